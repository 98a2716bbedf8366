"""Huginn-0125 (`RavenForCausalLM`, recurrent-depth LM of Geiping et al. 2025).

prelude = wte * embed_scale (the config's init_values.embed_scale, sqrt(h) in the released model) then prelude
sandwich blocks -> e; the state starts as zeros or a
truncated normal (std sqrt(2/5), cut at 3 std); core step = adapter(cat[state, e]) then the core
sandwich blocks; coda = ln_f, coda blocks, ln_f, tied head. Attention: fused Wqkv, `qk_bias` added
before interleaved (adjacent-pair) RoPE. Parameter names match the HF checkpoint.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from loopserve.device import upload
from loopserve.model_config import STATE_INITS, ModelConfig
from loopserve.models.base import LoopedLM
from loopserve.models.context import ForwardContext
from loopserve.models.layers import RMSNorm, compute_dtype, embedding, linear, paged_attention, rope, rope_angles
from loopserve.random_streams import uniforms

_TRUNC = 3.0  # truncation of the like-init normal, in standard deviations
_DRAW_ELEMENTS = 1 << 21  # like-init numbers drawn at once (int64 temporaries of 16 MiB)


class HuginnAttention(nn.Module):
    def __init__(self, c: ModelConfig) -> None:
        super().__init__()
        self.c = c
        self.Wqkv = nn.Linear(c.hidden_size, 3 * c.hidden_size, bias=False)
        self.qk_bias = nn.Parameter(torch.zeros(2, 1, c.num_heads, c.head_dim))
        self.proj = nn.Linear(c.hidden_size, c.hidden_size, bias=False)

    def forward(self, x: torch.Tensor, ctx: ForwardContext, stage: str, layer: int) -> torch.Tensor:
        c, n = self.c, x.shape[0]
        qkv = linear(x, self.Wqkv.weight).view(n, 3, c.num_heads, c.head_dim)
        # the query and key heads biased and rotated together: per element the same math, fewer ops
        qk = (qkv[:, :2] + self.qk_bias.transpose(0, 1)).view(n, 2 * c.num_heads, c.head_dim)
        cos, sin = rope_angles(ctx, c.head_dim, c.rope_theta, x.dtype, "interleaved")
        q, k = rope(qk, cos, sin, "interleaved").split(c.num_heads, dim=1)
        v = qkv[:, 2]
        return linear(paged_attention(q, k, v, ctx, stage, layer), self.proj.weight)


class HuginnMLP(nn.Module):
    def __init__(self, c: ModelConfig) -> None:
        super().__init__()
        self.fc = nn.Linear(c.hidden_size, 2 * c.intermediate_size, bias=False)
        self.proj = nn.Linear(c.intermediate_size, c.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = linear(x, self.fc.weight).chunk(2, dim=-1)
        return linear(F.silu(gate) * up, self.proj.weight)


class SandwichBlock(nn.Module):
    def __init__(self, c: ModelConfig, stage: str, idx: int) -> None:
        super().__init__()
        self.stage, self.idx = stage, idx
        self.norm_1 = RMSNorm(c.hidden_size, c.norm_eps)
        self.attn = HuginnAttention(c)
        self.norm_2 = RMSNorm(c.hidden_size, c.norm_eps)
        self.norm_3 = RMSNorm(c.hidden_size, c.norm_eps)
        self.mlp = HuginnMLP(c)
        self.norm_4 = RMSNorm(c.hidden_size, c.norm_eps)

    def forward(self, x: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        x = self.norm_2(x + self.attn(self.norm_1(x), ctx, self.stage, self.idx))
        return self.norm_4(x + self.mlp(self.norm_3(x)))


def like_init_state(seeds: list[int] | torch.Tensor, hidden: int, dtype: torch.dtype, device) -> torch.Tensor:
    """Truncated normal (std sqrt(2/5), cut at +-3 std) per row, from a per-row seed (63 bits): element j of
    row i inverts the normal CDF at the counter-based uniform (seeds[i], j) (`random_streams.uniforms`), so a
    row's state depends only on its own seed, and the rows are drawn together where the model runs (a
    generator per row on the host took 28-140 us a row: docs/benchmarks.md §8.26), in slices of at most
    `_DRAW_ELEMENTS` numbers, so a long prefill's int64 and float64 temporaries stay small."""
    lo = 0.5 * math.erfc(_TRUNC / math.sqrt(2))
    dev = torch.device(device)
    s = (seeds if isinstance(seeds, torch.Tensor) else upload(seeds, dev))[:, None]  # (a graphed prelude: static)
    j = torch.arange(hidden, device=dev)[None, :]
    step = max(1, _DRAW_ELEMENTS // hidden)
    parts = [(torch.special.ndtri(lo + (1 - 2 * lo) * uniforms(s[a:a + step], j)) * math.sqrt(2 / 5)).to(dtype)
             for a in range(0, len(seeds), step)]
    return parts[0] if len(parts) == 1 else torch.cat(parts)


class RavenForCausalLM(LoopedLM):
    injects = True  # the embedding, fed to the adapter at every loop step

    def __init__(self, c: ModelConfig, state_init: str | None = None) -> None:
        """`state_init`: how a token's initial loop state is drawn (None: the checkpoint's, `c.state_init`)."""
        super().__init__()
        state_init = c.state_init if state_init is None else state_init
        if state_init not in STATE_INITS:
            raise ValueError(f"state_init: expected one of {STATE_INITS}, got {state_init!r}")
        self.config, self.state_init = c, state_init
        self.transformer = nn.ModuleDict(dict(
            wte=embedding(c.vocab_size, c.hidden_size),
            prelude=nn.ModuleList(SandwichBlock(c, "prelude", i) for i in range(c.n_prelude)),
            adapter=nn.Linear(2 * c.hidden_size, c.hidden_size, bias=False),
            core_block=nn.ModuleList(SandwichBlock(c, "core", i) for i in range(c.n_core)),
            coda=nn.ModuleList(SandwichBlock(c, "coda", i) for i in range(c.n_coda)),
            ln_f=RMSNorm(c.hidden_size, c.norm_eps),
        ))

    @property
    def draws_random_state(self) -> bool:
        return self.state_init == "like-init"

    def prelude(self, token_ids, ctx, state_seeds=None):
        t = self.transformer
        e = t.wte(token_ids) * self.config.embed_scale
        for block in t.prelude:
            e = block(e, ctx)
        if self.state_init == "zero":
            return torch.zeros_like(e), e
        if state_seeds is None:
            raise ValueError("like-init state needs per-row seeds")
        return like_init_state(state_seeds, e.shape[-1], e.dtype, e.device), e

    def core_step(self, state, inject, ctx):
        t = self.transformer
        s = linear(torch.cat([state, inject], dim=-1), t.adapter.weight)
        for block in t.core_block:
            s = block(s, ctx)
        return s

    def coda(self, state, ctx, logit_rows=None):
        t = self.transformer
        x = t.ln_f(state)
        for block in t.coda:
            x = block(x, ctx)
        x = t.ln_f(x if logit_rows is None else x[logit_rows])
        return linear(x, t.wte.weight).to(compute_dtype(x.dtype))
