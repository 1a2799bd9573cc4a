"""fastdiff.atomic: all-or-nothing writes with the umask's file mode, and the output-location check."""

from __future__ import annotations

import os
import stat

import pytest

import fastdiff.atomic
from fastdiff.atomic import (
    AtomicOutputs,
    check_output_location,
    write_all_atomic,
    write_atomic,
    write_bytes_atomic,
    write_text_atomic,
)
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


@pytest.mark.parametrize("root", ["/proc", "/sys"])
def test_check_output_location_where_no_file_can_be_created(root):
    """/proc and /sys take no new files, for root neither (``os.access`` says yes to root there): the check
    proves it with a probe file, for a file output, a folder output and a missing folder below."""
    for path, folder in ((f"{root}/x.png", False), (f"{root}/images", True), (f"{root}/a/b/c.json", False)):
        with pytest.raises(FastdiffError) as info:
            check_output_location(path, "--flag", folder=folder)
        message = str(info.value)
        assert message.startswith(f"--flag {path}: cannot write in {root} (") and "\n" not in message, message


def test_check_output_location_probes_with_data(tmp_path, monkeypatch):
    """A full disk may still take a file name: the probe writes a byte, and leaves nothing behind."""
    check_output_location(tmp_path / "a.png", "--out")
    assert os.listdir(tmp_path) == []

    def full(fd, data):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(fastdiff.atomic.os, "write", full)
    with pytest.raises(FastdiffError, match=r"--out .*a.png: cannot write in .* \(no space left on device\)"):
        check_output_location(tmp_path / "a.png", "--out")
    assert os.listdir(tmp_path) == []


def test_atomic_outputs_commit_all_at_once(tmp_path, umask):
    (tmp_path / "old.txt").write_text("old")
    with AtomicOutputs() as outputs:
        outputs.add(tmp_path / "new" / "deep" / "a.txt", lambda tmp: tmp.write_text("a"))
        outputs.add(tmp_path / "old.txt", lambda tmp: tmp.write_text("b"))
        assert not (tmp_path / "new" / "deep" / "a.txt").exists()
        assert (tmp_path / "old.txt").read_text() == "old"  # nothing visible before the commit
    assert (tmp_path / "new" / "deep" / "a.txt").read_text() == "a" and (tmp_path / "old.txt").read_text() == "b"
    assert mode(tmp_path / "old.txt") == 0o666 & ~umask
    assert sorted(os.listdir(tmp_path)) == ["new", "old.txt"] and os.listdir(tmp_path / "new" / "deep") == ["a.txt"]


@pytest.mark.parametrize("error", [OSError("disk full"), KeyboardInterrupt()], ids=["OSError", "KeyboardInterrupt"])
def test_atomic_outputs_failing_write_leaves_nothing(tmp_path, error):
    (tmp_path / "kept.txt").write_text("old")

    def fail(tmp):
        tmp.write_text("half")
        raise error

    with pytest.raises(type(error)), AtomicOutputs() as outputs:
        outputs.add(tmp_path / "kept.txt", lambda tmp: tmp.write_text("new"))
        outputs.add(tmp_path / "made" / "b.txt", fail)
    assert os.listdir(tmp_path) == ["kept.txt"] and (tmp_path / "kept.txt").read_text() == "old"


def test_atomic_outputs_failing_rename_undoes_the_earlier_ones(tmp_path, monkeypatch):
    """The third rename fails: the first (a new file) is removed, the second (a replaced file) put back, the
    folder made for them removed, no temporary or backup file left."""
    out = tmp_path / "out"
    out.mkdir()
    (out / "b.txt").write_text("old b")
    real_replace = os.replace
    calls = []

    def replace(src, dst):
        calls.append(dst)
        if len(calls) == 3:
            raise OSError(28, "No space left on device", str(dst))
        return real_replace(src, dst)

    monkeypatch.setattr(fastdiff.atomic.os, "replace", replace)
    with pytest.raises(OSError, match="No space left"), AtomicOutputs() as outputs:
        outputs.add(out / "each" / "a.txt", lambda tmp: tmp.write_text("new a"))
        outputs.add(out / "b.txt", lambda tmp: tmp.write_text("new b"))
        outputs.add(out / "c.txt", lambda tmp: tmp.write_text("new c"))
    assert os.listdir(out) == ["b.txt"] and (out / "b.txt").read_text() == "old b"
    assert os.listdir(tmp_path) == ["out"]


def test_write_all_atomic_is_all_or_nothing_at_the_renames_too(tmp_path):
    (tmp_path / "config.json").mkdir()  # the last rename cannot replace a folder
    with pytest.raises(OSError):
        write_all_atomic({tmp_path / "weights.bin": lambda t: t.write_bytes(b"w"), tmp_path / "config.json": str})
    assert os.listdir(tmp_path) == ["config.json"]
