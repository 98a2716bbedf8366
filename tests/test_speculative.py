"""Self-speculative decoding (docs/design.md §12): with drafting on, every scheduler x per-depth KV
layout x exit policy gives each request exactly the tokens, exit depths, text and logprobs of the
sequential reference decoder (plain decoding), for greedy and seeded sampling, under KV pressure,
with aborts mid-verification, and in random workloads. Every test checks that drafts were made
(and, where the model agrees with itself, accepted), so none passes with speculation silently off.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from loopserve import LLM, SamplingParams
from loopserve.engine.config import SPECULATIVE_PAUSE as PAUSE
from loopserve.engine.config import SPECULATIVE_WINDOW as WINDOW
from loopserve.engine.config import EngineConfig
from loopserve.engine.reference import ReferenceDecoder
from loopserve.engine.runner import ModelRunner
from loopserve.engine.scheduler import Stage
from loopserve.engine.sequence import Sequence
from loopserve.outputs import RequestOutput
from tests.engine_helpers import Req, assert_logprobs_close, drive, make_engine, reference
from tests.test_engine_exact import MATRIX_CFG, matrix_workload
from tests.test_engine_workloads import HYP, sampling_params
from tests.test_prefix_cache import TIGHT, shared_workload

SCHEDULERS = ("cb", "cdb-norefill", "cdb")
LAYOUTS = ("depth_indexed", "last_exited")
POLICIES = ("fixed", "signal", "trace", "lookahead")
# keep drafting whatever the acceptance: random tiny models agree with their 1-loop selves less often
SPEC = dict(num_speculative_tokens=3, speculative_min_acceptance=0.0)


def assert_same(out: RequestOutput, ref: Sequence) -> None:
    """Tokens, exit depths, text and logprobs of plain decoding (an aborted request: a prefix of them).
    Loops run may differ: they include the loops of rejected verify rows."""
    c = out.outputs[0]
    if c.finish_reason == "abort":
        k = len(c.token_ids)
        assert c.token_ids == ref.output_ids[:k] and c.exit_depths == ref.exit_depths[:k]
        return
    assert (c.token_ids, c.exit_depths, c.finish_reason, c.text) == (
        ref.output_ids, ref.exit_depths, ref.finish_reason, ref.text)
    assert_logprobs_close(c.logprobs, ref.logprobs)


def drafted(engine) -> bool:
    st_ = engine.stats
    return st_.spec_rounds > 0 and st_.spec_draft_tokens >= st_.spec_rounds and st_.ticks[Stage.DRAFT] > 0


# -- the matrix: every scheduler x layout x policy, Ouro and Huginn, a small pool, aborts -----------------------
_REFS: dict[tuple, Sequence] = {}


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("scheduler", SCHEDULERS)
@pytest.mark.parametrize("arch", ["ouro", "huginn"])
def test_matrix_matches_reference(arch, scheduler, layout, policy, tiny_ouro, tiny_huginn):
    path, state_init = (tiny_ouro, "zero") if arch == "ouro" else (tiny_huginn, "like-init")
    engine = make_engine(path, state_init, scheduler=scheduler, kv_layout=layout, lookahead=policy == "lookahead",
                         **MATRIX_CFG, **SPEC)
    reqs = matrix_workload(arch, policy, engine.model_config.r_max)
    outs = drive(engine, reqs)
    for r in reqs:
        key = (arch, layout, policy, r.rid)
        if key not in _REFS:
            _REFS[key] = reference(engine, r)
        assert_same(outs[r.rid], _REFS[key])
    assert drafted(engine)


# -- the embedded model: drafts really get accepted ------------------------------------------------------------
PROMPTS = ["ROMEO:", "JULIET: O Romeo,", "First Citizen:\nBefore we proceed"]


@pytest.fixture(scope="module")
def plain_outputs():
    params = [SamplingParams(temperature=0, max_tokens=24, ignore_eos=True),
              SamplingParams(temperature=0.8, seed=5, max_tokens=20, logprobs=2),
              SamplingParams(temperature=0, max_tokens=16, exit_policy="lookahead_gate", stop=["\n\n"])]
    ref = LLM(dtype="float64", scheduler="reference", seed=3)
    return params, ref.generate(PROMPTS, params)


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("scheduler", SCHEDULERS)
def test_embedded_model_accepts_drafts(scheduler, layout, plain_outputs):
    params, want = plain_outputs
    llm = LLM(dtype="float64", scheduler=scheduler, kv_layout=layout, seed=3, kv_cache_tokens=1024, **SPEC)
    got = llm.generate(PROMPTS, params)
    for g, w in zip(got, want, strict=True):
        gc, wc = g.outputs[0], w.outputs[0]
        assert (gc.token_ids, gc.exit_depths, gc.text, gc.finish_reason) == (
            wc.token_ids, wc.exit_depths, wc.text, wc.finish_reason)
        assert_logprobs_close(gc.logprobs, wc.logprobs)
    st_ = llm.engine.stats
    assert drafted(llm.engine) and st_.spec_accepted_tokens > st_.spec_draft_tokens // 4
    assert st_.spec_tokens <= st_.spec_rounds + st_.spec_accepted_tokens  # fewer where a request stopped
    # by place in the round (vLLM's per-position counter): a draft is accepted only after those before it
    per_pos = st_.spec_accepted_per_pos
    assert len(per_pos) == SPEC["num_speculative_tokens"] and sum(per_pos) == st_.spec_accepted_tokens
    assert per_pos == sorted(per_pos, reverse=True) and per_pos[0] <= st_.spec_rounds
    # a verify row's exit depth is published only for emitted tokens: the stats equal the outputs'
    decode = [d for o in got for d in o.outputs[0].exit_depths[1:]]
    assert sum(st_.exit_depths.values()) == len(decode)
    assert llm.engine.kv_usage() == 0


# -- random workloads -------------------------------------------------------------------------------------------
@st.composite
def spec_workloads(draw, arch: str, r_max: int):
    block = draw(st.sampled_from([2, 4]))
    chunk = draw(st.sampled_from([3, 5, 8]))
    cfg = dict(scheduler=draw(st.sampled_from(SCHEDULERS)), kv_layout=draw(st.sampled_from(LAYOUTS)),
               block_size=block, kv_cache_tokens=block * draw(st.integers(16 // block, 36 // block)),
               max_num_seqs=draw(st.integers(2, 6)), max_decode_batch=draw(st.integers(2, 6)),
               prefill_chunk_size=chunk, max_num_batched_tokens=chunk * draw(st.integers(1, 2)),
               min_coda_batch=draw(st.integers(1, 3)), lookahead=draw(st.booleans()),
               async_coda=draw(st.booleans()), kv_safety_margin=draw(st.sampled_from([0.0, 0.1, 0.3])),
               cuda_graphs=draw(st.booleans()), pipeline_core_steps=draw(st.booleans()),
               enable_prefix_caching=draw(st.booleans()),
               num_speculative_tokens=draw(st.integers(1, 4)),
               # a draft as deep as the request's own depth is accepted (fixed depth, greedy): long rounds
               speculative_draft_loops=draw(st.sampled_from([1, 2, r_max])),
               speculative_max_batch=draw(st.sampled_from([2, 8, 64])),
               speculative_min_acceptance=draw(st.sampled_from([0.0, 0.0, 0.5])))
    reqs = []
    for i in range(draw(st.integers(1, 6))):
        prompt = draw(st.lists(st.integers(1, 470), min_size=1, max_size=12))
        arrive = draw(st.integers(0, 10))
        abort_at = arrive + draw(st.sampled_from([1, 4, 9, 15])) if draw(st.integers(0, 3)) == 0 else None
        reqs.append(Req(f"w{i}", prompt, draw(sampling_params(arch, r_max)), draw(st.integers(0, 2**40)),
                        arrive, abort_at))
    return cfg, reqs


def check_workload(path, state_init: str, cfg: dict, reqs: list[Req]) -> None:
    engine = make_engine(path, state_init, **cfg)
    outs = drive(engine, reqs)  # invariants after every step, drained at the end
    for r in reqs:
        out, ref = outs[r.rid], reference(engine, r)
        if out.outputs[0].finish_reason == "error":  # only a request that cannot fit in the whole pool fails
            assert out.error and "KV cache" in out.error
            assert out.outputs[0].token_ids == ref.output_ids[: len(out.outputs[0].token_ids)]
            continue
        assert_same(out, ref)


@HYP
@given(data=st.data())
def test_random_workloads_ouro(data, tiny_ouro):
    cfg, reqs = data.draw(spec_workloads("ouro", 4))
    check_workload(tiny_ouro, "zero", cfg, reqs)


@HYP
@given(data=st.data())
def test_random_workloads_ouro_lookahead_gate(data, tiny_ouro_la):
    cfg, reqs = data.draw(spec_workloads("ouro-la", 4))
    check_workload(tiny_ouro_la, "zero", cfg, reqs)


@HYP
@given(data=st.data(), state_init=st.sampled_from(["zero", "like-init"]))
def test_random_workloads_huginn(data, state_init, tiny_huginn):
    cfg, reqs = data.draw(spec_workloads("huginn", 6))
    check_workload(tiny_huginn, state_init, cfg, reqs)


# -- preemption, aborts mid-verification ------------------------------------------------------------------------
@pytest.mark.parametrize("scheduler", SCHEDULERS)
def test_preemption_under_kv_pressure(scheduler, tiny_ouro):
    engine = make_engine(tiny_ouro, scheduler=scheduler, block_size=2, kv_cache_tokens=28, max_decode_batch=4,
                         kv_safety_margin=0.0, **SPEC)
    reqs = [Req(f"p{i}", [(31 * i + 3 * j) % 400 + 1 for j in range(3 + 2 * i)],
                SamplingParams(temperature=0.8 * (i % 2), max_tokens=9, ignore_eos=True, exit_threshold=0.6),
                seed=i, arrive=i)
            for i in range(4)]
    outs = drive(engine, reqs)
    assert engine.stats.preemptions > 0 and engine.stats.swap_ins > 0 and drafted(engine)
    for r in reqs:
        assert outs[r.rid].outputs[0].finish_reason == "length"
        assert_same(outs[r.rid], reference(engine, r))


@pytest.mark.parametrize("stage", ["prelude", "core", "coda"])
@pytest.mark.parametrize("scheduler", SCHEDULERS)
def test_abort_mid_verification(scheduler, stage, tiny_ouro, monkeypatch):
    """Abort a request while its verify group waits for its prelude, loops, or waits for its coda: its KV
    blocks and state rows are freed, its neighbour is untouched."""
    if scheduler == "cdb" and stage == "prelude":
        # CDB takes a group's preludes in the tick that drafted it (its drafts fit the rows left), so a
        # group waits in the queue between steps only when that fails (KV pressure): make it wait here
        from loopserve.engine.scheduler import CDBScheduler

        real = CDBScheduler.follow_up
        monkeypatch.setattr(CDBScheduler, "follow_up",
                            lambda self, plan: None if plan.stage is Stage.DRAFT else real(self, plan))
    engine = make_engine(tiny_ouro, scheduler=scheduler, max_decode_batch=4, min_coda_batch=1, **SPEC)
    victim = Req("v", [7, 8, 9], SamplingParams(temperature=0, max_tokens=30, ignore_eos=True,
                                                exit_trace=[1, 4, 2, 3] * 8), seed=0)
    other = Req("o", [5, 6], SamplingParams(temperature=0.7, max_tokens=12, ignore_eos=True), seed=1)
    engine.add_request(victim.rid, victim.prompt, victim.params, seed=victim.seed)
    engine.add_request(other.rid, other.prompt, other.params, seed=other.seed)
    sched = engine.scheduler
    queue = {"prelude": lambda: sched.prelude_q, "core": lambda: sched.core_q, "coda": lambda: sched.coda_q}[stage]
    for _ in range(400):
        engine.step()
        sched.check_invariants()
        if any(i.group is not None and i.seq.request_id == "v" for i in queue()):
            break
    else:
        pytest.fail(f"no verify group of the victim reached the {stage} queue")
    engine.abort_request("v")
    outs = {o.request_id: o for o in engine.step() if o.finished}
    while engine.has_unfinished_requests():
        outs.update({o.request_id: o for o in engine.step() if o.finished})
        sched.check_invariants()
    sched.check_drained()
    assert outs["v"].outputs[0].finish_reason == "abort"
    assert_same(outs["v"], reference(engine, victim))
    assert_same(outs["o"], reference(engine, other))


# -- when speculation stays off ----------------------------------------------------------------------------------
def test_shared_layout_is_refused():
    with pytest.raises(ValueError, match="num_speculative_tokens: .*shared"):
        EngineConfig(kv_layout="shared", num_speculative_tokens=2)
    for name in ("num_speculative_tokens", "speculative_draft_loops", "speculative_max_batch"):
        with pytest.raises(ValueError, match=name):
            EngineConfig(**{name: -1})
    with pytest.raises(ValueError, match="speculative_min_acceptance"):
        EngineConfig(speculative_min_acceptance=1.5)
    with pytest.raises(ValueError, match="^num_speculative_tokens: must be an integer"):
        EngineConfig(num_speculative_tokens=True)  # (a bool is not a count)


def test_draft_loops_past_the_models_r_max_are_refused(tiny_ouro):
    """A draft runs at most the model's loops: more was clamped without a word."""
    with pytest.raises(ValueError, match=r"^speculative_draft_loops: at most the model's r_max \(4\), got 5"):
        make_engine(tiny_ouro, num_speculative_tokens=2, speculative_draft_loops=5)
    make_engine(tiny_ouro, num_speculative_tokens=2, speculative_draft_loops=4)


def test_requests_that_cannot_draft_run_plainly(tiny_ouro, tiny_huginn):
    """Penalties and min_tokens read the tokens before each position; KL exits on a model with coda
    layers read intermediate coda KV; num_speculative_tokens=0 asks for no drafts. Such requests decode
    plainly, with the same outputs."""
    cases = [(tiny_ouro, SamplingParams(temperature=0, max_tokens=8, presence_penalty=0.5)),
             (tiny_ouro, SamplingParams(temperature=0.5, max_tokens=8, min_tokens=3, seed=2)),
             (tiny_huginn, SamplingParams(temperature=0, max_tokens=6, exit_policy="kl", exit_threshold=0.01)),
             (tiny_ouro, SamplingParams(temperature=0, max_tokens=8, num_speculative_tokens=0))]
    for path, params in cases:
        engine = make_engine(path, scheduler="cdb", **SPEC)
        req = Req("x", [4, 5, 6], params, seed=3)
        outs = drive(engine, [req])
        assert engine.stats.spec_rounds == 0 and engine.stats.ticks[Stage.DRAFT] == 0
        assert_same(outs["x"], reference(engine, req))


# -- per request: SamplingParams.num_speculative_tokens ---------------------------------------------------------
def draft_widths(engine) -> dict[str, int]:
    """request -> the most drafts one of its verify groups held, read from the scheduler's queues at every
    stage batch (a group runs at least one core step, so every group is seen)."""
    widths: dict[str, int] = {}

    def hook(_record) -> None:
        s = engine.scheduler
        for item in (*s.prelude_q, *s.core_q, *s.coda_q, *s.coda_running):
            if item.group is not None:
                rid = item.seq.request_id
                widths[rid] = max(widths.get(rid, 0), len(item.group.drafts))

    engine.stage_hooks.append(hook)
    return widths


@pytest.mark.parametrize("scheduler", SCHEDULERS)
def test_per_request_draft_counts(scheduler, tiny_ouro):
    """One batch, the engine drafting 3: a request without a setting drafts 3, one asking for 2 or 1 drafts
    at most that, one asking for 0 never drafts; every output is plain decoding's."""
    engine = make_engine(tiny_ouro, scheduler=scheduler, max_decode_batch=16, max_num_seqs=16, **SPEC)
    widths = draft_widths(engine)
    asked = {"unset": None, "zero": 0, "one": 1, "two": 2, "three": 3}
    reqs = [Req(rid, [7 + i, 8, 9], SamplingParams(temperature=0.8 * (i % 2), seed=i, max_tokens=14, ignore_eos=True,
                                                   num_speculative_tokens=k), seed=i)
            for i, (rid, k) in enumerate(asked.items())]
    outs = drive(engine, reqs)
    for r in reqs:
        assert_same(outs[r.rid], reference(engine, r))
    assert widths == {"unset": 3, "one": 1, "two": 2, "three": 3}


def test_a_request_drafts_at_most_what_it_asks_for(tiny_ouro):
    """On an engine drafting 3, a request asking for 1 drafts exactly one token every round."""
    engine = make_engine(tiny_ouro, scheduler="cdb", **SPEC)
    req = Req("a", [9, 10, 11], SamplingParams(temperature=0, max_tokens=20, ignore_eos=True,
                                               num_speculative_tokens=1), seed=0)
    out = drive(engine, [req])["a"]
    assert_same(out, reference(engine, req))
    st_ = engine.stats
    assert drafted(engine) and st_.spec_draft_tokens == st_.spec_rounds


def test_asking_for_more_drafts_than_the_engine_is_refused(tiny_ouro):
    """A request may ask for at most the engine's num_speculative_tokens (none when it is off); the refusal
    names the field and the knob that turns speculation on, and nothing is admitted."""
    for engine_k, asked in [(2, 3), (0, 1)]:
        engine = make_engine(tiny_ouro, scheduler="cdb", num_speculative_tokens=engine_k)
        with pytest.raises(ValueError, match=rf"^num_speculative_tokens: {asked} .*--num-speculative-tokens"):
            engine.add_request("x", [4, 5], SamplingParams(max_tokens=4, num_speculative_tokens=asked))
        assert not engine.requests and not engine.has_unfinished_requests()
        engine.add_request("y", [4, 5], SamplingParams(max_tokens=4, num_speculative_tokens=engine_k))  # at most k
        engine.add_request("z", [4, 5], SamplingParams(max_tokens=4, num_speculative_tokens=0))
        engine.run_to_completion()
    # the offline LLM checks the same, whatever its scheduler
    with pytest.raises(ValueError, match="^num_speculative_tokens: 1 .*off"):
        LLM(tiny_ouro, scheduler="reference").generate([[4, 5]], SamplingParams(max_tokens=2, num_speculative_tokens=1))


def test_low_acceptance_and_full_batches_turn_drafting_off(tiny_ouro):
    """A request that accepts under the minimum over its last rounds pauses drafting; no request drafts
    while `speculative_max_batch` sequences are resident."""
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    engine = make_engine(tiny_ouro, scheduler="cdb", num_speculative_tokens=3, speculative_min_acceptance=1.0)
    outs = drive(engine, [Req("a", [9, 10, 11], params, seed=0)])
    st_ = engine.stats
    assert st_.spec_accepted_tokens < st_.spec_draft_tokens  # the tiny random model disagrees with itself
    assert st_.spec_rounds >= WINDOW
    assert 39 - st_.spec_tokens >= PAUSE  # paused once a window fell short (one miss is enough)
    assert len(outs["a"].outputs[0].token_ids) == 40
    engine = make_engine(tiny_ouro, scheduler="cdb", speculative_max_batch=2, **SPEC)
    resident: list[int] = []  # sequences resident at each DRAFT batch
    engine.stage_hooks.append(lambda rec: resident.append(len(engine.scheduler.running))
                              if rec.stage is Stage.DRAFT else None)
    reqs = [Req(f"b{i}", [9 + i, 10], SamplingParams(temperature=0, max_tokens=12 + 14 * i, ignore_eos=True),
                seed=i) for i in range(3)]
    outs = drive(engine, reqs)
    assert resident and max(resident) < 2  # drafting only once two of the three finished
    for r in reqs:
        assert_same(outs[r.rid], reference(engine, r))


@pytest.mark.parametrize("scheduler", SCHEDULERS)
def test_parallel_samples_draft(scheduler, tiny_ouro):
    """n > 1: each sample drafts and verifies on its own (sharing the prompt's blocks)."""
    engine = make_engine(tiny_ouro, scheduler=scheduler, max_decode_batch=6, **SPEC)
    reqs = [Req("n", [3, 4, 5, 6, 7], SamplingParams(temperature=0.9, seed=4, n=3, max_tokens=10, ignore_eos=True),
                seed=0),
            Req("g", [8, 9], SamplingParams(temperature=0, n=2, max_tokens=8, ignore_eos=True), seed=1, arrive=2)]
    outs = drive(engine, reqs)
    assert drafted(engine)
    for r in reqs:
        head = engine.make_sequence(r.rid, r.prompt, r.params, seed=r.seed)
        for c, sample in zip(outs[r.rid].outputs, head.family, strict=True):
            ref = ReferenceDecoder(engine.model, engine.layout, engine.cfg.prefill_chunk_size).run(sample)
            assert (c.token_ids, c.exit_depths, c.finish_reason) == (ref.output_ids, ref.exit_depths,
                                                                     ref.finish_reason)


# -- rounds that accept drafts: stops inside them; shared prefixes; a fault in a verify group -------------------
# a draft as deep as a fixed-depth greedy request computes exactly what its verifier computes: every draft
# is accepted, so rounds emit k + 1 tokens and a stop can fall anywhere inside one (draft loops: the models' r_max,
# tiny_huginn's 6; tiny_ouro's 4, set where it runs)
DEEP = dict(num_speculative_tokens=4, speculative_draft_loops=6, speculative_min_acceptance=0.0)
OURO_DEEP = {**DEEP, "speculative_draft_loops": 4}


@pytest.mark.parametrize("scheduler", SCHEDULERS)
@pytest.mark.parametrize("arch", ["ouro", "huginn"])
def test_stops_inside_accepted_rounds(arch, scheduler, tiny_ouro, tiny_huginn):
    """A stop token, a stop string or max_tokens reached in the middle of an accepted round ends the
    request there, exactly as plain decoding does (text, exit depths, logprobs included)."""
    path, state_init = (tiny_ouro, "zero") if arch == "ouro" else (tiny_huginn, "like-init")
    # room for all three requests' groups of k + 1 = 5 rows in one batch (drafts only take rows left)
    engine = make_engine(path, state_init, scheduler=scheduler, max_decode_batch=15, max_num_seqs=15,
                         **(OURO_DEEP if arch == "ouro" else DEEP))
    base = dict(temperature=0, exit_policy="fixed", ignore_eos=True, logprobs=1)
    free = reference(engine, Req("s", [5, 6, 7], SamplingParams(max_tokens=20, **base), seed=1)).output_ids
    stop_tok = free[6]  # inside the second round (tokens 1..5 come from the first verify pass)
    text = engine.tokenizer.decode([free[8]])
    stops = [SamplingParams(max_tokens=20, stop_token_ids=[stop_tok], **base),
             SamplingParams(max_tokens=7, **base)]
    if text.strip():
        stops.append(SamplingParams(max_tokens=20, stop=[text.strip()[0]], **base))
    reqs = [Req(f"s{i}", [5, 6, 7], p, seed=1, arrive=i) for i, p in enumerate(stops)]
    outs = drive(engine, reqs)
    for r in reqs:
        assert_same(outs[r.rid], reference(engine, r))
    assert outs["s0"].outputs[0].finish_reason == "stop" and len(outs["s0"].outputs[0].token_ids) <= 7
    st_ = engine.stats
    assert drafted(engine) and st_.spec_accepted_tokens == st_.spec_draft_tokens
    assert st_.spec_tokens < st_.spec_rounds + st_.spec_accepted_tokens  # some round was cut by a stop


@pytest.mark.parametrize("scheduler", SCHEDULERS)
def test_shared_prefixes_under_kv_pressure(scheduler, tiny_ouro):
    """Prefix-cache hits, prompt logprobs, aborts, preemption and eviction (test_prefix_cache's workload
    on its tight pool) with rounds that accept drafts."""
    engine = make_engine(tiny_ouro, scheduler=scheduler, **TIGHT, **OURO_DEEP)
    reqs = shared_workload("ouro", "fixed", engine.model_config.r_max, longer=8)
    outs = drive(engine, reqs)
    for r in reqs:
        assert_same(outs[r.rid], reference(engine, r))
    st_ = engine.stats
    assert st_.prefix_cache_hits > 0 and st_.preemptions > 0 and drafted(engine) and st_.spec_accepted_tokens > 0


def test_nan_in_a_verify_group_fails_that_request_alone(tiny_ouro, monkeypatch):
    """docs/design.md §10 with speculation: NaN in one request's state reaches every later row of its
    verify group (they attend to its KV); the request fails alone, the engine and its neighbour go on."""
    real_core = ModelRunner.core

    def core(self, rows):
        for row in rows.tolist():
            it = self.pool.items[row]
            if it.seq.request_id == "v" and it.group is not None and it.r >= 1 and len(it.seq.output_ids) >= 2:
                self.pool.state[int(self.pool.state_rows(np.array([row]))[0])] = float("nan")
        return real_core(self, rows)

    monkeypatch.setattr(ModelRunner, "core", core)
    engine = make_engine(tiny_ouro, scheduler="cdb", **OURO_DEEP)
    gate = dict(temperature=0, max_tokens=12, ignore_eos=True, exit_policy="gate", exit_threshold=0.6)
    reqs = [Req("v", [5, 9, 2, 7], SamplingParams(**gate), seed=1), Req("o", [3, 4], SamplingParams(**gate), seed=2)]
    outs = drive(engine, reqs)
    assert outs["v"].outputs[0].finish_reason == "error" and "non-finite" in outs["v"].error
    assert_same(outs["o"], reference(engine, reqs[1]))


@pytest.mark.parametrize("lookahead", [False, True])
@pytest.mark.parametrize("scheduler", SCHEDULERS)
def test_a_failing_rejected_draft_does_not_fail_the_request(scheduler, lookahead, tiny_ouro, monkeypatch, caplog):
    """Drafts are guesses, so exactness must hold whatever they are. Token X is poison (its state
    is NaN, as an overflow on a rare token would be) and the request bans it with logit_bias, so
    plain decoding never feeds it; every draft proposes X anyway. Each verify row fed X fails: the
    round is cut there and goes on, and the request ends as plain decoding does, not with an error.
    With lookahead the failing signal is read a tick late, after the next step was queued with the
    cut rows in it."""
    from loopserve.engine import runner as runner_module

    x = 77
    engine = make_engine(tiny_ouro, scheduler=scheduler, lookahead=lookahead, **SPEC)
    real_prelude, real_get = engine.model.prelude, runner_module.PendingDrafts.get

    def prelude(ids, ctx, seeds=None):
        state, inject = real_prelude(ids, ctx, seeds)
        return state.masked_fill((ids == x)[:, None], float("nan")), inject

    monkeypatch.setattr(engine.model, "prelude", prelude)
    monkeypatch.setattr(runner_module.PendingDrafts, "get", lambda self: [[x] * len(d) for d in real_get(self)])
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, exit_policy="gate", exit_threshold=0.6,
                            logit_bias={x: -100.0})
    reqs = [Req("a", [5, 6, 7], params, seed=1), Req("b", [9, 4], params, seed=2)]
    outs = drive(engine, reqs)
    monkeypatch.undo()  # the reference runs the real model
    for r in reqs:
        assert outs[r.rid].outputs[0].finish_reason == "length", outs[r.rid].error
        assert_same(outs[r.rid], reference(engine, r))
    assert any("its round is cut there" in rec.getMessage() for rec in caplog.records), "no verify row failed"


def test_drafts_follow_logit_bias(tiny_ouro):
    """A request whose logit_bias forces one token: plain decoding emits only that token, and so do the
    drafts (they apply the bias too), so every draft is accepted."""
    engine = make_engine(tiny_ouro, scheduler="cdb", **SPEC)
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, exit_policy="fixed", logit_bias={42: 100.0})
    req = Req("a", [5, 6, 7], params, seed=1)
    out = drive(engine, [req])["a"]
    assert_same(out, reference(engine, req))
    assert out.outputs[0].token_ids == [42] * 12
    st_ = engine.stats
    assert drafted(engine) and st_.spec_accepted_tokens == st_.spec_draft_tokens


# -- verify groups and batch width -------------------------------------------------------------------------------
@pytest.mark.parametrize("scheduler", SCHEDULERS)
def test_drafts_fit_the_rows_left(scheduler, tiny_ouro, monkeypatch):
    """A DRAFT batch drafts only as many tokens as its verify groups can take rows in the batch they join
    (FIFO, a group a row per position): in a cohort of 4 rows, one request drafts 3 tokens, not three."""
    real = ModelRunner.draft
    rows: list[int] = []

    def draft(self, items, lens, loops):
        rows.append(len(items) + sum(lens))
        return real(self, items, lens, loops)

    monkeypatch.setattr(ModelRunner, "draft", draft)
    engine = make_engine(tiny_ouro, scheduler=scheduler, max_decode_batch=4, max_num_seqs=4, **SPEC)
    reqs = [Req(f"w{i}", [7 + i, 8, 9], SamplingParams(temperature=0, max_tokens=10, ignore_eos=True), seed=i)
            for i in range(3)]
    outs = drive(engine, reqs)
    assert rows and max(rows) <= 4
    for r in reqs:
        assert_same(outs[r.rid], reference(engine, r))


@pytest.mark.parametrize("scheduler", SCHEDULERS)
def test_a_group_wider_than_the_rows_left_is_trimmed_not_waited_for(scheduler, tiny_ouro, monkeypatch):
    """When a queued verify group is wider than the rows a prelude batch has left (rows taken between its
    draft and its prelude), its first rows go in and its last drafts are dropped, instead of the whole
    queue waiting behind it. Outputs stay plain decoding's."""
    from loopserve.engine.scheduler import Scheduler

    real = Scheduler._prelude_plan
    trims: list[tuple[int, int]] = []  # (group rows before, rows taken of it)

    def take(self, limit):
        head = self.prelude_q[0] if self.prelude_q else None
        group = head.group if head is not None else None
        if group is not None and len(group.items) > 1 and len(self.prelude_q) > len(group.items):
            before = len(group.items)
            limit = min(limit, before - 1)  # one row short for the group at the head
            plan = real(self, limit)
            trims.append((before, len(group.items)))
            assert plan.items[: len(group.items)] == group.items and len(group.items) == before - 1
            return plan
        return real(self, limit)

    monkeypatch.setattr(Scheduler, "_prelude_plan", take)
    engine = make_engine(tiny_ouro, scheduler=scheduler, max_decode_batch=6, max_num_seqs=6, **SPEC)
    reqs = [Req(f"t{i}", [5 + i, 6, 7], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True), seed=i)
            for i in range(3)]
    outs = drive(engine, reqs)
    assert trims and engine.stats.spec_draft_tokens > engine.stats.spec_accepted_tokens >= 0
    for r in reqs:
        assert_same(outs[r.rid], reference(engine, r))


@pytest.mark.parametrize("scheduler", SCHEDULERS)
def test_a_verify_group_takes_its_drafting_items_place(scheduler, tiny_ouro, monkeypatch):
    """A verify group enters the prelude queue where the item that drafted it was (the rows its drafts
    were sized for), so groups are not trimmed for want of rows that items behind them took."""
    from loopserve.engine.scheduler import Scheduler

    real_after, real_trim = Scheduler.after_draft, Scheduler._trim_queued_group
    trims: list[int] = []

    def after_draft(self, plan, drafts):
        before = [i.seq.request_id for i in self.prelude_q if i.group is None or i is i.group.items[0]]
        real_after(self, plan, drafts)
        after = [i.seq.request_id for i in self.prelude_q if i.group is None or i is i.group.items[0]]
        assert after == before  # every group's first row where its item was, nothing reordered

    def trim(self, group, n):
        trims.append(len(group.items) - n)
        return real_trim(self, group, n)

    monkeypatch.setattr(Scheduler, "after_draft", after_draft)
    monkeypatch.setattr(Scheduler, "_trim_queued_group", trim)
    engine = make_engine(tiny_ouro, scheduler=scheduler, max_decode_batch=8, max_num_seqs=8, min_coda_batch=1, **SPEC)
    reqs = [Req(f"w{i}", [7 + i, 8, 9], SamplingParams(temperature=0, max_tokens=20, ignore_eos=True), seed=i)
            for i in range(3)]
    outs = drive(engine, reqs)
    assert drafted(engine) and not trims
    for r in reqs:
        assert_same(outs[r.rid], reference(engine, r))
