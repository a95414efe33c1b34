#!/usr/bin/env bash
# Download the wheels the lent GPU machine lacks, for an offline install there.
#
#   bash tools/device_wheels.sh [DIR]      # default DIR: .device-wheels (git-ignored)
#
# The GPU machine has no network; it runs Python 3.12 with torch and transformers preinstalled
# (numpy, pyyaml, tqdm, safetensors, jinja2 are there). powerpy also needs gguf and pulp. gguf
# depends on numpy, pyyaml, tqdm (present) and requests, which gguf imports only to fetch remote
# files and which newer transformers images may lack: requests and its small dependencies come
# too, and pip installs them there only where they are missing. So does pytest (with pluggy,
# iniconfig, pygments; packaging comes with transformers), for the CUDA tests: installed only
# when `import pytest` fails. The folder is carried to the machine (`carry: [".device-wheels"]`,
# 64 MiB at most for everything carried), so this fails above 60 MiB. tools/device_check.sh
# installs from it with `pip install --no-index`. llama.cpp's CUDA build, the hybrid's speed
# anchor, is built into the same folder by tools/device_llama_wheel.sh (about 25 minutes).
set -euo pipefail

DIR=${1:-.device-wheels}
PY=${PYTHON:-python3}
LIMIT=$((60 * 1024 * 1024))

# what the device image lacks; pulp is pinned as in pyproject.toml
PACKAGES=(
    "gguf>=0.10"
    "pulp>=3.3,<3.4"
    requests charset-normalizer idna urllib3 certifi  # gguf's requests (lazy import)
    pytest pluggy iniconfig pygments                  # only installed where pytest is missing
    diskcache                                         # llama_cpp's (tools/device_llama_wheel.sh)
)

mkdir -p "$DIR"
"$PY" -m pip download --quiet --only-binary=:all: --python-version 3.12 \
    --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 --platform any \
    --no-deps -d "$DIR" "${PACKAGES[@]}"

ls -l "$DIR"
total=$(find "$DIR" -type f -name '*.whl' -printf '%s\n' | awk '{s += $1} END {print s + 0}')
echo "total: $total bytes ($(awk -v b="$total" 'BEGIN {printf "%.1f", b / 1048576}') MiB) in $DIR"
if ((total > LIMIT)); then
    echo "error: more than 60 MiB of wheels in $DIR (64 MiB may be carried in all)" >&2
    exit 1
fi
