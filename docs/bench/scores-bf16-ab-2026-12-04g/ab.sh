#!/bin/bash
# A/B of `bench step-latency` (args after OUTDIR ROUNDS): "base" a git worktree of 9bb3808 at /tmp/base, "new" this
# checkout (the code of b955cbd, then uncommitted: the bf16 in-place scores); rounds alternate base, new; medians of medians.
out=$1; rounds=$2; shift 2
mkdir -p $out
for i in $(seq 1 $rounds); do
  for tree in base new; do
    dir=/work/main; [ $tree = base ] && dir=/tmp/base
    (cd $dir && PYTHONPATH=$dir /work/main/.venv/bin/python -m loopserve.cli bench step-latency --out $out/$tree-$i --no-progress "$@" > /dev/null 2>&1)
  done
done
/work/main/.venv/bin/python - "$out" "$rounds" <<'PY'
import json, sys, statistics
out, rounds = sys.argv[1], int(sys.argv[2])
res = {}
for tree in ("base", "new"):
    for i in range(1, rounds + 1):
        d = json.load(open(f"{out}/{tree}-{i}/step_latency.json"))
        for p in d["points"]:
            res.setdefault((p["context"], p["batch"]), {}).setdefault(tree, []).append(statistics.median(p["times_s"]) * 1e3)
for k, v in sorted(res.items()):
    b, n = v["base"], v["new"]
    print(f"context {k[0]:5} batch {k[1]:3}: {statistics.median(b):7.2f} -> {statistics.median(n):7.2f} ms ({statistics.median(n)/statistics.median(b)-1:+.1%})  rounds {[round(x,2) for x in b]} / {[round(x,2) for x in n]}")
PY
