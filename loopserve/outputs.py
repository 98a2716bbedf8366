"""What `generate` returns (vLLM's shapes, plus per-token exit depths and loop counts)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Logprob:
    logprob: float
    rank: int | None = None
    decoded_token: str | None = None  # the token's text as decoded alone (' the', not the BPE symbol 'Ġthe')


@dataclass
class RequestMetrics:
    arrival_time: float
    first_token_time: float | None = None
    finished_time: float | None = None
    loops_run: int = 0  # core loop steps spent on this request's decode tokens
    prefill_loops: int = 0  # core loop steps per prompt token, summed over the prompt tokens computed
    last_token_time: float | None = None

    @property
    def time_to_first_token(self) -> float | None:
        return None if self.first_token_time is None else self.first_token_time - self.arrival_time


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    logprobs: list[dict[int, Logprob]] | None
    exit_depths: list[int]
    finish_reason: str | None
    cumulative_logprob: float | None = None
    stop_reason: int | str | None = None  # the stop token id or stop string that finished it; None for eos/length

    def finished(self) -> bool:
        """vLLM's `CompletionOutput.finished()` (a method there too, unlike `RequestOutput.finished`)."""
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics | None = None
    error: str | None = None
    # HTTP-style status of an error finish: 400 when the request itself was at fault (it can never fit
    # the KV cache), 500 when the engine failed on its part of a batch (the other requests go on)
    error_status: int | None = None
    extra: dict = field(default_factory=dict)
    # with SamplingParams.prompt_logprobs: one entry per prompt token, None for the first (nothing
    # precedes it), else the token's own logprob and the top ones, computed at full depth
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
    # prompt tokens whose KV came from the prefix cache (vLLM's field; the API's cached_tokens)
    num_cached_tokens: int = 0
