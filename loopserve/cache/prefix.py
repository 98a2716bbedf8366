"""Keys of the prefix cache: when two prompts' blocks hold the same KV (docs/design.md §4.3).

A full prompt block's key is a hash chained over the prompt's blocks from a root that names
everything else its KV depends on: the engine's scope (model, dtype, KV layout, and for `shared` the
prefill chunk size, since chunks are part of the semantics, §4.2), the request's prompt depth
(prompt tokens run `max_loops` loops and keep that KV depth), and, when the model draws random
initial states (Huginn like-init), the state seed base the per-position seeds are chained from
(§8), and the request's cache salt if it has one (vLLM's `cache_salt`: requests share cached blocks
only with requests of the same salt, so one cannot learn from timing what another's prompt held).
Equal keys mean equal token prefixes under equal roots, so the blocks hold bit-identical KV.
SHA-256: a collision would silently serve another prompt's KV.
"""

from __future__ import annotations

import hashlib
import math

import numpy as np


def cache_scope(model: str, dtype: str, layout: str, prefill_chunk_size: int) -> bytes:
    """The engine-wide part of every key (a cache lives in one engine's pool; this keeps keys honest
    should a pool ever outlive its configuration)."""
    chunk = prefill_chunk_size if layout == "shared" else 0  # other layouts: chunking does not change KV
    return hashlib.sha256(f"{model}|{dtype}|{layout}|{chunk}".encode()).digest()


def block_keys(scope: bytes, prompt_depth: int, state_base: int | None, tokens: list[int],
               block_size: int, salt: str | None = None) -> list[bytes]:
    """Keys of the prompt's full blocks (block i covers tokens [i*bs, (i+1)*bs) and all before it)."""
    root = scope + f"|{prompt_depth}|{state_base}".encode()
    if salt is not None:  # (depth and seed base hold no '|': no salted root equals an unsalted one)
        root += b"|salt|" + hashlib.sha256(salt.encode("utf-8", "surrogatepass")).digest()
    h = hashlib.sha256(root).digest()
    data = np.asarray(tokens, dtype=np.int64).tobytes()
    step = 8 * block_size
    keys = []
    for i in range(len(tokens) // block_size):
        h = hashlib.sha256(h + data[i * step:(i + 1) * step]).digest()
        keys.append(h)
    return keys


def reusable_tokens(num_cached_blocks: int, prompt_len: int, block_size: int, align: int) -> int:
    """Prompt tokens a request may take from its cached blocks: whole blocks, short of the last prompt
    token (its logits give the first sampled token, so it is always computed), and a multiple of
    `align` (for `shared`, the chunk size: a restart in mid-chunk would see that chunk's earlier
    tokens at their final depth instead of at each loop's)."""
    n = min(num_cached_blocks * block_size, (prompt_len - 1) // block_size * block_size)
    unit = math.lcm(block_size, align)
    return n // unit * unit
