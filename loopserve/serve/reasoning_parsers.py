"""A thinking model's reasoning apart from its answer (vLLM's `--reasoning-parser NAME`): the parsers by name
(`REASONING_PARSERS`), `ThinkParser`, which splits an output at its think tags whole or piece by piece, and
`ReasoningReplies`, how the chat path answers with one (the message's `reasoning` beside its `content`, a stream's
reasoning deltas before its content deltas, tool_choice "auto"'s calls read from the content alone).

Both formats are <think>...</think>, read as current vLLM reads them: a <think> that opens the output is dropped
(a chat template may open it in the prompt instead: Ouro's Thinking template with enable_thinking, DeepSeek R1's,
Qwen3.5's), everything up to the first </think> is the reasoning and what follows the content (None if empty); an
output with no </think> is all reasoning (cut short while thinking). `qwen3` differs in one thing: a request whose
chat_template_kwargs say `enable_thinking: false` (the template then leaves the model no think block) has no
reasoning, its whole text is the content.

Streamed, the same parse piece by piece, so that a stream's pieces join into the whole answer's reasoning and
content: a piece's tail that may be the start of a tag (`<th`) is held until the next piece says, so a tag split
across pieces never shows. Unlike vLLM's stream, which reads tags by token id, tags are read in the text (a
tokenizer need not have them as single tokens), and only a <think> that opens the output is a tag (vLLM's whole
parse drops the text before a later <think> too, which a stream cannot take back once sent)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from loopserve.outputs import CompletionOutput
from loopserve.serve.responses import ChoiceStream
from loopserve.serve.tool_parsers import AutoTools, tag_start

START, END = "<think>", "</think>"


class ThinkParser:
    """One choice's output, read piece by piece (`feed`, then `finish`) into its reasoning and its content (module
    docstring); `parse` reads a whole text. `thinking` false: no reasoning, all content."""

    def __init__(self, thinking: bool = True) -> None:
        self.at = "start" if thinking else "content"  # "start" (nothing read but a prefix of <think>), "reasoning"
        self.pending = ""  # the end of the text read that may begin a tag
        self.thinking = thinking

    def feed(self, piece: str) -> tuple[str, str]:
        """The reasoning and the content of the next piece of text."""
        text, self.pending = self.pending + piece, ""
        if self.at == "start":
            if text.startswith(START):
                text, self.at = text[len(START):], "reasoning"
            elif START.startswith(text):  # (all of it may still become <think>)
                self.pending = text
                return "", ""
            else:
                self.at = "reasoning"
        if self.at == "content":
            return "", text
        end = text.find(END)
        if end >= 0:
            self.at = "content"
            return text[:end], text[end + len(END):]
        keep = tag_start(text, END)
        self.pending = text[len(text) - keep:]
        return text[:len(text) - keep], ""

    def finish(self) -> str:
        """The reasoning the end of the text leaves: what was held as a possible tag was reasoning after all."""
        rest, self.pending = self.pending, ""
        return rest

    def parse(self, text: str) -> tuple[str | None, str | None]:
        """A whole output's reasoning (None where there is none: `thinking` false) and content (None if empty)."""
        reasoning, content = self.feed(text)
        reasoning += self.finish()
        return (reasoning if self.thinking else None), content or None


@dataclass(frozen=True)
class ThinkFormat:
    """A --reasoning-parser choice: `switchable`, a request's chat_template_kwargs `enable_thinking: false` turns
    reasoning off (qwen3's templates then write no think block for the model to fill)."""

    switchable: bool = False

    def parser(self, template_kwargs: dict[str, Any] | None) -> ThinkParser:
        return ThinkParser(not (self.switchable and (template_kwargs or {}).get("enable_thinking") is False))


# --reasoning-parser's choices: name -> its format (module docstring)
REASONING_PARSERS: dict[str, ThinkFormat] = {"deepseek_r1": ThinkFormat(), "qwen3": ThinkFormat(switchable=True)}


@dataclass(frozen=True)
class ReasoningReplies:
    """How the chat path answers with the server's --reasoning-parser: `ToolPlan`'s methods (as `AutoTools` has
    them) for an output split into reasoning and content; each choice's parser is kept in its `ChoiceStream`.
    `include`: the request's include_reasoning (false: the reasoning is dropped, vLLM's field); `tools`: tool_choice
    "auto"'s reader of calls, fed the content alone."""

    fmt: ThinkFormat
    template_kwargs: dict[str, Any] | None
    include: bool = True
    tools: AutoTools | None = None

    def split(self, text: str) -> tuple[str | None, str | None]:
        """A whole output's reasoning and content."""
        return self.fmt.parser(self.template_kwargs).parse(text)

    def message(self, c: CompletionOutput, sent: ChoiceStream) -> dict[str, Any]:
        """The assistant message of a finished output: its reasoning (vLLM's `reasoning` field, null where there is
        none or it is not to be included), its content, and its tool calls."""
        reasoning, content = self.split(c.text)
        if self.tools is not None:
            message = self.tools.message(dataclasses.replace(c, text=content or ""), sent)
            if content is None:  # (all reasoning: no content, null as without tools; the parser reads "" as text)
                message["content"] = None
        else:
            message = {"role": "assistant", "content": content, "tool_calls": []}
        return {**message, "reasoning": reasoning if self.include else None}

    def delta(self, piece: str, finished: bool, sent: ChoiceStream) -> dict[str, Any]:
        """A stream chunk's delta for one choice's new text `piece` (`finished`: its last): the reasoning in it, then
        the content (the calls read from it, with "auto")."""
        if sent.reason_parse is None:
            sent.reason_parse = self.fmt.parser(self.template_kwargs)
        reasoning, content = sent.reason_parse.feed(piece)
        if finished:
            reasoning += sent.reason_parse.finish()
        if self.tools is not None:
            delta = self.tools.delta(content, finished, sent)
        else:
            delta = {"content": content} if content else {}
        return {**({"reasoning": reasoning} if reasoning and self.include else {}), **delta}

    def finish_reason(self, c: CompletionOutput, sent: ChoiceStream) -> str | None:
        return self.tools.finish_reason(c, sent) if self.tools is not None else c.finish_reason

    def reasoning_tokens(self, ids: list[int], decode: Callable[[list[int]], str]) -> int:
        """How many of an output's token `ids` are its reasoning (vLLM's reasoning_tokens, whether or not the reply
        includes it): those before the token whose text completes </think> (found by decoding prefixes, a binary
        search: a tag need not be one token), all of them where none does, none where thinking is off."""
        if not self.fmt.parser(self.template_kwargs).thinking:
            return 0
        if END not in decode(ids):
            return len(ids)
        low, high = 1, len(ids)  # the shortest prefix that holds </think>
        while low < high:
            mid = (low + high) // 2
            low, high = (low, mid) if END in decode(ids[:mid]) else (mid + 1, high)
        return low - 1
