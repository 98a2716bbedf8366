"""Building blocks shared by the looped models: RMSNorm, rotary embeddings, and attention over the
paged, layout-aware KV cache."""

from __future__ import annotations

import torch
from torch import nn

from loopserve.models.context import DenseContext, ForwardContext


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """Precision for norms, softmax and rotary math: at least fp32, float64 stays float64."""
    return torch.promote_types(dtype, torch.float32)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.to(compute_dtype(x.dtype))
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)  # cast back before the weight, as upstream does


def rope_angles(ctx: ForwardContext, head_dim: int, theta: float, dtype: torch.dtype):
    """cos/sin of shape [N, head_dim // 2] for the rows' positions, cached per forward call."""
    key = (head_dim, theta)
    if key not in ctx.rope_cache:
        cdt = compute_dtype(dtype)
        inv = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64, device=ctx.positions.device)
                               / head_dim))
        ang = ctx.positions.to(torch.float64)[:, None] * inv[None, :]
        ctx.rope_cache[key] = (ang.cos().to(cdt), ang.sin().to(cdt))
    return ctx.rope_cache[key]


def rope_rotate_half(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """NeoX / HF-Llama convention: dims i and i + d/2 form a pair. x: [N, heads, d]."""
    xf = x.to(cos.dtype)
    x1, x2 = xf.chunk(2, dim=-1)
    c, s = cos[:, None, :], sin[:, None, :]
    return torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], dim=-1).to(x.dtype)


def rope_interleaved(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """GPT-J / complex convention: adjacent dims (2i, 2i+1) form a pair. x: [N, heads, d]."""
    xf = x.to(cos.dtype).unflatten(-1, (-1, 2))
    x0, x1 = xf[..., 0], xf[..., 1]
    c, s = cos[:, None, :], sin[:, None, :]
    return torch.stack([x0 * c - x1 * s, x1 * c + x0 * s], dim=-1).flatten(-2).to(x.dtype)


def paged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ctx: ForwardContext,
                    stage: str, layer: int) -> torch.Tensor:
    """Causal attention of the rows over their sequences' cached KV.

    Writes this layer application's K/V for the rows first, then reads what the layout allows.
    q: [N, heads, d]; k, v: [N, kv_heads, d]. Returns [N, heads * d].
    """
    if isinstance(ctx, DenseContext):
        return _dense_attention(q, k, v, ctx)
    layout, kv = ctx.layout, ctx.kv
    n, nh, d = q.shape
    nkv = k.shape[1]
    if stage == "core":
        kv.write(layout.core_write_slot(layer, ctx.depth), ctx.write_rows, k, v)
    else:
        slot = layout.prelude_slot(layer) if stage == "prelude" else layout.coda_slot(layer)
        kv.write(slot, ctx.write_rows, k, v)

    def slots(keys: torch.Tensor, depth: torch.Tensor):
        if stage != "core":
            s = layout.prelude_slot(layer) if stage == "prelude" else layout.coda_slot(layer)
            return torch.full_like(keys, s), torch.ones_like(keys, dtype=torch.bool)
        return layout.core_read(layer, depth, kv.depth[keys])

    cdt = compute_dtype(q.dtype)
    scale = d ** -0.5
    if ctx.one_row_segments:  # decode: one query per sequence, batched over padded keys
        keys = ctx.seg_keys  # [N, Lk]
        slot, visible = slots(keys, ctx.depth[:, None])
        visible = visible & (torch.arange(keys.shape[1], device=keys.device)[None, :] <= ctx.positions[:, None])
        kk, vv = kv.k[slot, keys], kv.v[slot, keys]  # [N, Lk, nkv, d]
        qg = q.view(n, nkv, nh // nkv, d).to(cdt)
        scores = torch.einsum("nhgd,nlhd->nhgl", qg, kk.to(cdt)) * scale
        scores = scores.masked_fill(~visible[:, None, None, :], float("-inf"))
        # nan_to_num: a passive CB row may see no key at all; its result is discarded anyway
        out = torch.einsum("nhgl,nlhd->nhgd", scores.softmax(-1).nan_to_num(0.0), vv.to(cdt))
        return out.reshape(n, nh * d).to(q.dtype)

    outs = []
    for s in range(len(ctx.seg_starts) - 1):
        a, b = ctx.seg_starts[s], ctx.seg_starts[s + 1]
        lk = int(ctx.positions[b - 1]) + 1
        keys = ctx.seg_keys[s, :lk]
        slot, visible = slots(keys, ctx.depth[a])
        mask = visible[None, :] & (torch.arange(lk, device=keys.device)[None, :] <= ctx.positions[a:b, None])
        kk, vv = kv.k[slot, keys], kv.v[slot, keys]  # [Lk, nkv, d]
        qg = q[a:b].view(b - a, nkv, nh // nkv, d).to(cdt)
        scores = torch.einsum("qhgd,lhd->hgql", qg, kk.to(cdt)) * scale
        scores = scores.masked_fill(~mask[None, None], float("-inf"))
        o = torch.einsum("hgql,lhd->qhgd", scores.softmax(-1), vv.to(cdt))
        outs.append(o.reshape(b - a, nh * d))
    return torch.cat(outs).to(q.dtype)


def _dense_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ctx: DenseContext) -> torch.Tensor:
    b, s = ctx.batch, ctx.seq_len
    n, nh, d = q.shape
    nkv = k.shape[1]
    qq = q.view(b, s, nh, d).transpose(1, 2)
    kk = k.view(b, s, nkv, d).transpose(1, 2).repeat_interleave(nh // nkv, dim=1)
    vv = v.view(b, s, nkv, d).transpose(1, 2).repeat_interleave(nh // nkv, dim=1)
    out = torch.nn.functional.scaled_dot_product_attention(qq, kk, vv, is_causal=True)
    return out.transpose(1, 2).reshape(n, nh * d)
