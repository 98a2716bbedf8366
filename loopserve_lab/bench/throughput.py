"""`loopserve bench throughput`: offline throughput of CB, CDB no-refill and CDB refill on the same
workload and the same exit traces, all requests at t = 0.

Schedulers run interleaved (cb, no-refill, refill, cb, ...) for `repeats` rounds and each point keeps
the median, so a slow spell of a shared machine hits all three alike; with `lockstep` (CPU) a round's runs go
at once, a step of each in turn (`harness.run_lockstep`), so a slow spell hits them within the same seconds.
Every row carries tokens/s (wall and CPU clock), throughput normalized to CB, the mean exit depth, both FLOP bounds
(`loopserve_lab.bench.bounds`) and the share of the bound realized.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable
from typing import Any

from loopserve.engine.config import ENGINE_SCHEDULERS
from loopserve_lab.bench.bounds import realized, run_bounds
from loopserve_lab.bench.harness import (
    LABELS,
    BenchModel,
    OfflineRun,
    RunResult,
    run_lockstep,
    run_offline,
)
from loopserve_lab.bench.workloads import Workload

METRICS = {  # row key -> RunResult attribute
    "e2e": "tokens_per_s", "e2e_cpu": "cpu_tokens_per_s",
    "decode": "decode_tokens_per_s", "decode_cpu": "decode_cpu_tokens_per_s",
    "warm_decode": "warm_decode_tokens_per_s",  # (CUDA graphs: less the captures' time; else = decode)
}


def _median_run(runs: list[RunResult]) -> RunResult:
    return sorted(runs, key=lambda r: r.decode_tokens_per_s)[len(runs) // 2]


def compare_point(bm: BenchModel, workload: Workload, traces: list[list[int]] | None, width: int,
                  schedulers: tuple[str, ...] = ENGINE_SCHEDULERS, repeats: int = 1, progress: bool = True,
                  label: str = "", lockstep: bool = False, **engine_overrides: Any) -> list[dict[str, Any]]:
    """Run each scheduler `repeats` times (interleaved) at one configuration; one row per scheduler.

    Throughputs are medians over the repeats; a ratio to CB is the median over rounds of the ratio
    within a round (runs next to each other in time; with `lockstep`, a round's runs at once, a step of
    each in turn: `harness.run_lockstep`). `decode` rates leave out the time of prefill ticks and the
    prompt's first tokens; they are the ones the decode FLOP bound speaks of."""
    runs: dict[str, list[RunResult]] = {s: [] for s in schedulers}
    for rep in range(repeats):
        descs = [(f"{label} {LABELS.get(s, s)} w={width}" + (f" rep {rep + 1}" if repeats > 1 else "")).strip()
                 for s in schedulers]
        if lockstep:
            results = run_lockstep([OfflineRun(bm, workload, traces, s, width, progress=progress, desc=d,
                                               **engine_overrides) for s, d in zip(schedulers, descs, strict=True)])
        else:
            results = [run_offline(bm, workload, traces, s, width, progress=progress, desc=d, **engine_overrides)
                       for s, d in zip(schedulers, descs, strict=True)]
        for s, r in zip(schedulers, results, strict=True):
            runs[s].append(r)
    rows = []
    base = runs.get("cb")
    for s, rs in runs.items():
        med = _median_run(rs)
        b = run_bounds(bm.hf_config, bm.r_max, med.mean_exit_depth, med.prompt_tokens, med.decode_items)
        row: dict[str, Any] = {"scheduler": s, "width": width, "repeats": len(rs)}
        for key, attr in METRICS.items():
            vals = [getattr(r, attr) for r in rs]
            row[f"{key}_tokens_per_s"] = statistics.median(vals)
            row[f"{key}_tokens_per_s_runs"] = vals
            if base:
                ratios = [getattr(r, attr) / getattr(c, attr) for r, c in zip(rs, base, strict=True)]
                row[f"norm_{key}"] = statistics.median(ratios)
                row[f"norm_{key}_runs"] = ratios
        row.update({
            "tokens_per_s": row["e2e_tokens_per_s"], "mean_exit_depth": med.mean_exit_depth,
            "generated_tokens": med.generated_tokens, "prompt_tokens": med.prompt_tokens,
            "decode_items": med.decode_items, **b, "overhead": med.overhead(), "ticks": med.ticks, "rows": med.rows,
            "refill_events": med.refill_events, "errors": med.errors, "wall_s": med.wall_s, "cpu_s": med.cpu_s,
            "stage_wall_s": med.stage_wall_s, "config": med.config,
            # CUDA, --device-busy: the share of the run's wall time the device ran kernels and copies
            "device_busy": med.device_busy_s / med.wall_s if med.device_busy_s is not None else None,
            "graph_buckets": med.graph_buckets, "graph_capture_s": med.graph_capture_s,
        })
        if base and s != "cb":
            row["realized"] = {
                "decode": realized(row["norm_decode"], b)["of_decode_bound"],
                "decode_cpu": realized(row["norm_decode_cpu"], b)["of_decode_bound"],
                "e2e": realized(row["norm_e2e"], b)["of_workload_bound"],
                "e2e_cpu": realized(row["norm_e2e_cpu"], b)["of_workload_bound"],
            }
        rows.append(row)
    return rows


def sweep(points: list[tuple[Any, list[list[int]] | None, int]], key: str, bm: BenchModel, workload: Workload,
          schedulers: tuple[str, ...] = ENGINE_SCHEDULERS, repeats: int = 1, progress: bool = True,
          on_point: Callable[[list[dict[str, Any]]], None] | None = None, lockstep: bool = False,
          **engine_overrides: Any) -> list[dict[str, Any]]:
    """`points` = (x, traces, width); each row gets `key` = x."""
    from tqdm import tqdm

    rows: list[dict[str, Any]] = []
    for x, traces, width in tqdm(points, desc=f"sweep {key}", disable=not progress):
        pr = compare_point(bm, workload, traces, width, schedulers, repeats, progress, f"{key}={x}", lockstep,
                           **engine_overrides)
        for r in pr:
            r[key] = x
        rows += pr
        if on_point is not None:
            on_point(rows)
    return rows


def format_rows(rows: list[dict[str, Any]], key: str) -> str:
    """decode = without prefill ticks (vs the decode bound); e2e = whole run (vs the workload bound)."""
    head = (f"{key:>9} {'scheduler':<14}{'tok/s':>8}{'dec tok/s':>10}{'depth':>6}{'dec /CB':>8}{'cpu':>7}"
            f"{'bound':>7}{'%bnd':>7}{'%cpu':>7}{'e2e /CB':>8}{'wl bnd':>7}{'%bnd':>7}{'%busy':>7}")
    lines = [head, "-" * len(head)]

    def f(v: Any, fmt: str) -> str:
        if isinstance(v, int | float) and v == v:
            return format(v, fmt)
        return "-".rjust(int(fmt.split(".")[0]))

    for r in rows:
        rz = r.get("realized", {})
        x = r.get(key)
        xs = f"{x:g}" if isinstance(x, int | float) else str(x)
        pct = {k: (100 * v if v is not None else None) for k, v in rz.items()}
        lines.append(
            f"{xs:>9} {LABELS.get(r['scheduler'], r['scheduler']):<14}{f(r['e2e_tokens_per_s'], '8.1f')}"
            f"{f(r['decode_tokens_per_s'], '10.1f')}{f(r['mean_exit_depth'], '6.2f')}"
            f"{f(r.get('norm_decode'), '8.3f')}{f(r.get('norm_decode_cpu'), '7.3f')}{f(r['decode_bound'], '7.3f')}"
            f"{f(pct.get('decode'), '7.1f')}{f(pct.get('decode_cpu'), '7.1f')}{f(r.get('norm_e2e'), '8.3f')}"
            f"{f(r['workload_bound'], '7.3f')}{f(pct.get('e2e'), '7.1f')}"
            f"{f(100 * r['device_busy'] if r.get('device_busy') is not None else None, '7.1f')}")
    for r in rows:  # CUDA graphs: a short run pays every capture once, inside its decode time
        if r.get("graph_capture_s"):
            x, name = r.get(key), LABELS.get(r["scheduler"], r["scheduler"])
            lines.append(f"{x if isinstance(x, str) else format(x, 'g'):>9} {name}: {r['graph_buckets']} graphs "
                         f"captured in {r['graph_capture_s']:.2f} s; decode without them "
                         f"{r['warm_decode_tokens_per_s']:.1f} tok/s,{f(r.get('norm_warm_decode'), '6.3f')}x CB")
    return "\n".join(lines)
