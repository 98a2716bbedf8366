"""Attention scores of decode queries, read where the keys lie in the paged KV store (CPU: float32/64, bfloat16).

A decode query's keys are rows scattered over its sequence's blocks. Gathering them into one contiguous
tensor and multiplying that (`KVStore.keys`, then a batched matmul) writes every key once more and reads
it twice; at long contexts that copy was the largest part of a decode step on the CPU (docs/benchmarks.md
§8.21). `decode_scores` reads each key row once, where it is, and writes only the scores.

A sequence's blocks lie all over the store (a decoding sequence takes its next block between other sequences'
blocks), and the CPU's own prefetcher follows sequential reads only. So the passes prefetch the key `AHEAD`
positions on: the bfloat16 pass at every key (1.4-1.9x faster over scattered blocks), the float pass where the
keys jump to another block (docs/benchmarks.md §8.29).

Each (kv head, query row) pair is computed whole by one thread, in one order whatever else is in the
batch and however many threads share the call: a row's scores never depend on its neighbours.

numpy has no bfloat16, so a bfloat16 store is read as its 16-bit patterns: a key widens to float32 exactly
(its bits shifted up), the dot product is summed in float32, and the score is rounded to bfloat16, scaled and
rounded again, as the gathered path's bfloat16 matmul and scaling do (the sum's order may differ from that
matmul's: rounding, as between any two products).
"""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch

from loopserve.jit import bfloat16_bits, inlined_kernel, kernel, prefetch_row, widen_bfloat16

# Keys one thread takes at least before a call is split over threads: a slice of fewer finishes before
# a thread is woken (a key's dot product is some ns; a hand-off some tens of µs).
KEYS_PER_THREAD = 1 << 16
SCORE_DTYPES = (torch.float32, torch.float64, torch.bfloat16)
# How many keys ahead of the one being scored its row is prefetched: some 100-200 ns of work at a few ns a key,
# about a read from memory (16 to 48 measured the same over scattered blocks; 8 too few)
AHEAD = 24


def key_rows(k: torch.Tensor) -> np.ndarray:
    """A CPU store's K ([..., head_dim], `SCORE_DTYPES`) as the numpy view `decode_scores` reads: [rows, head_dim],
    bfloat16 as its int16 bit patterns."""
    flat = k.view(-1, k.shape[-1])
    return (flat.view(torch.int16) if k.dtype == torch.bfloat16 else flat).numpy()


def decode_scores(q: torch.Tensor, k_rows: np.ndarray, index: torch.Tensor, visible: torch.Tensor,
                  scale: float) -> torch.Tensor:
    """scale * q . K[index] for one query per sequence, -inf where a key is not visible.

    q [N, heads, d] (`SCORE_DTYPES`); k_rows: the store's K as [rows, d] (`key_rows`); index [kv_heads, N, L] flat
    row indices (`KVStore.index`); visible [N, L] bool. Returns [kv_heads, N, heads // kv_heads, L]
    (query head h reads kv head h // (heads // kv_heads)), in q's dtype."""
    nkv, n, length = index.shape
    if visible.shape != (n, length) or q.shape[0] != n or q.shape[1] % nkv or q.shape[2] != k_rows.shape[1]:
        # (the compiled pass trusts these shapes: it checks only the indices it reads the store at)
        raise ValueError(f"decode_scores: q {tuple(q.shape)}, K rows {k_rows.shape}, index {tuple(index.shape)} "
                         f"and visible {tuple(visible.shape)} do not match")
    out = torch.empty(nkv, n, q.shape[1] // nkv, length, dtype=q.dtype)
    if q.dtype == torch.bfloat16:  # (float32 queries, exact; bfloat16 scores written as their bits)
        run, qn, written = _scores_bf16, q.float().contiguous().numpy(), out.view(torch.int16).numpy()
    else:
        run, qn, written = _scores, q.contiguous().numpy(), out.numpy()
    args = (qn, k_rows, index.numpy(), visible.numpy(), qn.dtype.type(scale), written)
    pairs = nkv * n
    threads = min(torch.get_num_threads(), pairs, max(1, index.numel() // KEYS_PER_THREAD))
    if threads <= 1:  # (0: no rows)
        run(*args, 0, pairs)
        return out
    bounds = np.linspace(0, pairs, threads + 1).astype(int).tolist()
    slices = list(zip(bounds[:-1], bounds[1:], strict=True))
    workers = _pool(threads - 1)
    waits = [workers.submit(run, *args, a, b) for a, b in slices[1:]]
    run(*args, *slices[0])  # this thread takes the first slice
    for w in waits:
        w.result()
    return out


_workers: tuple[int, int, ThreadPoolExecutor] | None = None  # (process id, threads, pool)


def _pool(size: int) -> ThreadPoolExecutor:
    """Worker threads for split calls, made on first use, again when torch's thread count grows, and again
    in a forked child (which inherits the pool but not its threads: work sent there would never run)."""
    global _workers
    if _workers is None or _workers[0] != os.getpid() or _workers[1] < size:
        if _workers is not None and _workers[0] == os.getpid():
            _workers[2].shutdown(wait=False)
        _workers = (os.getpid(), size, ThreadPoolExecutor(max_workers=size, thread_name_prefix="loopserve-scores"))
    return _workers[2]


@inlined_kernel
def _dot(a, b):
    s = a.dtype.type(0.0)
    for j in range(a.shape[0]):
        s += a[j] * b[j]
    return s


@kernel
def _scores(q, k_rows, index, visible, scale, out, first, last):  # pragma: no cover (compiled)
    """Scores of the (kv head, query row) pairs first..last-1 of `decode_scores`, pair p = head * N + row."""
    n, length = visible.shape
    group = out.shape[2]
    for p in range(first, last):
        h, i = p // n, p % n
        for pos in range(length):
            # only where the keys jump to another block (here a prefetch at every key cost more than it saved on
            # contiguous blocks: the float pass's keys are shorter work, so the CPU itself reads further ahead)
            if pos + AHEAD < length and index[h, i, pos + AHEAD] != index[h, i, pos + AHEAD - 1] + 1:
                prefetch_row(k_rows, index[h, i, pos + AHEAD])
            if not visible[i, pos]:
                for a in range(group):
                    out[h, i, a, pos] = -np.inf
                continue
            r = index[h, i, pos]
            if r < 0 or r >= k_rows.shape[0]:
                raise IndexError("decode_scores: a KV index is outside the store")
            key = k_rows[r]
            for a in range(group):
                out[h, i, a, pos] = _dot(q[i, h * group + a], key) * scale


_BF16_NEG_INF = np.int16(-128)  # (0xFF80: bfloat16 -inf)


@kernel
def _scores_bf16(q, k_rows, index, visible, scale, out, first, last):  # pragma: no cover (compiled)
    """`_scores` for a bfloat16 store: q float32; k_rows and out the bit patterns of bfloat16 (int16 views)."""
    n, length = visible.shape
    group, d = out.shape[2], k_rows.shape[1]
    for p in range(first, last):
        h, i = p // n, p % n
        for pos in range(length):
            if pos + AHEAD < length:  # (the key read AHEAD keys on)
                prefetch_row(k_rows, index[h, i, pos + AHEAD])
            if not visible[i, pos]:
                for a in range(group):
                    out[h, i, a, pos] = _BF16_NEG_INF
                continue
            r = index[h, i, pos]
            if r < 0 or r >= k_rows.shape[0]:
                raise IndexError("decode_scores: a KV index is outside the store")
            row = k_rows[r]
            for a in range(group):
                qa = q[i, h * group + a]
                dot = np.float32(0.0)
                # each key element widened where it is read (a vectorized load, shift and cast; the store's rows are
                # contiguous, which fixes the sum's order as the loop's vector width)
                for j in range(d):
                    dot += qa[j] * widen_bfloat16(row[j])
                # the product rounded to bfloat16, then scaled in float32 and rounded again (the gathered path's
                # bfloat16 matmul, then its scaling)
                out[h, i, a, pos] = bfloat16_bits(widen_bfloat16(bfloat16_bits(dot)) * scale)
