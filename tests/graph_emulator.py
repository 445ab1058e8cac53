"""A CUDA graph's semantics on the CPU, for tests of `molora.model.graphs`.

`emulated_capture(step)` runs `step` once as a warm-up, then records every aten op a second run dispatches
(tensors kept by identity, every Python value as it was then). The returned `replay` runs those ops again on the
same tensors and writes each op's result into the tensor it produced when recorded; no Python of `step` runs.
So a replay sees new values in the tensors the step reads (static inputs, the adapter bank, the KV cache) and
nothing else: a Python int, a branch or a tensor computed during the warm-up and kept stays what it was, as in
a CUDA graph. A host read of a tensor value while recording raises, as it breaks a CUDA capture.

Only aten ops are seen, so the step must run without molora's C++ kernels (`fused_cpu.suspended()`, which the
capture enters) and with a dispatch backend built from torch ops (e.g. "stacked_mask").
"""

from __future__ import annotations

from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from molora.ops import fused_cpu

aten = torch.ops.aten
# allocations without a kernel: a CUDA graph replays nothing for them
_NO_KERNEL = {
    aten.empty.memory_format,
    aten.empty_like.default,
    aten.empty_strided.default,
    aten.new_empty.default,
    aten.new_empty_strided.default,
}
_HOST_READS = {aten._local_scalar_dense.default, aten.is_nonzero.default}


class HostReadWhileRecording(RuntimeError):
    pass


class _Recorder(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops: list[tuple[Any, tuple, dict, Any]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _HOST_READS:
            raise HostReadWhileRecording(f"{func} reads a tensor's value on the host inside a recorded step")
        out = func(*args, **kwargs)
        self.ops.append((func, args, kwargs, out))
        return out


def _write_back(recorded: Any, new: Any) -> None:
    if isinstance(recorded, torch.Tensor):
        if new.data_ptr() != recorded.data_ptr() or new.stride() != recorded.stride():
            recorded.copy_(new)
    elif isinstance(recorded, (tuple, list)):
        for r, n in zip(recorded, new):
            _write_back(r, n)


def emulated_capture(step):
    with fused_cpu.suspended():
        step()  # warm-up, as cuda_capture does
        rec = _Recorder()
        with rec:
            out = step()
    ops = rec.ops

    def replay() -> None:
        with torch.no_grad():
            for func, args, kwargs, recorded in ops:
                if func in _NO_KERNEL:
                    continue
                _write_back(recorded, func(*args, **kwargs))

    replay.num_ops = len(ops)
    return replay, out
