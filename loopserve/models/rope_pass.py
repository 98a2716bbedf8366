"""The rotary embedding on the CPU as one compiled pass (float32 and bfloat16, inference).

Written as torch ops (`layers.rope`), a rotation is a cast up, a roll, two products by the tables, a sum and a
cast down: five or six passes over the heads (float32 needs no cast up), the products broadcasting the tables over
them, which torch's CPU loops run slowly. In a 2,048-token Ouro prefill those ops took about 15 % of the step
(docs/benchmarks.md §8.32). This pass reads each element once and writes it once.

Per element it computes what the ops compute, in the same order and rounding: x * cos and partner(x) * sin each
rounded to float32, their sum rounded to float32, then (bfloat16) rounded to bfloat16: no product is fused into
the sum (`jit.elementwise`), so the result is the ops' bits (tested against the pair rotation written out; a NaN
stays a NaN, its payload aside).
"""

from __future__ import annotations

import numpy as np
import torch

from loopserve.jit import as_float32, elementwise, inlined_elementwise, stored_as

ROPE_DTYPES = (torch.float32, torch.bfloat16)


def applies(xs: tuple[torch.Tensor, ...], cos: torch.Tensor, sin: torch.Tensor) -> bool:
    """Whether `rotate` takes this rotation: plain CPU tensors (not a subclass, a functorch transform's wrapper or a
    lazily negated view: the pass reads their memory through numpy) of one dtype in `ROPE_DTYPES` with float32 tables,
    none of which autograd differentiates (the pass has no backward), outside torch.compile's tracing."""
    if not all(type(t) is torch.Tensor for t in (*xs, cos, sin)) or torch.compiler.is_compiling():
        return False  # (the types first: an fx Proxy is not looked into)
    if not _dtypes_taken(xs, cos, sin):
        return False
    grad = torch.is_grad_enabled()
    return not any(t.device.type != "cpu" or t.is_neg() or (grad and t.requires_grad) or _functorch_wrapped(t)
                   for t in (*xs, cos, sin))


_functorch_wrapped = torch._C._functorch.is_functorch_wrapped_tensor


def _dtypes_taken(xs: tuple[torch.Tensor, ...], cos: torch.Tensor, sin: torch.Tensor) -> bool:
    """Heads of one dtype in `ROPE_DTYPES`, float32 tables."""
    dtype = xs[0].dtype
    return dtype in ROPE_DTYPES and all(x.dtype == dtype for x in xs) and cos.dtype == sin.dtype == torch.float32


def compile_pass(dtype: torch.dtype) -> None:
    """Compile the pass for `dtype` (or load it from numba's cache) for the calls the models make (one tensor, and
    a query's and a key's heads), so that no request waits for it: a second or two the first time on a machine."""
    if dtype in ROPE_DTYPES:
        x, tables = torch.zeros(1, 1, 2, dtype=dtype), torch.zeros(1, 2)  # (float32)
        rotate((x,), tables, tables, True)
        rotate((x, x), tables, tables, True)


def rotate(xs: tuple[torch.Tensor, ...], cos: torch.Tensor, sin: torch.Tensor, half: bool) -> list[torch.Tensor]:
    """`layers.rope` of one or two tensors x [N, heads, d] (a query's and a key's heads: one call) with tables
    cos, sin [N, d] (sin negated at a pair's first dim), pairs (i, i + d/2) if `half`, else (2i, 2i + 1); new
    tensors of the xs' dtype."""
    n, d = cos.shape
    if len(xs) not in (1, 2) or sin.shape != (n, d) or d % 2 or any(
            x.dim() != 3 or x.shape[0] != n or x.shape[2] != d for x in xs):
        raise ValueError(f"rope: {[tuple(x.shape) for x in xs]} and tables {tuple(cos.shape)}, {tuple(sin.shape)} "
                         "do not match")
    if not _dtypes_taken(xs, cos, sin):
        raise ValueError(f"rope: the pass takes heads of one dtype in {ROPE_DTYPES} and float32 tables, not "
                         f"{[x.dtype for x in xs]} heads and {cos.dtype}, {sin.dtype} tables")
    outs = [torch.empty(x.shape, dtype=x.dtype) for x in xs]
    bits = xs[0].dtype == torch.bfloat16  # (numpy has no bfloat16: its bits, as int16)
    arrays = [(t.view(torch.int16) if bits else t).numpy() for t in (*xs, *outs)]
    if len(xs) == 1:  # (the second tensor: none, as no heads)
        arrays = [arrays[0], arrays[0][:, :0], arrays[1], arrays[1][:, :0]]
    q, k, q_out, k_out = arrays
    _rotate(q, k, cos.contiguous().numpy(), sin.contiguous().numpy(), half, q_out, k_out)
    return outs


@elementwise
def _rotate(q, k, cos, sin, half, q_out, k_out):  # pragma: no cover (compiled)
    """Both tensors' heads rotated (`rotate`)."""
    _rotate_heads(q, cos, sin, half, q_out)
    _rotate_heads(k, cos, sin, half, k_out)


@inlined_elementwise
def _rotate_heads(x, cos, sin, half, out):  # pragma: no cover (compiled)
    """out[i, h] = x[i, h] * cos[i] + partner(x[i, h]) * sin[i], in float32. (Indices only ever count up from 0: an
    index that may be negative, j - d/2, is wrapped around by numba at each read, which keeps LLVM from vectorizing
    the loop.)"""
    n, heads, d = x.shape
    mid = d // 2
    row = np.empty(d, np.float32)
    for i in range(n):
        c, s = cos[i], sin[i]
        for h in range(heads):
            xs, o = x[i, h], out[i, h]
            for j in range(d):
                row[j] = as_float32(xs[j])
            if half:  # dims j and j + d/2 form a pair
                for j in range(mid):
                    o[j] = stored_as(row[j] * c[j] + row[j + mid] * s[j], out)
                    o[j + mid] = stored_as(row[j + mid] * c[j + mid] + row[j] * s[j + mid], out)
            else:  # dims 2j and 2j + 1 form a pair
                for j in range(mid):
                    a = 2 * j
                    o[a] = stored_as(row[a] * c[a] + row[a + 1] * s[a], out)
                    o[a + 1] = stored_as(row[a + 1] * c[a + 1] + row[a] * s[a + 1], out)
