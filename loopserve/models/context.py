"""Per-call metadata of a stage batch: which rows, where their KV lives, what they may attend to.

A stage batch is a set of query rows. Rows are grouped into *segments*: consecutive positions of one
sequence (a prefill chunk is one segment; a decode token is a segment of one row). Every row of a
segment runs at the same loop depth. The runner and the reference decoder build this object; the
model code only reads it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

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
    seg_starts: list[int]  # row index where each segment starts (+ N at the end)
    seg_keys: torch.Tensor  # [S, Lk] physical KV rows of positions 0..Lk-1 of each segment's sequence
    seg_key_lens: list[int]  # keys each segment attends to (its last position + 1), known on the host
    rope_cache: dict = field(default_factory=dict)

    @property
    def num_rows(self) -> int:
        return int(self.positions.shape[0])

    @property
    def one_row_segments(self) -> bool:
        return len(self.seg_starts) - 1 == self.num_rows

    def with_depth(self, depth: torch.Tensor) -> ForwardContext:
        return ForwardContext(self.kv, self.layout, self.positions, self.write_rows, depth,
                              self.seg_starts, self.seg_keys, self.seg_key_lens, self.rope_cache)

    def select(self, rows: list[int]) -> ForwardContext:
        """Sub-batch of whole segments given by row indices (used when some rows stop looping)."""
        keep = set(rows)
        starts, seg_ids = [0], []
        for s in range(len(self.seg_starts) - 1):
            a, b = self.seg_starts[s], self.seg_starts[s + 1]
            if a in keep:
                seg_ids.append(s)
                starts.append(starts[-1] + (b - a))
        idx, segs = upload(rows, self.positions.device), upload(seg_ids, self.positions.device)
        return ForwardContext(self.kv, self.layout, self.positions[idx], self.write_rows[idx],
                              self.depth[idx], starts, self.seg_keys[segs], [self.seg_key_lens[i] for i in seg_ids])


@dataclass
class DenseContext:
    """Training / scoring context: `batch` equal-length sequences packed as rows, plain causal
    attention at every depth (the depth_indexed semantics the checkpoints were trained with), no
    KV cache. Differentiable."""

    batch: int
    seq_len: int
    positions: torch.Tensor  # [batch * seq_len]
    rope_cache: dict = field(default_factory=dict)


def dense_context(batch: int, seq_len: int, device=None) -> DenseContext:
    return DenseContext(batch, seq_len, torch.arange(seq_len, device=device).repeat(batch))


def build_context(kv: KVStore, layout: KVLayout, segments: list[tuple[torch.Tensor, int, int]],
                  depth: list[int] | torch.Tensor | None = None,
                  write_rows: list[int] | torch.Tensor | None = None) -> ForwardContext:
    """Context for segments given as (row_map, start_pos, n_rows).

    `row_map` (a CPU tensor) maps each position 0..start_pos+n_rows-1 of the segment's sequence to
    its physical KV row (a flattened block table). `depth` gives each row's loop depth (default 1);
    `write_rows` overrides where the rows write their KV. Everything is assembled on the host and
    uploaded once, so building a context never waits for the device.
    """
    positions, writes, starts = [], [], [0]
    lk = max(s + n for _, s, n in segments)
    keys = torch.full((len(segments), lk), kv.zero_row, dtype=torch.long)  # padding: the never-written row
    for i, (row_map, start, n) in enumerate(segments):
        positions.append(torch.arange(start, start + n))
        writes.append(row_map[start:start + n])
        keys[i, : start + n] = row_map[: start + n]
        starts.append(starts[-1] + n)
    pos = torch.cat(positions)
    dev = kv.k.device
    d = torch.ones_like(pos) if depth is None else torch.as_tensor(depth, dtype=torch.long)
    w = torch.cat(writes) if write_rows is None else torch.as_tensor(write_rows, dtype=torch.long)
    return ForwardContext(kv, layout, upload(pos, dev), upload(w, dev), upload(d, dev), starts, upload(keys, dev),
                          [s + n for _, s, n in segments])
