"""Self-checks of the float64 upstream oracle (tests/upstream/oracle.py) on tiny random weights."""

from __future__ import annotations

import json
import math

import pytest
import torch
from safetensors.torch import save_file

from . import oracle
from .tiny_weights import (
    tiny_huginn_config,
    tiny_huginn_weights,
    tiny_ouro_config,
    tiny_ouro_weights,
    upstream_freqs_cis,
)

IDS = [3, 17, 1, 42, 9, 30, 5]


def f64(weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {name: t.to(torch.float64) for name, t in weights.items()}


def ouro_setup(n_kv: int = 4, seed: int = 0):
    cfg = tiny_ouro_config(num_key_value_heads=n_kv)
    return cfg, f64(tiny_ouro_weights(cfg, seed))


def huginn_setup(split=(1, 2, 1), seed: int = 0, **overrides):
    cfg = tiny_huginn_config(
        n_layers_in_prelude=split[0],
        n_layers_in_recurrent_block=split[1],
        n_layers_in_coda=split[2],
        **overrides,
    )
    return cfg, f64(tiny_huginn_weights(cfg, seed))


# ---------------- hand-written position-0 forward
# Position 0 attends only to itself, so softmax = [1] and the attention output is the value
# projection (RoPE and qk_bias only touch q and k). Written per vector, with no oracle helpers.


def _rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return w * (x / math.sqrt(float((x * x).sum()) / x.numel() + eps))


def _silu(x: torch.Tensor) -> torch.Tensor:
    return x / (1.0 + torch.exp(-x))


def ouro_position0(cfg: dict, w: dict, token: int, steps: int) -> tuple[torch.Tensor, list[torch.Tensor]]:
    eps, hd = cfg["rms_norm_eps"], cfg["head_dim"]
    n_heads, n_kv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    group = n_heads // n_kv
    h = w["model.embed_tokens.weight"][token]
    states = []
    for _ in range(steps):
        for layer in range(cfg["num_hidden_layers"]):
            p = f"model.layers.{layer}."
            x = _rms(h, w[p + "input_layernorm.weight"], eps)
            v = w[p + "self_attn.v_proj.weight"] @ x
            per_query_head = [v[(j // group) * hd : (j // group + 1) * hd] for j in range(n_heads)]
            attn = w[p + "self_attn.o_proj.weight"] @ torch.cat(per_query_head)
            h = h + _rms(attn, w[p + "input_layernorm_2.weight"], eps)
            x = _rms(h, w[p + "post_attention_layernorm.weight"], eps)
            gate, up = w[p + "mlp.gate_proj.weight"] @ x, w[p + "mlp.up_proj.weight"] @ x
            mlp = w[p + "mlp.down_proj.weight"] @ (_silu(gate) * up)
            h = h + _rms(mlp, w[p + "post_attention_layernorm_2.weight"], eps)
        h = _rms(h, w["model.norm.weight"], eps)
        states.append(h)
    return w["lm_head.weight"] @ h, states


def huginn_position0(cfg: dict, w: dict, token: int, steps: int) -> tuple[torch.Tensor, list[torch.Tensor]]:
    n, inter, eps = cfg["n_embd"], cfg["intermediate_size"], cfg["norm_eps"]

    def block(p: str, x: torch.Tensor) -> torch.Tensor:
        value = w[p + "attn.Wqkv.weight"][2 * n : 3 * n] @ _rms(x, w[p + "norm_1.weight"], eps)
        x = _rms(x + w[p + "attn.proj.weight"] @ value, w[p + "norm_2.weight"], eps)
        fc = w[p + "mlp.fc.weight"] @ _rms(x, w[p + "norm_3.weight"], eps)
        return _rms(
            x + w[p + "mlp.proj.weight"] @ (_silu(fc[:inter]) * fc[inter:]), w[p + "norm_4.weight"], eps
        )

    e = w["transformer.wte.weight"][token] * math.sqrt(n)
    for i in range(cfg["n_layers_in_prelude"]):
        e = block(f"transformer.prelude.{i}.", e)
    adapter = w["transformer.adapter.weight"]
    s = torch.zeros(n, dtype=torch.float64)
    states = [s]
    for _ in range(steps):
        s = adapter[:, :n] @ s + adapter[:, n:] @ e
        for i in range(cfg["n_layers_in_recurrent_block"]):
            s = block(f"transformer.core_block.{i}.", s)
        states.append(s)
    x = _rms(s, w["transformer.ln_f.weight"], eps)
    for i in range(cfg["n_layers_in_coda"]):
        x = block(f"transformer.coda.{i}.", x)
    x = _rms(x, w["transformer.ln_f.weight"], eps)
    return w["transformer.wte.weight"] @ x, states


# ---------------- hand-written forward over a few positions
# Per position, per head, with explicit RoPE loops and a two-pass softmax; again no oracle helpers.


def _rope_half_1head(x: torch.Tensor, pos: int, theta: float) -> torch.Tensor:
    d, out = x.numel(), x.clone()
    for i in range(d // 2):  # dim i pairs with dim i + d/2
        c, s = math.cos(pos * theta ** (-2 * i / d)), math.sin(pos * theta ** (-2 * i / d))
        out[i], out[i + d // 2] = x[i] * c - x[i + d // 2] * s, x[i + d // 2] * c + x[i] * s
    return out


def _rope_pairs_1head(x: torch.Tensor, pos: int, base: float) -> torch.Tensor:
    d, out = x.numel(), x.clone()
    for i in range(d // 2):  # dims 2i, 2i+1 form a pair
        c, s = math.cos(pos * base ** (-2 * i / d)), math.sin(pos * base ** (-2 * i / d))
        out[2 * i], out[2 * i + 1] = x[2 * i] * c - x[2 * i + 1] * s, x[2 * i + 1] * c + x[2 * i] * s
    return out


def _attend(q: torch.Tensor, keys: list[torch.Tensor], values: list[torch.Tensor]) -> torch.Tensor:
    scores = [float(q @ k) / math.sqrt(q.numel()) for k in keys]
    top = max(scores)
    expo = [math.exp(x - top) for x in scores]
    return sum(e / sum(expo) * v for e, v in zip(expo, values, strict=True))


def _heads(x: torch.Tensor, hd: int) -> list[torch.Tensor]:
    return [x[j * hd : (j + 1) * hd] for j in range(x.numel() // hd)]


def ouro_by_hand(cfg: dict, w: dict, tokens: list[int], steps: int) -> list[torch.Tensor]:
    eps, hd, theta = cfg["rms_norm_eps"], cfg["head_dim"], cfg["rope_theta"]
    group = cfg["num_attention_heads"] // cfg["num_key_value_heads"]
    hs = [w["model.embed_tokens.weight"][t] for t in tokens]
    for _ in range(steps):
        for layer in range(cfg["num_hidden_layers"]):
            p = f"model.layers.{layer}."
            xs = [_rms(h, w[p + "input_layernorm.weight"], eps) for h in hs]
            qs = [
                [_rope_half_1head(q, i, theta) for q in _heads(w[p + "self_attn.q_proj.weight"] @ x, hd)]
                for i, x in enumerate(xs)
            ]
            ks = [
                [_rope_half_1head(k, i, theta) for k in _heads(w[p + "self_attn.k_proj.weight"] @ x, hd)]
                for i, x in enumerate(xs)
            ]
            vs = [_heads(w[p + "self_attn.v_proj.weight"] @ x, hd) for x in xs]
            new = []
            for i, h in enumerate(hs):
                heads = [
                    _attend(
                        q,
                        [ks[j][n // group] for j in range(i + 1)],
                        [vs[j][n // group] for j in range(i + 1)],
                    )
                    for n, q in enumerate(qs[i])
                ]
                h = h + _rms(
                    w[p + "self_attn.o_proj.weight"] @ torch.cat(heads),
                    w[p + "input_layernorm_2.weight"],
                    eps,
                )
                x = _rms(h, w[p + "post_attention_layernorm.weight"], eps)
                mlp = w[p + "mlp.down_proj.weight"] @ (
                    _silu(w[p + "mlp.gate_proj.weight"] @ x) * (w[p + "mlp.up_proj.weight"] @ x)
                )
                new.append(h + _rms(mlp, w[p + "post_attention_layernorm_2.weight"], eps))
            hs = new
        hs = [_rms(h, w["model.norm.weight"], eps) for h in hs]
    return [w["lm_head.weight"] @ h for h in hs]


def huginn_by_hand(cfg: dict, w: dict, tokens: list[int], steps: int) -> list[torch.Tensor]:
    n, inter, eps, base = cfg["n_embd"], cfg["intermediate_size"], cfg["norm_eps"], cfg["rope_base"]
    hd = n // cfg["n_heads"]

    def block(p: str, xs: list[torch.Tensor]) -> list[torch.Tensor]:
        wqkv, bias = w[p + "attn.Wqkv.weight"], w[p + "attn.qk_bias"]
        normed = [_rms(x, w[p + "norm_1.weight"], eps) for x in xs]
        qs = [
            [_rope_pairs_1head(q + bias[0, 0, j], i, base) for j, q in enumerate(_heads(wqkv[:n] @ x, hd))]
            for i, x in enumerate(normed)
        ]
        ks = [
            [
                _rope_pairs_1head(k + bias[1, 0, j], i, base)
                for j, k in enumerate(_heads(wqkv[n : 2 * n] @ x, hd))
            ]
            for i, x in enumerate(normed)
        ]
        vs = [_heads(wqkv[2 * n :] @ x, hd) for x in normed]
        out = []
        for i, x in enumerate(xs):
            heads = [
                _attend(q, [ks[j][m] for j in range(i + 1)], [vs[j][m] for j in range(i + 1)])
                for m, q in enumerate(qs[i])
            ]
            x = _rms(x + w[p + "attn.proj.weight"] @ torch.cat(heads), w[p + "norm_2.weight"], eps)
            fc = w[p + "mlp.fc.weight"] @ _rms(x, w[p + "norm_3.weight"], eps)
            mlp = w[p + "mlp.proj.weight"] @ (_silu(fc[:inter]) * fc[inter:])
            out.append(_rms(x + mlp, w[p + "norm_4.weight"], eps))
        return out

    es = [w["transformer.wte.weight"][t] * math.sqrt(n) for t in tokens]
    for i in range(cfg["n_layers_in_prelude"]):
        es = block(f"transformer.prelude.{i}.", es)
    adapter = w["transformer.adapter.weight"]
    ss = [torch.zeros(n, dtype=torch.float64) for _ in tokens]
    for _ in range(steps):
        ss = [adapter[:, :n] @ s + adapter[:, n:] @ e for s, e in zip(ss, es, strict=True)]
        for i in range(cfg["n_layers_in_recurrent_block"]):
            ss = block(f"transformer.core_block.{i}.", ss)
    xs = [_rms(s, w["transformer.ln_f.weight"], eps) for s in ss]
    for i in range(cfg["n_layers_in_coda"]):
        xs = block(f"transformer.coda.{i}.", xs)
    return [w["transformer.wte.weight"] @ _rms(x, w["transformer.ln_f.weight"], eps) for x in xs]


# ---------------- Ouro


@pytest.mark.parametrize("n_kv", [4, 2, 1])
@pytest.mark.parametrize("steps", [1, 2, 3])
def test_ouro_position0_matches_closed_form(n_kv, steps):
    cfg, w = ouro_setup(n_kv)
    logits = oracle.ouro_logits(cfg, w, IDS, steps)
    expected, states = ouro_position0(cfg, w, IDS[0], steps)
    assert logits.shape == (len(IDS), cfg["vocab_size"]) and logits.dtype == torch.float64
    torch.testing.assert_close(logits[0], expected, rtol=1e-10, atol=1e-10)
    for got, want in zip(oracle.ouro_step_states(cfg, w, IDS, steps), states, strict=True):
        torch.testing.assert_close(got[0], want, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("n_kv", [4, 2])
@pytest.mark.parametrize("steps", [1, 2])
def test_ouro_first_positions_match_hand_written_forward(n_kv, steps):
    cfg, w = ouro_setup(n_kv)
    logits = oracle.ouro_logits(cfg, w, IDS, steps)
    for i, expected in enumerate(ouro_by_hand(cfg, w, IDS[:3], steps)):
        torch.testing.assert_close(logits[i], expected, rtol=1e-10, atol=1e-10)


def test_ouro_position0_closed_form_is_sensitive():
    """The closed form must notice a swapped post-norm pair (guards the test itself)."""
    cfg, w = ouro_setup()
    swapped = dict(w)
    p = "model.layers.0."
    swapped[p + "input_layernorm_2.weight"], swapped[p + "post_attention_layernorm_2.weight"] = (
        w[p + "post_attention_layernorm_2.weight"],
        w[p + "input_layernorm_2.weight"],
    )
    assert not torch.allclose(
        oracle.ouro_logits(cfg, swapped, IDS, 2)[0], ouro_position0(cfg, w, IDS[0], 2)[0]
    )


@pytest.mark.parametrize("n_kv", [4, 2])
def test_ouro_causal(n_kv):
    cfg, w = ouro_setup(n_kv)
    full = oracle.ouro_logits(cfg, w, IDS, 3)
    changed = oracle.ouro_logits(cfg, w, IDS[:4] + [0, 11, 47], 3)
    torch.testing.assert_close(full[:4], changed[:4], rtol=0, atol=1e-12)
    assert not torch.allclose(full[4:], changed[4:])
    torch.testing.assert_close(oracle.ouro_logits(cfg, w, IDS[:4], 3), full[:4], rtol=0, atol=1e-12)


def _expand_kv(weight: torch.Tensor, n_kv: int, group: int, interleave: bool) -> torch.Tensor:
    heads = weight.view(n_kv, -1, weight.shape[1])
    heads = heads.repeat_interleave(group, dim=0) if interleave else heads.repeat(group, 1, 1)
    return heads.reshape(-1, weight.shape[1])


def test_ouro_gqa_equals_mha_with_duplicated_kv_heads():
    cfg_gqa, w_gqa = ouro_setup(n_kv=2)
    cfg_mha = dict(cfg_gqa, num_key_value_heads=4)
    mha, wrong = dict(w_gqa), dict(w_gqa)
    for layer in range(cfg_gqa["num_hidden_layers"]):
        for proj in ("k_proj", "v_proj"):
            name = f"model.layers.{layer}.self_attn.{proj}.weight"
            mha[name] = _expand_kv(w_gqa[name], 2, 2, interleave=True)  # query head j -> kv head j // 2
            wrong[name] = _expand_kv(w_gqa[name], 2, 2, interleave=False)  # j -> j % 2: must differ
    gqa_logits = oracle.ouro_logits(cfg_gqa, w_gqa, IDS, 2)
    torch.testing.assert_close(oracle.ouro_logits(cfg_mha, mha, IDS, 2), gqa_logits, rtol=1e-10, atol=1e-10)
    assert not torch.allclose(oracle.ouro_logits(cfg_mha, wrong, IDS, 2), gqa_logits)


@pytest.mark.parametrize("steps", [1, 2, 4])
def test_ouro_gate_cdf(steps):
    cfg, w = ouro_setup(n_kv=2)
    cdf = oracle.ouro_gate_cdf(cfg, w, IDS, steps)
    assert cdf.shape == (len(IDS), steps) and cdf.dtype == torch.float64
    assert torch.all(cdf[:, -1] == 1.0)
    assert torch.all(cdf >= 0) and torch.all(cdf <= 1)
    assert torch.all(cdf[:, 1:] - cdf[:, :-1] >= 0)
    # the upstream pdf recursion (OuroForCausalLM.forward), accumulated with a cumsum
    states = oracle.ouro_step_states(cfg, w, IDS, steps)
    lams = [
        torch.sigmoid(s @ w["model.early_exit_gate.weight"][0] + w["model.early_exit_gate.bias"][0])
        for s in states
    ]
    remaining, pdf = torch.ones(len(IDS), dtype=torch.float64), []
    for t, lam in enumerate(lams):
        pdf.append(lam * remaining if t < steps - 1 else remaining)
        remaining = remaining * (1 - lam)
    torch.testing.assert_close(cdf, torch.cumsum(torch.stack(pdf, dim=1), dim=1), rtol=0, atol=1e-12)
    # position 0 from the hand-written forward
    _, states0 = ouro_position0(cfg, w, IDS[0], steps)
    lam0 = [
        float(torch.sigmoid(w["model.early_exit_gate.weight"][0] @ s + w["model.early_exit_gate.bias"][0]))
        for s in states0
    ]
    for t in range(steps - 1):
        assert cdf[0, t].item() == pytest.approx(1 - math.prod(1 - x for x in lam0[: t + 1]), abs=1e-12)
    if steps > 1:
        assert not torch.all(cdf[:, :-1] == 1.0)  # the gate is not saturated for these weights


def test_ouro_rope_rotate_half_convention():
    hd, pos = 8, torch.arange(5)
    x = torch.zeros(1, 5, hd, dtype=torch.float64)
    x[..., 0] = 1.0
    out = oracle.rope_rotate_half(x, pos, 10000.0)
    expected = torch.zeros_like(x)
    expected[0, :, 0], expected[0, :, hd // 2] = pos.double().cos(), pos.double().sin()
    torch.testing.assert_close(out, expected, rtol=0, atol=1e-15)


# ---------------- Huginn


@pytest.mark.parametrize("split", [(1, 2, 1), (0, 4, 0), (2, 4, 2)])
@pytest.mark.parametrize("steps", [1, 3])
def test_huginn_position0_matches_closed_form(split, steps):
    cfg, w = huginn_setup(split)
    logits = oracle.huginn_logits(cfg, w, IDS, steps)
    expected, states = huginn_position0(cfg, w, IDS[0], steps)
    assert logits.shape == (len(IDS), cfg["vocab_size"]) and logits.dtype == torch.float64
    torch.testing.assert_close(logits[0], expected, rtol=1e-10, atol=1e-10)
    for got, want in zip(oracle.huginn_core_states(cfg, w, IDS, steps), states, strict=True):
        torch.testing.assert_close(got[0], want, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("split", [(1, 2, 1), (0, 4, 0)])
@pytest.mark.parametrize("steps", [1, 2])
def test_huginn_first_positions_match_hand_written_forward(split, steps):
    cfg, w = huginn_setup(split)
    logits = oracle.huginn_logits(cfg, w, IDS, steps)
    for i, expected in enumerate(huginn_by_hand(cfg, w, IDS[:3], steps)):
        torch.testing.assert_close(logits[i], expected, rtol=1e-10, atol=1e-10)


def test_huginn_adapter_order_matters():
    """With >= 2 steps a swapped [e, s] adapter input must change position 0 (guards the closed form)."""
    cfg, w = huginn_setup()
    n = cfg["n_embd"]
    swapped = dict(w)
    a = w["transformer.adapter.weight"]
    swapped["transformer.adapter.weight"] = torch.cat([a[:, n:], a[:, :n]], dim=1)
    assert not torch.allclose(
        oracle.huginn_logits(cfg, swapped, IDS, 3)[0], huginn_position0(cfg, w, IDS[0], 3)[0]
    )


@pytest.mark.parametrize("split", [(1, 2, 1), (0, 4, 0), (2, 4, 2)])
def test_huginn_causal(split):
    cfg, w = huginn_setup(split)
    full = oracle.huginn_logits(cfg, w, IDS, 3)
    changed = oracle.huginn_logits(cfg, w, IDS[:4] + [0, 11, 47], 3)
    torch.testing.assert_close(full[:4], changed[:4], rtol=0, atol=1e-12)
    assert not torch.allclose(full[4:], changed[4:])
    torch.testing.assert_close(oracle.huginn_logits(cfg, w, IDS[:4], 3), full[:4], rtol=0, atol=1e-12)


def test_huginn_rope_adjacent_pair_convention():
    hd, base, pos = 8, 50000.0, torch.arange(6)
    x = torch.zeros(6, 1, hd, dtype=torch.float64)
    x[:, 0, 0] = 1.0  # first element of pair 0
    x[:, 0, 3] = 1.0  # second element of pair 1
    out = oracle.rope_adjacent_pairs(x, pos, base)
    angle0, angle1 = pos.double(), pos.double() * base ** (-2 / hd)
    expected = torch.zeros_like(x)
    expected[:, 0, 0], expected[:, 0, 1] = angle0.cos(), angle0.sin()
    expected[:, 0, 2], expected[:, 0, 3] = -angle1.sin(), angle1.cos()
    torch.testing.assert_close(out, expected, rtol=0, atol=1e-15)
    # same thing as complex multiplication by e^{i * angle} on (x[2i] + i x[2i+1])
    g = torch.Generator().manual_seed(1)
    y = torch.randn(6, 3, hd, generator=g, dtype=torch.float64)
    angles = pos.double()[:, None] * base ** (-torch.arange(0, hd, 2, dtype=torch.float64) / hd)
    rotated = (
        torch.view_as_complex(y.reshape(6, 3, hd // 2, 2).contiguous())
        * torch.polar(torch.ones_like(angles), angles)[:, None, :]
    )
    torch.testing.assert_close(
        oracle.rope_adjacent_pairs(y, pos, base), torch.view_as_real(rotated).flatten(-2)
    )
    # and the checkpoint buffer (fp32, upstream formula) holds the same (cos, sin) table
    table = upstream_freqs_cis(hd, 6, base)[0, :, 0].double()
    torch.testing.assert_close(table[..., 0], angles.cos(), rtol=0, atol=1e-6)
    torch.testing.assert_close(table[..., 1], angles.sin(), rtol=0, atol=1e-6)


def test_huginn_head_is_tied_to_wte():
    cfg, w = huginn_setup()
    perturbed = dict(w, **{"lm_head.weight": w["lm_head.weight"] + 1.0})
    torch.testing.assert_close(
        oracle.huginn_logits(cfg, perturbed, IDS, 2), oracle.huginn_logits(cfg, w, IDS, 2)
    )
    untied = dict(cfg, tie_embeddings=False)
    assert not torch.allclose(
        oracle.huginn_logits(untied, perturbed, IDS, 2), oracle.huginn_logits(cfg, w, IDS, 2)
    )


def test_huginn_qk_bias_is_used():
    cfg, w = huginn_setup()
    no_bias = dict(w)
    for name in w:
        if name.endswith("qk_bias"):
            no_bias[name] = torch.zeros_like(w[name])
    base = oracle.huginn_logits(cfg, w, IDS, 2)
    torch.testing.assert_close(
        oracle.huginn_logits(dict(cfg, qk_bias=False), w, IDS, 2), oracle.huginn_logits(cfg, no_bias, IDS, 2)
    )
    assert not torch.allclose(base[1:], oracle.huginn_logits(cfg, no_bias, IDS, 2)[1:])
    torch.testing.assert_close(
        base[0], oracle.huginn_logits(cfg, no_bias, IDS, 2)[0]
    )  # position 0: no effect


@pytest.mark.parametrize("steps", [1, 4])
def test_huginn_latent_diffs(steps):
    cfg, w = huginn_setup()
    diffs = oracle.huginn_latent_diffs(cfg, w, IDS, steps)
    assert diffs.shape == (len(IDS), steps) and diffs.dtype == torch.float64
    torch.testing.assert_close(diffs[:, 0], torch.ones(len(IDS), dtype=torch.float64))  # s_0 = 0
    states = oracle.huginn_core_states(cfg, w, IDS, steps)
    for r in range(1, steps + 1):
        for i in range(len(IDS)):
            want = math.dist(states[r][i].tolist(), states[r - 1][i].tolist()) / math.hypot(
                *states[r][i].tolist()
            )
            assert diffs[i, r - 1].item() == pytest.approx(want, rel=1e-12)
    assert oracle.huginn_latent_diffs(cfg, w, IDS, 0).shape == (len(IDS), 0)


# ---------------- loading and greedy generation


def _write_folder(path, cfg, weights, shards: int = 1):
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(cfg))
    if shards == 1:
        save_file(weights, str(path / "model.safetensors"))
        return
    names = sorted(weights)
    weight_map = {}
    for s in range(shards):
        file = f"model-{s + 1:05d}-of-{shards:05d}.safetensors"
        part = {n: weights[n] for n in names[s::shards]}
        save_file(part, str(path / file))
        weight_map.update(dict.fromkeys(part, file))
    (path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))


def test_load_folder_single_and_sharded(tmp_path):
    cfg = tiny_huginn_config()
    weights = tiny_huginn_weights(cfg, seed=3)
    _write_folder(tmp_path / "single", cfg, weights)
    _write_folder(tmp_path / "sharded", cfg, weights, shards=3)
    for folder in ("single", "sharded"):
        got_cfg, got = oracle.load_folder(tmp_path / folder)
        assert got_cfg == cfg
        assert set(got) == set(weights)
        for name, t in weights.items():
            assert got[name].dtype == torch.float64
            assert torch.equal(got[name], t.double())


@pytest.mark.parametrize("arch", ["ouro", "huginn"])
def test_greedy_generate(tmp_path, arch):
    if arch == "ouro":
        cfg = tiny_ouro_config(num_key_value_heads=2)
        weights, forward = tiny_ouro_weights(cfg, seed=5), oracle.ouro_logits
    else:
        cfg = tiny_huginn_config()
        weights, forward = tiny_huginn_weights(cfg, seed=5), oracle.huginn_logits
    _write_folder(tmp_path, cfg, weights)
    prompt, depth = [4, 8, 15], 3
    tokens, top = oracle.greedy_generate(tmp_path, prompt, depth=depth, max_new_tokens=4, k=3)
    assert len(tokens) == len(top) == 4
    ids = list(prompt)
    for token, entry in zip(tokens, top, strict=True):
        logprobs = torch.log_softmax(forward(cfg, f64(weights), ids, depth)[-1], dim=-1)
        assert token == int(logprobs.argmax())
        assert len(entry) == 3 and max(entry, key=entry.get) == token
        for tok, lp in entry.items():
            assert lp == logprobs[tok].item() and lp <= 0
        assert sorted(entry.values(), reverse=True) == sorted(logprobs.tolist(), reverse=True)[:3]
        ids.append(token)


def test_greedy_generate_rejects_unknown_architecture(tmp_path):
    cfg = tiny_ouro_config(architectures=["LlamaForCausalLM"])
    _write_folder(tmp_path, cfg, tiny_ouro_weights(cfg))
    with pytest.raises(ValueError):
        oracle.greedy_generate(tmp_path, [1], depth=1, max_new_tokens=1)


def test_huginn_k_bias_is_added_before_rope():
    """A k bias added AFTER RoPE would shift every score of a query by the same q.b and cancel in
    the softmax; added BEFORE RoPE (upstream) it becomes position dependent and changes the output."""
    cfg, w = huginn_setup()
    k_only = dict(w)
    for name in w:
        if name.endswith("qk_bias"):
            k_only[name] = w[name].clone()
            k_only[name][0] = 0.0
    no_k = {name: (t.clone() if name.endswith("qk_bias") else t) for name, t in k_only.items()}
    for name in no_k:
        if name.endswith("qk_bias"):
            no_k[name][1] = 0.0
    assert not torch.allclose(
        oracle.huginn_logits(cfg, k_only, IDS, 2)[1:], oracle.huginn_logits(cfg, no_k, IDS, 2)[1:]
    )


def test_causal_attention_matches_torch_sdpa():
    g = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(3, 6, 8, generator=g, dtype=torch.float64) for _ in range(3))
    expected = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
    torch.testing.assert_close(oracle.causal_attention(q, k, v), expected, rtol=1e-12, atol=1e-12)
