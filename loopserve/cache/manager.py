"""Per-sequence block tables over the shared KV pool: grow, free, swap out to host memory, swap in.

A sequence's `row_map` is its flattened block table: position -> physical KV row (a CPU tensor: the
runner assembles each batch's indices on the host and uploads them once). Swapping copies a
sequence's rows (every slot, and each token's KV depth) to host memory and back, so a preempted
sequence resumes with bit-identical KV whatever the layout.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from loopserve.cache.pool import BlockAllocator, KVStore
from loopserve.device import Readback, upload


@dataclass
class BlockTable:
    blocks: list[int] = field(default_factory=list)
    row_map: torch.Tensor = field(default_factory=lambda: torch.zeros(0, dtype=torch.long))
    swapped: Readback | None = None  # host copies of k, v and the KV depths while swapped out
    num_tokens: int = 0  # tokens whose KV rows are in use


class KVCacheManager:
    def __init__(self, store: KVStore, block_size: int, reserved_blocks: int = 0) -> None:
        self.store = store
        self.block_size = block_size
        num_blocks = store.capacity // block_size
        self.allocator = BlockAllocator(num_blocks, block_size)
        # Reserved blocks (e.g. the scratch row passive CB rows write to) are owned by the manager.
        self.reserved = self.allocator.allocate(self, reserved_blocks) if reserved_blocks else []
        self.tables: dict[str, BlockTable] = {}

    @property
    def num_blocks(self) -> int:
        return self.allocator.num_blocks - len(self.reserved)

    @property
    def num_free(self) -> int:
        return self.allocator.num_free

    def usage(self) -> float:
        return 1.0 - self.num_free / max(self.num_blocks, 1)

    def blocks_needed(self, seq_id: str, num_tokens: int) -> int:
        have = len(self.tables[seq_id].blocks) if seq_id in self.tables else 0
        return max(0, self.allocator.blocks_for(num_tokens) - have)

    def ensure(self, seq_id: str, num_tokens: int) -> bool:
        """Make room for `num_tokens` tokens; False (and no change) if the pool is short."""
        table = self.tables.setdefault(seq_id, BlockTable())
        need = self.blocks_needed(seq_id, num_tokens)
        if need > self.num_free:
            if not table.blocks:
                del self.tables[seq_id]
            return False
        if need:
            new = self.allocator.allocate(seq_id, need)
            rows = [torch.arange(b * self.block_size, (b + 1) * self.block_size) for b in new]
            table.blocks += new
            table.row_map = torch.cat([table.row_map, *rows])  # host metadata, like the block list
        table.num_tokens = max(table.num_tokens, num_tokens)
        return True

    def row_map(self, seq_id: str) -> torch.Tensor:
        return self.tables[seq_id].row_map

    def free(self, seq_id: str) -> None:
        table = self.tables.pop(seq_id, None)
        if table is not None and table.blocks:
            self.allocator.free(seq_id, table.blocks)

    def swap_out(self, seq_id: str) -> None:
        table = self.tables[seq_id]
        s = self.store
        rows = upload(table.row_map[: table.num_tokens], s.k.device)
        # queued behind the work that wrote these rows; read back only when swapped in
        table.swapped = Readback({"k": s.k[:, rows], "v": s.v[:, rows], "depth": s.depth[rows]})
        self.allocator.free(seq_id, table.blocks)
        table.blocks, table.row_map = [], torch.zeros(0, dtype=torch.long)

    def is_swapped(self, seq_id: str) -> bool:
        table = self.tables.get(seq_id)
        return table is not None and table.swapped is not None

    def swap_in(self, seq_id: str) -> bool:
        table = self.tables[seq_id]
        assert table.swapped is not None
        n = table.num_tokens
        if self.allocator.blocks_for(n) > self.num_free:
            return False
        host = table.swapped.host()
        table.swapped, table.num_tokens = None, 0
        self.ensure(seq_id, n)
        s = self.store
        dev = s.k.device
        rows = upload(table.row_map[:n], dev)
        s.k[:, rows], s.v[:, rows] = upload(host["k"], dev), upload(host["v"], dev)
        s.depth[rows] = upload(host["depth"], dev)
        return True

    def check_invariants(self, live: set[str]) -> None:
        """Every block is free, reserved, or owned by exactly one live sequence's table."""
        owners = self.allocator.owners()
        seen: dict[int, str] = {}
        for sid, table in self.tables.items():
            assert sid in live, f"KV table of finished sequence {sid} still held"
            for b in table.blocks:
                assert b not in seen, f"block {b} in two tables ({seen[b]}, {sid})"
                assert owners.get(b) == sid, f"block {b} owned by {owners.get(b)!r}, listed by {sid}"
                seen[b] = sid
        reserved = set(self.reserved)
        assert len(seen) + len(reserved) == len(owners), "allocator owns blocks no table lists"
        assert self.allocator.num_free + len(owners) == self.allocator.num_blocks
