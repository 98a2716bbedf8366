"""`SamplingParams`: what a request asks for (vLLM names) plus the looped-model extensions."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from loopserve.exits import POLICIES

MAX_LOGPROBS = 20
# Temperatures below this sample greedily (as vLLM does): dividing logits by a subnormal temperature
# overflows to inf, and below it a logit gap of 1e-3 is already a probability ratio of e^100.
GREEDY_TEMPERATURE = 1e-5
SEED_MIN, SEED_MAX = -(2**63), 2**64 - 1  # any 64-bit seed, signed or not (the engine keeps 63 bits)


@dataclass
class SamplingParams:
    n: int = 1
    max_tokens: int | None = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None
    skip_special_tokens: bool = True
    # looped-model extensions
    min_loops: int | None = None
    max_loops: int | None = None
    exit_threshold: float | None = None
    exit_policy: str | None = None  # None: the model's own signal (Ouro gate, Huginn latent_diff)
    exit_trace: list[int] | None = None

    def __post_init__(self) -> None:
        def bad(name: str, why: str) -> ValueError:
            return ValueError(f"{name}: {why}, got {getattr(self, name)!r}")

        def is_int(x) -> bool:
            return isinstance(x, int) and not isinstance(x, bool)

        def is_real(x) -> bool:  # finite int or float (no bool, NaN or infinity)
            return isinstance(x, int | float) and not isinstance(x, bool) and math.isfinite(x)

        if not is_int(self.n) or self.n != 1:
            raise bad("n", "only n=1 is supported")
        if self.max_tokens is not None and (not is_int(self.max_tokens) or self.max_tokens < 1):
            raise bad("max_tokens", "must be an integer >= 1")
        if not is_real(self.temperature) or not 0 <= self.temperature <= 100:
            raise bad("temperature", "must be in [0, 100]")
        if not is_real(self.top_p) or not 0 < self.top_p <= 1:
            raise bad("top_p", "must be in (0, 1]")
        if not is_int(self.top_k) or (self.top_k < 1 and self.top_k not in (0, -1)):
            raise bad("top_k", "must be -1 or 0 (disabled) or >= 1")
        if not is_real(self.min_p) or not 0 <= self.min_p <= 1:
            raise bad("min_p", "must be in [0, 1]")
        if self.seed is not None and (not is_int(self.seed) or not SEED_MIN <= self.seed <= SEED_MAX):
            raise bad("seed", "must be a 64-bit integer")
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if isinstance(self.stop, tuple):
            self.stop = list(self.stop)
        if isinstance(self.stop_token_ids, tuple):
            self.stop_token_ids = list(self.stop_token_ids)
        if self.stop is not None and (not isinstance(self.stop, list)
                                      or not all(isinstance(s, str) and s for s in self.stop)):
            raise bad("stop", "must be a non-empty string or a list of them")
        if not isinstance(self.stop_token_ids, list) or not all(is_int(t) and t >= 0 for t in self.stop_token_ids):
            raise bad("stop_token_ids", "must be non-negative integers")
        if self.logprobs is not None and (not is_int(self.logprobs) or not 0 <= self.logprobs <= MAX_LOGPROBS):
            raise bad("logprobs", f"must be an integer in [0, {MAX_LOGPROBS}]")
        for name in ("min_loops", "max_loops"):
            v = getattr(self, name)
            if v is not None and (not is_int(v) or v < 1):
                raise bad(name, "must be an integer >= 1")
        if self.min_loops and self.max_loops and self.min_loops > self.max_loops:
            raise bad("min_loops", f"must be <= max_loops ({self.max_loops})")
        if self.exit_threshold is not None and (not is_real(self.exit_threshold) or self.exit_threshold < 0):
            raise bad("exit_threshold", "must be a finite number >= 0")
        if self.exit_policy is not None and self.exit_policy not in POLICIES:
            raise bad("exit_policy", f"must be one of {', '.join(POLICIES)}")
        if self.exit_trace is not None:
            if not isinstance(self.exit_trace, list) or not all(is_int(d) and d >= 1 for d in self.exit_trace):
                raise bad("exit_trace", "must be a list of integers >= 1")
            if self.exit_policy not in (None, "trace"):
                raise bad("exit_policy", "must be 'trace' (or unset) when exit_trace is given")
            self.exit_policy = "trace"
        if self.exit_policy == "gate" and self.exit_threshold is not None and not 0 < self.exit_threshold <= 1:
            raise bad("exit_threshold", "a gate threshold is a probability in (0, 1]")

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE
