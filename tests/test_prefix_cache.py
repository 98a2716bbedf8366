"""Prefix caching (docs/design.md §4.3): full prompt blocks are shared through content keys, and the
outputs are exactly those of the reference decoder (which has no cache), whatever the scheduler, KV
layout, exit policy, preemption, swapping or aborts; the allocator's reference counts are checked
after every step (`drive`), and a hit really skips the cached tokens' prefill."""

from __future__ import annotations

from collections import OrderedDict

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from loopserve import SamplingParams
from loopserve.cache.pool import BlockAllocator
from loopserve.cache.prefix import block_keys, reusable_tokens
from loopserve.engine.sequence import Sequence
from tests.engine_helpers import Req, assert_matches, drive, make_engine, reference
from tests.test_engine_exact import HUGINN_LATENT, LAYOUTS, POLICIES, SCHEDULERS, policy_kwargs

pytestmark = pytest.mark.usefixtures("single_thread")

A = [(13 * j + 7) % 400 + 3 for j in range(18)]  # a shared "system prompt" (4.5 blocks of 4)
B = [(29 * j + 1) % 400 + 3 for j in range(9)]


def shared_workload(arch: str, policy: str, r_max: int, longer: int = 0) -> list[Req]:
    """Requests behind common prefixes: identical prompts, a prompt that is a block-aligned prefix of
    another, a different prompt depth (no sharing), prompt logprobs (not served from the cache),
    a request seeded by its params (Huginn: another state seed base), aborts, late arrivals. `longer`
    adds that many generated tokens to every request (ignoring eos), to press on the KV pool."""
    specs = [  # (prompt, sampling, arrive, abort_at)
        (A + [5, 6, 7], dict(temperature=0.0, max_tokens=6, logprobs=2), 0, None),
        (A + [9, 8, 7, 6, 5], dict(temperature=0.8, seed=7, max_tokens=6), 7, None),
        (A[:16], dict(temperature=0.0, max_tokens=5), 9, None),
        (A + [5, 6, 7], dict(temperature=1.0, max_tokens=6), 11, None),  # seeded by the request's own seed
        (A + [1], dict(temperature=0.0, max_tokens=5, max_loops=r_max - 1), 9, None),
        (A + [2, 2], dict(temperature=0.0, max_tokens=4, prompt_logprobs=2), 10, None),
        (B + A, dict(temperature=0.7, max_tokens=6, ignore_eos=True), 2, 16),
        (B + [4, 4, 4, 4, 4, 4, 4], dict(temperature=0.0, max_tokens=5), 14, None),
        (A + [3, 3, 3, 3], dict(temperature=0.0, max_tokens=7, ignore_eos=True), 12, 20),
    ]
    reqs = []
    for i, (prompt, sampling, arrive, abort_at) in enumerate(specs):
        if longer:
            sampling = {**sampling, "max_tokens": sampling["max_tokens"] + longer, "ignore_eos": True}
        params = SamplingParams(**sampling, **policy_kwargs(arch, policy, i, r_max))
        reqs.append(Req(f"p{i}", prompt, params, seed=500 + 31 * i, arrive=arrive, abort_at=abort_at))
    return reqs


ROOMY = dict(block_size=4, kv_cache_tokens=200, max_num_seqs=4, max_decode_batch=3, prefill_chunk_size=8,
             max_num_batched_tokens=8, min_coda_batch=2)
TIGHT = {**ROOMY, "kv_cache_tokens": 44}  # 10 blocks: preemption, swapping and eviction of cached blocks
_REFS: dict[tuple, Sequence] = {}


def _run(path, state_init, arch, scheduler, layout, policy, cfg, longer=0):
    engine = make_engine(path, state_init, scheduler=scheduler, kv_layout=layout, lookahead=policy == "lookahead",
                         **cfg)
    reqs = shared_workload(arch, policy, engine.model_config.r_max, longer)
    outs = drive(engine, reqs)
    for r in reqs:
        key = (arch, layout, policy, longer, r.rid)
        if key not in _REFS:
            _REFS[key] = reference(engine, r)
        assert_matches(outs[r.rid], _REFS[key])
    return engine, outs


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("scheduler", SCHEDULERS)
@pytest.mark.parametrize("arch", ["ouro", "huginn"])
def test_shared_prefixes_match_reference(arch, scheduler, layout, policy, tiny_ouro, tiny_huginn):
    path, state_init = (tiny_ouro, "zero") if arch == "ouro" else (tiny_huginn, "like-init")
    engine, outs = _run(path, state_init, arch, scheduler, layout, policy, ROOMY)
    stats = engine.stats
    assert stats.prefix_cache_hits > 0, "nothing came from the cache: the test proves nothing"
    # prompt logprobs need every position's logits: never served from the cache
    assert outs["p5"].num_cached_tokens == 0
    # another prompt depth is another KV: no sharing with the max_loops = r_max prompts
    assert outs["p4"].num_cached_tokens == 0
    cached = {rid: o.num_cached_tokens for rid, o in outs.items()}
    if layout == "shared":  # cached prefixes end on a prefill chunk boundary (§4.2)
        assert all(n % 8 == 0 for n in cached.values())
    assert cached["p3"] > 0 and cached["p2"] > 0
    assert cached["p2"] <= 12  # the last prompt token (position 15) is always computed
    if arch == "huginn":  # like-init: a request seeded by its params has its own state seeds
        assert cached["p1"] == 0
    assert stats.prefill_token_loops == sum(o.metrics.prefill_loops for o in outs.values() if o.metrics)


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("scheduler", SCHEDULERS)
@pytest.mark.parametrize("arch", ["ouro", "huginn"])
def test_shared_prefixes_under_kv_pressure(arch, scheduler, layout, tiny_ouro, tiny_huginn):
    path, state_init = (tiny_ouro, "zero") if arch == "ouro" else (tiny_huginn, "like-init")
    engine, _ = _run(path, state_init, arch, scheduler, layout, "signal", TIGHT, longer=6)
    assert engine.stats.preemptions > 0, "the pool never ran short: the test proves nothing"


def test_swap_in_shares_cached_prompt_blocks_again(tiny_ouro):
    """A swapped-out sequence whose full prompt blocks are still cached takes them back shared
    (refcount + 1), not as fresh copies; outputs still equal the reference (the run asserts it)."""
    engine, _ = _run(tiny_ouro, "zero", "ouro", "cdb", "depth_indexed", "signal", TIGHT, longer=6)
    assert engine.stats.swap_ins > 0 and engine.stats.swap_in_shared_blocks > 0


def test_caching_off_computes_every_prompt_token(tiny_ouro):
    engine = make_engine(tiny_ouro, enable_prefix_caching=False, **ROOMY)
    outs = drive(engine, shared_workload("ouro", "fixed", engine.model_config.r_max))
    assert all(o.num_cached_tokens == 0 for o in outs.values())
    assert engine.stats.prefix_cache_queries == engine.stats.prefix_cache_hits == 0


def test_a_hit_skips_the_cached_prefill(tiny_ouro):
    """The second prompt's prefill starts at its cached length: fewer prompt rows, fewer loops."""
    engine = make_engine(tiny_ouro, block_size=4, prefill_chunk_size=8, kv_cache_tokens=128)
    rows: list[int] = []
    engine.stage_hooks.append(lambda rec: rows.append(rec.rows) if rec.stage == "prefill" else None)
    params = SamplingParams(temperature=0.0, max_tokens=3, exit_policy="fixed")
    first = Req("first", A + [1, 2], params, seed=0)
    second = Req("second", A + [3, 4, 5], params, seed=0, arrive=30)  # after the first's prefill
    outs = drive(engine, [first, second])
    assert outs["first"].num_cached_tokens == 0
    assert outs["second"].num_cached_tokens == 16  # the 4 full blocks of A
    assert rows == [8, 8, 4, 5]  # the second prompt's prefill: positions 16..20 only
    r_max = engine.model_config.r_max
    assert outs["second"].metrics.prefill_loops == 5 * r_max
    assert engine.stats.prefill_token_loops == (20 + 5) * r_max
    assert (engine.stats.prefix_cache_queries, engine.stats.prefix_cache_hits) == (20 + 21, 16)
    assert_matches(outs["second"], reference(engine, second))


def test_prompts_that_arrive_together_share_the_prefix_one_of_them_computes(tiny_ouro):
    """Prompts behind one system prompt, arriving together: the first computes the shared blocks, the others wait for
    them to be published and take them from the cache (they computed the same KV beside it: 0 cached tokens for a
    burst); a prompt that shares nothing goes on. Outputs equal the reference."""
    engine = make_engine(tiny_ouro, block_size=4, prefill_chunk_size=8, kv_cache_tokens=256, max_num_batched_tokens=32)
    params = SamplingParams(temperature=0.0, max_tokens=3, exit_policy="fixed")
    reqs = [Req("a", A + [1, 2], params, seed=0), Req("other", B + [4, 4], params, seed=0),
            Req("b", A + [3, 4, 5], params, seed=0), Req("c", A + [6], params, seed=0)]
    outs = drive(engine, reqs)
    assert outs["a"].num_cached_tokens == outs["other"].num_cached_tokens == 0
    assert outs["b"].num_cached_tokens == outs["c"].num_cached_tokens == 16  # the 4 full blocks of A
    assert engine.stats.prefix_cache_waits > 0
    r_max = engine.model_config.r_max
    assert engine.stats.prefill_token_loops == (20 + 11 + 5 + 3) * r_max  # A's 16 shared tokens computed once
    for r in reqs:
        assert_matches(outs[r.rid], reference(engine, r))


def test_a_prompt_admitted_in_the_same_tick_is_waited_for_too(tiny_ouro):
    """The first prompt asks for prompt_logprobs (it reads nothing from the cache, so the tick had built no set of
    blocks being prefilled when it was admitted): the second, behind the same prefix in the same tick, still waits for
    its blocks instead of computing them beside it."""
    engine = make_engine(tiny_ouro, block_size=4, prefill_chunk_size=8, kv_cache_tokens=256, max_num_batched_tokens=32)
    plain = SamplingParams(temperature=0.0, max_tokens=3, exit_policy="fixed")
    reqs = [Req("a", A + [1, 2], SamplingParams(temperature=0.0, max_tokens=3, exit_policy="fixed", prompt_logprobs=1),
                seed=0), Req("b", A + [3, 4, 5], plain, seed=0)]
    outs = drive(engine, reqs)
    assert outs["a"].num_cached_tokens == 0 and outs["b"].num_cached_tokens == 16
    for r in reqs:
        assert_matches(outs[r.rid], reference(engine, r))


def test_identical_prompt_recomputes_its_last_token(tiny_ouro):
    engine = make_engine(tiny_ouro, block_size=4, kv_cache_tokens=128)
    params = SamplingParams(temperature=0.0, max_tokens=2)
    outs = drive(engine, [Req("a", A[:16], params, seed=0), Req("b", A[:16], params, seed=0, arrive=30)])
    assert outs["b"].num_cached_tokens == 12 and outs["b"].metrics.prefill_loops == 4 * engine.model_config.r_max


def test_huginn_state_seeds_follow_the_prefix(tiny_huginn):
    """Like-init seeds are chained over the tokens: equal prefixes, equal seeds (so equal KV); another
    state seed base (a request's own `seed`) gives other seeds, and its blocks other keys."""
    engine = make_engine(tiny_huginn, "like-init", block_size=4)
    params = SamplingParams(max_tokens=2)
    x = engine.make_sequence("x", A + [1, 2], params)
    y = engine.make_sequence("y", A + [3], params)
    z = engine.make_sequence("z", A + [1, 2], SamplingParams(max_tokens=2, seed=9))
    assert [x.state_seed(p) for p in range(18)] == [y.state_seed(p) for p in range(18)]
    assert x.state_seed(18) != y.state_seed(18)
    assert x.state_seed(3) != z.state_seed(3)
    sched = engine.scheduler
    assert sched._prompt_keys(x)[:4] == sched._prompt_keys(y)[:4] != sched._prompt_keys(z)[:4]


def test_keys_name_everything_the_kv_depends_on():
    scope = b"s" * 32
    base = block_keys(scope, 4, None, A, 4)
    assert len(base) == 4 and block_keys(scope, 4, None, A[:8] + [0] * 10, 4)[:2] == base[:2]
    assert block_keys(scope, 4, None, [0] + A[1:], 4)[3] != base[3]  # chained: a change anywhere before
    assert block_keys(scope, 3, None, A, 4)[0] != base[0]  # prompt depth
    assert block_keys(scope, 4, 7, A, 4)[0] != base[0]  # state seed base
    assert block_keys(b"t" * 32, 4, None, A, 4)[0] != base[0]  # model / layout / chunking
    assert reusable_tokens(4, 17, 4, 1) == 16 and reusable_tokens(4, 16, 4, 1) == 12
    assert reusable_tokens(5, 30, 4, 8) == 16 and reusable_tokens(1, 30, 4, 8) == 0


def test_allocator_refcounts_and_lru_eviction():
    a = BlockAllocator(4, 2)
    x, y = a.allocate(2)
    a.register(x, b"kx")
    a.register(y, b"ky")
    a.share([x])
    assert a.refcounts() == {x: 2, y: 1}
    a.free([x, y])  # y (the tail) is evicted before x
    assert a.num_free == 3 and a.refcounts() == {x: 1}
    a.free([x])
    assert a.lookup([b"kx"]) == [x] and a.cost_to_share([x]) == 1
    a.check()
    fresh = a.allocate(2)  # the empty blocks go first
    assert x not in fresh and y not in fresh and a.lookup([b"kx", b"ky"]) == [x, y]
    assert a.allocate(1) == [y] and a.lookup([b"ky"]) == []  # then the least recently freed cached block
    a.register(fresh[0], b"kx")  # a key already indexed keeps its block
    assert a.lookup([b"kx"]) == [x]
    a.check()
    with pytest.raises(RuntimeError):
        a.free([x])


def test_eviction_skips_blocks_shared_since_they_were_freed():
    """Cached blocks taken back by a prompt (shared again) stay in the eviction queue as stale entries;
    eviction skips a long run of them (several scan windows) and takes the oldest block still cached."""
    a = BlockAllocator(40, 4)
    blocks = a.allocate(40)
    for b in blocks:
        a.register(b, f"k{b}".encode())
    for b in blocks:
        a.free([b])  # freed one by one: the queue holds them oldest first
    a.share(blocks[:30])  # prompts took the 30 oldest back
    assert a.num_free == 10 and a.allocate(1) == [blocks[30]]
    assert a.lookup([f"k{blocks[30]}".encode()]) == [] and a.lookup([f"k{blocks[31]}".encode()]) == [blocks[31]]
    a.free(blocks[:30])  # freed again: now the newest in the queue, after blocks 31..39
    assert a.allocate(10) == blocks[31:40] + [blocks[29]]  # (a table is freed tail first)
    a.check()


class _ModelAllocator:
    """The allocator's contract, written plainly (dicts and an ordered dict, a Python step per block):
    the array allocator must agree with it on every count, every eviction and every cached key."""

    def __init__(self, n: int) -> None:
        self.empty, self.refs, self.key_of = set(range(n)), {}, {}
        self.lru: OrderedDict[int, None] = OrderedDict()

    def allocate(self, got: list[int]) -> None:
        k = min(len(got), len(self.empty))
        assert set(got[:k]) <= self.empty, "allocation took a block that was not empty while empty ones were left"
        assert got[k:] == list(self.lru)[: len(got) - k], "eviction not least recently freed first"
        for b in got[k:]:
            del self.lru[b], self.key_of[b]
        self.empty -= set(got[:k])
        self.refs.update(dict.fromkeys(got, 1))

    def free(self, blocks: list[int]) -> None:
        for b in reversed(blocks):
            self.refs[b] -= 1
            if not self.refs[b]:
                del self.refs[b]
                if b in self.key_of:
                    self.lru[b] = None
                else:
                    self.empty.add(b)

    def share(self, blocks: list[int]) -> None:
        for b in blocks:
            self.lru.pop(b, None)
            self.refs[b] = self.refs.get(b, 0) + 1

    def reset(self) -> None:
        self.empty |= set(self.lru)
        self.lru.clear()
        self.key_of.clear()


@settings(max_examples=150, deadline=None)
@given(st.integers(1, 8), st.lists(st.tuples(st.sampled_from(["allocate", "share", "free", "free", "several", "reset",
                                                              "twice"]),
                                            st.integers(0, 63), st.integers(0, 63)), min_size=60, max_size=200))
def test_allocator_matches_a_plain_model(n, ops):
    """Random allocate (indexing some new blocks) / share / free / reset sequences on a small pool, so
    eviction, its skipping of blocks shared since they were freed (over several scan windows), and the
    compaction of the eviction queue all happen often; several tables freed in one call (`free_tables`, a
    coda batch's finished requests, which may share blocks) as if freed one by one; a block freed or
    shared twice in one call, or not held, raises and changes nothing."""
    a, m = BlockAllocator(n, 4), _ModelAllocator(n)
    tables: list[list[int]] = []
    keys = iter(range(10**6))
    for op, x, y in ops:
        if op == "allocate":
            k = x % (n + 2)
            if k > a.num_free:
                with pytest.raises(MemoryError):
                    a.allocate(k)
                continue
            got = a.allocate(k)
            m.allocate(got)
            tables.append(got)
            for i, b in enumerate(got):
                if y >> i & 1:  # its KV complete: indexed (a second key for it, or its key again, is ignored)
                    key = f"k{next(keys)}".encode()
                    a.register(b, key)
                    a.register(b, f"k{next(keys)}".encode())
                    m.key_of[b] = key
        elif op == "share" and (m.key_of or tables):
            pool = sorted(set(m.key_of) | {b for t in tables for b in t})
            blocks = [b for i, b in enumerate(pool) if (x | y << 6) >> i & 1]
            assert a.cost_to_share(blocks) == sum(b in m.lru for b in blocks)
            a.share(blocks)
            m.share(blocks)
            tables.append(blocks)
        elif op == "free" and tables:
            blocks = tables.pop(x % len(tables))
            a.free(np.array(blocks, np.int64) if y & 1 else blocks)  # (the manager frees a block-table row)
            m.free(blocks)
        elif op == "several" and tables:
            picked = [tables.pop(i % len(tables)) for i in (x, y, x + y)[: 1 + x % 3] if tables]
            a.free_tables([np.array(t, np.int64) for t in picked])
            for blocks in picked:
                m.free(blocks)
        elif op == "twice":  # caller bugs: a block listed twice, a block no one holds, a negative id
            b = x % n
            for bad in ([b, b], [b] if b not in m.refs else [-1]):
                with pytest.raises(RuntimeError):
                    a.free(bad)
            with pytest.raises(RuntimeError):  # one more hold than it has (or a negative id)
                a.free_tables([np.array([b]) for _ in range(m.refs.get(b, 0) + 1)] if y & 1 else [np.array([-1])])
            if b in m.refs or b in m.key_of:
                with pytest.raises(RuntimeError):
                    a.share([b, b])
        elif op == "reset" and x < 4:
            a.reset_cache()
            m.reset()
        a.check()
        assert a.refcounts() == m.refs and a.num_free == len(m.empty) + len(m.lru)
        assert a.num_cached == len(m.key_of) and all(a.lookup([k]) == [b] for b, k in m.key_of.items())
    for blocks in tables:
        a.free(blocks)
    a.check()
    assert a.num_free == n


# -- random shared-prefix workloads: caching on equals caching off equals the reference -------------------------
@st.composite
def prefix_workload(draw):
    stems = [A, B, A[:8] + B]
    reqs = []
    for i in range(draw(st.integers(2, 6))):
        stem = draw(st.sampled_from(stems))
        cut = draw(st.integers(1, len(stem)))
        tail = draw(st.lists(st.integers(1, 400), max_size=6))
        params = SamplingParams(temperature=draw(st.sampled_from([0.0, 0.9])), max_tokens=draw(st.integers(1, 6)),
                                max_loops=draw(st.sampled_from([None, None, 3])),
                                exit_policy="latent_diff", exit_threshold=HUGINN_LATENT,
                                seed=draw(st.sampled_from([None, None, 4])))
        reqs.append(Req(f"q{i}", stem[:cut] + tail, params, seed=i, arrive=draw(st.integers(0, 25)),
                        abort_at=draw(st.sampled_from([None, None, None, draw(st.integers(0, 30))]))))
    return reqs


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                  HealthCheck.too_slow])
@given(reqs=prefix_workload(), scheduler=st.sampled_from(SCHEDULERS), layout=st.sampled_from(LAYOUTS),
       tokens=st.sampled_from([44, 200]))
def test_random_shared_prefix_workloads(reqs, scheduler, layout, tokens, tiny_huginn):
    cfg = {**ROOMY, "kv_cache_tokens": tokens}
    on = drive(make_engine(tiny_huginn, "like-init", scheduler=scheduler, kv_layout=layout, **cfg), reqs)
    off = drive(make_engine(tiny_huginn, "like-init", scheduler=scheduler, kv_layout=layout,
                            enable_prefix_caching=False, **cfg), reqs)
    engine = make_engine(tiny_huginn, "like-init", kv_layout=layout, **cfg)
    for r in reqs:
        a, b = on[r.rid].outputs[0], off[r.rid].outputs[0]
        if a.finish_reason != "abort" and b.finish_reason != "abort":
            assert (a.token_ids, a.exit_depths) == (b.token_ids, b.exit_depths)
        assert_matches(on[r.rid], reference(engine, r))
