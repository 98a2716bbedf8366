"""The server's request metrics, fed hand-built outputs (`ServerMetrics.observe`, as the engine thread calls it): each
of an n > 1 request's samples is timed by its own first, last and finish times, not by the request's merge of them."""

from __future__ import annotations

import dataclasses

import pytest

from loopserve.engine.engine_thread import EngineSnapshot
from loopserve.outputs import CompletionOutput, RequestMetrics, RequestOutput
from loopserve.serve.metrics import ENGINE, TOKEN_GAP_BUCKETS, ServerMetrics, one_two_five

MODEL = "m"


def _value(metrics: ServerMetrics, name: str) -> float:
    value = metrics.registry.get_sample_value(f"loopserve:{name}", {"model_name": MODEL, "engine": ENGINE})
    assert value is not None, name
    return value


def _sample(index: int, tokens: int, first: float, last: float, finished: float | None,
            reason: str | None = "length") -> CompletionOutput:
    return CompletionOutput(index, "", list(range(tokens)), None, None, reason,
                            metrics=RequestMetrics(0.0, first, finished, last_token_time=last))


@pytest.fixture
def metrics() -> ServerMetrics:
    return ServerMetrics(MODEL, EngineSnapshot, r_max=4, max_decode_batch=8, max_model_len=256)


def test_a_final_only_output_times_each_sample_by_its_own_tokens(metrics):
    """One output for two samples (a response that is not streamed): the 2-token one ran from t=1 to t=11, the
    101-token one from t=1 to t=101; the request's merged metrics say first 1, last and finished 101."""
    metrics.scheduled("r", (0, 1), 0.5)
    merged = RequestMetrics(0.0, 1.0, 101.0, last_token_time=101.0)
    samples = [_sample(0, 2, 1.0, 11.0, 11.0), _sample(1, 101, 1.0, 101.0, 101.0)]
    out = RequestOutput("r", None, [7, 8, 9], None, samples, True, merged)
    metrics.observe([out])
    assert _value(metrics, "inter_token_latency_seconds_count") == 1 + 100
    assert _value(metrics, "inter_token_latency_seconds_sum") == pytest.approx(10.0 + 100.0)
    assert _value(metrics, "request_decode_time_seconds_sum") == pytest.approx(10.0 + 100.0)
    assert _value(metrics, "e2e_request_latency_seconds_sum") == pytest.approx(11.0 + 101.0)
    assert _value(metrics, "time_to_first_token_seconds_count") == 2
    assert _value(metrics, "prompt_tokens_total") == 2 * 3
    assert _value(metrics, "generation_tokens_total") == 103


def test_a_sample_admitted_later_waits_in_the_queue_by_its_own_admission(metrics):
    """n = 2 with room for one: sample 1 is admitted at t=9, when sample 0 has finished; its 9 s of waiting are queue
    time, not prefill time (they were counted as prefill, every sample taking the first one's admission)."""
    metrics.scheduled("r", (0,), 0.5)
    metrics.scheduled("r", (1,), 9.0)
    out = RequestOutput("r", None, [7], None, [_sample(0, 2, 1.0, 2.0, 2.0), _sample(1, 2, 9.5, 10.0, 10.0)], True,
                        RequestMetrics(0.0, 1.0, 10.0, last_token_time=10.0))
    metrics.observe([out])
    assert _value(metrics, "request_queue_time_seconds_sum") == pytest.approx(0.5 + 9.0)
    assert _value(metrics, "request_prefill_time_seconds_sum") == pytest.approx(0.5 + 0.5)


def test_the_engine_thread_reports_each_part_of_a_request_when_it_is_admitted(tiny_ouro):
    """n = 3 where two sequences fit: the third sample is admitted by a later step than the first two (a part of its
    own), and `on_scheduled` says so, sample by sample."""
    from loopserve.engine.engine_thread import EngineThread
    from loopserve.sampling_params import SamplingParams
    from tests.engine_helpers import make_engine

    calls: list[tuple[str, tuple[int, ...], float]] = []
    aengine = EngineThread(make_engine(tiny_ouro, max_num_seqs=2), max_queued_requests=4,
                           on_scheduled=lambda rid, samples, t: calls.append((rid, samples, t)))  # (not started)
    engine = aengine.engine
    aengine.add([engine.make_sequence("r", [5, 6, 7], SamplingParams(max_tokens=3, n=3, ignore_eos=True))])
    aengine._apply_commands()
    steps = 0
    while engine.has_unfinished_requests():
        engine.step()
        aengine._note_admissions(float(steps))
        steps += 1
    assert [(rid, samples) for rid, samples, _ in calls] == [("r", (0, 1)), ("r", (2,))], calls
    assert calls[1][2] > calls[0][2]


def test_a_sample_ended_before_its_first_token_times_no_phase(metrics):
    metrics.scheduled("r", (0, 1), 0.5)
    merged = RequestMetrics(0.0, 1.0, 5.0, last_token_time=5.0)
    out = RequestOutput("r", None, [7], None, [_sample(0, 5, 1.0, 5.0, 5.0), _sample(1, 0, None, None, 2.0, "abort")],
                        True, merged)
    metrics.observe([out])
    assert _value(metrics, "request_decode_time_seconds_count") == 1  # (the aborted one ran no decode of its own)
    assert _value(metrics, "e2e_request_latency_seconds_count") == 2
    assert _value(metrics, "time_to_first_token_seconds_count") == 1


def test_a_streamed_output_of_several_tokens_is_one_gap(metrics):
    """A stream's later output holds one engine step's tokens (several under speculative decoding): one
    inter-token observation, the time since the sample's previous output, as vLLM observes once per step (a zero
    per further token pulled the percentiles to 0)."""
    metrics.scheduled("r", (0, 1), 0.5)
    first = RequestOutput("r", None, [7], None, [_sample(0, 1, 1.0, 1.0, None, None)], False,
                          RequestMetrics(0.0, 1.0, None))
    metrics.observe([first])
    later = RequestOutput("r", None, [7], None, [_sample(0, 3, 1.0, 2.0, 2.0)], True, RequestMetrics(0.0, 1.0, 2.0))
    metrics.observe([later])
    assert _value(metrics, "inter_token_latency_seconds_count") == 1
    assert _value(metrics, "generation_tokens_total") == 4
    assert _value(metrics, "request_max_num_generation_tokens_sum") == 4
    assert _value(metrics, "request_time_per_output_token_seconds_sum") == pytest.approx((2.0 - 1.0) / 3)


def test_time_per_output_token_is_the_inter_token_latency_under_vllms_older_name(metrics):
    """vLLM 0.11 still exports vllm:time_per_output_token_seconds, the same observations and buckets as its
    inter_token_latency_seconds (dashboards of either name): a final-only output's gaps and a stream's."""
    metrics.scheduled("r", (0,), 0.5)
    metrics.observe([RequestOutput("r", None, [7], None, [_sample(0, 4, 1.0, 4.0, 4.0)], True,
                                   RequestMetrics(0.0, 1.0, 4.0, last_token_time=4.0))])
    metrics.scheduled("s", (0,), 0.5)
    metrics.observe([RequestOutput("s", None, [7], None, [_sample(0, 1, 1.0, 1.0, None, None)], False,
                                   RequestMetrics(0.0, 1.0, None))])
    metrics.observe([RequestOutput("s", None, [7], None, [_sample(0, 2, 1.0, 2.0, 2.0)], True,
                                   RequestMetrics(0.0, 1.0, 2.0))])

    def series(name: str) -> list[tuple[str, str | None, float]]:
        return [(s.name.removeprefix(f"loopserve:{name}"), s.labels.get("le"), s.value)
                for f in metrics.registry.collect() if f.name == f"loopserve:{name}" for s in f.samples]

    old = series("time_per_output_token_seconds")
    assert old == series("inter_token_latency_seconds")
    assert [le for suffix, le, _ in old if suffix == "_bucket"] == [*map(str, TOKEN_GAP_BUCKETS), "+Inf"]
    assert _value(metrics, "time_per_output_token_seconds_count") == 3 + 1


def test_vllm_prefix_and_buckets():
    """--metric-prefix vllm names every series as vLLM does (its dashboards read them); the buckets are vLLM V1's,
    so a time to first token of 100 s (an overloaded queue) lands in a finite bucket."""
    m = ServerMetrics(MODEL, EngineSnapshot, r_max=4, max_decode_batch=8, max_model_len=256, prefix="vllm",
                      cache_info={"block_size": "16"})
    labels = {"model_name": MODEL, "engine": ENGINE}
    m.ttft.labels(MODEL, ENGINE).observe(100.0)
    assert m.registry.get_sample_value("vllm:time_to_first_token_seconds_bucket", {**labels, "le": "160.0"}) == 1
    assert m.registry.get_sample_value("vllm:time_to_first_token_seconds_bucket", {**labels, "le": "80.0"}) == 0
    assert m.registry.get_sample_value("vllm:num_requests_running", labels) == 0
    assert m.registry.get_sample_value("vllm:cache_config_info", {"block_size": "16", "engine": ENGINE}) == 1
    assert m.registry.get_sample_value("loopserve:num_requests_running", labels) is None
    assert one_two_five(100) == (1, 2, 5, 10, 20, 50, 100) and one_two_five(4) == (1, 2)
    with pytest.raises(ValueError, match="^metric_prefix"):
        ServerMetrics(MODEL, EngineSnapshot, r_max=4, max_decode_batch=8, max_model_len=256, prefix="vllm:")


@pytest.mark.parametrize("accept", [
    "application/openmetrics-text;version=1.0.0;escaping=allow-utf-8;q=0.5,text/plain;version=0.0.4;q=0.4",
    "application/openmetrics-text; escaping=allow-utf-8",  # (no version: the names were half escaped)
    "application/openmetrics-text;version=1.0.0", "text/plain; version=1.0.0; escaping=allow-utf-8", "", None])
def test_every_answer_keeps_the_metric_names_as_they_are(metrics, accept):
    """Whatever the Accept header, the names a dashboard queries (`loopserve:...`), in the HELP and TYPE lines and in
    the samples alike: an OpenMetrics answer whose samples' names came escaped split into untyped families."""
    body, content_type = metrics.render_for(accept)
    text = body.decode()
    assert "loopserve:generation_tokens" in text and "loopserve_" not in text, (content_type, text[:500])
    assert content_type.startswith("text/plain") or "escaping=allow-utf-8" in content_type, content_type



def test_the_stats_lines_carry_vllms_prefix_cache_hit_rate_and_spec_decoding_line(monkeypatch):
    """vLLM's stats line ends with the prefix cache's hit rate, and a speculative engine logs a SpecDecoding line:
    both were missing. Each is of the interval since the last line."""
    from loopserve.serve import metrics as metrics_module
    from loopserve.serve.metrics import StatsLogger

    now = [100.0]
    monkeypatch.setattr(metrics_module.time, "monotonic", lambda: now[0])
    snap = [EngineSnapshot(running=1, prefix_cache_queries=100, prefix_cache_hits=40, spec_rounds=10,
                           spec_draft_tokens=30, spec_accepted_tokens=12, spec_accepted_per_pos=(6, 4, 2))]
    m = ServerMetrics(MODEL, lambda: snap[0], r_max=4, max_decode_batch=8, max_model_len=256)
    logger = StatsLogger(m, 1.0)
    now[0] += 2.0
    snap[0] = EngineSnapshot(running=1, exit_depths={2: 10}, prefix_cache_queries=300, prefix_cache_hits=190,
                             spec_rounds=30, spec_draft_tokens=90, spec_accepted_tokens=52,
                             spec_accepted_per_pos=(26, 18, 8))
    m.generation_total += 20
    main, spec = logger.lines()
    assert main == ("Engine 000: Avg prompt throughput: 0.0 tokens/s, Avg generation throughput: 10.0 tokens/s, "
                    "Running: 1 reqs, Waiting: 0 reqs, GPU KV cache usage: 0.0%, Prefix cache hit rate: 75.0%, "
                    "Mean exit depth: 2.00"), main  # vLLM's line word for word (log alerts read it), then the depth
    assert spec == ("SpecDecoding metrics: Mean acceptance length: 3.00, Accepted throughput: 20.00 tokens/s, Drafted "
                    "throughput: 30.00 tokens/s, Accepted: 40 tokens, Drafted: 60 tokens, Per-position acceptance "
                    "rate: 1.000, 0.700, 0.300, Avg Draft acceptance rate: 66.7%"), spec
    now[0] += 2.0  # nothing drafted or looked up since: no SpecDecoding line, a hit rate of 0
    m.generation_total += 1
    [main] = logger.lines()
    assert "Prefix cache hit rate: 0.0%" in main
    snap[0] = dataclasses.replace(snap[0], running=0)
    now[0] += 2.0  # idle after a busy interval: one line of zeros, as vLLM logs, then none
    [main] = logger.lines()
    assert "Avg generation throughput: 0.0 tokens/s, Running: 0 reqs" in main and "Mean exit depth: -" in main, main
    now[0] += 2.0
    assert logger.lines() == []
