#!/bin/bash
# Two checkouts side by side (docs/benchmarks.md: ratios measured in one run, interleaved):
#   scripts/ab.sh BASE NEW OUT ROUNDS BENCH [ARGS...]
# runs `loopserve bench BENCH ARGS... --out OUT/<base|new>-<round> --no-progress` in BASE, then NEW, ROUNDS times,
# each from its own directory with its own code first on PYTHONPATH, under this checkout's Python (PYTHON
# overrides it). BASE is typically a worktree: `git worktree add /tmp/base <rev>`.
set -euo pipefail
[ $# -ge 5 ] || { echo "usage: $0 BASE NEW OUT ROUNDS BENCH [ARGS...]" >&2; exit 2; }
base=$(cd "$1" && pwd); new=$(cd "$2" && pwd); out=$3; rounds=$4; shift 4
mkdir -p "$out"
out=$(cd "$out" && pwd)
py=${PYTHON:-$(cd "$(dirname "$0")/.." && pwd)/.venv/bin/python}
for i in $(seq 1 "$rounds"); do
  for tree in base new; do
    dir=$base; [ "$tree" = new ] && dir=$new
    (cd "$dir" && PYTHONPATH="$dir" "$py" -m loopserve.cli bench "$@" --out "$out/$tree-$i" --no-progress > /dev/null)
  done
done
