"""The `fused` backend: per-token LoRA in one C++ pass over the tokens, no gathers, no masked work (CPU).

Each routed token goes through its own slot only (the work of one adapter, as sort_group), but nothing is
copied: a token's row of x is read where it lies and its delta is added into its row of `out` in place.
Tokens are taken in sort_group's slot order (`SlotGroups`), in blocks of up to 4 of one slot:

    h[i]    = A[s] @ x[t_i]          [R]       16-lane dot products, 4 tokens x 4 ranks of accumulators
    h[i]   *= scale[s] (* weight)
    out[t_i] += Bt[s].T @ h[i]       [D_out]   64-column tiles held in registers across the R ranks

Blocks run in parallel on torch's intra-op threads (each token appears once in a call, so no two threads write one
row). Top-k routing (a static mix, a weighted token-id router) runs as one call per choice column, each a top-1
routing with its weights (`molora.ops.dispatch.RoutingPlan.column_groups`): a row of k adapters costs k adapters'
work and k kernel calls, never a merged weight. Written with GCC vector extensions (16-float vectors: AVX-512 where
the CPU has it, split into narrower ones elsewhere) in `csrc/lora_fused.cpp`, registered as the torch op
`torch.ops.molora.lora_fused_` and built with the other kernels by molora.ops.kernel_build (keyed by a hash of the
sources and flags). Without a C++ compiler molora says so once (a log warning) and runs the eager backends.

Why: on the dev CPU the eager backends pay either S times the work (stacked_mask) or row gathers and
scatters that are memory-bound (sort_group); `molora.bench.ops` measures this one against both and
against a single adapter.

Works in float32 and in bfloat16 (bf16 values widen exactly to float32 on load, every sum runs in
float32, each output rounds once to bf16 on store). On a CPU with AVX512_BF16 the bf16 path multiplies x by
A with the bf16 dot-product instruction (exact products, float32 sums, no widening), widens a slot's B once
per thread rather than once per block, and rounds outputs with the CPU's conversion instruction: 0.61x, 0.57x
and 0.69x the time of widening everything in software at T = 1024 (d_in x d_out 576 x 1536, 1536 x 576,
1000 x 200; S = 4, r = 16, 2 threads).

Limits (callers fall back to the eager backends): CPU, float32 or bfloat16, one choice per token and call, no
autograd, B stored slot-major (B.transpose(1, 2) contiguous, as `LoRASlots` keeps it), x and out with unit column
stride. `available()` says whether the library built; MOLORA_FUSED=0 turns every kernel off,
MOLORA_KERNELS_OFF=lora this one (molora.ops.kernel_build.FAMILIES).

This module is also the one place callers reach the CPU kernels from: it re-exports the build's names
(molora.ops.kernel_build: `build_key`, `suspended`, `unavailable_reason`) and the decode path's kernels
(molora.ops.cpu_kernels: paged attention, the per-layer glue, packed GEMMs, greedy rows, the one-call block,
`kernel_clock`).

Every entry point of the library checks its inputs before it reads or writes (csrc/checks.h: devices, dtypes, ranks,
shapes, strides, and each index tensor's values in one pass before the kernel's loops: tokens, cache rows, positions,
block ids, context lengths) and raises a RuntimeError naming the function, the argument and the value; a bug upstream
cannot turn into a write past a buffer (tests/test_kernel_checks.py: one test per check).
"""

from __future__ import annotations

import torch
from torch import Tensor

from molora.ops.cpu_kernels import (
    DTYPES,
    _profiled,
    add_rms_norm,
    amx,
    bind_block,
    block_supports,
    glue_supports,
    kernel_clock,
    linear_amx,
    linear_amx_w8,
    linear_panels,
    linear_w8,
    paged_decode,
    paged_decode_rows,
    panels_ready,
    quantize_rows,
    rope_write,
    run_block,
    scale_rows,
    silu_mul,
    w8_amx,
    w8_ready,
)
from molora.ops.gather import LoRABackendError
from molora.ops.kernel_build import build_key, off, ready, suspended, unavailable_reason
from molora.ops.lora import SlotGroups

__all__ = [  # the LoRA backend, and the build's and the decode path's names re-exported for callers
    "DTYPES",
    "add_rms_norm",
    "amx",
    "available",
    "bf16_dot",
    "bind_block",
    "block_supports",
    "build_key",
    "fused_apply",
    "glue_supports",
    "kernel_clock",
    "linear_amx",
    "linear_amx_w8",
    "linear_panels",
    "linear_w8",
    "lora_add",
    "paged_decode",
    "paged_decode_rows",
    "panels_ready",
    "quantize_rows",
    "rope_write",
    "run_block",
    "scale_rows",
    "silu_mul",
    "supports",
    "suspended",
    "unavailable_reason",
    "w8_amx",
    "w8_ready",
]

_NO_WEIGHTS = torch.empty(0)  # the kernel's "every pair weighs 1"


def available() -> bool:
    """Whether the fused CPU kernel is built (builds it on first call), not `suspended` and not turned off
    (MOLORA_KERNELS_OFF=lora)."""
    return ready() is not None and not off("lora")


def bf16_dot() -> bool:
    """Whether the built kernel runs bfloat16 on the CPU's bf16 dot-product instruction (AVX512_BF16);
    False where it widens to float32 in software, or where the kernel is not built."""
    mod = ready()
    return mod is not None and bool(mod.bf16_dot())


def supports(x: Tensor, B: Tensor) -> bool:
    """Whether a call with these tensors can run fused (module docstring: Limits; top-k runs one call per choice
    column); no build, no data read."""
    return (
        x.device.type == "cpu"
        and x.dtype in DTYPES
        and x.stride(-1) == 1
        and B.transpose(1, 2).is_contiguous()
        and not torch.is_grad_enabled()
    )


def fused_apply(g: SlotGroups, x: Tensor, A: Tensor, B: Tensor, scale: Tensor, out: Tensor | None = None) -> Tensor:
    """The fused backend on one top-1 SlotGroups (one choice column): out [T, D_out] += each token's own delta.
    out None: a new zero-initialised tensor is returned. Call only where `supports` and `available`."""
    mod = ready()
    if mod is None:
        raise LoRABackendError(
            f"backend 'fused' needs its C++ kernel, which could not be built here ({unavailable_reason()}). "
            "Use backend='auto' (falls back to the eager backends) or install a C++ compiler."
        )
    if out is None:
        out = x.new_zeros(x.shape[0], B.shape[1])
    elif out.stride(-1) != 1:  # the kernel writes rows with unit stride
        return out.add_(fused_apply(g, x, A, B, scale))
    # The kernel takes scale [S] and the pairs' weights as they are (float32, contiguous: no per-call op in the
    # usual case); it multiplies them per pair itself.
    if scale.dtype != torch.float32 or not scale.is_contiguous():
        scale = scale.float().contiguous()
    w = g.weight
    if w is not None and (w.dtype != torch.float32 or not w.is_contiguous()):
        w = w.float().contiguous()
    with _profiled("molora::lora_fused_"):
        done = mod.lora_fused_(out, x, A.contiguous(), B, g.tok, scale, _NO_WEIGHTS if w is None else w, g.counts)
    if not done:  # `supports` and the conversions above give the kernel its layout; this is a bug if reached
        raise LoRABackendError(
            f"the fused kernel declined the layout of x {tuple(x.stride())}, out "
            f"{tuple(out.stride())}, B {tuple(B.stride())}"
        )
    return out


def lora_add(
    out: Tensor, x: Tensor, A: Tensor, B: Tensor, scale: Tensor, tok: Tensor, weight: Tensor | None, counts: list[int]
) -> bool:
    """`fused_apply` into `out` on a step's prepared arguments (`molora.ops.dispatch.RoutingPlan.fused_step`:
    tok, weight in float32 or None, counts), with no check in Python: the kernel checks the shapes (a
    RuntimeError names the one that disagrees) and returns False, having done nothing, where the layout is not its
    own (a column stride other than 1, B not slot-major, scale not contiguous float32) or where it cannot run now
    (not built, `suspended`, autograd on); the caller then takes the checked path. The routed linears' path: about
    a tenth of the Python time per call of the checked one."""
    mod = ready()
    if mod is None or off("lora") or torch.is_grad_enabled():
        return False
    with _profiled("molora::lora_fused_"):
        return mod.lora_fused_(out, x, A, B, tok, scale, _NO_WEIGHTS if weight is None else weight, counts)
