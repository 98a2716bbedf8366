"""How the engine compiles its passes over a batch's rows (`compiled`) and its CPU kernels (`kernel`), with numba.

Each pass is a plain Python loop over row indices, compiled with bounds checks, so an index outside
an array raises `IndexError` as numpy's fancy indexing did, instead of reading or writing past it (the
checks cost nothing measurable next to a call's own few µs). The machine code is cached on disk
beside the source, or in the user's cache directory (`NUMBA_CACHE_DIR` names another); where neither
can be written, each process compiles its passes again (a few seconds) instead of failing to import.

A `kernel` is an inner loop over vectors (a dot product per key): bounds checks there would keep LLVM from
vectorizing it, so a kernel checks the indices it reads through itself. It may reassociate float sums (one
fixed order per compiled loop, so its results do not depend on the call) and releases the GIL, so
threads can run slices of one call. A kernel that reads rows scattered over a large array may
`prefetch_row` the rows it will read next: the CPU's own prefetcher follows only sequential reads.

An `elementwise` pass stands for a chain of torch's element-wise ops and must give their bits: it rounds every
product and sum as they do (no fast math). numpy has no bfloat16, so a bfloat16 tensor is passed as its int16
view; `as_float32` and `stored_as` read and write an element of either kind (`widen_bfloat16`, `bfloat16_bits`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar, cast

import numba
from llvmlite import ir
from numba.core import cgutils, types
from numba.extending import intrinsic, overload

F = TypeVar("F", bound=Callable)
# a kernel's float sums may be reordered (vectorized) and its products fused; NaN and inf keep their meaning
_REASSOCIATE = {"reassoc", "contract"}


def compiled(fn: F) -> F:
    return _njit(fn, boundscheck=True)


def kernel(fn: F) -> F:
    return _njit(fn, fastmath=_REASSOCIATE, nogil=True)


def inlined_kernel(fn: F) -> F:
    """A kernel's helper, compiled into its callers (a call per key would cost more than the work)."""
    return cast(F, numba.njit(fastmath=_REASSOCIATE, inline="always")(fn))


def _njit(fn: F, **options) -> F:
    try:
        return cast(F, numba.njit(cache=True, **options)(fn))
    except RuntimeError:  # numba: "cannot cache function ...: no locator available" (nowhere to write)
        return cast(F, numba.njit(**options)(fn))


# the most of a row `prefetch_row` prefetches (a longer row's rest is left to the CPU's own prefetcher)
PREFETCH_BYTES = 512


@intrinsic
def prefetch_row(typingctx, rows, row):
    """Start loading `rows[row]` (a 2-d array), its first `PREFETCH_BYTES`, into the caches for a read soon:
    LLVM's `llvm.prefetch` for each of its 64-byte cache lines. A hint: it never faults, whatever the row,
    and returns nothing. (Written as IR, not as a loop in the kernel: a loop over the row's lines, its
    length known only at run time, made a kernel slower than no prefetch at all.)"""
    if not (isinstance(rows, types.Array) and rows.ndim == 2 and isinstance(row, types.Integer)):
        return None

    def codegen(context, builder, sig, args):
        array = context.make_array(sig.args[0])(context, builder, args[0])
        i64, i32 = ir.IntType(64), ir.IntType(32)
        stride = builder.extract_value(array.strides, 0)
        r = context.cast(builder, args[1], sig.args[1], types.int64)
        start = builder.add(builder.ptrtoint(array.data, i64), builder.mul(r, stride))
        hint = cgutils.get_or_insert_function(
            builder.module, ir.FunctionType(ir.VoidType(), [ir.IntType(8).as_pointer(), i32, i32, i32]),
            "llvm.prefetch.p0i8")
        for offset in range(0, PREFETCH_BYTES, 64):  # line k if the row is longer than k lines: one branch a line
            within = builder.icmp_signed(">", stride, i64(offset)) if offset else cgutils.true_bit
            with builder.if_then(within, likely=True):
                address = builder.inttoptr(builder.add(start, i64(offset)), ir.IntType(8).as_pointer())
                builder.call(hint, [address, i32(0), i32(3), i32(1)])  # a read, kept in every cache level, data
        return context.get_dummy_value()

    return types.void(rows, row), codegen


def elementwise(fn: F) -> F:
    """An element-wise pass over tensors (`kernel`'s options without its fast math: each product and sum rounds
    as in IEEE arithmetic, none fused into another, so the pass gives torch's element-wise ops' bits)."""
    return _njit(fn, nogil=True)


def inlined_elementwise(fn: F) -> F:
    """An `elementwise` pass's helper, compiled into its callers."""
    return cast(F, numba.njit(inline="always")(fn))


@intrinsic
def widen_bfloat16(typingctx, bits):
    """A bfloat16, its 16 bits as an int16 (a bfloat16 tensor's int16 view), as the float32 it widens to exactly:
    the top half of that float32."""
    if bits != types.int16:
        return None

    def codegen(context, builder, sig, args):
        i32 = ir.IntType(32)
        return builder.bitcast(builder.shl(builder.zext(args[0], i32), i32(16)), ir.FloatType())

    return types.float32(types.int16), codegen


@intrinsic
def bfloat16_bits(typingctx, x):
    """float32 `x` rounded to bfloat16 (to nearest, ties to even; a NaN stays a NaN, quieted, its sign kept): its
    16 bits as an int16. In LLVM IR on 32-bit integers, so that a loop of them vectorizes."""
    if x != types.float32:
        return None

    def codegen(context, builder, sig, args):
        i32 = ir.IntType(32)
        u = builder.bitcast(args[0], i32)
        high = builder.lshr(u, i32(16))
        rounded = builder.lshr(builder.add(builder.add(u, i32(0x7FFF)), builder.and_(high, i32(1))), i32(16))
        nan = builder.icmp_unsigned(">", builder.and_(u, i32(0x7FFFFFFF)), i32(0x7F800000))
        return builder.trunc(builder.select(nan, builder.or_(high, i32(0x40)), rounded), ir.IntType(16))

    return types.int16(types.float32), codegen


def as_float32(v):
    """An element read from a tensor's numpy view, as float32: an int16 is taken for a bfloat16's bits (the view a
    bfloat16 tensor is passed as), anything else passes through as it is (the caller checks the dtypes)."""


@overload(as_float32, inline="always")
def _as_float32(v):
    if v == types.int16:
        return lambda v: widen_bfloat16(v)
    return lambda v: v


def stored_as(x, like):
    """float32 `x` as an element of array `like`: into an int16 array (a bfloat16 tensor's view) the bits of its
    bfloat16 rounding, into any other `x` as it is (the caller checks the dtypes)."""


@overload(stored_as, inline="always")
def _stored_as(x, like):
    if like.dtype == types.int16:
        return lambda x, like: bfloat16_bits(x)
    return lambda x, like: x
