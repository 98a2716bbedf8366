#!/bin/bash
# A/B of `bench host` (width 256, contexts 1k / 4k, final-only outputs): "base" a git worktree of 9bb3808 at /tmp/base,
# "new" this checkout (at the time 1ccc92e); the rounds alternate base, new; prints medians and minima of the runs.
# usage: ab.sh OUTDIR ROUNDS [extra bench host args]
out=$1; rounds=$2; shift 2
mkdir -p $out
for i in $(seq 1 $rounds); do
  for tree in base new; do
    dir=/work/main; [ $tree = base ] && dir=/tmp/base
    (cd $dir && PYTHONPATH=$dir /work/main/.venv/bin/python -m loopserve.cli bench host --widths 256 --contexts 1024,4096 --output-kinds final_only --out $out/$tree-$i --no-progress "$@" > /dev/null 2>&1)
  done
done
/work/main/.venv/bin/python - "$out" "$rounds" <<'PY'
import json, sys, statistics
out, rounds = sys.argv[1], int(sys.argv[2])
rows = {}
for tree in ("base", "new"):
    for i in range(1, rounds + 1):
        for p in json.load(open(f"{out}/{tree}-{i}/host.json"))["points"]:
            for st, c in p["stages"].items():
                rows.setdefault((p["scheduler"], p["context"], st), {}).setdefault(tree, []).append((c["host_cpu_us"], c["host_cpu_us_median"]))
for k, v in sorted(rows.items()):
    b, n = v.get("base", []), v.get("new", [])
    f = lambda xs, j: statistics.median(x[j] for x in xs) if xs else float("nan")
    g = lambda xs, j: min(x[j] for x in xs) if xs else float("nan")
    print(f"{k[0]:4} {k[1]:5} {k[2]:8} mean: med {f(b,0):5.0f} -> {f(n,0):5.0f}, min {g(b,0):5.0f} -> {g(n,0):5.0f} | tick median: med {f(b,1):5.0f} -> {f(n,1):5.0f}, min {g(b,1):5.0f} -> {g(n,1):5.0f}")
PY
