"""Chat messages as OpenAI's API (and vLLM) takes them: the roles there are, what each message must hold,
and the plain form a chat template receives (the content as text). `LLM.chat` and the server's chat
endpoints both check conversations here, so they take and refuse the same ones; an error names the
field (`messages.<i>.<field>`)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

ROLES = ("system", "developer", "user", "assistant", "tool")


def message_text(content: Any) -> str:
    """A checked message's content as text: a string as it is, the text parts one per line (vLLM joins them
    so), none as ""."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    return "\n".join(part["text"] for part in content)


def chat_messages(messages: Any, where: str = "messages") -> list[dict[str, Any]]:
    """The messages of one conversation, checked, as the chat template gets them: each a copy of the
    message with its content as text (`message_text`); other keys (tool_calls, tool_call_id, ...) are kept.
    ValueError naming `<where>.<i>.<field>`.

    A message has a known role; its content is a string or a list of {"type": "text", "text": ...} parts, or
    null or left out, which renders as empty text (as vLLM takes it, in any role: a client replaying a
    conversation sends an assistant turn without content, for one); `name`, if given, is a string."""
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
        if not isinstance(role, str) or role not in ROLES:
            raise ValueError(f"{at}.role: must be one of {', '.join(ROLES)}; got {role!r}")
        content = m.get("content")
        if content is not None and not isinstance(content, str):
            if isinstance(content, Mapping) or not isinstance(content, Sequence):
                raise ValueError(f"{at}.content: must be a string or a list of text parts, "
                                 f"got {type(content).__name__}")
            for j, part in enumerate(content):
                if not (isinstance(part, Mapping) and part.get("type") == "text"):
                    raise ValueError(f"{at}.content.{j}: must be a text part ({{'type': 'text', 'text': ...}})")
                if not isinstance(part.get("text"), str):
                    raise ValueError(f"{at}.content.{j}.text: must be a string")
        name = m.get("name")
        if name is not None and not isinstance(name, str):
            raise ValueError(f"{at}.name: must be a string, got {type(name).__name__}")
        plain = {**m, "content": message_text(content)}
        if name is None:
            plain.pop("name", None)
        out.append(plain)
    return out
