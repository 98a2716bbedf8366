"""Structured output and tool calls over HTTP: which grammar a request's fields ask for, and how a
forced tool call's output becomes `message.tool_calls` (a parsed one, for "auto": serve/tool_parsers.py).

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
(finish_reason "stop", as OpenAI and vLLM answer a forced function; streamed, its arguments as they come);
"required" forces a JSON list of {"name", "parameters"} over the given tools (at least one; one if
`parallel_tool_calls` is false), returned as tool calls (each call's arguments the raw text of its "parameters")
with finish_reason "tool_calls". Streamed, the list is read as it comes (`ToolListScanner`, which costs each chunk
its own length): a call's id and name are sent as soon as its name is complete, then its arguments in pieces, as
vLLM streams them. A tool's schema that refers within itself ($defs, `#/properties/...`, `#`) moves to the list
schema's $defs, its references rebased. A list cut short (finish_reason "length", or "stop" with the stop string or
token as stop_reason) is no tool calls but the text as content in a whole response; a stream cannot take back the
calls it sent: it keeps them (the last one's arguments cut short) and ends with that finish reason (if no name was
complete, it sends the text as content, as the whole response does). A tool's name must not be empty, and its
parameters must be a schema of type "object" (none given, or {}: no parameters, arguments {}). "auto" (the
default when tools are given and `tool_choice` is left out) needs a parser of the model's own tool-call format: with
the server's `--enable-auto-tool-choice --tool-call-parser NAME` the model generates freely (a grammar field still
applies, as vLLM allows it beside "auto") and serve/tool_parsers.py reads its calls (`AutoTools`); without, it is
refused with a 400, as vLLM refuses it. An explicit `"tool_choice": null` is not "auto": it generates text, as "none"
(vLLM lets it through to plain generation).
"""

from __future__ import annotations

import dataclasses
import json
import re
import secrets
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from loopserve.outputs import CompletionOutput
from loopserve.sampling_params import (
    GUIDE_KINDS,
    GuidedDecodingParams,
    check_structured_outputs_keys,
    structured_outputs_params,
)
from loopserve.serve.protocol import ApiError
from loopserve.serve.responses import ChoiceStream

if TYPE_CHECKING:
    from loopserve.serve.tool_parsers import AutoTools

# vLLM's request fields -> GuidedDecodingParams fields
GUIDED_FIELDS = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice",
                 "guided_grammar": "grammar"}
GRAMMAR_KEYS = (*GUIDE_KINDS, "json_object")  # a structured_outputs that has none: options
NO_PARAMETERS = {"type": "object", "properties": {}, "additionalProperties": False}  # a tool's that gives none


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
        if key in options:
            raise _given_twice(key)
        options[key], field_of[key] = value, f"structured_outputs.{key}"
    return options, field_of


def _given_twice(key: str) -> ApiError:
    """The 400 for a structured_outputs option that the request's guided_whitespace_pattern gives too."""
    where = f"structured_outputs.{key}"
    return ApiError(400, f"{where}: given twice (guided_whitespace_pattern gives it too)", where)


def _guided(param: str, field_of: dict[str, str], **kwargs: Any) -> GuidedDecodingParams:
    """GuidedDecodingParams(**kwargs); its ValueError becomes a 400 naming the request field (`field_of`:
    GuidedDecodingParams' field names -> the request's)."""
    try:
        return GuidedDecodingParams(**kwargs)
    except ValueError as e:
        raise _guided_error(param, field_of, e) from None


def _guided_error(param: str, field_of: dict[str, str], e: ValueError) -> ApiError:
    head, _, rest = str(e).partition(": ")
    where = field_of.get(head, param)
    return ApiError(400, f"{where}: {rest or e}", where)


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
        spec = req.structured_outputs
        pattern = getattr(req, "guided_whitespace_pattern", None)
        if pattern is not None:  # (vLLM's older field applies to the newer object's grammar too)
            if spec.get("whitespace_pattern") is not None:
                raise _given_twice("whitespace_pattern")
            spec = {**spec, "whitespace_pattern": pattern}
        return _structured_outputs(spec)
    options, field_of = grammar_options(req)
    return _guided(name, {GUIDED_FIELDS[name]: name, **field_of}, **{GUIDED_FIELDS[name]: getattr(req, name)},
                   **options)


def _structured_outputs(spec: dict[str, Any]) -> GuidedDecodingParams:
    try:  # (SamplingParams' own rule for the field)
        return structured_outputs_params(spec)
    except ValueError as e:
        raise ApiError.bad_request(e) from None


_STRING_STOP = re.compile(r'["\\]')  # what ends a run of plain characters in a JSON string
_WHITESPACE = " \t\n\r"
_SCALAR_END = ",}]" + _WHITESPACE  # what ends a number, true, false or null

# What `ToolListScanner.feed` reports: (call index, name, text): a call's name, once its string is complete (text
# ""), or a piece of the raw text of its parameters (name None).
ToolEvent = tuple[int, str | None, str]


class ToolListScanner:
    """An incremental reader of "required"'s output, the JSON list [{"name": ..., "parameters": {...}}, ...] its
    grammar makes (any whitespace between tokens, its keys in any order), or (`item_depth` 1) of one such object
    alone, a Hermes <tool_call> block's {"name": ..., "arguments": {...}} (`arguments_key`: the key of the call's
    arguments). Fed the text piece by piece, it reads each character once (a piece costs its length, not the
    text's) and reports each call's name as soon as that string is complete, then the raw text of its arguments
    value as it comes, from the value's first character to its last (a value read before the item's name is held
    until the name is known). Calls are numbered in the order their names complete. A small state machine over
    JSON: strings (with escapes), the depth of objects and arrays, and, in an item (at `item_depth`), whether a
    key, its colon, its value or what follows is next. The text is assumed a prefix of JSON of that shape (the
    grammar's promise; a parser of the model's own format catches the ValueError of a string it cannot read, or of a
    key or name no response can carry: a lone surrogate escape); a repeated parameters key's value is not read (the
    first one's is the call's);
    `complete`: the list (or the object) is closed."""

    def __init__(self, item_depth: int = 2, arguments_key: str = "parameters") -> None:
        self.item_depth, self.arguments_key = item_depth, arguments_key
        self.depth = 0  # objects and arrays open
        self.in_string = False
        self.escape = False  # in a string, just after a backslash
        self.item = False  # the container at `item_depth` is an item (an object)
        # in an item, at `item_depth`: "key" (or in one), "colon", "value", "string" (in one), "scalar" (in one), "next"
        self.expect = "key"
        self.key: str | None = None  # the key whose value is next or being read
        self.token: list[str] | None = None  # the raw text so far of the key or the name being read
        self.capture = False  # in the item's parameters value: its text goes to the call
        self.index: int | None = None  # the item's call index, once its name is complete
        self.held: list[str] = []  # the item's parameters text read before its name
        self.has_arguments = False  # the item's parameters value began (a second one, a repeated key, is not read)
        self.calls = 0  # calls named so far
        self.complete = False  # the list is closed

    def feed(self, piece: str) -> list[ToolEvent]:
        """The events of the next piece of text, a call's argument pieces joined."""
        events: list[ToolEvent] = []
        k, n = 0, len(piece)
        start = 0  # where the key, name or parameters being read began in this piece
        while k < n and not self.complete:
            if self.in_string:
                if self.escape:
                    self.escape, k = False, k + 1
                    continue
                m = _STRING_STOP.search(piece, k)
                if m is None:
                    k = n
                    break
                k = m.start()
                if piece[k] == "\\":
                    self.escape, k = True, k + 1
                    continue
                self.in_string = False
                if self.depth == self.item_depth and self.item:
                    self._string_end(piece, start, k, events)
                k += 1
                continue
            c = piece[k]
            in_item = self.depth == self.item_depth and self.item
            if in_item and self.expect == "scalar" and c in _SCALAR_END:
                self.expect = "next"
                if self.capture:
                    self.capture = False
                    self._arguments(piece[start:k], events)
            if in_item and self.expect == "value" and c not in _WHITESPACE:  # a value starts
                if self.key == self.arguments_key and not self.has_arguments:
                    self.capture, self.has_arguments, start = True, True, k
                if c == '"':
                    self.expect = "string"
                    if self.key == "name" and self.index is None:
                        self.token, start = [], k + 1
                else:
                    self.expect = "next" if c in "{[" else "scalar"  # (a container ends back at the item's depth)
            elif in_item and c == '"' and self.expect == "key":
                self.token, start = [], k + 1
            elif in_item and c == ":" and self.expect == "colon":
                self.expect = "value"
            elif in_item and c == "," and self.expect == "next":
                self.expect, self.key = "key", None
            if c == '"':
                self.in_string = True
            elif c in "{[":
                if self.depth == self.item_depth - 1:  # an item starts
                    self.item, self.expect, self.key, self.index, self.held = c == "{", "key", None, None, []
                    self.has_arguments = False
                self.depth += 1
            elif c in "}]":
                self.depth -= 1
                if self.depth == self.item_depth and self.item and self.capture:  # the arguments (object, array) closed
                    self.capture = False
                    self._arguments(piece[start:k + 1], events)
                elif self.depth == 0:
                    self.complete = True
            k += 1
        if self.capture:
            self._arguments(piece[start:], events)
        elif self.token is not None:
            self.token.append(piece[start:])
        return events

    def _string_end(self, piece: str, start: int, end: int, events: list[ToolEvent]) -> None:
        """An item's key or value string closed at `end` (its quote)."""
        if self.token is not None:  # a key, or the name
            value = json.loads('"' + "".join(self.token) + piece[start:end] + '"')
            self.token = None
            value.encode()  # (a lone surrogate escape, "\ud83d", cannot go into a response: UnicodeEncodeError)
            if self.expect == "key":
                self.key, self.expect = value, "colon"
                return
            self.index, self.calls = self.calls, self.calls + 1
            events.append((self.index, value, ""))
            if self.held:
                self._arguments("".join(self.held), events)
                self.held = []
        elif self.capture:  # (parameters that are a string)
            self.capture = False
            self._arguments(piece[start:end + 1], events)
        self.expect = "next"

    def _arguments(self, text: str, events: list[ToolEvent]) -> None:
        if not text:
            return
        if self.index is None:
            self.held.append(text)
        elif events and events[-1][0] == self.index and events[-1][1] is None:
            events[-1] = (self.index, None, events[-1][2] + text)
        else:
            events.append((self.index, None, text))


def tool_call_entries(events: list[ToolEvent]) -> list[dict[str, Any]]:
    """`tool_calls` entries of scanner events, one per call, in order, each with its `index`: a call named in them
    gets a new id, its type and its name (and arguments "", if none follow); its argument pieces are joined. A
    stream's chunk sends them as they are; a whole response's calls are those of all the events."""
    entries: dict[int, dict[str, Any]] = {}
    for i, name, text in events:
        entry = entries.setdefault(i, {"index": i})
        if name is not None:
            entry.update(tool_call(name, ""))
        else:
            fn = entry.setdefault("function", {"arguments": ""})
            fn["arguments"] += text
    return list(entries.values())


@dataclass
class ToolPlan:
    """How a chat request's output becomes tool calls: one named function, or "required" (a list).

    "required" reads its output with one `ToolListScanner` per choice, whole (`calls`, `message`) or, streamed,
    piece by piece (`delta`): a stream sends each call's id and name as soon as the name is complete, then the
    raw text of its parameters as it comes, so the arguments a stream sends are those the whole response has.
    Cut before the list is complete (max_tokens: finish_reason "length"), the whole response has no calls, only
    the text as content; a stream cannot take back what it sent: it keeps the calls whose names were complete (the
    last one's arguments cut short) and ends with the engine's finish reason, or, if no name was complete, sends
    the text as content at the end, as the whole response does. finish_reason "tool_calls" needs the list closed
    and the engine's "stop"."""

    names: list[str]  # the function forced, or every tool's
    required: bool  # "required": the output is [{"name", "parameters"}, ...]
    guide: GuidedDecodingParams

    @staticmethod
    def _scanner(sent: ChoiceStream) -> ToolListScanner:
        if sent.tool_scan is None:
            sent.tool_scan = ToolListScanner()
        return sent.tool_scan

    def calls(self, text: str, sent: ChoiceStream | None = None) -> list[dict[str, Any]]:
        """The tool calls of a finished output's text (`sent`: keeps the scanner, for `finish_reason`). A named
        call's arguments are the text as it is (vLLM's answer; cut by max_tokens it is incomplete JSON, which the
        finish reason "length" says); "required"'s calls, each with the raw text of its parameters as arguments,
        only if the list is complete ([] if it was cut: the text is then the message's content)."""
        if not self.required:
            return [tool_call(self.names[0], text)]
        scan = ToolListScanner()
        if sent is not None:
            assert sent.tool_scan is None, "a whole text is read by a scanner of its own"
            sent.tool_scan = scan
        entries = tool_call_entries(scan.feed(text))
        if not scan.complete:
            return []
        return [{k: v for k, v in entry.items() if k != "index"} for entry in entries]

    def message(self, c: CompletionOutput, sent: ChoiceStream) -> dict[str, Any]:
        """The assistant message of a finished output: its tool calls, or its text if they are incomplete."""
        calls = self.calls(c.text, sent)
        return {"role": "assistant", "content": None if calls else c.text, "tool_calls": calls}

    def delta(self, piece: str, finished: bool, sent: ChoiceStream) -> dict[str, Any]:
        """A stream chunk's delta for one choice's new text `piece` (`finished`: its last; `sent`: what the stream
        sent of the choice, with its scanner): a named call's arguments as they come (its id and name first);
        "required"'s calls as they come (see the class)."""
        if self.required:
            scan = self._scanner(sent)
            entries = tool_call_entries(scan.feed(piece))
            if scan.calls:
                sent.parts.clear()
            elif finished:  # no call named: the text as content, as `message` answers
                whole = "".join(sent.parts) + piece
                return {"content": whole} if whole else {}
            else:
                sent.parts.append(piece)  # (kept until a call is named)
            return {"tool_calls": entries} if entries else {}
        if not piece and not (finished and sent.call_id is None):  # (a call with no arguments is still sent)
            return {}
        if sent.call_id is not None:
            return {"tool_calls": [{"index": 0, "function": {"arguments": piece}}]}
        call = tool_call(self.names[0], piece)
        sent.call_id = call["id"]
        return {"tool_calls": [{"index": 0, **call}]}

    def finish_reason(self, c: CompletionOutput, sent: ChoiceStream) -> str | None:
        """"required": "tool_calls" once the list is complete (`sent`'s scanner says), else the engine's reason."""
        complete = sent.tool_scan is not None and sent.tool_scan.complete
        return "tool_calls" if self.required and c.finish_reason == "stop" and complete else c.finish_reason


# schema keywords whose values are data, not schemas: a "$ref" in them is not a reference
_DATA_KEYWORDS = ("const", "enum", "default", "examples")


def _rebased(schema: Any, base: str) -> Any:
    """`schema` with each local reference "#<pointer>" made "<base><pointer>" (`base`: where the schema now stands)."""
    if isinstance(schema, dict):
        return {k: (base + v[1:] if k == "$ref" and isinstance(v, str) and v.startswith("#")
                    else v if k in _DATA_KEYWORDS else _rebased(v, base)) for k, v in schema.items()}
    if isinstance(schema, list):
        return [_rebased(v, base) for v in schema]
    return schema


def new_call_id() -> str:
    return f"chatcmpl-tool-{secrets.token_hex(16)}"  # vLLM's form


def tool_call(name: str, arguments: str, call_id: str | None = None) -> dict[str, Any]:
    """One entry of `message.tool_calls` (OpenAI's shape; `arguments` is JSON text)."""
    return {"id": call_id or new_call_id(), "type": "function",
            "function": {"name": name, "arguments": arguments}}


def chat_guide(req: Any, auto: AutoTools | None = None) -> tuple[GuidedDecodingParams | None,
                                                                  ToolPlan | AutoTools | None]:
    """The grammar of a chat request and, when it forces tool calls or lets the model make them (`auto`: how the
    server's --tool-call-parser answers tool_choice "auto"), how they are returned. "auto" takes a grammar field
    beside it (vLLM's rule: the grammar shapes the text the parser reads); a forced call's grammar is its own."""
    plan = tool_plan(req, auto)
    forced = isinstance(plan, ToolPlan)
    guide = request_guide(req, tool_call=forced)
    if forced and guide is not None:
        raise ApiError(400, "tool_choice: a forced tool call cannot be combined with another grammar field",
                       "tool_choice")
    return (plan.guide if isinstance(plan, ToolPlan) else guide), plan


def _arguments_schema(parameters: dict[str, Any] | None) -> dict[str, Any]:
    """The schema a tool's call arguments are checked and generated by: none given (or {}), no parameters (its
    arguments are {}, OpenAI's reading); a schema without a type, an object's (OpenAI's rule; hand-written and MCP
    schemas leave it out: read as anything, the arguments could be `true` or a list, which the next turn's message
    could not send back)."""
    if not parameters:
        return NO_PARAMETERS
    return parameters if "type" in parameters else {"type": "object", **parameters}


def tool_plan(req: Any, auto: AutoTools | None = None) -> ToolPlan | AutoTools | None:
    """How a chat request's output becomes tool calls: a `ToolPlan` where it forces them, `auto` (the server's parser,
    None if it has none) where it lets the model call (tool_choice "auto"), None where it generates text. Raises
    ApiError for what is not supported ("auto" without a parser) or inconsistent (a named function that is not among
    the tools)."""
    choice, tools = req.tool_choice, req.tools or []
    seen: set[str] = set()  # (a set: a body may list tens of thousands of tools)
    for i, t in enumerate(tools):
        where = f"tools.{i}.function.name"
        if not t.function.name:  # (a client that tests `if call.function.name` would drop its calls)
            raise ApiError(400, f"{where}: must not be empty", where)
        if t.function.name in seen:
            raise ApiError(400, f"{where}: {t.function.name!r} names another tool already", where)
        seen.add(t.function.name)
        kind = _arguments_schema(t.function.parameters)["type"]
        if kind != "object":  # (OpenAI's rule: a call's arguments are a JSON object, which a message sends back)
            where = f"tools.{i}.function.parameters"
            raise ApiError(400, f"{where}: must be a schema of type \"object\" (a call's arguments are a JSON "
                                f"object), got type {json.dumps(kind)}", where)
    if choice is None:
        # left out: "auto" where tools are given (vLLM's default); an explicit null asks for no tool call, read as
        # "none" (vLLM lets it through: text, the tools still rendered, as for any choice here)
        choice = "auto" if tools and "tool_choice" not in req.model_fields_set else "none"
    elif choice in ("required", "auto") and req.tools == []:
        # (OpenAI's reading, which vLLM follows: "none"; agent frameworks send it, the OpenAI Agents SDK "auto" for an
        # agent without tools)
        choice = "none"
    if choice == "none":
        return None
    if not tools:
        raise ApiError(400, "tool_choice: needs tools", "tool_choice")
    if choice == "auto":
        if auto is not None:  # (one call at most where parallel calls are off: vLLM keeps the first)
            return dataclasses.replace(auto, single=True) if req.parallel_tool_calls is False else auto
        raise ApiError(400, "tool_choice: 'auto' (the default when tools come without a tool_choice) needs a parser "
                            "of the model's own tool-call format, which this server was not started with "
                            "(--enable-auto-tool-choice --tool-call-parser NAME); use 'required', a named function or "
                            "'none'", "tool_choice")
    schemas = {t.function.name: _arguments_schema(t.function.parameters) for t in tools}
    options, field_of = grammar_options(req)
    if choice == "required":
        # a tool's schema that refers within itself ($defs, `#/properties/...`, `#` for a recursive one) moves to the
        # list schema's $defs, its references rebased there: left inside the list, they pointed at the list's root
        rebased = {f"tool_{i}": (schema, _rebased(schema, f"#/$defs/tool_{i}"))
                   for i, schema in enumerate(schemas.values())}
        defs = {key: new for key, (old, new) in rebased.items() if new != old}  # (those that refer within themselves)
        items = [{"type": "object", "additionalProperties": False, "required": ["name", "parameters"],
                  "properties": {"name": {"const": name},
                                 "parameters": {"$ref": f"#/$defs/tool_{i}"} if f"tool_{i}" in defs else schema}}
                 for i, (name, schema) in enumerate(schemas.items())]
        schema = {"type": "array", "minItems": 1, "items": {"anyOf": items}, **({"$defs": defs} if defs else {})}
        if req.parallel_tool_calls is False:
            schema["maxItems"] = 1
        try:
            guide = GuidedDecodingParams(json=schema, **options)
        except ValueError as e:  # the list's grammar: named by the tool whose own schema fails, where one does
            head = str(e).partition(": ")[0]
            for i, one in enumerate(schemas.values() if head not in field_of else ()):
                _guided(f"tools.{i}.function.parameters", field_of, json=one, **options)
            raise _guided_error("tools", field_of, e) from None
        return ToolPlan(list(schemas), True, guide)
    name = choice.function.name
    if name not in schemas:
        raise ApiError(400, f"tool_choice.function.name: {name!r} is not among the tools", "tool_choice.function.name")
    index = list(schemas).index(name)
    return ToolPlan([name], False, _guided(f"tools.{index}.function.parameters", field_of, json=schemas[name],
                                           **options))
