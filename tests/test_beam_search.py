"""Beam search (loopserve/beam_search.py, vLLM's `LLM.beam_search`) on tiny checkpoints, in float64 (logprobs
exact to rounding whatever the batch or the prefix cache): width 1 is greedy `generate` at full depth; a search
equals a brute-force one built from single-prefix `generate` calls; results are ranked, batched steps equal
searches alone; end-of-sequence and context-end handling; a beam's text is its whole sequence decoded (vLLM's);
bad params name their field; the `BeamSearch` state machine gives the same beams whatever drives it (the server's
driver, tests/test_server_beam_search.py, admits a step's beams as requests of their own), and the server's text
rule."""

from __future__ import annotations

import math

import pytest

from loopserve import LLM, SamplingParams
from loopserve.beam_search import (
    BeamSearch,
    BeamSearchOutput,
    BeamSearchParams,
    BeamSearchSequence,
    beam_search,
    generated_text,
    get_beam_search_score,
    whole_text,
)
from loopserve.sampling_params import DEFAULT_MAX_LOGPROBS, MAX_N

pytestmark = pytest.mark.usefixtures("single_thread")

PROMPTS = ["hello", {"prompt": "The king"}, {"prompt_token_ids": [14, 300]}, [100, 101]]
EOS_PROMPT = {"prompt_token_ids": [14, 300]}  # tiny Ouro: an end-of-sequence token ranks 3rd after it


@pytest.fixture(scope="module")
def llm(tiny_ouro) -> LLM:
    return LLM(tiny_ouro, dtype="float64")


@pytest.fixture(scope="module")
def huginn(tiny_huginn) -> LLM:
    return LLM(tiny_huginn, dtype="float64")


def _ids(llm: LLM, prompt) -> list[int]:
    if isinstance(prompt, list):
        return prompt
    if isinstance(prompt, dict) and "prompt_token_ids" in prompt:
        return prompt["prompt_token_ids"]
    return llm.tokenizer.encode(prompt if isinstance(prompt, str) else prompt["prompt"])


def _score(llm: LLM, seq: BeamSearchSequence, length_penalty: float) -> float:
    return get_beam_search_score(seq.tokens, seq.cum_logprob, llm.tokenizer.eos_token_ids, length_penalty)


def _counting(llm: LLM, monkeypatch) -> list[int]:
    """Record the number of prompts of each `llm.generate` call."""
    calls: list[int] = []
    generate = llm.generate

    def counted(prompts, *args, **kwargs):
        calls.append(len(prompts))
        return generate(prompts, *args, **kwargs)

    monkeypatch.setattr(llm, "generate", counted)
    return calls


# ---------------- width 1 is greedy decoding at full depth


@pytest.mark.parametrize("model", ["llm", "huginn"])
def test_width_one_is_greedy_generate_at_full_depth(model, request):
    llm = request.getfixturevalue(model)
    for prompt in PROMPTS[:3]:
        ids = _ids(llm, prompt)
        if model == "huginn":  # its tokenizer adds a BOS to text
            ids = llm.generate(prompt, SamplingParams(max_tokens=1), use_tqdm=False)[0].prompt_token_ids
        greedy = llm.generate(prompt, SamplingParams(max_tokens=6, temperature=0, ignore_eos=True, logprobs=0,
                                                     exit_policy="fixed"), use_tqdm=False)[0].outputs[0]
        [out] = beam_search(llm, prompt, BeamSearchParams(beam_width=1, max_tokens=6, ignore_eos=True))
        [seq] = out.sequences
        assert seq.tokens == ids + greedy.token_ids
        assert seq.cum_logprob == pytest.approx(greedy.cumulative_logprob, abs=1e-9)
        assert seq.text == llm.tokenizer.decode(ids + greedy.token_ids, skip_special_tokens=False)
        assert seq.finish_reason == "length" and seq.stop_reason is None
        assert len(seq.logprobs) == 6
        for token, entry in zip(greedy.token_ids, seq.logprobs, strict=True):
            assert next(iter(entry)) == token and entry[token].rank == 1  # the sampled token first
            assert 2 <= len(entry) <= 3  # it, and the top 2 * beam_width


# ---------------- a brute-force search from single-prefix generate calls


def _brute_force(llm: LLM, prompt: list[int], width: int, steps: int, length_penalty: float,
                 ignore_eos: bool) -> list[tuple[list[int], float]]:
    """Beam search written out by enumeration: every prefix is scored on its own (one `generate` call, top
    DEFAULT_MAX_LOGPROBS logprobs); a step's candidates are a beam's continuations of rank <= 2 * width (the sampled
    token, greedily, is rank 1); candidates are compared by the length-penalized score, over all of them."""
    eos = llm.tokenizer.eos_token_ids
    table: dict[tuple[int, ...], dict[int, tuple[float, int]]] = {}

    def top(seq: tuple[int, ...]) -> dict[int, tuple[float, int]]:
        if seq not in table:
            out = llm.generate({"prompt_token_ids": list(seq)}, SamplingParams(max_tokens=1, temperature=0,
                               logprobs=DEFAULT_MAX_LOGPROBS), use_tqdm=False)[0].outputs[0].logprobs[0]
            table[seq] = {t: (lp.logprob, lp.rank) for t, lp in out.items()}
        return table[seq]

    def score(seq: tuple[int, ...], cum: float) -> float:
        n = len(seq) - (seq[-1] in eos)
        return cum / n ** length_penalty

    live: list[tuple[tuple[int, ...], float]] = [(tuple(prompt), 0.0)]
    finished: list[tuple[tuple[int, ...], float]] = []
    for _ in range(steps):
        grown = [(seq + (t,), cum + lp) for seq, cum in live for t, (lp, rank) in top(seq).items()
                 if rank <= 2 * width]
        finished += [c for c in grown if not ignore_eos and c[0][-1] in eos]
        rest = [c for c in grown if ignore_eos or c[0][-1] not in eos]
        live = sorted(rest, key=lambda c: score(*c), reverse=True)[:width]
    best = sorted(finished + live, key=lambda c: score(*c), reverse=True)[:width]
    return [(list(seq), cum) for seq, cum in best]


@pytest.mark.parametrize("length_penalty", [1.0, 0.0, 2.5, -1.0])
@pytest.mark.parametrize("ignore_eos", [False, True])
def test_matches_brute_force(llm, length_penalty, ignore_eos):
    for prompt in (EOS_PROMPT, "hello"):
        ids = _ids(llm, prompt)
        for width, steps in ((2, 2), (3, 3)):
            params = BeamSearchParams(beam_width=width, max_tokens=steps, length_penalty=length_penalty,
                                      ignore_eos=ignore_eos)
            [out] = beam_search(llm, prompt, params)
            want = _brute_force(llm, ids, width, steps, length_penalty, ignore_eos)
            assert [s.tokens for s in out.sequences] == [seq for seq, _ in want]
            for s, (_, cum) in zip(out.sequences, want, strict=True):
                assert s.cum_logprob == pytest.approx(cum, abs=1e-6)
                assert s.cum_logprob == pytest.approx(sum(e[t].logprob for t, e in zip(
                    s.tokens[len(ids):], s.logprobs, strict=True)), abs=1e-12)


def test_brute_force_sees_end_of_sequence(llm):
    """The brute-force comparison covers completed beams: after EOS_PROMPT, an end-of-sequence token is among
    the first step's candidates, and with length_penalty 0 (the cumulative logprob alone) that completed beam
    is returned, ahead of the beams that ran both steps."""
    [out] = beam_search(llm, EOS_PROMPT, BeamSearchParams(beam_width=2, max_tokens=2, length_penalty=0.0))
    assert [s.finish_reason for s in out.sequences] == ["stop", "length"]
    assert out.sequences[0].tokens[-1] in llm.tokenizer.eos_token_ids


# ---------------- ranking, batching


def test_ranked_and_batched_steps_equal_searches_alone(llm, monkeypatch):
    params = BeamSearchParams(beam_width=3, max_tokens=4, length_penalty=0.7)
    alone = [beam_search(llm, p, params) for p in PROMPTS]
    calls = _counting(llm, monkeypatch)
    outs = beam_search(llm, PROMPTS, params)
    assert len(outs) == len(PROMPTS) and all(isinstance(o, BeamSearchOutput) for o in outs)
    # one generate call a step, over every live beam of every prompt (all live until the last step here)
    assert calls == [len(PROMPTS)] + [3 * len(PROMPTS)] * 3
    for out, [one], prompt in zip(outs, alone, PROMPTS, strict=True):
        assert len(out.sequences) == 3
        scores = [_score(llm, s, 0.7) for s in out.sequences]
        assert scores == sorted(scores, reverse=True)
        assert all(s.tokens[:len(_ids(llm, prompt))] == _ids(llm, prompt) for s in out.sequences)
        assert [(s.tokens, s.text, s.finish_reason) for s in out.sequences] == [
            (s.tokens, s.text, s.finish_reason) for s in one.sequences]
        assert [s.cum_logprob for s in out.sequences] == pytest.approx([s.cum_logprob for s in one.sequences],
                                                                       abs=1e-9)
    # concurrency_limit: the prompts searched a chunk at a time, with the same results
    calls.clear()
    limited = beam_search(llm, PROMPTS, params, concurrency_limit=3)
    assert calls == [3] + [9] * 3 + [1] + [3] * 3
    assert [[s.tokens for s in o.sequences] for o in limited] == [[s.tokens for s in o.sequences] for o in outs]


def test_sampling_temperature_keeps_batched_equal_to_alone(llm):
    """With temperature > 0 a step's sampled token joins the candidates; it depends only on the beam."""
    params = BeamSearchParams(beam_width=2, max_tokens=3, temperature=1.5)
    outs = beam_search(llm, PROMPTS, params)
    for out, prompt in zip(outs, PROMPTS, strict=True):
        [one] = beam_search(llm, prompt, params)
        assert [s.tokens for s in out.sequences] == [s.tokens for s in one.sequences]


def test_reference_scheduler_gives_the_same_beams(tiny_ouro, llm):
    params = BeamSearchParams(beam_width=2, max_tokens=3)
    ref = beam_search(LLM(tiny_ouro, dtype="float64", scheduler="reference"), PROMPTS, params)
    outs = beam_search(llm, PROMPTS, params)
    assert [[s.tokens for s in o.sequences] for o in ref] == [[s.tokens for s in o.sequences] for o in outs]


def test_steps_reuse_the_prefix_cache(llm, monkeypatch):
    """A step re-runs each beam's prefix as a prompt: its full KV blocks come from the prefix cache."""
    prompt = {"prompt_token_ids": list(range(3, 40))}  # 37 tokens: 2 full blocks of 16
    cached: list[list[int]] = []
    generate = llm.generate

    def recorded(prompts, *args, **kwargs):
        outs = generate(prompts, *args, **kwargs)
        cached.append([o.num_cached_tokens for o in outs])
        return outs

    monkeypatch.setattr(llm, "generate", recorded)
    beam_search(llm, prompt, BeamSearchParams(beam_width=2, max_tokens=3))
    assert all(n >= 32 for step in cached[1:] for n in step)


# ---------------- end of sequence, end of context


def test_end_of_sequence_completes_a_beam(llm):
    eos = llm.tokenizer.eos_token_ids
    ids = _ids(llm, "hello")
    [out] = beam_search(llm, "hello", BeamSearchParams(beam_width=3, max_tokens=4))
    stopped = [s for s in out.sequences if s.finish_reason == "stop"]
    assert stopped  # tiny Ouro: an end-of-sequence token ranks 5th after "hello"
    for s in out.sequences:
        generated = s.tokens[len(ids):]
        assert len(s.logprobs) == len(generated) and s.stop_reason is None
        if s.finish_reason == "stop":
            assert generated[-1] in eos and not set(generated[:-1]) & eos
        else:
            assert len(generated) == 4 and not set(generated) & eos
    # a completed beam scores without its end-of-sequence token
    s = stopped[0]
    assert _score(llm, s, 1.0) == pytest.approx(s.cum_logprob / (len(s.tokens) - 1))
    # include_stop_str_in_output: taken, and changes nothing offline (vLLM's rule: the text is the whole sequence)
    [kept] = beam_search(llm, "hello", BeamSearchParams(beam_width=3, max_tokens=4, include_stop_str_in_output=True))
    assert [(x.tokens, x.text) for x in kept.sequences] == [(x.tokens, x.text) for x in out.sequences]
    # ignore_eos: no beam completes, every one runs max_tokens (an end-of-sequence token is just a token)
    [ignored] = beam_search(llm, "hello", BeamSearchParams(beam_width=3, max_tokens=4, ignore_eos=True))
    assert all(x.finish_reason == "length" and len(x.tokens) == len(ids) + 4 for x in ignored.sequences)


def test_text_is_the_whole_sequence_decoded_prompt_included(llm):
    """vLLM's `beam.text = tokenizer.decode(beam.tokens)`: the prompt's text, then the generated one, special
    tokens kept (a completed beam's text ends with its end-of-sequence token's own text)."""
    [out] = beam_search(llm, "hello", BeamSearchParams(beam_width=3, max_tokens=4))
    assert any(s.finish_reason == "stop" for s in out.sequences)
    for s in out.sequences:
        assert s.text == llm.tokenizer.decode(s.tokens, skip_special_tokens=False)
        assert s.text.startswith("hello") and len(s.text) > len("hello")
        if s.finish_reason == "stop":
            assert s.text.endswith(llm.tokenizer.decode(s.tokens[-1:], skip_special_tokens=False))
            assert s.text != llm.tokenizer.decode(s.tokens, skip_special_tokens=True)  # (the special token is kept)
    [ids] = beam_search(llm, {"prompt_token_ids": [14, 300]}, BeamSearchParams(beam_width=2, max_tokens=2))
    for s in ids.sequences:  # a token-id prompt's text is decoded too
        assert s.text.startswith(llm.tokenizer.decode([14, 300], skip_special_tokens=False))


def test_beam_search_params_live_beside_sampling_params():
    """`from vllm.sampling_params import BeamSearchParams` has its loopserve twin; the older homes still work."""
    import loopserve
    import loopserve.sampling_params

    assert loopserve.sampling_params.BeamSearchParams is BeamSearchParams is loopserve.BeamSearchParams


def test_context_end_finishes_beams(tiny_ouro, monkeypatch):
    llm = LLM(tiny_ouro, dtype="float64", max_model_len=6)
    calls = _counting(llm, monkeypatch)
    [out] = beam_search(llm, "hello", BeamSearchParams(beam_width=2, max_tokens=10, ignore_eos=True))
    assert calls == [1, 2, 2]  # the beams fill the context after 3 tokens: no fourth step
    assert [len(s.tokens) for s in out.sequences] == [6, 6]
    assert all(s.finish_reason == "length" for s in out.sequences)


# ---------------- parameters


@pytest.mark.parametrize("field,value", [
    ("beam_width", 0), ("beam_width", -1), ("beam_width", 1.5), ("beam_width", True),
    ("beam_width", MAX_N + 1), ("max_tokens", 0), ("max_tokens", "3"), ("max_tokens", None),
    ("temperature", -0.1), ("temperature", math.inf), ("temperature", math.nan), ("temperature", "0"),
    ("length_penalty", math.nan),
    ("length_penalty", math.inf), ("length_penalty", "1"), ("ignore_eos", 1), ("include_stop_str_in_output", None),
])
def test_bad_params_name_the_field(llm, field, value):
    kwargs = {"beam_width": 2, "max_tokens": 3, field: value}
    with pytest.raises(ValueError, match=f"^{field}: "):
        BeamSearchParams(**kwargs)
    params = BeamSearchParams(beam_width=2, max_tokens=3)
    setattr(params, field, value)  # set after construction: beam_search checks again
    with pytest.raises(ValueError, match=f"^{field}: "):
        beam_search(llm, "hello", params)


def test_widest_beam_and_bad_arguments(llm):
    [out] = beam_search(llm, "hello", BeamSearchParams(beam_width=DEFAULT_MAX_LOGPROBS // 2, max_tokens=1))
    assert len(out.sequences) == DEFAULT_MAX_LOGPROBS // 2
    with pytest.raises(ValueError, match=f"^beam_width: at most {DEFAULT_MAX_LOGPROBS // 2} under max_logprobs "):
        beam_search(llm, "hello", BeamSearchParams(beam_width=DEFAULT_MAX_LOGPROBS // 2 + 1, max_tokens=1))
    params = BeamSearchParams(beam_width=2, max_tokens=2)
    for kwargs, name in (({"params": SamplingParams()}, "params"), ({"lora_request": object()}, "lora_request"),
                         ({"concurrency_limit": 0}, "concurrency_limit"), ({"prompts": 5}, "prompts"),
                         ({"prompts": ["hello", {"x": 1}]}, "prompt")):
        args = {"prompts": "hello", "params": params, **kwargs}
        with pytest.raises(ValueError, match=f"^{name}: "):
            llm.beam_search(args.pop("prompts"), args.pop("params"), **args)


# ---------------- the state machine, whatever drives it


def test_state_machine_driven_beam_by_beam_equals_beam_search(llm):
    """`BeamSearch` driven with each beam of a step in a `generate` call of its own (as the server admits a step's
    beams: separate requests) returns `beam_search`'s beams, with their exit depths (full depth)."""
    params = BeamSearchParams(beam_width=3, max_tokens=4)
    ids = _ids(llm, "hello")
    [want] = beam_search(llm, "hello", params)
    search = BeamSearch([ids], params, llm.tokenizer.eos_token_ids, llm.max_model_len)
    step_params = search.step_params(llm.seed)
    widths = []
    while step := search.next_prompts():
        assert all(p == 0 for p, _ in step)
        widths.append(len(step))
        outs = [llm.generate({"prompt_token_ids": tokens}, step_params, use_tqdm=False)[0] for _, tokens in step]
        with pytest.raises(ValueError, match="^outputs: expected one per beam"):
            search.update(outs[:-1])
        search.update(outs)
    assert widths == [1, 3, 3, 3] and search.next_prompts() == []
    [got] = search.results(whole_text(llm.tokenizer))
    assert [(s.tokens, s.text, s.finish_reason) for s in got.sequences] == [
        (s.tokens, s.text, s.finish_reason) for s in want.sequences]
    assert [s.cum_logprob for s in got.sequences] == pytest.approx([s.cum_logprob for s in want.sequences],
                                                                   abs=1e-9)
    for s in got.sequences + want.sequences:
        assert s.exit_depths == [llm.config.r_max] * (len(s.tokens) - len(ids))


def test_server_text_rule(llm):
    """`generated_text`: the generated tokens alone, a final end-of-sequence token left out unless
    include_stop_str_in_output, decoded with skip_special_tokens (a normal request's text for those tokens)."""
    ids = _ids(llm, "hello")
    search = BeamSearch([ids], BeamSearchParams(beam_width=3, max_tokens=4), llm.tokenizer.eos_token_ids, 1000)
    step_params = search.step_params(llm.seed)
    while step := search.next_prompts():
        search.update(llm.generate([{"prompt_token_ids": t} for _, t in step], step_params, use_tqdm=False))
    [plain] = search.results(generated_text(llm.tokenizer, include_stop_str_in_output=False))
    [kept] = search.results(generated_text(llm.tokenizer, True, skip_special_tokens=False))
    [skipped] = search.results(generated_text(llm.tokenizer, True))
    assert any(s.finish_reason == "stop" for s in plain.sequences)
    for s, k, sk in zip(plain.sequences, kept.sequences, skipped.sequences, strict=True):
        generated = s.tokens[len(ids):]
        if s.finish_reason == "stop":
            eos = llm.tokenizer.decode(generated[-1:], skip_special_tokens=False)
            assert s.text == llm.tokenizer.decode(generated[:-1]) and k.text == s.text + eos and sk.text == s.text
        else:
            assert s.text == k.text == sk.text == llm.tokenizer.decode(generated)


def test_a_huge_length_penalty_takes_the_scores_limit():
    """`seq_len ** length_penalty` overflows (or underflows) a float for a finite but huge penalty, where vLLM raises:
    the score is its limit."""
    from loopserve.beam_search import length_penalized

    assert length_penalized(-3.0, 5, 1e300) == 0.0
    assert length_penalized(-3.0, 5, -1e300) == -math.inf and length_penalized(0.0, 5, -1e300) == 0.0
    assert length_penalized(-3.0, 5, 1.0) == -0.6 and length_penalized(-3.0, 1, 1e300) == -3.0


# ---------------- vLLM's BeamSearchSequence


def test_beam_search_sequence_has_vllms_fields_in_vllms_order():
    """vLLM's fields in vLLM's order (tokens, logprobs, lora_request, cum_logprob, text, finish_reason, stop_reason,
    multi_modal_data, mm_processor_kwargs), then loopserve's exit_depths: code that builds one positionally, or by
    keyword, as vLLM's gets the fields it means."""
    import dataclasses

    names = [f.name for f in dataclasses.fields(BeamSearchSequence)]
    assert names == ["tokens", "logprobs", "lora_request", "cum_logprob", "text", "finish_reason", "stop_reason",
                     "multi_modal_data", "mm_processor_kwargs", "exit_depths"]
    seq = BeamSearchSequence([1, 2], [{2: None}], None, -0.5, "ab", "stop", 2, None, None)
    assert (seq.cum_logprob, seq.text, seq.finish_reason, seq.stop_reason) == (-0.5, "ab", "stop", 2)
    seq = BeamSearchSequence(tokens=[1], logprobs=[], lora_request=None, cum_logprob=-1.0, multi_modal_data=None,
                             mm_processor_kwargs=None)
    assert (seq.cum_logprob, seq.lora_request, seq.multi_modal_data, seq.mm_processor_kwargs) == (-1.0, None, None,
                                                                                                  None)


def test_offline_stop_reason_is_none_as_vllms(llm):
    """vLLM's `LLM.beam_search` sets no stop_reason on its beams (nor a finish_reason: loopserve's says how a beam
    ended); its server's search sets a completed beam's to the end-of-sequence token (`request_outputs`)."""
    [out] = beam_search(llm, EOS_PROMPT, BeamSearchParams(beam_width=2, max_tokens=2, length_penalty=0.0))
    assert [(s.finish_reason, s.stop_reason) for s in out.sequences] == [("stop", None), ("length", None)]


def test_request_outputs_and_a_stopped_search(llm):
    """`request_outputs` (the server's and AsyncLLMEngine's result): a choice per beam, best first, with its generated
    ids, its logprobs (or None), and a completed beam's end-of-sequence token as its stop_reason; the loops every
    step ran. A search stopped early ends its live beams "abort", ranked with the complete ones."""
    ids = _ids(llm, EOS_PROMPT)
    params = BeamSearchParams(beam_width=2, max_tokens=2, length_penalty=0.0)
    [want] = beam_search(llm, EOS_PROMPT, params)
    search = BeamSearch([ids], params, llm.tokenizer.eos_token_ids, 1000)
    step_params = search.step_params(llm.seed)
    ran = []
    while step := search.next_prompts():
        ran += llm.generate([{"prompt_token_ids": t} for _, t in step], step_params, use_tqdm=False)
        search.update(ran[-len(step):])
    rule = generated_text(llm.tokenizer, include_stop_str_in_output=False)
    [out] = search.request_outputs(rule)
    assert out.finished and out.prompt_token_ids == ids
    assert [c.index for c in out.outputs] == [0, 1]
    for c, s in zip(out.outputs, want.sequences, strict=True):
        assert c.token_ids == s.tokens[len(ids):] and c.logprobs == s.logprobs and c.finish_reason == s.finish_reason
        assert c.cumulative_logprob == pytest.approx(s.cum_logprob, abs=1e-9)
    assert [c.stop_reason for c in out.outputs] == [want.sequences[0].tokens[-1], None]
    assert out.outputs[0].stop_reason in llm.tokenizer.eos_token_ids
    # (the prompt's own, from its first step's output; the loops its 1 + 2 step requests ran)
    assert out.metrics.arrival_time == ran[0].metrics.arrival_time and len(ran) == 3
    assert (out.metrics.loops_run, out.metrics.prefill_loops) == (
        sum(o.metrics.loops_run for o in ran), sum(o.metrics.prefill_loops for o in ran))
    assert all(c.logprobs is None for c in search.request_outputs(rule, logprobs=False)[0].outputs)
    # stopped after its first step: the live beams end "abort", ranked with the complete one (the end-of-sequence
    # token ranks 3rd after the prompt)
    wide = BeamSearchParams(beam_width=3, max_tokens=2, length_penalty=0.0)
    stopped = BeamSearch([ids], wide, llm.tokenizer.eos_token_ids, 1000)
    stopped.update(llm.generate([{"prompt_token_ids": t} for _, t in stopped.next_prompts()],
                                stopped.step_params(llm.seed), use_tqdm=False))
    stopped.stop()
    assert stopped.next_prompts() == []
    [out] = stopped.request_outputs(rule)
    assert [(c.finish_reason, len(c.token_ids)) for c in out.outputs] == [("abort", 1), ("abort", 1), ("stop", 1)]
    assert [c.stop_reason for c in out.outputs] == [None, None, out.outputs[2].token_ids[0]]
