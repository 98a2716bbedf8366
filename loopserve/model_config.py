"""Model configuration: one normalized view of an Ouro or Huginn `config.json`.

The engine, the cache and the benchmarks only read this dataclass; the raw HF dict is kept for
round trips (`make-tiny`, the loader's error messages).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

OURO = "OuroForCausalLM"
HUGINN = "RavenForCausalLM"
ARCHITECTURES = (OURO, HUGINN)


@dataclass(frozen=True)
class ModelConfig:
    arch: str  # OURO or HUGINN
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    n_prelude: int  # unshared attention blocks before the loop (Ouro: 0)
    n_core: int  # shared blocks run once per loop step
    n_coda: int  # unshared attention blocks after the loop (Ouro: 0)
    r_max: int  # default maximum number of loop steps
    rope_theta: float
    norm_eps: float
    max_position: int
    tie_embeddings: bool
    exit_threshold: float | None  # Ouro's `early_exit_threshold`; None for Huginn
    raw: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)

    @property
    def embed_scale(self) -> float:
        if self.arch != HUGINN:
            return 1.0
        init = self.raw.get("init_values") or {}  # upstream reads the checkpoint's stored value
        return float(init.get("embed_scale", math.sqrt(self.hidden_size)))

    @staticmethod
    def from_hf(cfg: dict[str, Any], source: str = "config.json") -> ModelConfig:
        archs = cfg.get("architectures") or []
        arch = archs[0] if archs else None
        if arch not in ARCHITECTURES:
            raise ValueError(
                f"{source}: unknown architecture {arch!r}; loopserve supports {', '.join(ARCHITECTURES)}"
            )
        try:
            if arch == OURO:
                hidden, heads = cfg["hidden_size"], cfg["num_attention_heads"]
                return ModelConfig(
                    arch=arch,
                    hidden_size=hidden,
                    num_heads=heads,
                    num_kv_heads=cfg.get("num_key_value_heads") or heads,
                    head_dim=cfg.get("head_dim") or hidden // heads,
                    intermediate_size=cfg["intermediate_size"],
                    vocab_size=cfg["vocab_size"],
                    n_prelude=0,
                    n_core=cfg["num_hidden_layers"],
                    n_coda=0,
                    r_max=cfg.get("total_ut_steps", 4),
                    rope_theta=float(cfg.get("rope_theta", 10000.0)),
                    norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
                    max_position=cfg.get("max_position_embeddings", 32768),
                    tie_embeddings=bool(cfg.get("tie_word_embeddings", False)),
                    exit_threshold=cfg.get("early_exit_threshold", 1.0),
                    raw=cfg,
                )
            hidden, heads = cfg["n_embd"], cfg["n_heads"]
            return ModelConfig(
                arch=arch,
                hidden_size=hidden,
                num_heads=heads,
                num_kv_heads=heads,
                head_dim=hidden // heads,
                intermediate_size=cfg["intermediate_size"],
                vocab_size=cfg.get("padded_vocab_size") or cfg["vocab_size"],
                n_prelude=cfg["n_layers_in_prelude"],
                n_core=cfg["n_layers_in_recurrent_block"],
                n_coda=cfg["n_layers_in_coda"],
                r_max=cfg.get("mean_recurrence", 32),
                rope_theta=float(cfg.get("rope_base", 50000.0)),
                norm_eps=float(cfg.get("norm_eps", 1e-6)),
                max_position=cfg.get("block_size", 4096),
                tie_embeddings=True,
                exit_threshold=None,
                raw=cfg,
            )
        except KeyError as e:
            raise ValueError(f"{source}: missing required key {e.args[0]!r} for {arch}") from None
