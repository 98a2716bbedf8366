"""KV storage and block allocation.

`KVStore` holds K and V for `capacity` physical token rows, each with the layout's slots, plus the
KV depth of every physical token (what the layout's read rule needs), plus one zero row that is never
written: attention gathers every key it masks (padding, keys a layout hides) from it, so whatever a
masked row holds (stale KV of a finished request, even NaN) cannot reach a query through 0 * NaN.
Reads: gathers of K or V rows by flat index, a decode query's scores (on the CPU read in place,
`cache/scores.py`) and its weighted sum of V (read in place).
`BlockAllocator` hands out fixed-size blocks of physical rows to sequences, counts who holds each
one (a full prompt block may be shared read-only through the prefix cache), and keeps cached blocks
until the pool needs them; a sequence's block table maps its positions to rows. The reference
decoder uses a store with one contiguous "block" per request.
"""

from __future__ import annotations

import numpy as np
import torch

from loopserve.cache import scores
from loopserve.cache.layout import IN_FLIGHT
from loopserve.device import upload
from loopserve.jit import compiled

GATHER_ELEMENTS = 1 << 26  # key elements a decode score call gathers at once (128 MiB of bfloat16)


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
        # on the CPU, depths are written through numpy: a tick's exits are a few rows, and numpy's fancy
        # write costs a tenth of torch's index_put at that size (about 0.6 against 5 us)
        self._depth_host = self.depth.numpy() if self.depth.device.type == "cpu" else None
        # flat index of (head h, slot 0, row 0): gathers index the [-1, head_dim] view
        self._head_base = (torch.arange(num_kv_heads, device=device) * (n_slots * (capacity + 1)))
        # On the CPU a gather writes into a buffer kept from the last one (`_take_rows`): a fresh output of
        # some MB is a fresh mapping from the C allocator, whose first touch faults page by page, which took
        # longer than the copy itself (docs/benchmarks.md §8.20). CUDA's caching allocator already reuses.
        on_cpu = torch.device(device).type == "cpu"
        self._gather_buffers: dict[str, torch.Tensor] | None = {} if on_cpu else None
        self._gather_rows = {"k": _as_words(self.k), "v": _as_words(self.v)}  # what `_take_rows` reads
        # decode scores read K in place on the CPU (`scores`). The flag is what `scores` tests: a torch.compile'd
        # stage may read a bool, not the numpy view (Dynamo guards fail)
        self._k_rows = scores.key_rows(self.k) if on_cpu and dtype in scores.SCORE_DTYPES else None
        self._reads_keys_in_place = self._k_rows is not None

    def write(self, slot: torch.Tensor | int, rows: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Write K/V of `rows` ([N] physical rows; k, v: [N, kv_heads, head_dim]) into `slot` (per row or one)."""
        self.k[:, slot, rows] = k.transpose(0, 1)
        self.v[:, slot, rows] = v.transpose(0, 1)

    @property
    def slot_stride(self) -> int:
        """Flat-index distance from a (head, slot, row) to the same head and row one slot further."""
        return self.k.shape[2]

    def index(self, slot: torch.Tensor | int, rows: torch.Tensor) -> torch.Tensor:
        """Flat indices of (head, slot, row) for every head and (slot, row) pair (any matching shapes)
        -> [kv_heads, *shape], for `keys`, `values` and `weighted_values`."""
        return (slot * self.slot_stride + rows)[None] + self._head_base.view(-1, *[1] * rows.dim())

    def keys(self, index: torch.Tensor) -> torch.Tensor:
        """K at `index` -> [*index.shape, head_dim], contiguous. On the CPU the result lives in a reused
        buffer: it holds until the next `keys` call on this store (attention consumes it at once)."""
        return self._take_rows("k", index)

    def values(self, index: torch.Tensor) -> torch.Tensor:
        """V at `index`, as `keys` (its own buffer: a prefill group reads both at once)."""
        return self._take_rows("v", index)

    def scores(self, q: torch.Tensor, index: torch.Tensor, visible: torch.Tensor, scale: float,
               shift: int = 0) -> torch.Tensor:
        """scale * q . K for one query per sequence: q [N, heads, d], index [kv_heads, N, L] (`index`) plus
        `shift` (a later layer's reads: the first layer's index, `shift` rows on; read as an offset view of
        the store, not added to the index), visible [N, L] -> [kv_heads, N, heads // kv_heads, L], -inf where
        not visible. On the CPU in float32/64 and bfloat16 the keys are read in place (`cache/scores.py`);
        elsewhere gathered, then multiplied (also for a query that needs gradients or is not in the store's
        dtype: the pass does neither)."""
        if self._reads_keys_in_place and q.dtype == self.k.dtype and not q.requires_grad:
            in_place = self._scores_traced if torch.compiler.is_compiling() else self._scores_in_place
            return in_place(q, index, visible, scale, shift)
        index = index + shift if shift else index
        n, nh, d = q.shape
        nkv, length = index.shape[0], index.shape[-1]
        qg = q.reshape(n, nkv, nh // nkv, d).transpose(0, 1)  # [nkv, N, g, d]: the query heads of a kv head
        # gathered a slice of keys at a time, at most GATHER_ELEMENTS numbers: whole, Ouro-1.4B's K at width 256
        # and 4k keys would be 4.3 GB per layer call, more than a device keeps beside its KV pool (each score is
        # its own dot product; a product of other shapes may sum it in another order: rounding, as any batch mix)
        step = max(1, GATHER_ELEMENTS // max(nkv * n * d, 1))
        if step >= length:
            out = torch.matmul(qg, self.keys(index).transpose(-1, -2))
        else:
            out = torch.cat([torch.matmul(qg, self.keys(index[..., a:a + step]).transpose(-1, -2))
                             for a in range(0, length, step)], dim=-1)
        return (out * scale).masked_fill(~visible[None, :, None], float("-inf"))

    def compile_scores(self) -> None:
        """Compile the in-place scores pass for this store's dtype (or load it from numba's cache), so that no
        request waits for it: about 2 s the first time on a machine, under 1 s after."""
        if self._reads_keys_in_place:
            nkv, d = self.k.shape[0], self.k.shape[-1]
            self._scores_in_place(torch.zeros(0, nkv, d, dtype=self.k.dtype), torch.zeros(nkv, 0, 0, dtype=torch.long),
                                  torch.zeros(0, 0, dtype=torch.bool), 1.0)

    def _scores_in_place(self, q: torch.Tensor, index: torch.Tensor, visible: torch.Tensor,
                         scale: float, shift: int = 0) -> torch.Tensor:
        assert self._k_rows is not None
        return scores.decode_scores(q, self._k_rows[shift:], index, visible, scale)

    # numba, not traceable: a torch.compile'd stage runs the pass eagerly (a graph break). Not torch.compiler.disable,
    # which imports Dynamo when it decorates: 1.6 s of every process's start on this CPU (a CLI error took 7 s), for
    # what only a compiled stage, in `bench compile`, calls. torch's private lazy form imports it at the first call
    # (`bench compile`'s test checks the break is here); were it gone, the public one
    _scores_traced = getattr(torch, "_disable_dynamo", torch.compiler.disable)(_scores_in_place)

    def _take_rows(self, name: str, index: torch.Tensor) -> torch.Tensor:
        """Rows of K or V ("k" / "v") at flat row indices `index`, as one index_select."""
        flat = self._gather_rows[name]
        rows = index.reshape(-1)
        if self._gather_buffers is None:
            out = flat.index_select(0, rows)
        else:
            need = rows.numel() * flat.shape[1]
            buf = self._gather_buffers.get(name)
            if buf is None or buf.numel() < need:  # 25 % headroom: a context grows a token a step
                with torch.inference_mode(False):  # a normal tensor: later gathers may run outside inference mode
                    buf = self._gather_buffers[name] = torch.empty(need + need // 4, dtype=flat.dtype)
            out = torch.index_select(flat, 0, rows, out=buf[:need].view(-1, flat.shape[1]))
        return out.view(self.k.dtype).view(*index.shape, self.k.shape[-1])

    def weighted_values(self, index: torch.Tensor, weights: torch.Tensor, shift: int = 0) -> torch.Tensor:
        """sum_l weights[..., l] * V[index[..., l] + shift] -> [*weights.shape[:-1], head_dim], without
        gathering the rows first (one fused embedding_bag: several times cheaper than a gather plus a
        batched matmul when each weight row is a single query's). `index` [..., L] broadcasts against
        `weights` [..., L] (the query heads sharing a KV head share its indices); `shift` as in `scores`
        (an offset view of V's rows)."""
        d = self.v.shape[-1]
        idx = index.expand_as(weights).reshape(-1, weights.shape[-1])
        out = torch.nn.functional.embedding_bag(idx, self.v.view(-1, d)[shift:], mode="sum",
                                                per_sample_weights=weights.reshape(idx.shape))
        return out.view(*weights.shape[:-1], d)

    def set_depth(self, rows: torch.Tensor | np.ndarray, depth: torch.Tensor | np.ndarray | int) -> None:
        """The KV depth of token rows `rows`: tensors or host arrays (any int dtype), `depth` an int or one per row.
        On the CPU both are written in place through numpy; elsewhere host arrays are uploaded."""
        if self._depth_host is not None:
            self._depth_host[_as_host(rows)] = _as_host(depth)
            return
        # elsewhere by index_fill_ (an int: the value goes as a kernel argument, where `depth[rows] = int` copies it
        # up from pageable memory, which waits) or index_copy_; both take int64 indices on the store's device
        if isinstance(rows, np.ndarray):
            rows = upload(torch.from_numpy(rows.astype(np.int64, copy=False)), self.depth.device)
        rows = rows.to(self.depth.device, torch.long)  # (a no-op for the engine's rows)
        if isinstance(depth, int | np.integer):
            self.depth.index_fill_(0, rows, int(depth))
            return
        if isinstance(depth, np.ndarray):
            depth = upload(torch.from_numpy(depth.astype(np.int64, copy=False)), self.depth.device)
        self.depth.index_copy_(0, rows, depth.to(self.depth.device, torch.long).expand(rows.shape))

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


def _as_host(x: torch.Tensor | np.ndarray | int) -> np.ndarray | int:
    """A CPU tensor as the numpy array sharing its memory (arrays and ints as they are)."""
    return x.numpy() if isinstance(x, torch.Tensor) else x


def _as_words(t: torch.Tensor) -> torch.Tensor:
    """`t` ([..., head_dim]) as [rows, words]: each row in the widest integer words that tile it (a bf16 row of
    64 is 16 int64). Gathers move the same bytes, but index_select's copy loop is about twice as fast on them
    as on 2-byte elements."""
    d = t.shape[-1]
    flat = t.view(-1, d)
    nbytes = d * t.element_size()
    for word in (torch.int64, torch.int32):
        if nbytes % word.itemsize == 0 and t.element_size() < word.itemsize:
            return flat.view(word)
    return flat


class BlockAllocator:
    """KV blocks with reference counts, and the prefix cache's index of blocks by content.

    A block is *held* (refcount >= 1: listed by that many block tables, or reserved), *cached* (held
    by no one but still indexed by the key of the prompt block whose KV it holds: it can be taken
    back by a later prompt with that key), or *empty*. Allocation takes empty blocks first, from a
    stack (a new allocator hands out the lowest ids first; later, the blocks freed last, whose memory
    is the likeliest to be warm), then evicts cached blocks, least recently freed first; so cached KV
    survives until the pool needs its blocks (docs/design.md §4.3). A held block is never handed out
    again, so KV is never overwritten while some sequence reads it.

    Every per-block fact is an array (holders, indexed or not, place in the eviction queue) and both
    free lists are arrays, so freeing a sequence's blocks (a 4k-token context holds 257 of 16 tokens)
    is a compiled pass over them and a few array operations, not a Python step per block; only the
    prefix-cache index (keys) is a dict.
    """

    def __init__(self, num_blocks: int, block_size: int) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError("num_blocks and block_size must be >= 1")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._refs = np.zeros(num_blocks, np.int64)  # holders of each block (int64: `np.add.at` is fast on it)
        self._empty = np.arange(num_blocks - 1, -1, -1)  # a stack: _empty[:_num_empty], its end taken first
        self._num_empty = num_blocks
        self._by_key: dict[bytes, int] = {}  # prefix cache: a prompt block's key -> the block holding its KV
        self._key_of: dict[int, bytes] = {}
        self._indexed = np.zeros(num_blocks, bool)  # the blocks `_key_of` lists, for whole-table partitions
        self._listed = np.zeros(num_blocks, bool)  # `_release_blocks`' scratch (all False between calls)
        # Cached blocks held by no one, in the order they were freed: _queue[_head:_tail]. A block's entry is
        # live while `_queued_at[block]` is its position; sharing a queued block sets that to -1 and leaves
        # the entry to be skipped. The queue is compacted when full; with 2 x num_blocks entries at least
        # num_blocks are free after a compaction, so compacting costs O(1) a block freed.
        self._queue = np.zeros(2 * num_blocks, np.int64)
        self._head = self._tail = 0
        self._queued_at = np.full(num_blocks, -1, np.int64)
        self._num_queued = 0

    @property
    def num_free(self) -> int:
        """Blocks an allocation may take: empty ones and cached ones no one holds."""
        return self._num_empty + self._num_queued

    @property
    def num_cached(self) -> int:
        return len(self._key_of)

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def allocate(self, n: int) -> list[int]:
        """`n` fresh blocks (refcount 1); evicts cached blocks once no empty block is left."""
        return self.allocate_array(n).tolist()

    def allocate_array(self, n: int) -> np.ndarray:
        """`allocate` as an array."""
        n = int(n)
        if n < 0:
            raise ValueError(f"n: cannot allocate {n} blocks")
        if n > self.num_free:
            raise MemoryError(f"need {n} KV blocks, {self.num_free} free")
        k = min(n, self._num_empty)
        fresh = self._empty[self._num_empty - k: self._num_empty][::-1]
        self._num_empty -= k
        self._refs[fresh] = 1
        if k == n:
            return fresh.copy()  # (a view of the empty stack, which later frees overwrite)
        evicted = self._evict(n - k)
        for b in evicted.tolist():
            del self._by_key[self._key_of.pop(b)]
        self._indexed[evicted] = False
        self._refs[evicted] = 1
        return np.concatenate([fresh, evicted])

    def free(self, blocks: list[int] | np.ndarray) -> None:
        """Drop one hold on each block (in position order, as a block table lists them). A block no one holds
        becomes empty, or stays cached if indexed; the last ones are evicted first (a prompt's tail is the
        part least likely to be shared). A block not held, or listed twice, raises and changes nothing."""
        self.free_tables([blocks])

    def free_tables(self, tables: list[list[int] | np.ndarray]) -> None:
        """`free` of each table in turn, in one pass (the requests a coda batch finished). A block in several
        of them (a shared prompt block) loses a hold for each and becomes free at its last listing. A block
        freed more often than it is held, an id outside the pool, or (one table given) a block listed twice raises
        and changes nothing; with several tables, a block listed twice in one is not told apart from a
        block two of them share."""
        entries = np.concatenate([np.asarray(t, np.int64)[::-1] for t in tables]) if tables else np.zeros(0, np.int64)
        gone = np.empty(len(entries), np.int64)
        m, bad = _release_blocks(entries, self._refs, len(tables) == 1, self._listed, gone)
        if bad >= 0:
            raise RuntimeError(f"block {int(entries[bad])} freed more often than it was held, or listed twice")
        self._drop_unheld(gone[:m][::-1])

    def _drop_unheld(self, blocks: np.ndarray) -> None:
        """Blocks no one holds now, in the order they were freed: cached if indexed, else empty."""
        indexed = self._indexed[blocks]
        self._push_empty(blocks[~indexed])
        self._enqueue(blocks[indexed])

    def _push_empty(self, blocks: np.ndarray) -> None:
        """Put blocks no one holds or indexes on the empty stack."""
        self._empty[self._num_empty: self._num_empty + len(blocks)] = blocks
        self._num_empty += len(blocks)

    def _enqueue(self, blocks: np.ndarray) -> None:
        """Append cached blocks no one holds now to the eviction queue."""
        n = len(blocks)
        if self._tail + n > len(self._queue):
            live = self._live(self._head, self._tail)
            self._queue[: len(live)] = live
            self._queued_at[live] = np.arange(len(live))
            self._head, self._tail = 0, len(live)
        self._queue[self._tail: self._tail + n] = blocks
        self._queued_at[blocks] = np.arange(self._tail, self._tail + n)
        self._tail += n
        self._num_queued += n

    def _live(self, start: int, end: int) -> np.ndarray:
        """The live entries of _queue[start:end], in order."""
        entries = self._queue[start:end]
        return entries[self._queued_at[entries] == np.arange(start, end)]

    def _evict(self, n: int) -> np.ndarray:
        """Take the `n` least recently freed cached blocks out of the queue."""
        taken: list[np.ndarray] = []
        window = 2 * n + 8  # entries scanned at once, 4x more each pass: a run of stale ones costs O(its length)
        while n:
            assert self._head < self._tail, "eviction queue holds fewer blocks than it counts"
            end = min(self._tail, self._head + window)
            window *= 4
            live = self._live(self._head, end)[:n]
            self._head = int(self._queued_at[live[-1]]) + 1 if len(live) == n else end
            self._queued_at[live] = -1
            taken.append(live)
            n -= len(live)
        evicted = np.concatenate(taken)
        self._num_queued -= len(evicted)
        return evicted

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
        return int((self._queued_at[blocks] >= 0).sum())

    def share(self, blocks: list[int]) -> None:
        """Hold blocks once more: cached ones (taken out of the eviction queue if no one held them), or held
        ones (the full prompt blocks of a request's samples, n > 1). A block neither cached nor held, or
        listed twice, raises and changes nothing."""
        index = np.asarray(blocks, np.int64)
        held = self._refs[index]
        np.add.at(self._refs, index, 1)
        bad = (self._refs[index] != held + 1) | ((held < 1) & ~self._indexed[index]) | (index < 0)
        if bad.any():
            np.subtract.at(self._refs, index, 1)
            raise RuntimeError(f"block {int(index[bad][0])} is neither cached nor held, or listed twice")
        queued = self._queued_at[index] >= 0
        self._num_queued -= int(queued.sum())
        self._queued_at[index] = -1

    def register(self, block: int, key: bytes) -> None:
        """Index a held block whose KV is now complete under `key`. A key already indexed keeps its
        block (two requests prefilled the same prefix at once: the second copy stays private)."""
        assert self._refs[block] >= 1, f"registering block {block}, which no one holds"
        if key in self._by_key or block in self._key_of:
            return
        self._by_key[key] = block
        self._key_of[block] = key
        self._indexed[block] = True

    def reset_cache(self) -> None:
        """Forget every cached block (held ones stay held, unindexed)."""
        cached = self._live(self._head, self._tail)
        self._queued_at[cached] = -1
        self._head = self._tail = self._num_queued = 0
        self._push_empty(cached)
        self._by_key.clear()
        self._key_of.clear()
        self._indexed[:] = False

    def refcounts(self) -> dict[int, int]:
        held = np.flatnonzero(self._refs)
        return dict(zip(held.tolist(), self._refs[held].tolist(), strict=True))

    def check(self) -> None:
        """The allocator's own bookkeeping: every block is exactly one of held, cached-unheld, empty."""
        empty_stack = self._empty[: self._num_empty].tolist()
        empty, held = set(empty_stack), set(np.flatnonzero(self._refs).tolist())
        queued = self._live(self._head, self._tail).tolist()
        lru = set(queued)
        assert len(empty) == len(empty_stack), "block twice in the empty stack"
        assert len(lru) == len(queued) == self._num_queued == int((self._queued_at >= 0).sum()), \
            "eviction queue out of step"
        assert not (empty & lru or empty & held or lru & held), "block both free and held"
        assert len(empty) + len(lru) + len(held) == self.num_blocks, "block lost by the allocator"
        assert (self._refs >= 0).all(), "block with a negative refcount"
        assert lru <= set(self._key_of) and not empty & set(self._key_of), "free block cached without a key"
        assert set(np.flatnonzero(self._indexed).tolist()) == set(self._key_of), "index bitmap out of step"
        assert all(self._by_key[k] == b for b, k in self._key_of.items()) and len(self._by_key) == len(self._key_of), \
            "prefix-cache index out of step"


@compiled
def _release_blocks(entries, refs, one_table, listed, gone):
    """`BlockAllocator.free_tables`' pass: each listed block (entries: the tables', tail first, in turn) loses a
    hold. At the first entry that is no block, is held by no one (any more), or (`one_table`) was listed
    before, the holds taken so far are put back and (0, its index) returned. Otherwise the blocks now held by
    no one, each once, go to gone[:m] last listed first (the reverse of the order they are freed in); returns
    (m, -1). `listed`: all False, left so. One pass each way over the entries, where numpy took two gathers and
    a scatter-add over them and a deduplication whenever a block was shared."""
    n = refs.shape[0]
    for k in range(entries.shape[0]):
        e = entries[k]
        if e < 0 or e >= n or refs[e] <= 0 or (one_table and listed[e]):
            for j in range(k):
                refs[entries[j]] += 1
                listed[entries[j]] = False
            return 0, k
        refs[e] -= 1
        listed[e] = True
    m = 0
    for k in range(entries.shape[0] - 1, -1, -1):  # backwards: a block is met first at its last listing
        e = entries[k]
        if listed[e]:
            listed[e] = False
            if refs[e] == 0:
                gone[m] = e
                m += 1
    return m, -1
