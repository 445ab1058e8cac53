"""The `triton` backend: per-token LoRA on the GPU in two Triton kernels over pairs sorted by slot (SGMV-like).

Semantics are those of `molora.ops.lora` (module docstring; `lora_delta_reference` is the spec). Legend: T tokens,
k choices per token, M = T*k (token, choice) pairs, S slots, R rank (R_pad = R rounded up to a power of two, at
least 16), D_in / D_out the target linear's sizes, BM the tile height.

Metadata, built once per step on the device by `build_plan` (a few sorts and scans; no host read, so the counts
per slot never leave the device and the whole thing is CUDA-graph safe for a fixed T):

    key        [M]        slot of each pair, S for "none" (-1) and for ids outside [0, S)
    rows       [P]        pair index (t*k + j) at each padded position, -1 for padding; every slot's run of pairs
                          starts on a multiple of BM, so one tile holds pairs of one slot only
    tile_slot  [P / BM]   the slot of each tile; S for tiles past the padded total (they exit at once)

P = BM * (ceil(M / BM) + min(S, M)) is the worst case of the padded total, so the grid never depends on data.

The two kernels (the rows of x are read through `rows`, results written to the pairs' own rows, no permute copies):

    shrink   h[p]   = scale[s] (* w[p]) * (A[s] @ x[t_p])      [M, R_pad] float32     grid (P / BM,)
    expand   out[t] += B[s] @ h[p]                             [T, D_out]             grid (P / BM, D_out / BN)

Only D_in (a loop bound), the tile sizes, k and the dtype path are compile-time constants; S, R and D_out are
runtime arguments, so one compiled kernel serves every bank size and output width. Both accumulate in float32
(tl.dot on bf16/fp16 tiles, or float32 tiles with input_precision "ieee"); `out` is rounded once. With top-1
routing every token has one pair, so expand adds straight into its row of `out`; with top-k > 1 two pairs of a
token would race on its row (and Triton has no bf16 atomics), so expand writes each pair's float32 delta
[M, D_out] and torch sums the k choices into `out`. No backward: the dispatcher runs it with autograd off only.

Tile sizes come from `TILES`, a host-side table keyed by M (nearest key at or above). The values are a first
guess from the shapes (no GPU has timed them yet): retune on a GPU with tools/gpu_check.py.

Under TRITON_INTERPRET=1 the kernels run on CPU tensors (the exactness tests). The interpreter's tl.dot on bf16 is
reported wrong (relative errors near 4e11 in this project's notes on the interpreter), so interpreted kernels
upcast their tiles to float32 first; and loops run over
constexpr bounds only (a loop over a runtime scalar fails in the interpreter under numpy 2.4).

Imported only where triton is installed (`molora.ops.dispatch` imports it lazily); importing it compiles nothing.
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from torch import Tensor

DTYPES: tuple[torch.dtype, ...] = (torch.float32, torch.float16, torch.bfloat16)

# (M at most, BLOCK_M, BLOCK_K of shrink, BLOCK_N of expand): small M wants short tiles (few padded rows), large M
# tall ones (more reuse of A[s] and B[s]). Untuned: see the module docstring.
TILES: tuple[tuple[int, int, int, int], ...] = (
    (32, 16, 64, 64),
    (256, 32, 64, 128),
    (2048, 64, 64, 128),
    (1 << 62, 128, 64, 128),
)


def tiles_for(num_pairs: int) -> tuple[int, int, int]:
    """(BLOCK_M, BLOCK_K, BLOCK_N) for M pairs: the first TILES row whose key is at least M."""
    for limit, bm, bk, bn in TILES:
        if num_pairs <= limit:
            return bm, bk, bn
    raise AssertionError("TILES ends with an unbounded row")


def interpreting() -> bool:
    """Whether Triton runs kernels in its CPU interpreter (TRITON_INTERPRET=1)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


# ---------------------------------------------------------------------------------------------- metadata


@dataclass(frozen=True)
class TritonPlan:
    """`build_plan`'s device metadata for one step (module docstring); shared by all target linears."""

    rows: Tensor  # [P] pair index at each padded position, -1 = padding
    tile_slot: Tensor  # [P / BM] slot of each tile, S = past the end
    weight: Tensor | None  # [M] float32 weight of each pair (None: all 1)
    num_tokens: int  # T
    top_k: int  # k
    num_slots: int  # S
    block_m: int  # BM

    @property
    def num_tiles(self) -> int:
        return self.tile_slot.shape[0]


def build_plan(ids: Tensor, weights: Tensor | None, num_slots: int) -> TritonPlan:
    """ids [T, k] int64 (-1: none), weights None or [T, k]  ->  TritonPlan. Device ops only: no host read."""
    T, k = ids.shape
    M, S, dev = T * k, num_slots, ids.device
    bm = tiles_for(M)[0]
    key = ids.reshape(-1)  # [M], pair p = t*k + j
    key = torch.where((key >= 0) & (key < S), key, S)  # none (and any bad id) -> S, sorts last
    sorted_key, order = torch.sort(key, stable=True)  # [M]
    start = torch.searchsorted(sorted_key, torch.arange(S + 1, device=dev))  # [S+1] first pair of each slot
    count = start[1:] - start[:-1]  # [S] pairs per slot (stays on the device)
    padded = (count + bm - 1) // bm * bm  # [S] runs rounded up to whole tiles
    pad_end = torch.cumsum(padded, 0)  # [S]
    pad_start = pad_end - padded
    tiles = -(-M // bm) + min(S, M)  # worst case of the padded total / BM
    P = tiles * bm
    s = sorted_key.clamp(max=S - 1)  # [M] (the none pairs are masked below)
    pos = pad_start[s] + torch.arange(M, device=dev) - start[s]  # [M] padded position of each sorted pair
    pos = torch.where(sorted_key < S, pos, P)  # none -> a dump row past the end
    rows = torch.full((P + 1,), -1, dtype=torch.long, device=dev).scatter_(0, pos, order)[:P]  # [P]
    tile_slot = torch.searchsorted(pad_end // bm, torch.arange(tiles, device=dev), right=True)  # [tiles] in [0, S]
    w = None if weights is None else weights.reshape(-1).to(torch.float32).contiguous()  # [M]
    return TritonPlan(rows, tile_slot, w, T, k, S, bm)


# ---------------------------------------------------------------------------------------------- kernels


def _shrink(
    x_ptr,
    a_ptr,
    scale_ptr,
    w_ptr,
    rows_ptr,
    tile_slot_ptr,
    h_ptr,
    S,
    R,
    stride_xt,
    stride_xk,
    stride_as,
    stride_ar,
    stride_ak,
    TOP_K: tl.constexpr,
    D_IN: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_K: tl.constexpr,
    HAS_W: tl.constexpr,
    F32_DOT: tl.constexpr,
):
    """h[p, :R] = scale[s] (* w[p]) * (A[s] @ x[p // TOP_K]) for the pairs p of one tile of slot s."""
    tile = tl.program_id(0)
    s = tl.load(tile_slot_ptr + tile)
    if s < S:
        offs_m = tile * BLOCK_M + tl.arange(0, BLOCK_M)
        pair = tl.load(rows_ptr + offs_m)  # [BM], -1 = padding
        valid = pair >= 0
        tok = tl.where(valid, pair // TOP_K, 0)
        offs_r = tl.arange(0, BLOCK_R)
        acc = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
        for k0 in range(0, D_IN, BLOCK_K):
            offs_k = k0 + tl.arange(0, BLOCK_K)
            xt = tl.load(
                x_ptr + tok[:, None] * stride_xt + offs_k[None, :] * stride_xk,
                mask=valid[:, None] & (offs_k[None, :] < D_IN),
                other=0.0,
            )  # [BM, BK]
            at = tl.load(
                a_ptr + s * stride_as + offs_r[None, :] * stride_ar + offs_k[:, None] * stride_ak,
                mask=(offs_r[None, :] < R) & (offs_k[:, None] < D_IN),
                other=0.0,
            )  # [BK, BR] = A[s].T
            if F32_DOT:
                acc += tl.dot(xt.to(tl.float32), at.to(tl.float32), input_precision="ieee")
            else:
                acc += tl.dot(xt, at)
        coeff = tl.load(scale_ptr + s).to(tl.float32)
        if HAS_W:
            acc = acc * (coeff * tl.load(w_ptr + pair, mask=valid, other=0.0))[:, None]
        else:
            acc = acc * coeff
        tl.store(h_ptr + pair[:, None] * BLOCK_R + offs_r[None, :], acc, mask=valid[:, None])


def _expand(
    h_ptr,
    b_ptr,
    out_ptr,
    y_ptr,
    rows_ptr,
    tile_slot_ptr,
    S,
    R,
    D_OUT,
    stride_bs,
    stride_bn,
    stride_br,
    stride_ot,
    stride_on,
    TOP_K: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    F32_DOT: tl.constexpr,
):
    """B[s] @ h[p] for the pairs of one tile of slot s and one BN-wide column block: added into out[p] (TOP_K 1)
    or stored, in float32, into y[p] (TOP_K > 1)."""
    tile = tl.program_id(0)
    s = tl.load(tile_slot_ptr + tile)
    if s < S:
        offs_m = tile * BLOCK_M + tl.arange(0, BLOCK_M)
        pair = tl.load(rows_ptr + offs_m)  # [BM]
        valid = pair >= 0
        safe = tl.where(valid, pair, 0)
        offs_r = tl.arange(0, BLOCK_R)
        offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        h = tl.load(h_ptr + safe[:, None] * BLOCK_R + offs_r[None, :], mask=valid[:, None], other=0.0)  # [BM, BR]
        b = tl.load(
            b_ptr + s * stride_bs + offs_r[:, None] * stride_br + offs_n[None, :] * stride_bn,
            mask=(offs_r[:, None] < R) & (offs_n[None, :] < D_OUT),
            other=0.0,
        )  # [BR, BN] = B[s].T
        if F32_DOT:
            acc = tl.dot(h, b.to(tl.float32), input_precision="ieee")
        else:
            acc = tl.dot(h.to(b.dtype), b)  # [BM, BN] float32
        mask = valid[:, None] & (offs_n[None, :] < D_OUT)
        if TOP_K == 1:
            ptrs = out_ptr + safe[:, None] * stride_ot + offs_n[None, :] * stride_on
            o = tl.load(ptrs, mask=mask, other=0.0)
            tl.store(ptrs, (o.to(tl.float32) + acc).to(o.dtype), mask=mask)
        else:
            tl.store(y_ptr + safe[:, None] * D_OUT + offs_n[None, :], acc, mask=mask)


@functools.cache
def _kernels(interpret: bool):
    """The jitted pair, decorated on first use (triton.jit reads TRITON_INTERPRET when it decorates)."""
    assert interpret == interpreting()
    return triton.jit(_shrink), triton.jit(_expand)


# ---------------------------------------------------------------------------------------------- launch


def triton_apply(plan: TritonPlan, x: Tensor, A: Tensor, B: Tensor, scale: Tensor, out: Tensor | None = None) -> Tensor:
    """out [T, D_out] += each token's routed delta (a new zero tensor when out is None); x [T, D_in],
    A [S, R, D_in], B [S, D_out, R] (any strides), scale [S]. The caller (`molora.ops.dispatch`) has checked
    shapes and dtypes; x, A and B share one dtype in DTYPES."""
    T, D_in = x.shape
    S, R, _ = A.shape
    D_out = B.shape[1]
    assert plan.num_tokens == T and plan.num_slots == S and x.dtype in DTYPES
    if out is None:
        out = x.new_zeros(T, D_out)
    M, k = T * plan.top_k, plan.top_k
    interpret = interpreting()
    shrink, expand = _kernels(interpret)
    _, bk, bn = tiles_for(M)
    br = max(16, triton.next_power_of_2(R))
    f32 = interpret or x.dtype == torch.float32  # interpreted bf16 dots are wrong: float32 tiles instead
    h = torch.empty(M, br, dtype=torch.float32, device=x.device)  # [M, R_pad]
    scale = scale if scale.dtype == torch.float32 else scale.float()
    w = plan.weight if plan.weight is not None else scale  # (unread when HAS_W is False)
    shrink[(plan.num_tiles,)](
        x,
        A,
        scale,
        w,
        plan.rows,
        plan.tile_slot,
        h,
        S,
        R,
        x.stride(0),
        x.stride(1),
        A.stride(0),
        A.stride(1),
        A.stride(2),
        TOP_K=k,
        D_IN=D_in,
        BLOCK_R=br,
        BLOCK_M=plan.block_m,
        BLOCK_K=bk,
        HAS_W=plan.weight is not None,
        F32_DOT=f32,
    )
    y = out if k == 1 else torch.zeros(M, D_out, dtype=torch.float32, device=x.device)  # [M, D_out] for top-k
    expand[(plan.num_tiles, triton.cdiv(D_out, bn))](
        h,
        B,
        out,
        y,
        plan.rows,
        plan.tile_slot,
        S,
        R,
        D_out,
        B.stride(0),
        B.stride(1),
        B.stride(2),
        out.stride(0),
        out.stride(1),
        TOP_K=k,
        BLOCK_R=br,
        BLOCK_M=plan.block_m,
        BLOCK_N=bn,
        F32_DOT=f32,
    )
    if k > 1:
        out.add_(y.view(T, k, D_out).sum(1))  # float32 sum of the choices, rounded once into out
    return out
