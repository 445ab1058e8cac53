"""Backend choice for per-token LoRA dispatch: `lora_delta`, `pick_backend`, `LoRADispatcher`, `RoutingPlan`.

Owns the table of backends, the rule behind "auto", the per-step routing plan (checked and sorted once,
shared by all target linears) and the public boundary (argument checks, T = 0). Three steps, kept apart:
validation (`_validate`: shapes, dtypes, what an explicit backend can run; clear LoRAInputErrors), the choice
(`pick_backend`: a pure function of device, dtype, T, S, k, r, D and whether the fused kernel can run; the
measurements behind its thresholds and which of them have a committed record: docs/dispatch.md), and the
memory of both per tensor signature, which `_resolve` keeps on the step's `RoutingPlan` (`plan.resolved`).
`LoRADispatcher.add_into`, the routed linears' call, skips all three where the fused kernel runs: the plan
prepares the kernel's arguments once per step (`RoutingPlan.fused_step`) and the kernel checks the shapes.
Knows nothing about adapter names or models: callers hand in stacked slot tensors and slot ids
(semantics and shapes in `molora.ops.lora`).
"""

from __future__ import annotations

import functools
import importlib.util
import logging

import torch
from torch import Tensor

from molora.ops import fused_cpu
from molora.ops.gather import gather
from molora.ops.lora import (
    LoRAInputError,
    SlotGroups,
    _fail,
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

BACKENDS: tuple[str, ...] = ("reference", "sort_group", "stacked_mask", "gather", "fused", "triton")
TRITON_DTYPES: tuple[torch.dtype, ...] = (torch.float32, torch.float16, torch.bfloat16)  # molora.ops.triton_lora


@functools.cache
def triton_available() -> bool:
    """Whether triton is importable here (it is never imported by this check; `molora.ops.triton_lora` imports it
    at the first "triton" call)."""
    return importlib.util.find_spec("triton") is not None


def _triton_lora():
    from molora.ops import triton_lora  # imports triton: only where the backend runs

    return triton_lora


# "auto" (`pick_backend`; docs/dispatch.md: the rule as a table, the measurements behind each threshold).
# bfloat16 on the fused kernel: fused below this many tokens per slot (T < per_slot * S), the eager backends'
# bf16 GEMMs from there on. The first where the kernel uses the CPU's bf16 dot product, the second where it
# widens bf16 in software (a CPU without AVX512_BF16). float32 runs fused at any T.
FUSED_BF16_TOKENS_PER_SLOT = 384
FUSED_BF16_SOFT_TOKENS_PER_SLOT = 48

# The CPU cost model of the two eager backends, in microseconds (docs/dispatch.md: its fit); D = D_in + D_out:
#   stacked_mask = fixed + per slot + per M weights read (S*R*D) + per M MACs (T*S*R*D: every token, every slot)
#   sort_group   = fixed (argsort, bincount, host read) + per used slot segment (two small mm)
#                  + per M MACs (T*k*R*D) + per M activations moved (T*k*D) + top-k > 1 (sum of choices)
STACKED_US = (94.05, 1.99, 98.04, 11.05)  # fixed, per slot, per M weights, per M MACs
SORTED_US = (151.22, 30.43, 14.76, 780.53, 104.82)  # fixed, per used slot, per M MACs, per M moved, top-k > 1


def cost_features(backend: str, T: int, S: int, k: int, R: int, D: int) -> list[float]:
    """The terms of the CPU cost model of `backend`, in the order of STACKED_US / SORTED_US; D = D_in + D_out."""
    if backend == "stacked_mask":
        return [1.0, S, S * R * D / 1e6, T * S * R * D / 1e6]
    return [1.0, min(S, T * k), T * k * R * D / 1e6, T * k * D / 1e6, float(k > 1)]


def estimate_us(backend: str, T: int, S: int, k: int, R: int, D: int) -> float:
    """Estimated CPU time of `backend` ("stacked_mask" or "sort_group") in microseconds."""
    coef = STACKED_US if backend == "stacked_mask" else SORTED_US
    return sum(c * f for c, f in zip(coef, cost_features(backend, T, S, k, R, D)))


def pick_backend(
    device: str,
    dtype: torch.dtype,
    T: int,
    S: int,
    k: int,
    r: int,
    d: int,
    *,
    fused_available: bool,
    bf16_dot: bool,
    triton_available: bool = False,
) -> str:
    """What "auto" runs: "triton", "fused", "stacked_mask" or "sort_group". A pure function (no tensors, no kernel
    build, no cache): the same arguments always give the same backend. docs/dispatch.md draws it as a table.

    device: a torch device type ("cpu", "cuda"); T tokens; S the slots the stacked form must touch
    (`LoRADispatcher` passes A.shape[0], all slots of the bank, which needs no device sync); k choices per
    token; r rank; d = D_in + D_out (the width the cost model charges per rank).
    fused_available: the fused kernel is built here and takes this call's tensors as they are laid out (rows
    of x with unit stride, B slot-major, autograd off: the rest of `fused_cpu.supports`).
    bf16_dot: the kernel multiplies bfloat16 on the CPU's bf16 dot product (`fused_cpu.bf16_dot()`).
    triton_available: triton is importable (`triton_available()`) and autograd is off (the kernels have no
    backward; `_pick` asks for torch.no_grad / inference mode, as the engine and generate run).

        triton         device "cuda", triton_available and a float32/float16/bfloat16 dtype (sync-free: the
                       per-slot counts stay on the device; molora.ops.triton_lora). Never on the CPU.
        fused          fused_available, device "cpu", and float32 at any T, or bfloat16 with T * k <
                       FUSED_BF16_TOKENS_PER_SLOT * S (FUSED_BF16_SOFT_TOKENS_PER_SLOT * S without bf16_dot); top-k
                       runs one top-1 call per choice column (RoutingPlan.column_groups; fused_available is False
                       past the dispatcher's max_fused_top_k)
        stacked_mask   otherwise, where the CPU cost model (`estimate_us`) says it costs no more than sort_group
        sort_group     otherwise
    Never "gather" nor "reference" (docs/dispatch.md: why). The cost model is measured on CPU only; on CUDA
    without triton it still decides, and sort_group's host read of the per-slot counts then syncs once per step
    (and breaks graph capture): ask for stacked_mask explicitly there.
    """
    if device == "cuda" and triton_available and dtype in TRITON_DTYPES:
        return "triton"
    per_slot = FUSED_BF16_TOKENS_PER_SLOT if bf16_dot else FUSED_BF16_SOFT_TOKENS_PER_SLOT
    if (
        fused_available
        and device == "cpu"
        and dtype in fused_cpu.DTYPES
        and (dtype != torch.bfloat16 or T * k < per_slot * S)
    ):
        return "fused"
    if estimate_us("stacked_mask", T, S, k, r, d) <= estimate_us("sort_group", T, S, k, r, d):
        return "stacked_mask"
    return "sort_group"


def _check_backend(backend: str) -> None:
    if backend != "auto" and backend not in BACKENDS:
        raise LoRAInputError(f"unknown LoRA dispatch backend {backend!r}; valid: {', '.join(('auto',) + BACKENDS)}")


class RoutingPlan:
    """The routing of one step, shared by every target linear that uses it: checked once, and sorted
    (sort_group) or spread into a [T, S] weight matrix (stacked_mask) at most once, on first use.

    slot_ids [T] or [T, k] (-1: none), weights None or [T, k], num_slots S of the banks it will meet.
    Build it with `LoRADispatcher.plan`; hand it to `LoRADispatcher.apply` for each target linear.
    """

    def __init__(self, slot_ids: Tensor, weights: Tensor | None, num_slots: int) -> None:
        self.slot_ids = as_2d(slot_ids)  # [T, k] int64
        self.weights = weights  # None or [T, k]
        self.num_slots = num_slots
        self._groups: SlotGroups | None = None
        self._columns: list[SlotGroups] | None = None
        self._slot_weights: dict[torch.dtype, Tensor] = {}
        self._triton = None
        self._fused: dict[tuple, list[tuple] | None] = {}  # (backend, dtype, max_top_k) -> fused_step's answer
        self._blocks: dict[tuple, tuple | None] = {}  # the same key -> fused_block_step's answer
        self.resolved: dict[tuple, str] = {}  # tensor signature -> backend, validated and "auto" resolved (_resolve)

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

    def column_groups(self) -> list[SlotGroups]:
        """The fused kernel's metadata: one top-1 `SlotGroups` per choice column that routes any token (k = 1: the
        plan's `groups`), so that each kernel call writes a row at most once; computed on first use (one sort and
        one host read per column)."""
        if self._columns is None:
            if self.top_k == 1:
                self._columns = [self.groups()]
            else:
                cols = []
                for j in range(self.top_k):
                    w = None if self.weights is None else self.weights[:, j : j + 1]
                    g = group_by_slot(self.slot_ids[:, j : j + 1], w, self.num_slots)
                    if sum(g.counts):
                        cols.append(g)
                self._columns = cols
        return self._columns

    def triton_plan(self):
        """The triton backend's device metadata (`triton_lora.build_plan`: no host read), built on first use."""
        if self._triton is None:
            self._triton = _triton_lora().build_plan(self.slot_ids, self.weights, self.num_slots)
        return self._triton

    def fused_step(self, backend: str, dtype: torch.dtype, max_top_k: int | None = None) -> list[tuple] | None:
        """The per-step arguments of the fused kernel, one (tok, weight float32 or None, counts) per choice column
        (`column_groups`), where `backend` ("auto" or "fused") runs it on this plan for CPU tensors of `dtype` with
        autograd off and top-k at most `max_top_k` (None: any); else None. Computed once per plan, backend and dtype
        (the first call sorts the plan's columns): `LoRADispatcher.add_into`'s fast path."""
        key = (backend, dtype, max_top_k)
        if key not in self._fused:
            step = None
            if (
                self.slot_ids.device.type == "cpu"
                and dtype in fused_cpu.DTYPES
                and (max_top_k is None or self.top_k <= max_top_k)
                and fused_cpu.available()
                and (
                    backend == "fused"
                    or backend == "auto"
                    and pick_backend(
                        "cpu",
                        dtype,
                        self.num_tokens,
                        self.num_slots,
                        self.top_k,
                        0,
                        0,
                        fused_available=True,
                        bf16_dot=fused_cpu.bf16_dot(),
                    )
                    == "fused"
                )
            ):
                step = [
                    (g.tok.contiguous(), None if g.weight is None else g.weight.float().contiguous(), g.counts)
                    for g in self.column_groups()
                ]
            self._fused[key] = step
        return self._fused[key]

    def fused_block_step(self, backend: str, dtype: torch.dtype, max_top_k: int | None = None) -> tuple | None:
        """`fused_step` as the one-call decode block takes it (fused_cpu.run_block): one (tok, weight or None, counts)
        whose counts are S per choice column, the columns one after another (the block runs one kernel call per
        column, in this order, as `LoRADispatcher.add_into` does); () where no choice routes a token; None where
        `fused_step` is None. Computed once per plan, backend, dtype and bound."""
        key = (backend, dtype, max_top_k)
        if key not in self._blocks:
            steps = self.fused_step(backend, dtype, max_top_k)
            joined: tuple | None = None
            if steps is not None and len(steps) == 1:
                joined = steps[0]
            elif steps:
                toks = torch.cat([t for t, _, _ in steps])
                weighted = any(w is not None for _, w, _ in steps)
                ws = (
                    torch.cat([w if w is not None else torch.ones(t.shape[0]) for t, w, _ in steps])
                    if weighted
                    else None
                )
                joined = (toks, ws, [c for _, _, counts in steps for c in counts])
            elif steps is not None:
                joined = ()
            self._blocks[key] = joined
        return self._blocks[key]

    def slot_weights(self, dtype: torch.dtype) -> Tensor:
        """stacked_mask's [T, S] weight matrix in `dtype`, computed on first use."""
        if dtype not in self._slot_weights:
            self._slot_weights[dtype] = slot_weights(self.slot_ids, self.weights, self.num_slots, dtype)
        return self._slot_weights[dtype]


def _plan(slot_ids: Tensor, weights: Tensor | None, num_slots: int, check_ids: bool | None) -> RoutingPlan:
    validate_routing(slot_ids, weights)
    if check_ids or (check_ids is None and slot_ids.device.type == "cpu"):
        validate_slot_range(slot_ids, num_slots)
    return RoutingPlan(slot_ids, weights, num_slots)


def _validate(
    backend: str, plan: RoutingPlan, x: Tensor, A: Tensor, B: Tensor, scale: Tensor, out: Tensor | None
) -> None:
    """Check the tensors against the plan and each other, `out`, and that an explicit "fused" can run them.
    Shapes, dtypes, layout and the autograd mode only: no data read, no kernel build."""
    validate_tensors(x, A, B, scale, plan.num_tokens, plan.num_slots)
    if out is not None and (out.shape != (x.shape[0], B.shape[1]) or out.dtype != x.dtype):
        _fail("out", f"a {x.dtype} tensor [T={x.shape[0]}, D_out={B.shape[1]}]", f"{out.dtype} {tuple(out.shape)}")
    if backend == "fused" and plan.num_tokens and not fused_cpu.supports(x, B):
        raise LoRAInputError(
            "backend 'fused' runs on CPU float32 or bfloat16 tensors, B stored "
            "slot-major (B.transpose(1, 2) contiguous) and autograd off; got "
            f"{x.device.type} {x.dtype}, B strides {tuple(B.stride())}, grad "
            f"{'on' if torch.is_grad_enabled() else 'off'}. Use backend='auto'."
        )
    if backend == "triton" and plan.num_tokens:
        _check_triton(x, A, B, scale)


def _check_triton(x: Tensor, A: Tensor, B: Tensor, scale: Tensor) -> None:
    """An explicit "triton" needs triton, autograd off, a float32/float16/bfloat16 x, and CUDA tensors (or CPU
    tensors under TRITON_INTERPRET=1, the interpreter the exactness tests use)."""
    if not triton_available():
        raise LoRAInputError("backend 'triton' needs the triton package (pip install triton); use backend='auto'")
    if torch.is_grad_enabled() and any(t.requires_grad for t in (x, A, B, scale)):
        raise LoRAInputError(
            "backend 'triton' has no backward: run it under torch.no_grad() / inference_mode, or "
            "use backend='auto' (an eager backend while autograd is on)"
        )
    if x.dtype not in TRITON_DTYPES:
        _fail("x for backend 'triton'", "float32, float16 or bfloat16", x.dtype)
    if x.device.type != "cuda" and not (x.device.type == "cpu" and _triton_lora().interpreting()):
        raise LoRAInputError(
            f"backend 'triton' runs on CUDA tensors (or CPU tensors under TRITON_INTERPRET=1); "
            f"got {x.device.type} tensors. Use backend='auto'."
        )


def _pick(plan: RoutingPlan, x: Tensor, A: Tensor, B: Tensor, max_fused_top_k: int | None = None) -> str:
    """`pick_backend` for these tensors: x [T, D_in], A [S, R, D_in], B [S, D_out, R]. Loads the fused kernel
    (`fused_cpu.available`: built once per machine) only where the tensors suit it."""
    S, R, D_in = A.shape
    fused = (
        (max_fused_top_k is None or plan.top_k <= max_fused_top_k)
        and fused_cpu.supports(x, B)  # False off the CPU
        and fused_cpu.available()
    )
    return pick_backend(
        x.device.type,
        x.dtype,
        plan.num_tokens,
        S,
        plan.top_k,
        R,
        D_in + B.shape[1],
        fused_available=fused,
        bf16_dot=fused and fused_cpu.bf16_dot(),
        triton_available=(x.device.type == "cuda" and not torch.is_grad_enabled() and triton_available()),
    )


def _resolve(
    backend: str,
    plan: RoutingPlan,
    x: Tensor,
    A: Tensor,
    B: Tensor,
    scale: Tensor,
    out: Tensor | None,
    max_fused_top_k: int | None = None,
) -> str:
    """Validate the tensors and resolve "auto". Both depend only on shapes, dtypes, layout and the autograd
    mode, so the plan remembers the answer per signature: a step's 7 * L target linears have about 4."""
    key = (
        x.shape,
        x.dtype,
        x.device,
        x.stride(),
        A.shape,
        A.dtype,
        B.shape,
        B.dtype,
        B.stride(),
        scale.shape,
        scale.dtype,
        None if out is None else (out.shape, out.dtype),
        torch.is_grad_enabled(),
        x.requires_grad or A.requires_grad or B.requires_grad or scale.requires_grad,
    )
    resolved = plan.resolved.get(key)
    if resolved is None:
        _validate(backend, plan, x, A, B, scale, out)
        resolved = _pick(plan, x, A, B, max_fused_top_k) if backend == "auto" else backend
        plan.resolved[key] = resolved
    return resolved


def _apply(
    backend: str,
    plan: RoutingPlan,
    x: Tensor,
    A: Tensor,
    B: Tensor,
    scale: Tensor,
    out: Tensor | None = None,
    max_fused_top_k: int | None = None,
) -> Tensor:
    """Check the tensors against the plan, resolve "auto", run the kernel on the plan's metadata.
    With `out` the delta is added into it in place (and `out` returned); else a new tensor."""
    backend = _resolve(backend, plan, x, A, B, scale, out, max_fused_top_k)
    if plan.num_tokens == 0:
        return x.new_zeros(0, B.shape[1]) if out is None else out  # [0, D_out]
    if backend == "triton":
        return _triton_lora().triton_apply(plan.triton_plan(), x, A, B, scale, out)
    if backend == "fused":  # _resolve checked fused_cpu.supports for this signature; one call per choice column
        if out is None:
            out = x.new_zeros(x.shape[0], B.shape[1])
        for g in plan.column_groups():
            fused_cpu.fused_apply(g, x, A, B, scale, out)
        return out
    if backend == "sort_group":
        return sort_group_apply(plan.groups(), x, A, B, scale, out)
    if backend == "stacked_mask":
        return stacked_mask_apply(plan.slot_weights(x.dtype), x, A, B, scale, out)
    w = None if plan.weights is None else plan.weights.to(x.dtype)
    if backend == "gather":
        delta = gather(x, A, B, scale, plan.slot_ids, w)
    else:
        delta = lora_delta_reference(x, A, B, scale, plan.slot_ids, w)
    return delta if out is None else out.add_(delta)


def lora_delta(
    x: Tensor,
    A: Tensor,
    B: Tensor,
    scale: Tensor,
    slot_ids: Tensor,
    weights: Tensor | None = None,
    *,
    backend: str = "auto",
) -> Tensor:
    """out[t] = sum_j weights[t, j] * scale[s] * (B[s] @ (A[s] @ x[t])), s = slot_ids[t, j] >= 0.

    x [T, D_in], A [S, R, D_in], B [S, D_out, R], scale [S], slot_ids [T] or [T, k] (-1: none),
    weights None (all 1) or [T, k]  ->  out [T, D_out], a new tensor in x's dtype.
    backend: one of BACKENDS or "auto" (`pick_backend` per call). Bad shapes, dtypes or slot ids
    raise LoRAInputError (a ValueError). In a model, build one `LoRADispatcher` and one `RoutingPlan`
    per step instead, so the routing is checked and sorted once for all target linears.
    """
    _check_backend(backend)
    return _apply(backend, _plan(slot_ids, weights, A.shape[0], check_ids=True), x, A, B, scale)


class LoRADispatcher:
    """One backend, chosen once at construction and logged; "auto" resolves per call from (T, S, k, R, D)
    with `pick_backend` (no device sync). "gather" compiles lazily at its first call, not here.

        dispatch = LoRADispatcher("auto")
        plan = dispatch.plan(slot_ids, weights, num_slots=S)       # once per step
        delta = dispatch.apply(plan, x, A, B, scale)               # per target linear
        delta = dispatch(x, A, B, scale, slot_ids, weights)        # both at once (like lora_delta)

    check_ids reads slot_ids to check -1 <= id < S when a plan is built: None (the default) where slot_ids lie on
    the CPU (no sync there), True everywhere (a device sync per plan on a GPU: for debugging), False never (inside
    CUDA graphs). Off the CPU an id outside [-1, S) is then not caught here: the triton backend treats it as -1,
    the eager backends may fail with a device-side index error.

    max_fused_top_k: "auto" runs the fused kernel on plans of top-k at most this (None: any k, one kernel call per
    choice column); 1 keeps top-k routing (static mixes, weighted routers) on the eager backends, as `molora bench
    mix` compares. A plain attribute: set it between steps.
    """

    def __init__(
        self, backend: str = "auto", *, check_ids: bool | None = None, max_fused_top_k: int | None = None
    ) -> None:
        _check_backend(backend)
        self.backend = backend
        self.check_ids = check_ids
        self.max_fused_top_k = max_fused_top_k
        if backend == "auto":
            log.info(
                "LoRA dispatch backend: auto (triton on CUDA where triton is installed, autograd off; fused "
                "where it can run: CPU, fp32 or bf16, top-1, no autograd; else stacked_mask or sort_group by a "
                "CPU cost model of T, S, k, R, D fitted to "
                "molora.bench.ops timings; docs/dispatch.md)"
            )
        else:
            log.info("LoRA dispatch backend: %s (requested explicitly)", backend)

    def plan(self, slot_ids: Tensor, weights: Tensor | None = None, *, num_slots: int) -> RoutingPlan:
        """Check a step's routing once (slot_ids [T] or [T, k], weights None or [T, k])."""
        return _plan(slot_ids, weights, num_slots, self.check_ids)

    def apply(
        self, plan: RoutingPlan, x: Tensor, A: Tensor, B: Tensor, scale: Tensor, out: Tensor | None = None
    ) -> Tensor:
        """The delta [T, D_out] of one target linear (x [T, D_in], A [S, R, D_in], B [S, D_out, R], scale [S]);
        with out [T, D_out] (e.g. the base output) the delta is added into it in place, no new tensor."""
        return _apply(self.backend, plan, x, A, B, scale, out, self.max_fused_top_k)

    def add_into(self, plan: RoutingPlan, x: Tensor, A: Tensor, B: Tensor, scale: Tensor, out: Tensor) -> Tensor:
        """`apply(plan, x, A, B, scale, out)`: the delta added into out [T, D_out] in place, and out returned. Where
        the fused kernel is what runs (`RoutingPlan.fused_step`), it is called directly on the plan's prepared
        arguments and checks the shapes itself (a RuntimeError), without `apply`'s argument checks in Python; the
        routed linears call this once per linear and step. Anything else (another backend, a layout the kernel
        does not take, autograd on) goes through `apply`, checks included."""
        steps = None if torch.is_grad_enabled() else plan.fused_step(self.backend, x.dtype, self.max_fused_top_k)
        if steps is not None and x.device.type == "cpu":
            if not steps:  # no choice routes any token
                return out
            if fused_cpu.lora_add(out, x, A, B, scale, *steps[0]):  # declined: nothing written, the checked path
                for step in steps[1:]:  # the same layout: the kernel takes every column
                    done = fused_cpu.lora_add(out, x, A, B, scale, *step)
                    assert done, "the fused kernel declined a choice column after taking the first"
                return out
        return _apply(self.backend, plan, x, A, B, scale, out, self.max_fused_top_k)

    def backend_for(
        self, plan: RoutingPlan, x: Tensor, A: Tensor, B: Tensor, scale: Tensor, out: Tensor | None = None
    ) -> str:
        """The backend `apply` runs for these tensors ("auto" resolved); checks them as `apply` does."""
        return _resolve(self.backend, plan, x, A, B, scale, out, self.max_fused_top_k)

    def __call__(
        self, x: Tensor, A: Tensor, B: Tensor, scale: Tensor, slot_ids: Tensor, weights: Tensor | None = None
    ) -> Tensor:
        return self.apply(self.plan(slot_ids, weights, num_slots=A.shape[0]), x, A, B, scale)

    def __repr__(self) -> str:
        return f"LoRADispatcher(backend={self.backend!r}, check_ids={self.check_ids})"


__all__ = ["BACKENDS", "LoRADispatcher", "RoutingPlan", "lora_delta", "pick_backend"]
