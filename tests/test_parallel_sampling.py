"""n > 1: a request's samples share its prompt's prefill (the other samples get a copy of the prompt's
KV), each with its own random stream; each sample equals the reference decoder run on it alone, whatever
the schedule, preemption or aborts."""

from __future__ import annotations

import pytest

from loopserve import LLM, SamplingParams
from tests.engine_helpers import Req, drive, make_engine

pytestmark = pytest.mark.usefixtures("single_thread")

PROMPT = [5, 17, 99, 3, 250, 40, 7, 11, 12, 300, 8]


def _check(engine, reqs, outs) -> None:
    for r in reqs:
        out = outs[r.rid]
        head = engine.make_sequence(r.rid, r.prompt, r.params, seed=r.seed)
        assert [c.index for c in out.outputs] == list(range(r.params.n))
        for c, sample in zip(out.outputs, head.family, strict=True):
            ref = reference_run(engine, sample)
            if c.finish_reason == "abort":
                assert c.token_ids == ref.output_ids[:len(c.token_ids)]
                continue
            assert (c.token_ids, c.exit_depths, c.finish_reason) == (ref.output_ids, ref.exit_depths,
                                                                     ref.finish_reason)


def reference_run(engine, sample):
    from loopserve.engine.reference import ReferenceDecoder

    return ReferenceDecoder(engine.model, engine.layout, engine.cfg.prefill_chunk_size).run(sample)


@pytest.mark.parametrize("scheduler", ["cb", "cdb-norefill", "cdb"])
@pytest.mark.parametrize("arch", ["ouro", "huginn"])
def test_samples_equal_the_reference(arch, scheduler, tiny_ouro, tiny_huginn):
    path = tiny_ouro if arch == "ouro" else tiny_huginn
    engine = make_engine(path, scheduler=scheduler, prefill_chunk_size=4, max_decode_batch=6)
    reqs = [Req("a", PROMPT, SamplingParams(max_tokens=5, temperature=1.0, n=3, seed=5, ignore_eos=True), seed=0),
            Req("b", [44, 45], SamplingParams(max_tokens=4, temperature=0.7, n=2, ignore_eos=True), seed=1, arrive=1),
            Req("c", [7, 8, 9], SamplingParams(max_tokens=3, temperature=0, ignore_eos=True), seed=2, arrive=2)]
    outs = drive(engine, reqs)
    _check(engine, reqs, outs)
    a = outs["a"].outputs
    assert len({tuple(c.token_ids) for c in a}) > 1, "samples drew the same stream"
    # the prompt was prefilled once per request, not once per sample
    assert engine.stats.prompt_tokens == len(PROMPT) + 2 + 3
    assert outs["a"].metrics.prefill_loops == len(PROMPT) * engine.model_config.r_max


def test_seeded_samples_are_seed_plus_index(tiny_ouro):
    """vLLM's rule: sample j of a request seeded s draws like a request seeded s + j."""
    llm = LLM(tiny_ouro, dtype="float64", kv_cache_tokens=512)
    many = llm.generate([PROMPT], SamplingParams(max_tokens=6, temperature=1.0, n=3, seed=11, ignore_eos=True),
                        use_tqdm=False)[0]
    for j, c in enumerate(many.outputs):
        one = llm.generate([PROMPT], SamplingParams(max_tokens=6, temperature=1.0, seed=11 + j, ignore_eos=True),
                           use_tqdm=False)[0].outputs[0]
        assert c.token_ids == one.token_ids


def test_aborts(tiny_ouro):
    """A request aborted before its prefill completes takes its waiting samples with it; one aborted
    mid-decode stops every sample; nothing leaks (drive checks after every step)."""
    engine = make_engine(tiny_ouro, scheduler="cdb", prefill_chunk_size=4, max_num_batched_tokens=4)
    reqs = [Req("early", PROMPT, SamplingParams(max_tokens=6, temperature=1.0, n=3, ignore_eos=True), seed=0,
                abort_at=1),
            Req("late", PROMPT[:6], SamplingParams(max_tokens=8, temperature=1.0, n=2, ignore_eos=True), seed=1,
                abort_at=12),
            Req("full", PROMPT[:5], SamplingParams(max_tokens=10, temperature=0.5, n=4, ignore_eos=True), seed=2)]
    outs = drive(engine, reqs)
    assert all(c.finish_reason == "abort" and not c.token_ids for c in outs["early"].outputs)
    assert all(c.finish_reason == "abort" and c.token_ids for c in outs["late"].outputs)
    assert all(c.finish_reason == "length" for c in outs["full"].outputs)
    _check(engine, reqs, outs)


def test_preemption(tiny_ouro):
    """Samples that outgrow a small KV pool are swapped out and back; every sample stays exact."""
    engine = make_engine(tiny_ouro, scheduler="cdb", block_size=4, kv_cache_tokens=80, kv_safety_margin=0.0)
    reqs = [Req(f"r{i}", PROMPT[i:i + 4], SamplingParams(max_tokens=14, temperature=1.0, n=3, ignore_eos=True),
                seed=i) for i in range(3)]
    outs = drive(engine, reqs)
    assert engine.stats.preemptions > 0
    _check(engine, reqs, outs)


def test_more_samples_than_the_cache_holds_together_come_in_parts(tiny_ouro):
    """12 blocks of 4 tokens; the 11-token prompt takes 3 with room for its first token, and each other
    sample 1 more (they share the prompt's 2 full blocks): 10 samples fit together (once refused, as if each held a
    copy), 9 beside the safety margin's block, so 11 run as a part of 9 and a part of 2 (they were refused, as if
    they had to run together; vLLM runs samples as requests of their own), every sample equal to the reference
    decoder's."""
    engine = make_engine(tiny_ouro, block_size=4, kv_cache_tokens=48)
    assert engine.part_size(len(PROMPT)) == 9
    assert make_engine(tiny_ouro, block_size=4, kv_cache_tokens=48, kv_safety_margin=0).part_size(len(PROMPT)) == 10
    reqs = [Req("big", PROMPT, SamplingParams(max_tokens=2, n=11), seed=0),
            Req("ok", PROMPT, SamplingParams(max_tokens=2, temperature=0), seed=1),
            Req("shared", PROMPT, SamplingParams(max_tokens=2, n=8), seed=2)]
    outs = drive(engine, reqs)
    assert all(o.error is None for o in outs.values()), {k: o.error for k, o in outs.items()}
    assert [c.finish_reason for c in outs["big"].outputs] == ["length"] * 11
    _check(engine, reqs, outs)
    assert engine.kv_usage() == 0


@pytest.mark.parametrize("bad", [0, 16385, 1.5, True, "2"])
def test_bad_n_names_the_field(bad):
    with pytest.raises(ValueError, match="^n: "):
        SamplingParams(n=bad)



@pytest.mark.parametrize("scheduler", ["cb", "cdb"])
@pytest.mark.parametrize("prefix_caching", [False, True])
def test_more_samples_than_max_num_seqs_come_in_parts(tiny_ouro, scheduler, prefix_caching):
    """n > max_num_seqs (pass@k evals): the samples prefill in parts of at most max_num_seqs, queued as vLLM queues
    them (they were refused: a request's samples were all resident at once), each sample still the reference's;
    the bound holds after every step (check_invariants), and aborting the request stops every part."""
    engine = make_engine(tiny_ouro, scheduler=scheduler, max_num_seqs=2, max_decode_batch=2, prefill_chunk_size=4,
                         enable_prefix_caching=prefix_caching)
    reqs = [Req("many", PROMPT, SamplingParams(n=5, max_tokens=4, temperature=1.0, seed=3, ignore_eos=True), seed=0),
            Req("one", [44, 45], SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True), seed=1, arrive=1)]
    outs = drive(engine, reqs)
    _check(engine, reqs, outs)
    assert len({tuple(c.token_ids) for c in outs["many"].outputs}) > 1
    parts = 3  # (5 samples, 2 at once: the prompt prefilled three times, or read from the cache)
    if not prefix_caching:
        assert engine.stats.prompt_tokens == parts * len(PROMPT) + 2
    # aborted while its later parts wait: every sample ends, nothing is left behind
    engine.add_request("cut", PROMPT, SamplingParams(n=5, max_tokens=50, ignore_eos=True))
    engine.step()
    engine.abort_request("cut")
    done = []
    while engine.has_unfinished_requests():
        done += engine.step()
    [cut] = [o for o in done if o.request_id == "cut"]
    assert len(cut.outputs) == 5 and {c.finish_reason for c in cut.outputs} == {"abort"}
    engine.scheduler.check_drained()
    llm = LLM(tiny_ouro, dtype="float64", kv_cache_tokens=256, max_num_seqs=2)
    out = llm.generate([PROMPT], SamplingParams(n=3, max_tokens=2), use_tqdm=False)[0]
    assert [c.index for c in out.outputs] == [0, 1, 2] and {c.finish_reason for c in out.outputs} == {"length"}
    r_max = engine.model_config.r_max  # (a part's prefill counted once each; the reference's once in all)
    assert out.metrics.prefill_loops == 2 * len(PROMPT) * r_max
    ref = LLM(tiny_ouro, dtype="float64", scheduler="reference").generate([PROMPT], SamplingParams(n=3, max_tokens=2),
                                                                         use_tqdm=False)[0]
    assert ref.metrics.prefill_loops == len(PROMPT) * r_max


def test_max_num_seqs_counts_waiting_samples_and_cache_hits(tiny_ouro):
    """Samples still waiting for their prompt's prefill, and prompts admitted from a prefix-cache hit,
    count against max_num_seqs (check_invariants asserts the bound after every step)."""
    prefix = [(13 * j + 7) % 400 + 3 for j in range(16)]
    greedy = SamplingParams(temperature=0.0, max_tokens=2)
    engine = make_engine(tiny_ouro, block_size=4, kv_cache_tokens=400, max_num_seqs=2, max_decode_batch=2,
                         prefill_chunk_size=8, max_num_batched_tokens=64)
    reqs = [Req("warm", prefix + [1, 2], greedy, seed=0)]
    reqs += [Req(f"hit{i}", prefix + [3 + i, 4], greedy, seed=i + 1, arrive=4) for i in range(4)]
    _check(engine, reqs, drive(engine, reqs))
    assert engine.stats.prefix_cache_hits > 0
    engine = make_engine(tiny_ouro, max_num_seqs=2, max_decode_batch=2, prefill_chunk_size=8,
                         max_num_batched_tokens=8)
    reqs = [Req("head", list(range(3, 20)), SamplingParams(temperature=0.0, max_tokens=2, n=2), seed=0),
            Req("small", [5, 6], greedy, seed=1, arrive=1)]
    _check(engine, reqs, drive(engine, reqs))


@pytest.mark.parametrize("layout", ["depth_indexed", "shared"])
def test_each_sample_counts_its_prompt_as_vllms_child_requests_do(tiny_ouro, layout):
    """vLLM runs each of n samples as a request of its own: its prompt counts once per sample in the step tokens
    (iteration_tokens_total, whose sum is then prompt_tokens_total + generation_tokens_total, which counts per sample)
    and in the prefix cache's lookups, whose hits are the prompt blocks the later samples find (here shared with
    the first); they counted the shared prompt once. Still prefilled once."""
    from loopserve.engine.engine_thread import EngineThread

    prompt = list(range(3, 3 + 14))  # 3 full blocks of 4 and 2 tokens (shared: restarts at chunks of 8 only)
    engine = make_engine(tiny_ouro, kv_layout=layout, block_size=4, prefill_chunk_size=8, max_num_batched_tokens=8)
    aengine = EngineThread(engine, max_queued_requests=4)  # (not started: `_tokens_so_far` read as its steps are)
    outs = drive(engine, [Req("r", prompt, SamplingParams(max_tokens=3, temperature=1.0, n=3, ignore_eos=True),
                              seed=0)])
    st = engine.stats
    assert st.prompt_tokens == len(prompt) and st.generated_tokens == 3 * 3
    assert st.sampled_prompt_tokens == 3 * len(prompt) and len(outs["r"].outputs) == 3
    assert aengine._tokens_so_far() == 3 * len(prompt) + 3 * 3
    assert st.prefix_cache_queries == 3 * len(prompt)
    assert st.prefix_cache_hits == 2 * (12 if layout == "depth_indexed" else 8)


def test_samples_share_the_prompts_full_blocks(tiny_ouro):
    """After the fork each sample lists the prompt's full KV blocks (shared, refcounted) and owns only
    the rest; the outputs still equal the reference (checked in the tests above)."""
    engine = make_engine(tiny_ouro, block_size=4, prefill_chunk_size=16)
    engine.add_request("r", PROMPT[:10], SamplingParams(max_tokens=4, temperature=1.0, n=3, seed=2), seed=0)
    while not engine.scheduler.prelude_q and not engine.scheduler.core_q:
        engine.step()
    head, forks = engine.kv.blocks("r"), [engine.kv.blocks(f"{j}_r") for j in (1, 2)]
    assert all(f[:2] == head[:2] for f in forks)  # 10 tokens: 2 full blocks of 4
    assert len({f[2] for f in forks} | {head[2]}) == 3  # the partial third block is each sample's own
    engine.scheduler.check_invariants()
    engine.run_to_completion()
    engine.scheduler.check_drained()


def test_seeds_are_distinct_over_64_bits(tiny_ouro):
    """Seeds 2^63 apart draw different streams (the engine once kept 63 bits); seeds with one 64-bit pattern
    (-2 and 2^64 - 2) draw the same one, as torch's manual_seed (-1 is no seed, as in vLLM)."""
    llm = LLM(tiny_ouro, dtype="float64", kv_cache_tokens=512)

    def tokens(seed: int) -> list[int]:
        params = SamplingParams(max_tokens=12, temperature=1.0, seed=seed, ignore_eos=True)
        return llm.generate([PROMPT], params, use_tqdm=False)[0].outputs[0].token_ids

    assert tokens(5) != tokens(5 + 2**63)
    assert tokens(0) != tokens(2**63)
    assert tokens(-2) == tokens(2**64 - 2)


def test_a_requests_samples_share_its_checked_prompt(tiny_ouro):
    """The prompt is checked and copied once per request, not once per sample (O(prompt) each: a request of 64
    samples of a 1k-token prompt held the GIL 64 times as long); its outputs hand out a copy of their own."""
    engine = make_engine(tiny_ouro, scheduler="cdb")
    head = engine.make_sequence("r", PROMPT, SamplingParams(n=4, max_tokens=2, temperature=1.0))
    assert all(s.prompt_ids is head.prompt_ids for s in head.family) and head.prompt_ids == PROMPT
    assert head.prompt_ids is not PROMPT  # (the caller's list is not the engine's)
    engine.add_sequence(head)
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                assert out.prompt_token_ids == PROMPT and out.prompt_token_ids is not head.prompt_ids
                out.prompt_token_ids.append(1)  # a caller's edit of an output reaches no sample
    assert all(s.prompt_ids == PROMPT for s in head.family)
