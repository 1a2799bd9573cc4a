"""Writing output files all or nothing, and checking an output location before any work is done.

``write_atomic(path, write)`` lets ``write(tmp)`` fill a temporary file beside ``path`` (same folder, unique
name), flushes it to disk, then renames it onto ``path``: readers see the old file or the new one, never half of
one, and any exception (KeyboardInterrupt included) removes the temporary file. The file gets the mode
``open(path, "w")`` would give it, ``0o666 & ~umask``, whatever the writer does (``mkstemp`` and safetensors
create 0600 files).
"""

from __future__ import annotations

import contextlib
import os
import secrets
import shutil
import stat
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


def write_all_atomic(files: dict[Path, Callable[[Path], object]]) -> None:
    """Write several files all or nothing: every ``write(tmp)`` first, then the renames in the given order (put
    the file readers look for first, e.g. a config, last). A failing write leaves every old file in place."""
    temps: dict[Path, Path] = {}
    try:
        for path, write in files.items():
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp, mode = _create_temporary(path)
            temps[path] = tmp
            write(tmp)
            os.chmod(tmp, mode)
            _fsync(tmp, os.O_RDWR)
        for path, tmp in temps.items():
            os.replace(tmp, path)
    finally:
        for tmp in temps.values():
            tmp.unlink(missing_ok=True)


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
    """Raise a FastdiffError now if a file (or, with ``folder``, files inside a folder) could not be written at
    ``path`` later: a part of the path is a file, the target has the wrong kind, or the folder that would hold it
    is not writable. Creates nothing."""
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
    if not os.access(existing, os.W_OK | os.X_OK):
        raise FastdiffError(f"{flag} {path}: cannot write in {existing} (permission denied)")
