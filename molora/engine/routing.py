"""Per-step routing of a mixed batch: each request's tokens go where its routing mode says.

    "none"     every token on the base model (slot -1)
    "pinned"   every token on the request's one adapter (the per-sequence mode of today's servers), weighted by
               its `scale` when one is given (a mix of one adapter)
    "mix"      every token on the weighted sum of a static mix's adapters (molora.routing.mix): slot ids [n, K]
               and the request's weights [n, K], the top-k dispatch with weights the request gives; a step with a
               mix row widens every row to a power-of-two k (padding slot -1, weight 0), so decode graphs see a
               few k's, not one per mix size (molora.model.graphs: k is part of a graph's key)
    "tokens"   a token-id router (VocabRouter, ...) routes each input token; its choice of an adapter the
               request does not allow becomes the base model
    "learned"  the in-network router decides per block from hidden states (`StepRouting.groups`); all the
               step's learned rows share one `decide` call per block, each row with its allowed set's mask. A
               router with `carry_blocks` also gets, for each generated token, the decision its predecessor got
               at the router's `carry_source` block (`RouteState.route_finals`, kept by `record_carry` after each
               step, so a recomputed sequence routes exactly as before). A router with `probe_prompt` first runs each
               prompt on its gates (probe chunks; `record_probe` keeps every prompt token's decision in
               `RouteState.prompt_routes`), then every block of each prompt token takes that decision (`fixed`);
               a prompt the probe keeps wholly on the base model turns the request to "none" (Base expert).
               An Arrow router (molora.routing.arrow) runs in this mode too: per_block through `decide`, per_linear
               through the runner's `LinearRouting` over the same row groups

Each request's routing lives in one `RouteState` (`Request.route`), owned by this module: `plan_routing` reads
it and `record_carry` / `record_probe` update it from what a step decided; the scheduler only reads its
`needs` (adapters to pin) and `probing` (a chunk of the probe pass).

`plan_routing` turns the scheduled chunks of one step into a `StepRouting` for the runner: slot ids [T, k]
(-1 = base) and weights [T, k] or None, plus the learned router's row groups and its adapter -> slot map.
Routers answer in indices into the engine's registered adapter names; this module maps them to bank slots.

Knows requests' routing modes, adapter names and slots; nothing about KV blocks, sampling or text.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from molora.engine.hotset import HotSet
from molora.engine.scheduler import Scheduled
from molora.model.batch import RouterGroup, StepRouting
from molora.ops.device import to_device
from molora.routing import SequenceRouter, VocabRouter
from molora.routing.base import Router, to_slots
from molora.routing.mix import Mix, plain_experts, router_experts

MODES = ("none", "pinned", "mix", "tokens", "learned", "choosing")  # choosing: waits for the chooser, never scheduled


@dataclass(eq=False)
class RouteState:
    """How one request routes, in one place (`Request.route`): its mode, router, pinned adapter, allowed
    adapters, the adapters it pins while in flight, and the decisions it carries between steps. This module
    reads it to plan a step and updates it from what the step decided (`record_carry`, `record_probe`); the
    scheduler sees only `needs` and `probing`."""

    mode: str  # one of MODES
    prompt_len: int
    router: Any = None  # the router of modes "tokens" and "learned"
    adapter: str | None = None  # the pinned adapter (mode "pinned")
    allowed: frozenset[str] | None = None  # names the router may choose (None: all)
    needs: tuple[str, ...] = ()  # adapters pinned while in flight
    mix: Mix | None = None  # mode "mix": ((adapter, weight), ...) (molora.routing.mix)
    scale: float | None = None  # mode "pinned": the adapter's weight (None: 1, no weights at all)
    # mode "learned" with a carrying router: the decision at its carry_source block of the tokens at positions
    # prompt_len - 1, prompt_len, ...: what each next generated token carries (molora.routing.learned)
    route_finals: list[int] = field(default_factory=list)
    # mode "learned" with a probing router (molora.routing.learned: Probe): each prompt token's decision at the
    # carry_source block in the probe pass, filled chunk by chunk while `probing`; afterwards every block of
    # that prompt token takes it (also when the sequence is recomputed after a preemption). None: no probe
    prompt_routes: list[int] | None = None
    # the probe pass's own decisions (before `prompt_routes` filled them), kept once the probe is complete:
    # the prefix cache stores them beside the probe's KV blocks
    probe_raw: list[int] | None = None

    @property
    def probing(self) -> bool:
        """The probe pass over the prompt is unfinished (its chunks sample nothing)."""
        return self.prompt_routes is not None and len(self.prompt_routes) < self.prompt_len


def slot_lookup(hotset: HotSet, allowed: frozenset[str] | None = None) -> Tensor:
    """[K]: registered adapter index -> bank slot (-1 when not resident or not allowed); see `to_slots`."""
    bank = hotset.mm.bank
    return torch.tensor(
        [bank.slot_of(n) if n in bank and (allowed is None or n in allowed) else -1 for n in hotset.names],
        dtype=torch.long,
    )


def fixed_routes(router: Router) -> list[str]:
    """The adapters a token-id router names by a fixed rule, in its order: a VocabRouter's ranges and default, a
    SequenceRouter's one adapter (empty for any other router)."""
    if isinstance(router, VocabRouter):
        return [n for n in dict.fromkeys([r[2] for r in router.ranges] + [router.default]) if n is not None]
    if isinstance(router, SequenceRouter) and isinstance(router.adapters, str):
        return [router.adapters]
    return []


def routed_names(router: Router, hotset: HotSet) -> list[str]:
    """The names a token-id router's indices refer to: the registered adapters, then those its fixed rule names that
    are no longer registered (unloaded at run time), whose tokens run on the base model."""
    return [*hotset.names, *(n for n in fixed_routes(router) if n not in hotset.paths)]


def _token_routing(s: Scheduled, hotset: HotSet) -> tuple[Tensor, Tensor | None]:
    """Slot ids [n, k] (and weights [n, k] or None) from the request's token-id router."""
    req = s.request
    ids = torch.tensor([s.ids], dtype=torch.long)  # [1, n] (draft ids too: routed by their ids, as when decoded)
    names = routed_names(req.route.router, hotset)
    routing = req.route.router.route(ids, names, start=s.start)
    idx = routing.adapter_ids.reshape(s.n, -1).long()  # [n, k] indices
    lookup = slot_lookup(hotset, req.route.allowed)  # [K]: registered names first, the gone ones after run on base
    if len(names) > len(lookup):
        lookup = torch.cat([lookup, torch.full((len(names) - len(lookup),), -1, dtype=torch.long)])
    slots = to_slots(lookup, idx)  # [n, k] slots
    w = None if routing.weights is None else routing.weights.reshape(s.n, -1).float()
    return slots, w


def plan_routing(scheduled: list[Scheduled], hotset: HotSet, device: torch.device) -> StepRouting | None:
    """The routing of one step (module docstring); None when every token runs on the base model."""
    pieces: list[tuple[Tensor, Tensor | None]] = []
    groups: dict[frozenset[str] | None, list[Tensor]] = {}
    router = None
    offset = 0
    mixed = False
    bank = hotset.mm.bank
    for s in scheduled:
        route = s.request.route
        if route.mode == "pinned":
            w = None if route.scale is None else torch.full((s.n, 1), route.scale, dtype=torch.float32)
            pieces.append((torch.full((s.n, 1), bank.slot_of(route.adapter), dtype=torch.long), w))
        elif route.mode == "mix":
            assert route.mix is not None, "a mix request without its mix"
            mix_slots = torch.tensor([bank.slot_of(n) for n, _ in route.mix], dtype=torch.long)  # [K]
            mix_weights = torch.tensor([w for _, w in route.mix], dtype=torch.float32)  # [K]
            pieces.append((mix_slots.expand(s.n, -1), mix_weights.expand(s.n, -1)))
            mixed = True
        elif route.mode == "tokens":
            pieces.append(_token_routing(s, hotset))
        else:
            pieces.append((torch.full((s.n, 1), -1, dtype=torch.long), None))
            if route.mode == "learned":
                assert router is None or router is route.router, "one in-network router per engine"
                router = route.router
                groups.setdefault(route.allowed, []).append(torch.arange(offset, offset + s.n))
        offset += s.n
    T = offset
    k = max(p[0].shape[1] for p in pieces)
    if mixed:  # a power of two, so that a new mix size rarely means a new graph key (module docstring)
        k = 1 << (k - 1).bit_length()
    slot_ids = torch.cat([_widen(ids, k, -1) for ids, _ in pieces])  # [T, k]
    weights = None
    if any(w is not None for _, w in pieces) or k > 1:
        weights = torch.cat([_widen(w if w is not None else _first_choice(ids), k, 0.0) for ids, w in pieces])
    if router is None:
        if bool((slot_ids < 0).all()):
            return None
        return StepRouting(to_device(slot_ids, device), None if weights is None else to_device(weights, device))
    carry = _token_rows(scheduled, T, device, _carried) if getattr(router, "carry_blocks", 0) > 0 else None
    fixed = _token_rows(scheduled, T, device, _probed) if getattr(router, "probe_prompt", False) else None
    slot_of = {n: i for i, n in enumerate(bank.table) if n is not None}  # one pass over the slots, not one per name
    experts = router_experts(router)
    table, table_w = expert_table(experts, slot_of)
    names = [e[0][0] if len(e) == 1 else "" for e in experts]  # a mix expert has no one name: masked below
    slots = [slot_of.get(n, -1) for n in names]
    if table_w is not None:  # an expert is usable where every adapter of it is resident
        slots = [0 if all(a in slot_of for a, _ in e) else -1 for e in experts]
    return StepRouting(
        to_device(slot_ids, device),
        None if weights is None else to_device(weights, device),
        router=router,
        router_slots=to_device(table, device),
        router_weights=None if table_w is None else to_device(table_w, device),
        groups=_router_groups(groups, names, slots, T, device, experts if table_w is not None else None),
        carry=carry,
        fixed=fixed,
    )


def expert_table(experts: list[Mix], slot_of: dict[str, int]) -> tuple[Tensor, Tensor | None]:
    """The dispatch rows of a router's experts (molora.routing.mix.router_experts): index_to_slot [K] and None when
    every expert is one adapter with weight 1 (plain routing), else slots [K, m] and weights [K, m] with m the widest
    expert rounded up to a power of two, as a static mix's row is widened (a mix expert adds no new k to a step's
    shapes that a static mix of its size would not add). A non-resident adapter has slot -1 (weight 0): such an
    expert is masked out of the router's choice (`_router_groups`)."""
    if plain_experts(experts):
        return torch.tensor([slot_of.get(e[0][0], -1) for e in experts], dtype=torch.long), None
    widest = max(len(e) for e in experts)
    m = 1 << (widest - 1).bit_length()
    slots = torch.full((len(experts), m), -1, dtype=torch.long)
    weights = torch.zeros(len(experts), m, dtype=torch.float32)
    for i, e in enumerate(experts):
        for j, (a, w) in enumerate(e):
            if a in slot_of:
                slots[i, j], weights[i, j] = slot_of[a], w
    return slots, weights


def _router_groups(
    groups: dict[frozenset[str] | None, list[Tensor]],
    names: list[str],
    slots: list[int],
    T: int,
    device: torch.device,
    experts: list[Mix] | None = None,
) -> list[RouterGroup]:
    """The router's row groups: one `RouterGroup` of its rows and its allowed mask [K] (None: every resident adapter)
    where the step's learned requests share one allowed set, else one group of all of them with each row's mask,
    allowed [n, K], so that the router decides once per block rather than once per allowed set (with Zipf traffic
    over 1,000 adapters a decode step's 8 learned requests had 8 sets: 240 small decisions a step instead of 30)."""
    resident = [s >= 0 for s in slots]
    if experts is not None:  # mix experts: an expert is allowed where every adapter of it is
        return _expert_groups(groups, experts, resident, T, device)
    if len(groups) == 1:
        ((allowed, rows),) = groups.items()
        # host list, no read: a router over N adapters costs N set lookups per allowed set, not N scans of the slots
        mask = resident if allowed is None else [s >= 0 and n in allowed for n, s in zip(names, slots)]
        r = torch.cat(rows)
        return [
            RouterGroup(
                None if r.shape[0] == T else to_device(r, device),
                None if all(mask) else to_device(mask, device, torch.bool),
            )
        ]
    index = {n: i for i, n in enumerate(names)}
    masks = torch.zeros(len(groups), len(names), dtype=torch.bool)  # [G, K]: each set's resident adapters
    for g, allowed in enumerate(groups):
        if allowed is None:
            masks[g] = torch.tensor(resident)
        else:
            masks[g, [index[n] for n in allowed if n in index and slots[index[n]] >= 0]] = True
    counts = torch.tensor([sum(r.shape[0] for r in rows) for rows in groups.values()])
    r = torch.cat([t for rows in groups.values() for t in rows])
    return [
        RouterGroup(
            None if r.shape[0] == T and bool((r == torch.arange(T)).all()) else to_device(r, device),
            to_device(masks.repeat_interleave(counts, 0), device),  # [n, K], row i's mask
        )
    ]


def _expert_groups(
    groups: dict[frozenset[str] | None, list[Tensor]],
    experts: list[Mix],
    resident: list[bool],
    T: int,
    device: torch.device,
) -> list[RouterGroup]:
    """`_router_groups` of a router with mix experts: one group of every learned row, each row's mask [n, K] true
    where the expert is resident and all its adapters are in the row's allowed set."""
    masks = torch.tensor(
        [
            [r and (allowed is None or all(a in allowed for a, _ in e)) for e, r in zip(experts, resident)]
            for allowed in groups
        ],
        dtype=torch.bool,
    )  # [G, K]
    counts = torch.tensor([sum(r.shape[0] for r in rows) for rows in groups.values()])
    r = torch.cat([t for rows in groups.values() for t in rows])
    return [
        RouterGroup(
            None if r.shape[0] == T and bool((r == torch.arange(T)).all()) else to_device(r, device),
            to_device(masks.repeat_interleave(counts, 0), device),
        )
    ]


def _token_rows(scheduled: list[Scheduled], T: int, device: torch.device, known) -> Tensor:
    """[T] decisions (router index, -1 none) at the rows of the learned requests' tokens that `known(s)` covers,
    -2 at every other row. known(s) -> (token index of the first covered token, its decisions and the next ones)."""
    rows = torch.full((T,), -2, dtype=torch.long)
    offset = 0
    for s in scheduled:
        if s.request.route.mode == "learned":
            lo, values = known(s)
            if values:
                rows[offset + lo - s.start : offset + lo - s.start + len(values)] = torch.tensor(values)
        offset += s.n
    return to_device(rows, device)


def _carried(s: Scheduled) -> tuple[int, list[int]]:
    """The chunk's generated tokens whose predecessor's decision is known (`RouteState.route_finals`); a draft
    row (speculative decoding) assumes the decision its chunk's first token carries (`assumed_carry`)."""
    route, P = s.request.route, len(s.request.prompt_ids)
    lo, hi = max(s.start, P), min(s.start + s.n, P + len(route.route_finals))
    values = route.route_finals[lo - P : hi - P] if lo < hi else []
    if s.drafted and values:
        values = values + [values[-1]] * (s.start + s.n - hi)
    return lo, values


def assumed_carry(s: Scheduled) -> list[int] | None:
    """The decisions a drafted chunk's rows were given to carry [n] (row 0's is known, each draft row assumes the
    same), or None when its request routes without carry. What plain decoding would carry into draft row j is the
    decision row j - 1 gets at the carry_source block in the same forward; `molora.engine.speculative.carry_valid`
    keeps the rows up to the first whose assumption was wrong (those after are decoded again)."""
    route = s.request.route
    if route.mode != "learned" or getattr(route.router, "carry_blocks", 0) <= 0:
        return None
    lo, values = _carried(s)
    if lo != s.start or len(values) != s.n:
        return None
    return values


def record_carry_rows(s: Scheduled, values: list[int]) -> None:
    """Keep the carry_source decisions of a drafted chunk's first len(values) rows (the rows it keeps) as what their
    successors carry (`RouteState.route_finals`), as `record_carry` does for one row."""
    route = s.request.route
    if route.mode != "learned":
        return
    for r, v in enumerate(values):
        i = s.start + r + 1 - route.prompt_len
        if i < 0 or v < -1:
            continue
        if i < len(route.route_finals):
            route.route_finals[i] = v
        elif i == len(route.route_finals):
            route.route_finals.append(v)


def _probed(s: Scheduled) -> tuple[int, list[int]]:
    """The chunk's prompt tokens, with their probe decisions, once the probe is done (`RouteState.prompt_routes`)."""
    route = s.request.route
    if s.probe or route.prompt_routes is None:
        return s.start, []
    return s.start, route.prompt_routes[s.start : min(s.start + s.n, route.prompt_len)]


def record_probe(scheduled: list[Scheduled], carry_rows: Tensor | None) -> list[bool]:
    """Keep the decisions (carry_rows [T] at the router's carry_source block) of each probe chunk's prompt
    tokens in `RouteState.prompt_routes`; when a request's probe is complete, turn them into the prompt's
    decisions (and a prompt the router keeps on the base model into mode "none"). Returns, per scheduled
    chunk, whether its request's probe just ended: the engine then computes that prompt again from position 0
    with these decisions. Changes routing state only; the KV bookkeeping is the engine's."""
    ended = []
    offset = 0
    for s in scheduled:
        done = False
        if s.probe:
            route = s.request.route
            assert route.prompt_routes is not None and carry_rows is not None, "a probe chunk without decisions"
            route.prompt_routes[s.start : s.start + s.n] = carry_rows[offset : offset + s.n].tolist()
            if not route.probing:  # the probe is complete: the real pass takes the prompt's decisions
                finish_probe(route)
                done = True
        ended.append(done)
        offset += s.n
    return ended


def finish_probe(route: RouteState) -> None:
    """The probe's decisions of every prompt token are known (`route.prompt_routes`, raw): keep them in
    `probe_raw`, turn them into the prompt's decisions, and a prompt the router keeps on the base model into
    mode "none" (molora.routing.learned: Base expert)."""
    assert route.prompt_routes is not None and len(route.prompt_routes) == route.prompt_len
    route.probe_raw = list(route.prompt_routes)
    routes = route.router.prompt_routes(torch.tensor([route.prompt_routes]))
    route.prompt_routes = routes[0].tolist()
    if bool(route.router.base_only(routes)[0]):
        route.mode = "none"


def token_routes(req: Any, hotset: HotSet, lo: int, hi: int, probe: bool) -> list | None:
    """What the KV of each of `req`'s tokens [lo, hi) depends on besides the tokens before it, as hashable
    descriptors for the prefix cache (molora.engine.prefix); None when that cannot be proven (a miss).

        v >= 1                       every block on the adapter whose content version is v (pinned, a top-1
                                     token-id router, a probed prompt token's fixed decision); -1: the base
        ((v, w), ...)                a weighted top-k choice, the same at every block (a token-id router's top-k,
                                     a static mix, a pinned adapter with a scale)
        ("gate", salt)               the in-network router's own gates at every block (learned or Arrow, no
                                     fixed decision; also the probe pass): a function of the tokens before it
                                     and the router, with the adapters it may choose and their versions (salt)
        ("carry", v, salt)           a generated token under a carrying router: blocks below carry_blocks on v
                                     (the predecessor's decision), the gates above

    probe: the descriptors of the probe pass (every prompt token on its gates) rather than the real pass.
    Versions are read now: call it while `req` pins its adapters (they cannot change under a pin)."""
    route, n = req.route, hi - lo
    if route.mode == "none":
        return [-1] * n
    if route.mode == "pinned":
        v = _version(hotset, route, route.adapter)
        if v is None:
            return None
        return [v] * n if route.scale is None else [((v, route.scale),)] * n
    if route.mode == "mix":
        assert route.mix is not None
        versions = [_version(hotset, route, name) for name, _ in route.mix]
        if any(v is None for v in versions):
            return None
        return [tuple((v, w) for v, (_, w) in zip(versions, route.mix))] * n
    if route.mode == "tokens":
        return _token_descriptors(req, hotset, lo, hi)
    # the gates' choices run on the router's experts: each one's adapters, versions and weights (a mix expert's)
    experts = router_experts(route.router)
    salt = (
        "gate",
        id(route.router),
        tuple(tuple((a, w, hotset.content_version(a) if a in route.needs else None) for a, w in e) for e in experts),
    )
    gate: tuple = ("gate", salt)
    P = route.prompt_len
    out: list[object] = []
    for i in range(lo, hi):
        if i < P and (probe or route.prompt_routes is None):
            out.append(gate)
        elif i < P:
            out.append(_index_version(hotset, route, route.prompt_routes[i]))
        elif getattr(route.router, "carry_blocks", 0) > 0:
            if i - P >= len(route.route_finals):
                return None
            out.append(("carry", _index_version(hotset, route, route.route_finals[i - P]), salt))
        else:
            out.append(gate)
    return None if any(d is None or (isinstance(d, tuple) and d[0] == "carry" and d[1] is None) for d in out) else out


def _version(hotset: HotSet, route: RouteState, name: str | None) -> int | None:
    """The content version a token routed to `name` runs on: the adapter's if the request pins it, -1 (the base)
    for no adapter or one not registered (no slot holds it), None (unprovable) otherwise."""
    if name is None or name not in hotset.paths:
        return -1
    return hotset.content_version(name) if name in route.needs else None


def _index_version(hotset: HotSet, route: RouteState, idx: int) -> int | tuple | None:
    """`_version` of a router index's expert: its adapter's, or for a mix expert ((v, w), ...) as a static mix's."""
    if idx < 0:
        return -1
    if not getattr(route.router, "mix_experts", None):
        return _version(hotset, route, route.router.adapter_names[idx])
    expert = router_experts(route.router)[idx]
    if len(expert) == 1 and expert[0][1] == 1.0:
        return _version(hotset, route, expert[0][0])
    versions = [_version(hotset, route, a) for a, _ in expert]
    if any(v is None for v in versions):
        return None
    return tuple((v, w) for v, (_, w) in zip(versions, expert))


def _token_descriptors(req: Any, hotset: HotSet, lo: int, hi: int) -> list | None:
    """`token_routes` of a token-id router: its choices as `_token_routing` makes them (an adapter it may not
    use becomes the base)."""
    route = req.route
    names = routed_names(route.router, hotset)
    ids = torch.tensor([req.tokens[lo:hi]], dtype=torch.long)  # [1, n]
    routing = route.router.route(ids, names, start=lo)
    idx = routing.adapter_ids.reshape(hi - lo, -1).long().tolist()  # [n][k] indices
    versions = {}
    for i in {i for row in idx for i in row}:
        name = names[i] if 0 <= i < len(names) else None
        versions[i] = (
            -1
            if name is not None and route.allowed is not None and name not in route.allowed
            else _version(hotset, route, name)
        )
    if any(v is None for v in versions.values()):
        return None
    if routing.weights is None and all(len(row) == 1 for row in idx):
        return [versions[row[0]] for row in idx]
    w = (
        routing.weights.reshape(hi - lo, -1).float().tolist()
        if routing.weights is not None
        else [[1.0] + [0.0] * (len(row) - 1) for row in idx]
    )
    return [tuple((versions[i], x) for i, x in zip(row, ws)) for row, ws in zip(idx, w)]


def record_carry(scheduled: list[Scheduled], last_carry: Tensor | None) -> None:
    """Keep each learned request's decision at the router's carry_source block for its last token of the step
    (last_carry [B] in scheduled order) when that token's successor is a generated one."""
    if last_carry is None:
        return
    values = last_carry.tolist()
    for s, v in zip(scheduled, values):
        route = s.request.route
        if s.probe:
            continue
        i = s.start + s.n - route.prompt_len  # index of the last token's successor among generated tokens
        if route.mode != "learned" or i < 0 or v < -1:
            continue
        if i < len(route.route_finals):
            route.route_finals[i] = v  # recomputed after a preemption: the same decision again
        elif i == len(route.route_finals):
            route.route_finals.append(v)


def _first_choice(ids: Tensor) -> Tensor:
    w = torch.zeros(ids.shape, dtype=torch.float32)
    w[:, 0] = 1.0
    return w


def _widen(t: Tensor, k: int, fill: float) -> Tensor:
    """[n, k'] -> [n, k], padding the extra choices with `fill` (slot -1 / weight 0)."""
    if t.shape[1] == k:
        return t
    return torch.cat([t, t.new_full((t.shape[0], k - t.shape[1]), fill)], 1)
