"""`EngineThread`: one background thread drives `LLMEngine.step()`; the event loop never computes. The public
`AsyncLLMEngine` (loopserve/async_llm.py) and the HTTP server (serve/api.py) each run their engine on one.

- The event-loop thread builds `Sequence`s, then `add`s them: a command goes on a thread-safe queue and the
  engine thread is woken. `abort` works the same way. Commands are applied between steps, so the engine itself
  stays single-threaded.
- The engine thread steps while there is work and sleeps on an event otherwise. After each step it
  hands the step's outputs to the event loop in one `call_soon_threadsafe`, which routes each
  output to its `RequestGroup` queue: clients see one output per generated token.
- Admission may be bounded (the server's): at most `max_num_seqs + max_queued_requests` sequences in flight, each
  sample of a request with n > 1 counted (as `max_num_seqs` counts them), so that one request of
  many prompts and samples cannot take every place while counting as a few; past that `add` raises
  `EngineOverloadedError` (the API answers 503) and nothing already admitted is touched.
- `between_steps(fn)` runs `fn(engine)` on the engine thread between two steps (an engine-wide call such as
  `reset_prefix_cache`), its result a future on the event loop.
- Requests that wait for admission are watched after each step: `on_scheduled(request_id, samples, t)`
  reports the start of the step that admitted those samples of one (the metrics' queue and prefill times): a
  request with n > 1 whose samples did not all fit beside the others is admitted part by part.
- If a step raises, the engine is dead: every in-flight request gets `EngineDeadError`, new ones too, and
  `on_dead` is called on the event loop (the server then stops: a process whose engine is gone should be
  restarted, not kept answering 503).
- At the end of a graceful shutdown's grace period `abort_all` ends every request still in flight at once
  (its group raises the error given, whatever step the engine thread is in) and aborts it in the engine;
  `shutdown` (a coroutine) or `close` (blocking) then stops the thread.
"""

from __future__ import annotations

import asyncio
import atexit
import logging
import queue
import threading
import weakref
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from loopserve.engine.engine import LLMEngine
from loopserve.engine.sequence import Sequence, Status
from loopserve.engine.stats import EngineStats
from loopserve.outputs import RequestOutput, request_clock
from loopserve.sampling_params import RequestOutputKind

log = logging.getLogger("loopserve.engine")


class EngineDeadError(RuntimeError):
    """The engine thread has stopped after a step raised (vLLM's `EngineDeadError`): nothing more runs on it. Its
    subclass `EngineStoppedError` says it was shut down instead."""


class EngineOverloadedError(RuntimeError):
    pass


class EngineStoppedError(EngineDeadError):
    """The engine thread has been shut down, or is shutting down: requests in flight end with it, new ones are
    refused. (An `EngineDeadError`, as vLLM's requests meet one after a shutdown.)"""


@dataclass
class EngineSnapshot:
    """Engine state as of the end of the last step, for `/metrics` and the periodic stats line (read from any
    thread)."""

    running: int = 0  # sequences admitted: each sample of a request with n > 1 counted
    waiting: int = 0  # sequences waiting for admission (queued or swapped out), samples counted too
    kv_usage: float = 0.0
    exit_depths: dict[int, int] = field(default_factory=dict)
    generated_tokens: int = 0  # every sample's, its first token included
    sampled_prompt_tokens: int = 0  # each sample's whole prompt, counted with its first token (`EngineStats`)
    core_batch: dict[int, int] = field(default_factory=dict)
    ticks: dict[str, int] = field(default_factory=dict)
    core_rows: int = 0
    useful_core_rows: int = 0
    prefill_token_loops: int = 0
    refill_events: int = 0
    preemptions: int = 0
    swap_ins: int = 0
    deferred_signal_steps: int = 0
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    swap_in_shared_blocks: int = 0
    spec_rounds: int = 0
    spec_draft_tokens: int = 0
    spec_accepted_tokens: int = 0
    spec_accepted_per_pos: tuple[int, ...] = ()  # by the draft's place in its round
    # engine steps that sampled, by their tokens as vLLM counts a step's: the whole prompts of the samples that got
    # their first token in it (cached tokens too; an n > 1 request's once per sample) plus the tokens generated
    iteration_tokens: dict[int, int] = field(default_factory=dict)

    def stats_line(self, since: EngineSnapshot, dt: float, prompt: int, generated: int) -> str:
        """vLLM's periodic stats line word for word, for the `dt` seconds from snapshot `since` to this one, in which
        `prompt` prompt tokens and `generated` tokens were counted (by the server's counters, or off the snapshots):
        its "GPU KV cache usage" on any device, as vLLM's CPU backend prints it (log alerts and scrapers written for
        vLLM read it as they are); the prefix cache's hit rate over those seconds' lookups. Then loopserve's mean
        exit depth of those seconds' decode tokens ("-": none)."""
        dt = max(dt, 1e-9)
        queries = self.prefix_cache_queries - since.prefix_cache_queries
        hit_rate = (self.prefix_cache_hits - since.prefix_cache_hits) / queries if queries else 0.0
        tokens = sum(self.exit_depths.values()) - sum(since.exit_depths.values())
        loops = sum(d * c for d, c in self.exit_depths.items()) - sum(d * c for d, c in since.exit_depths.items())
        depth = f"{loops / tokens:.2f}" if tokens else "-"
        return (f"Engine 000: Avg prompt throughput: {prompt / dt:.1f} tokens/s, Avg generation throughput: "
                f"{generated / dt:.1f} tokens/s, Running: {self.running} reqs, Waiting: {self.waiting} reqs, GPU KV "
                f"cache usage: {100 * self.kv_usage:.1f}%, Prefix cache hit rate: {100 * hit_rate:.1f}%, Mean exit "
                f"depth: {depth}")


def stat_totals(st: EngineStats) -> dict[str, Any]:
    """An `EngineSnapshot`'s fields that count from the engine's start (read off its `EngineStats`)."""
    return dict(
        exit_depths=dict(st.exit_depths), generated_tokens=st.generated_tokens,
        sampled_prompt_tokens=st.sampled_prompt_tokens, core_batch=dict(st.batch_hist.get("core", {})),
        ticks=dict(st.ticks), core_rows=st.rows.get("core", 0), useful_core_rows=st.useful_core_rows,
        prefill_token_loops=st.prefill_token_loops, refill_events=st.refill_events, preemptions=st.preemptions,
        swap_ins=st.swap_ins, deferred_signal_steps=st.deferred_signal_ticks,
        prefix_cache_queries=st.prefix_cache_queries, prefix_cache_hits=st.prefix_cache_hits,
        swap_in_shared_blocks=st.swap_in_shared_blocks, spec_rounds=st.spec_rounds,
        spec_draft_tokens=st.spec_draft_tokens, spec_accepted_tokens=st.spec_accepted_tokens,
        spec_accepted_per_pos=tuple(st.spec_accepted_per_pos))


class RequestGroup:
    """The engine requests of one client request. Iterate for `(index, RequestOutput)` pairs (one per
    new token, and a final one per request); `abort()` cancels what has not finished. `merge` (the public async
    engine's, as vLLM's): a request's outputs that arrive before the consumer read the last one are folded into it
    (`RequestOutput.add`: DELTA pieces joined, a CUMULATIVE output replaced), so that a slow consumer reads fewer,
    larger outputs instead of a queue that grows with every token (quadratically, for CUMULATIVE ones)."""

    def __init__(self, engine: EngineThread, request_ids: list[str],
                 merge: list[RequestOutputKind] | None = None) -> None:
        self._engine = engine
        self.request_ids = request_ids
        self.queue: asyncio.Queue[tuple[int, RequestOutput] | BaseException] = asyncio.Queue()
        self.pending = set(request_ids)
        self._aborted = False
        self._merge = merge  # per request: its output kind
        self._unread: dict[int, RequestOutput] = {}  # with `merge`: a request's output still in the queue
        self._unsent = set(request_ids)  # the requests whose final output the engine has not handed over
        # called (event-loop thread) when the engine has handed over every request's final output, read or not
        self.on_end: Callable[[], None] | None = None

    def put(self, index: int, out: RequestOutput) -> None:
        """Hand over request `index`'s next output (event-loop thread)."""
        if out.finished:
            self._unsent.discard(self.request_ids[index])
            if not self._unsent and self.on_end is not None:
                self.on_end()
                self.on_end = None  # (it may hold the group: no cycle left for the collector)
        if self._merge is not None:
            unread = self._unread.get(index)
            if unread is not None:
                unread.add(out, aggregate=self._merge[index] == RequestOutputKind.DELTA)
                return
            self._unread[index] = out
        self.queue.put_nowait((index, out))

    def __aiter__(self) -> RequestGroup:
        return self

    async def __anext__(self) -> tuple[int, RequestOutput]:
        if not self.pending:
            raise StopAsyncIteration
        item = await self.queue.get()
        if isinstance(item, BaseException):
            self.pending.clear()
            raise item
        index, out = item
        self._unread.pop(index, None)  # (read: later outputs queue anew)
        if out.finished:
            self.pending.discard(self.request_ids[index])
        return index, out

    def abort(self) -> None:
        """Abort the unfinished requests (idempotent; a no-op once all have finished)."""
        if self.pending and not self._aborted:
            self._aborted = True
            self._engine.abort(sorted(self.pending))


def _settle(future: asyncio.Future, result: Any, error: BaseException | None) -> None:
    if not future.done():  # (the caller may have stopped waiting)
        if error is not None:
            future.set_exception(error)
        else:
            future.set_result(result)


class EngineThread:
    """`max_queued_requests`: the admission bound past `max_num_seqs` (None: none). `stopped_message`: what a request
    refused or ended by the shutdown is told (`EngineStoppedError`)."""

    def __init__(self, engine: LLMEngine, max_queued_requests: int | None,
                 on_outputs: Callable[[list[RequestOutput]], None] | None = None,
                 idle_poll_s: float = 0.5, on_dead: Callable[[], None] | None = None,
                 on_scheduled: Callable[[str, tuple[int, ...], float], None] | None = None,
                 stopped_message: str = "the engine has been shut down") -> None:
        self.engine = engine
        self.capacity = None if max_queued_requests is None else engine.cfg.max_num_seqs + max_queued_requests
        self.stopped_message = stopped_message
        self.on_outputs = on_outputs
        self.on_scheduled = on_scheduled
        # engine thread only: the parts added, not admitted yet (by their heads' ids), with their samples' indices
        self._unscheduled: dict[str, tuple[Sequence, tuple[int, ...]]] = {}
        self.on_dead = on_dead
        self.idle_poll_s = idle_poll_s
        self.snapshot = EngineSnapshot(spec_accepted_per_pos=tuple(engine.stats.spec_accepted_per_pos))
        self._iteration_tokens: Counter[int] = Counter()  # (the snapshot's `iteration_tokens`)
        self.dead: BaseException | None = None
        self._cmds: queue.SimpleQueue[tuple[str, Any]] = queue.SimpleQueue()
        # `between_steps` queues a call only while the thread has not ended (under the lock it sets `_ended` under,
        # before answering the calls left): so every call is answered, by the thread or with its error
        self._calls_lock = threading.Lock()
        self._ended = False
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._stopping = False
        # event-loop thread only: request id -> (its group, its index there, its samples)
        self._routes: dict[str, tuple[RequestGroup, int, int]] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._life = threading.Lock()  # `start` against `hand_back` (from another thread): never half started

    # -- lifecycle (event-loop thread) ------------------------------------------------------------------
    def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._thread = threading.Thread(target=self._run, name="loopserve-engine", daemon=True)
        with self._life:
            self.engine.claim(self, None)  # (a RuntimeError if another thread steps the engine: nothing started)
            self._publish()  # (the engine's totals so far, read once it is ours: differences never start from zeros)
            _LIVE.add(self)
            with _THREADS_LOCK:  # (engines may start on several threads' loops at once)
                _THREADS.difference_update([t for t in _THREADS if not t.is_alive()])
                _THREADS.add(self._thread)
            self._thread.start()

    def __str__(self) -> str:
        return "an engine thread (an AsyncLLMEngine's or the server's)"

    @property
    def ident(self) -> int | None:
        """The engine thread's id (`threading.get_ident()` there), once started."""
        return self._thread.ident if self._thread is not None else None

    def hand_back(self) -> None:
        """Give the engine back to a caller on another thread (`LLM.generate` on the engine an `AsyncLLMEngine` ran):
        if the event loop this thread served no longer runs (`asyncio.run` returned without a `shutdown()`), or it
        holds no request (a notebook's loop always runs), stop the thread and wait for it; else a RuntimeError (two
        threads would step one engine). (`_routes` belongs to the loop's thread: read here only for being empty.)"""
        with self._life:
            if self._loop is not None and self._loop.is_running() and not self._stopping and self._routes:
                raise RuntimeError("the engine is stepped by an engine thread serving a running event loop, with "
                                   "requests in flight (AsyncLLMEngine): wait for them, or shutdown() it, before "
                                   "using the LLM synchronously")
            # (a request its loop adds from now on is refused with this, or ends with it: it raced the hand-back)
            self.stopped_message = "the engine was handed back to LLM.generate on another thread"
            self.stop()
        self.close()

    @property
    def loop(self) -> asyncio.AbstractEventLoop | None:
        """The event loop it was started on, whose tasks its outputs go to (None before `start`)."""
        return self._loop

    @property
    def stopping(self) -> bool:
        """`stop` was called (it admits nothing more; the thread ends once the engine has reported what it held)."""
        return self._stopping

    @property
    def alive(self) -> bool:
        return self.dead is None and self._thread is not None and self._thread.is_alive()

    def stop(self) -> None:
        """Stop admitting, abort whatever is still in flight, and let the engine thread end once the engine has
        reported them (from any thread: the engine thread aborts every request it holds, so the event loop's routes
        are not read here)."""
        self._stopping = True
        self._cmds.put(("abort_all", None))
        self._stop.set()
        self._wake.set()

    def _join(self, timeout_s: float | None) -> None:
        if self._thread is not None:
            self._thread.join(timeout_s)
            if self._thread.is_alive():
                log.warning("engine thread did not stop within %s s", timeout_s)

    async def shutdown(self, timeout_s: float = 10.0) -> None:
        """`stop`, wait for the engine thread without blocking the event loop, and end what is left in flight."""
        self.stop()
        await asyncio.to_thread(self._join, timeout_s)
        self._fail_all(EngineStoppedError(self.stopped_message))

    def close(self, timeout_s: float | None = None) -> None:
        """`shutdown` for a caller that is no coroutine (vLLM's `shutdown()` is not): it blocks until the thread
        has stopped (`timeout_s`: at most that long). Called off the event loop's thread, the requests left in
        flight are ended on the loop (if it still runs: else nobody waits for them), before the engine's abort
        outputs reach it (posted first: the loop runs its callbacks in order), so that they end with the error
        there too, not with their abort outputs."""
        exc = EngineStoppedError(self.stopped_message)
        try:
            on_loop = asyncio.get_running_loop() is self._loop
        except RuntimeError:  # no loop runs in this thread
            on_loop = False
        if not on_loop and self._loop is not None:
            self._post(self._fail_all, exc)
        self.stop()
        self._join(timeout_s)
        if on_loop:
            self._fail_all(exc)

    def abort_all(self, exc: BaseException) -> int:
        """Stop admitting, end every request group in flight with `exc` (its handler answers at once) and abort its
        requests in the engine; the engine thread goes on (`shutdown` stops it). The number of groups ended."""
        self._stopping = True
        groups = {id(group) for group, _, _ in self._routes.values()}
        if self._routes:
            self.abort(list(self._routes))
        self._fail_all(exc)
        return len(groups)

    # -- requests (event-loop thread) -------------------------------------------------------------------
    def add(self, seqs: list[Sequence], merge: bool = False) -> RequestGroup:
        """Queue requests (each with its samples) as one group. `merge`: outputs a consumer has not read yet are folded
        together (`RequestGroup`)."""
        if self.dead is not None:
            raise self.dead_error()
        if self._stopping:
            raise EngineStoppedError(self.stopped_message)
        in_flight = sum(samples for _, _, samples in self._routes.values())
        if self.capacity is not None and in_flight + sum(len(s.family) for s in seqs) > self.capacity:
            raise EngineOverloadedError(f"the server is at capacity ({self.capacity} sequences in flight or queued, "
                                        "each sample of a request counted)")
        group = RequestGroup(self, [s.request_id for s in seqs],
                             [s.params.output_kind for s in seqs] if merge else None)
        for i, s in enumerate(seqs):
            self._routes[s.request_id] = (group, i, len(s.family))
        self._cmds.put(("add", seqs))
        self._wake.set()
        return group

    def abort(self, request_ids: list[str]) -> None:
        self._cmds.put(("abort", list(request_ids)))
        self._wake.set()

    def serves_this_loop(self) -> bool:
        """Whether the running event loop is the one this thread answers on (`between_steps`' futures live there: a
        caller on another loop, say a Ray Serve replica's method, cannot await them)."""
        return self._loop is not None and asyncio.get_running_loop() is self._loop

    def between_steps(self, fn: Callable[[LLMEngine], Any]) -> asyncio.Future:
        """`fn(engine)` run on the engine thread between two steps (the engine is single-threaded: nothing else may
        touch it while the thread runs); a future of its result or its exception, on the event loop."""
        assert self._loop is not None
        future = self._loop.create_future()
        with self._calls_lock:
            if self._ended:
                _settle(future, None, self._end_error())
            else:
                self._cmds.put(("call", (fn, future)))
                self._wake.set()
        return future

    def dead_error(self) -> EngineDeadError:
        """What a request meets once a step has raised."""
        return EngineDeadError(f"the engine has stopped after an error: {self.dead!r}")

    def _end_error(self) -> BaseException:
        return self.dead_error() if self.dead is not None else EngineStoppedError(self.stopped_message)

    def _end(self) -> None:
        """The engine thread's last act: no call is queued from now on, and those queued are answered with its error
        (or stopped)."""
        with self._calls_lock:
            self._ended = True
        exc = self._end_error()
        for kind, payload in self._queued_commands():
            if kind == "call":
                self._post(_settle, payload[1], None, exc)

    def _queued_commands(self) -> Iterator[tuple[str, Any]]:
        """The commands queued so far, each taken off the queue as it is read."""
        while True:
            try:
                yield self._cmds.get_nowait()
            except queue.Empty:
                return

    def _deliver(self, outs: list[RequestOutput]) -> None:
        for out in outs:
            route = self._routes.get(out.request_id)
            if route is None:
                continue
            group, index, _ = route
            group.put(index, out)
            if out.finished:
                del self._routes[out.request_id]

    def _fail_all(self, exc: BaseException) -> None:
        for group, _, _ in list(self._routes.values()):
            group.queue.put_nowait(exc)
        self._routes.clear()

    def _post(self, fn: Callable, *args) -> None:
        assert self._loop is not None
        try:
            self._loop.call_soon_threadsafe(fn, *args)
        except RuntimeError:  # the loop has closed: nobody is listening any more
            pass

    # -- the engine thread --------------------------------------------------------------------------------
    def _apply_commands(self) -> None:
        for kind, payload in self._queued_commands():
            if kind == "add":
                for seq in payload:
                    self.engine.add_sequence(seq)
                    if self.on_scheduled is not None:
                        for part in seq.family:
                            if part.prefill_head is part:
                                samples = (part.index, *(s.index for s in part.pending_forks))
                                self._unscheduled[part.request_id] = (part, samples)
            elif kind == "abort_all":
                self._abort_requests()
            elif kind == "call":
                fn, future = payload
                try:
                    result = fn(self.engine)
                except Exception as e:  # (the caller's error, not the engine's: it goes to the caller)
                    self._post(_settle, future, None, e)
                else:
                    self._post(_settle, future, result, None)
            else:
                for rid in payload:
                    if rid in self.engine.requests:
                        self.engine.abort_request(rid)

    def _note_admissions(self, step_start: float) -> None:
        running = self.engine.scheduler.running
        for rid, (part, samples) in list(self._unscheduled.items()):
            # admitted: resident now, or already finished with tokens (admitted and done in one step)
            if rid in running or (part.status is Status.FINISHED and part.output_ids):
                del self._unscheduled[rid]
                assert self.on_scheduled is not None
                self.on_scheduled(part.family[0].request_id, samples, step_start)
            elif part.status is Status.FINISHED:  # aborted or rejected while waiting
                del self._unscheduled[rid]

    def _publish(self) -> None:
        eng = self.engine
        sched, st = eng.scheduler, eng.stats
        # both counted in sequences, each sample of a request with n > 1 one (as vLLM V1 counts them, and as
        # max_num_seqs does): an admitted prompt's samples run with it (they hold their places from its admission
        # on, and fork when its prefill completes: the scheduler's `resident`), a waiting one's wait with it
        waiting = sum(1 + len(s.pending_forks) for s in sched.waiting if s.request_id not in sched.running)
        self.snapshot = EngineSnapshot(
            running=sched.resident(), waiting=waiting + len(sched.swapped), kv_usage=eng.kv_usage(),
            iteration_tokens=dict(self._iteration_tokens), **stat_totals(st))

    def _tokens_so_far(self) -> int:
        """The engine's tokens so far as vLLM counts a step's: each sample's prompt with its first token (an n > 1
        request's once per sample), and the tokens generated."""
        st = self.engine.stats
        return st.sampled_prompt_tokens + st.generated_tokens

    def _run(self) -> None:
        self.engine.claim(self, threading.get_ident())  # (from now on only this thread may add to or step it)
        try:
            with torch.no_grad():
                while True:
                    self._wake.clear()
                    self._apply_commands()
                    if self.engine.has_unfinished_requests():
                        step_start, tokens_before = request_clock(), self._tokens_so_far()  # (RequestMetrics' clock)
                        outs = self.engine.step()
                        tokens = self._tokens_so_far() - tokens_before
                        if tokens:
                            self._iteration_tokens[tokens] += 1
                        if self._unscheduled:
                            self._note_admissions(step_start)
                        if self.on_outputs is not None and outs:
                            self.on_outputs(outs)
                        self._publish()
                        if outs:
                            self._post(self._deliver, outs)
                        continue
                    self._publish()
                    if self._stop.is_set():
                        return
                    self._wake.wait(self.idle_poll_s)
                    if self._loop is not None and self._loop.is_closed() and not self._stopping:
                        self.stop()  # its event loop has ended (`asyncio.run` returned, no shutdown): nobody reads on
        except BaseException as e:  # a bug in a step: fail loudly, answer what is in flight, then report
            log.exception("engine step failed; the engine is stopped")
            self.dead = e
            try:  # its requests too: the LLM it belongs to may still be used (`generate`), which ran them to their end
                self._abort_requests()  # first, unseen (57 s for a 2-token request after two long ones)
            except Exception:  # (best effort: the step that raised may have left what an abort cannot undo)
                log.exception("could not abort the dead engine's requests")
            self._post(self._fail_all, EngineDeadError(f"engine error: {e!r}"))
            if self.on_dead is not None:
                self._post(self.on_dead)
        finally:
            self.engine.release(self)
            self._end()

    def _abort_requests(self) -> None:
        """Abort every request in the engine (their KV freed): each once, by its head, which takes its samples
        along."""
        self.engine.abort_request([rid for rid, seq in self.engine.requests.items() if seq is seq.family[0]])


# Engine threads started and not yet collected; and their threads, alive or lately ended. At exit each is stopped and
# its thread waited for: a daemon thread still in a step while the interpreter finalizes aborted the process
# ("terminate called without an active exception"). So did one that had left its loop but was still dropping its
# engine: with nothing else holding it (an `AsyncLLM` made in `main()`, no shutdown), its thread held the last
# reference, and freed the model and the KV store as it ended, after the `EngineThread` had left `_LIVE`.
_LIVE: weakref.WeakSet[EngineThread] = weakref.WeakSet()
_THREADS: set[threading.Thread] = set()
_THREADS_LOCK = threading.Lock()
EXIT_JOIN_S = 10.0


@atexit.register
def _stop_at_exit() -> None:
    for engine_thread in list(_LIVE):
        if engine_thread.alive:
            engine_thread.stop()
    with _THREADS_LOCK:
        threads = list(_THREADS)
    for thread in threads:
        thread.join(EXIT_JOIN_S)
        if thread.is_alive():
            log.warning("engine thread did not stop within %s s", EXIT_JOIN_S)
