// The op registry: every entry point of the kernel files as a torch op, torch.ops.molora.<name>, with its schema
// (Tensor(a!): written in place; the empty tensor stands for "none" where an argument is optional: no delta, no
// bias, no weights). Registered as CompositeImplicitAutograd (m.def with the function): one kernel for every
// dispatch key, so a tensor on another device reaches the kernel's own checks (checks.h) and fails with their message
// rather than "no kernel for backend X". Loading the library (torch.ops.load_library, molora/ops/kernel_build.py)
// registers them; a failed check raises RuntimeError naming the function, the argument and the value.
#include "common.h"

TORCH_LIBRARY(molora, m) {
  m.def("lora_fused_(Tensor(a!) out, Tensor x, Tensor A, Tensor B, Tensor tok, Tensor scale, Tensor weight, "
        "int[] counts) -> bool", &lora_fused_);
  m.def("bf16_dot() -> bool", &bf16_dot);
  m.def("paged_decode(Tensor(a!) out, Tensor q, Tensor kc, Tensor vc, Tensor tables, Tensor ctx, int block_size, "
        "float scale, int window) -> ()", &paged_decode);
  m.def("paged_decode_rows(Tensor(a!) out, Tensor q, Tensor kc, Tensor vc, Tensor tables, Tensor ctx, Tensor rows, "
        "int block_size, float scale, int window) -> ()", &paged_decode_rows);
  m.def("add_rms_norm(Tensor(a!) h, Tensor delta, Tensor weight, Tensor(b!) out, float eps) -> ()", &add_rms_norm);
  m.def("rope_write(Tensor(a!) q, Tensor(b!) k, Tensor v, Tensor cos, Tensor sin, Tensor positions, "
        "Tensor write_rows, Tensor(c!) kc, Tensor(d!) vc) -> ()", &rope_write);
  m.def("silu_mul(Tensor(a!) gate, Tensor up) -> ()", &silu_mul);
  m.def("linear_panels(Tensor(a!) y, Tensor x, Tensor panels, Tensor bias) -> ()", &linear_panels);
  m.def("panels_fit() -> bool", &panels_fit);
  m.def("amx_ready() -> bool", &amx_ready);
  m.def("linear_amx(Tensor(a!) y, Tensor x, Tensor tiles, Tensor bias) -> ()", &linear_amx);
  m.def("linear_amx_w8(Tensor(a!) y, Tensor x, Tensor tiles, Tensor scale, Tensor bias) -> ()", &linear_amx_w8);
  m.def("linear_w8(Tensor(a!) y, Tensor x, Tensor q, Tensor scale, Tensor bias) -> ()", &linear_w8);
  m.def("quantize_rows_(Tensor(a!) xq, Tensor(b!) step, Tensor x, Tensor smooth) -> ()", &quantize_rows_);
  m.def("scale_rows_(Tensor(a!) y, Tensor acc, Tensor step, Tensor scale, Tensor bias) -> ()", &scale_rows_);
  register_decode_block(m);
}
