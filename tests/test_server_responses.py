"""OpenAI's Responses API (`POST /v1/responses`, serve/responses_api.py) against a real `loopserve serve`: driven by
the official client (`responses.create`, streamed and not, and the `responses.stream` helper) and by raw httpx. A
request runs as the chat request it translates to, so its greedy output is the chat route's for the same messages,
token for token; its stream's events rebuild the response it would have got whole; its errors name its own fields."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any, Literal

import httpx
import openai
import pydantic
import pytest

from loopserve_lab.tiny import TinySpec, make_tiny
from tests.server_helpers import MODEL, Server, run_server, wait_idle

pytest.importorskip("llguidance")
pytestmark = pytest.mark.timeout(180)

# a chat template that shows every message's role and content, the tools, and the calls and what each answers, so a
# message lost or changed in the translation changes the prompt
TEMPLATE = ("{% if tools %}tools:{% for t in tools %} {{ t.function.name }}{% endfor %}\n{% endif %}"
            "{% for m in messages %}{{ m.role }}: {{ m.content }}"
            "{% for c in m.tool_calls or [] %} call {{ c.id }} {{ c.function.name }}{% endfor %}"
            "{% if m.tool_call_id %} for {{ m.tool_call_id }}{% endif %}\n{% endfor %}"
            "{% if add_generation_prompt %}assistant:{% endif %}")
WEATHER_PARAMETERS = {"type": "object", "additionalProperties": False, "required": ["city", "days"],
                      "properties": {"city": {"enum": ["Paris", "Oslo"]},
                                     "days": {"type": "integer", "minimum": 1, "maximum": 7}}}
WEATHER = {"type": "function", "name": "get_weather", "description": "The forecast", "parameters": WEATHER_PARAMETERS}
CHAT_WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "The forecast",
                                                 "parameters": WEATHER_PARAMETERS}}
PET = {"type": "object", "additionalProperties": False, "required": ["kind", "legs"],
       "properties": {"kind": {"enum": ["cat", "dog"]}, "legs": {"type": "integer", "minimum": 0, "maximum": 8}}}


class Pet(pydantic.BaseModel):  # (PET's fields)
    kind: Literal["cat", "dog"]
    legs: int = pydantic.Field(ge=0, le=8)


# vLLM's extension: no whitespace between JSON tokens (a random model pads JSON with it until the budget runs out)
COMPACT = {"structured_outputs": {"disable_any_whitespace": True}}
GREEDY = {"temperature": 0}


@pytest.fixture(scope="module")
def server(tmp_path_factory) -> Iterator[Server]:
    folder = tmp_path_factory.mktemp("responses")
    model = make_tiny(folder / "model", TinySpec(arch="ouro", seed=1))
    with run_server(model, folder / "server.log", "--dtype", "float64", "--kv-cache-tokens", "2048",
                    chat_template=TEMPLATE) as s:
        yield s


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return server.client()


def _chat(client: openai.OpenAI, messages: list[dict[str, Any]], max_tokens: int, **kwargs: Any) -> Any:
    return client.chat.completions.create(model=MODEL, messages=messages, max_tokens=max_tokens, **GREEDY, **kwargs)


def _same_as_chat(response: Any, chat: Any) -> None:
    """A response's text, token counts and status are those of the chat completion of the same messages."""
    assert response.output_text == chat.choices[0].message.content
    assert response.usage.input_tokens == chat.usage.prompt_tokens
    assert response.usage.output_tokens == chat.usage.completion_tokens
    assert response.usage.total_tokens == chat.usage.total_tokens
    assert response.status == ("incomplete" if chat.choices[0].finish_reason == "length" else "completed")


_RUN_FIELDS = ("id", "created_at", "call_id", "cached_tokens", "prefill_loops")


def _without_ids(obj: Any) -> Any:
    """A response object (JSON) without what differs between two runs of the same request: ids, times, and what
    the prefix cache changes (the second run finds the first's prompt blocks there: its cached tokens, and fewer
    prefill loops)."""
    if isinstance(obj, dict):
        return {k: _without_ids(v) for k, v in obj.items() if k not in _RUN_FIELDS}
    if isinstance(obj, list):
        return [_without_ids(v) for v in obj]
    return obj


def _raw_events(server: Server, body: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    """A streamed request's events as (the `event:` line's type, the data's JSON), checking the framing."""
    events = []
    with httpx.stream("POST", server.url + "/v1/responses", json={"model": MODEL, "stream": True, **body},
                      timeout=60) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        text = r.read().decode()
    assert text.endswith("\n\n")
    for block in text.removesuffix("\n\n").split("\n\n"):
        head, data = block.split("\n")
        assert head.startswith("event: ") and data.startswith("data: "), block
        events.append((head.removeprefix("event: "), json.loads(data.removeprefix("data: "))))
    return events


# -- the text: the chat route's ----------------------------------------------------------------------------------
def test_text_is_the_chat_routes(client):
    r = client.responses.create(model=MODEL, input="Hello there", max_output_tokens=12, **GREEDY)
    _same_as_chat(r, _chat(client, [{"role": "user", "content": "Hello there"}], 12))
    assert r.id.startswith("resp_") and r.object == "response" and r.model == MODEL and r.error is None
    [item] = r.output
    assert item.type == "message" and item.role == "assistant" and item.id.startswith("msg_")
    [part] = item.content
    assert part.type == "output_text" and part.annotations == [] and part.text == r.output_text
    assert r.usage.output_tokens_details.reasoning_tokens == 0 and r.usage.input_tokens_details.cached_tokens >= 0
    # what the request ran with
    assert r.temperature == 0 and r.max_output_tokens == 12 and r.tools == [] and r.text.format.type == "text"


def test_seed_and_logprobs_are_the_chat_routes(client):
    """A sampled response with a seed is the chat route's sample with that seed; `top_logprobs` gives each output
    token's logprobs, with that many alternatives, as the chat route's `logprobs`."""
    seeded = {"input": "Once", "max_output_tokens": 8, "temperature": 1, "extra_body": {"seed": 7}}  # (the client's
    # Responses signature has no seed: the chat path's field, sent as an extra)
    r = client.responses.create(model=MODEL, top_logprobs=2, **seeded)
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Once"}], max_tokens=8,
                                          temperature=1, seed=7, logprobs=True, top_logprobs=2)
    _same_as_chat(r, chat)
    logprobs = r.output[0].content[0].logprobs
    assert [(lp.token, lp.logprob) for lp in logprobs] == [(lp.token, lp.logprob)
                                                           for lp in chat.choices[0].logprobs.content]
    assert len(logprobs) == r.usage.output_tokens and all(len(lp.top_logprobs) == 2 for lp in logprobs)
    streamed = list(client.responses.create(model=MODEL, top_logprobs=2, stream=True, **seeded))
    # each token's with its text's delta (a token whose text is held back, part of a character, with the text's
    # next delta; one whose text never comes out, in the done events only)
    pieces = [lp.model_dump() for e in streamed if e.type == "response.output_text.delta" for lp in e.logprobs]
    assert pieces and pieces == [lp.model_dump() for lp in logprobs][:len(pieces)]
    [done] = [e for e in streamed if e.type == "response.output_text.done"]
    assert [lp.model_dump() for lp in done.logprobs] == [lp.model_dump() for lp in logprobs]
    assert streamed[-1].response.output[0].content[0].logprobs == logprobs
    # asked by `include` alone: the tokens' own logprobs
    r = client.responses.create(model=MODEL, include=["message.output_text.logprobs"], **seeded)
    assert [lp.logprob for lp in r.output[0].content[0].logprobs] == [lp.logprob for lp in logprobs]
    assert client.responses.create(model=MODEL, input="Once", max_output_tokens=8).output[0].content[0].logprobs == []


def test_instructions_are_a_system_message_first(client):
    """`instructions` and a conversation of message items (input_text parts, a developer message, an earlier
    turn's output message replayed with its output_text part) are the chat messages they name."""
    first = client.responses.create(model=MODEL, input="Hi", max_output_tokens=4, **GREEDY)
    r = client.responses.create(model=MODEL, instructions="Be brief.", max_output_tokens=10, **GREEDY, input=[
        {"role": "user", "content": [{"type": "input_text", "text": "Hi"}]},
        first.output[0].model_dump(exclude_none=True),
        {"role": "developer", "content": "Answer in French."},
        {"type": "message", "role": "user", "content": "And then?"}])
    _same_as_chat(r, _chat(client, [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
                                    {"role": "assistant", "content": first.output_text},
                                    {"role": "developer", "content": "Answer in French."},
                                    {"role": "user", "content": "And then?"}], 10))
    assert r.instructions == "Be brief."
    # without the instructions, another prompt
    other = client.responses.create(model=MODEL, input="Hi", max_output_tokens=4, **GREEDY)
    assert other.usage.input_tokens < client.responses.create(
        model=MODEL, input="Hi", instructions="Be brief.", max_output_tokens=4, **GREEDY).usage.input_tokens


def test_max_output_tokens_cut_is_incomplete(client):
    more = {"extra_body": {"ignore_eos": True}}  # (cut by max_output_tokens, not ended by the model)
    r = client.responses.create(model=MODEL, input="Tell me a story", max_output_tokens=3, **GREEDY, **more)
    assert r.status == "incomplete" and r.incomplete_details is not None
    assert r.incomplete_details.reason == "max_output_tokens"
    assert r.usage.output_tokens == 3 and r.output[0].status == "incomplete"
    full = client.responses.create(model=MODEL, input="Tell me a story", max_output_tokens=30, **GREEDY, **more)
    assert full.output_text.startswith(r.output_text) and len(full.output_text) > len(r.output_text)


def test_json_schema_output_parses_and_matches(client):
    r = client.responses.create(model=MODEL, input="A pet, please", max_output_tokens=40, **GREEDY,
                                text={"format": {"type": "json_schema", "name": "pet", "schema": PET, "strict": True}},
                                extra_body=COMPACT)
    assert r.status == "completed"
    pet = json.loads(r.output_text)
    assert set(pet) == {"kind", "legs"} and pet["kind"] in ("cat", "dog") and 0 <= pet["legs"] <= 8
    assert r.text.format.type == "json_schema"
    chat = _chat(client, [{"role": "user", "content": "A pet, please"}], 40, extra_body=COMPACT, response_format={
        "type": "json_schema", "json_schema": {"name": "pet", "schema": PET, "strict": True}})
    _same_as_chat(r, chat)
    # the client's parse: a pydantic model as the schema, the output parsed into it
    parsed = client.responses.parse(model=MODEL, input="A pet, please", text_format=Pet, max_output_tokens=40,
                                    **GREEDY, extra_body=COMPACT).output_parsed
    assert isinstance(parsed, Pet) and parsed.model_dump() == pet
    # json_object: any JSON object
    r = client.responses.create(model=MODEL, input="An object", max_output_tokens=40, **GREEDY,
                                text={"format": {"type": "json_object"}}, extra_body=COMPACT)
    assert r.output_text.startswith("{")


def test_a_forced_function_call_is_a_function_call_item(client):
    for choice in ({"type": "function", "name": "get_weather"}, "required"):
        r = client.responses.create(model=MODEL, input="Weather in Oslo?", tools=[WEATHER], tool_choice=choice,
                                    max_output_tokens=100, **GREEDY, extra_body=COMPACT)
        assert r.status == "completed" and r.output_text == ""
        [call] = r.output
        assert call.type == "function_call" and call.name == "get_weather" and call.status == "completed"
        assert call.id.startswith("fc_") and call.call_id
        args = json.loads(call.arguments)
        assert set(args) == {"city", "days"} and args["city"] in ("Paris", "Oslo") and 1 <= args["days"] <= 7
        chat = _chat(client, [{"role": "user", "content": "Weather in Oslo?"}], 100, tools=[CHAT_WEATHER],
                     tool_choice="required" if choice == "required" else {"type": "function",
                                                                          "function": {"name": "get_weather"}},
                     extra_body=COMPACT)
        assert chat.choices[0].message.tool_calls[0].function.arguments == call.arguments
        assert r.tool_choice == choice if isinstance(choice, str) else r.tool_choice.name == "get_weather"
        assert r.tools[0].name == "get_weather"


def test_function_call_output_round_trip(client):
    """A turn's function_call item and the function_call_output answering it are the assistant's tool call and the
    tool message of a chat conversation."""
    call = client.responses.create(model=MODEL, input="Weather in Oslo?", tools=[WEATHER], max_output_tokens=40,
                                   tool_choice={"type": "function", "name": "get_weather"}, **GREEDY,
                                   extra_body=COMPACT).output[0]
    assert call.type == "function_call"
    r = client.responses.create(model=MODEL, tools=[WEATHER], tool_choice="none", max_output_tokens=10, **GREEDY,
                                input=[{"role": "user", "content": "Weather in Oslo?"},
                                       call.model_dump(exclude_none=True),
                                       {"type": "function_call_output", "call_id": call.call_id, "output": "Sunny"}])
    chat = _chat(client, [{"role": "user", "content": "Weather in Oslo?"},
                          {"role": "assistant", "content": None, "tool_calls": [
                              {"id": call.call_id, "type": "function",
                               "function": {"name": call.name, "arguments": call.arguments}}]},
                          {"role": "tool", "tool_call_id": call.call_id, "content": "Sunny"}], 10,
                 tools=[CHAT_WEATHER], tool_choice="none")
    _same_as_chat(r, chat)
    [item] = r.output
    assert item.type == "message"


# -- streaming ---------------------------------------------------------------------------------------------------
def test_stream_rebuilds_the_whole_response(server, client):
    body = {"input": "Hello there", "max_output_tokens": 12, **GREEDY}
    whole = client.responses.create(model=MODEL, **body)
    events = list(client.responses.create(model=MODEL, stream=True, **body))
    assert [e.sequence_number for e in events] == list(range(len(events)))
    kinds = [e.type for e in events]
    deltas = [e for e in events if e.type == "response.output_text.delta"]
    assert kinds == ["response.created", "response.in_progress", "response.output_item.added",
                     "response.content_part.added", *["response.output_text.delta"] * len(deltas),
                     "response.output_text.done", "response.content_part.done", "response.output_item.done",
                     "response.completed"]
    assert deltas and all(e.item_id == events[2].item.id and e.output_index == 0 and e.content_index == 0
                          for e in deltas)
    text = "".join(e.delta for e in deltas)
    assert text == whole.output_text == events[-4].text
    assert events[0].response.status == "in_progress" and events[0].response.output == []
    final = events[-1].response
    assert final.output_text == text and final.output[0].id == events[2].item.id
    assert _without_ids(final.model_dump()) == _without_ids(whole.model_dump())
    # the raw framing: each event's `event:` line names its type
    raw = _raw_events(server, body)
    assert [kind for kind, _ in raw] == [data["type"] for _, data in raw] == kinds
    assert _without_ids(raw[-1][1]["response"]) == _without_ids(whole.model_dump(exclude_unset=True))


def test_stream_helper_gets_the_final_response(client):
    body = {"input": "A pet, please", "max_output_tokens": 40, **GREEDY,
            "text": {"format": {"type": "json_schema", "name": "pet", "schema": PET, "strict": True}}}
    whole = client.responses.create(model=MODEL, **body, extra_body=COMPACT)
    with client.responses.stream(model=MODEL, **body, extra_body=COMPACT) as stream:
        text = "".join(e.delta for e in stream if e.type == "response.output_text.delta")
        final = stream.get_final_response()
    assert text == final.output_text == whole.output_text
    assert json.loads(text)["kind"] in ("cat", "dog")


def test_streamed_function_call(client):
    body = {"input": "Weather in Oslo?", "tools": [WEATHER], "tool_choice": {"type": "function", "name": "get_weather"},
            "max_output_tokens": 40, **GREEDY}
    whole = client.responses.create(model=MODEL, **body, extra_body=COMPACT)
    events = list(client.responses.create(model=MODEL, stream=True, **body, extra_body=COMPACT))
    kinds = [e.type for e in events]
    pieces = [e.delta for e in events if e.type == "response.function_call_arguments.delta"]
    assert kinds == ["response.created", "response.in_progress", "response.output_item.added",
                     *["response.function_call_arguments.delta"] * len(pieces),
                     "response.function_call_arguments.done", "response.output_item.done", "response.completed"]
    assert events[2].item.type == "function_call" and events[2].item.name == "get_weather"
    done = events[-3]
    assert "".join(pieces) == done.arguments == whole.output[0].arguments
    assert events[-2].item.call_id == events[2].item.call_id
    assert _without_ids(events[-1].response.model_dump()) == _without_ids(whole.model_dump())


def test_a_client_that_leaves_mid_stream_frees_its_request(server):
    with httpx.stream("POST", server.url + "/v1/responses", timeout=60, json={
            "model": MODEL, "input": "A long story", "max_output_tokens": 1000, "stream": True}) as r:
        for line in r.iter_lines():
            if "response.output_text.delta" in line:
                break
    wait_idle(server)
    assert httpx.get(server.url + "/health").status_code == 200


# -- errors ------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(("body", "param"), [
    ({"input": "x", "previous_response_id": "resp_1"}, "previous_response_id"),
    ({"input": "x", "background": True}, "background"),
    ({"input": "x", "truncation": "none"}, "truncation"),
    ({}, "input"),
    ({"input": []}, "input"),
    ({"input": 5}, "input"),
    ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "input.0"),
    ({"input": [{"type": "reasoning", "summary": 5}]}, "input.0.summary"),
    ({"input": [{"type": "reasoning", "summary": []}]}, "input"),  # (taken, and left out: no message is left)
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "http://x"}]}]},
     "input.0.content.0.type"),
    ({"input": [{"role": "robot", "content": "x"}]}, "input.0.role"),
    ({"input": [{"type": "function_call_output", "call_id": 5, "output": "x"}]}, "input.0.call_id"),
    ({"input": [{"role": "user", "content": "x"},
                {"type": "function_call", "call_id": "c", "name": "f", "arguments": "not json"}]}, "input.1.arguments"),
    ({"input": "x", "max_output_tokens": 0}, "max_output_tokens"),
    ({"input": "x", "temperature": -1}, "temperature"),
    ({"input": "x", "top_p": "high"}, "top_p"),
    ({"input": "x", "reasoning": {"effort": "extreme"}}, "reasoning.effort"),
    ({"input": "x", "tools": [{"type": "web_search"}]}, "tools.0.type"),
    ({"input": "x", "top_k": "many"}, "top_k"),  # (vLLM's fields, checked as the chat request's)
    ({"input": "x", "repetition_penalty": -1}, "repetition_penalty"),
    ({"input": "x", "cache_salt": ""}, "cache_salt"),
    ({"input": "x", "tools": [WEATHER], "tool_choice": {"type": "function", "name": "nope"}}, "tool_choice.name"),
    ({"input": "x", "tools": [{**WEATHER, "parameters": {"type": "string"}}], "tool_choice": "required"},
     "tools.0.parameters"),
    ({"input": "x", "text": {"format": {"type": "json_schema", "schema": PET}}}, "text.format.name"),
    ({"input": "x", "text": {"format": {"type": "json_schema", "name": "a", "schema": {"type": 5}}}},
     "text.format.schema"),
    ({"input": "x", "text": {"format": {"type": "xml"}}}, "text.format.type"),
    ({"input": "x" * 20000}, "input"),  # longer than the context
    # (it goes back in the X-Request-Id header: a newline in it dropped the connection after the answer was made)
    ({"input": "x", "request_id": "a\nb"}, "request_id"),
    ({"input": "x", "request_id": "r" * 129}, "request_id"),
])
def test_bad_input_is_a_400_naming_the_field(server, body, param):
    r = server.post("/v1/responses", {"model": MODEL, **body})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and error["message"].startswith(param + ":"), error
    assert error["type"] == "BadRequestError" and error["code"] == 400


def test_vllms_sampling_fields_are_the_chat_routes(client):
    """vLLM's fields of a Responses body beside OpenAI's (stop, top_k, repetition_penalty, logit_bias, ...) run as the
    chat route's (they were dropped as unknown: a `stop` came back unstopped)."""
    plain = client.responses.create(model=MODEL, input="Hello there", max_output_tokens=12, **GREEDY)
    stop = plain.output_text[3:5]
    r = client.responses.create(model=MODEL, input="Hello there", max_output_tokens=12, **GREEDY,
                                extra_body={"stop": [stop]})
    assert r.output_text == plain.output_text[:plain.output_text.index(stop)] and r.status == "completed"
    extras = {"top_k": 5, "repetition_penalty": 1.5, "logit_bias": {"7": -100}, "ignore_eos": True, "stop": [stop]}
    r = client.responses.create(model=MODEL, input="Hello there", max_output_tokens=12, **GREEDY, extra_body=extras)
    _same_as_chat(r, _chat(client, [{"role": "user", "content": "Hello there"}], 12, extra_body=extras))
    assert r.output_text != plain.output_text


def test_tools_with_auto_and_no_parser_are_text(client):
    """tool_choice "auto" (the default with tools) on a server without --enable-auto-tool-choice: text, as vLLM's
    Responses route answers without a parser (its chat route refuses it: so does this one's), the tools still in
    the prompt."""
    weather = WEATHER  # (the Responses API's flat shape)
    for choice in ({}, {"tool_choice": "auto"}):
        r = client.responses.create(model=MODEL, input="Weather?", tools=[weather], max_output_tokens=6, **GREEDY,
                                    **choice)
        none = client.responses.create(model=MODEL, input="Weather?", tools=[weather], tool_choice="none",
                                       max_output_tokens=6, **GREEDY)
        assert [o.type for o in r.output] == ["message"] and r.output_text == none.output_text
    r = client.responses.create(model=MODEL, input="Weather?", tool_choice="auto", max_output_tokens=6, **GREEDY)
    assert [o.type for o in r.output] == ["message"] and r.tool_choice == "auto"  # ("auto" with no tools: text)
    with pytest.raises(openai.BadRequestError, match="tool_choice"):
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Weather?"}], max_tokens=6,
                                       tools=[{"type": "function", "function": {k: v for k, v in weather.items()
                                                                                if k != "type"}}])


def test_a_body_request_id_names_the_response(server):
    """vLLM's `request_id` of a Responses body: its id as given where it has the resp_ prefix (was resp_resp_...),
    prefixed where not; `truncation: "auto"` is taken (nothing needs dropping here); usage carries the client type's
    cache_write_tokens."""
    for given, rid in (("resp_mine", "resp_mine"), ("mine", "resp_mine")):
        r = server.post("/v1/responses", {"model": MODEL, "input": "Hi", "max_output_tokens": 2, "request_id": given,
                                          "truncation": "auto"})
        assert r.status_code == 200 and r.json()["id"] == rid and r.headers["x-request-id"] == given, r.text
        assert r.json()["truncation"] == "auto"
        assert r.json()["usage"]["input_tokens_details"] == {"cached_tokens": r.json()["usage"][
            "input_tokens_details"]["cached_tokens"], "cache_write_tokens": 0}


def test_previous_response_id_is_refused_through_the_client(client):
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(model=MODEL, input="x", previous_response_id="resp_1")
    assert "previous_response_id" in str(e.value) and "stores no responses" in str(e.value)


def test_an_unknown_model_is_a_404(server):
    r = server.post("/v1/responses", {"model": "nope", "input": "x"})
    assert r.status_code == 404 and r.json()["error"]["param"] == "model"


def test_openapi_documents_the_route(server):
    schema = httpx.get(server.url + "/openapi.json").json()
    operation = schema["paths"]["/v1/responses"]["post"]
    ref = operation["requestBody"]["content"]["application/json"]["schema"]["$ref"]
    assert ref == "#/components/schemas/ResponsesRequest"
    assert {"input", "instructions", "max_output_tokens", "text", "tools"} <= set(
        schema["components"]["schemas"]["ResponsesRequest"]["properties"])
    assert set(operation["responses"]["200"]["content"]) == {"application/json", "text/event-stream"}
    assert "400" in operation["responses"] and "422" not in operation["responses"]


def test_the_depth_controls_are_the_chat_routes(server, client):
    """loopserve's depth controls (min_loops, max_loops, exit_threshold, exit_policy, exit_trace,
    num_speculative_tokens) reach a response as they reach a chat completion: the same loops run, and a bad value is
    a 400 naming it (they were ignored as unknown fields: a request at max_loops 1 ran the model's full depth, and
    max_loops 9 on a model of 4 was a 200)."""
    from loopserve.sampling_params import EXIT_FIELDS
    from loopserve.serve.responses_api import CHAT_FIELDS

    assert set(EXIT_FIELDS) | {"exit_trace", "num_speculative_tokens"} <= set(CHAT_FIELDS)
    depth = {"exit_policy": "fixed", "max_loops": 1}
    r = client.responses.create(model=MODEL, input="Hello there", max_output_tokens=6, **GREEDY, extra_body=depth)
    chat = _chat(client, [{"role": "user", "content": "Hello there"}], 6, extra_body=depth)
    _same_as_chat(r, chat)
    assert r.usage.model_extra["loops"] == chat.usage.model_extra["loops"] == r.usage.output_tokens - 1
    bad = httpx.post(server.url + "/v1/responses", timeout=60,
                     json={"model": MODEL, "input": "hi", "max_output_tokens": 4, "max_loops": 9})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "max_loops", bad.text
