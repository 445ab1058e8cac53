"""The one thread that drives the engine, and the bridge from it to asyncio handlers.

Owns: the engine thread (it loops `engine.step()` while work exists and sleeps otherwise), the inbox of
commands that handlers post to it (add requests, abort, load/unload adapters, read stats: the engine is
single-threaded, so every engine call runs on this thread, between steps), admission control (at most
`max_in_flight` engine requests at once, else `Saturated`), and delivery of each step's outputs to the
per-call asyncio queue of the handler that asked for them (`loop.call_soon_threadsafe`).

Knows nothing of HTTP, JSON or tokenizers: a `RequestSpec` is token ids plus sampling parameters, and a
`Submission` hands back `(choice index, RequestOutput)` pairs in order. An engine step that raises fails
the requests in flight (each handler gets an `EngineFailure`) and the thread keeps serving.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

from molora.config import SamplingParams

log = logging.getLogger("molora.server")
T = TypeVar("T")


@dataclass(frozen=True)
class RequestSpec:
    """One engine request: choice `index` of an API call."""

    index: int
    prompt_ids: list[int]
    params: SamplingParams
    adapter: str | None = None
    allowed_adapters: list[str] | None = None
    routing: str = "auto"


@dataclass(frozen=True)
class EngineFailure:
    """Delivered instead of an output when the engine failed (or was stopped) under a request."""

    message: str


class Saturated(Exception):
    """More engine requests in flight than the server admits; retry later."""


class RunnerStopped(Exception):
    """The engine thread is not running (shut down, or never started)."""


class Submission:
    """The engine requests of one API call and the queue their outputs arrive on.

    queue items: (choice index, RequestOutput) in step order, or an `EngineFailure`. `close()` aborts what
    has not finished and frees the admission slots; call it exactly when the handler is done (idempotent).
    """

    def __init__(self, runner: EngineRunner, ids: dict[str, int], arrival: float) -> None:
        self.runner = runner
        self.loop = asyncio.get_running_loop()
        self.queue: asyncio.Queue[tuple[int, Any] | EngineFailure] = asyncio.Queue()
        self.ids = ids                        # request_id -> choice index
        self.unfinished = set(ids)
        self.arrival = arrival
        self._closed = False

    def finished(self, request_id: str) -> None:
        self.unfinished.discard(request_id)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self.unfinished:
            self.runner.abort(list(self.unfinished))
        self.runner._release(len(self.ids))


class EngineRunner:
    """Drives `engine` on a background thread; see the module docstring."""

    def __init__(self, engine: Any, *, max_in_flight: int = 256, on_step: Callable[[int, float], None] | None = None):
        if max_in_flight < 1:
            raise ValueError(f"max_in_flight={max_in_flight} must be at least 1")
        self.engine = engine
        self.max_in_flight = max_in_flight
        self.on_step = on_step                # (new tokens, step seconds): for the tokens/s gauge
        self._cv = threading.Condition()
        self._inbox: list[_Command] = []
        self._routes: dict[str, Submission] = {}   # engine-thread only: request_id -> its submission
        self._admit = threading.Lock()
        self._in_flight = 0
        self._ids = itertools.count()
        self._stopping = False
        self._thread: threading.Thread | None = None

    # ------------------------------------------------------------------------------------ lifecycle
    def start(self) -> None:
        with self._cv:
            if self._thread is not None and self._thread.is_alive():
                return
            self._stopping = False
            self._thread = threading.Thread(target=self._loop, name="molora-engine", daemon=True)
            self._thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        """Stop the thread after the commands already posted; requests still in flight get EngineFailure."""
        with self._cv:
            self._stopping = True
            self._cv.notify()
        if self._thread is not None:
            self._thread.join(timeout)

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    @property
    def in_flight(self) -> int:
        return self._in_flight

    # ------------------------------------------------------------------------------------ handler side
    async def call(self, fn: Callable[[], T]) -> T:
        """Run fn() on the engine thread between steps and return its result (or raise its error)."""
        command = _Command(fn, asyncio.get_running_loop())
        self._post(command)
        return await command.future

    async def submit(self, specs: Sequence[RequestSpec], prefix: str) -> Submission:
        """Add all of `specs` to the engine, or none (the engine's error is raised); Saturated when full."""
        self._reserve(len(specs))
        ids = {f"{prefix}-{next(self._ids)}": spec.index for spec in specs}
        sub = Submission(self, ids, time.perf_counter())
        try:
            await self.call(lambda: self._add_all(sub, specs))
        except asyncio.CancelledError:
            self.abort(list(ids))  # posted after the add, so it runs after it: nothing leaks
            self._release(len(specs))
            raise
        except BaseException:
            self._release(len(specs))
            raise
        return sub

    def abort(self, request_ids: Sequence[str]) -> None:
        """Abort requests (fire and forget): frees their KV blocks and pins on the engine thread."""
        try:
            self._post(_Command(lambda: self._abort_now(request_ids)))
        except RunnerStopped:  # no engine thread: nothing is running that could be aborted
            pass

    # ------------------------------------------------------------------------------------ admission
    def _reserve(self, n: int) -> None:
        if not self.alive:
            raise RunnerStopped("the engine thread is not running")
        with self._admit:
            if self._in_flight + n > self.max_in_flight:
                raise Saturated(f"{self._in_flight} requests in flight, the server admits {self.max_in_flight}")
            self._in_flight += n

    def _release(self, n: int) -> None:
        with self._admit:
            self._in_flight -= n
            assert self._in_flight >= 0, "released more admission slots than were reserved"

    def _post(self, command: _Command) -> None:
        with self._cv:
            if self._stopping or self._thread is None or not self._thread.is_alive():
                raise RunnerStopped("the engine thread is not running")
            self._inbox.append(command)
            self._cv.notify()

    # ------------------------------------------------------------------------------------ engine thread
    def _add_all(self, sub: Submission, specs: Sequence[RequestSpec]) -> None:
        added: list[str] = []
        try:
            for rid, spec in zip(sub.ids, specs):
                self.engine.add_request(spec.prompt_ids, spec.params, request_id=rid, adapter=spec.adapter,
                                        allowed_adapters=spec.allowed_adapters, routing=spec.routing)
                added.append(rid)
                self._routes[rid] = sub
        except BaseException:
            self._abort_now(added)
            raise

    def _abort_now(self, request_ids: Sequence[str]) -> None:
        for rid in request_ids:
            if self._routes.pop(rid, None) is not None:  # not finished yet in the engine
                try:
                    self.engine.abort(rid)
                except Exception:  # keep aborting the others; the engine logs its own state
                    log.exception("engine.abort(%r) failed", rid)

    def _loop(self) -> None:
        try:
            self._serve()
        except BaseException:  # a bug in the engine's bookkeeping: nobody may wait forever on this thread
            log.exception("the engine thread died")
        finally:
            with self._cv:
                self._stopping = True
                leftover, self._inbox = self._inbox, []
            for command in leftover:
                command.refuse()
            self._fail_all("the server is shutting down")

    def _serve(self) -> None:
        while True:
            busy = self.engine.has_unfinished()
            with self._cv:
                while not self._inbox and not busy and not self._stopping:
                    self._cv.wait()
                commands, self._inbox = self._inbox, []
                stopping = self._stopping
            for command in commands:
                command.run()
            if stopping:
                return
            if self.engine.has_unfinished():
                self._step()

    def _step(self) -> None:
        t0 = time.perf_counter()
        try:
            outputs = self.engine.step()
        except Exception as e:  # an engine bug must not take the server down: fail what was running
            log.exception("engine step failed; failing %d in-flight requests", len(self._routes))
            self._fail_all(f"the engine failed during this request ({type(e).__name__}: {e})")
            return
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[Submission, Any]]] = {}
        new_tokens = 0
        for out in outputs:
            new_tokens += len(out.new_token_ids)
            sub = self._routes.pop(out.request_id, None) if out.finished else self._routes.get(out.request_id)
            if sub is not None:
                by_loop.setdefault(sub.loop, []).append((sub, out))
        for loop, items in by_loop.items():
            _call_soon(loop, _deliver, items)
        if self.on_step is not None:
            self.on_step(new_tokens, time.perf_counter() - t0)

    def _fail_all(self, message: str) -> None:
        routes, self._routes = self._routes, {}
        failure = EngineFailure(message)
        for rid, sub in routes.items():
            try:
                self.engine.abort(rid)
            except Exception:  # the engine is already broken; the request is failed either way
                log.exception("abort of %s failed", rid)
            _call_soon(sub.loop, sub.queue.put_nowait, failure)


def _deliver(items: list[tuple[Submission, Any]]) -> None:
    for sub, out in items:
        sub.queue.put_nowait((sub.ids[out.request_id], out))


def _call_soon(loop: asyncio.AbstractEventLoop, fn: Callable[..., None], *args: Any) -> None:
    try:
        loop.call_soon_threadsafe(fn, *args)
    except RuntimeError:  # that loop is closed: its handlers are gone, nobody is waiting
        log.debug("dropped a delivery to a closed event loop")


class _Command:
    """fn to run on the engine thread; with a loop, its result or error resolves `future` on that loop."""

    def __init__(self, fn: Callable[[], Any], loop: asyncio.AbstractEventLoop | None = None) -> None:
        self.fn, self.loop = fn, loop
        self.future: asyncio.Future | None = loop.create_future() if loop is not None else None

    def run(self) -> None:
        try:
            result = self.fn()
        except Exception as e:  # handed to the awaiting handler, which raises it
            self._resolve(None, e)
        else:
            self._resolve(result, None)

    def refuse(self) -> None:
        self._resolve(None, RunnerStopped("the engine thread stopped before running this"))

    def _resolve(self, result: Any, error: BaseException | None) -> None:
        if self.loop is None:
            if error is not None:
                log.error("engine-thread command failed: %r", error)
            return
        _call_soon(self.loop, _set_future, self.future, result, error)


def _set_future(fut: asyncio.Future, result: Any, error: BaseException | None) -> None:
    if fut.done():  # the awaiting handler was cancelled
        return
    if error is not None:
        fut.set_exception(error)
    else:
        fut.set_result(result)
