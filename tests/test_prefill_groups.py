"""Prefill attention in padded groups of segments (`group_segments`, `PrefillGroups`, `paged_attention`):
the groups partition the segments within the padding bound, every row's output is put back in place,
and a batch of chunks attends exactly as each chunk alone, whatever the pool's unused rows hold."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from loopserve.cache.layout import LAYOUTS, KVLayout
from loopserve.cache.pool import KVStore
from loopserve.models.context import (
    GROUP_CALL_PAIRS,
    GROUP_MAX_KEYS,
    GROUP_MAX_PAIRS,
    PrefillGroups,
    build_context,
    group_segments,
)
from loopserve.models.layers import paged_attention

segments = st.lists(st.tuples(st.integers(1, 512), st.integers(0, 4096)), min_size=1, max_size=40)


@settings(max_examples=300, deadline=None)
@given(segments)
def test_groups_partition_the_segments_within_the_padding_bound(segs):
    queries = [q for q, _ in segs]
    keys = [start + q for q, start in segs]  # a chunk of q rows from position `start`
    groups = group_segments(queries, keys)
    assert sorted(s for g in groups for s in g) == list(range(len(segs)))
    for g in groups:
        padded = len(g) * max(queries[s] for s in g) * max(keys[s] for s in g)
        real = sum(queries[s] * keys[s] for s in g)
        assert len(g) == 1 or (4 * padded <= 5 * real + 4 * GROUP_CALL_PAIRS and padded <= GROUP_MAX_PAIRS
                               and len(g) * max(keys[s] for s in g) <= GROUP_MAX_KEYS)
        assert keys[g[0]] == max(keys[s] for s in g)  # the group's key count is its first segment's


def test_like_chunks_make_one_group_and_a_long_chunk_pads_nothing():
    assert group_segments([32] * 64, [32] * 64) == [list(range(64))]
    assert group_segments([4] * 8, [4096] * 8) == [[i] for i in range(8)]  # long chunks attend one by one
    assert group_segments([1] * 64 + [8], [4096] * 64 + [4100])[0] == [64]  # no 64-row group of 4k keys
    groups = group_segments([512] + [20] * 30, [4096] + [20] * 30)
    assert groups[0] == [0] and sorted(s for g in groups[1:] for s in g) == list(range(1, 31))


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(1, 12), min_size=1, max_size=12), st.data())
def test_every_row_comes_back_to_its_place(queries, data):
    keys = [q + data.draw(st.integers(0, 200)) for q in queries]
    starts = [0, *np.cumsum(queries).tolist()]
    plan = PrefillGroups.build(starts, keys, torch.device("cpu"))
    # the groups' padded query rows, concatenated in group order, then `take`: the identity on rows
    padded = torch.cat([g.query_rows.reshape(-1) for g in plan.groups])
    assert padded[plan.take].tolist() == list(range(starts[-1]))
    for g in plan.groups:
        assert g.query_rows.shape == (len(g.segments), max(queries[s] for s in g.segments.tolist()))
        assert g.num_keys == max(keys[s] for s in g.segments.tolist())


@pytest.mark.parametrize("layout_name", LAYOUTS)
@pytest.mark.parametrize("stage", ["prelude", "core", "coda"])
def test_batched_chunks_attend_as_each_chunk_alone(layout_name, stage):
    """Chunks of different lengths and depths in one context equal each chunk in a context of its own;
    the pool's other rows hold NaN, so a key read past a shorter chunk's end would show."""
    torch.manual_seed(0)
    layout = KVLayout(layout_name, 1, 2, 1, 4)
    kv = KVStore(400, layout.slots_per_token, 2, 8, torch.float64)
    kv.k[:, :, :kv.zero_row] = float("nan")  # every row but the zero row, which is never written
    kv.v[:, :, :kv.zero_row] = float("nan")
    # (first pool row, start position, rows); pool row 0, where a short table's unused entries point, holds NaN
    chunks = [(20, 7, 2), (100, 0, 3), (200, 10, 1), (300, 33, 12)]
    depths = [2, 2, 2, 2] if stage != "core" else [2, 3, 1, 4]
    for base, start, _ in chunks:  # the chunks' earlier keys
        kv.k[:, :, base:base + start].normal_()
        kv.v[:, :, base:base + start].normal_()
        kv.depth[base:base + start] = int(torch.randint(1, 5, ()))
    maps = [torch.arange(base, base + start + n) for base, start, n in chunks]
    n_rows = sum(n for _, _, n in chunks)
    q = torch.randn(n_rows, 4, 8, dtype=torch.float64)
    k = torch.randn(n_rows, 2, 8, dtype=torch.float64)
    v = torch.randn(n_rows, 2, 8, dtype=torch.float64)
    row_depth = [d for (_, _, n), d in zip(chunks, depths, strict=True) for _ in range(n)]
    ctx = build_context(kv, layout, [(m, start, n) for m, (_, start, n) in zip(maps, chunks, strict=True)],
                        depth=row_depth)
    assert len(ctx.prefill_groups.groups) < len(chunks)  # some chunks do share a call
    layer = 1 if stage == "core" else 0
    together = paged_attention(q, k, v, ctx, stage, layer)
    a = 0
    for m, (_, start, n), d in zip(maps, chunks, depths, strict=True):
        alone = paged_attention(q[a:a + n], k[a:a + n], v[a:a + n], build_context(kv, layout, [(m, start, n)],
                                                                                 depth=[d] * n), stage, layer)
        torch.testing.assert_close(together[a:a + n], alone, rtol=1e-12, atol=1e-12)
        a += n
    assert torch.isfinite(together).all()
