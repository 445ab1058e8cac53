"""Weight-only int8 and int4 base linears on the CPU: the quantization schemes, torch's kernels, a reference.

    q, scales = quantize(weight, "int8")           # weight [N, K] float -> int8 [N, K], float32 scales [N]
    y = KERNELS["int8"](x, q, scales.to(x.dtype), 0)  # x [T, K] float32 / bfloat16 -> [T, N] in x's dtype
    y_ref = linear_reference(x, q, scales.to(x.dtype), "int8", 0, (N, K))   # the dequantized weight's product

Schemes (chosen on SmolLM2-135M's shapes, scripts/ab_quant_linear.py; the numbers in docs/quant_linear.json):

- **int8**: symmetric, one scale per output channel: scale[n] = max_k |w[n, k]| / 127, q = round(w / scale)
  in [-127, 127]; w ~ q * scale. Kernel: `torch._weight_int8pack_mm` (ATen's CPU weight-only int8 GEMM: the
  int8 weight converted to the activation dtype in registers, float32 accumulation, the scale applied per column).
- **int4**: asymmetric groups of G (default INT4_GROUP) along K, one scale and one zero per group and output
  channel, in torch's int4 layout: q in [0, 15], w ~ (q - 8) * scale + zero with scale = (max - min) / 15 and
  zero = min + 8 * scale over the group. Kernel: `torch._weight_int4pack_mm_for_cpu` on the weight packed once by
  `torch._convert_weight_to_int4pack_for_cpu` (two values a byte).

The scales (and zeros) are kept in the activation dtype (the kernels take them so); the reference dequantizes with
those same stored values, so the kernel and the reference compute the same mathematical product and differ only
by the order of float32 sums (float32: a few 1e-6 relative; bfloat16: a rounding of the output, tests/test_quant.py).

Knows nothing about modules, adapters or models.
"""

from __future__ import annotations

import torch
from torch import Tensor

SCHEMES = ("int8", "int4")
INT4_GROUP = 32   # group size along K for int4 (module docstring; measured in docs/quant_linear.json)
_INNER_K_TILES = 1  # argument of torch's int4 packing on the CPU (its layout does not depend on it there)


def check_scheme(scheme: str | None) -> str | None:
    """`scheme` if it is None or one of SCHEMES; a ValueError naming the choices otherwise."""
    if scheme is not None and scheme not in SCHEMES:
        raise ValueError(f"quantization must be one of {list(SCHEMES)} (or none), got {scheme!r}")
    return scheme


def quantize_int8(weight: Tensor) -> tuple[Tensor, Tensor]:
    """weight [N, K] -> (q int8 [N, K], scale float32 [N]): symmetric per output channel, q in [-127, 127]."""
    w = weight.detach().float()
    scale = (w.abs().amax(dim=1) / 127).clamp(min=torch.finfo(torch.float32).tiny)   # an all-zero row: q = 0
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
    w = weight.detach().float().reshape(n, k // group, group)                    # [N, K / G, G]
    lo, hi = w.amin(dim=2), w.amax(dim=2)                                        # [N, K / G]
    scale = ((hi - lo) / 15).clamp(min=1e-6)
    zero = lo + 8 * scale
    q = torch.round((w - lo[..., None]) / scale[..., None]).clamp(0, 15).to(torch.int32).reshape(n, k)
    return q, torch.stack([scale, zero], dim=-1).transpose(0, 1).contiguous()    # [K / G, N, 2]


def dequantize_int4(q: Tensor, scale_zero: Tensor, group: int) -> Tensor:
    """(q [N, K], scale_zero [K / G, N, 2]) -> float32 [N, K] = (q - 8) * scale + zero per group."""
    sz = scale_zero.float().transpose(0, 1)                                      # [N, K / G, 2]
    n, k = q.shape
    w = (q.float().reshape(n, k // group, group) - 8) * sz[..., 0:1] + sz[..., 1:2]
    return w.reshape(n, k)


def quantize(weight: Tensor, scheme: str, group: int = INT4_GROUP) -> tuple[Tensor, Tensor]:
    """weight [N, K] (a float CPU matrix) -> (q, scales) as `linear` takes them, scales in float32 (cast them to the
    activations' dtype): int8 q [N, K] and scales [N]; int4 q packed by torch (uint8, two values a byte) and
    scales [K / G, N, 2] (scale, zero)."""
    check_scheme(scheme)
    if weight.dim() != 2 or weight.device.type != "cpu" or not weight.is_floating_point():
        raise ValueError(f"weight-only {scheme} quantizes float CPU matrices; got {weight.dtype} "
                         f"{tuple(weight.shape)} on {weight.device.type}")
    if scheme == "int8":
        return quantize_int8(weight)
    q, scale_zero = quantize_int4(weight, group)
    return torch._convert_weight_to_int4pack_for_cpu(q, _INNER_K_TILES), scale_zero


def dequantize(q: Tensor, scales: Tensor, scheme: str, group: int, shape: tuple[int, int]) -> Tensor:
    """What (q, scales) of `quantize` stand for: the float32 weight [N, K] the kernel multiplies by."""
    if scheme == "int8":
        return dequantize_int8(q, scales)
    return dequantize_int4(unpack_int4(q, shape), scales, group)


def linear_int8(x: Tensor, q: Tensor, scales: Tensor, group: int) -> Tensor:
    """x [T, K] @ (q * scales[:, None]).T -> [T, N] in x's dtype (scales in x's dtype; group unused)."""
    return torch._weight_int8pack_mm(x, q, scales)


def linear_int4(x: Tensor, q: Tensor, scales: Tensor, group: int) -> Tensor:
    """x [T, K] @ dequantize_int4(q, scales, group).T -> [T, N] in x's dtype (q packed, scales in x's dtype)."""
    return torch._weight_int4pack_mm_for_cpu(x, q, group, scales)


KERNELS = {"int8": linear_int8, "int4": linear_int4}   # scheme -> the kernel, chosen once per layer


def unpack_int4(packed: Tensor, shape: tuple[int, int]) -> Tensor:
    """torch's packed int4 weight (from `_convert_weight_to_int4pack_for_cpu`) -> q int32 [N, K] in [0, 15], by
    running its own kernel on the identity (exact: (q - 8) * 1 + 8 = q, integers in float32)."""
    n, k = shape
    sz = torch.stack([torch.ones(k // 32, n), torch.full((k // 32, n), 8.0)], dim=-1)   # scale 1, zero 8
    q = torch._weight_int4pack_mm_for_cpu(torch.eye(k), packed, 32, sz)                 # [K, N] = q.T
    return q.t().round().to(torch.int32)


def linear_reference(x: Tensor, q: Tensor, scales: Tensor, scheme: str, group: int, shape: tuple[int, int],
                     bias: Tensor | None = None) -> Tensor:
    """The slow spec of KERNELS[scheme] (+ bias): dequantize to float32, multiply in float32, cast to x's dtype."""
    y = x.float() @ dequantize(q, scales, scheme, group, shape).t()
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype)
