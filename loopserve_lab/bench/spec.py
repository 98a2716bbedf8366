"""`bench spec`: self-speculative decoding vs plain decoding (docs/benchmarks.md §11).

Two engines, identical but for `num_speculative_tokens` (and the draft depth), decode the same
greedy requests (the model's own exit policy and threshold) side by side, interleaved (the order
alternates per round: this machine is shared and noisy), on the CPU clock (`time.process_time`):

- depths: one request at a time, for each draft depth: acceptance (accepted / drafted), tokens per
  verify pass, and CPU time per generated token against plain decoding;
- concurrency (at the draft depth that did best alone): c requests at once (c = 1, 2, 4, 8), CPU
  time to finish them divided by the tokens each generated (every request streams one token per
  that much time): the latency per token;
- throughput: 32 requests at once, generated tokens per CPU second. With the default
  `speculative_max_batch` the speculative engine drafts nothing there (the engine is compute-bound).

Both engines' outputs are compared token for token (speculation must not change them).
Prompts: for a checkpoint with a trained tokenizer, lines of Shakespeare; else random token runs.
"""

from __future__ import annotations

import statistics
import time
from typing import Any

import numpy as np

from loopserve import SamplingParams
from loopserve.engine.engine import LLMEngine
from loopserve_lab.bench.workloads import regular_token_ids

MODES = ("spec", "plain")
OPENINGS = ["ROMEO:\n", "JULIET:\nO Romeo, Romeo,", "First Citizen:\nBefore we proceed any further,",
            "KING RICHARD III:\nNow is the winter", "HAMLET:\nTo be, or not", "MENENIUS:\nWhat work's, my",
            "DUKE VINCENTIO:\nBe absolute for", "LADY MACBETH:\nThe raven himself", "PROSPERO:\nOur revels now",
            "BRUTUS:\nThere is a tide", "PORTIA:\nThe quality of mercy", "GLOUCESTER:\nWhat news abroad?"]


def build_prompts(tokenizer, n: int, seed: int, text: bool) -> list[list[int]]:
    """n prompts: Shakespeare openings (cycled, each with a distinct speaker line) or random token runs."""
    if text:
        return [tokenizer.encode(OPENINGS[i % len(OPENINGS)] + ("" if i < len(OPENINGS) else " " * (i // 12)))
                for i in range(n)]
    rng = np.random.default_rng(seed)
    vocab = regular_token_ids(tokenizer)
    return [[int(t) for t in rng.choice(vocab, 16)] for _ in range(n)]


def _params(max_tokens: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


def _batch(engine: LLMEngine, prompts: list[list[int]], max_tokens: int, tag: str) -> dict[str, Any]:
    """Run prompts at once to completion: CPU and wall time, tokens, and the speculation stats it added."""
    st = engine.stats
    before = (st.spec_rounds, st.spec_draft_tokens, st.spec_accepted_tokens, st.spec_tokens)
    for i, p in enumerate(prompts):
        engine.add_request(f"{tag}-{i}", p, _params(max_tokens))
    outs: dict[str, list[int]] = {}
    w0, c0 = time.perf_counter(), time.process_time()
    while engine.has_unfinished_requests():
        for o in engine.step():
            if o.finished:
                outs[o.request_id] = o.outputs[0].token_ids
    cpu, wall = time.process_time() - c0, time.perf_counter() - w0
    rounds, drafted, accepted, emitted = (a - b for a, b in zip(
        (st.spec_rounds, st.spec_draft_tokens, st.spec_accepted_tokens, st.spec_tokens), before, strict=True))
    tokens = [outs[f"{tag}-{i}"] for i in range(len(prompts))]
    return {"cpu": cpu, "wall": wall, "tokens": tokens, "generated": sum(len(t) for t in tokens),
            "rounds": rounds, "drafted": drafted, "accepted": accepted, "emitted": emitted}


def _interleaved(engines: dict[str, LLMEngine], prompts: list[list[int]], max_tokens: int, rounds: int,
                 tag: str) -> dict[str, list[dict[str, Any]]]:
    runs: dict[str, list[dict[str, Any]]] = {m: [] for m in engines}
    for k in range(rounds):
        for m in (list(engines) if k % 2 == 0 else list(engines)[::-1]):
            runs[m].append(_batch(engines[m], prompts, max_tokens, f"{tag}-{m}-{k}"))
    return runs


def _summary(runs: list[dict[str, Any]], per_request_tokens: int) -> dict[str, Any]:
    cpu = statistics.median(r["cpu"] for r in runs)
    drafted, accepted = sum(r["drafted"] for r in runs), sum(r["accepted"] for r in runs)
    rounds, emitted = sum(r["rounds"] for r in runs), sum(r["emitted"] for r in runs)
    return {"cpu_median": cpu, "ms_per_token": 1e3 * cpu / per_request_tokens,
            "tokens_per_cpu_s": runs[0]["generated"] / cpu,
            "acceptance": accepted / drafted if drafted else None,
            "tokens_per_verify": emitted / rounds if rounds else None, "verify_passes": rounds}


def _same(runs: dict[str, list[dict[str, Any]]]) -> bool:
    return all(r["tokens"] == runs["plain"][0]["tokens"] for m in runs for r in runs[m])


def run(make_engine, prompts: list[list[int]], k: int, draft_loops: list[int], concurrency: list[int],
        throughput_batch: int, max_tokens: int, rounds: int) -> dict[str, Any]:
    """`make_engine(**cfg)` builds an engine; speculative ones get `num_speculative_tokens=k`."""
    plain = make_engine(num_speculative_tokens=0)
    spec = {d: make_engine(num_speculative_tokens=k, speculative_draft_loops=d) for d in draft_loops}
    for e in [plain, *spec.values()]:  # warm up
        _batch(e, prompts[:1], 8, "warm")
    out: dict[str, Any] = {"k": k, "max_tokens": max_tokens, "rounds": rounds, "depths": [], "concurrency": []}
    for d, engine in spec.items():
        runs = _interleaved({"spec": engine, "plain": plain}, prompts[:1], max_tokens, rounds, f"d{d}")
        s, p = _summary(runs["spec"], max_tokens), _summary(runs["plain"], max_tokens)
        out["depths"].append({"draft_loops": d, "spec": s, "plain": p, "same_tokens": _same(runs),
                              "speedup": p["ms_per_token"] / s["ms_per_token"]})
    best = spec[max(out["depths"], key=lambda r: r["speedup"])["draft_loops"]]  # for the rest
    out["draft_loops"] = next(d for d, e in spec.items() if e is best)
    for c in concurrency:
        runs = _interleaved({"spec": best, "plain": plain}, prompts[:c], max_tokens, rounds, f"c{c}")
        s, p = _summary(runs["spec"], max_tokens), _summary(runs["plain"], max_tokens)
        out["concurrency"].append({"concurrency": c, "spec": s, "plain": p, "same_tokens": _same(runs),
                                   "speedup": p["ms_per_token"] / s["ms_per_token"]})
    runs = _interleaved({"spec": best, "plain": plain}, prompts[:throughput_batch], max_tokens, max(1, rounds // 2),
                        "tp")
    s, p = _summary(runs["spec"], max_tokens), _summary(runs["plain"], max_tokens)
    out["throughput"] = {"batch": throughput_batch, "spec": s, "plain": p, "same_tokens": _same(runs),
                         "ratio": s["tokens_per_cpu_s"] / p["tokens_per_cpu_s"]}
    return out


def format_summary(res: dict[str, Any]) -> str:
    def f(x, spec: str = ".2f") -> str:
        return "-" if x is None else format(x, spec)

    lines = [f"draft depth (k={res['k']}, concurrency 1): acceptance, tokens per verify pass, ms/token spec vs plain",
             f"{'loops':>6}{'accept':>8}{'tok/pass':>9}{'spec ms':>9}{'plain ms':>9}{'speedup':>8}{'same':>6}"]
    for r in res["depths"]:
        s, p = r["spec"], r["plain"]
        lines.append(f"{r['draft_loops']:>6}{f(s['acceptance']):>8}{f(s['tokens_per_verify']):>9}"
                     f"{s['ms_per_token']:>9.2f}{p['ms_per_token']:>9.2f}{r['speedup']:>7.2f}x{str(r['same_tokens']):>6}")
    lines += [f"latency per token (CPU ms) by concurrency, draft loops {res['draft_loops']}",
              f"{'conc':>6}{'accept':>8}{'tok/pass':>9}{'spec ms':>9}{'plain ms':>9}{'speedup':>8}{'same':>6}"]
    for r in res["concurrency"]:
        s, p = r["spec"], r["plain"]
        lines.append(f"{r['concurrency']:>6}{f(s['acceptance']):>8}{f(s['tokens_per_verify']):>9}"
                     f"{s['ms_per_token']:>9.2f}{p['ms_per_token']:>9.2f}{r['speedup']:>7.2f}x{str(r['same_tokens']):>6}")
    t = res["throughput"]
    lines.append(f"throughput at {t['batch']}: spec engine {t['spec']['tokens_per_cpu_s']:.0f} tok/CPU-s "
                 f"({t['spec']['verify_passes']} verify passes), plain {t['plain']['tokens_per_cpu_s']:.0f} "
                 f"(ratio {t['ratio']:.2f}, same tokens {t['same_tokens']})")
    return "\n".join(lines)
