"""Tool calls in the model's own format, for tool_choice "auto" (vLLM's `--enable-auto-tool-choice --tool-call-parser
NAME`): the parsers by name (`TOOL_PARSERS`; Hermes' only, for now) and `AutoTools`, how the chat path answers an
"auto" request with one: the model generates freely (no grammar, unless a grammar field of the request asks for one,
as vLLM lets `structured_outputs` beside "auto"), and its text is read for calls, whole or, streamed, as it comes.

The Hermes format (Hermes 2 Pro and 3, Qwen 2.5 and 3, ...): text, then calls, each
`<tool_call>{"name": ..., "arguments": {...}}</tool_call>` (any whitespace around the JSON). As vLLM's `hermes` parser
answers a whole output: the message's content is the text before the first <tool_call> (None if empty), each block
a call (an id in the chat path's form, its name, and its arguments as JSON text) and finish_reason "tool_calls"; a
last block left open (the output ended in it) is read as one too; a block that is not a JSON object with a string
"name" (and no keys but "name" and "arguments", none repeated, where vLLM reads a repeated key's last value; a name
any response can carry, not a lone surrogate escape; nesting Python's parser reads) leaves no calls and the whole
text as content, with the engine's finish reason. Unlike vLLM's, a call's
arguments are the raw text of its "arguments" value, as "required"'s are (vLLM re-serializes them: the same text for
the `json.dumps` spacing such models write), and a call without "arguments" has {} (OpenAI's reading; vLLM drops
the whole parse); text after the first block, between or after blocks, is dropped (vLLM's whole parse drops it,
while its stream sends it as content).

Streamed, the same parse piece by piece, so that a stream's pieces join into the whole answer's content and calls:
content as it comes until a <tool_call> starts (a piece's tail that could be the start of the tag is held until the
next piece says; a tag split across pieces never shows as content), then per call its index, id and name once the
name's string is complete, then its arguments in pieces as they come (`structured.ToolListScanner`, one per block).
A stream cannot take back what it sent: if no call was named by the end, the text from the first <tool_call> on is
sent as content (as the whole answer has it); once a call was named, finish_reason is "tool_calls" and the calls sent
stay, where the whole answer, which reads every block as JSON at its end, would be text: a block found not to be a
call only at its end (JSON broken after the name, text before or after the object, other keys, a repeated key: the
stream keeps the first arguments, nesting too deep, a "</tool_call>" inside a string, which ends the block there), or
a block that is not JSON before a good one (whose call the stream sends).
A model that writes well-formed blocks gets the same answer both ways.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from loopserve.outputs import CompletionOutput
from loopserve.serve.responses import ChoiceStream
from loopserve.serve.structured import ToolEvent, ToolListScanner, tool_call_entries


def tag_start(text: str, tag: str) -> int:
    """The length of the longest end of `text` that begins `tag` (without being all of it): held back until the next
    piece says whether the tag goes on."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0


class _Pairs(list):
    """A JSON object's (key, value) pairs in their order, repeated keys kept."""


def _is_call(block: str) -> bool:
    """Whether a block's text is a call: a JSON object with a string "name" any response can carry (no lone surrogate
    escape) and no keys but "name" and "arguments", none repeated (a repeated key's value would be lost, or two
    values' texts joined; keys but these two: another format's call, {"name", "parameters"} say, whose arguments would
    be lost). Nesting too deep for Python's parser is not a call either (vLLM's parse reads any failure so)."""
    try:
        # (the top-level object's pairs, as listed; integers read as floats: past 4,300 digits Python refuses to read
        # an int, where the arguments, passed on as their text, are JSON all the same)
        pairs = json.loads(block, object_pairs_hook=_Pairs, parse_int=float)
    except (ValueError, RecursionError):
        return False
    if not isinstance(pairs, _Pairs):
        return False
    keys = [k for k, _ in pairs]
    name = dict(pairs).get("name")
    if len(set(keys)) != len(keys) or not set(keys) <= {"name", "arguments"} or not isinstance(name, str):
        return False
    try:
        name.encode()
    except UnicodeEncodeError:
        return False
    return True


class HermesParser:
    """One choice's output in the Hermes format, read piece by piece (`feed`, then `finish`): content before the first
    <tool_call>, then each block's call (module docstring). `parse` reads a whole text."""

    START, END = "<tool_call>", "</tool_call>"

    def __init__(self) -> None:
        self.pending = ""  # the end of the text read that may begin the next tag
        self.started = False  # a <tool_call> was seen: no more content
        self.in_block = False  # after a <tool_call> whose end tag has not come
        self.scan: ToolListScanner | None = None  # the open block's (None: it has a string JSON cannot read)
        self.block: list[str] = []  # the open block's text
        self.block_arguments = False  # the open block's call has arguments
        self.calls = 0  # calls named so far (blocks closed, and the open one if named)
        self.named_before = 0  # calls named before the open block
        self.valid = True  # every block closed so far is a call
        self.sent = 0  # characters sent as content
        self.text: list[str] | None = []  # the text read, kept until a call is named (none: the rest is content)

    def feed(self, piece: str) -> tuple[str, list[ToolEvent]]:
        """The content and the call events (`ToolListScanner.feed`'s, calls numbered across blocks) of the next
        piece of text."""
        if self.text is not None:
            self.text.append(piece)
        text, self.pending = self.pending + piece, ""
        content: list[str] = []
        events: list[ToolEvent] = []
        while text:
            if self.in_block:  # up to its end tag
                end = text.find(self.END)
                if end < 0:
                    keep = tag_start(text, self.END)
                    self._block_text(text[:len(text) - keep], events)
                    self.pending = text[len(text) - keep:]
                    break
                self._block_text(text[:end], events)
                self._close(events)
                text = text[end + len(self.END):]
                continue
            start = text.find(self.START)
            if start < 0:
                keep = tag_start(text, self.START)
                if not self.started:
                    content.append(text[:len(text) - keep])
                self.pending = text[len(text) - keep:]
                break
            if not self.started:
                content.append(text[:start])
            self.started = True  # (text between and after blocks is dropped, as vLLM's whole parse drops it)
            self.in_block, self.scan = True, ToolListScanner(1, "arguments")
            self.block_arguments = False
            text = text[start + len(self.START):]
        out = "".join(content)
        self.sent += len(out)
        return out, events

    def finish(self) -> tuple[str, list[ToolEvent]]:
        """The content and events the end of the text makes: a block left open is read as closed (vLLM's rule); the
        held tail is content before any <tool_call>; with no call named, the text from the first <tool_call> on is
        content (the output was text after all)."""
        events: list[ToolEvent] = []
        if self.in_block:
            self._block_text(self.pending, events)
            self._close(events)
        if self.text is not None:  # no call named
            rest = "".join(self.text)[self.sent:]
            self.sent += len(rest)
            return rest, events
        return "", events

    def _block_text(self, text: str, events: list[ToolEvent]) -> None:
        self.block.append(text)
        if self.scan is None or not text:
            return
        try:
            found = self.scan.feed(text)
        except ValueError:  # (a string JSON cannot read: no call is read from the rest of the block)
            self.scan = None
            return
        for index, name, piece in found:
            if name is not None:
                self.calls, self.text = self.named_before + index + 1, None
            else:
                self.block_arguments = True
            events.append((self.named_before + index, name, piece))

    def _close(self, events: list[ToolEvent]) -> None:
        """The open block's end: a call named without arguments gets {}; the block must be a call."""
        if self.calls > self.named_before and not self.block_arguments:
            events.append((self.calls - 1, None, "{}"))
        self.valid = self.valid and _is_call("".join(self.block))
        self.in_block, self.scan, self.block = False, None, []
        self.named_before = self.calls

    def parse(self, text: str) -> tuple[str | None, list[dict[str, Any]]]:
        """A whole output's content (None if empty) and tool calls (`message.tool_calls` entries); no calls and the
        whole text as content where any block is not a call."""
        content, events = self.feed(text)
        more, tail = self.finish()
        if not (self.calls and self.valid):
            return text, []
        entries = tool_call_entries(events + tail)
        return (content + more) or None, [{k: v for k, v in e.items() if k != "index"} for e in entries]


# --tool-call-parser's choices: name -> the parser of that format (one per choice, made when the choice starts)
TOOL_PARSERS: dict[str, type[HermesParser]] = {"hermes": HermesParser}


@dataclass(frozen=True)
class AutoTools:
    """How the chat path answers tool_choice "auto" with the server's --tool-call-parser: `ToolPlan`'s methods for
    a parsed output (module docstring); each choice's parser is kept in its `ChoiceStream`."""

    parser: type[HermesParser]
    single: bool = False  # parallel_tool_calls false: the first call only (vLLM's answer), whole and streamed

    def message(self, c: CompletionOutput, sent: ChoiceStream) -> dict[str, Any]:
        """The assistant message of a finished output: its content and tool calls."""
        content, calls = self.parser().parse(c.text)
        sent.called = bool(calls)
        return {"role": "assistant", "content": content, "tool_calls": calls[:1] if self.single else calls}

    def delta(self, piece: str, finished: bool, sent: ChoiceStream) -> dict[str, Any]:
        """A stream chunk's delta for one choice's new text `piece` (`finished`: its last)."""
        if sent.tool_parse is None:
            sent.tool_parse = self.parser()
        content, events = sent.tool_parse.feed(piece)
        if finished:
            more, tail = sent.tool_parse.finish()
            content, events = content + more, events + tail
        sent.called = sent.tool_parse.calls > 0
        if self.single:
            events = [e for e in events if e[0] == 0]
        return {**({"content": content} if content else {}),
                **({"tool_calls": tool_call_entries(events)} if events else {})}

    def finish_reason(self, c: CompletionOutput, sent: ChoiceStream) -> str | None:
        """"tool_calls" where the output is calls (vLLM's answer, whatever ended it), else the engine's reason."""
        return "tool_calls" if sent.called else c.finish_reason
