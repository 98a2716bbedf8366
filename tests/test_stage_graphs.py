"""Core steps and codas with layers on static, bucketed buffers (`engine/graphs.py`, what CUDA graphs
replay): padding the batch and its key count changes no request's tokens or exit depths, and the buckets
are what they claim.
On the CPU the padded stages run eagerly, the same code a graph records; tests/test_cuda.py replays the
graphs on a GPU."""

from __future__ import annotations

import dataclasses
import logging

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from loopserve import SamplingParams
from loopserve.cache.block_table import BlockTables
from loopserve.engine.graphs import bucket
from tests.engine_helpers import Req, assert_matches, drive, make_engine, reference
from tests.test_engine_exact import matrix_workload

BASE = dict(block_size=4, max_decode_batch=5, prefill_chunk_size=8, max_num_batched_tokens=8, min_coda_batch=2,
            kv_safety_margin=0.1, cuda_graphs=True)
# wide: five sequences resident (a batch of 5 runs padded to 6: the prompts arrive at once and are prefilled
# several a tick, since a prefill tick waits for the tokens in flight at the last one); small: a pool of 9 blocks
# preempts. Keys are
# bucketed by block (1, 2, 3, 4, 6, 8, ... blocks of 4, at most the table's width)
POOLS = {"wide": dict(kv_cache_tokens=400, max_num_seqs=6, max_num_batched_tokens=64),
         "small": dict(kv_cache_tokens=36, max_num_seqs=5)}


@pytest.mark.parametrize("layout", ["depth_indexed", "last_exited", "shared"])
@pytest.mark.parametrize("scheduler", ["cb", "cdb-norefill", "cdb"])
@pytest.mark.parametrize("arch,policy,pool", [("ouro", "signal", "wide"), ("ouro", "lookahead", "wide"),
                                              ("huginn", "signal", "wide"), ("ouro", "signal", "small")])
def test_padded_stages_match_reference(arch, policy, pool, scheduler, layout, tiny_ouro, tiny_huginn):
    path, state_init = (tiny_ouro, "zero") if arch == "ouro" else (tiny_huginn, "like-init")
    engine = make_engine(path, state_init, scheduler=scheduler, kv_layout=layout, lookahead=policy == "lookahead",
                         **{**BASE, **POOLS[pool]})
    reqs = matrix_workload(arch, policy, engine.model_config.r_max)
    if pool == "wide":  # (all at once, so that five decode together)
        reqs = [dataclasses.replace(r, arrive=0) for r in reqs]
    outs = drive(engine, reqs)
    for r in reqs:
        assert_matches(outs[r.rid], reference(engine, r))
    graphs = engine.runner.graphs
    assert graphs is not None
    widths = {w for _, w, _ in graphs.buckets}
    assert widths <= {1, 2, 3, 4, 6}
    stages = {stage for stage, _, _ in graphs.buckets}
    # (Ouro's prelude and coda have no layers: eager)
    assert stages == ({"prelude", "core", "coda"} if arch == "huginn" else {"core"})
    if pool == "wide":
        assert 6 in widths  # five rows ran padded to six
    else:
        assert engine.stats.preemptions > 0


def test_cuda_graphs_are_on_by_default_only_on_cuda(tiny_ouro):
    """Unset, `cuda_graphs` is on for CUDA (tests/test_cuda.py) and off here: eager steps on the CPU."""
    engine = make_engine(tiny_ouro, scheduler="cdb", kv_cache_tokens=256)
    assert engine.cfg.cuda_graphs is False and engine.runner.graphs is None
    assert make_engine(tiny_ouro, scheduler="cdb", kv_cache_tokens=256, cuda_graphs=True).runner.graphs is not None


def test_block_table_never_moves_and_graphs_are_retired_if_it_does(tiny_ouro, caplog):
    """A graph reads the block table at the address it was captured with. With cuda_graphs the table is
    as wide as the longest sequence from the start, so it never grows; reallocated anyway, every prepared
    bucket is retired and prepared again when next needed. On the CPU the engine says it captures nothing."""
    with caplog.at_level(logging.WARNING, logger="loopserve.engine"):
        engine = make_engine(tiny_ouro, scheduler="cb", block_size=4, kv_cache_tokens=1024, max_num_seqs=5,
                             max_decode_batch=5, cuda_graphs=True)
    assert "nothing to capture" in caplog.text
    graphs, tables = engine.runner.graphs, engine.kv.block_tables
    assert graphs is not None
    table = tables.table
    capacity = engine.kv.num_blocks * 4  # tokens (the pool less its scratch block)
    assert table.shape[1] == -(-min(engine.model_config.max_position, capacity) // 4)
    params = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True, exit_policy="fixed")
    for i in range(5):
        engine.add_request(f"r{i}", [(7 * i + j) % 300 + 1 for j in range(60)], params)
    while not graphs.buckets:
        engine.step()
    (first,) = graphs.buckets
    assert first == ("core", 6, 64)  # five rows padded to six; keys 61-64: 16 blocks
    assert engine.stats.graph_buckets == 1
    tables.set_blocks(0, table.shape[1], [0])  # one column more: the table is reallocated
    core = engine.stats.ticks["core"]
    while engine.stats.ticks["core"] == core:
        engine.step()
    assert graphs.buckets == [first] and engine.stats.graph_buckets == 2  # the same bucket, prepared again
    while engine.has_unfinished_requests():
        engine.step()
    assert tables.table is not table and engine.stats.graph_buckets == 3  # then only keys 65-90 (96): one bucket more


class DetachedTables(BlockTables):
    """A CPU block table kept apart from its host array, as a device's is: host changes reach it by `sync`."""

    def _alloc(self, num_slots, max_blocks, keep=None):
        super()._alloc(num_slots, max_blocks, keep)
        self.shares_host, self.table = False, self.table.clone()


@pytest.mark.parametrize("scheduler", ["cb", "cdb"])
def test_replayed_steps_read_the_blocks_allocated_since_the_last_step(scheduler, tiny_ouro):
    """A replayed decode step builds no attention context, which is what brings an eager step's device table up
    to date, and an Ouro decode tick builds none elsewhere either (its prelude and coda attend to nothing): the
    graphs sync the table themselves. (The first GPU run caught them reading stale entries once a sequence
    crossed into a new block; here the CPU table is detached from its host array, as a device's is.)"""
    engine = make_engine(tiny_ouro, scheduler=scheduler, block_size=4, kv_cache_tokens=400, max_num_seqs=5,
                         max_decode_batch=5, cuda_graphs=True, enable_prefix_caching=False)
    tables = engine.kv.block_tables
    tables.__class__ = DetachedTables  # (before any request: the engine's one table, made a device-like copy)
    tables._alloc(*tables.host.shape, keep=tables.host)
    reqs = [Req(f"t{i}", [(9 * i + j) % 300 + 3 for j in range(3 + 2 * i)],
                SamplingParams(temperature=0.7 * (i % 2), max_tokens=9, ignore_eos=True, exit_threshold=0.6), seed=i)
            for i in range(5)]
    outs = drive(engine, reqs)
    for r in reqs:
        assert_matches(outs[r.rid], reference(engine, r))
    assert engine.runner.graphs is not None and engine.runner.graphs.buckets


def test_graph_buffers_made_in_inference_mode_serve_steps_outside_it(tiny_huginn):
    """The coda's logits buffer is made by its first run: under `torch.inference_mode` (as the benchmarks
    step) it must still be a normal tensor, or a later step outside inference mode cannot write it."""
    engine = make_engine(tiny_huginn, "like-init", cuda_graphs=True, block_size=4)
    params = SamplingParams(temperature=0.0, max_tokens=4, exit_policy="fixed")
    with torch.inference_mode():
        engine.add_request("a", [1, 2, 3, 4, 5], params)
        while engine.has_unfinished_requests():
            engine.step()
    assert engine.runner.graphs is not None and engine.runner.graphs.logits is not None
    engine.add_request("b", [1, 2, 3, 4, 5], params)
    while engine.has_unfinished_requests():
        assert engine.step() is not None


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8).clone()  # (compares bits: the uninitialized KV may hold NaN)


@pytest.mark.parametrize("arch", ["ouro", "huginn"])
def test_warmup_prepares_every_bucket_up_to_its_tokens_and_writes_only_scratch_rows(arch, tiny_ouro, tiny_huginn):
    """`cuda_graph_warmup_tokens` prepares (on CUDA: captures) at start-up every bucket a batch of at most
    max_decode_batch rows and that many keys may need; a warmed bucket is not prepared again, nor counted as a
    capture a batch waited for. The warm-up's batches are padding rows only: every KV row and state row but the
    scratch rows keeps its bits, and the outputs stay the reference's."""
    path, state_init = (tiny_ouro, "zero") if arch == "ouro" else (tiny_huginn, "like-init")
    cfg = {**BASE, **POOLS["wide"]}
    engine = make_engine(path, state_init, scheduler="cdb", **cfg, cuda_graph_warmup_tokens=10)
    graphs = engine.runner.graphs
    assert graphs is not None
    stages = {"core"} | ({"prelude", "coda"} if arch == "huginn" else set())
    # widths up to bucket(5) = 6; 10 tokens are 3 blocks of 4, so 3, 2 and 1 blocks of keys
    assert set(graphs.buckets) == {(s, w, b * 4) for s in stages for w in (1, 2, 3, 4, 6) for b in (1, 2, 3)}
    assert engine.stats.graph_buckets == 0 and engine.stats.graph_capture_s == 0
    reqs = [dataclasses.replace(r, arrive=0) for r in matrix_workload(arch, "signal", engine.model_config.r_max)]
    outs = drive(engine, reqs)
    for r in reqs:
        assert_matches(outs[r.rid], reference(engine, r))
    # the run prepared (and counted) only the buckets the warm-up did not reach (longer contexts)
    assert engine.stats.graph_buckets == len(graphs.buckets) - 15 * len(stages)
    assert all(keys > 12 for _, _, keys in graphs.buckets[15 * len(stages):])

    # a stage batch is at most the state pool's rows: no wider bucket is prepared
    narrow = make_engine(path, state_init, scheduler="cdb", **{**cfg, "max_num_seqs": 2, "max_decode_batch": 32},
                         cuda_graph_warmup_tokens=4)
    assert narrow.runner.graphs is not None and narrow.pool.rows == 2
    assert {w for _, w, _ in narrow.runner.graphs.buckets} == {1, 2}

    # what a warm-up writes, on an engine with KV and states already in place
    engine = make_engine(path, state_init, scheduler="cdb", **cfg)
    graphs, store, pool = engine.runner.graphs, engine.kv.store, engine.pool
    assert graphs is not None and not graphs.buckets
    torch.manual_seed(0)
    for t in (store.k, store.v, pool.state, pool.inject):
        if t is not None:
            t.copy_(torch.randn_like(t))
    scratch = engine.kv.reserved[0] * engine.cfg.block_size
    before = {name: _bytes(t) for name, t in (("k", store.k), ("v", store.v), ("depth", store.depth),
                                              ("state", pool.state), ("inject", pool.inject)) if t is not None}
    n = graphs.warm_up(sorted(stages), engine.cfg.max_decode_batch, 40)
    assert n == len(graphs.buckets) > 0
    after = {"k": _bytes(store.k), "v": _bytes(store.v), "depth": _bytes(store.depth), "state": _bytes(pool.state)}
    if pool.inject is not None:
        after["inject"] = _bytes(pool.inject)
    keep_kv = torch.ones(store.k.shape[2], dtype=torch.bool)
    keep_kv[scratch] = False
    for name in ("k", "v"):
        assert torch.equal(after[name][:, :, keep_kv], before[name][:, :, keep_kv])
    assert torch.equal(after["depth"], before["depth"])
    assert torch.equal(after["state"][:pool.scratch_state], before["state"][:pool.scratch_state])
    if pool.inject is not None:
        assert torch.equal(after["inject"][:pool.scratch_inject], before["inject"][:pool.scratch_inject])


def test_warmup_tokens_is_checked(tiny_ouro):
    for bad in (-1, 1.5, "64", True):
        with pytest.raises(ValueError, match="cuda_graph_warmup_tokens"):
            make_engine(tiny_ouro, cuda_graph_warmup_tokens=bad)


@given(st.integers(-3, 5000))
def test_bucket_is_the_smallest_rung_at_or_above(n):
    if n < 1:
        with pytest.raises(ValueError, match="bucket"):
            bucket(n)
        return
    b = bucket(n)
    ladder = [1, 2, 3, 4, 6] + [r for k in range(3, 14) for r in (1 << k, 3 << (k - 1))]
    assert b in ladder and n <= b
    assert all(not (n <= r < b) for r in ladder)  # nothing smaller would do
    assert b < max(4, n * 3 // 2 + 1)  # so a batch is padded to under 1.5x its rows (or to 3 or 4 rows)
