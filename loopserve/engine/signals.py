"""Per-step exit signals, computed on a batch of rows after a core step.

Shared by the reference decoder (batch of one) and the batched runner, so both feed the exit
trackers the same numbers.
"""

from __future__ import annotations

import torch

from loopserve.device import upload
from loopserve.models.base import LoopedLM, latent_diff
from loopserve.models.context import ForwardContext


def kl_prev_to_cur(prev_logprobs: torch.Tensor, cur_logprobs: torch.Tensor) -> torch.Tensor:
    """KL(p_{r-1} || p_r) per row."""
    return (prev_logprobs.exp() * (prev_logprobs - cur_logprobs)).sum(-1)


def uniform_logprobs(n: int, vocab: int, dtype: torch.dtype, device) -> torch.Tensor:
    return torch.full((n, vocab), -torch.log(torch.tensor(float(vocab))).item(), dtype=dtype, device=device)


def step_signals(model: LoopedLM, kinds: set[str], prev: torch.Tensor, new: torch.Tensor,
                 ctx: ForwardContext | None, prev_logprobs: torch.Tensor | None, kl_rows: list[int] | None):
    """Signals of the kinds asked for, each a [N] tensor (KL: only rows in `kl_rows`, [len]; `ctx`, the step's
    attention context, is read only for those).

    Returns (signals, new_logprobs of kl_rows or None). Running the coda for KL writes coda KV
    for those rows, as the reference decoder does.
    """
    out: dict[str, torch.Tensor] = {}
    logprobs = None
    if "gate" in kinds or "lookahead_gate" in kinds:
        out["gate"] = model.gate_logit(new)
    if "lookahead_gate" in kinds:  # [N, 2]: (main gate logit, predicted next-step logit)
        out["lookahead_gate"] = torch.stack([out["gate"], model.lookahead_gate_logit(new)], -1)
    if "latent_diff" in kinds:
        out["latent_diff"] = latent_diff(prev, new)
    if "kl" in kinds and kl_rows is not None and prev_logprobs is not None:
        assert ctx is not None, "ctx: the KL signal runs the coda, which needs the step's context"
        sub = ctx.select(kl_rows)
        logprobs = torch.log_softmax(model.coda(new[upload(kl_rows, new.device)], sub).double(), -1)
        out["kl"] = kl_prev_to_cur(prev_logprobs, logprobs)
    return out, logprobs
