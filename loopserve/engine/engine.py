"""`LLMEngine`: requests in, one planned stage batch per `step`, outputs out.

A step reads: schedule (`scheduler.schedule()`), run (queue the batch on the runner), update (hand
results to `scheduler.after_<stage>` / `observe_core`) (docs/design.md §6.1). Every queued batch
whose result the host has not read is one `InFlight` entry in one queue: results are read in queue
order, right after the next batch was queued, so on CUDA the host plans tick t+1 while the device
runs tick t. Entries that may wait for the next batch: async codas (CUDA by default), and core steps
whose rules all decide a step ahead (delayed lookahead, lookahead_gate). The tokens a coda or
prefill sampled start their next loop as soon as they are read (the scheduler's `follow_up`
preludes): in the same tick; an async coda's at the start of the next tick if its tokens have arrived by then
(`_take_arrived_codas`), else once that tick's batch is queued, joining the core batch a tick later.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import logging
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from loopserve.cache.layout import KVLayout
from loopserve.cache.manager import KVCacheManager
from loopserve.cache.pool import KVStore
from loopserve.cache.prefix import cache_scope
from loopserve.engine.budget import checked_model_len, pool_tokens
from loopserve.engine.config import EngineConfig
from loopserve.engine.graphs import StageGraphs
from loopserve.engine.runner import (
    ModelRunner,
    PendingDrafts,
    PendingPrefill,
    PendingSamples,
    PendingSignals,
    Signals,
    StatePool,
)
from loopserve.engine.scheduler import Stage, StagePlan, make_scheduler
from loopserve.engine.sequence import PromptType, Sequence, make_sequence, unseeded
from loopserve.engine.speculative import Speculator
from loopserve.engine.stats import EngineStats
from loopserve.model_config import EngineModelConfig, ModelConfig
from loopserve.models.base import LoopedLM
from loopserve.outputs import RequestOutput
from loopserve.sampling_params import SamplingParams, with_tokenization_kwargs
from loopserve.tokenizer import Tokenizer
from loopserve.vllm_neutral import absent_method, check_neutral

if TYPE_CHECKING:
    from loopserve.async_llm import EngineArgs

log = logging.getLogger("loopserve.engine")


@dataclass
class StageRecord:
    """One stage batch the engine ran, handed to every `LLMEngine.stage_hooks` callback (benchmarks and
    metrics read these instead of wrapping engine methods)."""

    stage: Stage
    rows: int  # prompt tokens (prefill) or work items
    start: float  # perf_counter when the batch went to the runner
    model_s: float  # time inside the runner call (on CUDA: queueing, unless something waited)
    cpu_s: float | None = None  # process CPU time of the runner call: prefill only (few calls; a
    # CPU clock read is a system call, too dear per decode batch)


@dataclass
class InFlight:
    """A stage batch queued on the device whose result the host has not read yet."""

    plan: StagePlan
    result: PendingPrefill | PendingSamples | PendingSignals | PendingDrafts | None
    rows: np.ndarray | None = None  # core: the state-pool rows of the batch, and their generations
    generations: np.ndarray | None = None
    keep: np.ndarray | None = None  # core: the batch rows whose signals are still to be read
    deferred: bool = False  # a core step whose signals may wait for the next batch
    settled: np.ndarray | None = None  # core, read at once: the rows its advance settled (they exit with its signals')


def _could_not_allocate(e: Exception) -> bool:
    """Whether `e` is an allocation refused for its size: torch.OutOfMemoryError (CUDA's), the CPU allocator's plain
    RuntimeError ("DefaultCPUAllocator: can't allocate memory: you tried to allocate N bytes ..."), or a size past
    what torch can count (a RuntimeError "Storage size calculation overflowed", a TypeError "Overflow when
    unpacking long long", a ValueError "Maximum allowed dimension exceeded")."""
    return isinstance(e, torch.OutOfMemoryError) or any(
        words in str(e) for words in ("can't allocate memory", "size calculation overflowed", "Overflow when unpacking",
                                      "Maximum allowed dimension exceeded"))


@contextlib.contextmanager
def _sized_by(error: Callable[[], ValueError]) -> Iterator[None]:
    """An allocation a knob sizes: refused for its size (`_could_not_allocate`), `error()` (a ValueError naming the
    knob) instead of torch's."""
    try:
        yield
    except (RuntimeError, TypeError, ValueError) as e:
        if not _could_not_allocate(e):
            raise
        raise error() from None


def _too_big(knob: str, what: str, device: Any) -> ValueError:
    return ValueError(f"{knob}: {what} cannot be allocated on {device}; give a smaller {knob}")


def check_request_id(request_id: Any) -> None:
    """A request id is a str, as vLLM's (an int would come back in outputs and sample ids of another type than the
    caller's other requests): ValueError naming it."""
    if not isinstance(request_id, str):
        raise ValueError(f"request_id: expected a str, got {type(request_id).__name__} {request_id!r}")


class LLMEngine:
    def __init__(self, model: LoopedLM, tokenizer: Tokenizer, cfg: EngineConfig, seed: int = 0,
                 max_model_len: int | None = None, kv_memory_knob: str = "kv_cache_memory_gb") -> None:
        """`max_model_len`: the most prompt + completion tokens of a request (vLLM's; None: the model's context);
        a request's prompt is checked against it and its output ends there ("length"). `kv_memory_knob`: the
        setting that gave cfg.kv_cache_memory_gb, which the KV pool's errors name (gpu_memory_utilization where
        `load_config.load_for_engine` sized the pool from it)."""
        if cfg.scheduler == "reference":
            raise ValueError("scheduler: 'reference' is the sequential oracle, not a batching engine")
        c: ModelConfig = model.config
        if cfg.speculative_draft_loops > c.r_max:  # (a draft runs at most the model's loops: more is not a setting)
            raise ValueError(f"speculative_draft_loops: at most the model's r_max ({c.r_max}), "
                             f"got {cfg.speculative_draft_loops}")
        if cfg.num_speculative_tokens >= cfg.max_decode_batch:
            log.warning("num_speculative_tokens=%d: a round drafts at most max_decode_batch - 1 = %d tokens (a "
                        "request's drafts and its verify row share one batch)", cfg.num_speculative_tokens,
                        cfg.max_decode_batch - 1)
        p = next(model.parameters())
        graphs_on = cfg.cuda_graphs if cfg.cuda_graphs is not None else p.device.type == "cuda"
        prelude_batch, coda_batch = cfg.boundary_batches_for(c.n_prelude, c.n_coda)
        cfg = dataclasses.replace(cfg, min_prelude_batch=prelude_batch, min_coda_batch=coda_batch,
                                  cuda_graphs=graphs_on)
        self.model, self.tokenizer, self.cfg, self.seed = model, tokenizer, cfg, seed
        self.layout = KVLayout(cfg.kv_layout, c.n_prelude, c.n_core, c.n_coda, c.r_max)
        per_token = self.layout.bytes_per_token(c.num_kv_heads, c.head_dim, p.dtype)
        blocks = cfg.kv_pool_tokens(per_token, kv_memory_knob) // cfg.block_size
        # (the model's config with the engine's max_model_len, vLLM's `engine.model_config`: auto's is the pool's)
        self.model_config = EngineModelConfig.of(
            c, checked_model_len(max_model_len, c.max_position, blocks * cfg.block_size), p.dtype)
        # a pool too big: a ValueError naming the knob that sized it, not torch's traceback
        with _sized_by(lambda: cfg.kv_pool_error(blocks * cfg.block_size, blocks * cfg.block_size * per_token,
                                                 p.device, kv_memory_knob)):
            store = KVStore((blocks + 1) * cfg.block_size, self.layout.slots_per_token, c.num_kv_heads, c.head_dim,
                            p.dtype, p.device)
        # block 0: scratch rows
        # CUDA graphs read the block table where it was when they were captured: give it, from the start, the
        # columns of the longest sequence the pool and max_model_len allow, so it never moves
        width = (-(-min(self.max_model_len, blocks * cfg.block_size) // cfg.block_size) if cfg.cuda_graphs
                 else KVCacheManager.TABLE_WIDTH)
        with _sized_by(lambda: _too_big("max_num_seqs", f"{cfg.max_num_seqs} sequences' block tables", p.device)):
            self.kv = KVCacheManager(store, cfg.block_size, reserved_blocks=1, num_slots=cfg.max_num_seqs,
                                     table_width=width)
        if pool_tokens(self) < self.max_model_len:  # (vLLM refuses to start here; requests say it one by one)
            log.warning("the KV cache holds %d tokens, fewer than max_model_len %d: a request needing more is refused "
                        "or its completion cut there (more kv_cache_tokens, %s, or a smaller max_model_len would "
                        "serve max_model_len)", pool_tokens(self), self.max_model_len, kv_memory_knob)
        # a state row per admitted sequence (a plain item keeps its row between tokens), and room for the drafts
        # of every sequence that may draft at once, so that verify groups are not trimmed for want of rows
        drafts = cfg.num_speculative_tokens * min(cfg.speculative_max_batch, cfg.max_num_seqs)
        knob = "num_speculative_tokens" if drafts > cfg.max_num_seqs else "max_num_seqs"
        state_rows = f"{cfg.max_num_seqs + drafts} state rows ({cfg.max_num_seqs} sequences, {drafts} drafts)"
        with _sized_by(lambda: _too_big(knob, state_rows, p.device)):
            self.pool = StatePool(cfg.max_num_seqs + drafts, c.hidden_size, p.dtype, p.device,
                                  with_inject=model.injects)
        self.stats = EngineStats(spec_accepted_per_pos=[0] * cfg.num_speculative_tokens)
        scope = cache_scope(c.arch, str(p.dtype), cfg.kv_layout, cfg.prefill_chunk_size)
        speculator = Speculator(cfg, coda_kv=c.n_coda > 0) if cfg.num_speculative_tokens else None
        self.scheduler = make_scheduler(cfg, self.kv, self.pool, self.stats,
                                        scope if cfg.enable_prefix_caching else None, model.draws_random_state,
                                        speculator)
        scratch = self.kv.reserved[0] * cfg.block_size
        graphs = StageGraphs(model, self.layout, store, self.kv.block_tables, self.pool, scratch,
                             capture=p.device.type == "cuda", stats=self.stats) \
            if cfg.cuda_graphs else None
        if graphs is not None and not graphs.capture:
            log.warning("cuda_graphs on %s: nothing to capture, the padded stages run eagerly (slower; for tests)",
                        p.device)
        self.runner = ModelRunner(model, self.layout, self.kv, self.pool, scratch_row=scratch, graphs=graphs)
        if graphs is not None and cfg.cuda_graph_warmup_tokens:
            t0 = time.perf_counter()
            # (Ouro's prelude and coda have no layers: they run eagerly, never graphed)
            stages = ["core"] + ["coda"] * (c.n_coda > 0) + ["prelude"] * (c.n_prelude > 0)
            # (a stage batch is at most max_decode_batch rows, and at most the state pool's)
            with _sized_by(lambda: _too_big("cuda_graph_warmup_tokens", "the graphs of every bucket it asks for",
                                            p.device)):
                n = graphs.warm_up(stages, min(cfg.max_decode_batch, self.pool.rows),
                                   min(cfg.cuda_graph_warmup_tokens, self.max_model_len))
            log.info("cuda graphs: %d buckets prepared at start-up in %.1f s", n, time.perf_counter() - t0)
        self._arrivals = itertools.count()
        # Async codas (CUDA by default): the host does not wait for a coda's tokens (taken when they have arrived,
        # at the latest once the next stage batch is queued: `_take_arrived_codas`, docs/design.md §6.4).
        self.async_coda = cfg.async_coda if cfg.async_coda is not None else p.device.type == "cuda"
        self._in_flight: list[InFlight] = []  # queued batches whose results are read after the next one
        self._model_time = 0.0
        self.requests: dict[str, Sequence] = {}
        self.stage_hooks: list[Callable[[StageRecord], None]] = []
        # who steps this engine now (`claim`): an EngineThread (engine/engine_thread.py) while it runs, or the thread
        # in `LLM.generate`; no other thread may add, abort, step or reset meanwhile (`LLM` asks an EngineThread to
        # hand the engine back first: `EngineThread.hand_back`)
        self.driver: Any = None
        self._driver_ident: int | None = None  # its thread's id, once known
        self._driver_lock = threading.Lock()

    @classmethod
    def from_engine_args(cls, engine_args: EngineArgs, usage_context: Any = None, stat_loggers: Any = None,
                         enable_multiprocessing: bool = False) -> LLMEngine:
        """vLLM's: the engine of the `LLM` that `engine_args` (an `EngineArgs`) describe (the model loads here; the
        engine keeps what it needs of it). `usage_context` (vLLM's telemetry, which loopserve does not send),
        `stat_loggers` (None) and `enable_multiprocessing` (False: the engine runs in this process) are taken at the
        values that ask for nothing."""
        from loopserve.async_llm import EngineArgs

        if not isinstance(engine_args, EngineArgs):
            raise ValueError(f"engine_args: expected an EngineArgs, got {type(engine_args).__name__}")
        if enable_multiprocessing is not False:
            raise ValueError(f"enable_multiprocessing: not supported by loopserve (the engine runs in this "
                             f"process); it takes False, got {enable_multiprocessing!r}")
        check_neutral(usage_context=usage_context, stat_loggers=stat_loggers)
        return engine_args.create_llm().llm_engine

    def __getattr__(self, name: str) -> Any:
        """vLLM's methods for what loopserve lacks (`vllm_neutral.ABSENT_METHODS`: a ValueError naming the method and
        what to use instead, when called); any other missing attribute is the usual AttributeError."""
        return absent_method(self, name)

    @property
    def max_model_len(self) -> int:
        """The most prompt + completion tokens of a request: its model_config's (vLLM's place for it)."""
        return self.model_config.max_model_len

    def get_tokenizer(self) -> Tokenizer:
        """The tokenizer requests are encoded and decoded with (vLLM's `LLMEngine.get_tokenizer`)."""
        return self.tokenizer

    # -- requests --------------------------------------------------------------------------------------
    def make_sequence(self, request_id: str, prompt: PromptType, params: SamplingParams,
                      arrival_time: float | None = None, seed: int | None = None) -> Sequence:
        if seed is None:
            seed = unseeded(self.seed, request_id)
        return make_sequence(self.model, self.tokenizer, request_id, prompt, params, seed, self.cfg.lookahead,
                             self.cfg.num_speculative_tokens, arrival_time, base_seed=self.seed,
                             part_size=self.part_size, max_model_len=self.max_model_len,
                             max_logprobs=self.cfg.max_logprobs)

    def part_size(self, prompt_len: int) -> int:
        """The most samples of one request (n > 1) that run together on a prompt of `prompt_len` tokens: at most
        max_num_seqs, and as many as the KV cache holds beside each other (`Scheduler.samples_that_fit`; 0: not one);
        more come in further parts, as vLLM runs a request's samples as requests of their own."""
        return min(self.cfg.max_num_seqs, self.scheduler.samples_that_fit(prompt_len))

    def add_request(self, request_id: str, prompt: PromptType, params: SamplingParams,
                    arrival_time: float | None = None, lora_request: Any = None,
                    tokenization_kwargs: dict[str, Any] | None = None, trace_headers: Any = None, priority: int = 0,
                    *, seed: int | None = None) -> None:
        """Queue a request (every sample of it, n > 1). The arguments are vLLM's, in its order; `lora_request`,
        `tokenization_kwargs`, `trace_headers` and `priority` are taken at the values that ask for nothing
        (`vllm_neutral`). `arrival_time`: wall-clock seconds, as vLLM's (`time.time()`; None: now), the origin of the
        output's `RequestMetrics`. `request_id` a str, as vLLM's (an int would come back in outputs and sample ids of
        another type than the caller's other requests): ValueError naming it. `seed`: the stream of an unseeded
        request (`make_sequence`)."""
        check_request_id(request_id)
        if not isinstance(params, SamplingParams):
            raise ValueError(f"params: expected a SamplingParams, got {type(params).__name__}")
        check_neutral(lora_request=lora_request, tokenization_kwargs=tokenization_kwargs, trace_headers=trace_headers,
                      priority=priority)
        params = with_tokenization_kwargs(params, tokenization_kwargs)
        self.add_sequence(self.make_sequence(request_id, prompt, params, arrival_time, seed))

    def claim(self, owner: Any, ident: int | None) -> None:
        """Make `owner` (on thread `ident`, None: not known yet) the one that steps this engine: a RuntimeError if
        another holds it (two threads stepping one engine broke its scheduler). The same owner may claim again."""
        with self._driver_lock:
            if self.driver is not None and self.driver is not owner:
                raise RuntimeError(f"LLMEngine: this engine is stepped by {self._owner()} already; shut that down "
                                   "first, or go through it")
            self.driver, self._driver_ident = owner, ident

    def release(self, owner: Any) -> None:
        """`owner` no longer steps this engine (a no-op if it does not hold it)."""
        with self._driver_lock:
            if self.driver is owner:
                self.driver = self._driver_ident = None

    def _check_thread(self, what: str) -> None:
        ident = self._driver_ident
        if ident is not None and ident != threading.get_ident():
            raise RuntimeError(f"LLMEngine.{what}: this engine is stepped by {self._owner()}; shut that down first, "
                               "or go through it")

    def _owner(self) -> str:
        driver = self.driver
        return f"LLM.generate on thread {driver.name!r}" if isinstance(driver, threading.Thread) else str(driver)

    def add_sequence(self, seq: Sequence) -> None:
        """Admit a request built by `make_sequence` (with n > 1: all its samples)."""
        self._check_thread("add_request")
        taken = [s.request_id for s in seq.family if s.request_id in self.requests]
        if taken:
            raise ValueError(f"request_id: {taken[0]!r} is already in flight")
        for s in seq.family:
            s.arrival_index = next(self._arrivals)
            self.requests[s.request_id] = s
        self.scheduler.add(seq)

    def abort_request(self, request_ids: str | Iterable[str]) -> None:
        """Stop requests (every sample of each); each is reported (finish_reason "abort") with the next step's
        outputs. `request_ids`: a list of ids, as vLLM V1's `LLMEngine.abort_request` takes them, or one id (a str,
        as vLLM V0 took it and the server passes it; vLLM V1 would read a str as its characters). An id not in
        flight (unknown, or already reported finished) is passed over, as in vLLM."""
        self._check_thread("abort_request")
        ids = [request_ids] if isinstance(request_ids, str) else request_ids
        if not isinstance(ids, Iterable):
            raise ValueError(f"request_ids: expected a list of request ids or one id (a str), got "
                             f"{type(request_ids).__name__}")
        for request_id in ids:
            seq = self.requests.get(request_id)
            for s in seq.family if seq is not None else ():  # (the head first: it takes its unstarted samples along)
                self.scheduler.abort(s)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_work() or bool(self.scheduler.finished)

    def get_num_unfinished_requests(self) -> int:
        """vLLM's: the requests `step` has still to report finished, each sample of an n > 1 request counted (vLLM
        runs them as requests of their own). 0 exactly when `has_unfinished_requests()` is false. Unlike vLLM's, an
        aborted request counts until the step that reports its abort, and a request's samples leave together, when
        the last of them is reported."""
        return len(self.requests)

    def reset_prefix_cache(self, reset_running_requests: bool = False, reset_connector: bool = False) -> bool:
        """vLLM's: forget every cached prompt block, so that no later prompt reuses KV computed before (after the
        weights changed, say, or to time prefills from cold). Only with no request in flight (an aborted one counts no
        more, reported or not), as vLLM resets only while no request holds KV: False (with a warning, as vLLM's) and
        nothing forgotten otherwise.
        `reset_running_requests=True` (vLLM preempts the running requests to reset at once) resets an idle engine, as
        there is nothing to preempt, and is a ValueError with requests in flight (loopserve does not preempt them
        for it). `reset_connector`: vLLM's, for the cache of a KV connector; loopserve has none, so there is
        nothing more to reset, as in vLLM without one."""
        self._check_thread("reset_prefix_cache")
        if self.scheduler.has_work():  # (a request aborted or finished, not yet reported, holds no KV any more)
            if reset_running_requests:
                raise ValueError("reset_running_requests: not supported by loopserve with requests in flight (it does "
                                 "not preempt requests to reset the prefix cache); reset with no request in flight")
            log.warning("prefix cache not reset: %d requests are in flight",
                        sum(not s.finished for s in self.requests.values()))
            return False
        self.kv.allocator.reset_cache()
        return True

    # -- one tick ----------------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Schedule one stage batch, run it, update the requests with what came back."""
        if torch.is_grad_enabled():  # (the engine thread steps under one `no_grad`: a decorator's costs µs a tick)
            with torch.no_grad():
                return self._step()
        return self._step()

    def _step(self) -> list[RequestOutput]:
        if self._driver_ident is not None:
            self._check_thread("step")
        t0 = time.perf_counter()
        self._model_time = 0.0
        sched = self.scheduler
        tokens = self.stats.generated_tokens
        if not len(sched.core_rows) and any(e.plan.stage is Stage.CODA for e in self._in_flight):
            self._land(self._take_in_flight())  # nothing would run beside the coda: take its tokens now
        else:
            self._land(self._take_arrived_codas())
        plan = sched.schedule()
        self._run(plan)
        self.stats.model_time += self._model_time
        self.stats.schedule_time += time.perf_counter() - t0 - self._model_time
        moved = bool(sched.appended or sched.finished)  # (most ticks neither: nothing to report)
        outs = self._outputs() if moved else []
        if plan.stage is Stage.IDLE and not moved and self.stats.generated_tokens == tokens and sched.has_work():
            raise RuntimeError("scheduler made no progress with work pending (a bug: please report)")
        return outs

    def _outputs(self) -> list[RequestOutput]:
        """One output per request that got a token or finished this tick (a request's samples share one output);
        a FINAL_ONLY request's only when it finished (`appended` lists none of those). Finished requests leave."""
        sched = self.scheduler
        for seq in sched.finished:
            if all(s.finished for s in seq.family):  # a request's samples leave together
                for s in seq.family:
                    self.requests.pop(s.request_id, None)
        heads = dict.fromkeys(s.family[0] for s in sched.appended + sched.finished)
        sched.appended.clear()
        sched.finished.clear()
        return [h.to_output() for h in heads if h.streams or h.finished and all(s.finished for s in h.family)]

    def _run(self, plan: StagePlan) -> None:
        """Queue one stage batch on the device, then read the results of the batches queued before it
        (on CUDA the device is busy with `plan` meanwhile), then this batch's own result, unless it may
        wait for the next batch: async codas, and core steps whose rules all decide a step ahead."""
        earlier = self._take_in_flight()
        entry = self._launch(plan)
        self._land(earlier)
        if entry is not None and plan.stage is Stage.CORE:  # counted before its signals are read
            entry = self._advance_core(entry)
        if entry is not None and self._may_wait(entry):
            self._in_flight.append(entry)
        elif entry is not None:
            self._land([entry])
        sched = self.scheduler
        if sched.kv_depth_writes:
            writes = sched.kv_depth_writes
            rows, depths = writes[0] if len(writes) == 1 else (np.concatenate(x) for x in zip(*writes, strict=True))
            self.runner.write_kv_depths(rows, depths)
            sched.kv_depth_writes.clear()

    def _launch(self, plan: StagePlan) -> InFlight | None:
        """Queue the batch on the runner; the result (tokens, exit signals) is still on its way."""
        if plan.stage is Stage.IDLE:
            return None
        # process CPU time for prefill only: a clock read per decode batch is too dear (a system call)
        c1 = time.process_time() if plan.stage is Stage.PREFILL and self.stage_hooks else 0.0
        t1 = time.perf_counter()
        pending: PendingPrefill | PendingSamples | PendingSignals | PendingDrafts | None = None
        rows = generations = None
        size = plan.size
        if plan.stage is Stage.PREFILL:
            pending = self.runner.prefill(plan.chunks)
        else:
            if plan.stage is Stage.PRELUDE:
                assert plan.rows is not None
                self.runner.prelude(plan.items, plan.rows)
            elif plan.stage is Stage.CORE:
                assert plan.rows is not None
                rows = plan.rows
                generations = self.pool.generation[rows]  # (a copy: fancy indexing)
                pending = self.runner.core(rows)
            elif plan.stage is Stage.DRAFT:
                pending = self.runner.draft(plan.items, plan.draft_lens, self.cfg.speculative_draft_loops)
            else:
                assert plan.rows is not None
                pending = self.runner.coda(plan.items, plan.rows)
        t2 = time.perf_counter()
        self._model_time += t2 - t1
        self.stats.record(plan.stage, size)
        if self.stage_hooks:
            record = StageRecord(plan.stage, size, t1, t2 - t1, time.process_time() - c1 if plan.stage is Stage.PREFILL
                                 else None)
            for hook in self.stage_hooks:
                hook(record)
        if plan.stage is Stage.PRELUDE:
            self.scheduler.after_prelude(plan)
            return None
        return InFlight(plan, pending, rows, generations)

    def _advance_core(self, entry: InFlight) -> InFlight | None:
        """A core step was queued: advance its items (no signal needed), then keep for later only the
        rows whose rule needs this step's signal; rows that need none (trace, fixed) are decided now."""
        assert entry.rows is not None and entry.generations is not None and isinstance(entry.result, PendingSignals)
        # not the rows freed since the step was queued: reading an earlier step's signals (this tick) may
        # have failed their requests (a later item in such a row is not this step's either)
        settled = self.scheduler.advance_core(entry.rows, entry.generations)
        if not self.cfg.pipeline_core_steps or entry.result.read_now:
            entry.settled = settled  # (read at once: they exit with the rows its signals decide)
            return entry
        signal = entry.result.kinds != 0  # passive rows (CB) have none
        now = ~signal
        self.scheduler.observe_core(entry.rows[now], entry.generations[now], Signals.none(entry.result.kinds[now]),
                                    settled)
        if not signal.any():
            return None
        self.stats.deferred_signal_ticks += 1
        return dataclasses.replace(entry, keep=signal, deferred=True)

    def _may_wait(self, entry: InFlight) -> bool:
        return entry.deferred or (entry.plan.stage is Stage.CODA and self.async_coda)

    def _take_in_flight(self) -> list[InFlight]:
        entries, self._in_flight = self._in_flight, []
        return entries

    def _take_arrived_codas(self) -> list[InFlight]:
        """The asynchronous codas at the head of the in-flight queue whose tokens are on the host already: taken
        before planning, their tokens join this tick's core batch (as with synchronous codas) without the host
        having waited for them; a coda the device has not finished keeps the tick it would otherwise cost (§6.4)."""
        n = 0
        for entry in self._in_flight:
            if entry.plan.stage is not Stage.CODA or not isinstance(entry.result, PendingSamples) \
                    or not entry.result.ready():
                break
            n += 1
        taken, self._in_flight = self._in_flight[:n], self._in_flight[n:]
        return taken

    def _land(self, entries: list[InFlight]) -> None:
        """Read the results of queued batches (in queue order) and hand them to the scheduler; the
        tokens of a coda or prefill start their next loop in the same tick (`follow_up` preludes)."""
        sched = self.scheduler
        for entry in entries:
            plan = entry.plan
            t1 = time.perf_counter()
            if isinstance(entry.result, PendingSignals):
                signals = entry.result.get()
                self._model_time += time.perf_counter() - t1
                rows, generations = entry.rows, entry.generations
                assert rows is not None and generations is not None
                if entry.keep is not None:  # deferred: the rows decided at once are not read again
                    rows, generations, signals = rows[entry.keep], generations[entry.keep], signals.take(entry.keep)
                sched.observe_core(rows, generations, signals, entry.settled)
                continue
            assert entry.result is not None
            if isinstance(entry.result, PendingDrafts):
                drafts = entry.result.get()
                self._model_time += time.perf_counter() - t1
                sched.after_draft(plan, drafts)
            else:
                samples = entry.result.get()
                self._model_time += time.perf_counter() - t1
                if isinstance(entry.result, PendingPrefill):
                    firsts = {s.request_id: x for s, x in zip(entry.result.seqs, samples, strict=True)}
                    sched.after_prefill(plan, firsts, entry.result.prompt_logprobs(), entry.result.broken())
                else:
                    sched.after_coda(plan, samples)
            follow = sched.follow_up(plan)
            if follow is not None:
                self._run(follow)

    def kv_usage(self) -> float:
        return self.kv.usage()

    def run_to_completion(self) -> None:
        while self.has_unfinished_requests():
            self.step()

