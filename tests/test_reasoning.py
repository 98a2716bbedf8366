"""The reasoning parsers of thinking models (serve/reasoning_parsers.py), on texts: the whole parse as current vLLM's
`deepseek_r1` and `qwen3` answer it (an opening <think> dropped, the reasoning up to the first </think>, the rest the
content, None if empty; no </think>: all reasoning; qwen3 with enable_thinking false: all content), and the stream's:
every split of a text into two and three pieces sends deltas that join into the whole parse, a tag split across
pieces never shows. Then the chat path's use of them (`ReasoningReplies`): the message's fields, include_reasoning,
and tool_choice "auto"'s calls read from the content alone."""

from __future__ import annotations

import pytest

from loopserve.outputs import CompletionOutput
from loopserve.serve.reasoning_parsers import REASONING_PARSERS, ReasoningReplies, ThinkParser
from loopserve.serve.responses import ChoiceStream
from loopserve.serve.tool_parsers import AutoTools, HermesParser

# text -> (reasoning, content), as vLLM's whole parse answers it with thinking on
PARSES = {
    "<think>\nLet me see.\n</think>\n\nThe answer is 4.": ("\nLet me see.\n", "\n\nThe answer is 4."),
    "Let me see (the template opened the block).</think>4": ("Let me see (the template opened the block).", "4"),
    "cut short while thinking <th": ("cut short while thinking <th", None),
    "still thinking, a </thi": ("still thinking, a </thi", None),
    "<think>no end": ("no end", None),
    "<think></think>": ("", None),
    "</think>only an answer": ("", "only an answer"),
    "a <think> later is reasoning text</think>and a </think> in the content stays": (
        "a <think> later is reasoning text", "and a </think> in the content stays"),
    "<thinking> is not the tag</think>x": ("<thinking> is not the tag", "x"),
    "<thi": ("<thi", None),
    "": ("", None),
}


def _split(text: str) -> list[list[str]]:
    """Every split of `text` into two and into three pieces."""
    n = len(text)
    return [[text[:i], text[i:]] for i in range(n + 1)] + \
        [[text[:i], text[i:j], text[j:]] for i in range(n + 1) for j in range(i, n + 1)]


def _streamed(parser: ThinkParser, pieces: list[str]) -> tuple[str, str]:
    reasoning, content = "", ""
    for piece in pieces:
        r, c = parser.feed(piece)
        reasoning, content = reasoning + r, content + c
    return reasoning + parser.finish(), content


@pytest.mark.parametrize("text", list(PARSES))
def test_whole_parse_as_vllm(text):
    for name in REASONING_PARSERS:  # (both read a thinking output alike)
        assert REASONING_PARSERS[name].parser(None).parse(text) == PARSES[text], name


def test_qwen3_without_thinking_is_all_content():
    """chat_template_kwargs enable_thinking false: qwen3's output has no reasoning, even with tags in it;
    deepseek_r1 takes no such switch."""
    off = {"enable_thinking": False}
    assert REASONING_PARSERS["qwen3"].parser(off).parse("plain answer") == (None, "plain answer")
    assert REASONING_PARSERS["qwen3"].parser(off).parse("a</think>b") == (None, "a</think>b")
    assert REASONING_PARSERS["qwen3"].parser({"enable_thinking": True}).parse("a</think>b") == ("a", "b")
    assert REASONING_PARSERS["deepseek_r1"].parser(off).parse("plain answer") == ("plain answer", None)


@pytest.mark.parametrize("text", list(PARSES))
def test_stream_joins_into_the_whole_parse(text):
    reasoning, content = PARSES[text]
    for pieces in _split(text):
        assert _streamed(ThinkParser(), pieces) == (reasoning, content or ""), pieces


def test_a_tag_split_across_pieces_never_shows():
    """Fed a character at a time, no piece of reasoning or content carries a tag's characters."""
    parser = ThinkParser()
    out = [parser.feed(ch) for ch in "<think>abc</think>def"]
    assert "".join(r for r, _ in out) == "abc" and "".join(c for _, c in out) == "def"
    assert all(not (set(r + c) & set("<>/")) for r, c in out)


def _output(text: str) -> CompletionOutput:
    return CompletionOutput(index=0, text=text, token_ids=[], cumulative_logprob=None, logprobs=None,
                            finish_reason="stop")


CALL = '<tool_call>{"name": "f", "arguments": {"x": 1}}</tool_call>'


def test_replies_message_and_include_reasoning():
    fmt = REASONING_PARSERS["deepseek_r1"]
    message = ReasoningReplies(fmt, None).message(_output("why</think>so"), ChoiceStream())
    assert message == {"role": "assistant", "content": "so", "tool_calls": [], "reasoning": "why"}
    message = ReasoningReplies(fmt, None, include=False).message(_output("why</think>so"), ChoiceStream())
    assert message["reasoning"] is None and message["content"] == "so"
    for tools in (None, AutoTools(HermesParser)):  # all reasoning: content null, with "auto" tools too (it was "")
        message = ReasoningReplies(fmt, None, tools=tools).message(_output("only thinking"), ChoiceStream())
        assert message["content"] is None and message["reasoning"] == "only thinking"


@pytest.mark.parametrize("text", [f"I should call f.</think>Sure. {CALL}", f"thinking about {CALL}, no end",
                                  f"<think>{CALL}</think>plain"])
def test_auto_tools_read_the_content_alone(text):
    """Calls come from the content: a block written while thinking is reasoning text, not a call; whole and streamed
    (every split into two pieces) alike."""
    replies = ReasoningReplies(REASONING_PARSERS["deepseek_r1"], None, tools=AutoTools(HermesParser))
    reasoning, content = REASONING_PARSERS["deepseek_r1"].parser(None).parse(text)
    sent = ChoiceStream()
    message = replies.message(_output(text), sent)
    expect_calls = content is not None and CALL in content
    assert message["reasoning"] == reasoning
    assert [c["function"]["name"] for c in message["tool_calls"]] == (["f"] if expect_calls else [])
    assert replies.finish_reason(_output(text), sent) == ("tool_calls" if expect_calls else "stop")
    for i in range(len(text) + 1):
        sent = ChoiceStream()
        deltas = [replies.delta(text[:i], False, sent), replies.delta(text[i:], True, sent)]
        assert "".join(d.get("reasoning", "") for d in deltas) == reasoning
        assert "".join(d.get("content", "") for d in deltas) == (message["content"] or "")
        names = [c["function"]["name"] for d in deltas for c in d.get("tool_calls", ()) if "id" in c]
        assert names == (["f"] if expect_calls else [])
