"""The compiled passes over a core batch's rows (`ExitBook.observe` / `start`, `StatePool.advance`,
`settle`, the packed core inputs) against what they stand for: each row decided alone, and the
array expressions they replaced. numba does not check bounds or aliasing, so these compare whole
arrays, rows outside the batch included."""

from __future__ import annotations

import copy
import math
from collections import Counter
from types import SimpleNamespace

import numba
import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from loopserve.engine.graphs import PACKED_ROWS
from loopserve.engine.runner import Signals, StatePool, _pack_rows
from loopserve.engine.stats import EngineStats
from loopserve.exits import POLICIES, SIGNALS, ExitBook, ExitRule, rule_table
from loopserve.jit import compiled

BOOK_FIELDS = ("policy", "threshold", "min_loops", "lookahead", "survival", "exit_depth", "frozen", "target",
               "stop_at")
signal_values = st.one_of(st.floats(-30, 30), st.sampled_from([math.nan, math.inf, -math.inf, 0.0, 1e300]))


@st.composite
def exit_rules(draw) -> ExitRule:
    policy = draw(st.sampled_from(POLICIES))
    max_loops = draw(st.integers(1, 6))
    min_loops = draw(st.integers(1, max_loops))
    threshold = None if policy in ("fixed", "trace") else draw(st.one_of(st.none(), st.floats(0.01, 1.5)))
    trace = tuple(draw(st.lists(st.integers(1, 8), max_size=4))) if policy == "trace" else ()
    return ExitRule(policy, threshold, min_loops, max_loops, trace, lookahead=draw(st.booleans()))


def _entry(book: ExitBook, row: int) -> tuple:
    values = (getattr(book, f)[row].item() for f in BOOK_FIELDS)
    return tuple("nan" if isinstance(v, float) and math.isnan(v) else v for v in values)  # (NaN: no threshold)


@settings(max_examples=150, deadline=None)
@given(st.lists(exit_rules(), min_size=1, max_size=8), st.randoms(use_true_random=False),
       st.lists(st.tuples(signal_values, signal_values, st.booleans()), min_size=64, max_size=64))
def test_a_batch_decides_each_row_as_alone(rules, rnd, signals):
    """Rows of mixed rules, at scattered book rows in a shuffled order, decide step after step exactly as
    each row in its own one-row book (the reference decoder's form), NaN and infinite signals included;
    entries outside the batch are never written."""
    n, size = len(rules), 16
    rows = np.array(rnd.sample(range(size), n), np.int64)
    batch = ExitBook(size)
    untouched = {f: getattr(batch, f).copy() for f in BOOK_FIELDS}
    decode = np.array([rnd.randrange(6) for _ in rules], np.int64)
    batch.start(rows, rules, decode)
    alone = [ExitBook(1) for _ in rules]
    for k, (book, rule) in enumerate(zip(alone, rules, strict=True)):
        book.start(np.zeros(1, np.int64), [rule], decode[k:k + 1])
    live = np.ones(n, bool)
    it = iter(signals)
    for r in range(1, 8):
        ks = np.flatnonzero(live)
        if not len(ks):
            break
        main, ahead, has = (np.array(x) for x in zip(*[next(it) for _ in ks], strict=True))
        order = list(range(len(ks)))
        rnd.shuffle(order)
        ks, main, ahead, has = ks[order], main[order], ahead[order], has[order]
        loops_on, bad = batch.observe(rows[ks], np.full(len(ks), r), main, ahead, has.astype(bool))
        for j, k in enumerate(ks.tolist()):
            one_on, one_bad = alone[k].observe(np.zeros(1, np.int64), np.array([r]), main[j:j + 1], ahead[j:j + 1],
                                               has[j:j + 1].astype(bool))
            assert (loops_on[j], bad[j]) == (one_on[0], one_bad[0])
            assert _entry(batch, int(rows[k])) == _entry(alone[k], 0)
            live[k] = loops_on[j] and not bad[j]
    outside = np.setdiff1d(np.arange(size), rows)
    for f in BOOK_FIELDS:
        assert np.array_equal(getattr(batch, f)[outside], untouched[f][outside]), f


def test_start_reads_rules_only_to_replay_a_trace():
    """Started from a table of the rules' rows, a batch without a trace reads no rule object; a trace
    replays per item, each at its own decode index."""
    book = ExitBook(8)
    gate = ExitRule("gate", 0.5, 1, 4)
    rows = np.array([6, 1], np.int64)
    book.start(rows, [], np.array([0, 1]), rule_table([gate, gate]))
    assert book.stop_at[rows].tolist() == [4, 4] and book.threshold[rows].tolist() == [0.5, 0.5]
    trace = ExitRule("trace", None, 2, 5, trace=(1, 4, 9))
    rows = np.array([6, 1, 3], np.int64)
    book.start(rows, [trace] * 3, np.array([0, 1, 2]), rule_table([trace] * 3))
    assert book.target[rows].tolist() == [2, 4, 5] and book.stop_at[rows].tolist() == [5, 5, 5]
    assert book.min_loops[rows].tolist() == [2, 2, 2] and book.policy[[0, 2, 4, 5, 7]].tolist() == [0] * 5


@settings(max_examples=150, deadline=None)
@given(st.lists(st.tuples(exit_rules(), st.integers(1, 50), st.integers(0, 40)), min_size=1, max_size=10,
                unique_by=lambda t: t[2]), st.randoms(use_true_random=False))
def test_start_loops_reads_each_rows_sequence_by_its_slot(seqs, rnd):
    """`StatePool.start_loops` reads the rows' sequences' facts by block-table slot (`SlotFacts`, grown past
    its first size on demand): each row gets its own sequence's rule and decode index, exactly as
    `ExitBook.start` from the items' own rules does."""
    size = 12
    pool = StatePool(size, 4, torch.float32, torch.device("cpu"), with_inject=False)
    items = []
    for rule, prompt_len, slot in seqs:
        seq = SimpleNamespace(prompt_ids=[0] * prompt_len, seed=rnd.randrange(2**63), plain_greedy=rnd.random() < 0.5,
                              rule=rule, quiet=True, streams=rnd.random() < 0.5, max_new=16,
                              stop_tokens=frozenset({0}))
        pool.sequences.admit(slot, seq)  # type: ignore[arg-type]
        items.append(SimpleNamespace(seq=seq, slot=slot, position=prompt_len + rnd.randrange(20)))
    assert all(pool.sequences.matches(i.slot, i.seq) for i in items)  # (growing kept the earlier ones)
    rows = np.array(rnd.sample(range(size), len(items)), np.int64)
    pool.kv_slot[rows] = [i.slot for i in items]
    pool.position[rows] = [i.position for i in items]
    pool.start_loops(items, rows)  # type: ignore[arg-type]
    decode = np.array([i.position - len(i.seq.prompt_ids) for i in items])
    assert pool.decode_index[rows].tolist() == decode.tolist()
    alone = ExitBook(size)
    rules = [i.seq.rule for i in items]
    alone.start(rows, rules, decode, rule_table(rules))
    for row in rows.tolist():
        assert _entry(pool.exits, row) == _entry(alone, row)


@st.composite
def pools(draw):
    size = draw(st.integers(1, 24))
    pool = StatePool(size, 4, torch.float32, torch.device("cpu"), with_inject=False)
    ints = st.lists(st.integers(0, 6), min_size=size, max_size=size)
    bools = st.lists(st.booleans(), min_size=size, max_size=size)
    pool.r[:], pool.parity[:] = draw(ints), draw(st.lists(st.integers(0, 1), min_size=size, max_size=size))
    pool.passive[:], pool.exits.frozen[:], pool.decides_ahead[:] = draw(bools), draw(bools), draw(bools)
    pool.exits.stop_at[:], pool.exits.exit_depth[:] = draw(ints), draw(ints)
    pool.generation[:], pool.signal[:] = draw(ints), draw(st.lists(st.integers(0, 4), min_size=size, max_size=size))
    pool.position[:], pool.kv_row[:], pool.kv_slot[:] = draw(ints), draw(ints), draw(ints)
    rows = np.array(draw(st.permutations(range(size))), np.int64)[: draw(st.integers(0, size))]
    generations = pool.generation[rows] + np.array(draw(st.lists(st.integers(0, 1), min_size=len(rows),
                                                                 max_size=len(rows))), np.int64)
    return pool, rows, generations


@settings(max_examples=200, deadline=None)
@given(pools())
def test_advance_is_the_array_form(case):
    """`StatePool.advance` against the numpy expressions it replaced (rows released since the step was
    queued, i.e. of another generation, skipped)."""
    pool, rows, generations = case
    r, parity = pool.r.copy(), pool.parity.copy()
    frozen, exit_depth = pool.exits.frozen.copy(), pool.exits.exit_depth.copy()
    act = rows[(pool.generation[rows] == generations) & ~pool.passive[rows]]
    r[act] += 1
    was_frozen = frozen[act]
    frozen[act[was_frozen]] = False
    kept = act[~was_frozen]
    parity[kept] ^= 1
    stop = r[kept] >= pool.exits.stop_at[kept]
    exit_depth[kept[stop]] = r[kept[stop]]
    done = was_frozen.copy()
    done[~was_frozen] = stop
    active, got = pool.advance(rows, generations)
    assert active == len(act) and got.tolist() == act[done].tolist()
    assert np.array_equal(pool.r, r) and np.array_equal(pool.parity, parity)
    assert np.array_equal(pool.exits.frozen, frozen) and np.array_equal(pool.exits.exit_depth, exit_depth)


@settings(max_examples=200, deadline=None)
@given(pools(), st.data())
def test_settle_is_the_array_form(case, data):
    """`StatePool.settle` against the array expressions it replaced: the rows still waiting for their signal
    (the same generation, active, undecided) read it with `ExitBook.observe` (rows of mixed rules, NaN and
    infinite signals included); the done and non-finite rows come back as batch indices, in order; nothing
    else in the book is written."""
    pool, rows, generations = case
    size, n = pool.rows, len(rows)
    rules = data.draw(st.lists(exit_rules(), min_size=size, max_size=size))
    pool.exits.start(np.arange(size), rules, np.zeros(size, np.int64))
    pool.exits.exit_depth[:] = data.draw(st.lists(st.sampled_from([0, 0, 0, 1, 3]), min_size=size, max_size=size))
    signals = data.draw(st.lists(st.tuples(signal_values, signal_values, st.booleans()), min_size=n, max_size=n))
    main, ahead, has = (np.array([x[j] for x in signals], dtype) for j, dtype in enumerate((float, float, bool)))
    twin = copy.deepcopy(pool.exits)
    keep = np.flatnonzero((pool.generation[rows] == generations) & ~pool.passive[rows]
                          & (pool.exits.exit_depth[rows] == 0))
    loops_on, bad = twin.observe(rows[keep], pool.r[rows[keep]], main[keep], ahead[keep], has[keep])
    done, broken = pool.settle(rows, generations, Signals(np.zeros(n, np.int8), main, ahead, has))
    assert done.tolist() == keep[~loops_on & ~bad].tolist() and broken.tolist() == keep[bad].tolist()
    for f in BOOK_FIELDS:
        assert np.array_equal(getattr(pool.exits, f), getattr(twin, f), equal_nan=True), f


@settings(max_examples=200, deadline=None)
@given(pools(), st.integers(0, 100), st.booleans())
def test_packed_inputs_are_the_array_form(case, scratch, core):
    pool, rows, _ = case
    host, kinds = np.full((PACKED_ROWS, len(rows)), -7, np.int64), np.full(len(rows), -7, np.int8)
    counts = np.zeros(len(SIGNALS), np.int64)
    top, now = _pack_rows(rows, core, pool.passive, pool.position, pool.kv_row, pool.r, pool.kv_slot, pool.parity,
                          pool.signal, pool.decides_ahead, scratch, pool.rows, host, kinds, counts)
    hidden = pool.passive[rows] & core  # a core batch's passive rows: KV to the scratch row, no signal
    expect = np.stack([pool.position[rows], np.where(hidden, scratch, pool.kv_row[rows]), pool.r[rows] + 1,
                       pool.kv_slot[rows], pool.parity[rows] * pool.rows + rows,
                       (1 - pool.parity[rows]) * pool.rows + rows, rows])
    assert np.array_equal(host, expect)
    assert kinds.tolist() == np.where(hidden, 0, pool.signal[rows]).tolist()
    assert top == (int(pool.position[rows].max()) if len(rows) else 0)
    assert now == int(((kinds != 0) & ~pool.decides_ahead[rows]).sum())
    assert counts.tolist() == np.bincount(kinds, minlength=len(SIGNALS)).tolist()
    assert pool.state_rows(rows).tolist() == expect[4].tolist()


def test_a_row_outside_the_arrays_raises():
    """Bounds are checked: a bad row index raises (as numpy's indexing did), it does not write past an array."""
    book = ExitBook(2)
    with pytest.raises(IndexError):
        book.observe(np.array([5]), np.array([1]), np.zeros(1), np.zeros(1), np.ones(1, bool))
    two_rules = [ExitRule("gate", 0.5, 1, 4), ExitRule("gate", 0.7, 1, 4)]
    with pytest.raises(IndexError):  # a table of two rows for four items
        ExitBook(4).start(np.arange(4), two_rules * 2, np.zeros(4, np.int64), rule_table(two_rules))


def test_compiled_without_a_cache_location(monkeypatch):
    """Where numba finds no directory to cache in, the pass is compiled per process instead of failing."""
    real = numba.njit

    def njit(**options):
        if options.get("cache"):
            raise RuntimeError("cannot cache function 'f': no locator available for file 'f.py'")
        return real(**options)

    monkeypatch.setattr(numba, "njit", njit)

    def f(x):
        return x[3]

    g = compiled(f)
    assert g(np.arange(5)) == 3
    with pytest.raises(IndexError):
        g(np.arange(2))


@settings(max_examples=200, deadline=None)
@given(pools(), st.data())
def test_without_keeps_the_queue_order_and_its_scratch_clear(case, data):
    """`StatePool.without` against the list form; its marks are all clear again after every call, a bad row's too."""
    pool, queue, _ = case
    gone = np.array(data.draw(st.lists(st.integers(0, pool.rows - 1), max_size=pool.rows)), np.int64)
    assert pool.without(queue, gone).tolist() == [q for q in queue.tolist() if q not in set(gone.tolist())]
    assert not pool._marks.any()
    if len(queue):
        with pytest.raises(IndexError):
            pool.without(queue, np.array([0, pool.rows], np.int64))
        assert not pool._marks.any()


def test_exit_counts_add_up_and_grow():
    stats = EngineStats()
    stats.count_exits(np.array([1, 3, 3], np.int64))
    stats.count_exits(np.array([], np.int64))
    stats.count_exits(np.array([7, 1], np.int64))
    assert stats.exit_depths == Counter({1: 2, 3: 2, 7: 1})
    assert stats.as_dict()["exit_depths"] == {1: 2, 3: 2, 7: 1}
