"""PNG figures of the benchmarks (matplotlib, Agg backend: no display needed)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from loopserve.engine.config import ENGINE_SCHEDULERS
from loopserve_lab.bench.harness import LABELS  # noqa: E402

COLORS = {"cb": "#7f7f7f", "cdb-norefill": "#ff7f0e", "cdb": "#1f77b4"}
MARKERS = {"cb": "s", "cdb-norefill": "^", "cdb": "o"}


def _save(fig, path: Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def _series(rows: list[dict[str, Any]], key: str, sched: str, y: str):
    pts = sorted((r[key], r[y]) for r in rows if r["scheduler"] == sched and r.get(y) is not None)
    return [p[0] for p in pts], [p[1] for p in pts]


def plot_throughput(rows: list[dict[str, Any]], x: str, path: Path, title: str, xlabel: str,
                    logx: bool = False) -> Path:
    """Decode throughput normalized to CB against `x` (width or threshold): CPU clock (solid) and
    wall clock (faint, dashed), with the decode FLOP bound. The right panel shows absolute decode
    tokens/s (wall) and the mean exit depth."""
    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(11, 4.2))
    for s in ENGINE_SCHEDULERS:
        xs, ys = _series(rows, x, s, "norm_decode_cpu")
        if xs:
            ax.plot(xs, ys, marker=MARKERS[s], color=COLORS[s], label=f"{LABELS[s]} (CPU clock)")
        xs, ys = _series(rows, x, s, "norm_decode")
        if xs and s != "cb":
            ax.plot(xs, ys, marker=MARKERS[s], color=COLORS[s], alpha=0.35, ls="--", label=f"{LABELS[s]} (wall clock)")
    xs, ys = _series(rows, x, "cdb", "decode_bound")
    if xs:
        ax.plot(xs, ys, "-", color="k", lw=2, label="FLOP bound (decode)")
    ax.set_xlabel(xlabel)
    ax.set_ylabel("decode throughput / CB")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, loc="best")
    for s in ENGINE_SCHEDULERS:
        xs, ys = _series(rows, x, s, "decode_tokens_per_s")
        if xs:
            ax2.plot(xs, ys, marker=MARKERS[s], color=COLORS[s], label=LABELS[s])
    ax2.set_xlabel(xlabel)
    ax2.set_ylabel("decode tokens/s (wall)")
    ax2.grid(alpha=0.3)
    xs, ds = _series(rows, x, "cdb", "mean_exit_depth")
    if xs:
        ax3 = ax2.twinx()
        ax3.plot(xs, ds, "x--", color="tab:green", label="mean exit depth")
        ax3.set_ylabel("mean exit depth", color="tab:green")
    ax2.legend(fontsize=8, loc="upper left")
    if logx:
        ax.set_xscale("log", base=2)
        ax2.set_xscale("log", base=2)
    return _save(fig, path)


def plot_serve(rows: list[dict[str, Any]], path: Path, title: str) -> Path:
    """Normalized latency (and TTFT p50) against request rate, one line per scheduler."""
    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(11, 4.2))
    for s in ENGINE_SCHEDULERS:
        pts = sorted((r["rate"], r["normalized_latency"], (r["ttft"] or {}).get("p50"))
                     for r in rows if r["scheduler"] == s and r.get("normalized_latency") is not None)
        if not pts:
            continue
        ax.plot([p[0] for p in pts], [p[1] * 1e3 for p in pts], marker=MARKERS[s], color=COLORS[s],
                label=LABELS[s])
        ax2.plot([p[0] for p in pts], [(p[2] or 0) * 1e3 for p in pts], marker=MARKERS[s], color=COLORS[s],
                 label=LABELS[s])
    ax.set_xlabel("request rate (req/s)")
    ax.set_ylabel("normalized latency (ms / output token)")
    ax.set_yscale("log")
    ax.set_title(title)
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=8)
    ax2.set_xlabel("request rate (req/s)")
    ax2.set_ylabel("TTFT p50 (ms)")
    ax2.set_yscale("log")
    ax2.grid(alpha=0.3, which="both")
    return _save(fig, path)


def plot_step_latency(points: list[dict[str, Any]], fits: list[dict[str, Any]], path: Path, title: str) -> Path:
    """Per-core-step latency against batch size (log-log), one series per context length, with the
    linear fit t(B) = floor + slope B (solid over the fitted batches, dotted beyond)."""
    fig, ax = plt.subplots(figsize=(7, 4.6))
    cmap = plt.get_cmap("viridis")
    ctxs = sorted({p["context"] for p in points})
    for i, c in enumerate(ctxs):
        col = cmap(0.85 * i / max(len(ctxs) - 1, 1))
        pts = sorted((p["batch"], p["latency_s"]) for p in points if p["context"] == c)
        ax.plot([p[0] for p in pts], [p[1] * 1e3 for p in pts], "o", color=col)
        fit = next((f for f in fits if f["context"] == c), None)
        if fit is None:
            continue
        top = fit.get("max_batch", pts[-1][0])
        bs = [b for b, _ in pts]
        inside = [b for b in bs if b <= top]
        outside = [b for b in bs if b >= top]
        line = [(fit["floor_s"] + fit["slope_s"] * b) * 1e3 for b in inside]
        ax.plot(inside, line, "-", color=col,
                label=f"ctx {c}: {fit['floor_s'] * 1e3:.2f} + {fit['slope_s'] * 1e3:.3f}·B ms, B*={fit['b_star']:.1f}"
                      f" (fit B<={top})")
        if len(outside) > 1:
            ax.plot(outside, [(fit["floor_s"] + fit["slope_s"] * b) * 1e3 for b in outside], ":", color=col)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("batch size B (rows in the core step)")
    ax.set_ylabel("core step latency (ms)")
    ax.set_title(title)
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=7)
    return _save(fig, path)


def plot_bars(labels: list[str], values: list[float], path: Path, title: str, ylabel: str,
              ref: float | None = None, ref_label: str | None = None) -> Path:
    fig, ax = plt.subplots(figsize=(max(5.0, 1.1 * len(labels) + 2), 4))
    ax.bar(labels, values, color="#1f77b4")
    for i, v in enumerate(values):
        ax.text(i, v, f"{v:.3g}", ha="center", va="bottom", fontsize=8)
    if ref is not None:
        ax.axhline(ref, ls="--", color="k", label=ref_label)
        ax.legend(fontsize=8)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.grid(alpha=0.3, axis="y")
    return _save(fig, path)


def plot_schedule_trace(traces: dict[str, list[dict[str, Any]]], path: Path, title: str,
                        max_ticks: int = 160) -> Path:
    """Batch size of each tick, coloured by stage, one panel per scheduler (the first `max_ticks`
    decode ticks; prefill ticks are marked, their bars clipped to the decode scale)."""
    stage_color = {"prefill": "tab:red", "prelude": "tab:green", "core": "tab:blue", "coda": "tab:purple"}
    fig, axes = plt.subplots(len(traces), 1, figsize=(12, 2.8 * len(traces)), squeeze=False)
    for ax, (name, ticks) in zip(axes[:, 0], traces.items(), strict=True):
        ticks = ticks[:max_ticks]
        top = max([t["batch"] for t in ticks if t["stage"] != "prefill"] or [1])
        for stage, col in stage_color.items():
            xs = [t["tick"] for t in ticks if t["stage"] == stage]
            ys = [min(t["batch"], top + 1) for t in ticks if t["stage"] == stage]
            if xs:
                ax.bar(xs, ys, width=0.9, color=col, label=stage)
        for t in ticks:
            if t["stage"] == "prefill":
                ax.text(t["tick"], top + 1, f"{t['batch']}", ha="center", va="bottom", fontsize=6, color="tab:red")
        ax.set_ylim(0, top * 1.25 + 1)
        ax.set_title(f"{LABELS.get(name, name)}: first {len(ticks)} ticks", fontsize=10)
        ax.set_ylabel("rows in the tick")
        ax.legend(fontsize=7, ncol=4, loc="upper right")
    axes[-1, 0].set_xlabel("tick")
    fig.suptitle(title)
    return _save(fig, path)


def plot_host(points: list[dict[str, Any]], path: Path, title: str) -> Path:
    """Host CPU time per tick (model compute taken out) against width, one panel per stage, a line per
    (scheduler, context)."""
    stages = [s for s in ("prelude", "core", "coda") if any(s in p["stages"] for p in points)]
    fig, axes = plt.subplots(1, len(stages), figsize=(4.2 * len(stages), 4.0), squeeze=False)
    contexts = sorted({p["context"] for p in points})
    schedulers = list(dict.fromkeys(p["scheduler"] for p in points))  # (every one measured, in the order given)
    # a line style per context, as many as there are contexts (four named ones, then longer and longer dashes)
    styles: list[Any] = ["-", "--", ":", "-."] + [(0, (2 + i, 2)) for i in range(2, len(contexts) - 2)]
    for ax, stage in zip(axes[0], stages, strict=True):
        for sched in schedulers:
            for ls, ctx in zip(styles, contexts, strict=False):
                pts = sorted((p["width"], p["stages"][stage]["host_cpu_us"]) for p in points
                             if p["scheduler"] == sched and p["context"] == ctx and stage in p["stages"])
                if pts:
                    ax.plot([x for x, _ in pts], [y for _, y in pts], linestyle=ls, marker=MARKERS[sched],
                            color=COLORS[sched], label=f"{LABELS[sched]}, context {ctx}")
        ax.axhline(150, color="k", lw=1, alpha=0.5)
        ax.text(ax.get_xlim()[0], 150, " target 150 us", va="bottom", fontsize=7)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("width (max_decode_batch)")
        ax.set_ylabel("host CPU us per tick")
        ax.set_title(f"{stage} ticks")
        ax.grid(alpha=0.3, which="both")
    axes[0][stages.index("core") if "core" in stages else 0].legend(fontsize=6)
    fig.suptitle(title, fontsize=9)
    return _save(fig, path)


def plot_prefix(summary: dict[str, Any], path: Path, title: str) -> Path:
    """Prefix cache on vs off: median TTFT alone and at turn 2 of a conversation, and a batch's wall time."""
    fig, axes = plt.subplots(1, 3, figsize=(11, 3.8))
    panels = (("ttft", "wall_median", "TTFT, one request (s)"), ("turn2", "wall_median", "TTFT, turn 2 (s)"),
              ("throughput", "wall", "batch: time to finish all (s)"))
    for ax, (key, field, label) in zip(axes, panels, strict=True):
        vals = [summary[key]["on"][field], summary[key]["off"][field]]
        ax.bar(["cache on", "cache off"], vals, color=["#1f77b4", "#7f7f7f"])
        for i, v in enumerate(vals):
            ax.text(i, v, f"{v:.3g}", ha="center", va="bottom", fontsize=8)
        ax.set_title(f"{label}\noff/on {summary[key]['speedup_wall']:.1f}x", fontsize=9)
        ax.grid(alpha=0.3, axis="y")
    fig.suptitle(title, fontsize=10)
    return _save(fig, path)


def plot_spec(res: dict[str, Any], path: Path, title: str) -> Path:
    """Speculative vs plain: CPU ms per token by concurrency, and acceptance / tokens per pass by draft depth."""
    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 3.8))
    conc = [r["concurrency"] for r in res["concurrency"]]
    for mode, color in (("spec", "#1f77b4"), ("plain", "#7f7f7f")):
        a.plot(conc, [r[mode]["ms_per_token"] for r in res["concurrency"]], "o-", color=color,
               label="speculative" if mode == "spec" else "plain")
    for r in res["concurrency"]:
        a.annotate(f"{r['speedup']:.2f}x", (r["concurrency"], r["spec"]["ms_per_token"]), fontsize=8,
                   textcoords="offset points", xytext=(0, -12), ha="center")
    a.set_xscale("log", base=2)
    a.set_xticks(conc, [str(c) for c in conc])
    a.set_xlabel("concurrent requests")
    a.set_ylabel("CPU ms per token (per request)")
    a.legend(fontsize=8)
    a.grid(alpha=0.3)
    depths = [str(r["draft_loops"]) for r in res["depths"]]
    acc = [r["spec"]["acceptance"] or 0.0 for r in res["depths"]]
    b.bar(depths, acc, color="#1f77b4")
    for i, r in enumerate(res["depths"]):
        b.text(i, acc[i], f"{acc[i]:.2f}, {r['spec']['tokens_per_verify'] or 0:.2f} tok/pass\n{r['speedup']:.2f}x",
               ha="center", va="bottom", fontsize=8)
    b.set_ylim(0, 1.15)
    b.set_xlabel("draft loops")
    b.set_ylabel("acceptance (concurrency 1)")
    b.grid(alpha=0.3, axis="y")
    fig.suptitle(title, fontsize=10)
    return _save(fig, path)
