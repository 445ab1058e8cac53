"""The two Ray Serve deployments of `molora serve --ray`, as module-level classes (molora.server.ray_serve binds
them with the options of a `RayConfig` and runs them). Imports ray: only ray_serve imports this module, inside the
functions that start Ray.

- `EngineDeployment`: one engine replica (`molora.server.ray_replica.EngineReplica`: one molora engine per resident
  bundle, leases, bank sync, streaming) behind `@serve.multiplexed` on the bundle. Its messages are typed
  (`BundleSpec`, `RequestSpec` in; `generate` yields the replica's tuples, molora.server.ray_replica). Ray fixes
  the multiplexed cap (max_num_models_per_replica) where the method is decorated, so `engine_class(cap)` gives the
  class with `bundle` decorated for that cap: a subclass that only adds that one attribute (one class per cap).
- `IngressDeployment`: the FastAPI app of `molora serve` (`ray_serve.ingress_app`) over a handle on the engine
  deployment, behind Ray's HTTP proxy (`--ray-ingress serve`).
"""

from __future__ import annotations

import functools
from collections.abc import AsyncIterator, Sequence
from typing import TYPE_CHECKING, Any

from ray import serve

from molora.server.ray_replica import EngineReplica
from molora.server.ray_state import BundleSpec, Resident
from molora.server.runner import RequestSpec

if TYPE_CHECKING:
    from molora.server.ray_serve import RayConfig


def build_engine(cfg: RayConfig, path: str | None) -> Any:
    """One engine of a replica: the bundle at `path` (None: the embedded default) with cfg's engine settings,
    dtype, quantization and LM-head quantization."""
    from molora.engine import EngineConfig
    from molora.server.launch import build_engine as build

    return build(
        path,
        EngineConfig(**cfg.engine_config),
        cfg.dtype,
        quantization=cfg.quantization,
        quantize_lm_head=cfg.quantize_lm_head,
    )


class EngineDeployment:
    """An engine replica (module docstring); deploy `engine_class(cfg.bundles_per_replica)`, bound to (cfg, specs)."""

    def __init__(self, cfg: RayConfig, specs: Sequence[BundleSpec]) -> None:
        import torch

        torch.set_num_threads(cfg.threads)
        self.by_name = {s.name: s for s in specs}
        self.replica = EngineReplica(
            functools.partial(build_engine, cfg),
            max_in_flight=cfg.max_queue,
            stall_s=cfg.stall_s,
            name=serve.get_replica_context().replica_id.unique_id,
        )

    async def bundle(self, bundle_id: str) -> Resident:
        """Make the bundle `bundle_id` resident (its newest spec this replica has seen, else the deployed one).
        `engine_class(cap)` puts Ray's multiplexed cache over it under the same name (Ray tells a method from a
        function by finding the wrapper on the instance under the wrapped function's name)."""
        return await self.replica.load(self.replica.specs.get(bundle_id) or self.by_name[bundle_id])

    async def _resident(self, spec: BundleSpec) -> Resident:
        newest = self.replica.specs.get(spec.name)
        if newest is None or spec.version >= newest.version:
            self.replica.specs[spec.name] = spec
        return await self.bundle(serve.get_multiplexed_model_id())

    async def generate(self, spec: BundleSpec, specs: list[RequestSpec], prefix: str) -> AsyncIterator[tuple]:
        resident = await self._resident(spec)
        async for message in self.replica.generate(resident, spec, specs, prefix):
            yield message

    async def command(self, spec: BundleSpec, op: str) -> tuple:
        return await self.replica.command(await self._resident(spec), spec, op)

    async def record_routing_stats(self) -> dict:
        """What this replica's hot sets hold, for the ingress's `AdapterSetRouter` (Ray polls it)."""
        return await self.replica.stats()

    def info(self) -> dict:
        """This replica's name, engines built and leases (diagnostics; tests)."""
        leases = {
            n: {"holders": x.holders, "sequences": x.sequences, "version": x.version}
            for n, x in self.replica.leases.leases.items()
        }
        return {"replica": self.replica.name, "builds": self.replica.leases.builds, "leases": leases}


@functools.cache
def engine_class(cap: int) -> type[EngineDeployment]:
    """`EngineDeployment` with `bundle` multiplexed over at most `cap` resident bundles (Ray's
    max_num_models_per_replica, fixed where the method is decorated)."""
    multiplexed = serve.multiplexed(max_num_models_per_replica=cap)(EngineDeployment.bundle)
    return type("MoloraEngine", (EngineDeployment,), {"bundle": multiplexed, "__module__": __name__})


@serve.ingress()
class IngressDeployment:
    """The ingress (module docstring): builds its app once Ray has started it, over the engine handle."""

    def __init__(self, engine: Any, cfg: RayConfig, specs: Sequence[BundleSpec], server_kwargs: dict) -> None:
        self.engine, self.cfg, self.specs, self.server_kwargs = engine, cfg, specs, server_kwargs

    def __serve_build_asgi_app__(self) -> Any:
        from molora.server.ray_serve import ingress_app

        return ingress_app(self.engine, self.cfg, self.specs, self.server_kwargs)
