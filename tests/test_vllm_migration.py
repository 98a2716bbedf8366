"""A vLLM script moved to loopserve: `LLM(seed=None)` and vLLM's other `LLM(...)` keywords (max_model_len,
gpu_memory_utilization, enforce_eager, tensor_parallel_size, trust_remote_code, tokenizer, swap_space,
disable_log_stats), the same keywords as `serve` flags with the same defaults and checks (`LoadConfig`),
truncate_prompt_tokens=-1, `llm.llm_engine`, and the endpoints the openai client's `models.retrieve` and vLLM's
probes call (GET /v1/models/{model}, /ping)."""

from __future__ import annotations

import dataclasses
import inspect
import logging
import os
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
import torch

from loopserve import LLM, SamplingParams
from loopserve.cli import build_parser
from loopserve.serve.api import load_engine
from loopserve.serve.cli import _check
from tests.server_helpers import REPO, Server, run_server

pytestmark = pytest.mark.timeout(180)

SAMPLED = SamplingParams(max_tokens=6, temperature=1.0, ignore_eos=True)  # unseeded: the LLM's seed decides
PROMPTS = ["The cat", "A loop", "ROMEO:"]
KEY = "migration-key"


def _tokens(llm: LLM, params: SamplingParams = SAMPLED) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params, use_tqdm=False)]


# -- seed ------------------------------------------------------------------------------------------------------
def test_seed_none_draws_a_random_seed_once(tiny_ouro):
    """vLLM's seed=None: a random seed, drawn at construction; the run repeats under that seed."""
    llm = LLM(tiny_ouro, seed=None)
    first = _tokens(llm)  # (raised TypeError: None * int)
    assert isinstance(llm.seed, int) and not isinstance(llm.seed, bool)
    assert _tokens(LLM(tiny_ouro, seed=llm.seed)) == first
    assert len({LLM(tiny_ouro, seed=None, scheduler="reference").seed for _ in range(3)}) == 3


@pytest.mark.parametrize("seed", ["x", 1.5, True, [1]])
def test_a_seed_that_is_not_an_integer_is_refused_at_construction(tiny_ouro, seed):
    with pytest.raises(ValueError, match=r"^seed: must be an integer"):
        LLM(tiny_ouro, seed=seed)
    with pytest.raises(ValueError, match=r"^seed: must be an integer"):
        load_engine(tiny_ouro, seed=seed, device="cpu")


def test_the_server_engine_takes_seed_none(tiny_ouro):
    engine, _ = load_engine(tiny_ouro, seed=None, device="cpu")
    assert isinstance(engine.seed, int)


# -- vLLM's LLM keywords ---------------------------------------------------------------------------------------
def test_output_neutral_vllm_keywords_are_accepted_and_change_nothing(tiny_ouro):
    """On the CPU graphs are off anyway, so enforce_eager changes nothing here either."""
    plain = _tokens(LLM(tiny_ouro, seed=5))
    llm = LLM(tiny_ouro, seed=5, trust_remote_code=True, tensor_parallel_size=1, tokenizer=str(tiny_ouro),
              swap_space=4, disable_log_stats=True, enforce_eager=True, gpu_memory_utilization=None)
    assert _tokens(llm) == plain
    assert llm.engine_config.cuda_graphs is False  # enforce_eager: CUDA graphs off
    assert _tokens(LLM(tiny_ouro, seed=5, tokenizer=None)) == plain


@pytest.mark.parametrize(("kwargs", "message"), [
    (dict(tensor_parallel_size=2), r"^tensor_parallel_size: must be 1, got 2: loopserve runs a model on one device "
                                   r".*--replicas"),
    (dict(tensor_parallel_size=True), r"^tensor_parallel_size: must be 1"),
    (dict(tensor_parallel_size=1.0), r"^tensor_parallel_size: must be 1 \(an integer\), got 1.0$"),  # (was taken)
    (dict(tensor_parallel_size="1"), r"^tensor_parallel_size: must be 1 \(an integer\), got '1'$"),
    (dict(enforce_eager=True, cuda_graphs=True), r"^enforce_eager: turns CUDA graphs off, but cuda_graphs=True"),
    (dict(gpu_memory_utilization=1.5), r"^gpu_memory_utilization: must be in \(0, 1\], got 1.5"),
    (dict(gpu_memory_utilization=0.5, kv_cache_tokens=256), r"^gpu_memory_utilization: .*not both"),
    (dict(gpu_memory_utilization=0, device="cpu"), r"^gpu_memory_utilization: must be in \(0, 1\], got 0"),
    (dict(gpu_memory_utilization=-0.5, device="cpu"), r"^gpu_memory_utilization: must be in \(0, 1\]"),
    (dict(max_model_len=4096), r"^max_model_len: must be in \[2, 2048\] \(the model's context; "
                               r"VLLM_ALLOW_LONG_MAX_MODEL_LEN=1 allows more, as vLLM's\), got 4096"),
    (dict(max_model_len="64"), r"^max_model_len: must be an integer"),
    (dict(swap_space=-1), r"^swap_space: must be a number of GiB >= 0"),
    (dict(tokenizer="/somewhere/else"), r"^tokenizer: '/somewhere/else' is not the model's folder; loopserve uses "
                                        r"the checkpoint's own tokenizer"),
    (dict(max_num_seq=4), r"^max_num_seq: not an LLM argument \(known: .*max_num_seqs.*\)$"),
])
def test_bad_vllm_keywords_are_named(tiny_ouro, kwargs, message):
    with pytest.raises(ValueError, match=message):
        LLM(tiny_ouro, **kwargs)


def test_vllms_long_max_model_len_variable_lets_the_context_grow(tiny_ouro, monkeypatch, caplog):
    """$VLLM_ALLOW_LONG_MAX_MODEL_LEN=1 lets max_model_len pass the model's context, with a warning, as vLLM's does (it
    was ignored: the same error as without it); a prompt longer than the model's context then runs."""
    from loopserve.engine import budget

    budget._warn_long_model_len.cache_clear()  # (once a process: as if this process had not said it yet)
    monkeypatch.setenv("VLLM_ALLOW_LONG_MAX_MODEL_LEN", " 1\n")  # (read as vLLM reads it: stripped)
    with caplog.at_level(logging.WARNING, logger="loopserve.engine.budget"):
        llm = LLM(tiny_ouro, max_model_len=2100, kv_cache_tokens=2304)
    assert llm.llm_engine.max_model_len == 2100
    said = [r for r in caplog.records if "greater than the model's context (2048)" in r.getMessage()]
    assert len(said) == 1, caplog.text  # (once, though the LLM and its engine both check it)
    [out] = llm.generate({"prompt_token_ids": [5 + k % 50 for k in range(2090)]},
                         SamplingParams(max_tokens=3, temperature=0, ignore_eos=True), use_tqdm=False)
    assert len(out.outputs[0].token_ids) == 3
    monkeypatch.setenv("VLLM_ALLOW_LONG_MAX_MODEL_LEN", "0")
    with pytest.raises(ValueError, match=r"^max_model_len: must be in \[2, 2048\]"):
        LLM(tiny_ouro, max_model_len=2100)
    with pytest.raises(ValueError, match=r"^max_model_len: must be in \[2, 2048\] \(the model's context\), got 1$"):
        budget.checked_model_len(1, 2048)  # (LLMEngine's check: the variable allows no less, so it is not named)


def test_max_model_len_auto_is_what_the_kv_cache_holds(tiny_ouro):
    """vLLM's max_model_len "auto" (or -1; --max-model-len auto): the model's context, or what the KV pool holds if
    less (it was refused)."""
    from loopserve.cli import build_parser

    for auto in ("auto", -1):
        assert LLM(tiny_ouro, max_model_len=auto, kv_cache_tokens=512).max_model_len == 512
    assert LLM(tiny_ouro, max_model_len="auto", kv_cache_tokens=4096).max_model_len == 2048  # (the model's context)
    assert LLM(tiny_ouro, max_model_len="auto", scheduler="reference").max_model_len == 2048  # (no pool)
    assert [build_parser().parse_args(["serve", "--max-model-len", a]).max_model_len for a in ("auto", "AUTO")] == [
        -1, -1]
    with pytest.raises(ValueError, match=r"^max_model_len: must be an integer >= 2 .*, or auto \(-1\), got -2"):
        LLM(tiny_ouro, max_model_len=-2)


def test_gpu_memory_utilization_on_the_cpu_is_a_warning_with_no_effect(tiny_ouro, caplog):
    """vLLM's scripts pass it everywhere (it was a ValueError on the CPU): the KV pool stays as kv_cache_memory_gb
    sizes it, and the outputs as without it."""
    plain = LLM(tiny_ouro, seed=5, device="cpu", dtype="float32")
    with caplog.at_level(logging.WARNING, logger="loopserve.load_config"):
        llm = LLM(tiny_ouro, seed=5, device="cpu", dtype="float32", gpu_memory_utilization=0.9)
    assert "gpu_memory_utilization=0.9 has no effect on the cpu" in caplog.text
    assert llm.engine_config == plain.engine_config
    assert _tokens(llm) == _tokens(plain)
    engine, _ = load_engine(tiny_ouro, device="cpu", gpu_memory_utilization=1)  # the server's engine too
    assert engine.cfg.kv_cache_memory_gb == plain.engine_config.kv_cache_memory_gb


def test_generate_and_chat_take_vllms_arguments_at_their_no_op_values(tiny_ouro):
    """vLLM's generate(..., lora_request, priority) and chat(...) in vLLM's argument order (a TypeError before);
    the values that ask for what loopserve lacks are ValueErrors naming the argument."""
    llm = LLM(tiny_ouro, device="cpu")
    greedy = SamplingParams(max_tokens=3, temperature=0.0)
    plain = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, greedy, use_tqdm=False)]
    same = llm.generate(PROMPTS, greedy, False, None, [0, 0, 0])  # (vLLM's positional order)
    assert [o.outputs[0].token_ids for o in same] == plain
    hello = [{"role": "user", "content": "Hello"}]
    [want] = llm.chat(hello, greedy, use_tqdm=False)
    [got] = llm.chat(hello, greedy, False, None, None, "string", True, False, None, None, {})
    assert got.outputs[0].token_ids == want.outputs[0].token_ids and got.prompt == want.prompt
    for call, name in ((lambda: llm.generate(PROMPTS, greedy, use_tqdm=False, priority=[1, 0, 0]), "priority"),
                       (lambda: llm.generate(PROMPTS, greedy, use_tqdm=False, lora_request=object()), "lora_request"),
                       (lambda: llm.chat(hello, greedy, use_tqdm=False, chat_template_content_format="openai"),
                        "chat_template_content_format"),
                       (lambda: llm.chat(hello, greedy, use_tqdm=False, mm_processor_kwargs={"fps": 2}),
                        "mm_processor_kwargs")):
        with pytest.raises(ValueError, match=f"^{name}: "):
            call()


@pytest.mark.parametrize("method", ["encode", "embed", "classify", "score", "reward"])
def test_vllms_pooling_methods_are_refused_naming_themselves(tiny_ouro, method):
    """A vLLM script that calls a pooling method gets a ValueError saying what to use instead, not an
    AttributeError; other missing attributes stay AttributeErrors (so `getattr(llm, x, default)` works)."""
    llm = LLM(tiny_ouro, device="cpu")
    assert callable(getattr(llm, method))
    with pytest.raises(ValueError, match=f"^{method}: LLM.{method} is for pooling models.*use generate"):
        getattr(llm, method)(["Hello"])
    assert getattr(llm, "no_such_method", None) is None
    with pytest.raises(AttributeError, match="no_such_method"):
        llm.no_such_method  # noqa: B018


@pytest.mark.parametrize("method", ["sleep", "wake_up", "collective_rpc", "apply_model", "start_profile",
                                    "stop_profile", "set_tokenizer", "get_metrics"])
def test_vllms_methods_for_what_loopserve_lacks_say_what_to_use(tiny_ouro, method):
    """They were AttributeErrors; now a ValueError naming the method and what to do instead."""
    llm = LLM(tiny_ouro, device="cpu")
    with pytest.raises(ValueError, match=f"^{method}: LLM.{method} is not supported by loopserve: "):
        getattr(llm, method)()


def test_max_model_len_caps_prompt_plus_completion(tiny_ouro):
    """As the model's own context does for `LLM` (vLLM's offline rule): a prompt that leaves no room is refused
    naming `prompt`; a completion asked to run past the cap ends there, finish_reason "length"."""
    llm = LLM(tiny_ouro, max_model_len=24)
    assert llm.max_model_len == 24
    with pytest.raises(ValueError, match=r"^prompt: This model's maximum context length is 24 tokens. However, your "
                                         r"request has 24 input tokens"):
        llm.generate({"prompt_token_ids": [5] * 24}, SamplingParams(max_tokens=1), use_tqdm=False)
    out = llm.generate({"prompt_token_ids": [5] * 20}, SamplingParams(max_tokens=100, ignore_eos=True),
                       use_tqdm=False)[0].outputs[0]
    assert (len(out.token_ids), out.finish_reason) == (4, "length")
    unset = llm.generate({"prompt_token_ids": [5] * 20}, SamplingParams(max_tokens=None, ignore_eos=True),
                         use_tqdm=False)[0].outputs[0]
    assert len(unset.token_ids) == 4  # no max_tokens: the room left under the cap
    floor = llm.generate({"prompt_token_ids": [5] * 20}, SamplingParams(max_tokens=100, min_tokens=50),
                         use_tqdm=False)[0].outputs[0]
    assert (len(floor.token_ids), floor.finish_reason) == (4, "length")  # as min_tokens past the model's context
    reference = LLM(tiny_ouro, max_model_len=24, scheduler="reference")
    with pytest.raises(ValueError, match=r"^prompt: .* your request has 30 input tokens"):
        reference.generate({"prompt_token_ids": [5] * 30}, SamplingParams(max_tokens=1), use_tqdm=False)


@pytest.mark.parametrize("scheduler", ["cdb", "reference"])
def test_truncate_prompt_tokens_minus_one_keeps_what_the_context_leaves(tiny_ouro, scheduler):
    """vLLM's truncate_prompt_tokens=-1: the prompt's last max_model_len - max_tokens tokens (this LLM's 24, not the
    model's 2048), so the request runs; max_model_len - 1 without max_tokens (the completion then runs to the
    context's end). A shorter prompt runs whole. generate and chat alike."""
    llm = LLM(tiny_ouro, max_model_len=24, scheduler=scheduler)
    greedy = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    to_context = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True, truncate_prompt_tokens=-1)
    short = list(range(5, 25))  # 20 tokens: exactly what 24 - 4 leaves
    got, want = (llm.generate({"prompt_token_ids": short}, p, use_tqdm=False)[0] for p in (to_context, greedy))
    assert got.prompt_token_ids == want.prompt_token_ids == short
    assert got.outputs[0].token_ids == want.outputs[0].token_ids
    hi = [{"role": "user", "content": "hi"}]  # 15 tokens once rendered
    got, want = (llm.chat(hi, p, use_tqdm=False)[0] for p in (to_context, greedy))
    assert got.prompt_token_ids == want.prompt_token_ids and got.outputs[0].token_ids == want.outputs[0].token_ids
    with pytest.raises(ValueError, match=r"^prompt: .* your request has 30 input tokens"):  # uncut
        llm.generate({"prompt_token_ids": list(range(5, 35))}, greedy, use_tqdm=False)
    long_ids = list(range(5, 35))  # 30 tokens
    got = llm.generate({"prompt_token_ids": long_ids}, to_context, use_tqdm=False)[0]
    assert got.prompt_token_ids == long_ids[-20:] and len(got.outputs[0].token_ids) == 4
    assert got.outputs[0].token_ids == llm.generate({"prompt_token_ids": long_ids[-20:]}, greedy,
                                                    use_tqdm=False)[0].outputs[0].token_ids
    text = llm.generate("to be or not " * 20, to_context, use_tqdm=False)[0]  # 121 tokens
    assert len(text.prompt_token_ids) == 20 and len(text.outputs[0].token_ids) == 4
    chat = llm.chat([{"role": "user", "content": "to be or not " * 20}], to_context, use_tqdm=False)[0]
    assert len(chat.prompt_token_ids) == 20 and len(chat.outputs[0].token_ids) == 4
    unbounded = SamplingParams(max_tokens=None, temperature=0, ignore_eos=True, truncate_prompt_tokens=-1)
    got = llm.generate({"prompt_token_ids": long_ids}, unbounded, use_tqdm=False)[0]
    assert got.prompt_token_ids == long_ids[-23:] and len(got.outputs[0].token_ids) == 1


def test_the_engine_holds_max_model_len(tiny_ouro):
    """`llm.llm_engine` keeps the LLM's max_model_len: a request added to it directly ends there ("length") and -1
    cuts against it, as through `generate`; a bad cap is a ValueError naming max_model_len."""
    llm = LLM(tiny_ouro, max_model_len=24)
    engine = llm.llm_engine
    assert engine.max_model_len == 24
    engine.add_request("long", {"prompt_token_ids": list(range(5, 25))},
                       SamplingParams(max_tokens=None, temperature=0, ignore_eos=True))
    engine.add_request("cut", {"prompt_token_ids": list(range(5, 35))},
                       SamplingParams(max_tokens=4, temperature=0, ignore_eos=True, truncate_prompt_tokens=-1))
    done = {}
    while engine.has_unfinished_requests():
        done.update({o.request_id: o for o in engine.step() if o.finished})
    assert len(done["long"].outputs[0].token_ids) == 4 and done["long"].outputs[0].finish_reason == "length"
    assert done["cut"].prompt_token_ids == list(range(15, 35)) and len(done["cut"].outputs[0].token_ids) == 4
    with pytest.raises(ValueError, match=r"^max_model_len: must be in \[2, 2048\]"):
        type(engine)(llm.model, llm.tokenizer, llm.engine_config, max_model_len=4096)


# -- llm.llm_engine --------------------------------------------------------------------------------------------
def test_llm_engine_is_the_engine_generate_runs_on(tiny_ouro):
    """vLLM's `llm.llm_engine`: the tokenizer is the LLM's, and a request driven through add_request / step
    comes out as `generate` gives it; abort_request ends one. scheduler="reference" has no engine: a ValueError
    naming scheduler, not None."""
    llm = LLM(tiny_ouro)
    engine = llm.llm_engine
    assert engine.get_tokenizer() is llm.get_tokenizer()
    greedy = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    want = llm.generate("ROMEO:", greedy, use_tqdm=False)[0]
    engine.add_request("by-hand", "ROMEO:", greedy)
    engine.add_request("aborted", "ROMEO:", SamplingParams(max_tokens=100, ignore_eos=True))
    engine.abort_request("aborted")
    finished = {}
    while engine.has_unfinished_requests():
        finished.update((o.request_id, o) for o in engine.step() if o.finished)
    assert finished["aborted"].outputs[0].finish_reason == "abort"
    got = finished["by-hand"]
    assert got.prompt_token_ids == want.prompt_token_ids
    assert got.outputs[0].token_ids == want.outputs[0].token_ids and len(want.outputs[0].token_ids) == 8
    with pytest.raises(ValueError, match=r"^scheduler: 'reference' .* no llm_engine"):
        _ = LLM(tiny_ouro, scheduler="reference").llm_engine


# -- one declaration: LLM keywords and serve flags -------------------------------------------------------------
def test_every_load_knob_is_an_llm_keyword_and_a_serve_flag_with_one_default():
    from loopserve.load_config import LoadConfig

    args = build_parser().parse_args(["serve"])
    for f in dataclasses.fields(LoadConfig):
        assert getattr(args, f.name) == f.default, f.name
    assert (args.dtype, args.device) == ("auto", "auto")  # vLLM's defaults, for LLM and the server alike


def test_threads_is_an_llm_keyword_and_a_flag_applied_when_the_model_loads(tiny_ouro, monkeypatch):
    """`threads` (not vLLM's): torch's CPU threads, set by `load_for_engine` for `LLM` and the server alike;
    unset leaves the count as it is; anything but an integer >= 1 is a ValueError naming it."""
    from loopserve import load_config

    set_to: list[int] = []
    monkeypatch.setattr(load_config.torch, "set_num_threads", set_to.append)
    LLM(tiny_ouro, scheduler="reference")
    assert set_to == []
    LLM(tiny_ouro, scheduler="reference", threads=1)
    load_engine(tiny_ouro, threads=2)
    assert set_to == [1, 2]
    most = load_config.MAX_THREADS_PER_CPU * (os.cpu_count() or 1)
    for bad in (0, -1, 1.5, True, "2", most + 1, 10**6):  # (a million crashed the process in torch's pool)
        with pytest.raises(ValueError, match=rf"^threads: must be an integer in \[1, {most}\]"):
            LLM(tiny_ouro, scheduler="reference", threads=bad)
    for command in ("generate", "demo", "serve"):
        assert build_parser().parse_args([command, "--threads", "3"]).threads == 3
    assert torch.get_num_threads() == 1  # (the fixture's; the patched setter changed nothing)


def test_threads_change_nothing_when_the_load_fails_and_unset_leaves_them_as_they_are(tiny_ouro, tmp_path):
    """torch's thread count is process-wide: `threads` sets it only once the model has loaded (a bad path, a
    folder that is no checkpoint, a max_model_len past the model's context: the count is untouched), and an
    unset `threads` leaves whatever an earlier `LLM(threads=N)` set, for `LLM` and the server alike. (The
    autouse `single_thread` fixture restores the count afterwards.)"""
    assert torch.get_num_threads() == 1
    for model, kwargs in ((tmp_path / "nosuch", {}), (tmp_path, {}), (tiny_ouro, {"max_model_len": 10 ** 9})):
        with pytest.raises(ValueError):
            LLM(model, scheduler="reference", threads=2, **kwargs)
        with pytest.raises(ValueError):
            load_engine(model, threads=2, device="cpu", **kwargs)
        assert torch.get_num_threads() == 1, model
    LLM(tiny_ouro, scheduler="reference", threads=2)
    assert torch.get_num_threads() == 2
    LLM(tiny_ouro, scheduler="reference")  # unset: the earlier LLM's 2 holds (not torch's default)
    load_engine(tiny_ouro, device="cpu")
    assert torch.get_num_threads() == 2


def test_llm_and_the_server_load_with_the_same_default_device_and_dtype(tiny_ouro, monkeypatch):
    """What reaches the loader: `auto` for both (it was device "cpu" and dtype "float32" for LLM)."""
    from loopserve.models import loader

    asked: list[tuple[str, str]] = []
    resolve_device, resolve_dtype = loader.resolve_device, loader.resolve_dtype
    monkeypatch.setattr(loader, "resolve_device", lambda d: asked.append(("device", d)) or resolve_device(d))
    monkeypatch.setattr(loader, "resolve_dtype",
                        lambda d, folder, where: asked.append(("dtype", d)) or resolve_dtype(d, folder, where))
    LLM(tiny_ouro, scheduler="reference")
    load_engine(tiny_ouro)
    assert asked == [("device", "auto"), ("dtype", "auto")] * 2


def test_dtype_auto_never_chooses_float16(tmp_path, monkeypatch):
    """A float16 checkpoint loads as bfloat16, or float32 on a CPU without bfloat16 kernels: float16 is emulated
    and far slower on a CPU."""
    from loopserve import device as dev
    from loopserve.load_config import LoadConfig

    (tmp_path / "config.json").write_text('{"torch_dtype": "float16"}')
    for kernels in (True, False):
        monkeypatch.setattr(dev, "cpu_has_bf16_kernels", lambda k=kernels: k)
        assert dev.resolve_dtype(LoadConfig().dtype, tmp_path, "cpu") == ("bfloat16" if kernels else "float32")


# -- dtype names: vLLM's and torch's --------------------------------------------------------------------------
FLOAT16_REFUSED = r"^dtype: .* is not supported: loopserve never computes in float16 .* use bfloat16 .* or auto"


@pytest.mark.parametrize(("given", "name"), [
    ("float", "float32"), ("float32", "float32"), (torch.float32, "float32"), (torch.float, "float32"),
    ("bfloat16", "bfloat16"), (torch.bfloat16, "bfloat16"), ("double", "float64"), (torch.float64, "float64"),
    ("auto", "auto"),
])
def test_vllms_and_torchs_dtype_names_are_taken(given, name):
    """vLLM's `LLM(dtype=...)` takes these (they were a ValueError: "expected one of float32, bfloat16, ...")."""
    from loopserve.load_config import LoadConfig

    assert LoadConfig(dtype=given).dtype == name


def test_a_torch_dtype_loads_the_model_in_it(tiny_ouro):
    llm = LLM(tiny_ouro, dtype=torch.float64, device="cpu", scheduler="reference")
    assert llm.load_config.dtype == "float64" and next(llm.model.parameters()).dtype == torch.float64
    llm = LLM(tiny_ouro, dtype="float", device="cpu", scheduler="reference")
    assert next(llm.model.parameters()).dtype == torch.float32


@pytest.mark.parametrize("given", ["half", "float16", torch.float16])
def test_float16_is_refused_saying_why(tiny_ouro, given):
    with pytest.raises(ValueError, match=FLOAT16_REFUSED):
        LLM(tiny_ouro, dtype=given)
    from loopserve.models.loader import load_model

    with pytest.raises(ValueError, match=FLOAT16_REFUSED):
        load_model(tiny_ouro, given, "cpu")


@pytest.mark.parametrize("given", ["int8", torch.int8, "float16x", None])
def test_other_dtypes_are_refused_naming_the_names(given):
    from loopserve.load_config import LoadConfig

    with pytest.raises(ValueError, match=r"^dtype: expected one of float32, float, bfloat16, float64, double, a torch"
                                         r"\.dtype of these, or auto; got "):
        LoadConfig(dtype=given)


@pytest.mark.parametrize("command", ["serve", "generate", "demo"])
def test_the_dtype_flag_takes_the_same_names(command):
    from loopserve.cli import load_kwargs
    from loopserve.load_config import LoadConfig

    for flag, name in (("float", "float32"), ("bfloat16", "bfloat16"), ("double", "float64"), ("auto", "auto")):
        args = build_parser().parse_args([command, "--dtype", flag])
        assert LoadConfig(**load_kwargs(args)).dtype == name
    for flag in ("half", "float16"):  # (argparse refused them as invalid choices, without the reason)
        args = build_parser().parse_args([command, "--dtype", flag])
        with pytest.raises(ValueError, match=FLOAT16_REFUSED):
            LoadConfig(**load_kwargs(args))
    if command == "serve":
        assert re.match(FLOAT16_REFUSED, _check(build_parser().parse_args(["serve", "--dtype", "half"])))


def test_one_table_of_dtype_names_serves_the_checkpoint_and_the_caller(tmp_path, monkeypatch):
    """A name the checkpoint rule (auto) knows is one `dtype=` takes, to the same dtype, but float16; and the loader
    builds in `device.DTYPES`."""
    from loopserve import device as dev
    from loopserve.models import loader

    assert loader.DTYPES is dev.DTYPES
    monkeypatch.setattr(dev, "cpu_has_bf16_kernels", lambda: True)
    for name, chosen in dev.DTYPE_NAMES.items():
        (tmp_path / "config.json").write_text(f'{{"torch_dtype": "{name}"}}')
        assert dev.resolve_dtype("auto", tmp_path, "cpu") == chosen
        if name in dev.FLOAT16_NAMES:
            assert chosen == "bfloat16"
        else:
            assert dev.dtype_name(name) == chosen and chosen in dev.DTYPES


def test_the_load_defaults_are_declared_once():
    """`load_model` declared dtype float32 and device cpu, against LoadConfig's auto and auto: it takes both from its
    callers now."""
    from loopserve.models.loader import load_model

    params = inspect.signature(load_model).parameters
    assert params["dtype"].default is inspect.Parameter.empty
    assert params["device"].default is inspect.Parameter.empty


@pytest.mark.parametrize(("flags", "message"), [
    (["--tensor-parallel-size", "2"], r"^tensor_parallel_size: must be 1, got 2"),
    (["--enforce-eager", "--cuda-graphs"], r"^enforce_eager: turns CUDA graphs off"),
    (["--gpu-memory-utilization", "2"], r"^gpu_memory_utilization: must be in \(0, 1\]"),
])
def test_bad_load_flags_are_refused_before_the_model_loads(flags, message):
    problem = _check(build_parser().parse_args(["serve", *flags]))
    assert problem is not None
    assert re.match(message, problem), problem


def test_serve_takes_vllms_model_flags():
    args = build_parser().parse_args(["serve", "--trust-remote-code", "--tensor-parallel-size", "1",
                                      "--enforce-eager", "--disable-log-requests", "--swap-space", "4"])
    assert args.trust_remote_code and args.enforce_eager and args.disable_log_requests
    assert (args.tensor_parallel_size, args.swap_space, args.enable_log_requests) == (1, 4.0, False)
    assert _check(args) is None
    with pytest.raises(SystemExit):  # one or the other
        build_parser().parse_args(["serve", "--enable-log-requests", "--disable-log-requests"])


def test_the_server_engine_runs_eagerly_under_enforce_eager(tiny_ouro):
    engine, _ = load_engine(tiny_ouro, device="cpu", enforce_eager=True)
    assert engine.cfg.cuda_graphs is False


def test_tensor_parallel_size_2_stops_the_server_start(tiny_ouro):
    cmd = [sys.executable, "-m", "loopserve.cli", "serve", "--model", str(tiny_ouro), "--port", "0",
           "--tensor-parallel-size", "2"]
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=90, cwd=REPO)
    assert run.returncode == 2, run.stdout + run.stderr
    assert "error: --tensor-parallel-size: must be 1, got 2" in run.stderr and "--replicas" in run.stderr


# -- endpoints -------------------------------------------------------------------------------------------------
SERVED = "org/tiny"  # a served name with a '/', as hub ids have


@pytest.fixture(scope="module")
def server(tiny_ouro, tmp_path_factory) -> Iterator[Server]:
    """Started with vLLM's model flags, which the server used to refuse."""
    log = tmp_path_factory.mktemp("migration") / "server.log"
    with run_server(tiny_ouro, log, "--served-model-name", SERVED, "--api-key", KEY, "--kv-cache-tokens", "1024",
                    "--max-model-len", "64", "--trust-remote-code", "--tensor-parallel-size", "1",
                    "--enforce-eager", "--disable-log-requests", "--swap-space", "4") as s:
        yield s


def test_models_retrieve_returns_the_model_card(server):
    client = openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0, timeout=30)
    model = client.models.retrieve(SERVED)
    assert (model.id, model.object, model.owned_by) == (SERVED, "model", "loopserve")
    assert model.model_extra["max_model_len"] == 64
    [listed] = client.models.list().data
    assert model.model_dump() == listed.model_dump()


def test_models_retrieve_of_an_unknown_model_is_a_404_naming_model(server):
    client = openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0, timeout=30)
    with pytest.raises(openai.NotFoundError) as e:
        client.models.retrieve("other")
    assert e.value.body["param"] == "model" and "other" in e.value.body["message"]
    bare = httpx.get(server.url + "/v1/models/other", headers={"Authorization": f"Bearer {KEY}"})
    assert bare.status_code == 404 and bare.json()["error"]["type"] == "NotFoundError"
    assert httpx.get(server.url + f"/v1/models/{SERVED}").status_code == 401  # under /v1: needs the key


@pytest.mark.parametrize("method", ["GET", "POST"])
def test_ping_is_health(server, method):
    """vLLM's probe; open as /health is."""
    r = httpx.request(method, server.url + "/ping")
    assert r.status_code == 200, r.text


def test_a_405_allows_every_method_of_the_path(server):
    """The Allow header of a 405 names every method the path takes: /ping's two routes (GET, POST) said GET alone."""
    for path, allowed in [("/ping", "GET, POST"), ("/v1/completions", "POST"), ("/v1/models", "GET")]:
        r = httpx.request("DELETE", server.url + path)
        assert r.status_code == 405 and r.headers["allow"] == allowed, (path, r.headers)


def test_vllm_model_flags_change_no_output(server, tiny_ouro):
    """The server started with them answers as the offline LLM (on the CPU, where graphs are off anyway)."""
    body = {"model": SERVED, "prompt": [5, 17, 99], "max_tokens": 5, "temperature": 0, "ignore_eos": True}
    r = httpx.post(server.url + "/v1/completions", json=body, headers={"Authorization": f"Bearer {KEY}"}, timeout=30)
    assert r.status_code == 200, r.text
    ref = LLM(Path(tiny_ouro), device="cpu", dtype="float32").generate(
        {"prompt_token_ids": [5, 17, 99]}, SamplingParams(max_tokens=5, temperature=0, ignore_eos=True),
        use_tqdm=False)[0].outputs[0]
    assert r.json()["choices"][0]["text"] == ref.text
