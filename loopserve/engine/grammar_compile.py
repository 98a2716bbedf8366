"""llguidance's compiles (a spec to grammar text; grammar text to a matcher against a tokenizer) and `Vetter`, the child
process that compiles every new grammar first, so that a grammar llguidance never finishes, or crashes on, cannot hurt
the engine (docs/design.md §9).

llguidance computes on the calling thread and cannot be interrupted. It never returns from the first mask of some small
Lark grammars (llguidance 1.9.1: `start: A B` with `A: /a+/` and `B: /a+b/`; none of its parser limits bounds it):
compiled on a thread of the server, such a grammar held a core, and memory growing ~7 MB/s, until the server restarted,
and each distinct one sent took another core. So a new grammar is compiled in the child first; the child is killed once
the grammar has taken longer than its limit (the grammar refused, a fresh child started for the next), and a child that
dies on a grammar refuses it too. Only a grammar the child compiled in time is compiled in this process (a matcher
cannot cross processes; grammar text can, and is taken from the child).

Nothing here imports torch or loopserve: the child runs this file as a script (`python -P <this file> <fd>`), ready in
~0.3 s, once per process and again after a kill.
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
from collections.abc import Callable
from multiprocessing.connection import Connection
from typing import Any, TypeVar

import numpy as np

log = logging.getLogger(__name__)

T = TypeVar("T")
INSTALL_HINT = "structured output needs llguidance: pip install 'loopserve[structured]'"
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
# The longest a new vetting child may take to start, or to read a tokenizer (a 150k vocabulary: about a second); past
# it, or when a child cannot be started at all, grammars are compiled in this process unvetted (logged once)
CHILD_START_LIMIT_S = 60.0
# llguidance's words for a token its grammar does not allow (after a masked sample: an engine bug, a 500);
# any other matcher error is the grammar past the parser's limits (the request's own input, a 400)
REJECTED = "doesn't satisfy the grammar"


def llguidance() -> Any:
    try:
        import llguidance
    except ImportError:
        raise ValueError(f"guided_decoding: {INSTALL_HINT}") from None
    return llguidance


def readable(error: str) -> str:
    """llguidance's error message for a client: without what it appends (the parser's state), and in words
    where it is an internal assertion or a bare error name."""
    error = error.strip().split("\n<", 1)[0]
    if error.startswith("panic"):
        return "the grammar is beyond what llguidance can compile (it failed an internal check)"
    return error if " " in error else f"llguidance cannot compile it ({error})"


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


def grammar_text(kind: str, text: str, whitespace: str | None) -> str:
    """llguidance's grammar for one spec (see engine/grammar.py's `grammar_text`), validated; ValueError naming the
    field."""
    llg = llguidance()
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
        raise ValueError(f"{kind}: {readable(error)}")
    return grammar


class _TextOnly:
    """llguidance's view of a tokenizer (its `TokenizerWrapper` protocol: each token's bytes, the special ones,
    and encoding text) in which text that spells a special token is encoded as text. llguidance encodes the text a
    grammar forces with the tokenizer, and the tokenizers library reads "<|im_end|>" in a text as the special token,
    which llguidance's matcher then refuses as no text (its mask allowed it: a grammar that had to write a special
    token's text failed its request with a 500). The tokens' bytes and special flags are those llguidance reads
    from tokenizer.json itself (`read`); `plain` encodes a special token's text as text (as transformers'
    `split_special_tokens`)."""

    def __init__(self, read: Any, plain: Any) -> None:
        n = read.vocab_size
        self.tokens = [read.decode_bytes([i]) for i in range(n)]
        self.special_token_ids = [i for i in range(n) if read.is_special_token(i)]
        self.eos_token_id, self.bos_token_id = read.eos_token, None  # (llguidance takes eos from its caller)
        self._plain = plain

    def __call__(self, text: str) -> list[int]:
        """Text's tokens, special tokens' text encoded as text (a str only: llguidance passes bytes to an encoder
        that takes them, and encodes an unfinished UTF-8 sequence itself otherwise)."""
        if not isinstance(text, str):
            raise TypeError("text only")
        return self._plain.encode(text, add_special_tokens=False).ids


class TokenizerSource:
    """What llguidance reads of a tokenizer (its tokenizer.json, the vocabulary size to mask, the eos ids), and
    `key`, which names it to the vetting child."""

    def __init__(self, tokenizer_json: str, n_vocab: int, eos: list[int] | None) -> None:
        self.json, self.n_vocab, self.eos = tokenizer_json, n_vocab, eos
        self.words = (n_vocab + 31) // 32  # int32 words of one bitmask
        self.key = f"{hashlib.sha256(tokenizer_json.encode()).hexdigest()}/{n_vocab}/{eos}"

    def llg_tokenizer(self) -> Any:
        """llguidance's tokenizer (`_TextOnly`'s view)."""
        from tokenizers import Tokenizer

        llg = llguidance()
        read = llg.LLTokenizer(self.json, n_vocab=self.n_vocab, eos_token=self.eos)
        plain = Tokenizer.from_str(self.json)
        plain.encode_special_tokens = True
        return llg.LLTokenizer(llg.TokenizerWrapper(_TextOnly(read, plain)), n_vocab=self.n_vocab,
                               eos_token=self.eos)


def compile_matcher(llg_tokenizer: Any, grammar: str, words: int) -> tuple[Any, np.ndarray]:
    """The pristine matcher of `grammar` and the bitmask of the tokens it allows first (read-only); ValueError if the
    matcher is in error, or fails on one of its first PROBED_FIRST_TOKENS allowed tokens."""
    llg = llguidance()
    # errors without the parser's state and the whole grammar: they go back to the client
    quiet = llg.LLParserLimits(verbose_errors=False)
    matcher = llg.LLMatcher(llg_tokenizer, grammar, log_level=0, limits=quiet)
    first = np.zeros(words, dtype=np.int32)
    if not matcher.is_error():
        matcher.unsafe_compute_mask_ptr(first.ctypes.data, first.nbytes)
        allowed = np.flatnonzero(np.unpackbits(first.view(np.uint8), bitorder="little"))
        for token in allowed[:PROBED_FIRST_TOKENS].tolist():
            trial = matcher.deep_copy()
            if not trial.consume_token(token) and REJECTED not in trial.get_error():
                raise ValueError(f"guided_decoding: the grammar cannot be parsed past its first token "
                                 f"({readable(trial.get_error())})")
    if matcher.is_error():
        raise ValueError(f"guided_decoding: {readable(matcher.get_error())}")
    first.flags.writeable = False
    return matcher, first


_stack_lock = threading.Lock()


def _on_big_stack(target: Callable[[], None]) -> threading.Thread:
    """`target` started on a daemon thread with COMPILE_STACK_BYTES of stack."""
    with _stack_lock:  # the size applies to threads started while it is set
        old = threading.stack_size(COMPILE_STACK_BYTES)
        try:
            worker = threading.Thread(target=target, name="loopserve-grammar", daemon=True)
            worker.start()
        finally:
            threading.stack_size(old)
    return worker


def too_slow(what: str, limit: float) -> ValueError:
    return ValueError(f"{what}: the grammar took longer than {limit:.0f} s to compile (llguidance's parser); a "
                      "simpler grammar compiles")


def on_compile_stack(fn: Callable[[], T], what: str, limit: float) -> T:
    """`fn()` on a thread with COMPILE_STACK_BYTES of stack, its exception raised here; a ValueError naming `what` (the
    grammar's field) if it takes longer than `limit` seconds. Only for grammars the child compiled in time (or when
    there is no child): a thread past the limit cannot be stopped and is left to run."""
    box: list[tuple[bool, Any]] = []

    def run() -> None:
        try:
            box.append((True, fn()))
        except BaseException as e:  # noqa: BLE001 (re-raised on the caller's thread)
            box.append((False, e))

    worker = _on_big_stack(run)
    worker.join(limit)
    if worker.is_alive():
        log.warning("a grammar the vetting child compiled in time took longer than %.0f s to compile here; its "
                    "compile thread cannot be stopped and runs on", limit)
        raise too_slow(what, limit)
    ok, value = box[0]
    if not ok:
        raise value
    return value


class Vetter:
    """The child process that compiles every new grammar first (see the module's docstring): started when first
    needed and again after one is killed; `vet` is thread-safe and vets one grammar at a time."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._child: subprocess.Popen[bytes] | None = None
        self._conn: Connection | None = None
        self._read: set[str] = set()  # keys of the tokenizers the running child has read
        self._unavailable: str | None = None  # why no child can be started (grammars are then compiled unvetted)

    def vet(self, job: tuple[Any, ...], what: str, limit: float, source: TokenizerSource | None = None) -> Any:
        """The child's compile of `job` (("text", kind, text, whitespace): its grammar text; ("matcher", grammar): None,
        against `source`'s tokenizer). None, too, where the compile is to be done here: its error was no ValueError
        (raised again here), or there is no child. Raises a ValueError naming `what` (the grammar's field) for a
        grammar that fails to compile, takes longer than `limit` seconds (the child killed) or kills the child."""
        with self._lock:
            if not self._started():
                return None
            if source is not None:
                if source.key not in self._read and not self._read_tokenizer(source):
                    return None
                job = (*job, source.key)
            try:
                reply = self._ask(job, limit)
            except TimeoutError:
                log.warning("a grammar took longer than %.0f s to compile and was refused; its compile was stopped",
                            limit)
                raise too_slow(what, limit) from None
            except EOFError:
                log.warning("llguidance's process died compiling a grammar, which was refused")
                raise ValueError(f"{what}: llguidance crashed compiling the grammar (in a process of its own); a "
                                 "simpler grammar compiles") from None
        status, value = reply
        if status == "error":
            raise ValueError(value)
        return value

    @property
    def pid(self) -> int | None:
        """The running child's process id (None before the first grammar or after a kill)."""
        return None if self._child is None else self._child.pid

    def _started(self) -> bool:
        if self._child is not None and self._child.poll() is None:
            return True
        if self._unavailable is not None:
            return False
        parent_end, child_end = socket.socketpair()
        try:
            self._child = subprocess.Popen(
                [sys.executable, "-P", os.path.abspath(__file__), str(child_end.fileno())],
                pass_fds=(child_end.fileno(),), stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL)
            self._conn, self._read = Connection(parent_end.detach()), set()
            if self._ask(("ready",), CHILD_START_LIMIT_S) == ("ok", None):
                return True
            why = "it did not start"
        except (OSError, TimeoutError, EOFError) as e:
            why = f"it did not start ({e!r})"
        finally:
            parent_end.close()
            child_end.close()
        self._stop()
        self._unavailable = why
        log.warning("grammars are compiled in this process, unvetted: no vetting child (%s); a grammar llguidance "
                    "never finishes compiling leaves a thread running", why)
        return False

    def _read_tokenizer(self, source: TokenizerSource) -> bool:
        try:
            if self._ask(("tokenizer", source.key, source.json, source.n_vocab, source.eos),
                         CHILD_START_LIMIT_S) == ("ok", None):
                self._read.add(source.key)
                return True
        except (TimeoutError, EOFError):
            pass
        log.warning("the vetting child could not read a tokenizer: its grammars are compiled in this process, "
                    "unvetted")
        return False

    def _ask(self, job: tuple[Any, ...], limit: float) -> tuple[str, Any]:
        """The child's reply to `job`; TimeoutError (the child killed) after `limit` seconds, EOFError if it died."""
        conn = self._conn
        assert conn is not None
        try:
            conn.send(job)
            answered = conn.poll(limit)
            reply: tuple[str, Any] = conn.recv() if answered else ("", None)
        except (EOFError, OSError):
            self._stop()
            raise EOFError from None
        if not answered:
            self._stop()
            raise TimeoutError
        return reply

    def _stop(self) -> None:
        if self._conn is not None:
            self._conn.close()
        if self._child is not None:
            self._child.kill()
            self._child.wait()
        self._child, self._conn = None, None


def _serve(fd: int) -> None:
    """The child's loop: each job compiled on a big-stack thread, its outcome sent back; the child exits when the
    parent's end closes, during a job too (the parent sends nothing while it waits, so its end readable is its end)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # (a terminal's Ctrl-C is for the server, which ends the child)
    conn = Connection(fd)
    tokenizers: dict[str, tuple[Any, int]] = {}
    while True:
        try:
            job = conn.recv()
        except (EOFError, OSError):
            return
        box: list[tuple[str, Any]] = []
        worker = _on_big_stack(functools.partial(_run, job, tokenizers, box))
        while worker.is_alive():
            worker.join(0.2)
            if worker.is_alive() and conn.poll(0):
                os._exit(0)
        conn.send(box[0])


def _run(job: tuple[Any, ...], tokenizers: dict[str, tuple[Any, int]], out: list[tuple[str, Any]]) -> None:
    """One job's outcome, appended to `out`: ("ok", its value), ("error", a ValueError's message), or ("raised", None)
    for any other error (the parent compiles it itself, and raises it)."""
    try:
        kind, *args = job
        value = None
        if kind == "tokenizer":
            key, tokenizer_json, n_vocab, eos = args
            source = TokenizerSource(tokenizer_json, n_vocab, eos)
            tokenizers[key] = (source.llg_tokenizer(), source.words)
        elif kind == "text":
            value = grammar_text(*args)
        elif kind == "matcher":
            grammar, key = args
            llg_tokenizer, words = tokenizers[key]
            compile_matcher(llg_tokenizer, grammar, words)
        out.append(("ok", value))
    except ValueError as e:
        out.append(("error", str(e)))
    except BaseException:  # noqa: BLE001 (the parent raises it, compiling it itself)
        out.append(("raised", None))


if __name__ == "__main__":
    _serve(int(sys.argv[1]))
