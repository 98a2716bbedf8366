"""Structured output: the grammar of a `GuidedDecodingParams`, one matcher per request, and the token
masks the batched sampler applies (docs/design.md §9).

The grammar engine is llguidance (the optional extra `loopserve[structured]`): it compiles JSON schemas,
regular expressions, choices and Lark/GBNF grammars against the checkpoint's own `tokenizer.json`, and
computes a request's allowed-token bitmask in microseconds, so masks are computed when a batch is
sampled rather than ahead of time.

Where the work happens:
- `grammar_text` turns a spec into llguidance's grammar text and validates it, with no tokenizer; it is
  what makes a bad schema a `ValueError` when the params are built. Cached by the spec's key.
- `new_guide` gives a request its `Guide` when its `Sequence` is built (on the caller's thread, a worker
  thread in the server, not the engine's): the grammar is compiled once per tokenizer and key, tried on
  its first allowed tokens (`_probe`: a grammar past the parser's limits is refused there), and each
  request gets a copy of the compiled matcher, with the grammar's first mask (kept from the probe).
  Compiling runs on a thread with a big stack, for at most GRAMMAR_COMPILE_LIMIT_S (`_on_compile_stack`).
  `with_guide` binds the guide to the
  request's params; `make_sequence` (engine/sequence.py) then refuses a request whose other masks
  (allowed_token_ids, bad_words, min_tokens) ban every token of that first mask (the sampler's `first_token_room`).
- `apply_guides` is the sampler's one call: for the rows whose params carry a guide it fills their
  bitmasks on the host (one parallel call), lets the sampler check them against each row's other masks (a
  row left no token fails alone, `NothingToSampleError`), uploads them once and sets the disallowed logits
  to -inf on the device. Rows without a guide are not touched, and a batch with none costs one scan of its
  params. Each row's mask depends only on its own request, so batches stay invariant (§9). An ambiguous
  grammar's masks grow with its output until one takes seconds, the whole batch waiting: a request whose mask
  takes longer than GRAMMAR_MASK_LIMIT_S fails alone (`_fill_masks`).
- `Guide.advance` moves the matcher past each token its request takes (`Sequence.append`); the request
  finishes with "stop" once the grammar admits nothing but the end.
"""

from __future__ import annotations

import contextlib
import copy
import json
import logging
import threading
import time
import weakref
from collections import OrderedDict
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any, TypeVar, cast

import numpy as np
import torch

from loopserve.device import upload
from loopserve.errors import GrammarLimitError

if TYPE_CHECKING:
    from loopserve.sampling_params import GuidedDecodingParams, SamplingParams
    from loopserve.tokenizer import Tokenizer

log = logging.getLogger(__name__)

T = TypeVar("T")
INSTALL_HINT = "structured output needs llguidance: pip install 'loopserve[structured]'"
# Compiled grammars kept per tokenizer (a request copies one instead of compiling): at most MATCHER_CACHE of them and
# MATCHER_CACHE_CHARS characters of grammar text in all. A matcher's memory grows with its grammar: JSON schemas of
# 1k / 12k / 122k characters held 0.16 / 0.44 / 5.9 MB each (36-122 bytes a character), so a cap by count alone let
# 128 large schemas pin over 2 GB for as long as the server ran; this cap keeps the cache near 100-250 MB.
MATCHER_CACHE = 128
MATCHER_CACHE_CHARS = 2_000_000
# Specs turned into grammar text, or the reason they cannot be, kept by spec (`grammar_text`): at most TEXT_CACHE
# entries and TEXT_CACHE_CHARS characters of spec and grammar text (a schema may be 500,000 characters)
TEXT_CACHE = 256
TEXT_CACHE_CHARS = 8_000_000
# llguidance's parser holds at most 2000 Earley items in a row (its default limit, which bounds the
# work of one mask): a choice among more options that share a first token, a JSON object of ~500
# optional properties or a Lark rule of 2000 alternatives cannot pass their first token. A new grammar
# is therefore tried on this many of its allowed first tokens when it is compiled, so that such a
# grammar is refused before its request starts rather than failing at its first token.
PROBED_FIRST_TOKENS = 64
# llguidance analyses a grammar recursively: a chain of ~2,800 rules, each naming the next, overflowed an
# 8 MB thread stack (a segfault that took the whole process down). Grammars are therefore compiled on a
# thread of their own with this much stack (reserved, not used, until needed): within MAX_GRAMMAR_CHARS
# a chain is at most ~10,000 rules deep, and 12,000 compile in 256 MB.
COMPILE_STACK_BYTES = 256 * 2**20
# The longest one request's token mask may take (`_fill_masks`) before the request fails alone. A grammar's masks cost
# microseconds to some ms (a choice of 1,900 options, a JSON schema of 450 optional properties, a GBNF JSON grammar:
# at most ~40 ms here, on a loaded machine), but an ambiguous grammar's grow with its output (`x: x x x | x x | "a" |
# "b"`: 58 ms by the 75th token, 7 s by the 260th, all within llguidance's item limits), and masks are computed in the
# engine's sampling step, so every other request waited (a probe saw plain requests take 16 s instead of 0.3). Timed,
# so a grammar near the limit may pass on an idle machine and fail on a loaded one: a mask this slow is a stall of
# the whole batch already.
GRAMMAR_MASK_LIMIT_S = 0.1
# The longest a grammar may take to compile (with its first mask) before its request is refused. llguidance 1.9.1
# never returns from the first mask of some small Lark grammars (`start: A B` with `A: /a+/` and `B: /a+b/`; none of
# its parser limits bounds it), and server requests that compile a grammar are built one at a time: one such grammar
# held every later one forever. The compile thread cannot be stopped: it is left running (a core, and memory that
# grows) and logged; its grammar is refused at once when sent again. Large schemas compile in well under a second.
GRAMMAR_COMPILE_LIMIT_S = 20.0
# llguidance's words for a token its grammar does not allow (after a masked sample: an engine bug, a 500);
# any other matcher error is the grammar past the parser's limits (the request's own input, a 400)
REJECTED = "doesn't satisfy the grammar"


def _llguidance() -> Any:
    try:
        import llguidance
    except ImportError:
        raise ValueError(f"guided_decoding: {INSTALL_HINT}") from None
    return llguidance


def _on_compile_stack(fn: Callable[[], T], what: str) -> T:
    """`fn()` on a new thread with COMPILE_STACK_BYTES of stack, its exception raised here; a ValueError naming `what`
    (the grammar's field) if it takes longer than GRAMMAR_COMPILE_LIMIT_S (the thread is left to run: a daemon)."""
    box: list[Any] = []

    def run() -> None:
        try:
            box.append((True, fn()))
        except BaseException as e:  # noqa: BLE001 (re-raised on the caller's thread)
            box.append((False, e))

    with _stack_lock:  # the size applies to threads started while it is set
        old = threading.stack_size(COMPILE_STACK_BYTES)
        try:
            worker = threading.Thread(target=run, name="loopserve-grammar", daemon=True)
            worker.start()
        finally:
            threading.stack_size(old)
    worker.join(GRAMMAR_COMPILE_LIMIT_S)
    if worker.is_alive():
        log.warning("a grammar took longer than %.0f s to compile and was refused; its compile thread cannot be "
                    "stopped and runs on", GRAMMAR_COMPILE_LIMIT_S)
        raise ValueError(f"{what}: the grammar took longer than {GRAMMAR_COMPILE_LIMIT_S:.0f} s to compile "
                         "(llguidance's parser); a simpler grammar compiles")
    ok, value = box[0]
    if not ok:
        raise value
    return value


_stack_lock = threading.Lock()


class SizedLRU:
    """A thread-safe map that forgets its least recently used entries past `entries` of them or past `chars` in
    all (each entry's size given when it is put; the newest entry stays, whatever its size)."""

    def __init__(self, entries: int, chars: int) -> None:
        self.entries, self.chars = entries, chars
        self._items: OrderedDict[Any, tuple[Any, int]] = OrderedDict()
        self._total = 0
        self._lock = threading.Lock()

    def get(self, key: Any) -> Any | None:
        with self._lock:
            hit = self._items.get(key)
            if hit is None:
                return None
            self._items.move_to_end(key)
            return hit[0]

    def put(self, key: Any, value: Any, size: int) -> None:
        with self._lock:
            old = self._items.pop(key, None)
            self._total += size - (old[1] if old is not None else 0)
            self._items[key] = (value, size)
            while len(self._items) > 1 and (len(self._items) > self.entries or self._total > self.chars):
                self._total -= self._items.popitem(last=False)[1][1]

    def __len__(self) -> int:
        return len(self._items)

    @property
    def size(self) -> int:
        return self._total


_texts = SizedLRU(TEXT_CACHE, TEXT_CACHE_CHARS)


class _KeyLocks:
    """A lock per key in use: callers compiling the same grammar at once wait for the first one's result (cached,
    a failure too) instead of compiling it beside it: a compile past GRAMMAR_COMPILE_LIMIT_S leaves its thread
    running, and concurrent requests with one such grammar left one such thread each."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._held: dict[Any, tuple[threading.Lock, int]] = {}  # key -> its lock, and how many hold or wait for it

    @contextlib.contextmanager
    def hold(self, key: Any) -> Iterator[None]:
        with self._lock:
            lock, users = self._held.get(key, (threading.Lock(), 0))
            self._held[key] = (lock, users + 1)
        try:
            with lock:
                yield
        finally:
            with self._lock:
                lock, users = self._held[key]
                if users == 1:
                    del self._held[key]
                else:
                    self._held[key] = (lock, users - 1)


_texts_compiling = _KeyLocks()


def grammar_text(kind: str, text: str, whitespace: str | None = None) -> str:
    """llguidance's grammar for one spec: `kind` is json, regex, choice or grammar (`text`: the schema as
    JSON, the regex, the choices as a JSON list, the Lark or GBNF grammar); `whitespace` is the pattern
    allowed between JSON tokens (None: any whitespace). Raises ValueError naming the field. Cached by spec, a
    failure too, so a bad grammar sent again is not compiled again (some take seconds to fail)."""
    return _compiled_once(_texts, _texts_compiling, (kind, text, whitespace),
                          lambda: _grammar_text(kind, text, whitespace), kind,
                          lambda result: len(text) + len(result))


def _compiled_once(cache: SizedLRU, compiling: _KeyLocks, key: Any, compile_: Callable[[], T], what: str,
                   size: Callable[[Any], int]) -> T:
    """`cache[key]`, else `compile_()` on the compile stack (`_on_compile_stack`, `what`: the grammar's field), once
    for callers that ask for it at once (`compiling`), its result or its failure's message kept (`size` of either);
    a kept failure is raised again as its ValueError."""
    hit = cache.get(key)
    if hit is None:
        with compiling.hold(key):
            hit = cache.get(key)
            if hit is None:
                try:
                    hit = True, _on_compile_stack(compile_, what)
                except ValueError as e:
                    hit = False, str(e)
                cache.put(key, hit, size(hit[1]))
    ok, result = hit
    if not ok:
        raise ValueError(result)
    return cast(T, result)


# llguidance reads a JSON schema's numeric bounds as 64-bit floats, an integer's then clamped to 64-bit integers: a
# bound that a float does not hold exactly is read as another (a minimum of 2^53 + 1 let 2^53 through), and one past
# 2^63 is clamped (minimum 10**30 with maximum 10**30 + 5 let only 9223372036854775807 through, finishing "stop"): such
# bounds are refused. 2^63 - 1, the common int64 maximum, is read right (clamped back to itself).
_BOUNDS = ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum")
_DATA_KEYWORDS = ("default", "examples", "enum", "const")  # (their values are instances, not schemas)
_I64 = 2**63


def _wide_integer_bound(text: str) -> str | None:
    """Why the schema `text` cannot be kept to (a numeric bound llguidance would read as another value), or None;
    None too for a text that is no JSON (llguidance names that). An integer literal anywhere in the schema must be
    exact as a 64-bit float and within int64; a float literal, where an integer is typed, within int64."""
    try:
        schema = json.loads(text)
    except (ValueError, RecursionError):
        return None
    stack = [schema]
    while stack:
        node = stack.pop()
        if isinstance(node, dict):
            kinds = node.get("type")
            integer = kinds == "integer" or (isinstance(kinds, list) and "integer" in kinds)
            for key in _BOUNDS:
                v = node.get(key)
                if isinstance(v, bool) or not isinstance(v, int | float):
                    continue
                exact = (-_I64 <= v < _I64 and (v == _I64 - 1 or float(v) == v)) if isinstance(v, int) else \
                    (not integer or -_I64 <= v < _I64)
                if not exact:
                    return (f"a {key} of {v} is one the grammar cannot keep to exactly (a bound must be a 64-bit "
                            "float's value, within the 64-bit integers)")
            stack.extend(v for k, v in node.items() if k not in _DATA_KEYWORDS)
        elif isinstance(node, list):
            stack.extend(node)
    return None


def _grammar_text(kind: str, text: str, whitespace: str | None) -> str:
    llg = _llguidance()
    matcher = llg.LLMatcher
    if kind == "json":
        overrides: dict[str, Any] | None = None if whitespace is None else {"whitespace_pattern": whitespace} \
            if whitespace else {"whitespace_flexible": False}
        if text.lstrip().startswith("{"):  # (a boolean schema, true or false, takes no options)
            # oneOf read as anyOf, as vLLM's default backend (xgrammar) reads it (llguidance refused even a oneOf of an
            # integer and a number, advising an option no request field sets); an instance may match two branches
            overrides = {**(overrides or {}), "coerce_one_of": True}
        wide = _wide_integer_bound(text)
        if wide is not None:
            raise ValueError(f"json: {wide}")
        try:
            grammar = matcher.grammar_from_json_schema(text, overrides=overrides)
        except ValueError as e:
            raise ValueError(f"json: not a JSON schema ({e})") from None
    elif kind == "regex":
        if (len(text) - len(text.rstrip("\\"))) % 2:  # llguidance would drop it and match the empty string
            raise ValueError("regex: ends with an unfinished escape (a lone backslash)")
        grammar = matcher.grammar_from_regex(text)
    elif kind == "choice":
        grammar = matcher.grammar_from_lark("start: " + " | ".join(json.dumps(c, ensure_ascii=False)
                                                                  for c in json.loads(text)))
    elif kind == "grammar":
        try:
            grammar = llg.grammar_from("grammar", text)  # Lark, or GBNF converted to Lark
        except ValueError as e:
            raise ValueError(f"grammar: {e}") from None
    else:
        raise ValueError(f"guided_decoding: unknown grammar kind {kind!r}")
    error = matcher.validate_grammar(grammar)
    if error:
        raise ValueError(f"{kind}: {_readable(error)}")
    return grammar


def _readable(error: str) -> str:
    """llguidance's error message for a client: without what it appends (the parser's state), and in words
    where it is an internal assertion or a bare error name."""
    error = error.strip().split("\n<", 1)[0]
    if error.startswith("panic"):
        return "the grammar is beyond what llguidance can compile (it failed an internal check)"
    return error if " " in error else f"llguidance cannot compile it ({error})"


class Guide:
    """One request's grammar state: its matcher, advanced past every token the request takes; `first`: the
    bitmask of the tokens its grammar allows first (every fresh matcher's; shared, read-only), which admission
    checks against the request's other masks (the sampler's `first_token_room`)."""

    def __init__(self, matcher: Any, words: int, first: np.ndarray, vocab: int) -> None:
        self.matcher, self.words = matcher, words  # words: int32 words of one bitmask
        self.first, self.vocab = first, vocab  # vocab: the model's (the sampler's logits)
        self.suspect = False  # its last batch's masks were slow: the next is timed alone (`_fill_masks`)
        self.too_slow: str | None = None  # why its grammar's masks are refused

    def advance(self, token: int) -> None:
        """Consume a taken token (raises if the grammar rejects it: the mask was bypassed or the
        matcher failed, and the request cannot go on)."""
        if not self.matcher.consume_token(token):
            error = self.matcher.get_error() or "not allowed here"
            if REJECTED in error:
                raise ValueError(f"guided_decoding: token {token} rejected by the grammar ({_readable(error)})")
            raise GrammarLimitError(f"guided_decoding: the grammar cannot be parsed past this point "
                                    f"({_readable(error)})")

    @property
    def done(self) -> bool:
        """The grammar is complete and admits nothing more: only an eos may follow (`Sequence.take`)."""
        return bool(self.matcher.is_stopped())

    def time_mask(self, out: torch.Tensor) -> None:
        """Compute its mask into `out` ([words] int32) alone, timed: one that takes longer than GRAMMAR_MASK_LIMIT_S
        refuses this and every later mask (`check`)."""
        start = time.perf_counter()
        self.matcher.unsafe_compute_mask_ptr(out.data_ptr(), out.shape[0] * 4)
        spent = time.perf_counter() - start
        self.suspect = False
        if spent > GRAMMAR_MASK_LIMIT_S:
            self.too_slow = (f"guided_decoding: the grammar took {spent * 1e3:.0f} ms to give one token's mask (at "
                             f"most {GRAMMAR_MASK_LIMIT_S * 1e3:.0f}): an ambiguous grammar's parse grows with the "
                             "output, and its masks hold up every request's sampling; write it unambiguously")

    def check(self) -> None:
        if self.too_slow is not None:
            raise GrammarLimitError(self.too_slow)
        if self.matcher.is_error():
            raise GrammarLimitError(f"guided_decoding: {_readable(self.matcher.get_error())}")


class _TextOnly:
    """llguidance's view of a tokenizer (its `TokenizerWrapper` protocol: each token's bytes, the special ones,
    and encoding text) in which text that spells a special token is encoded as text. llguidance encodes the text a
    grammar forces with the tokenizer, and the tokenizers library reads "<|im_end|>" in a text as the special token,
    which llguidance's matcher then refuses as no text (its mask allowed it: a grammar that had to write a special
    token's text failed its request with a 500). The tokens' bytes and special flags are those llguidance reads
    from tokenizer.json itself (`read`)."""

    def __init__(self, read: Any, tokenizer: Tokenizer) -> None:
        n = read.vocab_size
        self.tokens = [read.decode_bytes([i]) for i in range(n)]
        self.special_token_ids = [i for i in range(n) if read.is_special_token(i)]
        self.eos_token_id, self.bos_token_id = read.eos_token, None  # (llguidance takes eos from its caller)
        self._plain = tokenizer.text_only_encoder()

    def __call__(self, text: str) -> list[int]:
        """Text's tokens, special tokens' text encoded as text (a str only: llguidance passes bytes to an encoder
        that takes them, and encodes an unfinished UTF-8 sequence itself otherwise)."""
        if not isinstance(text, str):
            raise TypeError("text only")
        return self._plain.encode(text, add_special_tokens=False).ids


class _Compiler:
    """Grammars compiled against one tokenizer and model vocabulary, as pristine matchers to copy."""

    def __init__(self, tokenizer: Tokenizer, vocab_size: int) -> None:
        llg = _llguidance()
        # the model's vocabulary may be padded past the tokenizer's: the extra ids have no text and
        # llguidance never allows them; a tokenizer larger than the model is cut in `apply_guides`
        n_vocab = max(vocab_size, tokenizer.vocab_size)
        eos = sorted(tokenizer.eos_token_ids) or None
        read = llg.LLTokenizer(tokenizer.tok.to_str(), n_vocab=n_vocab, eos_token=eos)
        self.tokenizer = llg.LLTokenizer(llg.TokenizerWrapper(_TextOnly(read, tokenizer)), n_vocab=n_vocab,
                                         eos_token=eos)
        self.words, self.vocab = (n_vocab + 31) // 32, vocab_size
        # grammar -> (True, its pristine matcher and first mask) or (False, why it failed: not compiled again); server
        # requests build sequences on several threads, and one compiles a grammar at a time (`_compiled_once`)
        self._matchers = SizedLRU(MATCHER_CACHE, MATCHER_CACHE_CHARS)
        self._compiling = _KeyLocks()

    def matcher(self, grammar: str) -> tuple[Any, np.ndarray]:
        """A fresh matcher of `grammar` (a copy of its pristine one) and the bitmask of its first tokens."""
        matcher, first = _compiled_once(self._matchers, self._compiling, grammar, lambda: self._compile(grammar),
                                        "guided_decoding", lambda _: len(grammar))
        return matcher.deep_copy(), first

    def _compile(self, grammar: str) -> tuple[Any, np.ndarray]:
        """The pristine matcher of `grammar` and the bitmask of the tokens it allows first (read-only)."""
        llg = _llguidance()
        # errors without the parser's state and the whole grammar: they go back to the client
        quiet = llg.LLParserLimits(verbose_errors=False)
        pristine = llg.LLMatcher(self.tokenizer, grammar, log_level=0, limits=quiet)
        first = _probe(pristine, self.words)
        first.flags.writeable = False
        return pristine, first


def _probe(matcher: Any, words: int) -> np.ndarray:
    """The bitmask of a fresh matcher's first allowed tokens; ValueError if the matcher is in error, or fails on
    one of them (see PROBED_FIRST_TOKENS)."""
    mask = np.zeros(words, dtype=np.int32)
    if not matcher.is_error():
        matcher.unsafe_compute_mask_ptr(mask.ctypes.data, mask.nbytes)
        allowed = np.flatnonzero(np.unpackbits(mask.view(np.uint8), bitorder="little"))
        for token in allowed[:PROBED_FIRST_TOKENS].tolist():
            trial = matcher.deep_copy()
            if not trial.consume_token(token) and REJECTED not in trial.get_error():
                raise ValueError(f"guided_decoding: the grammar cannot be parsed past its first token "
                                 f"({_readable(trial.get_error())})")
    if matcher.is_error():
        raise ValueError(f"guided_decoding: {_readable(matcher.get_error())}")
    return mask


_compilers: weakref.WeakKeyDictionary[Tokenizer, dict[int, _Compiler]] = weakref.WeakKeyDictionary()
_compilers_lock = threading.Lock()


def new_guide(spec: GuidedDecodingParams, tokenizer: Tokenizer, vocab_size: int) -> Guide:
    """A fresh `Guide` for one request (raises ValueError naming the field for a bad grammar)."""
    with _compilers_lock:
        by_vocab = _compilers.setdefault(tokenizer, {})
        compiler = by_vocab.get(vocab_size)
        if compiler is None:
            compiler = by_vocab[vocab_size] = _Compiler(tokenizer, vocab_size)
    matcher, first = compiler.matcher(grammar_text(*spec.key))
    return Guide(matcher, compiler.words, first, compiler.vocab)


def with_guide(params: SamplingParams, guide: Guide) -> SamplingParams:
    """A request's own copy of its params, carrying its guide to the sampler (params may be shared by
    many requests; the guide is one request's). It only binds: whether the request's first token can be
    sampled at all is checked when the request is made (`make_sequence`, with the sampler's `first_token_room`)."""
    bound = copy.copy(params)
    bound.guide = guide
    return bound


_executor: Any = None


def _fill_masks(guides: list[Guide]) -> torch.Tensor:
    """[G, words] int32 bitmasks on the host (bit t of word t // 32: token t allowed), in one call."""
    global _executor
    for g in guides:
        g.check()  # a matcher in error has no mask to give: this row fails alone (sample_rows)
    masks = torch.zeros((len(guides), guides[0].words), dtype=torch.int32)
    if _executor is None:
        _executor = _llguidance().LLExecutor()
    # the guides of a batch whose masks took longer than GRAMMAR_MASK_LIMIT_S are suspects: their next masks are
    # computed one at a time and timed (a matcher keeps the mask of its state, so this one cannot be timed again)
    alone = [i for i, g in enumerate(guides) if g.suspect]
    together = [(g.matcher, i) for i, g in enumerate(guides) if not g.suspect]
    if together:
        start = time.perf_counter()
        _executor.unsafe_compute_mask_ptr(together, masks.data_ptr(), masks.shape[1] * 4, len(guides))
        if time.perf_counter() - start > GRAMMAR_MASK_LIMIT_S:
            for _, i in together:
                guides[i].suspect = True
    for i in alone:
        guides[i].time_mask(masks[i])
    for g in guides:
        g.check()  # one found too slow fails alone (the sampler's row-by-row retry, `sample_rows`)
    return masks


def apply_guides(x: torch.Tensor, params: list[SamplingParams],
                 check: Callable[[list[int], np.ndarray], None] | None = None) -> torch.Tensor:
    """`x` [B, V] with each guided row's disallowed tokens at -inf (the same tensor when no row has a
    guide; otherwise a new one, so that the caller's tensor is left as it was). `check(rows, masks)`, if given, reads
    the guided rows' bitmasks on the host ([G, words] int32, row j is row rows[j]'s) before they are applied,
    and may raise (the sampler's: a row that its other masks leave no token, `NothingToSampleError`)."""
    rows = [i for i, p in enumerate(params) if p.guide is not None]
    if not rows:
        return x
    guides = [params[i].guide for i in rows]
    words = {g.words for g in guides if g is not None}
    if len(words) != 1:
        raise ValueError("guided_decoding: guides of different vocabularies in one batch")
    masks = _fill_masks([g for g in guides if g is not None])
    if check is not None:
        check(rows, masks.numpy())
    dev, vocab = x.device, x.shape[-1]
    shifts = torch.arange(32, dtype=torch.int32, device=dev)
    bits = (upload(masks, dev)[:, :, None] >> shifts) & 1  # [G, words, 32]: little-endian bits of each word
    allowed = bits.reshape(len(rows), -1)[:, :vocab].bool()
    idx = upload(rows, dev)
    return x.index_put((idx,), x[idx].masked_fill(~allowed, float("-inf")))
