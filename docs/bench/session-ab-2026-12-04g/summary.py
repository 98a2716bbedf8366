"""The §8.28 session A/B: `scripts/ab.sh /tmp/base . OUT 2 throughput --model ouro-bench --dtype bfloat16 --threads 1
--workload alpaca --num-requests 64 --sweep width --widths 32`, run twice (rounds 3-4 are the second run's 1-2;
/tmp/base a worktree of 9bb3808, "new" 2efb088), then `python summary.py OUT 4`: decode tokens per CPU second,
median of the rounds, and every round."""
import json
import statistics
import sys

out, rounds = sys.argv[1], int(sys.argv[2])
res: dict = {}
for tree in ("base", "new"):
    for i in range(1, rounds + 1):
        for r in json.load(open(f"{out}/{tree}-{i}/throughput.json"))["sweeps"]["width"]["rows"]:
            res.setdefault(r["scheduler"], {}).setdefault(tree, []).append(r["decode_cpu_tokens_per_s"])
for scheduler, v in res.items():
    b, n = statistics.median(v["base"]), statistics.median(v["new"])
    print(f"{scheduler:13} {b:7.1f} -> {n:7.1f} ({n / b - 1:+.1%})  rounds {[round(x) for x in v['base']]} / "
          f"{[round(x) for x in v['new']]}")
