"""tool_choice "auto" on a server started with `--enable-auto-tool-choice --tool-call-parser hermes` (vLLM's flags):
the model generates freely, its text read for Hermes <tool_call> blocks (serve/tool_parsers.py), through
/v1/chat/completions and /v1/responses, whole and streamed. A tiny random model writes no calls by itself: a
`structured_outputs` regex (which vLLM, and this server, take beside "auto") makes it write a given text, which the
parser then reads as it would a model's own. And the flags' checks, as vLLM makes them."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import openai
import pytest

from loopserve.cli import build_parser
from loopserve.cli import main as cli_main
from loopserve.serve.cli import _check
from loopserve_lab.tiny import TinySpec, make_tiny
from tests.server_helpers import MODEL, Server, run_server
from tests.test_server_structured import TIME, WEATHER

pytestmark = pytest.mark.timeout(180)

# Hermes-style: the tools' JSON in the prompt, an assistant's calls in <tool_call> blocks, a tool's reply as its role
TEMPLATE = ("{% if tools %}<tools>{% for t in tools %}{{ t.function | tojson }}{% endfor %}</tools>\n{% endif %}"
            "{% for m in messages %}{{ m.role }}: {{ m.content or '' }}"
            "{% for c in m.tool_calls or [] %}<tool_call>{{ c.function | tojson }}</tool_call>{% endfor %}\n"
            "{% endfor %}{% if add_generation_prompt %}assistant:{% endif %}")
MESSAGES = [{"role": "user", "content": "Weather in Paris, and the time?"}]
CALLS = [("get_weather", {"city": "Paris", "days": 3}), ("get_time", {"utc": True})]
TEXT = "Sure. " + "\n".join(f'<tool_call>{{"name": "{n}", "arguments": {json.dumps(a)}}}</tool_call>' for n, a in CALLS)
FLAT_WEATHER = {"type": "function", **WEATHER["function"]}  # (the Responses API's shape)


def _forcing(text: str) -> dict[str, Any]:
    """The request field that makes the model write `text` (a regex of it, escaped for the grammar's syntax)."""
    regex = "".join("\\" + c if c in "\\.^$|?*+()[]{}" else c for c in text)
    return {"structured_outputs": {"regex": regex}}


@pytest.fixture(scope="module")
def server(tmp_path_factory) -> Iterator[Server]:
    pytest.importorskip("llguidance")
    folder = tmp_path_factory.mktemp("auto-tools")
    model = make_tiny(folder / "model", TinySpec(arch="ouro", seed=1))
    with run_server(model, folder / "server.log", "--kv-cache-tokens", "4096", "--enable-auto-tool-choice",
                    "--tool-call-parser", "hermes", chat_template=TEMPLATE) as s:
        yield s


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return server.client()


def _chat(client: openai.OpenAI, **kwargs: Any) -> Any:
    return client.chat.completions.create(model=MODEL, messages=MESSAGES, tools=[WEATHER, TIME], temperature=0,
                                          **kwargs)


def test_auto_reads_the_models_calls(client):
    """tool_choice left out ("auto", the agent frameworks' default) and given: the text before the first block is
    the content, each block a call, finish_reason "tool_calls"."""
    for choice in ({}, {"tool_choice": "auto"}):
        r = _chat(client, max_tokens=300, extra_body=_forcing(TEXT), **choice)
        (c,) = r.choices
        assert c.finish_reason == "tool_calls" and c.message.content == "Sure. "
        assert [(t.function.name, json.loads(t.function.arguments)) for t in c.message.tool_calls] == CALLS
        assert all(t.type == "function" and t.id.startswith("chatcmpl-tool-") for t in c.message.tool_calls)
        assert len({t.id for t in c.message.tool_calls}) == 2


def test_auto_streamed_joins_into_the_whole_answer(client):
    whole = _chat(client, max_tokens=300, extra_body=_forcing(TEXT)).choices[0]
    chunks = list(_chat(client, max_tokens=300, extra_body=_forcing(TEXT), stream=True))
    content, calls, finish = "", {}, None
    for chunk in chunks:
        for ch in chunk.choices:
            content += ch.delta.content or ""
            assert "<" not in (ch.delta.content or "")  # (no piece of a tag shows as content)
            for tc in ch.delta.tool_calls or ():
                if tc.id is not None:
                    assert tc.index == len(calls) and tc.type == "function" and tc.function.name
                    calls[tc.index] = [tc.id, tc.function.name, ""]
                calls[tc.index][2] += tc.function.arguments or ""
            finish = ch.finish_reason or finish
    assert content == whole.message.content and finish == whole.finish_reason == "tool_calls"
    assert [(n, a) for _, n, a in calls.values()] == [(t.function.name, t.function.arguments)
                                                      for t in whole.message.tool_calls]
    assert sum(1 for c in chunks for ch in c.choices for tc in ch.delta.tool_calls or () if tc.function.arguments) > 2


def test_auto_without_parallel_calls_keeps_the_first(client):
    """parallel_tool_calls false: the first call only, whole and streamed (vLLM's answer; an agent would have run
    both tools)."""
    whole = _chat(client, max_tokens=300, extra_body=_forcing(TEXT), parallel_tool_calls=False).choices[0]
    assert [(t.function.name, json.loads(t.function.arguments)) for t in whole.message.tool_calls] == CALLS[:1]
    assert whole.finish_reason == "tool_calls"
    chunks = list(_chat(client, max_tokens=300, extra_body=_forcing(TEXT), parallel_tool_calls=False, stream=True))
    streamed = [tc for c in chunks for ch in c.choices for tc in ch.delta.tool_calls or ()]
    assert {tc.index for tc in streamed} == {0}
    assert "".join(tc.function.arguments or "" for tc in streamed) == whole.message.tool_calls[0].function.arguments


def test_auto_with_no_tools_is_text(client):
    """tool_choice "auto" with an empty tools list (the OpenAI Agents SDK's for an agent without tools): text, as
    "none" (was a 400 'needs tools'), on both routes."""
    more = {"extra_body": {"ignore_eos": True}}  # (an early end of sequence is not what is checked)
    r = client.chat.completions.create(model=MODEL, messages=MESSAGES, tools=[], tool_choice="auto", max_tokens=3,
                                       **more)
    assert r.choices[0].finish_reason == "length" and not r.choices[0].message.tool_calls
    r = client.responses.create(model=MODEL, input="Hi", tools=[], tool_choice="auto", max_output_tokens=3, **more)
    assert r.status == "incomplete" and [o.type for o in r.output] == ["message"]


def test_auto_without_a_call_is_text_as_with_none(client):
    """Free generation: the same text as tool_choice "none" (the tools in the template either way)."""
    auto = _chat(client, max_tokens=12).choices[0]
    none = _chat(client, max_tokens=12, tool_choice="none").choices[0]
    assert auto.message.content == none.message.content and not auto.message.tool_calls
    assert auto.finish_reason == none.finish_reason == "length"
    plain = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=1)
    assert _chat(client, max_tokens=1).usage.prompt_tokens > plain.usage.prompt_tokens  # (the template saw the tools)


def test_a_block_that_is_not_json_leaves_the_text_as_content(client):
    text = "Hm <tool_call>{oops}</tool_call>"
    for stream in (False, True):
        r = _chat(client, max_tokens=100, extra_body=_forcing(text), stream=stream)
        if stream:
            pieces = [(ch.delta.content or "", ch.delta.tool_calls, ch.finish_reason) for c in r for ch in c.choices]
            assert "".join(p for p, _, _ in pieces) == text and not any(t for _, t, _ in pieces)
            assert pieces[-1][2] == "stop"
        else:
            (c,) = r.choices
            assert c.message.content == text and not c.message.tool_calls and c.finish_reason == "stop"


def test_a_second_turn_sends_the_calls_back(client):
    first = _chat(client, max_tokens=300, extra_body=_forcing(TEXT)).choices[0].message
    messages = [*MESSAGES, first.model_dump(exclude_none=True),
                *({"role": "tool", "tool_call_id": t.id, "content": "ok"} for t in first.tool_calls)]
    r = client.chat.completions.create(model=MODEL, messages=messages, tools=[WEATHER, TIME], max_tokens=5)
    assert r.choices[0].finish_reason in ("stop", "length")


def test_responses_auto_gives_function_call_items(server, client):
    body = {"input": MESSAGES[0]["content"], "tools": [FLAT_WEATHER, {"type": "function", **TIME["function"]}],
            "max_output_tokens": 300, "temperature": 0}
    whole = client.responses.create(model=MODEL, **body, extra_body=_forcing(TEXT))
    assert [o.type for o in whole.output] == ["message", "function_call", "function_call"]
    assert whole.output_text == "Sure. " and whole.status == "completed" and whole.tool_choice == "auto"
    assert [(o.name, json.loads(o.arguments)) for o in whole.output[1:]] == CALLS
    events = list(client.responses.create(model=MODEL, stream=True, **body, extra_body=_forcing(TEXT)))
    added = [e.item for e in events if e.type == "response.output_item.added"]
    assert [i.type for i in added] == ["message", "function_call", "function_call"]
    assert [i.name for i in added[1:]] == [n for n, _ in CALLS]
    done = [e for e in events if e.type == "response.function_call_arguments.done"]
    for item, end in zip(added[1:], done, strict=True):
        pieces = [e.delta for e in events if e.type == "response.function_call_arguments.delta"
                  and e.item_id == item.id]
        assert "".join(pieces) == end.arguments and json.loads(end.arguments) in [a for _, a in CALLS]
    final = events[-1].response
    assert [(o.type, getattr(o, "arguments", None)) for o in final.output] == \
        [(o.type, getattr(o, "arguments", None)) for o in whole.output]
    with_choice = client.responses.create(model=MODEL, tool_choice="auto", **body, extra_body=_forcing(TEXT))
    assert [o.type for o in with_choice.output] == ["message", "function_call", "function_call"]


def test_tags_that_are_special_tokens_reach_the_parser(tmp_path):
    """A tokenizer that marks <tool_call> and </tool_call> special (as some models' do): "auto" keeps special tokens
    in the text it reads (vLLM's rule), so the calls are found (they came back as text without their tags)."""
    from tokenizers import AddedToken
    from tokenizers import Tokenizer as Raw

    model = make_tiny(tmp_path / "model", TinySpec(arch="ouro", seed=1, vocab_size=560))
    tok = Raw.from_file(str(model / "tokenizer.json"))
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in ("<tool_call>", "</tool_call>")])
    tok.save(str(model / "tokenizer.json"))
    start, end = tok.token_to_id("<tool_call>"), tok.token_to_id("</tool_call>")
    call = '{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}'
    grammar = f"start: <[{start}]> {json.dumps(call)} <[{end}]>"
    with run_server(model, tmp_path / "server.log", "--kv-cache-tokens", "4096", "--enable-auto-tool-choice",
                    "--tool-call-parser", "hermes", chat_template=TEMPLATE) as server:
        r = _chat(server.client(), max_tokens=200, extra_body={"structured_outputs": {"grammar": grammar}})
    (c,) = r.choices
    assert c.finish_reason == "tool_calls" and c.message.content is None
    assert [(t.function.name, json.loads(t.function.arguments)) for t in c.message.tool_calls] == CALLS[:1]


def test_a_forced_call_still_refuses_another_grammar(server):
    r = server.post("/v1/chat/completions", {"model": MODEL, "messages": MESSAGES, "tools": [WEATHER],
                                             "tool_choice": "required", **_forcing("x")})
    assert r.status_code == 400 and r.json()["error"]["param"] == "tool_choice"


def test_echo_and_beam_search_are_refused_with_auto(server):
    """Neither fits a reply read for calls: echo would start it with the prompt's text, a beam is not read."""
    for extra, param in (({"echo": True}, "echo"), ({"use_beam_search": True, "n": 2}, "tool_choice")):
        r = server.post("/v1/chat/completions", {"model": MODEL, "messages": MESSAGES, "tools": [WEATHER],
                                                 "max_tokens": 4, **extra})
        assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


# -- the flags ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(("flags", "message"), [
    (["--enable-auto-tool-choice"], "error: --enable-auto-tool-choice: needs --tool-call-parser (the model's "
                                    "tool-call format: hermes)\n"),
    (["--enable-auto-tool-choice", "--tool-call-parser", "nope"],
     "error: --tool-call-parser: no parser 'nope' (choose from hermes)\n"),
    (["--tool-call-parser", "nope"], "error: --tool-call-parser: no parser 'nope' (choose from hermes)\n"),
    (["--tool-parser-plugin", "p.py"], "error: --tool-parser-plugin: not supported by loopserve"),
])
def test_refused_flags_stop_the_start(flags, message, capsys):
    with pytest.raises(SystemExit) as exited:  # (before the model "m" is looked for)
        cli_main(["serve", "m", *flags])
    err = capsys.readouterr().err
    assert exited.value.code == 2 and err.startswith(message), err


@pytest.mark.parametrize("flags", [["--tool-call-parser", "hermes"], ["--tool-call-parser", "null"],
                                   ["--no-enable-auto-tool-choice"],
                                   ["--enable-auto-tool-choice", "--tool-call-parser", "hermes"]])
def test_taken_flags(flags):
    assert _check(build_parser().parse_args(["serve", "m", *flags])) is None
