"""The FastAPI app: `build_app(engine, settings, on_engine_dead)`.

Endpoints: POST /v1/completions, POST /v1/chat/completions (both stream as SSE `data: {...}`
chunks ending with `data: [DONE]`), GET /v1/models, GET /health, GET /metrics, GET /openapi.json
(the request bodies' JSON schemas included, though the endpoints parse the raw body themselves).

Every error is an OpenAI-style body {"error": {"message", "type", "param", "code"}}: bad input is
a 400 (401 bad API key, 404 unknown model or route, 413 body too large, 415 a body that is not
JSON), overload a 503 with Retry-After. Requests are validated on the event loop (tokenizing,
checking lengths and sampling values) before they reach the engine, so nothing invalid is ever
admitted. A request that fails in the engine gets the engine's status (400 if its input was at
fault, else 500); a stream cannot change its status any more, so it is cut instead.

Only `application/json` bodies are read: a web page can make a browser send a cross-origin POST
without asking first only as text/plain, form or multipart, so none of those can run a generation
on a server that trusts its network. `/v1/models` shows the model's path only when asked.

A client that goes away (before, during or after sending its request) costs at most one info
line, and none here when `connection.py` has already answered and logged the request (a stalled
upload).

If the engine thread dies, in-flight requests fail at once and `on_engine_dead` is called on the
event loop: `cli.py` then stops the server and exits non-zero, so a supervisor restarts it.
"""

from __future__ import annotations

import asyncio
import json
import logging
import secrets
import time
import uuid
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import jinja2
from fastapi import FastAPI, Request
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from loopserve.engine.config import EngineConfig
from loopserve.engine.engine import LLMEngine
from loopserve.engine.sequence import Sequence, resolve_exit_rule
from loopserve.outputs import CompletionOutput, RequestOutput
from loopserve.sampling_params import SamplingParams
from loopserve.serve.async_engine import (
    AsyncLLMEngine,
    EngineDeadError,
    EngineOverloadedError,
    EngineStoppedError,
    RequestGroup,
)
from loopserve.serve.connection import CLOSED_BY_SERVER
from loopserve.serve.metrics import ServerMetrics
from loopserve.serve.protocol import (
    ApiError,
    ChatCompletionRequest,
    CompletionRequest,
    error_body,
    parse_body,
    sampling_params,
)

log = logging.getLogger("loopserve.serve")
COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # OpenAI's and vLLM's default for /v1/completions
MIN_LOGPROB = -9999.0  # JSON has no -inf


@dataclass
class ServerSettings:
    model_name: str
    model_path: str = ""
    expose_model_path: bool = False  # /v1/models shows `model_path` as the model's root (else its name)
    api_key: str | None = None
    max_queued_requests: int = 256  # engine requests waiting beyond max_num_seqs; past it: 503
    max_body_bytes: int = 4 * 2**20
    sampling_defaults: dict[str, Any] = field(default_factory=dict)  # min_loops, max_loops, exit_*


def load_engine(model: str | Path | None, *, dtype: str = "float32", device: str = "cpu",
                state_init: str = "like-init", seed: int = 0, **engine_kwargs: Any) -> tuple[LLMEngine, Path]:
    """Load a checkpoint and build a batching engine (ValueError on a bad model or bad flags)."""
    from loopserve.llm import default_model_path
    from loopserve.models.loader import load_model

    cfg = EngineConfig(**engine_kwargs)
    if cfg.scheduler == "reference":
        raise ValueError("scheduler: 'reference' is the sequential oracle; serve needs cb, cdb-norefill or cdb")
    loaded = load_model(model if model is not None else default_model_path(), dtype, device, state_init)
    return LLMEngine(loaded.model, loaded.tokenizer, cfg, seed), loaded.path


def check_sampling_defaults(engine: LLMEngine, defaults: dict[str, Any]) -> None:
    """Raise ValueError if server-wide exit defaults do not suit the model."""
    params = SamplingParams(**{k: v for k, v in defaults.items() if v is not None})
    resolve_exit_rule(params, engine.model, engine.cfg.lookahead)


# -- body size limit ------------------------------------------------------------------------------------------
DRAIN_FACTOR, DRAIN_S = 8, 2.0  # how much of an over-limit body is read and dropped before the 413


class _BodyTooLarge(Exception):
    pass


class BodyLimitMiddleware:
    """413 for a request body over `max_bytes` (declared by Content-Length or streamed)."""

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app, self.max_bytes = app, max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        for k, v in scope.get("headers", []):
            if k == b"content-length":
                try:
                    declared = int(v)
                except ValueError:
                    declared = 0
                if declared > self.max_bytes:
                    await self._reject(send)
                    return
        seen = 0
        started = False

        async def limited_receive() -> Message:
            nonlocal seen
            msg = await receive()
            if msg["type"] == "http.request":
                seen += len(msg.get("body", b""))
                if seen > self.max_bytes:
                    raise _BodyTooLarge
            return msg

        async def tracking_send(msg: Message) -> None:
            nonlocal started
            if msg["type"] == "http.response.start":
                started = True
            await send(msg)

        try:
            await self.app(scope, limited_receive, tracking_send)
        except _BodyTooLarge:
            if not started:
                await self._drain(receive)
                await self._reject(send)

    async def _drain(self, receive: Receive) -> None:
        """Read and drop the rest of an over-limit body before answering (a lingering close, RFC 9112
        §9.6): closing while the client still sends makes the kernel reset the connection, and the
        client loses the 413 it has not read yet. Bounded: DRAIN_FACTOR x the limit, DRAIN_S seconds."""
        budget = DRAIN_FACTOR * self.max_bytes
        try:
            async with asyncio.timeout(DRAIN_S):
                while budget > 0:
                    msg = await receive()
                    if msg["type"] != "http.request" or not msg.get("more_body", False):
                        return
                    budget -= len(msg.get("body", b""))
        except TimeoutError:
            return

    async def _reject(self, send: Send) -> None:
        body = json.dumps(error_body(413, f"request body: larger than the limit of {self.max_bytes} bytes")).encode()
        await send({"type": "http.response.start", "status": 413,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                                (b"connection", b"close")]})
        await send({"type": "http.response.body", "body": body})


# -- response pieces --------------------------------------------------------------------------------------------
def _lp(x: float) -> float:
    return max(x, MIN_LOGPROB) if x == x else MIN_LOGPROB


class _Delta:
    """What a stream has sent of one choice; hands out the next text delta and token range.

    Text that may still change is held back: trailing U+FFFD (an incomplete UTF-8 sequence) and,
    with stop strings, the last len(longest stop) - 1 characters (a stop string being completed
    is cut from the final text, so none of it may have been sent)."""

    def __init__(self, stop: list[str] | None) -> None:
        self.hold = max(len(s) for s in stop) - 1 if stop else 0
        self.text = ""
        self.tokens = 0
        self.offset = 0  # text_offset of the next token (completions logprobs)

    def advance(self, c: CompletionOutput, finished: bool) -> tuple[str, int, int]:
        start, self.tokens = self.tokens, len(c.token_ids)
        ready = c.text
        if not finished:
            ready = ready[: max(0, len(ready) - self.hold)].rstrip("\ufffd")
        delta = ""
        if len(ready) > len(self.text) and ready.startswith(self.text):
            delta, self.text = ready[len(self.text):], ready
        return delta, start, self.tokens


class _Formatter:
    def __init__(self, engine: LLMEngine) -> None:
        self.tok = engine.tokenizer

    def token_str(self, tid: int) -> str:
        return self.tok.decode([tid], skip_special_tokens=False)

    def completion_logprobs(self, c: CompletionOutput, start: int, end: int, d: _Delta) -> dict | None:
        if c.logprobs is None:
            return None
        out: dict[str, list] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        for k in range(start, end):
            tid, entry = c.token_ids[k], c.logprobs[k]
            s = self.token_str(tid)
            out["tokens"].append(s)
            out["token_logprobs"].append(_lp(entry[tid].logprob))
            ranked = sorted(entry.items(), key=lambda kv: kv[1].rank or 0)
            out["top_logprobs"].append({self.token_str(t): _lp(v.logprob) for t, v in ranked})
            out["text_offset"].append(d.offset)
            d.offset += len(s)
        return out

    def chat_logprobs(self, c: CompletionOutput, start: int, end: int, top: int) -> dict | None:
        if c.logprobs is None:
            return None
        content = []
        for k in range(start, end):
            tid, entry = c.token_ids[k], c.logprobs[k]
            s = self.token_str(tid)
            ranked = sorted(((t, v) for t, v in entry.items() if v.rank is not None and v.rank <= top),
                            key=lambda kv: kv[1].rank or 0)
            content.append({"token": s, "logprob": _lp(entry[tid].logprob), "bytes": list(s.encode()),
                            "top_logprobs": [{"token": self.token_str(t), "logprob": _lp(v.logprob),
                                              "bytes": list(self.token_str(t).encode())} for t, v in ranked]})
        return {"content": content}


def _usage(outs: list[RequestOutput]) -> dict[str, int]:
    prompt = sum(len(o.prompt_token_ids) for o in outs)
    completion = sum(len(o.outputs[0].token_ids) for o in outs)
    loops = sum(o.metrics.loops_run for o in outs if o.metrics is not None)
    prefill_loops = sum(o.metrics.prefill_loops for o in outs if o.metrics is not None)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "loops": loops, "prefill_loops": prefill_loops}


def _sse(obj: Any) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False, allow_nan=False)}\n\n"


class _StreamFailed(RuntimeError):
    """Raised inside a stream to cut the transport: an in-band error or a clean EOF would read as
    success to some clients (vLLM's bench client), a broken chunked stream does not."""


class _GroupStreamingResponse(StreamingResponse):
    """A streaming response that aborts its engine requests however the stream ends."""

    def __init__(self, content: AsyncIterator[str], group: RequestGroup) -> None:
        super().__init__(content, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self.group = group

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        except _StreamFailed as e:
            # Returning without the final chunk makes the server close the connection mid-stream,
            # without the traceback an exception would log for what is an engine-side failure.
            log.error("%s: stream cut: %s", scope.get("path"), e)
        finally:
            self.group.abort()


async def _wait_disconnect(receive: Callable) -> None:
    while True:
        msg = await receive()
        if msg["type"] == "http.disconnect":
            return


# -- the app -----------------------------------------------------------------------------------------------------
def _json_body(model: type) -> dict[str, Any]:
    """OpenAPI `requestBody` of an endpoint that reads the raw body: `model`'s schema, by reference."""
    return {"requestBody": {"required": True, "content": {"application/json": {
        "schema": {"$ref": f"#/components/schemas/{model.__name__}"}}}}}


def _is_json(content_type: str) -> bool:
    return content_type.split(";", 1)[0].strip().lower() == "application/json"


def build_app(engine: LLMEngine, settings: ServerSettings,
              on_engine_dead: Callable[[], None] | None = None) -> FastAPI:
    mc = engine.model_config
    max_model_len = mc.max_position
    kv_tokens = engine.kv.num_blocks * engine.kv.block_size
    fmt = _Formatter(engine)
    tokenizer = engine.tokenizer
    created = int(time.time())
    aengine = AsyncLLMEngine(engine, settings.max_queued_requests, on_dead=on_engine_dead)
    metrics = ServerMetrics(settings.model_name, lambda: aengine.snapshot, mc.r_max, engine.cfg.max_decode_batch,
                            max_model_len)
    aengine.on_outputs = metrics.observe

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        aengine.start()
        try:
            yield
        finally:
            await aengine.shutdown()

    app = FastAPI(title="loopserve", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url="/openapi.json")

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            schema = get_openapi(title=app.title, version=app.version, routes=app.routes)
            components = schema.setdefault("components", {}).setdefault("schemas", {})
            for model in (CompletionRequest, ChatCompletionRequest):
                body = model.model_json_schema(ref_template="#/components/schemas/{model}")
                components.update(body.pop("$defs", {}))
                components[model.__name__] = body
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]
    app.state.engine = aengine
    app.state.metrics = metrics
    app.state.settings = settings
    app.add_middleware(BodyLimitMiddleware, max_bytes=settings.max_body_bytes)

    @app.exception_handler(ApiError)
    async def _api_error(request: Request, exc: ApiError) -> JSONResponse:
        return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        message = exc.detail if isinstance(exc.detail, str) else "error"
        if exc.status_code == 404:
            message = f"{request.url.path}: no such route"
        elif exc.status_code == 405:
            message = f"{request.method} {request.url.path}: method not allowed"
        return JSONResponse(error_body(exc.status_code, message), status_code=exc.status_code,
                            headers=getattr(exc, "headers", None))

    @app.exception_handler(ClientDisconnect)
    async def _client_gone(request: Request, exc: ClientDisconnect) -> Response:
        if not request.scope.get(CLOSED_BY_SERVER):  # else the server has answered and logged it
            client = f"{request.client.host}:{request.client.port}" if request.client else "client"
            log.info("%s: disconnected before sending the whole request body of %s %s", client, request.method,
                     request.url.path)
        return Response(status_code=499)  # nobody reads it

    @app.exception_handler(Exception)
    async def _internal_error(request: Request, exc: Exception) -> JSONResponse:
        log.exception("unhandled error on %s", request.url.path)
        return JSONResponse(error_body(500, f"internal error: {type(exc).__name__}"), status_code=500)

    # -- helpers ----------------------------------------------------------------------------------------------
    def check_auth(request: Request) -> None:
        if settings.api_key is None:
            return
        header = request.headers.get("authorization", "")
        if not secrets.compare_digest(header.encode(), f"Bearer {settings.api_key}".encode()):
            raise ApiError(401, "invalid or missing API key (send 'Authorization: Bearer <key>')")

    def check_model(name: str | None) -> None:
        if name is not None and name != settings.model_name:
            raise ApiError(404, f"The model `{name}` does not exist.", "model")

    async def read(request: Request, cls: type) -> Any:
        check_auth(request)
        content_type = request.headers.get("content-type")
        if content_type is None or not _is_json(content_type):
            raise ApiError(415, f"Content-Type: expected application/json, got {content_type or 'none'}")
        req = parse_body(cls, await request.body())
        check_model(req.model)
        return req

    def resolve_max_tokens(requested: int | None, default: int | None, prompt_len: int, what: str) -> int | None:
        if prompt_len >= max_model_len:
            raise ApiError(400, f"{what}: {prompt_len} tokens; this model's maximum context length is "
                                f"{max_model_len} tokens, which leaves no room to generate", what)
        room = min(max_model_len, kv_tokens) - prompt_len
        if room < 1:
            raise ApiError(400, f"{what}: {prompt_len} tokens do not fit in the KV cache ({kv_tokens} tokens)", what)
        if requested is None:
            return room if default is None else min(default, room)
        if requested < 1:
            return requested  # SamplingParams names the error
        if prompt_len + requested > max_model_len:
            raise ApiError(400, f"max_tokens: this model's maximum context length is {max_model_len} tokens, "
                                f"but {prompt_len + requested} were requested ({prompt_len} in the {what}, "
                                f"{requested} in the completion)", "max_tokens")
        if prompt_len + requested > kv_tokens:
            raise ApiError(400, f"max_tokens: {prompt_len} prompt + {requested} completion tokens exceed the KV "
                                f"cache ({kv_tokens} tokens)", "max_tokens")
        return requested

    def make_seq(rid: str, text: str | None, ids: list[int], params: SamplingParams, arrival: float,
                 seed: int | None, what: str) -> Sequence:
        prompt: Any = {"prompt": text, "prompt_token_ids": ids} if text is not None else ids
        try:
            return engine.make_sequence(rid, prompt, params, arrival, seed=seed)
        except ValueError as e:
            msg = str(e)
            head = msg.split(":", 1)[0]
            raise ApiError(400, msg, what if head in ("prompt", "prompt_token_ids") else head) from None

    def admit(seqs: list[Sequence]) -> RequestGroup:
        try:
            return aengine.add(seqs)
        except EngineOverloadedError as e:
            metrics.reject("overload")
            raise ApiError(503, f"{e}; retry later", headers={"Retry-After": "1"}) from None
        except EngineStoppedError as e:
            metrics.reject("shutdown")
            raise ApiError(503, str(e), headers={"Retry-After": "5"}) from None
        except EngineDeadError as e:
            raise ApiError(503, str(e)) from None

    async def collect(group: RequestGroup, request: Request) -> list[RequestOutput] | None:
        """Final outputs, or None if the client went away first (then the requests are aborted)."""
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
                return None
            task.result()
        except (EngineDeadError, EngineStoppedError) as e:
            raise ApiError(503, str(e)) from None
        finally:
            gone.cancel()
            task.cancel()
            group.abort()
        done = [o for o in finals if o is not None]
        for o in done:
            c = o.outputs[0]
            if c.finish_reason == "error":
                raise ApiError(o.error_status or 500, o.error or "the engine failed on this request")
            if c.finish_reason not in ("stop", "length"):
                raise ApiError(503, o.error or f"request ended: {c.finish_reason}")
        return done

    def base(kind: str, cid: str) -> dict[str, Any]:
        return {"id": cid, "object": kind, "created": int(time.time()), "model": settings.model_name}

    # -- endpoints ---------------------------------------------------------------------------------------------
    @app.get("/health")
    async def health() -> Response:
        if not aengine.alive:
            return JSONResponse(error_body(503, "the engine is not running"), status_code=503)
        return Response(status_code=200)

    @app.get("/metrics")
    async def prometheus() -> Response:
        return Response(metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models(request: Request) -> JSONResponse:
        check_auth(request)
        root = settings.model_path if settings.expose_model_path else settings.model_name
        return JSONResponse({"object": "list", "data": [{
            "id": settings.model_name, "object": "model", "created": created, "owned_by": "loopserve",
            "root": root, "parent": None, "max_model_len": max_model_len, "r_max": mc.r_max}]})

    @app.post("/v1/completions", openapi_extra=_json_body(CompletionRequest))
    async def completions(request: Request) -> Response:
        arrival = time.monotonic()
        req: CompletionRequest = await read(request, CompletionRequest)
        prompts = completion_prompts(req.prompt)
        if len(prompts) > aengine.capacity:
            raise ApiError(400, f"prompt: at most {aengine.capacity} prompts per request", "prompt")
        cid = f"cmpl-{uuid.uuid4().hex}"
        seqs = []
        for i, (text, ids) in enumerate(prompts):
            mt = resolve_max_tokens(req.max_tokens, COMPLETIONS_DEFAULT_MAX_TOKENS, len(ids), "prompt")
            params = sampling_params(req, max_tokens=mt, logprobs=req.logprobs, defaults=settings.sampling_defaults)
            seqs.append(make_seq(f"{cid}-{i}", text, ids, params, arrival, req.seed, "prompt"))
        group = admit(seqs)
        stop = seqs[0].params.stop if isinstance(seqs[0].params.stop, list) else None
        if req.streaming:
            return _GroupStreamingResponse(stream_completion(req, group, cid, len(seqs), stop), group)
        outs = await collect(group, request)
        if outs is None:
            return Response(status_code=499)
        choices = []
        for i, o in enumerate(outs):
            c = o.outputs[0]
            d = _Delta(None)
            choice: dict[str, Any] = {"index": i, "text": c.text,
                                      "logprobs": fmt.completion_logprobs(c, 0, len(c.token_ids), d),
                                      "finish_reason": c.finish_reason, "stop_reason": None,
                                      "exit_depths": list(c.exit_depths)}
            if req.return_token_ids:
                choice["token_ids"] = list(c.token_ids)
                choice["prompt_token_ids"] = list(o.prompt_token_ids)
            choices.append(choice)
        return JSONResponse({**base("text_completion", cid), "choices": choices, "usage": _usage(outs)})

    def completion_prompts(prompt: Any) -> list[tuple[str | None, list[int]]]:
        items: list[Any] = [prompt] if isinstance(prompt, str) or (prompt and isinstance(prompt[0], int)) else prompt
        if not items:
            raise ApiError(400, "prompt: must not be empty", "prompt")
        out: list[tuple[str | None, list[int]]] = []
        for p in items:
            if not p:
                raise ApiError(400, "prompt: must not be empty", "prompt")
            out.append((p, tokenizer.encode(p)) if isinstance(p, str) else (None, list(p)))
        return out

    async def stream_completion(req: CompletionRequest, group: RequestGroup, cid: str, n: int,
                                stop: list[str] | None) -> AsyncIterator[str]:
        deltas = [_Delta(stop) for _ in range(n)]
        latest: dict[int, RequestOutput] = {}
        try:
            async for i, out in group:
                latest[i] = out
                c = out.outputs[0]
                if out.finished and c.finish_reason not in ("stop", "length"):
                    raise _StreamFailed(out.error or f"request ended: {c.finish_reason}")
                d = deltas[i]
                text, a, b = d.advance(c, out.finished)
                choice: dict[str, Any] = {"index": i, "text": text, "logprobs": fmt.completion_logprobs(c, a, b, d),
                                          "finish_reason": c.finish_reason if out.finished else None,
                                          "stop_reason": None, "exit_depths": list(c.exit_depths[a:b])}
                if req.return_token_ids:
                    choice["token_ids"] = list(c.token_ids[a:b])
                    if a == 0:
                        choice["prompt_token_ids"] = list(out.prompt_token_ids)
                chunk: dict[str, Any] = {**base("text_completion", cid), "choices": [choice]}
                if req.include_usage:
                    chunk["usage"] = _usage(list(latest.values())) if req.continuous_usage else None
                yield _sse(chunk)
        except (EngineDeadError, EngineStoppedError) as e:
            raise _StreamFailed(str(e)) from None
        if req.include_usage:
            yield _sse({**base("text_completion", cid), "choices": [], "usage": _usage(list(latest.values()))})
        yield "data: [DONE]\n\n"

    @app.post("/v1/chat/completions", openapi_extra=_json_body(ChatCompletionRequest))
    async def chat_completions(request: Request) -> Response:
        arrival = time.monotonic()
        req: ChatCompletionRequest = await read(request, ChatCompletionRequest)
        messages = [{"role": m.role, "content": m.text(), **({"name": m.name} if m.name else {})}
                    for m in req.messages]
        try:
            text = tokenizer.apply_chat_template(messages, add_generation_prompt=req.add_generation_prompt is not False)
        except ValueError as e:
            raise ApiError(400, f"messages: {e}", "messages") from None
        except jinja2.TemplateError as e:
            raise ApiError(400, f"messages: the chat template rejected them ({e})", "messages") from None
        ids = tokenizer.encode(text, add_special_tokens=False)
        if not ids:
            raise ApiError(400, "messages: the chat template produced an empty prompt", "messages")
        requested = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        mt = resolve_max_tokens(requested, None, len(ids), "messages")
        top = req.top_logprobs or 0
        params = sampling_params(req, max_tokens=mt, logprobs=top if req.logprobs else None,
                                 defaults=settings.sampling_defaults)
        cid = f"chatcmpl-{uuid.uuid4().hex}"
        seq = make_seq(cid, text, ids, params, arrival, req.seed, "messages")
        group = admit([seq])
        stop = params.stop if isinstance(params.stop, list) else None
        if req.streaming:
            return _GroupStreamingResponse(stream_chat(req, group, cid, stop, top), group)
        outs = await collect(group, request)
        if outs is None:
            return Response(status_code=499)
        o = outs[0]
        c = o.outputs[0]
        choice: dict[str, Any] = {"index": 0, "message": {"role": "assistant", "content": c.text},
                                  "logprobs": fmt.chat_logprobs(c, 0, len(c.token_ids), top),
                                  "finish_reason": c.finish_reason, "stop_reason": None,
                                  "exit_depths": list(c.exit_depths)}
        if req.return_token_ids:
            choice["token_ids"] = list(c.token_ids)
            choice["prompt_token_ids"] = list(o.prompt_token_ids)
        return JSONResponse({**base("chat.completion", cid), "choices": [choice], "usage": _usage(outs)})

    async def stream_chat(req: ChatCompletionRequest, group: RequestGroup, cid: str, stop: list[str] | None,
                          top: int) -> AsyncIterator[str]:
        d = _Delta(stop)
        latest: list[RequestOutput] = []
        first: dict[str, Any] = {**base("chat.completion.chunk", cid), "choices": [{
            "index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}]}
        if req.include_usage:
            first["usage"] = None
        yield _sse(first)
        try:
            async for _, out in group:
                latest = [out]
                c = out.outputs[0]
                if out.finished and c.finish_reason not in ("stop", "length"):
                    raise _StreamFailed(out.error or f"request ended: {c.finish_reason}")
                text, a, b = d.advance(c, out.finished)
                choice: dict[str, Any] = {"index": 0, "delta": {"content": text} if text or not out.finished else {},
                                          "logprobs": fmt.chat_logprobs(c, a, b, top),
                                          "finish_reason": c.finish_reason if out.finished else None,
                                          "stop_reason": None, "exit_depths": list(c.exit_depths[a:b])}
                if req.return_token_ids:
                    choice["token_ids"] = list(c.token_ids[a:b])
                chunk: dict[str, Any] = {**base("chat.completion.chunk", cid), "choices": [choice]}
                if req.include_usage:
                    chunk["usage"] = _usage(latest) if req.continuous_usage else None
                yield _sse(chunk)
        except (EngineDeadError, EngineStoppedError) as e:
            raise _StreamFailed(str(e)) from None
        if req.include_usage:
            yield _sse({**base("chat.completion.chunk", cid), "choices": [], "usage": _usage(latest)})
        yield "data: [DONE]\n\n"

    return app
