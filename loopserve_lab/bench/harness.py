"""Running the engine for a benchmark: load a model once, build an engine per run, replay a
workload with exit traces, and measure where the time goes.

Time accounting of an offline run (all wall clock, `time.perf_counter`):

* `wall_s`: from the first `step()` to the last (requests are added before, at t = 0);
* `compute_s`: inside the model's stage functions (`prelude`, `core_step`, `coda`, `gate_logit`),
  measured by wrapping them on the model instance: the model compute (on CUDA a device time only
  with `sync_steps`, else the time to queue the work);
* `model_time_s` (`EngineStats.model_time`): inside the runner (compute + gathering rows and
  building the attention context);
* `schedule_time_s` (`EngineStats.schedule_time`): `schedule()` and the `after_*` bookkeeping
  (sampling, exits, stop checks, detokenization);
* the rest of `wall_s`: `step()` assembling outputs, and this loop.

`cpu_s` is the process CPU time over the same span: on a shared machine it moves less than wall
time when other processes steal the cores (use `--threads 1` there).
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import platform
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from loopserve.cli import CommandError
from loopserve.device import bf16_is_emulated
from loopserve.engine.config import EngineConfig
from loopserve.engine.engine import LLMEngine, StageRecord
from loopserve.models.base import LoopedLM
from loopserve.models.loader import load_model
from loopserve.sampling_params import SamplingParams
from loopserve_lab.bench.presets import DEFAULT_DTYPE, resolve_model
from loopserve_lab.bench.workloads import Workload

log = logging.getLogger(__name__)

LABELS = {"cb": "CB", "cdb-norefill": "CDB no-refill", "cdb": "CDB refill"}


def set_threads(threads: int | None) -> None:
    if threads:
        torch.set_num_threads(int(threads))


def machine_info(device: str = "cpu") -> dict[str, Any]:
    info: dict[str, Any] = {"platform": platform.platform(), "python": platform.python_version(),
                            "torch": torch.__version__, "cpu_count": os.cpu_count(),
                            "torch_threads": torch.get_num_threads(), "device": device}
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                info["cpu"] = line.split(":", 1)[1].strip()
                break
    with contextlib.suppress(OSError, ValueError):
        info["mem_gib"] = round(int(Path("/proc/meminfo").read_text().split()[1]) / 2**20, 1)
    if device.startswith("cuda") and torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name(0)
    return info


@dataclass
class BenchModel:
    path: Path
    model: Any
    tokenizer: Any
    config: Any
    hf_config: dict
    dtype: str
    device: str

    @staticmethod
    def load(model: str | None, dtype: str = DEFAULT_DTYPE, device: str = "cpu",
             state_init: str | None = None) -> BenchModel:
        """`state_init`: Huginn's initial loop state, one of model_config.STATE_INITS (None: the checkpoint's)."""
        path = resolve_model(model)
        if dtype == "bfloat16" and bf16_is_emulated(device):
            log.warning("--dtype bfloat16 on a CPU without bfloat16 kernels: every product is emulated (about 5x "
                        "slower than float32 on an AVX2-only x86); pass --dtype float32 to measure the engine")
        loaded = load_model(path, dtype, device, state_init)
        hf = json.loads((path / "config.json").read_text())
        return BenchModel(path, loaded.model, loaded.tokenizer, loaded.config, hf, dtype, device)

    @property
    def r_max(self) -> int:
        return int(self.config.r_max)

    @property
    def name(self) -> str:
        return self.path.name

    def engine(self, seed: int = 0, timed: TimedModel | None = None, **cfg: Any) -> LLMEngine:
        """An engine on this model (`timed`: on that wrapper of it, which times the model's stages); a KV pool sized
        to the workload (`kv_cache_tokens`) is its longest request, not the model's context."""
        try:
            config = EngineConfig(**cfg)
            return LLMEngine(self.model if timed is None else timed, self.tokenizer, config, seed,
                             pool_model_len(config, self.config.max_position))
        except ValueError as e:  # a knob the engine refuses (each names its field): the command's error line
            raise CommandError(str(e)) from None


def pool_model_len(cfg: EngineConfig, max_position: int) -> int | None:
    """A benchmark engine's max_model_len: the tokens its KV pool holds where `kv_cache_tokens` sizes it to the run
    (whole blocks; at most the model's context), so that the engine does not warn of a context the run never
    needs; None (the model's context) otherwise."""
    if not cfg.kv_cache_tokens:
        return None
    return min(cfg.kv_cache_tokens // cfg.block_size * cfg.block_size, max_position)


def engine_kwargs_for(workload: Workload, width: int, max_num_seqs: int | None = None,
                      block_size: int = EngineConfig.block_size, **overrides: Any) -> dict[str, Any]:
    """Engine knobs for a run: decode width `width`, `max_num_seqs` running sequences (default
    4 x width, at most the workload size) and a KV pool that holds the `max_num_seqs` longest
    requests at full length, plus the admission safety margin."""
    try:  # (the engine's own rule for a block size, before one divides the lengths below)
        EngineConfig(block_size=block_size)
    except ValueError as e:
        raise CommandError(str(e)) from None
    seqs = max_num_seqs or max(width, min(4 * width, len(workload)))
    lengths = sorted((len(r.prompt_ids) + r.output_len + 1 for r in workload.requests), reverse=True)[:seqs]
    blocks = sum(-(-n // block_size) for n in lengths)
    kv_tokens = int(blocks * 1.2 + 4) * block_size
    cfg = {"max_decode_batch": width, "max_num_seqs": seqs, "block_size": block_size,
           "kv_cache_tokens": kv_tokens, "max_num_batched_tokens": EngineConfig.max_num_batched_tokens,
           "prefill_chunk_size": EngineConfig.prefill_chunk_size}
    cfg.update({k: v for k, v in overrides.items() if v is not None})
    return cfg


class TimedModel(LoopedLM):
    """`inner`'s stage API, timed: `seconds` (and `by_stage`) is the time spent inside its stages. A
    benchmark builds its engine around this model (`BenchModel.engine(timed=...)`): nothing of the
    model or the engine is replaced at run time. A stage that calls another inside `inner` (the KL
    signal's coda) is counted once, as part of the stage the engine called."""

    STAGES = ("prelude", "core_step", "coda", "gate_logit", "lookahead_gate_logit")

    def __init__(self, inner: LoopedLM, sync_cuda: bool = False) -> None:
        super().__init__()
        self.inner, self.sync = inner, sync_cuda
        self.config, self.has_gate, self.injects = inner.config, inner.has_gate, inner.injects
        self.seconds = 0.0
        self.by_stage: dict[str, float] = {s: 0.0 for s in self.STAGES}

    def _timed(self, name: str, fn: Any, *args: Any, **kwargs: Any) -> Any:
        t0 = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            if self.sync and not torch.cuda.is_current_stream_capturing():  # (no sync inside a CUDA graph)
                torch.cuda.synchronize()
            dt = time.perf_counter() - t0
            self.seconds += dt
            self.by_stage[name] += dt

    def prelude(self, token_ids, ctx, state_seeds=None):
        return self._timed("prelude", self.inner.prelude, token_ids, ctx, state_seeds)

    def core_step(self, state, inject, ctx):
        return self._timed("core_step", self.inner.core_step, state, inject, ctx)

    def coda(self, state, ctx, logit_rows=None):
        return self._timed("coda", self.inner.coda, state, ctx, logit_rows)

    def gate_logit(self, state):
        return self._timed("gate_logit", self.inner.gate_logit, state)

    def lookahead_gate_logit(self, state):
        return self._timed("lookahead_gate_logit", self.inner.lookahead_gate_logit, state)

    @property
    def has_lookahead_gate(self) -> bool:
        return self.inner.has_lookahead_gate

    @property
    def draws_random_state(self) -> bool:
        return self.inner.draws_random_state


def interval_union(intervals: list[tuple[float, float]]) -> float:
    """Total length covered by [start, end) intervals (overlaps counted once)."""
    total, reach = 0.0, -math.inf
    for start, end in sorted(intervals):
        if end > reach:
            total += end - max(start, reach)
            reach = end
    return total


class DeviceBusy:
    """Time the CUDA device spent running kernels and copies while the block ran: the union of the
    intervals of the profiler's device records (kernels on several streams that overlap count once).
    Only device activity is recorded, so the host path pays the profiler's per-launch callback and
    no per-op recording. The records are read raw (kineto's): the profiler's own event list builds a
    Python object per record, about 30 µs each, so a run's million kernel records took many minutes
    (the first lent GPU's busy step never finished). `busy_s` is set when the block exits.
    `cuda=False` records the CPU's operators instead (what the tests can run without a GPU)."""

    def __init__(self, cuda: bool = True) -> None:
        self.cuda = cuda
        self.busy_s: float | None = None
        self._prof: Any = None

    def __enter__(self) -> DeviceBusy:
        from torch.profiler import ProfilerActivity, profile

        self._prof = profile(activities=[ProfilerActivity.CUDA if self.cuda else ProfilerActivity.CPU])
        self._prof.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        if self.cuda:
            torch.cuda.synchronize()
        self._prof.__exit__(*exc)
        kind = torch.autograd.DeviceType.CUDA if self.cuda else torch.autograd.DeviceType.CPU
        spans = [(e.start_ns(), e.end_ns()) for e in self._prof.profiler.kineto_results.events()
                 if e.device_type() == kind]
        self.busy_s = interval_union(spans) * 1e-9


class StageRecorder:
    """Which stage each batch ran and its size, from the engine's stage records (`stage_hooks`).
    `ticks` keeps (t, stage, batch) when `keep` is set; `prefill_cpu_s` sums the CPU time of the
    runner's prefill calls; `end_step` charges a step's wall time to the stages it ran."""

    def __init__(self, engine: Any, keep: bool = False, t0: float | None = None) -> None:
        self.engine, self.keep = engine, keep
        self.t0 = t0 if t0 is not None else time.perf_counter()
        self.ticks: list[tuple[float, str, int]] = []
        self._step: list[tuple[str, float]] = []  # (stage, start) of the batches of the step under way
        self.prefill_cpu_s = 0.0

    def end_step(self, start: float, end: float, wall: dict[str, float]) -> None:
        """Add the step that ran from `start` to `end` to `wall` (stage -> seconds). A step may run
        several batches (a coda or prefill and the preludes of its tokens): each batch is charged from
        its own start to the next batch's, the first from the step's start, so a prefill's time never
        counts as the prelude's that followed it."""
        for i, (stage, begun) in enumerate(self._step):
            t1 = start if i == 0 else begun
            t2 = self._step[i + 1][1] if i + 1 < len(self._step) else end
            wall[stage] = wall.get(stage, 0.0) + t2 - t1
        self._step.clear()

    def _on_stage(self, rec: StageRecord) -> None:
        self._step.append((rec.stage, rec.start))
        if self.keep:
            self.ticks.append((rec.start - self.t0, rec.stage, rec.rows))
        if rec.cpu_s is not None:
            self.prefill_cpu_s += rec.cpu_s

    def __enter__(self) -> StageRecorder:
        self.engine.stage_hooks.append(self._on_stage)
        return self

    def __exit__(self, *exc: Any) -> None:
        self.engine.stage_hooks.remove(self._on_stage)

    def to_json(self) -> list[dict[str, Any]]:
        return [{"tick": i, "t": t, "stage": s, "batch": b} for i, (t, s, b) in enumerate(self.ticks)]


@dataclass
class RunResult:
    scheduler: str
    width: int
    requests: int
    wall_s: float
    cpu_s: float
    generated_tokens: int
    prompt_tokens: int
    mean_exit_depth: float | None  # over decode work items (the prompt's token excluded)
    decode_items: int
    compute_s: float
    model_time_s: float
    schedule_time_s: float
    compute_by_stage: dict[str, float] = field(default_factory=dict)
    stage_wall_s: dict[str, float] = field(default_factory=dict)  # wall time of each stage's batches (`end_step`)
    prefill_cpu_s: float = 0.0  # CPU time inside the runner's prefill calls
    ticks: dict[str, int] = field(default_factory=dict)
    rows: dict[str, int] = field(default_factory=dict)
    refill_events: int = 0
    preemptions: int = 0
    deferred_signal_ticks: int = 0
    config: dict[str, Any] = field(default_factory=dict)
    schedule_trace: list[dict[str, Any]] | None = None
    errors: int = 0
    device_busy_s: float | None = None  # CUDA: kernel and copy time on the device (`DeviceBusy`), if asked
    graph_buckets: int = 0  # cuda_graphs: the buckets prepared (on CUDA: captured) during the run
    graph_capture_s: float = 0.0  # CUDA: the wall time those captures took (inside the decode time)

    @property
    def tokens_per_s(self) -> float:
        return self.generated_tokens / self.wall_s if self.wall_s > 0 else float("nan")

    @property
    def cpu_tokens_per_s(self) -> float:
        return self.generated_tokens / self.cpu_s if self.cpu_s > 0 else float("nan")

    @property
    def decode_tokens(self) -> int:
        """Tokens made by decode work items (each request's first token comes from its prefill)."""
        return self.generated_tokens - self.requests

    @property
    def decode_wall_s(self) -> float:
        return self.wall_s - self.stage_wall_s.get("prefill", 0.0)

    @property
    def decode_cpu_s(self) -> float:
        return self.cpu_s - self.prefill_cpu_s

    @property
    def decode_tokens_per_s(self) -> float:
        return self.decode_tokens / self.decode_wall_s if self.decode_wall_s > 0 else float("nan")

    @property
    def warm_decode_tokens_per_s(self) -> float:
        """Decode tokens per second less the graph captures' time: the rate once every bucket the workload
        needs is captured (a server's steady state; a short run pays each capture once)."""
        wall = self.decode_wall_s - self.graph_capture_s
        return self.decode_tokens / wall if wall > 0 else float("nan")

    @property
    def decode_cpu_tokens_per_s(self) -> float:
        return self.decode_tokens / self.decode_cpu_s if self.decode_cpu_s > 0 else float("nan")

    def overhead(self) -> dict[str, float]:
        """Fractions of wall time: model compute, runner (outside compute), scheduler, other."""
        w = self.wall_s or float("nan")
        runner = max(self.model_time_s - self.compute_s, 0.0)
        other = max(self.wall_s - self.model_time_s - self.schedule_time_s, 0.0)
        return {"compute": self.compute_s / w, "runner": runner / w, "scheduler": self.schedule_time_s / w,
                "other": other / w, "outside_compute": 1 - self.compute_s / w,
                "outside_runner": 1 - self.model_time_s / w}

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        d["tokens_per_s"] = self.tokens_per_s
        d["cpu_tokens_per_s"] = self.cpu_tokens_per_s
        d["decode_tokens_per_s"] = self.decode_tokens_per_s
        d["decode_cpu_tokens_per_s"] = self.decode_cpu_tokens_per_s
        d["warm_decode_tokens_per_s"] = self.warm_decode_tokens_per_s
        d["overhead"] = self.overhead()
        return d


def add_workload(engine: LLMEngine, workload: Workload, traces: list[list[int]] | None,
                 arrival_time: float | None = None, prefix: str = "r",
                 rule: tuple[str, float] | None = None) -> list[str]:
    """Add the workload's requests, greedy. Exit depths follow `traces` (None: full depth), or the
    model's live signals when `rule` = (exit_policy, exit_threshold) is given."""
    ids = []
    for i, req in enumerate(workload.requests):
        rid = f"{prefix}{i}"
        if rule is not None:
            exits: dict[str, Any] = {"exit_policy": rule[0], "exit_threshold": rule[1]}
        elif traces is not None:
            exits = {"exit_trace": list(traces[i])}
        else:
            exits = {"exit_policy": "fixed"}
        params = SamplingParams(max_tokens=req.output_len, ignore_eos=True, temperature=0.0, **exits)
        engine.add_request(rid, {"prompt_token_ids": req.prompt_ids}, params, arrival_time=arrival_time)
        ids.append(rid)
    return ids


class OfflineRun:
    """One engine running a workload offline (every request at t = 0), a step at a time (`step`) inside its
    contexts (`with`): `run_offline` steps one to its end, `run_lockstep` several in turn. The arguments are
    `run_offline`'s."""

    def __init__(self, bm: BenchModel, workload: Workload, traces: list[list[int]] | None, scheduler: str,
                 width: int, progress: bool = True, record_schedule: bool = False, seed: int = 0,
                 desc: str | None = None, rule: tuple[str, float] | None = None, sync_steps: bool = False,
                 device_busy: bool = False, **engine_overrides: Any) -> None:
        from tqdm import tqdm

        cfg = engine_kwargs_for(workload, width, scheduler=scheduler, **engine_overrides)
        if sync_steps:
            if cfg.get("cuda_graphs"):
                raise ValueError("sync_steps: per-stage device times need eager core steps; drop cuda_graphs")
            cfg["cuda_graphs"] = False  # (unset would mean on, on CUDA)
        self.scheduler, self.width, self.requests, self.cfg = scheduler, width, len(workload), cfg
        self.cuda = str(bm.device).startswith("cuda")
        self.sync = self.cuda and sync_steps
        self.timer = TimedModel(bm.model, self.sync)
        self.engine = bm.engine(seed=seed, timed=self.timer, **cfg)
        add_workload(self.engine, workload, traces, rule=rule)
        self.bar = tqdm(total=workload.output_tokens, desc=desc or f"{scheduler} w={width}", disable=not progress,
                        unit="tok", leave=False)
        self.stages = StageRecorder(self.engine, keep=record_schedule)
        self.busy = DeviceBusy() if device_busy else None
        self.errors = 0
        self.stage_wall: dict[str, float] = {}
        self.time_steps = False  # `run_lockstep`: the run's time is its steps' (else its caller times it whole)
        self.step_wall = self.step_cpu = 0.0
        self._seen: dict[str, int] = {}
        self._contexts = contextlib.ExitStack()

    def __enter__(self) -> OfflineRun:
        self._contexts.enter_context(torch.inference_mode())
        self._contexts.enter_context(self.stages)
        if self.busy is not None:
            self._contexts.enter_context(self.busy)
        return self

    def __exit__(self, *exc: Any) -> None:
        self._contexts.close()
        self.bar.close()

    @property
    def done(self) -> bool:
        return not self.engine.has_unfinished_requests()

    @property
    def generated_tokens(self) -> int:
        return self.engine.stats.generated_tokens

    def step(self) -> None:
        """One engine step. Unless `time_steps`, only perf_counter (vDSO, no system call) is read per step: a
        CPU-time clock is a system call, a preemption point on a loaded machine (`run_offline` reads it around
        the whole run; `run_lockstep` needs each run's own, some µs a step against a step's ms)."""
        c1 = time.process_time() if self.time_steps else 0.0
        t1 = time.perf_counter()
        outs = self.engine.step()
        if self.sync:
            torch.cuda.synchronize()
        self.stages.end_step(t1, time.perf_counter(), self.stage_wall)
        for out in outs:
            n = len(out.outputs[0].token_ids)
            self.bar.update(n - self._seen.get(out.request_id, 0))
            self._seen[out.request_id] = n
            if out.finished and out.error:
                self.errors += 1
        if self.time_steps:
            self.step_wall += time.perf_counter() - t1
            self.step_cpu += time.process_time() - c1

    def result(self, wall: float, cpu: float) -> RunResult:
        """The run's figures, given its wall and CPU time."""
        st, engine = self.engine.stats, self.engine
        items = sum(st.exit_depths.values())
        mean_d = sum(d * c for d, c in st.exit_depths.items()) / items if items else None
        return RunResult(
            scheduler=self.scheduler, width=self.width, requests=self.requests, wall_s=wall, cpu_s=cpu,
            generated_tokens=st.generated_tokens, prompt_tokens=st.prompt_tokens, mean_exit_depth=mean_d,
            decode_items=items, compute_s=self.timer.seconds, model_time_s=st.model_time, stage_wall_s=self.stage_wall,
            prefill_cpu_s=self.stages.prefill_cpu_s,
            schedule_time_s=st.schedule_time, compute_by_stage=dict(self.timer.by_stage), ticks=dict(st.ticks),
            rows=dict(st.rows), refill_events=st.refill_events, preemptions=st.preemptions,
            deferred_signal_ticks=st.deferred_signal_ticks,
            # (the knobs as run: cuda_graphs and async_coda resolved for the device when left unset)
            config={**self.cfg, "cuda_graphs": engine.cfg.cuda_graphs, "async_coda": engine.async_coda},
            errors=self.errors, schedule_trace=self.stages.to_json() if self.stages.keep else None,
            device_busy_s=self.busy.busy_s if self.busy is not None else None,
            graph_buckets=st.graph_buckets, graph_capture_s=st.graph_capture_s)


def run_offline(bm: BenchModel, workload: Workload, traces: list[list[int]] | None, scheduler: str,
                width: int, progress: bool = True, record_schedule: bool = False, seed: int = 0,
                desc: str | None = None, rule: tuple[str, float] | None = None, sync_steps: bool = False,
                device_busy: bool = False, **engine_overrides: Any) -> RunResult:
    """All requests at t = 0, run to completion. `traces=None` runs every token at full depth;
    `rule` exits on the model's live signals instead (see `add_workload`).

    On CUDA the device is synchronized once at the end; `sync_steps` also synchronizes after every
    step and every model stage, which makes `compute_s` and the per-stage wall times device times
    but stops the host from running ahead of the device (no pipelining). `device_busy` (CUDA) measures
    the device's busy time over the run (`DeviceBusy`): busy / wall is how well the host kept it fed.
    With `cuda_graphs` a replayed stage (core steps, codas with layers) runs no model code, so `compute_s`
    leaves them out (they count as runner time); per-stage device times (`sync_steps`) are then not measured."""
    with OfflineRun(bm, workload, traces, scheduler, width, progress, record_schedule, seed, desc, rule, sync_steps,
                    device_busy, **engine_overrides) as run:
        c0, t0 = time.process_time(), time.perf_counter()  # (CPU time around the whole run: one system call)
        run.stages.t0 = t0
        while not run.done:
            run.step()
        if run.cuda:
            torch.cuda.synchronize()
        wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    return run.result(wall, cpu)


def run_lockstep(runs: list[OfflineRun]) -> list[RunResult]:
    """Run several offline runs of one workload at once: each step goes to the run that has generated the fewest
    tokens so far (the first listed on a tie), so the runs advance through the workload together and end at
    about the same time. A run's wall and CPU time are the sums over its own steps (`OfflineRun.time_steps`).

    Why: on a shared machine whose speed drifts over minutes, runs made one after another meet different
    machines, and their ratio carries the drift (rounds of the same point spread by up to 16 points of the bound,
    docs/benchmarks.md §8.33); runs made step by step in turn meet the same one. The cost: each step starts with
    the caches as another engine's step left them (on the CPU, a core step streams all the weights through them
    anyway). On the CPU only: on a GPU a step returns before its work is done, so its time is not its own."""
    if any(r.cuda for r in runs):
        raise ValueError("lockstep: on the CPU only (a GPU step's time is not its own: it returns before its work "
                         "is done); run them one after another")
    with contextlib.ExitStack() as stack:
        for r in runs:
            stack.enter_context(r)
            r.time_steps = True
        t0 = time.perf_counter()
        for r in runs:
            r.stages.t0 = t0
        step_in_turn(runs, lambda r: r.generated_tokens)
    return [r.result(r.step_wall, r.step_cpu) for r in runs]


def step_in_turn(runs: Sequence[Any], behind: Callable[[Any], float]) -> None:
    """Step runs (each with `done` and `step()`) until all are done, each time the live one furthest behind by
    `behind` (the first listed on a tie): the lockstep of offline runs (`run_lockstep`, by generated tokens) and
    of serving runs (`serve.serve_lockstep`, by each run's own clock)."""
    live = [r for r in runs if not r.done]
    while live:
        run = min(live, key=behind)
        run.step()
        if run.done:
            live.remove(run)


def write_json(path: Path, data: Any) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=2, default=_default) + "\n")
    return path


def _default(o: Any) -> Any:
    if isinstance(o, Path):
        return str(o)
    if hasattr(o, "to_json"):
        return o.to_json()
    if hasattr(o, "item"):
        return o.item()
    raise TypeError(f"not JSON serialisable: {type(o)}")
