"""Model configuration: one normalized view of an Ouro or Huginn `config.json` (`ModelConfig`), and that view as an
engine runs it, with its max_model_len (`EngineModelConfig`, vLLM's `engine.model_config`).

The engine, the cache and the benchmarks only read this dataclass. `from_hf` checks the config as it reads it:
a missing, mistyped or out-of-range value, or an architecture setting loopserve implements one way only
(`UNIMPLEMENTED`), is a ValueError naming the key and the file, before any weight is read. The raw HF dict is
kept so that a config can be made again with one key changed (`loopserve_lab.train.evaluate` sets a calibrated
`early_exit_threshold`).
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, fields
from typing import TYPE_CHECKING, Any

from loopserve.sampling_params import is_int, is_real

if TYPE_CHECKING:
    import torch

OURO = "OuroForCausalLM"
HUGINN = "RavenForCausalLM"
ARCHITECTURES = (OURO, HUGINN)
STATE_INITS = ("like-init", "zero")  # Huginn's initial loop states loopserve draws (its config's `state_init`)


def _one_of(*values: Any) -> Callable[[Any], bool]:
    return lambda v: v in values


def _plain_rope(v: Any) -> bool:
    """Whether upstream's rotary embedding reads `rope_scaling` as plain RoPE: null, or type (else rope_type)
    'default': OuroConfig copies an older config's `type` over `rope_type`, so `type` is what upstream runs."""
    return v is None or (isinstance(v, dict) and v.get("type", v.get("rope_type")) == "default")


# partial_rotary_factor, top-level (transformers 4) or in rope_parameters (5): the one setting loopserve implements
_WHOLE_HEAD = (_one_of(1.0), "1.0 (RoPE over the whole head)")


def _full_attention(v: Any) -> bool:
    """Full attention in every layer: each "full_attention", or null (OuroConfig derives the kinds then, as when
    the key is absent: see `UNIMPLEMENTED`)."""
    return v is None or (isinstance(v, list) and all(kind == "full_attention" for kind in v))


# Keys of every architecture's config that loopserve implements at one setting only (see `UNIMPLEMENTED`): a quantized
# checkpoint's weights and scales read as float weights would be other math
_EVERY_ARCHITECTURE = {
    "quantization_config": (_one_of(None), "unquantized weights (no quantization_config)"),
}
# Architecture keys the upstream code reads that loopserve implements at one setting only: per architecture,
# key -> (whether a value is that setting, what loopserve implements). A key that is absent takes upstream's
# default, which is that setting. Another value would run with silently different math, so it is refused at load.
# (Upstream Ouro derives sliding layers from use_sliding_window, sliding_window and max_window_layers when
# layer_types is absent or null: refusing use_sliding_window true covers that, and the corner where every layer is
# below max_window_layers, which keeps full attention, no released checkpoint sets.)
UNIMPLEMENTED: dict[str, dict[str, tuple[Callable[[Any], bool], str]]] = {
    OURO: {
        **_EVERY_ARCHITECTURE,
        # ("swish" names the same function as "silu" in transformers' ACT2FN)
        "hidden_act": (_one_of("silu", "swish"), '"silu" (the SiLU-gated MLP)'),
        "rope_scaling": (_plain_rope, 'plain RoPE (null, or type "default", else rope_type "default")'),
        "partial_rotary_factor": _WHOLE_HEAD,
        "use_sliding_window": (_one_of(False, None), "false (full attention in every layer)"),
        "layer_types": (_full_attention, '"full_attention" in every layer (no sliding window)'),
        "early_exit_step": (_one_of(None), "null (the exit depth is the exit policy's)"),
    },
    HUGINN: {
        **_EVERY_ARCHITECTURE,
        "injection_type": (_one_of("linear"), '"linear" (the adapter over [state, embedding])'),
        "nonlin_name": (_one_of("SiLU"), '"SiLU"'),
        "norm_class_name": (_one_of("RMSNorm_llama"), '"RMSNorm_llama"'),
        "block_class_name": (_one_of("SandwichBlock"), '"SandwichBlock"'),
        "mlp_class_name": (_one_of("GatedMLP"), '"GatedMLP"'),
        "qk_bias": (_one_of(True), "true (learned query and key biases)"),
        "bias": (_one_of(False), "false (no biases in the linear layers)"),
        "tie_embeddings": (_one_of(True), "true (the head is the embedding)"),
        "test_time_noise": (_one_of(0, None), "0 (no noise on the loop state)"),  # (null: none, as 0)
    },
}
# transformers 5's `rope_parameters` (its form of rope_theta, rope_scaling and partial_rotary_factor, both
# architectures): the keys plain RoPE reads, each at the setting loopserve implements; rope_theta is the base
# (`_Keys.rope_theta`). Any other key (factor, original_max_position_embeddings, beta_fast, ...) is another
# rope_type's, so it is refused, as is a rope_type (or its older name `type`, which transformers reads after it) other
# than "default". A `full_attention` entry holding these is the per-layer-type form (layer_types keys it), read as
# the parameters of every layer: loopserve runs no other layer type.
ROPE_PARAMETERS = "rope_parameters"
_PLAIN_ROPE_PARAMETERS: dict[str, tuple[Callable[[Any], bool], str]] = {
    "rope_type": (_one_of("default"), '"default" (plain RoPE)'),
    "type": (_one_of("default"), '"default" (plain RoPE)'),
    "partial_rotary_factor": _WHOLE_HEAD,
}
_REQUIRED = object()
# How errors name a head dim derived from other keys (`ModelConfig.from_hf`; make-tiny names its options for them)
OURO_DERIVED_HEAD_DIM = "head_dim (hidden_size // num_attention_heads)"
HUGINN_HEAD_DIM = "n_embd / n_heads"


class _Keys:
    """A config.json's values, each checked as it is read: a ValueError names the key and the file."""

    def __init__(self, cfg: dict[str, Any], source: str, arch: str, key_names: Mapping[str, str]) -> None:
        self.cfg, self.source, self.arch, self.key_names = cfg, source, arch, key_names

    def error(self, key: str, why: str) -> ValueError:
        return ValueError(f"{self.source}: {self.key_names.get(key, key)}: {why}")

    def get(self, key: str, default: Any = _REQUIRED, *, null_is_default: bool = False) -> Any:
        """The key's value; `default` when it is absent (or null, if `null_is_default`)."""
        value = self.cfg.get(key, default)
        if value is None and null_is_default:
            value = default
        if value is _REQUIRED:
            raise ValueError(f"{self.source}: missing required key {key!r} for {self.arch}")
        return value

    def integer(self, key: str, default: Any = _REQUIRED, *, low: int = 1, null_is_default: bool = False) -> int:
        value = self.get(key, default, null_is_default=null_is_default)
        if not (is_int(value) and value >= low):
            raise self.error(key, f"must be an integer >= {low}, got {value!r}")
        return value

    def positive(self, key: str, default: float) -> float:
        value = self.get(key, default)
        if not (is_real(value) and value > 0):
            raise self.error(key, f"must be a number > 0, got {value!r}")
        return float(value)

    def rope_theta(self, key: str, default: float) -> float:
        """The RoPE base: `key` (Ouro's rope_theta, Huginn's rope_base; `default` when absent), or
        `rope_parameters.rope_theta` (transformers 5's form), which must agree with `key` when both are given.
        `rope_parameters` must ask for plain RoPE (`_PLAIN_ROPE_PARAMETERS`)."""
        params, where = self.cfg.get(ROPE_PARAMETERS), ROPE_PARAMETERS
        if params is None:
            return self.positive(key, default)
        per_layer_type = params.get("full_attention") if isinstance(params, dict) and len(params) == 1 else None
        if isinstance(per_layer_type, dict):
            params, where = per_layer_type, f"{where}.full_attention"
        if not isinstance(params, dict):
            raise self.error(where, f"must be an object (transformers 5's RoPE parameters), got {json.dumps(params)}")
        for name, (accepted, implemented) in _PLAIN_ROPE_PARAMETERS.items():
            if name in params and not accepted(params[name]):
                raise self.error(f"{where}.{name}", f"{json.dumps(params[name])} is not supported: loopserve "
                                                    f"implements {implemented} only")
        scaling = sorted(params.keys() - _PLAIN_ROPE_PARAMETERS.keys() - {"rope_theta"})
        if scaling:
            raise self.error(f"{where}.{scaling[0]}", f"{json.dumps(params[scaling[0]])} is not supported: loopserve "
                                                      f'implements plain RoPE (rope_type "default", rope_theta, '
                                                      f"partial_rotary_factor 1.0) only")
        inner = params.get("rope_theta")
        if inner is None:  # (absent or null: transformers 5 takes the config's own base)
            return self.positive(key, default)
        if not (is_real(inner) and inner > 0):
            raise self.error(f"{where}.rope_theta", f"must be a number > 0, got {inner!r}")
        # (a null `key` is absent: transformers 5 reads the base from rope_parameters then)
        if self.cfg.get(key) is not None and self.positive(key, default) != inner:
            raise self.error(f"{where}.rope_theta", f"{inner!r} disagrees with {key} ({self.cfg[key]!r}): give the "
                                                    f"RoPE base once, or the same in both")
        return float(inner)

    def unimplemented(self) -> None:
        for key, (accepted, implemented) in UNIMPLEMENTED[self.arch].items():
            if key in self.cfg and not accepted(self.cfg[key]):
                raise self.error(key, f"{json.dumps(self.cfg[key])} is not supported: loopserve implements "
                                      f"{implemented} only")


# vLLM's ModelConfig attributes a harness reads off an engine's `model_config`, and where loopserve keeps them
_VLLM_MODEL_CONFIG = {
    "max_model_len": "the most prompt + completion tokens is an engine's (LLM.model_config.max_model_len, "
                     "LLMEngine.model_config.max_model_len, an EngineModelConfig); the model's own context is "
                     "max_position",
    "hf_config": "config.json, as read, is its `raw` field",
    "dtype": "the dtype the weights were loaded in is an engine's (LLM.model_config.dtype, "
             "LLMEngine.model_config.dtype)",
}


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
    exit_threshold: float | None  # Ouro's `early_exit_threshold` (None: the last step's); None for Huginn
    # Huginn's `state_init`, how training drew the initial loop state (a load's default); None for Ouro
    state_init: str | None
    embed_scale: float  # the embedding's multiplier (Huginn: init_values.embed_scale, as upstream reads it)
    raw: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)

    def get_vocab_size(self) -> int:
        """vLLM's ModelConfig method of that name (harnesses read an engine's `model_config.get_vocab_size()`)."""
        return self.vocab_size

    def __getattr__(self, name: str) -> Any:
        """vLLM's ModelConfig attributes that loopserve keeps elsewhere (this `model_config`, an `LLMEngine`'s, is the
        model's shapes): an AttributeError saying where, as `hasattr` expects; any other name the usual one."""
        where = _VLLM_MODEL_CONFIG.get(name)
        suffix = f": loopserve's model_config is the model's shapes; {where}" if where else ""
        raise AttributeError(f"'ModelConfig' object has no attribute {name!r}{suffix}", name=name, obj=self)

    @staticmethod
    def from_hf(cfg: dict[str, Any], source: str = "config.json", key_names: Mapping[str, str] | None = None
                ) -> ModelConfig:
        """The config of an HF `config.json` dict; ValueError naming `source` and the key for a value loopserve
        cannot run as upstream does (missing, mistyped, out of range, an `UNIMPLEMENTED` setting, or `rope_parameters`
        asking for other than plain RoPE). `key_names` names keys in errors as the caller's user knows them
        (make-tiny: its options)."""
        archs = cfg.get("architectures") or []
        if not (isinstance(archs, list) and all(isinstance(a, str) for a in archs)):
            raise ValueError(f'{source}: architectures: must be a list of class names (["{OURO}"] or ["{HUGINN}"]), '
                             f"got {json.dumps(archs)}")
        arch = archs[0] if archs else None
        if arch not in ARCHITECTURES:
            raise ValueError(
                f"{source}: unknown architecture {arch!r}; loopserve supports {', '.join(ARCHITECTURES)}"
            )
        k = _Keys(cfg, source, arch, key_names or {})
        k.unimplemented()
        if arch == OURO:
            hidden, heads = k.integer("hidden_size"), k.integer("num_attention_heads")
            kv_heads = k.integer("num_key_value_heads", heads, null_is_default=True)  # (OuroConfig: null = MHA)
            if heads % kv_heads:
                raise k.error("num_key_value_heads", f"must divide num_attention_heads ({heads}), got {kv_heads}")
            threshold = k.get("early_exit_threshold", 1.0)
            if threshold is not None and not (is_real(threshold) and threshold > 0):
                raise k.error("early_exit_threshold", f"must be a number > 0 or null, got {threshold!r}")
            if threshold is not None and threshold > 1:
                # upstream's exit CDF never exceeds it, so every token runs to the last step, as at 1.0; stored as
                # 1.0 because the gate takes a probability in (0, 1] (sequence.resolve_exit_rule)
                threshold = 1.0
            tie = k.get("tie_word_embeddings", False)
            if not isinstance(tie, bool):
                raise k.error("tie_word_embeddings", f"must be true or false, got {tie!r}")
            config = ModelConfig(
                arch=arch,
                hidden_size=hidden,
                num_heads=heads,
                num_kv_heads=kv_heads,
                head_dim=k.integer("head_dim", hidden // heads, null_is_default=True),
                intermediate_size=k.integer("intermediate_size"),
                vocab_size=k.integer("vocab_size"),
                n_prelude=0,
                n_core=k.integer("num_hidden_layers"),
                n_coda=0,
                r_max=k.integer("total_ut_steps", 4),
                rope_theta=k.rope_theta("rope_theta", 10000.0),
                norm_eps=k.positive("rms_norm_eps", 1e-6),
                max_position=k.integer("max_position_embeddings", 32768, low=2),
                tie_embeddings=tie,
                exit_threshold=threshold,
                state_init=None,
                embed_scale=1.0,
                raw=cfg,
            )
            head_dim_key = OURO_DERIVED_HEAD_DIM if cfg.get("head_dim") is None else "head_dim"
        else:
            hidden, heads = k.integer("n_embd"), k.integer("n_heads")
            if hidden % heads:
                raise k.error("n_embd", f"must be a multiple of n_heads ({heads}), got {hidden}")
            kv_heads = k.integer("num_key_value_heads", heads, null_is_default=True)
            if kv_heads != heads:  # (upstream's attention has no grouped-query attention)
                raise k.error("num_key_value_heads", f"must equal n_heads ({heads}): Huginn's attention has no "
                                                     f"grouped-query attention, got {kv_heads}")
            state_init = k.get("state_init", "like-init")
            if state_init not in STATE_INITS:
                raise k.error("state_init", f"{json.dumps(state_init)} is not supported: loopserve implements "
                                            f"{' and '.join(map(json.dumps, STATE_INITS))} only")
            init = k.get("init_values", {}, null_is_default=True)
            scale: Any = init.get("embed_scale", math.sqrt(hidden)) if isinstance(init, dict) else None
            if not (is_real(scale) and scale > 0):
                raise k.error("init_values", f"must be an object whose embed_scale (default sqrt(n_embd)) is a number "
                                             f"> 0, got {init!r}")
            config = ModelConfig(
                arch=arch,
                hidden_size=hidden,
                num_heads=heads,
                num_kv_heads=kv_heads,
                head_dim=hidden // heads,
                intermediate_size=k.integer("intermediate_size"),
                # (upstream: vocab_size, unless the config stores a padded size)
                vocab_size=k.integer("padded_vocab_size" if cfg.get("padded_vocab_size") is not None else "vocab_size"),
                n_prelude=k.integer("n_layers_in_prelude", low=0),
                n_core=k.integer("n_layers_in_recurrent_block"),
                n_coda=k.integer("n_layers_in_coda", low=0),
                r_max=k.integer("mean_recurrence", 32),
                rope_theta=k.rope_theta("rope_base", 50000.0),
                norm_eps=k.positive("norm_eps", 1e-6),
                max_position=k.integer("block_size", 4096, low=2),
                tie_embeddings=True,
                exit_threshold=None,
                state_init=state_init,
                embed_scale=float(scale),
                raw=cfg,
            )
            head_dim_key = HUGINN_HEAD_DIM
        if config.head_dim % 2:  # (RoPE turns pairs of dims)
            raise k.error(head_dim_key, f"must be even (rotary embeddings turn pairs of dims), got {config.head_dim}")
        return config


@dataclass(frozen=True, kw_only=True)
class EngineModelConfig(ModelConfig):
    """The model's config as an engine runs it: its shapes, the engine's `max_model_len`, the most prompt +
    completion tokens of a request (at most `max_position`), and the dtype the weights were loaded in, so that vLLM's
    `engine.model_config.max_model_len` and `.dtype`, which harnesses read (lm-eval's vLLM backend), read them.
    `LLMEngine.model_config` and `LLM.model_config`; the one place either keeps its max_model_len."""

    max_model_len: int
    dtype: torch.dtype  # (vLLM's ModelConfig.dtype: a torch.dtype)

    @staticmethod
    def of(config: ModelConfig, max_model_len: int, dtype: torch.dtype) -> EngineModelConfig:
        return EngineModelConfig(**{f.name: getattr(config, f.name) for f in fields(ModelConfig)},
                                 max_model_len=max_model_len, dtype=dtype)
