"""KV layouts: which slot a layer application writes, and which slot a query reads (docs/design.md §4.1).

This file is the single home of the read rule; the batched runner and the reference decoder both
call it. Slots of one token are laid out as

    prelude layers (1 slot each) | core layer j, depth slot 0..D-1 | coda layers (1 slot each)

with D = r_max for `depth_indexed` and `last_exited`, and D = 1 for `shared`.

A token's *KV depth* is the number of core loops whose KV it has written (its loops run). While
a token is still looping, its KV depth is `IN_FLIGHT`: it has just written the slot of the depth
being computed, and nothing deeper.

Read rules for a query at loop depth r (1-based) and an earlier or same-chunk token with KV depth e:
- depth_indexed: slot r; a token that never ran depth r (e < r) has no entry and is not attended
  (the checkpoints' own cache behaves this way: missing entries are simply absent).
- last_exited: slot min(r, e): the deepest KV the token has, never deeper than the query.
- shared: the token's one slot, holding the KV of its latest loop.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

IN_FLIGHT = 1 << 30  # KV depth of a token still looping
LAYOUTS = ("depth_indexed", "last_exited", "shared")


@dataclass(frozen=True)
class KVLayout:
    name: str
    n_prelude: int
    n_core: int
    n_coda: int
    r_max: int

    def __post_init__(self) -> None:
        if self.name not in LAYOUTS:
            raise ValueError(f"kv_layout: unknown layout {self.name!r}; choose one of {', '.join(LAYOUTS)}")

    @property
    def depth_slots(self) -> int:
        return 1 if self.name == "shared" else self.r_max

    @property
    def slots_per_token(self) -> int:
        return self.n_prelude + self.n_core * self.depth_slots + self.n_coda

    def bytes_per_token(self, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
        elem = torch.empty((), dtype=dtype).element_size()
        return 2 * self.slots_per_token * num_kv_heads * head_dim * elem

    # -- slot of a layer application -------------------------------------------------------
    def prelude_slot(self, layer: int) -> int:
        return layer

    def coda_slot(self, layer: int) -> int:
        return self.n_prelude + self.n_core * self.depth_slots + layer

    def boundary_slot(self, stage: str, layer: int) -> int:
        """The one slot a "prelude" or "coda" layer writes and reads."""
        return self.prelude_slot(layer) if stage == "prelude" else self.coda_slot(layer)

    def layer_stride(self, stage: str) -> int:
        """Slots from one layer of a stage to the next: layer j's slots are layer 0's plus j times this
        (write and read alike), so a batch's reads derived for one layer serve every layer."""
        return self.depth_slots if stage == "core" else 1

    def core_write_slot(self, layer: int, depth: torch.Tensor) -> torch.Tensor:
        """Slot written by core layer `layer` at loop depth `depth` (1-based, any shape)."""
        base = self.n_prelude + layer * self.depth_slots
        if self.name == "shared":
            return torch.full_like(depth, base)
        return base + depth - 1

    def core_read(self, layer: int, depth: torch.Tensor, key_depth: torch.Tensor):
        """(slot, visible) for queries at `depth` reading keys of KV depth `key_depth`.

        `depth` broadcasts against `key_depth` (e.g. [N, 1] against [N, L]).
        """
        base = self.n_prelude + layer * self.depth_slots
        if self.name == "shared":
            return torch.full_like(key_depth, base), torch.ones_like(key_depth, dtype=torch.bool)
        if self.name == "depth_indexed":
            slot = (base + depth - 1).expand_as(key_depth)
            return slot, key_depth >= depth
        return base + torch.minimum(depth, key_depth) - 1, torch.ones_like(key_depth, dtype=torch.bool)
