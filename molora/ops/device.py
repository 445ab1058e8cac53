"""Host-to-device copies of per-step metadata that do not block the host, and when a host read is free.

A step builds its index tensors (cache rows, decode tables, routing slot ids) from Python lists on the host and
hands them to the device. `torch.tensor(data, device="cuda")` copies from pageable memory, which the CUDA driver
stages synchronously; `to_device` goes through pinned memory with `non_blocking=True` instead, so the host can
keep queueing work. On the CPU (and any other device) it is the plain copy it always was.

`host_readable(t)`: whether reading t's values on the host costs nothing, so that a shortcut may branch on them:
CPU tensors, except while a step is being recorded for replay (`recording()`, molora.model.graphs), where a
branch taken on a value would be replayed whatever the value then is. Knows nothing about models or routing.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager

import torch
from torch import Tensor


class _Off(threading.local):
    """A thread's flag state: `on` is False until the thread sets it (a class default, so reading it costs an
    attribute lookup; `getattr(local, "on", False)` raised and caught an AttributeError on every read of a thread
    that never set it, about 0.9 us, and the routed linears read it for each call)."""

    on = False


class ThreadFlag:
    """A per-thread switch, on within `with flag():` (nested blocks restore the outer value); `flag.on` reads it."""

    def __init__(self) -> None:
        self._local = _Off()

    @property
    def on(self) -> bool:
        return self._local.on

    @contextmanager
    def __call__(self) -> Iterator[None]:
        before = self.on
        self._local.on = True
        try:
            yield
        finally:
            self._local.on = before


# On while a step is recorded for replay (molora.model.graphs): no tensor counts as host-readable, and the routed
# linears take no shortcut from Python state (molora.model.lora_linear).
recording = ThreadFlag()


def host_readable(t: Tensor) -> bool:
    """Whether branching on t's values is free and safe here: a CPU tensor, and no step being recorded."""
    return t.device.type == "cpu" and not recording.on


def to_device(data: Sequence | Tensor, device: torch.device | str, dtype: torch.dtype = torch.long) -> Tensor:
    """`data` (a host list or a CPU tensor) as a tensor on `device`; a list becomes `dtype` first.
    On CUDA the copy is asynchronous (pinned staging buffer, non_blocking); elsewhere a plain tensor."""
    dev = torch.device(device)
    if dev.type != "cuda":
        return data.to(dev) if isinstance(data, Tensor) else torch.tensor(data, dtype=dtype, device=dev)
    t = data if isinstance(data, Tensor) else torch.tensor(data, dtype=dtype)
    return t.pin_memory().to(dev, non_blocking=True)
