"""The lookahead-gate exit policy: a distilled head predicts the gate one step ahead, so the exit
after step r+1 is decided after step r without wasting a loop."""

from __future__ import annotations

import math

import pytest

from loopserve import LLM, SamplingParams
from loopserve.exits import ExitRule
from loopserve_lab.tiny import TinySpec, make_tiny


def _logit(p: float) -> float:
    return math.log(p / (1 - p))


def test_rule_by_hand():
    t = ExitRule("lookahead_gate", 0.5, 1, 4).new_item(0)
    # after step 1: lambda_1 = 0.2, predicted lambda_2 = 0.5 -> CDF_2 = 1 - 0.8 * 0.5 = 0.6 >= 0.5
    assert t.observe(1, (_logit(0.2), 0.0))
    assert not t.observe(2, (_logit(0.9), 0.0)) and t.exit_depth == 2
    # never predicted to cross: full depth
    t = ExitRule("lookahead_gate", 0.99, 1, 4).new_item(0)
    assert all(t.observe(r, (0.0, 0.0)) for r in (1, 2, 3)) and not t.observe(4, (0.0, 0.0))
    assert t.exit_depth == 4
    # min_loops binds the step decided to be last
    t = ExitRule("lookahead_gate", 0.1, 3, 4).new_item(0)
    assert t.observe(1, (5.0, 5.0)) and t.observe(2, (5.0, 5.0)) and not t.observe(3, (5.0, 5.0))
    assert t.exit_depth == 3


@pytest.fixture(scope="module")
def ouro_la(tmp_path_factory):
    return make_tiny(tmp_path_factory.mktemp("la") / "ouro", TinySpec(arch="ouro", seed=5, lookahead_gate=True))


PROMPTS = [[5, 17, 99, 3], "Hello there", list(range(10, 40))]


@pytest.mark.parametrize("scheduler", ["cb", "cdb-norefill", "cdb"])
@pytest.mark.parametrize("layout", ["depth_indexed", "last_exited", "shared"])
def test_engine_equals_reference_and_wastes_no_loop(ouro_la, scheduler, layout):
    params = [SamplingParams(max_tokens=10, temperature=0.0 if i % 2 else 0.9, seed=i, ignore_eos=True,
                             exit_policy="lookahead_gate", exit_threshold=q)
              for i, q in enumerate((0.3, 0.5, 0.7))]
    kw = dict(dtype="float64", kv_layout=layout, kv_cache_tokens=512, max_decode_batch=2)
    ref = LLM(ouro_la, scheduler="reference", **kw).generate(PROMPTS, params)
    out = LLM(ouro_la, scheduler=scheduler, **kw).generate(PROMPTS, params)
    depths = []
    for a, b in zip(ref, out, strict=True):
        assert b.outputs[0].token_ids == a.outputs[0].token_ids
        assert b.outputs[0].exit_depths == a.outputs[0].exit_depths
        decode = b.outputs[0].exit_depths[1:]
        assert b.metrics.loops_run == a.metrics.loops_run == sum(decode)  # no wasted loop
        depths += decode
    assert min(depths) >= 2 and len(set(depths)) > 1  # exits happen, never before depth 2


def test_needs_the_head(tiny_ouro):
    # (the error says what the checkpoint's own gate reads with)
    with pytest.raises(ValueError, match="^exit_policy: this checkpoint has no lookahead_gate tensors; 'gate' reads"):
        LLM(tiny_ouro, scheduler="reference").generate("hi", SamplingParams(exit_policy="lookahead_gate"))
