"""`HeldTokens`: the tokens whole coda batches gave resident quiet sequences, held by block-table slot
until something reads the sequence's lists.

A token that cannot finish its quiet sequence (`StatePool.requeue_quiet`) needs no per-token check, only
recording (its id and exit depth, the loops it ran, the time it arrived) and, if the sequence streams, its
text and an output. A batch writes those of all such rows
into arrays indexed by the rows' slots with a few array operations, instead of a Python call per
row. The sequence moves them into its lists the first time anything reads `Sequence.output_ids`,
`exit_depths` or `metrics` (each settles first): its next token that goes the long way, its finish,
an output (a streamed request's, right after its batch: the scheduler decodes its text then), a
preemption, a draft. So no reader ever sees a sequence short of a token
(docs/design.md §9, step 2 of the persistent batch).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from loopserve.jit import compiled

if TYPE_CHECKING:
    from loopserve.engine.sequence import Sequence

# tokens a slot holds before a batch that would add one more settles its sequence first (one Python call
# per this many tokens of a row, against one per token)
HOLD = 128
_BY_SLOT = ("count", "tokens", "depths", "loops", "first_time", "last_time")  # the arrays by slot (last axis)


class HeldTokens:
    def __init__(self, slots: int) -> None:
        self.owners: list[Sequence | None] = []  # the sequence each slot holds tokens for
        self._alloc(max(slots, 1))

    def _alloc(self, slots: int) -> None:
        old = {name: getattr(self, name) for name in _BY_SLOT if hasattr(self, name)}
        self.count = np.zeros(slots, np.int64)  # tokens held
        # their ids and exit depths, column j of slot s at [j, s]: a batch of slots that started together
        # writes one contiguous stretch of a row (the cache lines of one column, not one per slot)
        self.tokens = np.zeros((HOLD, slots), np.int32)
        self.depths = np.zeros((HOLD, slots), np.int16)
        self.loops = np.zeros(slots, np.int64)  # the loops they ran, together
        self.first_time = np.zeros(slots)  # when the first of them arrived
        self.last_time = np.zeros(slots)  # and the latest
        for name, kept in old.items():
            getattr(self, name)[..., : kept.shape[-1]] = kept  # (by slot: the last axis)
        self.owners += [None] * (slots - len(self.owners))

    def admit(self, slot: int, seq: Sequence) -> None:
        """`seq` now holds block-table slot `slot`: whichever sequence held it before takes its tokens
        out and lets go of it, and so does `seq` of the slot it held before, if any (a prompt whose
        partial prefill was dropped is admitted again, maybe into another slot)."""
        if slot >= len(self.owners):
            self._alloc(max(slot + 1, 2 * len(self.owners)))
        before = self.owners[slot]
        if before is not None and before.held is self and before.slot == slot:
            self._let_go(before)
        if seq.held is self and self.owners[seq.slot] is seq:
            self._let_go(seq)
        self.owners[slot] = seq
        # a sequence that is not quiet never has a token held: it keeps held None, so its every read of
        # `output_ids`, `exit_depths` and `metrics` (a request with logprobs or stop strings: several per
        # token) skips the count
        seq.held, seq.slot = (self if seq.quiet else None), slot

    def _let_go(self, seq: Sequence) -> None:
        """`seq` leaves its slot: it takes its tokens in first."""
        seq.settle()
        self.owners[seq.slot] = None
        seq.held = None

    def add(self, slots: np.ndarray, tokens: np.ndarray, depths: np.ndarray, loops: np.ndarray,
            now: float) -> None:
        """One token for each sequence in `slots` (no slot twice: one plain item per sequence), its exit
        depth and the loops it ran, all arrived at `now`. One compiled pass; a full slot's sequence takes
        its tokens in first, then its row is written."""
        skipped = np.empty(len(slots), np.int64)
        n = _hold_rows(slots, tokens, depths, loops, now, self.count, self.tokens, self.depths, self.loops,
                       self.first_time, self.last_time, skipped)
        if n:
            full = skipped[:n]
            for slot in slots[full].tolist():
                owner = self.owners[slot]
                assert owner is not None and owner.held is self and owner.slot == slot, f"slot {slot} holds no sequence"
                owner.settle()
            _hold_rows(slots[full], tokens[full], depths[full], loops[full], now, self.count, self.tokens,
                       self.depths, self.loops, self.first_time, self.last_time, skipped)

    def take(self, slot: int) -> tuple[list[int], list[int], int, float, float]:
        """The tokens held for `slot` (ids, exit depths, loops run, first and latest arrival), no longer held."""
        n = int(self.count[slot])
        if n == 1:  # (a streamed request's, every tick: two element reads cost less than two column slices)
            tokens, depths = [int(self.tokens[0, slot])], [int(self.depths[0, slot])]
        else:
            tokens, depths = self.tokens[:n, slot].tolist(), self.depths[:n, slot].tolist()
        out = (tokens, depths, int(self.loops[slot]), float(self.first_time[slot]), float(self.last_time[slot]))
        self.count[slot] = self.loops[slot] = 0
        return out


@compiled
def _hold_rows(slots, tokens, depths, loops, now, count, held_tokens, held_depths, held_loops, first_time, last_time,
               skipped):
    """`HeldTokens.add`: row k's token into the next free column of slot slots[k], unless the slot is full:
    those rows' indices go to `skipped` (how many is returned)."""
    n = 0
    width = held_tokens.shape[0]
    for k in range(slots.shape[0]):
        s = slots[k]
        c = count[s]
        if c == width:
            skipped[n] = k
            n += 1
            continue
        held_tokens[c, s] = tokens[k]
        held_depths[c, s] = depths[k]
        held_loops[s] += loops[k]
        if c == 0:
            first_time[s] = now
        last_time[s] = now
        count[s] = c + 1
    return n
