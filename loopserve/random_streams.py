"""Counter-based random streams: a uniform that is a pure function of (seed, counter), computed for whole
tensors of seeds and counters at once on any device. The sampler draws a request's k-th token from
(its seed, k) (`engine/sampler.py`), Huginn's random initial state draws element j of a token's state from
(its state seed, j) (`models/huginn.py`): no generator object is made or shared, so a row's numbers never
depend on its batch neighbours, and a batch of rows is a few tensor operations, not a loop."""

from __future__ import annotations

from typing import TypeVar

import numpy as np
import torch

_GOLDEN, _MIX1, _MIX2 = (c - (1 << 64) for c in (0x9E3779B97F4A7C15, 0xBF58476D1CE4E5B9, 0x94D049BB133111EB))
Ints = TypeVar("Ints", torch.Tensor, np.ndarray)


def _shr(x: Ints, k: int) -> Ints:
    """Logical right shift of int64 (torch's and numpy's >> are arithmetic)."""
    return (x >> k) & ((1 << (64 - k)) - 1)


def uniforms(seeds: Ints, counters: Ints) -> Ints:
    """A uniform in [0, 1) (float64, 53 bits) per element of `seeds` and `counters` (int64, broadcast): the
    splitmix64 finalizer of seed + (counter + 1) * golden, with int64 arithmetic wrapping as unsigned would.
    Torch tensors (on any device) or numpy arrays, bit for bit the same: the sampler draws a coda batch's few
    uniforms on the host (a dozen numpy calls, where on a GPU each torch op is a launch)."""
    x = seeds + (counters + 1) * _GOLDEN
    x = (x ^ _shr(x, 30)) * _MIX1
    x = (x ^ _shr(x, 27)) * _MIX2
    x = _shr(x ^ _shr(x, 31), 11)
    return (x.astype(np.float64) if isinstance(x, np.ndarray) else x.to(torch.float64)) * 2.0**-53
