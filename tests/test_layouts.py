"""KV layouts (docs/design.md §4.1): memory per token, the read rule, and what each layout does to outputs."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from loopserve import LLM, SamplingParams
from loopserve.cache.layout import IN_FLIGHT, LAYOUTS, KVLayout
from loopserve.cache.pool import KVStore
from loopserve.models.context import build_context
from loopserve.models.layers import paged_attention
from tests.engine_helpers import huginn_state

pytestmark = pytest.mark.usefixtures("single_thread")

PROMPTS = [[5, 17, 99, 3, 250, 40, 7], [11, 200, 13, 8, 77], [300, 301, 5, 6, 7, 8, 9, 10, 11]]


# ---------------- memory per token


@pytest.mark.parametrize("dtype,elem", [(torch.float32, 4), (torch.bfloat16, 2), (torch.float64, 8)])
def test_bytes_per_token_ouro(dtype, elem):
    # Ouro-like: no prelude/coda; 2 core layers, r_max 4, 4 KV heads of 16 dims; K and V
    di = KVLayout("depth_indexed", 0, 2, 0, 4).bytes_per_token(4, 16, dtype)
    le = KVLayout("last_exited", 0, 2, 0, 4).bytes_per_token(4, 16, dtype)
    sh = KVLayout("shared", 0, 2, 0, 4).bytes_per_token(4, 16, dtype)
    assert di == 2 * (2 * 4) * 4 * 16 * elem
    assert le == di
    assert sh == 2 * 2 * 4 * 16 * elem
    assert sh * 4 == di  # shared needs 1/r_max


def test_bytes_per_token_huginn_counts_prelude_and_coda_once():
    # Huginn-like 2-4-2, r_max 32, 55 heads x 96 (the released shape), bf16
    kv = 2 * 55 * 96 * 2  # K and V bytes of one layer application
    di = KVLayout("depth_indexed", 2, 4, 2, 32).bytes_per_token(55, 96, torch.bfloat16)
    sh = KVLayout("shared", 2, 4, 2, 32).bytes_per_token(55, 96, torch.bfloat16)
    assert di == (2 + 4 * 32 + 2) * kv
    assert sh == (2 + 4 + 2) * kv
    unshared = (2 + 2) * kv
    assert (di - unshared) == 32 * (sh - unshared)  # only the core part scales with r_max
    small = KVLayout("depth_indexed", 1, 2, 1, 6)
    assert small.slots_per_token == 1 + 2 * 6 + 1
    assert KVLayout("shared", 1, 2, 1, 6).slots_per_token == 4


def test_slot_map_is_a_partition():
    for name in LAYOUTS:
        lay = KVLayout(name, 2, 3, 1, 4)
        depths = torch.arange(1, 5)
        slots = [lay.prelude_slot(i) for i in range(2)] + [lay.coda_slot(0)]
        for j in range(3):
            slots += sorted(set(lay.core_write_slot(j, depths).tolist()))
        assert sorted(slots) == list(range(lay.slots_per_token)), name


@pytest.mark.parametrize("name", LAYOUTS)
def test_a_layers_slots_are_the_first_layers_plus_its_stride(name):
    """Attention derives a batch's reads for a stage's first layer and shifts them by `layer_stride`."""
    lay = KVLayout(name, 2, 3, 2, 4)
    depth = torch.arange(1, 5)[:, None]
    key_depth = torch.tensor([[4, 1, 2, 3, IN_FLIGHT]]).expand(4, 5)
    first_slot, first_visible = lay.core_read(0, depth, key_depth)
    for j in range(3):
        slot, visible = lay.core_read(j, depth, key_depth)
        assert torch.equal(slot, first_slot + j * lay.layer_stride("core")) and torch.equal(visible, first_visible)
        assert torch.equal(lay.core_write_slot(j, depth), lay.core_write_slot(0, depth) + j * lay.layer_stride("core"))
    for j in range(2):
        for stage, slot in (("prelude", lay.prelude_slot), ("coda", lay.coda_slot)):
            assert lay.boundary_slot(stage, j) == slot(j) == slot(0) + j * lay.layer_stride(stage)


def test_unknown_layout_rejected(tiny_ouro):
    with pytest.raises(ValueError, match="kv_layout"):
        KVLayout("paged", 0, 1, 0, 4)
    with pytest.raises(ValueError, match="kv_layout"):
        LLM(model=tiny_ouro, scheduler="reference", kv_layout="paged")


# ---------------- the read rule on hand-built key depths


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_gathers_equal_plain_indexing_and_reuse_their_buffer(dtype):
    """K and V gathers equal indexing the pool; on the CPU each lands in a buffer of its own that is reused
    while big enough (a grown index gets a new one), and a V gather leaves the K result in place."""
    g = torch.Generator().manual_seed(0)
    kv = KVStore(40, 3, 2, 8, dtype)
    kv.k.copy_(torch.randn(kv.k.shape, generator=g).to(dtype))
    kv.v.copy_(torch.randn(kv.v.shape, generator=g).to(dtype))
    plain_k, plain_v = kv.k.reshape(-1, 8), kv.v.reshape(-1, 8)
    pointers = []
    for shape in [(2, 5, 7), (2, 3, 4), (2, 6, 9), (2, 6, 9)]:
        index = torch.randint(0, plain_k.shape[0], shape, generator=g)
        k = kv.keys(index)
        v = kv.values(index[:, :, :3])
        assert torch.equal(k, plain_k[index]) and torch.equal(v, plain_v[index[:, :, :3]])
        assert k.shape == (*shape, 8) and k.is_contiguous()
        pointers.append(k.data_ptr())
    assert pointers[1] == pointers[0] != pointers[2] == pointers[3]
    # a buffer made under inference mode still serves a gather outside it (an engine may step either way)
    with torch.inference_mode():
        kv.keys(torch.zeros(2, 200, dtype=torch.long))
    assert torch.equal(kv.keys(index), plain_k[index])


def test_core_read_rules():
    """Core layer 1 of 2 behind 2 prelude slots, r_max 4; keys exited at 4, 1, 2, 3, or still looping."""
    key_depth = torch.tensor([[4, 1, 2, 3, IN_FLIGHT]])
    for r in (1, 2, 3, 4):
        depth = torch.tensor([[r]])
        base = 2 + 1 * 4  # 2 prelude slots, then core layer 0's four depth slots
        slot, vis = KVLayout("depth_indexed", 2, 2, 1, 4).core_read(1, depth, key_depth)
        assert slot.tolist() == [[base + r - 1] * 5]
        assert vis.tolist() == [[4 >= r, 1 >= r, 2 >= r, 3 >= r, True]]  # keys that never ran depth r: absent
        slot, vis = KVLayout("last_exited", 2, 2, 1, 4).core_read(1, depth, key_depth)
        assert slot.tolist() == [[base + min(r, e) - 1 for e in (4, 1, 2, 3, r)]]
        assert vis.all()
        slot, vis = KVLayout("shared", 2, 2, 1, 4).core_read(1, depth, key_depth)
        assert slot.tolist() == [[2 + 1] * 5] and vis.all()  # 2 prelude slots, core layer 0's one slot


def _hand_store(layout: KVLayout, key_depths: list[int]):
    """One core layer, 1 KV head of 2 dims. V of token t in slot s is (10 t + s, 1); K is zero."""
    n = len(key_depths) + 2
    kv = KVStore(n, layout.slots_per_token, 1, 2, torch.float64)
    kv.k.zero_()  # a store is not zeroed when allocated
    for s in range(layout.slots_per_token):
        for t in range(n):
            kv.v[0, s, t] = torch.tensor([10.0 * t + s, 1.0], dtype=torch.float64)
    kv.set_depth(torch.arange(len(key_depths)), torch.tensor(key_depths))
    return kv


@pytest.mark.parametrize("host_path", [True, False], ids=["numpy-in-place", "uploaded"])
@pytest.mark.parametrize("as_tensors", [False, True], ids=["arrays", "tensors"])
def test_kv_depths_land_where_a_tensor_write_puts_them(host_path, as_tensors):
    """The engine writes a tick's exit depths from host arrays, a prelude's from its uploaded rows (on the CPU
    both in place through numpy, on a device arrays are uploaded); the store ends up as torch's own indexed
    write leaves it, a single depth broadcast too."""
    ours = KVStore(10, 2, 1, 2, torch.float32)
    if not host_path:
        ours._depth_host = None  # what a store on a device has: no numpy view of its depths
    want = ours.depth.clone()
    rows, depths = np.array([7, 2, 9, 0]), np.array([3, 1, 4, 2], np.int32)  # (another int dtype: converted)
    first = (torch.from_numpy(rows), torch.from_numpy(depths).long()) if as_tensors else (rows, depths)
    ours.set_depth(*first)
    want[torch.from_numpy(rows)] = torch.from_numpy(depths).long()
    ours.set_depth(torch.tensor([5, 2]) if as_tensors else np.array([5, 2]), IN_FLIGHT)
    want[torch.tensor([5, 2])] = IN_FLIGHT
    ours.set_depth(torch.tensor([1, 3], dtype=torch.int32), np.int64(6))  # int32 rows, a numpy int
    want[torch.tensor([1, 3])] = 6
    assert torch.equal(ours.depth, want)
    assert ours.depth[[7, 2, 9, 0, 5]].tolist() == [3, IN_FLIGHT, 4, 2, IN_FLIGHT]


@pytest.mark.parametrize("name", LAYOUTS)
def test_paged_attention_reads_what_the_layout_allows(name):
    """A query with q = 0 averages the V rows it may see: the mean names exactly the slots read."""
    layout = KVLayout(name, 0, 1, 0, 3)
    key_depths = [3, 1, 2]  # tokens 0..2 exited at these depths
    kv = _hand_store(layout, key_depths)
    rows = torch.arange(kv.capacity)
    r = 2
    own_v = torch.tensor([[[-7.0, 1.0]]], dtype=torch.float64)
    ctx = build_context(kv, layout, [(rows, 3, 1)], depth=torch.tensor([r]))
    kv.set_depth(ctx.write_rows, IN_FLIGHT)
    q = torch.zeros(1, 1, 2, dtype=torch.float64)
    out = paged_attention(q, torch.zeros(1, 1, 2, dtype=torch.float64), own_v, ctx, "core", 0)
    if name == "depth_indexed":  # slot r-1 = 1 of the keys that ran depth 2; token 1 (depth 1) is absent
        seen = [10 * 0 + 1, 10 * 2 + 1, -7]
    elif name == "last_exited":  # slot min(r, e) - 1
        seen = [10 * 0 + 1, 10 * 1 + 0, 10 * 2 + 1, -7]
    else:  # one slot, everyone's latest KV
        seen = [0, 10, 20, -7]
    assert out[0, 0].item() == pytest.approx(sum(seen) / len(seen))
    assert out[0, 1].item() == pytest.approx(1.0)
    # the row wrote its own V into the slot of the depth it computed
    assert kv.v[0, layout.core_write_slot(0, torch.tensor(r)), 3, 0].item() == -7.0


def test_paged_attention_chunk_reads_own_chunk_at_current_depth():
    """A two-row prefill chunk at depth 2 under depth_indexed: each row sees earlier fully-run keys and
    the chunk's own depth-2 KV, causally."""
    layout = KVLayout("depth_indexed", 0, 1, 0, 3)
    kv = _hand_store(layout, [3, 3])
    rows = torch.arange(kv.capacity)
    ctx = build_context(kv, layout, [(rows, 2, 2)], depth=torch.tensor([2, 2]))
    kv.set_depth(ctx.write_rows, IN_FLIGHT)
    own_v = torch.tensor([[[-5.0, 1.0]], [[-9.0, 1.0]]], dtype=torch.float64)
    out = paged_attention(torch.zeros(2, 1, 2, dtype=torch.float64), torch.zeros(2, 1, 2, dtype=torch.float64),
                          own_v, ctx, "core", 0)
    assert out[0, 0].item() == pytest.approx((1 + 11 - 5) / 3)
    assert out[1, 0].item() == pytest.approx((1 + 11 - 5 - 9) / 4)


# ---------------- what layouts do to outputs


def _run(path, layout: str, prompts, chunk: int = 512, dtype: str = "float64", **params):
    llm = LLM(model=path, scheduler="reference", kv_layout=layout, dtype=dtype, state_init=huginn_state(path),
              prefill_chunk_size=chunk)
    params.setdefault("temperature", 0)
    params.setdefault("ignore_eos", True)
    params.setdefault("logprobs", 3)
    return [o.outputs[0] for o in llm.generate(prompts, SamplingParams(**params))]


def _logprob_rows(out) -> list[list[tuple[int, float]]]:
    return [sorted((t, lp.logprob) for t, lp in row.items()) for row in out.logprobs]


def _max_logprob_gap(a, b) -> float:
    """Largest logprob difference over tokens both outputs list (inf when the token streams differ)."""
    if a.token_ids != b.token_ids:
        return float("inf")
    gap = 0.0
    for ra, rb in zip(a.logprobs, b.logprobs, strict=True):
        for t in ra.keys() & rb.keys():
            gap = max(gap, abs(ra[t].logprob - rb[t].logprob))
    return gap


@pytest.mark.parametrize("fixture", ["tiny_ouro", "tiny_huginn"])
def test_full_depth_depth_indexed_equals_last_exited(request, fixture):
    path = request.getfixturevalue(fixture)
    a = _run(path, "depth_indexed", PROMPTS, max_tokens=6, exit_policy="fixed")
    b = _run(path, "last_exited", PROMPTS, max_tokens=6, exit_policy="fixed")
    for x, y in zip(a, b, strict=True):
        assert x.token_ids == y.token_ids
        assert _logprob_rows(x) == _logprob_rows(y)  # same slots read: bit-identical
        assert x.exit_depths == y.exit_depths


def test_layouts_with_early_exits_are_deterministic_and_differ(tiny_ouro):
    found = False
    for q in (0.3, 0.6, 0.9):
        runs = {}
        for layout in LAYOUTS:
            first = _run(tiny_ouro, layout, PROMPTS, max_tokens=8, exit_threshold=q)
            again = _run(tiny_ouro, layout, PROMPTS, max_tokens=8, exit_threshold=q)
            for x, y in zip(first, again, strict=True):
                assert x.token_ids == y.token_ids and x.exit_depths == y.exit_depths
                assert _logprob_rows(x) == _logprob_rows(y)
            runs[layout] = first
        for di, le in zip(runs["depth_indexed"], runs["last_exited"], strict=True):
            if min(di.exit_depths[1:]) < max(di.exit_depths) and _max_logprob_gap(di, le) > 1e-9:
                found = True
        if found:
            break
    assert found, "last_exited never differed from depth_indexed on a workload with early exits"


def test_forced_exits_separate_layouts_on_huginn(tiny_huginn):
    """Same forced exit depths (trace), three read rules, three different results."""
    trace = [2, 1, 3, 2, 4, 1]
    outs = {layout: _run(tiny_huginn, layout, [PROMPTS[0]], max_tokens=7, exit_trace=trace)[0] for layout in LAYOUTS}
    for o in outs.values():
        assert o.exit_depths[1:] == trace
    assert _max_logprob_gap(outs["depth_indexed"], outs["last_exited"]) > 1e-9
    assert _max_logprob_gap(outs["depth_indexed"], outs["shared"]) > 1e-9


@pytest.mark.parametrize("fixture", ["tiny_ouro", "tiny_huginn"])
def test_prefill_chunking_only_matters_for_shared(request, fixture):
    """Documented in loopserve/engine/reference.py: a prompt is prefilled in fixed chunks, all tokens of
    a chunk moving depth by depth together. depth_indexed / last_exited keep every depth, so chunking
    cannot change anything; shared keeps only the latest KV, so chunk size 1 (each earlier token already
    at full depth) differs from one chunk (earlier tokens at the query's depth)."""
    prompt = PROMPTS[2]
    for layout in ("depth_indexed", "last_exited"):
        ref = _run(path := request.getfixturevalue(fixture), layout, [prompt], chunk=64, max_tokens=5,
                   exit_policy="fixed")[0]
        for chunk in (1, 3):
            out = _run(path, layout, [prompt], chunk=chunk, max_tokens=5, exit_policy="fixed")[0]
            assert out.token_ids == ref.token_ids
            assert _max_logprob_gap(out, ref) < 1e-10, (layout, chunk)
    one_chunk = _run(path, "shared", [prompt], chunk=64, max_tokens=5, exit_policy="fixed")[0]
    per_token = _run(path, "shared", [prompt], chunk=1, max_tokens=5, exit_policy="fixed")[0]
    first_a = {t: lp.logprob for t, lp in one_chunk.logprobs[0].items()}
    first_b = {t: lp.logprob for t, lp in per_token.logprobs[0].items()}
    common = first_a.keys() & first_b.keys()
    assert first_a.keys() != first_b.keys() or max(abs(first_a[t] - first_b[t]) for t in common) > 1e-6
    # shared with one whole-prompt chunk prefills exactly like depth_indexed: the first token agrees
    di = _run(path, "depth_indexed", [prompt], chunk=64, max_tokens=1, exit_policy="fixed")[0]
    assert _max_logprob_gap(di, _run(path, "shared", [prompt], chunk=64, max_tokens=1, exit_policy="fixed")[0]) \
        < 1e-10
