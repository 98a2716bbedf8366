"""Load a looped LM from a local Hugging Face folder (or a hub id, resolved when online: the [hub] extra).

Reads `config.json` (dispatch on `architectures`), `model.safetensors` or shards listed in
`model.safetensors.index.json` (without one, every `*.safetensors` file; PyTorch `.bin` weights are refused, saying how
to convert them), the tokenizer files, and the generation config (`generation_config.json`: sampling
defaults and end-of-sequence ids; config.json's eos ids where there is none).
Every parameter the model needs must be present with the right shape; errors name the file and the tensor.
"""

from __future__ import annotations

import dataclasses
import json
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from loopserve.device import DTYPES, dtype_name, resolve_device, resolve_dtype
from loopserve.json_files import read_json_object, unreadable
from loopserve.model_config import HUGINN, OURO, STATE_INITS, ModelConfig
from loopserve.models.base import LoopedLM
from loopserve.models.huginn import RavenForCausalLM
from loopserve.models.layers import pack_linear_weights
from loopserve.models.ouro import OuroForCausalLM
from loopserve.sampling_params import SamplingParams, is_int
from loopserve.tokenizer import Tokenizer

log = logging.getLogger(__name__)
# Tensors real checkpoints carry that the model derives itself.
_DERIVED = {HUGINN: {"lm_head.weight", "freqs_cis"}, OURO: set()}
# the tensor dtypes a checkpoint's weights may be stored in (each converts exactly, or by rounding, to the dtype run)
WEIGHT_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)
LOOKAHEAD_GATE = ("lookahead_gate.weight", "lookahead_gate.bias")
# generation_config.json keys that are sampling defaults -> SamplingParams fields (the keys vLLM reads)
_GENERATION_KEYS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p",
                    "repetition_penalty": "repetition_penalty", "max_new_tokens": "max_tokens"}


@dataclass(frozen=True)
class GenerationConfig:
    """What a checkpoint's generation config gives the engine (vLLM's `--generation-config`): the sampling
    defaults of requests that leave those fields unset, and end-of-sequence ids besides the tokenizer's own."""

    # SamplingParams fields it sets: what a request that does not set them gets (vLLM's `--generation-config auto`)
    sampling_defaults: dict[str, Any] = field(default_factory=dict)
    eos_token_ids: tuple[int, ...] = ()
    # a server's cap on every request's max_tokens, set or not: the `max_new_tokens` of a generation config given
    # as a folder (vLLM's `override_max_tokens`; with "auto" the model's own only caps an unset max_tokens)
    max_tokens_cap: int | None = None


@dataclass
class LoadedModel:
    model: LoopedLM
    config: ModelConfig
    tokenizer: Tokenizer
    path: Path
    generation: GenerationConfig


def read_generation_config(folder: Path, mode: str = "auto", model_config: dict[str, Any] | None = None,
                           vocab_size: int | None = None, override: dict[str, Any] | None = None) -> GenerationConfig:
    """The generation config `mode` names, as vLLM reads it: "auto", the model folder's `generation_config.json`;
    "vllm", the same file's eos ids but no sampling defaults (vLLM's "vllm" drops only those); another value, the
    generation_config.json of that folder. Where the model folder has no such file, its `config.json`
    (`model_config`) gives the eos ids (transformers' `GenerationConfig.from_model_config`, vLLM's fallback).

    `do_sample` is ignored, as vLLM does; a key SamplingParams has no field for is skipped. Values are checked as
    SamplingParams checks them, and eos ids as token ids (below `vocab_size`): a ValueError naming the file and the
    key. `override`: vLLM's `override_generation_config`, keys of the same file whose values replace the file's (with
    "vllm", the only sampling defaults); a bad value is a ValueError naming `override_generation_config.<key>`, a key
    that sets no sampling default is logged and left out, as vLLM reads only these keys."""
    elsewhere = mode not in ("auto", "vllm")  # (another folder's)
    path = (Path(mode).expanduser() if elsewhere else folder) / "generation_config.json"
    if path.is_file():
        raw = read_json_object(path)
        eos = _token_ids(raw.get("eos_token_id"), path, vocab_size)
    elif elsewhere:
        raise ValueError(f"generation_config: {path} is missing")
    else:
        raw, eos = {}, _token_ids((model_config or {}).get("eos_token_id"), folder / "config.json", vocab_size)
    out = {} if mode == "vllm" else _sampling_defaults(raw, str(path))
    given: dict[str, Any] = {}
    if override:
        unread = sorted(set(override) - set(_GENERATION_KEYS))
        if unread:
            log.warning("override_generation_config: %s set no sampling default (only %s do), left out",
                        ", ".join(unread), ", ".join(_GENERATION_KEYS))
        for key, name in _GENERATION_KEYS.items():  # (null: the file's value is dropped, as vLLM's update drops it)
            if key in override and override[key] is None:
                out.pop(name, None)
        given = _sampling_defaults(override, "override_generation_config", ".")
        out.update(given)
    # vLLM's override_max_tokens, which caps every request: a folder's max_new_tokens (an override's over it), else an
    # override's (with "auto" the model's own file's caps only an unset max_tokens)
    cap = out.get("max_tokens") if elsewhere else given.get("max_tokens")
    if out:
        log.info("%s%s: default sampling parameters %s (a request's own values win)", path,
                 " and override_generation_config" if override else "", out)
    return GenerationConfig(out, eos, cap)


def _sampling_defaults(raw: dict[str, Any], source: str, joint: str = ": ") -> dict[str, Any]:
    """The SamplingParams defaults of a generation config's keys (`raw`), checked as SamplingParams checks them: a
    ValueError naming `source` and the key at fault (`source` + `joint` + key)."""
    fields = {f.name for f in dataclasses.fields(SamplingParams)}
    out: dict[str, Any] = {}
    for key, name in _GENERATION_KEYS.items():
        if raw.get(key) is None:
            continue
        if name not in fields:
            log.debug("%s: %s=%r ignored (SamplingParams has no %s)", source, key, raw[key], name)
            continue
        out[name] = raw[key]
    try:
        SamplingParams(**out)
    except ValueError as e:  # (its message names the SamplingParams field: the file's key for it instead)
        name, sep, why = str(e).partition(": ")
        keys = {name: key for key, name in _GENERATION_KEYS.items()}
        raise ValueError(f"{source}{joint}{keys.get(name, name)}{sep}{why}") from None
    return out


def _token_ids(value: Any, path: Path, vocab_size: int | None) -> tuple[int, ...]:
    """An `eos_token_id` entry (a token id, a list of them, or null) as ids (ValueError naming the file and key)."""
    ids = [] if value is None else value if isinstance(value, list) else [value]
    limit = vocab_size if vocab_size is not None else 2**31
    if not all(is_int(i) and 0 <= i < limit for i in ids):
        raise ValueError(f"{path}: eos_token_id: must be a token id (an integer in [0, {limit})) or a list of them, "
                         f"got {json.dumps(value)}")
    return tuple(dict.fromkeys(ids))


def embedded_model_path() -> Path:
    """The embedded default model: a Shakespeare-trained Ouro-architecture LM in the HF layout, shipped
    in the package (`loopserve/assets/`; `loopserve train-tiny` rebuilds it)."""
    return Path(__file__).resolve().parents[1] / "assets" / "ouro-shakespeare"


def is_hub_id(name: str) -> bool:
    """Whether `name` could name a Hugging Face Hub repository ("owner/name"), not a local path."""
    return name.count("/") == 1 and not name.startswith((".", "/", "~"))


def is_local_folder(model: str | Path | None) -> bool:
    """Whether `model` names a folder here, loaded as it is (None: the embedded model, which is one); else it is a hub
    id to fetch, or nothing."""
    # (Path("") is the working folder: an empty model names none)
    return model is None or (bool(str(model).strip()) and Path(model).expanduser().is_dir())


def resolve_model_path(model: str | Path) -> Path:
    if not str(model).strip():  # (Path("") is the working folder: its errors would name no folder at all)
        raise ValueError("model: empty; give a model folder or hub id (unset: the embedded model)")
    path = Path(model).expanduser()
    if is_local_folder(model):
        return path
    name = str(model)
    if path.exists() or not is_hub_id(name):
        raise ValueError(f"model: {name!r} is not a model folder")
    try:
        from huggingface_hub import snapshot_download
    except ImportError:
        raise ValueError(
            f"model: {name!r} is not a local folder, and fetching it from the Hugging Face Hub needs the [hub] extra "
            f"(pip install 'loopserve[hub]'); or download it first and pass the folder"
        ) from None
    try:
        return Path(snapshot_download(name, allow_patterns=["*.json", "*.safetensors", "*.jinja"]))
    except Exception as e:  # offline, unknown repo, no permission: all end here
        raise ValueError(
            f"model: {name!r} is not a local folder and could not be fetched from the Hugging Face Hub "
            f"({type(e).__name__}); download it first (hf download {name} --local-dir DIR) and pass DIR"
        ) from None


def _tensor_files(folder: Path) -> tuple[Path, dict[str, Path]]:
    """Map tensor name -> file holding it, from the index (`model.safetensors.index.json`) where there is one, else
    `model.safetensors`, else every `*.safetensors` file in the folder (shards without their index, as vLLM reads
    them: a tensor in two of them is refused); and the file (or pattern) an error about a missing tensor names."""
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        weight_map = read_json_object(index).get("weight_map")
        if not isinstance(weight_map, dict):
            raise ValueError(f"{index}: weight_map: must be an object of tensor name -> shard file, got "
                             f"{json.dumps(weight_map)}")
        for name, f in weight_map.items():
            if not isinstance(f, str):
                raise ValueError(f"{index}: weight_map: tensor {name!r} must map to a shard file name, got "
                                 f"{json.dumps(f)}")
        files = {name: folder / f for name, f in weight_map.items()}
        for file in set(files.values()):
            if not file.is_file():
                raise ValueError(f"{index}: lists shard {file.name}, which is missing")
        return index, files
    single = folder / "model.safetensors"
    if single.is_file():
        return single, {name: single for name in _open(single).keys()}
    shards = sorted(folder.glob("*.safetensors"))
    if not shards:
        raise ValueError(_no_weights(folder))
    files = {}
    for shard in shards:
        for name in _open(shard).keys():
            if name in files:
                raise ValueError(f"{shard}: tensor {name!r} is in {files[name].name} too (with no index, every "
                                 f"*.safetensors file of the folder is read): remove one, or give the index")
            files[name] = shard
    return folder / "*.safetensors", files


def _no_weights(folder: Path) -> str:
    """Why `folder` has no weights to load: none, or PyTorch's `.bin` files only, with the one line that converts one
    (torch.load's weights_only reads tensors without running the pickle's code; a clone per tensor, because
    save_file refuses tensors that share memory, as tied weights do)."""
    missing = f"{folder}: no model.safetensors, model.safetensors.index.json or other *.safetensors file"
    bins = sorted(p.name for p in folder.glob("pytorch_model*.bin"))
    if not bins:
        return missing
    out = bins[0].replace("pytorch_model", "model", 1).removesuffix(".bin") + ".safetensors"
    which = ("it in the folder:" if len(bins) == 1
             else f"each of the {len(bins)} in the folder (read then without an index), e.g.")
    return (f"{missing}; its PyTorch weights {', '.join(bins[:2])}{', ...' if len(bins) > 2 else ''} are not read "
            f"(loopserve loads safetensors only): convert {which} python -c \"import torch, "
            f"safetensors.torch as st; st.save_file({{k: v.contiguous().clone() for k, v in torch.load("
            f"'{bins[0]}', weights_only=True).items()}}, '{out}')\"")


def _open(file: Path):
    try:
        return safe_open(str(file), "pt")
    except Exception as e:  # truncated, a git-lfs pointer, or not a safetensors file
        raise unreadable(file, f"not a readable safetensors file ({e})") from None


def build_model(config: ModelConfig, lookahead_gate: bool = False, state_init: str | None = None) -> LoopedLM:
    """The model class of `config`'s architecture, built (in the current default device and dtype): Ouro with its
    lookahead gate head when asked, Huginn with `state_init` (None: the config's)."""
    if config.arch == OURO:
        return OuroForCausalLM(config, lookahead_gate=lookahead_gate)
    return RavenForCausalLM(config, state_init=state_init)


def read_model_files(folder: Path, state_init: str | None = None, *, chat_template: str | None = None,
                     generation_config: str = "auto", override_generation_config: dict[str, Any] | None = None
                     ) -> tuple[ModelConfig, GenerationConfig, Tokenizer, tuple[Path, dict[str, Path]]]:
    """Everything `load_model` reads from a model folder before the weights, checked (ValueError naming the file or
    field at fault): its config, generation config and tokenizer, and which file holds each tensor (`_tensor_files`:
    the safetensors headers only). Ray Serve's driver runs it too, so that a bad folder is one line there rather
    than an error in every replica (`serve/ray.py`)."""
    cfg_path = folder / "config.json"
    if not cfg_path.is_file():
        raise ValueError(f"{cfg_path.absolute()}: missing")
    raw = read_json_object(cfg_path)
    config = ModelConfig.from_hf(raw, str(cfg_path))
    # the small files first: a bad template or generation config fails before the weights are read
    if state_init is not None and config.arch != HUGINN:
        raise ValueError(f"state_init: {config.arch} has no random initial loop state to choose (Huginn's "
                         f"{' or '.join(STATE_INITS)}): leave it unset")
    generation = read_generation_config(folder, generation_config, raw, config.vocab_size, override_generation_config)
    tokenizer = Tokenizer(folder, chat_template=chat_template, extra_eos_ids=generation.eos_token_ids)
    return config, generation, tokenizer, _tensor_files(folder)


def load_model(model: str | Path, dtype: str | torch.dtype, device: str | torch.device, state_init: str | None = None,
               *, chat_template: str | None = None, generation_config: str = "auto",
               override_generation_config: dict[str, Any] | None = None) -> LoadedModel:
    """`dtype` and `device` are given by every caller: their defaults are `LoadConfig`'s (both "auto",
    `loopserve.device`), declared there only. `dtype` is a name `device.dtype_name` takes (ValueError naming
    `dtype` otherwise, before anything is read). `state_init`: Huginn's initial loop state (None: the checkpoint's
    `state_init`). `chat_template`: a template (text or a file) used instead of the folder's; `generation_config` and
    `override_generation_config`: see `read_generation_config`."""
    dtype = dtype_name(dtype)  # (before any file is read)
    folder = resolve_model_path(model)
    device = resolve_device(device)
    dtype = resolve_dtype(dtype, folder, device)
    config, generation, tokenizer, (source, files) = read_model_files(
        folder, state_init, chat_template=chat_template, generation_config=generation_config,
        override_generation_config=override_generation_config)
    net: LoopedLM
    default_dtype = torch.get_default_dtype()
    try:  # build on the meta device directly in the target dtype: no throwaway random init
        torch.set_default_dtype(DTYPES[dtype])
        with torch.device("meta"):
            net = build_model(config, lookahead_gate=all(n in files for n in LOOKAHEAD_GATE), state_init=state_init)
    finally:
        torch.set_default_dtype(default_dtype)
    # (Module.to_empty's empty_like of a meta tensor runs torch's Python reference, which imports sympy: 0.6 s of a
    # server's start; an empty tensor of each shape is the same storage, uninitialized)
    net = net._apply(lambda t: torch.empty(t.shape, dtype=t.dtype, device=device))
    params = net.checkpoint_tensors()  # (views: a stacked parameter loads part by part)
    handles = {f: _open(f) for f in set(files.values())}
    held = {f: set(h.keys()) for f, h in handles.items()}
    with torch.no_grad():
        for name, p in params.items():
            if name not in files:
                raise ValueError(f"{source}: tensor {name!r} missing from the checkpoint")
            if name not in held[files[name]]:  # an index entry pointing at the wrong shard
                raise ValueError(f"{files[name]}: tensor {name!r} missing (the index lists it in this file)")
            t = handles[files[name]].get_tensor(name)
            if t.dtype not in WEIGHT_DTYPES:  # (a quantized tensor copied into a float parameter is other math)
                stored = ", ".join(str(d).removeprefix("torch.") for d in WEIGHT_DTYPES)
                raise ValueError(f"{files[name]}: tensor {name!r} is {str(t.dtype).removeprefix('torch.')}; "
                                 f"loopserve loads weights stored as {stored} only")
            if tuple(t.shape) != tuple(p.shape):
                raise ValueError(f"{files[name]}: tensor {name!r} has shape {tuple(t.shape)}, "
                                 f"expected {tuple(p.shape)}")
            p.copy_(t)
    extra = set(files) - set(params) - _DERIVED[config.arch]
    if extra:
        log.warning("%s: ignoring %d unexpected tensors, e.g. %s", folder, len(extra), sorted(extra)[0])
    net = net.eval().requires_grad_(False)
    pack_linear_weights(net)  # (bfloat16 on the CPU: oneDNN copies of the projections, the same products faster)
    return LoadedModel(net, config, tokenizer, folder, generation)
