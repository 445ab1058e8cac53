"""Layer 1: per-token LoRA dispatch ops over stacked slot tensors.

`lora_delta(x, A, B, scale, slot_ids, weights)` computes, for every token, the LoRA delta of the
adapter(s) in the slot(s) it is routed to, in one pass over all tokens. `lora_delta_reference` is the
spec (a plain loop); `BACKENDS` are the implementations (eager PyTorch: sort_group, stacked_mask; compiled:
gather; C++: fused, `molora.ops.fused_cpu` on `csrc/`, built on first use (keyed by a hash of its sources); Triton:
triton, `molora.ops.triton_lora`, CUDA only, imported on first use); `LoRADispatcher` holds one ("auto": `pick_backend`,
a pure function of device, dtype, T, S, k, r, D: triton on CUDA where triton is installed, fused where it can run (CPU,
fp32 or bf16, top-1, inference), else the eager backend a CPU cost model prefers; docs/dispatch.md), and its `plan`
checks and sorts a step's routing once for all target linears (`apply`). This package knows nothing about adapter names,
banks or models.
"""

from molora.ops.dispatch import BACKENDS, LoRADispatcher, RoutingPlan, lora_delta, pick_backend
from molora.ops.gather import LoRABackendError
from molora.ops.lora import LoRAInputError, lora_delta_reference

__all__ = [
    "BACKENDS",
    "LoRABackendError",
    "LoRADispatcher",
    "LoRAInputError",
    "RoutingPlan",
    "lora_delta",
    "lora_delta_reference",
    "pick_backend",
]
