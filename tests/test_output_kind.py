"""`SamplingParams.output_kind` (vLLM's RequestOutputKind): CUMULATIVE requests get an output per
token, FINAL_ONLY ones a single output when they finish, equal to the cumulative one's last; a
FINAL_ONLY request without stop strings does not decode its text per token; DELTA is refused."""

from __future__ import annotations

import pytest

from loopserve import RequestOutputKind, SamplingParams
from loopserve.engine.sequence import Sequence
from tests.engine_helpers import make_engine

FINAL, CUMULATIVE = RequestOutputKind.FINAL_ONLY, RequestOutputKind.CUMULATIVE


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
    """No per-token detokenization for a FINAL_ONLY request without stop strings; a CUMULATIVE one decodes
    each token as it comes (its outputs carry the text)."""
    calls: dict[str, int] = {}
    real = Sequence._decode_pending

    def counted(self):
        calls[self.request_id] = calls.get(self.request_id, 0) + 1
        return real(self)

    monkeypatch.setattr(Sequence, "_decode_pending", counted)
    engine = make_engine(tiny_ouro, scheduler="cdb")
    kw = dict(max_tokens=10, ignore_eos=True, temperature=0.0)
    seen = _run(engine, {"c": SamplingParams(**kw), "f": SamplingParams(**kw, output_kind=FINAL)}, [9, 10, 11])
    assert calls.get("c") == 10 and "f" not in calls
    assert seen["f"][0].outputs[0].text == seen["c"][-1].outputs[0].text


def test_llm_generate_uses_final_only(tiny_ouro):
    from loopserve import LLM

    llm = LLM(str(tiny_ouro), dtype="float64", scheduler="cdb", kv_cache_tokens=512)
    seq = llm._make_sequence([1, 2, 3], SamplingParams(max_tokens=6, ignore_eos=True))
    assert seq.params.output_kind is FINAL
    out = llm.generate([[1, 2, 3]], SamplingParams(max_tokens=6, ignore_eos=True), use_tqdm=False)[0]
    assert out.finished and len(out.outputs[0].token_ids) == 6 and out.outputs[0].text


@pytest.mark.parametrize("bad", [RequestOutputKind.DELTA, 1, 3, "final", 2.0, True])
def test_output_kind_checked(bad):
    with pytest.raises(ValueError, match="^output_kind:"):
        SamplingParams(output_kind=bad)


def test_output_kind_accepts_vllm_values():
    assert SamplingParams(output_kind=2).output_kind is FINAL and SamplingParams().output_kind is CUMULATIVE


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
