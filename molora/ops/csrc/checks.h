// Input checks shared by the kernels' entry points. Every entry point checks what it will index before it touches
// memory: device, dtype, rank, shape and strides of each tensor, and the values of each index tensor (one O(n) pass
// before the kernel runs, never inside its loops). A failed check raises c10::Error, which torch's op call turns into a
// Python RuntimeError whose message names the function, the argument, the value found and the one expected.
#pragma once
#include <torch/types.h>  // torch::Tensor (= at::Tensor), without the Python bindings of torch/extension.h
#include <cstdint>
#include <vector>

namespace molora_checks {

inline void cpu(const char* fn, const char* name, const torch::Tensor& t) {
  TORCH_CHECK(t.device().is_cpu(), fn, ": ", name, " must be a CPU tensor, got one on ", t.device());
}

// float32 or bfloat16, on the CPU
inline void float_cpu(const char* fn, const char* name, const torch::Tensor& t) {
  cpu(fn, name, t);
  TORCH_CHECK(t.scalar_type() == at::kFloat || t.scalar_type() == at::kBFloat16, fn, ": ", name,
              " must be float32 or bfloat16, got ", t.scalar_type());
}

// `t` has the dtype of `ref` (named ref_name)
inline void same_dtype(const char* fn, const char* name, const torch::Tensor& t, const char* ref_name,
                       const torch::Tensor& ref) {
  TORCH_CHECK(t.scalar_type() == ref.scalar_type(), fn, ": ", name, " is ", t.scalar_type(), " but ", ref_name,
              " is ", ref.scalar_type(), "; they must share one dtype");
}

inline void rank(const char* fn, const char* name, const torch::Tensor& t, int64_t dims, const char* shape) {
  TORCH_CHECK(t.dim() == dims, fn, ": ", name, " must be ", shape, " (", dims, " dims), got shape ", t.sizes());
}

// an index tensor: int64, contiguous, on the CPU, [n]
inline void index(const char* fn, const char* name, const torch::Tensor& t, int64_t n) {
  cpu(fn, name, t);
  TORCH_CHECK(t.scalar_type() == at::kLong && t.is_contiguous(), fn, ": ", name,
              " must be a contiguous int64 tensor, got ", t.scalar_type(), t.is_contiguous() ? "" : " (not contiguous)");
  TORCH_CHECK(t.dim() == 1 && t.numel() == n, fn, ": ", name, " must have shape [", n, "], got ", t.sizes());
}

// lo <= p[i] < hi for i < n
inline void in_range(const char* fn, const char* name, const int64_t* p, int64_t n, int64_t lo, int64_t hi,
                     const char* what) {
  for (int64_t i = 0; i < n; ++i)
    TORCH_CHECK(p[i] >= lo && p[i] < hi, fn, ": ", name, "[", i, "] = ", p[i], " is outside [", lo, ", ", hi, "), ",
                what);
}

// p[0..n) in [0, hi) and no value twice (two tasks writing one row would race and one result would be lost)
inline void distinct(const char* fn, const char* name, const int64_t* p, int64_t n, int64_t hi, const char* what) {
  in_range(fn, name, p, n, 0, hi, what);
  std::vector<uint8_t> seen(hi, 0);
  for (int64_t i = 0; i < n; ++i) {
    TORCH_CHECK(!seen[p[i]], fn, ": ", name, "[", i, "] = ", p[i], " appears twice; each must appear once (", what,
                ")");
    seen[p[i]] = 1;
  }
}

}  // namespace molora_checks
