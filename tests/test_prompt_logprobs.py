"""Prompt logprobs (`SamplingParams.prompt_logprobs`): the coda's distribution at every prompt position,
at full depth, during prefill. Checked against the upstream math recomputed from scratch (float64, no
cache), and the batching engine against the sequential reference decoder whatever the schedule, chunking
and batch neighbours."""

from __future__ import annotations

import copy
import pickle

import numpy as np
import pytest
import torch

from loopserve import SamplingParams
from loopserve.outputs import Logprob, PromptLogprobs
from tests.engine_helpers import Req, drive, make_engine, reference
from tests.upstream import oracle

pytestmark = pytest.mark.usefixtures("single_thread")

PROMPT = [5, 17, 99, 3, 250, 40, 7, 11, 12, 300, 8]


def test_prompt_logprobs_match_the_upstream_math(tiny_ouro):
    """Every prompt position against the oracle's full-depth forward pass: the scored token's logprob
    and rank, and the top-k ids and values (the prompt spans three prefill chunks, beside a neighbour)."""
    k = 4
    engine = make_engine(tiny_ouro, scheduler="cdb", prefill_chunk_size=4)
    reqs = [Req("p", PROMPT, SamplingParams(max_tokens=2, temperature=0, prompt_logprobs=k), seed=0),
            Req("n", [9, 9, 9, 9, 9], SamplingParams(max_tokens=3, temperature=0), seed=1)]
    got = drive(engine, reqs)["p"].prompt_logprobs
    config, weights = oracle.load_folder(tiny_ouro)
    want = torch.log_softmax(oracle.ouro_logits(config, weights, PROMPT, config["total_ut_steps"]), -1)
    assert got is not None and len(got) == len(PROMPT) and got[0] is None
    for p in range(1, len(PROMPT)):
        row, entry = want[p - 1], got[p]
        assert entry is not None
        token = PROMPT[p]
        assert abs(entry[token].logprob - float(row[token])) < 1e-9
        assert entry[token].rank == int((row > row[token]).sum()) + 1
        top = torch.topk(row, k)
        ranked = sorted((lp.rank, t) for t, lp in entry.items() if lp.rank is not None and lp.rank <= k)
        assert [t for _, t in ranked] == top.indices.tolist()
        pairs = zip(top.indices.tolist(), top.values.tolist(), strict=True)
        assert max(abs(entry[t].logprob - v) for t, v in pairs) < 1e-9
        assert len(entry) == k + (token not in top.indices.tolist())


@pytest.mark.parametrize("scheduler", ["cb", "cdb-norefill", "cdb"])
@pytest.mark.parametrize("arch", ["ouro", "huginn"])
def test_engine_equals_the_reference(arch, scheduler, tiny_ouro, tiny_huginn):
    """Requests with and without prompt logprobs, different k, prompts of one token and of several chunks,
    arriving while others decode: the same values as the reference decoder, request by request."""
    path = tiny_ouro if arch == "ouro" else tiny_huginn
    engine = make_engine(path, scheduler=scheduler, prefill_chunk_size=4, max_num_batched_tokens=8)
    reqs = [Req("a", PROMPT, SamplingParams(max_tokens=3, temperature=0, prompt_logprobs=3), seed=0),
            Req("b", [44], SamplingParams(max_tokens=2, temperature=0.8, prompt_logprobs=0), seed=1),
            Req("c", [7, 8, 9, 10, 11, 12], SamplingParams(max_tokens=4, temperature=0), seed=2, arrive=2),
            Req("d", PROMPT[::-1], SamplingParams(max_tokens=2, temperature=0, prompt_logprobs=1, logprobs=2),
                seed=3, arrive=3)]
    outs = drive(engine, reqs)
    for r in reqs:
        ref = reference(engine, r)
        out = outs[r.rid]
        assert out.outputs[0].token_ids == ref.output_ids
        if r.params.prompt_logprobs is None:
            assert out.prompt_logprobs is None
            continue
        assert out.prompt_logprobs is not None and ref.prompt_logprobs is not None
        assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(r.prompt)
        for ours, theirs in zip(out.prompt_logprobs[1:], ref.prompt_logprobs[1:], strict=True):
            assert ours is not None and theirs is not None and ours.keys() == theirs.keys()
            for t in ours:
                assert ours[t].rank == theirs[t].rank
                assert abs(ours[t].logprob - theirs[t].logprob) < 1e-9


@pytest.mark.parametrize("bad", [-2, 1.5, False, "3"])  # (-1, the whole vocabulary, and 21 are the engine's to cap;
# True is vLLM's 1)
def test_bad_values_name_the_field(bad):
    with pytest.raises(ValueError, match="prompt_logprobs"):
        SamplingParams(prompt_logprobs=bad)


def test_the_engine_makes_no_entry_a_reader_does(tiny_ouro, monkeypatch):
    """The engine keeps a prompt's logprobs as the arrays its prefill read back; the entries (a `Logprob` and a
    decoded token each) are made when the output is first read, by the reader (the server formats responses off
    the engine thread), and they read as vLLM's list."""
    engine = make_engine(tiny_ouro, scheduler="cdb", prefill_chunk_size=4)
    decoded: list[int] = []
    decode_token = engine.tokenizer.decode_token
    monkeypatch.setattr(engine.tokenizer, "decode_token", lambda i: decoded.append(i) or decode_token(i))
    out = drive(engine, [Req("p", PROMPT, SamplingParams(max_tokens=2, temperature=0, prompt_logprobs=2), seed=0)])["p"]
    assert decoded == []  # no entry yet
    entries = list(out.prompt_logprobs or [])
    assert len(decoded) >= 2 * (len(PROMPT) - 1)
    assert entries[0] is None and all(len(e) in (2, 3) for e in entries[1:])
    assert out.prompt_logprobs == entries and entries == out.prompt_logprobs
    assert out.prompt_logprobs is not None and out.prompt_logprobs[1:3] == entries[1:3]
    assert repr(out.prompt_logprobs) == repr(entries)
    assert pickle.loads(pickle.dumps(out)).prompt_logprobs == entries == copy.deepcopy(out).prompt_logprobs
    assert out.prompt_logprobs + [] == [] + out.prompt_logprobs == out.prompt_logprobs.copy() == entries


def test_a_chunk_given_again_replaces_the_one_it_covers():
    """A prompt prefilled again after preemption gives its chunks again: the entries are the later rows', made anew
    when read after the change (a reader holding entries made before sees them replaced), and the covered chunk is
    dropped (memory does not grow with each recomputation)."""
    def rows(first: int, n: int, lp: float) -> dict[str, np.ndarray]:
        return {"tokens": np.arange(first, first + n), "finite": np.ones(n, bool), "lp_chosen": np.full(n, lp),
                "lp_rank": np.full(n, 2), "lp_top_ids": np.full((n, 3), 9), "lp_top_vals": np.full((n, 3), -0.1)}

    pl = PromptLogprobs(5, 1, str)
    pl.add(0, rows(10, 2, -1.0))
    assert pl[1] == {10: Logprob(-1.0, 2, "10"), 9: Logprob(-0.1, 1, "9")} and pl[3] is None
    pl.add(2, rows(12, 2, -3.0))
    pl.add(0, rows(10, 2, -2.0))  # (again, later values: made anew)
    assert [e and e[t].logprob for t, e in zip(range(9, 14), pl, strict=True)] == [None, -2.0, -2.0, -3.0, -3.0]
    assert len(pl._chunks) == 2
