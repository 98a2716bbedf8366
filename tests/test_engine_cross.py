"""Engine options crossed with the sampling features the other fuzzers leave out (Hypothesis).

test_engine_workloads and test_speculative fuzz the engine's options (scheduler, per-depth KV layout, lookahead,
async coda, chunked prefill, block size, batch widths, KV pressure, aborts, speculative decoding) with plain
sampling and exit policies only. Here each request of such a workload also draws the features that change what
is sampled or when a request ends: min_p; presence, frequency and repetition penalties; logit_bias; min_tokens;
stop strings (with include_stop_str_in_output), stop_token_ids; bad_words; allowed_token_ids; structured output
(choice, regex); prompt_logprobs; detokenize=False; skip_special_tokens=False; a per-request
num_speculative_tokens. Every sample must equal the sequential reference decoder's (float64): tokens, exit
depths, finish reason, text, stop_reason, logprobs, cumulative logprob, prompt logprobs, and loops run.
"""

from __future__ import annotations

import dataclasses
import math

from hypothesis import assume, given, note, settings
from hypothesis import strategies as st

from loopserve import SamplingParams
from loopserve.sampling_params import GuidedDecodingParams
from tests.engine_helpers import Req, assert_logprobs_close, drive, make_engine
from tests.test_engine_workloads import HYP, check_samples, workloads

# few examples a test: each runs a whole workload and its reference decodes (the file's budget: ~40 s of one core)
CROSS = settings(HYP, max_examples=5)
GUIDES = [GuidedDecodingParams(choice=["red", "green", "blue"]), GuidedDecodingParams(regex=r"[a-c]{2,4}-[0-9]{2}")]
STOPS = ["e", "th", " ", "a", "\n", "in", "o"]  # short strings: they often end the tiny models' random text
VOCAB = 512  # the tiny tokenizer's (the models' logits are padded past it)


# -- strategies ------------------------------------------------------------------------------------------------
@st.composite
def crossed_params(draw, base: SamplingParams, spec: int) -> SamplingParams:
    """`base` (test_engine_workloads' draw: temperature, top-k/p, seeds, logprobs, n, output kind, exit
    policies) with some of the features that only this file crosses with the engine's options."""
    kw: dict = {}
    if base.temperature and draw(st.booleans()):
        kw["min_p"] = draw(st.sampled_from([0.01, 0.1, 0.3]))
    if draw(st.integers(0, 3)) == 0:
        kw["prompt_logprobs"] = draw(st.integers(0, 3))
    for name, values in (("presence_penalty", [-0.5, 0.5, 1.5]), ("frequency_penalty", [-0.5, 0.5, 1.5]),
                         ("repetition_penalty", [0.7, 1.3, 2.0])):
        if draw(st.integers(0, 2)) == 0:
            kw[name] = draw(st.sampled_from(values))
    if draw(st.integers(0, 3)) == 0:  # +-100 forces or bans a token; +-3 only tilts
        kw["logit_bias"] = draw(st.dictionaries(st.integers(0, VOCAB - 1),
                                                st.sampled_from([-100.0, -3.0, 3.0, 100.0]), min_size=1, max_size=3))
    if draw(st.integers(0, 3)) == 0:
        kw["min_tokens"] = draw(st.integers(0, base.max_tokens))
    # a grammar alone: with allowed_token_ids or bad_words it mostly has no token left to sample, and the request
    # fails as its own fault (test_structured_conflicts)
    if draw(st.integers(0, 7)) == 0:
        kw["guided_decoding"] = draw(st.sampled_from(GUIDES))
    else:
        if draw(st.integers(0, 3)) == 0:
            kw["allowed_token_ids"] = draw(st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=40, unique=True))
        if draw(st.integers(0, 4)) == 0:
            kw["bad_words"] = draw(st.lists(st.sampled_from(["the", " a", "e", "in", " of"]), min_size=1, max_size=3))
    if draw(st.integers(0, 2)) == 0:
        kw["stop"] = draw(st.lists(st.sampled_from(STOPS), min_size=1, max_size=3))
        kw["include_stop_str_in_output"] = draw(st.booleans())
    elif draw(st.integers(0, 5)) == 0:  # (stop strings need the text)
        kw["detokenize"] = False
    if draw(st.integers(0, 3)) == 0:
        kw["stop_token_ids"] = draw(st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=8))
    if draw(st.integers(0, 5)) == 0:
        kw["skip_special_tokens"] = False
    if spec and draw(st.integers(0, 2)) == 0:
        kw["num_speculative_tokens"] = draw(st.integers(0, spec))
    return dataclasses.replace(base, **kw)


@st.composite
def cross_workloads(draw, arch: str, r_max: int):
    """test_engine_workloads' workload, with the pipelined core, the prefix cache on or off, speculative
    decoding (refused with the shared layout), and every request's params crossed."""
    cfg, reqs = draw(workloads(arch, r_max))
    cfg.update(pipeline_core_steps=draw(st.booleans()), enable_prefix_caching=draw(st.booleans()))
    spec = draw(st.sampled_from([0, 0, 1, 3])) if cfg["kv_layout"] != "shared" else 0
    if spec:
        cfg.update(num_speculative_tokens=spec, speculative_draft_loops=draw(st.sampled_from([1, 2, r_max])),
                   speculative_max_batch=draw(st.sampled_from([2, 8])),
                   speculative_min_acceptance=draw(st.sampled_from([0.0, 0.5])))
    return cfg, [dataclasses.replace(r, params=draw(crossed_params(r.params, spec))) for r in reqs]


# -- the check -------------------------------------------------------------------------------------------------
def check_workload(path, state_init: str, cfg: dict, reqs: list[Req]) -> None:
    note(repr(cfg))
    engine = make_engine(path, state_init, **cfg)
    # a request the engine refuses at admission (under min_tokens every allowed token ends it) is no workload
    for r in reqs:
        try:
            engine.make_sequence(r.rid, r.prompt, r.params, seed=r.seed)
        except ValueError:
            assume(False)
        note(repr(r))
    outs = drive(engine, reqs)  # invariants after every step, drained at the end
    drafting = bool(cfg.get("num_speculative_tokens"))
    for r in reqs:
        out = outs[r.rid]
        refs = check_samples(engine, r, out, drafting)  # tokens, exit depths, finish reason, text, logprobs, loops
        if r.params.prompt_logprobs is None:
            assert out.prompt_logprobs is None
        elif all(c.finish_reason not in ("abort", "error") for c in out.outputs):
            assert out.prompt_logprobs is not None and len(out.prompt_logprobs) == len(r.prompt)
            assert out.prompt_logprobs[0] is None  # the first prompt token has no logprob
            assert_logprobs_close(out.prompt_logprobs[1:], refs[0].prompt_logprobs[1:])
        for c, ref in zip(out.outputs, refs, strict=True):  # and what only these features set
            if c.finish_reason not in ("abort", "error"):
                want = ref.completion()
                assert c.stop_reason == want.stop_reason
                assert (c.cumulative_logprob is None) == (want.cumulative_logprob is None)
                if c.cumulative_logprob is not None:
                    assert math.isclose(c.cumulative_logprob, want.cumulative_logprob, rel_tol=1e-9, abs_tol=1e-9)


# -- the models: both architectures, MHA and GQA, a lookahead_gate head, two Huginn splits ----------------------
@CROSS
@given(data=st.data())
def test_cross_ouro(data, tiny_ouro):
    check_workload(tiny_ouro, "zero", *data.draw(cross_workloads("ouro", 4)))


@CROSS
@given(data=st.data())
def test_cross_ouro_gqa(data, tiny_ouro_gqa):
    check_workload(tiny_ouro_gqa, "zero", *data.draw(cross_workloads("ouro", 4)))


@CROSS
@given(data=st.data())
def test_cross_ouro_lookahead_gate(data, tiny_ouro_la):
    check_workload(tiny_ouro_la, "zero", *data.draw(cross_workloads("ouro-la", 4)))


@CROSS
@given(data=st.data(), state_init=st.sampled_from(["zero", "like-init"]))
def test_cross_huginn(data, state_init, tiny_huginn):
    check_workload(tiny_huginn, state_init, *data.draw(cross_workloads("huginn", 6)))


@CROSS
@given(data=st.data(), state_init=st.sampled_from(["zero", "like-init"]))
def test_cross_huginn_242(data, state_init, tiny_huginn_242):
    check_workload(tiny_huginn_242, state_init, *data.draw(cross_workloads("huginn", 4)))
