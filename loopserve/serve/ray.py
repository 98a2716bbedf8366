"""Scale-out on Ray Serve: N engine replicas behind one OpenAI-compatible endpoint.

This module owns the Ray side of `loopserve serve --replicas N` (the `[ray]` extra); nothing else in
loopserve imports Ray, and `serve/cli.py` imports this module only when a Ray flag is given.

- `LoopServeReplica`: the deployment. Each replica loads its own engine with the loader the
  single-process server uses (`cli.load_server`) and serves the very app `api.build_app` returns,
  as an ASGI ingress: same endpoints, errors, streaming and metrics. Ray Serve's proxy routes each
  HTTP request to a replica (its request router prefers the replica with the shortest queue), and a
  client that disconnects cancels its request on that replica, which aborts it and frees its KV.
- `deployment_options(args, gpus)`: the serve flags mapped onto Ray Serve's deployment options:
  replicas or autoscaling bounds, one GPU per replica where the cluster has GPUs (else
  `--replica-cpus` CPUs, and as many torch threads unless `--threads` gives them: `replica_threads`),
  `max_ongoing_requests` = what the replica's app admits
  (`--max-num-seqs` + `--max-queued-requests`, past which it answers 503 as the single-process
  server does) + a few slots so that probes never wait behind generations, `--max-queued-requests`
  also as the proxy's queue bound, `--shutdown-timeout` as the graceful shutdown time; autoscaling
  aims at `--max-num-seqs` requests per replica.
- Health: `check_health` fails once the replica's engine thread has died, and a check not answered within
  `HEALTH_CHECK_TIMEOUT_S` fails (a stuck replica), so Ray Serve's controller replaces the replica (force-stopped:
  `FORCE_STOP_UNHEALTHY`) (as a supervisor restarts the single-process server, which exits
  1 then); a replica process that dies is restarted by Ray Serve the same way. GET /health is
  answered by whichever replica the router picks, and is 503 on one whose engine is gone.
- Metrics: GET /metrics on any replica asks every replica for its Prometheus text
  (`handle.broadcast`) and answers them merged, each sample with a `replica` label (Ray Serve's
  replica id), in Prometheus text whatever the scraper's Accept says (one process's server also answers
  OpenMetrics and gzip). Every response carries `X-Loopserve-Replica: <replica id>`.
- `app(config)`: the application builder for `serve run loopserve.serve.ray:app model=PATH ...` and
  Ray Serve config files (`import_path: loopserve.serve.ray:app`, `args:` the serve flags by name).
- `run_replicas(args)`: the `loopserve serve` path: start (or join, `--ray-address`) Ray, run the
  application on `--host`/`--port`, wait for SIGTERM/SIGINT, drain the replicas (`drain_replicas`: the
  single-process server's graceful shutdown, on each replica), then take it down.

Failure semantics (docs/scale-out.md): requests that reach the proxy while a replica is dead, or wait
in the proxy, go to another replica; those the dead replica had taken (running, or waiting in its
engine's queue) fail (the proxy answers 500, or a stream is cut: its 200 is already sent); a replica that hangs
holds them until its health checks have failed (about 3 x `HEALTH_CHECK_TIMEOUT_S`), then they fail the same way.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import io
import json
import logging
import os
import signal
import socket
import sys
import threading
import time
from pathlib import Path
from typing import Any

import ray
from ray import serve
from ray.serve import Application
from starlette.types import Message, Receive, Scope, Send

from loopserve.cli import CommandError
from loopserve.config_args import FlagParser, flags_argv
from loopserve.engine.budget import LONG_MODEL_LEN_ENV
from loopserve.serve.cli import host_port, url_base
from loopserve.serve.protocol import SHUTDOWN_RETRY_AFTER_S, SHUTTING_DOWN, error_body

log = logging.getLogger("loopserve.serve")
APP_NAME = "loopserve"  # the Ray Serve application
DEPLOYMENT = "loopserve"  # its one deployment
REPLICA_HEADER = b"x-loopserve-replica"  # names the replica that answered
HEALTH_CHECK_PERIOD_S = 2.0  # Ray's default is 10 s: a dead engine should leave the rotation sooner
# How long a replica has to answer a health check (Ray's default, 30 s, 3 times in a row, left a stuck replica in the
# rotation for 90 s). `check_health` only reads a flag, on the replica's event loop, and the app keeps that loop free
# (tokenizing, building a request, compiling a grammar and encoding large answers run on worker threads): a busy
# replica answers in milliseconds; 5 s leaves room for a loaded machine, and finds a stuck one in about 15 s.
HEALTH_CHECK_TIMEOUT_S = 5.0
# The Serve controller's switch that stops a replica which failed its health checks at once, not after
# graceful_shutdown_timeout_s (--shutdown-timeout, 30 s by default) spent waiting for a replica that cannot answer:
# a stuck replica has nothing left to finish, and one whose engine died has already failed its requests
FORCE_STOP_UNHEALTHY = {"RAY_SERVE_FORCE_STOP_UNHEALTHY_REPLICAS": "1"}
START_POLL_S = 0.5  # how often `_wait_until_running` reads the application's status
CONSTRUCTOR_RETRIES = 3  # Ray's default, 20, would retry a bad model for minutes
METRICS_TIMEOUT_S = 5.0  # a replica that does not answer in time is left out of /metrics
PROBE_SLOTS = 8  # requests a replica takes beyond what its engine admits: /health, /metrics, 503s
DRAIN_POLL_S = 0.05  # `LoopServeReplica.drain`: how often it looks whether its HTTP requests are all answered
DRAIN_SLACK_S = 10.0  # `drain_replicas` waits this much beyond the grace period for the replicas' answers
# ... and this long once they have all answered: a replica's last chunks (a stream's 503 event) are still on their way
# through the proxy, which `serve.shutdown` takes down at once (a CI run saw a stream cut before its error event; with
# 1 s, a loaded CI run saw a response that was not answered whole)
DRAIN_FLUSH_S = 3.0


# -- flags -> deployment options ------------------------------------------------------------------------------
def deployment_options(args: argparse.Namespace, gpus: bool) -> dict[str, Any]:
    """Ray Serve deployment options for these serve flags; `gpus`: the cluster has GPUs."""
    from loopserve.cli import engine_kwargs
    from loopserve.engine.config import EngineConfig
    from loopserve.serve.cli import fixed_replicas, replica_bounds

    cfg = EngineConfig(**engine_kwargs(args))
    actor: dict[str, Any] = {"num_cpus": args.replica_cpus}
    if LONG_MODEL_LEN_ENV in os.environ:  # (read by each replica's engine: on another node it would not be set)
        actor["runtime_env"] = {"env_vars": {LONG_MODEL_LEN_ENV: os.environ[LONG_MODEL_LEN_ENV]}}
    if gpus and args.device != "cpu":
        actor["num_gpus"] = 1
    fixed = fixed_replicas(args)
    most = fixed if fixed is not None else replica_bounds(args)[1]
    admitted = cfg.max_num_seqs + args.max_queued_requests  # what a replica's app admits (503 with Retry-After beyond)
    opts: dict[str, Any] = {
        "ray_actor_options": actor,
        # what the app itself admits, and room for probes: a replica at its limit would make /health and /metrics
        # wait in the proxy
        "max_ongoing_requests": admitted + PROBE_SLOTS,
        # the proxy's own queue: every request waits there a moment for a replica, so a bound as small as one
        # replica's queue dropped requests below the deployment's capacity, with Ray's plain 503; bounded by what all
        # the replicas admit, the replicas' own 503 (with Retry-After) comes first
        "max_queued_requests": most * admitted,
        "health_check_period_s": HEALTH_CHECK_PERIOD_S,
        "health_check_timeout_s": HEALTH_CHECK_TIMEOUT_S,
        "graceful_shutdown_timeout_s": args.shutdown_timeout,
        "max_constructor_retry_count": CONSTRUCTOR_RETRIES,
    }
    if fixed is not None:
        opts["num_replicas"] = fixed
        return opts
    low, high = replica_bounds(args)
    opts["num_replicas"] = "auto"
    opts["autoscaling_config"] = {
        "min_replicas": low, "max_replicas": high,
        "initial_replicas": args.replicas if args.replicas is not None else max(low, 1),
        # scale out when replicas have more requests than their engines run at once
        "target_ongoing_requests": cfg.max_num_seqs,
    }
    return opts


def replica_threads(args: argparse.Namespace, cuda: bool) -> int | None:
    """A replica's torch CPU threads (`LoadConfig.threads`, which the loader sets once the model has loaded):
    `--threads` where given; else, on a replica with no GPU (`cuda` false), the CPUs Ray reserved for it
    (`--replica-cpus`, at least 1), since replicas on one node would otherwise each start a pool as wide as the
    machine and fight over its cores; else None (left as they are)."""
    if args.threads is not None:
        return int(args.threads)
    return None if cuda else max(1, int(args.replica_cpus))


def _cluster_has_gpus() -> bool:
    if ray.is_initialized():
        return ray.cluster_resources().get("GPU", 0) > 0
    import torch

    return torch.cuda.is_available()


def build_application(args: argparse.Namespace, check_model: bool = True) -> Application:
    """The Ray Serve application for parsed serve flags (ValueError on bad flags); `check_model`: check the model
    path and files here (`_check_model`; `run_replicas` has, before Ray started)."""
    from loopserve.serve.cli import _api_keys, _check

    problem = _check(args)  # (bad engine and load flags fail here, not in every replica)
    if problem is not None:
        raise ValueError(problem)
    if check_model:
        _check_model(args, local=False)
    args = argparse.Namespace(**vars(args))
    args.api_key = _api_keys(args.api_key)  # the key variables are read here: replicas may not see them
    args.func = None  # the subcommand's function is not needed (nor always picklable) on replicas
    deployment: Any = LoopServeReplica  # (`serve.deployment` made the class a Deployment; mypy sees the class)
    return deployment.options(**deployment_options(args, _cluster_has_gpus())).bind(args)


def _check_model(args: argparse.Namespace, local: bool) -> None:
    """ValueError for a model path that cannot be there: a file, a missing absolute path; with a local Ray instance
    (replicas on this machine) also a missing relative one that is no hub id (`loader.is_hub_id`). A cluster's nodes
    may hold relative paths this machine does not. A model folder this machine has (the embedded model's too) is read
    as the loader reads it before the weights (`loader.read_model_files`): a bad config or tokenizer is then the
    single-process server's one line here, where every replica's constructor would fail it, retried, with Ray's
    tracebacks."""
    from loopserve.llm import default_model_path
    from loopserve.models.loader import is_hub_id, is_local_folder, read_model_files

    model = args.model_tag or args.model
    if is_local_folder(model):
        folder = Path(model).expanduser() if model is not None else default_model_path()
        read_model_files(folder, args.state_init, chat_template=args.chat_template,
                         generation_config=args.generation_config,
                         override_generation_config=args.override_generation_config)
    elif Path(model).expanduser().exists() or Path(model).is_absolute() or (local and not is_hub_id(str(model))):
        raise ValueError(f"model: {model!r} is not a model folder")


RAY_CONNECT_TIMEOUT_S = 5.0  # how long a --ray-address HOST:PORT may take to accept a connection


def _check_ray_address(address: str) -> None:
    """ValueError when nothing accepts a connection at a HOST:PORT --ray-address: `ray.init` would wait for it without
    end, printing only Ray's own warnings. (Other forms, `auto` or `ray://...`, are Ray's to read.)"""
    host, sep, port = address.rpartition(":")
    if not sep or not port.isdigit() or "://" in address:
        return
    try:
        socket.create_connection((host, int(port)), timeout=RAY_CONNECT_TIMEOUT_S).close()
    except OSError as e:
        raise ValueError(f"--ray-address: nothing answers at {address} ({e.strerror or e}); start the cluster's head "
                         f"(ray start --head) or give its address") from None


def _serve_parser() -> argparse.ArgumentParser:
    from loopserve.serve.cli import register

    root = FlagParser(prog="loopserve")
    register(root.add_subparsers())
    return root._subparsers._group_actions[0].choices["serve"]  # type: ignore[union-attr, index]


def flags_from_config(config: dict[str, Any]) -> argparse.Namespace:
    """The serve flags from a config's `args` ({"model": PATH, "max_model_len": 512, "api_key": [...]}), read as
    `serve --config` reads a file's (`config_args.flags_argv`). ValueError names an unknown or bad entry."""
    parser = _serve_parser()
    try:
        argv = flags_argv(parser, config)
    except ValueError as e:
        raise ValueError(f"args.{e}") from None
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err):
            return parser.parse_args(argv)
    except SystemExit:  # argparse's own line, which names the flag; not the values (an API key, a token among them)
        why = err.getvalue().strip().splitlines()[-1:] or ["not valid"]
        raise ValueError(f"args: {why[0].split('error: ', 1)[-1]}") from None


def app(config: dict[str, Any]) -> Application:
    """Application builder for `serve run loopserve.serve.ray:app model=PATH ...` and config files."""
    from loopserve.serve.cli import DEFAULT_REPLICAS

    args = flags_from_config(config)
    if args.replicas is None and args.min_replicas is None and args.max_replicas is None:
        args.replicas = DEFAULT_REPLICAS  # a config file's `deployments:` section may say more
    return build_application(args)


# -- metrics -----------------------------------------------------------------------------------------------------
def _label(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def merge_metrics(texts: list[tuple[str, str]]) -> str:
    """One Prometheus text exposition from each replica's (replica id, text): every sample gains a
    `replica` label, each metric family keeps one HELP/TYPE header, its samples from all replicas together."""
    families: dict[str, tuple[list[str], list[str]]] = {}  # header name -> (HELP/TYPE lines, samples)
    for replica, text in texts:
        current: tuple[list[str], list[str]] | None = None
        label = f'replica="{_label(replica)}"'
        for line in text.splitlines():
            if not line.strip():
                continue
            if line.startswith("#"):
                parts = line.split(None, 3)
                if len(parts) >= 3 and parts[1] in ("HELP", "TYPE"):
                    current = families.setdefault(parts[2], ([], []))
                    if line not in current[0]:
                        current[0].append(line)
                continue
            if current is None:  # a sample before any header: its own family
                current = families.setdefault("", ([], []))
            cut = min(i for i in (line.find("{"), line.find(" "), len(line)) if i >= 0)
            if line[cut:cut + 1] == "{":
                rest = line[cut + 1:]
                line = f"{line[:cut]}{{{label}{',' if not rest.startswith('}') else ''}{rest}"
            else:
                line = f"{line[:cut]}{{{label}}}{line[cut:]}"
            current[1].append(line)
    out: list[str] = []
    for header, samples in families.values():
        out += header + samples
    return "\n".join(out) + "\n"


# -- the replica ------------------------------------------------------------------------------------------------
class _ReplicaASGI:
    """The app of one replica as Ray Serve calls it: `build_app`'s app, with the replica's id on every
    response and GET /metrics merged over all replicas. While the replica drains (`LoopServeReplica.drain`), a
    new generation request (`api.GENERATION_PATHS`) and a health probe are answered 503 here, as the single-process
    server's closed socket refuses them, and the generation requests in flight are counted."""

    def __init__(self, replica: LoopServeReplica) -> None:
        from loopserve.serve.api import GENERATION_PATHS, HEALTH_PATHS

        self.replica = replica
        self.inner = replica.fastapi
        root = replica.fastapi.state.settings.root_path

        def rooted(*paths: str) -> set[str]:  # (FastAPI matches a route with --root-path before it, or without)
            return {p for path in paths for p in (path, root + path)}
        self.metrics_paths = rooted("/metrics")
        self.generation_paths, self.health_paths = rooted(*GENERATION_PATHS), rooted(*HEALTH_PATHS)
        self.header = (REPLICA_HEADER, replica.replica_id.encode())
        # generation requests not answered yet, and whether new ones are refused: a plain int and bool, as every
        # ASGI call and the `drain` handle call run on the replica's one user-code event loop
        self.generating = 0
        self.draining = False

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":  # lifespan: the app's own (it starts and stops the engine thread)
            await self.inner(scope, receive, send)
            return

        # Ray Serve's proxy gives a request without X-Request-Id one (the app then takes it as the client's) and adds
        # the request's header to the response, as it came: the app's own would repeat it, or stand beside it where
        # the app did not take the client's (docs/scale-out.md, Limits)
        async def send_with_replica(msg: Message) -> None:
            if msg["type"] == "http.response.start":
                headers = [h for h in msg.get("headers", []) if h[0] != b"x-request-id"]
                msg = {**msg, "headers": [*headers, self.header]}
            await send(msg)

        if scope["method"] == "GET" and scope["path"] in self.metrics_paths:
            await self.metrics(scope, receive, send_with_replica)
            return
        generation = scope["method"] == "POST" and scope["path"] in self.generation_paths
        if self.draining and (generation or scope["path"] in self.health_paths):
            # (a health probe too: a load balancer stops sending what would only be refused)
            body = json.dumps(error_body(503, SHUTTING_DOWN)).encode()
            await _respond(send_with_replica, 503, body, "application/json",
                           [(b"retry-after", str(SHUTDOWN_RETRY_AFTER_S).encode())])
            return
        receive = _disconnect_when_cancelled(receive)  # (any route may ask whether its client left: `in_lane`)
        if not generation:  # probes, tokenize, ...
            await self.inner(scope, receive, send_with_replica)
            return
        self.generating += 1
        try:
            await self.inner(scope, receive, send_with_replica)
        finally:
            self.generating -= 1

    async def metrics(self, scope: Scope, receive: Receive, send: Send) -> None:
        """GET /metrics: the app's own answer (its middleware's headers, CORS among them, and its content type), asked
        for plain Prometheus text (no Accept, no gzip: what `merge_metrics` reads and writes), with every replica's
        metrics as its body."""
        merged = (await self.replica.merged_metrics()).encode()
        plain = {**scope, "headers": [h for h in scope["headers"] if h[0] not in (b"accept", b"accept-encoding")]}
        status = {"code": 0}

        async def send_merged(msg: Message) -> None:
            if msg["type"] == "http.response.start":
                status["code"] = msg["status"]
                if msg["status"] == 200:
                    msg = {**msg, "headers": [(k, str(len(merged)).encode() if k == b"content-length" else v)
                                              for k, v in msg.get("headers", [])]}
            elif msg["type"] == "http.response.body" and status["code"] == 200:  # (its one body: a `Response`)
                msg = {"type": "http.response.body", "body": merged}
            await send(msg)
        await self.inner(plain, receive, send_merged)


def _disconnect_when_cancelled(receive: Receive) -> Receive:
    """`receive`, with Ray's TaskCancelledError (the proxy cancels a request's receive task once the response is
    over or the client went away) read as the ASGI disconnect it means: raised into the app, it failed a streamed
    response that had just ended, with a traceback in the log (seen in a CI run)."""
    async def receive_or_disconnect() -> Message:
        try:
            return await receive()
        except ray.exceptions.TaskCancelledError:
            return {"type": "http.disconnect"}
    return receive_or_disconnect


async def _respond(send: Send, status: int, body: bytes, content_type: str,
                   headers: list[tuple[bytes, bytes]] | None = None) -> None:
    await send({"type": "http.response.start", "status": status, "headers": [
        (b"content-type", content_type.encode()), (b"content-length", str(len(body)).encode()), *(headers or [])]})
    await send({"type": "http.response.body", "body": body})


@serve.deployment(name=DEPLOYMENT)
@serve.ingress()
class LoopServeReplica:
    """One engine replica: the single-process server's app, with its own engine."""

    def __init__(self, args: argparse.Namespace) -> None:
        import torch

        from loopserve.serve.api import build_app
        from loopserve.serve.cli import LOG_FORMAT, load_server

        logging.basicConfig(level=args.log_level.upper(), format=LOG_FORMAT)
        # (set by the loader, once the model has loaded, as for the single-process server's --threads)
        args = argparse.Namespace(**{**vars(args), "threads": replica_threads(args, torch.cuda.is_available())})
        context = serve.get_replica_context()
        self.replica_id: str = context.replica_id.unique_id
        self._where = (context.deployment, context.app_name)
        self._handle: Any = None
        engine, settings = load_server(args)
        # a dead engine fails what is in flight (api.py); check_health then reports it to Ray Serve,
        # whose controller replaces this replica
        self.fastapi = build_app(engine, settings, on_engine_dead=lambda: log.error(
            "replica %s: the engine failed; Ray Serve will replace this replica", self.replica_id))
        self.asgi = _ReplicaASGI(self)
        log.info("replica %s: %s", self.replica_id, self.fastapi.state.serving.summary())

    def __serve_build_asgi_app__(self) -> _ReplicaASGI:
        return self.asgi

    async def drain(self, grace_s: float) -> int:
        """The graceful shutdown of the single-process server, on this replica (`drain_replicas` calls it on every
        replica before Ray Serve is taken down, which cuts whatever a replica is still answering at once): a new
        generation request gets a 503 from now on (`_ReplicaASGI`), those in flight have until
        `connection.grace_deadline` to finish (a beam search's later steps still admitted), then the app ends them
        with a 503 (a stream: its error event and cut). Returns once every generation request has been answered
        or the grace period is over: the number still unanswered then."""
        from loopserve.serve.connection import grace_deadline

        loop = asyncio.get_running_loop()
        start = loop.time()
        self.asgi.draining = True

        async def answered_by(seconds: float) -> None:
            while self.asgi.generating and loop.time() < start + seconds:
                await asyncio.sleep(DRAIN_POLL_S)

        await answered_by(grace_deadline(grace_s))
        if self.asgi.generating:
            self.fastapi.state.serving.abort_in_flight()
            await answered_by(grace_s)  # (their answers written)
        return self.asgi.generating

    def check_health(self) -> None:
        if not self.fastapi.state.engine.alive:
            raise RuntimeError(f"replica {self.replica_id}: the engine is not running")

    async def metrics_text(self) -> tuple[str, str]:
        """This replica's id and Prometheus text (called by `merged_metrics` on every replica)."""
        await self.fastapi.state.serving.metrics_caught_up()
        return self.replica_id, self.fastapi.state.metrics.render().decode()

    async def merged_metrics(self) -> str:
        if self._handle is None:
            self._handle = serve.get_deployment_handle(*self._where)
        try:
            answers = await self._handle.broadcast("metrics_text").results_async(
                timeout_s=METRICS_TIMEOUT_S, return_exceptions=True)
        except Exception as e:  # the router itself failed: this replica's own metrics still count
            log.warning("replica %s: /metrics: could not reach the other replicas (%s)", self.replica_id, e)
            answers = []
        texts = [a for a in answers if isinstance(a, tuple)]
        if not any(r == self.replica_id for r, _ in texts):
            texts.append(await self.metrics_text())
        return merge_metrics(sorted(texts))


# -- `loopserve serve --replicas N` ----------------------------------------------------------------------------
def run_replicas(args: argparse.Namespace) -> int:
    """Serve the flags' model on Ray Serve until SIGTERM (exit 0) or SIGINT (130); a CommandError for bad flags,
    1 if the application could not be deployed."""
    from loopserve.serve.cli import listen, model_refusal

    local = args.ray_address is None
    try:  # bad engine flags, a bad model, a port in use, a cluster that is not there: before Ray starts
        if args.port == 0:  # (Ray Serve's proxy takes port 0 as any free one, and tells no one which)
            raise ValueError("--port: 0 (a port the system picks) cannot be used with replicas: the port their proxy "
                             "would get cannot be reported; give one")
        deployment_options(args, gpus=False)
        _check_model(args, local)
        if local:  # (the proxy listens on this machine: a port in use was a traceback from serve.start)
            listen(args.host, args.port).close()
        else:
            _check_ray_address(args.ray_address)
    except ValueError as e:
        raise model_refusal(args, e) from None
    stop = threading.Event()
    code = {"value": 0}

    def on_signal(signum: int, frame: Any) -> None:
        if stop.is_set():  # a second signal, while the replicas drain: stop waiting for them (uvicorn's rule too)
            raise KeyboardInterrupt
        code["value"] = 130 if signum == signal.SIGINT else 0
        stop.set()

    try:
        context = ray.init(address=args.ray_address, logging_level=args.log_level.upper(),
                           include_dashboard=args.ray_dashboard if local else None)
    except ConnectionError as e:  # (--ray-address auto with no cluster running; a cluster that wants a token)
        raise CommandError(_ray_init_error(e, local)) from None
    # after ray.init, which installs its own SIGTERM handler (a stack dump, then abort)
    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    log.info("Ray: %s (%s)", "local instance" if local else "cluster", context.address_info.get("gcs_address"))  # type: ignore[attr-defined]
    deployed = False  # (Serve's shutdown and delete, with nothing to take down, only say so in Ray's log)
    try:
        try:
            application = build_application(args, check_model=False)
            _check_resources(args, local)
        except ValueError as e:
            raise model_refusal(args, e) from None
        try:
            # (controller_options applies where this starts Serve: a cluster's running Serve keeps its controller's)
            serve.start(http_options={"host": args.host, "port": args.port},
                        controller_options={"runtime_env": {"env_vars": FORCE_STOP_UNHEALTHY}})
        except Exception as e:  # (Ray's wrapping of the proxy's error, e.g. a port in use on a cluster's head)
            why = _last_line(e)
            where = (f"--port: Ray Serve's proxy could not listen on {host_port(args.host, args.port)}"
                     if "bind" in why.lower()
                     else "Ray Serve could not start")
            print(f"error: {where}: {why}", file=sys.stderr)
            return 1
        deployed = True
        # deployed without waiting in Ray's code (serve.run's wait), where a signal only set `stop` and a replica that
        # could not be placed kept the process waiting for good: the wait is this thread's, and a signal ends it
        serve.run_many([serve.RunTarget(application, name=APP_NAME, route_prefix="/")],
                       wait_for_ingress_deployment_creation=False, wait_for_applications_running=False)
        failed = _wait_until_running(stop)
        if failed is not None:
            print(f"error: the replicas could not start: {failed}", file=sys.stderr)
            return 1
        if stop.is_set():
            log.info("shutdown: stopped while the replicas were starting")
            return code["value"]
        log.info("serving on %s%s with Ray Serve (%s)", url_base("http", args.host, args.port), args.root_path,
                 _describe(args))
        stop.wait()
        if local and _local_ray_stopped():
            log.warning("shutdown: Ray's own processes are stopping too (a signal to the whole process group): the "
                        "replicas go with them, and requests in flight are cut without a drain (docs/scale-out.md, "
                        "Limits)")
            return code["value"]
        try:
            drain_replicas(args.shutdown_timeout)
        except KeyboardInterrupt:
            log.warning("shutdown: stopped again; requests still in flight are cut")
        return code["value"]
    finally:
        # (every call to a Ray that is gone waits 60 s for it)
        if deployed and not (local and _local_ray_stopped(wait_s=0.0)):
            if local:
                serve.shutdown()
            else:  # the cluster and its other applications stay up
                serve.delete(APP_NAME)
        ray.shutdown()


def _ray_init_error(error: ConnectionError, local: bool) -> str:
    """The error line for `ray.init`'s ConnectionError. A cluster that wants a token gets a hint: Ray 2.60 says so
    only in the error's cause ("Failed to connect to Ray cluster at ...", from an authentication error), so the whole
    chain is read."""
    if local:
        return f"Ray could not start: {_last_line(error)}"
    chain: list[BaseException] = []
    e: BaseException | None = error
    while e is not None and e not in chain:
        chain.append(e)
        e = e.__cause__ or e.__context__
    hint = (" (a cluster with token authentication: set RAY_AUTH_MODE and Ray's token variables, docs/scale-out.md)"
            if any("auth" in str(e).lower() for e in chain) else "")
    return f"--ray-address: {_last_line(error)}{hint}"


def _check_resources(args: argparse.Namespace, local: bool) -> None:
    """ValueError when the replicas the application starts with need more CPUs (or GPUs) than a local Ray instance
    has: Ray Serve would start those that fit and wait for the others for good. With a cluster, whose autoscaler may
    add nodes, a warning."""
    from loopserve.serve.cli import fixed_replicas

    options = deployment_options(args, _cluster_has_gpus())
    fixed = fixed_replicas(args)
    start = fixed if fixed is not None else options["autoscaling_config"]["initial_replicas"]
    flag = "--replicas" if fixed is not None or args.replicas is not None else "--min-replicas"
    have = ray.cluster_resources()
    actor = options["ray_actor_options"]
    wants = [("CPU", actor["num_cpus"], f"--replica-cpus {actor['num_cpus']:g}", f"{flag} or --replica-cpus")]
    if "num_gpus" in actor:
        wants.append(("GPU", actor["num_gpus"], "one GPU each", flag))
    for resource, per_replica, each, lower in wants:
        need, there = start * per_replica, have.get(resource, 0.0)
        if need <= there:
            continue
        problem = (f"{flag} {start} x {each}: the replicas need {need:g} {resource}s, and the "
                   f"{'local Ray instance' if local else 'cluster'} has {there:g}")
        if local:
            raise ValueError(f"{problem}; lower {lower}")
        log.warning("%s now: the replicas that do not fit wait until nodes join (Ctrl-C stops the wait)", problem)


def _wait_until_running(stop: threading.Event) -> str | None:
    """Wait until the application runs (None), its deployment fails (why, as Ray Serve's status says it), or `stop`
    is set (None)."""
    from ray.serve.schema import ApplicationStatus

    while not stop.wait(START_POLL_S):
        status = serve.status().applications.get(APP_NAME)
        if status is None:  # (deleted meanwhile: by another `loopserve serve --ray-address`, say)
            return "the application is gone from Ray Serve"
        if status.status == ApplicationStatus.RUNNING:
            return None
        if status.status == ApplicationStatus.DEPLOY_FAILED:
            return _why_not_deployed() or "Ray Serve could not deploy it"
    return None


def _last_line(error: BaseException | str) -> str:
    """The last line of an error's text: what a traceback Ray wraps into its own error says last, the cause."""
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    return lines[-1] if lines else repr(error)


def _why_not_deployed() -> str | None:
    """Why the replicas failed to start, as Ray Serve's status keeps it: the error a replica's constructor raised (a
    model that does not load), else None."""
    try:
        app = serve.status().applications[APP_NAME]
        message = app.deployments[DEPLOYMENT].message or app.message
    except Exception:  # (the status itself could not be read: the error above says what Ray knows)
        return None
    return _last_line(message) if message else None


RAY_STOP_WAIT_S = 0.5  # how long a signal to the whole process group may take to stop Ray's own processes


def _local_ray_stopped(wait_s: float = RAY_STOP_WAIT_S) -> bool:
    """Whether the local Ray instance this process started has lost any of its own processes (waiting up to `wait_s`
    for one to go): a SIGTERM to the whole process group (GNU `timeout`, systemd's control-group kill) reaches them with
    the server (its log monitor exits at once; the replicas' workers go too), and the drain's calls to the replicas,
    then Ray's own, waited 60 s for a GCS that went away before failing."""
    node = getattr(ray._private.worker, "_global_node", None)
    end = time.monotonic() + wait_s
    while node is not None:
        try:
            if node.dead_processes():
                return True
        except Exception:  # (a private API: if it changes, drain as before)
            return False
        if time.monotonic() >= end:
            return False
        time.sleep(0.05)
    return False


def drain_replicas(grace_s: float) -> None:
    """Every replica's `drain`, at once: `serve.shutdown` and `serve.delete` take the proxy down at once, cutting
    every request still being answered, whatever the deployment's graceful_shutdown_timeout_s. After this, the
    requests in flight have had the grace period to finish and the rest a 503."""
    log.info("shutdown: draining the replicas (grace period %.1f s)", grace_s)
    try:
        unanswered = serve.get_deployment_handle(DEPLOYMENT, APP_NAME).broadcast("drain", grace_s).results(
            timeout_s=grace_s + DRAIN_SLACK_S, return_exceptions=True)
    except Exception as e:  # the router failed, or a replica did not answer in time: nothing more to wait for
        log.warning("shutdown: the replicas could not be drained (%r); requests in flight are cut", e)
        return
    failed = [u for u in unanswered if not isinstance(u, int)]
    time.sleep(DRAIN_FLUSH_S)
    if failed or any(unanswered):
        log.warning("shutdown: %d replica(s) did not drain (%s), %d request(s) unanswered", len(failed),
                    "; ".join(repr(f) for f in failed) or "-", sum(u for u in unanswered if isinstance(u, int)))


def _describe(args: argparse.Namespace) -> str:
    from loopserve.serve.cli import fixed_replicas, replica_bounds

    fixed = fixed_replicas(args)
    if fixed is not None:
        return f"{fixed} replica{'s' * (fixed != 1)}"
    low, high = replica_bounds(args)
    return f"autoscaling {low}..{high} replicas"
