"""Exit behaviour you can replay: per-token exit traces for `SamplingParams(exit_trace=...)`.

Two sources:

* **Threshold-free trajectories** (docs/design.md §7.2): run the workload once at full depth and record, for
  every decode work item, the exit signal after every loop step (Ouro: the gate logit; Huginn: the
  relative latent change). `traces_for_threshold` then turns them into depths for any threshold by
  the rule the engine applies online (`loopserve.exits.ExitTracker`: the cumulative-hazard CDF for
  the gate, a direct threshold for latent_diff), so one recording replays any threshold in every
  scheduler, identically. These are the exits of the full-depth signals: an approximation of the
  depths an online run chooses, whose early exits change the KV, and so the signals, later tokens
  see (how close depends on the model: docs/design.md §7.2).
* **Synthetic depth laws** with a stated mean: `binomial` (1 + Binomial(r_max - 1, p)),
  `geometric` (truncated geometric, right-skewed), `fixed`.

A trace of request i lists the depth of its decode work items: item k is fed generated token k
(the first token comes from the prefill, at full depth), so a request with n output tokens has
n - 1 items.
"""

from __future__ import annotations

import gzip
import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from loopserve.exits import ExitRule

# --------------------------------------------------------------------------------------------------
# Synthetic depth laws
# --------------------------------------------------------------------------------------------------

DEPTH_LAWS = ("binomial", "geometric", "fixed")


def depth_pmf(law: str, mean: float, r_max: int, min_depth: int = 1) -> np.ndarray:
    """P(depth = d) for d = 1..r_max (index d - 1), with the stated mean over [min_depth, r_max]."""
    lo = int(min_depth)
    if not 1 <= lo <= r_max:
        raise ValueError(f"min_depth: must be in [1, {r_max}] (the model's r_max), got {min_depth}")
    if not lo <= mean <= r_max:
        raise ValueError(f"mean_depth: must be in [{lo}, {r_max}] (the minimum depth to the model's r_max), "
                         f"got {mean:g}")
    n = r_max - lo  # support lo..r_max has n + 1 points
    pmf = np.zeros(r_max)
    if law == "fixed":
        if abs(mean - round(mean)) > 1e-9:
            raise ValueError(f"mean_depth: the fixed law needs an integer mean, got {mean:g}")
        pmf[int(round(mean)) - 1] = 1.0
        return pmf
    if n == 0:
        pmf[lo - 1] = 1.0
        return pmf
    if law == "binomial":
        p = (mean - lo) / n
        k = np.arange(n + 1)
        coef = np.array([math.comb(n, int(i)) for i in k], dtype=float)
        with np.errstate(divide="ignore", invalid="ignore"):
            w = coef * np.power(p, k) * np.power(1 - p, n - k)
        pmf[lo - 1:] = np.nan_to_num(w)
        return pmf / pmf.sum()
    if law == "geometric":  # P(lo + k) proportional to q^k, k = 0..n; q solved for the mean
        k = np.arange(n + 1)

        def m(logq: float) -> float:
            w = np.exp(logq * k - np.max(logq * k))
            return lo + float((w * k).sum() / w.sum())

        a, b = -60.0, 60.0
        for _ in range(200):
            mid = (a + b) / 2
            if m(mid) < mean:
                a = mid
            else:
                b = mid
        logq = (a + b) / 2
        w = np.exp(logq * k - np.max(logq * k))
        pmf[lo - 1:] = w / w.sum()
        return pmf
    raise ValueError(f"unknown depth law {law!r}; known: {', '.join(DEPTH_LAWS)}")


def synthetic_traces(output_lens: list[int], r_max: int, mean: float, law: str = "binomial", seed: int = 0,
                     min_depth: int = 1) -> list[list[int]]:
    """One trace per request (n - 1 items for n output tokens), depths drawn i.i.d. from the law."""
    pmf = depth_pmf(law, mean, r_max, min_depth)
    rng = np.random.default_rng(seed)
    depths = np.arange(1, r_max + 1)
    return [[int(d) for d in rng.choice(depths, max(n - 1, 0), p=pmf)] for n in output_lens]


def full_depth_traces(output_lens: list[int], r_max: int) -> list[list[int]]:
    return [[r_max] * max(n - 1, 0) for n in output_lens]


def mean_depth(traces: list[list[int]]) -> float:
    flat = [d for t in traces for d in t]
    return float(np.mean(flat)) if flat else float("nan")


# --------------------------------------------------------------------------------------------------
# Threshold-free trajectories
# --------------------------------------------------------------------------------------------------


@dataclass
class Trajectories:
    """signals[i][k] = the exit signals of request i's decode item k after steps 1, 2, ... (a list
    shorter than r_max only if the online rule already forced an exit for every threshold)."""

    policy: str  # "gate" | "latent_diff"
    r_max: int
    signals: list[list[list[float]]]
    meta: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return {"policy": self.policy, "r_max": self.r_max, "meta": self.meta, "signals": self.signals}

    @staticmethod
    def from_json(d: dict[str, Any]) -> Trajectories:
        return Trajectories(d["policy"], int(d["r_max"]), d["signals"], d.get("meta", {}))

    def save(self, path: Path) -> None:
        path = Path(path)
        data = json.dumps(self.to_json()).encode()
        path.write_bytes(gzip.compress(data) if path.suffix == ".gz" else data)

    @staticmethod
    def load(path: Path) -> Trajectories:
        raw = Path(path).read_bytes()
        if raw[:2] == b"\x1f\x8b":
            raw = gzip.decompress(raw)
        return Trajectories.from_json(json.loads(raw))


def exit_depth(signals: list[float], policy: str, threshold: float, r_max: int, min_loops: int = 1) -> int:
    """The depth at which the engine's rule exits on a threshold-free signal trajectory (its own
    `ExitTracker`, so the rule cannot drift from the engine's; the signals are the full-depth run's,
    which online exits would change: docs/design.md §7.2)."""
    tracker = ExitRule(policy, threshold, min_loops, r_max).new_item(0)
    for r in range(1, len(signals) + 1):
        if not tracker.observe(r, signals[r - 1]):
            return int(tracker.exit_depth)  # type: ignore[arg-type]
    # a trajectory cut short was cut by a forced exit (a saturated gate): every threshold exits there
    return len(signals) if 0 < len(signals) < r_max else r_max


def traces_for_threshold(traj: Trajectories, threshold: float, min_loops: int = 1) -> list[list[int]]:
    """Replay a threshold: one depth per decode item of every request."""
    return [[exit_depth(s, traj.policy, threshold, traj.r_max, min_loops) for s in req] for req in traj.signals]


def threshold_for_depth(traj: Trajectories, target: float, min_loops: int = 1, iters: int = 40) -> float:
    """A threshold whose replay gives mean depth closest to `target` (bisection: the mean depth
    rises with a gate threshold and falls with a latent_diff threshold)."""
    if traj.policy == "gate":
        lo, hi, rising = 1e-6, 1.0, True
    else:
        flat = [x for req in traj.signals for item in req for x in item]
        lo, hi, rising = 0.0, (max(flat) * 1.01 if flat else 1.0), False
    for _ in range(iters):
        mid = (lo + hi) / 2
        d = mean_depth(traces_for_threshold(traj, mid, min_loops))
        if (d < target) == rising:
            lo = mid
        else:
            hi = mid
    return (lo + hi) / 2


def record_trajectories(engine, workload, policy: str | None = None, progress: bool = True) -> Trajectories:
    """Run `workload` once at full depth on `engine` (an `LLMEngine`; use the `cb` scheduler) and
    record every decode item's per-step exit signal. Ouro records its gate (threshold 1.0: the
    cumulative hazard never forces an exit short of a sigmoid that saturates at 1, which exits at
    every threshold anyway); Huginn records the latent change (threshold 0: never exits)."""
    import torch
    from tqdm import tqdm

    from loopserve.sampling_params import SamplingParams

    model = engine.model
    if policy is None:
        policy = model.default_exit_policy
    threshold = {"gate": 1.0, "latent_diff": 0.0}[policy]
    r_max = model.config.r_max
    n = len(workload)
    rec: list[list[list[float]]] = [[[] for _ in range(max(r.output_len - 1, 0))] for r in workload.requests]
    index: dict[str, int] = {}
    hooks = engine.scheduler.signal_hooks

    def observe(items, signals):
        for item, sig in zip(items, signals, strict=True):
            if sig is None:  # a passive row (exited in an earlier step)
                continue
            i, k = index[item.seq.request_id], item.seq.decode_index
            if k < len(rec[i]) and len(rec[i][k]) == item.r - 1:  # item.r: steps run, this one included
                rec[i][k].append(float(sig))

    hooks.append(observe)
    try:
        for i, req in enumerate(workload.requests):
            rid = f"traj-{i}"
            index[rid] = i
            engine.add_request(rid, {"prompt_token_ids": req.prompt_ids},
                               SamplingParams(max_tokens=req.output_len, ignore_eos=True, temperature=0.0,
                                              exit_policy=policy, exit_threshold=threshold))
        bar = tqdm(total=n, desc="record trajectories", disable=not progress)
        with torch.inference_mode():
            while engine.has_unfinished_requests():
                bar.update(sum(o.finished for o in engine.step()))
        bar.close()
    finally:
        hooks.remove(observe)
    return Trajectories(policy, r_max, rec, {"workload": workload.name, "requests": n, "threshold_used": threshold})
