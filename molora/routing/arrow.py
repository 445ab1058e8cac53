"""`ArrowRouter`: routing with no training data, from the adapters' own weights (Arrow, arXiv 2405.11157).

Each adapted linear l of each adapter e has a *prototype*: the top right singular vector v[l, e] of its delta
B·A (a direction in the linear's input space, unit norm, sign arbitrary). A token whose input x at that linear
points along v[l, e] is one the adapter changes most, so Arrow routes it there:

    sim[t, e]  = |x[t] · v[l, e]|                       (abs: a singular vector's sign is arbitrary)
    top-k of sim[t, :], then w = softmax(top values / temperature)     (the other adapters get weight 0)
    delta[t]   = sum_j w[t, j] * scale[e_j] * B[e_j] @ (A[e_j] @ x[t])

which is PEFT's `create_arrow_model` (peft.tuners.lora.arrow) without GenKnowSub. PEFT computes every
adapter for every token and mixes them (work K·N); here only the k chosen adapters run, on molora's sparse
dispatch (work k·N).

Two granularities (`ArrowConfig.granularity`):

- **per_linear** (PEFT's): every adapted linear routes its own input with its own prototypes. The routed
  linears ask the model's `RoutingContext` for their routing (`RoutingContext.linear`, a `LinearRouting`),
  which calls `ArrowRouter.decide_linear(name, x)`; no block-level decision exists.
- **per_block**: one decision per decoder block, made before the block runs from the input of one chosen
  attention projection (`projection`: q_proj, k_proj or v_proj, whose input is input_layernorm(block input))
  with that projection's prototypes, and reused by every linear of the block. It plugs in like the learned
  router: `decide(block, hidden, allowed)`, so the engine runs it too.

`threshold` (off by default, as in PEFT): a token whose best |cos(x, v)| (the similarity divided by |x|, so
a scale-free number in [0, 1]) is below it stays on the base model (-1) at that linear or block.

**Calibration** (`rms_threshold`, per_block top-1): a raw |cos| means different things for different adapters
(a prototype along a common direction fires on every token), so each adapter's |cos| is divided by its RMS over
general text run on the base model (`calibrate`: train-split general prompts in the model's chat template, no
labels), and a token whose best ratio is below the threshold stays on the base model. The router keeps
E[x̂ x̂ᵀ] of the deciding projection's unit-norm inputs, so an adapter loaded later is scored without a forward.

**Prompt** (`prompt`, with the engine's and `generate`'s probe pass, as the learned router's Probe): the probe
runs the base model and decides each prompt token at `source_block` only; the prompt votes
(`molora.routing.base.fill_prompt_routes`: a token that chose nothing takes the majority, the last token takes it
too, so the answer carries it), and a prompt with fewer than `prompt_share` of its tokens claimed runs wholly on
the base model. `prompt_window` limits the vote to the prompt's last tokens, so that in a conversation the latest
question, not the history, picks the answer's adapter. `--router arrow` serves this mode with settings chosen on
validation (docs/results.md).

Prototypes are computed from the adapters' weights once per adapter and recomputed when an adapter of the same
name is loaded again (a new `LoRAAdapter` object in `mm.adapters`); `method` "svd" takes the exact vector
(QR of B, then the SVD of the small R·A), "power" PEFT's estimator (power iteration on AᵀBᵀBA from a seeded
random start, `iters` steps) for bit-level comparisons with PEFT. The router knows adapter names, module paths
and hidden states; it answers in adapter indices (-1: none), never in slots.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from molora.data.general import calibration_rows
from molora.errors import RoutingError
from molora.ops.device import host_readable
from molora.routing.arrow_linear import LinearRouting
from molora.routing.arrow_protos import top_right_singular_vector
from molora.routing.base import RoutedModel, Router, Routing, base_only, fill_prompt_routes
from molora.routing.mix import Mix

log = logging.getLogger("molora.routing")

GRANULARITIES = ("per_linear", "per_block")
METHODS = ("svd", "power")
BLOCK_PROJECTIONS = ("q_proj", "k_proj", "v_proj")  # their input is input_layernorm(block input)


@dataclass(frozen=True)
class ArrowConfig:
    """Arrow's settings. top_k and temperature as PEFT's ArrowConfig (top_k, router_temperature); threshold
    None = off; projection (per_block) None = the first of q_proj, k_proj, v_proj that the adapters adapt."""

    top_k: int = 1
    temperature: float = 1.0
    granularity: str = "per_linear"
    threshold: float | None = None
    projection: str | None = None
    method: str = "svd"
    iters: int = 15  # method "power": PEFT's default
    seed: int | None = 0  # method "power": PEFT's rng_seed (None: the global RNG, not reproducible)
    # calibrated base option and prompt-level evidence (module docstring: Calibration, Prompt); per_block, top-1
    rms_threshold: float | None = None  # a token's best adapter must score this many times its general-text RMS
    prompt: bool = False  # decide once per prompt token from a probe, vote, follow the prompt
    source_block: int | None = None  # prompt: the block whose decision the probe keeps (None: 5/6 of the depth,
    # block 25 of 30 on the default bundle, chosen on validation)
    prompt_share: float = 0.0  # prompt: below this share of claimed tokens the prompt runs on the base
    prompt_window: int | None = None  # prompt: the vote counts the prompt's last this many tokens (None: all)
    calibration_prompts: int = 96  # general prompts (train split) in the chat template, for rms_threshold

    def __post_init__(self) -> None:
        fix = ' (in molora.json: router {"kind": "arrow", ...}; on the command line: --router arrow)'
        if not (isinstance(self.top_k, int) and self.top_k >= 1):
            raise RoutingError(f"arrow top_k={self.top_k!r}: use an integer >= 1 (1: one adapter per token){fix}")
        if not (isinstance(self.temperature, (int, float)) and self.temperature > 0):
            raise RoutingError(f"arrow temperature={self.temperature!r}: use a number > 0 (1.0 as PEFT){fix}")
        if self.granularity not in GRANULARITIES:
            raise RoutingError(f"arrow granularity={self.granularity!r}: use one of {', '.join(GRANULARITIES)}{fix}")
        if self.threshold is not None and not (isinstance(self.threshold, (int, float)) and 0 <= self.threshold <= 1):
            raise RoutingError(f"arrow threshold={self.threshold!r}: a |cosine| in [0, 1], or null for none{fix}")
        if self.projection is not None and self.projection not in BLOCK_PROJECTIONS:
            raise RoutingError(
                f"arrow projection={self.projection!r}: per_block decides from one of "
                f"{', '.join(BLOCK_PROJECTIONS)} (their input is the block's normed input){fix}"
            )
        if self.method not in METHODS:
            raise RoutingError(f"arrow method={self.method!r}: use one of {', '.join(METHODS)}{fix}")
        if not (isinstance(self.iters, int) and self.iters >= 1):
            raise RoutingError(f"arrow iters={self.iters!r}: use an integer >= 1{fix}")

        per_block_only = [k for k in ("rms_threshold", "prompt") if getattr(self, k) not in (None, False)]
        if per_block_only and (self.granularity != "per_block" or self.top_k != 1):
            raise RoutingError(
                f"arrow {', '.join(per_block_only)} needs granularity='per_block' and top_k=1 (got "
                f"{self.granularity!r}, top_k={self.top_k}){fix}"
            )
        if not (isinstance(self.prompt_share, (int, float)) and 0 <= self.prompt_share <= 1):
            raise RoutingError(f"arrow prompt_share={self.prompt_share!r}: a share in [0, 1]{fix}")
        if self.prompt_window is not None and not (
            self.prompt and isinstance(self.prompt_window, int) and self.prompt_window >= 1
        ):
            raise RoutingError(
                f"arrow prompt_window={self.prompt_window!r}: a token count >= 1 with prompt=true, or null{fix}"
            )
        if self.prompt_share and not self.prompt:
            raise RoutingError(f"arrow prompt_share needs prompt=true (the probe measures the share){fix}")
        if self.rms_threshold is not None and not (
            isinstance(self.rms_threshold, (int, float)) and self.rms_threshold >= 0
        ):
            raise RoutingError(f"arrow rms_threshold={self.rms_threshold!r}: a ratio >= 0, or null for none{fix}")
        if not (isinstance(self.calibration_prompts, int) and self.calibration_prompts >= 8):
            raise RoutingError(f"arrow calibration_prompts={self.calibration_prompts!r}: an integer >= 8{fix}")

    @classmethod
    def from_json(cls, raw: Mapping[str, Any], where: str = "arrow router") -> ArrowConfig:
        """From a manifest's router object (its "kind" and "path" keys ignored); unknown keys are refused."""
        known = set(cls.__dataclass_fields__)
        unknown = sorted(set(raw) - known - {"kind", "path"})
        if unknown:
            raise RoutingError(f"{where}: unknown option(s) {unknown}; known: {sorted(known)}")
        return cls(**{k: v for k, v in raw.items() if k in known})


# --------------------------------------------------------------------------------------------- router


class ArrowRouter(Router):
    """Arrow routing from the adapters' weights; see the module docstring.

    adapter_names: the adapters it chooses between (router index order); None follows the model's loaded
    adapters (`mm.adapter_names`) at every forward. Call `bind(mm)` once (molora.load and `prepare` do) so the
    router finds the model's adapters, decoder blocks and linears.
    """

    in_network = True

    def __init__(self, config: ArrowConfig | None = None, adapter_names: Sequence[str] | None = None) -> None:
        self.config = config or ArrowConfig()
        self.fixed_names = None if adapter_names is None else list(adapter_names)
        if self.fixed_names is not None and len(set(self.fixed_names)) != len(self.fixed_names):
            raise RoutingError(f"arrow router: duplicate adapter names {self.fixed_names}")
        self._mm: RoutedModel | None = None
        self._protos: dict[str, tuple[Any, dict[str, torch.Tensor]]] = {}  # name -> (its LoRAAdapter, module -> v)
        self._stacks: dict[
            tuple, tuple[torch.Tensor, torch.Tensor, bool]
        ] = {}  # (module, key, device) -> (P, has, all)
        self._block_linear: list[str] = []  # per_block: the projection decided from, per block
        self._block_norm: list[nn.Module] = []
        self._linear_block: dict[str, int] = {}  # module path -> its block (for traces)
        self._trace_linear: set[str] = set()  # per_linear: the linear whose decision a trace records
        # rms_threshold: module -> E[x̂ x̂ᵀ] [d_in, d_in] over general text run on the base model (x̂ = x / |x|),
        # from which any adapter's RMS |cos| follows without another forward (`calibrate`)
        self._moments: dict[str, torch.Tensor] = {}
        self._rms: dict[tuple, torch.Tensor] = {}  # (module, device, id of its prototype stack) -> [K]
        self._calib_tokens = 0
        self.mix_experts: dict[str, Mix] = {}  # named mixes it chooses between beside its adapters (set_mix_experts)

    # ------------------------------------------------------------------------------------ prompt mode
    @property
    def probe_prompt(self) -> bool:
        """prompt: the caller runs a probe pass and fills the prompt's decisions (molora.routing.learned: Probe)."""
        return self.config.prompt

    @property
    def carry_blocks(self) -> int:
        """prompt: every block of a generated token takes its predecessor's decision (the prompt's, in the end)."""
        return len(self._block_linear) if self.config.prompt else 0

    @property
    def carry_source(self) -> int:
        n = len(self._block_linear)
        b = self.config.source_block
        b = (5 * n) // 6 if b is None else (b + n if b < 0 else b)
        if not 0 <= b < n:
            raise RoutingError(f"arrow source_block={self.config.source_block} outside the model's {n} blocks")
        return b

    def carry_source_module(self) -> str:
        """The projection whose input the prompt vote reads: `carry_source`'s deciding linear (bound, per_block)."""
        return self._block_linear[self.carry_source]

    def prompt_routes(self, probe: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        """The prompt tokens' decisions [B, L] from the probe's [B, L] (molora.routing.base.fill_prompt_routes);
        the last token of each prompt takes the prompt's own adapter, so its answer (which carries that last
        decision) runs on the adapter most of the prompt chose, not on whatever its final template token scored."""
        c = self.config
        return fill_prompt_routes(probe, mask, c.prompt_share, last_takes_top=True, window=c.prompt_window)

    base_only = staticmethod(base_only)

    # ------------------------------------------------------------------------------------ settings
    @property
    def top_k(self) -> int:
        return self.config.top_k

    @property
    def granularity(self) -> str:
        return self.config.granularity

    @property
    def per_linear(self) -> bool:
        return self.config.granularity == "per_linear"

    @property
    def adapter_names(self) -> list[str]:
        """Its experts in router index order: its adapters, then its mix experts (`set_mix_experts`)."""
        own = self.fixed_names if self.fixed_names is not None else [] if self._mm is None else self._mm.adapter_names
        return [n for n in own if n not in self.mix_experts] + list(self.mix_experts)

    # ------------------------------------------------------------------------------------ mix experts
    def set_mix_experts(self, mixes: Mapping[str, Mix]) -> None:
        """Choose between these named mixes too (molora.json "router_experts"), each an expert of its own beside the
        adapters. A mix's prototype at a linear is Arrow's for one adapter applied to the mix's combined delta: the top
        right singular vector of sum_i w_i scale_i B_i A_i (over its adapters that adapt the linear), computed from the
        adapters' weights like theirs (`refresh`). An empty mapping restores plain routing. A mix whose adapters are not
        all loaded now is refused (RoutingError(field="router_experts") naming it), nothing changed."""
        loaded = {} if self._mm is None else self._mm.adapters
        for name, mix in mixes.items():
            missing = sorted(a for a, _ in mix if self._mm is not None and a not in loaded)
            if missing:
                raise RoutingError(
                    f"mix {name!r} cannot be an expert of the arrow router: its adapter(s) {missing} are not loaded "
                    "(its prototype comes from their weights)",
                    field="router_experts",
                )
        for name in [n for n in self.mix_experts if n not in mixes or mixes[n] != self.mix_experts[n]]:
            self._protos.pop(name, None)
        self.mix_experts = dict(mixes)
        self._stacks.clear()
        self._rms.clear()
        if self._mm is not None:
            self.refresh()

    def experts(self) -> list[Mix]:
        """Per router index: the adapter alone, or a mix expert's ((adapter, weight), ...)."""
        return [self.mix_experts.get(n, ((n, 1.0),)) for n in self.adapter_names]

    def _mix_prototypes(self, mix: Mix) -> tuple[tuple, dict[str, torch.Tensor]] | None:
        """(what they were computed from, module -> v) of a mix expert, or None while an adapter is not resident."""
        assert self._mm is not None
        loaded = self._mm.adapters
        if any(a not in loaded for a, _ in mix):
            return None
        key = tuple((loaded[a], w) for a, w in mix)
        vecs = {}
        for m in sorted({m for a, _ in mix for m in loaded[a].modules}):
            parts = [(loaded[a].modules[m], w) for a, w in mix if m in loaded[a].modules]
            A = torch.cat([p.A.float() for p, _ in parts])  # [sum r, d_in]
            B = torch.cat([w * p.scale * p.B.float() for p, w in parts], 1)  # [d_out, sum r]
            # B_cat @ A_cat = sum_i w_i s_i B_i A_i: the mix's delta, as the dispatch adds it
            c = self.config
            vecs[m] = top_right_singular_vector(A, B, method=c.method, iters=c.iters, seed=c.seed)
        return key, vecs

    # ------------------------------------------------------------------------------------ binding
    def bind(self, mm: RoutedModel, calibration: Sequence[Sequence[int]] | None = None) -> ArrowRouter:
        """Find mm's decoder blocks and routed linears and compute the prototypes of its adapters (once each);
        with rms_threshold, calibrate on `calibration` (token ids; default general text, `calibrate`)."""
        from molora.routing.learned import decoder_layers  # the one place that knows where blocks live

        if self._mm is mm:
            self.refresh()
            if calibration is not None:
                self.calibrate(calibration)
            return self
        layers = decoder_layers(mm.model)
        targets = set(mm.bank.slots)
        names = {id(m): n for n, m in mm.model.named_modules()}
        self._linear_block = {}
        self._block_linear, self._block_norm = [], []
        self._trace_linear = set()
        proj = self.config.projection
        for i, layer in enumerate(layers):
            lp = names[id(layer)]
            mine = sorted(t for t in targets if t.startswith(lp + "."))
            self._linear_block.update({t: i for t in mine})
            attn = [f"{lp}.self_attn.{p}" for p in BLOCK_PROJECTIONS if f"{lp}.self_attn.{p}" in targets]
            if mine:  # the trace records the block's first adapted attention projection, else its first linear
                self._trace_linear.add(attn[0] if attn else mine[0])
            if self.per_linear:
                continue
            pick = f"{lp}.self_attn.{proj}" if proj else (attn[0] if attn else None)
            if pick is None or pick not in targets:
                raise RoutingError(
                    f"arrow granularity='per_block' decides block {i} from "
                    f"{proj or 'q_proj, k_proj or v_proj'}, which no loaded adapter adapts there "
                    f"(adapted: {[t.rsplit('.', 1)[-1] for t in mine]}); use granularity='per_linear'"
                    " or name an adapted projection"
                )
            self._block_linear.append(pick)
            self._block_norm.append(layer.get_submodule("input_layernorm"))
        self._mm = mm
        self.refresh()
        if calibration is not None or (self.config.rms_threshold is not None and not self._moments):
            self.calibrate(calibration)
        return self

    def adopt_prototypes(self, other: ArrowRouter, skip: Sequence[str] = ()) -> list[str]:
        """Take `other`'s prototypes of the adapters this router chooses between (but `skip`), so that a router
        rebuilt for a changed set of adapters computes only the new ones' (`refresh` still recomputes an adapter
        loaded again: a new `LoRAAdapter` object). Returns the names taken; call before `bind`."""
        taken = [n for n in self.adapter_names if n in other._protos and n not in skip]
        self._protos.update({n: other._protos[n] for n in taken})
        self._stacks.clear()
        self._rms.clear()
        return taken

    def refresh(self) -> list[str]:
        """Compute prototypes for adapters loaded (or loaded again) since the last call; return their names."""
        if self._mm is None:
            raise RoutingError("the arrow router is not bound to a model: call router.bind(mm) (molora.load does)")
        loaded = self._mm.adapters
        done = []
        for name, mix in self.mix_experts.items():
            old = self._protos.get(name)
            if (
                old is not None
                and len(old[0]) == len(mix)
                and all(o[0] is loaded.get(a) and o[1] == w for o, (a, w) in zip(old[0], mix))
            ):
                continue  # computed from these very adapters and weights
            fresh = self._mix_prototypes(mix)
            if fresh is not None:
                self._protos[name] = fresh
                done.append(name)
        for name in self.adapter_names:
            if name in self.mix_experts:
                continue
            adapter = loaded.get(name)
            if adapter is None or (name in self._protos and self._protos[name][0] is adapter):
                continue  # not resident (an engine's evicted adapter keeps its prototypes) or up to date
            c = self.config
            self._protos[name] = (
                adapter,
                {
                    m: top_right_singular_vector(w.A, w.B, method=c.method, iters=c.iters, seed=c.seed)
                    for m, w in adapter.modules.items()
                },
            )
            done.append(name)
        if done:
            self._stacks.clear()
            self._rms.clear()
            log.info("arrow: prototypes of %s computed (%s)", done, self.config.method)
        return done

    def prepare(self, mm: RoutedModel, input_ids: torch.Tensor) -> None:
        """Make mm route by this router for its next forward (transformers path; molora.model.attach)."""
        from molora.routing.learned import install_gates

        self.bind(mm)
        if self.mix_experts:
            raise RoutingError(
                f"mix experts {sorted(self.mix_experts)} run on the engine (molora.Engine, molora serve); "
                "the transformers path routes between adapters only"
            )
        missing = [n for n in self.adapter_names if n not in mm.bank]
        if missing:
            raise RoutingError(
                f"the arrow router chooses between adapters {missing} that are not loaded (loaded: {mm.adapter_names})"
            )
        slot_map = torch.tensor(
            [mm.bank.slot_of(n) for n in self.adapter_names], dtype=torch.long, device=input_ids.device
        )
        ctx = mm.context
        if self.per_linear:
            ctx.linear = LinearRouting(self, slot_map)
        else:
            install_gates(mm)
            ctx.router = self
            ctx.slot_map = slot_map

    def route(self, input_ids: torch.Tensor, adapter_names: Sequence[str], *, start: int = 0) -> Routing:
        raise RoutingError("ArrowRouter decides inside the network; pass it as adapter_ids to a MoLoRAModel")

    # ------------------------------------------------------------------------------------ deciding
    def prototypes(self, module: str, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, bool]:
        """(P [K, d_in] fp32, has [K] bool, has.all()): the prototypes of `module` in router order; an adapter
        without the module (or without prototypes yet) has a zero row and has=False."""
        names = self.adapter_names
        key = (module, tuple(id(self._protos[n][0]) if n in self._protos else None for n in names), device)
        if key not in self._stacks:
            vecs = [self._protos[n][1].get(module) if n in self._protos else None for n in names]
            d_in = next((v.shape[0] for v in vecs if v is not None), None)
            if d_in is None:
                raise RoutingError(f"arrow: no adapter of {names} adapts {module}")
            P = torch.stack([torch.zeros(d_in) if v is None else v.float().cpu() for v in vecs]).to(device)
            has = torch.tensor([v is not None for v in vecs], device=device)
            self._stacks[key] = (P, has, all(v is not None for v in vecs))
        return self._stacks[key]

    def choose(
        self, x: torch.Tensor, module: str, allowed: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(ids [T, k] router indices, -1 none; weights [T, k] or None for top-1) for inputs x [T, d_in] of
        `module`: |x·v| similarity, top-k, softmax(top / temperature) (module docstring)."""
        P, has, every = self.prototypes(module, x.device)
        sim = (x.float() @ P.T).abs()  # [T, K]
        masked = allowed is not None or not every
        if masked:  # adapters absent here or not allowed
            ok = has if allowed is None else has & allowed.to(x.device)
            sim = sim.masked_fill(~ok, float("-inf"))
        c = self.config
        if c.rms_threshold is not None:  # calibrated against general text
            ratio = self.general_ratio(module, x, sim)  # [T, K]; -inf kept
            best, ids = ratio.max(dim=-1, keepdim=True)  # [T, 1]
            return torch.where(best < c.rms_threshold, -1, ids), None
        top, ids = sim.topk(min(c.top_k, sim.shape[1]), dim=-1)  # [T, k]
        off = torch.isinf(top) if masked else None  # not an adapter for this token
        if c.threshold is not None:
            cos = top[:, :1] / x.float().norm(dim=-1, keepdim=True).clamp_min(1e-12)  # [T, 1] best |cos|
            off = cos < c.threshold if off is None else off | (cos < c.threshold)
        if off is not None:
            ids = torch.where(off, -1, ids)
        if c.top_k == 1:
            return ids, None
        w = torch.softmax((top if off is None else top.masked_fill(off, float("-inf"))) / c.temperature, dim=-1)
        return ids, torch.nan_to_num(w, nan=0.0)  # a row all off: weights 0

    # ------------------------------------------------------------------------------------ calibration
    def general_rms(self, module: str, device: torch.device) -> torch.Tensor:
        """[K]: each adapter's RMS |cos(x, v)| at `module` over the calibration text, sqrt(vᵀ E[x̂ x̂ᵀ] v)."""
        if module not in self._moments:
            raise RoutingError(
                "arrow rms_threshold needs a calibration: bind the router to its model "
                "(router.bind(mm), as molora.load does) or call router.calibrate(rows)"
            )
        P, has, _ = self.prototypes(module, device)
        key = (module, device, id(P))  # P is rebuilt (a new object) when an adapter changes
        if key not in self._rms:
            M = self._moments[module].to(device)
            rms = torch.einsum("kd,de,ke->k", P, M, P).clamp_min(1e-12).sqrt()
            self._rms[key] = rms.masked_fill(~has, float("inf"))  # an adapter absent here never wins
        return self._rms[key]

    def general_ratio(self, module: str, x: torch.Tensor, sim: torch.Tensor | None = None) -> torch.Tensor:
        """[T, K]: |cos(x, v)| of inputs x [T, d_in] of `module` over each adapter's general-text RMS (`general_rms`);
        sim [T, K]: |x·v| if already computed (masked entries -inf stay -inf)."""
        if sim is None:
            P, _, _ = self.prototypes(module, x.device)
            sim = (x.float() @ P.T).abs()
        cos = sim / x.float().norm(dim=-1, keepdim=True).clamp_min(1e-12)
        return cos / self.general_rms(module, x.device)

    @torch.no_grad()
    def calibrate(self, rows: Sequence[Sequence[int]] | None = None) -> dict[str, Any]:
        """Measure what an ordinary token looks like at the deciding projection of every block that decides (with
        `prompt`, only `carry_source`): E[x̂ x̂ᵀ] over the tokens
        of general text run on the base model (x̂ the unit-norm input). No labels and no adapter data: the text is
        general prompts of the train split (molora.data.general: Self-Instruct and templated everyday requests)
        in the model's own chat template, template tokens included (the commonest tokens a served prompt has).
        An adapter loaded later is scored against the same moments (`general_rms`), no forward needed.
        rows: token ids to use instead. Called by `bind` when rms_threshold is set; outside any forward."""
        mm = self._mm
        if mm is None or not self._block_linear:
            raise RoutingError("arrow calibration needs the router bound to a per_block model: router.bind(mm)")
        rows = (
            [list(map(int, r)) for r in rows]
            if rows is not None
            else calibration_rows(mm, self.config.calibration_prompts)
        )
        blocks = [self.carry_source] if self.config.prompt else range(len(self._block_linear))  # those that decide
        acc: dict[int, torch.Tensor] = {}
        count = 0
        for r in rows:
            ids = torch.tensor([r], device=mm.device)
            out = mm(
                ids, adapter_ids=torch.full_like(ids, -1), output_hidden_states=True, use_cache=False, logits_to_keep=1
            )
            for b in blocks:
                x = self._block_norm[b](out.hidden_states[b][0]).float()  # [T, D]
                x = x / x.norm(dim=-1, keepdim=True).clamp_min(1e-12)
                acc[b] = acc.get(b, 0) + x.T @ x  # [D, D]
            count += len(r)
        self._moments = {self._block_linear[b]: (acc[b] / count).cpu() for b in blocks}
        self._rms.clear()
        self._calib_tokens = count
        log.info("arrow: calibrated on %d tokens of general text (%d prompts)", count, len(rows))
        return {"tokens": count, "prompts": len(rows)}

    def calibration_state(self) -> dict[str, Any]:
        """What `calibrate` measured ({"moments": {module: E[x̂ x̂ᵀ] [d_in, d_in]}, "tokens": count}), for a cache."""
        return {"moments": dict(self._moments), "tokens": self._calib_tokens}

    def set_calibration(self, state: Mapping[str, Any]) -> ArrowRouter:
        """Take a `calibration_state` measured before on the same base model and text (before `bind`, which then
        skips `calibrate`); RoutingError for a state of another shape."""
        moments = state.get("moments")
        if not isinstance(moments, Mapping) or not all(
            isinstance(m, torch.Tensor) and m.dim() == 2 and m.shape[0] == m.shape[1] for m in moments.values()
        ):
            raise RoutingError("arrow calibration state: 'moments' must map module paths to square matrices")
        self._moments = {str(k): v.float().cpu() for k, v in moments.items()}
        self._calib_tokens = int(state.get("tokens", 0))
        self._rms.clear()
        return self

    def traced_block(self, module: str) -> int | None:
        """per_linear: the block whose decision a routing trace records from linear `module` (its block's first
        adapted attention projection, else its first adapted linear), None for the other linears."""
        return self._linear_block[module] if module in self._trace_linear else None

    def gate_index(self, block: int) -> int | None:
        return None if self.per_linear else block

    def decide(
        self, block: int, hidden: torch.Tensor, allowed: torch.Tensor | None = None, carry: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None] | None:
        """per_block: block's decision from its input hidden [T, D] (the chosen projection's input is
        input_layernorm(hidden)); per_linear: None (the linears decide, `decide_linear`).

        prompt: a token with a carried decision (carry [T] >= -1: a generated token) takes it at every block;
        the others (a probe's prompt tokens) run on the base model except at `carry_source`, where Arrow decides
        from the base model's hidden state, the state the calibration measured."""
        if self.per_linear:
            return None
        if not self._block_linear:
            raise RoutingError("the arrow router is not bound to a model: call router.bind(mm) (molora.load does)")
        self.refresh()
        with torch.no_grad():
            if not self.config.prompt:
                return self.choose(self._block_norm[block](hidden), self._block_linear[block], allowed)
            carried = None if carry is None else carry.to(hidden.device).long()[:, None]  # [T, 1]
            if carried is not None and host_readable(carried) and bool((carried >= -1).all()):
                return carried, None
            if block == self.carry_source:
                ids, _ = self.choose(self._block_norm[block](hidden), self._block_linear[block], allowed)
            else:
                ids = torch.full((hidden.shape[0], 1), -1, dtype=torch.long, device=hidden.device)
            return (ids if carried is None else torch.where(carried >= -1, carried, ids)), None

    def decide_linear(
        self, module: str, x: torch.Tensor, allowed: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """per_linear: the decision of linear `module` from its own input x [T, d_in]."""
        with torch.no_grad():
            return self.choose(x, module, allowed)
