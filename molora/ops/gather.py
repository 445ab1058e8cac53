"""The `gather` backend: per-token gather of A[slot] and B[slot], compiled with torch.compile.

Owns the compiled kernel and its lazy construction (on first use, never on import). Eager, the same
code materializes [T, k, R, D] gathers and is ~50x slower than sort_group, so it only ever runs
compiled; inductor fuses each gather into the reduction that consumes it.

Knows nothing about adapters or models. Semantics: those of `molora.ops.lora` (module docstring).
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
from torch import Tensor

from molora.errors import MoLoRAError


class LoRABackendError(MoLoRAError, RuntimeError):
    """A dispatch backend cannot run here (e.g. torch.compile has no working compiler)."""


def _gather_core(x: Tensor, A: Tensor, Bt: Tensor, idx: Tensor, coeff: Tensor) -> Tensor:
    """x [T, D_in], A [S, R, D_in], Bt [S, R, D_out] (B transposed, contiguous),
    idx [T, k] in [0, S), coeff [T, k] (0 where the choice is -1)  ->  [T, D_out].

        h[t, j, :] = coeff[t, j] * (A[idx[t, j]] @ x[t])            [T, k, R]
        out[t]     = sum_j h[t, j, :] @ Bt[idx[t, j]]               [T, D_out]
    """
    h = (x[:, None, None, :] * A[idx]).sum(-1) * coeff[..., None]  # [T, k, R]
    return (h[:, :, :, None] * Bt[idx]).sum((1, 2))  # [T, D_out]


@functools.cache
def compiled_gather_core() -> Callable[..., Tensor]:
    """The compiled kernel, built once per process on first use (compilation happens at the first call)."""
    # dynamic=True: one graph for all T (sizes 0 and 1 still specialize, so T=1 compiles once more).
    return torch.compile(_gather_core, dynamic=True)


def gather(x: Tensor, A: Tensor, B: Tensor, scale: Tensor, ids: Tensor, w: Tensor | None) -> Tensor:
    """ids [T, k] int64 (-1: none), w None or [T, k] in x's dtype  ->  [T, D_out] in x's dtype.

    Raises LoRABackendError if torch.compile cannot build the kernel on this machine.
    """
    valid = ids >= 0
    idx = ids.clamp(min=0)  # [T, k]
    coeff = scale.to(x.dtype)[idx] * valid  # [T, k]
    if w is not None:
        coeff = coeff * w
    # The reduction over R runs best with D_out contiguous: transpose B once per call (S*R*D_out copy).
    Bt = B.transpose(1, 2).contiguous()  # [S, R, D_out]
    try:
        return compiled_gather_core()(x, A, Bt, idx, coeff)
    except Exception as e:  # compile failures surface here, at the first call of each shape family
        raise LoRABackendError(
            "backend 'gather' needs torch.compile (inductor and a C++ compiler), which failed here: "
            f"{type(e).__name__}: {e}. Use backend='sort_group' or 'auto' instead."
        ) from e
