"""Host <-> device transfers that never make the host wait for queued device work.

On CUDA a plain `tensor.to("cuda")` from pageable memory, `.tolist()` or `.item()` synchronizes the
stream: the host stops until every kernel queued so far has finished, so it cannot build the next
stage batch while the current one runs. The engine moves its small metadata (row indices, positions,
depths) with `upload` (pinned memory, non-blocking copy, ordered on the stream like any kernel) and
reads per-step results with `Readback` (a non-blocking copy into pinned memory plus an event: the
host waits for that copy only, not for the work queued after it). Swapping KV to the host and back
uses the same two. On the CPU both are plain tensors.
"""

from __future__ import annotations

import torch


def upload(data: list | torch.Tensor, device: torch.device, dtype: torch.dtype = torch.long) -> torch.Tensor:
    """Host data (a list or a CPU tensor) as a tensor on `device`, without a host-side wait."""
    t = data if isinstance(data, torch.Tensor) else torch.tensor(data, dtype=dtype)
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

    def __init__(self, tensors: dict[str, torch.Tensor]) -> None:
        self._event = None
        cuda = [t.device for t in tensors.values() if t.device.type == "cuda"]
        if cuda:
            tensors = {k: torch.empty(t.shape, dtype=t.dtype, pin_memory=True).copy_(t, non_blocking=True)
                       for k, t in tensors.items()}
            self._event = torch.cuda.Event()
            # on the copies' stream: that of the tensors' device, which need not be the current device
            self._event.record(torch.cuda.current_stream(cuda[0]))
        else:
            tensors = {k: t.to("cpu") for k, t in tensors.items()}
        self._host = tensors

    def host(self) -> dict[str, torch.Tensor]:
        if self._event is not None:
            self._event.synchronize()
        return self._host

    def get(self) -> dict[str, list]:
        return {k: t.tolist() for k, t in self.host().items()}
