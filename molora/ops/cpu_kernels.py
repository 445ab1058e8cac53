"""The decode path's C++ CPU kernels, as Python calls of `torch.ops.molora.*` (built by molora.ops.kernel_build).

`paged_decode` (and `paged_decode_rows`, the same on rows of a whole step): attention of one new token per sequence
over its context read in place from the paged KV cache (`ModelRunner` uses it for decode tokens), and the runner's
per-layer glue, one call each where torch needs 4-10 small ops: `add_rms_norm` (the residual add and transformers'
RMSNorm), `rope_write` (RoPE, bit for bit as torch computes it, and the K/V cache write) and `silu_mul`
(SiLU(gate) * up). Measured on the bench's routed batch-32 decode step (SmolLM2-135M, 2 threads): with them (and the
runner's and routed linears' other cuts) a step records about 2900 profiler events instead of about 5500 (6300 in
bf16), and runs 5-7% faster (interleaved A/B in one process).

`run_block` runs a whole Llama-shaped decoder block of a decode step (norms, packed GEMMs, LoRA, RoPE and cache
write, attention, SiLU * up) as one call of the kernels below (a `torch.classes.molora.BoundBlock` bound once by
`bind_block`), in the order molora.model.block calls them one by one.

And two GEMMs for few rows on weights packed once, which the runner's linears run through molora.ops.packed (its
docstring: the measurements): `linear_panels` in float32 (panels of 16 columns) and `linear_amx` in bfloat16 (on the
CPU's AMX tile unit, where it has one; the weight in the layout of the tiles); and two weight-only int8 GEMMs that
molora.ops.quant runs (its docstring: the measurements): `linear_w8` (float32 or bfloat16 activations, the int8
weight as stored) and `linear_amx_w8` (bfloat16 on AMX, the int8 weight in the tiles' layout).

Each family stays because the engine bench runs at least 1.15x slower without it, measured side by side against what
torch gives in its place (tools/kernel_keep.py; docs/kernel_keep_fp32.json, docs/kernel_keep_bf16.json, rendered in
docs/benchmarks.md). A greedy-pick kernel (each row's argmax and finiteness in one pass) measured about 1.0x there
and was deleted; the engine takes torch's max.

Each wrapper answers None or False (nothing done) where the kernel cannot run these tensors (not built, `suspended`,
its family turned off by MOLORA_KERNELS_OFF, not CPU, another dtype, autograd on); the caller then does the same
work in torch ops. Shapes that disagree raise the kernel's RuntimeError (csrc/checks.h). `kernel_clock` times the
kernels' calls without torch.profiler; under the profiler each call is an event named as its op ("molora::silu_mul").
"""

from __future__ import annotations

import functools
import time
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from typing import Any

import torch
from torch import Tensor

from molora.ops.kernel_build import off, ops, ready

DTYPES: tuple[torch.dtype, ...] = (torch.float32, torch.bfloat16)  # what the kernels compute in

_EMPTY = torch.empty(0)  # "none" for an optional tensor argument (no delta, no bias, no weights)
_EMPTY_BF16 = torch.empty(0, dtype=torch.bfloat16)
_EMPTY_LONG = torch.empty(0, dtype=torch.long)
_EMPTY_F64 = torch.empty(0, dtype=torch.float64)
_NO_TORCH_FUNCTION = torch._C.DisableTorchFunctionSubclass


def glue_supports(x: Tensor) -> bool:
    """Whether the glue kernels can run on tensors like x (CPU, float32 or bfloat16, no autograd, built)."""
    return x.device.type == "cpu" and x.dtype in DTYPES and not torch.is_grad_enabled() and ready() is not None


def block_supports(x: Tensor) -> bool:
    """Whether a decode step's blocks may run as one call (`run_block`) on rows like x: the glue can run, and
    none of the families the block runs inside is turned off (MOLORA_KERNELS_OFF: block, glue, paged, lora)."""
    return glue_supports(x) and not any(off(f) for f in ("block", "glue", "paged", "lora"))


def panels_ready() -> bool:
    """Whether float32 weights may be packed for `linear_panels` here: built, its family not turned off, and built
    for a CPU with AVX-512 (`panels_fit`: its register tile spills without it; molora.ops.packed: the measurement)."""
    mod = ready()
    return mod is not None and not off("panels") and bool(mod.panels_fit())


def paged_decode(
    q: Tensor, kc: Tensor, vc: Tensor, tables: Tensor, ctx: Tensor, block_size: int, scale: float, window: int | None
) -> Tensor | None:
    """Decode attention over the paged cache without gathering it: q [Bd, H, hd] (one token per sequence),
    kc / vc [N, Hkv, hd] (rows = block * block_size + offset), tables [Bd, nb] block ids, ctx [Bd] context
    lengths (the new token's key already written) -> [Bd, H, hd]; a sliding `window` keeps the last `window`
    keys. None when the kernel cannot run these (not built, not CPU, another dtype, autograd on): the caller
    gathers and uses SDPA. Scores and sums in float32; one task per sequence (all its kv heads) where
    sequences outnumber twice the threads, else per (sequence, kv head)."""
    if q.device.type != "cpu" or q.dtype not in DTYPES or kc.dtype != q.dtype or torch.is_grad_enabled():
        return None
    if ready() is None or off("paged"):
        return None
    out = torch.empty_like(q)
    with _profiled("molora::paged_decode"):
        ops().paged_decode(
            out,
            q.contiguous(),
            kc,
            vc,
            tables,
            ctx,
            int(block_size),
            float(scale),
            0 if window is None else int(window),
        )
    return out


def paged_decode_rows(
    out: Tensor,
    q: Tensor,
    kc: Tensor,
    vc: Tensor,
    tables: Tensor,
    ctx: Tensor,
    rows: Tensor,
    block_size: int,
    scale: float,
    window: int | None,
) -> bool:
    """`paged_decode` on rows of a whole step, in place: q, out [T, H, hd] (heads contiguous, any row stride,
    e.g. views into a wider projection output), sequence b's query and output at row rows[b]; the other rows of
    `out` are left alone. False (nothing done) where the kernel cannot run these; the caller falls back."""
    if (
        not glue_supports(q)
        or off("paged")
        or not (kc.dtype == vc.dtype == out.dtype == q.dtype)
        or not (tables.dtype == ctx.dtype == rows.dtype == torch.long)
    ):
        return False
    with _profiled("molora::paged_decode_rows"):
        ops().paged_decode_rows(
            out, q, kc, vc, tables, ctx, rows, int(block_size), float(scale), 0 if window is None else int(window)
        )
    return True


def add_rms_norm(h: Tensor, delta: Tensor | None, weight: Tensor, eps: float) -> Tensor | None:
    """h [T, D] += delta (in place, rounded as torch's add), then transformers' RMSNorm of h (mean of squares in
    float32, x * rsqrt(mean + eps) rounded to h's dtype, times weight) -> a new [T, D]. None: cannot run.

    The mean of squares is the float32 nearest the exact mean (squares summed in float64, csrc/glue.cpp mean_sq), not
    torch's float32 sum in torch's own order: the output is within about one float32 ulp of transformers' in float32
    and, in bfloat16, equal to it but for an element now and then one bf16 ulp apart (where the two means round it
    differently); tests/test_ops.py holds it to these tolerances, and docs/norm_agreement.json records what it changes
    in greedy outputs against transformers on real prompts."""
    if not glue_supports(h) or off("glue") or weight.dtype != h.dtype or (delta is not None and delta.dtype != h.dtype):
        return None
    out = torch.empty(h.shape, dtype=h.dtype)
    with _profiled("molora::add_rms_norm"):
        ops().add_rms_norm(h, _EMPTY if delta is None else delta, weight, out, float(eps))
    return out


def rope_write(
    q: Tensor, k: Tensor, v: Tensor, cos: Tensor, sin: Tensor, positions: Tensor, rows: Tensor, kc: Tensor, vc: Tensor
) -> bool:
    """RoPE on q [T, H, hd] and k [T, Hkv, hd] in place, bit for bit as x * cos + rotate_half(x) * sin in torch
    (cos, sin [P, hd] tables, row = position), then k and v [T, Hkv, hd] into the cache rows `rows` [T] of
    kc, vc [N, Hkv, hd]. False: cannot run (nothing done)."""
    if (
        not glue_supports(q)
        or off("glue")
        or not (k.dtype == v.dtype == cos.dtype == sin.dtype == kc.dtype == vc.dtype == q.dtype)
        or positions.dtype != torch.long
        or rows.dtype != torch.long
    ):
        return False
    with _profiled("molora::rope_write"):
        ops().rope_write(q, k, v, cos, sin, positions, rows, kc, vc)
    return True


def silu_mul(g: Tensor, u: Tensor) -> bool:
    """g [T, D] = silu(g) * u in place (each rounded to g's dtype, as torch's silu then mul). False: cannot run."""
    if not glue_supports(g) or off("glue") or u.dtype != g.dtype:
        return False
    with _profiled("molora::silu_mul"):
        ops().silu_mul(g, u)
    return True


def linear_panels(x: Tensor, panels: Tensor, bias: Tensor | None) -> Tensor | None:
    """x [M, K] @ W.T (+ bias) -> a new [M, N], float32, with W packed as panels [N / 16, K, 16]
    (molora.ops.packed.panels). None: cannot run (not built, not float32 CPU, autograd on)."""
    if not glue_supports(x) or off("panels") or x.dtype != torch.float32 or x.dim() != 2:
        return None
    return _packed_gemm("linear_panels", x, panels, bias, _EMPTY)


def amx() -> bool:
    """Whether the built kernel runs bfloat16 GEMMs on the CPU's AMX tiles here (`linear_amx`): compiled for a CPU
    with AMX-BF16 and granted the tile state by the OS; False where not built or `suspended`."""
    mod = ready()
    return mod is not None and not off("amx") and bool(mod.amx_ready())


def linear_amx(x: Tensor, tiles: Tensor, bias: Tensor | None) -> Tensor | None:
    """x [M, K] @ W.T (+ bias) -> a new [M, N], bfloat16, on AMX tiles, with W packed as tiles
    [N / 16, K / 32, 16, 32] (molora.ops.packed.tiles). None: cannot run (not built with AMX, not bfloat16 CPU,
    autograd on, `suspended`)."""
    if not glue_supports(x) or x.dtype != torch.bfloat16 or x.dim() != 2 or not amx():
        return None
    return _packed_gemm("linear_amx", x, tiles, bias, _EMPTY_BF16)


def w8_ready() -> bool:
    """Whether the weight-only int8 kernels (`linear_w8`, `linear_amx_w8`) may run here: built, not `suspended`, their
    family not turned off (MOLORA_KERNELS_OFF=w8)."""
    return ready() is not None and not off("w8")


def w8_amx() -> bool:
    """Whether `linear_amx_w8` runs here: `w8_ready` and the build runs on AMX tiles (what makes the int8 tiles'
    layout worth keeping: molora.model.quant_linear)."""
    mod = ready()
    return mod is not None and not off("w8") and bool(mod.amx_ready())


def linear_w8(x: Tensor, q: Tensor, scales: Tensor, bias: Tensor | None = None) -> Tensor | None:
    """Weight-only int8: x [M, K] @ (q * scales).T (+ bias) -> a new [M, N] in x's dtype (float32 or bfloat16), q int8
    [N, K] as it is stored, scales float32 [N] (csrc/linear_w8.cpp). None: cannot run (not built, `suspended`, turned
    off (MOLORA_KERNELS_OFF=w8), not a float CPU x, autograd on, K not a multiple of 16)."""
    if not glue_supports(x) or x.dim() != 2 or x.shape[1] % 16 or off("w8"):
        return None
    x = x if x.stride(1) == 1 else x.contiguous()
    y = torch.empty(x.shape[0], q.shape[0], dtype=x.dtype)
    with _profiled("molora::linear_w8"):
        ops().linear_w8(
            y, x, q, scales, bias if bias is not None else _EMPTY_BF16 if x.dtype == torch.bfloat16 else _EMPTY
        )
    return y


def quantize_rows(x: Tensor, smooth: Tensor | None = None) -> tuple[Tensor, Tensor] | None:
    """x [M, K] (float32 or bfloat16; times smooth [K] float32, if given) -> (xq int8 [M, K], step float32 [M, 1]),
    each row rounded over its own range, bit for bit molora.ops.quant.quantize_tokens in one pass
    (csrc/linear_w8a8.cpp). None: cannot run (not built, `suspended`, turned off (MOLORA_KERNELS_OFF=w8), not a
    float CPU x, autograd on)."""
    if not glue_supports(x) or x.dim() != 2 or off("w8"):
        return None
    x = x if x.stride(1) == 1 else x.contiguous()
    xq = torch.empty(x.shape, dtype=torch.int8)
    step = torch.empty(x.shape[0], 1)
    with _profiled("molora::quantize_rows_"):
        ops().quantize_rows_(xq, step, x, _EMPTY if smooth is None else smooth)
    return xq, step


def scale_rows(
    acc: Tensor, step: Tensor, scales: Tensor, dtype: torch.dtype, bias: Tensor | None = None
) -> Tensor | None:
    """acc int32 [M, N] -> a new [M, N] of `dtype` (float32 or bfloat16) = (acc * step[m]) * scales[n] (+ bias), one
    rounding to dtype: what torch computes as acc.float().mul_(step).mul_(scales), in one pass (csrc/linear_w8a8.cpp).
    None: cannot run."""
    if ready() is None or off("w8") or dtype not in DTYPES or torch.is_grad_enabled():
        return None
    y = torch.empty(acc.shape, dtype=dtype)
    no_bias = _EMPTY_BF16 if dtype == torch.bfloat16 else _EMPTY
    with _profiled("molora::scale_rows_"):
        ops().scale_rows_(y, acc, step, scales, no_bias if bias is None else bias)
    return y


def linear_amx_w8(x: Tensor, tiles: Tensor, scales: Tensor, bias: Tensor | None = None) -> Tensor | None:
    """Weight-only int8 on AMX: x [M, K] bfloat16 @ (q * scales).T (+ bias) -> a new [M, N] bfloat16, q int8 packed as
    tiles [N / 16, K / 32, 16, 32] (molora.ops.quant.tiles), scales float32 [N] (csrc/linear_amx.cpp). None: cannot
    run (not built with AMX, turned off (MOLORA_KERNELS_OFF=w8), not bfloat16 CPU, autograd on, `suspended`)."""
    if not glue_supports(x) or x.dtype != torch.bfloat16 or x.dim() != 2 or not w8_amx():
        return None
    x = x if x.stride(1) == 1 else x.contiguous()
    y = torch.empty(x.shape[0], tiles.shape[0] * 16, dtype=x.dtype)
    with _profiled("molora::linear_amx_w8"):
        ops().linear_amx_w8(y, x, tiles, scales, _EMPTY_BF16 if bias is None else bias)
    return y


def _packed_gemm(kernel: str, x: Tensor, packed: Tensor, bias: Tensor | None, no_bias: Tensor) -> Tensor:
    """y [M, 16 * packed.shape[0]] in x's dtype = the op `kernel` (linear_panels, linear_amx) on x's rows with unit
    column stride and a weight packed 16 output columns per leading index; `no_bias`: the empty tensor of x's dtype
    that stands for no bias."""
    if x.stride(1) != 1:
        x = x.contiguous()
    y = torch.empty(x.shape[0], packed.shape[0] * 16, dtype=x.dtype)
    with _profiled(f"molora::{kernel}"):
        getattr(ops(), kernel)(y, x, packed, no_bias if bias is None else bias)
    return y


# ------------------------------------------------------------------------------------ one decoder block, one call

_BLOCK_KERNELS = (
    None,
    "molora::lora_fused_",
    "molora::add_rms_norm",
    "molora::rope_write",
    "molora::paged_decode_rows",
    "molora::silu_mul",
)  # csrc decode_block's clock slots (0: the GEMM kernel, named by its form)


def bind_block(
    norms: tuple[Tensor, Tensor],
    eps: float,
    linears: list[tuple],
    heads: tuple[int, int, int],
    rope: tuple[Tensor, Tensor],
    cache: tuple,
    watched: list[Tensor],
    held: list[Tensor],
) -> Any:
    """One Llama-shaped decoder block's step-invariant arguments bound in C++ (a torch.classes.molora.BoundBlock),
    for `run_block`.

    norms: the two RMSNorm weights (one eps); linears: for q, k, v, o, gate, up,
    down, (packed weight as `PackedLinear.kernel_weight` gives it, bias or None, A, B, scale as
    `RoutedLoRALinear.kernel_operands` gives them, or three Nones where no adapter adds to it, and the weight's
    float32 scales where it is int8 (`QuantizedLinear.w8_operands`: int8 [N, K] or int8 tiles), else None);
    heads (H, Hkv, head_dim); rope: the cos, sin tables [P, hd]; cache (kc, vc [N, Hkv, hd], block size, scaling,
    window or None);
    watched: the tensors whose storage or in-place writes mean the binding no longer holds (`run_block` then returns
    None); held: tensors the bound block reads in place (the adapter slots, which loads write), whose storage alone
    must stay. Call only where the kernels can run (`ready()`, and `amx()` for bfloat16 weights)."""
    no_bias = _EMPTY_BF16 if norms[0].dtype == torch.bfloat16 else _EMPTY
    P, WS, bias, A, B, scale = ([], [], [], [], [], [])
    for w, b, a, bb, sc, ws in linears:
        P.append(w)
        WS.append(_EMPTY if ws is None else ws)
        bias.append(no_bias if b is None else b)
        A.append(_EMPTY if a is None else a)
        B.append(_EMPTY if bb is None else bb)
        scale.append(_EMPTY if sc is None else sc)
    kc, vc, block_size, scaling, window = cache
    ops()  # asserts the library is loaded (it registers the class)
    return torch.classes.molora.BoundBlock(
        P,
        WS,
        bias,
        A,
        B,
        scale,
        norms[0],
        norms[1],
        float(eps),
        *heads,
        rope[0],
        rope[1],
        kc,
        vc,
        int(block_size),
        float(scaling),
        0 if window is None else int(window),
        watched,
        held,
    )


def run_block(
    bound: Any,
    h: Tensor,
    delta: Tensor | None,
    step: tuple,
    positions: Tensor,
    write_rows: Tensor,
    tables: Tensor,
    ctx: Tensor,
    rows: Tensor,
    gemm: str | None = None,
) -> Tensor | None:
    """A bound block (`bind_block`) on one decode step as one C++ call (csrc decode_block: the kernels of this
    module in the order and on the arguments molora.model.block's per-kernel path gives them, equal to it bit for
    bit): h [T, D] += delta, attention, h += its output, in place; returns the MLP output [T, D]. step: the fused LoRA
    kernel's (tok, weight, counts) of the step's routing, or () for no deltas; positions, write_rows [T], and the
    `Decode` tables, context lengths and rows of the step. None, nothing done: a watched tensor changed since the
    bind (bind again). Shapes that disagree raise a RuntimeError from the kernels. gemm: the name `kernel_clock`
    gives the block's GEMM time (default: the float kernel of h's dtype)."""
    clock = _EMPTY_F64 if _clock is None else torch.zeros(6, dtype=torch.float64)
    tok, weight, counts = step if step else (_EMPTY_LONG, None, [])
    # torch's Python op call asks every argument for __torch_function__; asked of the bound block (a ScriptObject)
    # that lookup throws and catches two C++ exceptions, about 10 us a call here (measured: 26 against 16 us on a
    # tiny block). The arguments are plain tensors, so torch-function dispatch has nothing to find: it is off for
    # the call (torch's own Tensor.__torch_function__ uses this guard).
    with _NO_TORCH_FUNCTION(), _profiled("molora::run_block"):  # the whole call; its kernels also under their names
        out = _run_block_entry()(
            bound,
            h,
            _EMPTY if delta is None else delta,
            bool(step),
            tok,
            _EMPTY if weight is None else weight,
            counts,
            positions,
            write_rows,
            tables,
            ctx,
            rows,
            clock,
        )
    if _clock is not None and out is not None:
        gemm = gemm or ("molora::linear_amx" if h.dtype == torch.bfloat16 else "molora::linear_panels")
        for name, t in zip(_BLOCK_KERNELS, clock.tolist()):
            name = name or gemm
            _clock[name] = _clock.get(name, 0.0) + t
    return out


@functools.cache  # looked up once: the library is loaded once per process (ops() asserts it is)
def _run_block_entry() -> Any:
    """The run_block op's C++ entry: torch.ops.molora.run_block.default's `_op`, where torch has it. Calling the op
    through torch's Python wrappers first walks every argument looking for fake script objects (which only tracing
    makes; a bound block is never traced): 6.3 against 2.5 us a call here, 30 calls a decode step. Elsewhere the op
    itself."""
    op = ops().run_block
    return getattr(op.default, "_op", op)


# ------------------------------------------------------------------------------------ timing the kernels

_clock: dict[str, float] | None = None  # `kernel_clock`'s dict while its block runs
_UNTIMED = nullcontext()


def _profiled(name: str) -> Any:
    """The call's wall time into `kernel_clock`'s dict under `name` (the op's name, as torch.profiler names the
    call's event) while one is open, else nothing."""
    return _UNTIMED if _clock is None else _Timed(name, _clock)


class _Timed:
    __slots__ = ("clock", "name", "t0")

    def __init__(self, name: str, clock: dict[str, float]) -> None:
        self.name, self.clock = name, clock

    def __enter__(self) -> None:
        self.t0 = time.perf_counter()

    def __exit__(self, *exc: object) -> None:
        self.clock[self.name] = self.clock.get(self.name, 0.0) + time.perf_counter() - self.t0


@contextmanager
def kernel_clock() -> Iterator[dict[str, float]]:
    """Within the block, the wall time of every call of molora's CPU kernels is summed per op name (as torch.profiler
    names their events, e.g. "molora::linear_panels") into the dict it yields: their share of a step measured without
    torch.profiler, whose own cost per event inflates both the kernels' self time and the step's wall time (the
    bench's decode-step kernel share). Costs two clock reads per call."""
    global _clock
    before, _clock = _clock, {}
    try:
        yield _clock
    finally:
        _clock = before
