"""The OpenAI-compatible server, end to end: a real `loopserve serve` process on a loopback port
with a tiny checkpoint, driven by the official `openai` client (API behaviour, streaming, usage,
extension fields) and by raw `httpx` (the hard edges: a table of bad inputs, body limit, API key,
mid-stream disconnects, concurrent clients against the offline API, an overload burst, SIGTERM).

Servers run in float64 where outputs are compared with the offline `LLM`, so batch composition
cannot move a sampled token.
"""

from __future__ import annotations

import asyncio
import json
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from loopserve import LLM, SamplingParams
from loopserve_lab.tiny import TinySpec, make_tiny
from tests.server_helpers import MODEL, Server, metric, run_server, sse_events, wait_idle

pytestmark = pytest.mark.timeout(180)

API_KEY = "test-key"
AUTH = {"Authorization": f"Bearer {API_KEY}"}
MAX_NUM_SEQS = 4
MAX_QUEUED = 8
KV_TOKENS = 8192
BODY_LIMIT = 65536
MAX_LEN = 2048  # TinySpec.max_position


# -- fixtures ---------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module", autouse=True)
def _one_thread() -> Iterator[None]:
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def ouro_path(tmp_path_factory) -> Path:
    return make_tiny(tmp_path_factory.mktemp("tiny-ouro"), TinySpec(arch="ouro", seed=0))


@pytest.fixture(scope="module")
def server(ouro_path, tmp_path_factory) -> Iterator[Server]:
    log = tmp_path_factory.mktemp("logs") / "server.log"
    with run_server(ouro_path, log, "--dtype", "float64", "--kv-cache-tokens", str(KV_TOKENS),
                    "--max-num-seqs", str(MAX_NUM_SEQS), "--max-queued-requests", str(MAX_QUEUED),
                    "--api-key", API_KEY, "--max-request-body-bytes", str(BODY_LIMIT)) as s:
        yield s


@pytest.fixture(scope="module")
def offline(ouro_path) -> LLM:
    return LLM(ouro_path, dtype="float64", device="cpu", kv_cache_tokens=KV_TOKENS)


@pytest.fixture
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key=API_KEY, max_retries=0, timeout=60)


def offline_one(llm: LLM, prompt, **params):
    return llm.generate(prompt, SamplingParams(**params))[0]


# -- API behaviour (openai client) -----------------------------------------------------------------------------
def test_health_models_and_metric_names(server, client, ouro_path):
    assert httpx.get(server.url + "/health").status_code == 200
    models = client.models.list()
    assert [m.id for m in models.data] == [MODEL]
    assert models.data[0].model_extra["root"] == MODEL  # the model's path only with --expose-model-path
    assert str(ouro_path) not in httpx.get(server.url + "/v1/models", headers=AUTH).text
    text = httpx.get(server.url + "/metrics").text
    for name in ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc", "prompt_tokens_total",
                 "generation_tokens_total", "time_to_first_token_seconds", "inter_token_latency_seconds",
                 "e2e_request_latency_seconds", "exit_depth_bucket", "core_batch_size_bucket", "core_loops_total",
                 "refill_events_total", "deferred_signal_steps_total", "num_preemptions_total",
                 "prefix_cache_queries_total", "prefix_cache_hits_total", "swap_in_shared_blocks_total",
                 "spec_decode_num_drafts_total", "spec_decode_num_draft_tokens_total",
                 "spec_decode_num_accepted_tokens_total", "request_queue_time_seconds_bucket",
                 "request_prefill_time_seconds_bucket",
                 "request_decode_time_seconds_bucket", "request_inference_time_seconds_bucket"):
        assert f"loopserve:{name}" in text, name
    assert 'engine="0"' in text and "process_cpu_seconds_total" in text and "python_gc_objects_collected" in text
    assert "_created" not in text  # (no creation-time series beside each counter and histogram, as in vLLM)
    assert httpx.get(server.url + "/tokenizer_info").status_code == 404  # (only with --enable-tokenizer-info-endpoint)


def test_prefix_cache_usage_and_metrics(server, client):
    """A prompt behind a prefix an earlier one computed reports OpenAI's cached_tokens, and the two
    vLLM counters move by the same tokens."""
    def counter(name: str) -> float:
        line = next(x for x in httpx.get(server.url + "/metrics").text.splitlines()
                    if x.startswith(f"loopserve:{name}_total{{"))
        return float(line.rsplit(" ", 1)[1])

    system = [(7 * j) % 300 + 3 for j in range(70)]  # 4 full blocks of 16, then 6 tokens
    first = client.completions.create(model=MODEL, prompt=system + [1, 2], max_tokens=2)
    hits = counter("prefix_cache_hits")
    queries = counter("prefix_cache_queries")
    second = client.completions.create(model=MODEL, prompt=system + [3, 4, 5], max_tokens=2)
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    assert second.usage.prompt_tokens_details.cached_tokens == 64
    assert counter("prefix_cache_hits") - hits == 64 and counter("prefix_cache_queries") - queries == 73


def test_completion_equals_offline_with_extensions(client, offline):
    prompt = "ROMEO: But soft, what light"
    r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=16, temperature=0.8, seed=7,
                                  extra_body={"exit_threshold": 0.2, "return_token_ids": True})
    want = offline_one(offline, prompt, max_tokens=16, temperature=0.8, seed=7, exit_threshold=0.2)
    c, w = r.choices[0], want.outputs[0]
    assert c.text == w.text
    assert c.finish_reason == w.finish_reason == "length"
    assert c.model_extra["token_ids"] == w.token_ids
    assert c.model_extra["exit_depths"] == w.exit_depths
    assert min(w.exit_depths[1:]) < max(w.exit_depths)  # early exits happened
    assert r.usage.prompt_tokens == len(want.prompt_token_ids)
    assert r.usage.completion_tokens == 16
    assert r.usage.total_tokens == r.usage.prompt_tokens + 16
    assert r.usage.model_extra["loops"] == want.metrics.loops_run > 0


def test_loop_bounds_in_body(client):
    r = client.completions.create(model=MODEL, prompt="abc", max_tokens=8, temperature=0, extra_body={"max_loops": 2})
    depths = r.choices[0].model_extra["exit_depths"]
    assert depths[0] == 2 and max(depths) <= 2
    r = client.completions.create(model=MODEL, prompt="abc", max_tokens=8, temperature=0,
                                  extra_body={"min_loops": 3, "exit_threshold": 0.05})
    assert min(r.choices[0].model_extra["exit_depths"]) >= 3


def test_bench_style_stream(server, offline):
    """What `loopserve bench serve` sends: token ids, ignore_eos, greedy, usage, token ids back, a trace."""
    ids = offline.tokenizer.encode("bench me")
    body = {"model": MODEL, "prompt": ids, "max_tokens": 6, "temperature": 0.0, "stream": True, "ignore_eos": True,
            "stream_options": {"include_usage": True}, "return_token_ids": True, "exit_trace": [1, 2, 3]}
    with httpx.stream("POST", server.url + C, json=body, headers=AUTH, timeout=30) as r:
        assert r.status_code == 200
        events = list(sse_events(r.iter_lines()))
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 6
    tokens = [t for ch in chunks[:-1] for t in ch["choices"][0]["token_ids"]]
    depths = [d for ch in chunks[:-1] for d in ch["choices"][0]["exit_depths"]]
    assert chunks[0]["choices"][0]["prompt_token_ids"] == ids
    want = offline_one(offline, ids, max_tokens=6, temperature=0.0, ignore_eos=True, exit_trace=[1, 2, 3])
    assert tokens == want.outputs[0].token_ids
    assert depths == want.outputs[0].exit_depths == [4, 1, 2, 3, 4, 4]


def test_chat_equals_offline(client, offline):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello there"}]
    r = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=10, temperature=0.7, seed=3)
    tok = offline.tokenizer
    ids = tok.apply_chat_template(messages, add_generation_prompt=True)
    want = offline_one(offline, {"prompt_token_ids": ids}, max_tokens=10, temperature=0.7, seed=3)
    c = r.choices[0]
    assert c.message.role == "assistant"
    assert c.message.content == want.outputs[0].text
    assert c.model_extra["exit_depths"] == want.outputs[0].exit_depths
    assert r.usage.prompt_tokens == len(ids)
    assert r.usage.completion_tokens == len(want.outputs[0].token_ids)


def _ascii_stop(text: str) -> str | None:
    for i in range(3, len(text) - 2):
        s = text[i:i + 2]
        if s.isascii() and s.isalpha() and text.find(s) == i:
            return s
    return None


def test_completion_stream_equals_non_stream(client):
    args = dict(model=MODEL, prompt="The quick brown fox", max_tokens=24, temperature=0.9, seed=11)
    full = client.completions.create(**args, extra_body={"exit_threshold": 0.3})
    chunks = list(client.completions.create(**args, stream=True, stream_options={"include_usage": True},
                                            extra_body={"exit_threshold": 0.3}))
    usage = chunks[-1]
    assert usage.choices == [] and usage.usage.completion_tokens == 24
    assert usage.usage.model_extra["loops"] == full.usage.model_extra["loops"]
    body = chunks[:-1]
    assert all(ch.usage is None for ch in body)
    assert "".join(ch.choices[0].text for ch in body) == full.choices[0].text
    depths = [d for ch in body for d in ch.choices[0].model_extra["exit_depths"]]
    assert depths == full.choices[0].model_extra["exit_depths"]
    assert all(len(ch.choices[0].model_extra["exit_depths"]) == 1 for ch in body)  # one chunk per token
    assert [ch.choices[0].finish_reason for ch in body] == [None] * (len(body) - 1) + ["length"]
    # a stop string: nothing of it is streamed, and both paths cut at the same place
    stop = _ascii_stop(full.choices[0].text)
    assert stop is not None
    cut = full.choices[0].text[: full.choices[0].text.find(stop)]
    stopped = client.completions.create(**args, stop=[stop], extra_body={"exit_threshold": 0.3})
    assert stopped.choices[0].text == cut and stopped.choices[0].finish_reason == "stop"
    streamed = list(client.completions.create(**args, stop=[stop], stream=True, extra_body={"exit_threshold": 0.3}))
    assert "".join(ch.choices[0].text for ch in streamed) == cut
    assert streamed[-1].choices[0].finish_reason == "stop"


def test_chat_stream(client):
    messages = [{"role": "user", "content": "Tell me a story"}]
    full = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=12, seed=5)
    chunks = list(client.chat.completions.create(model=MODEL, messages=messages, max_tokens=12, seed=5, stream=True,
                                                 stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    assert text == full.choices[0].message.content
    assert chunks[-1].choices == [] and chunks[-1].usage.total_tokens == full.usage.total_tokens
    finals = [ch.choices[0].finish_reason for ch in chunks if ch.choices and ch.choices[0].finish_reason]
    assert finals == [full.choices[0].finish_reason]


def test_logprobs(client, offline):
    prompt = "logprobs please"
    r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=6, temperature=0.8, seed=2, logprobs=2)
    want = offline_one(offline, prompt, max_tokens=6, temperature=0.8, seed=2, logprobs=2).outputs[0]
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 6
    for got, tid, entry in zip(lp.token_logprobs, want.token_ids, want.logprobs, strict=True):
        assert got == pytest.approx(entry[tid].logprob)
    assert all(len(t) >= 2 for t in lp.top_logprobs)
    assert lp.text_offset[0] == 0
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}], max_tokens=4,
                                          logprobs=True, top_logprobs=3, seed=1)
    content = chat.choices[0].logprobs.content
    assert len(content) == chat.usage.completion_tokens
    assert all(len(c.top_logprobs) == 3 and c.logprob <= 0 for c in content)


def test_batch_prompts(client, offline):
    prompts = ["first prompt", "second one"]
    r = client.completions.create(model=MODEL, prompt=prompts, max_tokens=5, temperature=0.6, seed=9)
    want = offline.generate(prompts, SamplingParams(max_tokens=5, temperature=0.6, seed=9))
    assert [c.index for c in r.choices] == [0, 1]
    assert [c.text for c in r.choices] == [w.outputs[0].text for w in want]
    assert r.usage.completion_tokens == 10


def test_penalties_and_stop_fields_equal_offline(client, offline):
    """OpenAI's penalties and logit_bias as client arguments, vLLM's fields in extra_body: the offline result."""
    prompt = "ROMEO: But soft, what light"
    vllm = dict(repetition_penalty=1.3, min_tokens=3, include_stop_str_in_output=True, truncate_prompt_tokens=4)
    r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=12, temperature=0.8, seed=3,
                                  presence_penalty=0.5, frequency_penalty=-0.4, logit_bias={"17": 2.5},
                                  extra_body={**vllm, "return_token_ids": True})
    want = offline_one(offline, prompt, max_tokens=12, temperature=0.8, seed=3, presence_penalty=0.5,
                       frequency_penalty=-0.4, logit_bias={17: 2.5}, **vllm)
    c, w = r.choices[0], want.outputs[0]
    assert (c.text, c.model_extra["token_ids"], c.finish_reason) == (w.text, w.token_ids, w.finish_reason)
    assert r.usage.prompt_tokens == len(want.prompt_token_ids) == 4
    assert c.model_extra["prompt_token_ids"] == want.prompt_token_ids
    # stop_reason: the stop string, kept in the text when asked; null at length
    assert c.model_extra["stop_reason"] is None and c.finish_reason == "length"
    protected = len(offline.tokenizer.decode(w.token_ids[:3]))  # min_tokens: no stop string in there
    stop = _ascii_stop(w.text[protected:])
    assert stop is not None
    kw = dict(max_tokens=12, temperature=0.8, seed=3, presence_penalty=0.5, frequency_penalty=-0.4, stop=[stop])
    kept = client.completions.create(model=MODEL, prompt=prompt, **kw, logit_bias={"17": 2.5}, extra_body=vllm)
    want_kept = offline_one(offline, prompt, **kw, logit_bias={17: 2.5}, **vllm).outputs[0]
    kept = kept.choices[0]
    assert kept.text == want_kept.text == w.text[: w.text.find(stop, protected) + len(stop)]
    assert (kept.finish_reason, kept.model_extra["stop_reason"]) == ("stop", want_kept.stop_reason) == ("stop", stop)
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}], max_tokens=6,
                                          temperature=0, presence_penalty=1.0, extra_body={"min_tokens": 6})
    assert chat.usage.completion_tokens == 6 and chat.choices[0].model_extra["stop_reason"] is None
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=MODEL, prompt=prompt, max_tokens=4, presence_penalty=3)


@pytest.mark.parametrize(("path", "fields", "param"), [
    ("/v1/completions", {"presence_penalty": -2.5}, "presence_penalty"),
    ("/v1/completions", {"repetition_penalty": 0}, "repetition_penalty"),
    ("/v1/completions", {"stop_token_ids": [100000]}, "stop_token_ids"),  # outside the vocabulary, as vLLM's
    ("/v1/completions", {"logit_bias": {"five": 1}}, "logit_bias"),
    ("/v1/completions", {"logit_bias": {"100000": 1}}, "logit_bias"),  # outside the vocabulary
    ("/v1/completions", {"min_tokens": 5, "max_tokens": 4}, "min_tokens"),
    ("/v1/completions", {"truncate_prompt_tokens": 0}, "truncate_prompt_tokens"),
    ("/v1/chat/completions", {"frequency_penalty": 9}, "frequency_penalty"),
    ("/v1/chat/completions", {"min_tokens": -1}, "min_tokens"),
])
def test_bad_adjustment_names_the_field(server, path, fields, param):
    body = {**({"prompt": "hi"} if "chat" not in path else {"messages": [{"role": "user", "content": "hi"}]}),
            "model": MODEL, "max_tokens": 4, **fields}
    r = httpx.post(server.url + path, json=body, headers=AUTH, timeout=30)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param and r.json()["error"]["message"].startswith(param), r.text


# -- hard edges (httpx) -----------------------------------------------------------------------------------------
C, H = "/v1/completions", "/v1/chat/completions"
GOOD_C = {"model": MODEL, "prompt": "hi", "max_tokens": 4}
GOOD_H = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}


def _c(**kw):
    return {**GOOD_C, **kw}


def _h(**kw):
    return {**GOOD_H, **kw}


def _drop(d: dict, key: str) -> dict:
    return {k: v for k, v in d.items() if k != key}


# (case id, method, path, body: dict | bytes | None, headers or None (= the right key), expected status)
BAD_INPUTS = [
    ("malformed-json", "POST", C, b'{"model": "tiny", "prompt": "hi",', None, 400),
    ("json-not-an-object", "POST", C, b"[1, 2]", None, 400),
    ("empty-body", "POST", C, b"", None, 400),
    ("not-utf8", "POST", C, b'\xff\xfe{"prompt": 1}', None, 400),
    ("nan-literal", "POST", C, b'{"model": "tiny", "prompt": "hi", "temperature": NaN}', None, 400),
    ("missing-prompt", "POST", C, _drop(GOOD_C, "prompt"), None, 400),
    ("prompt-wrong-type", "POST", C, _c(prompt=5), None, 400),
    ("prompt-mixed-list", "POST", C, _c(prompt=["a", 1]), None, 400),
    ("prompt-empty-string", "POST", C, _c(prompt=""), None, 400),
    ("prompt-empty-list", "POST", C, _c(prompt=[]), None, 400),
    ("prompt-empty-in-batch", "POST", C, _c(prompt=["a", ""]), None, 400),
    ("prompt-longer-than-context", "POST", C, _c(prompt=[5] * (MAX_LEN + 10)), None, 400),
    ("prompt-fills-context", "POST", C, _c(prompt=[5] * MAX_LEN), None, 400),
    ("prompt-plus-max-tokens-over-context", "POST", C, _c(prompt=[5] * 2000, max_tokens=100), None, 400),
    ("token-id-out-of-vocab", "POST", C, _c(prompt=[10**6]), None, 400),
    ("token-id-negative", "POST", C, _c(prompt=[-1]), None, 400),
    ("max_tokens-string", "POST", C, _c(max_tokens="four"), None, 400),
    ("max_tokens-float", "POST", C, _c(max_tokens=4.5), None, 400),
    ("max_tokens-list", "POST", C, _c(max_tokens=[4]), None, 400),
    ("max_tokens-negative", "POST", C, _c(max_tokens=-1), None, 400),
    ("max_tokens-zero", "POST", C, _c(max_tokens=0), None, 400),
    ("max_tokens-huge", "POST", C, _c(max_tokens=10**9), None, 400),
    ("max_tokens-beyond-int64", "POST", C, _c(max_tokens=10**30), None, 400),
    ("temperature-negative", "POST", C, _c(temperature=-0.5), None, 400),
    ("temperature-string", "POST", C, _c(temperature="hot"), None, 400),
    ("top_p-zero", "POST", C, _c(top_p=0), None, 400),
    ("top_p-above-one", "POST", C, _c(top_p=1.5), None, 400),
    ("top_k-negative", "POST", C, _c(top_k=-5), None, 400),
    ("min_p-above-one", "POST", C, _c(min_p=2), None, 400),
    ("logprobs-too-many", "POST", C, _c(logprobs=50), None, 400),
    ("logprobs-negative", "POST", C, _c(logprobs=-1), None, 400),
    ("seed-string", "POST", C, _c(seed="seven"), None, 400),
    ("seed-beyond-64-bits", "POST", C, _c(seed=2**64), None, 400),
    ("seed-beyond-int64", "POST", C, _c(seed=2**63), None, 400),  # (vLLM's server: a signed 64-bit seed)
    ("seed-below-int64", "POST", C, _c(seed=-(2**63) - 1), None, 400),
    ("stop-empty-string", "POST", C, _c(stop=""), None, 400),
    ("stop-wrong-type", "POST", C, _c(stop=5), None, 400),
    ("n-zero", "POST", C, _c(n=0), None, 400),
    ("n-too-many", "POST", C, _c(n=1000), None, 400),
    ("best_of-2", "POST", C, _c(best_of=2), None, 400),
    ("prompt_logprobs-too-many", "POST", C, _c(prompt_logprobs=50), None, 400),
    ("suffix", "POST", C, _c(suffix="tail"), None, 400),
    ("frequency_penalty-above-two", "POST", C, _c(frequency_penalty=2.5), None, 400),
    ("stream-wrong-type", "POST", C, _c(stream="maybe"), None, 400),
    ("stream_options-without-stream", "POST", C, _c(stream_options={"include_usage": True}), None, 400),
    ("exit_trace-zero-depth", "POST", C, _c(exit_trace=[0, 1]), None, 400),
    ("min_loops-above-max_loops", "POST", C, _c(min_loops=3, max_loops=2), None, 400),
    ("max_loops-above-r_max", "POST", C, _c(max_loops=99), None, 400),
    ("max_loops-zero", "POST", C, _c(max_loops=0), None, 400),
    ("exit_threshold-negative", "POST", C, _c(exit_threshold=-1), None, 400),
    ("exit_threshold-gate-above-one", "POST", C, _c(exit_threshold=1.5), None, 400),
    ("exit_policy-unknown", "POST", C, _c(exit_policy="magic"), None, 400),
    ("unknown-model", "POST", C, _c(model="gpt-4"), None, 404),
    ("chat-missing-messages", "POST", H, _drop(GOOD_H, "messages"), None, 400),
    ("chat-empty-messages", "POST", H, _h(messages=[]), None, 400),
    ("chat-bad-role", "POST", H, _h(messages=[{"role": "", "content": "hi"}]), None, 400),
    ("chat-content-wrong-type", "POST", H, _h(messages=[{"role": "user", "content": 5}]), None, 400),
    ("chat-image-part", "POST", H,
     _h(messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]), None, 400),
    ("chat-top_logprobs-without-logprobs", "POST", H, _h(top_logprobs=2), None, 400),
    ("chat-top_logprobs-too-many", "POST", H, _h(logprobs=True, top_logprobs=50), None, 400),
    ("chat-tools", "POST", H, _h(tools=[{"type": "function", "function": {"name": "f"}}]), None, 400),
    ("chat-response_format-unknown-type", "POST", H, _h(response_format={"type": "yaml"}), None, 400),
    ("chat-max_completion_tokens-negative", "POST", H, _h(max_completion_tokens=-3), None, 400),
    ("chat-max_tokens-over-context", "POST", H, _h(max_tokens=MAX_LEN), None, 400),
    ("chat-unknown-model", "POST", H, _h(model="gpt-4"), None, 404),
    ("no-api-key", "POST", C, GOOD_C, {}, 401),
    ("wrong-api-key", "POST", C, GOOD_C, {"Authorization": "Bearer nope"}, 401),
    ("models-without-key", "GET", "/v1/models", None, {}, 401),
    ("unknown-route", "GET", "/v1/nope", None, None, 404),
    ("wrong-method", "GET", C, None, None, 405),
    ("body-over-limit", "POST", C, _c(prompt="x" * (BODY_LIMIT + 1)), None, 413),
]


@pytest.mark.parametrize(("method", "path", "body", "headers", "status"), [c[1:] for c in BAD_INPUTS],
                         ids=[c[0] for c in BAD_INPUTS])
def test_bad_input(server, method, path, body, headers, status):
    kwargs: dict = {"headers": AUTH if headers is None else headers, "timeout": 30}
    if isinstance(body, bytes):
        kwargs["content"] = body
        kwargs["headers"] = {**kwargs["headers"], "Content-Type": "application/json"}
    elif body is not None:
        kwargs["json"] = body
    r = httpx.request(method, server.url + path, **kwargs)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert isinstance(err["message"], str) and err["message"]
    assert err["code"] == status and isinstance(err["type"], str)


def test_the_bearer_scheme_is_case_insensitive(server):
    """RFC 7235: an auth scheme is matched case-insensitively ("bearer k" was a 401); the key is not."""
    for header in (f"bearer {API_KEY}", f"BEARER {API_KEY}", f"Bearer {API_KEY}", f"bEaReR  {API_KEY}"):
        r = httpx.get(server.url + "/v1/models", headers={"Authorization": header}, timeout=30)
        assert r.status_code == 200, (header, r.text)
    for header in (f"bearer {API_KEY.upper()}", f"Basic {API_KEY}", f"Bearer{API_KEY}", API_KEY, "bearer"):
        r = httpx.get(server.url + "/v1/models", headers={"Authorization": header}, timeout=30)
        assert r.status_code == 401, (header, r.text)


def test_too_many_top_logprobs_names_the_field(server):
    r = httpx.post(server.url + H, json=_h(logprobs=True, top_logprobs=50), headers=AUTH, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == "top_logprobs", r.text


def test_chunked_body_over_limit(server):
    def chunks():
        for _ in range(BODY_LIMIT // 1024 + 2):
            yield b" " * 1024

    r = httpx.post(server.url + C, content=chunks(), headers={**AUTH, "Content-Type": "application/json"}, timeout=30)
    assert r.status_code == 413 and r.json()["error"]["code"] == 413


def test_open_endpoints_need_no_key(server):
    assert httpx.get(server.url + "/health").status_code == 200
    assert httpx.get(server.url + "/metrics").status_code == 200
    assert httpx.get(server.url + "/version").status_code == 200


def test_no_cross_origin_access_by_default(server):
    r = httpx.get(server.url + "/v1/models", headers={**AUTH, "Origin": "https://app.example"})
    assert r.status_code == 200 and "access-control-allow-origin" not in r.headers
    pre = httpx.options(server.url + C, headers={"Origin": "https://app.example",
                                                 "Access-Control-Request-Method": "POST"})
    assert pre.status_code == 405 and "access-control-allow-origin" not in pre.headers


def test_a_logit_bias_past_100_is_clamped_as_vllms_server_clamps_it(server):
    """(It was a 400; vLLM's server clamps a request's biases into [-100, 100].)"""
    def tokens(bias: float) -> list[int]:
        r = httpx.post(server.url + C, json=_c(max_tokens=3, temperature=0, logit_bias={"5": bias}, ignore_eos=True,
                                              return_token_ids=True), headers=AUTH, timeout=60)
        assert r.status_code == 200, r.text
        return r.json()["choices"][0]["token_ids"]

    assert tokens(1000) == tokens(100) == [5, 5, 5]
    assert 5 not in tokens(-1e9)


def test_max_tokens_null_on_completions_is_the_room_left_as_vllms(server, client):
    """An explicit null runs to the context's end, as vLLM's `get_max_tokens` reads it (it was the field's default
    16, which only an omitted field gets)."""
    body = _c(prompt=[5] * (MAX_LEN - 30), ignore_eos=True)
    body.pop("max_tokens")
    r = httpx.post(server.url + C, json=body, headers=AUTH, timeout=60)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 16, r.text
    r = httpx.post(server.url + C, json={**body, "max_tokens": None}, headers=AUTH, timeout=60)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 30, r.text
    done = client.completions.create(model=MODEL, prompt=[5] * (MAX_LEN - 20), max_tokens=None,
                                     extra_body={"ignore_eos": True})  # (the openai client sends null)
    assert done.usage.completion_tokens == 20
    beams = httpx.post(server.url + C, json={**body, "max_tokens": None, "use_beam_search": True, "n": 2,
                                            "temperature": 0, "prompt": [5] * (MAX_LEN - 3)}, headers=AUTH, timeout=60)
    assert beams.status_code == 200, beams.text  # (a beam search too: to the end of the context, 3 tokens here)
    assert [len(c["text"]) > 0 for c in beams.json()["choices"]] == [True, True]
    assert beams.json()["usage"]["completion_tokens"] == 2 * 3, beams.text


def test_chat_echo_returns_the_prompts_logprobs_as_vllms(server):
    """vLLM's chat route asks an echo for the prompt's logprobs (top_logprobs of them): they were missing."""
    r = httpx.post(server.url + H, json=_h(echo=True, max_tokens=2), headers=AUTH, timeout=60)
    assert r.status_code == 200, r.text
    plp = r.json().get("prompt_logprobs")
    assert isinstance(plp, list) and plp[0] is None and len(plp) > 2 and all(len(e) >= 1 for e in plp[1:]), r.text
    r = httpx.post(server.url + H, json=_h(max_tokens=2), headers=AUTH, timeout=60)
    assert r.json().get("prompt_logprobs") is None, r.text
    # an explicit null top_logprobs asks for none (vLLM's default, 0, is the omitted field's); a stream carries none
    r = httpx.post(server.url + H, json=_h(echo=True, max_tokens=2, top_logprobs=None), headers=AUTH, timeout=60)
    assert r.json().get("prompt_logprobs") is None, r.text
    with httpx.stream("POST", server.url + H, json=_h(echo=True, max_tokens=2, stream=True), headers=AUTH,
                      timeout=60) as s:
        chunks = [json.loads(e) for e in sse_events(s.iter_lines()) if e != "[DONE]"]
    assert chunks and not any("prompt_logprobs" in c for c in chunks)


def test_still_serving_after_bad_inputs(server, client):
    assert httpx.get(server.url + "/health").status_code == 200
    # ignore_eos: an unseeded sample may draw EOS early, which is not what this test is about
    r = client.completions.create(model=MODEL, prompt="still here", max_tokens=3, extra_body={"ignore_eos": True})
    assert r.usage.completion_tokens == 3
    wait_idle(server)


def _long_body(stream: bool) -> dict:
    return {"model": MODEL, "prompt": "a long one", "max_tokens": 1800, "ignore_eos": True, "stream": stream}


def test_disconnect_mid_stream_frees_kv(server):
    wait_idle(server)
    aborted = metric(server, "loopserve:request_success_total", 0.0, finished_reason="abort")
    with httpx.Client(timeout=30) as c, c.stream("POST", server.url + C, json=_long_body(True), headers=AUTH) as r:
        assert r.status_code == 200
        events = sse_events(r.iter_lines())  # kept open: closing the iterator closes the connection
        for _ in range(5):
            assert json.loads(next(events))["choices"][0]["finish_reason"] is None
        assert metric(server, "loopserve:kv_cache_usage_perc") > 0
        assert metric(server, "loopserve:num_requests_running") == 1
        events.close()  # the client goes away mid-stream
    wait_idle(server)  # the request was aborted and its KV blocks freed
    assert metric(server, "loopserve:request_success_total", finished_reason="abort") == aborted + 1


def test_disconnect_while_waiting_non_streaming(server):
    wait_idle(server)
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(server.url + C, json=_long_body(False), headers=AUTH, timeout=httpx.Timeout(30, read=0.5))
    wait_idle(server)


def test_concurrent_clients_equal_offline(server, offline):
    cases = [dict(prompt=f"client {i} says", max_tokens=10 + i, temperature=0.5 + 0.1 * i, seed=100 + i,
                  exit_threshold=[None, 0.2, 0.5][i % 3]) for i in range(6)]

    async def one(aclient: openai.AsyncOpenAI, case: dict, stream: bool) -> tuple[str, list[int]]:
        extra = {"exit_threshold": case["exit_threshold"]} if case["exit_threshold"] is not None else {}
        kw = dict(model=MODEL, prompt=case["prompt"], max_tokens=case["max_tokens"],
                  temperature=case["temperature"], seed=case["seed"], extra_body=extra)
        if not stream:
            r = await aclient.completions.create(**kw)
            return r.choices[0].text, r.choices[0].model_extra["exit_depths"]
        text, depths = "", []
        async for ch in await aclient.completions.create(**kw, stream=True):
            text += ch.choices[0].text
            depths += ch.choices[0].model_extra["exit_depths"]
        return text, depths

    async def run() -> list[tuple[str, list[int]]]:
        async with openai.AsyncOpenAI(base_url=server.url + "/v1", api_key=API_KEY, max_retries=0) as ac:
            return await asyncio.gather(*(one(ac, c, i % 2 == 1) for i, c in enumerate(cases)))

    got = asyncio.run(run())
    want = offline.generate([c["prompt"] for c in cases],
                            [SamplingParams(max_tokens=c["max_tokens"], temperature=c["temperature"], seed=c["seed"],
                                            exit_threshold=c["exit_threshold"]) for c in cases])
    for (text, depths), w in zip(got, want, strict=True):
        assert text == w.outputs[0].text
        assert depths == w.outputs[0].exit_depths


def test_overload_burst_loses_no_admitted_request(server, offline):
    wait_idle(server)
    n, tokens = 24, 32

    async def one(ac: httpx.AsyncClient, i: int) -> httpx.Response:
        body = {"model": MODEL, "prompt": f"burst {i}", "max_tokens": tokens, "ignore_eos": True,
                "temperature": 0.9, "seed": i, "return_token_ids": True}
        return await ac.post(server.url + C, json=body, headers=AUTH)

    async def run() -> list[httpx.Response]:
        limits = httpx.Limits(max_connections=n, max_keepalive_connections=n)
        async with httpx.AsyncClient(timeout=120, limits=limits) as ac:
            return await asyncio.gather(*(one(ac, i) for i in range(n)))

    rejected_before = metric(server, "loopserve:request_rejected_total", 0.0)
    responses = asyncio.run(run())
    statuses = [r.status_code for r in responses]
    assert set(statuses) <= {200, 503}, statuses
    ok = [i for i, s in enumerate(statuses) if s == 200]
    busy = [r for r in responses if r.status_code == 503]
    assert busy and len(ok) >= MAX_NUM_SEQS
    for r in busy:
        assert r.headers["retry-after"] and r.json()["error"]["code"] == 503
    want = offline.generate([f"burst {i}" for i in ok],
                            [SamplingParams(max_tokens=tokens, ignore_eos=True, temperature=0.9, seed=i) for i in ok])
    for i, w in zip(ok, want, strict=True):
        choice = responses[i].json()["choices"][0]
        assert choice["finish_reason"] == "length"
        assert choice["token_ids"] == w.outputs[0].token_ids
    assert metric(server, "loopserve:request_rejected_total", 0.0) - rejected_before == len(busy)
    wait_idle(server)
    assert httpx.get(server.url + "/health").status_code == 200


def test_loop_metrics_move(server, client):
    before = metric(server, "loopserve:exit_depth_count")
    loops = metric(server, "loopserve:core_loops_total")
    # (ignore_eos: an unseeded draw may end the request at its first token, which no loop step decodes)
    client.completions.create(model=MODEL, prompt="metrics", max_tokens=5, extra_body={"ignore_eos": True})
    assert metric(server, "loopserve:exit_depth_count") > before
    assert metric(server, "loopserve:core_loops_total") > loops
    assert metric(server, "loopserve:core_batch_size_count") > 0


@pytest.mark.parametrize("stream", [False, True])
def test_latency_metrics_count_every_token(server, client, stream):
    """A response that is not streamed gets one (final) output from the engine: its time to first token and
    inter-token gaps still reach the histograms, one TTFT and max_tokens - 1 gaps, as a stream's do."""
    wait_idle(server)
    names = ("loopserve:time_to_first_token_seconds_count", "loopserve:inter_token_latency_seconds_count",
             "loopserve:e2e_request_latency_seconds_sum", "loopserve:time_to_first_token_seconds_sum")
    before = [metric(server, n) for n in names]
    r = client.completions.create(model=MODEL, prompt="count my gaps", max_tokens=7, stream=stream,
                                  extra_body={"ignore_eos": True})
    if stream:
        list(r)
    wait_idle(server)
    ttft, itl, e2e, ttft_sum = (metric(server, n) - b for n, b in zip(names, before, strict=True))
    assert (ttft, itl) == (1, 6)
    assert 0 < ttft_sum < e2e  # the first token came before the end, not when the response did


@pytest.mark.parametrize("stream", [False, True])
def test_token_and_request_metrics_count_every_sample(server, client, stream):
    """n > 1: each sample counts as a request of its own (vLLM V1's child requests), in every metric: its tokens
    (as usage counts them), its finish, its prompt, its time to first token and end-to-end latency, and the gaps
    between its own tokens (not between the tokens of the samples' merged stream)."""
    wait_idle(server)
    names = ("loopserve:generation_tokens_total", "loopserve:request_generation_tokens_count",
             "loopserve:request_generation_tokens_sum", "loopserve:time_to_first_token_seconds_count",
             "loopserve:e2e_request_latency_seconds_count", "loopserve:request_prompt_tokens_count",
             "loopserve:prompt_tokens_total", "loopserve:inter_token_latency_seconds_count",
             "loopserve:request_decode_time_seconds_count")
    before = [metric(server, n) for n in names]
    done = metric(server, "loopserve:request_success_total", finished_reason="length")
    kw = dict(model=MODEL, prompt="two samples", max_tokens=5, n=2, temperature=0.8, seed=5,
              extra_body={"ignore_eos": True})
    if stream:
        chunks = list(client.completions.create(**kw, stream=True, stream_options={"include_usage": True}))
        usage = chunks[-1].usage
    else:
        usage = client.completions.create(**kw).usage
    wait_idle(server)
    tokens, samples, per_sample, ttft, e2e, prompts, prompt_tokens, gaps, decode = (
        metric(server, n) - b for n, b in zip(names, before, strict=True))
    assert usage.completion_tokens == tokens == per_sample == 10 and samples == 2  # (streams: DELTA outputs)
    assert metric(server, "loopserve:request_success_total", finished_reason="length") - done == 2
    assert (ttft, e2e, prompts, decode, gaps) == (2, 2, 2, 2, 2 * 4)
    assert prompt_tokens == 2 * usage.prompt_tokens


def test_vllm_request_parameter_step_and_http_metrics(server, client):
    """vLLM V1's metrics beside the per-token ones: a request's n and its samples' max_tokens, its longest sample,
    each sample's time per output token, the tokens of each engine step that prefilled or sampled (they add up to
    the tokens generated and prefilled), the KV cache's settings, and the HTTP answers by handler and status class
    (a 401 and a 400 too)."""
    wait_idle(server)
    names = ("loopserve:request_params_n_count", "loopserve:request_params_n_sum",
             "loopserve:request_params_max_tokens_sum", "loopserve:request_max_num_generation_tokens_sum",
             "loopserve:request_time_per_output_token_seconds_count", "loopserve:iteration_tokens_total_sum",
             "loopserve:generation_tokens_total", "loopserve:prompt_tokens_total")
    http = {status: metric(server, "http_requests_total", 0.0, handler="/v1/completions", status=status)
            for status in ("2xx", "4xx")}
    before = [metric(server, n) for n in names]
    client.completions.create(model=MODEL, prompt="count my parameters", max_tokens=5, n=2, temperature=0.8,
                              seed=1, extra_body={"ignore_eos": True})
    assert httpx.post(server.url + C, json={"model": MODEL, "prompt": "x", "max_tokens": -1},
                      headers=AUTH).status_code == 400
    assert httpx.post(server.url + C, json={"model": MODEL, "prompt": "x"}).status_code == 401
    wait_idle(server)
    n_count, n_sum, max_tokens, most, tpot, step_tokens, generated, prompted = (
        metric(server, n) - b for n, b in zip(names, before, strict=True))
    assert (n_count, n_sum, max_tokens, most, tpot, generated) == (1, 2, 2 * 5, 5, 2, 10)
    # (vLLM's count: each sample's whole prompt, with its first token, as prompt_tokens_total counts it; the prompt
    # was counted once for all samples, so the sums disagreed)
    assert step_tokens == generated + prompted and prompted > 0
    for status, more in (("2xx", 1), ("4xx", 2)):
        assert metric(server, "http_requests_total", handler="/v1/completions", status=status) - http[status] == more
    assert metric(server, "loopserve:cache_config_info", block_size="16", enable_prefix_caching="True") == 1
    assert metric(server, "loopserve:cache_config_info", num_gpu_blocks=str(KV_TOKENS // 16)) == 1


def test_token_counters_grow_while_a_request_that_is_not_streamed_runs(server):
    """A request that is not streamed has one output, when it finishes: its tokens reached the counters only then
    (a scrape read 0 for seconds, then everything at once; the stats line said 0 tokens/s with requests running).
    A scrape now counts what the engine has generated so far, and the final output adds only the rest: the totals
    still equal `usage`, each prompt counted once per sample."""
    wait_idle(server)
    names = ("loopserve:generation_tokens_total", "loopserve:prompt_tokens_total")
    gen0, prompt0 = (metric(server, n) for n in names)
    result: dict = {}

    def send() -> None:
        result["r"] = httpx.post(server.url + C, headers=AUTH, timeout=120, json={
            "model": MODEL, "prompt": "count me as I go", "max_tokens": 600, "n": 2, "temperature": 0.8,
            "seed": 3, "ignore_eos": True})

    sender = threading.Thread(target=send)
    sender.start()
    seen = []
    while sender.is_alive():
        seen.append(metric(server, names[0]) - gen0)
        time.sleep(0.05)
    sender.join()
    usage = result["r"].json()["usage"]
    wait_idle(server)
    assert usage["completion_tokens"] == 2 * 600 == metric(server, names[0]) - gen0
    assert metric(server, names[1]) - prompt0 == usage["prompt_tokens"] * 2
    assert any(0 < d < 1200 for d in seen), seen  # (counted while it ran)
    assert seen == sorted(seen)  # (never backwards)


def test_prompt_only_echo_counts_no_generated_token(server):
    """echo with max_tokens 0 returns the prompt alone: the token the engine runs for it is not counted as
    generated (usage says 0), nor its time to first token; the request and its prompt tokens are."""
    wait_idle(server)
    names = ("loopserve:generation_tokens_total", "loopserve:time_to_first_token_seconds_count",
             "loopserve:prompt_tokens_total", "loopserve:e2e_request_latency_seconds_count")
    before = [metric(server, n) for n in names]
    r = httpx.post(server.url + C, json={"model": MODEL, "prompt": "echo me", "max_tokens": 0, "echo": True},
                   headers=AUTH, timeout=30)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 0
    wait_idle(server)
    generated, ttft, prompt, requests = (metric(server, n) - b for n, b in zip(names, before, strict=True))
    assert (generated, ttft, requests) == (0, 0, 1) and prompt == r.json()["usage"]["prompt_tokens"]


def test_server_log_has_no_tracebacks(server):
    text = server.log.read_text()
    assert "Traceback" not in text, text[-4000:]


# -- Huginn: the like-init state is seeded by the request's seed --------------------------------------------------
@pytest.fixture(scope="module")
def huginn(tmp_path_factory) -> Iterator[tuple[Server, Path]]:
    path = make_tiny(tmp_path_factory.mktemp("tiny-huginn"), TinySpec(arch="huginn", layers="1-2-1", r_max=4))
    log = tmp_path_factory.mktemp("logs") / "huginn.log"
    with run_server(path, log, "--dtype", "float64", "--kv-cache-tokens", str(KV_TOKENS)) as s:
        yield s, path


def _huginn_request(server: Server) -> dict:
    body = {"model": MODEL, "prompt": "Huginn and Muninn", "max_tokens": 8, "temperature": 0.8, "seed": 42,
            "return_token_ids": True}
    r = httpx.post(server.url + C, json=body, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]


def test_huginn_seeded_request_equals_engine_offline(huginn):
    server, path = huginn
    first, second = _huginn_request(server), _huginn_request(server)
    assert first["token_ids"] == second["token_ids"] and first["exit_depths"] == second["exit_depths"]
    llm = LLM(path, dtype="float64", device="cpu", kv_cache_tokens=KV_TOKENS)
    assert llm.engine is not None
    seq = llm.engine.make_sequence("x", "Huginn and Muninn", SamplingParams(max_tokens=8, temperature=0.8, seed=42),
                                   seed=42)
    llm.engine.add_sequence(seq)
    llm.engine.run_to_completion()
    assert first["token_ids"] == seq.output_ids and first["exit_depths"] == seq.exit_depths


def test_huginn_seeded_request_equals_llm_generate(huginn):
    server, path = huginn
    got = _huginn_request(server)
    want = LLM(path, dtype="float64", device="cpu", kv_cache_tokens=KV_TOKENS).generate(
        "Huginn and Muninn", SamplingParams(max_tokens=8, temperature=0.8, seed=42))[0].outputs[0]
    assert got["token_ids"] == want.token_ids


# -- per-request speculative decoding -------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def spec_server(ouro_path, tmp_path_factory) -> Iterator[Server]:
    """Drafts 2 tokens per round, whatever the acceptance (the tiny random model disagrees with itself)."""
    log = tmp_path_factory.mktemp("logs") / "spec.log"
    with run_server(ouro_path, log, "--dtype", "float64", "--kv-cache-tokens", str(KV_TOKENS), "--api-key", API_KEY,
                    "--num-speculative-tokens", "2", "--speculative-min-acceptance", "0") as s:
        yield s


def test_num_speculative_tokens_field(server, spec_server, offline):
    """vLLM-style extra field: on a server drafting 2, a request asking for 1 or 0 gets plain decoding's
    output, and one asking for 0 drafts nothing; a negative value, more than the server drafts, or any
    on a server that does not speculate is a 400 naming the field."""
    prompt = "ROMEO: But soft, what light"
    kw = dict(max_tokens=8, temperature=0.8, seed=3, ignore_eos=True)

    def post(s: Server, path: str, asked) -> httpx.Response:
        body = {"prompt": prompt} if path == C else {"messages": [{"role": "user", "content": prompt}]}
        return httpx.post(s.url + path, json={**body, "model": MODEL, **kw, "num_speculative_tokens": asked},
                          headers=AUTH, timeout=60)

    want = offline_one(offline, prompt, **kw).outputs[0].text
    drafts = "loopserve:spec_decode_num_draft_tokens_total"
    for asked in (0, 1):
        wait_idle(spec_server)
        before = metric(spec_server, drafts, missing=0.0)
        r = post(spec_server, C, asked)
        assert r.status_code == 200 and r.json()["choices"][0]["text"] == want, r.text
        wait_idle(spec_server)
        assert (metric(spec_server, drafts, missing=0.0) > before) == (asked > 0)
    assert post(spec_server, H, 2).status_code == 200
    wait_idle(spec_server)
    per_pos = [metric(spec_server, "loopserve:spec_decode_num_accepted_tokens_per_pos_total", position=str(j))
               for j in range(2)]  # (vLLM's per-position counter: one series per draft place)
    assert sum(per_pos) == metric(spec_server, "loopserve:spec_decode_num_accepted_tokens_total")
    assert per_pos[0] >= per_pos[1] >= 0
    for s, path, asked in [(spec_server, C, 3), (spec_server, H, 3), (server, C, 1), (server, H, 1),
                           (spec_server, C, -1), (server, H, -1)]:
        r = post(s, path, asked)
        err = r.json()["error"]
        assert r.status_code == 400 and err["param"] == "num_speculative_tokens", r.text
        assert err["message"].startswith("num_speculative_tokens: "), err
        if asked > 0:
            assert "--num-speculative-tokens" in err["message"], err


# -- SIGTERM --------------------------------------------------------------------------------------------------------
def test_sigterm_finishes_short_requests_and_aborts_long_ones(ouro_path, tmp_path):
    """SIGTERM: no new connections; a request in flight that finishes within the grace period (--shutdown-timeout)
    is answered in full; one still running a little before it runs out is ended by the server itself, before
    uvicorn would cancel it (a plain-text 500, a bare cut, an ERROR and a traceback each): a 503 with the
    OpenAI-style body and Retry-After, or for a stream, an error event with that body, then the cut (no [DONE]).
    The process exits 0, and its log has no ERROR line and no traceback."""
    log = tmp_path / "sigterm.log"
    # Size the grace period from this machine's speed: ~10x what the short request needs, ~1/5 of
    # what the long one needs.
    llm = LLM(ouro_path, device="cpu")  # (as the servers here: outputs are compared)
    llm.generate("warm up", SamplingParams(max_tokens=4))
    t = time.perf_counter()
    llm.generate("time me", SamplingParams(max_tokens=40, ignore_eos=True))
    per_token = (time.perf_counter() - t) / 40
    short, grace = 40, max(1.5, 400 * per_token)
    shutting_down = {"error": {"message": "the server is shutting down", "type": "ServiceUnavailableError",
                               "param": None, "code": 503}}
    with run_server(ouro_path, log, "--shutdown-timeout", str(grace), "--kv-cache-tokens", str(KV_TOKENS)) as server:
        results: dict[str, tuple[int, bool, dict | None]] = {}
        started = {k: threading.Event() for k in ("short", "long")}
        answer: dict[str, httpx.Response] = {}

        def stream(name: str, max_tokens: int) -> None:
            body = {"model": MODEL, "prompt": name, "max_tokens": max_tokens, "ignore_eos": True, "stream": True}
            n, done, error = 0, False, None
            try:
                with httpx.Client(timeout=60) as c, c.stream("POST", server.url + C, json=body) as r:
                    for data in sse_events(r.iter_lines()):
                        if data == "[DONE]":
                            done = True
                        elif "error" in (event := json.loads(data)):
                            error = event
                        else:
                            n += len(event["choices"][0]["exit_depths"])
                            started[name].set()
            except httpx.HTTPError:
                pass
            started[name].set()
            results[name] = (n, done, error)

        def whole() -> None:  # not streamed
            body = {"model": MODEL, "prompt": "whole", "max_tokens": MAX_LEN - 8, "ignore_eos": True}
            answer["whole"] = httpx.post(server.url + C, json=body, timeout=60)

        threads = [threading.Thread(target=stream, args=("short", short)),
                   threading.Thread(target=stream, args=("long", MAX_LEN - 8)), threading.Thread(target=whole)]
        for t in threads:
            t.start()
        for e in started.values():
            assert e.wait(30)
        deadline = time.monotonic() + 30
        while metric(server, "loopserve:num_requests_running") < 3:  # the one not streamed too
            assert time.monotonic() < deadline, "the requests did not all start"
            time.sleep(0.05)
        t0 = time.monotonic()
        server.proc.send_signal(signal.SIGTERM)
        time.sleep(0.3)
        with pytest.raises(httpx.HTTPError):  # no longer accepting connections
            httpx.get(server.url + "/health", timeout=2)
        for t in threads:
            t.join(30)
        rc = server.proc.wait(20)
        assert time.monotonic() - t0 < grace + 10
    text = log.read_text()
    assert rc == 0, text
    assert results["short"] == (short, True, None)  # in flight at SIGTERM: finished
    n_long, done_long, error = results["long"]
    # could not finish in the grace period: ended by the server, with its error event before the cut
    assert not done_long and n_long < MAX_LEN - 8 and error == shutting_down, results["long"]
    r = answer["whole"]
    assert r.status_code == 503 and r.json() == shutting_down, r.text
    assert r.headers.get("retry-after") == "5", r.headers
    assert "ERROR" not in text and "Traceback" not in text, text
    assert "aborted 2 request(s) still running" in text, text


def test_a_second_ctrl_c_ends_the_requests_with_their_503s_at_once(ouro_path, tmp_path):
    """Ctrl+C twice (uvicorn's force quit): the requests still running are ended at once as at the end of the grace
    period (a 503 with its JSON body; a stream, its error event), not cut by uvicorn's cancellation (a plain-text 500,
    a bare cut and an ERROR traceback per request); the process exits within a few seconds."""
    log = tmp_path / "sigint.log"
    shutting_down = {"error": {"message": "the server is shutting down", "type": "ServiceUnavailableError",
                               "param": None, "code": 503}}
    with run_server(ouro_path, log, "--shutdown-timeout", "120", "--kv-cache-tokens", str(KV_TOKENS)) as server:
        results: dict[str, object] = {}
        started = threading.Event()

        def stream() -> None:
            body = {"model": MODEL, "prompt": "long", "max_tokens": MAX_LEN - 8, "ignore_eos": True, "stream": True}
            events = []
            try:
                with httpx.Client(timeout=60) as c, c.stream("POST", server.url + C, json=body) as r:
                    for data in sse_events(r.iter_lines()):
                        events.append(data)
                        started.set()
            except httpx.HTTPError:  # (the cut after the error event)
                pass
            results["stream"] = events

        def whole() -> None:
            body = {"model": MODEL, "prompt": "whole", "max_tokens": MAX_LEN - 8, "ignore_eos": True}
            results["whole"] = httpx.post(server.url + C, json=body, timeout=60)

        threads = [threading.Thread(target=stream), threading.Thread(target=whole)]
        for t in threads:
            t.start()
        assert started.wait(30)
        deadline = time.monotonic() + 30
        while metric(server, "loopserve:num_requests_running") < 2:
            assert time.monotonic() < deadline, "the requests did not both start"
            time.sleep(0.05)
        t0 = time.monotonic()
        server.proc.send_signal(signal.SIGINT)
        time.sleep(1.0)  # (the graceful shutdown under way: uvicorn checks for the first signal every 0.1 s)
        server.proc.send_signal(signal.SIGINT)
        for t in threads:
            t.join(30)
        server.proc.wait(20)
        assert time.monotonic() - t0 < 10  # (not the 120 s grace period)
    text = log.read_text()
    events = results["stream"]
    assert isinstance(events, list) and events and json.loads(events[-1]) == shutting_down, events[-3:]
    r = results["whole"]
    assert isinstance(r, httpx.Response) and r.status_code == 503 and r.json() == shutting_down, r
    assert "ERROR" not in text and "Traceback" not in text, text
    assert "aborted 2 request(s) still running" in text, text


# -- prompt logprobs (echo) and n > 1 -------------------------------------------------------------------------
def test_lm_eval_loglikelihood_requests(server, offline):
    """Requests shaped like lm-eval's `local-completions` loglikelihood ones (token-id prompts, echo,
    logprobs 1, max_tokens 1 or 0, temperature 0): the prompt's logprobs equal the offline engine's
    prompt_logprobs, token by token, and the shape is what lm-eval parses (first token None)."""
    prompts = [[5, 17, 99, 3, 250, 40], [300, 12, 12, 401]]
    for max_tokens in (1, 0):
        r = httpx.post(server.url + "/v1/completions", headers=AUTH, timeout=60, json={
            "model": MODEL, "prompt": prompts, "temperature": 0, "max_tokens": max_tokens, "logprobs": 1,
            "seed": 1234, "echo": True})
        assert r.status_code == 200, r.text
        body = r.json()
        want = offline.generate([{"prompt_token_ids": p} for p in prompts],
                                SamplingParams(max_tokens=1, temperature=0, logprobs=1, prompt_logprobs=1),
                                use_tqdm=False)
        for choice, w, p in zip(sorted(body["choices"], key=lambda c: c["index"]), want, prompts, strict=True):
            lp = choice["logprobs"]
            extra = 1 if max_tokens else 0
            assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(p) + extra
            assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
            for k in range(1, len(p)):
                assert abs(lp["token_logprobs"][k] - w.prompt_logprobs[k][p[k]].logprob) < 1e-9
                assert len(lp["top_logprobs"][k]) in (1, 2)  # the top one, and the prompt token if it is not it
            if max_tokens:
                first = w.outputs[0]
                assert abs(lp["token_logprobs"][-1] - first.logprobs[0][first.token_ids[0]].logprob) < 1e-9
            prompt_text = offline.tokenizer.decode(p)
            assert choice["text"].startswith(prompt_text) and (max_tokens or choice["text"] == prompt_text)
        assert body["usage"]["completion_tokens"] == (len(prompts) if max_tokens else 0)


def test_echoed_logprobs_keep_logprobs_alternatives_whatever_prompt_logprobs_asks(server):
    """echo with logprobs 1 and prompt_logprobs 3: the echoed prompt tokens' top_logprobs hold the token and its one
    top alternative, as the generated token's (vLLM's rule), while `prompt_logprobs` gives the 3."""
    p = [5, 17, 99, 3, 250]
    choice = _ok(server, "/v1/completions", {"model": MODEL, "prompt": p, "max_tokens": 1, "temperature": 0,
                                             "echo": True, "logprobs": 1, "prompt_logprobs": 3})["choices"][0]
    tops = choice["logprobs"]["top_logprobs"]
    assert tops[0] is None and all(len(t) in (1, 2) for t in tops[1:]), tops
    entries = choice["prompt_logprobs"][1:]
    assert [len(e) for e in entries] == [3 + (e[str(t)]["rank"] > 3) for t, e in zip(p[1:], entries, strict=True)]


def test_prompt_logprobs_field(server, offline):
    p = [5, 17, 99, 3]
    want = offline.generate([{"prompt_token_ids": p}], SamplingParams(max_tokens=2, temperature=0, prompt_logprobs=2),
                            use_tqdm=False)[0].prompt_logprobs
    got = _ok(server, "/v1/completions", {"model": MODEL, "prompt": p, "max_tokens": 2, "temperature": 0,
                                          "prompt_logprobs": 2})["choices"][0]["prompt_logprobs"]
    chat = _ok(server, "/v1/chat/completions", {"model": MODEL, "max_tokens": 1, "prompt_logprobs": 0,
                                                "messages": [{"role": "user", "content": "hi"}]})
    assert chat["prompt_logprobs"][0] is None and all(len(e) == 1 for e in chat["prompt_logprobs"][1:])
    assert got[0] is None and len(got) == len(p)
    for entry, w in zip(got[1:], want[1:], strict=True):
        assert set(entry) == {str(t) for t in w}
        assert all(abs(entry[str(t)]["logprob"] - v.logprob) < 1e-9 and entry[str(t)]["rank"] == v.rank
                   for t, v in w.items())


def test_n_samples(server, client, offline):
    """n samples per prompt, numbered prompt by prompt; sample j of a seeded request is the offline sample
    seeded seed + j; streaming gives the same texts."""
    prompts = ["Once upon", "The king"]
    r = client.completions.create(model=MODEL, prompt=prompts, n=3, max_tokens=5, temperature=1.0, seed=9)
    assert sorted(c.index for c in r.choices) == list(range(6))
    assert r.usage.completion_tokens == sum(len(c.model_extra["exit_depths"]) for c in r.choices)
    for c in r.choices:
        i, j = divmod(c.index, 3)
        want = offline_one(offline, prompts[i], max_tokens=5, temperature=1.0, seed=9 + j)
        assert c.text == want.outputs[0].text
    texts = {c.index: c.text for c in r.choices}
    assert len({texts[0], texts[1], texts[2]}) > 1
    streamed: dict[int, str] = {}
    for chunk in client.completions.create(model=MODEL, prompt=prompts, n=3, max_tokens=5, temperature=1.0,
                                           seed=9, stream=True):
        for c in chunk.choices:
            streamed[c.index] = streamed.get(c.index, "") + c.text
    assert streamed == texts
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], n=2,
                                          max_tokens=4, temperature=1.0, seed=3)
    assert sorted(c.index for c in chat.choices) == [0, 1]


def _ok(server, path: str, body: dict) -> dict:
    r = httpx.post(server.url + path, headers=AUTH, json=body, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()


def test_metrics_answer_openmetrics_and_gzip_when_asked(server):
    """As prometheus_client's own app (vLLM's /metrics): OpenMetrics for a scraper whose Accept asks for it, gzip for
    one that accepts it (both were Prometheus text, uncompressed, whatever was asked)."""
    import gzip

    from prometheus_client.openmetrics.parser import text_string_to_metric_families as openmetrics_families

    prometheus3 = "application/openmetrics-text;version=1.0.0;escaping=allow-utf-8;q=0.5,text/plain;version=0.0.4;q=0.4"
    r = httpx.get(server.url + "/metrics", headers={"Accept": prometheus3, "Accept-Encoding": "identity"})
    assert r.headers["content-type"].startswith("application/openmetrics-text") and r.text.endswith("# EOF\n")
    samples = {s.name for f in openmetrics_families(r.text) for s in f.samples}
    assert {"loopserve:generation_tokens_total", "loopserve:time_to_first_token_seconds_count"} <= samples
    # Prometheus 2's header (no escaping): its names would be escaped (loopserve_generation_tokens_total): text
    prometheus2 = ("application/openmetrics-text;version=1.0.0,application/openmetrics-text;version=0.0.1;q=0.75,"
                   "text/plain;version=0.0.4;q=0.5,*/*;q=0.1")
    r = httpx.get(server.url + "/metrics", headers={"Accept": prometheus2})
    assert r.headers["content-type"].startswith("text/plain") and "loopserve:generation_tokens_total" in r.text
    raw = httpx.get(server.url + "/metrics", headers={"Accept-Encoding": "gzip"})  # (httpx inflates it)
    assert raw.headers["content-encoding"] == "gzip" and raw.headers["content-type"].startswith("text/plain")
    assert "loopserve:generation_tokens_total" in raw.text
    with httpx.stream("GET", server.url + "/metrics", headers={"Accept-Encoding": "gzip"}) as s:
        assert gzip.decompress(b"".join(s.iter_raw())).decode().count("loopserve:generation_tokens_total") >= 1


def test_invocations_answers_as_chat_or_completions_by_the_body(server):
    """SageMaker's POST /invocations (vLLM's): a body with messages is a chat completion, one with a prompt a
    completion, each answered (and checked) as its own endpoint answers it; any other object is a 400, after the
    key is checked."""
    chat = httpx.post(server.url + "/invocations", headers=AUTH, timeout=60, json={
        "model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3})
    assert chat.status_code == 200 and chat.json()["object"] == "chat.completion", chat.text
    text = httpx.post(server.url + "/invocations", headers=AUTH, timeout=60, json={"model": MODEL, "prompt": "hi",
                                                                                  "max_tokens": 3})
    assert text.status_code == 200 and text.json()["object"] == "text_completion", text.text
    bad = httpx.post(server.url + "/invocations", headers=AUTH, json={"model": MODEL, "max_tokens": 3})
    assert bad.status_code == 400 and bad.json()["error"]["message"].startswith("body: expected a chat completion")
    assert httpx.post(server.url + "/invocations", json={"model": MODEL}).status_code == 401
    wrong = httpx.post(server.url + "/invocations", headers=AUTH, json={"model": MODEL, "prompt": "hi", "n": 0})
    assert wrong.status_code == 400 and wrong.json()["error"]["param"] == "n"  # (the completions endpoint's check)
    # JSON nested past the parser's depth: a 500 (RecursionError) once, before the key was checked
    deep = {"content": b"[" * 30_000, "headers": {"Content-Type": "application/json"}, "timeout": 30}
    assert httpx.post(server.url + "/invocations", **deep).status_code == 401
    r = httpx.post(server.url + "/invocations", **{**deep, "headers": {**deep["headers"], **AUTH}})
    assert r.status_code == 400 and "nested too deeply" in r.json()["error"]["message"], r.text
    assert httpx.post(server.url + "/invocations", headers={**AUTH, "Content-Type": "text/plain"},
                      content=b'{"model": "x"}').status_code == 415


def test_what_vllm_takes_of_clients_that_send_defaults(server):
    """Fields vLLM takes that were 400s here: a tool and a named tool_choice without "type" (vLLM's default,
    "function"); tool_choice "required" with an empty tools list (OpenAI's reading: "none"); top_logprobs 0 without
    logprobs; stream_options {} without stream; the Responses API's input_text / output_text parts; an assistant's
    refusal part, as an OpenAI conversation replays it (read as its text); and at /invocations a body whose messages
    is null but that has a prompt (a completion)."""
    from loopserve.chat_messages import chat_messages

    msgs = [{"role": "user", "content": [{"type": "input_text", "text": "hi"}]},
            {"role": "assistant", "content": [{"type": "output_text", "text": "yes"}]},
            {"role": "user", "content": "and?"},
            {"role": "assistant", "content": [{"type": "refusal", "refusal": "no"}]},
            {"role": "user", "content": "again"}]
    assert [m["content"] for m in chat_messages(msgs)] == ["hi", "yes", "and?", "no", "again"]
    tool = {"function": {"name": "f", "parameters": {"type": "object", "properties": {"x": {"type": "integer"}}}}}

    def chat(**body):
        r = httpx.post(server.url + H, headers=AUTH, timeout=60, json={"model": MODEL, "messages": msgs,
                                                                        "max_tokens": 3, **body})
        assert r.status_code == 200, r.text
        return r.json()["choices"][0]

    called = chat(tools=[tool], tool_choice={"function": {"name": "f"}}, max_tokens=40)
    assert called["message"]["tool_calls"][0]["function"]["name"] == "f"
    chat(tools=[tool], tool_choice="required")  # (a 200: the tool without "type" taken)
    plain = chat(tools=[], tool_choice="required")
    assert plain["message"]["content"] is not None and not plain["message"].get("tool_calls")
    assert chat(top_logprobs=0)["logprobs"] is None
    chat(stream_options={})
    r = httpx.post(server.url + "/invocations", headers=AUTH, timeout=60, json={
        "model": MODEL, "prompt": "hi", "messages": None, "max_tokens": 2})
    assert r.status_code == 200 and r.json()["object"] == "text_completion", r.text
    r = httpx.post(server.url + H, headers=AUTH, json={"model": MODEL, "messages": msgs, "tool_choice": "required"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "tool_choice"  # (no tools at all: still refused)


def test_continuous_usage_counts_each_choices_own_loops(server):
    """With continuous usage a chunk's usage is its choice's: its tokens so far and now its own decode loops (they
    were the whole request's, every choice's, while its completion tokens were its own)."""
    body = {"model": MODEL, "prompt": "The", "max_tokens": 4, "n": 2, "temperature": 1.0, "seed": 3, "stream": True,
            "ignore_eos": True, "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
    with httpx.stream("POST", server.url + C, json=body, headers=AUTH, timeout=60) as r:
        events = [json.loads(e) for e in sse_events(r.iter_lines()) if e != "[DONE]"]
    last = {}
    for e in events:
        for c in e["choices"]:
            last[c["index"]] = e["usage"]
    total = events[-1]["usage"]
    assert sorted(last) == [0, 1] and total["completion_tokens"] == 8
    assert last[0]["loops"] + last[1]["loops"] == total["loops"] > 0
    assert last[0]["completion_tokens"] == last[1]["completion_tokens"] == 4


def test_a_role_of_the_templates_own_is_taken_as_vllm_takes_it(server, offline):
    """vLLM passes any role to the chat template (its custom message type); both refused every role but OpenAI's
    five. The template renders it (ChatML writes any role), and LLM.chat and the server agree; an empty role is a
    400 naming it."""
    msgs = [{"role": "narrator", "content": "Night falls."}, {"role": "user", "content": "hi"}]
    r = httpx.post(server.url + H, headers=AUTH, timeout=60, json={"model": MODEL, "messages": msgs,
                                                                    "max_tokens": 3, "temperature": 0})
    assert r.status_code == 200, r.text
    want = offline.chat(msgs, SamplingParams(max_tokens=3, temperature=0), use_tqdm=False)[0]
    assert r.json()["choices"][0]["message"]["content"] == want.outputs[0].text
    assert "narrator" in offline.get_tokenizer().apply_chat_template(msgs, tokenize=False)
    r = httpx.post(server.url + H, headers=AUTH, json={"model": MODEL, "messages": [{"role": "", "content": "x"}]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages.0.role", r.text


def test_metrics_and_methods_hold_against_odd_headers(server):
    """A hostile client's headers: an Accept whose version prometheus_client cannot compare was a 500 (TypeError);
    `gzip;q=0` refuses gzip and `nogzip` is not gzip (a substring test gave both gzip); made-up HTTP methods were
    counted as label values of the HTTP metrics, growing /metrics and the memory without bound, key or no key:
    now a 405 before the metrics see them."""
    r = httpx.get(server.url + "/metrics", headers={"Accept": "text/plain; version=abc; escaping=allow-utf-8"})
    assert r.status_code == 200 and "loopserve:generation_tokens_total" in r.text
    for refused in ("gzip;q=0", "nogzipplease"):
        r = httpx.get(server.url + "/metrics", headers={"Accept-Encoding": refused})
        assert r.status_code == 200 and "content-encoding" not in r.headers, refused
    assert httpx.get(server.url + "/metrics", headers={"Accept-Encoding": "GZIP"}).headers["content-encoding"] == "gzip"
    for method in ("JNJITBEAMZ", "get"):
        r = httpx.request(method, server.url + "/invocations")
        assert r.status_code == 405 and r.json()["error"]["code"] == 405, r.text
    assert "JNJITBEAMZ" not in httpx.get(server.url + "/metrics").text


def test_a_response_carries_vllms_unset_fields_as_null(server):
    """vLLM returns its response models whole: a field it has that the answer does not set reads null, so a client that
    indexes the JSON (`body["system_fingerprint"]`, `message["refusal"]`) finds the key (it was a KeyError here); set
    fields keep their values."""
    chat = httpx.post(server.url + H, json=_h(max_tokens=2), headers=AUTH, timeout=60).json()
    for key in ("service_tier", "system_fingerprint", "kv_transfer_params", "prompt_logprobs", "prompt_token_ids"):
        assert key in chat and chat[key] is None, key
    choice = chat["choices"][0]
    assert "token_ids" in choice and choice["token_ids"] is None
    message = choice["message"]
    for key in ("refusal", "annotations", "audio", "function_call", "reasoning"):
        assert key in message and message[key] is None, key
    assert message["role"] == "assistant" and isinstance(message["content"], str) and message["tool_calls"] == []
    done = httpx.post(server.url + C, json=_c(max_tokens=2, return_token_ids=True), headers=AUTH, timeout=60).json()
    for key in ("service_tier", "system_fingerprint", "kv_transfer_params"):
        assert key in done and done[key] is None, key
    choice = done["choices"][0]
    assert choice["prompt_logprobs"] is None and len(choice["token_ids"]) == 2 and choice["prompt_token_ids"], choice
