"""Prints an end-to-end A/B of docs/benchmarks.md §8.29 from throughput.json files: those beside this script, or
under the folder given as the first argument (docs/bench/scores-prefetch-e2e-fp32-2026-12-04h: the float32 run).
Decode tokens/s on the CPU clock of each scheduler in every round, base and new, and the ratio of the medians."""

import json
import statistics
import sys
from pathlib import Path

here = Path(sys.argv[1]) if len(sys.argv) > 1 else Path(__file__).parent
runs: dict[str, dict[str, list[float]]] = {"base": {}, "new": {}}
for f in sorted(here.glob("*/throughput.json")):
    tree = f.parent.name.split("-")[0]
    for row in json.loads(f.read_text())["sweeps"]["width"]["rows"]:
        runs[tree].setdefault(row["scheduler"], []).append(row["decode_cpu_tokens_per_s"])
print("scheduler | base decode tok/s (CPU) per round | new per round | new / base (medians)")
for sched in runs["base"]:
    b, n = runs["base"][sched], runs["new"][sched]
    print(f"{sched:>12} | {' '.join(f'{x:6.1f}' for x in b)} | {' '.join(f'{x:6.1f}' for x in n)} | "
          f"{statistics.median(n) / statistics.median(b):.3f}")
