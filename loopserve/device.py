"""Host <-> device transfers that never make the host wait for queued device work.

On CUDA a plain `tensor.to("cuda")` from pageable memory, `.tolist()` or `.item()` synchronizes the
stream: the host stops until every kernel queued so far has finished, so it cannot build the next
stage batch while the current one runs. The engine moves its small metadata (row indices, positions,
depths) with `upload` (pinned memory, non-blocking copy, ordered on the stream like any kernel) and
reads per-step results with `Readback` (a non-blocking copy into pinned memory plus an event: the
host waits for that copy only, not for the work queued after it). Swapping KV to the host and back
uses the same two. On the CPU both are plain tensors.

Also the choice of device and dtype: `auto` for either (`resolve_device`, `resolve_dtype`), and the KV
pool size for a fraction of a GPU's memory (`kv_memory_gb`).
"""

from __future__ import annotations

import functools
import json
import logging
from pathlib import Path

import numpy as np
import torch

log = logging.getLogger(__name__)


@functools.cache
def _numpy_dtype(dtype: torch.dtype) -> np.dtype:
    """numpy's dtype for `dtype` (raises for one numpy lacks, such as bfloat16)."""
    return torch.empty((), dtype=dtype).numpy().dtype


def upload(data: list | np.ndarray | torch.Tensor, device: torch.device,
           dtype: torch.dtype = torch.long) -> torch.Tensor:
    """Host data (a list, a numpy array or a CPU tensor) as a tensor on `device`, without a host-side wait. A list is
    read by numpy: `torch.tensor` of a list of Python numbers is 3-4x slower on this CPU (256 ints: 28
    against 8 us; 8192: 820 against 220 us; docs/benchmarks.md §8.16)."""
    t = data if isinstance(data, torch.Tensor) else torch.from_numpy(np.array(data, _numpy_dtype(dtype)))
    if device.type == "cpu":
        return t
    if device.type == "cuda":
        # The caching host allocator keeps the pinned buffer alive until the copy has run.
        return t.pin_memory().to(device, non_blocking=True)
    return t.to(device)


class Readback:
    """Device tensors on their way to the host. `host()` returns them as CPU tensors and `get()` as
    Python lists, waiting (on CUDA) only for their own copy, which was queued right after the work
    that produced them."""

    def __init__(self, tensors: dict[str, torch.Tensor], reused: bool = False) -> None:
        """`tensors`: on one device. `reused`: some tensors are buffers a later step overwrites (a graph's
        outputs), so they are copied on the CPU too, where the others are kept as they are."""
        self._event = None
        device = next(iter(tensors.values())).device if tensors else None  # (one step's tensors: one device)
        if device is not None and device.type == "cuda":
            tensors = {k: torch.empty(t.shape, dtype=t.dtype, pin_memory=True).copy_(t, non_blocking=True)
                       for k, t in tensors.items()}
            self._event = torch.cuda.Event()
            # on the copies' stream: that of the tensors' device, which need not be the current device
            self._event.record(torch.cuda.current_stream(device))
        elif reused or (device is not None and device.type != "cpu"):
            tensors = {k: t.to("cpu", copy=True) for k, t in tensors.items()}
        self._host = tensors  # (on the CPU: the tensors themselves, as `to("cpu")` would give)

    def ready(self) -> bool:
        """Whether `host()` would return at once: the copy has arrived (on the CPU, always)."""
        return self._event is None or self._event.query()

    def host(self) -> dict[str, torch.Tensor]:
        if self._event is not None:
            self._event.synchronize()
        return self._host

    def get(self) -> dict[str, list]:
        return {k: t.tolist() for k, t in self.host().items()}


# -- choosing the device and dtype ("auto", vLLM's default for both) ------------------------------------------
AUTO = "auto"
# The dtypes loopserve computes in, by name. float16 is not one (see `resolve_dtype`).
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float64": torch.float64}
# The one table of dtype names (vLLM's --dtype, torch's, config.json's torch_dtype) -> a name in DTYPES. The
# float16 names map to bfloat16, the `auto` rule for a float16 checkpoint; asked for by name they are refused
# (`dtype_name`).
DTYPE_NAMES = {"float32": "float32", "float": "float32", "bfloat16": "bfloat16", "float64": "float64",
               "double": "float64", "float16": "bfloat16", "half": "bfloat16"}
FLOAT16_NAMES = ("float16", "half")
DTYPE_CHOICES = tuple(n for n in DTYPE_NAMES if n not in FLOAT16_NAMES)  # the names a caller may ask for
KV_ACTIVATION_RESERVE_GB = 1.0  # --gpu-memory-utilization: device memory left out of the KV pool for activations


DEVICES = "cpu, cuda, cuda:N or auto"


def resolve_device(device: str | torch.device) -> str:
    """`auto`: CUDA when a GPU is visible, else the CPU; any other name is checked (ValueError naming
    `device`, where torch would raise its own errors later) and kept."""
    if isinstance(device, torch.device):  # (vLLM takes one too)
        device = str(device)
    if device == AUTO:
        return "cuda" if torch.cuda.is_available() else "cpu"
    if not isinstance(device, str):
        raise ValueError(f"device: expected {DEVICES}, got {type(device).__name__}")
    try:
        dev = torch.device(device)
    except RuntimeError:
        raise ValueError(f"device: expected {DEVICES}, got {device!r}") from None
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"device: {device!r}, but CUDA is not available here (this torch build has no CUDA, or "
                             "no GPU is visible); use cpu or auto")
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise ValueError(f"device: {device!r}, but only {torch.cuda.device_count()} CUDA device(s) are visible")
    elif dev.type != "cpu":
        raise ValueError(f"device: {dev.type} is not supported (expected {DEVICES})")
    return device


def dtype_name(dtype: str | torch.dtype) -> str:
    """A dtype asked for (`LLM(dtype=...)`, `--dtype`): a name of `DTYPE_NAMES` or a `torch.dtype` (as vLLM
    takes), as its name in `DTYPES`, or `auto` as it is. ValueError naming `dtype` for any other, and for float16,
    which loopserve never computes in (`resolve_dtype`; on an AVX-512 CPU, one thread, a [32, 768] x [768, 2048]
    product took 158 ms in float16 against 1.3 ms in float32 and 0.66 ms in bfloat16)."""
    name = str(dtype).removeprefix("torch.") if isinstance(dtype, torch.dtype) else dtype
    if name in FLOAT16_NAMES:
        raise ValueError(f"dtype: {dtype!r} is not supported: loopserve never computes in float16 (on a CPU it is "
                         "emulated, about 100x slower, and it overflows in long recurrences); use bfloat16 (the "
                         "same size, float32's range) or auto (which loads a float16 checkpoint as bfloat16)")
    if name == AUTO:
        return AUTO
    if not isinstance(name, str) or name not in DTYPE_NAMES:
        raise ValueError(f"dtype: expected one of {', '.join(DTYPE_CHOICES)}, "
                         f"a torch.dtype of these, or {AUTO}; got {dtype!r}")
    return DTYPE_NAMES[name]


def checkpoint_dtype(folder: Path) -> str | None:
    """The dtype a HF folder's config.json declares (`torch_dtype`, or `dtype` in newer transformers);
    None when it declares none or cannot be read (the loader reports a bad config.json)."""
    try:
        config = json.loads((folder / "config.json").read_text())
    except (OSError, ValueError):
        return None
    name = config.get("torch_dtype") or config.get("dtype") if isinstance(config, dict) else None
    return str(name).removeprefix("torch.") if name else None


def resolve_dtype(dtype: str | torch.dtype, folder: Path, device: str) -> str:
    """The name in `DTYPES` to load the model in `folder` with: another than `auto` as `dtype_name` checks it;
    `auto`: the checkpoint's dtype (float32 when it declares none). A float16 checkpoint loads as
    bfloat16: same size, float32's range (float16 overflows in long recurrences, and on the CPU it is
    emulated and slow, while bfloat16 has fast kernels), so loopserve never computes in float16. On a
    CPU without bfloat16 kernels (`cpu_has_bf16_kernels`) a bfloat16 choice becomes float32."""
    if dtype != AUTO:
        return dtype_name(dtype)
    declared = checkpoint_dtype(folder)
    chosen = DTYPE_NAMES.get(declared or "float32", "float32")
    if chosen == "bfloat16" and bf16_is_emulated(device):  # (one line says why: two read as contradicting each other)
        log.info("dtype auto: this CPU has no bfloat16 matrix kernels (oneDNN); loading the %s checkpoint as "
                 "float32, about 5x faster here (--dtype bfloat16 loads it as bfloat16)", declared)
        return "float32"
    if declared in FLOAT16_NAMES:
        log.info("dtype auto: the checkpoint is float16; loading it as bfloat16 on %s (loopserve does not compute "
                 "in float16)", device)
    elif declared is not None and declared not in DTYPE_NAMES:
        log.info("dtype auto: the checkpoint's dtype %r is not supported; loading it as float32", declared)
    return chosen


def bf16_is_emulated(device: str | torch.device) -> bool:
    """Whether bfloat16 products on `device` are emulated: a CPU without bfloat16 kernels."""
    return torch.device(device).type == "cpu" and not cpu_has_bf16_kernels()


@functools.cache
def cpu_has_bf16_kernels() -> bool:
    """Whether oneDNN has bfloat16 matrix kernels on this CPU (x86: AVX512 or newer). Without them a
    bfloat16 product is emulated: on an AVX2-only CPU, [32, 768] x [768, 2048] took 11.0 ms in bfloat16
    against 2.1 ms in float32 (docs/benchmarks.md §8.20)."""
    try:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):  # a build without oneDNN: no reason to prefer float32
        return True


def kv_memory_gb(fraction: float, device: str | torch.device) -> float:
    """The KV pool size (GiB) that keeps this process within `fraction` of a CUDA device's memory
    (vLLM's --gpu-memory-utilization): fraction x total, minus what is in use now (the weights, once
    loaded, and anything else on the device), minus KV_ACTIVATION_RESERVE_GB for activations.
    ValueError on the CPU (which `load_for_engine` does not ask: there the fraction has no effect, with a
    warning), or when nothing is left."""
    dev = torch.device(device)
    if dev.type != "cuda":
        raise ValueError(f"gpu_memory_utilization: only for CUDA devices (the model is on {dev.type}); size the "
                         "KV pool with --kv-cache-memory-gb or --kv-cache-tokens")
    free, total = torch.cuda.mem_get_info(dev)
    budget = (fraction * total - (total - free)) / 2**30 - KV_ACTIVATION_RESERVE_GB
    if budget <= 0:
        raise ValueError(f"gpu_memory_utilization: {fraction} of {total / 2**30:.1f} GiB leaves no room for the KV "
                         f"cache ({(total - free) / 2**30:.1f} GiB in use, {KV_ACTIVATION_RESERVE_GB} GiB kept "
                         "for activations)")
    return budget
