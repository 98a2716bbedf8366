"""Teacher-forced scoring with the engine's decode semantics (early exit, KV layouts, lookahead).

`score_windows` runs many equal-length windows side by side, each as its own request: the first
`prompt_len` tokens are prefilled as one chunk at full depth (prompt tokens never exit early), then
every later position is a decode work item fed the *true* token (teacher forcing) instead of a
sampled one. Each item loops through the core until its exit rule says stop, its next-token
distribution is read at its exit depth, and its KV depth is recorded so later tokens read KV by
the layout's rule. This is the reference decoder's loop (`engine/reference.py`), batched over
windows with the same `KVStore`, `KVLayout`, `ForwardContext` and `ExitTracker`; a window only
ever reads its own KV rows, so the batching does not change what any window computes.

Exit modes:
- `fixed` (depth d): every item runs d loops.
- `gate`: Ouro's Q-exit on the main gate (CDF after step r >= q).
- `gate` + `lookahead="delayed"`: the engine's delayed lookahead (decision after r, step r + 1
  still runs and is discarded; exit depth r, KV depth r + 1).
- `lookahead_gate`: the distilled head predicts, from the state after step r, the main gate's
  logit after step r + 1. With the main gate's hazards lambda_1..lambda_r and the predicted
  lambda_{r+1}, the item decides after step r whether step r + 1 is its last:
  1 - prod_{j<=r}(1 - lambda_j) * (1 - lambda_hat_{r+1}) >= q. It then runs step r + 1 and exits at
  depth r + 1 with that step's state, so no loop is wasted and batch r + 2 is known one step early
  (earliest exit: depth 2).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from loopserve.cache.layout import IN_FLIGHT, LAYOUTS
from loopserve.exits import ExitRule, ExitTracker
from loopserve.models.layers import compute_dtype, rope_rotate_half
from loopserve.models.ouro import OuroForCausalLM

MODES = ("fixed", "gate", "lookahead_gate")


@dataclass
class ScoreResult:
    logprobs: torch.Tensor  # [W, S - prompt_len - 1] float64: log p(true next token) of each decode item
    depths: torch.Tensor  # [W, S - prompt_len - 1] exit depth of each decode item
    loops: torch.Tensor  # [W, S - prompt_len - 1] loops run (delayed lookahead: depth + 1 on early exits)

    @property
    def nll(self) -> float:
        return float(-self.logprobs.mean())

    @property
    def ppl(self) -> float:
        return math.exp(self.nll)

    @property
    def mean_depth(self) -> float:
        return float(self.depths.double().mean())

    @property
    def mean_loops(self) -> float:
        return float(self.loops.double().mean())

    def summary(self) -> dict:
        n = self.depths.numel()
        hist = [int((self.depths == d).sum()) for d in range(1, int(self.depths.max()) + 1)]
        return {"ppl": self.ppl, "nll": self.nll, "mean_depth": self.mean_depth, "mean_loops": self.mean_loops,
                "tokens": n, "depth_hist": hist}


def _make_tracker(mode: str, threshold: float | None, max_loops: int, min_loops: int, lookahead: bool):
    if mode == "fixed":
        return ExitTracker(ExitRule("fixed", None, min_loops, max_loops), 0)
    if mode == "gate":
        return ExitTracker(ExitRule("gate", threshold, min_loops, max_loops, (), lookahead), 0)
    if mode == "lookahead_gate":
        return ExitTracker(ExitRule("lookahead_gate", threshold, max(min_loops, 2), max_loops), 0)
    raise ValueError(f"mode: expected one of {MODES}, got {mode!r}")


class _WindowCache:
    """Contiguous KV per window: k/v [depth slots, layers, W, kv_heads, S, head_dim] + KV depth [W, S].

    `last_exited` is stored copy-on-exit (a token's deepest slot is copied into the deeper slots when
    it stops looping), so a query at depth r always reads slot r; this equals the engine's copy-free
    clamped read slot min(r, e) (cache/layout.py)."""

    def __init__(self, layout: str, n_layers: int, r_max: int, n_win: int, seq: int, nkv: int, hd: int, dtype, dev):
        if layout not in LAYOUTS:
            raise ValueError(f"kv_layout: unknown layout {layout!r}; choose one of {', '.join(LAYOUTS)}")
        self.layout = layout
        slots = 1 if layout == "shared" else r_max
        self.k = torch.zeros(slots, n_layers, n_win, nkv, seq, hd, dtype=dtype, device=dev)
        self.v = torch.zeros_like(self.k)
        self.depth = torch.full((n_win, seq), IN_FLIGHT, dtype=torch.long, device=dev)

    def slot(self, r: int) -> int:
        return 0 if self.layout == "shared" else r - 1

    def finish(self, rows: torch.Tensor, pos: int, kv_depth: torch.Tensor) -> None:
        self.depth[rows, pos] = kv_depth
        if self.layout != "last_exited":
            return
        slots = self.k.shape[0]
        for e in kv_depth.unique().tolist():
            if e >= slots:
                continue
            sel = rows[kv_depth == e]
            self.k[e:, :, sel, :, pos] = self.k[e - 1, :, sel, :, pos].unsqueeze(0)
            self.v[e:, :, sel, :, pos] = self.v[e - 1, :, sel, :, pos].unsqueeze(0)


def _attention_layer(model: OuroForCausalLM, li: int, x: torch.Tensor, rows: torch.Tensor | None, pos: int,
                     r: int, cache: _WindowCache, rope: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """One Ouro decoder layer for one decode row per window (the same ops as models/ouro.py and the
    decode branch of models/layers.paged_attention), reading this window's contiguous cache."""
    c = model.config
    layer = model.model.layers[li]
    attn = layer.self_attn
    n, nh, nkv, d = x.shape[0], c.num_heads, c.num_kv_heads, c.head_dim
    h = layer.input_layernorm(x)
    q = attn.q_proj(h).view(n, nh, d)
    k = attn.k_proj(h).view(n, nkv, d)
    v = attn.v_proj(h).view(n, nkv, d)
    cos, sin = rope
    q, k = rope_rotate_half(q, cos, sin), rope_rotate_half(k, cos, sin)
    s = cache.slot(r)
    kc, vc = cache.k[s, li], cache.v[s, li]  # [W, nkv, S, d]
    if rows is None:
        kc[:, :, pos], vc[:, :, pos] = k, v
        kk, vv, kd = kc[:, :, : pos + 1], vc[:, :, : pos + 1], cache.depth[:, : pos + 1]
    else:
        kc[rows, :, pos], vc[rows, :, pos] = k, v
        kk, vv, kd = kc[rows, :, : pos + 1], vc[rows, :, : pos + 1], cache.depth[rows, : pos + 1]
    cdt = compute_dtype(q.dtype)
    qg = q.view(n, nkv, nh // nkv, d).to(cdt)
    scores = torch.matmul(qg, kk.to(cdt).transpose(-1, -2)) * d ** -0.5  # [n, nkv, g, L]
    if cache.layout == "depth_indexed":  # tokens that never ran depth r have no entry there
        scores = scores.masked_fill(~(kd >= r)[:, None, None, :], float("-inf"))
    out = torch.matmul(scores.softmax(-1), vv.to(cdt)).reshape(n, nh * d).to(q.dtype)
    x = x + layer.input_layernorm_2(attn.o_proj(out))
    return x + layer.post_attention_layernorm_2(layer.mlp(layer.post_attention_layernorm(x)))


def _rope(model: OuroForCausalLM, pos: int, n: int, dtype, dev):
    c = model.config
    cdt = compute_dtype(dtype)
    inv = 1.0 / (c.rope_theta ** (torch.arange(0, c.head_dim, 2, dtype=torch.float64, device=dev) / c.head_dim))
    ang = torch.full((n, 1), float(pos), dtype=torch.float64, device=dev) * inv[None, :]
    return ang.cos().to(cdt), ang.sin().to(cdt)


@torch.no_grad()
def score_windows(model: OuroForCausalLM, wins: torch.Tensor, layout: str = "depth_indexed", mode: str = "gate",
                  threshold: float | None = None, depth: int | None = None, prompt_len: int = 1,
                  lookahead: bool = False, min_loops: int = 1) -> ScoreResult:
    """Teacher-forced scoring of `wins` [W, S] (see the module docstring).

    `depth`: the fixed depth (mode "fixed") or max_loops (default r_max). `threshold`: the gate's
    q (modes "gate" and "lookahead_gate"; default the config's `early_exit_threshold`).
    `lookahead`: the engine's delayed lookahead (mode "gate" only). The prompt is prefilled token by
    token at full depth. That equals the engine's one-chunk prefill for `depth_indexed` and
    `last_exited` at any prompt length, and for `shared` with `prompt_len=1` (the default); with a
    longer prompt, `shared` chunk tokens would see each other's same-depth KV instead.
    """
    c = model.config
    dev = next(model.parameters()).device
    dtype = next(model.parameters()).dtype
    max_loops = depth or c.r_max
    if mode != "fixed" and threshold is None:
        threshold = c.exit_threshold or 1.0
    if mode == "lookahead_gate" and not model.has_lookahead_gate:
        raise ValueError("mode 'lookahead_gate' needs a checkpoint with lookahead_gate.* tensors")
    n_win, seq = wins.shape
    if not 1 <= prompt_len < seq - 1:
        raise ValueError(f"prompt_len must be in [1, {seq - 2}], got {prompt_len}")
    cache = _WindowCache(layout, c.n_core, c.r_max, n_win, seq, c.num_kv_heads, c.head_dim, dtype, dev)
    wins = wins.to(dev)
    n_items = seq - prompt_len - 1
    out_lp = torch.empty(n_win, n_items, dtype=torch.float64)
    out_depth = torch.empty(n_win, n_items, dtype=torch.long)
    out_loops = torch.empty(n_win, n_items, dtype=torch.long)
    all_rows = torch.arange(n_win, device=dev)
    for pos in range(seq - 1):
        prompt = pos < prompt_len
        item_mode = "fixed" if prompt else mode
        need_gate = item_mode != "fixed"
        state = model.model.embed_tokens(wins[:, pos])
        rope_all = _rope(model, pos, n_win, state.dtype, dev)
        final = torch.empty_like(state)
        trackers = [_make_tracker(item_mode, threshold, max_loops, min_loops, lookahead) for _ in range(n_win)]
        loops = [0] * n_win
        active = list(range(n_win))
        r = 0
        while active:
            r += 1
            full = len(active) == n_win
            idx = None if full else torch.tensor(active, device=dev)
            x = state if full else state[idx]
            rope = rope_all if full else (rope_all[0][: len(active)], rope_all[1][: len(active)])
            for li in range(c.n_core):
                x = _attention_layer(model, li, x, idx, pos, r, cache, rope)
            new = model.model.norm(x)
            main = model.gate_logit(new).tolist() if need_gate else None
            ahead = model.lookahead_gate_logit(new).tolist() if item_mode == "lookahead_gate" else None
            still = []
            for j, w in enumerate(active):
                t = trackers[w]
                loops[w] = r
                if t.frozen:  # delayed lookahead: this step ran, its state is discarded
                    final[w] = state[w]
                    continue
                state[w] = new[j]
                sig = None if main is None else (main[j], ahead[j]) if ahead is not None else main[j]
                if t.observe(r, sig):
                    still.append(w)
                else:
                    final[w] = new[j]
            active = still
        cache.finish(all_rows, pos, torch.tensor(loops, device=dev))
        if prompt and pos + 1 < prompt_len:
            continue
        k = pos - prompt_len
        if k < 0:
            continue  # the prompt's own prediction (full depth) is not scored
        lp = torch.log_softmax(model.coda(final, None).to(torch.float64), -1)
        out_lp[:, k] = lp.gather(1, wins[:, pos + 1, None])[:, 0].cpu()
        out_depth[:, k] = torch.tensor([t.exit_depth or loops[w] for w, t in enumerate(trackers)])
        out_loops[:, k] = torch.tensor(loops)
    return ScoreResult(out_lp, out_depth, out_loops)
