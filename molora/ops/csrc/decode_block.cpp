// A whole Llama-shaped decoder block of a decode step as one call of the other kernels (BoundBlock).
#include <ATen/record_function.h>
#include <chrono>
#include <optional>
#include <torch/custom_class.h>
#include "common.h"

// ------------------------------------------------------------------------------------ one decoder block of a decode step
// A Llama-shaped block (RMSNorm, q/k/v/o, RoPE, attention over the paged cache, RMSNorm, gate/up, SiLU * up, down)
// on a step whose every row decodes (one new token per sequence), as one call: the other files' kernels in the order and on
// the arguments the runner's Python path (molora.model.block.Block) gives them, so its results are those of that
// path bit for bit; what it saves is the Python between the kernels (about 20 calls a block). h [T, D] is updated in
// place (h += delta before the first norm, h += attention output before the second); returns the block's MLP output
// (the next block's delta). Linears in the order q, k, v, o, gate, up, down: P packed weights (panels [N/16, K, 16]
// float32 or AMX tiles [N/16, K/32, 16, 32] bfloat16), or a weight-only int8 base (int8 [N, K] for linear_w8, int8
// tiles [N/16, K/32, 16, 32] for linear_amx_w8) with its float32 scales WS [N] (empty for a float weight); bias or
// empty; a routed linear's A, B (slot-major), scale
// (float32) run lora_fused_ on the step's tok / weight / counts (lora: the step has routing), an empty A adds
// nothing; counts of c * S entries (S = A's slots, c > 1) are c choice columns of a top-k step one after another
// (tok and weight likewise), run as c calls in column order, as the Python path adds them. clock: empty, or float64 [6] to which each kernel kind's wall seconds are added (linear, lora, norm, rope,
// attention, silu_mul: the bench's kernel share); each kernel is also a torch.profiler range named as
// its op (as the Python path's op calls are named). Called by BoundBlock::run only, which checked the 7 linears
// when it was bound.

static torch::Tensor decode_block(const torch::Tensor& h, const torch::Tensor& delta, const torch::Tensor& ln1,
                                  const torch::Tensor& ln2, double eps,
                                  const std::vector<torch::Tensor>& P, const std::vector<torch::Tensor>& WS,
                                  const std::vector<torch::Tensor>& bias,
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
  // one kernel call as a profiler range named `name`, its wall time added to clock slot `kind` (if clocked)
  auto timed = [&](int kind, const char* name, auto&& call) {
    RECORD_FUNCTION(name, std::vector<c10::IValue>());
    const auto t0 = std::chrono::steady_clock::now();
    call();
    if (ck) ck[kind] += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  };
  auto norm = [&](const torch::Tensor& d, const torch::Tensor& w) {
    torch::Tensor out = at::empty(h.sizes(), opts);
    timed(2, "molora::add_rms_norm", [&] { add_rms_norm(h, d, w, out, eps); });
    return out;
  };
  auto linear = [&](int i, const torch::Tensor& x) {
    const torch::Tensor& p = P[i];
    const bool w8 = p.scalar_type() == at::kChar;
    torch::Tensor y = at::empty({T, w8 && p.dim() == 2 ? p.size(0) : 16 * p.size(0)}, opts);
    if (w8 && p.dim() == 4) timed(0, "molora::linear_amx_w8", [&] { linear_amx_w8(y, x, p, WS[i], bias[i]); });
    else if (w8) timed(0, "molora::linear_w8", [&] { linear_w8(y, x, p, WS[i], bias[i]); });
    else if (p.dim() == 4) timed(0, "molora::linear_amx", [&] { linear_amx(y, x, p, bias[i]); });
    else timed(0, "molora::linear_panels", [&] { linear_panels(y, x, p, bias[i]); });
    if (lora && A[i].numel())
      timed(1, "molora::lora_fused_", [&] {
        const int64_t S = A[i].size(0), n = (int64_t)counts.size();
        if (n <= S) {
          TORCH_CHECK(lora_fused_(y, x, A[i], B[i], tok, scale[i], weight, counts),
                      "decode_block: the LoRA kernel declined the layout of linear ", i);
          return;
        }
        TORCH_CHECK(n % S == 0, "decode_block: ", n, " counts are neither at most S = ", S, " nor whole columns of S");
        int64_t off = 0;
        for (int64_t c = 0; c < n / S; ++c) {  // one top-1 call per choice column: each writes a row once
          std::vector<int64_t> col(counts.begin() + c * S, counts.begin() + (c + 1) * S);
          int64_t m = 0;
          for (int64_t v : col) m += v;
          TORCH_CHECK(off + m <= tok.numel(), "decode_block: counts name more pairs than tok has (", tok.numel(), ")");
          const torch::Tensor w = weight.numel() ? weight.narrow(0, off, m) : weight;
          TORCH_CHECK(lora_fused_(y, x, A[i], B[i], tok.narrow(0, off, m), scale[i], w, col),
                      "decode_block: the LoRA kernel declined the layout of linear ", i);
          off += m;
        }
      });
    return y;
  };
  torch::Tensor x = norm(delta, ln1);
  torch::Tensor q = linear(0, x), k = linear(1, x), v = linear(2, x);
  torch::Tensor q3 = q.view({T, H, hd}), k3 = k.view({T, Hkv, hd}), v3 = v.view({T, Hkv, hd});
  timed(3, "molora::rope_write", [&] { rope_write(q3, k3, v3, cos, sin, pos, wrows, kc, vc); });
  torch::Tensor att = at::empty({T, H, hd}, opts);
  timed(4, "molora::paged_decode_rows",
        [&] { paged_decode_rows(att, q3, kc, vc, tables, ctx, rows, block_size, scaling, window); });
  torch::Tensor o = linear(3, att.view({T, H * hd}));
  x = norm(o, ln2);
  torch::Tensor g = linear(4, x), u = linear(5, x);
  timed(5, "molora::silu_mul", [&] { silu_mul(g, u); });
  return linear(6, g);
}


// A block's arguments that stay the same from step to step (weights packed, adapter slots, norms, RoPE tables, its
// cache views, shapes), bound once in C++ (molora.model.block.Block binds them: `fused_cpu.bind_block`), so that a
// step passes only what changes (h, the routing, the positions and cache rows). `watched`: the tensors from which the
// bound ones were derived or whose writes mean a rebind (base weights, from which the packed copies were made; a
// scale the bound float32 copy was made from; the norms); `held`: tensors the block reads in place, so that writes
// into them need no rebind (the adapter slots, written by every load and unload): `run` returns an undefined tensor
// (None in Python), having done nothing, once a watched tensor has moved to other storage or been written in place,
// or a held one has moved to other storage, since the bind; the caller binds again.
struct BoundBlock : torch::CustomClassHolder {
  std::vector<torch::Tensor> P, WS, bias, A, B, scale, watched, held;
  torch::Tensor ln1, ln2, cos, sin, kc, vc;
  double eps, scaling;
  int64_t H, Hkv, hd, block_size, window;
  std::vector<const void*> ptrs, held_ptrs;
  std::vector<int64_t> versions;

  BoundBlock(std::vector<torch::Tensor> P_, std::vector<torch::Tensor> WS_, std::vector<torch::Tensor> bias_, std::vector<torch::Tensor> A_,
             std::vector<torch::Tensor> B_, std::vector<torch::Tensor> scale_, torch::Tensor ln1_, torch::Tensor ln2_,
             double eps_, int64_t H_, int64_t Hkv_, int64_t hd_, torch::Tensor cos_,
             torch::Tensor sin_, torch::Tensor kc_, torch::Tensor vc_, int64_t block_size_, double scaling_,
             int64_t window_, std::vector<torch::Tensor> watched_, std::vector<torch::Tensor> held_)
      : P(P_), WS(WS_), bias(bias_), A(A_), B(B_), scale(scale_), watched(watched_), held(held_), ln1(ln1_), ln2(ln2_),
        cos(cos_),
        sin(sin_), kc(kc_), vc(vc_), eps(eps_), scaling(scaling_), H(H_), Hkv(Hkv_), hd(hd_),
        block_size(block_size_), window(window_) {
    TORCH_CHECK(P.size() == 7 && WS.size() == 7 && bias.size() == 7 && A.size() == 7 && B.size() == 7 && scale.size() == 7,
                "bind_block: 7 linears (q, k, v, o, gate, up, down) expected");
    TORCH_CHECK(H >= 1 && Hkv >= 1 && hd >= 2 && H % Hkv == 0, "bind_block: heads (H ", H, ", Hkv ", Hkv,
                ", head_dim ", hd, "): H must be a positive multiple of Hkv, head_dim >= 2");
    TORCH_CHECK(block_size >= 1 && window >= 0, "bind_block: block_size ", block_size, " must be >= 1 and window ",
                window, " >= 0 (0: none)");
    for (int i = 0; i < 7; ++i) {
      const bool w8 = P[i].scalar_type() == at::kChar;
      TORCH_CHECK(w8 ? (P[i].dim() == 2 || P[i].dim() == 4) && WS[i].numel() > 0 : (P[i].dim() == 3 || P[i].dim() == 4),
                  "bind_block: linear ", i, "'s weight must be float panels [N/16, K, 16] or AMX tiles "
                  "[N/16, K/32, 16, 32], or int8 [N, K] or int8 tiles with its scales; got ", P[i].scalar_type(), " ",
                  P[i].sizes(), " with ", WS[i].numel(), " scales");
    }
    for (const auto& t : watched) { ptrs.push_back(t.data_ptr()); versions.push_back(t._version()); }
    for (const auto& t : held) held_ptrs.push_back(t.data_ptr());
  }

  bool current() const {
    for (size_t i = 0; i < watched.size(); ++i)
      if (watched[i].data_ptr() != ptrs[i] || watched[i]._version() != versions[i]) return false;
    for (size_t i = 0; i < held.size(); ++i)
      if (held[i].data_ptr() != held_ptrs[i]) return false;
    return true;
  }

  std::optional<torch::Tensor> run(torch::Tensor h, torch::Tensor delta, bool lora, torch::Tensor tok,
                                   torch::Tensor weight, std::vector<int64_t> counts, torch::Tensor pos,
                                   torch::Tensor wrows, torch::Tensor tables, torch::Tensor ctx, torch::Tensor rows,
                                   torch::Tensor clock) {
    if (!current()) return std::nullopt;
    return decode_block(h, delta, ln1, ln2, eps, P, WS, bias, A, B, scale, lora, tok, weight, counts, H, Hkv, hd,
                        cos, sin, pos, wrows, kc, vc, tables, ctx, rows, block_size, scaling, window, clock);
  }
};

// torch.classes.molora.BoundBlock(...): a TorchScript custom class, so the binding is a torch object like the ops
// (no pybind11 in the library), and the op run_block(block, step...) runs it: a step is an op call (the dispatcher's
// path, about 5 us here), not a method call on the object (TorchScript's method path cost more per call, measured).
// run_block answers None where a watched tensor changed since the bind.
void register_decode_block(torch::Library& m) {
  m.class_<BoundBlock>("BoundBlock")
      .def(torch::init<std::vector<torch::Tensor>, std::vector<torch::Tensor>, std::vector<torch::Tensor>,
                       std::vector<torch::Tensor>, std::vector<torch::Tensor>, std::vector<torch::Tensor>, torch::Tensor, torch::Tensor, double,
                       int64_t, int64_t, int64_t, torch::Tensor, torch::Tensor, torch::Tensor, torch::Tensor,
                       int64_t, double, int64_t, std::vector<torch::Tensor>, std::vector<torch::Tensor>>())
      .def("current", &BoundBlock::current);
  m.def("run_block(__torch__.torch.classes.molora.BoundBlock block, Tensor(a!) h, Tensor delta, bool lora, "
        "Tensor tok, Tensor weight, int[] counts, Tensor positions, Tensor write_rows, Tensor tables, Tensor ctx, "
        "Tensor rows, Tensor(b!) clock) -> Tensor?",
        [](const c10::intrusive_ptr<BoundBlock>& block, torch::Tensor h, torch::Tensor delta, bool lora,
           torch::Tensor tok, torch::Tensor weight, std::vector<int64_t> counts, torch::Tensor pos,
           torch::Tensor wrows, torch::Tensor tables, torch::Tensor ctx, torch::Tensor rows, torch::Tensor clock) {
          return block->run(h, delta, lora, tok, weight, counts, pos, wrows, tables, ctx, rows, clock);
        });
}
