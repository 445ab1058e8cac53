// The greedy pick of a step's logits and the check that they are finite, in one pass (greedy_rows).
#include "common.h"

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
  const int64_t B = logits.size(0), V = logits.size(1), ld = logits.stride(0);
  if (logits.scalar_type() == at::kFloat) {
    greedy_rows_run<float>(logits.data_ptr<float>(), ld, B, V, ids.data_ptr<int64_t>(), finite.data_ptr<bool>());
  } else {
    TORCH_CHECK(logits.scalar_type() == at::kBFloat16, "greedy_rows: float32 or bfloat16 logits");
    greedy_rows_run<uint16_t>(reinterpret_cast<const uint16_t*>(logits.data_ptr<at::BFloat16>()), ld, B, V,
                              ids.data_ptr<int64_t>(), finite.data_ptr<bool>());
  }
}
