"""Teacher-forced scoring with the engine's decode semantics (early exit, KV layouts, lookahead).

`score_windows` runs many equal-length windows side by side, each as its own request: the first
`prompt_len` tokens are prefilled at full depth (prompt tokens never exit early), then every later
position is a decode work item fed the *true* token (teacher forcing) instead of a sampled one.
Each item loops through the core until its exit rule says stop, its next-token distribution is
read at its exit depth, and its KV depth is recorded so later tokens read KV by the layout's rule.

This module owns only that teacher-forcing loop. Everything it computes with is the engine's: the
model's own `prelude` / `core_step` / `coda` (`models/*`), paged attention over a `KVStore` whose
slots and read rule come from `KVLayout` (`cache/layout.py`, the single home of the read rule), the
exit signals of `engine/signals.py` and the `ExitTracker` of `exits.py`. It is the reference
decoder's loop (`engine/reference.py`, docs/design.md §5.1-5.2), batched over windows: each window is
one block table of block size 1 over its own KV rows, so the batching does not change what any
window computes. `tests/test_train.py` pins it to the reference decoder (logprobs and exit depths,
every layout, with and without lookahead).

Exit modes:
- `fixed` (depth d): every item runs d loops.
- `gate`: Ouro's Q-exit on the main gate (CDF after step r >= q).
- `gate` + `lookahead=True`: the engine's delayed lookahead (decision after r, step r + 1
  still runs and is discarded; exit depth r, KV depth r + 1).
- `lookahead_gate`: the distilled head predicts, from the state after step r, the main gate's
  logit after step r + 1. With the main gate's hazards lambda_1..lambda_r and the predicted
  lambda_{r+1}, the item decides after step r whether step r + 1 is its last:
  1 - prod_{j<=r}(1 - lambda_j) * (1 - lambda_hat_{r+1}) >= q. It then runs step r + 1 and exits at
  depth r + 1 with that step's state, so no loop is wasted and batch r + 2 is known one step early
  (earliest exit: depth 2).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from loopserve.cache.block_table import BlockTables
from loopserve.cache.layout import KVLayout
from loopserve.cache.pool import KVStore
from loopserve.engine.signals import step_signals
from loopserve.exits import ExitRule, ExitTracker
from loopserve.models.base import LoopedLM
from loopserve.models.context import paged_context

MODES = ("fixed", "gate", "lookahead_gate")


@dataclass
class ScoreResult:
    logprobs: torch.Tensor  # [W, S - prompt_len - 1] float64: log p(true next token) of each decode item
    depths: torch.Tensor  # [W, S - prompt_len - 1] exit depth of each decode item
    loops: torch.Tensor  # [W, S - prompt_len - 1] loops run (delayed lookahead: depth + 1 on early exits)

    @property
    def nll(self) -> float:
        return float(-self.logprobs.mean())

    @property
    def ppl(self) -> float:
        return math.exp(self.nll)

    @property
    def mean_depth(self) -> float:
        return float(self.depths.double().mean())

    @property
    def mean_loops(self) -> float:
        return float(self.loops.double().mean())

    def summary(self) -> dict:
        n = self.depths.numel()
        hist = [int((self.depths == d).sum()) for d in range(1, int(self.depths.max()) + 1)]
        return {"ppl": self.ppl, "nll": self.nll, "mean_depth": self.mean_depth, "mean_loops": self.mean_loops,
                "tokens": n, "depth_hist": hist}


def _make_tracker(mode: str, threshold: float | None, max_loops: int, min_loops: int, lookahead: bool):
    if mode == "fixed":
        return ExitTracker(ExitRule("fixed", None, min_loops, max_loops), 0)
    if mode == "gate":
        return ExitTracker(ExitRule("gate", threshold, min_loops, max_loops, (), lookahead), 0)
    if mode == "lookahead_gate":
        return ExitTracker(ExitRule("lookahead_gate", threshold, max(min_loops, 2), max_loops), 0)
    raise ValueError(f"mode: expected one of {MODES}, got {mode!r}")


@torch.no_grad()
def score_windows(model: LoopedLM, wins: torch.Tensor, layout: str = "depth_indexed", mode: str = "gate",
                  threshold: float | None = None, depth: int | None = None, prompt_len: int = 1,
                  lookahead: bool = False, min_loops: int = 1) -> ScoreResult:
    """Teacher-forced scoring of `wins` [W, S] (see the module docstring).

    `depth`: the fixed depth (mode "fixed") or max_loops (default r_max). `threshold`: the gate's
    q (modes "gate" and "lookahead_gate"; default the config's `early_exit_threshold`).
    `lookahead`: the engine's delayed lookahead (mode "gate" only). The prompt is prefilled token by
    token at full depth. That equals the engine's one-chunk prefill for `depth_indexed` and
    `last_exited` at any prompt length, and for `shared` with `prompt_len=1` (the default); with a
    longer prompt, `shared` chunk tokens would see each other's same-depth KV instead. The model's
    prelude gets no per-row state seeds, so a Huginn checkpoint with a random (like-init) loop state
    is refused by its prelude; the gate modes need a learned exit gate (Ouro).
    """
    c = model.config
    param = next(model.parameters())
    dev, dtype = param.device, param.dtype
    max_loops = depth or c.r_max
    if mode != "fixed" and threshold is None:
        threshold = c.exit_threshold or 1.0
    if mode == "lookahead_gate" and not model.has_lookahead_gate:
        raise ValueError("mode 'lookahead_gate' needs a checkpoint with lookahead_gate.* tensors")
    n_win, seq = wins.shape
    if not 1 <= prompt_len < seq - 1:
        raise ValueError(f"prompt_len must be in [1, {seq - 2}], got {prompt_len}")
    kv_layout = KVLayout(layout, c.n_prelude, c.n_core, c.n_coda, c.r_max)
    kv = KVStore(n_win * seq, kv_layout.slots_per_token, c.num_kv_heads, c.head_dim, dtype, dev)
    # window w owns KV rows w * seq .. (w + 1) * seq - 1: a block table of block size 1 per window
    tables = BlockTables.from_row_maps([torch.arange(w * seq, (w + 1) * seq) for w in range(n_win)], dev)
    wins = wins.to(dev)
    n_items = seq - prompt_len - 1
    out_lp = torch.empty(n_win, n_items, dtype=torch.float64)
    out_depth = torch.empty(n_win, n_items, dtype=torch.long)
    out_loops = torch.empty(n_win, n_items, dtype=torch.long)
    for pos in range(seq - 1):
        prompt = pos < prompt_len
        item_mode = "fixed" if prompt else mode
        trackers = [_make_tracker(item_mode, threshold, max_loops, min_loops, lookahead) for _ in range(n_win)]
        kind = trackers[0].rule.signal
        ctx = paged_context(kv, kv_layout, tables, [(w, pos, 1) for w in range(n_win)])
        state, inject = model.prelude(wins[:, pos], ctx)
        final = torch.empty_like(state)
        loops = [0] * n_win
        active = list(range(n_win))
        sub, idx = ctx, None  # the active windows' context (rebuilt when some stop looping) and rows
        r = 0
        while active:
            r += 1
            x = state if idx is None else state[idx]
            inj = inject if inject is None or idx is None else inject[idx]
            new = model.core_step(x, inj, sub.with_depth(torch.full((len(active),), r, device=dev)))
            sig, _ = step_signals(model, {kind} if kind else set(), x, new, sub, None, None)
            values = sig[kind].tolist() if kind else [None] * len(active)
            still = []
            for j, w in enumerate(active):
                t = trackers[w]
                loops[w] = r
                if t.frozen:  # delayed lookahead: this step ran, its state is discarded
                    final[w] = state[w]
                    continue
                state[w] = new[j]
                if t.observe(r, values[j]):
                    still.append(w)
                else:
                    final[w] = new[j]
            if still and len(still) < len(active):
                sub = paged_context(kv, kv_layout, tables, [(w, pos, 1) for w in still])
                idx = torch.tensor(still, device=dev)
            active = still
        kv.set_depth(ctx.write_rows, torch.tensor(loops, device=dev))
        logits = model.coda(final, ctx)  # also writes any coda KV, as the reference decoder does
        k = pos - prompt_len
        if k < 0:
            continue  # the prompt's own predictions (full depth) are not scored
        lp = torch.log_softmax(logits.to(torch.float64), -1)
        out_lp[:, k] = lp.gather(1, wins[:, pos + 1, None])[:, 0].cpu()
        out_depth[:, k] = torch.tensor([t.exit_depth or loops[w] for w, t in enumerate(trackers)])
        out_loops[:, k] = torch.tensor(loops)
    return ScoreResult(out_lp, out_depth, out_loops)
