"""`SlotFacts`: the resident sequences' constant facts as arrays indexed by block-table slot.

A sequence holds its slot of the KV block tables from admission to its end (through preemption too),
and the facts a decode batch reads about each row's sequence never change while it runs: its
prompt's length, whether it samples by a plain argmax, its exit rule's constants.
Set once per sequence when it is admitted, they are read for a whole batch with one gather by the
rows' slots (`StatePool.kv_slot`) instead of a Python attribute read per row. By itself that gains
nothing measurable (docs/benchmarks.md §8.15: the same instruction and cache-miss counts); it is the
first step of the persistent batch (docs/design.md §9), whose next step keeps tokens and stop checks by
slot as well.
"""

from __future__ import annotations

import numpy as np

from loopserve.engine.sequence import Sequence
from loopserve.exits import RULE_WIDTH


class SlotFacts:
    def __init__(self, slots: int) -> None:
        self._alloc(max(slots, 1))

    def _alloc(self, slots: int) -> None:
        old = self.__dict__.copy()
        self.prompt_len = np.zeros(slots, np.int64)
        self.plain = np.zeros(slots, bool)  # samples by the argmax of the raw logits (`plain_greedy`)
        self.rule = np.zeros((slots, RULE_WIDTH), np.float64)  # its exit rule's `row`
        for name, kept in old.items():
            getattr(self, name)[: len(kept)] = kept

    def admit(self, slot: int, seq: Sequence) -> None:
        """`seq` now holds block-table slot `slot`."""
        if slot >= len(self.plain):
            self._alloc(max(slot + 1, 2 * len(self.plain)))
        self.prompt_len[slot] = len(seq.prompt_ids)
        self.plain[slot] = seq.plain_greedy
        self.rule[slot] = seq.rule.row

    def matches(self, slot: int, seq: Sequence) -> bool:
        """Whether the facts of `slot` are `seq`'s (the scheduler's invariant checks)."""
        return (slot < len(self.plain) and self.prompt_len[slot] == len(seq.prompt_ids)
                and self.plain[slot] == seq.plain_greedy
                and np.array_equal(self.rule[slot], seq.rule.row, equal_nan=True))  # (no threshold: NaN)
