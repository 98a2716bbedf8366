"""The engine on a CUDA device (skipped where there is none; `scripts/gpu_check.sh` runs it on a lent
GPU): the same code gives the reference decoder's outputs, and queueing a pipelined core step
(lookahead) or planning the next tick never makes the host wait for the device."""

from __future__ import annotations

import pytest
import torch

from loopserve import LLM, SamplingParams

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

PROMPTS = [[5, 17, 99, 3], [8, 1, 2], list(range(10, 40)), [44], [7, 7, 7, 7, 7, 7]]


def params_for(arch: str) -> list[SamplingParams]:
    rule = dict(exit_policy="gate", exit_threshold=0.6) if arch == "ouro" else dict(
        exit_policy="latent_diff", exit_threshold=0.8)
    return [SamplingParams(max_tokens=8, temperature=0.0 if i % 2 else 0.9, seed=i, ignore_eos=True, **rule)
            for i in range(len(PROMPTS))]


@pytest.mark.parametrize("lookahead", [False, True])
@pytest.mark.parametrize("scheduler", ["cb", "cdb-norefill", "cdb"])
@pytest.mark.parametrize("arch", ["ouro", "huginn"])
def test_cuda_engine_matches_the_reference(arch, scheduler, lookahead, tiny_ouro, tiny_huginn):
    path = tiny_ouro if arch == "ouro" else tiny_huginn
    kw = dict(dtype="float64", device="cuda", kv_cache_tokens=1024, max_decode_batch=3, lookahead=lookahead,
              prefill_chunk_size=8, max_num_batched_tokens=16)
    params = params_for(arch)
    ref = LLM(path, scheduler="reference", **kw).generate(PROMPTS, params)
    out = LLM(path, scheduler=scheduler, **kw).generate(PROMPTS, params)
    for a, b in zip(ref, out, strict=True):
        assert b.outputs[0].token_ids == a.outputs[0].token_ids
        assert b.outputs[0].exit_depths == a.outputs[0].exit_depths


@pytest.mark.parametrize("arch", ["ouro", "huginn"])
def test_planning_and_queueing_core_steps_never_wait_for_the_device(arch, tiny_ouro, tiny_huginn):
    """With lookahead, `schedule()` and queueing a core step run under CUDA's sync-debug mode "error":
    any host-device synchronization inside them (a blocking copy, `.item()`, `.tolist()`) raises."""
    path = tiny_ouro if arch == "ouro" else tiny_huginn
    llm = LLM(path, dtype="float32", device="cuda", kv_cache_tokens=4096, max_decode_batch=4, lookahead=True)
    engine = llm.engine
    assert engine is not None
    core, schedule = engine.runner.core, engine.scheduler.schedule
    checked = {"core": 0, "schedule": 0}

    def strict(fn, name):
        def run(*args):
            torch.cuda.set_sync_debug_mode("error")
            try:
                out = fn(*args)
            finally:
                torch.cuda.set_sync_debug_mode("default")
            checked[name] += 1
            return out
        return run

    engine.runner.core = strict(core, "core")  # type: ignore[method-assign]
    engine.scheduler.schedule = strict(schedule, "schedule")  # type: ignore[method-assign]
    outs = llm.generate(PROMPTS, params_for(arch))
    assert all(o.finished for o in outs)
    assert checked["core"] > 10 and engine.stats.deferred_signal_ticks > 10
