"""Schedulers: which homogeneous stage batch runs next (docs/design.md §6.1-6.2).

All three share the queues, KV admission, preemption and the bookkeeping of results (`after_*`);
they differ only in `_plan` (the choice `schedule` returns):

- `CBScheduler` (`cb`): token-level continuous batching at full depth. A cohort of decode tokens
  runs prelude, then core steps until the deepest member's `max_loops`, then the coda. Members that
  exit early stay in the batch as passive rows (computed, results discarded): exit signals save nothing.
- `CDBNoRefillScheduler` (`cdb-norefill`): the same cohorts (both are `CohortScheduler`s), but exited
  tokens leave the core batch (it shrinks); the coda runs when the whole cohort has exited; new work
  joins only between cohorts.
- `CDBScheduler` (`cdb`, continuous depth batching with refill): four queues. Each tick, by
  priority: coda (>= min_coda_batch waiting), prefill (if KV admission keeps the safety margin, and
  no token that was in flight at the last prefill tick still waits for its sample: `_prefill_turn`),
  prelude (while the core batch has free width; a prelude batch of its own waits for min_prelude_batch
  tokens unless the core batch is empty), core, then an undersized coda flush. Exited tokens leave the
  core batch at once and fresh tokens take their rows (their preludes run in the tick of their coda or
  prefill, as far as the core batch has room).

KV admission: a new prompt is admitted only when the pool can hold all of it on top of what the
admitted, partly prefilled prompts still need (so half-prefilled prompts cannot hold the pool
between them). With prefix caching, an admitted prompt first takes the cached blocks of its longest
cached prefix and starts its prefill after them; the blocks a chunk completes are published for
later prompts (docs/design.md §4.3). KV pressure: a token that needs a new block and finds none swaps out the most
recently arrived sequence that is between tokens, or else drops a partly prefilled prompt (to be
recomputed); a request that could never fit fails alone with an error. Speculative decoding
(docs/design.md §12): a DRAFT batch comes before a drafting request's prelude, its verify group's
rows then travel as ordinary items (all or none into the prelude, one coda together), and
`after_coda` accepts the drafts. `check_invariants` and
`check_drained` state the bookkeeping the tests check after every step.
"""

from __future__ import annotations

import bisect
import logging
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import StrEnum

import numpy as np

from loopserve.cache.layout import IN_FLIGHT
from loopserve.cache.manager import KVCacheManager
from loopserve.cache.prefix import block_keys, reusable_tokens
from loopserve.engine.config import ENGINE_SCHEDULERS, EngineConfig
from loopserve.engine.runner import PrefillChunk, Signals, StatePool, WorkItem, rows_of
from loopserve.engine.sampler import REQUEST_ERRORS, Sample, SampledBatch
from loopserve.engine.sequence import Sequence, Status, failure
from loopserve.engine.speculative import Speculator, VerifyGroup
from loopserve.engine.stats import EngineStats
from loopserve.errors import NON_FINITE_PROMPT, NonFiniteError
from loopserve.exits import ROW_MAX_LOOPS, Signal
from loopserve.outputs import request_clock

log = logging.getLogger("loopserve.engine")


class Stage(StrEnum):
    """What a stage batch runs (a str, so records and metrics compare it with plain names)."""

    PREFILL = "prefill"  # prompt chunks: prelude, every loop to max_loops, coda where needed
    DRAFT = "draft"  # speculative decoding: each row drafts its next tokens at a shallow depth
    PRELUDE = "prelude"  # decode tokens enter the loop
    CORE = "core"  # one loop step, each row at its own depth
    CODA = "coda"  # exited tokens' next tokens are sampled
    IDLE = "idle"  # nothing to run


@dataclass
class StagePlan:
    stage: Stage
    items: list[WorkItem] = field(default_factory=list)  # PRELUDE, DRAFT, CODA
    chunks: list[PrefillChunk] = field(default_factory=list)  # PREFILL
    draft_lens: list[int] = field(default_factory=list)  # DRAFT: tokens each item drafts
    rows: np.ndarray | None = None  # the batch as state-pool rows (CORE: only these, no work items touched)

    @property
    def size(self) -> int:
        """Prompt tokens (prefill) or decode rows."""
        if self.stage is Stage.PREFILL:
            return sum(c.n for c in self.chunks)
        return len(self.rows) if self.rows is not None else len(self.items)


class Scheduler:
    def __init__(self, cfg: EngineConfig, kv: KVCacheManager, pool: StatePool, stats: EngineStats,
                 prefix_scope: bytes | None = None, random_state: bool = False,
                 speculator: Speculator | None = None) -> None:
        self.cfg, self.kv, self.pool, self.stats = cfg, kv, pool, stats
        # resolved for the model by the engine (`EngineConfig.boundary_batches_for`)
        assert cfg.min_coda_batch is not None and cfg.min_prelude_batch is not None, "boundary batches unresolved"
        self.min_coda_batch, self.min_prelude_batch = cfg.min_coda_batch, cfg.min_prelude_batch
        self.speculator = speculator  # speculative decoding (off when None)
        # prefix caching (off when None): the engine-wide part of block keys (`cache.prefix`), and
        # whether the model's random initial states make the state seed base part of a prompt's KV
        self.prefix_scope, self.random_state = prefix_scope, random_state
        # a restart inside a prefill chunk changes `shared` KV (§4.2): cached prefixes end on a chunk there
        self._prefix_align = cfg.prefill_chunk_size if cfg.kv_layout == "shared" else 1
        self.waiting: deque[Sequence] = deque()  # not yet (fully) prefilled
        self.prefill_pos: dict[str, int] = {}  # prompt tokens already prefilled
        self.running: dict[str, Sequence] = {}  # admitted, KV resident
        self.swapped: deque[WorkItem] = deque()  # preempted, KV on the host, item not started
        self.prelude_q: list[WorkItem] = []  # kept in creation order (FIFO)
        # The looping and the exited items, as state-pool rows (`core_q`, `coda_q`: their items): a core
        # tick is planned, advanced and decided on these arrays, with no Python per item. core_rows is
        # kept in creation order (the batch is its head), coda_rows in exit order.
        self.core_rows = _NO_ROWS
        self.coda_rows = _NO_ROWS
        self.coda_running: list[WorkItem] = []  # coda queued on the device, token not sampled yet
        # creation order of work items; a stride leaves room for a verify group's k + 1 rows to take the
        # place of the item that drafted (orders item.order + i)
        self._order_step, self._next_order = 1 + cfg.num_speculative_tokens, 0
        # the first creation order after the last prefill tick: the tokens in flight then (orders below it) are
        # owed a sample before another prefill tick may run (`_prefill_turn`)
        self._prefill_mark = 0
        self.finished: list[Sequence] = []  # finished since the last drain (the engine reports them)
        self.appended: list[Sequence] = []  # got a token since the last drain and streams (not FINAL_ONLY)
        self.retired_loops = 0  # decode loops of finished requests (bookkeeping check)
        self.prefilling: set[str] = set()  # prompts with a chunk queued whose result is not read yet
        self.kv_depth_writes: list[tuple[np.ndarray, np.ndarray]] = []  # (KV rows, depths) of tokens that exited
        self._kv_to_free: list[str] | None = None  # while a coda's results are taken: whose KV to free after
        # called with (items, signals) before exit rules see a core step's signals (trajectory recording)
        self.signal_hooks: list[Callable[[list[WorkItem], list[Signal]], None]] = []

    # -- requests ------------------------------------------------------------------------------------
    def never_fits(self, seq: Sequence) -> str | None:
        """Why a request (its head) could never fit the KV cache whatever else runs, or None: its samples'
        prompt with room for one generated token, and each other sample's own blocks beside the prompt's
        full ones, which they share (the samples of one part: its first one's `pending_forks`; the head's part is
        the largest, and parts are made to fit: `samples_that_fit`). (The server asks before a response starts.)"""
        if 1 + len(seq.pending_forks) <= self._samples_within(len(seq.prompt_ids), self.kv.num_blocks):
            return None
        return (f"prompt: a prompt of {len(seq.prompt_ids)} tokens cannot fit in the KV cache "
                f"({self.kv.num_blocks * self.kv.block_size} tokens)")

    def samples_that_fit(self, prompt_len: int) -> int:
        """How many samples of a prompt of `prompt_len` tokens the KV cache holds together at their first token
        (`never_fits`' rule), beside the safety margin that admission keeps free while anything else runs (a part
        that needs the whole pool waits until nothing runs, and holds up the queue behind it); one where only the
        whole pool holds the prompt; 0 if not even it does."""
        beside_margin = self._samples_within(prompt_len, self.kv.num_blocks - self._margin_blocks)
        return max(beside_margin, min(1, self._samples_within(prompt_len, self.kv.num_blocks)))

    def _samples_within(self, prompt_len: int, blocks: int) -> int:
        """How many samples of a prompt of `prompt_len` tokens fit in `blocks` at their first token: the prompt with
        room for one generated token, its full blocks shared, and each other sample's own (0: not the prompt)."""
        spare = blocks - self.kv.allocator.blocks_for(prompt_len + 1)
        return 0 if spare < 0 else 1 + spare // self._own_blocks(prompt_len)

    @property
    def _margin_blocks(self) -> int:
        """The blocks prefill admission keeps free while anything else runs (`kv_safety_margin` of the pool)."""
        return int(self.cfg.kv_safety_margin * self.kv.num_blocks)

    def add(self, seq: Sequence) -> None:
        """Queue a request (with n > 1, its head, and the first sample of each further part: the other samples
        fork from their part's prefill)."""
        why = self.never_fits(seq)
        parts = [s for s in seq.family if s.prefill_head is s]
        if why is not None:
            for s in seq.family:
                s.finish("error", why, error_status=400)
                self._finish(s)
            for s in parts:
                s.pending_forks = []
            return
        self.waiting.extend(parts)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self.swapped)

    def abort(self, seq: Sequence) -> None:
        """Stop a sequence (a request's sample) wherever it is; it is reported (finish_reason "abort") with the
        next step's outputs. A finished one is left as it is. The sequence is given, not looked up by id: a lookup
        scanned every waiting prompt's unstarted samples once per sample aborted (300 prompts x n = 64: 5 s)."""
        if not seq.finished:
            self._stop(seq, "abort")

    def fail(self, seq: Sequence, error: Exception) -> None:
        """Finish one request whose part of a batch raised (sampling, logprobs, detokenization, stop
        matching, its exit rule) or produced non-finite values: it alone ends with finish_reason
        "error" and frees its KV and state rows; every other request goes on untouched."""
        message, status = failure(error)  # (400: the request's own input failed it; as the reference decoder)
        if isinstance(error, REQUEST_ERRORS):
            log.warning("request %s failed: %s", seq.request_id, error)
        else:  # a bug the request triggered: keep the traceback for the report
            log.error("request %s failed", seq.request_id, exc_info=error)
        if not seq.finished:
            self._stop(seq, "error", message, status)

    def _stop(self, seq: Sequence, reason: str, error: str | None = None, status: int | None = None) -> None:
        """Take a request out of every queue, release what it holds, and finish it (`status`: an error's)."""
        if seq in self.waiting:
            self.waiting.remove(seq)
        head = seq.prefill_head
        if seq in head.pending_forks:  # a sample still waiting for the prompt's prefill
            head.pending_forks = [f for f in head.pending_forks if f is not seq]
        for fork in seq.pending_forks if seq is head else ():  # the prefill they wait for will not come
            fork.finish(reason, error, error_status=status)
            self._finish(fork)
        seq.pending_forks = []
        for item in [i for i in self.swapped if i.seq is seq]:
            self.swapped.remove(item)
        queues = (self.prelude_q, self.core_q, self.coda_q, self.coda_running)
        items = [i for q in queues for i in q if i.seq is seq]
        self._remove_items(items)
        self._discard_items(items)
        seq.finish(reason, error, error_status=status)
        self._finish(seq)

    # -- helpers -------------------------------------------------------------------------------------
    @property
    def core_q(self) -> list[WorkItem]:
        """The looping items, in creation order."""
        return self._items_at(self.core_rows)

    @property
    def coda_q(self) -> list[WorkItem]:
        """The exited items waiting for their coda, in exit order."""
        return self._items_at(self.coda_rows)

    def _items_at(self, rows: np.ndarray) -> list[WorkItem]:
        items = self.pool.items
        return [items[r] for r in rows.tolist()]  # type: ignore[misc]  # a queued row holds its item

    def _drop_item(self, item: WorkItem) -> None:
        if item.row >= 0:
            self.pool.release(item)

    def _discard_items(self, items: list[WorkItem]) -> None:
        """Items that will not produce their token: their loops count as spent, their rows are freed."""
        for item in items:
            item.seq.metrics.loops_run += item.r
            self._drop_item(item)

    def _release(self, seq: Sequence) -> None:
        self.running.pop(seq.request_id, None)
        self.prefill_pos.pop(seq.request_id, None)
        if self._kv_to_free is not None:  # (a coda batch's finished requests: freed together at its end)
            self._kv_to_free.append(seq.request_id)
        else:
            self.kv.free(seq.request_id)

    def _finish(self, seq: Sequence) -> None:
        self._release(seq)
        if self.speculator is not None:
            self.speculator.forget(seq.request_id)
        self.finished.append(seq)
        self.stats.finished_requests[seq.finish_reason] += 1
        self.retired_loops += seq.metrics.loops_run

    def _new_item(self, seq: Sequence, spent: WorkItem | None = None) -> None:
        """Queue the work item fed the sequence's last token: `spent`, the plain item of its previous token
        (its coda read, its row freed: it holds nothing), if given, else a new one."""
        order, position = self._new_orders(1), seq.num_tokens - 1
        if spent is None:
            self.prelude_q.append(WorkItem(seq, order, self.pool, position=position,
                                           slot=self.kv.slot(seq.request_id)))
        else:
            self.prelude_q.append(spent.reuse(order, position, seq.output_ids[-1]))

    def _new_orders(self, n: int) -> int:
        """Reserve the creation orders of `n` new work items; returns the first (the others follow it
        `_order_step` apart)."""
        first = self._next_order
        self._next_order += n * self._order_step
        return first

    def resident(self) -> int:
        """Sequences holding (or about to hold) a state of their own: the running ones, and the samples
        that will fork from admitted, partly prefilled prompts (n > 1). At most `max_num_seqs`. (The server's
        running gauge too: engine/engine_thread.py.)"""
        return len(self.running) + sum(len(s.pending_forks) for s in self.waiting if s.request_id in self.running)

    def _try_swap_in(self) -> None:
        while self.swapped and self.resident() < self.cfg.max_num_seqs:
            item = self.swapped[0]
            sid = item.seq.request_id
            shared = self._cached_prompt_blocks(item.seq)
            if not self.kv.swap_in(sid, shared):
                return
            self.swapped.popleft()
            self.running[sid] = item.seq
            item.seq.status = Status.RUNNING
            bisect.insort(self.prelude_q, item, key=_order)
            self.stats.swap_ins += 1
            self.stats.swap_in_shared_blocks += len(shared)

    def _preempt_for(self, needy: WorkItem, taken: list[WorkItem]) -> bool:
        """Free blocks for `needy`: swap out the latest-arrived sequence that is between tokens, or
        else drop the KV of a partly prefilled prompt (recomputing a prompt reproduces its KV).
        False if nothing can go."""
        candidates = [i for i in self.prelude_q if i.seq is not needy.seq and i not in taken]
        if candidates:
            victim = max(candidates, key=lambda i: i.seq.arrival_index)
            if victim.group is not None:  # its drafts are dropped: it resumes from its last accepted token
                self.prelude_q = _without(self.prelude_q, victim.group.items)
                victim = WorkItem(victim.seq, victim.order, self.pool, slot=victim.slot)
            else:
                self.prelude_q.remove(victim)
                self._drop_item(victim)  # (a plain item may have kept its row from its last token)
            sid = victim.seq.request_id
            self.kv.swap_out(sid, victim.position + 1)  # not the rows of its dropped drafts
            del self.running[sid]
            victim.seq.status = Status.SWAPPED
            self.swapped.append(victim)
            self.swapped = deque(sorted(self.swapped, key=lambda i: i.seq.arrival_index))
            self.stats.preemptions += 1
            return True
        return self._drop_partial_prefill()

    def _drop_partial_prefill(self) -> bool:
        """Drop the KV of the latest-arrived partly prefilled prompt (recomputed later, which
        reproduces its KV). False if there is none."""
        # not one whose chunk is queued and unread (a follow-up prelude landing an async coda first
        # may need blocks): its prefill result must still find its KV
        partial = [s for s in self.waiting if s.request_id in self.running and s.request_id not in self.prefilling]
        if not partial:
            return False
        victim = max(partial, key=lambda s: s.arrival_index)
        self._release(victim)
        victim.status = Status.WAITING
        victim.metrics.prefill_loops = 0  # the prompt's loops are counted once, when recomputed
        self.stats.preemptions += 1
        return True

    def _reserve_kv(self, item: WorkItem, taken: list[WorkItem]) -> bool:
        while not self.kv.ensure(item.seq.request_id, item.position + 1):
            if not self._preempt_for(item, taken):
                return False
        return True

    def _prelude_plan(self, limit: int) -> StagePlan | None:
        """A PRELUDE batch of at most `limit` queued items (FIFO), each given its next KV slot and a state
        row if it holds none (a verify group's items all or none; a group wider than the rows left is trimmed
        to them, so it never holds up the queue: fewer drafts are verified, the tokens are the same). None:
        no item."""
        pool, kv = self.pool, self.kv
        capacity = kv.num_blocks * kv.block_size
        # Most ticks, the queue's head is plain items that kept their rows from their last token (their
        # positions and slots are read from the pool) and whose KV fits the cache: room for their tokens is
        # made in one call (at most a block each). The rest go one by one, below: a verify group, a token
        # the pool is short for (which may preempt), a sequence longer than the whole cache. (No queued
        # item's sequence is swapped out when a plan starts: a preempted item leaves the queue.)
        head = self.prelude_q[:limit]
        rows = rows_of(head)
        rowless = rows < 0
        fresh_items = rowless.any()
        if fresh_items:  # items that hold no row yet: as many as there are free rows
            need = np.cumsum(rowless)
            cut = int(np.searchsorted(need, pool.num_free, side="right"))  # (the first that finds none)
            head, rows, rowless = head[:cut], rows[:cut], rowless[:cut]
        positions, slots = pool.position[rows], pool.kv_slot[rows]
        if fresh_items:
            fresh = np.flatnonzero(rowless)
            positions[fresh] = np.fromiter((head[k]._position for k in fresh.tolist()), np.int64, len(fresh))
            slots[fresh] = np.fromiter((head[k].slot for k in fresh.tolist()), np.int64, len(fresh))
        run = len(head)
        if self.speculator is not None:
            run = next((k for k, i in enumerate(head) if i.group is not None), run)
        too_long = (positions[:run] >= capacity).nonzero()[0]  # (not `np.flatnonzero`: five Python calls)
        run = int(too_long[0]) if len(too_long) else run
        got = kv.ensure_slots(slots[:run], positions[:run] + 1)
        taken = head[:got]
        free = pool.num_free - int(np.count_nonzero(rowless[:got]))  # rows left for the items below
        for item in self.prelude_q[len(taken):]:
            room = min(limit - len(taken), free if item.row < 0 else 1)
            if room <= 0:
                if len(taken) >= limit:
                    break
                continue  # (no row for it; one that holds a row may still go)
            seq = item.seq
            if seq.status is Status.SWAPPED:  # swapped out for an earlier item
                continue
            unit = [item]
            group = item.group
            if group is not None:
                if item is not group.items[0]:
                    continue  # taken (or not) with the group's first item
                if len(group.items) > room:
                    self._trim_queued_group(group, room)
                unit = group.items
            last = unit[-1]  # the unit's last KV row
            if last.position + 1 > capacity:
                self.prelude_q = _without(self.prelude_q, unit)  # longer than the whole cache: it can never fit
                self._drop_item(item)
                seq.finish("error", f"sequence of {seq.num_tokens} tokens exceeds the KV cache "
                                    f"({capacity} tokens)", error_status=400)
                self._finish(seq)
            elif self._reserve_kv(last, taken):
                taken += unit
                free -= sum(1 for i in unit if i.row < 0)
        self.prelude_q = _without(self.prelude_q, taken)
        if not taken:
            return None
        rows, kv_slots, kv_positions = rows[:got], slots[:got], positions[:got]
        rest = taken[got:]
        if rest:  # (most ticks none: the head took them all)
            rows = np.concatenate([rows, rows_of(rest)])
            kv_slots = np.concatenate([kv_slots, np.array([i.slot for i in rest], np.int64)])
            kv_positions = np.concatenate([kv_positions, np.array([i.position for i in rest], np.int64)])
        rows = pool.allocate(taken, rows, kv_slots, kv_positions, kv.block_tables.rows(kv_slots, kv_positions))
        return StagePlan(Stage.PRELUDE, taken, rows=rows)

    def _trim_queued_group(self, group: VerifyGroup, n: int) -> None:
        """Keep the first `n` rows of a verify group still in the prelude queue (no rows, no KV written
        by it yet): its last drafts are not verified this round. Its first row alone is a plain item
        (fed the last accepted token at its position): no round at all."""
        self.prelude_q = _without(self.prelude_q, group.items[n:])
        group.items, group.tokens = group.items[:n], group.tokens[:n]
        if n == 1:
            group.items[0].group = None

    def _owed_blocks(self) -> int:
        """Blocks the admitted, partly prefilled prompts still need to finish (with their samples' copies)."""
        return sum(self.kv.blocks_needed(s.request_id, len(s.prompt_ids) + 1) + self._fork_blocks(s)
                   for s in self.waiting if s.request_id in self.running)

    def _draft_plan(self, limit: int) -> StagePlan | None:
        """Speculative decoding (docs/design.md §12): the plain items of requests that draft this round
        among the queue's first `limit` rows (FIFO, a verify group counting a row per position, a new
        one capped to the rows left), each with the KV rows its verify group will write (taken only if
        free: a request that would need preemption decodes plainly instead). None when nothing drafts."""
        spec = self.speculator
        if spec is None:
            return None
        resident, width = len(self.running), min(self.cfg.max_decode_batch, self.pool.rows)
        # drafts take only blocks no one else is owed: never the safety margin or what admitted prompts need
        spare = self.kv.num_free - self._owed_blocks() - self._margin_blocks
        items: list[WorkItem] = []
        lens: list[int] = []
        rows, limit = 0, min(limit, self.pool.num_free)  # rows the queue takes in order (a group: one a position)
        for item in self.prelude_q:
            if rows >= limit:
                break
            rows += 1
            if item.group is not None:
                continue
            k = min(spec.tokens_for(item.seq, resident, width), limit - rows)  # its group fits the rows left
            need = self.kv.blocks_needed(item.seq.request_id, item.position + 1 + k) if k > 0 else 0
            if k > 0 and need <= spare and self.kv.ensure(item.seq.request_id, item.position + 1 + k):
                spare -= need
                rows += k
                items.append(item)
                lens.append(k)
        return StagePlan(Stage.DRAFT, items, draft_lens=lens) if items else None

    def after_draft(self, plan: StagePlan, drafts: list[list[int]]) -> None:
        """Each drafting item still queued becomes its verify group: k + 1 items fed x_t and the drafts,
        in the item's place in the queue (orders item.order + i: `_draft_plan` sized the drafts for
        that place), to enter the loop together."""
        queued = {id(i) for i in self.prelude_q}
        groups: dict[int, list[WorkItem]] = {}
        for item, tokens in zip(plan.items, drafts, strict=True):
            if id(item) not in queued:
                continue
            group = VerifyGroup(item.seq, item.position, [item.token, *tokens])
            group.items = [WorkItem(item.seq, item.order + i, self.pool, position=item.position + i, group=group,
                                    slot=item.slot) for i in range(len(group.tokens))]
            groups[id(item)] = group.items
            self._drop_item(item)  # (its row, if it kept one: the group's items take theirs in their prelude)
        self.prelude_q = [g for i in self.prelude_q for g in groups.get(id(i), (i,))]

    def _take_prefill(self) -> list[PrefillChunk]:
        """Prompt chunks for this tick, FIFO within the token budget.

        An admitted, partly prefilled prompt continues whenever its next chunk fits. A new prompt is
        admitted only if the pool can hold all of it (plus its first generated token) on top of what
        the admitted prompts still need, keeping the safety margin free unless nothing else runs:
        admitting chunk by chunk without this lets two half-prefilled prompts hold the pool between
        them with neither able to finish.
        """
        if self.swapped:  # resume preempted requests before admitting new ones
            return []
        cfg, kv = self.cfg, self.kv
        budget = cfg.max_num_batched_tokens
        chunks: list[PrefillChunk] = []
        margin = self._margin_blocks
        free = kv.num_free
        owed = self._owed_blocks()
        resident = self.resident()
        pending: set[bytes] | None = None  # prompt blocks being prefilled (`_pending_prompt_keys`), on first need,
        fresh: set[bytes] = set()  # and those of the prompts admitted in this tick (running only once it is planned)
        for seq in list(self.waiting):
            sid = seq.request_id
            admitted = sid in self.running
            if not admitted and resident + 1 + len(seq.pending_forks) > cfg.max_num_seqs:
                break
            hit = [] if admitted else self._cached_prefix(seq)  # a new prompt's cached blocks
            if not admitted and self._prefix_reusable(seq) > len(hit):
                pending = self._pending_prompt_keys() if pending is None else pending
                key = self._prompt_keys(seq)[len(hit)]
                if key in pending or key in fresh:  # an admitted prompt is computing its next block:
                    self.stats.prefix_cache_waits += 1  # it comes from the cache once that chunk has run, not
                    continue  # computed twice beside it (prompts that share a system prompt, arriving together)
            start = self.prefill_pos[sid] if admitted else len(hit) * kv.block_size
            n = min(cfg.prefill_chunk_size - start % cfg.prefill_chunk_size, len(seq.prompt_ids) - start)
            if n > budget:
                break
            last = start + n == len(seq.prompt_ids)
            # a new prompt allocates all but its cached blocks, and the cached ones no one holds leave the free count
            hit_cost = kv.share_cost(hit) - len(hit)
            need = kv.blocks_needed(sid, start + n + (1 if last else 0)) + (self._fork_blocks(seq) if last else 0)
            if admitted:
                if need > free:
                    break
                owed -= need
            else:
                need += hit_cost
                whole = kv.blocks_needed(sid, len(seq.prompt_ids) + 1) + self._fork_blocks(seq) + hit_cost
                idle = not chunks and not self.running  # an otherwise idle engine admits whatever fits
                if whole + owed > free - (0 if idle else margin):
                    break
                owed += whole - need
                self._admit(seq, hit)  # its cached blocks are held from now: later allocations cannot evict them
                resident += 1 + len(seq.pending_forks)
                if self.prefix_scope is not None:  # (its blocks are being computed from now on too)
                    fresh.update(self._prompt_keys(seq)[len(hit):len(seq.prompt_ids) // kv.block_size])
            free -= need
            budget -= n
            chunks.append(PrefillChunk(seq, start, n))
        for c in chunks:
            sid = c.seq.request_id
            self.prefilling.add(sid)  # until after_prefill reads this chunk's result
            kv.ensure(sid, c.start + c.n)
            if sid not in self.running:
                self.running[sid] = c.seq
                c.seq.status = Status.RUNNING
            full = kv.blocks(sid)[: len(c.seq.prompt_ids) // kv.block_size]
            for fork in c.seq.pending_forks if c.last else ():  # they get the prompt's KV with this chunk:
                kv.adopt(fork.request_id, full)  # its full blocks shared (read-only from now on),
                self._seat(fork)
                kv.ensure(fork.request_id, len(fork.prompt_ids) + 1)  # the rest copied (runner.prefill)
                self.running[fork.request_id] = fork
                fork.status = Status.RUNNING
        return chunks

    def _cached_prefix(self, seq: Sequence) -> list[int]:
        """The cached blocks a new prompt may start from (none for requests that skip reading the cache, as those
        that want every prompt position's logprobs do: the skipped positions would have none)."""
        most = self._prefix_reusable(seq)
        if not most:
            return []
        blocks = self.kv.cached_blocks(self._prompt_keys(seq)[:most])
        return blocks[: reusable_tokens(len(blocks), len(seq.prompt_ids), self.kv.block_size, self._prefix_align)
                      // self.kv.block_size]

    def _prefix_reusable(self, seq: Sequence) -> int:
        """The most prompt blocks a new prompt could take from the cache, were they all there (0 for requests that
        skip reading it, `SamplingParams.reads_prefix_cache`: those that want every prompt position's logprobs, say;
        or without a prefix cache)."""
        if self.prefix_scope is None or not seq.params.reads_prefix_cache:
            return 0
        bs = self.kv.block_size
        return reusable_tokens(len(seq.prompt_ids) // bs, len(seq.prompt_ids), bs, self._prefix_align) // bs

    def _pending_prompt_keys(self) -> set[bytes]:
        """The keys of the prompt blocks that admitted prompts are still to prefill (each is published, and found in
        the cache, once the chunk that completes it has run; asked only with a prefix cache)."""
        bs = self.kv.block_size
        return {key for seq in self.waiting if seq.request_id in self.running
                for key in self._prompt_keys(seq)[self.prefill_pos[seq.request_id] // bs:len(seq.prompt_ids) // bs]}

    def _cached_prompt_blocks(self, seq: Sequence) -> list[int]:
        """Cached blocks holding the KV of the prompt's first full blocks (a swapped-in sequence
        shares them again instead of copying them back: same key, bit-identical KV, §4.3)."""
        if self.prefix_scope is None:
            return []
        return self.kv.cached_blocks(self._prompt_keys(seq)[: len(seq.prompt_ids) // self.kv.block_size])

    def _prompt_keys(self, seq: Sequence) -> list[bytes]:
        """The prefix-cache keys of the prompt's full blocks (computed once per request)."""
        if seq.block_hashes is None:
            assert self.prefix_scope is not None
            seq.block_hashes = block_keys(self.prefix_scope, seq.rule.max_loops,
                                          seq.state_base if self.random_state else None, seq.prompt_ids,
                                          self.kv.block_size, seq.cache_salt)
        return seq.block_hashes

    def _admit(self, seq: Sequence, hit: list[int]) -> None:
        """A new prompt takes its cached blocks (a table even without any) and prefills after them."""
        sid = seq.request_id
        self.kv.adopt(sid, hit)
        self._seat(seq)
        cached = len(hit) * self.kv.block_size
        self.prefill_pos[sid] = seq.num_cached_tokens = cached
        if self.prefix_scope is not None and seq.params.reads_prefix_cache:
            # each sample looks the prompt up, as vLLM's child requests do: this one finds `cached`, the samples that
            # fork from its prefill find the full blocks it computes (which they share), as a later lookup would
            forks = len(seq.pending_forks)
            self.stats.prefix_cache_queries += len(seq.prompt_ids) * (1 + forks)
            self.stats.prefix_cache_hits += cached + forks * self._prefix_reusable(seq) * self.kv.block_size

    def _seat(self, seq: Sequence) -> None:
        """`seq` was given a block-table slot: its facts and its held tokens go by that slot now."""
        slot = self.kv.slot(seq.request_id)
        self.pool.sequences.admit(slot, seq)
        self.pool.held.admit(slot, seq)

    def _fork_blocks(self, seq: Sequence) -> int:
        """KV blocks the samples forking from `seq`'s prefill take: each shares the prompt's full blocks
        and owns the rest (the partial last block, room for its first generated token)."""
        return len(seq.pending_forks) * self._own_blocks(len(seq.prompt_ids))

    def _own_blocks(self, prompt_len: int) -> int:
        """The blocks a sample forked from a prompt of `prompt_len` tokens owns at its first token."""
        return self.kv.allocator.blocks_for(prompt_len + 1) - prompt_len // self.kv.block_size

    # -- the decision ---------------------------------------------------------------------------------
    def schedule(self) -> StagePlan:
        plan = self._plan_or_prefill()
        # Backstop for a stall (nothing can run while partly prefilled prompts hold the pool).
        while plan.stage is Stage.IDLE and self._drop_partial_prefill():
            plan = self._plan_or_prefill()
        return plan

    def _plan_or_prefill(self) -> StagePlan:
        plan = self._plan()
        if plan.stage is Stage.IDLE and self.waiting:  # nothing else can run: the prompts wait for no one
            plan = self._prefill_turn(owed_first=False) or plan
        return plan

    def _plan(self) -> StagePlan:
        raise NotImplementedError

    def _prefill_turn(self, owed_first: bool = True) -> StagePlan | None:
        """A prefill tick, if prompts wait and it is their turn: not while a token that was in flight at the last
        prefill tick still waits for its sample (`owed_first`). Each decoding sequence thus gets at least a token
        between two prefill ticks, as in vLLM, where every step runs the decode rows and prefill takes what is
        left of the token budget. (Prefill first without this starved decoding: prompts that finish in their
        prefill, `max_tokens` 1 or a beam search's steps, kept the queue full and no sequence got a token.)"""
        if not self.waiting or (owed_first and self._tokens_owed()):
            return None
        chunks = self._take_prefill()
        if not chunks:
            return None
        self._prefill_mark = self._next_order
        return StagePlan(Stage.PREFILL, chunks=chunks)

    def _tokens_owed(self) -> bool:
        """Whether an item created before the last prefill tick has not had its token sampled yet (queues in
        creation order: the prelude queue's head is its oldest; the core and coda rows by one array read)."""
        mark = self._prefill_mark
        if self.prelude_q and self.prelude_q[0].order < mark:
            return True
        order = self.pool.order
        if any(len(rows) and order[rows].min() < mark for rows in (self.core_rows, self.coda_rows)):
            return True
        return any(i.order < mark for i in self.coda_running)

    def follow_up(self, plan: StagePlan) -> StagePlan | None:
        """A stage batch to run in the same tick right after `plan` (none by default)."""
        return None

    # -- results ----------------------------------------------------------------------------------------
    def after_prefill(self, plan: StagePlan, samples: dict[str, Sample],
                      prompt_logprobs: list[tuple[Sequence, int, dict[str, np.ndarray]]] | None = None,
                      broken: list[int] | None = None) -> None:
        """`broken`: the chunks (indices in the plan) whose tokens' states went non-finite: their requests fail."""
        for i in broken or ():
            self.fail(plan.chunks[i].seq, NonFiniteError(NON_FINITE_PROMPT))
        for seq, position, rows in prompt_logprobs or ():
            if seq.finished:
                continue
            try:
                seq.set_prompt_logprobs(position, rows)
            except Exception as e:
                self.fail(seq, e)
        self.prefilling.difference_update(c.seq.request_id for c in plan.chunks)
        for c in plan.chunks:
            if c.seq.finished:  # failed above
                continue
            seq = c.seq
            self.prefill_pos[seq.request_id] = c.start + c.n
            if self.prefix_scope is not None:  # publish the prompt blocks this chunk completed
                bs = self.kv.block_size
                first, end = c.start // bs, (c.start + c.n) // bs
                if end > first:
                    self.kv.publish(seq.request_id, first, self._prompt_keys(seq)[first:end])
            self.stats.prefill_token_loops += c.n * seq.rule.max_loops
            seq.metrics.prefill_loops += c.n * seq.rule.max_loops
            if not c.last:
                continue
            self.waiting.remove(seq)
            self.stats.prompt_tokens += len(seq.prompt_ids)
            forks, seq.pending_forks = seq.pending_forks, []
            now = request_clock()
            self._append_token(seq, samples[seq.request_id], seq.rule.max_loops, now)
            for fork in forks:  # the runner copied the prompt's KV to them: they go on from here
                self.prefill_pos[fork.request_id] = len(fork.prompt_ids)
                fork.prompt_logprobs = seq.prompt_logprobs
                self._append_token(fork, samples[fork.request_id], fork.rule.max_loops, now)
            self.stats.sampled_prompt_tokens += sum(len(s.prompt_ids) for s in (seq, *forks) if s.output_ids)

    def after_prelude(self, plan: StagePlan) -> None:
        rows = plan.rows
        assert rows is not None
        self.pool.start_loops(plan.items, rows)
        if len(rows):  # each fresh item that joins a non-empty core queue (the first may find it empty)
            self.stats.refill_events += len(rows) - (0 if len(self.core_rows) else 1)
        # both are in creation order, and the fresh items usually all come after the looping ones
        core = np.concatenate([self.core_rows, rows])
        order = self.pool.order[core]
        if (order[1:] < order[:-1]).any():  # a swapped-in or verify item older than the batch's tail
            core = core[np.argsort(order, kind="stable")]
        self.core_rows = core

    def advance_core(self, rows: np.ndarray, generations: np.ndarray) -> np.ndarray:
        """A core step ran on the items in state-pool rows `rows` (those whose row still holds the item it
        held when the step was queued, `generations`): count it, and return the rows whose exit was settled
        before the step (a delayed-lookahead decision, a lookahead_gate stop, `max_loops`): they leave the
        loop with the rows this step's signals decide (`observe_core`'s `settled`). Needs no signal of this
        step, so the engine calls it before the step's signals are read back. One compiled pass over the
        batch's arrays."""
        active, done = self.pool.advance(rows, generations)
        self.stats.useful_core_rows += active
        return done

    def observe_core(self, rows: np.ndarray, generations: np.ndarray, signals: Signals,
                     settled: np.ndarray | None = None) -> None:
        """Apply each item's exit rule to the signal of the step it last ran (rows: state-pool rows,
        `generations` their allocation counts when the step was queued). For rules that decide ahead
        this may come a tick late (after the next step was queued): it then only settles what happens
        after that next step. Rows whose item exited, finished or changed meanwhile are skipped. The rows
        that stop looping leave the core queue together with `settled` (the step's `advance_core`), in one
        `_exit`.

        The whole batch is decided at once (`StatePool.settle`); if that raises, rows are decided one
        by one, so a failure ends only the request it belongs to."""
        pool = self.pool
        if self.signal_hooks:
            same = pool.generation[rows] == generations  # the row still holds the item that ran the step
            items = [pool.items[r] for r in rows[same].tolist()]
            values = [signals.row(k) for k in np.flatnonzero(same).tolist()]
            for hook in self.signal_hooks:
                hook(items, values)  # type: ignore[arg-type]
        failed = False
        try:
            done, bad = pool.settle(rows, generations, signals)
        except Exception:  # decide row by row: only the rows that raise fail
            if settled is not None:  # (they leave first, as a failure below may free rows)
                self._exit(settled)
                settled = None
            failed, picked, broken = True, [], []
            for k in range(len(rows)):
                one = slice(k, k + 1)
                try:
                    d, b = pool.settle(rows[one], generations[one], signals.take(one))
                except Exception as e:
                    self._row_failed(int(rows[k]), e)
                    continue
                picked += (d + k).tolist()
                broken += (b + k).tolist()
            done, bad = np.array(picked, np.int64), np.array(broken, np.int64)
        if failed or len(bad):
            if settled is not None:
                self._exit(settled)
                settled = None
            for row in rows[bad].tolist():
                item = pool.items[row]
                if item is not None:
                    self._row_failed(row, NonFiniteError(
                        f"the model produced a non-finite {item.seq.rule.policy} signal for this request"))
            done = done[pool.generation[rows[done]] == generations[done]]  # a failed request freed its rows
        leaving = rows[done]
        self._exit(leaving if settled is None or not len(settled) else np.concatenate([settled, leaving]))

    def _row_failed(self, row: int, error: Exception) -> None:
        """The item in state-pool row `row` failed (its exit rule raised, or its signal is not finite):
        its request fails, unless the row verifies a draft (a verify group's row after the first).
        Plain decoding computes that position only if the drafts before it are accepted, so the
        group is cut before the row and the round goes on; if plain decoding does reach the position,
        the next round's first row, fed the true token, fails the same way (docs/design.md §12)."""
        item = self.pool.items[row]
        if item is None:  # freed with an earlier row of its verify group
            return
        group = item.group
        if group is None or item is group.items[0]:
            self.fail(item.seq, error)
            return
        log.warning("request %s: a row verifying a draft failed (%s); its round is cut there", item.seq.request_id,
                    error)
        self._cut_group(group, group.items.index(item))

    def _cut_group(self, group: VerifyGroup, i: int) -> None:
        """Rows i.. of a verify group leave its round (their KV depth reset, their loops counted as
        spent); the round emits at most the sample of row i - 1 after the accepted drafts. The request
        pauses drafting (a draft it keeps proposing would fail again)."""
        cut = group.items[i:]
        self._remove_items(cut)
        self.kv_depth_writes.append((self.pool.kv_row[rows_of(cut)], np.full(len(cut), IN_FLIGHT)))
        self._discard_items(cut)
        group.items, group.tokens = group.items[:i], group.tokens[:i]
        assert self.speculator is not None
        self.speculator.pause(group.seq)

    def _remove_items(self, items: list[WorkItem]) -> None:
        """Take work items out of the decode queues (they still hold their state rows)."""
        self.prelude_q = _without(self.prelude_q, items)
        rows = rows_of([i for i in items if i.row >= 0])
        self.core_rows = self.pool.without(self.core_rows, rows)
        self.coda_rows = self.pool.without(self.coda_rows, rows)
        self.coda_running = _without(self.coda_running, items)

    def _exit(self, rows: np.ndarray) -> None:
        """The items in these state-pool rows stop looping: their KV depth is the loops they ran
        (written by the engine after this tick, batched), and they leave the core queue in one pass
        (not a list.remove each)."""
        if not len(rows):
            return
        pool = self.pool
        self.kv_depth_writes.append((pool.kv_row[rows], pool.r[rows]))
        counted = rows
        if self.speculator is not None:  # a verify row's depth counts once accepted
            counted = rows[np.fromiter((item.group is None for item in self._items_at(rows)), bool, len(rows))]
        self.stats.count_exits(pool.exits.exit_depth[counted])
        self.core_rows = self.pool.without(self.core_rows, rows)
        self.on_exit(rows)

    def on_exit(self, rows: np.ndarray) -> None:
        """The items in these state-pool rows left the core queue: they wait for their coda."""
        self.coda_rows = np.concatenate([self.coda_rows, rows])

    def _start_coda(self, items: list[WorkItem], rows: np.ndarray | None = None) -> StagePlan:
        """A coda batch of `items` (in state-pool rows `rows`, if known)."""
        rows = rows_of(items) if rows is None else rows
        self.coda_rows = self.pool.without(self.coda_rows, rows)
        self.coda_running += items
        return StagePlan(Stage.CODA, items, rows=rows)

    def after_coda(self, plan: StagePlan, samples: SampledBatch) -> None:
        """Append each item's sampled token (maybe a tick after the coda was queued: an item aborted
        meanwhile is skipped)."""
        index = {id(item): j for j, item in enumerate(plan.items)} if self.speculator is not None else {}
        pool = self.pool
        if self.coda_running == plan.items:  # (identity: items compare by it) the one coda in flight, whole
            taken, kept, self.coda_running, rows = plan.items, None, [], plan.rows
            tokens, ok = samples.tokens, samples.ok
        else:
            running = {id(i) for i in self.coda_running}
            kept = [j for j, i in enumerate(plan.items) if id(i) in running]  # (plan rows)
            taken = [plan.items[j] for j in kept]
            tokens, ok = samples.tokens[kept], samples.ok[kept]
            self.coda_running = _without(self.coda_running, taken)
            rows = rows_of(taken)
        assert rows is not None
        # the rows whose token needs no per-row check (most): their ids, exit depths and loops run go to
        # `HeldTokens` and their items keep their rows as the items of the next tokens, queued in batch order, in
        # one compiled pass (`StatePool.requeue_quiet`; no `Sample` is made for them); a streamed one's text is then
        # decoded and its output queued; the rest take theirs one by one.
        allowed = ok
        if self.speculator is not None:  # (a verify group's rows are released in _accept)
            allowed = ok & np.fromiter((i.group is None for i in taken), bool, len(taken))
        now = request_clock()  # (the batch's tokens arrived together)
        picked, slots = pool.requeue_quiet(taken, rows, tokens, allowed, self._next_order, self._order_step, now)
        n = len(picked)
        self._new_orders(n)  # (the orders the pass gave them)
        self.stats.generated_tokens += n
        if n == len(taken):  # most ticks: every row (nothing selected, no Python per row)
            loud, requeued, loops, depths = [], taken, [], []
        else:
            quiet = np.zeros(len(taken), bool)
            quiet[picked] = True
            loud = np.flatnonzero(~quiet).tolist()
            loud_rows = rows[loud]
            loops, depths = pool.r[loud_rows].tolist(), pool.exits.exit_depth[loud_rows].tolist()
            pool.release_all([item for item in (taken[j] for j in loud) if item.group is None])
            requeued = [taken[k] for k in picked.tolist()]
        self.prelude_q += requeued
        for k in pool.sequences.streams[slots].nonzero()[0].tolist():  # streamed: text, then an output
            seq = requeued[k].seq
            try:
                seq.decode_pending()  # (here, where a failure fails this request alone)
            except Exception as e:
                self.fail(seq, e)
                continue
            self.appended.append(seq)
        self._kv_to_free = []  # (nothing is allocated before the loop ends)
        try:
            for j, loops_run, depth in zip(loud, loops, depths, strict=True):
                item = taken[j]
                sample = samples[j if kept is None else kept[j]]
                if item.group is not None:  # a verify group runs one coda, whole (CDB holds it until then)
                    if item is item.group.items[0]:
                        self._accept(item.group, [samples[index[id(i)]] for i in item.group.items], now)
                    continue
                item.seq.metrics.loops_run += loops_run
                self._append_token(item.seq, sample, depth, now, spent=item)
        finally:
            finished, self._kv_to_free = self._kv_to_free, None
            self.kv.free_all(finished)

    def _accept(self, group: VerifyGroup, samples: list[Sample], now: float) -> None:
        """A verify round's coda ran (docs/design.md §12). Row i was fed x_t or draft i and sampled
        the token after it with plain decoding's draw; while the drafts equal those samples, each row
        was fed the true token, so its computation, exit depth and sample are plain decoding's. Emit
        the samples of those rows and of the first row after them; the later rows are discarded:
        their exit depths are not published and their KV depth is reset (nothing reads those
        positions before a later token rewrites them)."""
        seq, items, drafts = group.seq, group.items, group.drafts
        depths = [int(d) for d in self.pool.exits.exit_depth[rows_of(items)]]
        kv_rows = self.pool.kv_row[rows_of(items)]
        self._discard_items(items)  # rejected rows' loops were spent too
        matched = 0
        while matched < len(drafts) and samples[matched].token == drafts[matched]:
            matched += 1
        assert self.speculator is not None
        self.speculator.record(seq, len(drafts), matched)
        self.stats.spec_rounds += 1
        self.stats.spec_draft_tokens += len(drafts)
        self.stats.spec_accepted_tokens += matched
        for j in range(matched):  # (a round drafts at most the engine's k: a request may ask for fewer, not more)
            self.stats.spec_accepted_per_pos[j] += 1
        before = len(seq.output_ids)
        for i in range(matched + 1):
            if not self._append_token(seq, samples[i], depths[i], now, next_item=False):
                break  # finished (a stop, max_tokens) or failed
        emitted = len(seq.output_ids) - before
        self.stats.count_exits(np.array(depths[:emitted], np.int64))
        self.stats.spec_tokens += emitted
        if not seq.finished:
            self.kv_depth_writes.append((kv_rows[emitted:], np.full(len(items) - emitted, IN_FLIGHT)))
            self._new_item(seq)

    def _append_token(self, seq: Sequence, sample: Sample, exit_depth: int, now: float,
                      next_item: bool = True, spent: WorkItem | None = None) -> bool:
        """Give a sequence its sampled token (arrived at `now`; a failure finishes it alone), then finish it
        or (with `next_item`) queue the work item of its next token (`spent`: the plain item that computed
        this one, reused). True if the sequence goes on."""
        try:
            seq.take(sample, exit_depth, now)
        except Exception as e:
            self.fail(seq, e)
            return False
        if seq.streams:  # (the others report when they finish)
            self.appended.append(seq)
        self.stats.generated_tokens += 1
        if seq.finished:
            self._finish(seq)
            return False
        if next_item:
            self._new_item(seq, spent)
        return True

    # -- checks (tests call these between steps) -------------------------------------------------------
    def check_invariants(self) -> None:
        """Bookkeeping that holds between any two steps."""
        queued = np.concatenate([self.core_rows, self.coda_rows]).tolist()
        assert all(self.pool.items[r] is not None for r in queued), "a freed state row is still queued"
        items = self.prelude_q + self.core_q + self.coda_q + self.coda_running
        ids = [i.seq.request_id for i in items if i.group is None or i is i.group.items[0]]  # a group is one
        present = {id(i) for i in items}
        for i in items:
            assert i.group is None or all(id(j) in present for j in i.group.items), "verify group split up"
        swapped = [i.seq.request_id for i in self.swapped]
        partial = {s.request_id for s in self.waiting if s.request_id in self.running}
        assert len(ids) + len(swapped) == len(set(ids) | set(swapped)), "two in-flight items for one sequence"
        for q in (self.prelude_q, self.core_q):
            assert [i.order for i in q] == sorted(i.order for i in q), "queue out of creation order"
        # every admitted sequence is in exactly one place: prefilling its prompt, or one work item
        assert set(self.running) == partial | set(ids) and not partial & set(ids), "admitted sequence misplaced"
        assert not set(self.running) & set(swapped), "sequence both resident and swapped"
        assert self.resident() <= self.cfg.max_num_seqs, "more resident sequences than max_num_seqs"
        assert not self.prefilling, "a prefill chunk's result was never read"
        for s in [*self.waiting, *self.running.values(), *(i.seq for i in self.swapped)]:
            assert not s.finished, f"finished sequence {s.request_id} still queued"
        for s in self.waiting:
            if s.request_id not in self.running:
                assert s.request_id not in self.kv.tables, f"waiting sequence {s.request_id} holds KV"
        self.kv.check_invariants(set(self.running) | set(swapped))
        for s in [*self.running.values(), *(i.seq for i in self.swapped)]:
            slot = self.kv.slot(s.request_id)
            assert self.pool.sequences.matches(slot, s), f"slot facts of {s.request_id} are not its own"
        assert self.pool.sequences.stops_counted(), "stop-token counts are not the slots' stop tokens"
        held = self.pool.held
        for slot in np.flatnonzero(held.count).tolist():  # (nothing here settles them: `Sequence.loops_run`)
            owner = held.owners[slot]
            assert owner is not None and owner.held is held and owner.slot == slot, "held tokens without a holder"
            assert owner.request_id in self.running or owner in (i.seq for i in self.swapped) or owner.finished, \
                "tokens held for a sequence no longer admitted"
        for item in self.swapped:  # its host copy: the KV of its tokens, no row past them (drafts)
            sid = item.seq.request_id
            assert self.kv.is_swapped(sid), f"swapped sequence {sid} has no host copy"
            assert self.kv.num_tokens(sid) <= item.position + 1, f"swapped sequence {sid} keeps draft rows"
        # state rows: core and coda items one each, a plain prelude item the one it kept from its last token
        # (a verify group's items none before their prelude), swapped items none; none shared or leaked
        assert all(i.row < 0 for i in self.swapped), "swapped item holds a row"
        assert all(i.row < 0 for i in self.prelude_q if i.group is not None), "queued verify item holds a row"
        looping = [i.row for i in self.core_q + self.coda_q + self.coda_running]
        assert all(r >= 0 for r in looping), "looping item without a state row"
        rows = looping + [i.row for i in self.prelude_q if i.row >= 0]
        assert len(rows) == len(set(rows)), "state row shared by two items"
        assert sorted(rows + self.pool._free) == list(range(self.pool.rows)), "state row leaked"
        for i in items:
            if i.row >= 0:
                assert self.pool.items[i.row] is i, "state row maps to another item"
        for i in self.core_q + self.coda_q + self.coda_running:  # (a queued prelude item's is set by its plan)
            assert self.pool.kv_row[i.row] == self.kv.row(i.seq.request_id, i.position), "stale KV row"
        for i in self.prelude_q:
            assert i.r == 0 and not i.exited, "queued prelude item with loop state"
        for i in self.core_q:
            assert i.r <= i.seq.rule.max_loops
            assert self.kv.store.depth[self.kv.row(i.seq.request_id, i.position)] == IN_FLIGHT
        for i in self.coda_q + self.coda_running:
            assert i.exited, "item in the coda queue that has not exited"
            assert self.kv.store.depth[self.kv.row(i.seq.request_id, i.position)] == i.r
        for i in self.core_q + self.coda_q + self.coda_running:
            assert self.kv.num_tokens(i.seq.request_id) > i.position, "token without a KV row"
        for i in items + list(self.swapped):
            assert i.slot == self.kv.slot(i.seq.request_id), "work item of another block-table slot"
        # loops: every kept core row belongs to a finished request, a live one, or an in-flight token
        live = sum(s.loops_run for s in self.running.values()) + sum(i.seq.loops_run for i in self.swapped)
        assert self.stats.useful_core_rows == self.retired_loops + live + sum(i.r for i in items), \
            "core loops unaccounted for"

    def check_drained(self) -> None:
        """After the last request finished: nothing queued, every KV block and state row free."""
        self.check_invariants()
        assert not (self.waiting or self.running or self.swapped or self.prelude_q or len(self.core_rows)
                    or len(self.coda_rows) or self.coda_running), "queues not empty"
        assert not self.kv.tables and self.kv.num_free == self.kv.num_blocks, "KV blocks still held"
        assert self.pool.num_free == self.pool.rows, "state rows still held"
        assert self.stats.useful_core_rows == self.retired_loops


def _order(item: WorkItem) -> int:
    return item.order


_NO_ROWS = np.zeros(0, np.int64)


def _without(queue: list[WorkItem], items: list[WorkItem]) -> list[WorkItem]:
    """`queue` without `items`, in one pass (a `list.remove` each is quadratic for a wide batch); when they
    are its head, in order (a prelude batch, usually), by one slice."""
    n = len(items)
    if queue[:n] == items:  # (identity: items compare by it)
        return queue[n:]
    gone = {id(i) for i in items}
    return [i for i in queue if id(i) not in gone]


class CDBScheduler(Scheduler):
    def _plan(self) -> StagePlan:
        self._try_swap_in()
        width = self.cfg.max_decode_batch
        ready = self._ready_for_coda()
        if len(ready) >= self.min_coda_batch:
            return self._coda_plan(ready)
        prefill = self._prefill_turn()
        if prefill is not None:
            return prefill
        room = width - len(self.core_rows)
        if self.prelude_q and room > 0 and (not len(self.core_rows)
                                            or min(len(self.prelude_q), room) >= self.min_prelude_batch):
            plan = self._draft_plan(room)
            if plan is not None:
                return plan
            prelude = self._prelude_plan(room)
            if prelude is not None:
                return prelude
        if len(self.core_rows):
            return StagePlan(Stage.CORE, rows=self.core_rows[:width])
        if len(ready):
            return self._coda_plan(ready)
        return StagePlan(Stage.IDLE)

    def follow_up(self, plan: StagePlan) -> StagePlan | None:
        """After a coda or prefill, the fresh tokens' drafts (speculative decoding), then their preludes
        run in the same tick (as far as the core batch has free width), so a token re-enters the loop
        without a tick of its own."""
        if plan.stage not in (Stage.CODA, Stage.PREFILL, Stage.DRAFT) or not self.prelude_q:
            return None
        width = self.cfg.max_decode_batch - len(self.core_rows)
        if width <= 0:
            return None
        draft = self._draft_plan(width) if plan.stage is not Stage.DRAFT else None
        if draft is not None:
            return draft
        return self._prelude_plan(width)

    def check_invariants(self) -> None:
        super().check_invariants()
        assert len(self.core_rows) <= self.cfg.max_decode_batch, "core batch wider than max_decode_batch"

    def _ready_for_coda(self) -> np.ndarray:
        """The coda queue's rows but those of verify groups some of whose rows still loop (a group
        runs one coda: its rows' coda KV and the acceptance are decided together)."""
        if self.speculator is None:
            return self.coda_rows
        ready = [i.group is None or i.group.exited for i in self.coda_q]
        return self.coda_rows[np.array(ready, bool)]

    def _coda_plan(self, ready: np.ndarray) -> StagePlan:
        """The first `max_decode_batch` of the ready rows in creation order."""
        rows = ready[self.pool.order[ready].argsort(kind="stable")][: self.cfg.max_decode_batch]
        items = self._items_at(rows)
        cut = items[-1].group
        if cut is not None and items[-1] is not cut.items[-1]:  # never part of a group (it fits a batch whole)
            return self._start_coda([i for i in items if i.group is not cut])
        return self._start_coda(items, rows)


class CohortScheduler(Scheduler):
    """CB and CDB no-refill: a cohort runs prelude -> core steps -> coda; work joins between cohorts."""

    keep_exited_in_batch = False

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.cohort: list[WorkItem] = []
        self.cohort_depth: int | None = None  # CB: the loops the cohort runs (its deepest member's max_loops)
        self.cohort_rows: np.ndarray | None = None  # the members' state rows (computed once per cohort)
        self.phase = "none"
        self.core_ticks = 0

    def _plan(self) -> StagePlan:
        if self.phase == "none":
            self._try_swap_in()
            prefill = self._prefill_turn()
            if prefill is not None:
                return prefill
            if not self.prelude_q:
                return StagePlan(Stage.IDLE)
            draft = self._draft_plan(self.cfg.max_decode_batch)
            if draft is not None:  # the cohort forms next tick, with the drafting requests' verify groups
                return draft
            prelude = self._prelude_plan(self.cfg.max_decode_batch)
            if prelude is None:
                return StagePlan(Stage.IDLE)
            self._set_cohort(list(prelude.items))
            self.cohort_rows = prelude.rows
            self.phase, self.core_ticks = "prelude", 0
            return prelude
        if self.phase == "core":
            members = self._core_members()
            if len(members):
                self.core_ticks += 1
                return StagePlan(Stage.CORE, rows=members)
            self.phase = "coda"
        # coda for the whole cohort
        items, rows, self.phase = self.cohort, self._members(), "none"
        self._set_cohort([])
        return self._start_coda(items, rows)

    def _set_cohort(self, items: list[WorkItem]) -> None:
        """The cohort is now `items`: what was derived from the old one is recomputed when next asked."""
        self.cohort, self.cohort_depth, self.cohort_rows = items, None, None

    def _members(self) -> np.ndarray:
        """The cohort's state rows (its members hold rows from their prelude to their coda)."""
        if self.cohort_rows is None:
            self.cohort_rows = rows_of(self.cohort)
        return self.cohort_rows

    def _core_members(self) -> np.ndarray:
        """The rows that run this core tick, none once the cohort is done looping: those not done yet."""
        rows = self._members()
        return rows[~self.pool.exits.done(rows)]

    def after_prelude(self, plan: StagePlan) -> None:
        super().after_prelude(plan)
        self.phase = "core"

    def on_exit(self, rows: np.ndarray) -> None:
        super().on_exit(rows)
        if self.keep_exited_in_batch:
            self.pool.passive[rows] = True

    def _remove_items(self, items: list[WorkItem]) -> None:
        super()._remove_items(items)
        self._set_cohort(_without(self.cohort, items))

    def _stop(self, seq: Sequence, reason: str, error: str | None = None, status: int | None = None) -> None:
        super()._stop(seq, reason, error, status)
        self._set_cohort([i for i in self.cohort if i.seq is not seq])
        if not self.cohort and self.phase != "none":
            self.phase = "none"

    def check_invariants(self) -> None:
        super().check_invariants()
        assert all(i in self.core_q or i in self.coda_q for i in self.cohort), "cohort member lost"
        if self.phase == "none":
            assert not self.cohort and not self.core_q and not self.coda_q, "work outside a cohort"
        else:
            assert set(self.core_q) | set(self.coda_q) == set(self.cohort), "item outside the cohort"


class CDBNoRefillScheduler(CohortScheduler):
    """Exited members leave the core batch; the coda waits for the whole cohort."""


class CBScheduler(CohortScheduler):
    keep_exited_in_batch = True

    def _core_members(self) -> np.ndarray:  # the whole cohort, to full depth whatever the exits
        rows = self._members()
        if self.cohort_depth is None:  # once per cohort (and again if it lost members), not per tick
            pool = self.pool  # (the rules' max_loops by the members' block-table slots: no Python per member)
            self.cohort_depth = int(pool.sequences.rule[pool.kv_slot[rows], ROW_MAX_LOOPS].max())
        return rows if self.core_ticks < self.cohort_depth else _NO_ROWS


def make_scheduler(cfg: EngineConfig, kv: KVCacheManager, pool: StatePool, stats: EngineStats,
                   prefix_scope: bytes | None = None, random_state: bool = False,
                   speculator: Speculator | None = None) -> Scheduler:
    classes = dict(zip(ENGINE_SCHEDULERS, (CBScheduler, CDBNoRefillScheduler, CDBScheduler), strict=True))
    cls = classes[cfg.scheduler]
    return cls(cfg, kv, pool, stats, prefix_scope, random_state, speculator)
