"""Model runner: executes one homogeneous stage batch. Gathers state-pool rows, builds the
attention context from the block tables, runs the model stage, scatters results back.

The runner makes no scheduling decisions; it returns raw results (exit signals, sampled tokens) and
the scheduler decides what they mean. It is called inside `LLMEngine.step`, which runs without autograd
(one `no_grad` per tick, not one per stage call: each costs a few µs on the CPU).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, NamedTuple

import numpy as np
import torch

from loopserve.cache.layout import IN_FLIGHT, KVLayout
from loopserve.cache.manager import KVCacheManager
from loopserve.device import Readback, upload
from loopserve.engine.graphs import (
    DEPTH,
    KV_WRITE,
    PACKED_ROWS,
    POOL_ROW,
    POSITION,
    SEED,
    SLOT,
    STATE_READ,
    STATE_WRITE,
    TOKEN,
    StageGraphs,
)
from loopserve.engine.held_tokens import HeldTokens
from loopserve.engine.sampler import (
    GREEDY,
    SampledBatch,
    adjust_logits,
    argmax_rows,
    finite_rows,
    prompt_logprobs,
    sample_rows,
)
from loopserve.engine.sequence import Sequence, chain_seed
from loopserve.engine.signals import step_signals, uniform_logprobs
from loopserve.engine.slot_facts import SlotFacts
from loopserve.exits import (
    ROW_DECIDES_AHEAD,
    ROW_SIGNAL,
    RULE_WIDTH,
    SIGNALS,
    ExitBook,
    Signal,
)
from loopserve.jit import compiled
from loopserve.models import rope_pass
from loopserve.models.base import LoopedLM
from loopserve.models.context import ForwardContext, decode_context, packed_decode_context, paged_context

if TYPE_CHECKING:
    from loopserve.engine.speculative import VerifyGroup
    from loopserve.sampling_params import SamplingParams


class WorkItem:
    """One decode token travelling PRELUDE -> CORE (x loops) -> CODA. While it holds a state-pool row
    its state lives in the pool's arrays at that row: its loop state (steps run, parity, exit state), so a
    core batch is advanced and decided with array operations (see `StatePool`), and the token it is fed,
    its position and its creation order. A plain item keeps its row from one token to the next while its
    tokens need nothing but recording (`StatePool.requeue`); the attributes hold those three while it has
    no row."""

    __slots__ = ("seq", "pool", "row", "prev_logprobs", "group", "slot", "_order", "_position", "_token")

    def __init__(self, seq: Sequence, order: int, pool: StatePool, position: int = -1,
                 group: VerifyGroup | None = None, slot: int = -1, token: int = -1) -> None:
        self.seq, self.pool, self.group = seq, pool, group
        self.row = -1  # state pool row, -1 until its first prelude is planned
        self.prev_logprobs: torch.Tensor | None = None  # KL policy: last step's next-token log-probs
        self.slot = slot  # its sequence's block-table slot (fixed while the sequence is resident, swapped out too)
        self._order = order  # creation counter: FIFO among items
        # the token it computes (fixed until its coda is read) is at `position`; it is fed the one there: its
        # sequence's last one, or its verify group's (a draft)
        self._position = seq.num_tokens - 1 if position < 0 else position
        self._token = token if token >= 0 else (
            seq.output_ids[-1] if group is None else group.token_at(self._position))

    @property
    def order(self) -> int:
        return int(self.pool.order[self.row]) if self.row >= 0 else self._order

    @property
    def position(self) -> int:
        return int(self.pool.position[self.row]) if self.row >= 0 else self._position

    @property
    def token(self) -> int:
        return int(self.pool.token[self.row]) if self.row >= 0 else self._token

    def reuse(self, order: int, position: int, token: int) -> WorkItem:
        """This plain item, without a row, as the item of its sequence's next token, `token` at `position`
        (nothing of the last token is left in it; a new object per token was a cost per row)."""
        assert self.row < 0 and self.group is None
        self._order, self._position, self._token, self.prev_logprobs = order, position, token, None
        return self

    def state_seed(self) -> int:
        return self.seq.state_seed(self.position) if self.group is None else self.group.state_seed(self.position)

    @property
    def r(self) -> int:
        """Loop steps run (0 before the prelude)."""
        return int(self.pool.r[self.row]) if self.row >= 0 else 0

    @property
    def exit_depth(self) -> int | None:
        return int(self.pool.exits.exit_depth[self.row]) or None if self.row >= 0 else None

    @property
    def exited(self) -> bool:
        """Decided to exit and done looping (a frozen item still runs its lookahead step)."""
        return self.row >= 0 and bool(self.pool.exits.done(np.array([self.row]))[0])

    @property
    def passive(self) -> bool:
        return self.row >= 0 and bool(self.pool.passive[self.row])


@dataclass
class PrefillChunk:
    seq: Sequence
    start: int
    n: int

    @property
    def last(self) -> bool:
        return self.start + self.n == len(self.seq.prompt_ids)


_GATE, _LATENT_DIFF, _LOOKAHEAD_GATE, _KL = (SIGNALS.index(kind) for kind in ("gate", "latent_diff", "lookahead_gate",
                                                                              "kl"))


def rows_of(items: list[WorkItem]) -> np.ndarray:
    """The state-pool rows of `items`, in batch order."""
    return np.fromiter((it.row for it in items), np.int64, len(items))


class StatePool:
    """The in-flight decode tokens, one row each: preallocated hidden-state rows on the device (plus
    Huginn's injection e) and, on the host, each row's loop state as arrays indexed by row (where its
    KV lives, steps run, parity, its rule's signal, its `ExitBook` entry), so a core step's batch is
    built, advanced and decided with array operations instead of a Python loop over its items.

    Every row has two state buffers: a core step reads the item's current buffer (`parity`) and
    writes the other one, and the scheduler flips the parity when it keeps the step. Dropping a step
    (delayed lookahead) is then just not flipping, so a step can be queued on the device before the
    decision that drops it has been read back. `generation` counts a row's allocations, so results
    read a tick late are matched to the item that was in the row when they were computed.
    """

    def __init__(self, rows: int, hidden: int, dtype: torch.dtype, device, with_inject: bool) -> None:
        self.rows = rows
        # buffer b of row i: b*rows+i; then a scratch row, which a padded (graphed) step's padding rows write
        self.state = torch.zeros(2 * rows + 1, hidden, dtype=dtype, device=device)
        self.scratch_state = 2 * rows
        # Huginn's injection e, a row per pool row, then a scratch row (as the states')
        self.inject = torch.zeros(rows + 1, hidden, dtype=dtype, device=device) if with_inject else None
        self.scratch_inject = rows
        self._free = list(range(rows - 1, -1, -1))
        self._marks = np.zeros(rows, bool)  # `without`'s scratch (all False between calls)
        self.items: list[WorkItem | None] = [None] * rows
        self.generation = np.zeros(rows, np.int64)
        self.order = np.zeros(rows, np.int64)  # the item's creation counter (queues keep creation order)
        self.kv_slot = np.zeros(rows, np.int64)  # the token's sequence's block-table slot
        self.position = np.zeros(rows, np.int64)
        self.token = np.zeros(rows, np.int64)  # the token the item is fed (at `position`)
        self.decode_index = np.zeros(rows, np.int64)  # of the generated token the item is fed (from its prelude)
        self.kv_row = np.zeros(rows, np.int64)  # physical KV row of the token
        self.r = np.zeros(rows, np.int64)  # loop steps run
        self.parity = np.zeros(rows, np.int64)
        self.passive = np.zeros(rows, bool)  # CB: exited, still computed with its cohort, results discarded
        self.signal = np.zeros(rows, np.int8)  # code in SIGNALS of the signal its rule needs
        self.decides_ahead = np.zeros(rows, bool)  # its rule acts on a step's signal one step later
        self.exits = ExitBook(rows)
        self.sequences = SlotFacts(rows)  # by block-table slot: what the rows' sequences never change
        self.held = HeldTokens(rows)  # by block-table slot: quiet tokens not yet in their sequences' lists

    @property
    def num_free(self) -> int:
        return len(self._free)

    def allocate(self, items: list[WorkItem], rows: np.ndarray, kv_slots: np.ndarray, positions: np.ndarray,
                 kv_rows: np.ndarray) -> np.ndarray:
        """Start a prelude batch's rows: `rows` are the items' rows (`rows_of`), -1 for an item without one,
        which is given one here. Each item's token is at `positions`, its KV at `kv_rows`, its sequence in
        block-table slot `kv_slots`. Returns the rows."""
        new = (rows < 0).nonzero()[0]  # (the array's method: `np.flatnonzero` is five Python calls a tick)
        if len(new):
            n, free, slots = len(new), self._free, self.items
            taken = free[len(free) - n:][::-1]  # (the rows `pop` would give, in that order)
            del free[len(free) - n:]
            fresh = [items[k] for k in new.tolist()]
            for item, row in zip(fresh, taken, strict=True):
                item.row = row
                slots[row] = item
            given = np.array(taken, np.int64)
            rows = rows.copy()
            rows[new] = given
            self.order[given] = np.fromiter((item._order for item in fresh), np.int64, n)
            self.token[given] = np.fromiter((item._token for item in fresh), np.int64, n)
        _claim_rows(rows, kv_slots, positions, kv_rows, self.generation, self.kv_slot, self.position, self.kv_row,
                    self.r, self.parity, self.signal, self.passive)
        return rows

    def requeue_quiet(self, items: list[WorkItem], rows: np.ndarray, tokens: np.ndarray, ok: np.ndarray,
                      first_order: int, order_step: int, now: float) -> tuple[np.ndarray, np.ndarray]:
        """A coda batch's tokens read (`items` in `rows`, sampled `tokens`; `ok`: the rows that may take the quiet way
        at all). A row's token is quiet when its sequence (by slot, `SlotFacts`) is `quiet`, the token is not the last
        it may generate, and no sequence counted in `stop_refs` may stop on it (a token that stops another sequence
        goes the long way too, which decides it exactly: a cost, never a wrong token): it needs no per-row check.
        Each quiet row's token is held (`HeldTokens.add`: its exit depth, the loops it ran, arrived at `now`) and the
        row kept as the item of its sequence's next token, fed that token one position on, created in the next of
        the orders first_order, first_order + order_step, ... (a new generation: results still on their way are
        not its; no step run, no exit). One compiled pass; returns the quiet rows' batch indices, in order, and
        their sequences' slots."""
        facts, held, n = self.sequences, self.held, len(rows)
        picked, slots, depths, loops = np.empty((4, n), np.int64)
        m, kl = _requeue_quiet_rows(rows, tokens, ok, first_order, order_step, self.kv_slot, self.decode_index,
                                    facts.quiet, facts.max_new, facts.stop_refs, self.generation, self.position,
                                    self.token, self.order, self.r, self.parity, self.passive, self.exits.exit_depth,
                                    self.exits.frozen, self.signal, _KL, picked, slots, depths, loops)
        picked, slots = picked[:m], slots[:m]
        held.add(slots, tokens[picked], depths[:m], loops[:m], now)
        if kl:  # a new token starts from no previous step
            for k in picked[self.signal[rows[picked]] == _KL].tolist():
                items[k].prev_logprobs = None
        return picked, slots

    def start_loops(self, items: list[WorkItem], rows: np.ndarray) -> None:
        """The items' preludes ran (in state-pool rows `rows`): track their exit rules from step 1. Their
        sequences' facts are read by slot (`SlotFacts`), the items themselves only for a replayed trace."""
        slots, facts = self.kv_slot[rows], self.sequences
        _start_pool_rows(rows, slots, self.position, facts.prompt_len, facts.rule, self.decode_index, self.signal,
                         self.decides_ahead)
        self.exits.start(rows, lambda: [item.seq.rule for item in items], self.decode_index[rows], facts.rule, slots)

    def release(self, item: WorkItem) -> None:
        self.release_all([item])

    def release_all(self, items: list[WorkItem], rows: np.ndarray | None = None) -> None:
        """Free the items' rows (all hold one; `rows`: them, if known); each item keeps its position, input token
        and creation order, which lived in the pool while it held its row."""
        rows = rows_of(items) if rows is None else rows
        self.generation[rows] += 1  # results still on their way for these rows are no longer their items'
        for item, order, position, token in zip(items, self.order[rows].tolist(), self.position[rows].tolist(),
                                                self.token[rows].tolist(), strict=True):
            self.items[item.row] = None
            self._free.append(item.row)
            item.row = -1
            item._order, item._position, item._token = order, position, token

    def advance(self, rows: np.ndarray, generations: np.ndarray) -> tuple[int, np.ndarray]:
        """A core step ran on `rows` (queued when they were at `generations`; rows released since are
        skipped): each active (not passive) row counts it and keeps its state (flips its parity), but a
        frozen row, whose step was delayed lookahead's extra one, unfreezes and drops it. Returns the
        number of active rows and, in batch order, those done looping: the frozen ones and those that
        reached their last step (`max_loops`, or the one a lookahead_gate decision chose), whose exit
        depth is set to it. One compiled pass over the rows."""
        done = np.empty(len(rows), np.int64)
        book = self.exits
        active, n = _advance_rows(rows, generations, self.generation, self.passive, self.r, self.parity,
                                  book.frozen, book.stop_at, book.exit_depth, done)
        return active, done[:n]

    def without(self, queue: np.ndarray, rows: np.ndarray) -> np.ndarray:
        """`queue` (pool rows) without `rows`, order kept: one compiled pass."""
        if not len(rows) or not len(queue):
            return queue
        out = np.empty(len(queue), np.int64)  # (made here: an array made in a compiled pass costs more to return)
        try:
            return out[:_drop_rows(queue, rows, self._marks, out)]
        except IndexError:
            self._marks[:] = False  # (a bad row: the pass stopped with marks set)
            raise

    def settle(self, rows: np.ndarray, generations: np.ndarray, signals: Signals) -> tuple[np.ndarray, np.ndarray]:
        """A core step's signals read (`rows` queued at `generations`): each row whose rule still reads it (the
        row holds the same item, is not passive, has not decided) decides (`ExitBook.settle`). Returns the batch
        indices of the rows that stop looping and of those whose signal is not finite."""
        return self.exits.settle(rows, self.r[rows], generations, self.generation, self.passive, signals.main,
                                 signals.ahead, signals.has)

    def compile_passes(self) -> None:
        """Compile the passes over rows (or load them from numba's cache) for the argument types
        the engine gives them, so that no request waits for it: a few seconds the first time on a machine,
        a fraction of one after."""
        none = np.zeros(0, np.int64)
        self.advance(none, none)
        self.settle(none, none, Signals.none(np.zeros(0, np.int8)))
        _drop_rows(none, none, self._marks, none)
        self.exits.start(none, [], none, np.zeros((0, RULE_WIDTH)))
        _claim_rows(none, none, none, none, self.generation, self.kv_slot, self.position, self.kv_row, self.r,
                    self.parity, self.signal, self.passive)
        self.requeue_quiet([], none, none, np.zeros(0, bool), 0, 1, 0.0)
        _start_pool_rows(none, none, self.position, self.sequences.prompt_len, self.sequences.rule, self.decode_index,
                         self.signal, self.decides_ahead)
        self.exits.observe(none, none, np.zeros(0), np.zeros(0), np.zeros(0, bool))
        _pack_rows(none, True, self.passive, self.position, self.kv_row, self.r, self.kv_slot, self.parity,
                   self.signal, self.decides_ahead, 0, self.rows, np.zeros((PACKED_ROWS, 0), np.int64),
                   np.zeros(0, np.int8), np.zeros(len(SIGNALS), np.int64))

    def state_rows(self, rows: np.ndarray) -> np.ndarray:
        """Indices into `state` of the rows' current buffers."""
        return self.parity[rows] * self.rows + rows


@dataclass
class Signals:
    """One core step's exit signals on the host, per batch row (float64): `main` (gate logit, latent
    difference or KL), `ahead` (lookahead_gate's predicted logit), `has` (the row got a signal)."""

    kinds: np.ndarray  # each row's signal code in SIGNALS (0: none)
    main: np.ndarray
    ahead: np.ndarray
    has: np.ndarray

    @staticmethod
    def none(kinds: np.ndarray) -> Signals:
        n = len(kinds)
        return Signals(kinds, np.zeros(n), np.zeros(n), np.zeros(n, bool))

    def take(self, keep: np.ndarray | slice) -> Signals:
        return Signals(self.kinds[keep], self.main[keep], self.ahead[keep], self.has[keep])

    def row(self, k: int) -> Signal:
        """Row k's signal as a Python value (None, a float, or (main, ahead) for lookahead_gate)."""
        if not self.has[k]:
            return None
        if self.kinds[k] == _LOOKAHEAD_GATE:
            return (float(self.main[k]), float(self.ahead[k]))
        return float(self.main[k])


class PendingSignals:
    """The exit signals of one core step, still on their way back from the device."""

    def __init__(self, kinds: np.ndarray, readback: Readback | None, whole: bool = False,
                 read_now: bool = False) -> None:
        self.kinds, self._readback = kinds, readback  # kinds: each row's signal code (0: none)
        self._whole = whole  # every row has one signal kind, computed per row (most batches: one rule)
        self.read_now = read_now  # some row's rule reads this step's signal before the next step (most rules)
        self._got: Signals | None = None

    def get(self) -> Signals:
        """Waits for the copy (once)."""
        if self._got is not None:
            return self._got
        if self._whole:
            assert self._readback is not None
            (t,) = self._readback.host().values()
            n = len(self.kinds)
            # float64 and contiguous (what the compiled passes were built for); numpy casts faster than torch
            main = (t.numpy() if t.dtype in (torch.float32, torch.float64) else t.to(torch.float32).numpy()).astype(
                np.float64)
            self._got = Signals(self.kinds, main, np.zeros(n), np.ones(n, bool))
            return self._got
        got = Signals.none(self.kinds)
        if self._readback is not None:
            for name, t in self._readback.host().items():
                code = SIGNALS.index(name)
                rows = np.flatnonzero(self.kinds == code)
                v = t.to(torch.float64).numpy()
                if name == "lookahead_gate":
                    got.main[rows], got.ahead[rows] = v[rows, 0], v[rows, 1]
                elif name == "kl":  # computed for the KL rows only, in order
                    got.main[rows] = v
                else:
                    got.main[rows] = v[rows]
                got.has[rows] = True
        self._got = got
        return got


class PendingSamples:
    """The tokens a stage batch sampled on the device, on their way to the host (already there when
    the batched sampler fell back to sampling row by row)."""

    def __init__(self, logits: torch.Tensor, seqs: list[Sequence] | None, counters: np.ndarray | None = None) -> None:
        """Row i samples for `seqs[i]`; `seqs` None: every row samples by a plain argmax (the caller knows,
        and nothing is read per row)."""
        self._plain = seqs is None or all(s.plain_greedy for s in seqs)
        if seqs is None or self._plain:  # an argmax reads no params, seed nor counter; no row asks for logprobs
            n = logits.shape[0]
            self._params: list[SamplingParams] = [GREEDY] * n
            seeds = ctrs = [0] * n
        else:  # counters: the index of the token each row samples (its draw's counter, §8); default the next one
            self._params = [s.params for s in seqs]
            ctrs = [len(s.output_ids) for s in seqs] if counters is None else counters.tolist()
            seeds = [s.seed for s in seqs]
        result = sample_rows(logits, self._params, seeds, ctrs, self._plain)
        self._readback = Readback(result) if isinstance(result, dict) else None
        self._batch = None if isinstance(result, dict) else SampledBatch(None, [], rows=result)

    def ready(self) -> bool:
        """Whether the tokens are on the host already (`get` would not wait)."""
        return self._readback is None or self._readback.ready()

    def get(self) -> SampledBatch:
        if self._batch is None:
            assert self._readback is not None
            self._batch = SampledBatch(self._readback.host(), [] if self._plain else self._params)
        return self._batch


class PendingDrafts:
    """A DRAFT batch's drafted tokens on their way to the host (`ModelRunner.draft`)."""

    def __init__(self, readback: Readback, lens: list[int]) -> None:
        self._readback, self._lens = readback, lens

    def get(self) -> list[list[int]]:
        """Row i's `lens[i]` drafts (waits for the copy)."""
        rows = self._readback.host()["tokens"].tolist()
        return [row[:k] for row, k in zip(rows, self._lens, strict=True)]


class PendingPrefill:
    """A prefill batch's results on their way to the host: the first generated token of each prompt it
    completed, and the prompt-token logprobs of the requests that asked for them."""

    def __init__(self, seqs: list[Sequence], samples: PendingSamples | None, spans: list[tuple[Sequence, int, int]],
                 prompt: dict[str, torch.Tensor] | None, broken: torch.Tensor) -> None:
        """`broken` [chunks] bool: the chunks whose tokens' states went non-finite."""
        self.samples, self._spans = samples, spans
        self.seqs = seqs
        self._readback = Readback(prompt) if prompt is not None else None
        self._broken = Readback({"broken": broken})

    def broken(self) -> list[int]:
        """The chunks (by index in the plan) whose tokens' states went non-finite: their requests fail."""
        return np.flatnonzero(self._broken.host()["broken"].numpy()).tolist()

    def get(self) -> SampledBatch:
        """A `Sample` per sequence in `seqs` (waits for the copy)."""
        return self.samples.get() if self.samples is not None else SampledBatch(None, [], rows=[])

    def prompt_logprobs(self) -> list[tuple[Sequence, int, dict[str, np.ndarray]]]:
        """(sequence, position p, rows): row j of `prompt_logprobs`' host arrays scores its prompt token p+1+j."""
        if self._readback is None:
            return []
        host = {name: t.numpy() for name, t in self._readback.host().items()}
        out, a = [], 0
        for seq, position, n in self._spans:
            out.append((seq, position, {name: x[a:a + n] for name, x in host.items()}))
            a += n
        return out


class Packed(NamedTuple):
    """A decode batch's metadata packed for one upload (`ModelRunner._pack`)."""

    host: np.ndarray  # [PACKED_ROWS + extra, rows] int64: the rows named in graphs.py, then the caller's
    top: int  # the largest position
    kinds: np.ndarray  # each row's signal code in SIGNALS (0: none)
    counts: list[int]  # rows per signal code
    now: int  # rows whose signal their rule reads at once (not a step late)


class ModelRunner:
    def __init__(self, model: LoopedLM, layout: KVLayout, kv: KVCacheManager, pool: StatePool,
                 scratch_row: int, graphs: StageGraphs | None = None) -> None:
        self.model, self.layout, self.kv, self.pool = model, layout, kv, pool
        self.scratch_row = scratch_row
        self.graphs = graphs  # decode stages on static buffers (CUDA graphs: `StageGraphs`), else eager
        p = next(model.parameters())
        self.device, self.dtype = p.device, p.dtype
        self.has_prelude_kv = model.config.n_prelude > 0
        self.has_coda_kv = model.config.n_coda > 0
        self.draws_random_state = model.draws_random_state  # else the per-token state seeds go unused
        pool.compile_passes()
        kv.compile_passes()
        kv.store.compile_scores()
        if self.device.type == "cpu":
            rope_pass.compile_pass(self.dtype)

    def _pack(self, rows: np.ndarray, core: bool = False, extra: int = 0) -> Packed:
        """Per row of a decode batch (state-pool rows `rows`), in one pass: its context's positions, KV write rows,
        depths and table slots, the state buffer it reads and the one it writes, its pool row (`_pack_rows`),
        then `extra` rows for the caller to fill; the caller uploads them in one copy (`core`: a passive row
        writes its KV to the scratch row and has no signal)."""
        pool = self.pool
        host, kinds = np.empty((PACKED_ROWS + extra, len(rows)), np.int64), np.empty(len(rows), np.int8)
        counts = np.zeros(len(SIGNALS), np.int64)
        top, now = _pack_rows(rows, core, pool.passive, pool.position, pool.kv_row, pool.r, pool.kv_slot, pool.parity,
                              pool.signal, pool.decides_ahead, self.scratch_row, pool.rows, host, kinds, counts)
        return Packed(host, top, kinds, counts.tolist(), now)

    def _ctx(self, host: np.ndarray, device: torch.Tensor, top: int) -> ForwardContext:
        """The attention context of a packed decode batch (`_pack`)."""
        return packed_decode_context(self.kv.store, self.layout, self.kv.block_tables, host, device, top + 1)

    def _loop(self, state: torch.Tensor, inject: torch.Tensor | None, ctx: ForwardContext,
              loops: np.ndarray) -> torch.Tensor:
        """Loop steps 1..loops[i] for row i of `ctx`, all rows depth by depth; rows whose loops end
        sooner drop out (whole segments) and keep their state."""
        for r in range(1, int(loops.max()) + 1):
            active = np.flatnonzero(loops >= r)
            if len(active) == len(loops):
                state = self.model.core_step(state, inject, ctx.with_depth(torch.full_like(ctx.depth, r)))
            else:
                sub = ctx.select(active.tolist())
                idx = upload(torch.from_numpy(active), self.device)
                state[idx] = self.model.core_step(state[idx], None if inject is None else inject[idx],
                                                  sub.with_depth(torch.full_like(sub.depth, r)))
        return state

    # -- stages --------------------------------------------------------------------------------------
    def prefill(self, chunks: list[PrefillChunk]) -> PendingPrefill:
        """Run chunks through prelude, every loop up to their max_loops, and the coda where needed.

        Returns, on their way to the host, the first generated token of each sequence whose prompt is
        now complete (sampled on the device) and, for requests with `prompt_logprobs`, the logprobs of
        their prompt tokens: the coda's at every position of the chunk (the prompt runs at full depth).
        """
        model, dev = self.model, self.device
        ctx = paged_context(self.kv.store, self.layout, self.kv.block_tables,
                            [(self.kv.slot(c.seq.request_id), c.start, c.n) for c in chunks])
        ids = upload([t for c in chunks for t in c.seq.prompt_ids[c.start:c.start + c.n]], dev)
        seeds = ([c.seq.state_seed(p) for c in chunks for p in range(c.start, c.start + c.n)]
                 if self.draws_random_state else None)
        self.kv.store.set_depth(ctx.write_rows, IN_FLIGHT)
        state, inject = model.prelude(ids, ctx, seeds)
        loops = [c.seq.rule.max_loops for c in chunks for _ in range(c.n)]
        state = self._loop(state, inject, ctx, np.asarray(loops))  # a chunk's rows share one max_loops
        self.kv.store.set_depth(ctx.write_rows, upload(loops, dev))
        # a chunk any of whose tokens' states went non-finite (NaN or inf in a residual stream stays there) fails
        # its request: attention reads its KV as zeros in no way it could tell, so a later token would come out
        # finite and wrong (flags for the chunks, read back with the results: no host sync)
        bad = torch.cat([torch.zeros(1, dtype=torch.long, device=dev), (~finite_rows(state.detach())).long().cumsum(0)])
        starts = upload(ctx.seg_starts, dev)
        broken = bad[starts[1:]] > bad[starts[:-1]]
        last = [i for i, c in enumerate(chunks) if c.last]
        sampled = [s for i in last for s in (chunks[i].seq, *chunks[i].seq.pending_forks)]  # n > 1: from one row
        rows = [ctx.seg_starts[i + 1] - 1 for i in last for _ in range(1 + len(chunks[i].seq.pending_forks))]
        n_sampled = len(rows)
        spans: list[tuple[Sequence, int, int]] = []  # (sequence, first position, rows) scoring prompt tokens
        targets: list[int] = []
        for i, c in enumerate(chunks):
            n = min(c.n, len(c.seq.prompt_ids) - 1 - c.start)  # the last prompt token scores a generated one
            if c.seq.params.prompt_logprobs is not None and n > 0:
                spans.append((c.seq, c.start, n))
                rows += range(ctx.seg_starts[i], ctx.seg_starts[i] + n)
                targets += c.seq.prompt_ids[c.start + 1:c.start + 1 + n]
        logits = None
        if self.has_coda_kv or rows:  # a coda with layers writes its KV at every row
            logits = model.coda(state, ctx, upload(rows, dev))
        samples = PendingSamples(logits[:n_sampled], sampled) if sampled and logits is not None else None
        prompt = None
        if spans and logits is not None:
            k = max(seq.params.prompt_logprobs or 0 for seq, _, _ in spans)
            prompt = prompt_logprobs(logits[n_sampled:], upload(targets, dev), k)
        for i in last:  # the other samples of a request (n > 1) share its full prompt blocks (the
            head = chunks[i].seq  # scheduler), and get a copy of the rows of its partial last block
            n = len(head.prompt_ids)
            tail = n // self.kv.block_size * self.kv.block_size
            if head.pending_forks and tail < n:
                src = upload(self.kv.rows(head.request_id, n)[tail:], dev)
                for fork in head.pending_forks:
                    self.kv.store.copy_rows(upload(self.kv.rows(fork.request_id, n)[tail:], dev), src)
        return PendingPrefill(sampled if samples is not None else [], samples, spans, prompt, broken)

    def prelude(self, items: list[WorkItem], rows: np.ndarray) -> None:
        """Run the preludes of `items` (in state-pool rows `rows`) into their state rows (their current buffers)
        and, for Huginn, their injection rows. The tokens (and random-state seeds) go up with the rows' metadata."""
        host, top = self._pack(rows, extra=SEED + 1 - PACKED_ROWS)[:2]
        host[STATE_WRITE] = host[STATE_READ]  # a prelude writes the rows' current buffers, which their next step reads
        host[TOKEN] = self.pool.token[rows]
        host[SEED] = [it.state_seed() for it in items] if self.draws_random_state else 0
        device = upload(torch.from_numpy(host), self.device)
        self.kv.store.set_depth(device[KV_WRITE], IN_FLIGHT)  # its KV rows: being computed
        if self.graphs is not None and self.has_prelude_kv:  # (Huginn's: a prelude with layers, graphed)
            self.graphs.prelude(device, top + 1)
            return
        ctx = self._ctx(host, device, top) if self.has_prelude_kv else None  # (Ouro's prelude attends to nothing)
        state, inject = self.model.prelude(device[TOKEN], ctx, device[SEED] if self.draws_random_state else None)
        self.pool.state.index_copy_(0, device[STATE_WRITE], state)  # (index_copy_, index_select: the
        if inject is not None and self.pool.inject is not None:  # same copies as [] at less dispatch cost)
            self.pool.inject.index_copy_(0, device[POOL_ROW], inject)

    def core(self, rows: np.ndarray) -> PendingSignals:
        """Queue one loop step for the items in state-pool rows `rows` (each at its own depth r+1); its
        exit signals come back as `PendingSignals`, which the engine reads when it needs them (with
        lookahead: a tick later). Host work is one compiled pass and a few calls, whatever the batch width.

        Each item reads its current state buffer and writes the other one (see `StatePool`).
        Passive rows (CB) write their KV to a scratch row and report no signal.
        """
        pool = self.pool
        host, top, kinds, counts, now = self._pack(rows, core=True)
        device = upload(torch.from_numpy(host), self.device)
        # the attention context: for an eager step and for the KL signal's coda (a replayed step has its own)
        ctx = self._ctx(host, device, top) if self.graphs is None or counts[_KL] else None
        ready: dict[str, torch.Tensor] = {}  # signals the step computed itself
        if self.graphs is None:
            assert ctx is not None
            prev = pool.state.index_select(0, device[STATE_READ])
            inject = None if pool.inject is None else pool.inject.index_select(0, device[POOL_ROW])
            new = self.model.core_step(prev, inject, ctx)
            pool.state.index_copy_(0, device[STATE_WRITE], new)
        else:  # (the graph gathers and writes back the states, and computes the rows' own signals)
            prev, new, ready = self.graphs.core(device, top + 1)
        present = {SIGNALS[k] for k in range(1, len(SIGNALS)) if counts[k]}
        if not present:
            return PendingSignals(kinds, None)
        kl_rows = np.flatnonzero(kinds == _KL).tolist() if counts[_KL] else []
        prev_lp = None
        if kl_rows:
            vocab = self.model.config.vocab_size
            uniform = uniform_logprobs(1, vocab, torch.float64, self.device)[0]
            kl_items = [pool.items[int(rows[i])] for i in kl_rows]
            prev_lp = torch.stack([uniform if it is None or it.prev_logprobs is None else it.prev_logprobs
                                   for it in kl_items])
        sig, lp = step_signals(self.model, present - ready.keys() if ready else present,  # type: ignore[arg-type]
                               prev, new, ctx, prev_lp, kl_rows or None)
        if ready:
            sig.update((kind, signal) for kind, signal in ready.items() if kind in present)
        if kl_rows:
            for j, it in enumerate(kl_items):
                if it is not None:
                    it.prev_logprobs = lp[j] if lp is not None else None
        n = len(rows)
        return PendingSignals(kinds, Readback(sig, reused=bool(ready)),
                              whole=counts[_GATE] == n or counts[_LATENT_DIFF] == n, read_now=now > 0)

    def coda(self, items: list[WorkItem], rows: np.ndarray) -> PendingSamples:
        """The exited items' (in state-pool rows `rows`) next tokens, sampled on the device, on their way
        to the host in one copy."""
        host, top = self._pack(rows)[:2]
        device = upload(torch.from_numpy(host), self.device)
        pool = self.pool
        if self.has_coda_kv and self.graphs is not None:  # (the graph gathers the states itself)
            logits = self.graphs.coda(device, top + 1)
        else:
            state = pool.state.index_select(0, device[STATE_READ])
            # (a coda without layers attends to nothing: no context, no graph)
            logits = self.model.coda(state, self._ctx(host, device, top) if self.has_coda_kv else None)
        plain = pool.sequences.plain[host[SLOT]].all()  # (the rows' block-table slots)
        return PendingSamples(logits, None if plain else [it.seq for it in items], pool.decode_index[rows] + 1)

    def draft(self, items: list[WorkItem], lens: list[int], loops: int) -> PendingDrafts:
        """Self-speculative drafts (docs/design.md §12): `lens[i]` tokens after item i's token, each the
        greedy coda (with the request's `logit_bias`) of the token before it after `loops` loop steps (at
        most its rule's max_loops).
        Round j feeds every row still drafting its position + j; the KV goes to the sequence's own
        rows, which the verify pass rewrites before anything reads them. The drafts stay on the device
        until one readback (but for models with random initial states, whose next round's seeds are
        chained over the drafted tokens)."""
        kv, model, dev = self.kv, self.model, self.device
        n, want = len(items), np.asarray(lens)
        slots = np.fromiter((kv.slot(it.seq.request_id) for it in items), np.int64, n)
        start = np.fromiter((it.position for it in items), np.int64, n)
        depth = np.array([min(loops, it.seq.rule.max_loops) for it in items], np.int64)
        ids = upload([it.token for it in items], dev)
        seeds = [it.state_seed() for it in items] if self.draws_random_state else None
        tokens = torch.zeros(n, int(want.max()), dtype=torch.long, device=dev)
        for j in range(tokens.shape[1]):
            act = np.flatnonzero(want > j)
            rows = upload(torch.from_numpy(act), dev)
            ctx = decode_context(kv.store, self.layout, kv.block_tables, slots[act], start[act] + j)
            kv.store.set_depth(ctx.write_rows, IN_FLIGHT)
            state, inject = model.prelude(ids[rows], ctx, None if seeds is None else [seeds[i] for i in act])
            state = self._loop(state, inject, ctx, depth[act])
            params = [items[i].seq.params for i in act]  # logit_bias too: a draft it bans is never accepted
            nxt = argmax_rows(adjust_logits(model.coda(state, ctx).double(), params, [0] * len(act)))
            tokens[rows, j] = ids[rows] = nxt
            if seeds is not None:
                for i, token in zip(act.tolist(), nxt.tolist(), strict=True):
                    seeds[i] = chain_seed(seeds[i], token)
        return PendingDrafts(Readback({"tokens": tokens}), lens)

    def write_kv_depths(self, rows: np.ndarray, depths: np.ndarray) -> None:
        """Record the KV depth of tokens that exited (batched: one small write or upload per tick)."""
        self.kv.store.set_depth(rows, depths)


@compiled
def _advance_rows(rows, generations, generation, passive, r, parity, frozen, stop_at, exit_depth, done):
    """`StatePool.advance`: writes the done rows to done[:m]; returns (active rows, m)."""
    active = m = 0
    for k in range(rows.shape[0]):
        i = rows[k]
        if generation[i] != generations[k] or passive[i]:
            continue
        active += 1
        r[i] += 1
        if frozen[i]:
            frozen[i] = False
        else:
            parity[i] ^= 1
            if r[i] < stop_at[i]:
                continue
            exit_depth[i] = r[i]
        done[m] = i
        m += 1
    return active, m


@compiled
def _drop_rows(queue, rows, marks, out):
    """`StatePool.without`: the rows of `queue` not in `rows`, in order, into out[:m]; returns m (`marks`: all
    False, left so)."""
    for i in rows:
        marks[i] = True
    m = 0
    for q in queue:
        if not marks[q]:
            out[m] = q
            m += 1
    for i in rows:
        marks[i] = False
    return m


@compiled
def _claim_rows(rows, kv_slots, positions, kv_rows, generation, kv_slot, position, kv_row, r, parity, signal, passive):
    """`StatePool.allocate`: row rows[k] now holds batch item k (a new generation of the row, its token's KV
    slot, position and KV row; no step run, nothing to signal, active)."""
    for k in range(rows.shape[0]):
        i = rows[k]
        generation[i] += 1
        kv_slot[i], position[i], kv_row[i] = kv_slots[k], positions[k], kv_rows[k]
        r[i] = parity[i] = 0
        signal[i] = 0
        passive[i] = False


@compiled
def _requeue_quiet_rows(rows, tokens, ok, first_order, order_step, kv_slot, decode_index, quiet, max_new, stop_refs,
                        generation, position, token, order, r, parity, passive, exit_depth, frozen, signal, kl, picked,
                        slots, depths, loops):
    """`StatePool.requeue_quiet`'s pass: row k's token (tokens[k]) is quiet if ok[k], its sequence's slot is `quiet`,
    the token is not its last (decode index + 2 < max_new: the item was fed generated token decode_index) and
    stop_refs counts no sequence it may stop (the last entry stands for every larger token). A quiet row's batch
    index, slot, exit depth and loops go to picked/slots/depths/loops[m], then the row holds its next token.
    Returns (m, how many of them read the `kl` signal)."""
    m = n_kl = 0
    top = stop_refs.shape[0] - 1
    for k in range(rows.shape[0]):
        i, t = rows[k], tokens[k]
        s = kv_slot[i]
        if not (ok[k] and quiet[s] and decode_index[i] + 2 < max_new[s] and stop_refs[min(t, top)] == 0):
            continue
        picked[m], slots[m], depths[m], loops[m] = k, s, exit_depth[i], r[i]
        if signal[i] == kl:
            n_kl += 1
        generation[i] += 1
        position[i] += 1
        token[i], order[i] = t, first_order + m * order_step
        r[i] = parity[i] = 0
        passive[i] = False
        exit_depth[i] = 0
        frozen[i] = False
        m += 1
    return m, n_kl


@compiled
def _start_pool_rows(rows, slots, position, prompt_len, rule, decode_index, signal, decides_ahead):
    """`StatePool.start_loops` for row rows[k], whose sequence holds block-table slot slots[k]: the decode
    index of the token it is fed (its position less the prompt's length) and, from its rule's table row,
    the signal it needs and whether its rule decides a step ahead."""
    for k in range(rows.shape[0]):
        i, s = rows[k], slots[k]
        decode_index[i] = position[i] - prompt_len[s]
        signal[i] = np.int8(rule[s, ROW_SIGNAL])
        decides_ahead[i] = rule[s, ROW_DECIDES_AHEAD] != 0


@compiled
def _pack_rows(rows, core, passive, position, kv_row, r, kv_slot, parity, signal, decides_ahead, scratch_row, n_rows,
               host, kinds, counts):
    """`ModelRunner._pack`: host[:PACKED_ROWS, k] = (position, KV write row, depth, block-table slot, state index read,
    state index written, pool row) and kinds[k] = the signal code of batch row k (in a `core` batch a passive row
    writes its KV to the scratch row and has no signal), counted in counts[code]; returns the largest position and
    the number of rows with a signal whose rule does not decide a step ahead (a core step whose signals are all
    read a step late has none)."""
    top = now = 0
    for k in range(rows.shape[0]):
        i = rows[k]
        hidden = core and passive[i]
        host[POSITION, k] = position[i]
        host[KV_WRITE, k] = scratch_row if hidden else kv_row[i]
        host[DEPTH, k] = r[i] + 1
        host[SLOT, k] = kv_slot[i]
        host[STATE_READ, k] = parity[i] * n_rows + i
        host[STATE_WRITE, k] = (parity[i] ^ 1) * n_rows + i
        host[POOL_ROW, k] = i
        kinds[k] = 0 if hidden else signal[i]
        counts[kinds[k]] += 1
        if kinds[k] != 0 and not decides_ahead[i]:
            now += 1
        top = max(top, position[i])
    return top, now
