"""`LLM`: the offline entry point (vLLM's shape): load a model, `generate` a list of prompts."""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Sequence as Seq
from pathlib import Path

from tqdm import tqdm

from loopserve.cache.layout import KVLayout
from loopserve.engine.config import EngineConfig
from loopserve.engine.engine import LLMEngine
from loopserve.engine.reference import ReferenceDecoder
from loopserve.engine.sequence import PromptType, Sequence, make_sequence
from loopserve.models.loader import load_model
from loopserve.outputs import RequestOutput
from loopserve.sampling_params import SamplingParams


def default_model_path() -> Path:
    """The embedded default model: a small Ouro-architecture LM trained on Shakespeare, shipped in
    the package (`loopserve train-tiny` rebuilds it)."""
    from loopserve.train import embedded_model_path

    path = embedded_model_path()
    if not (path / "model.safetensors").is_file():
        raise ValueError(f"model: the embedded model is missing from {path}; pass model=PATH")
    return path


class LLM:
    """Offline generation. `scheduler` is one of "cdb" (default), "cdb-norefill", "cb", "reference";
    any `EngineConfig` field can be passed as a keyword (block_size, max_decode_batch, ...)."""

    def __init__(self, model: str | Path | None = None, *, dtype: str = "float32", device: str = "cpu",
                 state_init: str = "like-init", seed: int = 0, **engine_kwargs) -> None:
        names = {f.name for f in dataclasses.fields(EngineConfig)}
        unknown = set(engine_kwargs) - names
        if unknown:
            raise ValueError(f"{sorted(unknown)[0]}: unknown LLM argument")
        self.engine_config = EngineConfig(**engine_kwargs)
        loaded = load_model(model if model is not None else default_model_path(), dtype, device, state_init)
        self.model, self.config, self.tokenizer = loaded.model, loaded.config, loaded.tokenizer
        self.seed = seed
        cfg, c = self.engine_config, self.config
        self.layout = KVLayout(cfg.kv_layout, c.n_prelude, c.n_core, c.n_coda, c.r_max)
        self.engine = None if cfg.scheduler == "reference" else LLMEngine(self.model, self.tokenizer, cfg, seed)
        self._counter = itertools.count()

    def _make_sequence(self, prompt: PromptType, params: SamplingParams) -> Sequence:
        index = next(self._counter)
        # Per-request sampling seed: the request's own when given, as the server does, else one derived
        # from the LLM seed; the same in every scheduler. Initial states are seeded from the prompt.
        seed = params.seed if params.seed is not None else self.seed * 1_000_003 + index
        return make_sequence(self.model, self.tokenizer, str(index), prompt, params, seed,
                             self.engine_config.lookahead, base_seed=self.seed)

    def generate(self, prompts: PromptType | Seq[PromptType],
                 sampling_params: SamplingParams | Seq[SamplingParams] | None = None,
                 use_tqdm: bool = False) -> list[RequestOutput]:
        single = isinstance(prompts, str | dict) or (
            isinstance(prompts, list) and bool(prompts) and all(isinstance(t, int) for t in prompts))
        prompt_list: list[PromptType] = [prompts] if single else list(prompts)  # type: ignore[list-item,arg-type]
        if sampling_params is None:
            sampling_params = SamplingParams()
        params = ([sampling_params] * len(prompt_list) if isinstance(sampling_params, SamplingParams)
                  else list(sampling_params))
        if len(params) != len(prompt_list):
            raise ValueError(f"sampling_params: {len(params)} given for {len(prompt_list)} prompts")
        seqs = [self._make_sequence(p, sp) for p, sp in zip(prompt_list, params, strict=True)]
        bar = tqdm(total=len(seqs), disable=not use_tqdm, desc="generate")
        if self.engine is None:
            decoder = ReferenceDecoder(self.model, self.layout, self.engine_config.prefill_chunk_size)
            for seq in seqs:
                decoder.run(seq)
                bar.update(1)
        else:
            for seq in seqs:
                self.engine.add_sequence(seq)
            while self.engine.has_unfinished_requests():
                bar.update(sum(o.finished for o in self.engine.step()))
        bar.close()
        return [s.to_output() for s in seqs]
