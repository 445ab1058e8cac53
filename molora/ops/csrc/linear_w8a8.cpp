// The two halves of a W8A8 linear around torch._int_mm (oneDNN's s8 x s8 -> s32 GEMM): rounding the activations to
// int8 per row (quantize_rows_), and scaling the int32 sums back (scale_rows_). Each is one pass where torch took six
// to eight ops: at a decode step's 16 rows, the ops' overhead cost more than the GEMM itself (docs/quant_w8a8_kernel.json).
// A GEMM of our own on AVX512-VNNI (vpdpbusd on the row-major weight) was tried on an AVX512-VNNI CPU without AMX
// and ran about half as fast as torch._int_mm (no record kept), so the GEMM stays torch's.
#include "common.h"
#if defined(__AVX512F__)
#include <immintrin.h>
#endif

// xq [M, K] int8, step [M] float32 <- x [M, K] (float32 or bfloat16), each row (times smooth [K], if given) rounded
// as molora.ops.quant.quantize_tokens does: step = max_k |x s| / 127 (at least FLT_MIN), xq = round_half_even(x s /
// step); the same float32 operations in the same order, so xq and step equal torch's bit for bit.
template <typename T>
static void qr_row(const T* x, const float* smooth, int64_t K, float* xf, int8_t* xq, float* step) {
  float amax = 0.0f;
  for (int64_t k = 0; k < K; ++k) {
    const float v = smooth ? load1(x + k) * smooth[k] : load1(x + k);
    xf[k] = v;
    amax = std::max(amax, std::fabs(v));
  }
  const float s = std::max(amax / 127.0f, std::numeric_limits<float>::min());
  int64_t k = 0;
#if defined(__AVX512F__)
  const __m512 sv = _mm512_set1_ps(s);
  for (; k + 16 <= K; k += 16) {
    const __m512 r = _mm512_roundscale_ps(_mm512_div_ps(_mm512_loadu_ps(xf + k), sv),
                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(xq + k), _mm512_cvtepi32_epi8(_mm512_cvtps_epi32(r)));
  }
#endif
  for (; k < K; ++k) xq[k] = (int8_t)std::nearbyint(xf[k] / s);  // round half to even (the default mode)
  *step = s;
}

void quantize_rows_(torch::Tensor xq, torch::Tensor step, torch::Tensor x, torch::Tensor smooth) {
  static const char* fn = "quantize_rows_";
  for (auto [name, t] : {std::pair<const char*, const torch::Tensor*>{"xq", &xq}, {"step", &step}, {"x", &x},
                         {"smooth", &smooth}})
    chk::cpu(fn, name, *t);
  chk::float_cpu(fn, "x", x);
  chk::rank(fn, "x", x, 2, "[M, K]");
  const int64_t M = x.size(0), K = x.size(1);
  TORCH_CHECK(x.stride(1) == 1, fn, ": x needs unit column stride, got ", x.strides());
  TORCH_CHECK(xq.scalar_type() == at::kChar && xq.is_contiguous() && xq.dim() == 2 && xq.size(0) == M &&
              xq.size(1) == K, fn, ": xq must be a contiguous int8 [M, K] = [", M, ", ", K, "], got ",
              xq.scalar_type(), " ", xq.sizes());
  TORCH_CHECK(step.scalar_type() == at::kFloat && step.is_contiguous() && step.numel() == M, fn,
              ": step must be a contiguous float32 of M = ", M, " values, got ", step.scalar_type(), " ", step.sizes());
  TORCH_CHECK(smooth.numel() == 0 || (smooth.scalar_type() == at::kFloat && smooth.is_contiguous() &&
              smooth.dim() == 1 && smooth.numel() == K), fn, ": smooth must be a contiguous float32 [K] = [", K,
              "] (or empty), got ", smooth.scalar_type(), " ", smooth.sizes());
  const float* mp = smooth.numel() ? smooth.data_ptr<float>() : nullptr;
  int8_t* qp = xq.data_ptr<int8_t>();
  float* sp = step.data_ptr<float>();
  const int64_t ldx = x.stride(0);
  at::parallel_for(0, M, 16, [&](int64_t m0, int64_t m1) {
    std::vector<float> xf(K);
    for (int64_t m = m0; m < m1; ++m) {
      if (x.scalar_type() == at::kFloat)
        qr_row(x.data_ptr<float>() + m * ldx, mp, K, xf.data(), qp + m * K, sp + m);
      else
        qr_row(reinterpret_cast<const uint16_t*>(x.data_ptr()) + m * ldx, mp, K, xf.data(), qp + m * K, sp + m);
    }
  });
}

// y [M, N] (float32 or bfloat16) <- ((float) acc[m, n] * step[m]) * scale[n] (+ bias[n]), rounded once to y's dtype:
// what torch computes as acc.float().mul_(step).mul_(scale) (then .add_(bias)), in one pass.
template <typename T>
static void sr_rows(T* y, int64_t ldy, const int32_t* acc, const float* step, const float* scale, const T* bias,
                    int64_t m0, int64_t m1, int64_t N) {
  for (int64_t m = m0; m < m1; ++m) {
    const float s = step[m];
    const int32_t* a = acc + m * N;
    T* yr = y + m * ldy;
    for (int64_t n = 0; n < N; ++n) {
      const float v = ((float)a[n] * s) * scale[n];
      store1(yr + n, bias ? v + load1(bias + n) : v);
    }
  }
}

void scale_rows_(torch::Tensor y, torch::Tensor acc, torch::Tensor step, torch::Tensor scale, torch::Tensor bias) {
  static const char* fn = "scale_rows_";
  for (auto [name, t] : {std::pair<const char*, const torch::Tensor*>{"y", &y}, {"acc", &acc}, {"step", &step},
                         {"scale", &scale}, {"bias", &bias}})
    chk::cpu(fn, name, *t);
  chk::float_cpu(fn, "y", y);
  chk::rank(fn, "y", y, 2, "[M, N]");
  const int64_t M = y.size(0), N = y.size(1);
  TORCH_CHECK(y.stride(1) == 1, fn, ": y needs unit column stride, got ", y.strides());
  TORCH_CHECK(acc.scalar_type() == at::kInt && acc.is_contiguous() && acc.dim() == 2 && acc.size(0) == M &&
              acc.size(1) == N, fn, ": acc must be a contiguous int32 [M, N] = [", M, ", ", N, "], got ",
              acc.scalar_type(), " ", acc.sizes());
  TORCH_CHECK(step.scalar_type() == at::kFloat && step.is_contiguous() && step.numel() == M, fn,
              ": step must be a contiguous float32 of M = ", M, " values, got ", step.scalar_type(), " ", step.sizes());
  TORCH_CHECK(scale.scalar_type() == at::kFloat && scale.is_contiguous() && scale.dim() == 1 && scale.numel() == N,
              fn, ": scale must be a contiguous float32 [N] = [", N, "], got ", scale.scalar_type(), " ", scale.sizes());
  if (bias.numel()) {
    chk::same_dtype(fn, "bias", bias, "y", y);
    TORCH_CHECK(bias.dim() == 1 && bias.numel() == N && bias.is_contiguous(), fn, ": bias must be a contiguous [N] = [",
                N, "] (or empty), got ", bias.sizes());
  }
  const int32_t* ap = acc.data_ptr<int32_t>();
  const float* tp = step.data_ptr<float>();
  const float* sp = scale.data_ptr<float>();
  at::parallel_for(0, M, std::max<int64_t>(1, 16384 / std::max<int64_t>(N, 1)), [&](int64_t m0, int64_t m1) {
    if (y.scalar_type() == at::kFloat)
      sr_rows(y.data_ptr<float>(), y.stride(0), ap, tp, sp, bias.numel() ? bias.data_ptr<float>() : nullptr, m0, m1,
              N);
    else
      sr_rows(reinterpret_cast<uint16_t*>(y.data_ptr()), y.stride(0), ap, tp, sp,
              bias.numel() ? reinterpret_cast<const uint16_t*>(bias.data_ptr()) : nullptr, m0, m1, N);
  });
}
