"""`LearnedRouter`: small gates over hidden states choose each token's adapter inside the network (MoLoRA).

Two gate layouts, one module:

- **joint** (default): a K+1-way linear gate (K adapters + "none") trained on a mixture of the adapters'
  datasets. Logits [T, K+1] = W[g] @ rms(h) + b[g].
- **composable**: each adapter brings its own binary gate (its domain versus generic text), trained alone;
  a token goes to the adapter whose gate fires highest above `threshold`, else to none. A new adapter plus
  its gate is added with `add_adapter` without touching the other gates.

And two placements:

- **per_block**: gate g = block; each decoder block decides from its own input hidden state.
- **shared**: one gate at block `shared_block` decides once per token; blocks before it run the base
  model, later blocks reuse the decision.

`decide(block, hidden [T, D], allowed [K] or [T, K] | None, carry [T] | None)` returns (adapter_ids [T, k] in router
order, -1 = none; weights [T, k] or None) or None to keep the previous decision. Top-k (k <= 2)
renormalizes the chosen probabilities. The router knows hidden states and adapter names; not slots, banks
or requests.

**Carry** (`carry_blocks = c > 0`, per_block top-1): a block's input holds only as much context as the
blocks before it gathered. Block 0 sees the token's embedding alone, so its gate is a vocabulary lookup
(on held-out router data of the default bundle: 62% of tokens right at block 0, 90% at block 1, 96% at
block 2, >= 97% after), and in a long generated answer those context-free misroutes change digits and
formats. So for a *generated* token (one the model produced and is fed back) the blocks below c take the
adapter that the previous token got at the last block (`carry_source`), which saw the whole context;
prompt tokens, whose predecessors run in the same forward, keep their own gates. Callers pass `carry`
[T]: that previous decision per token (router index, -1 none) or -2 where there is none (prompt tokens),
and record each sequence's decision at `carry_source` for its next token (`MoLoRAModel.generate` and the
engine do both).

**Probe** (`probe_prompt`, needs carry): carry leaves the prompt tokens on their own gates, and their
early and middle gates err the same way (on the default bundle, an arithmetic prompt's "8" went to counting
in blocks 2-21). With `probe_prompt` the caller first runs the prompt once on the gates (the probe) and
keeps each prompt token's decision at `carry_source`; the real pass then routes every block of each
prompt token by that decision (`fixed`, see `molora.routing.base.in_network_decide`). Since the whole
prompt is known, a token the probe sent to "none" takes the prompt's most frequent adapter
(`prompt_routes`): the chat header before any content (`<|im_start|>user\n`, position 0 being the
attention sink) cannot tell the skill yet, and each adapter was trained with its LoRA on those tokens. The
probe costs one more forward over the prompt (its logits are not needed). Measured on the default bundle,
learned routing with carry (own adapter in brackets): on the 250 eval items per skill, probe without the
fill: arithmetic 4.0 -> 8.0 [8.0], Dyck 78.8 -> 81.2 [81.6], but counting 78.8 -> 76.4 [80.4]. The fill
was chosen on 200 separate validation items per skill (seed EVAL_SEED_BASE + 500 + skill index, none in
the training or eval items), against no fill and against taking the next prompt token's adapter:
arithmetic 8.0 / 7.5 / 6.5 [6.5], counting 66.0 / 64.0 / 66.0 [66.0]. Callers: `MoLoRAModel.generate` (one probe forward
over the whole prompt) and the engine (a probe phase of chunked prefill before the real one, `Request.prompt_routes`).

**Base expert** ("none" as a routing outcome of its own). The joint gate's last class is the base model, trained
on general text (molora.data.general: human-written everyday tasks, word problems, the base model's own answers)
like any adapter's class on its data. Two router settings, both chosen on validation data and kept in router.json:
`confidence` (0: the most probable class; c > 0: the most probable adapter takes a token if its gate
probability is at least c, else the base model does; composable gates compare their own sigmoid) and `prompt_share`
(with the probe: a prompt whose share of tokens the probe gives to adapters is below it, or is zero, runs wholly on the
base model, its answer included). The second is the generation-level policy: per-token gates err now and then, and on a
prompt outside every skill one stray adapter token used to pull the whole prompt to that adapter through the fill; a
prompt is either a skill's (routed per token, filled, carried) or nobody's (the base model's exact answer). A mixed
prompt holds enough skill tokens to stay routed. `MoLoRAModel.generate` holds such rows on the base for every generated
token; the engine turns such a request's mode to "none".
"""

from __future__ import annotations

import json
import logging
import math
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from torch import nn

from molora.errors import BundleError, RoutingError
from molora.ops.device import host_readable
from molora.routing.base import RoutedModel, Router, Routing, base_only, fill_prompt_routes
from molora.routing.mix import Mix

ROUTER_WEIGHTS = "router.safetensors"
ROUTER_CONFIG = "router.json"
BASE_EXPERT_KEYS = ("confidence", "prompt_share")  # router.json keys of the base expert (absent in old files)

log = logging.getLogger("molora.routing")


@dataclass(frozen=True)
class LearnedRouterConfig:
    adapter_names: tuple[str, ...]
    hidden_size: int
    num_blocks: int
    placement: str = "per_block"  # "per_block" | "shared"
    shared_block: int = 0
    composable: bool = False
    top_k: int = 1
    threshold: float = 0.0  # composable: a gate must exceed this logit to claim a token
    carry_blocks: int = 0  # generated tokens: blocks below this take the previous token's decision
    probe_prompt: bool = False  # prompt tokens: every block takes a probe pass's carry_source decision
    confidence: float = 0.0  # base expert: an adapter takes a token only with probability >= this
    prompt_share: float = 0.0  # base expert: the share of prompt tokens the probe must give to adapters,
    # else the whole request (prompt and answer) runs on the base model

    def __post_init__(self) -> None:
        if self.placement not in ("per_block", "shared"):
            raise RoutingError(f"placement={self.placement!r}: use 'per_block' or 'shared'")
        if not 0 <= self.shared_block < self.num_blocks:
            raise RoutingError(f"shared_block={self.shared_block} outside 0..{self.num_blocks - 1}")
        if self.top_k not in (1, 2):
            raise RoutingError(f"top_k={self.top_k}: the learned router supports top-1 and top-2")
        if len(set(self.adapter_names)) != len(self.adapter_names):
            raise RoutingError(f"duplicate adapter names {list(self.adapter_names)}")
        if self.carry_blocks and (
            self.placement != "per_block" or self.top_k != 1 or not 0 < self.carry_blocks < self.num_blocks
        ):
            raise RoutingError(
                f"carry_blocks={self.carry_blocks}: carry needs placement='per_block', top_k=1 and "
                f"0 < carry_blocks < num_blocks ({self.num_blocks}); use 0 to turn it off"
            )
        for key in ("confidence", "prompt_share"):
            value = getattr(self, key)
            if not (isinstance(value, (int, float)) and 0.0 <= value <= 1.0):
                raise RoutingError(
                    f"{key}={value!r} is outside [0, 1]: it is a probability (a share of the "
                    f"prompt for prompt_share); use 0 to turn it off"
                )
        if self.prompt_share and not self.probe_prompt:
            raise RoutingError(
                f"prompt_share={self.prompt_share} needs probe_prompt=true (the probe pass measures "
                "the share); set probe_prompt or prompt_share=0"
            )
        if self.probe_prompt and not self.carry_blocks:
            raise RoutingError(
                "probe_prompt needs carry_blocks > 0 (the probe keeps the decisions at the "
                "carry_source block); set carry_blocks or probe_prompt=false"
            )

    @property
    def num_gates(self) -> int:
        return self.num_blocks if self.placement == "per_block" else 1


class LearnedRouter(Router, nn.Module):
    """Gates over hidden states; see the module docstring."""

    in_network = True

    def __init__(self, config: LearnedRouterConfig) -> None:
        nn.Module.__init__(self)
        self.config = config
        self.adapter_names = list(config.adapter_names)
        G, D = config.num_gates, config.hidden_size
        C = len(self.adapter_names) + (0 if config.composable else 1)  # joint: last class = none
        self.weight = nn.Parameter(torch.zeros(G, C, D))  # [G, C, D]
        self.bias = nn.Parameter(torch.zeros(G, C))  # [G, C]
        self.mix_experts: dict[str, Mix] = {}  # named mixes standing in for their adapters (set_mix_experts)

    # ------------------------------------------------------------------------------------- mix experts
    def set_mix_experts(self, mixes: Mapping[str, Mix]) -> None:
        """Take named mixes as experts (molora.json "router_experts"): a token the gates give to an adapter of a mix
        runs on that mix (its weighted sum of adapter deltas); the gates themselves are unchanged.

        Why this form: the gates were trained on classes of adapters (and "none") and know no mix. A mix of a
        skill's adapters is what the router's choice of any of them should run, so the mix takes those adapters'
        tokens; a class of its own would need training data for the mix, and a logit made up from its adapters'
        logits (a weighted mean) can never beat the best of them, so such an expert would never be chosen. Hence each
        adapter belongs to at most one mix expert, and every adapter of a mix expert must be one of the router's
        (else the mix could never be chosen): a RoutingError(field="router_experts") naming the mix, nothing
        changed. An empty mapping restores plain routing."""
        owner: dict[str, str] = {}
        for name, mix in mixes.items():
            missing = sorted(a for a, _ in mix if a not in self.adapter_names)
            if missing:
                raise RoutingError(
                    f"mix {name!r} cannot be an expert of the learned router: its adapter(s) {missing} are not among "
                    f"the router's {self.adapter_names} (the gates choose only adapters they were trained on)",
                    field="router_experts",
                )
            for a, _ in mix:
                if a in owner:
                    raise RoutingError(
                        f"adapter {a!r} is in two mix experts of the learned router, {owner[a]!r} and {name!r}: a "
                        "token the gates give to it can run on one of them only; keep one",
                        field="router_experts",
                    )
                owner[a] = name
        self.mix_experts = dict(mixes)

    def experts(self) -> list[Mix]:
        """Per router index (adapter_names order): the mix expert holding that adapter, else the adapter alone."""
        of = {a: mix for mix in self.mix_experts.values() for a, _ in mix}
        return [of.get(n, ((n, 1.0),)) for n in self.adapter_names]

    # ------------------------------------------------------------------------------------- inference
    def gate_index(self, block: int) -> int | None:
        c = self.config
        if c.placement == "per_block":
            return block
        return 0 if block == c.shared_block else None

    def logits(self, gate: int, hidden: torch.Tensor) -> torch.Tensor:
        """Gate logits [T, C] for hidden [T, D] (RMS-normalized first: block inputs differ in scale)."""
        h = F.rms_norm(hidden.float(), (hidden.shape[-1],))
        return h @ self.weight[gate].float().T + self.bias[gate].float()  # fp32 even in a bf16 model

    @property
    def carry_blocks(self) -> int:
        """Blocks below this take a generated token's carried decision (module docstring: Carry)."""
        return self.config.carry_blocks

    @property
    def probe_prompt(self) -> bool:
        """Prompt tokens are routed by a probe pass's decisions (module docstring: Probe)."""
        return self.config.probe_prompt

    @property
    def carry_source(self) -> int:
        """The block whose decision a token carries to the next generated token: the last one."""
        return self.config.num_blocks - 1

    def decide(
        self, block: int, hidden: torch.Tensor, allowed: torch.Tensor | None = None, carry: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None] | None:
        gate = self.gate_index(block)
        if gate is None:
            if block < self.config.shared_block:  # before the shared gate: base model only
                return torch.full((hidden.shape[0], 1), -1, dtype=torch.long, device=hidden.device), None
            return None
        with torch.no_grad():
            if carry is None or block >= self.config.carry_blocks:
                return self.choose(self.logits(gate, hidden), allowed)
            carry = carry.to(hidden.device).long()[:, None]  # [T, 1]
            known = carry >= -1
            if host_readable(carry) and bool(known.all()):  # a shortcut only: off the CPU the gate
                return carry, None  # runs and `where` gives the same ids, no sync
            ids, _ = self.choose(self.logits(gate, hidden), allowed)
            return torch.where(known, carry, ids), None

    def prompt_routes(self, probe: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        """The prompt tokens' decisions [B, L] from a probe pass's carry_source decisions [B, L] (module
        docstring: Probe and Base expert). mask [B, L] (1 = token, 0 = padding) keeps padding out of the counts.

        A prompt whose share of tokens the probe gave to adapters is below `prompt_share`, or is zero, stays
        wholly on the base model (every decision -1: the caller then keeps its answer there too). Otherwise
        each "none" (-1) takes the most frequent other decision of its prompt (the lowest index on a tie)."""
        return fill_prompt_routes(probe, mask, self.config.prompt_share)

    base_only = staticmethod(base_only)

    def choose(
        self, logits: torch.Tensor, allowed: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(adapter_ids [T, k], weights [T, k] | None) from gate logits [T, C].

        confidence 0: the most probable class (an adapter or "none"). confidence c > 0, joint gate: the most
        probable adapter takes the token if its probability (softmax over the K adapters and "none") is at
        least c, whatever "none" has, else the base model does (-1); so c below 0.5 lets an adapter claim a
        token "none" narrowly wins, c above it keeps doubtful tokens on the base. Composable gates compare their
        own sigmoid with c."""
        K = len(self.adapter_names)
        conf = self.config.confidence
        if self.config.composable:
            # composable: column K is a fixed "none" logit at the threshold (raised to the confidence's logit)
            none = self.config.threshold
            if conf > 0:
                none = max(none, math.log(conf / (1 - conf)) if conf < 1 else math.inf)
            logits = torch.cat([logits, logits.new_full((logits.shape[0], 1), none)], 1)
        if allowed is not None:  # [K] for every token, or [T, K] per token; "none" is always allowed
            allowed = allowed.to(logits.device)
            block = torch.cat([~allowed, allowed.new_zeros(*allowed.shape[:-1], 1)], -1)
            logits = logits.masked_fill(block, float("-inf"))
        k = self.config.top_k
        if k == 1 and (conf == 0 or self.config.composable):
            top = logits.argmax(-1, keepdim=True)
            return torch.where(top == K, -1, top), None
        probs = logits.softmax(-1)
        if not self.config.composable:  # the best adapters compete on their own probability, "none" aside
            w, top = probs[:, :K].topk(min(k, K), dim=-1)
            top = torch.where(w < conf, K, top)  # unconfident: the base
        else:
            w, top = probs.topk(k, dim=-1)
        if k == 1:
            return torch.where(top == K, -1, top), None
        w = w / w.sum(-1, keepdim=True).clamp_min(1e-9)
        return torch.where(top == K, -1, top), w

    def route(self, input_ids: torch.Tensor, adapter_names: Sequence[str], *, start: int = 0) -> Routing:
        raise RoutingError("LearnedRouter decides inside the network; pass it as adapter_ids to a MoLoRAModel")

    def prepare(self, mm: RoutedModel, input_ids: torch.Tensor) -> None:
        """Make `mm` route by this router for its next forward (installs gated blocks once)."""
        if self.mix_experts:
            raise RoutingError(
                f"mix experts {sorted(self.mix_experts)} run on the engine (molora.Engine, molora serve); "
                "the transformers path routes between adapters only"
            )
        install_gates(mm)
        missing = [n for n in self.adapter_names if n not in mm.bank]
        if missing:
            raise RoutingError(
                f"the router was trained for adapters {missing} that are not loaded (loaded: {mm.adapter_names})"
            )
        ctx = mm.context
        ctx.router = self
        ctx.slot_map = torch.tensor([mm.bank.slot_of(n) for n in self.adapter_names], device=input_ids.device)

    # ------------------------------------------------------------------------------------- composability
    def add_adapter(self, name: str, weight: torch.Tensor, bias: torch.Tensor) -> None:
        """Composable mode: append `name` with its own gate (weight [G, D], bias [G]); others untouched."""
        if not self.config.composable:
            raise RoutingError("add_adapter needs a composable router; a joint router is retrained instead")
        if name in self.adapter_names:
            raise RoutingError(f"the router already has a gate for {name!r}")
        G, _, D = self.weight.shape
        if weight.shape != (G, D) or bias.shape != (G,):
            raise RoutingError(
                f"gate for {name!r} has shape {tuple(weight.shape)}/{tuple(bias.shape)}, expected ({G}, {D})/({G},)"
            )
        with torch.no_grad():
            self.weight = nn.Parameter(torch.cat([self.weight, weight[:, None].to(self.weight)], 1))
            self.bias = nn.Parameter(torch.cat([self.bias, bias[:, None].to(self.bias)], 1))
        self.adapter_names.append(name)
        self.config = LearnedRouterConfig(**{**asdict(self.config), "adapter_names": tuple(self.adapter_names)})

    def gate_of(self, name: str) -> tuple[torch.Tensor, torch.Tensor]:
        """Composable mode: the (weight [G, D], bias [G]) of one adapter's gate."""
        i = self.adapter_names.index(name)
        return self.weight[:, i].detach().clone(), self.bias[:, i].detach().clone()

    # ------------------------------------------------------------------------------------- files
    def save(self, folder: str | Path) -> Path:
        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        save_file(
            {"weight": self.weight.detach().contiguous(), "bias": self.bias.detach().contiguous()},
            str(folder / ROUTER_WEIGHTS),
        )
        (folder / ROUTER_CONFIG).write_text(json.dumps(asdict(self.config), indent=2) + "\n")
        return folder

    @classmethod
    def load(cls, folder: str | Path) -> LearnedRouter:
        folder = Path(folder)
        try:
            raw = json.loads((folder / ROUTER_CONFIG).read_text())
            raw["adapter_names"] = tuple(raw["adapter_names"])
            missing = [k for k in BASE_EXPERT_KEYS if k not in raw]
            router = cls(LearnedRouterConfig(**raw))
            tensors = load_file(str(folder / ROUTER_WEIGHTS))
        except (OSError, KeyError, TypeError, json.JSONDecodeError) as e:
            raise BundleError(f"cannot read the learned router in {folder}: {e}") from e
        except RoutingError as e:
            raise BundleError(f"{folder / ROUTER_CONFIG}: {e}") from e
        if missing:
            log.warning(
                "%s has no base-expert settings (%s): it predates the base model as a routing outcome of "
                "its own, so it loads with %s = 0: every token goes to its most probable class and no "
                "prompt is kept wholly on the base model. Retrain it with `molora train-router` (general "
                "text in the none class) to keep prompts outside the adapters' skills on the base.",
                folder / ROUTER_CONFIG,
                ", ".join(missing),
                " = ".join(missing),
            )
        for key in ("weight", "bias"):
            want = getattr(router, key).shape
            if key not in tensors or tensors[key].shape != want:
                got = tuple(tensors[key].shape) if key in tensors else "missing"
                raise BundleError(f"{folder / ROUTER_WEIGHTS}: {key} is {got}, expected {tuple(want)}")
        with torch.no_grad():
            router.weight.copy_(tensors["weight"])
            router.bias.copy_(tensors["bias"])
        return router


# --------------------------------------------------------------------------------------------- gating


def decoder_layers(model: nn.Module) -> nn.ModuleList:
    """The decoder blocks of a transformers causal LM (model.model.layers for the Llama family)."""
    inner = getattr(model, "model", None)
    layers = getattr(inner, "layers", None)
    if not isinstance(layers, nn.ModuleList):
        raise RoutingError(f"cannot find decoder layers (model.model.layers) in {type(model).__name__}")
    return layers


def install_gates(mm: RoutedModel) -> list[int]:
    """Let the in-network router decide before each decoder block of mm.model runs (once per model): a
    forward pre-hook on every block calls `mm.context.route_block(index, block input)`. A standard PyTorch
    hook, visible in `block._forward_pre_hooks`; the model's classes, module paths and state_dict keys are
    unchanged, so adapters keep loading by their PEFT keys. Returns the indices hooked now."""
    hooked = mm.__dict__.setdefault("_molora_gate_hooks", {})
    done = []
    for i, layer in enumerate(decoder_layers(mm.model)):
        if i not in hooked:
            hooked[i] = layer.register_forward_pre_hook(_gate_hook(i, mm.context), with_kwargs=True)
            done.append(i)
    return done


def _gate_hook(index: int, context: Any) -> Any:
    def hook(module: nn.Module, args: tuple, kwargs: dict) -> None:
        hidden = args[0] if args else kwargs["hidden_states"]
        context.route_block(index, hidden.reshape(-1, hidden.shape[-1]))

    return hook
