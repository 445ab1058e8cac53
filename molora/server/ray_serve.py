"""Scale-out on Ray Serve: `molora serve --ray`. The only module that imports ray (the `molora[ray]` extra).

    molora serve --ray --replicas 2 [--bundle A --bundle B] [--min-replicas 1 --max-replicas 4]

Two tiers (../docs/scaleout.md says why, with what was measured):

- **Ingress**: the same FastAPI app as `molora serve` (`build_app`), over a `RayClient` instead of the
  in-process `LocalClient`, so validation, errors, SSE, `return_routing`, API keys and metrics are one code
  path. It tokenises, checks and formats; it owns the adapter `Registry`. `--ray-ingress serve` (default) makes
  it a Serve deployment (one replica) behind Ray's HTTP proxy, which Ray restarts and places. `--ray-ingress
  process` runs it under uvicorn in the `molora serve --ray` process, calling the engine deployment through a
  handle: one Ray hop per streamed chunk instead of two, no proxy or ingress actor.
- **Engine replicas** (`--replicas N`, or autoscaled): each is one molora engine per resident bundle (one
  process, its own slot bank, KV cache and tiers) behind `@serve.multiplexed`. The multiplexed model id is the
  **bundle**, never the adapter: per-token routing may pick any adapter of the bundle at any token, so the whole
  bundle must be resident where the request runs (`model="bundle:adapter"` maps to the bundle's id too).
  Repeats of a bundle go to the replica that holds it; a bundle spills to another replica only when its
  holder is at `max_ongoing_requests` (set to the engine's admission limit, `--max-queue`).

Bundle leases (`Leases`): Ray's per-replica LRU evicts a bundle by dropping the object the loader returned,
calling its `__del__` (twice: Serve, then garbage collection) even while a stream of that bundle runs. So an
eviction only marks the lease; the engine is stopped and freed when the last sequence using it ends, a second
release is a no-op, and a request that arrives for a bundle being released gets the same engine back without a
reload.

Adapters at run time (`Registry`): POST/DELETE `/v1/adapters` change the ingress's registry, which gives the
bundle a new *version*: the bundle's adapter set (name -> folder) and which removals are forced. Every request
carries its bundle's current version; a replica whose engine is behind brings its bank up to date (loads what
is new, unloads what went: draining, or forced) before it runs the request. A POST first applies the new version
on one replica, which reads and checks the files; the version counts only if that worked (bad files are a 400
and nothing changes). So every replica serves exactly the registry's adapters from the first request it sees
after a change, replicas that Ray starts later included, which a broadcast could not promise (Serve has no
"every replica" call, and replicas come and go with autoscaling). `GET /v1/models` and `/v1/adapters` answer
from the registry: the same whichever replica would run the request. Adapter folders must be readable at the
same path on every replica's machine (one machine, or shared storage).

Saturation: the ingress's handle queues at most `max_queued_requests` (`--ray-queue`) calls beyond what the
replicas run; past that Ray raises `BackPressureError` and the client answers 429 with Retry-After. A replica
whose engine admission is full answers the same way.

Core molora never imports this module; ray is imported inside the functions that need it, so the plain parts
(registry, leases, the replica logic, the client over any handle) run and are tested without a Ray cluster.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import os
import time
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from molora.errors import AdapterDraining, AdapterNotFound, BankFullError, MoLoRAError
from molora.server.client import EngineClient, load_into
from molora.server.runner import (
    EngineBusy, EngineFailure, EngineRunner, RequestSpec, RunnerStopped, Saturated, Submission,
)

log = logging.getLogger("molora.server.ray")

ENGINE_DEPLOYMENT = "MoloraEngine"
INGRESS_DEPLOYMENT = "MoloraIngress"
APP_NAME = "molora"
INGRESS_KINDS = ("serve", "process")

# errors that cross the process boundary as (kind, message): exceptions of molora's own classes may not unpickle
_ERRORS: dict[str, type[Exception]] = {
    "saturated": Saturated, "stopped": RunnerStopped, "draining": AdapterDraining, "not_found": AdapterNotFound,
    "bank_full": BankFullError, "invalid": MoLoRAError,
}


def _error_kind(e: BaseException) -> str:
    for kind, cls in _ERRORS.items():  # most specific first: MoLoRAError comes last
        if isinstance(e, cls):
            return kind
    raise TypeError(f"not a transportable error: {e!r}")


def _raise(kind: str, message: str) -> None:
    raise _ERRORS[kind](message)


# ------------------------------------------------------------------------------------------ registry

@dataclass(frozen=True)
class BundleSpec:
    """One version of a served bundle: where it is, and the adapters it must hold.

    adapters: name -> folder (None: the bundle's own adapter, loaded with it). forced: removed adapters whose
    requests end now rather than drain. roots: the folders run-time adapters must lie under."""

    name: str
    path: str | None
    version: int = 0
    adapters: dict[str, str | None] = field(default_factory=dict)
    forced: frozenset[str] = frozenset()
    roots: tuple[str, ...] = ()


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
        return replace(s, version=s.version + 1, adapters={**s.adapters, name: path}, forced=s.forced - {name})

    def without_adapter(self, bundle: str, name: str, force: bool) -> BundleSpec:
        """The next version with `name` removed (not yet committed)."""
        s = self.specs[bundle]
        forced = s.forced | {name} if force else s.forced - {name}
        return replace(s, version=s.version + 1, adapters={k: v for k, v in s.adapters.items() if k != name},
                       forced=forced)

    def commit(self, spec: BundleSpec) -> None:
        if spec.version != self.specs[spec.name].version + 1:
            raise MoLoRAError(f"bundle {spec.name!r} changed meanwhile (version {self.specs[spec.name].version}, "
                              f"this change was made on {spec.version - 1}); retry")
        self.specs[spec.name] = spec


# ------------------------------------------------------------------------------------------ leases

class BundleLease:
    """One bundle's engine on one replica: resident while Ray holds it, alive while sequences use it."""

    def __init__(self, name: str, engine: Any, runner: EngineRunner, version: int = -1) -> None:
        self.name, self.engine, self.runner = name, engine, runner
        self.version = version         # the registry version the engine's bank matches (-1: none yet)
        self.holders = 0               # Ray's loaded objects for this bundle not yet released
        self.sequences = 0             # generate calls running on it
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
        self.close_fn = close or _close_lease
        self.leases: dict[str, BundleLease] = {}
        self.builds = 0                # engines built (a revived lease is not a build)
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


def _close_lease(lease: BundleLease) -> None:
    lease.runner.stop()
    close = getattr(lease.engine, "close", None)
    if close is not None:
        close()
    lease.engine = lease.runner = None
    gc.collect()


# ------------------------------------------------------------------------------------------ replica

class EngineReplica:
    """The engine deployment's logic without Ray: bundle leases, adapter sync, streaming outputs.

    build_engine(path) -> Engine (blocking; runs on a worker thread). The Ray deployment class wraps this."""

    def __init__(self, build_engine: Callable[[str | None], Any], *, max_in_flight: int = 256,
                 stall_s: float = 30.0, name: str = "local") -> None:
        self.build_engine, self.name = build_engine, name
        self.max_in_flight, self.stall_s = max_in_flight, stall_s
        self.specs: dict[str, BundleSpec] = {}     # the newest spec seen per bundle (the loader reads it)
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
            for name, path in spec.adapters.items():
                if name not in current:
                    if path is None:
                        raise AdapterNotFound(f"adapter {name!r} of bundle {spec.name!r} is not in its manifest")
                    await load_into(engine, runner, name, Path(path), roots)
            lease.version = spec.version
            return states

    async def generate(self, resident: Resident, spec: BundleSpec, specs: Sequence[RequestSpec],
                       prefix: str) -> AsyncIterator[tuple]:
        """Messages for the ingress: ("accepted", {request_id: index}, replica name), then ("outs", [(index,
        RequestOutput), ...]) with every output ready at that moment, ... or ("failure", message); ("error", kind,
        message) if the request never started."""
        lease = resident.lease
        try:
            self.leases.begin(lease)
        except RunnerStopped as e:
            yield ("error", "stopped", str(e))
            return
        try:
            try:
                await self.sync(lease, spec)
                sub = await lease.runner.submit(specs, prefix)
            except (MoLoRAError, Saturated, RunnerStopped) as e:
                yield ("error", _error_kind(e), str(e))
                return
            try:
                yield ("accepted", dict(sub.ids), self.name)
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
            return ("error", _error_kind(e), str(e))
        finally:
            self.leases.end(lease)


# ------------------------------------------------------------------------------------------ ingress client

class RemoteSubmission(Submission):
    """A submission whose outputs arrive as a stream of replica messages (`EngineReplica.generate`)."""

    def __init__(self, stream: Any, ids: dict[str, int], arrival: float, on_close: Callable[[], None],
                 replica: str | None = None) -> None:
        super().__init__(ids, arrival, replica)
        self.stream = stream
        self._on_close = on_close
        self._pump = asyncio.ensure_future(self._read())

    async def _read(self) -> None:
        try:
            async for message in self.stream:
                if message[0] == "outs":
                    for item in message[1]:
                        self.queue.put_nowait(item)
                elif message[0] == "failure":
                    self.queue.put_nowait(EngineFailure(message[1]))
                    return
        except asyncio.CancelledError:
            raise
        except Exception as e:  # the replica died or Ray failed: fail the choices still open
            log.warning("engine replica stream failed: %r", e)
            self.queue.put_nowait(EngineFailure(f"the engine replica failed ({type(e).__name__}: {e})"))

    def _end(self) -> None:
        """Stop reading and cancel the replica's generator (it aborts its engine requests)."""
        self._pump.cancel()
        if self.unfinished:
            _cancel(self.stream)
        self._on_close()


class RayClient(EngineClient):
    """`EngineClient` over a handle to the engine deployment (works with any object with the same calls:
    `handle.options(stream=..., multiplexed_model_id=...).generate.remote(...)` and `.command.remote(...)`)."""

    def __init__(self, handle: Any, registry: Registry, *, max_in_flight: int = 256,
                 call_timeout_s: float = 30.0, backpressure: tuple[type[BaseException], ...] = ()) -> None:
        self.handle, self.registry = handle, registry
        self.max_in_flight = max_in_flight
        self.call_timeout_s = call_timeout_s
        self.backpressure = backpressure or _backpressure_errors()
        self._in_flight = 0
        self._started = False
        self._failures = 0
        self._admin = asyncio.Lock()
        self._handles: dict[str, Any] = {}

    def start(self) -> None:
        self._started = True

    def stop(self) -> None:
        self._started = False

    @property
    def started(self) -> bool:
        return self._started

    @property
    def in_flight(self) -> int:
        return self._in_flight

    def health(self) -> dict:
        # liveness of the ingress; Ray restarts engine replicas that fail their own health checks
        return {"alive": self._started, "stalled": False, "broken": None, "last_progress_age_s": 0.0,
                "failures": self._failures}

    def _release(self, n: int) -> None:
        self._in_flight -= n

    def _streaming(self, bundle: str) -> Any:
        """The handle's streaming options for `bundle`, made once per bundle (options() builds a new handle)."""
        h = self._handles.get(bundle)
        if h is None:
            h = self._handles[bundle] = self.handle.options(stream=True, multiplexed_model_id=bundle)
        return h

    async def submit(self, specs: Sequence[RequestSpec], prefix: str, bundle: str) -> RemoteSubmission:
        spec = self.registry.spec(bundle)
        stream = self._streaming(bundle).generate.remote(spec, list(specs), prefix)
        arrival = time.perf_counter()
        try:
            first = await stream.__anext__()
        except self.backpressure as e:
            raise Saturated(f"every engine replica is full ({type(e).__name__})") from None
        except StopAsyncIteration:
            raise RunnerStopped("the engine replica ended the request without an answer") from None
        except asyncio.CancelledError:
            _cancel(stream)
            raise
        except Exception as e:
            self._failures += 1
            raise RunnerStopped(f"no engine replica could take the request ({type(e).__name__}: {e})") from e
        if first[0] == "error":
            _raise(first[1], first[2])
        self._in_flight += len(specs)
        return RemoteSubmission(stream, first[1], arrival, lambda n=len(specs): self._release(n), first[2])

    async def _command(self, bundle: str, spec: BundleSpec, op: str) -> Any:
        response = self.handle.options(multiplexed_model_id=bundle).command.remote(spec, op)
        try:
            answer = await asyncio.wait_for(response, self.call_timeout_s)
        except asyncio.TimeoutError:
            raise EngineBusy(f"no engine replica answered {op} within {self.call_timeout_s:g} s") from None
        except self.backpressure as e:
            raise Saturated(f"every engine replica is full ({type(e).__name__})") from None
        if answer[0] == "error":
            _raise(answer[1], answer[2])
        return answer[1]

    async def stats(self) -> dict:
        return {}  # one engine per bundle per replica: Ray's own metrics cover replicas (docs/scaleout.md)

    async def list_adapters(self, bundle: str) -> list[dict]:
        spec = self.registry.spec(bundle)
        return [{"name": n, "state": "ready", "source": "bundle" if p is None else "run time"}
                for n, p in spec.adapters.items()]

    async def load_adapter(self, bundle: str, name: str, path: Path, roots: Sequence[Path]) -> None:
        async with self._admin:
            spec = replace(self.registry.with_adapter(bundle, name, str(path)), roots=tuple(str(r) for r in roots))
            await self._command(bundle, spec, "sync")  # one replica reads and checks the files
            self.registry.commit(spec)

    async def unload_adapter(self, bundle: str, name: str, force: bool) -> str:
        async with self._admin:
            spec = self.registry.without_adapter(bundle, name, force)
            self.registry.commit(spec)  # from now on no request may name it, on any replica
            try:
                states = await self._command(bundle, spec, "sync")
            except (EngineBusy, Saturated, RunnerStopped):  # replicas catch up before their next request
                return "draining"
            return states.get(name, "unloaded")


def _cancel(stream: Any) -> None:
    cancel = getattr(stream, "cancel", None)
    if cancel is not None:
        cancel()


def _backpressure_errors() -> tuple[type[BaseException], ...]:
    try:
        from ray.serve.exceptions import BackPressureError
    except ImportError:  # tests without ray: a fake handle raises Saturated itself
        return (Saturated,)
    return (BackPressureError, Saturated)


# ------------------------------------------------------------------------------------------ Ray deployments

@dataclass(frozen=True)
class RayConfig:
    """What `molora serve --ray` deploys (CLI flags of the same names)."""

    bundles: tuple[str | None, ...] = (None,)      # bundle folders (None: the embedded default)
    replicas: int = 1
    min_replicas: int | None = None                # autoscaling bounds (both or neither)
    max_replicas: int | None = None
    max_queue: int = 64                            # engine requests a replica admits = max_ongoing_requests
    ray_queue: int | None = None                   # calls queued at the ingress beyond that (None: max_queue)
    bundles_per_replica: int = 2                   # Ray's max_num_models_per_replica
    threads_per_replica: int | None = None         # torch threads (None: cores / replicas)
    cpus_per_replica: float | None = None          # Ray's num_cpus (None: threads_per_replica)
    engine_config: dict = field(default_factory=dict)
    dtype: str = "float32"
    stall_s: float = 30.0
    ingress: str = "serve"                         # "serve": a Serve deployment; "process": in this process

    def __post_init__(self) -> None:
        if self.ingress not in INGRESS_KINDS:
            raise MoLoRAError(f"--ray-ingress {self.ingress!r}: use one of {', '.join(INGRESS_KINDS)}")
        if self.replicas < 1 or self.max_queue < 1 or self.bundles_per_replica < 1:
            raise MoLoRAError(f"--replicas ({self.replicas}), --max-queue ({self.max_queue}) and bundles per "
                              f"replica ({self.bundles_per_replica}) must be at least 1")
        if (self.min_replicas is None) != (self.max_replicas is None):
            raise MoLoRAError("give both --min-replicas and --max-replicas for autoscaling, or neither")
        if self.min_replicas is not None and not 0 < self.min_replicas <= self.max_replicas:
            raise MoLoRAError(f"need 0 < --min-replicas ({self.min_replicas}) <= --max-replicas "
                              f"({self.max_replicas})")
        if not self.bundles:
            raise MoLoRAError("--ray needs at least one bundle")

    @property
    def threads(self) -> int:
        if self.threads_per_replica is not None:
            return self.threads_per_replica
        return max(1, (os.cpu_count() or 1) // (self.max_replicas or self.replicas))


def bundle_specs(bundles: Sequence[str | None], roots: Sequence[str | Path] = ()) -> list[BundleSpec]:
    """Version-0 specs of the bundles: each with its manifest's adapters."""
    from molora.bundle import default_bundle_dir, read_bundle

    specs = []
    for path in bundles:
        b = read_bundle(default_bundle_dir() if path is None else path)
        specs.append(BundleSpec(b.name, None if path is None else str(Path(path).resolve()),
                                adapters={a.name: None for a in b.adapters},
                                roots=tuple(str(Path(r).resolve()) for r in roots)))
    return specs


def build_catalog(specs: Sequence[BundleSpec], *, max_model_len: int, default_max_tokens: int = 512) -> Any:
    """The ingress's `Catalog`: each bundle's tokenizer and manifest, without loading any model weights."""
    from molora.bundle import default_bundle_dir, load_tokenizer, read_bundle
    from molora.server.app import model_info
    from molora.server.generation import Catalog

    infos = []
    for s in specs:
        b = read_bundle(default_bundle_dir() if s.path is None else s.path)
        tok, config = load_tokenizer(b.base)
        infos.append(model_info(s.name, tok, b, config=config, max_model_len=max_model_len,
                                adapters=list(s.adapters), default_max_tokens=default_max_tokens))
    return Catalog(infos)


def engine_deployment(cfg: RayConfig, specs: Sequence[BundleSpec]) -> Any:
    """The engine deployment, bound (its replicas each run one engine per resident bundle)."""
    from ray import serve

    threads, dtype, stall_s = cfg.threads, cfg.dtype, cfg.stall_s
    engine_config, max_queue = dict(cfg.engine_config), cfg.max_queue
    by_name = {s.name: s for s in specs}

    def build(path: str | None) -> Any:
        from molora.engine import EngineConfig
        from molora.server.launch import build_engine

        return build_engine(path, EngineConfig(**engine_config), dtype)

    scaling: dict[str, Any] = {"num_replicas": cfg.replicas}
    if cfg.min_replicas is not None:
        scaling = {"autoscaling_config": {"min_replicas": cfg.min_replicas, "max_replicas": cfg.max_replicas,
                                          "target_ongoing_requests": max(1, max_queue // 2)}}

    @serve.deployment(name=ENGINE_DEPLOYMENT, max_ongoing_requests=max_queue,
                      max_queued_requests=cfg.ray_queue or max_queue,
                      ray_actor_options={"num_cpus": cfg.cpus_per_replica or threads}, **scaling)
    class MoloraEngine:
        def __init__(self) -> None:
            import torch

            torch.set_num_threads(threads)
            self.replica = EngineReplica(build, max_in_flight=max_queue, stall_s=stall_s,
                                         name=serve.get_replica_context().replica_id.unique_id)

        @serve.multiplexed(max_num_models_per_replica=cfg.bundles_per_replica)
        async def bundle(self, bundle_id: str) -> Resident:
            return await self.replica.load(self.replica.specs.get(bundle_id) or by_name[bundle_id])

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

        def info(self) -> dict:
            """This replica's name, engines built and leases (diagnostics; tests)."""
            leases = {n: {"holders": x.holders, "sequences": x.sequences, "version": x.version}
                      for n, x in self.replica.leases.leases.items()}
            return {"replica": self.replica.name, "builds": self.replica.leases.builds, "leases": leases}

    return MoloraEngine.bind()


def ingress_app(handle: Any, cfg: RayConfig, specs: Sequence[BundleSpec], server_kwargs: dict) -> Any:
    """The FastAPI app of `molora serve` over a `RayClient` on `handle` (the engine deployment)."""
    from molora.server.app import build_app

    catalog = build_catalog(specs, max_model_len=cfg.engine_config.get("max_model_len", 2048))
    client = RayClient(handle, Registry(specs), max_in_flight=cfg.max_queue)
    return build_app(client, catalog, **server_kwargs)


def make_app(cfg: RayConfig, specs: Sequence[BundleSpec], server_kwargs: dict) -> Any:
    """The Ray Serve application of `--ingress serve`: the ingress deployment bound to the engine deployment
    (`serve.run` it)."""
    from ray import serve

    max_queue = cfg.max_queue

    # the ingress only parses, tokenises and streams: it must take every call the engines could run or queue (Ray's
    # default of 5 ongoing requests per replica would hold the rest at the proxy, unbounded and unrefused)
    ingress_ongoing = max(1024, 2 * ((cfg.max_replicas or cfg.replicas) * max_queue + (cfg.ray_queue or max_queue)))

    @serve.deployment(name=INGRESS_DEPLOYMENT, num_replicas=1, max_ongoing_requests=ingress_ongoing,
                      ray_actor_options={"num_cpus": 0})
    @serve.ingress()
    class MoloraIngress:
        def __init__(self, engine: Any) -> None:
            self.engine = engine

        def __serve_build_asgi_app__(self) -> Any:
            return ingress_app(self.engine, cfg, specs, server_kwargs)

    return MoloraIngress.bind(engine_deployment(cfg, specs))


def serve_ray(cfg: RayConfig, *, host: str = "127.0.0.1", port: int = 8000, adapter_roots: Sequence[str] = (),
              server_kwargs: dict | None = None, block: bool = True) -> Any:
    """Start Ray (local), deploy the engine replicas and the ingress on host:port, and (block=True) serve until
    SIGTERM/Ctrl-C, then shut Serve and Ray down.

    cfg.ingress "serve": the app is a Serve deployment behind Ray's HTTP proxy; block=False returns its handle.
    cfg.ingress "process": the app runs under uvicorn in this process and calls the engine deployment through
    a handle, with no proxy (one hop per streamed chunk instead of two); block=False returns the app (serve it
    with `molora.server.launch.ServerThread`)."""
    import ray
    from ray import serve

    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    specs = bundle_specs(cfg.bundles, adapter_roots)
    if not ray.is_initialized():
        ray.init(include_dashboard=False, log_to_driver=False, configure_logging=False)
    kwargs = {"adapter_roots": list(adapter_roots), **(server_kwargs or {})}
    if cfg.ingress == "process":
        serve.start(proxy_location="Disabled")
        engine = serve.run(engine_deployment(cfg, specs), name=APP_NAME, route_prefix=None)
        app = ingress_app(engine, cfg, specs, kwargs)
        if not block:
            return app
        from molora.server.launch import run_app

        log.info("serving %s on http://%s:%d/v1 (engine replicas on Ray Serve)", [s.name for s in specs], host, port)
        try:
            run_app(app, host, port, drain_timeout_s=None)
        finally:
            shutdown()
        return None
    serve.start(http_options={"host": host, "port": port})
    handle = serve.run(make_app(cfg, specs, kwargs), name=APP_NAME, route_prefix="/")
    log.info("serving %s through Ray Serve on http://%s:%d/v1", [s.name for s in specs], host, port)
    if not block:
        return handle
    import signal
    import threading

    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    try:
        stop.wait()
    finally:
        shutdown()
    return None


def shutdown() -> None:
    """Stop Serve and this process's Ray (every replica and Ray process it started)."""
    import ray
    from ray import serve

    try:
        serve.shutdown()
    finally:
        ray.shutdown()
