"""`python -m loopserve_lab.bench.soak --duration-s N`: a soak test of the real server.

Owns the whole run: it starts its own `loopserve serve` subprocess on 127.0.0.1 (a free port; by
default a tiny checkpoint built with `make_tiny` in a temporary folder, or any checkpoint folder
given with `--model`), sized so that KV pressure (preemption) and overload (503) happen often; drives
it for the given wall time with mixed, partly hostile traffic from concurrent asyncio workers; then
checks that the server is left clean and stops it.

Traffic (weighted random, seeded per worker; every request goes to the server this run started):
completions and chat completions, plain and streamed (SSE read to `data: [DONE]`), with varied
prompts, max_tokens, sampling fields, logprobs, stop strings and loop extensions; streams the client
cuts after a few chunks; uploads cut halfway or before the body (raw sockets, some with a TCP reset);
uploads that stall past the server's read timeout (408); requests the client gives up on after a
short read timeout; bad inputs (malformed JSON, wrong types, out-of-range and huge values, NaN in
every spelling, wrong types beside unknown fields, bodies over the limit, non-JSON content types); long prompts with
large max_tokens (KV pressure); valid requests over raw sockets, some with the body trickled in
pieces. Besides, a burst of more requests than the server admits arrives every 0.5-1 times
`--burst-every-s` (overload). A worker that is answered 503 waits about the Retry-After second.

Every attempt gets one outcome:

- served: 2xx with a complete, well-formed body or stream, every choice finished by stop or length;
- rejected: 503 with Retry-After (overload: an accepted answer);
- client_error: a 4xx for a bad input or a stalled upload (the report lists any other than expected,
  and over-limit bodies whose 413 was overtaken by a connection reset);
- aborted: cut by the client on purpose (or by the driver when the run's drain time is up);
- 5xx: any other 5xx (a 503 without Retry-After included);
- lost: a request that should have been served or rejected but got no answer within the request
  timeout, a connection error, a truncated stream or a malformed body;
- unexpected_4xx: a valid request answered 4xx;
- bad_accepted: a bad input answered 2xx.

After the traffic: wait (bounded) until /metrics shows no running or waiting request, read the KV
usage, send one last request, read the server's RSS (after warm-up and at the end), stop it with
SIGTERM (exit code and shutdown time) and scan its log for tracebacks, HTTP 500s and ERROR lines.
The JSON report (`--out`) holds all of it; the exit status is 1 if any must-be-zero figure is not 0,
the KV cache is not empty once idle, the server did not exit 0, RSS grew more than
`--max-rss-growth-mib`, or nothing was served.
"""

from __future__ import annotations

import asyncio
import datetime
import json
import os
import platform
import random
import re
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

from loopserve.config_args import FlagParser, add_config_args, config_kwargs, knob
from loopserve_lab.bench.serve import free_port, wait_healthy

SERVED, REJECTED, CLIENT_ERROR, ABORTED = "served", "rejected", "client_error", "aborted"
SERVER_ERROR, LOST, UNEXPECTED_4XX, BAD_ACCEPTED = "5xx", "lost", "unexpected_4xx", "bad_accepted"
OUTCOMES = (SERVED, REJECTED, CLIENT_ERROR, ABORTED, SERVER_ERROR, LOST, UNEXPECTED_4XX, BAD_ACCEPTED)
MUST_BE_ZERO = (SERVER_ERROR, LOST, UNEXPECTED_4XX, BAD_ACCEPTED)
MODEL_NAME = "soak"
COMPLETIONS, CHAT = "/v1/completions", "/v1/chat/completions"
JSON_TYPES = ["application/json", "application/json; charset=utf-8", "Application/JSON"]  # all accepted

# weights of the traffic mix: served traffic dominates, every fault is frequent enough to recur
# many times a minute
KIND_WEIGHTS = {
    "completion": 12, "completion_stream": 12, "chat": 8, "chat_stream": 8, "raw_completion": 3,
    "trickled_upload": 3, "disconnect_stream": 8, "disconnect_upload": 4, "disconnect_before_body": 3,
    "client_timeout": 6, "stalled_upload": 2, "bad_input": 12, "long": 8,
}
WORDS = ("loop depth token exit gate batch river stone lantern harbor quiet amber signal window orchard copper "
         "meadow thread winter garden ember falcon marble echo compass velvet summit cobalt ripple tundra").split()
STOPS = ["e", "th", " the", "an", "\n", "o r", "xyz", "er"]  # ASCII: never half of a UTF-8 sequence


@dataclass
class SoakConfig:
    duration_s: float
    model: Path | None = None  # None: a tiny checkpoint built with make_tiny
    # (the knobs: a flag each, `main`)
    concurrency: int = knob(8, "concurrent client workers")
    seed: int = knob(0, "seed of the traffic and of the server")
    kv_cache_tokens: int = knob(1024, "server KV pool: small, for preemption")
    max_num_seqs: int = knob(4, "the server's --max-num-seqs")
    max_queued_requests: int = knob(4, "the server's --max-queued-requests: small, for overload (503)")
    max_request_body_bytes: int = knob(65536, "the server's --max-request-body-bytes")
    request_timeout_s: float = knob(300.0, "a request that should be answered and is not within this is lost")
    drain_s: float = knob(60.0, "after the traffic time, in-flight requests get this long before they are cut")
    burst_every_s: float = knob(10.0, "a burst of more requests than the server admits every 0.5-1 times this")
    read_timeout_s: float = knob(3.0, "the server's --request-read-timeout (stalled uploads wait this long for "
                                      "their 408)")
    idle_timeout_s: float = knob(30.0, "after the drain, the server must have nothing running or waiting within this")
    max_rss_growth_mib: float = knob(200.0, "the server's resident memory may grow this much over the run")
    server_args: list[str] = field(default_factory=list)
    server_log: Path | None = None  # default: in a temporary folder, removed after the run


@dataclass
class Limits:
    """What the driver needs to know of the server to keep valid requests valid."""

    room: int  # prompt + completion tokens one request may take: min(context length, KV pool)
    max_model_len: int
    r_max: int
    capacity: int  # sequences (a request's samples each) in flight or queued before 503
    body_limit: int
    read_timeout_s: float


@dataclass
class Attempt:
    kind: str
    outcome: str
    seconds: float
    status: int | None = None
    detail: str = ""
    prompts: int = 0  # engine requests it would make (a batch completion makes several); 0 for bad inputs


class Malformed(Exception):
    """A 2xx answer whose body or stream is not what the request asked for."""


# -- request bodies ------------------------------------------------------------------------------------------
def _words(rng: random.Random, lo: int, hi: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(rng.randint(lo, hi)))


def _max_tokens(rng: random.Random, lim: Limits) -> int:
    return min(lim.room // 4, rng.choice([rng.randint(1, 8), rng.randint(8, 48), rng.randint(48, 160)]))


def _budget(lim: Limits) -> int:
    """Bytes of prompt text (an upper bound on its tokens for byte-level tokenizers) of ordinary
    requests: a quarter of what a request may take, so that they never become too long."""
    return lim.room // 4


def _sampling(rng: random.Random, lim: Limits) -> dict[str, Any]:
    body: dict[str, Any] = {}
    t = rng.random()
    if t < 0.2:
        body["temperature"] = 0.0
    elif t < 0.8:
        body["temperature"] = round(rng.uniform(0.2, 1.5), 3)
    if rng.random() < 0.3:
        body["top_p"] = round(rng.uniform(0.05, 1.0), 3)
    if rng.random() < 0.3:
        body["top_k"] = rng.choice([-1, 1, 5, 40, 100000])
    if rng.random() < 0.15:
        body["min_p"] = round(rng.uniform(0.0, 0.3), 3)
    if rng.random() < 0.5:
        body["seed"] = rng.randrange(-2**62, 2**62)
    if rng.random() < 0.3:
        body["exit_threshold"] = round(rng.uniform(0.05, 0.95), 3)
    if rng.random() < 0.2:
        body["max_loops"] = rng.randint(1, lim.r_max)
        if rng.random() < 0.5:
            body["min_loops"] = rng.randint(1, body["max_loops"])
    if rng.random() < 0.3:
        body["ignore_eos"] = True
    if rng.random() < 0.25:
        stops = rng.sample(STOPS, rng.randint(1, 2))
        body["stop"] = stops[0] if len(stops) == 1 and rng.random() < 0.5 else stops
    return body


@dataclass
class Expect:
    """What a well-formed answer to a valid request must show."""

    chat: bool
    n: int
    max_tokens: int
    stop: list[str]
    logprobs: bool
    token_ids: bool
    usage: bool  # a final usage chunk (streams)
    r_max: int


def completion_request(rng: random.Random, lim: Limits, stream: bool, max_tokens: int | None = None,
                       prompt_ids: list[int] | None = None) -> tuple[dict[str, Any], Expect]:
    n = 1 if prompt_ids is not None or rng.random() < 0.85 else rng.randint(2, 3)
    as_ids = prompt_ids is not None or rng.random() < 0.3
    words = max(1, min(30, _budget(lim) // 10))  # a word takes at most 10 bytes with its space
    prompts: list[Any] = ([prompt_ids] if prompt_ids is not None else
                          [[rng.randint(1, 255) for _ in range(rng.randint(1, words))] if as_ids
                           else _words(rng, 1, words) for _ in range(n)])
    mt = max_tokens if max_tokens is not None else _max_tokens(rng, lim)
    body: dict[str, Any] = {"model": MODEL_NAME, "prompt": prompts[0] if n == 1 else prompts, "max_tokens": mt,
                            **_sampling(rng, lim)}
    if rng.random() < 0.3:
        body["logprobs"] = rng.randint(0, 5)
    if rng.random() < 0.3:
        body["return_token_ids"] = True
    usage = _make_stream(rng, body, stream, continuous_usage=True)
    return body, Expect(False, n, mt, _stops(body), "logprobs" in body, bool(body.get("return_token_ids")), usage,
                        lim.r_max)


def chat_request(rng: random.Random, lim: Limits, stream: bool,
                 max_tokens: int | None = None) -> tuple[dict[str, Any], Expect]:
    messages: list[dict[str, Any]] = []
    if rng.random() < 0.3:
        messages.append({"role": "system", "content": _words(rng, 2, 10)})
    for turn in range(rng.randint(0, 2)):
        messages.append({"role": "user", "content": _words(rng, 1, 12)})
        messages.append({"role": "assistant", "content": _words(rng, 1, 12) if turn % 2 else None})
    text = _words(rng, 1, 20)
    content: Any = text if rng.random() < 0.7 else [{"type": "text", "text": t} for t in text.split(" ", 1)]
    messages.append({"role": "user", "content": content})
    while len(messages) > 1 and sum(len(str(m["content"])) + 32 for m in messages) > _budget(lim):
        messages.pop(0)  # 32: a generous share of the chat template per message
    mt = max_tokens if max_tokens is not None else _max_tokens(rng, lim)
    key = "max_tokens" if rng.random() < 0.5 else "max_completion_tokens"
    body: dict[str, Any] = {"model": MODEL_NAME, "messages": messages, key: mt, **_sampling(rng, lim)}
    if rng.random() < 0.3:
        body["logprobs"] = True
        if rng.random() < 0.7:
            body["top_logprobs"] = rng.randint(0, 5)
    if rng.random() < 0.2:
        body["return_token_ids"] = True
    usage = _make_stream(rng, body, stream, continuous_usage=False)
    return body, Expect(True, 1, mt, _stops(body), bool(body.get("logprobs")), bool(body.get("return_token_ids")),
                        usage, lim.r_max)


def _make_stream(rng: random.Random, body: dict[str, Any], stream: bool, continuous_usage: bool) -> bool:
    """Make `body` a stream when asked, half of those asking for usage; returns whether usage was asked."""
    if not stream:
        return False
    body["stream"] = True
    if rng.random() >= 0.5:
        return False
    body["stream_options"] = {"include_usage": True}
    if continuous_usage:
        body["stream_options"]["continuous_usage_stats"] = rng.random() < 0.3
    return True


def _stops(body: dict[str, Any]) -> list[str]:
    stop = body.get("stop") or []
    return [stop] if isinstance(stop, str) else stop


def bad_inputs(lim: Limits) -> list[tuple[str, str, str, Any, int, str | None]]:
    """(name, method, path, body: a JSON-able value or raw bytes or None, expected status, Content-Type
    of a raw body)."""
    m = MODEL_NAME
    c = {"model": m, "prompt": "hi", "max_tokens": 4}
    h = {"model": m, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    over_kv = min(lim.room + 1, lim.max_model_len)
    cases: list[tuple[str, str, str, Any, int]] = [
        ("malformed-json", "POST", COMPLETIONS, b'{"model": "soak", "prompt": "hi",', 400),
        ("trailing-garbage", "POST", COMPLETIONS, b'{"model": "soak", "prompt": "hi"} }{', 400),
        ("json-array", "POST", COMPLETIONS, b"[1, 2, 3]", 400),
        ("json-string", "POST", CHAT, b'"hello"', 400),
        ("empty-body", "POST", COMPLETIONS, b"", 400),
        ("not-utf8", "POST", COMPLETIONS, b'\xff\xfe{"prompt": "hi"}', 400),
        ("nan-literal", "POST", COMPLETIONS, b'{"prompt": "hi", "temperature": NaN}', 400),
        ("infinity-literal", "POST", COMPLETIONS, b'{"prompt": "hi", "top_p": -Infinity}', 400),
        ("float-overflow", "POST", COMPLETIONS, b'{"prompt": "hi", "max_tokens": 1e400}', 400),
        ("deep-nesting", "POST", COMPLETIONS, b'{"prompt": ' + b"[" * 5000 + b"]" * 5000 + b"}", 400),
        ("nan-string", "POST", COMPLETIONS, {**c, "temperature": "NaN"}, 400),
        ("inf-string", "POST", COMPLETIONS, {**c, "max_tokens": "inf"}, 400),
        ("max_tokens-huge", "POST", COMPLETIONS, {**c, "max_tokens": 10**30}, 400),
        ("max_tokens-zero", "POST", COMPLETIONS, {**c, "max_tokens": 0}, 400),
        ("max_tokens-float", "POST", COMPLETIONS, {**c, "max_tokens": 4.5}, 400),
        ("max_tokens-list", "POST", COMPLETIONS, {**c, "max_tokens": [4]}, 400),  # (true is 1, as vLLM reads it)
        ("max_tokens-over-kv", "POST", COMPLETIONS, {**c, "max_tokens": over_kv}, 400),
        ("seed-beyond-int64", "POST", COMPLETIONS, {**c, "seed": 2**70}, 400),
        ("temperature-negative", "POST", COMPLETIONS, {**c, "temperature": -0.1}, 400),
        ("top_p-zero", "POST", COMPLETIONS, {**c, "top_p": 0}, 400),
        ("top_k-negative", "POST", COMPLETIONS, {**c, "top_k": -7}, 400),
        ("min_p-above-one", "POST", COMPLETIONS, {**c, "min_p": 1.5}, 400),
        ("logprobs-too-many", "POST", COMPLETIONS, {**c, "logprobs": 21}, 400),
        ("prompt-wrong-type", "POST", COMPLETIONS, {**c, "prompt": {"text": "hi"}}, 400),
        ("prompt-empty", "POST", COMPLETIONS, {**c, "prompt": ""}, 400),
        ("prompt-mixed-list", "POST", COMPLETIONS, {**c, "prompt": ["a", 1]}, 400),
        ("prompt-id-negative", "POST", COMPLETIONS, {**c, "prompt": [3, -1]}, 400),
        ("prompt-id-out-of-vocab", "POST", COMPLETIONS, {**c, "prompt": [10**9]}, 400),
        ("prompt-over-context", "POST", COMPLETIONS, {**c, "prompt": [7] * (lim.max_model_len + 1)}, 400),
        ("stop-empty", "POST", COMPLETIONS, {**c, "stop": ""}, 400),
        ("stop-wrong-type", "POST", COMPLETIONS, {**c, "stop": ["ok", 3]}, 400),
        ("known-field-wrong-type", "POST", COMPLETIONS, {**c, "temprature": 0.5, "ignore_eos": "maybe"}, 400),
        ("n-zero", "POST", COMPLETIONS, {**c, "n": 0}, 400),
        ("prompt_logprobs-too-many", "POST", COMPLETIONS, {**c, "echo": True, "prompt_logprobs": 21}, 400),
        ("frequency_penalty-above-two", "POST", COMPLETIONS, {**c, "frequency_penalty": 2.5}, 400),
        ("stream_options-without-stream", "POST", COMPLETIONS, {**c, "stream_options": {"include_usage": True}},
         400),
        ("max_loops-zero", "POST", COMPLETIONS, {**c, "max_loops": 0}, 400),
        ("max_loops-above-r_max", "POST", COMPLETIONS, {**c, "max_loops": lim.r_max + 1}, 400),
        ("min_loops-above-max_loops", "POST", COMPLETIONS, {**c, "min_loops": 2, "max_loops": 1}, 400),
        ("exit_threshold-negative", "POST", COMPLETIONS, {**c, "exit_threshold": -1}, 400),
        ("exit_policy-unknown", "POST", COMPLETIONS, {**c, "exit_policy": "whenever"}, 400),
        ("unknown-model", "POST", COMPLETIONS, {**c, "model": "not-this-one"}, 404),
        ("chat-no-messages", "POST", CHAT, {"model": m, "max_tokens": 4}, 400),
        ("chat-empty-messages", "POST", CHAT, {**h, "messages": []}, 400),
        # (a role is any non-empty string: vLLM passes unknown ones to the chat template)
        ("chat-empty-role", "POST", CHAT, {**h, "messages": [{"role": "", "content": "hi"}]}, 400),
        ("chat-content-number", "POST", CHAT, {**h, "messages": [{"role": "user", "content": 12}]}, 400),
        ("chat-image-part", "POST", CHAT,
         {**h, "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]}, 400),
        ("chat-top_logprobs-without-logprobs", "POST", CHAT, {**h, "top_logprobs": 2}, 400),
        ("chat-tools", "POST", CHAT, {**h, "tools": [{"type": "function", "function": {"name": "f"}}]}, 400),
        ("chat-max_completion_tokens-negative", "POST", CHAT, {**h, "max_completion_tokens": -3}, 400),
        ("unknown-route", "GET", "/v1/engines", None, 404),
        ("wrong-method", "GET", COMPLETIONS, None, 405),
        ("wrong-method-put", "PUT", CHAT, h, 405),
        ("body-over-limit", "POST", COMPLETIONS, {**c, "prompt": "x" * (lim.body_limit + 1)}, 413),
        ("chunked-body-over-limit", "POST", COMPLETIONS, "chunked", 413),
    ]
    raw = json.dumps(c).encode()
    return [(*case, "application/json") for case in cases] + [
        ("content-type-missing", "POST", COMPLETIONS, raw, 415, None),
        ("content-type-text", "POST", COMPLETIONS, raw, 415, "text/plain"),
        ("content-type-form", "POST", CHAT, json.dumps(h).encode(), 415, "application/x-www-form-urlencoded"),
        ("content-type-multipart", "POST", COMPLETIONS, raw, 415, "multipart/form-data; boundary=x"),
        ("content-type-json-lookalike", "POST", COMPLETIONS, raw, 415, "application/jsonp"),
    ]


def bad_request_kwargs(body: Any, content_type: str | None, over_limit: Any) -> dict[str, Any]:
    """The httpx keyword arguments that send a `bad_inputs` case's body: raw bytes, or `over_limit` for the
    "chunked" case (streamed content past the body limit), with the case's Content-Type; else its JSON, if any."""
    if body == "chunked" or isinstance(body, bytes):
        return {"content": over_limit if body == "chunked" else body,
                "headers": {"Content-Type": content_type} if content_type else {}}
    return {} if body is None else {"json": body}


# -- answer checks -------------------------------------------------------------------------------------------
def _need(ok: bool, what: str) -> None:
    if not ok:
        raise Malformed(what)


def _check_choice_tokens(ch: dict[str, Any], n_tokens: int, text: str, exp: Expect, where: str) -> None:
    reason = ch.get("finish_reason")
    _need(reason in ("stop", "length"), f"{where}: finish_reason {reason!r}")
    _need(1 <= n_tokens <= exp.max_tokens, f"{where}: {n_tokens} tokens for max_tokens {exp.max_tokens}")
    _need(reason != "length" or n_tokens == exp.max_tokens,
          f"{where}: finish_reason length after {n_tokens} of {exp.max_tokens} tokens")
    for s in exp.stop:
        _need(s not in text, f"{where}: stop string {s!r} in the text")


def _depths(ch: dict[str, Any], exp: Expect, where: str) -> list[int]:
    d = ch.get("exit_depths")
    _need(isinstance(d, list) and all(isinstance(x, int) and 1 <= x <= exp.r_max for x in d),
          f"{where}: exit_depths {d!r}")
    return d  # type: ignore[return-value]


def check_body(body: Any, exp: Expect) -> None:
    """A non-streamed answer: raise Malformed unless it is complete and matches the request."""
    _need(isinstance(body, dict), "body is not a JSON object")
    _need(body.get("object") == ("chat.completion" if exp.chat else "text_completion"),
          f"object {body.get('object')!r}")
    choices = body.get("choices")
    _need(isinstance(choices, list) and [c.get("index") for c in choices] == list(range(exp.n)),
          f"choices {str(choices)[:200]}")
    total = 0
    for ch in choices:
        where = f"choice {ch['index']}"
        depths = _depths(ch, exp, where)
        if exp.chat:
            msg = ch.get("message") or {}
            _need(msg.get("role") == "assistant" and isinstance(msg.get("content"), str), f"{where}: message {msg!r}")
            text = msg["content"]
        else:
            text = ch.get("text")
            _need(isinstance(text, str), f"{where}: text {text!r}")
        _check_choice_tokens(ch, len(depths), text, exp, where)
        if exp.token_ids:
            _need(len(ch.get("token_ids") or []) == len(depths), f"{where}: token_ids do not match exit_depths")
        if exp.logprobs:
            lp = ch.get("logprobs") or {}
            got = len(lp.get("content") or []) if exp.chat else len(lp.get("token_logprobs") or [])
            _need(got == len(depths), f"{where}: {got} logprobs for {len(depths)} tokens")
        total += len(depths)
    usage = body.get("usage") or {}
    _need(usage.get("completion_tokens") == total and usage.get("prompt_tokens", 0) >= 1
          and usage.get("total_tokens") == usage.get("prompt_tokens", 0) + total, f"usage {usage!r}")


def check_stream(events: list[str], exp: Expect) -> None:
    """The `data:` payloads of a finished stream: raise Malformed unless complete and consistent."""
    _need(bool(events) and events[-1] == "[DONE]", "stream does not end with data: [DONE]")
    chunks = []
    for e in events[:-1]:
        try:
            chunks.append(json.loads(e))
        except json.JSONDecodeError:
            raise Malformed(f"chunk is not JSON: {e[:120]!r}") from None
    kind = "chat.completion.chunk" if exp.chat else "text_completion"
    _need(all(isinstance(ch, dict) and ch.get("object") == kind for ch in chunks), "chunk object")
    if exp.usage:
        _need(bool(chunks) and chunks[-1].get("choices") == [], "no final usage chunk")
        usage = chunks.pop()["usage"]
    if exp.chat:
        first = chunks[0]["choices"][0] if chunks and chunks[0].get("choices") else {}
        _need(first.get("delta", {}).get("role") == "assistant", "first chat chunk has no assistant role")
    texts, tokens, finished = [""] * exp.n, [0] * exp.n, [None] * exp.n
    for ch in chunks:
        for c in ch.get("choices") or []:
            i = c.get("index")
            _need(isinstance(i, int) and 0 <= i < exp.n, f"choice index {i!r}")
            _need(finished[i] is None, f"choice {i}: a chunk after its finish_reason")
            piece = (c.get("delta") or {}).get("content") if exp.chat else c.get("text")
            texts[i] += piece or ""
            if "exit_depths" in c:
                tokens[i] += len(_depths(c, exp, f"choice {i}"))
            finished[i] = c.get("finish_reason")
    for i in range(exp.n):
        _need(finished[i] is not None, f"choice {i}: stream ended without a finish_reason")
        _check_choice_tokens({"finish_reason": finished[i]}, tokens[i], texts[i], exp, f"choice {i}")
    if exp.usage:
        _need(usage.get("completion_tokens") == sum(tokens), f"usage {usage!r} for {sum(tokens)} streamed tokens")


def _sse_data(line: str) -> str | None:
    return line[len("data: "):] if line.startswith("data: ") else None


# -- raw HTTP ------------------------------------------------------------------------------------------------
def _raw_request(method: str, path: str, body: bytes, declared: int | None = None,
                 content_type: str = "application/json") -> bytes:
    length = len(body) if declared is None else declared
    return (f"{method} {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: {content_type}\r\n"
            f"Content-Length: {length}\r\nConnection: close\r\n\r\n").encode()


async def _read_response(reader: asyncio.StreamReader) -> tuple[int, dict[str, str], bytes]:
    """A whole HTTP/1.1 response on a `Connection: close` socket (Content-Length, chunked or to EOF)."""
    head = await reader.readuntil(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    status = int(lines[0].split(" ")[1])
    headers = {k.strip().lower(): v.strip() for k, v in (x.split(":", 1) for x in lines[1:] if ":" in x)}
    if "content-length" in headers:
        return status, headers, await reader.readexactly(int(headers["content-length"]))
    if headers.get("transfer-encoding", "").lower() == "chunked":
        out = b""
        while True:
            size = int((await reader.readuntil(b"\r\n")).split(b";")[0], 16)
            out += await reader.readexactly(size + 2)
            if size == 0:
                return status, headers, out[:-2]
            out = out[:-2]
    return status, headers, await reader.read()


def _reset_on_close(writer: asyncio.StreamWriter) -> None:
    """Make closing the socket send a TCP reset instead of a FIN (an abrupt client crash)."""
    sock = writer.get_extra_info("socket")
    if sock is not None:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))


# -- the traffic ---------------------------------------------------------------------------------------------
class Traffic:
    """The client side: the workers and the burster, one method per kind of attempt, and the record of
    every attempt's outcome."""

    def __init__(self, cfg: SoakConfig, lim: Limits, base_url: str, port: int) -> None:
        self.cfg, self.lim, self.port = cfg, lim, port
        self.attempts: list[Attempt] = []
        self.bad_statuses: dict[str, Counter] = {}  # case -> status (or "reset") -> count
        # keep-alive connections are dropped well before the server's 5 s keep-alive timeout, so a
        # request never goes out on a connection the server is closing at that moment
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=cfg.concurrency, keepalive_expiry=1.0)
        self.client = httpx.AsyncClient(base_url=base_url, limits=limits, timeout=httpx.Timeout(cfg.request_timeout_s))
        self.bad_cases = bad_inputs(lim)
        self.kinds: dict[str, Callable[[random.Random], Awaitable[str]]] = {
            "completion": lambda r: self._valid(r, chat=False, stream=False),
            "completion_stream": lambda r: self._valid(r, chat=False, stream=True),
            "chat": lambda r: self._valid(r, chat=True, stream=False),
            "chat_stream": lambda r: self._valid(r, chat=True, stream=True),
            "raw_completion": lambda r: self._raw_valid(r, trickle=False),
            "trickled_upload": lambda r: self._raw_valid(r, trickle=True),
            "disconnect_stream": self._disconnect_stream,
            "disconnect_upload": lambda r: self._disconnect_upload(r, before_body=False),
            "disconnect_before_body": lambda r: self._disconnect_upload(r, before_body=True),
            "client_timeout": self._client_timeout,
            "stalled_upload": self._stalled_upload,
            "bad_input": self._bad_input,
            "long": self._long,
        }

    async def run(self, deadline: float) -> None:
        """`concurrency` closed-loop workers until `deadline` (loop time), then `drain_s` for what is
        in flight; anything still running after that is cut (counted aborted)."""
        workers = [asyncio.ensure_future(self._worker(i, deadline)) for i in range(self.cfg.concurrency)]
        workers.append(asyncio.ensure_future(self._burster(deadline)))
        loop = asyncio.get_running_loop()
        _, pending = await asyncio.wait(workers, timeout=max(0.0, deadline - loop.time()) + self.cfg.drain_s)
        for w in pending:
            w.cancel()
        await asyncio.gather(*workers, return_exceptions=True)
        await self.client.aclose()

    async def _worker(self, index: int, deadline: float) -> None:
        rng = random.Random(self.cfg.seed * 1_000_003 + index)
        names, weights = list(KIND_WEIGHTS), list(KIND_WEIGHTS.values())
        # the workers share one round of every kind before drawing at random, so that a run of any length
        # sees each kind at least once
        tour = names[index::self.cfg.concurrency]
        loop = asyncio.get_running_loop()
        while loop.time() < deadline:
            kind = tour.pop(0) if tour else rng.choices(names, weights)[0]
            if await self.kinds[kind](rng) == REJECTED:
                await asyncio.sleep(rng.uniform(0.5, 1.5))  # as Retry-After (1 s) asks, give or take

    async def _burster(self, deadline: float) -> None:
        """Overload on a clock rather than by weight, so that even a short run sees it."""
        rng = random.Random(self.cfg.seed * 1_000_003 - 1)
        loop = asyncio.get_running_loop()
        while True:
            delay = self.cfg.burst_every_s * rng.uniform(0.5, 1.0)
            if loop.time() + delay >= deadline:
                return
            await asyncio.sleep(delay)
            await self._burst(rng)

    # -- recording --------------------------------------------------------------------------------------
    async def _attempt(self, kind: str, fn: Callable[[], Awaitable[tuple[str, int | None, str]]],
                       prompts: int = 0) -> str:
        """Run one request with the overall request timeout; record and return its outcome."""
        t0 = time.monotonic()
        limit = self.cfg.request_timeout_s
        try:
            outcome, status, detail = await asyncio.wait_for(fn(), limit)
        except TimeoutError:
            outcome, status, detail = LOST, None, f"no complete answer within {limit:g} s"
        except asyncio.CancelledError:
            self.attempts.append(Attempt(kind, ABORTED, time.monotonic() - t0, None, "cut at the end of the run",
                                         prompts))
            raise
        except (httpx.TransportError, OSError, asyncio.IncompleteReadError, ValueError) as e:
            outcome, status, detail = LOST, None, f"{type(e).__name__}: {e}"
        self.attempts.append(Attempt(kind, outcome, time.monotonic() - t0, status, detail[:300], prompts))
        return outcome

    def _judge(self, r: httpx.Response, exp: Expect, note: str = "") -> tuple[str, int | None, str]:
        """Outcome of a non-streamed answer: its status first, then its body against what was asked."""
        bad = self._status_outcome(r.status_code, r.headers, r.text)
        if bad is not None:
            return bad[0], r.status_code, bad[1]
        try:
            check_body(r.json(), exp)
        except (Malformed, json.JSONDecodeError, KeyError, TypeError, AttributeError) as e:
            return LOST, r.status_code, f"malformed body: {e}"
        return SERVED, r.status_code, note

    @staticmethod
    def _status_outcome(status: int, headers: Any, text: str) -> tuple[str, str] | None:
        """The outcome of a valid request's non-2xx answer; None for 2xx."""
        if 200 <= status < 300:
            return None
        if status == 503 and headers.get("retry-after"):
            return REJECTED, ""
        if status >= 500:
            return SERVER_ERROR, text[:300]
        if 400 <= status < 500:
            return UNEXPECTED_4XX, text[:300]
        return LOST, f"status {status}"

    def _not_ok(self, status: int, headers: Any, text: str) -> tuple[str, int, str]:
        """The outcome of a valid request answered other than 200 (a stream always needs 200)."""
        outcome, detail = self._status_outcome(status, headers, text) or (LOST, f"status {status}: {text[:200]}")
        return outcome, status, detail

    # -- valid requests ---------------------------------------------------------------------------------
    def _make(self, rng: random.Random, chat: bool, stream: bool, **kw: Any) -> tuple[dict[str, Any], Expect]:
        return (chat_request if chat else completion_request)(rng, self.lim, stream, **kw)

    async def _valid(self, rng: random.Random, chat: bool, stream: bool, kind: str | None = None,
                     **kw: Any) -> str:
        body, exp = self._make(rng, chat, stream, **kw)
        path = CHAT if chat else COMPLETIONS
        kind = kind or ("chat" if chat else "completion") + ("_stream" if stream else "")

        async def plain() -> tuple[str, int | None, str]:
            return self._judge(await self.client.post(path, json=body), exp)

        async def streamed() -> tuple[str, int | None, str]:
            async with self.client.stream("POST", path, json=body) as r:
                if r.status_code != 200:
                    return self._not_ok(r.status_code, r.headers, (await r.aread()).decode(errors="replace"))
                events = [d async for line in r.aiter_lines() if (d := _sse_data(line)) is not None]
            try:
                check_stream(events, exp)
            except (Malformed, KeyError, TypeError, AttributeError, IndexError) as e:
                return LOST, 200, f"bad stream: {e}"
            return SERVED, 200, ""

        return await self._attempt(kind, streamed if stream else plain, exp.n)

    async def _long(self, rng: random.Random) -> str:
        """A token-id prompt and max_tokens that together take up to the whole KV pool (or context)."""
        room = self.lim.room
        prompt_len = rng.randint(max(1, room // 8), room // 2)
        if rng.random() < 0.15:
            mt = room - prompt_len  # exactly fills the pool
        else:
            mt = rng.randint(max(1, (room - prompt_len) // 3), room - prompt_len)
        ids = [rng.randint(1, 255) for _ in range(prompt_len)]
        return await self._valid(rng, chat=False, stream=rng.random() < 0.5, kind="long", max_tokens=mt,
                                 prompt_ids=ids)

    async def _burst(self, rng: random.Random) -> None:
        """More short requests at once than the server admits: some must be rejected."""
        n = self.lim.capacity + rng.randint(1, 4)
        seeds = [rng.randrange(2**31) for _ in range(n)]
        await asyncio.gather(*(self._valid(random.Random(s), chat=s % 4 == 0, stream=s % 3 == 0, kind="burst",
                                           max_tokens=32 + s % 32) for s in seeds))

    async def _raw_valid(self, rng: random.Random, trickle: bool) -> str:
        """A valid completion over a raw socket; `trickle` sends the body in pieces with pauses."""
        body, exp = completion_request(rng, self.lim, stream=False)
        data = json.dumps(body).encode()

        async def go() -> tuple[str, int | None, str]:
            reader, writer = await asyncio.open_connection("127.0.0.1", self.port)
            try:
                writer.write(_raw_request("POST", COMPLETIONS, data, content_type=rng.choice(JSON_TYPES)))
                if trickle:
                    cuts = sorted(rng.sample(range(1, len(data)), min(3, len(data) - 1)))
                    for a, b in zip([0, *cuts], [*cuts, len(data)], strict=True):
                        writer.write(data[a:b])
                        await writer.drain()
                        await asyncio.sleep(rng.uniform(0.01, 0.3))
                else:
                    writer.write(data)
                await writer.drain()
                status, headers, raw = await _read_response(reader)
            finally:
                writer.close()
            bad = self._status_outcome(status, headers, raw.decode(errors="replace"))
            if bad is not None:
                return bad[0], status, bad[1]
            try:
                check_body(json.loads(raw), exp)
            except (Malformed, json.JSONDecodeError, KeyError, TypeError, AttributeError) as e:
                return LOST, status, f"malformed body: {e}"
            return SERVED, status, ""

        return await self._attempt("trickled_upload" if trickle else "raw_completion", go, exp.n)

    # -- the client goes away ---------------------------------------------------------------------------
    async def _disconnect_stream(self, rng: random.Random) -> str:
        """Read a few chunks of a long stream, then close the connection."""
        chat = rng.random() < 0.4
        half = self.lim.room // 2
        mt = rng.randint(min(256, half), half)
        body, exp = self._make(rng, chat, stream=True, max_tokens=mt)
        body["ignore_eos"] = True
        body.pop("stop", None)
        exp.stop = []
        keep = rng.randint(1, 5)

        async def go() -> tuple[str, int | None, str]:
            async with self.client.stream("POST", CHAT if chat else COMPLETIONS, json=body) as r:
                if r.status_code != 200:
                    return self._not_ok(r.status_code, r.headers, (await r.aread()).decode(errors="replace"))
                events: list[str] = []
                async for line in r.aiter_lines():
                    d = _sse_data(line)
                    if d is not None:
                        events.append(d)
                        if len(events) >= keep and d != "[DONE]":
                            return ABORTED, 200, f"closed after {len(events)} chunks"
            try:
                check_stream(events, exp)
            except (Malformed, KeyError, TypeError, AttributeError, IndexError) as e:
                return LOST, 200, f"bad stream: {e}"
            return SERVED, 200, "finished before the client closed"

        return await self._attempt("disconnect_stream", go, exp.n)

    async def _disconnect_upload(self, rng: random.Random, before_body: bool) -> str:
        """Declare a body with Content-Length, send none or half of it, and close (FIN or reset)."""
        body, _ = completion_request(rng, self.lim, stream=rng.random() < 0.5)
        data = json.dumps(body).encode()
        sent = b"" if before_body else data[: max(1, len(data) // 2)]
        reset = rng.random() < 0.5

        async def go() -> tuple[str, int | None, str]:
            _, writer = await asyncio.open_connection("127.0.0.1", self.port)
            writer.write(_raw_request("POST", rng.choice([COMPLETIONS, CHAT]), b"", declared=len(data)) + sent)
            await writer.drain()
            await asyncio.sleep(rng.uniform(0.0, 0.2))
            if reset:
                _reset_on_close(writer)
            writer.close()
            return ABORTED, None, f"sent {len(sent)} of {len(data)} body bytes, then {'reset' if reset else 'closed'}"

        return await self._attempt("disconnect_before_body" if before_body else "disconnect_upload", go)

    async def _client_timeout(self, rng: random.Random) -> str:
        """A long non-streamed request the client stops waiting for after a short read timeout."""
        half = self.lim.room // 2
        mt = rng.randint(min(200, half), half)
        body, exp = self._make(rng, rng.random() < 0.4, stream=False, max_tokens=mt)
        body["ignore_eos"] = True
        body.pop("stop", None)
        exp.stop = []
        read = rng.uniform(0.05, 1.5)
        path = CHAT if exp.chat else COMPLETIONS

        async def go() -> tuple[str, int | None, str]:
            try:
                r = await self.client.post(path, json=body, timeout=httpx.Timeout(self.cfg.request_timeout_s,
                                                                                  read=read))
            except httpx.ReadTimeout:
                return ABORTED, None, f"client read timeout {read:.2f} s"
            return self._judge(r, exp, "answered before the client timeout")

        return await self._attempt("client_timeout", go, exp.n)

    async def _stalled_upload(self, rng: random.Random) -> str:
        """Declare a body, send half of it and stall: the server must answer 408 after its read timeout."""
        body, _ = completion_request(rng, self.lim, stream=False)
        data = json.dumps(body).encode()

        async def go() -> tuple[str, int | None, str]:
            reader, writer = await asyncio.open_connection("127.0.0.1", self.port)
            try:
                writer.write(_raw_request("POST", COMPLETIONS, b"", declared=len(data)) + data[: len(data) // 2])
                await writer.drain()
                t0 = time.monotonic()
                status, _, raw = await _read_response(reader)
                waited = time.monotonic() - t0
            finally:
                writer.close()
            if status == 408:
                early = waited < self.lim.read_timeout_s * 0.9
                return CLIENT_ERROR, status, f"stalled upload: 408 after only {waited:.2f} s" if early else ""
            if 400 <= status < 500:
                return CLIENT_ERROR, status, f"stalled upload: {status}, expected 408"
            if status >= 500:
                return SERVER_ERROR, status, raw.decode(errors="replace")[:200]
            return BAD_ACCEPTED, status, "an incomplete body was answered"

        return await self._attempt("stalled_upload", go)

    # -- bad inputs -------------------------------------------------------------------------------------
    async def _bad_input(self, rng: random.Random) -> str:
        name, method, path, body, want, content_type = rng.choice(self.bad_cases)

        async def chunks():
            for _ in range(self.lim.body_limit // 4096 + 2):
                yield b" " * 4096

        async def go() -> tuple[str, int | None, str]:
            kw = bad_request_kwargs(body, content_type, chunks())
            seen = self.bad_statuses.setdefault(name, Counter())
            try:
                r = await self.client.request(method, path, **kw)
            except httpx.TransportError:
                if want != 413:
                    raise
                # The server refuses an over-limit body without reading the rest of it and closes the
                # connection; the reset that a close with unread data sends can overtake the 413 (a
                # server issue: docs/reliability.md). Reported, not counted as lost.
                seen["reset"] += 1
                return CLIENT_ERROR, None, f"{name}: connection reset instead of the 413"
            s = r.status_code
            seen[str(s)] += 1
            if 400 <= s < 500:
                return CLIENT_ERROR, s, "" if s == want else f"{name}: {s}, expected {want}"
            if s == 503 and r.headers.get("retry-after"):
                return REJECTED, s, name
            if s >= 500:
                return SERVER_ERROR, s, f"{name}: {r.text[:200]}"
            if 200 <= s < 300:
                return BAD_ACCEPTED, s, name
            return LOST, s, f"{name}: status {s}"

        return await self._attempt("bad_input", go)


# -- the server ----------------------------------------------------------------------------------------------
def rss_mib(pid: int, field: str = "VmRSS") -> float | None:
    """Resident set size of a process (Linux /proc; VmHWM: its peak), MiB."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024
    except OSError:
        return None
    return None


def scrape(base_url: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """/metrics as {(sample name, sorted labels without model_name): value}."""
    text = httpx.get(base_url + "/metrics", timeout=10).text
    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            labels = tuple(sorted((k, v) for k, v in s.labels.items() if k != "model_name"))
            out[(s.name, labels)] = s.value
    return out


def _metric(m: dict, name: str, **labels: str) -> float:
    want = tuple(sorted(labels.items()))
    return sum(v for (n, lab), v in m.items() if n == name and all(x in lab for x in want))


def start_server(cfg: SoakConfig, model: Path, log: Path) -> tuple[subprocess.Popen, str, int]:
    """`loopserve serve` on a free loopback port, healthy (a few tries if a port is taken meanwhile)."""
    for _ in range(3):
        port = free_port()
        cmd = [sys.executable, "-m", "loopserve.cli", "serve", "--model", str(model), "--host", "127.0.0.1",
               "--port", str(port), "--served-model-name", MODEL_NAME, "--dtype", "float32",
               "--seed", str(cfg.seed), "--kv-cache-tokens", str(cfg.kv_cache_tokens),
               "--max-num-seqs", str(cfg.max_num_seqs), "--max-queued-requests", str(cfg.max_queued_requests),
               "--max-request-body-bytes", str(cfg.max_request_body_bytes),
               "--request-read-timeout", str(cfg.read_timeout_s),
               "--log-level", "info", *cfg.server_args]
        # one intra-op thread: a small model's ops are too small to split, and on a shared machine
        # torch's thread pool spins instead of working
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        with open(log, "w") as f:
            proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=env)
        url = f"http://127.0.0.1:{port}"
        try:
            wait_healthy(url, proc=proc)
            return proc, url, port
        except (RuntimeError, TimeoutError):
            pass
        if proc.poll() is None:
            proc.kill()
        proc.wait()
        if "address already in use" not in log.read_text().lower():
            break
    raise RuntimeError(f"the server did not start; its log ({log}):\n{log.read_text()[-3000:]}")


def stop_server(proc: subprocess.Popen, timeout_s: float = 90.0) -> tuple[int | None, float]:
    """SIGTERM; (exit code or None if it had to be killed, seconds to exit)."""
    t0 = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    try:
        code: int | None = proc.wait(timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        code = None
    return code, time.monotonic() - t0


def git_state() -> dict[str, Any] | None:
    """The commit of the code under test and its uncommitted changes (the server runs the working tree)."""
    root = Path(__file__).resolve().parents[2]
    try:
        head = subprocess.run(["git", "-C", str(root), "rev-parse", "--short", "HEAD"], capture_output=True,
                              text=True, timeout=10, check=True).stdout.strip()
        status = subprocess.run(["git", "-C", str(root), "status", "--porcelain", "--", "loopserve"],
                                capture_output=True, text=True, timeout=10, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    return {"head": head, "uncommitted": [line[3:] for line in status.splitlines()]}


def scan_log(text: str) -> dict[str, Any]:
    lines = text.splitlines()
    tracebacks = [ln for ln in lines if "Traceback" in ln]
    http_500 = [ln for ln in lines if re.search(r'" 500 ', ln) or "Internal Server Error" in ln]
    errors = [ln for ln in lines if re.match(r"(ERROR|CRITICAL)\b", ln)]
    first_tb = ""
    if tracebacks:
        i = lines.index(tracebacks[0])
        first_tb = "\n".join(lines[max(0, i - 2): i + 40])
    return {"lines": len(lines), "tracebacks": len(tracebacks), "http_500_lines": len(http_500),
            "error_lines": len(errors), "examples": (http_500 + errors)[:10], "first_traceback": first_tb}


def wait_idle(base_url: str, timeout_s: float) -> tuple[bool, float, dict]:
    """Poll /metrics until nothing runs or waits; (reached, seconds, last scrape)."""
    t0 = time.monotonic()
    while True:
        m = scrape(base_url)
        busy = _metric(m, "loopserve:num_requests_running") + _metric(m, "loopserve:num_requests_waiting")
        if busy == 0:
            return True, time.monotonic() - t0, m
        if time.monotonic() - t0 > timeout_s:
            return False, time.monotonic() - t0, m
        time.sleep(0.2)


def server_figures(before: dict, after: dict) -> dict[str, Any]:
    def delta(name: str, **labels: str) -> int:
        return round(_metric(after, name, **labels) - _metric(before, name, **labels))

    reasons = sorted({str(dict(lab)["finished_reason"]) for (n, lab) in after
                      if n == "loopserve:request_success_total" and "finished_reason" in dict(lab)})
    return {"finished": {r: delta("loopserve:request_success_total", finished_reason=r) for r in reasons},
            "rejected_overload": delta("loopserve:request_rejected_total", reason="overload"),
            "preemptions": delta("loopserve:num_preemptions_total"), "swap_ins": delta("loopserve:swap_ins_total"),
            "prompt_tokens": delta("loopserve:prompt_tokens_total"),
            "generation_tokens": delta("loopserve:generation_tokens_total")}


def final_probe(base_url: str, lim: Limits) -> str:
    """One short request once idle: the server must still serve ('' when it does)."""
    try:
        r = httpx.post(base_url + COMPLETIONS, json={"model": MODEL_NAME, "prompt": "still there", "max_tokens": 4},
                       timeout=60)
        check_body(r.json(), Expect(False, 1, 4, [], False, False, False, lim.r_max))
        return "" if r.status_code == 200 else f"status {r.status_code}"
    except (httpx.HTTPError, Malformed, json.JSONDecodeError, KeyError, TypeError) as e:
        return f"{type(e).__name__}: {e}"


# -- the run -------------------------------------------------------------------------------------------------
def _percentiles(xs: list[float]) -> dict[str, float] | None:
    if not xs:
        return None
    s = sorted(xs)
    return {"p50": round(s[len(s) // 2], 3), "p99": round(s[min(len(s) - 1, int(0.99 * len(s)))], 3),
            "max": round(s[-1], 3)}


async def _drive(cfg: SoakConfig, lim: Limits, base_url: str, port: int, pid: int,
                 rss: dict[str, Any]) -> tuple[Traffic, float]:
    loop = asyncio.get_running_loop()
    t0 = loop.time()
    traffic = Traffic(cfg, lim, base_url, port)
    warmup = max(0.1 * cfg.duration_s, min(20.0, 0.5 * cfg.duration_s))

    async def sample_rss() -> None:
        step = max(1.0, min(30.0, cfg.duration_s / 60))
        while True:
            now = loop.time() - t0
            value = rss_mib(pid)
            if value is not None:
                rss["samples"].append([round(now, 1), round(value, 1)])
                if rss["after_warmup"] is None and now >= warmup:
                    rss["after_warmup"], rss["warmup_at_s"] = round(value, 1), round(now, 1)
            await asyncio.sleep(step)

    sampler = asyncio.ensure_future(sample_rss())
    try:
        await traffic.run(t0 + cfg.duration_s)
    finally:
        sampler.cancel()
    return traffic, loop.time() - t0


def run_soak(cfg: SoakConfig) -> dict[str, Any]:
    """The whole soak; returns the report (its "ok" says whether every check passed)."""
    started = datetime.datetime.now(datetime.UTC)
    source = git_state()  # what the server is about to import; the tree may change during a long run
    with tempfile.TemporaryDirectory(prefix="loopserve-soak-") as tmp:
        model = cfg.model
        if model is None:
            from loopserve_lab.tiny import TinySpec, make_tiny

            model = make_tiny(Path(tmp) / "tiny", TinySpec(arch="ouro", seed=cfg.seed))
        log = cfg.server_log or Path(tmp) / "server.log"
        proc, base_url, port = start_server(cfg, model, log)
        try:
            info = httpx.get(base_url + "/v1/models", timeout=10).json()["data"][0]
            max_len, r_max = int(info["max_model_len"]), int(info["r_max"])
            lim = Limits(room=min(max_len, cfg.kv_cache_tokens), max_model_len=max_len, r_max=r_max,
                         capacity=cfg.max_num_seqs + cfg.max_queued_requests, body_limit=cfg.max_request_body_bytes,
                         read_timeout_s=cfg.read_timeout_s)
            before = scrape(base_url)
            rss: dict[str, Any] = {"after_warmup": None, "warmup_at_s": None, "samples": []}
            traffic, traffic_s = asyncio.run(_drive(cfg, lim, base_url, port, proc.pid, rss))
            idle, idle_s, after = wait_idle(base_url, cfg.idle_timeout_s)
            kv_after_idle = _metric(after, "loopserve:kv_cache_usage_perc")
            probe = final_probe(base_url, lim)
            rss_end, rss_peak = rss_mib(proc.pid), rss_mib(proc.pid, "VmHWM")
        finally:
            exit_code, shutdown_s = stop_server(proc)
        log_scan = scan_log(log.read_text(errors="replace"))

    counts = Counter(a.outcome for a in traffic.attempts)
    by_kind: dict[str, dict[str, int]] = {}
    for a in traffic.attempts:
        by_kind.setdefault(a.kind, {}).setdefault(a.outcome, 0)
        by_kind[a.kind][a.outcome] += 1
    failures = [asdict(a) for a in traffic.attempts if a.outcome in MUST_BE_ZERO][:50]
    mismatches = Counter(a.detail for a in traffic.attempts if a.outcome == CLIENT_ERROR and a.detail)
    growth = None if rss_end is None or rss["after_warmup"] is None else round(rss_end - rss["after_warmup"], 1)
    figures = server_figures(before, after)
    # engine requests the client cut after sending them (uploads cut halfway never reach the engine):
    # the server aborts each of them, unless it finished before the server saw the client go
    cut_after_upload = sum(a.prompts for a in traffic.attempts if a.outcome == ABORTED)
    checks = {
        **{f"{k} == 0": counts.get(k, 0) == 0 for k in MUST_BE_ZERO},
        "served > 0": counts.get(SERVED, 0) > 0,
        "idle within the idle timeout": idle,
        "kv_cache_usage_perc == 0 once idle": idle and kv_after_idle == 0,
        "final request served": probe == "",
        "log: no tracebacks": log_scan["tracebacks"] == 0,
        "log: no HTTP 500": log_scan["http_500_lines"] == 0,
        "log: no ERROR lines": log_scan["error_lines"] == 0,
        "server exit code 0 after SIGTERM": exit_code == 0,
        f"RSS growth <= {cfg.max_rss_growth_mib:g} MiB": growth is None or growth <= cfg.max_rss_growth_mib,
    }
    return {
        "started_utc": started.isoformat(timespec="seconds"),
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version()},
        "source": source,
        "config": {**{k: (str(v) if isinstance(v, Path) else v) for k, v in asdict(cfg).items()},
                   "model": str(cfg.model) if cfg.model else "make_tiny (ouro, random weights)",
                   "max_model_len": lim.max_model_len, "r_max": lim.r_max, "capacity": lim.capacity},
        "traffic_s": round(traffic_s, 1),
        "attempts": len(traffic.attempts),
        "outcomes": {k: counts.get(k, 0) for k in OUTCOMES},
        "by_kind": dict(sorted(by_kind.items())),
        "served_latency_s": {k: _percentiles([a.seconds for a in traffic.attempts if a.kind == k
                                              and a.outcome == SERVED]) for k in sorted(by_kind)},
        "client_cut_after_upload": cut_after_upload,
        "server": figures,
        "bad_input_statuses": {k: dict(sorted(v.items())) for k, v in sorted(traffic.bad_statuses.items())},
        "client_error_mismatches": dict(sorted(mismatches.items())),
        "idle": {"reached": idle, "wait_s": round(idle_s, 2), "kv_cache_usage_perc": kv_after_idle},
        "final_request": probe or "served",
        "rss_mib": {"after_warmup": rss["after_warmup"], "warmup_at_s": rss["warmup_at_s"],
                    "end": None if rss_end is None else round(rss_end, 1), "growth": growth,
                    "peak": None if rss_peak is None else round(rss_peak, 1),
                    "max_growth_allowed": cfg.max_rss_growth_mib, "samples": rss["samples"]},
        "log": log_scan,
        "shutdown": {"exit_code": exit_code, "seconds": round(shutdown_s, 2)},
        "failures": failures,
        "checks": checks,
        "ok": all(checks.values()),
    }


def summary(report: dict[str, Any]) -> str:
    cfg, o, srv = report["config"], report["outcomes"], report["server"]
    rss, idle, sd, log = report["rss_mib"], report["idle"], report["shutdown"], report["log"]
    lines = [
        f"soak: {cfg['duration_s']:g} s of traffic ({report['traffic_s']:g} s with the drain), "
        f"{cfg['concurrency']} workers, model {cfg['model']}",
        f"  server: kv {cfg['kv_cache_tokens']} tokens, {cfg['max_num_seqs']} seqs + {cfg['max_queued_requests']} "
        f"queued, context {cfg['max_model_len']}, r_max {cfg['r_max']}",
        f"attempts {report['attempts']}: " + ", ".join(f"{k} {v}" for k, v in o.items()),
        "by kind:",
    ]
    for kind, c in report["by_kind"].items():
        lat = report["served_latency_s"].get(kind)
        tail = f"   served p50 {lat['p50']:.2f} s, p99 {lat['p99']:.2f} s" if lat else ""
        lines.append(f"  {kind:<24}" + ", ".join(f"{k} {v}" for k, v in sorted(c.items())) + tail)
    lines += [
        f"server: finished {srv['finished']}, rejected (overload) {srv['rejected_overload']}, "
        f"preemptions {srv['preemptions']}, swap-ins {srv['swap_ins']}, generated {srv['generation_tokens']} tokens",
        f"  client cut {report['client_cut_after_upload']} engine requests after sending them; the server aborted "
        f"{srv['finished'].get('abort', 0)}",
        f"idle: {'reached' if idle['reached'] else 'NOT reached'} after {idle['wait_s']:.1f} s, "
        f"kv_cache_usage_perc {idle['kv_cache_usage_perc']:g}; final request: {report['final_request']}",
        f"RSS: {rss['after_warmup']} MiB after warm-up ({rss['warmup_at_s']} s), {rss['end']} MiB at the end: "
        f"growth {rss['growth']} MiB (limit {rss['max_growth_allowed']:g}); peak {rss['peak']} MiB",
        f"log: {log['lines']} lines, {log['tracebacks']} tracebacks, {log['http_500_lines']} HTTP 500 lines, "
        f"{log['error_lines']} ERROR lines",
        f"shutdown: exit code {sd['exit_code']} after {sd['seconds']:.2f} s",
    ]
    if report["client_error_mismatches"]:
        lines.append("client errors not as expected (reported, not a failure): "
                     + "; ".join(f"{k} (x{n})" for k, n in report["client_error_mismatches"].items()))
    for f in report["failures"][:10]:
        lines.append(f"  FAILED {f['kind']}: {f['outcome']} (status {f['status']}) {f['detail']}")
    failed = [k for k, ok in report["checks"].items() if not ok]
    lines.append("PASS" if report["ok"] else "FAIL: " + "; ".join(failed))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    from loopserve_lab.bench.cli import HelpFormat

    p = FlagParser(prog="python -m loopserve_lab.bench.soak", description=__doc__.split("\n\n")[0],
                                formatter_class=HelpFormat)
    p.add_argument("--duration-s", type=float, required=True, help="wall time of the traffic")
    p.add_argument("--model", type=Path, default=None, help="checkpoint folder (default: a make_tiny checkpoint)")
    p.add_argument("--out", type=Path, default=None, help="write the JSON report here")
    add_config_args(p, SoakConfig, skip=("duration_s", "model", "server_args", "server_log"))
    p.add_argument("--server-log", type=Path, default=None, help="keep the server's log here")
    p.add_argument("--server-arg", action="append", default=[], metavar="ARG",
                   help="extra flag for `loopserve serve` (repeat; e.g. --server-arg=--scheduler=cb)")
    a = p.parse_args(argv)
    if a.duration_s <= 0 or a.concurrency < 1:
        p.error("--duration-s must be > 0 and --concurrency >= 1")
    cfg = SoakConfig(**{**config_kwargs(a, SoakConfig), "server_args": a.server_arg})
    command = ["python -m loopserve_lab.bench.soak", *(argv if argv is not None else sys.argv[1:])]
    report = {"command": " ".join(command), **run_soak(cfg)}
    print(summary(report), flush=True)
    if a.out is not None:
        a.out.parent.mkdir(parents=True, exist_ok=True)
        a.out.write_text(json.dumps(report, indent=1) + "\n")
        print(f"report: {a.out}")
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
