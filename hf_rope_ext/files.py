"""Writing files so that an interrupted run never leaves a half-written one behind."""

from __future__ import annotations

import contextlib
import json
import os
import stat
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any


def current_umask() -> int:
    """The process's umask (read by setting it and putting it back)."""
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def staging_dir(parent: str | os.PathLike, prefix: str) -> Path:
    """A new empty folder in ``parent`` to build an output in before renaming it into place.

    ``tempfile.mkdtemp`` makes it 0700; it gets the mode a plain ``mkdir`` would give, so the
    renamed output is readable as the user's other files are.
    """
    folder = Path(tempfile.mkdtemp(prefix=prefix, dir=parent))
    os.chmod(folder, 0o777 & ~current_umask())
    return folder


def give_umask_permissions(folder: str | os.PathLike) -> None:
    """Give every file and folder under ``folder`` (itself included) the mode a plain ``open`` or
    ``mkdir`` would, before the folder is renamed into place: some writers (safetensors, mkstemp)
    create files readable by their owner only."""
    mask = current_umask()
    for root, folders, files in os.walk(folder):
        os.chmod(root, 0o777 & ~mask)
        for name in files:
            path = os.path.join(root, name)
            if not os.path.islink(path):
                os.chmod(path, 0o666 & ~mask)


@contextlib.contextmanager
def atomic_path(path: str | os.PathLike) -> Iterator[Path]:
    """Yield a temporary path beside ``path``; rename it over ``path`` once the block succeeds.

    On any error (Ctrl-C included) the temporary file is removed and ``path`` keeps its old
    content. The rename is atomic because both names are in the same folder.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    handle, temporary = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    os.close(handle)
    # mkstemp makes the file 0600; give it the mode a plain open() would (or the old file's).
    os.chmod(temporary, stat.S_IMODE(path.stat().st_mode) if path.is_file() else 0o666 & ~current_umask())
    try:
        yield Path(temporary)
        os.replace(temporary, path)
    finally:
        if os.path.exists(temporary):
            os.unlink(temporary)


def atomic_write_text(path: str | os.PathLike, text: str) -> None:
    with atomic_path(path) as temporary:
        with open(temporary, "w", encoding="utf-8") as file:
            file.write(text)
            file.flush()
            os.fsync(file.fileno())


def atomic_write_json(path: str | os.PathLike, data: Any) -> None:
    atomic_write_text(path, json.dumps(data, indent=2) + "\n")
