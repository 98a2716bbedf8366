"""vLLM's offline API where a second probe found loopserve short of it: its import paths (`vllm.inputs`,
`vllm.engine.arg_utils`, `vllm.PromptType`, `vllm.PoolingParams`); `generate`'s and `chat`'s `tokenization_kwargs`;
`engine.model_config.max_model_len` (lm-eval's vLLM backend reads it) and `LLM.model_config`; None for "the default"
of `max_num_seqs`, `enable_prefix_caching`, `block_size`, `max_num_batched_tokens`; vLLM's newer `LLM(...)` keywords
at their defaults; `priority` and `lora_request` lists, one per prompt; SamplingParams' `flat_logprobs`,
`skip_reading_prefix_cache`, `skip_clone` and vLLM's unbounded temperature; and the tokenizer's `text_pair`.

Before: each import an ImportError; `tokenization_kwargs` and the SamplingParams fields TypeErrors;
`model_config.max_model_len` an AttributeError and `LLM.model_config` one too; the None values and the newer keywords
ValueErrors; `priority=[0]` for two prompts taken; `lora_request=[None]` refused; `temperature=150` refused; and
`tok("a", "b")` a TypeError from the tokenizers library (the pair read as `add_special_tokens`).
"""

from __future__ import annotations

import asyncio
import dataclasses

import pytest
import torch
from tokenizers import Tokenizer as Raw

from loopserve import LLM, AsyncLLMEngine, EngineArgs, SamplingParams
from loopserve.sampling_params import BeamSearchParams

pytestmark = pytest.mark.timeout(180)

GREEDY = SamplingParams(max_tokens=3, temperature=0, ignore_eos=True)
HELLO = [{"role": "user", "content": "Hello"}]


@pytest.fixture(scope="module")
def llm(tiny_ouro) -> LLM:
    return LLM(tiny_ouro, device="cpu")


def _tokens(outs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outs]


# -- import paths ------------------------------------------------------------------------------------------------
def test_vllms_import_paths_name_loopserves_classes():
    import loopserve
    from loopserve.async_llm import AsyncEngineArgs as OwnAsync
    from loopserve.async_llm import EngineArgs as Own
    from loopserve.engine.arg_utils import AsyncEngineArgs, EngineArgs
    from loopserve.engine.sequence import PromptType as OwnPromptType
    from loopserve.inputs import PromptType, TextPrompt, TokensPrompt

    assert (EngineArgs, AsyncEngineArgs) == (Own, OwnAsync)
    assert (TextPrompt, TokensPrompt) == (loopserve.TextPrompt, loopserve.TokensPrompt)
    assert PromptType == OwnPromptType == loopserve.PromptType
    assert {"PromptType", "PoolingParams"} <= set(loopserve.__all__)


def test_pooling_params_exist_and_refuse_to_be_made():
    """vLLM's scripts import PoolingParams; loopserve runs no pooling model, so making one says so."""
    from loopserve import PoolingParams

    with pytest.raises(ValueError, match=r"^PoolingParams: .*pooling models.*use generate"):
        PoolingParams()
    with pytest.raises(ValueError, match=r"^PoolingParams: "):
        PoolingParams(dimensions=8)


# -- generate's and chat's arguments ----------------------------------------------------------------------------
def test_tokenization_kwargs_are_taken_where_they_ask_for_nothing(llm):
    plain = _tokens(llm.generate(["ROMEO:"], GREEDY, use_tqdm=False))
    for value in (None, {}):
        assert _tokens(llm.generate(["ROMEO:"], GREEDY, use_tqdm=False, tokenization_kwargs=value)) == plain
    chat = _tokens(llm.chat(HELLO, GREEDY, use_tqdm=False))
    assert _tokens(llm.chat(HELLO, GREEDY, use_tqdm=False, tokenization_kwargs=None, mm_processor_kwargs=None)) == chat
    with pytest.raises(ValueError, match=r"^tokenization_kwargs: not supported by loopserve"):
        llm.generate(["ROMEO:"], GREEDY, use_tqdm=False, tokenization_kwargs={"truncation": True})
    with pytest.raises(ValueError, match=r"^tokenization_kwargs: not supported by loopserve"):
        llm.chat(HELLO, GREEDY, use_tqdm=False, tokenization_kwargs={"add_special_tokens": True})


def test_tokenization_kwargs_truncate_the_prompt_as_the_params_would(llm, tiny_ouro):
    """Newer vLLM takes truncate_prompt_tokens in `tokenization_kwargs` (its SamplingParams field deprecated): the
    same prompt tokens and outputs as the params' field, in generate, chat, LLMEngine.add_request and
    AsyncLLMEngine.generate (it was refused); a different value in both is a ValueError naming the field."""
    text = "ROMEO: what light through yonder window breaks"
    by_params = llm.generate([text], dataclasses.replace(GREEDY, truncate_prompt_tokens=3), use_tqdm=False)[0]
    by_kwargs = llm.generate([text], GREEDY, use_tqdm=False, tokenization_kwargs={"truncate_prompt_tokens": 3})[0]
    assert len(by_kwargs.prompt_token_ids) == 3 and by_kwargs.prompt_token_ids == by_params.prompt_token_ids
    assert by_kwargs.outputs[0].token_ids == by_params.outputs[0].token_ids
    chat = llm.chat(HELLO, GREEDY, use_tqdm=False, tokenization_kwargs={"truncate_prompt_tokens": 2})[0]
    assert len(chat.prompt_token_ids) == 2
    engine = llm.llm_engine
    engine.add_request("tk", text, GREEDY, tokenization_kwargs={"truncate_prompt_tokens": 3})
    outs = []
    while engine.has_unfinished_requests():
        outs += engine.step()
    assert outs[-1].prompt_token_ids == by_params.prompt_token_ids

    async def streamed() -> list[int]:
        engine = AsyncLLMEngine(LLM(tiny_ouro, device="cpu"))
        try:
            async for out in engine.generate(text, GREEDY, "tk-async",
                                             tokenization_kwargs={"truncate_prompt_tokens": 3}):
                last = out
            return last.prompt_token_ids
        finally:
            engine.shutdown()

    assert asyncio.run(streamed()) == by_params.prompt_token_ids
    with pytest.raises(ValueError, match=r"^tokenization_kwargs: truncate_prompt_tokens 3 differs from the "
                                         r"sampling params' 2$"):
        llm.generate([text], SamplingParams(truncate_prompt_tokens=2), use_tqdm=False,
                     tokenization_kwargs={"truncate_prompt_tokens": 3})
    with pytest.raises(ValueError, match=r"^truncate_prompt_tokens: "):
        llm.generate([text], GREEDY, use_tqdm=False, tokenization_kwargs={"truncate_prompt_tokens": 0})


def test_priority_is_one_per_prompt(llm):
    """vLLM: "The lengths of prompts (2) and priority (1) must be the same" (it was taken)."""
    with pytest.raises(ValueError, match=r"^priority: the lengths of prompts \(2\) and priority \(1\) must be "):
        llm.generate(["Hello", "World"], GREEDY, use_tqdm=False, priority=[0])
    assert len(llm.generate(["Hello", "World"], GREEDY, use_tqdm=False, priority=[0, 0])) == 2


def test_lora_request_takes_a_list_of_none_one_per_prompt(llm):
    """vLLM takes a list of LoRARequest | None, one per prompt: loopserve serves no adapters, so a list of None."""
    plain = _tokens(llm.generate(["a", "b"], GREEDY, use_tqdm=False))
    assert _tokens(llm.generate(["a", "b"], GREEDY, use_tqdm=False, lora_request=[None, None])) == plain
    assert len(llm.chat([HELLO], GREEDY, use_tqdm=False, lora_request=[None])) == 1
    with pytest.raises(ValueError, match=r"^lora_request: the lengths of prompts \(2\) and lora_request \(1\)"):
        llm.generate(["a", "b"], GREEDY, use_tqdm=False, lora_request=[None])
    with pytest.raises(ValueError, match=r"^lora_request: not supported by loopserve \(no LoRA adapters\); it takes "
                                         r"None or a list of None"):
        llm.generate(["a"], GREEDY, use_tqdm=False, lora_request=[object()])
    params = BeamSearchParams(beam_width=2, max_tokens=2)
    [out] = llm.beam_search(["ROMEO:"], params, lora_request=[None])
    assert out.sequences
    with pytest.raises(ValueError, match=r"^lora_request: the lengths of prompts \(1\) and lora_request \(2\)"):
        llm.beam_search(["ROMEO:"], params, lora_request=[None, None])


# -- max_model_len where vLLM keeps it ---------------------------------------------------------------------------
@pytest.mark.parametrize("scheduler", ["cdb", "reference"])
def test_model_config_holds_the_engines_max_model_len(tiny_ouro, scheduler):
    """lm-eval's vLLM backend reads `llm.llm_engine.model_config.max_model_len`; `LLM.model_config` is that object.
    A request's completion ends at it ("length")."""
    llm = LLM(tiny_ouro, device="cpu", max_model_len=12, scheduler=scheduler)
    assert llm.model_config.max_model_len == llm.max_model_len == 12
    assert llm.model_config.vocab_size == llm.config.vocab_size
    assert llm.model_config.dtype == next(llm.model.parameters()).dtype == torch.float32  # (vLLM's: a torch.dtype)
    if scheduler != "reference":
        assert llm.model_config is llm.llm_engine.model_config
        assert llm.llm_engine.max_model_len == 12
    [out] = llm.generate([[5] * 8], SamplingParams(max_tokens=20, ignore_eos=True), use_tqdm=False)
    assert len(out.outputs[0].token_ids) == 12 - 8 and out.outputs[0].finish_reason == "length"
    # the model's own config (the checkpoint's shapes) says where the engine's is
    with pytest.raises(AttributeError, match=r"'max_model_len'.*LLM\.model_config\.max_model_len"):
        llm.config.max_model_len  # noqa: B018


# -- LLM(...) keywords --------------------------------------------------------------------------------------------
NONE_IS_DEFAULT = ("max_num_seqs", "enable_prefix_caching", "block_size", "max_num_batched_tokens")


def test_none_takes_the_default_as_in_vllm(tiny_ouro):
    plain = LLM(tiny_ouro, device="cpu", scheduler="reference").engine_config
    nones = dict.fromkeys(NONE_IS_DEFAULT)
    assert LLM(tiny_ouro, device="cpu", scheduler="reference", **nones).engine_config == plain
    assert EngineArgs(str(tiny_ouro), scheduler="reference", **nones).create_llm().engine_config == plain
    for name in NONE_IS_DEFAULT:  # (any other value is checked as before)
        with pytest.raises(ValueError, match=f"^{name}: "):
            LLM(tiny_ouro, device="cpu", scheduler="reference", **{name: "x"})


NEWER = dict(kv_cache_memory_bytes=None, convert="auto", pooler_config=None, attention_config=None,
             profiler_config=None, allowed_media_domains=None, enable_return_routed_experts=False,
             num_gpu_blocks_override=None)


def test_newer_vllm_keywords_at_their_defaults_change_nothing(tiny_ouro, llm):
    plain = _tokens(llm.generate(["ROMEO:"], GREEDY, use_tqdm=False))
    assert _tokens(LLM(tiny_ouro, device="cpu", **NEWER).generate(["ROMEO:"], GREEDY, use_tqdm=False)) == plain
    assert EngineArgs(str(tiny_ouro), **NEWER).convert == "auto"


@pytest.mark.parametrize(("name", "value"), [
    ("kv_cache_memory_bytes", 2**30), ("num_gpu_blocks_override", 64), ("convert", "embed"),
    ("pooler_config", {"pooling_type": "MEAN"}), ("attention_config", {"backend": "FLASH_ATTN"}),
    ("profiler_config", {"profiler": "torch"}), ("allowed_media_domains", ["example.com"]),
    ("enable_return_routed_experts", True)])
def test_newer_vllm_keywords_asking_for_something_are_named(tiny_ouro, name, value):
    with pytest.raises(ValueError, match=rf"^{name}: not supported by loopserve \(.*\); it takes "):
        LLM(tiny_ouro, device="cpu", **{name: value})


# -- SamplingParams ----------------------------------------------------------------------------------------------
def test_newer_sampling_fields(llm):
    plain = _tokens(llm.generate(["ROMEO:"], GREEDY, use_tqdm=False))
    for extra in (dict(flat_logprobs=False), dict(skip_clone=True), dict(skip_clone=False)):
        assert _tokens(llm.generate(["ROMEO:"], dataclasses.replace(GREEDY, **extra), use_tqdm=False)) == plain
    with pytest.raises(ValueError, match=r"^flat_logprobs: not supported by loopserve.*it takes False, got True$"):
        SamplingParams(flat_logprobs=True)
    for name in ("flat_logprobs", "skip_clone", "skip_reading_prefix_cache"):
        with pytest.raises(ValueError, match=f"^{name}: must be true"):
            SamplingParams(**{name: 1})


def test_skip_reading_prefix_cache_gets_no_cached_tokens(tiny_ouro):
    """vLLM's rule: True never reads the prefix cache, None reads it unless prompt_logprobs are asked for (whose
    cached positions would have none); False with prompt_logprobs would leave positions without them: refused."""
    llm = LLM(tiny_ouro, device="cpu")
    prompt = "ROMEO: " * 12  # several full KV blocks

    def run(**extra) -> tuple[list[int], int]:
        [out] = llm.generate(prompt, dataclasses.replace(GREEDY, **extra), use_tqdm=False)
        return out.outputs[0].token_ids, out.num_cached_tokens

    tokens, _ = run()
    again, cached = run()
    assert again == tokens and cached > 0  # (the prompt's blocks are cached now)
    assert run(skip_reading_prefix_cache=True) == (tokens, 0)
    assert run(skip_reading_prefix_cache=False)[1] > 0
    assert run(prompt_logprobs=1)[1] == 0 and run(prompt_logprobs=1, skip_reading_prefix_cache=True)[1] == 0
    with pytest.raises(ValueError, match=r"^skip_reading_prefix_cache: False .*prompt_logprobs"):
        SamplingParams(prompt_logprobs=1, skip_reading_prefix_cache=False)


def test_temperature_has_vllms_bound_only(llm):
    """vLLM requires temperature >= 0 only; a large one samples near uniformly (it was refused above 100)."""
    hot = SamplingParams(max_tokens=8, temperature=150, seed=3, ignore_eos=True)
    [a], [b] = llm.generate(["ROMEO:"], hot, use_tqdm=False), llm.generate(["ROMEO:"], hot, use_tqdm=False)
    assert len(a.outputs[0].token_ids) == 8 and a.outputs[0].token_ids == b.outputs[0].token_ids
    assert BeamSearchParams(beam_width=2, max_tokens=2, temperature=150).temperature == 150
    for bad in (-0.5, float("inf")):
        with pytest.raises(ValueError, match=r"^temperature: must be a finite number >= 0"):
            SamplingParams(temperature=bad)


# -- the tokenizer -----------------------------------------------------------------------------------------------
def test_tokenizer_encodes_a_text_pair_as_transformers_does(tiny_ouro, llm):
    """transformers' `tok(text, text_pair)` and `encode(text, text_pair)`: the pair joined by the tokenizer's
    post-processor (the tokenizers library's own pair encoding of the same file)."""
    raw = Raw.from_file(str(tiny_ouro / "tokenizer.json"))
    tok = llm.get_tokenizer()
    want = raw.encode("ROMEO: hi", "JULIET: ho").ids
    assert tok("ROMEO: hi", "JULIET: ho").input_ids == want == tok.encode("ROMEO: hi", "JULIET: ho")
    assert tok("ROMEO: hi", text_pair="JULIET: ho")["attention_mask"] == [1] * len(want)
    assert tok(["ROMEO: hi", "a"], ["JULIET: ho", "b"]).input_ids == [want, raw.encode("a", "b").ids]
    assert tok("a", "b", add_special_tokens=False).input_ids == raw.encode("a", "b", add_special_tokens=False).ids
    with pytest.raises(ValueError, match=r"^text_pair: with a list of 2 texts, expected a list of as many"):
        tok(["a", "b"], ["c"])
    with pytest.raises(ValueError, match=r"^text_pair: expected one text"):
        tok("a", ["b"])


def test_tokenizer_call_takes_transformers_return_switches(tiny_ouro, llm):
    """lm-eval's vLLM backend calls `tokenizer(texts, return_attention_mask=False)`: transformers' switches are taken
    as transformers takes them (the mask left out; token type ids, the segment of each token, given when asked),
    `verbose` changes nothing; they were a TypeError."""
    raw = Raw.from_file(str(tiny_ouro / "tokenizer.json"))
    tok = llm.get_tokenizer()
    ids = [raw.encode("ROMEO: hi").ids, raw.encode("a").ids]
    assert tok(["ROMEO: hi", "a"], return_attention_mask=False) == {"input_ids": ids}
    mask = [1] * len(ids[1])
    assert tok("a", return_attention_mask=True, verbose=False) == {"input_ids": ids[1], "attention_mask": mask}
    pair = raw.encode("a", "b")
    got = tok("a", "b", return_token_type_ids=True, return_attention_mask=False)
    assert got == {"input_ids": pair.ids, "token_type_ids": pair.type_ids} and set(pair.type_ids) == {0, 1}
    assert "token_type_ids" not in tok("a", return_token_type_ids=False)
    assert set(tok("a", return_token_type_ids=1, return_attention_mask=0)) == {"input_ids", "token_type_ids"}
    assert set(tok("a", return_attention_mask=None, return_token_type_ids=None)) == {"input_ids", "attention_mask"}
    with pytest.raises(TypeError, match="unexpected keyword argument 'return_offsets'"):
        tok("a", return_offsets=True)


def test_tokenizer_chat_template_can_be_set_as_an_attribute(tiny_ouro):
    """guidellm's vLLM backend sets `tokenizer.chat_template = template` (transformers' attribute); it was read-only.
    The text is the template (never read as a file's name); a broken one is refused naming the field; None drops
    every template."""
    tok = LLM(tiny_ouro, device="cpu").get_tokenizer()
    tok.chat_template = "{% for m in messages %}<{{ m['content'] }}>{% endfor %}"
    assert tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False) == "<hi>"
    with pytest.raises(ValueError, match=r"^chat_template: not a valid Jinja template"):
        tok.chat_template = "{% for"
    assert tok.apply_chat_template([{"role": "user", "content": "x"}], tokenize=False) == "<x>"  # (unchanged)
    tok.chat_template = {"default": "<d>", "tool_use": "<t>"}  # (transformers' named templates)
    assert tok.apply_chat_template([{"role": "user", "content": "x"}], tokenize=False) == "<d>"
    with pytest.raises(ValueError, match=r"^chat_template: expected a Jinja template"):
        tok.chat_template = {"default": 3}
    tok.chat_template = None
    assert tok.chat_template is None
