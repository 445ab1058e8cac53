"""What a new request's routing resolves to, checked before the engine queues it.

`resolve_routing` turns `Engine.add_request`'s routing arguments (a mode name, a pinned adapter, an allowed set)
into the parts of the request's `RouteState` (molora.engine.routing): its mode, router, allowed adapters and the
adapters it pins while in flight. Every refusal is a `RoutingError` (or the hot set's `AdapterError` for unknown
names) raised before anything changes. A draining adapter (`Engine.unload_adapter`) is refused to a pinned request
and left out of a router's allowed set and pins.

Knows routing modes, routers and the hot set's names; nothing about KV blocks, scheduling or sampling.
"""

from __future__ import annotations

from molora.engine.hotset import HotSet
from molora.errors import AdapterDraining, RoutingError
from molora.routing import ArrowRouter, SequenceRouter, VocabRouter
from molora.routing.base import Router

ROUTING_CHOICES = ("auto", "learned", "arrow", "vocab", "sequence", "none")


def resolve_routing(
    routing: str,
    adapter: str | None,
    allowed_adapters: list[str] | None,
    hotset: HotSet,
    router: Router | None,
    num_slots: int,
) -> tuple[str, Router | None, frozenset[str] | None, tuple[str, ...]]:
    """(mode, router, allowed, adapters to pin) of a request's RouteState, for a model with `router` attached
    (None: none) and a bank of `num_slots` slots."""
    if routing not in ROUTING_CHOICES:
        raise RoutingError(f"routing={routing!r}; choose one of {ROUTING_CHOICES}")
    hs = hotset
    hs.check_known([adapter] if adapter is not None else [])
    if adapter in hs.draining:
        raise AdapterDraining(
            f"adapter {adapter!r} is being unloaded (draining: only requests already using it "
            "may finish on it); choose another adapter, or load it again once it is gone"
        )
    allowed = None if allowed_adapters is None else frozenset(allowed_adapters)
    hs.check_known(sorted(allowed or ()))
    if routing == "none" or (routing == "auto" and adapter is None and router is None):
        if adapter is not None:
            raise RoutingError(f"routing='none' runs the base model; drop adapter={adapter!r}")
        return "none", None, allowed, ()
    if adapter is not None or routing == "sequence":
        if adapter is None:
            raise RoutingError("routing='sequence' pins one adapter per request: pass adapter=<name>")
        if routing not in ("auto", "sequence"):
            raise RoutingError(f"adapter={adapter!r} pins the request, which contradicts routing={routing!r}")
        if allowed is not None and adapter not in allowed:
            raise RoutingError(f"adapter {adapter!r} is not among allowed_adapters {sorted(allowed)}")
        return "pinned", None, allowed, (adapter,)
    if router is None:
        raise RoutingError(f"routing={routing!r} needs a router, but the model has none attached")
    if routing == "learned" and not router.in_network:
        raise RoutingError(f"routing='learned' needs an in-network router; the model has {type(router).__name__}")
    if routing == "arrow" and not isinstance(router, ArrowRouter):
        raise RoutingError(
            f"routing='arrow' needs a bundle whose router is Arrow (molora.json router kind "
            f'"arrow"); the model has {type(router).__name__}'
        )
    if routing == "vocab" and not isinstance(router, VocabRouter):
        raise RoutingError(f"routing='vocab' needs a VocabRouter; the model has {type(router).__name__}")
    if router.in_network:
        names = [n for n in _adapter_names(router) if n in hs.paths]
        mode = "learned"
    else:
        if isinstance(router, VocabRouter):
            names = [n for n in dict.fromkeys([r[2] for r in router.ranges] + [router.default]) if n is not None]
            hs.check_known(names)
        elif isinstance(router, SequenceRouter) and isinstance(router.adapters, str):
            names = [router.adapters]
            hs.check_known(names)
        else:
            names = hs.names
        mode = "tokens"
    if hs.draining.intersection(names):  # as if absent: the allowed set (which routing obeys) leaves it out
        allowed = (allowed if allowed is not None else frozenset(hs.paths)) - hs.draining
    needs = tuple(n for n in names if allowed is None or n in allowed)
    if len(needs) > num_slots:
        raise RoutingError(
            f"this request may route to {len(needs)} adapters {list(needs)}, but the bank has "
            f"{num_slots} slots; restrict allowed_adapters or attach with more slots"
        )
    return mode, router, allowed, needs


def _adapter_names(router: Router) -> list[str]:
    """The adapters an in-network router chooses between, in its index order (LearnedRouter, ArrowRouter)."""
    names = getattr(router, "adapter_names", None)
    if names is None:
        raise RoutingError(f"the in-network router {type(router).__name__} has no adapter_names to route between")
    return list(names)
