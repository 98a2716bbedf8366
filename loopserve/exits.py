"""Exit policies: when a decode token stops looping (docs/design.md §3).

A request resolves its `SamplingParams` into one `ExitRule`. The engine keeps the exit state of all
in-flight decode tokens in one `ExitBook` (arrays, one entry per state-pool row) and decides a whole
core batch in one compiled pass over its rows (numba); `ExitTracker` is the same book for one item
(the reference decoder, the scorer, trajectory replay), so both decide with one piece of code.

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
import itertools
import math
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from loopserve.errors import NonFiniteError
from loopserve.jit import compiled

POLICIES = ("fixed", "gate", "latent_diff", "kl", "trace", "lookahead_gate")
DEFAULT_POLICIES = tuple(p for p in POLICIES if p != "trace")  # what a default may be (a trace is a request's own)
# the threshold a state-signal policy uses when the request gives none: the upstream recurrent-depth (Huginn) code's
# "auto" values for its latent-diff and kl criteria (the gate's is the checkpoint's: `resolve_exit_rule`)
DEFAULT_THRESHOLDS = {"latent_diff": 0.03, "kl": 5e-4}
SIGNALS = (None, "gate", "latent_diff", "kl", "lookahead_gate")  # per-step signal kinds, by code (0: none)
GATE_POLICIES = ("gate", "lookahead_gate")  # the policies that read a learned exit gate (the checkpoint's threshold)
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
        if self.threshold is None and self.policy not in GATE_POLICIES:
            return None
        return self.policy if self.policy in SIGNALS else None  # (a policy named as the signal it reads)

    @functools.cached_property
    def signal_code(self) -> int:
        """`signal` as its index in SIGNALS (0: none), as the engine's state pool stores it."""
        return SIGNALS.index(self.signal)

    @functools.cached_property
    def decides_ahead(self) -> bool:
        """True if the signal after step r first changes what happens after step r+1 (delayed
        lookahead, lookahead_gate): the engine may read it one tick late, after queueing step r+1."""
        return self.lookahead or self.policy == "lookahead_gate"

    @functools.cached_property
    def code(self) -> int:
        """The policy's index in POLICIES (how `ExitBook` stores it)."""
        return POLICIES.index(self.policy)

    @functools.cached_property
    def row(self) -> tuple[float, ...]:
        """The rule's constants as one table row (columns `ROW_*`): a batch of items is started with one
        array built from these rows, not an attribute read per item and field."""
        threshold = math.nan if self.threshold is None else self.threshold
        return tuple(float(x) for x in (self.code, threshold, self.min_loops, self.lookahead, self.max_loops,
                                        self.signal_code, self.decides_ahead))

    def target(self, decode_index: int) -> int:
        """The depth a trace rule replays for decode item `decode_index` (max_loops past the trace's end,
        and for other policies)."""
        if self.policy == "trace" and decode_index < len(self.trace):
            return min(max(self.trace[decode_index], self.min_loops), self.max_loops)
        return self.max_loops

    def new_item(self, decode_index: int) -> ExitTracker:
        return ExitTracker(self, decode_index)


class ExitBook:
    """The exit state of many work items as arrays, one entry per row (the engine: one per state-pool
    row), updated for a whole core batch at once. `ExitTracker` is a one-row view of it, so the
    reference decoder, the scorer and the engine decide with the same code on the same float64
    numbers: every operation is element-wise, so a row's decision never depends on its batch.

    Per row: the rule (`policy` code, `threshold`, `min_loops`, `lookahead`), `survival` (gate:
    prod_j (1 - lambda_j)), `exit_depth` (0 until decided), `frozen` (delayed lookahead: the next
    step runs but its state is dropped), `target` (trace) and `stop_at` (`max_loops`, or the step a
    lookahead_gate decision made the last).
    """

    def __init__(self, rows: int) -> None:
        self.policy = np.zeros(rows, np.int8)
        self.threshold = np.zeros(rows)
        self.min_loops = np.zeros(rows, np.int64)
        self.lookahead = np.zeros(rows, bool)
        self.survival = np.ones(rows)
        self.exit_depth = np.zeros(rows, np.int64)
        self.frozen = np.zeros(rows, bool)
        self.target = np.zeros(rows, np.int64)
        self.stop_at = np.zeros(rows, np.int64)
        self._generations = np.zeros(rows, np.int64)  # `observe`'s: every row's the same, none passive
        self._active = np.zeros(rows, bool)

    def start(self, rows: np.ndarray, rules: list[ExitRule] | Callable[[], list[ExitRule]],
              decode_indices: np.ndarray | list[int], table: np.ndarray | None = None,
              table_rows: np.ndarray | None = None) -> None:
        """Rows `rows` now track fresh work items under `rules` (item k fed generated token
        `decode_indices[k]`: a trace rule replays its entry); `table`: the rules' `row`s, if the
        caller has them already, row k's at `table_rows[k]` (default: k); then `rules` is read, or
        called, only if a row replays a trace."""
        if table is None:
            assert not callable(rules)
            table = rule_table(rules)
        index = np.arange(len(rows)) if table_rows is None else table_rows
        if _start_rows(rows, table, index, self.policy, self.threshold, self.min_loops, self.lookahead, self.survival,
                       self.exit_depth, self.frozen, self.target, self.stop_at):  # replayed depths: per item
            listed = rules() if callable(rules) else rules
            self.target[rows] = [rule.target(int(k)) for rule, k in zip(listed, decode_indices, strict=True)]

    def done(self, rows: np.ndarray) -> np.ndarray:
        """Mask of `rows` that decided to exit and are done looping (a frozen row still runs its
        lookahead step)."""
        return (self.exit_depth[rows] != 0) & ~self.frozen[rows]

    def observe(self, rows: np.ndarray, r: np.ndarray, main: np.ndarray, ahead: np.ndarray,
                has: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """After step r (kept) of each row: `main` is its signal (gate logit, latent difference, KL),
        `ahead` the lookahead_gate's predicted logit, `has` whether the row got a signal at all.
        Returns (loops_on, bad): masks of rows that run another step and of rows whose signal is
        NaN or infinite (a broken state, not a decision: those rows are left unchanged). A row that has
        decided already is left as it is (neither).

        One compiled pass over the rows (`_decide_rows`): as element-wise numpy operations the decision
        took a few dozen calls per batch, most of a core tick's host time."""
        n = len(rows)
        loops_on, bad, out = np.empty(n, bool), np.empty(n, bool), np.empty(n, np.int64)
        _decide_rows(rows, r, self._generations, self._generations, self._active, main, ahead, has,
                     self.policy, self.threshold, self.min_loops, self.lookahead, self.survival, self.exit_depth,
                     self.frozen, self.target, self.stop_at, loops_on, bad, out)
        return loops_on, bad

    def settle(self, rows: np.ndarray, r: np.ndarray, generations: np.ndarray, generation: np.ndarray,
               passive: np.ndarray, main: np.ndarray, ahead: np.ndarray,
               has: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """`observe` for the rows of a core step (book entries `rows` after steps `r`, signals as there) whose rule
        still reads its signal: the row holds the item that ran the step (the state pool's `generation` of it is
        still `generations`), is not `passive` and has not decided. Returns (done, bad): the batch indices, in
        order, of the rows that stop looping and of those whose signal is not finite; the same compiled pass."""
        n = len(rows)
        loops_on, bad, out = np.empty(n, bool), np.empty(n, bool), np.empty(n, np.int64)
        m, b = _decide_rows(rows, r, generations, generation, passive, main, ahead, has, self.policy, self.threshold,
                            self.min_loops, self.lookahead, self.survival, self.exit_depth, self.frozen, self.target,
                            self.stop_at, loops_on, bad, out)
        return out[:m], out[n - b:][::-1]


class ExitTracker:
    """One work item's exit rule: feed `observe(r, signal)` after step r; False means it stops
    looping. A one-row `ExitBook` (the same code the engine runs on whole batches)."""

    def __init__(self, rule: ExitRule, decode_index: int) -> None:
        self.rule = rule
        self._book = ExitBook(1)
        self._book.start(_ROW, [rule], [decode_index])

    @property
    def exit_depth(self) -> int | None:
        """The depth the item exits at, once decided."""
        return int(self._book.exit_depth[0]) or None

    @property
    def frozen(self) -> bool:
        """Delayed lookahead: the next step runs, but its state is discarded."""
        return bool(self._book.frozen[0])

    def observe(self, r: int, signal: Signal) -> bool:
        """Called after a step whose state was kept. Returns True if the item runs another step.
        Raises `NonFiniteError` for a NaN or infinite signal (a broken state, not a decision)."""
        main, ahead = (signal if isinstance(signal, list | tuple) else (signal, 0.0))
        has = np.array([signal is not None])
        loops_on, bad = self._book.observe(_ROW, np.array([r]), np.array([main if main is not None else 0.0], float),
                                           np.array([ahead], float), has)
        if bad[0]:
            raise NonFiniteError(f"the model produced a non-finite {self.rule.policy} signal for this request")
        return bool(loops_on[0])


_ROW = np.zeros(1, np.int64)
# columns of `ExitRule.row`
ROW_POLICY, ROW_THRESHOLD, ROW_MIN_LOOPS, ROW_LOOKAHEAD, ROW_MAX_LOOPS, ROW_SIGNAL, ROW_DECIDES_AHEAD = range(7)
RULE_WIDTH = 7


def rule_table(rules: list[ExitRule]) -> np.ndarray:
    """The rules' `row`s as a float64 array [len(rules), RULE_WIDTH], in one pass (no array per rule)."""
    return np.fromiter(itertools.chain.from_iterable(rule.row for rule in rules), np.float64,
                       len(rules) * RULE_WIDTH).reshape(len(rules), RULE_WIDTH)


_GATE, _LATENT_DIFF, _KL, _TRACE, _LOOKAHEAD_GATE = (POLICIES.index(p) for p in
                                                     ("gate", "latent_diff", "kl", "trace", "lookahead_gate"))


@compiled
def _sigmoid(x):
    """In float64 with the C library's exp (numpy's vectorized exp differs from it in the last bit for a
    few % of arguments, which ones by the CPU's vector unit): 0 at or below -700, where exp(-x) would
    overflow."""
    return 1.0 / (1.0 + math.exp(-x)) if x > -700.0 else 0.0


@compiled
def _decide_rows(rows, r, generations, generation, passive, main, ahead, has, policy, threshold, min_loops, lookahead,
                 survival, exit_depth, frozen, target, stop_at, loops_on, bad, out):
    """Row k = 0.. of a batch (book entry rows[k], distinct: a batch never holds a row twice) after its step r[k]
    reads its signal, unless the entry no longer holds the item that ran the step (generation[i] !=
    generations[k]), is passive, or has decided already: writes loops_on[k] and bad[k] (both False for a row
    skipped), and the batch indices of the rows done looping to out[:m], of those whose signal is not finite to
    out[n - b:] (last first). Returns (m, b). Each row reads and writes only its own entry: a row's decision
    never depends on its batch. (One body for `ExitBook.observe` and `settle`: a helper called per row with these
    arrays, inlined or not, made a 256-row batch 6x slower, most likely numba's reference counts of its array
    arguments per call.)"""
    n = rows.shape[0]
    m = b = 0
    for k in range(n):
        i, rk = rows[k], r[k]
        loops_on[k] = bad[k] = False
        if generation[i] != generations[k] or passive[i] or exit_depth[i] != 0:
            continue
        p = policy[i]
        lag = p == _LOOKAHEAD_GATE
        if (has[k] and not np.isfinite(main[k])) or (lag and not np.isfinite(ahead[k])):
            bad[k] = True
            b += 1
            out[n - b] = k
            continue
        if rk >= stop_at[i]:
            exit_depth[i] = rk
            out[m] = k
            m += 1
            continue
        want = False
        if has[k] and (p == _GATE or lag):
            survival[i] *= 1.0 - _sigmoid(main[k])
            want = 1.0 - survival[i] >= threshold[i]
            if lag:  # lookahead_gate: decide whether step r+1 is the last; it never exits on this step's signal
                predicted = 1.0 - survival[i] * (1.0 - _sigmoid(ahead[k]))
                if predicted >= threshold[i] and rk + 1 >= min_loops[i]:
                    stop_at[i] = rk + 1
                want = False
        elif has[k] and (p == _LATENT_DIFF or p == _KL):
            want = main[k] < threshold[i]
        elif p == _TRACE:
            want = rk >= target[i]
        loops_on[k] = True
        if want and rk >= min_loops[i]:
            exit_depth[i] = rk
            if lookahead[i]:
                frozen[i] = True  # already scheduled for step r + 1
            else:
                loops_on[k] = False
                out[m] = k
                m += 1
    return m, b


@compiled
def _start_rows(rows, table, index, policy, threshold, min_loops, lookahead, survival, exit_depth, frozen, target,
                stop_at):
    """`ExitBook.start` for row k of a batch (book entry rows[k]) under table row index[k]; returns whether any
    row replays a trace."""
    trace = False
    for k in range(rows.shape[0]):
        i, rule = rows[k], table[index[k]]
        policy[i] = np.int8(rule[ROW_POLICY])
        threshold[i] = rule[ROW_THRESHOLD]
        min_loops[i] = np.int64(rule[ROW_MIN_LOOPS])
        lookahead[i] = rule[ROW_LOOKAHEAD] != 0
        survival[i] = 1.0
        exit_depth[i] = 0
        frozen[i] = False
        stop_at[i] = target[i] = np.int64(rule[ROW_MAX_LOOPS])
        trace = trace or policy[i] == _TRACE
    return trace
