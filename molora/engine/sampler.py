"""The sampler of one engine step: the next token id of every sampled row, and its logprobs.

`sample_step(reqs, logits, finite, best, eos_ids)` picks one id per row of logits [b, V] (row j belongs to
reqs[j]); `constrain_rows` applies the requests' constraints (the bundle's spans, a request's grammar: one packed
bitmask per constrained row, molora.sampling) and finds the rows at a dead end; `row_logprobs` reports a row's
logprobs as a request asked for them. `logits` itself is never changed, so logprobs report the model's
distribution (vLLM's default, raw logprobs).

Knows requests' sampling parameters, constraint states and generators; nothing about models, KV or routing.
"""

from __future__ import annotations

from collections.abc import Set

import torch

from molora.config import SamplingParams
from molora.engine.request import Request
from molora.sampling import apply_bitmask, constraint_bitmask, greedy, is_allowed, sample_next, top_logprobs


def sample_step(reqs: list[Request], logits: torch.Tensor, finite: list[bool], best: torch.Tensor | None,
                eos_ids: Set[int]) -> tuple[torch.Tensor, dict[int, str]]:
    """(token ids [b], {row: why} of rows at a dead end) from logits [b, V] (best: their greedy picks, if known).

    Constraints are applied by `constrain_rows` to the rows that need it. A request short of its min_tokens picks
    from a copy of its row with its stop ids at -inf (`without_stops`). A constrained row with nothing allowed is
    a dead end: it samples nothing and its request ends (Engine._run). finite[j]: row j's logits are finite (a
    row that is not samples nothing: its request ends)."""
    chosen = greedy(logits) if best is None else best                          # [b] greedy for all
    masked, dead = constrain_rows(reqs, logits, chosen)
    for j, req in enumerate(reqs):
        if j in dead:
            continue
        p = req.params
        row = masked.get(j, logits[j:j + 1])                                  # [1, V]
        if req.num_generated < p.min_tokens:
            row = without_stops(row, p, eos_ids)
            if j in masked and not bool(torch.isfinite(row).any()):         # the grammar allows only stops
                dead[j] = dead_end_why(req)
                continue
            chosen[j] = greedy(row)[0]
        if not p.greedy and finite[j]:
            chosen[j] = sample_next(row, p.temperature, p.top_k, p.top_p, req.generator)[0]
    return chosen, dead


def constrain_rows(reqs: list[Request], logits: torch.Tensor, chosen: torch.Tensor
                   ) -> tuple[dict[int, torch.Tensor], dict[int, str]]:
    """({row: masked copy [1, V]}, {row: why} of rows at a dead end) for the constrained rows of logits [b, V];
    `chosen` [b] (the greedy picks) is updated in place to the masked rows' greedy picks.

    One packed bitmask per constrained row (molora.sampling.constraint_bitmask), applied in one batched op to the
    rows that need it: every sampled row, and a greedy row only when its unconstrained pick is not allowed (the
    argmax of the masked row is then the same id, so the mask costs a bit test)."""
    V = logits.shape[-1]
    masked: dict[int, torch.Tensor] = {}                                       # row -> masked copy [1, V]
    dead: dict[int, str] = {}
    cons = [j for j, req in enumerate(reqs) if req.constraints]
    if not cons:
        return masked, dead
    bitmask = constraint_bitmask([reqs[j].constraints for j in cons], [reqs[j].tokens for j in cons], V)
    bitmask = bitmask.to(logits.device)                                      # [c, W] int32
    ok = is_allowed(bitmask, chosen[cons]).tolist()                          # [c]
    empty = (bitmask == 0).all(-1).tolist()                                   # [c]
    keep = [ok[k] and reqs[j].params.greedy and reqs[j].num_generated >= reqs[j].params.min_tokens
            for k, j in enumerate(cons)]                                      # the unconstrained pick stands
    redo = [k for k in range(len(cons)) if not empty[k] and not keep[k]]
    if redo:
        idx = [cons[k] for k in redo]
        sub = apply_bitmask(logits[idx], bitmask[redo])                      # [r, V], one batched op
        chosen[idx] = greedy(sub)
        masked = {j: sub[k:k + 1] for k, j in enumerate(idx)}
    for k, j in enumerate(cons):
        if empty[k]:
            dead[j] = dead_end_why(reqs[j])
    return masked, dead


def dead_end_why(req: Request) -> str:
    """RequestOutput.error of a request whose constraint allows no next token."""
    return (f"constraint dead end: after {req.num_generated} generated tokens the request's constraint allows no "
            "next token (its grammar is complete, or only an end token fits where ignore_eos or min_tokens "
            "forbids ending)")


def without_stops(row: torch.Tensor, p: SamplingParams, eos_ids: Set[int]) -> torch.Tensor:
    """A copy of one row of logits [1, V] where the eos ids and p.stop_token_ids cannot be sampled (vLLM
    masks eos for min_tokens also under ignore_eos); ids outside the vocabulary are left out."""
    ids = sorted(t for t in eos_ids | set(p.stop_token_ids) if 0 <= t < row.shape[-1])
    row = row.clone()
    row[0, ids] = float("-inf")
    return row


def row_logprobs(req: Request, logits: torch.Tensor, chosen: torch.Tensor) -> list[dict] | None:
    """RequestOutput.logprobs of one sampled token: `chosen` (a 0-d id) from its row of raw logits [V], with the
    top req.params.logprobs alternatives; None when the request asked for none."""
    n = req.params.logprobs
    if n <= 0:
        return None
    lp, vals, ids = top_logprobs(logits[None], chosen.reshape(1), n)
    top = [(int(i), float(v)) for i, v in zip(ids[0], vals[0])]
    return [{"token_id": int(chosen), "logprob": float(lp[0]), "top": top}]
