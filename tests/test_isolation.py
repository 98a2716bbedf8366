"""Fault isolation in the engine: one request's failure never touches another.

Faults are injected at every point where the engine handles one request's part of a batch
(sampling, logprobs, detokenization, stop matching, the exit rule) and as non-finite values (NaN
logits; NaN in the request's hidden state, which then also reaches its exit signal, its coda and
its KV). Each time the faulty request alone finishes with finish_reason "error" and status 500, its
KV blocks and state rows are freed (invariants are checked after every step and the engine drains
to nothing), and every other request, including ones that arrive later and reuse the failed
request's KV blocks, equals the sequential reference decoder. Also: any value `SamplingParams`
accepts is safe for the sampler, and Huginn's random initial state does not depend on request ids.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from loopserve import LLM, SamplingParams
from loopserve.engine import sampler as sampler_module
from loopserve.engine.config import ENGINE_SCHEDULERS
from loopserve.engine.runner import ModelRunner
from loopserve.engine.sampler import sample_batch, sample_one, unpack
from loopserve.engine.sequence import Sequence, as_int64
from loopserve.errors import NonFiniteError
from loopserve.exits import ExitBook
from loopserve.sampling_params import RequestOutputKind
from tests.engine_helpers import Req, assert_matches, drive, make_engine, reference

VICTIM = "victim"
# the victim's gate threshold: the exit-rule fault recognizes the victim's trackers by it
VICTIM_THRESHOLD = 0.61


def _victim(seq: Sequence) -> bool:
    return seq.request_id == VICTIM


class Fault(RuntimeError):
    pass


def _inject(monkeypatch, point: str) -> list[int]:
    """Make the victim's part of every batch fail at `point` (from its second generated token on).
    Returns, for the sampler's points, the sizes of the batches the sampler was called with."""
    calls: list[int] = []

    def later(seq: Sequence) -> bool:
        return _victim(seq) and len(seq.output_ids) >= 1

    if point in ("sample_first", "sample", "nan_logits"):
        real = sampler_module.sample_batch

        # the sampler sees params only: the victim is the one request with this stop string
        def sample_batch(logits, params, seeds, counters, plain=None):
            calls.append(len(params))
            rows = [i for i, p in enumerate(params) if p.stop == ["<victim>"]]
            hit = [i for i in rows if (counters[i] == 0) == (point == "sample_first")]
            if hit and point != "nan_logits":
                raise Fault("sampler failed")
            if hit:
                logits = logits.clone()
                logits[hit] = float("nan")
            return real(logits, params, seeds, counters, plain)

        monkeypatch.setattr(sampler_module, "sample_batch", sample_batch)
    elif point == "logprobs":
        real_lp = sampler_module.top_logprobs

        def top_logprobs(logits, tokens, k):
            if k == 4:  # only the victim asks for 4 logprobs
                raise Fault("logprobs failed")
            return real_lp(logits, tokens, k)

        monkeypatch.setattr(sampler_module, "top_logprobs", top_logprobs)
    elif point in ("detokenize", "stop"):
        name = "decode_pending" if point == "detokenize" else "_stopped"
        real_m = getattr(Sequence, name)

        def method(self, *args):
            if later(self):
                raise Fault(f"{name} failed")
            return real_m(self, *args)

        monkeypatch.setattr(Sequence, name, method)
    elif point == "exit_rule":
        real_settle = ExitBook.settle

        def settle(self, rows, r, *rest):  # the victim's rows raise from step 2 on
            if ((self.threshold[rows] == VICTIM_THRESHOLD) & (r >= 2)).any():
                raise Fault("exit rule failed")
            return real_settle(self, rows, r, *rest)

        monkeypatch.setattr(ExitBook, "settle", settle)
    elif point == "nan_state":
        real_core = ModelRunner.core

        def core(self, rows):
            for row in rows.tolist():
                it = self.pool.items[row]
                if _victim(it.seq) and it.r >= 1 and len(it.seq.output_ids) >= 2:
                    self.pool.state[int(self.pool.state_rows(np.array([row]))[0])] = float("nan")
            return real_core(self, rows)

        monkeypatch.setattr(ModelRunner, "core", core)
    else:
        raise AssertionError(point)
    return calls


POINTS = ("sample_first", "sample", "nan_logits", "logprobs", "detokenize", "stop", "exit_rule", "nan_state")


def _workload(r_max: int) -> list[Req]:
    """The victim among neighbours; late arrivals that take the KV blocks the victim held."""
    reqs = [Req(VICTIM, [5, 9, 2, 7, 3, 8, 1], SamplingParams(
        max_tokens=12, temperature=0.0, ignore_eos=True, stop=["<victim>"], logprobs=4,
        exit_policy="gate", exit_threshold=VICTIM_THRESHOLD), seed=1, arrive=0)]
    neighbours = (
        dict(temperature=0.0, logprobs=2, exit_policy="gate", exit_threshold=0.5),
        dict(temperature=0.8, seed=7, exit_policy="gate", exit_threshold=0.9),
        dict(temperature=1.0, top_p=0.9, exit_trace=[1, 3, 2, r_max, 1]),
        dict(temperature=0.0, exit_policy="fixed"),
    )
    for i, kw in enumerate(neighbours):
        prompt = [(31 * i + 7 * j + 3) % 400 + 1 for j in range(4 + 3 * i)]
        reqs.append(Req(f"n{i}", prompt, SamplingParams(max_tokens=10, ignore_eos=True, **kw), seed=100 + i,
                        arrive=0 if i < 2 else 9 + 6 * i))
    return reqs


CFG = dict(block_size=4, kv_cache_tokens=64, max_num_seqs=4, max_decode_batch=3, prefill_chunk_size=8,
           max_num_batched_tokens=8, min_coda_batch=1)


@pytest.mark.parametrize("point", POINTS)
@pytest.mark.parametrize("scheduler,layout", [("cdb", "depth_indexed"), ("cb", "depth_indexed"),
                                              ("cdb-norefill", "last_exited"), ("cdb", "shared")])
def test_a_failing_request_fails_alone(point, scheduler, layout, tiny_ouro, monkeypatch):
    engine = make_engine(tiny_ouro, scheduler=scheduler, kv_layout=layout, **CFG)
    reqs = _workload(engine.model_config.r_max)
    refs = {r.rid: reference(engine, r) for r in reqs if r.rid != VICTIM}  # before the fault is armed
    sampled = _inject(monkeypatch, point)
    outs = drive(engine, reqs)  # invariants after every step; drained at the end: nothing leaked
    if point in ("sample", "nan_logits"):  # neighbours were sampled in batches with it (not row by row only)
        assert max(sampled) > 1
    victim = outs[VICTIM]
    assert victim.outputs[0].finish_reason == "error" and victim.error_status == 500
    expected = "non-finite" if point.startswith("nan") else "internal error while handling this request ("
    if not point.startswith("nan"):
        assert "failed" in (victim.error or "")
    assert expected in (victim.error or "")
    for r in reqs[1:]:
        assert_matches(outs[r.rid], refs[r.rid])



@pytest.mark.parametrize("scheduler", ["cdb", "cb"])
def test_a_streamed_request_failing_to_detokenize_on_the_batch_path_fails_alone(scheduler, tiny_ouro, monkeypatch):
    """A streamed request without logprobs, stop strings or grammar takes its tokens with the coda batch's quiet
    rows, whose text the scheduler decodes request by request: a fault there fails that request alone."""
    engine = make_engine(tiny_ouro, scheduler=scheduler, **CFG)
    reqs = [Req(VICTIM, [5, 9, 2, 7, 3, 8, 1], SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True),
                seed=1), *_workload(engine.model_config.r_max)[1:]]
    assert reqs[0].params.output_kind != RequestOutputKind.FINAL_ONLY
    refs = {r.rid: reference(engine, r) for r in reqs[1:]}
    real_decode, real_append = Sequence.decode_pending, Sequence.append
    inside_append: list[bool] = []
    faults: list[bool] = []  # per fault: raised from inside `append` (the one-by-one path) or not

    def append(self, *args):
        inside_append.append(True)
        try:
            return real_append(self, *args)
        finally:
            inside_append.pop()

    def decode_pending(self, end=None):
        if _victim(self) and len(self.output_ids) >= 3:
            faults.append(bool(inside_append))
            raise Fault("decode_pending failed")
        return real_decode(self, end)

    monkeypatch.setattr(Sequence, "append", append)
    monkeypatch.setattr(Sequence, "decode_pending", decode_pending)
    outs = drive(engine, reqs)
    assert faults and not faults[0]  # it failed first on the batch path (then its finish decodes what it can)
    victim = outs[VICTIM]
    assert victim.outputs[0].finish_reason == "error" and victim.error_status == 500
    assert "decode_pending failed" in (victim.error or "")
    for r in reqs[1:]:
        assert_matches(outs[r.rid], refs[r.rid])


@pytest.mark.parametrize("point", ["exit_rule", "nan_state"])
@pytest.mark.parametrize("scheduler", ["cdb", "cb", "cdb-norefill"])
def test_a_request_failing_on_a_signal_read_a_tick_late_fails_alone(point, scheduler, tiny_ouro, monkeypatch):
    """With delayed lookahead the engine queues core step t+1 before it reads step t's signals. A row
    that reading fails (and frees) is already in the queued batch: it must not be advanced with it. (A
    freed row reaching max_loops there went into the coda queue and stopped the engine; short of that,
    its loops were counted twice.)"""
    engine = make_engine(tiny_ouro, scheduler=scheduler, lookahead=True, **CFG)
    reqs = _workload(engine.model_config.r_max)
    victim = reqs[0]
    reqs[0] = Req(victim.rid, victim.prompt, dataclasses.replace(victim.params, max_loops=3), victim.seed)
    refs = {r.rid: reference(engine, r) for r in reqs[1:]}
    _inject(monkeypatch, point)
    outs = drive(engine, reqs)  # invariants (loops accounted for, no stale row queued) after every step
    assert outs[VICTIM].outputs[0].finish_reason == "error"
    for r in reqs[1:]:
        assert_matches(outs[r.rid], refs[r.rid])

def test_nan_kv_of_a_failed_request_never_reaches_the_next_owner_of_its_blocks(tiny_ouro, monkeypatch):
    """The victim writes NaN KV at depths 2-4 of one position, then fails. A later request reuses its
    blocks; its token there exits at depth 1, so those NaN slots stay, hidden from its deeper queries
    by the depth_indexed rule: masked keys must not be read at all (0 * NaN is NaN)."""
    # without prefix caching the victim's blocks return in their old order, so `late` gets the NaN
    # row at the same position (a cached prompt block would be handed out after the empty ones)
    engine = make_engine(tiny_ouro, scheduler="cdb", kv_layout="depth_indexed", block_size=4, kv_cache_tokens=16,
                         max_num_seqs=2, max_decode_batch=2, min_coda_batch=1, enable_prefix_caching=False)
    late = Req("late", [3, 1, 4, 1, 5], SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True,
                                                         exit_trace=[1, 1, 1, 4, 3, 4, 2, 4]), seed=2, arrive=30)
    victim = Req(VICTIM, [2, 7, 1, 8, 2, 8], SamplingParams(max_tokens=9, temperature=0.0, ignore_eos=True,
                                                             exit_policy="fixed"), seed=1)
    ref = reference(engine, late)
    _inject(monkeypatch, "nan_state")
    outs = drive(engine, [victim, late])  # the victim has failed long before `late` arrives
    assert outs[VICTIM].outputs[0].finish_reason == "error"
    assert_matches(outs["late"], ref)
    assert torch.isnan(engine.kv.store.k).any(), "no NaN left in the KV cache: the test proves nothing"


@pytest.mark.parametrize("scheduler,layout", [("cdb", "depth_indexed"), ("cb", "depth_indexed"),
                                              ("cdb-norefill", "last_exited"), ("cdb", "shared")])
def test_unwritten_kv_rows_are_never_read(scheduler, layout, tiny_ouro):
    """The KV pool is not zeroed when allocated: a row must be written before any query sees it, and
    masked keys are read from the zero row. Fill every other row with NaN first: outputs (with
    preemption under this small pool, and late requests reusing blocks) still equal the reference."""
    engine = make_engine(tiny_ouro, scheduler=scheduler, kv_layout=layout, **CFG)
    store = engine.kv.store
    for t in (store.k, store.v):
        t[:, :, : store.zero_row] = float("nan")
    reqs = _workload(engine.model_config.r_max)
    outs = drive(engine, reqs)
    for r in reqs:
        assert_matches(outs[r.rid], reference(engine, r))


def test_offline_generate_reports_the_error_and_finishes_the_rest(tiny_ouro, monkeypatch):
    llm = LLM(tiny_ouro, dtype="float64", kv_cache_tokens=256)
    _inject(monkeypatch, "stop")
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    outs = llm.generate(["a", "b", "c"], params)
    assert [o.outputs[0].finish_reason for o in outs] == ["length"] * 3  # the fault only hits VICTIM
    llm.generate(["x"], params)  # the engine still works after a failure elsewhere
    assert llm.engine is not None and llm.engine.kv_usage() == 0


POISON = 7  # the token whose embedding row `poisoned` makes NaN


@pytest.fixture(scope="module")
def poisoned(tiny_ouro, tmp_path_factory):
    """tiny_ouro with a NaN embedding row for token `POISON`: its hidden state, KV, exit signals and logits go NaN."""
    import shutil

    from safetensors.torch import load_file, save_file

    folder = tmp_path_factory.mktemp("poisoned")
    shutil.copytree(tiny_ouro, folder, dirs_exist_ok=True)
    weights = load_file(folder / "model.safetensors")
    weights["model.embed_tokens.weight"][POISON] = float("nan")
    save_file(weights, folder / "model.safetensors", metadata={"format": "pt"})
    return folder


@pytest.mark.parametrize("scheduler", ["cdb", "cb", "reference"])
def test_a_prompt_that_poisons_its_kv_fails_whatever_it_asks(scheduler, poisoned):
    """A prompt token with a non-finite hidden state writes NaN KV, which later positions read as zeros (attention
    zeroes the rows a NaN reaches, as it does those that see no key: telling them apart would cost a pass over the
    scores). The request fails ("non-finite hidden states"), with or without logprobs or prompt_logprobs: it had
    answered a finite token, unless prompt_logprobs were asked for, which read the poisoned position's own logits.
    Its neighbour, in the same batches, is untouched."""
    llm = LLM(poisoned, scheduler=scheduler, dtype="float64", kv_cache_tokens=256, prefill_chunk_size=8)
    clean = llm.generate([[5, 6, 9]], SamplingParams(max_tokens=3, temperature=0.0), use_tqdm=False)[0]
    # (the second poisoned prompt's NaN is in its first chunk of three)
    for poisoned_prompt in ([5, POISON, 9], [5, POISON] + [9] * 20):
        for extra in ({}, {"logprobs": 1}, {"prompt_logprobs": 0}):
            bad, ok = llm.generate([poisoned_prompt, [5, 6, 9]],
                                   SamplingParams(max_tokens=3, temperature=0.0, **extra), use_tqdm=False)
            assert (bad.outputs[0].finish_reason, bad.outputs[0].token_ids) == ("error", []), extra
            assert bad.error == "the model produced non-finite hidden states for this request's prompt", extra
            assert ok.outputs[0].token_ids == clean.outputs[0].token_ids, extra
    if llm.engine is not None:
        assert llm.engine.kv_usage() == 0


@pytest.mark.parametrize("scheduler", ["cdb", "reference"])
def test_a_non_finite_exit_signal_fails_its_request_alone_in_the_reference_too(scheduler, poisoned):
    """A request made to decode the poisoned token gets a NaN gate signal at its next token's first loop: it fails
    alone in the engine and in the reference decoder alike (the reference had raised out of `generate`, losing
    every request of the call)."""
    llm = LLM(poisoned, scheduler=scheduler, dtype="float64", kv_cache_tokens=256)
    params = [SamplingParams(max_tokens=3, temperature=0.0, allowed_token_ids=[POISON]),
              SamplingParams(max_tokens=3, temperature=0.0)]
    bad, ok = llm.generate([[5, 6], [20, 21, 22]], params, use_tqdm=False)
    assert bad.outputs[0].finish_reason == "error" and bad.outputs[0].token_ids == [POISON]
    assert bad.error == "the model produced a non-finite gate signal for this request"
    assert (ok.outputs[0].finish_reason, len(ok.outputs[0].token_ids)) == ("length", 3)


def test_an_interrupted_generate_leaves_nothing_running(tiny_ouro):
    """Interrupted mid-run (here the progress bar raises KeyboardInterrupt when the first request finishes), the
    call's other requests are aborted and their KV freed: they do not run to their end inside the next call, and
    the prefix cache can be reset at once."""
    from tqdm import tqdm

    class Interrupting(tqdm):
        def update(self, n=1):
            raise KeyboardInterrupt

    llm = LLM(tiny_ouro, dtype="float64", kv_cache_tokens=256)
    short, long = SamplingParams(max_tokens=1, ignore_eos=True), SamplingParams(max_tokens=40, ignore_eos=True)
    with pytest.raises(KeyboardInterrupt):
        llm.generate([[5, 6], [7, 8], [9, 10]], [short, long, long], use_tqdm=Interrupting)
    assert llm.engine is not None and llm.engine.kv_usage() == 0
    assert llm.reset_prefix_cache() is True
    steps = llm.engine.stats.generated_tokens
    counted = []

    class Counting(tqdm):
        def close(self):
            counted.append((self.n, self.total))
            super().close()

    [out] = llm.generate([[5, 6]], short, use_tqdm=Counting)
    assert out.outputs[0].finish_reason == "length" and llm.engine.stats.generated_tokens == steps + 1
    assert counted[0] == (1, 1)  # (the aborted requests, reported at this call's first step, are not its bar's)


# -- sampling parameters at numeric extremes ---------------------------------------------------------------
_EXTREME = (0.0, -0.0, 5e-324, 2.2e-308, 1e-310, 1e-5, 9.99e-6, 1e-300, 0.5, 1.0, 1.0 + 1e-16, 100.0, 1e300,
            -1e-310, -1.0, float("nan"), float("inf"), float("-inf"))
_numbers = st.one_of(st.sampled_from(_EXTREME), st.floats(allow_nan=True, allow_infinity=True, allow_subnormal=True),
                     st.integers(-(2**70), 2**70), st.booleans())


@settings(max_examples=400, deadline=None)
@given(temperature=_numbers, top_p=_numbers, min_p=_numbers, exit_threshold=_numbers,
       top_k=st.one_of(st.integers(-(2**70), 2**70), st.sampled_from([-1, 0, 1, 2, 319, 320, 321])),
       seed=st.one_of(st.none(), st.integers(-(2**70), 2**70)),
       scale=st.sampled_from([1e-30, 1.0, 30.0, 1e4, 1e38]), logprobs=st.integers(0, 20))
def test_any_accepted_sampling_params_sample_safely(temperature, top_p, min_p, exit_threshold, top_k, seed, scale,
                                                    logprobs):
    try:
        p = SamplingParams(temperature=temperature, top_p=top_p, min_p=min_p, top_k=top_k, seed=seed,
                           exit_threshold=exit_threshold, logprobs=logprobs)
    except ValueError as e:
        assert str(e).split(":")[0] in ("temperature", "top_p", "min_p", "top_k", "seed", "exit_threshold")
        return
    for v in (p.temperature, p.top_p, p.min_p, p.exit_threshold or 0.0):
        assert math.isfinite(v) and not isinstance(v, bool)
    logits = (torch.randn(320, generator=torch.Generator().manual_seed(3), dtype=torch.float64) * scale).float()
    # (as a Sequence holds it: any 64-bit seed as the int64 the sampler's arrays take; 2^63 and up overflowed here)
    s = sample_one(logits, p, as_int64(p.seed) if p.seed is not None else 0, 0).checked()
    assert 0 <= s.token < 320
    assert math.isfinite(s.logprob) and s.logprob <= 0 and s.rank >= 1 and len(s.top) == (p.logprobs or 0)


def test_tiny_temperatures_sample_at_vllms_floor():
    """A subnormal temperature would overflow the logits: it is raised to 0.01 (vLLM's floor), and each draw is that
    temperature's (it was greedy below 1e-5, where vLLM samples)."""
    logits = torch.randn(50, generator=torch.Generator().manual_seed(0))
    for t in (5e-324, 1e-310, 1e-8, 9.9e-6):
        for counter in range(5):
            s = sample_one(logits, SamplingParams(temperature=t), 3, counter).checked()
            assert s.token == sample_one(logits, SamplingParams(temperature=0.01), 3, counter).token


def test_non_finite_logits_raise_a_named_error():
    bad = torch.tensor([[0.0, float("nan"), 1.0], [0.0, float("inf"), 1.0], [0.0, 1.0, 2.0]])
    params = [SamplingParams(temperature=0.0), SamplingParams(temperature=1.0, logprobs=1), SamplingParams()]
    rows = unpack(sample_batch(bad, params, [1, 2, 3], [0, 0, 0]), params)
    for r in rows[:2]:
        with pytest.raises(NonFiniteError):
            r.checked()
    assert rows[2].checked().token in (0, 1, 2)


def test_a_random_row_whose_adjusted_logits_are_not_finite_is_never_taken(monkeypatch):
    """Finite logits that the request's own adjustments turn non-finite leave no total to draw against: the draw
    would take the last token (searchsorted against NaN). The row is flagged instead (here the filter is made to
    give NaN for row 1), the other rows sample as they would; and the one adjustment that could overflow, a
    repetition_penalty near 0, is refused where it is given."""
    real = sampler_module.filtered_probs

    def nan_row_one(x, *args):
        probs = real(x, *args)
        probs[1] = float("nan")
        return probs

    logits = torch.tensor([[0.0, 1.0, 2.0], [0.5, 1.0, 0.0], [2.0, 0.0, 1.0]], dtype=torch.float64)
    params = [SamplingParams(temperature=1.0, seed=1) for _ in range(3)]
    want = unpack(sample_batch(logits, params, [1, 2, 3], [0, 0, 0]), params)
    monkeypatch.setattr(sampler_module, "filtered_probs", nan_row_one)
    rows = unpack(sample_batch(logits, params, [1, 2, 3], [0, 0, 0]), params)
    with pytest.raises(NonFiniteError):
        rows[1].checked()
    assert [rows[i].checked().token for i in (0, 2)] == [want[i].token for i in (0, 2)]
    for bad in (1e-310, 5e-324, 1e-201):
        with pytest.raises(ValueError, match="repetition_penalty: must be a finite number >= 1e-200"):
            SamplingParams(repetition_penalty=bad)
    SamplingParams(repetition_penalty=1e-200)


# -- Huginn: reproducible without a seed ---------------------------------------------------------------------
def test_huginn_greedy_is_reproducible_without_a_seed(tiny_huginn):
    engine = make_engine(tiny_huginn, "like-init", scheduler="cdb", kv_cache_tokens=256)
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, exit_policy="latent_diff",
                            exit_threshold=0.8)
    for rid in ("first", "second", "third"):
        engine.add_request(rid, [4, 8, 15, 16, 23], params)
    engine.add_request("other", [4, 8, 15, 16, 24], params)
    outs = {}
    while engine.has_unfinished_requests():
        outs.update({o.request_id: o.outputs[0] for o in engine.step() if o.finished})
    same = [(outs[r].token_ids, outs[r].exit_depths) for r in ("first", "second", "third")]
    assert same[0] == same[1] == same[2]
    # the state really is random per request content: a request's own seed changes the computation
    seeded = engine.make_sequence("s", [4, 8, 15, 16, 23], SamplingParams(max_tokens=8, temperature=0.0, seed=5))
    unseeded = engine.make_sequence("u", [4, 8, 15, 16, 23], params)
    assert seeded.state_seed(3) != unseeded.state_seed(3)
    assert engine.make_sequence("v", [4, 8, 15, 16, 23], params).state_seed(3) == unseeded.state_seed(3)


def test_llm_generate_gives_identical_huginn_prompts_identical_greedy_outputs(tiny_huginn):
    llm = LLM(tiny_huginn, dtype="float64", kv_cache_tokens=256)
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, exit_policy="latent_diff",
                            exit_threshold=0.8)
    a, b = llm.generate(["Huginn", "Huginn"], params)
    c = llm.generate("Huginn", params)[0]
    assert a.outputs[0].token_ids == b.outputs[0].token_ids == c.outputs[0].token_ids
    assert a.outputs[0].exit_depths == b.outputs[0].exit_depths == c.outputs[0].exit_depths


@pytest.mark.parametrize("scheduler", ENGINE_SCHEDULERS)
def test_prompts_that_end_in_their_prefill_never_starve_decoding(scheduler, tiny_ouro):
    """A client sending a prompt every tick whose request ends in its prefill (`max_tokens` 1; a beam search's
    steps are such requests) kept the prefill queue full, and prefill came first: a decoding request got no token
    while it lasted (2 tokens in 30 s over HTTP). Now every sequence that was decoding at a prefill tick gets a
    token before the next prefill tick runs, and its tokens equal the reference decoder's."""
    engine = make_engine(tiny_ouro, scheduler=scheduler, max_decode_batch=4)
    victim = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, output_kind=RequestOutputKind.DELTA)
    engine.add_request(VICTIM, [5, 6, 7], victim)
    one = SamplingParams(max_tokens=1, temperature=0.0)
    tokens: list[int] = []
    prefills_since_token, ticks = 0, 0
    while engine.has_unfinished_requests() and ticks < 2_000:
        engine.add_request(f"one-{ticks}", [9, 10, 11, 12], one)  # one more such prompt every tick
        before = engine.stats.ticks.get("prefill", 0)
        for out in engine.step():
            if out.request_id == VICTIM:
                got = out.outputs[0].token_ids
                tokens += got
                prefills_since_token = 0 if got else prefills_since_token
        prefills_since_token += engine.stats.ticks.get("prefill", 0) - before
        assert prefills_since_token <= 2, "the victim waited through two prefill ticks for a token"
        ticks += 1
        if len(tokens) == victim.max_tokens:
            break
    assert len(tokens) == victim.max_tokens, f"{len(tokens)} of {victim.max_tokens} tokens in {ticks} ticks"
    expected = reference(engine, Req(VICTIM, [5, 6, 7], victim, seed=0))
    assert tokens == expected.output_ids
