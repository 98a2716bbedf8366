"""The engine on a CUDA device (skipped where there is none; `scripts/gpu_check.sh` runs it on a lent
GPU): the same code gives the reference decoder's outputs, and queueing a pipelined core step
(lookahead) or planning the next tick never makes the host wait for the device."""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest
import torch

from loopserve import LLM, SamplingParams
from loopserve.cache.pool import KVStore
from tests.engine_helpers import check_finite_rows

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

PROMPTS = [[5, 17, 99, 3], [8, 1, 2], list(range(10, 40)), [44], [7, 7, 7, 7, 7, 7]]


def params_for(arch: str) -> list[SamplingParams]:
    rule = dict(exit_policy="gate", exit_threshold=0.6) if arch == "ouro" else dict(
        exit_policy="latent_diff", exit_threshold=0.8)
    return [SamplingParams(max_tokens=8, temperature=0.0 if i % 2 else 0.9, seed=i, ignore_eos=True, **rule)
            for i in range(len(PROMPTS))]


@pytest.mark.parametrize("graphs", [False, None])
@pytest.mark.parametrize("lookahead", [False, True])
@pytest.mark.parametrize("scheduler", ["cb", "cdb-norefill", "cdb"])
@pytest.mark.parametrize("arch", ["ouro", "huginn"])
def test_cuda_engine_matches_the_reference(arch, scheduler, lookahead, graphs, tiny_ouro, tiny_huginn):
    """Eager, and with the default `cuda_graphs` (unset: on for CUDA)."""
    path = tiny_ouro if arch == "ouro" else tiny_huginn
    kw = dict(dtype="float64", device="cuda", kv_cache_tokens=1024, max_decode_batch=3, lookahead=lookahead,
              prefill_chunk_size=8, max_num_batched_tokens=16)
    params = params_for(arch)
    ref = LLM(path, scheduler="reference", **kw).generate(PROMPTS, params)
    llm = LLM(path, scheduler=scheduler, **kw, **({} if graphs is None else {"cuda_graphs": graphs}))
    assert llm.engine is not None and (llm.engine.runner.graphs is not None) == (graphs is None)
    assert_equal_outputs(ref, llm.generate(PROMPTS, params))


def test_cuda_kv_depths_from_host_arrays_are_uploaded():
    """On a device, `KVStore.set_depth` uploads host arrays (any int dtype) and writes what a tensor write does."""
    ours = KVStore(10, 2, 1, 2, torch.float32, "cuda")
    ours.set_depth(np.array([7, 2, 9], np.int32), np.array([3, 1, 4], np.int32))
    ours.set_depth(np.array([5, 2]), 6)
    assert ours.depth[[7, 2, 9, 5]].tolist() == [3, 6, 4, 6]


def sync_free(fn, calls: Counter[str] | None = None, name: str = ""):
    """`fn` run under CUDA's sync-debug mode "error": any host-device synchronization inside it raises
    (`calls[name]` counts the calls)."""
    def run(*args):
        torch.cuda.set_sync_debug_mode("error")
        try:
            return fn(*args)
        finally:
            torch.cuda.set_sync_debug_mode("default")
            if calls is not None:
                calls[name] += 1
    return run


def assert_equal_outputs(ref, out) -> None:
    for a, b in zip(ref, out, strict=True):
        assert b.outputs[0].token_ids == a.outputs[0].token_ids
        assert b.outputs[0].exit_depths == a.outputs[0].exit_depths


@pytest.mark.parametrize("scheduler", ["cb", "cdb"])
@pytest.mark.parametrize("arch", ["ouro", "huginn"])
def test_cuda_graphs_match_the_reference_and_replay_without_waiting(arch, scheduler, tiny_ouro, tiny_huginn):
    """Core steps (and Huginn's prelude and coda) replayed from CUDA graphs (`cuda_graphs`, engine/graphs.py; five rows
    run padded to six) give the reference decoder's outputs, also after the block table was reallocated
    between runs (it never is by the engine with cuda_graphs; here by hand, so every graph is retired and
    captured again into a fresh pool); once the buckets a workload needs are captured, replaying them
    never makes the host wait (a third run of the workload runs its prelude, core and coda calls under
    sync-debug "error")."""
    path = tiny_ouro if arch == "ouro" else tiny_huginn
    kw = dict(dtype="float64", device="cuda", kv_cache_tokens=1024, max_decode_batch=5, prefill_chunk_size=8,
              max_num_batched_tokens=16, enable_prefix_caching=False)
    params = params_for(arch)
    ref = LLM(path, scheduler="reference", **kw).generate(PROMPTS, params)
    llm = LLM(path, scheduler=scheduler, cuda_graphs=True, **kw)
    engine = llm.engine
    assert engine is not None and engine.runner.graphs is not None
    tables = engine.kv.block_tables
    assert_equal_outputs(ref, llm.generate(PROMPTS, params))
    prepared = engine.stats.graph_buckets
    assert engine.stats.graph_capture_s > 0  # (the captures' time, which benchmarks report apart)
    tables.set_blocks(0, tables.table.shape[1], [0])  # one column more: the table is reallocated
    assert_equal_outputs(ref, llm.generate(PROMPTS, params))
    assert engine.stats.graph_buckets > prepared  # captured again
    captured = set(engine.runner.graphs.buckets)
    runner = engine.runner
    runner.prelude, runner.core, runner.coda = (sync_free(runner.prelude), sync_free(runner.core),
                                                sync_free(runner.coda))
    assert_equal_outputs(ref, llm.generate(PROMPTS, params))
    assert set(engine.runner.graphs.buckets) == captured
    assert any(width == 6 for _, width, _ in captured)
    assert {stage for stage, _, _ in captured} == ({"prelude", "core", "coda"} if arch == "huginn" else {"core"})


@pytest.mark.parametrize("arch", ["ouro", "huginn"])
def test_cuda_graphs_captured_at_start_up_serve_the_run_without_captures(arch, tiny_ouro, tiny_huginn):
    """`cuda_graph_warmup_tokens`: the buckets are captured when the engine is made (their batches of padding rows
    write only the scratch rows), a workload within those key counts captures nothing more and never waits for the
    device in its stage calls, and its outputs are the reference's."""
    path = tiny_ouro if arch == "ouro" else tiny_huginn
    kw = dict(dtype="float64", device="cuda", kv_cache_tokens=1024, max_decode_batch=5, prefill_chunk_size=8,
              max_num_batched_tokens=16, enable_prefix_caching=False)
    params = params_for(arch)
    ref = LLM(path, scheduler="reference", **kw).generate(PROMPTS, params)
    llm = LLM(path, scheduler="cdb", cuda_graphs=True, cuda_graph_warmup_tokens=64, **kw)
    engine = llm.engine
    assert engine is not None and engine.runner.graphs is not None
    warmed = set(engine.runner.graphs.buckets)
    assert warmed and engine.stats.graph_buckets == 0
    runner = engine.runner
    runner.prelude, runner.core, runner.coda = (sync_free(runner.prelude), sync_free(runner.core),
                                                sync_free(runner.coda))
    assert_equal_outputs(ref, llm.generate(PROMPTS, params))  # (the longest sequence: 30 + 8 tokens)
    assert engine.stats.graph_buckets == 0 and set(engine.runner.graphs.buckets) == warmed


@pytest.mark.parametrize("arch", ["ouro", "huginn"])
def test_cuda_bfloat16_graphs_run_what_a_gpu_runs(arch, tiny_ouro, tiny_huginn):
    """bf16, graphs on: the paths a served model takes on a GPU and the float64 tests do not (the fused decode
    attention's bf16 kernels, the stacked projections' strided views, the exit gate's fp32 head copy, Huginn's
    graphed prelude with like-init seeds) run every request to its length with valid tokens and depths, and
    agree with the eager engine on the first token (the prefill's, not graphed; in bf16 a padded batch may
    round differently, so later tokens may differ)."""
    path = tiny_ouro if arch == "ouro" else tiny_huginn
    kw = dict(dtype="bfloat16", device="cuda", kv_cache_tokens=1024, max_decode_batch=5, prefill_chunk_size=8,
              max_num_batched_tokens=16, scheduler="cdb")
    params = params_for(arch)
    eager = LLM(path, cuda_graphs=False, **kw).generate(PROMPTS, params)
    llm = LLM(path, **kw)
    assert llm.engine is not None and llm.engine.runner.graphs is not None
    graphed = llm.generate(PROMPTS, params)
    r_max, vocab = llm.config.r_max, llm.config.vocab_size
    for a, b in zip(eager, graphed, strict=True):
        got = b.outputs[0]
        assert a.outputs[0].finish_reason == got.finish_reason == "length" and len(got.token_ids) == 8
        assert got.token_ids[0] == a.outputs[0].token_ids[0]
        assert all(0 <= t < vocab for t in got.token_ids) and all(1 <= d <= r_max for d in got.exit_depths)


def test_cuda_step_latency_replays_a_captured_step(tiny_huginn):
    """`bench step-latency --cuda-graphs`: each timed rep is a replay of the captured core step, and a replay
    computes what the eager step computes."""
    from loopserve.engine.graphs import capture
    from loopserve.models.loader import load_model
    from loopserve_lab.bench.step_latency import core_inputs, step_latency

    model = load_model(tiny_huginn, dtype="float64", device="cuda").model
    with torch.inference_mode():
        state, inject, ctx = core_inputs(model, 3, 20)
        eager = model.core_step(state, inject, ctx)
        out = torch.zeros_like(eager)
        replay = capture(lambda: out.copy_(model.core_step(state, inject, ctx)), state.device)
        out.zero_()
        replay()
        torch.cuda.synchronize()
    assert torch.equal(out, eager)
    res = step_latency(model, [1, 4], [16], reps=2, progress=False, cuda_graphs=True)
    assert res["cuda_graphs"] and all(p["latency_s"] > 0 for p in res["points"])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_cuda_finite_rows_flags_what_isfinite_flags(dtype):
    """The sampler's finiteness check (a scaled sum, one matrix-vector product) is exact on the device too."""
    check_finite_rows(dtype, "cuda")


STRICT = {  # what runs under sync-debug "error": planning, queueing, and the host bookkeeping of a step
    "scheduler": ("schedule", "follow_up", "advance_core", "observe_core"),
    "runner": ("core", "prelude", "coda", "write_kv_depths"),  # coda: logits and device sampling queued
}


def workload(case: str) -> tuple[list[SamplingParams], dict]:
    """(params, engine knobs): live signals with lookahead; lookahead_gate beside gate, kl and trace
    (batches switch between pipelined and read-at-once); a KV pool small enough to preempt."""
    greedy = dict(max_tokens=12, temperature=0.0, ignore_eos=True)
    if case == "huginn":
        rule = dict(exit_policy="latent_diff", exit_threshold=0.8)
        return [SamplingParams(**greedy, **rule) for _ in PROMPTS], {"lookahead": True}
    if case == "lookahead":
        return [SamplingParams(**greedy, exit_policy="gate", exit_threshold=0.6) for _ in PROMPTS], {"lookahead": True}
    short = dict(greedy, max_tokens=3)  # once the gate and kl requests finish, batches pipeline
    rules = [dict(exit_policy="lookahead_gate", exit_threshold=0.5),
             dict(short, exit_policy="gate", exit_threshold=0.6),
             dict(short, exit_policy="kl", exit_threshold=0.01), dict(exit_trace=[2, 3, 1, 4]),
             dict(exit_policy="lookahead_gate", exit_threshold=0.3)]
    params = [SamplingParams(**{**greedy, **r}) for r in rules]
    if case == "mixed":
        return params, {}
    return params, {"kv_cache_tokens": 56, "block_size": 4, "kv_safety_margin": 0.0}  # "preempt"


@pytest.mark.parametrize("case", ["lookahead", "mixed", "preempt", "huginn"])
def test_planning_and_queueing_never_wait_for_the_device(case, tiny_ouro_la, tiny_huginn):
    """Planning, queueing and the per-step bookkeeping run under CUDA's sync-debug mode "error": any
    host-device synchronization inside them (a blocking copy, `.item()`, `.tolist()`) raises. Reading
    signals (`PendingSignals.get`) and sampled tokens (`PendingSamples.get`) is outside: that is where
    the engine waits on purpose."""
    params, knobs = workload(case)
    path = tiny_huginn if case == "huginn" else tiny_ouro_la
    llm = LLM(path, dtype="float32", device="cuda", max_decode_batch=4, cuda_graphs=False,  # (a capture waits)
              **{"kv_cache_tokens": 4096, **knobs})
    engine = llm.engine
    assert engine is not None
    calls: Counter[str] = Counter()
    for owner, names in STRICT.items():
        obj = getattr(engine, owner)
        for name in names:
            setattr(obj, name, sync_free(getattr(obj, name), calls, name))
    outs = llm.generate(PROMPTS, params)
    ref = LLM(path, scheduler="reference", dtype="float32", device="cuda", **knobs).generate(PROMPTS, params)
    for a, b in zip(ref, outs, strict=True):
        assert b.outputs[0].token_ids == a.outputs[0].token_ids
    assert all(calls[n] > 0 for n in ("schedule", "core", "prelude", "advance_core", "observe_core")), calls
    assert engine.stats.deferred_signal_ticks > 0
    if case == "preempt":
        assert engine.stats.preemptions > 0 and engine.stats.swap_ins > 0


def test_device_busy_counts_kernel_time_within_the_wall():
    """`DeviceBusy` (bench throughput --device-busy): a block of matmuls keeps the device busy for a
    positive time no longer than the block's wall time; a host sleep inside the block is not busy."""
    import time

    from loopserve_lab.bench.harness import DeviceBusy

    x = torch.randn(2048, 2048, device="cuda")
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    with DeviceBusy() as busy:
        for _ in range(20):
            x = (x @ x).tanh()
        time.sleep(0.2)
    wall = time.perf_counter() - t0
    assert busy.busy_s is not None and 0 < busy.busy_s < wall - 0.15
