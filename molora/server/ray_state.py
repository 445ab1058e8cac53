"""What the Ray tier shares across processes, without Ray: the adapter `Registry` (bundle versions) and bundle
`Leases` (an engine stays alive while a stream uses it, whatever Ray's LRU does), and the error kinds that cross
the process boundary. `molora.server.ray_serve` says how these fit together.
"""

from __future__ import annotations

import asyncio
import gc
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from molora.errors import AdapterDraining, AdapterNotFound, BankFullError, MoLoRAError, RoutingError
from molora.server.runner import EngineRunner, RunnerStopped, Saturated

log = logging.getLogger("molora.server.ray")

# errors that cross the process boundary as (kind, message): exceptions of molora's own classes may not unpickle
_ERRORS: dict[str, type[Exception]] = {
    "saturated": Saturated,
    "stopped": RunnerStopped,
    "draining": AdapterDraining,
    "not_found": AdapterNotFound,
    "bank_full": BankFullError,
    "invalid": MoLoRAError,
}


def error_kind(e: BaseException) -> str:
    if isinstance(e, RoutingError):  # "routing:<field>": the ingress names the request's parameter from the field
        return f"routing:{e.field or ''}"
    for kind, cls in _ERRORS.items():  # most specific first: MoLoRAError comes last
        if isinstance(e, cls):
            return kind
    raise TypeError(f"not a transportable error: {e!r}")


def raise_error(kind: str, message: str) -> None:
    if kind.startswith("routing:"):
        raise RoutingError(message, field=kind.removeprefix("routing:") or None)
    raise _ERRORS[kind](message)


# ------------------------------------------------------------------------------------------ registry


@dataclass(frozen=True)
class BundleSpec:
    """One version of a served bundle: where it is, and the adapters it must hold.

    adapters: name -> folder (None: the bundle's own adapter, loaded with it). forced: removed adapters whose
    requests end now rather than drain. roots: the folders run-time adapters must lie under. routed: the bundle
    has a router (placement: an unpinned request of a bundle without one needs no adapter). cold: adapters a replica
    registers without reading their weights (`--lora-dir`: read on first use, each confined to its own folder's
    parent, the --lora-dir it was found in). mixes, mix_experts: the named mixes every replica registers (in this
    order, after the adapters)."""

    name: str
    path: str | None
    version: int = 0
    adapters: dict[str, str | None] = field(default_factory=dict)
    forced: frozenset[str] = frozenset()
    roots: tuple[str, ...] = ()
    routed: bool = True
    cold: frozenset[str] = frozenset()
    # named mixes registered at run time (POST /v1/mixes): name -> {adapter: weight}, and for those whose
    # router_expert was ever given, whether the router takes them as experts (Engine.add_mix)
    mixes: dict[str, dict[str, float]] = field(default_factory=dict)
    mix_experts: dict[str, bool] = field(default_factory=dict)


class Registry:
    """The ingress's view of each bundle's adapters, by version (module docstring)."""

    def __init__(self, specs: Sequence[BundleSpec]) -> None:
        self.specs = {s.name: s for s in specs}

    def spec(self, bundle: str) -> BundleSpec:
        return self.specs[bundle]

    def adapters(self, bundle: str) -> list[str]:
        return list(self.specs[bundle].adapters)

    def with_adapter(self, bundle: str, name: str, path: str) -> BundleSpec:
        """The next version with `name` added (not yet committed)."""
        s = self.specs[bundle]
        return replace(
            s,
            version=s.version + 1,
            adapters={**s.adapters, name: path},
            forced=s.forced - {name},
            cold=s.cold - {name},  # added at run time: read and checked whole, as any POSTed adapter
        )

    def with_mix(
        self, bundle: str, name: str, adapters: dict[str, float], router_expert: bool | None = None
    ) -> BundleSpec:
        """The next version with the named mix `name` registered (or replaced; not yet committed); router_expert None
        keeps what an earlier call said."""
        s = self.specs[bundle]
        experts = s.mix_experts if router_expert is None else {**s.mix_experts, name: router_expert}
        return replace(s, version=s.version + 1, mixes={**s.mixes, name: dict(adapters)}, mix_experts=experts)

    def without_adapter(self, bundle: str, name: str, force: bool) -> BundleSpec:
        """The next version with `name` removed (not yet committed)."""
        s = self.specs[bundle]
        forced = s.forced | {name} if force else s.forced - {name}
        return replace(
            s, version=s.version + 1, adapters={k: v for k, v in s.adapters.items() if k != name}, forced=forced
        )

    def commit(self, spec: BundleSpec) -> None:
        if spec.version != self.specs[spec.name].version + 1:
            raise MoLoRAError(
                f"bundle {spec.name!r} changed meanwhile (version {self.specs[spec.name].version}, "
                f"this change was made on {spec.version - 1}); retry"
            )
        self.specs[spec.name] = spec


# ------------------------------------------------------------------------------------------ leases


class BundleLease:
    """One bundle's engine on one replica: resident while Ray holds it, alive while sequences use it."""

    def __init__(self, name: str, engine: Any, runner: EngineRunner, version: int = -1) -> None:
        self.name, self.engine, self.runner = name, engine, runner
        self.version = version  # the registry version the engine's bank matches (-1: none yet)
        self.holders = 0  # Ray's loaded objects for this bundle not yet released
        self.sequences = 0  # generate calls running on it
        self.closed = False
        self.sync_lock = asyncio.Lock()


class Resident:
    """What the multiplexed loader returns to Ray: releases its hold on the lease once, however often Ray
    and the garbage collector call `__del__`."""

    def __init__(self, leases: Leases, lease: BundleLease) -> None:
        self.leases, self.lease = leases, lease
        self._released = False

    def release(self) -> None:
        if not self._released:
            self._released = True
            self.leases.release(self.lease)

    def __del__(self) -> None:
        self.release()


class Leases:
    """Bundle engines of one replica, refcounted by Ray's holds and running sequences (module docstring).

    build(name) -> (engine, runner): makes an engine for a bundle; close(lease) frees one (default: stop its
    runner and loader thread). Single event loop: no locks needed beyond one build per bundle at a time."""

    def __init__(self, build: Callable[[str], Any], close: Callable[[BundleLease], None] | None = None) -> None:
        self.build = build
        self.close_fn = close or close_lease
        self.leases: dict[str, BundleLease] = {}
        self.builds = 0  # engines built (a revived lease is not a build)
        self._building: dict[str, asyncio.Future] = {}

    async def acquire(self, name: str) -> Resident:
        """A hold on `name`'s engine: the live one (revived if released but not yet freed), else a new one."""
        lease = self.leases.get(name)
        if lease is None or lease.closed:
            if name in self._building:  # a concurrent load of the same bundle: share it
                lease = await asyncio.shield(self._building[name])
            else:
                fut = asyncio.get_running_loop().create_future()
                self._building[name] = fut
                try:
                    engine, runner = await self.build(name)
                except BaseException as e:
                    fut.set_exception(e)
                    fut.exception()  # retrieved: no "never retrieved" warning when nobody else waited
                    raise
                finally:
                    self._building.pop(name, None)
                lease = BundleLease(name, engine, runner)
                self.leases[name] = lease
                self.builds += 1
                fut.set_result(lease)
        lease.holders += 1
        return Resident(self, lease)

    def release(self, lease: BundleLease) -> None:
        """Ray dropped one hold (eviction): free the engine once nothing holds or runs on it."""
        lease.holders = max(lease.holders - 1, 0)
        self._maybe_close(lease)

    def begin(self, lease: BundleLease) -> None:
        if lease.closed:
            raise RunnerStopped(f"bundle {lease.name!r} was released on this replica; retry")
        lease.sequences += 1

    def end(self, lease: BundleLease) -> None:
        lease.sequences -= 1
        assert lease.sequences >= 0, "a sequence ended twice"
        self._maybe_close(lease)

    def _maybe_close(self, lease: BundleLease) -> None:
        if lease.holders == 0 and lease.sequences == 0 and not lease.closed:
            lease.closed = True
            if self.leases.get(lease.name) is lease:
                del self.leases[lease.name]
            log.info("bundle %s released: freeing its engine", lease.name)
            self.close_fn(lease)


def close_lease(lease: BundleLease) -> None:
    lease.runner.stop()
    close = getattr(lease.engine, "close", None)
    if close is not None:
        close()
    lease.engine = lease.runner = None
    gc.collect()
