"""`AdapterSetRouter`: Ray Serve's request router for the engine deployment, placing each call by the adapters it
needs (`molora.server.placement` says how; this module only connects it to Ray's `RequestRouter` API).

Ray builds one router per deployment handle (in the ingress), calls `choose_replicas` for every pending call and
`on_request_routed` once a replica accepted it; each replica's `record_routing_stats` (the engine deployment's
method, every `STATS_PERIOD_S`) reaches the router as `RunningReplica.routing_stats`.

No `FIFOMixin`: with it Ray hands a free replica to the oldest pending call of the same bundle, not to the call the
replica was chosen for, which would undo a choice made for one adapter set in favour of another. Without it each
call gets the replica chosen for it (Ray's default matching by request id). Imports ray: load it only with `--ray`.
"""

from __future__ import annotations

from typing import Any

from ray.serve.request_router import PendingRequest, ReplicaID, RequestRouter, RunningReplica

from molora.server.placement import Placement, needed_adapters, rank_replicas
from molora.server.ray_state import BundleSpec

STATS_PERIOD_S = 1.0  # how often each replica reports what it holds
IMBALANCE = 4  # a holder this many requests above the least loaded one loses its preference


def call_needs(pending: PendingRequest) -> frozenset[str]:
    """The adapters of a `generate(spec, specs, prefix)` call; a command (`command(spec, op)`) needs none."""
    args = pending.args
    if len(args) < 2 or not isinstance(args[0], BundleSpec) or not isinstance(args[1], list):
        return frozenset()
    return needed_adapters(args[0].adapters, args[1], routed=args[0].routed)


class AdapterSetRouter(RequestRouter):
    """Ranks replicas by the adapters they hold of a call's allowed set (molora.server.placement)."""

    def initialize_state(self, imbalance: int = IMBALANCE, **kwargs: Any) -> None:
        self.placement = Placement()
        self.imbalance = imbalance

    async def choose_replicas(
        self, candidate_replicas: list[RunningReplica], pending_request: PendingRequest | None = None
    ) -> list[list[RunningReplica]]:
        if pending_request is None or not pending_request.metadata.multiplexed_model_id:
            return [candidate_replicas]
        bundle = pending_request.metadata.multiplexed_model_id
        need = call_needs(pending_request)
        by_name = {r.replica_id.unique_id: r for r in candidate_replicas}
        views = [
            self.placement.view(
                name,
                bundle,
                r.routing_stats,
                has_bundle=bundle in r.multiplexed_model_ids,
                load=self.replica_queue_len_cache.get(r.replica_id),
            )
            for name, r in by_name.items()
        ]
        pending_request.routing_context.should_backoff = True  # every rank was offered: back off before a retry
        return [[by_name[n] for n in rank] for rank in rank_replicas(need, views, imbalance=self.imbalance)]

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID, result: Any) -> None:
        bundle = pending_request.metadata.multiplexed_model_id
        if bundle:
            self.placement.routed(replica_id.unique_id, bundle, call_needs(pending_request))

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        super().on_replica_actor_died(replica_id)
        self.placement.forget(replica_id.unique_id)
