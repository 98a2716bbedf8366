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
  its first allowed tokens (`compile_matcher`: a grammar past the parser's limits is refused there), and each
  request gets a copy of the compiled matcher, with the grammar's first mask (kept from the probe).
  Every new grammar (text and matcher) is compiled first in a child process that is killed past
  GRAMMAR_COMPILE_LIMIT_S (engine/grammar_compile.py's `Vetter`), then here on a thread with a big stack.
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
import threading
import time
import weakref
from collections import OrderedDict
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any, TypeVar, cast

import numpy as np
import torch

from loopserve.device import upload
from loopserve.engine.grammar_compile import (
    REJECTED,
    TokenizerSource,
    Vetter,
    compile_matcher,
    llguidance,
    on_compile_stack,
    readable,
)
from loopserve.engine.grammar_compile import grammar_text as compile_text
from loopserve.errors import GrammarLimitError

if TYPE_CHECKING:
    from loopserve.sampling_params import GuidedDecodingParams, SamplingParams
    from loopserve.tokenizer import Tokenizer

T = TypeVar("T")
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
# held every later one forever. Its compile, in the vetting child, is stopped (the child killed, logged); its grammar
# is refused at once when sent again. Large schemas compile in well under a second.
GRAMMAR_COMPILE_LIMIT_S = 20.0
_vetter = Vetter()  # (engine/grammar_compile.py)


class GrammarNotCompiled(Exception):
    """A grammar that is not compiled yet (nor known to fail), met while `building` with compiled grammars only."""


_building = threading.local()  # this thread's request build: `compiled_only`, `stop` (`building`)


@contextlib.contextmanager
def building(compiled_only: bool = False, stop: Callable[[], None] | None = None) -> Iterator[None]:
    """On this thread, within it: with `compiled_only`, a grammar that is not compiled yet raises GrammarNotCompiled
    instead of being compiled (the server builds a request so first, so that one whose grammars are compiled does not
    wait for its turn behind new ones, each of which may take GRAMMAR_COMPILE_LIMIT_S); `stop()`, if given, is called
    before each step of a compile and may raise (a server's shutdown: a compile that had not started, or waited for
    its turn, ran its full limit, the process waiting for it)."""
    _building.compiled_only, _building.stop = compiled_only, stop
    try:
        yield
    finally:
        _building.compiled_only, _building.stop = False, None


def stop_vetting(error: BaseException) -> None:
    """Stop the grammar being compiled in the vetting child, if one is: its request ends with `error` (a server's
    shutdown: it would have waited for the compile, up to GRAMMAR_COMPILE_LIMIT_S)."""
    _vetter.interrupt(error)


def _must_compile() -> None:
    if getattr(_building, "compiled_only", False):
        raise GrammarNotCompiled


def _vet(job: tuple[Any, ...], what: str, source: TokenizerSource | None = None) -> Any:
    return _vetter.vet(job, what, GRAMMAR_COMPILE_LIMIT_S, source, getattr(_building, "stop", None))


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
    a failure too) instead of compiling it beside it: grammars are vetted one at a time, so concurrent requests with
    one grammar past GRAMMAR_COMPILE_LIMIT_S would each wait the limit out in turn."""

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
                          lambda: _compile_text(kind, text, whitespace), lambda result: len(text) + len(result))


def _compile_text(kind: str, text: str, whitespace: str | None) -> str:
    """The spec's grammar text as the vetting child compiles it (here only where there is no child)."""
    vetted = _vet(("text", kind, text, whitespace), kind)
    if vetted is not None:
        return cast(str, vetted)
    return on_compile_stack(lambda: compile_text(kind, text, whitespace), kind, GRAMMAR_COMPILE_LIMIT_S)


def _compiled_once(cache: SizedLRU, compiling: _KeyLocks, key: Any, compile_: Callable[[], T],
                   size: Callable[[Any], int]) -> T:
    """`cache[key]`, else `compile_()` (which raises a ValueError naming the grammar's field), once for callers that
    ask for it at once (`compiling`), its result or its failure's message kept (`size` of either); a kept failure is
    raised again as its ValueError."""
    hit = cache.get(key)
    if hit is None:
        _must_compile()
        with compiling.hold(key):
            hit = cache.get(key)
            if hit is None:
                try:
                    hit = True, compile_()
                except ValueError as e:
                    hit = False, str(e)
                cache.put(key, hit, size(hit[1]))
    ok, result = hit
    if not ok:
        raise ValueError(result)
    return cast(T, result)


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
                raise ValueError(f"guided_decoding: token {token} rejected by the grammar ({readable(error)})")
            raise GrammarLimitError(f"guided_decoding: the grammar cannot be parsed past this point "
                                    f"({readable(error)})")

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
            raise GrammarLimitError(f"guided_decoding: {readable(self.matcher.get_error())}")


class _Compiler:
    """Grammars compiled against one tokenizer and model vocabulary, as pristine matchers to copy."""

    def __init__(self, tokenizer: Tokenizer, vocab_size: int) -> None:
        # the model's vocabulary may be padded past the tokenizer's: the extra ids have no text and
        # llguidance never allows them; a tokenizer larger than the model is cut in `apply_guides`
        self.source = TokenizerSource(tokenizer.tok.to_str(), max(vocab_size, tokenizer.vocab_size),
                                      sorted(tokenizer.eos_token_ids) or None)
        self.tokenizer = self.source.llg_tokenizer()
        self.words, self.vocab = self.source.words, vocab_size
        # grammar -> (True, its pristine matcher and first mask) or (False, why it failed: not compiled again); server
        # requests build sequences on several threads, and one compiles a grammar at a time (`_compiled_once`)
        self._matchers = SizedLRU(MATCHER_CACHE, MATCHER_CACHE_CHARS)
        self._compiling = _KeyLocks()

    def matcher(self, grammar: str) -> tuple[Any, np.ndarray]:
        """A fresh matcher of `grammar` (a copy of its pristine one) and the bitmask of its first tokens."""
        matcher, first = _compiled_once(self._matchers, self._compiling, grammar, lambda: self._compile(grammar),
                                        lambda _: len(grammar))
        return matcher.deep_copy(), first

    def _compile(self, grammar: str) -> tuple[Any, np.ndarray]:
        """The pristine matcher of `grammar` and the bitmask of the tokens it allows first (read-only), once the
        vetting child has compiled it in time."""
        _vet(("matcher", grammar), "guided_decoding", self.source)
        return on_compile_stack(lambda: compile_matcher(self.tokenizer, grammar, self.words), "guided_decoding",
                                GRAMMAR_COMPILE_LIMIT_S)


_compilers: weakref.WeakKeyDictionary[Tokenizer, dict[int, _Compiler]] = weakref.WeakKeyDictionary()
_compilers_lock = threading.Lock()


def new_guide(spec: GuidedDecodingParams, tokenizer: Tokenizer, vocab_size: int) -> Guide:
    """A fresh `Guide` for one request (raises ValueError naming the field for a bad grammar)."""
    with _compilers_lock:
        by_vocab = _compilers.setdefault(tokenizer, {})
        compiler = by_vocab.get(vocab_size)
        if compiler is None:  # (reading a tokenizer into llguidance takes up to a second)
            _must_compile()
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
        _executor = llguidance().LLExecutor()
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
