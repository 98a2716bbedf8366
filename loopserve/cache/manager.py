"""Per-sequence block tables over the shared KV pool: grow, free, swap out to host memory, swap in,
and take or publish full prompt blocks through the prefix cache (docs/design.md §4.3).

Each sequence with a table holds a slot (a row) of the shared `BlockTables`, which maps its
positions to physical KV rows on the host and on the device. A table may start with cached blocks
other tables hold too (read-only: only full prompt blocks are shared, and nothing writes a prompt
row after its prefill); every block after them is the sequence's own. Swapping copies a sequence's rows
(every slot, and each token's KV depth) to host memory and back, so a preempted sequence resumes
with bit-identical KV whatever the layout.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from loopserve.cache.block_table import BlockTables
from loopserve.cache.pool import BlockAllocator, KVStore
from loopserve.device import Readback, upload
from loopserve.jit import compiled


@dataclass
class BlockTable:
    slot: int  # the sequence's row of `KVCacheManager.block_tables`, which lists its blocks (`room` says how many)
    swapped: Readback | None = None  # host copies of k, v and the KV depths while swapped out


class KVCacheManager:
    TABLE_WIDTH = 16  # blocks a block table starts with per sequence (it grows on demand)

    def __init__(self, store: KVStore, block_size: int, reserved_blocks: int = 0, num_slots: int = 64,
                 table_width: int = TABLE_WIDTH) -> None:
        self.store = store
        self.block_size = block_size
        num_blocks = store.capacity // block_size
        self.allocator = BlockAllocator(num_blocks, block_size)
        # Reserved blocks (e.g. the scratch row passive CB rows write to) are owned by the manager.
        self.reserved = self.allocator.allocate(reserved_blocks) if reserved_blocks else []
        self.tables: dict[str, BlockTable] = {}
        self.block_tables = BlockTables(num_slots, table_width, block_size, store.k.device)  # grows on demand
        self._free_slots: list[int] = []
        self._next_slot = 0
        # by slot: the tokens its blocks have room for, the tokens whose KV rows are in use, its sequence
        # (arrays, so that a prelude batch's room is checked and taken in one compiled pass, `_make_room`)
        self.room = np.zeros(max(num_slots, 1), np.int64)
        self.used = np.zeros(max(num_slots, 1), np.int64)
        self.owner: list[str | None] = [None] * max(num_slots, 1)

    @property
    def num_blocks(self) -> int:
        return self.allocator.num_blocks - len(self.reserved)

    @property
    def num_free(self) -> int:
        return self.allocator.num_free

    def usage(self) -> float:
        return 1.0 - self.num_free / max(self.num_blocks, 1)

    def blocks(self, seq_id: str) -> list[int]:
        """The sequence's KV blocks in position order."""
        return self._held(self.tables[seq_id].slot).tolist()

    def _held(self, slot: int) -> np.ndarray:
        """The blocks slot `slot` holds: the first room / block_size entries of its block-table row (the one
        list of them: growing a sequence writes its new blocks there and nowhere else; a slot that holds none
        may lie past the table, which grows on a slot's first write)."""
        n = self.room[slot] // self.block_size
        return self.block_tables.host[slot, :n] if n else np.zeros(0, np.int64)

    def blocks_needed(self, seq_id: str, num_tokens: int) -> int:
        have = int(self.room[self.tables[seq_id].slot]) // self.block_size if seq_id in self.tables else 0
        return max(0, self.allocator.blocks_for(num_tokens) - have)

    def ensure(self, seq_id: str, num_tokens: int) -> bool:
        """Make room for `num_tokens` tokens; False (and no change) if the pool is short."""
        table = self.tables.get(seq_id)
        if table is None or num_tokens > self.room[table.slot]:
            table = self._grow(seq_id, num_tokens)
            if table is None:
                return False
        if num_tokens > self.used[table.slot]:
            self.used[table.slot] = num_tokens
        return True

    def ensure_slots(self, slots: np.ndarray, num_tokens: np.ndarray) -> int:
        """`ensure` for the sequences holding `slots` in turn, stopping at the first the pool is short for:
        how many got room (a prefix). A prelude batch's tokens mostly fit the blocks their sequences hold or
        need one new block each (every block_size tokens a sequence crosses into a new one; in CDB a few of a
        batch's sequences do, most ticks): one compiled pass checks and takes that room, and their new blocks
        come from one allocation. Only a token that needs more (and those after it) goes through `ensure`."""
        grown, columns = np.empty(len(slots), np.int64), np.empty(len(slots), np.int64)
        k, g = _make_room(slots, num_tokens, self.room, self.used, self.block_size, self.num_free, grown, columns)
        if g:
            self.block_tables.set_entries(grown[:g], columns[:g], self.allocator.allocate_array(g))
        for j in range(k, len(slots)):
            owner = self.owner[int(slots[j])]
            assert owner is not None, f"slot {slots[j]} holds no sequence"
            if not self.ensure(owner, int(num_tokens[j])):
                return j
        return len(slots)

    def compile_passes(self) -> None:
        """Compile the passes of `ensure_slots`, of a batch's KV rows and of freeing blocks (or load them from
        numba's cache) before any request waits for them."""
        none = np.zeros(0, np.int64)
        _make_room(none, none, self.room, self.used, self.block_size, 0, none, none)
        self.block_tables.rows(none, none)
        self.allocator.free_tables([])

    def num_tokens(self, seq_id: str) -> int:
        """Tokens of the sequence whose KV rows are in use (room was ensured for them)."""
        return int(self.used[self.tables[seq_id].slot])

    def _grow(self, seq_id: str, num_tokens: int) -> BlockTable | None:
        """The sequence's table (made if it has none) with blocks for `num_tokens` tokens; None, and no
        change, if the pool is short."""
        need = self.blocks_needed(seq_id, num_tokens)
        if need > self.num_free:
            return None
        table = self.tables.get(seq_id)
        if table is None:
            table = self.tables[seq_id] = BlockTable(self._take_slot(seq_id))
        if need:
            have = int(self.room[table.slot]) // self.block_size
            self.block_tables.set_blocks(table.slot, have, self.allocator.allocate(need))
            self.room[table.slot] = (have + need) * self.block_size
        return table

    # -- the prefix cache --------------------------------------------------------------------------------
    def cached_blocks(self, keys: list[bytes]) -> list[int]:
        """Cached blocks holding the longest run of these prompt-block keys from the first."""
        return self.allocator.lookup(keys)

    def share_cost(self, blocks: list[int]) -> int:
        """Free blocks `adopt(blocks)` would take (cached blocks no table holds leave the free count)."""
        return self.allocator.cost_to_share(blocks)

    def adopt(self, seq_id: str, blocks: list[int]) -> None:
        """Start a new sequence's table with shared prompt blocks (cached ones, or the full prompt blocks
        of the request it is a sample of; refcount + 1 each)."""
        assert seq_id not in self.tables, f"{seq_id} already has KV"
        table = self.tables[seq_id] = BlockTable(self._take_slot(seq_id))
        self._share_into(table, blocks)

    def _share_into(self, table: BlockTable, blocks: list[int]) -> None:
        """An empty table starts with `blocks`, shared (refcount + 1 each)."""
        assert not self.room[table.slot]
        if blocks:
            self.allocator.share(blocks)
            self.block_tables.set_blocks(table.slot, 0, blocks)
            self.room[table.slot] = self.used[table.slot] = len(blocks) * self.block_size

    def publish(self, seq_id: str, first: int, keys: list[bytes]) -> None:
        """Index the sequence's blocks first, first+1, ... (complete prompt blocks) under `keys`."""
        blocks = self._held(self.tables[seq_id].slot)
        for i, key in enumerate(keys, start=first):
            self.allocator.register(int(blocks[i]), key)

    def _take_slot(self, seq_id: str) -> int:
        if self._free_slots:
            slot = self._free_slots.pop()
        else:
            slot, self._next_slot = self._next_slot, self._next_slot + 1
            if slot >= len(self.owner):  # more sequences hold tables than slots were made for: double
                grown = 2 * len(self.owner)
                self.room, self.used = (np.concatenate([a, np.zeros(grown - len(a), np.int64)])
                                        for a in (self.room, self.used))
                self.owner += [None] * (grown - len(self.owner))
        self.room[slot] = self.used[slot] = 0
        self.owner[slot] = seq_id
        return slot

    def slot(self, seq_id: str) -> int:
        return self.tables[seq_id].slot

    def row(self, seq_id: str, position: int) -> int:
        """Physical KV row of a position of a resident sequence."""
        return self.block_tables.row(self.tables[seq_id].slot, position)

    def rows(self, seq_id: str, n: int) -> torch.Tensor:
        """Physical KV rows of positions 0..n-1 (host)."""
        table = self.tables[seq_id]
        return torch.from_numpy(self.block_tables.rows(np.full(n, table.slot), np.arange(n)))

    def free(self, seq_id: str) -> None:
        self.free_all([seq_id])

    def free_all(self, seq_ids: list[str]) -> None:
        """Free the sequences' blocks and slots (those that hold any), in order: one allocator call."""
        tables = [self.tables.pop(s) for s in seq_ids if s in self.tables]
        if tables:
            self.allocator.free_tables([self._held(t.slot) for t in tables])
        slots = [t.slot for t in tables]
        for slot in slots:
            self.owner[slot] = None
        self._free_slots += slots

    def swap_out(self, seq_id: str, num_tokens: int) -> None:
        """Copy the KV of the sequence's first `num_tokens` tokens to the host and free its blocks (rows
        it holds past them, a speculative round's draft rows, are dropped, not copied)."""
        table = self.tables[seq_id]
        kept = self.used[table.slot] = min(int(self.used[table.slot]), num_tokens)
        s = self.store
        rows = upload(self.rows(seq_id, kept), s.k.device)
        # queued behind the work that wrote these rows; read back only when swapped in
        table.swapped = Readback(s.read_rows(rows))
        self.allocator.free(self._held(table.slot))
        self.room[table.slot] = 0

    def is_swapped(self, seq_id: str) -> bool:
        table = self.tables.get(seq_id)
        return table is not None and table.swapped is not None

    def swap_in(self, seq_id: str, shared: list[int]) -> bool:
        """Bring a swapped-out sequence back; False (and no change) if the pool is short. `shared`:
        cached blocks holding its first prompt blocks' KV (found by their prefix-cache keys); they are
        shared again instead of copied back."""
        table = self.tables[seq_id]
        assert table.swapped is not None
        n = int(self.used[table.slot])
        if self.allocator.blocks_for(n) - len(shared) + self.share_cost(shared) > self.num_free:
            return False
        host = table.swapped.host()
        table.swapped, self.used[table.slot] = None, 0
        self._share_into(table, shared)
        self.ensure(seq_id, n)
        s = self.store
        dev = s.k.device
        skip = len(shared) * self.block_size
        rows = upload(self.rows(seq_id, n)[skip:], dev)
        s.write_rows(rows, {name: upload(t, dev) for name, t in KVStore.rows_from(host, skip).items()})
        return True

    def check_invariants(self, live: set[str]) -> None:
        """Every block is free (empty or cached), reserved, or held by live sequences' tables, exactly as
        many as its reference count says (a table lists a block once); no held block is free."""
        self.allocator.check()
        refs = self.allocator.refcounts()
        slots = [t.slot for t in self.tables.values()]
        assert len(slots) == len(set(slots)) and not set(slots) & set(self._free_slots), "block-table slot shared"
        assert all(self.owner[slot] is None for slot in self._free_slots), "a free slot has an owner"
        listed: dict[int, int] = dict.fromkeys(self.reserved, 1)
        for sid, table in self.tables.items():
            assert sid in live, f"KV table of finished sequence {sid} still held"
            slot = table.slot
            blocks = self._held(slot).tolist()
            assert len(set(blocks)) == len(blocks), f"block listed twice by {sid}"
            assert self.owner[slot] == sid and self.room[slot] % self.block_size == 0, \
                f"slot arrays of {sid} out of date"
            assert self.used[slot] <= self.room[slot] or table.swapped is not None, f"{sid} uses rows without room"
            for b in blocks:
                assert b in refs, f"block {b} of {sid} is free while listed (its KV may be overwritten)"
                listed[b] = listed.get(b, 0) + 1
        assert set(refs) <= set(listed), "allocator owns blocks no table lists"
        for b, n in listed.items():
            assert refs.get(b) == n, f"block {b}: refcount {refs.get(b)}, listed {n} times"
        assert self.allocator.num_free + len(refs) == self.allocator.num_blocks


@compiled
def _make_room(slots, num_tokens, room, used, block_size, num_free, grown, columns):
    """`ensure_slots`' pass: entry k's sequence (block-table slot slots[k]) uses num_tokens[k] tokens' rows,
    taking a new block if its blocks are one short (its room grows here; the slot and the table column the
    block goes in are listed in grown[:g] and columns[:g] for the caller to allocate and write). Stops at
    the first entry that needs more than one block, or a block beyond `num_free`. Returns (entries done, g)."""
    g = 0
    for k in range(slots.shape[0]):
        s = slots[k]
        t = num_tokens[k]
        if t > room[s]:
            if t > room[s] + block_size or g == num_free:
                return k, g
            grown[g] = s
            columns[g] = room[s] // block_size
            g += 1
            room[s] += block_size
        if t > used[s]:
            used[s] = t
    return slots.shape[0], g
