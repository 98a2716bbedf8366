"""Model runner: executes one homogeneous stage batch. Gathers state-pool rows, builds the
attention context from the block tables, runs the model stage, scatters results back.

The runner makes no scheduling decisions; it returns raw results (exit signals, sampled tokens) and
the scheduler decides what they mean.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from loopserve.cache.layout import IN_FLIGHT, KVLayout
from loopserve.cache.manager import KVCacheManager
from loopserve.device import Readback, upload
from loopserve.engine.sampler import Sample, sample_rows, unpack
from loopserve.engine.sequence import Sequence
from loopserve.engine.signals import step_signals, uniform_logprobs
from loopserve.exits import ExitTracker, Signal
from loopserve.models.base import LoopedLM
from loopserve.models.context import ForwardContext, paged_context


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
    parity: int = 0  # which of its state pool row's two buffers holds the current state
    position: int = -1  # of the token it computes: fixed for its life (the next token comes after it)

    def __post_init__(self) -> None:
        self.position = self.seq.num_tokens - 1

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
    """Preallocated hidden-state rows for in-flight decode tokens (plus Huginn's injection e).

    Every row has two state buffers: a core step reads the item's current buffer (`WorkItem.parity`)
    and writes the other one, and the scheduler flips the parity when it keeps the step. Dropping a
    step (delayed lookahead) is then just not flipping, so a step can be queued on the device before
    the decision that drops it has been read back.
    """

    def __init__(self, rows: int, hidden: int, dtype: torch.dtype, device, with_inject: bool) -> None:
        self.rows = rows
        self.state = torch.zeros(2 * rows, hidden, dtype=dtype, device=device)  # buffer b of row i: b*rows+i
        self.inject = torch.zeros(rows, hidden, dtype=dtype, device=device) if with_inject else None
        self._free = list(range(rows - 1, -1, -1))

    @property
    def num_free(self) -> int:
        return len(self._free)

    def allocate(self) -> int:
        return self._free.pop()

    def release(self, row: int) -> None:
        self._free.append(row)

    def index(self, row: int, parity: int) -> int:
        return parity * self.rows + row


class PendingSignals:
    """The exit signals of one core step, still on their way back from the device."""

    def __init__(self, n: int, kinds: list[tuple[int, str]], readback: Readback | None) -> None:
        self.n, self._kinds, self._readback = n, kinds, readback  # (row in the batch, signal kind)

    def get(self) -> list[Signal]:
        """One signal per batch row (None where the row's rule needs none); waits for the copy."""
        out: list[Signal] = [None] * self.n
        if self._readback is None:
            return out
        values = self._readback.get()
        kl = 0
        for i, kind in self._kinds:
            if kind == "kl":  # computed for the KL rows only, in order
                out[i], kl = values["kl"][kl], kl + 1
            else:
                out[i] = values[kind][i]
        return out


class PendingSamples:
    """The tokens a stage batch sampled on the device, on their way to the host (already there when
    the batched sampler fell back to sampling row by row)."""

    def __init__(self, seqs: list[Sequence], logits: torch.Tensor) -> None:
        self._params = [s.params for s in seqs]
        result = sample_rows(logits, self._params, [s.seed for s in seqs], [len(s.output_ids) for s in seqs])
        self._readback = Readback(result) if isinstance(result, dict) else None
        self._rows = None if isinstance(result, dict) else result

    def get(self) -> list[Sample]:
        if self._rows is None:
            assert self._readback is not None
            self._rows = unpack(self._readback.host(), self._params)
        return self._rows


class ModelRunner:
    def __init__(self, model: LoopedLM, layout: KVLayout, kv: KVCacheManager, pool: StatePool,
                 scratch_row: int) -> None:
        self.model, self.layout, self.kv, self.pool = model, layout, kv, pool
        self.scratch_row = scratch_row
        p = next(model.parameters())
        self.device, self.dtype = p.device, p.dtype
        self.has_coda_kv = model.config.n_coda > 0

    def _ctx(self, items: list[WorkItem], depth: list[int] | None = None,
             write_rows: list[int] | None = None) -> ForwardContext:
        segs = [(self.kv.slot(it.seq.request_id), it.position, 1) for it in items]
        return paged_context(self.kv.store, self.layout, self.kv.block_tables, segs, depth, write_rows)

    def _state_index(self, items: list[WorkItem], flip: bool = False) -> torch.Tensor:
        return upload([self.pool.index(it.row, it.parity ^ flip) for it in items], self.device)

    # -- stages --------------------------------------------------------------------------------------
    @torch.no_grad()
    def prefill(self, chunks: list[PrefillChunk]) -> dict[str, Sample]:
        """Run chunks through prelude, every loop up to their max_loops, and the coda where needed.

        Returns the first generated token (`Sample`) of each sequence whose prompt is now complete.
        """
        model, dev = self.model, self.device
        ctx = paged_context(self.kv.store, self.layout, self.kv.block_tables,
                            [(self.kv.slot(c.seq.request_id), c.start, c.n) for c in chunks])
        ids = upload([t for c in chunks for t in c.seq.prompt_ids[c.start:c.start + c.n]], dev)
        seeds = [c.seq.state_seed(p) for c in chunks for p in range(c.start, c.start + c.n)]
        self.kv.store.set_depth(ctx.write_rows, IN_FLIGHT)
        state, inject = model.prelude(ids, ctx, seeds)
        loops = [c.seq.rule.max_loops for c in chunks for _ in range(c.n)]
        for r in range(1, max(loops) + 1):
            active = [i for i, m in enumerate(loops) if m >= r]
            if len(active) == len(loops):
                state = model.core_step(state, inject, ctx.with_depth(torch.full_like(ctx.depth, r)))
            else:  # whole chunks drop out (a chunk's rows share one request's max_loops)
                sub = ctx.select(active)
                sub = sub.with_depth(torch.full_like(sub.depth, r))
                idx = upload(active, dev)
                state[idx] = model.core_step(state[idx], None if inject is None else inject[idx], sub)
        self.kv.store.set_depth(ctx.write_rows, upload(loops, dev))
        last = [i for i, c in enumerate(chunks) if c.last]
        logit_rows = [ctx.seg_starts[i + 1] - 1 for i in last]
        if self.has_coda_kv:
            logits = model.coda(state, ctx, upload(logit_rows, dev))
        elif last:
            logits = model.coda(state[upload(logit_rows, dev)], ctx.select(logit_rows))
        if not last:
            return {}
        samples = PendingSamples([chunks[i].seq for i in last], logits).get()  # one readback for the batch
        return {chunks[i].seq.request_id: samples[j] for j, i in enumerate(last)}

    @torch.no_grad()
    def prelude(self, items: list[WorkItem]) -> None:
        ctx = self._ctx(items)
        self.kv.store.set_depth(ctx.write_rows, IN_FLIGHT)
        ids = upload([it.seq.output_ids[-1] for it in items], self.device)
        state, inject = self.model.prelude(ids, ctx, [it.seq.state_seed(it.position) for it in items])
        self.pool.state[self._state_index(items)] = state
        if inject is not None and self.pool.inject is not None:
            self.pool.inject[upload([it.row for it in items], self.device)] = inject

    @torch.no_grad()
    def core(self, items: list[WorkItem], kinds: set[str]) -> PendingSignals:
        """Queue one loop step for every item (each at its own depth r+1); its exit signals come back
        as `PendingSignals`, which the engine reads when it needs them (with lookahead: a tick later).

        Each item reads its current state buffer and writes the other one (see `StatePool`).
        Passive rows (CB) write their KV to a scratch row and report no signal.
        """
        writes = None
        if any(it.passive for it in items):
            writes = [self.scratch_row if it.passive else self.kv.row(it.seq.request_id, it.position)
                      for it in items]
        ctx = self._ctx(items, [it.r + 1 for it in items], writes)
        prev = self.pool.state[self._state_index(items)]
        inject = None
        if self.pool.inject is not None:
            inject = self.pool.inject[upload([it.row for it in items], self.device)]
        new = self.model.core_step(prev, inject, ctx)
        self.pool.state[self._state_index(items, flip=True)] = new
        rows = [(i, it.seq.rule.signal) for i, it in enumerate(items) if not it.passive and it.seq.rule.signal]
        if not kinds or not rows:
            return PendingSignals(len(items), [], None)
        kl_rows = [i for i, kind in rows if kind == "kl"]
        prev_lp = None
        if kl_rows:
            vocab = self.model.config.vocab_size
            uniform = uniform_logprobs(1, vocab, torch.float64, self.device)[0]
            prevs: list[torch.Tensor] = []
            for i in kl_rows:
                lp_i = items[i].prev_logprobs
                prevs.append(uniform if lp_i is None else lp_i)
            prev_lp = torch.stack(prevs)
        sig, lp = step_signals(self.model, kinds, prev, new, ctx, prev_lp, kl_rows or None)
        for j, i in enumerate(kl_rows):
            items[i].prev_logprobs = lp[j] if lp is not None else None
        return PendingSignals(len(items), rows, Readback(sig))

    @torch.no_grad()
    def coda(self, items: list[WorkItem]) -> PendingSamples:
        """The exited items' next tokens, sampled on the device, on their way to the host in one copy."""
        ctx = self._ctx(items)
        logits = self.model.coda(self.pool.state[self._state_index(items)], ctx)
        return PendingSamples([it.seq for it in items], logits)

    @torch.no_grad()
    def write_kv_depths(self, rows: list[int], depths: list[int]) -> None:
        """Record the KV depth of tokens that exited (batched: one small upload per tick)."""
        self.kv.store.set_depth(upload(rows, self.device), upload(depths, self.device))
