#!/usr/bin/env bash
# The soak test of the real server (loopserve_lab/bench/soak.py), as recorded in docs/reliability.md.
#
#   scripts/soak.sh [DURATION_S] [extra driver flags]      (default: 1800 s)
#
# The driver starts `loopserve serve` on a free 127.0.0.1 port with a make_tiny checkpoint, a small
# KV pool and a small admission bound, drives it with mixed and hostile traffic for DURATION_S, then
# checks it is idle with an empty KV cache, its RSS growth, its log and its exit code after SIGTERM.
# The JSON report goes to docs/bench/soak/report.json (OUT=path to change it); the exit status is
# the driver's: 0 when every check passed. Extra flags go to the driver, e.g. --concurrency 12,
# --model PATH, --server-arg=--scheduler=cb (python -m loopserve_lab.bench.soak --help lists them).
set -euo pipefail
cd "$(dirname "$0")/.."
DURATION=${1:-1800}
shift $(( $# > 0 ? 1 : 0 ))
OUT=${OUT:-docs/bench/soak/report.json}
mkdir -p "$(dirname "$OUT")"
exec .venv/bin/python -m loopserve_lab.bench.soak --duration-s "$DURATION" --out "$OUT" "$@"
