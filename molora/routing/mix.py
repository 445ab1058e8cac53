"""Static mixes of adapters: a request's weighted sum of adapter deltas, checked once, and a book of named mixes.

A mix `{"sql": 0.7, "chat": 0.3}` runs every token of a request on

    delta(x) = sum_i w_i * scale_i * B_i @ (A_i @ x)

which is the top-k dispatch (molora.ops.lora) with the request's weights instead of a router's: a mix is a row of
slot ids and weights, never a merged copy of weights. It equals PEFT's `add_weighted_adapter(names, weights,
combination_type="cat")` (the A's concatenated, the weighted B's concatenated: B_cat @ A_cat = sum_i w_i B_i A_i),
not its "linear" combination, which averages A and B separately (sqrt of each weight on both) and so adds the cross
terms sqrt(w_i w_j) B_i A_j of different adapters. Weights may be negative (task-vector subtraction) within a bound
the server sets (`max_weight`; EngineConfig.max_mix_weight).

`check_mix` validates one mix against the adapters known now; `MixBook` keeps named mixes (a bundle's
`molora.json` "mixes", or registered at run time) whose names never clash with an adapter's. Knows adapter names
and numbers; nothing about slots, engines or HTTP.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Iterable, Mapping

from molora.errors import RoutingError

Mix = tuple[tuple[str, float], ...]  # ((adapter, weight), ...) in the order given


def check_mix(mix: object, known: Collection[str], max_weight: float, num_slots: int, *, what: str = "mix") -> Mix:
    """The mix as ((adapter, weight), ...), or a RoutingError(field="mix") naming what is wrong: not a non-empty
    {adapter: weight} object, an unknown adapter, a weight that is not a finite number within [-max_weight,
    max_weight], more adapters than the bank's `num_slots` (every adapter of a mix is resident while it runs)."""
    if not isinstance(mix, Mapping) or not mix:
        raise RoutingError(
            f'{what} must be a non-empty object of adapter weights such as {{"a": 0.7, "b": 0.3}}, got {mix!r}',
            field="mix",
        )
    unknown = sorted(str(n) for n in mix if n not in known)
    if unknown:
        raise RoutingError(
            f"{what} names unknown adapter(s) {unknown}; registered adapters: {sorted(known)}", field="mix"
        )
    pairs: list[tuple[str, float]] = []
    for name, w in mix.items():
        if isinstance(w, bool) or not isinstance(w, int | float) or not math.isfinite(w) or abs(w) > max_weight:
            raise RoutingError(
                f"{what}[{name!r}]={w!r}: each weight must be a finite number within [-{max_weight:g}, "
                f"{max_weight:g}] (the server's max_mix_weight)",
                field="mix",
            )
        pairs.append((str(name), float(w)))
    if len(pairs) > num_slots:
        raise RoutingError(
            f"{what} has {len(pairs)} adapters but the bank has {num_slots} slots (every adapter of a mix is "
            "resident while it runs); use fewer adapters or serve with more slots (--max-loras)",
            field="mix",
        )
    return tuple(pairs)


def check_scale(scale: object, max_weight: float) -> float:
    """A pinned adapter's scale as a float, or a RoutingError(field="scale"): a finite number within
    [-max_weight, max_weight]."""
    if isinstance(scale, bool) or not isinstance(scale, int | float) or not math.isfinite(scale):
        raise RoutingError(f"scale={scale!r} must be a finite number", field="scale")
    if abs(scale) > max_weight:
        raise RoutingError(
            f"scale={scale!r} lies outside [-{max_weight:g}, {max_weight:g}] (the server's max_mix_weight)",
            field="scale",
        )
    return float(scale)


class MixBook:
    """Named mixes: name -> Mix. A name may not be an adapter's (`add` refuses it); the adapters of a named mix are
    checked when it is added and again when a request uses it (one may have been unloaded since)."""

    def __init__(self) -> None:
        self._mixes: dict[str, Mix] = {}

    def __contains__(self, name: object) -> bool:
        return name in self._mixes

    def __len__(self) -> int:
        return len(self._mixes)

    def names(self) -> list[str]:
        return sorted(self._mixes)

    def get(self, name: str) -> Mix:
        if name not in self._mixes:
            raise RoutingError(f"unknown mix {name!r}; named mixes: {self.names()}", field="mix")
        return self._mixes[name]

    def items(self) -> Iterable[tuple[str, Mix]]:
        return sorted(self._mixes.items())

    def add(self, name: object, adapters: object, known: Collection[str], max_weight: float, num_slots: int) -> Mix:
        """Register (or replace) the named mix `name` -> `adapters`, checked (`check_mix`); a name that is empty, not
        a string or an adapter's is refused (RoutingError field "name"), and nothing changes on any refusal."""
        if not isinstance(name, str) or not name or name != name.strip():
            raise RoutingError(
                f"a mix's name must be a non-empty string without outer spaces, got {name!r}", field="name"
            )
        if name in known:
            raise RoutingError(
                f"mix name {name!r} is an adapter's name; choose another name (a model id names one thing)",
                field="name",
            )
        mix = check_mix(adapters, known, max_weight, num_slots, what=f"mix {name!r}")
        self._mixes[name] = mix
        return mix

    def remove(self, name: str) -> None:
        self._mixes.pop(name, None)

    def resolve(self, mix: object, known: Collection[str], max_weight: float, num_slots: int) -> Mix:
        """A request's mix: the name of a named mix (checked again against the adapters known now) or an
        {adapter: weight} object (`check_mix`)."""
        if isinstance(mix, str):
            return check_mix(dict(self.get(mix)), known, max_weight, num_slots, what=f"mix {mix!r}")
        return check_mix(mix, known, max_weight, num_slots)


def router_experts(router: object) -> list[Mix]:
    """What each index of an in-network router runs: its expert as ((adapter, weight), ...): one adapter with weight
    1, or a named mix the router takes as an expert (`set_mix_experts` of LearnedRouter and ArrowRouter). The engine
    turns the list into the dispatch rows of the router's choices (molora.engine.routing.expert_table)."""
    experts = getattr(router, "experts", None)
    if callable(experts):
        return list(experts())
    return [((str(n), 1.0),) for n in getattr(router, "adapter_names", ())]


def plain_experts(experts: Iterable[Mix]) -> bool:
    """Whether every expert is one adapter with weight 1 (the router index -> slot lookup of plain routing)."""
    return all(len(e) == 1 and e[0][1] == 1.0 for e in experts)


def check_expert_names(names: object, book: MixBook) -> list[str]:
    """A router expert list (molora.json "router_experts"): a list of named mixes in `book`, each once; a
    RoutingError(field="router_experts") naming what is wrong."""
    if not isinstance(names, list | tuple) or not all(isinstance(n, str) for n in names):
        raise RoutingError(
            f'router_experts must be a list of named mixes such as ["arith_words"], got {names!r}',
            field="router_experts",
        )
    unknown = sorted(n for n in names if n not in book)
    if unknown:
        raise RoutingError(
            f"router_experts names unknown mix(es) {unknown}; named mixes: {book.names()} (declare them in "
            'molora.json "mixes" or register them with POST /v1/mixes first)',
            field="router_experts",
        )
    if len(set(names)) != len(names):
        raise RoutingError(f"router_experts lists a mix twice: {list(names)}", field="router_experts")
    return list(names)
