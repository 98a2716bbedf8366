"""`loopserve bench peer`: the upstream Hugging Face remote code side by side with loopserve.

This module owns the peer comparison: loading a checkpoint with the user's copy of the upstream
modeling code (`modeling_ouro.py` / `raven_modeling_minimal.py`; never shipped with loopserve),
running HF `generate` in arrival-order static batches, running loopserve's CB at full depth and
CDB refill at the workload's exit depths on the same prompts, the greedy-output check, and the
report (JSON, markdown, PNG).

How the HF side is loaded: the checkpoint's files are linked into a temporary folder next to a
copy of every `.py` file of the user's code folder, `config.json` gets the `auto_map` of the
architecture, and `AutoModelForCausalLM.from_pretrained(..., trust_remote_code=True)` loads it.
That is the path a user of the released checkpoints takes (their folders carry the same files),
and the checkpoint folder itself is never written to.

What is compared (all on one torch thread, the CPU clock `time.process_time`):

* HF: `generate` greedy, static batches of `hf_batch` requests in arrival order, left padding,
  `max_new_tokens` = the longest output in the batch, EOS disabled (outputs have the workload's
  lengths, as loopserve's `ignore_eos`). A static batch runs until its longest request is done:
  the padding and the finished rows' steps are HF's cost, so tokens/s counts only the requests'
  own tokens. The upstream Ouro code always runs every loop, so it is at full depth whatever
  exit depths the workload has.
* CB: loopserve's full-depth continuous batching, width `width`.
* CDB: loopserve's continuous depth batching with refill, replaying the workload's exit depths.

The systems run interleaved (HF, CB, CDB, HF, ...) so that a slow spell of a shared machine hits
all of them alike; a ratio is the median over rounds of the ratio within a round.

Greedy check: both sides in float32 on the first `check_requests` requests of each workload
(HF in one static batch), token ids compared request by request. The upstream Huginn code ignores
the attention mask (its padded rows attend to the padding), so for Huginn the check is meaningful
only on uniform lengths; both sides start the recurrence from a zero state there (the upstream
random initial state cannot be reproduced).
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import hashlib
import json
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from loopserve.cli import CommandError
from loopserve.config_args import flag_of
from loopserve.model_config import HUGINN, OURO

TESTED_TRANSFORMERS = "4.57.6"

# Per architecture: the modeling file and the config file the user's folder must hold, the auto_map that points
# transformers at them, what its `generate` needs to run as loopserve runs (Huginn: a zero initial state, as
# loopserve's --state-init zero), and whether it reads the attention mask (the upstream Huginn code does not).
ARCH_CODE: dict[str, dict[str, Any]] = {
    OURO: {"files": ("modeling_ouro.py", "configuration_ouro.py"),
           "auto_map": {"AutoConfig": "configuration_ouro.OuroConfig",
                        "AutoModelForCausalLM": "modeling_ouro.OuroForCausalLM"},
           "generate_kwargs": {}, "reads_mask": True},
    HUGINN: {"files": ("raven_modeling_minimal.py", "raven_config_minimal.py"),
             "auto_map": {"AutoConfig": "raven_config_minimal.RavenConfig",
                          "AutoModelForCausalLM": "raven_modeling_minimal.RavenForCausalLM"},
             "generate_kwargs": {"init_scale": 0.0}, "reads_mask": False},
}
SYSTEMS = ("hf", "cb", "cdb")
LABELS = {"hf": "HF generate", "cb": "loopserve CB (full depth)", "cdb": "loopserve CDB refill"}
TORCH_DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32, "float64": torch.float64}


class PeerError(Exception):
    """A missing prerequisite, said in one line (the CLI prints it and exits 2)."""


# --------------------------------------------------------------------------------------------------
# Configuration and prerequisites
# --------------------------------------------------------------------------------------------------


@dataclass
class PeerConfig:
    hf_code: Path  # the folder holding the upstream modeling / config files
    workloads: tuple[str, ...] = ("uniform", "alpaca")
    num_requests: int = 64
    prompt_len: int = 32  # uniform workload
    output_len: int = 64  # uniform workload
    scale: float = 1.0  # alpaca workload
    workload_seed: int = 0
    hf_batch: int = 32
    width: int = 32  # loopserve's max decode batch
    repeats: int = 3
    check: bool = True  # greedy outputs, float32
    check_requests: int = 32

    def __post_init__(self) -> None:
        bad = [w for w in self.workloads if w not in ("uniform", "alpaca")]
        if bad or not self.workloads:
            raise PeerError(f"--workloads: expected a comma list of uniform, alpaca; got {','.join(self.workloads)!r}")
        for name in ("num_requests", "prompt_len", "output_len", "hf_batch", "width", "repeats"):
            if getattr(self, name) < 1:
                raise PeerError(f"{flag_of(name)} must be >= 1")
        if self.check_requests < 0:
            raise PeerError("--check-requests must be >= 0")
        if self.scale <= 0:
            raise PeerError("--scale must be > 0")


@dataclass
class PeerCode:
    folder: Path
    arch: str
    files: list[Path]  # every .py of the folder (the modeling file may import siblings)

    @property
    def digests(self) -> dict[str, str]:
        """sha256 of each file: which version of the upstream code a report measured (copies differ)."""
        return {f.name: hashlib.sha256(f.read_bytes()).hexdigest() for f in self.files}


def check_peer_code(folder: Path | str | None, arch: str) -> PeerCode:
    """The user's upstream code folder for `arch`, or a PeerError naming what is missing."""
    if arch not in ARCH_CODE:
        raise PeerError(f"bench peer supports Ouro and Huginn checkpoints, not {arch}")
    need = ARCH_CODE[arch]["files"]
    if folder is None:
        raise PeerError(f"--hf-code: give the folder holding the upstream {' and '.join(need)}")
    path = Path(folder)
    if not path.is_dir():
        raise PeerError(f"--hf-code {folder}: not a folder (it must hold {' and '.join(need)})")
    missing = [f for f in need if not (path / f).is_file()]
    if missing:
        raise PeerError(f"--hf-code {folder}: missing {', '.join(missing)} (a {arch} checkpoint needs the "
                        f"upstream {' and '.join(need)})")
    return PeerCode(path, arch, sorted(path.glob("*.py")))


def require_transformers() -> str:
    """transformers' version, or a PeerError saying how to install it."""
    try:
        import transformers
    except ImportError:
        raise PeerError("bench peer runs the upstream Hugging Face code and needs transformers (tested with "
                        f"{TESTED_TRANSFORMERS}): pip install transformers=={TESTED_TRANSFORMERS}") from None
    version = str(transformers.__version__)
    if version != TESTED_TRANSFORMERS:
        print(f"warning: transformers {version}; bench peer was tested with {TESTED_TRANSFORMERS}", file=sys.stderr)
    return version


# --------------------------------------------------------------------------------------------------
# The HF side
# --------------------------------------------------------------------------------------------------


@contextlib.contextmanager
def remote_code_folder(checkpoint: Path, code: PeerCode) -> Iterator[Path]:
    """A temporary folder that looks like a released checkpoint: the checkpoint's files (linked),
    the user's code (copied: transformers copies it again into its module cache) and a config.json
    whose auto_map names that code."""
    with tempfile.TemporaryDirectory(prefix="loopserve-peer-") as tmp:
        root = Path(tmp) / f"{checkpoint.name}-hf"  # transformers names the module package after it
        root.mkdir()
        for f in checkpoint.iterdir():
            if f.is_file() and f.name != "config.json" and f.suffix != ".py":
                (root / f.name).symlink_to(f.resolve())
        for f in code.files:
            shutil.copy2(f, root / f.name)
        config = json.loads((checkpoint / "config.json").read_text())
        config["auto_map"] = dict(ARCH_CODE[code.arch]["auto_map"])
        (root / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        yield root


@dataclass
class HFPeer:
    model: Any
    arch: str
    pad_id: int
    dtype: str

    @staticmethod
    def load(checkpoint: Path, code: PeerCode, dtype: str) -> HFPeer:
        from transformers import AutoModelForCausalLM

        with remote_code_folder(checkpoint, code) as root:
            model = AutoModelForCausalLM.from_pretrained(root, trust_remote_code=True, dtype=TORCH_DTYPES[dtype])
        model.eval()
        # transformers fills every unset field of a given GenerationConfig from the model's own
        # (EOS included), so EOS is switched off there: rows never stop early, as loopserve's ignore_eos.
        model.generation_config.eos_token_id = None
        pad = model.config.pad_token_id
        return HFPeer(model, code.arch, int(pad) if pad is not None else 0, dtype)

    def generate(self, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
        """Greedy continuation of one static batch (left padding); every row gets `max_new_tokens`."""
        from transformers import GenerationConfig

        width = max(len(p) for p in prompts)
        ids = torch.full((len(prompts), width), self.pad_id, dtype=torch.long)
        mask = torch.zeros((len(prompts), width), dtype=torch.long)
        for i, p in enumerate(prompts):
            ids[i, width - len(p):] = torch.tensor(p, dtype=torch.long)
            mask[i, width - len(p):] = 1
        # No EOS (see `load`): a minimum length would instead mask EOS out of the logits and change
        # greedy choices.
        gen = GenerationConfig(do_sample=False, max_new_tokens=max_new_tokens, min_new_tokens=0,
                               eos_token_id=None, pad_token_id=self.pad_id, use_cache=True)
        with torch.inference_mode():
            out = self.model.generate(input_ids=ids, attention_mask=mask, generation_config=gen,
                                      **ARCH_CODE[self.arch]["generate_kwargs"])
        return [row[width:].tolist() for row in out]


def static_batches(workload: Any, batch: int) -> list[list[int]]:
    """Request indices in arrival order, `batch` at a time."""
    n = len(workload.requests)
    return [list(range(i, min(i + batch, n))) for i in range(0, n, batch)]


@dataclass
class SystemRun:
    system: str
    tokens: int  # the requests' own output tokens
    cpu_s: float
    wall_s: float
    computed_tokens: int = 0  # rows x steps actually generated (HF's static batches compute more)
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def cpu_tokens_per_s(self) -> float:
        return self.tokens / self.cpu_s if self.cpu_s > 0 else float("nan")

    @property
    def wall_tokens_per_s(self) -> float:
        return self.tokens / self.wall_s if self.wall_s > 0 else float("nan")

    def to_json(self) -> dict[str, Any]:
        return {**asdict(self), "cpu_tokens_per_s": self.cpu_tokens_per_s,
                "wall_tokens_per_s": self.wall_tokens_per_s}


def run_hf(hf: HFPeer, workload: Any, batch: int, progress: bool = False) -> tuple[SystemRun, list[list[int]]]:
    """The workload through HF generate in arrival-order static batches; (run, outputs)."""
    from tqdm import tqdm

    outputs: list[list[int]] = [[] for _ in workload.requests]
    computed = 0
    batches = static_batches(workload, batch)
    c0, t0 = time.process_time(), time.perf_counter()
    for idx in tqdm(batches, desc="HF generate", disable=not progress, leave=False):
        reqs = [workload.requests[i] for i in idx]
        steps = max(r.output_len for r in reqs)
        rows = hf.generate([r.prompt_ids for r in reqs], steps)
        computed += steps * len(reqs)
        for i, r, row in zip(idx, reqs, rows, strict=True):
            outputs[i] = row[:r.output_len]
    cpu, wall = time.process_time() - c0, time.perf_counter() - t0
    run = SystemRun("hf", workload.output_tokens, cpu, wall, computed, {"batches": len(batches), "batch": batch})
    return run, outputs


def _hf_run(hf: HFPeer, workload: Any, batch: int, progress: bool) -> SystemRun:
    return run_hf(hf, workload, batch, progress)[0]


def run_loopserve(bm: Any, workload: Any, traces: list[list[int]] | None, system: str, width: int,
                  progress: bool = False, **engine_overrides: Any) -> SystemRun:
    """CB at full depth (`traces` None) or CDB refill replaying `traces`, via the bench harness."""
    from loopserve_lab.bench.harness import run_offline

    scheduler = {"cb": "cb", "cdb": "cdb"}[system]
    r = run_offline(bm, workload, traces if system == "cdb" else None, scheduler, width, progress=progress,
                    desc=LABELS[system], **engine_overrides)
    if r.errors:
        raise RuntimeError(f"{system}: {r.errors} requests ended with an error")
    return SystemRun(system, r.generated_tokens, r.cpu_s, r.wall_s, r.generated_tokens,
                     {"mean_exit_depth": r.mean_exit_depth, "ticks": r.ticks, "decode_items": r.decode_items})


def loopserve_outputs(bm: Any, workload: Any, width: int, **engine_overrides: Any) -> list[list[int]]:
    """Greedy full-depth token ids of every request, from loopserve's CB."""
    from loopserve_lab.bench.harness import add_workload, engine_kwargs_for

    engine = bm.engine(**engine_kwargs_for(workload, width, scheduler="cb", **engine_overrides))
    ids = add_workload(engine, workload, None)
    done: dict[str, list[int]] = {}
    with torch.inference_mode():
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished:
                    if out.error:
                        raise RuntimeError(f"{out.request_id}: {out.error}")
                    done[out.request_id] = list(out.outputs[0].token_ids)
    return [done[i] for i in ids]


# --------------------------------------------------------------------------------------------------
# Interleaved measurement and summaries
# --------------------------------------------------------------------------------------------------


def interleave(systems: dict[str, Callable[[], SystemRun]], repeats: int,
               on_run: Callable[[int, SystemRun], None] | None = None) -> dict[str, list[SystemRun]]:
    """Each system once per round, in the given order, for `repeats` rounds."""
    runs: dict[str, list[SystemRun]] = {s: [] for s in systems}
    for rep in range(repeats):
        for name, fn in systems.items():
            run = fn()
            runs[name].append(run)
            if on_run is not None:
                on_run(rep, run)
    return runs


def summarize(runs: dict[str, list[SystemRun]], base: str = "hf") -> list[dict[str, Any]]:
    """One row per system: median tokens/s (CPU and wall) and the median within-round ratio to `base`."""
    rows = []
    for name, rs in runs.items():
        row: dict[str, Any] = {"system": name, "label": LABELS.get(name, name), "rounds": len(rs),
                               "tokens": rs[0].tokens, "computed_tokens": rs[0].computed_tokens,
                               "extra": rs[0].extra}
        for clock in ("cpu", "wall"):
            vals = [getattr(r, f"{clock}_tokens_per_s") for r in rs]
            row[f"{clock}_tokens_per_s"] = statistics.median(vals)
            row[f"{clock}_tokens_per_s_runs"] = vals
            if base in runs:
                ratios = [getattr(r, f"{clock}_tokens_per_s") / getattr(b, f"{clock}_tokens_per_s")
                          for r, b in zip(rs, runs[base], strict=True)]
                row[f"{clock}_vs_{base}"] = statistics.median(ratios)
                row[f"{clock}_vs_{base}_runs"] = ratios
        rows.append(row)
    return rows


def compare_outputs(hf: list[list[int]], ours: list[list[int]]) -> dict[str, Any]:
    """Requests whose token ids are identical, and where the others first differ."""
    first_diff = []
    for a, b in zip(hf, ours, strict=True):
        if a == b:
            continue
        k = next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))
        first_diff.append(k)
    return {"requests": len(hf), "identical": len(hf) - len(first_diff), "tokens": sum(len(x) for x in hf),
            "first_difference_at": first_diff}


def format_rows(rows: list[dict[str, Any]], workload: str) -> str:
    head = f"{'workload':<9}{'system':<28}{'tok/s cpu':>10}{'/HF cpu':>9}{'tok/s wall':>11}{'/HF wall':>9}{'depth':>7}"
    lines = [head, "-" * len(head)]
    for r in rows:
        d = r["extra"].get("mean_exit_depth")
        nan = float("nan")
        lines.append(f"{workload:<9}{r['label']:<28}{r['cpu_tokens_per_s']:>10.1f}{r.get('cpu_vs_hf', nan):>9.3f}"
                     f"{r['wall_tokens_per_s']:>11.1f}{r.get('wall_vs_hf', nan):>9.3f}"
                     f"{(f'{d:.2f}' if d is not None else '-'):>7}")
    return "\n".join(lines)


def write_markdown(path: Path, report: dict[str, Any]) -> Path:
    lines = ["# bench peer: upstream HF remote code vs loopserve", "", "```bash", report["command"], "```", "",
             f"{report['date']}; model `{report['model']['name']}` ({report['model']['dtype']}), "
             f"transformers {report['transformers']}, torch {report['machine']['torch']}, "
             f"{report['machine']['torch_threads']} torch thread(s), CPU clock, {report['config']['repeats']} "
             f"interleaved rounds (medians; ratios are medians of within-round ratios). Upstream code: "
             + ", ".join(f"`{name}` sha256 {digest[:12]}" for name, digest in report["hf_code_sha256"].items())
             + ".", "",
             "| workload | system | tok/s (CPU) | / HF (CPU) | tok/s (wall) | / HF (wall) | mean exit depth |",
             "|---|---|---|---|---|---|---|"]
    for name, body in report["workloads"].items():
        for r in body["rows"]:
            d = r["extra"].get("mean_exit_depth")
            lines.append(f"| {name} | {r['label']} | {r['cpu_tokens_per_s']:.1f} | {r['cpu_vs_hf']:.2f}x | "
                         f"{r['wall_tokens_per_s']:.1f} | {r['wall_vs_hf']:.2f}x | "
                         f"{f'{d:.2f}' if d is not None else 'full'} |")
    lines.append("")
    for name, body in report["workloads"].items():
        s = body["summary"]
        lines.append(f"- {name}: {s['requests']} requests, prompt mean {s['prompt_mean']:.1f}, output mean "
                     f"{s['output_mean']:.1f} (max {s['output_max']}); HF computes "
                     f"{body['rows'][0]['computed_tokens']} row-steps for {body['rows'][0]['tokens']} tokens.")
        chk = body.get("greedy_check")
        if chk:
            lines.append(f"  Greedy check (float32, first {chk['requests']} requests): {chk['identical']} of "
                         f"{chk['requests']} identical ({chk['tokens']} tokens).")
    path.write_text("\n".join(lines) + "\n")
    return path


def plot_report(path: Path, report: dict[str, Any]) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(report["workloads"])
    fig, ax = plt.subplots(figsize=(6.5, 4))
    colors = {"hf": "#d62728", "cb": "#7f7f7f", "cdb": "#1f77b4"}
    w = 0.8 / len(SYSTEMS)
    for j, s in enumerate(SYSTEMS):
        vals = [next((r["cpu_tokens_per_s"] for r in report["workloads"][n]["rows"] if r["system"] == s), 0.0)
                for n in names]
        xs = [i + (j - (len(SYSTEMS) - 1) / 2) * w for i in range(len(names))]
        ax.bar(xs, vals, w, label=LABELS[s], color=colors[s])
        for x, v, n in zip(xs, vals, names, strict=True):
            ratio = next((r["cpu_vs_hf"] for r in report["workloads"][n]["rows"] if r["system"] == s), None)
            if ratio is not None:
                ax.text(x, v, f"{ratio:.2f}x", ha="center", va="bottom", fontsize=8)
    ax.set_xticks(range(len(names)), names)
    ax.set_ylabel("output tokens/s (CPU clock)")
    ax.set_title(f"{report['model']['name']} ({report['model']['dtype']}): HF generate (batch "
                 f"{report['config']['hf_batch']}) vs loopserve", fontsize=10)
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3, axis="y")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


# --------------------------------------------------------------------------------------------------
# The command
# --------------------------------------------------------------------------------------------------


def peer_config(args: argparse.Namespace) -> PeerConfig:
    return PeerConfig(hf_code=args.hf_code, workloads=tuple(w.strip() for w in args.workloads.split(",") if w.strip()),
                      num_requests=args.num_requests, prompt_len=args.prompt_len, output_len=args.output_len,
                      scale=args.scale, workload_seed=args.workload_seed, hf_batch=args.hf_batch, width=args.width,
                      repeats=args.repeats, check=not args.no_check, check_requests=args.check_requests)


def build_peer_workload(kind: str, cfg: PeerConfig, bm: Any) -> Any:
    from loopserve_lab.bench.workloads import make_workload

    wl = make_workload("fixed" if kind == "uniform" else kind, cfg.num_requests, bm.tokenizer, cfg.workload_seed,
                       cfg.scale, max_model_len=int(bm.config.max_position), prompt_len=cfg.prompt_len,
                       output_len=cfg.output_len)
    wl.name = kind
    return wl


def cmd_peer(args: argparse.Namespace) -> int:
    try:
        return _peer(args)
    except PeerError as e:
        raise CommandError(str(e)) from None


def _peer(args: argparse.Namespace) -> int:
    import matplotlib  # noqa: F401  (the plot comes last: a missing [bench] extra is said before the runs, not after)

    from loopserve.model_config import ModelConfig
    from loopserve_lab.bench.cli import DEFAULT_OUT, _header, build_traces, check_depth_args, engine_overrides
    from loopserve_lab.bench.harness import BenchModel, set_threads, write_json
    from loopserve_lab.bench.presets import resolve_model

    cfg = peer_config(args)
    check_depth_args(args)
    try:
        path = resolve_model(args.model)
    except ValueError as e:
        raise PeerError(str(e)) from None
    config = ModelConfig.from_hf(json.loads((path / "config.json").read_text()))
    arch = config.arch
    code = check_peer_code(cfg.hf_code, arch)  # before the heavy imports: a wrong folder fails at once
    tf_version = require_transformers()
    if args.dtype == "float16":
        raise PeerError("--dtype float16 is not supported on the CPU (about 100x slower there)")
    set_threads(args.threads)
    out = args.out or DEFAULT_OUT / "peer"
    out.mkdir(parents=True, exist_ok=True)
    progress = not args.no_progress
    ov = engine_overrides(args)
    # a model that draws its initial loop state starts from zero on both sides (ARCH_CODE's generate_kwargs)
    state_init = "zero" if config.state_init is not None else args.state_init

    print(f"loading {path} ({args.dtype}): loopserve and HF ({code.folder})", file=sys.stderr)
    bm = BenchModel.load(str(path), args.dtype, "cpu", state_init)
    hf = HFPeer.load(path, code, args.dtype)
    report: dict[str, Any] = {**_header(args, bm), "transformers": tf_version, "hf_code": str(code.folder),
                              "hf_code_sha256": code.digests,
                              "config": {k: (str(v) if isinstance(v, Path) else v) for k, v in asdict(cfg).items()},
                              "clock": "process CPU time (time.process_time), one torch thread unless --threads",
                              "workloads": {}}
    report_path = out / "peer.json"

    workloads = {kind: build_peer_workload(kind, cfg, bm) for kind in cfg.workloads}
    _warm_up(hf, bm, next(iter(workloads.values())), cfg, ov)
    for kind, wl in workloads.items():
        traces, depth_desc = build_traces(args, bm, wl)
        s = wl.summary()
        print(f"workload {kind}: {s['requests']} requests, prompt mean {s['prompt_mean']:.1f}, output mean "
              f"{s['output_mean']:.1f} (max {s['output_max']}); CDB depths: {depth_desc}", file=sys.stderr)
        body: dict[str, Any] = {"summary": s, "depths": depth_desc, "runs": []}
        report["workloads"][kind] = body
        systems: dict[str, Callable[[], SystemRun]] = {
            "hf": functools.partial(_hf_run, hf, wl, cfg.hf_batch, progress),
            "cb": functools.partial(run_loopserve, bm, wl, None, "cb", cfg.width, progress, **ov),
            "cdb": functools.partial(run_loopserve, bm, wl, traces, "cdb", cfg.width, progress, **ov),
        }

        def on_run(rep: int, run: SystemRun, body: dict[str, Any] = body, kind: str = kind) -> None:
            body["runs"].append({"round": rep, **run.to_json()})
            print(f"{kind} round {rep + 1}: {LABELS[run.system]}: {run.cpu_tokens_per_s:.1f} tok/s CPU "
                  f"({run.cpu_s:.1f} s), {run.wall_tokens_per_s:.1f} tok/s wall", file=sys.stderr)
            write_json(report_path, report)

        runs = interleave(systems, cfg.repeats, on_run)
        body["rows"] = summarize(runs)
        print(format_rows(body["rows"], kind))
        write_json(report_path, report)
    if cfg.check and cfg.check_requests:
        _greedy_check(report, workloads, path, code, cfg, ov, state_init)
        write_json(report_path, report)
    print(f"wrote {report_path}, {write_markdown(out / 'peer.md', report)}, {plot_report(out / 'peer.png', report)}",
          file=sys.stderr)
    return 0


def _warm_up(hf: HFPeer, bm: Any, wl: Any, cfg: PeerConfig, ov: dict[str, Any]) -> None:
    """One short pass of each side first, so that one-time costs (kernel selection, allocator
    growth, lazy imports) land in no measured run."""
    from loopserve_lab.bench.workloads import Request, Workload

    reqs = [Request(r.prompt_ids, min(r.output_len, 4)) for r in wl.requests[:cfg.hf_batch]]
    small = Workload("warm-up", reqs)
    run_hf(hf, small, cfg.hf_batch)
    run_loopserve(bm, small, None, "cb", cfg.width, **ov)


def _greedy_check(report: dict[str, Any], workloads: dict[str, Any], path: Path, code: PeerCode, cfg: PeerConfig,
                  ov: dict[str, Any], state_init: str | None) -> None:
    from loopserve_lab.bench.harness import BenchModel
    from loopserve_lab.bench.workloads import Workload

    print("greedy check in float32", file=sys.stderr)
    bm32 = BenchModel.load(str(path), "float32", "cpu", state_init)
    hf32 = HFPeer.load(path, code, "float32")
    for kind, wl in workloads.items():
        sub = Workload(wl.name, wl.requests[:cfg.check_requests])
        hf_out = run_hf(hf32, sub, cfg.check_requests)[1]
        ours = loopserve_outputs(bm32, sub, cfg.width, **ov)
        chk = compare_outputs(hf_out, ours)
        chk["note"] = ("one HF static batch, left padded" if kind != "uniform" else "one HF static batch")
        if not ARCH_CODE[code.arch]["reads_mask"] and kind != "uniform":
            chk["note"] += "; the upstream Huginn code ignores the attention mask, so padded rows differ"
        report["workloads"][kind]["greedy_check"] = chk
        print(f"greedy check {kind}: {chk['identical']} of {chk['requests']} requests identical", file=sys.stderr)


def add_peer_args(p: argparse.ArgumentParser) -> None:
    """The peer command's own flags (the model, depth and engine flags come from the bench CLI)."""
    g = p.add_argument_group("peer")
    g.add_argument("--hf-code", type=Path, default=None,
                   help="folder holding the upstream modeling_ouro.py + configuration_ouro.py "
                        "(Ouro) or raven_modeling_minimal.py + raven_config_minimal.py (Huginn)")
    g.add_argument("--workloads", default="uniform,alpaca", help="comma list of: uniform, alpaca")
    g.add_argument("--num-requests", type=int, default=64)
    g.add_argument("--prompt-len", type=int, default=32, help="uniform workload")
    g.add_argument("--output-len", type=int, default=64, help="uniform workload")
    g.add_argument("--scale", type=float, default=1.0, help="alpaca workload: multiply the published mean lengths")
    g.add_argument("--workload-seed", type=int, default=0)
    g.add_argument("--hf-batch", type=int, default=32, help="HF static batch size (arrival order)")
    g.add_argument("--width", type=int, default=32, help="loopserve max decode batch")
    g.add_argument("--repeats", type=int, default=3, help="interleaved rounds (HF, CB, CDB)")
    g.add_argument("--no-check", action="store_true", help="skip the float32 greedy-output check")
    g.add_argument("--check-requests", type=int, default=32, help="requests per workload in the greedy check")
