"""`AsyncLLMEngine` (also `AsyncLLM`, vLLM V1's name): vLLM's asyncio API, and `EngineArgs` / `AsyncEngineArgs`, the
keywords one is built from.

An `AsyncLLMEngine` is an `LLM` (built from the args: its engine, tokenizer, chat template, generation defaults and
request checks, `LLM._make_sequence`) whose engine runs on an `EngineThread` (engine/engine_thread.py), the server's
thread too. The thread starts with the first `generate`, on the event loop that runs it (outputs are handed to that
loop); `shutdown()` stops it, and a later `generate` starts another, on its own loop (`asyncio.run` again).

`generate` is an async generator of one request's `RequestOutput`s as its `output_kind` asks (vLLM's rules, the
engine's outputs). Engine request ids are the LLM's own (unique), the caller's `request_id` goes on the outputs: a
request the caller stopped reading frees its id once its generator is closed (`aclose()`, cancelled, or collected:
a generator merely left by `break` is closed by asyncio a few loop turns later, or never while a reference holds
it), and at once when `abort(request_id)` is called,
whatever step the engine is in. A consumer that stops early (breaks out, is cancelled, closes the generator or drops
it) aborts its request, as vLLM does; `abort(request_id)`
ends a stream with a final output whose finish_reason is "abort" (vLLM V1's). A step that raises kills the engine:
every stream and every later call raise `EngineDeadError`. An event loop that ends without `shutdown()` stops its
engine thread; so does the interpreter's exit. `LLM.generate` on the same engine takes it back from a thread whose
loop has ended, and refuses (RuntimeError) while that loop runs: two threads never step one engine.

`beam_search` is vLLM's `EngineClient.beam_search`: the server's `use_beam_search` code (beam_search.py's
`run_steps`) on this engine's thread, its `request_id` in flight for the whole search, one final output at its end.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import functools
import logging
import threading
import time
from collections.abc import AsyncGenerator, Hashable, Iterable
from pathlib import Path
from typing import Any, ClassVar, TypeVar

from loopserve.beam_search import check_search_params, generated_text, new_search, run_steps, search_prompts
from loopserve.engine.config import EngineConfig
from loopserve.engine.engine import LLMEngine, check_request_id
from loopserve.engine.engine_thread import (
    EngineDeadError,
    EngineSnapshot,
    EngineStoppedError,
    EngineThread,
    RequestGroup,
    stat_totals,
)
from loopserve.engine.sequence import PromptType
from loopserve.llm import LLM, SUPPORTED_TASKS, llm_configs
from loopserve.load_config import LoadConfig
from loopserve.model_config import EngineModelConfig
from loopserve.outputs import RequestOutput
from loopserve.sampling_params import BeamSearchParams, SamplingParams, with_tokenization_kwargs
from loopserve.tokenizer import Tokenizer
from loopserve.vllm_neutral import (
    ASYNC_ABSENT_METHODS,
    absent_method,
    add_neutral_args,
    check_neutral,
    neutral_kwargs,
)

__all__ = ["AsyncLLMEngine", "AsyncLLM", "AsyncEngineArgs", "EngineArgs", "EngineDeadError", "EngineStoppedError"]

log = logging.getLogger(__name__)
SHUT_DOWN = "the AsyncLLMEngine has been shut down"  # what its requests meet after `shutdown()`


_Args = TypeVar("_Args")
# `EngineArgs`' settings beside `model`, `chat_template` and `generation_config`: the fields of `LLM`'s two configs
CONFIG_FIELDS = tuple(f for config in (LoadConfig, EngineConfig) for f in dataclasses.fields(config))
_CONFIG_NAMES = frozenset(f.name for f in CONFIG_FIELDS)


def _with_config_fields(cls: type[_Args]) -> type[_Args]:
    """`cls` as a dataclass whose fields are its own, then every `CONFIG_FIELDS` field with its default and help (one
    declaration: the configs'), as vLLM's `EngineArgs` is a dataclass of its settings (`dataclasses.asdict`,
    `replace` and `fields` work on it)."""
    annotations = dict(cls.__dict__.get("__annotations__", {}))
    for f in CONFIG_FIELDS:
        annotations[f.name] = f.type
        setattr(cls, f.name, dataclasses.field(default=f.default, metadata=f.metadata))
    cls.__annotations__ = annotations
    return dataclasses.dataclass(init=False)(cls)


@_with_config_fields
class EngineArgs:
    """vLLM's `EngineArgs`: a dataclass of `model`, `chat_template`, `generation_config` and the other keywords of
    `LLM(...)` (its configs' fields, each with its default), kept to build an engine from, so that
    `LLM(**dataclasses.asdict(args))` builds what `args.create_llm()` does. They are checked as `LLM` checks them
    (`llm_configs`): an unknown one, or a value out of range, is a ValueError naming it, when built and when set
    (`args.max_num_seqs = 8`). vLLM's keywords for what loopserve lacks (`NEUTRAL`) are taken at the values that ask
    for nothing of it and read back as attributes when given (`args.enable_chunked_prefill`), but are not fields:
    they change nothing."""

    __dataclass_fields__: ClassVar[dict[str, dataclasses.Field[Any]]]  # (made by the decorator: for the type checker)
    # the neutral keywords given, in a slot beside the instance dict, so that `vars(args)` holds exactly the fields
    # (`LLM(**vars(args))`, a vLLM idiom, as vLLM's plain dataclass allows); unset until `__init__` ran
    __slots__ = ("__dict__", "__weakref__", "_neutral")
    model: str | Path | None = None
    chat_template: str | None = None
    generation_config: str = "auto"

    def __init__(self, model: str | Path | None = None, *, chat_template: str | None = None,
                 generation_config: str = "auto", **kwargs: Any) -> None:
        llm_configs(kwargs, model)  # (a ValueError naming an unknown keyword, or a value out of range)
        for f in CONFIG_FIELDS:
            self.__dict__[f.name] = kwargs.get(f.name, f.default)
        self.model, self.chat_template, self.generation_config = model, chat_template, generation_config
        object.__setattr__(self, "_neutral", {k: v for k, v in kwargs.items() if k not in _CONFIG_NAMES})

    def _given_neutral(self) -> dict[str, Any] | None:
        """The neutral keywords given; None before `__init__` ran (copy and pickle look up hooks on such an instance,
        a subclass's dataclass `__init__` sets fields)."""
        try:
            return object.__getattribute__(self, "_neutral")
        except AttributeError:
            return None

    def settings(self) -> dict[str, Any]:
        """The `LLM(...)` keywords (but `model`, `chat_template` and `generation_config`) these args hold."""
        return {**{f.name: getattr(self, f.name) for f in CONFIG_FIELDS}, **(self._given_neutral() or {})}

    def __getattr__(self, name: str) -> Any:
        neutral = self._given_neutral() or {}
        if name in neutral:
            return neutral[name]
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    def __setattr__(self, name: str, value: Any) -> None:
        # (a subclass's own dataclass __init__ sets every field, this class's too, before any check can read them:
        # set as given, checked when the LLM is made)
        built = name != "_neutral" and self._given_neutral() is not None
        if not built or (name not in _CONFIG_NAMES and name in {f.name for f in dataclasses.fields(self)}):
            super().__setattr__(name, value)
            return
        llm_configs({**self.settings(), name: value}, self.model)  # (an unknown name, or a bad value: nothing changed)
        if name in _CONFIG_NAMES:
            super().__setattr__(name, value)
        else:  # (a new dict: a copy made with copy.copy keeps its own)
            object.__setattr__(self, "_neutral", {**(self._given_neutral() or {}), name: value})

    def create_llm(self) -> LLM:
        return LLM(self.model, chat_template=self.chat_template, generation_config=self.generation_config,
                   **self.settings())

    @classmethod
    def add_cli_args(cls, parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
        """vLLM's: the engine's flags on `parser` (those of `loopserve serve`: `--model`, each `LoadConfig` and
        `EngineConfig` field, `--chat-template`, `--generation-config`, and vLLM's flags for what loopserve lacks,
        `vllm_neutral.add_neutral_args`); returns it."""
        from loopserve.cli import add_chat_args, add_engine_args

        add_engine_args(parser)
        add_chat_args(parser)
        add_neutral_args(parser)
        return parser

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace) -> EngineArgs:
        """vLLM's: the args of a namespace parsed with `add_cli_args`' flags."""
        from loopserve.cli import engine_kwargs, load_kwargs

        return cls(args.model, chat_template=args.chat_template, generation_config=args.generation_config,
                   **cls._own_cli_kwargs(args), **load_kwargs(args), **engine_kwargs(args), **neutral_kwargs(args))

    @classmethod
    def _own_cli_kwargs(cls, args: argparse.Namespace) -> dict[str, Any]:
        return {}


@dataclasses.dataclass(init=False)
class AsyncEngineArgs(EngineArgs):
    """vLLM's `AsyncEngineArgs`: `EngineArgs` and the async engine's own `enable_log_requests` (a log line per
    request added and aborted; `disable_log_requests`, vLLM's older name, says the opposite)."""

    enable_log_requests: bool = False

    @classmethod
    def add_cli_args(cls, parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
        super().add_cli_args(parser)
        requests = parser.add_mutually_exclusive_group()
        requests.add_argument("--enable-log-requests", action="store_true",
                              help="log each request added and aborted")
        requests.add_argument("--disable-log-requests", action="store_true",
                              help="no log line per request, as without --enable-log-requests (vLLM's older flag)")
        return parser

    @classmethod
    def _own_cli_kwargs(cls, args: argparse.Namespace) -> dict[str, Any]:
        return {"enable_log_requests": bool(getattr(args, "enable_log_requests", False))}

    def __setattr__(self, name: str, value: Any) -> None:
        if name == "enable_log_requests" and not isinstance(value, bool):
            raise ValueError(f"enable_log_requests: expected a bool, got {value!r}")
        super().__setattr__(name, value)

    @property
    def disable_log_requests(self) -> bool:
        """vLLM's older name, the opposite of `enable_log_requests`."""
        return not self.enable_log_requests

    def __init__(self, model: str | Path | None = None, *, enable_log_requests: bool | None = None,
                 disable_log_requests: bool | None = None, **kwargs: Any) -> None:
        super().__init__(model, **kwargs)
        given = {"enable_log_requests": enable_log_requests, "disable_log_requests": disable_log_requests}
        for name, value in given.items():
            if value is not None and not isinstance(value, bool):
                raise ValueError(f"{name}: expected a bool, got {value!r}")
        if enable_log_requests is not None and enable_log_requests == disable_log_requests:
            raise ValueError(f"disable_log_requests: {disable_log_requests} contradicts enable_log_requests="
                             f"{enable_log_requests}; give one of them")
        self.enable_log_requests = enable_log_requests if enable_log_requests is not None else (
            disable_log_requests is False)


class AsyncLLMEngine:
    """vLLM's `AsyncLLMEngine` (V1: `AsyncLLM`): `from_engine_args(AsyncEngineArgs(model=..., ...))`, then
    `async for out in engine.generate(prompt, params, request_id)`, `await abort(request_id)`,
    `get_tokenizer()`, `shutdown()`. Use it from one event loop at a time (module docstring). `llm`: the `LLM` it is
    built on, whose engine it runs: `llm.generate` takes the engine back from an engine thread with nothing in flight
    or whose loop has ended, and is a RuntimeError while the thread serves requests (two threads would step one
    engine)."""

    def __init__(self, llm: LLM, log_requests: bool = False) -> None:
        self.llm = llm
        self.engine: LLMEngine = llm.llm_engine  # (a ValueError naming `scheduler` for the reference decoder)
        self.log_requests = log_requests
        self._thread: EngineThread | None = None
        self._thread_lock = threading.Lock()  # (two event loops' threads may each ask for the engine thread at once)
        self._closed = False  # shut down, and no generate since
        # event-loop thread only: the caller's request id -> its group (`_Building` while the request is built)
        self._streams: dict[str, RequestGroup | _Building] = {}
        # when `do_log_stats` last logged, and what it read (first: the engine's totals so far, which an `LLM` it wraps
        # may have run up; no thread steps the engine yet)
        self._logged = time.monotonic(), EngineSnapshot(**stat_totals(self.engine.stats))
        self._log_active = False  # that line had tokens

    @classmethod
    def from_engine_args(cls, engine_args: EngineArgs, start_engine_loop: bool = True, usage_context: Any = None,
                         stat_loggers: Any = None) -> AsyncLLMEngine:
        """Build the engine (the model loads here). `start_engine_loop`: vLLM's; the engine thread starts with the
        first `generate` either way (it hands outputs to the event loop running it, which only then is known).
        `usage_context` (vLLM's usage telemetry, which loopserve does not send) and `stat_loggers` (None: loopserve
        logs no periodic stats) are taken at the values that ask for nothing."""
        if not isinstance(engine_args, EngineArgs):
            raise ValueError(f"engine_args: expected an AsyncEngineArgs, got {type(engine_args).__name__}")
        if not isinstance(start_engine_loop, bool):
            raise ValueError(f"start_engine_loop: expected a bool, got {start_engine_loop!r}")
        check_neutral(usage_context=usage_context, stat_loggers=stat_loggers)
        return cls(engine_args.create_llm(), getattr(engine_args, "enable_log_requests", False))

    def __getattr__(self, name: str) -> Any:
        """vLLM's methods for what loopserve lacks (`vllm_neutral.ABSENT_METHODS`, and `ASYNC_ABSENT_METHODS`): a
        ValueError naming the method and what to use instead when called; any other missing attribute is the usual
        AttributeError."""
        return absent_method(self, name, ASYNC_ABSENT_METHODS)

    # -- state (vLLM's names) ---------------------------------------------------------------------------------------
    @property
    def errored(self) -> bool:
        """A step raised (the engine is dead: every stream raised `EngineDeadError`), or it was shut down (vLLM's:
        not running); a later `generate` after a shutdown starts it again."""
        return self._closed or (self._thread is not None and self._thread.dead is not None)

    @property
    def is_running(self) -> bool:
        """Not dead and not shut down (True before the first `generate` too, as vLLM's)."""
        return not self.errored

    @property
    def is_stopped(self) -> bool:
        """vLLM's: `errored`."""
        return self.errored

    @property
    def tokenizer(self) -> Tokenizer:
        return self.llm.get_tokenizer()

    @property
    def model_config(self) -> EngineModelConfig:
        """vLLM's: its LLM's model_config (the model's shapes and max_model_len)."""
        return self.llm.model_config

    @property
    def dead_error(self) -> EngineDeadError:
        """vLLM's: the error a dead (or shut down) engine's requests meet."""
        if self._thread is not None and self._thread.dead is not None:
            return self._thread.dead_error()
        if self._closed:
            return EngineStoppedError(SHUT_DOWN)
        return EngineDeadError("the engine has not failed")

    async def check_health(self) -> None:
        if self.errored:
            raise self.dead_error

    def get_tokenizer(self, lora_request: Any = None) -> Tokenizer:
        """The tokenizer (vLLM's, a plain method since V1's renderer; older vLLM awaited it, and so may a caller here:
        the tokenizer is awaitable, giving itself)."""
        check_neutral(lora_request=lora_request)
        return self.llm.get_tokenizer()

    async def is_tracing_enabled(self) -> bool:
        return False  # (loopserve exports no OpenTelemetry traces)

    async def get_supported_tasks(self) -> tuple[str, ...]:
        return SUPPORTED_TASKS

    async def reset_mm_cache(self) -> None:
        """vLLM's: loopserve takes no multimodal inputs, so there is no such cache to reset."""

    async def do_log_stats(self, *args: Any, **kwargs: Any) -> None:
        """vLLM's periodic stats line (`EngineSnapshot.stats_line`), logged from the engine thread's last snapshot (it
        is not read while the thread steps): throughputs, prefix-cache hit rate and mean exit depth since the last call
        (or since this AsyncLLMEngine was made), sequences running and waiting, KV cache use. At INFO, but a line with
        no tokens after one with none, at DEBUG, as vLLM's logger."""
        now, (then, last) = time.monotonic(), self._logged
        # (no thread, before the first generate or after shutdown: nothing runs, and nothing was counted since)
        snap = self._thread.snapshot if self._thread is not None else dataclasses.replace(last, running=0, waiting=0,
                                                                                          kv_usage=0.0)
        self._logged = now, snap
        prompt = snap.sampled_prompt_tokens - last.sampled_prompt_tokens
        generated = snap.generated_tokens - last.generated_tokens
        # as vLLM's: an idle line at DEBUG, but the first after a busy one
        active, was_active = bool(prompt or generated), self._log_active
        self._log_active = active
        log.log(logging.INFO if active or was_active else logging.DEBUG,
                snap.stats_line(last, now - then, prompt, generated))

    async def reset_prefix_cache(self, reset_running_requests: bool = False, reset_connector: bool = False) -> bool:
        """`LLMEngine.reset_prefix_cache` (vLLM's rules: only with no request in flight, else False), run between
        two steps of the engine thread when it runs."""
        def reset(engine: LLMEngine) -> bool:
            return engine.reset_prefix_cache(reset_running_requests, reset_connector)
        thread = self._thread
        if thread is not None and thread.dead is not None:
            raise self.dead_error
        if self._closed or thread is None or not thread.alive:  # (shut down, or never started: here, starting nothing)
            if thread is not None and thread.alive:  # (a shutdown(timeout) returned before it ended: let it end)
                await asyncio.to_thread(thread.close)
            return reset(self.engine)
        return await self._engine_thread().between_steps(reset)

    async def is_sleeping(self) -> bool:
        return False  # (vLLM's: loopserve never puts the model to sleep)

    # -- requests -----------------------------------------------------------------------------------------------
    async def generate(self, prompt: PromptType, sampling_params: SamplingParams, request_id: str, *,
                       lora_request: Any = None, tokenization_kwargs: dict[str, Any] | None = None,
                       trace_headers: Any = None, priority: int = 0,
                       data_parallel_rank: int | None = None) -> AsyncGenerator[RequestOutput, None]:
        """One request's outputs, as `sampling_params.output_kind` asks: an output per token with everything so far
        (CUMULATIVE, the default), with what is new (DELTA), or one when it finishes (FINAL_ONLY). `prompt`: what
        `LLM.generate` takes for one prompt (text, token ids, a TextPrompt or TokensPrompt). Checked as `LLM` checks
        a request when the generator is first iterated: a ValueError naming the field; a `request_id` in flight is
        one too. `lora_request`, `tokenization_kwargs`, `trace_headers`, `priority` and `data_parallel_rank` are vLLM's,
        taken at the values that ask for nothing (`vllm_neutral`)."""
        check_neutral(lora_request=lora_request, tokenization_kwargs=tokenization_kwargs, trace_headers=trace_headers,
                      priority=priority, data_parallel_rank=data_parallel_rank)
        check_request_id(request_id)
        if isinstance(sampling_params, BeamSearchParams):
            raise ValueError("sampling_params: a beam search (BeamSearchParams) is run by beam_search(prompt, "
                             "request_id, params), not generate")
        if not isinstance(sampling_params, SamplingParams):
            raise ValueError(f"sampling_params: expected a SamplingParams, got {type(sampling_params).__name__}")
        sampling_params = with_tokenization_kwargs(sampling_params, tokenization_kwargs)
        thread = self._engine_thread()  # (first: a thread it replaces takes its loop's streams along)
        if thread.dead is not None:  # (before the id: a dead engine's requests never freed theirs)
            raise self.dead_error
        if request_id in self._streams:
            raise ValueError(f"request_id: {request_id!r} is already in flight")
        # built on a worker thread, the id held meanwhile: tokenizing a long text (which releases the GIL) or checking
        # a grammar took seconds on the event loop, every other stream waiting (vLLM tokenizes off the loop too)
        building = _Building()
        self._streams[request_id] = building
        try:
            # (numbered here, in the order of the calls, as on the loop: a worker's order would vary the unseeded seeds)
            seq = await asyncio.to_thread(self.llm._make_sequence, prompt, sampling_params, sampling_params.output_kind,
                                          self.llm.take_index())
            group = thread.add([seq], merge=True)  # (a consumer that falls behind reads merged outputs, as vLLM's)
        except BaseException:
            if self._streams.get(request_id) is building:
                del self._streams[request_id]
            raise
        if self._streams.get(request_id) is building:
            self._streams[request_id] = group
            # its id is free again once the engine finished it, read or not (vLLM frees it then: a consumer that
            # has not read the final output, or never will, held it)
            group.on_end = functools.partial(self._free_id, request_id, group)
        else:  # aborted while it was built (or the engine shut down): it ends at once, as an abort does
            group.abort()
        if self.log_requests:
            log.info("Added request %s.", request_id)
        try:
            async for _, out in group:
                out.request_id = request_id
                yield out
        finally:
            # the consumer stopped before the end (broke out, was cancelled, closed or dropped the generator): the
            # request is aborted, as vLLM aborts it, so that it frees its KV blocks (a no-op once it finished)
            group.abort()
            self._free_id(request_id, group)

    def _free_id(self, request_id: str, group: RequestGroup) -> None:
        """`request_id` is free again, unless it names a newer request than `group`'s (after an abort, say)."""
        if self._streams.get(request_id) is group:
            del self._streams[request_id]

    async def beam_search(self, prompt: PromptType, request_id: str, params: BeamSearchParams,
                          lora_request: Any = None) -> AsyncGenerator[RequestOutput, None]:
        """vLLM's `EngineClient.beam_search`: `LLM.beam_search`'s search of one prompt, run on this engine's thread
        as the server runs its `use_beam_search` (beam_search.py's `run_steps`: each step's beams added together, as
        one request's samples are), yielding one RequestOutput, final, once the search is over: its outputs the best
        `params.beam_width` beams, best first, as the server returns them (`BeamSearch.request_outputs`: a beam's
        generated token ids, a final end-of-sequence token included; their text, that token left out unless
        `include_stop_str_in_output`, special tokens skipped (the server's default; vLLM's decode keeps them); every
        token's logprobs; a completed beam's end-of-sequence token as its stop_reason). Its beams are
        `LLM.beam_search`'s for the same params (every step is seeded with the LLM's seed).

        `request_id` is in flight for the whole search: `abort(request_id)` ends it after the step under way, and the
        output then holds the best beams so far, those still live finishing "abort"; a consumer that stops reading
        aborts the step in flight. A ValueError naming the field, as `LLM.beam_search` names it, when the generator
        is first iterated; a `request_id` in flight is one too. `lora_request`: vLLM's, taken at None."""
        check_neutral(lora_request=lora_request)
        check_request_id(request_id)
        check_search_params(self.llm, params)
        [(text, ids)] = search_prompts(self.llm, [prompt])
        thread = self._engine_thread()  # (first: a thread it replaces takes its loop's streams along)
        if thread.dead is not None:  # (before the id: a dead engine's requests never freed theirs)
            raise self.dead_error
        if request_id in self._streams:
            raise ValueError(f"request_id: {request_id!r} is already in flight")
        search = new_search(self.llm, [ids], params)
        step_params = search.step_params(self.llm.seed)
        running: list[RequestGroup] = []  # the latest step's group: the one `_streams` holds under request_id

        async def step(prompts: list[tuple[int, list[int]]]) -> list[RequestOutput] | None:
            if running and self._streams.get(request_id) is not running[-1]:
                return None  # aborted between two steps
            seqs = [self.llm._make_sequence({"prompt_token_ids": tokens}, step_params) for _, tokens in prompts]
            group = thread.add(seqs)
            running[:] = [group]
            self._streams[request_id] = group
            outs: list[RequestOutput | None] = [None] * len(seqs)
            async for i, out in group:
                if out.finished:
                    outs[i] = out
            if self._streams.get(request_id) is not group:
                return None  # aborted during the step (its outputs end "abort": not the search's)
            return [o for o in outs if o is not None]

        if self.log_requests:
            log.info("Added request %s.", request_id)
        try:
            await run_steps(search, step)
        finally:
            # (a consumer that stopped reading: the step in flight is aborted, as `generate` aborts its request)
            for group in running:
                group.abort()
                if self._streams.get(request_id) is group:
                    del self._streams[request_id]
        [out] = search.request_outputs(generated_text(self.llm.tokenizer, params.include_stop_str_in_output))
        out.request_id, out.prompt = request_id, text
        yield out

    async def abort(self, request_id: str | Iterable[str]) -> None:
        """Abort requests in flight (one id or several; an id not in flight is passed over, as in vLLM): each stream
        ends with a final output whose finish_reason is "abort"."""
        if not isinstance(request_id, str | Iterable):
            raise ValueError(f"request_id: expected a request id (a str) or a list of them, got "
                             f"{type(request_id).__name__}")
        ids = [request_id] if isinstance(request_id, str) else list(request_id)
        for rid in ids:
            # (its id is free at once, as vLLM frees it; something that cannot be an id is not in flight)
            group = self._streams.pop(rid, None) if isinstance(rid, Hashable) else None
            if group is not None:
                group.abort()
        if self.log_requests:
            log.info("Aborted request(s) %s.", ",".join(map(str, ids)))

    # -- the engine thread ----------------------------------------------------------------------------------------
    def _engine_thread(self) -> EngineThread:
        """The engine thread serving the running event loop: started by the first `generate`, and again after
        `shutdown()` or once the loop it served has ended. A dead one is kept (its `add` raises EngineDeadError)."""
        loop = asyncio.get_running_loop()
        with self._thread_lock:
            thread = self._thread
            if thread is not None and thread.dead is None and (thread.loop is not loop or thread.stopping):
                assert thread.loop is not None
                if thread.loop is not loop and thread.loop.is_running():
                    raise RuntimeError("AsyncLLMEngine: its engine thread serves another event loop, which is still "
                                       "running; use one AsyncLLMEngine per event loop, or shutdown() first")
                # its loop has ended, or it was shut down and has not stopped yet: waited for to the end, so that
                # never two threads step the engine; the streams of its loop are gone with it
                thread.close()
                thread = None
                self._streams.clear()
            if thread is None:
                thread = EngineThread(self.engine, max_queued_requests=None,
                                      stopped_message=SHUT_DOWN)
                thread.start()  # (a RuntimeError if another thread steps the engine: another AsyncLLMEngine on it)
                self._thread = thread
                self._closed = False
            return thread

    def shutdown(self, timeout: float | None = None) -> None:
        """Stop the engine thread (idempotent): requests in flight are aborted, their streams raise
        `EngineStoppedError`. Blocks until it has stopped (`timeout`: seconds, at most). A later `generate`
        starts a new thread."""
        thread = self._thread
        if thread is not None and thread.dead is None:  # (a dead one has stopped; kept, `errored` reads it)
            thread.close(timeout)
            if not thread.alive:  # (still stepping past `timeout`: kept, so that the next generate waits for it)
                self._thread = None
        self._streams.clear()  # (their requests were aborted: the ids are free at once, as after `abort`)
        self._closed = True

    def __del__(self) -> None:
        # a dropped engine's thread would poll on, holding the model: told to stop (without waiting for it, as
        # this may run anywhere the collector does)
        thread = self.__dict__.get("_thread")
        if thread is not None:
            thread.stop()


class _Building:
    """A request id's place in `AsyncLLMEngine._streams` while its request is built: an abort meanwhile takes it."""

    def abort(self) -> None:
        pass


AsyncLLM = AsyncLLMEngine  # vLLM V1's name for it
