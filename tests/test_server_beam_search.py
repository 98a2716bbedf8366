"""vLLM's `use_beam_search: true` on /v1/completions and /v1/chat/completions, against a real `loopserve serve`
process on a tiny checkpoint, compared with `LLM.beam_search` on the same checkpoint in this process (both in
float32, with the same engine flags): the same beams (tokens, cumulative logprobs, order, finish reasons) for n 1 to
3, several prompts, length_penalty, ignore_eos both ways and chat; the server's text rule (the generated tokens
alone, a final end-of-sequence token left out unless include_stop_str_in_output); streaming (the final choices as
chunks, then usage and [DONE]); the refusals (a 400 naming the field); a client that goes away mid-search stops it
(nothing left running); a step refused at admission fails the request with a 503; /metrics count a search as one
request (its prompt once, its returned tokens), not its steps' sequences."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator

import httpx
import pytest

from loopserve import LLM
from loopserve.beam_search import BeamSearchParams, BeamSearchSequence
from tests.server_helpers import MODEL, Server, metric, run_server, sse_events, wait_idle

pytestmark = pytest.mark.timeout(180)

C, H = "/v1/completions", "/v1/chat/completions"
# engine flags of both sides: 6 resident sequences and none queued (a capacity of 6: `test_a_step_refused_at_
# admission_fails_the_search`), a KV pool past the context's 2048 tokens
FLAGS = {"dtype": "float32", "kv_cache_tokens": 16384, "max_num_seqs": 6}
EOS_PROMPT = [14, 300]  # tiny Ouro (tests/conftest.py): an end-of-sequence token ranks 3rd after it
MESSAGES = [{"role": "user", "content": "Hello there"}]


@pytest.fixture(scope="module")
def server(tiny_ouro, tmp_path_factory) -> Iterator[Server]:
    flags = [f"--{k.replace('_', '-')}={v}" for k, v in FLAGS.items()]
    with run_server(tiny_ouro, tmp_path_factory.mktemp("beam") / "server.log", *flags,
                    "--max-queued-requests", "0") as s:
        yield s


@pytest.fixture(scope="module")
def offline(tiny_ouro) -> LLM:
    return LLM(tiny_ouro, device="cpu", **FLAGS)


def _post(server: Server, path: str, body: dict, timeout: float | httpx.Timeout = 60) -> httpx.Response:
    body = {"model": MODEL, "use_beam_search": True, **body}
    if path == H:
        body.setdefault("messages", MESSAGES)
    return httpx.post(server.url + path, json=body, timeout=timeout)


def _ok(server: Server, path: str, body: dict) -> dict:
    r = _post(server, path, {"return_token_ids": True, **body})
    assert r.status_code == 200, r.text
    return r.json()


def _server_text(llm: LLM, seq: BeamSearchSequence, prompt_len: int, include_stop: bool = False,
                 skip_special_tokens: bool = True) -> str:
    """The server's rule: the generated tokens, a final end-of-sequence token left out unless include_stop."""
    generated = seq.tokens[prompt_len:]
    if seq.finish_reason == "stop" and not include_stop:
        generated = generated[:-1]
    return llm.tokenizer.decode(generated, skip_special_tokens=skip_special_tokens)


def _assert_same_beams(llm: LLM, choices: list[dict], seqs: list[BeamSearchSequence], prompt: list[int],
                       chat: bool = False, include_stop: bool = False, skip_special_tokens: bool = True) -> None:
    assert len(choices) == len(seqs)
    for c, s in zip(choices, seqs, strict=True):
        assert c["token_ids"] == s.tokens[len(prompt):]  # the end-of-sequence token of a completed beam included
        assert c.get("prompt_token_ids") == (None if chat else prompt)  # (chat: the response's, at the top level)
        assert c["cumulative_logprob"] == pytest.approx(s.cum_logprob, abs=1e-5)
        assert c["finish_reason"] == s.finish_reason
        # a completed beam's end-of-sequence token (vLLM's server search: `stop_reason=eos_token_id`)
        assert c["stop_reason"] == (s.tokens[-1] if s.finish_reason == "stop" else None)
        assert c["logprobs"] is None  # (not asked)
        assert c["exit_depths"] == s.exit_depths == [llm.config.r_max] * len(c["token_ids"])  # full depth
        text = c["message"]["content"] if chat else c["text"]
        assert text == _server_text(llm, s, len(prompt), include_stop, skip_special_tokens)


# -- the same beams as LLM.beam_search ---------------------------------------------------------------------------
@pytest.mark.parametrize("n,max_tokens,length_penalty,ignore_eos,temperature", [
    (1, 4, 1.0, False, 0.0), (2, 3, 0.0, False, 0.0), (3, 4, 2.5, False, 0.0), (2, 4, 1.0, True, 0.0),
    (3, 3, 0.5, True, 0.8)])
def test_completions_equal_offline(server, offline, n, max_tokens, length_penalty, ignore_eos, temperature):
    prompts = [EOS_PROMPT, "hello", [100, 101, 102]]
    ids = [p if isinstance(p, list) else offline.tokenizer.encode(p) for p in prompts]
    params = BeamSearchParams(beam_width=n, max_tokens=max_tokens, ignore_eos=ignore_eos, temperature=temperature,
                              length_penalty=length_penalty)
    want = offline.beam_search([{"prompt_token_ids": p} for p in ids], params)
    body = {"n": n, "max_tokens": max_tokens, "ignore_eos": ignore_eos, "temperature": temperature,
            "length_penalty": length_penalty}
    for prompt, p, out in zip(prompts, ids, want, strict=True):  # one prompt a request
        got = _ok(server, C, {"prompt": prompt, **body})
        assert [c["index"] for c in got["choices"]] == list(range(n))
        _assert_same_beams(offline, got["choices"], out.sequences, p)
        assert got["usage"]["prompt_tokens"] == len(p)  # the prompt once, each returned beam's tokens
        assert got["usage"]["completion_tokens"] == sum(len(c["token_ids"]) for c in got["choices"])
    # the prompts of one request: searched together, each with its n choices, prompt by prompt
    got = _ok(server, C, {"prompt": [prompts[0], prompts[2]], **body})
    assert [c["index"] for c in got["choices"]] == list(range(2 * n))
    _assert_same_beams(offline, got["choices"][:n], want[0].sequences, ids[0])
    _assert_same_beams(offline, got["choices"][n:], want[2].sequences, ids[2])
    assert got["usage"]["prompt_tokens"] == len(ids[0]) + len(ids[2])


@pytest.mark.parametrize("n", [1, 2, 3])
def test_chat_equals_offline(server, offline, n):
    ids = offline.tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True)
    params = BeamSearchParams(beam_width=n, max_tokens=4, temperature=0.0, length_penalty=0.7)
    [want] = offline.beam_search({"prompt_token_ids": ids}, params)
    got = _ok(server, H, {"n": n, "max_tokens": 4, "temperature": 0.0, "length_penalty": 0.7})
    assert got["object"] == "chat.completion" and [c["index"] for c in got["choices"]] == list(range(n))
    assert all(c["message"]["role"] == "assistant" for c in got["choices"])
    _assert_same_beams(offline, got["choices"], want.sequences, ids, chat=True)
    assert got["prompt_token_ids"] == ids
    assert got["usage"]["prompt_tokens"] == len(ids)
    assert got["usage"]["completion_tokens"] == sum(len(c["token_ids"]) for c in got["choices"])
    # max_completion_tokens: the budget, as max_tokens
    capped = _ok(server, H, {"n": n, "max_completion_tokens": 2, "temperature": 0.0, "ignore_eos": True})
    assert [len(c["token_ids"]) for c in capped["choices"]] == [2] * n


def test_completions_default_max_tokens_and_echo(server, offline):
    """max_tokens unset: 16, as for sampling; echo puts the prompt's text first."""
    got = _ok(server, C, {"prompt": "hello", "n": 2, "ignore_eos": True, "temperature": 0.0, "echo": True})
    [want] = offline.beam_search("hello", BeamSearchParams(beam_width=2, max_tokens=16, ignore_eos=True))
    p = len(offline.tokenizer.encode("hello"))
    for c, s in zip(got["choices"], want.sequences, strict=True):
        assert len(c["token_ids"]) == 16 and c["token_ids"] == s.tokens[p:]
        assert c["text"] == "hello" + _server_text(offline, s, p)


# -- the server's text rule ----------------------------------------------------------------------------------------
def test_end_of_sequence_text_and_include_stop_str_in_output(server, offline):
    """A beam completed by an end-of-sequence token: its token ids end with it; its text leaves it out unless
    include_stop_str_in_output, which keeps it where skip_special_tokens does not drop it (a normal request's
    rule). Offline, `text` is the whole sequence decoded (vLLM's offline rule)."""
    body = {"prompt": EOS_PROMPT, "n": 2, "max_tokens": 2, "temperature": 0.0, "length_penalty": 0.0}
    [want] = offline.beam_search({"prompt_token_ids": EOS_PROMPT},
                                 BeamSearchParams(beam_width=2, max_tokens=2, length_penalty=0.0))
    stopped = want.sequences[0]
    assert stopped.finish_reason == "stop" and stopped.tokens[-1] in offline.tokenizer.eos_token_ids
    assert stopped.text == offline.tokenizer.decode(stopped.tokens, skip_special_tokens=False)
    eos_text = offline.tokenizer.decode(stopped.tokens[-1:], skip_special_tokens=False)
    assert eos_text
    plain = _ok(server, C, body)["choices"]
    kept = _ok(server, C, {**body, "include_stop_str_in_output": True, "skip_special_tokens": False})["choices"]
    skipped = _ok(server, C, {**body, "include_stop_str_in_output": True})["choices"]
    _assert_same_beams(offline, plain, want.sequences, EOS_PROMPT)
    _assert_same_beams(offline, kept, want.sequences, EOS_PROMPT, include_stop=True, skip_special_tokens=False)
    assert plain[0]["finish_reason"] == "stop" and plain[0]["token_ids"][-1] == stopped.tokens[-1]
    assert not plain[0]["text"].endswith(eos_text)
    assert kept[0]["text"] == plain[0]["text"] + eos_text
    assert skipped[0]["text"] == plain[0]["text"]  # (skip_special_tokens, true by default, drops it)
    # ignore_eos: no beam completes, each runs max_tokens
    ignored = _ok(server, C, {**body, "ignore_eos": True})["choices"]
    assert [(c["finish_reason"], len(c["token_ids"])) for c in ignored] == [("length", 2)] * 2


# -- streaming -------------------------------------------------------------------------------------------------------
def _events(r: httpx.Response) -> list[dict]:
    assert r.status_code == 200, r.text
    lines = list(sse_events(r.text.splitlines()))
    assert lines[-1] == "[DONE]"
    return [json.loads(x) for x in lines[:-1]]


def test_stream_sends_the_final_choices(server):
    body = {"prompt": EOS_PROMPT, "n": 3, "max_tokens": 4, "temperature": 0.0, "return_token_ids": True}
    whole = _ok(server, C, body)
    # completions: as vLLM's server (its fake stream), the whole response in one event, usage included even unasked
    [event] = _events(_post(server, C, {**body, "stream": True}))
    assert event["object"] == "text_completion" and [c["index"] for c in event["choices"]] == [0, 1, 2]
    for got, c in zip(event["choices"], whole["choices"], strict=True):
        assert (got["text"], got["token_ids"], got["finish_reason"]) == (c["text"], c["token_ids"], c["finish_reason"])
        assert got["cumulative_logprob"] == pytest.approx(c["cumulative_logprob"], abs=1e-5)
    assert {k: event["usage"][k] for k in ("prompt_tokens", "completion_tokens")} == {
        k: whole["usage"][k] for k in ("prompt_tokens", "completion_tokens")}
    # chat: the role for every choice first, then each choice's content
    chat = _ok(server, H, {"n": 2, "max_tokens": 3, "temperature": 0.0})
    events = _events(_post(server, H, {"n": 2, "max_tokens": 3, "temperature": 0.0, "stream": True}))
    assert [e["choices"][0]["delta"] for e in events[:2]] == [{"role": "assistant", "content": ""}] * 2
    assert [e["choices"][0]["index"] for e in events] == [0, 1, 0, 1]
    for e, c in zip(events[2:], chat["choices"], strict=True):
        assert e["object"] == "chat.completion.chunk"
        assert e["choices"][0]["delta"] == {"content": c["message"]["content"]}
        assert e["choices"][0]["finish_reason"] == c["finish_reason"]


# -- refusals --------------------------------------------------------------------------------------------------------
TOOLS = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]


@pytest.mark.parametrize("path,extra,param", [
    (C, {"n": 11}, "n"), (C, {"n": 0}, "n"), (H, {"n": 11}, "n"), (C, {"n": 7}, "n"), (H, {"n": 7}, "n"),
    (C, {"logprobs": -2}, "logprobs"), (C, {"logprobs": 21}, "logprobs"),
    (C, {"echo": True, "logprobs": 0}, "logprobs"), (H, {"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    (H, {"logprobs": False, "top_logprobs": 2}, "top_logprobs"), (C, {"prompt_logprobs": 0}, "prompt_logprobs"),
    (C, {"stop": ["x"]}, "stop"), (H, {"stop": "x"}, "stop"), (C, {"stop_token_ids": [5]}, "stop_token_ids"),
    (C, {"top_p": 0.5}, "top_p"), (C, {"top_k": 5}, "top_k"), (H, {"min_p": 0.1}, "min_p"),
    (C, {"repetition_penalty": 1.2}, "repetition_penalty"), (C, {"frequency_penalty": 0.5}, "frequency_penalty"),
    (H, {"presence_penalty": 0.5}, "presence_penalty"), (C, {"logit_bias": {"5": 1.0}}, "logit_bias"),
    (C, {"min_tokens": 2}, "min_tokens"), (C, {"allowed_token_ids": [5, 6]}, "allowed_token_ids"),
    (C, {"bad_words": ["x"]}, "bad_words"), (C, {"min_loops": 2}, "min_loops"), (H, {"max_loops": 2}, "max_loops"),
    (C, {"max_loops": 99}, "max_loops"),
    (C, {"exit_threshold": 0.5}, "exit_threshold"), (C, {"exit_policy": "kl"}, "exit_policy"),
    (C, {"exit_trace": [1, 2]}, "exit_trace"), (C, {"num_speculative_tokens": 2}, "num_speculative_tokens"),
    (C, {"n": 2, "best_of": 3}, "best_of"), (C, {"response_format": {"type": "json_object"}}, "response_format"),
    (H, {"guided_choice": ["a", "b"]}, "guided_choice"), (C, {"structured_outputs": {"regex": "a+"}},
                                                          "structured_outputs"),
    (H, {"tools": TOOLS, "tool_choice": "required"}, "tool_choice"), (C, {"max_tokens": 0}, "max_tokens"),
    (H, {"max_completion_tokens": 0}, "max_completion_tokens"), (C, {"max_tokens": 5000}, "max_tokens"),
    (C, {"temperature": -1.0}, "temperature"),
    (H, {"seed": 2**70}, "seed")])
@pytest.mark.parametrize("stream", [False, True])
def test_refusals_name_the_field(server, path, extra, param, stream):
    body = {"prompt": "hello"} if path == C else {}
    r = _post(server, path, {**body, "max_tokens": 2, "stream": stream, **extra})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and err["message"].startswith(f"{param}: "), err


@pytest.mark.parametrize("path", [C, H])
@pytest.mark.parametrize("beam", [True, False])
def test_n_past_the_capacity_is_a_400_before_anything_runs(server, path, beam):
    """n sequences (samples, or a beam search's beams) past the server's capacity (6 here) can never be admitted,
    however idle the server: a 400 naming n, one rule for completions and chat, before any step runs (chat used to
    run a search's first step, then answer 503 "retry later")."""
    wait_idle(server)
    before = _steps(server)
    body = {"prompt": "hello"} if path == C else {}
    r = _post(server, path, {**body, "max_tokens": 2, "n": 7, "use_beam_search": beam})
    assert r.status_code == 400 and "Retry-After" not in r.headers, r.text
    err = r.json()["error"]
    assert err["param"] == "n" and err["message"].startswith(
        "n: 1 prompt x n = 7 are 7 sequences; this server holds at most 6 at once"), err
    assert _steps(server) == before


# -- logprobs: the beams' own ----------------------------------------------------------------------------------------
def _ids_of(tokens: list[str]) -> list[int]:
    return [int(t.removeprefix("token_id:")) for t in tokens]


def _by_rank(entry: dict) -> list[int]:
    return [t for t, _ in sorted(entry.items(), key=lambda kv: kv[1].rank)]


@pytest.mark.parametrize("k", [0, 2, 6])
def test_completions_logprobs_are_the_beams_own(server, offline, k):
    """`logprobs: k` with use_beam_search (vLLM's server formats the beams' logprobs): per generated token, its own
    logprob and the first k + 1 of its step's entry (the sampled token, then the top 2 * n), by rank. A step's entry
    holds 2 * n here (greedy: the sampled token is the top one), so k = 6 with n = 2 gets 4, as vLLM's does.
    Streamed: the same."""
    body = {"prompt": EOS_PROMPT, "n": 2, "max_tokens": 3, "temperature": 0.0, "length_penalty": 0.0,
            "logprobs": k, "return_tokens_as_token_ids": True}
    [want] = offline.beam_search({"prompt_token_ids": EOS_PROMPT},
                                 BeamSearchParams(beam_width=2, max_tokens=3, length_penalty=0.0))
    got = _ok(server, C, body)["choices"]
    assert any(s.finish_reason == "stop" for s in want.sequences)
    for c, s in zip(got, want.sequences, strict=True):
        lp = c["logprobs"]
        assert _ids_of(lp["tokens"]) == c["token_ids"] == s.tokens[len(EOS_PROMPT):]
        assert len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == len(lp["text_offset"]) == len(s.logprobs)
        for t, own, top, entry in zip(c["token_ids"], lp["token_logprobs"], lp["top_logprobs"], s.logprobs,
                                      strict=True):
            assert own == pytest.approx(entry[t].logprob, abs=1e-5)
            assert len(entry) == 4 and _ids_of(list(top)) == _by_rank(entry)[:min(k + 1, 4)]
            assert list(top.values()) == pytest.approx([entry[x].logprob for x in _ids_of(list(top))], abs=1e-5)
        assert sum(lp["token_logprobs"]) == pytest.approx(c["cumulative_logprob"], abs=1e-5)
    [streamed] = _events(_post(server, C, {**body, "stream": True}))
    assert [c["logprobs"] for c in streamed["choices"]] == [c["logprobs"] for c in got]


@pytest.mark.parametrize("k", [0, 3, 6])
def test_chat_logprobs_are_the_beams_own(server, offline, k):
    """`logprobs: true, top_logprobs: k` with use_beam_search: per token its own logprob and k alternatives by rank,
    at most the 2 * n its step's entry holds (vLLM's too: k = 6 with n = 2 gets 4). Streamed: the same."""
    ids = offline.tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True)
    body = {"n": 2, "max_tokens": 3, "temperature": 0.0, "logprobs": True, "top_logprobs": k,
            "return_tokens_as_token_ids": True}
    [want] = offline.beam_search({"prompt_token_ids": ids}, BeamSearchParams(beam_width=2, max_tokens=3,
                                                                               temperature=0.0))
    got = _ok(server, H, body)["choices"]
    for c, s in zip(got, want.sequences, strict=True):
        content = c["logprobs"]["content"]
        assert _ids_of([x["token"] for x in content]) == c["token_ids"] == s.tokens[len(ids):]
        for x, t, entry in zip(content, c["token_ids"], s.logprobs, strict=True):
            assert x["logprob"] == pytest.approx(entry[t].logprob, abs=1e-5)
            assert _ids_of([y["token"] for y in x["top_logprobs"]]) == _by_rank(entry)[:min(k, 4)]
    streamed = [e["choices"][0] for e in _events(_post(server, H, {**body, "stream": True}))[2:]]
    (shapes, values), (want_shapes, want_values) = _floats_apart(streamed), _floats_apart(got)
    # (values up to float32 rounding: the two runs may find different prompt blocks cached, and a prefill that reads
    # cached KV rounds its last rows' logits otherwise)
    assert shapes == want_shapes and values == pytest.approx(want_values, abs=1e-5)


def _floats_apart(choices: list[dict]) -> tuple[list, list]:
    """The choices' logprobs with each float replaced by a placeholder, and the floats."""
    floats: list[float] = []

    def strip(x):
        if isinstance(x, float):
            floats.append(x)
            return "<float>"
        if isinstance(x, dict):
            return {k: strip(v) for k, v in x.items()}
        return [strip(v) for v in x] if isinstance(x, list) else x

    shapes = [strip(c["logprobs"]) for c in choices]
    return shapes, floats


def test_neutral_values_are_taken(server, offline):
    """Fields at a value that asks for nothing pass; length_penalty other than 1 still needs use_beam_search."""
    neutral = {"top_p": 1.0, "top_k": -1, "min_p": 0.0, "stop": [], "stop_token_ids": [], "repetition_penalty": 1,
               "frequency_penalty": 0, "presence_penalty": 0.0, "logit_bias": {}, "min_tokens": 0, "bad_words": [],
               # (what the search does: every token at full depth; these were refused, the depth fields but
               # exit_policy at any value)
               "allowed_token_ids": [], "exit_policy": "fixed", "max_loops": offline.config.r_max, "min_loops": 1,
               "num_speculative_tokens": 0, "n": 2, "best_of": 2, "seed": 5, "truncate_prompt_tokens": 1,
               "cache_salt": "s", "user": "u"}
    r = _ok(server, C, {"prompt": "hello there", "max_tokens": 2, **neutral})
    assert len(r["choices"]) == 2 and r["usage"]["prompt_tokens"] == 1  # (truncated to its last token)
    chat = _ok(server, H, {"max_tokens": 2, "logprobs": False, "tools": TOOLS, "tool_choice": "none"})
    assert len(chat["choices"]) == 1
    r = httpx.post(server.url + C, json={"model": MODEL, "prompt": "hi", "max_tokens": 2, "length_penalty": 0.5},
                   timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == "length_penalty", r.text


# -- the search's requests: disconnects, admission ---------------------------------------------------------------
def _steps(server: Server) -> float:
    """Engine steps so far (the search's steps are not requests in the metrics: `ServerMetrics.beam_search`)."""
    return metric(server, "loopserve:engine_steps_total")


def _aborted(server: Server) -> float:
    return metric(server, "loopserve:request_success_total", finished_reason="abort")


@pytest.mark.parametrize("stream", [False, True])
def test_client_disconnect_mid_search_stops_it(server, stream):
    """A long search (1000 steps of 3 beams, seconds) whose client goes away after half a second: the step in
    flight is aborted and no other starts; nothing is left running or holding KV blocks; the metrics count one
    aborted request."""
    wait_idle(server)
    before, aborted = _steps(server), _aborted(server)
    with pytest.raises(httpx.ReadTimeout):
        _post(server, C, {"prompt": "hello", "n": 3, "max_tokens": 1000, "ignore_eos": True, "stream": stream},
              timeout=httpx.Timeout(30, read=0.5))
    time.sleep(0.3)  # (the server sees the disconnect; between two steps nothing runs for a moment)
    wait_idle(server)
    after = _steps(server)
    assert after > before  # the search ran some steps, then stopped
    time.sleep(0.5)
    assert _steps(server) == after  # and no step began since
    wait_idle(server)
    assert metric(server, "loopserve:num_requests_running") == metric(server, "loopserve:num_requests_waiting") == 0
    assert _aborted(server) == aborted + 1


# -- the search in /metrics: one request per prompt ------------------------------------------------------------------
METRICS = {"success": ("loopserve:request_success_total", {}), "prompt": ("loopserve:prompt_tokens_total", {}),
           "generated": ("loopserve:generation_tokens_total", {}),
           "ttft": ("loopserve:time_to_first_token_seconds_count", {}),
           "e2e": ("loopserve:e2e_request_latency_seconds_count", {}),
           "itl": ("loopserve:inter_token_latency_seconds_count", {}),
           "request_prompt": ("loopserve:request_prompt_tokens_sum", {}),
           "request_generated": ("loopserve:request_generation_tokens_sum", {}),
           "length": ("loopserve:request_success_total", {"finished_reason": "length"})}


def _metrics(server: Server) -> dict[str, float]:
    return {k: metric(server, name, **labels) for k, (name, labels) in METRICS.items()}


@pytest.mark.parametrize("path,stream", [(C, False), (C, True), (H, False)])
def test_metrics_count_a_search_once(server, path, stream):
    """A search of 3 beams over 4 steps (one prompt) is one request: its prompt once, its returned beams' tokens
    (as `usage` counts them), one finish reason, one time to first token and one end-to-end latency; its steps'
    sequences (1 + 3 * 3 of them) are not counted."""
    body = {"n": 3, "max_tokens": 4, "ignore_eos": True, "temperature": 0.0, "stream": stream,
            "stream_options": {"include_usage": True} if stream else None}
    if path == C:
        body["prompt"] = [100, 101, 102]
    wait_idle(server)
    before = _metrics(server)
    r = _post(server, path, body)
    usage = _events(r)[-1]["usage"] if stream else r.json()["usage"]
    assert usage["completion_tokens"] == 3 * 4
    delta = {k: v - before[k] for k, v in _metrics(server).items()}
    assert delta == {"success": 1, "prompt": usage["prompt_tokens"], "generated": 12, "ttft": 1, "e2e": 1, "itl": 0,
                     "request_prompt": usage["prompt_tokens"], "request_generated": 12, "length": 1}, delta


def test_a_step_refused_at_admission_fails_the_search(server):
    """Each step is admitted as a request's samples are: with 3 of the server's 6 places taken by a running
    request, the first step (1 beam) runs, the second (4 beams) does not fit: the request is a 503 with
    Retry-After, and nothing of it is left running."""
    wait_idle(server)
    body = {"model": MODEL, "prompt": "busy", "n": 3, "max_tokens": 1500, "ignore_eos": True, "stream": True}
    with httpx.Client(timeout=60) as client, client.stream("POST", server.url + C, json=body) as long:
        assert long.status_code == 200
        events = sse_events(long.iter_lines())
        next(events)  # running
        r = _post(server, C, {"prompt": "hello", "n": 4, "max_tokens": 3})
        assert r.status_code == 503, r.text
        assert r.headers["Retry-After"] == "1" and "capacity" in r.json()["error"]["message"]
        events.close()
    wait_idle(server)
    assert _ok(server, C, {"prompt": "hello", "n": 4, "max_tokens": 3})["choices"]  # the server goes on


def test_log_is_clean(server):
    text = server.log.read_text()
    assert "Traceback" not in text and "ERROR" not in text, text[-3000:]


@pytest.mark.parametrize("length_penalty", [1e300, -1e300])
def test_a_huge_length_penalty_ranks_by_its_limit(server, offline, length_penalty):
    """A finite but huge length_penalty overflows `seq_len ** length_penalty` (vLLM raises OverflowError): the score
    takes its limit instead (0 for every beam, or minus infinity), on the server as offline."""
    body = {"prompt": "hello", "max_tokens": 2, "n": 2, "use_beam_search": True, "temperature": 0,
            "length_penalty": length_penalty}
    got = _ok(server, C, body)
    want = offline.beam_search(["hello"], BeamSearchParams(beam_width=2, max_tokens=2, temperature=0.0,
                                                           length_penalty=length_penalty))[0].sequences
    assert [c["cumulative_logprob"] for c in got["choices"]] == pytest.approx([s.cum_logprob for s in want])
