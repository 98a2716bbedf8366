"""`bench prefix`: prefix caching measured on shared-prefix traffic (docs/benchmarks.md §10).

Every prompt sits behind one system prompt (`--prefix-len` tokens); questions are MT-Bench's (first
turns, and second turns for the conversations) when `bench setup` fetched them, else random token
runs of similar length. Two engines, identical but for `enable_prefix_caching`, each warmed with one
request (so the on engine holds the system prompt's blocks), measure side by side, interleaved
(on/off order alternating per measurement: this machine is shared and noisy):

- ttft: one request at a time on an idle engine, time to first token (wall and process CPU);
- multi-turn: turn 2 of a conversation (turn 1's prompt + its answer + the second question), alone;
- throughput: all requests at once, run to completion; generated and prompt tokens per second, and
  the mean time to first token under that load.

Decode runs at full depth (`exit_policy="fixed"`), so both engines compute the same tokens.
"""

from __future__ import annotations

import statistics
import time
from pathlib import Path
from typing import Any

import numpy as np

from loopserve import SamplingParams
from loopserve.engine.engine import LLMEngine
from loopserve_lab.bench.workloads import load_mtbench, mtbench_path, regular_token_ids

MODES = ("on", "off")


def build_prompts(tokenizer, n: int, prefix_len: int, seed: int, mtbench_file: Path | None,
                  max_question: int = 256) -> tuple[list[int], list[tuple[list[int], list[int]]], str]:
    """(system prompt ids, n (first, second) question id pairs, where the questions came from)."""
    rng = np.random.default_rng(seed)
    vocab = regular_token_ids(tokenizer)
    system = [int(t) for t in rng.choice(vocab, prefix_len)]
    path = mtbench_file or mtbench_path()
    if Path(path).is_file():
        qs = load_mtbench(path)
        order = [int(i) for i in rng.permutation(len(qs))][:n]
        pairs = [tuple(tokenizer.encode(" " + t)[:max_question] for t in (qs[i]["turns"] + qs[i]["turns"])[:2])
                 for i in order]
        return system, pairs, f"MT-Bench ({path.name})"  # type: ignore[return-value]
    lens = rng.integers(40, 120, size=(n, 2))
    pairs = [([int(t) for t in rng.choice(vocab, a)], [int(t) for t in rng.choice(vocab, b)]) for a, b in lens]
    return system, pairs, "random token runs (MT-Bench not set up)"


def _params(max_tokens: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, exit_policy="fixed")


def _solo(engine: LLMEngine, rid: str, prompt: list[int], max_tokens: int) -> dict[str, Any]:
    """One request on an idle engine: time to first token (wall, CPU), then run it out."""
    w0, c0 = time.perf_counter(), time.process_time()
    engine.add_request(rid, prompt, _params(max_tokens))
    first: dict[str, float] = {}
    out = None
    while engine.has_unfinished_requests():
        for o in engine.step():
            if not first and o.outputs[0].token_ids:
                first = {"wall": time.perf_counter() - w0, "cpu": time.process_time() - c0}
            if o.finished:
                out = o
    assert out is not None
    return {**first, "cached": out.num_cached_tokens, "prompt": len(prompt), "tokens": out.outputs[0].token_ids}


def _batch(engine: LLMEngine, tag: str, prompts: list[list[int]], max_tokens: int) -> dict[str, Any]:
    w0, c0 = time.perf_counter(), time.process_time()
    for i, p in enumerate(prompts):
        engine.add_request(f"{tag}-{i}", p, _params(max_tokens))
    outs = []
    while engine.has_unfinished_requests():
        outs += [o for o in engine.step() if o.finished]
    wall, cpu = time.perf_counter() - w0, time.process_time() - c0
    gen = sum(len(o.outputs[0].token_ids) for o in outs)
    ttfts = [o.metrics.time_to_first_token for o in outs if o.metrics and o.metrics.time_to_first_token is not None]
    return {"wall": wall, "cpu": cpu, "generated_per_s": gen / wall, "prompt_per_s": sum(map(len, prompts)) / wall,
            "mean_ttft": statistics.fmean(ttfts), "cached": sum(o.num_cached_tokens for o in outs)}


def run(engines: dict[str, LLMEngine], system: list[int], pairs: list[tuple[list[int], list[int]]],
        ttft_requests: int, output_len: int, rounds: int, progress: bool = True) -> dict[str, Any]:
    def log(msg: str) -> None:
        if progress:
            print(msg, flush=True)

    for mode, eng in engines.items():  # warm-up: the on engine caches the system prompt's blocks
        _solo(eng, f"warm-{mode}", system + pairs[0][0], 2)
    ttft: dict[str, list[dict]] = {m: [] for m in MODES}
    for i, (q1, _) in enumerate(pairs[:ttft_requests]):
        for mode in (MODES if i % 2 == 0 else MODES[::-1]):
            ttft[mode].append(_solo(engines[mode], f"t{i}-{mode}", system + q1, 1))
        log(f"ttft {i}: on {ttft['on'][-1]['wall']:.3f} s, off {ttft['off'][-1]['wall']:.3f} s")
    turn2: dict[str, list[dict]] = {m: [] for m in MODES}
    for i, (q1, q2) in enumerate(pairs[:ttft_requests]):
        first = _solo(engines["on"], f"c{i}-1", system + q1, output_len)["tokens"]  # turn 1 (its answer)
        prompt = system + q1 + first + q2
        for mode in (MODES if i % 2 == 0 else MODES[::-1]):
            turn2[mode].append(_solo(engines[mode], f"c{i}-2-{mode}", prompt, 1))
        log(f"turn 2 {i}: on {turn2['on'][-1]['wall']:.3f} s, off {turn2['off'][-1]['wall']:.3f} s")
    tput: dict[str, list[dict]] = {m: [] for m in MODES}
    for k in range(rounds):
        # a token of its own after the system prompt: a round shares the system prompt, not earlier questions
        prompts = [system + [system[k]] + q1 for q1, _ in pairs]
        for mode in (MODES if k % 2 == 0 else MODES[::-1]):
            tput[mode].append(_batch(engines[mode], f"b{k}-{mode}", prompts, output_len))
            log(f"throughput round {k} {mode}: {tput[mode][-1]['generated_per_s']:.1f} generated tok/s, "
                f"wall {tput[mode][-1]['wall']:.1f} s")
    for mode in MODES:  # outputs do not depend on the cache
        for x in ttft[mode] + turn2[mode]:
            x.pop("tokens")
    return {"ttft": ttft, "turn2": turn2, "throughput": tput, "summary": summarize(ttft, turn2, tput)}


def _med(rows: list[dict], key: str) -> float:
    return float(statistics.median(r[key] for r in rows))


def summarize(ttft: dict, turn2: dict, tput: dict) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name, rows in (("ttft", ttft), ("turn2", turn2)):
        s: dict[str, Any] = {m: {"wall_median": _med(rows[m], "wall"), "cpu_median": _med(rows[m], "cpu"),
                 "cached_mean": statistics.fmean(r["cached"] for r in rows[m]),
                 "prompt_mean": statistics.fmean(r["prompt"] for r in rows[m])} for m in MODES}
        s["speedup_wall"] = s["off"]["wall_median"] / s["on"]["wall_median"]
        s["speedup_cpu"] = s["off"]["cpu_median"] / s["on"]["cpu_median"]
        out[name] = s
    fields = ("wall", "cpu", "generated_per_s", "prompt_per_s", "mean_ttft")
    t: dict[str, Any] = {m: {k: _med(tput[m], k) for k in fields} for m in MODES}
    t["speedup_wall"] = t["off"]["wall"] / t["on"]["wall"]
    out["throughput"] = t
    return out


def format_summary(s: dict[str, Any]) -> str:
    lines = ["| measure | cache on | cache off | off / on |", "|---|---|---|---|"]
    for name, label in (("ttft", "TTFT, one request (median)"), ("turn2", "TTFT, turn 2 of a conversation")):
        x = s[name]
        for clock in ("wall", "cpu"):
            on, off = 1e3 * x["on"][f"{clock}_median"], 1e3 * x["off"][f"{clock}_median"]
            lines.append(f"| {label}, {clock} | {on:.0f} ms | {off:.0f} ms | {x[f'speedup_{clock}']:.1f}x |")
        lines.append(f"| {label}: prompt / cached tokens (mean) | {x['on']['prompt_mean']:.0f} / "
                     f"{x['on']['cached_mean']:.0f} | {x['off']['prompt_mean']:.0f} / {x['off']['cached_mean']:.0f} "
                     "| |")
    t = s["throughput"]
    lines.append(f"| batch: wall to finish all | {t['on']['wall']:.1f} s | {t['off']['wall']:.1f} s "
                 f"| {t['speedup_wall']:.1f}x |")
    lines.append(f"| batch: generated tokens/s | {t['on']['generated_per_s']:.1f} | {t['off']['generated_per_s']:.1f} "
                 f"| |")
    lines.append(f"| batch: prompt tokens/s | {t['on']['prompt_per_s']:.0f} | {t['off']['prompt_per_s']:.0f} | |")
    lines.append(f"| batch: mean TTFT under load | {t['on']['mean_ttft']:.2f} s | {t['off']['mean_ttft']:.2f} s "
                 f"| {t['off']['mean_ttft'] / t['on']['mean_ttft']:.1f}x |")
    return "\n".join(lines)
