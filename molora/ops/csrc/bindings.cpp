// The extension's Python module: every entry point of the kernel files, each wrapped so that a failed check raises
// RuntimeError(its message).
#include "common.h"

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {   // each wrapped so that a failed check raises RuntimeError(its message)
  m.def("lora_fused_", torch::wrap_pybind_function(lora_fused_));
  m.def("bf16_dot", torch::wrap_pybind_function(bf16_dot));
  m.def("paged_decode", torch::wrap_pybind_function(paged_decode));
  m.def("paged_decode_rows", torch::wrap_pybind_function(paged_decode_rows));
  m.def("add_rms_norm", torch::wrap_pybind_function(add_rms_norm));
  m.def("rope_write", torch::wrap_pybind_function(rope_write));
  m.def("silu_mul", torch::wrap_pybind_function(silu_mul));
  m.def("linear_panels", torch::wrap_pybind_function(linear_panels));
  m.def("amx_ready", torch::wrap_pybind_function(amx_ready));
  m.def("linear_amx", torch::wrap_pybind_function(linear_amx));
  m.def("greedy_rows", torch::wrap_pybind_function(greedy_rows));
  bind_decode_block(m);
}
