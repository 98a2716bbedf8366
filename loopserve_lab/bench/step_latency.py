"""`loopserve bench step-latency`: latency of one core (loop) step against batch size and context.

Each point runs `model.core_step` on B rows whose sequences hold `context` cached tokens (random
K/V in a paged store, every key visible), so it measures the model's step alone: the weights read
once per step, plus per-row compute and KV reading. A sequence's rows are one contiguous run by
default (`--kv-blocks contiguous`, a prompt's blocks in a fresh pool), or (`scattered`) blocks of the
engine's default size placed at random over the store, as the blocks of sequences that decode side by
side lie in a serving engine's pool: each takes its next block wherever the free list has one. Per
context, a least-squares line t(B) = floor + slope x B is fitted; B* = floor / slope is the batch
where adding rows stops being nearly free (docs/design.md §7.3). The fit uses the minimum over
repeats by default, which filters out preemption on a shared machine; the median is kept too.
"""

from __future__ import annotations

import statistics
import time
from typing import Any

import numpy as np
import torch

from loopserve.cache.layout import KVLayout
from loopserve.cache.pool import KVStore
from loopserve.engine.config import EngineConfig
from loopserve.engine.graphs import capture
from loopserve.models.context import build_context


def fit_linear(batches: list[float], latencies: list[float]) -> dict[str, float]:
    """Least-squares t(B) = floor + slope B; B* = floor / slope (inf if slope <= 0); r2 of the fit."""
    b = np.asarray(batches, dtype=float)
    t = np.asarray(latencies, dtype=float)
    if b.size < 2 or np.ptp(b) == 0:
        raise ValueError("need at least two distinct batch sizes to fit")
    slope, floor = np.polyfit(b, t, 1)
    pred = floor + slope * b
    ss_res = float(((t - pred) ** 2).sum())
    ss_tot = float(((t - t.mean()) ** 2).sum())
    return {"floor_s": float(floor), "slope_s": float(slope),
            "b_star": float(floor / slope) if slope > 0 else float("inf"),
            "r2": 1 - ss_res / ss_tot if ss_tot > 0 else 1.0}


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


KV_BLOCKS = ("contiguous", "scattered")
SCATTER_BLOCK = EngineConfig.block_size  # rows of a block when `scattered`: the engine's default


def sequence_rows(batch: int, per: int, blocks: str = "contiguous", seed: int = 0) -> list[torch.Tensor]:
    """The physical rows of `batch` sequences of `per` tokens each, in a store of `store_rows(batch, per)`
    rows: one contiguous run per sequence, or (`scattered`) blocks of `SCATTER_BLOCK` rows in a random
    order over the whole store."""
    if blocks == "contiguous":
        return [torch.arange(i * per, (i + 1) * per) for i in range(batch)]
    if blocks != "scattered":
        raise ValueError(f"blocks: one of {KV_BLOCKS}, got {blocks!r}")
    n = -(-per // SCATTER_BLOCK)  # blocks per sequence
    order = torch.randperm(batch * n, generator=torch.Generator().manual_seed(seed))
    rows = (order.view(batch, n, 1) * SCATTER_BLOCK + torch.arange(SCATTER_BLOCK)).view(batch, -1)
    return list(rows[:, :per])


def store_rows(batch: int, per: int, blocks: str = "contiguous") -> int:
    """Rows a store needs for `sequence_rows(batch, per, blocks)`."""
    return batch * (per if blocks == "contiguous" else -(-per // SCATTER_BLOCK) * SCATTER_BLOCK)


def core_inputs(model: Any, batch: int, context: int, layout: str = "shared", depth: int = 2,
                seed: int = 0, kv: KVStore | None = None,
                blocks: str = "contiguous") -> tuple[torch.Tensor, torch.Tensor | None, Any]:
    """(state, inject, ctx) for one decode core step of `batch` rows whose sequences hold `context`
    cached tokens each: random K/V in a paged store, every key visible, all rows at `depth`, each
    sequence's rows laid out as `blocks` says (`sequence_rows`). The store is `kv` when given (one made
    by `random_store` with room for `store_rows(batch, context + 1, blocks)` rows, so that several points
    share one store, as an engine's steps do), else a store of its own."""
    c = model.config
    p = next(model.parameters())
    lay = KVLayout(layout, c.n_prelude, c.n_core, c.n_coda, c.r_max)
    per = context + 1
    g = torch.Generator(device="cpu").manual_seed(seed)
    kv = random_store(model, store_rows(batch, per, blocks), layout, seed) if kv is None else kv
    segs = [(rows, context, 1) for rows in sequence_rows(batch, per, blocks, seed)]
    ctx = build_context(kv, lay, segs, torch.full((batch,), depth))
    state = torch.randn(batch, c.hidden_size, generator=g).to(p)
    inject = torch.randn(batch, c.hidden_size, generator=g).to(p) if model.injects else None
    return state, inject, ctx


def random_store(model: Any, rows: int, layout: str = "shared", seed: int = 0) -> KVStore:
    """A paged KV store of `rows` rows filled with random K/V, every row at KV depth r_max."""
    c = model.config
    p = next(model.parameters())
    lay = KVLayout(layout, c.n_prelude, c.n_core, c.n_coda, c.r_max)
    kv = KVStore(rows, lay.slots_per_token, c.num_kv_heads, c.head_dim, p.dtype, p.device)
    # drawn where the store lives, in its dtype: at Ouro-1.4B's shapes, batch 64 and context 1k, K and V are 6.4G
    # numbers, which drawn on the host in fp32 and copied up took most of a GPU lease's minute per point
    g = torch.Generator(device=kv.k.device).manual_seed(seed)
    kv.k.normal_(generator=g)
    kv.v.normal_(generator=g)
    kv.k[:, :, kv.zero_row] = 0  # (the row masked keys read stays zero, as in an engine's store)
    kv.v[:, :, kv.zero_row] = 0
    kv.depth.fill_(c.r_max)
    return kv


@torch.inference_mode()
def measure_point(model: Any, batch: int, context: int, reps: int = 5, warmup: int = 2,
                  layout: str = "shared", depth: int = 2, seed: int = 0, cuda_graph: bool = False,
                  blocks: str = "contiguous") -> dict[str, Any]:
    """Latencies (s) of `reps` core steps for `batch` rows at `context` cached tokens each. `cuda_graph`: the
    step captured once as a CUDA graph and each rep a replay, so no launch from Python is timed (the rotary
    angles and key rows, which the engine derives once per stage call, are made before the capture)."""
    p = next(model.parameters())
    state, inject, ctx = core_inputs(model, batch, context, layout, depth, seed, blocks=blocks)

    def eager() -> None:
        model.core_step(state, inject, ctx)

    step = eager
    if cuda_graph:
        eager()  # (the context's per-call values, made outside the graph)
        step = capture(eager, p.device)
    times = []
    for i in range(warmup + reps):
        _sync(p.device)
        t0 = time.perf_counter()
        step()
        _sync(p.device)
        if i >= warmup:
            times.append(time.perf_counter() - t0)
    return {"batch": batch, "context": context, "times_s": times, "min_s": min(times),
            "median_s": statistics.median(times)}


def step_latency(model: Any, batches: list[int], contexts: list[int], reps: int = 5, stat: str = "min",
                 layout: str = "shared", progress: bool = True, fit_max_batch: int | None = None,
                 cuda_graphs: bool = False, blocks: str = "contiguous") -> dict[str, Any]:
    """Measure the grid (`cuda_graphs`: replayed steps, see `measure_point`; `blocks`: `sequence_rows`); fit
    per context on the points with batch <= `fit_max_batch` (all if None)."""
    if cuda_graphs and next(model.parameters()).device.type != "cuda":
        raise ValueError("cuda_graphs: replays CUDA graphs, so the model must be on a CUDA device")
    from tqdm import tqdm

    points = []
    grid = [(c, b) for c in contexts for b in batches]
    for c, b in tqdm(grid, desc="step latency", disable=not progress):
        pt = measure_point(model, b, c, reps, layout=layout, cuda_graph=cuda_graphs, blocks=blocks)
        pt["latency_s"] = pt["min_s" if stat == "min" else "median_s"]
        points.append(pt)
    return {"stat": stat, "layout": layout, "kv_blocks": blocks, "cuda_graphs": cuda_graphs, "points": points,
            "fits": fit_all(points, fit_max_batch)}


def fit_all(points: list[dict[str, Any]], fit_max_batch: int | None = None) -> list[dict[str, Any]]:
    """One fit per context, on the points with batch <= `fit_max_batch` (all if None)."""
    fits = []
    for c in sorted({p["context"] for p in points}):
        pts = [p for p in points if p["context"] == c and (fit_max_batch is None or p["batch"] <= fit_max_batch)]
        if len({p["batch"] for p in pts}) >= 2:
            fits.append({"context": c, "max_batch": max(p["batch"] for p in pts),
                         **fit_linear([p["batch"] for p in pts], [p["latency_s"] for p in pts])})
    return fits


def format_step_latency(res: dict[str, Any]) -> str:
    out = [f"{'context':>8}{'batch':>7}{'latency ms':>12}{'per row ms':>12}"]
    for p in res["points"]:
        out.append(f"{p['context']:>8}{p['batch']:>7}{p['latency_s'] * 1e3:>12.3f}"
                   f"{p['latency_s'] * 1e3 / p['batch']:>12.3f}")
    out.append("")
    out.append(f"{'context':>8}{'fit B <=':>9}{'floor ms':>10}{'slope ms/row':>14}{'B*':>8}{'r2':>7}")
    for f in res["fits"]:
        out.append(f"{f['context']:>8}{f.get('max_batch', '-'):>9}{f['floor_s'] * 1e3:>10.3f}"
                   f"{f['slope_s'] * 1e3:>14.4f}{f['b_star']:>8.1f}{f['r2']:>7.3f}")
    return "\n".join(out)
