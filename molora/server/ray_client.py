"""`RayClient`: the ingress's `EngineClient` over a handle to the engine deployment (any object with the
handle's calls, so it is tested without Ray); `RemoteSubmission` streams a replica's outputs back."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

from molora.server.client import EngineClient
from molora.server.ray_state import BundleSpec, Registry, raise_error
from molora.server.runner import (
    EngineBusy,
    EngineFailure,
    RequestSpec,
    RunnerStopped,
    Saturated,
    Submission,
)

log = logging.getLogger("molora.server.ray")


# ------------------------------------------------------------------------------------------ ingress client


class RemoteSubmission(Submission):
    """A submission whose outputs arrive as a stream of replica messages (`EngineReplica.generate`)."""

    def __init__(
        self, stream: Any, ids: dict[str, int], arrival: float, on_close: Callable[[], None], replica: str | None = None
    ) -> None:
        super().__init__(ids, arrival, replica)
        self.stream = stream
        self._release = on_close  # frees the replica lease (the base class keeps its on_close list)
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
        self._release()


class RayClient(EngineClient):
    """`EngineClient` over a handle to the engine deployment (works with any object with the same calls:
    `handle.options(stream=..., multiplexed_model_id=...).generate.remote(...)` and `.command.remote(...)`)."""

    def __init__(
        self,
        handle: Any,
        registry: Registry,
        *,
        max_in_flight: int = 256,
        call_timeout_s: float = 30.0,
        backpressure: tuple[type[BaseException], ...] = (),
    ) -> None:
        self.handle, self.registry = handle, registry
        self.max_in_flight = max_in_flight
        self.call_timeout_s = call_timeout_s
        self.backpressure = backpressure or _backpressure_errors()
        self._in_flight = 0
        self._started = False
        self._failures = 0
        self._admin = asyncio.Lock()
        self._handles: dict[str, Any] = {}
        # placement record: replica -> [calls accepted, calls whose adapters were all in a slot on arrival]
        self.placements: dict[str, list[int]] = {}

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
        return {
            "alive": self._started,
            "stalled": False,
            "broken": None,
            "last_progress_age_s": 0.0,
            "failures": self._failures,
        }

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
            raise_error(first[1], first[2])
        self._in_flight += len(specs)
        placed = self.placements.setdefault(first[2], [0, 0])
        placed[0] += 1
        placed[1] += bool(first[3])
        return RemoteSubmission(stream, first[1], arrival, lambda n=len(specs): self._release(n), first[2])

    async def _command(self, bundle: str, spec: BundleSpec, op: str) -> Any:
        response = self.handle.options(multiplexed_model_id=bundle).command.remote(spec, op)
        try:
            answer = await asyncio.wait_for(response, self.call_timeout_s)
        except TimeoutError:
            raise EngineBusy(f"no engine replica answered {op} within {self.call_timeout_s:g} s") from None
        except self.backpressure as e:
            raise Saturated(f"every engine replica is full ({type(e).__name__})") from None
        if answer[0] == "error":
            raise_error(answer[1], answer[2])
        return answer[1]

    async def stats(self) -> dict:
        return {}  # one engine per bundle per replica: Ray's own metrics cover replicas (docs/scaleout.md)

    async def list_adapters(self, bundle: str) -> list[dict]:
        spec = self.registry.spec(bundle)
        return [
            {"name": n, "state": "ready", "source": "bundle" if p is None else "run time"}
            for n, p in spec.adapters.items()
        ]

    async def load_adapter(self, bundle: str, name: str, path: Path, roots: Sequence[Path]) -> None:
        async with self._admin:
            spec = replace(self.registry.with_adapter(bundle, name, str(path)), roots=tuple(str(r) for r in roots))
            await self._command(bundle, spec, "sync")  # one replica reads and checks the files
            self.registry.commit(spec)

    async def add_mix(
        self, bundle: str, name: str, adapters: dict[str, float], router_expert: bool | None = None
    ) -> None:
        """A new bundle version with the mix (Registry.with_mix): one replica registers and checks it now, the others
        before their next request (EngineReplica.sync), as a run-time adapter reaches them."""
        async with self._admin:
            spec = self.registry.with_mix(bundle, name, adapters, router_expert)
            await self._command(bundle, spec, "sync")
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
