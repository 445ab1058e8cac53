"""Int8 and int4 base linears on the CPU: the quantization schemes, the kernels torch ships, a reference beside them.

    q, scales = quantize(weight, "int8")            # weight [N, K] float -> int8 [N, K], float32 scales [N]
    y = linear_int8(x, q, scales)                   # x [T, K] float32 / bfloat16 -> [T, N] in x's dtype
    y_ref = linear_reference(x, q, scales, "int8", 0, (N, K))   # the same rounding, dequantized, in float32

Weights (quantized once, on load):

- **int8** and **w8a8**: symmetric, one scale per output channel: scale[n] = max_k |w[n, k]| / 127,
  q = round(w / scale) in [-127, 127]; w ~ q * scale.
- **int4**: asymmetric groups of G (INT4_GROUP = 32; 64 also divides SmolLM2's K = 576, 128 does not) along K, one
  scale and one zero per group and output channel, in torch's int4 layout: q in [0, 15], w ~ (q - 8) * scale + zero
  with scale = (max - min) / 15 and zero = min + 8 * scale over the group.

Kernels (experiments/ab_quant_linear.py, SmolLM2-135M's shapes, interleaved; docs/quant_linear.json): torch's
weight-only CPU kernels ran far behind the float32 GEMM molora packs (molora.ops.packed) at every T above 1:
`torch._weight_int8pack_mm` 0.03-0.06x at T = 8-32 (float32 activations: not vectorized), the int4 one
(`torch._weight_int4pack_mm_for_cpu`) 0.01-0.02x, and torchao brings no CPU kernel of its own. So:

- **int8** (what `--quantization int8` runs) is weight only: the activations stay in the model's dtype, on molora's
  own kernels (`linear_int8`; csrc/linear_w8.cpp, csrc/linear_amx.cpp): float32 activations on `linear_w8` (the
  int8 weight widened to float32 four rows at a time into an L1 buffer, AVX-512 FMA), bfloat16 ones on
  `linear_amx_w8` (each task widens its int8 weight tiles to bfloat16, exact, then runs the AMX GEMM of the bf16
  path); the per-channel scale multiplies
  each output once. Weights cost a quarter (half) of float32's (bfloat16's) bytes, one int8 copy each: bfloat16
  activations read it in `tiles`' layout only (molora.model.quant_linear keeps it so; `untile` gives the rows back
  where a path needs them), float32 ones as rows. Measured side by side
  (experiments/ab_quant_linear.py, 1 thread, 6 layers, load 7-11: docs/quant_linear_w8_loaded.json): in float32,
  linear_w8 ran 1.34x, 0.82x, 0.89x, 0.77x, 0.71x the float32 panels at T = 8, 16, 32, 128, 512 (that run
  predates the widening into an L1 buffer; a rerun with it, load 7-9, docs/quant_linear_w8_loaded_b.json: 1.15x,
  0.97x, 0.89x at T = 8, 16, 32, no change that this load can resolve); torch's `_weight_int8pack_mm` 0.02-0.07x.
  In bfloat16, linear_amx_w8 ran 0.73-1.09x the bf16 AMX GEMM and torch's `_weight_int8pack_mm` (bf16 activations,
  the kernel the issue proposed calling from C++) 0.10-0.38x.
  The weights alone in int8 kept 96% top-1 agreement with float32 on validation text (bfloat16: 97%).
- **w8a8**: weights *and* activations in 8 bits on torch's int8 GEMM (`linear_w8a8`: `torch._int_mm`, oneDNN's
  s8 x s8 -> s32 matmul, on the int8 rows themselves: no packed copy), the rounding before it and the scaling after
  it each one pass of molora's kernels (csrc/linear_w8a8.cpp: `fused_cpu.quantize_rows`, `scale_rows`; torch's
  six to eight small ops cost more than the GEMM at a decode step's 16 rows). It does not run on
  `torch.ops.onednn.qlinear_pointwise` with signed int8 activations (what torch's x86 inductor quantization
  calls), which on an AVX512-VNNI CPU without AMX ran oneDNN's slow reference path, hundreds of times slower than
  the float32 GEMM (experiments/ab_w8a8_kernel.py, docs/quant_w8a8_kernel.json). A GEMM of molora's own on
  AVX512-VNNI (vpdpbusd on the row-major weight) was tried on that CPU and ran about half as fast as torch._int_mm,
  so it was not kept (no record kept). Each
  activation row rounded symmetrically over its own range (`quantize_tokens`: a row's result depends on that row
  alone), the int32 sums exact, scaled in float32. Rounding activations costs quality on SmolLM2 (outlier channels):
  top-1 agreement with float32 89% on validation text. **SmoothQuant** (`smoothing`) moves range from the
  activations into the weights per input channel, x @ W.T = (x / s) @ (W * s).T, from activation ranges on
  calibration text (`molora.load` reads 16 general prompts with their answers); alpha (SMOOTH_ALPHA) was chosen on
  validation text: 93.5% agreement, KL to float32 0.046 -> 0.018 (experiments/quant_smooth_choose.py,
  docs/quant_smooth_choice.json). s is a power of two, so the division and multiplication are exact in every dtype.
- **int4** runs on torch's weight-only int4 kernel (`linear_int4`, activations in their own dtype): it saves memory
  (half a byte a weight) and is slower than float; no faster int4 CPU kernel was found.

The reference (`linear_reference`) computes the same rounding of the same values in float32: the kernels equal it up
to the order of float32 sums (float32: about 1e-6 relative; bfloat16: one rounding of the output; tests/test_quant.py).

Knows nothing about modules, adapters or models.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from molora.ops import fused_cpu, packed

SCHEMES = ("int8", "int4", "w8a8")  # int8: weight only; w8a8: activations in int8 too
SMOOTH_ALPHA = 0.5  # SmoothQuant's migration strength for w8a8, chosen on validation (docs/quant_smooth_choice.json)
INT4_GROUP = 32  # group size along K for int4 (module docstring; measured in docs/quant_linear.json)
_INNER_K_TILES = 1  # argument of torch's int4 packing on the CPU (its layout does not depend on it there)


def check_scheme(scheme: str | None) -> str | None:
    """`scheme` if it is None or one of SCHEMES; a ValueError naming the choices otherwise."""
    if scheme is not None and scheme not in SCHEMES:
        raise ValueError(f"quantization must be one of {list(SCHEMES)} (or none), got {scheme!r}")
    return scheme


def quantize_int8(weight: Tensor) -> tuple[Tensor, Tensor]:
    """weight [N, K] -> (q int8 [N, K], scale float32 [N]): symmetric per output channel, q in [-127, 127]."""
    w = weight.detach().float()
    scale = (w.abs().amax(dim=1) / 127).clamp(min=torch.finfo(torch.float32).tiny)  # an all-zero row: q = 0
    q = torch.round(w / scale[:, None]).clamp(-127, 127).to(torch.int8)
    return q, scale


def dequantize_int8(q: Tensor, scale: Tensor) -> Tensor:
    """(q [N, K], scale [N]) -> float32 [N, K] = q * scale."""
    return q.float() * scale.float()[:, None]


def quantize_int4(weight: Tensor, group: int = INT4_GROUP) -> tuple[Tensor, Tensor]:
    """weight [N, K] (K a multiple of group) -> (q int32 [N, K] in [0, 15], scale_zero float32 [K / G, N, 2]):
    asymmetric min/max groups of `group` along K in torch's int4 convention, w ~ (q - 8) * scale + zero."""
    n, k = weight.shape
    if group <= 0 or k % group:
        raise ValueError(f"int4 groups of {group} do not divide the weight's K = {k}")
    w = weight.detach().float().reshape(n, k // group, group)  # [N, K / G, G]
    lo, hi = w.amin(dim=2), w.amax(dim=2)  # [N, K / G]
    scale = ((hi - lo) / 15).clamp(min=1e-6)
    zero = lo + 8 * scale
    q = torch.round((w - lo[..., None]) / scale[..., None]).clamp(0, 15).to(torch.int32).reshape(n, k)
    return q, torch.stack([scale, zero], dim=-1).transpose(0, 1).contiguous()  # [K / G, N, 2]


def dequantize_int4(q: Tensor, scale_zero: Tensor, group: int) -> Tensor:
    """(q [N, K], scale_zero [K / G, N, 2]) -> float32 [N, K] = (q - 8) * scale + zero per group."""
    sz = scale_zero.float().transpose(0, 1)  # [N, K / G, 2]
    n, k = q.shape
    w = (q.float().reshape(n, k // group, group) - 8) * sz[..., 0:1] + sz[..., 1:2]
    return w.reshape(n, k)


def quantize(weight: Tensor, scheme: str, group: int = INT4_GROUP) -> tuple[Tensor, Tensor]:
    """weight [N, K] (a float CPU matrix) -> (q, scales) as `linear` takes them, scales in float32 (cast them to the
    activations' dtype): int8 q [N, K] and scales [N]; int4 q packed by torch (uint8, two values a byte) and
    scales [K / G, N, 2] (scale, zero); w8a8 as int8."""
    check_scheme(scheme)
    if weight.dim() != 2 or weight.device.type != "cpu" or not weight.is_floating_point():
        raise ValueError(
            f"weight-only {scheme} quantizes float CPU matrices; got {weight.dtype} "
            f"{tuple(weight.shape)} on {weight.device.type}"
        )
    if scheme in ("int8", "w8a8"):
        return quantize_int8(weight)
    q, scale_zero = quantize_int4(weight, group)
    return torch._convert_weight_to_int4pack_for_cpu(q, _INNER_K_TILES), scale_zero


def dequantize(q: Tensor, scales: Tensor, scheme: str, group: int, shape: tuple[int, int]) -> Tensor:
    """What (q, scales) of `quantize` stand for: the float32 weight [N, K] the kernel multiplies by."""
    if scheme in ("int8", "w8a8"):
        return dequantize_int8(q, scales)
    return dequantize_int4(unpack_int4(q, shape), scales, group)


@dataclass(frozen=True)
class W8A8Weight:
    """What `linear_w8a8` multiplies by (`prepack_w8a8` makes it once per weight): the int8 weight as torch._int_mm
    reads it, qt [K, N] (a transposed view of the rows q [N, K]: no copy), its float32 scales [N], and `smooth`,
    float32 [K] or None: the factor each activation channel is multiplied by before it is rounded (SmoothQuant's
    1 / s, powers of two; `smoothing`)."""

    qt: Tensor
    scales: Tensor
    smooth: Tensor | None
    shape: tuple[int, int]


def prepack_w8a8(q: Tensor, scales: Tensor, smooth: Tensor | None = None) -> W8A8Weight:
    """(q int8 [N, K], scales [N], smooth [K] or None) -> the `W8A8Weight` of `linear_w8a8` (q itself, viewed
    [K, N]; the scales widened to float32)."""
    n, k = q.shape
    if q.dtype != torch.int8 or scales.shape != (n,) or (smooth is not None and smooth.shape != (k,)):
        raise ValueError(
            f"int8 weight: q must be int8 [N, K], scales [N], smooth [K]; got q {q.dtype} {tuple(q.shape)}, "
            f"scales {tuple(scales.shape)}, smooth {None if smooth is None else tuple(smooth.shape)}"
        )
    m = None if smooth is None else smooth.float().contiguous()
    return W8A8Weight(q.t(), scales.float().contiguous(), m, (n, k))


def quantize_tokens(x: Tensor, smooth: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """x [T, K] -> (xq int8 [T, K], step float32 [T, 1]): each row (times `smooth`, if given) rounded to 8 bits
    over its own range, x * smooth ~ xq * step, step = max |row| / 127. A row's rounding depends on that row
    alone (what makes `linear_w8a8` batch invariant)."""
    xf = x.float() if smooth is None else x.float() * smooth
    step = (xf.abs().amax(dim=1, keepdim=True) / 127).clamp(min=torch.finfo(torch.float32).tiny)  # [T, 1]
    return torch.round(xf / step).to(torch.int8), step


def linear_w8a8(x: Tensor, w: W8A8Weight) -> Tensor:
    """x [T, K] (float32 or bfloat16) @ W.T -> [T, N] in x's dtype, W the int8 weight of `w` (`prepack_w8a8`),
    the activations rounded per token at each call (`quantize_tokens`), the integer products summed exactly in
    int32 by torch._int_mm (oneDNN's s8 x s8 -> s32 matmul: AVX512-VNNI, or AMX-INT8 where the CPU has it), then
    scaled in float32 by the row's and the weight's scales: the rounding and the scaling each in one pass of molora's
    kernels where they are built (fused_cpu.quantize_rows / scale_rows), in torch ops otherwise (equal bit for bit)."""
    if x.dim() != 2 or x.shape[1] != w.shape[1]:
        raise ValueError(f"linear_w8a8: x must be [T, {w.shape[1]}]; got {tuple(x.shape)}")
    rounded = fused_cpu.quantize_rows(x, w.smooth)
    xq, step = rounded if rounded is not None else quantize_tokens(x, w.smooth)
    acc = torch._int_mm(xq, w.qt)
    y = fused_cpu.scale_rows(acc, step, w.scales, x.dtype)
    if y is None:
        y = acc.float().mul_(step).mul_(w.scales)
        y = y if x.dtype == torch.float32 else y.to(x.dtype)
    return y


def smoothing(act_amax: Tensor, weight: Tensor, alpha: float) -> Tensor:
    """SmoothQuant's per input channel factor s [K] as a power of two (exact in any float dtype, so that
    (x / s) @ (W * s).T is x @ W.T before rounding): s ~ act_amax^alpha / max_n |W[n, k]|^(1 - alpha), act_amax
    [K] the activations' largest magnitude per channel on calibration text. Quantize W * s and give
    `prepack_w8a8` smooth = 1 / s."""
    a = act_amax.float().clamp(min=1e-5)
    wmax = weight.detach().float().abs().amax(dim=0).clamp(min=1e-5)
    return torch.exp2(torch.round(torch.log2(a.pow(alpha) / wmax.pow(1 - alpha))))


def tiles(q: Tensor) -> Tensor:
    """q int8 [N, K] (N a multiple of 16, K of 32) -> the AMX layout [N / 16, K / 32, 16, 32] of `linear_int8`'s
    bfloat16 path (molora.ops.packed.tiles on the int8 values)."""
    return packed.tiles(q)


def untile(t: Tensor) -> Tensor:
    """The inverse of `tiles`: [N / 16, K / 32, 16, 32] -> q int8 [N, K] (a new tensor; exact)."""
    p, c = t.shape[0], t.shape[1]
    return t.view(p, c, 16, 16, 2).permute(0, 3, 1, 2, 4).reshape(16 * p, 32 * c)


def take_tiles(t: Tensor, ids: Tensor) -> Tensor:
    """Rows `ids` [T] of the int8 weight held as `tiles` t [N / 16, K / 32, 16, 32] -> int8 [T, K] (= untile(t)[ids],
    without untiling the rest)."""
    p, c = t.shape[0], t.shape[1]
    return t.view(p, c, 16, 16, 2)[ids // 16, :, :, ids % 16, :].reshape(ids.shape[0], 32 * c)  # [T, K / 32, 16, 2]


def linear_int8(
    x: Tensor, q: Tensor | None, scales: Tensor, q_tiles: Tensor | None = None, bias: Tensor | None = None
) -> Tensor:
    """Weight-only int8: x [T, K] (float32 or bfloat16) @ (q * scales).T (+ bias, added before the output's one
    rounding) -> [T, N] in x's dtype, q int8 [N, K], scales float32 [N], bias in x's dtype. On molora's kernels
    (module docstring): bfloat16 x on AMX where `q_tiles` (`tiles(q)`) is given and the CPU has it, else
    `linear_w8`; where the kernels cannot run (not built, `suspended`, autograd on, K not a multiple of 16), x times
    the dequantized weight in x's dtype (slow: a float copy of the weight a call). q may be None where q_tiles is
    given (the weight kept in the tiles' layout only): the paths that need rows take them from the tiles
    (`untile`, a copy a call)."""
    if q is None and q_tiles is None:
        raise ValueError("linear_int8 needs the int8 weight as rows (q) or as tiles (q_tiles)")
    y = None
    if x.dtype == torch.bfloat16 and q_tiles is not None and fused_cpu.amx():
        y = fused_cpu.linear_amx_w8(x, q_tiles, scales, bias)
    if y is not None:
        return y
    if q is not None:
        rows = q
    else:
        assert q_tiles is not None  # one of the two is given (checked above)
        rows = untile(q_tiles)
    y = fused_cpu.linear_w8(x, rows, scales, bias)
    if y is None:
        y = torch.nn.functional.linear(x, dequantize_int8(rows, scales).to(x.dtype), bias)
    return y


def linear_int4(x: Tensor, q: Tensor, scales: Tensor, group: int) -> Tensor:
    """x [T, K] @ dequantize_int4(q, scales, group).T -> [T, N] in x's dtype (q packed, scales in x's dtype)."""
    return torch._weight_int4pack_mm_for_cpu(x, q, group, scales)


def unpack_int4(packed: Tensor, shape: tuple[int, int]) -> Tensor:
    """torch's packed int4 weight (from `_convert_weight_to_int4pack_for_cpu`) -> q int32 [N, K] in [0, 15], by
    running its own kernel on the identity (exact: (q - 8) * 1 + 8 = q, integers in float32)."""
    n, k = shape
    sz = torch.stack([torch.ones(k // 32, n), torch.full((k // 32, n), 8.0)], dim=-1)  # scale 1, zero 8
    q = torch._weight_int4pack_mm_for_cpu(torch.eye(k), packed, 32, sz)  # [K, N] = q.T
    return q.t().round().to(torch.int32)


def linear_reference(
    x: Tensor,
    q: Tensor,
    scales: Tensor,
    scheme: str,
    group: int,
    shape: tuple[int, int],
    bias: Tensor | None = None,
    smooth: Tensor | None = None,
) -> Tensor:
    """The slow spec of `linear_int8` / `linear_w8a8` / `linear_int4` (+ bias), in float32, cast to x's dtype: int8
    and int4 multiply x by the dequantized weight; w8a8 first rounds x as `linear_w8a8` does (`quantize_tokens`,
    smooth included) and multiplies the rounded values by the dequantized int8 weight."""
    xf = x.float()
    if scheme == "w8a8":
        xq, step = quantize_tokens(x, smooth)
        xf = xq.float() * step
    y = xf @ dequantize(q, scales, scheme, group, shape).t()
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype)
