"""What a vLLM user expects of the server, against a real `loopserve serve` process started with
vLLM's flags: unknown request fields ignored with a warning, /tokenize, /detokenize and /version in
vLLM's shapes, `chat_template_kwargs`, CORS (with preflight), `--root-path`, `X-Request-Id`, several
API keys (and the environment variable), request logging, the start-up summary and periodic stats
lines with timestamps, `--max-model-len` (and truncate_prompt_tokens=-1, which cuts to it), vLLM's metric
names; and, without a server, the start-up refusals (`--max-model-len` past the context,
`--gpu-memory-utilization` on the CPU) and `auto` for the device and dtype.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from loopserve.tokenizer import Tokenizer
from loopserve_lab.tiny import TinySpec, make_tiny
from tests.server_helpers import MODEL, REPO, Server, metric, run_server, sse_events

pytestmark = pytest.mark.timeout(120)

KEYS = ("key-one", "key-two")
ORIGIN = "https://app.example"
ROOT = "/api"
MAX_LEN = 48  # --max-model-len (the model's context is 2048)
LOG_LEN = 8  # --max-log-len
STATS_S = 0.3  # --log-stats-interval
# a chat template with a variable only `chat_template_kwargs` sets, and those a request's reasoning_effort sets
TEMPLATE = ("{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}{% if shout %}SHOUTING {% endif %}"
            "{% if reasoning_effort %}effort={{ reasoning_effort }} {% endif %}"
            "{% if enable_thinking is defined %}thinking={{ enable_thinking }} {% endif %}"
            "{% if add_generation_prompt %}assistant:{% endif %}")
TIMESTAMP = re.compile(r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d")


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory) -> Path:
    return make_tiny(tmp_path_factory.mktemp("tiny-vllm"), TinySpec(arch="ouro", seed=1))


@pytest.fixture(scope="module")
def server(tiny_path, tmp_path_factory) -> Iterator[Server]:
    folder = tmp_path_factory.mktemp("vllm")
    with run_server(tiny_path, folder / "server.log", "--api-key", KEYS[0], "--api-key", KEYS[1],
                    "--allowed-origins", f'["{ORIGIN}"]', "--root-path", ROOT, "--enable-log-requests",
                    "--max-log-len", str(LOG_LEN),
                    "--log-stats-interval", str(STATS_S), "--max-model-len", str(MAX_LEN),
                    "--kv-cache-tokens", "1024", "--enable-tokenizer-info-endpoint",
                    "--max-logprobs", str(SERVER_MAX_LOGPROBS), log_level="info",
                    access_log=True,
                    chat_template=TEMPLATE) as s:
        yield s


SERVER_MAX_LOGPROBS = 3  # (the server's --max-logprobs: vLLM's cap, below its default 20)


def _auth(key: str = KEYS[0]) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def _post(server: Server, path: str, body: dict, **headers: str) -> httpx.Response:
    return httpx.post(server.url + path, json=body, headers={**_auth(), **headers}, timeout=30)


def _log_after(server: Server, marker: str, timeout: float = 10.0) -> str:
    """The server log once it contains `marker` (it is written by another process)."""
    deadline = time.monotonic() + timeout
    while marker not in (text := server.log.read_text()):
        assert time.monotonic() < deadline, f"{marker!r} not in the log:\n{text[-3000:]}"
        time.sleep(0.05)
    return text


# -- request bodies --------------------------------------------------------------------------------------------
def test_unknown_fields_are_ignored_with_a_warning(server):
    client = openai.OpenAI(base_url=server.url + "/v1", api_key=KEYS[0], max_retries=0, timeout=30)
    r = client.completions.create(model=MODEL, prompt="hi", max_tokens=2,
                                  extra_body={"temprature": 0.5, "guided_jsn": {"x": 1}, "ignore_eos": True},
                                  extra_headers={"X-Request-Id": "unknown-1"})
    assert r.usage.completion_tokens == 2
    chat = _post(server, "/v1/chat/completions", {
        "model": MODEL, "max_tokens": 2, "stream": True, "stream_options": {"include_usage": True, "bogus": 1},
        "messages": [{"role": "user", "content": "hi", "reasoning_content": "x"}]}, **{"X-Request-Id": "unknown-2"})
    assert chat.status_code == 200 and chat.text.rstrip().endswith("data: [DONE]")
    text = _log_after(server, "unknown-2 /v1/chat/completions")
    assert "unknown-1 /v1/completions: ignored unknown fields: temprature, guided_jsn" in text
    assert "ignored unknown fields: stream_options.bogus, messages.0.reasoning_content" in text
    # a name cannot write a line of its own into the log (nor a terminal escape), nor a page of it
    forged = "zz\n2026-12-07 02:00:00,000 ERROR loopserve.serve: FAKE\x1b[31m"
    r = _post(server, "/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": 1, forged: 1, "y" * 5000: 2},
              **{"X-Request-Id": "unknown-3"})
    assert r.status_code == 200
    text = _log_after(server, "unknown-3 /v1/completions: ignored")
    assert "\nFAKE" not in text and "\n2026-12-07 02:00:00,000 ERROR" not in text and "\x1b" not in text, text
    assert f"ignored unknown fields: {forged!r}, {'y' * 64}..." in text, text
    # a known field keeps its type, and the error names it
    bad = _post(server, "/v1/completions", {"model": MODEL, "prompt": "hi", "temprature": 1, "temperature": "hot"})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "temperature"


def test_reasoning_effort_is_checked_and_reaches_the_template(server):
    """vLLM's reasoning_effort: one of its values (else a 400 naming it), passed to the chat template as
    `reasoning_effort`, with `enable_thinking` (false for "none") unless chat_template_kwargs sets that; the field
    wins over the kwargs' reasoning_effort. The model has no reasoning mode: nothing else reads it. It was an
    unknown field, any value ignored."""
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1, "return_token_ids": True}

    def prompt(**extra: Any) -> str:
        r = _post(server, "/v1/chat/completions", {**body, **extra})
        assert r.status_code == 200, r.text
        return _post(server, "/detokenize", {"tokens": r.json()["prompt_token_ids"]}).json()["prompt"]

    assert prompt() == "user: hi\nassistant:"
    assert prompt(reasoning_effort="low") == "user: hi\neffort=low thinking=True assistant:"
    assert prompt(reasoning_effort="none") == "user: hi\neffort=none thinking=False assistant:"
    assert prompt(reasoning_effort="high", chat_template_kwargs={"reasoning_effort": "x", "enable_thinking": False}
                  ) == "user: hi\neffort=high thinking=False assistant:"
    assert prompt(chat_template_kwargs={"reasoning_effort": "x"}) == "user: hi\neffort=x assistant:"
    for bad in ("extreme", "HIGH", 5, ""):
        r = _post(server, "/v1/chat/completions", {**body, "reasoning_effort": bad})
        assert r.status_code == 400 and r.json()["error"]["param"] == "reasoning_effort", r.text
        assert r.json()["error"]["message"].startswith("reasoning_effort: Input should be 'none', 'minimal', "), r.text


# -- /tokenize, /detokenize, /version --------------------------------------------------------------------------
def test_tokenize_detokenize_round_trip(server):
    r = _post(server, "/tokenize", {"model": MODEL, "prompt": "To be, or not", "return_token_strs": True})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["count"] == len(body["tokens"]) > 0 and body["max_model_len"] == MAX_LEN
    assert len(body["token_strs"]) == body["count"]
    assert _post(server, "/tokenize", {"prompt": "To be, or not"}).json()["token_strs"] is None
    back = _post(server, "/detokenize", {"model": MODEL, "tokens": body["tokens"]})
    assert back.status_code == 200 and back.json() == {"prompt": "To be, or not"}
    # the chat form renders the chat template first, with the request's template variables
    messages = [{"role": "user", "content": "hello"}]
    chat = _post(server, "/tokenize", {"messages": messages}).json()
    shout = _post(server, "/tokenize", {"messages": messages, "chat_template_kwargs": {"shout": True}}).json()
    said = _post(server, "/detokenize", {"tokens": shout["tokens"]}).json()["prompt"]
    assert said == "user: hello\nSHOUTING assistant:"
    assert shout["count"] > chat["count"]
    for body, status, param in (({"tokens": [10**6]}, 400, "tokens.0"), ({"tokens": [1, -1]}, 400, "tokens.1"),
                                ({"tokens": ["a"]}, 400, "tokens.0")):
        r = _post(server, "/detokenize", body)
        assert (r.status_code, r.json()["error"]["param"]) == (status, param)
    assert _post(server, "/tokenize", {"prompt": "x"}, Authorization="Bearer nope").status_code == 401
    assert _post(server, "/tokenize", {"model": "other", "prompt": "x"}).status_code == 404


def test_tokenizer_info_serves_what_a_remote_tokenizer_reads(server, tiny_path):
    """GET /tokenizer_info (vLLM's --enable-tokenizer-info-endpoint): the tokenizer's config, its special tokens as
    text and the chat template the server renders with: what lm-eval's remote tokenizer reads (eos_token, the
    template), beside /tokenize and /detokenize. Authenticated as the other routes are."""
    r = httpx.get(server.url + "/tokenizer_info", headers=_auth(), timeout=30)
    assert r.status_code == 200, r.text
    info = r.json()
    tok = Tokenizer(tiny_path)
    assert info["tokenizer_class"] and info["eos_token"] == tok.eos_token and info["chat_template"] == TEMPLATE
    eos = _post(server, "/tokenize", {"prompt": info["eos_token"], "add_special_tokens": False}).json()["tokens"]
    assert eos == [tok.eos_token_id]
    assert httpx.get(server.url + "/tokenizer_info", timeout=30).status_code == 401


def test_chat_template_kwargs_reach_the_template(server):
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hello"}], "max_tokens": 1,
            "return_token_ids": True}
    plain = _post(server, "/v1/chat/completions", body).json()["prompt_token_ids"]
    shout = _post(server, "/v1/chat/completions", {**body, "chat_template_kwargs": {"shout": True}}).json()
    ids = shout["prompt_token_ids"]
    assert "SHOUTING" in _post(server, "/detokenize", {"tokens": ids}).json()["prompt"]
    assert len(ids) > len(plain)
    for name, value in (("add_generation_prompt", 0), ("chat_template", "{% for i in range(99) %}x{% endfor %}"),
                        ("tools", "not a list")):
        refused = _post(server, "/v1/chat/completions", {**body, "chat_template_kwargs": {name: value}})
        assert refused.status_code == 400 and refused.json()["error"]["param"] == f"chat_template_kwargs.{name}"


def test_version(server):
    from loopserve import __version__

    r = httpx.get(server.url + "/version")  # open, like /health
    assert r.status_code == 200 and r.json() == {"version": __version__}


# -- HTTP: CORS, root path, request ids, keys ------------------------------------------------------------------
def test_cors_preflight_and_responses(server):
    pre = httpx.options(server.url + "/v1/chat/completions", headers={
        "Origin": ORIGIN, "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "authorization,content-type"})
    assert pre.status_code == 200, pre.text  # answered before authentication
    assert pre.headers["access-control-allow-origin"] == ORIGIN
    assert "POST" in pre.headers["access-control-allow-methods"]
    assert "authorization" in pre.headers["access-control-allow-headers"].lower()
    r = httpx.get(server.url + "/v1/models", headers={**_auth(), "Origin": ORIGIN})
    assert r.headers["access-control-allow-origin"] == ORIGIN
    assert "x-request-id" in r.headers["access-control-expose-headers"].lower()
    other = httpx.options(server.url + "/v1/models", headers={"Origin": "https://evil.example",
                                                               "Access-Control-Request-Method": "GET"})
    assert other.status_code == 400 and "access-control-allow-origin" not in other.headers
    assert "access-control-allow-origin" not in httpx.get(server.url + "/v1/models", headers={
        **_auth(), "Origin": "https://evil.example"}).headers


def test_disable_fastapi_docs_takes_the_schema_away(tiny_path):
    """vLLM's --disable-fastapi-docs serves no /openapi.json (it was taken and changed nothing: a deployment that
    hides its schema with it still served it)."""
    import asyncio

    from loopserve.cli import build_parser
    from loopserve.serve.api import build_app
    from loopserve.serve.cli import load_server

    async def schema(app) -> int:  # (answered without the engine: it is not started)
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test") as client:
            return (await client.get("/openapi.json")).status_code

    for flags, status in (([], 200), (["--disable-fastapi-docs"], 404)):
        args = build_parser().parse_args(["serve", str(tiny_path), "--device", "cpu", "--kv-cache-tokens", "64",
                                          *flags])
        engine, settings = load_server(args)
        assert asyncio.run(schema(build_app(engine, settings))) == status, flags


def test_any_origin_with_credentials_is_answered_with_the_requests_origin(tiny_path):
    """vLLM passes `--allowed-origins '["*"]' --allow-credentials` to Starlette's CORS middleware, which answers with
    the request's own Origin (browsers refuse credentials for '*'); the server refused the pair at start."""
    import asyncio

    from loopserve.cli import build_parser
    from loopserve.serve.api import ServerSettings, build_app, load_engine
    from loopserve.serve.cli import _check

    args = build_parser().parse_args(["serve", "--allowed-origins", '["*"]', "--allow-credentials"])
    assert _check(args) is None
    engine, _ = load_engine(tiny_path, device="cpu", kv_cache_tokens=64)
    app = build_app(engine, ServerSettings((MODEL,), allowed_origins=tuple(args.allowed_origins),
                                           allow_credentials=args.allow_credentials))

    async def preflight() -> httpx.Response:  # (answered by the middleware: the engine is not started)
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test") as client:
            return await client.options("/v1/chat/completions", headers={
                "Origin": ORIGIN, "Access-Control-Request-Method": "POST",
                "Access-Control-Request-Headers": "authorization,content-type"})

    pre = asyncio.run(preflight())
    assert pre.status_code == 200, pre.text
    assert pre.headers["access-control-allow-origin"] == ORIGIN
    assert pre.headers["access-control-allow-credentials"] == "true"


def test_root_path(server):
    for path in (f"{ROOT}/v1/models", "/v1/models"):  # behind a proxy that strips the prefix, or one that does not
        r = httpx.get(server.url + path, headers=_auth())
        assert r.status_code == 200 and r.json()["data"][0]["max_model_len"] == MAX_LEN
    assert httpx.get(server.url + "/openapi.json").json()["servers"] == [{"url": ROOT}]


def test_request_id_is_echoed_and_names_the_response(server):
    r = _post(server, "/v1/completions", {"model": MODEL, "prompt": "id", "max_tokens": 1}, **{"X-Request-Id": "abc-1"})
    assert r.headers["x-request-id"] == "abc-1" and r.json()["id"] == "cmpl-abc-1"
    # the same id twice at once is still two requests to the engine
    same = _post(server, "/v1/completions", {"model": MODEL, "prompt": ["a", "b"], "max_tokens": 1},
                 **{"X-Request-Id": "abc-1"})
    assert same.status_code == 200 and len(same.json()["choices"]) == 2
    fresh = _post(server, "/v1/chat/completions", {"model": MODEL, "max_tokens": 1,
                                                   "messages": [{"role": "user", "content": "x"}]})
    rid = fresh.headers["x-request-id"]
    assert re.fullmatch(r"[0-9a-f]{32}", rid) and fresh.json()["id"] == f"chatcmpl-{rid}"
    for headers in ({"X-Request-Id": "x" * 500}, {}):  # an unusable id is replaced; errors carry one too
        err = httpx.get(server.url + "/v1/nope", headers=headers)
        assert err.status_code == 404 and re.fullmatch(r"[0-9a-f]{32}", err.headers["x-request-id"])
        if headers:  # and the log says so (the client's id was lost without a word)
            _log_after(server, f"X-Request-Id: not 1 to 128 visible ASCII characters (500 characters sent); the "
                               f"request is named {err.headers['x-request-id']} instead (or by its body's request_id)")


def test_any_of_several_api_keys(server):
    body = {"model": MODEL, "prompt": "k", "max_tokens": 1}
    for key in KEYS:
        assert _post(server, "/v1/completions", body, Authorization=f"Bearer {key}").status_code == 200
    for header in ("Bearer key-three", "Bearer key-one key-two", f"Bearer {KEYS[0]}{KEYS[1]}", ""):
        assert _post(server, "/v1/completions", body, Authorization=header).status_code == 401


def test_api_key_flags_win_over_the_environment(monkeypatch):
    from loopserve.serve.cli import API_KEY_ENVS, _api_keys

    ours, vllms = API_KEY_ENVS
    for name in API_KEY_ENVS:
        monkeypatch.delenv(name, raising=False)
    assert _api_keys(None) == []
    monkeypatch.setenv(vllms, "from-vllm")  # a deployment moved from vLLM keeps its key (it was ignored)
    assert _api_keys(None) == ["from-vllm"]
    monkeypatch.setenv(ours, "from-env")
    assert _api_keys(None) == ["from-env"]
    assert _api_keys(["a", "b"]) == ["a", "b"]


# -- limits ----------------------------------------------------------------------------------------------------
def test_max_model_len_caps_prompt_plus_completion(server):
    ok = _post(server, "/v1/completions", {"model": MODEL, "prompt": [5] * 40, "max_tokens": MAX_LEN - 40})
    assert ok.status_code == 200, ok.text
    over = _post(server, "/v1/completions", {"model": MODEL, "prompt": [5] * 40, "max_tokens": MAX_LEN - 39})
    assert over.status_code == 400 and over.json()["error"]["param"] == "max_tokens"
    assert f"{MAX_LEN} tokens" in over.json()["error"]["message"]
    # unset max_tokens: the room left under the cap
    chat = _post(server, "/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "hi"}],
                                                  "ignore_eos": True})
    usage = chat.json()["usage"]
    assert usage["prompt_tokens"] + usage["completion_tokens"] == MAX_LEN
    long = _post(server, "/v1/completions", {"model": MODEL, "prompt": [5] * MAX_LEN})
    assert long.status_code == 400 and long.json()["error"]["param"] == "prompt"
    # vLLM's words, whose numbers clients parse ("maximum context length is N", "you requested M tokens")
    assert re.match(rf"max_tokens: This model's maximum context length is {MAX_LEN} tokens\. However, you requested "
                    rf"{MAX_LEN + 1} tokens \(40 in the messages, 9 in the completion\)\. Please reduce the length "
                    rf"of the messages or completion\.$", over.json()["error"]["message"])
    assert "your request has 48 input tokens" in long.json()["error"]["message"]
    # a completion without max_tokens gets 16 (vLLM's field default, as OpenAI's): a prompt that leaves less room is
    # refused as one that asks for 16, not answered with fewer tokens (a client relies on the 400 to see the overflow)
    for n, status in ((MAX_LEN - 16, 200), (MAX_LEN - 15, 400)):
        r = _post(server, "/v1/completions", {"model": MODEL, "prompt": [5] * n, "ignore_eos": True})
        assert r.status_code == status, r.text
        if status == 200:
            assert r.json()["usage"]["completion_tokens"] == 16
        else:
            assert r.json()["error"]["param"] == "max_tokens" and "16 in the completion" in r.json()["error"]["message"]


def _usage(r: httpx.Response, stream: bool) -> dict:
    """A response's usage: the body's, or a stream's last chunk's (include_usage)."""
    assert r.status_code == 200, r.text
    if not stream:
        return r.json()["usage"]
    return json.loads([e for e in sse_events(r.text.splitlines()) if e != "[DONE]"][-1])["usage"]


@pytest.mark.parametrize("stream", [False, True])
def test_truncate_prompt_tokens_minus_one_keeps_what_the_context_leaves(server, stream):
    """vLLM's truncate_prompt_tokens=-1: the prompt's last --max-model-len - max_tokens tokens (48 - 3, not the
    model's 2048), on both endpoints, streamed or not, so the request runs. A shorter prompt runs whole. 0 and
    values below -1 are 400s naming truncate_prompt_tokens."""
    cmpl, chat = "/v1/completions", "/v1/chat/completions"
    base = {"model": MODEL, "max_tokens": 3, "temperature": 0, "ignore_eos": True,
            **({"stream": True, "stream_options": {"include_usage": True}} if stream else {})}
    short = {cmpl: {"prompt": list(range(5, 25))}, chat: {"messages": [{"role": "user", "content": "To be, or not"}]}}
    for path, prompt in short.items():
        cut, whole = (_usage(_post(server, path, {**base, **prompt, **asked}), stream)
                      for asked in ({"truncate_prompt_tokens": -1}, {}))
        assert cut["prompt_tokens"] == whole["prompt_tokens"] and cut["completion_tokens"] == 3, (path, cut, whole)
        assert path == chat or cut["prompt_tokens"] == 20
    text = "to be or not " * 40
    for path, prompt in ((cmpl, {"prompt": list(range(5, 5 + 2 * MAX_LEN))}), (cmpl, {"prompt": text}),
                         (chat, {"messages": [{"role": "user", "content": text}]})):
        r = _post(server, path, {**base, **prompt})
        assert r.status_code == 400, r.text  # uncut: too long
        usage = _usage(_post(server, path, {**base, **prompt, "truncate_prompt_tokens": -1}), stream)
        assert usage["prompt_tokens"] == MAX_LEN - 3 and usage["completion_tokens"] == 3, (path, usage)
    for path, bad in ((cmpl, 0), (cmpl, -2), (chat, 0), (chat, -2), (cmpl, MAX_LEN + 1), (chat, MAX_LEN + 1)):
        r = _post(server, path, {**base, **short[path], "truncate_prompt_tokens": bad})
        assert r.status_code == 400 and r.json()["error"]["param"] == "truncate_prompt_tokens", r.text
        assert r.json()["error"]["message"].startswith("truncate_prompt_tokens: "), r.text


@pytest.mark.parametrize(("flags", "message"), [
    (["--max-model-len", "4096"], "--max-model-len: must be in [2, 2048]"),
    # (on the CPU a fraction in range is a warning, not an error: vLLM scripts pass it everywhere)
    (["--gpu-memory-utilization", "1.5", "--device", "cpu"], "--gpu-memory-utilization: must be in (0, 1]"),
], ids=["max-model-len-past-context", "gpu-memory-out-of-range"])
def test_bad_server_flags_stop_the_start(tiny_path, flags, message):
    cmd = [sys.executable, "-m", "loopserve.cli", "serve", "--model", str(tiny_path), "--port", "0", *flags]
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=90, cwd=REPO)
    assert run.returncode == 2, run.stdout + run.stderr
    assert message in run.stderr


@pytest.mark.parametrize(("flags", "message"), [
    (["--root-path", "api"], "--root-path: must start with '/'"),
    (["--log-stats-interval", "0"], "--log-stats-interval"),
    (["--max-log-len", "-1"], "--max-log-len"),
    # a NaN deadline would fire at once: every request in flight a 503 on SIGTERM, with no grace
    (["--shutdown-timeout", "nan"], "--shutdown-timeout: must be a number of seconds >= 0"),
    (["--shutdown-timeout", "-1"], "--shutdown-timeout: must be a number of seconds >= 0"),
    (["--shutdown-timeout", "inf"], "--shutdown-timeout: must be a number of seconds >= 0"),
])
def test_bad_server_flags_are_named(flags, message):
    from loopserve.cli import build_parser
    from loopserve.serve.cli import _check

    problem = _check(build_parser().parse_args(["serve", *flags]))
    assert problem is not None and problem.startswith(message)


def test_shutdown_timeout_zero_is_taken():
    from loopserve.cli import build_parser
    from loopserve.serve.cli import _check

    assert _check(build_parser().parse_args(["serve", "--shutdown-timeout", "0"])) is None


def test_gpu_memory_utilization_is_a_fraction(tiny_path):
    from loopserve.serve.api import load_engine

    for value in (0.0, 1.5):
        with pytest.raises(ValueError, match=r"gpu_memory_utilization: must be in \(0, 1\]"):
            load_engine(tiny_path, gpu_memory_utilization=value)
    with pytest.raises(ValueError, match="not both"):
        load_engine(tiny_path, gpu_memory_utilization=0.5, kv_cache_tokens=256)


# -- the log ---------------------------------------------------------------------------------------------------
def test_startup_summary_request_log_and_stats_lines(server):
    r = _post(server, "/v1/completions", {"model": MODEL, "prompt": "a prompt longer than eight characters",
                                          "max_tokens": 3}, **{"X-Request-Id": "logged-1"})
    assert r.status_code == 200
    text = _log_after(server, "Finished request cmpl-logged-1")
    assert re.search(r"model \S+ served as 'tiny': OuroForCausalLM, dtype float32, device cpu, r_max \d+, "
                     rf"max_model_len {MAX_LEN}, KV cache 1024 tokens \([\d.e-]+ GiB, blocks of 16\), "
                     r"kv_layout depth_indexed, scheduler cdb, max_num_seqs \d+, speculative decoding off", text), \
        text[:3000]
    received = [ln for ln in text.splitlines() if "Received request cmpl-logged-1" in ln]
    assert len(received) == 1 and "prompt: 'a prompt'," in received[0]  # cut at --max-log-len characters
    assert "Finished request cmpl-logged-1" in text and "length, " in text
    text = _log_after(server, "Avg prompt throughput")
    stats = [ln for ln in text.splitlines() if "Avg prompt throughput" in ln]
    assert re.search(r"Engine 000: Avg prompt throughput: [\d.]+ tokens/s, Avg generation throughput: [\d.]+ "
                     r"tokens/s, Running: \d+ reqs, Waiting: \d+ reqs, GPU KV cache usage: [\d.]+%, Prefix cache hit "
                     r"rate: [\d.]+%, Mean exit depth: ", stats[0])
    lines = [ln for ln in text.splitlines() if ln.strip()]
    assert all(TIMESTAMP.match(ln) for ln in lines), [ln for ln in lines if not TIMESTAMP.match(ln)][:5]
    # the server is idle now: no stats lines while nothing happens
    time.sleep(4 * STATS_S)
    before = server.log.read_text().count("Avg prompt throughput")
    time.sleep(4 * STATS_S)
    assert server.log.read_text().count("Avg prompt throughput") == before


# -- metrics ---------------------------------------------------------------------------------------------------
def test_phase_histograms_count_finished_requests(server):
    names = [f"loopserve:request_{p}_time_seconds_count" for p in ("queue", "prefill", "decode", "inference")]
    before = [metric(server, n, engine="0") for n in names]
    r = _post(server, "/v1/completions", {"model": MODEL, "prompt": "time me", "max_tokens": 4, "ignore_eos": True})
    assert r.status_code == 200
    deadline = time.monotonic() + 5
    while [metric(server, n) for n in names] != [b + 1 for b in before]:
        assert time.monotonic() < deadline, [metric(server, n) for n in names]
        time.sleep(0.05)
    e2e = metric(server, "loopserve:e2e_request_latency_seconds_sum")
    assert metric(server, "loopserve:request_inference_time_seconds_sum") <= e2e
    assert metric(server, "process_resident_memory_bytes") > 0


# -- device and dtype: auto --------------------------------------------------------------------------------------
@pytest.mark.parametrize(("declared", "device", "chosen"), [
    ("bfloat16", "cpu", "bfloat16"), ("float32", "cpu", "float32"), ("float16", "cpu", "bfloat16"),
    ("float16", "cuda", "bfloat16"), (None, "cpu", "float32"), ("int8", "cpu", "float32")])
def test_dtype_auto_follows_the_checkpoint(tmp_path, declared, device, chosen, caplog, monkeypatch):
    from loopserve import device as dev
    from loopserve.device import resolve_dtype

    monkeypatch.setattr(dev, "cpu_has_bf16_kernels", lambda: True)  # this CPU's kernels: the next test
    (tmp_path / "config.json").write_text(json.dumps({"torch_dtype": declared} if declared else {}))
    with caplog.at_level("INFO", logger="loopserve.device"):
        assert resolve_dtype("auto", tmp_path, device) == chosen
    assert ("float16" in caplog.text) == (declared == "float16")
    assert resolve_dtype("float64", tmp_path, device) == "float64"


@pytest.mark.parametrize("kernels", [True, False])
@pytest.mark.parametrize("declared", ["bfloat16", "float16"])
def test_dtype_auto_on_a_cpu_without_bf16_kernels_is_float32(tmp_path, monkeypatch, caplog, kernels, declared):
    from loopserve import device as dev

    monkeypatch.setattr(dev, "cpu_has_bf16_kernels", lambda: kernels)
    (tmp_path / "config.json").write_text(json.dumps({"torch_dtype": declared}))
    with caplog.at_level("INFO", logger="loopserve.device"):
        assert dev.resolve_dtype("auto", tmp_path, "cpu") == ("bfloat16" if kernels else "float32")
    assert ("no bfloat16 matrix kernels" in caplog.text) == (not kernels)
    # one line, saying what happens (a float16 checkpoint was said to load as bfloat16, then as float32)
    lines = [r.getMessage() for r in caplog.records if r.name == "loopserve.device"]
    assert len(lines) == (declared == "float16" or not kernels), lines
    assert all(("as float32" in line) == (not kernels) for line in lines), lines
    assert dev.resolve_dtype("auto", tmp_path, "cuda:0") == "bfloat16"  # the rule is the CPU's only
    assert dev.resolve_dtype("bfloat16", tmp_path, "cpu") == "bfloat16"  # an explicit dtype is kept


def test_loading_with_dtype_and_device_auto(tmp_path):
    import torch

    from loopserve.device import cpu_has_bf16_kernels
    from loopserve.models.loader import load_model

    path = make_tiny(tmp_path / "half", TinySpec(arch="ouro", seed=2))
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, "torch_dtype": "float16"}))
    p = next(load_model(path, "auto", "auto").model.parameters())
    gpu = torch.cuda.is_available()
    assert p.dtype == (torch.bfloat16 if gpu or cpu_has_bf16_kernels() else torch.float32)
    assert p.device.type == ("cuda" if gpu else "cpu")


def test_device_auto(monkeypatch):
    import torch

    from loopserve.device import resolve_device

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert resolve_device("auto") == "cpu"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert resolve_device("auto") == "cuda"
    assert resolve_device("cpu") == "cpu"


@pytest.mark.parametrize(("path", "body", "param"), [
    ("/v1/chat/completions", {"logprobs": True, "top_logprobs": SERVER_MAX_LOGPROBS + 1}, "top_logprobs"),
    ("/v1/completions", {"logprobs": SERVER_MAX_LOGPROBS + 1}, "logprobs"),
    ("/v1/completions", {"prompt_logprobs": SERVER_MAX_LOGPROBS + 1}, "prompt_logprobs"),
    ("/v1/chat/completions", {"prompt_logprobs": SERVER_MAX_LOGPROBS + 1}, "prompt_logprobs"),
    # vLLM's -1, the whole vocabulary: past the cap too
    ("/v1/chat/completions", {"logprobs": True, "top_logprobs": -1}, "top_logprobs"),
    ("/v1/completions", {"logprobs": -1}, "logprobs"),
    ("/v1/completions", {"prompt_logprobs": -1}, "prompt_logprobs"),
])
def test_max_logprobs_caps_requests_naming_their_field(server, path, body, param):
    """vLLM's --max-logprobs: a request asking for more is a 400 naming the field it asked in (a chat request's
    is top_logprobs); as many as the cap is served. (The flag was refused at start unless it allowed 20.)"""
    base = {"messages": [{"role": "user", "content": "hi"}]} if "chat" in path else {"prompt": "hi"}
    r = _post(server, ROOT + path, {"model": MODEL, **base, "max_tokens": 2, **body})
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
    assert r.json()["error"]["message"].startswith(f"{param}: at most {SERVER_MAX_LOGPROBS}"), r.text
    if -1 in body.values():
        assert re.search(r" got -1 \(the whole vocabulary, \d+ tokens\)$", r.json()["error"]["message"]), r.text
    below = {k: -2 if v == -1 else v for k, v in body.items()}
    if below != body:  # (any other negative count is no count at all)
        r = _post(server, ROOT + path, {"model": MODEL, **base, "max_tokens": 2, **below})
        assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
        assert ">= 0, or -1 (the whole vocabulary)" in r.json()["error"]["message"], r.text
    at_cap = {k: SERVER_MAX_LOGPROBS if isinstance(v, int) and not isinstance(v, bool) else v
              for k, v in body.items()}
    assert _post(server, ROOT + path, {"model": MODEL, **base, "max_tokens": 2, **at_cap}).status_code == 200


def test_beam_search_under_max_logprobs_is_refused_by_its_width(server):
    """A beam search step asks for the top 2 * n logprobs: past the server's --max-logprobs it is a 400 naming n (it
    named logprobs, a field the request never sent)."""
    for path, base in (("/v1/completions", {"prompt": "hi"}),
                       ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]})):
        r = _post(server, ROOT + path, {"model": MODEL, **base, "max_tokens": 2, "use_beam_search": True, "n": 2})
        assert r.status_code == 400 and r.json()["error"]["param"] == "n", r.text
        assert "at most 1 under the server's --max-logprobs 3" in r.json()["error"]["message"], r.text
        ok = _post(server, ROOT + path, {"model": MODEL, **base, "max_tokens": 2, "use_beam_search": True, "n": 1})
        assert ok.status_code == 200, ok.text


def test_unknown_fields_are_found_at_any_depth_without_walking_lists_of_values():
    """Nested unknown fields are found in every model a body holds; lists of plain values (token ids: 2M of them
    took 0.8 s of the event loop) are not walked."""
    from loopserve.serve.protocol import (
        ChatCompletionRequest,
        CompletionRequest,
        _nesting_fields,
        parse_body,
        unknown_fields,
    )

    chat = parse_body(ChatCompletionRequest, json.dumps({
        "messages": [{"role": "user", "content": [{"type": "text", "text": "hi", "bogus": 1}]}],
        "tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}, "odd": 2}}],
        "stream": True, "stream_options": {"include_usage": True, "extra": 3}, "top": 4}).encode())
    assert sorted(unknown_fields(chat)) == ["messages.0.content.0.bogus", "stream_options.extra",
                                            "tools.0.function.odd", "top"]
    walked = set(_nesting_fields(CompletionRequest))
    assert {"prompt", "allowed_token_ids", "stop_token_ids", "logit_bias"}.isdisjoint(walked)
    assert "stream_options" in walked and "messages" in _nesting_fields(ChatCompletionRequest)
