// The decode layer's glue: add + RMSNorm (add_rms_norm), RoPE + KV-cache write (rope_write), SiLU(gate) * up
// (silu_mul): RoPE and the adds equal to transformers' torch ops bit for bit, the norm to within its tolerance
// (mean_sq), SiLU to rounding.
#include "common.h"

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

// mean(x^2) over a row of D values: each square is exact in float64 (a float32's square fits in 53 bits), the squares
// are summed in float64 on 16 lanes and the mean rounds once to float32. That is the float32 nearest the exact mean
// (the float64 sum's own error, about D * 2^-53 relative, is far below float32's rounding), whatever the row width or
// the machine's vector width. torch sums float32 squares in float32 in an order of its own (a cascade of vectors of
// its build's width), so the two means may differ in their last bits: the norm's output then differs from
// transformers' by about one float32 ulp, and in bf16 the rounding of an element whose value lies on a rounding
// boundary may go the other way (one bf16 ulp, rarely). tests/test_ops.py holds both to those tolerances.
typedef double v8d __attribute__((vector_size(64)));
template <typename T>
static float mean_sq(const T* x, int64_t D) {
  v8d a0 = {}, a1 = {};
  int64_t j = 0;
  for (; j + 16 <= D; j += 16) {
    const v16 v = load16(x + j);
    const v8d lo = __builtin_convertvector(__builtin_shufflevector(v, v, 0, 1, 2, 3, 4, 5, 6, 7), v8d);
    const v8d hi = __builtin_convertvector(__builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15), v8d);
    a0 += lo * lo;
    a1 += hi * hi;
  }
  a0 += a1;
  double s = 0;
  for (int e = 0; e < 8; ++e) s += a0[e];
  for (; j < D; ++j) { const double v = load1(x + j); s += v * v; }
  return (float)(s / (double)D);
}

// h[t] += d[t] (rounded to T, as torch's add), then out[t] = w * rnd(h[t] * rsqrt(mean(h[t]^2) + eps)), the
// mean in float32 (mean_sq): transformers' LlamaRMSNorm (also Mistral's, Qwen2's, Qwen3's). d null: no add.
template <typename T>
static void add_rms_norm_run(T* h, int64_t ldh, const T* d, int64_t ldd, const T* w, T* out, int64_t ldo,
                             int64_t rows, int64_t D, float eps) {
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
      const float inv = 1.f / std::sqrt(mean_sq(hr, D) + eps);
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

void add_rms_norm(torch::Tensor h, torch::Tensor d, torch::Tensor w, torch::Tensor out, double eps) {
  const char* fn = "add_rms_norm";
  chk::rank(fn, "h", h, 2, "[T, D]");
  chk::float_cpu(fn, "h", h);
  for (auto [name, t] : {std::pair<const char*, const torch::Tensor*>{"out", &out}, {"weight", &w}, {"delta", &d}})
    chk::cpu(fn, name, *t);
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
  const int64_t ldd = d.numel() ? d.stride(0) : 0;
  if (h.scalar_type() == at::kFloat) {
    add_rms_norm_run<float>(h.data_ptr<float>(), h.stride(0), d.numel() ? d.data_ptr<float>() : nullptr, ldd,
                            w.data_ptr<float>(), out.data_ptr<float>(), out.stride(0), rows, D, (float)eps);
  } else {
    TORCH_CHECK(h.scalar_type() == at::kBFloat16, "add_rms_norm: float32 or bfloat16 tensors");
    auto u = [](const torch::Tensor& t) { return reinterpret_cast<uint16_t*>(t.data_ptr<at::BFloat16>()); };
    add_rms_norm_run<uint16_t>(u(h), h.stride(0), d.numel() ? u(d) : nullptr, ldd, u(w), u(out), out.stride(0),
                               rows, D, (float)eps);
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
