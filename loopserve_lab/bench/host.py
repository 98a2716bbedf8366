"""`loopserve bench host`: the engine's own cost per tick, with model compute taken out.

A null model (`NullLM`, Ouro- or Huginn-shaped: `--arch`) implements the stage API with a few O(rows)
tensor ops and no attention:
its stages return tensors of the right shapes and never read the KV cache; its exit gate is a cheap
hash of the state, so tokens exit at mixed depths (mean about 2.5 of 4) and the exit bookkeeping,
signal readback and refill paths all run. What remains of a tick is the host path that a real
model pays on top of its compute: scheduling, building the attention context (row maps, key
tables), gathering state rows, sampling, exit bookkeeping, detokenization and output assembly.
The null model's own time is measured and reported apart (`null_us`), so `host = tick - null`.

Each point runs `width` requests with prompts of `context` tokens (CB: one cohort of `width`; CDB
refill: the same requests, re-forming the batch every loop), skips the prefill ticks and times
every decode tick (`engine.step()`), wall and process CPU clock, grouped by the stage the tick was
planned for (a coda tick includes the preludes of the tokens it sampled, which CDB refill runs in
the same tick). The engine thread's own CPU clock is read too: what the process spent beyond it went to
other threads (reported apart, "other threads"; it should be about zero: a library's thread pool that
spins beside the engine costs a core and inflates the process clock).

The projection of device idle (clearly a projection, nothing ran on a GPU) replays the measured run
tick by tick: each tick's host time on this CPU against the roofline time its stage batches would take
on an H100 or H200 for Ouro-1.4B / Huginn-0125 at the same rows and context
(`theory.step_time_estimate`: a core step, and a coda tick's coda plus the preludes that run in it).
Two schedules: `serial` (the host works only while the device waits: idle = host / (host + device),
what a step whose results are read at once costs) and `pipelined` (one tick deep, as the engine runs
pipelined core steps and async codas: while the device runs tick t the host does tick t+1's work, so
the device idles max(0, host[t+1] - device[t]) after tick t).
"""

from __future__ import annotations

import gc
import statistics
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from loopserve.engine.config import EngineConfig
from loopserve.engine.engine import LLMEngine, StageRecord
from loopserve.models.base import LoopedLM
from loopserve.models.loader import LoadedModel, load_model
from loopserve.sampling_params import RequestOutputKind, SamplingParams
from loopserve_lab.bench.harness import pool_model_len
from loopserve_lab.bench.theory import HUGINN_0125, OURO_1_4B, ROOFLINE_DEVICES, step_time_estimate
from loopserve_lab.tiny import TinySpec, make_tiny, tiny_arch

# the null models' checkpoints (their config and tokenizer; the weights go unused): Ouro-shaped (a prelude and a
# coda without layers) and Huginn-shaped (prelude and coda blocks, whose KV the engine plans: contexts are built
# for those stages too, an injection row is kept per token, and codas and preludes wait for fuller batches:
# `EngineConfig.boundary_batches_for`)
NULL_SPECS = {
    "ouro": TinySpec(arch="ouro", hidden_size=8, num_heads=1, intermediate_size=16, vocab_size=512, layers="1",
                     r_max=4, max_position=8192, seed=0),
    "huginn": TinySpec(arch="huginn", hidden_size=8, num_heads=1, intermediate_size=16, vocab_size=512,
                       layers="1-1-1", r_max=4, max_position=8192, state_init="zero", seed=0),
}
OUTPUT_TOKENS = 16
PROJECTED = {"ouro-1.4b": OURO_1_4B, "huginn-0125": HUGINN_0125}


class NullLM(LoopedLM):
    """The stage API of `shape` (a loaded model: its config, and whether it injects) at (almost) no cost:
    state[:, 0] is a hash of (token, position), state[:, 1] counts loops. `seconds` accumulates the CPU time
    spent inside the stages (the clock the host time is read on, so `host = tick - null` never mixes clocks)."""

    has_gate = True

    def __init__(self, shape: LoopedLM) -> None:
        super().__init__()
        self.config = shape.config
        self.injects = shape.injects  # (Huginn: an injection row per token, as the real model's)
        self.anchor = nn.Parameter(torch.zeros(1))  # the engine reads dtype and device from parameters
        self.seconds = 0.0

    def _timed(self, t0: float) -> None:
        # (through __dict__: nn.Module.__setattr__ takes about 2 us, which would count as host time)
        self.__dict__["seconds"] += time.process_time() - t0

    def prelude(self, token_ids, ctx, state_seeds=None):
        t0 = time.process_time()
        state = torch.zeros(token_ids.shape[0], self.config.hidden_size)
        state[:, 0] = token_ids * 0.6180339  # (the context, built for Huginn's prelude blocks, goes unread)
        inject = state.clone() if self.injects else None
        self._timed(t0)
        return state, inject

    def core_step(self, state, inject, ctx):
        t0 = time.process_time()
        out = state.clone()
        first = state[:, 1] == 0  # the first step mixes in the position (the hash the prelude used to take)
        out[:, 0] = torch.where(first, (state[:, 0] + ctx.positions * 0.1234567) % 1.0, state[:, 0])
        out[:, 1] += 1
        self._timed(t0)
        return out

    def gate_logit(self, state):
        t0 = time.process_time()
        u = (state[:, 0] * 7.31 + state[:, 1] * 0.377) % 1.0
        logit = (u - 0.77) * 6.0
        self._timed(t0)
        return logit

    def coda(self, state, ctx, logit_rows=None):
        t0 = time.process_time()
        rows = state if logit_rows is None else state[logit_rows]
        logits = torch.zeros(rows.shape[0], self.config.vocab_size)
        logits[torch.arange(rows.shape[0]), (rows[:, 0] * 997 + rows[:, 1]).long() % self.config.vocab_size] = 1.0
        self._timed(t0)
        return logits


@dataclass
class StageCost:
    ticks: int = 0
    rows: int = 0
    wall_s: float = 0.0
    cpu_s: float = 0.0
    # the engine thread's own CPU time: the process clock less this is what other threads spent meanwhile (a
    # BLAS pool's workers spinning after a call counted several ms a tick: docs/benchmarks.md §8.49)
    thread_s: float = 0.0
    null_s: float = 0.0
    # each tick's host CPU seconds: the median is a steady tick's cost, where the mean also carries the ticks
    # in which requests finish (all of a CB cohort's in its last coda tick: their text, blocks, outputs)
    host_s: list[float] = field(default_factory=list)

    def as_dict(self) -> dict[str, float]:
        n = max(self.ticks, 1)
        return {"ticks": self.ticks, "mean_rows": self.rows / n, "tick_us": 1e6 * self.wall_s / n,
                "tick_cpu_us": 1e6 * self.cpu_s / n, "null_us": 1e6 * self.null_s / n,
                "other_threads_us": 1e6 * (self.cpu_s - self.thread_s) / n,
                "host_cpu_us": 1e6 * (self.cpu_s - self.null_s) / n,
                "host_cpu_us_median": 1e6 * statistics.median(self.host_s) if self.host_s else 0.0,
                "host_cpu_us_per_row": 1e6 * (self.cpu_s - self.null_s) / max(self.rows, 1)}


@dataclass
class HostPoint:
    scheduler: str
    width: int
    context: int
    output_kind: str = "cumulative"
    arch: str = "ouro"  # the null model's shape (`NULL_SPECS`)
    stages: dict[str, StageCost] = field(default_factory=dict)
    mean_exit_depth: float = 0.0
    # every decode tick in order: (host seconds, [(stage, rows) of each batch it ran]); for the projection
    ticks: list[tuple[float, list[tuple[str, int]]]] = field(default_factory=list)
    # with repeats: each stage's host us per tick in every run of the point (this point is the fastest run)
    runs: dict[str, list[int]] = field(default_factory=dict)

    @property
    def host_s(self) -> float:
        return sum(h for h, _ in self.ticks)

    def as_dict(self) -> dict[str, Any]:
        return {"scheduler": self.scheduler, "width": self.width, "context": self.context,
                "output_kind": self.output_kind, "arch": self.arch,
                "mean_exit_depth": self.mean_exit_depth,
                "stages": {s: c.as_dict() for s, c in sorted(self.stages.items())},
                **({"host_cpu_us_runs": self.runs} if self.runs else {})}


def null_engine(scheduler: str, width: int, context: int, loaded: LoadedModel,
                output_len: int = OUTPUT_TOKENS) -> LLMEngine:
    block = 16
    tokens = width * (-(-(context + output_len + 1) // block) + 1) * block
    chunk = 2048
    # every prompt's next chunk in one prefill tick: all `width` requests are prefilled before the first decode
    # tick (prefill takes turns with decoding: with a smaller budget the batch would fill a few prompts a token)
    cfg = EngineConfig(scheduler=scheduler, max_decode_batch=width, max_num_seqs=width, block_size=block,
                       kv_cache_tokens=tokens, prefill_chunk_size=chunk,
                       max_num_batched_tokens=width * min(chunk, context), kv_safety_margin=0.0)
    return LLMEngine(NullLM(loaded.model), loaded.tokenizer, cfg,
                     max_model_len=pool_model_len(cfg, loaded.config.max_position))


def measure(scheduler: str, width: int, context: int, loaded: LoadedModel, seed: int = 0,
            output_kind: str = "cumulative", output_len: int = OUTPUT_TOKENS) -> HostPoint:
    """`output_kind`: "cumulative" (an output per token with everything so far), "delta" (an output per token
    with what is new, as a streamed response) or "final_only" (one per request, as `LLM.generate` and
    non-streamed responses)."""
    engine = null_engine(scheduler, width, context, loaded, output_len)
    model = engine.model
    assert isinstance(model, NullLM)
    arch = tiny_arch(loaded.config.arch)  # (the `NULL_SPECS` name)
    gen = torch.Generator().manual_seed(seed)
    params = SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True, exit_policy="gate",
                            exit_threshold=0.5, output_kind=RequestOutputKind[output_kind.upper()])
    for i in range(width):
        ids = torch.randint(1, loaded.config.vocab_size, (context,), generator=gen).tolist()
        engine.add_request(f"h{i}", ids, params)
    records: list[StageRecord] = []
    engine.stage_hooks.append(records.append)
    gc.collect()  # earlier points' garbage is not this point's host time
    point = HostPoint(scheduler, width, context, output_kind, arch)
    with torch.inference_mode():
        while engine.has_unfinished_requests():
            records.clear()
            null0, c0, th0, t0 = model.seconds, time.process_time(), time.thread_time(), time.perf_counter()
            engine.step()
            thread = time.thread_time() - th0  # (read inside the process clock's reads: other threads >= 0)
            wall, cpu, null = time.perf_counter() - t0, time.process_time() - c0, model.seconds - null0
            if not records or any(r.stage == "prefill" for r in records):
                continue
            cost = point.stages.setdefault(records[0].stage, StageCost())
            cost.ticks += 1
            cost.rows += records[0].rows
            cost.wall_s += wall
            cost.cpu_s += cpu
            cost.thread_s += thread
            cost.null_s += null
            cost.host_s.append(cpu - null)
            point.ticks.append((cpu - null, [(str(r.stage), r.rows) for r in records]))
    depths = engine.stats.exit_depths
    point.mean_exit_depth = sum(d * c for d, c in depths.items()) / max(sum(depths.values()), 1)
    return point


def run(widths: list[int], contexts: list[int], schedulers: list[str], progress: bool = True,
        output_kinds: tuple[str, ...] = ("cumulative",), output_len: int = OUTPUT_TOKENS,
        repeats: int = 1, arch: str = "ouro") -> list[HostPoint]:
    """Every point, side by side; with `repeats` > 1 the whole grid runs that many rounds and each point is
    its fastest run (least host time in all: on a shared machine noise only adds), its runs' per-stage
    figures kept in `HostPoint.runs`."""
    grid = [(sched, width, context, kind) for context in contexts for width in widths for sched in schedulers
            for kind in output_kinds]
    runs: dict[tuple[str, int, int, str], list[HostPoint]] = {key: [] for key in grid}
    with tempfile.TemporaryDirectory() as tmp:
        loaded = load_model(make_tiny(Path(tmp) / "null", NULL_SPECS[arch]), "float32", "cpu")  # (its tokenizer)
        for sched in schedulers:  # warm-up, discarded: first calls pay one-time costs (dispatch, caches)
            measure(sched, 8, 16, loaded)
        for _ in range(repeats):
            for sched, width, context, kind in grid:
                p = measure(sched, width, context, loaded, output_kind=kind, output_len=output_len)
                if progress:
                    core = p.stages.get("core", StageCost()).as_dict()
                    coda = p.stages.get("coda", StageCost()).as_dict()
                    print(f"{sched:>4} {kind:>10} width {width:4d} context {context:5d}: host us CPU per "
                          f"tick: core {core['host_cpu_us']:6.0f}, coda {coda['host_cpu_us']:6.0f} "
                          f"({coda['host_cpu_us_per_row']:.1f} us/row)", flush=True)
                runs[(sched, width, context, kind)].append(p)
    points = []
    for key in grid:
        best = min(runs[key], key=lambda p: p.host_s)
        if repeats > 1:
            best.runs = {stage: [round(r.stages[stage].as_dict()["host_cpu_us"])
                                 for r in runs[key] if stage in r.stages] for stage in sorted(best.stages)}
        points.append(best)
    return points


def projection(points: list[HostPoint]) -> list[dict[str, Any]]:
    """Projected device idle per (scheduler, model, device, width, context): the measured run's ticks
    replayed against roofline step times (module docstring), for the first output kind measured."""
    out = []
    for p in points:
        if p.output_kind != points[0].output_kind or not p.ticks:
            continue
        host = [h for h, _ in p.ticks]
        for model, cfg in PROJECTED.items():
            for dev in ("h100", "h200"):
                batches = {b for _, tick in p.ticks for b in tick}  # (stage, rows): roofline seconds
                step = {(stage, rows): step_time_estimate(cfg, ROOFLINE_DEVICES[dev], rows, p.context,
                                                          stage=stage).time_s for stage, rows in batches}
                device = [sum(step[b] for b in tick) for _, tick in p.ticks]
                h, d = sum(host), sum(device)
                # pipelined: the host's work for tick t+1 runs while the device runs tick t
                waits = [max(0.0, nxt - dt) for nxt, dt in zip([*host[1:], 0.0], device, strict=True)]
                out.append({"scheduler": p.scheduler, "model": model, "device": dev, "width": p.width,
                            "context": p.context, "ticks": len(host), "host_us_per_tick": 1e6 * h / len(host),
                            "device_us_per_tick": 1e6 * d / len(host), "idle_serial": h / (h + d),
                            "idle_pipelined": sum(waits) / (d + sum(waits))})
    return out


def format_table(points: list[HostPoint]) -> str:
    lines = ["| scheduler | outputs | width | context | stage | ticks | mean rows | host us/tick (CPU) | "
             "median tick | host us/row | null model us | other threads us | wall us/tick |", "|---" * 13 + "|"]
    for p in points:
        for stage, c in sorted(p.stages.items()):
            d = c.as_dict()
            lines.append(f"| {p.scheduler} | {p.output_kind} | {p.width} | {p.context} | {stage} | {d['ticks']} | "
                         f"{d['mean_rows']:.0f} | "
                         f"{d['host_cpu_us']:.0f} | {d['host_cpu_us_median']:.0f} | {d['host_cpu_us_per_row']:.2f} | "
                         f"{d['null_us']:.0f} | {d['other_threads_us']:.0f} | {d['tick_us']:.0f} |")
    return "\n".join(lines)


def format_projection(rows: list[dict[str, Any]]) -> str:
    lines = ["| scheduler | model | device | width | context | host us per tick (CPU, measured) | "
             "device us per tick (roofline) | idle, serial | idle, pipelined |", "|---" * 9 + "|"]
    for r in rows:
        lines.append(f"| {r['scheduler']} | {r['model']} | {r['device']} | {r['width']} | {r['context']} | "
                     f"{r['host_us_per_tick']:.0f} | {r['device_us_per_tick']:.0f} | {100 * r['idle_serial']:.0f}% | "
                     f"{100 * r['idle_pipelined']:.0f}% |")
    return "\n".join(lines)
