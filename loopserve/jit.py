"""`compiled`: how the engine compiles its passes over a batch's rows (numba).

Each pass is a plain Python loop over row indices, compiled with bounds checks, so an index outside
an array raises `IndexError` as numpy's fancy indexing did, instead of reading or writing past it (the
checks cost nothing measurable next to a call's own few µs). The machine code is cached on disk
beside the source, or in the user's cache directory (`NUMBA_CACHE_DIR` names another); where neither
can be written, each process compiles its passes again (a few seconds) instead of failing to import.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar, cast

import numba

F = TypeVar("F", bound=Callable)


def compiled(fn: F) -> F:
    try:
        return cast(F, numba.njit(cache=True, boundscheck=True)(fn))
    except RuntimeError:  # numba: "cannot cache function ...: no locator available" (nowhere to write)
        return cast(F, numba.njit(boundscheck=True)(fn))
