"""Exactness of the batching engine: every scheduler x KV layout x exit policy, in float64, gives
each request exactly the tokens and exit depths of the sequential reference decoder (docs/design.md §5.1).

Workloads mix prompt lengths (chunked prefill), greedy and seeded sampling, requests that arrive
while others run, aborts, and a KV pool small enough to force preemption. Bookkeeping invariants
are checked after every step. Also: CB and CDB agree at full depth, and trace exits make CDB run
exactly the trace's savings fewer core rows than CB.
"""

from __future__ import annotations

import pytest

from loopserve import LLM, SamplingParams
from loopserve.engine.held_tokens import HOLD
from loopserve.engine.sequence import Sequence
from loopserve.sampling_params import RequestOutputKind
from tests.engine_helpers import Req, assert_logprobs_close, assert_matches, drive, huginn_state, make_engine, reference

SCHEDULERS = ("cb", "cdb-norefill", "cdb")
LAYOUTS = ("depth_indexed", "last_exited", "shared")
POLICIES = ("fixed", "signal", "trace", "lookahead")  # signal: Ouro's gate, Huginn's latent diff
# Huginn's latent-diff threshold: on the tiny checkpoint ||s_r - s_r-1|| / ||s_r|| falls below 0.8
# after 2-5 loops for many tokens (measured), so exits really happen.
HUGINN_LATENT = 0.8
OURO_GATE = (0.5, 0.7, 0.9)




# -- the matrix -----------------------------------------------------------------------------------------
def policy_kwargs(arch: str, policy: str, i: int, r_max: int) -> dict:
    traces = ([1, 3, 2, r_max, 1, 2], [2, 2, 1], [r_max, 1, 1, 3, 2, 1, 2, 1, 3], [], [3, 1, 2, 2])
    if policy == "fixed":
        return {"exit_policy": "fixed"}
    if policy == "trace" or (policy == "lookahead" and i % 3 == 2):
        return {"exit_trace": traces[i % len(traces)]}
    if arch == "ouro":
        return {"exit_policy": "gate", "exit_threshold": OURO_GATE[i % 3]}
    return {"exit_policy": "latent_diff", "exit_threshold": HUGINN_LATENT}


def matrix_workload(arch: str, policy: str, r_max: int) -> list[Req]:
    """Six requests: long (chunked) and short prompts, greedy and sampled, late arrivals, aborts."""
    lens = (19, 3, 11, 1, 6, 9)
    sampling = (
        dict(temperature=0.0, logprobs=3, max_tokens=8),
        dict(temperature=0.8, seed=7, max_tokens=10),  # seeded by the request's params
        dict(temperature=1.0, max_tokens=7, logprobs=0),  # seeded by the request's own seed
        dict(temperature=0.0, max_tokens=9, min_loops=2, max_loops=r_max - 1),
        dict(temperature=0.7, top_k=50, max_tokens=10, ignore_eos=True),
        dict(temperature=0.0, max_tokens=6, max_loops=r_max - 2),
    )
    arrive = (0, 0, 3, 6, 0, 4)
    abort_at = (None, None, None, None, 14, 5)  # r4 mid-decode; r5 right after it arrived
    reqs = []
    for i, n in enumerate(lens):
        prompt = [(37 * i + 11 * j + 5) % 470 + 1 for j in range(n)]
        params = SamplingParams(**sampling[i], **policy_kwargs(arch, policy, i, r_max))
        reqs.append(Req(f"r{i}", prompt, params, seed=1000 + 17 * i, arrive=arrive[i], abort_at=abort_at[i]))
    return reqs


MATRIX_CFG = dict(block_size=4, kv_cache_tokens=36, max_num_seqs=4, max_decode_batch=3, prefill_chunk_size=8,
                  max_num_batched_tokens=8, min_coda_batch=2, kv_safety_margin=0.1)
_REFS: dict[tuple, Sequence] = {}


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("scheduler", SCHEDULERS)
@pytest.mark.parametrize("arch", ["ouro", "huginn"])
def test_matrix_matches_reference(arch, scheduler, layout, policy, tiny_ouro, tiny_huginn):
    path, state_init = (tiny_ouro, "zero") if arch == "ouro" else (tiny_huginn, "like-init")
    engine = make_engine(path, state_init, scheduler=scheduler, kv_layout=layout,
                         lookahead=policy == "lookahead", **MATRIX_CFG)
    reqs = matrix_workload(arch, policy, engine.model_config.r_max)
    outs = drive(engine, reqs)
    for r in reqs:
        key = (arch, layout, policy, r.rid)
        if key not in _REFS:
            _REFS[key] = reference(engine, r)
        assert_matches(outs[r.rid], _REFS[key])
    assert outs["r5"].outputs[0].finish_reason == "abort"
    assert outs["r4"].outputs[0].finish_reason == "abort" and outs["r4"].outputs[0].token_ids
    done = [o for o in outs.values() if o.outputs[0].finish_reason != "abort"]
    assert len(done) == 4
    # the pool (9 blocks) is too small for the workload: requests were swapped out and back in
    assert engine.stats.preemptions > 0 and engine.stats.swap_ins > 0


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("scheduler", ["cb", "cdb"])
@pytest.mark.parametrize("arch", ["ouro", "huginn"])
def test_accelerator_paths_on_the_cpu_match_the_reference(arch, scheduler, layout, tiny_ouro, tiny_huginn,
                                                          monkeypatch):
    """What runs on CUDA, forced on the CPU: stacked projections as one matmul, decode attention as one fused
    call over gathered K and V (every layout's read rule feeds its mask and rows), steps and codas padded to
    graph buckets. Each request still gets the reference decoder's tokens and exit depths (the reference of
    the CPU's own paths: the accelerator's math is the same attention, to float64 rounding)."""
    from loopserve.models import layers

    path, state_init = (tiny_ouro, "zero") if arch == "ouro" else (tiny_huginn, "like-init")
    engine = make_engine(path, state_init, scheduler=scheduler, kv_layout=layout, cuda_graphs=True, **MATRIX_CFG)
    reqs = matrix_workload(arch, "signal", engine.model_config.r_max)
    refs = {r.rid: reference(engine, r) for r in reqs}
    monkeypatch.setattr(layers, "SDPA_DECODE_DEVICES", ("cpu",))
    monkeypatch.setattr(layers, "PER_PART_DEVICES", ())
    fused: list[int] = []
    sdpa = layers._sdpa_decode
    monkeypatch.setattr(layers, "_sdpa_decode", lambda q, *a: fused.append(len(q)) or sdpa(q, *a))
    outs = drive(engine, reqs)
    assert fused  # (the fused attention ran)
    for r in reqs:
        assert_matches(outs[r.rid], refs[r.rid])


# -- through the public API: LLM(scheduler=s) against LLM(scheduler="reference") ------------------------
def mixed_params(arch: str, r_max: int) -> list[SamplingParams]:
    signal = ({"exit_threshold": 0.6} if arch.startswith("ouro") else
              {"exit_policy": "latent_diff", "exit_threshold": HUGINN_LATENT})
    return [
        SamplingParams(temperature=0, max_tokens=8, **signal),
        SamplingParams(temperature=0.9, seed=3, max_tokens=6, exit_trace=[2, 1, r_max, 3]),
        SamplingParams(temperature=1.0, max_tokens=7, exit_policy="fixed", max_loops=r_max - 1),
        SamplingParams(temperature=0, max_tokens=5, min_loops=2, logprobs=2, **signal),
        SamplingParams(temperature=0.6, top_p=0.9, max_tokens=8, **signal),
    ]


PROMPTS = [list(range(7, 30)), [45], [300, 301, 302, 9], list(range(100, 112)), [88, 77, 66, 55, 44, 33]]


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("scheduler", SCHEDULERS)
@pytest.mark.parametrize("arch", ["ouro", "ouro_gqa", "huginn", "huginn_242"])
def test_generate_matches_reference_llm(arch, scheduler, layout, tiny_ouro, tiny_ouro_gqa, tiny_huginn,
                                        tiny_huginn_242):
    path = {"ouro": tiny_ouro, "ouro_gqa": tiny_ouro_gqa, "huginn": tiny_huginn, "huginn_242": tiny_huginn_242}[arch]
    common = dict(dtype="float64", state_init=huginn_state(path), seed=5, kv_layout=layout, prefill_chunk_size=8)
    ref_llm = LLM(path, scheduler="reference", **common)
    llm = LLM(path, scheduler=scheduler, max_decode_batch=2, max_num_batched_tokens=10, block_size=4,
              kv_cache_tokens=48, **common)
    params = mixed_params(arch, llm.config.r_max)
    want = ref_llm.generate(PROMPTS, params)
    got = llm.generate(PROMPTS, params)
    for g, w in zip(got, want, strict=True):
        gc, wc = g.outputs[0], w.outputs[0]
        assert (gc.token_ids, gc.exit_depths, gc.finish_reason, gc.text) == (
            wc.token_ids, wc.exit_depths, wc.finish_reason, wc.text)
        assert g.metrics.loops_run == w.metrics.loops_run
        assert_logprobs_close(gc.logprobs, wc.logprobs)
    assert llm.engine.kv_usage() == 0


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("scheduler", ["cb", "cdb"])
def test_a_token_budget_below_the_chunk_size_caps_every_prefill_and_stays_exact(scheduler, layout, tiny_ouro):
    """max_num_batched_tokens below prefill_chunk_size lowers the chunk to it (vLLM caps every step at the budget; it
    was raised to the chunk, so a step prefilled 8 tokens for a budget of 3): the reference decoder chunks by the
    same config, so even `shared`, whose math depends on the chunk starts, matches it."""
    common = dict(dtype="float64", seed=5, kv_layout=layout, prefill_chunk_size=8, max_num_batched_tokens=3)
    ref_llm = LLM(tiny_ouro, scheduler="reference", **common)
    llm = LLM(tiny_ouro, scheduler=scheduler, max_decode_batch=2, block_size=4, kv_cache_tokens=48, **common)
    assert llm.engine_config.prefill_chunk_size == ref_llm.engine_config.prefill_chunk_size == 3
    params = mixed_params("ouro", llm.config.r_max)
    want = ref_llm.generate(PROMPTS, params)
    got = llm.generate(PROMPTS, params)
    for g, w in zip(got, want, strict=True):
        gc, wc = g.outputs[0], w.outputs[0]
        assert (gc.token_ids, gc.exit_depths, gc.finish_reason) == (wc.token_ids, wc.exit_depths, wc.finish_reason)
        assert_logprobs_close(gc.logprobs, wc.logprobs)
    assert max(llm.engine.stats.batch_hist["prefill"]) <= 3


@pytest.mark.parametrize("cuda_graphs", [False, True])
@pytest.mark.parametrize("scheduler", SCHEDULERS)
def test_huginn_kl_policy(scheduler, cuda_graphs, tiny_huginn):
    """The KL policy runs the coda after every step (writing coda KV) and still matches, also when the steps
    and codas run padded (engine/graphs.py: the KL coda then needs the step's own context, built for it)."""
    common = dict(dtype="float64", state_init="like-init", kv_layout="last_exited", prefill_chunk_size=8,
                  kv_cache_tokens=256)
    params = [SamplingParams(temperature=t, max_tokens=6, exit_policy="kl", exit_threshold=0.01, min_loops=m)
              for t, m in ((0, None), (0.8, 2), (0, None))]
    want = LLM(tiny_huginn, scheduler="reference", **common).generate(PROMPTS[:3], params)
    got = LLM(tiny_huginn, scheduler=scheduler, max_decode_batch=2, cuda_graphs=cuda_graphs,
              **common).generate(PROMPTS[:3], params)
    assert [o.outputs[0].exit_depths for o in got] == [o.outputs[0].exit_depths for o in want]
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]
    assert any(d < 6 for o in want for d in o.outputs[0].exit_depths)


# -- stops: eos, stop token ids, stop strings ------------------------------------------------------------
@pytest.mark.parametrize("scheduler", SCHEDULERS)
@pytest.mark.parametrize("arch", ["ouro", "huginn"])
def test_stops_match_reference(arch, scheduler, tiny_ouro, tiny_huginn):
    path = tiny_ouro if arch == "ouro" else tiny_huginn
    common = dict(dtype="float64", state_init=huginn_state(path), kv_layout="depth_indexed", kv_cache_tokens=256)
    ref_llm = LLM(path, scheduler="reference", **common)
    free = SamplingParams(temperature=0.9, seed=11, max_tokens=10)
    probe = ref_llm.generate(PROMPTS[:3], [free] * 3)  # what the requests say when nothing stops them
    ids = [o.outputs[0].token_ids for o in probe]
    eos = ids[0][4]  # make one of the model's own tokens an eos id for both tokenizers
    text = probe[2].outputs[0].text
    stop = next(ch for ch in text[3:] if ch.isprintable() and not ch.isspace() and ch != "\ufffd")
    params = [
        SamplingParams(temperature=0.9, seed=11, max_tokens=10),  # eos (patched below)
        SamplingParams(temperature=0.9, seed=11, max_tokens=10, stop_token_ids=[ids[1][3]]),
        SamplingParams(temperature=0.9, seed=11, max_tokens=10, stop=[stop]),
        SamplingParams(temperature=0.9, seed=11, max_tokens=10, ignore_eos=True),
    ]
    llm = LLM(path, scheduler=scheduler, max_decode_batch=3, **common)
    ref_llm = LLM(path, scheduler="reference", **common)  # fresh request counter: same seeds
    for t in (llm.tokenizer, ref_llm.tokenizer):
        t.eos_token_ids = set(t.eos_token_ids) | {eos}
    prompts = PROMPTS[:3] + PROMPTS[:1]
    want = ref_llm.generate(prompts, params)
    got = llm.generate(prompts, params)
    for g, w in zip(got, want, strict=True):
        assert (g.outputs[0].token_ids, g.outputs[0].text, g.outputs[0].finish_reason, g.outputs[0].stop_reason) == (
            w.outputs[0].token_ids, w.outputs[0].text, w.outputs[0].finish_reason, w.outputs[0].stop_reason)
    assert [o.outputs[0].finish_reason for o in want[:3]] == ["stop"] * 3
    assert len(want[0].outputs[0].token_ids) <= 5 and want[0].outputs[0].token_ids[-1] == eos
    assert want[2].outputs[0].text.find(stop) == -1
    assert want[3].outputs[0].finish_reason == "length"  # ignore_eos: runs past the patched eos


# -- chunked prefill, tight token budget, min_coda_batch > 1 ----------------------------------------------
@pytest.mark.parametrize("lookahead", [False, True])
@pytest.mark.parametrize("min_coda_batch", [2, 3])
def test_cdb_chunked_prefill_and_min_coda_batch(min_coda_batch, lookahead, tiny_ouro):
    engine = make_engine(tiny_ouro, scheduler="cdb", kv_layout="last_exited", prefill_chunk_size=4,
                         max_num_batched_tokens=5, min_coda_batch=min_coda_batch, max_decode_batch=4,
                         lookahead=lookahead)
    reqs = [Req(f"q{i}", [(13 * i + 7 * j) % 400 + 3 for j in range(n)],
                SamplingParams(temperature=0.5 * (i % 2), max_tokens=6 + i, exit_threshold=0.6), seed=i,
                arrive=2 * i)
            for i, n in enumerate((17, 2, 9, 5, 13))]
    outs = drive(engine, reqs)
    for r in reqs:
        assert_matches(outs[r.rid], reference(engine, r))
    assert engine.stats.ticks["prefill"] > 17 // 4  # the long prompt took several ticks
    assert max(engine.stats.batch_hist["coda"]) > 1


def test_engines_resolve_the_boundary_batches_for_their_model(tiny_huginn, tiny_ouro):
    """An engine runs with the boundary batches its model's layers call for (`EngineConfig.boundary_batches_for`):
    a Huginn with prelude and coda blocks waits for a quarter and a half of a batch, a fully looped Ouro for 1."""
    huginn = make_engine(tiny_huginn, scheduler="cdb", max_decode_batch=8)
    assert (huginn.cfg.min_prelude_batch, huginn.cfg.min_coda_batch) == (2, 4)
    ouro = make_engine(tiny_ouro, scheduler="cdb", max_decode_batch=8)
    assert (ouro.cfg.min_prelude_batch, ouro.cfg.min_coda_batch) == (1, 1)


def test_cdb_min_prelude_batch(tiny_huginn):
    """A prelude batch of its own (fresh tokens the core batch had no room for when their coda ran; room
    appears as tokens exit, before their coda runs) waits for `min_prelude_batch` tokens while the core batch
    has work: with 1 such batches run a token or two at a time, with 3 never under 3 (fewer prelude batches
    in all); outputs stay the reference's either way."""
    reqs = [Req(f"p{i}", [(11 * i + 5 * j) % 300 + 3 for j in range(2 + i % 3)],
                SamplingParams(temperature=0.6 * (i % 2), max_tokens=5 + i % 4, ignore_eos=True,
                               exit_policy="latent_diff", exit_threshold=0.8), seed=i)
            for i in range(10)]
    own, preludes = {}, {}
    for floor in (1, 3):
        engine = make_engine(tiny_huginn, scheduler="cdb", max_decode_batch=6, min_coda_batch=3,
                             min_prelude_batch=floor)
        for r in reqs:
            engine.add_request(r.rid, r.prompt, r.params, seed=r.seed)
        batches: list = []
        engine.stage_hooks.append(batches.append)
        own[floor], outs = [], {}  # own: rows of each prelude batch that opened a step beside a working core batch
        while engine.has_unfinished_requests():
            core, batches[:] = len(engine.scheduler.core_rows), []
            for o in engine.step():
                if o.finished:
                    outs[o.request_id] = o
            if core and batches and batches[0].stage.value == "prelude":
                own[floor].append(batches[0].rows)
        preludes[floor] = engine.stats.ticks["prelude"]
        for r in reqs:
            assert_matches(outs[r.rid], reference(engine, r))
    assert own[1] and min(own[1]) < 3  # the workload makes small preludes of their own
    assert all(rows >= 3 for rows in own[3]), own[3]
    assert preludes[3] < preludes[1]


# -- CB vs CDB ------------------------------------------------------------------------------------------------
FULL_DEPTH = [pytest.param({"exit_policy": "fixed"}, id="fixed"),
              pytest.param({"exit_policy": "gate", "exit_threshold": 1.0}, id="gate-1.0")]


@pytest.mark.parametrize("exits", FULL_DEPTH)
def test_cdb_at_full_depth_equals_cb(exits, tiny_ouro):
    prompts = [[5, 6, 7, 8, 9, 10, 11], [40, 41], list(range(100, 121)), [300, 301, 302, 303]]
    reqs = [Req(f"f{i}", p, SamplingParams(temperature=0.7 * (i % 2), max_tokens=8, ignore_eos=True, **exits),
                seed=i, arrive=i) for i, p in enumerate(prompts)]
    results = {}
    for sched in ("cb", "cdb-norefill", "cdb"):
        engine = make_engine(tiny_ouro, scheduler=sched, max_decode_batch=3)
        outs = drive(engine, reqs)
        results[sched] = ([outs[r.rid].outputs[0].token_ids for r in reqs],
                          [outs[r.rid].outputs[0].exit_depths for r in reqs], engine.stats)
    cb_tokens, cb_depths, cb = results["cb"]
    items = len(reqs) * 7  # decode work items: every generated token after the first
    for sched in ("cdb-norefill", "cdb"):
        tokens, depths, st = results[sched]
        assert tokens == cb_tokens and depths == cb_depths
        assert st.useful_core_rows == st.rows["core"] == items * 4
    assert all(d == 4 for ds in cb_depths for d in ds)
    assert cb.useful_core_rows == cb.rows["core"] == items * 4


TRACES = [[1, 2, 4, 1, 3, 2, 1], [4, 4, 1], [2, 1, 1, 1, 1, 3, 2, 4], []]  # (at most r_max: past it is refused)


def trace_depths(trace: list[int], items: int, max_loops: int, min_loops: int = 1) -> list[int]:
    """Depth of each decode item under a trace: clamped, full depth past the trace's end."""
    return [min(max(trace[k], min_loops), max_loops) if k < len(trace) else max_loops for k in range(items)]


@pytest.mark.parametrize("lookahead", [False, True])
@pytest.mark.parametrize("arch", ["ouro", "huginn"])
def test_trace_savings_exact(arch, lookahead, tiny_ouro, tiny_huginn):
    path = tiny_ouro if arch == "ouro" else tiny_huginn
    max_tokens = 8
    stats, tokens = {}, {}
    for sched in ("cb", "cdb-norefill", "cdb"):
        engine = make_engine(path, scheduler=sched, max_decode_batch=4, lookahead=lookahead)
        r_max = engine.model_config.r_max
        reqs = [Req(f"t{i}", [3 + i, 50 + 7 * i, 9, 120 + i][: i + 1],
                    SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, exit_trace=t), seed=i)
                for i, t in enumerate(TRACES)]
        outs = drive(engine, reqs)
        stats[sched], tokens[sched] = engine.stats, [outs[r.rid].outputs[0].token_ids for r in reqs]
        for r in reqs:
            want = trace_depths(r.params.exit_trace, max_tokens - 1, r_max)
            assert outs[r.rid].outputs[0].exit_depths == [r_max] + want
    assert tokens["cb"] == tokens["cdb-norefill"] == tokens["cdb"]
    depths = [d for t in TRACES for d in trace_depths(t, max_tokens - 1, r_max)]
    extra = sum(d < r_max for d in depths) if lookahead else 0  # delayed decision: one more loop
    useful = sum(depths) + extra
    savings = sum(r_max - d for d in depths) - extra
    assert savings > 0
    for sched in ("cb", "cdb-norefill", "cdb"):
        assert stats[sched].useful_core_rows == useful
    assert stats["cdb"].rows["core"] == stats["cdb-norefill"].rows["core"] == useful
    assert stats["cb"].rows["core"] == len(depths) * r_max  # every item computed to full depth
    assert stats["cb"].rows["core"] - stats["cdb"].rows["core"] == savings


# -- quiet tokens held by slot (`HeldTokens`) over many steps ---------------------------------------------
@pytest.mark.parametrize("scheduler", SCHEDULERS)
def test_long_quiet_outputs_match_reference(scheduler, tiny_ouro):
    """Requests whose tokens are mostly held by slot between steps (final-only, no logprobs or stop strings)
    for more than `HOLD` tokens at a time, beside ones that read their tokens at every step (penalties,
    a stop token, logprobs), one aborted while it holds tokens and a later one taking its slot (few slots:
    `max_num_seqs`): each equals the reference decoder, its loops and exit depths too."""
    engine = make_engine(tiny_ouro, scheduler=scheduler, max_decode_batch=3, max_num_seqs=3, kv_cache_tokens=1024)
    n = 2 * HOLD + 7
    quiet = dict(ignore_eos=True, output_kind=RequestOutputKind.FINAL_ONLY)
    params = [SamplingParams(temperature=0, max_tokens=HOLD + 3, **quiet),  # aborted below
              SamplingParams(temperature=0, max_tokens=n, **quiet),
              SamplingParams(temperature=0.8, seed=5, max_tokens=n, exit_threshold=0.6, **quiet),
              SamplingParams(temperature=0.8, seed=6, max_tokens=n, presence_penalty=0.5, **quiet),
              SamplingParams(temperature=0.7, seed=8, max_tokens=n, logprobs=1, **quiet),
              SamplingParams(temperature=0.9, seed=9, max_tokens=n, stop_token_ids=[7, 11],
                             output_kind=RequestOutputKind.FINAL_ONLY),
              SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)]  # streamed: reads every token
    reqs = [Req(f"h{i}", [5 + 3 * i, 40 + i, 9][: 1 + i % 3], p, seed=i, arrive=i,
                abort_at=3 * HOLD // 2 if i == 0 else None) for i, p in enumerate(params)]
    outs = drive(engine, reqs)
    for r in reqs:
        assert_matches(outs[r.rid], reference(engine, r))
    assert outs["h0"].outputs[0].finish_reason == "abort" and len(outs["h0"].outputs[0].token_ids) > 1
    assert len(outs["h1"].outputs[0].token_ids) == n


def test_prompt_admitted_again_into_another_slot_keeps_its_tokens(tiny_ouro):
    """A partly prefilled prompt whose KV is dropped (`_drop_partial_prefill`) and that is admitted again
    into another block-table slot holds its quiet tokens there, and a new request taking its old slot
    takes nothing of them: it equals the reference decoder."""
    final = dict(ignore_eos=True, output_kind=RequestOutputKind.FINAL_ONLY)
    engine = make_engine(tiny_ouro, prefill_chunk_size=16, max_num_batched_tokens=16, kv_cache_tokens=1024)
    sched = engine.scheduler
    a = Req("A", [(3 * i + 1) % 50 + 2 for i in range(48)], SamplingParams(temperature=0, max_tokens=2 * HOLD,
                                                                          **final), seed=2)
    engine.add_request("X", [5, 6, 7, 8, 9], SamplingParams(max_tokens=50, **final), seed=1)
    engine.add_request(a.rid, a.prompt, a.params, seed=a.seed)
    outs: dict = {}
    for _ in range(50):  # until A's prompt is partly prefilled
        outs.update({o.request_id: o for o in engine.step() if o.finished})
        if "A" in sched.running and "A" not in sched.prefilling and any(s.request_id == "A" for s in sched.waiting):
            break
    first = engine.kv.slot("A")
    assert sched._drop_partial_prefill()
    engine.abort_request("X")  # X's slot is freed after A's: A's next admission takes it
    outs.update({o.request_id: o for o in engine.step() if o.finished})
    assert engine.kv.slot("A") != first
    engine.add_request("D", [11, 12, 13], SamplingParams(max_tokens=5, **final), seed=3)  # into A's old slot
    for _ in range(20 * HOLD):  # (A: 2 * HOLD tokens of up to r_max core ticks and a coda each)
        if not engine.has_unfinished_requests():
            break
        outs.update({o.request_id: o for o in engine.step() if o.finished})
        sched.check_invariants()
    assert_matches(outs["A"], reference(engine, a))
    assert len(outs["D"].outputs[0].token_ids) == 5
