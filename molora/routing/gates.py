"""`GateRouter`: one gate per adapter, each trained alone on its own adapter's prompts against general text,
deciding at the prompt level; an adapter is added with its gate and no other gate changes.

A gate is a linear score over one block's normed input (the input of the block's attention projections,
input_layernorm(h), the state Arrow's prompt mode decides from) with its own threshold:

    margin[t, k] = w_k · x[t] + b_k - threshold_k          x [T, D], w [K, D]: one row per adapter
    vote[t]      = argmax_k margin[t, k]  if that margin > 0, else -1 (the token claims no adapter)

Each gate is fitted one-vs-rest on its adapter's own training prompts (positives) against general prompts the base
model answers (negatives: `molora.data.general` train split and everyday topic prompts), and its threshold is set
from its own held-out positives and general negatives (`molora.train.gates`); it never sees another adapter's data,
so gates trained at different times by different people compose. Nothing is renormalised across gates: adding a
gate leaves every other row of `weight` and every other threshold as it was.

The prompt decides as in Arrow's prompt mode and the learned router's probe (molora.routing.learned: Probe, Base
expert): a probe pass on the base model votes each prompt token at `source_block`, `fill_prompt_routes` counts the
votes over the prompt's last `prompt_window` tokens, a prompt whose share of claimed tokens is below `prompt_share`
(or zero: no gate fired) stays wholly on the base model, answer included, and otherwise every block of every prompt
token and of the answer runs on the prompt's adapter. The router knows adapter names, one block's norm and hidden
states; it answers in adapter indices (-1: none), never in slots.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file
from torch import nn

from molora.errors import BundleError, RoutingError
from molora.ops.device import host_readable
from molora.routing.base import RoutedModel, Router, Routing, base_only, fill_prompt_routes

GATES_WEIGHTS = "gates.safetensors"
GATES_CONFIG = "gates.json"


@dataclass(frozen=True)
class GateConfig:
    """source_block: the block whose normed input the gates read (negative: from the end); prompt_share and
    prompt_window: the prompt vote's (molora.routing.base.fill_prompt_routes)."""

    hidden_size: int
    source_block: int = -5
    prompt_share: float = 0.0
    prompt_window: int | None = None

    def __post_init__(self) -> None:
        if not (isinstance(self.hidden_size, int) and self.hidden_size >= 1):
            raise RoutingError(f"gates hidden_size={self.hidden_size!r}: the model's hidden size, an integer >= 1")
        if not isinstance(self.source_block, int):
            raise RoutingError(f"gates source_block={self.source_block!r}: a block index (negative: from the end)")
        if not (isinstance(self.prompt_share, (int, float)) and 0 <= self.prompt_share <= 1):
            raise RoutingError(f"gates prompt_share={self.prompt_share!r}: a share in [0, 1]")
        if self.prompt_window is not None and not (isinstance(self.prompt_window, int) and self.prompt_window >= 1):
            raise RoutingError(f"gates prompt_window={self.prompt_window!r}: a token count >= 1, or null for all")


@dataclass(frozen=True)
class Gate:
    """One adapter's gate: weight [D], bias, threshold (the margin is w·x + b - threshold)."""

    weight: torch.Tensor
    bias: float
    threshold: float

    def __post_init__(self) -> None:
        if self.weight.dim() != 1 or not torch.isfinite(self.weight).all():
            raise RoutingError(f"a gate's weight must be a finite vector [D], got shape {tuple(self.weight.shape)}")
        if not (torch.isfinite(torch.tensor([self.bias, self.threshold])).all()):
            raise RoutingError(f"a gate's bias and threshold must be finite, got {self.bias}, {self.threshold}")


class GateRouter(Router):
    """Per-adapter gates deciding per prompt; see the module docstring. Call `bind(mm)` before a forward."""

    in_network = True
    probe_prompt = True

    def __init__(self, config: GateConfig, gates: Mapping[str, Gate] | None = None) -> None:
        self.config = config
        self.adapter_names: list[str] = []
        self.weight = torch.zeros(0, config.hidden_size)  # [K, D]
        self.bias = torch.zeros(0, dtype=torch.float64)  # [K], float64: a gate's floats kept exactly
        self.threshold = torch.zeros(0, dtype=torch.float64)  # [K]
        self._norm: nn.Module | None = None
        self._num_blocks = 0
        for name, gate in (gates or {}).items():
            self.add_gate(name, gate)

    # ------------------------------------------------------------------------------------ composability
    def add_gate(self, name: str, gate: Gate) -> None:
        """Append `name` with its gate; the other gates' rows are copied unchanged (nothing is refitted)."""
        if name in self.adapter_names:
            raise RoutingError(f"the gate router already has a gate for {name!r}")
        if gate.weight.shape != (self.config.hidden_size,):
            raise RoutingError(
                f"gate for {name!r} has weight shape {tuple(gate.weight.shape)}, expected ({self.config.hidden_size},)"
            )
        self.weight = torch.cat([self.weight, gate.weight.detach().float().cpu()[None]])
        self.bias = torch.cat([self.bias, torch.tensor([float(gate.bias)], dtype=torch.float64)])
        self.threshold = torch.cat([self.threshold, torch.tensor([float(gate.threshold)], dtype=torch.float64)])
        self.adapter_names.append(name)

    def gate_of(self, name: str) -> Gate:
        i = self.adapter_names.index(name)
        return Gate(self.weight[i].clone(), float(self.bias[i]), float(self.threshold[i]))

    # ------------------------------------------------------------------------------------ deciding
    def margins(self, x: torch.Tensor) -> torch.Tensor:
        """[T, K]: each gate's score minus its threshold for normed inputs x [T, D]."""
        dev = x.device
        return x.float() @ self.weight.to(dev).T + (self.bias - self.threshold).float().to(dev)

    def votes(self, x: torch.Tensor, allowed: torch.Tensor | None = None) -> torch.Tensor:
        """[T]: the adapter whose gate clears its threshold by the most, -1 where no gate fires (stay on base)."""
        m = self.margins(x)
        if allowed is not None:
            m = m.masked_fill(~allowed.to(m.device).bool(), float("-inf"))
        if m.shape[1] == 0:
            return torch.full((x.shape[0],), -1, dtype=torch.long, device=x.device)
        best, ids = m.max(-1)
        return torch.where(best > 0, ids, -1)

    @property
    def carry_blocks(self) -> int:
        """Every block of a generated token takes its predecessor's decision (the prompt's, in the end)."""
        return self._num_blocks

    @property
    def carry_source(self) -> int:
        n, b = self._num_blocks, self.config.source_block
        b = b + n if b < 0 else b
        if not 0 <= b < n:
            raise RoutingError(f"gates source_block={self.config.source_block} outside the model's {n} blocks")
        return b

    def gate_index(self, block: int) -> int | None:
        return block

    def prompt_routes(self, probe: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        c = self.config
        return fill_prompt_routes(probe, mask, c.prompt_share, last_takes_top=True, window=c.prompt_window)

    base_only = staticmethod(base_only)

    def decide(
        self, block: int, hidden: torch.Tensor, allowed: torch.Tensor | None = None, carry: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None] | None:
        """A token with a carried decision (carry [T] >= -1) takes it at every block; the others (a probe's prompt
        tokens) run on the base model except at `carry_source`, where the gates vote from the base model's state."""
        if self._norm is None:
            raise RoutingError("the gate router is not bound to a model: call router.bind(mm) (molora.load does)")
        carried = None if carry is None else carry.to(hidden.device).long()[:, None]  # [T, 1]
        if carried is not None and host_readable(carried) and bool((carried >= -1).all()):
            return carried, None
        with torch.no_grad():
            if block == self.carry_source:
                ids = self.votes(self._norm(hidden), allowed)[:, None]
            else:
                ids = torch.full((hidden.shape[0], 1), -1, dtype=torch.long, device=hidden.device)
        return (ids if carried is None else torch.where(carried >= -1, carried, ids)), None

    def route(self, input_ids: torch.Tensor, adapter_names: Sequence[str], *, start: int = 0) -> Routing:
        raise RoutingError("GateRouter decides inside the network; pass it as adapter_ids to a MoLoRAModel")

    # ------------------------------------------------------------------------------------ binding
    def bind(self, mm: RoutedModel) -> GateRouter:
        """Find mm's decoder blocks and the norm of the source block's input."""
        from molora.routing.learned import decoder_layers  # the one place that knows where blocks live

        layers = decoder_layers(mm.model)
        self._num_blocks = len(layers)
        self._norm = layers[self.carry_source].get_submodule("input_layernorm")
        return self

    def prepare(self, mm: RoutedModel, input_ids: torch.Tensor) -> None:
        """Make mm route by this router for its next forward (installs gated blocks once)."""
        from molora.routing.learned import install_gates

        self.bind(mm)
        missing = [n for n in self.adapter_names if n not in mm.bank]
        if missing:
            raise RoutingError(f"gates for adapters {missing} that are not loaded (loaded: {mm.adapter_names})")
        install_gates(mm)
        ctx = mm.context
        ctx.router = self
        ctx.slot_map = torch.tensor([mm.bank.slot_of(n) for n in self.adapter_names], device=input_ids.device)

    # ------------------------------------------------------------------------------------ files
    def save(self, folder: str | Path) -> Path:
        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        save_file(
            {"weight": self.weight.contiguous(), "bias": self.bias.contiguous(), "threshold": self.threshold},
            str(folder / GATES_WEIGHTS),
        )
        meta = {"config": asdict(self.config), "adapter_names": self.adapter_names}
        (folder / GATES_CONFIG).write_text(json.dumps(meta, indent=2) + "\n")
        return folder

    @classmethod
    def load(cls, folder: str | Path, overrides: Mapping[str, Any] | None = None) -> GateRouter:
        """The router saved in `folder`; overrides: GateConfig fields to replace (a manifest's settings)."""
        folder = Path(folder)
        try:
            meta = json.loads((folder / GATES_CONFIG).read_text())
            t = load_file(str(folder / GATES_WEIGHTS))
            config = GateConfig(**{**meta["config"], **(overrides or {})})
            names = list(meta["adapter_names"])
            gates = {
                n: Gate(t["weight"][i], float(t["bias"][i]), float(t["threshold"][i])) for i, n in enumerate(names)
            }
        except (OSError, KeyError, TypeError, IndexError, json.JSONDecodeError) as e:
            raise BundleError(f"cannot read the gate router in {folder}: {e}") from e
        except RoutingError as e:
            raise BundleError(f"{folder}: {e}") from e
        return cls(config, gates)
