"""Penalties, logit_bias, min_tokens, include_stop_str_in_output, stop_reason and truncate_prompt_tokens:
the math on hand-built logits, batch invariance of the sampler, validation, and whole requests in the
batching engine against the reference decoder (docs/design.md §5.1)."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

from loopserve import LLM, SamplingParams
from loopserve.engine.sampler import (
    LogitBias,
    StopTokenIds,
    adjust_logits,
    bind,
    penalize,
    sample_batch,
    sample_one,
    sample_rows,
    unpack,
)
from loopserve.engine.sequence import truncate_prompt
from tests.engine_helpers import Req, assert_matches, drive, make_engine, reference

pytestmark = pytest.mark.usefixtures("single_thread")

INF = float("inf")
PROMPT = [5, 17, 99, 3, 250, 40, 7]


def history(prompt=(), output=(), eos=()) -> SimpleNamespace:
    return SimpleNamespace(prompt_ids=list(prompt), output_ids=list(output), eos_ids=set(eos))


def adjusted(logits: list[float], params: SamplingParams, hist: SimpleNamespace | None = None) -> list[float]:
    """One row through adjust_logits, `counter` being the history's output length."""
    p = bind(params, hist or history())
    n = len(hist.output_ids) if hist else 0
    return adjust_logits(torch.tensor([logits], dtype=torch.float64), [p], [n])[0].tolist()


# ---------------- validation


@pytest.mark.parametrize("field,kwargs", [
    ("presence_penalty", {"presence_penalty": 2.5}),
    ("presence_penalty", {"presence_penalty": float("nan")}),
    ("frequency_penalty", {"frequency_penalty": -2.01}),
    ("frequency_penalty", {"frequency_penalty": True}),
    ("repetition_penalty", {"repetition_penalty": 0.0}),
    ("repetition_penalty", {"repetition_penalty": INF}),
    ("repetition_penalty", {"repetition_penalty": "1.1"}),
    ("logit_bias", {"logit_bias": [1, 2]}),
    ("logit_bias", {"logit_bias": {5: INF}}),  # (+inf leaves no finite distribution; -inf bans the token)
    ("logit_bias", {"logit_bias": {5: float("nan")}}),
    ("logit_bias", {"logit_bias": {-1: 1.0}}),
    ("logit_bias", {"logit_bias": {"x": 1.0}}),
    ("logit_bias", {"logit_bias": {True: 1.0}}),
    ("min_tokens", {"min_tokens": -1}),
    ("min_tokens", {"min_tokens": 1.5}),
    ("min_tokens", {"min_tokens": 5, "max_tokens": 4}),
    ("include_stop_str_in_output", {"include_stop_str_in_output": 1}),
    ("truncate_prompt_tokens", {"truncate_prompt_tokens": 0}),
    ("truncate_prompt_tokens", {"truncate_prompt_tokens": -2}),  # -1 is the only negative (the context)
    ("truncate_prompt_tokens", {"truncate_prompt_tokens": 2.0}),
    ("truncate_prompt_tokens", {"truncate_prompt_tokens": True}),
])
def test_bad_field_is_named(field, kwargs):
    with pytest.raises(ValueError) as e:
        SamplingParams(**kwargs)
    assert str(e.value).startswith(field), str(e.value)


def test_valid_values_and_json_keys():
    p = SamplingParams(presence_penalty=-2, frequency_penalty=2.0, repetition_penalty=0.5, min_tokens=4, max_tokens=4,
                       logit_bias={"17": 5, 3: -100.0}, truncate_prompt_tokens=1, include_stop_str_in_output=True)
    assert p.logit_bias == {17: 5.0, 3: -100.0} and p.penalized
    # any other number, as vLLM's offline params take it (they were refused past [-100, 100]); -inf bans a token
    assert SamplingParams(logit_bias={5: -INF, 6: 1e9}).logit_bias == {5: -INF, 6: 1e9}
    assert not SamplingParams().penalized and bind(SamplingParams(), history()) == SamplingParams()
    assert SamplingParams(truncate_prompt_tokens=-1).truncate_prompt_tokens == -1  # vLLM's "to max_model_len"


def test_request_checked_against_the_vocabulary(tiny_ouro):
    llm = LLM(model=tiny_ouro, scheduler="reference")
    with pytest.raises(ValueError, match="^logit_bias"):
        llm.generate([PROMPT], SamplingParams(logit_bias={llm.config.vocab_size: 1.0}))
    with pytest.raises(ValueError, match=r"^stop_token_ids: token ids must be in \[0, "):  # (vLLM's check; was taken)
        llm.generate([PROMPT], SamplingParams(stop_token_ids=[llm.config.vocab_size]))
    # a banned token (-inf) is never sampled, greedy or not
    out = llm.generate([PROMPT] * 2, [SamplingParams(max_tokens=4, temperature=t, seed=1, ignore_eos=True,
                                                     logit_bias={5: 1e9}) for t in (0, 1)], use_tqdm=False)
    assert all(o.outputs[0].token_ids == [5] * 4 for o in out)
    out = llm.generate([PROMPT], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True), use_tqdm=False)
    first = out[0].outputs[0].token_ids[0]
    out = llm.generate([PROMPT], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True,
                                                logit_bias={first: -INF}), use_tqdm=False)
    assert first not in out[0].outputs[0].token_ids


# ---------------- the math on hand-built logits


def test_penalties_closed_form():
    logits = torch.tensor([[2.0, -1.0, 0.5, 3.0, -0.5]], dtype=torch.float64)
    counts = torch.tensor([[0.0, 2.0, 1.0, 0.0, 0.0]], dtype=torch.float64)
    in_prompt = torch.tensor([[True, False, False, False, True]])
    one = torch.ones(1, dtype=torch.float64)
    got = penalize(logits, counts, in_prompt, 0.5 * one, 0.25 * one, 2.0 * one)[0].tolist()
    # prompt-only tokens: repetition only; generated ones: repetition, then 0.25 * count + 0.5
    assert got == [1.0, -2.0 - 0.5 - 0.5, 0.25 - 0.25 - 0.5, 3.0, -1.0]
    # through the sampler's own path, from a request's tokens
    hist = history(prompt=[0, 4, 4], output=[1, 2, 1])
    params = SamplingParams(presence_penalty=0.5, frequency_penalty=0.25, repetition_penalty=2.0)
    assert adjusted(logits[0].tolist(), params, hist) == got
    # presence / frequency alone ignore the prompt; repetition < 1 raises repeated tokens
    assert adjusted([1.0, 1.0, 1.0], SamplingParams(presence_penalty=-1.5), history([0], [1, 1])) == [1.0, 2.5, 1.0]
    assert adjusted([1.0, 1.0, 1.0], SamplingParams(frequency_penalty=1.0), history([0], [1, 1, 2])) == [1, -1, 0]
    assert adjusted([1.0, -1.0, 1.0], SamplingParams(repetition_penalty=0.5), history([0], [1])) == [2, -0.5, 1]


def test_penalties_only_count_the_tokens_generated_so_far():
    """The counter says how many of the output's tokens precede this sample."""
    p = bind(SamplingParams(frequency_penalty=1.0), history(output=[1, 1, 2]))
    x = torch.zeros(2, 3, dtype=torch.float64)
    assert adjust_logits(x, [p, p], [1, 3]).tolist() == [[0, -1, 0], [0, -2, -1]]


def test_logit_bias_adds_to_the_logits():
    assert adjusted([0.0, 1.0, 2.0], SamplingParams(logit_bias={0: 5.0, 2: -1.5})) == [5.0, 1.0, 0.5]
    p = SamplingParams(temperature=0, logit_bias={1: 100})
    assert sample_one(torch.tensor([9.0, 0.0, 3.0]), p, 0, 0).token == 1


def test_a_request_takes_its_logit_bias_once(tiny_ouro):
    """The sampler reads a request's own snapshot of its logit_bias, as tensors built when the request is
    made (rebuilt from the dict at every step, a bias over a real vocabulary added ~100 ms to every step
    of its batch): changing the dict afterwards changes nothing, in flight or not."""
    engine = make_engine(tiny_ouro, scheduler="cdb")
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logit_bias={7: 100.0})
    engine.add_request("b", PROMPT, params)
    engine.step()
    params.logit_bias[7], params.logit_bias[9] = -100.0, 100.0  # the caller reuses its params
    outs = {}
    while engine.has_unfinished_requests():
        outs.update({o.request_id: o for o in engine.step()})
    assert outs["b"].outputs[0].token_ids == [7] * 6
    bound = engine.make_sequence("c", PROMPT, params).params
    assert isinstance(bound.logit_bias, LogitBias) and bound.logit_bias == {7: -100.0, 9: 100.0}
    assert bound.logit_bias.ids.tolist() == [7, 9] and bound.logit_bias.biases.tolist() == [-100.0, 100.0]


def test_min_tokens_holds_back_a_set_built_once(tiny_ouro):
    """What min_tokens holds back (the stop ids and the eos tokens, unique) is a tensor built when the request
    is made (rebuilt at every step, a vocabulary-wide list stalled every other stream); a list that leaves
    no token to sample is refused, naming stop_token_ids."""
    engine = make_engine(tiny_ouro)
    eos = sorted(engine.tokenizer.eos_token_ids)
    params = SamplingParams(max_tokens=4, min_tokens=2, stop_token_ids=[9, 3, 9, 3, 40])
    held = engine.make_sequence("h", PROMPT, params).params.stop_token_ids
    assert isinstance(held, StopTokenIds) and held == [9, 3, 9, 3, 40]
    assert held.held.tolist() == sorted({3, 9, 40, *eos})
    every = list(range(engine.model_config.vocab_size))
    with pytest.raises(ValueError, match="^stop_token_ids: with min_tokens"):
        engine.make_sequence("all", PROMPT, SamplingParams(max_tokens=4, min_tokens=2, stop_token_ids=every))
    engine.make_sequence("ok", PROMPT, SamplingParams(max_tokens=4, stop_token_ids=every))  # no min_tokens: fine


def test_min_tokens_masks_eos_and_stop_ids_until_reached():
    params = SamplingParams(min_tokens=2, stop_token_ids=[3, 99])  # 99 is outside this vocabulary: never sampled
    logits = [0.0, 1.0, 2.0, 3.0, 4.0]
    for n, want in ((0, [0, 1, 2, -INF, -INF]), (1, [0, 1, 2, -INF, -INF]), (2, logits)):
        assert adjusted(logits, params, history(output=[0] * n, eos=[4])) == want
    ignored = history(output=[], eos=())  # ignore_eos: the sequence has no eos ids
    assert adjusted(logits, params, ignored) == [0, 1, 2, -INF, 4]


def test_unbound_params_cannot_penalize():
    with pytest.raises(ValueError, match="bind"):
        adjust_logits(torch.zeros(1, 3, dtype=torch.float64), [SamplingParams(presence_penalty=1.0)], [0])


def test_logprobs_are_of_the_raw_distribution():
    logits = torch.tensor([2.0, 1.0, 0.0], dtype=torch.float64)
    p = bind(SamplingParams(temperature=0, logprobs=2, presence_penalty=2.0, logit_bias={2: 10.0}), history([], [0]))
    s = sample_one(logits, p, 0, 1)
    raw = torch.log_softmax(logits, -1).tolist()
    assert s.token == 2 and math.isclose(s.logprob, raw[2]) and s.rank == 3
    assert [t for t, _ in s.top] == [0, 1]


def test_batch_invariance_with_adjustments():
    """Each row samples the same token alone, in the batch, and in another order, whatever its neighbours ask."""
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(8, 40, generator=g, dtype=torch.float64) * 2
    top = logits.topk(3).indices.tolist()  # the histories hold each row's likeliest tokens: adjustments bite
    kinds = [dict(presence_penalty=1.5, frequency_penalty=0.7), dict(repetition_penalty=1.8),
             dict(logit_bias={3: 4.0, 7: -50}), dict(min_tokens=5, stop_token_ids=[2, 5]), dict(),
             dict(repetition_penalty=0.6, frequency_penalty=-1.0, logit_bias={0: 2.0}, min_tokens=3)]
    params, counters = [], []
    for i in range(8):
        kinds[2]["logit_bias"] = {top[i][0]: -50.0, 3: 4.0}
        hist = history(prompt=[top[i][1], 9, 12], output=[top[i][0], top[i][0], top[i][2], 1], eos=[top[i][0]])
        temp = 0.0 if i % 3 == 0 else 1.1
        params.append(bind(SamplingParams(temperature=temp, top_k=20 if i % 2 else -1, **kinds[i % 6]), hist))
        counters.append(2 + i % 3)
    seeds = [200 + i for i in range(8)]
    whole = unpack(sample_batch(logits, params, seeds, counters), params)
    assert [sample_one(logits[i], params[i], seeds[i], counters[i]) for i in range(8)] == whole
    perm = [5, 2, 7, 0, 3, 6, 1, 4]
    shuffled = unpack(sample_batch(logits[perm], [params[i] for i in perm], [seeds[i] for i in perm],
                                   [counters[i] for i in perm]), [params[i] for i in perm])
    assert [shuffled[perm.index(i)] for i in range(8)] == whole
    plain = unpack(sample_batch(logits, [SamplingParams(temperature=p.temperature, top_k=p.top_k) for p in params],
                                seeds, counters), params)
    assert [s.token for s in plain] != [s.token for s in whole]  # the adjustments did change tokens


def test_a_bad_logit_bias_fails_only_its_row():
    params = [SamplingParams(temperature=0), SamplingParams(temperature=0, logit_bias={50: 1.0})]
    rows = sample_rows(torch.tensor([[0.0, 1.0], [1.0, 0.0]]), params, [0, 0], [0, 0])
    assert isinstance(rows, list) and rows[0].token == 1 and rows[0].error is None
    assert rows[1].error is not None and "logit_bias" in rows[1].error


# ---------------- whole requests


def _gen(llm, prompt, **kw):
    return llm.generate([prompt], SamplingParams(**kw), use_tqdm=False)[0]


@pytest.fixture(scope="module")
def ref_llm(tiny_ouro) -> LLM:
    return LLM(model=tiny_ouro, scheduler="reference", dtype="float64")


def test_engine_equals_reference(tiny_ouro):
    """Every feature, greedy and seeded, several at once in the batching engine, each as the reference decodes it."""
    feats = (dict(presence_penalty=1.2, frequency_penalty=0.6), dict(repetition_penalty=1.5),
             dict(repetition_penalty=0.7, presence_penalty=-0.5), dict(logit_bias={7: 3.0, 12: -2.0}),
             dict(min_tokens=6, stop_token_ids=[5, 17]), dict(truncate_prompt_tokens=3),
             dict(stop=["e", "a"], include_stop_str_in_output=True, min_tokens=2), dict())
    reqs = []
    for i, f in enumerate(feats * 2):
        prompt = [(31 * i + 7 * j + 3) % 500 + 1 for j in range(4 + i % 5)]
        sampling = dict(temperature=0.0) if i < len(feats) else dict(temperature=1.0, seed=40 + i, logprobs=2)
        reqs.append(Req(f"r{i}", prompt, SamplingParams(max_tokens=12, **sampling, **f), seed=7 + i, arrive=i % 3))
    engine = make_engine(tiny_ouro, scheduler="cdb")
    outs = drive(engine, reqs)
    for r in reqs:
        ref = reference(engine, r)
        assert_matches(outs[r.rid], ref)
        assert outs[r.rid].outputs[0].stop_reason == ref.stop_reason
        assert outs[r.rid].prompt_token_ids == ref.prompt_ids


def test_penalties_change_the_output(ref_llm):
    base = _gen(ref_llm, PROMPT, max_tokens=16, temperature=0, ignore_eos=True).outputs[0].token_ids
    assert len(set(base)) < len(base)  # greedy repeats itself on this prompt
    for kw in (dict(presence_penalty=2.0), dict(frequency_penalty=2.0), dict(repetition_penalty=3.0)):
        out = _gen(ref_llm, PROMPT, max_tokens=16, temperature=0, ignore_eos=True, **kw).outputs[0].token_ids
        assert out != base
    biased = _gen(ref_llm, PROMPT, max_tokens=5, temperature=0, ignore_eos=True, logit_bias={321: 100})
    assert biased.outputs[0].token_ids == [321] * 5


def test_min_tokens_keeps_eos_away(ref_llm):
    eos = min(ref_llm.tokenizer.eos_token_ids)
    pushed = dict(max_tokens=10, temperature=0, logit_bias={eos: 100})  # eos is the argmax everywhere
    first = _gen(ref_llm, PROMPT, **pushed).outputs[0]
    assert first.token_ids == [eos] and first.finish_reason == "stop" and first.stop_reason is None
    out = _gen(ref_llm, PROMPT, min_tokens=4, **pushed).outputs[0]
    assert len(out.token_ids) == 5 and eos not in out.token_ids[:4] and out.token_ids[4] == eos
    assert out.finish_reason == "stop" and out.stop_reason is None
    stop = _gen(ref_llm, PROMPT, min_tokens=3, stop_token_ids=[eos], ignore_eos=True, **pushed).outputs[0]
    assert len(stop.token_ids) == 4 and stop.stop_reason == eos


def test_stop_reason_and_include_stop_str(ref_llm):
    whole = _gen(ref_llm, PROMPT, max_tokens=16, temperature=0, ignore_eos=True)
    full = whole.outputs[0]
    assert full.finish_reason == "length" and full.stop_reason is None
    text = full.text
    k = next(i for i in range(1, len(text) - 1) if text[i:i + 2].isascii() and text[i:i + 2].isalpha()
             and text.find(text[i:i + 2]) == i)
    stop = text[k:k + 2]
    kw = dict(max_tokens=16, temperature=0, ignore_eos=True, stop=["\u2603never", stop])
    out = _gen(ref_llm, PROMPT, **kw).outputs[0]
    assert (out.text, out.finish_reason, out.stop_reason) == (text[:k], "stop", stop)
    kept = _gen(ref_llm, PROMPT, include_stop_str_in_output=True, **kw).outputs[0]
    assert (kept.text, kept.stop_reason, kept.token_ids) == (text[:k + 2], stop, out.token_ids)
    # a stop token's text is left out of the text unless asked for, and it is the stop reason (a token whose text
    # shows: one that completes no character adds none)
    def text_of(n):  # the text of the first n tokens, as the output's stream decodes it
        return ref_llm.tokenizer.text_stream(whole.prompt_token_ids).extend(full.token_ids[:n])

    j = next(i for i in range(1, 16) if full.token_ids[i] not in full.token_ids[:i] and text_of(i + 1) != text_of(i))
    tid = full.token_ids[j]
    piece = text_of(j + 1)
    by_id = _gen(ref_llm, PROMPT, max_tokens=16, temperature=0, ignore_eos=True, stop_token_ids=[tid]).outputs[0]
    assert by_id.token_ids == full.token_ids[: j + 1] and by_id.stop_reason == tid
    assert by_id.text == text_of(j) != piece
    with_id = _gen(ref_llm, PROMPT, max_tokens=16, temperature=0, ignore_eos=True, stop_token_ids=[tid],
                   include_stop_str_in_output=True).outputs[0]
    assert with_id.text == piece


def test_stop_strings_wait_for_min_tokens(ref_llm):
    full = _gen(ref_llm, PROMPT, max_tokens=16, temperature=0, ignore_eos=True).outputs[0]
    stop = next(ch for ch in full.text if ch.isascii() and ch.isalnum())
    m = next(m for m in range(1, 17) if stop in ref_llm.tokenizer.decode(full.token_ids[:m]))  # the token ending it
    kw = dict(max_tokens=16, temperature=0, ignore_eos=True, stop=[stop])
    early = _gen(ref_llm, PROMPT, **kw).outputs[0]
    assert len(early.token_ids) == m and early.stop_reason == stop and stop not in early.text
    late = _gen(ref_llm, PROMPT, min_tokens=m, **kw).outputs[0]
    assert len(late.token_ids) > m and late.token_ids == full.token_ids[: len(late.token_ids)]
    assert stop in late.text  # the text of the first min_tokens tokens is never cut


def test_truncate_prompt_tokens(ref_llm):
    out = _gen(ref_llm, PROMPT, max_tokens=6, temperature=0, ignore_eos=True, truncate_prompt_tokens=3)
    direct = _gen(ref_llm, PROMPT[-3:], max_tokens=6, temperature=0, ignore_eos=True)
    assert out.prompt_token_ids == PROMPT[-3:]
    assert out.outputs[0].token_ids == direct.outputs[0].token_ids
    whole = _gen(ref_llm, PROMPT, max_tokens=6, temperature=0, ignore_eos=True, truncate_prompt_tokens=100)
    assert whole.prompt_token_ids == PROMPT
    with pytest.raises(ValueError, match="truncate_prompt_tokens: .* maximum context length"):  # (as vLLM refuses it)
        _gen(ref_llm, PROMPT, max_tokens=6, truncate_prompt_tokens=ref_llm.max_model_len + 1)


def test_truncate_prompt_keeps_the_last_tokens():
    """-1 keeps what the context leaves beside the completion (vLLM's max_input_tokens: max_model_len - max_tokens,
    or max_model_len - 1 without max_tokens); k >= 1 the last k."""
    ids = list(range(10, 40))
    assert truncate_prompt(ids, -1, 24, 4) == ids[-20:] == list(range(20, 40))
    assert truncate_prompt(ids, -1, 24, None) == ids[-23:]
    assert truncate_prompt(ids, -1, 34, 4) == truncate_prompt(ids, -1, 2048, 16) == truncate_prompt(ids, None, 24, 4)
    assert truncate_prompt(ids, -1, 34, 4) == ids
    assert truncate_prompt(ids, -1, 24, 100) == ids[-1:]  # (the budget check then refuses max_tokens)
    assert truncate_prompt(ids, 3, 24, 4) == [37, 38, 39]
    # cutting again with a budget no larger, to a context no shorter (the engine's, after LLM's or the server's,
    # with the max_tokens they settled on) changes nothing
    once = truncate_prompt(ids, -1, 24, 4)
    assert truncate_prompt(once, -1, 24, 4) == truncate_prompt(once, -1, 2048, 4) == once
    assert truncate_prompt(truncate_prompt(ids, -1, 24, None), -1, 24, 1) == ids[-23:]
