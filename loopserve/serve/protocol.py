"""Request bodies of the OpenAI-compatible API (and of vLLM's /tokenize and /detokenize), and
OpenAI-style errors.

Unknown-field policy (vLLM's): a field this server does not know, at any depth of the body, is
accepted and ignored; `unknown_fields` lists them so that the server can log a warning naming each.
Known fields:

- types are read as vLLM reads them (pydantic's lax mode: 4.0, "4" and true for 4, "true" and 1 for true; not 4.5,
  "four" or 2, and no NaN or infinity), and a wrong one is a 400 that names the field's full path (`param`); ranges
  are checked by `SamplingParams` (one place for both the offline and the HTTP API);
- known OpenAI fields that do not change the output (`user`, `metadata`, `store`, `service_tier`,
  `parallel_tool_calls`) are accepted and ignored;
- known fields whose feature is not implemented (`best_of`, `suffix`, vLLM's `priority`,
  `logits_processors`, `prompt_embeds`, `mm_processor_kwargs`, `kv_transfer_params` and `vllm_xargs`) are
  accepted only at their neutral value (n, empty, 0, none); anything else is a 400 saying it is not supported.

vLLM's `use_beam_search: true` runs a beam search (loopserve/beam_search.py, `OpenAIServing.beam_search`) of
width `n` (half the server's --max-logprobs at most: a step asks for the top 2 * n logprobs), with `max_tokens`,
`temperature`, `ignore_eos`, `length_penalty` (refused other than 1 without beam search, which alone uses it) and
`include_stop_str_in_output`. A field it cannot honour is refused with a 400 naming it unless it is at a value
that asks for nothing (`_SamplingFields.beam_search_conflicts`): sampling filters, penalties and token
restrictions, stop strings and stop tokens, prompt logprobs, the looped-model depth fields, `best_of` other than n,
and (checked where the grammar is read, serve/api.py) structured output and forced tool calls. (Empty token
restrictions, and `exit_policy: "fixed"`, `max_loops` r_max and `min_loops` 1, what the search does anyway, ask for
nothing: all are checked where the model's r_max is known, serve/api.py `build`.) `logprobs` (chat's with
`top_logprobs`) are the beams' own, as vLLM returns them (not with completions' `echo`: the prompt's would be prompt
logprobs).

Structured output (`response_format`, vLLM's `guided_*` and `structured_outputs`) and tool calls
(`tools`, `tool_choice`) are read by `serve/structured.py`. The Responses API's body, which becomes a chat request, is
`serve/responses_api.py`'s.
"""

from __future__ import annotations

import functools
import json
import re
from types import UnionType
from typing import Annotated, Any, Literal, Union, get_args, get_origin

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, ValidationError, field_validator, model_validator
from pydantic_core import PydanticCustomError

from loopserve.chat_messages import REFUSAL_PART, TEXT_PARTS, other_part
from loopserve.sampling_params import (
    EXIT_FIELDS,
    GuidedDecodingParams,
    RequestOutputKind,
    SamplingParams,
    clamped_bias,
)
from loopserve.tokenizer import template_switches, template_variables, unicode_problem


class ApiError(Exception):
    """An error the client gets as an OpenAI-style body: {"error": {message, type, param, code}}."""

    TYPES = {400: "BadRequestError", 401: "AuthenticationError", 404: "NotFoundError", 405: "MethodNotAllowed",
             408: "RequestTimeoutError", 413: "RequestTooLargeError", 415: "UnsupportedMediaTypeError",
             500: "InternalServerError", 503: "ServiceUnavailableError"}

    def __init__(self, status: int, message: str, param: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.headers = status, message, param, headers

    @classmethod
    def bad_request(cls, error: ValueError | str, prompt_field: str | None = None,
                    grammar_field: str | None = None) -> ApiError:
        """A 400 for a ValueError (or an engine's error message) that names the field at fault first ("max_tokens:
        ...", "messages.0.role: ..."), its `param` that field as the request named it (`request_field`); a message
        naming the prompt or the grammar as the engine does names it so too ("prompt.1: ...", "guided_regex: ...")."""
        message = str(error)
        head, param = _field_of(message), request_field(message, prompt_field, grammar_field)
        if head is not None and head in PROMPT_NAMES + GRAMMAR_NAMES and param != head:  # as the request named it
            message = f"{param}{message[len(head):]}"  # "prompt.1: ...", "messages: ...", "response_format: ..."
        return cls(400, message, param)

    def body(self) -> dict[str, Any]:
        return error_body(self.status, self.message, self.param)


MAX_REQUEST_ID = 128  # characters of a request id (it ends up in logs, response ids and the X-Request-Id header)


def usable_request_id(rid: str) -> bool:
    """Whether a client's request id (the X-Request-Id header's, or the body's `request_id`) can name its request:
    1 to MAX_REQUEST_ID visible ASCII characters, as it is logged and sent back in a header."""
    return 0 < len(rid) <= MAX_REQUEST_ID and all("!" <= c <= "~" for c in rid)


def check_request_id(rid: str | None) -> None:
    """A body's `request_id`, which names the response and goes back in the X-Request-Id header: a 400 naming it
    unless `usable_request_id`."""
    if rid is not None and not usable_request_id(rid):
        raise ApiError(400, f"request_id: must be 1 to {MAX_REQUEST_ID} visible ASCII characters (it is sent back "
                            "in the X-Request-Id header)", "request_id")


SHUTTING_DOWN = "the server is shutting down"  # what a request refused or ended by a graceful shutdown is told
SHUTDOWN_RETRY_AFTER_S = 5  # its Retry-After: another replica, or this server restarted, may take it by then


def error_body(status: int, message: str, param: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": ApiError.TYPES.get(status, "Error"), "param": param,
                      "code": status}}


_INTEGER = TypeAdapter(int)


def _lax_integer(x: Any) -> bool:
    """Whether the bodies' lax reading takes `x` as an integer (true, 2.0, "2", "1_000"): pydantic's own rule, asked."""
    if type(x) is int:
        return True
    try:
        _INTEGER.validate_python(x)
    except ValidationError:
        return False
    return True


class _Body(BaseModel):
    # extra="allow": unknown fields are kept aside (`model_extra`) for `unknown_fields` to report; lax types, as
    # vLLM's (a client's 512.0 for max_tokens, computed in floats, was a 400 when they were strict)
    model_config = ConfigDict(extra="allow", allow_inf_nan=False)


def unknown_fields(obj: Any, prefix: str = "") -> list[str]:
    """Full paths (`temprature`, `messages.0.reasoning_content`) of the unknown fields a parsed body carried.
    Only fields that may hold a model are walked (`_nesting_fields`): a list of 2M token ids took 0.8 s of the
    event loop, every stream's chunks waiting behind it."""
    if isinstance(obj, BaseModel):
        out = [prefix + k for k in obj.model_extra or {}]
        for name in _nesting_fields(type(obj)):
            out += unknown_fields(getattr(obj, name), f"{prefix}{name}.")
        return out
    if isinstance(obj, list):
        return [p for i, v in enumerate(obj) for p in unknown_fields(v, f"{prefix}{i}.")]
    return []


@functools.cache
def _nesting_fields(cls: type[BaseModel]) -> tuple[str, ...]:
    """The fields of `cls` whose type names a model, alone or inside lists and unions."""
    return tuple(name for name, f in cls.model_fields.items() if _names_a_model(f.annotation))


def _names_a_model(annotation: Any) -> bool:
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return True
    return any(_names_a_model(a) for a in get_args(annotation))


class StreamOptions(_Body):
    # vLLM's default: a stream_options object asks for the final usage chunk unless it says otherwise (`{}`, or only
    # continuous_usage_stats, gets usage); a stream without stream_options gets none
    include_usage: bool | None = True
    continuous_usage_stats: bool | None = False


class JsonSchemaFormat(_Body):
    name: str
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Body):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


# a chat request's `reasoning_effort`: the values vLLM's ChatCompletionRequest takes (OpenAI's, and "max")
REASONING_EFFORTS = ("none", "minimal", "low", "medium", "high", "xhigh", "max")

# vLLM's request fields for what this server has no counterpart of -> why; a request may send them empty
NEUTRAL_FIELDS = {
    "mm_processor_kwargs": "it takes no multimodal inputs",
    "kv_transfer_params": "it runs no disaggregated prefill",
    "vllm_xargs": "it loads no custom logits processors to read them",
}


class _SamplingFields(_Body):
    model: str | None = None
    max_tokens: int | None = None
    n: int | None = 1
    # unset sampling fields (these, the adjustments and the exit fields): the server's defaults (`fill_defaults`)
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    seed: int | None = Field(None, ge=-(2**63), le=2**63 - 1)  # int64, as vLLM's server (`LLM` takes unsigned too)
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool | None = False
    skip_special_tokens: bool | None = True
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    return_token_ids: bool | None = False  # vLLM extension: choices[].token_ids, prompt_token_ids
    # looped-model extensions
    min_loops: int | None = None
    max_loops: int | None = None
    exit_threshold: float | None = None
    exit_policy: str | None = None
    exit_trace: list[int] | None = None  # per-token exit depths to replay (benchmarks)
    num_speculative_tokens: int | None = None  # drafts per round at most (0: none); unset: the server's
    # structured output (serve/structured.py): at most one of these
    response_format: ResponseFormat | None = None
    # a JSON schema (an object or a boolean) or its JSON text: any value is taken here and checked by
    # GuidedDecodingParams, whose one message says what it takes (a union's error names one member's type)
    guided_json: Any = Field(None, json_schema_extra={"anyOf": [
        {"type": "object"}, {"type": "boolean"}, {"type": "string"}, {"type": "null"}]})
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    guided_whitespace_pattern: str | None = None
    structured_outputs: dict[str, Any] | None = None
    # known, output-neutral: ignored
    user: str | None = None
    metadata: dict[str, Any] | None = None
    store: bool | None = None
    service_tier: str | None = None
    # penalties and logit adjustments (OpenAI's, and vLLM's extensions); unset: the server's, else SamplingParams'
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    repetition_penalty: float | None = None  # unset: the model's generation_config.json, else 1
    logit_bias: dict[str, float] | None = None  # token id (a JSON key) -> bias
    min_tokens: int | None = None
    include_stop_str_in_output: bool | None = None
    truncate_prompt_tokens: int | None = None
    prompt_logprobs: int | None = None  # vLLM extension: logprobs of the prompt tokens (full depth)
    allowed_token_ids: list[int] | None = None  # vLLM extensions: only these may be sampled; words never generated
    bad_words: list[str] | None = None
    # vLLM's beam search (width n; `beam_search_conflicts`: what it refuses); length_penalty scores its beams
    use_beam_search: bool | None = None
    length_penalty: float | None = None
    # vLLM extensions: logprobs' tokens written "token_id:<id>" (unset: the server's --return-tokens-as-token-ids);
    # the response's id when no X-Request-Id header names one; a salt of the prompt's prefix-cache keys (requests
    # share cached blocks only with requests of the same salt, or none); only at the values that ask for nothing
    # this server lacks: `priority` 0 (no priority scheduling) and no `logits_processors` (no custom code is loaded)
    return_tokens_as_token_ids: bool | None = None
    request_id: str | None = None
    cache_salt: str | None = None
    priority: int | None = None
    logits_processors: list[Any] | None = None
    # vLLM's fields for what this server lacks: taken empty only (`NEUTRAL_FIELDS`); they used to be ignored
    mm_processor_kwargs: dict[str, Any] | None = None
    kv_transfer_params: dict[str, Any] | None = None
    vllm_xargs: dict[str, Any] | None = None
    spaces_between_special_tokens: bool | None = True  # vLLM's: SamplingParams' field

    def check_unsupported(self) -> None:
        for name, why in NEUTRAL_FIELDS.items():
            if getattr(self, name):
                raise ApiError(400, f"{name}: not supported by this server ({why}); only null or {{}} is taken", name)
        if self.stream_options is not None and self.stream_options.model_fields_set and not self.stream:
            # (an empty {} asks for nothing: vLLM takes it, as clients that always send defaults do)
            raise ApiError(400, "stream_options: only allowed with stream=true", "stream_options")
        if self.priority:
            raise ApiError(400, f"priority: this server does not run priority scheduling (vLLM refuses a priority "
                                f"unless started with --scheduling-policy priority); only 0 is taken, got "
                                f"{self.priority}", "priority")
        if self.logits_processors:
            raise ApiError(400, "logits_processors: this server loads no custom logits processors (vLLM runs only "
                                "those it was started with); only an empty list is taken", "logits_processors")
        check_request_id(self.request_id)
        if not self.use_beam_search and self.length_penalty is not None and self.length_penalty != 1:
            raise ApiError(400, f"length_penalty: only 1 is taken without use_beam_search (it scores beams), got "
                                f"{self.length_penalty}", "length_penalty")

    def check_beam_search(self, r_max: int) -> None:
        """A beam search's fields, on a model of `r_max` loops: `n` (the beam width) at least 1 (the server's
        --max-logprobs bounds it: a step asks for the top 2 * n logprobs), and none of `beam_search_conflicts` set to
        a value that asks for something (400 naming the field)."""
        n = 1 if self.n is None else self.n
        if n < 1:
            raise ApiError(400, f"n: the beam width with use_beam_search must be an integer >= 1, got {n}", "n")
        for name, (neutral, why) in self.beam_search_conflicts(r_max).items():
            value = getattr(self, name)
            if value is not None and value not in neutral:  # (read already: "1" and true are 1 here)
                raise ApiError(400, f"{name}: cannot be combined with use_beam_search ({why}); got "
                                    f"{json.dumps(value)[:80]}", name)

    def beam_search_conflicts(self, r_max: int) -> dict[str, tuple[tuple[Any, ...], str]]:
        """The fields a beam search cannot honour: field -> (the values that ask for nothing, besides unset; why).
        It runs every token at full depth, `r_max` loops: the depth fields ask for nothing at the values that
        describe that (max_loops r_max, min_loops 1, exit_policy fixed)."""
        ranks = "a beam search ranks the model's own top 2 * n tokens"
        depth = "a beam search runs every token at full depth, as a prompt token"
        return {
            "top_p": ((1.0,), ranks), "top_k": ((-1, 0), ranks), "min_p": ((0.0,), ranks),
            "frequency_penalty": ((0.0,), ranks), "presence_penalty": ((0.0,), ranks),
            "repetition_penalty": ((1.0,), ranks), "logit_bias": (({},), ranks), "min_tokens": ((0,), ranks),
            "allowed_token_ids": (([],), ranks), "bad_words": (([],), ranks),
            "stop": (("", []), "a beam ends only on an end-of-sequence token or at max_tokens"),
            "stop_token_ids": (([],), "a beam ends only on an end-of-sequence token or at max_tokens"),
            "prompt_logprobs": ((), "a beam search computes no prompt logprobs"),
            "min_loops": ((1,), depth), "max_loops": ((r_max,), depth), "exit_threshold": ((), depth),
            "exit_policy": (("fixed",), depth), "exit_trace": ((), depth), "num_speculative_tokens": ((0,), depth),
        }

    @property
    def streaming(self) -> bool:
        return bool(self.stream)

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    @property
    def continuous_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.continuous_usage_stats)


class CompletionRequest(_SamplingFields):
    # (token ids first: pydantic tries the members in order and collects an error per element of a member that
    # fails, so a 500k-id prompt took 250 ms to parse behind str | list[str], 43 ms in this order)
    prompt: list[int] | list[list[int]] | str | list[str]

    @field_validator("prompt", mode="before")
    @classmethod
    def _items_of_one_kind(cls, value: Any) -> Any:
        """A list prompt whose first item is a token id, a text or a list of ids, and a later item of another type: one
        error naming that item (`LIST_ITEM`), before the union's members each report every item they fail on (300k
        token ids and a string made 600k errors, 11 s of the event loop). Among token ids, what the lax reading takes
        as an integer (`_lax_integer`) is left to pydantic, which reads it so."""
        if isinstance(value, list) and value and len(set(map(type, value))) > 1:
            kind = int if isinstance(value[0], float) else type(value[0])  # (bool is an int)
            expected = {int: "integer", str: "string", list: "array"}.get(kind)
            fits = _lax_integer if kind is int else (lambda x: type(x) is kind)
            index = next((i for i, x in enumerate(value) if not fits(x)), None)
            if expected is not None and index is not None:
                raise PydanticCustomError(LIST_ITEM, "Input should be a valid {expected}",
                                          {"index": index, "expected": expected})
        return value
    logprobs: int | None = None
    echo: bool | None = False
    add_special_tokens: bool | None = True  # vLLM extension: a text prompt tokenized with the special tokens (BOS)
    suffix: str | None = None
    best_of: int | None = None  # SamplingParams' rule: unset or n
    prompt_embeds: Any = None  # vLLM's (base64 tensors), only when started with --enable-prompt-embeds: refused

    @model_validator(mode="before")
    @classmethod
    def _no_prompt_embeds(cls, data: Any) -> Any:
        """`prompt_embeds` refused before the fields are read: vLLM's request sends them without a `prompt`, which
        would otherwise be reported missing."""
        if isinstance(data, dict) and data.get("prompt_embeds") is not None:
            raise ApiError(400, "prompt_embeds: not supported by this server (vLLM takes them only when started with "
                                "--enable-prompt-embeds); give the prompt as text or token ids", "prompt_embeds")
        return data

    def check_unsupported(self) -> None:
        super().check_unsupported()
        if self.suffix:
            raise ApiError(400, "suffix: not supported by this server", "suffix")

    def beam_search_conflicts(self, r_max: int) -> dict[str, tuple[tuple[Any, ...], str]]:
        return {**super().beam_search_conflicts(r_max),
                "best_of": ((1 if self.n is None else self.n,), "a beam search returns its n best beams")}


class TextPart(_Body):
    type: Literal[TEXT_PARTS]  # type: ignore[valid-type]
    text: str


class RefusalPart(_Body):
    """An assistant's refusal, as an OpenAI conversation replays it: read as its text (vLLM's reading)."""

    type: Literal[REFUSAL_PART]  # type: ignore[valid-type]
    refusal: str


class ToolCallFunction(_Body):
    name: str
    # OpenAI sends the JSON text; an object is taken too, as LLM.chat takes a dict (chat_messages.py)
    arguments: str | dict[str, Any]


class ToolCall(_Body):
    """An earlier assistant turn's call. Some clients leave out `id` and `type`."""

    id: str | None = None
    type: Literal["function"] | None = None
    function: ToolCallFunction


def text_parts_only(value: Any) -> Any:
    """A message content's validator (mode "before"): a part of another type than text's (an image, audio, a file)
    is one error naming its type (`OTHER_PART`, `chat_messages.other_part`'s words), before the union's members each
    say what they wanted instead."""
    if isinstance(value, list):
        for j, part in enumerate(value):
            why = other_part(part)
            if why is not None:
                raise PydanticCustomError(OTHER_PART, "{why}", {"index": j, "why": why})
    return value


class ChatMessage(_Body):
    """Types only: which messages a conversation may hold (a non-empty role, content as text, tool calls only from
    the assistant, arguments a JSON object) is `chat_messages`'s rule, shared with `LLM.chat`."""

    role: str  # OpenAI's system, developer, user, assistant or tool, or one of the chat template's own (vLLM's)
    content: str | list[TextPart | RefusalPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None

    _text_parts_only = field_validator("content", mode="before")(text_parts_only)


class FunctionDefinition(_Body):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ChatTool(_Body):
    type: Literal["function"] = "function"  # (vLLM's default: clients that leave it out)
    function: FunctionDefinition


class FunctionName(_Body):
    name: str


class NamedToolChoice(_Body):
    type: Literal["function"] = "function"  # (vLLM's default)
    function: FunctionName


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage]
    max_completion_tokens: int | None = None
    logprobs: bool | None = False
    top_logprobs: int | None = None
    add_generation_prompt: bool | None = True
    tools: list[ChatTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    # checked as vLLM types it; the model has no reasoning mode, so only the chat template may read it
    # (`template_kwargs`)
    reasoning_effort: Literal[REASONING_EFFORTS] | None = None  # type: ignore[valid-type]
    chat_template_kwargs: dict[str, Any] | None = None  # vLLM extension: extra variables for the chat template
    # vLLM extension: false drops the reasoning the server's --reasoning-parser splits off (nothing without one)
    include_reasoning: bool | None = True
    documents: list[dict[str, Any]] | None = None  # vLLM extension: the template's `documents` (retrieval templates)
    # vLLM extensions: the prompt ends with the final (assistant) message left open; the rendered prompt tokenized
    # with the special tokens added; the final assistant message's text first in the reply; refused (below)
    continue_final_message: bool | None = False
    add_special_tokens: bool | None = False
    echo: bool | None = False
    chat_template: str | None = None

    def template_kwargs(self) -> dict[str, Any] | None:
        """The chat template's extra variables: `chat_template_kwargs`, with what vLLM adds from the request's
        `reasoning_effort` when it is set: the value itself (over the kwargs' own), and `enable_thinking` (false for
        "none") unless the kwargs set it, for templates that think only when asked to."""
        if self.reasoning_effort is None:
            return self.chat_template_kwargs
        kwargs = {**(self.chat_template_kwargs or {}), "reasoning_effort": self.reasoning_effort}
        kwargs.setdefault("enable_thinking", self.reasoning_effort != "none")
        return kwargs

    def check_unsupported(self) -> None:
        super().check_unsupported()
        check_rendering(self)
        if self.top_logprobs and not self.logprobs:  # (0 asks for nothing: vLLM takes it without logprobs)
            raise ApiError(400, "top_logprobs: needs logprobs=true", "top_logprobs")
        if self.top_logprobs is not None and self.top_logprobs < -1:  # (the server holds it to its --max-logprobs)
            raise ApiError(400, f"top_logprobs: must be an integer >= 0, or -1 (the whole vocabulary), got "
                                f"{self.top_logprobs}", "top_logprobs")
        if not self.messages:
            raise ApiError(400, "messages: must not be empty", "messages")


def check_rendering(req: ChatCompletionRequest | TokenizeChatRequest) -> None:
    """The chat template fields of a chat or /tokenize body: no template of the client's (the `chat_template`
    field, as vLLM refuses one unless started with --trust-request-chat-template: it would run on the event loop, a
    sandboxed one, but nested loops can still spin for minutes), and `chat_template_kwargs` as LLM.chat takes them
    (`template_variables`: none that the request sets by a field of its own, `chat_template` among them, but the
    switches add_generation_prompt and continue_final_message, which win over the request's fields, as in vLLM).
    `continue_final_message`'s rules are the tokenizer's, checked when the request is rendered."""
    kwargs = req.chat_template_kwargs
    try:
        template_variables(kwargs)
        for name, value in template_switches(kwargs).items():  # (vLLM merges the kwargs over the request's fields)
            setattr(req, name, value)
    except ValueError as e:
        raise ApiError.bad_request(e) from None
    if req.documents is not None and kwargs and "documents" in kwargs:  # (either reaches the template alone)
        raise ApiError(400, "documents: given twice, as the field and in chat_template_kwargs; give one", "documents")
    if req.chat_template is not None:
        raise ApiError(400, "chat_template: a request cannot replace the server's chat template (vLLM refuses one "
                            "too, unless started with --trust-request-chat-template); start the server with "
                            "--chat-template", "chat_template")


class TokenizeCompletionRequest(_Body):
    """vLLM's /tokenize body for text."""

    model: str | None = None
    prompt: str
    add_special_tokens: bool | None = True
    return_token_strs: bool | None = False


class TokenizeChatRequest(_Body):
    """vLLM's /tokenize body for chat messages (rendered with the chat template first)."""

    model: str | None = None
    messages: list[ChatMessage]
    add_generation_prompt: bool | None = True
    add_special_tokens: bool | None = False
    return_token_strs: bool | None = False
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[ChatTool] | None = None  # as in a chat request: a tool-use template renders them
    documents: list[dict[str, Any]] | None = None
    continue_final_message: bool | None = False  # as in a chat request
    chat_template: str | None = None  # refused, as in a chat request

    def check_unsupported(self) -> None:
        check_rendering(self)
        if not self.messages:
            raise ApiError(400, "messages: must not be empty", "messages")


class DetokenizeRequest(_Body):
    """vLLM's /detokenize body."""

    model: str | None = None
    tokens: list[int]


def parse_body(cls: type[BaseModel], body: bytes) -> Any:
    """Validate a JSON body; every failure is a 400 naming the field."""
    if not body.strip():
        raise ApiError(400, "request body: expected a JSON object, got an empty body")
    try:
        req = cls.model_validate_json(body)
    except ValidationError as e:
        first = e.errors(include_url=False)[0]
        culprit = _json_culprit(body) if first["type"] == "json_invalid" else None
        if culprit is not None:
            raise ApiError(400, *culprit) from None
        raise ApiError(400, *describe(cls, e)) from None
    if hasattr(req, "check_unsupported"):
        req.check_unsupported()
    return req


JSON_DEPTH = 200  # containers pydantic's JSON parser reads inside one another (past it: "recursion limit exceeded")


def _json_culprit(body: bytes) -> tuple[str, str] | None:
    """(message, field) for valid JSON that pydantic's parser refused, naming the field: a string or key holding a
    lone surrogate escape (valid JSON, not Unicode text: refused, where Python's json, vLLM's, reads it and a later
    log line or response would fail to encode it), or a value nested past its depth (the top-level field). None
    when Python's json cannot read the body either (malformed JSON), or finds neither."""
    try:
        obj = json.loads(body)
    except (ValueError, RecursionError):
        return None
    stack: list[tuple[Any, tuple[str, ...], int]] = [(obj, (), 1)]
    while stack:  # (depth first, in the body's order)
        value, path, depth = stack.pop()
        field = ".".join(path)
        if depth > JSON_DEPTH and isinstance(value, (dict, list)):
            return f"{path[0]}: nested too deeply for the JSON parser (more than {JSON_DEPTH} levels)", path[0]
        problem = unicode_problem(value) if isinstance(value, str) else None
        if problem is not None:
            return f"{field}: {problem}", field
        items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()
        children = []
        for key, child in items:
            problem = unicode_problem(key) if isinstance(key, str) else None
            if problem is not None:
                at = field or "request body"
                return f"{at}: a key is {problem}", at
            children.append((child, (*path, str(key)), depth + 1))
        stack.extend(reversed(children))
    return None


def body_object(body: bytes) -> dict[str, Any] | None:
    """The JSON object a body holds, for choosing its form by its fields before it is parsed (/tokenize,
    /invocations); None if it holds none (not JSON, nested too deeply, not an object: `parse_body` then says
    what is wrong with it)."""
    try:
        obj = json.loads(body)
    except (ValueError, RecursionError):
        return None
    return obj if isinstance(obj, dict) else None


def chat_form(obj: dict[str, Any] | None) -> bool:
    """Whether a body (`body_object`) is the chat form of its endpoint: it has `messages` (vLLM's rule)."""
    return obj is not None and obj.get("messages") is not None


def parse_tokenize(body: bytes) -> TokenizeCompletionRequest | TokenizeChatRequest:
    """A /tokenize body: the chat form when it has `messages`, else the text form (vLLM's rule). One with
    both is refused: either would be dropped without a word."""
    obj = body_object(body)
    if chat_form(obj) and obj is not None and obj.get("prompt") is not None:
        raise ApiError(400, "prompt: give one of prompt or messages, not both", "prompt")
    return parse_body(TokenizeChatRequest if chat_form(obj) else TokenizeCompletionRequest, body)


LIST_ITEM = "list_item_type"  # a list's item of another type than the list's first (`CompletionRequest.prompt`)
OTHER_PART = "content_part_type"  # a message's content part of another type than text's (`ChatMessage.content`)


def describe(cls: type[BaseModel], e: ValidationError) -> tuple[str, str | None]:
    errors = e.errors(include_url=False)
    first = errors[0]
    kind = first["type"]
    if kind == "json_invalid":
        if "recursion limit" in first["msg"]:  # (valid JSON, past the parser's depth: pydantic's ~200 levels)
            return f"request body: nested too deeply for the JSON parser ({first['msg']})", None
        return f"request body: malformed JSON ({first['msg']})", None
    if kind in ("model_type", "model_attributes_type") and not first["loc"]:
        return "request body: expected a JSON object", None
    # A union reports errors per member, each member every item of a list it fails on. Of each member's first
    # error under the first failing field, the deepest says most (`prompt.1: Input should be a valid string`
    # rather than `prompt: ...`), and of those the ones that got furthest along a list (`[1, "a"]` is a list of
    # token ids that fails at item 1, not a list of strings that fails at item 0); members that fail at the same
    # place are named together.
    firsts: dict[tuple[str, ...], int] = {}  # (a member's, or a field's, first error: errors come in item order)
    for k, err in enumerate(errors):
        firsts.setdefault(tuple(str(seg) for seg in err["loc"] if not isinstance(seg, int)), k)
    # (paths of the firsts only: a list of 300k items failing every member made an error each, and a path for each
    # held the event loop for seconds)
    paths = {k: _request_path(cls, errors[k]["loc"]) for k in firsts.values()}
    # the failing field: the shortest of the paths that lead to the first error (a union member that fails on the field
    # as a whole, `prompt: ... a valid string`, may come after one that fails at an item)
    head = min((p for p in paths.values() if paths[0][:len(p)] == p), key=len)
    under = [k for k in firsts.values() if paths[k][:len(head)] == head]
    deepest = max(len(paths[k]) for k in under)

    def reach(k: int) -> list[int]:
        return [int(seg) if seg.isdigit() else -1 for seg in paths[k]]

    furthest = max(reach(k) for k in under if len(paths[k]) == deepest)
    best = [k for k in under if len(paths[k]) == deepest and reach(k) == furthest]
    err, param = errors[best[0]], ".".join(paths[best[0]]) or None
    if err["type"] == LIST_ITEM:  # (raised on the list as a whole, about one of its items)
        param = f"{param}.{err['ctx']['index']}"
    if err["type"] == OTHER_PART:  # (raised on the content as a whole, about one part's type)
        param = f"{param}.{err['ctx']['index']}.type"
    if err["type"] == "missing":
        return f"{param}: field required", param
    said = list(dict.fromkeys(errors[k]["msg"] for k in best))
    lead = "Input should be "
    if len(said) > 1 and all(m.startswith(lead) for m in said):
        said = [lead + " or ".join(m.removeprefix(lead) for m in said)]
    return f"{param}: {'; or '.join(said)}", param


def _request_path(cls: type[BaseModel], loc: tuple[int | str, ...]) -> list[str]:
    """The path in the request body of an error location: field names, list indices and object keys.

    Where a field's type is a union, pydantic inserts the name of the member it tried (`str`,
    `list[int]`, ...) after the field. Those tags are told from field names by walking the models'
    types along the location, never by how a segment looks (a field may well be called `stream`)."""
    kinds: list[Any] = [cls]  # the types the next segment indexes into
    path: list[str] = []
    for seg in loc:
        unions = [_members(t) for t in kinds if len(_members(t)) > 1]
        if unions:  # this segment names a union member
            kinds = [m for members in unions for m in members]
            continue
        inner: list[Any] = []
        for t in (m for k in kinds for m in _members(k)):
            args = get_args(t)
            if isinstance(t, type) and issubclass(t, BaseModel) and seg in t.model_fields:
                inner.append(t.model_fields[str(seg)].annotation)
            elif get_origin(t) is list and isinstance(seg, int) and args:
                inner.append(args[0])
            elif get_origin(t) is dict and len(args) == 2:
                inner.append(args[1])
        if seg != "[key]":  # pydantic's marker for an invalid object key, after the key itself
            path.append(str(seg))
        kinds = inner
    return path


def _members(t: Any) -> list[Any]:
    """The member types of a union (None left out: optional fields are not tagged; a tagged union's, `Annotated`
    with its discriminator, too: pydantic names the tag it chose as it names a member); else [t]."""
    if get_origin(t) is Annotated:
        return _members(get_args(t)[0])
    if get_origin(t) in (Union, UnionType):
        return [m for m in get_args(t) if m is not type(None)]
    return [t]


# request fields passed to SamplingParams as they are (validated there)
ADJUSTMENTS = ("frequency_penalty", "presence_penalty", "repetition_penalty", "logit_bias", "min_tokens",
               "include_stop_str_in_output", "truncate_prompt_tokens", "allowed_token_ids", "bad_words")
# the fields an unset value of which the server's defaults give (`fill_defaults`)
DEFAULTED = ("temperature", "top_p", "top_k", "min_p", *ADJUSTMENTS, *EXIT_FIELDS)


def fill_defaults(req: _SamplingFields, defaults: dict[str, Any]) -> dict[str, Any]:
    """The request's `DEFAULTED` fields as SamplingParams keyword arguments: each the request's own value, else the
    server's default (`ServerSettings.sampling_defaults`: the checkpoint's generation_config.json temperature, top_p,
    top_k, min_p and repetition_penalty, as `LLM.get_default_sampling_params` takes them, under the serve flags' exit
    defaults), else left out (SamplingParams' own default): vLLM's rule for its `default_sampling_params`. One rule
    for sampling (`sampling_params`) and beam search (its temperature). The server's exit_threshold belongs to its
    exit policy (`defaults["exit_policy"]`: --exit-policy, else the model's own, filled in by the server): a request
    naming another policy without a threshold gets that policy's own default threshold (exits.py); one with an
    exit_trace names trace, which has none (not the server's policy either)."""
    out = {k: getattr(req, k) if getattr(req, k) is not None else defaults.get(k) for k in DEFAULTED}
    if req.exit_trace is not None and req.exit_policy is None:  # an exit_trace names its policy: the server's is not it
        out["exit_policy"] = None
    policy = req.exit_policy if req.exit_trace is None else "trace"
    if req.exit_threshold is None and policy not in (None, defaults.get("exit_policy")):
        out["exit_threshold"] = None
    return {k: v for k, v in out.items() if v is not None}


def sampling_params(req: _SamplingFields, *, max_tokens: int | None, logprobs: int | None,
                    defaults: dict[str, Any], prompt_logprobs: int | None = None,
                    guided_decoding: GuidedDecodingParams | None = None) -> SamplingParams:
    """SamplingParams of a request, its unset fields from the server's `defaults` (`fill_defaults`; `guided_decoding`:
    the grammar its fields ask for, checked with the rest); its range checks become 400s naming the field."""
    kwargs: dict[str, Any] = dict(
        max_tokens=max_tokens, seed=req.seed, stop=req.stop,
        stop_token_ids=list(req.stop_token_ids or []), ignore_eos=bool(req.ignore_eos),
        skip_special_tokens=req.skip_special_tokens is not False,
        spaces_between_special_tokens=req.spaces_between_special_tokens is not False, logprobs=logprobs,
        exit_trace=req.exit_trace,
        num_speculative_tokens=req.num_speculative_tokens,
        n=1 if req.n is None else req.n, best_of=getattr(req, "best_of", None),  # (a completions field only)
        # a stream needs what is new per step, a response that is not streamed the final output only
        output_kind=RequestOutputKind.DELTA if req.streaming else RequestOutputKind.FINAL_ONLY,
        prompt_logprobs=req.prompt_logprobs if prompt_logprobs is None else prompt_logprobs,
        guided_decoding=guided_decoding, **fill_defaults(req, defaults))
    if "logit_bias" in kwargs:  # (vLLM's server clamps a request's biases, where its offline params take any)
        kwargs["logit_bias"] = clamped_bias(kwargs["logit_bias"])
    try:
        return SamplingParams(**kwargs)
    except ValueError as e:
        # the values it names that are the server's, not the request's (the field at fault, or the one it conflicts
        # with): said so, with where the server got them
        message = str(e)
        named = [k for k in DEFAULTED if getattr(req, k) is None and k in kwargs and re.search(rf"\b{k}\b", message)]
        notes = "".join(f" ({k} {json.dumps(kwargs[k])} is the server's default, {_default_source(k)}: the request "
                        "left it unset)" for k in named)
        raise ApiError.bad_request(ValueError(message + notes)) from None


def _default_source(field: str) -> str:
    """Where a server's default of `field` comes from (serve/cli.py `load_server`): the exit fields from the serve
    flags (exit_policy, when only --exit-threshold is given, from the model: `serving_defaults`), the rest from the
    checkpoint's generation_config.json."""
    if field not in EXIT_FIELDS:
        return "from the checkpoint's generation_config.json"
    flag = f"--{field.replace('_', '-')}"
    return f"{flag}, else the model's own" if field == "exit_policy" else flag


def _field_of(message: str) -> str | None:
    """The field a ValueError's message names first ("max_tokens: ...", "messages.0.role: ..."), or None."""
    head = message.split(":", 1)[0]
    return head if head and all(p.isidentifier() or p.isdigit() for p in head.split(".")) else None


PROMPT_NAMES = ("prompt", "prompt_token_ids")  # the engine's names of a request's prompt
GRAMMAR_NAMES = ("guided_decoding", "structured_outputs")  # and of its grammar (SamplingParams' fields)


def request_field(message: str, prompt_field: str | None = None, grammar_field: str | None = None) -> str | None:
    """The request field a message (a ValueError's, or a failed request's engine error, found when its sequence is
    made or later) is about: the field it names first, except that the engine's names of the prompt and of the
    grammar become the fields this request gave them in (`prompt_field`: "prompt", "prompt.1", "messages";
    `grammar_field`: "response_format", "guided_json", "structured_outputs", "tools", ...), where known. The
    one rule for `param` of such an error, whenever it is found."""
    head = _field_of(message)
    if head in PROMPT_NAMES and prompt_field is not None:
        return prompt_field
    if head in GRAMMAR_NAMES and grammar_field is not None:
        return grammar_field
    return head
