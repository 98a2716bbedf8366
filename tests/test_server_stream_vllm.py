"""Streams in the shape vLLM's server sends them, against a real `loopserve serve` process: one choice per
chunk (several prompts and n > 1; completions and chat, the chat role and echo chunks included), continuous
usage counted per chunk for that chunk's prompt and choice (the final usage chunk counts everything), and a
request that fails mid-stream: one in-band error event in OpenAI's shape, then a cut without [DONE], so the
official client raises an `APIError` that carries the engine's message (it used to raise only
`APIConnectionError: Connection error.`).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest

from tests.server_helpers import MODEL, Server, run_server, sse_events

pytestmark = pytest.mark.timeout(120)

C, H = "/v1/completions", "/v1/chat/completions"
USAGE = {"stream_options": {"include_usage": True, "continuous_usage_stats": True}}
CONTINUED = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Good morrow"}]


@pytest.fixture(scope="module")
def server(tiny_ouro, tmp_path_factory) -> Iterator[Server]:
    # (--max-logprobs -1: vLLM's whole vocabulary, which a request asks for by -1)
    with run_server(tiny_ouro, tmp_path_factory.mktemp("stream-vllm") / "server.log", "--kv-cache-tokens", "2048",
                    "--max-logprobs", "-1") as s:
        yield s


def _post(server: Server, path: str, body: dict[str, Any]) -> dict[str, Any]:
    r = server.post(path, {"model": MODEL, **body})
    assert r.status_code == 200, r.text
    return r.json()


def _stream(server: Server, path: str, body: dict[str, Any]) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """A stream read to [DONE] with continuous usage: (its chunks of choices, the final usage)."""
    with httpx.stream("POST", server.url + path, json={"model": MODEL, **body, "stream": True, **USAGE},
                      timeout=60) as r:
        assert r.status_code == 200, r.read()
        events = list(sse_events(r.iter_lines()))
    assert events[-1] == "[DONE]"
    *chunks, last = [json.loads(e) for e in events[:-1]]
    assert last["choices"] == []
    assert all(len(ch["choices"]) == 1 for ch in chunks), [ch["choices"] for ch in chunks]
    assert len({(ch["id"], ch["object"], ch["model"]) for ch in [*chunks, last]}) == 1
    return chunks, last["usage"]


def test_completions_send_one_choice_per_chunk_with_its_own_usage(server):
    prompts = ["Once upon", "The king said that"]
    body = {"prompt": prompts, "n": 2, "max_tokens": 5, "temperature": 1.0, "seed": 3, "ignore_eos": True,
            "logprobs": 1, "prompt_logprobs": 1, "return_token_ids": True}
    whole = _post(server, C, body)
    chunks, usage = _stream(server, C, body)
    assert {k: usage[k] for k in ("prompt_tokens", "completion_tokens", "total_tokens")} == {
        k: whole["usage"][k] for k in ("prompt_tokens", "completion_tokens", "total_tokens")}
    assert usage["completion_tokens"] == 4 * 5
    for want in whole["choices"]:
        mine = [ch for ch in chunks if ch["choices"][0]["index"] == want["index"]]
        got = [ch["choices"][0] for ch in mine]
        assert "".join(c["text"] for c in got) == want["text"]
        assert [t for c in got for t in c["token_ids"]] == want["token_ids"]
        assert [d for c in got for d in c["exit_depths"]] == want["exit_depths"]
        assert [t for c in got for t in c["logprobs"]["tokens"]] == want["logprobs"]["tokens"]
        assert [c["finish_reason"] for c in got] == [None] * (len(got) - 1) + [want["finish_reason"]]
        # the prompt's fields on the choice's first chunk only, as before
        assert got[0]["prompt_token_ids"] == want["prompt_token_ids"]
        assert len(got[0]["prompt_logprobs"]) == len(want["prompt_token_ids"])
        assert not any("prompt_token_ids" in c or "prompt_logprobs" in c for c in got[1:])
        # continuous usage: this choice's prompt and its tokens so far (vLLM's rule), not a running total
        p, sent = len(want["prompt_token_ids"]), 0
        for ch, c in zip(mine, got, strict=True):
            sent += len(c["token_ids"])
            u = ch["usage"]
            assert (u["prompt_tokens"], u["completion_tokens"], u["total_tokens"]) == (p, sent, p + sent), u
    # the official client, reading `choices[0]` of each chunk as clients do, sees every sample
    client = server.client()
    texts: dict[int, str] = {}
    for ch in client.completions.create(model=MODEL, prompt=prompts, n=2, max_tokens=5, temperature=1.0, seed=3,
                                        stream=True, extra_body={"ignore_eos": True}):
        texts[ch.choices[0].index] = texts.get(ch.choices[0].index, "") + ch.choices[0].text
    assert texts == {c["index"]: c["text"] for c in whole["choices"]}


def test_chat_sends_one_choice_per_chunk_and_usage_from_the_first(server):
    """The role chunks and the echo chunks too, one per choice, each with usage {P, 0, P} (vLLM's); the prompt's
    logprobs once, at the top level of the first chunk with tokens."""
    body = {"messages": CONTINUED, "add_generation_prompt": False, "continue_final_message": True, "echo": True,
            "n": 2, "max_tokens": 4, "temperature": 1.0, "seed": 5, "ignore_eos": True, "prompt_logprobs": 1}
    whole = _post(server, H, body)
    chunks, usage = _stream(server, H, body)
    p = usage["prompt_tokens"]
    assert p == whole["usage"]["prompt_tokens"] and usage["completion_tokens"] == 2 * 4
    opening = [(ch["choices"][0]["index"], ch["choices"][0]["delta"], ch["usage"]) for ch in chunks[:4]]
    start = {"prompt_tokens": p, "completion_tokens": 0, "total_tokens": p}
    role, echo = {"role": "assistant", "content": ""}, {"content": "Good morrow"}
    assert opening == [(0, role, start), (1, role, start), (0, echo, start), (1, echo, start)]
    assert [i for i, ch in enumerate(chunks) if "prompt_logprobs" in ch] == [4]
    assert len(chunks[4]["prompt_logprobs"]) == p
    for want in whole["choices"]:
        got = [ch for ch in chunks if ch["choices"][0]["index"] == want["index"]]
        assert "".join(ch["choices"][0]["delta"].get("content") or "" for ch in got) == want["message"]["content"]
        sent = 0
        for ch in got[2:]:
            sent += len(ch["choices"][0]["exit_depths"])
            assert (ch["usage"]["prompt_tokens"], ch["usage"]["completion_tokens"]) == (p, sent), ch["usage"]
        assert sent == 4


def test_chat_returns_the_prompts_token_ids_at_the_top_level(server):
    """With return_token_ids a chat response has the prompt's ids at its top level and a stream at the top of each
    choice's role chunk (vLLM's ChatCompletionResponse and ChatCompletionStreamResponse), not in a choice, where a
    completion has them (each choice's first chunk: the test above); they were in the chat choices too."""
    body = {"messages": CONTINUED, "add_generation_prompt": False, "continue_final_message": True, "echo": True,
            "n": 2, "max_tokens": 3, "temperature": 1.0, "seed": 5, "return_token_ids": True}
    whole = _post(server, H, body)
    chunks, usage = _stream(server, H, body)
    ids = whole["prompt_token_ids"]
    assert len(ids) == whole["usage"]["prompt_tokens"] == usage["prompt_tokens"]
    assert not any("prompt_token_ids" in c for c in whole["choices"])
    assert [(ch["choices"][0]["index"], ch.get("prompt_token_ids")) for ch in chunks[:4]] == [
        (0, ids), (1, ids), (0, None), (1, None)]  # (the role chunks, then the echo chunks)
    assert not any("prompt_token_ids" in ch for ch in chunks[4:])
    assert not any("prompt_token_ids" in ch["choices"][0] for ch in chunks)
    for want in whole["choices"]:
        got = [ch["choices"][0] for ch in chunks if ch["choices"][0]["index"] == want["index"]]
        assert [t for c in got for t in c.get("token_ids", [])] == want["token_ids"]


def _chunks(server: Server, path: str, body: dict[str, Any]) -> list[dict[str, Any]]:
    """A stream's chunks, read to [DONE], as they are (no stream_options added)."""
    with httpx.stream("POST", server.url + path, json={"model": MODEL, **body, "stream": True}, timeout=60) as r:
        assert r.status_code == 200, r.read()
        events = list(sse_events(r.iter_lines()))
    assert events[-1] == "[DONE]"
    return [json.loads(e) for e in events[:-1]]


@pytest.mark.parametrize("path", [C, H])
def test_stream_options_ask_for_usage_unless_they_say_otherwise(server, path):
    """vLLM's StreamOptions default include_usage to true: `{}`, or `{"continuous_usage_stats": true}` alone, get
    the final usage chunk (the latter usage in every chunk too); no stream_options, or include_usage false, none.
    Both defaulted to false here, so those requests got no usage at all."""
    base = {"prompt": "Once"} if path == C else {"messages": [{"role": "user", "content": "Hi"}]}
    base = {**base, "max_tokens": 3, "ignore_eos": True}
    cases = ((None, False, False), ({}, True, False), ({"continuous_usage_stats": True}, True, True),
             ({"include_usage": False, "continuous_usage_stats": True}, False, False))
    for options, final, every in cases:  # (stream_options, a final usage chunk, usage in every chunk)
        chunks = _chunks(server, path, base if options is None else {**base, "stream_options": options})
        *body, last = chunks
        assert (last["choices"] == [] and last["usage"]["completion_tokens"] == 3) is final, (options, last)
        with_usage = [ch for ch in (body if final else chunks) if ch.get("usage") is not None]
        assert len(with_usage) == (len(body) if every else 0), (options, chunks)


def _fails_at_its_second_token(server: Server) -> tuple[int, dict[str, Any]]:
    """(a token, a request's fields that make it fail at its second token): the token is the one allowed, and
    `bad_words` bans it after itself, so the sampler has nothing left to sample (the request's own fault: 400)."""
    ids = server.post("/tokenize", {"model": MODEL, "prompt": "aa", "add_special_tokens": False}).json()["tokens"]
    assert len(ids) == 2 and ids[0] == ids[1], ids
    return ids[0], {"max_tokens": 6, "allowed_token_ids": [ids[0]], "bad_words": ["aa"]}


@pytest.mark.parametrize("path", [C, H])
def test_a_request_failing_mid_stream_sends_its_error_then_cuts(server, path):
    token, fields = _fails_at_its_second_token(server)
    base = {"prompt": "x"} if path == C else {"messages": [{"role": "user", "content": "x"}]}
    r = server.post(path, {"model": MODEL, **base, **fields})  # the status a non-streamed response gets
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["type"] == "BadRequestError" and "no token can be sampled" in error["message"]
    # raw: the first token, then one error event in the same shape, then the cut: no [DONE]
    events: list[str] = []
    with pytest.raises(httpx.RemoteProtocolError), httpx.stream(
            "POST", server.url + path, json={"model": MODEL, **base, **fields, "stream": True,
                                             "return_token_ids": True}, timeout=60) as s:
        assert s.status_code == 200
        for e in sse_events(s.iter_lines()):  # the cut raises while reading
            events.append(e)
    assert "[DONE]" not in events
    *chunks, last = [json.loads(e) for e in events]
    assert last == {"error": error}
    assert [t for ch in chunks for t in ch["choices"][0].get("token_ids", [])] == [token]
    # the official client raises the error with the engine's message, not a bare "Connection error."
    client = server.client()
    create = client.completions.create if path == C else client.chat.completions.create
    with pytest.raises(openai.APIError) as raised:
        for _ in create(model=MODEL, stream=True, max_tokens=fields["max_tokens"], **base,  # type: ignore[call-overload]
                        extra_body={k: fields[k] for k in ("allowed_token_ids", "bad_words")}):
            pass
    assert not isinstance(raised.value, openai.APIConnectionError)
    assert raised.value.message == error["message"] and raised.value.body == error
    assert server.post(C, {"model": MODEL, "prompt": "after", "max_tokens": 2}).status_code == 200


def test_every_chunk_of_a_response_carries_the_requests_created(monkeypatch):
    """A stream's chunks share one `created`, the request's, as OpenAI's and vLLM's do (each chunk read the clock, so
    a stream that crossed a second carried several; clients group chunks by id and created)."""
    import itertools
    from types import SimpleNamespace

    from loopserve.serve import api

    seconds = itertools.count(1000)
    monkeypatch.setattr(api.time, "time", lambda: float(next(seconds)))
    gen = api._Generation(api.CHAT, SimpleNamespace(model=None), "chatcmpl-1", [], None, [], None)  # type: ignore
    serving = SimpleNamespace(settings=SimpleNamespace(model_name="m"))
    assert {api.OpenAIServing.base(serving, "chat.completion.chunk", gen)["created"] for _ in range(3)} == {1000}


def test_logprobs_of_the_whole_vocabulary_by_minus_one(server, tiny_ouro):
    """Under --max-logprobs -1 a request's -1 asks for every token's logprob (vLLM's rule): a completion's came back
    empty (its formatter read -1 as the count), a chat's and a prompt's whole; streamed as not."""
    from loopserve.json_files import read_json_object
    from loopserve.model_config import ModelConfig

    vocab = ModelConfig.from_hf(read_json_object(tiny_ouro / "config.json")).vocab_size
    body = {"prompt": "Once upon", "max_tokens": 2, "temperature": 0, "logprobs": -1, "echo": True}
    for choice in (_post(server, C, body)["choices"][0],
                   *(ch["choices"][0] for ch in _stream(server, C, {**body, "echo": False})[0])):
        tops = [t for t in choice["logprobs"]["top_logprobs"] if t is not None]
        assert tops and all(20 < len(t) <= vocab for t in tops), [len(t) for t in tops]  # (keyed by text: ties merge)
    chat = _post(server, H, {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2, "temperature": 0,
                             "logprobs": True, "top_logprobs": -1})["choices"][0]["logprobs"]["content"]
    assert chat and all(len(t["top_logprobs"]) == vocab for t in chat)
