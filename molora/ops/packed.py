"""Base-linear GEMMs on weights packed once (MKL's packed sgemm): the engine runner's float32 linears on the CPU.

    lin = PackedLinear(weight, bias)        # weight [D_out, D_in] float32 on the CPU; packs a copy once
    y = lin(x)                              # x [T, D_in] -> [T, D_out]: torch.addmm(bias, x, weight.T)

`torch.mm` reorders ("packs") the weight for MKL's sgemm inside every call. At decode sizes that costs about as
much as the product: measured here (2 threads, SmolLM2-135M's shapes, T = 32), the packed product takes
0.42-0.74x the time of torch.mm (576 x 576 ... 576 x 1536, and 0.73x for the 49152-wide lm_head); at T = 512
0.83-0.99x. One packed copy serves every row count (MKL's packed B does not depend on T; torch's wrapper is told
each call's T, else it falls back to an unpacked GEMM).

Its results are torch.mm's up to float32 rounding (a few 1e-5 at these widths; equal bit for bit at many T, not
all: the packed kernel blocks the sums its own way, as torch.mm itself does differently for different T). A
single row (T = 1) is left to torch's GEMV, so one sequence decoding alone computes exactly what transformers
computes.

The packed copy is made again when the weight changes in place or is swapped (its version or address moves).
Costs one more copy of the weight. Float32 on the CPU with MKL only (`available`); bf16 has no such kernel here
(oneDNN's packed bf16 linear changed greedy outputs and ran prefill slower, measured). Knows nothing about
adapters or models.
"""

from __future__ import annotations

import torch
from torch import Tensor

PACK_HINT = 32  # the row count MKL packs for (the packed copy serves every T: its size does not depend on it)


def available() -> bool:
    """Whether this torch build has MKL's packed linear (x86 CPU builds do)."""
    return torch.backends.mkl.is_available() and hasattr(torch.ops.mkl, "_mkl_linear")


def supports(weight: Tensor) -> bool:
    """Whether `weight` can be packed here: a float32 CPU tensor and MKL's packed linear available."""
    return weight.device.type == "cpu" and weight.dtype == torch.float32 and weight.dim() == 2 and available()


class PackedLinear:
    """x @ weight.T (+ bias) on a packed copy of weight (module docstring); holds the weight, not a module."""

    __slots__ = ("weight", "bias", "packed", "_key")

    def __init__(self, weight: Tensor, bias: Tensor | None = None) -> None:
        if not supports(weight):
            raise ValueError(f"PackedLinear packs float32 CPU weights where MKL is available; got {weight.dtype} "
                             f"on {weight.device.type} (MKL {'available' if available() else 'unavailable'})")
        self.weight, self.bias = weight, bias
        self.packed: Tensor | None = None
        self._key: tuple | None = None

    def _current(self) -> Tensor:
        w = self.weight
        key = (w.data_ptr(), w._version)
        if key != self._key:
            with torch.no_grad():
                self.packed = torch.ops.mkl._mkl_reorder_linear_weight(w.detach(), PACK_HINT)
            self._key = key
        return self.packed

    def __call__(self, x: Tensor) -> Tensor:
        w, b = self.weight, self.bias
        if x.dim() != 2 or x.shape[0] < 2 or x.dtype != torch.float32 or torch.is_grad_enabled():
            return torch.nn.functional.linear(x, w, b)     # one row: torch's GEMV (module docstring)
        return torch.ops.mkl._mkl_linear(x, self._current(), w, b, x.shape[0])
