"""Writing files so that an interrupted run never leaves a half-written one behind."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import stat
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any


def current_umask() -> int:
    """The process's umask (read by setting it and putting it back)."""
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def file_in_the_way(path: str | os.PathLike) -> Path | None:
    """The file standing where ``path`` or one of its parent folders should be (None: none).

    Walking up from ``path``, the first entry that exists is a folder unless a file blocks the
    way: a folder below a file cannot exist.
    """
    path = Path(path)
    existing = next((entry for entry in (path, *path.parents) if entry.exists()), None)
    return existing if existing is not None and not existing.is_dir() else None


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


def _carry_over(old: Path, staging: Path, keep: Callable[[str], bool]) -> None:
    """Copy the entries of ``old`` that the staged output lacks (and ``keep`` accepts) into it.

    Hard links where the file system allows (no second copy of large files), copies otherwise.
    """
    for entry in old.iterdir():
        destination = staging / entry.name
        if destination.exists() or destination.is_symlink() or not keep(entry.name):
            continue
        if entry.is_dir() and not entry.is_symlink():
            shutil.copytree(entry, destination, symlinks=True, copy_function=_link_or_copy)
        else:
            _link_or_copy(entry, destination)


def _link_or_copy(source: str | os.PathLike, destination: str | os.PathLike) -> None:
    if os.path.islink(source):
        os.symlink(os.readlink(source), destination)
        return
    try:
        os.link(source, destination)
    except OSError:
        shutil.copy2(source, destination)


@contextlib.contextmanager
def atomic_directory(path: str | os.PathLike, *, keep_existing: Callable[[str], bool] | None = None) -> Iterator[Path]:
    """Yield an empty staging folder beside ``path``; once the block succeeds it replaces ``path``.

    Every output folder of the package (saved checkpoints, adapters, merged models, training
    checkpoints, cached model copies) is written through this, so that a run that fails or is
    interrupted half way leaves ``path`` exactly as it was, and a new folder appears whole.

    ``keep_existing``: when ``path`` already exists, its entries that the block did not write and
    that ``keep_existing(name)`` accepts are carried into the new folder (for example a README
    the user wrote beside a checkpoint); the others (stale weight shards) go with the old folder.
    Files get the user's normal permissions (umask), not the 0600/0700 of mkstemp/mkdtemp.

    The swap renames the old folder aside, renames the new one into place, then deletes the old;
    if the second rename fails the old folder is put back. Folders created for ``path``'s parent
    are removed again on failure.
    """
    # The real folder: a symlinked target is written where the link points (renaming the link
    # aside would replace it by a folder), and "." or "~" name the folder the user means.
    target = Path(os.path.realpath(Path(path).expanduser()))
    if target.exists() and not target.is_dir():
        raise ValueError(f"{target} is a file, not a folder; choose a folder path (new or existing).")
    if Path.cwd() == target or target in Path.cwd().parents:
        raise ValueError(
            f"{target} is the current working folder or holds it; replacing it would pull the folder from under the "
            "running process. Choose a subfolder (e.g. ./checkpoint)."
        )
    created = [folder for folder in (target.parent, *target.parent.parents) if not folder.exists()]
    blocking = file_in_the_way(target.parent)
    if blocking is not None:
        raise ValueError(f"Cannot create {target}: {blocking} is a file, not a folder. Choose another path.")
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = staging_dir(target.parent, f".{target.name}.staging-")
    try:
        yield staging
        # Only what the block wrote gets the umask's permissions: carried-over entries are hard
        # links to the user's own files and keep their modes (a 0600 token stays 0600).
        give_umask_permissions(staging)
        if target.exists() and keep_existing is not None:
            _carry_over(target, staging, keep_existing)
        if not target.exists():
            os.replace(staging, target)
        else:
            aside = Path(tempfile.mkdtemp(prefix=f".{target.name}.old-", dir=target.parent))
            os.rmdir(aside)
            os.replace(target, aside)
            try:
                os.replace(staging, target)
            except BaseException:
                os.replace(aside, target)
                raise
            shutil.rmtree(aside, ignore_errors=True)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        for folder in created:  # deepest first
            with contextlib.suppress(OSError):
                folder.rmdir()
        raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
