"""`LLM`: the offline entry point (vLLM's shape): load a model, `generate` from prompts or `chat` from
conversations, with the checkpoint's `generation_config.json` sampling defaults and a progress bar."""

from __future__ import annotations

import dataclasses
import itertools
import logging
import threading
from collections.abc import Callable, Mapping
from collections.abc import Sequence as Seq
from pathlib import Path
from typing import Any

from tqdm import tqdm

from loopserve.beam_search import BeamSearchOutput
from loopserve.beam_search import beam_search as _beam_search
from loopserve.cache.layout import KVLayout
from loopserve.chat_messages import chat_messages, within
from loopserve.engine.budget import checked_model_len, completion_budget, pool_tokens
from loopserve.engine.config import EngineConfig
from loopserve.engine.engine import LLMEngine
from loopserve.engine.engine_thread import EngineThread
from loopserve.engine.reference import ReferenceDecoder
from loopserve.engine.sequence import (
    PromptType,
    Sequence,
    TokensPrompt,
    in_batch,
    make_sequence,
    parse_prompt,
    prompt_list,
    truncate_prompt,
    unseeded,
)
from loopserve.load_config import LOAD_FIELDS, LoadConfig, configs, load_for_engine
from loopserve.model_config import EngineModelConfig
from loopserve.models.loader import embedded_model_path, is_local_folder
from loopserve.outputs import RequestOutput
from loopserve.sampling_params import BeamSearchParams, RequestOutputKind, SamplingParams, with_tokenization_kwargs
from loopserve.tokenizer import Tokenizer, template_switches, template_variables
from loopserve.vllm_neutral import NEUTRAL, absent_method, check_neutral, check_per_prompt

Conversation = Seq[Mapping[str, Any]]  # [{"role": "user", "content": "..."}, ...]

log = logging.getLogger(__name__)
SUPPORTED_TASKS = ("generate",)  # vLLM's names of the tasks loopserve runs (no pooling: vllm_neutral.ABSENT_METHODS)


def default_model_path() -> Path:
    """The embedded default model: a small Ouro-architecture LM trained on Shakespeare, shipped in
    the package (`loopserve train-tiny` rebuilds it)."""
    path = embedded_model_path()
    if not (path / "model.safetensors").is_file():
        raise ValueError(f"model: the embedded model is missing from {path}; pass model=PATH")
    return path


def llm_configs(kwargs: Mapping[str, Any], model: str | Path | None) -> tuple[LoadConfig, EngineConfig]:
    """`LLM(...)`'s keywords (but `model`, `chat_template` and `generation_config`) as its load and engine configs:
    a ValueError naming an unknown keyword, a value out of range, or a vLLM keyword at a value that asks for what
    loopserve lacks (`NEUTRAL`; a revision of `model`, unused where it is a local folder)."""
    neutral = {name for name, n in NEUTRAL.items() if n.init}
    known = {*LOAD_FIELDS, *(f.name for f in dataclasses.fields(EngineConfig)), *neutral}
    unknown = sorted(set(kwargs) - known)
    if unknown:
        names = ", ".join(sorted({"model", "chat_template", "generation_config", *known}))
        raise ValueError(f"{unknown[0]}: not an LLM argument (known: {names})")
    check_neutral(local_folder=is_local_folder(model), **{k: v for k, v in kwargs.items() if k in neutral})
    return configs({k: v for k, v in kwargs.items() if k not in neutral})


class LLM:
    """Offline generation. `scheduler` is one of "cdb" (default), "cdb-norefill", "cb", "reference";
    any `EngineConfig` field can be passed as a keyword (block_size, max_decode_batch, ...), and any
    `LoadConfig` field (dtype and device, both "auto" by default as for the server; seed, max_model_len, ...).

    `chat_template`: a Jinja template (text or a file) used instead of the model's. `generation_config`:
    "auto" (default) takes the sampling defaults of the model's `generation_config.json`, "vllm" ignores
    them, any other value is a folder holding one; `get_default_sampling_params` shows the result."""

    def __init__(self, model: str | Path | None = None, *, chat_template: str | None = None,
                 generation_config: str = "auto", **kwargs: Any) -> None:
        """`kwargs`: `LoadConfig` fields (dtype, device, state_init, seed, max_model_len, gpu_memory_utilization,
        enforce_eager, tensor_parallel_size, trust_remote_code, tokenizer, swap_space, threads: what the `serve`
        flags of those names mean, with the same defaults), `EngineConfig` fields, and vLLM's keywords for what
        loopserve lacks (`NEUTRAL`: tokenizer_mode, quantization, kv_cache_dtype, ...) at the values
        that ask for nothing of it. ValueError naming the argument at fault."""
        self.load_config, self.engine_config = llm_configs(kwargs, model)
        loaded, self.engine_config, max_model_len, memory_knob = load_for_engine(
            model if model is not None else default_model_path(), self.load_config, self.engine_config,
            chat_template=chat_template, generation_config=generation_config)
        self.model, self.config, self.tokenizer = loaded.model, loaded.config, loaded.tokenizer
        self.generation_defaults = loaded.generation.sampling_defaults
        self.seed = self.load_config.seed
        cfg, c = self.engine_config, self.config
        self.layout = KVLayout(cfg.kv_layout, c.n_prelude, c.n_core, c.n_coda, c.r_max)
        self.engine = (None if cfg.scheduler == "reference"
                       else LLMEngine(self.model, self.tokenizer, cfg, self.seed, max_model_len, memory_knob))
        # vLLM's `llm.model_config`: its engine's, the same object (scheduler="reference": the model's config with
        # this max_model_len)
        self.model_config = (self.engine.model_config if self.engine is not None
                             else EngineModelConfig.of(self.config, checked_model_len(max_model_len, c.max_position),
                                                       next(self.model.parameters()).dtype))
        self._counter = itertools.count()

    @property
    def max_model_len(self) -> int:
        """The most prompt + completion tokens of a request: its model_config's (vLLM's place for it)."""
        return self.model_config.max_model_len

    @property
    def supported_tasks(self) -> tuple[str, ...]:
        """vLLM's: the tasks this LLM runs."""
        return SUPPORTED_TASKS

    @property
    def engine_class(self) -> type[LLMEngine]:
        """vLLM's: the class of `llm_engine`."""
        return LLMEngine

    def get_world_size(self, include_dp: bool = True) -> int:
        """vLLM's: the workers the model runs on; loopserve runs it in this process, on one device."""
        return 1

    def reset_mm_cache(self) -> None:
        """vLLM's: loopserve takes no multimodal inputs, so there is no such cache to reset."""

    def get_tokenizer(self) -> Tokenizer:
        return self.tokenizer

    def __getattr__(self, name: str) -> Any:
        """vLLM's methods for what loopserve lacks (`vllm_neutral.ABSENT_METHODS`: pooling, sleep, profiling, ...)
        exist (`hasattr` is true, as on vLLM's LLM) and raise a ValueError naming themselves, saying what to use
        instead, when called; any other missing attribute is the usual AttributeError."""
        return absent_method(self, name)

    @property
    def llm_engine(self) -> LLMEngine:
        """The batching engine, by vLLM's name for it (`llm.llm_engine.add_request(...)`, `step()`,
        `has_unfinished_requests()`, `abort_request(...)`, `get_tokenizer()`). scheduler="reference" has none (it
        runs the sequential reference decoder): a ValueError naming `scheduler` says so, rather than a None that
        would fail later without saying why."""
        if self.engine is None:
            raise ValueError("scheduler: 'reference' is the sequential oracle, not a batching engine, so this LLM has "
                             "no llm_engine; scheduler cb, cdb-norefill or cdb has one")
        return self.engine

    def reset_prefix_cache(self, reset_running_requests: bool = False, reset_connector: bool = False) -> bool:
        """vLLM's: forget the prefix cache's blocks, so that no later prompt reuses KV computed before; True when
        reset (`LLMEngine.reset_prefix_cache`: only with no request in flight, which after `generate` and `chat`
        there is not, unless some were added to `llm_engine` by hand). scheduler="reference" caches nothing: True."""
        if self.engine is None:
            return True
        return self.engine.reset_prefix_cache(reset_running_requests, reset_connector)

    def get_default_sampling_params(self) -> SamplingParams:
        """What `generate` and `chat` use when given no sampling params: SamplingParams' defaults, overridden
        by the model's generation_config.json (as vLLM does; params passed explicitly are used as they are)."""
        return SamplingParams(**self.generation_defaults)

    def take_index(self) -> int:
        """The next request's number (requests are numbered in the order they are made: an unseeded one's seed
        derives from it, so runs that make them in the same order sample the same)."""
        return next(self._counter)

    def _make_sequence(self, prompt: PromptType, params: SamplingParams,
                       output_kind: RequestOutputKind = RequestOutputKind.FINAL_ONLY,
                       index: int | None = None) -> Sequence:
        """A request's Sequence, checked as the server checks one (ValueError naming the field): its token
        budget against the context and the KV pool (engine/budget.py), then whether its samples' blocks could
        ever fit the pool (the scheduler's `never_fits`), so that it never fails once running for that.
        `output_kind`: how it reports (`generate`: finished requests only; `AsyncLLMEngine`: the params' own).
        `index`: the request's number (`take_index`; default the next): an unseeded request's seed derives from it."""
        index = self.take_index() if index is None else index
        # Per-request sampling seed: the request's own when given, as the server does, else one derived from the
        # LLM seed and the request's id (`unseeded`); the same in every scheduler. Initial states are seeded from
        # the prompt.
        seed = params.seed if params.seed is not None else unseeded(self.seed, str(index))
        text, ids = parse_prompt(prompt, self.tokenizer, self.max_model_len, params.truncate_prompt_tokens)
        # cut before the budget check (make_sequence cuts again, by the same rule: no change)
        ids = truncate_prompt(ids, params.truncate_prompt_tokens, self.max_model_len, params.max_tokens)
        kv_tokens = pool_tokens(self.engine) if self.engine is not None else None
        budget = completion_budget(len(ids), params.max_tokens, max_model_len=self.max_model_len,
                                   kv_tokens=kv_tokens, clip_to_context=True)
        # generate() returns finished requests only: no per-token outputs (vLLM's LLM does the same). No
        # max_tokens: the room left, where the KV pool is smaller than the context (the server's rule); one past
        # max_model_len: cut to it (a sequence itself stops only at the model's own context), and min_tokens with
        # it, as a sequence stopped by the context ends before its min_tokens too.
        params = dataclasses.replace(params, output_kind=output_kind, max_tokens=budget,
                                     min_tokens=min(params.min_tokens, budget))
        parsed = TokensPrompt(prompt_token_ids=ids, prompt=text)
        if isinstance(prompt, dict) and "cache_salt" in prompt:
            parsed["cache_salt"] = prompt["cache_salt"]
        seq = make_sequence(self.model, self.tokenizer, str(index), parsed,
                            params, seed, self.engine_config.lookahead, self.engine_config.num_speculative_tokens,
                            base_seed=self.seed, max_model_len=self.max_model_len,
                            part_size=self.engine.part_size if self.engine is not None else None,
                            max_logprobs=self.engine_config.max_logprobs)
        why = self.engine.scheduler.never_fits(seq) if self.engine is not None else None
        if why is not None:
            raise ValueError(why)
        return seq

    def generate(self, prompts: PromptType | Seq[PromptType],
                 sampling_params: SamplingParams | Seq[SamplingParams] | None = None,
                 use_tqdm: bool | Callable[..., tqdm] = True, lora_request: Any = None,
                 priority: Seq[int] | None = None,
                 tokenization_kwargs: dict[str, Any] | None = None) -> list[RequestOutput]:
        """Outputs in the order of `prompts` (one prompt or a list: text, token ids or a prompt dict). Every
        request is checked before any runs: a ValueError naming the field means none ran. `lora_request`,
        `priority` and `tokenization_kwargs` are vLLM's, taken at the values that ask for nothing (None, or a list of
        None, one per prompt; priorities all 0, one per prompt; None or {})."""
        check_neutral(lora_request=lora_request, priority=priority, tokenization_kwargs=tokenization_kwargs)
        given = prompt_list(prompts)
        check_per_prompt(len(given), priority=priority, lora_request=lora_request)
        return self._run(given, sampling_params, use_tqdm, tokenization_kwargs)

    def beam_search(self, prompts: PromptType | Seq[PromptType], params: BeamSearchParams, lora_request: Any = None,
                    use_tqdm: bool = False, concurrency_limit: int | None = None) -> list[BeamSearchOutput]:
        """vLLM's beam search: one `BeamSearchOutput` per prompt (its best `params.beam_width` beams, best first);
        each step runs every live beam as a full-depth prompt, all in one `generate` call (loopserve/beam_search.py)."""
        check_neutral(lora_request=lora_request)
        check_per_prompt(len(prompt_list(prompts)), lora_request=lora_request)
        return _beam_search(self, prompts, params, use_tqdm=use_tqdm, concurrency_limit=concurrency_limit)

    def chat(self, messages: Conversation | Seq[Conversation],
             sampling_params: SamplingParams | Seq[SamplingParams] | None = None,
             use_tqdm: bool | Callable[..., tqdm] = True,
             lora_request: Any = None, chat_template: str | None = None,
             chat_template_content_format: str = "auto", add_generation_prompt: bool = True,
             continue_final_message: bool = False, tools: Seq[Mapping[str, Any]] | None = None,
             chat_template_kwargs: dict[str, Any] | None = None,
             mm_processor_kwargs: dict[str, Any] | None = None,
             tokenization_kwargs: dict[str, Any] | None = None) -> list[RequestOutput]:
        """Generate replies to one conversation or a list of them, each rendered with the chat template.
        The arguments are vLLM's, in its order; `lora_request`, `chat_template_content_format` ("auto" or
        "string": a message's content reaches the template as text), `mm_processor_kwargs` and `tokenization_kwargs`
        are taken at the values that ask for nothing loopserve lacks (no adapters, no images, the tokenizer as set
        up).

        `chat_template` names one of the model's templates, is a template itself or a file holding one;
        `chat_template_kwargs` become template variables (not those of `tokenizer.TEMPLATE_RESERVED`: a ValueError);
        `tools` (JSON-schema dicts) reach the template as `tools`. `continue_final_message` (with
        add_generation_prompt=False, as in vLLM): the model goes on with the final message, whatever its role, whose
        turn the prompt leaves open (it ends with the message's text). Messages are
        checked and rendered as the server's are (`chat_messages`): the template gets a message's role,
        content, name, tool_calls (arguments as dicts) and tool_call_id; other keys are ignored with a
        warning in the log."""
        check_neutral(lora_request=lora_request, mm_processor_kwargs=mm_processor_kwargs,
                      tokenization_kwargs=tokenization_kwargs)
        if chat_template_content_format not in ("auto", "string"):
            raise ValueError(f"chat_template_content_format: {chat_template_content_format!r} is not supported: a "
                             "message's content reaches the template as text ('string'; 'auto' picks it too)")
        if isinstance(messages, Seq) and not isinstance(messages, str) and messages and all(
                isinstance(m, Mapping) for m in messages):
            conversations: list[Conversation] = [messages]  # type: ignore[list-item]
        elif isinstance(messages, Seq) and not isinstance(messages, str) and messages:
            conversations = list(messages)  # type: ignore[arg-type]
        else:
            raise ValueError("messages: expected a conversation (a list of messages) or a list of conversations")
        check_per_prompt(len(conversations), lora_request=lora_request)
        batch = len(conversations) > 1 or conversations[0] is not messages
        prompts: list[PromptType] = [
            self._chat_prompt(conv, chat_template, add_generation_prompt, chat_template_kwargs, tools,
                              f"messages.{i}" if batch else "messages", continue_final_message)
            for i, conv in enumerate(conversations)]
        return self._run(prompts, sampling_params, use_tqdm, tokenization_kwargs)

    def _chat_prompt(self, conversation: Conversation, chat_template: str | None = None,
                     add_generation_prompt: bool = True, chat_template_kwargs: dict[str, Any] | None = None,
                     tools: Seq[Mapping[str, Any]] | None = None, where: str = "messages",
                     continue_final_message: bool = False) -> dict[str, Any]:
        """`where`: the conversation's field in errors (`messages`, or `messages.<i>` in a batch)."""
        extra = template_variables(chat_template_kwargs)  # (the server's rule for them too)
        switches = template_switches(chat_template_kwargs)  # (over the arguments, as vLLM merges them)
        add_generation_prompt = switches.get("add_generation_prompt", add_generation_prompt)
        continue_final_message = switches.get("continue_final_message", continue_final_message)
        ignored: list[str] = []
        # the server's rules for a message, and the same keys reach the template (chat_messages.py)
        messages = chat_messages(conversation, where, ignored)
        if ignored:  # as the server reports the fields it ignores
            log.warning("chat: ignored unknown message fields: %s", ", ".join(ignored))
        try:  # (continue_final_message's rules are the tokenizer's)
            text = self.tokenizer.apply_chat_template(messages, tools, chat_template=chat_template, tokenize=False,
                                                      add_generation_prompt=add_generation_prompt,
                                                      continue_final_message=continue_final_message, **extra)
        except ValueError as e:  # a field of `messages` named as the conversation's in a batch
            raise within(e, where) from None
        # the template writes any BOS itself: tokenize without adding special tokens (as vLLM and the server do)
        return {"prompt": text, "prompt_token_ids": self.tokenizer.encode(text, add_special_tokens=False,
                                                                          what=where)}

    def _run(self, prompt_list: list[PromptType], sampling_params: SamplingParams | Seq[SamplingParams] | None,
             use_tqdm: bool | Callable[..., tqdm],
             tokenization_kwargs: dict[str, Any] | None = None) -> list[RequestOutput]:
        if sampling_params is None:
            sampling_params = self.get_default_sampling_params()
        if isinstance(sampling_params, SamplingParams):
            params = [sampling_params] * len(prompt_list)
        elif isinstance(sampling_params, Seq) and not isinstance(sampling_params, str):
            params = list(sampling_params)
        else:
            raise ValueError("sampling_params: expected a SamplingParams or a list of them (one per prompt), got "
                             f"{type(sampling_params).__name__}")
        for i, sp in enumerate(params):
            if not isinstance(sp, SamplingParams):
                raise ValueError(f"sampling_params.{i}: expected a SamplingParams, got {type(sp).__name__}")
        if len(params) != len(prompt_list):
            raise ValueError(f"sampling_params: {len(params)} given for {len(prompt_list)} prompts")
        # all checked (and grammars compiled) before the first is added: a bad one means none ran
        seqs = []
        for i, (p, sp) in enumerate(zip(prompt_list, params, strict=True)):
            try:
                seqs.append(self._make_sequence(p, with_tokenization_kwargs(sp, tokenization_kwargs)))
            except ValueError as e:  # the field first, as ever; then which prompt of the batch
                raise in_batch(e, i, len(prompt_list)) from e
        bar = _ProgressBar(len(seqs), use_tqdm)
        if self.engine is None:
            decoder = ReferenceDecoder(self.model, self.layout, self.engine_config.prefill_chunk_size)
            for seq in seqs:
                for sample in seq.family:  # n > 1: each sample decoded on its own, from its own prefill
                    decoder.run(sample)
                bar.finished(seq.to_output())
        else:
            owner = self.engine.driver  # (read once: a thread whose loop closed lets go of it by itself)
            if isinstance(owner, EngineThread):  # an AsyncLLMEngine ran this engine: its thread hands it back
                owner.hand_back()
            me = threading.current_thread()
            self.engine.claim(me, threading.get_ident())  # (for the whole loop: no engine thread starts meanwhile)
            try:
                for seq in seqs:
                    self.engine.add_sequence(seq)
                mine = {seq.request_id for seq in seqs}  # (a step may also report an earlier call's aborted requests)
                while self.engine.has_unfinished_requests():
                    for out in self.engine.step():
                        if out.finished and out.request_id in mine:
                            bar.finished(out)
            except BaseException:  # interrupted (Ctrl-C, a progress bar that raised): this call's requests stop
                # here, their KV freed, rather than run to their end inside the next call
                try:
                    self.engine.abort_request([s.request_id for s in seqs if s.request_id in self.engine.requests])
                except Exception:  # (an engine that broke: what interrupted the call is the error to see)
                    log.exception("could not abort the interrupted call's requests")
                raise
            finally:
                self.engine.release(me)
        bar.close()
        return [s.to_output() for s in seqs]


class _ProgressBar:
    """vLLM's offline progress bar: requests done, and the prompt and output tokens/s of those done. `use_tqdm`: on
    or off, or the tqdm class (or factory) to draw it with, as vLLM takes it (a notebook's, a logging one)."""

    def __init__(self, total: int, use_tqdm: bool | Callable[..., tqdm]) -> None:
        make = use_tqdm if callable(use_tqdm) else tqdm
        # (made with vLLM's four keywords only, and only when asked for: a factory written to vLLM's call took no
        # `disable`)
        self.bar = make(total=total, desc="Processed prompts", dynamic_ncols=True,
                        postfix="est. speed input: 0.00 toks/s, output: 0.00 toks/s") if use_tqdm else None
        self.prompt_tokens = self.output_tokens = 0

    def finished(self, out: RequestOutput) -> None:
        if self.bar is None:
            return
        self.prompt_tokens += len(out.prompt_token_ids)
        self.output_tokens += sum(len(c.token_ids) for c in out.outputs)
        elapsed = self.bar.format_dict["elapsed"] or 1e-9
        # (what vLLM's loop uses of a bar: format_dict, postfix, update, close: a bar written to it has no more)
        self.bar.postfix = (f"est. speed input: {self.prompt_tokens / elapsed:.2f} toks/s, "
                            f"output: {self.output_tokens / elapsed:.2f} toks/s")
        self.bar.update(1)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
