"""`LLM`: the offline entry point (vLLM's shape): load a model, `generate` a list of prompts."""

from __future__ import annotations

import itertools
from collections.abc import Sequence as Seq
from pathlib import Path
from typing import Any

from tqdm import tqdm

from loopserve.cache.layout import KVLayout
from loopserve.engine.reference import ReferenceDecoder
from loopserve.engine.sequence import Sequence, resolve_exit_rule
from loopserve.models.loader import load_model
from loopserve.outputs import RequestOutput
from loopserve.sampling_params import SamplingParams

SCHEDULERS = ("reference",)
PromptType = str | dict[str, Any] | list[int]


def default_model_path() -> Path:
    """The embedded default model (a seeded tiny Ouro until the trained one ships)."""
    from loopserve.models.tiny import TinySpec, make_tiny

    path = Path.home() / ".cache" / "loopserve" / "tiny-ouro-seed0"
    if not (path / "model.safetensors").is_file():
        make_tiny(path, TinySpec(arch="ouro", seed=0))
    return path


class LLM:
    def __init__(self, model: str | Path | None = None, *, scheduler: str = "reference",
                 kv_layout: str = "depth_indexed", dtype: str = "float32", device: str = "cpu",
                 state_init: str = "like-init", seed: int = 0, lookahead: bool = False,
                 prefill_chunk_size: int = 512) -> None:
        if scheduler not in SCHEDULERS:
            raise ValueError(f"scheduler: expected one of {', '.join(SCHEDULERS)}, got {scheduler!r}")
        if prefill_chunk_size < 1:
            raise ValueError(f"prefill_chunk_size: must be >= 1, got {prefill_chunk_size}")
        loaded = load_model(model if model is not None else default_model_path(), dtype, device, state_init)
        self.model, self.config, self.tokenizer = loaded.model, loaded.config, loaded.tokenizer
        c = self.config
        self.layout = KVLayout(kv_layout, c.n_prelude, c.n_core, c.n_coda, c.r_max)
        self.scheduler, self.seed, self.lookahead = scheduler, seed, lookahead
        self.prefill_chunk_size = prefill_chunk_size
        self._counter = itertools.count()

    def _make_sequence(self, prompt: PromptType, params: SamplingParams) -> Sequence:
        text: str | None
        if isinstance(prompt, str):
            text, ids = prompt, self.tokenizer.encode(prompt)
        elif isinstance(prompt, dict) and "prompt_token_ids" in prompt:
            text, ids = prompt.get("prompt"), list(prompt["prompt_token_ids"])
        elif isinstance(prompt, dict) and isinstance(prompt.get("prompt"), str):
            text, ids = prompt["prompt"], self.tokenizer.encode(prompt["prompt"])
        elif isinstance(prompt, list) and all(isinstance(t, int) for t in prompt):
            text, ids = None, list(prompt)
        else:
            raise ValueError("prompt: expected a string, a list of token ids, or a dict with "
                             "'prompt' or 'prompt_token_ids'")
        if not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
            raise ValueError("prompt_token_ids: must be a list of integers")
        index = next(self._counter)
        rule = resolve_exit_rule(params, self.config, self.model.has_gate, self.lookahead)
        return Sequence(str(index), text, ids, params, rule, seed=self.seed * 1_000_003 + index,
                        tokenizer=self.tokenizer, max_model_len=self.config.max_position)

    def generate(self, prompts: PromptType | Seq[PromptType],
                 sampling_params: SamplingParams | Seq[SamplingParams] | None = None,
                 use_tqdm: bool = False) -> list[RequestOutput]:
        if isinstance(prompts, str | dict) or (isinstance(prompts, list) and prompts
                                               and all(isinstance(t, int) for t in prompts)):
            prompts = [prompts]  # type: ignore[list-item]
        prompts = list(prompts)  # type: ignore[arg-type]
        if sampling_params is None:
            sampling_params = SamplingParams()
        params = ([sampling_params] * len(prompts) if isinstance(sampling_params, SamplingParams)
                  else list(sampling_params))
        if len(params) != len(prompts):
            raise ValueError(f"sampling_params: {len(params)} given for {len(prompts)} prompts")
        seqs = [self._make_sequence(p, sp) for p, sp in zip(prompts, params, strict=True)]
        decoder = ReferenceDecoder(self.model, self.layout, self.prefill_chunk_size)
        for seq in tqdm(seqs, disable=not use_tqdm, desc="generate"):
            decoder.run(seq)
        return [s.to_output() for s in seqs]
