"""Backend choice for per-token LoRA dispatch: `lora_delta`, `choose_backend`, `LoRADispatcher`,
`RoutingPlan`.

Owns the table of backends, the measured rule behind "auto", the per-step routing plan (checked and
sorted once, shared by all target linears) and the public boundary (argument checks, T = 0).
Knows nothing about adapter names or models: callers hand in stacked slot tensors and slot ids
(semantics and shapes in `molora.ops.lora`).
"""

from __future__ import annotations

import logging

import torch
from torch import Tensor

from molora.ops.gather import gather
from molora.ops.lora import (
    LoRAInputError,
    SlotGroups,
    as_2d,
    group_by_slot,
    lora_delta_reference,
    slot_weights,
    sort_group_apply,
    stacked_mask_apply,
    validate_routing,
    validate_slot_range,
    validate_tensors,
)

log = logging.getLogger("molora.ops")

BACKENDS: tuple[str, ...] = ("reference", "sort_group", "stacked_mask", "gather")

# The "auto" rule is a cost model of the two eager backends, fitted (least squares on relative error,
# non-negative terms, 24 of 276 points dropped as noise from other jobs on the shared CPU) to the minimum
# over 3 sweeps x 9 interleaved repetitions of `molora.bench.ops` timings on the 2-core dev CPU (torch 2.13,
# fp32, default threads; `python -m molora.bench.ops --fit ...` refits them):
# r in {8, 16, 64}, S in {2, 4, 8, 16}, T in {1, 4, 16, ..., 2048}, d_in x d_out in {1024 x 1024, 576 x 1536}
# with top-1, and 1024 x 1024 with weighted top-2. Terms in microseconds (M = 1e6, D = D_in + D_out):
#   stacked_mask = fixed + per slot (one addmm each) + per M weights read (S*R*D: all slots, any T)
#                  + per M MACs (T*S*R*D: every token through every slot)
#   sort_group   = fixed (argsort, bincount, host read) + per used slot segment (two small mm)
#                  + per M MACs (T*k*R*D) + per M activations moved (T*k*D) + top-k > 1 (sum of choices)
# On that grid the pick costs on average 1.1% more than the faster backend, at worst 1.55x (top-2,
# T=512, where the timings were also noisiest). Some of the points (ms, sort_group / stacked_mask, d=1024,
# r=16, top-1; the pick in capitals):
#   S=4:  T=1 .073/.078 SG   T=4 .107/.078 SM   T=16 .137/.111 SM   T=64 .214/.179 SM
#         T=128 .281/.288 SM (near tie)   T=512 .674/.761 SG   T=2048 1.84/2.73 SG   T=4096 3.96/5.22 SG
#   S=16: T=1 .082/.185 SG   T=16 .292/.309 SM (near tie)   T=64 .456/.627 SG   T=512 1.04/2.55 SG
#   S=2:  stacked_mask at every T (T=4096 2.54 vs 3.55); r=64, S=16: sort_group at every T.
# Costs are per call; a RoutingPlan shared by a step's linears removes most of either backend's fixed
# cost (measured: 7 SmolLM2-shaped linears, T=1, S=4: 0.49 ms as 7 calls, 0.29 ms with one plan).
# Measured on CPU only: on CUDA sort_group's host read syncs and breaks graph capture, so a GPU engine
# should ask for stacked_mask (or gather) explicitly until this rule is measured there.
STACKED_US = (46.3, 7.2, 58.9, 10.35)          # fixed, per slot, per M weights, per M MACs
SORTED_US = (51.4, 18.7, 14.43, 344.2, 44.4)   # fixed, per used slot, per M MACs, per M moved, top-k > 1


def cost_features(backend: str, T: int, S: int, k: int, R: int, D: int) -> list[float]:
    """The terms of the CPU cost model of `backend`, in the order of STACKED_US / SORTED_US; D = D_in + D_out."""
    if backend == "stacked_mask":
        return [1.0, S, S * R * D / 1e6, T * S * R * D / 1e6]
    return [1.0, min(S, T * k), T * k * R * D / 1e6, T * k * D / 1e6, float(k > 1)]


def estimate_us(backend: str, T: int, S: int, k: int, R: int, D: int) -> float:
    """Estimated CPU time of `backend` ("stacked_mask" or "sort_group") in microseconds."""
    coef = STACKED_US if backend == "stacked_mask" else SORTED_US
    return sum(c * f for c, f in zip(coef, cost_features(backend, T, S, k, R, D)))


def choose_backend(
    num_tokens: int, num_slots_used: int, top_k: int, *, rank: int = 16, d_in: int = 1024, d_out: int = 1024
) -> str:
    """The "auto" rule: "stacked_mask" or "sort_group", whichever the CPU cost model says is faster.

    num_slots_used: the slots the stacked form must touch. `LoRADispatcher` passes A.shape[0] (all S
    slots of the bank), which needs no device sync; a caller that compacts the bank to the slots a
    step uses may pass that count. rank, d_in, d_out: A.shape[1], A.shape[2], B.shape[1].
    Never picks "gather" (compiled gather measured slower than the faster of the two at every T on
    CPU: T=8 0.23 ms vs 0.11, T=4096 12-21 ms vs 10-14, d=1024, S=4, r=16) nor "reference".
    """
    args = (num_tokens, num_slots_used, top_k, rank, d_in + d_out)
    if estimate_us("stacked_mask", *args) <= estimate_us("sort_group", *args):
        return "stacked_mask"
    return "sort_group"


def _check_backend(backend: str) -> None:
    if backend != "auto" and backend not in BACKENDS:
        raise LoRAInputError(
            f"unknown LoRA dispatch backend {backend!r}; valid: {', '.join(('auto',) + BACKENDS)}"
        )


class RoutingPlan:
    """The routing of one step, shared by every target linear that uses it: checked once, and sorted
    (sort_group) or spread into a [T, S] weight matrix (stacked_mask) at most once, on first use.

    slot_ids [T] or [T, k] (-1: none), weights None or [T, k], num_slots S of the banks it will meet.
    Build it with `LoRADispatcher.plan`; hand it to `LoRADispatcher.apply` for each target linear.
    """

    def __init__(self, slot_ids: Tensor, weights: Tensor | None, num_slots: int) -> None:
        self.slot_ids = as_2d(slot_ids)                          # [T, k] int64
        self.weights = weights                                   # None or [T, k]
        self.num_slots = num_slots
        self._groups: SlotGroups | None = None
        self._slot_weights: dict[torch.dtype, Tensor] = {}

    @property
    def num_tokens(self) -> int:
        return self.slot_ids.shape[0]

    @property
    def top_k(self) -> int:
        return self.slot_ids.shape[1]

    def groups(self) -> SlotGroups:
        """sort_group's metadata (one argsort, one host read), computed on first use."""
        if self._groups is None:
            self._groups = group_by_slot(self.slot_ids, self.weights, self.num_slots)
        return self._groups

    def slot_weights(self, dtype: torch.dtype) -> Tensor:
        """stacked_mask's [T, S] weight matrix in `dtype`, computed on first use."""
        if dtype not in self._slot_weights:
            self._slot_weights[dtype] = slot_weights(self.slot_ids, self.weights, self.num_slots, dtype)
        return self._slot_weights[dtype]


def _plan(slot_ids: Tensor, weights: Tensor | None, num_slots: int, check_ids: bool) -> RoutingPlan:
    validate_routing(slot_ids, weights)
    if check_ids:
        validate_slot_range(slot_ids, num_slots)
    return RoutingPlan(slot_ids, weights, num_slots)


def _apply(backend: str, plan: RoutingPlan, x: Tensor, A: Tensor, B: Tensor, scale: Tensor) -> Tensor:
    """Check the tensors against the plan, resolve "auto", run the kernel on the plan's metadata."""
    validate_tensors(x, A, B, scale, plan.num_tokens, plan.num_slots)
    if plan.num_tokens == 0:
        return x.new_zeros(0, B.shape[1])                        # [0, D_out]
    if backend == "auto":
        S, R, D_in = A.shape
        backend = choose_backend(plan.num_tokens, S, plan.top_k, rank=R, d_in=D_in, d_out=B.shape[1])
    if backend == "sort_group":
        return sort_group_apply(plan.groups(), x, A, B, scale)
    if backend == "stacked_mask":
        return stacked_mask_apply(plan.slot_weights(x.dtype), x, A, B, scale)
    w = None if plan.weights is None else plan.weights.to(x.dtype)
    if backend == "gather":
        return gather(x, A, B, scale, plan.slot_ids, w)
    return lora_delta_reference(x, A, B, scale, plan.slot_ids, w)


def lora_delta(
    x: Tensor, A: Tensor, B: Tensor, scale: Tensor, slot_ids: Tensor, weights: Tensor | None = None,
    *, backend: str = "auto",
) -> Tensor:
    """out[t] = sum_j weights[t, j] * scale[s] * (B[s] @ (A[s] @ x[t])), s = slot_ids[t, j] >= 0.

    x [T, D_in], A [S, R, D_in], B [S, D_out, R], scale [S], slot_ids [T] or [T, k] (-1: none),
    weights None (all 1) or [T, k]  ->  out [T, D_out], a new tensor in x's dtype.
    backend: one of BACKENDS or "auto" (`choose_backend` per call). Bad shapes, dtypes or slot ids
    raise LoRAInputError (a ValueError). In a model, build one `LoRADispatcher` and one `RoutingPlan`
    per step instead, so the routing is checked and sorted once for all target linears.
    """
    _check_backend(backend)
    return _apply(backend, _plan(slot_ids, weights, A.shape[0], check_ids=True), x, A, B, scale)


class LoRADispatcher:
    """One backend, chosen once at construction and logged; "auto" resolves per call from (T, S, k, R, D)
    with `choose_backend` (no device sync). "gather" compiles lazily at its first call, not here.

        dispatch = LoRADispatcher("auto")
        plan = dispatch.plan(slot_ids, weights, num_slots=S)       # once per step
        delta = dispatch.apply(plan, x, A, B, scale)               # per target linear
        delta = dispatch(x, A, B, scale, slot_ids, weights)        # both at once (like lora_delta)

    check_ids=True reads slot_ids to check -1 <= id < S when a plan is built (cheap on CPU; a sync on
    GPU, so turn it off once the router upstream is trusted, and inside CUDA graphs).
    """

    def __init__(self, backend: str = "auto", *, check_ids: bool = True) -> None:
        _check_backend(backend)
        self.backend = backend
        self.check_ids = check_ids
        if backend == "auto":
            log.info("LoRA dispatch backend: auto (per call, stacked_mask or sort_group by a CPU cost "
                     "model of T, S, k, R, D fitted to molora.bench.ops timings)")
        else:
            log.info("LoRA dispatch backend: %s (requested explicitly)", backend)

    def plan(self, slot_ids: Tensor, weights: Tensor | None = None, *, num_slots: int) -> RoutingPlan:
        """Check a step's routing once (slot_ids [T] or [T, k], weights None or [T, k])."""
        return _plan(slot_ids, weights, num_slots, self.check_ids)

    def apply(self, plan: RoutingPlan, x: Tensor, A: Tensor, B: Tensor, scale: Tensor) -> Tensor:
        """The delta [T, D_out] of one target linear (x [T, D_in], A [S, R, D_in], B [S, D_out, R], scale [S])."""
        return _apply(self.backend, plan, x, A, B, scale)

    def __call__(
        self, x: Tensor, A: Tensor, B: Tensor, scale: Tensor, slot_ids: Tensor, weights: Tensor | None = None
    ) -> Tensor:
        return self.apply(self.plan(slot_ids, weights, num_slots=A.shape[0]), x, A, B, scale)

    def __repr__(self) -> str:
        return f"LoRADispatcher(backend={self.backend!r}, check_ids={self.check_ids})"


__all__ = ["BACKENDS", "LoRADispatcher", "RoutingPlan", "choose_backend", "lora_delta"]
