"""ASGI middleware of the server: HTTP methods, the request body size limit and request ids (CORS is Starlette's).

- `MethodMiddleware`: 405 for a method no route or CORS preflight uses (any other name, lower-case `get` too),
  answered before anything else sees the request: the HTTP metrics label requests by method, and a client sending
  made-up methods grew them (and the memory, and each scrape's time) without bound, key or no key.
- `BodyLimitMiddleware`: 413 for a body over the limit, declared by Content-Length or streamed.
- `RequestIdMiddleware`: every request gets an id, the client's `X-Request-Id` when it sends a usable
  one (else a fresh one, and a warning when it sent one that is not); the app reads it from the scope
  (`request_id(scope)`) for the response's `id` and the log, and may rename the request before its response
  starts (`set_request_id`: a generation request's body `request_id`, vLLM's field, when no header named it);
  the response's `X-Request-Id` header sends the id as of then.
- `LoadMiddleware`: vLLM's server load (`--enable-server-load-tracking`), the generation requests in flight, which
  GET /load reports.
"""

from __future__ import annotations

import asyncio
import json
import logging
import uuid
from collections.abc import Collection

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from loopserve.serve.protocol import MAX_REQUEST_ID, error_body, usable_request_id

DRAIN_FACTOR, DRAIN_S = 8, 2.0  # how much of an over-limit body is read and dropped before the 413
REQUEST_ID_KEY = "loopserve.request_id"  # scope key
log = logging.getLogger("loopserve.serve")


HTTP_METHODS = frozenset({"GET", "HEAD", "POST", "PUT", "DELETE", "PATCH", "OPTIONS"})  # (RFC 9110's, but CONNECT
# and TRACE, which this server never answers)


class MethodMiddleware:
    """405 for a request whose method is not one of HTTP_METHODS (the app answers a known method that a route does
    not take with its own 405)."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] in HTTP_METHODS:
            await self.app(scope, receive, send)
            return
        body = json.dumps(error_body(405, "method not allowed")).encode()
        await send({"type": "http.response.start", "status": 405,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                                (b"allow", b"GET, POST")]})
        await send({"type": "http.response.body", "body": body})


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


def _sent_request_id(scope: Scope) -> str | None:
    """The X-Request-Id header as sent, usable or not."""
    for k, v in scope.get("headers", []):
        if k == b"x-request-id":
            return v.decode("latin-1")
    return None


def _usable_id(sent: str | None) -> str | None:
    # visible ASCII only, MAX_REQUEST_ID characters at most: the id is logged and sent back in a header
    return sent if sent is not None and usable_request_id(sent) else None


def request_id(scope: Scope) -> str:
    """The id `RequestIdMiddleware` gave this request (a fresh one if it did not run)."""
    return scope.get(REQUEST_ID_KEY) or uuid.uuid4().hex


def set_request_id(scope: Scope, rid: str) -> None:
    """Name the request `rid` from now on (the app's choice, before its response starts: the header sends it)."""
    scope[REQUEST_ID_KEY] = rid


def client_named(scope: Scope) -> bool:
    """Whether the client sent a usable X-Request-Id header (which then names the request)."""
    return _usable_id(_sent_request_id(scope)) is not None


class RequestIdMiddleware:
    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        sent = _sent_request_id(scope)
        rid = _usable_id(sent)
        if rid is None:
            rid = uuid.uuid4().hex
            if sent is not None:  # (served all the same, as vLLM serves it: a gateway's ids may be longer)
                log.warning("X-Request-Id: not 1 to %d visible ASCII characters (%d characters sent); the request "
                            "is named %s instead (or by its body's request_id)", MAX_REQUEST_ID, len(sent), rid)
        scope[REQUEST_ID_KEY] = rid

        async def send_with_id(msg: Message) -> None:
            if msg["type"] == "http.response.start":  # the id as of now (`set_request_id`)
                header = (b"x-request-id", scope[REQUEST_ID_KEY].encode())
                msg = {**msg, "headers": [*msg.get("headers", []), header]}
            await send(msg)

        await self.app(scope, receive, send_with_id)


class ServerLoad:
    """vLLM's server load: the generation requests in flight (`LoadMiddleware` counts them; GET /load reads them)."""

    def __init__(self) -> None:
        self.requests = 0


class LoadMiddleware:
    """Counts each POST to `paths` on `load` from its arrival to the end of its response (a stream's last event), as
    vLLM counts a generation request from its handler's start to its response's end."""

    def __init__(self, app: ASGIApp, paths: Collection[str], load: ServerLoad) -> None:
        self.app, self.paths, self.load = app, paths, load

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] != "POST" or scope["path"] not in self.paths:
            await self.app(scope, receive, send)
            return
        self.load.requests += 1
        try:
            await self.app(scope, receive, send)
        finally:
            self.load.requests -= 1
