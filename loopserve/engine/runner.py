"""Model runner: executes one homogeneous stage batch. Gathers state-pool rows, builds the
attention context from block tables, runs the model stage, scatters results back.

The runner makes no scheduling decisions; it returns raw results (signals, logits) and the
scheduler decides what they mean.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from loopserve.cache.layout import IN_FLIGHT, KVLayout
from loopserve.cache.manager import KVCacheManager
from loopserve.engine.sequence import Sequence
from loopserve.engine.signals import step_signals, uniform_logprobs
from loopserve.exits import ExitTracker, Signal
from loopserve.models.base import LoopedLM
from loopserve.models.context import ForwardContext, build_context


@dataclass(eq=False)
class WorkItem:
    """One decode token travelling PRELUDE -> CORE (x loops) -> CODA."""

    seq: Sequence
    order: int  # creation counter: FIFO among items
    row: int = -1  # state pool row, -1 until the prelude ran
    r: int = 0  # loop steps run
    tracker: ExitTracker | None = None
    passive: bool = False  # CB: exited, still computed with the cohort, results discarded
    prev_logprobs: torch.Tensor | None = None  # KL policy: last step's next-token log-probs

    @property
    def position(self) -> int:
        return self.seq.num_tokens - 1

    @property
    def exited(self) -> bool:
        return self.tracker is not None and self.tracker.exit_depth is not None and not self.tracker.frozen


@dataclass
class PrefillChunk:
    seq: Sequence
    start: int
    n: int

    @property
    def last(self) -> bool:
        return self.start + self.n == len(self.seq.prompt_ids)


class StatePool:
    """Preallocated hidden-state rows for in-flight decode tokens (plus Huginn's injection e)."""

    def __init__(self, rows: int, hidden: int, dtype: torch.dtype, device, with_inject: bool) -> None:
        self.state = torch.zeros(rows, hidden, dtype=dtype, device=device)
        self.inject = torch.zeros(rows, hidden, dtype=dtype, device=device) if with_inject else None
        self._free = list(range(rows - 1, -1, -1))

    @property
    def num_free(self) -> int:
        return len(self._free)

    def allocate(self) -> int:
        return self._free.pop()

    def release(self, row: int) -> None:
        self._free.append(row)


@dataclass
class CoreResult:
    signals: list[Signal] = field(default_factory=list)


class ModelRunner:
    def __init__(self, model: LoopedLM, layout: KVLayout, kv: KVCacheManager, pool: StatePool,
                 scratch_row: int) -> None:
        self.model, self.layout, self.kv, self.pool = model, layout, kv, pool
        self.scratch_row = scratch_row
        p = next(model.parameters())
        self.device, self.dtype = p.device, p.dtype
        self.has_coda_kv = model.config.n_coda > 0

    def _ctx(self, items: list[WorkItem], depth: list[int] | None = None) -> ForwardContext:
        segs = [(self.kv.row_map(it.seq.request_id), it.position, 1) for it in items]
        d = torch.tensor(depth) if depth is not None else None
        return build_context(self.kv.store, self.layout, segs, d)

    # -- stages --------------------------------------------------------------------------------------
    @torch.no_grad()
    def prefill(self, chunks: list[PrefillChunk]) -> dict[str, torch.Tensor]:
        """Run chunks through prelude, every loop up to their max_loops, and the coda where needed.

        Returns the last-position logits of each sequence whose prompt is now complete.
        """
        model, dev = self.model, self.device
        ctx = build_context(self.kv.store, self.layout,
                            [(self.kv.row_map(c.seq.request_id), c.start, c.n) for c in chunks])
        ids = torch.tensor([t for c in chunks for t in c.seq.prompt_ids[c.start:c.start + c.n]], device=dev)
        seeds = [c.seq.state_seed(p) for c in chunks for p in range(c.start, c.start + c.n)]
        self.kv.store.set_depth(ctx.write_rows, IN_FLIGHT)
        state, inject = model.prelude(ids, ctx, seeds)
        max_loops = torch.tensor([c.seq.rule.max_loops for c in chunks for _ in range(c.n)], device=dev)
        for r in range(1, int(max_loops.max()) + 1):
            active = (max_loops >= r).nonzero()[:, 0]
            if len(active) == len(max_loops):
                state = model.core_step(state, inject, ctx.with_depth(torch.full_like(max_loops, r)))
            else:
                sub = ctx.select(active).with_depth(torch.full_like(active, r))
                state[active] = model.core_step(state[active], None if inject is None else inject[active], sub)
        self.kv.store.set_depth(ctx.write_rows, max_loops)
        ends = torch.tensor(ctx.seg_starts[1:]) - 1
        last = [i for i, c in enumerate(chunks) if c.last]
        logit_rows = ends[last]
        if self.has_coda_kv:
            logits = model.coda(state, ctx, logit_rows)
        elif last:
            logits = model.coda(state[logit_rows], ctx.select(logit_rows))
        return {chunks[i].seq.request_id: logits[j] for j, i in enumerate(last)}

    @torch.no_grad()
    def prelude(self, items: list[WorkItem]) -> None:
        ctx = self._ctx(items)
        self.kv.store.set_depth(ctx.write_rows, IN_FLIGHT)
        ids = torch.tensor([it.seq.output_ids[-1] for it in items], device=self.device)
        state, inject = self.model.prelude(ids, ctx, [it.seq.state_seed(it.position) for it in items])
        rows = torch.tensor([it.row for it in items], device=self.device)
        self.pool.state[rows] = state
        if inject is not None and self.pool.inject is not None:
            self.pool.inject[rows] = inject

    @torch.no_grad()
    def core(self, items: list[WorkItem], kinds: set[str]) -> list[Signal]:
        """One loop step for every item (each at its own depth r+1). Returns each item's signal.

        Passive rows (CB) write their KV to a scratch row and keep no state; frozen rows
        (lookahead) write KV but keep their previous state.
        """
        ctx = self._ctx(items, [it.r + 1 for it in items])
        passive = [i for i, it in enumerate(items) if it.passive]
        if passive:
            ctx.write_rows[passive] = self.scratch_row
        rows = torch.tensor([it.row for it in items], device=self.device)
        prev = self.pool.state[rows]
        inject = self.pool.inject[rows] if self.pool.inject is not None else None
        new = self.model.core_step(prev, inject, ctx)
        keep = [i for i, it in enumerate(items) if not it.passive and not it.tracker.frozen]  # type: ignore[union-attr]
        if keep:
            self.pool.state[rows[keep]] = new[keep]
        signals: list[Signal] = [None] * len(items)
        if not kinds or not keep:
            return signals
        kl_rows = [i for i in keep if items[i].seq.rule.signal == "kl"]
        prev_lp = None
        if kl_rows:
            vocab = self.model.config.vocab_size
            uniform = uniform_logprobs(1, vocab, torch.float64, self.device)[0]
            prevs: list[torch.Tensor] = []
            for i in kl_rows:
                lp_i = items[i].prev_logprobs
                prevs.append(uniform if lp_i is None else lp_i)
            prev_lp = torch.stack(prevs)
        sig, lp = step_signals(self.model, kinds, prev, new, ctx, prev_lp,
                               torch.tensor(kl_rows) if kl_rows else None)
        values = {k: v.tolist() for k, v in sig.items()}
        for i in keep:
            kind = items[i].seq.rule.signal
            if kind is not None and kind != "kl":
                signals[i] = values[kind][i]
        for j, i in enumerate(kl_rows):
            signals[i] = values["kl"][j]
            items[i].prev_logprobs = lp[j] if lp is not None else None
        return signals

    @torch.no_grad()
    def coda(self, items: list[WorkItem]) -> torch.Tensor:
        ctx = self._ctx(items)
        rows = torch.tensor([it.row for it in items], device=self.device)
        return self.model.coda(self.pool.state[rows], ctx)
