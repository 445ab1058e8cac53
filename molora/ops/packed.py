"""Base-linear GEMMs on weights packed once: the engine runner's linears on the CPU.

    lin = PackedLinear(weight, bias)        # weight [D_out, D_in] float32 or bfloat16 on the CPU; packs a copy once
    y = lin(x)                              # x [T, D_in] -> [T, D_out]: torch.addmm(bias, x, weight.T)

`torch.mm` reorders ("packs") the weight inside every call; at decode sizes that costs about as much as the
product. Packing once pays at every T up to a few hundred rows. The packed forms (`form`), one copy each:

- **panels** (float32, where molora's C++ kernel is built and D_out is a multiple of 16): the weight in panels of 16
  output columns, [D_out / 16, D_in, 16], and `fused_cpu.linear_panels`, a GEMM written for few rows (csrc:
  register tiles of 8 rows x 48 columns, the panels streamed from memory once, prefetched). Measured against MKL's
  packed sgemm (the previous path; 2 threads, SmolLM2-135M's 7 shapes over 30 layers, alternating, one process):
  1.47x, 1.91x, 1.57x, 1.28-1.43x, 1.22x, 1.09x and 0.99x as fast at T = 2, 8, 16, 32, 64, 128 and 512; in the
  engine (interleaved, one process) a batch-32 decode step 1.10x, a 512-token prefill step 0.88x. So the panels
  serve up to PANEL_MAX_ROWS rows and torch's own GEMM the rest: on prefill steps it measured as fast as MKL's
  packed one (729 against 722 ms, within the noise), and no second copy of the weight is kept for them. The
  register tile needs AVX-512's 32 vector registers: built for a CPU with AVX2 only it spills, and there the engine
  bench ran 3.0-4.4x faster with the family off (docs/kernel_keep_fp32_avx2.json; a 119-token prefill step of the
  default bundle took 4.8 s against 0.33 s), so there the weights go to MKL (`fused_cpu.panels_ready`).
- **mkl** (float32, otherwise, e.g. on a CPU without AVX-512: `torch.ops.mkl._mkl_linear`): 0.42-0.74x the time of
  torch.mm at T = 32, 0.83-0.99x at T = 512 (same shapes). One packed copy serves every row count (MKL's packed B
  does not depend on T; torch's wrapper is told each call's T, else it falls back to an unpacked GEMM).
- **amx** (bfloat16, on a CPU with the AMX-BF16 tile unit, D_out a multiple of 16 and D_in of 32): the weight in
  the layout of the tile unit's B operand, [D_out / 16, D_in / 32, 16, 32], and `fused_cpu.linear_amx` (csrc:
  2 x 2 accumulator tiles of 16 x 16, the weight tiles prefetched), up to PANEL_MAX_ROWS rows. torch's bf16
  linear (oneDNN) read the weights of a batch-32 decode step at about 6 GB/s, where this machine reads 20 GB/s.
  Measured against it (2 threads, the 7 shapes over 30 layers, weights cold, alternating; four runs): 2.0-2.1x at
  T = 8, 1.6-2.5x at T = 32, 1.1-1.55x at T = 128, 0.9-1.0x at T = 512 (so torch's GEMM keeps the rows above
  PANEL_MAX_ROWS); in the engine (SmolLM2-135M, bf16, batch-32 routed decode step, interleaved, one process) 65
  against 96 ms, greedy outputs equal.

Results are torch's up to float32 rounding in float32 (a few 1e-5 at these widths). In bfloat16 they are torch's bit
for bit up to 32 rows (the same exact products and float32 sums in k order, the bias added before the one
rounding); from 33 rows torch's oneDNN changes its blocking and about 1e-4 of its outputs move by a rounding. The
panel and AMX kernels compute each row on its own, so a row's result does not depend on T or on the other rows.
A single row (T = 1) is left to torch's GEMV, so one sequence decoding alone computes exactly what transformers
computes.

The packed copy is made again when the weight changes in place or is swapped (its version or address moves).
Costs one more copy of the weight. Knows nothing about adapters or models.
"""

from __future__ import annotations

import torch
from torch import Tensor

from molora.ops import fused_cpu

PACK_HINT = 32  # the row count MKL packs for (the packed copy serves every T: its size does not depend on it)
PANEL_MAX_ROWS = 128  # the panel kernel runs up to this many rows, torch's GEMM above (module docstring)


def _mkl() -> bool:
    return torch.backends.mkl.is_available() and hasattr(torch.ops.mkl, "_mkl_linear")


def available() -> bool:
    """Whether float32 weights can be packed here (molora's C++ kernel built, or MKL's packed linear in torch)."""
    return fused_cpu.panels_ready() or _mkl()


def form(weight: Tensor) -> str:
    """How `PackedLinear` runs `weight` [N, K] for up to PANEL_MAX_ROWS rows: "panels" (float32, N a multiple of 16,
    molora's kernel built for AVX-512), "mkl" (float32, MKL's packed sgemm), "amx" (bfloat16, N a multiple of 16 and
    K of 32, the kernel built with AMX and granted the tiles), or "torch" (nothing packs it here)."""
    n, k = weight.shape
    if weight.dtype == torch.bfloat16:
        return "amx" if n % 16 == 0 and k % 32 == 0 and fused_cpu.amx() else "torch"
    if weight.dtype != torch.float32:
        return "torch"
    return "panels" if n % 16 == 0 and fused_cpu.panels_ready() else "mkl" if _mkl() else "torch"


def supports(weight: Tensor) -> bool:
    """Whether `weight` can be packed here: a float32 or bfloat16 CPU matrix with a packed `form`."""
    return weight.device.type == "cpu" and weight.dim() == 2 and form(weight) != "torch"


def panels(weight: Tensor) -> Tensor:
    """weight [N, K] (N a multiple of 16) -> its panels [N / 16, K, 16]: panels[p, k, j] = weight[16 p + j, k]."""
    n, k = weight.shape
    return weight.detach().reshape(n // 16, 16, k).transpose(1, 2).contiguous()


def tiles(weight: Tensor) -> Tensor:
    """weight [N, K] (N a multiple of 16, K of 32) -> the AMX B-operand tiles [N / 16, K / 32, 16, 32]:
    tiles[p, c, r, 2 j + e] = weight[16 p + j, 32 c + 2 r + e] (16 columns of pairs of k, one 1 KB tile per p, c)."""
    n, k = weight.shape
    return (
        weight.detach()
        .reshape(n // 16, 16, k // 32, 16, 2)
        .permute(0, 2, 3, 1, 4)
        .contiguous()
        .view(n // 16, k // 32, 16, 32)
    )


class PackedLinear:
    """x @ weight.T (+ bias) on a packed copy of weight (module docstring); holds the weight, not a module."""

    __slots__ = ("weight", "bias", "dtype", "form", "packed", "_key")

    def __init__(self, weight: Tensor, bias: Tensor | None = None) -> None:
        if not supports(weight):
            raise ValueError(
                f"PackedLinear packs float32 CPU weights where molora's kernel or MKL is available, and "
                f"bfloat16 ones where the kernel runs on AMX; got {weight.dtype} "
                f"{tuple(weight.shape)} on {weight.device.type} (form {form(weight)!r})"
            )
        self.weight, self.bias, self.dtype = weight, bias, weight.dtype
        self.form = form(weight)  # "panels" / "amx": up to PANEL_MAX_ROWS rows, torch's GEMM above; "mkl": every T
        self.packed: Tensor | None = None
        self._key: tuple | None = None

    def _current(self) -> Tensor:
        w = self.weight
        key = (w.data_ptr(), w._version)
        if key != self._key:
            with torch.no_grad():
                self.packed = (
                    panels(w)
                    if self.form == "panels"
                    else tiles(w)
                    if self.form == "amx"
                    else torch.ops.mkl._mkl_reorder_linear_weight(w.detach(), PACK_HINT)
                )
            self._key = key
        assert self.packed is not None  # packed above whenever the key changed, and the key starts unset
        return self.packed

    def kernel_weight(self, dtype: torch.dtype) -> Tensor | None:
        """The packed weight that `__call__` hands molora's panel or AMX kernel for rows of `dtype` (2 to
        PANEL_MAX_ROWS of them, the kernel able to run now: the caller checks both), repacked first if the weight
        changed; None for the "mkl" form or another dtype. The runner's bound decode blocks keep it."""
        if self.form == "mkl" or dtype != self.dtype or self.weight.dtype != dtype:
            return None
        return self._current()

    def __call__(self, x: Tensor) -> Tensor:
        w, b = self.weight, self.bias
        T = x.shape[0]
        if (
            x.dim() != 2
            or T < 2
            or x.dtype != self.dtype
            or w.dtype != self.dtype
            or torch.is_grad_enabled()
            or (self.form != "mkl" and T > PANEL_MAX_ROWS)
        ):
            return torch.nn.functional.linear(x, w, b)  # one row: torch's GEMV (module docstring)
        if self.form == "mkl":
            return torch.ops.mkl._mkl_linear(x, self._current(), w, b, T)
        y = (fused_cpu.linear_panels if self.form == "panels" else fused_cpu.linear_amx)(x, self._current(), b)
        if y is not None:
            return y
        return torch.nn.functional.linear(x, w, b)  # the kernel declined (suspended while a step is recorded)
