"""Placement by adapter set for `molora serve --ray`: which engine replica should run a request, from the adapters
the request needs and the adapters each replica holds. Pure logic, no Ray (`molora.server.ray_router` plugs it into
Ray Serve's `RequestRouter`).

Why: the multiplexed id is the bundle (`molora.server.ray_serve`), so Ray's own routing treats every replica that
holds the bundle alike; but once a bundle's engines know more adapters than they have slots (run-time adapters), the
replicas' hot sets differ, and a request that lands where its adapters are cold waits for a copy from the CPU tier or
a read from disk, and evicts adapters another request wanted.

A request **needs** its allowed set (`needed_adapters`): the pinned adapter, or the adapters its routing may pick
(its `allowed_adapters`, else every adapter of the bundle); `routing="none"`, or no router, needs none.

A replica **holds** (`Placement.view`) what it last reported (`replica_stats`, through Ray's `record_routing_stats`
every second): the adapters in its slots and the ones its queued requests will load ("hot"), and its CPU tier
("warm"), joined with the adapters this router sent it after that report (the newest `num_slots` of them): a burst
of one adapter set must not spread over every replica before the next report arrives.

**Ranking** (`rank_replicas`), most preferred first; Ray tries the ranks in order and, within a rank, takes the
replica with the shortest queue that accepts the request (a full one is skipped, so nothing waits on placement):

1. replicas that hold the bundle and are not overloaded (load at most `imbalance` above the least loaded candidate),
   by (needed adapters hot, needed adapters warm), most first;
2. the overloaded holders, in the same order;
3. replicas that do not hold the bundle (building its engine takes seconds: only when every holder is full).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

STATS_VERSION = 1  # the layout of `replica_stats`; a report of another layout is ignored (the router sees nothing)


def needed_adapters(bundle_adapters: Iterable[str], specs: Sequence[Any], *, routed: bool = True) -> frozenset[str]:
    """The adapters a call's engine requests (`RequestSpec`s) may run on: pinned, allowed, or the whole bundle.
    routed: the bundle has a router (without one an unpinned request runs the base model and needs none)."""
    need: set[str] = set()
    for s in specs:
        if s.adapter is not None:
            need.add(s.adapter)
        elif s.routing == "none" or (s.routing == "auto" and not routed):
            continue
        elif s.allowed_adapters is not None:
            need.update(s.allowed_adapters)
        else:
            need.update(bundle_adapters)
    return frozenset(need)


@dataclass(frozen=True)
class ReplicaView:
    """What the router knows of one replica for one bundle."""

    replica: str
    has_bundle: bool = True
    hot: frozenset[str] = frozenset()  # in its slots, or about to be (queued requests need them)
    warm: frozenset[str] = frozenset()  # in its CPU tier (a slot copy away)
    load: int | None = None  # requests running or queued there (None: not known yet)


def rank_replicas(need: frozenset[str], views: Sequence[ReplicaView], *, imbalance: int) -> list[list[str]]:
    """Replica names in ranks, most preferred first (module docstring). Every view appears exactly once."""
    known = [v.load for v in views if v.load is not None and v.has_bundle]
    floor = min(known) if known else 0

    def group(v: ReplicaView) -> int:
        if not v.has_bundle:
            return 2
        return 1 if v.load is not None and v.load - floor > imbalance else 0

    ranks: dict[tuple[int, int, int], list[str]] = {}
    for v in views:
        key = (group(v), -len(need & v.hot), -len(need & v.warm))
        ranks.setdefault(key, []).append(v.replica)
    return [ranks[k] for k in sorted(ranks)]


def hotset_entry(hotset: Any) -> dict:
    """One bundle's part of a replica's report, from its engine's `HotSet` (call it on the engine thread)."""
    hot = set(hotset.mm.bank.names) | set(hotset.wanted)
    return {"hot": sorted(hot), "warm": sorted(set(hotset.cpu) - hot), "num_slots": hotset.mm.bank.num_slots}


def replica_stats(entries: Mapping[str, dict], now: float) -> dict:
    """A replica's report for the router (Ray's routing stats): `hotset_entry` per resident bundle, and the
    replica's clock (time.time()) when it was taken."""
    return {"molora_placement": STATS_VERSION, "t": now, "bundles": dict(entries)}


def all_resident(hotset: Any, need: Iterable[str]) -> bool:
    """Whether every adapter in `need` sits in a slot of `hotset`'s bank (call it on the engine thread)."""
    return all(hotset.resident(n) for n in need)


class Placement:
    """The router's memory of what each replica holds: its last report plus what was sent to it since.

    clock: seconds on the replicas' clock (time.time(); one machine, or synchronised clocks). A send stops counting
    once a report taken `grace_s` after it arrives (the report shows the adapters, or their eviction); the grace
    covers a call accepted by a replica whose engine has not yet queued it when the report is taken."""

    def __init__(self, clock: Callable[[], float] = time.time, grace_s: float = 1.0) -> None:
        self.clock, self.grace_s = clock, grace_s
        self.sent: dict[str, dict[str, dict[str, float]]] = {}  # replica -> bundle -> adapter -> when sent

    def routed(self, replica: str, bundle: str, names: Iterable[str]) -> None:
        """A request that needs `names` went to `replica`."""
        now = self.clock()
        sent = self.sent.setdefault(replica, {}).setdefault(bundle, {})
        for n in sorted(names):
            sent.pop(n, None)  # re-insert: the dict's order is the order of sending
            sent[n] = now

    def forget(self, replica: str) -> None:
        self.sent.pop(replica, None)

    def view(
        self, replica: str, bundle: str, stats: Mapping[str, Any] | None, *, has_bundle: bool, load: int | None
    ) -> ReplicaView:
        """`replica`'s view for `bundle`, from its report `stats` (Ray's routing stats; {} before the first)."""
        report = stats if stats and stats.get("molora_placement") == STATS_VERSION else {}
        entry = report.get("bundles", {}).get(bundle, {})
        since = report.get("t", float("-inf"))
        sent = self.sent.get(replica, {}).get(bundle, {})
        covered = [n for n, t in sent.items() if t + self.grace_s <= since]  # the report shows them (or their eviction)
        for n in covered:
            del sent[n]
        newest = list(sent)[::-1]
        if "num_slots" in entry:
            newest = newest[: entry["num_slots"]]
        hot = frozenset(entry.get("hot", ())) | frozenset(newest)
        return ReplicaView(replica, has_bundle, hot, frozenset(entry.get("warm", ())) - hot, load)
