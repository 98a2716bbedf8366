"""KV storage and block allocation.

`KVStore` holds K and V for `capacity` physical token rows, each with the layout's slots, plus the
KV depth of every physical token (what the layout's read rule needs), plus one zero row that is never
written: attention gathers every key it masks (padding, keys a layout hides) from it, so whatever a
masked row holds (stale KV of a finished request, even NaN) cannot reach a query through 0 * NaN.
`BlockAllocator` hands out fixed-size blocks of physical rows to sequences, counts who holds each
one (a full prompt block may be shared read-only through the prefix cache), and keeps cached blocks
until the pool needs them; a sequence's block table maps its positions to rows. The reference
decoder uses a store with one contiguous "block" per request.
"""

from __future__ import annotations

import heapq
from collections import OrderedDict

import torch

from loopserve.cache.layout import IN_FLIGHT


class KVStore:
    """K and V as [kv_heads, slots, rows, head_dim] (head-major): a gather of key rows comes out as
    [kv_heads, *rows, head_dim], the layout batched attention multiplies without another copy.
    Reads are by flat (head, slot, row) index (`index`)."""

    def __init__(self, capacity: int, n_slots: int, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device | str = "cpu") -> None:
        self.capacity = capacity
        self.zero_row = capacity
        shape = (num_kv_heads, n_slots, capacity + 1, head_dim)
        # not zeroed (a fill of the whole pool): a row is written before any query may see it, and
        # every key a query must not see is read from the zero row
        self.k = torch.empty(shape, dtype=dtype, device=device)
        self.v = torch.empty(shape, dtype=dtype, device=device)
        self.k[:, :, capacity] = 0
        self.v[:, :, capacity] = 0
        self.depth = torch.full((capacity + 1,), IN_FLIGHT, dtype=torch.long, device=device)
        # flat index of (head h, slot 0, row 0): gathers index the [-1, head_dim] view
        self._head_base = (torch.arange(num_kv_heads, device=device) * (n_slots * (capacity + 1)))

    def write(self, slot: torch.Tensor | int, rows: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Write K/V of `rows` ([N] physical rows; k, v: [N, kv_heads, head_dim]) into `slot` (per row or one)."""
        self.k[:, slot, rows] = k.transpose(0, 1)
        self.v[:, slot, rows] = v.transpose(0, 1)

    def index(self, slot: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        """Flat indices of (head, slot, row) for every head and (slot, row) pair (any matching shapes)
        -> [kv_heads, *shape], for `keys`, `values` and `weighted_values`."""
        return (slot * self.k.shape[2] + rows)[None] + self._head_base.view(-1, *[1] * rows.dim())

    def keys(self, index: torch.Tensor) -> torch.Tensor:
        """K at `index` -> [*index.shape, head_dim], contiguous."""
        return _take_rows(self.k, index)

    def values(self, index: torch.Tensor) -> torch.Tensor:
        return _take_rows(self.v, index)

    def weighted_values(self, index: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """sum_l weights[..., l] * V[index[..., l]] -> [*weights.shape[:-1], head_dim], without
        gathering the rows first (one fused embedding_bag: several times cheaper than a gather plus a
        batched matmul when each weight row is a single query's). `index` [..., L] broadcasts against
        `weights` [..., L] (the query heads sharing a KV head share its indices)."""
        d = self.v.shape[-1]
        idx = index.expand_as(weights).reshape(-1, weights.shape[-1])
        out = torch.nn.functional.embedding_bag(idx, self.v.view(-1, d), mode="sum",
                                                per_sample_weights=weights.reshape(idx.shape))
        return out.view(*weights.shape[:-1], d)

    def set_depth(self, rows: torch.Tensor, depth: torch.Tensor | int) -> None:
        self.depth[rows] = depth

    def copy_rows(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        """Copy whole token rows (all slots, and their KV depth)."""
        self.k[:, :, dst] = self.k[:, :, src]
        self.v[:, :, dst] = self.v[:, :, src]
        self.depth[dst] = self.depth[src]

    def read_rows(self, rows: torch.Tensor) -> dict[str, torch.Tensor]:
        """Everything the store holds for token rows `rows`: K, V (all slots) and KV depth."""
        return {"k": self.k[:, :, rows], "v": self.v[:, :, rows], "depth": self.depth[rows]}

    @staticmethod
    def rows_from(data: dict[str, torch.Tensor], start: int) -> dict[str, torch.Tensor]:
        """What `read_rows` returned, from its `start`-th row on."""
        return {"k": data["k"][:, :, start:], "v": data["v"][:, :, start:], "depth": data["depth"][start:]}

    def write_rows(self, rows: torch.Tensor, data: dict[str, torch.Tensor]) -> None:
        """Put back what `read_rows` returned, at rows `rows` (same count)."""
        self.k[:, :, rows], self.v[:, :, rows], self.depth[rows] = data["k"], data["v"], data["depth"]


def _take_rows(t: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """Rows of `t` ([..., head_dim]) at flat row indices `index`, as one index_select. The rows are
    moved as the widest integer words that tile them (a bf16 row of 64 is 16 int64): the same bytes,
    but index_select's copy loop is about twice as fast on them as on 2-byte elements."""
    d = t.shape[-1]
    flat = t.view(-1, d)
    nbytes = d * t.element_size()
    for word in (torch.int64, torch.int32):
        if nbytes % word.itemsize == 0 and t.element_size() < word.itemsize:
            return flat.view(word).index_select(0, index.reshape(-1)).view(t.dtype).view(*index.shape, d)
    return flat.index_select(0, index.reshape(-1)).view(*index.shape, d)


class BlockAllocator:
    """KV blocks with reference counts, and the prefix cache's index of blocks by content.

    A block is *held* (refcount >= 1: listed by that many block tables, or reserved), *cached* (held
    by no one but still indexed by the key of the prompt block whose KV it holds: it can be taken
    back by a later prompt with that key), or *empty*. Allocation takes empty blocks first, lowest
    id first (a heap: deterministic, O(log n) per block), then evicts cached blocks, least recently
    freed first; so cached KV survives until the pool needs its blocks (docs/design.md §4.3). A held
    block is never handed out again, so KV is never overwritten while some sequence reads it.
    """

    def __init__(self, num_blocks: int, block_size: int) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError("num_blocks and block_size must be >= 1")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._empty = list(range(num_blocks))  # a heap (sorted is a valid heap)
        self._refs: dict[int, int] = {}  # held blocks -> holders
        self._by_key: dict[bytes, int] = {}  # prefix cache: a prompt block's key -> the block holding its KV
        self._key_of: dict[int, bytes] = {}
        self._lru: OrderedDict[int, None] = OrderedDict()  # cached blocks held by no one, oldest first

    @property
    def num_free(self) -> int:
        """Blocks an allocation may take: empty ones and cached ones no one holds."""
        return len(self._empty) + len(self._lru)

    @property
    def num_cached(self) -> int:
        return len(self._key_of)

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def allocate(self, n: int) -> list[int]:
        """`n` fresh blocks (refcount 1); evicts cached blocks once no empty block is left."""
        if n > self.num_free:
            raise MemoryError(f"need {n} KV blocks, {self.num_free} free")
        blocks = []
        for _ in range(n):
            if self._empty:
                b = heapq.heappop(self._empty)
            else:
                b, _ = self._lru.popitem(last=False)
                del self._by_key[self._key_of.pop(b)]
            self._refs[b] = 1
            blocks.append(b)
        return blocks

    def free(self, blocks: list[int]) -> None:
        """Drop one hold on each block. A block no one holds becomes empty, or stays cached if indexed:
        blocks are given in position order and the last ones are evicted first (a prompt's tail is the
        part least likely to be shared)."""
        for b in reversed(blocks):
            refs = self._refs.get(b, 0)
            if refs < 1:
                raise RuntimeError(f"block {b} freed more often than it was held")
            if refs > 1:
                self._refs[b] = refs - 1
                continue
            del self._refs[b]
            if b in self._key_of:
                self._lru[b] = None
            else:
                heapq.heappush(self._empty, b)

    # -- the prefix cache ------------------------------------------------------------------------------
    def lookup(self, keys: list[bytes]) -> list[int]:
        """The blocks holding the longest run of `keys` from the first (a chain: key i covers block i
        and everything before it)."""
        found = []
        for key in keys:
            b = self._by_key.get(key)
            if b is None:
                break
            found.append(b)
        return found

    def cost_to_share(self, blocks: list[int]) -> int:
        """Free blocks that sharing `blocks` takes out of the pool (those no one holds now)."""
        return sum(1 for b in blocks if b in self._lru)

    def share(self, blocks: list[int]) -> None:
        """Hold blocks once more: cached ones (taken out of the eviction order if no one held them), or
        held ones (the full prompt blocks of a request's samples, n > 1)."""
        for b in blocks:
            assert b in self._key_of or b in self._refs, f"block {b} is neither cached nor held"
            if b in self._lru:
                del self._lru[b]
            self._refs[b] = self._refs.get(b, 0) + 1

    def register(self, block: int, key: bytes) -> None:
        """Index a held block whose KV is now complete under `key`. A key already indexed keeps its
        block (two requests prefilled the same prefix at once: the second copy stays private)."""
        assert self._refs.get(block, 0) >= 1, f"registering block {block}, which no one holds"
        if key in self._by_key or block in self._key_of:
            return
        self._by_key[key] = block
        self._key_of[block] = key

    def reset_cache(self) -> None:
        """Forget every cached block (held ones stay held, unindexed)."""
        for b in self._lru:
            heapq.heappush(self._empty, b)
        self._lru.clear()
        self._by_key.clear()
        self._key_of.clear()

    def refcounts(self) -> dict[int, int]:
        return dict(self._refs)

    def check(self) -> None:
        """The allocator's own bookkeeping: every block is exactly one of held, cached-unheld, empty."""
        empty, lru, held = set(self._empty), set(self._lru), set(self._refs)
        assert len(empty) == len(self._empty), "block twice in the empty heap"
        assert not (empty & lru or empty & held or lru & held), "block both free and held"
        assert len(empty) + len(lru) + len(held) == self.num_blocks, "block lost by the allocator"
        assert all(r >= 1 for r in self._refs.values()), "held block with refcount < 1"
        assert lru <= set(self._key_of) and not empty & set(self._key_of), "free block cached without a key"
        assert all(self._by_key[k] == b for b, k in self._key_of.items()) and len(self._by_key) == len(self._key_of), \
            "prefix-cache index out of step"
