"""`ConfidenceChooser`: one adapter per request, the adapter that is unusually sure of how to start the answer,
calibrated on text the base model writes itself; no labelled data (the data-free path).

    chooser = ConfidenceChooser.from_pool(names, pool_entropy, z_min=2.0, margin=0.5)   # pool_entropy [N, K]
    chooser.choose_per_request(mm, ["How many ...?"])      # ["counting"], or [None]: the base model answers

Each adapter k reads the prompt (template applied) alone, and its confidence is 1 / the entropy of its
next-token distribution at the last prompt token (the first answer token). An adapter trained on a skill answers
that skill's prompts with a sure first token and is unsure elsewhere, but adapters differ in how sure they are
anywhere, so the log confidence is z-scored per adapter by its mean and spread over a pool of user turns the base
model wrote (molora.train.datafree.sample_pool). The request goes to the adapter with the largest z when it
reaches `z_min` and leads the runner-up by `margin`, else to the base model. The cost is one prompt pass per
adapter before the answer (no base-model pass); the answer then runs on the chosen adapter alone, as
`molora.eval.runner`'s "sequence" mode does with any router that has `choose_per_request`.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from molora.errors import BundleError, RoutingError
from molora.routing.base import RoutedModel

CONFIDENCE_FILE = "confidence.json"


@torch.no_grad()
def first_token_entropy(
    mm: RoutedModel, rows: Sequence[Sequence[int]], *, batch: int = 16, adapters: Sequence[int] | None = None
) -> torch.Tensor:
    """[N, K]: the entropy (nats) of each adapter's next-token distribution after each prompt (token ids, template
    applied), adapters in mm.adapter_names order (or the indices `adapters`, -1: the base model); rows are
    left-padded in batches."""
    which = list(range(len(mm.adapter_names))) if adapters is None else list(adapters)
    K = len(which)
    out = []
    for i in range(0, len(rows), batch):
        chunk = [list(r) for r in rows[i : i + batch]]
        width = max(len(r) for r in chunk)
        ids = torch.tensor([[0] * (width - len(r)) + r for r in chunk], device=mm.device)
        mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in chunk], device=mm.device)
        pos = (mask.cumsum(-1) - 1).clamp(min=0)
        ent = torch.zeros(len(chunk), K)
        for k, a in enumerate(which):
            o = mm(
                ids,
                attention_mask=mask,
                adapter_ids=torch.full_like(ids, a),
                position_ids=pos,
                use_cache=False,
                logits_to_keep=1,
            )
            logp = o.logits[:, -1].float().log_softmax(-1)
            ent[:, k] = -(logp.exp() * logp).sum(-1).cpu()
        out.append(ent)
    return torch.cat(out) if out else torch.zeros(0, K)


def prompt_rows(
    mm: RoutedModel,
    adapter_names: Sequence[str] | None,
    questions: Sequence[str],
    template: str | None,
    who: str,
) -> list[list[int]]:
    """The token ids of each question in `template` ("{prompt}" in it; default mm's bundle's), for a per-request
    chooser (`who`, in errors) calibrated for `adapter_names`, which must be mm's adapters in the same order (None:
    the caller maps names to mm's adapters itself, as a served chooser over an engine's hot set does)."""
    if adapter_names is not None and list(mm.adapter_names) != list(adapter_names):
        raise RoutingError(f"chooser calibrated for {list(adapter_names)}, model has {mm.adapter_names}")
    template = template or getattr(getattr(mm, "bundle", None), "prompt_template", None)
    if not template or "{prompt}" not in template:
        raise RoutingError(f"{who} needs a prompt template with {{prompt}}, got {template!r}")
    return [mm.tokenizer(template.replace("{prompt}", q), add_special_tokens=False)["input_ids"] for q in questions]


@dataclass(frozen=True)
class ConfidenceChooser:
    """Per adapter the mean and spread of log(1 / entropy) over the base model's own pool, and the rule."""

    adapter_names: tuple[str, ...]
    mean: tuple[float, ...]
    std: tuple[float, ...]
    z_min: float
    margin: float

    def __post_init__(self) -> None:
        K = len(self.adapter_names)
        if K < 1 or len(self.mean) != K or len(self.std) != K:
            raise RoutingError(f"confidence chooser: {K} adapters, {len(self.mean)} means, {len(self.std)} spreads")
        if not all(s > 0 for s in self.std) or not all(map(lambda v: abs(v) < float("inf"), self.mean)):
            raise RoutingError("confidence chooser: spreads must be > 0 and means finite")
        if self.margin < 0:
            raise RoutingError(f"confidence chooser margin={self.margin}: must be >= 0")

    @classmethod
    def from_pool(
        cls, names: Sequence[str], pool_entropy: torch.Tensor, *, z_min: float, margin: float
    ) -> ConfidenceChooser:
        """Calibrated on the entropies [N, K] of a pool of prompts the base model wrote (N >= 2)."""
        if pool_entropy.dim() != 2 or pool_entropy.shape[1] != len(names) or pool_entropy.shape[0] < 2:
            raise RoutingError(f"pool entropies {tuple(pool_entropy.shape)} for {len(names)} adapters (need N >= 2)")
        c = (1.0 / pool_entropy.double().clamp_min(1e-6)).log()
        return cls(tuple(names), tuple(c.mean(0).tolist()), tuple(c.std(0).clamp_min(1e-6).tolist()), z_min, margin)

    def zscores(self, entropy: torch.Tensor, adapters: Sequence[int] | None = None) -> torch.Tensor:
        """[N, K] z of log(1 / entropy) per adapter against the pool; with `adapters` (indices into adapter_names),
        entropy [N, len(adapters)] holds those adapters' columns alone."""
        idx = list(range(len(self.adapter_names))) if adapters is None else list(adapters)
        c = (1.0 / entropy.double().clamp_min(1e-6)).log()
        mean = torch.tensor([self.mean[k] for k in idx], dtype=torch.float64)
        return (c - mean) / torch.tensor([self.std[k] for k in idx], dtype=torch.float64)

    def decide(self, entropy: torch.Tensor) -> list[int]:
        """Adapter index per prompt from its entropies [N, K], -1: the base model (module docstring)."""
        z = self.zscores(entropy)
        if z.shape[1] == 1:
            return [0 if float(v) >= self.z_min else -1 for v in z[:, 0]]
        top = z.topk(2, dim=1)
        ok = (top.values[:, 0] >= self.z_min) & (top.values[:, 0] - top.values[:, 1] >= self.margin)
        return torch.where(ok, top.indices[:, 0], -1).tolist()

    def choose_per_request(
        self, mm: RoutedModel, questions: Sequence[str], *, batch_size: int = 16, template: str | None = None
    ) -> list[str | None]:
        """One adapter name (None: base) per question, with `template` ("{prompt}" in it; default mm's bundle's)
        applied."""
        rows = prompt_rows(mm, self.adapter_names, questions, template, "the confidence chooser")
        picks = self.decide(first_token_entropy(mm, rows, batch=batch_size))
        return [None if p < 0 else self.adapter_names[p] for p in picks]

    def save(self, folder: str | Path) -> Path:
        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        (folder / CONFIDENCE_FILE).write_text(json.dumps(asdict(self), indent=1) + "\n")
        return folder

    @classmethod
    def load(cls, folder: str | Path) -> ConfidenceChooser:
        try:
            d = json.loads((Path(folder) / CONFIDENCE_FILE).read_text())
            return cls(
                tuple(d["adapter_names"]), tuple(d["mean"]), tuple(d["std"]), float(d["z_min"]), float(d["margin"])
            )
        except (OSError, KeyError, TypeError, ValueError) as e:
            raise BundleError(f"cannot read the confidence chooser in {folder}: {e}") from e
