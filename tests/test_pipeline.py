"""Schedule/compute overlap (the engine's `_core`): when every rule in a core batch decides ahead
(delayed lookahead, lookahead_gate), a step's exit signals are read only after the next core step
has been planned and queued; a rule that acts on its own step's signal makes the engine read it at
once. Either way every request's output equals the sequential reference decoder's."""

from __future__ import annotations

import random

import pytest

from loopserve import LLM, SamplingParams
from loopserve.device import Readback
from loopserve.engine.config import EngineConfig
from loopserve.engine.engine import LLMEngine
from loopserve.models.loader import load_model
from loopserve_lab.tiny import TinySpec, make_tiny


@pytest.fixture(scope="module")
def ouro_la(tmp_path_factory):
    return make_tiny(tmp_path_factory.mktemp("pipe") / "ouro", TinySpec(arch="ouro", seed=9, lookahead_gate=True))


def logged_run(path, params: list[SamplingParams], prompts, **cfg) -> tuple[list[tuple[str, object]], LLMEngine, dict]:
    """Run the engine, logging `plan` (a stage batch was planned), `queue` (a stage batch was queued:
    for a core step, with its pending signals) and `read` (a core step's signals were read back)."""
    m = load_model(path, "float64", "cpu")
    engine = LLMEngine(m.model, m.tokenizer, EngineConfig(kv_cache_tokens=512, **cfg))
    log: list[tuple[str, object]] = []
    core, schedule = engine.runner.core, engine.scheduler.schedule

    def logged_core(rows):
        pending = core(rows)
        get = pending.get

        def logged_get():
            log.append(("read", pending))
            return get()

        pending.get = logged_get  # type: ignore[method-assign]
        log.append(("queue", pending))
        return pending

    def logged_schedule():
        plan = schedule()
        if plan.stage != "idle":
            log.append(("plan", None))
        return plan

    def logged_stage(record):
        if record.stage != "core":
            log.append(("queue", None))
            if record.stage == "prelude" and log[-2][0] != "plan":  # a same-tick follow-up: planned too
                log.insert(-1, ("plan", None))

    engine.runner.core = logged_core  # type: ignore[method-assign]
    engine.scheduler.schedule = logged_schedule  # type: ignore[method-assign]
    engine.stage_hooks.append(logged_stage)
    for i, (p, sp) in enumerate(zip(prompts, params, strict=True)):
        engine.add_request(str(i), p, sp)
    outs = {}
    while engine.has_unfinished_requests():
        for o in engine.step():
            outs[o.request_id] = o
        engine.scheduler.check_invariants()
    engine.scheduler.check_drained()
    return log, engine, outs


def read_lags(log) -> list[tuple[int, int]]:
    """For every read: (stage batches queued, stage batches planned) after the core step was queued."""
    lags = []
    for j, (what, pending) in enumerate(log):
        if what != "read":
            continue
        start = next(i for i, (w, p) in enumerate(log) if w == "queue" and p is pending)
        between = [w for w, _ in log[start + 1:j]]
        lags.append((between.count("queue"), between.count("plan")))
    return lags


PROMPTS = [[5, 17, 99, 3], [8, 1, 2], list(range(10, 30)), [44]]


def reference(path, params, **cfg):
    # on the CPU, as `logged_run` (LLM's default device is auto: a GPU where there is one)
    return LLM(path, scheduler="reference", dtype="float64", device="cpu", **cfg).generate(PROMPTS, params,
                                                                                          use_tqdm=False)


def assert_same(outs: dict, ref) -> None:
    for i, r in enumerate(ref):
        got = outs[str(i)].outputs[0]
        assert got.token_ids == r.outputs[0].token_ids
        assert got.exit_depths == r.outputs[0].exit_depths


@pytest.mark.parametrize("scheduler", ["cb", "cdb-norefill", "cdb"])
def test_lookahead_signals_are_read_after_the_next_step_is_queued(ouro_la, scheduler):
    params = [SamplingParams(max_tokens=8, temperature=0.0 if i % 2 else 0.8, seed=i, ignore_eos=True,
                             exit_policy="gate", exit_threshold=q) for i, q in enumerate((0.3, 0.6, 0.8, 0.5))]
    log, engine, outs = logged_run(ouro_la, params, PROMPTS, scheduler=scheduler, lookahead=True,
                                   max_decode_batch=3)
    lags = read_lags(log)
    assert lags and all(lag == (1, 1) for lag in lags), lags  # tick t+1 planned and queued before t is read
    assert engine.stats.deferred_signal_ticks in (len(lags), len(lags) + 1)  # the last may go unread
    assert_same(outs, reference(ouro_la, params, lookahead=True))


def test_pipelining_off_reads_at_once_and_changes_nothing_else(ouro_la):
    params = [SamplingParams(max_tokens=8, temperature=0.7, seed=i, ignore_eos=True, exit_policy=policy,
                             exit_threshold=0.5) for i, policy in enumerate(["gate", "lookahead_gate"] * 2)]
    runs = {}
    for piped in (True, False):
        log, engine, outs = logged_run(ouro_la, params, PROMPTS, scheduler="cdb", lookahead=True,
                                       max_decode_batch=3, pipeline_core_steps=piped)
        runs[piped] = (read_lags(log), engine.stats, outs)
    assert set(runs[True][0]) == {(1, 1)} and set(runs[False][0]) == {(0, 0)}
    assert runs[True][1].ticks == runs[False][1].ticks  # the same schedule
    assert runs[True][1].batch_hist == runs[False][1].batch_hist
    for rid, out in runs[True][2].items():
        assert out.outputs[0].token_ids == runs[False][2][rid].outputs[0].token_ids
        assert out.outputs[0].exit_depths == runs[False][2][rid].outputs[0].exit_depths


def test_a_rule_acting_on_its_own_step_is_read_at_once(ouro_la):
    params = [SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, exit_policy="gate",
                             exit_threshold=q) for q in (0.3, 0.6, 0.8, 0.5)]
    log, engine, outs = logged_run(ouro_la, params, PROMPTS, scheduler="cdb", max_decode_batch=3)
    lags = read_lags(log)
    assert lags and all(lag == (0, 0) for lag in lags), lags
    assert engine.stats.deferred_signal_ticks == 0
    assert_same(outs, reference(ouro_la, params))


def test_mixed_batches_wait_only_when_a_rule_needs_it(ouro_la):
    """lookahead_gate decides ahead, plain gate does not: batches holding a gate request are read at
    once, batches of lookahead_gate (and signal-free trace) requests one tick late; outputs stay exact."""
    kinds = (dict(exit_policy="lookahead_gate", exit_threshold=0.5), dict(exit_policy="gate", exit_threshold=0.6),
             dict(exit_trace=[3, 2, 4, 1, 2]), dict(exit_policy="lookahead_gate", exit_threshold=0.3))
    params = [SamplingParams(max_tokens=4 if "gate" == k.get("exit_policy") else 12, temperature=0.0,
                             ignore_eos=True, **k) for k in kinds]
    log, engine, outs = logged_run(ouro_la, params, PROMPTS, scheduler="cdb", max_decode_batch=4)
    lags = read_lags(log)
    assert (0, 0) in lags and (1, 1) in lags, lags  # both regimes happened
    assert set(lags) <= {(0, 0), (1, 1)}
    assert_same(outs, reference(ouro_la, params))


def test_aborting_a_request_whose_signals_are_in_flight(ouro_la):
    params = [SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True, exit_policy="lookahead_gate",
                             exit_threshold=0.4) for _ in PROMPTS]
    m = load_model(ouro_la, "float64", "cpu")
    engine = LLMEngine(m.model, m.tokenizer, EngineConfig(kv_cache_tokens=512, max_decode_batch=4))
    for i, (p, sp) in enumerate(zip(PROMPTS, params, strict=True)):
        engine.add_request(str(i), p, sp)
    aborted = False
    outs = {}
    while engine.has_unfinished_requests():
        for o in engine.step():
            outs[o.request_id] = o
        deferred = [e for e in engine._in_flight if e.deferred]
        if not aborted and deferred and engine.pool.items[deferred[0].rows[deferred[0].keep][0]] is not None:
            victim = engine.pool.items[deferred[0].rows[deferred[0].keep][0]].seq.request_id
            engine.abort_request(victim)
            aborted = True
        engine.scheduler.check_invariants()
    engine.scheduler.check_drained()
    assert aborted and outs[victim].outputs[0].finish_reason == "abort"
    ref = reference(ouro_la, params)
    for i, r in enumerate(ref):
        if str(i) != victim:
            assert outs[str(i)].outputs[0].token_ids == r.outputs[0].token_ids


# -- async codas: a coda's tokens are sampled once the next stage batch is queued ----------------------------
def device_copies_arrive(monkeypatch, when: str) -> None:
    """Whether a readback's copy has reached the host when the engine looks (`Readback.ready`): on the CPU it
    always has; "never" plays a device still busy with the coda when the next tick is planned, "sometimes"
    one that is busy at random ticks (a seeded draw)."""
    rng = random.Random(0)
    if when != "always":
        monkeypatch.setattr(Readback, "ready", lambda self: when == "sometimes" and rng.random() < 0.5)


@pytest.mark.parametrize("arrive", ["never", "sometimes", "always"])
@pytest.mark.parametrize("scheduler", ["cb", "cdb-norefill", "cdb"])
@pytest.mark.parametrize("arch", ["ouro", "huginn"])
def test_async_codas_match_the_reference(arch, scheduler, arrive, tiny_ouro, tiny_huginn, monkeypatch):
    """The exactness matrix's workload (late arrivals, aborts, preemption) with async codas on, whether their
    tokens are taken before the next batch is planned (arrived) or after it is queued."""
    from tests.engine_helpers import assert_matches, drive, make_engine, reference
    from tests.test_engine_exact import MATRIX_CFG, matrix_workload

    device_copies_arrive(monkeypatch, arrive)
    path, state_init = (tiny_ouro, "zero") if arch == "ouro" else (tiny_huginn, "like-init")
    engine = make_engine(path, state_init, scheduler=scheduler, lookahead=True, async_coda=True, **MATRIX_CFG)
    reqs = matrix_workload(arch, "lookahead", engine.model_config.r_max)
    outs = drive(engine, reqs)  # invariants after every step, drained at the end
    for r in reqs:
        assert_matches(outs[r.rid], reference(engine, r))
    assert engine.stats.preemptions > 0


def coda_read_lags(path, async_coda: bool) -> list[int]:
    """For every coda: how many other stage batches were queued between it and the read of its tokens."""
    m = load_model(path, "float64", "cpu")
    engine = LLMEngine(m.model, m.tokenizer, EngineConfig(kv_cache_tokens=512, max_decode_batch=3,
                                                          async_coda=async_coda))
    log: list[tuple[str, object]] = []
    runner = engine.runner
    for stage in ("prefill", "prelude", "core"):
        fn = getattr(runner, stage)
        setattr(runner, stage, (lambda f: lambda *a: (log.append(("queue", None)), f(*a))[1])(fn))
    coda = runner.coda

    def logged_coda(items, rows):
        handle = coda(items, rows)
        get = handle.get
        handle.get = lambda: (log.append(("read", handle)), get())[1]  # type: ignore[method-assign]
        log.append(("coda", handle))
        return handle

    runner.coda = logged_coda  # type: ignore[method-assign]
    params = [SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True, exit_policy="lookahead_gate",
                             exit_threshold=q) for q in (0.3, 0.5, 0.7, 0.4)]
    for i, (p, sp) in enumerate(zip(PROMPTS, params, strict=True)):
        engine.add_request(str(i), p, sp)
    while engine.has_unfinished_requests():
        engine.step()
        engine.scheduler.check_invariants()
    engine.scheduler.check_drained()
    lags = []
    for j, (what, handle) in enumerate(log):
        if what == "read":
            start = next(i for i, (w, h) in enumerate(log) if w == "coda" and h is handle)
            lags.append(sum(w in ("queue", "coda") for w, _ in log[start + 1:j]))
    return lags


def test_async_coda_reads_tokens_after_the_next_batch_is_queued(ouro_la, monkeypatch):
    """A coda the device has not finished when the next tick is planned is read after that tick's batch is queued;
    one whose tokens have arrived is read before anything else is queued (as a synchronous coda's, without a wait)."""
    sync, arrived = coda_read_lags(ouro_la, False), coda_read_lags(ouro_la, True)
    device_copies_arrive(monkeypatch, "never")
    lagged = coda_read_lags(ouro_la, True)
    assert sync and set(sync) == {0}
    assert arrived and set(arrived) == {0}
    assert lagged and max(lagged) >= 1 and sum(lag >= 1 for lag in lagged) > len(lagged) // 2, lagged


def test_stage_and_signal_hooks_see_every_batch_and_signal(tiny_ouro):
    """The records benchmarks and metrics read: one per stage batch (agreeing with EngineStats), and
    every core step's signals, for every item with a signal rule, once per loop it kept."""
    m = load_model(tiny_ouro, "float64", "cpu")
    engine = LLMEngine(m.model, m.tokenizer, EngineConfig(kv_cache_tokens=512, max_decode_batch=3))
    records, signals = [], []
    engine.stage_hooks.append(records.append)
    engine.scheduler.signal_hooks.append(lambda items, sigs: signals.extend(
        (i.seq.request_id, i.r, s) for i, s in zip(items, sigs, strict=True) if s is not None))
    for k in range(4):
        engine.add_request(f"r{k}", [3 + k, 5, 7], SamplingParams(max_tokens=5, ignore_eos=True, temperature=0.0,
                                                                  exit_policy="gate", exit_threshold=0.6))
    engine.run_to_completion()
    st = engine.stats
    assert {s: sum(r.stage == s for r in records) for s in st.ticks} == dict(st.ticks)
    assert {s: sum(r.rows for r in records if r.stage == s) for s in st.rows} == dict(st.rows)
    assert all((r.cpu_s is not None) == (r.stage == "prefill") for r in records)
    assert len(signals) == st.useful_core_rows  # gate: one signal per loop run
