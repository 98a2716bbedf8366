"""Beam search: vLLM's `LLM.beam_search(prompts, BeamSearchParams)`, built on `LLM.generate`.

Each step runs every live beam of every prompt (its prompt and its tokens so far, as a token-id prompt) for one
token, all in ONE `generate` call (one engine run), asking for the top `2 * beam_width` logprobs. A beam's
candidates are the beam plus each token of that logprob entry (the sampled token first, then the top ones), their
cumulative logprob the beam's plus the token's. A candidate ending in an end-of-sequence token (unless
`ignore_eos`) is complete; of the others, the best `beam_width` by score go on. After `max_tokens` steps, or once
no beam is live, the complete and live beams of a prompt are ranked by `get_beam_search_score` (the cumulative
logprob over the length, prompt included, to the power `length_penalty`) and the best `beam_width` returned, each
with its `text` the whole sequence decoded, prompt included and special tokens kept (vLLM's
`tokenizer.decode(beam.tokens)`); `include_stop_str_in_output` changes nothing offline, as in vLLM.

One deliberate difference from vLLM: a beam completes on any of the tokenizer's end-of-sequence ids
(`eos_token_ids`), where vLLM's offline search checks `tokenizer.eos_token_id` alone. loopserve's `generate` stops
on every end-of-sequence id of the checkpoint (a chat model's end-of-turn token among them), so a beam does too.

Logprobs are the raw model's (before temperature: SamplingParams' `raw_logprobs`), so `temperature` changes only
which token each step samples, and a sampled token outside the top ones is a candidate too (vLLM's rule). Every
step's request is seeded with the LLM's seed: its sampled token depends only on the beam (so a prompt's beams are
the same whether it is searched alone or with others), and Huginn's random initial states, which that seed also
seeds, are those `generate` uses by default. (A step samples its one token with the same draw for every beam and
step: the sampled token is a deterministic extra candidate, not an independent sample.)

Looped models: a step re-runs the beam's whole prefix as a prompt, so every token of a beam gets its KV from a
full-depth prefill (r_max loops), never from an exit-depth decode step, and its logprobs are full-depth ones (a
prompt's last position runs every loop). This is what vLLM's own beam search does; it stays cheap through prefix
caching (`EngineConfig.enable_prefix_caching`, on by default): a step recomputes only the tokens past the
prefix's last full KV block. Beam search therefore ignores the exit policy: a width-1 greedy search equals
`generate` at full depth (`exit_policy="fixed"`), not `generate` with early exits.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from collections.abc import Sequence as Seq
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from tqdm import tqdm

from loopserve.engine.budget import pool_tokens
from loopserve.engine.sequence import PromptType, parse_prompt
from loopserve.outputs import Logprob
from loopserve.sampling_params import (  # (BeamSearchParams: vLLM's home, also importable from here)
    BeamSearchParams,
    SamplingParams,
    check_beam_search_params,
    is_int,
)

if TYPE_CHECKING:
    from loopserve.llm import LLM


@dataclass
class BeamSearchSequence:
    """One beam (vLLM's fields): `tokens` the prompt's and the generated ones (a completed beam's last is its
    end-of-sequence token), `logprobs` one entry per generated token (the sampled token's, then the top
    2 * beam_width, as `generate` gives them), `cum_logprob` the sum of the generated tokens' logprobs, `text` the
    whole sequence (`tokens`, prompt included) decoded with special tokens kept, as vLLM sets it. `finish_reason`:
    "stop" (an end-of-sequence token) or "length" (max_tokens, or the context's end); `stop_reason` None for both, as
    `generate` reports them."""

    tokens: list[int]
    logprobs: list[dict[int, Logprob]]
    cum_logprob: float = 0.0
    text: str | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


@dataclass
class BeamSearchOutput:
    """The best beams of one prompt, best first (at most beam_width of them)."""

    sequences: list[BeamSearchSequence] = field(default_factory=list)


def get_beam_search_score(tokens: Seq[int], cumulative_logprob: float, eos_token_id: int | Collection[int] | None,
                          length_penalty: float = 1.0) -> float:
    """vLLM's beam score: `cumulative_logprob / seq_len ** length_penalty`, where seq_len counts every token,
    prompt included, but a last one that is an end-of-sequence token (`eos_token_id`: one id or several)."""
    eos = () if eos_token_id is None else (eos_token_id,) if isinstance(eos_token_id, int) else eos_token_id
    seq_len = len(tokens) - (1 if tokens and tokens[-1] in eos else 0)
    return cumulative_logprob / (seq_len ** length_penalty)


@dataclass
class _Beam:
    tokens: list[int]
    logprobs: list[dict[int, Logprob]]
    cum_logprob: float
    finish_reason: str | None = None


def _prompt_list(prompts: Any) -> list[PromptType]:
    """One prompt or a list of them, as `LLM.generate` takes them."""
    single = isinstance(prompts, str | dict) or (
        isinstance(prompts, list) and bool(prompts) and all(is_int(t) for t in prompts))
    if single:
        return [prompts]
    if isinstance(prompts, Mapping) or not isinstance(prompts, Seq):
        raise ValueError("prompts: expected a prompt (a string, a list of token ids, or a dict with 'prompt' or "
                         f"'prompt_token_ids') or a list of prompts, got {type(prompts).__name__}")
    return list(prompts)


def beam_search(llm: LLM, prompts: PromptType | Seq[PromptType], params: BeamSearchParams, lora_request: Any = None,
                use_tqdm: bool = False, concurrency_limit: int | None = None) -> list[BeamSearchOutput]:
    """vLLM's `LLM.beam_search` on `llm`: one `BeamSearchOutput` per prompt, in the order of `prompts` (one prompt or
    a list, as `generate` takes them). `concurrency_limit`: search at most this many prompts at once (None: all);
    `lora_request` is vLLM's, taken only as None. `use_tqdm`: a bar over the steps. ValueError naming the field
    at fault (for a prompt of several: which one) before anything runs."""
    if lora_request is not None:
        raise ValueError(f"lora_request: not supported by loopserve (no LoRA adapters); got {lora_request!r}")
    if not isinstance(params, BeamSearchParams):
        raise ValueError(f"params: expected a BeamSearchParams, got {type(params).__name__}")
    check_beam_search_params(params)  # (again: fields may have been set after construction)
    if concurrency_limit is not None and (not is_int(concurrency_limit) or concurrency_limit < 1):
        raise ValueError(f"concurrency_limit: must be an integer >= 1 or None, got {concurrency_limit!r}")
    prompt_list = _prompt_list(prompts)
    starts: list[_Beam] = []
    for i, prompt in enumerate(prompt_list):
        try:
            _, ids = parse_prompt(prompt, llm.tokenizer)
        except ValueError as e:
            raise ValueError(f"{e} (prompt {i} of {len(prompt_list)})" if len(prompt_list) > 1 else str(e)) from e
        starts.append(_Beam(ids, [], 0.0))
    chunk = concurrency_limit or max(1, len(starts))
    outputs: list[BeamSearchOutput] = []
    for lo in range(0, len(starts), chunk):
        outputs += _search(llm, starts[lo:lo + chunk], params, use_tqdm)
    return outputs


def _search(llm: LLM, starts: list[_Beam], params: BeamSearchParams, use_tqdm: bool) -> list[BeamSearchOutput]:
    """Beam search for these prompts together (each step one `generate` call over all their live beams)."""
    width = params.beam_width
    eos = frozenset(() if params.ignore_eos else llm.tokenizer.eos_token_ids)
    all_eos = frozenset(llm.tokenizer.eos_token_ids)  # (the score's rule, whatever ignore_eos says: vLLM's)
    # a beam that fills the context (or the KV pool) ends there, "length" (the prompt itself is generate's to check)
    room = llm.max_model_len if llm.engine is None else min(llm.max_model_len, pool_tokens(llm.engine))

    def score(b: _Beam) -> float:
        return get_beam_search_score(b.tokens, b.cum_logprob, all_eos, params.length_penalty)

    live: list[list[_Beam]] = [[b] for b in starts]
    done: list[list[_Beam]] = [[] for _ in starts]
    bar = tqdm(total=params.max_tokens, disable=not use_tqdm, desc="Beam search", unit="token")
    for _ in range(params.max_tokens):
        beams = [b for group in live for b in group]
        if not beams:
            break
        step_params = SamplingParams(max_tokens=1, logprobs=2 * width, temperature=params.temperature,
                                      ignore_eos=params.ignore_eos, seed=llm.seed)
        results = llm.generate([{"prompt_token_ids": b.tokens} for b in beams], step_params, use_tqdm=False)
        at = 0
        for p, group in enumerate(live):
            candidates: list[tuple[float, float, _Beam, int, dict[int, Logprob]]] = []
            for beam, result in zip(group, results[at:at + len(group)], strict=True):
                if result.error is not None:
                    raise RuntimeError(f"beam search: a step failed: {result.error}")
                entry = (result.outputs[0].logprobs or [{}])[0]
                for token, lp in entry.items():
                    cum = beam.cum_logprob + lp.logprob
                    if token in eos:
                        done[p].append(_Beam(beam.tokens + [token], beam.logprobs + [entry], cum, "stop"))
                    else:  # scored as get_beam_search_score would score the beam it makes, without making it
                        length = len(beam.tokens) + 1 - (token in all_eos)
                        candidates.append((cum / length ** params.length_penalty, cum, beam, token, entry))
            at += len(group)
            candidates.sort(key=lambda c: c[0], reverse=True)  # (stable: ties keep beam, then entry, order)
            group = []
            for _, cum, beam, token, entry in candidates[:width]:
                new = _Beam(beam.tokens + [token], beam.logprobs + [entry], cum)
                if len(new.tokens) >= room:
                    new.finish_reason = "length"
                    done[p].append(new)
                else:
                    group.append(new)
            live[p] = group
        bar.update(1)
    bar.close()
    outputs = []
    for p, group in enumerate(live):
        for b in group:
            b.finish_reason = "length"
        best = sorted(done[p] + group, key=score, reverse=True)[:width]
        outputs.append(BeamSearchOutput([_sequence(llm, b) for b in best]))
    return outputs


def _sequence(llm: LLM, beam: _Beam) -> BeamSearchSequence:
    """A finished beam as returned: its text is its whole sequence decoded, prompt and end-of-sequence token
    included (vLLM's `tokenizer.decode(beam.tokens)`: HF's decode keeps special tokens by default)."""
    text = llm.tokenizer.decode(beam.tokens, skip_special_tokens=False)
    return BeamSearchSequence(beam.tokens, beam.logprobs, beam.cum_logprob, text, beam.finish_reason, None)
