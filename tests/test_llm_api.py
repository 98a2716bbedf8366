"""The offline API as a vLLM user meets it: generation_config.json sampling defaults, `LLM.chat`, the
progress bar, decoded logprob tokens, the generate CLI's chat flags, and checkpoint folders that
transformers' `AutoConfig` / `AutoTokenizer` read."""

from __future__ import annotations

import dataclasses
import importlib.util
import inspect
import json
import re
import shutil
from pathlib import Path

import pytest

from loopserve import LLM, SamplingParams
from loopserve.cli import main as cli_main
from loopserve.device import resolve_device
from loopserve.models.loader import embedded_model_path, read_generation_config
from loopserve_lab.tiny import HF_CODE_DIR, TinySpec, make_tiny

HELLO = [{"role": "user", "content": "Hello"}]
PROMPTS = ["The cat", "A loop"]
SAMPLING_FIELDS = {f.name for f in dataclasses.fields(SamplingParams)}


def _with_generation_config(src: Path, dst: Path, **keys) -> Path:
    shutil.copytree(src, dst)
    path = dst / "generation_config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), **keys}))
    return dst


@pytest.fixture(scope="module")
def llm(tiny_ouro) -> LLM:
    return LLM(tiny_ouro, scheduler="cdb")


# ---------------- generation_config.json defaults


def test_generation_config_defaults_are_the_default_params(tiny_ouro, tmp_path):
    folder = _with_generation_config(tiny_ouro, tmp_path / "m", temperature=0.5, top_p=0.9, top_k=7, min_p=0.05,
                                     max_new_tokens=5, repetition_penalty=1.1, do_sample=True)
    defaults = read_generation_config(folder).sampling_defaults
    expected = {"temperature": 0.5, "top_p": 0.9, "top_k": 7, "min_p": 0.05, "max_tokens": 5}
    if "repetition_penalty" in SAMPLING_FIELDS:  # skipped (with a debug log) while SamplingParams lacks it
        expected["repetition_penalty"] = 1.1
    assert defaults == expected
    llm = LLM(folder, scheduler="reference")
    params = llm.get_default_sampling_params()
    assert (params.temperature, params.top_p, params.top_k, params.min_p, params.max_tokens) == (0.5, 0.9, 7, 0.05, 5)
    # generate without params uses them; the same values given explicitly give the same tokens
    implicit = LLM(folder, scheduler="reference").generate(PROMPTS, use_tqdm=False)
    explicit = LLM(folder, scheduler="reference").generate(PROMPTS, SamplingParams(**expected), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in implicit] == [o.outputs[0].token_ids for o in explicit]
    assert all(len(o.outputs[0].token_ids) <= 5 for o in implicit)
    assert any(len(o.outputs[0].token_ids) == 5 for o in implicit)
    # explicit params are used as given (vLLM's offline rule): max_tokens 3 and SamplingParams' own defaults
    outs = llm.generate(PROMPTS, SamplingParams(max_tokens=3, ignore_eos=True), use_tqdm=False)
    assert [len(o.outputs[0].token_ids) for o in outs] == [3, 3]


def test_generation_config_modes(tiny_ouro, tmp_path):
    folder = _with_generation_config(tiny_ouro, tmp_path / "m", temperature=0.25)
    other = _with_generation_config(tiny_ouro, tmp_path / "other", top_k=3)
    assert read_generation_config(folder, "auto").sampling_defaults == {"temperature": 0.25}
    assert read_generation_config(folder, "vllm").sampling_defaults == {}
    assert read_generation_config(folder, str(other)).sampling_defaults == {"top_k": 3}
    assert read_generation_config(tiny_ouro).sampling_defaults == {}  # eos ids only: nothing to default
    llm = LLM(folder, scheduler="reference", generation_config="vllm")
    assert llm.get_default_sampling_params() == SamplingParams()
    with pytest.raises(ValueError, match="generation_config: .*missing"):
        read_generation_config(folder, str(tmp_path / "nowhere"))


@pytest.mark.parametrize("key,value", [("top_p", 0), ("temperature", -1), ("max_new_tokens", 0)])
def test_bad_generation_config_names_the_file_and_key(tiny_ouro, tmp_path, key, value):
    """The key as the file spells it: max_new_tokens was named by its SamplingParams field, max_tokens."""
    folder = _with_generation_config(tiny_ouro, tmp_path / "m", **{key: value})
    with pytest.raises(ValueError, match=rf"generation_config.json: {key}: "):
        LLM(folder, scheduler="reference")


# ---------------- LLM.chat


def test_chat_single_conversation(llm):
    tok = llm.get_tokenizer()
    params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    [out] = llm.chat(HELLO, params, use_tqdm=False)
    text = tok.apply_chat_template(HELLO, add_generation_prompt=True, tokenize=False)
    assert out.prompt == text
    assert out.prompt_token_ids == tok.encode(text, add_special_tokens=False)
    [same] = llm.generate({"prompt_token_ids": out.prompt_token_ids}, params, use_tqdm=False)
    assert same.outputs[0].token_ids == out.outputs[0].token_ids and len(out.outputs[0].token_ids) == 4


def test_chat_batch_keeps_order(llm):
    convs = [HELLO, [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]]
    params = SamplingParams(max_tokens=3, temperature=0, ignore_eos=True)
    outs = llm.chat(convs, params, use_tqdm=False)
    assert len(outs) == 2
    assert outs[0].prompt.endswith("Hello<|im_end|>\n<|im_start|>assistant\n")
    assert outs[1].prompt.startswith("<|im_start|>system\nBe brief.")
    singles = [llm.chat(c, params, use_tqdm=False)[0] for c in convs]
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in singles]


def test_chat_template_arguments(llm):
    template = ("{% for t in tools or [] %}[{{ t.function.name }}]{% endfor %}{{ style }}:"
                "{{ messages[-1].content }}{% if add_generation_prompt %}>{% endif %}")
    tools = [{"type": "function", "function": {"name": "lookup", "parameters": {}}}]
    params = SamplingParams(max_tokens=1)
    [out] = llm.chat(HELLO, params, use_tqdm=False, chat_template=template, chat_template_kwargs={"style": "terse"},
                     tools=tools)
    assert out.prompt == "[lookup]terse:Hello>"
    [out] = llm.chat(HELLO, params, use_tqdm=False, chat_template=template, add_generation_prompt=False)
    assert out.prompt == ":Hello"
    with pytest.raises(ValueError, match="chat_template_kwargs.tools"):
        llm.chat(HELLO, params, chat_template_kwargs={"tools": []})


def test_chat_template_may_be_a_file_and_a_path_that_is_none_is_refused(llm, tmp_path):
    """`--chat-template`'s rule: a string without Jinja marks is a file to read. It used to render as itself: the
    prompt was the path, whatever the conversation."""
    path = tmp_path / "t.jinja"
    path.write_text("{% for m in messages %}[{{ m.role }}] {{ m.content }}{% endfor %}")
    params = SamplingParams(max_tokens=1)
    [out] = llm.chat(HELLO, params, use_tqdm=False, chat_template=str(path))
    assert out.prompt == "[user] Hello"
    for name in (str(tmp_path / "missing.jinja"), "tool_use"):
        with pytest.raises(ValueError, match=r"^chat_template: .* is not a Jinja template, a readable file or one of "
                                             r"the model's templates \(default\)$"):
            llm.chat(HELLO, params, use_tqdm=False, chat_template=name)
    with pytest.raises(ValueError, match=r"^chat_template: 'xxxx"):  # (too long a name for a path: an OSError before)
        llm.chat(HELLO, params, use_tqdm=False, chat_template="x" * 300)
    with pytest.raises(ValueError, match="^messages: "):
        llm.chat([], params)


def test_chat_uses_generation_config_defaults(tiny_ouro, tmp_path):
    folder = _with_generation_config(tiny_ouro, tmp_path / "m", max_new_tokens=2, temperature=0)
    outs = LLM(folder, scheduler="reference").chat([HELLO, HELLO], use_tqdm=False)
    assert all(len(o.outputs[0].token_ids) <= 2 for o in outs)
    assert outs[0].outputs[0].token_ids == outs[1].outputs[0].token_ids  # greedy, from the file


# ---------------- progress bar and logprobs


def test_use_tqdm_is_on_by_default_with_tokens_per_second(llm, capsys):
    for method in (LLM.generate, LLM.chat):
        assert inspect.signature(method).parameters["use_tqdm"].default is True
    llm.generate(PROMPTS, SamplingParams(max_tokens=2))
    err = capsys.readouterr().err
    assert "Processed prompts" in err and "2/2" in err
    assert "est. speed input:" in err and "toks/s, output:" in err
    llm.chat(HELLO, SamplingParams(max_tokens=2), use_tqdm=False)
    assert capsys.readouterr().err == ""


@pytest.mark.parametrize("scheduler", ["reference", "cdb"])
def test_logprob_decoded_token_is_text(tiny_ouro, scheduler):
    llm = LLM(tiny_ouro, scheduler=scheduler)
    tok = llm.get_tokenizer()
    [out] = llm.generate("The cat sat on the", SamplingParams(max_tokens=6, logprobs=20, ignore_eos=True),
                         use_tqdm=False)
    entries = out.outputs[0].logprobs
    assert entries is not None and len(entries) == 6
    for entry in entries:
        for tid, lp in entry.items():
            assert lp.decoded_token == tok.decode([tid], skip_special_tokens=False)
    # the byte-level symbol of a space never shows
    assert not any("Ġ" in (lp.decoded_token or "") for entry in entries for lp in entry.values())


# ---------------- command line


def test_generate_cli_chat_and_generation_config(tiny_ouro, tmp_path, capsys):
    folder = _with_generation_config(tiny_ouro, tmp_path / "m", max_new_tokens=3)
    args = ["generate", "--model", str(folder), "--scheduler", "reference", "--ignore-eos"]
    assert cli_main([*args, "--chat", "Hello"]) == 0
    out = capsys.readouterr().out
    assert "<|im_start|>user\nHello<|im_end|>\n<|im_start|>assistant\n" in out and "3 tokens" in out
    template = tmp_path / "t.jinja"
    template.write_text("Q: {{ messages[0].content }}\nA:")
    assert cli_main([*args, "--chat-template", str(template), "--max-tokens", "2", "Why"]) == 0
    out = capsys.readouterr().out
    assert "Q: Why\nA:" in out and "2 tokens" in out
    assert cli_main([*args, "--generation-config", "vllm", "--max-tokens", "1", "Hi"]) == 0
    with pytest.raises(SystemExit) as exited:
        cli_main([*args, "--chat-template", str(tmp_path / "missing"), "Hi"])
    assert exited.value.code == 2
    assert "neither a file nor a Jinja template" in capsys.readouterr().err


def test_generate_cli_prompts_file(tiny_ouro, tmp_path, capsys):
    """Prompts from a file, after the arguments'; a file that cannot be read is one error line, status 2."""
    args = ["generate", "--model", str(tiny_ouro), "--scheduler", "reference", "--max-tokens", "2", "--threads", "1"]
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("first one\n\nsecond one\n")
    assert cli_main([*args, "--prompts-file", str(prompts), "zeroth"]) == 0
    out = capsys.readouterr().out
    assert out.index(">>> zeroth") < out.index(">>> first one") < out.index(">>> second one")
    with pytest.raises(SystemExit) as exited:
        cli_main([*args, "--prompts-file", str(tmp_path / "nofile.txt")])
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert err == f"error: --prompts-file: {tmp_path / 'nofile.txt'}: No such file or directory\n"


# ---------------- folders transformers reads


def _hf_folders(tmp_path_factory) -> list[Path]:
    out = [make_tiny(tmp_path_factory.mktemp("hf_ouro"), TinySpec(arch="ouro")),
           make_tiny(tmp_path_factory.mktemp("hf_huginn"), TinySpec(arch="huginn", layers="1-1-1"))]
    if (embedded_model_path() / "config.json").is_file():
        out.append(embedded_model_path())
    return out


def test_auto_map_names_only_shipped_code(tmp_path_factory):
    """transformers imports each module `auto_map` names from the folder: every one must be there."""
    for folder in _hf_folders(tmp_path_factory):
        auto_map = json.loads((folder / "config.json").read_text())["auto_map"]
        assert set(auto_map) == {"AutoConfig"}  # no model class: loopserve ships no modeling code
        module = auto_map["AutoConfig"].rsplit(".", 1)[0]
        assert (folder / f"{module}.py").read_text() == (HF_CODE_DIR / f"{module}.py").read_text()
        names = {p.name for p in folder.iterdir()}
        assert {"tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"} <= names
        assert json.loads((folder / "tokenizer_config.json").read_text())["tokenizer_class"]


@pytest.mark.skipif(importlib.util.find_spec("transformers") is None, reason="transformers is not installed")
def test_transformers_reads_the_folders(tmp_path_factory):
    from transformers import AutoConfig, AutoTokenizer

    from loopserve.tokenizer import Tokenizer

    for folder in _hf_folders(tmp_path_factory):
        raw = json.loads((folder / "config.json").read_text())
        cfg = AutoConfig.from_pretrained(folder, trust_remote_code=True)
        assert cfg.model_type == raw["model_type"] and cfg.vocab_size == raw["vocab_size"]
        hf_tok = AutoTokenizer.from_pretrained(folder)  # the tokenizer needs no remote code
        ours = Tokenizer(folder)
        text = "Loops think twice. é"
        assert hf_tok(text)["input_ids"] == ours.encode(text)
        assert hf_tok.apply_chat_template(HELLO, tokenize=False, add_generation_prompt=True) == (
            ours.apply_chat_template(HELLO, tokenize=False, add_generation_prompt=True))


@pytest.mark.parametrize("prompt,field", [([1, True, 3], "prompt"), ([1, 2.0], "prompt"),
                                          ({"prompt_token_ids": [4, False]}, "prompt_token_ids"),
                                          ([3, -1], "prompt_token_ids"), ([3, 10**9], "prompt_token_ids"),
                                          ({"prompt_token_ids": [0, 10**9]}, "prompt_token_ids")])
def test_token_id_prompts_are_ints_in_the_vocabulary(llm, prompt, field):
    """Bools and floats are not token ids; ids outside the vocabulary are refused, naming the field."""
    with pytest.raises(ValueError, match=f"^{field}: "):
        llm.generate([prompt], SamplingParams(max_tokens=1), use_tqdm=False)
    assert llm.generate([[1, 2, 3]], SamplingParams(max_tokens=1), use_tqdm=False)[0].outputs[0].token_ids


# ---------------- checked as the server checks them, before anything runs


@pytest.fixture(scope="module")
def small_kv(tiny_ouro) -> LLM:
    """A KV pool of 256 tokens, far below the model's context (2048)."""
    return LLM(tiny_ouro, kv_cache_tokens=256)


def test_requests_that_cannot_fit_the_kv_pool_are_refused_before_any_runs(small_kv):
    """The server's rule (engine/budget.py, then the scheduler's `never_fits`): a prompt the pool cannot hold,
    or a prompt + max_tokens past it, is a ValueError naming the field, and none of the call's requests run.
    They used to come back with finish_reason "error" (the second after 57 of its 100 tokens)."""
    with pytest.raises(ValueError, match=r"^prompt: 300 tokens do not fit in the KV cache \(256 tokens\)$"):
        small_kv.generate({"prompt_token_ids": [5] * 300}, SamplingParams(max_tokens=2), use_tqdm=False)
    with pytest.raises(ValueError, match=r"^max_tokens: 200 prompt \+ 100 completion tokens exceed the KV cache "
                                         r"\(256 tokens\) \(prompt 1 of 2\)$"):  # (in a batch: which one)
        small_kv.generate([[5, 6], {"prompt_token_ids": [5] * 200}], SamplingParams(max_tokens=100), use_tqdm=False)
    with pytest.raises(ValueError, match=r"^max_tokens: "):
        small_kv.chat([HELLO, HELLO], SamplingParams(max_tokens=250), use_tqdm=False)
    assert small_kv.engine.stats.finished_requests == {} and not small_kv.engine.has_unfinished_requests()
    # no max_tokens: the room the pool leaves (the server's rule too), not the context's
    [out] = small_kv.generate({"prompt_token_ids": [5] * 200}, SamplingParams(max_tokens=None, ignore_eos=True),
                              use_tqdm=False)
    assert out.outputs[0].finish_reason == "length" and len(out.outputs[0].token_ids) == 56
    # a completion past the context still ends at its end offline (vLLM's LLM), and that must fit the pool
    with pytest.raises(ValueError, match=r"^max_tokens: 2 prompt \+ 2046 completion tokens exceed the KV cache"):
        small_kv.generate([[5, 6]], SamplingParams(max_tokens=5000), use_tqdm=False)


@pytest.mark.parametrize("prompts,params,field", [
    ("a\ud800b", SamplingParams(max_tokens=1), "prompt"),  # a lone surrogate: a str, but not Unicode text
    ({"prompt": "\udc80"}, SamplingParams(max_tokens=1), "prompt"),
    (None, SamplingParams(max_tokens=1), "prompts"),
    (5, SamplingParams(max_tokens=1), "prompts"),
    ("a", {"max_tokens": 1}, "sampling_params"),
    (["a", "b"], [SamplingParams(max_tokens=1), {"max_tokens": 1}], r"sampling_params\.1"),
])
def test_bad_arguments_are_value_errors_naming_the_field(llm, prompts, params, field):
    with pytest.raises(ValueError, match=rf"^{field}: "):
        llm.generate(prompts, params, use_tqdm=False)


@pytest.mark.parametrize("device,cuda,message", [
    ("tpu", True, r"^device: expected cpu, cuda, cuda:N or auto, got 'tpu'"),
    ("mps", True, r"^device: mps is not supported"),
    ("cuda", False, r"^device: 'cuda', but CUDA is not available"),
    ("cuda:3", True, r"^device: 'cuda:3', but only 1 CUDA device"),
])
def test_bad_device_is_a_value_error_naming_device(tiny_ouro, monkeypatch, device, cuda, message):
    """Not torch's RuntimeError (an unknown device type) or AssertionError (a build without CUDA)."""
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    with pytest.raises(ValueError, match=message):
        LLM(tiny_ouro, device=device)
    assert resolve_device(torch.device("cpu")) == "cpu"  # a torch.device is taken too (vLLM takes one)


def test_chat_messages_follow_the_servers_rules(llm):
    """One check for LLM.chat and the server (chat_messages.py): a message needs a role (any non-empty string, as
    vLLM takes it: the template renders it), and content that is text if it has any (none renders as empty text, as
    vLLM takes it). Errors name the message and field (in a batch, the conversation too). A missing content used to
    fail in the template."""
    params = SamplingParams(max_tokens=1)
    for conv, field in (([{"role": "user", "content": 5}], "messages.0.content"),
                        ([{"role": "", "content": "x"}], "messages.0.role"),
                        ([{"role": ["user"], "content": "x"}], "messages.0.role"),
                        ([{"content": "x"}], "messages.0.role"),
                        ([{"role": "user", "content": [{"type": "image_url"}]}], "messages.0.content.0.type"),
                        ([{"role": "user", "content": "x", "name": 5}], "messages.0.name"),
                        ([{"role": "user", "content": "\ud800"}], "messages")):
        with pytest.raises(ValueError, match=rf"^{re.escape(field)}: "):
            llm.chat(conv, params, use_tqdm=False)
    with pytest.raises(ValueError, match=r"^messages\.1\.0\.content: "):
        llm.chat([HELLO, [{"role": "user", "content": 5}]], params, use_tqdm=False)
    call = {"role": "assistant", "content": None, "tool_calls": [{"id": "c1", "type": "function",
                                                                  "function": {"name": "f", "arguments": "{}"}}]}
    for turn in (call, {"role": "assistant", "content": None}, {"role": "assistant"}):  # as the server takes them
        [out] = llm.chat([*HELLO, turn], params, use_tqdm=False)
        assert out.prompt.endswith("<|im_start|>assistant\n<|im_end|>\n<|im_start|>assistant\n")
    [empty] = llm.chat([{"role": "user"}], params, use_tqdm=False)
    assert empty.prompt == llm.chat([{"role": "user", "content": ""}], params, use_tqdm=False)[0].prompt
    # text parts one per line, as the server (and vLLM) join them
    [parts] = llm.chat([{"role": "user", "content": [{"type": "text", "text": "Hel"}, {"type": "text", "text": "lo"}]}],
                       params, use_tqdm=False)
    assert parts.prompt == llm.chat([{"role": "user", "content": "Hel\nlo"}], params, use_tqdm=False)[0].prompt
