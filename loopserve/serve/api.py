"""The FastAPI app: `build_app(engine, settings, on_engine_dead)`, around `OpenAIServing`, which holds
the engine and the settings and has one method per endpoint.

Endpoints: POST /v1/completions, POST /v1/chat/completions (both stream as SSE `data: {...}`
chunks ending with `data: [DONE]`), POST /v1/responses (OpenAI's Responses API, run as the chat request it translates
to: serve/responses_api.py; it streams as that API's events), POST /invocations (SageMaker's: completions or chat, by
the body), GET /v1/models and
/v1/models/{model}, vLLM's POST /tokenize and POST
/detokenize, GET /version, GET /health (and vLLM's GET or POST /ping), GET /load (vLLM's: the generation requests in
flight, with `ServerSettings.server_load_tracking`; else 0), GET /metrics, GET /openapi.json (the
request bodies' JSON schemas included, though the endpoints parse the raw body themselves). Completions and
chat share one path from admission to response: one choice builder and one stream writer, told apart by a `_Kind`.
vLLM's `use_beam_search` runs loopserve/beam_search.py's search on that path, step by step
(`OpenAIServing.beam_search`).

Every error is an OpenAI-style body {"error": {"message", "type", "param", "code"}}: bad input is
a 400 (401 bad API key, 404 unknown model or route, 413 body too large, 415 a body that is not
JSON), overload a 503 with Retry-After. Requests are validated (tokenizing, checking lengths and
sampling values, compiling grammars) before they reach the engine, so nothing invalid is ever
admitted; unknown fields are ignored with a warning in the log (vLLM's behaviour). A generation
request's sequences are built on a worker thread, not on the event loop: compiling a grammar can take
a second, and llguidance releases the GIL meanwhile, so the other requests are served. /tokenize and
/detokenize run on a worker thread too (a 4 MB prompt takes seconds to tokenize: on the event loop
it would stall every request, /health included), in a lane of their own (TOKENIZE_THREADS at a time: a
burst of them never holds the threads generation requests are built on), and a long text or id list is
tokenized or decoded with the GIL released (`Tokenizer.encode`). That still costs a core, so a text
prompt surely longer than the context is refused before it is tokenized, and a request whose body is over
LARGE_BODY_BYTES (a prompt to be truncated is tokenized whole, as vLLM's is: 4 MB of text takes 0.5-0.7 GB while it
is) is built or tokenized one at a time, in a lane of its own, so a burst of them cannot run the server out of
memory. Parsing a body stays on the event loop (a 3.5 MB one of 100,000 chat messages takes about half a second). A
request that fails in the engine gets the engine's status (400 if its input was at fault, else 500);
a stream cannot change its status any more, so it sends one error event with that status in the body
(the openai client raises it as an `APIError`) and is cut, without [DONE].

Only `application/json` bodies are read: a web page can make a browser send a cross-origin POST
without asking first only as text/plain, form or multipart, so none of those can run a generation
on a server that trusts its network. For the same reason no origin may read answers cross-site
unless `--allowed-origins` names it (vLLM allows every origin by default; this server none).
`/v1/models` shows the model's path only when asked. With API keys, /v1/*, /invocations, /tokenize, /detokenize
and /tokenizer_info need one; /health, /ping, /load, /metrics, /version and /openapi.json stay open (probes, load
balancers, scrapers).

Every response carries `X-Request-Id` (the client's, when it sends one; else a generation request's
body `request_id`, vLLM's field and rule; else a fresh one): it is also the response's `id`
(`cmpl-<id>`, `chatcmpl-<id>`) and names the request in the log.

A client that goes away (before, during or after sending its request) costs at most one info
line, and none here when `connection.py` has already answered and logged the request (a stalled
upload).

If the engine thread dies, in-flight requests fail at once and `on_engine_dead` is called on the
event loop: `cli.py` then stops the server and exits non-zero, so a supervisor restarts it.

On a graceful shutdown (SIGTERM) the server stops listening and closes idle connections at once (a new request's
connection is refused: a client or balancer retries elsewhere), a request whose body is still arriving gets a 503
with Retry-After, and those in flight get the grace period to finish; a little before it runs out
`abort_in_flight` ends the ones left with a 503 "the server is shutting down" (Retry-After; a stream: its error
event, then the cut), before uvicorn would cancel them.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import gzip
import itertools
import logging
import secrets
import time
from collections.abc import AsyncIterable, AsyncIterator, Awaitable, Callable, Iterable, Iterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar, cast

import anyio
import anyio.to_thread
import jinja2
from fastapi import FastAPI, Request
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse, Response
from fastapi.routing import APIRoute
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.middleware.cors import CORSMiddleware
from starlette.requests import ClientDisconnect
from starlette.routing import Match

from loopserve import __version__
from loopserve.beam_search import BeamSearch, generated_text, run_steps
from loopserve.chat_messages import chat_messages, message_text
from loopserve.engine import grammar
from loopserve.engine.budget import completion_budget, over_context, pool_tokens, sequence_room
from loopserve.engine.config import ENGINE_SCHEDULERS
from loopserve.engine.engine import LLMEngine
from loopserve.engine.engine_thread import (
    EngineDeadError,
    EngineOverloadedError,
    EngineStoppedError,
    EngineThread,
    RequestGroup,
)
from loopserve.engine.sequence import Sequence, TokensPrompt, resolve_exit_rule, truncate_prompt
from loopserve.models.loader import LoadedModel
from loopserve.outputs import CompletionOutput, RequestOutput, request_clock
from loopserve.sampling_params import (
    BeamSearchParams,
    GuidedDecodingParams,
    SamplingParams,
    check_beam_width,
    check_logprobs_asked,
    check_logprobs_count,
    given_seed,
    logprobs_asked,
    truncates_prompt,
)
from loopserve.serve.connection import CLOSED_BY_SERVER
from loopserve.serve.limits import (
    CORS_ANY,
    LOG_STATS_INTERVAL_S,
    MAX_QUEUED_REQUESTS,
    MAX_REQUEST_BODY_BYTES,
    METRIC_PREFIXES,
)
from loopserve.serve.metrics import (
    ServerMetrics,
    StatsLogger,
    accepts_gzip,
    cache_info,
    instrument_http,
    quiet_progress,
)
from loopserve.serve.middleware import (
    BodyLimitMiddleware,
    LoadMiddleware,
    MethodMiddleware,
    RequestIdMiddleware,
    ServerLoad,
    client_named,
    request_id,
    set_request_id,
)
from loopserve.serve.protocol import (
    SHUTDOWN_RETRY_AFTER_S,
    SHUTTING_DOWN,
    ApiError,
    ChatCompletionRequest,
    ChatMessage,
    ChatTool,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeChatRequest,
    TokenizeCompletionRequest,
    body_object,
    chat_form,
    error_body,
    fill_defaults,
    parse_body,
    parse_tokenize,
    sampling_params,
    unknown_fields,
)
from loopserve.serve.reasoning_parsers import REASONING_PARSERS, ReasoningReplies
from loopserve.serve.responses import (
    ChoiceStream,
    GroupStreamingResponse,
    LogprobFormatter,
    StreamFailed,
    sse,
    usage_body,
    with_vllms_nulls,
)
from loopserve.serve.responses_api import (
    ResponseEvents,
    ResponsesRequest,
    ResponsesTurn,
    response_status,
    response_usage,
)
from loopserve.serve.structured import ToolPlan, chat_guide, guide_field, request_guide
from loopserve.serve.tool_parsers import TOOL_PARSERS, AutoTools
from loopserve.tokenizer import template_variables

log = logging.getLogger("loopserve.serve")
COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # OpenAI's and vLLM's default for /v1/completions
METRICS_CATCH_UP_S = 1.0  # how long /metrics and the stats line wait for the step under way (`metrics_caught_up`)
GRAMMAR_BUILDS = 1  # requests with a grammar to compile are built one at a time (`OpenAIServing.build`)
TOKENIZE_THREADS = 2  # /tokenize and /detokenize calls run at once, on their own lane (`OpenAIServing.off_loop`)
# a request whose body is larger than this is built (or tokenized) in the large-body lane, one at a time: tokenizing
# takes some 150 bytes of memory a character while it runs (the library's encoding: offsets, token strings; 4 MB of
# text, 0.5-0.7 GB), so concurrent megabyte prompts multiplied the peak (`OpenAIServing.lane`)
LARGE_BODY_BYTES = 1 << 18
MAX_LISTED_UNKNOWN = 20  # unknown fields named in one warning
MAX_LOGGED_NAME = 64  # characters of an unknown field's name the warning shows
# the routes that run the engine (POST; a replica's drain waits for their answers, serve/ray.py), and the health probes
# (a draining replica answers them 503)
GENERATION_PATHS = ("/v1/completions", "/v1/chat/completions", "/v1/responses", "/invocations")
HEALTH_PATHS = ("/health", "/ping")


def completions_default(req: CompletionRequest) -> int | None:
    """The budget cap of a completions request that sets none: vLLM's field default, 16, where the request leaves
    max_tokens out; none where it sends null (as vLLM's `get_max_tokens` reads it: the room the context leaves)."""
    return None if "max_tokens" in req.model_fields_set else COMPLETIONS_DEFAULT_MAX_TOKENS


@dataclass
class ServerSettings:
    # the names a request's `model` may give (--served-model-name a b); the first is the default, for a request
    # without one, and the name metrics report; a response reports the name its request gave, else the first (vLLM's
    # rules: one card per name in /v1/models, `OpenAIServing._get_model_name`)
    model_names: tuple[str, ...]
    model_path: str = ""
    expose_model_path: bool = False  # /v1/models shows `model_path` as the model's root (else its first name)
    api_keys: tuple[str, ...] = ()  # any one of them is accepted; none: no authentication
    max_queued_requests: int = MAX_QUEUED_REQUESTS  # sequences (samples) waiting beyond max_num_seqs; past it: 503
    max_body_bytes: int = MAX_REQUEST_BODY_BYTES
    # what a request's unset fields take (`protocol.fill_defaults`): the checkpoint's generation_config.json sampling
    # defaults (temperature, top_p, top_k, min_p, repetition_penalty, max_tokens), and min_loops, max_loops, exit_*
    sampling_defaults: dict[str, Any] = field(default_factory=dict)
    # the most tokens any completion gets, whatever its request asks (`GenerationConfig.max_tokens_cap`); None: none
    max_tokens_cap: int | None = None
    # CORS: the origins whose pages may call the API; none: no cross-origin access at all
    allowed_origins: tuple[str, ...] = ()
    allowed_methods: tuple[str, ...] = CORS_ANY
    allowed_headers: tuple[str, ...] = CORS_ANY
    allow_credentials: bool = False
    root_path: str = ""  # the path prefix of a proxy in front of the server
    log_requests: bool = False  # a line per request received and finished
    max_log_len: int | None = None  # prompt characters and token ids shown in such a line; None: all
    stats_interval_s: float | None = LOG_STATS_INTERVAL_S  # the periodic stats line; None: off
    return_tokens_as_token_ids: bool = False  # logprobs' tokens as "token_id:<id>" unless a request says
    # GET /tokenizer_info (vLLM's --enable-tokenizer-info-endpoint, off by default as there: it shows the tokenizer's
    # config and chat template); clients that tokenize through the server read it (lm-eval's remote tokenizer)
    tokenizer_info: bool = False
    openapi: bool = True  # GET /openapi.json, the API's schema (off: vLLM's --disable-fastapi-docs)
    metric_prefix: str = next(iter(METRIC_PREFIXES))  # the metrics' names' prefix (a key of that table)
    # GET /load counts the generation requests in flight (vLLM's --enable-server-load-tracking; off: it says 0, as
    # vLLM's does)
    server_load_tracking: bool = False
    # the parser of the model's own tool calls that answers tool_choice "auto" (a `TOOL_PARSERS` name: vLLM's
    # --enable-auto-tool-choice --tool-call-parser NAME); None: "auto" is a 400
    tool_parser: str | None = None
    # the parser that splits a thinking model's chat replies into reasoning and content (a `REASONING_PARSERS` name:
    # vLLM's --reasoning-parser NAME); None: a reply's text comes back whole
    reasoning_parser: str | None = None
    # the chat template's variables for every chat request, under its own chat_template_kwargs (vLLM's
    # --default-chat-template-kwargs)
    default_template_kwargs: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if isinstance(self.model_names, str) or not self.model_names or not all(self.model_names):
            raise ValueError(f"model_names: expected a tuple of names, got {self.model_names!r}")
        self.model_names = tuple(dict.fromkeys(self.model_names))  # a name given twice is listed once

    @property
    def model_name(self) -> str:
        """The default name: the first."""
        return self.model_names[0]


def load_engine(model: str | Path | None, *, chat_template: str | None = None, generation_config: str = "auto",
                **kwargs: Any) -> tuple[LLMEngine, LoadedModel]:
    """Load a checkpoint and build a batching engine (ValueError on a bad model or bad flags); the loaded checkpoint
    beside it (its folder, its generation config's sampling defaults). `kwargs`: `LoadConfig` fields (the serve
    flags dtype, device, seed, max_model_len, gpu_memory_utilization, ...) and `EngineConfig` fields, checked and
    applied as `LLM` applies them (`load_config.load_for_engine`); `chat_template` and `generation_config` as
    `LLM` takes them."""
    from loopserve.llm import default_model_path
    from loopserve.load_config import configs, load_for_engine

    load, cfg = configs(kwargs)
    if cfg.scheduler == "reference":
        raise ValueError(f"scheduler: 'reference' is the sequential oracle; serve needs {', '.join(ENGINE_SCHEDULERS)}")
    loaded, cfg, max_model_len, memory_knob = load_for_engine(model if model is not None else default_model_path(),
                                                              load, cfg, chat_template=chat_template,
                                                              generation_config=generation_config)
    return LLMEngine(loaded.model, loaded.tokenizer, cfg, load.seed, max_model_len, memory_knob), loaded


def check_sampling_defaults(engine: LLMEngine, defaults: dict[str, Any]) -> None:
    """Raise ValueError if server-wide exit defaults do not suit the model."""
    params = SamplingParams(**{k: v for k, v in defaults.items() if v is not None})
    resolve_exit_rule(params, engine.model, engine.cfg.lookahead)


def serving_defaults(engine: LLMEngine, defaults: dict[str, Any]) -> dict[str, Any]:
    """`defaults` (`ServerSettings.sampling_defaults`) with the exit policy that an exit_threshold default belongs to:
    --exit-policy's, else the model's own (`resolve_exit_rule`: its gate, else latent_diff). A request naming another
    policy gets that policy's own threshold (`fill_defaults`); one naming none runs that policy, as it would anyway."""
    out = {k: v for k, v in defaults.items() if v is not None}
    if out.get("exit_threshold") is not None and out.get("exit_policy") is None:
        out["exit_policy"] = resolve_exit_rule(SamplingParams(), engine.model, engine.cfg.lookahead).policy
    return out


def request_failure(out: RequestOutput, prompt_field: str | None = None,
                    grammar_field: str | None = None) -> ApiError | None:
    """The error a request that ended early answers with, streamed or not (None while it runs, or once it ran to a
    stop or its length): the engine's status for a failed request (a 400 naming the field at fault as the request
    named it, as when its sequence is made: `ApiError.bad_request` with the request's prompt and grammar fields; e.g.
    bad_words, for a grammar that bad_words leave no token), 503 for one the server ended (shutdown, abort)."""
    for c in out.outputs:
        if c.finish_reason == "error":
            status, message = out.error_status or 500, out.error or "the engine failed on this request"
            return ApiError.bad_request(message, prompt_field, grammar_field) if status == 400 else \
                ApiError(status, message)
        if c.finish_reason not in (None, "stop", "length"):
            return ApiError(503, out.error or f"request ended: {c.finish_reason}")
    return None


T = TypeVar("T")


class LeftBeforeItsTurn(Exception):
    """The client of a request waiting in a lane (`OpenAIServing.in_lane`) disconnected before its turn came."""


async def run_in_lane(lane: anyio.CapacityLimiter, client_left: Callable[[], Awaitable[bool]],
                      threads: anyio.CapacityLimiter, fn: Callable[..., T], *args: Any) -> T:
    """`fn(*args)` on a worker thread (`threads`: the limiter it runs under) once `lane` gives it a turn, unless
    `client_left()` says so by then (LeftBeforeItsTurn). The turn is held until the thread ends, even where the waiting
    task is cancelled (Ray Serve cancels a handler whose client left): a thread cannot be stopped, and the lane is
    there to keep such work a few at a time (the task would leave at once and the next large body start beside it)."""
    holder = object()
    await lane.acquire_on_behalf_of(holder)
    try:
        if await client_left():
            raise LeftBeforeItsTurn
        work = asyncio.ensure_future(anyio.to_thread.run_sync(fn, *args, limiter=threads))
    except BaseException:
        lane.release_on_behalf_of(holder)
        raise

    def done(task: asyncio.Future) -> None:
        lane.release_on_behalf_of(holder)
        if not task.cancelled():
            task.exception()  # (read: a cancelled waiter leaves it unread, which asyncio would log)

    work.add_done_callback(done)
    return await asyncio.shield(work)


async def _wait_disconnect(receive: Callable) -> None:
    while True:
        msg = await receive()
        if msg["type"] == "http.disconnect":
            return


def _shut_down(e: EngineStoppedError) -> ApiError:
    """The 503 of a request the server's graceful shutdown refused or ended: retry later (another replica, or this
    server restarted)."""
    return ApiError(503, str(e), headers={"Retry-After": str(SHUTDOWN_RETRY_AFTER_S)})


def _content_logprobs(choice: dict[str, Any]) -> list[dict[str, Any]]:
    """A chat choice's (or delta's) token logprobs, [] where it has none: what a Responses text part carries."""
    return choice["logprobs"]["content"] if choice["logprobs"] is not None else []


def _refuse_beam_grammar(field: str | None) -> None:
    """A 400 naming the grammar field (or `tool_choice`, for a forced tool call) of a `use_beam_search` request."""
    if field is not None:
        raise ApiError(400, f"{field}: structured output cannot be combined with use_beam_search (a beam search "
                            "ranks the model's own top 2 * n tokens)", field)


async def _one_event(body: bytes | memoryview) -> AsyncIterator[str]:
    """A whole response as a stream of one event, then [DONE]: vLLM's server answers a streamed completions beam search
    so (its `fake_stream_generator`), usage included whatever `stream_options` says."""
    yield f"data: {bytes(body).decode()}\n\n"
    yield "data: [DONE]\n\n"


async def _replay(outs: list[RequestOutput]) -> AsyncIterator[tuple[int, RequestOutput]]:
    """Finished outputs as a request group yields them (a beam search's result, streamed)."""
    for i, out in enumerate(outs):
        yield i, out


# -- the serving class ------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class _Kind:
    """What tells a completions response from a chat one."""

    chat: bool
    object: str  # of a whole response
    chunk_object: str  # of a stream chunk
    id_prefix: str  # of a response's id, before the request id


COMPLETION = _Kind(False, "text_completion", "text_completion", "cmpl-")
CHAT = _Kind(True, "chat.completion", "chat.completion.chunk", "chatcmpl-")
# a chat request made of a Responses API one (serve/responses_api.py), answered in that API's shapes
RESPONSES = _Kind(True, "response", "response", "resp_")


@dataclass
class _Generation:
    """One generation request on the shared path: its kind, its body, its id, its sequences, its logprob formatter
    (which knows whether the request wants tokens as ids), and the fields its prompts and its grammar came in (an
    error the engine finds names them as the request did: `failure`)."""

    kind: _Kind
    req: CompletionRequest | ChatCompletionRequest
    cid: str
    seqs: list[Sequence]
    fmt: LogprobFormatter
    prompt_fields: list[str]  # per sequence: "prompt", "prompt.1" (a batch's), "messages"
    grammar_field: str | None  # response_format, guided_json, structured_outputs, tools, ... (None: no grammar)
    top_logprobs: int = 0  # alternatives per token (vLLM's -1 counted: the whole vocabulary)
    # chat: the tool calls the output becomes: forced (serve/structured.py) or parsed ("auto": serve/tool_parsers.py);
    # with --reasoning-parser, the reasoning and content it splits into (serve/reasoning_parsers.py), "auto" within
    tools: ToolPlan | AutoTools | ReasoningReplies | None = None
    echo: bool = False  # completions: the prompt comes first in the text (and the logprobs)
    echo_text: str = ""  # chat: what comes first in every reply (`echo`: the final message's text)
    role: str = "assistant"  # chat: the reply's (the final message's without a generation prompt, as in vLLM)
    generated: bool = True  # false: echo with max_tokens 0 (the prompt alone; the one token run is dropped)
    # use_beam_search: the search (its width is n), whose first step `seqs` are (`OpenAIServing.beam_search`), the
    # params every step's sequences run with (`BeamSearch.step_params`, made once: `beam_generation`), and the
    # request's arrival (its metrics)
    search: BeamSearch | None = None
    step_params: SamplingParams | None = None
    arrival: float = 0.0
    # the response's `created`, once per request: every chunk of a stream carries the same (OpenAI's and vLLM's;
    # clients group chunks by id and created)
    created: int = field(default_factory=lambda: int(time.time()))
    turn: ResponsesTurn | None = None  # RESPONSES: the request as the Responses API gave it

    @property
    def n(self) -> int:
        return self.search.width if self.search is not None else self.seqs[0].params.n

    @property
    def stop(self) -> list[str] | None:
        stop = self.seqs[0].params.stop
        return stop if isinstance(stop, list) else None

    def failure(self, index: int, out: RequestOutput) -> ApiError | None:
        """The error of sequence `index`'s output `out`, if it ended early (`request_failure`)."""
        return request_failure(out, self.prompt_fields[index], self.grammar_field)


class OpenAIServing:
    """The engine behind the HTTP API, with one method per endpoint (`build_app` routes to them)."""

    def __init__(self, engine: LLMEngine, settings: ServerSettings,
                 on_engine_dead: Callable[[], None] | None = None) -> None:
        self.engine, self.settings = engine, settings
        self.tokenizer = engine.tokenizer
        self.max_model_len = engine.max_model_len  # (--max-model-len: the engine's cap, `load_engine`)
        self.sampling_defaults = serving_defaults(engine, settings.sampling_defaults)
        self.kv_tokens = pool_tokens(engine)
        self.created = int(time.time())
        self.aengine = EngineThread(engine, settings.max_queued_requests, on_dead=on_engine_dead,
                                    stopped_message=SHUTTING_DOWN)
        self.metrics = ServerMetrics(settings.model_name, lambda: self.aengine.snapshot, engine.model_config.r_max,
                                     engine.cfg.max_decode_batch, self.max_model_len, settings.metric_prefix,
                                     cache_info(engine))
        self.aengine.on_outputs = self.metrics.observe
        self.aengine.on_scheduled = self.metrics.scheduled
        self._http_requests = itertools.count()  # engine ids stay unique whatever ids clients send
        self.load = ServerLoad()  # (counted by `LoadMiddleware` with server_load_tracking, else left at 0)
        self._lanes: dict[str, anyio.CapacityLimiter] = {}  # by name, made on first use (`lane_of`)
        self._stopping: EngineStoppedError | None = None  # set at the end of a graceful shutdown (`abort_in_flight`)
        self.auto_tools = AutoTools(TOOL_PARSERS[settings.tool_parser]) if settings.tool_parser else None
        self.reasoning = REASONING_PARSERS[settings.reasoning_parser] if settings.reasoning_parser else None

    @asynccontextmanager
    async def lifespan(self, app: FastAPI) -> AsyncIterator[None]:
        self.aengine.start()
        interval = self.settings.stats_interval_s
        stats = (asyncio.ensure_future(StatsLogger(self.metrics, interval, self.metrics_caught_up).run()) if interval
                 else None)
        try:
            yield
        finally:
            if stats is not None:
                stats.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await stats
            await self.aengine.shutdown()

    def abort_in_flight(self) -> None:
        """The end of a graceful shutdown's grace period (`connection.GracefulServer` calls it a little before uvicorn
        cancels the request tasks): refuse new requests and end every one still running in the engine with a 503
        (`collect`, `stream`): a response with Retry-After, a stream's error event and cut. One line in the log."""
        self._stopping = EngineStoppedError(SHUTTING_DOWN)
        # a request still being built ends too: one whose grammar compiles (its vet stopped: the process would wait
        # for it, up to GRAMMAR_COMPILE_LIMIT_S, and the request got uvicorn's 500) and those waiting for their turn
        grammar.stop_vetting(self._stopping)
        n = self.aengine.abort_all(self._stopping)
        if n:
            log.warning("shutdown: aborted %d request(s) still running (503)", n)

    def summary(self) -> str:
        """The start-up line: what is served, and how."""
        e, c = self.engine, self.engine.model_config
        p = next(e.model.parameters())
        gib = e.layout.bytes_per_token(c.num_kv_heads, c.head_dim, p.dtype) * self.kv_tokens / 2**30
        dtype = str(p.dtype).removeprefix("torch.")
        k = e.cfg.num_speculative_tokens
        spec = f"{k} tokens drafted at {e.cfg.speculative_draft_loops} loops" if k else "off"
        names = ", ".join(repr(n) for n in self.settings.model_names)
        return (f"model {self.settings.model_path or self.settings.model_name} served as "
                f"{names}: {c.arch}, dtype {dtype}, device {p.device}, r_max {c.r_max}, "
                f"max_model_len {self.max_model_len}, KV cache {self.kv_tokens} tokens ({gib:.3g} GiB, blocks of "
                f"{e.kv.block_size}), kv_layout {e.cfg.kv_layout}, scheduler {e.cfg.scheduler}, max_num_seqs "
                f"{e.cfg.max_num_seqs}, speculative decoding {spec}")

    # -- request plumbing -------------------------------------------------------------------------------------
    def check_auth(self, request: Request) -> None:
        keys = self.settings.api_keys
        if not keys:
            return
        scheme, _, credentials = request.headers.get("authorization", "").partition(" ")
        # the scheme is case-insensitive (RFC 7235: "bearer k" is "Bearer k"); the key is not
        given = credentials.lstrip(" ").encode()
        # every key is compared, so the time taken does not tell which one (if any) came close
        if scheme.lower() != "bearer" or not sum(secrets.compare_digest(given, k.encode()) for k in keys):
            raise ApiError(401, "invalid or missing API key (send 'Authorization: Bearer <key>')")

    def check_model(self, name: str | None, required: bool = False) -> None:
        """A 404 naming `model` unless it is one of the served names; absent or empty: the first (vLLM's),
        unless `required`."""
        if (name or required) and name not in self.settings.model_names:
            raise ApiError(404, f"The model `{name}` does not exist.", "model")

    @staticmethod
    def check_json(request: Request) -> None:
        """A 415 unless the body is JSON by its Content-Type."""
        content_type = request.headers.get("content-type")
        if content_type is None or not _is_json(content_type):
            raise ApiError(415, f"Content-Type: expected application/json, got {content_type or 'none'}")

    async def read(self, request: Request, parse: Callable[[bytes], Any]) -> Any:
        """The request's body, authenticated, JSON, parsed by `parse`, for this server's model."""
        self.check_auth(request)
        self.check_json(request)
        req = parse(await request.body())
        self.check_model(req.model)
        self.name_request(request, req)
        unknown = unknown_fields(req)
        if unknown:
            more = len(unknown) - MAX_LISTED_UNKNOWN
            # cut short, and as repr writes it where it holds a character that is not printable: a client's key must
            # not write lines (or terminal escapes) into the log
            names = ", ".join(n if n.isprintable() else repr(n) for n in (
                n if len(n) <= MAX_LOGGED_NAME else n[:MAX_LOGGED_NAME] + "..." for n in unknown[:MAX_LISTED_UNKNOWN]))
            log.warning("%s %s: ignored unknown fields: %s%s", request_id(request.scope), request.url.path,
                        names, f" and {more} more" if more > 0 else "")
        return req

    def resolve_max_tokens(self, requested: int | None, default: int | None, prompt_len: int, what: str,
                           field: str = "max_tokens") -> int | None:
        """The completion's token budget: `requested` (in the request's `field`) checked against the context
        and the KV cache, or the room left (capped by `default_max_tokens(default)`); `what` names the prompt's
        field. The rule is `LLM`'s too (engine/budget.py); a server's `max_tokens_cap` then caps it (vLLM's
        `get_max_tokens`: a request is checked as it asks, then capped). Where the endpoint has a default of its own
        (16 for completions), the default the request gets counts as asked for: with no room for it the request is a
        400, as vLLM's field default makes it (its `_validate_input`), not a shorter completion."""
        cap = self.default_max_tokens(default)
        try:
            if requested is None and default is not None and cap is not None \
                    and prompt_len < self.max_model_len < prompt_len + cap:
                raise over_context(field, self.max_model_len, prompt_len, cap)
            budget = completion_budget(prompt_len, requested, max_model_len=self.max_model_len,
                                       kv_tokens=self.kv_tokens, default=cap, prompt_field=what, field=field)
        except ValueError as e:
            raise ApiError.bad_request(e) from None
        return self.capped(budget)

    def capped(self, max_tokens: int | None) -> int | None:
        """A completion's `max_tokens` under the server's `max_tokens_cap` (vLLM's `override_max_tokens`), if any."""
        cap = self.settings.max_tokens_cap
        return max_tokens if cap is None or max_tokens is None or max_tokens < 1 else min(max_tokens, cap)

    def cut_prompt(self, ids: list[int], keep: int | None, max_tokens: int | None) -> list[int]:
        """The prompt a request runs on (`truncate_prompt`: -1 keeps what the context leaves beside `max_tokens` as
        the request asks it, the amount `resolve_max_tokens` checks before a cap applies: cut for a capped amount, the
        prompt would fail that check), or a 400 naming truncate_prompt_tokens."""
        try:
            return truncate_prompt(ids, keep, self.max_model_len, max_tokens)
        except ValueError as e:
            raise ApiError.bad_request(e) from None

    def default_max_tokens(self, default: int | None) -> int | None:
        """The cap on the budget of a request that sets none: the endpoint's `default` (16 for completions, none for
        chat), and the checkpoint's generation_config.json `max_new_tokens` where it gives one (the server's
        `max_tokens` default), whichever is smaller (vLLM's `get_max_tokens`)."""
        caps = [c for c in (default, self.sampling_defaults.get("max_tokens")) if c is not None]
        return min(caps) if caps else None

    def make_seq(self, rid: str, text: str | None, ids: list[int], params: SamplingParams, arrival: float,
                 seed: int | None, what: str, grammar_field: str | None = None,
                 cache_salt: str | None = None) -> Sequence:
        """The request's Sequence, or a 400 naming the field at fault as the request named it (`what`: the prompt's
        field; `grammar_field`: the one that gave its grammar, which is compiled here). `cache_salt`: vLLM's field, part
        of the prompt's prefix-cache keys (cache/prefix.py), for each of the request's samples."""
        prompt = TokensPrompt(prompt_token_ids=ids, prompt=text) if text is not None else TokensPrompt(
            prompt_token_ids=ids)
        if cache_salt is not None:
            prompt["cache_salt"] = cache_salt
        try:
            seq = self.engine.make_sequence(rid, prompt, params, arrival, seed=seed)
        except ValueError as e:
            msg = str(e)
        else:
            why = self.engine.scheduler.never_fits(seq)  # refused before a (streamed) response starts
            if why is None:
                return seq
            msg = why
        raise ApiError.bad_request(msg, what, grammar_field)  # (the rule of a failure found later: `request_failure`)

    def admit(self, seqs: list[Sequence]) -> RequestGroup:
        """Hand `seqs` to the engine as one group; refused, a 503, and the metrics stop tracking them."""
        try:
            return self.aengine.add(seqs)
        except EngineOverloadedError as e:
            self.metrics.reject("overload")
            error = ApiError(503, f"{e}; retry later", headers={"Retry-After": "1"})
        except EngineStoppedError as e:
            self.metrics.reject("shutdown")
            error = _shut_down(e)
        except EngineDeadError as e:
            error = ApiError(503, str(e))
        self.metrics.forget([s.request_id for s in seqs])
        raise error

    async def collect(self, gen: _Generation, group: RequestGroup, request: Request,
                      log_end: bool = True) -> list[RequestOutput] | None:
        """`gen`'s final outputs, or None if the client went away first (then the requests are aborted);
        `log_end`: a line per request that finished or was aborted (--enable-log-requests; not for a beam search's
        steps: the search logs its own)."""
        finals: list[RequestOutput | None] = [None] * len(group.request_ids)

        async def consume() -> None:
            async for i, out in group:
                if out.finished:
                    finals[i] = out

        task = asyncio.ensure_future(consume())
        gone = asyncio.ensure_future(_wait_disconnect(request.receive))
        try:
            await asyncio.wait({task, gone}, return_when=asyncio.FIRST_COMPLETED)
            if not task.done():
                if log_end:  # (a request of several prompts: some may have finished)
                    self.log_finished(self.ended(gen, [o for o in finals if o is not None]))
                    self.log_aborted([rid for rid, o in zip(group.request_ids, finals, strict=True) if o is None])
                return None
            task.result()
        except EngineStoppedError as e:  # the server's shutdown (`abort_in_flight`): retry (another replica, a restart)
            raise _shut_down(e) from None
        except EngineDeadError as e:
            raise ApiError(503, str(e)) from None
        finally:
            gone.cancel()
            task.cancel()
            group.abort()
        done = [o for o in finals if o is not None]
        if log_end:
            self.log_finished(self.ended(gen, done))
        for i, o in enumerate(finals):
            error = gen.failure(i, o) if o is not None else None
            if error is not None:
                raise error
        return done

    def template_kwargs(self, own: dict[str, Any] | None) -> dict[str, Any] | None:
        """A chat request's template variables: its own (`own`) over the server's defaults."""
        return {**self.settings.default_template_kwargs, **(own or {})} or None

    def render_chat(self, messages: list[ChatMessage], add_generation_prompt: bool | None,
                    template_kwargs: dict[str, Any] | None, tools: list[ChatTool] | None = None,
                    continue_final_message: bool | None = False,
                    documents: list[dict[str, Any]] | None = None) -> str:
        """The chat template applied to `messages` (with the request's tools, documents and extra template
        variables); with `continue_final_message`, up to the final message's text (its turn left open)."""
        tool_dicts = [t.model_dump(exclude_none=True) for t in tools] if tools else None
        # check_rendering checked the variables (`template_variables`) and refused documents given twice
        variables = {**template_variables(template_kwargs), **({} if documents is None else {"documents": documents})}
        try:  # the rules LLM.chat applies too (chat_messages.py); unknown fields were reported as ignored already
            plain = chat_messages([m.model_dump() for m in messages])
            return self.tokenizer.apply_chat_template(plain, tool_dicts, tokenize=False,
                                                      add_generation_prompt=add_generation_prompt is not False,
                                                      continue_final_message=bool(continue_final_message),
                                                      **variables)
        except ValueError as e:  # each names its field: messages..., continue_final_message, chat_template
            raise ApiError.bad_request(e) from None
        except jinja2.TemplateError as e:
            raise ApiError(400, f"messages: the chat template rejected them ({e})", "messages") from None

    def log_received(self, gen: _Generation, params: BeamSearchParams | None = None) -> None:
        """A line per sequence of `gen` (--enable-log-requests); `params`: a beam search's (its first step's sequences,
        one per prompt, are logged, with the search's params rather than the step's)."""
        if not self.settings.log_requests:
            return
        n = self.settings.max_log_len
        for s in gen.seqs:
            log.info("Received request %s: prompt: %r, params: %s, prompt_token_ids: %s", s.request_id,
                     (s.prompt or "")[:n] if s.prompt is not None else None, params or s.params, s.prompt_ids[:n])

    def log_finished(self, done: list[tuple[RequestOutput, list[str | None], int]]) -> None:
        """A line per request that ended (--enable-log-requests): (its last output, its samples' finish reasons, the
        completion tokens its response reports). The loops are all its samples', as the tokens are."""
        if not self.settings.log_requests:
            return
        for o, reasons, tokens in done:
            loops = o.metrics.loops_run if o.metrics is not None else 0
            reason = ", ".join(dict.fromkeys(str(r) for r in reasons))  # (one reason where the samples agree)
            log.info("Finished request %s: %s, %d prompt + %d completion tokens, %d loops", o.request_id,
                     reason, len(o.prompt_token_ids), tokens, loops)

    def log_aborted(self, request_ids: list[str]) -> None:
        """A line per request ended before it finished because its client went away (--enable-log-requests; vLLM's
        words)."""
        if self.settings.log_requests:
            for rid in request_ids:
                log.info("Aborted request %s.", rid)

    @staticmethod
    def ended(gen: _Generation, outs: list[RequestOutput]) -> list[tuple[RequestOutput, list[str | None], int]]:
        """`log_finished`'s lines of finished outputs that carried their whole completions (not streamed)."""
        return [(o, [c.finish_reason for c in o.outputs],
                 sum(len(c.token_ids) for c in o.outputs) if gen.generated else 0) for o in outs]

    def base(self, obj: str, gen: _Generation) -> dict[str, Any]:
        # `model`: the served name the request gave, else the first (vLLM's `OpenAIServing._get_model_name`)
        return {"id": gen.cid, "object": obj, "created": gen.created,
                "model": gen.req.model or self.settings.model_name}

    # -- the shared generation path ---------------------------------------------------------------------------
    async def generate(self, request: Request, gen: _Generation) -> Response:
        if gen.search is not None:
            beams = await self.beam_search(request, gen)
            if beams is None:
                return Response(status_code=499)
            if gen.req.streaming and not gen.kind.chat:  # (completions: vLLM's fake stream, the whole response once)
                return GroupStreamingResponse(_one_event((await self.respond_off_loop(gen, beams)).body), None)
            if gen.req.streaming:  # the search is over: its result, streamed (`beam_search`)
                return GroupStreamingResponse(self.stream(gen, _replay(beams)), None)
            return await self.respond_off_loop(gen, beams)
        # before admission: the engine thread may report them at once
        self.metrics.requested(gen.seqs)
        if not gen.generated:
            self.metrics.prompt_only([s.request_id for s in gen.seqs])
        group = self.admit(gen.seqs)
        self.log_received(gen)
        if gen.req.streaming:
            events = self.stream(gen, group) if gen.turn is None else self.response_events(gen, group)
            return GroupStreamingResponse(events, group)
        outs = await self.collect(gen, group, request)
        if outs is None:
            return Response(status_code=499)
        return await self.respond_off_loop(gen, outs)

    async def respond_off_loop(self, gen: _Generation, outs: list[RequestOutput]) -> JSONResponse:
        """`respond`, on a worker thread when the response writes logprobs: 20 echoed prompts of 1,022 tokens with
        20 logprobs each took 1.3 s to format and encode, every stream's chunks waiting on the event loop meanwhile
        (Python threads take turns every few ms, so the loop now keeps serving while it runs)."""
        if any(o.prompt_logprobs is not None or any(c.logprobs is not None for c in o.outputs) for o in outs):
            return await anyio.to_thread.run_sync(self.respond, gen, outs)
        return self.respond(gen, outs)

    def respond(self, gen: _Generation, outs: list[RequestOutput]) -> JSONResponse:
        """The response (not streamed) of `gen`'s final outputs."""
        if gen.turn is not None:
            return JSONResponse(self.response_object(gen, outs[0]))
        choices = [self.choice(gen, i, o, c, ChoiceStream()) for i, o in enumerate(outs) for c in o.outputs]
        sent = sum(len(c.token_ids) for o in outs for c in o.outputs) if gen.generated else 0
        body = {**self.base(gen.kind.object, gen), "choices": choices, "usage": usage_body(outs, sent)}
        if gen.kind.chat and outs[0].prompt_logprobs is not None:  # (asked for, or an echo's: vLLM's chat asks)
            body["prompt_logprobs"] = gen.fmt.prompt_logprobs(outs[0])
        if gen.kind.chat and gen.req.return_token_ids:  # (vLLM's place: a chat response's, a completion choice's)
            body["prompt_token_ids"] = list(outs[0].prompt_token_ids)
        return JSONResponse(with_vllms_nulls(body, gen.kind.chat))

    def choice(self, gen: _Generation, index: int, out: RequestOutput, c: CompletionOutput, d: ChoiceStream,
               stream: bool = False) -> dict[str, Any]:
        """Choice `c` of request `index`, whole (`stream` false) or, in a stream, what is new since its last
        chunk (`c` is then a DELTA output's completion; `d` is what was sent of the choice before). Choices
        are numbered request by request, n per request (OpenAI's order)."""
        finished = c.finish_reason is not None
        first = not d.chunks
        count = len(c.token_ids) if gen.generated else 0
        text = c.text if gen.generated else ""
        echo = out if gen.echo and not d.echoed else None
        d.echoed = d.echoed or gen.echo
        if not gen.kind.chat:
            if echo is not None:  # the prompt first: as given, or the text of its (token ids or truncated) tokens,
                # special tokens kept, as vLLM decodes them (and as `logprobs.tokens` and its offsets count them)
                given = out.prompt if out.prompt is not None and gen.req.truncate_prompt_tokens is None else None
                text = (given if given is not None
                        else self.tokenizer.decode(out.prompt_token_ids, skip_special_tokens=False)) + text
            body: dict[str, Any] = {"text": text}
            logprobs = gen.fmt.completion_logprobs(c, count, gen.top_logprobs, d, echo)
        else:
            if not stream:  # (a stream sends the echoed text in a chunk of its own, first)
                # (an empty tool_calls list, as vLLM's messages carry one: clients read it without a check)
                body = {"message": {"role": gen.role, "content": gen.echo_text + text, "tool_calls": []}}
            else:
                body = {"delta": {"content": text} if text or not finished else {}}
            if gen.tools is not None:  # a forced tool call (the output is its arguments), or "auto"'s parsed one
                body = {"delta": gen.tools.delta(text, finished, d)} if stream else {
                    "message": {**gen.tools.message(c, d), "role": gen.role}}
            logprobs = gen.fmt.chat_logprobs(c, count, gen.top_logprobs)
        choice = {"index": index * gen.n + c.index, **body, "logprobs": logprobs,
                  "finish_reason": (gen.tools.finish_reason(c, d) if gen.tools is not None else c.finish_reason)
                  if finished else None,
                  "stop_reason": c.stop_reason if finished else None,
                  "exit_depths": list(c.exit_depths[:count])}
        if not gen.kind.chat and gen.req.prompt_logprobs is not None and first:
            choice["prompt_logprobs"] = gen.fmt.prompt_logprobs(out)
        if gen.search is not None and finished:  # the beam's own (its score's numerator)
            choice["cumulative_logprob"] = c.cumulative_logprob
        if gen.req.return_token_ids:
            choice["token_ids"] = list(c.token_ids[:count])
            if first and not gen.kind.chat:  # (chat: at the top level, `respond` and `stream`)
                choice["prompt_token_ids"] = list(out.prompt_token_ids)
        d.tokens += count
        d.chunks += 1
        d.finish_reason = c.finish_reason
        return choice

    async def stream(self, gen: _Generation, group: AsyncIterable[tuple[int, RequestOutput]]) -> AsyncIterator[str]:
        """SSE chunks of one choice each, as vLLM sends them (a client reading `choices[0]` misses no sample):
        (chat: the assistant role for every choice, with return_token_ids the prompt's ids at the chunk's top level,
        then the echoed text for every choice), then a chunk for
        every choice an output moved on, usage if asked, [DONE]. The outputs are DELTA ones: a chunk costs
        what is new. With continuous usage a chunk counts its own choice's prompt and tokens so far (vLLM's
        rule); the last chunk counts everything. A request that fails raises `StreamFailed` with the status
        its non-streamed response would have (`collect`): its error event is sent, then the stream is cut."""
        req, obj = gen.req, gen.kind.chunk_object
        sent = {(i, j): ChoiceStream() for i in range(len(gen.seqs)) for j in range(gen.n)}
        latest: dict[int, RequestOutput] = {}
        prompt_logprobs: dict[int, Any] = {}  # a DELTA output carries them in a request's first output only
        chat_prompt_sent = False
        continuous = req.include_usage and req.continuous_usage

        def chunk(choice: dict[str, Any], usage: dict[str, Any] | None) -> dict[str, Any]:
            return {**self.base(obj, gen), "choices": [choice], **({"usage": usage} if req.include_usage else {})}

        with self.stream_ends_logged(gen, sent, latest):
            if gen.kind.chat:  # (vLLM's order: the echoed text in chunks after the role's)
                for delta in [{"role": gen.role, "content": ""},
                              *([{"content": gen.echo_text}] if gen.echo_text else [])]:
                    for j in range(len(gen.seqs) * gen.n):
                        ids = gen.seqs[j // gen.n].prompt_ids
                        p = len(ids)
                        usage = {"prompt_tokens": p, "completion_tokens": 0, "total_tokens": p} if continuous else None
                        body = chunk({"index": j, "delta": delta, "logprobs": None, "finish_reason": None}, usage)
                        if req.return_token_ids and "role" in delta:  # (vLLM's: at the top of every role chunk)
                            body["prompt_token_ids"] = list(ids)
                        yield sse(body)
            async for i, out in group:
                if out.prompt_logprobs is not None:
                    prompt_logprobs[i] = out.prompt_logprobs
                elif i in prompt_logprobs:
                    out = dataclasses.replace(out, prompt_logprobs=prompt_logprobs[i])
                self.stream_output(gen, i, out, latest)
                for c in out.outputs:
                    d = sent[i, c.index]
                    if d.finished or (not gen.generated and d.echoed and c.finish_reason is None):
                        continue  # nothing new for this choice
                    top_prompt = gen.kind.chat and out.prompt_logprobs is not None and not chat_prompt_sent
                    chat_prompt_sent = chat_prompt_sent or top_prompt

                    def encoded(i: int = i, out: RequestOutput = out, c: CompletionOutput = c, d: ChoiceStream = d,
                                top_prompt: bool = top_prompt) -> str:
                        body = chunk(self.choice(gen, i, out, c, d, True),
                                     usage_body([out], d.tokens, c) if continuous else None)
                        if top_prompt:  # chat: at the top level, as in the response
                            body["prompt_logprobs"] = gen.fmt.prompt_logprobs(out)
                        return sse(body)

                    # a chunk with a prompt's worth of logprobs is formatted and encoded on a worker thread, as such a
                    # response is (`respond_off_loop`)
                    heavy = not d.chunks and out.prompt_logprobs is not None
                    yield await anyio.to_thread.run_sync(encoded) if heavy else encoded()
        if req.include_usage:
            total = usage_body(list(latest.values()), sum(d.tokens for d in sent.values()))
            yield sse({**self.base(obj, gen), "choices": [], "usage": total})
        yield "data: [DONE]\n\n"

    @contextlib.contextmanager
    def stream_ends_logged(self, gen: _Generation, sent: dict[tuple[int, int], ChoiceStream],
                           latest: dict[int, RequestOutput]) -> Iterator[None]:
        """Around the part of a stream that reads `gen`'s outputs (`sent`: what it sent of each choice; `latest`: each
        request's latest output, `stream_output`): a dead (or stopped) engine becomes the stream's 503
        (`StreamFailed`), and the requests' ends are logged (--enable-log-requests), whether they finished or the
        client went away mid-stream (those finished by then as finished, the rest as aborted)."""

        def ended(done: Iterable[int]) -> list[tuple[RequestOutput, list[str | None], int]]:
            """`log_finished`'s lines of these requests (their indices), by what their streams sent."""
            return [(latest[i], [sent[i, j].finish_reason for j in range(gen.n)],
                     sum(sent[i, j].tokens for j in range(gen.n))) for i in done]

        try:
            yield
        except EngineDeadError as e:  # (EngineStoppedError too)
            raise StreamFailed(503, str(e)) from None
        except (GeneratorExit, asyncio.CancelledError):  # the client went away mid-stream
            if gen.search is None:  # (a request of several prompts: some may have finished)
                done = [i for i, o in latest.items() if o.finished]
                self.log_finished(ended(done))
                self.log_aborted([s.request_id for i, s in enumerate(gen.seqs) if i not in done])
            raise
        if gen.search is None:  # (a beam search logged its end itself)
            self.log_finished(ended(latest))

    @staticmethod
    def stream_output(gen: _Generation, i: int, out: RequestOutput, latest: dict[int, RequestOutput]) -> None:
        """A stream's output `out` of request `i`: kept as its latest; a failed one ends the stream (`StreamFailed`,
        with the status its response would have had), sending none of its choices."""
        latest[i] = out
        error = gen.failure(i, out)
        if error is not None:
            raise StreamFailed(error.status, error.message, error.param)

    # -- the Responses API ------------------------------------------------------------------------------------
    async def responses(self, request: Request) -> Response:
        """OpenAI's Responses API, run as the chat request it translates to (serve/responses_api.py): built, admitted
        and collected or streamed as a chat request is; its errors name the fields as this request gave them."""
        arrival = request_clock()
        req: ResponsesRequest = await self.read(request, lambda body: parse_body(ResponsesRequest, body))
        turn = ResponsesTurn(req, auto_tools=self.auto_tools is not None)
        with turn.fields():
            gen = await self.build(functools.partial(self.chat, kind=RESPONSES), request, turn.chat, arrival)
            gen.turn, gen.prompt_fields = turn, ["input"]  # (what an error the engine finds later names)
            gen.grammar_field = turn.field_name(gen.grammar_field) if gen.grammar_field is not None else None
            return await self.generate(request, gen)

    def response_head(self, gen: _Generation) -> dict[str, Any]:
        """`ResponsesTurn.response`'s arguments that the request's generation gives."""
        return {"rid": gen.cid, "created": gen.created, "model": gen.req.model or self.settings.model_name,
                "params": gen.seqs[0].params}

    def response_object(self, gen: _Generation, out: RequestOutput) -> dict[str, Any]:
        """The Responses API's response object of a finished request (its one sample: the chat message
        `choice` makes of it)."""
        assert gen.turn is not None
        c = out.outputs[0]
        choice = self.choice(gen, 0, out, c, ChoiceStream())
        status = response_status(c.finish_reason)
        logprobs = _content_logprobs(choice)
        return gen.turn.response(**self.response_head(gen), status=status,
                                 output=gen.turn.output(choice["message"], logprobs, status),
                                 usage=response_usage(usage_body([out], len(c.token_ids)),
                                                      self.reasoning_tokens(gen, list(c.token_ids))))

    async def response_events(self, gen: _Generation, group: RequestGroup) -> AsyncIterator[str]:
        """A streamed Responses API request's events (`ResponseEvents`), made of its chat stream's deltas (`choice`,
        streamed); its failures and ends as a chat stream's (`stream_ends_logged`, `stream_output`)."""
        assert gen.turn is not None
        events = ResponseEvents(gen.turn, self.response_head(gen))
        sent = {(0, 0): ChoiceStream()}
        latest: dict[int, RequestOutput] = {}
        ids: list[int] = []  # the output's, for its reasoning_tokens
        for event in events.start():
            yield event
        with self.stream_ends_logged(gen, sent, latest):
            async for i, out in group:
                self.stream_output(gen, i, out, latest)
                for c in out.outputs:
                    ids += c.token_ids
                    choice = self.choice(gen, i, out, c, sent[0, 0], True)
                    logprobs = _content_logprobs(choice)
                    for event in events.delta(choice["delta"], logprobs):
                        yield event
        usage = usage_body(list(latest.values()), sent[0, 0].tokens)
        for event in events.finish(sent[0, 0].finish_reason, response_usage(usage, self.reasoning_tokens(gen, ids))):
            yield event

    def reasoning_tokens(self, gen: _Generation, ids: list[int]) -> int:
        """The Responses usage's reasoning_tokens of an output's token `ids` (0 without --reasoning-parser)."""
        return gen.tools.reasoning_tokens(ids, self.tokenizer.decode) if isinstance(gen.tools, ReasoningReplies) else 0

    # -- beam search ------------------------------------------------------------------------------------------
    async def beam_search(self, request: Request, gen: _Generation) -> list[RequestOutput] | None:
        """Run `gen`'s beam search (loopserve/beam_search.py's `BeamSearch`, the algorithm `LLM.beam_search` runs,
        driven by `run_steps` as `AsyncLLMEngine.beam_search` drives it): each step's sequences are admitted
        together, as a request's samples are (`admit`: a full server is a 503, at any step), and collected as a
        request's are (`collect`: a client that goes away aborts the step in flight and ends the search, None; a
        step that fails fails the request with its error). The first step's sequences were built with the request
        (`gen.seqs`), the others are built on a worker thread, as a request's are. The result: one finished
        RequestOutput per prompt, its choices the best beams, best first (`beam_outputs`).

        The search is one request per prompt in the metrics (`ServerMetrics.beam_search`, recorded when it ends; its
        steps' sequences are not counted: `beam_steps`) and in the log (--enable-log-requests: one line per prompt
        when its first step is admitted, one when the search is over).

        A stream gets that result once the search is over, as vLLM's server sends it: a chat stream as chunks (the
        role of every choice, then each choice's whole text in one chunk, with its finish_reason, then usage if asked
        and [DONE]), a completions stream as one event holding the whole response (usage included), then [DONE].
        The status line waits for the search, so a search that fails, or is refused at a step's admission, answers
        with its own status, as a response that is not streamed does."""
        search = gen.search
        assert search is not None
        prompts = [len(s.prompt_ids) for s in gen.seqs]
        admitted, ended = False, "abort"  # how a search that ends early is counted

        async def step(beams: list[tuple[int, list[int]]]) -> list[RequestOutput] | None:
            nonlocal admitted
            seqs = gen.seqs if not search.steps else await anyio.to_thread.run_sync(
                self.beam_seqs, gen, beams, request_clock())
            step_gen = dataclasses.replace(gen, seqs=seqs, prompt_fields=[gen.prompt_fields[p] for p, _ in beams])
            # (marked before admission: the engine thread may report them at once)
            self.metrics.beam_steps([s.request_id for s in seqs])
            group = self.admit(seqs)
            if not admitted:
                admitted = True
                self.log_received(gen, search.params)
            return await self.collect(step_gen, group, request, log_end=False)

        try:
            if not await run_steps(search, step):
                self.log_aborted([s.request_id for s in gen.seqs])
                return None
            done = await anyio.to_thread.run_sync(self.beam_outputs, gen)
        except ApiError as e:  # (else, a 503 or cancelled: aborted)
            ended = "abort" if e.status == 503 else "error"
            raise
        else:
            self.metrics.beam_search(gen.arrival, [
                (plen, sum(len(c.token_ids) for c in o.outputs), o.outputs[0].finish_reason or "length",
                 self._first_token_time(o)) for plen, o in zip(prompts, done, strict=True)])
            self.log_finished(self.ended(gen, done))
            admitted = False  # (recorded)
            return done
        finally:
            if admitted:  # ended early, once running: one request per prompt, no tokens returned
                first = search.first
                self.metrics.beam_search(gen.arrival, [
                    (plen, 0, ended, self._first_token_time(first[p]) if first else None)
                    for p, plen in enumerate(prompts)])

    @staticmethod
    def _first_token_time(out: RequestOutput) -> float | None:
        return out.metrics.first_token_time if out.metrics is not None else None

    def beam_seqs(self, gen: _Generation, step: list[tuple[int, list[int]]], arrival: float,
                  texts: list[str | None] | None = None) -> list[Sequence]:
        """The sequences of a beam search step (`BeamSearch.next_prompts`): each beam as a token-id prompt, run for
        one token with the search's step params (`gen.step_params`). `texts`: the prompts' texts (the first step's:
        the log's)."""
        params = gen.step_params
        assert params is not None
        tag = next(self._http_requests)
        return [self.make_seq(f"{gen.cid}-{tag}-{j}", texts[p] if texts else None, ids, params, arrival, params.seed,
                              gen.prompt_fields[p], None, gen.req.cache_salt) for j, (p, ids) in enumerate(step)]

    def beam_generation(self, kind: _Kind, req: CompletionRequest | ChatCompletionRequest, cid: str,
                        params: BeamSearchParams, prompts: list[tuple[str, str | None, list[int]]], arrival: float,
                        **fields: Any) -> _Generation:
        """A `use_beam_search` request's generation, completions' and chat's alike: the search of its `prompts` (each
        its field, its text if given as text, its token ids, as checked and cut) with `params`; the params its steps
        run with, seeded with the request's seed, else the server's (`--seed`: what `LLM.beam_search` uses is the
        LLM's seed; a bad seed is a 400 naming it); and its first step's sequences, one per prompt. A beam ends where
        the context, or the KV pool, is full (`sequence_room`). `fields`: the kind's own (echo; echo_text, role)."""
        search = BeamSearch([ids for _, _, ids in prompts], params, self.tokenizer.eos_token_ids,
                            sequence_room(self.max_model_len, self.kv_tokens))
        try:
            seed = given_seed(req.seed)
            step_params = search.step_params(seed if seed is not None else self.engine.seed)
        except ValueError as e:
            raise ApiError.bad_request(e) from None
        gen = _Generation(kind, req, cid, [], self.formatter(req), [where for where, _, _ in prompts], None,
                          search=search, step_params=step_params, arrival=arrival, **fields)
        gen.seqs = self.beam_seqs(gen, search.next_prompts(), arrival, [text for _, text, _ in prompts])
        return gen

    def beam_outputs(self, gen: _Generation) -> list[RequestOutput]:
        """Per prompt, the search's result as a finished output (`BeamSearch.request_outputs`): its best beams as its
        choices (their text by the server's rule, `generated_text`; their logprobs where the request asked for
        them), its prompt, and its usage: the prompt counted once (its cached tokens the first step's), the loops
        every step of its beams ran."""
        assert gen.search is not None
        req = gen.req
        rule = generated_text(self.tokenizer, gen.search.params.include_stop_str_in_output,
                              req.skip_special_tokens is not False)
        # (chat's logprobs is a flag; completions' a count, 0 asking for the token's own.) A token's entry holds the
        # step's sampled token and its top 2 * n (`BeamSearch.step_params`): asked for more alternatives, a choice
        # gets those it holds, as vLLM's server does (its search asks for 2 * n too, and its formatters take at
        # most what an entry holds)
        asked = bool(req.logprobs) if gen.kind.chat else req.logprobs is not None
        return gen.search.request_outputs(rule, logprobs=asked)

    def beam_params(self, req: CompletionRequest | ChatCompletionRequest, max_tokens: int | None) -> BeamSearchParams:
        """A `use_beam_search` request's BeamSearchParams (vLLM's `to_beam_search_params`): width n, `max_tokens`,
        temperature (unset: the server's default, as for sampling: `fill_defaults`; else 1), ignore_eos,
        length_penalty, include_stop_str_in_output; a 400 naming the field at fault. (`build` refused the fields a
        beam search cannot honour.)"""
        temperature = fill_defaults(req, self.sampling_defaults).get("temperature", 1.0)
        width = 1 if req.n is None else req.n
        try:
            check_beam_width(width, self.engine.cfg.max_logprobs, self.engine.model_config.vocab_size, field="n",
                             search="use_beam_search", knob="the server's --max-logprobs")
            # (max_tokens None, never given here, would be named by BeamSearchParams' own check)
            return BeamSearchParams(beam_width=width, max_tokens=cast(int, max_tokens),
                                    ignore_eos=bool(req.ignore_eos), temperature=temperature,
                                    length_penalty=1.0 if req.length_penalty is None else req.length_penalty,
                                    include_stop_str_in_output=bool(req.include_stop_str_in_output))
        except ValueError as e:
            raise ApiError.bad_request(e) from None

    def formatter(self, req: CompletionRequest | ChatCompletionRequest) -> LogprobFormatter:
        """The request's logprob formatter: tokens as "token_id:<id>" if the request asks (vLLM's
        return_tokens_as_token_ids), else as the server's --return-tokens-as-token-ids says."""
        as_ids = req.return_tokens_as_token_ids
        return LogprobFormatter(self.tokenizer, self.settings.return_tokens_as_token_ids if as_ids is None else as_ids)

    def new_ids(self, request: Request, kind: _Kind, n: int) -> tuple[str, list[str]]:
        """The response id (from the request id) and the engine ids of its `n` sequences."""
        rid = request_id(request.scope)
        # (a Responses body's request_id may carry the prefix already, as vLLM's own ids do: it is taken as it is)
        cid = rid if kind is RESPONSES and rid.startswith(kind.id_prefix) else f"{kind.id_prefix}{rid}"
        tag = next(self._http_requests)
        return cid, [f"{cid}-{tag}-{i}" for i in range(n)]

    # -- endpoints ----------------------------------------------------------------------------------------------
    async def health(self) -> Response:
        if not self.aengine.alive:
            return JSONResponse(error_body(503, "the engine is not running"), status_code=503)
        return Response(status_code=200)

    async def prometheus(self, request: Request) -> Response:
        """The metrics in the format the scraper asks for (Prometheus text, or OpenMetrics by its Accept header),
        gzipped if it accepts that, as prometheus_client's own app (vLLM's /metrics) answers."""
        await self.metrics_caught_up()
        body, content_type = self.metrics.render_for(request.headers.get("accept"))
        if accepts_gzip(request.headers.get("accept-encoding", "")):
            return Response(gzip.compress(body), media_type=content_type, headers={"Content-Encoding": "gzip"})
        return Response(body, media_type=content_type)

    async def metrics_caught_up(self) -> None:
        """Bring the token counters up to the engine (`ServerMetrics.catch_up`): a request that is not streamed has
        one output, when it finishes, so its tokens would otherwise count only then. Asks the engine thread between
        two steps, waiting for the one under way up to METRICS_CATCH_UP_S (else the counters stay as they are)."""
        if not (self.aengine.alive and self.engine.requests and self.aengine.serves_this_loop()):
            return
        try:
            progress = await asyncio.wait_for(self.aengine.between_steps(quiet_progress), METRICS_CATCH_UP_S)
        except (TimeoutError, EngineDeadError, EngineStoppedError):
            return
        self.metrics.catch_up(progress)

    async def version(self) -> JSONResponse:
        return JSONResponse({"version": __version__})

    async def server_load(self) -> JSONResponse:
        """vLLM's GET /load: the generation requests in flight (0 unless server_load_tracking)."""
        return JSONResponse({"server_load": self.load.requests})

    async def models(self, request: Request) -> JSONResponse:
        self.check_auth(request)
        return JSONResponse({"object": "list", "data": [self.model_card(n) for n in self.settings.model_names]})

    async def model(self, request: Request, model: str) -> JSONResponse:
        """OpenAI's retrieve (`client.models.retrieve(id)`): the card of that served name, else a 404 naming
        `model`."""
        self.check_auth(request)
        self.check_model(model, required=True)  # (GET /v1/models/ names no model)
        return JSONResponse(self.model_card(model))

    def model_card(self, name: str) -> dict[str, Any]:
        """The card of one served name; every name's card has the same `root`: one model behind them all
        (vLLM's: its path; here the path only with --expose-model-path, else the first name)."""
        s = self.settings
        root = s.model_path if s.expose_model_path else s.model_name
        # (vLLM's permission entry, the same for every model: clients that list the cards read it)
        permission = {"id": f"modelperm-{name}", "object": "model_permission", "created": self.created,
                      "allow_create_engine": False, "allow_sampling": True, "allow_logprobs": True,
                      "allow_search_indices": False, "allow_view": True, "allow_fine_tuning": False,
                      "organization": "*", "group": None, "is_blocking": False}
        return {"id": name, "object": "model", "created": self.created, "owned_by": "loopserve",
                "root": root, "parent": None, "max_model_len": self.max_model_len, "permission": [permission],
                "r_max": self.engine.model_config.r_max}

    async def tokenize(self, request: Request) -> JSONResponse:
        req: TokenizeCompletionRequest | TokenizeChatRequest = await self.read(request, parse_tokenize)
        return await self.off_loop(request, self.tokenized, req)

    async def off_loop(self, request: Request, call: Callable[[Any], JSONResponse], req: Any) -> JSONResponse:
        """`call(req)` (/tokenize's or /detokenize's, the answer's JSON written too) on a worker thread (see the
        module's docstring), in the tokenize lane: TOKENIZE_THREADS at a time, so a burst of multi-MB calls (seconds
        each) never holds the shared pool's threads, which generation requests are built on (`build`); the others
        wait for the lane."""
        return await self.in_lane(request, self.lane_of("tokenize", TOKENIZE_THREADS), call, req)

    async def in_lane(self, request: Request, usual: anyio.CapacityLimiter | None, fn: Callable[..., Any],
                      *args: Any) -> Any:
        """`fn(*args)` on a worker thread, its turn taken in the request's lane (`lane`: `usual` unless its body is
        large; None: anyio's shared pool). A request whose client has gone by its turn in a lane is not run
        (LeftBeforeItsTurn), as vLLM cancels a handler whose client disconnected: each abandoned 3 MB prompt took its
        full turn in the large-body lane, one at a time, and a live request behind five of them waited 13.7 s instead
        of 2.7 (a probe with raw sockets closed after sending)."""
        lane = await self.lane(request, usual)
        if lane is None:
            return await anyio.to_thread.run_sync(fn, *args)
        return await run_in_lane(lane, request.is_disconnected, self.lane_of("lane threads", 1 << 20), fn, *args)

    def lane_of(self, name: str, threads: int) -> anyio.CapacityLimiter:
        """The lane `name`, `threads` at a time, made on first use (on the event loop, where anyio makes it)."""
        lane = self._lanes.get(name)
        if lane is None:
            lane = self._lanes[name] = anyio.CapacityLimiter(threads)
        return lane

    async def lane(self, request: Request, usual: anyio.CapacityLimiter | None) -> anyio.CapacityLimiter | None:
        """The lane a request's worker-thread work waits for: the large-body lane, one at a time, for a body over
        LARGE_BODY_BYTES (a prompt it holds may take a gigabyte to tokenize: 45 concurrent 4 MB prompts to be
        truncated, whose length is not checked before they are tokenized, took a server to 23 GB and the kernel killed
        it), else `usual` (None: anyio's shared pool)."""
        if len(await request.body()) <= LARGE_BODY_BYTES:  # (read already: starlette keeps it)
            return usual
        return self.lane_of("large body", 1)

    def tokenized(self, req: TokenizeCompletionRequest | TokenizeChatRequest) -> JSONResponse:
        if isinstance(req, TokenizeChatRequest):
            text = self.render_chat(req.messages, req.add_generation_prompt,
                                    self.template_kwargs(req.chat_template_kwargs), req.tools,
                                    req.continue_final_message, req.documents)
        else:
            text = req.prompt
        ids = self.tokenizer.encode(text, add_special_tokens=bool(req.add_special_tokens))
        strs = [self.tokenizer.id_to_token(t) or "" for t in ids] if req.return_token_strs else None
        return JSONResponse({"count": len(ids), "max_model_len": self.max_model_len, "tokens": ids,
                             "token_strs": strs})

    async def tokenizer_info(self, request: Request) -> JSONResponse:
        self.check_auth(request)
        return JSONResponse(self.tokenizer.info())

    async def detokenize(self, request: Request) -> JSONResponse:
        req: DetokenizeRequest = await self.read(request, lambda body: parse_body(DetokenizeRequest, body))
        return await self.off_loop(request, self.detokenized, req)  # (as /tokenize)

    def detokenized(self, req: DetokenizeRequest) -> JSONResponse:
        vocab = self.tokenizer.vocab_size
        for i, t in enumerate(req.tokens):
            if not 0 <= t < vocab:
                raise ApiError(400, f"tokens.{i}: token id {t} is outside the vocabulary [0, {vocab})", f"tokens.{i}")
        return JSONResponse({"prompt": self.tokenizer.decode(req.tokens, skip_special_tokens=False)})

    async def completions(self, request: Request) -> Response:
        arrival = request_clock()
        req: CompletionRequest = await self.read(request, lambda body: parse_body(CompletionRequest, body))
        return await self.generate(request, await self.build(self.completion, request, req, arrival))

    @staticmethod
    def name_request(request: Request, req: Any) -> None:
        """vLLM's rule for the request's id: the X-Request-Id header's, else a generation body's `request_id`, else
        a fresh one (the middleware's). It names the response (`new_ids`), the log lines and the X-Request-Id
        header."""
        rid = getattr(req, "request_id", None)
        if rid is not None and not client_named(request.scope):
            set_request_id(request.scope, rid)

    async def build(self, make: Callable[[Request, Any, float], _Generation], request: Request, req: Any,
                    arrival: float) -> _Generation:
        """`make(request, req, arrival)` on a worker thread (see the module's docstring). One whose grammar (of a
        grammar field, or of its tools) is not compiled yet is built in the grammar lane, GRAMMAR_BUILDS at a time, so
        a burst of slow grammars (1-3 s each; up to GRAMMAR_COMPILE_LIMIT_S) holds neither the shared pool's threads
        nor more than one core (a trial on a shared machine saw fifty of them delay a plain one-token request 68 s;
        not reproduced here). It is built first outside the lane with compiled grammars only
        (`grammar.building`), and goes to the lane when it meets one that is not: a request whose grammars are
        compiled, or known to fail, or that has tools and no grammar, waited behind every new grammar (three that
        never compile held a cached one 61 s). A beam search's fields are checked first (`check_beam_search`: its
        depth fields against this model's full depth), as a body's own checks are. At the end of a graceful
        shutdown a request still to be built is a 503 (`abort_in_flight`)."""
        if req.use_beam_search:
            req.check_beam_search(self.engine.model_config.r_max)
        may_compile = guide_field(req) is not None or bool(getattr(req, "tools", None))
        try:
            try:
                return await self.in_lane(request, None, self._build_now, make, may_compile, request, req, arrival)
            except grammar.GrammarNotCompiled:
                return await self.in_lane(request, self.lane_of("grammar", GRAMMAR_BUILDS), self._build_now, make,
                                          False, request, req, arrival)
        except EngineStoppedError as e:
            raise _shut_down(e) from None

    def _build_now(self, make: Callable[[Request, Any, float], _Generation], compiled_only: bool, request: Request,
                   req: Any, arrival: float) -> _Generation:
        """`make(request, req, arrival)`, on a worker thread, with compiled grammars only if `compiled_only` (`build`);
        EngineStoppedError once the server is shutting down, before it or at a step of a grammar's compile."""
        self._check_stopping()
        with grammar.building(compiled_only, self._check_stopping):
            return make(request, req, arrival)

    def _check_stopping(self) -> None:
        if self._stopping is not None:
            raise self._stopping

    def completion(self, request: Request, req: CompletionRequest, arrival: float) -> _Generation:
        """A completions request's sequences (built on a worker thread: see the module's docstring)."""
        # a text that will be cut skips the length check that spares tokenizing it; one with a value that is refused
        # later does not
        prompts = self.completion_prompts(req.prompt, truncates_prompt(req.truncate_prompt_tokens),
                                          req.add_special_tokens is not False)
        self.check_capacity(len(prompts), req.n)
        cid, rids = self.new_ids(request, COMPLETION, len(prompts))
        if req.use_beam_search:
            return self.beam_completion(req, arrival, prompts, cid)
        guide, grammar_field = request_guide(req), guide_field(req)
        echo = bool(req.echo)
        # echo with max_tokens 0 (lm-eval's loglikelihood): score the prompt, send no completion (one token runs)
        generated = not (echo and req.max_tokens == 0)
        seqs = []
        default = completions_default(req)
        for rid, (where, text, whole) in zip(rids, prompts, strict=True):
            requested = req.max_tokens if generated else 1
            # before the context check (the engine cuts again, by the same rule: no change)
            ids = self.cut_prompt(whole, req.truncate_prompt_tokens,
                                  self.default_max_tokens(default) if requested is None else requested)
            mt = self.resolve_max_tokens(requested, default, len(ids), where)
            params = sampling_params(req, max_tokens=mt, logprobs=req.logprobs,
                                     defaults=self.sampling_defaults,
                                     prompt_logprobs=req.logprobs if echo and req.prompt_logprobs is None else None,
                                     guided_decoding=guide)
            seqs.append(self.make_seq(rid, text, ids, params, arrival, params.seed, where, grammar_field,
                                      req.cache_salt))
        top = logprobs_asked(req.logprobs or 0, self.engine.model_config.vocab_size)
        return _Generation(COMPLETION, req, cid, seqs, self.formatter(req), [where for where, _, _ in prompts],
                           grammar_field, top, echo=echo, generated=generated)

    def check_capacity(self, prompts: int, n: int | None) -> None:
        """A 400 for a request of `prompts` prompts whose sequences, n of each (its samples, or a beam search's beams:
        n wide from its second step), this server never holds at once, however idle (its admission bound,
        engine_thread.py, would refuse it with a 503 saying to retry, at its first step or a later one); naming
        `prompt` where the prompts alone are too many, else `n`. One rule for completions and chat, checked before
        anything runs."""
        n = n if isinstance(n, int) and n >= 1 else 1  # (a bad n is SamplingParams' or protocol.py's to name)
        capacity = self.aengine.capacity
        if capacity is not None and prompts * n > capacity:
            field = "prompt" if prompts > capacity else "n"
            raise ApiError(400, f"{field}: {prompts} prompt{'s' if prompts > 1 else ''} x n = {n} are {prompts * n} "
                                f"sequences; this server holds at most {capacity} at once (--max-num-seqs + "
                                f"--max-queued-requests): send fewer per request", field)

    def beam_completion(self, req: CompletionRequest, arrival: float, prompts: list[tuple[str, str | None, list[int]]],
                        cid: str) -> _Generation:
        """A `use_beam_search` completions request: its search (every prompt's, together) and the first step's
        sequences. `max_tokens` (unset: 16, or the checkpoint's max_new_tokens if smaller) is checked against each
        prompt's context as a normal request's is; the room a prompt leaves is the search's end for its beams
        (`BeamSearch`'s `room`), as it is a normal request's."""
        _refuse_beam_grammar(guide_field(req))
        vocab = self.engine.model_config.vocab_size
        try:  # (a sampled request's checks: SamplingParams', then the engine's)
            check_logprobs_count("logprobs", req.logprobs)
            check_logprobs_asked("logprobs", req.logprobs, self.engine.cfg.max_logprobs, vocab,
                                 "the server's --max-logprobs")
        except ValueError as e:
            raise ApiError.bad_request(e) from None
        if req.logprobs is not None and req.echo:  # (vLLM's server fails an assertion on it: a 500)
            raise ApiError(400, "logprobs: cannot be combined with echo under use_beam_search (the echoed prompt's "
                                "logprobs are prompt logprobs, which a beam search does not compute)", "logprobs")
        default = completions_default(req)
        asked = self.default_max_tokens(default) if req.max_tokens is None else req.max_tokens
        starts, budgets = [], []
        for where, text, whole in prompts:
            ids = self.cut_prompt(whole, req.truncate_prompt_tokens, asked)  # (as the check below reads it)
            budgets.append(self.resolve_max_tokens(req.max_tokens, default, len(ids), where))
            starts.append((where, text, ids))
        # one search for every prompt: with max_tokens null, as far as the prompt with the most room may go (each
        # prompt's beams end where its own context is full, `BeamSearch`'s room: vLLM sizes each prompt's own)
        params = self.beam_params(req, self.capped(asked) if asked is not None else max(cast(list[int], budgets)))
        return self.beam_generation(COMPLETION, req, cid, params, starts, arrival, echo=bool(req.echo),
                                    top_logprobs=logprobs_asked(req.logprobs or 0, vocab))

    def completion_prompts(self, prompt: Any, truncated: bool,
                           add_special_tokens: bool = True) -> list[tuple[str, str | None, list[int]]]:
        """Each prompt of a completions request as (its field: "prompt", or "prompt.i" in a batch; its text,
        if it was given as text, tokenized with the special tokens unless `add_special_tokens` is false, as in
        vLLM; its token ids)."""
        items: list[Any] = [prompt] if isinstance(prompt, str) or (prompt and isinstance(prompt[0], int)) else prompt
        if not items:
            raise ApiError(400, "prompt: must not be empty", "prompt")
        out: list[tuple[str, str | None, list[int]]] = []
        for i, p in enumerate(items):
            where = "prompt" if items is not prompt else f"prompt.{i}"  # one prompt, or one of a batch
            if not p:
                raise ApiError(400, f"{where}: must not be empty", where)
            out.append((where, p, self.encode(p, where, truncated, add_special_tokens)) if isinstance(p, str)
                       else (where, None, list(p)))
        return out

    def encode(self, text: str, what: str, truncated: bool, add_special_tokens: bool = True) -> list[int]:
        """A prompt's token ids; a text that is surely longer than the context (unless it is to be truncated)
        is refused before it is tokenized (see `Tokenizer.fewest_tokens`)."""
        fewest = 0 if truncated else self.tokenizer.fewest_tokens(text)
        if fewest >= self.max_model_len:
            raise ApiError(400, f"{what}: at least {fewest} tokens ({len(text)} characters); this model's maximum "
                                f"context length is {self.max_model_len} tokens", what)
        return self.tokenizer.encode(text, add_special_tokens=add_special_tokens)

    async def chat_completions(self, request: Request) -> Response:
        arrival = request_clock()
        req: ChatCompletionRequest = await self.read(request, lambda body: parse_body(ChatCompletionRequest, body))
        return await self.generate(request, await self.build(self.chat, request, req, arrival))

    async def invocations(self, request: Request) -> Response:
        """SageMaker's inference endpoint (vLLM's): a chat completion request (it has `messages`) answered as
        /v1/chat/completions would, a completion request (`prompt`) as /v1/completions would. A body that is not
        JSON, or not an object, gets the errors /v1/completions gives it."""
        self.check_auth(request)  # (before the body is looked at: a client without a key gets nothing parsed)
        self.check_json(request)
        body = body_object(await request.body())
        if chat_form(body):
            return await self.chat_completions(request)
        if body is not None and "prompt" not in body:
            raise ApiError(400, "body: expected a chat completion request (with messages) or a completion request "
                                "(with prompt)")
        return await self.completions(request)

    def chat(self, request: Request, req: ChatCompletionRequest, arrival: float, kind: _Kind = CHAT) -> _Generation:
        """A chat request's sequence (built on a worker thread: see the module's docstring); `kind`: RESPONSES for
        one a Responses API request made."""
        self.check_capacity(1, req.n)
        guide, tools = chat_guide(req, self.auto_tools)
        if isinstance(tools, AutoTools):  # the parser reads the tags, which some tokenizers mark special (vLLM's rule)
            req.skip_special_tokens = False
        if req.use_beam_search and guide is not None:
            _refuse_beam_grammar("tool_choice" if isinstance(tools, ToolPlan) else guide_field(req))
        if req.use_beam_search and tools is not None:  # (a beam's text is not read for calls)
            raise ApiError(400, "tool_choice: 'auto' cannot be combined with use_beam_search (the beams' text is not "
                                "read for tool calls)", "tool_choice")
        # vLLM's roles: the reply is the assistant's where the prompt opens an assistant message, else it goes on
        # with the final message, in its role; `echo` starts it with the final message's text when that message is
        # in the reply's role (so always, without a generation prompt)
        last = req.messages[-1]
        role = "assistant" if req.add_generation_prompt is not False else last.role
        echo_text = message_text(last.model_dump()["content"]) if req.echo and last.role == role else ""
        if req.echo and tools is not None:  # the reply is calls, or read for them: nothing may come before it
            raise ApiError(400, "echo: cannot be combined with tool calls (tool_choice)", "echo")
        replies = self.reasoning_replies(req, guide, tools)
        text = self.render_chat(req.messages, req.add_generation_prompt, self.template_kwargs(req.template_kwargs()),
                                req.tools, req.continue_final_message, req.documents)
        # the template writes the special tokens it wants: none added unless asked (vLLM's default)
        ids = self.encode(text, "messages", truncates_prompt(req.truncate_prompt_tokens),
                          add_special_tokens=bool(req.add_special_tokens))
        if not ids:
            raise ApiError(400, "messages: the chat template produced an empty prompt", "messages")
        requested = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        ids = self.cut_prompt(ids, req.truncate_prompt_tokens, self.default_max_tokens(None) if requested is None
                              else requested)
        name = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
        if requested is not None and requested < 1:  # named as the request named it (SamplingParams says max_tokens)
            raise ApiError(400, f"{name}: must be an integer >= 1, got {requested}", name)
        mt = self.resolve_max_tokens(requested, None, len(ids), "messages", name)
        vocab = self.engine.model_config.vocab_size
        top = logprobs_asked(req.top_logprobs or 0, vocab)
        if req.logprobs:  # (the engine would name its own field, logprobs: a chat request's is this)
            try:
                check_logprobs_asked("top_logprobs", req.top_logprobs, self.engine.cfg.max_logprobs, vocab,
                                     "the server's --max-logprobs")
            except ValueError as e:
                raise ApiError(400, str(e), "top_logprobs") from None
        if req.use_beam_search:  # (the room left when max_tokens is unset, as for sampling)
            cid, _ = self.new_ids(request, kind, 1)
            return self.beam_generation(kind, req, cid, self.beam_params(req, mt), [("messages", text, ids)], arrival,
                                        echo_text=echo_text, role=role, top_logprobs=top, tools=replies)
        # echo: the prompt's logprobs too, top_logprobs of them (vLLM's field default: 0), as vLLM's chat route asks
        # for them; not for a stream, whose chunks vLLM's do not carry them in
        top_asked = req.top_logprobs if "top_logprobs" in req.model_fields_set else 0
        echo_logprobs = top_asked if req.echo and req.prompt_logprobs is None and not req.stream else None
        params = sampling_params(req, max_tokens=mt, logprobs=top if req.logprobs else None,
                                 defaults=self.sampling_defaults, prompt_logprobs=echo_logprobs, guided_decoding=guide)
        cid, (rid,) = self.new_ids(request, kind, 1)
        grammar_field = "tools" if isinstance(tools, ToolPlan) else guide_field(req)
        seq = self.make_seq(rid, text, ids, params, arrival, params.seed, "messages", grammar_field, req.cache_salt)
        return _Generation(kind, req, cid, [seq], self.formatter(req), ["messages"], grammar_field, top,
                           replies or tools, echo_text=echo_text, role=role)

    def reasoning_replies(self, req: ChatCompletionRequest, guide: GuidedDecodingParams | None,
                          tools: ToolPlan | AutoTools | None) -> ReasoningReplies | None:
        """With --reasoning-parser, how a chat request's replies are split into reasoning and content (`tools`:
        "auto"'s reader, fed the content). A grammar is refused beside it: vLLM holds a grammar back until the
        reasoning ends, which the engine's guides cannot (they mask from the first token), and a grammar over the
        whole output would leave the model no room to think. `echo` is refused: the echoed text would be read as
        the reply's first reasoning."""
        if self.reasoning is None:
            return None
        if guide is not None:
            field = "tool_choice" if isinstance(tools, ToolPlan) else guide_field(req)
            raise ApiError(400, f"{field}: a grammar (structured output, or a forced tool call) cannot be combined "
                                "with the server's --reasoning-parser (vLLM applies it once the reasoning ends; this "
                                "server cannot hold it back)", field)
        if req.echo:
            raise ApiError(400, "echo: cannot be combined with the server's --reasoning-parser", "echo")
        assert not isinstance(tools, ToolPlan)  # (a forced call has a grammar)
        return ReasoningReplies(self.reasoning, self.template_kwargs(req.template_kwargs()),
                                req.include_reasoning is not False, tools)


# -- the app -----------------------------------------------------------------------------------------------------
def _json_body(*models: type) -> dict[str, Any]:
    """OpenAPI `requestBody` of an endpoint that reads the raw body: one of `models`' schemas, by reference."""
    refs = [{"$ref": f"#/components/schemas/{m.__name__}"} for m in models]
    return {"requestBody": {"required": True, "content": {"application/json": {
        "schema": refs[0] if len(refs) == 1 else {"anyOf": refs}}}}}


BODIES = (CompletionRequest, ChatCompletionRequest, ResponsesRequest, TokenizeCompletionRequest, TokenizeChatRequest,
          DetokenizeRequest)


def _is_json(content_type: str) -> bool:
    """application/json, or a type with the +json suffix (application/vnd.api+json): JSON, as FastAPI reads it. Either
    needs a CORS preflight from a browser (docs/design.md §11)."""
    kind = content_type.split(";", 1)[0].strip().lower()
    return kind == "application/json" or len(kind) > len("application/+json") and kind.startswith("application/") \
        and kind.endswith("+json")


# What /openapi.json says each route answers (FastAPI documents a 200 of JSON and, for a route with parameters, a 422
# the server never sends: its errors are 400s): an error's OpenAI-style body, the statuses each kind of route may
# answer with one, streams and the non-JSON answers
ERROR_SCHEMA = {"type": "object", "required": ["error"], "properties": {"error": {
    "type": "object", "required": ["message", "type", "code"],
    "properties": {"message": {"type": "string"}, "type": {"type": "string"},
                   "param": {"anyOf": [{"type": "string"}, {"type": "null"}]}, "code": {"type": "integer"}}}}}
ERROR_STATUSES = {"POST": (400, 401, 404, 408, 413, 415, 500, 503), "GET": (401, 404, 500, 503)}
OK_CONTENT: dict[str, dict[str, Any]] = {
    **{path: {"application/json": {"schema": {}}, "text/event-stream": {}} for path in GENERATION_PATHS},
    **{path: {} for path in HEALTH_PATHS},  # (an empty body)
    "/metrics": {"text/plain": {}},
}


def documented_responses(path: str, method: str, responses: dict[str, Any]) -> dict[str, Any]:
    """The responses /openapi.json lists for one operation: FastAPI's 200 (its content as OK_CONTENT says, where it
    says), then an OpenAI-style error body for each status in ERROR_STATUSES; no 422."""
    ok = dict(responses.get("200", {"description": "Successful Response"}))
    if path in OK_CONTENT:
        ok["content"] = OK_CONTENT[path]
    error = {"content": {"application/json": {"schema": {"$ref": "#/components/schemas/ErrorResponse"}}}}
    return {"200": ok, **{str(s): {"description": ApiError.TYPES[s], **error} for s in ERROR_STATUSES[method.upper()]}}


def build_app(engine: LLMEngine, settings: ServerSettings,
              on_engine_dead: Callable[[], None] | None = None) -> FastAPI:
    serving = OpenAIServing(engine, settings, on_engine_dead)
    app = FastAPI(title="loopserve", version=__version__, lifespan=serving.lifespan, docs_url=None,
                  redoc_url=None, openapi_url="/openapi.json" if settings.openapi else None)
    # vLLM's --root-path: FastAPI puts it in every request's scope, so routes match with the prefix
    # (a proxy that keeps it) or without (one that strips it), and /openapi.json names it as the server.
    # Set on the app rather than passed to FastAPI(), which deprecates that in favour of uvicorn's
    # root_path, which would match only paths without the prefix.
    app.root_path = settings.root_path

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            schema = get_openapi(title=app.title, version=app.version, routes=app.routes, servers=app.servers)
            components = schema.setdefault("components", {}).setdefault("schemas", {})
            for model in BODIES:
                body = model.model_json_schema(ref_template="#/components/schemas/{model}")
                components.update(body.pop("$defs", {}))
                components[model.__name__] = body
            components["ErrorResponse"] = ERROR_SCHEMA
            for path, operations in schema["paths"].items():
                for method, operation in operations.items():
                    operation["responses"] = documented_responses(path.removeprefix(settings.root_path), method,
                                                                  operation.get("responses", {}))
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]
    app.state.serving = serving
    app.state.engine = serving.aengine
    app.state.metrics = serving.metrics
    app.state.settings = settings
    # the last added runs first: the HTTP metrics see every answer, then CORS answers preflights before anything
    # else looks at a request
    if settings.server_load_tracking:  # (the route a request matches: with --root-path before it, or without)
        paths = {p for path in GENERATION_PATHS for p in (path, settings.root_path + path)}
        app.add_middleware(LoadMiddleware, paths=paths, load=serving.load)
    app.add_middleware(BodyLimitMiddleware, max_bytes=settings.max_body_bytes)
    app.add_middleware(RequestIdMiddleware)
    if settings.allowed_origins:
        app.add_middleware(CORSMiddleware, allow_origins=list(settings.allowed_origins),
                           allow_methods=list(settings.allowed_methods), allow_headers=list(settings.allowed_headers),
                           allow_credentials=settings.allow_credentials, expose_headers=["X-Request-Id"])
    instrument_http(app, serving.metrics.registry)
    app.add_middleware(MethodMiddleware)  # (outermost: the metrics never see a made-up method)

    routes: list[tuple[str, str, Callable, dict[str, Any] | None]] = [
        ("GET", "/health", serving.health, None),
        ("GET", "/ping", serving.health, None),  # vLLM's (SageMaker's) name for /health, by GET or POST
        ("POST", "/ping", serving.health, None),
        ("GET", "/metrics", serving.prometheus, None),
        ("GET", "/version", serving.version, None),
        ("GET", "/load", serving.server_load, None),
        ("GET", "/v1/models", serving.models, None),
        ("GET", "/v1/models/{model:path}", serving.model, None),  # (a served name may hold a '/')
        ("POST", "/tokenize", serving.tokenize, _json_body(TokenizeCompletionRequest, TokenizeChatRequest)),
        ("POST", "/detokenize", serving.detokenize, _json_body(DetokenizeRequest)),
        ("POST", "/v1/completions", serving.completions, _json_body(CompletionRequest)),
        ("POST", "/v1/chat/completions", serving.chat_completions, _json_body(ChatCompletionRequest)),
        ("POST", "/v1/responses", serving.responses, _json_body(ResponsesRequest)),
        ("POST", "/invocations", serving.invocations, _json_body(ChatCompletionRequest, CompletionRequest)),
    ]
    if settings.tokenizer_info:
        routes.append(("GET", "/tokenizer_info", serving.tokenizer_info, None))
    for method, path, endpoint, extra in routes:
        app.add_api_route(path, endpoint, methods=[method], openapi_extra=extra)

    @app.exception_handler(ApiError)
    async def _api_error(request: Request, exc: ApiError) -> JSONResponse:
        return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        message = exc.detail if isinstance(exc.detail, str) else "error"
        if exc.status_code == 404:
            message = f"{request.url.path}: no such route"
        headers = getattr(exc, "headers", None)
        if exc.status_code == 405:
            message = f"{request.method} {request.url.path}: method not allowed"
            # every method the path's routes take (starlette names the first matching route's alone: /ping's two
            # routes, GET and POST, answered `Allow: GET`)
            allowed = sorted({m for route in app.routes if isinstance(route, APIRoute)
                              and route.matches(request.scope)[0] is Match.PARTIAL for m in route.methods or ()})
            if allowed:
                headers = {**(headers or {}), "Allow": ", ".join(allowed)}
        return JSONResponse(error_body(exc.status_code, message), status_code=exc.status_code, headers=headers)

    @app.exception_handler(ClientDisconnect)
    async def _client_gone(request: Request, exc: ClientDisconnect) -> Response:
        if not request.scope.get(CLOSED_BY_SERVER):  # else the server has answered and logged it
            client = f"{request.client.host}:{request.client.port}" if request.client else "client"
            log.info("%s: disconnected before sending the whole request body of %s %s", client, request.method,
                     request.url.path)
        return Response(status_code=499)  # nobody reads it

    @app.exception_handler(LeftBeforeItsTurn)
    async def _left_waiting(request: Request, exc: LeftBeforeItsTurn) -> Response:
        client = f"{request.client.host}:{request.client.port}" if request.client else "client"
        log.info("%s: disconnected while its request %s %s waited for its turn; not run", client, request.method,
                 request.url.path)
        return Response(status_code=499)  # nobody reads it

    @app.exception_handler(Exception)
    async def _internal_error(request: Request, exc: Exception) -> JSONResponse:
        log.exception("unhandled error on %s", request.url.path)
        return JSONResponse(error_body(500, f"internal error: {type(exc).__name__}"), status_code=500)

    return app
