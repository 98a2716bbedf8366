#!/usr/bin/env bash
# Idempotent set-up: a venv with torch 2.13.0 (installed first, so nothing pulls another build) and loopserve in
# editable mode with every extra (the runtime, the lab and the dev tools). The CPU build comes from where pip finds
# it: this machine's pip configuration has it (2.13.0+cpu); PyPI's Linux wheel is the CUDA build (gigabytes of
# nvidia packages), so elsewhere run `TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu ./setup.sh`.
set -euo pipefail
cd "$(dirname "$0")"
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
.venv/bin/python -m pip install -q --disable-pip-version-check ${TORCH_INDEX_URL:+--extra-index-url "$TORCH_INDEX_URL"} torch==2.13.0
.venv/bin/python -m pip install -q --disable-pip-version-check -e '.[serve,hub,structured,ray,bench,train,dev]'
