"""Loading Hugging Face folders: make-tiny round trips, shards, tokenizer files, generation config,
independent writers, and clear errors for every malformed input."""

from __future__ import annotations

import json
import re
import shlex
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from loopserve import LLM, SamplingParams
from loopserve.cli import main as cli_main
from loopserve.model_config import ModelConfig
from loopserve.models.loader import load_model
from loopserve_lab.tiny import TinySpec, make_tiny
from tests.engine_helpers import huginn_state
from tests.upstream import oracle
from tests.upstream.tiny_weights import tiny_huginn_config, tiny_huginn_weights, tiny_ouro_config, tiny_ouro_weights

pytestmark = pytest.mark.usefixtures("single_thread")

# Keys of the released configs (config.json of ByteDance/Ouro-1.4B and tomg-group-umd/huginn-0125).
OURO_KEYS = {
    "architectures", "model_type", "auto_map", "hidden_size", "intermediate_size", "num_hidden_layers",
    "num_attention_heads", "num_key_value_heads", "head_dim", "vocab_size", "hidden_act", "rope_theta",
    "rope_scaling", "rms_norm_eps", "max_position_embeddings", "tie_word_embeddings", "total_ut_steps",
    "early_exit_threshold", "use_sliding_window", "sliding_window", "layer_types", "initializer_range",
    "attention_dropout", "use_cache", "torch_dtype", "bos_token_id", "eos_token_id", "pad_token_id",
}
HUGINN_KEYS = {
    "architectures", "auto_map", "model_type", "n_embd", "n_heads", "num_key_value_heads", "n_layers",
    "n_layers_in_prelude", "n_layers_in_recurrent_block", "n_layers_in_coda", "intermediate_size", "vocab_size",
    "padded_vocab_size", "padding_multiple", "block_size", "rope_base", "norm_class_name", "norm_eps",
    "block_class_name", "mlp_class_name", "nonlin_name", "bias", "qk_bias", "tie_embeddings", "injection_type",
    "state_init", "mean_recurrence", "mean_backprop_depth", "sampling_scheme", "init_strategy", "init_orthogonal",
    "activation_checkpoint_impl", "architecture_class_name", "torch_dtype", "effective_expected_depth",
    "init_values", "bos_token_id", "eos_token_id", "pad_token_id",
}


def _shapes(folder: Path) -> dict[str, tuple[int, ...]]:
    index = folder / "model.safetensors.index.json"
    files = (sorted(set(json.loads(index.read_text())["weight_map"].values())) if index.is_file()
             else ["model.safetensors"])
    out = {}
    for f in files:
        with safe_open(str(folder / f), "pt") as h:
            for name in h.keys():
                assert name not in out, f"{name} stored twice"
                out[name] = tuple(h.get_slice(name).get_shape())
    return out


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


# ---------------- make-tiny round trips


@pytest.mark.parametrize("layers,n_kv", [("2", None), ("3", 2)])
def test_make_tiny_ouro_names_and_shapes_are_upstream(tmp_path, layers, n_kv):
    folder = make_tiny(tmp_path / "o", TinySpec(arch="ouro", layers=layers, num_kv_heads=n_kv, r_max=3))
    raw = json.loads((folder / "config.json").read_text())
    assert OURO_KEYS <= set(raw), f"missing upstream keys {OURO_KEYS - set(raw)}"
    assert set(tiny_ouro_config()) <= set(raw)
    assert raw["architectures"] == ["OuroForCausalLM"] and raw["total_ut_steps"] == 3
    assert raw["num_key_value_heads"] == (n_kv or raw["num_attention_heads"])
    shapes = _shapes(folder)
    expected = {n: tuple(t.shape) for n, t in tiny_ouro_weights(raw).items()}  # independent name list
    assert shapes == expected
    n_layers = int(layers)
    assert len(shapes) == 11 * n_layers + 5
    assert "model.layers.0.self_attn.q_proj.weight" in shapes and "model.early_exit_gate.bias" in shapes
    lm = load_model(folder, "float32", "cpu")
    c = lm.config
    assert (c.arch, c.n_prelude, c.n_core, c.n_coda, c.r_max) == ("OuroForCausalLM", 0, n_layers, 0, 3)
    # what was written is what was loaded
    weights = load_file(str(folder / "model.safetensors"))
    for name, p in lm.model.checkpoint_tensors().items():
        assert torch.equal(p, weights[name]), name


@pytest.mark.parametrize("layers", ["1-2-1", "2-4-2", "0-3-1"])
def test_make_tiny_huginn_names_and_shapes_are_upstream(tmp_path, layers):
    folder = make_tiny(tmp_path / "h", TinySpec(arch="huginn", layers=layers, r_max=5, max_position=128))
    raw = json.loads((folder / "config.json").read_text())
    assert HUGINN_KEYS <= set(raw), f"missing upstream keys {HUGINN_KEYS - set(raw)}"
    assert set(tiny_huginn_config()) <= set(raw)
    p, c, d = (int(x) for x in layers.split("-"))
    assert (raw["n_layers_in_prelude"], raw["n_layers_in_recurrent_block"], raw["n_layers_in_coda"]) == (p, c, d)
    assert raw["n_layers"] == p + c + d and raw["mean_recurrence"] == 5
    assert raw["effective_expected_depth"] == p + c * 5 + d
    shapes = _shapes(folder)
    expected = {n: tuple(t.shape) for n, t in tiny_huginn_weights(raw).items()}
    assert shapes == expected
    assert shapes["freqs_cis"] == (1, 128, 1, raw["n_embd"] // raw["n_heads"] // 2, 2)
    assert shapes["lm_head.weight"] == shapes["transformer.wte.weight"]
    weights = load_file(str(folder / "model.safetensors"))
    assert torch.equal(weights["lm_head.weight"], weights["transformer.wte.weight"])  # tied copy, as released
    hd = raw["n_embd"] // raw["n_heads"]
    ref = tiny_huginn_weights(raw)["freqs_cis"]
    assert torch.allclose(weights["freqs_cis"], ref, atol=1e-4)
    lm = load_model(folder, "float32", "cpu")
    assert (lm.config.n_prelude, lm.config.n_core, lm.config.n_coda, lm.config.head_dim) == (p, c, d, hd)
    for name, t in lm.model.checkpoint_tensors().items():
        assert torch.equal(t, weights[name]), name


def test_make_tiny_is_deterministic_per_seed(tmp_path):
    a = load_file(str(make_tiny(tmp_path / "a", TinySpec(seed=3)) / "model.safetensors"))
    b = load_file(str(make_tiny(tmp_path / "b", TinySpec(seed=3)) / "model.safetensors"))
    c = load_file(str(make_tiny(tmp_path / "c", TinySpec(seed=4)) / "model.safetensors"))
    assert all(torch.equal(a[n], b[n]) for n in a)
    assert not all(torch.equal(a[n], c[n]) for n in a)


def test_make_tiny_rejects_bad_spec(tmp_path):
    with pytest.raises(ValueError, match="arch"):
        make_tiny(tmp_path / "x", TinySpec(arch="llama"))
    with pytest.raises(ValueError, match="layers"):
        make_tiny(tmp_path / "y", TinySpec(arch="huginn", layers="4"))
    for layers in ("2-4-2", "0", "two"):  # Ouro takes a number, and says so (not int()'s "invalid literal")
        with pytest.raises(ValueError, match=r"^layers: Ouro takes a number of layers like '2'"):
            make_tiny(tmp_path / "z", TinySpec(arch="ouro", layers=layers))
    assert not (tmp_path / "z").exists()  # (the spec is checked before anything is written)


@pytest.mark.parametrize("arch,layers", [("ouro", "2"), ("huginn", "1-2-1")])
def test_sharded_checkpoint_loads_identically(tmp_path, arch, layers):
    spec = TinySpec(arch=arch, layers=layers, r_max=3, seed=5)
    single = make_tiny(tmp_path / "single", spec)
    sharded = make_tiny(tmp_path / "sharded", spec, shards=3)
    index = json.loads((sharded / "model.safetensors.index.json").read_text())
    shard_files = set(index["weight_map"].values())
    assert len(shard_files) == 3 and all((sharded / f).is_file() for f in shard_files)
    assert not (sharded / "model.safetensors").exists()
    assert _shapes(sharded) == _shapes(single)
    a, b = load_model(single, "float32", "cpu"), load_model(sharded, "float32", "cpu")
    pa, pb = dict(a.model.named_parameters()), dict(b.model.named_parameters())
    assert pa.keys() == pb.keys()
    assert all(torch.equal(pa[n], pb[n]) for n in pa)
    prompt = [7, 8, 9, 10]
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    outs = [LLM(model=f, scheduler="reference", state_init=huginn_state(f)).generate([prompt], params)[0]
            for f in (single, sharded)]
    assert outs[0].outputs[0].token_ids == outs[1].outputs[0].token_ids


# ---------------- tokenizer and generation config


def test_ouro_tokenizer_files(tiny_ouro):
    tok = load_model(tiny_ouro, "float32", "cpu").tokenizer
    # Ouro layout: <|endoftext|> = 0 is bos = eos; <|im_end|> = 2 is an extra eos (generation_config)
    assert tok.bos_token_id == 0 and tok.eos_token_id == 0
    assert tok.eos_token_ids == {0, 2}
    assert tok.id_to_token(1) == "<|im_start|>" and tok.id_to_token(2) == "<|im_end|>"
    text = tok.apply_chat_template([{"role": "user", "content": "Hello"}], add_generation_prompt=True, tokenize=False)
    assert "<|im_start|>user\nHello<|im_end|>" in text
    assert text.endswith("<|im_start|>assistant\n")
    closed = tok.apply_chat_template([{"role": "user", "content": "Hello"}], add_generation_prompt=False,
                                     tokenize=False)
    assert not closed.endswith("<|im_start|>assistant\n")
    ids = tok.encode("Hello, world")
    assert tok.decode(ids) == "Hello, world"
    assert tok.vocab_size == 512


def test_huginn_tokenizer_files(tiny_huginn):
    lm = load_model(tiny_huginn, "float32", "cpu")
    tok, vocab = lm.tokenizer, lm.config.vocab_size
    # Huginn layout: the 32 specials are the last ids; <|begin_text|> is BOS, <|end_text|> EOS
    assert tok.bos_token_id == vocab - 32 and tok.id_to_token(vocab - 32) == "<|begin_text|>"
    assert tok.eos_token_id == vocab - 31 and tok.id_to_token(vocab - 31) == "<|end_text|>"
    assert tok.eos_token_ids == {vocab - 31, vocab - 28}
    ids = tok.encode("Hi there")
    assert ids[0] == vocab - 32  # the post-processor prepends BOS
    assert tok.decode(ids, skip_special_tokens=True) == "Hi there" and tok.decode(ids) == "<|begin_text|>Hi there"
    text = tok.apply_chat_template([{"role": "user", "content": "  Hi  "}], add_generation_prompt=True, tokenize=False)
    assert text.startswith("<|begin_text|><|begin_header|>user<|end_header|>\n\nHi<|end_turn|>")
    assert text.endswith("<|begin_header|>Huginn<|end_header|>\n\n")


def _greedy(folder, prompt, n, ignore_eos):
    llm = LLM(model=folder, scheduler="reference", dtype="float64", state_init=huginn_state(folder))
    return llm.generate([prompt], SamplingParams(temperature=0, max_tokens=n, ignore_eos=ignore_eos))[0].outputs[0]


@pytest.mark.parametrize("fixture", ["tiny_ouro", "tiny_huginn"])
def test_generation_config_extra_eos_ids_stop_generation(request, tmp_path, fixture):
    folder = _copy(request.getfixturevalue(fixture), tmp_path / "m")
    prompt = [20, 21, 22, 23, 24]
    full = _greedy(folder, prompt, 10, ignore_eos=True)
    assert len(full.token_ids) == 10 and full.finish_reason == "length"
    tok = load_model(folder, "float32", "cpu").tokenizer
    # an extra eos only generation_config.json names: a token the model emits, first seen at k >= 1
    k = next(i for i in range(1, 10) if full.token_ids[i] not in full.token_ids[:i]
             and full.token_ids[i] != tok.eos_token_id)
    stop_tok = full.token_ids[k]
    gen_path = folder / "generation_config.json"
    gen = json.loads(gen_path.read_text())
    gen["eos_token_id"] = [tok.eos_token_id, stop_tok]
    gen_path.write_text(json.dumps(gen))
    assert stop_tok in load_model(folder, "float32", "cpu").tokenizer.eos_token_ids
    stopped = _greedy(folder, prompt, 10, ignore_eos=False)
    assert stopped.token_ids == full.token_ids[: k + 1]
    # vLLM's stop_reason: a generation config's eos id other than the tokenizer's is a stop id, and names itself
    assert stopped.finish_reason == "stop" and stopped.stop_reason == stop_tok
    again = _greedy(folder, prompt, 10, ignore_eos=True)
    assert again.token_ids == full.token_ids and again.finish_reason == "length"


@pytest.mark.parametrize("scheduler", ["reference", "cdb"])
def test_stop_reason_names_every_eos_but_the_tokenizers(tiny_ouro, scheduler):
    llm = LLM(tiny_ouro, scheduler=scheduler)
    tok = llm.get_tokenizer()
    extra = sorted(tok.eos_token_ids - {tok.eos_token_id})
    assert extra, "the tiny checkpoint's generation config names a second eos id"
    for forced, reason in [(tok.eos_token_id, None), (extra[0], extra[0])]:
        params = SamplingParams(temperature=0, max_tokens=4, logit_bias={forced: 100})
        out = llm.generate(["a"], params, use_tqdm=False)[0].outputs[0]
        assert (out.token_ids, out.finish_reason, out.stop_reason) == ([forced], "stop", reason)


def test_lookahead_gate_tensors_are_picked_up(tmp_path, tiny_ouro):
    with_gate = make_tiny(tmp_path / "la", TinySpec(arch="ouro", lookahead_gate=True, seed=2))
    names = _shapes(with_gate)
    assert names["lookahead_gate.weight"] == (1, 64) and names["lookahead_gate.bias"] == (1,)
    lm = load_model(with_gate, dtype="float64", device="cpu")
    assert lm.model.has_lookahead_gate
    w = load_file(str(with_gate / "model.safetensors"))
    state = torch.randn(3, 64, dtype=torch.float64)
    expected = state @ w["lookahead_gate.weight"].double()[0] + w["lookahead_gate.bias"].double()[0]
    assert torch.allclose(lm.model.lookahead_gate_logit(state), expected)
    assert not torch.allclose(lm.model.gate_logit(state), expected)  # a separate head from the exit gate
    plain = load_model(tiny_ouro, "float32", "cpu")
    assert not plain.model.has_lookahead_gate
    with pytest.raises(ValueError, match="lookahead gate"):
        plain.model.lookahead_gate_logit(state.float())


# ---------------- a folder written by the independent upstream-layout writer


def _independent_folder(dst: Path, tokenizer_src: Path, arch: str) -> Path:
    dst.mkdir()
    if arch.startswith("ouro"):
        cfg = tiny_ouro_config(vocab_size=512, tie_word_embeddings=arch == "ouro-tied")
        weights = tiny_ouro_weights(cfg, seed=7)
        if cfg["tie_word_embeddings"]:  # a tied checkpoint stores no separate head
            del weights["lm_head.weight"]
    else:
        cfg = tiny_huginn_config(vocab_size=512, padded_vocab_size=512, n_layers_in_prelude=2,
                                 n_layers_in_recurrent_block=1, n_layers_in_coda=1)
        weights = tiny_huginn_weights(cfg, seed=7)
    (dst / "config.json").write_text(json.dumps(cfg))
    save_file(weights, str(dst / "model.safetensors"))
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tokenizer_src / name, dst / name)
    return dst


@pytest.mark.parametrize("fixture,arch", [("tiny_ouro", "ouro"), ("tiny_ouro", "ouro-tied"),
                                          ("tiny_huginn", "huginn")])
def test_loads_folder_from_independent_writer(request, tmp_path, fixture, arch):
    folder = _independent_folder(tmp_path / "indep", request.getfixturevalue(fixture), arch)
    lm = load_model(folder, dtype="float64", device="cpu", state_init=huginn_state(folder))
    assert lm.config.vocab_size == 512
    prompt = [3, 30, 300, 33]
    depth = lm.config.r_max
    llm = LLM(model=folder, scheduler="reference", dtype="float64", state_init=huginn_state(folder))
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=3, ignore_eos=True, logprobs=3))[0]
    tokens, top = oracle.greedy_generate(folder, prompt, depth, 3, k=3)
    assert out.outputs[0].token_ids == tokens
    for ours, ref in zip(out.outputs[0].logprobs, top, strict=True):
        for t, v in ref.items():
            assert abs(ours[t].logprob - v) < 1e-8


# ---------------- malformed inputs


@pytest.fixture
def ouro_copy(tmp_path, tiny_ouro):
    return _copy(tiny_ouro, tmp_path / "broken")


def _rewrite_weights(folder: Path, edit) -> None:
    w = load_file(str(folder / "model.safetensors"))
    edit(w)
    save_file(w, str(folder / "model.safetensors"))


def test_an_empty_model_or_a_folder_without_config_is_named(tmp_path, monkeypatch):
    """`LLM("")` read the working folder and said "config.json: missing", naming no folder."""
    from loopserve.models.loader import load_model

    with pytest.raises(ValueError, match=r"^model: empty; give a model folder or hub id"):
        load_model("", "float32", "cpu")
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ValueError, match=f"^{tmp_path / 'config.json'}: missing$"):
        load_model(".", "float32", "cpu")


def test_missing_tensor_is_named(ouro_copy):
    _rewrite_weights(ouro_copy, lambda w: w.pop("model.layers.1.mlp.up_proj.weight"))
    with pytest.raises(ValueError) as e:
        load_model(ouro_copy, "float32", "cpu")
    msg = str(e.value)
    assert "model.layers.1.mlp.up_proj.weight" in msg and "model.safetensors" in msg and "missing" in msg


def test_wrong_shape_is_named(ouro_copy):
    def edit(w):
        w["model.layers.0.self_attn.k_proj.weight"] = torch.zeros(8, 64)
    _rewrite_weights(ouro_copy, edit)
    with pytest.raises(ValueError) as e:
        load_model(ouro_copy, "float32", "cpu")
    msg = str(e.value)
    assert "model.layers.0.self_attn.k_proj.weight" in msg and "model.safetensors" in msg
    assert "(8, 64)" in msg and "(64, 64)" in msg


def test_unknown_architecture(ouro_copy):
    cfg = json.loads((ouro_copy / "config.json").read_text())
    cfg["architectures"] = ["LlamaForCausalLM"]
    (ouro_copy / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError) as e:
        load_model(ouro_copy, "float32", "cpu")
    assert "LlamaForCausalLM" in str(e.value) and "config.json" in str(e.value)
    with pytest.raises(ValueError, match="unknown architecture"):
        ModelConfig.from_hf({"hidden_size": 4})


def test_missing_config_key(ouro_copy):
    cfg = json.loads((ouro_copy / "config.json").read_text())
    del cfg["num_hidden_layers"]
    (ouro_copy / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="num_hidden_layers") as e:
        load_model(ouro_copy, "float32", "cpu")
    assert "config.json" in str(e.value)


def test_missing_config_json(ouro_copy):
    (ouro_copy / "config.json").unlink()
    with pytest.raises(ValueError, match="config.json") as e:
        load_model(ouro_copy, "float32", "cpu")
    assert str(ouro_copy) in str(e.value)


@pytest.mark.parametrize("text", ["{not json", "[1, 2, 3]"])
def test_invalid_config_json(ouro_copy, text):
    (ouro_copy / "config.json").write_text(text)
    with pytest.raises(ValueError, match="config.json"):
        load_model(ouro_copy, "float32", "cpu")


@pytest.mark.parametrize("name", ["config.json", "generation_config.json", "tokenizer_config.json"])
@pytest.mark.parametrize("text", ["{not json", "[1, 2, 3]", "null"])
def test_invalid_json_files_are_named(ouro_copy, name, text):
    (ouro_copy / name).write_text(text)
    with pytest.raises(ValueError, match=rf"{name}: (not valid JSON|expected a JSON object)"):
        load_model(ouro_copy, "float32", "cpu")


def test_quantized_checkpoint_is_refused(ouro_copy):
    """A quantized checkpoint read as float weights would run other math: refused at load, naming the key."""
    cfg = json.loads((ouro_copy / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "fp8", "weight_block_size": [128, 128]}
    (ouro_copy / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="config.json: quantization_config: .* not supported"):
        load_model(ouro_copy, "float32", "cpu")
    cfg["quantization_config"] = None  # (null: none)
    (ouro_copy / "config.json").write_text(json.dumps(cfg))
    load_model(ouro_copy, "float32", "cpu")


@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.int8])
def test_weights_stored_as_another_kind_of_number_are_refused(ouro_copy, dtype):
    name = "model.layers.0.mlp.up_proj.weight"

    def edit(w):
        w[name] = w[name].to(dtype)
    _rewrite_weights(ouro_copy, edit)
    with pytest.raises(ValueError, match=rf"{name}.* is {str(dtype).removeprefix('torch.')}; .*bfloat16"):
        load_model(ouro_copy, "float32", "cpu")


def _generation_config(folder: Path, **keys) -> None:
    path = folder / "generation_config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), **keys}))


@pytest.mark.parametrize("eos", ["481", True, -1, 2**62, [[1]], [1, "2"], 1.0])
def test_generation_config_eos_ids_are_checked_at_load(ouro_copy, eos):
    _generation_config(ouro_copy, eos_token_id=eos)
    with pytest.raises(ValueError, match=r"generation_config.json: eos_token_id: must be a token id"):
        load_model(ouro_copy, "float32", "cpu")


def test_eos_ids_follow_the_generation_config_chosen(ouro_copy, tmp_path):
    """The eos ids besides the tokenizer's come from the generation config `generation_config` names (vLLM's
    rule): the model folder's (under "auto" and "vllm"), else its config.json's `eos_token_id`; another folder's."""
    own = load_model(ouro_copy, "float32", "cpu").tokenizer
    primary = own.eos_token_id
    assert primary is not None and len(own.eos_token_ids) > 1
    # "vllm" drops the file's sampling defaults, not its eos ids (vLLM reads the file for its special tokens either way)
    vllm_mode = load_model(ouro_copy, "float32", "cpu", generation_config="vllm")
    assert vllm_mode.tokenizer.eos_token_ids == own.eos_token_ids and vllm_mode.generation.sampling_defaults == {}
    other = _copy(ouro_copy, tmp_path / "other")
    _generation_config(other, eos_token_id=[7, 9])
    chosen = load_model(ouro_copy, "float32", "cpu", generation_config=str(other)).tokenizer
    assert chosen.eos_token_ids == {primary, 7, 9}
    (ouro_copy / "generation_config.json").unlink()
    cfg = json.loads((ouro_copy / "config.json").read_text())
    (ouro_copy / "config.json").write_text(json.dumps({**cfg, "eos_token_id": [primary, 11]}))
    assert load_model(ouro_copy, "float32", "cpu").tokenizer.eos_token_ids == {primary, 11}
    (ouro_copy / "config.json").write_text(json.dumps({**cfg, "eos_token_id": "11"}))
    with pytest.raises(ValueError, match="config.json: eos_token_id"):
        load_model(ouro_copy, "float32", "cpu")


def test_missing_weights(ouro_copy):
    (ouro_copy / "model.safetensors").unlink()
    with pytest.raises(ValueError, match="model.safetensors"):
        load_model(ouro_copy, "float32", "cpu")


def test_corrupt_safetensors(ouro_copy):
    (ouro_copy / "model.safetensors").write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00not json")
    with pytest.raises(ValueError, match="model.safetensors"):
        load_model(ouro_copy, "float32", "cpu")


def test_missing_tokenizer(ouro_copy):
    (ouro_copy / "tokenizer.json").unlink()
    # a slow tokenizer's files alone: the error says how to write tokenizer.json (vLLM's AutoTokenizer converts them)
    (ouro_copy / "vocab.json").write_text("{}")
    with pytest.raises(ValueError, match=r"tokenizer.json: missing tokenizer file; .*vocab.json and merges.txt.*"
                                         r"AutoTokenizer.from_pretrained\(FOLDER\).save_pretrained\(FOLDER\)"):
        load_model(ouro_copy, "float32", "cpu")
    (ouro_copy / "vocab.json").unlink()
    with pytest.raises(ValueError, match="tokenizer.json: missing tokenizer file$"):
        load_model(ouro_copy, "float32", "cpu")


@pytest.mark.parametrize("arch,layers", [("ouro", "2"), ("huginn", "1-2-1")])
def test_shards_without_an_index_load_identically(tmp_path, arch, layers):
    """As vLLM reads a folder without an index: every *.safetensors file (they were refused as no model.safetensors)."""
    spec = TinySpec(arch=arch, layers=layers, r_max=3, seed=5)
    single = load_model(make_tiny(tmp_path / "single", spec), "float32", "cpu")
    sharded = make_tiny(tmp_path / "sharded", spec, shards=3)
    (sharded / "model.safetensors.index.json").unlink()
    loaded = load_model(sharded, "float32", "cpu")
    assert loaded.config == single.config
    want = single.model.checkpoint_tensors()
    assert all(torch.equal(t, want[n]) for n, t in loaded.model.checkpoint_tensors().items())
    # a tensor in two of them: which to load is not guessed
    shards = sorted(sharded.glob("*.safetensors"))
    first = load_file(str(shards[0]))
    name = next(n for n in sorted(first) if n in want)
    save_file({name: first[name]}, str(sharded / "extra.safetensors"))
    with pytest.raises(ValueError, match=rf"tensor '{name}' is in .* too \(with no index, every \*\.safetensors"):
        load_model(sharded, "float32", "cpu")
    # a tensor none of them holds: the error names the files read
    (sharded / "extra.safetensors").unlink()
    save_file({n: t for n, t in first.items() if n != name}, str(shards[0]))
    with pytest.raises(ValueError, match=rf"^{re.escape(str(sharded / '*.safetensors'))}: tensor '{name}' missing"):
        load_model(sharded, "float32", "cpu")


@pytest.mark.parametrize("arch,bins", [("ouro", ["pytorch_model.bin"]),
                                       ("huginn", ["pytorch_model-00001-of-00002.bin",
                                                   "pytorch_model-00002-of-00002.bin"])])
def test_pytorch_bin_weights_are_refused_saying_how_to_convert_them(tmp_path, arch, bins):
    """A folder of .bin weights only: still refused, with the line that converts them (run here, file by file: the
    folder then loads as the safetensors one did)."""
    folder = make_tiny(tmp_path / "m", TinySpec(arch=arch, layers="1-1-1" if arch == "huginn" else "2", r_max=2))
    want = load_model(folder, "float32", "cpu").model.checkpoint_tensors()
    weights = load_file(str(folder / "model.safetensors"))
    if arch == "huginn":  # (tied, as torch.save keeps a tied model's state dict: one storage)
        weights["lm_head.weight"] = weights["transformer.wte.weight"]
    names = sorted(weights)
    for i, b in enumerate(bins):
        torch.save({n: weights[n] for n in names[i::len(bins)]}, folder / b)
    (folder / "model.safetensors").unlink()
    with pytest.raises(ValueError) as e:
        load_model(folder, "float32", "cpu")
    msg = str(e.value)
    assert msg.startswith(f"{folder}: no model.safetensors") and bins[0] in msg and "not read" in msg, msg
    assert "weights_only=True" in msg and "\n" not in msg
    command = shlex.split(msg[msg.index("python -c "):])
    for b in bins:
        out = b.replace("pytorch_model", "model").replace(".bin", ".safetensors")
        code = command[2].replace(bins[0], b).replace(bins[0].replace("pytorch_model", "model").replace(
            ".bin", ".safetensors"), out)
        subprocess.run([sys.executable, "-c", code], cwd=folder, check=True)
    loaded = load_model(folder, "float32", "cpu").model.checkpoint_tensors()
    assert all(torch.equal(t, want[n]) for n, t in loaded.items())


def test_index_listing_missing_shard(tmp_path):
    folder = make_tiny(tmp_path / "s", TinySpec(arch="huginn", layers="1-1-1", r_max=2), shards=3)
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    victim = sorted(set(index["weight_map"].values()))[1]
    (folder / victim).unlink()
    with pytest.raises(ValueError) as e:
        load_model(folder, "float32", "cpu")
    assert victim in str(e.value) and "model.safetensors.index.json" in str(e.value)


def test_index_pointing_at_wrong_shard(tmp_path):
    folder = make_tiny(tmp_path / "s", TinySpec(arch="ouro", r_max=2), shards=3)
    path = folder / "model.safetensors.index.json"
    index = json.loads(path.read_text())
    name = "model.norm.weight"
    other = next(f for f in sorted(set(index["weight_map"].values())) if f != index["weight_map"][name])
    index["weight_map"][name] = other
    path.write_text(json.dumps(index))
    with pytest.raises(ValueError) as e:
        load_model(folder, "float32", "cpu")
    assert name in str(e.value) and other in str(e.value)


def test_index_without_weight_map(tmp_path):
    folder = make_tiny(tmp_path / "s", TinySpec(arch="ouro", r_max=2), shards=2)
    (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}}))
    with pytest.raises(ValueError, match="weight_map"):
        load_model(folder, "float32", "cpu")
    for text in ("{broken", "[]"):
        (folder / "model.safetensors.index.json").write_text(text)
        with pytest.raises(ValueError, match="model.safetensors.index.json"):
            load_model(folder, "float32", "cpu")


LFS_POINTER = "version https://git-lfs.github.com/spec/v1\noid sha256:" + "0" * 64 + "\nsize 2113710\n"


def _write(folder: Path, name: str, text: str | None = None, **keys) -> Path:
    """`folder`'s file `name` replaced by `text`, or (a JSON file) with `keys` set; the file's path."""
    path = folder / name
    path.write_text(text if text is not None else json.dumps({**json.loads(path.read_text()), **keys}))
    return path


# Files a user's folder held that crashed the load with a TypeError or the tokenizers library's bare Exception, naming
# no file: (file, its text or keys, what the one-line ValueError says after naming the file)
UNREADABLE = {
    "tokenizer.json as a git-lfs pointer": ("tokenizer.json", LFS_POINTER, "a git-lfs pointer, not the file itself"),
    "truncated tokenizer.json": ("tokenizer.json", '{"version": "1.0", "truncation": nu',
                                 "not a readable tokenizer file ("),
    "model.safetensors as a git-lfs pointer": ("model.safetensors", LFS_POINTER, "git lfs pull"),
    "config.json as a git-lfs pointer": ("config.json", LFS_POINTER, "a git-lfs pointer"),
    "an eos_token id": ("tokenizer_config.json", {"eos_token": 5}, 'eos_token: must be a token (its text, or an '
                        'object with its "content"), got 5'),
    "a bos_token object without text": ("tokenizer_config.json", {"bos_token": {"content": 1}}, "bos_token: must be"),
    "additional_special_tokens as one token": ("tokenizer_config.json", {"additional_special_tokens": "<x>"},
                                               "additional_special_tokens: must be a list of tokens"),
    "additional_special_tokens with a null": ("tokenizer_config.json", {"additional_special_tokens": [None]},
                                              "additional_special_tokens: must be a token"),
    "architectures as a string": ("config.json", {"architectures": "OuroForCausalLM"},
                                  'architectures: must be a list of class names (["OuroForCausalLM"] or '
                                  '["RavenForCausalLM"]), got "OuroForCausalLM"'),
}


@pytest.mark.parametrize("case", UNREADABLE)
def test_unreadable_files_are_named(ouro_copy, case):
    name, content, words = UNREADABLE[case]
    path = _write(ouro_copy, name, content) if isinstance(content, str) else _write(ouro_copy, name, **content)
    with pytest.raises(ValueError) as e:
        load_model(ouro_copy, "float32", "cpu")
    msg = str(e.value)
    assert msg.startswith(f"{path}: ") and words in msg and "\n" not in msg, msg


def test_index_weight_map_must_map_tensors_to_file_names(tmp_path):
    """A non-string shard in weight_map was a TypeError in the loader."""
    folder = make_tiny(tmp_path / "s", TinySpec(arch="ouro", r_max=2), shards=2)
    index = folder / "model.safetensors.index.json"
    weight_map = json.loads(index.read_text())["weight_map"]
    _write(folder, index.name, weight_map={**weight_map, "model.norm.weight": 5})
    with pytest.raises(ValueError, match=rf"^{index}: weight_map: tensor 'model.norm.weight' must map to a shard file "
                                         rf"name, got 5$"):
        load_model(folder, "float32", "cpu")
    _write(folder, index.name, weight_map=sorted(set(weight_map.values())))
    with pytest.raises(ValueError, match=rf"^{index}: weight_map: must be an object of tensor name -> shard file"):
        load_model(folder, "float32", "cpu")


@pytest.mark.parametrize("command", ["generate", "serve"])
@pytest.mark.parametrize("case", ["truncated tokenizer.json", "an eos_token id", "architectures as a string"])
def test_cli_unreadable_file_is_one_line(ouro_copy, capsys, command, case):
    name, content, words = UNREADABLE[case]
    path = _write(ouro_copy, name, content) if isinstance(content, str) else _write(ouro_copy, name, **content)
    argv = ["generate", "--model", str(ouro_copy), "hi"] if command == "generate" else ["serve", str(ouro_copy)]
    with pytest.raises(SystemExit) as exited:
        cli_main([*argv, "--dtype", "float32"])
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: {path}: ") and words in err and err.count("\n") == 1, err


def test_bad_dtype_and_state_init(tiny_ouro, tiny_huginn):
    with pytest.raises(ValueError, match="dtype"):
        load_model(tiny_ouro, dtype="float16x", device="cpu")
    for value in ("random", ""):  # "" is no choice, not the checkpoint's default (Ouro refuses it too)
        with pytest.raises(ValueError, match="state_init"):
            load_model(tiny_huginn, "float32", "cpu", state_init=value)
    for value in ("zero", "like-init", ""):  # Ouro has no initial loop state to choose: not silently ignored
        with pytest.raises(ValueError, match="state_init: OuroForCausalLM has no random initial loop state"):
            load_model(tiny_ouro, "float32", "cpu", state_init=value)
        with pytest.raises(ValueError, match="state_init"):
            LLM(tiny_ouro, state_init=value)


def test_not_a_folder(tmp_path):
    for bad in (tmp_path / "nope", "a/b/c", "./relative"):
        with pytest.raises(ValueError, match="not a model folder"):
            load_model(bad, "float32", "cpu")


def test_hub_id_offline_fails_fast_naming_the_id(monkeypatch, tmp_path):
    import huggingface_hub.constants as hf_constants

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(hf_constants, "HF_HUB_OFFLINE", True)  # read at import time by huggingface_hub
    monkeypatch.chdir(tmp_path)  # so "nobody/nothing" is not a relative folder by accident
    start = time.monotonic()
    with pytest.raises(ValueError) as e:
        load_model("nobody/nothing", "float32", "cpu")
    assert time.monotonic() - start < 10
    assert "'nobody/nothing'" in str(e.value)
    assert "Hugging Face Hub" in str(e.value) and "download" in str(e.value)


# ---------------- CLI


def test_cli_make_tiny(tmp_path, capsys):
    out = tmp_path / "cli_huginn"
    rc = cli_main(["make-tiny", str(out), "--arch", "huginn", "--layers", "1-3-1", "--r-max", "5",
                   "--hidden-size", "32", "--num-heads", "2", "--vocab-size", "320", "--shards", "2", "--seed", "9"])
    assert rc == 0 and str(out) in capsys.readouterr().out
    assert (out / "model.safetensors.index.json").is_file()
    lm = load_model(out, "float32", "cpu")
    c = lm.config
    assert (c.n_prelude, c.n_core, c.n_coda, c.r_max, c.hidden_size, c.num_heads, c.vocab_size) == (
        1, 3, 1, 5, 32, 2, 320)
    out2 = tmp_path / "cli_ouro"
    assert cli_main(["make-tiny", str(out2), "--num-kv-heads", "2", "--lookahead-gate"]) == 0
    lm2 = load_model(out2, "float32", "cpu")
    assert lm2.config.arch == "OuroForCausalLM" and lm2.config.num_kv_heads == 2 and lm2.model.has_lookahead_gate
    with pytest.raises(SystemExit) as exited:
        cli_main(["make-tiny", str(tmp_path / "bad"), "--arch", "huginn", "--layers", "x"])
    assert exited.value.code == 2
    assert "layers" in capsys.readouterr().err


def test_cli_make_tiny_refuses_a_file_or_a_folder_with_files(tmp_path, capsys):
    """Writing over another checkpoint would leave its files beside the new ones (Ouro's beside Huginn's): a
    non-empty folder is refused, with one error line and status 2, and left as it was; an empty one is taken."""
    afile = tmp_path / "afile"
    afile.write_text("x")
    with pytest.raises(SystemExit) as exited:
        cli_main(["make-tiny", str(afile)])
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "not a folder" in err and err.count("\n") == 1
    ouro = tmp_path / "ouro"
    assert cli_main(["make-tiny", str(ouro)]) == 0
    before = sorted(p.name for p in ouro.iterdir())
    with pytest.raises(SystemExit) as exited:
        cli_main(["make-tiny", str(ouro), "--arch", "huginn", "--layers", "1-1-1"])
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "not empty" in err and err.count("\n") == 1
    assert sorted(p.name for p in ouro.iterdir()) == before
    assert load_model(ouro, "float32", "cpu").config.arch == "OuroForCausalLM"
    empty = tmp_path / "empty"
    empty.mkdir()
    assert cli_main(["make-tiny", str(empty), "--layers", "1"]) == 0
    with pytest.raises(SystemExit) as exited:
        cli_main(["make-tiny", str(tmp_path / "o2"), "--layers", "2-4-2"])
    assert exited.value.code == 2
    assert "Ouro takes a number of layers" in capsys.readouterr().err
