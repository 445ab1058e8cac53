"""The adapter bank: every adapted linear's LoRA weights in S fixed, preallocated slots.

For each adapted linear the bank holds stacked tensors (legend: S slots, R max rank)

    A     [S, R, d_in]     B     [S, d_out, R]     scale [S]

allocated once, so their addresses never change (what CUDA graphs and torch.compile rely on). Loading an
adapter is a copy into a free slot (smaller ranks are zero-padded up to R; a module the adapter does not
target gets scale 0); unloading zeroes the slot and frees it. Routing is choosing slot ids.

The bank knows slot numbers and the names in its slot table, nothing about routing, requests or models.
A load is validated completely before the first byte is copied, so a refused load leaves the bank exactly
as it was.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping

import torch
from torch import nn

from molora.adapters.io import LoRAAdapter
from molora.config import BankConfig
from molora.errors import AdapterError, BankFullError

log = logging.getLogger("molora.bank")


class LoRASlots(nn.Module):
    """Slot storage of one linear. Buffers are non-persistent: they never enter the model's state_dict.

    A [S, R, d_in] and B [S, d_out, R] as the ops expect them; B is a transposed view of the buffer
    Bt [S, R, d_out], so that every slot's up-projection lies in one [S*R, d_out] matrix and the
    stacked dispatch does all slots in a single GEMM (`molora.ops.lora.stacked_mask_apply`).
    """

    A: torch.Tensor  # the buffers, typed here (nn.Module.__getattr__ would type them `Tensor | Module`)
    Bt: torch.Tensor
    scale: torch.Tensor

    def __init__(
        self,
        num_slots: int,
        max_rank: int,
        d_in: int,
        d_out: int,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str | None = None,
    ) -> None:
        super().__init__()
        self.d_in, self.d_out = d_in, d_out
        self.register_buffer(
            "A", torch.zeros(num_slots, max_rank, d_in, dtype=dtype, device=device), persistent=False
        )  # [S, R, d_in]
        self.register_buffer(
            "Bt", torch.zeros(num_slots, max_rank, d_out, dtype=dtype, device=device), persistent=False
        )  # [S, R, d_out]; B is its transposed view
        self.register_buffer(
            "scale", torch.zeros(num_slots, dtype=torch.float32, device=device), persistent=False
        )  # [S]
        self._active = 0  # how many loaded adapters target this linear (`active`)
        LoRASlots.generation += 1

    # Bumped whenever a LoRASlots starts or stops carrying a delta (`active` turns 0 or leaves it) or its buffers are
    # replaced (`_apply`: .to(), .cpu() ...): what a runner's bound decode blocks (molora.model.block.Block.run_bound)
    # compare to know that their view of the slots still holds. Writing a slot (a load, an unload, a rewrite) bumps
    # nothing: the bound blocks read the slot tensors in place.
    generation = 0

    @property
    def active(self) -> int:
        """How many loaded adapters target this linear; 0 lets forward skip the delta."""
        return self._active

    def count(self, change: int) -> None:
        """active += change (the bank, on a load or unload); a method, not a setter: nn.Module.__setattr__ costs
        about 5 us a call, and a load changes every target linear's count."""
        before, self._active = self._active, self._active + change
        assert self._active >= 0, "an adapter unloaded from a linear it was never loaded into"
        if (before == 0) != (self._active == 0):
            LoRASlots.generation += 1

    def _apply(self, fn, recurse=True):
        LoRASlots.generation += 1
        return super()._apply(fn, recurse)

    @property
    def B(self) -> torch.Tensor:
        """[S, d_out, R]: a view of Bt (writes through to the same storage)."""
        return self.Bt.transpose(1, 2)

    def extra_repr(self) -> str:
        s, r, d_in = self.A.shape
        return f"slots={s}, max_rank={r}, d_in={d_in}, d_out={self.d_out}, active={self.active}"


class AdapterBank:
    """Slot table plus per-linear `LoRASlots`. One bank serves one base model."""

    def __init__(
        self,
        module_shapes: Mapping[str, tuple[int, int]],
        config: BankConfig,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str | None = None,
    ) -> None:
        if not module_shapes:
            raise AdapterError("the bank needs at least one target linear; none were given")
        self.config = config
        self.module_shapes = dict(module_shapes)
        self.slots: dict[str, LoRASlots] = {
            m: LoRASlots(config.num_slots, config.max_rank, d_in, d_out, dtype, device)
            for m, (d_out, d_in) in self.module_shapes.items()
        }
        self.table: list[str | None] = [None] * config.num_slots  # slot -> adapter name
        self._targets: dict[str, frozenset[str]] = {}  # adapter name -> modules it targets

    # ---------------------------------------------------------------------------------------- queries
    @property
    def num_slots(self) -> int:
        return self.config.num_slots

    @property
    def names(self) -> list[str]:
        """Loaded adapter names in slot order."""
        return [n for n in self.table if n is not None]

    def slot_of(self, name: str) -> int:
        try:
            return self.table.index(name)
        except ValueError:
            raise AdapterError(f"adapter {name!r} is not loaded; loaded: {self.names}") from None

    def free_slots(self) -> list[int]:
        return [i for i, n in enumerate(self.table) if n is None]

    def __contains__(self, name: object) -> bool:
        return name in self.table

    def slot_nbytes(self) -> int:
        """Bytes one slot occupies across all linears."""
        return sum(
            (s.A[0].numel() * s.A.element_size() + s.B[0].numel() * s.B.element_size()) for s in self.slots.values()
        )

    # ---------------------------------------------------------------------------------------- changes
    def check(self, adapter: LoRAAdapter) -> None:
        """Raise AdapterError if `adapter` cannot be loaded into this bank (touches nothing)."""
        who = f"adapter {adapter.name!r}" + (f" ({adapter.path})" if adapter.path else "")
        if adapter.name in self.table:
            raise AdapterError(f"{who}: an adapter of that name is already loaded; unload it first")
        self.check_ranks(who, {m: lora.rank for m, lora in adapter.modules.items()})

    def check_ranks(self, who: str, ranks: Mapping[str, int]) -> None:
        """Raise AdapterError unless adapter `who` with {module path: rank} fits this bank's linears and max_rank."""
        outside = sorted(set(ranks) - set(self.slots))
        if outside:
            raise AdapterError(
                f"{who}: targets linears the bank was not built for {outside[:6]}; attach with "
                f"target_modules covering them (bank covers {len(self.slots)} linears)"
            )
        rank = max(ranks.values(), default=0)
        if rank > self.config.max_rank:
            raise AdapterError(
                f"{who}: rank {rank} exceeds the bank's max_rank {self.config.max_rank}; attach with max_rank>={rank}"
            )

    def load(self, adapter: LoRAAdapter, slot: int | None = None) -> int:
        """Copy `adapter` into a free slot (or the given free slot) and return the slot number."""
        self.check(adapter)
        free = self.free_slots()
        if slot is None:
            if not free:
                raise BankFullError(
                    f"adapter {adapter.name!r}: all {self.num_slots} slots are in use "
                    f"({self.names}); unload one or attach with more slots"
                )
            slot = free[0]
        elif slot not in free:
            raise BankFullError(
                f"adapter {adapter.name!r}: slot {slot} is not free "
                f"(holds {self.table[slot] if 0 <= slot < self.num_slots else 'out of range'})"
            )
        try:
            self._write(slot, adapter)
        except Exception:
            self._clear(slot, adapter.modules)  # the slot was free (all zeros): restore exactly that
            raise
        self.table[slot] = adapter.name
        self._targets[adapter.name] = frozenset(adapter.modules)
        for m in adapter.modules:
            self.slots[m].count(1)
        log.debug("loaded adapter %r into slot %d", adapter.name, slot)
        return slot

    # ---------------------------------------------------------------------------------------- faults
    @torch.no_grad()
    def nonfinite(self) -> list[str]:
        """Names of loaded adapters whose slot holds a NaN or inf (memory corruption after validation). The
        stacked dispatch sends every token through every slot, so one such slot spoils every row of a step."""
        bad = set()
        for s in self.slots.values():
            rows = ~(torch.isfinite(s.A).flatten(1).all(1) & torch.isfinite(s.Bt).flatten(1).all(1))  # [S]
            bad.update(int(i) for i in rows.nonzero().flatten())
        return [self.table[i] for i in sorted(bad) if self.table[i] is not None]

    @torch.no_grad()
    def rewrite(self, name: str, adapter: LoRAAdapter | None) -> None:
        """Write `adapter`'s weights again into the slot of `name` (same targets), or zeros when None (the
        adapter then adds nothing: the base model's behaviour). The slot stays assigned to `name`."""
        slot = self.slot_of(name)
        targets = self._targets[name]
        if adapter is not None and set(adapter.modules) != set(targets):
            raise AdapterError(
                f"adapter {name!r}: the rewrite targets {sorted(adapter.modules)[:4]}, the slot "
                f"holds {sorted(targets)[:4]}"
            )
        self._clear(slot, targets)
        if adapter is not None:
            self._write(slot, adapter)

    def unload(self, name: str) -> int:
        """Zero and free the slot holding `name`; return the slot number."""
        slot = self.slot_of(name)
        targets = self._targets.pop(name)
        self._clear(slot, targets)
        for m in targets:
            self.slots[m].count(-1)
        self.table[slot] = None
        return slot

    @torch.no_grad()
    def _write(self, slot: int, adapter: LoRAAdapter) -> None:
        # One foreach copy for every target's A, B and scale (a load swaps adapters while the engine serves: 6
        # small ops per linear from Python cost about 5 ms on SmolLM2's 60 q/v linears); ranks below R get zeros.
        dst: list[torch.Tensor] = []
        src: list[torch.Tensor] = []
        pad: list[torch.Tensor] = []
        scales: list[torch.Tensor] = []
        for m, lora in adapter.modules.items():
            s = self.slots[m]
            A, Bt, r = s.A[slot], s.Bt[slot], lora.rank  # [R, d_in], [R, d_out]
            dst += (A[:r], Bt[:r])
            src += (lora.A, lora.B.t())
            scales.append(s.scale[slot])  # [] views
            if r < A.shape[0]:
                pad += (A[r:], Bt[r:])
        values = torch.tensor([lora.scale for lora in adapter.modules.values()], dtype=torch.float64)
        torch._foreach_copy_(dst + scales, src + list(values.unbind()))
        if pad:
            torch._foreach_zero_(pad)

    @torch.no_grad()
    def _clear(self, slot: int, modules: Iterable[str]) -> None:
        slots = [self.slots[m] for m in modules]
        torch._foreach_zero_([t for s in slots for t in (s.A[slot], s.Bt[slot], s.scale[slot])])
