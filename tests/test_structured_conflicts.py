"""A grammar whose tokens the request's other masks (allowed_token_ids, bad_words, what min_tokens holds back) all
ban: the request fails alone as its own fault (`NothingToSampleError`: finish_reason "error", status 400, a warning
without traceback), naming the fields in conflict, in every scheduler as in the reference decoder, and its
neighbours are untouched. A conflict at the first token is refused when the request is made (exactly then: the
sampler's first masks are known). Before, the sampler drew some token anyway (an argmax over -inf, or a draw from
NaN) and the grammar refused it: an internal error (500) with a traceback per request.

The tiny tokenizer: "yes" is [124 ("y"), 284 ("es")], "yess" [124, 284, 118 ("s")], "no" [113, 114]; end-of-sequence
tokens 0 and 2. The model's vocabulary (4096) is padded past the tokenizer's (512)."""

from __future__ import annotations

import dataclasses
import itertools
import logging
import re

import numpy as np
import pytest
import torch

from loopserve import LLM, GuidedDecodingParams, SamplingParams
from loopserve.engine import sequence
from loopserve.engine.sampler import NothingToSampleError, guided_room, sample_one
from tests.engine_helpers import Req, assert_matches, drive, make_engine, reference

pytest.importorskip("llguidance")

PROMPT = [5, 9, 3]
YES = GuidedDecodingParams(choice=["yes"])
YESS = GuidedDecodingParams(choice=["yes", "yess"])  # after "yes": the end, or "s"
HELD = " (min_tokens holds back the end-of-sequence and stop tokens)"


def at(n: int, fields: str, kind: str = "choice", field: str = "guided_decoding") -> str:
    """The error of a request that `fields` (", a and b" or " and a") with its grammar leave no token at token n."""
    first = fields.replace(",", " ").split()[0 if fields.startswith(",") else 1]
    return f"{first}: {field} ({kind}){fields} leave no token to sample at output token {n}"


# the request's fields -> its error: the first token's conflicts are refused up front, the later ones fail it
UP_FRONT = {
    "allowed": (dict(allowed_token_ids=[5]), at(1, " and allowed_token_ids")),
    "one-token bad word": (dict(bad_words=["y"]), at(1, " and bad_words")),
    "stop id held": (dict(stop_token_ids=[124], min_tokens=1), at(1, " and min_tokens") + HELD),
    "all three": (dict(allowed_token_ids=[5, 124, 113], bad_words=["n"], stop_token_ids=[124], min_tokens=2),
                  at(1, " and min_tokens") + HELD),  # (5 and 113 are not the grammar's: only min_tokens masks 124)
}
LATER = {  # (fields, error, tokens taken before it)
    "bad word": (dict(bad_words=["yes"]), at(2, " and bad_words"), [124]),
    "allowed": (dict(allowed_token_ids=[124]), at(2, " and allowed_token_ids"), [124]),
    "allowed, min_tokens": (dict(allowed_token_ids=[124, 284], min_tokens=5),
                            at(3, ", allowed_token_ids and min_tokens") + HELD, [124, 284]),
    "bad word, min_tokens": (dict(bad_words=["yess"], min_tokens=4), at(3, ", bad_words and min_tokens") + HELD,
                             [124, 284]),
}


def guide_of(name: str) -> GuidedDecodingParams:
    return YESS if "min_tokens" in name else YES


@pytest.mark.parametrize("name", list(UP_FRONT))
def test_a_first_token_conflict_is_refused_when_the_request_is_made(tiny_ouro, name):
    """allowed_token_ids, a bad word of one token (banned at every step) or a stop id that min_tokens holds back,
    masking every token the grammar allows first: a ValueError naming the fields when the request is made (a 400 on
    a server), on every scheduler; a field that masks none of the grammar's first tokens is not named."""
    fields, error = UP_FRONT[name]
    engine = make_engine(tiny_ouro, scheduler="cb")
    params = SamplingParams(max_tokens=4, n=2, guided_decoding=YES, **fields)
    with pytest.raises(ValueError, match=f"^{re.escape(error)}$"):
        engine.make_sequence("x", PROMPT, params)
    for sched in ("reference", "cdb"):
        llm = LLM(model=tiny_ouro, scheduler=sched, dtype="float64", kv_cache_tokens=512)
        with pytest.raises(ValueError, match=f"^{re.escape(error)}"):
            llm.generate([PROMPT], SamplingParams(max_tokens=4, guided_decoding=YES, **fields), use_tqdm=False)
    # vLLM's newer name is the one the error gives when the request used it
    so = SamplingParams(max_tokens=4, structured_outputs={"choice": ["yes"]}, **fields)
    with pytest.raises(ValueError, match=f"^{re.escape(error.replace('guided_decoding (', 'structured_outputs ('))}$"):
        engine.make_sequence("y", PROMPT, so)


def test_the_first_token_check_refuses_exactly_what_the_sampler_would_fail(tiny_ouro, monkeypatch):
    """Over combinations of allowed ids, one-token bad words, stop ids and min_tokens around a grammar's first
    tokens (113 "n" and 124 "y" for "no" or "yes"), a request is refused when it is made exactly when its first
    sample, with the check left out, fails with `NothingToSampleError` (no false refusal, none missed)."""
    engine = make_engine(tiny_ouro, scheduler="cb")
    grammar = GuidedDecodingParams(choice=["no", "yes"])
    logits = torch.randn(engine.model.config.vocab_size, generator=torch.Generator().manual_seed(0),
                         dtype=torch.float64)
    refused = sampled = 0
    combos = itertools.product([None, [124], [113, 124], [5, 113], [5]], [[], ["y"], ["n", "x"]], [[], [113]],
                               [0, 1], [0.0, 1.0])
    for k, (allowed, words, stops, min_tokens, temperature) in enumerate(combos):
        params = SamplingParams(max_tokens=3, allowed_token_ids=allowed, bad_words=words, stop_token_ids=stops,
                                min_tokens=min_tokens, temperature=temperature, guided_decoding=grammar)
        try:
            engine.make_sequence(f"r{k}", PROMPT, params)
            why = None
        except ValueError as e:
            why = str(e)
        with monkeypatch.context() as m:
            m.setattr(sequence, "first_token_room", lambda p: None)
            try:
                seq = engine.make_sequence(f"s{k}", PROMPT, params)
            except ValueError as e:  # refused for another reason (allowed ids all banned): refused above too
                assert why == str(e)
                continue
        try:
            sample_one(logits, seq.params, seq.seed, 0).checked()
            failed = None
        except NothingToSampleError as e:
            failed = str(e)
        assert why == failed, (allowed, words, stops, min_tokens)
        refused += why is not None
        sampled += why is None
    assert refused > 10 and sampled > 10  # both outcomes are covered


@pytest.mark.parametrize("scheduler", ["cb", "cdb"])
def test_a_later_conflict_fails_its_request_alone_as_the_reference(tiny_ouro, scheduler, caplog):
    """Each conflicting request (greedy, and seeded at temperature 1, where the draw was from NaN) takes the tokens
    its grammar and masks allow, then finishes with finish_reason "error", status 400, the error naming the fields,
    and a warning (no ERROR, no traceback), as the reference decoder finishes it. Its neighbours in the batch
    (free, guided, n = 2, logprobs) equal the reference, and their solo runs; every KV block is free after."""
    engine = make_engine(tiny_ouro, scheduler=scheduler, max_decode_batch=8)
    reqs, failing = [], {}
    for i, (name, (fields, error, taken)) in enumerate(LATER.items()):
        for j, sampling in enumerate((dict(temperature=0.0), dict(temperature=1.0, seed=40 + i))):
            rid = f"bad{i}.{j}"
            reqs.append(Req(rid, PROMPT if j else [7, 8], SamplingParams(max_tokens=8, guided_decoding=guide_of(name),
                                                                         **sampling, **fields), seed=i, arrive=j))
            failing[rid] = (error, taken)
    neighbours = [Req("free", [4, 5, 6], SamplingParams(max_tokens=8, temperature=0.0, logprobs=2), seed=1),
                  Req("seeded", [6, 2], SamplingParams(max_tokens=8, temperature=1.0, seed=7, exit_threshold=0.6),
                      seed=2, arrive=1),
                  Req("guided", [9, 9], SamplingParams(max_tokens=8, temperature=1.0, seed=3, guided_decoding=YESS,
                                                       allowed_token_ids=[124, 284, 118, 0, 2]), seed=3),
                  Req("n2", PROMPT, SamplingParams(max_tokens=6, temperature=1.0, seed=11, n=2,
                                                   bad_words=["y"]), seed=4)]
    reqs += neighbours
    with caplog.at_level(logging.WARNING, logger="loopserve"):
        outs = drive(engine, reqs)
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR or r.exc_info]
    for r in reqs:
        ref = reference(engine, r) if r.params.n == 1 else None
        if r.rid in failing:
            error, taken = failing[r.rid]
            assert ref is not None and (ref.finish_reason, ref.error, ref.error_status) == ("error", error, 400)
            c = outs[r.rid].outputs[0]
            assert ref.output_ids == taken
            assert (c.token_ids, c.exit_depths, c.finish_reason, c.text) == (
                ref.output_ids, ref.exit_depths, "error", ref.text)
            assert (outs[r.rid].error, outs[r.rid].error_status) == (error, 400)
            logged = f"request {r.rid} failed: {error}"
            assert sum(record.getMessage() == logged for record in caplog.records) == 1
            continue
        assert outs[r.rid].outputs[0].finish_reason != "error"
        solo = drive(make_engine(tiny_ouro, scheduler=scheduler), [dataclasses.replace(r, arrive=0)])[r.rid]
        assert [c.token_ids for c in solo.outputs] == [c.token_ids for c in outs[r.rid].outputs]
        if ref is not None:
            assert_matches(outs[r.rid], ref)
    assert engine.kv.allocator.num_free == engine.kv.num_blocks


@pytest.mark.parametrize("scheduler", ["reference", "cb", "cdb"])
def test_offline_generate_reports_the_conflict_as_the_request_output(tiny_ouro, scheduler):
    """`LLM.generate` returns the failed request's output (finish_reason "error", the error, status 400) instead of
    raising, on every scheduler, and the other prompt's output is its solo run's."""
    llm = LLM(model=tiny_ouro, scheduler=scheduler, dtype="float64", kv_cache_tokens=512)
    plain = SamplingParams(max_tokens=6, temperature=0)
    alone = llm.generate([PROMPT], plain, use_tqdm=False)[0].outputs[0]
    for name, (fields, error, taken) in LATER.items():
        guided = SamplingParams(max_tokens=6, temperature=0, guided_decoding=guide_of(name), **fields)
        got = llm.generate([PROMPT, PROMPT], [guided, plain], use_tqdm=False)
        c = got[0].outputs[0]
        assert (c.finish_reason, got[0].error, got[0].error_status, c.token_ids) == ("error", error, 400, taken), name
        assert got[1].outputs[0].token_ids == alone.token_ids and got[1].outputs[0].finish_reason != "error"


def test_guided_room_names_only_the_fields_that_mask_a_grammar_token():
    """The reason names the grammar's field, then each other field that bans one of the tokens the grammar allows
    (here 3 and 40 of a vocabulary of 64, in a 2-word bitmask): a field whose bans miss them all is not named."""
    words = np.zeros(2, np.int32)
    words[0], words[1] = 1 << 3, 1 << (40 - 32)
    grammar = GuidedDecodingParams(regex="[ab]")

    def why(bans=(), held=None, **kw):
        p = SamplingParams(guided_decoding=grammar, **kw)
        return guided_room(p, words, 64, 4, list(bans), None if held is None else np.array(held))

    assert why() is None and why(allowed_token_ids=[40, 7]) is None and why(bans=[3], held=[5]) is None
    assert why(allowed_token_ids=[7]) == at(5, " and allowed_token_ids", "regex")
    assert why(allowed_token_ids=[3, 7], bans=[3, 9]) == at(5, ", allowed_token_ids and bad_words", "regex")
    assert why(allowed_token_ids=[40], held=[40, 0]) == at(5, ", allowed_token_ids and min_tokens", "regex") + HELD
    assert why(bans=[3, 40]) == at(5, " and bad_words", "regex")
    assert why(allowed_token_ids=[3, 40], bans=[40], held=[3]) == at(5, ", bad_words and min_tokens", "regex") + HELD
    # tokens past the model's vocabulary (a tokenizer larger than the model) are never sampled: no other field
    high = np.array([0, 1 << (40 - 32)], np.int32)  # token 40 alone
    assert guided_room(SamplingParams(guided_decoding=grammar), high, 40, 0, [], None) == (
        "guided_decoding: the grammar (regex) allows no token of the model's vocabulary [0, 40) at output token 1")
    assert guided_room(SamplingParams(guided_decoding=grammar), high, 41, 0, [], None) is None
