"""Engine knobs (one dataclass; the CLI and `LLM` pass them through)."""

from __future__ import annotations

from dataclasses import dataclass

SCHEDULERS = ("reference", "cb", "cdb-norefill", "cdb")


@dataclass
class EngineConfig:
    scheduler: str = "cdb"
    kv_layout: str = "depth_indexed"
    block_size: int = 16
    kv_cache_tokens: int | None = None  # pool size in tokens; None: from kv_cache_memory_gb
    kv_cache_memory_gb: float = 1.0
    max_num_seqs: int = 64
    max_decode_batch: int = 32  # width of a core (and prelude/coda) stage batch
    max_num_batched_tokens: int = 2048  # prompt tokens per prefill tick
    prefill_chunk_size: int = 512  # chunk boundary rule, shared with the reference decoder
    # Coda waits for this many exited tokens (an undersized batch still runs when nothing else can).
    # None: 1 for fully looped models (Ouro: the coda is just the head), max_decode_batch // 4 when
    # the model has coda blocks (Huginn: small coda batches re-read big boundary weights per token).
    min_coda_batch: int | None = None
    kv_safety_margin: float = 0.1  # fraction of blocks prefill admission keeps free
    lookahead: bool = False
    # Read a core step's exit signals only after the next step is queued when every rule in the batch
    # decides ahead (lookahead, lookahead_gate). False reads them at once: same schedule and outputs,
    # the host just waits for the device each step (the `bench ablate overlap` baseline).
    pipeline_core_steps: bool = True
    # Sample a coda's tokens only after the next stage batch is queued, so the device never idles
    # while the host samples (their preludes join one tick later; outputs are the same). None: on for
    # CUDA, off for the CPU, where nothing overlaps and refilling a tick later only costs.
    async_coda: bool | None = None

    def __post_init__(self) -> None:
        if self.scheduler not in SCHEDULERS:
            raise ValueError(f"scheduler: expected one of {', '.join(SCHEDULERS)}, got {self.scheduler!r}")
        for name in ("block_size", "max_num_seqs", "max_decode_batch", "max_num_batched_tokens",
                     "prefill_chunk_size", "min_coda_batch"):
            v = getattr(self, name)
            if v is None and name == "min_coda_batch":
                continue
            if not isinstance(v, int) or v < 1:
                raise ValueError(f"{name}: must be an integer >= 1, got {v!r}")
        if self.kv_cache_tokens is not None and self.kv_cache_tokens < self.block_size:
            raise ValueError(f"kv_cache_tokens: must be >= block_size ({self.block_size})")
        if not 0 <= self.kv_safety_margin < 1:
            raise ValueError(f"kv_safety_margin: must be in [0, 1), got {self.kv_safety_margin}")
        if self.max_num_batched_tokens < self.prefill_chunk_size:
            self.max_num_batched_tokens = self.prefill_chunk_size

    def coda_batch_for(self, n_coda_layers: int) -> int:
        if self.min_coda_batch is not None:
            return self.min_coda_batch
        return 1 if n_coda_layers == 0 else max(1, self.max_decode_batch // 4)
