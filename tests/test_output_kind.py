"""`SamplingParams.output_kind` (vLLM's RequestOutputKind): CUMULATIVE requests get an output per
token, FINAL_ONLY ones a single output when they finish, equal to the cumulative one's last; a
FINAL_ONLY request without stop strings does not decode its text per token; DELTA outputs hold what
is new, add up to the cumulative output and never send text a stop string later cuts."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from loopserve import RequestOutputKind, SamplingParams
from loopserve.engine.sequence import Sequence
from loopserve.exits import ExitRule
from loopserve.tokenizer import Tokenizer
from tests.engine_helpers import make_engine

FINAL, CUMULATIVE, DELTA = RequestOutputKind.FINAL_ONLY, RequestOutputKind.CUMULATIVE, RequestOutputKind.DELTA


def _run(engine, params: dict[str, SamplingParams], prompt: list[int]) -> dict[str, list]:
    for rid, p in params.items():
        engine.add_request(rid, prompt, p, seed=7)
    seen: dict[str, list] = {rid: [] for rid in params}
    while engine.has_unfinished_requests():
        for o in engine.step():
            seen[o.request_id].append(o)
    engine.scheduler.check_drained()
    return seen


@pytest.mark.parametrize("scheduler", ["cb", "cdb"])
@pytest.mark.parametrize("stop", [None, ["e"]])
def test_final_only_reports_once_and_equals_cumulative(tiny_ouro, scheduler, stop):
    engine = make_engine(tiny_ouro, scheduler=scheduler)
    kw = dict(max_tokens=12, temperature=0.9, seed=3, stop=stop, logprobs=2)
    seen = _run(engine, {"c": SamplingParams(**kw), "f": SamplingParams(**kw, output_kind=FINAL)}, [5, 6, 7, 8])
    cumulative, final = seen["c"], seen["f"]
    assert len(final) == 1 and final[0].finished
    assert len(cumulative) == len(cumulative[-1].outputs[0].token_ids) >= 1  # one per token
    a, b = cumulative[-1].outputs[0], final[0].outputs[0]
    assert (b.text, b.token_ids, b.exit_depths, b.finish_reason, b.stop_reason, b.logprobs) == (
        a.text, a.token_ids, a.exit_depths, a.finish_reason, a.stop_reason, a.logprobs)
    m = final[0].metrics
    assert m is not None and m.first_token_time is not None and m.last_token_time is not None
    assert m.first_token_time <= m.last_token_time <= m.finished_time


def test_final_only_decodes_text_once(tiny_ouro, monkeypatch):
    """No per-token detokenization for a FINAL_ONLY request without stop strings (its tokens decoded together, when it
    finishes); a CUMULATIVE one decodes each token as it comes (its outputs carry the text)."""
    calls: dict[str, list[int]] = {}
    real = Sequence.decode_pending

    def counted(self, end=None):
        n = (len(self.output_ids) if end is None else end) - self._decoded
        if n > 0:
            calls.setdefault(self.request_id, []).append(n)
        return real(self, end)

    monkeypatch.setattr(Sequence, "decode_pending", counted)
    engine = make_engine(tiny_ouro, scheduler="cdb")
    kw = dict(max_tokens=10, ignore_eos=True, temperature=0.0)
    seen = _run(engine, {"c": SamplingParams(**kw), "f": SamplingParams(**kw, output_kind=FINAL)}, [9, 10, 11])
    assert calls["c"] == [1] * 10 and calls["f"] == [10]
    assert seen["f"][0].outputs[0].text == seen["c"][-1].outputs[0].text


def test_llm_generate_uses_final_only(tiny_ouro):
    from loopserve import LLM

    llm = LLM(str(tiny_ouro), dtype="float64", scheduler="cdb", kv_cache_tokens=512)
    seq = llm._make_sequence([1, 2, 3], SamplingParams(max_tokens=6, ignore_eos=True))
    assert seq.params.output_kind is FINAL
    out = llm.generate([[1, 2, 3]], SamplingParams(max_tokens=6, ignore_eos=True), use_tqdm=False)[0]
    assert out.finished and len(out.outputs[0].token_ids) == 6 and out.outputs[0].text


@pytest.mark.parametrize("bad", [3, -1, "final", 2.0, True])
def test_output_kind_checked(bad):
    with pytest.raises(ValueError, match="^output_kind:"):
        SamplingParams(output_kind=bad)


def test_output_kind_accepts_vllm_values():
    assert SamplingParams(output_kind=2).output_kind is FINAL and SamplingParams().output_kind is CUMULATIVE
    assert SamplingParams(output_kind=1).output_kind is DELTA


def _samples(outs: list, index: int) -> list:
    return [c for o in outs for c in o.outputs if c.index == index]


@pytest.mark.parametrize("scheduler", ["cb", "cdb"])
@pytest.mark.parametrize("stop", [None, [], ["e", "t "]])
@pytest.mark.parametrize("spec", [0, 2])
def test_delta_outputs_add_up_to_the_cumulative_output(tiny_ouro, scheduler, stop, spec):
    """Per sample (n = 2), the DELTA completions concatenate to the CUMULATIVE request's last output: text,
    token ids, exit depths, logprobs; each carries at least one new token (speculative rounds: several),
    only the last has the finish; the request's first output alone has the prompt logprobs."""
    # speculation: drafts as deep as a fixed-depth greedy request are all accepted, so an output holds a
    # whole round's tokens
    deep = dict(num_speculative_tokens=spec, speculative_draft_loops=4, speculative_min_acceptance=0.0) if spec else {}
    engine = make_engine(tiny_ouro, scheduler=scheduler, kv_cache_tokens=1024, max_decode_batch=16,
                         max_num_seqs=16, **deep)
    kw = dict(max_tokens=14, temperature=0.0 if spec else 0.9, seed=3, logprobs=2, n=2,
              prompt_logprobs=1, ignore_eos=True, exit_policy="fixed" if spec else None)
    if stop and spec:  # greedy: a stop string from the middle of what the request writes without one
        free = _run(engine, {"free": SamplingParams(**kw)}, [5, 6, 7, 8])["free"][-1].outputs[0].text
        stop = [free[len(free) // 2:len(free) // 2 + 2]]
    kw["stop"] = stop
    seen = _run(engine, {"c": SamplingParams(**kw), "d": SamplingParams(**kw, output_kind=DELTA)}, [5, 6, 7, 8])
    cumulative, delta = seen["c"][-1], seen["d"]
    assert [o.finished for o in delta] == [False] * (len(delta) - 1) + [True]
    first, whole_prompt = delta[0].prompt_logprobs, cumulative.prompt_logprobs
    assert first is not None and whole_prompt is not None and len(first) == len(whole_prompt)
    for a, b in zip(first[1:], whole_prompt[1:], strict=True):  # (two rows of one prefill: equal to an ulp)
        assert a is not None and b is not None and a.keys() == b.keys()
        assert [v.logprob for v in a.values()] == pytest.approx([v.logprob for v in b.values()], abs=1e-9)
    assert all(o.prompt_logprobs is None for o in delta[1:])
    for whole in cumulative.outputs:
        parts = _samples(delta, whole.index)
        assert "".join(p.text for p in parts) == whole.text
        assert [t for p in parts for t in p.token_ids] == whole.token_ids
        assert [e for p in parts for e in p.exit_depths] == whole.exit_depths
        assert [lp for p in parts for lp in p.logprobs] == whole.logprobs
        assert all(p.token_ids for p in parts)  # an output is sent because a token came
        assert [p.finish_reason for p in parts] == [None] * (len(parts) - 1) + [whole.finish_reason]
        assert (parts[-1].stop_reason, parts[-1].cumulative_logprob) == (whole.stop_reason, whole.cumulative_logprob)
    assert all(c.finish_reason == ("stop" if stop else "length") for c in cumulative.outputs)
    if spec:
        assert engine.stats.spec_accepted_tokens > 0
        assert max(len(c.token_ids) for o in delta for c in o.outputs) > 1


@settings(max_examples=80, deadline=None)
@given(text=st.text(alphabet="abcde \u00e9\u4e2d", min_size=1, max_size=30),
       stops=st.lists(st.text(alphabet="abcde \u00e9", min_size=1, max_size=4), max_size=3),
       include=st.booleans())
def test_delta_text_never_sends_what_a_stop_string_cuts(tiny_ouro, text, stops, include):
    """Token by token, the DELTA pieces are held back while a stop string may still cut them, so their
    concatenation is the final text exactly (a stop string is cut, or kept with
    include_stop_str_in_output); multi-byte characters split across tokens come out whole. A CUMULATIVE output's
    text is held back alike (vLLM's): each is the start of the final text (one showed the start of a stop string,
    to take it back in its next output)."""
    tok = Tokenizer(tiny_ouro)
    ids = tok.encode(text) or [7]
    seqs = [Sequence("r", None, [5], SamplingParams(
        max_tokens=len(ids), ignore_eos=True, stop=stops,  # [] too (vLLM's default)
        include_stop_str_in_output=include, output_kind=kind), ExitRule("fixed", None, 1, 1), 0, tok, 4096,
        tok.vocab_size) for kind in (DELTA, CUMULATIVE)]
    seq, cumulative = seqs
    sent, shown = "", []
    for t in ids:
        for s in seqs:
            s.append(t, 1, 0.0)
        piece = seq.delta()
        if piece is not None:
            sent += piece.text
            assert seq.text.startswith(sent)  # nothing sent is ever taken back
        shown.append(cumulative.completion().text)
        if seq.finished:
            break
    assert seq.finished and seq.delta() is None and cumulative.finished
    assert sent == seq.text == shown[-1]
    assert all(seq.text.startswith(text) for text in shown)



def test_a_failed_request_keeps_its_text_whatever_the_output_kind(tiny_ouro, monkeypatch):
    """A request that fails mid-generation (here a NaN state) reports the text of its tokens so far, for
    FINAL_ONLY requests too (which decode no text per token)."""
    import numpy as np

    from loopserve.engine.runner import ModelRunner
    from tests.engine_helpers import Req, drive

    real = ModelRunner.core

    def core(self, rows):
        for row in rows.tolist():
            it = self.pool.items[row]
            if it.r >= 1 and len(it.seq.output_ids) >= 5:
                self.pool.state[int(self.pool.state_rows(np.array([row]))[0])] = float("nan")
        return real(self, rows)

    monkeypatch.setattr(ModelRunner, "core", core)
    got = {}
    for kind in (CUMULATIVE, FINAL):
        engine = make_engine(tiny_ouro, scheduler="cdb")
        params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, exit_policy="fixed", output_kind=kind)
        c = drive(engine, [Req("v", [5, 9, 2, 7], params, seed=1)])["v"].outputs[0]
        assert c.finish_reason == "error" and len(c.token_ids) == 5
        got[kind] = c.text
    assert got[FINAL] == got[CUMULATIVE] and got[FINAL]


def test_output_kind_set_after_construction_compares_by_value(tiny_ouro):
    """vLLM code may assign the plain value (0) after construction: still an output per token."""
    p = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True, output_kind=FINAL)
    p.output_kind = 0  # type: ignore[assignment]
    seen = _run(make_engine(tiny_ouro, scheduler="cdb"), {"a": p}, [3, 4, 5])
    assert len(seen["a"]) == 4
