"""`HybridChooser`: one adapter (or the base model) per request with no training data, two signals each doing
what it does well on validation: prompt-level Arrow decides *whether* the prompt leaves the base model,
the confidence chooser decides *which* adapter it goes to.

    hybrid = HybridChooser(chooser, arrow_config)            # molora.routing.confidence / molora.routing.arrow
    hybrid.choose_per_request(mm, ["How many ...?"])         # ["counting"], or [None]: the base model answers

Per prompt (template applied), one base-model pass gives the deciding block's normed input; Arrow's calibrated
ratio (ArrowConfig.rms_threshold: |cos| over each adapter's general-text RMS, `ArrowRouter.general_ratio`)
claims a token for an adapter where the best ratio reaches the threshold, and the prompt is *claimed* when the
claimed tokens among its last `prompt_window` are at least `prompt_share` of them (and at least one) -- Arrow's
prompt vote, which keeps general prompts on the base model. Then each adapter reads the prompt and the request goes
to the adapter whose confidence (1 / entropy of the first answer token) has the largest z over the base model's own
pool (`ConfidenceChooser.zscores`, its z_min and margin unused), when

    (claimed or top z >= z_or) and top z >= z_floor

else to the base model. z_or None: Arrow alone decides; z_floor None: no floor. The cost is one base-model prompt
pass and one prompt pass per adapter before the answer, or one forward of the prompt repeated on the base model and
every adapter (`variants_pass`) where nothing else waits for the engine (`HybridChooser.decide_stages`).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Generator, Mapping, Sequence
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any, TypeVar

import torch

from molora.errors import BundleError, RoutingError
from molora.routing.arrow import ArrowConfig, ArrowRouter
from molora.routing.base import RoutedModel
from molora.routing.confidence import CONFIDENCE_FILE, ConfidenceChooser, prompt_rows

HYBRID_FILE = "hybrid.json"
T = TypeVar("T")


def arrow_claim_share(
    router: ArrowRouter, mm: RoutedModel, rows: Sequence[Sequence[int]], *, batch: int = 16
) -> torch.Tensor:
    """[N]: per prompt (token ids), the share of its last `prompt_window` tokens whose best calibrated Arrow ratio
    at the router's source block reaches rms_threshold (the prompt vote's claimed share), from base-model forwards
    of left-padded batches. The router must be bound to mm, per_block with rms_threshold."""
    share, _ = variants_pass(router, mm, rows, [-1], batch=batch)
    assert share is not None
    return share


def joint_pass(
    router: ArrowRouter, mm: RoutedModel, rows: Sequence[Sequence[int]], adapters: Sequence[int], *, batch: int = 16
) -> tuple[torch.Tensor, torch.Tensor]:
    """(`arrow_claim_share` [N], `first_token_entropy` [N, len(adapters)]) of the same prompts from one forward per
    group of prompts instead of one base pass and one pass per adapter (`adapters`: indices into mm.adapter_names):
    `variants_pass` over the base model and every adapter. The same numbers up to float rounding."""
    share, ent = variants_pass(router, mm, rows, [-1, *adapters], batch=batch)
    assert share is not None
    return share, ent


@torch.no_grad()
def variants_pass(
    router: ArrowRouter, mm: RoutedModel, rows: Sequence[Sequence[int]], variants: Sequence[int], *, batch: int = 16
) -> tuple[torch.Tensor | None, torch.Tensor]:
    """The chooser's signals from prompts (token ids, template applied) read by several variants of the model at
    once: `variants` holds -1 (the base model: Arrow's claimed share, `arrow_claim_share`) and adapter indices into
    mm.adapter_names (each one's first-answer-token entropy, `first_token_entropy`). Each prompt is repeated once
    per variant, left-padded together, at most `batch` rows a forward (at least one prompt). Returns (the share [N],
    None without -1; the entropies [N, adapters in `variants` order])."""
    c = router.config
    if c.rms_threshold is None or c.granularity != "per_block":
        raise RoutingError("the hybrid's Arrow needs granularity='per_block' and rms_threshold (its calibration)")
    if any(not len(r) for r in rows):
        raise RoutingError("an empty prompt has no tokens to vote")
    V = len(variants)
    if not V or len(set(variants)) != V:
        raise RoutingError(f"variants {list(variants)}: give each of the base (-1) and the adapters at most once")
    b, module = router.carry_source, router._block_linear[router.carry_source]
    base = variants.index(-1) if -1 in variants else None
    cols = [v for v, a in enumerate(variants) if a != -1]
    per = max(1, batch // V)  # prompts per forward
    shares, ents = [], []
    for i in range(0, len(rows), per):
        chunk = [list(r) for r in rows[i : i + per] for _ in range(V)]  # each prompt once per variant
        width = max(len(r) for r in chunk)
        ids = torch.tensor([[0] * (width - len(r)) + r for r in chunk], device=mm.device)
        mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in chunk], device=mm.device)
        which = torch.tensor(list(variants) * (len(chunk) // V), device=mm.device)  # [R]
        o = mm(
            ids,
            attention_mask=mask,
            adapter_ids=which[:, None].expand_as(ids).contiguous(),
            position_ids=(mask.cumsum(-1) - 1).clamp(min=0),
            output_hidden_states=base is not None,
            use_cache=False,
            logits_to_keep=1,
        )
        if cols:
            logp = o.logits[:, -1].float().log_softmax(-1)
            ents.append((-(logp.exp() * logp).sum(-1).cpu().view(-1, V))[:, cols])  # [prompts, adapters]
        if base is None:
            continue
        for j in range(base, len(chunk), V):
            x = router._block_norm[b](o.hidden_states[b][j, width - len(chunk[j]) :]).float()  # [T, D]
            x = x[-c.prompt_window :] if c.prompt_window is not None else x
            shares.append(float((router.general_ratio(module, x).max(-1).values >= c.rms_threshold).float().mean()))
    ent = torch.cat(ents) if ents else torch.zeros(len(rows) if not cols else 0, len(cols))
    return (torch.tensor(shares) if base is not None else None), ent


def drain(stages: Generator[None, None, T]) -> T:
    """Run a staged computation (a generator of None) to its end; its return value."""
    while True:
        try:
            next(stages)
        except StopIteration as done:
            return done.value


def hybrid_decide(
    share: torch.Tensor, z: torch.Tensor, prompt_share: float, z_or: float | None, z_floor: float | None
) -> list[int]:
    """Adapter index per prompt (-1: the base model) from Arrow's claimed shares [N] and confidence z [N, K]
    (module docstring)."""
    if share.shape[0] != z.shape[0]:
        raise RoutingError(f"{share.shape[0]} shares for {z.shape[0]} prompts")
    top, k = z.max(1)
    go = (share >= prompt_share) & (share > 0) & torch.isfinite(top)  # -inf: no adapter may be chosen
    if z_or is not None:
        go = go | (top >= z_or)
    if z_floor is not None:
        go = go & (top >= z_floor)
    return torch.where(go, k, -1).tolist()


@dataclass(frozen=True)
class HybridSettings:
    """What a served hybrid chooser is built from (a bundle's router object {"kind": "hybrid", ...}): Arrow's
    prompt-vote settings, the rule's z_or and z_floor, and the pool the confidence statistics are taken over (the
    base model writes `pool_n` user turns, molora.calibration.sample_pool with these sampling settings)."""

    arrow: ArrowConfig
    z_or: float | None = None
    z_floor: float | None = None
    pool_n: int = 800
    pool_seed: int = 0
    pool_batch: int = 128
    pool_max_new_tokens: int = 48
    pool_temperature: float = 1.0

    def __post_init__(self) -> None:
        for name in ("pool_n", "pool_batch", "pool_max_new_tokens"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < (2 if name == "pool_n" else 1):
                raise RoutingError(f"hybrid {name}={v!r}: a whole number >= {2 if name == 'pool_n' else 1}")
        if not isinstance(self.pool_seed, int) or not self.pool_temperature > 0:
            raise RoutingError(
                f"hybrid pool_seed={self.pool_seed!r} (an integer), pool_temperature={self.pool_temperature!r} (> 0)"
            )
        for name in ("z_or", "z_floor"):
            v = getattr(self, name)
            if v is not None and not isinstance(v, (int, float)):
                raise RoutingError(f"hybrid {name}={v!r}: a number or null")
        HybridChooser._check_arrow(self.arrow)

    @classmethod
    def from_json(cls, raw: Mapping[str, Any], where: str = "hybrid router") -> HybridSettings:
        """From a router object {"kind": "hybrid", "arrow": {...ArrowConfig}, "z_or", "z_floor", "pool_n", ...}."""
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(raw) - known - {"kind"})
        if unknown:
            raise RoutingError(f"{where}: unknown hybrid settings {unknown}; known: {sorted(known)}")
        if not isinstance(raw.get("arrow"), Mapping):
            raise RoutingError(f'{where}: "arrow" must be an object of Arrow settings (prompt, rms_threshold, ...)')
        arrow = ArrowConfig.from_json(raw["arrow"], where=f"{where} arrow")
        try:
            return cls(arrow, **{k: v for k, v in raw.items() if k in known and k != "arrow"})
        except RoutingError as e:
            raise RoutingError(f"{where}: {e}") from e


@dataclass(frozen=True)
class HybridChooser:
    """The confidence chooser (which adapter: its largest z), prompt-level Arrow's settings (whether), the rule."""

    chooser: ConfidenceChooser
    arrow: ArrowConfig
    z_or: float | None = None
    z_floor: float | None = None
    joint: bool = False  # decide_rows by `joint_pass` (one forward per group of prompts) instead of K + 1 passes

    def __post_init__(self) -> None:
        self._check_arrow(self.arrow)

    @staticmethod
    def _check_arrow(a: ArrowConfig) -> None:
        if not (a.prompt and a.granularity == "per_block" and a.rms_threshold is not None):
            raise RoutingError("the hybrid's Arrow settings need prompt=true, per_block and rms_threshold")

    @property
    def adapter_names(self) -> tuple[str, ...]:
        return self.chooser.adapter_names

    def bind(
        self,
        mm: RoutedModel,
        calibration: Sequence[Sequence[int]] | None = None,
        arrow_state: Mapping[str, Any] | None = None,
    ) -> HybridChooser:
        """Bind Arrow to mm (prototypes, and its calibration on `calibration`: token ids; default the router's
        general text, `ArrowRouter.calibrate`; or `arrow_state`, an `ArrowRouter.calibration_state` measured before
        on this base); choose_per_request binds on first use."""
        router = ArrowRouter(self.arrow, list(self.adapter_names))
        if arrow_state is not None and calibration is None:
            router.set_calibration(arrow_state)
        router.bind(mm, calibration)
        if router.carry_source_module() not in router.calibration_state()["moments"]:
            router.calibrate(calibration)  # a state of other blocks: measured again
        object.__setattr__(self, "_bound", (mm, router))
        return self  # frozen: the binding is a cache, not a setting

    def rebuilt(self, mm: RoutedModel, chooser: ConfidenceChooser, fresh: Sequence[str] = ()) -> HybridChooser:
        """A new chooser with this one's rule and Arrow settings over `chooser`'s adapters, bound to mm: Arrow's
        general-text calibration (adapter-free) and the prototypes of this chooser's adapters but `fresh` are
        taken over, a new adapter's prototypes computed from its weights (it must be resident in mm). This one
        is left as it is (a server swaps the new one in: adapters loaded or unloaded at run time)."""
        old = self._router(mm)
        router = ArrowRouter(self.arrow, list(chooser.adapter_names))
        router.set_calibration(old.calibration_state())
        router.adopt_prototypes(old, skip=fresh)
        router.bind(mm)
        missing = [n for n in chooser.adapter_names if n not in router._protos]
        if missing:
            raise RoutingError(f"the hybrid chooser's Arrow has no prototypes of {missing}: load them into slots first")
        new = HybridChooser(chooser, self.arrow, self.z_or, self.z_floor, self.joint)
        object.__setattr__(new, "_bound", (mm, router))
        return new

    def _router(self, mm: RoutedModel) -> ArrowRouter:
        cached = getattr(self, "_bound", None)
        if cached is None or cached[0] is not mm:
            self.bind(mm)
        return self._bound[1]  # type: ignore[attr-defined]

    def choose_per_request(
        self, mm: RoutedModel, questions: Sequence[str], *, batch_size: int = 16, template: str | None = None
    ) -> list[str | None]:
        """One adapter name (None: base) per question, with `template` ("{prompt}" in it; default mm's bundle's)
        applied."""
        rows = prompt_rows(mm, self.adapter_names, questions, template, "the hybrid chooser")
        return [c["adapter"] for c in self.decide_rows(mm, rows, list(range(len(self.adapter_names))), batch_size)]

    def decide_rows(
        self, mm: RoutedModel, rows: Sequence[Sequence[int]], mm_index: Sequence[int | None], batch_size: int = 16
    ) -> list[dict[str, Any]]:
        """Per prompt (token ids, template applied) {"adapter": name or None (the base model), "share": Arrow's
        claimed share, "z": {adapter: its confidence z}}, choosing among the adapters whose `mm_index` (their index
        in mm.adapter_names, per adapter of this chooser) is not None; the others are neither run nor chosen."""
        return drain(self.decide_stages(mm, rows, mm_index, batch_size))

    def decide_stages(
        self,
        mm: RoutedModel,
        rows: Sequence[Sequence[int]],
        mm_index: Sequence[int | None],
        batch_size: int = 16,
        busy: Callable[[], bool] | None = None,
    ) -> Generator[None, None, list[dict[str, Any]]]:
        """`decide_rows` in stages: a generator that runs one forward pass per step of it and returns the decisions.
        Its passes are the base model's, then one per adapter; each stage asks `busy` (a server: are other requests
        running or waiting?) and, when it says no, runs all the passes still to come as one (`variants_pass`: 0.71x
        their time on the default bundle, docs/hybrid_serve_cost.json), or else the next one alone, so that a choice
        pauses other requests for one pass at a time, not all of them (docs/hybrid_stall.json), and costs a request
        that has the engine to itself the least. busy None: the chooser's `joint` setting decides once."""
        if len(mm_index) != len(self.adapter_names):
            raise RoutingError(f"{len(mm_index)} model indices for the chooser's {len(self.adapter_names)} adapters")
        which = [k for k, i in enumerate(mm_index) if i is not None]
        z = torch.full((len(rows), len(self.adapter_names)), float("-inf"), dtype=torch.float64)
        if busy is None:
            busy = (lambda: False) if self.joint else (lambda: True)
        router = self._router(mm)
        index = [int(i) for i in mm_index if i is not None]  # the adapters' own, `which` order
        pending: list[int] = [-1, *index]
        share: torch.Tensor | None = None
        got: dict[int, torch.Tensor] = {}
        while pending:
            if len(pending) <= len(index):  # not the first stage
                yield None
            take = pending[:1] if busy() else pending
            s, e = variants_pass(router, mm, rows, take, batch=batch_size)
            share = s if s is not None else share
            got.update(zip([a for a in take if a != -1], e.unbind(1)))
            pending = pending[len(take) :]
        assert share is not None
        ent = torch.stack([got[i] for i in index], 1) if index else torch.zeros(len(rows), 0)
        if which:
            z[:, which] = self.chooser.zscores(ent, which)
        picks = hybrid_decide(share, z, self.arrow.prompt_share, self.z_or, self.z_floor)
        return [
            {
                "adapter": None if p < 0 else self.adapter_names[p],
                "share": round(float(s), 4),
                "z": {self.adapter_names[k]: round(float(z[j, k]), 3) for k in which},
            }
            for j, (p, s) in enumerate(zip(picks, share.tolist()))
        ]

    def choose_served(
        self, mm: RoutedModel, questions: Sequence[str], allowed: Sequence[str] | None = None, batch_size: int = 16
    ) -> list[dict[str, Any]]:
        """`decide_rows` for question texts in mm's bundle template, over whichever of this chooser's adapters mm
        holds now (an engine's hot set orders and evicts them) and `allowed` names (None: all)."""
        return drain(self.served_stages(mm, questions, allowed, batch_size))

    def served_stages(
        self,
        mm: RoutedModel,
        questions: Sequence[str],
        allowed: Sequence[str] | None = None,
        batch_size: int = 16,
        busy: Callable[[], bool] | None = None,
    ) -> Generator[None, None, list[dict[str, Any]]]:
        """`choose_served` in stages (`decide_stages`, with `busy`)."""
        rows = prompt_rows(mm, None, questions, None, "the hybrid chooser")
        held = mm.adapter_names
        index = [held.index(n) if n in held and (allowed is None or n in allowed) else None for n in self.adapter_names]
        return (yield from self.decide_stages(mm, rows, index, batch_size, busy))

    def save(self, folder: str | Path) -> Path:
        folder = Path(folder)
        self.chooser.save(folder)
        rule = {"arrow": asdict(self.arrow), "z_or": self.z_or, "z_floor": self.z_floor}
        (folder / HYBRID_FILE).write_text(json.dumps(rule, indent=1) + "\n")
        return folder

    @classmethod
    def load(cls, folder: str | Path) -> HybridChooser:
        chooser = ConfidenceChooser.load(folder)
        try:
            d = json.loads((Path(folder) / HYBRID_FILE).read_text())
            return cls(chooser, ArrowConfig(**d["arrow"]), d.get("z_or"), d.get("z_floor"))
        except (OSError, KeyError, TypeError, ValueError) as e:
            raise BundleError(
                f"cannot read the hybrid chooser in {folder} ({HYBRID_FILE}, {CONFIDENCE_FILE}): {e}"
            ) from e
