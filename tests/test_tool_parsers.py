"""The Hermes parser of a model's own tool calls (serve/tool_parsers.py), on texts: the whole parse as vLLM's `hermes`
parser answers it (content before the first <tool_call>, a call per block, the whole text as content where a block is
not a call), and the stream's: every split of a text into two and three pieces sends deltas that join into the whole
parse (the same content, the same calls), a tag split across pieces never shows as content."""

from __future__ import annotations

import pytest

from loopserve.outputs import CompletionOutput
from loopserve.serve.responses import ChoiceStream
from loopserve.serve.tool_parsers import TOOL_PARSERS, AutoTools, HermesParser

CALL = '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}</tool_call>'
TEXTS = [
    "plain text, no call",
    "ends with a tag's start <tool_ca",
    "a < b and </tool_call> alone is text",
    CALL,
    "Sure. " + CALL,
    # whitespace around the JSON, the name after the arguments, escapes and tags' characters inside strings
    '<tool_call>\n{"arguments": {"q": "<tool_call>\\"}{", "n": [1, {"a": null}]}, "name": "se\\u00e9"}\n</tool_call>'
    '\n<tool_call>{"name": "b", "arguments": {}}</tool_call>',
    '<tool_call>{"name": "no_arguments"}</tool_call> after the calls: dropped',
    'text <tool_call>{"name": "f", "arguments": {"x": 1}}',  # the output ended inside the block
    "text <tool_call>{not json}</tool_call>",
    'text <tool_call>{"arguments": {"x": 1}}</tool_call>',  # no name
    '<tool_call>{"name": 5, "arguments": {}}</tool_call>',  # a name that is no string
    "<tool_call>",
]


def _output(text: str, finish_reason: str | None = "stop") -> CompletionOutput:
    return CompletionOutput(index=0, text=text, token_ids=[], cumulative_logprob=None, logprobs=None,
                            finish_reason=finish_reason)


def _whole(text: str) -> tuple[str, list[tuple[str, str]], str | None]:
    """The whole answer's content ("" for None), calls (name, arguments) and finish reason."""
    tools, sent = AutoTools(HermesParser), ChoiceStream()
    message = tools.message(_output(text), sent)
    calls = [(c["function"]["name"], c["function"]["arguments"]) for c in message["tool_calls"]]
    assert all(c["type"] == "function" and c["id"].startswith("chatcmpl-tool-") for c in message["tool_calls"])
    assert message["content"] != ""  # (None where empty, as vLLM answers)
    return message["content"] or "", calls, tools.finish_reason(_output(text), sent)


def _streamed(pieces: list[str]) -> tuple[str, list[tuple[str, str]], str | None]:
    """A stream's content and calls, its deltas joined (each call's id, type and name once, first), and its finish
    reason."""
    tools, sent = AutoTools(HermesParser), ChoiceStream()
    content, calls = "", {}
    for k, piece in enumerate(pieces):
        delta = tools.delta(piece, k == len(pieces) - 1, sent)
        assert set(delta) <= {"content", "tool_calls"} and all(delta.values())
        content += delta.get("content", "")
        for e in delta.get("tool_calls", ()):
            if "id" in e:
                assert e["index"] == len(calls) and e["type"] == "function" and e["function"]["name"] is not None
                calls[e["index"]] = [e["function"]["name"], ""]
            else:
                assert set(e) == {"index", "function"} and set(e["function"]) == {"arguments"}
            calls[e["index"]][1] += e["function"]["arguments"]
    return content, [(n, a) for n, a in calls.values()], tools.finish_reason(_output("", "stop"), sent)


def test_whole_parse_as_vllm_answers_it():
    assert _whole("plain text, no call") == ("plain text, no call", [], "stop")
    assert _whole("Sure. " + CALL) == ("Sure. ", [("get_weather", '{"city": "Paris", "days": 3}')], "tool_calls")
    assert _whole(TEXTS[5]) == ("", [("se\u00e9", '{"q": "<tool_call>\\"}{", "n": [1, {"a": null}]}'),
                                     ("b", "{}")], "tool_calls")
    assert _whole(TEXTS[6]) == ("", [("no_arguments", "{}")], "tool_calls")  # (text after the calls: dropped)
    assert _whole(TEXTS[7]) == ("text ", [("f", '{"x": 1}')], "tool_calls")  # (a block left open: read as one)
    for text in TEXTS[8:]:  # a block that is not a call: the whole text is content
        assert _whole(text) == (text, [], "stop")


def test_a_bad_block_after_a_good_one_makes_the_whole_text_content():
    for bad in ("oops", '{"name": 5, "arguments": {}}'):
        text = CALL + f"<tool_call>{bad}</tool_call>"
        assert _whole(text) == (text, [], "stop")


def test_a_block_of_another_format_is_text_not_a_call_without_its_arguments():
    """{"name", "parameters"} (another format's keys): text, as vLLM's hermes answers it (it was a call with
    arguments {}, the model's arguments lost)."""
    text = '<tool_call>{"name": "f", "parameters": {"a": 1}}</tool_call>'
    assert _whole(text) == (text, [], "stop")


@pytest.mark.parametrize("text", TEXTS)
def test_every_split_in_two_and_three_streams_the_whole_parse(text):
    content, calls, finish = _whole(text)
    for i in range(len(text) + 1):
        assert _streamed([text[:i], text[i:]]) == (content, calls, finish), i
        for j in range(i, len(text) + 1, 3):
            assert _streamed([text[:i], text[i:j], text[j:]]) == (content, calls, finish), (i, j)


def test_character_by_character_a_tag_never_shows_as_content_and_a_call_streams_its_arguments():
    text = "Sure. " + CALL
    tools, sent = AutoTools(HermesParser), ChoiceStream()
    deltas = [tools.delta(c, k == len(text) - 1, sent) for k, c in enumerate(text)]
    assert "".join(d.get("content", "") for d in deltas) == "Sure. "
    named = [k for k, d in enumerate(deltas) if any("id" in e for e in d.get("tool_calls", ()))]
    assert named == [text.index('"get_weather"') + len('"get_weather"') - 1]  # as soon as the name's string closes
    assert sum(1 for d in deltas for e in d.get("tool_calls", ()) if e["function"]["arguments"]) > 10


def test_a_stream_keeps_the_calls_it_sent_before_a_bad_block():
    """A stream cannot take back a call: a later block that is not JSON leaves it (the whole answer is text)."""
    text = CALL + "<tool_call>oops</tool_call>"
    assert _streamed([text]) == ("", [("get_weather", '{"city": "Paris", "days": 3}')], "tool_calls")


def test_an_unreadable_string_ends_the_blocks_calls_without_an_error():
    text = '<tool_call>{"name": "bad\\q", "arguments": {}}</tool_call>'
    assert _whole(text) == (text, [], "stop")
    assert _streamed([text[:20], text[20:]]) == (text, [], "stop")


def test_a_block_no_response_can_carry_or_python_cannot_read_is_text():
    """A name with a lone surrogate escape (no response can encode it: a 500, and a stream cut without its error
    event), nesting past Python's parser (RecursionError: a 500) and a repeated key (arguments whose texts joined
    into no JSON, or a name read first where vLLM reads the last): the block is not a call, whole or streamed
    where the stream can still say so."""
    surrogate = '<tool_call>{"name": "\\ud83d", "arguments": {}}</tool_call>'
    assert _whole(surrogate) == (surrogate, [], "stop")
    assert _streamed([surrogate[:20], surrogate[20:]]) == (surrogate, [], "stop")
    deep = '<tool_call>{"name": "f", "arguments": ' + "[" * 50_000 + "]" * 50_000 + "}</tool_call>"
    assert _whole(deep) == (deep, [], "stop")
    for repeated in ('<tool_call>{"name": "f", "arguments": {"a": 1}, "arguments": {"b": 2}}</tool_call>',
                     '<tool_call>{"name": "f", "name": "g", "arguments": {}}</tool_call>'):
        assert _whole(repeated) == (repeated, [], "stop")
    long_int = '<tool_call>{"name": "f", "arguments": {"a": ' + "1" * 5000 + "}}</tool_call>"  # (JSON all the same)
    assert _whole(long_int) == _streamed([long_int[:30], long_int[30:]]) == ("", [("f", '{"a": ' + "1" * 5000 + "}")],
                                                                             "tool_calls")
    # a stream that sent the call before the repeated key came: the first arguments only, still one JSON text
    text = '<tool_call>{"name": "f", "arguments": {"a": 1}, "arguments": {"b": 2}}</tool_call>'
    assert _streamed([text[:30], text[30:]]) == ("", [("f", '{"a": 1}')], "tool_calls")


def test_the_registry_names_hermes():
    assert TOOL_PARSERS == {"hermes": HermesParser}
