"""`loopserve bench serve`: open-loop Poisson arrivals at a sweep of rates, in-process or against an
OpenAI-compatible HTTP server.

* **In-process**: the engine runs in this process; a request is added at the first step boundary
  after its release instant (a step cannot be interrupted), and its arrival time is the release
  instant, so queueing behind a running step counts as latency. Tokens are timed when `step()`
  returns them. The clock is the wall clock, or with `clock="cpu"` the CPU time of the run's own steps plus
  the idle gaps skipped to the next arrival: time the process waits for the machine no longer counts. Its
  work still runs slower while others share the cores and caches, so configurations compare only run side
  by side (`serve_lockstep`): on this VM wall-clock serving runs of one configuration differed by 25 %, and
  CPU-clock runs minutes apart by as much.
* **HTTP**: `/v1/completions` with `stream: true` (SSE, `data: [DONE]`), prompts as token-id lists,
  `ignore_eos` and `max_tokens` from the workload, `stream_options.include_usage` for the token
  count and the vLLM extension `return_token_ids` for per-chunk counts. Works against any server
  speaking that API; `launch_server` starts `loopserve serve` for a scheduler and stops it after.
  Exits over HTTP follow the model's live exit rule (`exit_threshold`/`exit_policy` fields), which
  depends only on the request's own tokens, so every scheduler makes the same exit decisions;
  `exit_trace` is sent only with `--http-exit-trace` (a server must accept it). The mean exit depth is measured
  from the responses' `exit_depths` (loopserve's extension: None from a server without it); serve.json's `depths`
  says, per mode, what decided them (`bench.cli.serve_depths`).

Metric definitions: `loopserve_lab.bench.metrics`.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from loopserve.config_args import as_flags
from loopserve.engine.config import EngineConfig
from loopserve.outputs import request_clock
from loopserve_lab.bench.harness import BenchModel, engine_kwargs_for, step_in_turn
from loopserve_lab.bench.metrics import RequestRecord, poisson_arrivals, serving_metrics
from loopserve_lab.bench.workloads import Workload

# --------------------------------------------------------------------------------------------------
# In-process
# --------------------------------------------------------------------------------------------------


class RunClock:
    """Seconds since a run started: wall (`perf_counter`), or "cpu": the process CPU time spent inside the run's own
    steps (`running`), plus the idle gaps skipped to the next arrival instead of slept (runs stepped in turn in one
    process each count their own work only: `serve_lockstep`)."""

    def __init__(self, kind: str = "wall") -> None:
        if kind not in CLOCKS:
            raise ValueError(f"clock: expected one of {', '.join(CLOCKS)}, got {kind!r}")
        self.kind = kind
        self._t0 = time.perf_counter()
        self._spent = 0.0  # cpu: CPU seconds of the run's steps, and skipped gaps
        self._since: float | None = None  # cpu: the process CPU time the current step started at

    def now(self) -> float:
        if self.kind == "wall":
            return time.perf_counter() - self._t0
        return self._spent + (time.process_time() - self._since if self._since is not None else 0.0)

    @contextlib.contextmanager
    def running(self) -> Iterator[None]:
        """Around one of the run's steps: on the CPU clock, the time it spends is the run's."""
        if self.kind == "cpu":
            self._since = time.process_time()
        try:
            yield
        finally:
            if self._since is not None:
                self._spent += time.process_time() - self._since
                self._since = None

    def wait_until(self, t: float) -> None:
        gap = max(0.0, t - self.now())
        if self.kind == "wall":
            time.sleep(gap)
        else:
            self._spent += gap


CLOCKS = ("wall", "cpu")


class ServeRun:
    """One open-loop in-process run, stepped from outside: the workload's requests released at Poisson instants of
    `rate` req/s, timed by `clock` (`RunClock`). `run_inprocess` steps one to its end; `serve_lockstep` several in
    turn."""

    def __init__(self, bm: BenchModel, workload: Workload, traces: list[list[int]] | None, scheduler: str,
                 rate: float, width: int, seed: int = 0, progress: bool = True, burstiness: float = 1.0,
                 clock: str = "wall", **engine_overrides: Any) -> None:
        from tqdm import tqdm

        self.workload, self.traces, self.scheduler, self.rate, self.width = workload, traces, scheduler, rate, width
        self.arrivals = poisson_arrivals(rate, len(workload), seed, burstiness)
        self.cfg = engine_kwargs_for(workload, width, scheduler=scheduler, **engine_overrides)
        self.engine = bm.engine(seed=seed, **self.cfg)
        if clock == "cpu" and self.engine.runner.device.type != "cpu":
            raise ValueError("clock: 'cpu' times runs on the CPU only (a GPU step returns before its work is done)")
        self.records = [RequestRecord(arrival=a, prompt_tokens=len(r.prompt_ids))
                        for a, r in zip(self.arrivals, workload.requests, strict=True)]
        self._seen = [0] * len(workload)
        self._bar = tqdm(total=len(workload), desc=f"{scheduler} @ {rate:g} req/s", disable=not progress,
                         leave=False)
        self.next = 0  # the next request to release
        self.clock = RunClock(clock)
        self._m0 = request_clock()

    @property
    def done(self) -> bool:
        return self.next >= len(self.workload) and not self.engine.has_unfinished_requests()

    @torch.inference_mode()
    def step(self) -> None:
        """Release the requests whose instant has come, then one engine step (or, idle, wait for the next)."""
        from loopserve.sampling_params import SamplingParams

        engine, traces = self.engine, self.traces
        with self.clock.running():
            now = self.clock.now()
            while self.next < len(self.workload) and self.arrivals[self.next] <= now:
                i = self.next
                req = self.workload.requests[i]
                params = SamplingParams(max_tokens=req.output_len, ignore_eos=True, temperature=0.0,
                                        exit_trace=list(traces[i]) if traces is not None else None,
                                        exit_policy=None if traces is not None else "fixed")
                engine.add_request(str(i), {"prompt_token_ids": req.prompt_ids}, params,
                                   arrival_time=self._m0 + self.arrivals[i])
                self.next += 1
            outs = engine.step() if engine.has_unfinished_requests() else None
            t = self.clock.now()
        if outs is None:  # idle until the next release
            self.clock.wait_until(self.arrivals[self.next])
            return
        for out in outs:
            i = int(out.request_id)
            rec = self.records[i]
            n = len(out.outputs[0].token_ids)
            rec.token_times += [t] * (n - self._seen[i])
            self._seen[i] = n
            if out.finished:
                rec.finish = t
                if out.error:
                    rec.error = out.error
                self._bar.update(1)

    def result(self) -> dict[str, Any]:
        self._bar.close()
        m = serving_metrics(self.records)
        st = self.engine.stats
        items = sum(st.exit_depths.values())
        m.update({"scheduler": self.scheduler, "rate": self.rate, "width": self.width, "mode": "in-process",
                  "clock": self.clock.kind,
                  "mean_exit_depth": sum(d * c for d, c in st.exit_depths.items()) / items if items else None,
                  "model_time_s": st.model_time, "schedule_time_s": st.schedule_time, "config": self.cfg})
        return {"metrics": m, "records": [r.to_json() for r in self.records]}


def run_inprocess(bm: BenchModel, workload: Workload, traces: list[list[int]] | None, scheduler: str,
                  rate: float, width: int, **kwargs: Any) -> dict[str, Any]:
    """One open-loop run (`ServeRun`, same arguments) to its end."""
    run = ServeRun(bm, workload, traces, scheduler, rate, width, **kwargs)
    while not run.done:
        run.step()
    return run.result()


def serve_lockstep(runs: list[ServeRun]) -> list[dict[str, Any]]:
    """Several open-loop runs at once on the CPU clock: each step goes to the run whose clock is furthest behind,
    so the runs move through their (virtual) time together and meet the same machine, as `harness.run_lockstep`
    does for offline runs; each run's clock counts its own steps only. On the CPU only (a GPU step returns before
    its work is done: its time is not its own)."""
    if any(r.clock.kind != "cpu" for r in runs):  # (which `ServeRun` allows on the CPU only)
        raise ValueError("lockstep: runs on the CPU clock")
    step_in_turn(runs, lambda r: r.clock.now())
    return [r.result() for r in runs]


# --------------------------------------------------------------------------------------------------
# HTTP (OpenAI /v1/completions, SSE streaming)
# --------------------------------------------------------------------------------------------------


def _chunk_tokens(chunk: dict[str, Any]) -> int:
    """Tokens carried by one streamed chunk: `token_ids` when the server returns them, else one per
    chunk with text (vLLM's convention); 0 for a usage-only or an empty final chunk."""
    n = 0
    for ch in chunk.get("choices") or []:
        ids = ch.get("token_ids")
        if isinstance(ids, list):
            n += len(ids)
        elif ch.get("text"):
            n += 1
    return n


async def stream_completion(client: Any, url: str, body: dict[str, Any], rec: RequestRecord, t0: float,
                            headers: dict[str, str] | None = None) -> RequestRecord:
    """POST one streaming completion and fill `rec` (times relative to `t0`, perf_counter clock)."""
    try:
        async with client.stream("POST", url, json=body, headers=headers) as resp:
            if resp.status_code != 200:
                text = (await resp.aread()).decode(errors="replace")
                rec.error = f"HTTP {resp.status_code}: {text[:300]}"
                return rec
            usage_tokens = None
            async for line in resp.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                now = time.perf_counter() - t0
                chunk = json.loads(data)
                if chunk.get("error"):
                    rec.error = str(chunk["error"])
                    break
                k = _chunk_tokens(chunk)
                rec.token_times += [now] * k
                for ch in chunk.get("choices") or []:
                    rec.exit_depths += ch.get("exit_depths") or []  # (loopserve's extension; other servers: none)
                if chunk.get("usage"):
                    usage_tokens = chunk["usage"].get("completion_tokens")
            rec.finish = time.perf_counter() - t0
            if usage_tokens is not None:
                rec.output_tokens = int(usage_tokens)
    except Exception as e:  # noqa: BLE001 - a failed request is a result, not a crash
        rec.error = f"{type(e).__name__}: {e}"
    return rec


async def run_http_async(base_url: str, model_name: str, workload: Workload, rate: float, seed: int = 0,
                         traces: list[list[int]] | None = None, extra: dict[str, Any] | None = None,
                         api_key: str | None = None, burstiness: float = 1.0, timeout: float = 3600.0,
                         transport: Any = None, progress: bool = True) -> dict[str, Any]:
    import httpx
    from tqdm import tqdm

    arrivals = poisson_arrivals(rate, len(workload), seed, burstiness)
    url = base_url.rstrip("/") + "/v1/completions"
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else None
    records = [RequestRecord(arrival=a, prompt_tokens=len(r.prompt_ids))
               for a, r in zip(arrivals, workload.requests, strict=True)]
    bar = tqdm(total=len(workload), desc=f"http @ {rate:g} req/s", disable=not progress, leave=False)
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(timeout=timeout, limits=limits, transport=transport) as client:
        t0 = time.perf_counter()

        async def one(i: int) -> None:
            await asyncio.sleep(max(0.0, arrivals[i] - (time.perf_counter() - t0)))
            req = workload.requests[i]
            body: dict[str, Any] = {"model": model_name, "prompt": req.prompt_ids, "max_tokens": req.output_len,
                                    "temperature": 0.0, "stream": True, "ignore_eos": True,
                                    "stream_options": {"include_usage": True}, "return_token_ids": True}
            if traces is not None:
                body["exit_trace"] = list(traces[i])
            body.update(extra or {})
            await stream_completion(client, url, body, records[i], t0, headers)
            bar.update(1)

        await asyncio.gather(*(one(i) for i in range(len(workload))))
    bar.close()
    m = serving_metrics(records)
    # as in-process: over decode items, each request's first token being its prefill's (at full depth)
    decode = [d for r in records for d in r.exit_depths[1:]]
    m.update({"rate": rate, "mode": "http", "url": base_url,
              "mean_exit_depth": sum(decode) / len(decode) if decode else None})
    return {"metrics": m, "records": [r.to_json() for r in records]}


def run_http(*args: Any, **kwargs: Any) -> dict[str, Any]:
    return asyncio.run(run_http_async(*args, **kwargs))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_healthy(base_url: str, timeout: float = 180.0, proc: subprocess.Popen | None = None) -> None:
    import httpx

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"server exited with code {proc.returncode} before it was healthy")
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(base_url.rstrip("/") + "/health", timeout=2.0).status_code == 200:
                return
        time.sleep(0.5)
    raise TimeoutError(f"{base_url} not healthy after {timeout:.0f}s")


def server_command(model_path: Path, scheduler: str, engine_cfg: dict[str, Any], dtype: str, device: str,
                   port: int, seed: int = 0) -> list[str]:
    """`loopserve serve` on 127.0.0.1:`port` for one scheduler, with every knob of `engine_cfg` (the
    `EngineConfig` fields the benchmark runs in-process too) as its flag."""
    knobs = {f.name for f in dataclasses.fields(EngineConfig)} - {"scheduler"}
    return [sys.executable, "-m", "loopserve.cli", "serve", "--model", str(model_path), "--host", "127.0.0.1",
            "--port", str(port), "--dtype", dtype, "--device", device, "--scheduler", scheduler,
            "--seed", str(seed), "--no-access-log", "--log-level", "warning", "--max-queued-requests", "100000",
            *as_flags({k: v for k, v in engine_cfg.items() if k in knobs})]


@contextlib.contextmanager
def launch_server(model_path: Path, scheduler: str, engine_cfg: dict[str, Any], dtype: str, device: str,
                  threads: int | None = None, port: int | None = None, log: Path | None = None,
                  seed: int = 0):
    """Start `loopserve serve` (`server_command`) for one scheduler; yields (base_url, served model name)."""
    port = port or free_port()
    cmd = server_command(model_path, scheduler, engine_cfg, dtype, device, port, seed)
    env = dict(os.environ)
    if threads:
        env.update({"OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads)})
    out = open(log, "ab") if log else subprocess.DEVNULL  # noqa: SIM115
    proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env)
    base = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(base, proc=proc)
        yield base, str(model_path)
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        if log:
            out.close()  # type: ignore[union-attr]


def format_serve(rows: list[dict[str, Any]]) -> str:
    from loopserve_lab.bench.harness import LABELS

    head = (f"{'rate':>7} {'scheduler':<14}{'norm lat ms':>12}{'TTFT p50':>10}{'TTFT p99':>10}{'TPOT p50':>10}"
            f"{'ITL p99':>9}{'e2e p50':>9}{'e2e p99':>9}{'req/s':>7}{'tok/s':>8}{'fail':>5}")
    lines = [head, "-" * len(head)]

    def ms(d: dict | None, k: str) -> str:
        v = (d or {}).get(k)
        return f"{v * 1e3:.1f}" if v is not None else "-"

    def s(d: dict | None, k: str) -> str:
        v = (d or {}).get(k)
        return f"{v:.2f}" if v is not None else "-"

    for r in rows:
        nl = r.get("normalized_latency")
        lines.append(
            f"{r['rate']:>7.3g} {LABELS.get(r.get('scheduler', ''), r.get('scheduler', '')):<14}"
            f"{(f'{nl * 1e3:.2f}' if nl is not None else '-'):>12}{ms(r['ttft'], 'p50'):>10}{ms(r['ttft'], 'p99'):>10}"
            f"{ms(r['tpot'], 'p50'):>10}{ms(r['itl'], 'p99'):>9}{s(r['e2e'], 'p50'):>9}{s(r['e2e'], 'p99'):>9}"
            f"{(r['request_throughput'] or 0):>7.2f}{(r['output_token_throughput'] or 0):>8.1f}{r['failed']:>5}")
    return "\n".join(lines)


__all__ = ["format_serve", "launch_server", "run_http", "run_http_async", "run_inprocess",
           "stream_completion", "wait_healthy"]
