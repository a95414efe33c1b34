"""Compiling the native kernels (``powerpy.model.kernels`` loads them).

The library is compiled with the system C++ compiler into a per-user cache,
``$XDG_CACHE_HOME/powerpy/kernels`` (default ``~/.cache/powerpy/kernels``), under a name that
hashes the sources (every file of ``csrc/``, headers included, so editing any of them
rebuilds), the flags, the compiler version and the CPU flags, so a cache shared between
machines never hands a binary to a CPU it was not built for. Builds go to a temporary file that
is renamed into place, under a file lock, so concurrent processes neither race nor see
half-written files. The library is several translation units (``csrc/*.cpp``), compiled side by
side and linked into one file.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from powerpy._fs import atomic_write, file_lock
from powerpy.formats.constants import GGMLType
from powerpy.model import kernel_abi

logger = logging.getLogger("powerpy.model.kernels")

SOURCE = Path(__file__).parent / "csrc"  # every .cpp there, one library
DEFAULT_FLAGS = ("-O3", "-march=native", "-fopenmp", "-shared", "-fPIC", "-std=c++17", "-flto")


class KernelBuildError(RuntimeError):
    """The kernel library could not be compiled or loaded."""


def default_cache_dir() -> Path:
    """``$XDG_CACHE_HOME/powerpy/kernels``, or ``~/.cache/powerpy/kernels``."""
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "powerpy" / "kernels"


def find_compiler() -> str | None:
    """The first C++ compiler on PATH (g++, c++, clang++), or None."""
    for name in ("g++", "c++", "clang++"):
        path = shutil.which(name)
        if path:
            return path
    return None


def _cpu_flags() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                if line.startswith(("flags", "Features")):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


def _compiler_id(compiler: str) -> str:
    try:
        res = subprocess.run(
            [compiler, "--version"], capture_output=True, text=True, timeout=30, check=False
        )
        return res.stdout.splitlines()[0] if res.stdout else compiler
    except (OSError, subprocess.SubprocessError):
        return compiler


def compile_library(
    source: Path = SOURCE,
    flags: tuple[str, ...] = DEFAULT_FLAGS,
    cache_dir: Path | None = None,
    compiler: str | None = None,
) -> Path:
    """Compile ``source`` into the cache (or find the cached build) and return its path.

    Args:
        source: a folder (every ``.cpp`` in it is a translation unit of the library) or one
            C++ file; every file of the folder (with the headers) is hashed.
        flags: compiler flags; ``-march=...`` selects the SIMD level (tests build
            ``-march=x86-64-v3`` and ``-march=x86-64`` variants to cover AVX2 and scalar code).
        cache_dir: where builds are kept (default :func:`default_cache_dir`).
        compiler: compiler executable (default :func:`find_compiler`).

    Raises:
        KernelBuildError: no compiler, or a failed compile.
    """
    compiler = compiler or find_compiler()
    if compiler is None:
        raise KernelBuildError("no C++ compiler (g++, c++ or clang++) on PATH")
    try:
        return _cached_build(source, flags, cache_dir, compiler)
    except KernelBuildError as e:
        plain = tuple(f for f in flags if not f.startswith("-flto"))
        if plain == flags:
            raise
        # a compiler or linker without link-time optimization (clang without its LTO plugin)
        logger.warning("kernel build with -flto failed, building without it: %s", e)
        return _cached_build(source, plain, cache_dir, compiler)


def _cached_build(
    source: Path, flags: tuple[str, ...], cache_dir: Path | None, compiler: str
) -> Path:
    """The cached build of ``source`` with ``flags`` and ``compiler``, compiled if missing."""
    key = hashlib.sha256()
    for part in (
        _sources_digest(source),
        " ".join(flags).encode(),
        _compiler_id(compiler).encode(),
        _cpu_flags().encode(),
        platform.machine().encode(),
    ):
        key.update(part)
        key.update(b"\0")
    cache_dir = cache_dir or default_cache_dir()
    name = "powerpy_kernels" if source.is_dir() else source.stem
    target = cache_dir / f"{name}-{key.hexdigest()[:20]}.so"
    if not target.exists():
        try:
            cache_dir.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise KernelBuildError(f"cannot create kernel cache {cache_dir}: {e}") from e
        with file_lock(cache_dir / (target.name + ".lock")):
            if not target.exists():  # another process may have built it while we waited
                _compile(compiler, source, flags, target)
    return target


def check_codes(
    cdll, path: Path, dtype_codes: dict, record: type[ctypes.Structure] = kernel_abi.LayerRecord
) -> None:
    """Raise KernelBuildError unless the loaded library ``cdll`` has Python's dtype codes
    (``kernels.DTYPE_CODES``, for every GGMLType; -1: not read) and decode layer record: the
    size of ``record`` (``kernel_abi.LayerRecord``) and every field's offset and size, by name
    (``kernel_abi.record_fields``: its sub-records' members too, and the flags and variant
    codes), against the library's table; the error names the first field that differs."""
    ours, theirs = kernel_abi.record_fields(record), record_fields(cdll)
    for name in [*ours, *(n for n in theirs if n not in ours)]:
        have, want = theirs.get(name), ours.get(name)
        if have != want:
            raise KernelBuildError(
                f"{path}: decode layer record field {name}: {_entry(have)} in the library, "
                f"{_entry(want)} in kernel_abi"
            )
    n, want = cdll.pp_layer_record_len(), ctypes.sizeof(record)
    if n != want:
        raise KernelBuildError(f"{path}: a decode layer record of {n} bytes, not {want}")
    for t in GGMLType:
        code, want = cdll.pp_dtype_code(int(t)), dtype_codes.get(t, -1)
        if code != want:
            raise KernelBuildError(f"{path}: dtype code {code} for {t.name}, not {want}")


def _entry(e: tuple[int, int] | None) -> str:
    """A record table entry in words: a field's offset and size, or a code (size 0)."""
    if e is None:
        return "not there"
    return f"offset {e[0]}, size {e[1]}" if e[1] else f"code {e[0]}"


def record_fields(cdll) -> dict[str, tuple[int, int]]:
    """The library's decode layer record table (pp_layer_record_field), in its order: name ->
    (offset, size), or (code, 0) for a flag or variant."""
    fn = cdll.pp_layer_record_field
    i64p = ctypes.POINTER(ctypes.c_int64)
    fn.argtypes = [ctypes.c_int, ctypes.POINTER(ctypes.c_char_p), i64p, i64p]
    fn.restype = ctypes.c_int
    name, offset, size = ctypes.c_char_p(), ctypes.c_int64(), ctypes.c_int64()
    out = {}
    for i in range(fn(-1, ctypes.byref(name), ctypes.byref(offset), ctypes.byref(size))):
        fn(i, ctypes.byref(name), ctypes.byref(offset), ctypes.byref(size))
        out[(name.value or b"").decode()] = (offset.value, size.value)
    return out


def _units(source: Path) -> list[Path]:
    """The translation units of ``source``: its ``.cpp`` files if it is a folder, else itself."""
    return sorted(source.glob("*.cpp")) if source.is_dir() else [source]


def _sources_digest(source: Path) -> bytes:
    """A digest of ``source`` and the other files in its folder, by name, in sorted order."""
    h = hashlib.sha256()
    folder = source if source.is_dir() else source.parent
    try:
        files = sorted({*_units(source), *(p for p in folder.iterdir() if p.is_file())})
        for path in files:
            h.update(path.name.encode() + b"\0" + path.read_bytes() + b"\0")
    except OSError as e:
        raise KernelBuildError(f"cannot read the kernel sources {source.parent}: {e}") from e
    return h.digest()


def _compile(compiler: str, source: Path, flags: tuple[str, ...], target: Path) -> None:
    """Compile each translation unit to an object (side by side, one per CPU), then link them."""
    units = _units(source)
    if not units:
        raise KernelBuildError(f"no C++ sources in {source}")
    with tempfile.TemporaryDirectory(prefix="powerpy-kernels-") as tmpdir:
        objs = [Path(tmpdir) / f"{u.stem}.o" for u in units]
        jobs = [
            [compiler, *flags, "-c", "-o", str(o), str(u)] for u, o in zip(units, objs, strict=True)
        ]
        with ThreadPoolExecutor(max(1, min(len(jobs), os.cpu_count() or 1))) as pool:
            for _ in pool.map(_run, jobs):
                pass
        with atomic_write(target) as tmp:  # readers see the old name or a complete file
            _run([compiler, *flags, "-o", str(tmp), *map(str, objs)])


def _run(cmd: list[str]) -> None:
    try:
        logger.info("building powerpy kernels: %s", " ".join(cmd))
        res = subprocess.run(cmd, capture_output=True, text=True, timeout=600, check=False)
    except (OSError, subprocess.SubprocessError) as e:
        raise KernelBuildError(f"{' '.join(cmd)}: {e}") from e
    if res.returncode != 0:
        tail = "\n".join(res.stderr.strip().splitlines()[-20:])
        raise KernelBuildError(f"{' '.join(cmd)} failed ({res.returncode}):\n{tail}")
