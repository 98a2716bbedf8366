"""Random tiny weights with the exact upstream parameter names and shapes (test helpers)."""

from __future__ import annotations

import math

import torch


def tiny_ouro_config(**overrides) -> dict:
    config = {
        "architectures": ["OuroForCausalLM"],
        "model_type": "ouro",
        "vocab_size": 48,
        "hidden_size": 32,
        "intermediate_size": 48,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 4,
        "head_dim": 8,
        "hidden_act": "silu",
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "rope_scaling": None,
        "max_position_embeddings": 256,
        "tie_word_embeddings": False,
        "use_sliding_window": False,
        "total_ut_steps": 4,
        "early_exit_threshold": 1.0,
    }
    config.update(overrides)
    return config


def tiny_huginn_config(**overrides) -> dict:
    config = {
        "architectures": ["RavenForCausalLM"],
        "model_type": "huginn_raven",
        "n_embd": 32,
        "n_heads": 4,
        "num_key_value_heads": 4,
        "n_layers": 4,
        "n_layers_in_prelude": 1,
        "n_layers_in_recurrent_block": 2,
        "n_layers_in_coda": 1,
        "intermediate_size": 48,
        "vocab_size": 48,
        "padded_vocab_size": 48,
        "block_size": 64,
        "rope_base": 50000.0,
        "norm_eps": 1e-6,
        "bias": False,
        "qk_bias": True,
        "tie_embeddings": True,
        "mean_recurrence": 4,
    }
    config.update(overrides)
    config["n_layers"] = (
        config["n_layers_in_prelude"] + config["n_layers_in_recurrent_block"] + config["n_layers_in_coda"]
    )
    n = config["n_embd"]
    config.setdefault("init_values", {"std": math.sqrt(2 / (5 * n)), "embed_scale": math.sqrt(n)})
    return config


def _randn(gen: torch.Generator, *shape: int, scale: float = 1.0) -> torch.Tensor:
    return torch.randn(*shape, generator=gen, dtype=torch.float64) * scale


def _linear_w(gen: torch.Generator, out_features: int, in_features: int) -> torch.Tensor:
    return _randn(gen, out_features, in_features, scale=1.0 / math.sqrt(in_features))


def _norm_w(gen: torch.Generator, n: int) -> torch.Tensor:
    return 1.0 + _randn(gen, n, scale=0.2)


def tiny_ouro_weights(
    cfg: dict, seed: int = 0, dtype: torch.dtype = torch.float32
) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    hid, inter, vocab = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
    n_heads = cfg["num_attention_heads"]
    n_kv = cfg.get("num_key_value_heads") or n_heads
    head_dim = cfg.get("head_dim") or hid // n_heads
    w = {"model.embed_tokens.weight": _randn(gen, vocab, hid)}
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        w[p + "self_attn.q_proj.weight"] = _linear_w(gen, n_heads * head_dim, hid)
        w[p + "self_attn.k_proj.weight"] = _linear_w(gen, n_kv * head_dim, hid)
        w[p + "self_attn.v_proj.weight"] = _linear_w(gen, n_kv * head_dim, hid)
        w[p + "self_attn.o_proj.weight"] = _linear_w(gen, hid, n_heads * head_dim)
        w[p + "mlp.gate_proj.weight"] = _linear_w(gen, inter, hid)
        w[p + "mlp.up_proj.weight"] = _linear_w(gen, inter, hid)
        w[p + "mlp.down_proj.weight"] = _linear_w(gen, hid, inter)
        for norm in (
            "input_layernorm",
            "input_layernorm_2",
            "post_attention_layernorm",
            "post_attention_layernorm_2",
        ):
            w[p + norm + ".weight"] = _norm_w(gen, hid)
    w["model.norm.weight"] = _norm_w(gen, hid)
    w["model.early_exit_gate.weight"] = _linear_w(gen, 1, hid) * 3.0
    w["model.early_exit_gate.bias"] = _randn(gen, 1)
    w["lm_head.weight"] = _linear_w(gen, vocab, hid) * 4.0
    return {name: t.to(dtype).contiguous() for name, t in w.items()}


def upstream_freqs_cis(head_dim: int, block_size: int, base: float) -> torch.Tensor:
    """The persistent ``freqs_cis`` buffer as upstream ``precompute_freqs_cis`` builds it (fp32):
    shape (1, block_size, 1, head_dim // 2, 2), last axis (cos, sin)."""
    inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    angles = torch.outer(torch.arange(block_size, dtype=torch.float32), inv_freq)
    return torch.stack([angles.cos()[None, :, None, :], angles.sin()[None, :, None, :]], dim=4)


def tiny_huginn_weights(
    cfg: dict, seed: int = 0, dtype: torch.dtype = torch.float32
) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    n, inter = cfg["n_embd"], cfg["intermediate_size"]
    vocab = cfg.get("padded_vocab_size", cfg["vocab_size"])
    n_heads = cfg["n_heads"]
    head_dim = n // n_heads
    w = {"transformer.wte.weight": _randn(gen, vocab, n, scale=1.0 / math.sqrt(n))}
    blocks = (
        [f"transformer.prelude.{i}." for i in range(cfg["n_layers_in_prelude"])]
        + [f"transformer.core_block.{i}." for i in range(cfg["n_layers_in_recurrent_block"])]
        + [f"transformer.coda.{i}." for i in range(cfg["n_layers_in_coda"])]
    )
    for p in blocks:
        for k in range(1, 5):
            w[f"{p}norm_{k}.weight"] = _norm_w(gen, n)
        w[p + "attn.Wqkv.weight"] = _linear_w(gen, 3 * n, n)
        w[p + "attn.qk_bias"] = _randn(gen, 2, 1, n_heads, head_dim, scale=0.3)
        w[p + "attn.proj.weight"] = _linear_w(gen, n, n)
        w[p + "mlp.fc.weight"] = _linear_w(gen, 2 * inter, n)
        w[p + "mlp.proj.weight"] = _linear_w(gen, n, inter)
    w["transformer.adapter.weight"] = _linear_w(gen, n, 2 * n)
    w["transformer.ln_f.weight"] = _norm_w(gen, n)
    w["lm_head.weight"] = w["transformer.wte.weight"].clone()  # the hub checkpoint stores the tied copy twice
    out = {name: t.to(dtype).contiguous() for name, t in w.items()}
    out["freqs_cis"] = upstream_freqs_cis(head_dim, cfg["block_size"], cfg["rope_base"])
    return out
