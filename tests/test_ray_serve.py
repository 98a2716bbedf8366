"""Scale-out on Ray Serve (`loopserve/serve/ray.py`): `loopserve serve --replicas 2` on a local Ray
instance, against a tiny model on this machine's CPUs.

One server (two replicas, `--max-num-seqs 2` so that requests beyond four wait in Ray Serve's proxy)
is shared by the module: Ray takes ~15 s to start. Its tests check the same API as the single-process
server, identical outputs whichever replica answers, merged metrics with a `replica` label, that a
client's disconnect frees its KV on its replica, and that a replica that dies fails only what it was
running, while the rest is served by the other replica and Ray Serve restarts it. Teardown stops the
server and checks that every process it started (Ray's included) is gone.

The flag mapping, the config-file builder and the metrics merge are tested without a Ray instance;
the single-process path is checked never to import Ray.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.server_helpers import MODEL, REPO, free_port, server_env, sse_events, stop

ray = pytest.importorskip("ray", reason="Ray Serve is the [ray] extra (pip install -e '.[ray]'; setup.sh installs it)")
pytest.importorskip("ray.serve", reason="Ray Serve is the [ray] extra (pip install -e '.[ray]')")

from loopserve.engine.config import EngineConfig  # noqa: E402
from loopserve.serve import ray as lray  # noqa: E402
from loopserve.serve.limits import MAX_QUEUED_REQUESTS  # noqa: E402
from loopserve.vllm_neutral import neutral_kwargs  # noqa: E402
from loopserve_lab.tiny import TinySpec, make_tiny  # noqa: E402

REPLICA = "x-loopserve-replica"
START_TIMEOUT_S = 150.0  # Ray, the proxy and two replicas on a loaded 2-core machine
LONG = {"max_tokens": 600, "ignore_eos": True, "temperature": 0}  # a request that runs for seconds
GRACE_S = 8.0  # the server's --shutdown-timeout
ORIGIN = "https://a.example"  # the server's --allowed-origins


# -- without a Ray instance -------------------------------------------------------------------------------------
def test_single_process_path_never_imports_ray():
    code = ("import sys, loopserve.cli, loopserve.serve.cli, loopserve.serve.api\n"
            "from loopserve.serve.cli import register\n"
            "import argparse; p = argparse.ArgumentParser(); register(p.add_subparsers())\n"
            "assert not [m for m in sys.modules if m == 'ray' or m.startswith('ray.')], 'ray imported'\n")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=REPO, timeout=60)


def _flags(*argv: str) -> argparse.Namespace:
    return lray._serve_parser().parse_args(list(argv))


def test_the_long_max_model_len_variable_reaches_every_replica(monkeypatch):
    """Each replica's engine reads $VLLM_ALLOW_LONG_MAX_MODEL_LEN: on another node of a cluster it is the driver's only
    if the deployment carries it."""
    monkeypatch.setenv("VLLM_ALLOW_LONG_MAX_MODEL_LEN", "1")
    opts = lray.deployment_options(_flags("--replicas", "2"), gpus=False)
    assert opts["ray_actor_options"]["runtime_env"] == {"env_vars": {"VLLM_ALLOW_LONG_MAX_MODEL_LEN": "1"}}


def test_flags_map_onto_deployment_options():
    fixed = lray.deployment_options(_flags("--replicas", "3", "--max-num-seqs", "8", "--max-queued-requests",
                                           "40", "--shutdown-timeout", "12"), gpus=False)
    assert fixed["num_replicas"] == 3 and "autoscaling_config" not in fixed
    assert fixed["ray_actor_options"] == {"num_cpus": 1.0}  # no GPU: --replica-cpus
    # what the app admits (8 running + 40 queued) plus the probe slots
    assert fixed["max_ongoing_requests"] == 8 + 40 + lray.PROBE_SLOTS
    # the proxy's queue holds what all the replicas admit: a bound of one replica's queue dropped requests below the
    # deployment's capacity (each request waits there a moment), with Ray's plain 503 instead of the app's
    assert fixed["max_queued_requests"] == 3 * (8 + 40)
    assert fixed["graceful_shutdown_timeout_s"] == 12
    # a stuck replica is found in seconds: Ray's default timeout, 30 s three times in a row, kept it for 90 s
    assert (fixed["health_check_period_s"], fixed["health_check_timeout_s"]) == (2.0, 5.0)
    auto = lray.deployment_options(_flags("--min-replicas", "1", "--max-replicas", "4", "--replicas", "2",
                                          "--max-num-seqs", "8", "--replica-cpus", "0.5"), gpus=True)
    assert auto["num_replicas"] == "auto"
    assert auto["autoscaling_config"] == {"min_replicas": 1, "max_replicas": 4, "initial_replicas": 2,
                                          "target_ongoing_requests": 8}
    assert auto["ray_actor_options"] == {"num_cpus": 0.5, "num_gpus": 1}  # one GPU per replica
    cpu_only = lray.deployment_options(_flags("--replicas", "2", "--device", "cpu"), gpus=True)
    assert "num_gpus" not in cpu_only["ray_actor_options"]
    assert lray.deployment_options(_flags("--max-queued-requests", "0"), gpus=False)["max_queued_requests"] == (
        EngineConfig().max_num_seqs)  # (bounded: it was -1, no bound at all)
    assert auto["max_queued_requests"] == 4 * (8 + MAX_QUEUED_REQUESTS)  # (the most replicas autoscaling allows)


@pytest.mark.parametrize(("argv", "said"), [
    ((), "1 replica"), (("--replicas", "3"), "3 replicas"),
    (("--min-replicas", "2"), "autoscaling 2..2 replicas"),  # (it said "2..None")
    (("--max-replicas", "4"), "autoscaling 1..4 replicas"),
])
def test_the_start_line_says_the_replicas_the_deployment_gets(argv, said):
    args = _flags(*argv)
    assert lray._describe(args) == said
    opts = lray.deployment_options(args, gpus=False)
    auto = opts.get("autoscaling_config")
    assert said.startswith(f"autoscaling {auto['min_replicas']}..{auto['max_replicas']} " if auto else
                           f"{opts['num_replicas']} replica")


def test_replica_threads_flags_one_rule(monkeypatch):
    """A replica's torch threads: --threads where given (on a CPU or a GPU replica), else on a CPU replica
    --replica-cpus (at least 1), else left as they are; set by the loader once the model has loaded (as the
    single-process server's --threads), never by the replica itself before it."""
    import types

    import torch

    assert lray.replica_threads(_flags(), cuda=False) == 1
    assert lray.replica_threads(_flags("--replica-cpus", "2.5"), cuda=False) == 2
    assert lray.replica_threads(_flags("--replica-cpus", "0.5"), cuda=False) == 1
    assert lray.replica_threads(_flags("--replica-cpus", "2", "--threads", "3"), cuda=False) == 3
    assert lray.replica_threads(_flags("--replica-cpus", "2"), cuda=True) is None
    assert lray.replica_threads(_flags("--threads", "3"), cuda=True) == 3
    # the replica's constructor, with Ray's context, the loader and the app stubbed: --threads reaches the loader
    # (which sets it once the model has loaded) and the replica sets no threads itself
    from loopserve.serve import api, cli

    loaded_with: list[argparse.Namespace] = []
    set_to: list[int] = []
    monkeypatch.setattr(torch, "set_num_threads", set_to.append)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(lray.serve, "get_replica_context", lambda: types.SimpleNamespace(
        replica_id=types.SimpleNamespace(unique_id="r1"), deployment=lray.DEPLOYMENT, app_name=lray.APP_NAME))
    monkeypatch.setattr(cli, "load_server", lambda a: (loaded_with.append(a), (None, None))[1])
    monkeypatch.setattr(api, "build_app", lambda *a, **k: types.SimpleNamespace(
        state=types.SimpleNamespace(serving=types.SimpleNamespace(summary=lambda: ""),
                                    settings=types.SimpleNamespace(root_path=""))))
    user_class = lray.LoopServeReplica.func_or_class.__mro__[1]  # (the class under Ray Serve's ASGI wrapper)
    for argv, threads in ((["--replica-cpus", "2", "--threads", "3"], 3), (["--replica-cpus", "2"], 2)):
        args = _flags(*argv)
        user_class.__init__(object.__new__(user_class), args)
        assert loaded_with[-1].threads == threads and args.threads == (3 if "--threads" in argv else None)
    assert set_to == []


@pytest.mark.parametrize("argv, message", [
    (["--replicas", "0"], "--replicas: must be >= 1"),
    (["--min-replicas", "3", "--max-replicas", "2"], "is above --max-replicas"),
    (["--replicas", "5", "--max-replicas", "2"], "must lie in"),
    (["--replicas", "2", "--replica-cpus", "0"], "--replica-cpus: must be > 0"),
    # (a relative one: Ray started, and six replica tracebacks came before the error, with exit 1)
    (["--replicas", "2", "--model", "no_such_folder"], "model: 'no_such_folder' is not a model folder"),
    # (given positionally, vLLM's `serve MODEL`: named as the --model flag, which the user did not type)
    (["no_such_folder", "--replicas", "2"], "error: model: 'no_such_folder' is not a model folder"),
    (["--replicas", "2", "--ray-address", "127.0.0.1:1"], "--ray-address: nothing answers at 127.0.0.1:1"),
    # (Ray's proxy took it as any free port, and the start-up line said port 0)
    (["--replicas", "2", "--port", "0"], "--port: 0 (a port the system picks) cannot be used with replicas"),
    # a model that cannot load: the single-process server's line (it was 7 replica tracebacks over 48 s, then the line)
    (["--replicas", "2", "--model", "{bad}"], "config.json: unknown architecture None; loopserve supports"),
    (["--replicas", "2", "--model", "{empty}"], "config.json: missing"),
    (["--replicas", "2", "--model", "{bad}/config.json"], "config.json' is not a model folder"),
])
def test_bad_replica_flags_exit_2_before_ray_starts(argv, message, tmp_path):
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "config.json").write_text('{"model_type": "ouro"}')
    (tmp_path / "empty").mkdir()
    argv = [a.format(bad=tmp_path / "bad", empty=tmp_path / "empty") for a in argv]
    t0 = time.monotonic()
    r = subprocess.run([sys.executable, "-m", "loopserve.cli", "serve", *argv],  # (no --model: the embedded one)
                       capture_output=True, text=True, cwd=REPO, timeout=60)
    assert r.returncode == 2 and message in r.stderr, r.stderr
    assert "Ray" not in r.stderr and time.monotonic() - t0 < 30


def test_ray_address_auto_without_a_cluster_is_one_error_line():
    """It was Ray's ConnectionError traceback (exit 1)."""
    if Path(tempfile.gettempdir(), "ray", "ray_current_cluster").exists():  # (what "auto" would join)
        pytest.skip("a Ray cluster runs on this machine")
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    r = subprocess.run([sys.executable, "-m", "loopserve.cli", "serve", "--ray-address", "auto"],
                       capture_output=True, text=True, cwd=REPO, timeout=120, env=env)
    assert r.returncode == 2 and "error: --ray-address: Could not find any running Ray instance" in r.stderr, r.stderr
    assert "Traceback" not in r.stderr


def test_a_port_in_use_exits_2_before_ray_starts():
    """It was a traceback from serve.start, 14 s later (Ray's proxy failed to bind)."""
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        r = subprocess.run([sys.executable, "-m", "loopserve.cli", "serve", "--replicas", "2", "--port", str(port)],
                           capture_output=True, text=True, cwd=REPO, timeout=60)
    assert r.returncode == 2 and f"error: --port: cannot listen on 127.0.0.1:{port}" in r.stderr, r.stderr
    assert "Traceback" not in r.stderr


def test_replicas_that_do_not_fit_the_local_instance_exit_2():
    """Ray Serve started the replicas that fit and waited for the others for good ("serving on" never came), and the
    first SIGTERM did nothing. Ray starts (its CPUs are the figure), the application does not."""
    r = subprocess.run([sys.executable, "-m", "loopserve.cli", "serve", "--replicas", "2", "--replica-cpus", "4096",
                        "--port", str(free_port())], capture_output=True, text=True, cwd=REPO, timeout=120)
    assert r.returncode == 2, r.stderr
    last = r.stderr.strip().splitlines()[-1]
    assert last.startswith("error: --replicas 2 x --replica-cpus 4096: the replicas need 8192 CPUs, and the local Ray "
                           "instance has ") and last.endswith("; lower --replicas or --replica-cpus"), r.stderr
    assert "Traceback" not in r.stderr and "Serve" not in r.stderr


def test_a_cluster_wanting_a_token_gets_the_hint():
    """Ray 2.60 raises ConnectionError("Failed to connect to Ray cluster at ...") from the authentication error: the
    hint was only given where the error's own text said "auth"."""
    try:
        try:
            raise RuntimeError("UNAUTHENTICATED: Authentication token is missing or invalid")
        except RuntimeError as cause:
            raise ConnectionError("Failed to connect to Ray cluster at 10.0.0.1:6379") from cause
    except ConnectionError as e:
        chained = e
    said = lray._ray_init_error(chained, local=False)
    assert said.startswith("--ray-address: Failed to connect to Ray cluster at 10.0.0.1:6379 (a cluster with token "
                           "authentication: set RAY_AUTH_MODE"), said
    assert lray._ray_init_error(ConnectionError("Could not find any running Ray instance"), local=False) == (
        "--ray-address: Could not find any running Ray instance")


def test_config_file_builder(tmp_path):
    args = lray.flags_from_config({"model": str(tmp_path), "max-model-len": 256, "api_key": ["a", "b"],
                                   "enable_log_requests": True, "allowed_origins": ["https://a.example"],
                                   "min_replicas": 1, "max_replicas": 3})
    assert (args.model, args.max_model_len, args.api_key) == (str(tmp_path), 256, ["a", "b"])
    assert args.enable_log_requests and args.allowed_origins == ["https://a.example"]
    assert (args.min_replicas, args.max_replicas) == (1, 3)
    application = lray.app({"replicas": 2})  # (the embedded model: its files are read here)
    assert isinstance(application, ray.serve.Application)
    with pytest.raises(ValueError, match="args.nonsense: not a `loopserve serve` flag"):
        lray.flags_from_config({"nonsense": 1})
    # engine switches are --x / --no-x: true and false each set them (unset: the engine's default)
    args = lray.flags_from_config({"model": str(tmp_path), "cuda_graphs": True, "lookahead": "true",
                                   "enable-prefix-caching": False, "async_coda": "false"})
    assert (args.model, args.cuda_graphs, args.lookahead, args.enable_prefix_caching, args.async_coda) == (
        str(tmp_path), True, True, False, False)
    # and by their --no- names (vLLM's configs write `no_enable_prefix_caching: true`)
    args = lray.flags_from_config({"model": str(tmp_path), "no_enable_prefix_caching": True, "no-lookahead": "false"})
    assert (args.enable_prefix_caching, args.lookahead) == (False, True)
    assert lray.flags_from_config({"model": str(tmp_path)}).cuda_graphs is None
    with pytest.raises(ValueError, match="args.cuda_graphs: expected true or false"):
        lray.flags_from_config({"cuda_graphs": "yes"})
    # a bad value: argparse's line, naming the flag, and no other value (the error is logged: keys and tokens stay out)
    with pytest.raises(ValueError) as e:
        lray.flags_from_config({"model": str(tmp_path), "api_key": "sk-VERYSECRET", "hf_token": "hf_SECRET",
                                "max_model_len": "abc"})
    assert str(e.value) == ("args: argument --max-model-len: expected an integer (or with a suffix: 32k is 32000, "
                            "32K 32768) or auto, got 'abc'")
    # vLLM's dict- and list-valued flags as JSON (a dict was passed as its Python repr), and a list flag's items
    args = lray.flags_from_config({"model": str(tmp_path), "limit_mm_per_prompt": {}, "cuda_graph_sizes": [8, 16]})
    assert (args.limit_mm_per_prompt, args.cuda_graph_sizes) == ({}, [8, 16])
    with pytest.raises(ValueError, match="--replicas: must be >= 1"):
        lray.app({"model": str(tmp_path), "replicas": 0})
    # a flag by its own name: an alias, and vLLM's flags for what loopserve lacks (refused as unknown before)
    args = lray.flags_from_config({"model": str(tmp_path), "disable_uvicorn_access_log": True,
                                   "uvicorn_log_level": "debug", "kv_cache_dtype": "auto",
                                   "enable_chunked_prefill": False, "enable-lora": "false"})
    assert args.no_access_log and (args.uvicorn_log_level, args.log_level) == ("debug", "info")
    # (serve's own flags of vLLM's names: any value passes)
    own = ("served_model_name", "disable_log_stats", "reasoning_parser")
    assert {k: v for k, v in neutral_kwargs(args).items() if k not in own} == {
        "kv_cache_dtype": "auto", "enable_chunked_prefill": False, "enable_lora": False}
    # a switch's true is its --x (it came out as --no-x once both forms shared the keyword as dest)
    assert neutral_kwargs(lray.flags_from_config({"model": str(tmp_path), "enable_chunked_prefill": True,
                                                  "enable_prefix_caching": True}))["enable_chunked_prefill"] is True


def test_merge_metrics_labels_every_sample_with_its_replica():
    a = ('# HELP loopserve:x_total X.\n# TYPE loopserve:x_total counter\nloopserve:x_total{engine="0"} 1.0\n'
         '# HELP process_cpu_seconds_total CPU.\n# TYPE process_cpu_seconds_total counter\n'
         'process_cpu_seconds_total 2.5\n')
    b = a.replace(" 1.0", " 3.0").replace(" 2.5", " 4.5")
    merged = lray.merge_metrics([("r1", a), ("r2", b)])
    families = {f.name: f for f in text_string_to_metric_families(merged)}
    x = {s.labels["replica"]: s.value for s in families["loopserve:x"].samples}
    cpu = {s.labels["replica"]: s.value for s in families["process_cpu_seconds"].samples}
    assert x == {"r1": 1.0, "r2": 3.0} and cpu == {"r1": 2.5, "r2": 4.5}
    assert merged.count("# TYPE loopserve:x_total") == 1


# -- a local Ray instance with two replicas ---------------------------------------------------------------------
@dataclass
class RayServer:
    proc: subprocess.Popen
    url: str
    log: Path
    gcs: str


def _children() -> dict[int, list[int]]:
    out: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            out.setdefault(ppid, []).append(int(entry))
    return out


def _descendants(pid: int) -> set[int]:
    tree, seen, todo = _children(), set(), [pid]
    while todo:
        for child in tree.get(todo.pop(), []):
            if child not in seen:
                seen.add(child)
                todo.append(child)
    return seen


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> Path:
    return make_tiny(tmp_path_factory.mktemp("ray-tiny"), TinySpec(arch="ouro", layers="2", r_max=4, seed=11))


@pytest.fixture(scope="module")
def server(tiny_model, tmp_path_factory) -> Iterator[RayServer]:
    log = tmp_path_factory.mktemp("ray-logs") / "serve.log"
    port = free_port()
    cmd = [sys.executable, "-m", "loopserve.cli", "serve", "--model", str(tiny_model), "--port", str(port),
           "--served-model-name", MODEL, "--device", "cpu", "--kv-cache-tokens", "4096", "--max-num-seqs", "2",
           "--max-queued-requests", "8", "--replicas", "2", "--replica-cpus", "1", "--no-access-log",
           "--shutdown-timeout", str(GRACE_S), "--allowed-origins", ORIGIN,
           "--log-level", "info"]
    env = server_env(RAY_DEDUP_LOGS="0")
    with open(log, "w") as f:
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=env, cwd=REPO)
    started: set[int] = set()
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + START_TIMEOUT_S
        while "serving on http" not in log.read_text():
            assert proc.poll() is None, f"server exited:\n{log.read_text()}"
            assert time.monotonic() < deadline, f"server did not start:\n{log.read_text()}"
            time.sleep(0.25)
        gcs = log.read_text().split("local instance (", 1)[1].split(")", 1)[0]
        assert httpx.get(url + "/health", timeout=10).status_code == 200
        yield RayServer(proc, url, log, gcs)
    finally:
        started = _descendants(proc.pid)
        stop(proc, timeout=60)
        deadline = time.monotonic() + 20
        while any(_alive(p) for p in started) and time.monotonic() < deadline:
            time.sleep(0.25)
        left = sorted(p for p in started if _alive(p))
        for p in left:  # cleaned up whatever happens; the assertion below still reports them
            try:
                os.kill(p, signal.SIGKILL)
            except ProcessLookupError:
                pass
        assert proc.returncode == 0, f"server exit status {proc.returncode}:\n{log.read_text()[-3000:]}"
        assert not left, f"processes left behind by the server: {left}"


def _metrics(server: RayServer, **labels: str) -> dict[tuple[str, str], float]:
    """(sample name, replica) -> value, over the samples with these labels, summed over the other labels."""
    out: dict[tuple[str, str], float] = {}
    for fam in text_string_to_metric_families(httpx.get(server.url + "/metrics", timeout=30).text):
        for s in fam.samples:
            if any(s.labels.get(k) != v for k, v in labels.items()):
                continue
            key = (s.name, s.labels.get("replica", ""))
            out[key] = out.get(key, 0.0) + s.value
    return out


def _per_replica(metrics: dict[tuple[str, str], float], name: str) -> dict[str, float]:
    return {replica: v for (n, replica), v in metrics.items() if n == name}


def _complete(server: RayServer, **body) -> httpx.Response:
    return httpx.post(server.url + "/v1/completions", json={"model": MODEL, "prompt": "Once upon", **body},
                      timeout=120)


@pytest.mark.timeout(300)
def test_same_api_as_the_single_process_server(server):
    models = httpx.get(server.url + "/v1/models", timeout=30).json()
    assert models["data"][0]["id"] == MODEL and models["data"][0]["max_model_len"] > 0
    assert httpx.get(server.url + "/version", timeout=30).json()["version"]
    r = _complete(server, max_tokens=5, temperature=0)
    assert r.status_code == 200 and r.headers[REPLICA]
    body = r.json()
    assert body["object"] == "text_completion" and body["usage"]["completion_tokens"] == 5
    assert body["id"] == f"cmpl-{r.headers['x-request-id']}"  # one X-Request-Id, the response's id
    mine = httpx.post(server.url + "/v1/completions", headers={"X-Request-Id": "abc-123"}, timeout=60,
                      json={"model": MODEL, "prompt": "x", "max_tokens": 2})
    assert mine.headers.get_list("x-request-id") == ["abc-123"] and mine.json()["id"] == "cmpl-abc-123"
    # an id the server does not take: the proxy echoes it, alone (the replica's fresh one came beside it), and the
    # response's id is a fresh one (docs/scale-out.md, Limits)
    long_id = "a" * 200
    odd = httpx.post(server.url + "/v1/completions", headers={"X-Request-Id": long_id}, timeout=60,
                     json={"model": MODEL, "prompt": "x", "max_tokens": 2})
    assert odd.status_code == 200 and odd.headers.get_list("x-request-id") == [long_id], odd.headers
    assert long_id not in odd.json()["id"]
    chat = httpx.post(server.url + "/v1/chat/completions", timeout=60, json={
        "model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4})
    assert chat.status_code == 200 and chat.json()["choices"][0]["message"]["role"] == "assistant"
    bad = _complete(server, max_tokens=-1)
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "max_tokens"
    missing = httpx.get(server.url + "/nothing", timeout=30)
    assert missing.status_code == 404 and missing.json()["error"]["code"] == 404
    with httpx.stream("POST", server.url + "/v1/completions", timeout=60, json={
            "model": MODEL, "prompt": "Once", "max_tokens": 6, "stream": True, "temperature": 0}) as s:
        assert s.headers["content-type"].startswith("text/event-stream")
        events = list(sse_events(s.iter_lines()))
    assert events[-1] == "[DONE]" and len(events) >= 2
    streamed = "".join(json.loads(e)["choices"][0]["text"] for e in events[:-1])
    assert streamed == _complete(server, prompt="Once", max_tokens=6, temperature=0).json()["choices"][0]["text"]


@pytest.mark.timeout(300)
def test_outputs_identical_whichever_replica_serves(server):
    cases = {"greedy": {"temperature": 0, "max_tokens": 12},
             "seeded": {"temperature": 1.0, "top_p": 0.9, "seed": 1234, "max_tokens": 12}}
    for name, params in cases.items():
        seen: dict[str, list[tuple[str, list[int]]]] = {}
        for _ in range(8):  # concurrent rounds: the router spreads them over both replicas
            with ThreadPoolExecutor(4) as pool:
                results = list(pool.map(lambda p: _complete(server, return_token_ids=True, **p), [params] * 4))
            for r in results:
                assert r.status_code == 200, r.text
                c = r.json()["choices"][0]
                seen.setdefault(r.headers[REPLICA], []).append((c["text"], c["token_ids"]))
            if len(seen) == 2:
                break
        assert len(seen) == 2, f"{name}: every request went to one replica"
        outputs = {o for outs in seen.values() for o in map(lambda x: (x[0], tuple(x[1])), outs)}
        assert len(outputs) == 1, f"{name}: outputs differ between replicas: {seen}"


@pytest.mark.timeout(300)
def test_metrics_merged_with_a_replica_label(server):
    replicas = {_complete(server, max_tokens=2).headers[REPLICA] for _ in range(12)}
    metrics = _metrics(server)
    generated = _per_replica(metrics, "loopserve:generation_tokens_total")
    assert len(generated) == 2 and replicas <= set(generated)
    for name in ("loopserve:num_requests_running", "loopserve:kv_cache_usage_perc", "process_cpu_seconds_total"):
        assert set(_per_replica(metrics, name)) == set(generated), name
    # as the single-process server answers a Prometheus scrape, through the app's middleware (CORS): it was Ray's
    # handler beside the app, without CORS headers, and prometheus_client's latest content type (version=1.0.0)
    r = httpx.get(server.url + "/metrics", timeout=30, headers={
        "Origin": ORIGIN, "Accept-Encoding": "gzip", "Accept": "application/openmetrics-text; version=1.0.0"})
    assert r.status_code == 200 and r.headers["access-control-allow-origin"] == ORIGIN
    assert r.headers["content-type"] == "text/plain; version=0.0.4; charset=utf-8"
    assert "content-encoding" not in r.headers and int(r.headers["content-length"]) == len(r.content)
    assert all(f'replica="{replica}"' in r.text for replica in generated)


@pytest.mark.timeout(300)
def test_client_disconnect_frees_kv_on_its_replica(server):
    with httpx.stream("POST", server.url + "/v1/completions", timeout=60,
                      json={"model": MODEL, "prompt": "Once", "stream": True, **LONG, "max_tokens": 1500}) as s:
        replica = s.headers[REPLICA]
        for i, _ in enumerate(sse_events(s.iter_lines())):
            if i == 5:
                break  # closes the connection mid-stream
    deadline = time.monotonic() + 30
    while True:
        m = _metrics(server)
        running = _per_replica(m, "loopserve:num_requests_running")
        kv = _per_replica(m, "loopserve:kv_cache_usage_perc")
        aborted = _metrics(server, finished_reason="abort").get(("loopserve:request_success_total", replica), 0)
        if running.get(replica) == 0 and kv.get(replica) == 0 and aborted >= 1:
            break
        assert time.monotonic() < deadline, f"replica {replica} still holds the request: {running} {kv}"
        time.sleep(0.25)


def _replicas(server: RayServer) -> set[str]:
    """The ids of the replicas that answer /metrics."""
    return set(_per_replica(_metrics(server), "process_cpu_seconds_total"))


def _kill_replica(server: RayServer, replica: str) -> None:
    """Kill a replica's actor with Ray's API, from a driver of its own: the server's local instance uses
    token authentication (the token Ray saved for this user), which a driver reads when it starts."""
    code = ("import sys, ray\n"
            "ray.init(address=sys.argv[1], logging_level='ERROR', log_to_driver=False)\n"
            "ray.kill(ray.get_actor(sys.argv[2], namespace='serve'), no_restart=True)\n"
            "ray.shutdown()\n")
    name = f"SERVE_REPLICA::{lray.APP_NAME}#{lray.DEPLOYMENT}#{replica}"
    subprocess.run([sys.executable, "-c", code, server.gcs, name], check=True, timeout=120, cwd=REPO,
                   env={**os.environ, "RAY_AUTH_MODE": "token"}, capture_output=True)


@pytest.mark.timeout(300)
def test_replica_death_fails_only_its_requests_and_ray_restarts_it(server):
    before = _replicas(server)
    assert len(before) == 2
    outcomes: dict[str, object] = {}

    def stream() -> None:
        try:
            with httpx.stream("POST", server.url + "/v1/completions", timeout=120,
                              json={"model": MODEL, "prompt": "Once", "stream": True, **LONG,
                                    "max_tokens": 1500}) as s:
                outcomes["victim"] = s.headers[REPLICA]
                outcomes["stream"] = [e for e in sse_events(s.iter_lines())][-1:]
        except httpx.HTTPError as e:  # the connection was cut mid-stream
            outcomes["stream"] = e

    def plain(i: int) -> None:
        try:
            r = _complete(server, **LONG)
            outcomes[f"plain{i}"] = (r.status_code, r.headers.get(REPLICA))
        except httpx.HTTPError as e:
            outcomes[f"plain{i}"] = e

    threads = [threading.Thread(target=stream)]
    threads[0].start()
    while "victim" not in outcomes:
        assert threads[0].is_alive(), outcomes
        time.sleep(0.05)
    victim = outcomes["victim"]
    threads += [threading.Thread(target=plain, args=(i,)) for i in range(5)]
    for t in threads[1:]:
        t.start()
    deadline = time.monotonic() + 60
    while True:  # all six admitted: two run on each replica (--max-num-seqs 2), the others wait in the engines
        m = _metrics(server)
        taken = {r: v + _per_replica(m, "loopserve:num_requests_waiting")[r]
                 for r, v in _per_replica(m, "loopserve:num_requests_running").items()}
        if sum(taken.values()) == 6:
            break
        assert time.monotonic() < deadline, f"requests not admitted: {taken}"
        time.sleep(0.05)
    _kill_replica(server, victim)
    assert _complete(server, max_tokens=3).status_code == 200  # served by the other replica at once
    for t in threads:
        t.join(150)
        assert not t.is_alive(), "a request hung after its replica died"
    # the stream that ran on the victim is cut (its 200 was sent): no [DONE]
    assert isinstance(outcomes["stream"], httpx.HTTPError) or outcomes["stream"] != ["[DONE]"], outcomes
    plain_results = [outcomes[f"plain{i}"] for i in range(5)]
    assert all(isinstance(p, tuple) for p in plain_results), plain_results
    failed = [p for p in plain_results if p[0] >= 500]
    served = [p for p in plain_results if p[0] == 200]
    # what the victim had taken besides the stream fails with a 5xx; the rest is served elsewhere
    assert len(failed) == taken[victim] - 1 and len(served) == 5 - len(failed), (taken, plain_results)
    assert all(replica != victim for _, replica in served)
    deadline = time.monotonic() + 90
    while True:  # Ray Serve replaces the dead replica
        now = _replicas(server)
        if len(now) == 2 and victim not in now:
            break
        assert time.monotonic() < deadline, f"replica not restarted: {now}"
        time.sleep(0.5)
    assert httpx.get(server.url + "/health", timeout=30).status_code == 200


# -- last: it stops the module's server ------------------------------------------------------------------------
@pytest.mark.timeout(300)
def test_sigterm_lets_requests_in_flight_finish_and_answers_the_rest_503(server):
    """A stopped server (SIGTERM) drains its replicas as the single-process server drains: a request that can finish
    within the grace period is answered in full, those that cannot get a 503 a little before it runs out (a
    stream: the error event), none is cut without an answer (Ray Serve's own shutdown cut them all at once)."""
    outcomes: dict[str, object] = {}
    first_token = threading.Event()

    def stream(name: str, max_tokens: int) -> None:
        events: list[str] = []
        try:
            with httpx.stream("POST", server.url + "/v1/completions", timeout=120,
                              json={"model": MODEL, "prompt": "Once", "stream": True, **LONG,
                                    "max_tokens": max_tokens}) as s:
                for event in sse_events(s.iter_lines()):
                    events.append(event)
                    first_token.set()
            outcomes[name] = (s.status_code, events[-1:])
        except httpx.HTTPError as e:  # a cut: fine only after the error event
            outcomes[name] = (e, events[-1:])

    def plain(name: str, path: str = "/v1/completions") -> None:
        try:  # (/invocations, SageMaker's route, is drained as the completions routes are: it was not waited for)
            r = httpx.post(server.url + path, timeout=120,
                           json={"model": MODEL, "prompt": "Once upon", **LONG, "max_tokens": 1900})
            # (a body that is not JSON is kept as text: the checks below name it, where it once went unseen)
            body = r.json() if r.headers.get("content-type", "").startswith("application/json") else r.text
            outcomes[name] = (r.status_code, body, r.headers.get("retry-after"))
        except httpx.HTTPError as e:
            outcomes[name] = e

    # one request that finishes well within the grace period, then ten that cannot all finish (four run, two at
    # a time on each replica, the others wait in the engines: 5,700 tokens a slot)
    threads = [threading.Thread(target=stream, args=("short", 120))]
    threads[0].start()
    assert first_token.wait(60), outcomes
    threads += [threading.Thread(target=stream, args=(f"stream{i}", 1900)) for i in range(5)]
    threads += [threading.Thread(target=plain, args=(f"plain{i}", "/invocations" if i % 2 else "/v1/completions"))
                for i in range(5)]
    for t in threads[1:]:
        t.start()
    deadline = time.monotonic() + 60
    while True:
        m = _metrics(server)
        if sum(v for (name, _), v in m.items()
               if name in ("loopserve:num_requests_running", "loopserve:num_requests_waiting")) >= 10:
            break
        assert time.monotonic() < deadline, f"requests not admitted: {m}, {outcomes}"
        time.sleep(0.05)
    stopped = time.monotonic()
    server.proc.send_signal(signal.SIGTERM)
    while "shutdown: draining the replicas" not in server.log.read_text():
        assert time.monotonic() - stopped < 30, "the server did not start draining"
        time.sleep(0.05)
    time.sleep(1.0)  # (the drain call reaches the replicas)
    late = _complete(server, max_tokens=3)  # a new request while the ones above still run: refused at once
    assert late.status_code == 503 and late.headers.get("retry-after") == "5", late.text
    assert late.json()["error"]["message"] == "the server is shutting down"
    late = httpx.post(server.url + "/invocations", json={"model": MODEL, "prompt": "x", "max_tokens": 3}, timeout=30)
    assert late.status_code == 503 and late.headers.get("retry-after") == "5", late.text
    health = httpx.get(server.url + "/health", timeout=30)  # (a load balancer stops sending what would be refused)
    assert health.status_code == 503, health.text
    assert time.monotonic() - stopped < GRACE_S - 2  # (long before the grace period is over)
    for t in threads:
        t.join(GRACE_S + 60)
        assert not t.is_alive(), "a request hung through the shutdown"
    assert server.proc.wait(60) == 0
    assert time.monotonic() - stopped < GRACE_S + 30
    assert outcomes["short"] == (200, ["[DONE]"]), outcomes["short"]
    refused = 0
    for name, outcome in outcomes.items():
        if name.startswith("stream") and isinstance(outcome, tuple):
            status, last = outcome
            if last != ["[DONE]"]:  # its 200 was sent: the 503 comes as its last event
                assert json.loads(last[0])["error"]["code"] == 503, (name, outcome)
                refused += 1
        elif name.startswith("plain"):
            assert isinstance(outcome, tuple) and isinstance(outcome[1], dict), (name, outcome)
            if outcome[0] != 200:
                assert outcome[0] == 503 and outcome[2] is not None, (name, outcome)
                assert outcome[1]["error"]["message"] == "the server is shutting down"
                refused += 1
    assert refused >= 1, outcomes
    log = server.log.read_text()
    assert "shutdown: draining the replicas" in log and "Traceback" not in log, log[-3000:]
