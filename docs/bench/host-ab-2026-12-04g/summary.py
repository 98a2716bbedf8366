"""The §8.28 host A/B: `scripts/ab.sh /tmp/base . OUT 5 host --widths 256 --contexts 1024,4096 --output-kinds
final_only` (/tmp/base a worktree of 9bb3808, "new" ecb5530), then `python summary.py OUT 5`: each point's mean
and median-tick host µs, median and fastest of the rounds (also §8.30's A/Bs, whose points have two output kinds)."""
import json
import statistics
import sys

out, rounds = sys.argv[1], int(sys.argv[2])
rows: dict = {}
for tree in ("base", "new"):
    for i in range(1, rounds + 1):
        for p in json.load(open(f"{out}/{tree}-{i}/host.json"))["points"]:
            for stage, c in p["stages"].items():
                key = (p["scheduler"], p["output_kind"], p["context"], stage)
                rows.setdefault(key, {}).setdefault(tree, []).append((c["host_cpu_us"], c["host_cpu_us_median"]))
for (sched, kind, context, stage), v in sorted(rows.items()):
    b, n = v["base"], v["new"]
    med = [statistics.median(x[j] for x in xs) for xs in (b, n) for j in (0, 1)]
    low = [min(x[j] for x in xs) for xs in (b, n) for j in (0, 1)]
    print(f"{sched:4} {kind:10} {context:5} {stage:8} mean: median {med[0]:5.0f} -> {med[2]:5.0f}, "
          f"fastest {low[0]:5.0f} -> {low[2]:5.0f} | median tick: median {med[1]:5.0f} -> {med[3]:5.0f}, "
          f"fastest {low[1]:5.0f} -> {low[3]:5.0f}")
