"""Per-call metadata of a stage batch: which rows, where their KV lives, what they may attend to.

A stage batch is a set of query rows. Rows are grouped into *segments*: consecutive positions of one
sequence (a prefill chunk is one segment; a decode token is a segment of one row). Every row of a
segment runs at the same loop depth. The runner and the reference decoder build this object; the
model code only reads it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from loopserve.cache.block_table import BlockTables
from loopserve.cache.layout import KVLayout
from loopserve.cache.pool import KVStore
from loopserve.device import upload


@dataclass
class ForwardContext:
    kv: KVStore
    layout: KVLayout
    positions: torch.Tensor  # [N] absolute positions of the rows
    write_rows: torch.Tensor  # [N] physical KV rows of the rows' own tokens
    depth: torch.Tensor  # [N] loop depth being computed (1-based); unused outside the core
    segments: list[int] | None  # row index where each segment starts (+ N at the end); None: a row each
    tables: BlockTables  # block tables the segments' keys are read through
    seg_slots: torch.Tensor  # [S] each segment's row in `tables` (on the device)
    # keys each segment attends to (its last position + 1), on the host: an array for a row per segment
    # (decode), a list of ints for prefill chunks (attention reads them one by one)
    seg_key_lens: np.ndarray | list[int]
    max_keys: int  # the longest segment's key count: a host int (the width of `seg_keys`, a shape)
    cache: dict = field(default_factory=dict)  # values derived on first use (rotary angles, key rows)

    @property
    def num_rows(self) -> int:
        return int(self.positions.shape[0])

    @property
    def seg_starts(self) -> list[int]:
        """Row index where each segment starts (+ N at the end). A decode context (a row per segment)
        holds no such list: nothing on its path reads one."""
        return list(range(self.num_rows + 1)) if self.segments is None else self.segments

    @property
    def one_row_segments(self) -> bool:
        return self.segments is None or len(self.segments) - 1 == self.num_rows

    @property
    def seg_keys(self) -> torch.Tensor:
        """[S, Lk] physical KV rows of positions 0..Lk-1 of each segment's sequence (Lk: the longest
        segment's key count). Computed on the device from the block tables when attention first asks."""
        if "keys" not in self.cache:
            self.cache["keys"] = self.tables.key_rows(self.seg_slots, self.max_keys)
        return self.cache["keys"]

    @property
    def prefill_groups(self) -> PrefillGroups:
        """The segments of a prefill context grouped for batched attention (`group_segments`), with the
        row gathers that pad each group and put its outputs back in row order; made on first use."""
        if "groups" not in self.cache:
            self.cache["groups"] = PrefillGroups.build(self.seg_starts, self.seg_key_lens, self.positions.device)
        return self.cache["groups"]

    def with_depth(self, depth: torch.Tensor) -> ForwardContext:
        return ForwardContext(self.kv, self.layout, self.positions, self.write_rows, depth, self.segments,
                              self.tables, self.seg_slots, self.seg_key_lens, self.max_keys, self.cache)

    def select(self, rows: list[int]) -> ForwardContext:
        """Sub-batch of whole segments given by row indices (used when some rows stop looping)."""
        lens: np.ndarray | list[int]
        if self.segments is None:  # a row per segment
            starts, seg_ids = None, rows
            lens = np.asarray(self.seg_key_lens)[seg_ids]
        else:
            keep = set(rows)
            starts, seg_ids = [0], []
            for s in range(len(self.segments) - 1):
                a, b = self.segments[s], self.segments[s + 1]
                if a in keep:
                    seg_ids.append(s)
                    starts.append(starts[-1] + (b - a))
            lens = [self.seg_key_lens[i] for i in seg_ids]
        idx, segs = upload(rows, self.positions.device), upload(seg_ids, self.positions.device)
        return ForwardContext(self.kv, self.layout, self.positions[idx], self.write_rows[idx], self.depth[idx],
                              starts, self.tables, self.seg_slots[segs], lens, int(np.max(lens)))


# Grouping pays for small chunks only (a call's fixed ops are most of their cost); past a few thousand
# key rows a group's gathered K/V and scores outgrow the caches and one call per chunk is faster (8 chunks
# of 4 rows at 4k keys, 4 layers: 146 ms one call each, 216-235 ms as one group, on this CPU). So a group of
# several chunks holds at most GROUP_MAX_KEYS padded key rows (size x max keys: its K/V gather) and
# GROUP_MAX_PAIRS padded query-key pairs (its scores), and padding may add a quarter of its real pairs plus
# GROUP_CALL_PAIRS, what one more call costs (~20 ops on the CPU, about 16k pairs of bf16 work).
GROUP_MAX_KEYS = 4096
GROUP_MAX_PAIRS = 1 << 18
GROUP_CALL_PAIRS = 16_384


def group_segments(queries: list[int], keys: list[int]) -> list[list[int]]:
    """Segments (query rows, keys) -> groups of segment indices to attend to in one batched call each,
    padded to the group's most queries and keys. Segments are taken by key count, longest first, and a
    group grows while it stays within the bounds above. A batch of short prompts of one length makes one
    group; a long chunk is never padded into a group of short ones, and long chunks attend one by one."""
    order = sorted(range(len(keys)), key=lambda s: -keys[s])
    groups: list[list[int]] = []
    q = k = real = 0  # the last group's most queries, key count (its first segment's) and real pairs
    for s in order:
        if groups:
            size, wide = len(groups[-1]) + 1, max(q, queries[s])
            padded, more = size * wide * k, real + queries[s] * keys[s]
            if (size * k <= GROUP_MAX_KEYS and padded <= GROUP_MAX_PAIRS
                    and 4 * padded <= 5 * more + 4 * GROUP_CALL_PAIRS):
                groups[-1].append(s)
                q, real = wide, more
                continue
        groups.append([s])
        q, k, real = queries[s], keys[s], queries[s] * keys[s]
    return groups


@dataclass
class PrefillGroup:
    segments: torch.Tensor  # [G] segment indices
    query_rows: torch.Tensor  # [G, Q] each segment's rows, its last row repeated as padding
    num_keys: int  # the group's key count (its first segment's, the longest)


@dataclass
class PrefillGroups:
    groups: list[PrefillGroup]
    # row r's output is row take[r] of the groups' padded outputs, concatenated in group order
    take: torch.Tensor

    @staticmethod
    def build(starts: list[int], key_lens: list[int] | np.ndarray, device: torch.device) -> PrefillGroups:
        first = np.asarray(starts[:-1], dtype=np.int64)
        queries = np.asarray(starts[1:], dtype=np.int64) - first
        keys = [int(k) for k in key_lens]
        groups, seg_base, base = [], np.empty(len(first), dtype=np.int64), 0
        for seg in group_segments(queries.tolist(), keys):
            ids = np.asarray(seg, dtype=np.int64)
            q = int(queries[ids].max())
            rows = first[ids, None] + np.minimum(np.arange(q)[None, :], queries[ids, None] - 1)
            seg_base[ids] = base + q * np.arange(len(ids))  # where each segment's padded rows start
            base += len(ids) * q
            groups.append(PrefillGroup(upload(torch.from_numpy(ids), device), upload(torch.from_numpy(rows), device),
                                       keys[seg[0]]))
        take = np.repeat(seg_base - first, queries) + np.arange(starts[-1])
        return PrefillGroups(groups, upload(torch.from_numpy(take), device))


@dataclass
class DenseContext:
    """Training / scoring context: `batch` equal-length sequences packed as rows, plain causal
    attention at every depth (the depth_indexed semantics the checkpoints were trained with), no
    KV cache. Differentiable."""

    batch: int
    seq_len: int
    positions: torch.Tensor  # [batch * seq_len]
    cache: dict = field(default_factory=dict)  # rotary angles, derived on first use


def dense_context(batch: int, seq_len: int, device=None) -> DenseContext:
    return DenseContext(batch, seq_len, torch.arange(seq_len, device=device).repeat(batch))


def paged_context(kv: KVStore, layout: KVLayout, tables: BlockTables, segments: list[tuple[int, int, int]],
                  depth: list[int] | torch.Tensor | None = None,
                  write_rows: list[int] | torch.Tensor | None = None) -> ForwardContext:
    """Context for segments given as (table slot, start_pos, n_rows).

    `depth` gives each row's loop depth (default 1); `write_rows` overrides where the rows write
    their KV (default: their own positions' rows). Host work is O(rows): positions and write rows
    come from the host block table, vectorized; the [S, Lk] key rows are derived on the device
    (`ForwardContext.seg_keys`), so building a context neither waits for the device nor grows with
    the context length.
    """
    slots = np.fromiter((sl for sl, _, _ in segments), dtype=np.int64, count=len(segments))
    starts = np.fromiter((st for _, st, _ in segments), dtype=np.int64, count=len(segments))
    counts = np.fromiter((n for _, _, n in segments), dtype=np.int64, count=len(segments))
    if counts.max() == 1:  # decode: one row per segment
        return decode_context(kv, layout, tables, slots, starts, depth, write_rows)
    tables.sync()
    pos = np.concatenate([np.arange(st, st + n) for st, n in zip(starts, counts, strict=True)])
    writes = tables.rows(np.repeat(slots, counts), pos) if write_rows is None else write_rows
    return _context(kv, layout, tables, slots, pos, writes, depth, [0, *np.cumsum(counts).tolist()], starts + counts)


def decode_context(kv: KVStore, layout: KVLayout, tables: BlockTables, slots: np.ndarray, positions: np.ndarray,
                   depth: np.ndarray | list[int] | torch.Tensor | None = None,
                   write_rows: np.ndarray | list[int] | torch.Tensor | None = None) -> ForwardContext:
    """Context for decode rows, one per segment: row i is position `positions[i]` of the sequence in
    table slot `slots[i]` (arrays; nothing here loops over rows in Python)."""
    tables.sync()
    writes = tables.rows(slots, positions) if write_rows is None else write_rows
    return _context(kv, layout, tables, slots, positions, writes, depth, None, positions + 1)


def packed_decode_context(kv: KVStore, layout: KVLayout, tables: BlockTables, host: np.ndarray,
                          device: torch.Tensor, max_keys: int) -> ForwardContext:
    """`decode_context` from the rows' metadata packed in one int64 array whose first rows are positions,
    write rows, depths and table slots (`host`; `device`: the same array uploaded in one copy; a caller
    may pack more rows after these); `max_keys`: the largest position + 1."""
    tables.sync()
    positions, writes, depths, slots = device[0], device[1], device[2], device[3]  # (unbind costs more)
    return ForwardContext(kv, layout, positions, writes, depths, None, tables, slots, host[0] + 1, max_keys)


def _context(kv: KVStore, layout: KVLayout, tables: BlockTables, slots: np.ndarray, pos: np.ndarray, writes,
             depth, seg_starts: list[int] | None, key_lens: np.ndarray) -> ForwardContext:
    dev = kv.k.device
    w, d = _long(writes), torch.ones(len(pos), dtype=torch.long) if depth is None else _long(depth)
    lens = key_lens if seg_starts is None else key_lens.tolist()
    return ForwardContext(kv, layout, upload(torch.from_numpy(pos), dev), upload(w, dev), upload(d, dev), seg_starts,
                          tables, upload(torch.from_numpy(slots), tables.table.device), lens, int(key_lens.max()))


def _long(x: np.ndarray | list[int] | torch.Tensor) -> torch.Tensor:
    """An int64 tensor of `x` (an int64 array is wrapped, not copied)."""
    if isinstance(x, np.ndarray) and x.dtype == np.int64:
        return torch.from_numpy(x)
    return torch.as_tensor(x, dtype=torch.long)


def build_context(kv: KVStore, layout: KVLayout, segments: list[tuple[torch.Tensor, int, int]],
                  depth: list[int] | torch.Tensor | None = None,
                  write_rows: list[int] | torch.Tensor | None = None) -> ForwardContext:
    """Context for segments given as (row_map, start_pos, n_rows), where `row_map` (a CPU tensor) maps
    positions 0..start_pos+n_rows-1 of the segment's sequence to physical KV rows (the reference
    decoder and tests: a row map is a block table of block size 1)."""
    tables = BlockTables.from_row_maps([m for m, _, _ in segments], kv.k.device)
    return paged_context(kv, layout, tables, [(i, st, n) for i, (_, st, n) in enumerate(segments)], depth, write_rows)
