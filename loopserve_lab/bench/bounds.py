"""The FLOP bound applied to a benchmark run, and the share of it a run realizes.

Two bounds are reported for every run:

* **decode bound** (eq. 1 of the CDB paper, docs/design.md §7.1): `(F0 + r_max Fr) / (F0 + d Fr)` with `d`
  the mean exit depth of the decode work items;
* **workload bound**: the same formula with `d` averaged over every token the run computes,
  prompt tokens included at `r_max` (no scheduler can shorten a prefill). This is the bound for
  an end-to-end throughput ratio whose wall time includes the prefill; it equals the decode bound
  when prompts are empty.

Realized share = (CDB tokens/s / CB tokens/s) / bound.
"""

from __future__ import annotations

from typing import Any

from loopserve_lab.bench.theory import flop_bound, realized_fraction, stage_flops


def workload_mean_depth(prompt_tokens: int, decode_items: int, decode_mean: float, r_max: int) -> float:
    """Mean depth over prompt tokens (at r_max) and decode items (at their exit depths)."""
    total = prompt_tokens + decode_items
    if total == 0:
        return float(r_max)
    return (prompt_tokens * r_max + decode_items * decode_mean) / total


def run_bounds(hf_config: dict[str, Any], r_max: int, decode_mean: float | None, prompt_tokens: int,
               decode_items: int, count: str = "matmul") -> dict[str, float]:
    """F0, Fr, both bounds and the mean depths they use."""
    f = stage_flops(hf_config, count=count)
    d = float(r_max) if decode_mean is None else float(decode_mean)
    dw = workload_mean_depth(prompt_tokens, decode_items, d, r_max)
    return {"F0": f.F0, "Fr": f.Fr, "F0_over_Fr": f.F0 / f.Fr, "r_max": r_max, "decode_mean_depth": d,
            "workload_mean_depth": dw, "decode_bound": flop_bound(f.F0, f.Fr, r_max, d),
            "workload_bound": flop_bound(f.F0, f.Fr, r_max, dw)}


def realized(speedup: float, bounds: dict[str, float]) -> dict[str, float]:
    return {"of_decode_bound": realized_fraction(speedup, bounds["decode_bound"]),
            "of_workload_bound": realized_fraction(speedup, bounds["workload_bound"])}
