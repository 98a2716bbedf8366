"""`SlotFacts`: the resident sequences' constant facts as arrays indexed by block-table slot.

A sequence holds its slot of the KV block tables from admission to its end (swapped out too; one whose
KV is dropped for recomputation is admitted again, maybe into another slot, and its facts written there),
and the facts a decode batch reads about each row's sequence never change while it runs: its
prompt's length, whether it samples by a plain argmax, its exit rule's constants, whether a token
that cannot finish it needs no per-token check (`Sequence.quiet`), whether it streams, how many tokens
it may generate, and which tokens may stop it. Set once per sequence when it is admitted, they are read for
a whole batch with one gather by the rows' slots (`StatePool.kv_slot`) instead of a Python attribute
read per row. The reads alone gain nothing measurable (docs/benchmarks.md §8.15: the same instruction
and cache-miss counts); what gains is the Python they let a batch skip: `StatePool.requeue_quiet` decides for
a whole coda batch which rows' tokens need no per-row check, so those rows make no `Sample` (a streamed
one only has its text decoded and an output made) (docs/design.md §9).
"""

from __future__ import annotations

import numpy as np

from loopserve.engine.sequence import Sequence
from loopserve.exits import RULE_WIDTH

_BY_SLOT = ("prompt_len", "plain", "quiet", "streams", "max_new", "rule")  # the arrays with a row per slot


class SlotFacts:
    def __init__(self, slots: int) -> None:
        # how many slots' latest sequences each token may stop (a slot's count leaves when another sequence
        # takes the slot; the last entry, always 0, stands for every larger token)
        self.stop_refs = np.zeros(1, np.int64)
        self._stops: list[frozenset[int]] = []  # each slot's `stop_tokens`, counted in stop_refs
        self._alloc(max(slots, 1))

    def _alloc(self, slots: int) -> None:
        old = {name: getattr(self, name) for name in _BY_SLOT if hasattr(self, name)}
        self.prompt_len = np.zeros(slots, np.int64)
        self.plain = np.zeros(slots, bool)  # samples by the argmax of the raw logits (`plain_greedy`)
        self.quiet = np.zeros(slots, bool)  # `Sequence.quiet`
        self.streams = np.zeros(slots, bool)  # `Sequence.streams`: an output after every token
        self.max_new = np.zeros(slots, np.int64)  # tokens it may generate (`Sequence.max_new`)
        self.rule = np.zeros((slots, RULE_WIDTH), np.float64)  # its exit rule's `row`
        for name, kept in old.items():
            getattr(self, name)[: len(kept)] = kept
        self._stops += [frozenset()] * (slots - len(self._stops))

    def admit(self, slot: int, seq: Sequence) -> None:
        """`seq` now holds block-table slot `slot` (in place of whichever sequence held it before)."""
        if slot >= len(self.plain):
            self._alloc(max(slot + 1, 2 * len(self.plain)))
        self.prompt_len[slot] = len(seq.prompt_ids)
        self.plain[slot] = seq.plain_greedy
        self.quiet[slot] = seq.quiet
        self.streams[slot] = seq.streams
        self.max_new[slot] = seq.max_new
        self.rule[slot] = seq.rule.row
        before, stops = self._stops[slot], seq.stop_tokens
        if before:
            self.stop_refs[list(before)] -= 1
        if stops:
            size = max(stops) + 2  # (the sentinel after the largest)
            if size > len(self.stop_refs):
                self.stop_refs = np.concatenate([self.stop_refs, np.zeros(size - len(self.stop_refs), np.int64)])
            self.stop_refs[list(stops)] += 1
        self._stops[slot] = stops

    def matches(self, slot: int, seq: Sequence) -> bool:
        """Whether the facts of `slot` are `seq`'s (the scheduler's invariant checks)."""
        return (slot < len(self.plain) and self.prompt_len[slot] == len(seq.prompt_ids)
                and self.plain[slot] == seq.plain_greedy and self.quiet[slot] == seq.quiet
                and self.streams[slot] == seq.streams
                and self.max_new[slot] == seq.max_new and self._stops[slot] == seq.stop_tokens
                and np.array_equal(self.rule[slot], seq.rule.row, equal_nan=True))  # (no threshold: NaN)

    def stops_counted(self) -> bool:
        """Whether `stop_refs` counts exactly the slots' stop tokens (the scheduler's invariant checks)."""
        counted = np.zeros(len(self.stop_refs), np.int64)
        for stops in self._stops:
            counted[list(stops)] += 1
        return bool(np.array_equal(counted, self.stop_refs))
