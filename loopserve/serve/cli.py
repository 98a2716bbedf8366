"""`loopserve serve [MODEL] --model PATH [--host 127.0.0.1] [--port 8000] [--api-key KEY ...]
[--served-model-name NAME ...]` plus the engine flags: an OpenAI-compatible server (FastAPI + uvicorn).
Flags take vLLM's names where the concept is the same; `--help` shows every default.

Exit status: 0 after SIGTERM (130 after SIGINT), 2 for bad flags or a bad model, 1 if the server
could not start or the engine failed while serving (then the server stops itself after failing
what was in flight, so that systemd, Kubernetes or Ray Serve restart it).
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import errno
import importlib
import json
import logging
import math
import os
import signal
import socket
import ssl
import stat
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from loopserve.cli import CommandError, add_chat_args, add_engine_args, add_exit_args, engine_kwargs, load_kwargs
from loopserve.config_args import CONFIG_FLAG, json_object
from loopserve.engine.config import ENGINE_SCHEDULERS
from loopserve.load_config import configs
from loopserve.models.loader import is_local_folder
from loopserve.sampling_params import EXIT_FIELDS
from loopserve.serve.limits import (
    BODY_TIMEOUTS,
    CORS_ANY,
    LOG_STATS_INTERVAL_S,
    MAX_QUEUED_REQUESTS,
    MAX_REQUEST_BODY_BYTES,
    METRIC_PREFIXES,
    MIN_BODY_RATE,
    REQUEST_READ_TIMEOUT_S,
)
from loopserve.tokenizer import TEMPLATE_SWITCHES, template_variables
from loopserve.vllm_neutral import SERVE_NEUTRAL, add_neutral_args, check_neutral, neutral_kwargs

if TYPE_CHECKING:
    from loopserve.engine.engine import LLMEngine
    from loopserve.serve.api import ServerSettings

# the key when no --api-key is given: loopserve's variable, else vLLM's (a deployment moved from vLLM keeps its key:
# ignoring VLLM_API_KEY would serve it without one)
API_KEY_ENVS = ("LOOPSERVE_API_KEY", "VLLM_API_KEY")
LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
LOG_LEVELS = ("critical", "error", "warning", "info", "debug")  # --log-level's (uvicorn's take "trace" too)
LOG_LEVEL_ENV = "VLLM_LOGGING_LEVEL"  # --log-level's default when set, as vLLM reads it (a deployment moved keeps it)
log = logging.getLogger("loopserve.serve")


def _str_list(value: str) -> list[str]:
    """A JSON list (vLLM's form: '["https://a.example"]') or comma-separated values."""
    if value.lstrip().startswith("["):
        try:
            items = json.loads(value)
        except json.JSONDecodeError as e:
            raise argparse.ArgumentTypeError(f"not a JSON list ({e})") from None
        if not isinstance(items, list) or not all(isinstance(x, str) for x in items):
            raise argparse.ArgumentTypeError("expected a JSON list of strings")
        return items
    return [x.strip() for x in value.split(",") if x.strip()]


def _unset_if_empty(value: str) -> str | None:
    """A flag's value, None for '', null or None (vLLM's scripts pass those for "unset")."""
    return None if value.lower() in ("", "null", "none") else value


class _OwnUsage(argparse.ArgumentParser):
    """For `serve`'s parser: arguments it does not know are its own error, shown with its own usage. (A subcommand's
    parser hands them back to the top-level one, whose error would show `loopserve`'s usage instead.)"""

    def parse_known_args(  # type: ignore[override]  # (typeshed's overloads; the call is the base class's)
            self, args: Any = None, namespace: Any = None) -> tuple[argparse.Namespace, list[str]]:
        namespace, extras = super().parse_known_args(args, namespace)
        if extras:
            self.error(f"unrecognized arguments: {' '.join(extras)}")
        return namespace, extras


def _parser_names(module: str, registry: str) -> str:
    """The names of a parser registry of loopserve.serve (`module`.`registry`), for a flag's help. Without the serve
    extra (the parsers' modules import pydantic) the parser is still built: `serve` then says which extra it needs."""
    try:
        return ", ".join(getattr(importlib.import_module(f"loopserve.serve.{module}"), registry))
    except ImportError:
        return "(install the [serve] extra)"


def register(sub: argparse._SubParsersAction) -> None:
    # (a short usage line, as vLLM's: the generated one lists some 190 flags, 130 lines before a bad flag's error)
    p = sub.add_parser("serve", help="OpenAI-compatible HTTP server (completions, chat, SSE, metrics)",
                       formatter_class=argparse.ArgumentDefaultsHelpFormatter,
                       usage="loopserve serve [model_tag] [options]  (--help: every option)")
    # (add_parser builds the top-level parser's class: that class, with this one's parse_known_args)
    p.__class__ = type("ServeParser", (_OwnUsage, type(p)), {})
    p.add_argument("model_tag", nargs="?", default=None, help="model folder (same as --model)")
    p.add_argument(CONFIG_FLAG, default=None, metavar="FILE",
                   help="a YAML file of flags, each by its long name without the dashes (port: 8123, max-model-len: "
                        "128 or max_model_len: 128; a list for a list flag, true or false for a switch); a flag on "
                        "the command line wins over the file's (vLLM's --config)")
    add_engine_args(p, ENGINE_SCHEDULERS)  # (the reference decoder is no engine to serve from)
    add_chat_args(p)
    p.add_argument("--host", default="127.0.0.1", help="bind address (loopback only by default)")
    p.add_argument("--port", type=int, default=8000, help="TCP port")
    p.add_argument("--uds", default=None, metavar="PATH",
                   help="listen on this Unix domain socket instead of --host and --port")
    tls = p.add_argument_group("TLS (HTTPS; vLLM's flags, read by uvicorn)")
    tls.add_argument("--ssl-keyfile", default=None, help="the server's private key (PEM), with --ssl-certfile")
    tls.add_argument("--ssl-certfile", default=None, help="the server's certificate chain (PEM)")
    tls.add_argument("--ssl-ca-certs", default=None, help="CA certificates (PEM) to verify client certificates by")
    tls.add_argument("--ssl-cert-reqs", type=int, default=int(ssl.CERT_NONE),
                     help="client certificates: 0 not asked for, 1 optional, 2 required (Python's ssl.CERT_*)")
    tls.add_argument("--ssl-ciphers", default=None,
                     help="the ciphers HTTPS offers, as OpenSSL's cipher list ('ECDHE+AESGCM:ECDHE+CHACHA20'; unset: "
                          "uvicorn's, 'TLSv1')")
    # vLLM's forms, several keys after one flag and several names after one flag (so the model goes before them, or
    # in --model: `_check` refuses a model either swallowed); keys also by repeating the flag, as loopserve took them
    p.add_argument("--api-key", action="extend", nargs="+", default=None, metavar="KEY",
                   help=f"require 'Authorization: Bearer KEY' on /v1, /invocations, /tokenize, /detokenize and "
                        f"/tokenizer_info; several keys after the flag, or the flag repeated (any one is accepted); "
                        f"unset: ${API_KEY_ENVS[0]}, else ${API_KEY_ENVS[1]}, else no key")
    p.add_argument("--served-model-name", nargs="+", default=None, metavar="NAME",
                   help="the names clients may pass as `model`, each listed in /v1/models; the first is the default "
                        "and the one metrics report; a response reports the name its request gave, else the first "
                        "(unset: the model as given)")
    p.add_argument("--expose-model-path", action="store_true",
                   help="/v1/models shows the model's path as its `root` (else its first served name)")
    p.add_argument("--root-path", default="", help="path prefix under which a proxy serves this API")
    p.add_argument("--disable-fastapi-docs", action="store_true",
                   help="no GET /openapi.json, the API's schema (vLLM's flag; its /docs and /redoc pages are never "
                        "served here)")
    g = p.add_argument_group("request defaults (a request's own fields win)")
    add_exit_args(g)
    g.add_argument("--enable-tokenizer-info-endpoint", action="store_true",
                   help="serve GET /tokenizer_info: the tokenizer's config and chat template (vLLM's flag; for "
                        "clients that tokenize through the server)")
    g.add_argument("--return-tokens-as-token-ids", action="store_true",
                   help="write logprobs' tokens as 'token_id:<id>' (vLLM's flag; a request's "
                        "return_tokens_as_token_ids wins)")
    t = p.add_argument_group("tool calls in the model's own format (tool_choice 'auto'; vLLM's flags)")
    t.add_argument("--enable-auto-tool-choice", action=argparse.BooleanOptionalAction, default=False,
                   help="answer tool_choice 'auto' (the default when a request gives tools) by letting the model "
                        "write calls in its own format, read by --tool-call-parser; off, 'auto' is a 400 ('none', "
                        "'required' and a named function work either way)")
    t.add_argument("--tool-call-parser", type=_unset_if_empty, default=None, metavar="NAME",
                   help=f"the model's tool-call format: {_parser_names('tool_parsers', 'TOOL_PARSERS')} (with "
                        "--enable-auto-tool-choice)")
    p.add_argument("--default-chat-template-kwargs", type=json_object, default=None, metavar="JSON",
                   help="the chat template's variables for every chat request, under a request's own "
                        "chat_template_kwargs (vLLM's flag; '{\"enable_thinking\": false}')")
    p.add_argument_group("reasoning of thinking models (vLLM's flag)").add_argument(
        "--reasoning-parser", type=_unset_if_empty, default=None, metavar="NAME",
        help=f"the model's reasoning format, {_parser_names('reasoning_parsers', 'REASONING_PARSERS')}: a chat "
             "reply's reasoning "
             "(<think>...</think>) comes back apart from its content, in the message's `reasoning` (a /v1/responses "
             "answer: a reasoning item); unset: the reply's text comes back whole")
    s = p.add_argument_group("server limits (--max-model-len and --gpu-memory-utilization: under model)")
    s.add_argument("--max-queued-requests", type=int, default=MAX_QUEUED_REQUESTS,
                   help="sequences accepted beyond --max-num-seqs (each sample of a request with n > 1 counts); "
                        "past it the server answers 503 with Retry-After")
    s.add_argument("--max-request-body-bytes", type=int, default=MAX_REQUEST_BODY_BYTES, help="larger bodies get 413")
    s.add_argument("--shutdown-timeout", type=float, default=30.0,
                   help="on SIGTERM, seconds in-flight requests get to finish before they are aborted")
    s.add_argument("--request-read-timeout", type=float, default=REQUEST_READ_TIMEOUT_S,
                   help="seconds a client may take to send a request head, or stall while sending a body "
                        f"(then 408; a body trickling in gets {BODY_TIMEOUTS} of these plus its bytes at "
                        f"{MIN_BODY_RATE // 1024} KiB/s); a connection that does not keep up is closed")
    c = p.add_argument_group("CORS (browsers calling the API from other origins; off unless origins are given)")
    c.add_argument("--allowed-origins", type=_str_list, default=[],
                   help="origins allowed to call the API: a JSON list or comma-separated; '*' for any")
    c.add_argument("--allowed-methods", type=_str_list, default=list(CORS_ANY),
                   help="allowed methods (JSON list or a,b)")
    c.add_argument("--allowed-headers", type=_str_list, default=list(CORS_ANY),
                   help="allowed request headers (JSON list or a,b)")
    c.add_argument("--allow-credentials", action="store_true",
                   help="allow cookies and Authorization cross-origin (with '*', each answer names the request's "
                        "origin instead, as browsers need)")
    lg = p.add_argument_group("logging")
    lg.add_argument("--log-level", default=os.environ.get(LOG_LEVEL_ENV, "info").lower(), choices=LOG_LEVELS,
                    help=f"log level of the server (and of uvicorn, unless --uvicorn-log-level); unset: "
                         f"${LOG_LEVEL_ENV} (vLLM's variable), else info")
    lg.add_argument("--uvicorn-log-level", default=None, choices=[*LOG_LEVELS, "trace"],
                    help="log level of uvicorn's loggers alone (vLLM's flag; unset: --log-level's)")
    lg.add_argument("--no-access-log", "--disable-uvicorn-access-log", action="store_true",
                    help="no line per HTTP request from uvicorn (--disable-uvicorn-access-log: vLLM's name)")
    lg.add_argument("--disable-access-log-for-endpoints", type=_str_list, default=None, metavar="PATHS",
                    help="no access-log line for requests to these paths, comma-separated ('/health,/metrics': the "
                         "probes' and scrapers' lines; a query string is not part of a path)")
    requests = lg.add_mutually_exclusive_group()
    requests.add_argument("--enable-log-requests", action="store_true",
                          help="log each request received (prompt, token ids, sampling parameters) and finished")
    # older vLLM logged requests unless told not to; its scripts still pass this
    requests.add_argument("--disable-log-requests", action="store_true",
                          help="no log line per request, as without --enable-log-requests (vLLM's older flag)")
    lg.add_argument("--max-log-len", type=int, default=None,
                    help="prompt characters and token ids shown per logged request (unset: all)")
    lg.add_argument("--disable-log-stats", action="store_true", help="no periodic stats line")
    lg.add_argument("--log-stats-interval", type=float, default=LOG_STATS_INTERVAL_S,
                    help="seconds between stats lines (throughput, running and waiting requests, KV cache usage, "
                         "mean exit depth), logged while the server is busy")
    lg.add_argument("--enable-server-load-tracking", action=argparse.BooleanOptionalAction, default=False,
                    help="GET /load counts the generation requests in flight (vLLM's flag; off, /load says 0)")
    lg.add_argument("--metric-prefix", default=next(iter(METRIC_PREFIXES)), choices=list(METRIC_PREFIXES),
                    help="the prefix of /metrics' names: loopserve (loopserve:...) or vllm (vllm:..., so that vLLM's "
                         "Grafana dashboards and alerts read them as they are)")
    r = p.add_argument_group("scale-out on Ray Serve (the [ray] extra; docs/scale-out.md)")
    r.add_argument("--replicas", type=int, default=None,
                   help="run this many engine replicas as Ray Serve deployments behind one endpoint (with "
                        "--min/--max-replicas: the initial count); unset: one engine in this process, no Ray")
    r.add_argument("--min-replicas", type=int, default=None,
                   help="autoscale: fewest replicas (Ray Serve's autoscaling_config.min_replicas)")
    r.add_argument("--max-replicas", type=int, default=None,
                   help="autoscale: most replicas (Ray Serve's autoscaling_config.max_replicas)")
    r.add_argument("--ray-address", default=None,
                   help="Ray cluster to join (e.g. HEAD:6379, as `ray start --head` prints); unset: a local Ray "
                        "instance, stopped with the server")
    r.add_argument("--ray-dashboard", action="store_true",
                   help="start Ray's dashboard (http://127.0.0.1:8265; `serve status` needs it) with the local "
                        "Ray instance (a dozen more processes)")
    r.add_argument("--replica-cpus", type=float, default=1.0,
                   help="CPUs reserved per replica (and its torch threads, unless --threads) when it gets no GPU; a "
                        "replica gets one GPU wherever the cluster has GPUs and --device is not cpu")
    add_neutral_args(p.add_argument_group("vLLM's flags for what loopserve lacks (LLM's keywords of the same names: "
                                          "each taken at the values that ask for nothing of it)"))
    add_neutral_args(p.add_argument_group("vLLM's server flags for what loopserve's server lacks or always does "
                                          "(each taken at the values that ask for nothing of it)"), SERVE_NEUTRAL)
    p.set_defaults(func=cmd_serve)


def uvicorn_log_config(level: str, quiet_paths: list[str] | None = None) -> dict[str, Any]:
    """uvicorn's logging config with a timestamp on every line (its default has none), and without its error line
    for a stream the app cut on purpose (the app logs that itself: `responses.CutStreamFilter`); `quiet_paths`:
    paths whose requests get no access-log line (`responses.QuietPathsFilter`)."""
    from uvicorn.config import LOGGING_CONFIG

    cfg = copy.deepcopy(LOGGING_CONFIG)
    for formatter in cfg["formatters"].values():
        formatter["fmt"] = "%(asctime)s " + formatter["fmt"]
    for name in ("uvicorn", "uvicorn.error", "uvicorn.access"):
        cfg["loggers"].setdefault(name, {})["level"] = level.upper()
    filters = cfg.setdefault("filters", {})
    filters["stream_cut"] = {"()": "loopserve.serve.responses.CutStreamFilter"}
    cfg["loggers"]["uvicorn.error"].setdefault("filters", []).append("stream_cut")
    if quiet_paths:
        filters["quiet_paths"] = {"()": "loopserve.serve.responses.QuietPathsFilter", "paths": quiet_paths}
        cfg["loggers"]["uvicorn.access"].setdefault("filters", []).append("quiet_paths")
    return cfg


def _check(args: argparse.Namespace) -> str | None:
    """The first thing wrong with the server flags, if any."""
    if args.model_tag and args.model and args.model_tag != args.model:
        return f"model given twice ({args.model_tag!r} and --model {args.model!r})"
    # (a value that is a checkpoint folder: another that merely exists here, "docs", is a name or a key)
    for flag, what, values in (("--served-model-name", "name", args.served_model_name),
                               ("--api-key", "key", args.api_key)):
        swallowed = [n for n in (values or [])[1:] if Path(n, "config.json").is_file()]
        if swallowed and not (args.model_tag or args.model):
            return f"{flag} took the model {swallowed[-1]!r} as a {what}; give the model before the flag or as --model"
    if args.log_level not in LOG_LEVELS:  # (a default argparse does not check: from $VLLM_LOGGING_LEVEL)
        return f"${LOG_LEVEL_ENV}: must be one of {', '.join(LOG_LEVELS)} (any case), got {args.log_level!r}"
    if args.max_queued_requests < 0:
        return "--max-queued-requests: must be >= 0"
    if args.max_request_body_bytes < 1024:
        return "--max-request-body-bytes: must be >= 1024"
    if not 0 <= args.port < 65536:
        return "--port: must be in [0, 65535]"
    if not (math.isfinite(args.shutdown_timeout) and args.shutdown_timeout >= 0):
        return "--shutdown-timeout: must be a number of seconds >= 0"
    if not (math.isfinite(args.request_read_timeout) and args.request_read_timeout > 0):
        return "--request-read-timeout: must be a number of seconds > 0"
    if not (math.isfinite(args.log_stats_interval) and args.log_stats_interval > 0):
        return "--log-stats-interval: must be a number of seconds > 0"
    if args.max_log_len is not None and args.max_log_len < 0:
        return "--max-log-len: must be >= 0"
    if args.root_path and not args.root_path.startswith("/"):
        return "--root-path: must start with '/'"
    if args.replicas is not None and args.replicas < 1:
        return "--replicas: must be >= 1"
    if args.min_replicas is not None and args.min_replicas < 0:
        return "--min-replicas: must be >= 0"
    if args.max_replicas is not None and args.max_replicas < 1:
        return "--max-replicas: must be >= 1"
    low, high = replica_bounds(args)
    if low > high:
        return f"--min-replicas ({low}) is above --max-replicas ({high})"
    if args.replicas is not None and (args.min_replicas is not None or args.max_replicas is not None) \
            and not low <= args.replicas <= high:
        return f"--replicas ({args.replicas}): must lie in [--min-replicas, --max-replicas] = [{low}, {high}]"
    if not (math.isfinite(args.replica_cpus) and args.replica_cpus > 0):
        return "--replica-cpus: must be > 0"
    problem = _check_tool_parser(args) or _check_reasoning_parser(args) or _check_template_kwargs(args)
    if problem is not None:
        return problem
    problem = _check_transport(args)
    if problem is not None:
        return problem
    try:  # before the model loads, and before any Ray replica starts (--tensor-parallel-size 2, ...)
        configs({**load_kwargs(args), **engine_kwargs(args)})
        check_neutral(local_folder=is_local_folder(args.model_tag or args.model), **neutral_kwargs(args))
        check_neutral(SERVE_NEUTRAL, **neutral_kwargs(args, SERVE_NEUTRAL))
    except ValueError as e:
        return str(e)
    return None


def _check_tool_parser(args: argparse.Namespace) -> str | None:
    """What is wrong with --enable-auto-tool-choice and --tool-call-parser, as vLLM refuses them: the switch needs a
    parser; a parser must be one there is (one alone is taken, and 'auto' stays refused, as vLLM takes it)."""
    from loopserve.serve.tool_parsers import TOOL_PARSERS

    if args.enable_auto_tool_choice and args.tool_call_parser is None:
        return "--enable-auto-tool-choice: needs --tool-call-parser (the model's tool-call format: " \
               f"{', '.join(TOOL_PARSERS)})"
    return _unknown_parser("--tool-call-parser", args.tool_call_parser, TOOL_PARSERS)


def _check_template_kwargs(args: argparse.Namespace) -> str | None:
    """--default-chat-template-kwargs' variables as a request's are checked; the switches a request's may set
    (add_generation_prompt, continue_final_message) are each request's own."""
    flag = "--default-chat-template-kwargs"
    try:
        template_variables(args.default_chat_template_kwargs, flag)
    except ValueError as e:
        return str(e)
    switches = [n for n in TEMPLATE_SWITCHES if n in (args.default_chat_template_kwargs or {})]
    return f"{flag}.{switches[0]}: a request's own field, not a default" if switches else None


def _check_reasoning_parser(args: argparse.Namespace) -> str | None:
    """What is wrong with --reasoning-parser: a parser must be one there is."""
    from loopserve.serve.reasoning_parsers import REASONING_PARSERS

    return _unknown_parser("--reasoning-parser", args.reasoning_parser, REASONING_PARSERS)


def _unknown_parser(flag: str, name: str | None, registry: Mapping[str, Any]) -> str | None:
    """`flag`'s error where it names a parser `registry` lacks."""
    if name is not None and name not in registry:
        return f"{flag}: no parser {name!r} (choose from {', '.join(registry)})"
    return None


def _check_transport(args: argparse.Namespace) -> str | None:
    """The first thing wrong with --uds and the TLS flags: the files are read now, before the model loads."""
    tls = [f for f in ("ssl_keyfile", "ssl_certfile", "ssl_ca_certs", "ssl_ciphers") if getattr(args, f) is not None]
    if uses_ray(args) and (tls or args.uds is not None):
        flag = "--" + (tls[0] if tls else "uds").replace("_", "-")
        return f"{flag}: not with Ray Serve replicas (Ray Serve's proxies serve plain HTTP on --host and --port)"
    if args.ssl_cert_reqs not in (ssl.CERT_NONE, ssl.CERT_OPTIONAL, ssl.CERT_REQUIRED):
        return f"--ssl-cert-reqs: must be 0, 1 or 2, got {args.ssl_cert_reqs}"
    if args.ssl_ciphers is not None:
        try:
            ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER).set_ciphers(args.ssl_ciphers)
        except ssl.SSLError:
            return f"--ssl-ciphers: no cipher OpenSSL knows matches {args.ssl_ciphers!r}"
    if args.ssl_certfile is None and tls:
        return f"--{tls[0].replace('_', '-')}: needs --ssl-certfile (the server's certificate)"
    if args.ssl_cert_reqs != ssl.CERT_NONE and args.ssl_ca_certs is None:
        return "--ssl-cert-reqs: asks for client certificates, so needs --ssl-ca-certs to verify them by"
    if args.ssl_certfile is not None:
        for flag in ("ssl_certfile", "ssl_keyfile", "ssl_ca_certs"):  # (each file by its own flag: ssl's errors
            path = getattr(args, flag)  # name none)
            if path is not None:
                try:
                    Path(path).open("rb").close()
                except OSError as e:
                    return f"--{flag.replace('_', '-')}: cannot use it: {e.strerror or e}"
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        # (no passphrase: an encrypted key is refused here, not asked for on the terminal, as uvicorn would)
        pair = ("--ssl-certfile: cannot use it, with no --ssl-keyfile (the private key must then be in it, after the "
                "certificate)" if args.ssl_keyfile is None else
                "--ssl-certfile, --ssl-keyfile: cannot use them (a PEM certificate and its unencrypted private key)")
        loads = [(pair, lambda: context.load_cert_chain(args.ssl_certfile, args.ssl_keyfile, password=b""))]
        if args.ssl_ca_certs:
            loads.append(("--ssl-ca-certs: cannot use it", lambda: context.load_verify_locations(args.ssl_ca_certs)))
        for what, load in loads:
            try:
                load()
            except (OSError, ssl.SSLError) as e:
                return f"{what}: {e.strerror or e}"
    return None


DEFAULT_REPLICAS = 1  # without --replicas, and the least replicas autoscaling keeps without --min-replicas


def fixed_replicas(args: argparse.Namespace) -> int | None:
    """How many replicas these flags ask for, or None where they ask for autoscaling (--min-replicas or
    --max-replicas given: `replica_bounds`)."""
    if args.min_replicas is None and args.max_replicas is None:
        return args.replicas or DEFAULT_REPLICAS
    return None


def replica_bounds(args: argparse.Namespace) -> tuple[int, int]:
    """The least and most replicas these flags allow: --min-replicas (unset: `DEFAULT_REPLICAS`), --max-replicas
    (unset: the larger of that and --replicas)."""
    low = args.min_replicas if args.min_replicas is not None else DEFAULT_REPLICAS
    return low, args.max_replicas if args.max_replicas is not None else max(low, args.replicas or DEFAULT_REPLICAS)


def uses_ray(args: argparse.Namespace) -> bool:
    """Whether these flags ask for replicas on Ray Serve (else one engine in this process)."""
    return any(v is not None for v in (args.replicas, args.min_replicas, args.max_replicas, args.ray_address))


def load_server(args: argparse.Namespace) -> tuple[LLMEngine, ServerSettings]:
    """The engine and the `ServerSettings` these flags describe (ValueError on a bad model or bad flags):
    what this process serves, and what each Ray Serve replica loads (`serve/ray.py`)."""
    from loopserve.serve.api import ServerSettings, check_sampling_defaults, load_engine

    model = args.model_tag or args.model
    defaults = {k: getattr(args, k) for k in EXIT_FIELDS}
    engine, loaded = load_engine(model, chat_template=args.chat_template, generation_config=args.generation_config,
                                 **load_kwargs(args), **engine_kwargs(args))
    path = loaded.path
    # the model's generation_config.json sampling defaults, under the flags' own
    defaults = {**loaded.generation.sampling_defaults, **defaults}
    check_sampling_defaults(engine, defaults)
    if args.exit_policy == "kl":
        _warn_kl(engine)
    settings = ServerSettings(
        model_names=_served_names(args) or (str(model if model is not None else path.name),), model_path=str(path),
        expose_model_path=args.expose_model_path, api_keys=tuple(_api_keys(args.api_key)),
        max_queued_requests=args.max_queued_requests, max_body_bytes=args.max_request_body_bytes,
        sampling_defaults={k: v for k, v in defaults.items() if v is not None},
        max_tokens_cap=loaded.generation.max_tokens_cap,
        allowed_origins=tuple(args.allowed_origins), allowed_methods=tuple(args.allowed_methods),
        allowed_headers=tuple(args.allowed_headers), allow_credentials=args.allow_credentials,
        root_path=args.root_path, log_requests=args.enable_log_requests, max_log_len=args.max_log_len,
        stats_interval_s=None if args.disable_log_stats else args.log_stats_interval,
        tokenizer_info=args.enable_tokenizer_info_endpoint, openapi=not args.disable_fastapi_docs,
        return_tokens_as_token_ids=args.return_tokens_as_token_ids, metric_prefix=args.metric_prefix,
        server_load_tracking=args.enable_server_load_tracking,
        tool_parser=args.tool_call_parser if args.enable_auto_tool_choice else None,
        reasoning_parser=args.reasoning_parser, default_template_kwargs=args.default_chat_template_kwargs or {})
    return engine, settings


def model_refusal(args: argparse.Namespace, e: ValueError) -> CommandError:
    """`e`, a refusal of the flags or the model, as the command's `error:` line: one about a model given as the
    positional argument (`serve MODEL`, vLLM's form) names it `model`, not the --model flag the user did not type."""
    message = str(e)
    return CommandError(message, as_flag=not (args.model_tag is not None and message.startswith("model: ")))


def cmd_serve(args: argparse.Namespace) -> int:
    problem = _check(args)
    if problem is not None:
        raise CommandError(problem)
    logging.basicConfig(level=args.log_level.upper(), format=LOG_FORMAT)
    if uses_ray(args):  # imported only here: the single-process server never loads Ray
        from loopserve.serve.ray import run_replicas

        return run_replicas(args)
    # uvicorn shuts down gracefully on SIGTERM/SIGINT, then re-raises the signal: exit quietly then (set before the
    # model loads: a signal meanwhile still runs the clean-up below)
    signal.signal(signal.SIGTERM, _exit_with(0))
    signal.signal(signal.SIGINT, _exit_with(130))
    # (before the model loads: a port in use is said at once)
    listener = listen(args.host, args.port) if args.uds is None else listen_unix(args.uds)
    if args.uds is None:
        args.port = listener.getsockname()[1]  # (--port 0: the one the system gave, as logged below)
    own = os.stat(args.uds).st_ino if args.uds is not None else None
    try:
        return _serve_on(listener, args)
    finally:
        listener.close()
        if args.uds is not None:  # (uvicorn leaves the file of a socket it was handed): ours, not a later server's
            with contextlib.suppress(OSError):
                if os.stat(args.uds).st_ino == own:
                    os.unlink(args.uds)


def _serve_on(listener: socket.socket, args: argparse.Namespace) -> int:
    """`cmd_serve` once its socket is bound: load the model, then serve until a signal or the engine's death."""
    import uvicorn

    from loopserve.serve.api import build_app
    from loopserve.serve.connection import GracefulServer, read_timeout_protocol

    try:
        engine, settings = load_server(args)
    except ValueError as e:
        raise model_refusal(args, e) from None
    engine_failed = False

    def stop_serving() -> None:  # on the event loop, once the engine thread has died
        nonlocal engine_failed
        engine_failed = True
        server.should_exit = True  # uvicorn's graceful stop, as on SIGTERM

    app = build_app(engine, settings, on_engine_dead=stop_serving)
    log.info("%s", app.state.serving.summary())
    scheme = "https" if args.ssl_certfile else "http"
    where = url_base(scheme, args.host, args.port) if args.uds is None else f"{scheme} on unix:{args.uds}"
    log.info("serving on %s%s (API keys: %d, CORS origins: %s)", where, args.root_path, len(settings.api_keys),
             ", ".join(settings.allowed_origins) or "none")
    uvicorn_level = args.uvicorn_log_level or args.log_level
    # ws="none": there are no WebSocket endpoints, so an upgrade request is read as plain HTTP
    # the grace period's end: the app answers what is still running (503) before uvicorn cancels it
    server = GracefulServer(uvicorn.Config(app, host=args.host, port=args.port, log_level=uvicorn_level,
                                           log_config=uvicorn_log_config(uvicorn_level,
                                                                         args.disable_access_log_for_endpoints),
                                           access_log=not args.no_access_log,
                                           timeout_graceful_shutdown=args.shutdown_timeout,
                                           http=read_timeout_protocol(args.request_read_timeout), ws="none",
                                           ssl_keyfile=args.ssl_keyfile, ssl_certfile=args.ssl_certfile,
                                           ssl_ca_certs=args.ssl_ca_certs, ssl_cert_reqs=args.ssl_cert_reqs,
                                           **({} if args.ssl_ciphers is None else {"ssl_ciphers": args.ssl_ciphers})),
                            on_deadline=app.state.serving.abort_in_flight)
    try:
        server.run(sockets=[listener])
    except OSError as e:  # (another server took the port while the model loaded: bound, it listens only now)
        flag, where = ("--uds", args.uds) if args.uds is not None else ("--port", host_port(args.host, args.port))
        raise CommandError(f"{flag}: cannot listen on {where}: {e.strerror or e}") from None
    if engine_failed:
        print("error: the engine failed (see the log above); the server has stopped", file=sys.stderr, flush=True)
        return 1
    return 0 if server.started else 1


def host_port(host: str, port: int) -> str:
    """`host:port`, an IPv6 host in brackets (as a client must write it: `[::]:8000`, not `:::8000`)."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def url_base(scheme: str, host: str, port: int) -> str:
    """The server's address as a URL's start."""
    return f"{scheme}://{host_port(host, port)}"


def listen(host: str, port: int) -> socket.socket:
    """The server's socket, bound before the model loads, as vLLM binds it (one address: IPv6 for a host with a
    colon, else IPv4; SO_REUSEADDR), or a CommandError naming the flag: a port in use or a host that does not
    resolve was reported only after the model had loaded, under a "serving on" line."""
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except socket.gaierror as e:
        sock.close()
        raise CommandError(f"--host: {host!r} is not an address of this machine ({e.strerror})") from None
    except OSError as e:
        sock.close()
        flag = "--port" if e.errno in (errno.EADDRINUSE, errno.EACCES) else "--host"
        raise CommandError(f"{flag}: cannot listen on {host_port(host, port)}: {e.strerror}") from None
    return sock


def listen_unix(path: str) -> socket.socket:
    """The server's Unix domain socket at `path`, open to every user of the machine as uvicorn makes it (0666: a
    proxy running as another user connects), or a CommandError naming --uds. A socket file that an earlier server
    left there is replaced; one a live server answers on, or any other kind of file, is not."""
    if os.path.lexists(path):
        if not stat.S_ISSOCK(os.lstat(path).st_mode):
            raise CommandError(f"--uds: {path} exists and is not a socket")
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
            try:
                probe.connect(path)
            except OSError:  # nobody listens: a stale file
                os.unlink(path)
            else:
                raise CommandError(f"--uds: a server is listening on {path}")
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.bind(path)
        os.chmod(path, 0o666)
        sock.listen()  # (now, not once the model has loaded: a second server's probe finds this one)
    except OSError as e:
        sock.close()
        raise CommandError(f"--uds: cannot listen on {path}: {e.strerror or e}") from None
    return sock



def _warn_kl(engine: LLMEngine) -> None:
    """--exit-policy kl's cost, said at start-up: every request that keeps the default runs the coda (and LM head)
    after every loop, and, on a model with coda layers, decodes without speculative drafts."""
    spec = engine.cfg.num_speculative_tokens and engine.model_config.n_coda > 0
    log.warning("--exit-policy kl: every request that does not pick another exit_policy runs the coda and LM head "
                "after every loop (the KL signal), an expensive default%s",
                "; and speculative decoding is off for those requests (the KL signal reads the coda KV of every loop)"
                if spec else "")


def _served_names(args: argparse.Namespace) -> tuple[str, ...]:
    """The --served-model-name names, empty ones left out (an unset variable in a script): none, the model's."""
    return tuple(n for n in args.served_model_name or () if n)


def _api_keys(flags: list[str] | None) -> list[str]:
    """The accepted keys: the --api-key values, else the first of `API_KEY_ENVS` set (flags win, as in vLLM; an empty
    one, say an unset variable's, is no key, so it falls back to the variables as vLLM's does, with a warning: a
    server meant to need a key should not quietly take requests without one)."""
    keys = [k for k in flags or () if k]
    if keys:
        return keys
    name, env = next(((n, os.environ[n]) for n in API_KEY_ENVS if os.environ.get(n)), (None, None))
    if flags:
        log.warning("--api-key: only empty keys given (an unset variable?); %s", f"taking ${name}" if env else
                    "the server takes requests without a key")
    return [env] if env else []


def _exit_with(code: int):
    def handler(signum, frame):
        raise SystemExit(code)

    return handler
