"""What the data-free choosers' experiments share: the cached per-prompt features of arrow_variants_choose.

`features_cache(path)` reads the cache (`runs/arrow_variants_features.pt`, written by
`python -m experiments.arrow_variants_choose`) into one object, and `scored(labels)` lists the prompts a choice is
scored on (all but the calibration prompts). datafree_choose, datafree_confidence and datafree_hybrid read it so.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

DEFAULT_CACHE = "runs/arrow_variants_features.pt"


@dataclass(frozen=True)
class Features:
    """The cache's prompts: label (group:index), task, own adapter, and the adapters' names in the cache's order."""

    labels: list[str]
    tasks: list[str]
    own: list[Any]
    names: list[str]
    raw: dict  # everything the cache holds (num_blocks, the per-block statistics)


def features_cache(path: str = DEFAULT_CACHE) -> Features:
    f = torch.load(path)
    return Features(list(f["labels"]), list(f["tasks"]), list(f["own"]), list(f["names"]), f)


def scored(labels: list[str]) -> list[int]:
    """Indices of the prompts a choice is scored on: every one but the calibration prompts."""
    return [i for i, lab in enumerate(labels) if not lab.startswith("calib")]
