#!/usr/bin/env bash
# Idempotent set-up: a venv with the CPU build of torch 2.13.0 (installed first, so nothing pulls
# a CUDA build) and loopserve in editable mode with every extra (the runtime, the lab and the dev tools).
set -euo pipefail
cd "$(dirname "$0")"
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
.venv/bin/python -m pip install -q --disable-pip-version-check torch==2.13.0
.venv/bin/python -m pip install -q --disable-pip-version-check -e '.[serve,hub,structured,ray,bench,train,dev]'
