"""Tests for loopserve_lab.bench.theory against hand-computed numbers for the real configs.

Expected values are written as arithmetic on the config numbers, never by calling the code under
test. One test (`test_reports_equal_pinned_outputs`) is a regression pin instead: `bench theory`
reports recorded before the theory was moved onto `ModelConfig` and `KVLayout` must not change.
"""

from __future__ import annotations

import dataclasses
import json
import math
from fractions import Fraction
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from loopserve_lab.bench.theory import (
    H100_SXM,
    H200,
    LAYOUTS,
    ROOFLINE_DEVICES,
    Device,
    StageFlops,
    bytes_per_element,
    cpu_probe,
    flop_bound,
    format_report,
    kv_bytes_per_token,
    kv_read_bytes_per_token_step,
    model_config,
    param_counts,
    realized_fraction,
    stage_flops,
    step_time_estimate,
    theory_report,
)
from loopserve_lab.bench.theory import HUGINN_0125 as HUGINN_35B
from loopserve_lab.bench.theory import OURO_1_4B as OURO_14B

# ---- Ouro-1.4B by hand: H=2048, I=5632, L=24, 16 heads (16 kv) x 128, V=49152, T=4, untied ----
O_H, O_I, O_L, O_V = 2048, 5632, 24, 49152
# q, k, v, o are each 2048 x (16*128 = 2048); gate, up, down are 2048 x 5632
O_BLOCK_MATMUL = 4 * 2048 * 2048 + 3 * 2048 * 5632  # 16,777,216 + 34,603,008
O_BLOCK = O_BLOCK_MATMUL + 4 * 2048  # + 4 RMSNorms
O_TOTAL = 2 * 49152 * 2048 + 24 * O_BLOCK + 2048 + (2048 + 1)  # emb + head + layers + norm + gate
O_F0 = 2 * 49152 * 2048  # lm_head only
O_FR = 2 * (24 * O_BLOCK_MATMUL + 2048)  # 24 layers + exit gate Linear(2048, 1)
O_FR_PARAMS = 2 * (24 * O_BLOCK + 2048 + 2048 + 1)  # + model.norm + gate weight and bias

# ---- Huginn-3.5B by hand: h=5280, 55 heads x 96, 2-4-2 blocks, I=17920, V=65536, tied ----
H_H, H_I, H_V = 5280, 17920, 65536
H_BLOCK_MATMUL = 3 * 5280 * 5280 + 5280 * 5280 + 2 * 17920 * 5280 + 5280 * 17920  # Wqkv proj fc proj
H_BLOCK = H_BLOCK_MATMUL + 4 * 5280 + 2 * 55 * 96  # + 4 norms + qk_bias (2, 1, 55, 96)
H_ADAPTER = 2 * 5280 * 5280  # Linear(10560 -> 5280)
H_PRELUDE = 2 * (2 * H_BLOCK_MATMUL)
H_FR = 2 * (H_ADAPTER + 4 * H_BLOCK_MATMUL)
H_CODA = 2 * (2 * H_BLOCK_MATMUL + 65536 * 5280)
H_F0 = H_PRELUDE + H_CODA
H_TOTAL = 65536 * 5280 + 8 * H_BLOCK + H_ADAPTER + 5280  # wte (tied head) + blocks + adapter + ln_f


def test_hand_constants_match_literal_numbers():
    # pin the hand arithmetic to literal numbers, so that a slip in the expressions above shows
    assert O_BLOCK == 51_388_416
    assert O_TOTAL == 1_434_652_673
    assert H_BLOCK == 395_398_080
    assert H_TOTAL == 3_564_976_800


# ------------------------------------------------------------------ shapes and parameter counts


def test_ouro_shape():
    c = model_config(OURO_14B)
    assert (c.arch, c.hidden_size, c.n_core, c.n_prelude, c.n_coda) == ("OuroForCausalLM", 2048, 24, 0, 0)
    assert (c.num_heads, c.num_kv_heads, c.head_dim, c.r_max, c.tie_embeddings) == (16, 16, 128, 4, False)


def test_ouro_head_dim_defaults_to_hidden_over_heads():
    cfg = {k: v for k, v in OURO_14B.raw.items() if k != "head_dim"}
    assert model_config(cfg).head_dim == 2048 // 16


def test_huginn_shape():
    c = model_config(HUGINN_35B)
    assert (c.arch, c.hidden_size, c.num_heads, c.num_kv_heads, c.head_dim) == ("RavenForCausalLM", 5280, 55, 55, 96)
    assert (c.n_prelude, c.n_core, c.n_coda, c.r_max, c.tie_embeddings) == (2, 4, 2, 32, True)


def test_unknown_architecture_rejected():
    with pytest.raises(ValueError):
        model_config({"architectures": ["LlamaForCausalLM"], "hidden_size": 8})


def test_ouro_param_counts():
    p = param_counts(OURO_14B)
    assert p.block_matmul == O_BLOCK_MATMUL
    assert p.block == O_BLOCK
    assert p.embedding == 49152 * 2048
    assert p.prelude == 0
    assert p.core_step == 24 * O_BLOCK + 2048 + 2049
    assert p.coda == 49152 * 2048
    assert p.total == 1_434_652_673


def test_ouro_26b_param_count():
    # Ouro-2.6B differs only in 48 layers; reference: 2,667,974,657 params
    cfg = {**OURO_14B.raw, "num_hidden_layers": 48}
    assert param_counts(cfg).total == 2 * 49152 * 2048 + 48 * O_BLOCK + 2048 + 2049 == 2_667_974_657


def test_huginn_param_counts():
    p = param_counts(HUGINN_35B)
    assert p.block_matmul == H_BLOCK_MATMUL
    assert p.block == H_BLOCK
    assert p.prelude == 2 * H_BLOCK
    assert p.core_step == H_ADAPTER + 4 * H_BLOCK
    assert p.coda == 2 * H_BLOCK + 5280 + 65536 * 5280  # blocks + ln_f + (tied) head
    assert p.total == 3_564_976_800


def test_huginn_untied_adds_a_head():
    cfg = dataclasses.replace(HUGINN_35B, tie_embeddings=False)  # the engine's Huginn always ties
    assert param_counts(cfg).total == 3_564_976_800 + 65536 * 5280


def test_huginn_prefers_padded_vocab():
    cfg = {**HUGINN_35B.raw, "vocab_size": 65000, "padded_vocab_size": 65536}
    assert model_config(cfg).vocab_size == 65536
    cfg = {k: v for k, v in HUGINN_35B.raw.items() if k != "padded_vocab_size"}
    assert model_config(cfg).vocab_size == 65536


# ------------------------------------------------------------------------------------ FLOPs


def test_ouro_stage_flops():
    f = stage_flops(OURO_14B)
    assert isinstance(f, StageFlops)
    assert f.prelude == 0
    assert f.coda == O_F0 == 201_326_592
    assert f.F0 == 201_326_592
    assert f.Fr == O_FR == 2_466_254_848
    fp = stage_flops(OURO_14B, count="params")
    assert fp.F0 == O_F0
    assert fp.Fr == O_FR_PARAMS == 2 * 1_233_326_081


def test_huginn_stage_flops():
    f = stage_flops(HUGINN_35B)
    assert f.prelude == H_PRELUDE == 1_581_465_600
    assert f.Fr == H_FR == 3_274_444_800
    assert f.coda == H_CODA == 2_273_525_760
    assert f.F0 == H_F0 == 3_854_991_360
    assert 1.1 < f.F0 / f.Fr < 1.25  # DESIGN: F0 ~ 1.2 Fr
    fp = stage_flops(HUGINN_35B, count="params")
    assert fp.prelude == 2 * 2 * H_BLOCK
    assert fp.Fr == 2 * (H_ADAPTER + 4 * H_BLOCK)
    assert fp.coda == 2 * (2 * H_BLOCK + 5280 + 65536 * 5280)


def test_attention_term():
    c = 1000
    per_layer = 2 * 2 * 16 * 128 * c  # QK^T and AV for 16 heads x 128 over 1000 keys
    f = stage_flops(OURO_14B, context=c)
    assert f.Fr == O_FR + 24 * per_layer
    assert f.F0 == O_F0  # the LM head has no attention
    h = stage_flops(HUGINN_35B, context=c)
    h_layer = 2 * 2 * 55 * 96 * c
    assert h.Fr == H_FR + 4 * h_layer
    assert h.F0 == H_F0 + 4 * h_layer  # 2 prelude + 2 coda blocks


def test_stage_flops_rejects_bad_count():
    with pytest.raises(ValueError):
        stage_flops(OURO_14B, count="bogus")


def test_as_dict_is_json():
    d = stage_flops(HUGINN_35B).as_dict()
    json.dumps(d, allow_nan=False)
    assert d["F0"] == H_F0 and d["Fr"] == H_FR


# ------------------------------------------------------------------------------------ bound


def test_ouro_bound_at_2_5_of_4():
    f = stage_flops(OURO_14B)
    expected = Fraction(O_F0 + 4 * O_FR) / Fraction(2 * O_F0 + 5 * O_FR, 2)  # d = 5/2
    assert flop_bound(f.F0, f.Fr, 4, 2.5) == pytest.approx(float(expected), rel=1e-12)
    assert flop_bound(f.F0, f.Fr, 4, 2.5) == pytest.approx(1.58103, abs=1e-5)


def test_huginn_bound_at_8_of_16():
    f = stage_flops(HUGINN_35B)
    expected = Fraction(H_F0 + 16 * H_FR, H_F0 + 8 * H_FR)
    assert flop_bound(f.F0, f.Fr, 16, 8) == pytest.approx(float(expected), rel=1e-12)
    # a large boundary stage keeps the bound well below r_max / d = 2
    assert flop_bound(f.F0, f.Fr, 16, 8) < 1.9


def test_bound_validation_and_fraction():
    with pytest.raises(ValueError):
        flop_bound(1.0, 1.0, 4, 5)
    with pytest.raises(ValueError):
        flop_bound(0.0, 0.0, 4, 0)
    assert flop_bound(0.0, 1.0, 4, 2) == 2.0
    assert realized_fraction(1.5, 2.0) == 0.75
    with pytest.raises(ValueError):
        realized_fraction(1.0, 0.0)


@given(
    f0=st.floats(min_value=0.0, max_value=1e12),
    fr=st.floats(min_value=1e6, max_value=1e12),
    r_max=st.integers(min_value=1, max_value=64),
    u1=st.floats(min_value=0.0, max_value=1.0),
    u2=st.floats(min_value=0.0, max_value=1.0),
)
def test_bound_monotone_in_depth(f0, fr, r_max, u1, u2):
    d1, d2 = sorted((u1 * r_max, u2 * r_max))
    if f0 + d1 * fr <= 0:  # F0 = 0 and d = 0: undefined
        d1 = d2 = max(d2, 0.5)
    b1 = flop_bound(f0, fr, r_max, d1)
    b2 = flop_bound(f0, fr, r_max, d2)
    assert b1 >= b2 >= 1.0
    if d2 - d1 > 0.01:
        assert b1 > b2
    assert flop_bound(f0, fr, r_max, r_max) == 1.0
    assert flop_bound(f0, fr, r_max, float(r_max)) == 1.0


# ------------------------------------------------------------------------------------ KV bytes


def test_ouro_kv_bytes():
    per_slot = 2 * 16 * 128 * 2  # K and V, 16 kv heads x 128, bf16
    assert kv_bytes_per_token(OURO_14B, "depth_indexed") == 24 * 4 * per_slot == 786_432
    assert kv_bytes_per_token(OURO_14B, "last_exited") == 786_432
    assert kv_bytes_per_token(OURO_14B, "shared") == 24 * per_slot == 196_608
    assert kv_bytes_per_token(OURO_14B, "shared", dtype="float32") == 2 * 196_608
    assert kv_read_bytes_per_token_step(OURO_14B) == 196_608
    # Ouro-2.6B: 1.5 MiB and 384 KiB
    cfg = {**OURO_14B.raw, "num_hidden_layers": 48}
    assert kv_bytes_per_token(cfg, "depth_indexed") == 3 * 2**19
    assert kv_bytes_per_token(cfg, "shared") == 384 * 1024


def test_huginn_kv_bytes():
    per_slot = 2 * 5280 * 2  # K and V of 55 x 96 = 5280, bf16
    assert kv_bytes_per_token(HUGINN_35B, "depth_indexed") == (2 + 4 * 32 + 2) * per_slot == 2_787_840
    assert kv_bytes_per_token(HUGINN_35B, "depth_indexed", r_max=16) == (2 + 4 * 16 + 2) * per_slot
    assert kv_bytes_per_token(HUGINN_35B, "shared") == (2 + 4 + 2) * per_slot
    assert kv_read_bytes_per_token_step(HUGINN_35B) == 4 * per_slot


def test_shared_is_one_over_r_max_of_core():
    for r in (1, 2, 4, 8):
        assert kv_bytes_per_token(OURO_14B, "depth_indexed", r_max=r) == r * kv_bytes_per_token(
            OURO_14B, "shared"
        )


def test_gqa_reduces_kv_bytes_and_params():
    gqa = {**OURO_14B.raw, "num_key_value_heads": 4}
    assert kv_bytes_per_token(gqa, "shared") == 2 * 24 * 4 * 128 * 2 == 49_152
    assert kv_bytes_per_token(gqa, "depth_indexed") == 4 * 49_152
    for layout in LAYOUTS:
        assert kv_bytes_per_token(gqa, layout) < kv_bytes_per_token(OURO_14B, layout)
    # k_proj and v_proj shrink from 2048 x 2048 to (4*128) x 2048
    assert param_counts(gqa).block == O_BLOCK - 2 * (16 - 4) * 128 * 2048


def test_kv_validation():
    with pytest.raises(ValueError):
        kv_bytes_per_token(OURO_14B, "paged")
    with pytest.raises(ValueError):
        kv_bytes_per_token(OURO_14B, "shared", dtype="complex7")
    with pytest.raises(ValueError):
        kv_bytes_per_token(OURO_14B, "depth_indexed", r_max=0)


def test_bytes_per_element():
    import torch

    assert bytes_per_element("bfloat16") == bytes_per_element("bf16") == 2
    assert bytes_per_element("float32") == bytes_per_element("torch.float32") == 4
    assert bytes_per_element(torch.bfloat16) == 2
    assert bytes_per_element(torch.float64) == 8


# ------------------------------------------------------------------------------------ roofline


def test_device_presets():
    assert H100_SXM.peak_flops == 989e12 and H100_SXM.mem_bw == 3.35e12
    assert H200.peak_flops == 989e12 and H200.mem_bw == 4.8e12
    assert H100_SXM.ridge == pytest.approx(989 / 3.35)
    assert ROOFLINE_DEVICES["h200"] is H200


def test_core_step_estimate_ouro_h100():
    weight_bytes = 2 * (24 * O_BLOCK + 2048 + 2049)  # bf16 core-step params
    floor = weight_bytes / 3.35e12
    row_compute = O_FR / 989e12
    e0 = step_time_estimate(OURO_14B, H100_SXM, batch=1, context=0)
    assert e0.weight_bytes == weight_bytes
    assert e0.floor_s == pytest.approx(floor)
    assert e0.limited_by == "memory" and e0.time_s == pytest.approx(floor)
    assert e0.b_star_weights == pytest.approx(floor / row_compute)
    assert e0.b_star_linear == pytest.approx(e0.b_star_weights)  # no KV term at context 0
    assert 250 < e0.b_star_weights < 300  # ~ the ridge point: params ~ FLOPs / 2, bytes = 2 x params
    big = step_time_estimate(OURO_14B, H100_SXM, batch=10_000, context=0)
    assert big.limited_by == "compute"
    assert big.time_s == pytest.approx(10_000 * row_compute)

    c = 1024
    row_flops = O_FR + 24 * 2 * 2 * 16 * 128 * c
    row_kv = c * 196_608 / 3.35e12
    e = step_time_estimate(OURO_14B, H100_SXM, batch=32, context=c)
    slope = row_flops / 989e12 + row_kv
    assert e.slope_s == pytest.approx(slope)
    assert e.memory_s == pytest.approx(floor + 32 * row_kv)
    assert e.time_s == pytest.approx(max(32 * row_flops / 989e12, floor + 32 * row_kv))
    assert e.b_star_linear == pytest.approx(floor / slope)
    assert 10 < e.b_star_linear < 14  # docs/design.md §7.3: B* ~ 12 at 1k context


def test_core_step_estimate_huginn_h100():
    weight_bytes = 2 * (H_ADAPTER + 4 * H_BLOCK)
    c = 1024
    slope = (H_FR + 4 * 2 * 2 * 55 * 96 * c) / 989e12 + c * 4 * 2 * 5280 * 2 / 3.35e12
    e = step_time_estimate(HUGINN_35B, H100_SXM, batch=1, context=c)
    assert e.b_star_linear == pytest.approx(weight_bytes / 3.35e12 / slope)
    assert 30 < e.b_star_linear < 37  # docs/design.md §7.3: B* ~ 34


def test_prelude_and_coda_step_estimates():
    """The other stages' rooflines: Ouro's prelude (an embedding lookup) costs nothing and its coda is
    the LM head alone; Huginn's coda reads two blocks, ln_f and the tied head, and its layers' KV."""
    assert step_time_estimate(OURO_14B, H100_SXM, batch=64, context=512, stage="prelude").time_s == 0
    head = 49152 * 2048
    e = step_time_estimate(OURO_14B, H100_SXM, batch=8, context=512, stage="coda")
    assert e.weight_bytes == 2 * head and e.kv_bytes_per_row == 0  # no coda layers: no KV read
    assert e.time_s == pytest.approx(max(8 * 2 * head / 989e12, 2 * head / 3.35e12))
    c = 1024
    e = step_time_estimate(HUGINN_35B, H100_SXM, batch=4, context=c, stage="coda")
    assert e.weight_bytes == 2 * (2 * H_BLOCK + 5280 + 65536 * 5280)
    assert e.kv_bytes_per_row == c * 2 * 2 * 55 * 96 * 2  # 2 layers, K and V, 55 heads x 96, bf16
    assert e.stage == "coda"
    with pytest.raises(ValueError, match="stage"):
        step_time_estimate(HUGINN_35B, H100_SXM, batch=4, context=c, stage="loop")

def test_cpu_probe():
    dev = cpu_probe(seconds=0.2, matmul_size=256, copy_mib=16)
    assert isinstance(dev, Device)
    assert dev.name == "this CPU"
    assert math.isfinite(dev.peak_flops) and dev.peak_flops > 1e6
    assert math.isfinite(dev.mem_bw) and dev.mem_bw > 1e6


# ------------------------------------------------------------------------------------ report


def test_theory_report_ouro_json_and_values():
    rep = theory_report(OURO_14B, mean_depth=2.5, context=0, device="h100")
    text = json.dumps(rep, allow_nan=False)
    assert json.loads(text) == rep
    assert rep["r_max"] == 4
    assert rep["params"]["total"] == 1_434_652_673
    assert rep["flops"]["matmul"]["F0"] == O_F0
    assert rep["flops"]["matmul"]["Fr"] == O_FR
    assert rep["bound"]["matmul"] == pytest.approx((O_F0 + 4 * O_FR) / (O_F0 + 2.5 * O_FR))
    assert rep["bound"]["no_boundary"] == pytest.approx(4 / 2.5)
    assert rep["kv_bytes_per_token"] == {
        "depth_indexed": 786_432,
        "last_exited": 786_432,
        "shared": 196_608,
    }
    assert rep["roofline"]["device"]["name"] == "H100 SXM"
    assert [row["batch"] for row in rep["roofline"]["batches"]] == [1, 8, 32, 64, 128, 256, 512]
    out = format_report(rep)
    for needle in ("1,434,652,673", "786,432", "196,608", "201,326,592", "H100 SXM", "1.5810"):
        assert needle in out, needle


def test_theory_report_huginn_no_device():
    rep = theory_report(HUGINN_35B, mean_depth=8, r_max=16)
    json.dumps(rep, allow_nan=False)
    assert rep["roofline"] is None
    assert rep["r_max"] == 16
    assert rep["params"]["total"] == 3_564_976_800
    assert rep["flops"]["matmul"]["F0"] == H_F0
    assert rep["bound"]["matmul"] == pytest.approx((H_F0 + 16 * H_FR) / (H_F0 + 8 * H_FR))
    assert rep["kv_bytes_per_token"]["depth_indexed"] == (2 + 4 * 16 + 2) * 2 * 5280 * 2
    out = format_report(rep)
    assert "3,564,976,800" in out and "RavenForCausalLM" in out


def test_theory_report_rejects_depth_beyond_r_max():
    with pytest.raises(ValueError):
        theory_report(OURO_14B, mean_depth=5)


# ------------------------------------------------------------------------------------ pinned outputs

PINNED = Path(__file__).parent / "data" / "theory_pinned.json"


def _pinned_cases() -> list[dict]:
    """`bench theory` reports (JSON and text) for the real configs, a GQA variant, the embedded model
    and three bench presets, at the CLI's defaults and at a roofline point. `PINNED` holds these as
    computed at commit 4d758a5, before the theory read `ModelConfig` and `KVLayout`; re-record it
    (`python -m tests.test_theory`) only for a deliberate change of the figures."""
    from loopserve.models.loader import embedded_model_path
    from loopserve_lab.bench.presets import preset_config

    models = {
        "Ouro-1.4B": OURO_14B,
        "Huginn-0125": HUGINN_35B,
        "Ouro-1.4B-gqa4": {**OURO_14B.raw, "num_key_value_heads": 4},
        "embedded": json.loads((embedded_model_path() / "config.json").read_text()),
        **{name: preset_config(name) for name in ("ouro-bench", "huginn-bench", "huginn-bench-0-4-0")},
    }
    cases = []
    for name, cfg in models.items():
        r = model_config(cfg).r_max
        for mean, r_max, ctx, dev, dt in [(0.625 * r, None, 0, None, "bfloat16"), (2.5, 4, 1024, "h100", "float32")]:
            rep = theory_report(cfg, mean, r_max, ctx, dev, dt)
            cases.append({"model": name, "args": [mean, r_max, ctx, dev, dt], "report": rep,
                          "text": format_report(rep)})
    return cases


def test_reports_equal_pinned_outputs():
    pinned = json.loads(PINNED.read_text())["cases"]
    now = _pinned_cases()
    assert [(c["model"], c["args"]) for c in now] == [(c["model"], c["args"]) for c in pinned]
    for case, old in zip(now, pinned, strict=True):
        assert json.loads(json.dumps(case["report"])) == old["report"], case["model"]
        assert case["text"] == old["text"], case["model"]


if __name__ == "__main__":
    import sys

    json.dump({"cases": _pinned_cases()}, sys.stdout, separators=(",", ":"), sort_keys=True)
