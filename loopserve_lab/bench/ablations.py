"""`loopserve bench ablate ...`: the paper's ablations, on the bench models.

* `min-coda`: CDB refill with a minimum coda batch of 1, 2, 4, ... (fewer, fuller coda ticks
  against tokens waiting longer), normalized to CB on the same workload and traces.
* `huginn-split`: Huginn-like models with the same core and 0-4-0, 1-4-1, 2-4-2 layer splits:
  the bigger the boundary stages (F0 / Fr), the lower the bound and the realized speed-up.
* `overhead`: where the wall time of a CDB refill run goes, synchronous exits against delayed
  (lookahead) exits: model compute, runner (row gathering, attention context), scheduler
  (`EngineStats.schedule_time`), other (output assembly). On a CPU everything runs eagerly in one
  thread, so lookahead cannot overlap scheduling with compute here; its cost (one extra loop per
  early exit) is what this measures.
* `overlap`: CDB refill exiting on the model's live signal (Ouro's gate, Huginn's latent change):
  synchronous exits, lookahead with each step's signals read at once, lookahead pipelined (a step's
  signals read after the next step is queued), and pipelined with async codas (a coda's tokens
  sampled after the next batch is queued). Modes 2 and 3 run the same schedule, so their ratio is
  what pipelining buys: on a GPU the host plans tick t+1 while the device runs tick t; on a CPU
  nothing can overlap and the ratio should be 1.
* `trace`: the schedule trace (stage and batch size of every tick) of CDB no-refill and CDB refill
  on the same short workload, as JSON and a picture.
"""

from __future__ import annotations

from typing import Any

from loopserve.engine.config import ENGINE_SCHEDULERS
from loopserve_lab.bench.bounds import run_bounds
from loopserve_lab.bench.harness import BenchModel, run_offline
from loopserve_lab.bench.throughput import compare_point
from loopserve_lab.bench.workloads import Workload


def min_coda(bm: BenchModel, workload: Workload, traces: list[list[int]] | None, width: int,
             values: list[int], repeats: int = 1, progress: bool = True, **overrides: Any) -> list[dict[str, Any]]:
    rows = []
    base = compare_point(bm, workload, traces, width, ("cb",), repeats, progress, "min-coda base", **overrides)[0]
    for v in values:
        for rep in range(repeats):
            r = run_offline(bm, workload, traces, "cdb", width, progress=progress, desc=f"min_coda_batch={v}",
                            min_coda_batch=v, **overrides)
            rows.append({"min_coda_batch": v, "rep": rep, "decode_tokens_per_s": r.decode_tokens_per_s,
                         "tokens_per_s": r.tokens_per_s, "decode_cpu_tokens_per_s": r.decode_cpu_tokens_per_s,
                         "norm_decode": r.decode_tokens_per_s / base["decode_tokens_per_s"],
                         "norm_decode_cpu": r.decode_cpu_tokens_per_s / base["decode_cpu_tokens_per_s"],
                         "ticks": r.ticks, "rows": r.rows, "mean_exit_depth": r.mean_exit_depth,
                         "overhead": r.overhead()})
    return [{"baseline_cb": base}, *rows]


def huginn_split(models: dict[str, BenchModel], workload_for: Any, traces_for: Any, width: int, repeats: int = 1,
                 progress: bool = True, **overrides: Any) -> list[dict[str, Any]]:
    """`models`: split label -> loaded model; `workload_for(bm)`, `traces_for(bm, workload)` build the
    (identical) workload and traces for each."""
    rows = []
    for split, bm in models.items():
        wl = workload_for(bm)
        tr = traces_for(bm, wl)
        for r in compare_point(bm, wl, tr, width, ENGINE_SCHEDULERS, repeats, progress,
                               f"split {split}", **overrides):
            r["split"] = split
            rows.append(r)
    return rows


def overhead(bm: BenchModel, workload: Workload, traces: list[list[int]] | None, width: int, repeats: int = 1,
             progress: bool = True, **overrides: Any) -> list[dict[str, Any]]:
    rows = []
    for rep in range(repeats):
        for sched, lookahead in (("cb", False), ("cdb", False), ("cdb", True)):
            kw = dict(overrides)
            kw["lookahead"] = lookahead
            r = run_offline(bm, workload, traces, sched, width, progress=progress,
                            desc=f"{sched} {'lookahead' if lookahead else 'sync'}", sync_steps=True, **kw)
            b = run_bounds(bm.hf_config, bm.r_max, r.mean_exit_depth, r.prompt_tokens, r.decode_items)
            rows.append({"scheduler": sched, "mode": "lookahead" if lookahead else "synchronous", "rep": rep,
                         "wall_s": r.wall_s, "compute_s": r.compute_s, "model_time_s": r.model_time_s,
                         "schedule_time_s": r.schedule_time_s, "overhead": r.overhead(),
                         "compute_by_stage": r.compute_by_stage, "stage_wall_s": r.stage_wall_s,
                         "ticks": r.ticks, "decode_tokens_per_s": r.decode_tokens_per_s,
                         "tokens_per_s": r.tokens_per_s, "mean_exit_depth": r.mean_exit_depth,
                         "loops_per_item": r.rows.get("core", 0) / max(r.decode_items, 1),
                         "decode_bound": b["decode_bound"]})
    return rows


OVERLAP_MODES = {  # mode -> engine knobs
    "synchronous exits": {"lookahead": False, "async_coda": False},
    "lookahead, read at once": {"lookahead": True, "pipeline_core_steps": False, "async_coda": False},
    "lookahead, pipelined": {"lookahead": True, "pipeline_core_steps": True, "async_coda": False},
    "pipelined + async coda": {"lookahead": True, "pipeline_core_steps": True, "async_coda": True},
}


def overlap(bm: BenchModel, workload: Workload, width: int, rule: tuple[str, float], repeats: int = 1,
            progress: bool = True, **overrides: Any) -> list[dict[str, Any]]:
    """Modes 2 and 3 run the identical schedule (same ticks, same outputs); only when the host reads
    the exit signals differs, so their wall-time ratio is what pipelining the core steps buys. Mode 4
    also samples each coda's tokens after the next batch is queued (they refill a tick later)."""
    rows = []
    for rep in range(repeats):
        modes = list(OVERLAP_MODES.items())
        # ABBA order: a machine that drifts slower over the run hits every mode alike
        for mode, knobs in modes if rep % 2 == 0 else modes[::-1]:
            r = run_offline(bm, workload, None, "cdb", width, progress=progress, desc=f"overlap: {mode}",
                            rule=rule, **knobs, **overrides)
            rows.append({"mode": mode, "rep": rep, "rule": list(rule), "wall_s": r.wall_s, "ticks": r.ticks,
                         "deferred_signal_ticks": r.deferred_signal_ticks,
                         "loops_per_item": r.rows.get("core", 0) / max(r.decode_items, 1),
                         "mean_exit_depth": r.mean_exit_depth, "decode_tokens_per_s": r.decode_tokens_per_s,
                         "schedule_time_s": r.schedule_time_s})
    return rows


def schedule_traces(bm: BenchModel, workload: Workload, traces: list[list[int]] | None, width: int,
                    progress: bool = True, **overrides: Any) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for sched in ("cdb-norefill", "cdb"):
        r = run_offline(bm, workload, traces, sched, width, progress=progress, record_schedule=True,
                        desc=f"trace {sched}", **overrides)
        out[sched] = {"ticks": r.schedule_trace, "summary": {"ticks": r.ticks, "rows": r.rows,
                                                             "refill_events": r.refill_events,
                                                             "wall_s": r.wall_s}}
    return out
