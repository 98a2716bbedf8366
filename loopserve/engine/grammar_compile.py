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
import socket
import subprocess
import sys
import threading
import time
import weakref
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
# The longest a new vetting child may take to start, or to read a tokenizer (a 150k vocabulary: about a second). A
# child that cannot be started leaves grammars compiled in this process, unvetted, until CHILD_RETRY_S have passed
# (logged): where no child can run (no `sys.executable` Python, no `pass_fds`) that is every grammar.
CHILD_START_LIMIT_S = 60.0
CHILD_RETRY_S = 60.0
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
# keywords whose value maps names of the schema's own choosing to schemas (a property may be named "default")
_NAMED_SCHEMAS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas", "dependencies")
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
            for k, v in node.items():
                if k in _NAMED_SCHEMAS and isinstance(v, dict):
                    stack.extend(v.values())
                elif k not in _DATA_KEYWORDS:
                    stack.append(v)
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

    @functools.cached_property
    def key(self) -> str:
        """(Made when first vetted: the child, which is sent the key, and a process with no child never hash the
        tokenizer's megabytes.)"""
        return f"{hashlib.sha256(self.json.encode()).hexdigest()}/{self.n_vocab}/{self.eos}"

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


def _too_slow(what: str, limit: float) -> ValueError:
    return ValueError(f"{what}: the grammar took longer than {limit:.0f} s to compile (llguidance's parser); a "
                      "simpler grammar compiles")


def _crashed(what: str) -> ValueError:
    log.warning("llguidance's process died compiling a grammar; the grammar was refused")
    return ValueError(f"{what}: llguidance crashed compiling the grammar (in a process of its own); a simpler grammar "
                      "compiles")


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
        log.warning("a grammar took longer than %.0f s to compile in this process; its compile thread cannot be "
                    "stopped and runs on", limit)
        raise _too_slow(what, limit)
    ok, value = box[0]
    if not ok:
        raise value
    return value


class Vetter:
    """The child process that compiles every new grammar first (see the module's docstring): one per Python process,
    shared by its engines and tokenizers, started when first needed and again after one is stopped; `vet` is
    thread-safe and vets one grammar at a time."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._child: subprocess.Popen[bytes] | None = None
        self._conn: Connection | None = None
        self._read: set[str] = set()  # keys of the tokenizers the running child has read
        self._retry_at = 0.0  # (time.monotonic) no child is started before then: the last start failed
        self._vetting = False  # a job is in flight (under the lock)
        self._stopped_by: BaseException | None = None  # `interrupt`'s error for the job in flight
        _vetters.add(self)

    def vet(self, job: tuple[Any, ...], what: str, limit: float, source: TokenizerSource | None = None,
            stop: Callable[[], None] | None = None) -> Any:
        """The child's compile of `job` (("text", kind, text, whitespace): its grammar text; ("matcher", grammar): None,
        against `source`'s tokenizer). None, too, where the compile is to be done here: its error was no ValueError
        (raised again here), or there is no child to ask (none could be started, or it could not read the tokenizer:
        logged). Raises a ValueError naming `what` (the grammar's field) for a grammar that fails to compile, takes
        longer than `limit` seconds (the child stopped) or kills the child twice (a fresh one the second time, in
        case the first died of something else); `interrupt`'s error for one stopped from outside. `stop()`, if given,
        is called before each step (the wait for this vetter's turn, a child's start) and may raise: the caller's own
        end (a server that is shutting down)."""
        with self._lock:
            self._stopped_by = None
            for attempt in (1, 2):
                if stop is not None:
                    stop()
                if not self._ready(source):
                    if attempt == 1:
                        return None
                    raise _crashed(what)  # (it killed a child, and no other could be had to try it again)
                try:
                    if stop is not None:
                        stop()
                    self._vetting = True
                    status, value = self._ask(job if source is None else (*job, source.key), limit)
                    break
                except TimeoutError:
                    log.warning("a grammar took longer than %.0f s to compile and was refused; its compile was "
                                "stopped", limit)
                    raise _too_slow(what, limit) from None
                except EOFError:
                    if self._stopped_by is not None:
                        raise self._stopped_by from None
                    if attempt == 2:
                        raise _crashed(what) from None
                finally:
                    self._vetting = False
        if status == "error":
            raise ValueError(value)
        return value

    def interrupt(self, error: BaseException) -> None:
        """Stop the grammar being vetted, if one is, from any thread: its `vet` raises `error` (not cached as the
        grammar's failure: a server's shutdown, which would otherwise wait up to the limit for it). The next grammar
        starts a fresh child."""
        child = self._child
        if self._vetting and child is not None:
            self._stopped_by = error
            child.kill()

    @property
    def pid(self) -> int | None:
        """The running child's process id (None before the first grammar or after a stop)."""
        return None if self._child is None else self._child.pid

    def _ready(self, source: TokenizerSource | None) -> bool:
        """Whether a child is running that has read `source`'s tokenizer (one is started, and reads it, if need be)."""
        if self._child is None or self._child.poll() is not None:
            self._stop()
            if time.monotonic() < self._retry_at or not self._start():
                return False
        if source is None or source.key in self._read:
            return True
        try:
            reply = self._ask(("tokenizer", source.key, source.json, source.n_vocab, source.eos), CHILD_START_LIMIT_S)
        except (TimeoutError, EOFError) as e:
            reply = ("failed", repr(e))
        if reply == ("ok", None):
            self._read.add(source.key)
            return True
        log.warning("the grammar-vetting child could not read a tokenizer (%s): this grammar is compiled in this "
                    "process, unvetted", reply)
        return False

    def _start(self) -> bool:
        """Start a child (in a process group of its own: a terminal's Ctrl-C is for the server, which ends it) and
        wait for it to be ready; False, logged, if it cannot be (no child is tried again for CHILD_RETRY_S)."""
        parent_end: socket.socket | None = None
        try:
            parent_end, child_end = socket.socketpair()
            with child_end:  # (closed here once the child has its copy: a child that dies is then an EOF at once)
                self._child = subprocess.Popen(
                    [sys.executable, "-P", os.path.abspath(__file__), str(child_end.fileno()), str(os.getpid())],
                    pass_fds=(child_end.fileno(),), stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                    process_group=0)
            self._conn, self._read = Connection(parent_end.detach()), set()
            reply = self._ask(("ready",), CHILD_START_LIMIT_S)
            why = "" if reply == ("ok", None) else f"it answered {reply!r}"
        except (OSError, EOFError, AssertionError) as e:  # (a timeout is an OSError; AssertionError: no pass_fds)
            why = repr(e)
        finally:
            if parent_end is not None:
                parent_end.close()  # (nothing once detached)
        if not why:
            return True
        self._stop()
        self._retry_at = time.monotonic() + CHILD_RETRY_S
        log.warning("no grammar-vetting child could be started (%s): for the next %.0f s grammars are compiled in "
                    "this process, unvetted", why, CHILD_RETRY_S)
        return False

    def _ask(self, job: tuple[Any, ...], limit: float) -> tuple[str, Any]:
        """The child's reply to `job`; TimeoutError after `limit` seconds, EOFError if it died. The child is stopped
        on any failure, an interrupt too: a reply left unread would answer the next job."""
        conn = self._conn
        assert conn is not None
        try:
            conn.send(job)
            if not conn.poll(limit):
                raise TimeoutError
            reply: tuple[str, Any] = conn.recv()
            return reply
        except BaseException as e:
            self._stop()
            if isinstance(e, TimeoutError | EOFError) or not isinstance(e, OSError):
                raise
            raise EOFError from None

    def _stop(self) -> None:
        if self._conn is not None:
            self._conn.close()
        if self._child is not None:
            self._child.kill()
            self._child.wait()
        self._child, self._conn = None, None

    def _forget(self) -> None:
        """In a forked copy of this process: its parent's child is not its own (never stopped from here), the socket's
        copy is closed (the child still sees its parent's end close), and a lock another thread held is replaced."""
        if self._conn is not None:
            self._conn.close()
        self._lock, self._child, self._conn, self._read = threading.Lock(), None, None, set()


_vetters: weakref.WeakSet[Vetter] = weakref.WeakSet()


def _forget_children() -> None:
    for vetter in list(_vetters):
        vetter._forget()


os.register_at_fork(after_in_child=_forget_children)


def _serve(fd: int, parent: int) -> None:
    """The child's loop: each job compiled on a big-stack thread, its outcome sent back. The child exits when the
    parent's end of the socket closes (the parent sends nothing while a job runs, so its end readable is its end), or
    when the parent has gone (a process it forked may hold a copy of that end), during a job too."""
    conn = Connection(fd)
    tokenizers: dict[str, tuple[Any, int]] = {}
    try:
        while True:
            while not conn.poll(0.2):
                if os.getppid() != parent:
                    return
            job = conn.recv()
            box: list[tuple[str, Any]] = []
            worker = _on_big_stack(functools.partial(_run, job, tokenizers, box))
            while worker.is_alive():
                worker.join(0.2)
                if worker.is_alive() and (conn.poll(0) or os.getppid() != parent):
                    os._exit(0)
            conn.send(box[0])
    except (EOFError, OSError):  # (the parent's end closed)
        return


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
    _serve(int(sys.argv[1]), int(sys.argv[2]))
