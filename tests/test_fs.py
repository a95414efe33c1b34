"""powerpy._fs: atomic writes, the advisory file lock and the byte formatter."""

from __future__ import annotations

import ast
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from powerpy import _fs
from powerpy._fs import AtomicFile, atomic_write, file_lock, fmt_bytes

REPO = Path(__file__).resolve().parents[1]


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


# --- atomic_write --------------------------------------------------------------------------------
def test_atomic_write_replaces_the_file(tmp_path):
    path = tmp_path / "a.json"
    path.write_text("old")
    with atomic_write(path) as tmp:
        assert tmp.parent == tmp_path and tmp.name.startswith(".a.json.") and tmp.is_file()
        assert tmp.read_bytes() == b""  # a fresh, empty file
        assert path.read_text() == "old"  # untouched until the block ends
        tmp.write_text("new")
    assert path.read_text() == "new"
    assert [p.name for p in tmp_path.iterdir()] == ["a.json"]
    assert path.stat().st_mode & 0o777 == 0o666 & ~_umask()  # usual permissions, not 0600


def test_atomic_write_creates_a_new_file(tmp_path):
    with atomic_write(tmp_path / "new.bin") as tmp:
        tmp.write_bytes(b"\x00\x01")
    assert (tmp_path / "new.bin").read_bytes() == b"\x00\x01"
    assert [p.name for p in tmp_path.iterdir()] == ["new.bin"]


@pytest.mark.parametrize("exc", [ValueError("bad value"), KeyboardInterrupt()])
def test_atomic_write_failure_keeps_the_old_file(tmp_path, exc):
    path = tmp_path / "m.gguf"
    path.write_bytes(b"old content")
    with pytest.raises(type(exc)):
        with atomic_write(path) as tmp:
            tmp.write_bytes(b"half written")
            raise exc
    assert path.read_bytes() == b"old content"
    assert [p.name for p in tmp_path.iterdir()] == ["m.gguf"]  # no temp file left


def test_atomic_write_failing_replace_removes_the_temp_file(tmp_path, monkeypatch):
    path = tmp_path / "x.pt"
    path.write_bytes(b"old")

    def fail(*args):
        raise OSError("disk full")

    monkeypatch.setattr(_fs.os, "replace", fail)
    with pytest.raises(OSError, match="disk full"), atomic_write(path) as tmp:
        tmp.write_bytes(b"new")
    assert path.read_bytes() == b"old"
    assert [p.name for p in tmp_path.iterdir()] == ["x.pt"]


def test_atomic_write_needs_the_directory(tmp_path):
    with pytest.raises(FileNotFoundError), atomic_write(tmp_path / "no" / "x.json"):
        pass


def test_atomic_file_commit_and_discard(tmp_path):
    a = AtomicFile(tmp_path / "a")
    b = AtomicFile(tmp_path / "a")
    assert a.tmp != b.tmp and a.tmp.is_file() and b.tmp.is_file()
    a.tmp.write_text("A")
    assert a.commit() == tmp_path / "a"
    b.discard()
    b.discard()  # idempotent
    assert (tmp_path / "a").read_text() == "A"
    assert [p.name for p in tmp_path.iterdir()] == ["a"]


# --- file_lock -----------------------------------------------------------------------------------
try:
    import fcntl
except ImportError:  # pragma: no cover - not POSIX: file_lock is a no-op there
    fcntl = None
posix_only = pytest.mark.skipif(fcntl is None, reason="flock needs POSIX")


@posix_only
def test_file_lock_is_exclusive(tmp_path):
    lock = tmp_path / "x.lock"
    with file_lock(lock):
        fd = os.open(lock, os.O_RDWR)  # another open file description, as another process has
        try:
            with pytest.raises(BlockingIOError):
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        finally:
            os.close(fd)
    fd = os.open(lock, os.O_RDWR)  # released
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        fcntl.flock(fd, fcntl.LOCK_UN)
    finally:
        os.close(fd)
    with file_lock(lock), pytest.raises(RuntimeError):  # released on an exception too
        raise RuntimeError
    with file_lock(lock):
        pass


@posix_only
def test_file_lock_excludes_another_process(tmp_path):
    lock, waiting, log = tmp_path / "x.lock", tmp_path / "waiting", tmp_path / "log"
    child = textwrap.dedent(
        """
        import sys
        from pathlib import Path
        from powerpy._fs import file_lock
        lock, waiting, log = map(Path, sys.argv[1:])
        waiting.touch()
        with file_lock(lock):
            with open(log, "a") as f:
                f.write("child\\n")
        """
    )
    with file_lock(lock):
        proc = subprocess.Popen([sys.executable, "-c", child, lock, waiting, log], cwd=REPO)
        try:
            deadline = time.monotonic() + 60
            while not waiting.exists() and proc.poll() is None and time.monotonic() < deadline:
                time.sleep(0.02)
            time.sleep(0.3)
            assert proc.poll() is None and not log.exists()  # blocked on the lock
            log.write_text("parent\n")
        except BaseException:
            proc.kill()
            raise
    assert proc.wait(timeout=60) == 0
    assert log.read_text() == "parent\nchild\n"


# --- fmt_bytes and the module's imports -----------------------------------------------------------
@pytest.mark.parametrize(
    ("n", "text"),
    [
        (0, "0 B"),
        (1023, "1023 B"),
        (1024, "1.0 KiB"),
        (8 << 10, "8.0 KiB"),
        (3 << 19, "1.5 MiB"),
        (320 << 20, "320.0 MiB"),
        (1 << 30, "1.00 GiB"),
        (11 << 29, "5.50 GiB"),
        (-2048, "-2.0 KiB"),
    ],
)
def test_fmt_bytes(n, text):
    assert fmt_bytes(n) == text


def test_fs_imports_only_the_standard_library():
    tree = ast.parse(Path(_fs.__file__).read_text(encoding="utf-8"))
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            names.add((node.module or "").split(".")[0])
    assert names and names <= set(sys.stdlib_module_names) | {"__future__"}, names
