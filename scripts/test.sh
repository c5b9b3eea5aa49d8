#!/usr/bin/env bash
# Set up (idempotent) and run the whole test suite.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
# the suite also tests the TRL and verl integrations and uses pytest, hypothesis and playwright:
# their extras go into the same environment (verl then holds transformers below 5.11 there)
.venv/bin/python -m pip install -q -e ".[dev,train,trl,verl]" "torch==2.13.0"
# headless Chromium for the inspect page's browser test (Debian's package; no browser download,
# never `playwright install`). Skipped where it is already there or apt is unavailable.
if [ ! -x /usr/bin/chromium ] && command -v apt-get >/dev/null 2>&1; then
  (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null) \
    || echo "warning: could not install chromium; the browser test will be skipped" >&2
fi
# -q comes from pyproject.toml (addopts); a second -q would hide pytest's summary line
.venv/bin/python -m pytest tests -p no:cacheprovider "$@"
