"""Chat messages as OpenAI's API (and vLLM) takes them: what each message must hold (its role any non-empty string),
and the plain form a chat template receives. `LLM.chat` and the server's chat endpoints both check
conversations here, so they take and refuse the same ones, and a template gets the same messages from
either: the keys of `TEMPLATE_KEYS` that are set, checked and normalized, and nothing else. An error names
the field (`messages.<i>.<field>`, down to `messages.<i>.tool_calls.<j>.function.arguments`)."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

# a text part's types: OpenAI's chat "text", and the Responses API's "input_text" and "output_text" (vLLM reads all)
TEXT_PARTS = ("text", "input_text", "output_text")
# and an assistant's refusal, {"type": "refusal", "refusal": ...}, which an OpenAI conversation replays: its text
# (vLLM's reading)
REFUSAL_PART = "refusal"


def other_part(part: Any) -> str | None:
    """Why a content part of another type than text's (an image, audio, a file, a video: OpenAI's and vLLM's
    multimodal parts) is refused, naming its type; None for a text part, or a part without a type that is a string
    (the checks of its shape say what is wrong with it)."""
    kind = part.get("type") if isinstance(part, Mapping) else None
    if not isinstance(kind, str) or kind in (*TEXT_PARTS, REFUSAL_PART):
        return None
    return (f"{kind!r} parts are not supported: this model takes text only (parts of type "
            f"{', '.join(map(repr, TEXT_PARTS))}, or an assistant's {REFUSAL_PART!r})")


def part_text(part: Mapping[str, Any]) -> str:
    """A checked content part's text."""
    return part[REFUSAL_PART] if part.get("type") == REFUSAL_PART else part["text"]


# what a chat template may read of a message, as vLLM passes them; the server reports any other field as ignored
TEMPLATE_KEYS = ("role", "content", "name", "tool_calls", "tool_call_id")
TOOL_CALL_KEYS = ("id", "type", "function")
FUNCTION_KEYS = ("name", "arguments")


def message_text(content: Any) -> str:
    """A checked message's content as text: a string as it is, the text parts one per line (vLLM joins them
    so), none as ""."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    return "\n".join(part_text(part) for part in content)


def chat_messages(messages: Any, where: str = "messages", ignored: list[str] | None = None) -> list[dict[str, Any]]:
    """The messages of one conversation, checked, as the chat template gets them: each holds the keys of
    `TEMPLATE_KEYS` the message sets (a null counts as unset), the content always, as text (`message_text`).
    Other keys are left out, and their paths (`<where>.<i>.<key>`) appended to `ignored` if it is given.
    ValueError naming `<where>.<i>.<field>`.

    A message has a role, a non-empty string: OpenAI's, or any other the chat template renders (vLLM passes them
    on); its content is a string or a list of {"type": "text", "text": ...} parts (or
    `TEXT_PARTS`' other types, or an assistant's {"type": "refusal", "refusal": ...}), or
    null or left out, which renders as empty text (as vLLM takes it, in any role: a client replaying a
    conversation sends an assistant turn without content, for one); `name`, if given, is a string. Only an
    assistant message may carry `tool_calls` (as `tool_calls` checks them), and only a tool message a
    `tool_call_id` (a string: the call it answers)."""
    if isinstance(messages, str | Mapping) or not isinstance(messages, Sequence):
        raise ValueError(f"{where}: expected a list of {{'role': ..., 'content': ...}} objects, "
                         f"got {type(messages).__name__}")
    if not messages:
        raise ValueError(f"{where}: must not be empty")
    out = []
    for i, m in enumerate(messages):
        at = f"{where}.{i}"
        if not isinstance(m, Mapping):
            raise ValueError(f"{at}: expected an object with 'role' and 'content', got {type(m).__name__}")
        role = m.get("role")
        if role is None:
            raise ValueError(f"{at}.role: field required")
        if not isinstance(role, str) or not role:
            # (OpenAI's system, developer, user, assistant, tool, or a role of the template's own, as vLLM takes it)
            raise ValueError(f"{at}.role: must be a non-empty string (user, assistant, system, ... or a role the "
                             f"chat template knows); got {role!r}")
        content = m.get("content")
        if content is not None and not isinstance(content, str):
            if isinstance(content, Mapping) or not isinstance(content, Sequence):
                raise ValueError(f"{at}.content: must be a string or a list of text parts, "
                                 f"got {type(content).__name__}")
            for j, part in enumerate(content):
                why = other_part(part)
                if why is not None:
                    raise ValueError(f"{at}.content.{j}.type: {why}")
                if not (isinstance(part, Mapping) and part.get("type") in (*TEXT_PARTS, REFUSAL_PART)):
                    raise ValueError(f"{at}.content.{j}: must be a text part ({{'type': 'text', 'text': ...}})")
                key = REFUSAL_PART if part["type"] == REFUSAL_PART else "text"
                if not isinstance(part.get(key), str):
                    raise ValueError(f"{at}.content.{j}.{key}: must be a string")
        plain: dict[str, Any] = {"role": role, "content": message_text(content)}
        name = m.get("name")
        if name is not None:
            if not isinstance(name, str):
                raise ValueError(f"{at}.name: must be a string, got {type(name).__name__}")
            plain["name"] = name
        calls = m.get("tool_calls")
        if calls is not None:
            # OpenAI refuses them elsewhere; dropping them, as vLLM does, would hide the client's mistake
            if role != "assistant":
                raise ValueError(f"{at}.tool_calls: only an assistant message has tool calls (this one is {role!r})")
            plain["tool_calls"] = tool_calls(calls, f"{at}.tool_calls", ignored)
        call_id = m.get("tool_call_id")
        if call_id is not None:
            if not isinstance(call_id, str):
                raise ValueError(f"{at}.tool_call_id: must be a string, got {type(call_id).__name__}")
            if role != "tool":  # as tool_calls above
                raise ValueError(f"{at}.tool_call_id: only a tool message answers a tool call (this one is {role!r})")
            plain["tool_call_id"] = call_id
        if ignored is not None:
            ignored += [f"{at}.{k}" for k in m if k not in TEMPLATE_KEYS]
        out.append(plain)
    return out


def check_continuable(messages: Sequence[Mapping[str, Any]]) -> None:
    """`continue_final_message`'s rule: there is a final message to continue, whatever its role (vLLM's, as
    transformers': the model goes on with it, a user's text too). The tokenizer checks it (for `LLM.chat` and the
    server too). ValueError naming `messages`."""
    if not messages:
        raise ValueError("messages: continue_final_message needs a final message to continue")


def within(error: ValueError, where: str) -> ValueError:
    """`error`, one that names a field of a conversation (`messages...: ...`, as the tokenizer's do), naming that
    field as it is under `where` instead (`messages.<i>`: the conversation of a batch); any other as it is."""
    message = str(error)
    head = message.split(":", 1)[0]
    if where == "messages" or not (head == "messages" or head.startswith("messages.")):
        return error
    return ValueError(where + message.removeprefix("messages"))


def tool_calls(calls: Any, where: str, ignored: list[str] | None = None) -> list[dict[str, Any]]:
    """An assistant message's tool calls (`where`: their field), checked, as a chat template gets them:
    OpenAI's [{"id": str, "type": "function", "function": {"name": str, "arguments": str}}], where `id` and
    `type` may be left out (some clients do; `type` then reads "function"), and `arguments` is the JSON text of
    an object or (from Python) a mapping. The template gets the arguments as a dict, as vLLM passes them: the
    tool-use templates of Hugging Face models iterate over them or dump them with `tojson`; an empty string
    is taken as no arguments ({}), as vLLM takes it. Other keys are left out (their paths added to `ignored`).
    ValueError naming `<where>.<j>.<field>`."""
    if isinstance(calls, str | Mapping) or not isinstance(calls, Sequence):
        raise ValueError(f"{where}: must be a list of tool calls, got {type(calls).__name__}")
    out = []
    for j, call in enumerate(calls):
        at = f"{where}.{j}"
        if not isinstance(call, Mapping):
            raise ValueError(f"{at}: must be a tool call ({{'id': ..., 'type': 'function', 'function': "
                             f"{{'name': ..., 'arguments': ...}}}}), got {type(call).__name__}")
        call_id, kind, fn = call.get("id"), call.get("type"), call.get("function")
        if call_id is not None and not isinstance(call_id, str):
            raise ValueError(f"{at}.id: must be a string, got {type(call_id).__name__}")
        if kind is not None and kind != "function":
            raise ValueError(f"{at}.type: must be 'function', got {kind!r}")
        if fn is None:
            raise ValueError(f"{at}.function: field required")
        if not isinstance(fn, Mapping):
            raise ValueError(f"{at}.function: must be an object with 'name' and 'arguments', got {type(fn).__name__}")
        name = fn.get("name")
        if name is None:
            raise ValueError(f"{at}.function.name: field required")
        if not isinstance(name, str):
            raise ValueError(f"{at}.function.name: must be a string, got {type(name).__name__}")
        one: dict[str, Any] = {} if call_id is None else {"id": call_id}
        one["type"] = "function"
        one["function"] = {"name": name, "arguments": _arguments(fn.get("arguments"), f"{at}.function.arguments")}
        if ignored is not None:
            ignored += [f"{at}.{k}" for k in call if k not in TOOL_CALL_KEYS]
            ignored += [f"{at}.function.{k}" for k in fn if k not in FUNCTION_KEYS]
        out.append(one)
    return out


def _arguments(args: Any, where: str) -> dict[str, Any]:
    if args is None:
        raise ValueError(f"{where}: field required")
    if isinstance(args, Mapping):
        return dict(args)
    if not isinstance(args, str):
        raise ValueError(f"{where}: must be a JSON object as text (or a mapping), got {type(args).__name__}")
    if args == "":
        return {}
    try:
        parsed = json.loads(args)
    except (ValueError, RecursionError) as e:
        raise ValueError(f"{where}: must be a JSON object as text, got text that is not JSON ({e})") from None
    if not isinstance(parsed, dict):
        raise ValueError(f"{where}: must be a JSON object as text, got a JSON {_json_kind(parsed)}")
    return parsed


def _json_kind(value: Any) -> str:
    if isinstance(value, list):
        return "array"
    if isinstance(value, str):
        return "string"
    if isinstance(value, bool):
        return "boolean"
    return "null" if value is None else "number"
