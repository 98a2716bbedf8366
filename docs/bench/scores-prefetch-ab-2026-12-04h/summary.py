"""Prints an A/B table of docs/benchmarks.md §8.29 from step_latency.json files: those beside this script, or
under the folder given as the first argument (another A/B laid out the same way, such as
docs/bench/shift-view-ab-2026-12-04h). Per (kv blocks, context, batch), every round's core-step ms (the min of
7 reps) for base and new, then the ratio of the medians over rounds."""

import json
import statistics
import sys
from pathlib import Path

here = Path(sys.argv[1]) if len(sys.argv) > 1 else Path(__file__).parent
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
