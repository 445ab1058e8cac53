// The `fused` per-token LoRA kernel: each routed token's delta from its own slot, added into its row of `out` in
// place (shrink x by A, scale, expand by B), blocks of up to 4 tokens of one slot in parallel. fused_cpu.py's
// docstring: what, limits, measurements.
#include "common.h"

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
