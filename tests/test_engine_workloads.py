"""Random workloads against `LLMEngine` (Hypothesis): requests with random prompts (some the head of an
earlier one: prefix caching, on by default, shares their full blocks) and sampling / exit parameters
arrive at random steps, some are aborted, and the KV pool is small. After every
step the scheduler's invariants hold; at the end every request finished, queues are empty and all
KV blocks and state rows are free; every request that was not aborted equals the sequential
reference decoder's output (float64), and loops run equal the exit depths.

Also: preemption really happens and changes nothing; a prompt that can never fit, or a generation
that outgrows the whole pool, fails that request alone with a clear error.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from loopserve import LLM, SamplingParams
from loopserve.engine.reference import ReferenceDecoder
from loopserve.engine.runner import WorkItem
from loopserve.engine.sequence import Sequence
from loopserve.sampling_params import RequestOutputKind
from tests.engine_helpers import (
    Req,
    assert_logprobs_close,
    assert_matches,
    drive,
    expected_loops,
    make_engine,
    reference,
)

SCHEDULERS = ("cb", "cdb-norefill", "cdb")
LAYOUTS = ("depth_indexed", "last_exited", "shared")
HYP = settings(max_examples=25, deadline=None, database=None,
               suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])




# -- strategies ------------------------------------------------------------------------------------------
@st.composite
def sampling_params(draw, arch: str, r_max: int) -> SamplingParams:
    kw: dict = dict(max_tokens=draw(st.sampled_from([1, 3, 6, 8, 10, 10])), ignore_eos=draw(st.booleans()),
                    # (max_num_seqs is 2-5: a pair is admitted together, 7 samples come in parts)
                    n=draw(st.sampled_from([1, 1, 1, 2, 7])))
    temperature = draw(st.sampled_from([0.0, 0.0, 0.7, 1.0]))
    kw["temperature"] = temperature
    if temperature and draw(st.booleans()):
        kw["seed"] = draw(st.integers(0, 1000))
    if temperature and draw(st.booleans()):
        kw["top_k"] = draw(st.sampled_from([5, 50]))
    if temperature and draw(st.booleans()):
        kw["top_p"] = draw(st.sampled_from([0.3, 0.9, 1 - 1e-12]))
    if draw(st.booleans()):  # one output at the end: plain tokens take the coda's short path
        kw["output_kind"] = RequestOutputKind.FINAL_ONLY
    if draw(st.integers(0, 3)) == 0:
        kw["logprobs"] = draw(st.integers(0, 3))
    max_loops = draw(st.one_of(st.none(), st.integers(2, r_max)))
    kw["max_loops"] = max_loops
    if draw(st.integers(0, 3)) == 0:
        kw["min_loops"] = draw(st.integers(1, max_loops or r_max))
    policy = draw(st.sampled_from(["default", "fixed", "trace", "signal", "signal", "kl"]))
    if policy == "fixed":
        kw["exit_policy"] = "fixed"
    elif policy == "trace":
        kw["exit_trace"] = draw(st.lists(st.integers(1, r_max), max_size=10))  # (past r_max: refused)
    elif policy == "signal" and arch == "ouro-la":  # rules that decide ahead next to ones that do not
        kw.update(exit_policy=draw(st.sampled_from(["lookahead_gate", "gate"])),
                  exit_threshold=draw(st.sampled_from([0.3, 0.6, 0.9])))
    elif policy == "signal" and arch == "ouro":
        kw.update(exit_policy="gate", exit_threshold=draw(st.sampled_from([0.3, 0.6, 0.9, 1.0])))
    elif policy == "signal":
        kw.update(exit_policy="latent_diff", exit_threshold=draw(st.sampled_from([0.5, 0.8, 0.9])))
    elif policy == "kl":
        kw.update(exit_policy="kl", exit_threshold=draw(st.sampled_from([0.003, 0.01, 0.05])))
    return SamplingParams(**kw)


@st.composite
def workloads(draw, arch: str, r_max: int):
    block = draw(st.sampled_from([2, 4]))
    chunk = draw(st.sampled_from([3, 5, 8]))
    cfg = dict(scheduler=draw(st.sampled_from(SCHEDULERS)), kv_layout=draw(st.sampled_from(LAYOUTS)),
               block_size=block, kv_cache_tokens=block * draw(st.integers(12 // block, 28 // block)),
               max_num_seqs=draw(st.integers(2, 5)), max_decode_batch=(width := draw(st.integers(1, 4))),
               prefill_chunk_size=chunk, max_num_batched_tokens=chunk * draw(st.integers(1, 2)),
               min_coda_batch=draw(st.integers(1, 3)), min_prelude_batch=draw(st.integers(1, min(3, width))),
               lookahead=draw(st.booleans()), async_coda=draw(st.booleans()), cuda_graphs=draw(st.booleans()),
               kv_safety_margin=draw(st.sampled_from([0.0, 0.1, 0.3])))
    reqs: list[Req] = []
    for i in range(draw(st.integers(2, 8))):
        prompt = draw(st.lists(st.integers(1, 470), min_size=1, max_size=14))
        if reqs and draw(st.integers(0, 2)) == 0:  # an earlier prompt's head: full blocks the prefix cache shares
            head = draw(st.sampled_from(reqs)).prompt
            prompt = head[:draw(st.integers(1, len(head)))] + prompt[:draw(st.integers(0, 4))]
        arrive = draw(st.integers(0, 12))
        aborted = draw(st.integers(0, 3)) == 0
        abort_at = arrive + draw(st.sampled_from([0, 1, 5, 12, 25])) if aborted else None
        reqs.append(Req(f"w{i}", prompt, draw(sampling_params(arch, r_max)), draw(st.integers(0, 2**40)),
                        arrive, abort_at))
    return cfg, reqs


def check_workload(path, state_init: str, cfg: dict, reqs: list[Req]) -> None:
    engine = make_engine(path, state_init, **cfg)
    outs = drive(engine, reqs)  # invariants after every step, drained at the end
    blocks_for, num_blocks = engine.kv.allocator.blocks_for, engine.kv.num_blocks
    for r in reqs:
        if r.params.n > 1:
            check_samples(engine, r, outs[r.rid])
            continue
        out, ref = outs[r.rid], reference(engine, r)
        c = out.outputs[0]
        assert c.finish_reason in ("stop", "length", "abort", "error")
        if c.finish_reason == "error":  # only a request that cannot fit in the whole pool fails
            assert out.error and "KV cache" in out.error
            assert blocks_for(len(r.prompt) + max(len(c.token_ids), 1)) > num_blocks
            assert c.token_ids == ref.output_ids[: len(c.token_ids)]
            continue
        if c.finish_reason != "abort":
            assert out.metrics.loops_run == expected_loops(ref)
        assert_matches(out, ref)


def check_samples(engine, r: Req, out, drafting: bool = False) -> list[Sequence]:
    """A request's samples (n >= 1): each equals the reference decoder run on it alone (an aborted or failed one
    is a prefix of it; a failure is the pool's, which cannot hold the samples together); the request's loops
    are its samples' when none was cut short (unless `drafting`: speculative decoding's rejected verify rows ran
    loops too). Returns the reference runs, in sample order."""
    dec = ReferenceDecoder(engine.model, engine.layout, engine.cfg.prefill_chunk_size)
    refs = [dec.run(s) for s in engine.make_sequence(r.rid, r.prompt, r.params, seed=r.seed).family]
    assert [c.index for c in out.outputs] == list(range(r.params.n))
    for c, ref in zip(out.outputs, refs, strict=True):
        k = len(c.token_ids)
        assert (c.token_ids, c.exit_depths) == (ref.output_ids[:k], ref.exit_depths[:k])
        if c.finish_reason == "error":
            assert out.error and "KV cache" in out.error
        elif c.finish_reason != "abort":
            assert (c.finish_reason, k, c.text) == (ref.finish_reason, len(ref.output_ids), ref.text)
            assert_logprobs_close(c.logprobs, ref.logprobs)
    if not drafting and all(c.finish_reason in ("stop", "length") for c in out.outputs):
        assert out.metrics.loops_run == sum(expected_loops(ref) for ref in refs)
    return refs


@HYP
@given(data=st.data())
def test_random_workloads_ouro(data, tiny_ouro):
    cfg, reqs = data.draw(workloads("ouro", 4))
    check_workload(tiny_ouro, "zero", cfg, reqs)


@HYP
@given(data=st.data())
def test_random_workloads_ouro_lookahead_gate(data, tiny_ouro_la):
    """Mixed batches: lookahead_gate items (signals read a tick late) beside gate, kl, trace items."""
    cfg, reqs = data.draw(workloads("ouro-la", 4))
    check_workload(tiny_ouro_la, "zero", cfg, reqs)


@HYP
@given(data=st.data(), state_init=st.sampled_from(["zero", "like-init"]))
def test_random_workloads_huginn(data, state_init, tiny_huginn):
    cfg, reqs = data.draw(workloads("huginn", 6))
    check_workload(tiny_huginn, state_init, cfg, reqs)


# -- preemption -------------------------------------------------------------------------------------------
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("scheduler", SCHEDULERS)
def test_preemption_happens_and_changes_nothing(scheduler, layout, tiny_ouro):
    engine = make_engine(tiny_ouro, scheduler=scheduler, kv_layout=layout, block_size=2, kv_cache_tokens=24,
                         max_decode_batch=4, kv_safety_margin=0.0, lookahead=layout == "shared")
    reqs = [Req(f"p{i}", [(31 * i + 3 * j) % 400 + 1 for j in range(3 + 2 * i)],
                SamplingParams(temperature=0.8 * (i % 2), max_tokens=9, ignore_eos=True, exit_threshold=0.6),
                seed=i, arrive=i)
            for i in range(4)]
    outs = drive(engine, reqs)
    assert engine.stats.preemptions > 0 and engine.stats.swap_ins > 0
    for r in reqs:
        assert outs[r.rid].outputs[0].finish_reason == "length"
        assert_matches(outs[r.rid], reference(engine, r))


@pytest.mark.parametrize("scheduler", SCHEDULERS)
def test_half_prefilled_prompts_cannot_deadlock(scheduler, tiny_huginn):
    """Two long prompts whose chunks together overfill the pool: admitting chunk by chunk used to
    leave both half prefilled, holding every block, with neither able to finish."""
    engine = make_engine(tiny_huginn, scheduler=scheduler, block_size=2, kv_cache_tokens=18,
                         prefill_chunk_size=6, max_num_batched_tokens=12, kv_safety_margin=0.0)
    reqs = [Req(f"d{i}", list(range(10 + i, 24 + i)), SamplingParams(temperature=0, max_tokens=3), seed=i)
            for i in range(2)]
    outs = drive(engine, reqs)
    for r in reqs:
        assert outs[r.rid].outputs[0].finish_reason in ("length", "stop")
        assert_matches(outs[r.rid], reference(engine, r))


# -- requests that cannot fit -------------------------------------------------------------------------------
@pytest.mark.parametrize("scheduler", SCHEDULERS)
def test_prompt_that_never_fits_fails_alone(scheduler, tiny_ouro):
    engine = make_engine(tiny_ouro, scheduler=scheduler, block_size=4, kv_cache_tokens=16)
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    reqs = [Req("ok0", [5, 6, 7], params, seed=0), Req("huge", list(range(1, 21)), params, seed=1, arrive=1),
            Req("ok1", [9, 8], params, seed=2, arrive=1)]
    outs = drive(engine, reqs)
    huge = outs["huge"]
    assert huge.outputs[0].finish_reason == "error" and huge.outputs[0].token_ids == []
    assert "prompt of 20 tokens cannot fit in the KV cache (16 tokens)" in huge.error
    for rid in ("ok0", "ok1"):
        assert outs[rid].outputs[0].finish_reason == "length" and outs[rid].error is None
        assert_matches(outs[rid], reference(engine, next(r for r in reqs if r.rid == rid)))
    assert engine.stats.finished_requests["error"] == 1


def test_prompt_that_never_fits_through_llm(tiny_huginn):
    """LLM refuses it up front, as the server does (ValueError naming the field), and runs none of the call's
    requests; it used to return it as an output with finish_reason "error"."""
    llm = LLM(tiny_huginn, dtype="float64", scheduler="cdb", block_size=4, kv_cache_tokens=16)
    params = SamplingParams(temperature=0, max_tokens=3)
    with pytest.raises(ValueError, match=r"^prompt: 29 tokens do not fit in the KV cache \(16 tokens\)"):
        llm.generate([[5, 6], list(range(1, 30)), [7]], params)
    assert not llm.engine.has_unfinished_requests() and llm.engine.stats.finished_requests == {}
    # 13 tokens and one to generate need 4 blocks, two samples together 5: they run one after the other (parts of
    # one sample each, as vLLM runs samples as requests of their own), as the reference decoder draws them (they were
    # refused: "n: 2 samples of a prompt of 13 tokens cannot fit")
    two = SamplingParams(temperature=1.0, seed=3, max_tokens=3, n=2, ignore_eos=True)
    got = llm.generate([list(range(1, 14))], two)[0]
    ref = LLM(tiny_huginn, dtype="float64", scheduler="reference").generate([list(range(1, 14))], two)[0]
    assert [c.token_ids for c in got.outputs] == [c.token_ids for c in ref.outputs] and len(got.outputs) == 2
    assert not llm.engine.has_unfinished_requests() and llm.engine.stats.finished_requests == {"length": 2}
    outs = llm.generate([[5, 6], [7]], params)
    assert [o.outputs[0].finish_reason for o in outs] == ["length", "length"]
    assert llm.engine.kv_usage() == 0


@pytest.mark.parametrize("scheduler", SCHEDULERS)
def test_generation_outgrowing_the_pool_fails_and_frees(scheduler, tiny_ouro):
    """A request whose tokens outgrow the whole pool ends with an error once its next token cannot get
    a KV slot; its blocks are freed and a request running next to it completes."""
    engine = make_engine(tiny_ouro, scheduler=scheduler, block_size=4, kv_cache_tokens=16, kv_safety_margin=0.0)
    grow = Req("grow", list(range(40, 50)), SamplingParams(temperature=0, max_tokens=20, ignore_eos=True), seed=0)
    small = Req("small", [3], SamplingParams(temperature=0.9, max_tokens=3, ignore_eos=True), seed=1, arrive=2)
    outs = drive(engine, [grow, small])  # drained: every block is free again
    c, out = outs["grow"].outputs[0], outs["grow"]
    assert c.finish_reason == "error" and "exceeds the KV cache (16 tokens)" in out.error
    assert len(c.token_ids) == 7  # prompt 10 + 6 tokens fill 16 slots; the 7th has no slot
    ref = reference(engine, grow)
    assert c.token_ids == ref.output_ids[:7] and c.exit_depths == ref.exit_depths[:7]
    assert outs["small"].outputs[0].finish_reason == "length"
    assert_matches(outs["small"], reference(engine, small))


def test_invariant_checks_catch_leaks(tiny_ouro):
    """The checks are not vacuous: a leaked block, a leaked state row or lost loops are caught."""
    engine = make_engine(tiny_ouro, scheduler="cdb", block_size=4, kv_cache_tokens=32)
    engine.add_request("a", [1, 2, 3], SamplingParams(temperature=0, max_tokens=4), seed=0)
    for _ in range(3):
        engine.step()
    sched = engine.scheduler
    sched.check_invariants()
    leaked = sched.kv.allocator.allocate(1)
    with pytest.raises(AssertionError, match="allocator owns blocks"):
        sched.check_invariants()
    sched.kv.allocator.free(leaked)
    ghost = WorkItem(sched.running["a"], -1, sched.pool)
    sched.pool.allocate([ghost], np.full(1, -1), np.zeros(1, np.int64), np.zeros(1, np.int64), np.zeros(1, np.int64))
    with pytest.raises(AssertionError, match="state row leaked"):
        sched.check_invariants()
    sched.pool.release(ghost)
    engine.stats.useful_core_rows += 1
    with pytest.raises(AssertionError, match="core loops unaccounted"):
        sched.check_invariants()
    engine.stats.useful_core_rows -= 1
    engine.run_to_completion()
    sched.check_drained()
