"""Building blocks shared by the looped models: RMSNorm, linear layers (stacked projections, their derived copies
and, on the CPU, oneDNN's packed bfloat16 weights), rotary embeddings, and attention over the paged, layout-aware
KV cache."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from loopserve.cache import pool
from loopserve.cache.pool import KVStore
from loopserve.models import rope_pass
from loopserve.models.context import DenseContext, ForwardContext, PrefillGroup


@functools.cache
def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """Precision for norms, softmax and rotary math: at least fp32, float64 stays float64. (Cached:
    `torch.promote_types` is a dispatched op, called a few times per layer.)"""
    return torch.promote_types(dtype, torch.float32)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x * rsqrt(mean(x^2) + eps) in fp32 or wider, cast back to x's dtype: torch's rms_norm computes a bf16
        # input in fp32 itself, as one fused kernel on CUDA from torch 2.8 (so no launches for the casts either:
        # Ouro runs four norms a layer) and on the CPU as the same ops, bit for bit, as writing them out
        return self.weight * F.rms_norm(x, (x.shape[-1],), eps=self.eps)  # the weight after the cast, as upstream


PER_PART_DEVICES = ("cpu",)  # device types where `stacked_linear` multiplies part by part

# Copies derived from a weight and kept on it, by what they are: a bfloat16 weight's parts reordered for oneDNN
# (`_packed`), a gate head's float32 copy (`OuroForCausalLM._gate`). Made at first use and made again once the
# weight has been written in place (its version counter moved) or its data replaced (`Module.to` converts a
# parameter by swapping its data, keeping the object, its attributes and its version); a new tensor carries none
# of the old one's copies.
DERIVED = "loopserve_derived"


def embedding(num: int, dim: int) -> nn.Embedding:
    """An embedding table left uninitialized: whoever builds a model writes its weights (a checkpoint's, make-tiny's
    random ones, training's init). nn.Embedding's own random init, on the meta device models are built on, imports
    torch's Dynamo: 1.6 s of every server's start on this CPU."""
    return nn.Embedding(num, dim, _weight=torch.empty(num, dim))


def derived(weight: torch.Tensor, key: tuple, make: Callable[[torch.Tensor], Any]) -> Any:
    """`make(weight)`, kept on `weight` under `key` and made outside inference mode (usable in and out of it). The
    caller makes sure no product autograd differentiates reads it: a copy has no gradient path to its weight. (An
    inference tensor, a weight made under inference mode, has no version counter: written in place later, which
    only inference mode allows, it would keep its copies.)"""
    copies = getattr(weight, DERIVED, None)
    if copies is None:
        copies = {}
        setattr(weight, DERIVED, copies)
    stamp = (-1 if weight.is_inference() else weight._version, weight.data_ptr(), weight.dtype, weight.device)
    hit = copies.get(key)
    if hit is None or hit[0] != stamp:
        with torch.inference_mode(False), torch.no_grad():
            hit = copies[key] = (stamp, make(weight))
    return hit[1]


# bfloat16 weights on the CPU are multiplied through copies reordered once into oneDNN's blocked layout
# (`pack_linear_weights`): F.linear reorders a bfloat16 weight at every call. A weight marked `PACKED` is multiplied
# through its parts by the part sizes asked for (`derived`, key ("onednn", sizes)).
PACKED = "loopserve_onednn_packed"
PACK_ROWS = 32  # oneDNN's packing hint (rows per call): the products are the same bits for any row count


def can_pack_linear_weights(dtype: torch.dtype, device: torch.device) -> bool:
    return (device.type == "cpu" and dtype == torch.bfloat16 and torch.backends.mkldnn.is_available()
            and torch.ops.mkldnn._is_mkldnn_bf16_supported())


def pack_linear_weights(model: nn.Module) -> None:
    """Multiply `model`'s bfloat16 projection weights (every 2-d parameter that `linear` or `stacked_linear`
    is given) through oneDNN copies reordered once, made at a weight's first product. The same bits as
    `F.linear` at any row count (tested), 1.1-1.5x faster per core step on an AVX-512 CPU at widths 8-32
    (docs/benchmarks.md §8.31); each copy takes as much memory as its weight."""
    for p in model.parameters():
        if p.dim() == 2 and can_pack_linear_weights(p.dtype, p.device):
            setattr(p, PACKED, True)


def _packed(x: torch.Tensor, weight: torch.Tensor, sizes: tuple[int, ...]) -> list[torch.Tensor] | None:
    """The packed parts of `weight` for a product with `x`, or None (not packed, `x` not bfloat16 on the CPU, a
    product autograd would differentiate: the packed one has no backward, or one `torch.compile` traces: inductor
    cannot lower oneDNN's packed product, `bench compile` failed in bfloat16). (The dtype is tested first: a float32
    model never looks a weight up.)"""
    if x.dtype != torch.bfloat16 or x.device.type != "cpu" or not getattr(weight, PACKED, False):
        return None
    if torch.is_grad_enabled() and (weight.requires_grad or x.requires_grad):
        return None
    if torch.compiler.is_compiling():
        return None
    return derived(weight, ("onednn", sizes), lambda w: [torch.ops.mkldnn._reorder_linear_weight(part, PACK_ROWS)
                                                          for part in w.split(list(sizes))])


def _packed_product(x: torch.Tensor, packed: torch.Tensor) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")


def linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x @ weight.T (`F.linear`, no bias), through the weight's packed copy if it has one."""
    packed = _packed(x, weight, (weight.shape[0],))
    return F.linear(x, weight) if packed is None else _packed_product(x, packed[0])


def stacked_linear(x: torch.Tensor, weight: torch.Tensor, sizes: list[int]) -> list[torch.Tensor]:
    """x @ weight.T in parts of `sizes` output features: the parts of a stacked projection (q, k and v; gate and
    up). On an accelerator one matmul (one kernel instead of one a part: a decode core step is launch-bound
    there, docs/benchmarks.md §6.2); on the CPU one a part, on that part's rows of the weight (contiguous: no
    copy), where oneDNN ran the stacked shapes at widths 8-32 in float32 2-10 % slower (§8.27); in bfloat16
    through the parts' packed copies if the weight has them."""
    if x.device.type in PER_PART_DEVICES:
        packed = _packed(x, weight, tuple(sizes))
        if packed is not None:
            return [_packed_product(x, part) for part in packed]
        return [F.linear(x, w) for w in weight.split(sizes)]
    return list(F.linear(x, weight).split(sizes, dim=-1))


def rope_angles(ctx: ForwardContext, head_dim: int, theta: float, dtype: torch.dtype, style: str):
    """The rotation tables [N, head_dim] of the rows' positions for `rope` in `style` ("half": NeoX / HF-Llama,
    Ouro's; "interleaved": GPT-J / complex, Huginn's), cached per forward call: each pair's cos at both its dims,
    and its sin, negated at the pair's first dim."""
    key = (head_dim, theta, style)
    if key not in ctx.cache:
        cdt = compute_dtype(dtype)
        inv = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64, device=ctx.positions.device)
                               / head_dim))
        ang = ctx.positions.to(torch.float64)[:, None] * inv[None, :]
        cos, sin = ang.cos().to(cdt), ang.sin().to(cdt)
        if style == "half":  # dims i and i + d/2 form a pair
            ctx.cache[key] = (torch.cat([cos, cos], -1), torch.cat([-sin, sin], -1))
        else:  # dims 2i and 2i + 1 form a pair
            ctx.cache[key] = (torch.stack([cos, cos], -1).flatten(-2), torch.stack([-sin, sin], -1).flatten(-2))
    return ctx.cache[key]


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, style: str) -> torch.Tensor:
    """Rotary embedding of x [N, heads, d] in fp32 or wider, tables from `rope_angles` in the same `style`:
    x * cos + partner(x) * sin, where a dim's partner is the other dim of its pair. Per element exactly the
    pair rotation written out (x1 c - x2 s is x1 c + x2 (-s) in IEEE arithmetic), in four ops and two casts,
    where that took seven and two (the tables are made once per stage call, not per layer). On the CPU in
    float32 and bfloat16 (inference) the same bits in one compiled pass (`rope_pass`)."""
    if rope_pass.applies((x,), cos, sin):
        return rope_pass.rotate((x,), cos, sin, style == "half")[0]
    xf = x.to(cos.dtype)
    partner = xf.roll(x.shape[-1] // 2, -1) if style == "half" else xf.unflatten(-1, (-1, 2)).flip(-1).flatten(-2)
    return (xf * cos[:, None] + partner * sin[:, None]).to(x.dtype)


def rope_pair(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
              style: str) -> tuple[torch.Tensor, torch.Tensor]:
    """`rope` of a query's heads q [N, heads, d] and a key's k [N, kv_heads, d]: one compiled pass over both where
    `rope_pass` applies, else the heads rotated together (one rotation, half the ops of two)."""
    if rope_pass.applies((q, k), cos, sin):
        q, k = rope_pass.rotate((q, k), cos, sin, style == "half")
        return q, k
    q, k = rope(torch.cat([q, k], dim=1), cos, sin, style).split([q.shape[1], k.shape[1]], dim=1)
    return q, k


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
    if stage == "core":
        kv.write(layout.core_write_slot(layer, ctx.depth), ctx.write_rows, k, v)
    else:
        kv.write(layout.boundary_slot(stage, layer), ctx.write_rows, k, v)
    # Which rows each query reads, and which it sees, is the same for every layer of a stage call: derived
    # once per call (and loop depth) for the stage's first layer; a later layer's slots are those plus
    # `layer_stride` slots per layer: one offset `shift` in the flat index (decode on the CPU reads it as views
    # of the store that start `shift` rows on; elsewhere it is added to the index).
    shift = layer * layout.layer_stride(stage) * kv.slot_stride
    if ctx.one_row_segments:  # decode: one query per sequence, batched over padded keys
        index, visible = _per_call(ctx, ("decode", stage), lambda: _first_layer_reads(
            ctx, stage, ctx.seg_keys, ctx.depth[:, None], ctx.positions[:, None]))
        return attend_decode(q, kv, index, visible, shift)

    # prefill: a sequence's chunk per segment, segments of like size attended to in one padded call
    plan, outs = ctx.prefill_groups, []
    for i, g in enumerate(plan.groups):
        index, mask = _per_call(ctx, ("prefill", stage, i), lambda g=g: _group_reads(ctx, stage, g))
        if shift:
            index = index + shift
        o = attend(q[g.query_rows].transpose(1, 2), kv.keys(index), kv.values(index), mask)
        outs.append(o.transpose(1, 2).reshape(-1, nh * d))  # [G * Q, nh * d]
    return (outs[0] if len(outs) == 1 else torch.cat(outs))[plan.take]


def _per_call(ctx: ForwardContext, key: tuple, make):
    """`make()`, made once per stage call and loop depth: `ctx.cache` outlives `with_depth`, so an entry
    holds the depth tensor it was made for."""
    hit = ctx.cache.get(key)
    if hit is None or hit[0] is not ctx.depth:
        hit = ctx.cache[key] = (ctx.depth, make())
    return hit[1]


def _first_layer_reads(ctx: ForwardContext, stage: str, keys: torch.Tensor, depth: torch.Tensor,
                       last: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(flat KV index [nkv, B, L], visible [B, L]) of key rows `keys` [B, L] for queries at loop `depth` and
    last position `last` ([B, 1] each), in the slots of the stage's first layer. Keys the layout hides
    and keys past `last` (padding; a block table's unused entries point at other sequences' rows) are
    read from the zero row."""
    layout, kv = ctx.layout, ctx.kv
    visible = torch.arange(keys.shape[1], device=keys.device)[None, :] <= last
    if stage == "core":
        slot, shown = layout.core_read(0, depth, kv.depth[keys])
        visible = visible & shown
    else:
        slot = layout.boundary_slot(stage, 0)
    return kv.index(slot, keys.where(visible, kv.zero_row)), visible


def _group_reads(ctx: ForwardContext, stage: str, g: PrefillGroup) -> tuple[torch.Tensor, torch.Tensor]:
    """(flat KV index [nkv, G, Lk], mask [G, Q, Lk]) of a prefill group: its segments' keys, and which
    key each (padded) query row attends to."""
    rows, pos = g.query_rows, ctx.positions[g.query_rows]  # [G, Q]: a segment's last row is its last position
    index, visible = _first_layer_reads(ctx, stage, ctx.seg_keys[g.segments, :g.num_keys], ctx.depth[rows[:, :1]],
                                        pos[:, -1:])
    at = torch.arange(g.num_keys, device=pos.device)
    return index, visible[:, None, :] & (at[None, None, :] <= pos[:, :, None])


SDPA_DECODE_DEVICES = ("cuda",)  # device types where decode attention is one fused kernel per slice of rows


def attend_decode(q: torch.Tensor, kv: KVStore, index: torch.Tensor, visible: torch.Tensor,
                  shift: int = 0) -> torch.Tensor:
    """One query per sequence. q [N, nh, d]; index [nkv, N, L] flat KV indices of each sequence's keys
    (`KVStore.index`), read `shift` rows on (a later layer's slots; on the CPU as offset views of the store,
    which spares writing a shifted copy of the index, 12.6 MB at 32 rows, 12 kv heads and 4k keys, per layer);
    visible [N, L]. Returns [N, nh * d]. A row that sees no key (a passive CB row, discarded) gets zeros.
    On CUDA: K and V gathered, then torch's fused attention (`_sdpa_decode`). Elsewhere the scores, then the
    softmax, then the weighted sum of V, which reads V's rows in place (`KVStore.weighted_values`); the scores
    read K in place on the CPU (float32/64, bfloat16) and gather it otherwise (`KVStore.scores`)."""
    if q.device.type in SDPA_DECODE_DEVICES:
        return _sdpa_decode(q, kv, index + shift if shift else index, visible)
    n, nh, d = q.shape
    scores = kv.scores(q, index, visible, d ** -0.5, shift)  # [nkv, N, g, L]; -inf where not visible
    probs = _softmax_weights(scores, q.dtype)
    return kv.weighted_values(index[:, :, None], probs, shift).transpose(0, 1).reshape(n, nh * d)


def _sdpa_decode(q: torch.Tensor, kv: KVStore, index: torch.Tensor, visible: torch.Tensor) -> torch.Tensor:
    """`attend_decode` as one `scaled_dot_product_attention` per slice of rows over their gathered K and V.

    Why: on a GPU a decode core step is kernel-bound (docs/benchmarks.md §6.2), and scores, mask, softmax and
    the weighted sum of V are about a dozen kernels a layer apart, one fused. The query heads of a KV head
    attend as that head's queries (no GQA expansion). Rows are independent, so a batch whose K would exceed
    `pool.GATHER_ELEMENTS` numbers runs a slice of rows at a time; V is gathered too (the in-place weighted
    sum reads it once; this reads it twice, the price of the fused kernel)."""
    n, nh, d = q.shape
    nkv, length = index.shape[0], index.shape[-1]
    qg = q.view(n, nkv, nh // nkv, d)  # [N, nkv, g, d]
    mask = visible[:, None, None, :]  # [N, 1, 1, L]: every head and query of a row sees its keys
    step = max(1, pool.GATHER_ELEMENTS // max(nkv * length * d, 1))
    outs = []
    for a in range(0, n, step):
        rows = index if step >= n else index[:, a:a + step]
        k, v = kv.keys(rows).transpose(0, 1), kv.values(rows).transpose(0, 1)  # [rows, nkv, L, d]
        outs.append(F.scaled_dot_product_attention(qg[a:a + step], k, v, attn_mask=mask[a:a + step]))
    out = outs[0] if len(outs) == 1 else torch.cat(outs)
    return out.nan_to_num(0.0).reshape(n, nh * d)  # (a row that sees no key: NaN from the kernel, zeros here)


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Masked attention. q [B, nh, Q, d]; k, v [nkv, B, L, d] (head-major, as `KVStore.keys` returns
    them; GQA: nh a multiple of nkv, query head h reads kv head h // (nh // nkv)); mask [B, Q, L] bool.
    Returns [B, nh, Q, d]. The query heads of one kv head are stacked as extra query rows, so both
    products are one batched matmul over contiguous [nkv * B] matrices."""
    bsz, nh, nq, d = q.shape
    nkv = k.shape[0]
    g = nh // nkv
    qg = q.reshape(bsz, nkv, g * nq, d).transpose(0, 1)  # [nkv, B, g*Q, d]; rows (head in group, query)
    keep = mask[None, :, None]  # [1, B, 1, Q, L]
    if q.dtype == torch.bfloat16:
        scores = torch.matmul(qg, k.transpose(-1, -2)).view(nkv, bsz, g, nq, -1) * d ** -0.5
        probs = _masked_softmax(scores, keep, q.dtype).view(nkv, bsz, g * nq, -1)
        out = torch.matmul(probs, v)
    else:
        full = keep.expand(1, bsz, g, nq, mask.shape[-1]).reshape(1, bsz, g * nq, -1)
        out = F.scaled_dot_product_attention(qg, k, v, attn_mask=full).nan_to_num(0.0)
    return out.transpose(0, 1).reshape(bsz, nh, nq, d)


def _masked_softmax(scores: torch.Tensor, keep: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Softmax over the last dim of the kept scores, in fp32 or wider (products stay in the model's
    dtype: bf16 as upstream's eager attention, much faster than upcasting K/V), cast back to `dtype`.
    A row that keeps no score (a passive CB row, whose result is discarded) gets weights 0, not NaN."""
    return _softmax_weights(scores.to(compute_dtype(scores.dtype)).masked_fill(~keep, float("-inf")), dtype)


def _softmax_weights(scores: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Softmax over the last dim in fp32 or wider, cast to `dtype`; a row of only -inf gets weights 0."""
    return scores.to(compute_dtype(scores.dtype)).softmax(-1).nan_to_num(0.0).to(dtype)


def _dense_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ctx: DenseContext) -> torch.Tensor:
    b, s = ctx.batch, ctx.seq_len
    n, nh, d = q.shape
    nkv = k.shape[1]
    qq = q.view(b, s, nh, d).transpose(1, 2)
    kk = k.view(b, s, nkv, d).transpose(1, 2).repeat_interleave(nh // nkv, dim=1)
    vv = v.view(b, s, nkv, d).transpose(1, 2).repeat_interleave(nh // nkv, dim=1)
    out = torch.nn.functional.scaled_dot_product_attention(qq, kk, vv, is_causal=True)
    return out.transpose(1, 2).reshape(n, nh * d)
