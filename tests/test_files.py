import errno
import os
import signal
import stat
import time
from pathlib import Path

import pytest

from hf_rope_ext.files import atomic_directory, atomic_path

def test_new_folder_appears_whole(tmp_path):
    target = tmp_path / "a" / "b" / "out"
    with atomic_directory(target) as staging:
        (staging / "x.txt").write_text("1")
        assert not target.exists()
    assert (target / "x.txt").read_text() == "1"
    assert sorted(p.name for p in target.parent.iterdir()) == ["out"]

def test_a_new_folder_another_run_created_meanwhile_is_refused_in_one_line(tmp_path):
    """Two runs writing one new folder: the later rename is refused naming the cause (it was a
    bare "Directory not empty"), the first run's folder stays and no staging folder is left."""
    target = tmp_path / "out"
    with pytest.raises(FileExistsError, match="out was created by another run while this one wrote it"):
        with atomic_directory(target) as staging:
            (staging / "x.txt").write_text("mine")
            target.mkdir()  # the other run's rename
            (target / "x.txt").write_text("theirs")
    assert (target / "x.txt").read_text() == "theirs"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]

def test_failure_leaves_existing_folder_and_removes_created_parents(tmp_path):
    old = tmp_path / "out"; old.mkdir(); (old / "keep.txt").write_text("old")
    with pytest.raises(RuntimeError):
        with atomic_directory(old) as staging:
            (staging / "keep.txt").write_text("new")
            raise RuntimeError("boom")
    assert (old / "keep.txt").read_text() == "old"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]
    target = tmp_path / "new" / "deep" / "out"
    with pytest.raises(KeyboardInterrupt):
        with atomic_directory(target):
            raise KeyboardInterrupt
    assert not (tmp_path / "new").exists()

def test_replace_carries_only_accepted_entries(tmp_path):
    old = tmp_path / "out"; old.mkdir()
    (old / "README.md").write_text("mine"); (old / "model-00001-of-00002.safetensors").write_text("stale")
    (old / "config.json").write_text("old")
    with atomic_directory(old, keep_existing=lambda name: not name.startswith("model-")) as staging:
        (staging / "config.json").write_text("new")
    assert sorted(p.name for p in old.iterdir()) == ["README.md", "config.json"]
    assert (old / "config.json").read_text() == "new" and (old / "README.md").read_text() == "mine"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]

def test_permissions_follow_umask(tmp_path):
    mask = os.umask(0o022)
    try:
        with atomic_directory(tmp_path / "out") as staging:
            (staging / "f").write_text("x"); os.chmod(staging / "f", 0o600)
        assert (tmp_path / "out").stat().st_mode & 0o777 == 0o755
        assert (tmp_path / "out" / "f").stat().st_mode & 0o777 == 0o644
    finally:
        os.umask(mask)

def test_file_target_refused(tmp_path):
    (tmp_path / "f").write_text("x")
    with pytest.raises(ValueError, match="is a file"):
        with atomic_directory(tmp_path / "f"):
            pass


# ----------------------------------------------------------------------------------------------
# An existing folder is filled in place; leftovers of killed runs; long names
# ----------------------------------------------------------------------------------------------

def test_existing_folder_is_filled_in_place_keeping_its_mode_setgid_and_mount(tmp_path, monkeypatch):
    """A mount point (a Docker volume) cannot be renamed, and a private (0700) or group-shared
    (setgid) folder must stay what its owner made it: the folder itself is never replaced."""
    target = tmp_path / "out"
    target.mkdir()
    os.chmod(target, 0o2700)
    (target / "old-shard.bin").write_text("old")
    (target / "notes.txt").write_text("mine")
    os.chmod(target / "notes.txt", 0o600)
    inode = target.stat().st_ino
    real_replace = os.replace

    def replace_unless_mount_point(source, destination):
        if Path(source) == target or Path(destination) == target:
            raise OSError(errno.EBUSY, "Device or resource busy", str(source))
        return real_replace(source, destination)

    monkeypatch.setattr(os, "replace", replace_unless_mount_point)
    with atomic_directory(target, keep_existing=lambda name: name == "notes.txt") as staging:
        (staging / "config.json").write_text("new")
        (staging / "sub").mkdir()
        (staging / "sub" / "f").write_text("x")
        assert sorted(os.listdir(target)) == sorted(["old-shard.bin", "notes.txt", staging.name])  # not yet swapped
    assert target.stat().st_ino == inode and stat.S_IMODE(target.stat().st_mode) == 0o2700
    assert sorted(os.listdir(target)) == ["config.json", "notes.txt", "sub"]
    assert stat.S_IMODE((target / "notes.txt").stat().st_mode) == 0o600
    assert (target / "sub").stat().st_mode & stat.S_ISGID  # a new subfolder keeps the group-shared setgid bit
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]


def test_swap_failing_half_way_puts_the_old_entries_back(tmp_path, monkeypatch):
    target = tmp_path / "out"
    target.mkdir()
    before = {"a.bin": "old a", "b.bin": "old b", "config.json": "old config", "README.md": "mine"}
    for name, text in before.items():
        (target / name).write_text(text)
    real_replace, calls = os.replace, []

    def fail_on_the_fifth(source, destination):
        calls.append(source)
        if len(calls) == 5:  # the old entries are aside, one new entry is in place
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_replace(source, destination)

    monkeypatch.setattr(os, "replace", fail_on_the_fifth)
    with pytest.raises(OSError, match="No space left"):
        with atomic_directory(target, keep_existing=lambda name: name == "README.md") as staging:
            for name in ("a.bin", "c.bin", "config.json"):
                (staging / name).write_text("new")
    assert len(calls) > 5  # the failed swap was undone by renames back
    assert {path.name: path.read_text() for path in target.iterdir()} == before  # nothing hidden left either


def test_leftovers_of_killed_runs_are_removed_and_running_ones_kept(tmp_path):
    """A run killed (SIGKILL, the OOM killer) while writing a new folder leaves ``.NAME.staging-*``
    beside it, one killed while filling an existing folder leaves a hidden folder inside it; the
    next write of the same folder removes both, but not the folder of a run still writing."""
    import fcntl

    def killed_while_writing(target):
        pid = os.fork()
        if pid == 0:  # the child: killed half way through the block
            try:
                with atomic_directory(target) as staging:
                    (staging / "model.safetensors").write_bytes(b"0" * 4096)
                    os.kill(os.getpid(), signal.SIGKILL)
            finally:
                os._exit(1)
        assert os.waitpid(pid, 0)[1] == signal.SIGKILL

    new, existing = tmp_path / "new", tmp_path / "existing"
    existing.mkdir()
    (existing / "config.json").write_text("kept")
    for target in (new, existing):
        killed_while_writing(target)
    assert not new.exists() and sorted(os.listdir(existing))[1:] == ["config.json"]
    leftovers = [*tmp_path.glob(".new.staging-*"), *existing.glob(".*")]
    assert len(leftovers) == 2
    running = tmp_path / ".new.staging-running"  # another process is writing this one
    running.mkdir()
    handle = os.open(running, os.O_RDONLY)
    fcntl.flock(handle, fcntl.LOCK_EX)
    past = time.time() - 60  # the locks are what tells them apart, not the age
    for folder in (*leftovers, running):
        os.utime(folder, (past, past))
    try:
        for target in (new, existing):
            with atomic_directory(target, keep_existing=lambda name: True) as staging:
                (staging / "model.safetensors").write_text("done")
    finally:
        os.close(handle)
    assert sorted(os.listdir(tmp_path)) == [".new.staging-running", "existing", "new"]
    assert sorted(os.listdir(existing)) == ["config.json", "model.safetensors"]


@pytest.mark.parametrize("killed_at", range(1, 7))
def test_a_swap_killed_half_way_is_undone_by_the_next_run(tmp_path, monkeypatch, killed_at):
    """A run killed (SIGKILL) between the renames of an existing folder's swap leaves the old
    entries in a hidden folder inside it, possibly the only copy: the next run puts them back,
    so that run failing too leaves the previous output, and succeeding leaves its own."""
    from hf_rope_ext import files

    target = tmp_path / "out"
    target.mkdir()
    before = {"a.bin": "old a", "b.bin": "old b", "config.json": "old config", "README.md": "mine"}
    for name, text in before.items():
        (target / name).write_text(text)
    keep_readme = lambda name: name == "README.md"  # noqa: E731
    pid = os.fork()
    if pid == 0:  # the child: killed at its killed_at-th rename (3 moves aside, then 3 into place)
        try:
            calls, real_replace = [], os.replace

            def killed(source, destination):
                calls.append(source)
                if len(calls) == killed_at:
                    os.kill(os.getpid(), signal.SIGKILL)
                return real_replace(source, destination)

            os.replace = killed
            with atomic_directory(target, keep_existing=keep_readme) as staging:
                for name in ("a.bin", "c.bin", "config.json"):
                    (staging / name).write_text("new")
        finally:
            os._exit(1)
    assert os.waitpid(pid, 0)[1] == signal.SIGKILL
    monkeypatch.setattr(files, "_LOCK_GRACE_SECONDS", 0.0)  # the folders were made just now
    with pytest.raises(RuntimeError, match="half way"):
        with atomic_directory(target, keep_existing=keep_readme) as staging:
            (staging / "a.bin").write_text("newer")
            raise RuntimeError("failed half way")
    assert {path.name: path.read_text() for path in target.iterdir()} == before
    with atomic_directory(target, keep_existing=keep_readme) as staging:
        (staging / "a.bin").write_text("newest")
    assert {path.name: path.read_text() for path in target.iterdir()} == {"a.bin": "newest", "README.md": "mine"}


def test_leftovers_of_another_target_whose_name_globs_alike_are_kept(tmp_path, monkeypatch):
    """``ckpt[1]`` is not a pattern for ``ckpt1``: each target removes only its own leftovers."""
    from hf_rope_ext import files

    monkeypatch.setattr(files, "_LOCK_GRACE_SECONDS", 0.0)
    other = tmp_path / ".ckpt1.staging-abandoned"
    mine = tmp_path / ".ckpt[1].staging-abandoned"
    other.mkdir()
    mine.mkdir()
    with atomic_directory(tmp_path / "ckpt[1]") as staging:
        (staging / "config.json").write_text("{}")
    assert other.is_dir() and not mine.exists()


@pytest.mark.parametrize("length", [240, 255])
def test_names_up_to_the_file_system_limit_can_be_written(tmp_path, length):
    name = "b" * (length - 2) + "é"  # 2 bytes: a cut must not split it
    with atomic_directory(tmp_path / name) as staging:
        (staging / "x").write_text("1")
    with atomic_path(tmp_path / name / name) as temporary:
        temporary.write_text("2")
    assert (tmp_path / name / "x").read_text() == "1" and (tmp_path / name / name).read_text() == "2"
    assert os.listdir(tmp_path) == [name]


def test_atomic_path_removes_what_a_killed_write_of_the_same_file_left(tmp_path):
    """SIGKILL skips atomic_path's clean-up: the next write of the same file removes the temporary
    file it left once it is older than any write takes; a fresh one (a write running now), another
    file's, and a file of the user's with a similar name stay."""
    from hf_rope_ext import files

    target = tmp_path / "report.png"
    stale, fresh = tmp_path / ".report.png.hf_rope_ext-abcd1234", tmp_path / ".report.png.hf_rope_ext-wxyz9876"
    others = [tmp_path / ".summary.json.hf_rope_ext-abcd1234", tmp_path / ".report.png.original",
              tmp_path / ".report.png.20261101", tmp_path / ".report.png.backup-of-mine"]  # the user's own
    for path in (stale, fresh, *others):
        path.write_text("left")
    past = time.time() - files.STALE_STAGING_SECONDS - 60
    for path in (stale, *others):
        os.utime(path, (past, past))
    with atomic_path(target) as temporary:
        temporary.write_text("new")
    assert target.read_text() == "new"
    assert not stale.exists() and fresh.exists() and all(path.exists() for path in others)
