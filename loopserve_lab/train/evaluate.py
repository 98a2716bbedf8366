"""`loopserve eval ppl`: held-out perplexity of a looped Ouro model under the engine's decode rules.

Every number comes from `scorer.score_windows` (teacher forcing with the reference decoder's
semantics: each position's next-token distribution is read at its exit depth, earlier tokens' KV
is read by the layout's rule). Windows are non-overlapping `seq_len`-token slices of the held-out
play; in each, the first token is the prompt (prefilled at full depth) and the remaining
`seq_len - 2` predictions are scored, so perplexity and mean exit depth cover the same decode items.

Runs: fixed depths 1..r_max per layout; a sweep of gate thresholds per layout (mean exit depth vs
perplexity); the engine's delayed lookahead and the distilled lookahead gate (depth_indexed).
`--calibrate` picks the default threshold on the validation slice (training-stream tail, never
trained on): the smallest mean exit depth with perplexity within `--max-ppl-increase` of full depth
and mean depth <= `--max-mean-depth`; it is written to config.json as `early_exit_threshold`.
"""

from __future__ import annotations

import json
import multiprocessing
import time
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from loopserve.cache.layout import LAYOUTS
from loopserve.device import dtype_name
from loopserve.models.loader import LoadedModel, load_model
from loopserve_lab.train.corpus import DEFAULT_CACHE_DIR, DEFAULT_HELDOUT_TITLE, fetch_shakespeare, load_works
from loopserve_lab.train.scorer import score_windows
from loopserve_lab.train.train_tiny import set_exit_threshold, token_streams, windows

THRESHOLDS = (0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9)
# What `loopserve eval ...` loads and runs a model in, on the CPU, unless --dtype says otherwise: the dtype of the
# figures in docs/embedded-model.md (not `LLM`'s auto, which runs the embedded bfloat16 checkpoint in bfloat16 on a
# CPU with bfloat16 kernels).
EVAL_DTYPE = "float32"
EVAL_DEVICE = "cpu"


def eval_texts(tokenizer, cache_dir=DEFAULT_CACHE_DIR, heldout=DEFAULT_HELDOUT_TITLE, val_tokens=32768):
    works = load_works(fetch_shakespeare(cache_dir))
    _, val, held = token_streams(works, lambda t: tokenizer.encode(t), heldout, val_tokens)
    return val, held


def sweep(model, wins, layouts=LAYOUTS, thresholds=THRESHOLDS, lookahead=True, progress=True, log=print,
          jobs: int = 1) -> dict:
    """All runs on `wins`; returns {"fixed": {layout: [summary per depth]}, "gate": {...}, ...}."""
    r_max = model.config.r_max
    # At a fixed depth every token has KV at every depth a query reads, so last_exited reads exactly
    # what depth_indexed reads: it is not run separately.
    todo = [("fixed", lay, d) for lay in layouts if lay != "last_exited" for d in range(1, r_max + 1)]
    todo += [("gate", lay, q) for lay in layouts for q in thresholds]
    if lookahead:
        todo += [("delayed", "depth_indexed", q) for q in thresholds]
        if model.has_lookahead_gate:
            todo += [("lookahead_gate", "depth_indexed", q) for q in thresholds]
    out: dict = {}
    global _JOB_STATE
    _JOB_STATE = (model, wins)
    if jobs > 1:  # independent runs: fork workers that share the model and windows copy-on-write
        ctx = multiprocessing.get_context("fork")
        with ctx.Pool(jobs) as pool:
            recs = list(tqdm(pool.imap(_run_job, todo), total=len(todo), desc="eval", disable=not progress,
                             dynamic_ncols=True))
    else:
        recs = [_run_job(j) for j in tqdm(todo, desc="eval", disable=not progress, dynamic_ncols=True)]
    for (kind, lay, x), rec in zip(todo, recs, strict=True):
        out.setdefault(kind, {}).setdefault(lay, []).append(rec)
        if kind == "fixed" and lay == "depth_indexed" and "last_exited" in layouts:
            out[kind].setdefault("last_exited", []).append(dict(rec, same_as="depth_indexed"))
        log(f"{kind:14s} {lay:13s} {x:<5} ppl {rec['ppl']:8.3f} mean depth {rec['mean_depth']:.3f}")
    return out


_JOB_STATE: tuple[Any, Any] | None = None  # (model, windows), set before the workers fork


def _run_job(job) -> dict:
    kind, lay, x = job
    assert _JOB_STATE is not None
    model, wins = _JOB_STATE
    torch.set_num_threads(1)
    t0 = time.time()
    if kind == "fixed":
        res = score_windows(model, wins, lay, "fixed", depth=x)
    elif kind == "delayed":
        res = score_windows(model, wins, lay, "gate", threshold=x, lookahead=True)
    else:
        res = score_windows(model, wins, lay, kind, threshold=x)
    return {("depth" if kind == "fixed" else "threshold"): x, **res.summary(), "seconds": time.time() - t0}


def pick_threshold(runs: dict, layout: str, max_increase: float, max_depth: float) -> dict | None:
    """Lowest mean depth among gate thresholds with ppl <= (1 + max_increase) * full-depth ppl."""
    full = runs["fixed"][layout][-1]["ppl"]
    ok = [r for r in runs["gate"][layout] if r["ppl"] <= (1 + max_increase) * full and r["mean_depth"] <= max_depth]
    if not ok:
        return None
    best = min(ok, key=lambda r: (r["mean_depth"], -r["threshold"]))
    return {"threshold": best["threshold"], "mean_depth": best["mean_depth"], "ppl": best["ppl"],
            "full_depth_ppl": full, "ppl_increase": best["ppl"] / full - 1}


def run_eval(model_path: str | Path, out_json: Path, windows_limit: int | None, seq_len: int, calibrate: bool,
             max_increase: float, max_depth: float, calib_windows: int, layouts=LAYOUTS, progress=True,
             log=print, jobs: int = 1, dtype: str = EVAL_DTYPE, loaded: LoadedModel | None = None) -> dict:
    """`loaded`: `model_path` already loaded in `dtype` (the CLI loads it first, to refuse one that does not load
    with an `error:` line); None: loaded here."""
    loaded = loaded or load_model(model_path, dtype, EVAL_DEVICE)
    model, tok = loaded.model, loaded.tokenizer
    val, held = eval_texts(tok)
    results: dict = {"model": str(model_path), "seq_len": seq_len, "torch_threads": torch.get_num_threads(),
                     "dtype": dtype_name(next(model.parameters()).dtype)}
    if calibrate:
        vw = windows(val, seq_len, calib_windows)
        log(f"calibrating on {len(vw)} validation windows of {seq_len} tokens")
        calib = sweep(model, vw, layouts=("depth_indexed",), lookahead=False, progress=progress, jobs=jobs)
        choice = pick_threshold(calib, "depth_indexed", max_increase, max_depth)
        results["calibration"] = {"runs": calib, "choice": choice, "max_ppl_increase": max_increase,
                                  "max_mean_depth": max_depth}
        if choice is None:
            log("calibration: no threshold meets the targets; config.json left unchanged")
        else:
            set_exit_threshold(loaded.path, choice["threshold"])
            model.config = type(model.config).from_hf({**model.config.raw, "early_exit_threshold": choice["threshold"]})
            log(f"calibration: early_exit_threshold = {choice['threshold']} (val: mean depth "
                f"{choice['mean_depth']:.2f}, ppl {choice['ppl']:.2f} vs {choice['full_depth_ppl']:.2f} at full depth)")
    hw = windows(held, seq_len, windows_limit)
    log(f"held-out: {len(hw)} windows of {seq_len} tokens ({hw.numel():,} tokens)")
    results["heldout"] = sweep(model, hw, layouts=layouts, progress=progress, jobs=jobs)
    q = model.config.exit_threshold
    results["default_threshold"] = q
    for lay in layouts:
        if q is not None and q < 1.0 and not any(r["threshold"] == q for r in results["heldout"]["gate"][lay]):
            res = score_windows(model, hw, lay, "gate", threshold=q)
            results["heldout"]["gate"][lay].append({"threshold": q, **res.summary()})
            results["heldout"]["gate"][lay].sort(key=lambda r: r["threshold"])
    out_json.parent.mkdir(parents=True, exist_ok=True)
    out_json.write_text(json.dumps(results, indent=1) + "\n")
    return results


# --------------------------------------------------------------------------------------------------
# Plots and tables
# --------------------------------------------------------------------------------------------------


def plot_results(results: dict, training_log: Path | None, out_dir: Path, prefix: str = "embedded-model") -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out_dir.mkdir(parents=True, exist_ok=True)
    written = []
    runs = results["heldout"]
    # 1. mean exit depth vs perplexity
    fig, ax = plt.subplots(figsize=(7, 4.5))
    colors = {"depth_indexed": "C0", "last_exited": "C1", "shared": "C2"}
    for lay, recs in runs["gate"].items():
        ax.plot([r["mean_depth"] for r in recs], [r["ppl"] for r in recs], "o-", color=colors[lay],
                label=f"gate, {lay}", ms=3)
        fx = runs["fixed"][lay]
        ax.plot([r["depth"] for r in fx], [r["ppl"] for r in fx], "s:", color=colors[lay], alpha=0.6,
                label=f"fixed depth, {lay}", ms=4)
    for lay, recs in runs.get("lookahead_gate", {}).items():
        ax.plot([r["mean_depth"] for r in recs], [r["ppl"] for r in recs], "^--", color=colors[lay], ms=3,
                alpha=0.8, label=f"lookahead gate, {lay}")
    for lay, recs in runs.get("delayed", {}).items():
        ax.plot([r["mean_loops"] for r in recs], [r["ppl"] for r in recs], "x-.", color="C3", ms=4,
                label=f"delayed lookahead ({lay}), x = loops run")
    full = runs["fixed"]["depth_indexed"][-1]["ppl"]
    ax.axhline(full * 1.05, color="grey", lw=0.8, ls="--", label="full depth + 5%")
    q = results.get("default_threshold")
    d = next((r for r in runs["gate"]["depth_indexed"] if r["threshold"] == q), None)
    if d:
        ax.plot([d["mean_depth"]], [d["ppl"]], "k*", ms=12, label=f"default q = {q}")
    ax.set_xlabel("mean exit depth (loops)")
    ax.set_ylabel("held-out perplexity")
    lo = min(r["ppl"] for kind in runs.values() for recs in kind.values() for r in recs)
    ax.set_ylim(lo * 0.98, full * 1.12)  # curves far above (e.g. shared KV) leave the frame: see the tables
    ax.set_title("Early exit: depth vs perplexity (held-out play, teacher-forced, engine semantics)", fontsize=9)
    ax.legend(fontsize=6.5, ncol=2)
    ax.grid(alpha=0.3)
    p = out_dir / f"{prefix}-depth-vs-ppl.png"
    fig.tight_layout()
    fig.savefig(p, dpi=130)
    plt.close(fig)
    written.append(p)
    # 2. exit-depth histogram at the default threshold
    if d:
        fig, ax = plt.subplots(figsize=(5, 3.2))
        hist = d["depth_hist"]
        ax.bar(range(1, len(hist) + 1), [h / sum(hist) for h in hist])
        ax.set_xlabel("exit depth")
        ax.set_ylabel("fraction of tokens")
        ax.set_title(f"Exit depths, held-out, q = {q} (depth_indexed)", fontsize=9)
        fig.tight_layout()
        p = out_dir / f"{prefix}-depth-hist.png"
        fig.savefig(p, dpi=130)
        plt.close(fig)
        written.append(p)
    # 3. training curves
    if training_log and Path(training_log).is_file():
        logd = json.loads(Path(training_log).read_text())
        steps = logd["steps"]
        fig, (a1, a2) = plt.subplots(1, 2, figsize=(10, 3.8))
        xs = [s["step"] for s in steps]
        for t in range(len(steps[0]["step_loss"])):
            a1.plot(xs, [s["step_loss"][t] for s in steps], lw=0.8, label=f"L_{t + 1} (train batch)")
        for t in range(len(logd["evals"][0]["loss"])):
            a1.plot([e["step"] for e in logd["evals"]], [e["loss"][t] for e in logd["evals"]], "o", ms=3,
                     color=f"C{t}")
        a1.set_xlabel("step")
        a1.set_ylabel("cross-entropy (nats); dots: validation")
        a1.set_ylim(top=min(a1.get_ylim()[1], 8))
        a1.legend(fontsize=7)
        for t in range(len(steps[0]["p_exit"])):
            a2.plot(xs, [s["p_exit"][t] for s in steps], lw=0.8, label=f"mean p(exit at {t + 1})")
        a2.set_xlabel("step")
        a2.legend(fontsize=7)
        a2.set_title("exit distribution (Stage I gate)", fontsize=9)
        fig.tight_layout()
        p = out_dir / f"{prefix}-training.png"
        fig.savefig(p, dpi=130)
        plt.close(fig)
        written.append(p)
    return written


def markdown_tables(results: dict) -> str:
    runs = results["heldout"]
    lines = ["| layout | " + " | ".join(f"depth {r['depth']}" for r in runs["fixed"]["depth_indexed"]) + " |",
             "|---|" + "---|" * len(runs["fixed"]["depth_indexed"])]
    for lay, recs in runs["fixed"].items():
        lines.append(f"| {lay} | " + " | ".join(f"{r['ppl']:.2f}" for r in recs) + " |")
    lines += ["", "| threshold q | " + " | ".join(f"{lay}" for lay in runs["gate"]) + " |",
              "|---|" + "---|" * len(runs["gate"])]
    qs = [r["threshold"] for r in runs["gate"]["depth_indexed"]]
    for i, q in enumerate(qs):
        cells = []
        for lay in runs["gate"]:
            r = runs["gate"][lay][i]
            cells.append(f"{r['ppl']:.2f} @ {r['mean_depth']:.2f}")
        lines.append(f"| {q} | " + " | ".join(cells) + " |")
    for kind, title in (("lookahead_gate", "lookahead gate"), ("delayed", "delayed lookahead (mean loops run)")):
        if kind not in runs:
            continue
        lines += ["", "| threshold q | " + " | ".join(f"{title}, {lay}" for lay in runs[kind]) + " |",
                  "|---|" + "---|" * len(runs[kind])]
        for i, q in enumerate(r["threshold"] for r in next(iter(runs[kind].values()))):
            cells = []
            for lay in runs[kind]:
                r = runs[kind][lay][i]
                depth = r["mean_loops"] if kind == "delayed" else r["mean_depth"]
                cells.append(f"{r['ppl']:.2f} @ {depth:.2f}")
            lines.append(f"| {q} | " + " | ".join(cells) + " |")
    return "\n".join(lines)

