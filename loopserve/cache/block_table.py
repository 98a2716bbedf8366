"""`BlockTables`: the block tables of all resident sequences in one array, on the host and the device.

Table row `slot` lists one sequence's KV blocks in position order, so the physical KV row of
position p is `table[slot, p // block_size] * block_size + p % block_size`. The host copy (numpy)
is the truth: the scheduler grows it as sequences allocate blocks, and the runner computes the rows
a batch writes from it, vectorized. Attention reads keys through the device copy, so building a
batch costs O(rows) on the host whatever the context length; the device copy is brought up to date
by uploading only the entries that changed since the last sync (on the CPU the two share memory).

A table whose block size is 1 is a plain row map (the reference decoder and tests use that form).
"""

from __future__ import annotations

import numpy as np
import torch

from loopserve.device import upload
from loopserve.jit import compiled


class BlockTables:
    def __init__(self, num_slots: int, max_blocks: int, block_size: int, device: torch.device | str = "cpu") -> None:
        self.block_size = block_size
        self.device = torch.device(device)
        self._alloc(max(num_slots, 1), max(max_blocks, 1))

    def _alloc(self, num_slots: int, max_blocks: int, keep: np.ndarray | None = None) -> None:
        host = np.zeros((num_slots, max_blocks), dtype=np.int64)  # unused entries: block 0 (never read unmasked)
        if keep is not None:
            host[: keep.shape[0], : keep.shape[1]] = keep
        self.host = host
        self.shares_host = self.device.type == "cpu"  # the table is the host array itself: nothing to sync
        self.table = torch.from_numpy(host) if self.shares_host else upload(torch.from_numpy(host), self.device)
        self._dirty: list[tuple[int, int, int]] = []  # (slot, first column, end column) changed on the host

    @staticmethod
    def from_row_maps(row_maps: list[torch.Tensor], device: torch.device | str = "cpu") -> BlockTables:
        """One slot per row map (position -> physical row): a table of block size 1."""
        host = np.zeros((max(len(row_maps), 1), max((len(m) for m in row_maps), default=1)), dtype=np.int64)
        for i, m in enumerate(row_maps):
            host[i, : len(m)] = m.numpy()
        t = BlockTables(1, 1, 1, device)
        t._alloc(*host.shape, keep=host)
        return t

    @property
    def num_slots(self) -> int:
        return self.host.shape[0]

    def set_blocks(self, slot: int, first: int, blocks: list[int]) -> None:
        """Write `blocks` into columns first.. of `slot` (growing the table when needed)."""
        end = first + len(blocks)
        if slot >= self.num_slots or end > self.host.shape[1]:
            self._grow(max(slot + 1, self.num_slots), max(end, self.host.shape[1]))
        self.host[slot, first:end] = blocks
        if not self.shares_host and blocks:
            self._dirty.append((slot, first, end))

    def set_entries(self, slots: np.ndarray, columns: np.ndarray, blocks: np.ndarray) -> None:
        """Write blocks[i] into column columns[i] of slot slots[i] (growing the table when needed)."""
        if not len(slots):
            return
        top_slot, top_column = int(slots.max()), int(columns.max())
        if top_slot >= self.num_slots or top_column >= self.host.shape[1]:
            self._grow(max(top_slot + 1, self.num_slots), max(top_column + 1, self.host.shape[1]))
        self.host[slots, columns] = blocks
        if not self.shares_host:
            self._dirty += [(s, c, c + 1) for s, c in zip(slots.tolist(), columns.tolist(), strict=True)]

    def _grow(self, slots: int, blocks: int) -> None:
        self.sync()
        self._alloc(max(slots, 2 * self.num_slots) if slots > self.num_slots else slots,
                    max(blocks, 2 * self.host.shape[1]) if blocks > self.host.shape[1] else blocks, keep=self.host)

    def sync(self) -> None:
        """Upload the entries changed on the host since the last sync (one small copy per change)."""
        for slot, a, b in self._dirty:
            self.table[slot, a:b] = upload(torch.from_numpy(self.host[slot, a:b].copy()), self.device)
        self._dirty.clear()

    def rows(self, slots: np.ndarray, positions: np.ndarray) -> np.ndarray:
        """Physical KV rows of (slot, position) pairs, on the host: one compiled pass (as array expressions, five
        calls: a prelude batch's plan paid them every tick)."""
        if len(positions) != len(slots):
            raise ValueError(f"positions: {len(positions)} for {len(slots)} slots")
        out = np.empty(len(slots), np.int64)
        _kv_rows(self.host, slots, positions, self.block_size, out)
        return out

    def row(self, slot: int, position: int) -> int:
        bs = self.block_size
        return int(self.host[slot, position // bs]) * bs + position % bs

    def key_rows(self, slots: torch.Tensor, length: int) -> torch.Tensor:
        """[len(slots), length] physical rows of positions 0..length-1 of each slot's sequence, computed
        where the table lives (device work, no host loop). Positions 0..length-1 are the table's first
        blocks in order, so this is their block ids (a row gather of the first columns only: a table may be
        much wider than the batch's longest context) spread over their rows in one broadcast; gathering a
        block per position was 4-7x slower on the CPU (256 rows, 4k keys: 11-14 ms against 2 ms)."""
        bs = self.block_size
        blocks = -(-length // bs)
        if blocks > self.table.shape[1]:
            raise IndexError(f"key_rows: {length} positions need {blocks} blocks, the table has {self.table.shape[1]}")
        offsets = torch.arange(bs, device=self.table.device)
        return (self.table[:, :blocks].index_select(0, slots).unsqueeze(-1) * bs + offsets).flatten(1)[:, :length]


@compiled
def _kv_rows(table, slots, positions, block_size, out):
    """`BlockTables.rows` into out (a slot or block index outside the table raises IndexError, as numpy's indexing)."""
    for k in range(slots.shape[0]):
        p = positions[k]
        out[k] = table[slots[k], p // block_size] * block_size + p % block_size
