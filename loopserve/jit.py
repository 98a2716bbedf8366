"""How the engine compiles its passes over a batch's rows (`compiled`) and its CPU kernels (`kernel`), with numba.

Each pass is a plain Python loop over row indices, compiled with bounds checks, so an index outside
an array raises `IndexError` as numpy's fancy indexing did, instead of reading or writing past it (the
checks cost nothing measurable next to a call's own few µs). The machine code is cached on disk
beside the source, or in the user's cache directory (`NUMBA_CACHE_DIR` names another); where neither
can be written, each process compiles its passes again (a few seconds) instead of failing to import.

A `kernel` is an inner loop over vectors (a dot product per key): bounds checks there would keep LLVM from
vectorizing it, so a kernel checks the indices it reads through itself. It may reassociate float sums (one
fixed order per compiled loop, so its results do not depend on the call) and releases the GIL, so
threads can run slices of one call.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar, cast

import numba

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
