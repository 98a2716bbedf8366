"""KV storage and block allocation.

`KVStore` holds K and V for `capacity` physical token rows, each with the layout's slots, plus the
KV depth of every physical token (what the layout's read rule needs), plus one zero row that is never
written: attention gathers every key it masks (padding, keys a layout hides) from it, so whatever a
masked row holds (stale KV of a finished request, even NaN) cannot reach a query through 0 * NaN.
`BlockAllocator` hands out fixed-size blocks of physical rows to sequences; a sequence's block table
maps its positions to rows. The reference decoder uses a store with one contiguous "block" per request.
"""

from __future__ import annotations

import heapq

import torch

from loopserve.cache.layout import IN_FLIGHT


class KVStore:
    def __init__(self, capacity: int, n_slots: int, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device | str = "cpu") -> None:
        self.capacity = capacity
        self.zero_row = capacity
        shape = (n_slots, capacity + 1, num_kv_heads, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.depth = torch.full((capacity + 1,), IN_FLIGHT, dtype=torch.long, device=device)

    def write(self, slot: torch.Tensor | int, rows: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        self.k[slot, rows] = k
        self.v[slot, rows] = v

    def gather(self, slot: torch.Tensor, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V at (slot, row) pairs (any matching shapes) -> [*shape, kv_heads, head_dim]."""
        flat = (slot * self.k.shape[1] + rows).reshape(-1)  # one index_select beats 2-D advanced indexing
        shape = (*rows.shape, *self.k.shape[2:])
        k = self.k.view(-1, *self.k.shape[2:]).index_select(0, flat).view(shape)
        v = self.v.view(-1, *self.v.shape[2:]).index_select(0, flat).view(shape)
        return k, v

    def set_depth(self, rows: torch.Tensor, depth: torch.Tensor | int) -> None:
        self.depth[rows] = depth

    def copy_rows(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        """Copy whole token rows (all slots, and their KV depth)."""
        self.k[:, dst] = self.k[:, src]
        self.v[:, dst] = self.v[:, src]
        self.depth[dst] = self.depth[src]


class BlockAllocator:
    """Free KV blocks in a min-heap: allocation order is deterministic (lowest id first), and freeing
    a sequence's blocks costs O(blocks log n), not a sort of the whole free list."""

    def __init__(self, num_blocks: int, block_size: int) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError("num_blocks and block_size must be >= 1")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._free = list(range(num_blocks))  # a heap (sorted is a valid heap)
        self._owner: dict[int, object] = {}

    @property
    def num_free(self) -> int:
        return len(self._free)

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def allocate(self, owner: object, n: int) -> list[int]:
        if n > len(self._free):
            raise MemoryError(f"need {n} KV blocks, {len(self._free)} free")
        blocks = [heapq.heappop(self._free) for _ in range(n)]
        for b in blocks:
            self._owner[b] = owner
        return blocks

    def free(self, owner: object, blocks: list[int]) -> None:
        for b in blocks:
            if self._owner.get(b) is not owner:
                raise RuntimeError(f"block {b} freed by a sequence that does not own it")
            del self._owner[b]
            heapq.heappush(self._free, b)

    def owners(self) -> dict[int, object]:
        return dict(self._owner)
