"""`loopserve serve [MODEL] --model PATH [--host 127.0.0.1] [--port 8000] [--api-key KEY]
[--served-model-name NAME]` plus the engine flags: an OpenAI-compatible server (FastAPI + uvicorn).

Exit status: 0 after SIGTERM (130 after SIGINT), 2 for bad flags or a bad model, 1 if the server
could not start or the engine failed while serving (then the server stops itself after failing
what was in flight, so that systemd, Kubernetes or Ray Serve restart it).
"""

from __future__ import annotations

import argparse
import logging
import math
import os
import signal
import sys

from loopserve.cli import add_chat_args, add_engine_args, engine_kwargs
from loopserve.exits import POLICIES


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("serve", help="OpenAI-compatible HTTP server (completions, chat, SSE, metrics)")
    p.add_argument("model_tag", nargs="?", default=None, help="model folder (same as --model)")
    add_engine_args(p)
    add_chat_args(p)
    p.add_argument("--host", default="127.0.0.1", help="bind address (default: loopback only)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' on /v1 (env LOOPSERVE_API_KEY)")
    p.add_argument("--served-model-name", default=None, help="the name clients pass as `model` (default: --model)")
    p.add_argument("--expose-model-path", action="store_true",
                   help="/v1/models shows the model's path as its `root` (default: its served name)")
    g = p.add_argument_group("request defaults (a request's own fields win)")
    g.add_argument("--exit-threshold", type=float, default=None)
    g.add_argument("--exit-policy", default=None, choices=POLICIES)
    g.add_argument("--min-loops", type=int, default=None)
    g.add_argument("--max-loops", type=int, default=None)
    s = p.add_argument_group("server limits")
    s.add_argument("--max-queued-requests", type=int, default=256,
                   help="requests accepted beyond --max-num-seqs; past it the server answers 503 with Retry-After")
    s.add_argument("--max-request-body-bytes", type=int, default=4 * 2**20, help="larger bodies get 413")
    s.add_argument("--shutdown-timeout", type=float, default=30.0,
                   help="on SIGTERM, seconds in-flight requests get to finish before they are aborted")
    s.add_argument("--request-read-timeout", type=float, default=30.0,
                   help="seconds a client may take to send a request head, or stall while sending a body "
                        "(then 408); a connection that does not keep up is closed")
    s.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])
    s.add_argument("--no-access-log", action="store_true")
    p.set_defaults(func=cmd_serve)


def cmd_serve(args: argparse.Namespace) -> int:
    import uvicorn

    from loopserve.models.loader import generation_defaults
    from loopserve.serve.api import ServerSettings, build_app, check_sampling_defaults, load_engine
    from loopserve.serve.connection import read_timeout_protocol

    def fail(msg: str) -> int:
        print(f"error: {msg}", file=sys.stderr)
        return 2

    if args.model_tag and args.model and args.model_tag != args.model:
        return fail(f"model given twice ({args.model_tag!r} and --model {args.model!r})")
    model = args.model_tag or args.model
    if args.max_queued_requests < 0:
        return fail("--max-queued-requests: must be >= 0")
    if args.max_request_body_bytes < 1024:
        return fail("--max-request-body-bytes: must be >= 1024")
    if not 0 <= args.port < 65536:
        return fail("--port: must be in [0, 65535]")
    if not (math.isfinite(args.request_read_timeout) and args.request_read_timeout > 0):
        return fail("--request-read-timeout: must be a number of seconds > 0")
    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    defaults = {"exit_threshold": args.exit_threshold, "exit_policy": args.exit_policy,
                "min_loops": args.min_loops, "max_loops": args.max_loops}
    try:
        engine, path = load_engine(model, dtype=args.dtype, device=args.device, state_init=args.state_init,
                                   seed=args.seed, **engine_kwargs(args))
        if args.chat_template is not None:
            engine.tokenizer.set_chat_template(args.chat_template)
        # the model's generation_config.json sampling defaults, under the flags' own
        defaults = {**generation_defaults(path, args.generation_config), **defaults}
        check_sampling_defaults(engine, defaults)
    except ValueError as e:
        return fail(str(e))
    settings = ServerSettings(
        model_name=args.served_model_name or str(model if model is not None else path.name), model_path=str(path),
        expose_model_path=args.expose_model_path, api_key=args.api_key or os.environ.get("LOOPSERVE_API_KEY") or None,
        max_queued_requests=args.max_queued_requests, max_body_bytes=args.max_request_body_bytes,
        sampling_defaults={k: v for k, v in defaults.items() if v is not None})
    engine_failed = False

    def stop_serving() -> None:  # on the event loop, once the engine thread has died
        nonlocal engine_failed
        engine_failed = True
        server.should_exit = True  # uvicorn's graceful stop, as on SIGTERM

    app = build_app(engine, settings, on_engine_dead=stop_serving)
    print(f"loopserve: serving {path} as {settings.model_name!r} on http://{args.host}:{args.port}", flush=True)
    # ws="none": there are no WebSocket endpoints, so an upgrade request is read as plain HTTP
    server = uvicorn.Server(uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level,
                                           access_log=not args.no_access_log,
                                           timeout_graceful_shutdown=args.shutdown_timeout,
                                           http=read_timeout_protocol(args.request_read_timeout), ws="none"))
    # uvicorn shuts down gracefully on SIGTERM/SIGINT, then re-raises the signal: exit quietly then
    signal.signal(signal.SIGTERM, _exit_with(0))
    signal.signal(signal.SIGINT, _exit_with(130))
    server.run()
    if engine_failed:
        print("error: the engine failed (see the log above); the server has stopped", file=sys.stderr, flush=True)
        return 1
    return 0 if server.started else 1


def _exit_with(code: int):
    def handler(signum, frame):
        raise SystemExit(code)

    return handler
