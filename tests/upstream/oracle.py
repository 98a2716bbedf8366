"""Independent float64 oracle of the upstream Hugging Face forward passes, for parity tests.

This module re-implements, from scratch and in plain tensor algebra, the forward math of

* Ouro ``OuroForCausalLM`` (ByteDance remote code; read in ``LoopedLMs/ouro_rl``:
  ``ouro_rl/modeling/modeling_ouro.py``), and
* Huginn-0125 ``RavenForCausalLM`` (``seal-rg/recurrent-pretraining``:
  ``recpre/raven_modeling_minimal.py``),

so that loopserve's own model code can be checked against it. It shares no code with loopserve
and favours being obviously right over being fast: one sequence, no batch, no KV cache, every
tensor in float64 (upstream computes RMSNorm / RoPE / softmax in fp32 and the rest in the model
dtype; float64 is at least as precise everywhere). Upstream line references are in comments.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import load_file

F64 = torch.float64


# ---------------- loading


def load_folder(path) -> tuple[dict, dict[str, torch.Tensor]]:
    """Read ``config.json`` and ``model.safetensors`` (or the shards named in
    ``model.safetensors.index.json``); every tensor is converted to float64."""
    folder = Path(path)
    config = json.loads((folder / "config.json").read_text())
    index = folder / "model.safetensors.index.json"
    if index.exists():
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    else:
        shards = ["model.safetensors"]
    weights: dict[str, torch.Tensor] = {}
    for shard in shards:
        for name, tensor in load_file(str(folder / shard)).items():
            weights[name] = tensor.to(F64)
    return config, weights


# ---------------- shared pieces


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x / sqrt(mean(x^2) + eps), then times the weight (plain weight, not 1 + weight).

    Ouro ``OuroRMSNorm.forward``: normalise in fp32, cast back to the input dtype, then
    ``self.weight * x``. Huginn ``RMSNorm.forward``: ``self._norm(x.float()).type_as(x) * weight``.
    Same order in both; in float64 the casts are no-ops."""
    x = x.to(F64)
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight.to(F64)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """torch.nn.Linear: x @ W^T (+ b); W is [out, in]."""
    y = x @ weight.to(F64).T
    return y if bias is None else y + bias.to(F64)


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """softmax(q k^T / sqrt(d) + causal mask) v, per head. q, k, v: [heads, S, d] -> [heads, S, d].

    Query i sees keys 0..i (full-sequence prefill, so top-left == bottom-right alignment)."""
    seq, d = q.shape[1], q.shape[2]
    scores = q @ k.transpose(1, 2) / math.sqrt(d)
    future = torch.ones(seq, seq, dtype=torch.bool).triu(1)
    scores = scores.masked_fill(future, float("-inf"))
    return torch.softmax(scores, dim=-1) @ v


def rope_rotate_half(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    """NeoX / HF-Llama RoPE (Ouro). x: [heads, S, d].

    ``OuroRotaryEmbedding`` (rope_type "default"): inv_freq[i] = theta^(-2i/d), i < d/2;
    emb = cat(freqs, freqs); ``apply_rotary_pos_emb``: x*cos + rotate_half(x)*sin with
    ``rotate_half(x) = cat(-x[d/2:], x[:d/2])``: dim i pairs with dim i + d/2."""
    d = x.shape[-1]
    inv_freq = 1.0 / theta ** (torch.arange(0, d, 2, dtype=F64) / d)
    angles = positions.to(F64)[:, None] * inv_freq[None, :]  # [S, d/2]
    cos = torch.cat([angles.cos(), angles.cos()], dim=-1)
    sin = torch.cat([angles.sin(), angles.sin()], dim=-1)
    rotated = torch.cat([-x[..., d // 2 :], x[..., : d // 2]], dim=-1)
    return x * cos + rotated * sin


def rope_adjacent_pairs(x: torch.Tensor, positions: torch.Tensor, base: float) -> torch.Tensor:
    """Interleaved (GPT-J / complex) RoPE (Huginn). x: [S, heads, d].

    ``precompute_freqs_cis(dim=d, end=block_size, theta=rope_base)``: inv_freq[i] = base^(-2i/d),
    i < d/2, table (cos, sin) of shape (1, block_size, 1, d/2, 2);
    ``apply_rotary_emb_complex_like``: dims (2i, 2i+1) form a pair (x0, x1) ->
    (x0 cos - x1 sin, x1 cos + x0 sin). All d dims are rotated."""
    d = x.shape[-1]
    inv_freq = 1.0 / base ** (torch.arange(0, d, 2, dtype=F64) / d)
    angles = positions.to(F64)[:, None] * inv_freq[None, :]  # [S, d/2]
    cos, sin = angles.cos()[:, None, :], angles.sin()[:, None, :]  # broadcast over heads
    x0, x1 = x[..., 0::2], x[..., 1::2]
    return torch.stack([x0 * cos - x1 * sin, x1 * cos + x0 * sin], dim=-1).flatten(-2)


# ---------------- Ouro


def _ouro_dims(config: dict) -> tuple[int, int, int]:
    n_heads = config["num_attention_heads"]
    n_kv = config.get("num_key_value_heads") or n_heads  # OuroConfig: None -> n_heads
    head_dim = config.get("head_dim") or config["hidden_size"] // n_heads  # OuroAttention.__init__
    return n_heads, n_kv, head_dim


def _ouro_check_config(config: dict) -> None:
    rope_scaling = config.get("rope_scaling")
    if rope_scaling and rope_scaling.get("rope_type", rope_scaling.get("type")) != "default":
        raise NotImplementedError(f"oracle supports default RoPE only, got {rope_scaling}")
    if config.get("use_sliding_window"):
        raise NotImplementedError("oracle supports full attention only")
    if config.get("hidden_act", "silu") != "silu":
        raise NotImplementedError(f"oracle supports silu only, got {config.get('hidden_act')}")


def _ouro_attention(config: dict, w: dict, p: str, x: torch.Tensor) -> torch.Tensor:
    """``OuroAttention.forward`` (eager): bias-free q/k/v/o, RoPE on q and k, GQA by repeating
    each kv head for num_heads // num_kv_heads consecutive query heads (``repeat_kv``)."""
    n_heads, n_kv, head_dim = _ouro_dims(config)
    seq = x.shape[0]
    q = linear(x, w[p + "q_proj.weight"]).view(seq, n_heads, head_dim).transpose(0, 1)
    k = linear(x, w[p + "k_proj.weight"]).view(seq, n_kv, head_dim).transpose(0, 1)
    v = linear(x, w[p + "v_proj.weight"]).view(seq, n_kv, head_dim).transpose(0, 1)
    positions = torch.arange(seq)  # position_ids = cache_position = 0..S-1 on a fresh forward
    theta = config.get("rope_theta", 10000.0)
    q, k = rope_rotate_half(q, positions, theta), rope_rotate_half(k, positions, theta)
    k = k.repeat_interleave(n_heads // n_kv, dim=0)
    v = v.repeat_interleave(n_heads // n_kv, dim=0)
    out = causal_attention(q, k, v).transpose(0, 1).reshape(seq, n_heads * head_dim)
    return linear(out, w[p + "o_proj.weight"])


def _ouro_layer(config: dict, w: dict, layer: int, h: torch.Tensor) -> torch.Tensor:
    """``OuroDecoderLayer.forward``: four RMSNorms, residual added AFTER the post-norm:
    h = h + norm_in2(attn(norm_in(h))); h = h + norm_post2(mlp(norm_post(h)))."""
    eps = config.get("rms_norm_eps", 1e-6)
    p = f"model.layers.{layer}."
    attn = _ouro_attention(config, w, p + "self_attn.", rms_norm(h, w[p + "input_layernorm.weight"], eps))
    h = h + rms_norm(attn, w[p + "input_layernorm_2.weight"], eps)
    x = rms_norm(h, w[p + "post_attention_layernorm.weight"], eps)
    # OuroMLP: down(silu(gate(x)) * up(x)), no biases
    mlp = linear(
        F.silu(linear(x, w[p + "mlp.gate_proj.weight"])) * linear(x, w[p + "mlp.up_proj.weight"]),
        w[p + "mlp.down_proj.weight"],
    )
    return h + rms_norm(mlp, w[p + "post_attention_layernorm_2.weight"], eps)


def ouro_step_states(
    config: dict, weights: dict, input_ids: list[int], total_ut_steps: int
) -> list[torch.Tensor]:
    """``OuroModel.forward``: the normalised state after each loop step, a list of T [S, H] tensors.

    Embedding without scaling; every step runs all num_hidden_layers layers and then ``model.norm``;
    the normalised state is both the step's readout (``hidden_states_list``) and the next step's
    input."""
    _ouro_check_config(config)
    if total_ut_steps < 1:
        raise ValueError("total_ut_steps must be >= 1")
    eps = config.get("rms_norm_eps", 1e-6)
    h = weights["model.embed_tokens.weight"].to(F64)[torch.tensor(input_ids, dtype=torch.long)]
    states = []
    for _step in range(total_ut_steps):
        for layer in range(config["num_hidden_layers"]):
            h = _ouro_layer(config, weights, layer, h)
        h = rms_norm(h, weights["model.norm.weight"], eps)
        states.append(h)
    return states


def _ouro_head(config: dict, weights: dict) -> torch.Tensor:
    if config.get("tie_word_embeddings", False):
        return weights["model.embed_tokens.weight"]
    return weights["lm_head.weight"]


def ouro_logits(config: dict, weights: dict, input_ids: list[int], total_ut_steps: int) -> torch.Tensor:
    """[S, V] logits of ``lm_head`` on the step-``total_ut_steps`` normalised state, i.e.
    ``OuroForCausalLM.forward(exit_at_step=total_ut_steps - 1)`` (also what the default
    threshold 1.0 gives in exact arithmetic)."""
    states = ouro_step_states(config, weights, input_ids, total_ut_steps)
    return linear(states[-1], _ouro_head(config, weights))


def ouro_gate_cdf(config: dict, weights: dict, input_ids: list[int], total_ut_steps: int) -> torch.Tensor:
    """[S, T] exit CDF per position after each step.

    lambda_t = sigmoid(early_exit_gate(normed h_t)) (``nn.Linear(H, 1)`` with bias);
    ``OuroForCausalLM.forward`` builds pdf p_t = lambda_t * prod_{j<t}(1 - lambda_j) for t < T-1 and
    gives the remaining mass to the last step, so CDF_t = 1 - prod_{j<=t}(1 - lambda_j) and
    CDF_{T-1} = 1 (lambda of the last step is computed but unused)."""
    states = ouro_step_states(config, weights, input_ids, total_ut_steps)
    gate_w, gate_b = weights["model.early_exit_gate.weight"], weights["model.early_exit_gate.bias"]
    lam = torch.cat([torch.sigmoid(linear(s, gate_w, gate_b)) for s in states], dim=1)  # [S, T]
    cdf = 1.0 - torch.cumprod(1.0 - lam, dim=1)
    cdf[:, -1] = 1.0
    return cdf


# ---------------- Huginn


def _huginn_dims(config: dict) -> tuple[int, int, int]:
    n_embd = config.get("n_embd", config.get("hidden_size"))
    n_heads = config.get("n_heads", config.get("num_attention_heads"))
    n_kv = config.get("num_key_value_heads") or n_heads  # RavenConfig derives it = n_heads
    if n_kv != n_heads:
        raise NotImplementedError(
            "Huginn upstream SDPA call has no GQA; num_key_value_heads must equal n_heads"
        )
    return n_embd, n_heads, n_embd // n_heads  # CausalSelfAttention: head_dim = n_embd // n_head


def _huginn_attention(config: dict, w: dict, p: str, x: torch.Tensor) -> torch.Tensor:
    """``CausalSelfAttention.forward``: fused Wqkv split [Q | K | V] (rows), heads contiguous;
    q += qk_bias[0], k += qk_bias[1] BEFORE RoPE; adjacent-pair RoPE; causal SDPA with the
    default 1/sqrt(head_dim) scale; bias-free output ``proj``."""
    n_embd, n_heads, head_dim = _huginn_dims(config)
    seq = x.shape[0]
    q, k, v = linear(x, w[p + "Wqkv.weight"]).split([n_embd, n_heads * head_dim, n_heads * head_dim], dim=-1)
    q, k, v = (t.reshape(seq, n_heads, head_dim) for t in (q, k, v))
    if config.get("qk_bias", True):
        bias = w[p + "qk_bias"].to(F64)  # (2, 1, n_heads, head_dim)
        q, k = q + bias[0, 0], k + bias[1, 0]
    positions = torch.arange(seq)  # freqs_cis[:, :S] on a fresh forward
    base = config.get("rope_base", 50000.0)
    q, k = rope_adjacent_pairs(q, positions, base), rope_adjacent_pairs(k, positions, base)
    out = causal_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1))
    return linear(out.transpose(0, 1).reshape(seq, n_embd), w[p + "proj.weight"])


def _huginn_block(config: dict, w: dict, p: str, x: torch.Tensor) -> torch.Tensor:
    """``SandwichBlock.forward``: x = norm_2(x + attn(norm_1(x))); x = norm_4(x + mlp(norm_3(x)));
    ``GatedMLP``: fc rows [0, I) are the gate (SiLU), rows [I, 2I) the up projection."""
    eps = config.get("norm_eps", 1e-6)

    def norm(i: int, t: torch.Tensor) -> torch.Tensor:
        return rms_norm(t, w[f"{p}norm_{i}.weight"], eps)

    x = norm(2, x + _huginn_attention(config, w, p + "attn.", norm(1, x)))
    gate, up = linear(norm(3, x), w[p + "mlp.fc.weight"]).chunk(2, dim=-1)
    return norm(4, x + linear(F.silu(gate) * up, w[p + "mlp.proj.weight"]))


def huginn_core_states(
    config: dict, weights: dict, input_ids: list[int], num_steps: int
) -> list[torch.Tensor]:
    """Raw recurrent states s_0 .. s_{num_steps} ([S, h] each; s_0 = 0, i.e. ``init_scale=0``).

    ``RavenForCausalLM.forward``: e = wte(ids) * embed_scale, then the prelude blocks.
    ``iterate_forward`` / ``core_block_forward``: s = adapter(cat[s, e]) then the core blocks, per
    step; no ``ln_f`` between steps."""
    if num_steps < 0:
        raise ValueError("num_steps must be >= 0")
    n_embd, _, _ = _huginn_dims(config)
    if len(input_ids) > config.get("block_size", 4096):
        raise ValueError("sequence longer than the upstream freqs_cis table (block_size)")
    # emb_scale = config.init_values["embed_scale"]; RavenConfig computes it as sqrt(n_embd)
    embed_scale = config.get("init_values", {}).get("embed_scale", math.sqrt(n_embd))
    e = weights["transformer.wte.weight"].to(F64)[torch.tensor(input_ids, dtype=torch.long)] * embed_scale
    for i in range(config.get("n_layers_in_prelude", 2)):
        e = _huginn_block(config, weights, f"transformer.prelude.{i}.", e)
    adapter_w, adapter_b = weights["transformer.adapter.weight"], weights.get("transformer.adapter.bias")
    s = torch.zeros_like(e)
    states = [s]
    for _step in range(num_steps):
        s = linear(torch.cat([s, e], dim=-1), adapter_w, adapter_b)  # state first, embedding second
        for j in range(config.get("n_layers_in_recurrent_block", 4)):
            s = _huginn_block(config, weights, f"transformer.core_block.{j}.", s)
        states.append(s)
    return states


def huginn_predict_from_state(config: dict, weights: dict, state: torch.Tensor) -> torch.Tensor:
    """``predict_from_latents``: ln_f -> coda blocks -> ln_f (same module twice) -> tied head."""
    eps = config.get("norm_eps", 1e-6)
    x = rms_norm(state, weights["transformer.ln_f.weight"], eps)
    for i in range(config.get("n_layers_in_coda", 2)):
        x = _huginn_block(config, weights, f"transformer.coda.{i}.", x)
    x = rms_norm(x, weights["transformer.ln_f.weight"], eps)
    tied = config.get("tie_embeddings", config.get("tie_word_embeddings", True))
    return linear(x, weights["transformer.wte.weight" if tied else "lm_head.weight"])


def huginn_logits(config: dict, weights: dict, input_ids: list[int], num_steps: int) -> torch.Tensor:
    """[S, V] logits of ``RavenForCausalLM.forward(num_steps=num_steps, init_scale=0)``."""
    states = huginn_core_states(config, weights, input_ids, num_steps)
    return huginn_predict_from_state(config, weights, states[-1])


def huginn_latent_diffs(config: dict, weights: dict, input_ids: list[int], num_steps: int) -> torch.Tensor:
    """[S, num_steps]: ||s_r - s_{r-1}|| / ||s_r|| per position for r = 1..num_steps, on the raw
    (pre-ln_f) core output, s_0 = 0; the per-position value that upstream's ``latent-diff``
    criterion computes before averaging over positions (``generate_with_adaptive_compute``)."""
    states = huginn_core_states(config, weights, input_ids, num_steps)
    diffs = [
        (states[r] - states[r - 1]).norm(dim=-1) / states[r].norm(dim=-1) for r in range(1, num_steps + 1)
    ]
    return torch.stack(diffs, dim=1) if diffs else torch.zeros(len(input_ids), 0, dtype=F64)


# ---------------- generation


def greedy_generate(
    folder, prompt_ids: list[int], depth: int, max_new_tokens: int, k: int = 5
) -> tuple[list[int], list[dict[int, float]]]:
    """Greedy decoding, recomputing the whole sequence for every new token (no cache).

    ``depth`` is ``total_ut_steps`` for Ouro and ``num_steps`` for Huginn. Returns the generated
    tokens (prompt excluded; no stop tokens, always ``max_new_tokens``) and, per generated token,
    the top-k float64 log-probabilities {token_id: logprob}."""
    config, weights = load_folder(folder)
    arch = config["architectures"][0]
    if arch == "OuroForCausalLM":
        forward = ouro_logits
    elif arch == "RavenForCausalLM":
        forward = huginn_logits
    else:
        raise ValueError(f"unsupported architecture {arch}")
    ids = list(prompt_ids)
    tokens: list[int] = []
    top_logprobs: list[dict[int, float]] = []
    for _ in range(max_new_tokens):
        logprobs = torch.log_softmax(forward(config, weights, ids, depth)[-1], dim=-1)
        values, indices = torch.topk(logprobs, k)
        top_logprobs.append({int(i): float(v) for i, v in zip(indices, values, strict=True)})
        token = int(torch.argmax(logprobs))
        tokens.append(token)
        ids.append(token)
    return tokens, top_logprobs
