"""Structured output (engine/grammar.py): every output obeys its grammar even when sampled at temperature 1
from a random tiny model, guided requests equal the reference decoder and leave their batch neighbours
unchanged, masks are row-wise in the batched sampler, and bad grammars are ValueErrors naming the field."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest
import torch

from loopserve import LLM, GuidedDecodingParams, SamplingParams
from loopserve.engine import grammar
from loopserve.engine.grammar import apply_guides, new_guide, with_guide
from loopserve.engine.grammar_compile import readable
from loopserve.engine.sampler import sample_batch, sample_one, unpack
from loopserve.sampling_params import MAX_CHOICES, MAX_GRAMMAR_CHARS, MAX_SCHEMA_CHARS
from tests.engine_helpers import Req, assert_matches, drive, loaded, make_engine, reference

pytest.importorskip("llguidance")

SCHEMA = {"type": "object", "additionalProperties": False, "required": ["name", "age", "pet"],
          "properties": {"name": {"type": "string", "maxLength": 6},
                         "age": {"type": "integer", "minimum": 0, "maximum": 120},
                         "pet": {"enum": ["cat", "dog"]}}}
REGEX = r"[a-c]{2,4}-[0-9]{3}"
CHOICES = ["red", "green", "blue"]
GRAMMAR = 'start: "(" num (" + " num)* ")"\nnum: /[1-9]/'  # Lark: a parenthesized sum of digits
GUIDES = {
    "json": GuidedDecodingParams(json=SCHEMA, disable_any_whitespace=True),
    "json_ws": GuidedDecodingParams(json=SCHEMA, whitespace_pattern=r"[ \n]{0,2}"),  # some whitespace
    "json_object": GuidedDecodingParams(json_object=True, whitespace_pattern=r"[ ]?"),
    "regex": GuidedDecodingParams(regex=REGEX),
    "choice": GuidedDecodingParams(choice=CHOICES),
    "grammar": GuidedDecodingParams(grammar=GRAMMAR),
}


def obeys(kind: str, text: str) -> bool:
    if kind in ("json", "json_ws"):
        try:
            v = json.loads(text)
        except ValueError:
            return False
        return (isinstance(v, dict) and list(v) == ["name", "age", "pet"] and isinstance(v["name"], str)
                and len(v["name"]) <= 6 and type(v["age"]) is int and 0 <= v["age"] <= 120
                and v["pet"] in ("cat", "dog"))
    if kind == "json_object":
        try:
            return isinstance(json.loads(text), dict)
        except ValueError:
            return False
    if kind == "regex":
        return re.fullmatch(REGEX, text) is not None
    if kind == "choice":
        return text in CHOICES
    return re.fullmatch(r"\([1-9]( \+ [1-9])*\)", text) is not None


@pytest.fixture(scope="module")
def llm(tiny_ouro):
    return LLM(tiny_ouro, dtype="float64", seed=3, max_decode_batch=8, kv_cache_tokens=2048)


@pytest.mark.parametrize("kind", list(GUIDES))
def test_every_output_obeys_its_grammar(kind, llm):
    """Temperature 1 on a random model: the mask alone makes outputs valid (without it they are not), and a
    complete grammar finishes the request with "stop" instead of running to max_tokens."""
    prompts = [[5 + i, 40 + 3 * i, 7] for i in range(8)]
    guided = SamplingParams(temperature=1.0, max_tokens=120, guided_decoding=GUIDES[kind])
    outs = [o.outputs[0] for o in llm.generate(prompts, guided, use_tqdm=False)]
    for c in outs:
        if kind == "json_object" and c.finish_reason == "length":  # any object: a random model may not close it
            assert c.text.startswith("{") and len(c.token_ids) == 120
            continue
        assert c.finish_reason == "stop" and obeys(kind, c.text), (c.text, c.finish_reason)
    assert any(c.finish_reason == "stop" for c in outs)
    assert len({c.text for c in outs}) > 1 or kind == "choice"  # really sampled
    free = llm.generate(prompts, SamplingParams(temperature=1.0, max_tokens=20), use_tqdm=False)
    assert not any(obeys(kind, o.outputs[0].text) for o in free)


def test_grammar_cut_by_max_tokens_is_length(llm):
    out = llm.generate([[9, 9]], SamplingParams(temperature=1.0, max_tokens=3, guided_decoding=GUIDES["json"]),
                       use_tqdm=False)[0].outputs[0]
    assert out.finish_reason == "length" and len(out.token_ids) == 3 and '{"name":'.startswith(out.text)


@pytest.mark.parametrize("scheduler", ["cb", "cdb"])
def test_guided_requests_equal_the_reference(scheduler, tiny_ouro):
    """Guided and unguided requests batched together (with preemption) equal the reference decoder, which
    samples each alone: masks are row-wise and neighbours are untouched (batch invariance)."""
    engine = make_engine(tiny_ouro, scheduler=scheduler, block_size=4, kv_cache_tokens=64, max_decode_batch=4,
                         max_num_seqs=6, prefill_chunk_size=8)
    kinds = ["json", None, "regex", "choice", None, "json_ws", "grammar"]
    reqs = []
    for i, kind in enumerate(kinds):
        params = SamplingParams(temperature=1.0 if i % 3 else 0.0, max_tokens=40, exit_threshold=0.6,
                                logprobs=2 if i % 2 else None,
                                guided_decoding=GUIDES[kind] if kind else None)
        reqs.append(Req(f"g{i}", [(29 * i + 7 * j) % 400 + 3 for j in range(3 + 2 * i)], params, seed=50 + i,
                        arrive=i))
    outs = drive(engine, reqs)
    for r, kind in zip(reqs, kinds, strict=True):
        ref = reference(engine, r)
        assert_matches(outs[r.rid], ref)
        if kind:  # (the output's tokens: its text may begin with characters the prompt's last bytes left incomplete)
            text = engine.tokenizer.decode(ref.output_ids, skip_special_tokens=True)
            assert obeys(kind, text) or ref.finish_reason == "length", (kind, text)


def test_masks_are_row_wise_in_the_batched_sampler(tiny_ouro):
    """One batch of guided and free rows samples each row as a batch of one would, in any order; the
    guided rows' draws are allowed tokens and their logprobs are those of the raw logits under the grammar's mask."""
    m = loaded(tiny_ouro)
    tok, vocab = m.tokenizer, m.model.config.vocab_size
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(6, vocab, generator=gen, dtype=torch.float64) * 3
    base = [SamplingParams(temperature=1.0, logprobs=1), SamplingParams(temperature=0.0),
            SamplingParams(temperature=0.7, top_k=20), SamplingParams(temperature=1.0),
            SamplingParams(temperature=0.0, logprobs=0), SamplingParams(temperature=1.0, top_p=0.9)]
    params = [with_guide(p, new_guide(GUIDES["regex"] if i == 2 else GUIDES["choice"], tok, vocab))
              if i in (0, 2, 4) else p for i, p in enumerate(base)]
    seeds, counters = [11, 12, 13, 14, 15, 16], [0, 3, 1, 4, 0, 2]
    whole = unpack(sample_batch(logits, params, seeds, counters), params)
    for i in range(6):
        assert sample_one(logits[i], params[i], seeds[i], counters[i]) == whole[i]
    perm = [5, 2, 0, 4, 1, 3]
    shuffled = unpack(sample_batch(logits[perm], [params[i] for i in perm], [seeds[i] for i in perm],
                                   [counters[i] for i in perm]), [params[i] for i in perm])
    assert [shuffled[perm.index(i)] for i in range(6)] == whole
    texts = [tok.decode([s.token]) for s in whole]
    assert all(any(c.startswith(texts[i]) for c in CHOICES) for i in (0, 4)) and re.fullmatch("[a-c]{1,4}", texts[2])
    # a guided row's logprobs are of the tokens its grammar allows (vLLM masks the logits its sampler gets): its
    # greedy token ranks first (they were the unmasked model's, where forbidden tokens outranked it)
    allowed = apply_guides(logits[:1].clone(), params[:1])[0]
    raw = torch.log_softmax(allowed, -1)[whole[0].token].item()
    assert whole[0].logprob == pytest.approx(raw, rel=1e-12)
    assert raw > torch.log_softmax(logits[0], -1)[whole[0].token].item()
    assert whole[4].rank == 1 and whole[4].logprob == pytest.approx(torch.log_softmax(
        apply_guides(logits[4:5].clone(), params[4:5])[0], -1).max().item(), rel=1e-12)
    for i in (1, 3, 5):  # free rows: what they sample with no guided row in the batch
        assert whole[i] == unpack(sample_batch(logits[i:i + 1], [base[i]], [seeds[i]], [counters[i]]), [base[i]])[0]


def test_padded_model_vocabulary_is_masked(tiny_ouro):
    """A model vocabulary padded past the tokenizer's: the ids without text are never allowed."""
    m = loaded(tiny_ouro)
    n = m.tokenizer.vocab_size
    params = [with_guide(SamplingParams(), new_guide(GUIDES["json_object"], m.tokenizer, n + 64))]
    logits = torch.zeros(1, n + 64, dtype=torch.float64)
    logits[0, n:] = 100.0
    masked = apply_guides(logits, params)
    assert torch.isinf(masked[0, n:]).all() and torch.isfinite(masked[0, :n]).any()
    assert apply_guides(logits, [SamplingParams()]) is logits  # no guided row: untouched, no copy


@pytest.mark.parametrize("kwargs, field", [
    (dict(json={"type": "nope"}), "json"),
    (dict(json="{not json"), "json"),
    (dict(json=5), "json"),
    (dict(regex="a(b"), "regex"),
    (dict(regex=""), "regex"),
    (dict(choice=[]), "choice"),
    (dict(choice=["a", 3]), "choice"),
    (dict(grammar="start: undefined_rule"), "grammar"),
    (dict(json_object="yes"), "json_object"),
    (dict(json_object=True, disable_any_whitespace="x"), "disable_any_whitespace"),
    (dict(regex="ab\\"), "regex"),  # a lone trailing backslash (llguidance would match the empty string)
    (dict(regex="a" * (MAX_GRAMMAR_CHARS + 1)), "regex"),
    (dict(grammar="start: " + " | ".join(f'"w{i}"' for i in range(MAX_GRAMMAR_CHARS // 6)) + ""), "grammar"),
    (dict(choice=[f"c{i}" for i in range(MAX_CHOICES + 1)]), "choice"),
    (dict(json={"enum": ["x" * 100] * (MAX_SCHEMA_CHARS // 100)}), "json"),
    # integer bounds llguidance reads as 64-bit floats and clamps: 10**30 let only 2^63 - 1 through, finishing "stop"
    (dict(json={"type": "integer", "minimum": 10**30, "maximum": 10**30 + 5}), "json"),
    (dict(json={"properties": {"id": {"type": ["integer", "null"], "exclusiveMaximum": 2**63 + 10}}}), "json"),
    (dict(json={"items": [{"type": "integer", "minimum": -(2**53) - 1}]}), "json"),  # (read as -2^53)
    (dict(json={"allOf": [{"type": "integer"}, {"minimum": 10**30}]}), "json"),  # (the bound not on the typed node)
    # a property, or a definition, named like a keyword whose value is no schema
    (dict(json={"properties": {"default": {"type": "integer", "maximum": 10**30}}}), "json"),
    (dict(json={"$defs": {"enum": {"type": "integer", "minimum": 2**53 + 1}}}), "json"),
    (dict(), "structured_outputs"),
    (dict(regex="a", choice=["a"]), "structured_outputs"),
])
def test_bad_specs_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=rf"^{field}: "):
        GuidedDecodingParams(**kwargs)


def test_integer_bounds_within_2_to_the_53_are_kept_to(llm):
    """Integer bounds near 2^53 taken (exact as 64-bit floats), and the output within them."""
    schema = {"type": "integer", "minimum": 2**53 - 3, "maximum": 2**53}
    params = SamplingParams(max_tokens=20, temperature=1.0, seed=3, guided_decoding=GuidedDecodingParams(json=schema))
    out = llm.generate([[5, 6]], params, use_tqdm=False)[0].outputs[0]
    assert out.finish_reason == "stop" and 2**53 - 3 <= json.loads(out.text) <= 2**53, out.text
    # bounds a 64-bit float holds exactly, int64's maximum (clamped back to itself), and instances that are no schema
    for kept in ({"type": "integer", "minimum": 10**16, "maximum": 10**16 + 4},
                 {"type": "integer", "minimum": 0, "maximum": 2**63 - 1},
                 {"type": "object", "properties": {"x": {"type": "string", "default": {"minimum": 10**30}}}}):
        GuidedDecodingParams(json=kept)


def test_bad_spec_messages_stay_short():
    """A huge bad value is not echoed whole into the error (an HTTP body would carry it back)."""
    with pytest.raises(ValueError) as e:
        GuidedDecodingParams(choice=["x" * 1000] * 10_000 + [""])
    assert len(str(e.value)) < 1000


# Grammars llguidance compiles but cannot parse past their first token: its parser holds at most 2000
# Earley items in a row. They are refused when their request is built, naming the field, instead of
# failing at the first token with a 500 (or a cut stream).
PARSER_LIMIT = {
    "choice": GuidedDecodingParams(choice=[f"option{i}" for i in range(MAX_CHOICES)]),
    "json": GuidedDecodingParams(json={"type": "object", "properties": {f"p{i}": {"type": "integer"}
                                                                        for i in range(500)},
                                       "additionalProperties": True}),
    "grammar": GuidedDecodingParams(grammar="start: " + " | ".join(f'"w{i}"' for i in range(2500))),
}


@pytest.mark.parametrize("kind", list(PARSER_LIMIT))
def test_grammar_past_the_parser_limit_is_refused_up_front(kind, llm):
    params = SamplingParams(max_tokens=4, guided_decoding=PARSER_LIMIT[kind])
    with pytest.raises(ValueError, match=r"^guided_decoding: the grammar cannot be parsed past its first token"):
        llm.engine.make_sequence("limit", [5, 6], params)


def test_grammar_past_the_parser_limit_later_fails_its_request_alone_with_400(tiny_ouro):
    """A grammar that passes its first token but reaches the limit later (here past its first five letters): its request
    fails alone, as the request's own fault (status 400, a warning without traceback), and its neighbours
    equal the reference decoder."""
    later = "start: /[a-z]{5}/ word\nword: " + " | ".join(f'"w{i}"' for i in range(2500))
    engine = make_engine(tiny_ouro, scheduler="cdb", max_decode_batch=4)
    late = SamplingParams(temperature=0.0, max_tokens=30, guided_decoding=GuidedDecodingParams(grammar=later))
    free = SamplingParams(temperature=1.0, max_tokens=12, exit_threshold=0.6)
    reqs = [Req("late", [4, 5, 6], late, seed=1), Req("n0", [7, 8], free, seed=2), Req("n1", [9, 3, 2], free, seed=3)]
    outs = drive(engine, reqs)
    bad = outs["late"]
    assert bad.outputs[0].finish_reason == "error" and bad.error_status == 400, bad.error
    assert bad.error.startswith("guided_decoding: the grammar cannot be parsed past this point"), bad.error
    assert 0 < len(bad.outputs[0].token_ids) < 30 and re.fullmatch("[a-z]{1,5}", bad.outputs[0].text)
    assert len(bad.error) < 500  # llguidance's parser state and grammar are not in it
    for r in reqs[1:]:
        assert_matches(outs[r.rid], reference(engine, r))
    assert not engine.requests and engine.kv.allocator.num_free == engine.kv.num_blocks



STUCK = "start: A B\nA: /a+/\nB: /a+b/"  # (llguidance 1.9.1 never returns from its first mask)


def _gone(pid: int) -> bool:
    """The process has exited (a zombie counts: nothing reaps an orphan in some containers)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0] in "ZX"


def _children(pid: int) -> list[int]:
    """The processes whose parent is `pid`."""
    found = []
    for entry in os.listdir("/proc"):
        try:
            with open(f"/proc/{entry}/stat") as f:
                if entry.isdigit() and int(f.read().rsplit(")", 1)[1].split()[1]) == pid:
                    found.append(int(entry))
        except OSError:
            continue
    return found


def _vets(monkeypatch) -> list[str]:
    """The kinds of the jobs the vetting child is sent from now on."""
    vets: list[str] = []
    vet = grammar._vetter.vet
    monkeypatch.setattr(grammar._vetter, "vet", lambda job, *a: (vets.append(job[0]), vet(job, *a))[1])
    return vets


def test_a_grammar_that_never_compiles_is_refused_and_its_compile_stopped(llm, monkeypatch):
    """llguidance 1.9.1 never returns from the first mask of `start: A B`, `A: /a+/`, `B: /a+b/` (none of its parser
    limits bounds it): compiled on a thread of the server, it held a core and memory growing ~7 MB/s until the server
    restarted. Its request is refused once GRAMMAR_COMPILE_LIMIT_S has passed (lowered here), named by its field; the
    vetting child that compiled it is killed, so nothing is left computing; it is compiled once for requests that send
    it at once and refused at once when sent again; other grammars compile as ever, in a fresh child."""
    import threading
    import time

    monkeypatch.setattr(grammar, "GRAMMAR_COMPILE_LIMIT_S", 1.0)
    params = SamplingParams(max_tokens=4, guided_decoding=GuidedDecodingParams(grammar=STUCK))
    child = grammar._vetter.pid  # (started for the grammar's text)
    assert child is not None and not _gone(child)
    vets = _vets(monkeypatch)
    refused: list[str] = []

    def request() -> None:
        try:
            llm.engine.make_sequence("stuck", [5, 6], params)
        except ValueError as e:
            refused.append(str(e))

    start = time.monotonic()
    together = [threading.Thread(target=request) for _ in range(4)]  # (at once: they wait for one compile)
    for t in together:
        t.start()
    for t in together:
        t.join(30)
    request()  # (again, after: the failure kept)
    assert time.monotonic() - start < 10 and vets == ["matcher"], vets
    assert len(refused) == 5 and all(
        r.startswith("guided_decoding: the grammar took longer than 1 s to compile") for r in refused), refused
    assert _gone(child) and grammar._vetter.pid is None
    assert not [t for t in threading.enumerate() if t.name == "loopserve-grammar"]
    cpu = time.process_time()
    time.sleep(0.5)
    assert time.process_time() - cpu < 0.25  # (the stuck compile's thread took a core here)
    ok = SamplingParams(max_tokens=4, guided_decoding=GuidedDecodingParams(grammar='start: "y" | "x"'))
    assert llm.engine.make_sequence("ok", [5, 6], ok).params.guide is not None
    assert grammar._vetter.pid not in (None, child)


def test_a_grammar_whose_compile_kills_its_process_is_refused(llm, monkeypatch):
    """A grammar that crashes llguidance (a stack overflow took the server down once) kills only the vetting child:
    its request is refused, named by its field (after a second try in a fresh child, which it kills too), and the
    next grammar compiles in a fresh child. (The crash is a kill from outside here, twice, during a compile that would
    never end.)"""
    import signal
    import threading
    import time

    params = SamplingParams(max_tokens=4, guided_decoding=GuidedDecodingParams(grammar=STUCK.replace("A", "C")))
    warm = SamplingParams(max_tokens=4, guided_decoding=GuidedDecodingParams(grammar='start: "w" | "x"'))
    llm.engine.make_sequence("warm", [5, 6], warm)  # (so that the child is compiling, not reading a tokenizer)
    refused: list[str] = []
    asked: list[str] = []  # the kinds of the jobs sent to a child (the compile, not a start or a tokenizer read)
    ask = grammar._vetter._ask
    monkeypatch.setattr(grammar._vetter, "_ask", lambda job, limit: (asked.append(job[0]), ask(job, limit))[1])

    def request() -> None:
        try:
            llm.engine.make_sequence("crash", [5, 6], params)
        except ValueError as e:
            refused.append(str(e))

    worker = threading.Thread(target=request)
    worker.start()
    deadline = time.monotonic() + 20
    killed: list[int] = []
    while len(killed) < 2 and time.monotonic() < deadline:
        time.sleep(0.05)
        child = grammar._vetter.pid
        if asked.count("matcher") > len(killed) and child is not None and child not in killed:
            time.sleep(0.2)  # (compiling)
            os.kill(child, signal.SIGKILL)
            killed.append(child)
    worker.join(10)
    assert len(killed) == 2
    assert refused and refused[0].startswith("guided_decoding: llguidance crashed compiling the grammar"), refused
    ok = SamplingParams(max_tokens=4, guided_decoding=GuidedDecodingParams(grammar='start: "z" | "x"'))
    assert llm.engine.make_sequence("ok", [5, 6], ok).params.guide is not None


ORPHAN = """
import os, subprocess, sys, threading, time
from loopserve.engine import grammar
from loopserve.sampling_params import GuidedDecodingParams
from loopserve.tokenizer import Tokenizer
from loopserve.llm import default_model_path
tokenizer = Tokenizer(default_model_path())
grammar.new_guide(GuidedDecodingParams(regex="[0-9]+"), tokenizer, 4096)
child = grammar._vetter.pid
forked = os.fork()
if forked == 0:  # (a forked process has a vetting child of its own)
    mine = grammar._vetter.pid is None
    grammar.new_guide(GuidedDecodingParams(regex="[a-f]+"), tokenizer, 4096)
    os._exit(0 if mine and grammar._vetter.pid not in (None, child) else 3)
assert os.waitstatus_to_exitcode(os.waitpid(forked, 0)[1]) == 0
# a process of the parent's holds a copy of its end of the socket
end = os.dup(grammar._vetter._conn.fileno())
holder = subprocess.Popen(["sleep", "60"], pass_fds=[end], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
spec = GuidedDecodingParams(grammar=sys.argv[1])
threading.Thread(target=grammar.new_guide, args=(spec, tokenizer, 4096), daemon=True).start()
time.sleep(1.0)
print(child, holder.pid, flush=True)
os._exit(0)
"""


def test_a_stop_ends_the_compile_in_flight_and_those_waiting_for_it(tiny_ouro):
    """A server's shutdown ends the grammar being compiled (`stop_vetting`) and, through the stop check its builds
    carry (`building(stop=...)`), those that wait for their turn: they had each run their full compile limit, the
    process waiting for them."""
    import threading
    import time

    class Stopped(RuntimeError):
        pass

    stopping: list[Stopped] = []

    def check() -> None:
        if stopping:
            raise stopping[0]

    tokenizer = loaded(tiny_ouro).tokenizer
    new_guide(GuidedDecodingParams(regex="[0-9]+"), tokenizer, 512)  # (the child started)
    ended: dict[str, BaseException] = {}

    def build(name: str) -> None:
        try:
            with grammar.building(stop=check):
                new_guide(GuidedDecodingParams(grammar=STUCK.replace("A", name)), tokenizer, 512)
        except BaseException as e:  # noqa: BLE001 (kept for the assertions)
            ended[name] = e

    threads = [threading.Thread(target=build, args=(name,)) for name in ("F", "G")]
    for t in threads:
        t.start()
        time.sleep(0.3)  # (F compiling, G waiting for its turn)
    start = time.monotonic()
    stopping.append(Stopped("the server is shutting down"))
    grammar.stop_vetting(stopping[0])
    for t in threads:
        t.join(15)
    assert time.monotonic() - start < 5 and set(ended) == {"F", "G"}, ended
    assert all(isinstance(e, Stopped) for e in ended.values()), ended
    assert GuidedDecodingParams(regex="[a-c]+") and new_guide(GuidedDecodingParams(regex="[a-c]+"), tokenizer, 512)


def test_the_vetting_child_ends_with_its_parent():
    """A server that exits while a grammar compiles (its vetting child deep in a compile that would never end) leaves
    no process behind: the child watches its parent's end of their socket and its parent's pid (here another process
    holds a copy of that end). A process the server forks starts a child of its own."""
    import signal
    import time

    done = subprocess.run([sys.executable, "-c", ORPHAN, STUCK.replace("A", "D")], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    child, holder = map(int, done.stdout.split())
    try:
        deadline = time.monotonic() + 10
        while not _gone(child) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert _gone(child) and not _gone(holder)
    finally:
        os.kill(holder, signal.SIGKILL)


def test_an_interrupted_vet_leaves_no_reply_behind(tiny_ouro):
    """A vet interrupted while it waits (Ctrl-C in a notebook, an exception from a signal handler) stops its child: a
    reply left unread would have answered the next grammar, which then got another grammar's text for good."""
    import signal
    import threading

    class Interrupted(Exception):
        pass

    def interrupt(*_: object) -> None:
        raise Interrupted

    tokenizer = loaded(tiny_ouro).tokenizer
    new_guide(GuidedDecodingParams(regex="[0-9]+"), tokenizer, 512)  # (the child started: the signal lands in the wait)
    old = signal.signal(signal.SIGUSR1, interrupt)
    timer = threading.Timer(0.5, os.kill, (os.getpid(), signal.SIGUSR1))
    try:
        timer.start()
        with pytest.raises(Interrupted):
            new_guide(GuidedDecodingParams(grammar=STUCK.replace("A", "E")), tokenizer, 512)
    finally:
        timer.cancel()
        signal.signal(signal.SIGUSR1, old)
    assert grammar._vetter.pid is None
    for text in ("bbbb", "cccc"):
        assert f"/{text}/" in grammar.grammar_text("regex", text)
    assert '"integer"' in grammar.grammar_text("json", '{"type": "integer"}')


def test_an_ambiguous_grammar_whose_masks_grow_slow_fails_its_request_alone(tiny_ouro, monkeypatch):
    """An ambiguous grammar's masks grow with its output, within llguidance's item limits (on the embedded model:
    100 ms by some 200 tokens, 480 ms by 390, where its item limit fails it), and every other request waits for each:
    once one takes longer than GRAMMAR_MASK_LIMIT_S (lowered here, so the test is short on any machine), the request
    fails alone, as its own fault, and its neighbours equal the reference decoder."""
    monkeypatch.setattr(grammar, "GRAMMAR_MASK_LIMIT_S", 0.002)
    engine = make_engine(tiny_ouro, scheduler="cdb", max_decode_batch=4)
    ambiguous = SamplingParams(temperature=1.0, max_tokens=300, logit_bias={0: -100, 2: -100},  # (no eos)
                               guided_decoding=GuidedDecodingParams(grammar='start: x\nx: x x x | x x | "a" | "b"'))
    free = SamplingParams(temperature=1.0, max_tokens=12, exit_threshold=0.6)
    reqs = [Req("slow", [4, 5, 6], ambiguous, seed=1), Req("n0", [7, 8], free, seed=2), Req("n1", [9, 3], free, seed=3)]
    outs = drive(engine, reqs)
    bad = outs["slow"]
    assert bad.outputs[0].finish_reason == "error" and bad.error_status == 400, bad.outputs[0]
    took = r"guided_decoding: the grammar took \d+ ms to give one token's mask \(at most 2\).*"
    assert re.fullmatch(took, bad.error), bad.error
    assert 0 < len(bad.outputs[0].token_ids) < 300 and set(bad.outputs[0].text) <= {"a", "b"}
    for r in reqs[1:]:
        assert_matches(outs[r.rid], reference(engine, r))
    assert not engine.requests and engine.kv.allocator.num_free == engine.kv.num_blocks


def test_one_of_is_read_as_any_of_as_vllms_default_backend_reads_it(llm):
    """llguidance refuses oneOf (it cannot hold that exactly one branch matches); vLLM's default backend, xgrammar,
    reads it as anyOf, and so does loopserve: the output is an instance of one of the branches."""
    schema = {"oneOf": [{"type": "object", "properties": {"a": {"type": "integer", "maximum": 99}}},  # ({} is both)
                        {"type": "object", "properties": {"b": {"type": "string", "maxLength": 4}}}]}
    params = SamplingParams(temperature=1.0, seed=5, max_tokens=40, n=4,
                            guided_decoding=GuidedDecodingParams(json=schema, disable_any_whitespace=True))
    done = [c for c in llm.generate(["x"], params, use_tqdm=False)[0].outputs if c.finish_reason == "stop"]
    assert done  # (it compiled: llguidance alone refused the schema)
    for c in done:
        got = set(json.loads(c.text))
        assert got <= {"a"} or got <= {"b"}, c.text

DEEP_CHAIN = """
from loopserve.engine.grammar import new_guide
from loopserve.llm import default_model_path
from loopserve.sampling_params import GuidedDecodingParams
from loopserve.tokenizer import Tokenizer
chain = "start: a0\\n" + "\\n".join(f'a{i}: "x" a{i + 1} | "y"' for i in range(3000)) + '\\na3000: "z"'
new_guide(GuidedDecodingParams(grammar=chain), Tokenizer(default_model_path()), 4096)
print("compiled")
"""


def test_a_deep_grammar_compiles_without_taking_the_process_down():
    """llguidance analyses grammars recursively: a chain of 3,000 rules (72 kB, within the size cap)
    overflowed the 8 MB stack of the thread that compiled it, a segfault that killed the server. Grammars
    are compiled on a thread with a big stack (run in a subprocess here, so a crash fails only the test)."""
    done = subprocess.run([sys.executable, "-c", DEEP_CHAIN], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and done.stdout.strip() == "compiled", (done.returncode, done.stderr[-2000:])


def test_llguidance_errors_read_as_sentences(tiny_ouro):
    """A client gets llguidance's message without its internals: no Rust assertion or backtrace, no parser
    state, and a bare error name is put in words."""
    with pytest.raises(ValueError, match=r"^guided_decoding: llguidance cannot compile it \(NoExtensionBias\)$"):
        new_guide(GuidedDecodingParams(json={"$ref": "#"}), loaded(tiny_ouro).tokenizer, 512)
    panic = "panic: assertion failed: grammar.symbols.len() < u16::MAX as usize - 10\n<backtrace>\n   0: <unknown>"
    assert readable(panic) == "the grammar is beyond what llguidance can compile (it failed an internal check)"
    assert readable("Parser Error: row too big\n<state>\nTokens: x</state>") == "Parser Error: row too big"


def test_a_grammar_is_compiled_once_even_when_it_fails(tiny_ouro, monkeypatch):
    """Compiling can take seconds before it fails: a failure is cached like a success, so the same bad
    grammar sent again (ten at once, in a trial: ten compiles in a row, 16 s) costs nothing more."""
    texts, matchers = [], []
    real_text, real_compile = grammar._compile_text, grammar._Compiler._compile
    monkeypatch.setattr(grammar, "_compile_text", lambda *a: (texts.append(a), real_text(*a))[1])
    monkeypatch.setattr(grammar._Compiler, "_compile", lambda self, g: (matchers.append(g), real_compile(self, g))[1])
    for _ in range(3):
        with pytest.raises(ValueError, match="^regex: "):
            GuidedDecodingParams(regex="once(")
    tok = loaded(tiny_ouro).tokenizer
    past_limit = GuidedDecodingParams(choice=[f"compiled-once-{i}" for i in range(MAX_CHOICES)])
    for _ in range(3):
        with pytest.raises(ValueError, match="cannot be parsed past its first token"):
            new_guide(past_limit, tok, 512)
    assert [t[1] for t in texts].count("once(") == 1 and len(matchers) == 1


@pytest.mark.parametrize("schema", [5, "5", [1], "null", "{not json"])
def test_a_schema_of_the_wrong_form_says_what_json_takes(schema):
    """One message, whatever the wrong value (it used to be llguidance's "schema must be an object or boolean"
    for "5", and its parser's position in its own wrapper for text that is not JSON)."""
    with pytest.raises(ValueError, match=r"^json: must be a JSON schema: an object, a boolean, or the JSON text"):
        GuidedDecodingParams(json=schema)


def test_boolean_schemas(llm):
    """true (any JSON value) is a schema llguidance compiles, given as a boolean or as text; false admits
    nothing and is refused."""
    for schema in (True, "true"):
        params = SamplingParams(temperature=1.0, max_tokens=30, guided_decoding=GuidedDecodingParams(json=schema))
        out = llm.generate([[3, 4]], params, use_tqdm=False)[0].outputs[0]
        assert out.finish_reason in ("stop", "length") and out.token_ids
        if out.finish_reason == "stop":
            json.loads(out.text)  # a complete JSON value
    with pytest.raises(ValueError, match=r"^json: .*false"):
        GuidedDecodingParams(json=False)


def test_a_complete_grammar_ends_the_output_whatever_min_tokens_says(llm):
    """min_tokens holds back eos, stop ids and stop strings; a grammar still ends the output when it is
    complete (vLLM takes the pair too: clients send min_tokens with JSON mode and tools)."""
    choice = GuidedDecodingParams(choice=["yes", "no"])
    out = llm.generate([[3, 4]], SamplingParams(min_tokens=5, max_tokens=10, guided_decoding=choice),
                       use_tqdm=False)[0].outputs[0]
    assert out.text in ("yes", "no") and out.finish_reason == "stop" and len(out.token_ids) < 5


def test_a_complete_grammar_is_followed_by_the_eos_it_allows_as_in_vllm(llm):
    """A grammar that admits nothing more allows only the eos, which the next step samples and which ends the output,
    in its token ids and counted, as vLLM's grammar bitmask makes it: the output ended without it (one token fewer
    in the ids and usage than vLLM's). Where an eos could not end it (ignore_eos, min_tokens not out) it still ends
    there, without one."""
    eos = llm.get_tokenizer().eos_token_id
    for spec in (GuidedDecodingParams(choice=["yes", "no"]), GuidedDecodingParams(regex="ab")):
        plain = SamplingParams(max_tokens=10, temperature=0, guided_decoding=spec, logprobs=1)
        out = llm.generate([[3, 4]], plain, use_tqdm=False)[0].outputs[0]
        assert out.token_ids[-1] == eos and out.finish_reason == "stop" and out.stop_reason is None, out
        assert out.text in ("yes", "no", "ab") and len(out.logprobs) == len(out.token_ids)
        body = out.token_ids[:-1]
        for kw in ({"ignore_eos": True}, {"min_tokens": len(body) + 1}):
            held = llm.generate([[3, 4]], SamplingParams(max_tokens=10, temperature=0, guided_decoding=spec, **kw),
                                use_tqdm=False)[0].outputs[0]
            assert held.token_ids == body and held.text == out.text and held.finish_reason == "stop", (kw, held)
        at_min = llm.generate([[3, 4]], SamplingParams(max_tokens=10, temperature=0, guided_decoding=spec,
                                                       min_tokens=len(body)), use_tqdm=False)[0].outputs[0]
        assert at_min.token_ids == out.token_ids
        cut = llm.generate([[3, 4]], SamplingParams(max_tokens=len(body), temperature=0, guided_decoding=spec),
                           use_tqdm=False)[0].outputs[0]
        assert cut.token_ids == body and cut.finish_reason == "length"


def test_a_complete_grammar_ends_the_output_of_a_tokenizer_without_eos(tiny_ouro):
    """No eos to sample (a tokenizer without one): the output ends with the grammar. Sampling on, it ran to max_tokens
    on the token llguidance took for an eos, which ends nothing here."""
    llm = LLM(tiny_ouro, dtype="float64", kv_cache_tokens=512)
    llm.tokenizer.eos_token_ids, llm.tokenizer.eos_token_id = set(), None
    out = llm.generate([[3, 4]], SamplingParams(max_tokens=8, temperature=0,
                                                guided_decoding=GuidedDecodingParams(choice=["yes", "no"])),
                       use_tqdm=False)[0].outputs[0]
    assert out.text in ("yes", "no") and out.finish_reason == "stop" and len(out.token_ids) < 8, out


def test_sampling_params_takes_guided_decoding_params_or_a_dict_of_them():
    assert SamplingParams(guided_decoding={"json": SCHEMA}).grammar_spec == GuidedDecodingParams(json=SCHEMA)
    with pytest.raises(ValueError, match=r"^guided_decoding: "):
        SamplingParams(guided_decoding=5)  # type: ignore[arg-type]


def test_a_grammar_set_or_cleared_on_the_params_after_construction_is_the_one_that_runs(llm):
    """A script that reuses its params, as with vLLM's: the grammar it sets on them is the one its next request
    obeys, and one it clears is gone (a copy under the old name kept constraining the output, and a new grammar was
    refused as given under both names)."""
    from loopserve import StructuredOutputsParams

    params = SamplingParams(max_tokens=6, temperature=0, structured_outputs=StructuredOutputsParams(choice=["yes"]))
    assert llm.generate([[3, 4]], params, use_tqdm=False)[0].outputs[0].text == "yes"
    params.structured_outputs = StructuredOutputsParams(choice=CHOICES)
    assert llm.generate([[3, 4]], params, use_tqdm=False)[0].outputs[0].text in CHOICES
    params.structured_outputs = None
    free = llm.generate([[3, 4]], SamplingParams(max_tokens=6, temperature=0), use_tqdm=False)[0].outputs[0]
    assert llm.generate([[3, 4]], params, use_tqdm=False)[0].outputs[0].token_ids == free.token_ids
    assert free.text not in ("yes", *CHOICES)


def test_pydantic_model_as_schema(llm):
    pydantic = pytest.importorskip("pydantic")

    class Pet(pydantic.BaseModel):
        kind: bool
        legs: int = pydantic.Field(ge=0, le=8)

    params = SamplingParams(temperature=1.0, max_tokens=60,
                            guided_decoding=GuidedDecodingParams(json=Pet, disable_any_whitespace=True))
    for o in llm.generate([[3, 4], [8, 1, 2]], params, use_tqdm=False):
        Pet.model_validate_json(o.outputs[0].text)


@pytest.mark.parametrize(("spec", "text"), [(dict(regex=r"<\|im_end\|>"), "<|im_end|>"),
                                            (dict(choice=["say <|im_start|> x"]), "say <|im_start|> x"),
                                            (dict(json={"const": "<|endoftext|>"}), '"<|endoftext|>"')])
def test_a_grammar_may_write_a_special_tokens_text(spec, text, llm):
    """The text of a special token that a grammar forces is written with ordinary tokens (the tokenizer would read
    it as the special token, which is no text: the mask allowed it, the matcher refused it, a 500)."""
    out = llm.generate(["go"], SamplingParams(temperature=0.0, max_tokens=40, guided_decoding=spec),
                       use_tqdm=False)[0].outputs[0]
    assert (out.finish_reason, out.text) == ("stop", text)
    special = set(llm.get_tokenizer().all_special_ids)
    assert not set(out.token_ids[:-1]) & special  # (then the eos the complete grammar allows)


def test_grammar_caches_are_bounded_by_size_not_only_by_count(tiny_ouro, monkeypatch):
    """A compiled matcher's memory grows with its grammar (a 122k-character schema held 5.9 MB), so the caches of
    compiled grammars and of grammar texts are capped by characters too: 128 large schemas had pinned over 2 GB.
    Past the cap the least recently used go; the newest stays, and a cached grammar is not compiled again."""
    m = loaded(tiny_ouro)
    texts = [grammar.grammar_text("json", json.dumps(
        {"type": "object", "properties": {f"p{i}_{j}": {"type": "integer"} for j in range(150)}})) for i in range(8)]
    cap = 5 * len(texts[0]) // 2  # (two of them)
    monkeypatch.setattr(grammar, "MATCHER_CACHE_CHARS", cap)
    compiler = grammar._Compiler(m.tokenizer, m.model.config.vocab_size)
    compiled: list[str] = []
    compile_one = compiler._compile
    monkeypatch.setattr(compiler, "_compile", lambda g: compiled.append(g) or compile_one(g))
    for t in texts:
        compiler.matcher(t)
    cache = compiler._matchers
    assert len(cache) == 2 and cache.size <= cap and len(compiled) == len(texts)
    compiler.matcher(texts[-1])  # (the newest: cached)
    compiler.matcher(texts[0])  # (the oldest: forgotten, compiled again)
    assert compiled[len(texts):] == [texts[0]]
    lru = grammar.SizedLRU(entries=3, chars=10)
    for k, size in [("a", 4), ("b", 4), ("c", 4), ("d", 30)]:
        lru.put(k, k.upper(), size)
    assert len(lru) == 1 and lru.get("d") == "D" and lru.get("a") is None  # (the newest stays, even alone over)
    for k in "efgh":
        lru.put(k, k, 1)
    assert len(lru) == 3 and lru.size == 3 and lru.get("e") is None
