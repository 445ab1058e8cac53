"""The `fused` backend: per-token LoRA in one C++ pass over the tokens, no gathers, no masked work (CPU).

Each routed token goes through its own slot only (the work of one adapter, as sort_group), but nothing is
copied: a token's row of x is read where it lies and its delta is added into its row of `out` in place.
Tokens are taken in sort_group's slot order (`SlotGroups`), in blocks of up to 4 of one slot:

    h[i]    = A[s] @ x[t_i]          [R]       16-lane dot products, 4 tokens x 4 ranks of accumulators
    h[i]   *= scale[s] (* weight)
    out[t_i] += Bt[s].T @ h[i]       [D_out]   64-column tiles held in registers across the R ranks

Blocks run in parallel on torch's intra-op threads (each token appears once when k = 1, so no two
threads write one row). Written with GCC vector extensions (16-float vectors: AVX-512 where the CPU has
it, split into narrower ones elsewhere); compiled once per machine by `torch.utils.cpp_extension` into
torch's extension cache (about a minute; `-O3 -march=native`).

Why: on the dev CPU the eager backends pay either S times the work (stacked_mask) or row gathers and
scatters that are memory-bound (sort_group); `molora.bench.ops` measures this one against both and
against a single adapter.

Works in float32 and in bfloat16 (bf16 values widen exactly to float32 on load, every sum runs in
float32, each output rounds once to bf16 on store). On a CPU with AVX512_BF16 the bf16 path multiplies x by
A with the bf16 dot-product instruction (exact products, float32 sums, no widening), widens a slot's B once
per thread rather than once per block, and rounds outputs with the CPU's conversion instruction: 0.61x, 0.57x
and 0.69x the time of widening everything in software at T = 1024 (d_in x d_out 576 x 1536, 1536 x 576,
1000 x 200; S = 4, r = 16, 2 threads).

Limits (callers fall back to the eager backends): CPU, float32 or bfloat16, top-1 routing (k = 1), no autograd, B
stored slot-major (B.transpose(1, 2) contiguous, as `LoRASlots` keeps it), x and out with unit column
stride. `available()` says whether the extension built; MOLORA_FUSED=0 turns it off.
"""

from __future__ import annotations

import hashlib
import logging
import os
import platform
import sys
import threading

import torch
from torch import Tensor

from molora.ops.gather import LoRABackendError
from molora.ops.lora import SlotGroups

log = logging.getLogger("molora.ops")

_SOURCE = r"""
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <cstdint>
#include <cstring>
#include <type_traits>
#ifdef __AVX512BF16__
#include <immintrin.h>
#endif

typedef float v16 __attribute__((vector_size(64)));
typedef uint32_t u32x16 __attribute__((vector_size(64)));
typedef uint16_t u16x16 __attribute__((vector_size(32)));

// Element access for float and bfloat16 (stored as uint16_t): arithmetic is always float32; bf16 values
// widen exactly on load and round to nearest even on store (as torch does).
static inline v16 load16(const float* p) { v16 v; std::memcpy(&v, p, sizeof(v)); return v; }
static inline void store16(float* p, v16 v) { std::memcpy(p, &v, sizeof(v)); }
static inline float load1(const float* p) { return *p; }
static inline void store1(float* p, float v) { *p = v; }

static inline v16 load16(const uint16_t* p) {
  u16x16 h; std::memcpy(&h, p, sizeof(h));
  u32x16 w = __builtin_convertvector(h, u32x16) << 16;
  v16 v; std::memcpy(&v, &w, sizeof(v)); return v;
}
#ifdef __AVX512BF16__
static inline void store16(uint16_t* p, v16 v) {  // the CPU's round-to-nearest-even conversion: one instruction
  const __m256bh b = _mm512_cvtneps_pbh((__m512)v); std::memcpy(p, &b, sizeof(b));
}
#else
static inline void store16(uint16_t* p, v16 v) {
  u32x16 w; std::memcpy(&w, &v, sizeof(w));
  w = (w + 0x7FFFu + ((w >> 16) & 1u)) >> 16;
  u16x16 h = __builtin_convertvector(w, u16x16); std::memcpy(p, &h, sizeof(h));
}
#endif
static inline float load1(const uint16_t* p) { uint32_t w = (uint32_t)*p << 16; float f; std::memcpy(&f, &w, 4); return f; }
static inline void store1(uint16_t* p, float f) {
  uint32_t w; std::memcpy(&w, &f, 4); *p = (uint16_t)((w + 0x7FFFu + ((w >> 16) & 1u)) >> 16);
}
// Horizontal sum as a tree of halves (2 + 1 shuffles and 4 vector adds, then 3 scalar adds): a left-to-right
// loop over the 16 lanes costs 15 lane extractions, which share a port with the FMAs. Measured on the dev
// CPU (d = 1024, r = 16, K = 4, the shrink half alone): 0.91x and 0.93x the time at T = 1024 and 4096.
typedef float v8 __attribute__((vector_size(32)));
typedef float v4 __attribute__((vector_size(16)));
static inline float hsum(v16 v) {
  const v8 a = __builtin_shufflevector(v, v, 0, 1, 2, 3, 4, 5, 6, 7) +
               __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15);
  const v4 b = __builtin_shufflevector(a, a, 0, 1, 2, 3) + __builtin_shufflevector(a, a, 4, 5, 6, 7);
  return (b[0] + b[2]) + (b[1] + b[3]);
}

// h[i * R + r] = dot(x[i], A[r]) for NB tokens and RB ranks: NB * RB accumulators, each A chunk
// loaded once for all NB tokens (A rows stream from L2 once D * RB values outgrow L1). The npf rows pf
// (the next block's x) are prefetched a cache line per step, so DRAM fetches overlap this block's work.
template <typename T, int NB, int RB>
static inline void shrink_tile(const T* const* x, const T* A, int64_t D, float* h, int64_t R,
                               const T* const* pf, int npf) {
  v16 acc[NB][RB];
  for (int i = 0; i < NB; ++i)
    for (int r = 0; r < RB; ++r) acc[i][r] = v16{};
  int64_t d = 0;
  for (; d + 16 <= D; d += 16) {
    v16 xv[NB];
    for (int i = 0; i < npf; ++i) __builtin_prefetch(pf[i] + d, 0, 3);
    for (int i = 0; i < NB; ++i) xv[i] = load16(x[i] + d);
    for (int r = 0; r < RB; ++r) {
      const v16 a = load16(A + r * D + d);
      for (int i = 0; i < NB; ++i) acc[i][r] += xv[i] * a;
    }
  }
  for (int i = 0; i < NB; ++i)
    for (int r = 0; r < RB; ++r) {
      float s = hsum(acc[i][r]);
      for (int64_t e = d; e < D; ++e) s += load1(x[i] + e) * load1(A + r * D + e);
      h[i * R + r] = s;
    }
}

#ifdef __AVX512BF16__
// The same tile for bfloat16 on the CPU's bf16 dot-product instruction: each step multiplies 32 pairs of
// bf16 values exactly and adds them into 16 float32 lanes, with neither operand widened first.
template <int NB, int RB>
static inline void shrink_tile_bf16(const uint16_t* const* x, const uint16_t* A, int64_t D, float* h, int64_t R,
                                    const uint16_t* const* pf, int npf) {
  __m512 acc[NB][RB];
  for (int i = 0; i < NB; ++i)
    for (int r = 0; r < RB; ++r) acc[i][r] = _mm512_setzero_ps();
  int64_t d = 0;
  for (; d + 32 <= D; d += 32) {
    __m512bh xv[NB];
    for (int i = 0; i < npf; ++i) __builtin_prefetch(pf[i] + d, 0, 3);
    for (int i = 0; i < NB; ++i) xv[i] = (__m512bh)_mm512_loadu_si512(x[i] + d);
    for (int r = 0; r < RB; ++r) {
      const __m512bh a = (__m512bh)_mm512_loadu_si512(A + r * D + d);
      for (int i = 0; i < NB; ++i) acc[i][r] = _mm512_dpbf16_ps(acc[i][r], xv[i], a);
    }
  }
  for (int i = 0; i < NB; ++i)
    for (int r = 0; r < RB; ++r) {
      float s = hsum((v16)acc[i][r]);
      for (int64_t e = d; e < D; ++e) s += load1(x[i] + e) * load1(A + r * D + e);
      h[i * R + r] = s;
    }
}
#endif

// h [NB, R] for NB tokens: ranks in tiles of 4 (then 1); the first tile prefetches pf.
template <typename T, int NB>
static void shrink(const T* const* x, const T* A, int64_t R, int64_t D, float* h, const T* const* pf, int npf) {
  int64_t r = 0;
#ifdef __AVX512BF16__
  if constexpr (std::is_same<T, uint16_t>::value) {
    for (; r + 4 <= R; r += 4) shrink_tile_bf16<NB, 4>(x, A + r * D, D, h + r, R, pf, r == 0 ? npf : 0);
    for (; r < R; ++r) shrink_tile_bf16<NB, 1>(x, A + r * D, D, h + r, R, pf, r == 0 ? npf : 0);
    return;
  }
#endif
  for (; r + 4 <= R; r += 4) shrink_tile<T, NB, 4>(x, A + r * D, D, h + r, R, pf, r == 0 ? npf : 0);
  for (; r < R; ++r) shrink_tile<T, NB, 1>(x, A + r * D, D, h + r, R, pf, r == 0 ? npf : 0);
}

// out[i] += sum_r h[i][r] * Bt[r]  for NB rows, Bt [R, D] row-major; 64-column tiles in registers.
// The npf rows pf (the next block's out) are prefetched for writing, tile by tile. Bt may be float32 while
// out is bfloat16 (TB = float: a bf16 slot's B widened once, see run).
template <typename T, typename TB, int NB>
static void expand(T* const* out, const float* h, int64_t R, const TB* Bt, int64_t D, T* const* pf, int npf) {
  int64_t j = 0;
  for (; j + 64 <= D; j += 64) {
    for (int i = 0; i < npf; ++i)
      for (int q = 0; q < 64 * (int)sizeof(T); q += 64) __builtin_prefetch((const char*)(pf[i] + j) + q, 1, 3);
    v16 acc[NB][4];
    for (int i = 0; i < NB; ++i)
      for (int q = 0; q < 4; ++q) acc[i][q] = load16(out[i] + j + 16 * q);
    for (int64_t r = 0; r < R; ++r) {
      const TB* b = Bt + r * D + j;
      const v16 b0 = load16(b), b1 = load16(b + 16), b2 = load16(b + 32), b3 = load16(b + 48);
      for (int i = 0; i < NB; ++i) {
        const float hv = h[i * R + r];
        acc[i][0] += hv * b0; acc[i][1] += hv * b1; acc[i][2] += hv * b2; acc[i][3] += hv * b3;
      }
    }
    for (int i = 0; i < NB; ++i)
      for (int q = 0; q < 4; ++q) store16(out[i] + j + 16 * q, acc[i][q]);
  }
  for (; j < D; ++j)
    for (int i = 0; i < NB; ++i) {
      float s = load1(out[i] + j);
      for (int64_t r = 0; r < R; ++r) s += h[i * R + r] * load1(Bt + r * D + j);
      store1(out[i] + j, s);
    }
}

// expand for a block of n <= 4 rows (the row count is a template argument of expand).
template <typename T, typename TB>
static void expand_rows(int64_t n, T* const* out, const float* h, int64_t R, const TB* Bt, int64_t D, T* const* pf,
                        int npf) {
  switch (n) {
    case 4: expand<T, TB, 4>(out, h, R, Bt, D, pf, npf); break;
    case 3: expand<T, TB, 3>(out, h, R, Bt, D, pf, npf); break;
    case 2: expand<T, TB, 2>(out, h, R, Bt, D, pf, npf); break;
    default: expand<T, TB, 1>(out, h, R, Bt, D, pf, npf); break;
  }
}

// out[tok[p]] += scale[s_p] * w[p] * Bt[s_p].T @ (A[s_p] @ x[tok[p]]) for the pairs p of each slot segment
// (w = 1 when wp is null).
template <typename T>
static void run(T* op, const T* xp, const T* Ap, const T* Bp, int64_t ldx, int64_t ldo, int64_t S, int64_t R,
                int64_t Din, int64_t Dout, const int64_t* tp, const float* sp, const float* wp,
                const std::vector<int64_t>& counts) {
  constexpr int64_t NB = 4;
  std::vector<int64_t> bstart, bslot;            // blocks of <= NB pairs of one slot
  int64_t off = 0;
  for (int64_t s = 0; s < (int64_t)counts.size() && s < S; ++s) {
    for (int64_t p = off; p < off + counts[s]; p += NB) { bstart.push_back(p); bslot.push_back(s); }
    off += counts[s];
  }
  const int64_t nblocks = (int64_t)bstart.size();
  bstart.push_back(off);
  // Software prefetch of the next block's rows can pay only when the rows come from DRAM. Measured on the
  // dev CPU (d = 1024, r = 16, A/B against this kernel without it): 0.97-0.98x the time at T = 4096 on an
  // idle machine with 2 threads, 0.88-0.94x with 1 thread while another job ran; small T is left as it was.
  const bool prefetch = off * (Din + Dout) * (int64_t)sizeof(T) > (int64_t)4 << 20;
  at::parallel_for(0, nblocks, 1, [&](int64_t b0, int64_t b1) {
    std::vector<float> h(NB * R);
    std::vector<float> bw;                      // bf16: B[bw_slot] widened to float32 (this thread's scratch)
    int64_t bw_slot = -1;
    T* rows[NB];
    const T* xrows[NB];
    T* prow[NB];
    const T* pxrow[NB];
    for (int64_t b = b0; b < b1; ++b) {
      const int64_t s = bslot[b], p0 = bstart[b];
      const int64_t n = bstart[b + 1] - p0;     // blocks tile [0, off) in order; the last entry is off
      const T* As = Ap + s * R * Din;
      const T* Bs = Bp + s * R * Dout;
      for (int64_t i = 0; i < n; ++i) {
        xrows[i] = xp + tp[p0 + i] * ldx;
        rows[i] = op + tp[p0 + i] * ldo;
      }
      int npf = 0;                              // rows of the next block (this thread's) to prefetch
      if (prefetch && b + 1 < b1) {
        const int64_t q0 = bstart[b + 1];
        npf = (int)(bstart[b + 2] - q0);
        for (int i = 0; i < npf; ++i) { pxrow[i] = xp + tp[q0 + i] * ldx; prow[i] = op + tp[q0 + i] * ldo; }
      }
      switch (n) {
        case 4: shrink<T, 4>(xrows, As, R, Din, h.data(), pxrow, npf); break;
        case 3: shrink<T, 3>(xrows, As, R, Din, h.data(), pxrow, npf); break;
        case 2: shrink<T, 2>(xrows, As, R, Din, h.data(), pxrow, npf); break;
        default: shrink<T, 1>(xrows, As, R, Din, h.data(), pxrow, npf); break;
      }
      for (int64_t i = 0; i < n; ++i) {
        const float c = sp[s] * (wp ? wp[p0 + i] : 1.f);
        for (int64_t r = 0; r < R; ++r) h[i * R + r] *= c;
      }
      // bf16: a thread with more blocks of this slot ahead widens B[s] to float32 once, into its scratch, so
      // that each block reads float32 B as the float32 kernel does instead of widening it again. Measured on
      // the dev CPU (r = 16, S = 4, 2 threads, d 576 x 1536 either way), on top of the dot-product shrink:
      // 0.76x and 0.90x the time at T = 1024, 0.91x and 0.99x at T = 64; a lone block (decode) widens as it
      // reads (the scratch would cost more than it saves).
      const bool wide = !std::is_same<T, float>::value && (bw_slot == s || (b + 1 < b1 && bslot[b + 1] == s));
      if (wide && bw_slot != s) {
        bw.resize(R * Dout);
        int64_t e = 0;
        for (; e + 16 <= R * Dout; e += 16) store16(bw.data() + e, load16(Bs + e));
        for (; e < R * Dout; ++e) bw[e] = load1(Bs + e);
        bw_slot = s;
      }
      if (wide) expand_rows<T, float>(n, rows, h.data(), R, bw.data(), Dout, prow, npf);
      else expand_rows<T, T>(n, rows, h.data(), R, Bs, Dout, prow, npf);
    }
  });
}

// Whether this build multiplies bf16 with the CPU's bf16 dot-product instruction (else in software).
bool bf16_dot() {
#ifdef __AVX512BF16__
  return true;
#else
  return false;
#endif
}

void lora_fused_(torch::Tensor out, torch::Tensor x, torch::Tensor A, torch::Tensor Bt, torch::Tensor tok,
                 torch::Tensor scale, torch::Tensor weight, std::vector<int64_t> counts) {
  const int64_t S = A.size(0), R = A.size(1), Din = A.size(2), Dout = Bt.size(2);
  const int64_t ldx = x.stride(0), ldo = out.stride(0);
  const int64_t* tp = tok.data_ptr<int64_t>();
  const float* sp = scale.data_ptr<float>();
  const float* wp = weight.numel() ? weight.data_ptr<float>() : nullptr;   // empty: every pair weighs 1
  if (x.scalar_type() == at::kFloat) {
    run<float>(out.data_ptr<float>(), x.data_ptr<float>(), A.data_ptr<float>(), Bt.data_ptr<float>(), ldx, ldo,
               S, R, Din, Dout, tp, sp, wp, counts);
  } else {
    TORCH_CHECK(x.scalar_type() == at::kBFloat16, "lora_fused_: float32 or bfloat16 tensors");
    auto u = [](const torch::Tensor& t) { return reinterpret_cast<uint16_t*>(t.data_ptr<at::BFloat16>()); };
    run<uint16_t>(u(out), u(x), u(A), u(Bt), ldx, ldo, S, R, Din, Dout, tp, sp, wp, counts);
  }
}
"""

_lock = threading.Lock()
_NO_WEIGHTS = torch.empty(0)  # the kernel's "every pair weighs 1"
_module = None
_failed: str | None = None


def _load():
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
        try:
            from torch.utils.cpp_extension import load_inline

            log.info("building the fused LoRA CPU kernel (once per machine, about a minute)")
            venv_bin = os.path.dirname(sys.executable)  # a venv's ninja, when the venv is not activated
            if venv_bin not in os.environ.get("PATH", "").split(os.pathsep):
                os.environ["PATH"] = venv_bin + os.pathsep + os.environ.get("PATH", "")
            # -fopenmp: at::parallel_for runs on torch's OpenMP threads (torch's own libgomp.so.1, already
            # loaded, serves this library too); without it the kernel silently runs on one thread.
            _module = load_inline(name=f"molora_fused_lora_v8_{_cpu_tag()}", cpp_sources=_SOURCE,
                                  functions=["lora_fused_", "bf16_dot"], verbose=False,
                                  extra_cflags=["-O3", "-march=native", "-ffp-contract=fast", "-fopenmp"],
                                  extra_ldflags=["-fopenmp"])
        except Exception as e:  # no compiler, no ninja, unsupported platform: the eager backends remain
            _failed = f"{type(e).__name__}: {str(e).strip().splitlines()[-1] if str(e).strip() else ''}"
            log.warning("fused LoRA CPU kernel unavailable (%s); using the eager backends", _failed)
        return _module


def _cpu_tag() -> str:
    """A short hash of this CPU's feature flags: a build with -march=native is only reused on a like CPU."""
    try:
        flags = next(line for line in open("/proc/cpuinfo") if line.startswith("flags"))
    except (OSError, StopIteration):
        flags = platform.processor() or platform.machine()
    return hashlib.sha1(flags.encode()).hexdigest()[:8]


def available() -> bool:
    """Whether the fused CPU kernel is built (builds it on first call)."""
    return _load() is not None


def bf16_dot() -> bool:
    """Whether the built kernel runs bfloat16 on the CPU's bf16 dot-product instruction (AVX512_BF16);
    False where it widens to float32 in software, or where the kernel is not built."""
    mod = _load()
    return mod is not None and bool(mod.bf16_dot())


def unavailable_reason() -> str | None:
    """Why the kernel could not be built (None if it was, or was never tried)."""
    return _failed


def supports(x: Tensor, B: Tensor, top_k: int) -> bool:
    """Whether a call with these tensors can run fused (module docstring: Limits); no build, no data read."""
    return (x.device.type == "cpu" and x.dtype in (torch.float32, torch.bfloat16) and top_k == 1 and x.stride(-1) == 1
            and B.transpose(1, 2).is_contiguous() and not torch.is_grad_enabled())


def fused_apply(g: SlotGroups, x: Tensor, A: Tensor, B: Tensor, scale: Tensor, out: Tensor | None = None
                ) -> Tensor:
    """The fused backend on sort_group's metadata (k = 1): out [T, D_out] += each token's own delta.
    out None: a new zero-initialised tensor is returned. Call only where `supports` and `available`."""
    mod = _load()
    if mod is None:
        raise LoRABackendError(f"backend 'fused' needs its C++ kernel, which could not be built here ({_failed}). "
                               "Use backend='auto' (falls back to the eager backends) or install a C++ compiler.")
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
    mod.lora_fused_(out, x, A.contiguous(), B.transpose(1, 2), g.tok, scale, _NO_WEIGHTS if w is None else w,
                    g.counts)
    return out
