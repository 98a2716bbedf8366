"""Ouro (`OuroForCausalLM`, ByteDance LoopLM): a fully looped transformer.

prelude = embedding; core step = all L layers (4 RMSNorms each, residual after the post-norm),
then `model.norm`, whose output is both the readout and the next step's input; coda = lm_head;
exit gate = Linear(H, 1) with bias on the normed state. Parameter names match the HF checkpoint but for the
stacked projections (q/k/v and gate/up, one matmul each: `LoopedLM.checkpoint_tensors` maps them).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from loopserve.model_config import ModelConfig
from loopserve.models.base import LoopedLM
from loopserve.models.context import ForwardContext
from loopserve.models.layers import (
    RMSNorm,
    compute_dtype,
    derived,
    embedding,
    linear,
    paged_attention,
    rope_angles,
    rope_pair,
    stacked_linear,
)


class OuroAttention(nn.Module):
    def __init__(self, c: ModelConfig) -> None:
        super().__init__()
        self.c = c
        q, kv = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
        # the checkpoint's q, k and v projections stacked (`stacked_linear`)
        self.qkv_proj = nn.Linear(c.hidden_size, q + 2 * kv, bias=False)
        self.stacked = {"qkv_proj.weight": (("q_proj.weight", q), ("k_proj.weight", kv), ("v_proj.weight", kv))}
        self.qkv_sizes = [rows for _, rows in self.stacked["qkv_proj.weight"]]
        self.o_proj = nn.Linear(q, c.hidden_size, bias=False)

    def forward(self, x: torch.Tensor, ctx: ForwardContext, layer: int) -> torch.Tensor:
        c, n = self.c, x.shape[0]
        q, k, v = stacked_linear(x, self.qkv_proj.weight, self.qkv_sizes)
        cos, sin = rope_angles(ctx, c.head_dim, c.rope_theta, x.dtype, "half")
        q, k = rope_pair(q.view(n, c.num_heads, c.head_dim), k.view(n, c.num_kv_heads, c.head_dim), cos, sin, "half")
        v = v.view(n, c.num_kv_heads, c.head_dim)
        return linear(paged_attention(q, k, v, ctx, "core", layer), self.o_proj.weight)


class OuroMLP(nn.Module):
    def __init__(self, c: ModelConfig) -> None:
        super().__init__()
        i = c.intermediate_size
        self.gate_up_proj = nn.Linear(c.hidden_size, 2 * i, bias=False)  # the checkpoint's gate and up, stacked
        self.stacked = {"gate_up_proj.weight": (("gate_proj.weight", i), ("up_proj.weight", i))}
        self.gate_up_sizes = [rows for _, rows in self.stacked["gate_up_proj.weight"]]
        self.down_proj = nn.Linear(i, c.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = stacked_linear(x, self.gate_up_proj.weight, self.gate_up_sizes)
        return linear(F.silu(gate) * up, self.down_proj.weight)


class OuroLayer(nn.Module):
    def __init__(self, c: ModelConfig, idx: int) -> None:
        super().__init__()
        self.idx = idx
        self.self_attn = OuroAttention(c)
        self.mlp = OuroMLP(c)
        self.input_layernorm = RMSNorm(c.hidden_size, c.norm_eps)
        self.input_layernorm_2 = RMSNorm(c.hidden_size, c.norm_eps)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.norm_eps)
        self.post_attention_layernorm_2 = RMSNorm(c.hidden_size, c.norm_eps)

    def forward(self, x: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        x = x + self.input_layernorm_2(self.self_attn(self.input_layernorm(x), ctx, self.idx))
        return x + self.post_attention_layernorm_2(self.mlp(self.post_attention_layernorm(x)))


class OuroInner(nn.Module):
    def __init__(self, c: ModelConfig) -> None:
        super().__init__()
        self.embed_tokens = embedding(c.vocab_size, c.hidden_size)
        self.layers = nn.ModuleList(OuroLayer(c, i) for i in range(c.n_core))
        self.norm = RMSNorm(c.hidden_size, c.norm_eps)
        self.early_exit_gate = nn.Linear(c.hidden_size, 1, bias=True)


class OuroForCausalLM(LoopedLM):
    has_gate = True

    def __init__(self, c: ModelConfig, lookahead_gate: bool = False) -> None:
        super().__init__()
        self.config = c
        self.model = OuroInner(c)
        # tie_word_embeddings (false in the released checkpoints): the head reuses the embedding
        self.lm_head = None if c.tie_embeddings else nn.Linear(c.hidden_size, c.vocab_size, bias=False)
        # Optional distilled head predicting the gate's decision one step ahead (loopserve extra).
        self.lookahead_gate = nn.Linear(c.hidden_size, 1, bias=True) if lookahead_gate else None

    def prelude(self, token_ids, ctx, state_seeds=None):
        return self.model.embed_tokens(token_ids), None

    def core_step(self, state, inject, ctx):
        h = state
        for layer in self.model.layers:
            h = layer(h, ctx)
        return self.model.norm(h)

    def coda(self, state, ctx, logit_rows=None):
        h = state if logit_rows is None else state[logit_rows]
        head = self.model.embed_tokens if self.lm_head is None else self.lm_head
        return linear(h, head.weight).to(compute_dtype(h.dtype))

    def _gate(self, head: nn.Linear, state: torch.Tensor) -> torch.Tensor:
        cdt = compute_dtype(state.dtype)  # gate math in fp32 (or wider), not in bf16
        weight: torch.Tensor = head.weight
        bias: torch.Tensor = head.bias
        if weight.dtype != cdt:  # a bf16 model: the head's fp32 copy, made once (`derived`), not two casts a core tick
            if torch.is_grad_enabled() and (weight.requires_grad or bias.requires_grad):  # (training: the casts' graph)
                weight, bias = weight.to(cdt), bias.to(cdt)
            else:
                weight, bias = (derived(t, ("cast", cdt), lambda w: w.to(cdt)) for t in (weight, bias))
        return F.linear(state.to(cdt), weight, bias)[:, 0]

    def gate_logit(self, state):
        return self._gate(self.model.early_exit_gate, state)

    @property
    def has_lookahead_gate(self) -> bool:
        return self.lookahead_gate is not None

    def lookahead_gate_logit(self, state):
        if self.lookahead_gate is None:
            return super().lookahead_gate_logit(state)
        return self._gate(self.lookahead_gate, state)
