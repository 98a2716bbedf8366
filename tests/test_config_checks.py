"""A checkpoint's config.json is checked at load: a value loopserve would run with silently different math than
upstream (an architecture setting it does not implement) or could not run at all (a mistyped or out-of-range
value) is a ValueError naming the key and the file, before any weight is read; the released checkpoints' configs
load. `make-tiny` refuses what the loader would refuse, before writing anything; a KV pool that cannot be
allocated (or holds nothing) is a ValueError naming the knob that sized it."""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path

import pytest
import torch

from loopserve import LLM, SamplingParams, load_config
from loopserve.cli import main as cli_main
from loopserve.engine import engine as engine_module
from loopserve.engine.config import EngineConfig
from loopserve.engine.engine import LLMEngine
from loopserve.load_config import LoadConfig
from loopserve.model_config import HUGINN, OURO, UNIMPLEMENTED, ModelConfig
from loopserve.models.loader import load_model
from loopserve_lab.tiny import ARCH_DEFAULTS, TINY_ARCHS, TinySpec, make_tiny, tiny_arch

pytestmark = pytest.mark.usefixtures("single_thread")


def _edited(src: Path, dst: Path, **changes) -> Path:
    """A copy of checkpoint `src` whose config.json has `changes` (a value of `...` deletes the key)."""
    shutil.copytree(src, dst)
    path = dst / "config.json"
    cfg = json.loads(path.read_text())
    for key, value in changes.items():
        if value is ...:
            cfg.pop(key, None)
        else:
            cfg[key] = value
    path.write_text(json.dumps(cfg))
    return dst


def _refused(folder: Path, *words: str) -> str:
    with pytest.raises(ValueError) as e:
        load_model(folder, "float32", "cpu")
    msg = str(e.value)
    assert str(folder / "config.json") in msg and all(w in msg for w in words), msg
    assert "\n" not in msg
    return msg


# ---------------- the released checkpoints' configs (values from their config.json)

def _ouro_released(layers: int) -> dict:
    return {
        "architectures": [OURO], "model_type": "ouro",
        "auto_map": {"AutoConfig": "configuration_ouro.OuroConfig", "AutoModel": "modeling_ouro.OuroModel",
                     "AutoModelForCausalLM": "modeling_ouro.OuroForCausalLM"},
        "hidden_size": 2048, "intermediate_size": 5632, "num_hidden_layers": layers, "num_attention_heads": 16,
        "num_key_value_heads": 16, "head_dim": 128, "vocab_size": 49152, "hidden_act": "silu",
        "rope_theta": 1000000.0, "rope_scaling": None, "rms_norm_eps": 1e-6, "max_position_embeddings": 65536,
        "tie_word_embeddings": False, "total_ut_steps": 4, "early_exit_threshold": 1.0, "use_sliding_window": False,
        "sliding_window": None, "max_window_layers": layers, "layer_types": ["full_attention"] * layers,
        "initializer_range": 0.02, "attention_dropout": 0.0, "use_cache": True, "torch_dtype": "bfloat16",
        "bos_token_id": 0, "eos_token_id": 0, "pad_token_id": 0,
    }


HUGINN_0125 = {
    "architectures": [HUGINN], "model_type": "huginn_raven",
    "auto_map": {"AutoConfig": "raven_config_minimal.RavenConfig",
                 "AutoModelForCausalLM": "raven_modeling_minimal.RavenForCausalLM"},
    "n_embd": 5280, "n_heads": 55, "num_key_value_heads": 55, "head_dim": 96, "n_layers": 8,
    "n_layers_in_prelude": 2, "n_layers_in_recurrent_block": 4, "n_layers_in_coda": 2, "intermediate_size": 17920,
    "vocab_size": 65536, "padded_vocab_size": 65536, "padding_multiple": 4096, "block_size": 4096, "rope_base": 50000,
    "norm_class_name": "RMSNorm_llama", "norm_eps": 1e-6, "block_class_name": "SandwichBlock",
    "mlp_class_name": "GatedMLP", "nonlin_name": "SiLU", "bias": False, "qk_bias": True, "tie_embeddings": True,
    "injection_type": "linear", "state_init": "like-init", "mean_recurrence": 32, "mean_backprop_depth": 8,
    "sampling_scheme": "poisson-lognormal-filling", "init_strategy": "takase", "init_orthogonal": False,
    "activation_checkpoint_impl": "per-iteration", "architecture_class_name": "RecurrentGPT", "torch_dtype": "float32",
    "effective_expected_depth": 132, "test_time_noise": 0, "test_time_noise_type": "fixed",
    "init_values": {"std": 0.008703882797784892, "out_proj": 0.0005356869554443541, "embedding": 0.008703882797784892,
                    "embed_scale": 72.66360849328164},
    "bos_token_id": 65504, "eos_token_id": 65505, "pad_token_id": 65509,
}


@pytest.mark.parametrize("name,cfg,want", [
    ("Ouro-1.4B", _ouro_released(24), (2048, 16, 16, 128, 0, 24, 0, 4, 65536, 1.0, None)),
    ("Ouro-2.6B", _ouro_released(48), (2048, 16, 16, 128, 0, 48, 0, 4, 65536, 1.0, None)),
    ("huginn-0125", HUGINN_0125, (5280, 55, 55, 96, 2, 4, 2, 32, 4096, None, "like-init")),
])
def test_released_configs_load(name, cfg, want):
    c = ModelConfig.from_hf(cfg, name)
    assert (c.hidden_size, c.num_heads, c.num_kv_heads, c.head_dim, c.n_prelude, c.n_core, c.n_coda, c.r_max,
            c.max_position, c.exit_threshold, c.state_init) == want


# ---------------- architecture settings loopserve does not implement

REFUSED = {
    OURO: [
        ("rope_scaling", {"type": "yarn", "factor": 4.0}),
        ("rope_scaling", {"rope_type": "linear", "factor": 2.0}),
        ("rope_scaling", {"type": "linear", "rope_type": "default", "factor": 2.0}),  # (OuroConfig: type wins)
        ("use_sliding_window", True),
        ("layer_types", ["full_attention", "sliding_attention"]),
        ("hidden_act", "gelu"),
        ("partial_rotary_factor", 0.5),
        ("early_exit_step", 1),
        ("quantization_config", {"quant_method": "fp8", "fmt": "e4m3"}),
    ],
    HUGINN: [
        ("injection_type", "add"),
        ("nonlin_name", "GELU"),
        ("norm_class_name", "LayerNorm"),
        ("block_class_name", "TransformerPreNormBlock"),
        ("mlp_class_name", "BaseMLP"),
        ("qk_bias", False),
        ("bias", True),
        ("tie_embeddings", False),
        ("test_time_noise", 0.5),
        ("quantization_config", {"quant_method": "bitsandbytes", "load_in_4bit": True}),
    ],
}


def test_every_unimplemented_key_is_tested():
    assert {arch: {k for k, _ in cases} for arch, cases in REFUSED.items()} == {
        arch: set(keys) for arch, keys in UNIMPLEMENTED.items()}


@pytest.mark.parametrize("arch,key,value", [(a, k, v) for a, cases in REFUSED.items() for k, v in cases])
def test_unimplemented_setting_is_refused_naming_key_and_value(request, tmp_path, arch, key, value):
    src = request.getfixturevalue("tiny_ouro" if arch == OURO else "tiny_huginn")
    msg = _refused(_edited(src, tmp_path / "c", **{key: value}), key, json.dumps(value), "not supported",
                   "loopserve implements")
    assert "only" in msg


# ---------------- transformers 5's RoPE form: rope_parameters

@pytest.mark.parametrize("fixture,base_key", [("tiny_ouro", "rope_theta"), ("tiny_huginn", "rope_base")])
@pytest.mark.parametrize("params", [{"rope_type": "default", "rope_theta": 1e6},
                                    {"full_attention": {"rope_type": "default", "rope_theta": 1e6}}])
def test_rope_parameters_give_the_rope_base(request, tmp_path, fixture, base_key, params):
    """A config.json in transformers 5's form has no top-level base: rope_parameters' rope_theta is it (it loaded
    with the default base, other math)."""
    src = request.getfixturevalue(fixture)
    new = load_model(_edited(src, tmp_path / "new", **{base_key: ..., "rope_parameters": params}), "float32", "cpu")
    old = load_model(_edited(src, tmp_path / "old", **{base_key: 1e6}), "float32", "cpu")
    assert new.config.rope_theta == 1e6 and new.config == old.config
    both = _edited(src, tmp_path / "both", **{base_key: 1000000, "rope_parameters": params})  # (the same base twice)
    assert load_model(both, "float32", "cpu").config == old.config


@pytest.mark.parametrize("fixture", ["tiny_ouro", "tiny_huginn"])
@pytest.mark.parametrize("params,words", [
    ({"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768},
     ["rope_parameters.rope_type", '"yarn"', "not supported", '"default"']),
    ({"rope_type": "llama3", "rope_theta": 5e5, "factor": 8.0}, ["rope_parameters.rope_type", '"llama3"']),
    ({"type": "linear", "factor": 2.0}, ["rope_parameters.type", '"linear"']),
    ({"full_attention": {"rope_type": "dynamic", "factor": 2.0}}, ["rope_parameters.full_attention.rope_type"]),
    ({"factor": 4.0}, ["rope_parameters.factor", "4.0", "plain RoPE"]),  # (a scaling field without its rope_type)
    ({"rope_type": "default", "partial_rotary_factor": 0.5}, ["rope_parameters.partial_rotary_factor", "0.5"]),
    ({"sliding_attention": {"rope_type": "default"}}, ["rope_parameters.sliding_attention"]),
    ({"rope_type": "default", "rope_theta": -1.0}, ["rope_parameters.rope_theta", "> 0"]),
    ("default", ["rope_parameters", "must be an object"]),
])
def test_rope_parameters_other_than_plain_rope_are_refused(request, tmp_path, fixture, params, words):
    """The README's promise: rope scaling is refused at load naming the key, in transformers 5's form too (it loaded
    and ran plain RoPE)."""
    _refused(_edited(request.getfixturevalue(fixture), tmp_path / "c", rope_parameters=params), *words)


@pytest.mark.parametrize("fixture,base_key", [("tiny_ouro", "rope_theta"), ("tiny_huginn", "rope_base")])
def test_rope_base_given_twice_differently_is_refused(request, tmp_path, fixture, base_key):
    folder = _edited(request.getfixturevalue(fixture), tmp_path / "c", **{base_key: 20000.0},
                     rope_parameters={"rope_type": "default", "rope_theta": 1e6})
    _refused(folder, "rope_parameters.rope_theta", "1000000.0", f"disagrees with {base_key} (20000.0)")


@pytest.mark.parametrize("changes", [
    {"rope_scaling": None}, {"rope_scaling": {"rope_type": "default"}}, {"rope_scaling": {"type": "default"}},
    {"use_sliding_window": False, "sliding_window": None}, {"use_sliding_window": False, "sliding_window": 4096},
    {"rope_scaling": {"type": "default", "rope_type": "linear"}},
    {"rope_parameters": None}, {"rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}},
    {"rope_parameters": {"type": "default", "rope_theta": None, "partial_rotary_factor": 1.0}},
    {"rope_parameters": {"full_attention": {"rope_type": "default"}}},
    {"layer_types": ["full_attention"] * 2}, {"layer_types": None}, {"hidden_act": "silu"},
    {"hidden_act": "swish"}, {"partial_rotary_factor": 1.0},
    {"early_exit_step": None}, {"early_exit_threshold": None}, {"num_key_value_heads": None, "head_dim": None},
    {key: ... for key in ("rope_scaling", "use_sliding_window", "sliding_window", "layer_types", "hidden_act")},
])
def test_ouro_neutral_settings_load_as_the_plain_model(tmp_path, tiny_ouro, changes):
    base = load_model(tiny_ouro, "float32", "cpu")
    lm = load_model(_edited(tiny_ouro, tmp_path / "c", **changes), "float32", "cpu")
    if changes == {"early_exit_threshold": None}:  # (null: upstream reads out the last step, as 1.0 does)
        assert lm.config.exit_threshold is None and base.config.exit_threshold == 1.0
    else:
        assert lm.config == base.config


@pytest.mark.parametrize("threshold", [1.5, 7])
def test_ouro_exit_threshold_above_one_runs_as_one(tmp_path, tiny_ouro, threshold):
    """Upstream's exit CDF never exceeds a threshold above 1: every token runs to the last step, as at 1.0."""
    lm = LLM(str(_edited(tiny_ouro, tmp_path / "c", early_exit_threshold=threshold)), dtype="float32",
             kv_cache_tokens=512)
    base = LLM(str(tiny_ouro), dtype="float32", kv_cache_tokens=512)
    assert lm.config == base.config and lm.config.exit_threshold == 1.0
    params = SamplingParams(max_tokens=4, temperature=0)
    assert lm.generate(["To be"], params)[0].outputs[0].token_ids == \
        base.generate(["To be"], params)[0].outputs[0].token_ids


@pytest.mark.parametrize("changes", [
    {"num_key_value_heads": ...}, {"num_key_value_heads": None}, {"test_time_noise": 0}, {"test_time_noise": None},
    {"init_values": None},  # (made with embed_scale sqrt(n_embd), the default)
    {"rope_parameters": {"rope_type": "default", "rope_theta": 50000}}, {"rope_parameters": {}},
    {key: ... for key in ("injection_type", "nonlin_name", "norm_class_name", "block_class_name", "mlp_class_name",
                          "qk_bias", "bias", "tie_embeddings", "state_init", "padded_vocab_size")},
])
def test_huginn_neutral_settings_load_as_the_plain_model(tmp_path, tiny_huginn, changes):
    base = load_model(tiny_huginn, "float32", "cpu")
    lm = load_model(_edited(tiny_huginn, tmp_path / "c", **changes), "float32", "cpu")
    assert lm.config == base.config and lm.model.state_init == "like-init"


# ---------------- Huginn's state_init: the checkpoint's, unless the load asks for another

def test_huginn_state_init_follows_the_checkpoint_unless_asked(tmp_path, tiny_huginn):
    zero = _edited(tiny_huginn, tmp_path / "zero", state_init="zero")
    assert load_model(zero, "float32", "cpu").model.state_init == "zero"
    assert not LLM(str(zero), dtype="float32").engine.model.draws_random_state
    assert load_model(zero, "float32", "cpu", "like-init").model.state_init == "like-init"
    assert load_model(tiny_huginn, "float32", "cpu", "zero").model.state_init == "zero"
    assert load_model(tiny_huginn, "float32", "cpu").model.state_init == "like-init"
    _refused(_edited(tiny_huginn, tmp_path / "normal", state_init="normal"), "state_init", '"normal"',
             '"like-init" and "zero"')


# ---------------- values no model can run

@pytest.mark.parametrize("key,value,words", [
    ("total_ut_steps", 0, ">= 1"), ("total_ut_steps", -2, ">= 1"), ("total_ut_steps", "4", "integer"),
    ("num_hidden_layers", 0, ">= 1"), ("num_attention_heads", 0, ">= 1"), ("hidden_size", 64.0, "integer"),
    ("num_key_value_heads", 3, "divide num_attention_heads (4)"), ("head_dim", 15, "even"),
    ("rms_norm_eps", None, "> 0"), ("rope_theta", -1.0, "> 0"), ("early_exit_threshold", "0.5", "> 0 or null"),
    ("early_exit_threshold", 0, "> 0 or null"), ("early_exit_threshold", -1.0, "> 0 or null"),
    ("early_exit_threshold", True, "> 0 or null"),
    ("max_position_embeddings", 1, ">= 2"), ("tie_word_embeddings", "false", "true or false"),
    ("num_hidden_layers", ..., "missing"),
])
def test_ouro_invalid_value_is_refused_naming_the_key(tmp_path, tiny_ouro, key, value, words):
    msg = _refused(_edited(tiny_ouro, tmp_path / "c", **{key: value}), key, words)
    assert "got" in msg or value is ...


def test_ouro_head_dim_derived_odd_is_refused(tmp_path, tiny_ouro):
    # (no head_dim: hidden_size // heads, 60 // 4 = 15)
    _refused(_edited(tiny_ouro, tmp_path / "c", head_dim=..., hidden_size=60), "hidden_size // num_attention_heads",
             "even", "15")


@pytest.mark.parametrize("key,value,words", [
    ("num_key_value_heads", 2, "must equal n_heads (4)"), ("n_embd", 66, "multiple of n_heads (4)"),
    ("mean_recurrence", 0, ">= 1"), ("n_layers_in_recurrent_block", 0, ">= 1"), ("n_layers_in_prelude", -1, ">= 0"),
    ("norm_eps", None, "> 0"), ("block_size", 1, ">= 2"), ("init_values", {"embed_scale": "8"}, "embed_scale"),
])
def test_huginn_invalid_value_is_refused_naming_the_key(tmp_path, tiny_huginn, key, value, words):
    _refused(_edited(tiny_huginn, tmp_path / "c", **{key: value}), key, words)


def test_huginn_odd_head_dim_is_refused(tmp_path, tiny_huginn):
    _refused(_edited(tiny_huginn, tmp_path / "c", n_embd=60), "n_embd / n_heads", "even", "15")


# ---------------- make-tiny refuses what the loader would refuse, writing nothing

@pytest.mark.parametrize("flags,words", [  # (the option's name first, then the config.json key it is written to)
    (["--hidden-size", "63"], ["hidden_size / num_heads (head_dim", "even"]),
    (["--num-kv-heads", "3"], ["num_kv_heads (num_key_value_heads)", "divide"]),
    (["--r-max", "0"], ["r_max (total_ut_steps)", ">= 1"]),
    (["--arch", "huginn", "--r-max", "0"], ["r_max (mean_recurrence)", ">= 1"]),
    (["--shards", "0"], ["shards", ">= 1"]),
    (["--num-heads", "0"], ["num_heads (num_attention_heads)", ">= 1"]),
    (["--arch", "huginn", "--hidden-size", "63"], ["hidden_size (n_embd)", "multiple of n_heads"]),
    (["--arch", "huginn", "--hidden-size", "0"], ["hidden_size (n_embd)", ">= 1"]),  # (was a ZeroDivisionError)
    (["--arch", "huginn", "--layers", "0-0-0"], ["layers (n_layers_in_recurrent_block)", ">= 1"]),  # (the same)
    (["--arch", "huginn", "--num-kv-heads", "2"], ["--num-kv-heads", "Ouro only"]),
    (["--arch", "huginn", "--lookahead-gate"], ["--lookahead-gate", "Ouro only"]),
    (["--vocab-size", "100"], ["vocab_size"]),
])
def test_make_tiny_refuses_a_checkpoint_the_loader_would_refuse(tmp_path, capsys, flags, words):
    out = tmp_path / "t"
    with pytest.raises(SystemExit) as exited:
        cli_main(["make-tiny", str(out), *flags])
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1 and all(w in err for w in words), err
    assert not out.exists()


def test_make_tiny_unwritable_folder_is_one_line(tmp_path, capsys):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    with pytest.raises(SystemExit) as exited:
        cli_main(["make-tiny", str(blocker / "sub")])
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: {blocker / 'sub'}: cannot write") and err.count("\n") == 1, err


@pytest.mark.parametrize("arch", list(TINY_ARCHS))
def test_tiny_arch_names_the_spec_a_checkpoint_was_made_from(tmp_path, arch):
    """One table maps make-tiny's names to config.json's classes: what a benchmark reads back from a loaded
    checkpoint (its `NULL_SPECS` key, its report's "arch") is the name it was made with."""
    path = make_tiny(tmp_path / arch, TinySpec(arch=arch, layers=ARCH_DEFAULTS[arch][0]))
    assert tiny_arch(load_model(path, "float32", "cpu").config.arch) == arch
    with pytest.raises(ValueError, match="arch: no tiny checkpoint of 'GPT2LMHeadModel'"):
        tiny_arch("GPT2LMHeadModel")


def test_tiny_state_init_is_written_for_huginn_and_refused_for_ouro(tmp_path):
    path = make_tiny(tmp_path / "h", TinySpec(arch="huginn", layers="1-1-1", state_init="zero"))
    assert load_model(path, "float32", "cpu").config.state_init == "zero"
    with pytest.raises(ValueError, match="state_init: Huginn only"):
        make_tiny(tmp_path / "o", TinySpec(state_init="zero"))
    assert not (tmp_path / "o").exists()


def test_make_tiny_r_max_given_is_kept(tmp_path):
    out = tmp_path / "t"
    assert cli_main(["make-tiny", str(out), "--r-max", "1"]) == 0
    assert load_model(out, "float32", "cpu").config.r_max == 1


# ---------------- the KV pool

@pytest.mark.parametrize("value", [0, -1.0, float("nan"), "1"])
def test_kv_cache_memory_gb_must_be_positive(value):
    with pytest.raises(ValueError, match="kv_cache_memory_gb: must be a number of GiB > 0"):
        EngineConfig(kv_cache_memory_gb=value)


def test_a_kv_pool_shorter_than_max_model_len_is_said_at_start(tiny_ouro, caplog):
    """vLLM refuses to start there; loopserve serves what fits, and says so once (the server started silently and
    /v1/models advertised a length no request could reach)."""
    with caplog.at_level("WARNING", logger="loopserve.engine"):
        LLM(str(tiny_ouro), dtype="float32", kv_cache_tokens=100, max_model_len=512)
    assert "the KV cache holds 96 tokens, fewer than max_model_len 512" in caplog.text
    caplog.clear()
    with caplog.at_level("WARNING", logger="loopserve.engine"):
        LLM(str(tiny_ouro), dtype="float32", kv_cache_tokens=512, max_model_len=512)
    assert "fewer than max_model_len" not in caplog.text


def test_kv_cache_tokens_must_be_an_integer():
    with pytest.raises(ValueError, match="kv_cache_tokens: must be an integer >= block_size"):
        EngineConfig(kv_cache_tokens=100.5)


@pytest.mark.parametrize("knobs,words", [
    ({"kv_cache_tokens": 10**15}, ["kv_cache_tokens: 1000000000000000 asks for a KV pool", "could not allocate"]),
    ({"kv_cache_memory_gb": 1e9}, ["kv_cache_memory_gb: 1000000000.0 GiB asks", "could not allocate"]),
    ({"kv_cache_memory_gb": 1e-7}, ["kv_cache_memory_gb: 1e-07 GiB holds 0 tokens", "less than a block"]),
    # sizes past what torch counts (a TypeError, a RuntimeError, a ValueError of torch's own, naming nothing)
    ({"kv_cache_memory_gb": 1e30}, ["kv_cache_memory_gb: 1e+30 GiB asks", "could not allocate"]),
    ({"kv_cache_tokens": 2**62}, [f"kv_cache_tokens: {2**62} asks for a KV pool", "could not allocate"]),
    ({"kv_cache_tokens": 256, "max_num_seqs": 2**63}, [f"max_num_seqs: {2**63} sequences' block tables cannot be "
                                                       "allocated on cpu; give a smaller max_num_seqs"]),
])
def test_kv_pool_that_cannot_be_made_names_the_knob(tiny_ouro, knobs, words):
    with pytest.raises(ValueError) as e:
        LLM(str(tiny_ouro), dtype="float32", **knobs)
    assert all(w in str(e.value) for w in words), str(e.value)


def test_kv_pool_sized_by_gpu_memory_utilization_names_it():
    """On CUDA gpu_memory_utilization gives kv_cache_memory_gb (`load_for_engine`): the errors name it."""
    with pytest.raises(ValueError, match=r"^gpu_memory_utilization: the 1e-07 GiB it leaves for the KV pool holds "
                                         r"0 tokens of KV \(1000 bytes a token\), less than a block"):
        EngineConfig(kv_cache_memory_gb=1e-7).kv_pool_tokens(1000, "gpu_memory_utilization")
    msg = str(EngineConfig(kv_cache_memory_gb=70.0).kv_pool_error(16, 2**30, "cuda:0", "gpu_memory_utilization"))
    assert msg.startswith("gpu_memory_utilization: the 70 GiB it leaves for the KV pool asks for a KV pool of 16 "
                          "tokens") and msg.endswith("give a smaller gpu_memory_utilization"), msg
    # kv_cache_tokens, when given, sized the pool whatever gave kv_cache_memory_gb
    msg = str(EngineConfig(kv_cache_tokens=64).kv_pool_error(64, 2**20, "cpu", "gpu_memory_utilization"))
    assert msg.startswith("kv_cache_tokens: 64 asks"), msg


def test_engine_kv_pool_errors_name_the_memory_knob_given(tiny_ouro):
    loaded = load_model(tiny_ouro, "float32", "cpu")
    with pytest.raises(ValueError, match="^gpu_memory_utilization: the 1e[+]09 GiB it leaves .* could not allocate"):
        LLMEngine(loaded.model, loaded.tokenizer, EngineConfig(kv_cache_memory_gb=1e9),
                  kv_memory_knob="gpu_memory_utilization")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_kv_pool_from_gpu_memory_utilization_names_it(tiny_ouro, monkeypatch):
    monkeypatch.setattr(load_config, "kv_memory_gb", lambda fraction, device: 1e-9)
    with pytest.raises(ValueError, match="^gpu_memory_utilization: the 1e-09 GiB it leaves for the KV pool holds 0"):
        LLM(str(tiny_ouro), dtype="float32", device="cuda", gpu_memory_utilization=0.5)


@pytest.mark.parametrize("error", [torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"),
                                   RuntimeError("DefaultCPUAllocator: can't allocate memory: you tried to allocate "
                                                "1024 bytes. Error code 12 (Cannot allocate memory)")])
def test_kv_pool_allocation_failure_names_the_knob(tiny_ouro, monkeypatch, error):
    def refuse(*args, **kwargs):
        raise error
    monkeypatch.setattr(engine_module, "KVStore", refuse)
    with pytest.raises(ValueError, match="^kv_cache_tokens: 512 asks for a KV pool .* could not allocate"):
        LLM(str(tiny_ouro), dtype="float32", kv_cache_tokens=512)


def test_kv_pool_other_runtime_error_is_not_called_an_allocation_failure(tiny_ouro, monkeypatch):
    """Only an allocator's refusal becomes "could not allocate"; any other error passes unchanged."""
    error = RuntimeError("some bug while making the pool")

    def fail(*args, **kwargs):
        raise error
    monkeypatch.setattr(engine_module, "KVStore", fail)
    with pytest.raises(RuntimeError) as e:
        LLM(str(tiny_ouro), dtype="float32", kv_cache_tokens=512)
    assert e.value is error


def test_cli_kv_pool_too_big_is_one_line(tiny_ouro, capsys):
    with pytest.raises(SystemExit) as exited:
        cli_main(["generate", "--model", str(tiny_ouro), "--dtype", "float32", "--max-tokens", "1",
                  "--kv-cache-memory-gb", "1e9", "hi"])
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("error: --kv-cache-memory-gb:") and err.count("\n") == 1, err


# ---------------- bool knobs take bools only
@pytest.mark.parametrize("config,name", [(EngineConfig, "enable_prefix_caching"), (EngineConfig, "lookahead"),
                                         (EngineConfig, "async_coda"), (LoadConfig, "enforce_eager")])
@pytest.mark.parametrize("value", ["false", 0, 1, [True]])
def test_bool_knobs_refuse_anything_but_a_bool(config, name, value):
    """The string "false" turned prefix caching on (a truthy value read as a setting): every bool field of the
    engine's and the load's configs takes True or False (None where it means unset) and nothing else."""
    with pytest.raises(ValueError, match=f"^{name}: must be true or false"):
        config(**{name: value})
    config(**{name: False})


def test_a_token_budget_below_the_chunk_size_lowers_the_chunk(caplog):
    """vLLM caps every step at max_num_batched_tokens: a budget below prefill_chunk_size lowers the chunk to it, said
    once in the log (the budget was raised to the chunk: 256 became 512, without a word); a larger one changes
    nothing."""
    with caplog.at_level("INFO", logger="loopserve.engine.config"):
        cfg = EngineConfig(max_num_batched_tokens=256)
    assert (cfg.max_num_batched_tokens, cfg.prefill_chunk_size) == (256, 256)
    assert [r.getMessage() for r in caplog.records] == [
        "prefill_chunk_size: lowered from 512 to max_num_batched_tokens (256), the most prompt tokens a step "
        "prefills"]
    caplog.clear()
    with caplog.at_level("INFO", logger="loopserve.engine.config"):
        assert dataclasses.replace(cfg, max_num_seqs=2).prefill_chunk_size == 256  # (not said again)
        cfg = EngineConfig(max_num_batched_tokens=4096, prefill_chunk_size=64)
    assert (cfg.max_num_batched_tokens, cfg.prefill_chunk_size) == (4096, 64) and not caplog.records
