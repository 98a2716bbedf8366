"""Exit policies: when a decode token stops looping (DESIGN.md §1, §3).

A request resolves its `SamplingParams` into one `ExitRule`; each decode work item gets a fresh
`ExitTracker` that sees the item's signal after every loop step and answers whether it loops on.

Policies and their per-step signal:
- `fixed`: none; every token runs `max_loops`.
- `gate` (Ouro): learned gate logit on the normed state; lambda_r = sigmoid(logit), exit at the first
  r with CDF(r) = 1 - prod_{j<=r}(1 - lambda_j) >= threshold (the cumulative-hazard rule).
- `latent_diff` (Huginn): ||s_r - s_{r-1}|| / ||s_r|| < threshold (s_0 = the initial state).
- `kl`: KL(p_{r-1} || p_r) < threshold between successive next-token distributions (p_0 uniform).
  Needs the coda and LM head after every step: supported, but expensive.
- `trace`: replay; the k-th decode work item exits at depth `exit_trace[k]` (full depth past the end).
- `lookahead_gate` (checkpoints with a distilled `lookahead_gate` head): after step r the signal is
  (main gate logit, lookahead logit predicting the main gate's logit after step r+1); step r+1 is the
  last if 1 - prod_{j<=r}(1 - lambda_j) * (1 - lambda_hat_{r+1}) >= threshold. The item runs step r+1
  and exits there with its state: no loop is wasted and batch r+2 is known one step early (the
  earliest exit is depth 2). Delayed lookahead adds nothing to this policy.

All policies respect `min_loops` (no exit before) and `max_loops` (always exit there).

Delayed lookahead (`lookahead=True`): the decision made from the signal after step r is applied one
step late. The item already sits in batch r+1 (built before step r finished), so it runs step r+1,
but that step's state is discarded: the token exits at depth r (the coda reads the state of step r,
its KV depth is r+1). Batch r+1 is thus known while step r runs (r_min = 2 loops). An early exit
costs exactly one extra loop; an item that reaches `max_loops` costs nothing extra.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

from loopserve.errors import NonFiniteError

POLICIES = ("fixed", "gate", "latent_diff", "kl", "trace", "lookahead_gate")
SIGNAL_OF = {"gate": "gate", "latent_diff": "latent_diff", "kl": "kl", "lookahead_gate": "lookahead_gate"}
Signal = float | list[float] | tuple[float, float] | None  # lookahead_gate: (main logit, lookahead logit)


@dataclass(frozen=True)
class ExitRule:
    policy: str
    threshold: float | None
    min_loops: int
    max_loops: int
    trace: tuple[int, ...] = ()
    lookahead: bool = False

    @functools.cached_property  # read per item per step: computed once per rule
    def signal(self) -> str | None:
        """Which per-step signal the runner must compute for this rule, if any."""
        if self.threshold is None and self.policy not in ("gate", "lookahead_gate"):
            return None
        return SIGNAL_OF.get(self.policy)

    @functools.cached_property
    def decides_ahead(self) -> bool:
        """True if the signal after step r first changes what happens after step r+1 (delayed
        lookahead, lookahead_gate): the engine may read it one tick late, after queueing step r+1."""
        return self.lookahead or self.policy == "lookahead_gate"

    def new_item(self, decode_index: int) -> ExitTracker:
        return ExitTracker(self, decode_index)


class ExitTracker:
    """Per work item: feed `observe(r, signal)` after step r; False means the item stops looping."""

    def __init__(self, rule: ExitRule, decode_index: int) -> None:
        self.rule = rule
        self.survival = 1.0
        self.exit_depth: int | None = None  # set once the decision to exit is made
        self.frozen = False  # lookahead: the next step runs but its state is discarded
        self.target = rule.max_loops
        self.stop_at = rule.max_loops  # lookahead_gate: the step decided to be the last
        if rule.policy == "trace" and decode_index < len(rule.trace):
            self.target = min(max(rule.trace[decode_index], rule.min_loops), rule.max_loops)

    def wants_exit(self, r: int, signal: Signal) -> bool:
        rule = self.rule
        if rule.policy == "gate" and isinstance(signal, float | int):
            self.survival *= 1.0 - _sigmoid(signal)
            return 1.0 - self.survival >= rule.threshold  # type: ignore[operator]
        if rule.policy in ("latent_diff", "kl") and isinstance(signal, float | int):
            return signal < rule.threshold  # type: ignore[operator]
        if rule.policy == "trace":
            return r >= self.target
        return False

    def reaches_stop(self, r: int) -> bool:
        """True (and the exit depth set) if step r is the last whatever its signal says: `max_loops`,
        or the step a lookahead_gate decision made the last one step earlier."""
        if r >= self.stop_at:
            self.exit_depth = r
            return True
        return False

    def observe(self, r: int, signal: Signal) -> bool:
        """Called after a step whose state was kept. Returns True if the item runs another step.
        Raises `NonFiniteError` for a NaN or infinite signal (a broken state, not a decision)."""
        if isinstance(signal, float) and not -math.inf < signal < math.inf or (
                isinstance(signal, list | tuple) and not all(map(math.isfinite, signal))):
            raise NonFiniteError(f"the model produced a non-finite {self.rule.policy} signal for this request")
        if self.reaches_stop(r):
            return False
        if self.rule.policy == "lookahead_gate":
            if signal is not None and not isinstance(signal, float | int):
                main, ahead = signal
                self.survival *= 1.0 - _sigmoid(main)
                predicted = 1.0 - self.survival * (1.0 - _sigmoid(ahead))
                if predicted >= self.rule.threshold and r + 1 >= self.rule.min_loops:  # type: ignore[operator]
                    self.stop_at = r + 1
            return True
        exit_now = self.wants_exit(r, signal) and r >= self.rule.min_loops
        if not exit_now:
            return True
        self.exit_depth = r
        if self.rule.lookahead:
            self.frozen = True  # already scheduled for step r + 1
            return True
        return False


def _sigmoid(x: float) -> float:
    return 1.0 / (1.0 + math.exp(-x)) if x > -700 else 0.0
