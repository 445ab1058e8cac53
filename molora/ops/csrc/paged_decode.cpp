// Decode attention over the paged KV cache, read in place (paged_decode, and paged_decode_rows on rows of a step).
#include "common.h"

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

// Rows prefetched ahead in attend_tiled. Measured against no prefetch (experiments/ab_paged_decode.py, 16 repetitions):
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
