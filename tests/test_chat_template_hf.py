"""Chat templates and the tokenizer as scripts written for vLLM use them: `LLM.get_tokenizer()` answers
transformers' calls (`apply_chat_template` with its keywords and defaults, calling the tokenizer, `len`,
`get_vocab`, `batch_decode`, token <-> id, the special tokens), and `continue_final_message` leaves the final
assistant message open, in the tokenizer, `LLM.chat`, chat completions and /tokenize alike. The server's other
chat fields that change the output (`echo`, `add_special_tokens`) do what vLLM's do, and a per-request
`chat_template` is refused as vLLM refuses it by default.

Before: `apply_chat_template` returned text with the generation prompt whatever `tokenize` and
`add_generation_prompt` said, took `continue_final_message` and transformers' options as template variables;
`LLM.chat(continue_final_message=...)` was a TypeError; the server ignored these fields (a warning in the log)
and closed the assistant turn; the tokenizer could not be called, nor had the methods below. Later: a
`chat_template_kwargs` name of one of apply_chat_template's arguments (`tokenize`, ...) was a TypeError, and chat
`echo` without a generation prompt echoed only an assistant's final message (vLLM's rule: any role's).

The expected values come from the `tokenizers` library on the same files (transformers is not installed here);
`test_transformers_agrees` compares with transformers itself where it is.
"""

from __future__ import annotations

import importlib.util
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest
from tokenizers import Tokenizer as Raw

from loopserve import LLM, SamplingParams
from loopserve.tokenizer import Tokenizer
from tests.server_helpers import MODEL, Server, run_server

pytestmark = pytest.mark.timeout(120)

HELLO = [{"role": "user", "content": "Hello"}]
CONTINUED = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Good morrow"}]
# the tiny Huginn's template (loopserve_lab/tokenization/build.py): BOS first, content trimmed, <|end_text|> closes
HUGINN_HEAD = ("<|begin_text|><|begin_header|>user<|end_header|>\n\nHi<|end_turn|>"
               "<|begin_header|>Huginn<|end_header|>\n\n")
HUGINN_CONTINUED = HUGINN_HEAD + "Good morrow"


@pytest.fixture(scope="module")
def huginn(tiny_huginn) -> Tokenizer:
    """Its tokenizer's post-processor adds BOS, which the template writes too."""
    return Tokenizer(tiny_huginn)


@pytest.fixture(scope="module")
def ouro(tiny_ouro) -> Tokenizer:
    return Tokenizer(tiny_ouro)


def _raw(folder: Path) -> tuple[Raw, dict[str, Any]]:
    return Raw.from_file(str(folder / "tokenizer.json")), json.loads((folder / "tokenizer_config.json").read_text())


# -- apply_chat_template: transformers' keywords and defaults -------------------------------------------------------
def test_defaults_are_transformers(huginn, tiny_huginn):
    raw, _ = _raw(tiny_huginn)
    closed = "<|begin_text|><|begin_header|>user<|end_header|>\n\nHello<|end_turn|><|end_text|>"
    # tokenize=True and no generation prompt by default; the ids are the text's, BOS not added a second time
    ids = huginn.apply_chat_template(HELLO)
    assert ids == raw.encode(closed, add_special_tokens=False).ids
    assert ids.count(huginn.bos_token_id) == 1 and raw.encode(closed).ids == [huginn.bos_token_id, *ids]
    assert huginn.apply_chat_template(HELLO, tokenize=False) == closed
    opened = huginn.apply_chat_template(HELLO, tokenize=False, add_generation_prompt=True)
    assert opened == closed.removesuffix("<|end_text|>") + "<|begin_header|>Huginn<|end_header|>\n\n"


def test_transformers_options_are_refused_not_template_variables(ouro):
    shows = "{{ padding is defined }} {{ return_dict is defined }} {{ enable_thinking }}"
    # at the value that does nothing (transformers' defaults) they are taken, and the template does not see them
    assert ouro.apply_chat_template(HELLO, chat_template=shows, tokenize=False, padding=False, return_dict=False,
                                    return_tensors=None, enable_thinking=True) == "False False True"
    for name, value in (("return_dict", True), ("return_tensors", "pt"), ("padding", True), ("truncation", True),
                        ("max_length", 8), ("return_assistant_tokens_mask", True), ("tokenizer_kwargs", {"a": 1})):
        with pytest.raises(ValueError, match=f"^{name}: not supported by this tokenizer"):
            ouro.apply_chat_template(HELLO, **{name: value})


# -- continue_final_message ----------------------------------------------------------------------------------------
def test_continue_final_message_leaves_the_turn_open(ouro, huginn):
    assert ouro.apply_chat_template(CONTINUED, tokenize=False, continue_final_message=True) == (
        "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\nGood morrow")
    assert huginn.apply_chat_template(CONTINUED, tokenize=False, continue_final_message=True) == HUGINN_CONTINUED
    assert huginn.apply_chat_template(CONTINUED, continue_final_message=True) == huginn.encode(
        HUGINN_CONTINUED, add_special_tokens=False)
    # the cut is where the template put the final text, not where that text occurs last (here in <|im_end|>)
    said = [CONTINUED[0], {"role": "assistant", "content": "im_end"}]
    assert ouro.apply_chat_template(said, tokenize=False, continue_final_message=True).endswith("assistant\nim_end")
    # trailing whitespace: kept where the template keeps it, dropped where it trims the content (as transformers)
    spaced = [CONTINUED[0], {"role": "assistant", "content": "Good morrow \n"}]
    assert ouro.apply_chat_template(spaced, tokenize=False, continue_final_message=True).endswith("morrow \n")
    assert huginn.apply_chat_template(spaced, tokenize=False, continue_final_message=True) == HUGINN_CONTINUED
    # content parts: after the last text part
    parts = [CONTINUED[0], {"role": "assistant", "content": [{"type": "text", "text": "Good"},
                                                             {"type": "text", "text": " morrow"}]}]
    joined = "{% for m in messages %}{% for p in m.content %}{{ p.text if p is mapping else p }}{% endfor %}|" \
             "{% endfor %}"
    assert ouro.apply_chat_template(parts, chat_template=joined, tokenize=False,
                                    continue_final_message=True) == "Hi|Good morrow"


@pytest.mark.parametrize("messages,kwargs,field,says", [
    (CONTINUED, {"add_generation_prompt": True}, "continue_final_message", "cannot be combined with add_generation"),
    ([], {}, "messages", "continue_final_message needs a final message to continue"),
    (CONTINUED, {"chat_template": "{% for m in messages if m.role == 'user' %}{{ m.content }}{% endfor %}"},
     "continue_final_message", "the chat template does not render the final message's text once"),
    (CONTINUED, {"chat_template": "{% for m in messages %}{{ m.content }}{{ m.content }}{% endfor %}"},
     "continue_final_message", "the chat template does not render the final message's text once"),
])
def test_continue_final_message_refusals_name_the_field(ouro, messages, kwargs, field, says):
    with pytest.raises(ValueError, match=f"^{field}: {says}"):
        ouro.apply_chat_template(messages, continue_final_message=True, **kwargs)


# -- transformers' tokenizer basics --------------------------------------------------------------------------------
@pytest.mark.parametrize("arch", ["ouro", "huginn"])
def test_tokenizer_basics_match_the_tokenizer_files(arch, request):
    folder = request.getfixturevalue(f"tiny_{arch}")
    tok, (raw, config) = Tokenizer(folder), _raw(folder)
    text, texts = "Loops think twice.", ["a", "b c d"]
    enc = tok(text)
    assert enc["input_ids"] == enc.input_ids == raw.encode(text).ids and enc.attention_mask == [1] * len(enc.input_ids)
    assert tok(text, add_special_tokens=False).input_ids == raw.encode(text, add_special_tokens=False).ids
    batch = tok(texts)
    assert batch.input_ids == [raw.encode(t).ids for t in texts]
    assert batch.attention_mask == [[1] * len(ids) for ids in batch.input_ids]
    assert len(tok) == raw.get_vocab_size(with_added_tokens=True) and tok.get_vocab() == raw.get_vocab(True)
    ids = [raw.encode(t).ids for t in ("To be", "or not")]
    assert tok.batch_decode(ids, skip_special_tokens=False) == [raw.decode(i, skip_special_tokens=False) for i in ids]
    assert tok.batch_decode(ids, skip_special_tokens=True) == [raw.decode(i) for i in ids]  # (the library skips them)
    assert tok.batch_decode(ids) == [tok.decode(i) for i in ids] == [raw.decode(i, skip_special_tokens=False)
                                                                      for i in ids]  # (transformers keeps them)
    assert tok.convert_ids_to_tokens(ids[0]) == [raw.id_to_token(i) for i in ids[0]]
    assert tok.convert_ids_to_tokens(ids[0][-1]) == raw.id_to_token(ids[0][-1])
    symbols = [raw.id_to_token(i) for i in ids[1]]
    assert tok.convert_tokens_to_ids(symbols) == ids[1] and tok.convert_tokens_to_ids(symbols[0]) == ids[1][0]
    # special tokens as transformers lists them: the named ones that are set, then the additional ones, each once
    named = [config[n] for n in ("bos_token", "eos_token", "unk_token", "pad_token") if config.get(n)]
    want = list(dict.fromkeys(named + config.get("additional_special_tokens", [])))
    assert tok.all_special_tokens == want and tok.all_special_ids == [raw.token_to_id(t) for t in want]
    plain = raw.encode("To be", add_special_tokens=False).ids
    assert tok.convert_ids_to_tokens(tok.all_special_ids + plain, skip_special_tokens=True) == (
        tok.convert_ids_to_tokens(plain))
    for name in ("bos", "eos", "pad", "unk"):
        token = config.get(f"{name}_token")
        assert getattr(tok, f"{name}_token") == token
        assert getattr(tok, f"{name}_token_id") == (raw.token_to_id(token) if token else None)
    assert tok.convert_tokens_to_ids("no such symbol") == tok.unk_token_id  # (transformers' answer)


def test_tokenizer_misuse_is_a_clear_error(ouro):
    with pytest.raises(ValueError, match=r"^text: expected one text \(a str\), got list; .* tokenizer\(texts\)"):
        ouro.encode(["a", "b"])  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="^text.1: expected one text"):
        ouro(["a", 5])  # type: ignore[list-item]
    with pytest.raises(ValueError, match="^padding: not supported"):
        ouro("a", padding=True)
    with pytest.raises(ValueError, match="^return_tensors: not supported"):
        ouro(["a"], return_tensors="pt")
    assert ouro("a", padding=False, truncation=None).input_ids == ouro.encode("a")
    with pytest.raises(TypeError, match="unexpected keyword argument 'colour'"):
        ouro("a", colour=1)


@pytest.mark.skipif(importlib.util.find_spec("transformers") is None, reason="transformers is not installed")
@pytest.mark.parametrize("arch", ["ouro", "huginn"])
def test_transformers_agrees(arch, request):
    from transformers import PreTrainedTokenizerFast

    folder = request.getfixturevalue(f"tiny_{arch}")
    hf, ours = PreTrainedTokenizerFast.from_pretrained(folder), Tokenizer(folder)
    spaced = [CONTINUED[0], {"role": "assistant", "content": "Good morrow  "}]
    for conv, kwargs in ((HELLO, {}), (HELLO, {"add_generation_prompt": True}), (HELLO, {"tokenize": False}),
                         (CONTINUED, {"continue_final_message": True}),
                         (spaced, {"continue_final_message": True, "tokenize": False})):
        assert ours.apply_chat_template(conv, **kwargs) == hf.apply_chat_template(conv, **kwargs), (conv, kwargs)
    text, ids = "Loops think twice.", [[5, 6, 7], [8, 9]]
    assert ours(text).input_ids == hf(text).input_ids and ours(["a", "b c"]).input_ids == hf(["a", "b c"]).input_ids
    assert len(ours) == len(hf) and ours.get_vocab() == hf.get_vocab()
    assert ours.batch_decode(ids, skip_special_tokens=False) == hf.batch_decode(ids, skip_special_tokens=False)
    assert ours.convert_ids_to_tokens(ids[0]) == hf.convert_ids_to_tokens(ids[0])
    assert ours.convert_tokens_to_ids(["a", "zzzq"]) == hf.convert_tokens_to_ids(["a", "zzzq"])
    assert ours.all_special_tokens == hf.all_special_tokens and ours.all_special_ids == hf.all_special_ids
    for name in ("bos_token_id", "eos_token_id", "pad_token_id", "unk_token_id"):
        assert getattr(ours, name) == getattr(hf, name), name


# -- LLM.chat --------------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def llm(tiny_huginn) -> LLM:
    return LLM(tiny_huginn, scheduler="reference")


GREEDY = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)


def test_llm_chat_continues_the_final_message(llm):
    tok = llm.get_tokenizer()
    [out] = llm.chat(CONTINUED, GREEDY, use_tqdm=False, add_generation_prompt=False, continue_final_message=True)
    assert out.prompt == HUGINN_CONTINUED
    assert out.prompt_token_ids == tok.apply_chat_template(CONTINUED, continue_final_message=True)
    [same] = llm.generate({"prompt_token_ids": out.prompt_token_ids}, GREEDY, use_tqdm=False)
    assert same.outputs[0].token_ids == out.outputs[0].token_ids


def test_llm_chat_continue_final_message_refusals(llm):
    with pytest.raises(ValueError, match="^continue_final_message: cannot be combined with add_generation_prompt"):
        llm.chat(CONTINUED, GREEDY, use_tqdm=False, continue_final_message=True)  # (add_generation_prompt: True)
    # the switches in chat_template_kwargs win over the arguments, as vLLM merges them (they were refused)
    with pytest.raises(ValueError, match="^continue_final_message: cannot be combined with add_generation_prompt"):
        llm.chat(CONTINUED, GREEDY, use_tqdm=False, chat_template_kwargs={"continue_final_message": True})
    [out] = llm.chat(CONTINUED, GREEDY, use_tqdm=False,
                     chat_template_kwargs={"continue_final_message": True, "add_generation_prompt": False})
    assert out.prompt == HUGINN_CONTINUED
    with pytest.raises(ValueError, match="^chat_template_kwargs.add_generation_prompt: must be true or false"):
        llm.chat(HELLO, GREEDY, use_tqdm=False, chat_template_kwargs={"add_generation_prompt": "no"})


# -- the server ------------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def server(tiny_huginn, tmp_path_factory) -> Iterator[Server]:
    folder = tmp_path_factory.mktemp("chat-hf")
    with run_server(tiny_huginn, folder / "server.log", "--kv-cache-tokens", "1024") as s:
        yield s


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return server.client(timeout=30)


def _chat(client: openai.OpenAI, messages: list[dict[str, Any]], **extra: Any) -> Any:
    return client.chat.completions.create(model=MODEL, messages=messages, max_tokens=4,  # type: ignore[arg-type]
                                          temperature=0, extra_body={"ignore_eos": True, **extra})


CONTINUE = {"continue_final_message": True, "add_generation_prompt": False}


def test_server_continues_the_final_message(server, client, llm):
    r = _chat(client, CONTINUED, return_token_ids=True, **CONTINUE)
    ids = r.model_extra["prompt_token_ids"]
    assert ids == llm.get_tokenizer().apply_chat_template(CONTINUED, continue_final_message=True)
    [want] = llm.chat(CONTINUED, GREEDY, use_tqdm=False, add_generation_prompt=False, continue_final_message=True)
    assert r.choices[0].message.content == want.outputs[0].text
    t = server.post("/tokenize", {"model": MODEL, "messages": CONTINUED, **CONTINUE}, "continued")
    assert t.status_code == 200 and t.json()["tokens"] == ids
    assert server.post("/detokenize", {"tokens": ids}).json()["prompt"] == HUGINN_CONTINUED
    assert "ignored unknown fields" not in server.log.read_text()  # (known fields now)
    # the same switches in chat_template_kwargs, as a client written for vLLM sends them (they win over the fields)
    t = server.post("/tokenize", {"model": MODEL, "messages": CONTINUED, "chat_template_kwargs": CONTINUE})
    assert t.status_code == 200 and t.json()["tokens"] == ids, t.text
    r = _chat(client, CONTINUED, return_token_ids=True, chat_template_kwargs=CONTINUE)
    assert r.model_extra["prompt_token_ids"] == ids


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/tokenize"])
@pytest.mark.parametrize("body,param", [
    ({"messages": CONTINUED, "continue_final_message": True}, "continue_final_message"),  # generation prompt: true
    ({"messages": CONTINUED, "continue_final_message": True, "add_generation_prompt": True}, "continue_final_message"),
    ({"messages": CONTINUED, "chat_template": "{{ messages }}"}, "chat_template"),
    ({"messages": CONTINUED, "chat_template_kwargs": {"continue_final_message": True}}, "continue_final_message"),
    ({"messages": CONTINUED, "chat_template_kwargs": {"add_generation_prompt": 0}},
     "chat_template_kwargs.add_generation_prompt"),
])
def test_chat_fields_refused_with_a_400_naming_them(server, path, body, param):
    r = server.post(path, {"model": MODEL, "max_tokens": 1, **body})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param and r.json()["error"]["message"].startswith(f"{param}: ")


def test_a_users_final_message_is_continued_as_vllm_continues_it(server, llm):
    """continue_final_message leaves whatever the final message is open (vLLM's, transformers' rule): a user's text
    too, answered in the user's role (it was a 400: the final message had to be the assistant's)."""
    t = server.post("/tokenize", {"model": MODEL, "messages": HELLO, **CONTINUE})
    assert t.status_code == 200, t.text
    assert t.json()["tokens"] == llm.get_tokenizer().apply_chat_template(HELLO, continue_final_message=True)
    r = server.post("/v1/chat/completions", {"model": MODEL, "messages": HELLO, "max_tokens": 2, **CONTINUE})
    assert r.status_code == 200 and r.json()["choices"][0]["message"]["role"] == "user", r.text


def test_echo_starts_the_reply_with_the_final_assistant_message(client):
    plain = _chat(client, CONTINUED, **CONTINUE).choices[0].message.content
    echoed = _chat(client, CONTINUED, echo=True, n=2, **CONTINUE)
    assert [c.message.content for c in echoed.choices] == ["Good morrow" + plain] * 2
    # streamed: the echoed text in chunks of its own after the roles', one per choice (vLLM's order and shape)
    chunks = list(client.chat.completions.create(model=MODEL, messages=CONTINUED, max_tokens=4,  # type: ignore
                                                 temperature=0, stream=True, n=2,
                                                 extra_body={"ignore_eos": True, "echo": True, **CONTINUE}))
    assert [(c.index, c.delta.content) for ch in chunks[2:4] for c in ch.choices] == [(0, "Good morrow"),
                                                                                     (1, "Good morrow")]
    text = "".join(c.delta.content or "" for ch in chunks for c in ch.choices if c.index == 1)
    assert text == "Good morrow" + plain
    # nothing to echo when the final message is not the assistant's
    assert _chat(client, HELLO, echo=True).choices[0].message.content == _chat(client, HELLO).choices[0].message.content


def test_echo_with_a_forced_tool_call_is_refused(server):
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
    r = server.post("/v1/chat/completions", {"model": MODEL, "messages": CONTINUED, "max_tokens": 2, "echo": True,
                                               "tools": [tool], "tool_choice": "required"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "echo", r.text


def test_add_special_tokens_tokenizes_the_prompt_with_them(client, huginn):
    without = _chat(client, HELLO, return_token_ids=True).model_extra["prompt_token_ids"]
    with_them = _chat(client, HELLO, return_token_ids=True, add_special_tokens=True)
    # the post-processor's BOS before the template's own (as vLLM tokenizes it)
    assert with_them.model_extra["prompt_token_ids"] == [huginn.bos_token_id, *without]
    assert without == huginn.apply_chat_template(HELLO, add_generation_prompt=True)



# -- chat_template_kwargs: one list of the names they may not use, refused by name everywhere -------------------------
# (each name with the reason TEMPLATE_RESERVED gives: apply_chat_template's own arguments, read off its signature,
# transformers' options of it and `messages`; a name of an argument used to be a TypeError, "got multiple values")
RESERVED = [("tokenize", "not a template variable"), ("conversation", "the conversation"),
            ("self", "an argument of apply_chat_template"), ("padding", "transformers' option of apply_chat_template"),
            ("return_dict", "transformers' option"), ("messages", "the conversation"),
            ("tools", "set by `tools` itself"), ("chat_template", "picks the template to render")]


def test_reserved_template_variables_are_read_off_apply_chat_template():
    import inspect

    from loopserve.tokenizer import CHAT_TEMPLATE_OPTIONS, TEMPLATE_RESERVED

    own = set(inspect.signature(Tokenizer.apply_chat_template).parameters) - {"kwargs", "documents"}
    assert set(TEMPLATE_RESERVED) == own | {"messages", *CHAT_TEMPLATE_OPTIONS} >= {name for name, _ in RESERVED}


@pytest.mark.parametrize("name,why", RESERVED)
def test_llm_chat_refuses_template_kwargs_named_like_arguments(llm, name, why):
    # at a value that would do nothing too (padding=False): it is not a template variable whatever its value
    with pytest.raises(ValueError, match=rf"^chat_template_kwargs\.{name}: {why}"):
        llm.chat(HELLO, GREEDY, use_tqdm=False, chat_template_kwargs={name: False})


def test_llm_chat_template_kwargs_other_misuse_and_documents(llm, ouro):
    with pytest.raises(ValueError, match="^chat_template_kwargs: expected a dict of template variables, got str"):
        llm.chat(HELLO, GREEDY, use_tqdm=False, chat_template_kwargs="x")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="^chat_template_kwargs: the variables' names must be strings, got 1"):
        llm.chat(HELLO, GREEDY, use_tqdm=False, chat_template_kwargs={1: True})  # type: ignore[dict-item]
    # documents are a template variable that apply_chat_template takes as an argument: vLLM passes them so
    [out] = llm.chat(HELLO, GREEDY, use_tqdm=False, chat_template="{{ documents | length }} docs",
                     chat_template_kwargs={"documents": [{"text": "a"}, {"text": "b"}]})
    assert out.prompt == "2 docs"
    # the tokenizer itself: `messages` is the conversation, which a keyword used to replace without a word
    with pytest.raises(ValueError, match="^messages: the conversation"):
        ouro.apply_chat_template(HELLO, tokenize=False, messages=CONTINUED)


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/tokenize"])
@pytest.mark.parametrize("name,why", RESERVED)
def test_server_refuses_template_kwargs_named_like_arguments(server, path, name, why):
    r = server.post(path, {"model": MODEL, "max_tokens": 1, "messages": HELLO, "chat_template_kwargs": {name: False}})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == f"chat_template_kwargs.{name}" and error["message"].startswith(
        f"chat_template_kwargs.{name}: {why}"), error


# -- continue_final_message: one check, one message, each rule run once ---------------------------------------------
def test_continue_with_a_generation_prompt_is_one_rule_with_one_message(ouro, llm, server):
    with pytest.raises(ValueError) as tok:
        ouro.apply_chat_template(CONTINUED, add_generation_prompt=True, continue_final_message=True)
    message = str(tok.value)
    assert message.startswith("continue_final_message: cannot be combined with add_generation_prompt")
    with pytest.raises(ValueError) as chat:
        llm.chat(CONTINUED, GREEDY, use_tqdm=False, continue_final_message=True)  # (add_generation_prompt: True)
    assert str(chat.value) == message
    for path in ("/v1/chat/completions", "/tokenize"):
        for body in ({}, {"add_generation_prompt": True}, {"add_generation_prompt": None}):
            r = server.post(path, {"model": MODEL, "max_tokens": 1, "messages": CONTINUED,
                                   "continue_final_message": True, **body})
            assert r.status_code == 400 and r.json()["error"]["param"] == "continue_final_message", r.text
            assert r.json()["error"]["message"] == message


def test_the_final_message_is_checked_once(llm, monkeypatch):
    import loopserve.chat_messages
    import loopserve.llm
    import loopserve.tokenizer

    calls = []

    def counted(*args: Any, **kwargs: Any) -> None:
        calls.append(args)
        loopserve.chat_messages.check_continuable(*args, **kwargs)

    for module in (loopserve.llm, loopserve.tokenizer):  # wherever it is called from
        if hasattr(module, "check_continuable"):
            monkeypatch.setattr(module, "check_continuable", counted)
    llm.chat(CONTINUED, GREEDY, use_tqdm=False, add_generation_prompt=False, continue_final_message=True)
    assert len(calls) == 1
    # a batch: once a conversation; a user's final message is continued too (vLLM's rule, transformers': it was
    # refused for not being the assistant's)
    user_goes_on = llm.chat([CONTINUED, HELLO], GREEDY, use_tqdm=False, add_generation_prompt=False,
                            continue_final_message=True)
    assert len(calls) == 3
    assert user_goes_on[1].prompt.endswith(HELLO[-1]["content"])


# -- echo: vLLM's rule ------------------------------------------------------------------------------------------------
def test_echo_without_a_generation_prompt_echoes_the_final_message_in_its_role(server, client):
    # vLLM: without a generation prompt the reply goes on with the final message, in that message's role, and
    # `echo` starts it with that message's text, whoever's it is (it used to echo nothing but an assistant's)
    body = {"model": MODEL, "messages": HELLO, "max_tokens": 4, "temperature": 0, "ignore_eos": True,
            "add_generation_prompt": False}
    plain = server.post("/v1/chat/completions", body).json()["choices"][0]["message"]
    echoed = server.post("/v1/chat/completions", {**body, "echo": True, "n": 2}).json()["choices"]
    assert plain["role"] == "user"
    assert [{k: c["message"][k] for k in ("role", "content", "tool_calls")} for c in echoed] == [
        {"role": "user", "content": "Hello" + plain["content"], "tool_calls": []}] * 2
    chunks = list(client.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=4,  # type: ignore
                                                 temperature=0, stream=True,
                                                 extra_body={"ignore_eos": True, "echo": True,
                                                             "add_generation_prompt": False}))
    assert chunks[0].choices[0].delta.role == "user" and chunks[1].choices[0].delta.content == "Hello"
    assert "".join(c.delta.content or "" for ch in chunks for c in ch.choices) == "Hello" + plain["content"]
    # with a generation prompt the reply is the assistant's: a final user message is not echoed (as before)
    opened = {**body, "add_generation_prompt": True}
    reply = server.post("/v1/chat/completions", opened).json()["choices"][0]["message"]
    assert reply["role"] == "assistant"
    assert server.post("/v1/chat/completions", {**opened, "echo": True}).json()["choices"][0]["message"] == reply
