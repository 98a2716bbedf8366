"""Helpers for the engine tests: cached float64 models, a workload driver that checks the
scheduler's invariants after every step, comparison against the sequential reference decoder, and the
sampler's finiteness check on extreme logits (run on the CPU and on a device)."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import torch

from loopserve import SamplingParams
from loopserve.engine.config import EngineConfig
from loopserve.engine.engine import LLMEngine
from loopserve.engine.reference import ReferenceDecoder
from loopserve.engine.sampler import finite_rows
from loopserve.engine.sequence import Sequence
from loopserve.model_config import HUGINN
from loopserve.models.loader import LoadedModel, load_model
from loopserve.outputs import RequestOutput

_LOADED: dict[tuple[Path, str | None], LoadedModel] = {}


def huginn_state(path: Path, state_init: str = "zero") -> str | None:
    """`state_init` for a Huginn checkpoint; None for another (Ouro has no initial state to choose)."""
    return state_init if json.loads((path / "config.json").read_text())["architectures"] == [HUGINN] else None


def loaded(path: Path, state_init: str = "zero") -> LoadedModel:
    key = (path, huginn_state(path, state_init))
    if key not in _LOADED:
        _LOADED[key] = load_model(path, "float64", "cpu", key[1])
    return _LOADED[key]


def make_engine(path: Path, state_init: str = "zero", seed: int = 0, **cfg) -> LLMEngine:
    cfg.setdefault("kv_cache_tokens", 512)  # the default (1 GiB of float64 KV) is slow to allocate
    m = loaded(path, state_init)
    return LLMEngine(m.model, m.tokenizer, EngineConfig(**cfg), seed=seed)


# -- driving a workload ------------------------------------------------------------------------------
@dataclass
class Req:
    rid: str
    prompt: list[int]
    params: SamplingParams
    seed: int
    arrive: int = 0  # engine step at which the request is added
    abort_at: int | None = None  # engine step before which it is aborted


def drive(engine: LLMEngine, reqs: list[Req], max_steps: int = 20_000) -> dict[str, RequestOutput]:
    """Add requests at their steps, abort at theirs, step to the end; check invariants every step."""
    pending = sorted(reqs, key=lambda r: r.arrive)
    outs: dict[str, RequestOutput] = {}
    seen: dict[str, list[int]] = {}  # tokens streamed so far per request
    step = 0
    while pending or engine.has_unfinished_requests():
        while pending and pending[0].arrive <= step:
            r = pending.pop(0)
            engine.add_request(r.rid, r.prompt, r.params, seed=r.seed)
        for r in reqs:
            if r.abort_at == step:
                engine.abort_request(r.rid)
        for o in engine.step():
            assert o.request_id not in outs, f"{o.request_id} reported after it finished"
            ids = o.outputs[0].token_ids
            assert ids[: len(seen.get(o.request_id, []))] == seen.get(o.request_id, []), "stream rewrote tokens"
            seen[o.request_id] = ids
            if o.finished:
                outs[o.request_id] = o
        engine.scheduler.check_invariants()
        step += 1
        assert step < max_steps, "workload did not finish"
    engine.scheduler.check_drained()
    assert engine.kv_usage() == 0 and not engine.requests
    assert set(outs) == {r.rid for r in reqs}, "a request never finished"
    # every kept core row is a loop of some request's token (aborted ones included)
    assert engine.stats.useful_core_rows == sum(o.metrics.loops_run for o in outs.values())
    return outs


def reference(engine: LLMEngine, req: Req) -> Sequence:
    dec = ReferenceDecoder(engine.model, engine.layout, engine.cfg.prefill_chunk_size)
    return dec.run(engine.make_sequence(req.rid, req.prompt, req.params, seed=req.seed))


def expected_loops(seq: Sequence) -> int:
    """Decode loops: the exit depth of every decode token, +1 for an early exit under lookahead."""
    rule = seq.rule
    return sum(d + (1 if rule.lookahead and d < rule.max_loops else 0) for d in seq.exit_depths[1:])


def assert_logprobs_close(got, want) -> None:
    assert (got is None) == (want is None)
    if got is None:
        return
    assert len(got) == len(want)
    for g, w in zip(got, want, strict=True):
        assert set(g) == set(w)
        for tok in g:
            assert math.isclose(g[tok].logprob, w[tok].logprob, rel_tol=1e-9, abs_tol=1e-9)
            assert g[tok].rank == w[tok].rank


def assert_matches(out: RequestOutput, ref: Sequence) -> None:
    """A finished request equals the reference; an aborted one is a prefix of it."""
    c = out.outputs[0]
    if c.finish_reason == "abort":
        k = len(c.token_ids)
        assert c.token_ids == ref.output_ids[:k] and c.exit_depths == ref.exit_depths[:k]
        return
    assert (c.token_ids, c.exit_depths, c.finish_reason) == (ref.output_ids, ref.exit_depths, ref.finish_reason)
    assert c.text == ref.text
    assert out.metrics.loops_run == ref.metrics.loops_run == expected_loops(ref)
    assert ref.metrics.prefill_loops == len(ref.prompt_ids) * ref.rule.max_loops
    # the engine computes the prompt tokens the prefix cache did not supply (never the last one)
    assert 0 <= out.num_cached_tokens < len(ref.prompt_ids)
    assert out.metrics.prefill_loops == (len(ref.prompt_ids) - out.num_cached_tokens) * ref.rule.max_loops
    assert_logprobs_close(c.logprobs, ref.logprobs)
    if c.cumulative_logprob is not None:
        assert math.isclose(c.cumulative_logprob, ref.cumulative_logprob, rel_tol=1e-9, abs_tol=1e-9)


def check_finite_rows(dtype: torch.dtype, device: str = "cpu") -> None:
    """`finite_rows` flags exactly the rows `isfinite(...).all` flags, extremes included: the largest
    finite values (a float32 or bf16 sum of them would overflow), both extremes in one row, a row of
    49,152 (Ouro's vocabulary) of the largest value."""
    g = torch.Generator().manual_seed(0)
    big = torch.finfo(dtype).max
    x = torch.randn(64, 300, generator=g, dtype=torch.float64).to(dtype)
    x[1:8] = big
    x[8:12] = -big
    for i, v in enumerate((float("nan"), float("inf"), float("-inf")), start=12):
        x[i, (i * 37) % 300] = v
    x[15, 3], x[15, 4] = float("inf"), float("-inf")
    x[16, :150], x[16, 150:] = big, -big  # both extremes in one finite row
    x = x.to(device)
    assert torch.equal(finite_rows(x), torch.isfinite(x).all(-1))
    assert finite_rows(x)[:12].all() and not finite_rows(x)[12:16].any()
    wide = torch.full((2, 49152), big, dtype=dtype, device=device)
    wide[1, 7] = float("nan")
    assert finite_rows(wide).tolist() == [True, False]
