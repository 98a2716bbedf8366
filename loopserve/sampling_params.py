"""`SamplingParams`: what a request asks for (vLLM names) plus the looped-model extensions."""

from __future__ import annotations

import copy
import dataclasses
import enum
import json
import logging
import math
import reprlib
from dataclasses import KW_ONLY, dataclass, field, fields
from typing import TYPE_CHECKING, Any

import numpy as np

from loopserve.exits import GATE_POLICIES, POLICIES
from loopserve.vllm_neutral import TRUNCATE_KEY

if TYPE_CHECKING:
    from loopserve.engine.grammar import Guide
    from loopserve.engine.sampler import TokenHistory

log = logging.getLogger(__name__)

DEFAULT_MAX_LOGPROBS = 20  # vLLM's default max_logprobs (the engine's cap on what a request's logprobs ask for)


def logprobs_cap(max_logprobs: int, vocab_size: int) -> int:
    """The most logprobs (and prompt_logprobs) a request may ask for of an engine whose max_logprobs (vLLM's knob)
    is this, on a model of `vocab_size` tokens: -1 is no cap but the vocabulary, as in vLLM."""
    return vocab_size if max_logprobs < 0 else min(max_logprobs, vocab_size)


def logprobs_asked(k: int, vocab_size: int) -> int:
    """The logprobs a request's `k` asks for: vLLM's -1 is the whole vocabulary."""
    return vocab_size if k == -1 else k


def check_logprobs_asked(name: str, k: int | None, max_logprobs: int, vocab_size: int,
                         knob: str = "the engine's max_logprobs") -> None:
    """ValueError naming `name` unless an engine whose max_logprobs is this (`knob`: how the caller knows the setting)
    returns the `k` logprobs asked for."""
    if k is None or logprobs_asked(k, vocab_size) <= logprobs_cap(max_logprobs, vocab_size):
        return
    got = f"-1 (the whole vocabulary, {vocab_size} tokens)" if k == -1 else str(k)
    cap = (f"{vocab_size} (the model's vocabulary)" if max_logprobs < 0 or max_logprobs > vocab_size
           else f"{max_logprobs} ({knob})")
    raise ValueError(f"{name}: at most {cap}, got {got}")


def check_logprobs_count(name: str, k: Any) -> None:
    """ValueError naming `name` unless `k` is None, an integer >= 0 or -1 (the whole vocabulary): what a request's
    logprobs (or prompt_logprobs) may ask for; the engine's max_logprobs then bounds it (`check_logprobs_asked`)."""
    if k is not None and (not is_int(k) or k < -1):
        raise ValueError(f"{name}: must be an integer >= 0, or -1 (the whole vocabulary), got {_short(k)}")


def check_beam_width(width: int, max_logprobs: int, vocab_size: int, *, field: str = "beam_width",
                     search: str = "beam_width", knob: str = "max_logprobs") -> None:
    """ValueError unless an engine whose max_logprobs is this runs a beam search `width` wide: naming `search` (the
    field that asks for a search) where it runs none, else `field` (the width's); `knob`: how the caller knows the
    setting (`LLM.beam_search` and the server's `use_beam_search` alike)."""
    cap, why = logprobs_cap(max_logprobs, vocab_size) // 2, f"(a step asks for the top 2 * {field} logprobs)"
    if cap == 0:
        raise ValueError(f"{search}: a beam search needs {knob} >= 2 {why}; this one is {max_logprobs}")
    if width > cap:
        raise ValueError(f"{field}: at most {cap} under {knob} {max_logprobs} {why}, got {width}")


# samples per prompt: vLLM's bound (VLLM_MAX_N_SEQUENCES' default). Past an engine's max_num_seqs they come in parts
# (docs/design.md §6.6); a server's admission bound counts each one
MAX_N = 16384
# Sizes that bound one request's cost to the engine (a 400 beyond them). Stop strings are searched for
# after every token, each on its own (150,000 of them held the engine ~60 ms a token, for everyone).
# Grammars are compiled in time that grows faster than their size (a choice among 20,000 options: 0.6 s;
# 200,000: over a minute, then llguidance fails), and llguidance's parser cannot pass the first token of
# a choice among more than ~2,000 options that share it.
MAX_STOP = 256
MAX_CHOICES = 2000
# An exit trace's k-th entry is the k-th decode token's depth, so entries past the longest output are never read:
# its cap is the longest context of a looped model served (Ouro's max_position_embeddings; Huginn's is 4,096; a
# max_model_len past it, which $VLLM_ALLOW_LONG_MAX_MODEL_LEN allows, runs the tokens past the trace at full depth)
MAX_EXIT_TRACE = 65536
# GuidedDecodingParams' grammar fields (its json_object, a flag, names one more: a JSON object)
GUIDE_KINDS = ("json", "regex", "choice", "grammar")
# SamplingParams' fields for a looped model's exit rule that a request, a command's flags or a server's defaults set
EXIT_FIELDS = ("min_loops", "max_loops", "exit_threshold", "exit_policy")
MAX_GRAMMAR_CHARS = 100_000  # a regex, a Lark/GBNF grammar, a whitespace pattern
MAX_SCHEMA_CHARS = 500_000  # a JSON schema, as JSON (an enum of 40,000 words: 0.3 s to compile)
# A temperature above 0 and below this is raised to it, as vLLM raises it (so only 0 samples greedily): dividing
# logits by a tiny temperature overflows to inf, and at 0.01 a logit gap of 1 is already a ratio of e^100.
MIN_TEMPERATURE = 0.01
# the smallest repetition_penalty: a positive logit is divided by it in float64, and a float32 logit (up to 3.4e38)
# divided by less than about 1.9e-270 overflows to infinity (vLLM takes any value > 0; a tiny one samples garbage)
MIN_REPETITION_PENALTY = 1e-200
SEED_MIN, SEED_MAX = -(2**63), 2**64 - 1  # any 64-bit seed, signed or not (engine/sequence.py `as_int64`)
_repr = reprlib.Repr()  # a bad value in an error message, shortened
_repr.maxlist, _repr.maxdict, _repr.maxstring, _repr.maxother = 8, 8, 80, 80
_short = _repr.repr


def is_int(x: Any) -> bool:
    """An integer, not a bool (a JSON true would pass isinstance(x, int))."""
    return isinstance(x, int) and not isinstance(x, bool)


def all_ints(values: list) -> bool:
    """Whether every element is an int (not a bool). By the set of their types first, at C speed: with the
    range check by min/max, about 0.05 us a value, where a Python test per value took about 0.15 us (a request
    may send 10^6 token ids)."""
    return set(map(type, values)) <= {int} or all(is_int(x) for x in values)


def is_number(x: Any) -> bool:
    """An int or a float, not a bool."""
    return isinstance(x, int | float) and not isinstance(x, bool)


def is_real(x: Any) -> bool:
    """A finite number (no bool, NaN or infinity)."""
    return is_number(x) and math.isfinite(x)


def python_numbers(value: Any) -> Any:
    """`value` with numpy scalars (np.int64(5), np.float32(0.5), np.True_), alone or in a list, tuple or dict (keys
    and values), as the Python numbers they hold, as vLLM takes them: sweeps written with np.arange / np.linspace
    pass such values. An array, of any shape, becomes a list (nested for two dimensions or more: the checks that
    want a flat list then refuse it naming the field; a 0-d array becomes its number). Anything else is returned
    as it is (the types of a long list are read by their set first, at C speed)."""
    if isinstance(value, np.generic | np.ndarray):
        return value.tolist()
    if isinstance(value, list | tuple) and any(issubclass(t, np.generic) for t in set(map(type, value))):
        return type(value)(v.item() if isinstance(v, np.generic) else v for v in value)
    if isinstance(value, dict) and any(isinstance(x, np.generic) for kv in value.items() for x in kv):
        return {python_numbers(k): python_numbers(v) for k, v in value.items()}
    return value


# truncate_prompt_tokens: keep the last prompt tokens the context holds beside the completion (vLLM's -1,
# `engine.sequence.truncate_prompt`)
TRUNCATE_TO_CONTEXT = -1


def truncates_prompt(truncate_prompt_tokens: Any) -> bool:
    """A value truncate_prompt_tokens may take: an integer >= 1 (keep the last that many prompt tokens) or
    TRUNCATE_TO_CONTEXT."""
    return is_int(truncate_prompt_tokens) and (truncate_prompt_tokens >= 1
                                                or truncate_prompt_tokens == TRUNCATE_TO_CONTEXT)


SCHEMA_FORMS = "a JSON schema: an object, a boolean, or the JSON text of one"


def with_tokenization_kwargs(params: SamplingParams, tokenization_kwargs: dict[str, Any] | None) -> SamplingParams:
    """`params` with the `truncate_prompt_tokens` of vLLM's `tokenization_kwargs` (checked by `vllm_neutral`), where
    newer vLLM takes it (its SamplingParams' field is deprecated there); a different value on `params` as well is a
    ValueError naming the field."""
    keep = (tokenization_kwargs or {}).get(TRUNCATE_KEY)
    if keep is None or keep == params.truncate_prompt_tokens:
        return params
    if params.truncate_prompt_tokens is not None:
        raise ValueError(f"tokenization_kwargs: truncate_prompt_tokens {keep!r} differs from the sampling params' "
                         f"{params.truncate_prompt_tokens!r}")
    return dataclasses.replace(params, truncate_prompt_tokens=keep)  # (checked as the params' own)


def _check_schema(schema: Any) -> None:
    """ValueError naming `json` unless `schema` is a JSON schema in a form GuidedDecodingParams takes (the
    grammar compiler says whether its content is valid)."""
    value = schema
    if isinstance(schema, str):
        try:
            value = json.loads(schema)
        except (ValueError, RecursionError) as e:
            raise ValueError(f"json: must be {SCHEMA_FORMS}; the text is not valid JSON ({e})") from None
    if not isinstance(value, dict | bool):
        kinds = {list: "an array", str: "a string", int: "a number", float: "a number", type(None): "null"}
        kind = kinds.get(type(value), type(value).__name__)
        raise ValueError(f"json: must be {SCHEMA_FORMS}, got {'the JSON text of ' if schema is not value else ''}"
                         f"{kind}")


GRAMMAR_BACKENDS = (None, "auto", "guidance")  # `GuidedDecodingParams.backend`: the names that mean llguidance
# the keywords of a JSON schema whose values are schemas, or lists or name maps of schemas
_SUBSCHEMA = ("items", "additionalItems", "contains", "not", "if", "then", "else", "propertyNames",
              "unevaluatedItems", "unevaluatedProperties", "additionalProperties")
_SUBSCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")
_SUBSCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")


def _without_additional_properties(schema: Any, strict: bool = False) -> Any:
    """`disable_additional_properties`: a copy of the JSON schema (a dict, or its JSON text: then JSON text) in
    which every schema that lists `properties` or `patternProperties` (a dict) and does not set
    `additionalProperties` sets it false: vLLM's rule (backend_guidance `_walk_json_for_additional_properties`),
    whatever its `type` says, so a free-form `{"type": "object"}` stays open. `strict` (the default backend's rule,
    after xgrammar's strict mode): and a tuple (`prefixItems`) that sets neither `items` nor `additionalItems` admits
    nothing past its items; and it leaves open the schemas that describe an object together with others, where
    closing one would refuse the others' properties (`additionalProperties` sees only its own schema's): a schema
    with `allOf`, `anyOf` or `oneOf`, the branches of `allOf`, and those of `anyOf` / `oneOf` beside properties of
    their own (closed, `{"properties": {"a": ...}, "allOf": [{"properties": {"b": ...}}]}` admitted only `{}`).
    (llguidance refuses the `unevaluated*` keywords, so no schema here relies on them.)
    Walked by keyword, so a property named "type" or "properties" is not taken for a keyword."""
    def walk(node: Any, composed: bool = False) -> Any:
        if not isinstance(node, dict):
            return node
        out = dict(node)
        lists_props = isinstance(out.get("properties"), dict) or isinstance(out.get("patternProperties"), dict)
        for key in _SUBSCHEMA:
            if key in out:
                out[key] = walk(out[key]) if not isinstance(out[key], list) else [walk(x) for x in out[key]]
        for key in _SUBSCHEMA_LISTS:
            if isinstance(out.get(key), list):
                shared = strict and (key == "allOf" or (key in ("anyOf", "oneOf") and lists_props))
                out[key] = [walk(x, shared) for x in out[key]]
        for key in _SUBSCHEMA_MAPS:
            if isinstance(out.get(key), dict):
                out[key] = {name: walk(x) for name, x in out[key].items()}
        combines = strict and (composed or any(isinstance(out.get(k), list) for k in ("allOf", "anyOf", "oneOf")))
        if "additionalProperties" not in out and lists_props and not combines:
            out["additionalProperties"] = False
        if strict and isinstance(out.get("prefixItems"), list) and not any(
                k in out for k in ("items", "additionalItems")):
            out["items"] = False
        return out

    if isinstance(schema, str):
        return json.dumps(walk(json.loads(schema)), ensure_ascii=False)
    return walk(schema)


@dataclass
class GuidedDecodingParams:
    """Structured output (vLLM's `GuidedDecodingParams`): exactly one of `json` (a JSON schema: a dict, a
    boolean (true: any JSON value), its JSON text, or a pydantic model class), `regex`, `choice` (the output
    is one of these strings), `grammar` (Lark, or GBNF as llama.cpp writes it) or `json_object=True` (any
    JSON object). Between JSON tokens any whitespace is allowed, unless `disable_any_whitespace` (none) or
    `whitespace_pattern` (a regex) says otherwise. The grammar is validated here: a ValueError names the field."""

    json: str | dict[str, Any] | bool | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool = False
    whitespace_pattern: str | None = None
    # vLLM's other fields. backend: the grammar engine; loopserve has one, llguidance (vLLM's "guidance"), so
    # None, "auto" and "guidance" are taken and any other name is a ValueError rather than a silent swap.
    # disable_fallback: nothing ever falls back to another engine here, so either value holds.
    # disable_additional_properties: a JSON schema's objects that do not say otherwise admit no properties
    # beyond those they list. That is also what backend None or "auto" does, whatever this says, and tuples
    # (`prefixItems`) that do not say otherwise admit nothing past their items: vLLM's "auto" compiles a schema with
    # xgrammar, whose strict mode closes both (it also closes free-form objects and arrays, `{"type": "object"}`,
    # to `{}` and `[]`: those stay open here); "guidance" keeps llguidance's own rule (open, as vLLM's guidance
    # backend) unless this is set. structural_tag: not supported (a ValueError when set).
    backend: str | None = None
    disable_fallback: bool = False
    disable_additional_properties: bool = False
    structural_tag: str | None = None

    def __post_init__(self) -> None:
        if isinstance(self.json, type) and hasattr(self.json, "model_json_schema"):  # a pydantic model class
            self.json = self.json.model_json_schema()
        if isinstance(self.choice, tuple):
            self.choice = list(self.choice)
        for name in ("json_object", "disable_any_whitespace", "disable_fallback", "disable_additional_properties"):
            v = getattr(self, name)
            if v is not None and not isinstance(v, bool):
                raise ValueError(f"{name}: must be true or false, got {_short(v)}")
        if self.backend not in GRAMMAR_BACKENDS:
            raise ValueError(f"backend: loopserve compiles every grammar with llguidance (vLLM's 'guidance'); "
                             f"expected one of {', '.join(map(str, GRAMMAR_BACKENDS))}, got {_short(self.backend)}")
        if self.structural_tag is not None:
            raise ValueError("structural_tag: not supported (use json, regex, choice, grammar or json_object)")
        given = [n for n in GUIDE_KINDS if getattr(self, n) is not None]
        given += ["json_object"] if self.json_object else []
        if len(given) != 1:
            # (named by vLLM's newer name: GuidedDecodingParams and StructuredOutputsParams are one class here, so which
            # one the caller wrote is unknown; the message says both take it)
            raise ValueError("structured_outputs: exactly one of json, regex, choice, grammar or json_object is needed "
                             f"(in StructuredOutputsParams or GuidedDecodingParams), got {', '.join(given) or 'none'}")
        if self.json is not None:
            _check_schema(self.json)
            if self.disable_additional_properties or self.backend != "guidance":
                self.json = _without_additional_properties(self.json, strict=self.backend != "guidance")
        for name in ("regex", "grammar", "whitespace_pattern"):
            v = getattr(self, name)
            if v is not None and (not isinstance(v, str) or (not v and name != "whitespace_pattern")):
                raise ValueError(f"{name}: must be a non-empty string, got {_short(v)}")
            if v is not None and len(v) > MAX_GRAMMAR_CHARS:
                raise ValueError(f"{name}: at most {MAX_GRAMMAR_CHARS} characters, got {len(v)}")
        if self.disable_any_whitespace and self.whitespace_pattern:  # (one would be ignored)
            raise ValueError(f"whitespace_pattern: {_short(self.whitespace_pattern)} allows whitespace that "
                             "disable_any_whitespace forbids: give one of them")
        if self.choice is not None and (not isinstance(self.choice, list) or not self.choice
                                        or not all(isinstance(c, str) and c for c in self.choice)):
            raise ValueError(f"choice: must be a non-empty list of non-empty strings, got {_short(self.choice)}")
        key = self.key  # (a schema's JSON text, made once)
        if self.json is not None and len(key[1]) > MAX_SCHEMA_CHARS:
            raise ValueError(f"json: at most {MAX_SCHEMA_CHARS} characters as JSON, got {len(key[1])}")
        if self.choice is not None and len(self.choice) > MAX_CHOICES:
            raise ValueError(f"choice: at most {MAX_CHOICES} options, got {len(self.choice)}")
        from loopserve.engine.grammar import grammar_text

        if key[0] == "json" and key[2]:  # (checked alone, so that an error in it is not blamed on the schema)
            try:
                grammar_text("regex", key[2])
            except ValueError as e:
                raise ValueError(f"whitespace_pattern: not a pattern llguidance takes ({str(e).partition(': ')[2]})"
                                 ) from None
        grammar_text(*key)  # compiles (cached) and validates

    @property
    def key(self) -> tuple[str, str, str | None]:
        """(kind, text, JSON whitespace pattern): what the grammar is compiled from, and its cache key."""
        whitespace = "" if self.disable_any_whitespace else self.whitespace_pattern
        if self.json is not None:
            text = self.json if isinstance(self.json, str) else json.dumps(self.json, ensure_ascii=False)
            return "json", text, whitespace
        if self.json_object:
            return "json", '{"type": "object"}', whitespace
        if self.regex is not None:
            return "regex", self.regex, None
        if self.choice is not None:
            return "choice", json.dumps(self.choice, ensure_ascii=False), None
        assert self.grammar is not None
        return "grammar", self.grammar, None


# vLLM's newer name (0.10+) for the same thing: `SamplingParams(structured_outputs=StructuredOutputsParams(...))`
StructuredOutputsParams = GuidedDecodingParams


def check_structured_outputs_keys(spec: dict[str, Any], name: str = "structured_outputs") -> None:
    """ValueError naming the first key of a `structured_outputs` dict (or one given as `name`) that is not a
    GuidedDecodingParams field."""
    known = [f.name for f in fields(GuidedDecodingParams)]
    unknown = [k for k in spec if k not in known]
    if unknown:
        raise ValueError(f"{name}.{unknown[0]}: unknown field (the fields are {', '.join(known)})")


def structured_outputs_params(spec: dict[str, Any], name: str = "structured_outputs") -> GuidedDecodingParams:
    """The grammar of a `structured_outputs` dict (GuidedDecodingParams' fields; or of `guided_decoding`, its older
    name, as `name` says), for `SamplingParams` and the server's requests alike; a ValueError names the key at fault
    (`structured_outputs.choice: ...`)."""
    check_structured_outputs_keys(spec, name)
    try:
        return GuidedDecodingParams(**spec)
    except ValueError as e:
        head, _, rest = str(e).partition(": ")
        where = f"{name}.{head}" if head in spec else name
        raise ValueError(f"{where}: {rest or e}") from None


def given_seed(seed: int | None) -> int | None:
    """A request's seed as vLLM reads it: -1 is no seed (configs that mean "random" by it), as None is."""
    return None if seed == -1 else seed


class RequestOutputKind(enum.IntEnum):
    """When a request's outputs are reported (vLLM's enum and values)."""

    CUMULATIVE = 0  # after every new token, with everything so far
    DELTA = 1  # after every new token, only what is new (O(new) per output: what a stream needs)
    FINAL_ONLY = 2  # once, when the request finishes: no per-token output objects or text decoding


OUTPUT_KINDS = tuple(RequestOutputKind)


@dataclass
class SamplingParams:
    # (current vLLM's first fields, in its order: a call with them as positional arguments means the same; the fields
    # after them are keyword-only, where vLLM's versions differ, so a longer positional call is a TypeError)
    n: int = 1
    # penalties (applied to the raw logits, before temperature and the filters)
    presence_penalty: float = 0.0  # logits -= presence_penalty for every token generated so far
    frequency_penalty: float = 0.0  # logits -= frequency_penalty * (times the token was generated)
    repetition_penalty: float = 1.0  # tokens of the prompt or the output: logit / p if > 0 else logit * p
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    seed: int | None = None  # -1 is taken as None (unseeded), as vLLM takes it (`given_seed`)
    stop: str | list[str] | None = None  # None is taken as [] (as vLLM does)
    stop_token_ids: list[int] = field(default_factory=list)  # None is taken as [] (vLLM types it Optional)
    ignore_eos: bool = False
    max_tokens: int | None = 16
    # eos and stop_token_ids cannot end the request (nor stop strings) before this many tokens; a grammar
    # (guided_decoding) still ends it when complete: a choice "yes" is 1 token whatever min_tokens
    min_tokens: int = 0
    logprobs: int | None = None
    prompt_logprobs: int | None = None  # top logprobs per prompt token (and the token's own), full depth
    _: KW_ONLY
    skip_special_tokens: bool = True
    logit_bias: dict[int, float] | None = None  # token id -> added to its logit
    include_stop_str_in_output: bool = False
    # keep only the last k prompt tokens; -1 (TRUNCATE_TO_CONTEXT): the last max_model_len of them
    truncate_prompt_tokens: int | None = None
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
    # no best-of selection: every sample is returned, so only best_of = n (or unset) means what it says
    best_of: int | None = None
    # only these token ids may be sampled (a mask on the raw logits, before logit_bias and the penalties); a set,
    # kept unique and sorted. A request whose single-token bad words (and, with min_tokens, its stop and eos
    # tokens) cover them is refused at admission
    allowed_token_ids: list[int] | None = None
    # vLLM's rule: each word is tokenized as it is and after a space (its leading spaces stripped), once per
    # request; a word's last token is masked whenever its other tokens end the output so far
    bad_words: list[str] | None = None  # None is taken as [] (as vLLM does)
    # the text is decoded as the tokenizer joins tokens: false is taken only where it changes nothing (no
    # special tokens in the text, skip_special_tokens)
    spaces_between_special_tokens: bool = True
    detokenize: bool = True  # false: token ids only (the text "", logprobs' decoded_token None; no stop strings)
    # kept on the params for the caller's own use and never read here (vLLM hands them to custom logits
    # processors, which this engine does not run)
    extra_args: dict[str, Any] | None = None
    # vLLM's per-request logits processors (callables; vLLM 0.10 and before): loopserve runs none, so only None or
    # an empty list is taken (a ValueError otherwise: running without them would sample from other logits)
    logits_processors: list[Any] | None = None
    # vLLM's newer name for guided_decoding (a StructuredOutputsParams, or a dict of its fields): `grammar_spec`
    structured_outputs: GuidedDecodingParams | dict[str, Any] | None = None
    # vLLM's: logprobs as its flat containers (FlatLogprobs); loopserve returns its default lists of dicts only
    flat_logprobs: bool = False
    # vLLM's: whether the request may start from the prefix cache's blocks; None: not when it asks for prompt_logprobs
    # (the cached positions would have none), else it may (`reads_prefix_cache`)
    skip_reading_prefix_cache: bool | None = None
    # vLLM's hint that its engine may use these params without copying them: loopserve copies a request's params
    # (`LLM._make_sequence`) either way, so it changes nothing
    skip_clone: bool = False
    # set by the engine on a request's own copy (engine/sampler.py `bind`), never by users: the request's
    # tokens, which penalties, min_tokens and bad_words read
    history: TokenHistory | None = field(default=None, repr=False, compare=False)
    # looped-model extensions
    min_loops: int | None = None
    max_loops: int | None = None
    exit_threshold: float | None = None
    exit_policy: str | None = None  # None: the model's own signal (Ouro gate, Huginn latent_diff)
    exit_trace: list[int] | None = None
    # self-speculative decoding (docs/design.md §12): the most tokens this request drafts per round. None:
    # the engine's num_speculative_tokens; 0: it never drafts. Outputs are plain decoding's either way.
    num_speculative_tokens: int | None = None
    # structured output (vLLM's name until 0.10; the server's guided_* and response_format map to it)
    guided_decoding: GuidedDecodingParams | None = None
    # set by the engine on a request's own copy (engine/grammar.py `with_guide`), never by users: the
    # request's live grammar matcher, which the batched sampler reads to mask the row's logits (an init
    # field so that copies made through the constructor keep it)
    guide: Guide | None = field(default=None, repr=False, compare=False)

    def __post_init__(self) -> None:
        def bad(name: str, why: str) -> ValueError:
            return ValueError(f"{name}: {why}, got {_short(getattr(self, name))}")

        given = self.__dict__
        if any(issubclass(t, _NUMPY) for t in set(map(type, given.values()))):  # (every array: now a list)
            for name in _NUMBER_FIELDS:
                given[name] = python_numbers(given[name])
        for name in _NUMBER_LISTS:  # (numpy numbers inside them; `is not None`, never an array's truth value)
            if given[name] is not None:
                given[name] = python_numbers(given[name])
        if not is_int(self.n) or not 1 <= self.n <= MAX_N:
            raise bad("n", f"must be an integer in [1, {MAX_N}]")
        if self.best_of is not None and (not is_int(self.best_of) or self.best_of != self.n):
            raise bad("best_of", f"only best_of = n ({self.n}) or unset is supported (every sample is returned, none "
                                 "is picked by its score)")
        for name in ("ignore_eos", "skip_special_tokens", "include_stop_str_in_output",
                     "spaces_between_special_tokens", "detokenize"):
            if not isinstance(getattr(self, name), bool):  # ("no" is truthy: it would mean true)
                raise bad(name, "must be true or false")
        if self.max_tokens is not None and (not is_int(self.max_tokens) or self.max_tokens < 1):
            raise bad("max_tokens", "must be an integer >= 1")
        if not is_real(self.temperature) or self.temperature < 0:  # (vLLM's bound: a large one samples ~uniformly)
            raise bad("temperature", "must be a finite number >= 0")
        if 0 < self.temperature < MIN_TEMPERATURE:
            log.warning("temperature %s is below %s: raised to %s, as vLLM raises it (0 samples greedily)",
                        self.temperature, MIN_TEMPERATURE, MIN_TEMPERATURE)
            self.temperature = MIN_TEMPERATURE
        if not is_real(self.top_p) or not 0 < self.top_p <= 1:
            raise bad("top_p", "must be in (0, 1]")
        if not is_int(self.top_k) or (self.top_k < 1 and self.top_k not in (0, -1)):
            raise bad("top_k", "must be -1 or 0 (disabled) or >= 1")
        if not is_real(self.min_p) or not 0 <= self.min_p <= 1:
            raise bad("min_p", "must be in [0, 1]")
        if self.seed is not None and (not is_int(self.seed) or not SEED_MIN <= self.seed <= SEED_MAX):
            raise bad("seed", "must be a 64-bit integer")
        if self.logits_processors not in (None, [], ()):
            raise ValueError("logits_processors: not supported by loopserve (it runs no per-request logits "
                             "processors: use logit_bias, allowed_token_ids, bad_words or structured outputs); it "
                             f"takes None or [], got {_short(self.logits_processors)}")
        for name in ("flat_logprobs", "skip_clone"):
            if not isinstance(getattr(self, name), bool):
                raise bad(name, "must be true or false")
        if self.flat_logprobs:
            raise ValueError("flat_logprobs: not supported by loopserve (logprobs come back as vLLM's default lists "
                             "of dicts, Logprob by token id); it takes False, got True")
        if not (self.skip_reading_prefix_cache is None or isinstance(self.skip_reading_prefix_cache, bool)):
            raise bad("skip_reading_prefix_cache", "must be true, false or None")
        if self.skip_reading_prefix_cache is False and self.prompt_logprobs is not None:
            # (vLLM would return no logprobs for the prompt tokens read from the cache)
            raise ValueError("skip_reading_prefix_cache: False reads the prefix cache, whose tokens would get no "
                             "prompt_logprobs; with prompt_logprobs it takes True or None")
        self.seed = given_seed(self.seed)
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if isinstance(self.stop, tuple):
            self.stop = list(self.stop)
        if self.stop is None:
            self.stop = []
        if isinstance(self.stop_token_ids, tuple):
            self.stop_token_ids = list(self.stop_token_ids)
        if self.stop_token_ids is None:
            self.stop_token_ids = []
        if not isinstance(self.stop, list) or not all(isinstance(s, str) and s for s in self.stop):
            raise bad("stop", "must be a non-empty string or a list of them")
        if len(self.stop) > MAX_STOP:
            raise ValueError(f"stop: at most {MAX_STOP} stop strings, got {len(self.stop)}")
        if not isinstance(self.stop_token_ids, list) or not all(is_int(t) and t >= 0 for t in self.stop_token_ids):
            raise bad("stop_token_ids", "must be non-negative integers")
        if not self.detokenize and self.stop:
            raise bad("detokenize", "must be true with stop strings (they are matched in the text)")
        if isinstance(self.allowed_token_ids, tuple):
            self.allowed_token_ids = list(self.allowed_token_ids)
        allowed = self.allowed_token_ids
        if allowed is not None:
            if not isinstance(allowed, list) or not allowed or not all_ints(allowed) or min(allowed) < 0:
                raise bad("allowed_token_ids", "must be a non-empty list of token ids (integers >= 0)")
            # a set: unique and sorted once, here (duplicates mean nothing; a long list of them is not kept)
            unique = sorted(set(allowed))
            if len(unique) != len(allowed) or unique != allowed:
                self.allowed_token_ids = unique
        if isinstance(self.bad_words, tuple):
            self.bad_words = list(self.bad_words)
        if self.bad_words is None:
            self.bad_words = []
        if not isinstance(self.bad_words, list) or not all(isinstance(w, str) and w.strip() for w in self.bad_words):
            raise bad("bad_words", "must be a list of strings, none empty or all whitespace")
        if len(self.bad_words) > MAX_STOP:  # (matched after every token, as stop is)
            raise ValueError(f"bad_words: at most {MAX_STOP} words, got {len(self.bad_words)}")
        if self.extra_args is not None and not isinstance(self.extra_args, dict):
            raise bad("extra_args", "must be a dict")
        # penalties and logit adjustments
        for name in ("presence_penalty", "frequency_penalty"):
            if not is_real(getattr(self, name)) or not -2 <= getattr(self, name) <= 2:
                raise bad(name, "must be in [-2, 2]")
        if not is_real(self.repetition_penalty) or self.repetition_penalty < MIN_REPETITION_PENALTY:
            raise bad("repetition_penalty", f"must be a finite number >= {MIN_REPETITION_PENALTY:g} (> 0, and not so "
                                            f"small that dividing a logit by it overflows)")
        if self.logit_bias is not None:
            if not isinstance(self.logit_bias, dict):
                raise bad("logit_bias", "must map token ids to biases")
            bias = {}
            for k, v in self.logit_bias.items():  # JSON object keys are strings: "50256" is token 50256
                # (at most 19 digits: int64; Python refuses to convert more than 4,300 with a message naming no field)
                tid = int(k) if isinstance(k, str) and k.isascii() and k.isdigit() and len(k) <= 19 else k
                if not is_int(tid) or tid < 0:
                    raise ValueError(f"logit_bias: keys must be token ids (integers >= 0), got {_short(k)}")
                # (any number, as vLLM's offline params take it; -inf bans the token; NaN and +inf would leave no
                # finite distribution; the server clamps into [-100, 100], as vLLM's: `clamped_bias`)
                if not (is_real(v) or (is_number(v) and v == -math.inf)):
                    raise ValueError(f"logit_bias: the bias of token {tid} must be a number or -inf, got {_short(v)}")
                bias[tid] = float(v)
            self.logit_bias = bias
        if not is_int(self.min_tokens) or self.min_tokens < 0:
            raise bad("min_tokens", "must be an integer >= 0")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise bad("min_tokens", f"must be <= max_tokens ({self.max_tokens})")
        if self.truncate_prompt_tokens is not None and not truncates_prompt(self.truncate_prompt_tokens):
            raise bad("truncate_prompt_tokens",
                      "must be an integer >= 1, or -1 (the last tokens the context holds beside the completion)")
        if not is_int(self.output_kind) or self.output_kind not in OUTPUT_KINDS:
            raise bad("output_kind", f"must be one of {', '.join(f'RequestOutputKind.{k.name}' for k in OUTPUT_KINDS)}")
        self.output_kind = RequestOutputKind(self.output_kind)
        for name in ("logprobs", "prompt_logprobs"):  # (the engine holds them to its max_logprobs)
            if getattr(self, name) is True:  # (vLLM's: True asks for the sampled token's, as 1 does)
                setattr(self, name, 1)
            check_logprobs_count(name, getattr(self, name))
        for name in ("min_loops", "max_loops"):
            v = getattr(self, name)
            if v is not None and (not is_int(v) or v < 1):
                raise bad(name, "must be an integer >= 1")
        if self.min_loops and self.max_loops and self.min_loops > self.max_loops:
            raise bad("min_loops", f"must be <= max_loops ({self.max_loops})")
        if self.exit_threshold is not None and (not is_real(self.exit_threshold) or self.exit_threshold < 0):
            raise bad("exit_threshold", "must be a finite number >= 0")
        if self.exit_policy is not None and self.exit_policy not in POLICIES:
            raise bad("exit_policy", f"must be one of {', '.join(POLICIES)}")
        if isinstance(self.exit_trace, tuple):
            self.exit_trace = list(self.exit_trace)
        trace = self.exit_trace
        if trace is not None:  # (the bound by min, at C speed, as allowed_token_ids')
            if not isinstance(trace, list) or not all_ints(trace) or min(trace, default=1) < 1:
                raise bad("exit_trace", "must be a list of integers >= 1")
            if len(trace) > MAX_EXIT_TRACE:
                raise ValueError(f"exit_trace: at most {MAX_EXIT_TRACE} depths (one per generated token), got "
                                 f"{len(trace)}")
            if self.exit_policy not in (None, "trace"):
                raise bad("exit_policy", "must be 'trace' (or unset) when exit_trace is given")
            self.exit_policy = "trace"
        if self.exit_policy == "trace" and self.exit_trace is None:  # else it would run at full depth unsaid
            raise bad("exit_trace", "needed with exit_policy 'trace' (the exit depths to replay)")
        if self.exit_policy in ("fixed", "trace") and self.exit_threshold is not None:  # (not silently ignored)
            raise bad("exit_threshold", f"exit_policy {self.exit_policy!r} compares no signal with a threshold: "
                                        "leave it unset")
        if self.exit_policy in GATE_POLICIES and self.exit_threshold is not None and not 0 < self.exit_threshold <= 1:
            raise bad("exit_threshold", "a gate threshold is a probability in (0, 1]")
        if self.num_speculative_tokens is not None and (not is_int(self.num_speculative_tokens)
                                                        or self.num_speculative_tokens < 0):
            raise bad("num_speculative_tokens", "must be an integer >= 0")
        for name in ("structured_outputs", "guided_decoding"):  # (a dict of its fields, under either name)
            if isinstance(getattr(self, name), dict):
                setattr(self, name, structured_outputs_params(getattr(self, name), name))
        if self.structured_outputs is not None:
            if not isinstance(self.structured_outputs, GuidedDecodingParams):
                raise bad("structured_outputs", "must be a StructuredOutputsParams or a dict of its fields")
            if self.guided_decoding is not None and self.guided_decoding != self.structured_outputs:
                raise ValueError("structured_outputs: give it or guided_decoding (vLLM's newer and older names for "
                                 "one thing), not both")
        if self.guided_decoding is not None and not isinstance(self.guided_decoding, GuidedDecodingParams):
            raise bad("guided_decoding", "must be a GuidedDecodingParams or a dict of its fields")

    @property
    def grammar_spec(self) -> GuidedDecodingParams | None:
        """The structured output asked for: `structured_outputs`, else `guided_decoding` (vLLM's newer and older
        names), read as the request is made, so that a script may set or clear either on its params after
        construction, as on vLLM's (a copy of one into the other had kept a cleared grammar, and refused a new one
        as given under both names)."""
        spec = self.structured_outputs if self.structured_outputs is not None else self.guided_decoding
        if isinstance(spec, dict):  # (a dict set after construction, as the constructor takes one)
            spec = structured_outputs_params(spec, self.grammar_field)
        if spec is not None and not isinstance(spec, GuidedDecodingParams):
            raise ValueError(f"{self.grammar_field}: must be a StructuredOutputsParams or a dict of its fields, got "
                             f"{_short(spec)}")
        return spec

    @property
    def grammar_field(self) -> str:
        """The field `grammar_spec` is read from, as errors name it."""
        return "structured_outputs" if self.structured_outputs is not None else "guided_decoding"

    @staticmethod
    def from_optional(**kwargs: Any) -> SamplingParams:
        """vLLM's: the params of keywords an API request may leave unset (None), each of those at its default
        (`max_tokens` None stays None: no limit, as there); `logit_bias`'s biases clamped into [-100, 100], as vLLM
        clamps them. An unknown keyword is a TypeError naming it."""
        unknown = set(kwargs) - {f.name for f in fields(SamplingParams)}
        if unknown:
            raise TypeError(f"SamplingParams.from_optional: unexpected keyword {sorted(unknown)[0]!r}")
        given = {k: v for k, v in kwargs.items() if v is not None or k == "max_tokens"}
        if "logit_bias" in given:
            given["logit_bias"] = clamped_bias(given["logit_bias"])
        return SamplingParams(**given)

    def clone(self) -> SamplingParams:
        """A deep copy (vLLM's `clone`): its lists and dicts are its own. What the engine sets on a request's
        copy (`history`, `guide`) is not copied: a clone is a new request's params."""
        return copy.deepcopy(self, {id(self.history): None, id(self.guide): None})

    @property
    def penalized(self) -> bool:
        """Whether sampling depends on the tokens so far (presence, frequency or repetition penalty)."""
        return self.presence_penalty != 0 or self.frequency_penalty != 0 or self.repetition_penalty != 1

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def reads_prefix_cache(self) -> bool:
        """Whether the request may start from blocks the prefix cache holds (`skip_reading_prefix_cache`, vLLM's
        rule where it is None: not with prompt_logprobs, whose cached positions would get none)."""
        skip = self.skip_reading_prefix_cache
        return not (self.prompt_logprobs is not None if skip is None else skip)


def clamped_bias(bias: Any) -> Any:
    """A request's `logit_bias` with its biases clamped into [-100, 100], as vLLM's API requests clamp them
    (`from_optional`, and the server's requests); anything else as it is, for SamplingParams' checks to name."""
    if not isinstance(bias, dict):
        return bias
    return {k: min(100.0, max(-100.0, v)) if is_number(v) and not math.isnan(v) else v for k, v in bias.items()}


# the fields a user sets to numbers, or lists or dicts of them (`python_numbers` reads them before the checks)
_NUMPY = np.generic | np.ndarray
_NUMBER_LISTS = ("stop_token_ids", "allowed_token_ids", "exit_trace", "logit_bias")
_NUMBER_FIELDS = tuple(f.name for f in fields(SamplingParams)
                       if f.name not in ("stop", "bad_words", "extra_args", "logits_processors", "structured_outputs",
                                         "history",
                                         "exit_policy", "guided_decoding", "guide"))


@dataclass
class BeamSearchParams:
    """vLLM's `BeamSearchParams` (`vllm.sampling_params`: its fields, order and defaults), for `LLM.beam_search`
    (loopserve/beam_search.py). `beam_width`: beams kept per prompt, and sequences returned; `max_tokens`: the most
    tokens a beam generates; `ignore_eos`: no end-of-sequence token completes a beam; `temperature`: which token each
    step samples (an extra candidate); `length_penalty`: the score's exponent of the length.
    `include_stop_str_in_output`: taken, and changes nothing offline, as in vLLM (a beam's text is its whole
    sequence decoded, end-of-sequence token included). A ValueError names the field at fault."""

    beam_width: int
    max_tokens: int
    ignore_eos: bool = False
    temperature: float = 0.0
    length_penalty: float = 1.0
    include_stop_str_in_output: bool = False

    def __post_init__(self) -> None:
        check_beam_search_params(self)


def check_beam_search_params(params: BeamSearchParams) -> None:
    """ValueError naming the first field of `params` that beam search cannot run with."""
    def bad(name: str, why: str) -> ValueError:
        return ValueError(f"{name}: {why}, got {_short(getattr(params, name))}")

    if not is_int(params.beam_width) or params.beam_width < 1:
        raise bad("beam_width", "must be an integer >= 1")
    if params.beam_width > MAX_N:  # (the engine's max_logprobs holds it lower: `check_beam_width`)
        raise bad("beam_width", f"must be at most {MAX_N}")
    if not is_int(params.max_tokens) or params.max_tokens < 1:
        raise bad("max_tokens", "must be an integer >= 1")
    for name in ("ignore_eos", "include_stop_str_in_output"):
        if not isinstance(getattr(params, name), bool):
            raise bad(name, "must be true or false")
    if not is_real(params.temperature) or params.temperature < 0:
        raise bad("temperature", "must be a finite number >= 0")  # (SamplingParams' range: each step samples with it)
    if not is_real(params.length_penalty):
        raise bad("length_penalty", "must be a finite number")
