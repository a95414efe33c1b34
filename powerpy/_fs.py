"""Small helpers shared by every layer: atomic writes, a file lock, byte sizes, huge-page
buffers.

This module imports only the standard library (no torch, numpy or powerpy), so the lowest layers
can use it.

    with atomic_write(path) as tmp:      # tmp: a fresh file beside ``path``
        torch.save(obj, tmp)             # on success tmp is fsynced and replaces ``path``

    with file_lock(cache / ".build.lock"):
        ...                              # one process at a time (POSIX flock)

    fmt_bytes(3 << 19)                   # '1.5 MiB'
    buf = huge_page_buffer(1 << 30)      # anonymous memory in 2 MiB pages where allowed
"""

from __future__ import annotations

import contextlib
import json
import mmap
import os
import secrets
from collections.abc import Iterator
from pathlib import Path
from typing import Any

__all__ = ["AtomicFile", "atomic_write", "file_lock", "fmt_bytes"]

_TEMP_SUFFIX = ".tmp"


class AtomicFile:
    """A temporary file beside ``path`` that either replaces ``path`` or disappears.

    The temp file is created empty (exclusively, with the usual umask permissions) in the same
    directory, named ``.<name>.<pid>.<random>.tmp`` so loaders that glob for ``<name>`` ignore
    it. Write it by name (``tmp``), then call ``commit()`` (fsync + ``os.replace``) or
    ``discard()``. ``atomic_write`` wraps this for ``with`` blocks; ``GGUFStreamWriter`` uses it
    directly because its writes span several calls.

    Attributes:
        path: the destination.
        tmp: the temporary file.
    """

    def __init__(self, path: str | os.PathLike[str]) -> None:
        """Create the temp file.

        Raises:
            FileNotFoundError: the destination's directory does not exist.
            OSError: the directory is not writable.
        """
        self.path = Path(path)
        while True:
            name = f".{self.path.name}.{os.getpid()}.{secrets.token_hex(4)}{_TEMP_SUFFIX}"
            tmp = self.path.with_name(name)
            try:
                fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
            except FileExistsError:  # pragma: no cover - 32 random bits collided
                continue
            os.close(fd)
            break
        self.tmp = tmp
        self.done = False

    def commit(self) -> Path:
        """Flush the temp file to disk and rename it over ``path``; returns ``path``.

        On any failure (including KeyboardInterrupt) the temp file is removed and the error
        re-raised; ``path`` then still holds its old content.
        """
        try:
            fd = os.open(self.tmp, os.O_RDWR)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
            os.replace(self.tmp, self.path)
        except BaseException:
            self.discard()
            raise
        self.done = True
        _fsync_dir(self.path.parent)
        return self.path

    def discard(self) -> None:
        """Remove the temp file (if still there); the destination is untouched."""
        self.done = True
        with contextlib.suppress(OSError):
            self.tmp.unlink()


def _fsync_dir(directory: Path) -> None:
    """Make a rename in ``directory`` durable (POSIX; best effort elsewhere)."""
    flags = os.O_RDONLY | getattr(os, "O_DIRECTORY", 0)
    try:
        fd = os.open(directory, flags)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


@contextlib.contextmanager
def atomic_write(path: str | os.PathLike[str]) -> Iterator[Path]:
    """Write ``path`` atomically: readers see the old file or the complete new one.

    Yields the path of an empty temp file in the same directory; write it (``write_text``,
    ``torch.save``, a compiler's ``-o``...). When the block ends normally the temp file is
    fsynced and replaces ``path`` (``os.replace``); when it raises anything, KeyboardInterrupt
    included, the temp file is removed and ``path`` is left as it was.

    Args:
        path: the destination; its directory must exist.

    Raises:
        FileNotFoundError: the directory does not exist.
    """
    target = AtomicFile(path)
    try:
        yield target.tmp
    except BaseException:
        target.discard()
        raise
    target.commit()


@contextlib.contextmanager
def file_lock(path: str | os.PathLike[str]) -> Iterator[None]:
    """Hold an exclusive advisory lock on ``path`` (created if missing) for the block.

    POSIX ``flock``: other processes (and other open file descriptions in this process) block
    until the holder leaves the block or dies. A no-op where ``fcntl`` is unavailable; callers
    keep their writes atomic so that only duplicate work, never a torn file, can result there.
    """
    try:
        import fcntl
    except ImportError:  # pragma: no cover - not POSIX
        yield
        return
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fd, fcntl.LOCK_UN)
    finally:
        os.close(fd)


def fmt_bytes(n: int) -> str:
    """A byte count for people: ``512 B``, ``8.0 KiB``, ``1.5 MiB``, ``2.00 GiB`` (binary units)."""
    if abs(n) >= 1 << 30:
        return f"{n / (1 << 30):.2f} GiB"
    if abs(n) >= 1 << 20:
        return f"{n / (1 << 20):.1f} MiB"
    if abs(n) >= 1 << 10:
        return f"{n / (1 << 10):.1f} KiB"
    return f"{n} B"


def read_json(path: str | os.PathLike[str]) -> dict[str, Any]:
    """A JSON object file, or {} when it does not exist.

    Raises:
        ValueError: the file is not valid JSON or not an object (the message names it).
    """
    path = Path(path)
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"{path}: not valid JSON ({e})") from None
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected a JSON object, found {type(data).__name__}")
    return data


def huge_page_buffer(size: int) -> mmap.mmap:
    """``size`` bytes of private anonymous memory advised for transparent huge pages (2 MiB
    pages where the kernel allows them: ``/sys/kernel/mm/transparent_hugepage/enabled`` is
    ``always`` or ``madvise``), zero-filled. Weights read into it, and buffers that measure the
    weights' read speed, see few TLB misses even when read row by row at random."""
    if hasattr(mmap, "MAP_ANONYMOUS"):  # private: shared anonymous memory is shmem, not THP
        buf = mmap.mmap(-1, max(size, 1), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    else:
        buf = mmap.mmap(-1, max(size, 1))
    if hasattr(mmap, "MADV_HUGEPAGE"):
        with contextlib.suppress(OSError):
            buf.madvise(mmap.MADV_HUGEPAGE)
    return buf


def release_free_heap() -> None:
    """Hand the C heap's free pages back to the system (glibc's ``malloc_trim``; nothing
    elsewhere): one-off work at load (a cut's column norms) leaves freed chunks below glibc's
    mmap threshold resident, tens of MB that the model never uses again."""
    import ctypes
    import ctypes.util

    name = ctypes.util.find_library("c")
    try:
        trim = ctypes.CDLL(name).malloc_trim if name else None
    except (OSError, AttributeError):
        trim = None
    if trim is not None:
        trim(0)
