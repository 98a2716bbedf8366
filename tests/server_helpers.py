"""Helpers for the server tests: a real `loopserve serve` process on a free loopback port, clients of it, and
readers of its /metrics and SSE streams."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

MODEL = "tiny"  # the served model name
REPO = Path(__file__).resolve().parents[1]


@dataclass
class Server:
    proc: subprocess.Popen
    url: str
    log: Path

    def client(self, api_key: str = "none", timeout: float = 60) -> openai.OpenAI:
        """The official client on this server, without retries (a test sees the first answer)."""
        return openai.OpenAI(base_url=self.url + "/v1", api_key=api_key, max_retries=0, timeout=timeout)

    def post(self, path: str, body: dict, request_id: str | None = None, timeout: float = 30) -> httpx.Response:
        """A JSON POST to `path`, with `X-Request-Id` when given."""
        headers = {"X-Request-Id": request_id} if request_id else {}
        return httpx.post(self.url + path, json=body, headers=headers, timeout=timeout)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def server_env(**extra: str) -> dict[str, str]:
    """The environment a server process runs in: one intra-op thread (the tiny model's ops are too small to split,
    and on a loaded machine torch's pool spins instead of working), the code of this checkout first on the path
    (also for a launcher script, whose own folder comes first), and `extra`."""
    return {**os.environ, "OMP_NUM_THREADS": "1",
            "PYTHONPATH": os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p), **extra}


def wait_ready(proc: subprocess.Popen, url: str, timeout: float = 90.0, client: httpx.Client | None = None) -> bool:
    """Whether the server at `url` answered /health (through `client`, if given: TLS, a Unix socket) before `proc`
    exited or `timeout` seconds passed."""
    get = httpx.get if client is None else client.get
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            return False
        try:
            if get(url + "/health", timeout=1.0).status_code == 200:
                return True
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    return False


def stop(proc: subprocess.Popen, timeout: float = 15) -> None:
    """SIGTERM, then SIGKILL if it has not exited within `timeout` seconds."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)


@contextmanager
def run_server(model: Path, log: Path, *extra: str, log_level: str = "warning", access_log: bool = False,
               launcher: Path | None = None, chat_template: str | None = None) -> Iterator[Server]:
    """A server on a free port, stopped (SIGTERM) on exit. `launcher`: a script run instead of
    `python -m loopserve.cli` that takes the same arguments (tests patch the engine in one). `chat_template`: a
    template's text, written to a file beside the log and served with `--chat-template`."""
    entry = [str(launcher)] if launcher is not None else ["-m", "loopserve.cli"]
    if chat_template is not None:
        template = log.parent / "template.jinja"
        template.write_text(chat_template)
        extra = (*extra, "--chat-template", str(template))
    for _ in range(3):
        port = free_port()
        cmd = [sys.executable, *entry, "serve", "--model", str(model), "--host", "127.0.0.1", "--port", str(port),
               "--served-model-name", MODEL, "--log-level", log_level, *([] if access_log else ["--no-access-log"]),
               "--device", "cpu",  # not `auto`: outputs are compared with the offline LLM on the CPU
               *extra]
        with open(log, "w") as f:
            proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=server_env())
        url = f"http://127.0.0.1:{port}"
        if wait_ready(proc, url):
            break
        stop(proc)
        text = log.read_text()
        if "address already in use" not in text.lower():
            pytest.fail(f"server did not start:\n{text}")
    else:
        pytest.fail("no free port for the server")
    try:
        yield Server(proc, url, log)
    finally:
        stop(proc)


def metric(server: Server, name: str, missing: float | None = None, **labels: str) -> float:
    text = httpx.get(server.url + "/metrics", timeout=10).text
    total, found = 0.0, False
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()):
                total += s.value
                found = True
    if not found and missing is not None:
        return missing
    assert found, f"{name} {labels} not in /metrics"
    return total


def wait_idle(server: Server, timeout: float = 15.0) -> None:
    """Until no request is running or waiting and the KV cache is empty."""
    deadline = time.monotonic() + timeout
    while True:
        kv = metric(server, "loopserve:kv_cache_usage_perc")
        busy = metric(server, "loopserve:num_requests_running") + metric(server, "loopserve:num_requests_waiting")
        if kv == 0 and busy == 0:
            return
        assert time.monotonic() < deadline, f"server not idle: kv usage {kv}, {busy} requests"
        time.sleep(0.05)


def sse_events(lines: Iterator[str]) -> Iterator[str]:
    for line in lines:
        if line.startswith("data: "):
            yield line[len("data: "):]
