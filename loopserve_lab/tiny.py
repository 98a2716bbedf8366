"""`loopserve make-tiny`: random tiny checkpoints in the exact HF layouts of Ouro and Huginn.

Config keys, tensor names and shapes, and tokenizer files are those of the released checkpoints,
only smaller, so tests exercise the same loader path a real folder takes. Weights are scaled so
that logits and exit signals vary (a near-uniform model would make argmax ties and exits trivial).
The config's `auto_map` names only a configuration class, whose file (`hf_code/`) is written beside
it, so that `transformers.AutoConfig` reads the folder (with `trust_remote_code=True`).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from loopserve.model_config import HUGINN, HUGINN_HEAD_DIM, OURO, OURO_DERIVED_HEAD_DIM, ModelConfig
from loopserve.models.base import LoopedLM
from loopserve.models.loader import build_model
from loopserve.sampling_params import is_int
from loopserve_lab.tokenization.build import ARCHS, byte_level_tokenizer, role_token_ids, write_tokenizer_files

# The configuration class transformers loads for each architecture, as the released checkpoints name it
# (module, class); the module's file is in hf_code/. No model class: loopserve runs the model itself, and
# an auto_map entry for modeling code that is not shipped would make transformers fail on a missing file.
HF_CONFIG_CLASS = {OURO: ("configuration_ouro", "OuroConfig"), HUGINN: ("raven_config_minimal", "RavenConfig")}
HF_CODE_DIR = Path(__file__).parent / "hf_code"


# make-tiny's name of each architecture (`TinySpec.arch`, `--arch`; the tokenizer builder's `ARCHS`) -> the class
# its config.json names
TINY_ARCHS = dict(zip(ARCHS, (OURO, HUGINN), strict=True))
# `TinySpec.layers` and `r_max` of each architecture where make-tiny's flags leave them unset (TinySpec's own: Ouro's)
ARCH_DEFAULTS = {"ouro": ("2", 4), "huginn": ("2-2-2", 8)}


def tiny_arch(architecture: str) -> str:
    """make-tiny's name (`TINY_ARCHS`) of a config's architecture class, e.g. OuroForCausalLM -> "ouro"."""
    for name, cls in TINY_ARCHS.items():
        if cls == architecture:
            return name
    raise ValueError(f"arch: no tiny checkpoint of {architecture!r}; make-tiny builds "
                     f"{', '.join(TINY_ARCHS.values())}")


@dataclass
class TinySpec:
    arch: str = "ouro"  # a key of `TINY_ARCHS`
    hidden_size: int = 64
    num_heads: int = 4
    num_kv_heads: int | None = None  # Ouro only; < num_heads gives GQA
    intermediate_size: int = 128
    vocab_size: int = 512
    layers: str = ARCH_DEFAULTS["ouro"][0]  # Ouro: number of layers; Huginn: "prelude-core-coda", e.g. "2-4-2"
    r_max: int = ARCH_DEFAULTS["ouro"][1]
    max_position: int = 2048
    lookahead_gate: bool = False
    state_init: str = "like-init"  # Huginn: its config's `state_init` (model_config.STATE_INITS); the released value
    seed: int = 0


# The config.json keys each TinySpec field is written to, so that the loader's errors name the field (make-tiny's
# option of the same name) and the key
SPEC_FIELD_OF_KEY = {
    key: spec_field if key == spec_field else f"{spec_field} ({key})"
    for spec_field, keys in (
        ("hidden_size", ("hidden_size", "n_embd")), ("num_heads", ("num_attention_heads", "n_heads")),
        ("num_kv_heads", ("num_key_value_heads",)), ("intermediate_size", ("intermediate_size",)),
        ("vocab_size", ("vocab_size", "padded_vocab_size")),
        ("layers", ("num_hidden_layers", "n_layers_in_prelude", "n_layers_in_recurrent_block", "n_layers_in_coda")),
        ("r_max", ("total_ut_steps", "mean_recurrence")), ("state_init", ("state_init",)),
        ("hidden_size / num_heads", ("head_dim", OURO_DERIVED_HEAD_DIM, HUGINN_HEAD_DIM)),
    )
    for key in keys
}


def hf_config(spec: TinySpec) -> dict:
    """The config.json of `spec` (ValueError naming the spec field for a setting its architecture lacks; the values
    themselves are checked as the loader checks them, by `make_tiny`)."""
    head_dim = spec.hidden_size // max(spec.num_heads, 1)  # (0 heads: refused as the loader refuses it)
    if spec.arch not in TINY_ARCHS:
        raise ValueError(f"arch: expected one of {', '.join(map(repr, TINY_ARCHS))}, got {spec.arch!r}")
    if TINY_ARCHS[spec.arch] == OURO:
        try:
            n = int(spec.layers)
        except ValueError:
            n = 0
        if n < 1:
            raise ValueError(f"layers: Ouro takes a number of layers like '2', got {spec.layers!r} "
                             "('prelude-core-coda' like '2-4-2' is Huginn's)")
        if spec.state_init != TinySpec.state_init:
            raise ValueError(f"state_init: Huginn only (Ouro's loop starts from its prelude's output), got "
                             f"{spec.state_init!r}")
        return {
            "architectures": [OURO],
            "auto_map": _auto_map(OURO),
            "model_type": "ouro", "hidden_size": spec.hidden_size,
            "intermediate_size": spec.intermediate_size, "num_hidden_layers": n,
            "num_attention_heads": spec.num_heads,
            "num_key_value_heads": spec.num_kv_heads or spec.num_heads, "head_dim": head_dim,
            "vocab_size": spec.vocab_size, "hidden_act": "silu", "rope_theta": 10000.0,
            "rope_scaling": None, "rms_norm_eps": 1e-6, "max_position_embeddings": spec.max_position,
            "tie_word_embeddings": False, "total_ut_steps": spec.r_max, "early_exit_threshold": 1.0,
            "use_sliding_window": False, "sliding_window": None, "max_window_layers": n,
            "layer_types": ["full_attention"] * n, "initializer_range": 0.02, "attention_dropout": 0.0,
            "use_cache": True, "torch_dtype": "float32", **_special_ids(spec),
        }
    if spec.num_kv_heads not in (None, spec.num_heads):
        raise ValueError(f"num_kv_heads: Ouro only (Huginn's attention has no grouped-query attention), got "
                         f"{spec.num_kv_heads}")
    if spec.lookahead_gate:
        raise ValueError("lookahead_gate: Ouro only (Huginn has no learned exit gate)")
    try:
        p, c, d = (int(x) for x in spec.layers.split("-"))
    except ValueError:
        raise ValueError(f"layers: Huginn needs 'prelude-core-coda' like '2-4-2', got {spec.layers!r}") from None
    h = spec.hidden_size
    depth = max(p + c * spec.r_max + d, 1)  # (0 core layers or loops: refused as the loader refuses them)
    std = math.sqrt(2 / (5 * max(h, 1)))
    return {
        "architectures": [HUGINN],
        "auto_map": _auto_map(HUGINN),
        "model_type": "huginn_raven", "n_embd": h, "n_heads": spec.num_heads,
        "num_key_value_heads": spec.num_heads, "n_layers": p + c + d, "n_layers_in_prelude": p,
        "n_layers_in_recurrent_block": c, "n_layers_in_coda": d, "intermediate_size": spec.intermediate_size,
        "vocab_size": spec.vocab_size, "padded_vocab_size": spec.vocab_size, "padding_multiple": 4096,
        "block_size": spec.max_position, "rope_base": 50000, "norm_class_name": "RMSNorm_llama",
        "norm_eps": 1e-6, "block_class_name": "SandwichBlock", "mlp_class_name": "GatedMLP",
        "nonlin_name": "SiLU", "bias": False, "qk_bias": True, "tie_embeddings": True,
        "injection_type": "linear", "state_init": spec.state_init, "mean_recurrence": spec.r_max,
        "mean_backprop_depth": max(1, spec.r_max // 4), "sampling_scheme": "poisson-lognormal-filling",
        "init_strategy": "takase", "init_orthogonal": False, "activation_checkpoint_impl": "per-iteration",
        "architecture_class_name": "RecurrentGPT", "torch_dtype": "float32",
        "effective_expected_depth": depth,
        "init_values": {"std": std, "out_proj": std / math.sqrt(2 * depth), "embedding": std,
                        "embed_scale": math.sqrt(h)},
        **_special_ids(spec),
    }


def _special_ids(spec: TinySpec) -> dict[str, Any]:
    """config.json's bos, eos and pad ids: the tokenizer's (`tokenization.build.ROLE_TOKENS`)."""
    ids = role_token_ids(spec.arch, spec.vocab_size)
    return {f"{role}_token_id": ids[role] for role in ("bos", "eos", "pad")}


def write_generation_config(out: Path, arch: str, vocab_size: int) -> None:
    """generation_config.json as the released checkpoints have it: bos, pad, and every token that ends a reply."""
    ids = role_token_ids(arch, vocab_size)
    gen = {"bos_token_id": ids["bos"], "eos_token_id": ids["ends"], "pad_token_id": ids["pad"]}
    (out / "generation_config.json").write_text(json.dumps(gen, indent=2) + "\n")


def _auto_map(arch: str) -> dict[str, str]:
    module, cls = HF_CONFIG_CLASS[arch]
    return {"AutoConfig": f"{module}.{cls}"}


def write_hf_config(out: Path, raw: dict) -> None:
    """config.json, and the code file of each class its `auto_map` names (so that none dangles)."""
    (out / "config.json").write_text(json.dumps(raw, indent=2) + "\n")
    for ref in (raw.get("auto_map") or {}).values():
        module = ref.rsplit(".", 1)[0]
        shutil.copyfile(HF_CODE_DIR / f"{module}.py", out / f"{module}.py")


def _random_weights(model: LoopedLM, seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    out = {}
    for name, p in model.checkpoint_tensors().items():  # (the checkpoint's names: q, k, v apart)
        if name.endswith("norm.weight") or "norm_" in name or "layernorm" in name:
            t = 1 + 0.1 * torch.randn(p.shape, generator=g)
        elif "embed" in name or "wte" in name:
            t = torch.randn(p.shape, generator=g) * (0.3 if "wte" in name else 1.0)
        elif "gate" in name and "gate_proj" not in name:  # exit gates: spread-out hazards
            t = torch.randn(p.shape, generator=g) * (2.0 / math.sqrt(p.shape[-1]) if p.dim() > 1 else 0.5) - (
                0.5 if p.dim() == 1 else 0.0)
        elif name.endswith("qk_bias"):
            t = 0.1 * torch.randn(p.shape, generator=g)
        else:
            t = torch.randn(p.shape, generator=g) / math.sqrt(p.shape[-1])
        out[name] = t.float().contiguous()
    return out


def make_tiny(out: str | Path, spec: TinySpec, shards: int = 1) -> Path:
    """Write the checkpoint of `spec` to folder `out`. ValueError, before anything is written, for a spec or a
    shard count whose checkpoint the loader would refuse; OSError if `out` cannot be written."""
    out = Path(out)
    if not (is_int(shards) and shards >= 1):
        raise ValueError(f"shards: must be an integer >= 1, got {shards!r}")
    raw = hf_config(spec)
    config = ModelConfig.from_hf(raw, "make-tiny", SPEC_FIELD_OF_KEY)
    tokenizer = byte_level_tokenizer(spec.arch, spec.vocab_size)
    out.mkdir(parents=True, exist_ok=True)
    with torch.device("meta"):
        model = build_model(config, lookahead_gate=spec.lookahead_gate)
    tensors = _random_weights(model, spec.seed)
    if config.arch == HUGINN:  # the released file carries a duplicate head and the RoPE table
        tensors["lm_head.weight"] = tensors["transformer.wte.weight"].clone()
        hd = config.head_dim
        inv = 1.0 / (config.rope_theta ** (torch.arange(0, hd, 2, dtype=torch.float64) / hd))
        ang = torch.arange(config.max_position, dtype=torch.float64)[:, None] * inv[None]
        tensors["freqs_cis"] = torch.stack([ang.cos(), ang.sin()], -1)[None, :, None].float().contiguous()
    _save(tensors, out, shards)
    write_hf_config(out, raw)
    write_generation_config(out, spec.arch, spec.vocab_size)
    write_tokenizer_files(tokenizer, spec.arch, out, spec.max_position)
    return out


def _save(tensors: dict[str, torch.Tensor], out: Path, shards: int) -> None:
    if shards == 1:
        save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
        return
    names = sorted(tensors)
    weight_map, total = {}, 0
    for i in range(shards):
        part = names[i::shards]
        fname = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
        save_file({n: tensors[n] for n in part}, str(out / fname), metadata={"format": "pt"})
        for n in part:
            weight_map[n] = fname
            total += tensors[n].numel() * tensors[n].element_size()
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")


def register(sub: argparse._SubParsersAction) -> None:
    """`loopserve make-tiny`: a flag per TinySpec field, its default TinySpec's."""
    from loopserve.cli import HELP_FORMAT

    default = {f.name: f.default for f in dataclasses.fields(TinySpec)}
    arch_defaults = ", ".join(f"{arch} {layers}" for arch, (layers, _) in ARCH_DEFAULTS.items())
    arch_r_max = ", ".join(f"{arch} {r_max}" for arch, (_, r_max) in ARCH_DEFAULTS.items())
    p = sub.add_parser("make-tiny", help="write a random tiny Ouro or Huginn checkpoint (HF layout)",
                       formatter_class=HELP_FORMAT)
    p.add_argument("out", help="folder to write: a new or empty one")
    p.add_argument("--arch", default=default["arch"], choices=list(TINY_ARCHS), help="architecture")
    p.add_argument("--seed", type=int, default=default["seed"], help="seed of the random weights")
    p.add_argument("--hidden-size", type=int, default=default["hidden_size"], help="hidden size")
    p.add_argument("--num-heads", type=int, default=default["num_heads"], help="attention heads")
    p.add_argument("--num-kv-heads", type=int, default=default["num_kv_heads"],
                   help="Ouro: < num-heads for GQA (unset: num-heads)")
    p.add_argument("--intermediate-size", type=int, default=default["intermediate_size"], help="MLP width")
    p.add_argument("--vocab-size", type=int, default=default["vocab_size"], help="vocabulary size")
    p.add_argument("--layers", default=None, help="Ouro: a number of layers, e.g. 2; Huginn: prelude-core-coda, e.g. "
                                                  f"2-4-2 (unset: {arch_defaults})")
    p.add_argument("--r-max", type=int, default=None,
                   help=f"Ouro total_ut_steps / Huginn mean_recurrence (unset: {arch_r_max})")
    p.add_argument("--lookahead-gate", action="store_true", help="Ouro: add the distilled lookahead gate head")
    p.add_argument("--shards", type=int, default=1, help="safetensors files to split the weights into")
    p.set_defaults(func=cmd_make_tiny)


def cmd_make_tiny(args: argparse.Namespace) -> int:
    from loopserve.cli import CommandError

    out = Path(args.out)
    if out.exists() and not out.is_dir():
        raise CommandError(f"{out}: exists and is not a folder (make-tiny writes a checkpoint folder)")
    if out.is_dir() and any(out.iterdir()):
        # (another checkpoint's files left beside the new ones, say Ouro's beside Huginn's, would make a folder
        # that loads as neither)
        raise CommandError(f"{out}: the folder is not empty; give a new or empty folder")
    layers, r_max = ARCH_DEFAULTS[args.arch]
    spec = TinySpec(arch=args.arch, hidden_size=args.hidden_size, num_heads=args.num_heads,
                    num_kv_heads=args.num_kv_heads, intermediate_size=args.intermediate_size,
                    vocab_size=args.vocab_size, layers=args.layers or layers,
                    r_max=args.r_max if args.r_max is not None else r_max, lookahead_gate=args.lookahead_gate,
                    seed=args.seed)
    try:
        out = make_tiny(out, spec, shards=args.shards)
    except ValueError as e:
        raise CommandError(str(e)) from None
    except OSError as e:  # (a folder that cannot be made or written: /proc/x, read-only, disk full)
        raise CommandError(f"{out}: cannot write the checkpoint there ({e.strerror or e})") from None
    print(f"wrote {args.arch} tiny checkpoint to {out}")
    return 0
