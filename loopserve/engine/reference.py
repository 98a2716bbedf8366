"""The sequential reference decoder: the spec the batching engine is tested against.

One request, one token, one loop step at a time, over a plain contiguous KV cache, with the same
KV layout rule, exit policy and sampler as the engine. Prompts are prefilled in fixed chunks of
`prefill_chunk` tokens counted from the prompt's start; all tokens of a chunk move depth by depth
together and run every loop up to `max_loops` (prompt tokens never exit early).
"""

from __future__ import annotations

import torch

from loopserve.cache.layout import IN_FLIGHT, KVLayout
from loopserve.cache.pool import KVStore
from loopserve.engine.sampler import REQUEST_ERRORS, prompt_logprobs
from loopserve.engine.sequence import Sequence, failure
from loopserve.engine.signals import step_signals, uniform_logprobs
from loopserve.errors import NON_FINITE_PROMPT, NonFiniteError
from loopserve.models.base import LoopedLM
from loopserve.models.context import build_context


class ReferenceDecoder:
    def __init__(self, model: LoopedLM, layout: KVLayout, prefill_chunk: int) -> None:
        self.model, self.layout, self.prefill_chunk = model, layout, prefill_chunk
        c = model.config
        self.has_coda_kv = c.n_coda > 0
        self.device = next(model.parameters()).device
        self.dtype = next(model.parameters()).dtype

    @torch.no_grad()
    def run(self, seq: Sequence) -> Sequence:
        c, model, dev = self.model.config, self.model, self.device
        kv = KVStore(seq.num_tokens + seq.max_new, self.layout.slots_per_token, c.num_kv_heads,
                     c.head_dim, self.dtype, dev)
        rows = torch.arange(kv.capacity)
        prompt, depth = seq.prompt_ids, seq.rule.max_loops
        for start in range(0, len(prompt), self.prefill_chunk):
            n = min(self.prefill_chunk, len(prompt) - start)
            last = start + n == len(prompt)
            ctx = build_context(kv, self.layout, [(rows, start, n)])
            ids = torch.tensor(prompt[start:start + n], device=dev)
            state, inject = model.prelude(ids, ctx, [seq.state_seed(p) for p in range(start, start + n)])
            for r in range(1, depth + 1):
                state = model.core_step(state, inject, ctx.with_depth(torch.full((n,), r, device=dev)))
            kv.set_depth(ctx.write_rows, depth)
            if not bool(torch.isfinite(state).all()):  # (as the engine: the request fails, not a later token)
                self._fail(seq, NonFiniteError(NON_FINITE_PROMPT))
                return seq
            seq.metrics.prefill_loops += depth * n
            coda_rows = [n - 1] if last else []
            k = seq.params.prompt_logprobs
            scored = min(n, len(prompt) - 1 - start) if k is not None else 0  # prompt tokens this chunk scores
            coda_rows += range(scored)
            if self.has_coda_kv or coda_rows:
                logits = model.coda(state, ctx, torch.tensor(coda_rows, dtype=torch.long, device=dev))
            if scored > 0:
                targets = torch.tensor(prompt[start + 1:start + 1 + scored], device=dev)
                lp = prompt_logprobs(logits[len(coda_rows) - scored:], targets, k or 0)
                try:
                    seq.set_prompt_logprobs(start, {name: t.cpu().numpy() for name, t in lp.items()})
                except REQUEST_ERRORS as e:  # (non-finite logits: as `_take`)
                    self._fail(seq, e)
                    return seq
            if last:
                first = logits[0]
        self._take(seq, first, depth)
        while not seq.finished:
            self._decode_token(seq, kv, rows)
        return seq

    def _decode_token(self, seq: Sequence, kv: KVStore, rows: torch.Tensor) -> None:
        model, dev = self.model, self.device
        pos = seq.num_tokens - 1
        ctx = build_context(kv, self.layout, [(rows, pos, 1)])
        kv.set_depth(ctx.write_rows, IN_FLIGHT)
        state, inject = model.prelude(torch.tensor([seq.output_ids[-1]], device=dev), ctx, [seq.state_seed(pos)])
        tracker = seq.rule.new_item(seq.decode_index)
        kinds = {seq.rule.signal} if seq.rule.signal else set()
        prev_lp = uniform_logprobs(1, model.config.vocab_size, torch.float64, dev) if "kl" in kinds else None
        r = 0
        while True:
            r += 1
            new = model.core_step(state, inject, ctx.with_depth(torch.tensor([r], device=dev)))
            if tracker.frozen:  # lookahead: the step ran, its state is discarded
                break
            sig, lp = step_signals(model, kinds, state, new, ctx, prev_lp, [0])
            if lp is not None:
                prev_lp = lp.to(torch.float64)
            state = new
            value = sig[seq.rule.signal].tolist()[0] if seq.rule.signal else None
            try:
                if not tracker.observe(r, value):
                    break
            except REQUEST_ERRORS as e:  # (a non-finite signal: the request fails alone, as in the engine)
                self._fail(seq, e)
                return
        kv.set_depth(ctx.write_rows, r)
        seq.metrics.loops_run += r
        self._take(seq, model.coda(state, ctx)[0], tracker.exit_depth or r)

    def _take(self, seq: Sequence, logits: torch.Tensor, exit_depth: int) -> None:
        """Sample and append the next token. A failure of the request's own making (`REQUEST_ERRORS`: non-finite
        logits, its grammar past the parser's limits, sampling constraints that leave no token) finishes it with
        finish_reason "error", as the engine does (`Scheduler.fail`: the same error and status); any other raises
        (the spec: a bug is not a request's outcome)."""
        try:
            seq.sample_and_append(logits, exit_depth)
        except REQUEST_ERRORS as e:
            self._fail(seq, e)

    @staticmethod
    def _fail(seq: Sequence, error: Exception) -> None:
        """Finish a request that failed alone, with the engine's error and status (`failure`)."""
        message, status = failure(error)
        seq.finish("error", message, error_status=status)
