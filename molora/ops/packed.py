"""Base-linear GEMMs on weights packed once: the engine runner's float32 linears on the CPU.

    lin = PackedLinear(weight, bias)        # weight [D_out, D_in] float32 on the CPU; packs a copy once
    y = lin(x)                              # x [T, D_in] -> [T, D_out]: torch.addmm(bias, x, weight.T)

`torch.mm` reorders ("packs") the weight for MKL's sgemm inside every call; at decode sizes that costs about as
much as the product. Packing once pays at every T up to a few hundred rows. Two packed forms, one copy each:

- **panels** (where molora's C++ kernel is built and D_out is a multiple of 16): the weight in panels of 16
  output columns, [D_out / 16, D_in, 16], and `fused_cpu.linear_panels`, a GEMM written for few rows (csrc:
  register tiles of 8 rows x 48 columns, the panels streamed from memory once, prefetched). Measured against MKL's
  packed sgemm (the previous path; 2 threads, SmolLM2-135M's 7 shapes over 30 layers, alternating, one process):
  1.47x, 1.91x, 1.57x, 1.28-1.43x, 1.22x, 1.09x and 0.99x as fast at T = 2, 8, 16, 32, 64, 128 and 512; in the
  engine (interleaved, one process) a batch-32 decode step 1.10x, a 512-token prefill step 0.88x. So the panels
  serve up to PANEL_MAX_ROWS rows and torch's own GEMM the rest: on prefill steps it measured as fast as MKL's
  packed one (729 against 722 ms, within the noise), and no second copy of the weight is kept for them.
- **MKL's packed sgemm** otherwise (`torch.ops.mkl._mkl_linear`): 0.42-0.74x the time of torch.mm at T = 32,
  0.83-0.99x at T = 512 (same shapes). One packed copy serves every row count (MKL's packed B does not depend on
  T; torch's wrapper is told each call's T, else it falls back to an unpacked GEMM).

Results are torch.mm's up to float32 rounding (a few 1e-5 at these widths; the panel kernel sums each output over
k in order, so a row's result does not depend on T or on the other rows). A single row (T = 1) is left to
torch's GEMV, so one sequence decoding alone computes exactly what transformers computes.

The packed copy is made again when the weight changes in place or is swapped (its version or address moves).
Costs one more copy of the weight. Float32 on the CPU only (`available`); bf16 has no such kernel here (oneDNN's
packed bf16 linear changed greedy outputs and ran prefill slower, measured). Knows nothing about adapters or
models.
"""

from __future__ import annotations

import torch
from torch import Tensor

from molora.ops import fused_cpu

PACK_HINT = 32         # the row count MKL packs for (the packed copy serves every T: its size does not depend on it)
PANEL_MAX_ROWS = 128   # the panel kernel runs up to this many rows, torch's GEMM above (module docstring)


def _mkl() -> bool:
    return torch.backends.mkl.is_available() and hasattr(torch.ops.mkl, "_mkl_linear")


def available() -> bool:
    """Whether float32 weights can be packed here (molora's C++ kernel built, or MKL's packed linear in torch)."""
    return fused_cpu.available() or _mkl()


def supports(weight: Tensor) -> bool:
    """Whether `weight` can be packed here: a float32 CPU matrix, and a packed form available."""
    return weight.device.type == "cpu" and weight.dtype == torch.float32 and weight.dim() == 2 and available()


def panels(weight: Tensor) -> Tensor:
    """weight [N, K] (N a multiple of 16) -> its panels [N / 16, K, 16]: panels[p, k, j] = weight[16 p + j, k]."""
    n, k = weight.shape
    return weight.detach().reshape(n // 16, 16, k).transpose(1, 2).contiguous()


class PackedLinear:
    """x @ weight.T (+ bias) on a packed copy of weight (module docstring); holds the weight, not a module."""

    __slots__ = ("weight", "bias", "form", "packed", "_key")

    def __init__(self, weight: Tensor, bias: Tensor | None = None) -> None:
        if not supports(weight):
            raise ValueError(f"PackedLinear packs float32 CPU weights where molora's kernel or MKL is available; got "
                             f"{weight.dtype} on {weight.device.type} "
                             f"(packing {'available' if available() else 'unavailable'})")
        self.weight, self.bias = weight, bias
        # "panels" (up to PANEL_MAX_ROWS rows; torch's GEMM above), else "mkl" (every T), else "torch" (nothing packs
        # this one here: torch's GEMM)
        self.form = ("panels" if fused_cpu.available() and weight.shape[0] % 16 == 0
                     else "mkl" if _mkl() else "torch")
        self.packed: Tensor | None = None
        self._key: tuple | None = None

    def _current(self) -> Tensor:
        w = self.weight
        key = (w.data_ptr(), w._version)
        if key != self._key:
            with torch.no_grad():
                self.packed = (panels(w) if self.form == "panels"
                               else torch.ops.mkl._mkl_reorder_linear_weight(w.detach(), PACK_HINT))
            self._key = key
        return self.packed

    def __call__(self, x: Tensor) -> Tensor:
        w, b = self.weight, self.bias
        T = x.shape[0]
        if (x.dim() != 2 or T < 2 or x.dtype != torch.float32 or torch.is_grad_enabled() or self.form == "torch"
                or (self.form == "panels" and T > PANEL_MAX_ROWS)):
            return torch.nn.functional.linear(x, w, b)     # one row: torch's GEMV (module docstring)
        if self.form == "panels":
            y = fused_cpu.linear_panels(x, self._current(), b)
            if y is not None:
                return y
            return torch.nn.functional.linear(x, w, b)     # the kernel declined (suspended while a step is recorded)
        return torch.ops.mkl._mkl_linear(x, self._current(), w, b, T)
