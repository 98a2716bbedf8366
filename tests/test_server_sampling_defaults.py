"""The server's request defaults: a checkpoint's generation_config.json sampling values fill a request's unset fields
(vLLM's `default_sampling_params`, `LLM.get_default_sampling_params` offline; `--generation-config vllm` ignores
them), for sampling and for a beam search's temperature; the server's `--exit-threshold` is the threshold of its own
exit policy (--exit-policy, else the model's), not of a policy a request picks; `--exit-policy kl`'s start-up warning.
A real `loopserve serve` process on a tiny Ouro copy whose generation_config.json sets temperature, top_k and
max_new_tokens, and `load_server` in this process."""

from __future__ import annotations

import json
import logging
import shutil
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from loopserve import LLM
from loopserve.cli import build_parser
from loopserve.exits import DEFAULT_THRESHOLDS
from loopserve.serve.api import serving_defaults
from loopserve.serve.cli import load_server
from loopserve.serve.protocol import ApiError, CompletionRequest, fill_defaults, sampling_params
from tests.server_helpers import MODEL, Server, run_server

pytestmark = pytest.mark.timeout(180)

C, H = "/v1/completions", "/v1/chat/completions"
GEN = {"temperature": 0.5, "top_k": 3, "max_new_tokens": 5}  # the checkpoint's generation_config.json sets these
THRESHOLD = 0.9  # the server's --exit-threshold (the Ouro gate's: the model's own policy)


def _with_generation_config(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    path = dst / "generation_config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), **GEN}))
    return dst


@pytest.fixture(scope="module")
def checkpoint(tiny_ouro, tmp_path_factory) -> Path:
    return _with_generation_config(tiny_ouro, tmp_path_factory.mktemp("gen") / "m")


@pytest.fixture(scope="module")
def server(checkpoint, tmp_path_factory) -> Iterator[Server]:
    with run_server(checkpoint, tmp_path_factory.mktemp("defaults") / "server.log", "--dtype", "float32",
                    "--kv-cache-tokens", "4096", "--exit-threshold", str(THRESHOLD), "--enable-log-requests",
                    log_level="info") as s:
        yield s


def _ok(server: Server, path: str, body: dict, request_id: str | None = None) -> dict:
    if path == H:
        body = {"messages": [{"role": "user", "content": "Hello there"}], **body}
    else:
        body = {"prompt": "hello there", **body}
    r = server.post(path, {"model": MODEL, "return_token_ids": True, **body}, request_id=request_id)
    assert r.status_code == 200, r.text
    return r.json()


def _tokens(server: Server, path: str, body: dict) -> list[int]:
    return _ok(server, path, body)["choices"][0]["token_ids"]


def _args(model: Path, *flags: str):
    return build_parser().parse_args(["serve", "--model", str(model), "--device", "cpu", "--kv-cache-tokens", "1024",
                                      *flags])


# -- generation_config.json -------------------------------------------------------------------------------------
@pytest.mark.parametrize("path", [C, H])
def test_unset_sampling_fields_take_the_checkpoints(server, path):
    """A seeded request that sets neither temperature nor top_k samples as one giving the checkpoint's values, not
    as one giving SamplingParams' own (1 and -1)."""
    body = {"seed": 7, "max_tokens": 12, "ignore_eos": True}
    unset = _tokens(server, path, body)
    assert unset == _tokens(server, path, {**body, "temperature": GEN["temperature"], "top_k": GEN["top_k"]})
    assert unset != _tokens(server, path, {**body, "temperature": 1.0, "top_k": -1})
    # a request's own value wins over the checkpoint's
    assert unset != _tokens(server, path, {**body, "top_k": -1})


@pytest.mark.parametrize("path", [C, H])
def test_truncation_to_the_context_leaves_room_for_the_default_max_tokens(server, path):
    """truncate_prompt_tokens=-1 without max_tokens keeps max_model_len - the default the request then gets (here the
    checkpoint's max_new_tokens), on both endpoints: the completion is not squeezed to what is left."""
    long = "word " * 4000
    body = {"ignore_eos": True, "seed": 1, "truncate_prompt_tokens": -1}
    body |= {"messages": [{"role": "user", "content": long}]} if path == H else {"prompt": long}
    usage = _ok(server, path, body)["usage"]
    assert usage["completion_tokens"] == GEN["max_new_tokens"], usage
    context = httpx.get(server.url + "/v1/models", timeout=30).json()["data"][0]["max_model_len"]
    assert usage["prompt_tokens"] + GEN["max_new_tokens"] == context, usage


@pytest.mark.parametrize("path", [C, H])
def test_unset_max_tokens_takes_max_new_tokens(server, path):
    got = _ok(server, path, {"ignore_eos": True, "seed": 1})
    assert got["usage"]["completion_tokens"] == GEN["max_new_tokens"]  # (completions: min(16, 5); chat: 5)
    got = _ok(server, path, {"ignore_eos": True, "seed": 1, "max_tokens": 7})
    assert got["usage"]["completion_tokens"] == 7


def _log_lines(server: Server, marker: str, want: int, timeout: float = 10.0) -> list[str]:
    deadline = time.monotonic() + timeout
    while len(lines := [ln for ln in server.log.read_text().splitlines() if marker in ln]) < want:
        assert time.monotonic() < deadline, f"{marker!r}: {lines}"
        time.sleep(0.05)
    return lines


def test_beam_search_temperature_default_and_one_log_line_per_search(server):
    """A beam search's unset temperature is the checkpoint's (vLLM's `to_beam_search_params`), its own wins; the
    search is logged once when it starts (with its params) and once when it ends, not per beam per step."""
    body = {"use_beam_search": True, "n": 2, "max_tokens": 3, "ignore_eos": True}
    for rid, extra, temperature in (("beam-default", {}, GEN["temperature"]), ("beam-own", {"temperature": 0.25},
                                                                                0.25)):
        got = _ok(server, C, {**body, **extra}, request_id=rid)
        assert [len(c["token_ids"]) for c in got["choices"]] == [3, 3]
        [received] = _log_lines(server, f"Received request cmpl-{rid}", 1)
        assert "BeamSearchParams(beam_width=2, max_tokens=3, ignore_eos=True, temperature=" \
               f"{temperature}," in received, received
        [finished] = _log_lines(server, f"Finished request cmpl-{rid}", 1)
        assert "length, " in finished and " + 6 completion tokens" in finished  # (both beams', as usage counts)
    time.sleep(0.3)  # (nothing more is logged for them)
    for rid in ("beam-default", "beam-own"):
        assert len(_log_lines(server, f"request cmpl-{rid}", 2)) == 2


def test_the_request_log_counts_every_sample_and_says_what_was_aborted(server):
    """--enable-log-requests: a request's line counts the completion tokens its response reports (every sample's, none
    for an echo with max_tokens 0), beside the loops of all its samples; a stream its client leaves is logged as
    aborted (it had no line at all; an n = 2 request's line read sample 0's tokens beside both samples' loops)."""
    got = _ok(server, C, {"n": 2, "max_tokens": 3, "ignore_eos": True}, request_id="log-n2")
    assert got["usage"]["completion_tokens"] == 6
    [line] = _log_lines(server, "Finished request cmpl-log-n2", 1)
    assert "length, " in line and " + 6 completion tokens" in line, line
    _ok(server, C, {"echo": True, "max_tokens": 0, "logprobs": 1}, request_id="log-echo")
    [line] = _log_lines(server, "Finished request cmpl-log-echo", 1)
    assert " + 0 completion tokens" in line, line
    body = {"model": MODEL, "prompt": "hello there", "max_tokens": 1500, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", server.url + C, json=body, headers={"X-Request-Id": "log-cut"}, timeout=30) as r:
        next(r.iter_lines())  # (the first chunk; then the client goes away, 1,500 tokens before the end)
    _log_lines(server, "Aborted request cmpl-log-cut", 1)
    assert not _log_lines(server, "Finished request cmpl-log-cut", 0)


def test_generation_config_vllm_ignores_the_checkpoints(checkpoint):
    req = CompletionRequest(prompt="x")
    for mode, want in (("auto", (0.5, 3)), ("vllm", (1.0, -1))):
        engine, settings = load_server(_args(checkpoint, "--generation-config", mode))
        params = sampling_params(req, max_tokens=2, logprobs=None, defaults=settings.sampling_defaults)
        assert (params.temperature, params.top_k) == want, mode
    # as offline
    offline = LLM(checkpoint, scheduler="reference").get_default_sampling_params()
    assert (offline.temperature, offline.top_k, offline.max_tokens) == (0.5, 3, 5)


def test_override_generation_config_sets_defaults_over_the_generation_configs(checkpoint, caplog):
    """vLLM's --override-generation-config (a JSON object of the file's keys; LLM's override_generation_config): over
    the checkpoint's defaults, or alone with --generation-config vllm (it was refused). A bad value names its key; a
    key that sets no default is left out, with a warning."""
    req = CompletionRequest(prompt="x")
    override = '{"temperature": 0.25, "max_new_tokens": 7, "do_sample": true}'
    for mode, want in (("auto", (0.25, 3, 7)), ("vllm", (0.25, -1, 7))):
        with caplog.at_level(logging.WARNING, logger="loopserve.models.loader"):
            engine, settings = load_server(_args(checkpoint, "--generation-config", mode,
                                                 "--override-generation-config", override))
        params = sampling_params(req, max_tokens=None, logprobs=None, defaults=settings.sampling_defaults)
        assert (params.temperature, params.top_k, settings.sampling_defaults["max_tokens"]) == want, mode
        assert "do_sample set no sampling default" in caplog.text
    llm = LLM(checkpoint, scheduler="reference", override_generation_config={"top_k": 9})
    offline = llm.get_default_sampling_params()
    assert (offline.temperature, offline.top_k, offline.max_tokens) == (0.5, 9, 5)
    # null drops the file's value, as vLLM's update does; keys are the file's names
    dropped = LLM(checkpoint, scheduler="reference", override_generation_config={"temperature": None})
    assert dropped.get_default_sampling_params().temperature == 1.0
    with pytest.raises(ValueError, match=r"^override_generation_config: must be a dict of generation config keys"):
        LLM(checkpoint, scheduler="reference", override_generation_config={1: 2})
    # vLLM's override_max_tokens: an override's max_new_tokens caps a request's own max_tokens too
    from loopserve.serve.api import OpenAIServing

    serving = OpenAIServing(*load_server(_args(checkpoint, "--override-generation-config", '{"max_new_tokens": 7}')))
    assert serving.resolve_max_tokens(20, 16, 4, "prompt") == 7
    with pytest.raises(ValueError, match=r"^override_generation_config\.temperature: must be"):
        LLM(checkpoint, scheduler="reference", override_generation_config={"temperature": -1})
    with pytest.raises(SystemExit):  # (argparse's error: not a JSON object)
        _args(checkpoint, "--override-generation-config", "[1]")


def test_a_beam_search_with_max_tokens_null_goes_as_far_as_its_roomiest_prompt(checkpoint):
    """vLLM sizes each prompt's search by its own room; one search here runs as far as the prompt with the most room,
    each prompt's beams ending where its own context is full (it ran every prompt only as far as the shortest)."""
    from loopserve.serve.api import OpenAIServing

    serving = OpenAIServing(*load_server(_args(checkpoint, "--generation-config", "vllm", "--max-model-len", "64")))
    req = CompletionRequest.model_validate({"prompt": [[5, 6], [5] * 60], "max_tokens": None, "use_beam_search": True,
                                            "n": 1})
    beam = serving.beam_completion(req, 0.0, [("prompt.0", None, [5, 6]), ("prompt.1", None, [5] * 60)], "cmpl-b")
    assert beam.search is not None and beam.search.params.max_tokens == 62


def test_a_generation_config_folder_caps_every_max_tokens(checkpoint):
    """vLLM's rule (`override_max_tokens`): a generation config given as a folder caps every request's budget with its
    max_new_tokens, whether the request sets max_tokens or not; the model's own ("auto") caps only an unset one. A
    request is checked as it asks first (past the context: still a 400)."""
    from loopserve.serve.api import ApiError, OpenAIServing

    for mode, explicit in ((str(checkpoint), GEN["max_new_tokens"]), ("auto", 9)):
        serving = OpenAIServing(*load_server(_args(checkpoint, "--generation-config", mode)))
        assert serving.resolve_max_tokens(9, 16, 4, "prompt") == explicit, mode
        assert serving.resolve_max_tokens(None, 16, 4, "prompt") == GEN["max_new_tokens"], mode
        beam = serving.beam_completion(CompletionRequest(prompt=[5, 17, 99], max_tokens=9, use_beam_search=True, n=2),
                                       0.0, [("prompt", None, [5, 17, 99])], "cmpl-beam")
        assert beam.search is not None and beam.search.params.max_tokens == explicit, mode  # (a search's too)
        with pytest.raises(ApiError, match="max_tokens: This model's maximum context length"):
            serving.resolve_max_tokens(serving.max_model_len, 16, 4, "prompt")
    # truncate_prompt_tokens=-1 cuts for max_tokens as asked, the amount the check reads (cut for the capped 5 it
    # left 59 tokens, which then failed the check of 30 with a 400 about a length the server had picked)
    serving = OpenAIServing(*load_server(_args(checkpoint, "--generation-config", str(checkpoint),
                                               "--max-model-len", "64")))
    ids = serving.cut_prompt(list(range(3, 103)), -1, 30)
    assert ids == list(range(69, 103))  # (the last 64 - 30)
    assert serving.resolve_max_tokens(30, 16, len(ids), "prompt") == GEN["max_new_tokens"]


# -- the exit threshold belongs to the server's exit policy --------------------------------------------------------
def test_server_threshold_is_its_own_policys(server):
    """--exit-threshold 0.9 on an Ouro server (no --exit-policy: the gate's): a request that picks kl gets kl's
    default threshold (5e-4), not 0.9; one that names the gate, or no policy, gets 0.9."""
    body = {"temperature": 0.0, "max_tokens": 8, "ignore_eos": True}

    def depths(extra: dict) -> list[int]:
        return _ok(server, C, {**body, **extra})["choices"][0]["exit_depths"]

    kl = depths({"exit_policy": "kl"})
    assert kl == depths({"exit_policy": "kl", "exit_threshold": DEFAULT_THRESHOLDS["kl"]})
    assert kl != depths({"exit_policy": "kl", "exit_threshold": THRESHOLD})  # (this checkpoint tells them apart)
    gate = depths({"exit_policy": "gate"})
    assert gate == depths({}) == depths({"exit_threshold": THRESHOLD})
    assert gate != depths({"exit_threshold": 1.0})


@pytest.mark.parametrize("fixture,own", [("tiny_ouro", "gate"), ("tiny_huginn", "latent_diff")])
def test_threshold_default_rule(request, fixture, own):
    engine, settings = load_server(_args(request.getfixturevalue(fixture), "--exit-threshold", "0.5"))
    defaults = serving_defaults(engine, settings.sampling_defaults)
    assert defaults["exit_policy"] == own
    for policy, threshold in ((None, 0.5), (own, 0.5), ("kl", None), ("fixed", None)):
        filled = fill_defaults(CompletionRequest(prompt="x", exit_policy=policy), defaults)
        assert filled.get("exit_threshold") == threshold, policy
    # an exit_trace names its policy (trace): the server's threshold is not its, and a request with one is run
    traced = CompletionRequest(prompt="x", exit_trace=[1, 2])
    assert "exit_threshold" not in fill_defaults(traced, defaults)
    assert sampling_params(traced, max_tokens=2, logprobs=None, defaults=defaults).exit_policy == "trace"
    # an empty one too: a trace of no tokens, every token past its end at full depth
    empty = CompletionRequest(prompt="x", exit_trace=[])
    assert sampling_params(empty, max_tokens=2, logprobs=None, defaults=defaults).exit_policy == "trace"
    # a request's own threshold always wins; --exit-policy kl makes kl the policy the threshold belongs to
    assert fill_defaults(CompletionRequest(prompt="x", exit_policy="kl", exit_threshold=0.1), defaults)[
        "exit_threshold"] == 0.1
    engine, settings = load_server(_args(request.getfixturevalue(fixture), "--exit-threshold", "0.01",
                                         "--exit-policy", "kl"))
    defaults = serving_defaults(engine, settings.sampling_defaults)
    assert fill_defaults(CompletionRequest(prompt="x", exit_policy="kl"), defaults)["exit_threshold"] == 0.01
    assert "exit_threshold" not in fill_defaults(CompletionRequest(prompt="x", exit_policy=own), defaults)


# -- --exit-policy kl --------------------------------------------------------------------------------------------
def test_exit_policy_kl_warns_at_start(tiny_ouro, tiny_huginn, caplog):
    with caplog.at_level(logging.WARNING, logger="loopserve.serve"):
        load_server(_args(tiny_ouro))
        assert not [r for r in caplog.records if "--exit-policy kl" in r.getMessage()]
        load_server(_args(tiny_ouro, "--exit-policy", "kl"))
        [warning] = [r for r in caplog.records if "--exit-policy kl" in r.getMessage()]
        assert warning.levelno == logging.WARNING and "coda" in warning.getMessage()
        assert "speculative" not in warning.getMessage()  # (no drafts to lose)
        caplog.clear()
        # a model with coda layers and drafts: the KL requests do not draft
        load_server(_args(tiny_huginn, "--exit-policy", "kl", "--num-speculative-tokens", "2"))
        [warning] = [r for r in caplog.records if "--exit-policy kl" in r.getMessage()]
        assert "speculative decoding is off" in warning.getMessage()


def test_a_refusal_of_a_server_default_says_it_is_the_servers(tiny_ouro):
    """--min-loops 2: a request with only max_loops 1 is refused naming min_loops, a field it never sent; the message
    says the value is the server's default (it read as if the request had sent min_loops 2)."""
    engine, settings = load_server(_args(tiny_ouro, "--min-loops", "2"))
    defaults = serving_defaults(engine, settings.sampling_defaults)
    with pytest.raises(ApiError) as refused:
        sampling_params(CompletionRequest(prompt="x", max_loops=1), max_tokens=2, logprobs=None, defaults=defaults)
    assert refused.value.status == 400 and refused.value.param == "min_loops"
    assert str(refused.value).endswith("(min_loops 2 is the server's default, --min-loops: the request left it "
                                       "unset)"), refused.value
    with pytest.raises(ApiError) as own:  # (the request's own value: said as it is)
        sampling_params(CompletionRequest(prompt="x", min_loops=3, max_loops=1), max_tokens=2, logprobs=None,
                        defaults=defaults)
    assert "server's default" not in str(own.value)


@pytest.mark.parametrize("flags, body, note", [
    # the request's own min_loops, against the server's max_loops: the 3 is --max-loops'
    (("--max-loops", "3"), {"min_loops": 4}, "(max_loops 3 is the server's default, --max-loops: the request left "
                                             "it unset)"),
    # the request's own exit_threshold, which the server's policy compares with nothing
    (("--exit-policy", "fixed"), {"exit_threshold": 0.5}, "(exit_policy \"fixed\" is the server's default, "
                                                          "--exit-policy, else the model's own: the request left it "
                                                          "unset)"),
])
def test_a_refusal_says_which_conflicting_value_is_the_servers(tiny_ouro, flags, body, note):
    """A request's own value refused for its conflict with a server default: the message names the field the
    request sent and says the other value is the server's, and from which flag (it read as the request's own)."""
    engine, settings = load_server(_args(tiny_ouro, *flags))
    defaults = serving_defaults(engine, settings.sampling_defaults)
    [field] = body
    with pytest.raises(ApiError) as refused:
        sampling_params(CompletionRequest(prompt="x", **body), max_tokens=2, logprobs=None, defaults=defaults)
    assert refused.value.status == 400 and refused.value.param == field
    assert str(refused.value).startswith(f"{field}: ") and str(refused.value).endswith(note), refused.value
    assert str(refused.value).count("server's default") == 1  # (the request's own field: said as it is)


# -- the chat template's default variables ---------------------------------------------------------------------------
def test_default_chat_template_kwargs_sit_under_a_requests_own(checkpoint, tmp_path):
    """vLLM's --default-chat-template-kwargs: the template's variables for every chat request, a request's own
    chat_template_kwargs over them (it was refused as an unknown flag); checked as a request's are."""
    from loopserve.serve.api import OpenAIServing
    from loopserve.serve.cli import _check
    from loopserve.serve.protocol import ChatCompletionRequest, TokenizeChatRequest

    template = tmp_path / "t.jinja"
    template.write_text("{{ 'think' if enable_thinking else 'plain' }}|{{ style | default('none') }}|"
                        "{% for m in messages %}{{ m.content }}{% endfor %}")
    flags = ("--chat-template", str(template), "--default-chat-template-kwargs",
             '{"enable_thinking": false, "style": "terse"}')
    serving = OpenAIServing(*load_server(_args(checkpoint, *flags)))

    def rendered(**kwargs) -> str:
        ids = json.loads(serving.tokenized(TokenizeChatRequest(messages=[{"role": "user", "content": "hi"}],
                                                               **kwargs)).body)["tokens"]
        return serving.tokenizer.decode(ids)

    assert rendered() == "plain|terse|hi"
    assert rendered(chat_template_kwargs={"enable_thinking": True}) == "think|terse|hi"  # (the request's wins)
    chat = ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}], reasoning_effort="high")
    assert serving.template_kwargs(chat.template_kwargs()) == {"enable_thinking": True, "style": "terse",
                                                               "reasoning_effort": "high"}
    assert _check(_args(checkpoint, "--default-chat-template-kwargs", '{"tools": []}')).startswith(
        "--default-chat-template-kwargs.tools: ")
    assert _check(_args(checkpoint, "--default-chat-template-kwargs", '{"add_generation_prompt": false}')) == (
        "--default-chat-template-kwargs.add_generation_prompt: a request's own field, not a default")
