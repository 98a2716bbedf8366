"""Tokenizer of a checkpoint folder, read as transformers reads it: `tokenizer.json` + `tokenizer_config.json`
(special tokens) and the chat templates. The generation config's extra eos ids are the loader's to give
(`extra_eos_ids`): transformers' tokenizers do not read that file either.

Chat templates follow transformers' rules. Where they come from: `chat_template.jinja` in the folder replaces
whatever `tokenizer_config.json` says; `tokenizer_config.json`'s `chat_template` is one template or a list of
`{"name", "template"}`; `additional_chat_templates/NAME.jinja` adds named ones. Which one renders: the one
named by the `chat_template` argument (any other value is the template text itself), else `tool_use` when
tools are given and the folder has it, else `default`. How: a sandboxed Jinja environment with
`trim_blocks`, `lstrip_blocks`, the `loopcontrols` extension, the `{% generation %}` block, a `tojson` that
keeps non-ASCII text, and the globals `raise_exception` and `strftime_now`.

The public methods are transformers' where the names are (scripts written for vLLM call them on
`LLM.get_tokenizer()`): `apply_chat_template` with its keywords and defaults (and a batch of conversations),
calling the tokenizer, `len`, `get_vocab`, `get_added_vocab`, `tokenize`, `decode` and `batch_decode` (of lists,
one id, tensors or arrays), `convert_ids_to_tokens`, `convert_tokens_to_ids`, `convert_tokens_to_string`, the
special tokens and `special_tokens_map` (4.x's: with `additional_special_tokens`), `is_fast`, `model_max_length`
and `name_or_path` (the folder).
transformers' options that are not implemented (padding, tensors, ...) are a ValueError naming the option
when set, never silently ignored. One difference: `decode` and `batch_decode` skip special tokens unless
told not to (transformers keeps them), as the engine detokenizes its outputs.
"""

from __future__ import annotations

import inspect
import json
import logging
import numbers
import os
import uuid
from collections.abc import Generator, Iterable, Mapping, Sequence
from datetime import datetime
from functools import cached_property, lru_cache
from pathlib import Path
from typing import Any, Literal, cast, overload

import jinja2
import jinja2.ext
from jinja2 import nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Encoding, pre_tokenizers
from tokenizers import Tokenizer as HFTokenizer

from loopserve.chat_messages import check_continuable, within
from loopserve.detokenizer import TextStream, is_byte_level
from loopserve.json_files import read_json_object, read_text, unreadable

log = logging.getLogger(__name__)

DEFAULT_TEMPLATE = "default"
TOOL_USE_TEMPLATE = "tool_use"  # picked when tools are given, as transformers does
_JINJA_MARKS = "{}\n"  # a --chat-template value holding one of these is template text, not a path
# texts (characters) and id lists longer than this are encoded and decoded by the tokenizers library's batch calls,
# which release the GIL while they work (the single calls hold it: seconds for megabytes, every other thread stalled,
# a server's event loop too); the same ids and text, for a few microseconds more
RELEASE_GIL_FROM = 1 << 14
_Dicts = Sequence[Mapping[str, Any]]  # messages, tools, documents
# transformers' special-token attributes, in the order its `all_special_tokens` lists them
SPECIAL_TOKEN_NAMES = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
# transformers' options of `apply_chat_template` and of calling the tokenizer that are not implemented here; taken
# at a value that does nothing (None, False, empty), as code passing transformers' defaults does
CHAT_TEMPLATE_OPTIONS = ("padding", "truncation", "max_length", "return_tensors", "return_dict",
                         "return_assistant_tokens_mask", "tokenizer_kwargs")
CALL_OPTIONS = ("padding", "truncation", "max_length", "return_tensors", "is_split_into_words")
# ... and of its `encode` (the call's, and the stride of overflowing windows), and its `decode` and `batch_decode`
ENCODE_OPTIONS = (*CALL_OPTIONS, "stride")
DECODE_OPTIONS = ("clean_up_tokenization_spaces",)
# transformers' `model_max_length` when tokenizer_config.json sets none (its VERY_LARGE_INTEGER)
VERY_LARGE_INTEGER = int(1e30)


def _token_str(v: Any) -> str | None:
    return v.get("content") if isinstance(v, dict) else v


def _check_special_tokens(config: Mapping[str, Any], path: Path) -> None:
    """ValueError naming the file and key unless each special token of tokenizer_config.json is its text, an object
    holding that as its `content` (transformers' AddedToken) or null, and additional_special_tokens a list of tokens."""
    def check(token: Any, key: str) -> None:
        if not isinstance(token, str) and not (isinstance(token, dict) and isinstance(token.get("content"), str)):
            raise ValueError(f'{path}: {key}: must be a token (its text, or an object with its "content"), got '
                             f"{json.dumps(token)}")
    for key in SPECIAL_TOKEN_NAMES:
        if config.get(key) is not None:
            check(config[key], key)
    extra = config.get("additional_special_tokens")
    if extra is not None and not isinstance(extra, list):
        raise ValueError(f"{path}: additional_special_tokens: must be a list of tokens, got {json.dumps(extra)}")
    for token in extra or []:
        check(token, "additional_special_tokens")


def _check_text(text: Any, what: str) -> None:
    """ValueError naming `what` unless `text` is one text (a str) that is Unicode text: not one with a lone
    surrogate, which a Python string can hold and UTF-8 cannot."""
    if not isinstance(text, str):
        raise ValueError(f"{what}: expected one text (a str), got {type(text).__name__}; to tokenize several, call "
                         "the tokenizer on the list: tokenizer(texts)['input_ids']")
    problem = unicode_problem(text)
    if problem is not None:
        raise ValueError(f"{what}: {problem}")


def unicode_problem(text: str) -> str | None:
    """Why `text` is not Unicode text (it holds a lone surrogate, which a Python string can hold and UTF-8 cannot),
    or None."""
    try:
        text.encode()
    except UnicodeEncodeError as e:
        return f"not valid Unicode text (it holds a lone surrogate, U+{ord(text[e.start]):04X})"
    return None


def _token_ids(ids: Any, what: str) -> Any:
    """Token ids as the tokenizers library takes them, from what transformers' `decode` takes (its `to_py_obj`): a
    list as it is, one id (an int) as a list of it, a tensor or an array (torch, numpy) as its list. ValueError
    naming `what` for anything else (a str, a float): the library's TypeError would name neither."""
    if isinstance(ids, list):
        return ids
    ids = ids.tolist() if hasattr(ids, "tolist") else ids
    if isinstance(ids, int):
        return [ids]
    if isinstance(ids, str | bytes) or not isinstance(ids, Iterable):
        raise ValueError(f"{what}: expected token ids (a list of integers, one integer, or a tensor or array of "
                         f"them), got {type(ids).__name__}")
    return list(ids)


def _check_ids(ids: list[Any], what: str) -> None:
    """ValueError naming the first of `ids` that is not a token id: an integer the tokenizers library reads (an
    unsigned 32-bit one). Called only once the library has refused `ids`, so that a decode pays nothing for it."""
    for i, token in enumerate(ids):
        if not (isinstance(token, numbers.Integral) and 0 <= int(token) < 2**32):
            raise ValueError(f"{what}.{i}: expected a token id (an integer >= 0), got {token!r}")


def _take_options(given: Mapping[str, Any], known: Sequence[str], method: str) -> None:
    """transformers' options of a method (`known`), taken at a value that does nothing (`_refuse_options`); a name
    that is not one of them is the TypeError Python raises for an unknown keyword."""
    if not given:  # (most calls: decode runs once per finished request, on the engine thread)
        return
    unknown = sorted(set(given) - set(known))
    if unknown:
        raise TypeError(f"{method} got an unexpected keyword argument {unknown[0]!r}")
    _refuse_options(given)


def _refuse_options(given: Mapping[str, Any]) -> None:
    """ValueError naming the first option in `given` set to a value that would do something: ignoring it would
    hand the caller something other than transformers does (unpadded ids for `padding=True`, a list for
    `return_tensors="pt"`)."""
    for name, value in given.items():
        if value:
            raise ValueError(f"{name}: not supported by this tokenizer (transformers' option; got {value!r})")


def _batch_encoding(encodings: list[Any], mask: bool, types: bool, batched: bool) -> BatchEncoding:
    """What the tokenizer's call returns for these encodings (`tokenizers.Encoding`): ids, then the attention mask
    and the token type ids where asked for; a list of each (`batched`) or the one encoding's."""
    fields = {"input_ids": [e.ids for e in encodings]}
    if types:
        fields["token_type_ids"] = [e.type_ids for e in encodings]
    if mask:
        fields["attention_mask"] = [[1] * len(e.ids) for e in encodings]
    return BatchEncoding({k: v if batched else v[0] for k, v in fields.items()})


class BatchEncoding(dict):
    """What calling the tokenizer returns: `input_ids` and `attention_mask`, read as a dict or as attributes
    (`tok(text).input_ids`), as transformers' BatchEncoding is."""

    def __getattr__(self, name: str) -> Any:
        try:
            return self[name]
        except KeyError:
            raise AttributeError(name) from None


def _continuation_marker(messages: list[Any], marker: str) -> list[Any]:
    """`messages` with `marker` after the final message's text, where `continue_final_message` cuts the rendered
    prompt: the template renders the message as it would, and whatever it adds after the text (its end of turn)
    falls behind the marker. A message with content parts gets it after its last text part."""
    last = dict(messages[-1])
    content = last.get("content")
    where = f"messages.{len(messages) - 1}.content"
    if content is None or isinstance(content, str):
        last["content"] = (content or "") + marker
    elif isinstance(content, Sequence) and not isinstance(content, Mapping):
        parts = list(content)
        texts = [j for j, p in enumerate(parts) if isinstance(p, Mapping) and isinstance(p.get("text"), str)]
        if not texts:
            raise ValueError(f"{where}: continue_final_message needs text in the final message to continue")
        parts[texts[-1]] = {**parts[texts[-1]], "text": parts[texts[-1]]["text"] + marker}
        last["content"] = parts
    else:
        raise ValueError(f"{where}: must be a string or a list of text parts, got {type(content).__name__}")
    return [*messages[:-1], last]


class _TemplateRaised(jinja2.TemplateError):
    """What `raise_exception(...)` in a template raises: the template rejected its input."""


def _raise_exception(message: str) -> None:
    raise _TemplateRaised(message)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    # Jinja's own tojson escapes <, >, & and ' for HTML; chat templates want the JSON text as is
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


class _GenerationBlock(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}` marks assistant text for transformers' training masks; when
    rendering a prompt it is a plain block, but templates that use it must still parse."""

    tags = {"generation"}

    def parse(self, parser: Any) -> list[nodes.Node]:
        next(parser.stream)
        return parser.parse_statements(("name:endgeneration",), drop_needle=True)


_ENV = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                     extensions=[jinja2.ext.loopcontrols, _GenerationBlock])
_ENV.filters["tojson"] = _tojson
_ENV.globals["raise_exception"] = _raise_exception
_ENV.globals["strftime_now"] = _strftime_now


@lru_cache(maxsize=32)
def _compile(template: str) -> jinja2.Template:
    try:
        return _ENV.from_string(template)
    except jinja2.TemplateSyntaxError as e:
        raise ValueError(f"chat_template: not a valid Jinja template (line {e.lineno}: {e.message})") from None


def read_chat_templates(folder: Path, config: Mapping[str, Any]) -> dict[str, tuple[str, str]]:
    """The folder's chat templates by name (`default` for the unnamed one), as transformers loads them, each with
    where it came from (a file, or tokenizer_config.json's key)."""
    where = folder / "tokenizer_config.json"
    raw = config.get("chat_template")
    templates: dict[str, tuple[str, str]] = {}  # name: (template, where it came from)
    if isinstance(raw, str):
        templates[DEFAULT_TEMPLATE] = raw, f"{where}: chat_template"
    elif isinstance(raw, list):
        for entry in raw:
            if not (isinstance(entry, dict) and isinstance(entry.get("name"), str)
                    and isinstance(entry.get("template"), str)):
                raise ValueError(f"{where}: chat_template: each list entry must be "
                                 f'{{"name": ..., "template": ...}}, got {entry!r}')
            templates[entry["name"]] = entry["template"], f"{where}: chat_template {entry['name']!r}"
    elif raw is not None:
        raise ValueError(f"{where}: chat_template: expected a string or a list of named templates")
    jinja_file = folder / "chat_template.jinja"
    if jinja_file.is_file():  # the file replaces the config's template(s) entirely, as in transformers
        templates = {DEFAULT_TEMPLATE: (read_text(jinja_file), str(jinja_file))}
    extra = folder / "additional_chat_templates"
    if extra.is_dir():
        for f in sorted(extra.glob("*.jinja")):
            templates[f.stem] = read_text(f), str(f)
    return templates


def load_chat_template(value: str) -> str:
    """A `--chat-template` value (vLLM's rule): template text if it has Jinja marks, else a file to read."""
    if any(c in value for c in _JINJA_MARKS):
        return value
    path = Path(value).expanduser()
    if not path.is_file():
        raise ValueError(f"chat_template: {value!r} is neither a file nor a Jinja template")
    return read_text(path)


class Tokenizer:
    is_fast = True  # transformers' attribute: a tokenizers-library tokenizer, as its PreTrainedTokenizerFast

    def __init__(self, folder: Path, chat_template: str | None = None, extra_eos_ids: Iterable[int] = ()) -> None:
        """`chat_template`: a template (or a file holding one, see `load_chat_template`) that replaces the
        folder's templates. `extra_eos_ids`: end-of-sequence ids besides `eos_token` (the generation config's),
        all in `eos_token_ids`."""
        path = folder / "tokenizer.json"
        if not path.is_file():
            hint = ("; a folder with only vocab.json and merges.txt (a slow tokenizer's files): convert it once with "
                    "transformers, `AutoTokenizer.from_pretrained(FOLDER).save_pretrained(FOLDER)`, which writes it"
                    if (folder / "vocab.json").is_file() else "")
            raise ValueError(f"{path}: missing tokenizer file{hint}")
        try:
            self.tok = HFTokenizer.from_file(str(path))
        except Exception as e:  # (the tokenizers library raises a bare Exception: truncated, not JSON, git-lfs)
            raise unreadable(path, f"not a readable tokenizer file ({e})") from None
        # a tokenizer.json may carry padding or truncation settings; transformers applies them only when a call
        # asks (here none does), and the batch calls that release the GIL would otherwise pad or cut every text
        self.tok.no_padding()
        self.tok.no_truncation()
        cfg_path = folder / "tokenizer_config.json"
        self.config: dict[str, Any] = read_json_object(cfg_path) if cfg_path.is_file() else {}
        _check_special_tokens(self.config, cfg_path)
        mapped = folder / "special_tokens_map.json"
        if "added_tokens_decoder" not in self.config and mapped.is_file():
            # transformers' older format: a tokenizer_config.json without added_tokens_decoder takes its special
            # tokens from special_tokens_map.json, which wins where both name one (a folder with only the map had
            # no eos token, and generation never stopped)
            special = read_json_object(mapped)
            _check_special_tokens(special, mapped)
            self.config.update({k: special[k] for k in SPECIAL_TOKEN_NAMES if k in special})
            if special.get("additional_special_tokens"):  # (the config's, then the map's not among them)
                extra = list(self.config.get("additional_special_tokens") or [])
                have = {_token_str(t) for t in extra}
                self.config["additional_special_tokens"] = extra + [
                    t for t in special["additional_special_tokens"] if _token_str(t) not in have]
        # transformers' attributes: the folder it was loaded from, and the longest input the model takes
        self.name_or_path = str(folder)
        max_length = self.config.get("model_max_length")
        self.model_max_length: int = max_length if max_length is not None else VERY_LARGE_INTEGER
        self.bos_token = _token_str(self.config.get("bos_token"))
        self.eos_token = _token_str(self.config.get("eos_token"))
        self.bos_token_id = self.tok.token_to_id(self.bos_token) if self.bos_token else None
        self.eos_token_id = self.tok.token_to_id(self.eos_token) if self.eos_token else None
        self.pad_token = _token_str(self.config.get("pad_token"))
        self.pad_token_id = self.tok.token_to_id(self.pad_token) if self.pad_token else None
        self.unk_token = _token_str(self.config.get("unk_token"))
        self.unk_token_id = self.tok.token_to_id(self.unk_token) if self.unk_token else None
        # transformers' attribute: `all_special_tokens` and the chat templates' variable of that name read it
        self.additional_special_tokens = [_token_str(t) for t in self.config.get("additional_special_tokens") or []]
        found = read_chat_templates(folder, self.config)
        self.chat_templates = {name: template for name, (template, _) in found.items()}
        # A folder's template that does not compile is refused when a chat uses it, naming its file, as vLLM starts
        # and warns: completions need no template (the load had been refused, a checkpoint unusable for a template
        # that a newer Jinja feature broke). A template given replaces the folder's, which then need not compile.
        self._broken: dict[str, str] = {}  # a template's text: why it cannot be used
        for template, source in found.values() if chat_template is None else ():
            try:
                _compile(template)
            except ValueError as e:
                # (named by its file: it is no field or flag the user gave)
                self._broken[template] = (f"{source}: {str(e).removeprefix('chat_template: ')}: the model's chat "
                                          "template does not compile; fix it, or give another with --chat-template")
                log.warning("%s; a chat that uses it is refused", self._broken[template])
        if chat_template is not None:
            self.set_chat_template(chat_template)
        self.eos_token_ids: set[int] = {self.eos_token_id} if self.eos_token_id is not None else set()
        self.eos_token_ids |= set(extra_eos_ids)
        self.special_ids = {i for i, t in self.tok.get_added_tokens_decoder().items() if t.special}
        self._token_text: dict[int, str] = {}

    @property
    def vocab_size(self) -> int:
        return self.tok.get_vocab_size()

    @cached_property
    def max_token_id(self) -> int:
        """The largest id of the vocabulary, added tokens included (vLLM's tokenizers carry it)."""
        return max(self.tok.get_vocab(with_added_tokens=True).values())

    @property
    def chat_template(self) -> str | None:
        """The default chat template (None when the folder has none, or only named ones). Set, as transformers'
        attribute is (guidellm's vLLM backend sets a custom one): the template text (never a file's name), which
        replaces every template, as `set_chat_template`, or named templates (a dict, "default" the default one); None
        drops them all."""
        return self.chat_templates.get(DEFAULT_TEMPLATE)

    @chat_template.setter
    def chat_template(self, value: str | dict[str, str] | None) -> None:
        templates = {} if value is None else {DEFAULT_TEMPLATE: value} if isinstance(value, str) else value
        if not isinstance(templates, dict) or not all(isinstance(k, str) and isinstance(t, str)
                                                       for k, t in templates.items()):
            raise ValueError("chat_template: expected a Jinja template (a string), named templates (a dict of "
                             f"strings) or None, got {type(value).__name__}")
        for template in templates.values():
            _compile(template)
        self.chat_templates = dict(templates)

    def set_chat_template(self, value: str) -> None:
        """Use this template (text or a file, as `--chat-template` takes it) instead of the folder's (a broken one
        fails here, at startup, not on the first request)."""
        self.chat_template = load_chat_template(value)

    def encode(self, text: str, text_pair: str | None = None, add_special_tokens: bool = True, what: str = "text",
               **options: Any) -> list[int]:
        """The token ids of `text` (then `text_pair`, joined as the tokenizer's post-processor joins a pair, as
        transformers' `encode(text, text_pair)`); ValueError naming `what` (the caller's field) or `text_pair` for
        anything but one text (a list of texts is the tokenizer's call) and for a string that is not Unicode text:
        one with a lone surrogate, which a Python string can hold and UTF-8 cannot. `options`: transformers' of
        ENCODE_OPTIONS, taken at a value that does nothing."""
        _take_options(options, ENCODE_OPTIONS, "encode")
        return self._encoding(text, add_special_tokens, what, text_pair, "text_pair").ids

    def encode_texts(self, texts: list[str], add_special_tokens: bool = True, what: str = "texts") -> list[list[int]]:
        """The token ids of each text, in one call that releases the GIL (a request's texts are tokenized on a worker
        thread: one `encode` a text held the GIL through each, and the engine thread waited for it at every torch
        call). ValueError naming `what.i` as `encode` names its text."""
        for i, text in enumerate(texts):
            _check_text(text, f"{what}.{i}")
        return [e.ids for e in self.tok.encode_batch(texts, add_special_tokens=add_special_tokens)]

    def tokenize(self, text: str, pair: str | None = None, add_special_tokens: bool = False) -> list[str]:
        """transformers' `tokenize`: the vocabulary symbols of `text` (then `pair`), with the special tokens the
        tokenizer adds only if `add_special_tokens` (transformers' default leaves them out). A byte-level BPE's read
        'Ġthe' for ' the': `convert_tokens_to_string` turns them back into text. ValueError naming `text` or `pair`,
        as `encode`'s names its text."""
        return self._encoding(text, add_special_tokens, "text", pair).tokens

    def _encoding(self, text: str, add_special_tokens: bool, what: str, pair: str | None = None,
                  pair_what: str = "pair") -> Encoding:
        """The tokenizers library's encoding of `text` (then `pair`); ValueError naming `what` or `pair_what` as
        `encode` says."""
        try:
            if isinstance(text, str) and len(text) > RELEASE_GIL_FROM:
                one = text if pair is None else (text, pair)
                return self.tok.encode_batch([one], add_special_tokens=add_special_tokens)[0]
            return self.tok.encode(text, pair, add_special_tokens=add_special_tokens)
        except TypeError:  # (what the tokenizers library raises for both: "TextInputSequence must be str")
            _check_text(text, what)
            if pair is not None:
                _check_text(pair, pair_what)
            raise

    @cached_property
    def _bytes_per_token(self) -> int | None:
        """The most bytes of text one token can stand for, where the tokenizer bounds it, else None. It does
        when every byte of the text ends up in some token, each read from at most its vocabulary entry's
        UTF-8 length: a byte-level BPE (ByteLevel pre-tokenizer, alone or after Digits and isolating
        Splits, which keep all the text; every byte symbol in the vocabulary, so nothing is unknown) with no
        normalizer and no added token that strips the whitespace beside it."""
        spec = json.loads(self.tok.to_str())
        pre = spec.get("pre_tokenizer") or {}
        steps = pre.get("pretokenizers", []) if pre.get("type") == "Sequence" else [pre]
        keeps_text = all(s.get("type") in ("ByteLevel", "Digits")
                         or (s.get("type") == "Split" and str(s.get("behavior")).lower() == "isolated") for s in steps)
        stripping = any(t.lstrip or t.rstrip for t in self.tok.get_added_tokens_decoder().values())
        vocab = self.tok.get_vocab(with_added_tokens=True)
        if (spec.get("normalizer") is not None or (spec.get("model") or {}).get("type") != "BPE" or stripping
                or not keeps_text or not any(s.get("type") == "ByteLevel" for s in steps)
                or not set(pre_tokenizers.ByteLevel.alphabet()) <= vocab.keys()):
            return None
        return max(len(t.encode()) for t in vocab)

    def fewest_tokens(self, text: str) -> int:
        """A lower bound on the tokens `text` encodes to, without encoding it (0 if the tokenizer gives none):
        the server refuses a prompt that cannot fit before it pays for tokenizing it, which holds the GIL
        (about 0.7 us a byte here) and so stalls every other request."""
        most = self._bytes_per_token
        # (a lone surrogate counted as UTF-8 would write it: `encode` then refuses the text, naming its field)
        return -(-len(text.encode("utf-8", "surrogatepass")) // most) if most else 0

    def decode(self, ids: Any, skip_special_tokens: bool = False, **options: Any) -> str:
        """The text of token ids: a list of them, one id (an int), or a tensor or array (torch, numpy) of them, as
        transformers' `decode` takes them (ValueError naming `ids` for anything else), special tokens kept unless
        `skip_special_tokens`, as there. `options`: transformers' of DECODE_OPTIONS, taken at a value that does
        nothing."""
        _take_options(options, DECODE_OPTIONS, "decode")
        ids = _token_ids(ids, "ids")
        try:
            if len(ids) > RELEASE_GIL_FROM:
                return self.tok.decode_batch([ids], skip_special_tokens=skip_special_tokens)[0]
            return self.tok.decode(ids, skip_special_tokens=skip_special_tokens)
        except (TypeError, OverflowError):  # (the library's errors for an item that is not a u32)
            _check_ids(ids, "ids")
            raise

    def text_stream(self, prompt_ids: Sequence[int], skip_special_tokens: bool = True) -> TextStream:
        """The incremental decoder of an output that follows `prompt_ids` (vLLM's rules: `TextStream`)."""
        return TextStream(self.tok, prompt_ids, skip_special_tokens, self._byte_level)

    @cached_property
    def _byte_level(self) -> bool:
        return is_byte_level(self.tok)

    def id_to_token(self, i: int) -> str | None:
        """The vocabulary symbol (a byte-level BPE token reads 'Ġthe'); `decode_token` gives its text."""
        return self.tok.id_to_token(i)

    def decode_token(self, i: int) -> str:
        """One token's text as decoding it alone gives it (' the'; special tokens kept), cached: logprobs
        ask for the same top tokens at every step."""
        text = self._token_text.get(i)
        if text is None:
            text = self._token_text[i] = self.tok.decode([i], skip_special_tokens=False)
        return text

    def __call__(self, text: str | Sequence[str], text_pair: str | Sequence[str] | None = None,
                 add_special_tokens: bool = True, **options: Any) -> BatchEncoding:
        """transformers' call: the `input_ids` and `attention_mask` of a text, or a list of each for a list of
        texts (unpadded); `text_pair`: a text to follow it (a list, one per text, with a list), the pair joined as
        the tokenizer's post-processor joins one. `return_attention_mask` (default: returned) and
        `return_token_type_ids` (default: not; the segment of each token, 0 for the text and 1 for its pair where
        the post-processor marks them) as transformers takes them (lm-eval's vLLM backend asks for no mask);
        `verbose` does nothing (nothing is logged); `options`: transformers' of CALL_OPTIONS, taken at a value that
        does nothing."""
        mask = options.pop("return_attention_mask", None)
        mask = mask is None or bool(mask)
        types = bool(options.pop("return_token_type_ids", None))
        options.pop("verbose", None)
        _take_options(options, CALL_OPTIONS, "Tokenizer()")
        if isinstance(text, str):
            one = self._encoding(text, add_special_tokens, "text", text_pair, "text_pair")  # type: ignore[arg-type]
            return _batch_encoding([one], mask, types, batched=False)
        if isinstance(text, Mapping) or not isinstance(text, Sequence):
            raise ValueError(f"text: expected a string or a list of strings, got {type(text).__name__}")
        if text_pair is None:
            pairs: Sequence[str | None] = [None] * len(text)
        elif isinstance(text_pair, str) or not isinstance(text_pair, Sequence) or len(text_pair) != len(text):
            raise ValueError(f"text_pair: with a list of {len(text)} texts, expected a list of as many, got "
                             f"{type(text_pair).__name__}")
        else:
            pairs = text_pair
        batch = [self._encoding(t, add_special_tokens, f"text.{i}", p, f"text_pair.{i}")
                 for i, (t, p) in enumerate(zip(text, pairs, strict=True))]
        return _batch_encoding(batch, mask, types, batched=True)

    def __await__(self) -> Generator[Any, None, Tokenizer]:
        """`await engine.get_tokenizer()`, as vLLM before V1's renderer had it (a coroutine), gives the tokenizer
        too: code written for either vLLM runs."""
        return self
        yield  # (a generator that returns at once)

    def __len__(self) -> int:
        """The vocabulary's size with the added tokens, as transformers' `len(tokenizer)`."""
        return self.tok.get_vocab_size(with_added_tokens=True)

    def get_vocab(self) -> dict[str, int]:
        """Token (vocabulary symbol, added tokens included) -> id."""
        return self.tok.get_vocab(with_added_tokens=True)

    def batch_decode(self, sequences: Any, skip_special_tokens: bool = False, **options: Any) -> list[str]:
        """`decode` of each of `sequences` (a list of them, or a 2-d tensor or array: its rows)."""
        _take_options(options, DECODE_OPTIONS, "batch_decode")
        if isinstance(sequences, numbers.Integral) or getattr(sequences, "ndim", None) == 0:
            # (one id is not a batch: transformers fails iterating over it)
            raise ValueError(f"sequences: expected a list of token-id sequences (or a 2-d tensor or array), got "
                             f"{type(sequences).__name__} {sequences!r}")
        rows = [_token_ids(ids, f"sequences.{i}") for i, ids in enumerate(_token_ids(sequences, "sequences"))]
        try:
            return self.tok.decode_batch(rows, skip_special_tokens=skip_special_tokens)
        except (TypeError, OverflowError):  # (as in `decode`)
            for i, ids in enumerate(rows):
                _check_ids(ids, f"sequences.{i}")
            raise

    def convert_tokens_to_string(self, tokens: Sequence[str]) -> str:
        """transformers': the text of vocabulary symbols (what `tokenize` gives), read by the tokenizer's decoder
        (joined by spaces if it has none), special tokens kept."""
        decoder = self.tok.decoder
        return decoder.decode(list(tokens)) if decoder is not None else " ".join(tokens)

    def convert_ids_to_tokens(self, ids: int | Sequence[int], skip_special_tokens: bool = False) -> Any:
        """The vocabulary symbol of an id (None outside the vocabulary), or a list of them for a list of ids."""
        if isinstance(ids, int):
            return self.tok.id_to_token(ids)
        skip = set(self.all_special_ids) if skip_special_tokens else set()
        return [self.tok.id_to_token(i) for i in ids if i not in skip]

    def convert_tokens_to_ids(self, tokens: str | Sequence[str]) -> Any:
        """The id of a vocabulary symbol (the unknown token's for one not in it, as transformers answers; None
        if there is no unknown token), or a list of them for a list of symbols."""
        if isinstance(tokens, str):
            i = self.tok.token_to_id(tokens)
            return self.unk_token_id if i is None else i
        return [self.convert_tokens_to_ids(t) for t in tokens]

    @property
    def all_special_tokens(self) -> list[str]:
        """transformers': the tokens of `special_tokens_map` (the special-token attributes that are set, then
        `additional_special_tokens`), each once."""
        tokens = [t for v in self.special_tokens_map.values() for t in ([v] if isinstance(v, str) else v)]
        return list(dict.fromkeys(tokens))

    @property
    def all_special_ids(self) -> list[int]:
        return self.convert_tokens_to_ids(self.all_special_tokens)

    @property
    def special_tokens_map(self) -> dict[str, str | list[str]]:
        """transformers' (4.x): each special-token attribute that is set (SPECIAL_TOKEN_NAMES) -> its token, then
        `additional_special_tokens` -> their list, if any."""
        named = {n: _token_str(self.config.get(n)) for n in SPECIAL_TOKEN_NAMES}
        out: dict[str, str | list[str]] = {n: t for n, t in named.items() if t}
        additional = [t for t in self.additional_special_tokens if t]
        if additional:
            out["additional_special_tokens"] = additional
        return out

    def info(self) -> dict[str, Any]:
        """What vLLM's GET /tokenizer_info answers: tokenizer_config.json's settings, its special tokens as text
        (`special_tokens_map`), `tokenizer_class`, and the chat template a chat request renders with (the default
        one, as set: `--chat-template`'s or the folder's; None when there is none)."""
        return {"tokenizer_class": "PreTrainedTokenizerFast", **self.config, **self.special_tokens_map,
                "chat_template": self.chat_template}

    def get_added_vocab(self) -> dict[str, int]:
        """transformers': the added tokens (tokenizer.json's `added_tokens`, special or not) -> their ids, by id."""
        return {t.content: i for i, t in sorted(self.tok.get_added_tokens_decoder().items())}

    def get_chat_template(self, chat_template: str | None = None, tools: Sequence[Any] | None = None) -> str:
        """The template text to render: `chat_template` names one of the folder's, is itself a template, or is a file
        holding one (`load_chat_template`, as `--chat-template` reads it: a string with no Jinja marks would render
        as itself, whatever the conversation)."""
        if chat_template is not None:
            if chat_template in self.chat_templates:
                return self.chat_templates[chat_template]
            try:
                return load_chat_template(chat_template)
            except (ValueError, OSError):  # (OSError: a name too long for a path, say, or a file it cannot read)
                what = (f"a Jinja template, a readable file or one of the model's templates "
                        f"({', '.join(sorted(self.chat_templates))})" if self.chat_templates
                        else "a Jinja template or a readable file")
                raise ValueError(f"chat_template: {chat_template[:80]!r} is not {what}") from None
        if tools is not None and TOOL_USE_TEMPLATE in self.chat_templates:
            return self.chat_templates[TOOL_USE_TEMPLATE]
        if DEFAULT_TEMPLATE in self.chat_templates:
            return self.chat_templates[DEFAULT_TEMPLATE]
        if self.chat_templates:
            raise ValueError(f"chat_template: the model has several templates and none is 'default'; name one of "
                             f"{', '.join(sorted(self.chat_templates))}")
        raise ValueError("chat_template: the model has none (no chat_template.jinja, none in "
                         "tokenizer_config.json); pass one")

    def _special_tokens(self) -> dict[str, Any]:
        names = ("bos_token", "eos_token", "unk_token", "pad_token")
        out: dict[str, Any] = {n: _token_str(self.config.get(n)) or "" for n in names}
        out["additional_special_tokens"] = self.additional_special_tokens  # (shared: the sandbox is immutable)
        return out

    @overload
    def apply_chat_template(self, conversation: _Dicts, tools: _Dicts | None = None, documents: _Dicts | None = None,
                            chat_template: str | None = None, add_generation_prompt: bool = False,
                            continue_final_message: bool = False, *, tokenize: Literal[False],
                            **kwargs: Any) -> str: ...

    @overload
    def apply_chat_template(self, conversation: _Dicts, tools: _Dicts | None = None, documents: _Dicts | None = None,
                            chat_template: str | None = None, add_generation_prompt: bool = False,
                            continue_final_message: bool = False, tokenize: Literal[True] = True,
                            **kwargs: Any) -> list[int]: ...

    @overload
    def apply_chat_template(self, conversation: Sequence[_Dicts], tools: _Dicts | None = None,
                            documents: _Dicts | None = None, chat_template: str | None = None,
                            add_generation_prompt: bool = False, continue_final_message: bool = False, *,
                            tokenize: Literal[False], **kwargs: Any) -> list[str]: ...

    @overload
    def apply_chat_template(self, conversation: Sequence[_Dicts], tools: _Dicts | None = None,
                            documents: _Dicts | None = None, chat_template: str | None = None,
                            add_generation_prompt: bool = False, continue_final_message: bool = False,
                            tokenize: Literal[True] = True, **kwargs: Any) -> list[list[int]]: ...

    def apply_chat_template(self, conversation: _Dicts | Sequence[_Dicts], tools: _Dicts | None = None,
                            documents: _Dicts | None = None, chat_template: str | None = None,
                            add_generation_prompt: bool = False, continue_final_message: bool = False,
                            tokenize: bool = True, **kwargs: Any) -> str | list[int] | list[str] | list[list[int]]:
        """transformers' `apply_chat_template`, with its arguments and defaults: the conversation rendered with
        the chat template, as token ids (none added: the template writes the special tokens itself), or as text
        with `tokenize=False`. A batch of conversations (a list whose first item is a list, transformers' test)
        gives a list of those, each rendered with the same arguments; an error names the conversation's field
        under `messages.<i>`.

        `tools`: JSON-schema dicts. `documents`: the template's `documents`. `chat_template`: see
        `get_chat_template`. `add_generation_prompt`: end with the template's opening of an assistant reply.
        `continue_final_message`: end with the final message's text instead, its turn left open for the model to
        continue (the final message, whatever its role, as transformers has it; not with `add_generation_prompt`).
        transformers' options
        of CHAT_TEMPLATE_OPTIONS are taken at a value that does nothing. Other keyword arguments
        (`enable_thinking`, ... a vLLM request's `chat_template_kwargs`) become template variables and may
        override the special tokens (`bos_token`, `eos_token`, ...); not `messages`, the conversation's name in
        the template (TEMPLATE_RESERVED; a ValueError naming it). ValueError naming `messages` when the
        template rejects the conversation (`raise_exception`) or fails on it, `chat_template` when there is no
        template or it does not parse."""
        _refuse_options({name: kwargs.pop(name) for name in CHAT_TEMPLATE_OPTIONS if name in kwargs})
        for name in kwargs:  # (`messages`: the one reserved name that is not an argument here)
            if name in TEMPLATE_RESERVED:
                raise ValueError(f"{name}: {TEMPLATE_RESERVED[name]}")
        first = conversation[0] if isinstance(conversation, list | tuple) and conversation else None
        batch = isinstance(first, list | tuple)  # (transformers' test of a batch)
        conversations = cast("Sequence[_Dicts]", conversation) if batch else [cast("_Dicts", conversation)]
        rendered: list[Any] = []
        for i, messages in enumerate(conversations):
            try:
                text = self._render(messages, tools, documents, chat_template, add_generation_prompt,
                                    continue_final_message, kwargs)
            except ValueError as e:
                raise within(e, f"messages.{i}" if batch else "messages") from None
            rendered.append(self.encode(text, add_special_tokens=False) if tokenize else text)
        return rendered if batch else rendered[0]

    def _render(self, messages: _Dicts, tools: _Dicts | None, documents: _Dicts | None, chat_template: str | None,
                add_generation_prompt: bool, continue_final_message: bool, kwargs: dict[str, Any]) -> str:
        if not isinstance(messages, Sequence) or isinstance(messages, str) or not all(
                isinstance(m, Mapping) for m in messages):
            raise ValueError("messages: expected a list of {'role': ..., 'content': ...} objects")
        if tools is not None and (isinstance(tools, str | Mapping) or not isinstance(tools, Sequence)
                                  or not all(isinstance(t, Mapping) for t in tools)):
            raise ValueError("tools: expected a list of JSON-schema objects")
        text = self.get_chat_template(chat_template, tools)
        if text in self._broken:
            raise ValueError(self._broken[text])
        template = _compile(text)
        variables = {**self._special_tokens(), "documents": documents, **kwargs,
                     "tools": None if tools is None else list(tools), "add_generation_prompt": add_generation_prompt}

        def render(conversation: list[Any]) -> str:
            try:
                return template.render({**variables, "messages": conversation})
            except _TemplateRaised as e:
                raise ValueError(f"messages: {e.message}") from None
            except Exception as e:  # an undefined field, a wrong type in a message, a sandbox violation
                why = f"{type(e).__name__}: {e}"
                raise ValueError(f"messages: the chat template could not render them ({why})") from None

        if not continue_final_message:
            return render(list(messages))
        if add_generation_prompt:  # (LLM.chat and the server leave this check, and the next, to this one)
            raise ValueError("continue_final_message: cannot be combined with add_generation_prompt, which opens "
                             "a new assistant message instead of continuing the final one; set add_generation_prompt "
                             "to false (LLM.chat and chat requests default it to true)")
        check_continuable(messages)
        # a text no message holds but by a 2^-122 chance: the prompt is cut where the template put it
        marker = f"CONTINUE{uuid.uuid4().hex}"
        text = render(_continuation_marker(list(messages), marker))
        if text.count(marker) != 1:
            raise ValueError("continue_final_message: the chat template does not render the final message's text "
                             "once and unchanged, so the prompt cannot end with it")
        prompt = text[:text.index(marker)]
        bare = prompt.rstrip()
        if bare == prompt:
            return prompt
        # The marker hid the text's trailing whitespace from a template that trims the content (Llama 3's do). The
        # prompt keeps as much of it as the conversation rendered as it is does, as transformers cuts it: the
        # model then goes on from the text the template would have shown it.
        kept = len(os.path.commonprefix([prompt, render(list(messages))]))
        return prompt[:max(kept, len(bare))]


# apply_chat_template's arguments that are also the template's variables of the same name, which the template
# variables a caller passes on (vLLM's `chat_template_kwargs`) may set instead: vLLM passes `documents` so
TEMPLATE_ARGUMENTS = ("documents",)
_RESERVED_WHY = {
    "conversation": "the conversation: the template's `messages` are the messages given",
    "chat_template": "picks the template to render; it is not a variable of one",
    "tokenize": "not a template variable (the prompt is rendered as text, then tokenized)",
    **{name: f"set by `{name}` itself, not by a template variable"
       for name in ("tools", "add_generation_prompt", "continue_final_message")},
}


def _reserved() -> dict[str, str]:
    own = [p.name for p in inspect.signature(Tokenizer.apply_chat_template).parameters.values()
           if p.kind is not p.VAR_KEYWORD and p.name not in TEMPLATE_ARGUMENTS]
    why = {name: _RESERVED_WHY.get(name, "an argument of apply_chat_template, not a template variable") for name in own}
    why["messages"] = _RESERVED_WHY["conversation"]  # what the template calls the conversation
    return {**why, **{name: "transformers' option of apply_chat_template, not a template variable"
                      for name in CHAT_TEMPLATE_OPTIONS}}


# The template variables a caller may not set (LLM.chat's and a request's `chat_template_kwargs`), with why: each
# of apply_chat_template's own arguments (read off its signature, so that one added there is reserved here too),
# transformers' options of it, and `messages`, the template's name for the conversation. The one list that
# `template_variables` (LLM.chat, the server) and `apply_chat_template` itself check.
TEMPLATE_RESERVED: dict[str, str] = _reserved()


# apply_chat_template's switches that a caller's `chat_template_kwargs` may set, over the call's own arguments of
# those names (vLLM merges a request's kwargs over them: `{"add_generation_prompt": false}` for a reward model's score)
TEMPLATE_SWITCHES = ("add_generation_prompt", "continue_final_message")


def template_switches(kwargs: Any, where: str = "chat_template_kwargs") -> dict[str, bool]:
    """The `TEMPLATE_SWITCHES` a caller's `chat_template_kwargs` sets, which win over the call's own arguments;
    ValueError naming `<where>.<name>` for a value that is not true or false."""
    if not isinstance(kwargs, Mapping):
        return {}
    for name in TEMPLATE_SWITCHES:
        if name in kwargs and not isinstance(kwargs[name], bool):
            raise ValueError(f"{where}.{name}: must be true or false, got {kwargs[name]!r}")
    return {name: kwargs[name] for name in TEMPLATE_SWITCHES if name in kwargs}


def template_variables(kwargs: Any, where: str = "chat_template_kwargs") -> dict[str, Any]:
    """A caller's extra template variables (`chat_template_kwargs`), checked, as keywords to pass on to
    `apply_chat_template`: ValueError naming `<where>` when it is not a mapping of names, `<where>.<name>` (with the
    reason of TEMPLATE_RESERVED) for a name the call sets itself, which would otherwise collide with the argument
    of that name (a TypeError) or override it. `documents` (TEMPLATE_ARGUMENTS) is taken: it reaches the template
    as the argument would; `TEMPLATE_SWITCHES` are left out (`template_switches` reads them)."""
    if kwargs is None:
        return {}
    if not isinstance(kwargs, Mapping):
        raise ValueError(f"{where}: expected a dict of template variables, got {type(kwargs).__name__}")
    for name in kwargs:
        if not isinstance(name, str):
            raise ValueError(f"{where}: the variables' names must be strings, got {name!r}")
        if name in TEMPLATE_RESERVED and name not in TEMPLATE_SWITCHES:
            raise ValueError(f"{where}.{name}: {TEMPLATE_RESERVED[name]}")
    template_switches(kwargs, where)
    return {name: value for name, value in kwargs.items() if name not in TEMPLATE_SWITCHES}
