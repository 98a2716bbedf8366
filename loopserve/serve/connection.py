"""HTTP connections: uvicorn's h11 protocol with a request read timeout, and uvicorn's server with the app's own
end of a graceful shutdown's grace period (`GracefulServer`).

uvicorn closes idle keep-alive connections, but a client that is slow to *send* a request is
never timed out: one that opens a connection and sends half a request head, or declares a body
and stops sending it, holds its connection (and its request task) forever, and a graceful
shutdown waits for it until its grace period runs out. `read_timeout_protocol(seconds)` gives the
protocol class `cli.py` passes to `uvicorn.Config(http=...)`:

- a request head (request line and headers) must be complete within the timeout of the
  connection opening or of the head's first byte; otherwise the connection is closed;
- while a request body is being received, a gap of more than the timeout between its bytes is a
  stall: the client gets a 408 (OpenAI-style body) and the connection is closed; so is a body that trickles in
  without stalling, once it has taken BODY_TIMEOUTS timeouts plus its bytes at MIN_BODY_RATE (a byte every few
  seconds held a connection and its task for as long as the client liked);
- on graceful shutdown, a request whose body is still arriving gets a 503 and its connection is
  closed at once: it was never admitted, so there is nothing to let finish.

The app sees such a request as a client disconnect; `CLOSED_BY_SERVER` in its scope tells it that
the server has already answered and logged it.

When the grace period (`--shutdown-timeout`) runs out, uvicorn cancels the request tasks still running: a
request not answered yet gets a plain-text 500, a stream is cut with no error event, and each logs an ERROR
and a traceback. `GracefulServer` calls the app's `on_deadline` (`OpenAIServing.abort_in_flight`) a little
before that, so that the app answers them itself (a 503, a stream's error event and cut) and they are done
by then.
"""

from __future__ import annotations

import asyncio
import json
import logging
import signal
import socket
from collections.abc import Callable
from types import FrameType
from typing import Any

import h11
import uvicorn
from uvicorn.protocols.http.h11_impl import STATUS_PHRASES, H11Protocol

from loopserve.serve.limits import BODY_TIMEOUTS, MIN_BODY_RATE
from loopserve.serve.protocol import SHUTDOWN_RETRY_AFTER_S, SHUTTING_DOWN, error_body

log = logging.getLogger("loopserve.serve")
CLOSED_BY_SERVER = "loopserve.closed_by_server"  # scope key: the server answered and closed the request
SHUTDOWN_MARGIN_S = 1.0  # `GracefulServer`: the app's end of the grace period comes this much (at most a quarter
# of the grace period) before uvicorn's, for the answers to be written


def grace_deadline(grace_s: float) -> float:
    """Seconds from the start of a graceful shutdown to the app's end of it (`OpenAIServing.abort_in_flight`):
    SHUTDOWN_MARGIN_S, at most a quarter of the grace period, before the grace period runs out. One rule for
    the single-process server (`GracefulServer`) and Ray Serve's replicas (`ray.LoopServeReplica.drain`)."""
    return max(grace_s - min(SHUTDOWN_MARGIN_S, grace_s / 4), 0.0)


def read_timeout_protocol(timeout_s: float) -> type[H11Protocol]:
    """The protocol class for `uvicorn.Config(http=...)` with this read timeout."""
    return type("ReadTimeoutProtocol", (ReadTimeoutProtocol,), {"read_timeout_s": timeout_s})


class ReadTimeoutProtocol(H11Protocol):
    read_timeout_s: float  # (`read_timeout_protocol` makes the class that sets it)

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._timer: asyncio.TimerHandle | None = None
        self._awaiting: str | None = None  # "head" or "body": what the client is expected to send
        self._since = 0.0  # head: when it was first awaited; body: when its last bytes arrived
        self._body_start = 0.0  # when the body began to be awaited
        self._body_bytes = 0  # and what of it has arrived since

    # -- asyncio / uvicorn hooks ----------------------------------------------------------------------
    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._watch(fresh=True)

    def data_received(self, data: bytes) -> None:
        if self._awaiting == "body":
            self._body_bytes += len(data)
        super().data_received(data)
        self._watch()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._watch()

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel()
        super().connection_lost(exc)

    def shutdown(self) -> None:
        if self._awaiting == "body" and not self.cycle.response_started:
            log.info("%s: request body still arriving at shutdown; answered 503 and closed", self._peer())
            self._answer(503, SHUTTING_DOWN, [(b"retry-after", str(SHUTDOWN_RETRY_AFTER_S).encode())])
            self.transport.close()
            return
        super().shutdown()

    # -- the timer ------------------------------------------------------------------------------------
    def _watch(self, fresh: bool = False) -> None:
        """Track what the client owes after an event, and keep the timer armed while it owes something."""
        awaiting: str | None = None
        if not self.transport.is_closing():
            state = self.conn.their_state
            if state is h11.SEND_BODY:
                awaiting = "body"
            elif state is h11.IDLE and (fresh or self.conn.trailing_data[0]):
                awaiting = "head"  # a new connection, or part of the next request head has arrived
        now = self.loop.time()
        if awaiting == "body" and self._awaiting != "body":
            self._body_start, self._body_bytes = now, 0
        if awaiting != self._awaiting or awaiting == "body":  # body bytes restart the stall clock
            self._since = now
        self._awaiting = awaiting
        if awaiting is None:
            self._cancel()
        elif self._timer is None:
            self._timer = self.loop.call_at(self._since + self.read_timeout_s, self._check)

    def _cancel(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _check(self) -> None:
        self._timer = None
        if self._awaiting is None or self.transport.is_closing():
            return
        now = self.loop.time()
        if self.flow.read_paused:  # the app has not read what came: not the client's stall
            self._since = now
            self._body_start, self._body_bytes = now, 0  # (nor its slowness: the body's allowance starts again)
        due = self._since + self.read_timeout_s
        slow = (self._awaiting == "body" and not self.cycle.response_started
                and now - self._body_start > BODY_TIMEOUTS * self.read_timeout_s + self._body_bytes / MIN_BODY_RATE)
        if slow:
            log.info("%s: request body too slow (%d bytes in %.0f s); answered 408 and closed", self._peer(),
                     self._body_bytes, now - self._body_start)
            self._answer(408, f"request body: too slow ({self._body_bytes} bytes in {now - self._body_start:.0f} s)")
            self.transport.close()
        elif now < due:
            self._timer = self.loop.call_at(due, self._check)
        elif self._awaiting == "head":
            # a connection that never sent a byte is not worth a line (browsers open spare ones)
            level = logging.INFO if self.conn.trailing_data[0] else logging.DEBUG
            log.log(level, "%s: request head not complete within %g s; connection closed", self._peer(),
                    self.read_timeout_s)
            self.transport.close()
        elif not self.cycle.response_started:
            log.info("%s: request body stalled for %g s; answered 408 and closed", self._peer(), self.read_timeout_s)
            self._answer(408, f"request body: nothing received for {self.read_timeout_s:g} s")
            self.transport.close()
        elif self.cycle.response_complete:  # answered without reading the whole body: nothing to wait for
            self.transport.close()

    def _answer(self, status: int, message: str, extra: list[tuple[bytes, bytes]] | None = None) -> None:
        """Write a complete error response while the request is still being received (`extra`: more headers)."""
        body = json.dumps(error_body(status, message)).encode()
        headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                   (b"connection", b"close"), *(extra or ())]
        for event in (h11.Response(status_code=status, headers=headers, reason=STATUS_PHRASES[status]),
                      h11.Data(data=body), h11.EndOfMessage()):
            self.transport.write(self.conn.send(event))
        self.scope[CLOSED_BY_SERVER] = True  # type: ignore[literal-required]

    def _peer(self) -> str:
        return f"{self.client[0]}:{self.client[1]}" if self.client else "client"


class GracefulServer(uvicorn.Server):
    """uvicorn's server, whose graceful shutdown calls `on_deadline` (on the event loop) SHUTDOWN_MARGIN_S (at most a
    quarter of the grace period) before its grace period (`timeout_graceful_shutdown`) runs out and uvicorn cancels
    the request tasks still running: the app ends them itself meanwhile. A second Ctrl+C (uvicorn's force quit)
    calls it at once, then forces the exit SHUTDOWN_MARGIN_S later: each request still running gets its 503 (a
    stream, its error event) instead of the plain-text 500 and the traceback uvicorn's cancellation leaves."""

    def __init__(self, config: uvicorn.Config, on_deadline: Callable[[], None]) -> None:
        super().__init__(config)
        self.on_deadline = on_deadline
        self._loop: asyncio.AbstractEventLoop | None = None
        self._ending_now = False

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if sig == signal.SIGINT and self.should_exit and self._loop is not None and not self._ending_now:
            self._ending_now = True  # (a third Ctrl+C forces the exit at once, as uvicorn's second does)
            self._loop.call_soon_threadsafe(self._end_now)
            return
        super().handle_exit(sig, frame)

    def _end_now(self) -> None:
        self.on_deadline()
        asyncio.get_running_loop().call_later(SHUTDOWN_MARGIN_S, setattr, self, "force_exit", True)

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        self._loop = asyncio.get_running_loop()
        grace = self.config.timeout_graceful_shutdown
        deadline: asyncio.TimerHandle | None = None
        if grace is not None:  # (None: uvicorn waits for them however long they take)
            deadline = self._loop.call_later(grace_deadline(grace), self.on_deadline)
        try:
            await super().shutdown(sockets)
        finally:
            if deadline is not None:
                deadline.cancel()
