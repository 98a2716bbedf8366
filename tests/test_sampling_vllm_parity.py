"""vLLM's SamplingParams as a script migrating from vLLM passes them: optional lists given as None, booleans
checked as booleans, vLLM's other fields (`best_of`, `allowed_token_ids`, `bad_words`,
`spaces_between_special_tokens`, `detokenize`, `extra_args`, `structured_outputs`) accepted or refused with a
ValueError naming the field; `allowed_token_ids` and `bad_words` in the batching engine exactly as the
reference decoder samples them, whatever the batch; the same over HTTP (with beam search refused); and
logprob entries in vLLM V1's order (the token's own first, then the top ones by rank)."""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest
import torch

from loopserve import LLM, GuidedDecodingParams, SamplingParams
from loopserve.engine.sampler import (
    AllowedTokenIds,
    BadWords,
    NothingToSampleError,
    adjust_logits,
    bind,
    plain_greedy,
    sample_one,
    sample_rows,
)
from loopserve.sampling_params import MAX_EXIT_TRACE, StructuredOutputsParams
from tests.engine_helpers import Req, assert_matches, drive, make_engine, reference
from tests.server_helpers import MODEL, Server, run_server
from tests.test_penalties import history
from tests.test_speculative import SPEC, assert_same, drafted

PROMPT = [5, 17, 99, 3, 250, 40, 7]
INF = float("inf")


def _gen(llm: LLM, prompt, **kw):
    return llm.generate([prompt], SamplingParams(**kw), use_tqdm=False)[0]


@pytest.fixture(scope="module")
def ref_llm(tiny_ouro) -> LLM:
    return LLM(model=tiny_ouro, scheduler="reference", dtype="float64")


# ---------------- validation


def test_optional_lists_take_none():
    p = SamplingParams(stop_token_ids=None, stop=None, bad_words=None, allowed_token_ids=None, extra_args=None,
                       structured_outputs=None, best_of=None, logit_bias=None)
    assert p.stop_token_ids == [] and p.stop == [] and p.bad_words == [] and p.guided_decoding is None
    assert SamplingParams().stop == [] and SamplingParams().bad_words == []  # (vLLM's: `params.stop + [...]` works)
    assert SamplingParams(stop_token_ids=(3, 4), allowed_token_ids=(1, 2)).allowed_token_ids == [1, 2]
    assert SamplingParams(exit_trace=(1, 2)).exit_trace == [1, 2]  # (as a numpy array is taken)


def test_exit_trace_is_capped_and_checked_at_c_speed():
    """An exit trace longer than any output (`MAX_EXIT_TRACE`) is refused naming it: 1.3M entries once took 34 s
    of a server's CPU, its per-entry checks run again for every prompt's copy of the params."""
    assert len(SamplingParams(exit_trace=[1] * MAX_EXIT_TRACE).exit_trace) == MAX_EXIT_TRACE
    with pytest.raises(ValueError, match=rf"^exit_trace: at most {MAX_EXIT_TRACE} depths .*got {MAX_EXIT_TRACE + 1}$"):
        SamplingParams(exit_trace=[1] * (MAX_EXIT_TRACE + 1))
    for bad in ([1, 0], [1, True], [1, 2.0], "12"):
        with pytest.raises(ValueError, match="^exit_trace: must be a list of integers >= 1"):
            SamplingParams(exit_trace=bad)


def test_seed_minus_one_is_unseeded():
    """vLLM takes seed -1 as no seed; other negative seeds are seeds."""
    assert SamplingParams(seed=-1).seed is None and SamplingParams(seed=-2).seed == -2


BOOLS = ("ignore_eos", "skip_special_tokens", "spaces_between_special_tokens", "detokenize")  # (and
# include_stop_str_in_output, checked before: tests/test_penalties.py)


@pytest.mark.parametrize("name", BOOLS)
@pytest.mark.parametrize("value", ["no", 1, 0, None])
def test_bool_fields_take_only_bools(name, value):
    with pytest.raises(ValueError, match=f"^{name}: must be true or false"):
        SamplingParams(**{name: value})


@pytest.mark.parametrize("field,kwargs", [
    ("best_of", {"best_of": 2}),
    ("best_of", {"best_of": 2, "n": 3}),
    ("best_of", {"best_of": 2.0, "n": 2}),
    ("allowed_token_ids", {"allowed_token_ids": []}),
    ("allowed_token_ids", {"allowed_token_ids": [-1]}),
    ("allowed_token_ids", {"allowed_token_ids": [True]}),
    ("allowed_token_ids", {"allowed_token_ids": "12"}),
    ("bad_words", {"bad_words": "hen"}),
    ("bad_words", {"bad_words": [""]}),
    ("bad_words", {"bad_words": ["  "]}),
    ("bad_words", {"bad_words": [5]}),
    ("bad_words", {"bad_words": ["w"] * 257}),
    ("detokenize", {"detokenize": False, "stop": ["x"]}),
    ("extra_args", {"extra_args": [1]}),
    ("structured_outputs", {"structured_outputs": 5}),
    ("structured_outputs.colour", {"structured_outputs": {"colour": "red"}}),
    ("structured_outputs.choice", {"structured_outputs": {"choice": []}}),
    ("structured_outputs", {"structured_outputs": {}}),
    ("structured_outputs", {"structured_outputs": {"regex": "a+"},
                            "guided_decoding": GuidedDecodingParams(regex="b+")}),
])
def test_bad_field_is_named(field, kwargs):
    with pytest.raises(ValueError) as e:
        SamplingParams(**kwargs)
    assert str(e.value).startswith(f"{field}: "), str(e.value)


def test_a_grammar_without_a_kind_names_both_of_vllms_names():
    """GuidedDecodingParams and StructuredOutputsParams are one class: its error cannot know which name the caller
    used, so it names the field by the newer one and says both classes take it."""
    for cls in (GuidedDecodingParams, StructuredOutputsParams):
        with pytest.raises(ValueError, match=r"^structured_outputs: exactly one of json, regex, choice, grammar or "
                                             r"json_object is needed \(in StructuredOutputsParams or "
                                             r"GuidedDecodingParams\), got none$"):
            cls()
    with pytest.raises(ValueError, match=r"^structured_outputs: .* got regex, choice$"):
        StructuredOutputsParams(regex="a+", choice=["a"])


def test_vllm_fields_accepted():
    assert SamplingParams(n=3, best_of=3).best_of == 3
    p = SamplingParams(logprobs=True, prompt_logprobs=True)  # (vLLM's: True is 1)
    assert (p.logprobs, p.prompt_logprobs) == (1, 1)
    with pytest.raises(ValueError, match="^logprobs: must be an integer"):  # (False: not a count)
        SamplingParams(logprobs=False)
    # either value (with special tokens kept too: it was refused, though the text has no spaces between them anyway,
    # as vLLM's fast detokenizer gives it on a byte-level BPE whatever the value)
    assert SamplingParams(spaces_between_special_tokens=False).spaces_between_special_tokens is False
    assert SamplingParams(spaces_between_special_tokens=False, skip_special_tokens=False).skip_special_tokens is False
    args = {"processor": {"k": 1}}
    assert SamplingParams(extra_args=args).extra_args is args
    # structured_outputs: vLLM's newer name, as a dict of its fields or StructuredOutputsParams
    want = GuidedDecodingParams(choice=["yes", "no"])
    assert SamplingParams(structured_outputs={"choice": ["yes", "no"]}).grammar_spec == want
    p = SamplingParams(structured_outputs=StructuredOutputsParams(choice=["yes", "no"]), max_tokens=4)
    assert p.grammar_spec == want and p.grammar_field == "structured_outputs"
    assert dataclasses.replace(p, max_tokens=5).grammar_spec == want
    assert SamplingParams(guided_decoding=want).grammar_spec == want
    # the older name takes a dict too, as the newer one does (it was refused: "must be a GuidedDecodingParams")
    assert SamplingParams(guided_decoding={"choice": ["yes", "no"]}).grammar_spec == want
    with pytest.raises(ValueError, match=r"^guided_decoding\.colour: unknown field"):
        SamplingParams(guided_decoding={"colour": "red"})
    with pytest.raises(ValueError, match=r"^guided_decoding\.choice: "):
        SamplingParams(guided_decoding={"choice": []})
    # set or cleared after construction, as a script does to vLLM's params: the request reads it then
    p.structured_outputs = None
    assert p.grammar_spec is None
    p.structured_outputs = StructuredOutputsParams(regex="[ab]+")
    assert p.grammar_spec == GuidedDecodingParams(regex="[ab]+")


def test_spaces_between_special_tokens_keeps_the_text(ref_llm):
    """Either value gives the same text, special tokens kept side by side without spaces (vLLM's fast detokenizer on
    a byte-level BPE): False with skip_special_tokens False was refused, as if the text had spaces to take out."""
    tok = ref_llm.get_tokenizer()
    specials = sorted(tok.all_special_ids)[:2]
    assert len(specials) == 2
    texts = {spaces: _gen(ref_llm, "to be", max_tokens=4, temperature=0, ignore_eos=True, allowed_token_ids=specials,
                          skip_special_tokens=False, spaces_between_special_tokens=spaces).outputs[0].text
             for spaces in (True, False)}
    assert texts[True] == texts[False]
    assert texts[True] == "".join(tok.convert_ids_to_tokens(
        _gen(ref_llm, "to be", max_tokens=4, temperature=0, ignore_eos=True, allowed_token_ids=specials).outputs[0]
        .token_ids))


def test_request_checked_against_the_vocabulary(ref_llm):
    vocab = ref_llm.config.vocab_size
    with pytest.raises(ValueError, match="^allowed_token_ids: token ids must be in"):
        _gen(ref_llm, PROMPT, allowed_token_ids=[3, vocab])
    with pytest.raises(ValueError, match="^logit_bias: token ids must be in"):
        _gen(ref_llm, PROMPT, logit_bias={vocab: 1.0})
    eos = min(ref_llm.tokenizer.eos_token_ids)
    with pytest.raises(ValueError, match="^allowed_token_ids: with min_tokens"):
        _gen(ref_llm, PROMPT, allowed_token_ids=[eos], stop_token_ids=[9], max_tokens=4, min_tokens=2)


def test_a_text_that_cannot_fit_is_refused_before_it_is_tokenized(ref_llm, monkeypatch):
    """As the server refuses it (`Tokenizer.fewest_tokens`): tokenizing 2 MB of text took seconds, for a request
    refused after; one to be truncated is tokenized and runs."""
    text, encoded = "word " * 200_000, []
    real = ref_llm.tokenizer.encode
    monkeypatch.setattr(ref_llm.tokenizer, "encode", lambda *a, **k: encoded.append(1) or real(*a, **k))
    for prompt in (text, {"prompt": text}):
        with pytest.raises(ValueError, match=r"^prompt: at least \d+ tokens \(1000000 characters\) leave no room"):
            _gen(ref_llm, prompt, max_tokens=2)
    assert not encoded
    out = _gen(ref_llm, text, max_tokens=2, truncate_prompt_tokens=8, ignore_eos=True)
    assert len(out.prompt_token_ids) == 8 and len(out.outputs[0].token_ids) == 2 and encoded


@pytest.mark.parametrize("scheduler", ["reference", "cdb"])
def test_stop_token_ids_outside_the_vocabulary_are_refused(tiny_ouro, scheduler):
    """As newer vLLM releases check them against the model's vocabulary: such ids were taken and
    never met, as vLLM's older releases took them. min_tokens holds back the stop ids that remain."""
    llm = LLM(model=tiny_ouro, scheduler=scheduler, dtype="float64")
    vocab = max(llm.config.vocab_size, len(llm.tokenizer))  # (vLLM's bound: the model's or the tokenizer's)
    for ids in ([vocab], [3, 10**12], [2**64]):
        with pytest.raises(ValueError, match=rf"^stop_token_ids: token ids must be in \[0, {vocab}\)"):
            _gen(llm, PROMPT, max_tokens=5, ignore_eos=True, temperature=0, stop_token_ids=ids)
    every = list(range(vocab))  # (all of the vocabulary: min_tokens would leave no token to sample)
    with pytest.raises(ValueError, match="^stop_token_ids: with min_tokens"):
        _gen(llm, PROMPT, max_tokens=4, min_tokens=2, stop_token_ids=every)
    # all but one: one token is left
    out = _gen(llm, PROMPT, max_tokens=4, min_tokens=2, ignore_eos=True, stop_token_ids=every[1:])
    assert out.outputs[0].token_ids[:2] == [0, 0]


# ---------------- bad words: vLLM's tokenization, and the sampler's masks on hand-built logits


def test_bad_words_tokenized_as_vllm_does(ref_llm):
    tok = ref_llm.tokenizer

    def enc(w: str) -> list[int]:
        return tok.encode(w, add_special_tokens=False)

    def enc_all(texts: list[str]) -> list[list[int]]:
        return tok.encode_texts(texts, add_special_tokens=False)

    words = BadWords.tokenize(["hen", " i", "henhen"], enc_all, ref_llm.config.vocab_size)
    # a spaced form is kept when it is as long and starts with another token (" i" is one token, " hen" two)
    assert len(enc(" i")) == len(enc("i")) == 1 and len(enc(" hen")) == 2
    assert words.token_ids == [enc("hen"), enc("i"), enc(" i"), enc("henhen")]
    assert list(words) == ["hen", " i", "henhen"]
    with pytest.raises(ValueError, match=r"^bad_words\.0: tokenizes to ids outside"):
        BadWords.tokenize(["hen"], enc_all, 100)


def test_a_requests_bad_words_are_tokenized_in_one_call_that_releases_the_gil(ref_llm, monkeypatch):
    """A request is built on a worker thread; `encode` holds the GIL, so 256 long words tokenized one call each
    stalled the engine thread at every torch call it made meanwhile (seconds of stalls per request, measured over
    HTTP). `encode_batch` releases it: every form of every word goes in one such call."""
    from loopserve.engine.sequence import with_bad_words

    tok = ref_llm.tokenizer
    calls: list[tuple[str, int]] = []

    class Counting:
        def __getattr__(self, name):
            real = getattr(tok_backend, name)
            if name not in ("encode", "encode_batch"):
                return real

            def counted(arg, *a, **k):
                calls.append((name, len(arg) if name == "encode_batch" else 1))
                return real(arg, *a, **k)
            return counted

    tok_backend = tok.tok
    monkeypatch.setattr(tok, "tok", Counting())
    params = with_bad_words(SamplingParams(bad_words=["hen", " i", "henhen"] * 40), tok, ref_llm.config.vocab_size)
    assert calls == [("encode_batch", 240)]
    assert len(params.bad_words.token_ids) >= 120


def adjusted(logits: list[float], params: SamplingParams, hist, counter: int | None = None) -> list[float]:
    p = bind(params, hist)
    n = len(hist.output_ids) if counter is None else counter
    return adjust_logits(torch.tensor([logits], dtype=torch.float64), [p], [n])[0].tolist()


def test_masks_on_hand_built_logits():
    x = [0.5, 1.0, 2.0, 3.0, -1.0]
    assert adjusted(x, SamplingParams(allowed_token_ids=[1, 3, 1]), history()) == [-INF, 1.0, -INF, 3.0, -INF]
    words = BadWords(["a", "b c"], [[2], [4, 3]])  # 2 always; 3 right after 4
    p = SamplingParams(bad_words=words)
    assert adjusted(x, p, history(output=[0, 1])) == [0.5, 1.0, -INF, 3.0, -1.0]
    assert adjusted(x, p, history(output=[0, 4])) == [0.5, 1.0, -INF, -INF, -1.0]
    assert adjusted(x, p, history(output=[4, 0]), counter=1) == [0.5, 1.0, -INF, -INF, -1.0]  # the counter's prefix
    assert adjusted(x, p, history(prompt=[4])) == [0.5, 1.0, -INF, 3.0, -1.0]  # the output's, not the prompt's
    both = SamplingParams(bad_words=words, allowed_token_ids=[3, 0], logit_bias={0: 1.0})
    assert adjusted(x, both, history(output=[4])) == [1.5, -INF, -INF, -INF, -INF]
    # greedy: the argmax of what is left; the raw logits' logprobs stay (vLLM's raw_logprobs)
    s = sample_one(torch.tensor(x), bind(SamplingParams(temperature=0, allowed_token_ids=[0, 1], logprobs=1),
                                         history()), 0, 0)
    assert s.token == 1 and s.top == [(3, pytest.approx(torch.log_softmax(torch.tensor(x), 0)[3].item()))]


def test_a_row_with_nothing_left_fails_alone():
    """Bad words banning every allowed token fail their row (its argmax would be any token), not the batch."""
    stuck = bind(SamplingParams(temperature=0, allowed_token_ids=[2], bad_words=BadWords(["a"], [[2]])), history())
    fine = bind(SamplingParams(temperature=0, bad_words=BadWords(["a"], [[2]])), history())
    logits = torch.tensor([[0.0, 1.0, 5.0], [0.0, 1.0, 5.0]], dtype=torch.float64)
    rows = sample_rows(logits, [stuck, fine], [0, 0], [0, 0])
    assert isinstance(rows, list) and "allowed_token_ids" in (rows[0].error or "") and rows[1].token == 1
    with pytest.raises(NothingToSampleError, match="^allowed_token_ids: "):  # its own type: the request's fault
        rows[0].checked()


def test_plain_greedy_fast_path_stays_for_other_rows():
    assert plain_greedy(SamplingParams(temperature=0))
    assert not plain_greedy(SamplingParams(temperature=0, allowed_token_ids=[1]))
    assert not plain_greedy(SamplingParams(temperature=0, bad_words=["x"]))
    plain = SamplingParams(temperature=0)
    assert bind(plain, history()) is plain  # no copy, nothing to read per token
    bound = bind(SamplingParams(allowed_token_ids=[4, 2, 4]), history())
    assert isinstance(bound.allowed_token_ids, AllowedTokenIds) and bound.allowed_token_ids.ids.tolist() == [2, 4]


# ---------------- whole requests: the batching engine against the reference decoder


def _contains(seq: list[int], part: list[int]) -> bool:
    return any(seq[i:i + len(part)] == part for i in range(len(seq) - len(part) + 1))


@pytest.mark.parametrize("scheduler", ["cb", "cdb"])
def test_engine_equals_reference(tiny_ouro, scheduler):
    """allowed_token_ids and bad_words, greedy and seeded, beside rows without them (plain greedy, seeded,
    penalized, with logprobs): each request as the reference decodes it alone."""
    engine = make_engine(tiny_ouro, scheduler=scheduler)
    tok = engine.tokenizer
    feats = (dict(allowed_token_ids=[5, 17, 99, 300, 404]), dict(bad_words=["hen"]), dict(bad_words=["henhen", "i"]),
             dict(allowed_token_ids=[404, 99, 108, 214], bad_words=["henhen"], logprobs=2), dict(),
             dict(presence_penalty=0.5), dict(logprobs=1), dict(bad_words=["hen"], n=2))
    reqs = []
    for i, f in enumerate(feats * 2):
        prompt = PROMPT if i % 3 == 0 else [(31 * i + 7 * j + 3) % 500 + 1 for j in range(4 + i % 5)]
        seeded = i >= len(feats) or f.get("n") == 2
        sampling = dict(temperature=1.0, seed=40 + i) if seeded else dict(temperature=0.0)
        reqs.append(Req(f"r{i}", prompt, SamplingParams(max_tokens=14, ignore_eos=True, **{**sampling, **f}),
                        seed=7 + i, arrive=i % 3))
    outs = drive(engine, reqs)
    for r in reqs:
        if r.params.n == 1:
            assert_matches(outs[r.rid], reference(engine, r))
        for j, sample in enumerate(outs[r.rid].outputs if r.params.n > 1 else ()):  # j: as if seeded seed + j
            alone = dataclasses.replace(r.params, n=1, seed=r.params.seed + j)
            assert sample.token_ids == reference(engine, Req(r.rid, r.prompt, alone, r.seed)).output_ids
        allowed, words = r.params.allowed_token_ids, r.params.bad_words
        for sample in outs[r.rid].outputs:
            if allowed is not None:
                assert set(sample.token_ids) <= set(allowed)
            for w in words or ():
                assert not _contains(sample.token_ids, tok.encode(w, add_special_tokens=False))
    # tokenized once for a request's samples
    family = engine.make_sequence("f", PROMPT, SamplingParams(n=2, bad_words=["hen"])).family
    assert isinstance(family[0].params.bad_words, BadWords)
    assert family[0].params.bad_words is family[1].params.bad_words
    # the features bite: greedy decoding of PROMPT runs into 'hen' (token 404) unless it is banned
    greedy = dict(max_tokens=14, ignore_eos=True, temperature=0)
    base = reference(engine, Req("b", PROMPT, SamplingParams(**greedy), 0)).output_ids
    banned = reference(engine, Req("h", PROMPT, SamplingParams(**greedy, bad_words=["hen"]), 0)).output_ids
    assert _contains(base, [404, 404]) and 404 not in banned
    assert outs["r3"].outputs[0].token_ids.count(404) > 1  # 'henhen': 'hen' comes back, never twice in a row


def test_speculation_keeps_them_exact(tiny_ouro):
    """allowed_token_ids is a mask of the row alone (drafts apply it too); bad_words read the tokens before each
    position, so such requests decode plainly, as penalties do. Drafts at full depth, at the fixed depth the
    requests verify at, propose plain greedy's tokens: 'hen' after 'hen', which 'henhen' bans."""
    engine = make_engine(tiny_ouro, scheduler="cdb", **SPEC, speculative_draft_loops=4)
    greedy = dict(max_tokens=12, temperature=0, ignore_eos=True, exit_policy="fixed")
    reqs = [Req("a", PROMPT, SamplingParams(**greedy, allowed_token_ids=[404, 99, 214, 5]), seed=1),
            Req("b", PROMPT, SamplingParams(**greedy, bad_words=["henhen"]), seed=2),
            Req("c", PROMPT[:4], SamplingParams(**greedy), seed=3)]
    outs = drive(engine, reqs)
    for r in reqs:
        assert_same(outs[r.rid], reference(engine, r))
    assert drafted(engine)
    assert not _contains(outs["b"].outputs[0].token_ids, [404, 404])


# ---------------- allowed_token_ids: a set, built once per request; a request left no token to sample


def test_allowed_token_ids_are_a_set_shared_by_the_samples(tiny_ouro):
    """Duplicates are dropped once, in SamplingParams; the mask's data is built once per request (make_sequence),
    and every sample holds that one object, with bad words too (their params are copies, bound to their tokens)."""
    ids = [(7 * i) % 300 for i in range(10**5)]  # 10^5 ids, 300 of them unique
    p = SamplingParams(allowed_token_ids=ids, n=8)
    assert p.allowed_token_ids == sorted(set(ids)) and ids[:3] == [0, 7, 14]  # (the caller's list untouched)
    engine = make_engine(tiny_ouro)
    for extra in ({}, {"bad_words": ["henhen"]}, {"min_tokens": 1}):
        family = engine.make_sequence("s", PROMPT, dataclasses.replace(p, **extra)).family
        assert len(family) == 8
        shared = family[0].params.allowed_token_ids
        assert isinstance(shared, AllowedTokenIds) and list(shared) == sorted(set(ids))
        assert shared.ids.tolist() == list(shared) and shared.top == 299
        assert all(s.params.allowed_token_ids is shared for s in family)
        mask = shared.keep(512, torch.device("cpu"))  # what its rows stack at every step: made once
        assert mask is shared.keep(512, torch.device("cpu")) and mask.nonzero()[:, 0].tolist() == shared
    assert SamplingParams(allowed_token_ids=[9, 3, 9, 3]).allowed_token_ids == [3, 9]


def test_admission_refuses_a_request_left_no_first_token(tiny_ouro, ref_llm):
    """Single-token bad words are banned at every step: covering every allowed id (with min_tokens, also with the
    tokens it holds back) the request could sample nothing, and is refused before it runs (a 400 on a server)."""
    engine = make_engine(tiny_ouro, scheduler="cb")
    eos = min(engine.tokenizer.eos_token_ids)
    refused = {"bad_words ban every one": dict(allowed_token_ids=[404, 108], bad_words=["hen", "i"]),
               "with min_tokens, bad_words": dict(allowed_token_ids=[404, eos], bad_words=["hen"], min_tokens=1)}
    for why, kw in refused.items():
        with pytest.raises(ValueError, match=f"^allowed_token_ids: {why}"):
            engine.make_sequence("x", PROMPT, SamplingParams(max_tokens=4, n=2, **kw))
        with pytest.raises(ValueError, match=f"^allowed_token_ids: {why}"):
            _gen(ref_llm, PROMPT, max_tokens=4, **kw)
    # eos is not held back without min_tokens, nor 108 banned by a word it only ends ('ii': 108 after 108)
    out = _gen(ref_llm, PROMPT, max_tokens=4, allowed_token_ids=[404, eos], bad_words=["hen"])
    assert out.outputs[0].token_ids == [eos] and out.outputs[0].finish_reason == "stop"
    engine.make_sequence("y", PROMPT, SamplingParams(allowed_token_ids=[404, 108], bad_words=["hen", "ii"]))


STUCK = "allowed_token_ids: bad_words ban every one of them at output token 2: no token can be sampled"


@pytest.mark.parametrize("scheduler", ["cb", "cdb"])
def test_a_request_left_no_token_later_fails_alone_as_the_reference(tiny_ouro, scheduler, caplog):
    """A bad word of several tokens bans its last one after the others: allowed_token_ids [404] with 'henhen'
    ([404, 404]) leaves the second token nothing. That request alone finishes with finish_reason "error", status
    400 (its own constraints, not a fault of the server) and no ERROR log, in a mixed batch (greedy, seeded, n = 2,
    logprobs, penalties); the reference decoder finishes it the same way (not raising out of generate), and every
    other request is as the reference decodes it."""
    engine = make_engine(tiny_ouro, scheduler=scheduler)
    words = ["henhen", "heni", "ihen", "ii"]  # [404, 404], [404, 108], [108, 404], [108, 108]
    feats = (dict(allowed_token_ids=[404], bad_words=["henhen"]), dict(),
             dict(allowed_token_ids=[404, 108], bad_words=words, n=2), dict(presence_penalty=0.5, logprobs=2),
             dict(allowed_token_ids=[404, 108], bad_words=words, logprobs=1), dict(bad_words=["hen"]),
             dict(allowed_token_ids=[404, 108], bad_words=["henhen"]))
    reqs = []
    for i, f in enumerate(feats * 2):
        seeded = i >= len(feats) or f.get("n") == 2
        sampling = dict(temperature=1.0, seed=60 + i) if seeded else dict(temperature=0.0)
        prompt = PROMPT if i % 2 == 0 else [(13 * i + 5 * j) % 500 + 1 for j in range(3 + i % 4)]
        reqs.append(Req(f"r{i}", prompt, SamplingParams(max_tokens=8, ignore_eos=True, **{**sampling, **f}),
                        seed=3 + i, arrive=i % 3))
    with caplog.at_level(logging.WARNING, logger="loopserve"):
        outs = drive(engine, reqs)
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]
    failed = 0
    for r in reqs:
        samples = ([dataclasses.replace(r.params, n=1, seed=r.params.seed + j) for j in range(r.params.n)]
                   if r.params.n > 1 else [r.params])
        for c, alone in zip(outs[r.rid].outputs, samples, strict=True):
            ref = reference(engine, Req(r.rid, r.prompt, alone, r.seed))
            if ref.finish_reason != "error":
                assert c.finish_reason != "error"
                if r.params.n == 1:
                    assert_matches(outs[r.rid], ref)
                assert c.token_ids == ref.output_ids
                continue
            failed += 1
            assert (ref.error, ref.error_status) == (STUCK, 400) and len(ref.output_ids) == 1
            assert (c.token_ids, c.exit_depths, c.finish_reason, c.text) == (
                ref.output_ids, ref.exit_depths, "error", ref.text)
            assert (outs[r.rid].error, outs[r.rid].error_status) == (STUCK, 400)
    assert failed == 8  # r0, r2's two samples, r4, and again seeded (r6 never: 108 may follow 404)
    assert sum("failed: " + STUCK in r.getMessage() for r in caplog.records) == failed  # a warning each
    # offline, every scheduler: the request's output, not an exception out of generate
    for sched in ("reference", scheduler):
        llm = LLM(model=tiny_ouro, scheduler=sched, dtype="float64", kv_cache_tokens=512)
        got = llm.generate([PROMPT, PROMPT], [SamplingParams(max_tokens=6, temperature=0, **feats[0]),
                                              SamplingParams(max_tokens=6, temperature=0)], use_tqdm=False)
        assert (got[0].outputs[0].finish_reason, got[0].error, got[0].error_status) == ("error", STUCK, 400)
        assert got[0].outputs[0].token_ids == [404] and got[1].outputs[0].finish_reason == "length"


# ---------------- detokenize, and the order of logprob entries


@pytest.mark.parametrize("scheduler", ["reference", "cdb"])
def test_detokenize_false_gives_token_ids_only(tiny_ouro, scheduler):
    llm = LLM(model=tiny_ouro, scheduler=scheduler, dtype="float64")
    kw = dict(max_tokens=6, temperature=0, ignore_eos=True, logprobs=1)
    text = _gen(llm, PROMPT, **kw).outputs[0]
    ids_only = _gen(llm, PROMPT, detokenize=False, **kw).outputs[0]
    assert ids_only.token_ids == text.token_ids and text.text and ids_only.text == ""
    assert all(v.decoded_token is None for d in ids_only.logprobs for v in d.values())


def test_logprob_entries_in_vllm_order(ref_llm):
    """The sampled (or prompt) token first, with its rank in the vocabulary, then the top k by rank; the token
    once, first, when it is among them."""
    out = _gen(ref_llm, PROMPT, max_tokens=8, temperature=1.5, seed=3, logprobs=2, prompt_logprobs=2)
    c = out.outputs[0]
    entries = list(zip(c.token_ids, c.logprobs, strict=True))
    entries += [(t, d) for t, d in zip(out.prompt_token_ids[1:], out.prompt_logprobs[1:], strict=True)]
    outside = 0
    for token, entry in entries:
        ids = list(entry)
        assert ids[0] == token
        ranks = [entry[i].rank for i in ids[1:]]
        assert ranks == sorted(ranks) and set(ranks) <= {1, 2}
        outside += token not in ids[1:] and len(ids) == 3
        if len(ids) == 2:  # the token is one of the top two: its own rank, listed once
            assert entry[token].rank in (1, 2) and ranks == [3 - entry[token].rank]
    assert outside > 0  # some tokens were not among the top two (their entries have three)


# ---------------- over HTTP (the openai client, vLLM's fields in extra_body)


@pytest.fixture(scope="module")
def server(tiny_ouro, tmp_path_factory) -> Iterator[Server]:
    log: Path = tmp_path_factory.mktemp("parity") / "server.log"
    with run_server(tiny_ouro, log, "--dtype", "float64", "--kv-cache-tokens", "1024") as s:
        yield s


@pytest.fixture
def client(server) -> openai.OpenAI:
    return server.client(api_key="x")


@pytest.fixture(scope="module")
def offline(tiny_ouro) -> LLM:
    return LLM(model=tiny_ouro, dtype="float64", device="cpu", kv_cache_tokens=1024)  # (as the server)


def test_server_allowed_token_ids_and_bad_words(client, offline):
    for extra in ({"allowed_token_ids": [5, 17, 99, 300, 404]}, {"bad_words": ["henhen", "i"]},
                  {"allowed_token_ids": [404, 99, 108], "bad_words": ["henhen"]}):
        r = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=10, temperature=0,
                                      extra_body={"ignore_eos": True, "return_token_ids": True, **extra})
        want = _gen(offline, PROMPT, max_tokens=10, temperature=0, ignore_eos=True, **extra).outputs[0]
        assert r.choices[0].model_extra["token_ids"] == want.token_ids
        assert r.choices[0].text == want.text
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=6,
                                          temperature=0, extra_body={"allowed_token_ids": [404, 99],
                                                                     "return_token_ids": True, "ignore_eos": True})
    assert set(chat.choices[0].model_extra["token_ids"]) <= {404, 99}
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL, prompt="hi", max_tokens=2, extra_body={"allowed_token_ids": [10**6]})
    assert e.value.body["param"] == "allowed_token_ids"


def test_server_request_left_no_token_is_a_400(server, client):
    """Refused at admission (single-token bad words cover allowed_token_ids), or failed when a bad word of several
    tokens leaves it nothing later: a 400 either way (the client's constraints), never a 500 or an ERROR log, and
    the server serves the next request."""
    cases = [({"allowed_token_ids": [404, 108], "bad_words": ["hen", "i"]}, "allowed_token_ids: bad_words ban every"),
             ({"allowed_token_ids": [404], "bad_words": ["henhen"]}, STUCK)]
    for extra, message in cases:
        for stream in (False, True):
            if stream and extra["allowed_token_ids"] == [404]:  # (a stream has started: its error is an event)
                continue
            with pytest.raises(openai.BadRequestError) as e:
                client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=6, temperature=0, stream=stream,
                                          extra_body=extra)
            assert e.value.body["message"].startswith(message)
            if message != STUCK:  # (refused at admission: the field named)
                assert e.value.body["param"] == "allowed_token_ids"
    ok = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=3, temperature=0)
    assert ok.choices[0].finish_reason == "length"
    log = server.log.read_text()
    assert STUCK in log and "ERROR" not in log and "Traceback" not in log


@pytest.mark.parametrize("extra,param", [({"length_penalty": 0.8}, "length_penalty"),
                                         ({"best_of": 3}, "best_of")])
def test_server_refuses_beam_search_fields_without_beam_search(client, extra, param):
    """(beam search itself: tests/test_server_beam_search.py)"""
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL, prompt="hi", max_tokens=2, extra_body=extra)
    assert e.value.body["param"] == param and e.value.body["message"].startswith(f"{param}: ")
    if param != "best_of":
        with pytest.raises(openai.BadRequestError):
            client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=2,
                                           extra_body=extra)
    # their neutral values are accepted (best_of = n: every sample is returned)
    ok = client.completions.create(model=MODEL, prompt="hi", max_tokens=2, n=2, best_of=2,
                                   extra_body={"use_beam_search": False, "length_penalty": 1.0})
    assert len(ok.choices) == 2


def test_server_logprobs_order(client, offline):
    """vLLM's `prompt_logprobs` field lists an entry as the engine does (the prompt token first); OpenAI's lists
    are by rank, whatever the order of the entries they are read from."""
    kw = dict(max_tokens=6, temperature=1.5, seed=3)
    r = client.completions.create(model=MODEL, prompt=PROMPT, logprobs=3, **kw, extra_body={"prompt_logprobs": 2})
    for token, entry in zip(PROMPT[1:], r.choices[0].model_extra["prompt_logprobs"][1:], strict=True):
        assert list(entry)[0] == str(token) and len(entry) in (2, 3)
    want = _gen(offline, PROMPT, logprobs=3, **kw).outputs[0]
    assert r.choices[0].text == want.text
    checked = 0
    for top, entry in zip(r.choices[0].logprobs.top_logprobs, want.logprobs, strict=True):
        ranked = [offline.tokenizer.decode_token(t) for t, _ in sorted(entry.items(), key=lambda kv: kv[1].rank)]
        if len(set(ranked)) == len(ranked):  # (a dict keyed by text: two tokens of one text would be one key)
            assert list(top) == ranked
            checked += 1
    assert checked
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], logprobs=True,
                                          top_logprobs=3, **kw)
    for c in chat.choices[0].logprobs.content:
        values = [t.logprob for t in c.top_logprobs]
        assert len(values) == 3 and values == sorted(values, reverse=True)


def test_from_optional_takes_unset_fields_at_their_defaults():
    """vLLM's `SamplingParams.from_optional`: None means "unset" (the default), but max_tokens None stays None (no
    limit); logit_bias clamped into [-100, 100]; an unknown keyword a TypeError."""
    p = SamplingParams.from_optional(n=None, temperature=None, top_p=None, top_k=None, max_tokens=None, seed=None,
                                     stop=None, logit_bias={"5": 150, 7: -300.0})
    assert (p.n, p.temperature, p.top_p, p.top_k, p.max_tokens, p.seed, p.stop) == (1, 1.0, 1.0, -1, None, None, [])
    assert p.logit_bias == {5: 100.0, 7: -100.0}
    assert SamplingParams.from_optional(temperature=0.5, max_tokens=3) == SamplingParams(temperature=0.5, max_tokens=3)
    with pytest.raises(TypeError, match="bogus"):
        SamplingParams.from_optional(bogus=None)


def test_logits_processors_only_when_empty():
    """vLLM 0.10's per-request logits processors: loopserve runs none, so a non-empty list is refused naming it."""
    assert SamplingParams(logits_processors=[]).logits_processors == [] and SamplingParams().logits_processors is None
    with pytest.raises(ValueError, match="^logits_processors: not supported by loopserve"):
        SamplingParams(logits_processors=[lambda ids, logits: logits])


def test_positional_arguments_mean_what_they_mean_in_vllm():
    """vLLM's SamplingParams takes its fields positionally in its order (n, presence_penalty, frequency_penalty,
    repetition_penalty, temperature, top_p, top_k, min_p, seed, stop, stop_token_ids, ignore_eos, max_tokens,
    min_tokens, logprobs, prompt_logprobs): a ported call with positional arguments gets the same params (loopserve's
    second field was max_tokens, so SamplingParams(1, 0.0, 0.0, 1.0, 0.7) was a ValueError on max_tokens)."""
    p = SamplingParams(2, 0.1, 0.2, 1.1, 0.7, 0.9, 5, 0.05, 7, ["x"], [3], True, 9, 1, 2, 0)
    assert (p.n, p.presence_penalty, p.frequency_penalty, p.repetition_penalty, p.temperature, p.top_p, p.top_k,
            p.min_p, p.seed, p.stop, p.stop_token_ids, p.ignore_eos, p.max_tokens, p.min_tokens, p.logprobs,
            p.prompt_logprobs) == (2, 0.1, 0.2, 1.1, 0.7, 0.9, 5, 0.05, 7, ["x"], [3], True, 9, 1, 2, 0)
    with pytest.raises(TypeError):  # (past them vLLM's versions differ: keyword-only here, not a silent other field)
        SamplingParams(2, 0.1, 0.2, 1.1, 0.7, 0.9, 5, 0.05, 7, ["x"], [3], True, 9, 1, 2, 0, True)  # type: ignore[misc]
