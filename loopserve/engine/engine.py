"""`LLMEngine`: requests in, a planned stage batch (and what it frees up) per `step`, outputs out.

A step plans a stage batch (`scheduler.schedule()`), runs it on the runner, hands the result to
`scheduler.after_<stage>` and settles codas and follow-up preludes around it (docs/design.md §6.1).
Core steps are pipelined where lookahead allows (see `_core`), and with `async_coda` a coda's tokens
are sampled after the next stage batch is queued: the host builds tick t+1 while the device still
runs tick t.
"""

from __future__ import annotations

import dataclasses
import hashlib
import itertools
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from loopserve.cache.layout import KVLayout
from loopserve.cache.manager import KVCacheManager
from loopserve.cache.pool import KVStore
from loopserve.config import HUGINN, ModelConfig
from loopserve.engine.config import EngineConfig
from loopserve.engine.runner import ModelRunner, PendingSamples, PendingSignals, Signals, StatePool, rows_of
from loopserve.engine.scheduler import StagePlan, make_scheduler
from loopserve.engine.sequence import PromptType, Sequence, make_sequence
from loopserve.engine.stats import EngineStats
from loopserve.models.base import LoopedLM
from loopserve.outputs import RequestOutput
from loopserve.sampling_params import SamplingParams
from loopserve.tokenizer import Tokenizer


@dataclass
class StageRecord:
    """One stage batch the engine ran, handed to every `LLMEngine.stage_hooks` callback (benchmarks and
    metrics read these instead of wrapping engine methods)."""

    stage: str  # prefill | prelude | core | coda
    rows: int  # prompt tokens (prefill) or work items
    start: float  # perf_counter when the batch went to the runner
    model_s: float  # time inside the runner call (on CUDA: queueing, unless something waited)
    cpu_s: float | None = None  # process CPU time of the runner call: prefill only (few calls; a
    # CPU clock read is a system call, too dear per decode batch)


class LLMEngine:
    def __init__(self, model: LoopedLM, tokenizer: Tokenizer, cfg: EngineConfig, seed: int = 0) -> None:
        if cfg.scheduler == "reference":
            raise ValueError("scheduler: 'reference' is the sequential oracle, not a batching engine")
        c: ModelConfig = model.config
        cfg = dataclasses.replace(cfg, min_coda_batch=cfg.coda_batch_for(c.n_coda))
        self.model, self.tokenizer, self.cfg, self.seed = model, tokenizer, cfg, seed
        self.model_config = c
        p = next(model.parameters())
        self.layout = KVLayout(cfg.kv_layout, c.n_prelude, c.n_core, c.n_coda, c.r_max)
        per_token = self.layout.bytes_per_token(c.num_kv_heads, c.head_dim, p.dtype)
        tokens = cfg.kv_cache_tokens or int(cfg.kv_cache_memory_gb * 2**30 // per_token)
        blocks = max(1, tokens // cfg.block_size)
        store = KVStore((blocks + 1) * cfg.block_size, self.layout.slots_per_token, c.num_kv_heads, c.head_dim,
                        p.dtype, p.device)
        # block 0: scratch rows
        self.kv = KVCacheManager(store, cfg.block_size, reserved_blocks=1, num_slots=cfg.max_num_seqs)
        self.pool = StatePool(cfg.max_num_seqs, c.hidden_size, p.dtype, p.device, with_inject=c.arch == HUGINN)
        self.stats = EngineStats()
        self.scheduler = make_scheduler(cfg, self.kv, self.pool, self.stats)
        scratch = self.kv.reserved[0] * cfg.block_size
        self.runner = ModelRunner(model, self.layout, self.kv, self.pool, scratch_row=scratch)
        self._arrivals = itertools.count()
        # Async codas (CUDA by default): a coda's tokens are read once the next stage batch is queued.
        self.async_coda = cfg.async_coda if cfg.async_coda is not None else p.device.type == "cuda"
        self._codas: list[tuple[StagePlan, PendingSamples]] = []
        # the last core step's signals, read once the next step is queued:
        # (state-pool rows, their generations, the pending signals, which batch rows they are)
        self._deferred: tuple[np.ndarray, np.ndarray, PendingSignals, np.ndarray] | None = None
        self.requests: dict[str, Sequence] = {}
        self.stage_hooks: list[Callable[[StageRecord], None]] = []

    # -- requests --------------------------------------------------------------------------------------
    def make_sequence(self, request_id: str, prompt: PromptType, params: SamplingParams,
                      arrival_time: float | None = None, seed: int | None = None) -> Sequence:
        if seed is None:  # unseeded sampling differs per request; stable across processes (unlike hash())
            seed = int.from_bytes(hashlib.sha256(f"{self.seed}:{request_id}".encode()).digest()[:8], "little")
        return make_sequence(self.model, self.tokenizer, request_id, prompt, params, seed, self.cfg.lookahead,
                             arrival_time, base_seed=self.seed)

    def add_request(self, request_id: str, prompt: PromptType, params: SamplingParams,
                    arrival_time: float | None = None, seed: int | None = None) -> None:
        if request_id in self.requests:
            raise ValueError(f"request_id: {request_id!r} is already in flight")
        self.add_sequence(self.make_sequence(request_id, prompt, params, arrival_time, seed))

    def add_sequence(self, seq: Sequence) -> None:
        seq.arrival_index = next(self._arrivals)
        self.requests[seq.request_id] = seq
        self.scheduler.add(seq)

    def abort_request(self, request_id: str) -> None:
        self.scheduler.abort(request_id)  # reported with the next step's outputs

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_work() or bool(self.scheduler.finished)

    # -- one tick ----------------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        t0 = time.perf_counter()
        sched = self.scheduler
        model_time = 0.0
        if self._codas and not sched.core_q:  # nothing would run beside the coda: take its tokens now
            model_time += self._finish_codas(self._take_codas())
        plan = sched.schedule()
        queued_codas = self._take_codas()
        model_time += self._execute(plan)
        # With async codas, the tokens of codas queued before `plan` are read back only now, once `plan` is
        # queued behind them; their preludes follow.
        model_time += self._finish_codas(queued_codas)
        # Tokens just sampled start their next loop in the same tick (the refill scheduler runs
        # their prelude right away instead of spending a separate tick on it).
        follow = sched.follow_up(plan) if not (plan.stage == "coda" and self.async_coda) else None
        if follow is not None:
            model_time += self._execute(follow)
        self.stats.model_time += model_time
        self.stats.schedule_time += time.perf_counter() - t0 - model_time
        outs = [seq.to_output() for seq in dict.fromkeys(sched.appended) if not seq.finished]
        sched.appended.clear()
        for seq in sched.finished:
            outs.append(seq.to_output())
            self.requests.pop(seq.request_id, None)
        sched.finished.clear()
        if not sched.has_work():
            self._deferred = None  # signals of tokens that have all finished: nothing left to decide
        if plan.stage == "idle" and not outs and sched.has_work():
            raise RuntimeError("scheduler made no progress with work pending (a bug: please report)")
        return outs

    def _execute(self, plan: StagePlan) -> float:
        """Run one stage batch and hand its results to the scheduler; returns the model time."""
        sched, t1 = self.scheduler, time.perf_counter()
        cpu = None
        if plan.stage == "prefill":
            c1 = time.process_time()
            logits = self.runner.prefill(plan.chunks)
            t2, cpu = time.perf_counter(), time.process_time() - c1
            sched.after_prefill(plan, logits)
        elif plan.stage == "prelude":
            self.runner.prelude(plan.items)
            t2 = time.perf_counter()
            sched.after_prelude(plan)
        elif plan.stage == "core":
            self._core(plan)
            t2 = time.perf_counter()
        elif plan.stage == "coda":
            pending = self.runner.coda(plan.items)
            if self.async_coda:
                self._codas.append((plan, pending))  # sampled after the next stage batch is queued
                t2 = time.perf_counter()
            else:
                samples = pending.get()
                t2 = time.perf_counter()
                sched.after_coda(plan, samples)
        else:
            t2 = t1
        if sched.kv_depth_writes:
            rows, depths = (np.concatenate(x) for x in zip(*sched.kv_depth_writes, strict=True))
            self.runner.write_kv_depths(rows, depths)
            sched.kv_depth_writes.clear()
        if plan.stage == "idle":
            return 0.0
        size = sum(c.n for c in plan.chunks) if plan.stage == "prefill" else len(plan.items)
        self.stats.record(plan.stage, size)
        if self.stage_hooks:
            record = StageRecord(plan.stage, size, t1, t2 - t1, cpu)
            for hook in self.stage_hooks:
                hook(record)
        return t2 - t1

    def _take_codas(self) -> list[tuple[StagePlan, PendingSamples]]:
        codas, self._codas = self._codas, []
        return codas

    def _finish_codas(self, codas: list[tuple[StagePlan, PendingSamples]]) -> float:
        """Take the tokens of queued codas and run their preludes; returns the model time."""
        model_time = 0.0
        for plan, pending in codas:
            t1 = time.perf_counter()
            samples = pending.get()
            model_time += time.perf_counter() - t1
            self.scheduler.after_coda(plan, samples)
            follow = self.scheduler.follow_up(plan)
            if follow is not None:
                model_time += self._execute(follow)
        return model_time

    def _core(self, plan: StagePlan) -> None:
        """One loop step, pipelined where the exit rules allow.

        The step is queued first. Then the previous core step's deferred signals are read (on CUDA
        the device has finished them and already holds this step's work), then this step is counted.
        If every rule in the batch decides ahead (delayed lookahead, lookahead_gate) or needs no
        signal, this step's signals stay on their way back until after the next step is queued, so
        the host schedules tick t+1 while the device runs tick t. A rule that acts on the step's own
        signal (gate, latent_diff, kl without lookahead) makes the engine wait for it here.
        Everything here is array work over the batch's state-pool rows (see `StatePool`).
        """
        sched, pool = self.scheduler, self.pool
        rows = rows_of(plan.items)
        generations = pool.generation[rows].copy()
        pending = self.runner.core(rows)
        if self._deferred is not None:
            previous_rows, previous_generations, previous, keep = self._deferred
            self._deferred = None
            sched.observe_core(previous_rows, previous_generations, previous.get().take(keep))
        sched.advance_core(rows)
        signal = pending.kinds != 0  # passive rows (CB) have none
        if not self.cfg.pipeline_core_steps or (signal & ~pool.decides_ahead[rows]).any():
            sched.observe_core(rows, generations, pending.get())
            return
        now = ~signal  # trace, fixed: no device value to wait for
        sched.observe_core(rows[now], generations[now], Signals.none(pending.kinds[now]))
        if signal.any():  # all decide ahead (checked above)
            self._deferred = (rows[signal], generations[signal], pending, signal)
            self.stats.deferred_signal_ticks += 1

    def kv_usage(self) -> float:
        return self.kv.usage()

    @torch.no_grad()
    def run_to_completion(self) -> None:
        while self.has_unfinished_requests():
            self.step()

