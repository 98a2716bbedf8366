"""A request's output text, decoded incrementally as vLLM's detokenizer decodes it (`TextStream`).

Three rules make the text differ from a plain `decode` of the output ids, and they are vLLM's:
- The stream is primed with the end of the prompt, so the first output token decodes in context: a
  SentencePiece token "▁world" after a prompt reads " world" (decoded alone, "world"), and a token that
  completes a character the prompt began reads as that character.
- A character whose bytes have not all arrived is held back, and at the end of the output it is dropped
  (a plain decode shows U+FFFD).
- A stop token is not decoded unless the request keeps it (`include_stop_str_in_output`: the caller's rule).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

from tokenizers import Tokenizer as RustTokenizer
from tokenizers import decoders
from tokenizers.decoders import DecodeStream

log = logging.getLogger(__name__)

# the prompt's last tokens that prime the stream: the shortest suffix of at least 4 tokens (at most 23) that decodes
# to whole characters, as vLLM's FastIncrementalDetokenizer primes its DecodeStream; where none does (a prompt that
# ends within a character, or in bytes that are not text), vLLM feeds the whole prompt, here its last 23 tokens (fed
# one at a time, a 100,000-token prompt held the engine thread for a tenth of a second). The text differs only where
# those 23 tokens hold no whole character: vLLM's output then begins with a U+FFFD for each byte since the prompt's
# last whole character, loopserve's for those within the 23 tokens
PRIME_MIN, PRIME_MAX = 4, 23
_INVALID_PREFIX = "Invalid prefix encountered"  # tokenizers' DecodeStream error when a decode is not monotonic


def is_byte_level(tok: RustTokenizer) -> bool:
    """Whether `tok`'s decoder is byte-level BPE's alone (GPT-2's, Qwen's, Ouro's, Huginn's): a decode joins the
    tokens' bytes, so nothing but an unfinished character carries over from one token to the next."""
    return isinstance(tok.decoder, decoders.ByteLevel)


def prime_suffix(tok: RustTokenizer, prompt_ids: Sequence[int]) -> Sequence[int]:
    """The prompt tokens a stream is primed with (see PRIME_MIN)."""
    for n in range(PRIME_MIN, min(len(prompt_ids), PRIME_MAX) + 1):
        suffix = prompt_ids[-n:]
        if "\ufffd" not in tok.decode(list(suffix)):
            return suffix
    return prompt_ids[-PRIME_MAX:]


class TextStream:
    """Output ids in, their text out, one token at a time (`step`) or many at once (`extend`): about 1-2 us a
    token by `step`, a few times less by `extend`, which a request that needs no text before it finishes uses
    once. The prompt is read (its last tokens decoded) at the first call, not before."""

    def __init__(self, tok: RustTokenizer, prompt_ids: Sequence[int], skip_special_tokens: bool,
                 byte_level: bool = False) -> None:
        """`byte_level`: the tokenizer's decoder is byte-level BPE's alone (`is_byte_level`), whose text of a prompt
        and an output is the two texts joined where the prompt ends on a whole character: no need to prime then."""
        self._tok, self._prompt_ids, self._skip, self._byte_level = tok, prompt_ids, skip_special_tokens, byte_level
        self._stream: DecodeStream | None = None
        self._stepped = 0  # output tokens fed so far

    def step(self, token: int) -> str | None:
        """The new text that `token` completes (None: none yet, a character is still incomplete)."""
        if self._stream is None:
            self._prime()
        self._stepped += 1
        return self._protected(token)

    def extend(self, tokens: Sequence[int]) -> str:
        """The text of `tokens` fed one by one, joined. Before any token was fed, in one call of the decoder
        when that ends on a whole character (most outputs); else, and after, token by token."""
        if len(tokens) > 1 and self._stepped == 0:
            if self._stream is None:
                self._prime()
            chunk = self._feed_at_once(tokens)
            if chunk is not None:
                self._stepped = len(tokens)
                return chunk
            self._prime()  # the output ends within a character: fed one by one, the whole characters before it
        return "".join(c for c in map(self.step, tokens) if c)

    def _prime(self) -> None:
        ids = self._prompt_ids
        if self._byte_level:  # (only the bytes since the prompt's last whole character carry over)
            if not ids or "\ufffd" not in self._tok.decode(list(ids[-1:])):
                self._stream = DecodeStream(skip_special_tokens=self._skip)
                return  # (the last token's bytes are whole characters: the prompt ends on one, priming changes nothing)
            suffix = ids[-PRIME_MAX:]  # (its last token is part of a character: what carries over is within these)
        else:
            suffix = prime_suffix(self._tok, ids)
        # Fed token by token, the stream keeps the text since its last whole character; the same state comes of
        # feeding in one call a head that ends on a whole character, then the rest token by token: the whole suffix
        # at once where it ends on one, else all but its last PRIME_MIN tokens (a prompt cut within a character),
        # else every token one by one (bytes that are not text)
        for split in (len(suffix), len(suffix) - PRIME_MIN):
            self._stream = DecodeStream(skip_special_tokens=self._skip)
            if split > 1 and self._feed_at_once(suffix[:split]) is not None:
                for token in suffix[split:]:
                    self._protected(token)
                return
        self._stream = DecodeStream(skip_special_tokens=self._skip)
        for token in suffix:
            self._protected(token)

    def _feed_at_once(self, ids: Sequence[int]) -> str | None:
        """`ids` in one call: their text where it ends on a whole character, else None (the stream then holds them:
        the caller starts again; so it does where the decoder raised, as feeding token by token recovers from what it
        can, as vLLM's does)."""
        try:
            return self._feed(list(ids))
        except Exception:
            return None

    def _feed(self, ids: int | list[int]) -> str | None:
        assert self._stream is not None
        return self._stream.step(self._tok, ids)

    def _protected(self, token: int) -> str | None:
        """One token, recovering as vLLM does where a tokenizer's decode is not monotonic (tokenizers' DecodeStream
        then raises "Invalid prefix"): a fresh stream from this token on."""
        try:
            return self._feed(token)
        except Exception as e:
            if not str(e).startswith(_INVALID_PREFIX):
                raise
            log.warning("decode stream reset after a non-monotonic decode at token %d", token)
            self._stream = DecodeStream(skip_special_tokens=self._skip)
            return self._feed(token)
