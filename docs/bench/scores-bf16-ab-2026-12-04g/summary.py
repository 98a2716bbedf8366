"""The §8.28 bfloat16 scores A/B: `scripts/ab.sh /tmp/base . OUT 3 step-latency --model ouro-bench --dtype bfloat16
--threads 1 --contexts 128,1024,4096 --batches 1,8,32 --reps 15` (/tmp/base a worktree of 9bb3808, "new" the code
of c76c7bd), then `python summary.py OUT 3`: ms per step, median of the rounds' medians, and every round."""
import json
import statistics
import sys

out, rounds = sys.argv[1], int(sys.argv[2])
res: dict = {}
for tree in ("base", "new"):
    for i in range(1, rounds + 1):
        for p in json.load(open(f"{out}/{tree}-{i}/step_latency.json"))["points"]:
            res.setdefault((p["context"], p["batch"]), {}).setdefault(tree, []).append(
                statistics.median(p["times_s"]) * 1e3)
for (context, batch), v in sorted(res.items()):
    b, n = statistics.median(v["base"]), statistics.median(v["new"])
    print(f"context {context:5} batch {batch:3}: {b:7.2f} -> {n:7.2f} ms ({n / b - 1:+.1%})  rounds "
          f"{[round(x, 2) for x in v['base']]} / {[round(x, 2) for x in v['new']]}")
