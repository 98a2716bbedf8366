"""Incremental detokenization: streamed text is always a prefix of the full decode, and the final
text equals it (byte-level BPE splits multi-byte characters across tokens)."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from loopserve.engine.sequence import Sequence
from loopserve.exits import ExitRule
from loopserve.sampling_params import SamplingParams
from loopserve.tokenizer import Tokenizer


def _sequence(tok: Tokenizer, max_tokens: int, stop=None) -> Sequence:
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True, stop=stop)
    return Sequence("r", None, [5], params, ExitRule("fixed", None, 1, 1), 0, tok, 4096, tok.vocab_size)


@settings(max_examples=60, deadline=None)
@given(text=st.text(min_size=1, max_size=40))
def test_streamed_text_is_a_prefix_and_final_text_is_exact(tiny_ouro, text):
    tok = Tokenizer(tiny_ouro)
    ids = tok.encode(text) or [7]
    seq = _sequence(tok, len(ids))
    for i, t in enumerate(ids):
        seq.append(t, 1, 0.0)
        full = tok.decode(ids[: i + 1])
        assert full.startswith(seq.text)
    assert seq.finished and seq.text == tok.decode(ids)
    assert tok.decode(ids, skip_special_tokens=False) == text  # (text may spell a special token)


def test_stop_string_truncates_the_incremental_text(tiny_ouro):
    tok = Tokenizer(tiny_ouro)
    ids = tok.encode("to be or not to be")
    seq = _sequence(tok, 100, stop=["not"])
    for t in ids:
        seq.append(t, 1, 0.0)
        if seq.finished:
            break
    assert seq.finish_reason == "stop" and seq.text == "to be or "
