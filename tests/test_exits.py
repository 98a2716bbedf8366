"""Exit policies: the per-item tracker against closed forms, then end to end through the reference
decoder (exit depths, loop accounting, lookahead) on tiny Ouro and Huginn checkpoints."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from loopserve import LLM, SamplingParams
from loopserve.exits import ExitRule
from tests.engine_helpers import huginn_state
from tests.upstream import oracle

pytestmark = pytest.mark.usefixtures("single_thread")

PROMPTS = [[5, 17, 99, 3, 250, 40, 7], [11, 200, 13, 8, 77], [300, 301, 5, 6, 7, 8, 9, 10, 11]]


def drive(rule: ExitRule, signals, decode_index: int = 0) -> tuple[int, int]:
    """Run one work item the way a decoder does; returns (exit depth, loop steps run)."""
    tracker = rule.new_item(decode_index)
    r = 0
    while True:
        r += 1
        if tracker.frozen:  # lookahead: this step ran but its state is discarded
            break
        if not tracker.observe(r, signals[r - 1] if signals is not None else None):
            break
    assert tracker.exit_depth is not None
    return tracker.exit_depth, r


# ---------------- closed forms (written independently of loopserve/exits.py)


def sigmoid(x: float) -> float:
    return 0.5 * (1.0 + math.tanh(x / 2.0))


def gate_depth(logits, q, lo, hi) -> int:
    survive = 1.0
    for r, z in enumerate(logits[:hi], start=1):
        survive *= 1.0 - sigmoid(z)
        if r >= lo and 1.0 - survive >= q:
            return min(r, hi)
    return hi


def below_depth(signals, eps, lo, hi) -> int:
    return next((r for r in range(lo, hi) if signals[r - 1] < eps), hi)


def trace_depth(trace, k, lo, hi) -> int:
    return min(max(trace[k], lo), hi) if k < len(trace) else hi


def loops(depth: int, hi: int, lookahead: bool) -> int:
    return depth + 1 if lookahead and depth < hi else depth


# ---------------- tracker unit tests


def test_fixed_runs_max_loops():
    for lo, hi in ((1, 4), (3, 3), (2, 7)):
        assert drive(ExitRule("fixed", None, lo, hi), [100.0] * hi) == (hi, hi)
        assert drive(ExitRule("fixed", None, lo, hi, lookahead=True), [100.0] * hi) == (hi, hi)


def test_gate_cumulative_hazard_rule():
    # lambdas 0.2, 0.5, 0.5 -> CDF 0.2, 0.6, 0.8
    logits = [math.log(0.2 / 0.8), 0.0, 0.0, 0.0]
    assert drive(ExitRule("gate", 0.15, 1, 4), logits)[0] == 1
    assert drive(ExitRule("gate", 0.5, 1, 4), logits)[0] == 2
    assert drive(ExitRule("gate", 0.7, 1, 4), logits)[0] == 3
    assert drive(ExitRule("gate", 0.85, 1, 4), logits)[0] == 4  # CDF 0.9 at 4, but max_loops anyway
    assert drive(ExitRule("gate", 0.99, 1, 4), logits)[0] == 4  # never reached: max_loops
    assert drive(ExitRule("gate", 1.0, 1, 4), [3.0] * 4)[0] == 4  # threshold 1: full depth (config default)
    # the rule is cumulative, not per-step: no single lambda reaches 0.55 before step 2
    assert drive(ExitRule("gate", 0.55, 1, 4), [0.0, 0.0, 0.0, 0.0])[0] == 2


def test_gate_extreme_logits_do_not_overflow():
    assert drive(ExitRule("gate", 0.5, 1, 4), [-1e4, -800.0, 1e4, 0.0])[0] == 3
    assert drive(ExitRule("gate", 0.5, 1, 4), [-1e4] * 4)[0] == 4


def test_min_and_max_loops_clamp():
    logits = [10.0, 10.0, 10.0, 10.0, 10.0]  # wants to exit at step 1
    assert drive(ExitRule("gate", 0.5, 3, 5), logits)[0] == 3
    assert drive(ExitRule("gate", 0.5, 1, 5), logits)[0] == 1
    never = [-10.0] * 6
    assert drive(ExitRule("gate", 0.9, 1, 2), never)[0] == 2
    # latent_diff below threshold only before min_loops: those steps do not count
    assert drive(ExitRule("latent_diff", 0.1, 3, 6), [0.01, 0.01, 0.5, 0.5, 0.05, 0.5])[0] == 5
    assert drive(ExitRule("latent_diff", 0.1, 3, 4), [0.01, 0.01, 0.5, 0.5])[0] == 4


@pytest.mark.parametrize("policy", ["latent_diff", "kl"])
def test_threshold_policies(policy):
    sig = [1.0, 0.4, 0.2, 0.05, 0.01, 0.001]
    for eps, want in ((0.5, 2), (0.3, 3), (0.1, 4), (0.02, 5), (0.0001, 6), (0.2, 4)):
        assert drive(ExitRule(policy, eps, 1, 6), sig)[0] == want, eps  # strict "<": 0.2 is not < 0.2
    assert drive(ExitRule(policy, None, 1, 6), None)[0] == 6  # no threshold: no signal, full depth
    assert ExitRule(policy, None, 1, 6).signal is None and ExitRule(policy, 0.1, 1, 6).signal == policy


def test_trace_policy_clamps_and_ends_at_full_depth():
    rule = ExitRule("trace", None, 2, 5, trace=(1, 3, 9, 5, 2))
    assert [drive(rule, None, k)[0] for k in range(8)] == [2, 3, 5, 5, 2, 5, 5, 5]
    assert rule.signal is None


def test_delayed_lookahead():
    sig = [1.0, 0.4, 0.2, 0.05]
    plain, la = ExitRule("latent_diff", 0.3, 1, 4), ExitRule("latent_diff", 0.3, 1, 4, lookahead=True)
    assert drive(plain, sig) == (3, 3)
    assert drive(la, sig) == (3, 4)  # decision at 3 -> step 4 runs and is discarded, exit depth 3
    assert drive(la, [1.0, 1.0, 1.0, 1.0]) == (4, 4)  # reaching max_loops costs nothing extra
    la6 = ExitRule("gate", 0.5, 1, 6, lookahead=True)
    assert drive(la6, [5.0] * 6) == (1, 2)
    t = la6.new_item(0)
    assert t.observe(1, 5.0) is True and t.frozen and t.exit_depth == 1


# ---------------- hypothesis properties


signal_lists = st.lists(st.floats(-30, 30, allow_nan=False), min_size=8, max_size=8)


@st.composite
def bounds(draw):
    hi = draw(st.integers(1, 8))
    lo = draw(st.integers(1, hi))
    return lo, hi


@settings(max_examples=300, deadline=None)
@given(signal_lists, st.floats(0.01, 1.0), bounds(), st.booleans())
def test_gate_property(logits, q, lohi, lookahead):
    lo, hi = lohi
    # stay away from CDF == q ties, where two correct roundings may disagree
    surv, cdfs = 1.0, []
    for z in logits:
        surv *= 1.0 - sigmoid(z)
        cdfs.append(1.0 - surv)
    if any(abs(c - q) < 1e-9 for c in cdfs):
        return
    depth, run = drive(ExitRule("gate", q, lo, hi, lookahead=lookahead), logits)
    assert depth == gate_depth(logits, q, lo, hi)
    assert lo <= depth <= hi
    assert run == loops(depth, hi, lookahead)


@settings(max_examples=300, deadline=None)
@given(st.lists(st.floats(0, 2, allow_nan=False), min_size=8, max_size=8), st.floats(0, 2), bounds(),
       st.booleans(), st.sampled_from(["latent_diff", "kl"]))
def test_threshold_property(signals, eps, lohi, lookahead, policy):
    lo, hi = lohi
    depth, run = drive(ExitRule(policy, eps, lo, hi, lookahead=lookahead), signals)
    assert depth == below_depth(signals, eps, lo, hi)
    assert run == loops(depth, hi, lookahead)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(1, 12), max_size=10), st.integers(0, 12), bounds(), st.booleans())
def test_trace_property(trace, k, lohi, lookahead):
    lo, hi = lohi
    depth, run = drive(ExitRule("trace", None, lo, hi, tuple(trace), lookahead), None, k)
    assert depth == trace_depth(trace, k, lo, hi)
    assert run == loops(depth, hi, lookahead)


@settings(max_examples=200, deadline=None)
@given(signal_lists, st.floats(0.01, 1.0), bounds())
def test_gate_depth_is_monotone_in_threshold(logits, q, lohi):
    lo, hi = lohi
    a = drive(ExitRule("gate", q, lo, hi), logits)[0]
    b = drive(ExitRule("gate", min(1.0, q + 0.1), lo, hi), logits)[0]
    assert a <= b


# ---------------- end to end through the reference decoder


def _llm(path, **kw):
    return LLM(model=path, scheduler="reference", dtype="float64", state_init=huginn_state(path), **kw)


def _gen(llm, prompts, **params):
    params.setdefault("temperature", 0)
    params.setdefault("ignore_eos", True)
    return [o.outputs[0] for o in llm.generate(prompts, SamplingParams(**params))]


def test_gate_exits_vary_and_first_item_matches_upstream_cdf(tiny_ouro):
    llm = _llm(tiny_ouro)
    r_max = llm.config.r_max
    config, weights = oracle.load_folder(tiny_ouro)
    varied = False
    for q in (0.3, 0.6, 0.9):
        outs = _gen(llm, PROMPTS, max_tokens=8, exit_threshold=q)
        depths = [d for o in outs for d in o.exit_depths[1:]]
        assert all(o.exit_depths[0] == r_max for o in outs), "prompt tokens never exit early"
        assert all(1 <= d <= r_max for d in depths)
        varied |= len(set(depths)) >= 2
    assert varied, "no threshold produced a mix of exit depths"
    # decode item 0 (fed generated token 0) sees a prompt that ran every depth: its gate CDF is the
    # upstream full-recompute CDF of prompt + [token 0]. Put q between CDF(1) and CDF(2): exit at 2.
    hits = 0
    for prompt in PROMPTS:
        first = _gen(llm, [prompt], max_tokens=1)[0].token_ids[0]
        cdf = oracle.ouro_gate_cdf(config, weights, prompt + [first], r_max)[-1].tolist()
        if not cdf[1] - cdf[0] > 1e-6:
            continue
        q = (cdf[0] + cdf[1]) / 2
        out = _gen(llm, [prompt], max_tokens=3, exit_threshold=q)[0]
        assert out.token_ids[0] == first
        assert out.exit_depths[1] == 2
        hits += 1
    assert hits >= 2


def test_exit_trace_replays_depths(tiny_ouro, tiny_huginn):
    for path in (tiny_ouro, tiny_huginn):
        llm = _llm(path)
        r_max = llm.config.r_max
        trace = [1, 3, 2, r_max, 1, 4]
        clamped = [max(d, 2) for d in trace]  # min_loops bounds the replayed depths
        out = _gen(llm, [PROMPTS[0]], max_tokens=5, exit_trace=trace, min_loops=2)[0]
        assert out.exit_depths[1:] == clamped[:4]
        long = _gen(llm, [PROMPTS[1]], max_tokens=9, exit_trace=trace)[0]
        assert long.exit_depths[1:] == trace + [r_max] * 2  # full depth past the trace's end
        assert long.exit_depths[0] == r_max
        # a depth past r_max is refused as max_loops past it is, naming the entry (it was once clamped)
        with pytest.raises(ValueError, match=rf"^exit_trace\.3: 99 exceeds the model's r_max \({r_max}\)"):
            _gen(llm, [PROMPTS[0]], max_tokens=5, exit_trace=[1, 3, 2, 99, 1, 100])


@pytest.mark.parametrize("fixture,policy,threshold", [("tiny_ouro", "gate", 0.5), ("tiny_huginn", "trace", None)])
def test_loops_run_accounting_and_lookahead(request, fixture, policy, threshold):
    path = request.getfixturevalue(fixture)
    kw = {"exit_threshold": threshold} if policy == "gate" else {"exit_trace": [2, 5, 1, 6, 3, 3, 6, 2]}
    plain, la = _llm(path), _llm(path, lookahead=True)
    r_max = plain.config.r_max
    early = 0
    for prompt in PROMPTS:
        for llm, lookahead in ((plain, False), (la, True)):
            res = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, **kw))[0]
            depths = res.outputs[0].exit_depths[1:]
            assert res.metrics.prefill_loops == r_max * len(prompt)
            extra = sum(1 for d in depths if d < r_max) if lookahead else 0
            assert res.metrics.loops_run == sum(depths) + extra
            early += extra
    assert early > 0, "lookahead never had an early exit to pay for"


def _first_item_kl(path, prompt, token, r_max):
    """KL(p_{r-1} || p_r) for decode item 0, p_0 uniform, from the upstream oracle."""
    config, weights = oracle.load_folder(path)
    ids = prompt + [token]
    if config["architectures"][0] == "OuroForCausalLM":
        states = oracle.ouro_step_states(config, weights, ids, r_max)
        rows = [oracle.linear(s[-1:], weights["lm_head.weight"])[0] for s in states]
    else:  # the coda attends to the prompt's coda KV, which the prefill wrote at full depth
        states = oracle.huginn_core_states(config, weights, ids, r_max)
        rows = []
        for r in range(1, r_max + 1):
            mixed = torch.cat([states[r_max][:-1], states[r][-1:]])
            rows.append(oracle.huginn_predict_from_state(config, weights, mixed)[-1])
    prev = torch.full_like(rows[0], -math.log(rows[0].numel()))
    kls = []
    for row in rows:
        cur = torch.log_softmax(row, -1)
        kls.append(float((prev.exp() * (prev - cur)).sum()))
        prev = cur
    return kls


@pytest.mark.parametrize("fixture", ["tiny_ouro", "tiny_huginn"])
def test_kl_policy(request, fixture):
    path = request.getfixturevalue(fixture)
    llm = _llm(path)
    r_max = llm.config.r_max
    assert all(d == r_max for d in _gen(llm, [PROMPTS[0]], max_tokens=4, exit_policy="kl",
                                        exit_threshold=0.0)[0].exit_depths)  # KL >= 0: never below 0
    huge = _gen(llm, [PROMPTS[0]], max_tokens=4, exit_policy="kl", exit_threshold=1e9, min_loops=2)[0]
    assert huge.exit_depths[1:] == [2, 2, 2]
    hits = 0
    for prompt in PROMPTS:
        first = _gen(llm, [prompt], max_tokens=1)[0].token_ids[0]
        kls = _first_item_kl(path, prompt, first, r_max)[: r_max - 1]  # steps where an exit is possible
        ordered = sorted(kls)
        if ordered[1] - ordered[0] < 1e-6:
            continue
        eps = (ordered[0] + ordered[1]) / 2  # exactly one step is below eps
        want = next(r for r in range(1, r_max) if kls[r - 1] < eps)
        out = _gen(llm, [prompt], max_tokens=3, exit_policy="kl", exit_threshold=eps)[0]
        assert out.token_ids[0] == first
        assert out.exit_depths[1] == want
        hits += 1
    assert hits >= 2


def test_latent_diff_on_huginn(tiny_huginn):
    llm = _llm(tiny_huginn)
    r_max = llm.config.r_max
    config, weights = oracle.load_folder(tiny_huginn)
    diffs = oracle.huginn_latent_diffs(config, weights, PROMPTS[0], r_max)[:, 1:]  # observed at full depth
    eps = float(diffs.median())
    outs = _gen(llm, PROMPTS, max_tokens=8, exit_policy="latent_diff", exit_threshold=eps)
    depths = [d for o in outs for d in o.exit_depths[1:]]
    assert min(depths) < r_max, "threshold from the observed diffs should make tokens exit"
    assert all(1 <= d <= r_max for d in depths)
    # default policy for Huginn is latent_diff
    default = _gen(llm, PROMPTS, max_tokens=8, exit_threshold=eps)
    assert [o.exit_depths for o in default] == [o.exit_depths for o in outs]
    # decode item 0: its diffs are those of the full recompute of prompt + [token 0]
    for prompt in PROMPTS:
        first = _gen(llm, [prompt], max_tokens=1)[0].token_ids[0]
        d = oracle.huginn_latent_diffs(config, weights, prompt + [first], r_max)[-1].tolist()
        ordered = sorted(d[: r_max - 1])
        eps1 = (ordered[0] + ordered[1]) / 2
        want = next(r for r in range(1, r_max) if d[r - 1] < eps1)
        out = _gen(llm, [prompt], max_tokens=2, exit_policy="latent_diff", exit_threshold=eps1)[0]
        assert out.exit_depths[1] == want


def test_gate_policy_rejected_for_huginn(tiny_huginn):
    llm = _llm(tiny_huginn)
    with pytest.raises(ValueError, match="gate"):
        llm.generate([PROMPTS[0]], SamplingParams(max_tokens=2, exit_policy="gate", exit_threshold=0.5))
    with pytest.raises(ValueError, match="max_loops"):
        llm.generate([PROMPTS[0]], SamplingParams(max_tokens=2, max_loops=llm.config.r_max + 1))


@pytest.mark.parametrize("policy, threshold", [("latent_diff", 0.03), ("kl", 5e-4)])
def test_a_state_signal_without_a_threshold_takes_the_upstream_default(tiny_huginn, policy, threshold):
    """latent_diff and kl without exit_threshold use the upstream Huginn code's "auto" values
    (`exits.DEFAULT_THRESHOLDS`), so "the model's own signal" exits early by default as Ouro's gate does; a
    request's own threshold wins, and fixed and trace need none."""
    from loopserve.engine.sequence import resolve_exit_rule
    from loopserve.exits import DEFAULT_THRESHOLDS

    llm = _llm(tiny_huginn)
    assert DEFAULT_THRESHOLDS[policy] == threshold
    rule = resolve_exit_rule(SamplingParams(exit_policy=policy), llm.model, False)
    assert rule.threshold == threshold and rule.signal == policy
    assert resolve_exit_rule(SamplingParams(exit_policy=policy, exit_threshold=0.5), llm.model, False).threshold == 0.5
    if policy == "latent_diff":  # (Huginn's own policy)
        assert resolve_exit_rule(SamplingParams(), llm.model, False).threshold == threshold
    assert resolve_exit_rule(SamplingParams(exit_policy="fixed"), llm.model, False).threshold is None
    same = _gen(llm, PROMPTS, max_tokens=6, exit_policy=policy)
    assert [o.exit_depths for o in same] == [o.exit_depths for o in _gen(llm, PROMPTS, max_tokens=6,
                                                                         exit_policy=policy, exit_threshold=threshold)]


@pytest.mark.parametrize("kw", [dict(exit_policy="fixed"), dict(exit_policy="trace", exit_trace=[1, 2]),
                                dict(exit_trace=[2])])
def test_a_threshold_with_a_rule_that_reads_no_signal_is_refused(kw):
    """fixed and trace compare no signal with a threshold: one given is a ValueError naming it, not ignored."""
    with pytest.raises(ValueError, match="exit_threshold: exit_policy '(fixed|trace)' compares no signal"):
        SamplingParams(exit_threshold=0.5, **kw)
    SamplingParams(**kw)  # (without one: fine)
