"""The public asyncio API (`loopserve.AsyncLLMEngine`, vLLM's): its outputs equal `LLM.generate`'s, streams follow
`output_kind`, concurrent requests run together, a stopped consumer or `abort` frees its request, bad requests are a
ValueError naming the field, a dead engine says so, and the engine thread follows its event loop."""

from __future__ import annotations

import asyncio
import time
import types

import pytest

from loopserve import (
    LLM,
    AsyncEngineArgs,
    AsyncLLM,
    AsyncLLMEngine,
    EngineConfig,
    RequestOutputKind,
    SamplingParams,
    TokensPrompt,
)
from loopserve.async_llm import EngineDeadError, EngineStoppedError
from loopserve.sampling_params import BeamSearchParams

FINAL, CUMULATIVE, DELTA = RequestOutputKind.FINAL_ONLY, RequestOutputKind.CUMULATIVE, RequestOutputKind.DELTA
PROMPTS = ["the cat", [5, 6, 7, 8], TokensPrompt(prompt_token_ids=[9, 10, 11]), {"prompt": "a b c"}]
LONG = SamplingParams(max_tokens=400, ignore_eos=True, temperature=0.0)


@pytest.fixture(scope="module")
def engine(tiny_ouro):
    eng = AsyncLLMEngine.from_engine_args(AsyncEngineArgs(model=str(tiny_ouro), dtype="float32", scheduler="cdb",
                                                          kv_cache_tokens=1024))
    yield eng
    eng.shutdown()


def drained(eng: AsyncLLMEngine) -> bool:
    """Nothing in flight, every KV block free (cached prompt blocks count as free) and no stream open."""
    e = eng.llm.llm_engine
    return not e.requests and e.kv.allocator.num_free == e.kv.num_blocks and not eng._streams


async def wait_drained(eng: AsyncLLMEngine, timeout_s: float = 30.0) -> None:
    end = time.monotonic() + timeout_s
    while not drained(eng):
        assert time.monotonic() < end, "the request was not freed"
        await asyncio.sleep(0.01)


async def collect(eng: AsyncLLMEngine, prompt, params: SamplingParams, rid: str) -> list:
    return [out async for out in eng.generate(prompt, params, rid)]


def completion(out):
    return [(c.index, c.text, c.token_ids, c.exit_depths, c.finish_reason) for c in out.outputs]


@pytest.mark.parametrize("params", [
    SamplingParams(max_tokens=12, temperature=0.0),
    SamplingParams(max_tokens=12, temperature=0.9, top_p=0.9, seed=7),
    SamplingParams(max_tokens=8, temperature=1.0, seed=3, n=3),
], ids=["greedy", "seeded", "n3"])
def test_outputs_equal_llm_generate(engine, params):
    """Concurrent requests from several tasks, each kind, give `LLM.generate`'s outputs (the same engine, before its
    thread runs it; the thread is stopped first for this)."""
    engine.shutdown()
    want = [completion(o) for o in engine.llm.generate(PROMPTS, params, use_tqdm=False)]

    async def main():
        kinds = [CUMULATIVE, FINAL, DELTA, CUMULATIVE]
        runs = [collect(engine, p, params.clone() if k == CUMULATIVE else _kind(params, k), f"r{i}")
                for i, (p, k) in enumerate(zip(PROMPTS, kinds, strict=True))]
        return kinds, await asyncio.gather(*runs)

    kinds, got = asyncio.run(main())
    for i, (kind, outs) in enumerate(zip(kinds, got, strict=True)):
        assert all(o.request_id == f"r{i}" for o in outs)
        assert outs[-1].finished and not any(o.finished for o in outs[:-1])
        if kind == FINAL:
            assert len(outs) == 1
        if kind == DELTA:
            assert _joined(outs) == want[i]
        else:
            assert completion(outs[-1]) == want[i]
            assert len(outs) > 1 or kind == FINAL  # streamed: an output per token
    assert drained(engine)


def _kind(params: SamplingParams, kind: RequestOutputKind) -> SamplingParams:
    p = params.clone()
    p.output_kind = kind
    return p


def _joined(outs) -> list:
    """The completions DELTA outputs add up to, per sample."""
    text: dict[int, str] = {}
    ids: dict[int, list] = {}
    depths: dict[int, list] = {}
    reason: dict[int, str | None] = {}
    for o in outs:
        for c in o.outputs:
            text[c.index] = text.get(c.index, "") + c.text
            ids.setdefault(c.index, []).extend(c.token_ids)
            depths.setdefault(c.index, []).extend(c.exit_depths)
            reason[c.index] = c.finish_reason
    return [(i, text[i], ids[i], depths[i], reason[i]) for i in sorted(text)]


def test_cumulative_streams_every_token(engine):
    """Each CUMULATIVE output holds everything so far. A token comes as its own output unless the consumer fell
    behind, when the outputs it had not read are folded into one (as vLLM's): the counts only rise."""
    async def main():
        return await collect(engine, "to be", SamplingParams(max_tokens=10, ignore_eos=True, temperature=0.0), "c")

    outs = asyncio.run(main())
    counts = [len(o.outputs[0].token_ids) for o in outs]
    assert counts[-1] == 10 and counts == sorted(set(counts)), counts
    final = outs[-1].outputs[0]
    assert all(final.token_ids[:n] == o.outputs[0].token_ids for n, o in zip(counts, outs, strict=True))
    assert all(outs[k].outputs[0].text.startswith(outs[k - 1].outputs[0].text) for k in range(1, len(outs)))


def test_abort_ends_the_stream_with_abort(engine):
    """`abort` (one id, or a list) ends the stream with a final output, finish_reason "abort" (vLLM V1's); the request
    is gone from the engine and its blocks are free; an id not in flight is passed over."""
    async def main():
        gens = {rid: engine.generate([5, 6, 7], LONG, rid) for rid in ("a", "b", "c")}
        for g in gens.values():
            await anext(g)
        await engine.abort("a")
        await engine.abort(["b", "c", "never-added"])
        return {rid: [o async for o in g] for rid, g in gens.items()}

    for rid, rest in asyncio.run(main()).items():
        last = rest[-1]
        assert last.request_id == rid and last.finished and last.outputs[0].finish_reason == "abort"
        assert len(last.outputs[0].token_ids) < 400
    assert drained(engine)


@pytest.mark.parametrize("how", ["break", "cancel", "aclose"])
def test_a_consumer_that_stops_frees_its_request(engine, how):
    """vLLM aborts a request whose consumer went away: breaking out, a cancelled task, a closed generator. The engine
    then has nothing in flight and every KV block is free (long before the request could have run its 1000 tokens),
    and the id may be used again."""
    core = engine.llm.llm_engine
    run = SamplingParams(max_tokens=1000, ignore_eos=True, temperature=0.0)

    async def main():
        before = core.stats.generated_tokens
        if how == "break":
            async for out in engine.generate([5, 6, 7], run, "x"):
                if len(out.outputs[0].token_ids) >= 2:
                    break
        elif how == "cancel":
            started = asyncio.Event()

            async def consume():
                async for _ in engine.generate([5, 6, 7], run, "x"):
                    started.set()

            task = asyncio.ensure_future(consume())
            await started.wait()
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
        else:
            gen = engine.generate([5, 6, 7], run, "x")
            await anext(gen)
            await gen.aclose()
        await wait_drained(engine)
        assert core.stats.generated_tokens - before < 100
        again = await collect(engine, [5, 6, 7], SamplingParams(max_tokens=3, temperature=0.0), "x")
        assert again[-1].outputs[0].finish_reason == "length"

    asyncio.run(main())
    assert drained(engine)


@pytest.mark.parametrize("call, field", [
    (lambda e: e.generate([5] * 5000, SamplingParams(max_tokens=4), "r"), "prompt"),
    (lambda e: e.generate([5, 6], SamplingParams(max_tokens=5000), "r"), "max_tokens"),
    (lambda e: e.generate([5, 6], SamplingParams(max_tokens=4, logit_bias={10**6: 1.0}), "r"), "logit_bias"),
    (lambda e: e.generate([], SamplingParams(max_tokens=4), "r"), "prompt"),
    (lambda e: e.generate([5], {"max_tokens": 4}, "r"), "sampling_params"),
    (lambda e: e.generate([5], BeamSearchParams(beam_width=2, max_tokens=4), "r"), "sampling_params"),
    (lambda e: e.generate([5], SamplingParams(max_tokens=4), 7), "request_id"),
    (lambda e: e.generate([5], SamplingParams(max_tokens=4), "r", lora_request=object()), "lora_request"),
    (lambda e: e.generate([5], SamplingParams(max_tokens=4), "r", priority=1), "priority"),
    (lambda e: e.generate([5], SamplingParams(max_tokens=4), "r", data_parallel_rank=1), "data_parallel_rank"),
])
def test_bad_requests_are_value_errors_naming_the_field(engine, call, field):
    async def main():
        with pytest.raises(ValueError, match=f"^{field}"):
            await anext(call(engine))

    asyncio.run(main())
    assert drained(engine)


def test_vllms_generate_keywords_at_their_neutral_values_are_taken(engine):
    """vLLM's AsyncLLM.generate takes data_parallel_rank (the engine of a data-parallel deployment): it was a
    TypeError."""
    async def main():
        outs = [o async for o in engine.generate([5, 6], SamplingParams(max_tokens=2), "dp", data_parallel_rank=0,
                                                 priority=0, lora_request=None, trace_headers=None)]
        assert outs[-1].finished and len(outs[-1].outputs[0].token_ids) == 2

    asyncio.run(main())
    assert drained(engine)


def test_a_request_id_in_flight_is_refused(engine):
    async def main():
        first = engine.generate([5, 6, 7], LONG, "dup")
        await anext(first)
        with pytest.raises(ValueError, match="^request_id: 'dup' is already in flight"):
            await anext(engine.generate([1, 2], SamplingParams(max_tokens=2), "dup"))
        await engine.abort("dup")
        assert [o async for o in first][-1].outputs[0].finish_reason == "abort"

    asyncio.run(main())
    assert drained(engine)


def test_a_request_id_is_free_once_its_request_finished_read_or_not(engine):
    """As in vLLM, an id is free again when the engine finished its request, whether or not the consumer has read the
    final output (it was held until then: a stalled consumer's ids stayed 'already in flight'); the unread stream
    still ends with its own output."""
    async def main():
        first = engine.generate([5, 6, 7], SamplingParams(max_tokens=3, temperature=0.0), "fin")
        await anext(first)
        await wait_drained(engine)  # finished in the engine, its final output unread
        again = await collect(engine, [1, 2], SamplingParams(max_tokens=2, temperature=0.0), "fin")
        assert again[-1].finished and len(again[-1].outputs[0].token_ids) == 2
        rest = [o async for o in first]
        assert rest[-1].finished and rest[-1].outputs[0].finish_reason == "length"
        assert len(rest[-1].outputs[0].token_ids) == 3 and rest[-1].prompt_token_ids == [5, 6, 7]

    asyncio.run(main())
    assert drained(engine)


def test_shutdown_ends_streams_and_a_new_loop_restarts(engine):
    """`shutdown()` stops the thread (idempotent): a stream in flight raises EngineStoppedError and its request is
    freed; a later `generate`, on another event loop, starts a new thread."""
    async def main():
        gen = engine.generate([5, 6, 7], LONG, "s")
        await anext(gen)
        engine.shutdown()
        engine.shutdown()
        assert not engine.is_running and engine.errored and engine.is_stopped  # (vLLM's: not running is errored)
        with pytest.raises(EngineDeadError, match="shut down"):  # (an EngineStoppedError, as vLLM's dead error)
            await engine.check_health()
        # the id of the request it stopped is free at once, as after an abort (it was "already in flight" until that
        # request's consumer read again)
        again = await collect(engine, [5, 6], SamplingParams(max_tokens=2, temperature=0.0), "s")
        assert again[-1].finished and again[-1].outputs[0].finish_reason == "length"
        with pytest.raises(EngineStoppedError):
            async for _ in gen:
                pass
        engine.shutdown()

    asyncio.run(main())
    assert drained(engine)
    outs = asyncio.run(collect(engine, [5, 6], SamplingParams(max_tokens=2, temperature=0.0), "t"))
    assert outs[-1].finished and engine.is_running


def test_get_tokenizer_and_alias(engine):
    """vLLM's (V1 renderer) `get_tokenizer()` is a plain method, and `tokenizer` a property."""
    assert AsyncLLM is AsyncLLMEngine
    tok = engine.get_tokenizer()
    assert tok is engine.llm.get_tokenizer() is engine.tokenizer is engine.get_tokenizer(lora_request=None)
    with pytest.raises(ValueError, match="^lora_request"):
        engine.get_tokenizer(lora_request=object())

    async def older_vllm() -> object:  # (vLLM before V1's renderer awaited it: a TypeError here before)
        return await engine.get_tokenizer()
    assert asyncio.run(older_vllm()) is tok


def test_vllms_housekeeping_calls(engine, caplog):
    """The calls vLLM's API server makes on its engine client: a stats line, no tracing, the task, no multimodal
    cache."""
    import logging

    async def main():
        await collect(engine, "the cat", SamplingParams(max_tokens=3, ignore_eos=True), "stats")
        with caplog.at_level(logging.INFO, logger="loopserve.async_llm"):
            await engine.do_log_stats()
        return await engine.is_tracing_enabled(), await engine.get_supported_tasks(), await engine.reset_mm_cache()

    assert asyncio.run(main()) == (False, ("generate",), None)
    [line] = [r.getMessage() for r in caplog.records if "Avg generation throughput" in r.getMessage()]
    assert line.startswith("Engine 000: Avg prompt throughput: ") and "GPU KV cache usage: 0.0%" in line, line


def test_do_log_stats_counts_every_generated_token(tiny_ouro, caplog, monkeypatch):
    """do_log_stats' rates are of the tokens since its last line: each sample's first token included (it counted only
    the decode tokens, which have exit depths: 18 of two requests' 20), not the wrapped LLM's earlier work, never
    negative after a shutdown, and not counted twice after a restart. An idle line after an idle one is DEBUG."""
    import logging

    llm = LLM(tiny_ouro, device="cpu", seed=0)
    llm.generate([[5, 6, 7]], SamplingParams(max_tokens=30, ignore_eos=True), use_tqdm=False)  # before: not counted
    from loopserve import async_llm

    eng = AsyncLLMEngine(llm)
    params = SamplingParams(max_tokens=10, ignore_eos=True, temperature=0.0)
    lines: list[tuple[int, str]] = []
    clock = types.SimpleNamespace(monotonic=lambda: clock.now, now=1000.0)  # the module's own clock, read by it alone
    monkeypatch.setattr(async_llm, "time", clock)

    async def log_a_second_on() -> None:
        eng._logged = clock.now, eng._logged[1]
        clock.now += 1.0  # the line a second after the last: its rates are counts
        with caplog.at_level(logging.DEBUG, logger="loopserve.async_llm"):
            caplog.clear()
            await eng.do_log_stats()
            [line] = [(r.levelno, r.getMessage()) for r in caplog.records if "Avg generation" in r.getMessage()]
        lines.append(line)

    async def main():
        for rid in ("a", "b"):
            await collect(eng, [5, 6, 7], params, rid)
        await log_a_second_on()
        await log_a_second_on()  # nothing since: zeros, at INFO (the first idle line)
        await log_a_second_on()  # at DEBUG
        eng.shutdown()
        await log_a_second_on()  # no thread: zeros, not the totals subtracted
        await collect(eng, [5, 6, 7], params, "c")  # a new thread, which starts from the engine's totals
        await log_a_second_on()
        eng.shutdown()

    asyncio.run(main())
    rates = [line.split("Avg prompt throughput: ")[1].split(", Running")[0] for _, line in lines]
    assert rates[0] == "6.0 tokens/s, Avg generation throughput: 20.0 tokens/s", lines
    assert rates[1:4] == ["0.0 tokens/s, Avg generation throughput: 0.0 tokens/s"] * 3, lines
    assert rates[4] == "3.0 tokens/s, Avg generation throughput: 10.0 tokens/s", lines
    assert [level for level, _ in lines] == [logging.INFO, logging.INFO, logging.DEBUG, logging.DEBUG, logging.INFO]
    assert "Mean exit depth: -" in lines[1][1] and "Running: 0 reqs" in lines[3][1]


def test_from_engine_args_names_an_unknown_keyword(tiny_ouro):
    """Checked when the args are made (vLLM's dataclass refuses an unknown field there), values too; every setting
    reads back, given or not; vLLM's from_engine_args keywords at the values that ask for nothing."""
    with pytest.raises(ValueError, match="^max_num_seq: not an LLM argument"):
        AsyncEngineArgs(model=str(tiny_ouro), max_num_seq=4)
    with pytest.raises(ValueError, match="^max_num_seqs"):
        AsyncEngineArgs(model=str(tiny_ouro), max_num_seqs=0)
    assert AsyncEngineArgs(model=str(tiny_ouro)).max_num_seqs == EngineConfig().max_num_seqs  # (the default)
    assert AsyncEngineArgs(model=str(tiny_ouro), max_num_seqs=3).max_num_seqs == 3
    with pytest.raises(ValueError, match="^stat_loggers: not supported by loopserve"):
        AsyncLLMEngine.from_engine_args(AsyncEngineArgs(model=str(tiny_ouro)), stat_loggers=[object()])
    with pytest.raises(ValueError, match="^disable_log_requests"):
        AsyncEngineArgs(model=str(tiny_ouro), enable_log_requests=True, disable_log_requests=True)
    args = AsyncEngineArgs(model=str(tiny_ouro), dtype="float32", disable_log_requests=False)
    assert args.dtype == "float32" and args.enable_log_requests
    with pytest.raises(ValueError, match="^scheduler: 'reference'"):
        AsyncLLMEngine(LLM(str(tiny_ouro), dtype="float32", scheduler="reference"))


def test_a_dead_engine_fails_every_stream(tiny_ouro, monkeypatch):
    """A step that raises kills the engine (vLLM's EngineDeadError): the streams in flight raise it, and so do later
    requests; `errored`, `is_running` and `check_health` say so."""
    eng = AsyncLLMEngine.from_engine_args(AsyncEngineArgs(model=str(tiny_ouro), dtype="float32",
                                                          kv_cache_tokens=1024))
    real, steps = eng.llm.llm_engine.step, []

    def failing():
        steps.append(1)
        if len(steps) > 3:
            raise RuntimeError("boom")
        return real()

    monkeypatch.setattr(eng.llm.llm_engine, "step", failing)

    async def main():
        assert eng.is_running and not eng.errored
        await eng.check_health()
        held = eng.generate([5, 6, 7], LONG, "held")  # (a consumer that reads once, then not while the engine dies)
        await anext(held)
        runs = [collect(eng, [5, 6, 7], LONG, f"d{i}") for i in range(3)]
        for result in await asyncio.gather(*runs, return_exceptions=True):
            assert isinstance(result, EngineDeadError) and "boom" in str(result)
            assert not isinstance(result, EngineStoppedError)  # (dead, not shut down)
        assert eng.errored and not eng.is_running
        with pytest.raises(EngineDeadError, match="boom"):
            await eng.check_health()
        with pytest.raises(EngineDeadError, match="boom"):
            await anext(eng.generate([5], SamplingParams(max_tokens=2), "later"))
        with pytest.raises(EngineDeadError, match="boom"):  # (its id unread: not "already in flight")
            await anext(eng.generate([5], SamplingParams(max_tokens=2), "held"))
        with pytest.raises(EngineDeadError, match="boom"):
            await anext(held)
        with pytest.raises(EngineDeadError, match="boom"):  # (not False "requests are in flight": they failed)
            await eng.reset_prefix_cache()

    asyncio.run(main())
    eng.shutdown()
    assert eng.errored
    # the LLM it ran on, used again, runs its own request alone: the dead engine's were left in it, and its next
    # generate ran them to their end first, unseen
    monkeypatch.setattr(eng.llm.llm_engine, "step", real)
    before = eng.llm.llm_engine.stats.generated_tokens
    [out] = eng.llm.generate([[5, 6]], SamplingParams(max_tokens=2), use_tqdm=False)
    assert len(out.outputs[0].token_ids) == 2 and eng.llm.llm_engine.stats.generated_tokens - before == 2
    assert not eng.llm.llm_engine.requests and eng.llm.reset_prefix_cache() is True


def test_a_request_being_built_holds_up_no_other_stream(engine, monkeypatch):
    """A request is built (its text tokenized, its grammar checked) on a worker thread, its id held meanwhile: built
    on the event loop, a 2 MB prompt held every other stream up for seconds. An abort while it is built ends it with
    an abort output."""
    import threading

    real, release = engine.llm._make_sequence, threading.Event()

    def slow(prompt, *args):
        if prompt == "slow":
            assert release.wait(10), "the event loop waited for this build"
        return real(prompt, *args)

    monkeypatch.setattr(engine.llm, "_make_sequence", slow)

    async def main():
        building = asyncio.create_task(collect(engine, "slow", SamplingParams(max_tokens=2), "b1"))
        await asyncio.sleep(0.05)
        with pytest.raises(ValueError, match="^request_id: 'b1' is already in flight"):  # (held while it is built)
            await anext(engine.generate([5], SamplingParams(max_tokens=2), "b1"))
        other = await asyncio.wait_for(collect(engine, [5, 6], SamplingParams(max_tokens=3), "b2"), 30)
        assert other[-1].finished and not building.done()
        release.set()
        assert (await asyncio.wait_for(building, 30))[-1].finished
        release.clear()
        aborted = asyncio.create_task(collect(engine, "slow", LONG, "b3"))
        await asyncio.sleep(0.05)
        await engine.abort("b3")
        release.set()
        outs = await asyncio.wait_for(aborted, 30)
        assert outs[-1].finished and outs[-1].outputs[0].finish_reason == "abort"

    asyncio.run(main())
    assert drained(engine)


def test_reset_prefix_cache_runs_between_steps(engine):
    """vLLM's rules (False while a request is in flight, True when idle), run on the engine thread between two steps
    (the engine is single-threaded), and before the thread starts."""
    engine.shutdown()
    assert asyncio.run(engine.reset_prefix_cache()) is True

    async def run() -> tuple[bool, bool]:
        stream = engine.generate("the cat", LONG, "busy")
        await stream.__anext__()
        busy = await engine.reset_prefix_cache()
        await stream.aclose()
        await wait_drained(engine)
        return busy, await engine.reset_prefix_cache()

    assert asyncio.run(run()) == (False, True)


@pytest.mark.parametrize("method", ["encode", "add_lora", "sleep", "start_profile", "get_model_config",
                                    "pause_generation", "add_request", "get_decoding_config"])
def test_vllms_methods_for_what_loopserve_lacks_say_what_to_use(engine, method):
    with pytest.raises(ValueError, match=f"^{method}: AsyncLLMEngine.{method} .*"):
        getattr(engine, method)()
    assert asyncio.run(engine.is_sleeping()) is False
    with pytest.raises(AttributeError, match="no_such_method"):
        engine.no_such_method  # noqa: B018


def test_vllms_config_attributes_are_attribute_errors_saying_what_to_use(engine):
    """An attribute, not a method: reading it is an AttributeError (hasattr stays False) that names `.llm`; vLLM's
    `model_config` is its LLM's."""
    with pytest.raises(AttributeError, match=r"'vllm_config'.*LLM.model_config.*\.llm"):
        engine.vllm_config  # noqa: B018
    assert not hasattr(engine, "vllm_config")
    assert engine.model_config is engine.llm.model_config


@pytest.mark.parametrize("kind", [DELTA, CUMULATIVE])
def test_a_slow_consumer_reads_merged_outputs(engine, kind):
    """Outputs that arrive while the consumer is busy are folded into the one it has not read yet (vLLM's
    `RequestOutput.add`): fewer outputs than tokens, and together exactly what a fast consumer gets."""
    params = SamplingParams(max_tokens=48, ignore_eos=True, temperature=0.0, logprobs=1)
    engine.shutdown()
    [want] = engine.llm.generate(["the cat"], params, use_tqdm=False)

    async def slow() -> list:
        outs = []
        async for out in engine.generate("the cat", SamplingParams(**{**vars(params), "output_kind": kind}), "slow"):
            outs.append(out)
            time.sleep(0.05)  # (blocks the loop: the engine thread's outputs pile up meanwhile)
        return outs

    outs = asyncio.run(slow())
    assert len(outs) < 48 and outs[-1].finished, len(outs)
    w = want.outputs[0]
    if kind == DELTA:
        got = [c for o in outs for c in o.outputs]
        assert "".join(c.text for c in got) == w.text
        assert [t for c in got for t in c.token_ids] == w.token_ids
        assert [d for c in got for d in c.exit_depths] == w.exit_depths
        assert [lp for c in got for lp in c.logprobs] == w.logprobs
    else:
        last = outs[-1].outputs[0]
        assert (last.text, last.token_ids, last.exit_depths, last.finish_reason) == (w.text, w.token_ids,
                                                                                    w.exit_depths, w.finish_reason)


def test_a_call_between_steps_is_answered_when_the_thread_has_ended(engine):
    """`EngineThread.between_steps` on a thread that has stopped answers with EngineStoppedError at once, rather
    than a future nobody settles (a hang)."""
    async def run() -> None:
        [_ async for _ in engine.generate("the cat", SamplingParams(max_tokens=1), "warm")]
        thread = engine._thread
        assert thread is not None
        await thread.shutdown()
        with pytest.raises(EngineStoppedError):
            await asyncio.wait_for(thread.between_steps(lambda e: True), 5)

    asyncio.run(run())
    engine.shutdown()


def test_engine_args_read_back_set_copy_and_take_every_llm_keyword(tiny_ouro):
    """chat_template and generation_config are LLM's keywords too; a setting assigned is checked and used; the args
    deep-copy and pickle (copy's hook lookups on a half-built instance raised a TypeError)."""
    import copy
    import pickle

    args = AsyncEngineArgs(model=str(tiny_ouro), dtype="float32", generation_config="vllm", enable_log_requests=True)
    args.max_num_seqs = 3
    with pytest.raises(ValueError, match="^max_num_seqs: must be an integer >= 1"):
        args.max_num_seqs = 0
    for same in (copy.deepcopy(args), pickle.loads(pickle.dumps(args))):
        assert (same.max_num_seqs, same.generation_config, same.enable_log_requests) == (3, "vllm", True)
    eng = AsyncLLMEngine.from_engine_args(args)
    assert eng.engine.cfg.max_num_seqs == 3 and eng.log_requests


def test_a_finished_request_frees_its_id_at_once(engine):
    """vLLM frees a request id when the request finishes: a consumer that breaks out on the finished output may
    reuse it at once (it stayed in use until the generator was closed)."""
    async def run() -> None:
        for _ in range(2):
            async for out in engine.generate("the cat", SamplingParams(max_tokens=2), "same"):
                if out.finished:
                    break

    asyncio.run(run())


def test_cumulative_outputs_hold_their_own_lists(engine):
    """A CUMULATIVE output kept by the consumer does not change as the engine thread goes on (its logprobs were the
    engine's own list, growing under it)."""
    params = SamplingParams(max_tokens=10, ignore_eos=True, temperature=0.0, logprobs=1, output_kind=CUMULATIVE)

    async def run() -> list:
        return [out async for out in engine.generate("the cat", params, "lists")]

    outs = asyncio.run(run())
    lengths = [len(o.outputs[0].token_ids) for o in outs]  # (a loaded machine may merge some: fewer, never fewer ids)
    assert [len(o.outputs[0].logprobs) for o in outs] == lengths and lengths[-1] == 10
    assert lengths == sorted(set(lengths)) and len(outs) > 1
    assert outs[0].metrics is not outs[-1].metrics and outs[0].metrics.finished_time is None


def test_reset_prefix_cache_from_a_second_event_loop(engine):
    """After a first asyncio.run, a second one's reset goes to a thread serving its own loop (it raised 'Future
    attached to a different loop')."""
    asyncio.run(collect(engine, "the cat", SamplingParams(max_tokens=1), "first"))
    assert asyncio.run(engine.reset_prefix_cache()) is True


def test_a_shutdown_past_its_timeout_never_leaves_two_threads_stepping(tiny_ouro, monkeypatch):
    """shutdown(timeout) returning while the thread is mid-step keeps it: the next generate waits for it to end
    before starting another (two threads once stepped the same engine and broke its scheduler)."""
    eng = AsyncLLMEngine.from_engine_args(AsyncEngineArgs(model=str(tiny_ouro), dtype="float32",
                                                          kv_cache_tokens=1024))
    real, active, most = eng.llm.llm_engine.step, [0], [0]

    def slow():
        active[0] += 1
        most[0] = max(most[0], active[0])
        time.sleep(0.05)
        try:
            return real()
        finally:
            active[0] -= 1

    monkeypatch.setattr(eng.llm.llm_engine, "step", slow)

    async def main() -> list:
        stream = eng.generate([5, 6, 7], LONG, "a")
        await anext(stream)
        eng.shutdown(timeout=0.001)
        with pytest.raises(EngineStoppedError):
            async for _ in stream:
                pass
        return await collect(eng, [5, 6], SamplingParams(max_tokens=3, ignore_eos=True), "b")

    outs = asyncio.run(main())
    eng.shutdown()
    assert outs[-1].finished and most[0] == 1 and not eng.engine.requests


def test_metrics_snapshot_copies_every_field():
    """`RequestMetrics.snapshot` copies field by field (for speed): a field added later must be copied too."""
    import dataclasses

    from loopserve.outputs import RequestMetrics

    values = {f.name: float(i + 1) if "time" in f.name else i + 1
              for i, f in enumerate(dataclasses.fields(RequestMetrics))}
    m = RequestMetrics(**values)
    copy = m.snapshot()
    assert copy is not m and dataclasses.asdict(copy) == values


def test_shutdown_from_another_thread_ends_streams_with_the_error(engine):
    """Called off the event loop (asyncio.to_thread), shutdown ends the streams in flight with EngineStoppedError, as
    on the loop (they ended with their abort outputs instead)."""
    async def run() -> None:
        stream = engine.generate("the cat", LONG, "off-loop")
        await anext(stream)
        await asyncio.to_thread(engine.shutdown)
        with pytest.raises(EngineStoppedError):
            async for _ in stream:
                pass

    asyncio.run(run())


# -- one engine, several threads and loops ------------------------------------------------------------------------
def test_llm_generate_takes_the_engine_back_from_a_loop_that_ended(engine):
    """After `asyncio.run` returned without a shutdown, `llm.generate` on the same engine stops the idle engine thread
    first and gives `LLM.generate`'s own outputs (it stepped the engine beside the thread: wrong outputs, or a dead
    engine); while a loop runs the engine, it is a RuntimeError, and so is stepping the engine by hand."""
    params = SamplingParams(max_tokens=8, temperature=0.9, seed=5)
    engine.shutdown()
    want = [completion(o) for o in engine.llm.generate(PROMPTS, params, use_tqdm=False)]
    asyncio.run(collect(engine, "the cat", SamplingParams(max_tokens=3), "before"))
    assert [completion(o) for o in engine.llm.generate(PROMPTS, params, use_tqdm=False)] == want

    async def busy():
        stream = engine.generate([5, 6, 7], LONG, "busy")
        await anext(stream)
        with pytest.raises(RuntimeError, match="shutdown"):
            engine.llm.generate(PROMPTS, params, use_tqdm=False)
        with pytest.raises(RuntimeError, match="engine thread"):
            engine.llm.llm_engine.step()
        await stream.aclose()

    asyncio.run(busy())
    assert [completion(o) for o in engine.llm.generate(PROMPTS, params, use_tqdm=False)] == want
    assert not engine.errored or engine._closed


def test_a_loop_that_ends_without_shutdown_stops_its_engine_thread(engine):
    """Nobody reads its outputs any more: the thread stops (within its idle poll), aborting what it held."""
    async def main():
        stream = engine.generate([5, 6, 7], LONG, "left")
        await anext(stream)
        return engine._thread

    thread = asyncio.run(main())
    end = time.monotonic() + 10
    while thread.alive:
        assert time.monotonic() < end, "the engine thread outlived its event loop"
        time.sleep(0.05)
    assert engine.engine.driver is None and not engine.engine.requests


def test_two_threads_asking_for_the_engine_thread_at_once_get_one(engine):
    """After a first loop ended, two threads each running their own loop race to replace the engine thread: one gets
    it, the other the documented RuntimeError (both once started a thread on the one engine, which then died)."""
    import threading

    asyncio.run(collect(engine, "the cat", SamplingParams(max_tokens=2), "first"))
    barrier, results = threading.Barrier(2), []

    def run(tag: str) -> None:
        async def main():
            barrier.wait()
            try:
                outs = await collect(engine, [5, 6, 7], SamplingParams(max_tokens=40, ignore_eos=True), tag)
                results.append(("ok", len(outs[-1].outputs[0].token_ids)))
            except RuntimeError as e:
                results.append(("refused" if "another event loop" in str(e) else repr(e), 0))
        asyncio.run(main())

    threads = [threading.Thread(target=run, args=(f"t{i}",)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    engine.shutdown()
    assert sorted(r[0] for r in results) in (["ok", "refused"], ["ok", "ok"]), results
    assert all(n == 40 for kind, n in results if kind == "ok")
    assert engine._thread is None or engine._thread.dead is None


def test_a_closed_loops_streams_do_not_hold_their_ids(engine):
    """A loop closed with a stream still open (run_until_complete, then close): its request id is free on the next
    loop (it stayed 'already in flight' for ever)."""
    loop = asyncio.new_event_loop()
    stream = engine.generate([5, 6, 7], LONG, "stale")
    loop.run_until_complete(anext(stream))
    loop.close()
    outs = asyncio.run(collect(engine, [5, 6], SamplingParams(max_tokens=2, ignore_eos=True), "stale"))
    assert outs[-1].finished
    del stream


def test_abort_frees_the_id_and_the_kv_at_once(engine):
    """After `await abort(id)`, the id may be reused and the prefix cache reset (an aborted request holds no KV), before
    the consumer has read the abort output (vLLM's order)."""
    async def main():
        stream = engine.generate([5, 6, 7], LONG, "again")
        await anext(stream)
        await engine.abort("again")
        reset = await engine.reset_prefix_cache()
        outs = await collect(engine, [5, 6], SamplingParams(max_tokens=2, ignore_eos=True), "again")
        rest = [o async for o in stream]
        return reset, outs, rest

    reset, outs, rest = asyncio.run(main())
    assert reset is True and outs[-1].finished and outs[-1].request_id == "again"
    assert rest[-1].outputs[0].finish_reason == "abort"


def test_abort_of_something_that_is_no_request_id_is_a_value_error(engine):
    """As `LLMEngine.abort_request`: a ValueError naming the argument (it was a TypeError from `list(None)`); an id
    that cannot be one (a list inside the list) is passed over, as an id not in flight is."""
    async def main():
        for bad in (None, 123, 4.5):
            with pytest.raises(ValueError, match="^request_id: expected a request id"):
                await engine.abort(bad)
        await engine.abort([["x"], "not-in-flight"])
        return await collect(engine, [5, 6], SamplingParams(max_tokens=2, ignore_eos=True), "after")

    assert asyncio.run(main())[-1].finished  # (the engine serves on)


@pytest.mark.parametrize("how", ["return", "raise"])
def test_exit_with_requests_in_flight_and_no_shutdown_is_clean(tiny_ouro, how, tmp_path):
    """A script that leaves asyncio.run with a stream open and never calls shutdown exits 0 (the engine thread, still
    in a step while the interpreter finalized, aborted the process: 'terminate called without an active exception')."""
    import subprocess
    import sys

    script = tmp_path / "leave.py"
    script.write_text(f"""
import asyncio, sys
from loopserve import AsyncEngineArgs, AsyncLLMEngine, SamplingParams
eng = AsyncLLMEngine.from_engine_args(AsyncEngineArgs(model={str(tiny_ouro)!r}, dtype="float32", kv_cache_tokens=1024))
async def main():
    streams = [eng.generate([5, 6, 7], SamplingParams(max_tokens=400, ignore_eos=True), str(i)) for i in range(4)]
    for s in streams:
        await anext(s)
    if {how!r} == "raise":
        raise SystemExit(0)
asyncio.run(main())
""")
    for _ in range(2):
        done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, done.stderr[-2000:]


def test_exit_after_an_engine_made_in_main_without_shutdown_is_clean(tiny_ouro, tmp_path):
    """An engine made inside `main()` and never shut down: its thread, once the loop had ended, held the last
    reference to it and freed the model as the interpreter finalized, after the exit hook had stopped looking for
    it: the process aborted (rc 134) every time. vLLM's scripts of this shape exit 0. (The KV pool at its default
    size, 1 GiB: a small one was freed before the interpreter got that far.)"""
    import subprocess
    import sys

    script = tmp_path / "local.py"
    script.write_text(f"""
import asyncio
from loopserve import AsyncEngineArgs, AsyncLLM, SamplingParams
async def main():
    engine = AsyncLLM.from_engine_args(AsyncEngineArgs(model={str(tiny_ouro)!r}, dtype="float32"))
    async for out in engine.generate([5, 6, 7], SamplingParams(max_tokens=4), "r1"):
        pass
    print(len(out.outputs[0].token_ids))
asyncio.run(main())
""")
    for _ in range(2):
        done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120)
        assert (done.returncode, done.stdout.strip()) == (0, "4"), done.stderr[-2000:]


def test_engine_args_from_cli_args(tiny_ouro):
    """vLLM's `add_cli_args` / `from_cli_args`: the flags of `loopserve serve` (one declaration: the configs'), and
    `--enable-log-requests`; `enable_log_requests` is checked when set, and `disable_log_requests` reads back."""
    import argparse

    parser = AsyncEngineArgs.add_cli_args(argparse.ArgumentParser())
    args = AsyncEngineArgs.from_cli_args(parser.parse_args(
        ["--model", str(tiny_ouro), "--dtype", "float32", "--max-num-seqs", "3", "--enable-log-requests"]))
    assert isinstance(args, AsyncEngineArgs)
    assert (args.model, args.dtype, args.max_num_seqs, args.enable_log_requests, args.disable_log_requests) == (
        str(tiny_ouro), "float32", 3, True, False)
    with pytest.raises(ValueError, match="^enable_log_requests: expected a bool"):
        args.enable_log_requests = "yes"
    with pytest.raises(SystemExit):
        parser.parse_args(["--max-num-seqs", "x"])
    plain = EngineArgs_from_cli(tiny_ouro)
    assert plain.max_num_seqs == EngineConfig().max_num_seqs and not hasattr(plain, "enable_log_requests")
    # vLLM's flags for what loopserve lacks, as serve takes them
    vllm = AsyncEngineArgs.from_cli_args(parser.parse_args(["--model", str(tiny_ouro), "--enable-chunked-prefill",
                                                            "--kv-cache-dtype", "auto"]))
    assert (vllm.enable_chunked_prefill, vllm.kv_cache_dtype) == (True, "auto")
    with pytest.raises(ValueError, match="^quantization: not supported by loopserve"):
        AsyncEngineArgs.from_cli_args(parser.parse_args(["--quantization", "awq"]))
    # vLLM's older --disable-log-requests and its -tp (each was "unrecognized arguments")
    quiet = AsyncEngineArgs.from_cli_args(parser.parse_args(["--model", str(tiny_ouro), "--disable-log-requests",
                                                             "-tp", "1"]))
    assert (quiet.disable_log_requests, quiet.tensor_parallel_size) == (True, 1)


def test_engine_args_is_a_dataclass_as_vllms(tiny_ouro):
    """vLLM's scripts build an LLM from `asdict(EngineArgs(...))`, from `vars(EngineArgs(...))` and from `vars()` of a
    parser `add_cli_args` filled (its examples' pattern): all give the LLM the args describe. `replace` and `fields`
    work; a vLLM flag for what loopserve lacks reaches `LLM` under its keyword's name (it had a prefixed one LLM
    refused)."""
    import argparse
    import copy
    import dataclasses

    from loopserve.async_llm import EngineArgs

    args = EngineArgs(model=str(tiny_ouro), dtype="float32", max_model_len=96, seed=7, enable_chunked_prefill=True)
    names = [f.name for f in dataclasses.fields(EngineArgs)]
    assert names[:3] == ["model", "chat_template", "generation_config"] and {"max_num_seqs", "dtype"} <= set(names)
    assert "enable_chunked_prefill" not in names and args.enable_chunked_prefill  # (given: reads back)
    llm = LLM(**dataclasses.asdict(args))
    assert (llm.max_model_len, llm.seed, llm.load_config.dtype) == (96, 7, "float32")
    assert set(vars(args)) == set(names)  # (`LLM(**vars(args))`: nothing but the fields, the neutral ones kept apart)
    assert LLM(**vars(args)).max_model_len == 96
    changed = dataclasses.replace(args, max_num_seqs=5)
    assert (changed.max_num_seqs, changed.seed, args.max_num_seqs) == (5, 7, EngineConfig().max_num_seqs)
    with pytest.raises(ValueError, match="^max_num_seqs"):
        dataclasses.replace(args, max_num_seqs=0)
    assert dataclasses.replace(AsyncEngineArgs(enable_log_requests=True), seed=1).enable_log_requests
    with pytest.raises(ValueError, match="^max_model_len: must be an integer >= 2"):  # (when made, not at load)
        EngineArgs(max_model_len=-2)  # (-1 is vLLM's "auto")
    twin = copy.copy(args)
    twin.enable_chunked_prefill = False  # (a copy's own: the original's stays as given)
    assert args.enable_chunked_prefill and not twin.enable_chunked_prefill

    @dataclasses.dataclass
    class MyArgs(EngineArgs):  # (a script's own dataclass on top: its __init__ set fields before any check could)
        extra: int = 1

    mine = MyArgs(model=str(tiny_ouro), max_num_seqs=3, extra=2)
    assert (mine.max_num_seqs, mine.extra, mine.settings()["max_num_seqs"]) == (3, 2, 3)

    parser = EngineArgs.add_cli_args(argparse.ArgumentParser())
    parser.add_argument("--max-tokens", type=int)
    given = vars(parser.parse_args(["--model", str(tiny_ouro), "--dtype", "float32", "--max-model-len", "80",
                                    "--enable-chunked-prefill", "--kv-cache-dtype", "auto", "--max-tokens", "4"]))
    assert given.pop("max_tokens") == 4 and given["enable_chunked_prefill"] is True
    llm = LLM(**given)
    assert llm.max_model_len == 80 and len(llm.generate([[5, 6]], SamplingParams(max_tokens=4))[0].outputs[0].token_ids)


def EngineArgs_from_cli(path):  # noqa: N802 (the class's name)
    import argparse

    from loopserve.async_llm import EngineArgs

    parser = EngineArgs.add_cli_args(argparse.ArgumentParser())
    return EngineArgs.from_cli_args(parser.parse_args(["--model", str(path)]))


def test_an_aborted_stream_does_not_free_the_id_of_the_request_reusing_it(engine):
    """`abort` frees the id at once, so a new request may take it while the old stream still has its abort output to
    read: reading it left the new request's id free (a third was admitted) and unabortable."""
    async def main():
        old = engine.generate([5, 6, 7], LONG, "x")
        await anext(old)
        await engine.abort("x")
        new = engine.generate([5, 6], LONG, "x")
        await anext(new)
        rest = [o async for o in old]  # (its abort output)
        with pytest.raises(ValueError, match="already in flight"):
            await anext(engine.generate([5], LONG, "x"))
        await engine.abort("x")
        tail = [o async for o in new]
        return rest, tail

    rest, tail = asyncio.run(main())
    assert rest[-1].outputs[0].finish_reason == "abort" and tail[-1].outputs[0].finish_reason == "abort"
    assert len(tail[-1].outputs[0].token_ids) < 400


def test_one_engine_is_stepped_by_one_owner(tiny_ouro):
    """A second AsyncLLMEngine over the same LLM, on another loop, is refused (both threads once stepped the engine and
    broke its scheduler); so is an engine thread while `LLM.generate` runs on another thread, and `LLM.generate`
    while the thread serves a request; an idle thread (a notebook's loop always runs) hands the engine back."""
    import threading

    llm = LLM(str(tiny_ouro), dtype="float32", kv_cache_tokens=1024)
    first, second = AsyncLLMEngine(llm), AsyncLLMEngine(llm)
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    want = completion(llm.generate(["the cat"], params, use_tqdm=False)[0])

    async def run_first(started: threading.Event, release: threading.Event):
        stream = first.generate([5, 6, 7], LONG, "a")
        await anext(stream)
        started.set()
        await asyncio.to_thread(release.wait, 60)
        await stream.aclose()
        while first._thread._routes:  # (the abort is reported by the engine's next step)
            await asyncio.sleep(0.01)
        # idle now: the loop still runs, yet LLM.generate may take the engine (the thread is stopped for it)
        assert completion(llm.generate(["the cat"], params, use_tqdm=False)[0]) == want
        return [completion(o) async for o in first.generate("the cat", params, "b")][-1]

    started, release, errors = threading.Event(), threading.Event(), []

    def other_loop():
        started.wait(60)
        try:
            asyncio.run(collect(second, [5, 6], params, "c"))
        except RuntimeError as e:
            errors.append(str(e))
        try:
            llm.generate(["the cat"], params, use_tqdm=False)
        except RuntimeError as e:
            errors.append(str(e))
        release.set()

    t = threading.Thread(target=other_loop)
    t.start()
    last = asyncio.run(run_first(started, release))
    t.join(60)
    first.shutdown()
    second.shutdown()
    assert last == want
    assert len(errors) == 2 and "stepped by" in errors[0] and "requests in flight" in errors[1], errors
    assert llm.llm_engine.driver is None and not llm.llm_engine.requests

    # an engine thread cannot start while LLM.generate steps the engine on another thread
    blocked: list[str] = []
    real_step, in_step = llm.llm_engine.step, threading.Event()

    def slow_step():
        in_step.set()
        time.sleep(0.05)
        return real_step()

    llm.llm_engine.step = slow_step  # type: ignore[method-assign]
    sync = threading.Thread(target=llm.generate, args=(["the cat"], SamplingParams(max_tokens=20, ignore_eos=True)),
                            kwargs={"use_tqdm": False})
    sync.start()
    in_step.wait(30)
    try:
        asyncio.run(collect(first, [5, 6], params, "d"))
    except RuntimeError as e:
        blocked.append(str(e))
    sync.join(60)
    del llm.llm_engine.step
    assert blocked and "stepped by" in blocked[0]


def test_reset_prefix_cache_after_shutdown_starts_nothing(engine):
    """After a shutdown, even one whose timeout ran out mid-step, a reset runs on the engine itself once the thread
    has ended (it started a new thread, making the engine healthy again)."""
    asyncio.run(collect(engine, "the cat", SamplingParams(max_tokens=2), "r"))
    engine.shutdown()
    assert asyncio.run(engine.reset_prefix_cache()) is True
    assert engine.errored and (engine._thread is None or not engine._thread.alive)

    async def cut_short() -> bool:
        stream = engine.generate([5, 6, 7], LONG, "long")
        await anext(stream)
        engine.shutdown(timeout=0)
        reset = await engine.reset_prefix_cache()
        with pytest.raises(EngineStoppedError):
            async for _ in stream:
                pass
        return reset

    assert asyncio.run(cut_short()) is True
    assert engine.errored and (engine._thread is None or not engine._thread.alive)


def test_asyncllm_only_methods_are_not_llms(engine):
    """vLLM's LLM has no add_request or pause_generation: loopserve's LLM neither (the shared table gave it them)."""
    assert not hasattr(engine.llm, "add_request") and not hasattr(engine.llm, "pause_generation")
    with pytest.raises(ValueError, match="^add_request: AsyncLLMEngine.add_request"):
        engine.add_request()


# -- beam search (vLLM's EngineClient.beam_search) -------------------------------------------------------------------
BEAMS = BeamSearchParams(beam_width=3, max_tokens=4, length_penalty=0.0)
EOS_PROMPT = [14, 300]  # tiny Ouro: an end-of-sequence token ranks 3rd after it


def test_beam_search_equals_llm_beam_search(engine):
    """One output, final, once the search is over: its outputs `LLM.beam_search`'s beams (the same engine, stopped
    for it), best first, as the server returns them: the generated ids (a completed beam's end-of-sequence token
    included, and its stop_reason), the text of the generated tokens without it, every token's logprobs. Searches
    run together, and beside a sampled request, give each its own result."""
    from loopserve.beam_search import generated_text

    engine.shutdown()
    llm = engine.llm
    prompts = [EOS_PROMPT, "hello"]
    want = llm.beam_search(prompts, BEAMS)

    async def search(prompt, rid: str) -> list:
        return [o async for o in engine.beam_search(prompt, rid, BEAMS)]

    async def main():
        sampled = collect(engine, [5, 6, 7], SamplingParams(max_tokens=8, temperature=0.0), "s")
        return await asyncio.gather(*[search(p, f"b{i}") for i, p in enumerate(prompts)], sampled)

    *got, sampled = asyncio.run(main())
    assert sampled[-1].outputs[0].finish_reason == "length"
    rule = generated_text(llm.tokenizer, include_stop_str_in_output=False)
    for i, (outs, p, w) in enumerate(zip(got, prompts, want, strict=True)):
        [out] = outs
        ids = p if isinstance(p, list) else llm.tokenizer.encode(p)
        assert out.finished and out.request_id == f"b{i}" and out.prompt_token_ids == ids
        assert out.prompt == (p if isinstance(p, str) else None)
        assert [c.index for c in out.outputs] == [0, 1, 2]
        for c, s in zip(out.outputs, w.sequences, strict=True):
            assert c.token_ids == s.tokens[len(ids):] and c.finish_reason == s.finish_reason
            assert c.cumulative_logprob == pytest.approx(s.cum_logprob, abs=1e-5)  # (float32, other batches)
            assert len(c.logprobs) == len(c.token_ids) == len(s.logprobs)
            for entry, offline in zip(c.logprobs, s.logprobs, strict=True):
                assert list(entry) == list(offline)  # the sampled token, then the top 2 * beam_width
                assert [e.logprob for e in entry.values()] == pytest.approx(
                    [e.logprob for e in offline.values()], abs=1e-5)
            assert c.text == rule(len(ids), s.tokens, s.finish_reason)
            assert c.stop_reason == (c.token_ids[-1] if c.finish_reason == "stop" else None)
    assert any(c.finish_reason == "stop" for c in got[0][0].outputs)
    assert drained(engine)


LONG_BEAMS = BeamSearchParams(beam_width=2, max_tokens=300, ignore_eos=True)


def _finished(eng: AsyncLLMEngine) -> int:
    """Requests the engine has run to their end (a beam search's steps are requests of one token)."""
    return eng.llm.llm_engine.stats.finished_requests["length"]


async def _steps_run(eng: AsyncLLMEngine, requests: int, timeout_s: float = 30.0) -> None:
    """Wait until the engine has finished `requests` more requests (a search 2 wide: 1, then 2 a step)."""
    start, end = _finished(eng), time.monotonic() + timeout_s
    while _finished(eng) - start < requests:
        assert time.monotonic() < end, "the search did not run"
        await asyncio.sleep(0.005)


def test_beam_search_abort_ends_it_with_the_beams_so_far(engine):
    """`abort(request_id)` ends a search (its id is in flight throughout: a second use of it is refused): the output
    holds the best beams so far, finishing "abort", well short of max_tokens; nothing is left running."""
    async def main():
        task = asyncio.ensure_future(_collect_beams(engine, [5, 6, 7], "bs", LONG_BEAMS))
        await _steps_run(engine, 5)
        with pytest.raises(ValueError, match="^request_id: 'bs' is already in flight"):
            await anext(engine.generate([1, 2], SamplingParams(max_tokens=2), "bs"))
        with pytest.raises(ValueError, match="^request_id: 'bs' is already in flight"):
            await anext(engine.beam_search([1, 2], "bs", BEAMS))
        await engine.abort("bs")
        return await task

    [out] = asyncio.run(main())
    assert out.finished and out.request_id == "bs"
    assert [c.finish_reason for c in out.outputs] == ["abort", "abort"]
    assert 1 <= len(out.outputs[0].token_ids) < 300
    assert all(len(c.logprobs) == len(c.token_ids) for c in out.outputs)
    assert drained(engine)


async def _collect_beams(eng: AsyncLLMEngine, prompt, rid: str, params: BeamSearchParams) -> list:
    return [o async for o in eng.beam_search(prompt, rid, params)]


@pytest.mark.parametrize("how", ["cancel", "aclose"])
def test_a_beam_search_consumer_that_stops_frees_it(engine, how):
    """A consumer that goes away mid-search (its task cancelled, the generator closed) aborts the step in flight: no
    other step starts, the engine is drained and the id is free again."""

    async def main():
        gen = engine.beam_search([5, 6, 7], "gone", LONG_BEAMS)
        task = asyncio.ensure_future(anext(gen))
        await _steps_run(engine, 5)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        if how == "aclose":
            await gen.aclose()
        await wait_drained(engine)
        finished = _finished(engine)
        await asyncio.sleep(0.2)
        assert _finished(engine) == finished  # no step began since
        [again] = await _collect_beams(engine, [5, 6, 7], "gone", BeamSearchParams(beam_width=2, max_tokens=2))
        assert [len(c.token_ids) for c in again.outputs] == [2, 2]

    asyncio.run(main())
    assert drained(engine)


@pytest.mark.parametrize("call, field", [
    (lambda e: e.beam_search([5, 6], "r", SamplingParams(max_tokens=4)), "params"),
    (lambda e: e.beam_search([5, 6], "r", BeamSearchParams(beam_width=11, max_tokens=4)), "beam_width"),
    (lambda e: e.beam_search([5, 6], 7, BEAMS), "request_id"),
    (lambda e: e.beam_search([5, 6], "r", BEAMS, lora_request=object()), "lora_request"),
    (lambda e: e.beam_search({"x": 1}, "r", BEAMS), "prompt"),
    (lambda e: e.beam_search([5] * 5000, "r", BEAMS), "prompt"),
])
def test_bad_beam_searches_are_value_errors_naming_the_field(engine, call, field):
    async def main():
        with pytest.raises(ValueError, match=f"^{field}"):
            await anext(call(engine))

    asyncio.run(main())
    assert drained(engine)
