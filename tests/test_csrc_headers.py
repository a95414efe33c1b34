"""Every header of the native kernels compiles on its own (``#pragma once``, and it includes what it
uses), with the flags of the library build and of the tests' portable builds. An arch header
(simd.h's choice) may refuse a build without its ISA, with its own ``#error``."""

from __future__ import annotations

import ctypes
import platform
import subprocess
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from powerpy.model import kernel_build

CSRC = Path(kernel_build.__file__).parent / "csrc"
HEADERS = sorted(p.name for p in CSRC.glob("*.h"))
# the library's flags, then the AVX2 and scalar builds the kernel tests also make (x86-64 only)
MARCHES = ("-march=native", "-march=x86-64-v3", "-march=x86-64")
NOT_FOR_THIS_ISA = "(simd.h chooses the arch headers)"


def _flags(march: str) -> list[str]:
    return [march if f.startswith("-march=") else f for f in kernel_build.DEFAULT_FLAGS]


def _syntax(compiler: str, header: str, march: str) -> tuple[str, str, int, str]:
    cmd = [compiler, *_flags(march), "-fsyntax-only", "-x", "c++", "-"]
    res = subprocess.run(
        cmd,
        input=f'#include "{header}"\n',
        cwd=CSRC,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    return header, march, res.returncode, res.stderr


def test_headers_have_pragma_once() -> None:
    missing = [h for h in HEADERS if "#pragma once" not in (CSRC / h).read_text(encoding="utf-8")]
    assert not missing, missing


def test_each_header_compiles_alone() -> None:
    compiler = kernel_build.find_compiler()
    if compiler is None:
        pytest.skip("no C++ compiler")
    marches = MARCHES if platform.machine() in ("x86_64", "AMD64") else MARCHES[:1]
    jobs = [(h, m) for m in marches for h in HEADERS]
    with ThreadPoolExecutor(2) as pool:
        results = list(pool.map(lambda j: _syntax(compiler, *j), jobs))
    failed = []
    for header, march, rc, err in results:
        if rc == 0 or (march != MARCHES[0] and NOT_FOR_THIS_ISA in err):
            continue
        failed.append(f"{header} ({march}):\n" + "\n".join(err.splitlines()[:6]))
    assert not failed, "\n".join(failed)


def test_no_include_after_code() -> None:
    """Includes come first in every file (after the opening comment and guards), none mid-file."""
    late = []
    for p in sorted(CSRC.iterdir()):
        seen_code = False
        for n, line in enumerate(p.read_text(encoding="utf-8").splitlines(), 1):
            s = line.strip()
            if s.startswith("#include"):
                if seen_code:
                    late.append(f"{p.name}:{n}")
            elif s and not s.startswith(("//", "#pragma once", "#if", "#el", "#endif", "#error")):
                seen_code = True
    allowed = {f"{h}:{n}" for h in ("ops.h", "blocks.h") for n in _tail_includes(h)}
    assert not [x for x in late if x not in allowed], late


def _tail_includes(name: str) -> list[int]:
    """ops.h ends with the headers of its specializations, blocks.h with mla.h (what they
    declare is defined there: a file that sees the declarations sees the definitions)."""
    lines = (CSRC / name).read_text(encoding="utf-8").splitlines()
    return [i for i, line in enumerate(lines, 1) if line.startswith("#include")][1:]


def test_a_folder_builds_every_unit_and_hashes_every_file(tmp_path: Path) -> None:
    """The library is every .cpp of its folder, linked into one file; any file edited rebuilds."""
    if kernel_build.find_compiler() is None:
        pytest.skip("no C++ compiler")
    src = tmp_path / "src"
    src.mkdir()
    (src / "k.h").write_text("#pragma once\ninline int f() { return 1; }\n")
    (src / "a.cpp").write_text('#include "k.h"\nextern "C" int a() { return f(); }\n')
    (src / "b.cpp").write_text('#include "k.h"\nextern "C" int b() { return 10 * f(); }\n')
    flags = ("-O0", "-shared", "-fPIC")
    first = kernel_build.compile_library(src, flags, tmp_path / "cache")
    lib = ctypes.CDLL(str(first))
    assert (lib.a(), lib.b()) == (1, 10)
    assert kernel_build.compile_library(src, flags, tmp_path / "cache") == first  # cached
    (src / "notes.txt").write_text("any file of the folder is part of the key\n")
    second = kernel_build.compile_library(src, flags, tmp_path / "cache")
    assert second != first and second.exists()
    assert kernel_build.SOURCE.is_dir() and len(list(kernel_build.SOURCE.glob("*.cpp"))) > 1
