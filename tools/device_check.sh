#!/usr/bin/env bash
# Everything a session lent a GPU machine should run, as one command (see docs/gpu.md):
#
#   bash tools/device_check.sh [--dry-run] [OUTDIR]
#
# Steps: env (versions, GPU, compiler, Triton), install (gguf and pulp, and pytest if missing,
# from .device-wheels, offline), kernels (build the native CPU kernels, timed), measure
# (tools/device_check.py, with llama.cpp's CUDA build as the anchor when its wheel is there:
# tools/device_llama_wheel.sh), moe (tools/device_moe.py: a mixture beyond the GPU against
# llama.cpp's --n-cpu-moe), pytest_cuda (-m "cuda or triton": tests/test_hybrid.py, the
# fused kernels' tests and any other test file with CUDA-marked tests), pytest_fake
# (tests/test_fake_cuda.py, if time is left). Each step
# has its own timeout, capped by the time left of DEVICE_CHECK_SECONDS; a step that fails or
# times out is recorded and the next one runs. OUTDIR (default $OUT, else ./device-check-out)
# gets device_check.json (the measurements plus each step's status, rc and seconds),
# device_check.md (tables) and logs/<step>.log.
#
# --dry-run: no install, the measurements on the emulated accelerator with tiny shapes, one
# fake-CUDA test instead of both test files (the whole file takes ~30 s on 2 cores); ~30 s.
#
# Environment: PYTHON (default: python, else python3), DEVICE_WHEELS (default .device-wheels),
# DEVICE_CHECK_SECONDS (default 450; 150 with --dry-run), DEVICE_CHECK_LAYERS (cut the 7B
# shape to N layers when time is short), DEVICE_CHECK_ARGS (more device_check.py arguments),
# DEVICE_CHECK_STEPS (the steps to run, e.g. "env install kernels moe" for a second call).
# Exit status: 0 when every step that ran succeeded.
set -u

DRY=0
OUTDIR=""
for arg in "$@"; do
    case $arg in
        --dry-run) DRY=1 ;;
        -h | --help)
            sed -n '2,24p' "$0"
            exit 0
            ;;
        -*)
            echo "unknown option $arg" >&2
            exit 2
            ;;
        *) OUTDIR=$arg ;;
    esac
done
OUTDIR=${OUTDIR:-${OUT:-./device-check-out}}
mkdir -p "$OUTDIR/logs" && OUTDIR=$(cd "$OUTDIR" && pwd)
cd "$(dirname "${BASH_SOURCE[0]}")/.." || exit 2 # the repository root

PY=${PYTHON:-$(command -v python || command -v python3)}
WHEELS=${DEVICE_WHEELS:-.device-wheels}
TOTAL=${DEVICE_CHECK_SECONDS:-$((DRY ? 150 : 450))}
SITE=${TMPDIR:-/tmp}/powerpy-device-site # pip --target fallback of the install step
export PY WHEELS SITE PYTHONUNBUFFERED=1
export PYTHONPATH="$PWD:$SITE${PYTHONPATH:+:$PYTHONPATH}" # works without an install too
STEPS=$OUTDIR/steps.tsv
: >"$STEPS"
START=$SECONDS
FAILED=0

left() { echo $((TOTAL - (SECONDS - START))); }

record() { # NAME STATUS RC SECONDS TIMEOUT
    printf '%s\t%s\t%s\t%s\t%s\n' "$@" >>"$STEPS"
}

step() { # NAME LIMIT CMD...: run CMD with a timeout capped by the time left; log and record
    local name=$1 limit=$2 t rc status t0 dt
    shift 2
    if [[ -n ${DEVICE_CHECK_STEPS:-} && " $DEVICE_CHECK_STEPS " != *" $name "* ]]; then
        echo "== $name: skipped (DEVICE_CHECK_STEPS)"
        record "$name" skipped "" 0 0
        return
    fi
    t=$(left)
    ((limit < t)) && t=$limit
    if ((t < 5)); then
        echo "== $name: skipped, $(left) s left"
        record "$name" skipped "" 0 "$t"
        return
    fi
    echo "== $name (timeout ${t} s): $*"
    t0=$(date +%s.%N)
    timeout -k 10 "$t" "$@" 2>&1 | tee "$OUTDIR/logs/$name.log"
    rc=${PIPESTATUS[0]}
    dt=$(awk -v a="$t0" -v b="$(date +%s.%N)" 'BEGIN { printf "%.1f", b - a }')
    case $rc in
        0) status=ok ;;
        124 | 137) status=timeout ;;
        *) status=failed ;;
    esac
    [[ $status != ok ]] && FAILED=1
    echo "== $name: $status (rc $rc, $dt s)"
    record "$name" "$status" "$rc" "$dt" "$t"
}

env_step() {
    echo "date: $(date -u)"
    echo "nproc: $(nproc)"
    free -g | head -2
    echo "g++: $(command -v g++ || echo none) $(g++ --version 2>/dev/null | head -1)"
    df -h "${TMPDIR:-/tmp}" /dev/shm . | cat
    if command -v nvidia-smi >/dev/null; then
        timeout 20 nvidia-smi --format=csv \
            --query-gpu=name,driver_version,memory.total,memory.used,clocks.max.sm,power.limit
    fi
    "$PY" - <<'EOF'
import importlib, sys

import torch

print("python", sys.version.split()[0], "| torch", torch.__version__, "| CUDA", torch.version.cuda)
print("cuda available:", torch.cuda.is_available())
if torch.cuda.is_available():
    print("device:", torch.cuda.get_device_name(0), torch.cuda.get_device_capability(0))
    print("mem_get_info (free, total):", torch.cuda.mem_get_info(0))
for name in ("triton", "gguf", "pulp", "transformers", "numpy", "yaml", "tqdm", "requests"):
    try:
        print(name, getattr(importlib.import_module(name), "__version__", "?"))
    except Exception as e:
        print(name, "NOT importable:", e)
EOF
}

offline_install() { # PKG...: from $WHEELS only; with dependencies, else without, else --target
    local find=(--no-index --find-links "$WHEELS")
    "$PY" -m pip install "${find[@]}" "$@" && return
    echo "-- retrying without dependencies"
    PIP_BREAK_SYSTEM_PACKAGES=1 "$PY" -m pip install "${find[@]}" --no-deps "$@" && return
    echo "-- retrying into $SITE (on PYTHONPATH)"
    "$PY" -m pip install "${find[@]}" --no-deps --target "$SITE" "$@"
}

install_step() {
    [[ -d $WHEELS ]] || echo "no $WHEELS here: run tools/device_wheels.sh and carry the folder"
    if "$PY" -c "import gguf, pulp" 2>/dev/null; then
        echo "gguf and pulp are already installed"
    else
        offline_install gguf "pulp>=3.3,<3.4"
    fi
    "$PY" -c "import pytest" 2>/dev/null || offline_install pytest
    # llama.cpp's CUDA build, the anchor (tools/device_llama_wheel.sh), with diskcache, which
    # llama_cpp imports; its numpy, jinja2 and typing-extensions come with torch
    local llama
    llama=$(ls "$WHEELS"/llama_cpp_python-*.whl 2>/dev/null | head -1)
    if [[ -n $llama ]]; then
        "$PY" -c "import diskcache" 2>/dev/null || offline_install diskcache
        PIP_BREAK_SYSTEM_PACKAGES=1 "$PY" -m pip install --no-index --no-deps "$llama" ||
            "$PY" -m pip install --no-index --no-deps --target "$SITE" "$llama"
    else
        echo "no llama.cpp CUDA wheel in $WHEELS: the llamacpp section will say so"
    fi
    "$PY" -m pip install --no-index --no-deps --no-build-isolation -e . ||
        echo "editable install failed: powerpy runs from PYTHONPATH=$PWD"
    "$PY" -c "import gguf, pulp, powerpy, pytest
print('gguf', gguf.__file__, '| pulp', pulp.__version__, '| pytest', pytest.__version__)
print('powerpy', powerpy.__file__)"
}
export -f env_step offline_install install_step

KERNELS_PY='from powerpy.model import kernels
import time
t = time.time()
lib = kernels.library()
print("kernels built:", lib is not None, f"{time.time() - t:.1f} s", lib.simd if lib else "")
raise SystemExit(lib is None)'

step env 30 bash -c env_step
if ((DRY)); then
    record install skipped "" 0 0
else
    step install 90 bash -c install_step
fi
step kernels 120 "$PY" -c "$KERNELS_PY"

# the measurements: all the time left but what the CUDA tests need; they stop themselves
# (--deadline) before the step's timeout kills them
if ((DRY)); then limit=60; else limit=$(($(left) - 100)); fi
((limit > 300)) && limit=300
((limit < 30)) && limit=30
deadline=$(((limit < $(left) ? limit : $(left)) - 20))
DRY_FLAG=()
((DRY)) && DRY_FLAG=(--dry-run)
LAYERS=()
[[ -n ${DEVICE_CHECK_LAYERS:-} ]] && LAYERS=(--layers "$DEVICE_CHECK_LAYERS")
# shellcheck disable=SC2086  # DEVICE_CHECK_ARGS is split on purpose
step measure "$limit" "$PY" tools/device_check.py "${DRY_FLAG[@]}" --out "$OUTDIR" \
    --deadline "$deadline" "${LAYERS[@]}" ${DEVICE_CHECK_ARGS:-}
# a measure step killed by its timeout leaves its model behind (13.5 GiB, in /dev/shm when it
# fits); device_check.py names its directory in the JSON
work=$("$PY" -c 'import json, sys; print(json.load(open(sys.argv[1])).get("workdir") or "")' \
    "$OUTDIR/device_check.json" 2>/dev/null)
[[ -d $work && $(basename "$work") == device_check_* ]] && rm -rf -- "$work"

if ((DRY)); then
    record pytest_cuda skipped "" 0 0
    step pytest_fake 40 "$PY" -m pytest -q -p no:cacheprovider tests/test_fake_cuda.py \
        -k "decode_run_on_the_device and 1-everything"
else
    # tests/test_hybrid.py and any other test file with CUDA-marked tests, and the fused
    # kernels' tests (compiled here, interpreted elsewhere)
    mapfile -t cuda_tests < <(grep -l "mark.cuda\|mark.triton" tests/test_*.py)
    step pytest_cuda 150 "$PY" -m pytest -m "cuda or triton" -q -rA --durations=5 \
        -p no:cacheprovider \
        --continue-on-collection-errors "${cuda_tests[@]:-tests/test_hybrid.py}"
fi
# the DeepSeek-like mixture beyond the GPU: powerpy's expert placement against llama.cpp's
# --n-cpu-moe at the same VRAM (tools/device_moe.py; a 27 GB model, about two and a half
# minutes: with less time left it is skipped, and `python tools/device_moe.py --out DIR` runs
# it as a call of its own)
if [[ -n ${DEVICE_CHECK_STEPS:-} ]] || ((DRY || $(left) >= 160)); then
    step moe $((DRY ? 60 : 160)) "$PY" tools/device_moe.py "${DRY_FLAG[@]}" --out "$OUTDIR"
else
    echo "== moe: skipped, $(left) s left (run tools/device_moe.py as a call of its own)"
    record moe skipped "" 0 0
fi
((DRY)) || step pytest_fake 120 "$PY" -m pytest -q -p no:cacheprovider tests/test_fake_cuda.py

# merge the steps into the JSON and put their table at the top of the markdown
"$PY" - "$OUTDIR" "$DRY" <<'EOF'
import json, sys
from pathlib import Path

out, dry = Path(sys.argv[1]), sys.argv[2] == "1"
steps = []
for line in (out / "steps.tsv").read_text().splitlines():
    name, status, rc, seconds, timeout = line.split("\t")
    steps.append({"name": name, "status": status, "rc": int(rc) if rc else None,
                  "seconds": float(seconds), "timeout_s": int(timeout),
                  "log": f"logs/{name}.log" if status != "skipped" else None})
js, md = out / "device_check.json", out / "device_check.md"
data = json.loads(js.read_text()) if js.exists() else {
    "error": "tools/device_check.py wrote no results: see logs/measure.log", "sections": {}}
data["steps"] = steps
if dry:
    data["steps_note"] = ("dry run: no install, no CUDA tests; one fake-CUDA test "
                          "(the whole file takes ~30 s on 2 cores)")
js.write_text(json.dumps(data, indent=1))
rows = ["## Steps", "", "| step | status | rc | seconds | timeout s |", "|---|---|---|---|---|"]
rows += [f"| {s['name']} | {s['status']} | {'' if s['rc'] is None else s['rc']} | "
         f"{s['seconds']} | {s['timeout_s']} |" for s in steps]
text = md.read_text() if md.exists() else "# Device check\n\nno results from device_check.py\n"
i = text.find("\n## ")
i = len(text) if i < 0 else i + 1
md.write_text(text[:i] + "\n".join(rows) + "\n\n" + text[i:])
EOF

echo
cat "$OUTDIR/device_check.md"
echo "results in $OUTDIR: device_check.json, device_check.md, logs/ ($((SECONDS - START)) s)"
exit $FAILED
