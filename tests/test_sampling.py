"""SamplingParams validation, the sampler's filters on hand-built logits, and stop / length / logprob
behaviour of whole requests."""

from __future__ import annotations

import math
import time

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from loopserve import LLM, SamplingParams
from loopserve.engine.sampler import (
    Sample,
    SampledBatch,
    _sorted_nucleus,
    argmax_rows,
    filtered_probs,
    finite_rows,
    nucleus,
    sample_batch,
    sample_one,
    top_logprobs,
    unpack,
)
from loopserve.random_streams import uniforms
from tests.engine_helpers import check_finite_rows

pytestmark = pytest.mark.usefixtures("single_thread")

PROMPTS = [[5, 17, 99, 3, 250, 40, 7], [11, 200, 13, 8, 77], [300, 301, 5, 6, 7, 8, 9, 10, 11]]
P = torch.tensor([0.5, 0.25, 0.15, 0.1], dtype=torch.float64)
LOGITS = P.log() + 3.0  # a constant shift changes nothing


# ---------------- validation


@pytest.mark.parametrize("field,kwargs", [
    ("n", {"n": 0}),
    ("max_tokens", {"max_tokens": 0}),
    ("max_tokens", {"max_tokens": 2.5}),
    ("temperature", {"temperature": -0.1}),
    ("temperature", {"temperature": "hot"}),
    ("top_p", {"top_p": 0.0}),
    ("top_p", {"top_p": 1.5}),
    ("top_k", {"top_k": -2}),
    ("top_k", {"top_k": 1.5}),
    ("min_p", {"min_p": 1.5}),
    ("seed", {"seed": "abc"}),
    ("stop", {"stop": [""]}),
    ("stop", {"stop": ["ok", 3]}),
    ("stop_token_ids", {"stop_token_ids": [-1]}),
    ("logprobs", {"logprobs": -2}),
    ("logprobs", {"logprobs": 1.5}),
    ("prompt_logprobs", {"prompt_logprobs": -3}),
    ("min_loops", {"min_loops": 0}),
    ("max_loops", {"max_loops": 0}),
    ("min_loops", {"min_loops": 3, "max_loops": 2}),
    ("exit_threshold", {"exit_threshold": -0.5}),
    ("exit_threshold", {"exit_policy": "gate", "exit_threshold": 1.5}),
    ("exit_policy", {"exit_policy": "sometimes"}),
    ("exit_trace", {"exit_trace": [2, 0]}),
    ("exit_policy", {"exit_trace": [2], "exit_policy": "gate"}),
    ("exit_trace", {"exit_policy": "trace"}),  # nothing to replay: it ran at full depth unsaid
    ("exit_threshold", {"exit_policy": "lookahead_gate", "exit_threshold": 1.5}),  # (at construction, as gate's)
    ("exit_threshold", {"exit_policy": "lookahead_gate", "exit_threshold": 0}),
    ("num_speculative_tokens", {"num_speculative_tokens": -1}),
    ("num_speculative_tokens", {"num_speculative_tokens": 1.5}),
    ("num_speculative_tokens", {"num_speculative_tokens": "2"}),
    ("num_speculative_tokens", {"num_speculative_tokens": True}),
    ("logit_bias", {"logit_bias": {"1" * 5000: 1.0}}),  # (was Python's message on converting 4,300+ digits)
    ("logit_bias", {"logit_bias": {"9" * 20: 1.0}}),
])
def test_bad_field_is_named(field, kwargs):
    with pytest.raises(ValueError) as e:
        SamplingParams(**kwargs)
    assert str(e.value).startswith(field), str(e.value)


def test_valid_params_normalise():
    p = SamplingParams(stop="END", exit_trace=[1, 2])
    assert p.stop == ["END"] and p.exit_policy == "trace"
    assert SamplingParams(temperature=0).greedy and not SamplingParams().greedy
    SamplingParams(top_k=0, top_p=1.0, min_p=0.0, logprobs=0, max_tokens=None, num_speculative_tokens=0)  # all allowed


def test_request_checked_against_the_model(tiny_ouro):
    llm = LLM(model=tiny_ouro, scheduler="reference")
    r_max = llm.config.r_max
    with pytest.raises(ValueError, match="max_loops"):
        llm.generate([PROMPTS[0]], SamplingParams(max_loops=r_max + 1))
    with pytest.raises(ValueError, match="min_loops"):
        llm.generate([PROMPTS[0]], SamplingParams(min_loops=r_max + 1))
    with pytest.raises(ValueError, match="prompt"):
        llm.generate([[]], SamplingParams())
    with pytest.raises(ValueError, match="prompt_token_ids"):
        llm.generate([[1, 2, 10_000]], SamplingParams())


def test_prompt_token_ids_as_numpy_or_torch(tiny_ouro):
    """A TokensPrompt's ids as a numpy array, a list of numpy integers or a 1-d tensor are its list (they were refused:
    "must be a list of integers", though SamplingParams takes numpy's numbers); other shapes and types still are."""
    llm = LLM(model=tiny_ouro, scheduler="reference")
    ids = [5, 17, 99, 3]
    params = SamplingParams(max_tokens=3, temperature=0)
    want = llm.generate({"prompt_token_ids": ids}, params, use_tqdm=False)[0].outputs[0].token_ids
    for sent in (np.array(ids), [np.int64(i) for i in ids], np.array(ids, np.int32), torch.tensor(ids)):
        out = llm.generate({"prompt_token_ids": sent}, params, use_tqdm=False)[0]
        assert out.outputs[0].token_ids == want and out.prompt_token_ids == ids, type(sent)
    for bad in (np.array([ids]), np.array([1.0, 2.0]), torch.tensor(3), (5, 17)):
        with pytest.raises(ValueError, match="^prompt_token_ids: must be a list of integers"):
            llm.generate({"prompt_token_ids": bad}, params, use_tqdm=False)


# ---------------- the sampler on hand-built logits


def probs(**kw) -> list[float]:
    p = SamplingParams(**kw)
    vocab = LOGITS.numel()
    return filtered_probs(LOGITS[None], torch.tensor([p.temperature], dtype=torch.float64),
                          torch.tensor([p.top_k if 0 < p.top_k < vocab else vocab]),
                          torch.tensor([p.top_p], dtype=torch.float64),
                          torch.tensor([p.min_p], dtype=torch.float64))[0].tolist()


def close(a, b, tol=1e-12) -> bool:
    return all(abs(x - y) < tol for x, y in zip(a, b, strict=True))


def test_no_filter_is_softmax():
    assert close(probs(), P.tolist())


def test_temperature_scales_logits():
    for t in (0.5, 2.0):
        w = [p ** (1 / t) for p in P.tolist()]
        assert close(probs(temperature=t), [x / sum(w) for x in w])


def test_top_k():
    assert close(probs(top_k=1), [1, 0, 0, 0])
    assert close(probs(top_k=2), [2 / 3, 1 / 3, 0, 0])
    assert close(probs(top_k=3), [0.5 / 0.9, 0.25 / 0.9, 0.15 / 0.9, 0])
    assert close(probs(top_k=-1), probs(top_k=0)) and close(probs(top_k=10), P.tolist())


def test_top_p_keeps_the_smallest_prefix_reaching_p():
    assert close(probs(top_p=0.45), [1, 0, 0, 0])
    assert close(probs(top_p=0.6), [2 / 3, 1 / 3, 0, 0])
    assert close(probs(top_p=0.8), [0.5 / 0.9, 0.25 / 0.9, 0.15 / 0.9, 0])
    assert close(probs(top_p=0.95), P.tolist())


def test_min_p_is_relative_to_the_top_token():
    assert close(probs(min_p=0.4), [2 / 3, 1 / 3, 0, 0])  # keeps p >= 0.2
    assert close(probs(min_p=0.25), [0.5 / 0.9, 0.25 / 0.9, 0.15 / 0.9, 0])  # keeps p >= 0.125
    assert close(probs(min_p=1.0), [1, 0, 0, 0])


def test_filters_compose_after_temperature():
    # temperature 2 -> weights sqrt(p); top_k 3 then top_p over the renormalised three
    w = [math.sqrt(p) for p in P.tolist()[:3]]
    q = [x / sum(w) for x in w]
    assert q[0] < 0.6 < q[0] + q[1]  # so top_p=0.6 keeps exactly two
    got = probs(temperature=2.0, top_k=3, top_p=0.6)
    assert close(got, [q[0] / (q[0] + q[1]), q[1] / (q[0] + q[1]), 0, 0])


def test_min_p_comes_before_top_p():
    """vLLM V1's order: min-p (an argmax-invariant logits processor) filters first, then top-p takes its nucleus of
    what is left, renormalized. min_p 0.3 keeps p >= 0.15: {0.5, 0.25, 0.15} / 0.9; top_p 0.8 of those: the mass
    before the third is 0.75 / 0.9 = 0.83, not under 0.8, so two are kept; top-p over the whole row first would
    keep three (0.75 is under 0.8), and so would min-p after it."""
    assert close(probs(min_p=0.3, top_p=0.8), [2 / 3, 1 / 3, 0, 0])
    assert close(probs(top_p=0.8), [0.5 / 0.9, 0.25 / 0.9, 0.15 / 0.9, 0])
    assert close(probs(min_p=0.3), [0.5 / 0.9, 0.25 / 0.9, 0.15 / 0.9, 0])


def test_a_rows_distribution_does_not_depend_on_its_neighbours_filters():
    """Bit for bit, a row's filtered distribution alone (as the reference decoder samples it) and beside rows that
    use min-p, top-p or both (the renormalization between them is the rows' own, not the batch's)."""
    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(6, 300, generator=gen, dtype=torch.float64) * 3
    rows = [(1.0, 300, 0.9, 0.0), (1.0, 300, 1.0, 0.05), (0.7, 300, 0.8, 0.1), (1.3, 40, 0.95, 0.02),
            (1.0, 300, 1.0, 0.0), (2.0, 300, 0.5, 0.3)]

    def filtered(idx: list[int]) -> torch.Tensor:
        t, k, p, m = (torch.tensor([rows[i][j] for i in idx], dtype=torch.long if j == 1 else torch.float64)
                      for j in range(4))
        return filtered_probs(logits[idx], t, k, p, m)

    together = filtered(list(range(len(rows))))
    for i in range(len(rows)):
        assert torch.equal(filtered([i]), together[i:i + 1]), i


def test_sample_greedy_and_support():
    assert sample_one(LOGITS, SamplingParams(temperature=0), 1, 0).token == 0
    assert sample_one(torch.tensor([0.0, 5.0, 1.0]), SamplingParams(temperature=0), 1, 0).token == 1
    draws = [sample_one(LOGITS, SamplingParams(top_k=2), 7, i).token for i in range(600)]
    assert set(draws) == {0, 1}
    assert abs(draws.count(0) / 600 - 2 / 3) < 0.08
    a = [sample_one(LOGITS, SamplingParams(), 5, i).token for i in range(50)]
    assert a == [sample_one(LOGITS, SamplingParams(), 5, i).token for i in range(50)]
    assert a != [sample_one(LOGITS, SamplingParams(), 6, i).token for i in range(50)]


def test_counter_uniforms_on_the_host_are_the_devices_bit_for_bit():
    """The sampler draws on the host with numpy what Huginn's states draw with torch: the same stream."""
    rng = np.random.default_rng(0)
    info = np.iinfo(np.int64)
    seeds = rng.integers(info.min, info.max, 5000, dtype=np.int64, endpoint=True)
    seeds[:4] = [info.min, info.max, 0, -1]
    counters = rng.integers(0, 1 << 40, 5000, dtype=np.int64)
    host = uniforms(seeds, counters)
    assert host.dtype == np.float64 and ((host >= 0) & (host < 1)).all()
    assert np.array_equal(host, uniforms(torch.from_numpy(seeds), torch.from_numpy(counters)).numpy())


def test_counter_uniforms_are_uniform_and_independent_per_stream():
    u = uniforms(torch.full((20000,), 12345), torch.arange(20000))
    assert 0 <= float(u.min()) and float(u.max()) < 1
    assert abs(float(u.mean()) - 0.5) < 0.01 and abs(float(u.var()) - 1 / 12) < 0.003
    for b in range(10):  # the fraction in each tenth
        assert abs(float(((u >= b / 10) & (u < (b + 1) / 10)).double().mean()) - 0.1) < 0.01
    v = uniforms(torch.arange(20000), torch.zeros(20000, dtype=torch.long))  # across seeds, same counter
    assert abs(float(v.mean()) - 0.5) < 0.01 and abs(float(torch.corrcoef(torch.stack([u, v]))[0, 1])) < 0.03


def test_like_init_states_are_a_truncated_normal_drawn_per_seed(monkeypatch):
    """Huginn's random initial state (`like-init`): a token's row is a function of its seed alone (drawn alone
    or in any batch, in any order), element j from the counter stream (seed, j); over many rows, a normal of std
    sqrt(2/5) cut at 3 std (the truncation lowers the std by 1.3 %)."""
    from loopserve.models.huginn import like_init_state

    seeds = [(i * 0x9E3779B97F4A7C15) & ((1 << 63) - 1) for i in range(1, 1201)]
    rows = like_init_state(seeds, 64, torch.float64, "cpu")
    assert rows.shape == (1200, 64)
    alone = torch.cat([like_init_state([s], 64, torch.float64, "cpu") for s in seeds[:5]])
    assert torch.equal(alone, rows[:5])
    assert torch.equal(like_init_state(seeds[4::-1], 64, torch.float64, "cpu"), rows[:5].flip(0))
    assert not torch.equal(rows[0], rows[1])
    cut = 3 * math.sqrt(2 / 5)
    assert float(rows.abs().max()) <= cut and float(rows.abs().max()) > 0.9 * cut
    assert abs(float(rows.mean())) < 0.01 and abs(float(rows.std()) - math.sqrt(2 / 5) * 0.9866) < 0.01
    assert like_init_state(seeds[:2], 8, torch.float32, "cpu").dtype == torch.float32
    monkeypatch.setattr("loopserve.models.huginn._DRAW_ELEMENTS", 3 * 64)  # drawn three rows at a time
    assert torch.equal(like_init_state(seeds[:10], 64, torch.float64, "cpu"), rows[:10])


def test_batch_sampling_is_batch_invariant():
    """A row draws the same token alone or among any neighbours, at any position in the batch."""
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(12, 50, generator=g, dtype=torch.float64) * 3
    params = [SamplingParams(temperature=t, top_k=k, top_p=tp, min_p=mp, logprobs=lp)
              for t, k, tp, mp, lp in [(0.0, -1, 1.0, 0.0, None), (1.0, -1, 1.0, 0.0, 2), (0.7, 5, 1.0, 0.0, None),
                                       (1.3, -1, 0.8, 0.0, 0), (1.0, 10, 0.9, 0.05, 3), (0.5, -1, 1.0, 0.2, None)] * 2]
    seeds, counters = list(range(100, 112)), [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 8]
    whole = unpack(sample_batch(logits, params, seeds, counters), params)
    for i in range(12):
        assert sample_one(logits[i], params[i], seeds[i], counters[i]) == whole[i]
    perm = list(reversed(range(12)))
    shuffled = unpack(sample_batch(logits[perm], [params[i] for i in perm], [seeds[i] for i in perm],
                                   [counters[i] for i in perm]), [params[i] for i in perm])
    assert [shuffled[perm.index(i)] for i in range(12)] == whole


def test_sampled_batch_gives_each_row_the_sample_it_draws_alone():
    """`SampledBatch` (what a coda batch reads): its arrays hold every row's token and whether it may be
    taken, and row j's `Sample` is the one row j samples alone (logprobs in place, rows asking for none or
    for different k among them), from the device result or from `sample_rows`' row-by-row fallback."""
    g = torch.Generator().manual_seed(2)
    logits = torch.randn(7, 30, generator=g, dtype=torch.float64)
    logits[2, 3] = float("nan")  # (a row asking for no logprobs: a non-finite row's are not defined)
    params = [SamplingParams(temperature=t, logprobs=lp) for t, lp in
              [(0.0, None), (1.0, 3), (0.8, None), (0.0, 0), (1.0, 2), (0.0, 5), (1.2, None)]]
    seeds, counters = list(range(7)), [0, 1, 2, 3, 4, 5, 6]
    host = sample_batch(logits, params, seeds, counters)
    rows = [sample_one(logits[j], params[j], seeds[j], counters[j]) for j in range(7)]
    for batch in (SampledBatch(host, params), SampledBatch(None, [], rows=rows)):
        assert len(batch) == 7 and list(batch) == rows
        assert [batch[j] for j in (6, 1, 4, 1)] == [rows[j] for j in (6, 1, 4, 1)]  # any order, twice
        assert batch.tokens.tolist() == [r.token for r in rows]
        assert batch.ok.tolist() == [j != 2 for j in range(7)]
    failed = [*rows[:2], Sample(0, True, error="ValueError: bad")]
    assert SampledBatch(None, [], rows=failed).ok.tolist() == [True, True, False]


def test_logprobs_list_top_k_and_the_sampled_token():
    s = sample_one(LOGITS, SamplingParams(temperature=0, logprobs=2), 1, 0)
    assert s.token == 0 and s.rank == 1 and abs(s.logprob - math.log(0.5)) < 1e-12
    assert [t for t, _ in s.top] == [0, 1]
    assert abs(s.top[1][1] - math.log(0.25)) < 1e-12
    flat = torch.tensor([0.0, 3.0, 3.0 + math.log(0.5), 3.0 + math.log(0.25)], dtype=torch.float64)
    s = sample_one(flat, SamplingParams(temperature=0, logprobs=0), 1, 0)
    assert s.token == 1 and s.top == [] and s.rank == 1


def test_a_tied_token_takes_the_last_of_the_tied_ranks():
    """vLLM V1 ranks a token by the count of tokens whose logprob is at least its own: three tied at the top are
    each rank 3 (bfloat16 logits tie often)."""
    tied = torch.tensor([1.0, 2.0, 2.0, 2.0, 0.5], dtype=torch.float64)
    for seed in range(8):  # (whichever of the three is drawn)
        s = sample_one(tied, SamplingParams(temperature=1.0, top_k=3, logprobs=1), seed, 0)
        assert s.token in (1, 2, 3) and s.rank == 3
    assert sample_one(tied, SamplingParams(temperature=0, logprobs=0), 1, 0).rank == 3
    assert sample_one(torch.tensor([3.0, 1.0, 2.0]), SamplingParams(temperature=0, logprobs=0), 1, 0).rank == 1


def test_non_finite_rows_are_flagged_not_sampled():
    logits = torch.tensor([[0.0, 1.0, 2.0], [0.0, float("nan"), 1.0], [float("inf"), 0.0, 0.0]])
    params = [SamplingParams(temperature=1.0)] * 3
    rows = unpack(sample_batch(logits, params, [1, 2, 3], [0, 0, 0]), params)
    assert [r.finite for r in rows] == [True, False, False]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_finite_rows_equals_isfinite_all(dtype):
    """The scaled-sum finiteness check flags exactly the rows `isfinite(...).all` flags, extremes included."""
    check_finite_rows(dtype)


@settings(max_examples=150, deadline=None)
@given(rows=st.integers(1, 9), vocab=st.integers(1, 300), dtype=st.sampled_from([torch.float32, torch.float64]),
       bad=st.lists(st.tuples(st.integers(0, 8), st.integers(0, 299), st.sampled_from(["nan", "inf", "-inf"])),
                    max_size=5),
       view=st.sampled_from(["whole", "transposed", "every_other"]), seed=st.integers(0, 2**16))
def test_finite_rows_any_shape_and_view(rows, vocab, dtype, bad, view, seed):
    """The CPU's compiled finiteness pass flags exactly the rows `isfinite(...).all` flags, whatever the shape
    (the vectorized body and its remainder), where a non-finite value lies, and however the logits are laid
    out (a transposed copy, a strided slice), next to values near the dtype's largest."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, vocab, generator=g, dtype=torch.float64).to(dtype) * torch.finfo(dtype).max / 8
    for i, j, v in bad:
        x[i % rows, j % vocab] = float(v)
    if view == "transposed":
        x = x.t().contiguous().t()
    elif view == "every_other":
        x = x[:, ::2]
    assert torch.equal(finite_rows(x), torch.isfinite(x).all(-1))


def test_finite_rows_keeps_to_the_calling_thread():
    """On the CPU the check is one compiled pass on the caller's thread: numpy's matrix-vector product had
    woken OpenBLAS's worker threads, which shared the product and then spun for milliseconds after each call,
    a core taken from everything else (docs/benchmarks.md section 8.49)."""
    x = torch.randn(256, 4096)
    finite_rows(x)
    own, total = time.thread_time(), time.process_time()
    for _ in range(100):
        finite_rows(x)
    own, total = time.thread_time() - own, time.process_time() - total
    assert total - own < 0.2 * own + 0.001, (own, total)  # (other threads: OpenBLAS's had about 0.9 * own)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_plain_greedy_batch_takes_the_float64_argmax(dtype):
    """A batch of plain greedy rows is sampled without the float64 copy, to the same tokens, ties
    included (the first maximum), and a non-finite row is still flagged."""
    g = torch.Generator().manual_seed(1)
    logits = torch.randint(-3, 4, (40, 50), generator=g).to(dtype)  # many ties
    logits[5, 7] = float("nan")
    plain = [SamplingParams(temperature=0.0)] * 40
    got = sample_batch(logits, plain, [0] * 40, [0] * 40)
    ties = sample_batch(logits, [SamplingParams(temperature=0.0, logprobs=0)] * 40, [0] * 40, [0] * 40)  # float64 path
    keep = torch.arange(40) != 5
    assert torch.equal(got["tokens"][keep], logits.double().argmax(-1)[keep])
    assert torch.equal(got["tokens"][keep], ties["tokens"][keep])
    assert got["finite"].tolist() == [i != 5 for i in range(40)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_argmax_rows_is_torchs_argmax(dtype):
    """numpy's argmax on the CPU picks what torch's does: the first maximum of each row, on strided rows too."""
    g = torch.Generator().manual_seed(2)
    x = torch.randint(-4, 5, (64, 90), generator=g).to(dtype)  # many ties
    x[3] = 1.0  # a row of one value throughout
    for view in (x, x[:, ::2], x.t().contiguous().t()):
        assert torch.equal(argmax_rows(view), view.argmax(-1))


@settings(max_examples=80, deadline=None)
@given(rows=st.integers(1, 6), vocab=st.sampled_from([3, 50, 130, 700, 5000]),
       scale=st.sampled_from([0.0, 0.3, 3.0, 30.0]), levels=st.sampled_from([0, 4]),
       top_ps=st.lists(st.sampled_from([0.05, 0.5, 0.9, 0.999, 1 - 1e-7, 1.0]), min_size=6, max_size=6),
       zeros=st.booleans(), masked=st.booleans(), dtype=st.sampled_from([torch.float64, torch.float32]),
       seed=st.integers(0, 2**16))
def test_nucleus_equals_a_full_sort(rows, vocab, scale, levels, top_ps, zeros, masked, dtype, seed):
    """The CPU's nucleus from each row's largest values gives what a stable sort of the whole row gives,
    bit for bit: flat and peaked rows, ties (`levels`: few distinct values), rows mostly 0 (as after top-k),
    a row whose logits are all masked (NaN probabilities), float32 as well as the sampler's float64."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, vocab, generator=g, dtype=torch.float64) * scale
    if levels:
        x = x.round()
    if zeros:
        x[:, vocab // 3:] = float("-inf")
    if masked:
        x[0] = float("-inf")
    probs = torch.softmax(x, -1).to(dtype)
    top_p = torch.tensor(top_ps[:rows], dtype=dtype)
    cut = torch.where(top_p < 1, top_p, torch.full_like(top_p, float("inf")))
    torch.testing.assert_close(nucleus(probs.clone(), top_p), _sorted_nucleus(probs, cut), rtol=0, atol=0,
                               equal_nan=True)


def test_nucleus_of_float32_rows_at_the_edge_of_top_p():
    """top_p a hair under the running sum of a float32 row's 61st-66th largest values (around the 64 the
    fast path first looks at): the margin (a few ulps of 1 in the dtype, not float64's 1e-9) keeps it
    from stopping a token short of the sort."""
    g = torch.Generator().manual_seed(0)
    p = torch.softmax(torch.randn(3000, 300, generator=g, dtype=torch.float64) * 3, -1).to(torch.float32)
    sums = p.sort(dim=-1, descending=True, stable=True).values.cumsum(-1)
    at = torch.randint(60, 66, (3000, 1), generator=g)
    top_p = (sums.gather(1, at)[:, 0] - torch.rand(3000, generator=g) * 2e-9).clamp(max=0.999)
    assert torch.equal(nucleus(p.clone(), top_p), _sorted_nucleus(p, top_p))


@pytest.mark.parametrize("vocab", [40, 3000])
def test_top_k_filter_equals_the_kth_of_a_full_sort(vocab):
    """Each row's k-th largest value from the largest k_max alone, as a full sort gives it, ties included;
    a row at top_k = V keeps everything."""
    g = torch.Generator().manual_seed(3)
    x = torch.randint(-5, 6, (6, vocab), generator=g).to(torch.float64)
    top_k = torch.tensor([1, 2, 7, 30, vocab, vocab])
    ones = torch.ones(6, dtype=torch.float64)
    got = filtered_probs(x, ones, top_k, ones, torch.zeros(6, dtype=torch.float64))
    kth = x.sort(-1, descending=True).values.gather(1, (top_k - 1)[:, None])
    want = torch.softmax(x.masked_fill(x < kth, float("-inf")), -1)
    assert torch.equal(got, want / want.sum(-1, keepdim=True))


# ---------------- whole requests


def _gen(llm, prompt, **kw):
    return llm.generate([prompt], SamplingParams(**kw))[0].outputs[0]


def test_seeded_sampling_reproducible_and_seed_dependent(tiny_ouro):
    llm = LLM(model=tiny_ouro, scheduler="reference", dtype="float64")
    a = _gen(llm, PROMPTS[0], max_tokens=8, temperature=1.0, seed=123, ignore_eos=True)
    b = _gen(llm, PROMPTS[0], max_tokens=8, temperature=1.0, seed=123, ignore_eos=True)
    assert a.token_ids == b.token_ids
    others = {tuple(_gen(llm, PROMPTS[0], max_tokens=8, temperature=1.0, seed=s, ignore_eos=True).token_ids)
              for s in (1, 2, 3, 4)}
    assert len(others | {tuple(a.token_ids)}) >= 3
    # without a per-request seed, the LLM seed decides; the same LLM seed reproduces
    runs = [_gen(LLM(model=tiny_ouro, scheduler="reference", seed=s), PROMPTS[1], max_tokens=8, temperature=1.0,
                 ignore_eos=True).token_ids for s in (7, 7, 8)]
    assert runs[0] == runs[1] and runs[0] != runs[2]
    # top_k = 1 samples the argmax whatever the temperature
    greedy = _gen(llm, PROMPTS[2], max_tokens=6, temperature=0, ignore_eos=True)
    assert _gen(llm, PROMPTS[2], max_tokens=6, temperature=1.5, top_k=1, seed=9, ignore_eos=True).token_ids == \
        greedy.token_ids


def test_unseeded_requests_do_not_draw_as_seeded_ones(tiny_ouro):
    """The k-th unseeded request of an `LLM` seeded 0 drew exactly as a request seeded k (its seed was
    `seed * 1_000_003 + k`): a script mixing unseeded runs with a seed sweep got the same samples twice. Unseeded seeds
    now hash the LLM's seed with the request's id, as `LLMEngine.add_request`'s do; the scheduler does not change
    them (the reference decoder draws the same)."""
    kw = dict(max_tokens=8, temperature=1.0, ignore_eos=True)
    prompts = [PROMPTS[0]] * 6
    runs = {}
    for scheduler in ("cdb", "reference"):
        llm = LLM(model=tiny_ouro, scheduler=scheduler, dtype="float64", seed=0)
        runs[scheduler] = [o.outputs[0].token_ids for o in llm.generate(prompts, SamplingParams(**kw), use_tqdm=False)]
        seeded = [o.outputs[0].token_ids for o in llm.generate(
            prompts, [SamplingParams(**kw, seed=k) for k in range(6)], use_tqdm=False)]
        assert all(a != b for a, b in zip(runs[scheduler], seeded, strict=True)), scheduler
    assert runs["cdb"] == runs["reference"]


def test_max_tokens_finishes_with_length(tiny_huginn):
    llm = LLM(model=tiny_huginn, scheduler="reference", state_init="zero")
    for n in (1, 3, 7):
        out = _gen(llm, PROMPTS[0], max_tokens=n, temperature=0, ignore_eos=True)
        assert len(out.token_ids) == n and out.finish_reason == "length" and len(out.exit_depths) == n


def test_stop_token_ids(tiny_ouro):
    llm = LLM(model=tiny_ouro, scheduler="reference", dtype="float64")
    full = _gen(llm, PROMPTS[1], max_tokens=10, temperature=0, ignore_eos=True)
    k = next(i for i in range(2, 10) if full.token_ids[i] not in full.token_ids[:i])
    out = _gen(llm, PROMPTS[1], max_tokens=10, temperature=0, ignore_eos=True, stop_token_ids=[full.token_ids[k]])
    assert out.token_ids == full.token_ids[: k + 1] and out.finish_reason == "stop"


def test_stop_strings_truncate_text(tiny_ouro):
    llm = LLM(model=tiny_ouro, scheduler="reference", dtype="float64")
    tried = 0
    for prompt in PROMPTS:
        full = _gen(llm, prompt, max_tokens=16, temperature=0, ignore_eos=True)
        text = full.text
        # an ASCII two-letter stop string that first occurs after some text
        k = next((i for i in range(1, len(text) - 1) if text[i:i + 2].isascii() and text[i:i + 2].isalpha()
                  and text.find(text[i:i + 2]) == i), None)
        if k is None:
            continue
        stop = text[k:k + 2]
        out = _gen(llm, prompt, max_tokens=16, temperature=0, ignore_eos=True, stop=[stop, "\u2603never"])
        assert out.finish_reason == "stop"
        assert out.text == text[:k]
        assert stop not in out.text
        assert out.token_ids == full.token_ids[: len(out.token_ids)] and len(out.token_ids) < 16
        tried += 1
    assert tried >= 1


def test_logprobs_include_the_sampled_token(tiny_huginn):
    llm = LLM(model=tiny_huginn, scheduler="reference", dtype="float64", state_init="zero")
    greedy = _gen(llm, PROMPTS[0], max_tokens=1, temperature=0, logprobs=5)
    raw_first = {t: lp.logprob for t, lp in greedy.logprobs[0].items()}
    for n_lp in (0, 2):
        out = _gen(llm, PROMPTS[0], max_tokens=8, temperature=1.3, seed=4, logprobs=n_lp, ignore_eos=True)
        assert len(out.logprobs) == len(out.token_ids)
        total = 0.0
        for row, tok in zip(out.logprobs, out.token_ids, strict=True):
            assert tok in row
            assert n_lp <= len(row) <= n_lp + 1
            ranks = sorted(lp.rank for t, lp in row.items() if t != tok)
            assert ranks == list(range(1, len(ranks) + 1))
            assert all(row[tok].logprob <= lp.logprob for t, lp in row.items() if lp.rank < row[tok].rank)
            total += row[tok].logprob
        assert out.cumulative_logprob == pytest.approx(total)
        # logprobs are of the model's own distribution, not the temperature-scaled one
        for t, lp in out.logprobs[0].items():
            if t in raw_first:
                assert lp.logprob == pytest.approx(raw_first[t], abs=1e-12)
    assert _gen(llm, PROMPTS[0], max_tokens=3, temperature=0).logprobs is None


@pytest.mark.parametrize("given", [1e-9, 1e-6, 1e-5, 0.005])
def test_a_tiny_temperature_is_raised_to_vllms_floor(given, caplog):
    """vLLM raises a temperature in (0, 0.01) to 0.01 and samples with it (only 0 is greedy): loopserve sampled
    1e-6 greedily and 0.005 at 0.005, so a seeded request's draw differed from vLLM's."""
    with caplog.at_level("WARNING", logger="loopserve.sampling_params"):
        p = SamplingParams(temperature=given)
    assert p.temperature == 0.01 and not p.greedy
    assert "raised to 0.01" in caplog.text
    assert SamplingParams(temperature=0).greedy and SamplingParams(temperature=0.01).temperature == 0.01



def test_top_logprobs_report_tied_tokens_by_lowest_id_whatever_the_batch():
    """Tied logprobs at the k-th place are reported lowest ids first, as argmax breaks ties, so a row reports the same
    tokens alone and batched: `topk` left ties in any order, and a grammar's row (one token allowed, the rest -inf)
    reported other -inf tokens batched than alone (found by test_engine_cross's Huginn workloads)."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, 1000, generator=g, dtype=torch.float64)
    x[:, 500:] = -math.inf
    x[3] = -math.inf
    x[3, 7] = 0.0  # a grammar's row: one token allowed
    x[5, 10:20] = 9.0  # ties among the largest
    tokens = x.argmax(-1)
    batched = top_logprobs(x, tokens, 20)
    assert torch.equal(batched["lp_top_vals"], torch.log_softmax(x, -1).topk(20, -1).values)  # topk's values
    for i in range(64):
        alone = top_logprobs(x[i:i + 1], tokens[i:i + 1], 20)
        assert torch.equal(alone["lp_top_ids"][0], batched["lp_top_ids"][i]), i
    assert batched["lp_top_ids"][3, :4].tolist() == [7, 0, 1, 2]  # the -inf ones by lowest id
    assert batched["lp_top_ids"][5, :10].tolist() == list(range(10, 20))
