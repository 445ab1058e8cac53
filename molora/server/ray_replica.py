"""`EngineReplica`: the engine deployment's logic without Ray (bundle leases, adapter sync, streamed outputs);
`molora.server.ray_serve` wraps it in a Serve deployment."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Callable, Sequence
from pathlib import Path
from typing import Any

from molora.errors import AdapterNotFound, MoLoRAError
from molora.server.client import load_into
from molora.server.placement import all_resident, hotset_entry, needed_adapters, replica_stats
from molora.server.ray_state import (
    BundleLease,
    BundleSpec,
    Leases,
    Resident,
    error_kind,
)
from molora.server.runner import (
    EngineBusy,
    EngineFailure,
    EngineRunner,
    RequestSpec,
    RunnerStopped,
    Saturated,
)

log = logging.getLogger("molora.server.ray")


# ------------------------------------------------------------------------------------------ replica


class EngineReplica:
    """The engine deployment's logic without Ray: bundle leases, adapter sync, streaming outputs.

    build_engine(path) -> Engine (blocking; runs on a worker thread). The Ray deployment class wraps this."""

    def __init__(
        self,
        build_engine: Callable[[str | None], Any],
        *,
        max_in_flight: int = 256,
        stall_s: float = 30.0,
        name: str = "local",
    ) -> None:
        self.build_engine, self.name = build_engine, name
        self.max_in_flight, self.stall_s = max_in_flight, stall_s
        self.specs: dict[str, BundleSpec] = {}  # the newest spec seen per bundle (the loader reads it)
        self.leases = Leases(self._build)

    async def _build(self, name: str) -> tuple[Any, EngineRunner]:
        spec = self.specs[name]
        engine = await asyncio.to_thread(self.build_engine, spec.path)
        runner = EngineRunner(engine, max_in_flight=self.max_in_flight, stall_s=self.stall_s)
        runner.start()
        return engine, runner

    async def load(self, spec: BundleSpec) -> Resident:
        """The multiplexed loader's body (Ray calls it on a miss)."""
        self.specs[spec.name] = spec
        return await self.leases.acquire(spec.name)

    async def sync(self, lease: BundleLease, spec: BundleSpec) -> dict[str, str]:
        """Bring the lease's adapters to `spec` (module docstring); returns {removed name: "unloaded" or
        "draining"}. Raises the engine's error if an added adapter does not load (the version stays)."""
        async with lease.sync_lock:
            if spec.version <= lease.version:
                return {}
            engine, runner = lease.engine, lease.runner
            listed = await runner.call(engine.list_adapters)
            current = {a["name"] for a in listed if a.get("state", "ready") != "draining"}
            states = {}
            for name in sorted(current - set(spec.adapters)):
                states[name] = await runner.call(lambda n=name: engine.unload_adapter(n, force=n in spec.forced))
            roots = [Path(r) for r in spec.roots]
            cold: dict[Path, dict[str, Path]] = {}  # --lora-dir adapters by folder: registered, weights not read
            for name, path in spec.adapters.items():
                if name not in current and name in spec.cold and path is not None:
                    cold.setdefault(Path(path).parent, {})[name] = Path(path)
            for root, group in cold.items():  # configs read and checked on the engine thread, all or none per folder
                await runner.call(lambda g=group, r=root: engine.register_adapters(g, roots=[r]))
            for name, path in spec.adapters.items():
                if name not in current and name not in spec.cold:
                    if path is None:
                        raise AdapterNotFound(f"adapter {name!r} of bundle {spec.name!r} is not in its manifest")
                    await load_into(engine, runner, name, Path(path), roots)
            for name, adapters in spec.mixes.items():  # after the adapters they name; registering again is harmless
                flag = spec.mix_experts.get(name)
                await runner.call(lambda n=name, a=adapters, f=flag: engine.add_mix(n, a, f))
            lease.version = spec.version
            return states

    async def generate(
        self, resident: Resident, spec: BundleSpec, specs: Sequence[RequestSpec], prefix: str
    ) -> AsyncIterator[tuple]:
        """Messages for the ingress: ("accepted", {request_id: index}, replica name, whether every adapter the
        call needs was in a slot when it arrived), then ("outs", [(index, RequestOutput), ...]) with every output
        ready at that moment, ... or ("failure", message); ("error", kind, message) if the request never
        started."""
        lease = resident.lease
        try:
            self.leases.begin(lease)
        except RunnerStopped as e:
            yield ("error", "stopped", str(e))
            return
        try:
            try:
                await self.sync(lease, spec)
                found = await self._check_resident(lease, needed_adapters(spec.adapters, specs, routed=spec.routed))
                try:
                    sub = await lease.runner.submit(specs, prefix)
                except BaseException:
                    found.cancel()
                    raise
            except (MoLoRAError, Saturated, RunnerStopped) as e:
                yield ("error", error_kind(e), str(e))
                return
            try:
                try:
                    hit = await found
                except (RunnerStopped, EngineBusy):  # the engine stopped meanwhile: its failure reaches sub
                    hit = False
                yield ("accepted", dict(sub.ids), self.name, hit)
                while sub.unfinished:
                    items = [await sub.queue.get()]
                    while not sub.queue.empty():  # outputs that piled up while the last message was in transit:
                        items.append(sub.queue.get_nowait())  # one message (Ray's per-item cost adapts to load)
                    outs = []
                    for item in items:
                        if isinstance(item, EngineFailure):
                            break
                        if item[1].finished:
                            sub.finished(item[1].request_id)
                        outs.append(item)
                    if outs:
                        yield ("outs", outs)
                    if len(outs) < len(items):
                        yield ("failure", items[len(outs)].message)
                        return
            finally:  # done, failed, or cancelled by the ingress (client gone): abort what still runs
                sub.close()
        finally:
            self.leases.end(lease)

    async def _check_resident(self, lease: BundleLease, need: frozenset[str]) -> asyncio.Future:
        """Whether `need` is all in slots, checked on the engine thread just before the call's requests are added
        (posted first, so both run in the same pause between steps): the placement record's hit."""
        engine = lease.engine
        found = asyncio.ensure_future(lease.runner.call(lambda: all_resident(engine.hotset, need)))
        await asyncio.sleep(0)  # the task runs up to its post
        return found

    async def command(self, resident: Resident, spec: BundleSpec, op: str) -> tuple:
        """("ok", result) or ("error", kind, message): op "sync" applies `spec` now (adapter POST/DELETE),
        "stats" and "list_adapters" read the engine."""
        lease = resident.lease
        try:
            self.leases.begin(lease)
        except RunnerStopped as e:
            return ("error", "stopped", str(e))
        try:
            if op == "sync":
                return ("ok", await self.sync(lease, spec))
            if op == "stats":
                return ("ok", await lease.runner.call(lease.engine.stats, timeout=10.0))
            if op == "list_adapters":
                return ("ok", await lease.runner.call(lease.engine.list_adapters, timeout=10.0))
            raise ValueError(f"unknown command {op!r}")
        except (MoLoRAError, Saturated, RunnerStopped) as e:
            return ("error", error_kind(e), str(e))
        finally:
            self.leases.end(lease)

    async def stats(self, timeout: float = 5.0) -> dict:
        """This replica's report for Ray's router (`molora.server.placement.replica_stats`): what each live
        bundle's hot set holds. A bundle whose engine does not answer within `timeout` is left out."""
        entries = {}
        for name, lease in list(self.leases.leases.items()):
            if lease.closed:
                continue
            engine = lease.engine
            try:
                entries[name] = await lease.runner.call(lambda e=engine: hotset_entry(e.hotset), timeout=timeout)
            except (MoLoRAError, RunnerStopped, EngineBusy) as e:
                log.debug("no placement report for bundle %s: %s", name, e)
        return replica_stats(entries, time.time())
