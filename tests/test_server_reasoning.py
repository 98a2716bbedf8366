"""A server started with `--reasoning-parser deepseek_r1` (vLLM's flag) serving a tiny model whose chat template
opens <think> (as Ouro's Thinking template does with enable_thinking): a chat reply's reasoning comes back in the
message's `reasoning`, apart from its content, whole and streamed, through /v1/chat/completions and /v1/responses.
The tiny model's own greedy text has no </think>, so it is all reasoning (unforced); for a </think> in the middle the
checkpoint's tokenizer gets </think> as one (non-special) token, and a seeded sample over a few allowed tokens writes
it. Every answer is compared with the parse of the raw text its token ids decode to (/detokenize)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import openai
import pytest
from tokenizers import AddedToken, Tokenizer

from loopserve.serve.cli import _check
from loopserve.serve.reasoning_parsers import REASONING_PARSERS
from loopserve_lab.tiny import TinySpec, make_tiny
from tests.server_helpers import MODEL, Server, run_server
from tests.test_server_auto_tools import _forcing

pytestmark = pytest.mark.timeout(180)

TEMPLATE = ("{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}"
            "{% if add_generation_prompt %}assistant: <think>\n{% endif %}")
MESSAGES = [{"role": "user", "content": "What is two and two?"}]


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    """A tiny checkpoint whose tokenizer has </think> as one token (in the one id past the trained vocabulary)."""
    folder = make_tiny(tmp_path_factory.mktemp("thinking") / "model", TinySpec(arch="ouro", seed=1, vocab_size=557))
    tok = Tokenizer.from_file(str(folder / "tokenizer.json"))
    tok.add_tokens([AddedToken("</think>", special=False, normalized=False)])
    tok.save(str(folder / "tokenizer.json"))
    return folder


@pytest.fixture(scope="module")
def server(model, tmp_path_factory) -> Iterator[Server]:
    log = tmp_path_factory.mktemp("thinking-server") / "server.log"
    with run_server(model, log, "--kv-cache-tokens", "4096", "--reasoning-parser", "deepseek_r1",
                    chat_template=TEMPLATE) as s:
        yield s


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return server.client()


def _raw(server: Server, ids: list[int]) -> str:
    r = server.post("/detokenize", {"model": MODEL, "tokens": ids})
    assert r.status_code == 200, r.text
    return r.json()["prompt"]


def _parse(text: str) -> tuple[str | None, str | None]:
    return REASONING_PARSERS["deepseek_r1"].parser(None).parse(text)


def _reasoning(message: Any) -> str | None:
    return (message.model_extra or {}).get("reasoning")


def _chat(client: openai.OpenAI, **extra: Any) -> Any:
    return client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=24, temperature=0,
                                          extra_body={"return_token_ids": True, **extra})


def _end_id(model) -> int:
    return Tokenizer.from_file(str(model / "tokenizer.json")).token_to_id("</think>")


def _split_sample(client: openai.OpenAI, model) -> dict[str, Any]:
    """Sampling fields that make the model write </think> between other text: a seed whose sample over a few allowed
    tokens (</think> among them) has reasoning before it and content after it."""
    tok = Tokenizer.from_file(str(model / "tokenizer.json"))
    allowed = [_end_id(model), *tok.encode(" a b").ids]
    for seed in range(20):
        fields = {"temperature": 1.0, "seed": seed, "allowed_token_ids": allowed}
        r = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=12, extra_body=fields)
        if _reasoning(r.choices[0].message) and r.choices[0].message.content:
            return fields
    pytest.fail("no seed wrote </think> in the middle")


def test_unforced_output_is_all_reasoning(server, client):
    """The template opened <think> and the model never closed it: all of its text is reasoning, content null."""
    r = _chat(client)
    (c,) = r.choices
    raw = _raw(server, c.model_extra["token_ids"])
    assert raw and "</think>" not in raw
    assert _reasoning(c.message) == raw and c.message.content is None
    assert r.usage.completion_tokens == len(c.model_extra["token_ids"])


def test_think_end_splits_reasoning_from_content(server, client, model):
    fields = _split_sample(client, model)
    r = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=12,
                                       extra_body={**fields, "return_token_ids": True})
    (c,) = r.choices
    raw = _raw(server, c.model_extra["token_ids"])
    assert "</think>" in raw
    assert (_reasoning(c.message), c.message.content) == _parse(raw)
    assert "</think>" not in (_reasoning(c.message) or "")
    # include_reasoning false: the same reply without its reasoning
    r2 = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=12,
                                        extra_body={**fields, "include_reasoning": False})
    assert _reasoning(r2.choices[0].message) is None and r2.choices[0].message.content == c.message.content
    assert r2.usage.completion_tokens == r.usage.completion_tokens
    # streamed: reasoning deltas, then content deltas, joining into the whole answer
    chunks = list(client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=12, stream=True,
                                                 extra_body=fields))
    deltas = [ch.choices[0].delta for ch in chunks if ch.choices]
    kinds = [k for d in deltas for k in ("reasoning", "content") if (d.model_extra or {}).get(k) or
             (k == "content" and d.content)]
    assert kinds == sorted(kinds, key=lambda k: k == "content") and "content" in kinds and "reasoning" in kinds
    assert "".join((d.model_extra or {}).get("reasoning") or "" for d in deltas) == _reasoning(c.message)
    assert "".join(d.content or "" for d in deltas) == c.message.content


def test_grammar_beside_the_parser_is_refused(client):
    """vLLM holds a grammar back until the reasoning ends; this server cannot, so it refuses it, naming the field."""
    for extra, field in ((_forcing("four"), "structured_outputs"),
                         ({"response_format": {"type": "json_object"}}, "response_format"),
                         ({"echo": True}, "echo")):
        with pytest.raises(openai.BadRequestError) as e:
            _chat(client, **extra)
        assert e.value.body["param"] == field and "--reasoning-parser" in e.value.body["message"]
    weather = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=MESSAGES, tools=[weather], tool_choice="required")
    assert e.value.body["param"] == "tool_choice"


def test_responses_reasoning_item(client):
    """/v1/responses: the reasoning is an item of its own before the message (here all of the greedy text: the model
    never closes the block), whole and streamed alike, counted in reasoning_tokens; replayed in the next turn's input,
    it is taken."""
    chat = _chat(client)
    reasoning = _reasoning(chat.choices[0].message)
    r = client.responses.create(model=MODEL, input=MESSAGES[0]["content"], max_output_tokens=24, temperature=0)
    assert [i.type for i in r.output] == ["reasoning", "message"]
    item = r.output[0]
    assert item.id.startswith("rs_") and item.summary == [] and [(p.type, p.text) for p in item.content] == [
        ("reasoning_text", reasoning)]
    assert r.output[1].content[0].text == "" and r.output_text == ""
    assert r.usage.output_tokens_details.reasoning_tokens == r.usage.output_tokens  # (all of them: no </think>)
    events = list(client.responses.create(model=MODEL, input=MESSAGES[0]["content"], max_output_tokens=24,
                                          temperature=0, stream=True))
    deltas = [e for e in events if e.type == "response.reasoning_text.delta"]
    assert "".join(e.delta for e in deltas) == reasoning
    assert all(e.output_index == 0 and e.item_id == deltas[0].item_id for e in deltas)
    (done,) = [e for e in events if e.type == "response.reasoning_text.done"]
    assert done.text == reasoning and [e.sequence_number for e in events] == list(range(len(events)))
    # (vLLM's event names for the reasoning item's part; the message's are content_part's)
    assert [e.type for e in events if e.type.endswith(("_part.added", "_part.done"))] == [
        "response.reasoning_part.added", "response.reasoning_part.done", "response.content_part.added",
        "response.content_part.done"]
    final = events[-1].response
    assert [i.type for i in final.output] == ["reasoning", "message"] and final.output[0].content[0].text == reasoning
    assert final.usage.output_tokens_details.reasoning_tokens == r.usage.output_tokens_details.reasoning_tokens
    replay = [{"role": "user", "content": MESSAGES[0]["content"]}, *[i.model_dump(exclude_none=True)
                                                                      for i in r.output],
              {"role": "user", "content": "And three and three?"}]
    again = client.responses.create(model=MODEL, input=replay, max_output_tokens=4, temperature=0)
    assert again.output[0].type == "reasoning"


def test_cli_refuses_an_unknown_parser(model):
    from loopserve.cli import build_parser

    args = build_parser().parse_args(["serve", str(model), "--reasoning-parser", "nope"])
    problem = _check(args)
    assert problem is not None and "--reasoning-parser" in problem and "deepseek_r1, qwen3" in problem
    assert _check(build_parser().parse_args(["serve", str(model), "--reasoning-parser", "qwen3"])) is None


def test_beam_search_replies_are_split_too(server, client):
    """A beam search's choices (the chat path's too, as vLLM's full generator reads every reply) are parsed alike."""
    r = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=8, n=2,
                                       extra_body={"use_beam_search": True, "return_token_ids": True})
    assert len(r.choices) == 2
    for c in r.choices:
        raw = _raw(server, c.model_extra["token_ids"])
        assert raw and (_reasoning(c.message), c.message.content) == _parse(raw)
