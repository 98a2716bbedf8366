"""Serving metrics from per-request timestamps (vLLM `bench serve` and CDB-paper definitions).

For a request with arrival time a (the scheduled Poisson release instant on open-loop runs), token
arrival times t_1 <= ... <= t_n and finish time f (= t_n unless it failed):

* TTFT = t_1 - a
* e2e latency = f - a
* TPOT = (e2e - TTFT) / (n - 1), requests with n >= 2 only
* ITL = every gap t_i - t_(i-1), pooled over all requests
* normalized latency = mean over requests of (e2e / n)   (the vLLM/Orca definition the CDB paper
  uses: the division happens per request, before averaging), in s/token
* request throughput = completed requests / duration; output token throughput = output tokens /
  duration; duration = last finish - first arrival.

Each latency is summarised by mean, p50, p90, p99 and max (numpy's linear-interpolation
percentiles).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

PERCENTILES = (50, 90, 99)


@dataclass
class RequestRecord:
    arrival: float
    token_times: list[float] = field(default_factory=list)  # one entry per output token
    finish: float | None = None
    prompt_tokens: int = 0
    output_tokens: int | None = None  # when the count differs from len(token_times) (HTTP chunks)
    error: str | None = None
    exit_depths: list[int] = field(default_factory=list)  # HTTP: each output token's, as the server reports them

    @property
    def n(self) -> int:
        return self.output_tokens if self.output_tokens is not None else len(self.token_times)

    @property
    def ok(self) -> bool:
        return self.error is None and self.n > 0 and bool(self.token_times)

    @property
    def end(self) -> float:
        return self.finish if self.finish is not None else self.token_times[-1]

    @property
    def ttft(self) -> float:
        return self.token_times[0] - self.arrival

    @property
    def e2e(self) -> float:
        return self.end - self.arrival

    @property
    def tpot(self) -> float | None:
        return (self.e2e - self.ttft) / (self.n - 1) if self.n > 1 else None

    @property
    def itls(self) -> list[float]:
        t = self.token_times
        return [b - a for a, b in zip(t[:-1], t[1:], strict=True)]

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def summarize(values: list[float] | np.ndarray) -> dict[str, float | None]:
    """mean, p50, p90, p99, max (None for an empty list)."""
    v = np.asarray(values, dtype=float)
    if v.size == 0:
        return {"mean": None, **{f"p{p}": None for p in PERCENTILES}, "max": None}
    return {"mean": float(v.mean()), **{f"p{p}": float(np.percentile(v, p)) for p in PERCENTILES},
            "max": float(v.max())}


def normalized_latency(records: list[RequestRecord]) -> float | None:
    """Mean over completed requests of e2e / output tokens (s/token)."""
    done = [r for r in records if r.ok]
    return float(np.mean([r.e2e / r.n for r in done])) if done else None


def serving_metrics(records: list[RequestRecord], duration: float | None = None) -> dict[str, Any]:
    """Every metric of the module docstring for one run."""
    done = [r for r in records if r.ok]
    if duration is None:
        duration = (max(r.end for r in done) - min(r.arrival for r in records)) if done else 0.0
    out_tokens = sum(r.n for r in done)
    in_tokens = sum(r.prompt_tokens for r in done)
    return {
        "requests": len(records),
        "completed": len(done),
        "failed": len(records) - len(done),
        "duration_s": duration,
        "output_tokens": out_tokens,
        "prompt_tokens": in_tokens,
        "request_throughput": len(done) / duration if duration > 0 else None,
        "output_token_throughput": out_tokens / duration if duration > 0 else None,
        "total_token_throughput": (out_tokens + in_tokens) / duration if duration > 0 else None,
        "normalized_latency": normalized_latency(records),
        "ttft": summarize([r.ttft for r in done]),
        "tpot": summarize([t for r in done if (t := r.tpot) is not None]),
        "itl": summarize([x for r in done for x in r.itls]),
        "e2e": summarize([r.e2e for r in done]),
    }


def poisson_arrivals(rate: float, n: int, seed: int = 0, burstiness: float = 1.0) -> list[float]:
    """Release instants (s from the start) of `n` requests: gaps ~ Gamma(shape=burstiness,
    mean=1/rate) (burstiness 1: a Poisson process). rate = inf: all at t = 0."""
    if rate <= 0:
        raise ValueError("rate must be > 0")
    if np.isinf(rate):
        return [0.0] * n
    rng = np.random.default_rng(seed)
    gaps = rng.gamma(burstiness, 1.0 / (rate * burstiness), n)
    gaps[0] = 0.0  # the first request opens the run
    return [float(x) for x in np.cumsum(gaps)]
