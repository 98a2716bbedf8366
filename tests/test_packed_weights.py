"""bfloat16 projections on the CPU through oneDNN copies of their weights reordered once (`layers.pack_linear_weights`):
the same bits as `F.linear` at every row count, packed again after an in-place write, used by a bfloat16 model that
`load_model` builds on the CPU, whose engine still equals the sequential reference decoder."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from loopserve.engine.config import EngineConfig
from loopserve.engine.engine import LLMEngine
from loopserve.engine.reference import ReferenceDecoder
from loopserve.models import layers
from loopserve.models.loader import load_model
from loopserve.sampling_params import SamplingParams
from tests.engine_helpers import huginn_state

CPU = torch.device("cpu")
needs_packing = pytest.mark.skipif(not layers.can_pack_linear_weights(torch.bfloat16, CPU),
                                   reason="oneDNN without bfloat16 on this CPU")


def _packed_sizes(w: torch.Tensor) -> set[tuple[int, ...]]:
    """The part sizes `w` has packed copies for."""
    return {key[1] for key in getattr(w, layers.DERIVED, {}) if key[0] == "onednn"}


def _packed_module(out_features: int, in_features: int, seed: int) -> nn.Linear:
    g = torch.Generator().manual_seed(seed)
    m = nn.Linear(in_features, out_features, bias=False).requires_grad_(False)
    m.weight.copy_(torch.randn(out_features, in_features, generator=g).to(torch.bfloat16).float())
    m = m.to(torch.bfloat16)
    layers.pack_linear_weights(m)
    return m


@needs_packing
@pytest.mark.parametrize("out_features,in_features", [(48, 64), (96, 40), (2304, 768)])
def test_packed_products_are_f_linear_bit_for_bit(out_features, in_features):
    w = _packed_module(out_features, in_features, out_features).weight
    sizes = [out_features // 2, out_features // 4, out_features - out_features // 2 - out_features // 4]
    g = torch.Generator().manual_seed(1)
    for rows in (0, 1, 2, 7, 8, 9, 31, 32, 33, 100):
        x = torch.randn(rows, in_features, generator=g).to(torch.bfloat16)
        assert torch.equal(layers.linear(x, w), F.linear(x, w))
        for got, want in zip(layers.stacked_linear(x, w, sizes), F.linear(x, w).split(sizes, dim=-1), strict=True):
            assert torch.equal(got, want)
    x3 = torch.randn(3, 5, in_features, generator=g).to(torch.bfloat16)
    strided = torch.randn(40, in_features, generator=g).to(torch.bfloat16)[::3]
    for x in (x3, strided):
        assert torch.equal(layers.linear(x, w), F.linear(x, w))
    assert _packed_sizes(w) == {(out_features,), tuple(sizes)}  # the whole weight and the stacked parts, once each


@needs_packing
def test_a_weight_written_in_place_is_packed_again():
    w = _packed_module(48, 64, 3).weight
    x = torch.randn(5, 64).to(torch.bfloat16)
    before = layers.linear(x, w)
    with torch.no_grad():
        w.mul_(2)
    assert torch.equal(layers.linear(x, w), F.linear(x, w)) and not torch.equal(layers.linear(x, w), before)


def test_a_copy_is_made_again_once_module_to_replaces_the_weights_data():
    # `Module.to` converts a parameter by swapping its data: the same object, its attributes and its version counter
    # stay, so a copy checked by the version alone came back made from the old data (on a move to CUDA: on the CPU)
    m = nn.Linear(4, 3, bias=False).requires_grad_(False)
    w = m.weight
    first = layers.derived(w, ("copy",), lambda t: t.clone())
    m.to(torch.float64)
    assert m.weight is w  # (what makes the stale copy possible)
    again = layers.derived(m.weight, ("copy",), lambda t: t.clone())
    assert first.dtype == torch.float32 and again.dtype == torch.float64 and torch.equal(again, m.weight)


@needs_packing
def test_weights_made_under_inference_mode_are_packed_too():
    with torch.inference_mode():  # (inference tensors have no version counter)
        m = nn.Linear(64, 48, bias=False).to(torch.bfloat16).requires_grad_(False)
    layers.pack_linear_weights(m)
    x = torch.randn(3, 64).to(torch.bfloat16)
    assert torch.equal(layers.linear(x, m.weight), F.linear(x, m.weight)) and _packed_sizes(m.weight)


@needs_packing
def test_a_product_autograd_differentiates_goes_through_f_linear():
    w = _packed_module(48, 64, 4).weight
    x = torch.randn(5, 64).to(torch.bfloat16).requires_grad_(True)
    layers.linear(x, w).sum().backward()  # (the packed product has no backward)
    assert x.grad is not None and not _packed_sizes(w)
    with torch.no_grad():
        assert torch.equal(layers.linear(x, w), F.linear(x, w)) and _packed_sizes(w)


def test_only_bfloat16_weights_on_the_cpu_are_packed(tiny_ouro):
    fp32 = load_model(tiny_ouro, "float32", "cpu").model
    assert not any(hasattr(p, layers.PACKED) for p in fp32.parameters())
    x = torch.randn(4, fp32.config.hidden_size)
    w = next(p for p in fp32.parameters() if p.dim() == 2)
    assert torch.equal(layers.linear(x[:, : w.shape[1]], w), F.linear(x[:, : w.shape[1]], w))


@needs_packing
@pytest.mark.parametrize("fixture", ["tiny_ouro", "tiny_huginn"])
@pytest.mark.parametrize("scheduler", ["cdb", "cb"])
def test_a_bfloat16_engine_with_packed_weights_equals_the_reference(request, fixture, scheduler):
    path = request.getfixturevalue(fixture)
    loaded = load_model(path, "bfloat16", "cpu", huginn_state(path))
    projections = [p for p in loaded.model.parameters() if hasattr(p, layers.PACKED)]
    assert projections
    engine = LLMEngine(loaded.model, loaded.tokenizer, EngineConfig(scheduler=scheduler, kv_cache_tokens=1024,
                                                                    max_decode_batch=6))
    prompts = [[(7 * i + 3 * j) % 200 + 1 for j in range(5 + 3 * i)] for i in range(6)]
    params = [SamplingParams(max_tokens=10, temperature=0.0 if i % 2 else 0.8, seed=i, ignore_eos=True)
              for i in range(6)]
    for i, (prompt, p) in enumerate(zip(prompts, params, strict=True)):
        engine.add_request(f"r{i}", prompt, p, seed=i)
    outs = {}
    while engine.has_unfinished_requests():
        outs.update((o.request_id, o) for o in engine.step() if o.finished)
    assert any(_packed_sizes(p) for p in projections)  # the products went through packed copies
    decoder = ReferenceDecoder(engine.model, engine.layout, engine.cfg.prefill_chunk_size)
    for i, (prompt, p) in enumerate(zip(prompts, params, strict=True)):
        ref = decoder.run(engine.make_sequence(f"r{i}", prompt, p, seed=i))
        c = outs[f"r{i}"].outputs[0]
        assert (c.token_ids, c.exit_depths) == (ref.output_ids, ref.exit_depths)


@needs_packing
def test_a_traced_product_is_f_linear_not_the_packed_op():
    """`torch.compile` traces `F.linear`, which inductor lowers, not oneDNN's packed product, which it cannot (`bench
    compile` failed in bfloat16); eager calls still take the packed one."""
    w = _packed_module(48, 64, 5).weight
    graphs: list[torch.fx.GraphModule] = []

    def capture(gm: torch.fx.GraphModule, inputs):
        graphs.append(gm)
        return gm.forward

    x = torch.randn(4, 64).to(torch.bfloat16)
    traced = torch.compile(lambda a: layers.linear(a, w) + layers.stacked_linear(a, w, [16, 32])[1].sum(),
                           backend=capture, fullgraph=True)
    with torch.inference_mode():
        got = traced(x)
    targets = {str(node.target) for gm in graphs for node in gm.graph.nodes}
    assert graphs and not any("linear_pointwise" in t for t in targets), targets
    assert torch.equal(got, F.linear(x, w) + F.linear(x, w[16:48]).sum())
    torch._dynamo.reset()
