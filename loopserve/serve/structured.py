"""Structured output and tool calls over HTTP: which grammar a request's fields ask for, and how a
forced tool call's output becomes `message.tool_calls`.

Grammar fields (at most one may be given; each error is a 400 naming it): `response_format`
({"type": "json_object"} or {"type": "json_schema", "json_schema": {"name", "schema", "strict"}}; "text"
is no grammar), vLLM's `guided_json`, `guided_regex`, `guided_choice`, `guided_grammar` (with
`guided_whitespace_pattern`, which applies to response_format and tool calls too) and its newer `structured_outputs`
object (`json`, `regex`, `choice`, `grammar`, `json_object`, `disable_any_whitespace`,
`whitespace_pattern`). Between JSON tokens any whitespace is allowed unless a pattern says otherwise. A
`structured_outputs` that names no grammar, only options (`disable_any_whitespace`, `whitespace_pattern`,
`disable_additional_properties`, ...), applies them to the grammar another field asks for (`response_format`,
`guided_*`, a forced tool call), as vLLM merges the two.

Tool calling (chat), as vLLM does it without a tool-call parser: `tools` go to the chat template;
`tool_choice` "none" generates text; a named function ({"type": "function", "function": {"name"}})
forces its arguments through the function's parameters schema, and the output becomes one tool call
(finish_reason "stop", as OpenAI and vLLM answer a forced function); "required" forces a JSON list
of {"name", "parameters"} over the given tools (at least one; one if `parallel_tool_calls` is false),
returned as tool calls with finish_reason "tool_calls". "auto" (the default when tools are given)
would need a parser for the model's own tool-call format: it is refused with a 400, as vLLM refuses
it when started without `--enable-auto-tool-choice`.
"""

from __future__ import annotations

import json
import secrets
from dataclasses import dataclass
from typing import Any

from loopserve.outputs import CompletionOutput
from loopserve.sampling_params import GuidedDecodingParams, check_structured_outputs_keys, structured_outputs_params
from loopserve.serve.protocol import ApiError
from loopserve.serve.responses import ChoiceStream

# vLLM's request fields -> GuidedDecodingParams fields
GUIDED_FIELDS = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice",
                 "guided_grammar": "grammar"}
GRAMMAR_KEYS = ("json", "regex", "choice", "grammar", "json_object")  # a structured_outputs that has none: options


def _options_only(req: Any) -> dict[str, Any] | None:
    """The request's `structured_outputs` if it names no grammar, only options for another field's grammar."""
    spec = getattr(req, "structured_outputs", None)
    if isinstance(spec, dict) and all(spec.get(k) is None or (k == "json_object" and spec[k] is False)
                                      for k in GRAMMAR_KEYS):
        return spec
    return None


def grammar_options(req: Any) -> tuple[dict[str, Any], dict[str, str]]:
    """The options a request gives the grammar of its response_format, guided_* field or forced tool call
    (GuidedDecodingParams' fields), and the request field each comes from (for errors)."""
    options: dict[str, Any] = {}
    field_of: dict[str, str] = {}
    if getattr(req, "guided_whitespace_pattern", None) is not None:
        options["whitespace_pattern"] = req.guided_whitespace_pattern
        field_of["whitespace_pattern"] = "guided_whitespace_pattern"
    spec = _options_only(req) or {}
    try:
        check_structured_outputs_keys(spec)
    except ValueError as e:
        raise ApiError.bad_request(e) from None
    for key, value in spec.items():
        if key in GRAMMAR_KEYS:
            continue
        where = f"structured_outputs.{key}"
        if key in options:
            raise ApiError(400, f"{where}: given twice (guided_whitespace_pattern gives it too)", where)
        options[key], field_of[key] = value, where
    return options, field_of


def _guided(param: str, field_of: dict[str, str], **kwargs: Any) -> GuidedDecodingParams:
    """GuidedDecodingParams(**kwargs); its ValueError becomes a 400 naming the request field (`field_of`:
    GuidedDecodingParams' field names -> the request's)."""
    try:
        return GuidedDecodingParams(**kwargs)
    except ValueError as e:
        head, _, rest = str(e).partition(": ")
        where = field_of.get(head, param)
        raise ApiError(400, f"{where}: {rest or e}", where) from None


def response_format_guide(req: Any, param: str = "response_format") -> GuidedDecodingParams | None:
    """The grammar of a request's OpenAI `response_format` (None for text), with its `grammar_options`."""
    kind = req.response_format.type
    options, field_of = grammar_options(req)
    if kind == "text":
        return None
    if kind == "json_object":
        return _guided(param, field_of, json_object=True, **options)
    if kind == "json_schema":
        spec = req.response_format.json_schema
        if spec is None:
            raise ApiError(400, f"{param}.json_schema: field required for type json_schema", f"{param}.json_schema")
        schema = spec.schema_ if spec.schema_ is not None else {"type": "object"}  # OpenAI: schema is optional
        return _guided(f"{param}.json_schema.schema", field_of, json=schema, **options)
    raise ApiError(400, f"{param}.type: {kind!r} is not supported (text, json_object or json_schema)", f"{param}.type")


def guide_field(req: Any) -> str | None:
    """The grammar field a request gives (None: none; a forced tool call is not one). Raises ApiError if
    it gives several."""
    given = [name for name in GUIDED_FIELDS if getattr(req, name, None) is not None]
    if getattr(req, "structured_outputs", None) is not None and _options_only(req) is None:
        given.append("structured_outputs")
    fmt = getattr(req, "response_format", None)
    if fmt is not None and fmt.type != "text":
        given.append("response_format")
    if len(given) > 1:
        raise ApiError(400, f"{given[1]}: only one of {', '.join(given)} may be given", given[1])
    return given[0] if given else None


def request_guide(req: Any, tool_call: bool = False) -> GuidedDecodingParams | None:
    """The grammar a completions or chat request asks for through its grammar fields (None: none). `tool_call`:
    the request forces a tool call, whose grammar takes the options of a `structured_outputs` without one."""
    name = guide_field(req)
    if name is None:
        if _options_only(req) is not None and not tool_call:  # (options for no grammar: the 400 saying one is needed)
            _structured_outputs(req.structured_outputs)
        return None
    if name == "response_format":
        return response_format_guide(req)
    if name == "structured_outputs":
        return _structured_outputs(req.structured_outputs)
    options, field_of = grammar_options(req)
    return _guided(name, {GUIDED_FIELDS[name]: name, **field_of}, **{GUIDED_FIELDS[name]: getattr(req, name)},
                   **options)


def _structured_outputs(spec: dict[str, Any]) -> GuidedDecodingParams:
    try:  # (SamplingParams' own rule for the field)
        return structured_outputs_params(spec)
    except ValueError as e:
        raise ApiError.bad_request(e) from None


@dataclass
class ToolPlan:
    """How a chat request's output becomes tool calls: one named function, or "required" (a list)."""

    names: list[str]  # the function forced, or every tool's
    required: bool  # "required": the output is [{"name", "parameters"}, ...]
    guide: GuidedDecodingParams

    def calls(self, text: str) -> list[dict[str, Any]]:
        """The tool calls of a finished output's text. A named call's arguments are the text as it is (vLLM's
        answer; cut by max_tokens it is incomplete JSON, which the finish reason "length" says); "required"'s
        list only if it is complete JSON ([] if it was cut: the text is then the message's content)."""
        if not self.required:
            return [tool_call(self.names[0], text)]
        try:
            value = json.loads(text)
        except ValueError:
            return []
        return [tool_call(item["name"], json.dumps(item["parameters"], ensure_ascii=False)) for item in value]

    def message(self, c: CompletionOutput) -> dict[str, Any]:
        """The assistant message of a finished output: its tool calls, or its text if they are incomplete."""
        calls = self.calls(c.text)
        return {"role": "assistant", "content": None if calls else c.text, "tool_calls": calls}

    def delta(self, piece: str, whole: str | None, sent: ChoiceStream) -> dict[str, Any]:
        """A stream chunk's delta for one choice's new text `piece` (`whole`: "required"'s whole text, once it
        finished; `sent`: what the stream sent of the choice): a named call's arguments as they come (its id
        and name first); the calls of "required" once the list is complete."""
        if self.required:  # the list once complete; cut (no complete list), the text as content, as `message`
            if whole is None:
                return {}
            calls = self.calls(whole)
            if calls:
                return {"tool_calls": [{"index": i, **call} for i, call in enumerate(calls)]}
            return {"content": whole} if whole else {}
        if not piece:
            return {}
        fn: dict[str, Any] = {"arguments": piece}
        if sent.call_id is not None:
            return {"tool_calls": [{"index": 0, "function": fn}]}
        sent.call_id = new_call_id()
        return {"tool_calls": [{"index": 0, "id": sent.call_id, "type": "function",
                                "function": {"name": self.names[0], **fn}}]}

    def finish_reason(self, c: CompletionOutput) -> str | None:
        return "tool_calls" if self.required and c.finish_reason == "stop" else c.finish_reason


def new_call_id() -> str:
    return f"chatcmpl-tool-{secrets.token_hex(16)}"  # vLLM's form


def tool_call(name: str, arguments: str, call_id: str | None = None) -> dict[str, Any]:
    """One entry of `message.tool_calls` (OpenAI's shape; `arguments` is JSON text)."""
    return {"id": call_id or new_call_id(), "type": "function",
            "function": {"name": name, "arguments": arguments}}


def chat_guide(req: Any) -> tuple[GuidedDecodingParams | None, ToolPlan | None]:
    """The grammar of a chat request and, when it forces tool calls, how they are returned."""
    plan = tool_plan(req)
    guide = request_guide(req, tool_call=plan is not None)
    if plan is not None and guide is not None:
        raise ApiError(400, "tool_choice: a forced tool call cannot be combined with another grammar field",
                       "tool_choice")
    return (plan.guide if plan is not None else guide), plan


def tool_plan(req: Any) -> ToolPlan | None:
    """The tool calls a chat request forces (None: it generates text). Raises ApiError for what is not
    supported ("auto") or inconsistent (a named function that is not among the tools)."""
    choice, tools = req.tool_choice, req.tools or []
    seen: set[str] = set()  # (a set: a body may list tens of thousands of tools)
    for i, t in enumerate(tools):
        if t.function.name in seen:
            where = f"tools.{i}.function.name"
            raise ApiError(400, f"{where}: {t.function.name!r} names another tool already", where)
        seen.add(t.function.name)
    if choice is None:
        choice = "auto" if tools else "none"
    if choice == "none":
        return None
    if not tools:
        raise ApiError(400, "tool_choice: needs tools", "tool_choice")
    if choice == "auto":
        raise ApiError(400, "tool_choice: 'auto' (the default when tools are given) needs a parser of the model's own "
                            "tool-call format, which this server does not have; use 'required', a named function "
                            "or 'none'", "tool_choice")
    schemas = {t.function.name: t.function.parameters or {"type": "object", "properties": {}} for t in tools}
    options, field_of = grammar_options(req)
    if choice == "required":
        items = [{"type": "object", "additionalProperties": False, "required": ["name", "parameters"],
                  "properties": {"name": {"const": name}, "parameters": schema}} for name, schema in schemas.items()]
        schema = {"type": "array", "minItems": 1, "items": {"anyOf": items}}
        if req.parallel_tool_calls is False:
            schema["maxItems"] = 1
        return ToolPlan(list(schemas), True, _guided("tools", field_of, json=schema, **options))
    name = choice.function.name
    if name not in schemas:
        raise ApiError(400, f"tool_choice.function.name: {name!r} is not among the tools", "tool_choice.function.name")
    index = list(schemas).index(name)
    return ToolPlan([name], False, _guided(f"tools.{index}.function.parameters", field_of, json=schemas[name],
                                           **options))
