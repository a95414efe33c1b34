"""Every header of the native kernels compiles on its own (``#pragma once``, and it includes what it
uses), with the flags of the library build and of the tests' portable builds. An arch header
(simd.h's choice) may refuse a build without its ISA, with its own ``#error``."""

from __future__ import annotations

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
    allowed = {f"ops.h:{n}" for n in _tail_includes("ops.h")}
    assert not [x for x in late if x not in allowed], late


def _tail_includes(name: str) -> list[int]:
    """ops.h ends with the headers of its specializations (a file that sees the templates sees
    them: see its last lines)."""
    lines = (CSRC / name).read_text(encoding="utf-8").splitlines()
    return [i for i, line in enumerate(lines, 1) if line.startswith("#include")][1:]
