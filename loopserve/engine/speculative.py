"""Self-speculative decoding (docs/design.md §12): which requests draft and how many tokens, the
verify group of one round, and each request's acceptance.

A looped model is its own draft model. After its last accepted token x_t, a request drafts k tokens,
each run for `speculative_draft_loops` loop steps and a greedy coda (one DRAFT stage batch,
`ModelRunner.draft`). Positions t..t+k then run as k+1 ordinary decode work items of one
`VerifyGroup`: prelude, core steps each under the request's own exit rule (beside other requests'
rows), and one coda for the whole group, which samples position p with plain decoding's (seed,
counter). The scheduler accepts the drafts up to the first one that differs from the verifier's own
sample, plus that sample: exactly the tokens and exit depths plain decoding gives.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from loopserve.engine.config import SPECULATIVE_PAUSE, SPECULATIVE_WINDOW, EngineConfig
from loopserve.engine.sequence import Sequence, chain_seed

if TYPE_CHECKING:
    from loopserve.engine.runner import WorkItem



@dataclass(eq=False)
class VerifyGroup:
    """One round of one request: the rows verifying positions start..start+k, fed `tokens` (x_t, then
    the k drafts). Its items enter the prelude together and run one coda together, once all exited."""

    seq: Sequence
    start: int  # position of x_t, the last accepted token
    tokens: list[int]
    items: list[WorkItem] = field(default_factory=list)

    @property
    def drafts(self) -> list[int]:
        return self.tokens[1:]

    def token_at(self, position: int) -> int:
        return self.tokens[position - self.start]

    def state_seed(self, position: int) -> int:
        """Initial-state seed of the row at `position` (Huginn like-init): the request's chain
        (`Sequence.state_seed`) continued over the drafts, which equals the real chain wherever the
        drafts are accepted."""
        seed = self.seq.state_seed(self.start)
        for token in self.tokens[1:position - self.start + 1]:
            seed = chain_seed(seed, token)
        return seed

    @property
    def exited(self) -> bool:
        return all(item.exited for item in self.items)


class Speculator:
    """Decides how many tokens a request drafts this round (0: it decodes plainly) and keeps its
    acceptance. Requests that ask for no drafts (`num_speculative_tokens=0`) never draft, nor do
    those whose sampling reads the tokens before it (penalties, `min_tokens`, `bad_words`, a
    grammar): verifying several positions at once would need each row's own history. Nor do KL-exit
    requests on models with coda layers: the KL signal runs the coda every loop, so a verify row would
    read the intermediate coda KV of the rows before it, not their final one."""

    def __init__(self, cfg: EngineConfig, coda_kv: bool) -> None:
        self.k, self.loops = cfg.num_speculative_tokens, cfg.speculative_draft_loops
        self.max_batch, self.min_acceptance = cfg.speculative_max_batch, cfg.speculative_min_acceptance
        self.coda_kv = coda_kv
        self._rounds: dict[str, deque[tuple[int, int]]] = {}  # request -> (drafted, accepted) of its last rounds
        self._paused: dict[str, int] = {}  # request -> its output length when it drafts again

    def eligible(self, seq: Sequence) -> bool:
        p = seq.params
        if (p.num_speculative_tokens == 0 or p.penalized or p.min_tokens or p.bad_words
                or p.guide is not None):
            return False
        return not (self.coda_kv and seq.rule.signal == "kl")

    def tokens_for(self, seq: Sequence, resident: int, width: int) -> int:
        """Drafts for `seq`'s next round: none while `resident` sequences make the engine compute-bound,
        for a request that cannot or no longer should draft, or with fewer than two tokens to go;
        else k (or the request's own `num_speculative_tokens`, at most k: `make_sequence` refuses more),
        capped so the group fits a `width`-row batch and drafts nothing past `max_tokens`."""
        if resident >= self.max_batch or not self.eligible(seq):
            return 0
        if len(seq.output_ids) < self._paused.get(seq.request_id, 0):
            return 0
        left = seq.max_new - len(seq.output_ids)  # the round emits up to k + 1 of these
        asked = seq.params.num_speculative_tokens or self.k  # unset: k (0 is not eligible)
        return max(0, min(asked, width - 1, left - 1))

    def record(self, seq: Sequence, drafted: int, accepted: int) -> None:
        """One round's outcome (before its tokens are appended); a request accepting under `min_acceptance` of its
        drafts over the last `SPECULATIVE_WINDOW` rounds decodes the next `SPECULATIVE_PAUSE` tokens plainly (drafting
        would cost more than it saves), then drafts again with a fresh window."""
        rounds = self._rounds.setdefault(seq.request_id, deque(maxlen=SPECULATIVE_WINDOW))
        rounds.append((drafted, accepted))
        judged = len(rounds) == SPECULATIVE_WINDOW
        if judged and sum(a for _, a in rounds) < self.min_acceptance * sum(d for d, _ in rounds):
            self._paused[seq.request_id] = len(seq.output_ids) + accepted + 1 + SPECULATIVE_PAUSE
            rounds.clear()

    def pause(self, seq: Sequence) -> None:
        """`seq` decodes the next `SPECULATIVE_PAUSE` tokens plainly (a row verifying its draft failed)."""
        self._paused[seq.request_id] = len(seq.output_ids) + SPECULATIVE_PAUSE
        self._rounds.pop(seq.request_id, None)

    def forget(self, request_id: str) -> None:
        self._rounds.pop(request_id, None)
        self._paused.pop(request_id, None)
