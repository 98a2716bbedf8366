"""`loopserve bench compile`: does `torch.compile` of the model's stage functions help (issue 10 item 5)?

For a stage (`core_step` or `coda`) and each variant, on decode batches of `width` rows at `context`
cached tokens (inputs from `step_latency.core_inputs`, all points sharing one KV store as an engine's
steps do, a fresh `ForwardContext` per call as the engine builds one per tick):

- **variants**: `eager`; `default` (`torch.compile(stage)`); `dynamic` (`dynamic=True`);
  `max-autotune` (`mode="max-autotune-no-cudagraphs"`, `dynamic=True`); `mlp` (the stage left eager,
  every `*.mlp` submodule compiled: the linear + silu part alone, which sees only tensors);
- **compile**: wall and CPU seconds of a point's first call (CPU includes the C++ compiler's child
  processes) and the graphs Dynamo compiled for it (`counters["stats"]["unique_graphs"]`);
- **steady state**: per-call CPU time (`time.process_time`), the variants interleaved call by call;
  medians, and the median of per-round ratios eager / variant;
- **outputs**: bitwise equal to eager or not, and the largest absolute difference;
- **ticks**: graphs compiled over a seeded run of ticks whose width and context change every tick, as
  an engine's do, with Dynamo's own recompile limit (traced with the `eager` backend: guards and
  recompiles are Dynamo's, independent of the backend, and nothing is code-generated);
- **explain**: graphs and graph breaks of the stage (`torch._dynamo.explain`).

The timing grid raises Dynamo's recompile limit so that every point gets its own graph; the tick run
shows what the default limit does to a stage that recompiles per width.
"""

from __future__ import annotations

import copy
import dataclasses
import random
import resource
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

from loopserve_lab.bench.step_latency import core_inputs, random_store

VARIANTS = ("eager", "default", "dynamic", "max-autotune", "mlp")
STAGES = ("core", "coda")


def _dynamo() -> Any:
    """torch._dynamo, imported when a run needs it: importing it takes 1.6 s on this CPU, and every `loopserve`
    command imports this module for its flags' choices."""
    import torch._dynamo
    import torch._dynamo.utils
    return torch._dynamo


def _graphs() -> int:
    return int(_dynamo().utils.counters["stats"]["unique_graphs"])


def _cpu_with_children() -> float:
    child = resource.getrusage(resource.RUSAGE_CHILDREN)
    return time.process_time() + child.ru_utime + child.ru_stime


def with_compiled_mlps(model: Any, backend: str = "inductor") -> Any:
    """A copy of `model` whose `*.mlp` submodules are compiled (the original is left as it is)."""
    twin = copy.deepcopy(model)
    for name, mod in list(twin.named_modules()):
        if name.endswith(".mlp"):
            parent, _, attr = name.rpartition(".")
            setattr(twin.get_submodule(parent), attr, torch.compile(mod, backend=backend))
    return twin


def stage_fn(model: Any, stage: str, variant: str, backend: str = "inductor") -> Callable[..., torch.Tensor]:
    """f(state, inject, ctx) running `stage` of `model` as `variant`."""
    if variant == "mlp":
        model = with_compiled_mlps(model, backend)
    fn = model.core_step if stage == "core" else model.coda
    if variant == "default":
        fn = torch.compile(fn, backend=backend)
    elif variant == "dynamic":
        fn = torch.compile(fn, backend=backend, dynamic=True)
    elif variant == "max-autotune":
        fn = torch.compile(fn, backend=backend, dynamic=True, mode="max-autotune-no-cudagraphs")
    elif variant not in ("eager", "mlp"):
        raise ValueError(f"variant: expected one of {VARIANTS}, got {variant!r}")
    if stage == "core":
        return fn
    return lambda state, inject, ctx: fn(state, ctx)


def _fresh(ctx: Any) -> Any:
    return dataclasses.replace(ctx, cache={})  # the engine builds a new context every tick


@torch.inference_mode()
def explain(model: Any, stage: str, width: int, context: int) -> dict[str, Any]:
    """Graphs and graph breaks Dynamo finds in `stage` at one point."""
    state, inject, ctx = core_inputs(model, width, context)
    fn = model.core_step if stage == "core" else (lambda s, i, c: model.coda(s, c))
    ex = _dynamo().explain(fn)(state, inject, _fresh(ctx))
    return {"graphs": ex.graph_count, "graph_breaks": ex.graph_break_count, "ops": ex.op_count,
            "break_reasons": [b.reason for b in ex.break_reasons]}


@torch.inference_mode()
def ticks(model: Any, stage: str, variant: str, n_ticks: int, max_width: int, contexts: tuple[int, int],
          seed: int = 0) -> dict[str, Any]:
    """Graphs compiled per tick over `n_ticks` ticks of random width (1..max_width) and context, under
    Dynamo's default recompile limit, traced with the `eager` backend."""
    dynamo = _dynamo()
    dynamo.reset()
    dynamo.utils.counters.clear()
    rng = random.Random(seed)
    kv = random_store(model, max_width * (contexts[1] + 1))
    fn = stage_fn(model, stage, variant, backend="eager")
    per_tick = []
    for _ in range(n_ticks):
        width, context = rng.randint(1, max_width), rng.randint(*contexts)
        state, inject, ctx = core_inputs(model, width, context, kv=kv)
        before = _graphs()
        fn(state, inject, ctx)
        per_tick.append(_graphs() - before)
    limit_hit = any("recompile limit" in k.lower() for k in dynamo.utils.counters["unimplemented"])
    dynamo.reset()
    return {"variant": variant, "graphs_per_tick": per_tick, "graphs": sum(per_tick),
            "recompile_limit_hit": limit_hit}


@torch.inference_mode()
def measure(model: Any, stage: str, variants: list[str], widths: list[int], contexts: list[int],
            reps: int = 10, seed: int = 0, backend: str = "inductor", progress: bool = True) -> list[dict[str, Any]]:
    """One record per (context, width): per variant its compile cost, steady-state CPU time and exactness."""
    from tqdm import tqdm

    dynamo = _dynamo()
    dynamo.reset()
    dynamo.utils.counters.clear()
    limit = dynamo.config.recompile_limit
    dynamo.config.recompile_limit = 64  # a graph per point: the tick run shows the default limit
    try:
        kv = random_store(model, max(widths) * (max(contexts) + 1), seed=seed)
        fns = {v: stage_fn(model, stage, v, backend) for v in ["eager", *[v for v in variants if v != "eager"]]}
        points = []
        grid = [(c, w) for c in contexts for w in widths]
        for context, width in tqdm(grid, desc=f"compile {stage}", disable=not progress):
            state, inject, ctx = core_inputs(model, width, context, seed=seed, kv=kv)
            point: dict[str, Any] = {"context": context, "width": width, "variants": {}}
            ref = fns["eager"](state, inject, _fresh(ctx)).clone()
            for v, fn in fns.items():  # first call: compiles (or not), and the output check
                g0, wall, cpu = _graphs(), time.perf_counter(), _cpu_with_children()
                out = fn(state, inject, _fresh(ctx))
                rec = {"first_call_wall_s": time.perf_counter() - wall,
                       "first_call_cpu_s": _cpu_with_children() - cpu, "new_graphs": _graphs() - g0,
                       "bitwise_equal": bool(torch.equal(out, ref)),
                       "max_abs_diff": float((out.double() - ref.double()).abs().max()),
                       "new_graphs_second_call": 0}
                g1 = _graphs()
                fn(state, inject, _fresh(ctx))
                rec["new_graphs_second_call"] = _graphs() - g1
                point["variants"][v] = rec
            times: dict[str, list[float]] = {v: [] for v in fns}
            for _ in range(reps):  # interleaved, call by call
                for v, fn in fns.items():
                    c = _fresh(ctx)
                    t0 = time.process_time()
                    fn(state, inject, c)
                    times[v].append(time.process_time() - t0)
            for v, ts in times.items():
                point["variants"][v].update({
                    "median_us": statistics.median(ts) * 1e6, "min_us": min(ts) * 1e6,
                    "speedup": statistics.median(e / t for e, t in zip(times["eager"], ts, strict=True))})
            points.append(point)
        return points
    finally:
        dynamo.config.recompile_limit = limit
        dynamo.reset()


def run(model: Any, stages: list[str], variants: list[str], widths: list[int], contexts: list[int],
        reps: int = 10, n_ticks: int = 24, seed: int = 0, backend: str = "inductor",
        progress: bool = True) -> dict[str, Any]:
    """`explain`, `ticks` and `measure` for each stage; `backend` other than inductor (`eager`,
    `aot_eager`) only checks the plumbing quickly."""
    import torch._inductor.config as inductor_config

    inductor_config.compile_threads = 1  # compile in this process: modest CPU, and its CPU time is counted
    inductor_config.fx_graph_cache = False  # cold compiles: no graphs reused from an earlier run's disk cache
    res: dict[str, Any] = {"stages": {}}
    for stage in stages:
        res["stages"][stage] = {
            "explain": explain(model, stage, widths[0], contexts[0]),
            "ticks": [ticks(model, stage, v, n_ticks, max(widths), (min(contexts), max(contexts)), seed)
                      for v in variants if v != "eager"],
            "points": measure(model, stage, variants, widths, contexts, reps, seed, backend, progress)}
    return res


def format_markdown(res: dict[str, Any]) -> str:
    out = []
    for stage, r in res["stages"].items():
        ex = r["explain"]
        out.append(f"**{stage}**: `torch._dynamo.explain`: {ex['graphs']} graph(s), {ex['graph_breaks']} "
                   f"graph break(s), {ex['ops']} ops.")
        out.append("")
        variants = [v for v in r["points"][0]["variants"] if v != "eager"]
        out.append("| context | width | eager µs | " + " | ".join(f"{v} µs (x eager)" for v in variants)
                   + " | first call s (graphs) | bitwise equal / max diff |")
        out.append("|---" * (4 + len(variants)) + "|---|")
        for p in r["points"]:
            vs = p["variants"]
            cells = [f"{vs[v]['median_us']:,.0f} ({vs[v]['speedup']:.2f})" for v in variants]
            first = ", ".join(f"{vs[v]['first_call_wall_s']:.1f} ({vs[v]['new_graphs']})" for v in variants)
            exact = ", ".join("yes" if vs[v]["bitwise_equal"] else f"{vs[v]['max_abs_diff']:.2g}" for v in variants)
            out.append(f"| {p['context']} | {p['width']} | {vs['eager']['median_us']:,.0f} | " + " | ".join(cells)
                       + f" | {first} | {exact} |")
        out.append("")
        for t in r["ticks"]:
            out.append(f"- ticks, `{t['variant']}`: {t['graphs']} graphs over {len(t['graphs_per_tick'])} ticks "
                       f"({' '.join(map(str, t['graphs_per_tick']))})"
                       + ("; Dynamo's recompile limit hit: later ticks run eager" if t["recompile_limit_hit"] else ""))
        out.append("")
    return "\n".join(out)
