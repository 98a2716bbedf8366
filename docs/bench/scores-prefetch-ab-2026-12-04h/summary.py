"""Prints the A/B table of docs/benchmarks.md §8.29 from the step_latency.json files beside this script:
per (kv blocks, context, batch), every round's core-step ms (the min of 7 reps) for base and new, then the
ratio of the medians over rounds."""

import json
import statistics
from pathlib import Path

here = Path(__file__).parent
for blocks in ("scattered", "contiguous"):
    runs: dict[str, dict[tuple[int, int], list[float]]] = {"base": {}, "new": {}}
    for f in sorted(here.glob(f"{blocks}/*/step_latency.json")):
        tree = f.parent.name.split("-")[0]
        for p in json.loads(f.read_text())["points"]:
            runs[tree].setdefault((p["context"], p["batch"]), []).append(1e3 * p["min_s"])
    print(f"{blocks}: context batch | base ms per round | new ms per round | new / base (medians)")
    for key in sorted(runs["base"]):
        b, n = runs["base"][key], runs["new"][key]
        print(f"  {key[0]:5d} {key[1]:3d} | {' '.join(f'{x:6.1f}' for x in b)} | {' '.join(f'{x:6.1f}' for x in n)} | "
              f"{statistics.median(n) / statistics.median(b):.3f}")
