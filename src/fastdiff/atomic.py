"""Writing output files all or nothing, and checking an output location before any work is done.

``write_atomic(path, write)`` lets ``write(tmp)`` fill a temporary file beside ``path`` (same folder, unique
name), flushes it to disk, then renames it onto ``path``: readers see the old file or the new one, never half of
one, and any exception (KeyboardInterrupt included) removes the temporary file. The file gets the mode
``open(path, "w")`` would give it, ``0o666 & ~umask``, whatever the writer does (``mkstemp`` and safetensors
create 0600 files). ``AtomicOutputs`` does the same for several files as one unit (a command's outputs),
``write_folder_atomic`` for a whole folder; ``write_temporary``, ``flush_to_disk``, ``publish`` and
``fsync_folder`` write a batch of files with one flush to disk (``fastdiff generate``).

``check_output_location`` proves, before a command does any work, that it can create files where its outputs go:
it creates, writes and removes a temporary file there, so /proc, /sys, read-only mounts and full disks fail up
front, for root too (``os.access`` says yes to root everywhere).
"""

from __future__ import annotations

import contextlib
import os
import secrets
import shutil
import stat
import sys
from collections.abc import Callable
from pathlib import Path

from fastdiff.errors import FastdiffError

_CREATE_FLAGS = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0)


def _create_temporary(path: Path) -> tuple[Path, int]:
    """A new empty file ``.NAME.RANDOM.tmp`` beside ``path`` and its mode: 0o666 less the umask, as the OS applied
    it (no need to read the process-wide umask)."""
    while True:
        tmp = path.with_name(f".{path.name}.{secrets.token_hex(6)}.tmp")
        try:
            fd = os.open(tmp, _CREATE_FLAGS, 0o666)
        except FileExistsError:
            continue
        try:
            return tmp, stat.S_IMODE(os.fstat(fd).st_mode)
        finally:
            os.close(fd)


def write_temporary(path: Path, data: bytes) -> Path:
    """``data`` in a new file ``.NAME.RANDOM.tmp`` beside ``path`` (mode 0o666 less the umask), not yet flushed to
    disk; returns its path. For many files written as one batch: :func:`flush_to_disk` them together, then
    :func:`publish` each and :func:`fsync_folder` once (a killed writer may leave temporary files behind)."""
    while True:
        tmp = path.with_name(f".{path.name}.{secrets.token_hex(6)}.tmp")
        try:
            fd = os.open(tmp, _CREATE_FLAGS, 0o666)
            break
        except FileExistsError:
            continue
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return tmp


def publish(tmp: Path, path: Path) -> None:
    """Give a flushed temporary file its name (atomic: the name shows the whole file or nothing)."""
    os.replace(tmp, path)


def _load_syncfs() -> Callable[[int], int] | None:
    if not sys.platform.startswith("linux"):
        return None
    try:
        import ctypes

        return ctypes.CDLL(None, use_errno=True).syncfs
    except (OSError, AttributeError):
        return None


SYNCFS = _load_syncfs()
"""Linux's ``syncfs(fd)``: writes back every dirty file of one filesystem and commits its journal once."""


def flush_to_disk(folder_fd: int, files: list[Path]) -> None:
    """Make the data of ``files`` (in the folder open as ``folder_fd``) durable: one ``syncfs`` of the folder's
    filesystem for several files (Linux), else one ``fsync`` each."""
    if len(files) > 1 and SYNCFS is not None and SYNCFS(folder_fd) == 0:
        return
    for file in files:
        _fsync(file, os.O_RDONLY)


def fsync_folder(folder_fd: int) -> None:
    """Make the renames in a folder durable (POSIX; a no-op where folders cannot be fsynced)."""
    with contextlib.suppress(OSError):
        os.fsync(folder_fd)


def _fsync(path: Path, flags: int) -> None:
    fd = os.open(path, flags)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_atomic(path: str | os.PathLike[str], write: Callable[[Path], object]) -> Path:
    """Create ``path`` (and missing parent folders) from ``write(tmp)``, which writes the content to ``tmp``.

    ``write`` may reopen ``tmp`` by name (``torch.save``, ``PIL.Image.save``, ``Figure.savefig``, safetensors);
    the file gets the mode it was created with even if ``write`` replaced it. Returns ``path``.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp, mode = _create_temporary(path)
    try:
        write(tmp)
        os.chmod(tmp, mode)
        _fsync(tmp, os.O_RDWR)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    if hasattr(os, "O_DIRECTORY"):  # make the rename itself durable (POSIX)
        with contextlib.suppress(OSError):
            _fsync(path.parent, os.O_RDONLY | os.O_DIRECTORY)
    return path


class AtomicOutputs:
    """Several output files written as one unit: all of them, or none.

    ``add(path, write)`` has ``write(tmp)`` fill a temporary file beside ``path`` at once (creating missing
    folders); ``commit()`` renames every staged file onto its path, in the order added (add the file readers look
    for first, e.g. a config, last). If a rename fails, the ones before it are undone: a file that was replaced is
    put back, a new one removed. A failing ``write``, ``discard()`` or leaving the ``with`` block by an exception
    (KeyboardInterrupt included) removes every temporary file, and the folders created for them while they are
    empty. On success the ``with`` block commits. Each file gets the mode ``open(path, "w")`` would give it.
    """

    def __init__(self) -> None:
        self._staged: list[tuple[Path, Path]] = []  # (path, temporary file)
        self._created: list[Path] = []  # folders made for the outputs, outermost first
        self._done = False

    def __enter__(self) -> AtomicOutputs:
        return self

    def __exit__(self, exc_type: object, exc: object, tb: object) -> None:
        if exc_type is None:
            self.commit()
        else:
            self.discard()

    def add(self, path: str | os.PathLike[str], write: Callable[[Path], object]) -> Path:
        """Stage ``path``: ``write(tmp)`` fills its temporary file now (see ``write_atomic``). Returns ``path``."""
        if self._done:
            raise RuntimeError("AtomicOutputs: add after commit or discard")
        path = Path(path)
        try:
            self._make_folder(path.parent)
            tmp, mode = _create_temporary(path)
            self._staged.append((path, tmp))
            write(tmp)
            os.chmod(tmp, mode)
            _fsync(tmp, os.O_RDWR)
        except BaseException:
            self.discard()
            raise
        return path

    def commit(self) -> None:
        """Rename every staged file into place, or, if one rename fails, none (the earlier ones are undone)."""
        if self._done:
            return
        done: list[tuple[Path, Path | None]] = []  # (path, the file it replaced, kept under another name)
        try:
            for path, tmp in self._staged:
                backup = _keep_old(path)
                try:
                    os.replace(tmp, path)
                except BaseException:
                    if backup is not None:
                        backup.unlink(missing_ok=True)
                    raise
                done.append((path, backup))
        except BaseException:
            for path, backup in reversed(done):
                with contextlib.suppress(OSError):
                    if backup is not None:
                        os.replace(backup, path)
                    else:
                        path.unlink(missing_ok=True)
            self.discard()
            raise
        self._done = True
        for _, backup in done:
            if backup is not None:
                backup.unlink(missing_ok=True)
        if hasattr(os, "O_DIRECTORY"):  # make the renames themselves durable (POSIX)
            for folder in dict.fromkeys(path.parent for path, _ in done):
                with contextlib.suppress(OSError):
                    _fsync(folder, os.O_RDONLY | os.O_DIRECTORY)

    def discard(self) -> None:
        """Remove the staged files and the (empty) folders made for them; nothing committed is touched."""
        self._done = True
        for _, tmp in self._staged:
            with contextlib.suppress(OSError):
                tmp.unlink(missing_ok=True)
        for folder in reversed(self._created):
            with contextlib.suppress(OSError):
                folder.rmdir()  # only while empty

    def _make_folder(self, folder: Path) -> None:
        missing = []
        while not folder.exists() and folder.parent != folder:
            missing.append(folder)
            folder = folder.parent
        for new in reversed(missing):
            new.mkdir(exist_ok=True)
            self._created.append(new)


def _keep_old(path: Path) -> Path | None:
    """A second name for the file (or symbolic link) at ``path``, a hard link or else a copy, so that a commit can
    put it back; None where there is none (or a folder, which the rename will refuse)."""
    if not (path.is_symlink() or path.is_file()):
        return None
    while True:
        backup = path.with_name(f".{path.name}.{secrets.token_hex(6)}.old")
        try:
            os.link(path, backup, follow_symlinks=False)
            return backup
        except FileExistsError:
            continue
        except OSError:  # no hard links here
            shutil.copy2(path, backup, follow_symlinks=False)
            return backup


def write_all_atomic(files: dict[Path, Callable[[Path], object]]) -> None:
    """Write several files all or nothing (``AtomicOutputs``): every ``write(tmp)`` first, then the renames in the
    given order (put the file readers look for first, e.g. a config, last). A failing write or rename leaves
    every old file in place."""
    with AtomicOutputs() as outputs:
        for path, write in files.items():
            outputs.add(path, write)


def write_folder_atomic(path: str | os.PathLike[str], fill: Callable[[Path], object]) -> Path:
    """Create or replace the folder ``path`` with what ``fill(tmp)`` writes into a new folder beside it: readers see
    the old folder or the complete new one. The folder gets the mode ``mkdir`` gives (0o777 less the umask); an
    old ``path`` is moved aside, replaced, then removed; any exception removes the new folder and keeps the old."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    while True:
        tmp = path.with_name(f".{path.name}.{secrets.token_hex(6)}.tmp")
        try:
            tmp.mkdir(mode=0o777)
            break
        except FileExistsError:
            continue
    try:
        fill(tmp)
        if path.exists():
            old = tmp.with_suffix(".old")
            path.rename(old)
            try:
                tmp.rename(path)
            except BaseException:
                old.rename(path)
                raise
            shutil.rmtree(old, ignore_errors=True)
        else:
            tmp.rename(path)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return path


def write_bytes_atomic(path: str | os.PathLike[str], data: bytes) -> Path:
    """Write ``data`` to ``path`` all or nothing (see :func:`write_atomic`)."""
    return write_atomic(path, lambda tmp: tmp.write_bytes(data))


def write_text_atomic(path: str | os.PathLike[str], text: str) -> Path:
    """Write ``text`` (UTF-8) to ``path`` all or nothing (see :func:`write_atomic`)."""
    return write_atomic(path, lambda tmp: tmp.write_text(text, encoding="utf-8"))


def check_output_location(path: str | os.PathLike[str], flag: str, folder: bool = False) -> None:
    """Raise a one-line FastdiffError now if a file (or, with ``folder``, files inside a folder) could not be
    written at ``path`` later: a part of the path is a file, the target has the wrong kind, or no file can be
    created in the folder that would hold it (``folder``: ``path`` itself if it exists, else its parent), or in
    the nearest existing folder above a missing one. That is proven by creating, writing one byte to and removing
    a temporary file there, so it holds for root too (/proc, /sys, read-only mounts, a full disk). Leaves nothing
    behind."""
    path = Path(path)
    if path.exists():
        if folder and not path.is_dir():
            raise FastdiffError(f"{flag} {path} is a file, not a folder")
        if not folder and path.is_dir():
            raise FastdiffError(f"{flag} {path} is a folder, not a file")
    holder = path if folder else path.parent
    existing = holder
    while not existing.exists():  # the nearest existing folder is where the missing ones would be created
        if existing.parent == existing:
            break
        existing = existing.parent
    if existing.exists() and not existing.is_dir():
        raise FastdiffError(f"{flag} {path}: {existing} is a file, not a folder")
    try:
        _probe(existing)
    except OSError as exc:
        reason = (exc.strerror or str(exc)).lower()
        raise FastdiffError(f"{flag} {path}: cannot write in {existing} ({reason})") from None


def _probe(folder: Path) -> None:
    """Create a temporary file in ``folder``, write one byte (a full disk may take a name, not data), remove it."""
    while True:
        tmp = folder / f".fastdiff-probe.{secrets.token_hex(6)}.tmp"
        try:
            fd = os.open(tmp, _CREATE_FLAGS, 0o600)
            break
        except FileExistsError:
            continue
    try:
        try:
            os.write(fd, b"\0")
        finally:
            os.close(fd)
    finally:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
