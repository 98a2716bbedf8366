"""tool_choice "required" streamed as it is generated (serve/structured.py's `ToolListScanner`): the scanner over
every split of a sample list into two and three pieces reports what one pass over the whole text does, and a
served tiny model's stream sends each call's id and name once its name is complete, then its arguments in pieces,
whose concatenation is the whole response's calls; a list cut by max_tokens keeps what it sent and ends "length"."""

from __future__ import annotations

import json
from collections.abc import Iterator

import openai
import pytest

from loopserve.outputs import CompletionOutput
from loopserve.serve.responses import ChoiceStream
from loopserve.serve.structured import ToolListScanner, ToolPlan, tool_call_entries
from loopserve_lab.tiny import TinySpec, make_tiny
from tests.server_helpers import MODEL, Server, run_server
from tests.test_server_structured import COMPACT, MESSAGES, TEMPLATE, TIME, WEATHER

# escapes (\" and \u00e9, in names and values), whitespace between every token, nested objects and arrays with
# strings holding braces and brackets, a call whose parameters come before its name, a scalar parameters value
SAMPLE = ('[ {"name" : "get_\\"w\\u00e9", "parameters":{"a": "{[\\"}]", "b" :[1, {"c": [null, "]"]}],'
          '"d":"\\u00e9\\\\"} } ,\n\t{"parameters": {"x": {"}": "{"}}, "name": "second"},{"name":"n3",'
          '"parameters":-1.5e3}]  ')


def _fold(events: list[tuple[int, str | None, str]]) -> dict[int, tuple[str, str]]:
    """Per call index: (name, arguments joined), checking that a call is named once, before its arguments."""
    calls: dict[int, tuple[str, str]] = {}
    for i, name, text in events:
        if name is not None:
            assert i not in calls and i == len(calls) and text == ""
            calls[i] = (name, "")
        else:
            assert i in calls and text
            calls[i] = (calls[i][0], calls[i][1] + text)
    return calls


def _scan(pieces: list[str]) -> tuple[list[tuple[int, str | None, str]], bool]:
    scanner = ToolListScanner()
    events = [e for piece in pieces for e in scanner.feed(piece)]
    return events, scanner.complete


def test_one_pass_reads_names_and_raw_parameters():
    events, complete = _scan([SAMPLE])
    assert complete
    calls = _fold(events)
    expected = json.loads(SAMPLE)
    assert [name for name, _ in calls.values()] == [item["name"] for item in expected] == ['get_"wé', "second", "n3"]
    assert [json.loads(args) for _, args in calls.values()] == [item["parameters"] for item in expected]
    # the raw text of each value, from its first character to its last
    assert calls[0][1] == '{"a": "{[\\"}]", "b" :[1, {"c": [null, "]"]}],"d":"\\u00e9\\\\"}'
    assert calls[1][1] == '{"x": {"}": "{"}}' and calls[2][1] == "-1.5e3"
    # the events of one piece: a call's arguments are one event (merged), named first
    assert [(i, name is None) for i, name, _ in events] == [(0, False), (0, True), (1, False), (1, True),
                                                            (2, False), (2, True)]


def test_every_split_in_two_and_three_reads_the_same():
    whole, _ = _scan([SAMPLE])
    expected = _fold(whole)
    n = len(SAMPLE)
    for a in range(n + 1):
        events, complete = _scan([SAMPLE[:a], SAMPLE[a:]])
        assert complete and _fold(events) == expected, a
    for a in range(n + 1):
        for b in range(a, n + 1):
            events, complete = _scan([SAMPLE[:a], SAMPLE[a:b], SAMPLE[b:]])
            assert complete and _fold(events) == expected, (a, b)


def test_character_by_character_each_prefix_reports_a_prefix():
    """Fed one character at a time: a name is reported once its string is complete (never before its closing
    quote), the arguments so far are always a prefix of the final ones, and the list is complete only at `]`."""
    expected = _fold(_scan([SAMPLE])[0])
    scanner = ToolListScanner()
    events: list[tuple[int, str | None, str]] = []
    for k, ch in enumerate(SAMPLE):
        events += scanner.feed(ch)
        so_far = _fold(events)
        for i, (name, args) in so_far.items():
            assert name == expected[i][0] and expected[i][1].startswith(args)
        assert scanner.complete == (k >= SAMPLE.rindex("]"))
    assert _fold(events) == expected
    # the name of the first call is known right after its closing quote, not before
    first_name_end = SAMPLE.index('00e9"') + len('00e9"')
    assert not _fold(_scan([SAMPLE[:first_name_end - 1]])[0])
    assert _fold(_scan([SAMPLE[:first_name_end]])[0]) == {0: (expected[0][0], "")}


def test_parameters_before_the_name_are_held_until_the_name():
    text = '[{"parameters": {"q": "\\"name\\": 1"}, "name": "late"}]'
    scanner = ToolListScanner()
    cut = text.index(', "name"')
    assert scanner.feed(text[:cut]) == []  # the parameters are complete, the name is not known yet
    assert scanner.feed(text[cut:]) == [(0, "late", ""), (0, None, '{"q": "\\"name\\": 1"}')]
    assert scanner.complete


def test_a_cut_list_is_not_complete():
    expected = _fold(_scan([SAMPLE])[0])
    # cut in the first call's parameters: its name and the arguments so far
    cut = SAMPLE.index('"b"')
    events, complete = _scan([SAMPLE[:cut]])
    assert not complete and _fold(events) == {0: (expected[0][0], SAMPLE[SAMPLE.index('{"a"'):cut])}
    # cut in the second call's name, its parameters complete: held, not reported
    events, complete = _scan([SAMPLE[:SAMPLE.index('"second"') + 3]])
    assert not complete and _fold(events) == {0: expected[0]}


def test_tool_call_entries_merge_a_chunk_per_call():
    entries = tool_call_entries(_scan([SAMPLE])[0])
    assert [e["index"] for e in entries] == [0, 1, 2]
    assert all(e["id"].startswith("chatcmpl-tool-") and e["type"] == "function" for e in entries)
    assert len({e["id"] for e in entries}) == 3
    # a chunk of arguments only: no id, no name
    scanner = ToolListScanner()
    scanner.feed(SAMPLE[:SAMPLE.index('"a"')])
    (entry,) = tool_call_entries(scanner.feed('"a": "{[\\"'))
    assert entry == {"index": 0, "function": {"arguments": '"a": "{[\\"'}}


def _plan() -> ToolPlan:
    return ToolPlan(["get_\"wé", "second", "n3"], True, None)  # type: ignore[arg-type]  # (no grammar needed here)


def _output(text: str, finish_reason: str | None) -> CompletionOutput:
    return CompletionOutput(index=0, text=text, token_ids=[], cumulative_logprob=None, logprobs=None,
                            finish_reason=finish_reason)


def test_plan_streamed_and_whole_give_the_same_calls():
    plan = _plan()
    whole_sent = ChoiceStream()
    message = plan.message(_output(SAMPLE, "stop"), whole_sent)
    assert message["content"] is None and plan.finish_reason(_output(SAMPLE, "stop"), whole_sent) == "tool_calls"
    step = 7
    sent = ChoiceStream()
    deltas = [plan.delta(SAMPLE[k:k + step], k + step >= len(SAMPLE), sent) for k in range(0, len(SAMPLE), step)]
    assert plan.finish_reason(_output("", "stop"), sent) == "tool_calls"
    streamed: dict[int, dict] = {}
    for delta in deltas:
        assert set(delta) <= {"tool_calls"}
        indices = [e["index"] for e in delta.get("tool_calls", [])]
        assert len(indices) == len(set(indices))  # one entry per call in a chunk
        for e in delta.get("tool_calls", []):
            if "id" in e:
                assert e["index"] not in streamed
                streamed[e["index"]] = {"id": e["id"], "name": e["function"]["name"], "arguments": ""}
            streamed[e["index"]]["arguments"] += e["function"]["arguments"]
    assert [(c["name"], c["arguments"]) for c in streamed.values()] == \
        [(c["function"]["name"], c["function"]["arguments"]) for c in message["tool_calls"]]
    assert sum(1 for d in deltas for e in d.get("tool_calls", []) if e["function"]["arguments"]) > 3


def test_plan_cut_before_any_name_sends_the_text_as_content():
    plan = _plan()
    text = '[ {"name" : "get'
    sent = ChoiceStream()
    assert plan.delta(text[:5], False, sent) == {}
    assert plan.delta(text[5:], True, sent) == {"content": text}
    assert plan.finish_reason(_output("", "length"), sent) == "length"
    whole = ChoiceStream()
    assert plan.message(_output(text, "length"), whole) == {"role": "assistant", "content": text, "tool_calls": []}
    assert plan.finish_reason(_output(text, "length"), whole) == "length"


def test_plan_cut_after_a_name_keeps_the_calls_sent():
    """A stream cannot take back a call it sent: cut, it has the calls named so far and ends with the engine's
    reason; the whole response keeps answering a cut list with its text as content."""
    plan = _plan()
    text = SAMPLE[:SAMPLE.index('"b"')]
    sent = ChoiceStream()
    first = plan.delta(text[:40], False, sent)
    last = plan.delta(text[40:], True, sent)
    (head,) = first["tool_calls"]
    assert head["function"]["name"] == 'get_"wé' and head["id"]
    args = head["function"]["arguments"] + "".join(e["function"]["arguments"] for e in last["tool_calls"])
    assert args == text[text.index('{"a"'):]
    assert "content" not in last and plan.finish_reason(_output("", "length"), sent) == "length"
    whole = ChoiceStream()
    assert plan.message(_output(text, "length"), whole)["content"] == text


# -- against a served tiny model --------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def server(tmp_path_factory) -> Iterator[Server]:
    pytest.importorskip("llguidance")
    model = make_tiny(tmp_path_factory.mktemp("tiny-tool-stream"), TinySpec(arch="ouro", seed=1))
    log = tmp_path_factory.mktemp("tool-stream") / "server.log"
    with run_server(model, log, "--kv-cache-tokens", "2048", chat_template=TEMPLATE) as s:
        yield s


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return server.client()


def _streamed_calls(chunks: list) -> tuple[list[dict], int]:
    """The calls a stream's tool-call deltas add up to (an id and name once per index, arguments joined), and how
    many chunks carried an arguments fragment."""
    calls: dict[int, dict] = {}
    with_arguments = 0
    for chunk in chunks:
        for ch in chunk.choices:
            with_arguments += any(tc.function.arguments for tc in ch.delta.tool_calls or ())
            for tc in ch.delta.tool_calls or ():
                if tc.id is not None:
                    assert tc.index not in calls and tc.type == "function" and tc.function.name
                    calls[tc.index] = {"id": tc.id, "name": tc.function.name, "arguments": ""}
                else:
                    assert tc.index in calls and tc.function.name is None
                calls[tc.index]["arguments"] += tc.function.arguments or ""
    assert list(calls) == list(range(len(calls)))
    return list(calls.values()), with_arguments


@pytest.mark.timeout(180)
def test_required_streams_calls_as_they_come(client):
    """Two calls, sampled at temperature 1 (seed 6 closes the list at 72 tokens): the stream's tool-call deltas add
    up to the whole response's calls, arguments in several chunks; the name comes before the end."""
    kw = dict(model=MODEL, messages=MESSAGES, tools=[TIME, WEATHER], tool_choice="required", temperature=1.0,
              max_tokens=300, seed=6, extra_body=COMPACT)
    done = client.chat.completions.create(**kw).choices[0]
    assert done.finish_reason == "tool_calls" and done.message.content is None
    assert len(done.message.tool_calls) >= 2
    chunks = list(client.chat.completions.create(**kw, stream=True))
    calls, with_arguments = _streamed_calls(chunks)
    assert [(c["name"], c["arguments"]) for c in calls] == \
        [(tc.function.name, tc.function.arguments) for tc in done.message.tool_calls]
    assert all(c["id"].startswith("chatcmpl-tool-") for c in calls)
    assert with_arguments > 2
    choices = [ch for chunk in chunks for ch in chunk.choices]
    assert choices[-1].finish_reason == "tool_calls" and not any(ch.delta.content for ch in choices)
    named_at = next(k for k, ch in enumerate(choices) if ch.delta.tool_calls)
    assert named_at < len(choices) - 2  # sent as it came, not all in the last chunk


@pytest.mark.timeout(180)
def test_required_cut_by_max_tokens_streams_what_it_had(client):
    """Cut by max_tokens after the first call's name: the stream has sent the call (its arguments cut short) and
    ends with "length"; the whole response answers the cut list with its text as content."""
    kw = dict(model=MODEL, messages=MESSAGES, tools=[TIME, WEATHER], tool_choice="required", temperature=1.0,
              max_tokens=30, seed=6, extra_body=COMPACT)
    done = client.chat.completions.create(**kw).choices[0]
    assert done.finish_reason == "length" and not done.message.tool_calls
    text = done.message.content
    assert text.startswith('[{"name":"get_time","parameters":{')
    chunks = list(client.chat.completions.create(**kw, stream=True))
    calls, _ = _streamed_calls(chunks)
    choices = [ch for chunk in chunks for ch in chunk.choices]
    assert choices[-1].finish_reason == "length" and not any(ch.delta.content for ch in choices)
    (call,) = calls
    assert call["name"] == "get_time" and text.endswith(call["arguments"]) and call["arguments"].startswith("{")


BOOK = {"type": "function", "function": {"name": "book", "parameters": {
    "$defs": {"Who": {"type": "object", "properties": {"name": {"enum": ["al", "bo"]}}, "required": ["name"],
                      "additionalProperties": False}},
    "type": "object", "properties": {"who": {"$ref": "#/$defs/Who"}}, "required": ["who"],
    "additionalProperties": False}}}
TREE = {"type": "function", "function": {"name": "tree", "parameters": {
    "type": "object", "properties": {"child": {"anyOf": [{"$ref": "#"}, {"type": "null"}]}, "v": {"enum": [1]}},
    "required": ["v", "child"], "additionalProperties": False}}}


def _tree_ok(value) -> bool:
    return value is None or (isinstance(value, dict) and set(value) == {"v", "child"} and value["v"] == 1
                             and _tree_ok(value["child"]))


@pytest.mark.timeout(180)
@pytest.mark.parametrize("seed", [1, 3])
def test_required_keeps_each_tools_references_its_own(client, seed):
    """A tool schema that refers within itself ($defs, or `#` for a recursive one, as pydantic writes nested models)
    under "required": its references still point into it (left inside the list schema, `#/$defs/Who` was a 400 and
    `#` the whole call list, so a call's arguments nested calls)."""
    kw = dict(model=MODEL, messages=MESSAGES, tools=[BOOK, TREE], tool_choice="required", temperature=1.0,
              max_tokens=400, seed=seed, extra_body=COMPACT)
    done = client.chat.completions.create(**kw).choices[0]
    assert done.finish_reason in ("tool_calls", "length")
    for tc in done.message.tool_calls or ():
        args = json.loads(tc.function.arguments)
        if tc.function.name == "book":
            assert args["who"]["name"] in ("al", "bo") and set(args) == {"who"}
        else:
            assert _tree_ok(args), args


@pytest.mark.timeout(180)
def test_a_named_call_with_no_arguments_is_streamed_too(client):
    """A forced function whose output a stop string cuts to nothing: the whole response has the call (arguments "");
    the stream sent none (an empty delta, then the finish)."""
    kw = dict(model=MODEL, messages=MESSAGES, tools=[TIME, WEATHER], temperature=1.0, max_tokens=20, stop=["{"],
              tool_choice={"type": "function", "function": {"name": "get_time"}}, seed=1, extra_body=COMPACT)
    done = client.chat.completions.create(**kw).choices[0]
    calls, _ = _streamed_calls(list(client.chat.completions.create(**kw, stream=True)))
    assert [(tc.function.name, tc.function.arguments) for tc in done.message.tool_calls] == \
        [(c["name"], c["arguments"]) for c in calls] == [("get_time", "")]


def test_an_empty_tool_name_is_refused(client):
    tool = {"type": "function", "function": {"name": "", "parameters": {"type": "object"}}}
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=MESSAGES, tools=[tool], tool_choice="required")
    assert e.value.body["param"] == "tools.0.function.name" and "must not be empty" in e.value.body["message"]


def test_sse_lines_escape_unicode_line_separators():
    """SSE ends a line at CR or LF only, but httpx's iter_lines (Python's splitlines) also at U+2028 / U+2029."""
    from loopserve.serve.responses import sse

    event = sse({"name": "a\u2028b\u2029c\u00e9"})
    assert "\u2028" not in event and "\u2029" not in event and len(event.splitlines()) == 2
    assert json.loads(event.removeprefix("data: ")) == {"name": "a\u2028b\u2029c\u00e9"}


def test_a_required_tools_bad_schema_is_named_by_its_tool():
    """The list's grammar holds every tool's schema: its error names the tool whose own schema fails (it named
    `tools`); an option's error still names the option."""
    pytest.importorskip("llguidance")
    from loopserve.serve.protocol import ApiError, ChatCompletionRequest, parse_body
    from loopserve.serve.structured import chat_guide

    bad = {"type": "function", "function": {"name": "b", "parameters": {
        "type": "object", "properties": {"x": {"$ref": "#/nope"}}}}}
    cases = [([TIME, bad], {}, "tools.1.function.parameters"),
             ([TIME], {"structured_outputs": {"whitespace_pattern": "("}}, "structured_outputs.whitespace_pattern")]
    for tools, extra, param in cases:
        req = parse_body(ChatCompletionRequest, json.dumps({"model": MODEL, "messages": MESSAGES, "tools": tools,
                                                            "tool_choice": "required", **extra}).encode())
        with pytest.raises(ApiError) as e:
            chat_guide(req)
        assert (e.value.status, e.value.param) == (400, param) and e.value.message.startswith(param + ": ")


def test_a_tools_schema_without_a_type_forces_an_object():
    """Hand-written and MCP schemas often leave out the top-level "type", which the tool check reads as "object":
    the grammar now says so too (a forced call's arguments came out `true`, `null` or a list, and sending that call
    back in the next turn's messages was then a 400)."""
    pytest.importorskip("llguidance")
    from loopserve.serve.protocol import ChatCompletionRequest, parse_body
    from loopserve.serve.structured import chat_guide

    untyped = {"type": "function", "function": {"name": "f", "parameters": {
        "properties": {"a": {"type": "boolean"}}, "required": ["a"]}}}
    for choice in ({"type": "function", "function": {"name": "f"}}, "required"):
        req = parse_body(ChatCompletionRequest, json.dumps({"model": MODEL, "messages": MESSAGES, "tools": [untyped],
                                                            "tool_choice": choice}).encode())
        _, plan = chat_guide(req)
        assert plan is not None and isinstance(plan.guide.json, dict)
        schema = plan.guide.json if choice != "required" else \
            plan.guide.json["items"]["anyOf"][0]["properties"]["parameters"]
        assert schema["type"] == "object" and schema["required"] == ["a"], schema
