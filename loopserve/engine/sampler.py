"""Next-token sampling and logprobs for one row.

Sampling math runs in float64 from the row's logits so a request draws the same token from the same
logits whatever batch it was in; a per-request generator makes seeded sampling reproducible.
Logits that are not all finite raise `NonFiniteError`: the engine then fails that request alone
(sampling from NaN would either raise deep in torch or silently pick an arbitrary token).
"""

from __future__ import annotations

import torch

from loopserve.errors import NonFiniteError
from loopserve.outputs import Logprob
from loopserve.sampling_params import SamplingParams


def _host_logits(logits: torch.Tensor) -> torch.Tensor:
    x = logits.detach().to("cpu", torch.float64)
    if not bool(torch.isfinite(x).all()):
        raise NonFiniteError("the model produced non-finite logits for this request")
    return x


def _filtered_probs(logits: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    x = logits / p.temperature  # temperature >= GREEDY_TEMPERATURE here, so x stays finite
    if p.top_k > 0 and p.top_k < x.numel():
        kth = torch.topk(x, p.top_k).values[-1]
        x = x.masked_fill(x < kth, float("-inf"))
    probs = torch.softmax(x, -1)
    if p.top_p < 1:
        sorted_p, order = probs.sort(descending=True)
        before = sorted_p.cumsum(0) - sorted_p  # mass strictly above each token
        drop = before >= p.top_p
        probs = probs.scatter(0, order, sorted_p.masked_fill(drop, 0.0))
    if p.min_p > 0:
        probs = probs.masked_fill(probs < p.min_p * probs.max(), 0.0)
    return probs / probs.sum()


def sample_token(logits: torch.Tensor, p: SamplingParams, generator: torch.Generator | None) -> int:
    x = _host_logits(logits)
    if p.greedy:
        return int(torch.argmax(x))
    return int(torch.multinomial(_filtered_probs(x, p), 1, generator=generator))


def token_logprobs(logits: torch.Tensor, token: int, k: int, decode) -> tuple[dict[int, Logprob], float]:
    """Top-k of the model's raw distribution plus the sampled token; and the sampled logprob."""
    lp = torch.log_softmax(_host_logits(logits), -1)
    chosen = float(lp[token])
    out: dict[int, Logprob] = {}
    if k > 0:
        vals, ids = torch.topk(lp, min(k, lp.numel()))
        for rank, (v, i) in enumerate(zip(vals.tolist(), ids.tolist(), strict=True), start=1):
            out[i] = Logprob(v, rank, decode(i))
    if token not in out:
        out[token] = Logprob(chosen, int((lp > lp[token]).sum()) + 1, decode(token))
    return out, chosen
