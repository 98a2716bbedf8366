"""A request's token budget: its prompt and completion checked against the context and the KV pool
before it is added, by the server and by `LLM` alike (one rule for both), so that a request that can
never run is refused up front instead of failing mid-generation. (How many blocks a request's samples
need together is the scheduler's `never_fits`, which both ask next.)"""

from __future__ import annotations

import functools
import logging
import os
from typing import Any

from loopserve.sampling_params import is_int

log = logging.getLogger(__name__)

# vLLM's variable: "1" or "true" lets max_model_len pass the model's context (its positions past it were never trained)
LONG_MODEL_LEN_ENV = "VLLM_ALLOW_LONG_MAX_MODEL_LEN"
# vLLM's max_model_len "auto" (or -1): the longest context the KV pool holds, at most the model's own
AUTO_MODEL_LEN = -1


def checked_model_len(cap: Any, max_position: int, kv_tokens: int | None = None) -> int:
    """A request's maximum prompt + completion length: `cap` (max_model_len) or the model's own context
    (`max_position`); for `AUTO_MODEL_LEN`, the model's context or what the KV pool holds (`kv_tokens`, once it is
    sized) if less. ValueError if the cap leaves no room to generate, or exceeds the model's context unless
    $VLLM_ALLOW_LONG_MAX_MODEL_LEN allows it (as vLLM, with a warning)."""
    if cap is None:
        return max_position
    if is_int(cap) and cap == AUTO_MODEL_LEN:
        fitted = max_position if kv_tokens is None else max(2, min(max_position, kv_tokens))
        if fitted < max_position:
            log.info("max_model_len auto: %d, what the KV cache holds (the model's context: %d)", fitted,
                     max_position)
        return fitted
    longer = is_int(cap) and cap > max_position
    if longer and os.environ.get(LONG_MODEL_LEN_ENV, "0").strip().lower() in ("1", "true"):  # (vLLM's reading)
        _warn_long_model_len(cap, max_position)
        return cap
    if not (is_int(cap) and 2 <= cap <= max_position):
        allows = f"; {LONG_MODEL_LEN_ENV}=1 allows more, as vLLM's" if longer else ""
        raise ValueError(f"max_model_len: must be in [2, {max_position}] (the model's context{allows}), got {cap!r}")
    return cap


@functools.cache  # (once: an LLM checks its max_model_len as it loads, and its engine again)
def _warn_long_model_len(cap: int, max_position: int) -> None:
    log.warning("max_model_len %d is greater than the model's context (%d), as $%s allows: the model was never "
                "trained on positions past %d, and what it computes there may be meaningless", cap, max_position,
                LONG_MODEL_LEN_ENV, max_position)


def pool_tokens(engine: Any) -> int:
    """The tokens the engine's KV pool holds (whole blocks)."""
    return engine.kv.num_blocks * engine.kv.block_size


def sequence_room(max_model_len: int, kv_tokens: int | None) -> int:
    """The most tokens one sequence (prompt and completion) may hold: the context, or the KV pool if smaller
    (`kv_tokens`: `pool_tokens`; None: no pool to fit, the reference decoder). A completion's budget is what
    its prompt leaves of it (`completion_budget`); a beam ends where it is full (`BeamSearch`'s `room`)."""
    return max_model_len if kv_tokens is None else min(max_model_len, kv_tokens)


def over_context(field: str, max_model_len: int, prompt_len: int, requested: int) -> ValueError:
    """The error for a prompt and a completion that do not fit the context together: vLLM's words (whose numbers
    clients parse) after the name of the field at fault."""
    return ValueError(f"{field}: This model's maximum context length is {max_model_len} tokens. However, you "
                      f"requested {prompt_len + requested} tokens ({prompt_len} in the messages, {requested} in the "
                      f"completion). Please reduce the length of the messages or completion.")


def completion_budget(prompt_len: int, requested: int | None, *, max_model_len: int, kv_tokens: int | None,
                      default: int | None = None, prompt_field: str = "prompt", field: str = "max_tokens",
                      clip_to_context: bool = False) -> int:
    """The completion's token budget: `requested` (given in the request's `field`) checked against the
    context (`max_model_len`) and the KV pool (`kv_tokens`; None: no pool to fit, the reference decoder),
    or, when not requested, the room left, capped by `default`. ValueError naming the field at fault
    (`prompt_field`: the prompt's) when the request cannot run.

    `clip_to_context`: a completion asked to run past the context ends at its end instead (vLLM's offline
    `LLM` does that, finish_reason "length"; its server, like this one, refuses the request)."""
    if prompt_len >= max_model_len:  # (vLLM's words after the field's name, which clients' patterns read)
        raise ValueError(f"{prompt_field}: This model's maximum context length is {max_model_len} tokens. However, "
                         f"your request has {prompt_len} input tokens, which leave no room to generate. Please "
                         f"reduce the length of the input messages.")
    room = sequence_room(max_model_len, kv_tokens) - prompt_len
    if room < 1:
        raise ValueError(f"{prompt_field}: {prompt_len} tokens do not fit in the KV cache ({kv_tokens} tokens)")
    if requested is None:
        return room if default is None else min(default, room)
    if requested < 1:
        return requested  # SamplingParams names the error
    if clip_to_context:
        requested = min(requested, max_model_len - prompt_len)
    if prompt_len + requested > max_model_len:
        raise over_context(field, max_model_len, prompt_len, requested)
    if kv_tokens is not None and prompt_len + requested > kv_tokens:
        raise ValueError(f"{field}: {prompt_len} prompt + {requested} completion tokens exceed the KV cache "
                         f"({kv_tokens} tokens)")
    return requested
