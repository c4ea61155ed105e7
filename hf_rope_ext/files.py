"""Writing files so that an interrupted run never leaves a half-written one behind."""

from __future__ import annotations

import contextlib
import errno
import glob
import json
import logging
import os
import shutil
import stat
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

try:
    import fcntl
except ImportError:  # Windows: abandoned temporary folders are recognised by their age only
    fcntl = None

logger = logging.getLogger(__name__)

# Temporary folders that atomic_directory makes inside an existing target: the new entries while
# they are written, and the entries they replace during the swap.
INNER_STAGING_PREFIX = ".hf_rope_ext.staging-"
INNER_ASIDE_PREFIX = ".hf_rope_ext.old-"
# In the aside folder: the names a swap moves out and in, so that a swap killed half way is undone
# by the next run (the aside folder may hold the only copy of the previous output).
SWAP_JOURNAL = ".hf_rope_ext.swap.json"
# A temporary folder that no running process holds (see folder_lock) is abandoned; one untouched for
# this long is taken as abandoned where locks are not available.
STALE_STAGING_SECONDS = 30 * 60
# A folder just made by mkdtemp is locked right after; younger ones are left alone.
_LOCK_GRACE_SECONDS = 2.0
_RANDOM_PART = 8  # characters tempfile adds to a prefix
# atomic_path's temporary files are ".NAME.hf_rope_ext-XXXXXXXX": a name no user file of the same
# folder has, so that a killed write's leftovers can be told from the user's own hidden files
TEMPORARY_MARK = ".hf_rope_ext-"


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


def hidden_prefix(folder: str | os.PathLike, name: str, suffix: str) -> str:
    """``.NAME<suffix>`` for a temporary entry beside ``name`` in ``folder``, with NAME cut short
    where the whole name (plus tempfile's random part) would exceed the file system's name limit:
    any name ``mkdir`` accepts can be written."""
    try:
        limit = os.pathconf(folder, "PC_NAME_MAX")
    except (OSError, ValueError, AttributeError):
        limit = 255
    room = limit - len(f".{suffix}".encode()) - _RANDOM_PART
    stem = name.encode()[: max(room, 0)].decode(errors="ignore")
    return f".{stem}{suffix}"


def _umask_mode(path: str | os.PathLike, mode: int) -> int:
    """``mode`` less the umask; a folder keeps its setgid bit (inherited from a group-shared parent)."""
    mode &= ~current_umask()
    if os.path.isdir(path) and not os.path.islink(path):
        mode |= os.stat(path).st_mode & stat.S_ISGID
    return mode


def staging_dir(parent: str | os.PathLike, prefix: str) -> Path:
    """A new empty folder in ``parent`` to build an output in before renaming it into place.

    ``tempfile.mkdtemp`` makes it 0700; it gets the mode a plain ``mkdir`` would give, so the
    renamed output is readable as the user's other files are.
    """
    folder = Path(tempfile.mkdtemp(prefix=prefix, dir=parent))
    os.chmod(folder, _umask_mode(folder, 0o777))
    return folder


def give_umask_permissions(folder: str | os.PathLike) -> None:
    """Give every file and folder under ``folder`` (itself included) the mode a plain ``open`` or
    ``mkdir`` would, before the folder is renamed into place: some writers (safetensors, mkstemp)
    create files readable by their owner only."""
    for root, folders, files in os.walk(folder):
        os.chmod(root, _umask_mode(root, 0o777))
        for name in files:
            path = os.path.join(root, name)
            if not os.path.islink(path):
                os.chmod(path, _umask_mode(path, 0o666))


@contextlib.contextmanager
def folder_lock(folder: Path, *, wait: bool = False) -> Iterator[None]:
    """Hold an advisory lock on ``folder`` while it is written, so that :func:`remove_abandoned`
    in another run tells it from one a killed run left (the kernel drops the lock of a dead
    process). ``wait``: wait for a run that holds it (else go on without it). No lock where the
    system or file system has none: there the grace period and ages alone separate runs."""
    handle = None
    if fcntl is not None:
        with contextlib.suppress(OSError):
            handle = os.open(folder, os.O_RDONLY)
            fcntl.flock(handle, fcntl.LOCK_EX if wait else fcntl.LOCK_EX | fcntl.LOCK_NB)
    try:
        yield
    finally:
        if handle is not None:
            os.close(handle)


def _abandoned(folder: Path) -> bool:
    """True for a temporary folder no running process is writing."""
    try:
        changed = folder.lstat().st_mtime  # an entry made or removed in it
        age = time.time() - max([changed, *(entry.lstat().st_mtime for entry in folder.iterdir())])
    except OSError:
        return False  # removed meanwhile, or not a folder
    if time.time() - changed < _LOCK_GRACE_SECONDS:
        return False
    if fcntl is not None:
        try:
            handle = os.open(folder, os.O_RDONLY)
        except OSError:
            return False
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return True
        except BlockingIOError:
            return False
        except OSError:
            pass  # no locks on this file system (some network mounts): go by age
        finally:
            os.close(handle)
    return age > STALE_STAGING_SECONDS


def remove_abandoned(target: str | os.PathLike, *, old_copies: bool = False) -> None:
    """Remove the temporary folders of :func:`atomic_directory` that runs killed while writing
    ``target`` left: ``.NAME.staging-*`` beside it and the ones inside it (``old_copies``: also
    ``.NAME.old-*`` beside it, where an older version swapped folders; without ``target`` that
    may be the only copy of the previous output). Folders other runs are writing are kept."""
    target = Path(target)
    # glob.escape: a name such as "ckpt[1]" must not match another target's folders
    patterns = [(target.parent, glob.escape(hidden_prefix(target.parent, target.name, ".staging-")) + "*")]
    if old_copies:
        patterns.append((target.parent, glob.escape(f".{target.name}.old-") + "*"))
    if target.is_dir() and not target.is_symlink():
        # the swaps first: undoing one needs only its aside folder
        patterns += [(target, glob.escape(INNER_ASIDE_PREFIX) + "*"), (target, glob.escape(INNER_STAGING_PREFIX) + "*")]
    for folder, pattern in patterns:
        if not folder.is_dir():
            continue
        for leftover in folder.glob(pattern):
            if leftover.is_dir() and not leftover.is_symlink() and _abandoned(leftover):
                if leftover.parent == target and leftover.name.startswith(INNER_ASIDE_PREFIX):
                    _undo_swap(target, leftover)
                logger.info("Removing %s, left by an interrupted save.", leftover)
                shutil.rmtree(leftover, ignore_errors=True)


def restore_interrupted_save(folder: str | os.PathLike) -> None:
    """Before ``folder`` is read: put back its files if a save into it was killed while it swapped
    them (see :func:`_swap_in`): such a folder holds neither version until then. A swap under way
    in another run is waited for (it holds its folder's lock for the few renames it takes);
    concurrent loads take turns, so one undo runs, once."""
    folder = Path(folder)
    if not folder.is_dir():
        return
    for aside in sorted(folder.glob(glob.escape(INNER_ASIDE_PREFIX) + "*")):
        if not aside.is_dir() or aside.is_symlink():
            continue
        try:
            young = time.time() - aside.lstat().st_mtime
            if young < _LOCK_GRACE_SECONDS:  # made a moment ago: its run may not have locked it yet
                time.sleep(_LOCK_GRACE_SECONDS - young)
            with folder_lock(aside, wait=True):
                if not (aside / SWAP_JOURNAL).is_file():
                    continue  # finished, undone by another load, or killed before it moved anything
                _undo_swap(folder, aside)
                os.unlink(aside / SWAP_JOURNAL)
                shutil.rmtree(aside)
        except FileNotFoundError:
            continue  # its run finished meanwhile and removed it
        except OSError as error:
            raise OSError(f"{folder}: a save was interrupted while it replaced the folder's files, and putting the "
                          f"previous ones back failed ({error.strerror or error}); they are in {aside}: move them "
                          f"back into {folder}.") from None  # fmt: skip


def _undo_swap(target: Path, aside: Path) -> None:
    """Put ``target`` back as it was before a :func:`_swap_in` that was killed half way: remove the
    new entries it had placed and move the old ones back from ``aside``, as its journal lists them."""
    try:
        journal = json.loads((aside / SWAP_JOURNAL).read_text())
        old, new = [str(name) for name in journal["old"]], [str(name) for name in journal["new"]]
    except (OSError, ValueError, KeyError, TypeError):
        return  # killed before the journal was written, so before anything was moved
    moved_out = {name for name in old if os.path.lexists(aside / name)}
    for name in new:
        placed = target / name
        # a name of the new output exists in target only once placed, unless its old entry is still there
        if os.path.lexists(placed) and (name not in old or name in moved_out):
            if placed.is_dir() and not placed.is_symlink():
                shutil.rmtree(placed)
            else:
                placed.unlink()
    for name in sorted(moved_out):
        os.replace(aside / name, target / name)
    logger.warning("%s: a save was interrupted while it replaced the folder's files; the previous files are back.", target)


def _remove_stale_temporaries(folder: Path, prefix: str) -> None:
    """Remove the temporary files of earlier :func:`atomic_path` writes of the same file that a
    killed run left (SIGKILL skips their clean-up): ``prefix`` (which holds :data:`TEMPORARY_MARK`)
    and tempfile's random part, older than :data:`STALE_STAGING_SECONDS` (the small files written
    this way take seconds)."""
    now = time.time()
    for leftover in folder.glob(glob.escape(prefix) + "?" * _RANDOM_PART):
        with contextlib.suppress(OSError):  # removed meanwhile, or not ours to remove
            if leftover.is_file() and not leftover.is_symlink() and now - leftover.lstat().st_mtime > STALE_STAGING_SECONDS:
                leftover.unlink()
                logger.info("Removed %s, left by an interrupted write.", leftover)


@contextlib.contextmanager
def atomic_path(path: str | os.PathLike) -> Iterator[Path]:
    """Yield a temporary path beside ``path``; rename it over ``path`` once the block succeeds.

    On any error (Ctrl-C included) the temporary file is removed and ``path`` keeps its old
    content. The rename is atomic because both names are in the same folder.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    prefix = hidden_prefix(path.parent, path.name, TEMPORARY_MARK)
    _remove_stale_temporaries(path.parent, prefix)
    handle, temporary = tempfile.mkstemp(prefix=prefix, dir=path.parent)
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


def _is_temporary(name: str) -> bool:
    return name.startswith((INNER_STAGING_PREFIX, INNER_ASIDE_PREFIX)) or name == SWAP_JOURNAL


def _swap_in(target: Path, staging: Path, keep: Callable[[str], bool] | None) -> None:
    """Replace the entries of the existing folder ``target`` by those of ``staging`` (inside it).

    The folder itself stays (its mode, owner, group and setgid bit; a mount point cannot be
    renamed anyway). The entries the new output replaces, and those ``keep`` does not accept, are
    first moved into a hidden folder inside ``target``, then the new entries are renamed in: all
    renames within one file system, so the swap takes no new space and, if a rename fails, is
    undone. Entries ``keep`` accepts are not touched.
    """
    new = sorted(os.listdir(staging))
    old = [name for name in sorted(os.listdir(target)) if not _is_temporary(name)
           and (name in new or keep is None or not keep(name))]  # fmt: skip
    aside = Path(tempfile.mkdtemp(prefix=INNER_ASIDE_PREFIX, dir=target))
    moved, placed = [], []
    with folder_lock(aside):
        try:
            # the journal first: a run killed during the renames is undone by the next one (_undo_swap)
            with open(aside / SWAP_JOURNAL, "w", encoding="utf-8") as journal:
                json.dump({"old": old, "new": new}, journal)
                journal.flush()
                os.fsync(journal.fileno())
            for name in old:
                os.replace(target / name, aside / name)
                moved.append(name)
            for name in new:
                os.replace(staging / name, target / name)
                placed.append(name)
        except BaseException:
            for name in reversed(placed):
                os.replace(target / name, staging / name)
            for name in reversed(moved):
                os.replace(aside / name, target / name)
            raise
        finally:
            # the journal first: a run killed while the folder below is removed has finished (or
            # undone) its swap, and a later load must not undo it again from what is left
            with contextlib.suppress(OSError):
                os.unlink(aside / SWAP_JOURNAL)
            shutil.rmtree(aside, ignore_errors=True)


@contextlib.contextmanager
def atomic_directory(path: str | os.PathLike, *, keep_existing: Callable[[str], bool] | None = None) -> Iterator[Path]:
    """Yield an empty staging folder; once the block succeeds its entries make up ``path``.

    Every output folder of the package (saved checkpoints, adapters, merged models, training
    checkpoints, cached model copies) is written through this, so that a run that fails or is
    interrupted half way leaves ``path`` exactly as it was, and a new folder appears whole.

    A new ``path`` is built in a hidden folder beside it (``.NAME.staging-*``) and renamed into
    place. An existing ``path`` keeps its own folder (mode, owner, group, setgid bit; it may be a
    mount point, which cannot be renamed): the output is built in a hidden folder inside it, and
    its entries replace the old ones by renames (:func:`_swap_in`).

    ``keep_existing``: when ``path`` already exists, its entries that the block did not write and
    that ``keep_existing(name)`` accepts stay (for example a README the user wrote beside a
    checkpoint); the others (stale weight shards) are removed. Without it, nothing old stays.
    What the block wrote gets the user's normal permissions (umask), not the 0600/0700 of
    mkstemp/mkdtemp. Folders created for ``path``'s parent are removed again on failure, and
    the temporary folders of earlier runs killed while writing ``path`` are removed
    (:func:`remove_abandoned`).
    """
    # The real folder: a symlinked target is written where the link points, and "." or "~" name
    # the folder the user means.
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
    if target.is_dir() and not os.access(target, os.W_OK | os.X_OK):
        raise PermissionError(f"{target} is not writable for you; make it writable (chmod u+w) or choose another folder.")
    target.parent.mkdir(parents=True, exist_ok=True)
    remove_abandoned(target)
    fill_in_place = target.is_dir()
    if fill_in_place:
        staging = staging_dir(target, INNER_STAGING_PREFIX)
    else:
        staging = staging_dir(target.parent, hidden_prefix(target.parent, target.name, ".staging-"))
    try:
        with folder_lock(staging):
            yield staging
            # Only what the block wrote gets the umask's permissions: the user's entries that stay
            # keep their modes (a 0600 token stays 0600).
            give_umask_permissions(staging)
            if fill_in_place:
                _swap_in(target, staging, keep_existing)
            else:
                _rename_new(staging, target)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        for folder in created:  # deepest first
            with contextlib.suppress(OSError):
                folder.rmdir()
        raise
    finally:
        if fill_in_place:
            shutil.rmtree(staging, ignore_errors=True)


def _rename_new(staging: Path, target: Path) -> None:
    """Rename ``staging`` to the new folder ``target``; refused in one line when another run
    created ``target`` meanwhile (the rename cannot replace a folder that has entries)."""
    try:
        os.replace(staging, target)
    except OSError as error:
        if error.errno not in (errno.ENOTEMPTY, errno.EEXIST) or not target.is_dir():
            raise
        raise FileExistsError(
            f"{target} was created by another run while this one wrote it; this run's output was discarded and the "
            "other's kept. Run again to write over it, or choose another folder."
        ) from None
