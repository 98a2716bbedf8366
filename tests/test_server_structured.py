"""Structured output and tool calls against a real `loopserve serve` (serve/structured.py): the official
client's `.parse()` gets a parsed object, a forced tool call's arguments parse to the function's schema
(streamed too), vLLM's guided_* fields work on both endpoints, and bad grammars are 400s naming the field."""

from __future__ import annotations

import json
import re
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Literal

import httpx
import openai
import pydantic
import pytest

from loopserve.sampling_params import MAX_CHOICES
from loopserve.tokenizer import Tokenizer
from loopserve_lab.tiny import TinySpec, make_tiny
from tests.server_helpers import MODEL, Server, run_server, sse_events

pytest.importorskip("llguidance")
pytestmark = pytest.mark.timeout(180)

# a chat template that shows the tools it is given
TEMPLATE = ("{% if tools %}tools:{% for t in tools %} {{ t.function.name }}{% endfor %}\n{% endif %}"
            "{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}"
            "{% if add_generation_prompt %}assistant:{% endif %}")
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The forecast",
    "parameters": {"type": "object", "additionalProperties": False, "required": ["city", "days"],
                   "properties": {"city": {"enum": ["Paris", "Oslo"]},
                                  "days": {"type": "integer", "minimum": 1, "maximum": 7}}}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "parameters": {"type": "object", "additionalProperties": False, "required": ["utc"],
                                       "properties": {"utc": {"type": "boolean"}}}}}
MESSAGES = [{"role": "user", "content": "What is the weather?"}]
COMPACT = {"guided_whitespace_pattern": ""}  # no whitespace in JSON: a random model would pad it at length


class Pet(pydantic.BaseModel):
    kind: Literal["cat", "dog"]
    legs: int = pydantic.Field(ge=0, le=8)
    indoor: bool


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory) -> Path:
    return make_tiny(tmp_path_factory.mktemp("tiny-structured"), TinySpec(arch="ouro", seed=1))


@pytest.fixture(scope="module")
def server(tiny_path, tmp_path_factory) -> Iterator[Server]:
    folder = tmp_path_factory.mktemp("structured")
    with run_server(tiny_path, folder / "server.log", "--kv-cache-tokens", "2048", chat_template=TEMPLATE) as s:
        yield s


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return server.client()


def _post(server: Server, path: str, body: dict) -> httpx.Response:
    return httpx.post(server.url + path, json={"model": MODEL, **body}, timeout=60)


def _valid_weather(arguments: str) -> bool:
    args = json.loads(arguments)
    return set(args) == {"city", "days"} and args["city"] in ("Paris", "Oslo") and type(args["days"]) is int \
        and 1 <= args["days"] <= 7


def test_parse_returns_a_parsed_object(client):
    """The official client's `.parse()` with a pydantic model: a json_schema response_format, sampled at
    temperature 1 from a random model, comes back as a Pet. Without whitespace between tokens: a random
    model may otherwise spend the whole budget on it, as any seed can."""
    for seed in (1, 2, 3):
        done = client.chat.completions.parse(model=MODEL, messages=MESSAGES, response_format=Pet, temperature=1.0,
                                             max_tokens=400, seed=seed,
                                             extra_body={"guided_whitespace_pattern": ""})
        choice = done.choices[0]
        assert choice.finish_reason == "stop" and isinstance(choice.message.parsed, Pet), choice.message.content


def test_json_object_and_guided_fields_on_both_endpoints(server):
    out = _post(server, "/v1/completions", {"prompt": "a", "max_tokens": 30, "seed": 4,
                                            "guided_choice": ["north", "south"]}).json()
    assert out["choices"][0]["text"] in ("north", "south") and out["choices"][0]["finish_reason"] == "stop"
    out = _post(server, "/v1/completions", {"prompt": "a", "max_tokens": 30, "seed": 4,
                                            "guided_regex": "[xyz]{3}-[0-9]{2}"}).json()
    assert re.fullmatch("[xyz]{3}-[0-9]{2}", out["choices"][0]["text"])
    out = _post(server, "/v1/completions", {"prompt": "a", "max_tokens": 60, "seed": 5,
                                            "response_format": {"type": "json_schema", "json_schema": {
                                                "name": "w", "schema": WEATHER["function"]["parameters"]}},
                                            "guided_whitespace_pattern": ""}).json()
    assert _valid_weather(out["choices"][0]["text"])
    out = _post(server, "/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 60, "seed": 6,
                                                 "structured_outputs": {"json": WEATHER["function"]["parameters"],
                                                                        "disable_any_whitespace": True}}).json()
    assert _valid_weather(out["choices"][0]["message"]["content"])
    out = _post(server, "/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 40, "seed": 7,
                                                 "guided_grammar": 'start: "(" /[1-9]/ ")"'}).json()
    assert re.fullmatch(r"\([1-9]\)", out["choices"][0]["message"]["content"])


def test_structured_outputs_options_apply_to_another_fields_grammar(server):
    """vLLM merges a structured_outputs of options only (disable_any_whitespace, ...) with response_format or a
    forced tool call: the options shape that grammar (a 400 "only one of" before)."""
    schema = WEATHER["function"]["parameters"]
    out = _post(server, "/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 60, "seed": 6,
                                                 "response_format": {"type": "json_schema", "json_schema": {
                                                     "name": "w", "schema": schema}},
                                                 "structured_outputs": {"disable_any_whitespace": True}})
    text = out.json()["choices"][0]["message"]["content"]
    assert out.status_code == 200 and _valid_weather(text) and not re.search(r"\s", text), out.text
    out = _post(server, "/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 300, "seed": 9,
                                                 "tools": [WEATHER], "tool_choice": "required",
                                                 "parallel_tool_calls": False,
                                                 "structured_outputs": {"disable_any_whitespace": True}})
    choice = out.json()["choices"][0]
    assert out.status_code == 200 and choice["finish_reason"] == "tool_calls", out.text
    assert _valid_weather(choice["message"]["tool_calls"][0]["function"]["arguments"])


def test_guided_whitespace_pattern_shapes_a_structured_outputs_grammar(server):
    """vLLM's older `guided_whitespace_pattern` applies to the grammar the newer `structured_outputs` names (it was
    dropped: the random model padded the object with whitespace to max_tokens)."""
    out = _post(server, "/v1/completions", {"prompt": "a", "max_tokens": 60, "seed": 3, "guided_whitespace_pattern": "",
                                            "structured_outputs": {"json": WEATHER["function"]["parameters"]}})
    text = out.json()["choices"][0]["text"]
    assert out.status_code == 200 and _valid_weather(text) and not re.search(r"\s", text), out.text


@pytest.mark.parametrize("parameters", [None, {}])
def test_a_tool_without_parameters_is_called_with_none(client, parameters):
    """A function that gives no parameters (or {}) takes none, as OpenAI reads it: its arguments are {} (they were
    an open object's, free keys until max_tokens)."""
    function = {"name": "now"} if parameters is None else {"name": "now", "parameters": parameters}
    tool = {"type": "function", "function": function}
    for choice in ({"type": "function", "function": {"name": "now"}}, "required"):
        done = client.chat.completions.create(model=MODEL, messages=MESSAGES, tools=[tool], tool_choice=choice,
                                              max_tokens=60, seed=4, extra_body=COMPACT)
        (call,) = done.choices[0].message.tool_calls
        assert (call.function.name, json.loads(call.function.arguments)) == ("now", {}), done


def test_named_tool_choice_returns_a_tool_call(client, server, tiny_path):
    named = {"type": "function", "function": {"name": "get_weather"}}
    done = client.chat.completions.create(model=MODEL, messages=MESSAGES, tools=[TIME, WEATHER], tool_choice=named,
                                          temperature=1.0, max_tokens=200, seed=8, extra_body=COMPACT)
    choice = done.choices[0]
    assert choice.finish_reason == "stop" and choice.message.content is None  # OpenAI's and vLLM's answer
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.function.name == "get_weather" and call.id.startswith("chatcmpl-tool-")
    assert _valid_weather(call.function.arguments)
    # streamed: the id and name first, then the same arguments in pieces
    stream = client.chat.completions.create(model=MODEL, messages=MESSAGES, tools=[TIME, WEATHER], tool_choice=named,
                                            temperature=1.0, max_tokens=200, seed=8, stream=True,
                                            extra_body=COMPACT)
    parts = [tc for chunk in stream for ch in chunk.choices for tc in ch.delta.tool_calls or ()]
    assert parts[0].function.name == "get_weather" and parts[0].id
    assert "".join(p.function.arguments or "" for p in parts) == call.function.arguments
    # n = 2 streamed: each choice's call starts with its own id and the name
    stream = client.chat.completions.create(model=MODEL, messages=MESSAGES, tools=[TIME, WEATHER], tool_choice=named,
                                            temperature=1.0, max_tokens=200, seed=8, n=2, stream=True,
                                            extra_body=COMPACT)
    by_choice: dict[int, list] = {0: [], 1: []}
    for chunk in stream:
        for ch in chunk.choices:
            by_choice[ch.index] += ch.delta.tool_calls or ()
    heads = [calls[0] for calls in by_choice.values()]
    assert [h.function.name for h in heads] == ["get_weather"] * 2 and heads[0].id != heads[1].id
    assert all(h.id.startswith("chatcmpl-tool-") for h in heads)
    assert all(p.id is None and p.function.name is None for calls in by_choice.values() for p in calls[1:])
    # the tools reached the chat template
    raw = _post(server, "/v1/chat/completions", {"messages": MESSAGES, "tools": [TIME, WEATHER], "max_tokens": 1,
                                                 "tool_choice": "none", "return_token_ids": True}).json()
    prompt = Tokenizer(tiny_path).decode(raw["prompt_token_ids"])
    assert prompt.startswith("tools: get_time get_weather")


def test_a_null_tool_choice_generates_text_with_the_tools_rendered(server, tiny_path):
    """`"tool_choice": null` is not the key left out: vLLM defaults to "auto" only where it is absent, and lets an
    explicit null through to plain text, the tools in the template. It was refused here as "auto"."""
    body = {"messages": MESSAGES, "tools": [TIME, WEATHER], "max_tokens": 3, "temperature": 0,
            "return_token_ids": True}
    r = _post(server, "/v1/chat/completions", {**body, "tool_choice": None})
    assert r.status_code == 200, r.text
    none = _post(server, "/v1/chat/completions", {**body, "tool_choice": "none"}).json()
    got = r.json()
    assert Tokenizer(tiny_path).decode(got["prompt_token_ids"]).startswith("tools: get_time get_weather")
    assert got["prompt_token_ids"] == none["prompt_token_ids"]
    assert got["choices"][0]["message"] == none["choices"][0]["message"]
    assert got["choices"][0]["message"]["tool_calls"] == [] and got["choices"][0]["message"]["content"]
    # left out, it is still "auto", refused for want of a tool-call parser
    refused = _post(server, "/v1/chat/completions", body)
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "tool_choice", refused.text


@pytest.mark.parametrize("named", [True, False])
def test_tool_call_cut_by_max_tokens_streams_as_it_answers(client, named):
    """A forced tool call cut by max_tokens: a named call is still the call, its arguments the text so far
    (vLLM's answer), and "required" without a complete list answers with the text as content; streamed
    the same as not (found by a new-user trial: the stream sent nothing for "required" and a call for a
    named function whose answer was content)."""
    choice = {"type": "function", "function": {"name": "get_weather"}} if named else "required"
    kw = dict(model=MODEL, messages=MESSAGES, tools=[TIME, WEATHER], tool_choice=choice, temperature=0,
              max_tokens=4, extra_body=COMPACT)
    done = client.chat.completions.create(**kw).choices[0]
    assert done.finish_reason == "length"
    chunks = [ch for chunk in client.chat.completions.create(**kw, stream=True) for ch in chunk.choices]
    content = "".join(ch.delta.content or "" for ch in chunks)
    calls = [tc for ch in chunks for tc in ch.delta.tool_calls or ()]
    assert chunks[-1].finish_reason == "length"
    if named:
        (call,) = done.message.tool_calls
        assert done.message.content is None and call.function.name == "get_weather" and call.function.arguments
        assert content == "" and "".join(tc.function.arguments or "" for tc in calls) == call.function.arguments
        assert calls[0].function.name == "get_weather"
    else:
        assert not done.message.tool_calls and done.message.content
        assert calls == [] and content == done.message.content


def test_chat_stream_sends_prompt_logprobs_once(client):
    """prompt_logprobs on a streamed chat: the top-level field of the first chunk with tokens, as the response
    has it (found by a new-user trial: the stream dropped it)."""
    kw = dict(model=MODEL, messages=MESSAGES, max_tokens=3, temperature=0,
              extra_body={"prompt_logprobs": 1, "ignore_eos": True})
    whole = client.chat.completions.create(**kw).model_extra["prompt_logprobs"]
    chunks = list(client.chat.completions.create(**kw, stream=True))
    sent = [c.model_extra["prompt_logprobs"] for c in chunks if (c.model_extra or {}).get("prompt_logprobs")]
    assert len(sent) == 1 and whole and len(sent[0]) == len(whole)
    for a, b in zip(sent[0], whole, strict=True):
        assert (a is None) == (b is None)
        if a is not None:
            assert a.keys() == b.keys()


def test_required_tool_choice(client):
    done = client.chat.completions.create(model=MODEL, messages=MESSAGES, tools=[TIME, WEATHER],
                                          tool_choice="required", parallel_tool_calls=False, temperature=1.0,
                                          max_tokens=300, seed=9, extra_body=COMPACT)
    choice = done.choices[0]
    assert choice.finish_reason == "tool_calls"
    (call,) = choice.message.tool_calls
    assert call.function.name in ("get_time", "get_weather")
    args = json.loads(call.function.arguments)
    assert _valid_weather(call.function.arguments) if call.function.name == "get_weather" else \
        set(args) == {"utc"} and isinstance(args["utc"], bool)


@pytest.mark.parametrize("path, body, param", [
    ("/v1/chat/completions", {"response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "nope"}}}}, "response_format.json_schema.schema"),
    ("/v1/chat/completions", {"response_format": {"type": "json_schema"}}, "response_format.json_schema"),
    ("/v1/chat/completions", {"response_format": {"type": "yaml"}}, "response_format.type"),
    ("/v1/completions", {"guided_regex": "a(b"}, "guided_regex"),
    ("/v1/completions", {"guided_choice": []}, "guided_choice"),
    ("/v1/completions", {"guided_json": {"type": "object"}, "guided_regex": "a"}, "guided_regex"),
    ("/v1/completions", {"structured_outputs": {"colour": "red"}}, "structured_outputs.colour"),
    ("/v1/completions", {"structured_outputs": {"json_object": True, "disable_any_whitespace": "x"}},
     "structured_outputs.disable_any_whitespace"),
    ("/v1/completions", {"guided_regex": "ab\\"}, "guided_regex"),  # a lone backslash: once a 200 with no text
    ("/v1/completions", {"guided_choice": [f"c{i}" for i in range(MAX_CHOICES + 1)]}, "guided_choice"),
    # past llguidance's parser limit at the first token: once a 500 there (or a cut stream)
    ("/v1/completions", {"guided_choice": [f"option{i}" for i in range(MAX_CHOICES)]}, "guided_choice"),
    ("/v1/completions", {"guided_choice": [f"option{i}" for i in range(MAX_CHOICES)], "stream": True},
     "guided_choice"),
    # (open: closed, as the default engine closes objects that list properties, it compiles within the limit)
    ("/v1/chat/completions", {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "object", "properties": {f"p{i}": {"type": "integer"} for i in range(500)},
        "additionalProperties": True}}}}, "response_format"),
    ("/v1/chat/completions", {"structured_outputs": {"grammar": "start: " + " | ".join(
        f'"w{i}"' for i in range(2500))}, "stream": True}, "structured_outputs"),
    ("/v1/chat/completions", {"tools": [WEATHER]}, "tool_choice"),  # "auto": no tool-call parser
    ("/v1/chat/completions", {"tools": [WEATHER], "tool_choice": "auto"}, "tool_choice"),
    ("/v1/chat/completions", {"tool_choice": "required"}, "tool_choice"),
    ("/v1/chat/completions", {"tools": [WEATHER, WEATHER], "tool_choice": "none"}, "tools.1.function.name"),
    ("/v1/chat/completions", {"response_format": {"type": "json_object"}, "guided_whitespace_pattern": "x" * 100_001},
     "guided_whitespace_pattern"),
    ("/v1/chat/completions", {"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "f"}}},
     "tool_choice.function.name"),
    ("/v1/chat/completions", {"tools": [{"type": "function", "function": {
        "name": "bad", "parameters": {"type": "nope"}}}], "tool_choice": "required"}, "tools.0.function.parameters"),
    # a structured_outputs of options only: merged with another field's grammar, its own fields checked
    ("/v1/chat/completions", {"response_format": {"type": "json_object"},
                              "structured_outputs": {"disable_any_whitespace": "x"}},
     "structured_outputs.disable_any_whitespace"),
    ("/v1/completions", {"guided_regex": "a", "structured_outputs": {"colour": 1}}, "structured_outputs.colour"),
    ("/v1/completions", {"guided_regex": "a", "guided_whitespace_pattern": "",
                         "structured_outputs": {"whitespace_pattern": " "}}, "structured_outputs.whitespace_pattern"),
    ("/v1/completions", {"structured_outputs": {"disable_any_whitespace": True}}, "structured_outputs"),  # no grammar
    # a grammar key given as false or 0 is a grammar (a bad one), not options: it was dropped beside guided_regex
    ("/v1/completions", {"guided_regex": "a+", "structured_outputs": {"json": False}}, "structured_outputs"),
    # a bad whitespace pattern is named, not the schema it goes with
    ("/v1/completions", {"guided_json": {"type": "object"}, "structured_outputs": {"whitespace_pattern": "(("}},
     "structured_outputs.whitespace_pattern"),
    ("/v1/completions", {"guided_json": {"type": "object"}, "guided_whitespace_pattern": "(("},
     "guided_whitespace_pattern"),
    # the older field's pattern and the newer object's, both for its grammar; a pattern no whitespace may follow
    ("/v1/completions", {"structured_outputs": {"json": {"type": "object"}, "whitespace_pattern": " "},
                         "guided_whitespace_pattern": ""}, "structured_outputs.whitespace_pattern"),
    ("/v1/completions", {"guided_json": {"type": "object"}, "guided_whitespace_pattern": " ",
                         "structured_outputs": {"disable_any_whitespace": True}}, "guided_whitespace_pattern"),
    # a call's arguments are a JSON object (which a later turn sends back): a tool's parameters schema says so
    ("/v1/chat/completions", {"tools": [{"type": "function", "function": {
        "name": "g", "parameters": {"type": "string", "maxLength": 3}}}], "tool_choice": "none"},
     "tools.0.function.parameters"),
])
def test_bad_grammars_are_400_naming_the_field(server, path, body, param):
    base = {"messages": MESSAGES} if "chat" in path else {"prompt": "a"}
    r = _post(server, path, {**base, "max_tokens": 4, **body})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param, r.json()


# a character class llguidance cannot compile (it excludes every character): the engine's error names the grammar
# `guided_decoding`; the 400 names it as the request gave it, in `param` and at the start of its message
UNCOMPILABLE_REGEX = "[^\\x00-\\U0010FFFF]"


@pytest.mark.parametrize(("path", "grammar", "field"), [
    ("/v1/completions", {"guided_regex": UNCOMPILABLE_REGEX}, "guided_regex"),
    ("/v1/completions", {"guided_regex": UNCOMPILABLE_REGEX, "stream": True}, "guided_regex"),
    ("/v1/chat/completions", {"structured_outputs": {"regex": UNCOMPILABLE_REGEX}}, "structured_outputs"),
])
def test_an_uncompilable_grammar_is_a_400_whose_message_names_the_request_field(server, path, grammar, field):
    base = {"messages": MESSAGES} if "chat" in path else {"prompt": "a"}
    r = _post(server, path, {**base, "max_tokens": 4, **grammar})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == field, err
    assert err["message"].startswith(f"{field}: llguidance cannot compile it ("), err


def test_a_slow_grammar_compiles_off_the_event_loop(server):
    """A grammar can take a second or more to compile (this regex's counted repetitions: over 1 s here,
    then llguidance gives up: a 400). Requests are built on a worker thread and llguidance releases the
    GIL while it works, so the server answers others meanwhile: /health, sent while the slow request
    compiles, is answered first. On the event loop, it was answered only after the 400."""
    done: dict[str, float] = {}

    def slow() -> None:
        body = {"prompt": "a", "max_tokens": 2, "guided_regex": "((a{1000}){1000}){1000}"}
        r = _post(server, "/v1/completions", body)
        assert r.status_code == 400 and r.json()["error"]["param"] == "guided_regex", r.text
        done["slow"] = time.monotonic()

    worker = threading.Thread(target=slow)
    worker.start()
    time.sleep(0.3)  # the slow request is compiling
    assert httpx.get(server.url + "/health", timeout=60).status_code == 200
    done["health"] = time.monotonic()
    worker.join()
    assert done["health"] < done["slow"], done



@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_a_grammar_the_allowed_ids_leave_no_first_token_is_a_400_naming_the_field(server, path):
    """A grammar whose first tokens `allowed_token_ids` all miss: refused when the request is made, a 400 naming the
    field (the sampler drew a token the grammar then refused: a 500, with a traceback in the log), streamed or not."""
    base = {"messages": MESSAGES} if "chat" in path else {"prompt": "ROMEO:"}
    grammar = {"structured_outputs": {"choice": ["yes"]}} if "chat" in path else {"guided_choice": ["yes"]}
    offset = len(server.log.read_text())
    for stream in (False, True):
        r = _post(server, path, {**base, "max_tokens": 4, "allowed_token_ids": [5], "stream": stream, **grammar})
        assert r.status_code == 400 and r.json()["error"]["param"] == "allowed_token_ids", r.text
        assert r.json()["error"]["message"] == ("allowed_token_ids: guided_decoding (choice) and allowed_token_ids "
                                                "leave no token to sample at output token 1"), r.text
    log = server.log.read_text()[offset:]
    assert "Traceback" not in log and "ERROR" not in log, log


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_a_grammar_a_bad_word_leaves_no_token_later_is_a_400_naming_the_field(server, path):
    """A bad word that bans the only token the grammar allows after "y" ("yes" is "y" + "es" here): the request
    fails there as its own fault, a 400 naming the field (a warning in the log, no ERROR or traceback), where it was
    a 500."""
    base = {"messages": MESSAGES} if "chat" in path else {"prompt": "ROMEO:"}
    grammar = {"structured_outputs": {"choice": ["yes"]}} if "chat" in path else {"guided_choice": ["yes"]}
    offset = len(server.log.read_text())
    r = _post(server, path, {**base, "max_tokens": 4, "bad_words": ["yes"], **grammar})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["message"] == ("bad_words: guided_decoding (choice) and bad_words leave no token to "
                                            "sample at output token 2"), r.text
    log = server.log.read_text()[offset:]
    assert "Traceback" not in log and "ERROR" not in log, log
    assert r.json()["error"]["param"] == "bad_words", r.text  # (the engine's error names it first)


# grammars that pass their first tokens and reach llguidance's parser limit later (after 5 letters; after `["abc",`):
# the engine fails the request with "guided_decoding: the grammar cannot be parsed past this point (...)"
LATE_LIMIT_GRAMMAR = "start: /[a-z]{5}/ word\nword: " + " | ".join(f'"w{i}"' for i in range(2500))
LATE_LIMIT_SCHEMA = {"type": "array", "minItems": 2, "items": False, "prefixItems": [
    {"type": "string", "pattern": "^[a-z]{3}$"},
    {"type": "object", "properties": {f"p{i}": {"type": "integer"} for i in range(500)}, "additionalProperties": True}]}


@pytest.mark.parametrize(("path", "grammar", "field"), [
    ("/v1/completions", {"guided_grammar": LATE_LIMIT_GRAMMAR}, "guided_grammar"),
    ("/v1/completions", {"guided_json": LATE_LIMIT_SCHEMA, **COMPACT}, "guided_json"),
    ("/v1/chat/completions", {"response_format": {"type": "json_schema", "json_schema": {
        "name": "late", "schema": LATE_LIMIT_SCHEMA}}, **COMPACT}, "response_format"),
    ("/v1/chat/completions", {"structured_outputs": {"grammar": LATE_LIMIT_GRAMMAR}}, "structured_outputs"),
])
def test_a_grammar_failure_found_later_names_the_field_the_request_gave_it_in(server, path, grammar, field):
    """A grammar that fails after its first tokens (the engine's error names it `guided_decoding`): the 400's `param`,
    and the name its message starts with, is the field the request gave the grammar in, as for a failure found when
    the request is made (`make_seq`), and the same in a stream's error event."""
    base = {"messages": MESSAGES} if "chat" in path else {"prompt": "ROMEO:"}
    body = {**base, "max_tokens": 30, "temperature": 0.0, **grammar}
    r = _post(server, path, body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == field, err
    assert err["message"].startswith(f"{field}: the grammar cannot be parsed past this point"), err
    events: list[str] = []
    with pytest.raises(httpx.HTTPError), httpx.stream("POST", server.url + path, timeout=60,
                                                      json={"model": MODEL, **body, "stream": True}) as s:
        assert s.status_code == 200
        for e in sse_events(s.iter_lines()):  # the cut raises while reading
            events.append(e)
    assert "[DONE]" not in events and json.loads(events[-1]) == {"error": err}, events


def test_one_rule_names_the_request_field_of_an_engine_error():
    """`request_field`: the engine's names of the prompt and the grammar become the request's fields, whether the
    error is found when the sequence is made (`make_seq`) or later (`request_failure`); other fields stay."""
    from loopserve.outputs import CompletionOutput, RequestOutput
    from loopserve.serve.api import request_failure
    from loopserve.serve.protocol import ApiError, request_field

    limit = "guided_decoding: the grammar cannot be parsed past this point (...)"
    assert request_field(limit, "prompt", "guided_choice") == "guided_choice"
    assert request_field(limit, "messages", "response_format") == "response_format"
    assert request_field(limit) == "guided_decoding"  # (no request to name it)
    conflict = "bad_words: guided_decoding (choice) and bad_words leave no token to sample at output token 2"
    assert request_field(conflict, "prompt", "guided_choice") == "bad_words"
    too_long = ApiError.bad_request("prompt: 5000 tokens; this model's maximum context length is 4096", "prompt.1")
    assert (too_long.param, too_long.message) == ("prompt.1", "prompt.1: 5000 tokens; this model's maximum context "
                                                              "length is 4096")
    bad_regex = ApiError.bad_request("guided_decoding: llguidance cannot compile it (x)", "prompt", "guided_regex")
    assert (bad_regex.param, bad_regex.message) == ("guided_regex", "guided_regex: llguidance cannot compile it (x)")
    unnamed = ApiError.bad_request("guided_decoding: llguidance cannot compile it (x)")  # (no request field known)
    assert (unnamed.param, unnamed.message) == ("guided_decoding", "guided_decoding: llguidance cannot compile it (x)")
    assert ApiError.bad_request(conflict, "prompt", "guided_choice").message == conflict  # (names another field)
    failed = RequestOutput("r", None, [1], None, [CompletionOutput(0, "", [], None, None, "error")], True, error=limit,
                           error_status=400)
    error = request_failure(failed, "prompt", "guided_choice")
    assert error is not None and (error.status, error.param) == (400, "guided_choice")
    assert error.message == "guided_choice" + limit.removeprefix("guided_decoding")  # named as the request did
    failed.error_status = 500  # (not the request's fault: no field)
    error = request_failure(failed, "prompt", "guided_choice")
    assert error is not None and (error.status, error.param) == (500, None)


STUCK = "start: A B\nA: /a+/\nB: /a+b/"  # (llguidance 1.9.1 never returns from its first mask: 20 s, then a 400)


def test_new_grammars_hold_up_no_other_request_and_a_shutdown_ends_them_with_503s(tiny_path, tmp_path):
    """Requests with a grammar to compile are built one at a time (the grammar lane), and a grammar llguidance never
    finishes takes GRAMMAR_COMPILE_LIMIT_S (20 s) to be refused: requests whose grammar is compiled already, or that
    carry tools and no grammar, do not wait behind it (they did, for every such grammar in the lane: 61 s behind
    three). At the end of a graceful shutdown the one compiling and the one waiting for the lane get the 503 of a
    shutdown at once (they had waited out the compile, the process with them, and got uvicorn's plain 500), the
    process exits 0, and no compiling child is left."""
    import signal

    from tests.test_structured_output import _children, _gone

    log = tmp_path / "server.log"
    with run_server(tiny_path, log, "--shutdown-timeout", "4", "--kv-cache-tokens", "2048",
                    "--enable-auto-tool-choice", "--tool-call-parser", "hermes", chat_template=TEMPLATE) as server:
        cached = {"prompt": "a", "max_tokens": 2, "guided_regex": "[0-9]{2}"}
        assert _post(server, "/v1/completions", cached).status_code == 200
        answers: dict[str, httpx.Response] = {}

        def send(name: str, grammar: str) -> None:
            body = {"prompt": "a", "max_tokens": 2, "guided_grammar": grammar}
            answers[name] = _post(server, "/v1/completions", body)

        stuck = [threading.Thread(target=send, args=(name, STUCK.replace("A", name))) for name in ("P", "Q")]
        for t in stuck:
            t.start()
            time.sleep(0.5)  # (P compiling, then Q waiting for its turn)
        children = _children(server.proc.pid)
        assert children, "no vetting child"
        start = time.monotonic()
        assert _post(server, "/v1/completions", cached).status_code == 200
        tools = {"messages": MESSAGES, "max_tokens": 2, "tools": [WEATHER], "tool_choice": "auto"}
        assert _post(server, "/v1/chat/completions", tools).status_code == 200
        assert time.monotonic() - start < 8 and not answers  # (the stuck ones still compiling)
        server.proc.send_signal(signal.SIGTERM)
        for t in stuck:
            t.join(30)
        rc = server.proc.wait(30)
        ended = time.monotonic() - start
    text = log.read_text()
    assert rc == 0 and ended < 15, (rc, ended, text)
    for name in ("P", "Q"):
        r = answers[name]
        assert r.status_code == 503 and r.json()["error"]["message"] == "the server is shutting down", r.text
    assert all(_gone(pid) for pid in children)
    assert "Traceback" not in text and "ERROR" not in text, text
