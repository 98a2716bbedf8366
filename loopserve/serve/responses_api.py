"""OpenAI's Responses API (`POST /v1/responses`) as a translation onto the chat path: the request body
(`ResponsesRequest`), its chat request (`ResponsesTurn.chat`: `instructions` a system message first, `input` the
messages, function_call and function_call_output items an assistant's tool calls and the tool messages answering
them, `text.format` the chat's `response_format`, flat function tools the chat's nested ones), the chat path's errors
renamed to the fields the request gave (`ResponsesTurn.renamed`), and the answer in the Responses shapes: the
response object (`ResponsesTurn.response`) and, streamed, its events (`ResponseEvents`).

What is refused, with a 400 naming the field: `previous_response_id`, `conversation`, `prompt` and `background:
true` (nothing is stored: each request carries its whole conversation), input items other than messages, function
calls and their outputs and reasoning items (built-in tools, item references), and whatever the chat path refuses.
tool_choice "auto" (the default with tools) reads the model's calls where the server was started with
--enable-auto-tool-choice (serve/structured.py: they come back as function_call items, as a forced call's do);
without it the reply is text, the tools still in the prompt (vLLM's answer without a parser, where its chat route
refuses "auto"). `truncation: "auto"` is taken but drops nothing: an input longer than the context is a 400 either
way. vLLM's sampling fields beside OpenAI's (`CHAT_FIELDS`: stop, top_k, repetition_penalty, logit_bias, ...) and
loopserve's depth controls (min_loops, max_loops, exit_threshold, exit_policy, exit_trace, num_speculative_tokens)
pass to the chat request as they are, checked and named there; a body's `request_id` names the response (with the
`resp_` prefix it lacks). With the server's --reasoning-parser the reply's reasoning is a reasoning
item before the message (streamed: its reasoning_text events), and `usage.output_tokens_details.reasoning_tokens`
counts its tokens (`ReasoningReplies.reasoning_tokens`); a reasoning item replayed in `input` (agents send an earlier
turn's back) is taken and left out of the prompt. `reasoning.effort` reaches the chat template as a chat request's
`reasoning_effort` does; `user`, `metadata`, `store`, `service_tier`, `prompt_cache_key`, `safety_identifier`,
`max_tool_calls` and `stream_options` change nothing and are accepted (so does `include`, but for the logprobs
below). `top_logprobs` asks for each output text token's logprobs (its alternatives up to that many), as `include:
["message.output_text.logprobs"]` does with none.
"""

from __future__ import annotations

import contextlib
import itertools
import secrets
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Annotated, Any, Literal

from pydantic import Discriminator, Field, Tag, ValidationError, field_validator

from loopserve.sampling_params import EXIT_FIELDS, SamplingParams
from loopserve.serve.protocol import (
    REASONING_EFFORTS,
    ApiError,
    ChatCompletionRequest,
    RefusalPart,
    TextPart,
    _Body,
    check_request_id,
    describe,
    text_parts_only,
)
from loopserve.serve.responses import sse

LOGPROBS_INCLUDE = "message.output_text.logprobs"  # the `include` entry that asks for the output's logprobs


class OutputTextPart(TextPart):
    """A text part; an earlier turn's output_text replays with its annotations and logprobs, which are dropped."""

    annotations: list[Any] | None = None
    logprobs: list[Any] | None = None


class InputMessage(_Body):
    """A message item: {"role", "content"}, `type` "message" or left out; an earlier turn's output message (its
    `id`, `status`) replays as the assistant's."""

    type: Literal["message"] | None = None
    role: Literal["user", "system", "developer", "assistant"]
    content: str | list[OutputTextPart | RefusalPart]
    id: str | None = None
    status: str | None = None

    _text_parts_only = field_validator("content", mode="before")(text_parts_only)


class FunctionCallItem(_Body):
    """An earlier turn's function call (its `call_id` is what the function_call_output answering it names)."""

    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str
    id: str | None = None
    status: str | None = None


class ReasoningInputItem(_Body):
    """An earlier turn's reasoning item, replayed: taken, and left out of the prompt (module docstring)."""

    type: Literal["reasoning"]
    id: str | None = None
    summary: list[Any] = []
    content: list[Any] | None = None
    encrypted_content: str | None = None
    status: str | None = None


class FunctionCallOutputItem(_Body):
    type: Literal["function_call_output"]
    call_id: str
    output: str | list[OutputTextPart]
    id: str | None = None
    status: str | None = None


def _item_kind(item: Any) -> str | None:
    """An input item's type (a message may leave it out), which picks its model: of a JSON object when a body is
    validated, of a parsed item when one is dumped (pydantic asks the discriminator then too)."""
    if isinstance(item, dict):
        kind = item.get("type", "message")
        return kind if isinstance(kind, str) else None
    return getattr(item, "type", None) or ("message" if isinstance(item, InputMessage) else None)


InputItem = Annotated[
    Annotated[InputMessage, Tag("message")] | Annotated[FunctionCallItem, Tag("function_call")]
    | Annotated[FunctionCallOutputItem, Tag("function_call_output")] | Annotated[ReasoningInputItem, Tag("reasoning")],
    Discriminator(_item_kind, custom_error_type="input_item_type", custom_error_message=(
        "Input should be a message ({'role', 'content'}), a function_call, a function_call_output or a reasoning "
        "item (this server stores nothing and runs no built-in tools)"))]


class FunctionTool(_Body):
    """A function tool, in the Responses API's flat shape."""

    type: Literal["function"]
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class FunctionChoice(_Body):
    type: Literal["function"]
    name: str


class TextFormat(_Body):
    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None  # json_schema's
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None


class TextConfig(_Body):
    format: TextFormat | None = None
    verbosity: str | None = None  # a hint to OpenAI's models: nothing here


class Reasoning(_Body):
    effort: Literal[REASONING_EFFORTS] | None = None  # type: ignore[valid-type]
    summary: str | None = None
    generate_summary: str | None = None


class ResponsesRequest(_Body):
    """The /v1/responses body (types only: `ResponsesTurn` checks the rest and translates it)."""

    model: str | None = None
    input: str | list[InputItem]
    instructions: str | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_logprobs: int | None = None
    seed: int | None = Field(None, ge=-(2**63), le=2**63 - 1)  # as a chat request's
    stream: bool | None = False
    text: TextConfig | None = None
    tools: list[FunctionTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | FunctionChoice | None = None
    parallel_tool_calls: bool | None = None
    reasoning: Reasoning | None = None
    include: list[str] | None = None
    # vLLM's extension, as in a chat request (serve/structured.py): options for the grammar of text.format or a forced
    # tool call (`{"disable_any_whitespace": true}`), or a grammar of its own
    structured_outputs: dict[str, Any] | None = None
    # vLLM's further fields of this body (`CHAT_FIELDS`), the chat request's own: their types are checked there
    stop: Any = None
    top_k: Any = None
    repetition_penalty: Any = None
    logit_bias: Any = None
    ignore_eos: Any = None
    skip_special_tokens: Any = None
    include_stop_str_in_output: Any = None
    priority: Any = None
    cache_salt: Any = None
    vllm_xargs: Any = None
    # loopserve's depth controls (EXIT_FIELDS, exit_trace) and drafts, as a chat request's (they were ignored, as
    # unknown fields)
    min_loops: Any = None
    max_loops: Any = None
    exit_threshold: Any = None
    exit_policy: Any = None
    exit_trace: Any = None
    num_speculative_tokens: Any = None
    request_id: str | None = None  # (names the response: serve/api.py `name_request`)
    max_tool_calls: int | None = None  # (vLLM's for built-in tools' calls: none run here)
    # refused unless they ask for nothing (module docstring)
    previous_response_id: str | None = None
    conversation: Any = None
    prompt: Any = None
    background: bool | None = None
    truncation: Literal["auto", "disabled"] | None = None
    # known, output-neutral: ignored
    user: str | None = None
    metadata: dict[str, Any] | None = None
    store: bool | None = None
    service_tier: str | None = None
    prompt_cache_key: str | None = None
    safety_identifier: str | None = None
    stream_options: dict[str, Any] | None = None

    def check_unsupported(self) -> None:
        check_request_id(self.request_id)
        for name in ("previous_response_id", "conversation", "prompt"):
            if getattr(self, name) is not None:
                raise ApiError(400, f"{name}: not supported: this server stores no responses, conversations or "
                                    "prompts; send the whole conversation as input", name)
        if self.background:
            raise ApiError(400, "background: not supported: this server stores no responses to fetch later; "
                                "only false is taken", "background")
        fmt = self.text.format if self.text is not None else None
        if fmt is not None and fmt.type == "json_schema" and fmt.name is None:
            raise ApiError(400, "text.format.name: field required for type json_schema", "text.format.name")

    @property
    def logprobs(self) -> bool:
        return self.top_logprobs is not None or LOGPROBS_INCLUDE in (self.include or ())


# vLLM's fields of a Responses body that a chat request has under the same name (`ResponsesRequest`)
CHAT_FIELDS = ("stop", "top_k", "repetition_penalty", "logit_bias", "ignore_eos", "skip_special_tokens",
               "include_stop_str_in_output", "priority", "cache_salt", "vllm_xargs", *EXIT_FIELDS, "exit_trace",
               "num_speculative_tokens")


def _parts(parts: list[OutputTextPart] | list[OutputTextPart | RefusalPart]) -> list[dict[str, Any]]:
    """Content parts as a chat message's (their text, or refusal)."""
    return [p.model_dump(include={"type", "text", "refusal"}) for p in parts]


def new_item_id(prefix: str) -> str:
    return f"{prefix}_{secrets.token_hex(16)}"


@dataclass
class ResponsesTurn:
    """A Responses request and the chat request it runs as; `sources`: per chat message, the request field it came
    from ("instructions", "input", "input.3"), and per (message, tool call) the function_call item it came from, so
    that an error the chat path raises names the field as this request gave it (`renamed`). `auto_tools`: whether
    the server reads tool_choice "auto"'s calls (--enable-auto-tool-choice); else "auto" asks for text."""

    req: ResponsesRequest
    auto_tools: bool
    chat: ChatCompletionRequest = field(init=False)
    sources: list[str] = field(default_factory=list)
    call_sources: dict[tuple[int, int], str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        req = self.req
        messages = self.messages()
        body: dict[str, Any] = {
            "model": req.model, "messages": messages, "max_completion_tokens": req.max_output_tokens,
            "temperature": req.temperature, "top_p": req.top_p, "seed": req.seed, "stream": req.stream,
            "logprobs": req.logprobs, "top_logprobs": req.top_logprobs if req.logprobs else None,
            "parallel_tool_calls": req.parallel_tool_calls, "structured_outputs": req.structured_outputs,
            "reasoning_effort": req.reasoning.effort if req.reasoning is not None else None}
        fmt = req.text.format if req.text is not None else None
        if fmt is not None and fmt.type == "json_schema":
            spec = {"name": fmt.name, "description": fmt.description, "schema": fmt.schema_, "strict": fmt.strict}
            body["response_format"] = {"type": "json_schema", "json_schema": spec}
        elif fmt is not None:
            body["response_format"] = {"type": fmt.type}
        if req.tools is not None:
            body["tools"] = [{"type": "function", "function": t.model_dump(exclude={"type"}, exclude_none=True)}
                             for t in req.tools]
        body |= {name: getattr(req, name) for name in CHAT_FIELDS}
        body = {k: v for k, v in body.items() if v is not None}
        if "tool_choice" in req.model_fields_set:  # (an explicit null too: the chat path tells it from none given)
            choice = req.tool_choice
            body["tool_choice"] = choice if not isinstance(choice, FunctionChoice) else {
                "type": "function", "function": {"name": choice.name}}
        if body.get("tool_choice", "auto") == "auto" and not (self.auto_tools and req.tools):
            # text: vLLM's Responses reply without a tool parser, or without tools ("auto" is this API's default
            # whatever the tools, and every response says it back)
            body["tool_choice"] = "none"
        with self.fields():
            try:  # (the Responses body's own fields were checked already; CHAT_FIELDS are checked here)
                self.chat = ChatCompletionRequest.model_validate(body)
            except ValidationError as e:
                raise ApiError(400, *describe(ChatCompletionRequest, e)) from None
            self.chat.check_unsupported()

    def messages(self) -> list[dict[str, Any]]:
        """The chat messages of `instructions` and `input`: consecutive function calls join one assistant message
        (the one just before them if it is the assistant's), each output a tool message."""
        req = self.req
        out: list[dict[str, Any]] = []
        if req.instructions is not None:
            out.append({"role": "system", "content": req.instructions})
            self.sources.append("instructions")
        if isinstance(req.input, str):
            out.append({"role": "user", "content": req.input})
            self.sources.append("input")
            return out
        for i, item in enumerate(req.input):
            where = f"input.{i}"
            if isinstance(item, FunctionCallItem):
                last = out[-1] if out else None
                if last is None or last["role"] != "assistant":
                    last = {"role": "assistant", "content": None, "tool_calls": []}
                    out.append(last)
                    self.sources.append(where)
                calls = last.setdefault("tool_calls", [])
                self.call_sources[len(out) - 1, len(calls)] = where
                calls.append({"id": item.call_id, "type": "function",
                              "function": {"name": item.name, "arguments": item.arguments}})
            elif isinstance(item, ReasoningInputItem):
                continue  # (no part of the prompt: module docstring)
            elif isinstance(item, FunctionCallOutputItem):
                content = item.output if isinstance(item.output, str) else _parts(item.output)
                out.append({"role": "tool", "tool_call_id": item.call_id, "content": content})
                self.sources.append(where)
            else:
                content = item.content if isinstance(item.content, str) else _parts(item.content)
                out.append({"role": item.role, "content": content})
                self.sources.append(where)
        return out

    def field_name(self, param: str) -> str:
        """The field of this request that the chat request's field `param` came from."""
        parts = param.split(".")
        head = parts[0]
        if head == "messages":
            if len(parts) < 2 or not parts[1].isdigit() or int(parts[1]) >= len(self.sources):
                return "input"
            k, tail = int(parts[1]), parts[2:]
            if tail[:1] == ["tool_calls"] and len(tail) > 1 and tail[1].isdigit() \
                    and (k, int(tail[1])) in self.call_sources:
                return ".".join([self.call_sources[k, int(tail[1])], *tail[3:]])  # (past "function")
            source = self.sources[k]
            if source.startswith("input.") and tail:
                names = {"content": "output", "tool_call_id": "call_id"} if self.chat.messages[k].role == "tool" \
                    else {}
                return ".".join([source, names.get(tail[0], tail[0]), *tail[1:]])
            return source
        if head == "tools" and parts[2:3] == ["function"]:
            return ".".join(parts[:2] + parts[3:])
        if head == "tool_choice" and parts[1:2] == ["function"]:
            return ".".join(["tool_choice", *parts[2:]])
        if head == "response_format":
            return ".".join(["text.format", *(p for p in parts[1:] if p != "json_schema")])
        renames = {"max_completion_tokens": "max_output_tokens", "max_tokens": "max_output_tokens",
                   "reasoning_effort": "reasoning.effort"}
        return ".".join([renames.get(head, head), *parts[1:]])

    def renamed(self, e: ApiError) -> ApiError:
        """`e`, raised on the chat path, naming the field as this request gave it (its `param`, and its message's
        head where the message starts with it)."""
        if e.param is None:
            return e
        name = self.field_name(e.param)
        message = name + e.message[len(e.param):] if e.message.startswith(e.param) else e.message
        return ApiError(e.status, message, name, e.headers)

    @contextlib.contextmanager
    def fields(self) -> Iterator[None]:
        """Where the chat path runs: its errors are `renamed`."""
        try:
            yield
        except ApiError as e:
            raise self.renamed(e) from None

    # -- the answer ------------------------------------------------------------------------------------------------
    def response(self, rid: str, created: int, model: str, params: SamplingParams, status: str,
                 output: list[dict[str, Any]], usage: dict[str, Any] | None) -> dict[str, Any]:
        """The response object: its `status` ("in_progress", "completed" or "incomplete": cut at
        max_output_tokens), its output items, and the request's settings as it ran them."""
        req = self.req
        return {
            "id": rid, "object": "response", "created_at": created, "status": status, "background": False,
            "error": None,
            "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
            "instructions": req.instructions, "max_output_tokens": req.max_output_tokens, "metadata": req.metadata,
            "model": model, "output": output,
            "parallel_tool_calls": req.parallel_tool_calls is not False, "previous_response_id": None,
            "reasoning": req.reasoning.model_dump() if req.reasoning is not None else None,
            "store": False,  # (nothing is)
            "temperature": params.temperature, "top_p": params.top_p, "top_logprobs": req.top_logprobs,
            "text": {"format": req.text.format.model_dump(by_alias=True, exclude_none=True)}
            if req.text is not None and req.text.format is not None else {"format": {"type": "text"}},
            "tool_choice": (req.tool_choice if isinstance(req.tool_choice, str) else req.tool_choice.model_dump())
            if req.tool_choice is not None else "auto",
            "tools": [t.model_dump(exclude_none=True) for t in req.tools or []],
            "truncation": req.truncation or "disabled", "user": req.user, "usage": usage}

    def output(self, message: dict[str, Any], logprobs: list[dict[str, Any]], status: str) -> list[dict[str, Any]]:
        """The output items of a finished chat message (`ToolPlan.message`'s, `AutoTools.message`'s, or plain text):
        its reasoning as a reasoning item (with --reasoning-parser), its text as a message item (unless it is only
        tool calls), then a function_call item per call; the last one ends with `status`."""
        calls = message.get("tool_calls") or []
        items = [reasoning_item(new_item_id("rs"), message["reasoning"], "completed")] if message.get("reasoning") \
            else []
        if message.get("content") or not calls:
            items.append(message_item(new_item_id("msg"), message.get("content") or "", logprobs, "completed"))
        items += [function_call_item(new_item_id("fc"), c["id"], c["function"]["name"], c["function"]["arguments"],
                                     "completed") for c in calls]
        items[-1]["status"] = status  # (a cut response's last item is the one cut, as a stream ends it)
        return items


def response_usage(usage: dict[str, Any], reasoning_tokens: int = 0) -> dict[str, Any]:
    """A chat usage (`responses.usage_body`) in the Responses shape, its loop counts kept."""
    return {"input_tokens": usage["prompt_tokens"],
            # (cache_write_tokens: the openai client's type requires it; no provider cache is written here)
            "input_tokens_details": {"cached_tokens": usage["prompt_tokens_details"]["cached_tokens"],
                                     "cache_write_tokens": 0},
            "output_tokens": usage["completion_tokens"],
            "output_tokens_details": {"reasoning_tokens": reasoning_tokens},
            "total_tokens": usage["total_tokens"], "loops": usage["loops"], "prefill_loops": usage["prefill_loops"]}


def response_status(finish_reason: str | None) -> str:
    return "incomplete" if finish_reason == "length" else "completed"


def text_part(text: str, logprobs: list[dict[str, Any]]) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": logprobs}


def message_item(item_id: str, text: str | None, logprobs: list[dict[str, Any]], status: str) -> dict[str, Any]:
    """A message output item; `text` None: one just opened in a stream, without its part yet."""
    content = [] if text is None else [text_part(text, logprobs)]
    return {"type": "message", "id": item_id, "status": status, "role": "assistant", "content": content}


def reasoning_item(item_id: str, text: str | None, status: str) -> dict[str, Any]:
    """A reasoning output item; `text` None: one just opened in a stream, without its part yet."""
    content = [] if text is None else [reasoning_part(text)]
    return {"type": "reasoning", "id": item_id, "summary": [], "content": content, "status": status}


def reasoning_part(text: str) -> dict[str, Any]:
    return {"type": "reasoning_text", "text": text}


def function_call_item(item_id: str, call_id: str, name: str, arguments: str, status: str) -> dict[str, Any]:
    return {"type": "function_call", "id": item_id, "call_id": call_id, "name": name, "arguments": arguments,
            "status": status}


def _part_event(item: dict[str, Any], what: str) -> str:
    """The type of the event that adds (or finishes) an item's content part: vLLM's reasoning_part events for a
    reasoning item's text, content_part ones for a message's."""
    return f"response.{'reasoning' if item['type'] == 'reasoning' else 'content'}_part.{what}"


class ResponseEvents:
    """A streamed response's events (`event: <type>` and its JSON, `sequence_number` counting from 0), fed the chat
    path's stream deltas (`delta`): response.created and response.in_progress, then per output item its
    output_item.added, its text's content_part.added and output_text.delta events (a reasoning item's
    reasoning_part.added and reasoning_text.delta, as vLLM names them; a function call's
    function_call_arguments.delta events), and, once the next item starts or the response ends, its output_text.done
    and content_part.done (reasoning_text.done and reasoning_part.done; function_call_arguments.done) and
    output_item.done; last
    response.completed with the whole response, which the items' done events build up, status and usage included
    (an incomplete response too: clients wait for response.completed)."""

    def __init__(self, turn: ResponsesTurn, head: dict[str, Any]) -> None:
        self.turn, self.head = turn, head  # (`head`: `ResponsesTurn.response`'s leading arguments)
        self.numbers = itertools.count()
        self.items: list[dict[str, Any]] = []  # the output items, done ones whole; the last may be open
        self.open = False
        # the logprobs of tokens whose text is not out yet (a character's first bytes): sent with the text's delta
        self.held: list[dict[str, Any]] = []

    def event(self, kind: str, **fields: Any) -> str:
        return f"event: {kind}\n" + sse({"type": kind, "sequence_number": next(self.numbers), **fields})

    def start(self) -> list[str]:
        response = self.turn.response(**self.head, status="in_progress", output=[], usage=None)
        return [self.event("response.created", response=response),
                self.event("response.in_progress", response=response)]

    def where(self) -> dict[str, Any]:
        return {"item_id": self.items[-1]["id"], "output_index": len(self.items) - 1}

    def add(self, item: dict[str, Any]) -> list[str]:
        out = self.close("completed")
        self.items.append(item)
        self.open = True
        return [*out, self.event("response.output_item.added", output_index=len(self.items) - 1, item=item)]

    def open_message(self) -> list[str]:
        """A message item and its text part, started."""
        return self.open_part(message_item(new_item_id("msg"), None, [], "in_progress"), text_part("", []))

    def open_part(self, item: dict[str, Any], part: dict[str, Any]) -> list[str]:
        """An item with one content part (a message's text, a reasoning item's), started."""
        out = self.add(item)
        item["content"].append(part)
        return [*out, self.event(_part_event(item, "added"), **self.where(), content_index=0, part=part)]

    def delta(self, delta: dict[str, Any], logprobs: list[dict[str, Any]]) -> list[str]:
        """The events of one chat stream delta: its text (with its tokens' `logprobs`), or its tool calls' starts
        and argument pieces."""
        out: list[str] = []
        text, reasoning = delta.get("content"), delta.get("reasoning")
        self.held += logprobs  # (a reasoning item has no logprobs: its tokens' go with the message's first text)
        if reasoning:
            if not (self.open and self.items[-1]["type"] == "reasoning"):
                out += self.open_part(reasoning_item(new_item_id("rs"), None, "in_progress"), reasoning_part(""))
            self.items[-1]["content"][0]["text"] += reasoning
            out.append(self.event("response.reasoning_text.delta", **self.where(), content_index=0, delta=reasoning))
        if text:
            if not (self.open and self.items[-1]["type"] == "message"):
                out += self.open_message()
            part = self.items[-1]["content"][0]
            part["text"] += text
            part["logprobs"] += self.held
            out.append(self.event("response.output_text.delta", **self.where(), content_index=0, delta=text,
                                  logprobs=self.held))
            self.held = []
        for call in delta.get("tool_calls", ()):
            self.held = []  # (a call's tokens: a function_call item has no logprobs)
            fn = call.get("function", {})
            if "id" in call:  # (a call's first piece: its id and name)
                out += self.add(function_call_item(new_item_id("fc"), call["id"], fn["name"], "", "in_progress"))
            if fn.get("arguments"):
                self.items[-1]["arguments"] += fn["arguments"]
                out.append(self.event("response.function_call_arguments.delta", **self.where(),
                                      delta=fn["arguments"]))
        return out

    def close(self, status: str) -> list[str]:
        """The done events of the open item, if any, finished with `status`."""
        if not self.open:
            return []
        self.open = False
        item = self.items[-1]
        item["status"] = status
        out = []
        if item["type"] != "function_call":
            part = item["content"][0]
            out += [self.event("response.output_text.done", **self.where(), content_index=0, text=part["text"],
                               logprobs=part["logprobs"]) if item["type"] == "message" else
                    self.event("response.reasoning_text.done", **self.where(), content_index=0, text=part["text"]),
                    self.event(_part_event(item, "done"), **self.where(), content_index=0, part=part)]
        else:
            out.append(self.event("response.function_call_arguments.done", **self.where(), name=item["name"],
                                  arguments=item["arguments"]))
        return [*out, self.event("response.output_item.done", output_index=len(self.items) - 1, item=item)]

    def finish(self, finish_reason: str | None, usage: dict[str, Any]) -> list[str]:
        """The last events: the open item's done ones (an empty message if nothing was generated as text or calls,
        as a whole response has one), and response.completed."""
        status = response_status(finish_reason)
        out = [] if any(i["type"] != "reasoning" for i in self.items) else self.open_message()
        if self.held and self.items[-1]["type"] == "message":  # (tokens whose text never came out)
            self.items[-1]["content"][0]["logprobs"] += self.held
        out += self.close(status)
        response = self.turn.response(**self.head, status=status, output=self.items, usage=usage)
        return [*out, self.event("response.completed", response=response)]
