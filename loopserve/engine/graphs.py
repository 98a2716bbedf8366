"""`StageGraphs`: decode core steps (and preludes and codas with layers) on static buffers at bucketed
shapes, replayed as CUDA graphs.

Why: a core step launches every layer's kernels from Python (Ouro-1.4B: 24 layers, a few hundred
kernels per step). At decode widths a GPU runs them faster than the host launches them, so the launch
time, not the kernels, would set the step time. A CUDA graph records a step's launches once and
replays them with one call. The same holds for a prelude or coda with layers (Huginn's); Ouro's prelude
is an embedding lookup and its coda one matmul (both eager), and the sampler after a coda stays eager.
A graph has fixed shapes and addresses, so the stage
runs on static buffers, one graph per stage and bucket:
- the batch is padded to the next rung of 1, 2, 3, 4, 6, 8, 12, 16, 24, ... (`bucket`: under 1.5x the
  rows): padding rows are position 0 of table slot 0 at depth 1. They write their KV only to the
  scratch row, which no real row reads unmasked, and what they read changes nothing but their own
  outputs, which are dropped;
- the key count to the next rung of the same ladder in blocks (at most the block table's width):
  keys past a row's position are masked already (they read the zero row), so more of them add
  nothing to any weight.
Padding changes the shapes of the matmuls and softmaxes, so real rows' results can differ in the last
bits, as they do between any two batch mixes; in float64 the tokens and exit depths stay the
reference's (the tests).
The KV store, the block table and the state pool are read and written in place (the engine gives the
table, from the start, the width of the longest sequence, so it never moves): a step gathers its rows'
states (and injections) from the pool and writes the new ones back inside the graph (padding rows read row 0
and the injection scratch row, and write the
pool's scratch rows, as they write the KV store's), so besides the one upload of the rows' metadata a tick
launches from the host only its copy into the graph's buffer (and the padding's), and the replay.
A bucket's graph is captured the first time a batch needs it (a device synchronization
each), or at start-up up to a key count (`warm_up`, `cuda_graph_warmup_tokens`), all into one memory
pool (they never run at once, and nothing allocated while capturing
outlives it). If the block table is reallocated anyway (a graph holds its address and shape), every
graph is retired and the next ones go to a fresh pool; the retired ones are kept until the next
capture has synchronized the device, since a replay of theirs may still be running.

On the CPU nothing is captured: the same padded stages run eagerly on the static buffers. That is how
the tests check this path against the reference decoder; it is slower than the plain one.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from loopserve.cache.block_table import BlockTables
from loopserve.cache.layout import KVLayout
from loopserve.cache.pool import KVStore
from loopserve.engine.signals import step_signals
from loopserve.models.base import LoopedLM
from loopserve.models.context import ForwardContext

if TYPE_CHECKING:
    from loopserve.engine.runner import StatePool
    from loopserve.engine.stats import EngineStats

LADDER_BASE = (1, 2, 3, 4, 6)  # then doubling: 8, 12, 16, 24, 32, 48, ...
# The rows of a decode batch's metadata, packed on the host and uploaded in one copy a tick (`ModelRunner._pack`):
# each row's position, KV write row, loop depth, block-table slot, state rows read and written, pool row (its
# injection row); a prelude adds its token and random-state seed.
POSITION, KV_WRITE, DEPTH, SLOT, STATE_READ, STATE_WRITE, POOL_ROW, TOKEN, SEED = range(9)
PACKED_ROWS = POOL_ROW + 1  # the rows every stage packs


def bucket(n: int) -> int:
    """The smallest of 1, 2, 3, 4, 6, 8, 12, 16, 24, ... (powers of two and 1.5x them) at or above n >= 1."""
    if n < 1:
        raise ValueError(f"bucket: sizes start at 1, got {n}")
    rung = next((r for r in LADDER_BASE if r >= n), None)
    if rung is None:
        power = 1 << (n - 1).bit_length()  # the power of two at or above n; its 3/4 may do
        rung = power * 3 // 4 if power * 3 // 4 >= n else power
    return rung


def _rungs_to(top: int) -> list[int]:
    """The ladder's rungs up to `top` (a rung), the largest first."""
    rungs = [1]
    while rungs[-1] < top:
        rungs.append(bucket(rungs[-1] + 1))
    return rungs[::-1]


def capture(run: Callable[[], None], device: torch.device, pool: Any = None) -> Callable[[], None]:
    """`run` recorded as a CUDA graph on `device` (into memory pool `pool`, a fresh one if None): run once
    eagerly on a side stream first (lazy initialization: cuBLAS workspaces, buffers made on first use), then
    captured. Returns the graph's replay (which holds the graph). Capture and replay use the current device:
    both make it `device`."""
    with torch.cuda.device(device):
        side = torch.cuda.Stream(device)
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side):
            run()
        torch.cuda.current_stream(device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool, capture_error_mode="thread_local"):
            run()

    def replay() -> None:
        with torch.cuda.device(device):
            graph.replay()
    return replay


class StageGraphs:
    """The static buffers and the prepared (captured) buckets of one engine's decode stages: core steps, and
    preludes and codas with layers."""

    def __init__(self, model: LoopedLM, layout: KVLayout, kv: KVStore, tables: BlockTables, pool: StatePool,
                 scratch_row: int, capture: bool, stats: EngineStats) -> None:
        """`pool`: the state pool whose buffers the steps read and write (its scratch rows take the padding
        rows' writes); `scratch_row`: the KV row padding rows write; `stats`: where the buckets prepared and
        the captures' time are counted."""
        p = next(model.parameters())
        self.model, self.layout, self.kv, self.tables = model, layout, kv, tables
        self.states, self.injects = pool.state, pool.inject
        self.capture = capture
        width = bucket(pool.rows)
        hidden = model.config.hidden_size
        self.state = torch.zeros(width, hidden, dtype=p.dtype, device=p.device)
        self.inject = torch.zeros(width, hidden, dtype=p.dtype, device=p.device) if pool.inject is not None else None
        self.out = torch.zeros(width, hidden, dtype=p.dtype, device=p.device)
        self.logits: torch.Tensor | None = None  # [width, vocab] of the coda, made by its first (eager) run
        # a row's own exit signals, computed in every core step's graph (a few small kernels there, not launches
        # from the host each tick), whichever its batch's rules read; made by the first (eager) run
        self.signal_kinds = {"latent_diff"} | ({"gate"} if model.has_gate else set()) | (
            {"lookahead_gate"} if model.has_lookahead_gate else set())
        self.signals: dict[str, torch.Tensor] | None = None
        self.meta = torch.zeros(SEED + 1, width, dtype=torch.long, device=p.device)  # rows: POSITION ... SEED
        pad = np.zeros((SEED + 1, width), np.int64)  # (token 0, seed 0, state row 0 read: any valid value)
        pad[KV_WRITE], pad[DEPTH] = scratch_row, 1
        pad[STATE_WRITE], pad[POOL_ROW] = pool.scratch_state, pool.scratch_inject
        self._pad = torch.from_numpy(pad).to(p.device)
        self._steps: dict[tuple[str, int, int], Callable[[], None]] = {}
        self._table = tables.table  # (held: its memory cannot be reused by a new table while graphs read it)
        self._retired: list[Callable[[], None]] = []
        self.stats = stats
        self._pool = torch.cuda.graph_pool_handle() if capture else None

    @property
    def buckets(self) -> list[tuple[str, int, int]]:
        """The (stage, width, key count) buckets prepared (captured, on CUDA) since the block table last moved."""
        return list(self._steps)

    def prelude(self, meta: torch.Tensor, max_keys: int) -> None:
        """The prelude (with layers: Huginn's) of the rows whose metadata is `meta` ([SEED + 1, n]) and whose
        longest key count is `max_keys`: each row's initial state written to its STATE_WRITE row, its injection
        to its POOL_ROW."""
        self._replay("prelude", meta, max_keys)

    def core(self, meta: torch.Tensor, max_keys: int) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
        """The core step of the rows whose metadata is `meta` ([PACKED_ROWS, n], `POSITION` ... `POOL_ROW`) and whose
        longest key count is `max_keys`: each row's state read from the pool and the next one written back.
        Returns the states read and written ([n, hidden]) and the rows' own signals (`signal_kinds`, by kind),
        views of the static buffers, valid until the next stage is queued."""
        n = meta.shape[1]
        self._replay("core", meta, max_keys)
        assert self.signals is not None
        return self.state[:n], self.out[:n], {kind: signal[:n] for kind, signal in self.signals.items()}

    def coda(self, meta: torch.Tensor, max_keys: int) -> torch.Tensor:
        """The coda's logits of the rows whose metadata is `meta` (as `core`; a coda writes no state). Returns
        [n, vocab], a view of the static logits (valid until the next coda is queued: sample them first)."""
        self._replay("coda", meta, max_keys)
        assert self.logits is not None
        return self.logits[: meta.shape[1]]

    def _replay(self, stage: str, meta: torch.Tensor, max_keys: int) -> None:
        n = meta.shape[1]
        # the graphs read the device table, and no context is built on this path to bring it up to date (an
        # eager step's does): upload the blocks allocated on the host since the last step
        self.tables.sync()
        if self.tables.table is not self._table:  # the table was reallocated: the graphs read the old one
            self._retire()
        bs = self.tables.block_size
        width = bucket(n)
        keys = min(bucket(-(-max_keys // bs)), self.tables.table.shape[1]) * bs
        self.meta[:len(meta), :n].copy_(meta)
        if n < width:
            self.meta[:, n:width].copy_(self._pad[:, n:width])
        key = (stage, width, keys)
        run = self._steps.get(key)
        if run is None:
            run = self._steps[key] = self._prepare(stage, width, keys)
        run()

    def warm_up(self, stages: list[str], max_width: int, max_tokens: int) -> int:
        """Prepare (on CUDA: capture) now every bucket of `stages` a batch of at most `max_width` rows whose keys
        number at most `max_tokens` may need, so that no batch waits for a capture later; returns the buckets
        prepared. Each runs as a batch of padding rows only (they write the scratch rows alone), the widest and
        longest first (a capture takes its memory from the pool the smaller ones then reuse). Not counted in
        `EngineStats.graph_buckets` / `graph_capture_s`, which count the captures a run waited for. On the CPU
        each bucket's padded stage runs once, eagerly (what the tests check: it changes no request's KV or state)."""
        bs, columns = self.tables.block_size, self.tables.table.shape[1]
        widths = _rungs_to(bucket(max_width))
        key_blocks = sorted({min(b, columns) for b in _rungs_to(bucket(max(1, -(-max_tokens // bs))))}, reverse=True)
        self.tables.sync()
        prepared = 0
        for stage in stages:
            for width in widths:
                self.meta[:, :width].copy_(self._pad[:, :width])
                for blocks in key_blocks:
                    key = (stage, width, blocks * bs)
                    if key in self._steps:
                        continue
                    run = self._steps[key] = self._prepare(stage, width, blocks * bs, counted=False)
                    if not self.capture:
                        run()
                    prepared += 1
        return prepared

    def _retire(self) -> None:
        if self.capture:
            self._retired += self._steps.values()
            self._pool = torch.cuda.graph_pool_handle()
        self._steps.clear()
        self._table = self.tables.table

    def _prepare(self, stage: str, width: int, keys: int, counted: bool = True) -> Callable[[], None]:
        """`counted`: a batch waits for this one (counted in the stats), not the start-up's `warm_up`."""
        if counted:
            self.stats.graph_buckets += 1
        if not self.capture:
            return lambda: self._run(stage, width, keys)
        torch.cuda.synchronize(self.state.device)  # (the capture waits for the queued steps anyway: not their time)
        t0 = time.perf_counter()
        # (both runs of `capture` compute the batch in the buffers now, and the replay that follows writes the
        # same KV again; entering the capture synchronized the device: no retired graph still runs)
        replay = capture(lambda: self._run(stage, width, keys), self.state.device, self._pool)
        self._retired.clear()
        if counted:
            self.stats.graph_capture_s += time.perf_counter() - t0
        return replay

    def _run(self, stage: str, width: int, keys: int) -> None:
        meta = self.meta[:, :width]
        # (no per-row key counts on the host: a decode step reads only `keys`, the padded width; nothing
        # calls `select` on this context, which would need them)
        ctx = ForwardContext(self.kv, self.layout, meta[POSITION], meta[KV_WRITE], meta[DEPTH], None, self.tables,
                             meta[SLOT], np.zeros(0, np.int64), keys)
        if stage == "prelude":
            seeds = meta[SEED] if self.model.draws_random_state else None
            state, inject = self.model.prelude(meta[TOKEN], ctx, seeds)
            self.states.index_copy_(0, meta[STATE_WRITE], state)  # (padding rows: into the scratch rows)
            if inject is not None and self.injects is not None:
                self.injects.index_copy_(0, meta[POOL_ROW], inject)
            return
        state = torch.index_select(self.states, 0, meta[STATE_READ], out=self.state[:width])
        if stage == "core":
            inject = None
            if self.inject is not None and self.injects is not None:
                inject = torch.index_select(self.injects, 0, meta[POOL_ROW], out=self.inject[:width])
            out = self.out[:width]
            out.copy_(self.model.core_step(state, inject, ctx))
            self.states.index_copy_(0, meta[STATE_WRITE], out)  # (padding rows: into the scratch row)
            signals, _ = step_signals(self.model, self.signal_kinds, state, out, None, None, None)
            if self.signals is None:  # (the first run of a core step is eager, never one being captured)
                with torch.inference_mode(False):
                    self.signals = {k: v.new_empty((self.state.shape[0], *v.shape[1:])) for k, v in signals.items()}
            for kind, signal in signals.items():
                self.signals[kind][:width].copy_(signal)
            return
        logits = self.model.coda(state, ctx)
        if self.logits is None:  # (the first run of a coda is eager, never one being captured)
            with torch.inference_mode(False):  # a normal tensor: later steps may run outside inference mode
                self.logits = logits.new_empty((self.state.shape[0], logits.shape[1]))
        self.logits[:width].copy_(logits)
