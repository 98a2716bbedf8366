"""Incremental detokenization, as vLLM's: streamed text is always a prefix of the full decode; the final text equals
it where the output ends on a whole character (byte-level BPE splits multi-byte characters across tokens), else it
leaves the incomplete one out; the output is decoded after the prompt's last tokens; stop strings and stop tokens by
vLLM's rules."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer as RustTokenizer
from tokenizers import decoders, pre_tokenizers
from tokenizers.decoders import DecodeStream
from tokenizers.models import WordLevel

from loopserve.detokenizer import TextStream
from loopserve.engine.sequence import Sequence
from loopserve.exits import ExitRule
from loopserve.sampling_params import SamplingParams
from loopserve.tokenizer import Tokenizer


def _sequence(tok: Tokenizer, max_tokens: int, stop=None, prompt=(5,), **kw) -> Sequence:
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True, stop=stop, **kw)
    return Sequence("r", None, list(prompt), params, ExitRule("fixed", None, 1, 1), 0, tok, 4096, tok.vocab_size)


def _run(seq: Sequence, ids: list[int]) -> Sequence:
    for t in ids:
        seq.append(t, 1, 0.0)
        if seq.finished:
            break
    return seq


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


EMOJI = "\U0001F600"  # four bytes: four tokens of the tiny checkpoints' byte-level BPE


def test_an_incomplete_last_character_is_left_out(tiny_ouro):
    """An output cut within a character ends before it (vLLM drops what its stream holds back; a plain decode
    would end in U+FFFD), streamed or not; a stop token is not decoded either."""
    tok = Tokenizer(tiny_ouro)
    ids = tok.encode("a" + EMOJI + "b")
    assert len(ids) == 6 and "\ufffd" in tok.decode(ids[:3])
    for kind in (0, 2):  # CUMULATIVE (decoded token by token), FINAL_ONLY (decoded once, at the end)
        assert _run(_sequence(tok, 3, output_kind=kind), ids).text == "a"
        assert _run(_sequence(tok, 5, output_kind=kind), ids).text == "a" + EMOJI
        assert _run(_sequence(tok, 3, output_kind=kind, prompt=ids[:1]), ids[1:] * 2).text == ""
    cut = _run(_sequence(tok, 9, stop_token_ids=[ids[2]]), ids)
    assert (cut.finish_reason, cut.stop_reason, cut.text) == ("stop", ids[2], "a")
    kept = _run(_sequence(tok, 9, stop_token_ids=[ids[4]], include_stop_str_in_output=True), ids)
    assert kept.text == "a" + EMOJI and kept.output_ids == ids[:5]


def test_the_output_is_decoded_after_the_prompt(tiny_ouro):
    """A token that completes a character the prompt began gives the character (vLLM primes its stream with the
    prompt's last tokens); decoded alone, the output would read U+FFFD."""
    tok = Tokenizer(tiny_ouro)
    ids = tok.encode("x" + EMOJI)
    for kind in (0, 2):
        seq = _run(_sequence(tok, 1, prompt=ids[:-1], output_kind=kind), ids[-1:])
        assert seq.text == EMOJI and tok.decode(ids[-1:]) == "\ufffd"


def _metaspace() -> RustTokenizer:
    """A SentencePiece-style tokenizer: a word's token carries its leading space as "▁", which a decode drops at
    the start of what it decodes."""
    tok = RustTokenizer(WordLevel({"<unk>": 0, "\u2581hello": 1, "\u2581world": 2}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Metaspace()
    return tok


def test_a_word_after_the_prompt_keeps_its_space():
    """vLLM's ' world' after 'hello' (decoded alone, the token reads 'world')."""
    tok = _metaspace()
    assert tok.decode([2]) == "world"
    assert TextStream(tok, [1], True).extend([2, 2]) == " world world"
    stream = TextStream(tok, [1], True)
    assert [stream.step(2), stream.step(2)] == [" world", " world"]
    assert TextStream(tok, [], True).extend([2, 2]) == "world world"  # (no prompt: decoded from the start)


@settings(max_examples=150, deadline=None)
@given(prompt=st.lists(st.integers(3, 511), max_size=30), out=st.lists(st.integers(3, 511), min_size=1, max_size=30))
def test_many_tokens_at_once_decode_as_one_at_a_time(tiny_ouro, prompt, out):
    """`extend` (one call of the decoder where it can) gives what feeding the tokens one by one gives, whatever
    the bytes (the tiny vocabulary is mostly single bytes: random ids are often not UTF-8)."""
    tok = Tokenizer(tiny_ouro)
    one = TextStream(tok.tok, prompt, True)
    assert TextStream(tok.tok, prompt, True).extend(out) == "".join(c for c in map(one.step, out) if c)
    # byte-level BPE's shortcut (no priming where the prompt ends on a whole character) changes no text
    assert tok._byte_level
    shortcut = TextStream(tok.tok, prompt, True, byte_level=True)
    assert shortcut.extend(out) == TextStream(tok.tok, prompt, True).extend(out)


def _vllm_text(tok, prompt: list[int], out: list[int]) -> str:
    """vLLM's text of `out` after `prompt`, uncapped: the stream primed token by token with the shortest suffix of
    4-23 prompt tokens that decodes to whole characters, else the whole prompt, then fed `out` token by token."""
    stream = DecodeStream(skip_special_tokens=True)
    suffix = next((prompt[-n:] for n in range(4, min(len(prompt), 23) + 1) if "\ufffd" not in tok.decode(prompt[-n:])),
                  prompt)
    for t in suffix:
        stream.step(tok, t)
    return "".join(c for c in (stream.step(tok, t) for t in out) if c)


@settings(max_examples=150, deadline=None)
@given(text=st.text(min_size=2, max_size=30), cut=st.integers(1, 200), junk=st.lists(st.integers(3, 511), max_size=8))
def test_primed_as_vllm_primes_after_a_prompt_cut_anywhere(tiny_ouro, text, cut, junk):
    """A prompt that is text cut at any token (within a character too), after any bytes: the output's text is
    vLLM's (whose priming reads up to the whole prompt), by both priming rules (byte-level's last 4 tokens, and the
    general one)."""
    tok = Tokenizer(tiny_ouro)
    ids = junk + tok.encode(text)
    k = min(len(junk) + cut, len(ids) - 1)
    prompt, out = ids[:k], ids[k:]
    want = _vllm_text(tok.tok, prompt, out)
    assert TextStream(tok.tok, prompt, True, byte_level=True).extend(out) == want
    assert TextStream(tok.tok, prompt, True).extend(out) == want


def test_the_first_stop_string_listed_wins(tiny_ouro):
    """vLLM's order: of the stop strings that end in a token's new text, the first listed, not the earliest in
    the text."""
    tok = Tokenizer(tiny_ouro)
    ids = tok.encode("a hello")
    assert [tok.decode([i]) for i in ids] == ["a", " he", "ll", "o"]  # "ll" completes both "ll" and "hel"
    seq = _run(_sequence(tok, 20, stop=["ll", "hel"]), ids)
    assert (seq.stop_reason, seq.text, len(seq.output_ids)) == ("ll", "a he", 3)
    seq = _run(_sequence(tok, 20, stop=["hel", "ll"]), ids)
    assert (seq.stop_reason, seq.text, len(seq.output_ids)) == ("hel", "a ", 3)


def test_a_stop_string_may_begin_within_min_tokens(tiny_ouro):
    """vLLM's rule (since its PR 22014): the first min_tokens tokens do not stop the request, but a stop string
    that ends after them may begin in their text."""
    tok = Tokenizer(tiny_ouro)
    ids = tok.encode("abcd")
    assert [tok.decode([i]) for i in ids] == ["a", "b", "c", "d"]
    seq = _run(_sequence(tok, 20, stop=["bc"], min_tokens=2), ids)
    assert (seq.finish_reason, seq.stop_reason, seq.text) == ("stop", "bc", "a")
    seq = _run(_sequence(tok, 4, stop=["ab"], min_tokens=2), ids)  # (ends within them: no stop)
    assert (seq.finish_reason, seq.text) == ("length", "abcd")
