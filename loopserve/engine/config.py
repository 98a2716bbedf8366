"""Engine knobs: one dataclass, the one declaration of each knob (`LLM` takes them as keywords; the
command-line flags are generated from it by `config_args`)."""

from __future__ import annotations

import logging
from dataclasses import dataclass

from loopserve.cache.layout import LAYOUTS
from loopserve.config_args import check_bool_knobs, none_to_defaults
from loopserve.config_args import knob as _knob
from loopserve.sampling_params import DEFAULT_MAX_LOGPROBS, is_int, is_real

log = logging.getLogger(__name__)
ENGINE_SCHEDULERS = ("cb", "cdb-norefill", "cdb")  # the batching engines (`LLMEngine`: what `serve` runs)
SCHEDULERS = ("reference", *ENGINE_SCHEDULERS)  # and the sequential oracle, which `LLM` also runs
# self-speculative decoding: the rounds over which a request's acceptance is judged (and the fewest before it is
# judged at all), and the tokens it then decodes plainly before it drafts again (text changes: a passage that drafts
# badly may be followed by one that drafts well)
SPECULATIVE_WINDOW = 4
SPECULATIVE_PAUSE = 16
SCHEDULER_HELP = dict(zip(SCHEDULERS, ("the sequential oracle (a request, a token, a loop at a time)",
                                       "full-depth continuous batching",
                                       "continuous depth batching without refill",
                                       "continuous depth batching with refill"), strict=True))


@dataclass
class EngineConfig:
    scheduler: str = _knob("cdb", "", choices=SCHEDULER_HELP)
    kv_layout: str = _knob("depth_indexed", "KV cache layout (what a query at loop depth r reads)", choices=LAYOUTS)
    # (None, vLLM's "the default", is taken for the default of the knobs declared `none_is_default`)
    block_size: int = _knob(16, "tokens per KV block", none_is_default=True)
    kv_cache_tokens: int | None = _knob(None, "KV pool size in tokens; unset: from --kv-cache-memory-gb")
    kv_cache_memory_gb: float = _knob(1.0, "KV pool size in GiB when --kv-cache-tokens is unset")
    max_num_seqs: int = _knob(64, "sequences admitted at once", none_is_default=True)
    max_decode_batch: int = _knob(32, "width of a core (and prelude/coda) stage batch")
    max_num_batched_tokens: int = _knob(2048, "prompt tokens per prefill tick (below --prefill-chunk-size it lowers "
                                        "that to itself)", human_readable=True, none_is_default=True)
    prefill_chunk_size: int = _knob(512, "prompt chunk boundary (part of the semantics, shared with the reference; "
                                    "at most --max-num-batched-tokens)")
    # Coda waits for this many exited tokens (an undersized batch still runs when nothing else can).
    # None: 1 for fully looped models (Ouro: the coda is just the head), max_decode_batch // 2 when
    # the model has coda blocks (Huginn: small coda batches re-read big boundary weights per token).
    min_coda_batch: int | None = _knob(None, "exited tokens a coda batch waits for; unset: 1 for fully looped "
                                       "models, max-decode-batch/2 with coda blocks (Huginn)")
    # A prelude batch of its own (fresh tokens the core batch had no room for when their coda or prefill ran)
    # waits for this many tokens while the core batch still has work. Fewer, fuller prelude batches re-read
    # boundary weights less often (Huginn's prelude blocks) but refill the core batch later. None: 1 for fully
    # looped models (Ouro's prelude is the embedding), max_decode_batch // 4 with prelude blocks. With the codas
    # at half a batch, Huginn-like decoding on the CPU ran 2-9 % faster at widths 16-64 than with preludes at once
    # and codas at a quarter batch, measured side by side (docs/benchmarks.md §8.34), and served with the same
    # latency (§8.35).
    min_prelude_batch: int | None = _knob(None, "cdb: fresh tokens a prelude batch of its own waits for while the "
                                          "core batch has work (at most max-decode-batch); unset: 1 for fully "
                                          "looped models, max-decode-batch/4 with prelude blocks (Huginn)")
    kv_safety_margin: float = _knob(0.1, "fraction of KV blocks prefill admission keeps free")
    enable_prefix_caching: bool = _knob(True, "reuse the KV of full prompt blocks an earlier prompt with the same "
                                        "prefix computed (token ids as without it in float64; in float32 logits "
                                        "differ by rounding, about 1e-6, so a sampled token can rarely differ)",
                                        none_is_default=True)
    lookahead: bool = _knob(False, "delayed exits: the signal after loop r decides loop r+2 (r_min = 2)")
    # Read a core step's exit signals only after the next step is queued when every rule in the batch
    # decides ahead (lookahead, lookahead_gate). False reads them at once: same schedule and outputs,
    # the host just waits for the device each step (the `bench ablate overlap` baseline).
    pipeline_core_steps: bool = _knob(True, "read a core step's exit signals after queueing the next step "
                                      "when every rule decides ahead")
    # Sample a coda's tokens only after the next stage batch is queued, so the device never idles
    # while the host samples (their preludes join one tick later; outputs are the same). None: on for
    # CUDA, off for the CPU, where nothing overlaps and refilling a tick later only costs.
    async_coda: bool | None = _knob(None, "take a coda's tokens after the next batch is queued; unset: on for "
                                    "CUDA only")
    # Each decode core step (and coda with layers) replayed from a CUDA graph, one per bucket of batch width
    # and key count (the batch padded to it): one launch instead of a few per layer (docs/design.md §9). None:
    # on for CUDA, where eager steps are launch-bound (on an H200 graphs decoded 3.5-3.8x faster,
    # docs/benchmarks.md §6.1), off for the CPU, where the same padded stages run eagerly, which only the tests
    # want (it is slower).
    cuda_graphs: bool | None = _knob(None, "replay decode core steps (and codas with layers) as CUDA graphs at "
                                     "bucketed widths and key counts; unset: on for CUDA only (on the CPU the "
                                     "padded stages run eagerly: for tests, slower)")
    # A bucket's graph is otherwise captured when a batch first needs it, and every request of that batch waits
    # for the capture (about 70 ms a bucket at Ouro-1.4B's size on an H200, docs/benchmarks.md §6.2). vLLM captures
    # at start-up; this does the same for the buckets up to a key count (docs/design.md §9).
    cuda_graph_warmup_tokens: int = _knob(0, "with cuda graphs: capture at start-up every decode bucket of batch "
                                          "width up to max-decode-batch and key count up to this many tokens "
                                          "(longer contexts capture when first needed); 0: every bucket when "
                                          "first needed")
    # Self-speculative decoding (docs/design.md §12): the model drafts with a few loops, the request's
    # own depth verifies; outputs and exit depths stay those of plain decoding.
    num_speculative_tokens: int = _knob(0, "tokens drafted per verify pass (0: off); needs a per-depth KV layout "
                                        "(depth_indexed or last_exited)")
    speculative_draft_loops: int = _knob(1, "loop steps a drafted token runs before its greedy coda")
    speculative_max_batch: int = _knob(8, "no drafting while this many sequences are resident (the engine is "
                                       "compute-bound there: B*)")
    speculative_min_acceptance: float = _knob(0.3, f"a request pauses drafting ({SPECULATIVE_PAUSE} tokens) when "
                                              f"under this share of its drafts was accepted over its last "
                                              f"{SPECULATIVE_WINDOW} rounds")

    # vLLM's cap on what a request's logprobs and prompt_logprobs ask for (and so on a beam search's width: a step
    # asks for 2 * width); -1 is the whole vocabulary, which a request asks for by -1, as in vLLM
    max_logprobs: int = _knob(DEFAULT_MAX_LOGPROBS, "most logprobs (and prompt_logprobs) a request may ask for "
                              "(-1: the whole vocabulary; a beam search may then be up to half the vocabulary wide, "
                              "each beam's step reading 2 x width logprobs)")

    def __post_init__(self) -> None:
        none_to_defaults(self)
        check_bool_knobs(self)
        if self.scheduler not in SCHEDULERS:
            raise ValueError(f"scheduler: expected one of {', '.join(SCHEDULERS)}, got {self.scheduler!r}")
        for name in ("block_size", "max_num_seqs", "max_decode_batch", "max_num_batched_tokens",
                     "prefill_chunk_size", "min_coda_batch", "min_prelude_batch"):
            v = getattr(self, name)
            if v is None and name in ("min_coda_batch", "min_prelude_batch"):
                continue
            if not is_int(v) or v < 1:
                raise ValueError(f"{name}: must be an integer >= 1, got {v!r}")
        if self.min_prelude_batch is not None and self.min_prelude_batch > self.max_decode_batch:
            # (a core batch with work never leaves that much room)
            raise ValueError(f"min_prelude_batch: must be <= max_decode_batch ({self.max_decode_batch}), "
                             f"got {self.min_prelude_batch}")
        if self.kv_cache_tokens is not None and not (is_int(self.kv_cache_tokens)
                                                     and self.kv_cache_tokens >= self.block_size):
            raise ValueError(f"kv_cache_tokens: must be an integer >= block_size ({self.block_size}), "
                             f"got {self.kv_cache_tokens!r}")
        if not (is_real(self.kv_cache_memory_gb) and self.kv_cache_memory_gb > 0):
            raise ValueError(f"kv_cache_memory_gb: must be a number of GiB > 0, got {self.kv_cache_memory_gb!r}")
        if not (is_real(self.kv_safety_margin) and 0 <= self.kv_safety_margin < 1):
            raise ValueError(f"kv_safety_margin: must be in [0, 1), got {self.kv_safety_margin}")
        warmup = self.cuda_graph_warmup_tokens
        if not (is_int(warmup) and warmup >= 0):
            raise ValueError(f"cuda_graph_warmup_tokens: must be an integer >= 0, got {warmup!r}")
        for name in ("num_speculative_tokens", "speculative_draft_loops", "speculative_max_batch"):
            v = getattr(self, name)
            if not is_int(v) or v < (0 if name == "num_speculative_tokens" else 1):
                raise ValueError(f"{name}: must be an integer >= {0 if name == 'num_speculative_tokens' else 1}, "
                                 f"got {v!r}")
        if not (is_int(self.max_logprobs) and self.max_logprobs >= -1):
            raise ValueError(f"max_logprobs: must be an integer >= 0 (or -1: the whole vocabulary), got "
                             f"{self.max_logprobs!r}")
        if not (is_real(self.speculative_min_acceptance) and 0 <= self.speculative_min_acceptance <= 1):
            raise ValueError(f"speculative_min_acceptance: must be in [0, 1], got {self.speculative_min_acceptance}")
        if self.num_speculative_tokens and self.kv_layout == "shared":
            # under shared a verify row reads the other rows' latest loop, not their final depth (§12)
            raise ValueError("num_speculative_tokens: speculative decoding is exact only with a per-depth KV "
                             "layout (depth_indexed or last_exited), not kv_layout='shared'")
        if self.max_num_batched_tokens < self.prefill_chunk_size:
            # vLLM caps every step at max_num_batched_tokens, so a chunk (which a prefill tick takes whole) is cut to
            # it (the budget was raised to the chunk). Chunk starts are part of the semantics under `shared`
            # (docs/design.md §4.2), and the reference decoder reads them from this same config: outputs stay exact.
            log.info("prefill_chunk_size: lowered from %d to max_num_batched_tokens (%d), the most prompt tokens a "
                     "step prefills", self.prefill_chunk_size, self.max_num_batched_tokens)
            self.prefill_chunk_size = self.max_num_batched_tokens

    def kv_pool_tokens(self, bytes_per_token: int, memory_knob: str) -> int:
        """The KV pool's size in tokens: kv_cache_tokens, else what kv_cache_memory_gb holds at `bytes_per_token`
        (ValueError naming `memory_knob`, the setting that gave kv_cache_memory_gb, when that is less than a
        block)."""
        if self.kv_cache_tokens is not None:
            return self.kv_cache_tokens
        tokens = int(self.kv_cache_memory_gb * 2**30 // bytes_per_token)
        if tokens < self.block_size:
            raise ValueError(f"{memory_knob}: {self._memory_asked(memory_knob)} holds {tokens} tokens of KV "
                             f"({bytes_per_token} bytes a token), less than a block ({self.block_size} tokens)")
        return tokens

    def kv_pool_error(self, tokens: int, nbytes: int, device: object, memory_knob: str) -> ValueError:
        """The error for a KV pool of `tokens` tokens (`nbytes` bytes) that `device` could not allocate, naming the
        knob that sized it: kv_cache_tokens, else `memory_knob` (the setting that gave kv_cache_memory_gb)."""
        if self.kv_cache_tokens is not None:
            name, asked = "kv_cache_tokens", str(self.kv_cache_tokens)
        else:
            name, asked = memory_knob, self._memory_asked(memory_knob)
        return ValueError(f"{name}: {asked} asks for a KV pool of {tokens} tokens, {nbytes} bytes "
                          f"({nbytes / 2**30:.3g} GiB), which {device} could not allocate; give a smaller {name}")

    def _memory_asked(self, memory_knob: str) -> str:
        """kv_cache_memory_gb as an error names it: as given, or as what `memory_knob` (gpu_memory_utilization,
        which gives it a fraction of the device, not GiB) left for the KV pool."""
        if memory_knob == "kv_cache_memory_gb":
            return f"{self.kv_cache_memory_gb} GiB"
        return f"the {self.kv_cache_memory_gb:.3g} GiB it leaves for the KV pool"

    def boundary_batches_for(self, n_prelude_layers: int, n_coda_layers: int) -> tuple[int, int]:
        """(min_prelude_batch, min_coda_batch) for a model with these prelude and coda layer counts: the knobs as
        set, or their defaults for that model."""
        width = self.max_decode_batch
        prelude = self.min_prelude_batch or (1 if n_prelude_layers == 0 else max(1, width // 4))
        coda = self.min_coda_batch or (1 if n_coda_layers == 0 else max(1, width // 2))
        return prelude, coda
