"""Back-of-envelope theory for looped LMs: FLOPs per stage, the adaptive-depth speed-up bound,
KV bytes per token per cache layout, and a simple roofline for one step of a stage (a core step, prelude, coda).

This module owns the cost model (parameter and FLOP counting conventions, the bound, the roofline)
and nothing about the model itself: the model's shape is the engine's `ModelConfig`
(`loopserve/model_config.py`, read from an HF ``config.json`` dict, no weights loaded), KV slots and
bytes per token are the engine's `KVLayout` (`loopserve/cache/layout.py`), and dtype sizes are
torch's. It is the library behind ``loopserve bench theory``.

Conventions
-----------
* A looped LM runs three stages per token (docs/design.md §2.1): prelude -> r core steps -> coda.
  ``F0`` = FLOPs of prelude + coda (paid once per token), ``Fr`` = FLOPs of one core step.
* FLOPs count 2 per multiply-add. Two counting conventions are offered:

  - ``"matmul"``: only weight matrices of linear layers (projections, MLP, adapter, exit gate,
    LM head). Norm weights and biases are elementwise work and are not counted; the embedding is
    a table lookup and costs 0.
  - ``"params"``: 2 x every parameter the stage touches (norm weights and biases included), the
    convention of the CDB paper's parameter-count bound. The embedding table is still not counted
    (a lookup touches one row and does no multiply-add); a tied LM head is counted in the coda.

  Both add an attention term when ``context > 0``: per attention layer application, QK^T and AV
  cost ``2 * 2 * n_heads * head_dim * context`` FLOPs for a query that sees ``context`` keys.
  ``context = 0`` (the default) is weights only.
* Stage boundaries. Ouro: prelude = embedding (0 FLOPs); core step = all L layers + ``model.norm``
  + the exit gate ``Linear(H, 1)`` (both run after every loop step); coda = ``lm_head``.
  Huginn: prelude = 2 sandwich blocks; core step = adapter ``Linear(2h, h)`` + 4 blocks;
  coda = ``ln_f`` + 2 blocks + ``lm_head`` (tied to the embedding).
* Speed-up bound of adaptive depth over full depth at mean exit depth ``d`` (docs/design.md §7.1):
  ``(F0 + r_max * Fr) / (F0 + d * Fr)``.
* KV layouts (docs/design.md §4.1): `KVLayout.slots_per_token` and `KVLayout.bytes_per_token`, at
  the ``r_max`` asked for.
"""

from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass
from typing import Any

import torch

from loopserve.cache.layout import LAYOUTS, KVLayout
from loopserve.model_config import HUGINN, OURO, ModelConfig
from loopserve_lab.tiny import tiny_arch

__all__ = [
    "LAYOUTS",
    "ROOFLINE_DEVICES",
    "H100_SXM",
    "H200",
    "HUGINN_0125",
    "OURO_1_4B",
    "Device",
    "ParamCounts",
    "StageFlops",
    "STAGES",
    "StepTimeEstimate",
    "attention_flops_per_layer",
    "bytes_per_element",
    "step_time_estimate",
    "cpu_probe",
    "flop_bound",
    "format_report",
    "get_device",
    "kv_bytes_per_token",
    "kv_read_bytes_per_token_step",
    "model_config",
    "param_counts",
    "realized_fraction",
    "stage_flops",
    "theory_report",
]

# Published configs (config.json of ByteDance/Ouro-1.4B and tomg-group-umd/huginn-0125), for the
# theory of the real models and the device-idle projection of `bench host`.
OURO_1_4B = ModelConfig.from_hf({
    "architectures": [OURO],
    "model_type": "ouro",
    "hidden_size": 2048,
    "intermediate_size": 5632,
    "num_hidden_layers": 24,
    "num_attention_heads": 16,
    "num_key_value_heads": 16,
    "head_dim": 128,
    "vocab_size": 49152,
    "total_ut_steps": 4,
    "tie_word_embeddings": False,
    "hidden_act": "silu",
    "rms_norm_eps": 1e-6,
    "rope_theta": 1000000.0,
}, "Ouro-1.4B")

HUGINN_0125 = ModelConfig.from_hf({
    "architectures": [HUGINN],
    "model_type": "huginn_raven",
    "n_embd": 5280,
    "n_heads": 55,
    "n_layers": 8,
    "n_layers_in_prelude": 2,
    "n_layers_in_recurrent_block": 4,
    "n_layers_in_coda": 2,
    "intermediate_size": 17920,
    "vocab_size": 65536,
    "padded_vocab_size": 65536,
    "mean_recurrence": 32,
    "qk_bias": True,
    "bias": False,
    "tie_embeddings": True,
}, "huginn-0125")

# Short names the CLI accepts besides torch's own dtype names (float32, bfloat16, half, int8, ...)
_DTYPE_ALIASES = {"fp64": "float64", "fp32": "float32", "bf16": "bfloat16", "fp16": "float16", "fp8": "float8_e4m3fn"}


def torch_dtype(dtype: str | torch.dtype) -> torch.dtype:
    """A torch dtype from itself or a name: torch's ("bfloat16", "torch.float16", "half") or a short
    one ("bf16", "fp32", "fp8")."""
    if isinstance(dtype, torch.dtype):
        return dtype
    name = str(dtype).lower().removeprefix("torch.")
    found = getattr(torch, _DTYPE_ALIASES.get(name, name), None)
    if not isinstance(found, torch.dtype):
        raise ValueError(f"unknown dtype {dtype!r}; use a torch dtype name or one of {sorted(_DTYPE_ALIASES)}")
    return found


def bytes_per_element(dtype: str | torch.dtype) -> int:
    """Bytes per element of ``dtype`` (see :func:`torch_dtype`)."""
    return torch_dtype(dtype).itemsize


# --------------------------------------------------------------------------------------------
# Model
# --------------------------------------------------------------------------------------------


def model_config(config: dict[str, Any] | ModelConfig) -> ModelConfig:
    """The engine's view of a model: an HF ``config.json`` dict of Ouro or Huginn, or a `ModelConfig`."""
    return config if isinstance(config, ModelConfig) else ModelConfig.from_hf(config)


def _has_qk_bias(c: ModelConfig) -> bool:
    return c.arch == HUGINN  # Huginn's attention adds a learned bias to q and k (models/huginn.py)


def _r_max(c: ModelConfig, r_max: int | None) -> int:
    r = c.r_max if r_max is None else int(r_max)
    if r < 1:
        raise ValueError(f"r_max must be >= 1, got {r}")
    return r


def _model_summary(c: ModelConfig) -> dict[str, Any]:
    """The report's ``model`` block (its key names are those of earlier ``theory.json`` files)."""
    return {
        "arch": tiny_arch(c.arch),
        "architecture": c.arch,
        "hidden": c.hidden_size,
        "intermediate": c.intermediate_size,
        "n_heads": c.num_heads,
        "n_kv_heads": c.num_kv_heads,
        "head_dim": c.head_dim,
        "vocab": c.vocab_size,
        "n_prelude": c.n_prelude,
        "n_core": c.n_core,
        "n_coda": c.n_coda,
        "r_default": c.r_max,
        "tied": c.tie_embeddings,
        "qk_bias": _has_qk_bias(c),
    }


# --------------------------------------------------------------------------------------------
# Parameters and FLOPs
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ParamCounts:
    """Parameter counts. ``prelude``/``core_step``/``coda`` are the params each stage touches per
    token (embedding lookup excluded, a tied LM head counted in the coda); ``total`` is the number
    of unique parameters in the checkpoint (a tied head counted once)."""

    block: int  # one transformer block, norms and biases included
    block_matmul: int  # the linear-layer weights of one block
    embedding: int
    lm_head: int  # V x h; shares storage with the embedding when tied
    prelude: int
    core_step: int
    coda: int
    total: int


def _block_matmul(c: ModelConfig) -> int:
    attn = c.hidden_size * c.head_dim * (2 * c.num_heads + 2 * c.num_kv_heads)  # q, o + k, v
    mlp = 3 * c.hidden_size * c.intermediate_size  # gate, up, down
    return attn + mlp


def _block_params(c: ModelConfig) -> int:
    norms = 4 * c.hidden_size  # both architectures use 4 RMSNorms per block ("sandwich")
    bias = (c.num_heads + c.num_kv_heads) * c.head_dim if _has_qk_bias(c) else 0
    return _block_matmul(c) + norms + bias


def _core_extra_matmul(c: ModelConfig) -> int:
    if c.arch == OURO:
        return c.hidden_size  # exit gate Linear(H, 1) weight
    return 2 * c.hidden_size * c.hidden_size  # adapter Linear(2h, h), no bias


def _core_extra_params(c: ModelConfig) -> int:
    if c.arch == OURO:
        return c.hidden_size + (c.hidden_size + 1)  # model.norm + exit gate (weight + bias)
    return 2 * c.hidden_size * c.hidden_size


def param_counts(config: dict[str, Any] | ModelConfig) -> ParamCounts:
    """Parameter counts per block, per stage and in total (see :class:`ParamCounts`)."""
    c = model_config(config)
    block = _block_params(c)
    head = c.vocab_size * c.hidden_size
    prelude = c.n_prelude * block
    core = c.n_core * block + _core_extra_params(c)
    coda_norm = c.hidden_size if c.arch == HUGINN else 0  # Huginn ln_f; Ouro's norm is in the core
    coda = c.n_coda * block + coda_norm + head
    total = head + prelude + core + coda - (head if c.tie_embeddings else 0)
    return ParamCounts(
        block=block,
        block_matmul=_block_matmul(c),
        embedding=head,
        lm_head=head,
        prelude=prelude,
        core_step=core,
        coda=coda,
        total=total,
    )


def attention_flops_per_layer(config: dict[str, Any] | ModelConfig, context: int) -> int:
    """QK^T + AV FLOPs of one attention layer for one query over ``context`` keys."""
    c = model_config(config)
    if context < 0:
        raise ValueError(f"context must be >= 0, got {context}")
    return 2 * 2 * c.num_heads * c.head_dim * int(context)


@dataclass(frozen=True)
class StageFlops:
    """Per-token FLOPs of each stage. ``F0`` = prelude + coda, ``Fr`` = one core step."""

    prelude: int
    core_step: int
    coda: int
    context: int = 0
    count: str = "matmul"  # "matmul" or "params"

    @property
    def F0(self) -> int:
        return self.prelude + self.coda

    @property
    def Fr(self) -> int:
        return self.core_step

    def as_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["F0"] = self.F0
        d["Fr"] = self.Fr
        d["F0_over_Fr"] = self.F0 / self.Fr if self.Fr else None
        return d


def stage_flops(config: dict[str, Any] | ModelConfig, context: int = 0, count: str = "matmul") -> StageFlops:
    """Per-token FLOPs of prelude, one core step and coda.

    ``count="matmul"`` counts linear-layer weights only; ``count="params"`` is 2 x params touched
    (see the module docstring). ``context`` adds the attention term of every attention layer
    applied in the stage.
    """
    c = model_config(config)
    attn = attention_flops_per_layer(c, context)
    if count == "matmul":
        block = _block_matmul(c)
        core_extra = _core_extra_matmul(c)
        coda_extra = c.vocab_size * c.hidden_size
    elif count == "params":
        p = param_counts(c)
        block = p.block
        core_extra = p.core_step - c.n_core * p.block
        coda_extra = p.coda - c.n_coda * p.block
    else:
        raise ValueError(f"count must be 'matmul' or 'params', got {count!r}")
    return StageFlops(
        prelude=c.n_prelude * (2 * block + attn),
        core_step=c.n_core * (2 * block + attn) + 2 * core_extra,
        coda=c.n_coda * (2 * block + attn) + 2 * coda_extra,
        context=int(context),
        count=count,
    )


def flop_bound(f0: float, fr: float, r_max: float, mean_depth: float) -> float:
    """Theoretical speed-up of adaptive depth over full depth: (F0 + r_max Fr) / (F0 + d Fr)."""
    if f0 < 0 or fr < 0:
        raise ValueError("F0 and Fr must be >= 0")
    if r_max <= 0:
        raise ValueError(f"r_max must be > 0, got {r_max}")
    if not 0 <= mean_depth <= r_max:
        raise ValueError(f"mean_depth must be in [0, r_max={r_max}], got {mean_depth}")
    denom = f0 + mean_depth * fr
    if denom <= 0:
        raise ValueError("F0 + mean_depth * Fr must be > 0")
    return (f0 + r_max * fr) / denom


def realized_fraction(measured_speedup: float, bound: float) -> float:
    """Fraction of the theoretical speed-up actually achieved: measured / bound."""
    if bound <= 0:
        raise ValueError(f"bound must be > 0, got {bound}")
    if measured_speedup < 0:
        raise ValueError(f"measured_speedup must be >= 0, got {measured_speedup}")
    return measured_speedup / bound


# --------------------------------------------------------------------------------------------
# KV cache memory
# --------------------------------------------------------------------------------------------


def _kv_layout(c: ModelConfig, layout: str, r_max: int) -> KVLayout:
    return KVLayout(layout, c.n_prelude, c.n_core, c.n_coda, r_max)


def kv_bytes_per_token(
    config: dict[str, Any] | ModelConfig,
    layout: str,
    r_max: int | None = None,
    dtype: str | torch.dtype = "bfloat16",
) -> int:
    """KV bytes stored per token under ``layout`` (``depth_indexed``, ``last_exited``, ``shared``):
    the engine's `KVLayout.bytes_per_token` at ``r_max`` (default: the config's loop count)."""
    c = model_config(config)
    return _kv_layout(c, layout, _r_max(c, r_max)).bytes_per_token(c.num_kv_heads, c.head_dim, torch_dtype(dtype))


STAGES = ("prelude", "core", "coda")


def kv_read_bytes_per_token_step(config: dict[str, Any] | ModelConfig, dtype: str | torch.dtype = "bfloat16",
                                 stage: str = "core") -> int:
    """KV bytes one query reads per earlier token in one application of `stage` (a core step, the
    prelude or the coda), whatever the layout: one slot per layer of the stage (in the core, the read
    rule `KVLayout.core_read` picks one per layer), the size of that stage in a `shared` layout."""
    c = model_config(config)
    if stage not in STAGES:
        raise ValueError(f"stage must be one of {STAGES}, got {stage!r}")
    layers = {"prelude": (c.n_prelude, 0, 0), "core": (0, c.n_core, 0), "coda": (0, 0, c.n_coda)}[stage]
    return KVLayout("shared", *layers, 1).bytes_per_token(c.num_kv_heads, c.head_dim, torch_dtype(dtype))


# --------------------------------------------------------------------------------------------
# Roofline
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Device:
    """A device for the roofline: peak FLOP/s and memory bandwidth in bytes/s."""

    name: str
    peak_flops: float
    mem_bw: float

    @property
    def ridge(self) -> float:
        """FLOPs per byte at which compute time equals memory time."""
        return self.peak_flops / self.mem_bw


H100_SXM = Device("H100 SXM", 989e12, 3.35e12)  # dense BF16 peak, HBM3
H200 = Device("H200", 989e12, 4.8e12)  # dense BF16 peak, HBM3e
ROOFLINE_DEVICES: dict[str, Device] = {"h100": H100_SXM, "h100-sxm": H100_SXM, "h200": H200}


def cpu_probe(seconds: float = 1.0, matmul_size: int = 1024, copy_mib: int = 256) -> Device:
    """Measure this machine: fp32 matmul FLOP/s (``torch.matmul`` on square matrices) for half of
    ``seconds``, and a stream-like bandwidth (copy of a ``copy_mib`` MiB fp32 tensor, bytes read +
    written / time) for the other half. Returns ``Device("this CPU", ...)``."""
    budget = max(float(seconds), 1e-3) / 2
    n = int(matmul_size)
    a = torch.randn(n, n, dtype=torch.float32)
    b = torch.randn(n, n, dtype=torch.float32)
    out = torch.empty(n, n, dtype=torch.float32)
    torch.matmul(a, b, out=out)  # warm-up
    count, t0 = 0, time.perf_counter()
    while True:
        torch.matmul(a, b, out=out)
        count += 1
        elapsed = time.perf_counter() - t0
        if elapsed >= budget:
            break
    flops = 2.0 * n**3 * count / elapsed
    del a, b, out

    numel = max(int(copy_mib) * 2**20 // 4, 1)
    src = torch.ones(numel, dtype=torch.float32)
    dst = torch.empty_like(src)
    dst.copy_(src)  # warm-up, also faults the pages in
    count, t0 = 0, time.perf_counter()
    while True:
        dst.copy_(src)
        count += 1
        elapsed = time.perf_counter() - t0
        if elapsed >= budget:
            break
    bw = 2.0 * src.numel() * src.element_size() * count / elapsed
    return Device("this CPU", flops, bw)


def get_device(name: str | Device) -> Device:
    """A :class:`Device` from a preset name (``h100``, ``h200``) or ``cpu`` (runs :func:`cpu_probe`)."""
    if isinstance(name, Device):
        return name
    key = name.lower()
    if key in ("cpu", "this-cpu"):
        return cpu_probe()
    if key not in ROOFLINE_DEVICES:
        raise ValueError(f"unknown device {name!r}; known: {sorted(ROOFLINE_DEVICES)} or 'cpu'")
    return ROOFLINE_DEVICES[key]


@dataclass(frozen=True)
class StepTimeEstimate:
    """Roofline estimate of one step of a stage (by default a core step) for ``batch`` rows, each
    attending to ``context`` keys.

    Two idealisations share the same three ingredients:

    * ``floor_s`` = the stage's weight bytes / bandwidth (weights are read once per step, any batch);
    * ``row_compute_s`` = (the stage's FLOPs, e.g. Fr, + attention at ``context``) / peak FLOP/s per row;
    * ``row_kv_s`` = ``context`` x KV bytes per token per step / bandwidth per row.

    Max model: ``time_s = max(batch * row_compute_s, floor_s + batch * row_kv_s)``.
    ``b_star_weights`` = floor_s / row_compute_s is the batch where compute equals the weight read.
    Linear model (what a fit of measured step latency gives): t(B) = floor + slope * B with
    ``slope_s = row_compute_s + row_kv_s``; ``b_star_linear`` = floor / slope (<= b_star_weights).
    """

    device: str
    batch: int
    context: int
    dtype: str
    weight_bytes: int
    kv_bytes_per_row: int
    compute_s: float
    memory_s: float
    time_s: float
    limited_by: str  # "compute" or "memory"
    floor_s: float
    row_compute_s: float
    row_kv_s: float
    slope_s: float
    b_star_weights: float
    b_star_linear: float
    stage: str = "core"

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def step_time_estimate(
    config: dict[str, Any] | ModelConfig,
    device: Device,
    batch: int,
    context: int = 0,
    dtype: str | torch.dtype = "bfloat16",
    stage: str = "core",
) -> StepTimeEstimate:
    """Roofline time of one step of `stage` (see :class:`StepTimeEstimate`). Compute uses the matmul
    FLOPs of the stage plus attention at ``context`` in each of its layers; memory uses the parameters
    the stage touches (norms included; Ouro's prelude, an embedding lookup, reads none) at ``dtype``
    and one KV slot per layer of the stage per earlier token."""
    if batch < 0:
        raise ValueError(f"batch must be >= 0, got {batch}")
    c = model_config(config)
    bpe = bytes_per_element(dtype)
    kv_row = int(context) * kv_read_bytes_per_token_step(c, dtype, stage)
    params, flops = param_counts(c), stage_flops(c, context=context, count="matmul")
    weight_bytes = {"prelude": params.prelude, "core": params.core_step, "coda": params.coda}[stage] * bpe
    row_flops = {"prelude": flops.prelude, "core": flops.core_step, "coda": flops.coda}[stage]
    floor = weight_bytes / device.mem_bw
    row_compute = row_flops / device.peak_flops
    row_kv = kv_row / device.mem_bw
    compute = batch * row_compute
    memory = floor + batch * row_kv
    slope = row_compute + row_kv
    return StepTimeEstimate(
        device=device.name,
        batch=int(batch),
        context=int(context),
        dtype=str(dtype),
        weight_bytes=weight_bytes,
        kv_bytes_per_row=kv_row,
        compute_s=compute,
        memory_s=memory,
        time_s=max(compute, memory),
        limited_by="compute" if compute > memory else "memory",
        floor_s=floor,
        row_compute_s=row_compute,
        row_kv_s=row_kv,
        slope_s=slope,
        b_star_weights=floor / row_compute if row_compute > 0 else math.inf,
        b_star_linear=floor / slope if slope > 0 else math.inf,
        stage=stage,
    )


# --------------------------------------------------------------------------------------------
# Report
# --------------------------------------------------------------------------------------------

REPORT_BATCHES: tuple[int, ...] = (1, 8, 32, 64, 128, 256, 512)


def _finite(x: float) -> float | None:
    return x if math.isfinite(x) else None


def theory_report(
    config: dict[str, Any] | ModelConfig,
    mean_depth: float,
    r_max: int | None = None,
    context: int = 0,
    device: Device | str | None = None,
    dtype: str | torch.dtype = "bfloat16",
    batches: tuple[int, ...] = REPORT_BATCHES,
) -> dict[str, Any]:
    """Everything above for one model, as a JSON-serialisable dict (infinities become ``None``)."""
    c = model_config(config)
    r = _r_max(c, r_max)
    if not 0 < mean_depth <= r:  # (every token runs a loop at least; the command's --mean-depth is > 0 too)
        raise ValueError(f"mean_depth must be in (0, r_max={r}], got {mean_depth}")
    flops = {k: stage_flops(c, context=context, count=k) for k in ("matmul", "params")}
    bounds: dict[str, float | None] = {k: flop_bound(f.F0, f.Fr, r, mean_depth) for k, f in flops.items()}
    bounds["no_boundary"] = r / mean_depth if mean_depth > 0 else None  # the F0 = 0 limit
    report: dict[str, Any] = {
        "model": _model_summary(c),
        "r_max": r,
        "mean_depth": float(mean_depth),
        "context": int(context),
        "dtype": str(dtype),
        "params": asdict(param_counts(c)),
        "flops": {c: f.as_dict() for c, f in flops.items()},
        "bound": bounds,
        "kv_bytes_per_token": {lay: kv_bytes_per_token(c, lay, r, dtype) for lay in LAYOUTS},
        "kv_read_bytes_per_token_step": kv_read_bytes_per_token_step(c, dtype),
        "roofline": None,
    }
    if device is not None:
        dev = get_device(device)
        base = step_time_estimate(c, dev, 1, context, dtype)
        rows = []
        for b in batches:
            est = step_time_estimate(c, dev, b, context, dtype)
            rows.append(
                {
                    "batch": b,
                    "time_s": est.time_s,
                    "compute_s": est.compute_s,
                    "memory_s": est.memory_s,
                    "limited_by": est.limited_by,
                    "core_steps_per_s": b / est.time_s if est.time_s > 0 else None,
                }
            )
        report["roofline"] = {
            "device": {**asdict(dev), "ridge": dev.ridge},
            "weight_bytes": base.weight_bytes,
            "kv_bytes_per_row": base.kv_bytes_per_row,
            "floor_s": base.floor_s,
            "row_compute_s": base.row_compute_s,
            "row_kv_s": base.row_kv_s,
            "slope_s": base.slope_s,
            "b_star_weights": _finite(base.b_star_weights),
            "b_star_linear": _finite(base.b_star_linear),
            "batches": rows,
        }
    return report


def _ms(x: float) -> str:
    return f"{x * 1e3:.4f} ms"


def format_report(report: dict[str, Any]) -> str:
    """Render :func:`theory_report`'s dict as a plain-text table for the CLI."""
    m = report["model"]
    p = report["params"]
    fm, fp = report["flops"]["matmul"], report["flops"]["params"]
    r, d = report["r_max"], report["mean_depth"]
    out: list[str] = []
    add = out.append
    add(f"{m['architecture']} ({m['arch']})")
    add(
        f"  hidden {m['hidden']}, intermediate {m['intermediate']}, heads {m['n_heads']} "
        f"(kv {m['n_kv_heads']}) x {m['head_dim']}, vocab {m['vocab']}"
    )
    add(
        f"  blocks prelude {m['n_prelude']} | core {m['n_core']} | coda {m['n_coda']}; "
        f"r_max {r} (config default {m['r_default']}); tied head: {'yes' if m['tied'] else 'no'}"
    )
    add("")
    add("Parameters")
    for key, label in (
        ("total", "total (unique)"),
        ("block", "one block"),
        ("embedding", "embedding"),
        ("prelude", "prelude (touched)"),
        ("core_step", "core step (touched)"),
        ("coda", "coda incl. head (touched)"),
    ):
        add(f"  {label:<28}{p[key]:>18,}")
    add("")
    title = f"FLOPs per token (context {report['context']})"
    add(f"{title:<30}{'matmul':>18}{'2 x params':>18}")
    for key, label in (
        ("prelude", "prelude"),
        ("core_step", "core step = Fr"),
        ("coda", "coda"),
        ("F0", "F0 = prelude + coda"),
    ):
        add(f"  {label:<28}{fm[key]:>18,}{fp[key]:>18,}")
    ratio_m = fm["F0_over_Fr"]
    ratio_p = fp["F0_over_Fr"]
    add(
        f"  {'F0 / Fr':<28}{(f'{ratio_m:.4f}' if ratio_m is not None else '-'):>18}"
        f"{(f'{ratio_p:.4f}' if ratio_p is not None else '-'):>18}"
    )
    add("")
    b = report["bound"]
    add(f"Speed-up bound at mean depth {d:g} of r_max {r}: (F0 + r_max Fr) / (F0 + d Fr)")
    add(f"  {'matmul':<28}{b['matmul']:>17.4f}x")
    add(f"  {'2 x params':<28}{b['params']:>17.4f}x")
    if b["no_boundary"] is not None:
        add(f"  {'r_max / d (F0 = 0 limit)':<28}{b['no_boundary']:>17.4f}x")
    add("")
    add(f"KV bytes per token ({report['dtype']}, r_max {r})")
    for lay, nbytes in report["kv_bytes_per_token"].items():
        add(f"  {lay:<28}{nbytes:>18,}")
    add(f"  {'read per token per step':<28}{report['kv_read_bytes_per_token_step']:>18,}")
    roof = report["roofline"]
    if roof is not None:
        dev = roof["device"]
        add("")
        add(
            f"Roofline of one core step on {dev['name']} ({dev['peak_flops'] / 1e12:.4g} TFLOP/s, "
            f"{dev['mem_bw'] / 1e9:.4g} GB/s, ridge {dev['ridge']:.1f} FLOP/B), context {report['context']}"
        )
        add(f"  {'floor (weight read)':<28}{_ms(roof['floor_s']):>18}")
        add(f"  {'per row: compute':<28}{_ms(roof['row_compute_s']):>18}")
        add(f"  {'per row: KV read':<28}{_ms(roof['row_kv_s']):>18}")
        bw, bl = roof["b_star_weights"], roof["b_star_linear"]
        add(f"  {'B* compute = weight read':<28}{(f'{bw:.1f}' if bw is not None else 'inf'):>18}")
        add(f"  {'B* floor / slope':<28}{(f'{bl:.1f}' if bl is not None else 'inf'):>18}")
        add(f"  {'batch':>8}{'time/step':>16}{'steps*rows/s':>16}  limited by")
        for row in roof["batches"]:
            rate = row["core_steps_per_s"]
            add(
                f"  {row['batch']:>8}{_ms(row['time_s']):>16}"
                f"{(f'{rate:,.0f}' if rate is not None else '-'):>16}  {row['limited_by']}"
            )
    return "\n".join(out)
