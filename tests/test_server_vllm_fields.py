"""vLLM request fields and server behaviours a probe found accepted and ignored (or done otherwise than vLLM
does them), against a real `loopserve serve` process on the tiny Huginn (whose tokenizer adds a BOS):

- /tokenize and /detokenize run off the event loop (a 4 MB prompt froze /health for seconds), on a lane of
  their own (a burst of them leaves the worker threads generation requests are built on free), and a long text
  is tokenized with the GIL released;
- `num_requests_running` and `num_requests_waiting` both count sequences (each of a request's n samples),
  as vLLM V1 does (running counted samples, waiting requests);
- completions' `add_special_tokens` (default true; false: no BOS), `return_tokens_as_token_ids`
  ("token_id:<id>" for every token string of the logprobs), `priority` and `logits_processors` (only their
  neutral values), `request_id` (the response's id unless an X-Request-Id header names one), `cache_salt`
  (requests share cached prompt blocks only with requests of the same salt), and `"model": ""` (the served
  model).

The server runs from a launcher that slows tokenizer calls on marked inputs and prints the thread each ran on and how
many ran at once (a marked text naming a gate file waits for that file instead), prints each request that asks a lane
for its turn, and gives anyio's shared worker pool POOL_THREADS threads (its default is 40, which a test would need as
many slow calls to fill).
"""

from __future__ import annotations

import asyncio
import json
import re
import socket
import threading
import time
from collections.abc import Callable, Iterator

import anyio
import httpx
import pytest

from loopserve.cache.prefix import block_keys
from loopserve.serve.api import LARGE_BODY_BYTES, TOKENIZE_THREADS, LeftBeforeItsTurn, run_in_lane
from loopserve.tokenizer import RELEASE_GIL_FROM, Tokenizer
from tests.server_helpers import MODEL, Server, metric, run_server, sse_events, wait_idle

pytestmark = pytest.mark.timeout(180)

C, CHAT = "/v1/completions", "/v1/chat/completions"
SLOW_S = 3.0  # how long a marked tokenizer call takes
MARK_LEN = 77  # a /detokenize of this many ids is slowed
MARK_ID = 433  # and so is the string of this one token (a logprob entry's, where a response is formatted)
MAX_NUM_SEQS = 3
POOL_THREADS = 4  # anyio's shared worker threads in the server (generation requests are built on them)
PREFIX = [(7 * j) % 300 + 3 for j in range(70)]  # 4 full blocks of 16, then 6 tokens
LAUNCHER = f'''"""`loopserve` with a tokenizer slow on marked inputs, saying which thread it ran on and how many ran
at once, and a small shared worker pool."""
import contextlib
import os
import re
import sys
import threading
import time

import anyio.to_thread

from loopserve.cli import main
from loopserve.serve import api
from loopserve.tokenizer import Tokenizer

encode, decode = Tokenizer.encode, Tokenizer.decode
lock, running = threading.Lock(), [0]
lifespan, run_in_lane = api.OpenAIServing.lifespan, api.run_in_lane


@contextlib.asynccontextmanager
async def small_pool(self, app):
    anyio.to_thread.current_default_thread_limiter().total_tokens = {POOL_THREADS}  # (the event loop's)
    async with lifespan(self, app):
        yield


async def logged_run_in_lane(lane, *args):
    sys.stdout.write(f"lane turn asked ({{lane.borrowed_tokens}} of {{lane.total_tokens}} taken)\\n")
    sys.stdout.flush()
    return await run_in_lane(lane, *args)


def slow(what, gate=None):
    with lock:
        running[0] += 1
        at_once = running[0]
    # (one write per line: print writes the text and the newline apart, so two threads' lines could run together)
    sys.stdout.write(f"{{what}} on thread {{threading.current_thread().name}} ({{at_once}} at once)\\n")
    sys.stdout.flush()
    if gate is None:
        time.sleep({SLOW_S})  # (releases the GIL: on the event loop it would stall the loop, on a worker it would not)
    else:
        while not os.path.exists(gate):
            time.sleep(0.01)
    with lock:
        running[0] -= 1


def slow_encode(self, text, *args, **kwargs):
    if isinstance(text, str) and "SLOW-TOKENIZE" in text:
        slow("encode")
    elif isinstance(text, str) and "LANE-TOKENIZE" in text:
        slow("lane")
    elif isinstance(text, str) and "BIG-TOKENIZE" in text[:100]:
        gate = re.search(r"GATE=(\\S+)", text[:300])
        slow("big", gate and gate.group(1))
    return encode(self, text, *args, **kwargs)


def slow_decode(self, ids, *args, **kwargs):
    if len(ids) == {MARK_LEN}:
        slow("decode")
    elif list(ids) == [{MARK_ID}]:
        slow("format")
    return decode(self, ids, *args, **kwargs)


Tokenizer.encode, Tokenizer.decode = slow_encode, slow_decode
api.OpenAIServing.lifespan, api.run_in_lane = small_pool, logged_run_in_lane
sys.exit(main(sys.argv[1:]))
'''


@pytest.fixture(scope="module")
def server(tiny_huginn, tmp_path_factory) -> Iterator[Server]:
    folder = tmp_path_factory.mktemp("vllm-fields")
    launcher = folder / "slow_tokenizer_loopserve.py"
    launcher.write_text(LAUNCHER)
    with run_server(tiny_huginn, folder / "server.log", "--max-num-seqs", str(MAX_NUM_SEQS), "--kv-cache-tokens",
                    "8192", launcher=launcher) as s:
        yield s


def _json(r: httpx.Response) -> dict:
    assert r.status_code == 200, r.text
    return r.json()


def _events(server: Server, path: str, body: dict) -> list[dict]:
    with httpx.stream("POST", server.url + path, json={**body, "stream": True}, timeout=60) as r:
        assert r.status_code == 200, r.read()
        return [json.loads(e) for e in sse_events(r.iter_lines()) if e != "[DONE]"]


def _refused(r: httpx.Response, param: str) -> str:
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param, err
    return err["message"]


# -- /tokenize and /detokenize off the event loop -----------------------------------------------------------------
def _health_during_slow_call(server: Server, path: str, body: dict, what: str) -> float:
    """Seconds GET /health took while `body`'s request to `path` was inside its slow `what` call (the request then
    answered 200). On the event loop /health would wait for the rest of it (SLOW_S, less the poll's lag)."""
    before = server.log.read_text().count(f"{what} on thread")
    answer: dict = {}
    t = threading.Thread(target=lambda: answer.update(r=server.post(path, body, timeout=60)))
    t.start()
    deadline = time.monotonic() + 30
    while server.log.read_text().count(f"{what} on thread") == before:  # the slow call has started
        assert time.monotonic() < deadline, server.log.read_text()[-2000:]
        time.sleep(0.02)
    start = time.monotonic()
    assert httpx.get(server.url + "/health", timeout=30).status_code == 200
    health_s = time.monotonic() - start
    t.join(60)
    assert answer["r"].status_code == 200, answer["r"].text
    return health_s


def test_tokenize_and_detokenize_run_off_the_event_loop(server):
    calls = (("/tokenize", {"prompt": "SLOW-TOKENIZE to be"}, "encode"),
             ("/tokenize", {"messages": [{"role": "user", "content": "SLOW-TOKENIZE hi"}]}, "encode"),
             ("/detokenize", {"tokens": [5] * MARK_LEN}, "decode"))
    for path, body, what in calls:
        health_s = _health_during_slow_call(server, path, body, what)
        assert health_s < SLOW_S / 2, (path, health_s)
    threads = re.findall(r"(?:encode|decode) on thread (\S+)", server.log.read_text())
    assert len(threads) >= len(calls) and "MainThread" not in threads, threads  # (uvicorn's loop runs there)


@pytest.mark.parametrize("stream", [False, True])
def test_a_response_with_logprobs_is_formatted_off_the_event_loop(server, stream):
    """(20 echoed prompts of 1,022 tokens with 20 logprobs each took 1.3 s to format on the event loop, every other
    stream waiting.) The echoed prompt's marked token is slow to turn into its string: /health answers meanwhile.
    Streamed, the first chunk holds the prompt's logprobs."""
    body = {"prompt": [5, MARK_ID, 6], "max_tokens": 1, "echo": True, "logprobs": 1, "stream": stream}
    health_s = _health_during_slow_call(server, C, body, "format")
    assert health_s < SLOW_S / 2, health_s
    threads = re.findall(r"format on thread (\S+)", server.log.read_text())
    assert threads and "MainThread" not in threads, threads


def _small_request_amid(server: Server, calls: list[tuple[str, dict]], ready: Callable[[str], bool],
                        settle_s: float = 0.0) -> tuple[list[httpx.Response], float, str]:
    """Send `calls` ((path, body) each) at once; once `ready(the server's log since)` holds (and `settle_s` later),
    time a one-token completion (answered 200). Returns the calls' answers, its seconds, and the log since."""
    offset = len(server.log.read_text())
    answers: list[httpx.Response] = []
    burst = [threading.Thread(target=lambda p=p, b=b: answers.append(server.post(p, b, timeout=60))) for p, b in calls]
    for t in burst:
        t.start()
    deadline = time.monotonic() + 30
    while not ready(server.log.read_text()[offset:]):
        assert time.monotonic() < deadline, server.log.read_text()[-2000:]
        time.sleep(0.02)
    time.sleep(settle_s)
    start = time.monotonic()
    r = server.post(C, {"model": MODEL, "prompt": "hi", "max_tokens": 1})
    took = time.monotonic() - start
    for t in burst:
        t.join(60)
    assert r.status_code == 200, r.text
    return answers, took, server.log.read_text()[offset:]


def test_tokenize_calls_run_on_a_lane_of_their_own(server):
    """As many slow /tokenize calls as the shared worker pool has threads, at once: they run TOKENIZE_THREADS at a
    time, on their own lane, and a completion sent meanwhile is built on a free shared thread at once (without the
    lane the burst would hold every shared thread, and its build would wait out a slow call)."""
    answers, took, log = _small_request_amid(
        server, [("/tokenize", {"prompt": "LANE-TOKENIZE"})] * POOL_THREADS,
        lambda log: log.count("lane on thread") >= TOKENIZE_THREADS,  # the lane is full
        settle_s=0.3)  # (the rest of the burst reaches the server)
    assert len(answers) == POOL_THREADS and all(a.status_code == 200 for a in answers), answers
    at_once = [int(k) for k in re.findall(r"lane on thread [^()]*? \((\d+) at once\)", log)]
    assert len(at_once) == POOL_THREADS and max(at_once) == TOKENIZE_THREADS, at_once
    assert took < SLOW_S / 2, took  # (behind the burst it would wait for the rest of a slow call)


def test_large_bodies_are_built_one_at_a_time(server):
    """Prompts in bodies over LARGE_BODY_BYTES are tokenized one at a time, whatever the endpoint (each may take a
    gigabyte while it is tokenized: concurrent 4 MB prompts to be truncated, which skip the length check, took a
    server out of memory); a small request is built on a shared thread meanwhile."""
    text = "BIG-TOKENIZE " + "to be or not " * (LARGE_BODY_BYTES // 13 + 1)
    bodies = [(C, {"model": MODEL, "prompt": text, "max_tokens": 1, "truncate_prompt_tokens": 8}),
              (CHAT, {"model": MODEL, "messages": [{"role": "user", "content": text}], "max_tokens": 1,
                      "truncate_prompt_tokens": 8}),
              ("/tokenize", {"prompt": text})]
    answers, took, log = _small_request_amid(server, bodies, lambda log: "big on thread" in log)
    assert sorted(a.status_code for a in answers) == [200] * len(bodies), [a.text[:300] for a in answers]
    at_once = [int(k) for k in re.findall(r"big on thread [^()]*? \((\d+) at once\)", log)]
    assert len(at_once) == len(bodies) and max(at_once) == 1, at_once
    assert took < SLOW_S / 2, took


def test_a_request_whose_client_left_is_not_built_when_its_turn_comes(server, tmp_path):
    """Requests waiting in a lane whose clients disconnect are not built at their turn (vLLM cancels a handler whose
    client left): behind a live large body, three abandoned ones (raw sockets closed once their bodies are sent)
    leave the one-at-a-time lane at once, so a large request queued after them is built next, not 9 s later. Before,
    each took its full turn (a probe: a live request behind five abandoned 3 MB prompts waited 13.7 s, not 2.7).
    The live one holds the lane until the test opens its gate, once all four behind it wait for their turns."""
    gate = tmp_path / "gate"
    text = "BIG-TOKENIZE " + "to be or not " * (LARGE_BODY_BYTES // 13 + 1)
    body = {"model": MODEL, "prompt": text, "max_tokens": 1, "truncate_prompt_tokens": 8}
    raw_body = json.dumps(body).encode()
    offset = len(server.log.read_text())
    host, port = server.url.removeprefix("http://").split(":")
    answers: list[httpx.Response] = []

    def send(gated: bool) -> threading.Thread:
        prompt = f"BIG-TOKENIZE GATE={gate} {text}" if gated else text
        t = threading.Thread(target=lambda: answers.append(server.post(C, {**body, "prompt": prompt}, timeout=60)))
        t.start()
        return t

    def wait_for(what: str, count: int) -> None:
        deadline = time.monotonic() + 30
        while server.log.read_text()[offset:].count(what) < count:
            assert time.monotonic() < deadline, server.log.read_text()[-2000:]
            time.sleep(0.02)

    live = send(gated=True)
    try:
        wait_for("big on thread", 1)  # the live one holds the lane
        for _ in range(3):
            with socket.create_connection((host, int(port))) as raw:
                raw.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                            b"Content-Length: %d\r\n\r\n" % len(raw_body) + raw_body)
        wait_for("lane turn asked (1 of 1 taken)", 3)  # the abandoned three wait for their turns
        late = send(gated=False)
        wait_for("lane turn asked (1 of 1 taken)", 4)  # and the late one behind them
    finally:  # (a failed wait leaves the lane free for the module's other tests)
        start = time.monotonic()
        gate.touch()
    live.join(60)
    late.join(60)
    took = time.monotonic() - start
    assert [a.status_code for a in answers] == [200, 200], [a.text[:300] for a in answers]
    log = server.log.read_text()[offset:]
    assert log.count("big on thread") == 2, log[-3000:]  # the live two only
    assert took < 2 * SLOW_S, took  # (the late one's turn: each abandoned turn would add SLOW_S)


def test_a_lane_turn_is_held_until_its_thread_ends_even_if_its_task_is_cancelled():
    """Ray Serve cancels a handler whose client left; its worker thread cannot be stopped, so its lane's turn is held
    until the thread ends (the task left at once, and the next large body ran beside the first). A request whose
    client left by its turn does not run, and gives the turn back."""
    async def scenario() -> None:
        lane, threads = anyio.CapacityLimiter(1), anyio.CapacityLimiter(8)
        started: dict[str, float] = {}

        def slow(tag: str) -> str:
            started[tag] = time.monotonic()
            time.sleep(0.5)
            return tag

        async def stayed() -> bool:
            return False

        async def left() -> bool:
            return True

        first = asyncio.ensure_future(run_in_lane(lane, stayed, threads, slow, "a"))
        await asyncio.sleep(0.1)
        first.cancel()
        with pytest.raises(asyncio.CancelledError):
            await first
        assert await run_in_lane(lane, stayed, threads, slow, "b") == "b"
        assert started["b"] - started["a"] >= 0.45, started  # (after a's thread, not beside it)
        with pytest.raises(LeftBeforeItsTurn):
            await run_in_lane(lane, left, threads, slow, "c")
        assert "c" not in started and lane.borrowed_tokens == 0

    asyncio.run(scenario())


def test_long_texts_are_tokenized_with_the_gil_released(tiny_huginn):
    tok = Tokenizer(tiny_huginn)
    text = "ROMEO loves JULIET. \n" * 5_000  # the same ids and text as the single calls give
    assert len(text) > RELEASE_GIL_FROM
    for special in (True, False):
        ids = tok.encode(text, add_special_tokens=special)
        assert ids == tok.tok.encode(text, add_special_tokens=special).ids
        assert tok.decode(ids, special) == tok.tok.decode(ids, skip_special_tokens=special)
    text *= 10  # 1 MB: about a second
    gaps, done = [], threading.Event()
    took: dict = {}

    def work() -> None:
        start = time.monotonic()
        tok.encode(text)
        took["s"] = time.monotonic() - start
        done.set()

    worker = threading.Thread(target=work)
    last = time.monotonic()
    worker.start()
    while not done.is_set():  # this thread runs between 5 ms sleeps only while the worker lets go of the GIL
        time.sleep(0.005)
        now = time.monotonic()
        gaps.append(now - last)
        last = now
    worker.join()
    # holding the GIL, the call would stop this thread for all of its time (the list of ids it returns is built
    # with the GIL held: a fraction of it)
    assert max(gaps) < took["s"] / 2, (max(gaps), took["s"])


# -- metrics: samples in both gauges ---------------------------------------------------------------------------------
def test_running_and_waiting_gauges_count_samples(server):
    body = {"model": MODEL, "prompt": "count us", "max_tokens": 1800, "ignore_eos": True, "stream": True,
            "min_loops": 6}  # (full depth: the long completions stay in flight while /metrics is read)
    seen = []
    with httpx.Client(timeout=60) as client, \
            client.stream("POST", server.url + C, json={**body, "n": MAX_NUM_SEQS}) as first, \
            client.stream("POST", server.url + C, json={**body, "n": 2}) as second:
        assert first.status_code == second.status_code == 200
        deadline = time.monotonic() + 30
        # the first request's 3 samples fill max_num_seqs: the second's 2 wait for admission
        while (seen := [metric(server, "loopserve:num_requests_running"),
                        metric(server, "loopserve:num_requests_waiting")]) != [MAX_NUM_SEQS, 2]:
            assert time.monotonic() < deadline, seen
            time.sleep(0.02)
    wait_idle(server)
    text = httpx.get(server.url + "/metrics").text
    assert re.search(r"# HELP loopserve:num_requests_waiting Sequences waiting .* samples counted", text)


# -- request fields ------------------------------------------------------------------------------------------------
def test_completions_add_special_tokens(server):
    base = {"model": MODEL, "prompt": "To be", "max_tokens": 1, "return_token_ids": True}
    with_them = _json(server.post("/tokenize", {"prompt": "To be"}))["tokens"]
    without = _json(server.post("/tokenize", {"prompt": "To be", "add_special_tokens": False}))["tokens"]
    assert len(with_them) == len(without) + 1  # the BOS
    for extra, want in (({}, with_them), ({"add_special_tokens": True}, with_them),
                        ({"add_special_tokens": False}, without)):
        r = _json(server.post(C, {**base, **extra}))
        assert r["choices"][0]["prompt_token_ids"] == want, extra
        assert r["usage"]["prompt_tokens"] == len(want)
    # token ids are taken as they are
    r = _json(server.post(C, {**base, "prompt": without, "add_special_tokens": True}))
    assert r["choices"][0]["prompt_token_ids"] == without
    # echo gives the text back
    r = _json(server.post(C, {**base, "echo": True, "add_special_tokens": False}))
    assert r["choices"][0]["text"].startswith("To be")
    # a token-id prompt is echoed with its special tokens, as vLLM decodes it and as the logprobs' tokens and
    # offsets count them (the text dropped them while the offsets counted them)
    r = _json(server.post(C, {**base, "prompt": with_them, "echo": True, "logprobs": 0, "max_tokens": 1,
                              "skip_special_tokens": False}))["choices"][0]
    lp = r["logprobs"]
    assert r["text"].startswith("".join(lp["tokens"][:len(with_them)])) and len(with_them) > len(without)
    n = len(with_them)
    assert all(r["text"][o:o + len(t)] == t for o, t in zip(lp["text_offset"][:n], lp["tokens"][:n], strict=True)), lp


def test_return_tokens_as_token_ids_in_completions(server):
    body = {"model": MODEL, "prompt": "Once upon", "max_tokens": 4, "logprobs": 2, "return_token_ids": True,
            "seed": 3, "return_tokens_as_token_ids": True}
    r = _json(server.post(C, body))["choices"][0]
    lp = r["logprobs"]
    assert lp["tokens"] == [f"token_id:{t}" for t in r["token_ids"]]
    for top in lp["top_logprobs"]:
        assert top and all(re.fullmatch(r"token_id:\d+", k) for k in top), top
    # vLLM's text offsets: each token's string's length after the one before
    assert lp["text_offset"] == [sum(len(s) for s in lp["tokens"][:k]) for k in range(len(lp["tokens"]))]
    # the prompt's tokens too, with echo
    echoed = _json(server.post(C, {**body, "echo": True}))["choices"][0]
    ids = [*echoed["prompt_token_ids"], *echoed["token_ids"]]
    assert echoed["logprobs"]["tokens"] == [f"token_id:{t}" for t in ids]
    # streamed: every chunk's tokens
    chunks = [e["choices"][0] for e in _events(server, C, body) if e["choices"]]
    assert [t for c in chunks for t in c["logprobs"]["tokens"]] == \
        [f"token_id:{t}" for c in chunks for t in c["token_ids"]]
    # without the field (or with false) tokens are text again: the setting is the request's alone
    for extra in ({"return_tokens_as_token_ids": False}, {"return_tokens_as_token_ids": None}):
        plain = _json(server.post(C, {**body, **extra}))["choices"][0]["logprobs"]
        assert "".join(plain["tokens"]) == r["text"] and not any(t.startswith("token_id:") for t in plain["tokens"])


def test_return_tokens_as_token_ids_in_chat(server):
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "logprobs": True,
            "top_logprobs": 2, "return_token_ids": True, "seed": 3, "return_tokens_as_token_ids": True}
    r = _json(server.post(CHAT, body))["choices"][0]
    content = r["logprobs"]["content"]
    assert [c["token"] for c in content] == [f"token_id:{t}" for t in r["token_ids"]]
    for c in content:
        assert len(c["top_logprobs"]) == 2 and all(re.fullmatch(r"token_id:\d+", t["token"]) for t in c["top_logprobs"])
    chunks = [e["choices"][0] for e in _events(server, CHAT, body) if e["choices"] and e["choices"][0]["logprobs"]]
    assert [c["token"] for ch in chunks for c in ch["logprobs"]["content"]] == \
        [f"token_id:{t}" for ch in chunks for t in ch["token_ids"]]
    plain = _json(server.post(CHAT, {**body, "return_tokens_as_token_ids": False}))["choices"][0]
    assert "".join(c["token"] for c in plain["logprobs"]["content"]) == plain["message"]["content"]


@pytest.mark.parametrize("path", [C, CHAT])
def test_priority_and_logits_processors_only_at_their_neutral_values(server, path):
    body = ({"prompt": "hi"} if path == C else {"messages": [{"role": "user", "content": "hi"}]})
    body = {**body, "model": MODEL, "max_tokens": 1}
    for neutral in ({"priority": 0}, {"priority": None}, {"logits_processors": []}, {"logits_processors": None}):
        assert server.post(path, {**body, **neutral}).status_code == 200, neutral
    assert "priority scheduling" in _refused(server.post(path, {**body, "priority": 1}), "priority")
    assert "priority" in _refused(server.post(path, {**body, "priority": -2}), "priority")
    _refused(server.post(path, {**body, "priority": "high"}), "priority")
    for value in (["my_module.Processor"], [{"qualname": "m.P"}]):
        assert "logits processors" in _refused(server.post(path, {**body, "logits_processors": value}),
                                               "logits_processors")


@pytest.mark.parametrize("path", [C, CHAT])
def test_vllms_fields_for_what_the_server_lacks_are_refused_unless_empty(server, path):
    """They were ignored with a log line: a request with `prompt_embeds` was answered from its text prompt."""
    body = ({"prompt": "hi"} if path == C else {"messages": [{"role": "user", "content": "hi"}]})
    body = {**body, "model": MODEL, "max_tokens": 1}
    for name in ("mm_processor_kwargs", "kv_transfer_params", "vllm_xargs"):
        for neutral in (None, {}):
            assert server.post(path, {**body, name: neutral}).status_code == 200, (name, neutral)
        assert "not supported by this server" in _refused(server.post(path, {**body, name: {"a": 1}}), name)
    if path == C:  # (with a prompt, and without one, as vLLM's clients send them)
        for sent in ({**body, "prompt_embeds": "AAAA"}, {"model": MODEL, "prompt_embeds": "AAAA"}):
            assert "--enable-prompt-embeds" in _refused(server.post(path, sent), "prompt_embeds")
    # SamplingParams' field, taken (no longer logged as unknown), with special tokens kept or not, as offline
    for skip in (True, False):
        sent = {**body, "spaces_between_special_tokens": False, "skip_special_tokens": skip}
        assert server.post(path, sent).status_code == 200, skip


def test_request_id_field_names_the_response(server):
    body = {"model": MODEL, "prompt": "id", "max_tokens": 1}
    r = server.post(C, {**body, "request_id": "body-id-1"})
    assert r.json()["id"] == "cmpl-body-id-1" and r.headers["x-request-id"] == "body-id-1"
    # the X-Request-Id header wins (vLLM's rule)
    r = server.post(C, {**body, "request_id": "body-id-2"}, request_id="header-id-2")
    assert r.json()["id"] == "cmpl-header-id-2" and r.headers["x-request-id"] == "header-id-2"
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "max_tokens": 1, "request_id": "chat-3"}
    r = server.post(CHAT, chat)
    assert r.json()["id"] == "chatcmpl-chat-3" and r.headers["x-request-id"] == "chat-3"
    assert {e["id"] for e in _events(server, CHAT, chat)} == {"chatcmpl-chat-3"}
    # the same id twice is still two requests to the engine
    r = server.post(C, {**body, "prompt": ["a", "b"], "n": 2, "request_id": "body-id-1"})
    assert len(_json(r)["choices"]) == 4
    for bad in ("", "has space", "x" * 129, "é"):
        _refused(server.post(C, {**body, "request_id": bad}), "request_id")


def test_cache_salt_separates_prefix_cache_entries(server):
    def cached(prompt: list[int], **extra) -> int:
        # one seed for all: the tiny Huginn's random initial states are part of the cache keys
        r = _json(server.post(C, {"model": MODEL, "prompt": prompt, "max_tokens": 1, "seed": 5, **extra}))
        return r["usage"]["prompt_tokens_details"]["cached_tokens"]

    salted = [*PREFIX, 1]
    assert cached(salted, cache_salt="alice") == 0
    assert cached([*PREFIX, 2], cache_salt="alice") == 64  # the same salt shares the 4 full blocks
    assert cached([*PREFIX, 3], cache_salt="bob") == 0  # another salt shares none
    assert cached([*PREFIX, 4]) == 0  # nor does no salt
    assert cached([*PREFIX, 5]) == 64
    assert cached([*PREFIX, 6], cache_salt="bob") == 64
    messages = [{"role": "user", "content": "a long system prompt " * 8}]
    chat = {"model": MODEL, "messages": messages, "max_tokens": 1, "seed": 5}
    first = _json(server.post(CHAT, {**chat, "cache_salt": "carol"}))["usage"]["prompt_tokens_details"]
    again = _json(server.post(CHAT, {**chat, "cache_salt": "carol"}))["usage"]["prompt_tokens_details"]
    other = _json(server.post(CHAT, {**chat, "cache_salt": "dave"}))["usage"]["prompt_tokens_details"]
    assert first["cached_tokens"] == 0 and again["cached_tokens"] > 0 and other["cached_tokens"] == 0
    _refused(server.post(C, {"model": MODEL, "prompt": "x", "cache_salt": ""}), "cache_salt")
    _refused(server.post(C, {"model": MODEL, "prompt": "x", "cache_salt": 7}), "cache_salt")


def test_block_keys_depend_on_the_salt():
    scope, tokens = b"s" * 32, list(range(40))
    plain = block_keys(scope, 4, None, tokens, 16)
    assert block_keys(scope, 4, None, tokens, 16, None) == plain
    a, b = block_keys(scope, 4, None, tokens, 16, "a"), block_keys(scope, 4, None, tokens, 16, "b")
    assert a == block_keys(scope, 4, None, tokens, 16, "a")
    assert len({*plain, *a, *b}) == 3 * len(plain)  # no key shared


def test_an_empty_model_name_is_the_served_model(server):
    r = _json(server.post(C, {"model": "", "prompt": "hi", "max_tokens": 1}))
    assert r["model"] == MODEL
    r = _json(server.post(CHAT, {"model": "", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}))
    assert r["model"] == MODEL
    assert _json(server.post("/tokenize", {"model": "", "prompt": "hi"}))["count"] > 0
    assert _json(server.post("/detokenize", {"model": "", "tokens": [5]}))["prompt"]
    r = server.post(C, {"model": "other", "prompt": "hi", "max_tokens": 1})
    assert r.status_code == 404 and r.json()["error"]["param"] == "model"


def test_the_openapi_schema_lists_the_fields(server):
    schema = httpx.get(server.url + "/openapi.json").json()["components"]["schemas"]
    for name in ("CompletionRequest", "ChatCompletionRequest"):
        props = schema[name]["properties"]
        assert {"return_tokens_as_token_ids", "request_id", "cache_salt", "priority",
                "logits_processors"} <= props.keys(), name
    assert "add_special_tokens" in schema["CompletionRequest"]["properties"]


def test_seed_minus_one_is_no_seed(server):
    """vLLM's rule, over HTTP too: `seed: -1` is unseeded (each request its own stream), not one fixed stream (the
    raw -1 reached the engine, and every such request drew the same tokens)."""
    body = {"model": MODEL, "prompt": "Once upon", "max_tokens": 12, "temperature": 1.0, "ignore_eos": True,
            "return_token_ids": True}
    seeded = [_json(server.post(C, {**body, "seed": 7}))["choices"][0]["token_ids"] for _ in range(2)]
    assert seeded[0] == seeded[1]
    unseeded = [_json(server.post(C, {**body, "seed": -1}))["choices"][0]["token_ids"] for _ in range(3)]
    assert len({tuple(t) for t in unseeded}) > 1, unseeded


def test_more_samples_than_max_num_seqs_are_served(server):
    """n past --max-num-seqs (a pass@k eval) is served in parts, as vLLM queues such samples (it was a 400); the
    samples of the first part are those of the same request with n = --max-num-seqs (they do not depend on how the
    request was cut), and the samples differ."""
    body = {"model": MODEL, "prompt": "Once upon", "max_tokens": 4, "temperature": 1.0, "seed": 5,
            "ignore_eos": True, "return_token_ids": True}

    def samples(n: int) -> list[list[int]]:
        choices = _json(server.post(C, {**body, "n": n}))["choices"]
        return [c["token_ids"] for c in sorted(choices, key=lambda c: c["index"])]

    many = samples(2 * MAX_NUM_SEQS + 1)
    assert len(many) == 2 * MAX_NUM_SEQS + 1 and len({tuple(t) for t in many}) > 1
    assert many[:MAX_NUM_SEQS] == samples(MAX_NUM_SEQS)
