"""vLLM's offline API where a probe found loopserve short of it: `LLMEngine.abort_request` with vLLM V1's list of ids
and `get_num_unfinished_requests`; `CompletionOutput.finished()`; vLLM's `LLM(...)` keywords for what loopserve lacks,
taken at the values that ask for nothing of it (`vllm_neutral.NEUTRAL`); `LLM.reset_prefix_cache`; bytes refused as
prompts; and transformers' tokenizer methods and attributes scripts call on `LLM.get_tokenizer()` (`tokenize`,
`convert_tokens_to_string`, `special_tokens_map`, `get_added_vocab`, `is_fast`, `model_max_length`, `name_or_path`,
`decode` of an id or a tensor, `apply_chat_template` of a batch).

Before: `abort_request(["b"])` was a TypeError (unhashable list), `finished()` and `get_num_unfinished_requests()`
AttributeErrors, `LLM(tokenizer_mode="auto")` (and the other keywords below) "not an LLM argument",
`generate(b"hello")` five prompts of one byte each, and the tokenizer methods missing or TypeErrors.

The tokenizer's expected values are the `tokenizers` library's on the same files, by the rules transformers' fast
tokenizer follows (transformers is not installed here); `test_transformers_agrees` compares with transformers itself
where it is.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import math
import re
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from tokenizers import Tokenizer as Raw
from tokenizers import models, pre_tokenizers

from loopserve import LLM, CompletionOutput, EngineArgs, RequestOutput, SamplingParams
from loopserve.beam_search import BeamSearchParams
from loopserve.tokenizer import Tokenizer

pytestmark = pytest.mark.timeout(180)

GREEDY = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
PROMPTS = ["The cat", "A loop", "ROMEO:"]


def _tokens(llm: LLM) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]


# -- LLMEngine ---------------------------------------------------------------------------------------------------
def test_abort_request_takes_vllms_list_of_ids_and_one_id(tiny_ouro):
    """vLLM V1's `abort_request(request_ids: list[str])`, and one id (a str) as before; ids not in flight are passed
    over. `get_num_unfinished_requests` counts each sample of an n > 1 request (vLLM runs them as requests of their
    own) until `step` reports it finished, so it is 0 exactly when `has_unfinished_requests()` is false."""
    engine = LLM(tiny_ouro, device="cpu").llm_engine
    assert engine.get_num_unfinished_requests() == 0
    long = SamplingParams(max_tokens=50, ignore_eos=True)
    engine.add_request("a", "ROMEO:", long)
    engine.add_request("b", "ROMEO:", SamplingParams(n=2, max_tokens=50, ignore_eos=True))
    engine.add_request("c", "ROMEO:", SamplingParams(max_tokens=3, ignore_eos=True))
    engine.add_request("d", "ROMEO:", long)
    assert engine.get_num_unfinished_requests() == 5
    engine.abort_request(["a", "b", "no-such-id"])
    engine.abort_request("d")
    engine.abort_request("no-such-id")
    engine.abort_request(())
    finished = {}
    while engine.get_num_unfinished_requests():
        assert engine.has_unfinished_requests()
        finished.update((o.request_id, o) for o in engine.step() if o.finished)
    assert not engine.has_unfinished_requests()
    assert {r: [c.finish_reason for c in o.outputs] for r, o in finished.items()} == {
        "a": ["abort"], "b": ["abort", "abort"], "c": ["length"], "d": ["abort"]}
    with pytest.raises(ValueError, match=r"^request_ids: expected a list of request ids or one id \(a str\), got int"):
        engine.abort_request(5)  # type: ignore[arg-type]
    # an id is a str, as vLLM's add_request requires (an int would come back as another type than the others)
    with pytest.raises(ValueError, match=r"^request_id: expected a str, got int 5"):
        engine.add_request(5, "ROMEO:", SamplingParams(max_tokens=1))  # type: ignore[arg-type]
    assert not engine.has_unfinished_requests()


def test_completion_output_finished_is_vllms_method():
    """vLLM's `CompletionOutput.finished()`: whether it has a finish reason (a method, as there)."""
    done = CompletionOutput(0, "x", [5], None, None, "length", exit_depths=[1])
    assert done.finished() is True
    assert CompletionOutput(0, "", [], None, None).finished() is False


def test_generated_completions_are_finished(tiny_ouro):
    [out] = LLM(tiny_ouro, device="cpu").generate("ROMEO:", GREEDY, use_tqdm=False)
    assert out.finished and out.outputs[0].finished()


# -- vLLM's LLM keywords for what loopserve lacks ----------------------------------------------------------------
NEUTRAL = dict(tokenizer_mode="hf", skip_tokenizer_init=False, revision=None, tokenizer_revision=None,
               download_dir=None, hf_overrides={}, quantization=None, kv_cache_dtype="auto", cpu_offload_gb=0,
               pipeline_parallel_size=1, enable_chunked_prefill=True, task="generate",
               runner="auto", enable_lora=False, mm_processor_kwargs=None, disable_custom_all_reduce=True,
               disable_log_stats=False, hf_token=True, distributed_executor_backend=None, enable_sleep_mode=False,
               compilation_config=None, data_parallel_size=1, enable_expert_parallel=False, worker_cls="auto",
               max_parallel_loading_workers=None, load_format="auto", config_format="auto", code_revision=None,
               model_impl="auto", served_model_name=["a", "b"], scheduling_policy="fcfs", async_scheduling=False,
               disable_sliding_window=True, disable_cascade_attn=False, calculate_kv_scales=False,
               kv_transfer_config=None, guided_decoding_backend="auto", structured_outputs_config=None,
               logits_processors=None, logprobs_mode="raw_logprobs", override_generation_config={},
               speculative_config=None,
               limit_mm_per_prompt=None, enable_prompt_embeds=False,
               allowed_local_media_path="", max_cpu_loras=None, max_num_partial_prefills=1,
               max_long_partial_prefills=1, long_prefill_token_threshold=0, num_scheduler_steps=1,
               preemption_mode="swap", max_cudagraph_capture_size=None,
               cuda_graph_sizes=[1, 2, 4], mm_processor_cache_gb=0,
               max_loras=1, max_lora_rank=16, fully_sharded_loras=False, lora_dtype="auto",  # (lm-eval passes these)
               stream_interval=1, use_tqdm_on_load=True, model_loader_extra_config=None, ignore_patterns=None,
               pt_load_map_location="cpu", kv_sharing_fast_prefill=False, enable_mm_embeds=False,
               interleave_mm_strings=False, media_io_kwargs=None, reasoning_parser="")  # (vLLM's newer ones)


def test_vllms_keywords_at_their_neutral_values_are_taken_and_change_nothing(tiny_ouro):
    plain = _tokens(LLM(tiny_ouro, device="cpu"))
    llm = LLM(tiny_ouro, device="cpu", **NEUTRAL)
    assert _tokens(llm) == plain
    assert _tokens(LLM(tiny_ouro, device="cpu", tokenizer_mode="auto", enable_chunked_prefill=None, task="auto",
                       hf_overrides=None, cpu_offload_gb=0.0, revision="main",
                       compilation_config={})) == plain  # ({}: refused once, though it asks for nothing)
    # (loopserve always chunks, and its outputs do not depend on chunking: vLLM's False changes nothing either)
    assert _tokens(LLM(tiny_ouro, device="cpu", enable_chunked_prefill=False)) == plain


@pytest.mark.parametrize(("kwargs", "message"), [
    (dict(tokenizer_mode="slow"), r"^tokenizer_mode: not supported by loopserve \(.*tokenizers library.*\); it takes "
                                  r"'auto' or 'hf', got 'slow'$"),
    (dict(skip_tokenizer_init=True), r"^skip_tokenizer_init: not supported by loopserve"),
    (dict(hf_overrides={"num_hidden_layers": 1}), r"^hf_overrides: .*it takes None or \{\}"),
    (dict(quantization="fp8"), r"^quantization: not supported by loopserve \(weights load unquantized"),
    (dict(kv_cache_dtype="fp8"), r"^kv_cache_dtype: .*it takes 'auto', got 'fp8'$"),
    (dict(logprobs_mode="processed_logprobs"), r"^logprobs_mode: .*raw ones.*it takes 'raw_logprobs', got "),
    (dict(cpu_offload_gb=4), r"^cpu_offload_gb: "),
    (dict(pipeline_parallel_size=2), r"^pipeline_parallel_size: "),
    (dict(pipeline_parallel_size=True), r"^pipeline_parallel_size: .*got True$"),  # (True == 1, but not an int)
    (dict(enable_chunked_prefill=0), r"^enable_chunked_prefill: .*prefilled in chunks.*None or True or False, "
                                     r"got 0$"),
    (dict(hf_token="hf_abc"), r"^hf_token: .*huggingface_hub's own token.*got a string \(not shown: a secret\)$"),
    (dict(hf_token=False), r"^hf_token: .*it takes None or True, got False$"),
    (dict(distributed_executor_backend="ray"), r"^distributed_executor_backend: .*in this process"),
    (dict(enable_sleep_mode=True), r"^enable_sleep_mode: "),
    (dict(compilation_config=3), r"^compilation_config: .*it takes None or \{\}, got 3$"),
    (dict(compilation_config={"level": 0}), r"^compilation_config: "),
    (dict(task="embed"), r"^task: .*generative models only"),
    (dict(runner="pooling"), r"^runner: "),
    (dict(enable_lora=True), r"^enable_lora: .*no LoRA adapters"),
    (dict(max_lora_rank=64), r"^max_lora_rank: .*no LoRA adapters.*it takes 16, got 64$"),
    (dict(mm_processor_kwargs={"fps": 2}), r"^mm_processor_kwargs: .*no multimodal inputs"),
    (dict(data_parallel_size=2), r"^data_parallel_size: .*loopserve serve --replicas.*it takes 1, got 2$"),
    (dict(scheduling_policy="priority"), r"^scheduling_policy: .*first come, first served.*got 'priority'$"),
    (dict(guided_decoding_backend="xgrammar"), r"^guided_decoding_backend: .*llguidance.*'auto' or 'guidance'"),
    (dict(logits_processors=[print]), r"^logits_processors: .*no custom logits processors"),
    (dict(speculative_config={"method": "ngram"}), r"^speculative_config: .*num_speculative_tokens"),
    (dict(disable_cascade_attn="no"), r"^disable_cascade_attn: .*True or False"),
    (dict(load_format="dummy"), r"^load_format: .*safetensors"),
    (dict(lora_request=None), r"^lora_request: not an LLM argument"),  # (generate's and chat's, not LLM's)
    (dict(priority=None), r"^priority: not an LLM argument"),
    (dict(max_seq_len_to_capture=8192), r"^max_seq_len_to_capture: not an LLM argument"),  # (gone from vLLM)
])
def test_vllms_keywords_asking_for_what_loopserve_lacks_are_named(tiny_ouro, kwargs, message):
    with pytest.raises(ValueError, match=message):
        LLM(tiny_ouro, device="cpu", **kwargs)


@pytest.mark.parametrize("kwargs", [dict(revision="abc123"), dict(tokenizer_revision="v2"),
                                    dict(revision="v1", tokenizer_revision="v2"), dict(download_dir="/tmp")])
def test_a_revision_of_a_local_folder_is_taken_unused(tiny_ouro, caplog, kwargs):
    """vLLM ignores revision, tokenizer_revision and download_dir for a local folder: loopserve refused them, failing
    scripts that pass the revision they downloaded or their cache folder. A hub id's still takes the defaults only."""
    plain = _tokens(LLM(tiny_ouro, device="cpu"))
    with caplog.at_level(logging.INFO, logger="loopserve.vllm_neutral"):
        assert _tokens(LLM(tiny_ouro, device="cpu", **kwargs)) == plain
    assert [r.getMessage() for r in caplog.records if r.name == "loopserve.vllm_neutral"] == [
        f"{k}={v!r} is unused: the model is a local folder, loaded as it is" for k, v in kwargs.items()]
    name, value = next(iter(kwargs.items()))
    with pytest.raises(ValueError, match=rf"^{name}: not supported by loopserve \(.*\); it takes None.*, got "
                                         rf"{re.escape(repr(value))}$"):
        LLM("nobody/nothing", device="cpu", **kwargs)
    assert EngineArgs(str(tiny_ouro), **kwargs).create_llm() is not None
    with pytest.raises(ValueError, match=rf"^{name}: "):
        EngineArgs("nobody/nothing", **kwargs)


def test_a_hub_id_takes_the_main_revision_for_model_and_tokenizer():
    """vLLM's default revision, "main", is the one a hub id is fetched at: asked for by name, for the model or its
    tokenizer, it is taken (tokenizer_revision="main" was refused where revision="main" was not)."""
    args = EngineArgs("nobody/nothing", revision="main", tokenizer_revision="main")
    assert (args.revision, args.tokenizer_revision) == ("main", "main")


# -- LLM.reset_prefix_cache --------------------------------------------------------------------------------------
def test_reset_prefix_cache_forgets_the_cached_prompt_blocks(tiny_ouro):
    """vLLM's `LLM.reset_prefix_cache()`: True, and a prompt seen before is prefilled from scratch again (the same
    tokens); False, and nothing forgotten, while a request is in flight (vLLM resets only when no request holds
    KV); `reset_running_requests=True` (vLLM preempts to reset at once) resets an idle engine and is refused naming
    it while a request runs (it was refused idle too)."""
    llm = LLM(tiny_ouro, device="cpu")
    prompt = "ROMEO: " * 12  # several full KV blocks

    def run() -> tuple[list[int], int]:
        [out] = llm.generate(prompt, GREEDY, use_tqdm=False)
        return out.outputs[0].token_ids, out.num_cached_tokens

    tokens, cached = run()
    assert cached == 0
    again, cached = run()
    assert again == tokens and cached > 0
    engine = llm.llm_engine
    engine.add_request("busy", "A loop", GREEDY)
    assert llm.reset_prefix_cache() is False
    with pytest.raises(ValueError, match=r"^reset_running_requests: not supported by loopserve with requests in "):
        llm.reset_prefix_cache(reset_running_requests=True)
    engine.run_to_completion()
    assert run()[1] > 0  # (not forgotten)
    assert llm.reset_prefix_cache() is True
    engine.kv.check_invariants(set())
    assert run() == (tokens, 0)
    assert llm.reset_prefix_cache(reset_connector=True) is True  # (no KV connector: nothing more to reset)
    assert run() == (tokens, 0)
    assert llm.reset_prefix_cache(reset_running_requests=True) is True  # (idle: nothing to preempt)
    assert run() == (tokens, 0)
    assert LLM(tiny_ouro, device="cpu", scheduler="reference").reset_prefix_cache() is True  # (caches nothing)


# -- prompts ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("prompts", [b"hello", bytearray(b"hello")])
def test_bytes_are_refused_as_prompts_saying_to_decode_them(tiny_ouro, prompts):
    """Bytes are a sequence of ints: they were read as one prompt per byte ("prompt 0 of 5")."""
    llm = LLM(tiny_ouro, device="cpu")
    want = rf"^prompts: got {type(prompts).__name__}, not text; decode them first"
    with pytest.raises(ValueError, match=want):
        llm.generate(prompts, GREEDY, use_tqdm=False)
    with pytest.raises(ValueError, match=want):
        llm.beam_search(prompts, BeamSearchParams(beam_width=2, max_tokens=2))


# -- the tokenizer: transformers' methods and attributes -----------------------------------------------------------
TEXT, PAIR = "Loops think twice.", " And again!"


def _raw(folder: Path) -> tuple[Raw, dict]:
    return Raw.from_file(str(folder / "tokenizer.json")), json.loads((folder / "tokenizer_config.json").read_text())


@pytest.mark.parametrize("arch", ["ouro", "huginn"])
def test_tokenize_and_convert_tokens_to_string_are_transformers(arch, request):
    """`tokenize`: the encoding's symbols, special tokens only with add_special_tokens (transformers' default: none);
    `convert_tokens_to_string`: the tokenizer's decoder over them (a byte-level BPE gives the text back)."""
    folder = request.getfixturevalue(f"tiny_{arch}")
    tok, (raw, _) = Tokenizer(folder), _raw(folder)
    symbols = tok.tokenize(TEXT)
    assert symbols == raw.encode(TEXT, add_special_tokens=False).tokens
    assert tok.tokenize(TEXT, add_special_tokens=True) == raw.encode(TEXT).tokens
    assert tok.tokenize(TEXT, PAIR) == raw.encode(TEXT, PAIR, add_special_tokens=False).tokens
    assert tok.convert_tokens_to_ids(symbols) == tok.encode(TEXT, add_special_tokens=False)
    assert tok.convert_tokens_to_string(symbols) == raw.decoder.decode(symbols) == TEXT
    long = "to be or not " * 2000  # (past RELEASE_GIL_FROM: the batch call, the same symbols)
    assert tok.tokenize(long, PAIR) == raw.encode(long, PAIR, add_special_tokens=False).tokens
    with pytest.raises(ValueError, match=r"^text: expected one text \(a str\), got list"):
        tok.tokenize(["a"])  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"^pair: expected one text \(a str\), got int"):
        tok.tokenize("a", 5)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"^pair: not valid Unicode text"):
        tok.tokenize("a", "\ud800")


@pytest.mark.parametrize("arch", ["ouro", "huginn"])
def test_special_tokens_map_added_vocab_and_attributes_are_transformers(arch, request):
    """transformers' (4.x) `special_tokens_map`: the special-token attributes set, then additional_special_tokens if
    any; `get_added_vocab`: tokenizer.json's added tokens -> ids; `is_fast`; `model_max_length` from
    tokenizer_config.json; `name_or_path` the folder."""
    folder = request.getfixturevalue(f"tiny_{arch}")
    tok, (raw, config) = Tokenizer(folder), _raw(folder)
    names = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
    want: dict = {n: config[n] for n in names if config.get(n)}
    if config.get("additional_special_tokens"):
        want["additional_special_tokens"] = config["additional_special_tokens"]
    assert tok.special_tokens_map == want
    assert tok.all_special_tokens == list(dict.fromkeys(
        t for v in want.values() for t in ([v] if isinstance(v, str) else v)))
    assert tok.get_added_vocab() == {t.content: i for i, t in sorted(raw.get_added_tokens_decoder().items())}
    assert tok.is_fast is True
    assert tok.model_max_length == config["model_max_length"]
    assert tok.name_or_path == str(folder)


def test_a_bare_tokenizer_folder_gets_transformers_defaults(tmp_path):
    """No tokenizer_config.json: transformers' model_max_length default (int(1e30)) and no special tokens; a
    tokenizer with no decoder joins symbols with spaces."""
    raw = Raw(models.WordLevel({"[UNK]": 0, "hello": 1, "world": 2}, unk_token="[UNK]"))
    raw.pre_tokenizer = pre_tokenizers.Whitespace()
    raw.save(str(tmp_path / "tokenizer.json"))
    tok = Tokenizer(tmp_path)
    assert tok.model_max_length == int(1e30) and tok.special_tokens_map == {} and tok.get_added_vocab() == {}
    assert tok.tokenize("hello world") == ["hello", "world"]
    assert tok.convert_tokens_to_string(["hello", "world"]) == "hello world"


def test_decode_takes_one_id_and_tensors_as_transformers_does(tiny_ouro):
    """transformers' decode runs `to_py_obj` on its input: one id (an int) decodes as a list of it, a torch tensor
    or a numpy array (or scalar) as its list; batch_decode so too, row by row."""
    tok = Tokenizer(tiny_ouro)
    ids = tok.encode("To be, or not")
    assert tok.decode(ids[0]) == tok.decode([ids[0]])
    for given in (torch.tensor(ids), np.array(ids), tuple(ids)):
        assert tok.decode(given) == tok.decode(ids) == "To be, or not"
    assert tok.decode(np.int64(ids[1])) == tok.decode(torch.tensor(ids[1])) == tok.decode([ids[1]])
    rows = [ids[:3], ids[3:6]]
    assert tok.batch_decode(torch.tensor(rows)) == tok.batch_decode(np.array(rows)) == [tok.decode(r) for r in rows]


@pytest.mark.parametrize("given,want", [
    ("abc", "ids: expected token ids (a list of integers, one integer, or a tensor or array of them), got str"),
    (1.5, "ids: expected token ids .*, got float"), (torch.tensor(1.5), "ids: expected token ids .*, got float"),
    (None, "ids: expected token ids .*, got NoneType"), (b"ab", "ids: expected token ids .*, got bytes"),
    (["a"], "ids.0: expected a token id (an integer >= 0), got 'a'"), ([1, 1.5], "ids.1: .* got 1.5"),
    ([-1], "ids.0: .* got -1"), ([2**32], "ids.0: .* got 4294967296"), ([2**64], "ids.0: .* got 18446744073709551616"),
])
def test_decode_of_what_is_not_token_ids_is_a_value_error_naming_it(tiny_ouro, given, want):
    """Not the tokenizers library's TypeError or OverflowError ("'str' object cannot be interpreted as an
    integer"), which names neither the argument nor the item."""
    tok = Tokenizer(tiny_ouro)
    with pytest.raises(ValueError, match="^" + want.replace("(", r"\(").replace(")", r"\)")):
        tok.decode(given)


def test_encode_and_decode_take_transformers_options_at_their_neutral_values(tiny_ouro):
    """transformers' options of encode, decode and batch_decode: taken where they ask for nothing, a ValueError naming
    the option where they would (they were a TypeError, "unexpected keyword", for every value); a name transformers
    does not have stays Python's TypeError. vLLM's tokenizers carry max_token_id."""
    tok = Tokenizer(tiny_ouro)
    ids = tok.encode("To be")
    assert tok.encode("To be", truncation=False, max_length=None, return_tensors=None, padding=False, stride=0) == ids
    assert tok.decode(ids, clean_up_tokenization_spaces=False) == tok.batch_decode(
        [ids], clean_up_tokenization_spaces=None)[0] == "To be"
    for call, option in ((lambda: tok.encode("To be", truncation=True, max_length=3), "truncation"),
                         (lambda: tok.encode("To be", return_tensors="pt"), "return_tensors"),
                         (lambda: tok.decode(ids, clean_up_tokenization_spaces=True), "clean_up_tokenization_spaces"),
                         (lambda: tok.batch_decode([ids], clean_up_tokenization_spaces=True),
                          "clean_up_tokenization_spaces")):
        with pytest.raises(ValueError, match=f"^{option}: not supported by this tokenizer"):
            call()
    for call in (lambda: tok.encode("To be", colour=1), lambda: tok.decode(ids, colour=1)):
        with pytest.raises(TypeError, match="unexpected keyword argument 'colour'"):
            call()
    assert tok.max_token_id == max(tok.get_vocab().values()) and tok.max_token_id < len(tok)


def test_batch_decode_of_what_is_not_token_ids_names_the_row(tiny_ouro):
    tok = Tokenizer(tiny_ouro)
    with pytest.raises(ValueError, match=r"^sequences\.1: expected token ids .* got str"):
        tok.batch_decode([[1], "ab"])
    with pytest.raises(ValueError, match=r"^sequences\.1\.0: expected a token id .* got -1"):
        tok.batch_decode([[1], [-1]])
    with pytest.raises(ValueError, match="^sequences: expected token ids .* got float"):
        tok.batch_decode(1.5)
    for one_id in (3, np.int64(3), torch.tensor(3)):  # (one id is not a batch: it decoded as [3] before)
        with pytest.raises(ValueError, match="^sequences: expected a list of token-id sequences"):
            tok.batch_decode(one_id)
    assert tok.batch_decode(torch.tensor([3])) == [tok.decode(3)]  # (a 1-d tensor: each id alone, as transformers)


def test_apply_chat_template_takes_a_batch_of_conversations(tiny_ouro):
    """transformers' batch (a list whose first item is a list): a list of what each conversation gives alone, text
    or ids; an error names the conversation's field under messages.<i>."""
    tok = Tokenizer(tiny_ouro)
    convs = [[{"role": "user", "content": "Hi"}],
             [{"role": "user", "content": "Yo"}, {"role": "assistant", "content": "Well"}]]
    for kwargs in ({}, {"tokenize": False}, {"add_generation_prompt": True, "tokenize": False}):
        assert tok.apply_chat_template(convs, **kwargs) == [tok.apply_chat_template(c, **kwargs) for c in convs]
    assert tok.apply_chat_template(tuple(convs), tokenize=False) == tok.apply_chat_template(convs, tokenize=False)
    with pytest.raises(ValueError, match=r"^messages\.1: expected a list of"):
        tok.apply_chat_template([convs[0], ["not a message"]])
    continued = tok.apply_chat_template(convs, continue_final_message=True, tokenize=False)  # (a user's final too)
    assert continued == [tok.apply_chat_template(c, continue_final_message=True, tokenize=False) for c in convs]


@pytest.mark.skipif(importlib.util.find_spec("transformers") is None, reason="transformers is not installed")
@pytest.mark.parametrize("arch", ["ouro", "huginn"])
def test_transformers_agrees(arch, request):
    import transformers
    from transformers import PreTrainedTokenizerFast

    folder = request.getfixturevalue(f"tiny_{arch}")
    hf, ours = PreTrainedTokenizerFast.from_pretrained(folder), Tokenizer(folder)
    assert ours.tokenize(TEXT) == hf.tokenize(TEXT) and ours.tokenize(TEXT, PAIR) == hf.tokenize(TEXT, PAIR)
    symbols = hf.tokenize(TEXT)
    assert ours.convert_tokens_to_string(symbols) == hf.convert_tokens_to_string(symbols)
    assert ours.get_added_vocab() == hf.get_added_vocab() and ours.is_fast == hf.is_fast
    assert ours.model_max_length == hf.model_max_length
    ids = ours.encode(TEXT)
    assert ours.decode(ids[0], skip_special_tokens=False) == hf.decode(ids[0])
    assert ours.decode(torch.tensor(ids), skip_special_tokens=False) == hf.decode(torch.tensor(ids))
    ours_map = ours.special_tokens_map
    if int(transformers.__version__.split(".")[0]) >= 5:  # (5 leaves additional_special_tokens out; 4.x's map)
        ours_map.pop("additional_special_tokens", None)
    assert ours_map == hf.special_tokens_map
    convs = [[{"role": "user", "content": "Hi"}], [{"role": "user", "content": "Yo"}]]
    assert ours.apply_chat_template(convs, tokenize=False) == hf.apply_chat_template(convs, tokenize=False)


def test_outputs_take_vllms_positional_order():
    """vLLM's order: CompletionOutput(index, text, token_ids, cumulative_logprob, logprobs, finish_reason,
    stop_reason), RequestOutput(request_id, prompt, prompt_token_ids, prompt_logprobs, outputs, finished, metrics):
    a mock or an adapter built positionally gets the fields it means (it got logprobs=-0.5 before)."""
    c = CompletionOutput(0, "hi", [1], -0.5, None, "stop", "\n")
    assert (c.cumulative_logprob, c.logprobs, c.finish_reason, c.stop_reason, c.exit_depths) == (-0.5, None, "stop",
                                                                                                 "\n", [])
    r = RequestOutput("r", "p", [1], None, [c], True)
    assert (r.prompt_logprobs, r.outputs, r.finished, r.metrics, r.num_cached_tokens) == (None, [c], True, None, 0)
    assert (r.lora_request, r.kv_transfer_params, r.encoder_prompt, c.lora_request) == (None, None, None, None)
    assert r.multi_modal_placeholders == {}  # (vLLM's, read by scripts that handle media: it was an AttributeError)


def test_add_request_takes_vllms_arguments(tiny_ouro):
    """vLLM's add_request(request_id, prompt, params, arrival_time, lora_request, tokenization_kwargs, trace_headers,
    priority): taken at the values that ask for nothing, any other a ValueError naming it; params not a
    SamplingParams a ValueError naming params (an AttributeError before)."""
    engine = LLM(tiny_ouro, device="cpu").llm_engine
    engine.add_request("a", "ROMEO:", SamplingParams(max_tokens=1), None, None, None, {"traceparent": "x"}, 0)
    for name, value in (("lora_request", object()), ("tokenization_kwargs", {"truncation": True}), ("priority", 2)):
        with pytest.raises(ValueError, match=f"^{name}: not supported by loopserve"):
            engine.add_request("b", "ROMEO:", SamplingParams(max_tokens=1), **{name: value})
    with pytest.raises(ValueError, match="^params: expected a SamplingParams, got NoneType"):
        engine.add_request("c", "ROMEO:", None)  # type: ignore[arg-type]
    while engine.has_unfinished_requests():
        engine.step()
    assert engine.get_num_unfinished_requests() == 0


def test_request_times_are_wall_clock_seconds(tiny_ouro):
    """vLLM's arrival_time is wall-clock (`time.time()`), and so are the output's times: a script that passes
    time.time() gets latencies of seconds (monotonic stamps beside it gave a time to first token of -1.8e9 s), and
    times read without one lie within the call's wall-clock bounds."""
    llm = LLM(tiny_ouro, device="cpu")
    engine = llm.llm_engine
    start = time.time()
    engine.add_request("w", "ROMEO:", SamplingParams(max_tokens=3), arrival_time=start)
    outs = []
    while engine.has_unfinished_requests():
        outs += engine.step()
    m = outs[-1].metrics
    assert m is not None and m.first_token_time is not None and m.finished_time is not None
    assert 0 <= m.time_to_first_token <= m.finished_time - m.arrival_time <= time.time() - start + 0.01, m
    before = time.time()
    out = llm.generate("ROMEO:", SamplingParams(max_tokens=2))[0]
    after = time.time()
    assert out.metrics is not None and out.metrics.finished_time is not None
    # (the clocks' offset is taken once: a step of the system clock since would show here, within a few ms)
    assert before - 0.05 <= out.metrics.arrival_time <= out.metrics.finished_time <= after + 0.05, (before, after)


def test_vllms_llm_attributes_for_one_process_generation(tiny_ouro):
    """vLLM's LLM attributes that scripts read (they were plain AttributeErrors): the tasks it runs, its engine's
    class, its world size (one process, one device), a multimodal cache reset (nothing to reset); its input
    processor an AttributeError saying what to use instead."""
    llm = LLM(tiny_ouro, device="cpu")
    assert llm.supported_tasks == ("generate",) and llm.engine_class is type(llm.llm_engine)
    assert llm.get_world_size() == llm.get_world_size(include_dp=False) == 1
    assert llm.reset_mm_cache() is None
    with pytest.raises(AttributeError, match=r"input_processor is not supported by loopserve: .*get_tokenizer"):
        _ = llm.input_processor


def test_use_tqdm_takes_a_tqdm_class(tiny_ouro):
    """vLLM's use_tqdm: a callable is the bar's class (a notebook's, a logging one); it was ignored before."""
    from tqdm import tqdm

    made = []

    class Bar(tqdm):
        def __init__(self, *args, **kwargs):
            made.append(kwargs["total"])
            super().__init__(*args, **kwargs)

    llm = LLM(tiny_ouro, device="cpu")
    llm.generate(["a", "b"], GREEDY, use_tqdm=Bar)
    llm.chat([{"role": "user", "content": "hi"}], GREEDY, use_tqdm=Bar)
    assert made == [2, 1]

    def factory(total, desc, dynamic_ncols, postfix):  # exactly the keywords vLLM passes (no `disable`)
        made.append(total)
        return tqdm(total=total, desc=desc, dynamic_ncols=dynamic_ncols, postfix=postfix)

    assert len(llm.generate(["a", "b", "c"], GREEDY, use_tqdm=factory)) == 3
    assert made == [2, 1, 3]

    class VllmStyleBar:  # only what vLLM's loop uses of a bar: format_dict, postfix, update, close
        def __init__(self, total, desc, dynamic_ncols, postfix):
            self.format_dict, self.postfix, self.n, self.closed = {"elapsed": 1.0}, postfix, 0, False

        def update(self, n):
            self.n += n

        def close(self):
            self.closed = True

    bars = []
    llm.generate(["a", "b"], GREEDY, use_tqdm=lambda **kw: bars.append(VllmStyleBar(**kw)) or bars[-1])
    assert bars[0].n == 2 and bars[0].closed and bars[0].postfix.startswith("est. speed input: ")


def test_priority_zeros_of_any_number_type_ask_for_nothing(tiny_ouro):
    """generate's priority list of numpy zeros (np.zeros(n, int)) is neutral, as 0 is; a non-zero one is refused."""
    llm = LLM(tiny_ouro, device="cpu")
    assert len(llm.generate(["a", "b"], GREEDY, use_tqdm=False, priority=list(np.zeros(2, int)))) == 2
    with pytest.raises(ValueError, match="^priority: not supported"):
        llm.generate(["a"], GREEDY, use_tqdm=False, priority=[np.int64(1)])
    with pytest.raises(ValueError, match="^priority: not supported"):
        llm.generate(["a"], GREEDY, use_tqdm=False, priority=[True])


def test_llm_engine_from_engine_args_as_vllms_example(tiny_ouro):
    """vLLM's llm_engine_example: `LLMEngine.from_engine_args(EngineArgs(...))`, then add_request / step; its
    outputs are the LLM's (it was an AttributeError). vLLM's methods for what loopserve lacks refuse by name on the
    engine as on the LLM (get_model_config was a bare AttributeError)."""
    from loopserve import EngineArgs, LLMEngine

    args = EngineArgs(model=str(tiny_ouro), dtype="float32", kv_cache_tokens=1024)
    engine = LLMEngine.from_engine_args(args)
    for i, prompt in enumerate(PROMPTS):
        engine.add_request(str(i), prompt, GREEDY)
    done = {}
    while engine.has_unfinished_requests():
        done.update({o.request_id: o.outputs[0].token_ids for o in engine.step() if o.finished})
    want = LLM(str(tiny_ouro), dtype="float32", kv_cache_tokens=1024).generate(PROMPTS, GREEDY)
    assert [done[str(i)] for i in range(len(PROMPTS))] == [o.outputs[0].token_ids for o in want]
    with pytest.raises(ValueError, match="^get_model_config: LLMEngine.get_model_config is not supported"):
        engine.get_model_config()
    # its model_config is loopserve's (the model's shapes and the engine's max_model_len, which harnesses read
    # there): vLLM's get_vocab_size() answers; hf_config is an AttributeError saying where it is
    assert engine.model_config.get_vocab_size() == engine.model_config.vocab_size
    assert engine.model_config.max_model_len == engine.max_model_len
    assert not hasattr(engine.model_config, "hf_config") and not hasattr(engine.model_config, "colour")
    with pytest.raises(ValueError, match="^engine_args: expected an EngineArgs"):
        LLMEngine.from_engine_args({"model": str(tiny_ouro)})
    with pytest.raises(ValueError, match="^enable_multiprocessing"):
        LLMEngine.from_engine_args(args, enable_multiprocessing=True)


def test_max_logprobs_caps_what_a_request_asks_for(tiny_ouro):
    """vLLM's max_logprobs is a cap of the engine's: a request asking for more logprobs or prompt_logprobs is a
    ValueError naming the field (it was refused at start unless it allowed loopserve's own 20, so vLLM launch lines
    with --max-logprobs 5 did not start)."""
    llm = LLM(tiny_ouro, dtype="float32", kv_cache_tokens=1024, max_logprobs=2)
    for field in ("logprobs", "prompt_logprobs"):
        with pytest.raises(ValueError, match=f"^{field}: at most 2 \\(the engine's max_logprobs\\), got 3$"):
            llm.generate([[5, 6, 7]], SamplingParams(max_tokens=2, **{field: 3}), use_tqdm=False)
    out = llm.generate([[5, 6, 7]], SamplingParams(max_tokens=2, logprobs=2, prompt_logprobs=2), use_tqdm=False)[0]
    assert all(len(step) >= 2 for step in out.outputs[0].logprobs)
    # vLLM's -1: the whole vocabulary, refused under a cap below it (the default, 20), given under max_logprobs -1;
    # above the default too (loopserve had a cap of its own, 20: LLM(max_logprobs=50) took logprobs=30 nowhere)
    default = LLM(tiny_ouro, dtype="float32", kv_cache_tokens=1024)
    vocab = default.config.vocab_size
    for field in ("logprobs", "prompt_logprobs"):
        for k, got in ((-1, f"-1 \\(the whole vocabulary, {vocab} tokens\\)"), (21, "21")):
            with pytest.raises(ValueError, match=f"^{field}: at most 20 \\(the engine's max_logprobs\\), got {got}$"):
                default.generate([[5, 6, 7]], SamplingParams(max_tokens=2, **{field: k}), use_tqdm=False)
    whole = LLM(tiny_ouro, dtype="float32", kv_cache_tokens=1024, max_logprobs=-1)
    assert whole.engine_config.max_logprobs == -1
    out = whole.generate([[5, 6, 7]], SamplingParams(max_tokens=2, logprobs=-1, prompt_logprobs=-1, temperature=0),
                         use_tqdm=False)[0]
    for step in [*out.outputs[0].logprobs, *out.prompt_logprobs[1:]]:
        assert len(step) == vocab
        assert math.isclose(sum(math.exp(lp.logprob) for lp in step.values()), 1, rel_tol=1e-4)
    with pytest.raises(ValueError, match=f"^logprobs: at most {vocab} \\(the model's vocabulary\\), got {vocab + 1}$"):
        whole.generate([[5, 6, 7]], SamplingParams(max_tokens=2, logprobs=vocab + 1), use_tqdm=False)
    wide = LLM(tiny_ouro, dtype="float32", kv_cache_tokens=1024, max_logprobs=30)
    out = wide.generate([[5, 6, 7]], SamplingParams(max_tokens=2, logprobs=30), use_tqdm=False)[0]
    assert all(len(step) >= 30 for step in out.outputs[0].logprobs)
    assert len(wide.beam_search([[5, 6, 7]], BeamSearchParams(beam_width=15, max_tokens=1))[0].sequences) == 15
    for bad in (-2, True, 2.0):
        with pytest.raises(ValueError, match="^max_logprobs: must be an integer >= 0 \\(or -1"):
            LLM(tiny_ouro, dtype="float32", kv_cache_tokens=1024, max_logprobs=bad)
    # a beam search asks for 2 * beam_width logprobs a step: refused by its width, the field the caller gave
    with pytest.raises(ValueError, match="^beam_width: at most 1 under max_logprobs 2"):
        llm.beam_search([[5, 6, 7]], BeamSearchParams(beam_width=2, max_tokens=2))
    assert len(llm.beam_search([[5, 6, 7]], BeamSearchParams(beam_width=1, max_tokens=2))[0].sequences) == 1
    narrow = LLM(tiny_ouro, dtype="float32", kv_cache_tokens=1024, max_logprobs=1)
    with pytest.raises(ValueError, match="^beam_width: a beam search needs max_logprobs >= 2"):  # (not "at most 0")
        narrow.beam_search([[5, 6, 7]], BeamSearchParams(beam_width=1, max_tokens=2))
