"""fastdiff.atomic: all-or-nothing writes with the umask's file mode, and the output-location check."""

from __future__ import annotations

import os
import stat

import pytest

from fastdiff.atomic import check_output_location, write_atomic, write_bytes_atomic, write_text_atomic
from fastdiff.errors import FastdiffError


def mode(path) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


def test_new_file_has_the_umask_mode(tmp_path, umask):
    path = write_text_atomic(tmp_path / "sub" / "a.json", "{}\n")
    assert path.read_text() == "{}\n"
    assert mode(path) == 0o666 & ~umask  # 0o644 under 022, 0o640 under 027 (mkstemp would give 0o600)
    assert os.listdir(tmp_path / "sub") == ["a.json"]


def test_replaces_an_existing_file_with_the_new_content(tmp_path, umask):
    path = tmp_path / "a.bin"
    path.write_bytes(b"old")
    os.chmod(path, 0o600)
    write_bytes_atomic(path, b"new")
    assert path.read_bytes() == b"new" and mode(path) == 0o666 & ~umask


def test_writer_that_reopens_the_file_by_name(tmp_path, umask):
    def write(tmp):
        with open(tmp, "wb") as f:  # as torch.save / PIL / savefig do
            f.write(b"by name")
        os.chmod(tmp, 0o600)  # as safetensors does

    path = write_atomic(tmp_path / "x.pt", write)
    assert path.read_bytes() == b"by name" and mode(path) == 0o666 & ~umask


@pytest.mark.parametrize("error", [OSError("disk full"), KeyboardInterrupt()], ids=["OSError", "KeyboardInterrupt"])
def test_failing_write_leaves_nothing_behind(tmp_path, error):
    (tmp_path / "kept.txt").write_text("old")
    seen = []

    def write(tmp):
        seen.append(tmp)
        tmp.write_bytes(b"half")
        raise error

    for name in ("new.txt", "kept.txt"):
        with pytest.raises(type(error)):
            write_atomic(tmp_path / name, write)
    assert [p.parent for p in seen] == [tmp_path, tmp_path] and seen[0] != seen[1]  # beside the target, unique
    assert os.listdir(tmp_path) == ["kept.txt"] and (tmp_path / "kept.txt").read_text() == "old"


def test_check_output_location(tmp_path):
    (tmp_path / "file").write_text("x")
    (tmp_path / "folder").mkdir()
    check_output_location(tmp_path / "new" / "deeper" / "grid.png", "--out")  # missing folders get created later
    check_output_location(tmp_path / "folder", "--save-dir", folder=True)
    cases = [
        (tmp_path / "file" / "grid.png", False, "is a file, not a folder"),
        (tmp_path / "file" / "a" / "b.png", False, "is a file, not a folder"),
        (tmp_path / "folder", False, "is a folder, not a file"),
        (tmp_path / "file", True, "is a file, not a folder"),
        (tmp_path / "file" / "images", True, "is a file, not a folder"),
    ]
    for path, folder, message in cases:
        with pytest.raises(FastdiffError, match=message):
            check_output_location(path, "--flag", folder=folder)
    assert sorted(os.listdir(tmp_path)) == ["file", "folder"]  # nothing created


@pytest.mark.skipif(os.geteuid() == 0, reason="root may write anywhere")
def test_check_output_location_in_a_read_only_folder(tmp_path):
    locked = tmp_path / "locked"
    locked.mkdir()
    locked.chmod(0o555)
    try:
        with pytest.raises(FastdiffError, match="permission denied"):
            check_output_location(locked / "grid.png", "--out")
        with pytest.raises(FastdiffError, match="permission denied"):
            check_output_location(locked / "images", "--save-dir", folder=True)
    finally:
        locked.chmod(0o755)


def test_write_folder_atomic_replaces_whole_and_respects_umask(tmp_path):
    import os

    from fastdiff.atomic import write_folder_atomic

    dest = tmp_path / "report"
    previous = os.umask(0o027)
    try:
        write_folder_atomic(dest, lambda d: (d / "a.txt").write_text("one"))
        assert (dest.stat().st_mode & 0o777) == 0o750
        write_folder_atomic(dest, lambda d: (d / "b.txt").write_text("two"))
    finally:
        os.umask(previous)
    assert sorted(p.name for p in dest.iterdir()) == ["b.txt"]

    def failing(d):
        (d / "c.txt").write_text("half")
        raise RuntimeError("disk full")

    with pytest.raises(RuntimeError):
        write_folder_atomic(dest, failing)
    assert sorted(p.name for p in dest.iterdir()) == ["b.txt"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["report"]  # no temporary folder left
