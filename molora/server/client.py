"""The engine client: the one interface through which the app reaches engines, in process or remote.

    client = LocalClient(engine, max_in_flight=256)          # molora serve: one engine on a thread here
    client = molora.server.ray_serve.RayClient(handle, ...)  # molora serve --ray: engine replicas via Ray Serve

The app (routes, auth, errors, draining, metrics) and the generation endpoints (validation, SSE, routing
options) are written once against `EngineClient`; only how a request reaches an engine differs. Everything
crosses this interface as plain data: `RequestSpec`s go in (token ids, sampling parameters, routing), and a
`Submission`'s queue gives back `(choice index, RequestOutput)` pairs in order, or an `EngineFailure`.

Each call names a bundle (`ModelInfo.bundle`): the in-process client serves one; the Ray client routes by it
(the bundle is Ray's multiplexed model id, so repeats of a bundle go to the replica that holds it).

Errors a client raises, whatever the transport: `Saturated` (429: no room), `RunnerStopped` (503: no engine),
`EngineBusy` (503: the engine did not answer in time), and molora's own `MoLoRAError` family for bad
requests (unknown or draining adapters, invalid adapter files).
"""

from __future__ import annotations

import abc
import asyncio
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from molora.errors import MoLoRAError
from molora.server.runner import EngineRunner, RequestSpec, Submission


class EngineClient(abc.ABC):
    """What the app needs from its engines (module docstring)."""

    #: engine requests one API call may need at most (n x prompts); more is a 400
    max_in_flight: int
    #: seconds the app waits for commands (stats, adapters) before answering 503 engine_busy
    call_timeout_s: float = 10.0

    # ------------------------------------------------------------------------------------ lifecycle
    def attach(  # noqa: B027 (optional, a no-op by default)
        self,
        *,
        on_step: Callable[[int, float], None] | None = None,
        on_event: Callable[[str, Any], None] | None = None,
    ) -> None:
        """Hooks for the app's metrics: on_step(new tokens, step seconds) after each engine step,
        on_event(kind, value) for engine events (molora.server.runner). Clients without them ignore this."""

    @abc.abstractmethod
    def start(self) -> None:
        """Begin serving (idempotent)."""

    @abc.abstractmethod
    def stop(self) -> None:
        """Stop; requests in flight end with EngineFailure."""

    @property
    @abc.abstractmethod
    def started(self) -> bool:
        """start() was called."""

    @property
    @abc.abstractmethod
    def in_flight(self) -> int:
        """Engine requests admitted and not yet closed."""

    @abc.abstractmethod
    def health(self) -> dict:
        """{"alive", "stalled", "broken" (why or None), "last_progress_age_s", "failures"} for /health."""

    # ------------------------------------------------------------------------------------ requests
    @abc.abstractmethod
    async def submit(self, specs: Sequence[RequestSpec], prefix: str, bundle: str) -> Submission:
        """Start all of `specs` on an engine serving `bundle`, or none; see the module docstring for errors."""

    # ------------------------------------------------------------------------------------ commands
    @abc.abstractmethod
    async def stats(self) -> dict:
        """The engine's `stats()` (for /metrics); {} where there is no single engine to ask."""

    @abc.abstractmethod
    async def list_adapters(self, bundle: str) -> list[dict]:
        """[{"name", "state", ...}] of `bundle` (Engine.list_adapters)."""

    @abc.abstractmethod
    async def load_adapter(self, bundle: str, name: str, path: Path, roots: Sequence[Path]) -> None:
        """Load the PEFT folder `path` (confined to `roots`) into `bundle` as `name`."""

    @abc.abstractmethod
    async def unload_adapter(self, bundle: str, name: str, force: bool) -> str:
        """ "unloaded", or "draining" (it goes when the requests using it end); force ends them now."""

    async def add_mix(
        self, bundle: str, name: str, adapters: dict[str, float], router_expert: bool | None = None
    ) -> None:
        """Register the named mix `name` -> `adapters` in `bundle`'s engine (Engine.add_mix: a RoutingError naming the
        field for a bad one; router_expert: the router takes it as an expert). Clients whose engines cannot take it
        refuse with a MoLoRAError saying so."""
        raise MoLoRAError(f"{type(self).__name__} does not register named mixes; send the mix with each request")


class LocalClient(EngineClient):
    """One engine in this process, driven by an `EngineRunner` thread (`molora serve`)."""

    def __init__(self, engine: Any, runner: EngineRunner, *, call_timeout_s: float = 10.0) -> None:
        self.engine, self.runner = engine, runner
        self.max_in_flight = runner.max_in_flight
        self.call_timeout_s = call_timeout_s
        # loads and unloads one at a time: with --router hybrid each rebuilds the chooser from the one before
        self._adapter_changes = asyncio.Lock()

    def attach(
        self, *, on_step: Callable[[int, float], None] | None = None, on_event: Callable[[str, Any], None] | None = None
    ) -> None:
        self.runner.on_step, self.runner.on_event = on_step, on_event

    def start(self) -> None:
        self.runner.start()

    def stop(self) -> None:
        self.runner.stop()

    @property
    def started(self) -> bool:
        return self.runner.started

    @property
    def in_flight(self) -> int:
        return self.runner.in_flight

    def health(self) -> dict:
        return self.runner.health()

    async def submit(self, specs: Sequence[RequestSpec], prefix: str, bundle: str) -> Submission:
        return await self.runner.submit(specs, prefix)

    async def stats(self) -> dict:
        return await self.runner.call(self.engine.stats, timeout=self.call_timeout_s)

    async def list_adapters(self, bundle: str) -> list[dict]:
        return await self.runner.call(self.engine.list_adapters, timeout=self.call_timeout_s)

    async def load_adapter(self, bundle: str, name: str, path: Path, roots: Sequence[Path]) -> None:
        async with self._adapter_changes:
            await load_into(self.engine, self.runner, name, path, roots)

    async def unload_adapter(self, bundle: str, name: str, force: bool) -> str:
        async with self._adapter_changes:
            return await self.runner.call(lambda: self.engine.unload_adapter(name, force=force))

    async def add_mix(
        self, bundle: str, name: str, adapters: dict[str, float], router_expert: bool | None = None
    ) -> None:
        async with self._adapter_changes:  # its adapters are checked against the ones loaded now
            await self.runner.call(
                lambda: self.engine.add_mix(name, adapters, router_expert), timeout=self.call_timeout_s
            )


async def run_stages(runner: EngineRunner, stages: Any) -> Any:
    """Run a staged computation (a generator of None) on the engine thread, one stage between two engine steps;
    its result. Cancelled or failed mid-way, it is closed on the engine thread (a choice's pins go, a load rolls
    back)."""
    done, value = False, None
    try:
        while not done:
            done, value = await runner.call(lambda: _advance(stages))
        return value
    finally:
        if not done:
            await asyncio.shield(runner.call(stages.close))


def _advance(stages: Any) -> tuple[bool, Any]:
    """Run one stage of a staged computation: (False, None), or (True, its result) once it has ended."""
    try:
        next(stages)
    except StopIteration as end:
        return True, end.value
    return False, None


async def load_into(engine: Any, runner: EngineRunner, name: str, path: Path, roots: Sequence[Path]) -> None:
    """Read and check the adapter files on a worker thread (never on the engine thread or the event loop),
    then register the adapter on the engine thread (`Engine.load_adapter_stages`: with --router hybrid, the
    chooser's calibration on it follows, one forward pass between two engine steps)."""
    adapter = await asyncio.to_thread(engine.read_adapter, name, str(path), roots=roots)
    stages = await runner.call(lambda: engine.load_adapter_stages(name, adapter, roots=roots))
    await run_stages(runner, stages)
