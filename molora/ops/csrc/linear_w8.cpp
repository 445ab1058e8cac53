// A weight-only int8 GEMM: float32 or bfloat16 activations times an int8 weight with one float32 scale per output
// channel, the weight read in its own row-major layout (no packed copy) and widened to float32 a few rows at a time.
#include "common.h"
#ifdef __AVX512F__
#include <immintrin.h>
#endif

// ------------------------------------------------------------------------------------ weight-only int8 GEMM
// y [M, N] = (x [M, K] @ q.T) * scale (+ bias), q int8 [N, K] (row-major, as molora.ops.quant.quantize_int8 makes
// it), scale float32 [N], x / y / bias float32 or bfloat16 (one dtype). Each output is a dot product over k: 16
// lanes of float32 partial sums (lane l sums k = l, l + 16, ...), added in a tree at the end (hsum), then times the
// channel's scale, plus the bias, rounded once to y's dtype. So a row's result depends on that row alone (not on M,
// nor on the other rows), and equals the float32 product with the dequantized weight q * scale up to the order of
// float32 sums. A task is W8_TASK output channels; it runs over chunks of W8_MC rows (kept in L2) and, in each, over
// its channels W8_NB at a time: their int8 weight rows are widened once to float32 into a buffer of the thread
// (vpmovsxbd + vcvtdq2ps; 4 x K floats, in L1), then the chunk's rows run W8_MB at a time with W8_MB x W8_NB vector
// accumulators, each step of 16 k loading W8_NB weight vectors and W8_MB activation vectors. Widening once per chunk
// rather than at every row pass takes the widening off the FMA ports' loop (it had cost 8 of every 32 vector
// operations there). Decode is memory-bound on the weights: a quarter of float32's bytes. K must be a multiple of 16 (SmolLM2's 576 and 1536 are).
constexpr int W8_MB = 6;  // rows per pass: 6 x 4 accumulators + 4 weights + 1 activation = 29 of 32 vector registers
constexpr int W8_NB = 4;  // output channels per pass
constexpr int64_t W8_TASK = 16;  // output channels per parallel task (4 passes of W8_NB)
constexpr int64_t W8_MC = 48;  // rows per chunk: the chunk's activations (48 x K floats, 295 KB at K = 1536) stay in L2
                               // while the task's W8_TASK weight rows pass over them

// 16 int8 -> 16 float32: vpmovsxbd + vcvtdq2ps with AVX-512 (GCC's vector conversion of int8 lanes compiles to 16
// scalar conversions, measured 4x slower than the float32 GEMM), lane by lane elsewhere.
static inline v16 widen_i8(const int8_t* p) {
#ifdef __AVX512F__
  return (v16)_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
#else
  v16 v;
  for (int l = 0; l < 16; ++l) v[l] = p[l];
  return v;
#endif
}

template <typename T, int MB, int NB>
static inline void w8_tile(const T* x, int64_t ldx, const float* q, int64_t K, const float* scale, const T* bias,
                           T* y, int64_t ldy) {
  v16 acc[MB][NB];
  for (int i = 0; i < MB; ++i)
    for (int j = 0; j < NB; ++j) acc[i][j] = v16{};
  for (int64_t k = 0; k < K; k += 16) {
    v16 w[NB];
    for (int j = 0; j < NB; ++j) w[j] = load16(q + j * K + k);
    for (int i = 0; i < MB; ++i) {
      const v16 xv = load16(x + i * ldx + k);
      for (int j = 0; j < NB; ++j) acc[i][j] += xv * w[j];
    }
  }
  for (int i = 0; i < MB; ++i)
    for (int j = 0; j < NB; ++j) {
      const float v = hsum(acc[i][j]) * scale[j];
      store1(y + i * ldy + j, bias ? v + load1(bias + j) : v);
    }
}

template <typename T, int NB>
static void w8_rows(int64_t mb, const T* x, int64_t ldx, const float* q, int64_t K, const float* scale,
                    const T* bias, T* y, int64_t ldy) {
  switch (mb) {
    case 6: w8_tile<T, 6, NB>(x, ldx, q, K, scale, bias, y, ldy); break;
    case 5: w8_tile<T, 5, NB>(x, ldx, q, K, scale, bias, y, ldy); break;
    case 4: w8_tile<T, 4, NB>(x, ldx, q, K, scale, bias, y, ldy); break;
    case 3: w8_tile<T, 3, NB>(x, ldx, q, K, scale, bias, y, ldy); break;
    case 2: w8_tile<T, 2, NB>(x, ldx, q, K, scale, bias, y, ldy); break;
    default: w8_tile<T, 1, NB>(x, ldx, q, K, scale, bias, y, ldy); break;
  }
}

template <typename T>
static void w8_run(const torch::Tensor& y, const torch::Tensor& x, const torch::Tensor& q,
                   const torch::Tensor& scale, const torch::Tensor& bias) {
  const int64_t M = x.size(0), K = x.size(1), N = q.size(0), ldx = x.stride(0), ldy = y.stride(0);
  const T* xp = reinterpret_cast<const T*>(x.data_ptr());
  const T* bp = bias.numel() ? reinterpret_cast<const T*>(bias.data_ptr()) : nullptr;
  T* yp = reinterpret_cast<T*>(y.data_ptr());
  const int8_t* qp = q.data_ptr<int8_t>();
  const float* sp = scale.data_ptr<float>();
  at::parallel_for(0, (N + W8_TASK - 1) / W8_TASK, 1, [&](int64_t t0, int64_t t1) {
    std::vector<float> wbuf(W8_NB * K);  // the pass's W8_NB weight rows widened to float32 (24 KB at K = 1536: L1)
    float* qn = wbuf.data();
    for (int64_t c0 = 0; c0 < M; c0 += W8_MC)
    for (int64_t n0 = t0 * W8_TASK; n0 < std::min(N, t1 * W8_TASK); n0 += W8_NB) {
      const int64_t nb = std::min<int64_t>(W8_NB, N - n0);
      for (int64_t i = 0; i < nb * K; i += 16) store16(qn + i, widen_i8(qp + n0 * K + i));
      const T* bn = bp ? bp + n0 : nullptr;
      for (int64_t m0 = c0; m0 < std::min(M, c0 + W8_MC); m0 += W8_MB) {
        const int64_t mb = std::min<int64_t>(W8_MB, std::min(M, c0 + W8_MC) - m0);
        const T* xm = xp + m0 * ldx;
        T* ym = yp + m0 * ldy + n0;
        if (nb == 4) w8_rows<T, 4>(mb, xm, ldx, qn, K, sp + n0, bn, ym, ldy);
        else if (nb == 3) w8_rows<T, 3>(mb, xm, ldx, qn, K, sp + n0, bn, ym, ldy);
        else if (nb == 2) w8_rows<T, 2>(mb, xm, ldx, qn, K, sp + n0, bn, ym, ldy);
        else w8_rows<T, 1>(mb, xm, ldx, qn, K, sp + n0, bn, ym, ldy);
      }
    }
  });
}

void linear_w8(torch::Tensor y, torch::Tensor x, torch::Tensor q, torch::Tensor scale, torch::Tensor bias) {
  static const char* fn = "linear_w8";
  for (auto [name, t] : {std::pair<const char*, const torch::Tensor*>{"y", &y}, {"x", &x}, {"q", &q},
                         {"scale", &scale}, {"bias", &bias}})
    chk::cpu(fn, name, *t);
  chk::float_cpu(fn, "x", x);
  chk::same_dtype(fn, "y", y, "x", x);
  chk::rank(fn, "x", x, 2, "[M, K]");
  chk::rank(fn, "y", y, 2, "[M, N]");
  chk::rank(fn, "q", q, 2, "[N, K]");
  TORCH_CHECK(q.scalar_type() == at::kChar && q.is_contiguous(), fn, ": q must be a contiguous int8 [N, K], got ",
              q.scalar_type(), q.is_contiguous() ? "" : " (not contiguous)");
  TORCH_CHECK(x.stride(1) == 1 && y.stride(1) == 1, fn, ": x and y need unit column stride, got x ", x.strides(),
              " and y ", y.strides());
  TORCH_CHECK(x.size(1) == q.size(1) && x.size(1) % 16 == 0, fn, ": x [M, K] and q [N, K] must share K, a multiple "
              "of 16; got x ", x.sizes(), " and q ", q.sizes());
  TORCH_CHECK(y.size(0) == x.size(0) && y.size(1) == q.size(0), fn, ": y must be [M, N] = [", x.size(0), ", ",
              q.size(0), "], got ", y.sizes());
  TORCH_CHECK(scale.scalar_type() == at::kFloat && scale.is_contiguous() && scale.dim() == 1 &&
              scale.numel() == q.size(0), fn, ": scale must be a contiguous float32 [N] = [", q.size(0), "], got ",
              scale.scalar_type(), " ", scale.sizes());
  if (bias.numel()) {
    chk::same_dtype(fn, "bias", bias, "x", x);
    TORCH_CHECK(bias.dim() == 1 && bias.numel() == q.size(0) && bias.is_contiguous(), fn,
                ": bias must be a contiguous [N] = [", q.size(0), "] (or empty), got ", bias.sizes());
  }
  if (x.scalar_type() == at::kFloat) w8_run<float>(y, x, q, scale, bias);
  else w8_run<uint16_t>(y, x, q, scale, bias);
}
