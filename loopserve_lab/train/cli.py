"""Command line for the embedded model: `loopserve train-tiny` and `loopserve eval ppl|trajectories`."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import TYPE_CHECKING

from loopserve.cli import CommandError, output_file, output_folder, positive_int
from loopserve.config_args import add_config_args, config_kwargs

if TYPE_CHECKING:
    from loopserve.models.loader import LoadedModel

# Where `eval` writes unless told: a folder of the current directory, so that a run from the repository's root
# never overwrites the committed docs/ files (docs/embedded-model.md passes those paths when it means them).
EVAL_OUT = Path("eval-results")
SAMPLE_PROMPTS = ("ROMEO:\nBut soft, what light", "KING HENRY:\nOnce more unto the", "HAMLET:\n",
                  "First Citizen:\nWe are accounted poor citizens,")


def cmd_train_tiny(args: argparse.Namespace) -> int:
    from loopserve_lab.train.train_tiny import TrainConfig, train

    out = Path(args.out)
    if out.is_dir() and any(out.iterdir()) and not args.overwrite:  # (before the training, not after it)
        raise CommandError(f"{out}: the folder is not empty (a checkpoint there would be replaced); give a new or "
                           "empty folder, or --overwrite")
    try:
        cfg = TrainConfig(**{**config_kwargs(args, TrainConfig), "out": str(out)})  # (as written in its JSON)
        train(cfg, progress=not args.no_progress)
    except (ValueError, RuntimeError) as e:
        raise CommandError(str(e)) from None
    return 0


def _model(args) -> str:
    """The model folder to evaluate (the embedded model unless given), or a CommandError (`error:` line, exit 2)
    if it is not a checkpoint folder of an Ouro model: checked before anything runs, as `load_model` would refuse
    it. Both evaluations read Ouro's learned exit gate, which Huginn has not (its like-init state would fail first,
    in `score_windows`, which gives its prelude no per-row seeds)."""
    from loopserve.json_files import read_json_object
    from loopserve.model_config import OURO, ModelConfig
    from loopserve.models.loader import embedded_model_path, resolve_model_path

    model = str(args.model or embedded_model_path())
    try:
        folder = resolve_model_path(model)  # (a hub id is fetched here, as the loader would)
        cfg_path = folder / "config.json"
        if not cfg_path.is_file():
            raise CommandError(f"model: {model!r} is not a checkpoint folder ({cfg_path}: missing)")
        arch = ModelConfig.from_hf(read_json_object(cfg_path), str(cfg_path)).arch
    except ValueError as e:
        raise CommandError(str(e)) from None
    if arch != OURO:
        raise CommandError(f"model: {model!r} is a {arch} checkpoint; `loopserve eval` evaluates {OURO} checkpoints "
                           "only (its exit depths come from Ouro's learned exit gate)")
    return model


def _load(model: str, dtype: str) -> LoadedModel:
    """`model` loaded as `eval` runs it (on the CPU, in `dtype`), or a CommandError saying why it does not load (a
    tensor of the wrong shape, a missing tokenizer): the load's ValueError only, so a bug in the evaluation that
    follows still shows its traceback."""
    from loopserve.models.loader import load_model
    from loopserve_lab.train.evaluate import EVAL_DEVICE

    try:
        return load_model(model, dtype, EVAL_DEVICE)
    except ValueError as e:
        raise CommandError(str(e)) from None


def samples(model: str, n_tokens: int = 80, seed: int = 0, dtype: str | None = None) -> list[dict]:
    """Sample texts, in `dtype` on the CPU as `eval ppl` scores (default `evaluate.EVAL_DTYPE`, float32: the
    dtype of docs/embedded-model.md's samples; LLM's auto would differ)."""
    from loopserve import LLM, SamplingParams
    from loopserve_lab.train.evaluate import EVAL_DEVICE, EVAL_DTYPE

    llm = LLM(model, seed=seed, dtype=dtype or EVAL_DTYPE, device=EVAL_DEVICE)
    outs = llm.generate(list(SAMPLE_PROMPTS), SamplingParams(max_tokens=n_tokens, temperature=0.8))
    return [{"prompt": o.prompt, "text": o.outputs[0].text, "exit_depths": o.outputs[0].exit_depths} for o in outs]


def cmd_eval_ppl(args: argparse.Namespace) -> int:
    import matplotlib  # noqa: F401  (the plots come last: a missing [train] extra is said before the evaluation)
    import torch

    from loopserve_lab.train.evaluate import markdown_tables, plot_results, run_eval

    if args.calibrate and args.model is None:  # (it would rewrite the packaged model's defaults without a word)
        raise CommandError("--calibrate writes the chosen threshold into the model's config.json: name the model "
                           "folder (the embedded model's is loopserve/assets/ouro-shakespeare, to calibrate the "
                           "shipped model again on purpose)")
    model = _model(args)
    torch.set_num_threads(args.threads)
    out_json = Path(args.out_json)
    res = run_eval(model, out_json, args.windows, args.seq_len, args.calibrate, args.max_ppl_increase,
                   args.max_mean_depth, args.calib_windows, progress=not args.no_progress, jobs=args.jobs,
                   dtype=args.dtype, loaded=_load(model, args.dtype))
    if args.samples:
        res["samples"] = samples(model, dtype=args.dtype)
        for s in res["samples"]:
            print(f"\n>>> {s['prompt']}{s['text']}\n    depths: {''.join(str(d) for d in s['exit_depths'])}")
        out_json.write_text(json.dumps(res, indent=1) + "\n")
    log = Path(args.training_log) if args.training_log else Path(model) / "training_log.json"
    for p in plot_results(res, log, Path(args.plots_dir)):
        print(f"wrote {p}")
    print(markdown_tables(res))
    print(f"wrote {out_json}")
    return 0


def cmd_eval_trajectories(args: argparse.Namespace) -> int:
    import torch

    from loopserve_lab.bench.workloads import MTBenchUnavailable, setup_mtbench
    from loopserve_lab.train.trajectories import record

    model = _model(args)
    torch.set_num_threads(args.threads)
    try:
        setup_mtbench()  # (before the load, as `record` fetches them first: cached, `record` finds them there)
        loaded = _load(model, args.dtype)
        record(model, args.out_dir, args.heldout_windows, args.seq_len, args.max_tokens, dtype=args.dtype,
               loaded=loaded)
    except MTBenchUnavailable as e:
        raise CommandError(str(e)) from None
    return 0


def _add_dtype_arg(p: argparse.ArgumentParser) -> None:
    from loopserve.device import AUTO, DTYPE_CHOICES
    from loopserve_lab.train.evaluate import EVAL_DTYPE

    p.add_argument("--dtype", default=EVAL_DTYPE, choices=[*DTYPE_CHOICES, AUTO],
                   help=f"the model's dtype, on the CPU (default {EVAL_DTYPE}: the dtype docs/embedded-model.md's "
                        "figures were measured in; auto: LLM's rule)")


def register(sub: argparse._SubParsersAction) -> None:
    from loopserve_lab.train.train_tiny import TrainConfig

    p = sub.add_parser("train-tiny", help="train the embedded looped model on Shakespeare (Ouro Stage I)")
    p.add_argument("out", nargs="?", type=output_folder, default=TrainConfig.out,
                   help="output folder (HF layout; default: %(default)s)")
    p.add_argument("--overwrite", action="store_true", help="write into a folder that is not empty (its files of "
                   "the same names are replaced)")
    add_config_args(p, TrainConfig, skip=("out",))
    p.add_argument("--no-progress", action="store_true")
    p.set_defaults(func=cmd_train_tiny)

    ev = sub.add_parser("eval", help="evaluate a looped Ouro model (perplexity under early exit, trajectories)")
    evs = ev.add_subparsers(dest="eval_command", required=True, metavar="EVALUATION")
    p = evs.add_parser("ppl", help="held-out perplexity at fixed depths and over exit thresholds, per KV layout")
    p.add_argument("model", nargs="?", default=None, help="model folder (default: the embedded model)")
    p.add_argument("--windows", type=positive_int, default=48, help="held-out windows to score (default: %(default)s)")
    p.add_argument("--seq-len", type=positive_int, default=256, help="tokens per window (default: %(default)s)")
    p.add_argument("--calibrate", action="store_true",
                   help="pick the default exit threshold on the validation slice and write it to the model's "
                        "config.json (the model folder must be named)")
    p.add_argument("--calib-windows", type=positive_int, default=32,
                   help="validation windows for --calibrate (default: %(default)s)")
    p.add_argument("--max-ppl-increase", type=float, default=0.05,
                   help="--calibrate: the most perplexity may rise over full depth (default: %(default)s)")
    p.add_argument("--max-mean-depth", type=float, default=3.0,
                   help="--calibrate: the most mean exit depth may be (default: %(default)s)")
    p.add_argument("--samples", action="store_true", help="also generate a few sample texts")
    p.add_argument("--out-json", type=output_file, default=str(EVAL_OUT / "embedded-model-results.json"),
                   help="results file (default: %(default)s; docs/embedded-model.md's is "
                        "docs/embedded-model-results.json)")
    p.add_argument("--plots-dir", type=output_folder, default=str(EVAL_OUT),
                   help="folder for the PNG plots (default: %(default)s; docs/embedded-model.md's: docs)")
    p.add_argument("--training-log", default=None,
                   help="training_log.json for the training plot (default: the model folder's)")
    p.add_argument("--threads", type=positive_int, default=1, help="torch CPU threads (default: %(default)s)")
    p.add_argument("--jobs", type=positive_int, default=1,
                   help="parallel scoring processes (one thread each; default: %(default)s)")
    p.add_argument("--no-progress", action="store_true")
    _add_dtype_arg(p)
    p.set_defaults(func=cmd_eval_ppl)
    p = evs.add_parser("trajectories", help="record full-depth gate logits per token and step (held-out, MT-Bench)")
    p.add_argument("model", nargs="?", default=None, help="model folder (default: the embedded model)")
    p.add_argument("--out-dir", type=output_folder, default=str(EVAL_OUT / "trajectories"),
                   help="output folder (default: %(default)s; docs/embedded-model.md's: docs/trajectories)")
    p.add_argument("--heldout-windows", type=positive_int, default=32, help="held-out windows (default: %(default)s)")
    p.add_argument("--seq-len", type=positive_int, default=256, help="tokens per window (default: %(default)s)")
    p.add_argument("--max-tokens", type=positive_int, default=128,
                   help="tokens generated per MT-Bench question (default: %(default)s)")
    p.add_argument("--threads", type=positive_int, default=1, help="torch CPU threads (default: %(default)s)")
    _add_dtype_arg(p)
    p.set_defaults(func=cmd_eval_trajectories)
