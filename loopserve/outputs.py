"""What `generate` returns (vLLM's shapes, plus per-token exit depths and loop counts)."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Iterator
from collections.abc import Sequence as SequenceABC
from dataclasses import dataclass, field
from typing import Any, overload

import numpy as np


@dataclass
class Logprob:
    logprob: float
    rank: int | None = None
    decoded_token: str | None = None  # the token's text as decoded alone (' the', not the BPE symbol 'Ġthe')


def logprob_entry(token: int, logprob: float, rank: int, top: Iterable[tuple[int, float]],
                  decode: Callable[[int], str | None]) -> dict[int, Logprob]:
    """A token's logprob entry in vLLM's order (V1): the token's own first, then the `top` (id, logprob) pairs by rank
    (the token once, first, with its top rank, when it is among them); `decode`: a token's text (vLLM's
    decoded_token)."""
    ranked = {i: Logprob(v, r, decode(i)) for r, (i, v) in enumerate(top, start=1)}
    own = ranked.pop(token, None)
    if own is None:
        own = Logprob(logprob, rank, decode(token))
    return {token: own, **ranked}


class PromptLogprobs(SequenceABC):
    """`RequestOutput.prompt_logprobs`, read as vLLM's list: an entry per prompt token, None for the first (nothing
    precedes it), else {token id: Logprob}, the token's own first, then the top ones by rank (the token once, first,
    with its top rank, when it is among them). Held as the arrays the device computed, a prefilled chunk at a time;
    the entries (a `Logprob` each, its token's text decoded) are made when first read, by whoever reads them (the
    server's response formatter runs off the engine thread), not by the engine as each chunk lands: a prompt of 1,000
    tokens at 20 logprobs is 21,000 of them."""

    def __init__(self, length: int, k: int, decode: Callable[[int], str | None]) -> None:
        """`length` prompt tokens, `k` top logprobs each; `decode`: a token's text (vLLM's decoded_token)."""
        self._length, self._k, self._decode = length, k, decode
        self._chunks: list[tuple[int, dict[str, np.ndarray]]] = []
        # the entries, and the chunk list they were made from (`add` swaps in a new list: a chunk added since, maybe
        # while another thread made them, leaves them stale)
        self._entries: tuple[list | None, list[dict[int, Logprob] | None]] = (None, [])

    def add(self, position: int, rows: dict[str, np.ndarray]) -> None:
        """The logprobs of prompt tokens position+1, position+2, ...: row j of `rows` scores token position+1+j
        ("tokens", "lp_chosen", "lp_rank" and, for k > 0, "lp_top_ids" / "lp_top_vals" of at least k columns). A
        position given twice (a prompt prefilled again after preemption) takes the later row, the same values."""
        # copies of its rows and top k: the batch's arrays (every request's, the batch's largest k) are not kept alive
        names = ("tokens", "lp_chosen", "lp_rank", *(("lp_top_ids", "lp_top_vals") if self._k else ()))
        chunk = {name: rows[name][:, :self._k].copy() if rows[name].ndim == 2 else rows[name].copy() for name in names}
        end = position + len(chunk["tokens"])
        # (one list, swapped whole: a reader on another thread sees the old or the new; chunks this one covers go)
        kept = [(p, c) for p, c in self._chunks if not (position <= p and p + len(c["tokens"]) <= end)]
        self._chunks = [*kept, (position, chunk)]

    def _list(self) -> list[dict[int, Logprob] | None]:
        chunks = self._chunks
        made_from, entries = self._entries
        if made_from is not chunks:
            entries = [None] * self._length
            decode, k = self._decode, self._k
            for position, rows in chunks:
                n = len(rows["tokens"])
                tops = (zip(rows["lp_top_ids"].tolist(), rows["lp_top_vals"].tolist(), strict=True) if k
                        else [((), ())] * n)
                own = zip(rows["tokens"].tolist(), rows["lp_chosen"].tolist(), rows["lp_rank"].tolist(), strict=True)
                for j, ((token, lp, rank), (ids, vals)) in enumerate(zip(own, tops, strict=True)):
                    entries[position + 1 + j] = logprob_entry(token, lp, rank, zip(ids, vals, strict=True), decode)
            self._entries = (chunks, entries)
        return entries

    @overload
    def __getitem__(self, i: int) -> dict[int, Logprob] | None: ...

    @overload
    def __getitem__(self, i: slice) -> list[dict[int, Logprob] | None]: ...

    def __getitem__(self, i: int | slice) -> Any:
        return self._list()[i]

    def __len__(self) -> int:
        return self._length

    def __iter__(self) -> Iterator[dict[int, Logprob] | None]:
        return iter(self._list())

    def __eq__(self, other: object) -> bool:
        if isinstance(other, PromptLogprobs | list):
            return self._list() == list(other)
        return NotImplemented

    __hash__ = None  # type: ignore[assignment]  # (mutable, compared by value, as the list it stands for)

    def __repr__(self) -> str:
        return repr(self._list())

    def __add__(self, other: object) -> list:
        return self._list() + list(other) if isinstance(other, PromptLogprobs | list) else NotImplemented

    def __radd__(self, other: object) -> list:
        return list(other) + self._list() if isinstance(other, list) else NotImplemented

    def copy(self) -> list[dict[int, Logprob] | None]:
        """A plain list of the entries (as `list.copy`)."""
        return list(self._list())

    def __reduce__(self) -> tuple[type, tuple[list]]:
        """Pickled (an output sent to another process) and copied as the list it reads as: no tokenizer goes along."""
        return list, (self._list(),)


# RequestMetrics' times are wall-clock seconds, as vLLM's (its `add_request(arrival_time=time.time())`), read off the
# monotonic clock plus the two clocks' offset taken once, so the intervals between them never run backwards when the
# system clock is set (they were monotonic seconds: a caller's time.time() arrival gave a TTFT of -1.8e9 s)
_WALL_OFFSET = time.time() - time.monotonic()


def request_clock() -> float:
    """Now, in the seconds of `RequestMetrics`' times."""
    return time.monotonic() + _WALL_OFFSET


@dataclass
class RequestMetrics:
    """A request's times (`request_clock` seconds: wall-clock) and the loops spent on it."""

    arrival_time: float
    first_token_time: float | None = None
    finished_time: float | None = None
    loops_run: int = 0  # core loop steps spent on this request's decode tokens
    prefill_loops: int = 0  # core loop steps per prompt token, summed over the prompt tokens computed
    last_token_time: float | None = None

    def snapshot(self) -> RequestMetrics:
        """A copy (the engine goes on writing a running request's own), made field by field: a fifth of copy.copy's
        time, for an output per token."""
        return RequestMetrics(self.arrival_time, self.first_token_time, self.finished_time, self.loops_run,
                              self.prefill_loops, self.last_token_time)

    @property
    def time_to_first_token(self) -> float | None:
        return None if self.first_token_time is None else self.first_token_time - self.arrival_time


@dataclass
class CompletionOutput:
    """One sample's output. vLLM's fields in vLLM's order (so that code building one positionally, a test's mock or
    an adapter, gets the fields it means), then loopserve's."""

    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None  # None unless logprobs were asked for
    logprobs: list[dict[int, Logprob]] | None
    finish_reason: str | None = None
    # the stop token id or stop string that finished it; None for the tokenizer's eos and for length
    stop_reason: int | str | None = None
    lora_request: None = None  # (vLLM's; loopserve serves no LoRA adapters)
    exit_depths: list[int] = field(default_factory=list)  # each token's loop count
    # this sample's own times and loops (`RequestOutput.metrics` merges an n > 1 request's samples): what the
    # server's metrics time each sample by, as vLLM times each child request (not compared: outputs of one text
    # are equal whenever they ran)
    metrics: RequestMetrics | None = field(default=None, compare=False)

    def finished(self) -> bool:
        """vLLM's `CompletionOutput.finished()` (a method there too, unlike `RequestOutput.finished`)."""
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    """One request's output (every sample of it). vLLM's fields in vLLM's order, then loopserve's."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    # with SamplingParams.prompt_logprobs: one entry per prompt token, None for the first (nothing
    # precedes it), else the token's own logprob and the top ones, computed at full depth (`PromptLogprobs`,
    # which reads as that list; a plain list once pickled or deep-copied)
    prompt_logprobs: PromptLogprobs | list[dict[int, Logprob] | None] | None
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics | None = None
    lora_request: None = None  # (vLLM's, as the encoder and KV-transfer fields: no LoRA, encoder or KV transfer)
    encoder_prompt: None = None
    encoder_prompt_token_ids: None = None
    # prompt tokens whose KV came from the prefix cache (vLLM's field; the API's cached_tokens)
    num_cached_tokens: int = 0
    multi_modal_placeholders: dict = field(default_factory=dict)  # (vLLM's: {} where a prompt has no media)
    kv_transfer_params: None = None
    error: str | None = None
    # HTTP-style status of an error finish: 400 when the request itself was at fault (it can never fit
    # the KV cache), 500 when the engine failed on its part of a batch (the other requests go on)
    error_status: int | None = None
    extra: dict = field(default_factory=dict)

    def add(self, next_output: RequestOutput, aggregate: bool) -> None:
        """vLLM's: fold a later output of the same request into this one, for a consumer that fell behind.
        `aggregate` (DELTA outputs): each completion's new text, tokens, logprobs and depths are appended to this
        one's of the same index (a completion new to this output is added); otherwise (CUMULATIVE) the later output,
        which holds everything so far, replaces this one's completions. Either way the request's state (finished,
        metrics, error, cached tokens) becomes the later one's; the prompt logprobs stay the first output's."""
        if aggregate:
            mine = {c.index: c for c in self.outputs}
            for c in next_output.outputs:
                old = mine.get(c.index)
                if old is None:
                    self.outputs.append(c)
                    continue
                old.text += c.text
                old.token_ids = [*old.token_ids, *c.token_ids]
                old.exit_depths = [*old.exit_depths, *c.exit_depths]
                if old.logprobs is not None and c.logprobs is not None:
                    old.logprobs = [*old.logprobs, *c.logprobs]
                old.cumulative_logprob, old.finish_reason, old.stop_reason = (c.cumulative_logprob, c.finish_reason,
                                                                              c.stop_reason)
        else:
            self.outputs = next_output.outputs
        self.finished, self.metrics, self.num_cached_tokens = (next_output.finished, next_output.metrics,
                                                               next_output.num_cached_tokens)
        self.error, self.error_status = next_output.error, next_output.error_status
        if self.prompt_logprobs is None:
            self.prompt_logprobs = next_output.prompt_logprobs
