"""Engine statistics: what the benchmarks and `/metrics` read."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

import numpy as np


@dataclass
class EngineStats:
    ticks: Counter = field(default_factory=Counter)  # stage -> ticks run
    rows: Counter = field(default_factory=Counter)  # stage -> rows computed (core: row-steps)
    useful_core_rows: int = 0  # core row-steps of tokens still looping (not CB's passive rows; verify rows count)
    prefill_token_loops: int = 0
    batch_hist: dict[str, Counter] = field(default_factory=dict)  # stage -> batch size -> ticks
    refill_events: int = 0  # a fresh item joined a non-empty core queue
    deferred_signal_ticks: int = 0  # core steps whose signals were read only after the next was queued
    preemptions: int = 0
    swap_ins: int = 0
    swap_in_shared_blocks: int = 0  # prompt blocks a swapped-in sequence found cached and shared again
    # decode tokens by exit depth (loops run): an array, added to a batch at a time (`count_exits`)
    exit_depth_counts: np.ndarray = field(default_factory=lambda: np.zeros(1, np.int64))
    model_time: float = 0.0
    schedule_time: float = 0.0
    generated_tokens: int = 0
    prompt_tokens: int = 0  # prompts prefilled (an n > 1 request's once: its samples share the prefill)
    # each sample's whole prompt, counted with its first token (an n > 1 request's once per sample, as vLLM counts its
    # child requests; cached tokens too): with generated_tokens, what /metrics' iteration_tokens_total observes
    sampled_prompt_tokens: int = 0
    prefix_cache_queries: int = 0  # prompt tokens looked up in the prefix cache (once per sample, as vLLM's)
    prefix_cache_waits: int = 0  # admissions put off a tick: the prompt's next block was being prefilled
    prefix_cache_hits: int = 0  # of those, tokens whose KV the cache supplied (their prefill skipped)
    finished_requests: Counter = field(default_factory=Counter)  # finish reason -> count
    spec_rounds: int = 0  # speculative decoding: verify groups whose coda ran
    spec_draft_tokens: int = 0  # tokens those rounds drafted
    spec_accepted_tokens: int = 0  # drafts equal to the verifier's own token
    # those by their place in the round (0: its first draft), one entry per draft the engine may make a round
    spec_accepted_per_pos: list[int] = field(default_factory=list)
    spec_tokens: int = 0  # tokens those rounds emitted (accepted drafts + the verifier's next token)
    graph_buckets: int = 0  # cuda_graphs: stage buckets prepared (on CUDA: captured), retired ones included
    graph_capture_s: float = 0.0  # CUDA: the wall time those captures took (a warm-up run and a capture each, which
    # synchronize the device): a run's cost that a longer run amortizes (benchmarks report it apart)

    @property
    def exit_depths(self) -> Counter:
        """Decode tokens by exit depth."""
        return Counter({d: c for d, c in enumerate(self.exit_depth_counts.tolist()) if c})

    def count_exits(self, depths: np.ndarray) -> None:
        """Count decode tokens that exited at `depths` (an int array)."""
        counts = np.bincount(depths)
        if len(counts) > len(self.exit_depth_counts):
            self.exit_depth_counts = np.pad(self.exit_depth_counts, (0, len(counts) - len(self.exit_depth_counts)))
        self.exit_depth_counts[:len(counts)] += counts

    def record(self, stage: str, batch: int) -> None:
        self.ticks[stage] += 1
        self.rows[stage] += batch
        hist = self.batch_hist.get(stage)
        if hist is None:  # (not setdefault: it would build a Counter every call)
            hist = self.batch_hist[stage] = Counter()
        hist[batch] += 1

    def as_dict(self) -> dict:
        return {
            "ticks": dict(self.ticks), "rows": dict(self.rows), "useful_core_rows": self.useful_core_rows,
            "prefill_token_loops": self.prefill_token_loops,
            "batch_hist": {k: dict(sorted(v.items())) for k, v in self.batch_hist.items()},
            "refill_events": self.refill_events, "deferred_signal_ticks": self.deferred_signal_ticks,
            "preemptions": self.preemptions, "swap_ins": self.swap_ins,
            "swap_in_shared_blocks": self.swap_in_shared_blocks,
            "exit_depths": dict(sorted(self.exit_depths.items())), "model_time": self.model_time,
            "schedule_time": self.schedule_time, "generated_tokens": self.generated_tokens,
            "prompt_tokens": self.prompt_tokens, "sampled_prompt_tokens": self.sampled_prompt_tokens,
            "finished_requests": dict(self.finished_requests),
            "prefix_cache_queries": self.prefix_cache_queries, "prefix_cache_hits": self.prefix_cache_hits,
            "spec_rounds": self.spec_rounds, "spec_draft_tokens": self.spec_draft_tokens,
            "spec_accepted_tokens": self.spec_accepted_tokens, "spec_tokens": self.spec_tokens,
            "spec_accepted_per_pos": list(self.spec_accepted_per_pos),
            "graph_buckets": self.graph_buckets, "graph_capture_s": self.graph_capture_s,
        }
