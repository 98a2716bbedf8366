"""Prometheus metrics of the server, on a private registry, all under one prefix (`loopserve:`, or vLLM's own
`vllm:` with `serve --metric-prefix vllm`, so that vLLM's Grafana dashboards and alerts read them as they are) and
with `model_name` and `engine` labels (vLLM's convention; one engine, "0"), plus the process metrics of
prometheus_client's default collectors (`process_*`, `python_*`) and vLLM's HTTP metrics (`http_requests_total`
{handler, method, status}, `http_request_duration_seconds`, ...: `instrument_http`); and the periodic stats line of
the log (`StatsLogger`).

vLLM V1's names, types and histogram buckets: num_requests_running, num_requests_waiting (both in sequences: each of
a request's n samples counts as one, as in vLLM V1, which runs them as requests of their own), kv_cache_usage_perc,
num_preemptions_total, prefix_cache_queries_total and prefix_cache_hits_total (prompt tokens looked up in the prefix
cache, and those it supplied; each of a request's n samples looks its prompt up, as vLLM's child requests do) (read
from the engine's last snapshot); cache_config_info (a gauge at 1 whose labels describe the KV cache);
iteration_tokens_total (each engine step that sampled, by the whole prompts of the samples that got their first token
in it plus the tokens generated, as vLLM counts a step: its sum is prompt_tokens_total + generation_tokens_total,
but for what the engine runs that no response counts: the hidden token of an echo with max_tokens 0,
and the sequences of a beam search's steps (below), which vLLM runs as requests of their own and counts in both;
prefill chunks before a prompt's last, and loop steps, sample nothing and are not observed); prompt_tokens_total,
generation_tokens_total, request_success_total{finished_reason}, time_to_first_token_seconds,
inter_token_latency_seconds (and under its older name time_per_output_token_seconds, which vLLM 0.11 still exports:
the same observations),
request_time_per_output_token_seconds (a sample's decode time over its tokens after the first; 0 for one token),
e2e_request_latency_seconds, request_queue_time_seconds (arrival to the first step that admits the request),
request_prefill_time_seconds (admission to the first token), request_decode_time_seconds (first token to finish),
request_inference_time_seconds (admission to finish), request_prompt_tokens, request_generation_tokens,
request_params_max_tokens, and once per request when it ends request_params_n and request_max_num_generation_tokens
(the most tokens one of its samples generated) (recorded per output on the
engine thread). Units: each of a request's n samples counts as a request of its own, as vLLM V1 counts its child
requests: its prompt tokens (prompt_tokens_total, request_prompt_tokens), its finish
(request_success_total{finished_reason}), its tokens (request_generation_tokens), its max_tokens, its time to first
token and latencies (e2e, queue, prefill, decode and inference time: to the sample's finish). inter_token_latency is
observed once per output of a stream after a sample's first (the time since that sample's previous output, however
many tokens it holds: one engine step's, as vLLM observes once per step). A request that is not streamed has one
output, when it finishes (`FINAL_ONLY`): its time to first token is the engine's first-token time, and its
inter-token latency is observed as its mean gap, once per gap (the histogram's sum and count are exact, its
buckets approximate for such requests). A sample a client's disconnect (or `abort`) ended counts under
`finished_reason="abort"`, with its latencies to then. A beam search (`use_beam_search`) counts as one request per
prompt, recorded when it ends (`beam_search`): its prompt once, the tokens of the beams it returns (as its `usage`
counts them), its finish reason, its time to first token (its first step's) and its end-to-end latency; the
sequences of its steps are not requests of their own (`beam_steps`), and it observes no inter-token or phase times,
time per output token, request_params_* or request_max_num_generation_tokens.

Loop-specific (from `EngineStats`): exit_depth (histogram of decode-token exit depths),
core_batch_size (histogram of core-step batch widths), core_loops_total (core row-steps computed),
useful_core_loops_total (row-steps of tokens still looping: not CB's exited rows), prefill_token_loops_total,
refill_events_total, swap_ins_total, swap_in_shared_blocks_total, deferred_signal_steps_total (core
steps pipelined under lookahead), engine_steps_total{stage}; speculative decoding under vLLM's names:
spec_decode_num_drafts_total, spec_decode_num_draft_tokens_total,
spec_decode_num_accepted_tokens_total, spec_decode_num_accepted_tokens_per_pos_total{position}; and
request_rejected_total{reason} (503s at the admission
bound).
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Awaitable, Callable, Iterable
from typing import TYPE_CHECKING

from prometheus_client import (
    CollectorRegistry,
    Counter,
    GCCollector,
    Histogram,
    PlatformCollector,
    ProcessCollector,
    disable_created_metrics,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.exposition import choose_encoder
from prometheus_client.registry import Collector

from loopserve.device import dtype_name
from loopserve.engine.engine_thread import EngineSnapshot
from loopserve.outputs import RequestMetrics, RequestOutput, request_clock
from loopserve.serve.limits import METRIC_PREFIXES

if TYPE_CHECKING:
    from starlette.applications import Starlette

    from loopserve.engine.engine import LLMEngine
    from loopserve.engine.sequence import Sequence

log = logging.getLogger("loopserve.serve")
LABELS = ["model_name", "engine"]
ENGINE = "0"  # the `engine` label: this process runs one engine
# vLLM V1's buckets, so that a fleet of both aggregates by `le` (and an overloaded queue's minutes stay in range)
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                40.0, 80.0, 160.0, 640.0, 2560.0)
TOKEN_GAP_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                     40.0, 80.0)
REQUEST_LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
                           240.0, 480.0, 960.0, 1920.0, 7680.0)
ITERATION_TOKEN_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
N_BUCKETS = (1, 2, 5, 10, 20)


def one_two_five(limit: int) -> tuple[int, ...]:
    """1, 2, 5, 10, 20, 50, ... up to `limit` (vLLM's buckets of token counts)."""
    out: list[int] = []
    scale = 1
    while True:
        for mantissa in (1, 2, 5):
            if mantissa * scale > limit:
                return tuple(out)
            out.append(mantissa * scale)
        scale *= 10


def _exact_histogram(name: str, doc: str, counts: dict[int, int], bounds: Iterable[int],
                     label: list[str]) -> HistogramMetricFamily:
    """A histogram from exact value counts (value -> occurrences)."""
    h = HistogramMetricFamily(name, doc, labels=LABELS)
    buckets, total = [], 0
    for b in bounds:
        total_le = sum(c for v, c in counts.items() if v <= b)
        buckets.append((str(float(b)), float(total_le)))
    total = sum(counts.values())
    buckets.append(("+Inf", float(total)))
    h.add_metric(label, buckets, float(sum(v * c for v, c in counts.items())))
    return h


class _EngineCollector(Collector):
    def __init__(self, prefix: str, snapshot: Callable[[], EngineSnapshot], model_name: str, r_max: int,
                 max_batch: int, cache_info: dict[str, str]) -> None:
        self.prefix, self.snapshot, self.model_name = prefix, snapshot, model_name
        self.r_max, self.max_batch, self.cache_info = r_max, max_batch, cache_info

    def collect(self) -> Iterable[Metric]:
        P, s, m = self.prefix, self.snapshot(), [self.model_name, ENGINE]
        for name, doc, value in (
                ("num_requests_running", "Sequences admitted to the engine (KV resident), each of a request's n "
                                         "samples counted as one (as vLLM V1 counts them).", s.running),
                ("num_requests_waiting", "Sequences waiting for admission (queued or swapped out), each of a "
                                         "request's n samples counted as one (as vLLM V1 counts them).", s.waiting),
                ("kv_cache_usage_perc", "KV-cache usage: 1 means 100 percent of blocks in use.", s.kv_usage)):
            g = GaugeMetricFamily(P + name, doc, labels=LABELS)
            g.add_metric(m, float(value))
            yield g
        info = GaugeMetricFamily(P + "cache_config_info", "Information of the engine's KV cache.",
                                 labels=[*self.cache_info, "engine"])
        info.add_metric([*self.cache_info.values(), ENGINE], 1.0)
        yield info
        yield _exact_histogram(P + "iteration_tokens_total", "Tokens per engine step that sampled: the prompts of "
                               "the samples it gave their first token, and the tokens it generated.",
                               s.iteration_tokens, ITERATION_TOKEN_BUCKETS, m)
        yield _exact_histogram(P + "exit_depth", "Exit depth (loops) of decode tokens.", s.exit_depths,
                               range(1, self.r_max + 1), m)
        bounds = sorted({*one_two_five(self.max_batch), self.max_batch})
        yield _exact_histogram(P + "core_batch_size", "Rows per core-step batch.", s.core_batch, bounds, m)
        for name, doc, value in (
                ("core_loops", "Core row-steps computed (including passive CB rows).", s.core_rows),
                ("useful_core_loops", "Core row-steps of tokens still looping: all but the rows CB keeps in its "
                                      "batch after their tokens exited (a rejected draft's verify rows count: "
                                      "speculation's cost is in spec_decode_*).", s.useful_core_rows),
                ("prefill_token_loops", "Prompt tokens times loops run over them.", s.prefill_token_loops),
                ("refill_events", "Fresh tokens that joined a non-empty core batch.", s.refill_events),
                ("num_preemptions", "Sequences swapped out or prompts dropped for KV space.", s.preemptions),
                ("swap_ins", "Swapped-out sequences brought back.", s.swap_ins),
                ("deferred_signal_steps", "Core steps whose exit signals were read after the next step was "
                                          "queued (lookahead pipelining).", s.deferred_signal_steps),
                ("prefix_cache_queries", "Prompt tokens looked up in the prefix cache.", s.prefix_cache_queries),
                ("prefix_cache_hits", "Prompt tokens whose KV the prefix cache supplied.", s.prefix_cache_hits),
                ("swap_in_shared_blocks", "Prompt blocks swapped-in sequences found cached and shared again.",
                 s.swap_in_shared_blocks),
                ("spec_decode_num_drafts", "Speculative rounds verified (verify groups whose coda ran).",
                 s.spec_rounds),
                ("spec_decode_num_draft_tokens", "Tokens drafted by those rounds.", s.spec_draft_tokens),
                ("spec_decode_num_accepted_tokens", "Drafted tokens equal to the verifier's own token.",
                 s.spec_accepted_tokens)):
            c = CounterMetricFamily(P + name, doc, labels=LABELS)
            c.add_metric(m, float(value))
            yield c
        per_pos = CounterMetricFamily(P + "spec_decode_num_accepted_tokens_per_pos", "Accepted drafts by their place "
                                      "in the round (0: a round's first draft).", labels=[*LABELS, "position"])
        for position, accepted in enumerate(s.spec_accepted_per_pos):
            per_pos.add_metric([*m, str(position)], float(accepted))
        yield per_pos
        steps = CounterMetricFamily(P + "engine_steps", "Engine steps by stage.", labels=[*LABELS, "stage"])
        for stage in ("prefill", "draft", "prelude", "core", "coda"):
            steps.add_metric([*m, stage], float(s.ticks.get(stage, 0)))
        yield steps


class _Track:
    """What the metrics know of one request in flight."""

    __slots__ = ("sample_tokens", "sample_last", "scheduled", "prompt_only", "beam_step", "precounted", "n",
                 "max_tokens")

    def __init__(self) -> None:
        self.sample_tokens: dict[int, int] = {}  # per sample (its index): its tokens so far
        self.sample_last: dict[int, float] = {}  # and when its latest arrived
        self.scheduled: dict[int, float] = {}  # per sample: start of the first step that admitted it
        self.prompt_only = False  # echo with max_tokens 0: the token the engine runs is not part of the response
        self.beam_step = False  # a step of a beam search: not counted (`beam_search` records the search)
        # per sample of a request that is not streamed: its tokens the counters took before its output came
        # (`catch_up`; with them its prompt, counted as prefilled)
        self.precounted: dict[int, int] = {}
        self.n = 1  # its samples, and their max_tokens (`requested`)
        self.max_tokens: int | None = None


class ServerMetrics:
    def __init__(self, model_name: str, snapshot: Callable[[], EngineSnapshot], r_max: int, max_decode_batch: int,
                 max_model_len: int, prefix: str = next(iter(METRIC_PREFIXES)),
                 cache_info: dict[str, str] | None = None) -> None:
        """`prefix`: a `METRIC_PREFIXES` key; `cache_info`: the labels of cache_config_info (KV cache settings)."""
        if prefix not in METRIC_PREFIXES:
            raise ValueError(f"metric_prefix: one of {', '.join(METRIC_PREFIXES)}, got {prefix!r}")
        self.model_name = model_name
        self.snapshot = snapshot
        self.prefix = P = METRIC_PREFIXES[prefix]
        # no `*_created` series beside each counter and histogram (vLLM turns them off too; prometheus_client's
        # setting is the process's, and this process serves)
        disable_created_metrics()
        self.registry = CollectorRegistry(auto_describe=True)
        r, lab = self.registry, LABELS
        for collector in (ProcessCollector, PlatformCollector, GCCollector):
            collector(registry=r)
        self.prompt_tokens = Counter(P + "prompt_tokens", "Prompt tokens prefilled.", lab, registry=r)
        self.generation_tokens = Counter(P + "generation_tokens", "Tokens generated.", lab, registry=r)
        self.request_success = Counter(P + "request_success", "Finished requests by finish reason.",
                                       [*lab, "finished_reason"], registry=r)
        self.rejected = Counter(P + "request_rejected", "Requests refused at admission.", [*lab, "reason"],
                                registry=r)

        def histogram(name: str, doc: str, buckets: Iterable[float]) -> Histogram:
            return Histogram(P + name, doc, lab, registry=r, buckets=tuple(buckets))

        token_buckets = one_two_five(max_model_len)
        self.ttft = histogram("time_to_first_token_seconds", "Time to first token (from HTTP arrival).",
                              TTFT_BUCKETS)
        self.itl = histogram("inter_token_latency_seconds", "Time between consecutive outputs of a request.",
                             TOKEN_GAP_BUCKETS)
        # vLLM 0.11 still exports its older name of the same histogram (deprecated there; dashboards read either)
        self.itl_old_name = histogram("time_per_output_token_seconds", "Time between consecutive outputs of a request "
                                      "(deprecated: inter_token_latency_seconds, the same observations).",
                                      TOKEN_GAP_BUCKETS)
        self.tpot = histogram("request_time_per_output_token_seconds", "Decode time per token after the first, per "
                              "finished request.", TOKEN_GAP_BUCKETS)
        self.e2e = histogram("e2e_request_latency_seconds", "Arrival to finish.", REQUEST_LATENCY_BUCKETS)
        self.queue_time = histogram("request_queue_time_seconds", "Arrival to the first step that admits the "
                                    "request.", REQUEST_LATENCY_BUCKETS)
        self.prefill_time = histogram("request_prefill_time_seconds", "Admission to the first token.",
                                      REQUEST_LATENCY_BUCKETS)
        self.decode_time = histogram("request_decode_time_seconds", "First token to finish.",
                                     REQUEST_LATENCY_BUCKETS)
        self.inference_time = histogram("request_inference_time_seconds", "Admission to finish.",
                                        REQUEST_LATENCY_BUCKETS)
        self.req_prompt = histogram("request_prompt_tokens", "Prompt tokens per finished request.", token_buckets)
        self.req_gen = histogram("request_generation_tokens", "Generated tokens per finished request.", token_buckets)
        self.req_max_tokens = histogram("request_params_max_tokens", "The max_tokens of finished requests.",
                                        token_buckets)
        self.req_n = histogram("request_params_n", "The n of finished requests.", N_BUCKETS)
        self.req_most_gen = histogram("request_max_num_generation_tokens", "The most tokens one of a request's "
                                      "samples generated.", token_buckets)
        r.register(_EngineCollector(P, snapshot, model_name, r_max, max_decode_batch, cache_info or {}))
        self.labels = (model_name, ENGINE)
        # every series exists from the start (a labelled metric shows nothing until its first use)
        for metric in (self.prompt_tokens, self.generation_tokens, self.ttft, self.itl, self.itl_old_name, self.tpot,
                       self.e2e, self.queue_time, self.prefill_time, self.decode_time, self.inference_time,
                       self.req_prompt, self.req_gen, self.req_max_tokens, self.req_n, self.req_most_gen):
            metric.labels(*self.labels)
        for reason in ("stop", "length", "abort", "error"):
            self.request_success.labels(*self.labels, reason)
        for reason in ("overload", "shutdown"):
            self.rejected.labels(*self.labels, reason)
        # plain totals for the stats line (the counters' values are private to prometheus_client)
        self.prompt_total = 0
        self.generation_total = 0
        self._tracks: dict[str, _Track] = {}
        self._lock = threading.Lock()

    def requested(self, seqs: list[Sequence]) -> None:
        """Requests received (one `Sequence` per prompt, its samples with it): their n and max_tokens, observed as
        they end. Called before they are admitted (`forget`, if they are not)."""
        with self._lock:
            for seq in seqs:
                track = self._tracks.setdefault(seq.request_id, _Track())
                track.n, track.max_tokens = seq.params.n, seq.max_new  # (max_tokens, or the room a None leaves)

    def scheduled(self, request_id: str, samples: tuple[int, ...], when: float) -> None:
        """These samples of the request (their indices) were admitted by the step that started at `when` (engine
        thread): with n > 1, a part that did not fit beside the others waits on, and its queue time is its own."""
        with self._lock:
            track = self._tracks.setdefault(request_id, _Track())
            for index in samples:
                track.scheduled.setdefault(index, when)

    def prompt_only(self, request_ids: list[str]) -> None:
        """These requests return their prompt alone (echo with max_tokens 0): the one token the engine runs
        for each is not generated output (no tokens, TTFT or gaps counted, as `usage` says). Called before
        they are admitted."""
        with self._lock:
            for rid in request_ids:
                self._tracks.setdefault(rid, _Track()).prompt_only = True

    def beam_steps(self, request_ids: list[str]) -> None:
        """These sequences are a beam search's step: none of them is counted (`beam_search` records the search, once,
        when it ends). Called before they are admitted."""
        with self._lock:
            for rid in request_ids:
                self._tracks.setdefault(rid, _Track()).beam_step = True

    def beam_search(self, arrival: float, prompts: list[tuple[int, int, str, float | None]]) -> None:
        """A beam search that has ended, one request per prompt: (its prompt tokens, the tokens of the beams it
        returns, its finish reason (its best beam's; `abort` or `error` for a search that ended early), the time of
        its first token (its first step's; None if no step gave one: then its prompt is not counted as prefilled))."""
        now, m = request_clock(), self.labels
        with self._lock:
            for prompt, tokens, reason, first in prompts:
                if first is not None:
                    self._prefilled(prompt)
                    self.ttft.labels(*m).observe(max(0.0, first - arrival))
                self.generation_tokens.labels(*m).inc(tokens)
                self.generation_total += tokens
                self.request_success.labels(*m, reason).inc()
                self.req_prompt.labels(*m).observe(prompt)
                self.req_gen.labels(*m).observe(tokens)
                self.e2e.labels(*m).observe(max(0.0, now - arrival))

    def forget(self, request_ids: list[str]) -> None:
        """Requests that were not admitted after all."""
        with self._lock:
            for rid in request_ids:
                self._tracks.pop(rid, None)

    def observe(self, outs: list[RequestOutput]) -> None:
        """Record a step's outputs (called on the engine thread), each sample of a request as a request of its own
        (vLLM V1's child requests). The server's outputs are DELTA ones (a stream) or one FINAL_ONLY output: either
        way a completion holds tokens not counted before, and a sample is finished in the output whose completion
        first has its finish reason."""
        now = request_clock()
        m = self.labels
        with self._lock:
            for out in outs:
                track = self._tracks.setdefault(out.request_id, _Track())
                if track.beam_step:
                    if out.finished:
                        self._tracks.pop(out.request_id, None)
                    continue
                for c in out.outputs:
                    new = 0 if track.prompt_only else len(c.token_ids)
                    before = track.sample_tokens.get(c.index, 0)
                    times = c.metrics or out.metrics  # (the sample's own: an n > 1 request's merge is not it)
                    if new > 0:
                        if before == 0:
                            self._first_tokens(out, times, new, now, prefilled=c.index in track.precounted)
                        else:  # a stream's later output (one engine step's tokens): one gap since the sample's last
                            self._token_gap(now - track.sample_last[c.index])
                        counted = new - track.precounted.pop(c.index, 0)  # (`catch_up` took the rest)
                        self.generation_tokens.labels(*m).inc(counted)
                        self.generation_total += counted
                        track.sample_last[c.index] = now
                    track.sample_tokens[c.index] = before + new
                    if c.finish_reason is not None:
                        self._sample_finished(out, times, track, c.index, c.finish_reason, now)
                if out.finished:
                    self._tracks.pop(out.request_id, None)
                    self.req_n.labels(*m).observe(track.n)
                    self.req_most_gen.labels(*m).observe(max(track.sample_tokens.values(), default=0))

    def _first_tokens(self, out: RequestOutput, times: RequestMetrics | None, new: int, now: float,
                      prefilled: bool = False) -> None:
        """A sample's first output with tokens: its prompt counts as prefilled (unless `catch_up` counted it), its
        time to first token (the engine's first-token time), and for an output that is not streamed (all its tokens
        at once), its gaps as their mean."""
        m = self.labels
        if not prefilled:
            self._prefilled(len(out.prompt_token_ids))
        if times is None:
            return
        first = times.first_token_time if times.first_token_time is not None else now
        self.ttft.labels(*m).observe(max(0.0, first - times.arrival_time))
        if new > 1 and times.first_token_time is not None:  # a final-only output
            gap = ((times.last_token_time or now) - times.first_token_time) / (new - 1)
            for _ in range(new - 1):
                self._token_gap(gap)

    def _token_gap(self, seconds: float) -> None:
        """One inter-token latency, under both of vLLM's names."""
        for hist in (self.itl, self.itl_old_name):
            hist.labels(*self.labels).observe(seconds)

    def _sample_finished(self, out: RequestOutput, times: RequestMetrics | None, track: _Track, index: int,
                         reason: str, now: float) -> None:
        m, tokens, scheduled = self.labels, track.sample_tokens[index], track.scheduled.get(index)
        self.request_success.labels(*m, reason).inc()
        self.req_gen.labels(*m).observe(tokens)
        self.req_prompt.labels(*m).observe(len(out.prompt_token_ids))
        if track.prompt_only:
            self._prefilled(len(out.prompt_token_ids))
        elif track.max_tokens is not None:
            self.req_max_tokens.labels(*m).observe(track.max_tokens)
        if times is None:
            return
        end = times.finished_time if times.finished_time is not None else now
        self.e2e.labels(*m).observe(max(0.0, end - times.arrival_time))
        if scheduled is None or times.first_token_time is None or track.prompt_only or tokens == 0:
            return  # never admitted, or no token of its own: no phases to time
        for hist, start, stop in ((self.queue_time, times.arrival_time, scheduled),
                                  (self.prefill_time, scheduled, times.first_token_time),
                                  (self.decode_time, times.first_token_time, end),
                                  (self.inference_time, scheduled, end)):
            hist.labels(*m).observe(max(0.0, stop - start))
        decode = max(0.0, end - times.first_token_time)
        self.tpot.labels(*m).observe(decode / (tokens - 1) if tokens > 1 else 0.0)

    def _prefilled(self, tokens: int) -> None:
        """A prompt counted as prefilled (the counter, and the plain total the stats line reads)."""
        self.prompt_tokens.labels(*self.labels).inc(tokens)
        self.prompt_total += tokens

    def catch_up(self, progress: dict[str, tuple[int, dict[int, int]]]) -> None:
        """Count the tokens of requests in flight that are not streamed (`quiet_progress`: request id -> (prompt
        tokens, tokens per sample so far)), whose one output comes when they finish: the counters then grow while
        they run, as the engine generates, instead of at once at their end (vLLM counts per step). Each sample's
        final output then adds only what this did not count; a sample's prompt counts with its first tokens here."""
        m = self.labels
        with self._lock:
            for rid, (prompt, samples) in progress.items():
                track = self._tracks.get(rid)
                if track is None or track.beam_step or track.prompt_only:
                    continue
                for index, tokens in samples.items():
                    before = track.precounted.get(index, 0)
                    if tokens <= before or track.sample_tokens.get(index, 0):
                        continue
                    if before == 0:
                        self._prefilled(prompt)
                    self.generation_tokens.labels(*m).inc(tokens - before)
                    self.generation_total += tokens - before
                    track.precounted[index] = tokens

    def reject(self, reason: str) -> None:
        self.rejected.labels(*self.labels, reason).inc()

    def render(self) -> bytes:
        """The metrics as Prometheus text."""
        return self.render_for(None)[0]

    def render_for(self, accept: str | None) -> tuple[bytes, str]:
        """The metrics in the format an Accept header asks for, and its content type: OpenMetrics where the answer
        keeps names as they are (`escaping=allow-utf-8`, Prometheus 3's), else Prometheus text. (prometheus_client
        escapes the names of an OpenMetrics answer otherwise, to `vllm_generation_tokens_total`: Prometheus 2's
        default header would then get names no dashboard queries; and where a header asks for the escaping without
        a version, its answer escapes the samples' names but not their HELP and TYPE lines, which a parser then
        reads as other families, untyped.)"""
        accept = accept or ""
        try:
            encoder, content_type = choose_encoder(accept if "escaping=allow-utf-8" in accept else "")
        except (TypeError, ValueError):  # (a version it cannot compare, `version=abc`: prometheus_client raises)
            encoder, content_type = choose_encoder("")
        if content_type.startswith("application/openmetrics-text") and "escaping=allow-utf-8" not in content_type:
            encoder, content_type = choose_encoder("")
        return encoder(self.registry), content_type


def instrument_http(app: Starlette, registry: CollectorRegistry) -> None:
    """vLLM's HTTP metrics on `registry`, by the library vLLM uses (prometheus_fastapi_instrumentator):
    http_requests_total{handler, method, status} (status grouped, 2xx, 4xx, ...), http_request_size_bytes,
    http_response_size_bytes, http_request_duration_seconds and http_request_duration_highr_seconds; probes and
    scrapes left out, as vLLM leaves them. Its middleware is the app's outermost from here on (add it last), so that it
    sees every answer, the 401s, 413s and CORS ones too."""
    from prometheus_fastapi_instrumentator import Instrumentator

    Instrumentator(excluded_handlers=["/metrics", "/health", "/ping", "/load", "/version"],
                   registry=registry).instrument(app)


def accepts_gzip(accept_encoding: str) -> bool:
    """Whether an Accept-Encoding header takes gzip: a `gzip` coding (any case) without `q=0`."""
    for coding in accept_encoding.split(","):
        name, _, params = coding.strip().partition(";")
        if name.strip().lower() == "gzip":
            q = params.strip().lower().removeprefix("q=")
            try:
                return not params.strip() or float(q) > 0
            except ValueError:
                return False
    return False


def cache_info(engine: LLMEngine) -> dict[str, str]:
    """cache_config_info's labels: vLLM's names where the setting is the same (num_gpu_blocks: the KV pool's blocks,
    on whatever device), and the layout."""
    return {"block_size": str(engine.kv.block_size), "num_gpu_blocks": str(engine.kv.num_blocks),
            "cache_dtype": dtype_name(next(engine.model.parameters()).dtype),
            "enable_prefix_caching": str(engine.cfg.enable_prefix_caching), "kv_layout": engine.cfg.kv_layout}


def quiet_progress(engine: LLMEngine) -> dict[str, tuple[int, dict[int, int]]]:
    """On the engine thread (`EngineThread.between_steps`): each request in flight that is not streamed, by id, as
    `ServerMetrics.catch_up` takes it: (its prompt's tokens, its tokens so far per sample)."""
    out: dict[str, tuple[int, dict[int, int]]] = {}
    for seq in engine.requests.values():
        head = seq.family[0]
        if not head.streams and not seq.finished:
            out.setdefault(head.request_id, (len(head.prompt_ids), {}))[1][seq.index] = len(seq.output_ids)
    return out


class StatsLogger:
    """Logs a line every `interval_s` while the server is busy (an interval with tokens, or requests running or
    waiting at its end) and once after (zeros), like vLLM's: prompt and generation throughput over the interval,
    running and waiting requests (samples counted, as in the gauges), KV-cache usage, the prefix cache's hit rate (the
    interval's prompt tokens looked up; vLLM's is over its recent requests); and for the loops, the mean exit depth
    of the interval's decode tokens. With speculative decoding, vLLM's second line, of the interval's drafts."""

    def __init__(self, metrics: ServerMetrics, interval_s: float,
                 refresh: Callable[[], Awaitable[None]] | None = None) -> None:
        """`refresh`: brings the counters up to the engine before each line (`OpenAIServing.metrics_caught_up`)."""
        self.metrics, self.interval_s, self.refresh = metrics, interval_s, refresh
        self._last = self._sample()
        self._active = False  # the last interval had tokens

    def _sample(self) -> tuple[float, int, int, EngineSnapshot]:
        """Now, the prompt and generation counters, the engine's snapshot."""
        return time.monotonic(), self.metrics.prompt_total, self.metrics.generation_total, self.metrics.snapshot()

    def lines(self) -> list[str]:
        """The stats since the last call: none when nothing happened then and nothing runs now."""
        (then, prompt_before, gen_before, prev), (now, prompt_total, gen_total, s) = self._last, self._sample()
        self._last = now, prompt_total, gen_total, s
        prompt, generated = prompt_total - prompt_before, gen_total - gen_before
        active, was_active = bool(prompt or generated), self._active
        self._active = active
        if not (active or was_active or s.running or s.waiting):  # (as vLLM: one line of zeros after the last busy one)
            return []
        out = [s.stats_line(prev, now - then, prompt, generated)]
        dt = max(now - then, 1e-9)
        rounds = s.spec_rounds - prev.spec_rounds
        accepted = s.spec_accepted_tokens - prev.spec_accepted_tokens
        drafted = s.spec_draft_tokens - prev.spec_draft_tokens
        if rounds:
            cur_pos, prev_pos = s.spec_accepted_per_pos, prev.spec_accepted_per_pos
            before = prev_pos + (0,) * (len(cur_pos) - len(prev_pos))
            per_pos = ", ".join(f"{(n - b) / rounds:.3f}" for n, b in zip(cur_pos, before, strict=True))
            out.append(f"SpecDecoding metrics: Mean acceptance length: {1 + accepted / rounds:.2f}, Accepted "
                       f"throughput: {accepted / dt:.2f} tokens/s, Drafted throughput: {drafted / dt:.2f} tokens/s, "
                       f"Accepted: {accepted} tokens, Drafted: {drafted} tokens, Per-position acceptance rate: "
                       f"{per_pos}, Avg Draft acceptance rate: {100 * accepted / max(drafted, 1):.1f}%")
        return out

    async def run(self) -> None:
        while True:
            await asyncio.sleep(self.interval_s)
            if self.refresh is not None:
                await self.refresh()
            for text in self.lines():
                log.info("%s", text)
