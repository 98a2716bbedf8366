"""Parity with the upstream Hugging Face forward passes (tests/upstream/oracle.py).

The oracle recomputes every sequence from scratch in float64 with no KV cache, so it matches
loopserve's `depth_indexed` layout at a fixed depth (every earlier token ran every depth). We compare
greedy tokens and top-5 logprobs from the reference decoder, the per-step Ouro exit-gate CDF and the
per-step Huginn latent differences from the stage API.
"""

from __future__ import annotations

import pytest
import torch

from loopserve import LLM, SamplingParams
from loopserve.models.base import latent_diff
from loopserve.models.context import dense_context
from loopserve.models.loader import load_model
from loopserve_lab.tiny import TinySpec, make_tiny
from tests.engine_helpers import huginn_state
from tests.upstream import oracle

PROMPTS = [[5, 17, 99, 3, 250, 40, 7], [300, 12, 12, 401, 8]]
NEW_TOKENS = 5
TOL = 2e-3  # the tolerance on top-5 logprobs
TIGHT_F64 = 1e-8  # float64 must agree to rounding; a subtle math error cannot hide under 2e-3

pytestmark = pytest.mark.usefixtures("single_thread")


@pytest.fixture(scope="module")
def tiny_huginn_020(tmp_path_factory):
    """Huginn with no prelude and no coda blocks (embedding straight into the core)."""
    return make_tiny(tmp_path_factory.mktemp("tiny_huginn_020"),
                     TinySpec(arch="huginn", layers="0-2-0", r_max=3, seed=15))


def _ours(path, dtype: str, depth: int, prompt: list[int]):
    llm = LLM(model=path, scheduler="reference", kv_layout="depth_indexed", dtype=dtype, state_init=huginn_state(path))
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, logprobs=5, ignore_eos=True,
                            min_loops=depth, max_loops=depth)
    return llm.generate([prompt], params)[0].outputs[0]


def _compare(path, dtype: str, depth: int) -> None:
    for prompt in PROMPTS:
        out = _ours(path, dtype, depth, prompt)
        tokens, top = oracle.greedy_generate(path, prompt, depth, NEW_TOKENS, k=5)
        assert out.token_ids == tokens, f"{dtype} depth {depth}: greedy tokens differ from upstream"
        assert out.exit_depths == [depth] * NEW_TOKENS
        worst = 0.0
        for ours, ref in zip(out.logprobs, top, strict=True):
            ours_sorted = sorted((lp.logprob for lp in ours.values()), reverse=True)[:5]
            ref_sorted = sorted(ref.values(), reverse=True)
            worst = max(worst, max(abs(a - b) for a, b in zip(ours_sorted, ref_sorted, strict=True)))
            for tok, ref_lp in ref.items():  # same ids where they are present (near-ties may swap rank 5/6)
                if tok in ours:
                    worst = max(worst, abs(ours[tok].logprob - ref_lp))
            if dtype == "float64":
                assert set(ref) <= set(ours), "float64 top-5 ids differ from upstream"
        assert worst < TOL, f"{dtype} depth {depth}: top-5 logprobs off by {worst:.2e}"
        if dtype == "float64":
            assert worst < TIGHT_F64, f"float64 depth {depth}: logprobs off by {worst:.2e} (expected ~1e-12)"


@pytest.mark.parametrize("dtype", ["float64", "float32"])
@pytest.mark.parametrize("depth", [1, 2, 3, 4])
def test_ouro_mha_greedy_parity(tiny_ouro, dtype, depth):
    _compare(tiny_ouro, dtype, depth)


@pytest.mark.parametrize("dtype", ["float64", "float32"])
@pytest.mark.parametrize("depth", [1, 2, 3, 4])
def test_ouro_gqa_greedy_parity(tiny_ouro_gqa, dtype, depth):
    assert load_model(tiny_ouro_gqa, "float32", "cpu").config.num_kv_heads == 2
    _compare(tiny_ouro_gqa, dtype, depth)


@pytest.mark.parametrize("dtype", ["float64", "float32"])
@pytest.mark.parametrize("depth", [1, 3, 6])
def test_huginn_121_greedy_parity(tiny_huginn, dtype, depth):
    _compare(tiny_huginn, dtype, depth)


@pytest.mark.parametrize("dtype", ["float64", "float32"])
@pytest.mark.parametrize("depth", [2, 4])
def test_huginn_242_greedy_parity(tiny_huginn_242, dtype, depth):
    _compare(tiny_huginn_242, dtype, depth)


@pytest.mark.parametrize("depth", [1, 3])
def test_huginn_020_greedy_parity(tiny_huginn_020, depth):
    _compare(tiny_huginn_020, "float64", depth)
    _compare(tiny_huginn_020, "float32", depth)


def test_depth_actually_matters(tiny_ouro, tiny_huginn):
    """Guard against a vacuous parity: different depths give different distributions."""
    for path, (a, b) in ((tiny_ouro, (1, 4)), (tiny_huginn, (1, 6))):
        la = _ours(path, "float64", a, PROMPTS[0]).logprobs[0]
        lb = _ours(path, "float64", b, PROMPTS[0]).logprobs[0]
        va = sorted(x.logprob for x in la.values())
        vb = sorted(x.logprob for x in lb.values())
        assert max(abs(x - y) for x, y in zip(va, vb, strict=False)) > 1e-3


# ---------------- per-step exit signals through the stage API (dense context)


def _step_states(model, ids: list[int], steps: int):
    ctx = dense_context(1, len(ids))
    state, inject = model.prelude(torch.tensor(ids), ctx)
    states = [state]
    for _ in range(steps):
        state = model.core_step(state, inject, ctx)
        states.append(state)
    return ctx, states


@pytest.mark.parametrize("fixture", ["tiny_ouro", "tiny_ouro_gqa"])
def test_ouro_stacked_projections_in_one_matmul_match_upstream(request, fixture, monkeypatch):
    """An accelerator multiplies q, k and v (and gate and up) as one matmul on the stacked weight; the CPU part
    by part. That path, forced here on the CPU, still matches upstream in float64 to rounding."""
    from loopserve.models import layers

    monkeypatch.setattr(layers, "PER_PART_DEVICES", ())
    _compare(request.getfixturevalue(fixture), "float64", 3)


def test_stacked_linear_gives_each_part_in_one_matmul_or_part_by_part(monkeypatch):
    from loopserve.models import layers

    g = torch.Generator().manual_seed(5)
    x, w = torch.randn(6, 16, generator=g, dtype=torch.float64), torch.randn(40, 16, generator=g, dtype=torch.float64)
    want = [x @ w[:24].T, x @ w[24:32].T, x @ w[32:].T]
    per_part = layers.stacked_linear(x, w, [24, 8, 8])
    assert per_part[0]._base is None  # a product of its own
    monkeypatch.setattr(layers, "PER_PART_DEVICES", ())
    one = layers.stacked_linear(x, w, [24, 8, 8])
    assert one[0]._base is not None and one[0]._base.shape == (6, 40)  # views of one product
    for parts in (per_part, one):
        assert [tuple(p.shape) for p in parts] == [(6, 24), (6, 8), (6, 8)]
        assert all(torch.allclose(p, q, rtol=0, atol=1e-12) for p, q in zip(parts, want, strict=True))


@pytest.mark.parametrize("fixture", ["tiny_ouro", "tiny_ouro_gqa"])
@pytest.mark.parametrize("dtype,tol", [("float64", 1e-10), ("float32", 1e-4)])
def test_ouro_gate_cdf_matches_upstream(request, fixture, dtype, tol):
    path = request.getfixturevalue(fixture)
    lm = load_model(path, dtype=dtype, device="cpu")
    config, weights = oracle.load_folder(path)
    ids = PROMPTS[0] + PROMPTS[1]
    steps = lm.config.r_max
    ctx, states = _step_states(lm.model, ids, steps)
    lam = torch.stack([torch.sigmoid(lm.model.gate_logit(s).double()) for s in states[1:]], dim=1)  # [S, T]
    cdf = 1.0 - torch.cumprod(1.0 - lam, dim=1)
    ref = oracle.ouro_gate_cdf(config, weights, ids, steps)
    # upstream gives the last step the remaining mass (CDF = 1); compare the steps before it
    assert torch.allclose(cdf[:, :-1], ref[:, :-1], atol=tol, rtol=0)
    assert (ref[:, :-1] < 0.999).any() and (ref[:, :-1] > 0.01).any(), "gate CDF is degenerate"
    # the logits at every depth match too (lm_head on the normed state of that step)
    for r in range(1, steps + 1):
        ours = lm.model.coda(states[r], ctx).double()
        assert torch.allclose(ours, oracle.ouro_logits(config, weights, ids, r), atol=50 * tol, rtol=0)


@pytest.mark.parametrize("fixture", ["tiny_huginn", "tiny_huginn_242"])
@pytest.mark.parametrize("dtype,tol", [("float64", 1e-10), ("float32", 1e-4)])
def test_huginn_latent_diffs_match_upstream(request, fixture, dtype, tol):
    path = request.getfixturevalue(fixture)
    lm = load_model(path, dtype=dtype, device="cpu", state_init="zero")
    config, weights = oracle.load_folder(path)
    ids = PROMPTS[0] + PROMPTS[1]
    steps = lm.config.r_max
    ctx, states = _step_states(lm.model, ids, steps)
    assert torch.count_nonzero(states[0]) == 0, "state_init='zero' must start from s_0 = 0"
    ours = torch.stack([latent_diff(states[r - 1], states[r]).double() for r in range(1, steps + 1)], dim=1)
    ref = oracle.huginn_latent_diffs(config, weights, ids, steps)
    assert ours.shape == ref.shape
    assert torch.allclose(ours, ref, atol=tol, rtol=0)
    logits = lm.model.coda(states[-1], ctx).double()
    assert torch.allclose(logits, oracle.huginn_logits(config, weights, ids, steps), atol=50 * tol, rtol=0)


# ---------------- bfloat16 smoke


@pytest.mark.parametrize("fixture", ["tiny_ouro", "tiny_huginn"])
def test_bfloat16_loads_generates_and_stays_close(request, fixture):
    path = request.getfixturevalue(fixture)
    llm = LLM(model=path, scheduler="reference", dtype="bfloat16", state_init=huginn_state(path))
    assert next(llm.model.parameters()).dtype == torch.bfloat16
    out = llm.generate([PROMPTS[0]], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, logprobs=1))[0]
    c = out.outputs[0]
    assert len(c.token_ids) == 4 and all(0 <= t < llm.config.vocab_size for t in c.token_ids)
    assert all(torch.isfinite(torch.tensor(lp[t].logprob)) for lp, t in zip(c.logprobs, c.token_ids, strict=True))

    ids = PROMPTS[0] + PROMPTS[1]
    logprobs = {}
    for dtype in ("float32", "bfloat16"):
        lm = load_model(path, dtype=dtype, device="cpu", state_init=huginn_state(path))
        ctx, states = _step_states(lm.model, ids, lm.config.r_max)
        logits = lm.model.coda(states[-1], ctx)
        assert logits.dtype == torch.float32  # logits leave the model in fp32 or wider
        logprobs[dtype] = torch.log_softmax(logits.double(), -1)
    diff = (logprobs["bfloat16"] - logprobs["float32"]).abs()
    # bf16 keeps ~3 significant digits; over a few loops of a random model errors grow, but stay
    # far below the spread of the distribution (a broken bf16 path gives O(1) differences)
    p32 = logprobs["float32"].exp()
    assert (p32 * diff).sum(-1).max() < 0.3, "bf16 log-probabilities drift too far from fp32"
    agree = (logprobs["bfloat16"].argmax(-1) == logprobs["float32"].argmax(-1)).double().mean()
    assert agree >= 0.75


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_rms_norm_is_upstreams_formula_bit_for_bit_on_the_cpu(dtype):
    """`RMSNorm` calls torch's rms_norm (one fused kernel on CUDA); on the CPU it must stay exactly upstream's
    written-out x * rsqrt(mean(x^2) + eps) in fp32 or wider, cast back before the weight."""
    from loopserve.models.layers import RMSNorm

    g = torch.Generator().manual_seed(3)
    norm = RMSNorm(48, 1e-6).to(dtype)
    norm.weight.data = torch.randn(48, generator=g).to(dtype)
    x = (torch.randn(4, 9, 48, generator=g) * 3).to(dtype)
    xf = x.to(torch.promote_types(dtype, torch.float32))
    want = norm.weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-6)).to(dtype)
    assert torch.equal(norm(x), want)


def test_rope_pass_names_mismatched_shapes_and_keeps_infinities_as_the_ops_do():
    """The compiled rotation refuses tables that do not match the heads (a ValueError naming both, not a read past an
    array), leaves to torch's ops what it cannot read, and an infinite or NaN element comes out where the ops put
    one."""
    from types import SimpleNamespace

    from loopserve.models import rope_pass
    from loopserve.models.layers import rope, rope_angles

    cos, sin = rope_angles(SimpleNamespace(cache={}, positions=torch.arange(4)), 8, 10000.0, torch.float32, "half")
    with pytest.raises(ValueError, match="do not match"):
        rope_pass.rotate((torch.zeros(3, 2, 8),), cos, sin, True)
    with pytest.raises(ValueError, match="do not match"):
        rope_pass.rotate((torch.zeros(4, 2, 6),), cos, sin, True)
    with pytest.raises(ValueError, match="float32 tables"):
        rope_pass.rotate((torch.zeros(4, 2, 8, dtype=torch.float64),), cos, sin, True)
    with pytest.raises(ValueError, match="one dtype"):
        rope_pass.rotate((torch.zeros(4, 2, 8), torch.zeros(4, 2, 8, dtype=torch.bfloat16)), cos, sin, True)
    x = torch.randn(4, 2, 8)
    # what the pass cannot read through numpy goes through the ops: a lazily negated view, a vmap'd tensor, heads of
    # two dtypes (the ops promote them), a float64 table
    assert not rope_pass.applies((torch._neg_view(x),), cos, sin)
    assert torch.equal(rope(torch._neg_view(x), cos, sin, "half"), rope(-x, cos, sin, "half"))
    assert torch.equal(torch.vmap(lambda t: rope(t, cos, sin, "half"))(x[None])[0], rope(x, cos, sin, "half"))
    assert not rope_pass.applies((x, x.bfloat16()), cos, sin) and not rope_pass.applies((x,), cos, sin.double())
    x[1, 0, 2], x[2, 1, 5], x[3, 0, 0] = float("inf"), float("-inf"), float("nan")
    for dtype in rope_pass.ROPE_DTYPES:
        got = rope(x.to(dtype), cos, sin, "half")
        want = rope(x.to(dtype).requires_grad_(True), cos, sin, "half").detach()  # (torch's ops)
        assert torch.equal(got.isnan(), want.isnan()) and torch.equal(got.nan_to_num(), want.nan_to_num())


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
@pytest.mark.parametrize("style", ["half", "interleaved"])
@pytest.mark.parametrize("autograd", [False, True])
def test_rope_is_the_pair_rotation_written_out_bit_for_bit(dtype, style, autograd):
    """`rope` (x * cos + partner(x) * sin on whole-width tables) gives exactly the pair rotation written out:
    pairs (i, i + d/2) for Ouro, (2i, 2i + 1) for Huginn, in fp32 or wider; as torch ops (float64, and any input
    autograd differentiates) and as the CPU's compiled pass (`rope_pass`: float32 and bfloat16 in inference). So
    does `rope_pair` on a query's and a key's heads."""
    from types import SimpleNamespace

    from loopserve.models import rope_pass
    from loopserve.models.layers import compute_dtype, rope, rope_angles, rope_pair

    g = torch.Generator().manual_seed(7)
    positions = torch.randint(0, 4000, (9,), generator=g)
    x = (torch.randn(9, 5, 32, generator=g) * 3).to(dtype).requires_grad_(autograd)
    cos, sin = rope_angles(SimpleNamespace(cache={}, positions=positions), 32, 10000.0, dtype, style)
    assert rope_pass.applies((x,), cos, sin) == (dtype != torch.float64 and not autograd)
    got = rope(x, cos, sin, style).detach()
    q, k = rope_pair(x[:, :3], x[:, 3:], cos, sin, style)
    assert torch.equal(torch.cat([q, k], dim=1).detach(), got)
    x = x.detach()
    inv = 1.0 / (10000.0 ** (torch.arange(0, 32, 2, dtype=torch.float64) / 32))
    ang = positions.to(torch.float64)[:, None] * inv[None, :]
    cdt = compute_dtype(dtype)
    c, s = ang.cos().to(cdt)[:, None], ang.sin().to(cdt)[:, None]
    xf = x.to(cdt)
    if style == "half":
        x1, x2 = xf.chunk(2, dim=-1)
        want = torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], dim=-1)
    else:
        x0, x1 = xf.unflatten(-1, (-1, 2)).unbind(-1)
        want = torch.stack([x0 * c - x1 * s, x1 * c + x0 * s], dim=-1).flatten(-2)
    assert got.dtype == dtype and torch.equal(got, want.to(dtype))


def test_ouro_gate_of_a_bf16_model_upcasts_its_head_once_and_again_after_a_write(tiny_ouro):
    """A bfloat16 Ouro computes its exit gate in fp32 from an fp32 copy of the head made once (not two casts
    every core tick; `layers.derived`, as the packed projections), the same logits as casting each time, and a
    copy made again once the head is written."""
    from loopserve.models import layers

    model = load_model(tiny_ouro, "bfloat16", "cpu").model
    head = model.model.early_exit_gate
    state = torch.randn(5, model.config.hidden_size, generator=torch.Generator().manual_seed(1)).bfloat16()

    def written_out():
        return torch.nn.functional.linear(state.float(), head.weight.float(), head.bias.float())[:, 0]

    with torch.inference_mode():  # (as the engine runs it)
        first = model.gate_logit(state)
    assert torch.equal(first, written_out())
    def copy():
        return getattr(head.weight, layers.DERIVED)[("cast", torch.float32)][1]

    kept = copy()
    assert kept.dtype == torch.float32 and not kept.is_inference()  # (usable outside inference mode too)
    assert torch.equal(model.gate_logit(state), first) and copy() is kept
    with torch.no_grad():
        head.bias.add_(1.0)
    assert torch.equal(model.gate_logit(state), written_out()) and not torch.equal(model.gate_logit(state), first)
    head.weight = torch.nn.Parameter(torch.zeros_like(head.weight), requires_grad=False)  # a new tensor, same id
    assert torch.equal(model.gate_logit(state), written_out())
    with torch.inference_mode():  # a model built in inference mode: inference tensors, no version counters
        built = load_model(tiny_ouro, "bfloat16", "cpu").model
    assert torch.equal(built.gate_logit(state), torch.nn.functional.linear(
        state.float(), built.model.early_exit_gate.weight.float(), built.model.early_exit_gate.bias.float())[:, 0])
    assert ("cast", torch.float32) in getattr(built.model.early_exit_gate.weight, layers.DERIVED)  # kept there too
