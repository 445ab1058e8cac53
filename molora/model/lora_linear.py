"""`RoutedLoRALinear`: a base linear plus the routed LoRA delta of each token, one code path.

    y = x @ W.T + b  +  lora_delta(x, A, B, scale, slot_ids, weights)        x [..., d_in] -> T = prod(...)

The routing of the current step (slot_ids [T, k], weights [T, k] or None) lives in a `RoutingContext`
that the owner of the model fills before each forward and clears after; every routed linear of the model
holds a reference to the same context. Nothing here reads globals or hooks, and `forward` never branches
on adapter names or file formats.

The layer keeps the base linear's own `weight` / `bias` parameters under the same names, so the model's
state_dict keys (`...q_proj.weight`) do not change when it is swapped in. Over a quantized base
(molora.model.quant_linear: `QuantizedLinear`, int8 or int4) it keeps that module as `qbase` and has no float `weight`
(None): the base product runs on the quantized kernel and the delta is added in the activation dtype as over a float
base.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from molora.adapters.bank import LoRASlots
from molora.model.quant_linear import QuantizedLinear
from molora.ops import LoRADispatcher, RoutingPlan
from molora.ops.device import recording
from molora.routing.base import InNetworkRouter, decide_slots

if TYPE_CHECKING:
    from molora.routing.arrow_linear import LinearRouting


class RoutingContext:
    """The routing of one forward pass, shared by all routed linears of a model.

    slot_ids [T, k] (long, -1 = base only) and weights [T, k] (or None for weight 1), where T counts the
    tokens of the step in row-major order of the model's input (batch, then sequence).
    For in-network (learned) routing the owner also sets `router` (it decides per block from hidden
    states), `slot_map` (router adapter index -> bank slot, [K]) and `allowed` (bool [K] or None); gated
    blocks then refresh slot_ids before they run. `trace`, when a list, collects each block's decision.
    `carry_in` [T] (or None) is the decision each token carries from its predecessor for a router with
    `carry_blocks` (molora.routing.learned: Carry); `carry_out` [T] receives the decisions at the router's
    `carry_source` block. `fixed_in` [T] (or None) holds decisions that apply at every block (-2: the router
    decides), as a probe pass gives prompt tokens (molora.routing.learned: Probe).
    `linear` (a `molora.routing.arrow.LinearRouting`, or None) routes each linear by its own input instead
    (Arrow per_linear): every routed linear then asks it for its slots, with slot_ids as the fixed routing of
    the rows the router does not own (None: base).
    While a step is recorded for replay (`molora.ops.device.recording`, molora.model.graphs) the routed linears
    take no decision from Python state that could change between replays (no "no adapter loaded" shortcut, no
    cast kept from an earlier call), so a replay sees the bank as it is then.
    """

    __slots__ = (
        "slot_ids",
        "weights",
        "router",
        "slot_map",
        "allowed",
        "trace",
        "carry_in",
        "carry_out",
        "fixed_in",
        "linear",
        "_plan",
    )

    def __init__(self) -> None:
        self.slot_ids: torch.Tensor | None = None
        self.weights: torch.Tensor | None = None
        self.router: InNetworkRouter | None = None
        self.slot_map: torch.Tensor | None = None
        self.allowed: torch.Tensor | None = None
        self.trace: list | None = None
        self.carry_in: torch.Tensor | None = None
        self.carry_out: torch.Tensor | None = None
        self.fixed_in: torch.Tensor | None = None
        self.linear: LinearRouting | None = None
        self._plan: RoutingPlan | None = None

    def plan(self, dispatcher: LoRADispatcher, num_slots: int) -> RoutingPlan:
        """The step's routing checked and sorted once (a `RoutingPlan`), shared by every routed linear."""
        if self._plan is None:
            assert self.slot_ids is not None, "a plan needs the step's slot_ids (set)"
            self._plan = dispatcher.plan(self.slot_ids, self.weights, num_slots=num_slots)
        return self._plan

    def linear_plan(self, name: str, x: torch.Tensor, dispatcher: LoRADispatcher, num_slots: int) -> RoutingPlan:
        """Per-linear routing (`linear` set): the plan of linear `name` for its own input x [T, d_in]."""
        assert self.linear is not None, "linear_plan without per-linear routing"
        slot_ids, weights = self.linear.slots(name, x, self.slot_ids, self.weights, self.trace)
        return dispatcher.plan(slot_ids, weights, num_slots=num_slots)

    def route_block(self, block: int, hidden: torch.Tensor) -> None:
        """Let the in-network router decide for `block` from its input hidden [T, D] (no-op without one)."""
        if self.router is None:
            return
        assert self.slot_map is not None, "an in-network router needs slot_map"
        decision = decide_slots(self.router, block, hidden, self.slot_map, self.allowed, self.carry_in, self.fixed_in)
        if decision is None:
            return  # keep the previous block's decision
        slots, weights, ids = decision  # [T, k]; ids in router order, -1 = none
        if getattr(self.router, "carry_blocks", 0) > 0 and block == self.router.carry_source:
            self.carry_out = ids[:, 0]
        self.slot_ids, self.weights, self._plan = slots, weights, None
        if self.trace is not None and self.router.gate_index(block) is not None:
            self.trace.append((block, ids))  # only blocks whose own gate decided

    def set(self, slot_ids: torch.Tensor | None, weights: torch.Tensor | None = None) -> None:
        assert slot_ids is None or slot_ids.ndim == 2, "slot_ids must be [T, k]"
        assert weights is None or (slot_ids is not None and weights.shape == slot_ids.shape)
        self.slot_ids, self.weights, self._plan = slot_ids, weights, None

    def clear(self) -> None:
        self.slot_ids = self.weights = self.router = self.slot_map = self.allowed = self._plan = None
        self.carry_in = self.carry_out = self.fixed_in = self.linear = None


class RoutedLoRALinear(nn.Module):
    """A linear whose output adds, for each token, the LoRA delta of the adapter its routing names."""

    # parameters and submodules, typed here (nn.Module.__getattr__ would type them `Tensor | Module`); the hot path
    # reads them through the module dicts instead (add_delta: why), asserting their types there
    weight: torch.Tensor | None  # None over a quantized base (`qbase`)
    bias: torch.Tensor | None
    qbase: QuantizedLinear
    lora: LoRASlots

    def __init__(
        self,
        base: nn.Linear | QuantizedLinear,
        slots: LoRASlots,
        context: RoutingContext,
        dispatcher: LoRADispatcher,
        name: str = "",
    ) -> None:
        super().__init__()
        self.name = name  # the module path (the bank's key): what a per-linear router knows this linear by
        self.in_features, self.out_features = base.in_features, base.out_features
        if isinstance(base, QuantizedLinear):
            self.qbase = base  # the quantized base computes x @ W.T + b (module docstring)
            self.weight = None
        else:
            self.weight = base.weight
        self.bias = base.bias
        self.lora = slots
        self.context = context
        self.dispatcher = dispatcher
        # kept between calls while the bank's tensors stay the same (an op or a cast less per call):
        self._B: tuple[torch.Tensor, torch.Tensor] | None = None  # (lora.Bt, its view B)
        self._scale: tuple[torch.Tensor, int, torch.Tensor] | None = None  # (lora.scale, its version, float32 copy)
        self._wt: torch.Tensor | None = None  # weight.t() (inference only)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        qbase = self._modules.get("qbase")
        if qbase is not None:
            return self.add_delta(x, qbase.forward(x))
        params = self._parameters  # (add_delta: why not self.weight)
        weight, bias = params["weight"], params.get("bias")  # (a bias of None lives outside _parameters)
        assert weight is not None, "a routed linear over a float base has a weight"
        if x.dim() == 2 and not torch.is_grad_enabled():  # what F.linear runs for 2-D x, minus three view ops
            wt = self._wt
            if wt is None or wt.data_ptr() != weight.data_ptr() or wt.dtype != weight.dtype:
                wt = self._wt = weight.detach().t()  # (weight.data may be swapped, e.g. by model.to())
            y = torch.mm(x, wt) if bias is None else torch.addmm(bias, x, wt)
        else:
            y = F.linear(x, weight, bias)
        return self.add_delta(x, y)

    def add_delta(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """y, this linear's base output for x, plus each token's routed delta (added into y in place where
        autograd is off; a new tensor where it is on). `forward` is base + add_delta; the engine's runner computes
        the base its own way (packed weights, molora.ops.packed) and adds the delta here."""
        # Runs 7 * L times a step: the slots and their tensors are read through the module dicts, as nn.Module's
        # __getattr__ would find them (each lookup through it cost about 1.5 us here, five per call).
        ctx = self.context
        slot_ids = ctx.slot_ids
        lora = self._modules["lora"]
        assert isinstance(lora, LoRASlots)
        static = recording.on
        if (slot_ids is None and ctx.linear is None) or (lora.active == 0 and not static):
            return y
        bufs = lora._buffers
        A, Bt, scale = bufs["A"], bufs["Bt"], bufs["scale"]
        assert A is not None and Bt is not None and scale is not None
        flat = x if x.dim() == 2 else x.reshape(-1, self.in_features)  # [T, d_in]
        if slot_ids is not None and flat.shape[0] != slot_ids.shape[0]:
            raise RuntimeError(f"routing covers {slot_ids.shape[0]} tokens but the layer got {flat.shape[0]}")
        if ctx.linear is not None:  # per-linear routing: this linear's own decision from its input
            plan = ctx.linear_plan(self.name, flat, self.dispatcher, A.shape[0])
        else:
            plan = ctx._plan or ctx.plan(self.dispatcher, A.shape[0])
        if torch.is_grad_enabled():  # autograd keeps the sum out of place
            delta = self.dispatcher.apply(plan, flat, A, lora.B, scale)
            return y + delta.view(y.shape).to(y.dtype)
        B, scale = self._kernel_operands(Bt, scale, static)
        self.dispatcher.add_into(plan, flat, A, B, scale, y if y.dim() == 2 else y.view(-1, self.out_features))
        return y

    def _kernel_operands(
        self, Bt: torch.Tensor, scale: torch.Tensor, static: bool
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(B [S, D_out, R] as the slot-major view of the bank's Bt, scale in float32) as the kernels take them,
        kept between calls while the bank's tensors stay the same."""
        if self._B is None or self._B[0] is not Bt:
            self._B = (Bt, Bt.transpose(1, 2))  # lora.B, kept while the bank's Bt stays the same
        if scale.dtype != torch.float32 and static:  # recorded: the cast runs again at every replay
            scale = scale.float()
        elif scale.dtype != torch.float32:  # a bf16 model's bank: the kernels take scale in float32 (exact)
            if self._scale is None or self._scale[0] is not scale or self._scale[1] != scale._version:
                self._scale = (scale, scale._version, scale.float())
            scale = self._scale[2]
        return self._B[1], scale

    def kernel_step(self, rows: int, dtype: torch.dtype) -> tuple | None:
        """How `add_delta` would add the routed deltas of `rows` tokens of `dtype` now, for every routed linear that
        shares this one's context and dispatcher: () where it adds none (no routing in the context, or no choice routes
        a token), the fused kernel's step arguments (tok, weight, counts; top-k: its choice columns one after another,
        `RoutingPlan.fused_block_step`) where the kernel adds them (`LoRADispatcher.add_into`'s fast path), None where
        it would take another path (per-linear routing, a recorded step, autograd, another backend). With
        `kernel_operands`, what the runner's one-call decode block (fused_cpu.run_block) runs."""
        ctx = self.context
        if ctx.linear is not None or recording.on or torch.is_grad_enabled():
            return None
        if ctx.slot_ids is None:
            return ()
        if ctx.slot_ids.shape[0] != rows:
            return None
        lora = self._modules["lora"]
        assert isinstance(lora, LoRASlots)
        A = lora._buffers["A"]
        assert A is not None
        S = A.shape[0]
        d = self.dispatcher
        return (ctx._plan or ctx.plan(d, S)).fused_block_step(d.backend, dtype, d.max_fused_top_k)

    def kernel_operands(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        """(A, B, scale) of this linear's slots as the fused kernel takes them (`kernel_step`; A contiguous, as the
        checked path hands it over); None where no loaded adapter targets this linear (add_delta adds nothing)."""
        lora = self.lora
        if lora.active == 0:
            return None
        A, Bt, scale = lora.A, lora.Bt, lora.scale
        return (A if A.is_contiguous() else A.contiguous(), *self._kernel_operands(Bt, scale, False))

    def to_linear(self) -> nn.Linear | QuantizedLinear:
        """A plain nn.Linear sharing this layer's base parameters (the delta is dropped); over a quantized base, the
        QuantizedLinear itself."""
        if self.weight is None:
            return self.qbase
        lin = nn.Linear(
            self.in_features,
            self.out_features,
            bias=self.bias is not None,
            device=self.weight.device,
            dtype=self.weight.dtype,
        )
        # registered as parameters by nn.Module (the base's own)
        assert isinstance(self.weight, nn.Parameter) and (self.bias is None or isinstance(self.bias, nn.Parameter))
        lin.weight = self.weight
        if self.bias is not None:
            lin.bias = self.bias
        return lin

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


def linear_shapes(model: nn.Module) -> dict[str, tuple[int, int]]:
    """Module path -> (d_out, d_in) for every linear of `model` (plain, quantized or already routed; a routed
    linear's quantized base is not listed apart)."""
    wrapped = {id(m._modules.get("qbase")) for m in model.modules() if isinstance(m, RoutedLoRALinear)}
    return {
        name: (m.out_features, m.in_features)
        for name, m in model.named_modules()
        if isinstance(m, (nn.Linear, RoutedLoRALinear, QuantizedLinear)) and id(m) not in wrapped
    }


def linear_norms(model: nn.Module) -> dict[str, float]:
    """Module path -> Frobenius norm of the base weight of every linear of `model` (a quantized base: of its
    dequantized weight), what an adapter's delta is measured against when it loads
    (molora.adapters.io.MAX_DELTA_RATIO)."""
    out = {}
    wrapped = {id(m._modules.get("qbase")) for m in model.modules() if isinstance(m, RoutedLoRALinear)}
    with torch.no_grad():
        for name, m in model.named_modules():
            if id(m) in wrapped:
                continue
            if isinstance(m, RoutedLoRALinear):
                m = m.qbase if m.weight is None else m
            if isinstance(m, QuantizedLinear):
                out[name] = float(m.dequantized().float().norm())
            elif isinstance(m, (nn.Linear, RoutedLoRALinear)) and m.weight is not None:
                out[name] = float(m.weight.float().norm())
    return out


def swap_modules(model: nn.Module, names: Iterable[str], make: Callable[[str, nn.Module], nn.Module]) -> list[str]:
    """Replace each named submodule by `make(name, old)`; return the names replaced, in order."""
    replaced = []
    for name in names:
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, child, make(name, getattr(parent, child)))
        replaced.append(name)
    return replaced
