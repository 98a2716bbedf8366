"""Multi-turn tool use as vLLM users send it: an assistant turn's `tool_calls` and a tool turn's `tool_call_id`
reach the chat template, checked and normalized by `chat_messages` (the arguments as a dict, as vLLM passes
them), the same from `LLM.chat` and from the server; bad ones are refused naming the field. The server used to
take both as unknown fields and render the conversation without them.
"""

from __future__ import annotations

import logging
import re
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest

from loopserve import LLM, SamplingParams
from loopserve.chat_messages import TEMPLATE_KEYS, chat_messages
from tests.server_helpers import MODEL, Server, run_server

pytestmark = pytest.mark.timeout(120)

# shows everything a template may read of a message (the arguments read as a mapping)
TEMPLATE = ("{% for m in messages %}"
            "{{ m.role }}{% if m.name %}({{ m.name }}){% endif %}: {{ m.content }}"
            "{% for c in m.tool_calls or [] %} [call {{ c.id }} {{ c.type }} {{ c.function.name }}"
            "{% for k, v in c.function.arguments | dictsort %} {{ k }}={{ v | tojson }}{% endfor %}]{% endfor %}"
            "{% if m.tool_call_id %} [answers {{ m.tool_call_id }}]{% endif %}|"
            "{% endfor %}{% if add_generation_prompt %}assistant:{% endif %}"
            "{% if documents %}[{{ documents | length }} documents]{% endif %}"
            "{% if tools %}[tools:{% for t in tools %} {{ t.function.name }}{% endfor %}]{% endif %}")
CALL = {"id": "call_1", "type": "function",
        "function": {"name": "get_weather", "arguments": '{"city": "Paris", "days": 2}'}}
CONVERSATION = [{"role": "user", "content": "Weather in Paris?"},
                {"role": "assistant", "content": None, "tool_calls": [CALL]},
                {"role": "tool", "content": "sunny", "tool_call_id": "call_1"}]
RENDERED = ('user: Weather in Paris?|assistant:  [call call_1 function get_weather city="Paris" days=2]|'
            "tool: sunny [answers call_1]|assistant:")
ARGS = "messages.1.tool_calls.0.function.arguments"


def _with_call(**function: Any) -> list[dict[str, Any]]:
    """CONVERSATION with the call's function fields replaced."""
    call = {**CALL, "function": {**CALL["function"], **function}}
    return [CONVERSATION[0], {**CONVERSATION[1], "tool_calls": [call]}, CONVERSATION[2]]


# -- chat_messages: the one rule ---------------------------------------------------------------------------------
def test_a_tool_conversation_as_the_template_gets_it():
    assert chat_messages(CONVERSATION) == [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": "", "tool_calls": [
            {"id": "call_1", "type": "function",
             "function": {"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}}]},
        {"role": "tool", "content": "sunny", "tool_call_id": "call_1"}]
    assert CALL["function"]["arguments"] == '{"city": "Paris", "days": 2}'  # the caller's message is left as it was


def test_id_and_type_may_be_left_out_and_arguments_may_be_a_mapping():
    calls = [{"function": {"name": "f", "arguments": {"x": [1]}}},  # from Python, already a dict
             {"id": None, "type": None, "function": {"name": "g", "arguments": ""}},  # "": no arguments, as vLLM
             {"type": "function", "function": {"name": "h", "arguments": " {\"y\": null} "}}]
    [msg] = chat_messages([{"role": "assistant", "tool_calls": calls}])
    assert msg["tool_calls"] == [{"type": "function", "function": {"name": "f", "arguments": {"x": [1]}}},
                                 {"type": "function", "function": {"name": "g", "arguments": {}}},
                                 {"type": "function", "function": {"name": "h", "arguments": {"y": None}}}]
    # null is unset; an empty list of calls is kept as the client sent it
    assert chat_messages([{"role": "assistant", "content": "x", "tool_calls": None, "tool_call_id": None,
                           "name": None}]) == [{"role": "assistant", "content": "x"}]
    assert chat_messages([{"role": "assistant", "tool_calls": []}])[0]["tool_calls"] == []


def test_only_the_template_keys_are_kept_and_the_rest_reported():
    ignored: list[str] = []
    call = {**CALL, "index": 0, "function": {**CALL["function"], "extra": 1}}
    out = chat_messages([{"role": "user", "content": "hi", "reasoning_content": "x"},
                         {"role": "assistant", "tool_calls": [call]}], ignored=ignored)
    assert all(set(m) <= set(TEMPLATE_KEYS) for m in out)
    assert set(out[1]["tool_calls"][0]) == {"id", "type", "function"}
    assert set(out[1]["tool_calls"][0]["function"]) == {"name", "arguments"}
    assert ignored == ["messages.0.reasoning_content", "messages.1.tool_calls.0.index",
                       "messages.1.tool_calls.0.function.extra"]


@pytest.mark.parametrize(("messages", "field", "says"), [
    (_with_call(name=5), "messages.1.tool_calls.0.function.name", "must be a string"),
    (_with_call(name=None), "messages.1.tool_calls.0.function.name", "field required"),
    (_with_call(arguments="{city: Paris}"), ARGS, "must be a JSON object as text, got text that is not JSON"),
    (_with_call(arguments='["Paris"]'), ARGS, "must be a JSON object as text, got a JSON array"),
    (_with_call(arguments='"Paris"'), ARGS, "must be a JSON object as text, got a JSON string"),
    (_with_call(arguments="null"), ARGS, "must be a JSON object as text, got a JSON null"),
    (_with_call(arguments=None), ARGS, "field required"),
    (_with_call(arguments=["Paris"]), ARGS, "must be a JSON object as text (or a mapping), got list"),
    ([{"role": "assistant", "tool_calls": [{"id": 1, "function": {"name": "f", "arguments": "{}"}}]}],
     "messages.0.tool_calls.0.id", "must be a string"),
    ([{"role": "assistant", "tool_calls": [{"type": "code", "function": {"name": "f", "arguments": "{}"}}]}],
     "messages.0.tool_calls.0.type", "must be 'function'"),
    ([{"role": "assistant", "tool_calls": [{"id": "c"}]}], "messages.0.tool_calls.0.function", "field required"),
    ([{"role": "assistant", "tool_calls": [{"function": "f"}]}], "messages.0.tool_calls.0.function",
     "must be an object"),
    ([{"role": "assistant", "tool_calls": ["f"]}], "messages.0.tool_calls.0", "must be a tool call"),
    ([{"role": "assistant", "tool_calls": CALL}], "messages.0.tool_calls", "must be a list of tool calls"),
    ([{"role": "user", "content": "hi", "tool_calls": [CALL]}], "messages.0.tool_calls",
     "only an assistant message has tool calls"),
    ([{"role": "tool", "content": "42", "tool_call_id": 7}], "messages.0.tool_call_id", "must be a string"),
    ([{"role": "user", "content": "42", "tool_call_id": "call_1"}], "messages.0.tool_call_id",
     "only a tool message answers a tool call"),
])
def test_bad_tool_fields_name_their_path(messages, field, says):
    with pytest.raises(ValueError, match=f"^{re.escape(field)}: {re.escape(says)}"):
        chat_messages(messages)


# -- LLM.chat ----------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def llm(tiny_ouro) -> LLM:
    return LLM(tiny_ouro, scheduler="reference")


def _llm_prompt(llm: LLM, messages: list[dict[str, Any]]) -> str:
    [out] = llm.chat(messages, SamplingParams(max_tokens=1), use_tqdm=False, chat_template=TEMPLATE)
    return out.prompt


def test_llm_chat_renders_the_calls_and_ids(llm, caplog):
    assert _llm_prompt(llm, CONVERSATION) == RENDERED
    # keys a template does not get are ignored as the server ignores them, with a warning
    with caplog.at_level(logging.WARNING, logger="loopserve.llm"):
        extra = [{**CONVERSATION[0], "reasoning_content": "x"}, *CONVERSATION[1:]]
        assert _llm_prompt(llm, extra) == RENDERED
    assert "ignored unknown message fields: messages.0.reasoning_content" in caplog.text
    with pytest.raises(ValueError, match=f"^{re.escape(ARGS)}: must be a JSON object as text"):
        _llm_prompt(llm, _with_call(arguments="oops"))


# -- the server --------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def server(tiny_ouro, tmp_path_factory) -> Iterator[Server]:
    folder = tmp_path_factory.mktemp("tool-messages")
    with run_server(tiny_ouro, folder / "server.log", "--kv-cache-tokens", "1024", chat_template=TEMPLATE) as s:
        yield s


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return server.client(timeout=30)


def _rendered(server: Server, messages: list[dict[str, Any]], request_id: str | None = None) -> str:
    """The prompt the server renders for `messages` (/tokenize, then /detokenize)."""
    r = server.post("/tokenize", {"model": MODEL, "messages": messages}, request_id)
    assert r.status_code == 200, r.text
    return server.post("/detokenize", {"tokens": r.json()["tokens"]}).json()["prompt"]


def _log_after(log: Path, marker: str, timeout: float = 10.0) -> str:
    deadline = time.monotonic() + timeout
    while marker not in (text := log.read_text()):
        assert time.monotonic() < deadline, f"{marker!r} not in the log:\n{text[-3000:]}"
        time.sleep(0.05)
    return text


def test_the_template_gets_the_calls_and_ids(server):
    assert _rendered(server, CONVERSATION, "tools-known") == RENDERED
    # some clients leave out the call's id and type
    bare = [CONVERSATION[0], {"role": "assistant", "tool_calls": [{"function": CALL["function"]}]}]
    assert _rendered(server, bare) == 'user: Weather in Paris?|assistant:  [call  function get_weather city="Paris" ' \
                                      'days=2]|assistant:'
    # tool_calls and tool_call_id are known fields now; an unknown one in a call is still reported, not rendered
    odd = [CONVERSATION[0], {**CONVERSATION[1], "tool_calls": [{**CALL, "index": 0}]}, CONVERSATION[2]]
    assert _rendered(server, odd, "tools-odd") == RENDERED
    text = _log_after(server.log, "tools-odd /tokenize")
    assert "tools-odd /tokenize: ignored unknown fields: messages.1.tool_calls.0.index" in text
    assert "tools-known" not in text


def test_documents_and_tools_reach_the_template_from_chat_and_tokenize(server, client):
    # vLLM's `documents` (retrieval templates) on both endpoints, and `tools` on /tokenize too: they used to be
    # reported as ignored fields, so a retrieval or tool-use template rendered without them
    docs = [{"title": "a", "text": "x"}, {"title": "b", "text": "y"}]
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
    want = RENDERED + "[2 documents][tools: get_weather]"
    r = server.post("/tokenize", {"model": MODEL, "messages": CONVERSATION, "documents": docs, "tools": tools})
    assert r.status_code == 200, r.text
    assert server.post("/detokenize", {"tokens": r.json()["tokens"]}).json()["prompt"] == want
    c = client.chat.completions.create(model=MODEL, messages=CONVERSATION, max_tokens=1,  # type: ignore[arg-type]
                                       tools=tools, tool_choice="none",  # ("auto" needs a tool parser)
                                       extra_body={"documents": docs, "return_token_ids": True})
    ids = c.model_extra["prompt_token_ids"]
    assert server.post("/detokenize", {"tokens": ids}).json()["prompt"] == want
    # documents given twice is refused, naming the field
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=CONVERSATION, max_tokens=1,  # type: ignore[arg-type]
                                       extra_body={"documents": docs, "chat_template_kwargs": {"documents": docs}})
    assert e.value.param == "documents", e.value.body
    # given in chat_template_kwargs alone they reach the template as the field does (vLLM passes them so; this was
    # a TypeError, "got multiple values for argument 'documents'", answered as a 400 that refused them)
    r = server.post("/tokenize", {"model": MODEL, "messages": CONVERSATION, "tools": tools,
                                  "chat_template_kwargs": {"documents": docs}})
    assert r.status_code == 200, r.text
    assert server.post("/detokenize", {"tokens": r.json()["tokens"]}).json()["prompt"] == want
    # and a template that fails on them is a 400 naming the messages it could not render (once: "messages: ")
    r = server.post("/tokenize", {"model": MODEL, "messages": CONVERSATION, "chat_template_kwargs": {"documents": 5}})
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages", r.text
    assert r.json()["error"]["message"].startswith("messages: the chat template could not render them (TypeError")


def test_openai_client_and_llm_chat_render_the_same_prompt(server, client, llm):
    r = client.chat.completions.create(model=MODEL, messages=CONVERSATION, max_tokens=1,  # type: ignore[arg-type]
                                       extra_body={"return_token_ids": True})
    ids = r.model_extra["prompt_token_ids"]
    said = server.post("/detokenize", {"tokens": ids}).json()["prompt"]
    assert said == RENDERED == _llm_prompt(llm, CONVERSATION)
    # arguments sent as an object render as the JSON text of the same object
    as_object = _with_call(arguments={"city": "Paris", "days": 2})
    assert _rendered(server, as_object) == RENDERED == _llm_prompt(llm, as_object)


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/tokenize"])
def test_arguments_that_are_not_a_json_object_are_a_400_naming_them(server, path):
    for arguments, says in (("{city: Paris}", "got text that is not JSON"), ("[1, 2]", "got a JSON array")):
        r = server.post(path, {"model": MODEL, "max_tokens": 1, "messages": _with_call(arguments=arguments)})
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert (err["param"], err["type"], err["code"]) == (ARGS, "BadRequestError", 400), err
        assert err["message"].startswith(f"{ARGS}: must be a JSON object as text, {says}"), err


def test_bad_tool_fields_are_a_400_naming_them(client):
    for messages, param in (([{"role": "user", "content": "hi", "tool_calls": [CALL]}], "messages.0.tool_calls"),
                            (_with_call(name=5), "messages.1.tool_calls.0.function.name"),
                            ([*CONVERSATION[:2], {**CONVERSATION[2], "tool_call_id": 7}], "messages.2.tool_call_id"),
                            ([{"role": "user", "content": "hi", "tool_call_id": "c"}], "messages.0.tool_call_id")):
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(model=MODEL, messages=messages, max_tokens=1)  # type: ignore[arg-type]
        assert e.value.param == param, e.value.body
