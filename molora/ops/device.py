"""Host-to-device copies of per-step metadata that do not block the host.

A step builds its index tensors (cache rows, decode tables, routing slot ids) from Python lists on the host and
hands them to the device. `torch.tensor(data, device="cuda")` copies from pageable memory, which the CUDA driver
stages synchronously; `to_device` goes through pinned memory with `non_blocking=True` instead, so the host can
keep queueing work. On the CPU (and any other device) it is the plain copy it always was. Knows nothing about
models or routing.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor


def to_device(data: Sequence | Tensor, device: torch.device | str, dtype: torch.dtype = torch.long) -> Tensor:
    """`data` (a host list or a CPU tensor) as a tensor on `device`; a list becomes `dtype` first.
    On CUDA the copy is asynchronous (pinned staging buffer, non_blocking); elsewhere a plain tensor."""
    dev = torch.device(device)
    if dev.type != "cuda":
        return data.to(dev) if isinstance(data, Tensor) else torch.tensor(data, dtype=dtype, device=dev)
    t = data if isinstance(data, Tensor) else torch.tensor(data, dtype=dtype)
    return t.pin_memory().to(dev, non_blocking=True)
