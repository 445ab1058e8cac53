// Shared by molora's C++ CPU kernels (one file per kernel family in this folder, built as one extension by
// molora/ops/kernel_build.py, keyed by a hash of this folder and the flags): includes, the 16-lane float vector type,
// element access for float32 and bfloat16, a horizontal sum and a vector exp, and the entry points the op registry
// (bindings.cpp) and the decode block (decode_block.cpp) call. Each entry point checks its inputs (checks.h). They
// are torch ops (torch.ops.molora.*): torch's op call releases the GIL while one runs, so a server's event loop is
// not stopped by a step. No pybind11 here: the library registers ops, it is not a Python module.
#pragma once
#include <ATen/Parallel.h>
#include <torch/library.h>
#include <torch/types.h>
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
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


// ------------------------------------------------------------------------------------ entry points
// lora_fused.cpp
bool bf16_dot();
bool lora_fused_(torch::Tensor out, torch::Tensor x, torch::Tensor A, torch::Tensor B, torch::Tensor tok,
                 torch::Tensor scale, torch::Tensor weight, std::vector<int64_t> counts);
// paged_decode.cpp
void paged_decode(torch::Tensor out, torch::Tensor q, torch::Tensor kc, torch::Tensor vc, torch::Tensor tables,
                  torch::Tensor ctx, int64_t block_size, double scale, int64_t window);
void paged_decode_rows(torch::Tensor out, torch::Tensor q, torch::Tensor kc, torch::Tensor vc, torch::Tensor tables,
                       torch::Tensor ctx, torch::Tensor rows, int64_t block_size, double scale, int64_t window);
// glue.cpp
void add_rms_norm(torch::Tensor h, torch::Tensor d, torch::Tensor w, torch::Tensor out, double eps);
void rope_write(torch::Tensor q, torch::Tensor k, torch::Tensor v, torch::Tensor cos, torch::Tensor sin,
                torch::Tensor pos, torch::Tensor wrows, torch::Tensor kc, torch::Tensor vc);
void silu_mul(torch::Tensor g, torch::Tensor u);
// linear_panels.cpp, linear_amx.cpp
void linear_panels(torch::Tensor y, torch::Tensor x, torch::Tensor P, torch::Tensor bias);
bool panels_fit();
bool amx_ready();
void linear_amx(torch::Tensor y, torch::Tensor x, torch::Tensor P, torch::Tensor bias);
void linear_amx_w8(torch::Tensor y, torch::Tensor x, torch::Tensor Pq, torch::Tensor scale, torch::Tensor bias);
// linear_w8.cpp
void linear_w8(torch::Tensor y, torch::Tensor x, torch::Tensor q, torch::Tensor scale, torch::Tensor bias);
// linear_w8a8.cpp
void quantize_rows_(torch::Tensor xq, torch::Tensor step, torch::Tensor x, torch::Tensor smooth);
void scale_rows_(torch::Tensor y, torch::Tensor acc, torch::Tensor step, torch::Tensor scale, torch::Tensor bias);
// decode_block.cpp: registers the BoundBlock class (torch.classes.molora.BoundBlock)
void register_decode_block(torch::Library& m);
