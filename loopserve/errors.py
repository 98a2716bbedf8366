"""Exceptions shared across the engine's modules."""


class NonFiniteError(ValueError):
    """A model output computed for one request (logits, an exit signal, a prompt token's hidden state) held NaN or
    infinity.

    The engine fails that request alone; its KV is never read by another request (masked keys are
    gathered from a zero row, see `KVStore`), so the value cannot spread.
    """


# a prompt chunk whose tokens' hidden states went non-finite (the engine's and the reference decoder's words)
NON_FINITE_PROMPT = "the model produced non-finite hidden states for this request's prompt"


class GrammarLimitError(ValueError):
    """A request's grammar went past the parser's limits while it generated (llguidance bounds the work
    of one token's mask). Its own input is at fault: it fails alone, with status 400. (A token that the
    grammar rejects after its mask allowed it is an engine bug, and a plain ValueError.)"""
