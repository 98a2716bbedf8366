"""Bench models: random checkpoints (real HF layouts, via `make_tiny`) sized so that model compute,
not Python, dominates an engine tick on a small CPU.

| preset | arch | layers | hidden / FFN | vocab | r_max | F0 / Fr (matmul) |
|---|---|---|---|---|---|---|
| `ouro-bench` | Ouro, fully looped | 2 | 768 / 2048 | 2048 | 4 | 0.11 (real Ouro-1.4B: 0.08) |
| `huginn-bench` | Huginn sandwich | 2-4-2 | 512 / 1536 | 6656 | 16 | 1.2 (as Huginn-3.5B) |
| `micro-ouro`, `micro-huginn` | tests | 2 / 1-1-1 | 64 / 128 | 512 | 4 | - |
| `ouro-1.4b-shape` | Ouro-1.4B's shapes (`theory.OURO_1_4B`), for a lent GPU | 24 | 2048 / 5632 | 49152 | 4 | 0.08 |

`huginn-bench-0-4-0` and `huginn-bench-1-4-1` are the layer-split ablation (same core, smaller
boundary stages). Weights are random: these models measure speed, not quality. The bench default
dtype is bfloat16: on a CPU with AVX512-BF16 (the machine of most recorded runs) a bf16 core step at
batch 32 is about 1.4x faster than fp32 (see docs/benchmarks.md); on an AVX2-only CPU bf16 is emulated
and about 5x slower, so pass --dtype float32 there (the harness warns); never fp16 on CPU.
"""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path

from loopserve.model_config import OURO, ModelConfig
from loopserve_lab.bench.theory import OURO_1_4B
from loopserve_lab.tiny import TinySpec, hf_config, make_tiny, tiny_arch


def _shapes_of(c: ModelConfig) -> TinySpec:
    """Random weights in a released model's shapes: device step times at its real size (a 2.8 GB bf16
    checkpoint: meant for a lent GPU, where `scripts/gpu_check.sh` uses it), never quality."""
    ouro = c.arch == OURO
    return TinySpec(arch=tiny_arch(c.arch), hidden_size=c.hidden_size, num_heads=c.num_heads,
                    num_kv_heads=c.num_kv_heads if ouro else None, intermediate_size=c.intermediate_size,
                    vocab_size=c.vocab_size, layers=str(c.n_core) if ouro else f"{c.n_prelude}-{c.n_core}-{c.n_coda}",
                    r_max=c.r_max, max_position=8192, seed=0)


PRESETS: dict[str, TinySpec] = {
    "ouro-bench": TinySpec(arch="ouro", hidden_size=768, num_heads=12, intermediate_size=2048,
                           vocab_size=2048, layers="2", r_max=4, max_position=4096, seed=0),
    "huginn-bench": TinySpec(arch="huginn", hidden_size=512, num_heads=8, intermediate_size=1536,
                             vocab_size=6656, layers="2-4-2", r_max=16, max_position=4096, seed=0),
    "huginn-bench-1-4-1": TinySpec(arch="huginn", hidden_size=512, num_heads=8, intermediate_size=1536,
                                   vocab_size=6656, layers="1-4-1", r_max=16, max_position=4096, seed=0),
    "huginn-bench-0-4-0": TinySpec(arch="huginn", hidden_size=512, num_heads=8, intermediate_size=1536,
                                   vocab_size=6656, layers="0-4-0", r_max=16, max_position=4096, seed=0),
    "micro-ouro": TinySpec(arch="ouro", hidden_size=64, num_heads=4, intermediate_size=128, vocab_size=512,
                           layers="2", r_max=4, seed=0),
    "micro-huginn": TinySpec(arch="huginn", hidden_size=64, num_heads=4, intermediate_size=128, vocab_size=512,
                             layers="1-1-1", r_max=4, seed=0),
    "ouro-1.4b-shape": _shapes_of(OURO_1_4B),
}

DEFAULT_DTYPE = "bfloat16"


def cache_root() -> Path:
    return Path(os.environ.get("LOOPSERVE_BENCH_CACHE", Path.home() / ".cache" / "loopserve" / "bench"))


def preset_config(name: str) -> dict:
    """The HF config.json dict of a preset (no weights written)."""
    return hf_config(_spec(name))


def _spec(name: str) -> TinySpec:
    if name not in PRESETS:
        raise ValueError(f"unknown bench preset {name!r}; known: {', '.join(PRESETS)}")
    return PRESETS[name]


def ensure_preset(name: str, root: Path | None = None) -> Path:
    """The folder of preset `name`, written with `make_tiny` on first use (or when the spec changed)."""
    spec = _spec(name)
    out = (root or cache_root()) / name
    stamp = out / "bench_preset.json"
    want = dataclasses.asdict(spec)
    if stamp.is_file() and json.loads(stamp.read_text()) == want and (out / "config.json").is_file():
        return out
    make_tiny(out, spec)
    stamp.write_text(json.dumps(want, indent=2) + "\n")
    return out


def resolve_model(model: str | None, root: Path | None = None) -> Path:
    """A preset name or a checkpoint folder -> folder. None means `ouro-bench`."""
    model = model or "ouro-bench"
    if model in PRESETS:
        return ensure_preset(model, root)
    path = Path(model)
    if not (path / "config.json").is_file():
        raise ValueError(f"--model: {model!r} is neither a bench preset ({', '.join(PRESETS)}) "
                         "nor a folder with config.json")
    return path
