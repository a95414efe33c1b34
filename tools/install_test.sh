#!/usr/bin/env bash
# Install the test extras (and Ray, for the cluster tests): the first half of the README's
# second command.
# llama-cpp-python, the oracle for logits and tokens and the speed peer, builds from source
# (5-10 minutes). Its ggml is built without AMX: ggml's AMX kernels crash (SIGSEGV in
# ggml_backend_amx_mul_mat) on machines whose CPU flags list AMX, and they are not the reference
# path the oracle tests compare with. An installed build that has them is rebuilt.
set -euo pipefail
cd "$(dirname "$0")/.."
ORACLE="llama-cpp-python==0.3.36"
if ! python -c 'import sys, llama_cpp; sys.exit(b"AMX_INT8 = 1" in llama_cpp.llama_print_system_info())' 2>/dev/null; then
  flags=""
  [ "$(uname -m)" = x86_64 ] && flags="-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
  CFLAGS="$flags" CXXFLAGS="$flags" python -m pip install --quiet --no-deps --force-reinstall \
    --no-cache-dir "$ORACLE"
fi
python -m pip install --quiet -e ".[test,dev,cluster]"  # cluster: Ray, for -m cluster tests
