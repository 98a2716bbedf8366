"""Ouro's Stage-I training objective (docs/design.md §3.4) and the exit distribution it uses.

For each position, with per-step losses L_t (cross-entropy of the readout after loop step t) and
gate logits g_t (t = 1..T):

    lambda_t = sigmoid(g_t)
    p_t      = lambda_t * prod_{j<t} (1 - lambda_j)      t < T
    p_T      = prod_{j<T} (1 - lambda_j)                  (the last step takes the remaining mass)
    loss     = sum_t p_t L_t - beta * H(p),   H(p) = -sum_t p_t log p_t

averaged over positions. Minimising it over p alone gives p_t proportional to exp(-L_t / beta): the
gate puts its mass on the cheapest step that is nearly as good as the best, so easy tokens get an
early exit and hard ones run deep. Everything is computed in log space (logsigmoid), so saturated
gates give exact zeros instead of NaNs.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def exit_log_probs(gate_logits: torch.Tensor) -> torch.Tensor:
    """log p(t | x) for t = 1..T from gate logits [T, N] (the last step's logit is ignored)."""
    t_max = gate_logits.shape[0]
    g = gate_logits.float() if gate_logits.dtype in (torch.float16, torch.bfloat16) else gate_logits
    log_stay = F.logsigmoid(-g[: t_max - 1])  # log(1 - lambda_t), t < T
    log_surv = torch.cat([torch.zeros_like(g[:1]), log_stay.cumsum(0)])  # log prod_{j<t}(1 - lambda_j)
    log_exit = torch.cat([F.logsigmoid(g[: t_max - 1]), torch.zeros_like(g[:1])])  # log lambda_t; 0 at T
    return log_surv + log_exit


def exit_distribution(gate_logits: torch.Tensor) -> torch.Tensor:
    """p(t | x) [T, N]; sums to one over t."""
    return exit_log_probs(gate_logits).exp()


def exit_cdf(gate_logits: torch.Tensor) -> torch.Tensor:
    """CDF(t) = 1 - prod_{j<=t}(1 - lambda_j) [T, N], with CDF(T) = 1 (what the Q-exit rule compares)."""
    return exit_distribution(gate_logits).cumsum(0).clamp(max=1.0)


def stage1_loss(step_losses: torch.Tensor, gate_logits: torch.Tensor, beta: float) -> tuple[torch.Tensor, dict]:
    """Stage-I loss from per-step losses [T, N] and gate logits [T, N] (same positions).

    Returns (loss, stats) where stats holds detached floats: expected loss, entropy, the mean exit
    distribution and each step's mean loss.
    """
    if step_losses.shape != gate_logits.shape:
        raise ValueError(f"step_losses {tuple(step_losses.shape)} and gate_logits {tuple(gate_logits.shape)} differ")
    logp = exit_log_probs(gate_logits)
    p = logp.exp()
    expected = (p * step_losses).sum(0).mean()
    entropy = -(p * logp).sum(0).mean()
    loss = expected - beta * entropy
    with torch.no_grad():
        stats = {
            "expected_loss": float(expected),
            "entropy": float(entropy),
            "p_exit": [float(x) for x in p.mean(1)],
            "step_loss": [float(x) for x in step_losses.mean(1)],
        }
    return loss, stats
