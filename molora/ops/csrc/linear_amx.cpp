// A bfloat16 GEMM on the CPU's AMX tiles, the weight packed once into the tiles' layout (molora.ops.packed.tiles).
#include "common.h"

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

// The driver shared by linear_amx and linear_amx_w8: `widen(p0, two, buf)` gives the bf16 tiles of panels p0 (and
// p0 + 1 where `two`): a pointer into P (bf16) or `buf` filled from the int8 tiles; `scale` (or nullptr) multiplies
// each output column before the bias is added.
#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
template <typename Widen>
static void amx_gemm(torch::Tensor& y, const torch::Tensor& x, int64_t KC, int64_t np, const float* scale,
                     const torch::Tensor& bias, Widen widen) {
  TORCH_CHECK(amx_permitted(), "linear_amx: the kernel may not use the AMX tiles here");
  const int64_t M = x.size(0), K = x.size(1), ldx = x.stride(0), ldy = y.stride(0);
  auto u = [](const torch::Tensor& t) { return reinterpret_cast<uint16_t*>(t.data_ptr<at::BFloat16>()); };
  const uint16_t* xp = u(x);
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
    std::vector<uint16_t> buf;
    for (int64_t g = g0; g < g1; ++g) {
      const int64_t p0 = 2 * g;
      const bool two = p0 + 1 < np;
      const uint16_t* b0 = widen(p0, two, buf);
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
          const v16 s = scale ? load16(scale + n0) : v16{} + 1.0f;
          for (int64_t i = 0; i < 16 && r0 + i < M; ++i)
            store16(yp + (r0 + i) * ldy + n0, scale ? load16(c[q][i]) * s + b : load16(c[q][i]) + b);
        }
      }
    }
    _tile_release();
  });
}
#endif

static void amx_check(const char* fn, const torch::Tensor& y, const torch::Tensor& x, const torch::Tensor& P,
                      const torch::Tensor& bias, at::ScalarType wtype) {
  for (auto [name, t] : {std::pair<const char*, const torch::Tensor*>{"y", &y}, {"x", &x}, {"P", &P}, {"bias", &bias}})
    chk::cpu(fn, name, *t);
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && P.scalar_type() == wtype &&
              y.scalar_type() == at::kBFloat16 && x.dim() == 2 && y.dim() == 2 && P.dim() == 4 && P.size(2) == 16 &&
              P.size(3) == 32 && P.is_contiguous() && x.stride(1) == 1 && y.stride(1) == 1 &&
              x.size(1) == 32 * P.size(1) && y.size(0) == x.size(0) && y.size(1) == 16 * P.size(0) &&
              (bias.numel() == 0 || (bias.numel() == y.size(1) && bias.is_contiguous() &&
                                     bias.scalar_type() == at::kBFloat16)),
              fn, ": bfloat16 x [M, K] (unit column stride), ", wtype == at::kChar ? "int8" : "bfloat16",
              " P [N/16, K/32, 16, 32], y [M, N], bias [N] or empty; got x ", x.scalar_type(), " ", x.sizes(), ", P ",
              P.scalar_type(), " ", P.sizes(), ", y ", y.scalar_type(), " ", y.sizes(), ", bias ", bias.sizes());
}

void linear_amx(torch::Tensor y, torch::Tensor x, torch::Tensor P, torch::Tensor bias) {
  amx_check("linear_amx", y, x, P, bias, at::kBFloat16);
#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
  const uint16_t* pp = reinterpret_cast<const uint16_t*>(P.data_ptr<at::BFloat16>());
  const int64_t KC = P.size(1);
  amx_gemm(y, x, KC, P.size(0), nullptr, bias,
           [&](int64_t p0, bool, std::vector<uint16_t>&) { return pp + p0 * KC * 512; });
#else
  TORCH_CHECK(false, "linear_amx: built without AMX (amx_ready() is false here)");
#endif
}

// ------------------------------------------------------------------------------------ int8 weights on AMX tiles
// y [M, N] = (x [M, K] @ q.T) * scale (+ bias), bfloat16 x / y / bias, q int8 in the tile layout of linear_amx
// (Pq [N / 16, K / 32, 16, 32] int8: molora.ops.packed.tiles of q), scale float32 [N]: weight-only int8. Each task
// (a pair of panels) first widens its int8 tiles to bf16 into a buffer of its thread (|q| <= 127 is exact in bf16:
// 8 significant bits), then runs linear_amx's loop over every row tile on it: exact products, float32 sums in k order,
// times the channel's scale, plus the bias, one rounding to bf16. The weights come from memory as half of bf16's
// bytes; the widening (vpmovsxbd, vcvtdq2ps, vcvtne2ps2bf16: 5 instructions per 32 weights) is done once a call.
void linear_amx_w8(torch::Tensor y, torch::Tensor x, torch::Tensor Pq, torch::Tensor scale, torch::Tensor bias) {
  amx_check("linear_amx_w8", y, x, Pq, bias, at::kChar);
  chk::cpu("linear_amx_w8", "scale", scale);
  TORCH_CHECK(scale.scalar_type() == at::kFloat && scale.is_contiguous() && scale.dim() == 1 &&
              scale.numel() == y.size(1), "linear_amx_w8: scale must be a contiguous float32 [N] = [", y.size(1),
              "], got ", scale.scalar_type(), " ", scale.sizes());
#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__)
  const int8_t* qp = Pq.data_ptr<int8_t>();
  const int64_t KC = Pq.size(1);
  amx_gemm(y, x, KC, Pq.size(0), scale.data_ptr<float>(), bias,
           [&](int64_t p0, bool two, std::vector<uint16_t>& buf) {
             const int64_t n = (two ? 2 : 1) * KC * 512;  // weights of the task's panels
             if ((int64_t)buf.size() < n) buf.resize(n);
             const int8_t* src = qp + p0 * KC * 512;
             for (int64_t i = 0; i < n; i += 32) {
               const __m512 lo = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)(src + i))));
               const __m512 hi =
                   _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)(src + i + 16))));
               const __m512bh b = _mm512_cvtne2ps_pbh(hi, lo);
               std::memcpy(buf.data() + i, &b, 64);
             }
             return (const uint16_t*)buf.data();
           });
#else
  TORCH_CHECK(false, "linear_amx_w8: built without AMX and AVX512_BF16 (amx_ready() is false here)");
#endif
}
