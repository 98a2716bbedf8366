"""A request in flight: prompt, resolved exit rule, generated tokens, and the stop logic shared by
the reference decoder and the batching engine (one place decides when a request is finished)."""

from __future__ import annotations

import contextlib
import copy
import enum
import hashlib
from collections.abc import Callable, Mapping
from collections.abc import Sequence as Seq
from typing import TYPE_CHECKING, Any, Required, TypedDict, cast

import numpy as np
import torch

from loopserve.engine.grammar import new_guide, with_guide
from loopserve.engine.sampler import (
    REQUEST_ERRORS,
    AllowedTokenIds,
    BadWords,
    Sample,
    bind,
    first_token_room,
    plain_greedy,
    sample_one,
)
from loopserve.errors import NonFiniteError
from loopserve.exits import DEFAULT_THRESHOLDS, GATE_POLICIES, ExitRule
from loopserve.models.base import LoopedLM
from loopserve.outputs import (
    CompletionOutput,
    Logprob,
    PromptLogprobs,
    RequestMetrics,
    RequestOutput,
    logprob_entry,
    request_clock,
)
from loopserve.sampling_params import (
    TRUNCATE_TO_CONTEXT,
    RequestOutputKind,
    SamplingParams,
    all_ints,
    check_logprobs_asked,
    logprobs_asked,
    python_numbers,
)
from loopserve.tokenizer import Tokenizer

if TYPE_CHECKING:
    from loopserve.engine.held_tokens import HeldTokens

_MASK63 = (1 << 63) - 1


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    SWAPPED = "swapped"
    FINISHED = "finished"


def _within_r_max(name: str, depth: int, r_max: int) -> None:
    if depth > r_max:
        raise ValueError(f"{name}: {depth} exceeds the model's r_max ({r_max}); the KV cache holds r_max depths")


def resolve_exit_rule(params: SamplingParams, model: LoopedLM, lookahead: bool) -> ExitRule:
    """Fill in model defaults and check the request against the model."""
    config, has_gate = model.config, model.has_gate
    max_loops = params.max_loops or config.r_max
    _within_r_max("max_loops", max_loops, config.r_max)
    trace = params.exit_trace or ()
    if max(trace, default=1) > config.r_max:  # refused, not clamped: the first entry past r_max named
        i = next(i for i, depth in enumerate(trace) if depth > config.r_max)
        _within_r_max(f"exit_trace.{i}", trace[i], config.r_max)
    min_loops = params.min_loops or 1
    if min_loops > max_loops:
        raise ValueError(f"min_loops: {min_loops} exceeds max_loops ({max_loops})")
    policy = params.exit_policy or model.default_exit_policy
    threshold = params.exit_threshold
    if policy == "lookahead_gate" and not model.has_lookahead_gate:
        raise ValueError("exit_policy: this checkpoint has no lookahead_gate tensors"
                         + ("; 'gate' reads its learned exit gate" if has_gate else ""))
    if policy in GATE_POLICIES:
        if not has_gate:
            raise ValueError(f"exit_policy: {config.arch} has no learned exit gate")
        threshold = threshold if threshold is not None else (config.exit_threshold or 1.0)
        if not 0 < threshold <= 1:
            raise ValueError(f"exit_threshold: a gate threshold is a probability in (0, 1], got {threshold}")
    elif threshold is None:
        threshold = DEFAULT_THRESHOLDS.get(policy)  # (a policy without a threshold: fixed, trace)
    # lookahead_gate already decides one step ahead without a wasted loop: delayed lookahead adds nothing
    delayed = lookahead and policy != "lookahead_gate"
    return ExitRule(policy, threshold, min_loops, max_loops, tuple(trace), delayed)


class TextPrompt(TypedDict, total=False):
    """vLLM's text prompt (`from loopserve import TextPrompt`). `cache_salt` as in vLLM; its multimodal keys are typed
    as vLLM types them and refused when set (a ValueError naming the key: loopserve's models read text only)."""

    prompt: Required[str]
    cache_salt: str  # only requests with the same salt share prefix-cache blocks (cache/prefix.py)
    multi_modal_data: Any
    mm_processor_kwargs: Any


class TokensPrompt(TypedDict, total=False):
    """vLLM's token prompt: `prompt`, when given, is its text, reported back in the output; multimodal keys as in
    `TextPrompt`."""

    prompt_token_ids: Required[list[int]]
    prompt: str | None
    cache_salt: str
    multi_modal_data: Any
    mm_processor_kwargs: Any


PromptType = str | TextPrompt | TokensPrompt | dict[str, Any] | list[int]
# vLLM prompt keys that ask for what a text-only model cannot do: refused when set, never ignored
_MULTIMODAL_KEYS = ("multi_modal_data", "prompt_embeds", "mm_processor_kwargs", "multi_modal_uuids")


def parse_prompt(prompt: PromptType, tokenizer: Tokenizer, context: int | None = None,
                 truncate: int | None = None) -> tuple[str | None, list[int]]:
    """(text, token ids) of a prompt given as text, token ids, or {"prompt" | "prompt_token_ids": ...}. `context`: a
    text that surely encodes to that many tokens or more (`Tokenizer.fewest_tokens`) is refused before it is
    tokenized, which would cost about a second a megabyte, for nothing (None: no such check), unless it is to be
    truncated (`truncate`: the request's truncate_prompt_tokens)."""
    if truncate is not None:
        context = None
    if isinstance(prompt, str):
        return prompt, _encode_prompt(prompt, tokenizer, context)
    if isinstance(prompt, dict):
        given = cast("dict[str, Any]", prompt)  # (TextPrompt, TokensPrompt or a plain dict)
        for key in _MULTIMODAL_KEYS:  # (set: not None nor an empty dict, list or tuple; never a tensor's truth value)
            value = given.get(key)
            if value is not None and not (isinstance(value, dict | list | tuple) and not value):
                raise ValueError(f"{key}: not supported (loopserve serves text-only looped models)")
        if "prompt_token_ids" in given:
            ids = given["prompt_token_ids"]
            if hasattr(ids, "tolist") and hasattr(ids, "ndim"):  # a numpy array or torch tensor: its list (if 1-d)
                ids = ids.tolist()
            ids = python_numbers(ids)  # (numpy's integers in a list: np.arange's, as SamplingParams takes them)
            if not isinstance(ids, list) or not all_ints(ids):
                raise ValueError("prompt_token_ids: must be a list of integers")
            return given.get("prompt"), list(ids)
        if isinstance(given.get("prompt"), str):
            return given["prompt"], _encode_prompt(given["prompt"], tokenizer, context)
    if isinstance(prompt, list) and all_ints(prompt):
        return None, list(prompt)
    raise ValueError("prompt: expected a string, a list of token ids, or a dict with 'prompt' or 'prompt_token_ids'")


def _encode_prompt(text: str, tokenizer: Tokenizer, context: int | None) -> list[int]:
    fewest = tokenizer.fewest_tokens(text) if context is not None else 0
    if context is not None and fewest >= context:
        raise ValueError(f"prompt: at least {fewest} tokens ({len(text)} characters) leave no room to generate "
                         f"within the model's context of {context}")
    return tokenizer.encode(text, what="prompt")


def prompt_list(prompts: Any) -> list[PromptType]:
    """One prompt (text, token ids, a prompt dict) or a list of them, as `LLM.generate` and `LLM.beam_search` take
    them, as a list; a ValueError naming `prompts` for anything else."""
    if isinstance(prompts, str | dict) or (isinstance(prompts, list) and bool(prompts) and all_ints(prompts)):
        return [prompts]
    if isinstance(prompts, bytes | bytearray):  # (a Sequence of ints: it would be read as one prompt per byte)
        raise ValueError(f"prompts: got {type(prompts).__name__}, not text; decode them first "
                         "(prompts.decode('utf-8'))")
    if isinstance(prompts, Mapping) or not isinstance(prompts, Seq):
        raise ValueError("prompts: expected a prompt (a string, a list of token ids, or a dict with 'prompt' or "
                         f"'prompt_token_ids') or a list of prompts, got {type(prompts).__name__}")
    return list(prompts)


def in_batch(error: ValueError, i: int, n: int) -> ValueError:
    """`error` of prompt i of a batch of n, saying which (the field it names stays first)."""
    return ValueError(f"{error} (prompt {i} of {n})" if n > 1 else str(error))


def truncate_prompt(ids: list[int], keep: int | None, max_model_len: int, max_tokens: int | None) -> list[int]:
    """The prompt a request runs on: its last `keep` tokens (`truncate_prompt_tokens`), else all of them (also for
    a value SamplingParams refuses). TRUNCATE_TO_CONTEXT (-1) keeps what the context leaves beside the completion
    (vLLM's `max_input_tokens`): the last `max_model_len - max_tokens`, or `max_model_len - 1` without max_tokens
    (room for one token; the completion then runs to the context's end). `max_model_len`: the context whoever cuts
    checks the prompt against (`LLM`'s, the server's, the engine's: the same cap), so cutting again changes
    nothing. A `keep` over `max_model_len` is a ValueError naming the field (as vLLM refuses it)."""
    if keep is not None and keep > max_model_len:
        raise ValueError(f"truncate_prompt_tokens: {keep} is more than this model's maximum context length "
                         f"({max_model_len} tokens)")
    if keep == TRUNCATE_TO_CONTEXT:
        keep = max(max_model_len - (max_tokens or 1), 1)
    return ids[-keep:] if keep is not None and keep >= 1 else ids


_MASK64 = (1 << 64) - 1


def as_int64(seed: int) -> int:
    """A seed modulo 2^64 as the signed value an int64 array holds: any two seeds SamplingParams takes (64 bits,
    signed or not) stay distinct unless they are one 64-bit pattern (-1 and 2^64 - 1, as torch's `manual_seed`)."""
    return ((seed + (1 << 63)) & _MASK64) - (1 << 63)


def chain_seed(seed: int, token: int) -> int:
    """One link of a token chain: the splitmix64 finalizer of (seed, token). Position p's initial-state
    seed is the chain over tokens 0..p from the request's state base, so it is a function of the prefix
    (what lets prefix caching share a Huginn prompt's KV: docs/design.md §4.3, §8)."""
    z = (seed + (token + 1) * 0x9E3779B97F4A7C15) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return (z ^ (z >> 31)) & _MASK63


def make_sequence(model: LoopedLM, tokenizer: Tokenizer, request_id: str, prompt: PromptType,
                  params: SamplingParams, seed: int, lookahead: bool, num_speculative_tokens: int,
                  arrival_time: float | None = None, base_seed: int = 0,
                  part_size: Callable[[int], int] | None = None,
                  max_model_len: int | None = None, max_logprobs: int = -1) -> Sequence:
    """Validate a request against the model and the engine (`lookahead`, `num_speculative_tokens`: its knobs) and
    build its Sequence (ValueError names the bad field). `part_size(prompt_len)`: the most samples of a prompt that
    run together (the engine's `part_size`: its max_num_seqs, and what its KV cache holds; None: all). Past it the
    samples prefill in parts, each part's first sample the `prefill_head` of the others (vLLM queues such samples
    too; here each part prefills the prompt again, or reuses it from the prefix cache).
    `max_model_len`: the most prompt + completion tokens (None: the model's context); the sequence ends
    ("length") there. `max_logprobs`: the most logprobs and prompt_logprobs it may ask for (-1: the whole
    vocabulary, which it asks for by -1, as in vLLM).

    `seed` seeds sampling when the request gives none; the random initial states are seeded by the
    request's own seed, else by `base_seed` (the engine's), chained over the tokens (`Sequence.state_seed`).
    """
    c = model.config
    for name in ("logprobs", "prompt_logprobs"):
        check_logprobs_asked(name, getattr(params, name), max_logprobs, c.vocab_size)
    asked = params.num_speculative_tokens
    if asked is not None and asked > num_speculative_tokens:
        # the engine's k sizes every verify group (work items are numbered with a stride of k + 1, §12);
        # refused rather than cut, so that the client learns what the engine does
        why = (f"this engine drafts at most {num_speculative_tokens} tokens per round (its --num-speculative-tokens, "
               "EngineConfig.num_speculative_tokens)" if num_speculative_tokens else
               "speculative decoding is off in this engine: --num-speculative-tokens K "
               "(EngineConfig.num_speculative_tokens=K) turns it on, and a request may then ask for up to K")
        raise ValueError(f"num_speculative_tokens: {asked} asked for, but {why}")
    context = max_model_len or c.max_position
    text, ids = parse_prompt(prompt, tokenizer, context, params.truncate_prompt_tokens)
    salt = cast("dict[str, Any]", prompt).get("cache_salt") if isinstance(prompt, dict) else None
    if salt is not None and (not isinstance(salt, str) or not salt):
        raise ValueError(f"cache_salt: must be a non-empty string if given, got {salt!r}")
    ids = truncate_prompt(ids, params.truncate_prompt_tokens, context, params.max_tokens)  # (the text stays: vLLM)
    rule = resolve_exit_rule(params, model, lookahead)
    state = params.seed if params.seed is not None else base_seed
    # once for the request's n samples, which share them
    params = as_sampled(params, tokenizer, c.vocab_size)
    ids = checked_prompt(ids, params, tokenizer, context, c.vocab_size)
    out = list(ids)  # (outputs hand this one to the caller: not the list the engine reads)
    family = [Sequence(sample_id(request_id, j), text, ids, params, rule, _sample_seed(seed, params.seed, j), tokenizer,
                       context, c.vocab_size, arrival_time, state_seed=state, index=j, prompt_ids_out=out)
              for j in range(params.n)]
    head = family[0]
    first_token_room(head.params)  # a grammar whose first tokens the other masks all ban (its samples share them)
    for seq in family:
        seq.family = family
        seq.cache_salt = salt
    part = max(1, min(params.n, part_size(len(ids)) if part_size is not None else params.n))  # (resident together)
    for k in range(0, params.n, part):
        family[k].pending_forks = family[k + 1:k + part]
        for seq in family[k:k + part]:
            seq.prefill_head = family[k]
    return head


def as_sampled(params: SamplingParams, tokenizer: Tokenizer, vocab_size: int) -> SamplingParams:
    """The params as the sampler reads them (a copy where any differs): logprobs counted (`with_logprobs_counted`),
    bad words tokenized (`with_bad_words`), allowed token ids as a mask (`with_allowed_token_ids`)."""
    known = max(vocab_size, len(tokenizer))  # (vLLM's bound: the model's vocabulary or the tokenizer's, if larger)
    bad = [t for t in params.stop_token_ids if t >= known]
    if bad:
        raise ValueError(f"stop_token_ids: token ids must be in [0, {known}) (the vocabulary), got {bad[0]}")
    return with_allowed_token_ids(with_bad_words(with_logprobs_counted(params, vocab_size), tokenizer, vocab_size),
                                  tokenizer, vocab_size)


def with_logprobs_counted(params: SamplingParams, vocab_size: int) -> SamplingParams:
    """The params with vLLM's -1 in `logprobs` or `prompt_logprobs` (the whole vocabulary) as the count it asks for (a
    copy); as given when neither is -1."""
    if params.logprobs != -1 and params.prompt_logprobs != -1:
        return params
    counted = copy.copy(params)
    for name in ("logprobs", "prompt_logprobs"):
        if getattr(params, name) is not None:
            setattr(counted, name, logprobs_asked(getattr(params, name), vocab_size))
    return counted


def with_bad_words(params: SamplingParams, tokenizer: Tokenizer, vocab_size: int) -> SamplingParams:
    """The params with their `bad_words` tokenized as the sampler bans them (`BadWords.tokenize`; a copy: the
    caller's params may be shared); as given when there are none, or they already are."""
    if not params.bad_words or isinstance(params.bad_words, BadWords):
        return params
    tokenized = copy.copy(params)
    tokenized.bad_words = BadWords.tokenize(
        params.bad_words, lambda texts: tokenizer.encode_texts(texts, add_special_tokens=False, what="bad_words"),
        vocab_size)
    return tokenized


def with_allowed_token_ids(params: SamplingParams, tokenizer: Tokenizer, vocab_size: int) -> SamplingParams:
    """The params with their `allowed_token_ids` as the sampler masks them (`AllowedTokenIds`, unique, sorted and a
    tensor; a copy, made once per request and shared by its samples); as given when there are none, or they
    already are. Call it after `with_bad_words`. ValueError naming the field for ids outside the vocabulary, or for
    a request that could sample none of them as its first token: each is a bad word of one token (banned at every
    step) or, with min_tokens, a token that min_tokens holds back (an end-of-sequence or stop token). Later, only a
    bad word of several tokens can leave it none (the sampler's `NothingToSampleError`: the request fails alone)."""
    ids = params.allowed_token_ids
    if ids is None or isinstance(ids, AllowedTokenIds):
        return params
    if max(ids) >= vocab_size:  # (before building the set: a list of 10^6 ids outside the vocabulary is refused)
        raise ValueError(f"allowed_token_ids: token ids must be in [0, {vocab_size}) (the model's vocabulary)")
    allowed = AllowedTokenIds(ids)
    words = params.bad_words
    banned = set(words.always) if isinstance(words, BadWords) else set()
    held = stop_tokens(params, tokenizer, vocab_size)
    if params.min_tokens and held.issuperset(allowed):
        raise ValueError("allowed_token_ids: with min_tokens, every allowed token is an end-of-sequence or stop "
                         "token: none could be sampled before min_tokens")
    if banned.issuperset(allowed):
        raise ValueError("allowed_token_ids: bad_words ban every one of them (each is a bad word of one token, "
                         "banned at every step): no token could be sampled")
    if params.min_tokens and banned.union(held).issuperset(allowed):
        raise ValueError("allowed_token_ids: with min_tokens, bad_words and the end-of-sequence or stop tokens ban "
                         "every one of them: no token could be sampled before min_tokens")
    masked = copy.copy(params)
    masked.allowed_token_ids = allowed
    return masked


def eos_ids(params: SamplingParams, tokenizer: Tokenizer) -> set[int]:
    """The end-of-sequence tokens that may end a request: none under ignore_eos."""
    return set() if params.ignore_eos else set(tokenizer.eos_token_ids)


def stop_tokens(params: SamplingParams, tokenizer: Tokenizer, vocab_size: int) -> frozenset[int]:
    """The tokens that may end a request (its eos tokens and stop_token_ids) and can be sampled (in the model's
    vocabulary: a tokenizer's eos id may lie outside it): what min_tokens holds back."""
    return frozenset(t for t in eos_ids(params, tokenizer) | set(params.stop_token_ids) if t < vocab_size)


def failure(error: Exception) -> tuple[str, int]:
    """The error and status a request that `error` failed finishes with (finish_reason "error"), in the engine
    (`Scheduler.fail`) and the reference decoder alike: a failure of its own making (`REQUEST_ERRORS`) as it was
    raised, 400 where its input is at fault (500: its logits were not finite); any other, a bug it triggered,
    as an internal error (500)."""
    if isinstance(error, REQUEST_ERRORS):
        return str(error), 500 if isinstance(error, NonFiniteError) else 400
    return f"internal error while handling this request ({type(error).__name__}: {error})", 500


def _no_text(token: int) -> None:
    """What a request that asked for token ids only (detokenize=False) decodes of a token: nothing."""
    return None


def unseeded(base_seed: int, request_id: str) -> int:
    """The sampling seed of a request that gives none: a hash of the engine's seed and the request's id, so that
    unseeded requests differ from each other and from any request's own seed (the k-th request of an `LLM` seeded 0
    drew as one seeded k did), and stay the same across processes (unlike `hash()`)."""
    return int.from_bytes(hashlib.sha256(f"{base_seed}:{request_id}".encode()).digest()[:8], "little")


def sample_id(request_id: str, index: int) -> str:
    """The engine's id of sample `index` of a request (n > 1): the request's own id for the first,
    "{index}_{request_id}" for the others (vLLM's child ids)."""
    return request_id if index == 0 else f"{index}_{request_id}"


def _sample_seed(seed: int, given: int | None, index: int) -> int:
    """Sampling seed of sample `index`: seed + index when the request gave one (vLLM), else a distinct
    stream derived from the engine's seed for the request."""
    if given is not None:
        return given + index
    return (seed + index * 0x9E3779B97F4A7C15) & _MASK63


def checked_prompt(prompt_ids: list[int], params: SamplingParams, tokenizer: Tokenizer, max_model_len: int,
                   vocab_size: int) -> list[int]:
    """A request's prompt ids, checked against the model with the token ids its params name (ValueError naming
    the field), as a list of the request's own: its samples share it and nothing modifies it. Once per request,
    not per sample: the checks and the copy are O(prompt), and a request of n = 64 samples of a 1k-token prompt
    held the GIL 64 times as long for them."""
    if not prompt_ids:
        raise ValueError("prompt: empty prompt (no tokens)")
    if len(prompt_ids) >= max_model_len:
        raise ValueError(f"prompt: {len(prompt_ids)} tokens leave no room to generate "
                         f"within the model's context of {max_model_len}")
    if min(prompt_ids) < 0 or max(prompt_ids) >= vocab_size:
        raise ValueError(f"prompt_token_ids: ids must be in [0, {vocab_size}) (the model's vocabulary)")
    if params.logit_bias and max(params.logit_bias) >= vocab_size:
        raise ValueError(f"logit_bias: token ids must be in [0, {vocab_size}) (the model's vocabulary)")
    if params.min_tokens and len(stop_tokens(params, tokenizer, vocab_size)) >= vocab_size:
        raise ValueError("stop_token_ids: with min_tokens, these and the end-of-sequence tokens leave no "
                         "token to sample")
    return list(prompt_ids)


class Sequence:
    def __init__(self, request_id: str, prompt: str | None, prompt_ids: list[int], params: SamplingParams,
                 rule: ExitRule, seed: int, tokenizer: Tokenizer, max_model_len: int, vocab_size: int,
                 arrival_time: float | None = None, state_seed: int | None = None, index: int = 0,
                 prompt_ids_out: list[int] | None = None) -> None:
        """One sample of a request, as `make_sequence` builds it: `prompt_ids` checked (`checked_prompt`) and
        kept as given, shared with the request's other samples (never modified); `prompt_ids_out`: the copy
        the request's outputs hand out (one per request; a copy of `prompt_ids` if not given)."""
        self.eos_ids = eos_ids(params, tokenizer)
        self.stop_ids = set(params.stop_token_ids)
        self.stop_tokens = stop_tokens(params, tokenizer, vocab_size)
        # bound to this sequence's tokens if its sampling reads them (penalties, min_tokens, bad_words, which
        # make_sequence has tokenized once for the request's samples, as it has built their allowed_token_ids)
        params = as_sampled(params, tokenizer, vocab_size)
        self.request_id, self.prompt, self.params, self.rule = request_id, prompt, bind(params, self), rule
        if params.grammar_spec is not None:  # structured output: this request's own grammar matcher
            self.params = with_guide(self.params, new_guide(params.grammar_spec, tokenizer, vocab_size))
        # Read per token, so settled once here (params never change after this): whether it reports after
        # every token, whether it needs its text then (stop strings too), whether it samples by a plain argmax
        self.streams = params.output_kind != RequestOutputKind.FINAL_ONLY
        self._text_per_token = (bool(params.stop) or self.streams) and params.detokenize
        self.plain_greedy = plain_greedy(self.params)
        # and whether a token that cannot finish it needs nothing but recording (`HeldTokens`) and, if it
        # streams, its text and an output: no logprobs, stop strings or grammar read per token
        self.quiet = params.logprobs is None and not params.stop and self.params.guide is None
        self.prompt_ids = prompt_ids
        self._prompt_ids_out = prompt_ids_out if prompt_ids_out is not None else list(prompt_ids)
        self.tokenizer = tokenizer
        self.seed = as_int64(seed)  # sampling (make_sequence: the request's seed, + index for sample `index`)
        self.state_base = as_int64(state_seed if state_seed is not None else self.seed)
        self._state_chain: list[int] = []  # state seeds of positions 0.. computed so far
        self.num_cached_tokens = 0  # prompt tokens the latest admission took from the prefix cache
        self.block_hashes: list[bytes] | None = None  # the prompt's full KV blocks' keys (prefix cache)
        self.cache_salt: str | None = None  # part of those keys: only requests with the same salt share blocks
        limit = max_model_len - len(prompt_ids)
        self.max_new = min(params.max_tokens, limit) if params.max_tokens is not None else limit
        self._output_ids: list[int] = []
        self.logprobs: list | None = [] if params.logprobs is not None else None
        self.prompt_logprobs = (PromptLogprobs(len(self.prompt_ids), params.prompt_logprobs, self._token_text)
                                if params.prompt_logprobs is not None else None)
        self.cumulative_logprob = 0.0
        self._exit_depths: list[int] = []
        self._text = ""  # the text of output_ids[:_decoded] (`text` decodes the rest when read)
        self._decoded = 0
        # incremental decoding of output_ids, as vLLM's (detokenize=False: none, the text stays "")
        self._detok = tokenizer.text_stream(prompt_ids, params.skip_special_tokens) if params.detokenize else None
        # DELTA outputs: what earlier outputs reported (tokens, characters of text, the finish); and the characters
        # an unfinished output (DELTA or CUMULATIVE) holds back while a stop string may still cut them: the longest
        # one, less one (none when stop strings stay in the output, as in vLLM)
        self._sent_tokens = self._sent_chars = 0
        self._sent_finish = self._sent_prompt_logprobs = False
        self._hold = (max(len(s) for s in params.stop) - 1
                      if params.stop and not params.include_stop_str_in_output else 0)
        self.finish_reason: str | None = None
        self.stop_reason: int | str | None = None  # the stop token id or stop string that finished it (not eos)
        self.error: str | None = None
        self.error_status: int | None = None
        self.status = Status.WAITING
        # n > 1: the request's samples share the prompt's prefill. `family` lists them all (this one
        # included, the first is the head, whose id is the request's); the head prefills the prompt and
        # its `pending_forks` receive a copy of the prompt's KV when that completes. With more samples than the
        # engine holds at once (its `part_size`), they come in parts, each prefilled by its first (`prefill_head`).
        self.index = index
        self.family: list[Sequence] = [self]
        self.pending_forks: list[Sequence] = []
        self.prefill_head: Sequence = self
        self.arrival_index = 0  # order of arrival at the engine (preemption picks the latest)
        self._metrics = RequestMetrics(arrival_time if arrival_time is not None else request_clock())
        # while resident in the engine: where whole batches leave its quiet tokens (`HeldTokens`), by slot
        self.held: HeldTokens | None = None
        self.slot = -1

    # -- token bookkeeping --------------------------------------------------------------------------
    # The generated tokens, their exit depths and the metrics are read through these: each first takes in
    # what coda batches left for it in `held` (a check of one array entry when nothing is there).
    @property
    def output_ids(self) -> list[int]:
        if self.held is not None and self.held.count[self.slot]:
            self.settle()
        return self._output_ids

    @property
    def exit_depths(self) -> list[int]:
        if self.held is not None and self.held.count[self.slot]:
            self.settle()
        return self._exit_depths

    @property
    def metrics(self) -> RequestMetrics:
        if self.held is not None and self.held.count[self.slot]:
            self.settle()
        return self._metrics

    @property
    def loops_run(self) -> int:
        """Core loops its decode tokens ran so far, held ones included, read without settling them (the
        scheduler's invariant checks: settling there would leave nothing held between two steps)."""
        return self._metrics.loops_run + (int(self.held.loops[self.slot]) if self.held is not None else 0)

    def settle(self) -> None:
        """Take in the tokens held for this sequence (`HeldTokens`): ids and exit depths onto the lists, their
        loops and times into the metrics. They were quiet: none of them could finish it or needs checking."""
        if self.held is None:
            return
        tokens, depths, loops, first, last = self.held.take(self.slot)
        if tokens:
            self._output_ids += tokens
            self._exit_depths += depths
            metrics = self._metrics
            metrics.loops_run += loops
            if metrics.first_token_time is None:
                metrics.first_token_time = first
            metrics.last_token_time = last

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def decode_index(self) -> int:
        """Index of the next decode work item (the item fed generated token k is item k)."""
        return len(self.output_ids) - 1

    def state_seed(self, position: int) -> int:
        """Seed of the random initial loop state of the token at `position` (Huginn like-init): the chain
        of `chain_seed` over tokens 0..position from `state_base`, a function of the prefix alone."""
        chain, n = self._state_chain, len(self.prompt_ids)
        while len(chain) <= position:
            p = len(chain)
            chain.append(chain_seed(chain[-1] if chain else self.state_base,
                                    self.prompt_ids[p] if p < n else self.output_ids[p - n]))
        return chain[position]

    @property
    def text(self) -> str:
        """The output's text so far."""
        if self._decoded < len(self.output_ids):
            self.decode_pending()
        return self._text

    @text.setter
    def text(self, value: str) -> None:  # the text a stop string cut: nothing left to decode
        if self._sent_chars and value[:self._sent_chars] != self._text[:self._sent_chars]:
            self._sent_chars = len(value)  # (a cut into text a DELTA output sent, which the hold-back prevents)
        self._text, self._decoded = value, len(self.output_ids)

    def decode_pending(self, end: int | None = None) -> None:
        """Append the text of the tokens not decoded yet, up to output token `end` (default: all); the stream holds
        back an incomplete UTF-8 character until the token that completes it (`TextStream`). Called per token only
        for requests that need the text then (by `append` for stop strings and per-token outputs, by the scheduler
        for a coda batch's quiet tokens of streamed requests): a FINAL_ONLY request without stop strings decodes its
        text once, when it finishes."""
        ids = self.output_ids
        end = len(ids) if end is None else end
        if self._decoded < end and self._detok is not None:
            self._text += self._detok.extend(ids[self._decoded:end])
        self._decoded = max(self._decoded, end)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def sample_and_append(self, logits: torch.Tensor, exit_depth: int) -> int:
        """Sample the next token from one row of logits (the reference decoder; the engine samples a
        whole batch on the device and hands each request its `Sample`)."""
        return self.take(sample_one(logits, self.params, self.seed, len(self.output_ids)), exit_depth)

    def take(self, sample: Sample, exit_depth: int, now: float | None = None) -> int:
        """Append a sampled token (raises for a row that failed or held non-finite logits); `now`: the
        time it arrived (read here if not given; the engine reads the clock once per batch)."""
        token = sample.checked().token
        if sample.logprob is not None:
            self.cumulative_logprob += sample.logprob
            if self.logprobs is not None:
                self.logprobs.append(self._logprob_entry(sample))
        self.append(token, exit_depth, request_clock() if now is None else now)
        return token

    @property
    def _token_text(self) -> Callable[[int], str | None]:
        """A token's text in a logprob entry (vLLM's decoded_token): none without detokenize."""
        return self.tokenizer.decode_token if self.params.detokenize else _no_text

    def _logprob_entry(self, sample: Sample) -> dict[int, Logprob]:
        """A sampled token's logprob entry (`logprob_entry`: vLLM's order)."""
        return logprob_entry(sample.token, sample.logprob, sample.rank, sample.top or (),  # type: ignore[arg-type]
                             self._token_text)

    def set_prompt_logprobs(self, position: int, rows: dict[str, np.ndarray]) -> None:
        """The logprobs of prompt tokens position+1, position+2, ... (row j of `rows`, `prompt_logprobs`' host
        arrays, scores token position+1+j from the state of the token before it), kept as arrays
        (`PromptLogprobs`). A non-finite row fails the request (NonFiniteError)."""
        assert self.prompt_logprobs is not None
        if not rows["finite"].all():
            raise NonFiniteError("the model produced non-finite logits for this request")
        self.prompt_logprobs.add(position, rows)

    def append(self, token: int, exit_depth: int, now: float) -> None:
        metrics = self.metrics
        if metrics.first_token_time is None:
            metrics.first_token_time = now
        metrics.last_token_time = now
        guide = self.params.guide
        if guide is not None:
            guide.advance(token)  # raises if the grammar rejects it: the request fails alone
        stop = self.params.stop
        searched = len(self.text) if stop else 0  # the text before this token had no stop string
        ids = self.output_ids
        ids.append(token)
        self.exit_depths.append(exit_depth)
        if self._text_per_token:  # (a stop token's text is left out unless kept: vLLM does not decode it)
            self.decode_pending(len(ids) - self._drops_stop_token(token))  # here, where a failure fails this request
        if not (stop or guide is not None or token in self.stop_tokens or len(ids) >= self.max_new):
            return  # (most tokens: nothing below could finish it, and the checks run per token)
        if not self._stopped(token, searched) and len(ids) >= self.max_new:
            self.finish("length")
        if not self.finished and guide is not None and guide.done and not self._eos_may_end():
            # the grammar is complete, so only an eos may follow, and none can end the request here (ignore_eos; within
            # min_tokens): it ends now (vLLM would sample a masked row). Else the eos is sampled next, as in vLLM
            self.finish("stop")

    def _eos_may_end(self) -> bool:
        """Whether an eos sampled next would end the request: it has one (none under ignore_eos, or from a tokenizer
        without one), and min_tokens are out."""
        return bool(self.eos_ids) and len(self.output_ids) >= self.params.min_tokens

    def _drops_stop_token(self, token: int) -> bool:
        """Whether `token`, just appended, is a stop token that ends the request (past min_tokens) and whose text
        is left out (unless include_stop_str_in_output)."""
        p = self.params  # (read per token of a request that decodes per token: the set lookup first)
        return token in self.stop_tokens and not p.include_stop_str_in_output and len(self.output_ids) > p.min_tokens

    def _stopped(self, token: int, searched: int) -> bool:
        """Finish the request if the token just appended, or the text it completed, stops it (vLLM's rules:
        nothing stops it before min_tokens tokens; the stop token's text, or the stop string, is left out
        of the text unless include_stop_str_in_output; stop_reason is the stop token id or string, None for the
        tokenizer's eos token: a generation config's other eos ids are stop ids to vLLM, and name themselves)."""
        p = self.params
        if len(self.output_ids) <= p.min_tokens:
            return False
        if token in self.eos_ids or token in self.stop_ids:
            n = len(self.output_ids)
            self.decode_pending(n - self._drops_stop_token(token))
            self._decoded = n  # (a stop token left out is never decoded)
            self.finish("stop")
            self.stop_reason = None if token in self.eos_ids and token == self.tokenizer.eos_token_id else token
            return True
        if not p.stop:
            return False
        # vLLM's rule: the first stop string listed that ends in the new text (it may begin in the text before it, in
        # that of the first min_tokens tokens too)
        text = self.text
        for s in p.stop:
            i = text.find(s, max(0, searched - len(s) + 1))
            if i >= 0:
                self.text = text[: i + len(s) if p.include_stop_str_in_output else i]
                self.finish("stop")
                self.stop_reason = s
                return True
        return False

    def finish(self, reason: str, error: str | None = None, error_status: int | None = None) -> None:
        """End the request: the text is what the stream decoded (a character still incomplete is dropped, as vLLM
        drops it), or for an error as far as it decodes (decoding may be what failed); nothing more after this."""
        with contextlib.suppress(Exception) if error is not None else contextlib.nullcontext():
            self.decode_pending()
        self._decoded = len(self.output_ids)
        self.finish_reason = reason
        self.error = error
        self.error_status = error_status or (500 if error is not None else None)
        self.status = Status.FINISHED
        self.metrics.finished_time = request_clock()

    def completion(self) -> CompletionOutput:
        """Everything so far (CUMULATIVE and FINAL_ONLY outputs): the lists as they are once it finished (they
        never change after; an n > 1 request's later outputs share them: outputs are read, not modified), else
        copies (the engine thread goes on appending to its own while a consumer holds the output); the text, until
        it finishes, less the characters a stop string may still cut (vLLM's: a stream never shows the start of a
        stop string, to take it back in its next output)."""
        done = self.finished
        ids, depths, text = self.output_ids, self._exit_depths, self.text
        if self._hold and not done:
            text = text[:max(0, len(text) - self._hold)]
        logprobs = self.logprobs if done or self.logprobs is None else list(self.logprobs)
        return CompletionOutput(self.index, text, ids if done else list(ids),
                                self.cumulative_logprob if self.params.logprobs is not None else None,
                                logprobs, self.finish_reason, self.stop_reason,
                                exit_depths=depths if done else list(depths),
                                metrics=self._metrics if done else self._metrics.snapshot())

    def delta(self) -> CompletionOutput | None:
        """What is new since this sample's last DELTA output (None: nothing): the new tokens, their exit
        depths and logprobs, and the new text, less the last characters a stop string may still cut
        (sent once the request finishes). Costs O(new), not O(length)."""
        if self._sent_finish:
            return None
        ids = self.output_ids  # (read once: a streamed request's every output comes here, a token at a time)
        a, b = self._sent_tokens, len(ids)
        text, finished = self.text, self.finished
        ready = len(text) if finished else max(self._sent_chars, len(text) - self._hold)
        if a == b and ready == self._sent_chars and not finished:
            return None
        piece = text[self._sent_chars:ready]
        self._sent_tokens, self._sent_chars, self._sent_finish = b, max(self._sent_chars, ready), finished
        return CompletionOutput(self.index, piece, ids[a:b],
                                self.cumulative_logprob if self.params.logprobs is not None else None,
                                self.logprobs[a:b] if self.logprobs is not None else None, self.finish_reason,
                                self.stop_reason, exit_depths=self._exit_depths[a:b], metrics=self._metrics)

    def to_output(self) -> RequestOutput:
        """The request's output (called on its head): everything so far, or with `output_kind` DELTA what
        is new, one completion per sample that has something new, and the prompt logprobs in the first
        output only (vLLM's rule). Finished once every sample is."""
        head = self.family[0]
        kind = head.params.output_kind
        if kind == RequestOutputKind.DELTA:
            completions = [c for s in head.family if (c := s.delta()) is not None]
            prompt_logprobs = None if head._sent_prompt_logprobs else head.prompt_logprobs
            head._sent_prompt_logprobs = True
        else:
            completions, prompt_logprobs = [s.completion() for s in head.family], head.prompt_logprobs
        if len(head.family) == 1:
            # its sample's own: a running request's metrics are still written to, so a CUMULATIVE output, a snapshot
            # of everything so far, holds a copy (`completion`), as it holds copies of the lists; a DELTA one, read
            # as it comes, is not worth one a token
            metrics = completions[0].metrics if completions else head.metrics
            return RequestOutput(head.request_id, head.prompt, head._prompt_ids_out, prompt_logprobs, completions,
                                 head.finished, metrics, num_cached_tokens=head.num_cached_tokens,
                                 error=head.error, error_status=head.error_status)
        failed = next((s for s in head.family if s.error is not None), None)
        finished = all(s.finished for s in head.family)
        firsts = [s.metrics.first_token_time for s in head.family if s.metrics.first_token_time is not None]
        lasts = [s.metrics.last_token_time for s in head.family if s.metrics.last_token_time is not None]
        metrics = RequestMetrics(head.metrics.arrival_time, min(firsts, default=None),
                                 max(s.metrics.finished_time or 0.0 for s in head.family) if finished else None,
                                 sum(s.metrics.loops_run for s in head.family),
                                 # (the samples share the prompt's prefill, each part's first sample runs it; the
                                 # reference decoder runs one per sample, counted once as the engine's)
                                 sum(s.metrics.prefill_loops for s in head.family if s.prefill_head is s),
                                 last_token_time=max(lasts, default=None))
        return RequestOutput(head.request_id, head.prompt, head._prompt_ids_out, prompt_logprobs, completions, finished,
                             metrics, num_cached_tokens=head.num_cached_tokens,
                             error=failed.error if failed else None,
                             error_status=failed.error_status if failed else None)
