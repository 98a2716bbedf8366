"""The server's edges, against real `loopserve serve` processes: clients that disconnect at any
moment or stall while sending, SIGTERM with a stalled upload, the full path of every validation
error, JSON-only bodies, the model path kept private, the OpenAPI schema fuzzed by schemathesis,
and faults: a request the engine fails alone (its status), and an engine that dies (the process
exits non-zero). Faults are injected by a launcher script that patches the engine, then runs the
ordinary command line.

Most tests share one server on a model with a 64-token context, so that any generation a fuzzer
asks for is short.
"""

from __future__ import annotations

import asyncio
import collections
import json
import re
import select
import signal
import socket
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from schemathesis import GenerationMode
from schemathesis.checks import (
    content_type_conformance,
    not_a_server_error,
    response_schema_conformance,
    status_code_conformance,
)

from loopserve.sampling_params import MAX_EXIT_TRACE, MAX_STOP
from loopserve.serve.api import GENERATION_PATHS, HEALTH_PATHS
from loopserve.serve.protocol import (
    ApiError,
    ChatCompletionRequest,
    CompletionRequest,
    error_body,
    parse_body,
    sampling_params,
)
from loopserve.serve.responses import StreamFailed, _error_event_on_failure, sse
from loopserve_lab.tiny import TinySpec, make_tiny
from tests.server_helpers import MODEL, Server, run_server, sse_events, wait_idle

pytestmark = pytest.mark.timeout(120)

C, H = "/v1/completions", "/v1/chat/completions"
CONTEXT = 64  # the shared server's model: max_position
READ_TIMEOUT = 1.5  # the shared server's --request-read-timeout
BODY_LIMIT = 65536  # the shared server's --max-request-body-bytes


# -- fixtures and raw-socket helpers ------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def short_path(tmp_path_factory) -> Path:
    return make_tiny(tmp_path_factory.mktemp("tiny-short"), TinySpec(arch="ouro", max_position=CONTEXT, seed=3))


@pytest.fixture(scope="module")
def server(short_path, tmp_path_factory) -> Iterator[Server]:
    log = tmp_path_factory.mktemp("logs") / "edges.log"
    with run_server(short_path, log, "--request-read-timeout", str(READ_TIMEOUT), "--kv-cache-tokens", "2048",
                    "--max-request-body-bytes", str(BODY_LIMIT), "--expose-model-path", log_level="info",
                    access_log=True) as s:
        yield s


def _addr(server: Server) -> tuple[str, int]:
    host, port = server.url.removeprefix("http://").split(":")
    return host, int(port)


def _request(path: str, body: bytes, content_type: str = "application/json") -> tuple[bytes, bytes]:
    """(head, body) of a raw HTTP/1.1 POST."""
    head = (f"POST {path} HTTP/1.1\r\nHost: test\r\nContent-Type: {content_type}\r\n"
            f"Content-Length: {len(body)}\r\n\r\n").encode()
    return head, body


def _read_all(s: socket.socket) -> bytes:
    """What the server sends until it closes the connection (a reset counts as a close)."""
    data = b""
    try:
        while chunk := s.recv(65536):
            data += chunk
    except ConnectionResetError:
        pass
    return data


def _read_response(s: socket.socket) -> bytes:
    """One response on a kept-alive connection: its head, then Content-Length bytes of body (a single
    recv may return only part of it)."""
    data = b""
    while b"\r\n\r\n" not in data:
        data += s.recv(65536)
    head, _, body = data.partition(b"\r\n\r\n")
    length = int(re.search(rb"content-length: *(\d+)", head, re.I).group(1))  # type: ignore[union-attr]
    while len(body) < length:
        body += s.recv(65536)
    return head + b"\r\n\r\n" + body


def _status_and_json(raw: bytes) -> tuple[int, Any]:
    head, _, body = raw.partition(b"\r\n\r\n")
    return int(head.split(b" ", 2)[1]), json.loads(body)


def _new_log(server: Server, offset: int) -> list[str]:
    """Log lines written since `offset`, without the access lines of /metrics polls."""
    text = server.log.read_text()[offset:]
    return [line for line in text.splitlines() if "GET /metrics" not in line]


def _assert_quiet(lines: list[str]) -> None:
    text = "\n".join(lines)
    assert "Traceback" not in text and "ERROR" not in text and "Exception" not in text, text
    assert not re.search(r'" 5\d\d', text), text  # no 5xx in the access log


# -- A: clients that go away -------------------------------------------------------------------------------------
def _disconnect(server: Server, kind: str) -> int:
    """Send part of a request (or all of it, and read part of the answer), then go away; returns the local port."""
    body = json.dumps({"model": MODEL, "prompt": "going away", "max_tokens": CONTEXT - 8, "ignore_eos": True,
                       "stream": kind == "mid-stream"}).encode()
    head, body = _request(C, body)
    with socket.create_connection(_addr(server)) as s:
        if kind == "mid-head":
            s.sendall(head[: len(head) // 2])
        elif kind == "before-body":
            s.sendall(head)
        elif kind == "mid-body":
            s.sendall(head + body[: len(body) // 2])
        elif kind == "mid-body-chunked":
            chunked = head.replace(f"Content-Length: {len(body)}".encode(), b"Transfer-Encoding: chunked")
            s.sendall(chunked + f"{len(body):x}\r\n".encode() + body[:10])
        elif kind == "after-body":
            s.sendall(head + body)
        elif kind == "mid-stream":
            s.sendall(head + body)
            seen = b""
            while b"data: " not in seen:
                chunk = s.recv(4096)
                assert chunk, seen
                seen += chunk
        else:
            raise AssertionError(kind)
        time.sleep(0.1)  # the server is now waiting for the rest, or generating
        return s.getsockname()[1]


DISCONNECTS = ["mid-head", "before-body", "mid-body", "mid-body-chunked", "after-body", "mid-stream"]


def test_disconnects_at_any_moment_are_quiet(server):
    wait_idle(server)
    offset = len(server.log.read_text())
    ports = {kind: [_disconnect(server, kind) for _ in range(3)] for kind in DISCONNECTS}
    wait_idle(server)  # every aborted request has left the engine
    time.sleep(0.2)
    lines = _new_log(server, offset)
    _assert_quiet(lines)
    by_port = collections.Counter(int(m[1]) for line in lines if (m := re.search(r"127\.0\.0\.1:(\d+)", line)))
    assert sum(by_port.values()) == len(lines), "\n".join(lines)  # every line is about one of the clients
    for kind, kind_ports in ports.items():
        assert all(by_port[port] <= 1 for port in kind_ports), (kind, "\n".join(lines))
    r = httpx.post(server.url + C, json={"model": MODEL, "prompt": "still here", "max_tokens": 4, "ignore_eos": True},
                   timeout=30)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4


# -- B: clients that stall ---------------------------------------------------------------------------------------
def test_concurrent_bodies_over_the_limit_all_get_their_413(server):
    """The server reads (and drops, within bounds) the rest of an over-limit body before answering, so
    its 413 is not lost to a connection reset while the client is still sending: under concurrency,
    about 10% of chunked uploads used to get a connection error instead."""

    async def chunks():
        for _ in range(BODY_LIMIT // 4096 + 2):
            yield b" " * 4096

    async def one(client: httpx.AsyncClient, chunked: bool) -> int | str:
        kw: dict[str, Any] = ({"content": chunks(), "headers": {"Content-Type": "application/json"}} if chunked
                              else {"json": {"prompt": "x" * (BODY_LIMIT + 10), "max_tokens": 4}})
        try:
            return (await client.post(server.url + C, **kw)).status_code
        except httpx.TransportError as e:
            return type(e).__name__

    async def rounds() -> collections.Counter:
        seen: collections.Counter = collections.Counter()
        async with httpx.AsyncClient(timeout=30, limits=httpx.Limits(max_connections=None)) as client:
            for _ in range(8):
                seen.update(await asyncio.gather(*(one(client, i % 2 == 1) for i in range(20))))
        return seen

    assert asyncio.run(rounds()) == {413: 160}


def test_stalled_connections_are_closed_after_the_read_timeout(server):
    offset = len(server.log.read_text())
    # ignore_eos: the slow upload below must get both tokens (unseeded sampling may draw eos first)
    head, body = _request(C, json.dumps({"model": MODEL, "prompt": "stall", "max_tokens": 2,
                                         "ignore_eos": True}).encode())
    sockets: dict[str, list[socket.socket]] = {"idle": [], "head": [], "body": []}
    t0 = time.monotonic()
    for _ in range(4):  # several at once: none may outlive the timeout
        for kind, data in (("idle", b""), ("head", head[:30]), ("body", head + body[:5])):
            s = socket.create_connection(_addr(server))
            s.settimeout(READ_TIMEOUT + 10)
            s.sendall(data)
            sockets[kind].append(s)
    for kind, group in sockets.items():
        for s in group:
            raw = _read_all(s)
            elapsed = time.monotonic() - t0
            s.close()
            assert READ_TIMEOUT - 0.2 < elapsed < READ_TIMEOUT + 5, (kind, elapsed)
            if kind == "body":  # a request had begun: it gets an answer
                status, err = _status_and_json(raw)
                assert status == 408 and err["error"]["code"] == 408, raw
                assert err["error"]["type"] == "RequestTimeoutError"
            else:
                assert raw == b"", raw
    lines = _new_log(server, offset)
    _assert_quiet(lines)
    # one line per stalled request at most; idle ones say nothing (the periodic stats line, which earlier
    # tests' traffic may trigger inside this window, is not about these connections)
    connections = [ln for ln in lines if "Avg prompt throughput" not in ln]
    assert len(connections) <= 8, "\n".join(lines)
    # a slow but steady upload is not a stall
    with socket.create_connection(_addr(server)) as s:
        s.sendall(head)
        for i in range(0, len(body), len(body) // 3 + 1):
            time.sleep(READ_TIMEOUT * 0.6)
            s.sendall(body[i:i + len(body) // 3 + 1])
        status, out = _status_and_json(_read_response(s))
        assert status == 200 and out["usage"]["completion_tokens"] == 2


def test_a_body_that_trickles_in_is_cut_once_it_is_too_slow(server):
    """A byte every third of the read timeout never stalls, and held its connection and request task for as long
    as the client liked: a body gets BODY_TIMEOUTS read timeouts, plus its bytes at MIN_BODY_RATE, then a 408."""
    from loopserve.serve.limits import BODY_TIMEOUTS

    head, body = _request(C, json.dumps({"model": MODEL, "prompt": "trickle " * 40, "max_tokens": 2}).encode())
    with socket.create_connection(_addr(server)) as s:
        s.sendall(head)
        t0 = time.monotonic()
        for i in range(len(body)):  # (far more bytes than the deadline lets through at this pace)
            if select.select([s], [], [], READ_TIMEOUT / 3)[0]:  # answered
                break
            try:
                s.sendall(body[i:i + 1])
            except OSError:
                break
        raw = _read_all(s)
        elapsed = time.monotonic() - t0
    status, err = _status_and_json(raw)
    assert status == 408 and "too slow" in err["error"]["message"], err
    deadline = BODY_TIMEOUTS * READ_TIMEOUT
    assert deadline - 0.5 < elapsed < deadline + 2 * READ_TIMEOUT + 1, elapsed


@pytest.mark.parametrize("value", ["0", "-1", "nan", "inf"])
def test_request_read_timeout_must_be_positive(value, capsys):
    from loopserve.cli import main

    with pytest.raises(SystemExit) as exited:  # before loading anything
        main(["serve", "--model", "unused", "--request-read-timeout", value])
    assert exited.value.code == 2
    assert "--request-read-timeout: must be a number of seconds > 0" in capsys.readouterr().err


def test_sigterm_does_not_wait_for_stalled_uploads(short_path, tmp_path):
    log = tmp_path / "sigterm.log"
    with run_server(short_path, log, "--shutdown-timeout", "60", "--request-read-timeout", "60",
                    "--kv-cache-tokens", "2048", log_level="info") as server:
        head, body = _request(C, json.dumps({"model": MODEL, "prompt": "stall", "max_tokens": 2}).encode())
        uploads = [socket.create_connection(_addr(server)) for _ in range(2)]
        for s in uploads:
            s.settimeout(20)
            s.sendall(head + body[:5])
        half_head = socket.create_connection(_addr(server))
        half_head.settimeout(20)
        half_head.sendall(head[:30])
        time.sleep(0.5)  # the app is now waiting for the bodies
        t0 = time.monotonic()
        server.proc.send_signal(signal.SIGTERM)
        rc = server.proc.wait(20)
        elapsed = time.monotonic() - t0
        answers = [_read_all(s) for s in uploads]
        assert _read_all(half_head) == b""
    assert rc == 0, log.read_text()
    assert elapsed < 10, elapsed  # not the 60 s grace period, nor the 60 s read timeout
    for raw in answers:
        status, err = _status_and_json(raw)
        assert status == 503 and err["error"]["code"] == 503, raw
        assert b"\r\nretry-after: 5\r\n" in raw.lower(), raw  # (as the other shutdown 503s: SHUTDOWN_RETRY_AFTER_S)
    _assert_quiet(log.read_text().splitlines())


# -- C: validation errors name the field's full path -------------------------------------------------------------
# a value of the wrong type for every field (wrong as vLLM reads them too: "4" and 4.0 are 4 there, "yes" and 1 true)
WRONG_SAMPLING = {
    "model": 5, "max_tokens": "four", "n": "one", "temperature": "hot", "top_p": [1], "top_k": 1.5,
    "min_p": "zero", "seed": "seven", "stop": 5, "stop_token_ids": "1", "ignore_eos": "maybe", "skip_special_tokens": 2,
    "stream": "maybe", "stream_options": 5, "return_token_ids": "maybe", "min_loops": 1.5, "max_loops": "two",
    "exit_threshold": "half", "exit_policy": 5, "exit_trace": 5, "num_speculative_tokens": "one", "user": 5,
    "metadata": [1], "store": "maybe", "service_tier": 5, "frequency_penalty": "zero", "presence_penalty": "zero",
    "repetition_penalty": "one", "logit_bias": [1], "min_tokens": "one", "include_stop_str_in_output": "maybe",
    "truncate_prompt_tokens": 1.5, "response_format": [1], "guided_json": 5, "guided_regex": 5, "guided_choice": "x",
    "guided_grammar": 5, "guided_whitespace_pattern": 5, "structured_outputs": [1], "prompt_logprobs": "two",
    "allowed_token_ids": "1", "bad_words": "x", "use_beam_search": "maybe", "length_penalty": "one",
    "return_tokens_as_token_ids": "maybe", "request_id": 5, "cache_salt": 5, "priority": "one", "logits_processors": 5,
    "mm_processor_kwargs": [1], "kv_transfer_params": 5, "vllm_xargs": "x", "spaces_between_special_tokens": "maybe"}
WRONG_COMPLETION = {**WRONG_SAMPLING, "prompt": 5, "logprobs": "two", "echo": "maybe", "suffix": 5, "best_of": "one",
                    "add_special_tokens": "maybe"}
WRONG_CHAT = {**WRONG_SAMPLING, "messages": 5, "max_completion_tokens": "four", "logprobs": 2, "top_logprobs": "two",
              "add_generation_prompt": "maybe", "tools": "x", "tool_choice": 5, "parallel_tool_calls": "maybe",
              "chat_template_kwargs": [1], "echo": "maybe", "continue_final_message": "maybe", "chat_template": 5,
              "add_special_tokens": "maybe", "documents": 5, "reasoning_effort": "extreme",
              "include_reasoning": "maybe"}
ANY_VALUE = {"prompt_embeds"}  # fields any JSON value is valid for (to be refused by name)
GOOD_C = {"model": MODEL, "prompt": "hi", "max_tokens": 2}
GOOD_H = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}


def _user(content: Any, **extra: Any) -> dict:
    return {"messages": [{"role": "user", "content": content, **extra}]}


# (endpoint, fields replacing a valid body's, the expected param)
NESTED = [
    (C, {"stream": True, "stream_options": {"include_usage": "maybe"}}, "stream_options.include_usage"),
    (C, {"stream": True, "stream_options": {"continuous_usage_stats": 2}}, "stream_options.continuous_usage_stats"),
    (C, {"prompt": ["a", 1]}, "prompt.1"),
    (C, {"prompt": [[1, "a"]]}, "prompt.0.1"),
    (C, {"stop": ["a", 5]}, "stop.1"),
    (C, {"stop_token_ids": [1, "two"]}, "stop_token_ids.1"),
    (C, {"exit_trace": [2, 2.5]}, "exit_trace.1"),
    (C, {"logit_bias": {"17": "x"}}, "logit_bias.17"),
    (H, _user(5), "messages.0.content"),
    (H, {"messages": [{"role": 5, "content": "hi"}]}, "messages.0.role"),
    (H, {"messages": [{"content": "hi"}]}, "messages.0.role"),
    (H, {"messages": [{"role": "user", "content": "hi"}, {"role": "", "content": "x"}]}, "messages.1.role"),
    (H, _user("hi", name=5), "messages.0.name"),
    (H, _user([{"type": "text", "text": 5}]), "messages.0.content.0.text"),
    (H, _user([{"type": "image_url", "image_url": {"url": "x"}}]), "messages.0.content.0.type"),
    (H, {"stream": True, "stream_options": {"include_usage": "maybe"}}, "stream_options.include_usage"),
    (H, {"tools": [{"type": "function", "function": {"name": 5}}]}, "tools.0.function.name"),
    (H, {"tool_choice": {"type": "function", "function": {"name": 5}}}, "tool_choice.function.name"),
    (C, {"response_format": {"type": "json_schema", "json_schema": {"name": 5}}}, "response_format.json_schema.name"),
]
# values of the right type that the engine cannot take
VALUES = [
    (C, {"stop": [f"s{i}" for i in range(MAX_STOP + 1)]}, "stop"),  # each is searched after every token
    (H, {"stop": [f"s{i}" for i in range(MAX_STOP + 1)]}, "stop"),
    (H, {"max_completion_tokens": 0}, "max_completion_tokens"),  # named as given (it used to say max_tokens)
    (H, {"max_completion_tokens": CONTEXT}, "max_completion_tokens"),  # past the context: named as given too
    (H, {"max_tokens": 0}, "max_tokens"),
    (C, {"prompt": [[1], []]}, "prompt.1"),  # one of a batch: named by its index
    (C, {"prompt": [[1], [3, 10**6]]}, "prompt.1"),  # a token outside the vocabulary
    (C, {"prompt": [3, 10**6]}, "prompt"),
    # contradictory or ignored inputs
    (C, {"exit_policy": "trace"}, "exit_trace"),  # nothing to replay (it ran at full depth)
    (C, {"exit_trace": [1, 100]}, "exit_trace.1"),  # past r_max, as max_loops is (it was clamped)
]


def test_an_exit_trace_longer_than_any_output_is_a_400():
    """Past `MAX_EXIT_TRACE` depths (a body over the shared server's limit, so checked where the server makes the
    request's params): a 400 naming exit_trace, no longer each entry checked in Python for every prompt."""
    req = parse_body(CompletionRequest, json.dumps({**GOOD_C, "exit_trace": [1] * (MAX_EXIT_TRACE + 1)}).encode())
    with pytest.raises(ApiError) as e:
        sampling_params(req, max_tokens=4, logprobs=None, defaults={})
    assert (e.value.status, e.value.param) == (400, "exit_trace") and "at most" in e.value.message, e.value


def test_a_long_mixed_prompt_list_is_one_error():
    """Every member of the prompt's union reported each item it failed on (300k token ids and a text: 600k errors,
    11 s of the event loop to describe); now the list is refused at its first odd item, as one error."""
    from pydantic import ValidationError

    body = json.dumps({"model": MODEL, "prompt": [7] * 300_000 + ["x"]})
    with pytest.raises(ValidationError) as e:
        CompletionRequest.model_validate_json(body)
    assert e.value.error_count() == 1
    with pytest.raises(ApiError) as err:
        parse_body(CompletionRequest, body.encode())
    assert (err.value.message, err.value.param) == ("prompt.300000: Input should be a valid integer", "prompt.300000")


@pytest.mark.parametrize("prompt, message", [
    ([1, "a"], "prompt.1: Input should be a valid integer"),  # token ids, wrong at item 1 (not "prompt.0: string")
    (["a", 1], "prompt.1: Input should be a valid string"),
    ([[1], 2], "prompt.1: Input should be a valid array"),
    ([[1], [2, "x"]], "prompt.1.1: Input should be a valid integer, unable to parse string as an integer"),
    ([1.5, 2], "prompt.0: Input should be a valid integer"),  # (a whole 2.0 would be read as 2, as vLLM reads it)
])
def test_a_mixed_prompt_list_is_named_where_it_goes_wrong(prompt, message):
    """The prompt is a union (text, texts, token ids, lists of them), each member failing on its own items: the
    error names the member that got furthest, or every member that fails at the same item."""
    with pytest.raises(ApiError) as e:
        parse_body(CompletionRequest, json.dumps({"model": MODEL, "prompt": prompt}).encode())
    assert (e.value.status, e.value.message, e.value.param) == (400, message, message.split(":")[0])


def test_token_ids_in_a_mixed_list_are_read_by_pydantics_own_rule():
    """What the lax reading takes as an integer anywhere ("1_000", "2.0", 3.0, true) is a token id in a list too: the
    list's early check asks pydantic, not a rule of its own (one of digits refused "1_000" that max_tokens took)."""
    body = {"model": MODEL, "prompt": [7, "1_000", "2.0", 3.0, True]}
    assert parse_body(CompletionRequest, json.dumps(body).encode()).prompt == [7, 1000, 2, 3, 1]


@pytest.mark.parametrize("path", [C, H])
def test_a_prompt_surely_past_the_context_is_refused_before_it_is_tokenized(server, path):
    """Tokenizing holds the GIL (a 4 MB prompt stalled every stream ~3 s): a text prompt longer than the
    context could hold even at the tokenizer's longest tokens is refused from its length ("at least"); with
    truncate_prompt_tokens it is tokenized and cut as asked."""
    text = "to be or not " * 2000
    fields = {"prompt": text} if path == C else _user(text)
    base = GOOD_C if path == C else GOOD_H
    r = httpx.post(server.url + path, json={**base, **fields}, timeout=30)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == ("prompt" if path == C else "messages") and " at least " in err["message"], err
    bad = httpx.post(server.url + path, json={**base, **fields, "truncate_prompt_tokens": -2}, timeout=30)
    assert bad.status_code == 400 and " at least " in bad.json()["error"]["message"], bad.text  # no cut: no skip
    cut = httpx.post(server.url + path, json={**base, **fields, "truncate_prompt_tokens": 8}, timeout=30)
    assert cut.status_code == 200 and cut.json()["usage"]["prompt_tokens"] == 8, cut.text
    # -1: cut to what the context leaves beside max_tokens, and run
    full = httpx.post(server.url + path, json={**base, **fields, "truncate_prompt_tokens": -1}, timeout=30)
    usage = full.json()["usage"]
    assert full.status_code == 200 and usage["prompt_tokens"] + base["max_tokens"] == CONTEXT, full.text
CASES = ([(C, {f: v}, f) for f, v in WRONG_COMPLETION.items()] + [(H, {f: v}, f) for f, v in WRONG_CHAT.items()]
         + NESTED + VALUES)


def test_values_are_read_as_vllm_reads_them(server):
    """vLLM's request models are pydantic's lax ones: a whole float or a numeric string for an integer, "true" or 1
    for a boolean, true for completions' logprobs (1) are taken as those values (each was a 400 when the types were
    strict: a client's max_tokens computed in floats, 512.0, failed on loopserve and not on vLLM)."""
    plain = httpx.post(server.url + C, json={**GOOD_C, "max_tokens": 3, "temperature": 0, "logprobs": 1}, timeout=30)
    assert plain.status_code == 200, plain.text
    for loose in ({"max_tokens": 3.0, "temperature": "0", "logprobs": True},
                  {"max_tokens": "3", "temperature": 0.0, "logprobs": "1", "echo": "false", "ignore_eos": 0}):
        r = httpx.post(server.url + C, json={**GOOD_C, **loose}, timeout=30)
        assert r.status_code == 200, (loose, r.text)
        assert r.json()["choices"][0]["logprobs"] == plain.json()["choices"][0]["logprobs"], loose
    ids = httpx.post(server.url + C, json={**GOOD_C, "prompt": [3, "4", 5.0, True], "echo": True}, timeout=30)
    text = httpx.post(server.url + "/detokenize", json={"model": MODEL, "tokens": [3, 4, 5, 1]}, timeout=30)
    assert ids.status_code == 200 and ids.json()["choices"][0]["text"].startswith(text.json()["prompt"]), ids.text
    streamed = httpx.post(server.url + C, json={**GOOD_C, "stream": "true"}, timeout=30)
    assert streamed.status_code == 200 and streamed.text.rstrip().endswith("data: [DONE]"), streamed.text


def test_wrong_type_table_covers_every_field():
    assert set(WRONG_COMPLETION) == set(CompletionRequest.model_fields) - ANY_VALUE
    assert set(WRONG_CHAT) == set(ChatCompletionRequest.model_fields) - ANY_VALUE


@pytest.mark.parametrize(("path", "fields", "param"), CASES,
                         ids=[f"{'chat' if p == H else 'cmpl'}-{param}" for p, _, param in CASES])
def test_validation_error_names_the_full_path(server, path, fields, param):
    body = {**(GOOD_C if path == C else GOOD_H), **fields}
    r = httpx.post(server.url + path, json=body, timeout=30)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param, err
    assert err["message"].startswith(f"{param}: "), err



@pytest.mark.parametrize("schema", [5, "5", [1], "{not json", "null"])
def test_guided_json_says_in_one_message_what_it_takes(server, schema):
    """A schema object, its JSON text or a boolean (valid JSON Schemas, which llguidance compiles): each
    wrong value gets the same message (a number was "Input should be a valid string", "5" llguidance's own)."""
    r = httpx.post(server.url + C, json={**GOOD_C, "guided_json": schema}, timeout=30)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == "guided_json", err
    assert err["message"].startswith("guided_json: must be a JSON schema: an object, a boolean, or the JSON text"), err


def test_guided_json_takes_a_boolean_schema(server):
    for schema in (True, "true"):
        r = httpx.post(server.url + C, json={**GOOD_C, "guided_json": schema, "max_tokens": 4}, timeout=30)
        assert r.status_code == 200, r.text
    r = httpx.post(server.url + C, json={**GOOD_C, "guided_json": False}, timeout=30)  # admits nothing
    assert r.status_code == 400 and r.json()["error"]["param"] == "guided_json", r.text


def test_a_message_may_have_no_content(server):
    """Null or left out, in any role: an empty text, as vLLM takes it (a replayed conversation sends an assistant
    turn without content; OpenAI asks for tool_calls there)."""
    call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
    for messages in ([{"role": "user", "content": "hi"}, {"role": "assistant", "content": None, "tool_calls": [call]},
                      {"role": "tool", "content": "42", "tool_call_id": "c1"}],
                     [{"role": "user", "content": "hi"}, {"role": "assistant", "content": None},
                      {"role": "user", "content": "again"}],
                     [{"role": "user", "content": "hi"}, {"role": "assistant"}],
                     [{"role": "system"}, {"role": "user", "content": None}]):
        r = httpx.post(server.url + H, json={**GOOD_H, "messages": messages}, timeout=30)
        assert r.status_code == 200, r.text


@pytest.mark.parametrize("kind", ["image_url", "input_audio", "file", "video_url", "audio_url", "image"])
def test_a_part_other_than_text_is_named_by_its_type(server, kind):
    """An image, audio, a file or a video in a message: one 400 naming the part's type (it was pydantic's union
    error, "Input should be 'text', 'input_text' or 'output_text'; or Field required; or Input should be
    'refusal'"), at chat completions and /tokenize alike, and LLM.chat says the same."""
    from loopserve.chat_messages import chat_messages

    messages = [{"role": "system", "content": "be brief"},
                {"role": "user", "content": [{"type": "text", "text": "what is this?"}, {"type": kind, kind: {}}]}]
    want = (f"messages.1.content.1.type: {kind!r} parts are not supported: this model takes text only (parts of "
            "type 'text', 'input_text', 'output_text', or an assistant's 'refusal')")
    for path in (H, "/tokenize"):
        r = httpx.post(server.url + path, json={**GOOD_H, "messages": messages}, timeout=30)
        assert r.status_code == 400, r.text
        assert r.json()["error"] == {"message": want, "type": "BadRequestError", "param": "messages.1.content.1.type",
                                     "code": 400}
    with pytest.raises(ValueError) as e:
        chat_messages(messages)
    assert str(e.value) == want


def test_tokenize_takes_one_of_prompt_or_messages(server):
    """Both: refused (the messages were used and the prompt dropped without a word). The chat form checks
    its messages as chat completions does."""
    both = {"prompt": "x", "messages": [{"role": "user", "content": "hi"}]}
    r = httpx.post(server.url + "/tokenize", json=both, timeout=30)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == "prompt" and err["message"] == "prompt: give one of prompt or messages, not both", err
    r = httpx.post(server.url + "/tokenize", json={"messages": [{"role": "", "content": "x"}]}, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages.0.role", r.text
    for one in ({"prompt": "x"}, {"prompt": "x", "messages": None}, {"prompt": None, **_user("x")}):
        assert httpx.post(server.url + "/tokenize", json=one, timeout=30).status_code == 200, one


def test_more_samples_than_resident_sequences_are_served_in_parts(server):
    """n above max_num_seqs (64 here) is served in parts of at most 64 (docs/design.md §6.6), as vLLM queues such
    samples: once it stalled the engine, then it was a 400; the server goes on."""
    r = httpx.post(server.url + C, json={**GOOD_C, "n": 65, "max_tokens": 2}, timeout=60)
    assert r.status_code == 200 and sorted(c["index"] for c in r.json()["choices"]) == list(range(65)), r.text
    ok = httpx.post(server.url + C, json={**GOOD_C, "n": 64, "max_tokens": 2}, timeout=60)
    assert ok.status_code == 200 and len(ok.json()["choices"]) == 64, ok.text


@pytest.fixture(scope="module")
def small_kv_server(short_path, tmp_path_factory) -> Iterator[Server]:
    """16 KV blocks of 16 tokens."""
    with run_server(short_path, tmp_path_factory.mktemp("logs") / "small-kv.log", "--kv-cache-tokens", "256") as s:
        yield s


@pytest.mark.parametrize("stream", [False, True])
def test_samples_that_the_kv_cache_cannot_hold_together_run_in_parts(small_kv_server, stream):
    """n samples of a prompt that the KV cache cannot hold together: the ones it holds run, then the rest, as vLLM
    runs samples as requests of their own (they were a 400 naming n). They share the prompt's full blocks: a
    60-token prompt takes 4 blocks and each other sample 1 more, so 13 samples fit in 16 blocks, 12 beside the
    safety margin's block: a part of 12, then one of 2. A prompt the cache cannot hold alone is a 400 naming the
    prompt, before any response starts."""
    body = {**GOOD_C, "prompt": [7] * 60, "max_tokens": 2, "ignore_eos": True, "stream": stream}
    ok = httpx.post(small_kv_server.url + C, json={**body, "n": 14}, timeout=60)
    assert ok.status_code == 200, ok.text
    if stream:
        finished = ok.text.replace(" ", "").count('"finish_reason":"length"')
        assert ok.text.rstrip().endswith("data: [DONE]") and finished == 14, ok.text[-2000:]
    else:
        assert [c["finish_reason"] for c in ok.json()["choices"]] == ["length"] * 14
    r = httpx.post(small_kv_server.url + C, json={**body, "prompt": [7] * 256}, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt", r.text

@pytest.fixture(scope="module")
def small_capacity_server(short_path, tmp_path_factory) -> Iterator[Server]:
    """At most 4 resident sequences and 4 more queued: a capacity of 8 sequences."""
    with run_server(short_path, tmp_path_factory.mktemp("logs") / "capacity.log", "--kv-cache-tokens", "2048",
                    "--max-num-seqs", "4", "--max-queued-requests", "4") as s:
        yield s


def test_prompts_times_n_past_the_capacity_is_a_400_naming_the_field(small_capacity_server):
    """Never admitted, however idle the server (each sample takes a place: `EngineThread`); the field is n
    unless the prompts alone are too many."""
    url = small_capacity_server.url + C
    for body, field in (({"prompt": ["a", "b", "c"], "n": 3}, "n"), ({"prompt": ["a"] * 9}, "prompt")):
        r = httpx.post(url, json={**GOOD_C, **body}, timeout=30)
        assert r.status_code == 400 and r.json()["error"]["param"] == field, r.text
        assert "9 sequences; this server holds at most 8 at once" in r.json()["error"]["message"]
    ok = httpx.post(url, json={**GOOD_C, "prompt": ["a", "b"], "n": 4}, timeout=60)
    assert ok.status_code == 200 and len(ok.json()["choices"]) == 8, ok.text


def test_capacity_counts_every_sample(tiny_ouro):
    """A request's samples each take a place (as max_num_seqs counts them): one request of 2 prompts x n = 4
    fills a capacity of 8 until it finishes (it used to count as 2, and a few such requests held every
    sequence while the server took more)."""
    from loopserve.engine.engine_thread import EngineOverloadedError, EngineThread
    from loopserve.outputs import RequestOutput
    from loopserve.sampling_params import SamplingParams
    from tests.engine_helpers import make_engine

    aengine = EngineThread(make_engine(tiny_ouro, max_num_seqs=4), max_queued_requests=4)  # (not started)
    engine = aengine.engine

    def request(rid: str, n: int):
        return engine.make_sequence(rid, [5, 6, 7], SamplingParams(max_tokens=2, n=n))

    aengine.add([request("a", 4), request("b", 4)])
    with pytest.raises(EngineOverloadedError, match=r"capacity \(8 sequences"):
        aengine.add([request("c", 1)])
    aengine._deliver([RequestOutput("a", None, [5, 6, 7], None, [], finished=True)])  # a's 4 samples leave
    aengine.add([request("c", 3), request("d", 1)])
    with pytest.raises(EngineOverloadedError):
        aengine.add([request("e", 1)])


# -- D: cross-site safety --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("content_type", [
    "text/plain", "text/plain; charset=utf-8", "application/x-www-form-urlencoded", "multipart/form-data; boundary=x",
    "application/jsonx", "text/json", "text/vnd.x+json", "application/+json", None])
@pytest.mark.parametrize("path", [C, H])
def test_post_bodies_must_be_json(server, path, content_type):
    body = json.dumps(GOOD_C if path == C else GOOD_H).encode()
    headers = {} if content_type is None else {"Content-Type": content_type}
    r = httpx.post(server.url + path, content=body, headers=headers, timeout=30)
    assert "content-type" in r.request.headers or content_type is None
    assert r.status_code == 415, r.text
    err = r.json()["error"]
    assert err["code"] == 415 and err["type"] == "UnsupportedMediaTypeError" and "application/json" in err["message"]


@pytest.mark.parametrize("content_type", ["application/json", "application/json; charset=utf-8", "Application/JSON",
                                          "application/vnd.api+json"])
def test_json_content_types_are_accepted(server, content_type):
    r = httpx.post(server.url + C, content=json.dumps(GOOD_C).encode(), headers={"Content-Type": content_type},
                   timeout=30)
    assert r.status_code == 200, r.text


def test_models_shows_the_path_only_when_asked(server, short_path):
    # this server runs with --expose-model-path; test_server.py checks the default
    assert httpx.get(server.url + "/v1/models").json()["data"][0]["root"] == str(short_path)


# -- E: the OpenAPI schema, fuzzed ---------------------------------------------------------------------------------
def test_the_generation_and_health_paths_are_the_apps_routes(server):
    """A Ray Serve replica's drain waits for (then refuses) `GENERATION_PATHS`, and answers `HEALTH_PATHS` 503
    meanwhile (serve/ray.py): SageMaker's /invocations had been left out, so a drain did not wait for it."""
    paths = httpx.get(server.url + "/openapi.json").json()["paths"]
    posts = {p for p, methods in paths.items() if "post" in methods}
    assert posts - {"/tokenize", "/detokenize", "/ping"} == set(GENERATION_PATHS)
    assert set(HEALTH_PATHS) <= set(paths)


def test_openapi_describes_the_request_bodies(server):
    schema = httpx.get(server.url + "/openapi.json").json()
    components = schema["components"]["schemas"]
    for path, model in ((C, CompletionRequest), (H, ChatCompletionRequest)):
        ref = schema["paths"][path]["post"]["requestBody"]["content"]["application/json"]["schema"]["$ref"]
        assert ref == f"#/components/schemas/{model.__name__}"
        assert set(components[model.__name__]["properties"]) == set(model.model_fields)
    assert {"StreamOptions", "ChatMessage", "TextPart"} <= set(components)
    tokenize = schema["paths"]["/tokenize"]["post"]["requestBody"]["content"]["application/json"]["schema"]["anyOf"]
    assert [ref["$ref"].rsplit("/", 1)[1] for ref in tokenize] == ["TokenizeCompletionRequest", "TokenizeChatRequest"]
    assert set(components["DetokenizeRequest"]["properties"]) == {"model", "tokens"}
    assert "/version" in schema["paths"]
    # the answers too, as vLLM documents them: streams, errors' bodies, non-JSON answers; no 422 (never sent)
    completions = schema["paths"][C]["post"]["responses"]
    assert set(completions["200"]["content"]) == {"application/json", "text/event-stream"}
    assert {"400", "404", "413", "503"} <= set(completions) and "422" not in completions
    assert completions["400"]["content"]["application/json"]["schema"] == {"$ref": "#/components/schemas/ErrorResponse"}
    assert components["ErrorResponse"]["properties"]["error"]["required"] == ["message", "type", "code"]
    assert "422" not in schema["paths"]["/v1/models/{model}"]["get"]["responses"]
    assert set(schema["paths"]["/metrics"]["get"]["responses"]["200"]["content"]) == {"text/plain"}


@pytest.mark.parametrize("mode", [GenerationMode.POSITIVE, GenerationMode.NEGATIVE], ids=lambda m: m.value)
def test_fuzzed_requests_get_no_server_error(server, mode):
    """Every operation, with inputs the schema allows and inputs it does not: never a 5xx (generations
    stay short: the model's context is 64 tokens), and every answer one /openapi.json documents: its status, its
    content type, an error's OpenAI-style body (it documented only a 200 of JSON, and a 422 never sent)."""
    schema = schemathesis.openapi.from_url(server.url + "/openapi.json")
    operations = [result.ok() for result in schema.get_all_operations()]
    assert {op.path for op in operations} >= {C, H, "/v1/models", "/health", "/metrics", "/tokenize", "/detokenize",
                                              "/version"}
    statuses: dict[str, list[int]] = {}
    for operation in operations:
        if mode is GenerationMode.NEGATIVE and not operation.body:
            continue  # no inputs to get wrong

        @settings(max_examples=30 if mode is GenerationMode.POSITIVE else 100, deadline=None, database=None,
                  derandomize=True, suppress_health_check=list(HealthCheck))
        @given(case=operation.as_strategy(generation_mode=mode))
        def fuzz(case: schemathesis.Case) -> None:
            r = case.call_and_validate(checks=[not_a_server_error, status_code_conformance, content_type_conformance,
                                               response_schema_conformance], timeout=60)
            statuses.setdefault(case.operation.label, []).append(r.status_code)

        fuzz()
    if mode is GenerationMode.POSITIVE:  # some inputs were generated through, not only rejected
        assert 200 in statuses[f"POST {C}"] + statuses[f"POST {H}"], statuses


# -- F and G: faults in the engine ----------------------------------------------------------------------------------
LAUNCHER = '''"""`loopserve` with faults injected for prompts that carry a marker (tests/test_server_edges.py)."""
import sys

from loopserve.cli import main
from loopserve.engine.engine import LLMEngine
from loopserve.engine.scheduler import Scheduler
from loopserve.engine.sequence import Sequence

step, append, add = LLMEngine.step, Sequence.append, Scheduler.add


def marked(seq, marker):
    return marker in (seq.prompt or "")


def crashing_step(self):
    if any(marked(s, "CRASH-ENGINE") for s in self.requests.values()):
        raise RuntimeError("injected engine failure")
    return step(self)


def failing_append(self, *args, **kwargs):  # a request's own part of a tick: it fails alone
    if marked(self, "FAIL-REQUEST"):
        raise RuntimeError("injected failure in this request's token bookkeeping")
    return append(self, *args, **kwargs)


def rejecting_add(self, seq):
    if marked(seq, "REJECT-REQUEST"):  # finished as the scheduler finishes a prompt that can never fit
        seq.finish("error", "prompt: rejected by the engine", error_status=400)
        self._finish(seq)
        return
    add(self, seq)


LLMEngine.step, Sequence.append, Scheduler.add = crashing_step, failing_append, rejecting_add
sys.exit(main(sys.argv[1:]))
'''


@pytest.fixture(scope="module")
def launcher(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("launcher") / "faulty_loopserve.py"
    path.write_text(LAUNCHER)
    return path


@pytest.fixture(scope="module")
def long_path(tmp_path_factory) -> Path:
    """A 2048-token context, so a stream can outlast the fault injected beside it."""
    return make_tiny(tmp_path_factory.mktemp("tiny-long"), TinySpec(arch="ouro", seed=4))


def _stream_in_background(server: Server, max_tokens: int) -> tuple[threading.Thread, threading.Event, dict]:
    """A long stream on a thread; `started` is set at its first token; `result` gets tokens, [DONE], the body of
    an error event (`failed`), the transport's error."""
    started, result = threading.Event(), {"tokens": 0, "done": False, "failed": None, "error": None}
    body = {"model": MODEL, "prompt": "a long one", "max_tokens": max_tokens, "ignore_eos": True, "stream": True}

    def run() -> None:
        try:
            with httpx.stream("POST", server.url + C, json=body, timeout=60) as r:
                for data in sse_events(r.iter_lines()):
                    chunk = json.loads(data) if data != "[DONE]" else None
                    if chunk is None:
                        result["done"] = True
                    elif "error" in chunk:
                        result["failed"] = chunk["error"]
                    else:
                        result["tokens"] += len(chunk["choices"][0]["exit_depths"])
                        started.set()
        except httpx.HTTPError as e:
            result["error"] = e
        result["ended"] = time.monotonic()
        started.set()

    t = threading.Thread(target=run)
    t.start()
    return t, started, result


def test_request_failures_carry_the_engine_status(long_path, launcher, tmp_path):
    with run_server(long_path, tmp_path / "faults.log", "--kv-cache-tokens", "4096", launcher=launcher) as server:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=60)
        t, started, result = _stream_in_background(server, 150)
        assert started.wait(30)
        r = httpx.post(server.url + C, json={"model": MODEL, "prompt": "FAIL-REQUEST now", "max_tokens": 4},
                       timeout=30)
        assert r.status_code == 500, r.text
        err = r.json()["error"]
        assert err["code"] == 500 and err["type"] == "InternalServerError"
        assert "injected failure" in err["message"]
        with pytest.raises(openai.BadRequestError) as bad:  # the engine says the input was at fault
            client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "REJECT-REQUEST"}])
        assert bad.value.status_code == 400 and "rejected by the engine" in bad.value.message
        # a stream cannot change its status once started: it sends the same error in-band, then is cut (no [DONE])
        events: list[str] = []
        with pytest.raises(httpx.HTTPError), httpx.stream("POST", server.url + C, timeout=30, json={
                "model": MODEL, "prompt": "FAIL-REQUEST streamed", "max_tokens": 4, "stream": True}) as s:
            for e in sse_events(s.iter_lines()):  # the cut raises while reading
                events.append(e)
        assert "[DONE]" not in events and json.loads(events[-1]) == {"error": err}, events
        t.join(60)
        assert result["done"] and result["tokens"] == 150 and result["error"] is None  # the neighbour is unharmed
        assert httpx.get(server.url + "/health").status_code == 200
        assert client.completions.create(model=MODEL, prompt="after", max_tokens=3,
                                        extra_body={"ignore_eos": True}).usage.completion_tokens == 3
        assert server.proc.poll() is None


def test_engine_death_fails_in_flight_requests_and_exits_nonzero(long_path, launcher, tmp_path):
    log = tmp_path / "crash.log"
    with run_server(long_path, log, "--kv-cache-tokens", "4096", launcher=launcher) as server:
        t, started, result = _stream_in_background(server, 1800)
        assert started.wait(30)
        t0 = time.monotonic()
        r = httpx.post(server.url + C, json={"model": MODEL, "prompt": "CRASH-ENGINE", "max_tokens": 4}, timeout=30)
        assert r.status_code == 503 and "injected engine failure" in r.json()["error"]["message"]
        t.join(30)
        assert not result["done"] and result["tokens"] < 1800  # the stream was cut...
        assert result["ended"] - t0 < 5  # ...at once, after its error event
        assert result["failed"]["code"] == 503 and "injected engine failure" in result["failed"]["message"]
        try:
            rc = server.proc.wait(15)
        except subprocess.TimeoutExpired:
            pytest.fail("the server kept running after its engine died")
        assert time.monotonic() - t0 < 10
    assert rc == 1, log.read_text()
    assert "error: the engine failed" in log.read_text()


@pytest.mark.parametrize("bad", ["unencodable", "raises"])
def test_a_stream_that_fails_unexpectedly_ends_with_a_500_error_event_not_a_silent_cut(bad):
    """A chunk no response can encode (a lone surrogate) or a bug raising inside a stream: its error event (500, as a
    plain response's), then the cut (`StreamFailed`); it was a cut without a word, after the server's send loop
    raised, with nothing for the client to read."""
    async def content() -> Any:
        yield sse({"a": 1})
        if bad == "raises":
            raise RuntimeError("a bug")
        yield sse({"name": "\ud83d"})

    async def read() -> tuple[list[bytes], StreamFailed]:
        chunks: list[bytes] = []
        with pytest.raises(StreamFailed) as failed:
            async for chunk in _error_event_on_failure(content()):
                chunks.append(chunk)
        return chunks, failed.value

    chunks, failed = asyncio.run(read())
    name = "RuntimeError" if bad == "raises" else "UnicodeEncodeError"
    assert chunks[0] == b'data: {"a": 1}\n\n' and failed.status == 500
    assert json.loads(chunks[1].decode().removeprefix("data: ")) == error_body(500, f"internal error: {name}")
    assert len(chunks) == 2


@pytest.mark.parametrize("body, message", [
    ({"messages": [{"role": "user", "content": [{"type": "text", "text": 1}]}, {"role": "user", "content": "hi"}, 5]},
     "messages.0.content.0.text: Input should be a valid string"),
    ({"messages": [{"role": 7, "content": "x"}, 3]}, "messages.0.role: Input should be a valid string"),
    ({"messages": [{"role": "user", "content": "hi"}], "tools": [{"type": "function"}, 3]},
     "tools.0.function: field required"),
])
def test_the_first_failing_item_is_named_not_a_later_one(body, message):
    """The failing field is found along the first error's path: a later item's shorter error (`messages.2: Input should
    be an object`) is not it."""
    with pytest.raises(ApiError) as e:
        parse_body(ChatCompletionRequest, json.dumps({"model": MODEL, **body}).encode())
    assert e.value.message.startswith(message), e.value.message


@pytest.mark.parametrize("body,message,param", [
    (b'{"model": "m", "prompt": ', "request body: malformed JSON", None),
    (b'{"model": "m", "prompt": "a", "guided_json": ' + b'{"a": ' * 300 + b"1" + b"}" * 301,
     "guided_json: nested too deeply for the JSON parser (more than 200 levels)", "guided_json"),
    # valid JSON that is not Unicode text: the field is named (the whole body was "malformed JSON", param null)
    (b'{"model": "m", "prompt": "a", "user": "\\udc00"}',
     "user: not valid Unicode text (it holds a lone surrogate, U+DC00)", "user"),
    (b'{"model": "m", "prompt": ["a", "b\\ud800c"]}', "prompt.1: not valid Unicode text", "prompt.1"),
    (b'{"model": "m", "prompt": "a", "logit_bias": {"\\ud800": 1}}', "logit_bias: a key is not valid Unicode text",
     "logit_bias"),
])
def test_a_body_the_json_parser_cannot_read_is_a_400_saying_why(server, body, message, param):
    r = httpx.post(server.url + C, content=body, headers={"Content-Type": "application/json"}, timeout=30)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["message"].startswith(message), r.json()
    assert r.json()["error"]["param"] == param, r.json()


def test_uvicorn_log_level_sets_uvicorns_loggers_alone(short_path, tmp_path):
    """vLLM's --uvicorn-log-level is uvicorn's (its "trace" too); it was --log-level's alias, so `--uvicorn-log-level
    warning` silenced the server's own log. Here the server logs at warning and uvicorn at trace."""
    log = tmp_path / "levels.log"
    with run_server(short_path, log, "--uvicorn-log-level", "trace", log_level="warning", access_log=True) as s:
        assert httpx.get(s.url + "/v1/models").status_code == 200
        wait_idle(s)
    text = log.read_text()
    assert "TRACE" in text and "GET /v1/models" in text, text[-3000:]  # (uvicorn's trace lines, its access line)
    assert not re.search(r" INFO loopserve", text), text[-3000:]  # (the server's own: at warning, no info lines)


def test_load_counts_the_generation_requests_in_flight(server, long_path, tmp_path):
    """vLLM's GET /load: {"server_load": N}, N the generation requests in flight (a stream until its last event) with
    --enable-server-load-tracking, else 0 (the flag was refused, and the endpoint a 404)."""
    assert httpx.get(server.url + "/load").json() == {"server_load": 0}
    with run_server(long_path, tmp_path / "load.log", "--kv-cache-tokens", "4096",
                    "--enable-server-load-tracking") as tracked:
        t, started, result = _stream_in_background(tracked, 300)
        assert started.wait(30)
        assert httpx.get(tracked.url + "/v1/models").status_code == 200  # (not a generation request)
        assert httpx.get(tracked.url + "/load").json() == {"server_load": 1}
        t.join(60)
        assert result["done"] and result["tokens"] == 300
        assert httpx.get(tracked.url + "/load").json() == {"server_load": 0}
