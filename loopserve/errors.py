"""Exceptions shared across the engine's modules."""


class NonFiniteError(ValueError):
    """A model output computed for one request (logits, an exit signal) held NaN or infinity.

    The engine fails that request alone; its KV is never read by another request (masked keys are
    gathered from a zero row, see `KVStore`), so the value cannot spread.
    """
