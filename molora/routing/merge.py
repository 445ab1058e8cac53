"""`UniformMergeRouter`: the "merge" baseline, every token on the uniform average of the adapters.

Merging K LoRAs by averaging their deltas is the usual way to get one model that has all the skills
without any routing. Through the top-k dispatch it is exact and needs no merged adapter: every token
takes all K adapters with weight 1/K,

    delta(x) = sum_k (1/K) * scale_k * B_k @ (A_k @ x)

which equals PEFT's `add_weighted_adapter(names, [1/K] * K, combination_type="cat")` (the "linear"
combination averages A and B separately, which is exact only up to cross terms). The router knows
adapter names, not slots or models.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from molora.errors import RoutingError
from molora.routing.base import Router, Routing, adapter_index


class UniformMergeRouter(Router):
    """Every token on all of `adapters` (default: every loaded adapter) with weight 1/K each."""

    def __init__(self, adapters: Sequence[str] | None = None) -> None:
        if adapters is not None and len(adapters) == 0:
            raise RoutingError("UniformMergeRouter needs at least one adapter to average")
        self.adapters = None if adapters is None else list(adapters)

    def route(self, input_ids: torch.Tensor, adapter_names: Sequence[str], *, start: int = 0) -> Routing:
        names = self.adapters if self.adapters is not None else list(adapter_names)
        if not names:
            raise RoutingError("UniformMergeRouter: no adapters are loaded, nothing to merge")
        K = len(names)
        idx = torch.tensor([adapter_index(adapter_names, n) for n in names], device=input_ids.device)  # [K]
        B, L = input_ids.shape
        ids = idx.view(1, 1, K).expand(B, L, K).clone()  # [B, L, K]
        weights = torch.full((B, L, K), 1.0 / K, device=input_ids.device)  # [B, L, K]
        return Routing(ids, weights)
