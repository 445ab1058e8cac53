"""What a new request's routing resolves to, checked once, before the engine queues it.

A request asks to be routed with one `RoutingRequest` (a mode name, a pinned adapter, an allowed set, and for the
per-request chooser the text it reads), carried from the API (`Engine.add_request`'s routing arguments; a server's
`RequestSpec`) to here. `resolve_routing` turns it into the parts of the request's `RouteState`
(molora.engine.routing): its mode, router, allowed adapters and the adapters it pins while in flight. Every refusal
is a `RoutingError` naming the field at fault (or the hot set's `AdapterError` for unknown names) raised before
anything changes; a server maps the field to its own parameter instead of checking again. A draining adapter
(`Engine.unload_adapter`) is refused to a pinned request and left out of a router's allowed set and pins. Mode
"hybrid" resolves to "choosing": the request waits for the per-request chooser's pick (molora.engine.choosing),
then resolves again, pinned to the pick (or on the base model).

`run_chooser` asks a model's per-request chooser (`mm.chooser`, `--router hybrid`) which adapter each question goes
to, with the adapters it may choose pinned in slots while it runs (BankFullError when they cannot all be: retry).

Knows routing modes, routers and the hot set's names; nothing about KV blocks, scheduling or sampling.
"""

from __future__ import annotations

from collections.abc import Callable, Generator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from molora.engine.hotset import HotSet
from molora.engine.routing import fixed_routes
from molora.errors import AdapterDraining, BankFullError, RoutingError
from molora.routing import ArrowRouter, VocabRouter
from molora.routing.arrow import ArrowConfig
from molora.routing.base import Router
from molora.routing.mix import Mix, router_experts
from molora.routing.names import router_config

if TYPE_CHECKING:
    from molora.model.attach import MoLoRAModel

ROUTING_CHOICES = ("auto", "learned", "arrow", "arrow-token", "vocab", "sequence", "hybrid", "mix", "none")


@dataclass(frozen=True)
class RoutingRequest:
    """How one request asks to be routed (module docstring). mode: one of ROUTING_CHOICES ("auto": the model's
    router, or the pinned adapter, or the base model); adapter: pin the request to it; allowed: the adapters its
    routing may use (None: any, empty: none, the base model); question: for mode "hybrid", the text the per-request
    chooser reads (None: the prompt, decoded); mix: a static mix already checked (molora.routing.mix.check_mix):
    every token on the weighted sum of those adapters' deltas (mode "mix"); scale: the pinned adapter's weight
    (None: 1), checked (molora.routing.mix.check_scale)."""

    mode: str = "auto"
    adapter: str | None = None
    allowed: Sequence[str] | None = None
    question: str | None = None
    mix: Mix | None = None
    scale: float | None = None


def resolve_routing(
    ask: RoutingRequest, hotset: HotSet, router: Router | None, num_slots: int, chooser: Any = None
) -> tuple[str, Router | None, frozenset[str] | None, tuple[str, ...]]:
    """(mode, router, allowed, adapters to pin) of a request's RouteState, for a model with `router` attached
    (None: none), a per-request `chooser` (None: none) and a bank of `num_slots` slots. Mode "choosing": the request
    waits for the chooser's pick and pins nothing yet."""
    routing, adapter = ask.mode, ask.adapter
    if routing not in ROUTING_CHOICES:
        raise RoutingError(f"routing={routing!r}; choose one of {ROUTING_CHOICES}", field="mode")
    hs = hotset
    hs.check_known([adapter] if adapter is not None else [])
    if adapter in hs.draining:
        raise AdapterDraining(
            f"adapter {adapter!r} is being unloaded (draining: only requests already using it "
            "may finish on it); choose another adapter, or load it again once it is gone"
        )
    allowed = None if ask.allowed is None else frozenset(ask.allowed)
    hs.check_known(sorted(allowed or ()))
    if ask.scale is not None and adapter is None:
        raise RoutingError(
            "scale weighs a pinned adapter: pin one (adapter=<name>, or model=<adapter> over HTTP), or give a mix "
            "of one adapter with that weight",
            field="scale",
        )
    if ask.mix is not None or routing == "mix":
        return _resolve_mix(ask, hs, allowed)
    if adapter is not None and allowed is not None and adapter not in allowed:
        raise RoutingError(f"adapter {adapter!r} is not among allowed_adapters {sorted(allowed)}", field="allowed")
    if routing == "hybrid":
        if chooser is None:
            raise RoutingError(
                "routing='hybrid' asks the per-request chooser, which this model has only when its bundle's router "
                "is hybrid (molora serve --router hybrid); leave routing 'auto'",
                field="mode",
            )
        if adapter is not None:
            raise RoutingError(
                f"adapter={adapter!r} pins the request, which contradicts routing='hybrid' (the chooser picks)",
                field="mode",
            )
        return "choosing", None, allowed, ()
    if routing == "none" or (routing == "auto" and adapter is None and router is None):
        if adapter is not None:
            raise RoutingError(f"routing='none' runs the base model; drop adapter={adapter!r}", field="mode")
        return "none", None, allowed, ()
    if adapter is not None or routing == "sequence":
        if adapter is None:
            raise RoutingError("routing='sequence' pins one adapter per request: pass adapter=<name>", field="adapter")
        if routing not in ("auto", "sequence"):
            raise RoutingError(
                f"adapter={adapter!r} pins the request, which contradicts routing={routing!r} (per-token routing "
                "runs on the model's router: leave the adapter out)",
                field="mode",
            )
        return "pinned", None, allowed, (adapter,)
    if router is None:
        raise RoutingError(f"routing={routing!r} needs a router, but the model has none attached", field="mode")
    if routing == "learned" and not router.in_network:
        raise RoutingError(
            f"routing='learned' needs an in-network router; the model has {type(router).__name__}", field="mode"
        )
    # a router name means one router (molora.routing.names): 'arrow' is a bundle's own Arrow (its settings win),
    # 'arrow-token' Arrow's plain defaults; the engine runs the model's router, so it serves the name it is
    if routing in ("arrow", "arrow-token") and not _is_named(router, routing):
        raise RoutingError(
            f"routing={routing!r} runs the router of that name, and this model's router is "
            f"{type(router).__name__}{_config_of(router)}; serve a bundle whose router it is (molora serve --model M "
            f'--lora-modules ... --router {routing}, or molora.json router {{"kind": "arrow", ...}})',
            field="mode",
        )
    if routing == "vocab" and not isinstance(router, VocabRouter):
        raise RoutingError(f"routing='vocab' needs a VocabRouter; the model has {type(router).__name__}", field="mode")
    if router.in_network:
        _adapter_names(router)  # (an in-network router without names is refused)
        # the adapters of its experts (a mix expert's every adapter: molora.routing.mix.router_experts)
        names = list(dict.fromkeys(a for e in router_experts(router) for a, _ in e if a in hs.paths))
        mode = "learned"
    else:
        # an adapter a fixed rule names that is no longer registered (unloaded at run time) gets its tokens on the
        # base model, as a draining one does (molora.engine.routing._token_routing); other routers may use any
        fixed = fixed_routes(router)
        names = [n for n in fixed if n in hs.paths] if fixed else hs.names
        mode = "tokens"
    if hs.draining.intersection(names):  # as if absent: the allowed set (which routing obeys) leaves it out
        allowed = (allowed if allowed is not None else frozenset(hs.paths)) - hs.draining
    needs = tuple(n for n in names if allowed is None or n in allowed)
    if len(needs) > num_slots:
        mixes = sorted(getattr(router, "mix_experts", None) or ())
        raise RoutingError(
            f"this request may route to {len(needs)} adapters {list(needs)}"
            + (f" (with the adapters of the router's mix experts {mixes})" if mixes else "")
            + f", but the bank has {num_slots} slots; restrict allowed_adapters or attach with more slots",
            field="allowed",
        )
    return mode, router, allowed, needs


def _resolve_mix(
    ask: RoutingRequest, hs: HotSet, allowed: frozenset[str] | None
) -> tuple[str, Router | None, frozenset[str] | None, tuple[str, ...]]:
    """resolve_routing of a static mix: mode "mix", no router, the mix's adapters pinned. The mix arrives checked
    (known adapters, weights, no more adapters than slots: molora.routing.mix.check_mix); what is checked here is
    how it fits the rest of the request and the adapters' state."""
    if ask.mix is None:
        raise RoutingError("routing='mix' runs a static mix: give the mix (mix={adapter: weight, ...})", field="mix")
    if ask.mode not in ("auto", "mix"):
        raise RoutingError(
            f"a mix fixes every token's adapters, which contradicts routing={ask.mode!r}; leave routing 'auto'",
            field="mode",
        )
    if ask.adapter is not None:
        raise RoutingError(
            f"adapter={ask.adapter!r} pins one adapter and a mix weighs several: give one of them (a pinned adapter "
            "with a weight is a mix of one)",
            field="mix",
        )
    names = tuple(n for n, _ in ask.mix)
    draining = sorted(hs.draining.intersection(names))
    if draining:
        raise AdapterDraining(
            f"adapter(s) {draining} of the mix are being unloaded (draining); leave them out of the mix"
        )
    if allowed is not None and not allowed.issuperset(names):
        raise RoutingError(
            f"the mix's adapters {sorted(set(names) - allowed)} are not among allowed_adapters {sorted(allowed)}",
            field="allowed",
        )
    return "mix", None, allowed, names


def _is_named(router: Router, name: str) -> bool:
    """Whether `router` is what router name `name` (arrow, arrow-token) means on its model: any Arrow for 'arrow' (a
    model's Arrow is its bundle's own, whose settings win), Arrow's plain defaults for 'arrow-token'."""
    if not isinstance(router, ArrowRouter):
        return False
    return name == "arrow" or router.config == ArrowConfig.from_json(router_config(name))


def _config_of(router: Router) -> str:
    return f" ({router.config})" if isinstance(router, ArrowRouter) else ""


def _adapter_names(router: Router) -> list[str]:
    """The adapters an in-network router chooses between, in its index order (LearnedRouter, ArrowRouter)."""
    names = getattr(router, "adapter_names", None)
    if names is None:
        raise RoutingError(f"the in-network router {type(router).__name__} has no adapter_names to route between")
    return list(names)


def run_chooser(
    mm: MoLoRAModel,
    hotset: HotSet,
    questions: list[str],
    allowed: list[str] | None,
    busy: Callable[[], bool] | None = None,
) -> list[dict]:
    """`mm.chooser.choose_served` (a `HybridChooser`) over the chooser's adapters that are registered, not draining
    and in `allowed` (None: all), pinned in slots for the call; each question's {"adapter", "share", "z"}. Runs on
    the engine thread between steps (it shares the model's routing context with the steps)."""
    from molora.routing.hybrid import drain

    return drain(chooser_stages(mm, hotset, questions, allowed, busy))


def chooser_stages(
    mm: MoLoRAModel,
    hotset: HotSet,
    questions: list[str],
    allowed: list[str] | None,
    busy: Callable[[], bool] | None = None,
) -> Generator[None, None, list[dict]]:
    """`run_chooser` in stages, one forward pass each (`HybridChooser.served_stages`), for the engine thread to run
    one at a time between steps; `busy` (the engine's: has it requests?) says no and the passes still to come run
    as one. Its adapters stay pinned from the first stage until it ends, raises or is closed
    (a generator's `close()`), so no load can move them between stages. It keeps the chooser it began with to its
    end: a run-time load or unload swaps `mm.chooser` for a rebuilt one (molora.engine.runtime_adapters), and the
    next choice asks that one."""
    chooser = getattr(mm, "chooser", None)
    if chooser is None:
        raise RoutingError("this model has no per-request chooser; serve its bundle with --router hybrid")
    names = [
        n
        for n in chooser.adapter_names
        if n in hotset.paths and n not in hotset.draining and (allowed is None or n in allowed)
    ]
    if not hotset.acquire(names):
        raise BankFullError(
            f"the chooser's adapters {names} are not all in slots now (one is being read, or every slot is pinned "
            "by running requests); retry shortly"
        )
    try:
        return list((yield from chooser.served_stages(mm, questions, names, busy=busy)))
    finally:
        hotset.release(names)
