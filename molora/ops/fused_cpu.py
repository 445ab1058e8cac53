"""The `fused` backend: per-token LoRA in one C++ pass over the tokens, no gathers, no masked work (CPU).

Each routed token goes through its own slot only (the work of one adapter, as sort_group), but nothing is
copied: a token's row of x is read where it lies and its delta is added into its row of `out` in place.
Tokens are taken in sort_group's slot order (`SlotGroups`), in blocks of up to 4 of one slot:

    h[i]    = A[s] @ x[t_i]          [R]       16-lane dot products, 4 tokens x 4 ranks of accumulators
    h[i]   *= scale[s] (* weight)
    out[t_i] += Bt[s].T @ h[i]       [D_out]   64-column tiles held in registers across the R ranks

Blocks run in parallel on torch's intra-op threads (each token appears once when k = 1, so no two
threads write one row). Written with GCC vector extensions (16-float vectors: AVX-512 where the CPU has
it, split into narrower ones elsewhere) in `csrc/` (package data); compiled on first use by
`torch.utils.cpp_extension.load` into torch's extension cache (about a minute; `-O3 -march=native`) under a name
keyed by `build_key()`: a hash of the sources, the flags, torch's and Python's versions and the CPU's feature flags,
so an edited source builds anew and two checkouts never share a build. Without a C++ compiler molora says so once
(a log warning) and runs the eager backends.

Why: on the dev CPU the eager backends pay either S times the work (stacked_mask) or row gathers and
scatters that are memory-bound (sort_group); `molora.bench.ops` measures this one against both and
against a single adapter.

Works in float32 and in bfloat16 (bf16 values widen exactly to float32 on load, every sum runs in
float32, each output rounds once to bf16 on store). On a CPU with AVX512_BF16 the bf16 path multiplies x by
A with the bf16 dot-product instruction (exact products, float32 sums, no widening), widens a slot's B once
per thread rather than once per block, and rounds outputs with the CPU's conversion instruction: 0.61x, 0.57x
and 0.69x the time of widening everything in software at T = 1024 (d_in x d_out 576 x 1536, 1536 x 576,
1000 x 200; S = 4, r = 16, 2 threads).

The same build holds `paged_decode` (and `paged_decode_rows`, the same on rows of a whole step): attention of one
new token per sequence over its context read in place from the paged KV cache (`ModelRunner` uses it for decode
tokens), and the runner's per-layer glue, one call each where torch needs 4-10 small ops: `add_rms_norm` (the
residual add and transformers' RMSNorm), `rope_write` (RoPE, bit for bit as torch computes it, and the K/V cache
write) and `silu_mul` (SiLU(gate) * up). Measured on the bench's routed batch-32 decode step (SmolLM2-135M, 2
threads): with them (and the runner's and routed linears' other cuts) a step records about 2900 profiler events
instead of about 5500 (6300 in bf16), and runs 5-7% faster (interleaved A/B in one process).

`run_block` runs a whole Llama-shaped decoder block of a decode step (norms, packed GEMMs, LoRA, RoPE and
cache write, attention, SiLU * up) as one call of the kernels below, in the order molora.model.runner calls them one
by one (its docstring: when, and what it saved).

And two GEMMs for few rows on weights packed once, which the runner's linears run through molora.ops.packed (its
docstring: the measurements): `linear_panels` in float32 (panels of 16 columns) and `linear_amx` in bfloat16 (on the
CPU's AMX tile unit, where it has one; the weight in the layout of the tiles).

Limits (callers fall back to the eager backends): CPU, float32 or bfloat16, top-1 routing (k = 1), no autograd, B
stored slot-major (B.transpose(1, 2) contiguous, as `LoRASlots` keeps it), x and out with unit column
stride. `available()` says whether the extension built; MOLORA_FUSED=0 turns it off.

Every entry point of the extension checks its inputs before it reads or writes (csrc/checks.h: devices, dtypes, ranks,
shapes, strides, and each index tensor's values in one pass before the kernel's loops: tokens, cache rows, positions,
block ids, context lengths) and raises a RuntimeError naming the function, the argument and the value; a bug upstream
cannot turn into a write past a buffer (tests/test_kernel_checks.py: one test per check).
"""

from __future__ import annotations

import hashlib
import logging
import os
import platform
import shutil
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from pathlib import Path
from types import ModuleType
from typing import Any

import torch
from torch import Tensor

from molora.ops.device import ThreadFlag
from molora.ops.gather import LoRABackendError
from molora.ops.lora import SlotGroups

log = logging.getLogger("molora.ops")

_CSRC = Path(__file__).parent / "csrc"  # the kernels' sources (package data), one file per kernel family
# what the compiler is given, as one extension; common.h (shared types, entry points) and checks.h are included
_SOURCES: tuple[Path, ...] = tuple(
    _CSRC / f
    for f in (
        "lora_fused.cpp",  # the fused per-token LoRA kernel (lora_fused_, bf16_dot)
        "paged_decode.cpp",  # decode attention over the paged KV cache (paged_decode, paged_decode_rows)
        "glue.cpp",  # add_rms_norm, rope_write, silu_mul
        "linear_panels.cpp",  # float32 GEMM on panels
        "linear_amx.cpp",  # bfloat16 GEMM on AMX tiles (amx_ready, linear_amx)
        "decode_block.cpp",  # a whole decoder block of a decode step (BoundBlock)
        "greedy.cpp",  # greedy_rows
        "bindings.cpp",
    )
)  # the Python module
# -fopenmp: at::parallel_for runs on torch's OpenMP threads (torch's own libgomp.so.1, already loaded, serves this
# library too); without it the kernel silently runs on one thread.
_CFLAGS = ("-O3", "-march=native", "-ffp-contract=fast", "-fopenmp")
_LDFLAGS = ("-fopenmp",)
DTYPES: tuple[torch.dtype, ...] = (torch.float32, torch.bfloat16)  # what the kernel computes in

_lock = threading.Lock()
_NO_WEIGHTS = torch.empty(0)  # the kernel's "every pair weighs 1"
_module: ModuleType | None = None  # the built extension (`_load`)
_failed: str | None = None


def build_key() -> str:
    """The extension's build key: a hash of every file in csrc/ (names and contents), the compile and link flags,
    torch's and Python's versions, this CPU's feature flags (-march=native) and where csrc/ lies. The build lives in
    torch's extension cache under `molora_kernels_<key>`: editing a source builds anew, and two checkouts never share
    (or overwrite) one build; even with equal sources they would only take turns rebuilding it, since torch's ninja
    file names the sources by path."""
    h = hashlib.sha256(str(_CSRC.resolve()).encode() + b"\0")
    for path in sorted(_CSRC.iterdir()):
        if path.is_file():
            h.update(path.name.encode() + b"\0" + path.read_bytes() + b"\0")
    h.update(repr((_CFLAGS, _LDFLAGS, torch.__version__, sys.version_info[:2], _cpu_tag())).encode())
    return h.hexdigest()[:16]


def _load() -> ModuleType | None:
    """The compiled extension, building it on first use; None (reason logged once) if it cannot be built."""
    global _module, _failed
    if _module is not None or _failed is not None:
        return _module
    with _lock:
        if _module is not None or _failed is not None:
            return _module
        if os.environ.get("MOLORA_FUSED", "1") == "0":
            _failed = "turned off by MOLORA_FUSED=0"
            return None
        compiler = os.environ.get("CXX", "c++")  # what torch.utils.cpp_extension compiles with
        if shutil.which(compiler) is None:
            _failed = f"no C++ compiler: {compiler!r} (CXX, else c++) is not on PATH"
            log.warning(
                "molora's C++ CPU kernels unavailable (%s); using the eager backends. Install a C++ compiler "
                "(g++) to build them, or set MOLORA_FUSED=0 to silence this",
                _failed,
            )
            return None
        try:
            from torch.utils.cpp_extension import load

            name = f"molora_kernels_{build_key()}"
            log.info(
                "loading molora's C++ CPU kernels (%s; the first time on a machine it builds: about a minute)", name
            )
            venv_bin = os.path.dirname(sys.executable)  # a venv's ninja, when the venv is not activated
            if venv_bin not in os.environ.get("PATH", "").split(os.pathsep):
                os.environ["PATH"] = venv_bin + os.pathsep + os.environ.get("PATH", "")
            _module = load(
                name=name,
                sources=[str(p) for p in _SOURCES],
                extra_include_paths=[str(_CSRC)],
                extra_cflags=list(_CFLAGS),
                extra_ldflags=list(_LDFLAGS),
                verbose=False,
            )
        except Exception as e:  # no compiler, no ninja, unsupported platform: the eager backends remain
            _failed = f"{type(e).__name__}: {str(e).strip().splitlines()[-1] if str(e).strip() else ''}"
            log.warning(
                "molora's C++ CPU kernels unavailable (%s); using the eager backends. Install a C++ compiler "
                "(g++) and ninja to build them, or set MOLORA_FUSED=0 to silence this",
                _failed,
            )
        return _module


def _cpu_tag() -> str:
    """A short hash of this CPU's feature flags: a build with -march=native is only reused on a like CPU."""
    try:
        with open("/proc/cpuinfo") as f:
            flags = next(line for line in f if line.startswith("flags"))
    except (OSError, StopIteration):
        flags = platform.processor() or platform.machine()
    return hashlib.sha1(flags.encode()).hexdigest()[:8]


# Within `with suspended():` (on this thread) every kernel of this module reports that it cannot run, so callers
# take their torch fallbacks: a step recorded op by op (tests/graph_emulator.py) must run only torch ops.
suspended = ThreadFlag()


def _ready() -> ModuleType | None:
    """The extension where it may run now (built and not `suspended`), else None."""
    return None if suspended.on else _load()


def _ext() -> ModuleType:
    """The extension, for the kernels' wrappers once `_ready()` (or `glue_supports`) said it may run."""
    assert _module is not None, "molora's CPU kernels are not built; check _ready() first"
    return _module


def available() -> bool:
    """Whether the fused CPU kernel is built (builds it on first call) and not `suspended`."""
    return _ready() is not None


def bf16_dot() -> bool:
    """Whether the built kernel runs bfloat16 on the CPU's bf16 dot-product instruction (AVX512_BF16);
    False where it widens to float32 in software, or where the kernel is not built."""
    mod = _ready()
    return mod is not None and bool(mod.bf16_dot())


def unavailable_reason() -> str | None:
    """Why the kernel could not be built (None if it was, or was never tried)."""
    return _failed


def supports(x: Tensor, B: Tensor, top_k: int) -> bool:
    """Whether a call with these tensors can run fused (module docstring: Limits); no build, no data read."""
    return (
        x.device.type == "cpu"
        and x.dtype in DTYPES
        and top_k == 1
        and x.stride(-1) == 1
        and B.transpose(1, 2).is_contiguous()
        and not torch.is_grad_enabled()
    )


def fused_apply(g: SlotGroups, x: Tensor, A: Tensor, B: Tensor, scale: Tensor, out: Tensor | None = None) -> Tensor:
    """The fused backend on sort_group's metadata (k = 1): out [T, D_out] += each token's own delta.
    out None: a new zero-initialised tensor is returned. Call only where `supports` and `available`."""
    mod = _ready()
    if mod is None:
        raise LoRABackendError(
            f"backend 'fused' needs its C++ kernel, which could not be built here ({_failed}). "
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
    with _profiled("molora::lora_fused"):
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
    mod = _ready()
    if mod is None or torch.is_grad_enabled():
        return False
    with _profiled("molora::lora_fused"):
        return mod.lora_fused_(out, x, A, B, tok, scale, _NO_WEIGHTS if weight is None else weight, counts)


def paged_decode(
    q: Tensor, kc: Tensor, vc: Tensor, tables: Tensor, ctx: Tensor, block_size: int, scale: float, window: int | None
) -> Tensor | None:
    """Decode attention over the paged cache without gathering it: q [Bd, H, hd] (one token per sequence),
    kc / vc [N, Hkv, hd] (rows = block * block_size + offset), tables [Bd, nb] block ids, ctx [Bd] context
    lengths (the new token's key already written) -> [Bd, H, hd]; a sliding `window` keeps the last `window`
    keys. None when the kernel cannot run these (not built, not CPU, another dtype, autograd on): the caller
    gathers and uses SDPA. Scores and sums in float32; one task per sequence (all its kv heads) where
    sequences outnumber twice the threads, else per (sequence, kv head)."""
    if (
        q.device.type != "cpu"
        or q.dtype not in DTYPES
        or kc.dtype != q.dtype
        or torch.is_grad_enabled()
        or _ready() is None
    ):
        return None
    out = torch.empty_like(q)
    with _profiled("molora::paged_decode"):
        _ext().paged_decode(
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
        or not (kc.dtype == vc.dtype == out.dtype == q.dtype)
        or not (tables.dtype == ctx.dtype == rows.dtype == torch.long)
    ):
        return False
    with _profiled("molora::paged_decode"):
        _ext().paged_decode_rows(
            out, q, kc, vc, tables, ctx, rows, int(block_size), float(scale), 0 if window is None else int(window)
        )
    return True


# ------------------------------------------------------------------------------------ decode-layer glue
# One C++ call each for the runner's small per-layer operations (module docstring of molora.model.runner):
# float32 or bfloat16 CPU tensors, autograd off, rows with unit column stride. Each returns False (or None)
# when it cannot run, and the caller does the same work in torch ops.


def glue_supports(x: Tensor) -> bool:
    """Whether the glue kernels can run on tensors like x (CPU, float32 or bfloat16, no autograd, built)."""
    return x.device.type == "cpu" and x.dtype in DTYPES and not torch.is_grad_enabled() and _ready() is not None


def add_rms_norm(h: Tensor, delta: Tensor | None, weight: Tensor, eps: float) -> Tensor | None:
    """h [T, D] += delta (in place, rounded as torch's add), then transformers' RMSNorm of h (mean of squares in
    float32, x * rsqrt(mean + eps) rounded to h's dtype, times weight) -> a new [T, D]. None: cannot run.

    Equal to transformers' bit for bit in both dtypes: the mean of squares is summed in the order of torch's own
    reduction (csrc: torch_mean_sq, with the lane count `_sum_lanes` finds), in one call. It matters in bf16, where a
    last-bit difference in the float32 mean flips the bf16 rounding of about 1 value in 10^6, enough to change
    greedy outputs (11 of the engine bench's 32 requests, measured). Where no lane count reproduces torch's sum, the
    mean comes from torch's reduction itself (the add and four more ops per call, as bf16 always did before)."""
    if not glue_supports(h) or weight.dtype != h.dtype or (delta is not None and delta.dtype != h.dtype):
        return None
    out = torch.empty(h.shape, dtype=h.dtype)
    lanes, var = _sum_lanes(), _EMPTY
    if not lanes:
        if delta is not None:
            h.add_(delta)
            delta = None
        var = h.float().pow(2).mean(-1)  # [T] as LlamaRMSNorm computes it (h stays)
    with _profiled("molora::add_rms_norm"):
        _ext().add_rms_norm(h, _EMPTY if delta is None else delta, weight, out, float(eps), var, lanes)
    return out


_lanes: int | None = None


def _sum_lanes() -> int:
    """The vector width (8 or 16 lanes) with which the kernel's mean of squares equals torch's
    x.float().pow(2).mean(-1) on this machine, bit for bit, on test rows of both dtypes and widths that meet every
    branch of its reduction; 0 if neither does (then add_rms_norm takes the mean from torch). Found once."""
    global _lanes
    if _lanes is None:
        g = torch.Generator().manual_seed(0)
        rows = [(torch.randn(8, n, generator=g) * 3).to(dtype) for n in (7, 576, 1030, 4100, 20000) for dtype in DTYPES]

        def matches(x: Tensor, lanes: int) -> bool:  # the kernel's norm (weight 1) equals torch's formula
            got = torch.empty_like(x)
            _ext().add_rms_norm(x, _EMPTY, torch.ones(x.shape[1], dtype=x.dtype), got, 1e-6, _EMPTY, lanes)
            xf = x.float()
            return torch.equal(got, (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-6)).to(x.dtype))

        _lanes = next((lanes for lanes in (16, 8) if all(matches(x, lanes) for x in rows)), 0)
        if not _lanes:
            log.info("add_rms_norm: torch's sum order not reproduced here; the mean of squares comes from torch")
    return _lanes


def rope_write(
    q: Tensor, k: Tensor, v: Tensor, cos: Tensor, sin: Tensor, positions: Tensor, rows: Tensor, kc: Tensor, vc: Tensor
) -> bool:
    """RoPE on q [T, H, hd] and k [T, Hkv, hd] in place, bit for bit as x * cos + rotate_half(x) * sin in torch
    (cos, sin [P, hd] tables, row = position), then k and v [T, Hkv, hd] into the cache rows `rows` [T] of
    kc, vc [N, Hkv, hd]. False: cannot run (nothing done)."""
    if (
        not glue_supports(q)
        or not (k.dtype == v.dtype == cos.dtype == sin.dtype == kc.dtype == vc.dtype == q.dtype)
        or positions.dtype != torch.long
        or rows.dtype != torch.long
    ):
        return False
    with _profiled("molora::rope_write"):
        _ext().rope_write(q, k, v, cos, sin, positions, rows, kc, vc)
    return True


def silu_mul(g: Tensor, u: Tensor) -> bool:
    """g [T, D] = silu(g) * u in place (each rounded to g's dtype, as torch's silu then mul). False: cannot run."""
    if not glue_supports(g) or u.dtype != g.dtype:
        return False
    with _profiled("molora::silu_mul"):
        _ext().silu_mul(g, u)
    return True


def greedy_rows(logits: Tensor) -> tuple[Tensor, Tensor] | None:
    """(ids [B] int64, finite [B] bool) of logits [B, V]: each row's greedy pick, the index of its first maximum (as
    torch's max(-1).indices gives it), and whether all its values are finite; one pass in C++ where torch needs a
    max and a sum. None: cannot run (the caller uses torch)."""
    if not glue_supports(logits) or logits.dim() != 2 or logits.stride(1) != 1 or logits.shape[1] == 0:
        return None
    ids = torch.empty(logits.shape[0], dtype=torch.long)
    finite = torch.empty(logits.shape[0], dtype=torch.bool)
    _ext().greedy_rows(logits, ids, finite)
    return ids, finite


def linear_panels(x: Tensor, panels: Tensor, bias: Tensor | None) -> Tensor | None:
    """x [M, K] @ W.T (+ bias) -> a new [M, N], float32, with W packed as panels [N / 16, K, 16]
    (molora.ops.packed.panels). None: cannot run (not built, not float32 CPU, autograd on)."""
    if not glue_supports(x) or x.dtype != torch.float32 or x.dim() != 2:
        return None
    return _packed_gemm("linear_panels", x, panels, bias, _EMPTY)


def amx() -> bool:
    """Whether the built kernel runs bfloat16 GEMMs on the CPU's AMX tiles here (`linear_amx`): compiled for a CPU
    with AMX-BF16 and granted the tile state by the OS; False where not built or `suspended`."""
    mod = _ready()
    return mod is not None and bool(mod.amx_ready())


def linear_amx(x: Tensor, tiles: Tensor, bias: Tensor | None) -> Tensor | None:
    """x [M, K] @ W.T (+ bias) -> a new [M, N], bfloat16, on AMX tiles, with W packed as tiles
    [N / 16, K / 32, 16, 32] (molora.ops.packed.tiles). None: cannot run (not built with AMX, not bfloat16 CPU,
    autograd on, `suspended`)."""
    if not glue_supports(x) or x.dtype != torch.bfloat16 or x.dim() != 2 or not _ext().amx_ready():
        return None
    return _packed_gemm("linear_amx", x, tiles, bias, _EMPTY_BF16)


def _packed_gemm(kernel: str, x: Tensor, packed: Tensor, bias: Tensor | None, no_bias: Tensor) -> Tensor:
    """y [M, 16 * packed.shape[0]] in x's dtype = the extension's `kernel` (linear_panels, linear_amx) on x's rows
    with unit column stride and a weight packed 16 output columns per leading index; `no_bias`: the empty tensor
    of x's dtype that stands for no bias."""
    if x.stride(1) != 1:
        x = x.contiguous()
    y = torch.empty(x.shape[0], packed.shape[0] * 16, dtype=x.dtype)
    with _profiled(f"molora::{kernel}"):
        getattr(_module, kernel)(y, x, packed, no_bias if bias is None else bias)
    return y


_EMPTY = torch.empty(0)
_EMPTY_BF16 = torch.empty(0, dtype=torch.bfloat16)
_EMPTY_LONG = torch.empty(0, dtype=torch.long)
_EMPTY_F64 = torch.empty(0, dtype=torch.float64)
_BLOCK_KERNELS = (
    None,
    "molora::lora_fused",
    "molora::add_rms_norm",
    "molora::rope_write",
    "molora::paged_decode",
    "molora::silu_mul",
)  # csrc decode_block's clock slots (0: the GEMM kernel, named by its form)


def norm_lanes() -> int:
    """The lane count with which the kernel's RMSNorm reproduces torch's mean of squares here (`add_rms_norm`);
    0 where none does or the kernel cannot run now."""
    return 0 if _ready() is None else _sum_lanes()


def bind_block(
    norms: tuple[Tensor, Tensor],
    eps: float,
    lanes: int,
    linears: list[tuple],
    heads: tuple[int, int, int],
    rope: tuple[Tensor, Tensor],
    cache: tuple,
    watched: list[Tensor],
) -> Any:
    """One Llama-shaped decoder block's step-invariant arguments bound in C++ (csrc BoundBlock), for `run_block`.

    norms: the two RMSNorm weights (one eps; lanes = `norm_lanes()`, nonzero); linears: for q, k, v, o, gate, up,
    down, (packed weight as `PackedLinear.kernel_weight` gives it, bias or None, and A, B, scale as
    `RoutedLoRALinear.kernel_operands` gives them, or three Nones where no adapter adds to it); heads (H, Hkv,
    head_dim); rope: the cos, sin tables [P, hd]; cache (kc, vc [N, Hkv, hd], block size, scaling, window or None);
    watched: the tensors whose storage or in-place writes mean the binding no longer holds (`run_block` then returns
    None). Call only where the kernels can run (`available()`, and `amx()` for bfloat16 weights)."""
    no_bias = _EMPTY_BF16 if norms[0].dtype == torch.bfloat16 else _EMPTY
    P, bias, A, B, scale = ([], [], [], [], [])
    for w, b, a, bb, sc in linears:
        P.append(w)
        bias.append(no_bias if b is None else b)
        A.append(_EMPTY if a is None else a)
        B.append(_EMPTY if bb is None else bb)
        scale.append(_EMPTY if sc is None else sc)
    kc, vc, block_size, scaling, window = cache
    return _ext().BoundBlock(
        P,
        bias,
        A,
        B,
        scale,
        norms[0],
        norms[1],
        float(eps),
        int(lanes),
        *heads,
        rope[0],
        rope[1],
        kc,
        vc,
        int(block_size),
        float(scaling),
        0 if window is None else int(window),
        watched,
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
) -> Tensor | None:
    """A bound block (`bind_block`) on one decode step as one C++ call (csrc decode_block: the kernels of this
    module in the order and on the arguments molora.model.runner's per-kernel path gives them, equal to it bit for
    bit): h [T, D] += delta, attention, h += its output, in place; returns the MLP output [T, D]. step: the fused LoRA
    kernel's (tok, weight, counts) of the step's routing, or () for no deltas; positions, write_rows [T], and the
    `Decode` tables, context lengths and rows of the step. None, nothing done: a watched tensor changed since the
    bind (bind again). Shapes that disagree raise a RuntimeError from the kernels."""
    clock = _EMPTY_F64 if _clock is None else torch.zeros(6, dtype=torch.float64)
    tok, weight, counts = step if step else (_EMPTY_LONG, None, [])
    out = bound.run(
        h,
        _EMPTY if delta is None else delta,
        bool(step),
        tok,
        _NO_WEIGHTS if weight is None else weight,
        counts,
        positions,
        write_rows,
        tables,
        ctx,
        rows,
        clock,
    )
    if _clock is not None and out is not None:
        gemm = "molora::linear_amx" if h.dtype == torch.bfloat16 else "molora::linear_panels"
        for name, t in zip(_BLOCK_KERNELS, clock.tolist()):
            name = name or gemm
            _clock[name] = _clock.get(name, 0.0) + t
    return out


def _profiled(name: str) -> Any:
    """A torch.profiler range named `name` while a profiler runs (the kernels are not aten ops, so a profile
    would not see them otherwise), else the call's wall time into `kernel_clock`'s dict while one is open, else
    nothing."""
    if torch.autograd.profiler._is_profiler_enabled:
        return torch.profiler.record_function(name)
    return nullcontext() if _clock is None else _Timed(name, _clock)


_clock: dict[str, float] | None = None  # `kernel_clock`'s dict while its block runs


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
    """Within the block, the wall time of every call of this module's kernels is summed per name (the profiler
    range names, e.g. "molora::linear_panels") into the dict it yields: their share of a step measured without
    torch.profiler, whose own cost per event inflates both the kernels' self time and the step's wall time (the
    bench's decode-step kernel share). Costs two clock reads per call."""
    global _clock
    before, _clock = _clock, {}
    try:
        yield _clock
    finally:
        _clock = before
