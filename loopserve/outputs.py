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
    """One sample's output. vLLM's fields in vLLM's order (so that code building one positionally, a test's mock or
    an adapter, gets the fields it means), then loopserve's."""

    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None  # None unless logprobs were asked for
    logprobs: list[dict[int, Logprob]] | None
    finish_reason: str | None = None
    stop_reason: int | str | None = None  # the stop token id or stop string that finished it; None for eos/length
    lora_request: None = None  # (vLLM's; loopserve serves no LoRA adapters)
    exit_depths: list[int] = field(default_factory=list)  # each token's loop count

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
    # precedes it), else the token's own logprob and the top ones, computed at full depth
    prompt_logprobs: list[dict[int, Logprob] | None] | None
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics | None = None
    lora_request: None = None  # (vLLM's, as the encoder and KV-transfer fields: no LoRA, encoder or KV transfer)
    encoder_prompt: None = None
    encoder_prompt_token_ids: None = None
    # prompt tokens whose KV came from the prefix cache (vLLM's field; the API's cached_tokens)
    num_cached_tokens: int = 0
    kv_transfer_params: None = None
    error: str | None = None
    # HTTP-style status of an error finish: 400 when the request itself was at fault (it can never fit
    # the KV cache), 500 when the engine failed on its part of a batch (the other requests go on)
    error_status: int | None = None
    extra: dict = field(default_factory=dict)
