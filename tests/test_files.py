import os, pytest
from hf_rope_ext.files import atomic_directory

def test_new_folder_appears_whole(tmp_path):
    target = tmp_path / "a" / "b" / "out"
    with atomic_directory(target) as staging:
        (staging / "x.txt").write_text("1")
        assert not target.exists()
    assert (target / "x.txt").read_text() == "1"
    assert sorted(p.name for p in target.parent.iterdir()) == ["out"]

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
