"""Chat templates as transformers reads and renders them: where they come from (chat_template.jinja, named
lists, additional_chat_templates/), which one renders (a name, tool_use, default), and the Jinja environment
(loopcontrols, raise_exception, strftime_now, tojson, {% generation %}, tools, documents, extra variables)."""

from __future__ import annotations

import json
import re
import shutil
from datetime import datetime
from pathlib import Path

import pytest

from loopserve.tokenizer import Tokenizer

HELLO = [{"role": "user", "content": "Hello"}]


def _text(tok: Tokenizer, messages, add_generation_prompt: bool = True, **kwargs) -> str:
    """The prompt text, with the generation prompt unless told otherwise (the defaults these tests were written
    for; transformers' `apply_chat_template` defaults to ids, without it: test_chat_template_hf.py)."""
    return tok.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, tokenize=False, **kwargs)


@pytest.fixture
def folder(tiny_ouro, tmp_path) -> Path:
    """The tiny Ouro tokenizer files, in a folder a test may change."""
    out = tmp_path / "tok"
    out.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        shutil.copy(tiny_ouro / name, out / name)
    return out


def _set_config_template(folder: Path, template) -> None:
    path = folder / "tokenizer_config.json"
    cfg = json.loads(path.read_text())
    cfg["chat_template"] = template
    path.write_text(json.dumps(cfg))


def test_folder_template_renders_chatml(folder):
    tok = Tokenizer(folder)
    assert _text(tok, HELLO) == "<|im_start|>user\nHello<|im_end|>\n<|im_start|>assistant\n"
    assert _text(tok, HELLO, False) == "<|im_start|>user\nHello<|im_end|>\n"


def test_chat_template_jinja_file_wins_over_the_config(folder):
    _set_config_template(folder, [{"name": "default", "template": "config"}, {"name": "rag", "template": "rag"}])
    (folder / "chat_template.jinja").write_text("file: {{ messages[0]['content'] }}")
    tok = Tokenizer(folder)
    assert _text(tok, HELLO) == "file: Hello"
    assert tok.chat_templates == {"default": "file: {{ messages[0]['content'] }}"}  # the file replaces the list


@pytest.mark.parametrize("where", ["chat_template.jinja", "additional_chat_templates/terse.jinja",
                                   "tokenizer_config.json"])
def test_a_folder_template_that_does_not_compile_is_refused_when_a_chat_uses_it(folder, tmp_path, where, caplog):
    """A broken template of the folder is named, with its file, in a warning at load and in the error of a chat that
    uses it; the load itself goes on, as vLLM's does, so completions work (the load had been refused: a checkpoint
    unusable for its template). A template given at load replaces the folder's, which then need not compile."""
    broken = "{% for m in messages %}{{ m.content }"
    if where == "tokenizer_config.json":
        _set_config_template(folder, broken)
    else:
        (folder / where).parent.mkdir(exist_ok=True)
        (folder / where).write_text(broken)
    source = re.escape(str(folder / where))
    why = rf"{source}(: chat_template)?: not a valid Jinja template \(line 1[^)]*\): the model's chat template does not"
    with caplog.at_level("WARNING", logger="loopserve.tokenizer"):
        tok = Tokenizer(folder)
    assert re.search(why, caplog.text), caplog.text
    assert tok.encode("Hello") and tok.decode(tok.encode("Hello")) == "Hello"
    name = "terse" if "terse" in where else None
    with pytest.raises(ValueError, match=rf"^{why} compile; fix it, or give another with --chat-template$"):
        tok.apply_chat_template(HELLO, chat_template=name, tokenize=False)
    given = tmp_path / "given.jinja"
    given.write_text("G{{ messages[0].content }}")
    assert _text(Tokenizer(folder, chat_template=str(given)), HELLO) == "GHello"


@pytest.mark.parametrize("where", ["chat_template.jinja", "given"])
def test_a_template_file_that_is_not_utf8_is_named(folder, tmp_path, where):
    """A template file in another encoding: a ValueError naming the file (was a bare UnicodeDecodeError)."""
    path = folder / "chat_template.jinja" if where == "chat_template.jinja" else tmp_path / "given.jinja"
    path.write_bytes(b"\xff\xfe{{ x }}")
    with pytest.raises(ValueError, match=rf"^{re.escape(str(path))}: not UTF-8 text"):
        Tokenizer(folder) if where == "chat_template.jinja" else Tokenizer(folder, chat_template=str(path))


def test_additional_chat_templates_are_named(folder):
    (folder / "additional_chat_templates").mkdir()
    (folder / "additional_chat_templates" / "terse.jinja").write_text("T{{ messages | length }}")
    tok = Tokenizer(folder)
    assert _text(tok, HELLO, chat_template="terse") == "T1"
    assert _text(tok, HELLO).startswith("<|im_start|>user")  # the default is still the config's


def test_named_template_list(folder):
    _set_config_template(folder, [{"name": "default", "template": "D{{ messages[0].content }}"},
                                  {"name": "rag", "template": "R{{ documents | length }}"},
                                  {"name": "tool_use", "template": "U{{ tools[0].function.name }}"}])
    tok = Tokenizer(folder)
    assert tok.chat_template == "D{{ messages[0].content }}"
    assert _text(tok, HELLO) == "DHello"
    assert _text(tok, HELLO, chat_template="rag", documents=[{"text": "a"}, {"text": "b"}]) == "R2"
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {}}}]
    assert _text(tok, HELLO, tools=tools) == "Uget_weather"  # tools pick tool_use, as transformers
    assert _text(tok, HELLO, tools=tools, chat_template="default") == "DHello"
    # a chat_template that names no template is the template itself
    assert _text(tok, HELLO, chat_template="{{ messages[0].role }}!") == "user!"


def test_named_list_without_default_needs_a_name(folder):
    _set_config_template(folder, [{"name": "a", "template": "A"}, {"name": "b", "template": "B"}])
    tok = Tokenizer(folder)
    assert tok.chat_template is None
    with pytest.raises(ValueError, match="chat_template: .*none is 'default'.*a, b"):
        _text(tok, HELLO)
    assert _text(tok, HELLO, chat_template="b") == "B"


@pytest.mark.parametrize("bad", [[{"name": "x"}], [["x", "y"]], 7])
def test_malformed_config_template_names_the_file(folder, bad):
    _set_config_template(folder, bad)
    with pytest.raises(ValueError, match="tokenizer_config.json: chat_template"):
        Tokenizer(folder)


def test_no_template_is_a_clear_error(folder):
    _set_config_template(folder, None)
    with pytest.raises(ValueError, match="chat_template: the model has none"):
        _text(Tokenizer(folder), HELLO)


def test_loopcontrols_extension(folder):
    tok = Tokenizer(folder)
    template = ("{% for m in messages %}{% if m.role == 'stop' %}{% break %}{% endif %}"
                "{% if m.role == 'skip' %}{% continue %}{% endif %}{{ m.content }}{% endfor %}")
    msgs = [{"role": "user", "content": "a"}, {"role": "skip", "content": "b"}, {"role": "user", "content": "c"},
            {"role": "stop", "content": "d"}, {"role": "user", "content": "e"}]
    assert _text(tok, msgs, chat_template=template) == "ac"


def test_raise_exception_is_a_value_error_naming_messages(folder):
    tok = Tokenizer(folder)
    template = ("{% if messages[0].role != 'system' %}{{ raise_exception('a system message must come first') }}"
                "{% endif %}")
    with pytest.raises(ValueError, match=r"^messages: a system message must come first$"):
        _text(tok, HELLO, chat_template=template)
    assert _text(tok, [{"role": "system", "content": "x"}], chat_template=template) == ""


def test_render_errors_name_messages_and_syntax_errors_the_template(folder):
    tok = Tokenizer(folder)
    with pytest.raises(ValueError, match="^messages: the chat template could not render them"):
        _text(tok, [{"role": "user"}])  # no content: 'str' + undefined
    with pytest.raises(ValueError, match="^chat_template: not a valid Jinja template"):
        _text(tok, HELLO, chat_template="{% for m in messages %}")
    with pytest.raises(ValueError, match="^messages: expected a list"):
        _text(tok, "Hello")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="^tools: expected a list"):
        _text(tok, HELLO, tools={"name": "f"})  # type: ignore[arg-type]


def test_strftime_now(folder):
    tok = Tokenizer(folder)
    before = datetime.now().strftime("%Y-%m-%d")
    out = _text(tok, HELLO, chat_template="{{ strftime_now('%Y-%m-%d') }}")
    assert out in {before, datetime.now().strftime("%Y-%m-%d")}


def test_tools_documents_and_tojson(folder):
    tok = Tokenizer(folder)
    template = ("{% if tools %}{% for t in tools %}{{ t | tojson }}\n{% endfor %}{% endif %}"
                "{% if documents is not none %}{{ documents | length }} docs\n{% endif %}"
                "{{ messages[-1].content }}")
    tools = [{"name": "f", "description": "a <b> & 'c' — é"}]
    out = _text(tok, HELLO, chat_template=template, tools=tools)
    # transformers' tojson: plain JSON, non-ASCII kept, no HTML escaping
    assert out == json.dumps(tools[0], ensure_ascii=False) + "\nHello"
    out = _text(tok, HELLO, chat_template=template, documents=[{"title": "x", "text": "y"}])
    assert out == "1 docs\nHello"
    assert _text(tok, HELLO, chat_template="{{ x | tojson(indent=2) }}", x={"a": 1}) == '{\n  "a": 1\n}'


def test_chat_template_kwargs_reach_the_template(folder):
    tok = Tokenizer(folder)
    template = "{{ bos_token }}{% if enable_thinking %}<think>{% endif %}{{ messages[0].content }}{{ eos_token }}"
    assert _text(tok, HELLO, chat_template=template) == "<|endoftext|>Hello<|endoftext|>"
    out = _text(tok, HELLO, chat_template=template, enable_thinking=True, bos_token="[B]")
    assert out == "[B]<think>Hello<|endoftext|>"  # extra variables, and the special tokens can be overridden


def test_generation_block_parses(folder):
    tok = Tokenizer(folder)
    template = ("{% for m in messages %}{% if m.role == 'assistant' %}{% generation %}[{{ m.content }}]"
                "{% endgeneration %}{% else %}{{ m.content }}{% endif %}{% endfor %}")
    msgs = [*HELLO, {"role": "assistant", "content": "Hi"}]
    assert _text(tok, msgs, chat_template=template) == "Hello[Hi]"


def test_set_chat_template_from_text_or_file(folder, tmp_path):
    path = tmp_path / "t.jinja"
    path.write_text("F{{ messages[0].content }}")
    tok = Tokenizer(folder, chat_template=str(path))
    assert _text(tok, HELLO) == "FHello"
    tok.set_chat_template("{{ 'T' + messages[0].content }}")
    assert _text(tok, HELLO) == "THello"
    with pytest.raises(ValueError, match="chat_template: .*neither a file nor a Jinja template"):
        tok.set_chat_template(str(tmp_path / "missing.jinja"))
    with pytest.raises(ValueError, match="chat_template: not a valid Jinja template"):
        tok.set_chat_template("{% if %}")
    assert _text(tok, HELLO) == "THello"  # a rejected template leaves the last one


def test_sandbox_blocks_attribute_escapes(folder):
    tok = Tokenizer(folder)
    with pytest.raises(ValueError, match="^messages: "):
        _text(tok, HELLO, chat_template="{{ messages.__class__.__mro__ }}")


def test_decode_token_is_the_tokens_text(folder):
    tok = Tokenizer(folder)
    space_the = tok.encode(" the", add_special_tokens=False)
    assert tok.id_to_token(space_the[0]).startswith("Ġ")  # the byte-level symbol of a leading space
    assert tok.decode_token(space_the[0]).startswith(" ")
    for i in range(tok.vocab_size):
        assert tok.decode_token(i) == tok.decode([i], skip_special_tokens=False)
    assert tok.decode_token(2) == "<|im_end|>"  # special tokens keep their text


def test_special_tokens_map_gives_the_special_tokens_of_an_older_folder(folder, tiny_ouro):
    """transformers' older format: a tokenizer_config.json without added_tokens_decoder (or none at all) takes its
    special tokens from special_tokens_map.json, which wins where both name one (without it such a folder had no eos
    token, and generation never stopped); with added_tokens_decoder the config's own are read, as transformers does."""
    shutil.copy(tiny_ouro / "special_tokens_map.json", folder / "special_tokens_map.json")
    path = folder / "tokenizer_config.json"
    cfg = json.loads(path.read_text())
    path.unlink()
    tok = Tokenizer(folder)
    assert tok.eos_token == "<|endoftext|>" and tok.eos_token_id is not None and tok.eos_token_ids == {tok.eos_token_id}
    assert "<|im_end|>" in tok.additional_special_tokens
    legacy = {k: v for k, v in cfg.items() if k != "added_tokens_decoder"}
    path.write_text(json.dumps({**legacy, "eos_token": "<|im_end|>", "additional_special_tokens": ["<|x|>"],
                                "pad_token": "<|im_end|>"}))
    mapped = json.loads((folder / "special_tokens_map.json").read_text())
    (folder / "special_tokens_map.json").write_text(json.dumps({**mapped, "pad_token": None}))
    tok = Tokenizer(folder)
    assert tok.eos_token == "<|endoftext|>" and tok.pad_token is None  # (the map wins, its null too)
    assert tok.additional_special_tokens == ["<|x|>", "<|im_start|>", "<|im_end|>"]  # (the config's, then the map's)
    path.write_text(json.dumps({**cfg, "eos_token": "<|im_end|>"}))
    assert Tokenizer(folder).eos_token == "<|im_end|>"  # (a config with added_tokens_decoder: its own)
    (folder / "special_tokens_map.json").write_text(json.dumps({"eos_token": 5}))
    path.write_text(json.dumps(legacy))
    with pytest.raises(ValueError, match=r"special_tokens_map.json: eos_token: must be a token"):
        Tokenizer(folder)
