"""The stage API every looped model implements (docs/design.md §2.1).

A token's life: `prelude` (embedding + unshared blocks) -> `core_step` once per loop (shared
blocks) -> `coda` (unshared blocks + head). Every call takes a packed batch of rows that may
belong to different sequences at different depths; KV goes through `ctx` (the layout decides
slots). States are plain tensors the caller keeps in its state pool.
"""

from __future__ import annotations

import torch
from torch import nn

from loopserve.model_config import ModelConfig
from loopserve.models.context import ForwardContext


class LoopedLM(nn.Module):
    """A looped model's stages. Made with its weights unset (the embedding uninitialized, the rest at torch's defaults):
    whoever makes one writes every tensor of `checkpoint_tensors` (`load_model`, make-tiny, training's init)."""

    config: ModelConfig
    has_gate: bool = False
    injects: bool = False  # whether `prelude` returns a per-step injection (then the engine keeps one per state row)

    @property
    def default_exit_policy(self) -> str:
        """The exit policy of a request that names none: the learned gate where the model has one, else the
        latent difference between loop steps."""
        return "gate" if self.has_gate else "latent_diff"

    def checkpoint_tensors(self) -> dict[str, torch.Tensor]:
        """Every tensor of the model's checkpoint by its name there, in parameter order: a parameter, or the
        rows of one that stacks tensors a checkpoint stores apart (a submodule's `stacked`: {its parameter:
        ((checkpoint tensor, rows), ...)}, e.g. q, k and v in one projection, one matmul a call). Views:
        copying into one loads that part of the parameter."""
        parts: dict[str, tuple[tuple[str, int], ...]] = {}
        for prefix, module in self.named_modules():
            at = f"{prefix}." if prefix else ""
            for own, pieces in getattr(module, "stacked", {}).items():
                parts[at + own] = tuple((at + name, rows) for name, rows in pieces)
        out = {}
        for name, p in self.named_parameters():
            start = 0
            for piece, rows in parts.get(name, ((name, p.shape[0]),)):
                out[piece] = p if piece == name else p[start:start + rows]
                start += rows
            assert start == p.shape[0], f"{name}: its stacked parts have {start} rows, it has {p.shape[0]}"
        return out

    def prelude(self, token_ids: torch.Tensor, ctx: ForwardContext | None,
                state_seeds: list[int] | torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Returns (initial loop state, per-step injection or None). `ctx` may be None for a model without
        prelude layers (`config.n_prelude == 0`). `state_seeds`: a seed per row (a list, or int64 on the device)
        for a model that draws its initial state (`draws_random_state`)."""
        raise NotImplementedError

    def core_step(self, state: torch.Tensor, inject: torch.Tensor | None, ctx: ForwardContext) -> torch.Tensor:
        """One loop step at depths `ctx.depth`; returns the next state."""
        raise NotImplementedError

    def coda(self, state: torch.Tensor, ctx: ForwardContext | None,
             logit_rows: torch.Tensor | None = None) -> torch.Tensor:
        """Coda over all rows (writing any coda KV); logits [len(logit_rows) or N, V] in fp32+. `ctx` may be
        None for a model without coda layers (`config.n_coda == 0`: nothing in its coda attends)."""
        raise NotImplementedError

    def gate_logit(self, state: torch.Tensor) -> torch.Tensor:
        """Learned exit-gate logit per row (fp32 or wider)."""
        raise ValueError(f"{self.config.arch} has no learned exit gate; use exit_policy='latent_diff'")

    def lookahead_gate_logit(self, state: torch.Tensor) -> torch.Tensor:
        raise ValueError("this checkpoint has no lookahead gate tensor")

    @property
    def has_lookahead_gate(self) -> bool:
        return False

    @property
    def draws_random_state(self) -> bool:
        """Whether `prelude` draws each token's initial loop state from its seed (then a prompt's KV
        depends on the seeds too: docs/design.md §4.3)."""
        return False


def latent_diff(prev: torch.Tensor, new: torch.Tensor) -> torch.Tensor:
    """||s_r - s_{r-1}|| / ||s_r|| per row, in fp32 or wider."""
    cdt = torch.promote_types(new.dtype, torch.float32)
    n, p = new.to(cdt), prev.to(cdt)
    return (n - p).norm(dim=-1) / n.norm(dim=-1)
