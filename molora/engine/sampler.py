"""The sampler of one engine step: the next token id of every sampled row, and its logprobs.

`sample_step(reqs, logits, finite, eos_ids)` picks one id per row of logits [b, V] (row j belongs to
reqs[j]); `adjust_rows` applies the logit knobs of the rows whose requests set any (logit_bias, bad words,
penalties) to a copy, before anything else, as vLLM does; `constrain_rows` applies the requests' constraints
(the bundle's spans, a request's grammar: one packed bitmask per constrained row, molora.sampling) and finds the
rows at a dead end; `step_logprobs` reports the rows' logprobs as their requests asked for them. `logits` itself
is never changed, so logprobs report the model's distribution (vLLM's default, raw logprobs).

Knows requests' sampling parameters, constraint states and generators; nothing about models, KV or routing.
"""

from __future__ import annotations

from collections.abc import Set

import torch

from molora.engine.request import Request
from molora.sampling import (
    adjust_logits_rows,
    apply_bitmask,
    bitmask_words,
    constraint_bitmask,
    filter_logits_rows,
    greedy,
    is_allowed,
    masked_greedy,
    top_logprobs,
)


def sample_step(
    reqs: list[Request],
    logits: torch.Tensor,
    finite: list[bool],
    eos_ids: Set[int],
    bitmask: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[int, str]]:
    """(token ids [b], {row: why} of rows at a dead end) from logits [b, V].

    Batched over the step's rows: the logit knobs of the rows that set any in one batched op (`adjust_rows`; a
    step where no row does takes no copy), one argmax for every row, constraints in one call (`constrain_rows`),
    the stop ids of every request short of its min_tokens masked in one indexed write, one argmax over those rows,
    and the filtering (temperature, min-p, top-k, top-p) and softmax of every sampled row in one batched op each
    (molora.sampling.filter_logits_rows); only the draw is per row, from the request's own generator, so a
    seeded request samples the same ids in any batch. A constrained row with nothing allowed (also once its stop
    ids are masked) is a dead end: it samples nothing and its request ends (Engine._run). finite[j]: row j's
    logits are finite (a row that is not draws nothing: its request ends). bitmask: the constrained rows' packed
    masks if filled ahead (Engine._fill_masks, while the forward ran), else filled here."""
    if any(req.params.adjusts_logits for req in reqs):
        logits = adjust_rows(reqs, logits)  # [b, V], a float32 copy
    chosen = greedy(logits)  # [b] greedy for all
    masked, dead = constrain_rows(reqs, logits, chosen, bitmask)
    short = [j for j, req in enumerate(reqs) if j not in dead and req.num_generated < req.params.min_tokens]
    drawn = [j for j, req in enumerate(reqs) if j not in dead and not req.params.greedy and finite[j]]
    rows = sorted(set(short) | set(drawn))  # rows that pick from a copy
    if not rows:
        return chosen, dead
    at = {j: k for k, j in enumerate(rows)}
    work = torch.cat([masked.get(j, logits[j : j + 1]) for j in rows])  # [w, V], a copy
    if short:
        V = logits.shape[-1]
        stops = [
            (at[j], t) for j in short for t in sorted(eos_ids | set(reqs[j].params.stop_token_ids)) if 0 <= t < V
        ]  # vLLM masks eos also under ignore_eos
        if stops:
            r, c = zip(*stops)
            work[list(r), list(c)] = float("-inf")
        alive = torch.isfinite(work[[at[j] for j in short]]).any(-1).tolist()  # [s]
        for j, ok in zip(short, alive):
            if j in masked and not ok:  # the grammar allows only stops
                dead[j] = dead_end_why(reqs[j])
        live = [j for j in short if j not in dead]
        if live:
            chosen[live] = greedy(work[[at[j] for j in live]])
        drawn = [j for j in drawn if j not in dead]
    if drawn:
        ps = [reqs[j].params for j in drawn]
        probs = filter_logits_rows(
            work[[at[j] for j in drawn]],
            [p.temperature for p in ps],
            [p.top_k for p in ps],
            [p.top_p for p in ps],
            [p.min_p for p in ps],
        ).softmax(-1)  # [d, V]
        for k, j in enumerate(drawn):  # each from its request's generator
            chosen[j] = torch.multinomial(probs[k : k + 1], 1, generator=reqs[j].generator)[0, 0]
    return chosen, dead


def adjust_rows(reqs: list[Request], logits: torch.Tensor) -> torch.Tensor:
    """A float32 copy of logits [b, V] in which each row carries its request's logit knobs (logit_bias, bad words,
    repetition/frequency/presence penalties: molora.sampling.adjust_logits_rows, batched over the rows); rows
    without knobs are copied as they are. The counts are read from each request's ids (prompt_ids, then what it
    generated), so a request restarted or preempted has no state of its own to rebuild."""
    ps = [req.params for req in reqs]
    outputs = [req.tokens[len(req.prompt_ids) :] if p.adjusts_logits else () for req, p in zip(reqs, ps)]
    return adjust_logits_rows(
        logits,
        [p.logit_bias for p in ps],
        [p.bad_words_ids for p in ps],
        outputs,
        [req.prompt_ids for req in reqs],
        [p.presence_penalty for p in ps],
        [p.frequency_penalty for p in ps],
        [p.repetition_penalty for p in ps],
    )  # [b, V] float32


def constrain_rows(
    reqs: list[Request], logits: torch.Tensor, chosen: torch.Tensor, bitmask: torch.Tensor | None = None
) -> tuple[dict[int, torch.Tensor], dict[int, str]]:
    """({row: masked copy [1, V]}, {row: why} of rows at a dead end) for the constrained rows of logits [b, V];
    `chosen` [b] (the greedy picks) is updated in place to the masked rows' greedy picks.

    One packed bitmask per constrained row (molora.sampling.constraint_bitmask), applied in one batched op to the
    rows that need it: every sampled row (and a row short of its min_tokens); a greedy row only when its
    unconstrained pick is not allowed (otherwise the argmax of the masked row is the same id, so the mask costs a
    bit test), and then through `masked_greedy` (its next pick, or the best of its allowed ids), no full mask."""
    V = logits.shape[-1]
    masked: dict[int, torch.Tensor] = {}  # row -> masked copy [1, V]
    dead: dict[int, str] = {}
    cons = [j for j, req in enumerate(reqs) if req.constraints]
    if not cons:
        return masked, dead
    if bitmask is None or bitmask.shape[-1] != bitmask_words(V):  # not filled ahead (Engine._fill_masks)
        bitmask = constraint_bitmask([reqs[j].constraints for j in cons], [reqs[j].tokens for j in cons], V)
    bitmask = bitmask.to(logits.device)  # [c, W] int32
    ok = is_allowed(bitmask, chosen[cons]).tolist()  # [c]
    empty = (bitmask == 0).all(-1).tolist()  # [c]
    plain = [reqs[j].params.greedy and reqs[j].num_generated >= reqs[j].params.min_tokens for j in cons]
    fast = [k for k in range(len(cons)) if not empty[k] and plain[k] and not ok[k]]  # greedy, pick refused
    if fast:
        chosen[[cons[k] for k in fast]] = masked_greedy(logits[[cons[k] for k in fast]], bitmask[fast])
    redo = [k for k in range(len(cons)) if not empty[k] and not plain[k]]  # sampled, or short of min_tokens
    if redo:
        idx = [cons[k] for k in redo]
        sub = apply_bitmask(logits[idx], bitmask[redo])  # [r, V], one batched op
        chosen[idx] = greedy(sub)
        masked = {j: sub[k : k + 1] for k, j in enumerate(idx)}
    for k, j in enumerate(cons):
        if empty[k]:
            dead[j] = dead_end_why(reqs[j])
    return masked, dead


def dead_end_why(req: Request) -> str:
    """RequestOutput.error of a request whose constraint allows no next token."""
    return (
        f"constraint dead end: after {req.num_generated} generated tokens the request's constraint allows no "
        "next token (its grammar is complete, or only an end token fits where ignore_eos or min_tokens "
        "forbids ending)"
    )


def step_logprobs(reqs: list[Request], logits: torch.Tensor, chosen: torch.Tensor) -> list[list[dict] | None]:
    """RequestOutput.logprobs of each row's sampled token: chosen[j] from raw logits [b, V] with the top
    reqs[j].params.logprobs alternatives (None for a request that asked for none). One log-softmax and top-n over
    the rows that ask for the same n (usually all of them)."""
    out: list[list[dict] | None] = [None] * len(reqs)
    by_n: dict[int, list[int]] = {}
    for j, req in enumerate(reqs):
        if req.params.logprobs > 0:
            by_n.setdefault(req.params.logprobs, []).append(j)
    for n, js in by_n.items():
        lp, vals, ids = top_logprobs(logits[js], chosen[js], n)  # [m], [m, n], [m, n]
        picked, lps, tops, top_ids = chosen[js].tolist(), lp.tolist(), vals.tolist(), ids.tolist()
        for k, j in enumerate(js):
            out[j] = [{"token_id": picked[k], "logprob": lps[k], "top": list(zip(top_ids[k], tops[k]))}]
    return out


def score_tokens(logits: torch.Tensor, targets: torch.Tensor, n: int) -> list[dict]:
    """The prompt-logprob entry (RequestOutput.prompt_logprobs) of each row of logits [t, V] for the token that
    follows it, targets [t]: its logprob, its rank (1 = the most likely; ties share the better rank, as vLLM's)
    and the top n alternatives. Raw logits, as `step_logprobs`."""
    logp = torch.log_softmax(logits.float(), dim=-1)  # [t, V]
    lp = logp.gather(-1, targets[:, None])  # [t, 1]
    rank = (logp > lp).sum(-1) + 1  # [t]
    vals, ids = torch.topk(logp, n, dim=-1)  # [t, n]
    lp = lp[:, 0]
    rows = zip(targets.tolist(), lp.tolist(), rank.tolist(), ids.tolist(), vals.tolist())
    return [{"token_id": t, "logprob": v, "rank": r, "top": list(zip(i, tv))} for t, v, r, i, tv in rows]
