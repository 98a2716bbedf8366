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
