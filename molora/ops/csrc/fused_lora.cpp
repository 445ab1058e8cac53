// The `fused` per-token LoRA CPU kernel and its siblings. molora/ops/fused_cpu.py builds this file with
// torch.utils.cpp_extension.load under a name keyed by a hash of csrc/ and the flags (-O3 -march=native
// -ffp-contract=fast -fopenmp), with the Python bindings at the end of this file. Each kernel releases the GIL while
// it runs (as torch's own ops do), so a server's event loop is not stopped by a step, and checks its inputs first
// (checks.h). What they compute, limits, why: fused_cpu.py's docstring.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <ATen/record_function.h>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <algorithm>
#include <cmath>
#include <vector>
#ifdef __AVX512BF16__
#include <immintrin.h>
#endif
#include "checks.h"
namespace chk = molora_checks;

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

// Returns false, having done nothing, where the layout is not the kernel's (a row stride other than 1 in x or out,
// B not slot-major, A not contiguous, scale or weight not contiguous float32): the caller takes another path. Shapes
// that disagree raise (each call is checked here, so that callers may skip their own checks per call).
bool lora_fused_(torch::Tensor out, torch::Tensor x, torch::Tensor A, torch::Tensor B, torch::Tensor tok,
                 torch::Tensor scale, torch::Tensor weight, std::vector<int64_t> counts) {
  const char* fn = "lora_fused_";
  TORCH_CHECK(x.dim() == 2 && out.dim() == 2 && A.dim() == 3 && B.dim() == 3 && tok.dim() == 1,
              "lora_fused_: x [T, D_in], out [T, D_out], A [S, R, D_in], B [S, D_out, R] and tok [n] expected");
  for (auto [name, t] : {std::pair<const char*, const torch::Tensor*>{"out", &out}, {"x", &x}, {"A", &A}, {"B", &B},
                         {"tok", &tok}, {"scale", &scale}, {"weight", &weight}})
    chk::cpu(fn, name, *t);
  const int64_t S = A.size(0), R = A.size(1), Din = A.size(2), Dout = B.size(1), T = x.size(0);
  TORCH_CHECK(x.size(1) == Din && out.size(0) == T && B.size(0) == S && B.size(2) == R && out.size(1) == Dout,
              "lora_fused_: shapes disagree: x ", x.sizes(), ", out ", out.sizes(), ", A ", A.sizes(), ", B ", B.sizes());
  TORCH_CHECK(x.scalar_type() == out.scalar_type() && A.scalar_type() == x.scalar_type() &&
              B.scalar_type() == x.scalar_type() && (x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16),
              "lora_fused_: x, out, A and B must share one dtype, float32 or bfloat16");
  TORCH_CHECK(tok.scalar_type() == at::kLong && (int64_t)counts.size() <= S && scale.dim() == 1 && scale.numel() == S,
              "lora_fused_: tok int64, at most S = ", S, " counts (got ", counts.size(), "), scale [S] (got ",
              scale.sizes(), ")");
  TORCH_CHECK(weight.numel() == 0 || weight.dim() == 1, "lora_fused_: weight [pairs] or empty, got ", weight.sizes());
  int64_t pairs = 0;
  for (int64_t c : counts) { TORCH_CHECK(c >= 0, "lora_fused_: negative count"); pairs += c; }
  TORCH_CHECK(pairs <= tok.numel() && (weight.numel() == 0 || weight.numel() >= pairs),
              "lora_fused_: counts name ", pairs, " pairs; tok has ", tok.numel(), ", weight ", weight.numel());
  // B [S, Dout, R] stored slot-major (its transpose Bt [S, R, Dout] contiguous): read through Bt's layout
  const bool layout = (Dout == 1 || B.stride(1) == 1) && (R == 1 || B.stride(2) == Dout) &&
                      (S == 1 || B.stride(0) == R * Dout) && A.is_contiguous() && tok.is_contiguous() &&
                      (Din <= 1 || x.stride(1) == 1) && (Dout <= 1 || out.stride(1) == 1) &&
                      scale.scalar_type() == at::kFloat && scale.is_contiguous() &&
                      (weight.numel() == 0 || (weight.scalar_type() == at::kFloat && weight.is_contiguous()));
  if (!layout) return false;
  const int64_t* tp = tok.data_ptr<int64_t>();
  // each token once: blocks run in parallel and a token's row is read, then added to, by one block (top-1 routing)
  std::vector<uint8_t> seen(T, 0);
  for (int64_t p = 0; p < pairs; ++p) {
    TORCH_CHECK(tp[p] >= 0 && tp[p] < T, "lora_fused_: token ", tp[p], " of ", T, " (tok[", p, "] must be a row of x)");
    TORCH_CHECK(!seen[tp[p]], "lora_fused_: token ", tp[p], " is listed twice in tok; the kernel adds one delta per "
                "token (top-1 routing): use another backend for top-k > 1");
    seen[tp[p]] = 1;
  }
  pybind11::gil_scoped_release no_gil;  // pure C++ on tensors: the server's other threads run meanwhile
  const torch::Tensor& Bt = B;
  const int64_t ldx = x.stride(0), ldo = out.stride(0);
  const float* sp = scale.data_ptr<float>();
  const float* wp = weight.numel() ? weight.data_ptr<float>() : nullptr;   // empty: every pair weighs 1
  if (x.scalar_type() == at::kFloat) {
    run<float>(out.data_ptr<float>(), x.data_ptr<float>(), A.data_ptr<float>(), Bt.data_ptr<float>(), ldx, ldo,
               S, R, Din, Dout, tp, sp, wp, counts);
  } else {
    auto u = [](const torch::Tensor& t) { return reinterpret_cast<uint16_t*>(t.data_ptr<at::BFloat16>()); };
    run<uint16_t>(u(out), u(x), u(A), u(Bt), ldx, ldo, S, R, Din, Dout, tp, sp, wp, counts);
  }
  return true;
}

// ------------------------------------------------------------------------------------ paged decode attention
// One new token per sequence against its cached context, read where it lies in the paged cache: no gathered
// copy of the context (the eager path copies every context block per layer per step before attending).
// q [Bd, H, hd]; kc, vc [N, Hkv, hd] (row = block * bs + offset); tables [Bd, nb] block ids; ctx [Bd] context
// lengths (the new token's key is already written); window > 0 keeps keys at positions >= ctx - window.
// Query head h uses kv head h / G (G = H / Hkv). Scores, softmax and sums run in float32 (as SDPA's do).
// A kv head's G query heads share each key and value row read. Measured against the kernel before (one task per
// (sequence, kv head), a division per row; in one process, alternating, 30 layers' caches): 1.3-1.5x faster in
// float32 and 1.07-1.18x in bf16 at 32 sequences of 160 and 1000 tokens, outputs equal bit for bit; an engine
// decode step (batch 32, SmolLM2) 1.11x in float32, 1.05x in bf16.
template <typename T>
static inline float dot_row(const float* q, const T* k, int64_t hd) {
  int64_t d = 0;
  v16 acc = {};
  for (; d + 16 <= hd; d += 16) acc += load16(q + d) * load16(k + d);
  float s = hsum(acc);
  for (; d < hd; ++d) s += q[d] * load1(k + d);
  return s;
}

template <typename T>
static inline void axpy_row(float* acc, float p, const T* v, int64_t hd) {
  int64_t d = 0;
  for (; d + 16 <= hd; d += 16) store16(acc + d, load16(acc + d) + p * load16(v + d));
  for (; d < hd; ++d) acc[d] += p * load1(v + d);
}

// exp(x) for x <= 0 on 16 lanes: 2^n * e^z with n = trunc(x / ln 2) and z = x - n ln 2 in (-ln 2, 0], e^z by
// its Taylor series to z^8 (relative error below 2e-7 there); x below -87 gives exp(-87) (~1.6e-38, then
// negligible beside the row's maximum, which is 1). A scalar std::exp per score cost more than the reads.
typedef int32_t i32x16 __attribute__((vector_size(64)));
static inline v16 exp16(v16 x) {
  const v16 lo = v16{} - 87.0f;
  x = x < lo ? lo : x;
  const i32x16 n = __builtin_convertvector(x * 1.44269504088896341f, i32x16);     // toward zero: n >= x / ln 2
  const v16 z = x - __builtin_convertvector(n, v16) * 0.69314718055994531f;
  v16 p = 1.0f + z * (1.0f / 8);
  p = 1.0f + z * (1.0f / 7) * p;
  p = 1.0f + z * (1.0f / 6) * p;
  p = 1.0f + z * (1.0f / 5) * p;
  p = 1.0f + z * (1.0f / 4) * p;
  p = 1.0f + z * (1.0f / 3) * p;
  p = 1.0f + z * (1.0f / 2) * p;
  p = 1.0f + z * p;
  i32x16 bits;
  std::memcpy(&bits, &p, sizeof(bits));
  bits += n << 23;                                                                 // times 2^n
  std::memcpy(&p, &bits, sizeof(p));
  return p;
}

// softmax numerators in place over s[0, n) (max subtracted) and their sum
static inline float exp_sum(float* s, int64_t n, float m) {
  int64_t i = 0;
  v16 acc = {};
  for (; i + 16 <= n; i += 16) {
    const v16 e = exp16(load16(s + i) - m);
    store16(s + i, e);
    acc += e;
  }
  float sum = hsum(acc);
  for (; i < n; ++i) { const float e = std::exp(s[i] - m); s[i] = e; sum += e; }
  return sum;
}

// Row t of a context, where it lies in the cache: calls f(i, row pointer) for t = lo .. c-1 (i = t - lo), block by
// block (one table read and no division per row).
template <typename T, typename F>
static inline void for_rows(const T* base, const int64_t* t_b, int64_t lo, int64_t c, int64_t bs, int64_t row, F f) {
  for (int64_t t = lo; t < c;) {
    const int64_t blk = t / bs, off = t - blk * bs, cnt = std::min(bs - off, c - t);
    const T* r = base + (t_b[blk] * bs + off) * row;
    for (int64_t i = 0; i < cnt; ++i, r += row) f(t + i - lo, r);
    t += cnt;
  }
}

// float32 view of one cache row of `width` values: the row itself (float32), or widened once into `buf` (bf16)
static inline const float* widened(const float* r, int64_t, std::vector<float>&) { return r; }
static inline const float* widened(const uint16_t* r, int64_t width, std::vector<float>& buf) {
  int64_t d = 0;
  for (; d + 16 <= width; d += 16) store16(buf.data() + d, load16(r + d));
  for (; d < width; ++d) buf[d] = load1(r + d);
  return buf.data();
}

// {sum(a), sum(b), sum(c), sum(d)}, each by the same tree of halves as hsum (so each equals hsum of its vector bit
// for bit), the four reductions sharing their shuffles: 8 shuffles and 5 vector adds where 4 hsums take 12 and 16.
static inline v4 hsum4(v16 a, v16 b, v16 c, v16 d) {
  const v16 ab = __builtin_shufflevector(a, b, 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23) +
                 __builtin_shufflevector(a, b, 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31);
  const v16 cd = __builtin_shufflevector(c, d, 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23) +
                 __builtin_shufflevector(c, d, 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31);
  // lanes 4u .. 4u + 3 hold vector u's four partial sums b[0..3] (hsum's names)
  const v16 q = __builtin_shufflevector(ab, cd, 0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27) +
                __builtin_shufflevector(ab, cd, 4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31);
  const v16 r = q + __builtin_shufflevector(q, q, 2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13);
  const v16 t = r + __builtin_shufflevector(r, r, 1, 0, 3, 2, 5, 4, 7, 6, 9, 8, 11, 10, 13, 12, 15, 14);
  return __builtin_shufflevector(t, t, 0, 4, 8, 12);   // (b0 + b2) + (b1 + b3) in lane 0 of each group
}

// softmax numerators in place over each of the nq score rows of sc [nq, n] (max subtracted), inv[j] = 1 / their sum
static inline void softmax_rows(float* sc, int64_t nq, int64_t n, float* inv) {
  for (int64_t j = 0; j < nq; ++j) {
    float m = -INFINITY;
    for (int64_t i = 0; i < n; ++i) m = std::max(m, sc[j * n + i]);
    inv[j] = 1.f / exp_sum(sc + j * n, n, m);
  }
}

// Rows prefetched ahead in attend_tiled. Measured against no prefetch (scripts/ab_paged_decode.py, 16 repetitions):
// 1.10x and 1.06x in float32 at contexts 160 and 1000, 0.99x and 1.00x in bf16 (half the lines per row).
constexpr int64_t PF = 8;

// One task's attention with the head dim HD known at compile time: a key row's HD / 16 vectors stay in registers
// for all G query heads of its kv head, whose dot products reduce four at a time (hsum4); the value pass runs per
// kv head and per group of up to 16 / (HD / 16) query heads, their output rows held in registers across the
// context (no load and store of an accumulator per row). The same sums in the same order as the generic path
// (dot_row, axpy_row): outputs equal bit for bit.
template <typename T, int HD>
static void attend_tiled(const float* qf, const T* K, const T* V, const int64_t* t_b, int64_t lo, int64_t c,
                         int64_t bs, int64_t row, int64_t nh, int64_t G, float* sc, float* inv, T* o) {
  constexpr int C = HD / 16;
  constexpr int GB = C >= 16 ? 1 : 16 / C;       // query heads whose output rows fit 16 registers
  const int64_t n = c - lo;
  const int64_t lines = (nh * HD * (int64_t)sizeof(T) + 63) / 64;
  auto prefetch = [&](const T* base, int64_t i) {   // the row PF rows ahead (this task's heads): in flight meanwhile
    const int64_t t = lo + i + PF;
    if (t >= c) return;
    const char* p = (const char*)(base + (t_b[t / bs] * bs + t % bs) * row);
    for (int64_t l = 0; l < lines; ++l) __builtin_prefetch(p + 64 * l, 0, 3);
  };
  for_rows(K, t_b, lo, c, bs, row, [&](int64_t i, const T* r) {     // scores, head-major: sc[j * n + i]
    prefetch(K, i);
    for (int64_t hh = 0; hh < nh; ++hh) {
      v16 kv[C];
      for (int e = 0; e < C; ++e) kv[e] = load16(r + hh * HD + 16 * e);
      const float* qh = qf + hh * G * HD;
      float* sh = sc + hh * G * n;
      for (int64_t j = 0; j < G; j += 4) {
        v16 acc[4];
        for (int u = 0; u < 4; ++u) {
          acc[u] = v16{};
          if (j + u < G)
            for (int e = 0; e < C; ++e) acc[u] += load16(qh + (j + u) * HD + 16 * e) * kv[e];
        }
        const v4 s = hsum4(acc[0], acc[1], acc[2], acc[3]);
        for (int u = 0; u < 4 && j + u < G; ++u) sh[(j + u) * n + i] = s[u];
      }
    }
  });
  softmax_rows(sc, nh * G, n, inv);
  for (int64_t hh = 0; hh < nh; ++hh)
    for (int64_t j0 = hh * G; j0 < (hh + 1) * G; j0 += GB) {
      const int64_t g = std::min<int64_t>(GB, (hh + 1) * G - j0);
      v16 acc[GB][C];
      for (int u = 0; u < GB; ++u)
        for (int e = 0; e < C; ++e) acc[u][e] = v16{};
      for_rows(V + hh * HD, t_b, lo, c, bs, row, [&](int64_t i, const T* r) {
        if (hh == 0 && j0 == 0) prefetch(V, i);
        v16 vv[C];
        for (int e = 0; e < C; ++e) vv[e] = load16(r + 16 * e);
        for (int u = 0; u < GB; ++u)
          if (u < g) {
            const float p = sc[(j0 + u) * n + i];
            for (int e = 0; e < C; ++e) acc[u][e] += p * vv[e];
          }
      });
      for (int u = 0; u < g; ++u)
        for (int e = 0; e < C; ++e) store16(o + (j0 + u) * HD + 16 * e, acc[u][e] * inv[j0 + u]);
    }
}

template <typename T>
static void paged_decode_run(const T* Q, const T* K, const T* V, T* O, const int64_t* tab, const int64_t* cl,
                             int64_t Bd, int64_t H, int64_t Hkv, int64_t hd, int64_t nb, int64_t bs, float scale,
                             int64_t window, const int64_t* qrows = nullptr, int64_t ldq = 0, int64_t ldo = 0) {
  // sequence b's query is row qrows[b] of Q (row stride ldq) and its output row qrows[b] of O (stride ldo);
  // qrows null: row b of Q [Bd, H, hd] and O contiguous
  if (!qrows) { ldq = H * hd; ldo = H * hd; }
  const int64_t G = H / Hkv, row = Hkv * hd;
  // A task is one sequence's kv heads [h0, h0 + nh): all of them where there are sequences enough to keep every
  // thread busy (each cache row then read whole, in order, block by block), else one (a few long contexts).
  const int64_t nh = Bd >= 2 * at::get_num_threads() ? Hkv : 1, per = Hkv / nh;
  at::parallel_for(0, Bd * per, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> qf, sc, acc, inv, buf(row);
    for (int64_t task = begin; task < end; ++task) {
      const int64_t b = task / per, h0 = (task % per) * nh, c = cl[b];
      const int64_t qr = qrows ? qrows[b] : b;
      const int64_t lo = window > 0 ? std::max<int64_t>(0, c - window) : 0, n = c - lo;
      const int64_t nq = nh * G;                   // query heads of this task: h0 * G ... (h0 + nh) * G - 1
      qf.resize(nq * hd);
      sc.resize(nq * n);
      inv.resize(nq);
      for (int64_t j = 0; j < nq * hd; ++j) qf[j] = load1(Q + qr * ldq + h0 * G * hd + j) * scale;
      const int64_t* t_b = tab + b * nb;
      T* o = O + qr * ldo + h0 * G * hd;
      if (hd == 64) {
        attend_tiled<T, 64>(qf.data(), K + h0 * hd, V + h0 * hd, t_b, lo, c, bs, row, nh, G, sc.data(), inv.data(), o);
        continue;
      }
      if (hd == 128) {
        attend_tiled<T, 128>(qf.data(), K + h0 * hd, V + h0 * hd, t_b, lo, c, bs, row, nh, G, sc.data(), inv.data(),
                             o);
        continue;
      }
      acc.assign(nq * hd, 0.f);                    // any other head dim: one row at a time through a buffer
      for_rows(K + h0 * hd, t_b, lo, c, bs, row, [&](int64_t i, const T* r) {   // scores, head-major: sc[j * n + i]
        const float* k = widened(r, nh * hd, buf);
        for (int64_t j = 0; j < nq; ++j) sc[j * n + i] = dot_row(qf.data() + j * hd, k + (j / G) * hd, hd);
      });
      softmax_rows(sc.data(), nq, n, inv.data());
      for_rows(V + h0 * hd, t_b, lo, c, bs, row, [&](int64_t i, const T* r) {
        const float* v = widened(r, nh * hd, buf);
        for (int64_t j = 0; j < nq; ++j) axpy_row(acc.data() + j * hd, sc[j * n + i], v + (j / G) * hd, hd);
      });
      for (int64_t j = 0; j < nq; ++j)
        for (int64_t d = 0; d < hd; ++d) store1(o + j * hd + d, acc[j * hd + d] * inv[j]);
    }
  });
}

// The checks paged_decode and paged_decode_rows share, for Bd sequences: q, out [T, H, hd] (heads contiguous), kc, vc
// [N, Hkv, hd] contiguous, one float dtype, H a multiple of Hkv; tables [Bd, nb] and ctx [Bd] int64; each context
// 1 <= ctx[b] <= nb * block_size, and each block id a context reads (the first ctx[b] positions' blocks, less those
// wholly outside the window) a block of the cache: 0 <= id < N / block_size. O(Bd * nb), before any read.
static void check_paged(const char* fn, const torch::Tensor& out, const torch::Tensor& q, const torch::Tensor& kc,
                        const torch::Tensor& vc, const torch::Tensor& tables, const torch::Tensor& ctx, int64_t Bd,
                        int64_t block_size, int64_t window) {
  chk::rank(fn, "q", q, 3, "[T, H, head_dim]");
  chk::float_cpu(fn, "q", q);
  chk::rank(fn, "kc", kc, 3, "[N, Hkv, head_dim]");
  for (auto [name, t] : {std::pair<const char*, const torch::Tensor*>{"out", &out}, {"kc", &kc}, {"vc", &vc}}) {
    chk::cpu(fn, name, *t);
    chk::same_dtype(fn, name, *t, "q", q);
  }
  TORCH_CHECK(out.sizes() == q.sizes(), fn, ": out ", out.sizes(), " must have q's shape ", q.sizes());
  TORCH_CHECK(vc.sizes() == kc.sizes(), fn, ": vc ", vc.sizes(), " must have kc's shape ", kc.sizes());
  const int64_t H = q.size(1), hd = q.size(2), Hkv = kc.size(1), N = kc.size(0);
  TORCH_CHECK(kc.size(2) == hd, fn, ": kc's head_dim ", kc.size(2), " differs from q's ", hd);
  TORCH_CHECK(Hkv >= 1 && H % Hkv == 0, fn, ": q's ", H, " heads must be a multiple of the cache's ", Hkv, " kv heads");
  TORCH_CHECK(q.stride(2) == 1 && q.stride(1) == hd && out.stride(2) == 1 && out.stride(1) == hd, fn,
              ": q and out need contiguous heads (strides [*, ", hd, ", 1]), got ", q.strides(), " and ", out.strides());
  TORCH_CHECK(kc.is_contiguous() && vc.is_contiguous(), fn, ": kc and vc must be contiguous");
  TORCH_CHECK(block_size >= 1 && window >= 0, fn, ": block_size ", block_size, " must be >= 1 and window ", window,
              " >= 0 (0: none)");
  chk::rank(fn, "tables", tables, 2, "[Bd, blocks per sequence]");
  chk::cpu(fn, "tables", tables);
  TORCH_CHECK(tables.scalar_type() == at::kLong && tables.is_contiguous() && tables.size(0) == Bd, fn,
              ": tables must be contiguous int64 [", Bd, ", nb], got ", tables.scalar_type(), " ", tables.sizes());
  chk::index(fn, "ctx", ctx, Bd);
  const int64_t nb = tables.size(1), blocks = N / block_size;
  const int64_t* tp = tables.data_ptr<int64_t>();
  const int64_t* cp = ctx.data_ptr<int64_t>();
  for (int64_t b = 0; b < Bd; ++b) {
    const int64_t c = cp[b];
    TORCH_CHECK(c >= 1 && c <= nb * block_size, fn, ": ctx[", b, "] = ", c, " is outside [1, ", nb * block_size,
                "] (the sequence's table holds ", nb, " blocks of ", block_size, ")");
    const int64_t lo = window > 0 ? std::max<int64_t>(0, c - window) : 0;
    for (int64_t k = lo / block_size; k <= (c - 1) / block_size; ++k)
      TORCH_CHECK(tp[b * nb + k] >= 0 && tp[b * nb + k] < blocks, fn, ": tables[", b, ", ", k, "] = ", tp[b * nb + k],
                  " is not a block of the cache (", N, " rows hold ", blocks, " blocks of ", block_size, ")");
  }
}

void paged_decode(torch::Tensor out, torch::Tensor q, torch::Tensor kc, torch::Tensor vc, torch::Tensor tables,
                  torch::Tensor ctx, int64_t block_size, double scale, int64_t window) {
  pybind11::gil_scoped_release no_gil;  // pure C++ on tensors: the server's other threads run meanwhile
  check_paged("paged_decode", out, q, kc, vc, tables, ctx, q.dim() == 3 ? q.size(0) : 0, block_size, window);
  TORCH_CHECK(q.is_contiguous() && out.is_contiguous(), "paged_decode: q and out must be contiguous");
  const int64_t Bd = q.size(0), H = q.size(1), hd = q.size(2), Hkv = kc.size(1), nb = tables.size(1);
  const int64_t* tp = tables.data_ptr<int64_t>();
  const int64_t* cp = ctx.data_ptr<int64_t>();
  if (q.scalar_type() == at::kFloat) {
    paged_decode_run<float>(q.data_ptr<float>(), kc.data_ptr<float>(), vc.data_ptr<float>(), out.data_ptr<float>(),
                            tp, cp, Bd, H, Hkv, hd, nb, block_size, (float)scale, window);
  } else {
    TORCH_CHECK(q.scalar_type() == at::kBFloat16, "paged_decode: float32 or bfloat16 tensors");
    auto u = [](const torch::Tensor& t) { return reinterpret_cast<uint16_t*>(t.data_ptr<at::BFloat16>()); };
    paged_decode_run<uint16_t>(u(q), u(kc), u(vc), u(out), tp, cp, Bd, H, Hkv, hd, nb, block_size, (float)scale,
                               window);
  }
}

// paged_decode on rows of a step: q and out [T, H, hd] (heads contiguous, any row stride), sequence b's query
// at row rows[b]; the output rows of the other tokens are left as they are (no gather, no scatter).
void paged_decode_rows(torch::Tensor out, torch::Tensor q, torch::Tensor kc, torch::Tensor vc, torch::Tensor tables,
                       torch::Tensor ctx, torch::Tensor rows, int64_t block_size, double scale, int64_t window) {
  pybind11::gil_scoped_release no_gil;  // pure C++ on tensors: the server's other threads run meanwhile
  const char* fn = "paged_decode_rows";
  chk::rank(fn, "rows", rows, 1, "[Bd]");
  const int64_t Bd = rows.size(0);
  check_paged(fn, out, q, kc, vc, tables, ctx, Bd, block_size, window);
  chk::index(fn, "rows", rows, Bd);
  chk::distinct(fn, "rows", rows.data_ptr<int64_t>(), Bd, q.size(0), "a sequence's query row of q and out");
  const int64_t H = q.size(1), hd = q.size(2), Hkv = kc.size(1), nb = tables.size(1);
  const int64_t* tp = tables.data_ptr<int64_t>();
  const int64_t* cp = ctx.data_ptr<int64_t>();
  const int64_t* rp = rows.data_ptr<int64_t>();
  if (q.scalar_type() == at::kFloat) {
    paged_decode_run<float>(q.data_ptr<float>(), kc.data_ptr<float>(), vc.data_ptr<float>(), out.data_ptr<float>(),
                            tp, cp, Bd, H, Hkv, hd, nb, block_size, (float)scale, window, rp, q.stride(0),
                            out.stride(0));
  } else {
    TORCH_CHECK(q.scalar_type() == at::kBFloat16, "paged_decode_rows: float32 or bfloat16 tensors");
    auto u = [](const torch::Tensor& t) { return reinterpret_cast<uint16_t*>(t.data_ptr<at::BFloat16>()); };
    paged_decode_run<uint16_t>(u(q), u(kc), u(vc), u(out), tp, cp, Bd, H, Hkv, hd, nb, block_size, (float)scale,
                               window, rp, q.stride(0), out.stride(0));
  }
}

// ------------------------------------------------------------------------------------ decode-layer glue
// The small per-layer operations around the GEMMs and attention, one call each instead of 4-10 torch ops:
// RMSNorm with the residual add before it, RoPE with the KV-cache write after it, SiLU(gate) * up. Rows may
// be strided (views into a wider projection output). Row work is split over torch's threads in blocks of
// about 8K values, so a batch-32 decode step runs them on both threads. Blocks of 64K values (one thread at that
// step) had looked cheaper under torch.profiler, which adds its own cost to every call; without it, engine decode
// steps alternating between the two builds in one process ran 0.975x the time in bf16 (twice) and 0.988x in
// float32 with 8K (outputs bit for bit the same: each row is computed on its own).
static inline int64_t glue_grain(int64_t width) { return std::max<int64_t>(1, 8192 / std::max<int64_t>(width, 1)); }

template <typename T> static inline float rnd(float f);
template <> inline float rnd<float>(float f) { return f; }
template <> inline float rnd<uint16_t>(float f) { uint16_t b; store1(&b, f); return load1(&b); }

// mean(x^2) over a row of D values, summed in the order of torch's own reduction of x.float().pow(2).mean(-1)
// (ATen's SumKernel: vectorized_inner_sum -> row_sum -> multi_row_sum) with its vectors of L lanes: L-lane vectors of
// squares into 4 interleaved accumulators (vector c into accumulator c % 4), carried up a cascade of levels every
// 2^lp steps; then the leftover vectors into the first, the other three added to it in order, the scalar tail, the
// L lanes one by one, and a true division by D. Each square rounds before it is added (no fused multiply-add), as
// torch's pow then sum. Which L torch uses is found at run time (fused_cpu._sum_lanes: 8 on the dev CPU, although
// it reports AVX512); with it the result equals torch's bit for bit, so the RMSNorm equals transformers' in bf16
// (where one last-bit difference flips a greedy output now and then) and in float32. Lanes are plain arrays: each
// is its own sequential sum, which the compiler vectorizes without reordering.
#pragma GCC push_options
#pragma GCC optimize("fp-contract=off")
template <typename T, int L>
static float torch_mean_sq(const T* x, int64_t D) {
  const int64_t nv = D / L, ni = nv / 4;
  int64_t lp = 1;                                          // level power: max(4, CeilLog2(ni) / 4)
  if (ni > 2) { lp = 0; for (uint64_t u = (uint64_t)ni - 1; u; u >>= 1) ++lp; }
  lp = std::max<int64_t>(4, lp / 4);
  const int64_t step = (int64_t)1 << lp, lmask = step - 1;
  float acc[4][4][L] = {};
  auto add_sq = [&](float* a, int64_t c) {
    for (int e = 0; e < L; ++e) { const float v = load1(x + c * L + e); const float q = v * v; a[e] += q; }
  };
  int64_t i = 0;
  while (i + step <= ni) {
    for (int64_t j = 0; j < step; ++j, ++i)
      for (int k = 0; k < 4; ++k) add_sq(acc[0][k], 4 * i + k);
    for (int l = 1; l < 4; ++l) {
      for (int k = 0; k < 4; ++k)
        for (int e = 0; e < L; ++e) { acc[l][k][e] += acc[l - 1][k][e]; acc[l - 1][k][e] = 0.f; }
      if ((i & (lmask << (l * lp))) != 0) break;
    }
  }
  for (; i < ni; ++i)
    for (int k = 0; k < 4; ++k) add_sq(acc[0][k], 4 * i + k);
  for (int l = 1; l < 4; ++l)
    for (int k = 0; k < 4; ++k)
      for (int e = 0; e < L; ++e) acc[0][k][e] += acc[l][k][e];
  for (int64_t c = 4 * ni; c < nv; ++c) add_sq(acc[0][0], c);
  for (int k = 1; k < 4; ++k)
    for (int e = 0; e < L; ++e) acc[0][0][e] += acc[0][k][e];
  float s = 0.f;
  for (int64_t e = L * nv; e < D; ++e) { const float v = load1(x + e); const float q = v * v; s += q; }
  for (int e = 0; e < L; ++e) s += acc[0][0][e];
  return s / (float)D;
}
#pragma GCC pop_options

// h[t] += d[t] (rounded to T, as torch's add), then out[t] = w * rnd(h[t] * rsqrt(mean(h[t]^2) + eps)), the
// mean in float32: transformers' LlamaRMSNorm (also Mistral's, Qwen2's, Qwen3's). d null: no add. The mean of squares
// is summed here in torch's order with `lanes` (8 or 16) lanes (torch_mean_sq), or, lanes 0, taken from var ([rows]
// float32, computed by the caller with torch's own reduction): either way the output equals transformers' bit for bit.
template <typename T>
static void add_rms_norm_run(T* h, int64_t ldh, const T* d, int64_t ldd, const T* w, T* out, int64_t ldo,
                             int64_t rows, int64_t D, float eps, const float* var, int lanes) {
  at::parallel_for(0, rows, glue_grain(D), [&](int64_t r0, int64_t r1) {
    for (int64_t t = r0; t < r1; ++t) {
      T* hr = h + t * ldh;
      T* orow = out + t * ldo;
      int64_t j = 0;
      if (d) {
        const T* dr = d + t * ldd;
        for (; j + 16 <= D; j += 16) { const v16 s = load16(hr + j) + load16(dr + j); store16(hr + j, s); }
        for (; j < D; ++j) store1(hr + j, load1(hr + j) + load1(dr + j));
      }
      const float mean = var ? var[t] : D < lanes ? torch_mean_sq<T, 1>(hr, D)   // rows narrower than a vector:
                                                                                 // torch's scalar loop, same order
                         : lanes == 16 ? torch_mean_sq<T, 16>(hr, D) : torch_mean_sq<T, 8>(hr, D);
      const float inv = 1.f / std::sqrt(mean + eps);
      if constexpr (std::is_same<T, float>::value) {
        for (j = 0; j + 16 <= D; j += 16) store16(orow + j, load16(w + j) * (load16(hr + j) * inv));
      } else {  // bf16: the normed value rounds to bf16 before the weight multiplies it (x.to(input_dtype))
        for (j = 0; j + 16 <= D; j += 16) {
          u16x16 tmp; store16((uint16_t*)&tmp, load16(hr + j) * inv);
          store16(orow + j, load16(w + j) * load16((const uint16_t*)&tmp));
        }
      }
      for (; j < D; ++j) store1(orow + j, load1(w + j) * rnd<T>(load1(hr + j) * inv));
    }
  });
}

void add_rms_norm(torch::Tensor h, torch::Tensor d, torch::Tensor w, torch::Tensor out, double eps,
                  torch::Tensor var, int64_t lanes) {
  pybind11::gil_scoped_release no_gil;  // pure C++ on tensors: the server's other threads run meanwhile
  const char* fn = "add_rms_norm";
  chk::rank(fn, "h", h, 2, "[T, D]");
  chk::float_cpu(fn, "h", h);
  for (auto [name, t] : {std::pair<const char*, const torch::Tensor*>{"out", &out}, {"weight", &w}, {"delta", &d},
                         {"var", &var}}) chk::cpu(fn, name, *t);
  chk::same_dtype(fn, "out", out, "h", h);
  chk::same_dtype(fn, "weight", w, "h", h);
  TORCH_CHECK(out.sizes() == h.sizes(), "add_rms_norm: out ", out.sizes(), " must have h's shape ", h.sizes());
  TORCH_CHECK(d.numel() == 0 || d.sizes() == h.sizes(), "add_rms_norm: delta ", d.sizes(), " must have h's shape ",
              h.sizes(), " (or be empty: no add)");
  if (d.numel()) chk::same_dtype(fn, "delta", d, "h", h);
  const int64_t rows = h.size(0), D = h.size(1);
  TORCH_CHECK(w.dim() == 1 && w.size(0) == D, "add_rms_norm: weight ", w.sizes(), " must be [D] = [", D, "]");
  TORCH_CHECK(h.stride(1) == 1 && out.stride(1) == 1 && w.is_contiguous() && (d.numel() == 0 || d.stride(1) == 1),
              "add_rms_norm: rows with unit stride");
  TORCH_CHECK(var.numel() == 0 || (var.numel() == rows && var.scalar_type() == at::kFloat && var.is_contiguous()),
              "add_rms_norm: var [rows] float32");
  TORCH_CHECK(var.numel() != 0 || lanes == 8 || lanes == 16, "add_rms_norm: var, or lanes 8 or 16");
  const float* vp = var.numel() ? var.data_ptr<float>() : nullptr;
  const int64_t ldd = d.numel() ? d.stride(0) : 0;
  if (h.scalar_type() == at::kFloat) {
    add_rms_norm_run<float>(h.data_ptr<float>(), h.stride(0), d.numel() ? d.data_ptr<float>() : nullptr, ldd,
                            w.data_ptr<float>(), out.data_ptr<float>(), out.stride(0), rows, D, (float)eps, vp,
                            (int)lanes);
  } else {
    TORCH_CHECK(h.scalar_type() == at::kBFloat16, "add_rms_norm: float32 or bfloat16 tensors");
    auto u = [](const torch::Tensor& t) { return reinterpret_cast<uint16_t*>(t.data_ptr<at::BFloat16>()); };
    add_rms_norm_run<uint16_t>(u(h), h.stride(0), d.numel() ? u(d) : nullptr, ldd, u(w), u(out), out.stride(0),
                               rows, D, (float)eps, vp, (int)lanes);
  }
}

// RoPE as transformers computes it, x * cos + rotate_half(x) * sin, each product and the sum rounded to T
// (no fused multiply-add: the results equal torch's bit for bit), on the Hq heads of q and the Hk heads of k
// in place; then the rotated k and v rows go to the cache rows `wrows` (index_copy_). cos / sin [P, hd].
#pragma GCC push_options
#pragma GCC optimize("fp-contract=off")
template <typename T>
static void rope_heads(T* x, int64_t heads, int64_t hd, const T* c, const T* s) {
  const int64_t half = hd / 2;
  for (int64_t h = 0; h < heads; ++h) {
    T* r = x + h * hd;
    for (int64_t i = 0; i < half; ++i) {
      const float a = load1(r + i), b = load1(r + i + half);
      const float lo = rnd<T>(rnd<T>(a * load1(c + i)) + rnd<T>(-b * load1(s + i)));
      const float hi = rnd<T>(rnd<T>(b * load1(c + i + half)) + rnd<T>(a * load1(s + i + half)));
      store1(r + i, lo);
      store1(r + i + half, hi);
    }
  }
}

template <typename T>
static void rope_write_run(T* q, int64_t ldq, int64_t Hq, T* k, int64_t ldk, int64_t Hk, const T* v, int64_t ldv,
                           const T* cs, const T* sn, int64_t hd, const int64_t* pos, const int64_t* wrows, T* kc,
                           T* vc, int64_t rows) {
  at::parallel_for(0, rows, glue_grain((Hq + 2 * Hk) * hd), [&](int64_t r0, int64_t r1) {
    for (int64_t t = r0; t < r1; ++t) {
      const T* c = cs + pos[t] * hd;
      const T* s = sn + pos[t] * hd;
      rope_heads<T>(q + t * ldq, Hq, hd, c, s);
      rope_heads<T>(k + t * ldk, Hk, hd, c, s);
      std::memcpy(kc + wrows[t] * Hk * hd, k + t * ldk, Hk * hd * sizeof(T));
      std::memcpy(vc + wrows[t] * Hk * hd, v + t * ldv, Hk * hd * sizeof(T));
    }
  });
}
#pragma GCC pop_options

void rope_write(torch::Tensor q, torch::Tensor k, torch::Tensor v, torch::Tensor cos, torch::Tensor sin,
                torch::Tensor pos, torch::Tensor wrows, torch::Tensor kc, torch::Tensor vc) {
  pybind11::gil_scoped_release no_gil;  // pure C++ on tensors: the server's other threads run meanwhile
  // q [T, Hq, hd], k / v [T, Hk, hd] with contiguous heads (any row stride); kc / vc [N, Hk, hd] contiguous
  const char* fn = "rope_write";
  chk::rank(fn, "q", q, 3, "[T, H, head_dim]");
  chk::rank(fn, "k", k, 3, "[T, Hkv, head_dim]");
  chk::rank(fn, "kc", kc, 3, "[N, Hkv, head_dim]");
  chk::rank(fn, "cos", cos, 2, "[positions, head_dim]");
  chk::float_cpu(fn, "q", q);
  for (auto [name, t] : {std::pair<const char*, const torch::Tensor*>{"k", &k}, {"v", &v}, {"cos", &cos},
                         {"sin", &sin}, {"kc", &kc}, {"vc", &vc}}) {
    chk::cpu(fn, name, *t);
    chk::same_dtype(fn, name, *t, "q", q);
  }
  const int64_t rows = q.size(0), Hq = q.size(1), hd = q.size(2), Hk = k.size(1);
  TORCH_CHECK(hd % 2 == 0, "rope_write: head_dim ", hd, " must be even (rotate_half)");
  TORCH_CHECK(k.size(0) == rows && k.size(2) == hd && v.sizes() == k.sizes(), "rope_write: k ", k.sizes(), " and v ",
              v.sizes(), " must both be [T, Hkv, head_dim] with q's T and head_dim (q ", q.sizes(), ")");
  TORCH_CHECK(kc.size(1) == Hk && kc.size(2) == hd && vc.sizes() == kc.sizes(), "rope_write: kc ", kc.sizes(),
              " and vc ", vc.sizes(), " must both be [N, ", Hk, ", ", hd, "]");
  TORCH_CHECK(cos.size(1) == hd && sin.sizes() == cos.sizes(), "rope_write: cos ", cos.sizes(), " and sin ",
              sin.sizes(), " must both be [positions, ", hd, "]");
  chk::index(fn, "positions", pos, rows);
  chk::index(fn, "write_rows", wrows, rows);
  TORCH_CHECK(q.stride(2) == 1 && q.stride(1) == hd && k.stride(2) == 1 && k.stride(1) == hd && v.stride(2) == 1 &&
              v.stride(1) == hd && kc.is_contiguous() && vc.is_contiguous() && cos.is_contiguous() &&
              sin.is_contiguous() && pos.is_contiguous() && wrows.is_contiguous(), "rope_write: layout");
  const int64_t* pp = pos.data_ptr<int64_t>();
  const int64_t* wp = wrows.data_ptr<int64_t>();
  chk::in_range(fn, "positions", pp, rows, 0, cos.size(0), "a row of the cos / sin tables");
  chk::in_range(fn, "write_rows", wp, rows, 0, kc.size(0), "a row of the cache");
  if (q.scalar_type() == at::kFloat) {
    rope_write_run<float>(q.data_ptr<float>(), q.stride(0), Hq, k.data_ptr<float>(), k.stride(0), Hk,
                          v.data_ptr<float>(), v.stride(0), cos.data_ptr<float>(), sin.data_ptr<float>(), hd, pp, wp,
                          kc.data_ptr<float>(), vc.data_ptr<float>(), rows);
  } else {
    TORCH_CHECK(q.scalar_type() == at::kBFloat16, "rope_write: float32 or bfloat16 tensors");
    auto u = [](const torch::Tensor& t) { return reinterpret_cast<uint16_t*>(t.data_ptr<at::BFloat16>()); };
    rope_write_run<uint16_t>(u(q), q.stride(0), Hq, u(k), k.stride(0), Hk, u(v), v.stride(0), u(cos), u(sin), hd,
                             pp, wp, u(kc), u(vc), rows);
  }
}

// g = silu(g) * u in place (each rounded to T, as torch's silu then mul): silu(x) = x / (1 + e^-x), computed as
// x * m / (1 + e) with e = e^-|x| and m = 1 (x >= 0) or e (x < 0), so exp16 only sees arguments <= 0.
template <typename T>
static void silu_mul_run(T* g, int64_t ldg, const T* u, int64_t ldu, int64_t rows, int64_t D) {
  at::parallel_for(0, rows, glue_grain(D), [&](int64_t r0, int64_t r1) {
    for (int64_t t = r0; t < r1; ++t) {
      T* gr = g + t * ldg;
      const T* ur = u + t * ldu;
      int64_t j = 0;
      for (; j + 16 <= D; j += 16) {
        const v16 x = load16(gr + j);
        const v16 ax = x < 0 ? -x : x;
        const v16 e = exp16(-ax);
        const v16 m = x < 0 ? e : v16{} + 1.0f;
        v16 sv = x * m / (1.0f + e);
        if constexpr (!std::is_same<T, float>::value) {
          u16x16 tmp; store16((uint16_t*)&tmp, sv); sv = load16((const uint16_t*)&tmp);
        }
        store16(gr + j, sv * load16(ur + j));
      }
      for (; j < D; ++j) {
        const float x = load1(gr + j);
        store1(gr + j, rnd<T>(x / (1.f + std::exp(-x))) * load1(ur + j));
      }
    }
  });
}

void silu_mul(torch::Tensor g, torch::Tensor u) {
  pybind11::gil_scoped_release no_gil;  // pure C++ on tensors: the server's other threads run meanwhile
  const char* fn = "silu_mul";
  chk::rank(fn, "gate", g, 2, "[T, D]");
  chk::float_cpu(fn, "gate", g);
  chk::cpu(fn, "up", u);
  chk::same_dtype(fn, "up", u, "gate", g);
  TORCH_CHECK(g.sizes() == u.sizes(), "silu_mul: up ", u.sizes(), " must have gate's shape ", g.sizes());
  TORCH_CHECK(g.stride(1) == 1 && u.stride(1) == 1, "silu_mul: rows with unit stride");
  const int64_t rows = g.size(0), D = g.size(1);
  if (g.scalar_type() == at::kFloat) {
    silu_mul_run<float>(g.data_ptr<float>(), g.stride(0), u.data_ptr<float>(), u.stride(0), rows, D);
  } else {
    TORCH_CHECK(g.scalar_type() == at::kBFloat16, "silu_mul: float32 or bfloat16 tensors");
    auto p = [](const torch::Tensor& t) { return reinterpret_cast<uint16_t*>(t.data_ptr<at::BFloat16>()); };
    silu_mul_run<uint16_t>(p(g), g.stride(0), p(u), u.stride(0), rows, D);
  }
}

// ------------------------------------------------------------------------------------ float32 GEMM on panels
// y [M, N] = x [M, K] @ W.T (+ bias) with W packed once into panels of 16 output columns, P [N / 16, K, 16]
// (P[p, k, j] = W[16 p + j, k]: molora.ops.packed). A task is a group of up to 3 panels (48 columns); it runs over
// the rows 8 at a time with 8 x 3 vectors of accumulators, each k step loading 3 weight vectors and broadcasting 8
// values of x (24 multiply-adds). The first pass over the rows streams the panels from memory, prefetched PF_W
// steps ahead; the later passes find them in L2. Each output is one running sum over k in order (then + bias):
// a row's result does not depend on the other rows, nor on M. Measured against MKL's packed sgemm (the
// previous path; 2 threads, SmolLM2-135M's 7 shapes over 30 layers, alternating): 1.47x, 1.91x, 1.57x, 1.28-1.43x,
// 1.22x, 1.09x and 0.99x as fast at M = 2, 8, 16, 32, 64, 128 and 512.
constexpr int64_t PF_W = 32;

template <int MB, int NP>
static inline void panel_tile(const float* x, int64_t ldx, const float* P, int64_t K, float* y, int64_t ldy,
                              const float* bias, bool prefetch) {
  v16 acc[MB][NP];
  for (int i = 0; i < MB; ++i)
    for (int j = 0; j < NP; ++j) acc[i][j] = v16{};
  for (int64_t k = 0; k < K; ++k) {
    if (prefetch)
      for (int j = 0; j < NP; ++j) __builtin_prefetch(P + (j * K + k + PF_W) * 16, 0, 3);
    v16 w[NP];
    for (int j = 0; j < NP; ++j) w[j] = load16(P + (j * K + k) * 16);
    for (int i = 0; i < MB; ++i) {
      const float xv = x[i * ldx + k];
      for (int j = 0; j < NP; ++j) acc[i][j] += xv * w[j];
    }
  }
  for (int j = 0; j < NP; ++j) {
    const v16 b = bias ? load16(bias + 16 * j) : v16{};
    for (int i = 0; i < MB; ++i) store16(y + i * ldy + 16 * j, bias ? acc[i][j] + b : acc[i][j]);
  }
}

template <int NP>
static void panel_rows(int64_t mb, const float* x, int64_t ldx, const float* P, int64_t K, float* y, int64_t ldy,
                       const float* bias, bool prefetch) {
  switch (mb) {
    case 8: panel_tile<8, NP>(x, ldx, P, K, y, ldy, bias, prefetch); break;
    case 7: panel_tile<7, NP>(x, ldx, P, K, y, ldy, bias, prefetch); break;
    case 6: panel_tile<6, NP>(x, ldx, P, K, y, ldy, bias, prefetch); break;
    case 5: panel_tile<5, NP>(x, ldx, P, K, y, ldy, bias, prefetch); break;
    case 4: panel_tile<4, NP>(x, ldx, P, K, y, ldy, bias, prefetch); break;
    case 3: panel_tile<3, NP>(x, ldx, P, K, y, ldy, bias, prefetch); break;
    case 2: panel_tile<2, NP>(x, ldx, P, K, y, ldy, bias, prefetch); break;
    default: panel_tile<1, NP>(x, ldx, P, K, y, ldy, bias, prefetch); break;
  }
}

void linear_panels(torch::Tensor y, torch::Tensor x, torch::Tensor P, torch::Tensor bias) {
  pybind11::gil_scoped_release no_gil;  // pure C++ on tensors: the server's other threads run meanwhile
  for (auto [name, t] : {std::pair<const char*, const torch::Tensor*>{"y", &y}, {"x", &x}, {"P", &P}, {"bias", &bias}})
    chk::cpu("linear_panels", name, *t);
  TORCH_CHECK(x.scalar_type() == at::kFloat && P.scalar_type() == at::kFloat && y.scalar_type() == at::kFloat &&
              x.dim() == 2 && y.dim() == 2 && P.dim() == 3 && P.size(2) == 16 && P.is_contiguous() && x.stride(1) == 1 &&
              y.stride(1) == 1 && x.size(1) == P.size(1) && y.size(0) == x.size(0) && y.size(1) == 16 * P.size(0) &&
              (bias.numel() == 0 || (bias.numel() == y.size(1) && bias.is_contiguous() &&
                                     bias.scalar_type() == at::kFloat)),
              "linear_panels: float32 x [M, K] (unit column stride), P [N/16, K, 16], y [M, N], bias [N] or empty");
  const int64_t M = x.size(0), K = x.size(1), np = P.size(0), ldx = x.stride(0), ldy = y.stride(0);
  const float* xp = x.data_ptr<float>();
  const float* pp = P.data_ptr<float>();
  const float* bp = bias.numel() ? bias.data_ptr<float>() : nullptr;
  float* yp = y.data_ptr<float>();
  at::parallel_for(0, (np + 2) / 3, 1, [&](int64_t g0, int64_t g1) {
    for (int64_t g = g0; g < g1; ++g) {
      const int64_t p0 = 3 * g, n = std::min<int64_t>(3, np - p0);
      const float* Pg = pp + p0 * K * 16;
      const float* bg = bp ? bp + p0 * 16 : nullptr;
      for (int64_t m0 = 0; m0 < M; m0 += 8) {
        const int64_t mb = std::min<int64_t>(8, M - m0);
        float* yt = yp + m0 * ldy + p0 * 16;
        const float* xt = xp + m0 * ldx;
        if (n == 3) panel_rows<3>(mb, xt, ldx, Pg, K, yt, ldy, bg, m0 == 0);
        else if (n == 2) panel_rows<2>(mb, xt, ldx, Pg, K, yt, ldy, bg, m0 == 0);
        else panel_rows<1>(mb, xt, ldx, Pg, K, yt, ldy, bg, m0 == 0);
      }
    }
  });
}

// ------------------------------------------------------------------------------------ bfloat16 GEMM on AMX tiles
// y [M, N] = x [M, K] @ W.T (+ bias), bfloat16, on the CPU's AMX tile unit, with W packed once into the tile layout
// of its B operand, P [N / 16, K / 32, 16, 32] (P[p, c, r, 2 j + e] = W[16 p + j, 32 c + 2 r + e]:
// molora.ops.packed.tiles). A task is a pair of panels (32 output columns; a last odd panel alone); it runs over
// the rows 32 at a time: 2 x 2 accumulator tiles of 16 x 16 float32, each step over 32 values of k loading 2 tiles
// of x and 2 of W. The products are exact, the sums float32 in k order, each output rounded once to bf16 after the
// bias is added: what torch's oneDNN GEMM computes, equal bit for bit at M <= 32 (tested; above that torch changes
// its blocking and differs in about 1e-4 of the outputs), and a row's result depends neither on the other rows nor
// on M. The weight tiles of the first row pass are prefetched AMX_PF steps ahead.
// Measured against torch's bf16 linear (2 threads, SmolLM2-135M's 7 shapes over 30 layers, alternating, weights
// cold, four runs): 2.0-2.1x at M = 8, 1.6-2.5x at M = 32, 1.1-1.55x at M = 128, 0.9-1.0x at M = 512.
#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
#include <sys/syscall.h>
#include <unistd.h>

constexpr int64_t AMX_PF = 4;

// Linux hands a process the AMX tile state only once asked (arch_prctl ARCH_REQ_XCOMP_PERM for XTILEDATA).
static bool amx_permitted() {
  static const bool ok = syscall(SYS_arch_prctl, 0x1023, 18) == 0;
  return ok;
}

static inline void amx_config() {  // 8 tiles of 16 rows x 64 bytes (palette 1), for this thread
  struct alignas(64) { uint8_t palette, start_row, reserved[14]; uint16_t colsb[16]; uint8_t rows[16]; } cfg = {};
  cfg.palette = 1;
  for (int t = 0; t < 8; ++t) { cfg.colsb[t] = 64; cfg.rows[t] = 16; }
  _tile_loadconfig(&cfg);
}

// Output tiles 0-3 (rows a / b x panels 0 / 1), x tiles 4-5, W tiles 6-7.
template <bool TWO_ROWS, bool TWO_PANELS>
static inline void amx_block(const uint16_t* a0, const uint16_t* a1, int64_t lda0, int64_t lda1, const uint16_t* b0,
                             const uint16_t* b1, int64_t KC, bool prefetch, float (*c)[16][16]) {
  _tile_zero(0); _tile_zero(1); _tile_zero(2); _tile_zero(3);
  for (int64_t k = 0; k < KC; ++k) {
    if (prefetch && k + AMX_PF < KC)
      for (int q = 0; q < 1024; q += 64) {
        __builtin_prefetch((const char*)(b0 + (k + AMX_PF) * 512) + q, 0, 3);
        if (TWO_PANELS) __builtin_prefetch((const char*)(b1 + (k + AMX_PF) * 512) + q, 0, 3);
      }
    _tile_loadd(4, a0 + k * 32, lda0 * 2);
    _tile_loadd(6, b0 + k * 512, 64);
    _tile_dpbf16ps(0, 4, 6);
    if (TWO_PANELS) { _tile_loadd(7, b1 + k * 512, 64); _tile_dpbf16ps(1, 4, 7); }
    if (TWO_ROWS) {
      _tile_loadd(5, a1 + k * 32, lda1 * 2);
      _tile_dpbf16ps(2, 5, 6);
      if (TWO_PANELS) _tile_dpbf16ps(3, 5, 7);
    }
  }
  _tile_stored(0, c[0], 64);
  if (TWO_PANELS) _tile_stored(1, c[1], 64);
  if (TWO_ROWS) { _tile_stored(2, c[2], 64); if (TWO_PANELS) _tile_stored(3, c[3], 64); }
}
#endif

bool amx_ready() {
#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
  return amx_permitted();
#else
  return false;
#endif
}

void linear_amx(torch::Tensor y, torch::Tensor x, torch::Tensor P, torch::Tensor bias) {
  for (auto [name, t] : {std::pair<const char*, const torch::Tensor*>{"y", &y}, {"x", &x}, {"P", &P}, {"bias", &bias}})
    chk::cpu("linear_amx", name, *t);
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && P.scalar_type() == at::kBFloat16 &&
              y.scalar_type() == at::kBFloat16 && x.dim() == 2 && y.dim() == 2 && P.dim() == 4 && P.size(2) == 16 &&
              P.size(3) == 32 && P.is_contiguous() && x.stride(1) == 1 && y.stride(1) == 1 &&
              x.size(1) == 32 * P.size(1) && y.size(0) == x.size(0) && y.size(1) == 16 * P.size(0) &&
              (bias.numel() == 0 || (bias.numel() == y.size(1) && bias.is_contiguous() &&
                                     bias.scalar_type() == at::kBFloat16)),
              "linear_amx: bfloat16 x [M, K] (unit column stride), P [N/16, K/32, 16, 32], y [M, N], bias [N] or empty");
#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
  TORCH_CHECK(amx_permitted(), "linear_amx: the kernel may not use the AMX tiles here");
  pybind11::gil_scoped_release no_gil;  // pure C++ on tensors: the server's other threads run meanwhile
  const int64_t M = x.size(0), K = x.size(1), KC = P.size(1), np = P.size(0), ldx = x.stride(0), ldy = y.stride(0);
  auto u = [](const torch::Tensor& t) { return reinterpret_cast<uint16_t*>(t.data_ptr<at::BFloat16>()); };
  const uint16_t* xp = u(x);
  const uint16_t* pp = u(P);
  const uint16_t* bp = bias.numel() ? u(bias) : nullptr;
  uint16_t* yp = u(y);
  // A last tile of fewer than 16 rows is read from a zero-padded copy (a tile load reads 16 rows).
  const int64_t full = M / 16, tail = M % 16, tiles = full + (tail ? 1 : 0);
  std::vector<uint16_t> pad(tail ? 16 * K : 0, 0);
  for (int64_t i = 0; i < tail; ++i) std::memcpy(&pad[i * K], xp + (full * 16 + i) * ldx, K * 2);
  auto rows = [&](int64_t t) { return t < full ? xp + t * 16 * ldx : pad.data(); };
  auto ld = [&](int64_t t) { return t < full ? ldx : K; };
  at::parallel_for(0, (np + 1) / 2, 1, [&](int64_t g0, int64_t g1) {
    amx_config();
    alignas(64) float c[4][16][16];
    for (int64_t g = g0; g < g1; ++g) {
      const int64_t p0 = 2 * g;
      const bool two = p0 + 1 < np;
      const uint16_t* b0 = pp + p0 * KC * 512;
      const uint16_t* b1 = two ? b0 + KC * 512 : b0;
      for (int64_t t = 0; t < tiles; t += 2) {
        const bool tr = t + 1 < tiles;
        const uint16_t* a1 = tr ? rows(t + 1) : rows(t);
        if (tr && two) amx_block<true, true>(rows(t), a1, ld(t), ld(t + 1), b0, b1, KC, t == 0, c);
        else if (tr) amx_block<true, false>(rows(t), a1, ld(t), ld(t + 1), b0, b1, KC, t == 0, c);
        else if (two) amx_block<false, true>(rows(t), a1, ld(t), ld(t), b0, b1, KC, t == 0, c);
        else amx_block<false, false>(rows(t), a1, ld(t), ld(t), b0, b1, KC, t == 0, c);
        for (int q = 0; q < 4; ++q) {          // q: rows t + q / 2, panel p0 + q % 2
          if ((q >= 2 && !tr) || (q % 2 && !two)) continue;
          const int64_t r0 = (t + q / 2) * 16, n0 = (p0 + q % 2) * 16;
          const v16 b = bp ? load16(bp + n0) : v16{};
          for (int64_t i = 0; i < 16 && r0 + i < M; ++i) store16(yp + (r0 + i) * ldy + n0, load16(c[q][i]) + b);
        }
      }
    }
    _tile_release();
  });
#else
  TORCH_CHECK(false, "linear_amx: built without AMX (amx_ready() is false here)");
#endif
}


// ------------------------------------------------------------------------------------ one decoder block of a decode step
// A Llama-shaped block (RMSNorm, q/k/v/o, RoPE, attention over the paged cache, RMSNorm, gate/up, SiLU * up, down)
// on a step whose every row decodes (one new token per sequence), as one call: the kernels above in the order and on
// the arguments the runner's Python path (molora.model.runner._Block) gives them, so its results are those of that
// path bit for bit; what it saves is the Python between the kernels (about 20 calls a block). h [T, D] is updated in
// place (h += delta before the first norm, h += attention output before the second); returns the block's MLP output
// (the next block's delta). Linears in the order q, k, v, o, gate, up, down: P packed weights (panels [N/16, K, 16]
// float32 or AMX tiles [N/16, K/32, 16, 32] bfloat16), bias or empty; a routed linear's A, B (slot-major), scale
// (float32) run lora_fused_ on the step's tok / weight / counts (lora: the step has routing), an empty A adds
// nothing. clock: empty, or float64 [6] to which each kernel kind's wall seconds are added (linear, lora, norm, rope,
// attention, silu_mul: the bench's kernel share); each kernel is also a torch.profiler range named as the Python path
// names it. Called by BoundBlock::run only, which checked the 7 linears when it was bound.

static torch::Tensor decode_block(const torch::Tensor& h, const torch::Tensor& delta, const torch::Tensor& ln1,
                                  const torch::Tensor& ln2, double eps, int64_t lanes,
                                  const std::vector<torch::Tensor>& P, const std::vector<torch::Tensor>& bias,
                                  const std::vector<torch::Tensor>& A, const std::vector<torch::Tensor>& B,
                                  const std::vector<torch::Tensor>& scale, bool lora, const torch::Tensor& tok,
                                  const torch::Tensor& weight, const std::vector<int64_t>& counts, int64_t H,
                                  int64_t Hkv, int64_t hd, const torch::Tensor& cos, const torch::Tensor& sin,
                                  const torch::Tensor& pos, const torch::Tensor& wrows, const torch::Tensor& kc,
                                  const torch::Tensor& vc, const torch::Tensor& tables, const torch::Tensor& ctx,
                                  const torch::Tensor& rows, int64_t block_size, double scaling, int64_t window,
                                  const torch::Tensor& clock) {
  TORCH_CHECK(h.dim() == 2 && h.is_contiguous(), "decode_block: h [T, D] contiguous");
  TORCH_CHECK(clock.numel() == 0 || (clock.numel() == 6 && clock.scalar_type() == at::kDouble &&
                                     clock.is_contiguous()), "decode_block: clock empty or float64 [6]");
  double* ck = clock.numel() ? clock.data_ptr<double>() : nullptr;
  const int64_t T = h.size(0);
  const auto opts = h.options();
  const torch::Tensor no_var = at::empty({0}, opts.dtype(at::kFloat));   // the mean of squares comes from lanes
  // one kernel call as a profiler range named `name`, its wall time added to clock slot `kind` (if clocked)
  auto timed = [&](int kind, const char* name, auto&& call) {
    RECORD_FUNCTION(name, std::vector<c10::IValue>());
    const auto t0 = std::chrono::steady_clock::now();
    call();
    if (ck) ck[kind] += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  };
  auto norm = [&](const torch::Tensor& d, const torch::Tensor& w) {
    torch::Tensor out = at::empty(h.sizes(), opts);
    timed(2, "molora::add_rms_norm", [&] { add_rms_norm(h, d, w, out, eps, no_var, lanes); });
    return out;
  };
  auto linear = [&](int i, const torch::Tensor& x) {
    const torch::Tensor& p = P[i];
    torch::Tensor y = at::empty({T, 16 * p.size(0)}, opts);
    if (p.dim() == 4) timed(0, "molora::linear_amx", [&] { linear_amx(y, x, p, bias[i]); });
    else timed(0, "molora::linear_panels", [&] { linear_panels(y, x, p, bias[i]); });
    if (lora && A[i].numel())
      timed(1, "molora::lora_fused", [&] {
        TORCH_CHECK(lora_fused_(y, x, A[i], B[i], tok, scale[i], weight, counts),
                    "decode_block: the LoRA kernel declined the layout of linear ", i);
      });
    return y;
  };
  torch::Tensor x = norm(delta, ln1);
  torch::Tensor q = linear(0, x), k = linear(1, x), v = linear(2, x);
  torch::Tensor q3 = q.view({T, H, hd}), k3 = k.view({T, Hkv, hd}), v3 = v.view({T, Hkv, hd});
  timed(3, "molora::rope_write", [&] { rope_write(q3, k3, v3, cos, sin, pos, wrows, kc, vc); });
  torch::Tensor att = at::empty({T, H, hd}, opts);
  timed(4, "molora::paged_decode",
        [&] { paged_decode_rows(att, q3, kc, vc, tables, ctx, rows, block_size, scaling, window); });
  torch::Tensor o = linear(3, att.view({T, H * hd}));
  x = norm(o, ln2);
  torch::Tensor g = linear(4, x), u = linear(5, x);
  timed(5, "molora::silu_mul", [&] { silu_mul(g, u); });
  return linear(6, g);
}


// A block's arguments that stay the same from step to step (weights packed, adapter slots, norms, RoPE tables, its
// cache views, shapes), bound once in C++ (molora.model.runner._Block binds them: `fused_cpu.bind_block`), so that a
// step passes only what changes (h, the routing, the positions and cache rows). `watched`: the tensors from which the
// bound ones were derived or whose writes mean a rebind (base weights, from which the packed copies were made; the
// adapter slots and their scales, written by a load or unload, which also changes which linears carry a delta;
// the norms): `run` returns an undefined tensor (None in Python), having done nothing, once any of them has moved
// to other storage or been written in place since the bind; the caller binds again.
struct BoundBlock {
  std::vector<torch::Tensor> P, bias, A, B, scale, watched;
  torch::Tensor ln1, ln2, cos, sin, kc, vc;
  double eps, scaling;
  int64_t lanes, H, Hkv, hd, block_size, window;
  std::vector<const void*> ptrs;
  std::vector<int64_t> versions;

  BoundBlock(std::vector<torch::Tensor> P_, std::vector<torch::Tensor> bias_, std::vector<torch::Tensor> A_,
             std::vector<torch::Tensor> B_, std::vector<torch::Tensor> scale_, torch::Tensor ln1_, torch::Tensor ln2_,
             double eps_, int64_t lanes_, int64_t H_, int64_t Hkv_, int64_t hd_, torch::Tensor cos_,
             torch::Tensor sin_, torch::Tensor kc_, torch::Tensor vc_, int64_t block_size_, double scaling_,
             int64_t window_, std::vector<torch::Tensor> watched_)
      : P(P_), bias(bias_), A(A_), B(B_), scale(scale_), watched(watched_), ln1(ln1_), ln2(ln2_), cos(cos_),
        sin(sin_), kc(kc_), vc(vc_), eps(eps_), scaling(scaling_), lanes(lanes_), H(H_), Hkv(Hkv_), hd(hd_),
        block_size(block_size_), window(window_) {
    TORCH_CHECK(P.size() == 7 && bias.size() == 7 && A.size() == 7 && B.size() == 7 && scale.size() == 7,
                "bind_block: 7 linears (q, k, v, o, gate, up, down) expected");
    TORCH_CHECK(H >= 1 && Hkv >= 1 && hd >= 2 && H % Hkv == 0, "bind_block: heads (H ", H, ", Hkv ", Hkv,
                ", head_dim ", hd, "): H must be a positive multiple of Hkv, head_dim >= 2");
    TORCH_CHECK(lanes == 8 || lanes == 16, "bind_block: lanes ", lanes, " must be 8 or 16 (fused_cpu.norm_lanes())");
    TORCH_CHECK(block_size >= 1 && window >= 0, "bind_block: block_size ", block_size, " must be >= 1 and window ",
                window, " >= 0 (0: none)");
    for (int i = 0; i < 7; ++i)
      TORCH_CHECK(P[i].dim() == 3 || P[i].dim() == 4, "bind_block: linear ", i, "'s packed weight must be panels "
                  "[N/16, K, 16] or AMX tiles [N/16, K/32, 16, 32], got ", P[i].sizes());
    for (const auto& t : watched) { ptrs.push_back(t.data_ptr()); versions.push_back(t._version()); }
  }

  bool current() const {
    for (size_t i = 0; i < watched.size(); ++i)
      if (watched[i].data_ptr() != ptrs[i] || watched[i]._version() != versions[i]) return false;
    return true;
  }

  torch::Tensor run(torch::Tensor h, torch::Tensor delta, bool lora, torch::Tensor tok, torch::Tensor weight,
                    std::vector<int64_t> counts, torch::Tensor pos, torch::Tensor wrows, torch::Tensor tables,
                    torch::Tensor ctx, torch::Tensor rows, torch::Tensor clock) {
    if (!current()) return torch::Tensor();
    return decode_block(h, delta, ln1, ln2, eps, lanes, P, bias, A, B, scale, lora, tok, weight, counts, H, Hkv, hd,
                        cos, sin, pos, wrows, kc, vc, tables, ctx, rows, block_size, scaling, window, clock);
  }
};

// ------------------------------------------------------------------------------------ greedy pick of a step's logits
// ids[b] = the index of the first maximum of row b of logits [B, V] (torch's max(-1).indices: the first NaN where a
// row holds one), finite[b] = whether every value of the row is finite; one pass over the rows, split over torch's
// threads. The engine's greedy pick and its check of the sampled rows, where torch needs a max and a sum (about
// 1.5 ms a batch-32 bf16 step of a 49152-token vocabulary, measured).
template <typename T>
static int64_t first_max_exact(const T* r, int64_t V, bool* fin) {   // torch's rule, element by element
  float best = load1(r);
  int64_t arg = 0;
  *fin = std::isfinite(best);
  if (std::isnan(best)) return 0;
  for (int64_t j = 1; j < V; ++j) {
    const float v = load1(r + j);
    if (!std::isfinite(v)) *fin = false;
    if (std::isnan(v)) return j;
    if (v > best) { best = v; arg = j; }
  }
  return arg;
}

template <typename T>
static void greedy_rows_run(const T* x, int64_t ld, int64_t B, int64_t V, int64_t* ids, bool* finite) {
  at::parallel_for(0, B, 1, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) {
      const T* r = x + b * ld;
      const int64_t V16 = V / 16 * 16;
      if (V16 == 0) { bool f; ids[b] = first_max_exact(r, V, &f); finite[b] = f; continue; }
      // pass 1: the row's maximum, and whether every value is finite (v - v is 0 for finite v, NaN for inf or NaN)
      v16 mx = load16(r), bad = v16{};
      for (int64_t j = 0; j < V16; j += 16) {
        const v16 v = load16(r + j);
        mx = v > mx ? v : mx;
        bad += v - v;
      }
      float best = mx[0], chk = 0.f;
      for (int l = 1; l < 16; ++l) best = mx[l] > best ? mx[l] : best;
      for (int l = 0; l < 16; ++l) chk += bad[l];
      for (int64_t j = V16; j < V; ++j) {
        const float v = load1(r + j);
        chk += v - v;
        best = v > best ? v : best;
      }
      if (chk != 0.f) { bool f; ids[b] = first_max_exact(r, V, &f); finite[b] = f; continue; }   // not all finite
      // pass 2: the first index holding the maximum
      const v16 bv = v16{} + best;
      int64_t arg = -1;
      for (int64_t j = 0; j < V16 && arg < 0; j += 16) {
        const i32x16 eq = (i32x16)(load16(r + j) == bv);
        uint64_t w[8];
        std::memcpy(w, &eq, sizeof(w));
        if (w[0] | w[1] | w[2] | w[3] | w[4] | w[5] | w[6] | w[7])
          for (int l = 0; l < 16; ++l) if (eq[l]) { arg = j + l; break; }
      }
      for (int64_t j = V16; j < V && arg < 0; ++j) if (load1(r + j) == best) arg = j;
      ids[b] = arg;
      finite[b] = true;
    }
  });
}

void greedy_rows(torch::Tensor logits, torch::Tensor ids, torch::Tensor finite) {
  for (auto [name, t] : {std::pair<const char*, const torch::Tensor*>{"logits", &logits}, {"ids", &ids},
                         {"finite", &finite}}) chk::cpu("greedy_rows", name, *t);
  TORCH_CHECK(logits.dim() != 2 || logits.size(1) >= 1, "greedy_rows: logits ", logits.sizes(),
              " has an empty vocabulary; each row needs at least one value");
  TORCH_CHECK(logits.dim() == 2 && logits.stride(1) == 1 && ids.scalar_type() == at::kLong && ids.is_contiguous() &&
              finite.scalar_type() == at::kBool && finite.is_contiguous() && ids.numel() == logits.size(0) &&
              finite.numel() == logits.size(0), "greedy_rows: logits [B, V] (unit column stride), ids [B] int64, "
              "finite [B] bool");
  pybind11::gil_scoped_release no_gil;
  const int64_t B = logits.size(0), V = logits.size(1), ld = logits.stride(0);
  if (logits.scalar_type() == at::kFloat) {
    greedy_rows_run<float>(logits.data_ptr<float>(), ld, B, V, ids.data_ptr<int64_t>(), finite.data_ptr<bool>());
  } else {
    TORCH_CHECK(logits.scalar_type() == at::kBFloat16, "greedy_rows: float32 or bfloat16 logits");
    greedy_rows_run<uint16_t>(reinterpret_cast<const uint16_t*>(logits.data_ptr<at::BFloat16>()), ld, B, V,
                              ids.data_ptr<int64_t>(), finite.data_ptr<bool>());
  }
}


// ------------------------------------------------------------------------------------ Python bindings
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {   // each wrapped so that a failed check raises RuntimeError(its message)
  m.def("lora_fused_", torch::wrap_pybind_function(lora_fused_));
  m.def("bf16_dot", torch::wrap_pybind_function(bf16_dot));
  m.def("paged_decode", torch::wrap_pybind_function(paged_decode));
  m.def("paged_decode_rows", torch::wrap_pybind_function(paged_decode_rows));
  m.def("add_rms_norm", torch::wrap_pybind_function(add_rms_norm));
  m.def("rope_write", torch::wrap_pybind_function(rope_write));
  m.def("silu_mul", torch::wrap_pybind_function(silu_mul));
  m.def("linear_panels", torch::wrap_pybind_function(linear_panels));
  m.def("amx_ready", torch::wrap_pybind_function(amx_ready));
  m.def("linear_amx", torch::wrap_pybind_function(linear_amx));
  m.def("greedy_rows", torch::wrap_pybind_function(greedy_rows));
  pybind11::class_<BoundBlock>(m, "BoundBlock")
      .def(pybind11::init<std::vector<torch::Tensor>, std::vector<torch::Tensor>, std::vector<torch::Tensor>,
                          std::vector<torch::Tensor>, std::vector<torch::Tensor>, torch::Tensor, torch::Tensor, double,
                          int64_t, int64_t, int64_t, int64_t, torch::Tensor, torch::Tensor, torch::Tensor,
                          torch::Tensor, int64_t, double, int64_t, std::vector<torch::Tensor>>())
      .def("current", &BoundBlock::current)
      .def("run", torch::wrap_pybind_function(
          [](BoundBlock& b, torch::Tensor h, torch::Tensor delta, bool lora, torch::Tensor tok, torch::Tensor weight,
             std::vector<int64_t> counts, torch::Tensor pos, torch::Tensor wrows, torch::Tensor tables,
             torch::Tensor ctx, torch::Tensor rows, torch::Tensor clock) {
            return b.run(h, delta, lora, tok, weight, counts, pos, wrows, tables, ctx, rows, clock);
          }));
}
