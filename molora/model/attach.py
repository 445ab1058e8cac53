"""`molora.attach`: per-token multi-LoRA on a plain transformers causal LM.

    mm = molora.attach(model, {"math": "adapters/math", "code": "adapters/code"})
    mm(input_ids, adapter_ids=ids)          # ids [B, L]: index into mm.adapter_names per token, -1 = base
    mm(input_ids, adapter_ids="math")       # one adapter for the whole batch
    mm.generate(input_ids, adapter_ids=VocabRouter(...))

`attach` reads and validates every adapter first, builds one `AdapterBank` over the union of their target
linears, swaps those `nn.Linear`s for `RoutedLoRALinear`s (walk-and-swap) and copies each adapter into a
slot. Each forward turns the routing into slot ids [T, k] once and hands it to the routed linears through
the model's `RoutingContext`. This layer knows models and routers; it knows nothing of requests or HTTP.
"""

from __future__ import annotations

import dataclasses
import logging
import re
from collections.abc import Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any, cast

import torch
from torch import nn

from molora.adapters.bank import AdapterBank
from molora.adapters.io import LoRAAdapter, read_adapter, read_adapter_ranks
from molora.config import LLAMA_PROJECTIONS, BankConfig
from molora.errors import AdapterError, MoLoRAError, RoutingError
from molora.model.lora_linear import RoutedLoRALinear, RoutingContext, linear_norms, linear_shapes, swap_modules
from molora.model.quant_linear import (
    HEAD_CAPABLE,
    HEAD_SCHEMES,
    QuantizedLinear,
    activation_ranges,
    quantize_head,
    quantize_linears,
)
from molora.ops import LoRADispatcher, fused_cpu
from molora.routing import Router, Routing, SequenceRouter
from molora.routing.base import InNetworkRouter, to_slots
from molora.sampling import sample_next

log = logging.getLogger("molora.model")

AdapterSpec = torch.Tensor | str | Router | Routing | None


class MoLoRAModel(nn.Module):
    """A causal LM whose target linears add each token's own adapter delta. See the module docstring."""

    def __init__(
        self,
        model: nn.Module,
        bank: AdapterBank,
        context: RoutingContext,
        *,
        router: Router | None = None,
        tokenizer: Any = None,
        base_name: str | None = None,
        check_base: bool = True,
    ) -> None:
        super().__init__()
        self.model = model
        self.bank = bank
        self.context = context
        self.router = router
        self.tokenizer = tokenizer
        self.base_name = base_name
        self.check_base = check_base
        self.adapters: dict[str, LoRAAdapter] = {}  # in load order: index i <-> adapter_names[i]
        # [K] adapter index -> bank slot; a buffer (not persistent: no state_dict key) so mm.to(device) moves it
        self.register_buffer("_index_to_slot", torch.empty(0, dtype=torch.long), persistent=False)
        self.bundle: Any = None  # set by molora.load: the manifest this model came from
        # a per-request chooser (molora.routing.hybrid.HybridChooser, `--router hybrid`): the engine asks it which
        # adapter a request runs on (routing "hybrid": molora.engine.choosing), while `router` (None then) routes
        # per token
        self.chooser: Any = None
        # what rebuilds `chooser` when adapters are loaded or unloaded at run time (a HybridCalibration)
        self.calibration: Any = None
        self.last_carry: torch.Tensor | None = None  # [B, L] decisions at the router's carry_source block
        self._base_norms: dict[str, float] | None = None  # base_norms(), computed at the first adapter read

    # ------------------------------------------------------------------------------------ adapters
    @property
    def adapter_names(self) -> list[str]:
        return list(self.adapters)

    @property
    def config(self) -> Any:
        return self.model.config

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    @property
    def dispatcher(self) -> Any:
        """The `LoRADispatcher` every routed linear shares (attach makes one), None if nothing is routed."""
        return next((m.dispatcher for m in self.model.modules() if isinstance(m, RoutedLoRALinear)), None)

    def read(
        self,
        name: str,
        path: str | Path,
        *,
        roots: Sequence[str | Path] | None = None,
        shapes: Mapping[str, tuple[int, int]] | None = None,
    ) -> LoRAAdapter:
        """Read and validate a PEFT folder against this model's linears (does not load it); with `roots`, every
        file must resolve inside one of them. Touches no model state: safe on a worker thread. shapes: `linear_shapes`
        of the model, when the caller reads many folders (walking the model's modules took about 1 of the 8 ms a rank-8
        q/v adapter of SmolLM2 took to read, 1 thread)."""
        return read_adapter(
            path,
            linear_shapes(self.model) if shapes is None else shapes,
            name=name,
            base_name=self.base_name if self.check_base else None,
            roots=roots,
            base_norms=self.base_norms(),
        )

    def base_norms(self) -> dict[str, float]:
        """{module path: Frobenius norm of its base weight} (`linear_norms`), computed once: the base weights
        never change while adapters come and go (about 0.1 s for SmolLM2-135M, one thread)."""
        if self._base_norms is None:
            self._base_norms = linear_norms(self.model)
        return self._base_norms

    def read_ranks(
        self,
        name: str,
        path: str | Path,
        *,
        roots: Sequence[str | Path] | None = None,
        shapes: Mapping[str, tuple[int, int]] | None = None,
    ) -> dict[str, int]:
        """{module path: rank} of the linears a PEFT folder's config adapts in this model, checked as `read` does
        but without reading the weights (`molora.adapters.io.read_adapter_ranks`). shapes: `linear_shapes` of
        the model, when the caller checks many folders (computed here otherwise)."""
        return read_adapter_ranks(
            path,
            linear_shapes(self.model) if shapes is None else shapes,
            name=name,
            base_name=self.base_name if self.check_base else None,
            roots=roots,
        )

    def load_adapter(self, name: str, path: str | Path | LoRAAdapter) -> int:
        """Load an adapter into a free slot at run time; on any error nothing changes. Returns the slot."""
        adapter = path if isinstance(path, LoRAAdapter) else self.read(name, path)
        if adapter.name != name:
            adapter = dataclasses.replace(adapter, name=name)
        slot = self.bank.load(adapter)
        self.adapters[name] = adapter
        self._sync_slots()
        return slot

    def unload_adapter(self, name: str) -> None:
        """Free `name`'s slot. Indices of adapters loaded after it shift down by one."""
        if name not in self.adapters:
            raise AdapterError(f"adapter {name!r} is not loaded; loaded: {self.adapter_names}")
        self.bank.unload(name)
        del self.adapters[name]
        self._sync_slots()

    def _sync_slots(self) -> None:
        self._index_to_slot = torch.tensor(
            [self.bank.slot_of(n) for n in self.adapters], dtype=torch.long, device=self.device
        )

    # ------------------------------------------------------------------------------------ routing
    def resolve(
        self,
        input_ids: torch.Tensor,
        adapter_ids: AdapterSpec = None,
        adapter_weights: torch.Tensor | None = None,
        *,
        start: int = 0,
    ) -> Routing | None:
        """Turn any accepted routing spec into a `Routing` over input_ids [B, L] (None: decided in-network)."""
        if isinstance(adapter_ids, Routing):
            return adapter_ids
        if isinstance(adapter_ids, torch.Tensor):
            return Routing(adapter_ids, adapter_weights)
        if isinstance(adapter_ids, str):
            adapter_ids = SequenceRouter(adapter_ids)
        router = adapter_ids if adapter_ids is not None else self.router
        if router is None:
            raise RoutingError(
                "no routing given and no router attached: pass adapter_ids (a LongTensor of "
                "adapter indices, an adapter name or a Router) or attach a router"
            )
        if router.in_network:  # (in_network = True marks an InNetworkRouter: learned or Arrow)
            cast(InNetworkRouter, router).prepare(self, input_ids)
            return None
        return router.route(input_ids, self.adapter_names, start=start)

    def slot_routing(
        self, routing: Routing, shape: torch.Size, *, check_values: bool = True
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Map adapter indices to bank slots, flattened: (slot_ids [T, k], weights [T, k] | None).
        check_values: read the ids to check -1 <= id < K (a device sync for ids off the CPU; `routed` skips it
        for ids a library router made on the device)."""
        ids, weights = routing.adapter_ids, routing.weights
        if ids.dtype not in (torch.int64, torch.int32) or ids.shape[:2] != shape or ids.ndim not in (2, 3):
            raise RoutingError(
                f"adapter_ids must be an integer tensor shaped like input_ids {tuple(shape)} "
                f"(or [B, L, k] for top-k), got {ids.dtype} {tuple(ids.shape)}"
            )
        k = len(self.adapters)
        if check_values and ids.numel():
            lo, hi = torch.stack([ids.min(), ids.max()]).tolist()  # one host read for both
            if lo < -1 or hi >= k:
                raise RoutingError(
                    f"adapter_ids hold values in [{lo}, {hi}], but only "
                    f"-1 (base) and 0..{k - 1} (adapters {self.adapter_names}) are valid"
                )
        ids = ids.reshape(-1, 1 if ids.ndim == 2 else ids.shape[-1]).long().to(self._index_to_slot.device)
        if weights is not None:
            if weights.shape[:2] != shape or weights.reshape(ids.shape[0], -1).shape != ids.shape:
                raise RoutingError(f"adapter_weights {tuple(weights.shape)} must match adapter_ids")
            weights = weights.reshape(ids.shape).to(self.device)
        return to_slots(self._index_to_slot, ids), weights

    @contextmanager
    def routed(
        self,
        input_ids: torch.Tensor,
        adapter_ids: AdapterSpec = None,
        adapter_weights: torch.Tensor | None = None,
        *,
        start: int = 0,
        carry: torch.Tensor | None = None,
        fixed: torch.Tensor | None = None,
    ):
        """Fill the routing context for one forward over input_ids, and clear it afterwards.

        carry [B, L] (or None): the decision each token carries from its predecessor (-2: none), for a
        learned router with `carry_blocks`; `self.last_carry` [B, L] then holds the decisions at the
        router's `carry_source` block (None without one). fixed [B, L] (or None): decisions that hold at
        every block (-2: the router decides), e.g. a probe pass's `last_carry` (molora.routing.learned: Probe)."""
        routing = self.resolve(input_ids, adapter_ids, adapter_weights, start=start)
        if routing is not None:
            # ids the caller gave are checked; ids a router made are trusted off the CPU (no device sync)
            given = isinstance(adapter_ids, (torch.Tensor, Routing))
            check = given or routing.adapter_ids.device.type == "cpu"
            self.context.set(*self.slot_routing(routing, input_ids.shape, check_values=check))
        self.context.carry_in = None if carry is None else carry.reshape(-1)
        self.context.fixed_in = None if fixed is None else fixed.reshape(-1)
        self.last_carry = None
        try:
            yield routing
        finally:
            out = self.context.carry_out
            self.last_carry = None if out is None else out.reshape(input_ids.shape[0], -1)
            self.context.clear()

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        adapter_ids: AdapterSpec = None,
        adapter_weights: torch.Tensor | None = None,
        **kwargs: Any,
    ) -> Any:
        """The transformers output (`.logits` [B, L, V]) with each token's adapter applied."""
        with self.routed(
            input_ids,
            adapter_ids,
            adapter_weights,
            start=kwargs.pop("start", 0),
            carry=kwargs.pop("carry", None),
            fixed=kwargs.pop("fixed", None),
        ):
            return self.model(input_ids=input_ids, attention_mask=attention_mask, **kwargs)

    # ------------------------------------------------------------------------------------ generation
    @torch.no_grad()
    def generate(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        *,
        adapter_ids: str | Router | None = None,
        max_new_tokens: int = 32,
        temperature: float = 0.0,
        top_k: int = 0,
        top_p: float = 1.0,
        eos_token_id: int | Sequence[int] | None = None,
        pad_token_id: int | None = None,
        seed: int | None = None,
    ) -> torch.Tensor:
        """Greedy or sampled continuation [B, L + n] (left-padded batches), routing every new token too.

        The router sees each generated token when it is fed back in, so for `VocabRouter` the input token
        decides; a learned router with `carry_blocks` gets each fed-back token's carried decision (the
        previous token's at its `carry_source` block); with `probe_prompt` a probe forward over the prompt
        first gives each prompt token the decision that routes all its blocks, and a prompt it keeps on the
        base model keeps its whole answer there (molora.routing.learned: Base expert). Finished rows are filled with
        pad_token_id (default: the first eos id).
        """
        from transformers import DynamicCache

        if isinstance(adapter_ids, torch.Tensor):
            raise RoutingError(
                "generate needs a router or an adapter name (a fixed adapter_ids tensor cannot "
                "cover the tokens still to be generated); use OracleRouter for given labels"
            )
        eos = [eos_token_id] if isinstance(eos_token_id, int) else list(eos_token_id or [])
        pad = pad_token_id if pad_token_id is not None else (eos[0] if eos else 0)
        mask = attention_mask if attention_mask is not None else torch.ones_like(input_ids)
        positions = (mask.long().cumsum(-1) - 1).clamp(min=0)
        gen = torch.Generator(device=input_ids.device).manual_seed(seed) if seed is not None else None
        cache = DynamicCache()
        tokens, step_ids, step_pos, start = input_ids, input_ids, positions, 0
        done = torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)
        carry = None  # [B, 1] the previous token's decision, for a router with carry_blocks
        fixed = None  # [B, L] the prompt tokens' decisions from a probe pass (molora.routing.learned: Probe)
        router = adapter_ids if adapter_ids is not None else self.router
        # a router with probe_prompt is in-network (molora.routing.learned: Probe; molora.routing.arrow's prompt mode)
        probe = cast(InNetworkRouter, router) if getattr(router, "probe_prompt", False) else None
        if probe is not None:
            self(
                input_ids,
                attention_mask=mask,
                adapter_ids=adapter_ids,
                position_ids=positions,
                use_cache=False,
                logits_to_keep=1,
            )
            assert self.last_carry is not None, "a probe_prompt router's forward records last_carry"
            fixed = probe.prompt_routes(self.last_carry, mask)
        # rows the probe kept wholly on the base model stay there for every generated token (Base expert)
        base_rows = None if fixed is None or probe is None else probe.base_only(fixed, mask)
        held = (
            None if base_rows is None or not bool(base_rows.any()) else torch.where(base_rows, -1, -2)[:, None]
        )  # [B, 1]
        for _ in range(max_new_tokens):
            out = self(
                step_ids,
                attention_mask=mask,
                adapter_ids=adapter_ids,
                position_ids=step_pos,
                cache=cache,
                use_cache=True,
                start=start,
                logits_to_keep=1,
                carry=carry,
                fixed=fixed,
            )
            fixed = held
            carry = None if self.last_carry is None else self.last_carry[:, -1:]
            nxt = sample_next(out.logits[:, -1], temperature, top_k, top_p, gen)
            nxt = torch.where(done, torch.full_like(nxt, pad), nxt)
            tokens = torch.cat([tokens, nxt[:, None]], dim=1)
            done |= torch.isin(nxt, torch.tensor(eos, device=nxt.device)) if eos else done
            if bool(done.all()):
                break
            start += step_ids.shape[1]
            step_ids, step_pos = nxt[:, None], step_pos[:, -1:] + 1
            mask = torch.cat([mask, mask.new_ones(mask.shape[0], 1)], dim=1)
        return tokens


# ---------------------------------------------------------------------------------------------- attach


def attach(
    model: nn.Module,
    adapters: Mapping[str, str | Path] | None = None,
    *,
    slots: int | None = None,
    max_rank: int | None = None,
    target_modules: Sequence[str] | None = None,
    router: Router | None = None,
    tokenizer: Any = None,
    dispatch: str = "auto",
    base_name: str | None = None,
    check_base: bool = True,
    quantization: str | None = None,
    calibration: Sequence[Sequence[int]] | None = None,
    quantize_lm_head: bool | None = None,
) -> MoLoRAModel:
    """Swap the target linears of `model` for routed layers and load `adapters` (name -> PEFT folder).

    slots: bank size S (default max(4, number of adapters)); max_rank: R (default the largest rank given,
    at least 8); target_modules: module-name suffixes to make routable besides the adapters' own targets
    (default, when no adapter is given: the seven Llama projections). quantization: "int8", "int4" or "w8a8"
    quantizes every linear but the LM head first, on the CPU (molora.model.quant_linear: int8 and int4 weight only,
    w8a8 rounds the activations to int8 too); the adapters stay in the model's dtype. calibration (w8a8): rows of
    token ids of general text the float model reads first, for SmoothQuant's activation ranges (molora.load gives
    16 general prompts with their answers; without it w8a8 rounds the activations unsmoothed). quantize_lm_head: the
    LM head too, and a tied input embedding reading the head's int8 copy (molora.model.quant_linear.quantize_head;
    int8 only); None: the scheme's default (HEAD_SCHEMES).
    """
    if any(isinstance(m, RoutedLoRALinear) for m in model.modules()):
        raise MoLoRAError("this model is already attached; attach once and use load_adapter for more")
    if quantize_lm_head and quantization not in HEAD_CAPABLE:
        raise MoLoRAError(f"quantize_lm_head needs quantization='int8' or 'w8a8', got {quantization!r}")
    if quantize_lm_head and type(getattr(model, "get_output_embeddings", lambda: None)()) is not nn.Linear:
        raise MoLoRAError("quantize_lm_head: the model has no plain nn.Linear LM head (get_output_embeddings)")
    if quantization is not None:
        try:
            amax = activation_ranges(model, calibration) if quantization == "w8a8" and calibration else None
            names = quantize_linears(model, quantization, act_amax=amax)
            if quantize_lm_head or (quantize_lm_head is None and quantization in HEAD_SCHEMES):
                names += quantize_head(model, quantization)
        except ValueError as e:
            raise MoLoRAError(f"cannot quantize the base model: {e}") from e
        log.info("quantized %d linears to %s", len(names), quantization)
    adapters = dict(adapters or {})
    base_name = base_name if base_name is not None else (getattr(model, "name_or_path", None) or None)
    shapes = linear_shapes(model)
    read = [read_adapter(p, shapes, name=n, base_name=base_name if check_base else None) for n, p in adapters.items()]
    targets = set().union(*(a.modules for a in read)) if read else set()
    suffixes = target_modules if target_modules is not None else (() if read else LLAMA_PROJECTIONS)
    targets |= {m for m in shapes if any(re.fullmatch(rf"(.*\.)?{re.escape(s)}", m) for s in suffixes)}
    if not targets:
        raise MoLoRAError(f"no linear of the model matches target_modules={list(suffixes)}")
    num_slots = slots if slots is not None else max(4, len(read))
    if num_slots < len(read):
        raise MoLoRAError(f"slots={num_slots} is fewer than the {len(read)} adapters given")
    rank = max_rank if max_rank is not None else max([8] + [a.max_rank for a in read])
    param = next(model.parameters())
    bank = AdapterBank(
        {m: shapes[m] for m in sorted(targets)}, BankConfig(num_slots, rank), dtype=param.dtype, device=param.device
    )
    context = RoutingContext()
    dispatcher = LoRADispatcher(dispatch)
    if dispatch in ("auto", "fused") and param.device.type == "cpu":
        fused_cpu.available()  # build (once per machine) or load the CPU kernel now, not at the first request

    def routed(name: str, old: nn.Module) -> RoutedLoRALinear:
        assert isinstance(old, (nn.Linear, QuantizedLinear)), (name, type(old))  # `targets`: linear_shapes' linears
        return RoutedLoRALinear(old, bank.slots[name], context, dispatcher, name)

    swap_modules(model, sorted(targets), routed)
    mm = MoLoRAModel(
        model, bank, context, router=router, tokenizer=tokenizer, base_name=base_name, check_base=check_base
    )
    for adapter in read:
        mm.load_adapter(adapter.name, adapter)
    mm._sync_slots()
    log.info("attached %d adapters over %d linears (%d slots, max rank %d)", len(read), len(targets), num_slots, rank)
    return mm
