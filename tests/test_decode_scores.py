"""Decode attention scores read in place from the KV store (`loopserve/cache/scores.py`): equal to the
gather-then-multiply path (float32/64; bfloat16 to its rounding), the same bits whatever the batch and thread
split, and safe against bad indices and other rows' non-finite keys."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from loopserve.cache import scores
from loopserve.cache.pool import KVStore


def _store(dtype: torch.dtype, kv_heads: int = 2, head_dim: int = 16, capacity: int = 300, seed: int = 0) -> KVStore:
    g = torch.Generator().manual_seed(seed)
    kv = KVStore(capacity, 3, kv_heads, head_dim, dtype)
    kv.k[:, :, :capacity] = torch.randn(kv_heads, 3, capacity, head_dim, generator=g).to(dtype)
    kv.v[:, :, :capacity] = torch.randn(kv_heads, 3, capacity, head_dim, generator=g).to(dtype)
    return kv


def _reads(kv: KVStore, rows: int, length: int, seed: int = 0):
    """A random batch of decode reads: (index [kv_heads, N, L], visible [N, L]); hidden keys read the zero
    row, as the engine's are."""
    g = torch.Generator().manual_seed(seed)
    keys = torch.randint(0, kv.capacity, (rows, length), generator=g)
    slot = torch.randint(0, 3, (rows, length), generator=g)
    visible = torch.rand(rows, length, generator=g) < 0.8
    return kv.index(slot, keys.where(visible, kv.zero_row)), visible


def _gathered(kv: KVStore, q: torch.Tensor, index: torch.Tensor, visible: torch.Tensor) -> torch.Tensor:
    """The path the kernel replaces: gather the keys, multiply, hide."""
    n, nh, d = q.shape
    nkv = index.shape[0]
    qg = q.reshape(n, nkv, nh // nkv, d).transpose(0, 1)
    out = torch.matmul(qg, kv.keys(index).transpose(-1, -2)) * d ** -0.5
    return out.masked_fill(~visible[None, :, None], float("-inf"))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
@pytest.mark.parametrize("heads", [2, 6])  # 1 and 3 query heads per kv head
def test_scores_equal_the_gathered_product(dtype, heads):
    kv = _store(dtype)
    index, visible = _reads(kv, 5, 40)
    q = torch.randn(5, heads, 16).to(dtype)
    got = kv.scores(q, index, visible, 16 ** -0.5)
    want = _gathered(kv, q, index, visible)
    assert kv._reads_keys_in_place  # the in-place path ran
    assert got.shape == (2, 5, heads // 2, 40) and got.dtype == dtype
    assert torch.equal(got.isneginf(), ~visible[None, :, None].expand_as(got))
    torch.testing.assert_close(got, want)


@pytest.mark.parametrize("scale", [16 ** -0.5, 0.3])  # 0.3: a scale that rounds
def test_bfloat16_scores_round_as_the_gathered_matmul(scale):
    """bfloat16 keys are read in place as their bit patterns: each score is the float32 dot product rounded to
    bfloat16, scaled, rounded again, as the gathered path's bfloat16 matmul and scaling round it (its sum may run
    in another order: at most a bfloat16 step apart, and mostly the same bits); against float32 arithmetic on
    the same numbers, bfloat16's rounding; -inf exactly where hidden; attention gives the same output either way."""
    from loopserve.models.layers import attend_decode

    kv = _store(torch.bfloat16)
    assert kv._reads_keys_in_place
    index, visible = _reads(kv, 6, 50)
    q = torch.randn(6, 4, 16, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16)
    got = kv.scores(q, index, visible, scale)
    keys = kv.k.reshape(-1, 16)[index].float()  # [2, 6, 50, 16]: each query's keys, by plain indexing
    exact = torch.einsum("hngd,hnld->hngl", q.float().view(6, 2, 2, 16).transpose(0, 1), keys) * scale
    exact = exact.masked_fill(~visible[None, :, None], float("-inf"))
    assert got.dtype == torch.bfloat16 and torch.equal(got.isneginf(), exact.isneginf())
    torch.testing.assert_close(got.float(), exact, atol=0.05, rtol=0.02)
    kv._reads_keys_in_place = False  # the gather
    gathered = kv.scores(q, index, visible, scale)
    torch.testing.assert_close(got, gathered)
    assert (got.view(torch.int16) == gathered.view(torch.int16)).float().mean() > 0.95
    out_gathered = attend_decode(q, kv, index, visible)
    kv._reads_keys_in_place = True
    torch.testing.assert_close(attend_decode(q, kv, index, visible), out_gathered)


def test_bfloat16_rounding_of_the_pass_is_torchs():
    """The pass's float32 -> bfloat16 rounding (to nearest, ties to even; infinities and NaN kept) against torch's
    cast, on values around every kind of tie and the edges of the range: one key of ones reads back q's sum."""
    kv = KVStore(4, 1, 1, 1, torch.bfloat16)
    kv.k[0, 0, 0, 0] = 1.0
    steps = torch.tensor([1.0, 1.00390625, 1.0078125, 1.01171875], dtype=torch.float64)  # ties at 1 + k/256
    values = torch.cat([steps, -steps, steps * 3.0e38, torch.tensor([0.0, -0.0, 1e-40, float("inf"), float("-inf"),
                                                                       float("nan"), 3.4e38, -3.4e38])])
    values = torch.cat([values, torch.nextafter(values.float(), torch.tensor(float("inf"))).double()]).float()
    index = kv.index(0, torch.zeros(len(values), 1, dtype=torch.long))
    visible = torch.ones(len(values), 1, dtype=torch.bool)
    # q's float32 widening must keep the value: feed it through the scale instead (q = 1, scale = the value)
    for v in values.tolist():
        got = kv.scores(torch.ones(1, 1, 1, dtype=torch.bfloat16), index[:, :1], visible[:1], v)
        want = torch.tensor(v, dtype=torch.float32).to(torch.bfloat16)
        assert got.view(torch.int16).item() == want.view(torch.int16).item() or (got.isnan() & want.isnan()).all(), v


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float64])
def test_gathered_scores_in_slices_of_keys_are_the_same(dtype, monkeypatch):
    """Where the keys are gathered (on CUDA always; forced here), a batch whose keys exceed GATHER_ELEMENTS
    gathers and multiplies them a slice at a time, with the scores of one gather (to rounding: the product's
    kernel for other shapes may sum a dot product in another order)."""
    from loopserve.cache import pool

    kv = _store(dtype)
    kv._reads_keys_in_place = False  # (force the gather)
    index, visible = _reads(kv, 5, 40)
    q = torch.randn(5, 4, 16).to(dtype)
    whole = kv.scores(q, index, visible, 16 ** -0.5)
    monkeypatch.setattr(pool, "GATHER_ELEMENTS", 2 * 5 * 16 * 7)  # 7 keys a slice: 6 slices, the last of 5
    gathered: list[int] = []
    keys = kv.keys
    monkeypatch.setattr(kv, "keys", lambda index: gathered.append(index.shape[-1]) or keys(index))
    sliced = kv.scores(q, index, visible, 16 ** -0.5)
    assert gathered == [7] * 5 + [5]
    assert sliced.shape == whole.shape == (2, 5, 2, 40)
    assert torch.equal(sliced.isneginf(), whole.isneginf())
    torch.testing.assert_close(sliced, whole)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@settings(max_examples=25, deadline=None)
@given(rows=st.integers(1, 6), length=st.integers(1, 50), pad=st.integers(0, 30), seed=st.integers(0, 1000))
def test_a_rows_scores_do_not_depend_on_its_batch(dtype, rows, length, pad, seed):
    """Row 0 alone and row 0 in a batch, its keys padded to a longer length: the same bits."""
    kv = _store(dtype, seed=seed % 7)
    index, visible = _reads(kv, rows, length + pad, seed)
    visible[0, length:] = False
    index[:, 0, length:] = kv.index(0, torch.tensor(kv.zero_row))[:, None]
    q = torch.randn(rows, 4, 16, generator=torch.Generator().manual_seed(seed)).to(dtype)
    batched = kv.scores(q, index, visible, 0.25)
    alone = kv.scores(q[:1], index[:, :1, :length].contiguous(), visible[:1, :length].contiguous(), 0.25)
    assert torch.equal(batched[:, :1, :, :length], alone)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_call_split_over_threads_gives_the_same_bits(dtype, monkeypatch):
    kv = _store(dtype)
    index, visible = _reads(kv, 7, 64)
    q = torch.randn(7, 4, 16).to(dtype)
    one = kv.scores(q, index, visible, 0.25)
    threads = torch.get_num_threads()
    monkeypatch.setattr(scores, "KEYS_PER_THREAD", 16)
    pools = []
    monkeypatch.setattr(scores, "_pool", lambda size, make=scores._pool: pools.append(size) or make(size))
    try:
        torch.set_num_threads(3)
        split = kv.scores(q, index, visible, 0.25)
    finally:
        torch.set_num_threads(threads)
    assert pools == [2]  # the call went to two workers besides the caller
    assert torch.equal(one, split)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_scores_over_block_runs_equal_the_gathered_product(dtype):
    """Keys in runs of contiguous rows that jump between blocks, as an engine's block tables give them, over more
    than `AHEAD` keys: the rows the pass prefetches ahead (at every key, or where the keys jump) change nothing."""
    kv = _store(dtype, capacity=640)
    g = torch.Generator().manual_seed(4)
    length = 3 * scores.AHEAD + 5
    blocks = torch.stack([torch.randperm(40, generator=g)[:(length + 15) // 16] for _ in range(4)])  # 16-row blocks
    keys = (blocks[:, :, None] * 16 + torch.arange(16)).reshape(4, -1)[:, :length]
    visible = torch.ones(4, length, dtype=torch.bool)
    visible[2, -7:] = False  # a sequence shorter than the batch's longest: its tail reads the zero row
    index = kv.index(torch.randint(0, 3, (4, length), generator=g), keys.where(visible, kv.zero_row))
    q = torch.randn(4, 2, 16, generator=g).to(dtype)
    torch.testing.assert_close(kv.scores(q, index, visible, 16 ** -0.5), _gathered(kv, q, index, visible))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("wild", [-(1 << 40), 1 << 40])
def test_a_wild_index_ahead_is_prefetched_harmlessly_then_refused(dtype, wild):
    """The pass prefetches the row of a key `AHEAD` positions before it reads it: an index far outside the
    store is prefetched first (a hint, which never faults), then refused when its key is reached."""
    kv = _store(dtype)
    index, visible = _reads(kv, 2, scores.AHEAD + 10)
    index[0, 1, scores.AHEAD + 5] = wild
    visible[1, scores.AHEAD + 5] = True
    with pytest.raises(IndexError, match="outside the store"):
        kv.scores(torch.randn(2, 2, 16).to(dtype), index, visible, 0.25)


def test_prefetch_row_is_a_hint_that_never_faults():
    """`jit.prefetch_row` on a row in range, past the end, far outside (either sign), for rows of one line and of
    several: it returns, and what it was pointed at is unchanged. An argument it cannot serve fails typing."""
    import numba

    from loopserve.jit import prefetch_row

    @numba.njit
    def touch(rows, picks):
        for r in picks:
            prefetch_row(rows, r)
        return rows.sum()

    picks = np.array([0, 3, 4, -1, 1 << 20, -(1 << 40), 1 << 40], np.int64)
    for rows in (np.arange(8.0).reshape(4, 2), np.ones((4, 300), np.int16)):
        before = rows.copy()
        assert touch(rows, picks) == before.sum() and np.array_equal(rows, before)
    with pytest.raises(numba.TypingError):
        touch(np.ones(4), picks)  # one dimension: not a table of rows


def test_bfloat16_intrinsics_convert_as_torch_does():
    """`jit.bfloat16_bits` rounds float32 to bfloat16 as torch's cast does (to nearest, ties to even, overflow to
    inf) on a million random bit patterns and the edge cases, a NaN to a NaN (its payload aside); `widen_bfloat16`
    widens every one of the 65,536 bfloat16 patterns as torch does."""
    import numba

    from loopserve.jit import bfloat16_bits, widen_bfloat16

    @numba.njit
    def narrow(x, out):
        for i in range(x.shape[0]):
            out[i] = bfloat16_bits(x[i])

    @numba.njit
    def widen(bits, out):
        for i in range(bits.shape[0]):
            out[i] = widen_bfloat16(bits[i])

    patterns = np.random.default_rng(0).integers(0, 1 << 32, 1 << 20, dtype=np.uint64).astype(np.uint32)
    edges = np.array([0, 0x80000000, 0x7F7FFFFF, 0xFF7FFFFF, 0x7F7F8000, 0x7F7F7FFF, 0x00000001, 0x00008000,
                      0x00018000, 0x3F808000, 0x3F818000, 0x7F800000, 0xFF800000, 0x7F800001, 0xFFC00000], np.uint32)
    x = np.concatenate([patterns, edges]).view(np.float32)
    got = np.empty(len(x), np.int16)
    narrow(x, got)
    want = torch.from_numpy(x).to(torch.bfloat16)
    nan = np.isnan(x)
    assert np.array_equal(got[~nan], want.view(torch.int16).numpy()[~nan])
    assert torch.isnan(torch.from_numpy(got[nan]).view(torch.bfloat16)).all()
    bits = np.arange(-(1 << 15), 1 << 15, dtype=np.int16)
    wide = np.empty(len(bits), np.float32)
    widen(bits, wide)
    torch_wide = torch.from_numpy(bits).view(torch.bfloat16).float().numpy()
    assert np.array_equal(wide.view(np.uint32), torch_wide.view(np.uint32))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
@pytest.mark.parametrize("grad", [False, True])  # True: the gather path (a query that needs gradients)
def test_a_later_layers_shift_reads_what_the_shifted_index_reads(dtype, grad):
    """`attend_decode(..., shift)` (a later layer: the first layer's index, `shift` rows on; on the CPU read as
    offset views of the store) gives what the shifted index gives, bit for bit; the zero row it lands on for
    hidden keys is the shifted slot's, zero too. A shift past the store is refused, not read."""
    from loopserve.models.layers import attend_decode

    kv = _store(dtype)
    g = torch.Generator().manual_seed(5)
    keys = torch.randint(0, kv.capacity, (4, 40), generator=g)
    visible = torch.rand(4, 40, generator=g) < 0.8
    index = kv.index(torch.randint(0, 2, (4, 40), generator=g), keys.where(visible, kv.zero_row))  # slots 0, 1
    q = torch.randn(4, 4, 16, generator=g).to(dtype).requires_grad_(grad)
    shift = kv.slot_stride  # one slot on
    got = attend_decode(q, kv, index, visible, shift)
    assert torch.equal(got, attend_decode(q, kv, index + shift, visible))
    assert not torch.equal(got, attend_decode(q, kv, index, visible))  # (the shift reads other rows)
    if not grad:
        with pytest.raises(IndexError, match="outside the store"):
            attend_decode(q, kv, index, visible, kv.k.numel() // kv.k.shape[-1])


def test_an_index_outside_the_store_raises_instead_of_reading_past_it():
    kv = _store(torch.float32)
    index, visible = _reads(kv, 2, 8)
    index[1, 1, 3] = kv.k.numel() // kv.k.shape[-1]  # one past the last row
    visible[1, 3] = True
    with pytest.raises(IndexError, match="outside the store"):
        kv.scores(torch.randn(2, 2, 16), index, visible, 0.25)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_non_finite_keys_of_one_sequence_stay_in_its_row(dtype):
    """Row 1's keys (rows 150-299 of the store) turn NaN: row 0 (rows 0-149) keeps its scores bit for bit."""
    kv = _store(dtype)
    g = torch.Generator().manual_seed(1)
    keys = torch.stack([torch.randint(0, 150, (30,), generator=g), torch.randint(150, 300, (30,), generator=g)])
    visible = torch.ones(2, 30, dtype=torch.bool)
    index = kv.index(0, keys)
    q = torch.randn(2, 2, 16, generator=g).to(dtype)
    clean = kv.scores(q, index, visible, 0.25)
    kv.k[:, 0, 150:300] = float("nan")
    dirty = kv.scores(q, index, visible, 0.25)
    assert torch.equal(dirty[:, 0], clean[:, 0]) and dirty[:, 1].isnan().all()


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_a_forked_child_splits_calls_on_threads_of_its_own(monkeypatch):
    """A child forked after a split call inherits the parent's pool but not its threads: it must make its own
    (else its split calls would wait forever)."""
    kv = _store(torch.float32)
    index, visible = _reads(kv, 7, 64)
    q = torch.randn(7, 4, 16)
    monkeypatch.setattr(scores, "KEYS_PER_THREAD", 16)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(3)
        want = kv.scores(q, index, visible, 0.25)  # the parent's pool now exists
        pid = os.fork()
        if pid == 0:  # the child: exit 0 only if its split call finishes with the same bits
            ok = False
            try:
                ok = torch.equal(kv.scores(q, index, visible, 0.25), want)
            finally:
                os._exit(0 if ok else 1)
        deadline = time.monotonic() + 60
        while (done := os.waitpid(pid, os.WNOHANG))[0] == 0 and time.monotonic() < deadline:
            time.sleep(0.05)
        if done[0] == 0:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            pytest.fail("the forked child's split call hung")
        assert os.waitstatus_to_exitcode(done[1]) == 0
    finally:
        torch.set_num_threads(threads)


def test_mismatched_shapes_are_refused_before_the_compiled_pass():
    kv = _store(torch.float32)
    index, visible = _reads(kv, 3, 10)
    with pytest.raises(ValueError, match="do not match"):
        kv.scores(torch.randn(3, 2, 16), index, visible[:, :9], 0.25)
    with pytest.raises(ValueError, match="do not match"):
        kv.scores(torch.randn(3, 3, 16), index, visible, 0.25)  # 3 query heads over 2 kv heads


def test_queries_the_pass_cannot_serve_take_the_gather():
    """A query that needs gradients, or is not in the store's dtype, is served as the gather path serves it
    (a graph to differentiate; a dtype error), not silently detached or mixed."""
    kv = _store(torch.float32)
    index, visible = _reads(kv, 3, 10)
    q = torch.randn(3, 2, 16, requires_grad=True)
    assert kv.scores(q, index, visible, 0.25).grad_fn is not None
    with pytest.raises(RuntimeError):
        kv.scores(torch.randn(3, 2, 16, dtype=torch.float64), index, visible, 0.25)


def test_no_rows_and_no_keys_give_empty_scores():
    kv = _store(torch.float32)
    empty_rows = kv.scores(torch.randn(0, 2, 16), torch.zeros(2, 0, 5, dtype=torch.long),
                           torch.zeros(0, 5, dtype=torch.bool), 0.25)
    no_keys = kv.scores(torch.randn(3, 2, 16), torch.zeros(2, 3, 0, dtype=torch.long),
                        torch.zeros(3, 0, dtype=torch.bool), 0.25)
    assert empty_rows.shape == (2, 0, 1, 5) and no_keys.shape == (2, 3, 1, 0)


@pytest.mark.parametrize("dtype,kernel", [("float32", "_scores"), ("bfloat16", "_scores_bf16")])
def test_the_warm_up_compiles_what_a_call_needs(tmp_path, dtype, kernel):
    """`compile_scores` (run when an engine starts) compiles the pass for the types a decode call gives it: the
    first real call compiles nothing more. In a fresh process with an empty numba cache."""
    code = f"""
import torch
from loopserve.cache import scores
from loopserve.cache.pool import KVStore
kernel = scores.{kernel}
kv = KVStore(64, 3, 2, 16, torch.{dtype})
assert not kernel.signatures
kv.compile_scores()
assert len(kernel.signatures) == 1
index = kv.index(torch.zeros(3, 5, dtype=torch.long), torch.arange(15).view(3, 5))
kv.scores(torch.randn(3, 4, 16).to(torch.{dtype}), index, torch.ones(3, 5, dtype=torch.bool), 0.25)
assert len(kernel.signatures) == 1, kernel.signatures
"""
    env = {**os.environ, "NUMBA_CACHE_DIR": str(tmp_path)}
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]


@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-12), (torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("heads", [2, 6])
def test_fused_decode_attention_equals_the_separate_ops(dtype, tol, heads, monkeypatch):
    """CUDA's decode attention (K and V gathered, one fused attention call per slice of rows), forced here on the
    CPU: the same outputs as scores, softmax and the weighted sum of V apart; a row that sees no key gets zeros;
    rows sliced to bound the gather give the whole call's result."""
    from loopserve.cache import pool
    from loopserve.models import layers

    kv = _store(dtype)
    index, visible = _reads(kv, 7, 40, seed=2)
    visible[3] = False  # a passive row: reads only the zero row
    index[:, 3] = kv.index(0, torch.tensor(kv.zero_row))[:, None]
    q = torch.randn(7, heads, 16, generator=torch.Generator().manual_seed(4)).to(dtype)
    apart = layers.attend_decode(q, kv, index, visible)
    monkeypatch.setattr(layers, "SDPA_DECODE_DEVICES", ("cpu",))
    gathered: list[int] = []
    keys = kv.keys
    monkeypatch.setattr(kv, "keys", lambda index: gathered.append(index.shape[1]) or keys(index))
    fused = layers.attend_decode(q, kv, index, visible)
    assert gathered == [7]  # one slice: the fused path ran
    assert fused.shape == apart.shape == (7, heads * 16) and fused.dtype == dtype
    assert not fused[3].any() and not apart[3].any()
    torch.testing.assert_close(fused, apart, atol=tol, rtol=tol)
    monkeypatch.setattr(pool, "GATHER_ELEMENTS", 2 * 40 * 16 * 3)  # 3 rows a slice: 3, 3, 1
    gathered.clear()
    sliced = layers.attend_decode(q, kv, index, visible)
    assert gathered == [3, 3, 1]
    torch.testing.assert_close(sliced, fused, atol=tol, rtol=tol)
