"""vLLM's arguments for what loopserve has no counterpart of (LoRA, quantization, priorities, ...), each taken at the
values that ask for nothing of it, so that vLLM's scripts that pass them run as they are; any other value is a
ValueError naming the argument (`check_neutral`); the same as vLLM's command-line flags (`add_neutral_args`: `serve`'s,
`EngineArgs.add_cli_args`'); and vLLM's methods for what loopserve lacks, refused saying what to use instead
(`ABSENT_METHODS`), and its `PoolingParams`, refused when made; and `vllm serve`'s own flags of that kind
(`SERVE_NEUTRAL`). Read by `LLM`,
`LLMEngine.add_request`, `AsyncLLMEngine` and those commands."""

from __future__ import annotations

import argparse
import json
import logging
import numbers
from collections.abc import Callable
from collections.abc import Sequence as Seq
from dataclasses import dataclass
from typing import Any

from loopserve.config_args import cli_terms, flag_of

log = logging.getLogger(__name__)
TRUNCATE_KEY = "truncate_prompt_tokens"  # the one key of vLLM's tokenization_kwargs loopserve takes


@dataclass(frozen=True)
class Neutral:
    """One of vLLM's arguments for what loopserve has no counterpart of, taken at the values that ask for nothing of
    it (vLLM's defaults, mostly), so that vLLM's scripts that pass them run as they are."""

    accepts: Callable[[Any], bool]
    values: str  # the values taken, as the error for any other names them
    why: str  # what loopserve does instead
    init: bool = True  # an `LLM(...)` keyword (else an argument of `generate`, `chat` or `add_request` only)
    switch: bool = False  # on vLLM's command line a flag without a value (`--x` on, `--no-x` off)
    secret: bool = False  # a string value is not repeated in an error (a token)
    many: bool = False  # on vLLM's command line a list: one or more values after the flag (nargs "+")
    # any value is taken when the model is a local folder, which has no revisions (vLLM ignores it there), and logged
    # as unused; `values` are what a hub id takes
    any_for_folder: bool = False


def _only(why: str, *values: Any, init: bool = True, secret: bool = False, switch: bool | None = None,
          many: bool = False, any_for_folder: bool = False) -> Neutral:
    """Taken at exactly these values, type and all (True is not 1); unless `switch` says, a switch on the command line
    where the values are booleans (and None)."""
    if switch is None:
        switch = all(v is None or isinstance(v, bool) for v in values) and any(isinstance(v, bool) for v in values)
    return Neutral(lambda v: any(type(v) is type(x) and v == x for x in values), " or ".join(map(repr, values)), why,
                   init, switch, secret, many, any_for_folder)


_ANY = "any value"


def _zero(v: Any) -> bool:  # (numpy's zeros too, as vLLM compares them)
    return isinstance(v, numbers.Number) and not isinstance(v, bool) and v == 0


def _any_bool(why: str) -> Neutral:
    """A switch of vLLM's that asks for nothing loopserve lacks, on or off."""
    return Neutral(lambda v: isinstance(v, bool), "True or False", why, switch=True)


def _positive_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= 1


_GRAPHS = ("every batch width and context runs graphed on CUDA (a bucket captured when a batch first needs it, or at "
           "start-up: --cuda-graph-warmup-tokens)")
# vLLM's `LLM(...)` keywords, and the arguments of `generate` and `chat`, for what loopserve lacks: each taken at the
# values that ask for nothing of it, any other a ValueError naming it (`check_neutral`).
NEUTRAL: dict[str, Neutral] = {
    "disable_log_stats": Neutral(lambda v: True, _ANY, "this class logs no periodic stats", switch=True),
    "disable_custom_all_reduce": Neutral(lambda v: True, _ANY, "it has no tensor parallelism to all-reduce for",
                                         switch=True),
    "tokenizer_mode": _only("the checkpoint's tokenizer.json is read by the tokenizers library: the fast tokenizer "
                            "'auto' and 'hf' pick", "auto", "hf"),
    "skip_tokenizer_init": _only("the checkpoint's tokenizer is always loaded", False),
    "revision": _only("a hub id is fetched at its default revision; a local folder takes any value, unused", None,
                      "main", any_for_folder=True),
    "tokenizer_revision": _only("the checkpoint's own tokenizer is loaded, from the model's revision; a local folder "
                                "takes any value, unused", None, "main", any_for_folder=True),
    "download_dir": _only("a hub model is fetched to the Hugging Face cache; a local folder takes any value, unused",
                          None, any_for_folder=True),
    # (True is vLLM's "the token of `huggingface-cli login`", which huggingface_hub reads anyway)
    # (vLLM's --hf-token takes the token: a value, never repeated in an error)
    "hf_token": _only("a hub model is fetched with huggingface_hub's own token (HF_TOKEN, or a login)", None, True,
                      secret=True, switch=False),
    "hf_overrides": _only("the checkpoint's config.json is read as it is", None, {}),
    "quantization": _only("weights load unquantized, in `dtype`", None),
    "kv_cache_dtype": _only("the KV cache is kept in the model's dtype", "auto"),
    "cpu_offload_gb": _only("weights are not offloaded", 0, 0.0),
    "pipeline_parallel_size": _only("a model runs on one device", 1),
    "distributed_executor_backend": _only("a model runs in this process, on one device", None),
    # (False too: loopserve always chunks, and its outputs do not depend on it: the chunks change no math under
    # depth_indexed and last_exited, and under shared their starts are fixed by prefill_chunk_size, not by how
    # the scheduler packs them, docs/design.md §4.2)
    "enable_chunked_prefill": _only("prompts are always prefilled in chunks (prefill_chunk_size, max_num_batched_"
                                    "tokens)", None, True, False),
    "enable_sleep_mode": _only("the model and KV cache stay on the device until the LLM is dropped", False),
    "compilation_config": _only("loopserve compiles its own stages (CUDA graphs: cuda_graphs, enforce_eager)",
                                None, {}),
    "data_parallel_size": _only("a model runs on one device; replicas: loopserve serve --replicas", 1),
    "enable_expert_parallel": _only("no mixture-of-experts layers to spread", False),
    "worker_cls": _only("a model runs in this process, with no workers", "auto"),
    "max_parallel_loading_workers": _only("weights load in this process", None),
    "load_format": _only("weights load from the folder's safetensors files", "auto", "safetensors"),
    "config_format": _only("the folder's config.json is read, Hugging Face's format", "auto", "hf"),
    "code_revision": _only("no remote modeling code is run: loopserve implements the models itself", None),
    "model_impl": _only("loopserve runs its own implementation of the model", "auto"),
    "served_model_name": Neutral(lambda v: True, _ANY, "an LLM answers to no name; the server's --served-model-name "
                                 "names it"),
    "scheduling_policy": _only("requests are admitted first come, first served", "fcfs"),
    "async_scheduling": _only("the engine pipelines its own steps, async_coda", None, False),
    # (both: loopserve's models have no sliding window to disable, and a config.json asking for one is refused)
    "disable_sliding_window": _only("its models attend over the whole context", False, True),
    "disable_cascade_attn": _any_bool("it has no cascade attention kernel to turn off"),
    "calculate_kv_scales": _only("the KV cache is kept in the model's dtype, unscaled", False),
    "kv_transfer_config": _only("no disaggregated prefill", None),
    "guided_decoding_backend": _only("structured output is llguidance's, vLLM's 'guidance'", "auto", "guidance"),
    "structured_outputs_config": _only("structured output is llguidance's, vLLM's 'guidance'", None),
    "logits_processors": _only("no custom logits processors: SamplingParams' own fields apply: penalties, "
                               "logit_bias, allowed_token_ids, bad_words, min_tokens", None, []),
    "logprobs_mode": _only("logprobs are the model's raw ones, vLLM's default: before penalties, logit_bias and "
                           "temperature (a structured output row's over the tokens its grammar allows)",
                           "raw_logprobs"),
    "speculative_config": _only("speculation drafts with the model's own shallower loops, num_speculative_tokens",
                                None),
    "limit_mm_per_prompt": _only("no multimodal inputs", None, {}),
    "enable_prompt_embeds": _only("prompts are token ids or text", False),
    "allowed_local_media_path": _only("no multimodal inputs", ""),
    "max_cpu_loras": _only("no LoRA adapters", None),
    "task": _only("it serves generative models only", "auto", "generate"),  # (vLLM's name before `runner`)
    "runner": _only("it serves generative models only", "auto", "generate"),
    "enable_lora": _only("no LoRA adapters", False),
    # (read by vLLM only with LoRA on; lm-eval's vLLM backend passes them, at their defaults, with enable_lora=False)
    "max_loras": _only("no LoRA adapters", 1),
    "max_lora_rank": _only("no LoRA adapters", 16),
    "fully_sharded_loras": _only("no LoRA adapters", False),
    "lora_dtype": _only("no LoRA adapters", "auto"),
    # (`generate` and `beam_search` take a list of them too, one per prompt: `check_per_prompt`)
    "lora_request": Neutral(lambda v: v is None or (isinstance(v, Seq) and not isinstance(v, str) and all(
        x is None for x in v)), "None or a list of None", "no LoRA adapters", init=False),
    # (`generate` takes a list, one per prompt: `check_per_prompt`; `LLMEngine.add_request` one int)
    "priority": Neutral(lambda v: v is None or _zero(v) or (isinstance(v, Seq) and all(map(_zero, v))),
                        "None, 0 or all 0", "no priority scheduling", init=False),
    "mm_processor_kwargs": _only("no multimodal inputs", None, {}),
    # `generate`'s, `chat`'s, `LLMEngine.add_request`'s: the prompt is tokenized as the model's tokenizer is set up,
    # its `truncate_prompt_tokens` (where newer vLLM takes it) set on the request's params
    # (`sampling_params.with_tokenization_kwargs`); tracing headers are for vLLM's OpenTelemetry spans, which
    # loopserve does not emit (so any value asks for nothing)
    "tokenization_kwargs": Neutral(lambda v: v is None or (isinstance(v, dict) and set(v) <= {TRUNCATE_KEY}),
                                   f"None or a dict of {TRUNCATE_KEY}",
                                   "prompts are tokenized as the checkpoint's tokenizer is set up", init=False),
    "trace_headers": Neutral(lambda v: True, _ANY, "it emits no tracing spans", init=False),
    # `AsyncLLMEngine.from_engine_args`'s
    "usage_context": Neutral(lambda v: True, _ANY, "it sends no usage telemetry", init=False),
    "stat_loggers": _only("it logs no periodic stats", None, init=False),
    # `AsyncLLM.generate`'s: the engine replica of a data-parallel deployment to send the request to
    "data_parallel_rank": Neutral(lambda v: v is None or _zero(v), "None or 0",
                                  "one engine; replicas: loopserve serve --replicas", init=False),
    # engine arguments of vLLM's (`LLM(...)` keywords and `vllm serve` flags) for its scheduler and CUDA graphs
    "max_num_partial_prefills": _only("prompts are prefilled first come, first served, in chunks", 1),
    "max_long_partial_prefills": _only("prompts are prefilled first come, first served, in chunks", 1),
    "long_prefill_token_threshold": _only("prompts are prefilled first come, first served, in chunks", 0),
    "num_scheduler_steps": _only("the engine plans one stage batch a step", 1),
    "stream_interval": _only("a stream gets an output at every engine step that gave it tokens", 1),
    # vLLM's loading keywords, at their defaults
    "use_tqdm_on_load": _any_bool("weights load without a progress bar"),
    "model_loader_extra_config": _only("weights load from the folder's safetensors files", None, {}),
    "ignore_patterns": _only("weights load from the folder's safetensors files", None, [], "original/**/*",
                             ["original/**/*"], many=True),
    "pt_load_map_location": _only("weights load from the folder's safetensors files", "cpu"),
    "kv_sharing_fast_prefill": _only("no KV sharing across layers", False),
    "enable_mm_embeds": _only("no multimodal inputs", False),
    "interleave_mm_strings": _only("no multimodal inputs", False),
    "media_io_kwargs": _only("no multimodal inputs", None, {}),
    # offline, the reasoning stays in the text, as vLLM's LLM gives it (the server splits it: serve --reasoning-parser)
    "reasoning_parser": Neutral(lambda v: v is None or isinstance(v, str), "None or a parser's name",
                                "LLM's outputs keep the reasoning in their text; serve --reasoning-parser splits it"),
    "preemption_mode": _only("a preempted request's KV is copied to the host and back, vLLM's 'swap' (docs/design.md "
                             "§6.5)", None, "swap"),
    "max_cudagraph_capture_size": Neutral(lambda v: v is None or _positive_int(v), "None or an integer >= 1", _GRAPHS),
    "cuda_graph_sizes": Neutral(lambda v: v is None or _positive_int(v) or (isinstance(v, list) and all(
        map(_positive_int, v))), "integers >= 1", _GRAPHS, many=True),
    # vLLM's newer `LLM(...)` keywords, at their defaults
    "kv_cache_memory_bytes": _only("the KV pool is sized by kv_cache_tokens, kv_cache_memory_gb or "
                                   "gpu_memory_utilization", None),
    "num_gpu_blocks_override": _only("the KV pool is sized by kv_cache_tokens, kv_cache_memory_gb or "
                                     "gpu_memory_utilization", None),
    "convert": _only("it serves generative models only, converted to nothing", "auto"),
    "pooler_config": _only("it serves generative models only, with no pooler", None),
    "attention_config": _only("loopserve runs its own attention over its paged KV layouts", None),
    "profiler_config": _only("wrap the calls in torch.profiler.profile() (the model runs in this process)", None),
    "allowed_media_domains": _only("no multimodal inputs", None),
    "enable_return_routed_experts": _only("no mixture-of-experts layers", False),
    "mm_processor_cache_gb": Neutral(lambda v: isinstance(v, int | float) and not isinstance(v, bool) and v >= 0,
                                     "a number >= 0", "no multimodal inputs"),
}


# `vllm serve`'s own flags (its OpenAI server's) for what loopserve's server lacks or does anyway, each taken at the
# values that ask for nothing of it, so that a vLLM launch line runs as it is; any other value stops the start with
# an error naming it (`check_neutral(SERVE_NEUTRAL, ...)`).
SERVE_NEUTRAL: dict[str, Neutral] = {
    "response_role": _only("a reply is the assistant's", "assistant"),
    "enable_prompt_tokens_details": _any_bool("usage always carries prompt_tokens_details.cached_tokens"),
    "enable_request_id_headers": _any_bool("every response carries X-Request-Id"),
    "disable_frontend_multiprocessing": _any_bool("the server and its engine run in one process, the engine on a "
                                                  "thread of its own"),
    "log_error_stack": _any_bool("a 500's traceback is always logged"),
    "chat_template_content_format": _only("a message's content parts are joined as text, vLLM's 'string'", "auto",
                                          "string"),
    "trust_request_chat_template": _only("a request cannot replace the server's chat template (--chat-template)",
                                         False),
    # (--enable-auto-tool-choice, --tool-call-parser and --reasoning-parser are serve's own flags: serve/cli.py)
    "tool_parser_plugin": _only("no tool-call parsers from plugins: --tool-call-parser's are built in", None,
                                ""),
    "exclude_tools_when_tool_choice_none": _only("tools reach the chat template whatever tool_choice says", False),
    "tool_server": _only("no built-in tool servers", None, ""),
    "enable_force_include_usage": _only("a stream's usage comes with its request's stream_options.include_usage",
                                        False),
    "lora_modules": _only("no LoRA adapters", None, [], many=True),
    "middleware": _only("no custom ASGI middleware", None, [], many=True),
    "log_config_file": _only("logging is set by --log-level", None, ""),
    "enable_ssl_refresh": _only("the TLS files are read once, at start-up", False),
    # (vLLM's defaults)
    "h11_max_incomplete_event_size": _only("HTTP heads are read with uvicorn's own limits", 4194304),
    "h11_max_header_count": _only("HTTP heads are read with uvicorn's own limits", 256),
    "headless": _only("the server runs its own engine", False),
    "api_server_count": _only("one API server process (replicas: --replicas)", 1),
    "otlp_traces_endpoint": _only("it emits no tracing spans", None, ""),
    "collect_detailed_traces": _only("it emits no tracing spans", None, ""),
}


def check_neutral(table: dict[str, Neutral] = NEUTRAL, /, *, local_folder: bool = False, **given: Any) -> None:
    """ValueError naming the first of `given` (keywords of `table`) set to a value that asks for what loopserve
    lacks. `local_folder`: the model is a folder here (`loader.is_local_folder`), where a revision is unused."""
    for name, value in given.items():
        neutral = table[name]
        if local_folder and neutral.any_for_folder:
            if value is not None:
                log.info("%s=%r is unused: the model is a local folder, loaded as it is", name, value)
            continue
        if not neutral.accepts(value):
            shown = "a string (not shown: a secret)" if neutral.secret and isinstance(value, str) else repr(value)
            raise ValueError(f"{name}: not supported by loopserve ({neutral.why}); it takes {neutral.values}, "
                             f"got {shown}")


def check_per_prompt(prompts: int, **given: Any) -> None:
    """vLLM's rule for `LLM.generate`'s (and `beam_search`'s) arguments that are one per prompt when a list
    (`priority`, `lora_request`): a ValueError naming the first of `given` whose list is not as long as the prompts."""
    for name, value in given.items():
        if isinstance(value, Seq) and not isinstance(value, str) and len(value) != prompts:
            raise ValueError(f"{name}: the lengths of prompts ({prompts}) and {name} ({len(value)}) must be the same")


_CLI_WORDS = {"none": None, "null": None, "true": True, "false": False}


def _flag_value(text: str) -> Any:
    """A vLLM flag's value as vLLM's parser would give it: true, false, null (any case, and None), else JSON where it
    parses (1, {}), else the text."""
    if text.lower() in _CLI_WORDS:
        return _CLI_WORDS[text.lower()]
    try:
        return json.loads(text)
    except ValueError:
        return text


def add_neutral_args(parser: argparse.ArgumentParser | argparse._ArgumentGroup,
                     table: dict[str, Neutral] = NEUTRAL) -> None:
    """vLLM's command-line flags of the `NEUTRAL` `LLM(...)` keywords the command has no flag of its own for, so that
    a vLLM launch line runs as it is (`--enable-chunked-prefill`, `--kv-cache-dtype auto`): a switch as vLLM's
    (`--x` true, `--no-x` false, no value: a model path after it stays the model), any other with one value (JSON or
    text), each kept under its keyword's name, so that `LLM(**vars(parser.parse_args()))` takes them as vLLM's `LLM`
    does (vLLM's examples build their engine so); `neutral_kwargs` reads them back for `check_neutral`."""
    taken = set(getattr(parser, "_option_string_actions", {}))
    for name, neutral in table.items():
        flag = flag_of(name)
        if not neutral.init or flag in taken:
            continue
        if neutral.switch:
            on, off = neutral.accepts(True), neutral.accepts(False)
            taken_as = "on or off" if on and off else "off (--no-" + flag[2:] + ") only" if off else "on only"
            text = f"vLLM's switch; not supported by loopserve ({neutral.why}): taken {taken_as}"
            parser.add_argument(flag, dest=name, action="store_const", const=True, default=argparse.SUPPRESS,
                                help=text.replace("%", "%%"))
            parser.add_argument("--no-" + flag[2:], dest=name, action="store_const", const=False,
                                default=argparse.SUPPRESS, help=argparse.SUPPRESS)
            continue
        text = f"vLLM's; not supported by loopserve ({neutral.why}): takes {cli_terms(neutral.values)}"
        parser.add_argument(flag, dest=name, type=_flag_value, default=argparse.SUPPRESS, metavar="VALUE",
                            nargs="+" if neutral.many else None, help=text.replace("%", "%%"))


def neutral_kwargs(args: argparse.Namespace, table: dict[str, Neutral] = NEUTRAL) -> dict[str, Any]:
    """The `add_neutral_args` flags given, as `LLM(...)` keywords (and a command's own flags of `NEUTRAL` names, serve's
    --served-model-name say, which any value passes); of `table`'s names where given."""
    return {k: v for k, v in vars(args).items() if k in table and table[k].init}


_POOLING = ("is for pooling models (embeddings, classification, scores); loopserve serves generative looped LMs: "
            "use generate (or chat, beam_search)")


class PoolingParams:
    """vLLM's `PoolingParams` (`from loopserve import PoolingParams` works, as vLLM's scripts import it): the params of
    a pooling model's requests, which loopserve does not run, so that making one is a ValueError saying so."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        raise ValueError(f"PoolingParams: {type(self).__name__} {_POOLING}, with SamplingParams")


_SLEEP = "is not supported by loopserve: the model and KV cache stay on the device until the engine is dropped"
_IN_PROCESS = "is not supported by loopserve: the model runs in this process, with no workers to call (llm.model)"
_PROFILE = "is not supported by loopserve: wrap the calls in torch.profiler.profile() (the model runs in this process)"
_LORA = "is not supported by loopserve: it serves no LoRA adapters"
# vLLM's methods of `LLM` and of its async engine for what loopserve has no counterpart of: they exist (`hasattr` is
# true, as on vLLM's classes) and raise a ValueError naming themselves and saying what to use instead when called
_CONFIGS = ("is not supported by loopserve: its configs are those of the LLM (LLM.model_config: the model's shapes "
            "and max_model_len, LLM.engine_config, LLM.load_config; an AsyncLLMEngine's LLM is its .llm)")
ABSENT_METHODS = {
    **dict.fromkeys(("encode", "embed", "classify", "score", "reward"), _POOLING),
    **dict.fromkeys(("sleep", "wake_up"), _SLEEP),
    **dict.fromkeys(("collective_rpc", "apply_model"), _IN_PROCESS),
    **dict.fromkeys(("start_profile", "stop_profile"), _PROFILE),
    **dict.fromkeys(("add_lora", "remove_lora", "list_loras", "pin_lora"), _LORA),
    "set_tokenizer": "is not supported by loopserve: the checkpoint's tokenizer is always used (get_tokenizer())",
    "get_metrics": "is not supported by loopserve: the engine's counters are its stats (LLMEngine.stats); the "
                   "server exports Prometheus /metrics",
    **dict.fromkeys(("get_model_config", "get_vllm_config"), _CONFIGS),
}
_PROCESSOR = ("is not supported by loopserve: prompts are tokenized and checked by the LLM (get_tokenizer(); "
              "LLM.generate's rules)")
# vLLM's AsyncLLM methods (not LLM's) for what loopserve lacks: `AsyncLLMEngine`'s, beside the table above
ASYNC_ABSENT_METHODS = {
    "get_decoding_config": _CONFIGS,
    **dict.fromkeys(("pause_generation", "resume_generation", "is_paused"),
                    "is not supported by loopserve: it does not update weights in place; abort the requests (or "
                    "shutdown()) and build a new engine"),
    "add_request": "is not supported by loopserve: generate(prompt, params, request_id) adds a request and streams "
                   "its outputs (LLMEngine.add_request is the offline engine's)",
    "get_input_preprocessor": _PROCESSOR,
}
# vLLM's attributes (not methods) for the same: reading one is an AttributeError saying what to use instead
ABSENT_ATTRIBUTES = {
    "vllm_config": _CONFIGS,
    "input_processor": _PROCESSOR,
}


def absent_method(owner: object, name: str, more: dict[str, str] | None = None) -> Callable[..., Any]:
    """`owner.name` for an `ABSENT_METHODS` name: a function that refuses (a ValueError naming it, saying what to use
    instead; `more`: the owner's own such methods); an `ABSENT_ATTRIBUTES` name is an AttributeError saying the same
    (`hasattr` stays False), any other name the usual AttributeError (for `__getattr__`)."""
    why = ABSENT_METHODS.get(name) or (more or {}).get(name)
    kind = type(owner).__name__
    if name in ABSENT_ATTRIBUTES:
        raise AttributeError(f"{kind!r} object has no attribute {name!r}: {kind}.{name} {ABSENT_ATTRIBUTES[name]}")
    if why is None:
        raise AttributeError(f"{kind!r} object has no attribute {name!r}")

    def refuse(*args: Any, **kwargs: Any) -> Any:
        raise ValueError(f"{name}: {kind}.{name} {why}")
    return refuse
