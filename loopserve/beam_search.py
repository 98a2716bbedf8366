"""Beam search: vLLM's `LLM.beam_search(prompts, BeamSearchParams)`, its server's `use_beam_search` and its
`EngineClient.beam_search` (`AsyncLLMEngine.beam_search`), one algorithm (`BeamSearch`) driven two ways.

A step runs every live beam of every prompt (its prompt and its tokens so far, as a token-id prompt) for one token,
asking for the top `2 * beam_width` logprobs (`BeamSearch.step_params`). A beam's candidates are the beam plus each
token of that logprob entry (the sampled token first, then the top ones), their cumulative logprob the beam's plus
the token's. A candidate ending in an end-of-sequence token (unless `ignore_eos`) is complete; of the others, the
best `beam_width` by score go on. After `max_tokens` steps, or once no beam is live, the complete and live beams of
a prompt are ranked by `get_beam_search_score` (the cumulative logprob over the length, prompt included, to the
power `length_penalty`) and the best `beam_width` returned, best first.

`BeamSearch` is that state machine: `next_prompts()` (the step's prompts, [] once the search is over),
`update(outputs)` (the step's results, one per prompt, in order), `results(text)` (the ranked beams as
`BeamSearchSequence`s, their text by a rule), `request_outputs(text)` (them as finished RequestOutputs, vLLM's
`EngineClient.beam_search` result), `stop()` (the search ends early). Its two drivers:

- `LLM.beam_search` (`beam_search` here): each step is ONE `LLM.generate` call (one engine run) over every live
  beam of every prompt searched together.
- `run_steps`, on an engine thread (engine/engine_thread.py): each step's sequences are added together, as one
  request's samples are, and collected as a request's are; a consumer that goes away (or aborts) ends the search.
  The server's `use_beam_search` (serve/api.py, `OpenAIServing.beam_search`: the steps after the first built on a
  worker thread; the server's admission limits apply to every step, a full queue a 503; a step that fails fails
  the request with its error) and `AsyncLLMEngine.beam_search` (its `request_id` in flight throughout, `abort`
  ending it) run it, and return `request_outputs`.

The text of a returned beam is the one thing the drivers do differently, as vLLM's do (`results`' rule):

- offline (`whole_text`): the whole sequence decoded, prompt included and special tokens kept (vLLM's
  `tokenizer.decode(beam.tokens)`); `include_stop_str_in_output` changes nothing, as in vLLM;
- the server and `AsyncLLMEngine` (`generated_text`): the generated tokens alone, without a final end-of-sequence
  token unless `include_stop_str_in_output`, decoded with the request's `skip_special_tokens` (AsyncLLMEngine: true,
  the server's default): the text a normal request with those tokens gets. (vLLM's server decodes keeping special
  tokens whatever `skip_special_tokens` says, and drops the end-of-sequence token from the text even with
  `include_stop_str_in_output`, which instead keeps it in the token ids; here the token ids are always the beam's,
  end-of-sequence token included, as offline.)

One deliberate difference from vLLM: a beam completes on any of the tokenizer's end-of-sequence ids
(`eos_token_ids`), where vLLM's search checks `tokenizer.eos_token_id` alone. loopserve's `generate` stops on every
end-of-sequence id of the checkpoint (a chat model's end-of-turn token among them), so a beam does too.

Logprobs are the raw model's (before temperature: SamplingParams' `raw_logprobs`), so `temperature` changes only
which token each step samples, and a sampled token outside the top ones is a candidate too (vLLM's rule). Every
step's request is seeded with one seed (offline and on an AsyncLLMEngine the LLM's; on the server the request's
`seed`, else the server's `--seed`): its sampled token depends only on the beam (so a prompt's beams are the same
whether it is searched alone or with others), and Huginn's random initial states, which the engine's seed seeds,
are those `generate` uses by default. (A step samples its one token with the same draw for every beam and step:
the sampled token is a deterministic extra candidate, not an independent sample.) So a server's search returns what
`LLM.beam_search` returns for the same checkpoint, dtype, seed and params, apart from the text rule.

Looped models: a step re-runs the beam's whole prefix as a prompt, so every token of a beam gets its KV from a
full-depth prefill (r_max loops), never from an exit-depth decode step, and its logprobs are full-depth ones (a
prompt's last position runs every loop). This is what vLLM's own beam search does; it stays cheap through prefix
caching (`EngineConfig.enable_prefix_caching`, on by default): a step recomputes only the tokens past the
prefix's last full KV block. Beam search therefore ignores the exit policy (the server's exit flags included): a
width-1 greedy search equals `generate` at full depth (`exit_policy="fixed"`), not `generate` with early exits.
"""

from __future__ import annotations

import math
from collections.abc import Awaitable, Callable, Collection
from collections.abc import Sequence as Seq
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

from tqdm import tqdm

from loopserve.engine.budget import pool_tokens, sequence_room
from loopserve.engine.sequence import PromptType, in_batch, parse_prompt, prompt_list
from loopserve.outputs import CompletionOutput, Logprob, RequestOutput
from loopserve.sampling_params import (  # (BeamSearchParams: vLLM's home, also importable from here)
    BeamSearchParams,
    SamplingParams,
    check_beam_search_params,
    check_beam_width,
    is_int,
)

if TYPE_CHECKING:
    from loopserve.llm import LLM
    from loopserve.tokenizer import Tokenizer


@dataclass
class BeamSearchSequence:
    """One beam: vLLM's fields in vLLM's order (so that keyword and positional construction mean what they mean in
    vLLM), then loopserve's `exit_depths`. `tokens` the prompt's and the generated ones (a completed beam's last is
    its end-of-sequence token), `logprobs` one entry per generated token (the sampled token's, then the top 2 *
    beam_width, as `generate` gives them), `cum_logprob` the sum of the generated tokens' logprobs, `text` as the
    driver's rule writes it (offline: the whole sequence, `tokens` with the prompt, decoded with special tokens
    kept, as vLLM sets it). `finish_reason`: "stop" (an end-of-sequence token) or "length" (max_tokens, or the
    context's end); "abort" for a live beam of a search stopped early (`BeamSearch.stop`). `stop_reason` None: vLLM's
    `LLM.beam_search` sets no finish or stop reason (loopserve's finish_reason says how a beam ended); the drivers that
    return RequestOutputs (the server, `AsyncLLMEngine.beam_search`) write a completed beam's end-of-sequence token
    there, as vLLM's do (`BeamSearch.request_outputs`). `lora_request`, `multi_modal_data` and
    `mm_processor_kwargs`: vLLM's, always None here (no adapters, text-only models). `exit_depths`: the loops each
    generated token ran (full depth: a step's token is its prompt's last position)."""

    tokens: list[int]
    logprobs: list[dict[int, Logprob]]
    lora_request: None = None
    cum_logprob: float = 0.0
    text: str | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    multi_modal_data: None = None
    mm_processor_kwargs: None = None
    exit_depths: list[int] = field(default_factory=list)


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
    return length_penalized(cumulative_logprob, seq_len, length_penalty)


def length_penalized(cumulative_logprob: float, seq_len: int, length_penalty: float) -> float:
    """`cumulative_logprob / seq_len ** length_penalty`, its limit where the power overflows or underflows a float (a
    finite but huge length_penalty: vLLM raises OverflowError there): 0 for a huge positive penalty (every beam ties),
    minus infinity (0 for a sure beam) for a huge negative one."""
    try:
        scale = seq_len ** length_penalty
    except OverflowError:
        return 0.0
    if scale == 0.0:  # (underflowed)
        return -math.inf if cumulative_logprob < 0 else 0.0
    return cumulative_logprob / scale


@dataclass
class _Beam:
    tokens: list[int]
    logprobs: list[dict[int, Logprob]]
    cum_logprob: float
    exit_depths: list[int] = field(default_factory=list)
    finish_reason: str | None = None


# A returned beam's text: (its prompt's length, its tokens, its finish reason) -> the text
TextRule = Callable[[int, list[int], str], str]


def whole_text(tokenizer: Tokenizer) -> TextRule:
    """`LLM.beam_search`'s rule (vLLM's offline one, `tokenizer.decode(beam.tokens)`: HF's decode keeps special
    tokens by default): the whole sequence decoded, prompt and end-of-sequence token included."""
    return lambda prompt_len, tokens, finish_reason: tokenizer.decode(tokens, skip_special_tokens=False)


def generated_text(tokenizer: Tokenizer, include_stop_str_in_output: bool,
                   skip_special_tokens: bool = True) -> TextRule:
    """The server's rule: the generated tokens alone, a final end-of-sequence token left out unless
    `include_stop_str_in_output`, decoded with `skip_special_tokens` (the text a normal request with the same
    tokens gets: engine/sequence.py's rule for a request that ends on an end-of-sequence token)."""
    def text(prompt_len: int, tokens: list[int], finish_reason: str) -> str:
        generated = tokens[prompt_len:]
        if finish_reason == "stop" and not include_stop_str_in_output:
            generated = generated[:-1]
        return tokenizer.decode(generated, skip_special_tokens=skip_special_tokens)

    return text


class BeamSearch:
    """The search of some prompts (token ids), together: which prompts each step runs, how their results update
    the beams, how the final beams are ranked and returned. A driver runs it:

        search = BeamSearch(prompts, params, eos_token_ids, room)
        while step := search.next_prompts():
            outputs = ...  # each of `step`'s prompts run for one token with `search.step_params(seed)`
            search.update(outputs)
        return search.results(text_rule)

    `eos_token_ids`: the tokens that complete a beam (unless `params.ignore_eos`) and that its score leaves out.
    `room`: the most tokens a beam may hold (`sequence_room`: the context, or the KV pool if smaller); a beam that
    fills it ends there, "length" (a prompt that leaves no room is the driver's to refuse). ValueError naming the
    field of `params` at fault."""

    def __init__(self, prompts: Seq[Seq[int]], params: BeamSearchParams, eos_token_ids: Collection[int],
                 room: int) -> None:
        check_beam_search_params(params)
        self.params = params
        self.width = params.beam_width
        self.eos = frozenset(() if params.ignore_eos else eos_token_ids)  # what completes a beam
        self.all_eos = frozenset(eos_token_ids)  # (the score's rule, whatever ignore_eos says: vLLM's)
        self.room = room
        self.prompts = [list(p) for p in prompts]
        self.live: list[list[_Beam]] = [[_Beam(list(p), [], 0.0)] for p in prompts]
        self.done: list[list[_Beam]] = [[] for _ in prompts]
        self.steps = 0
        self.stopped = False  # `stop`: no more steps, the live beams end "abort"
        # what `request_outputs` makes each prompt's output of: the first step's outputs (the prompts' own: text,
        # cached tokens, times), and per prompt the decode and prefill loops every step of its beams ran
        self.first: list[RequestOutput] = []
        self.loops = [[0, 0] for _ in prompts]

    def step_params(self, seed: int) -> SamplingParams:
        """Every step request's params: one token, the top 2 * beam_width logprobs, seeded with `seed`."""
        p = self.params
        return SamplingParams(max_tokens=1, logprobs=2 * self.width, temperature=p.temperature,
                              ignore_eos=p.ignore_eos, seed=seed)

    def next_prompts(self) -> list[tuple[int, list[int]]]:
        """The next step's prompts: (the index of the prompt searched, the beam's token ids) for every live beam,
        prompt by prompt; [] once the search is over (max_tokens steps run, or no beam live)."""
        if self.stopped or self.steps >= self.params.max_tokens:
            return []
        return [(p, list(b.tokens)) for p, group in enumerate(self.live) for b in group]

    def update(self, outputs: Seq[RequestOutput]) -> None:
        """Take a step's results: one finished output per `next_prompts` entry, in its order. RuntimeError for a
        failed one (the server fails a request on its step's error before this)."""
        if len(outputs) != sum(len(group) for group in self.live):
            raise ValueError(f"outputs: expected one per beam ({sum(len(g) for g in self.live)}), got {len(outputs)}")
        penalty = self.params.length_penalty
        at = 0
        if not self.steps:
            self.first = list(outputs)  # (one per prompt: the first step runs each prompt alone)
        for p, group in enumerate(self.live):
            candidates: list[tuple[float, float, _Beam, int, dict[int, Logprob], list[int]]] = []
            for beam, result in zip(group, outputs[at:at + len(group)], strict=True):
                if result.error is not None:
                    raise RuntimeError(f"beam search: a step failed: {result.error}")
                if result.metrics is not None:
                    self.loops[p][0] += result.metrics.loops_run
                    self.loops[p][1] += result.metrics.prefill_loops
                out = result.outputs[0]
                entry = (out.logprobs or [{}])[0]
                depths = beam.exit_depths + list(out.exit_depths[:1])
                for token, lp in entry.items():
                    cum = beam.cum_logprob + lp.logprob
                    if token in self.eos:
                        self.done[p].append(_Beam(beam.tokens + [token], beam.logprobs + [entry], cum, depths, "stop"))
                    else:  # scored as get_beam_search_score would score the beam it makes, without making it
                        length = len(beam.tokens) + 1 - (token in self.all_eos)
                        candidates.append((length_penalized(cum, length, penalty), cum, beam, token, entry, depths))
            at += len(group)
            candidates.sort(key=lambda c: c[0], reverse=True)  # (stable: ties keep beam, then entry, order)
            group = []
            for _, cum, beam, token, entry, depths in candidates[:self.width]:
                new = _Beam(beam.tokens + [token], beam.logprobs + [entry], cum, depths)
                if len(new.tokens) >= self.room:
                    new.finish_reason = "length"
                    self.done[p].append(new)
                else:
                    group.append(new)
            self.live[p] = group
        self.steps += 1

    def stop(self) -> None:
        """End the search before its end (its consumer aborted it): no more steps; the beams still live end "abort"
        (vLLM's finish reason for an aborted request) and are ranked with the complete ones."""
        self.stopped = True

    def score(self, beam: _Beam) -> float:
        return get_beam_search_score(beam.tokens, beam.cum_logprob, self.all_eos, self.params.length_penalty)

    def results(self, text: TextRule) -> list[BeamSearchOutput]:
        """Per prompt, its best beams (at most beam_width, best first: the complete ones and those still live, which
        end "length"), each with its text by the rule `text` (`whole_text`, `generated_text`)."""
        outputs = []
        for p, group in enumerate(self.live):
            for b in group:
                b.finish_reason = "abort" if self.stopped else "length"
            best = sorted(self.done[p] + group, key=self.score, reverse=True)[:self.width]
            outputs.append(BeamSearchOutput([
                BeamSearchSequence(b.tokens, b.logprobs, cum_logprob=b.cum_logprob,
                                   text=text(len(self.prompts[p]), b.tokens, b.finish_reason or "length"),
                                   finish_reason=b.finish_reason, exit_depths=b.exit_depths) for b in best]))
        return outputs

    def request_outputs(self, text: TextRule, logprobs: bool = True) -> list[RequestOutput]:
        """Per prompt, the search's result as one finished RequestOutput (vLLM's `EngineClient.beam_search` result,
        which its server formats): its best beams as its choices, best first, each with its text by the rule `text`,
        its generated token ids (a final end-of-sequence token included: a normal request's ids), its cumulative
        logprob, its logprobs (one entry per token; `logprobs` false: None, for a request that asked for none), its
        finish reason and, for a beam an end-of-sequence token completed, that token as its stop_reason (vLLM's
        server search sets `stop_reason=eos_token_id`); the request's prompt (the first step's output's: its text
        where the driver gave it), and its metrics with the loops every step of its beams ran."""
        outs = []
        for p, result in enumerate(self.results(text)):
            plen = len(self.prompts[p])
            # (no first output: a search stopped during its first step)
            own = self.first[p] if self.first else RequestOutput("", None, self.prompts[p], None, [], True)
            metrics = None if own.metrics is None else replace(
                own.metrics, loops_run=self.loops[p][0], prefill_loops=self.loops[p][1])
            outs.append(replace(own, finished=True, metrics=metrics, outputs=[
                CompletionOutput(k, s.text or "", s.tokens[plen:], s.cum_logprob, s.logprobs if logprobs else None,
                                 s.finish_reason, s.tokens[-1] if s.finish_reason == "stop" else None,
                                 exit_depths=s.exit_depths) for k, s in enumerate(result.sequences)]))
        return outs


async def run_steps(search: BeamSearch,
                    run_step: Callable[[list[tuple[int, list[int]]]], Awaitable[Seq[RequestOutput] | None]]) -> bool:
    """Drive `search` to its end on an async engine, a step at a time: `run_step(prompts)` runs a step's prompts
    (`BeamSearch.next_prompts`) and returns their finished outputs in order, or None where the search is to end
    early (its consumer went away or aborted it: `search` is then `stop`ped). True if the search ran to its end.
    The server's `use_beam_search` and `AsyncLLMEngine.beam_search` run their searches with it."""
    while step := search.next_prompts():
        outs = await run_step(step)
        if outs is None:
            search.stop()
            return False
        search.update(outs)
    return True


def beam_search(llm: LLM, prompts: PromptType | Seq[PromptType], params: BeamSearchParams, use_tqdm: bool = False,
                concurrency_limit: int | None = None) -> list[BeamSearchOutput]:
    """vLLM's `LLM.beam_search` on `llm`: one `BeamSearchOutput` per prompt, in the order of `prompts` (one prompt or
    a list, as `generate` takes them). `concurrency_limit`: search at most this many prompts at once (None: all).
    `use_tqdm`: a bar over the steps. ValueError naming the field at fault (for a prompt of several: which one)
    before anything runs."""
    check_search_params(llm, params)
    if concurrency_limit is not None and (not is_int(concurrency_limit) or concurrency_limit < 1):
        raise ValueError(f"concurrency_limit: must be an integer >= 1 or None, got {concurrency_limit!r}")
    starts = [ids for _, ids in search_prompts(llm, prompt_list(prompts))]
    chunk = concurrency_limit or max(1, len(starts))
    outputs: list[BeamSearchOutput] = []
    for lo in range(0, len(starts), chunk):
        outputs += _search(llm, starts[lo:lo + chunk], params, use_tqdm)
    return outputs


def check_search_params(llm: LLM, params: BeamSearchParams) -> None:
    """ValueError naming the field of `params` (or `params` itself) that `llm`'s engine cannot search with."""
    if not isinstance(params, BeamSearchParams):
        raise ValueError(f"params: expected a BeamSearchParams, got {type(params).__name__}")
    check_beam_search_params(params)  # (again: fields may have been set after construction)
    check_beam_width(params.beam_width, llm.engine_config.max_logprobs, llm.config.vocab_size)


def search_prompts(llm: LLM, given: list[PromptType]) -> list[tuple[str | None, list[int]]]:
    """Each prompt's (text, if given as text; token ids), as `generate` reads it: ValueError naming the field at
    fault (and, for a prompt of several, which one)."""
    parsed = []
    for i, prompt in enumerate(given):
        try:
            parsed.append(parse_prompt(prompt, llm.tokenizer))
        except ValueError as e:
            raise in_batch(e, i, len(given)) from e
    return parsed


def new_search(llm: LLM, starts: list[list[int]], params: BeamSearchParams) -> BeamSearch:
    """The search of these prompts (token ids) on `llm`: a beam that fills the context (or the KV pool) ends there,
    "length" (the prompt itself is its first step's request's to check, as `generate` checks it)."""
    room = sequence_room(llm.max_model_len, None if llm.engine is None else pool_tokens(llm.engine))
    return BeamSearch(starts, params, llm.tokenizer.eos_token_ids, room)


def _search(llm: LLM, starts: list[list[int]], params: BeamSearchParams, use_tqdm: bool) -> list[BeamSearchOutput]:
    """`BeamSearch` of these prompts together, each step one `generate` call over all their live beams."""
    search = new_search(llm, starts, params)
    step_params = search.step_params(llm.seed)
    bar = tqdm(total=params.max_tokens, disable=not use_tqdm, desc="Beam search", unit="token")
    while step := search.next_prompts():
        search.update(llm.generate([{"prompt_token_ids": ids} for _, ids in step], step_params, use_tqdm=False))
        bar.update(1)
    bar.close()
    return search.results(whole_text(llm.tokenizer))
