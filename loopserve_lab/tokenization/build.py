"""Byte-level BPE tokenizers laid out like the Ouro and Huginn checkpoints.

The merges come from ``tokenizers``' ``BpeTrainer``; this module adds what the trainer does not do:
the special-token layouts, the byte-ordered base alphabet of the untrained tokenizer, and the HF
tokenizer folder (``tokenizer_config.json`` with the chat template, ``special_tokens_map.json``, the
slow GPT-2 files). Layouts, as the released checkpoints' tokenizer files have them:

* ``arch="ouro"``: ``<|endoftext|>`` = 0, ``<|im_start|>`` = 1, ``<|im_end|>`` = 2, then regular
  tokens. bos = eos = pad = ``<|endoftext|>``; ChatML chat template; ``GPT2Tokenizer`` class.
* ``arch="huginn"``: regular tokens first, then the 32 Huginn special tokens in the last 32 ids
  (``<|begin_text|>`` = vocab_size - 32 is BOS, ``<|end_text|>`` = vocab_size - 31 is EOS). The
  post-processor prepends BOS to a single sequence and appends nothing. ``PreTrainedTokenizerFast``.

Both use a ByteLevel pre-tokenizer without prefix space and a ByteLevel decoder, so every string
round-trips through encode/decode.
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Iterable, Sequence
from functools import lru_cache
from pathlib import Path
from typing import Any

from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors, trainers

__all__ = [
    "ARCHS",
    "HUGINN_BOS",
    "HUGINN_CHAT_TEMPLATE",
    "HUGINN_EOS",
    "HUGINN_PAD",
    "HUGINN_SPECIAL_TOKENS",
    "OURO_CHAT_TEMPLATE",
    "OURO_SPECIAL_TOKENS",
    "ROLE_TOKENS",
    "byte_level_tokenizer",
    "bytes_to_unicode",
    "role_token_ids",
    "special_token_ids",
    "train_bpe",
    "write_tokenizer_files",
]

ARCHS = ("ouro", "huginn")

# --------------------------------------------------------------------------------------------------
# Special tokens
# --------------------------------------------------------------------------------------------------

OURO_SPECIAL_TOKENS: tuple[str, ...] = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")

HUGINN_BOS = "<|begin_text|>"
HUGINN_EOS = "<|end_text|>"
HUGINN_PAD = "<|pad|>"
# Order matters: these occupy ids vocab_size-32 .. vocab_size-1, in this order.
HUGINN_SPECIAL_TOKENS: tuple[str, ...] = (
    HUGINN_BOS,
    HUGINN_EOS,
    "<|begin_header|>",
    "<|end_header|>",
    "<|end_turn|>",
    HUGINN_PAD,
    "<|fim_prefix|>",
    "<|fim_middle|>",
    "<|fim_suffix|>",
    "<|fim_pad|>",
    "<|...|>",
    "<|del|>",
    *(f"<|c_{i}|>" for i in range(10)),
    "<|?|>",
    "<|&|>",
    "<|!|>",
    "<|-|>",
    "<|+|>",
    "<|interrupt|>",
    "<|>>-|>",
    "<|-<<|>",
    "<|->>|>",
    "<|<<-|>",
)
assert len(HUGINN_SPECIAL_TOKENS) == 32 and len(set(HUGINN_SPECIAL_TOKENS)) == 32

# Filler for regular Huginn ids that no merge produced (keeps the specials in the last 32 ids).
_RESERVED_FMT = "<|reserved_{}|>"

# --------------------------------------------------------------------------------------------------
# Chat templates (written into tokenizer_config.json; loopserve.tokenizer renders them as HF does)
# --------------------------------------------------------------------------------------------------

# ChatML: <|im_start|>{role}\n{content}<|im_end|>\n per message; generation prompt
# <|im_start|>assistant\n. No default system message is injected.
OURO_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

# Huginn: BOS before the first message only; <|begin_header|>role<|end_header|>\n\ncontent<|end_turn|>
# with the assistant role written as "Huginn" and content trimmed. The generation prompt opens a
# Huginn header; without it the conversation is closed with <|end_text|>.
HUGINN_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{% if loop.first %}{{ '<|begin_text|>' }}{% endif %}"
    "{{ '<|begin_header|>' }}"
    "{% if message['role'] == 'assistant' %}{{ 'Huginn' }}{% else %}{{ message['role'] }}{% endif %}"
    "{{ '<|end_header|>\\n\\n' + (message['content'] | trim) + '<|end_turn|>' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|begin_header|>Huginn<|end_header|>\\n\\n' }}"
    "{% else %}{{ '<|end_text|>' }}{% endif %}"
)


# --------------------------------------------------------------------------------------------------
# Byte-level alphabet
# --------------------------------------------------------------------------------------------------


@lru_cache(maxsize=1)
def bytes_to_unicode() -> dict[int, str]:
    """The ByteLevel byte -> printable character map.

    Printable Latin-1 bytes stand for themselves; the remaining 68 bytes are mapped, in byte order,
    onto code points 256, 257, ... so that every byte has a visible, non-whitespace symbol.
    """
    keep = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAC + 1), *range(0xAE, 0xFF + 1)]
    kept = set(keep)
    table: dict[int, str] = {}
    extra = 0
    for b in range(256):
        if b in kept:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + extra)
            extra += 1
    return table


def _byte_symbols() -> list[str]:
    table = bytes_to_unicode()
    return [table[b] for b in range(256)]


# --------------------------------------------------------------------------------------------------
# Built-in text used to pick merges for the untrained tokenizer (original sentences).
# --------------------------------------------------------------------------------------------------

_BUILTIN_SENTENCES: tuple[str, ...] = (
    "The kettle on the stove began to whistle just as the rain started again.",
    "She folded the map twice and tucked it into the pocket of her coat.",
    "A looped model runs the same layers several times before it writes a token.",
    "Every morning the baker opens the shop at six and sells the first loaf by seven.",
    "The river was higher than anyone in the village could remember.",
    "He asked whether the train would stop at the station near the old mill.",
    "They planted tomatoes, beans and a row of sunflowers along the fence.",
    "If the answer is not clear, think about the problem one step at a time.",
    "The committee will meet on Thursday to discuss the budget for next year.",
    "Our cat sleeps in the warmest corner of the house and ignores the dog.",
    "The library keeps its rarest books in a cool room without windows.",
    "Please write your name at the top of the page before you begin.",
    "The children counted the stars until they fell asleep on the grass.",
    "When the power failed, the whole street went quiet for a moment.",
    "I would rather walk to the market than wait for the bus in this weather.",
    "The engineer measured the bridge twice and found the same small error.",
    "What time does the museum close on weekends during the summer?",
    "The recipe calls for two cups of flour, one egg and a pinch of salt.",
    "Most of the letters arrived late because of the storm in the north.",
    "The teacher explained that water expands when it freezes into ice.",
    "We could hear the waves against the rocks long before we saw the sea.",
    "Her brother repaired the old radio and it played music for the first time in years.",
    "The server answered every request in less than a second.",
    "A good question is often more useful than a quick answer.",
    "The farmer said that the apples would be ready to pick in October.",
    "There are seven days in a week and twelve months in a year.",
    "The lights of the city were reflected in the still water of the harbour.",
    "He remembered the number, but he had forgotten the name of the street.",
    "The meeting was moved to the large room on the second floor.",
    "Some birds fly thousands of miles south when the nights grow cold.",
    "The students wrote short stories about a journey through the mountains.",
    "Turn left at the church, then keep walking until you reach the bridge.",
    "The doctor told him to drink more water and to rest for a few days.",
    "It is easier to read the instructions than to guess how the machine works.",
    "The garden was full of bees, and the air smelled of lavender and cut grass.",
    "Nobody knew who had left the blue umbrella by the door of the office.",
    "The price of the ticket includes a hot meal and a seat by the window.",
    "On clear nights you can see the planets without a telescope.",
    "The old clock in the hall strikes the hour a minute too early.",
    "She practised the piano every evening until the piece sounded right.",
    "The mountain path is steep, narrow and covered in loose stones.",
    "Write the result of each step on a new line, then check the total.",
    "The shop sells bread, cheese, fresh fish and vegetables from the farm.",
    "After the long winter, the first warm day felt like a small holiday.",
    "The pilot announced that the plane would land twenty minutes ahead of time.",
    "Reading a book by candlelight is slower, but it is strangely pleasant.",
    "The scientist repeated the experiment to be sure that the result was real.",
    "Thank you for your letter; I was very glad to hear that you are well.",
    "They walked along the beach and collected shells of every colour.",
    "The number 42 is larger than 17, and 3.14 is close to the value of pi.",
)


# --------------------------------------------------------------------------------------------------
# Assembly
# --------------------------------------------------------------------------------------------------


def _check_arch(arch: str) -> None:
    if arch not in ARCHS:
        raise ValueError(f"unknown arch {arch!r}; expected one of {ARCHS}")


def _num_regular(arch: str, vocab_size: int) -> int:
    """How many ids are available to regular (non-special) tokens; validates ``vocab_size``."""
    _check_arch(arch)
    n_special = len(OURO_SPECIAL_TOKENS) if arch == "ouro" else len(HUGINN_SPECIAL_TOKENS)
    if vocab_size < 256 + n_special:
        raise ValueError(
            f"vocab_size={vocab_size} too small for arch={arch!r}: need >= {256 + n_special} "
            f"(256 byte symbols + {n_special} special tokens)"
        )
    return vocab_size - n_special


# Each layout's beginning, end and padding tokens (config.json's bos / eos / pad ids), and the tokens that end a reply
# (a generation config's eos ids: the released checkpoints' end of text and end of turn)
ROLE_TOKENS: dict[str, dict[str, str | tuple[str, ...]]] = {
    "ouro": {"bos": "<|endoftext|>", "eos": "<|endoftext|>", "pad": "<|endoftext|>",
             "ends": ("<|endoftext|>", "<|im_end|>")},
    "huginn": {"bos": HUGINN_BOS, "eos": HUGINN_EOS, "pad": HUGINN_PAD, "ends": (HUGINN_EOS, "<|end_turn|>")},
}


def role_token_ids(arch: str, vocab_size: int) -> dict[str, int | list[int]]:
    """`ROLE_TOKENS` of `arch` as ids: {"bos": id, "eos": id, "pad": id, "ends": [ids]}."""
    ids = special_token_ids(arch, vocab_size)
    return {role: [ids[t] for t in tok] if isinstance(tok, tuple) else ids[tok]
            for role, tok in ROLE_TOKENS[arch].items()}


def special_token_ids(arch: str, vocab_size: int) -> dict[str, int]:
    """Special token -> id for a tokenizer of ``vocab_size`` ids built by this module."""
    _check_arch(arch)
    if arch == "ouro":
        return {t: i for i, t in enumerate(OURO_SPECIAL_TOKENS)}
    base = vocab_size - len(HUGINN_SPECIAL_TOKENS)
    return {t: base + i for i, t in enumerate(HUGINN_SPECIAL_TOKENS)}


def _assemble(
    arch: str, regular: Sequence[str], merges: Sequence[tuple[str, str]], vocab_size: int
) -> Tokenizer:
    """Place the special tokens around ``regular`` and wire up the byte-level pipeline."""
    n_regular = _num_regular(arch, vocab_size)
    if len(regular) > n_regular:
        raise ValueError(f"{len(regular)} regular tokens do not fit in {n_regular} regular ids")
    if arch == "ouro":
        specials = list(OURO_SPECIAL_TOKENS)
        tokens = [*specials, *regular]
    else:
        specials = list(HUGINN_SPECIAL_TOKENS)
        filler = [_RESERVED_FMT.format(i) for i in range(n_regular - len(regular))]
        tokens = [*regular, *filler, *specials]
    vocab = {t: i for i, t in enumerate(tokens)}
    if len(vocab) != len(tokens):
        dupes = [t for t, c in Counter(tokens).items() if c > 1]
        raise ValueError(f"duplicate tokens in vocabulary: {dupes[:5]}")
    missing = [s for s in _byte_symbols() if s not in vocab]
    if missing:
        raise ValueError(f"vocabulary lacks {len(missing)} byte symbols")

    tok = Tokenizer(models.BPE(vocab=vocab, merges=list(merges), fuse_unk=False, byte_fallback=False))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(
        [AddedToken(t, special=True, normalized=False, lstrip=False, rstrip=False) for t in specials]
    )
    if arch == "ouro":
        tok.post_processor = processors.ByteLevel(trim_offsets=False)
    else:
        bos_id = vocab[HUGINN_BOS]
        tok.post_processor = processors.TemplateProcessing(
            single=f"{HUGINN_BOS} $A",
            pair=f"{HUGINN_BOS} $A {HUGINN_BOS}:1 $B:1",
            special_tokens=[(HUGINN_BOS, bos_id)],
        )
    ids = special_token_ids(arch, vocab_size)
    for t, i in ids.items():
        assert tok.token_to_id(t) == i, (t, tok.token_to_id(t), i)
    return tok


def _bpe_trainer_merges(
    texts: Iterable[str], n_regular: int, min_frequency: int
) -> tuple[list[str], list[tuple[str, str]]]:
    """``tokenizers``' ``BpeTrainer`` on ``texts`` (ByteLevel words, all 256 byte symbols in the alphabet):
    the regular tokens in the trainer's id order (the 256 byte symbols, then each merge's token) and the merges."""
    trainee = Tokenizer(models.BPE())
    trainee.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(
        vocab_size=n_regular,
        min_frequency=min_frequency,
        special_tokens=[],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    trainee.train_from_iterator(iter(texts), trainer=trainer)
    data = json.loads(trainee.to_str())["model"]
    regular = [t for t, _ in sorted(data["vocab"].items(), key=lambda kv: kv[1])]
    merges: list[tuple[str, str]] = []
    for m in data["merges"]:
        left, right = m.split(" ", 1) if isinstance(m, str) else m  # older serialisation: "left right"
        merges.append((left, right))
    return regular, merges


def byte_level_tokenizer(arch: str, vocab_size: int) -> Tokenizer:
    """A small deterministic byte-level BPE tokenizer with the special-token layout of ``arch``.

    The vocabulary holds the special tokens, the 256 byte symbols (in byte order) and the tokens of
    the merges the ``BpeTrainer`` learns from a built-in list of English sentences, until
    ``vocab_size`` ids are used or no pair occurs twice. Ouro leaves any remaining ids unassigned (the
    tokenizer's vocab is then smaller than ``vocab_size``); Huginn fills them with unreachable
    ``<|reserved_N|>`` tokens so its 32 specials stay in the last 32 ids.
    """
    n_regular = _num_regular(arch, vocab_size)
    regular, merges = _bpe_trainer_merges(_BUILTIN_SENTENCES, n_regular, min_frequency=2)
    return _assemble(arch, [*_byte_symbols(), *regular[256:]], merges, vocab_size)


def train_bpe(texts: Iterable[str], vocab_size: int, arch: str = "ouro") -> Tokenizer:
    """Train a byte-level BPE on ``texts`` with the special-token layout of ``arch``.

    The trainer fills the regular ids (``vocab_size`` minus the specials) unless the text runs out of
    pairs; see ``byte_level_tokenizer`` for what happens then. The regular ids follow the trainer's order.
    """
    regular, merges = _bpe_trainer_merges(texts, _num_regular(arch, vocab_size), min_frequency=0)
    return _assemble(arch, regular, merges, vocab_size)


# --------------------------------------------------------------------------------------------------
# Writing an HF tokenizer folder
# --------------------------------------------------------------------------------------------------


def _token_entry(content: str) -> dict[str, Any]:
    return {"content": content, "lstrip": False, "normalized": False, "rstrip": False, "single_word": False}


def _added_tokens_decoder(tok: Tokenizer) -> dict[str, dict[str, Any]]:
    out: dict[str, dict[str, Any]] = {}
    for idx, added in sorted(tok.get_added_tokens_decoder().items()):
        out[str(idx)] = {
            "content": added.content,
            "lstrip": added.lstrip,
            "normalized": added.normalized,
            "rstrip": added.rstrip,
            "single_word": added.single_word,
            "special": added.special,
        }
    return out


def write_tokenizer_files(
    tok: Tokenizer, arch: str, out_dir: str | Path, model_max_length: int
) -> list[Path]:
    """Write an HF tokenizer folder for ``arch`` into ``out_dir``; returns the files written.

    Always writes ``tokenizer.json``, ``tokenizer_config.json`` (with the chat template) and
    ``special_tokens_map.json``. For Ouro (a ``GPT2Tokenizer``) it also writes ``vocab.json`` and
    ``merges.txt``, as the upstream repos ship them and the slow GPT-2 tokenizer needs them.
    """
    _check_arch(arch)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    vocab_size = tok.get_vocab_size(with_added_tokens=True)
    if arch == "ouro":
        expected = special_token_ids(arch, vocab_size)
    else:
        if vocab_size < 256 + len(HUGINN_SPECIAL_TOKENS):
            raise ValueError(f"vocab_size={vocab_size} too small for a Huginn tokenizer")
        expected = special_token_ids(arch, vocab_size)
    for t, i in expected.items():
        if tok.token_to_id(t) != i:
            raise ValueError(f"special token {t!r} has id {tok.token_to_id(t)}, expected {i} for {arch}")

    written: list[Path] = []
    tok_path = out / "tokenizer.json"
    tok.save(str(tok_path), pretty=True)
    written.append(tok_path)

    if arch == "ouro":
        eos = bos = pad = unk = OURO_SPECIAL_TOKENS[0]
        config: dict[str, Any] = {
            "add_bos_token": False,
            "add_prefix_space": False,
            "added_tokens_decoder": _added_tokens_decoder(tok),
            "additional_special_tokens": list(OURO_SPECIAL_TOKENS[1:]),
            "bos_token": bos,
            "chat_template": OURO_CHAT_TEMPLATE,
            "clean_up_tokenization_spaces": False,
            "eos_token": eos,
            "errors": "replace",
            "model_max_length": int(model_max_length),
            "pad_token": pad,
            "tokenizer_class": "GPT2Tokenizer",
            "unk_token": unk,
            "vocab_size": vocab_size,
        }
        special_map: dict[str, Any] = {
            "additional_special_tokens": list(OURO_SPECIAL_TOKENS[1:]),
            "bos_token": _token_entry(bos),
            "eos_token": _token_entry(eos),
            "pad_token": _token_entry(pad),
            "unk_token": _token_entry(unk),
        }
        # vocab.json + merges.txt (GPT-2 slow-tokenizer files).
        for name in tok.model.save(str(out)):
            written.append(Path(name))
    else:
        config = {
            "added_tokens_decoder": _added_tokens_decoder(tok),
            "bos_token": HUGINN_BOS,
            "chat_template": HUGINN_CHAT_TEMPLATE,
            "clean_up_tokenization_spaces": False,
            "eos_token": HUGINN_EOS,
            "model_input_names": ["input_ids", "attention_mask"],
            "model_max_length": int(model_max_length),
            "pad_token": HUGINN_PAD,
            "tokenizer_class": "PreTrainedTokenizerFast",
        }
        special_map = {
            "bos_token": _token_entry(HUGINN_BOS),
            "eos_token": _token_entry(HUGINN_EOS),
            "pad_token": _token_entry(HUGINN_PAD),
        }

    for name, payload in (("tokenizer_config.json", config), ("special_tokens_map.json", special_map)):
        path = out / name
        path.write_text(json.dumps(payload, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
        written.append(path)
    return written
