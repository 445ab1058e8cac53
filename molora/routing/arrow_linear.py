"""`LinearRouting`: Arrow's per-linear routing of one forward (granularity per_linear, PEFT's).

Owns the per-step glue between the routed linears and an `ArrowRouter`: which rows the router owns, the slot ids
and weights each linear gets, the trace of one linear per block. Knows nothing of prototypes or calibration
(molora.routing.arrow decides; this module asks it through `decide_linear`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F

from molora.errors import RoutingError
from molora.routing.base import expert_rows


class LinearRouting:
    """Per-linear in-network routing of one forward (Arrow per_linear), held by `RoutingContext.linear`.

    router: an `ArrowRouter`; slot_map [K]: router index -> bank slot (-1: not resident); groups: (rows [n] or
    None for all T, allowed bool [K] or None) of the rows the router owns, the other rows keep the step's fixed
    routing (an engine step mixes routing modes). `slots(module, x, fixed, fixed_w)` is what each routed linear
    calls: slot ids [T, k] and weights [T, k] or None for its input x [T, d_in].
    """

    def __init__(
        self,
        router: Any,  # an ArrowRouter
        slot_map: torch.Tensor,
        groups: Sequence[tuple[torch.Tensor | None, torch.Tensor | None]] = ((None, None),),
        slot_weights: torch.Tensor | None = None,
    ) -> None:
        self.router = router
        self.slot_map = slot_map  # [K], or [K, m] with slot_weights [K, m] for mix experts (expert_rows)
        self.slot_weights = slot_weights
        self.groups = list(groups)
        router.refresh()

    def slots(
        self,
        module: str,
        x: torch.Tensor,
        fixed: torch.Tensor | None,
        fixed_w: torch.Tensor | None,
        trace: list | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        m = 1 if self.slot_weights is None else self.slot_weights.shape[1]
        T, k = x.shape[0], self.router.top_k * m
        if len(self.groups) == 1 and self.groups[0][0] is None:  # every row is the router's
            ids, w = self.router.decide_linear(module, x, self.groups[0][1])
            out, weights = expert_rows(self.slot_map, self.slot_weights, ids, w)
        else:
            kk = max(k, 1 if fixed is None else fixed.shape[1])
            out = torch.full((T, kk), -1, dtype=torch.long, device=x.device)
            weights = None if kk == 1 and fixed_w is None else torch.zeros(T, kk, device=x.device)
            if fixed is not None:
                out[:, : fixed.shape[1]] = fixed
                if weights is not None:
                    if fixed_w is not None:
                        weights[:, : fixed_w.shape[1]] = fixed_w
                    else:
                        weights[:, 0] = 1.0
            for rows, allowed in self.groups:
                r = slice(None) if rows is None else rows
                ids, w = self.router.decide_linear(module, x[r], allowed)
                sl, w = expert_rows(self.slot_map, self.slot_weights, ids, w)
                out[r] = F.pad(sl, (0, kk - sl.shape[1]), value=-1)
                if weights is not None:
                    ww = torch.ones_like(sl, dtype=weights.dtype) if w is None else w.to(weights.dtype)
                    weights[r] = F.pad(ww, (0, kk - sl.shape[1]))
            ids = None
        block = None if trace is None else self.router.traced_block(module)
        if trace is not None and block is not None:
            if ids is None:
                raise RoutingError("a routing trace needs every row on the arrow router")
            trace.append((block, ids))
        return out, weights
