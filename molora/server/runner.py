"""The one thread that drives the engine, and the bridge from it to asyncio handlers.

Owns: the engine thread (it loops `engine.step()` while work exists and sleeps otherwise), the inbox of
commands that handlers post to it (add requests, abort, load/unload adapters, read stats: the engine is
single-threaded, so every engine call runs on this thread, between steps), admission control (at most
`max_in_flight` engine requests at once, else `Saturated`), and delivery of each step's outputs to the
per-call asyncio queue of the handler that asked for them (`loop.call_soon_threadsafe`).

Knows nothing of HTTP, JSON or tokenizers: a `RequestSpec` is token ids plus sampling parameters, and a
`Submission` hands back `(choice index, RequestOutput)` pairs in order.

Faults and time:
- Heartbeat: the thread notes when it last made progress (a step or a command finished, or it went idle).
  `health()` reports it stalled when it has been busy (work pending) for more than `stall_s` without
  progress: a hung step. `call(fn, timeout=...)` gives up after `timeout` with `EngineBusy`; a command that
  had not started by then never runs (nothing changed), one that had started finishes.
- A request's own fault is isolated inside `Engine.step` (only that request ends, with finish_reason
  "error"). An exception that escapes `step()` is an engine bug: every request in flight gets an
  `EngineFailure`, the engine is reset (`Engine.reset`), and the next step waits an exponential back-off
  (`backoff_s` doubling, at most 30 s). After `max_failures` such failures in a row with no good step
  between them the runner is *broken*: new work is refused (`RunnerStopped`) and `health()` says why.
- `on_event(kind, value)` receives the engine's events (`Engine.events`: queue waits, deadline expiries,
  faults, requests failed alone) and the runner's own ("restart" when the step loop itself died and was
  restarted under the same back-off).
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
from molora.errors import MoLoRAError

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
    timeout_s: float | None = None  # engine-side deadlines (Engine.add_request)
    queue_timeout_s: float | None = None
    constraint: Any = None  # a compiled molora.sampling.Constraint (structured output) or None
    question: str | None = None  # routing "hybrid": the text the engine's per-request chooser reads
    tenant: str | None = None  # whose request it is (molora.server.tenants; the engine's fair share)
    priority: int = 0  # vLLM's priority field: lower first under --scheduling-policy priority
    mix: dict[str, float] | str | None = None  # a static mix or a named mix's name (Engine.add_request)
    scale: float | None = None  # the pinned adapter's weight (Engine.add_request)


@dataclass(frozen=True)
class EngineFailure:
    """Delivered instead of an output when the engine failed (or was stopped) under a request."""

    message: str


class Saturated(Exception):
    """More engine requests in flight than the server admits; retry later."""


class RunnerStopped(Exception):
    """The engine thread is not running (shut down, never started, or broken by repeated failures)."""


class EngineBusy(Exception):
    """The engine thread did not take up a command within its timeout (a long or hung step)."""


class Submission:
    """The engine requests of one API call and the queue their outputs arrive on.

    queue items: (choice index, RequestOutput) in step order, or an `EngineFailure`. `close()` aborts what
    has not finished and frees the admission slots; call it exactly when the handler is done (idempotent).
    How the aborting and freeing happen is the transport's (`_end`): the engine thread here
    (`RunnerSubmission`), a replica's stream in `molora.server.ray_serve`.
    """

    def __init__(self, ids: dict[str, int], arrival: float, replica: str | None = None) -> None:
        self.loop = asyncio.get_running_loop()
        self.queue: asyncio.Queue[tuple[int, Any] | EngineFailure] = asyncio.Queue()
        self.ids = ids  # request_id -> choice index
        self.unfinished = set(ids)
        self.arrival = arrival
        self.replica = replica  # which engine replica runs it (None: this process)
        self._closed = False
        self._on_close: list[Callable[[], None]] = []

    def on_close(self, fn: Callable[[], None]) -> None:
        """Call `fn` once, when the submission closes (after its requests are aborted or finished)."""
        self._on_close.append(fn)

    def finished(self, request_id: str) -> None:
        self.unfinished.discard(request_id)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            self._end()
        finally:
            for fn in self._on_close:
                fn()

    def _end(self) -> None:
        """Abort what is unfinished and free the admission slots (once, from close)."""
        raise NotImplementedError


class RunnerSubmission(Submission):
    """A submission to the engine thread of an `EngineRunner` in this process."""

    def __init__(self, runner: EngineRunner, ids: dict[str, int], arrival: float) -> None:
        super().__init__(ids, arrival)
        self.runner = runner

    def _end(self) -> None:
        if self.unfinished:
            self.runner.abort(list(self.unfinished))
        self.runner._release(len(self.ids))


class EngineRunner:
    """Drives `engine` on a background thread; see the module docstring."""

    def __init__(
        self,
        engine: Any,
        *,
        max_in_flight: int = 256,
        on_step: Callable[[int, float], None] | None = None,
        on_event: Callable[[str, Any], None] | None = None,
        stall_s: float = 30.0,
        max_failures: int = 5,
        backoff_s: float = 0.5,
    ):
        if max_in_flight < 1:
            raise ValueError(f"max_in_flight={max_in_flight} must be at least 1")
        if not stall_s > 0 or max_failures < 1 or backoff_s < 0:
            raise MoLoRAError(
                f"stall_s={stall_s} must be > 0, max_failures={max_failures} >= 1, backoff_s={backoff_s} >= 0"
            )
        self.engine = engine
        self.max_in_flight = max_in_flight
        self.on_step = on_step  # (new tokens, step seconds): for the tokens/s gauge
        self.on_event = on_event  # (kind, value): engine events and "restart" (module docstring)
        self.stall_s, self.max_failures, self.backoff_s = stall_s, max_failures, backoff_s
        self._beat = time.monotonic()  # last progress of the engine thread
        self._busy = False  # the engine thread is running commands or steps
        self.failures = 0  # step() exceptions and loop restarts since start
        self._in_a_row = 0  # ... since the last good step
        self.broken: str | None = None  # why the runner gave up (crash loop), else None
        self._cv = threading.Condition()
        self._inbox: list[_Command] = []
        self._routes: dict[str, Submission] = {}  # engine-thread only: request_id -> its submission
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
    def started(self) -> bool:
        """start() was called once (the thread may have ended since: it is never restarted from outside)."""
        return self._thread is not None

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def health(self) -> dict:
        """alive, stalled (busy for more than stall_s without progress), broken (why), seconds since the last
        progress, failures so far."""
        age = time.monotonic() - self._beat
        stalled = self.alive and self._busy and age > self.stall_s
        return {
            "alive": self.alive,
            "stalled": stalled,
            "broken": self.broken,
            "last_progress_age_s": age,
            "busy": self._busy,
            "failures": self.failures,
        }

    @property
    def healthy(self) -> bool:
        h = self.health()
        return h["alive"] and not h["stalled"] and h["broken"] is None

    @property
    def in_flight(self) -> int:
        return self._in_flight

    # ------------------------------------------------------------------------------------ handler side
    async def call(self, fn: Callable[[], T], timeout: float | None = None) -> T:
        """Run fn() on the engine thread between steps and return its result (or raise its error).

        timeout: EngineBusy if fn has not finished by then; if it had not started, it never runs."""
        command = _Command(fn, asyncio.get_running_loop())
        self._post(command)
        if timeout is None:
            return await command.future
        try:
            return await asyncio.wait_for(asyncio.shield(command.future), timeout)
        except TimeoutError:
            started = not command.cancel()
            raise EngineBusy(
                f"the engine thread did not {'finish' if started else 'take up'} this within "
                f"{timeout:g} s (a long or hung step); "
                f"{'it may still take effect' if started else 'nothing was changed'}"
            ) from None

    async def submit(self, specs: Sequence[RequestSpec], prefix: str) -> Submission:
        """Add all of `specs` to the engine, or none (the engine's error is raised); Saturated when full."""
        self._reserve(len(specs))
        ids = {f"{prefix}-{next(self._ids)}": spec.index for spec in specs}
        sub = RunnerSubmission(self, ids, time.perf_counter())
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
        if self.broken is not None:
            raise RunnerStopped(f"the engine is broken ({self.broken})")
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
                extra: dict[str, Any] = {"constraint": spec.constraint} if spec.constraint is not None else {}
                if spec.question is not None:
                    extra["question"] = spec.question
                if spec.mix is not None:
                    extra["mix"] = spec.mix
                if spec.scale is not None:
                    extra["scale"] = spec.scale
                self.engine.add_request(
                    spec.prompt_ids,
                    spec.params,
                    request_id=rid,
                    adapter=spec.adapter,
                    allowed_adapters=spec.allowed_adapters,
                    routing=spec.routing,
                    timeout_s=spec.timeout_s,
                    queue_timeout_s=spec.queue_timeout_s,
                    tenant=spec.tenant,
                    priority=spec.priority,
                    **extra,
                )
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
            while True:
                try:
                    self._serve()
                    return
                except Exception as e:  # a bug in this loop's bookkeeping: fail what runs, back off, restart
                    log.exception("the engine loop died; restarting it")
                    self._emit("restart", f"{type(e).__name__}: {e}")
                    if not self._failed(f"the engine loop died ({type(e).__name__}: {e})"):
                        return
        except BaseException:  # nobody may wait forever on this thread
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
                    self._busy = False
                    self._beat = time.monotonic()
                    self._cv.wait()
                self._busy = True
                self._beat = time.monotonic()
                commands, self._inbox = self._inbox, []
                stopping = self._stopping
            for command in commands:
                command.run()
                self._beat = time.monotonic()
            if stopping:
                return
            if self.engine.has_unfinished() and not self._step():
                return

    def _step(self) -> bool:
        """One engine step and its delivery; False when the runner has given up (broken)."""
        t0 = time.perf_counter()
        try:
            outputs = self.engine.step()
        except Exception as e:  # an engine bug must not take the server down: fail what was running
            log.exception("engine step failed; failing %d in-flight requests", len(self._routes))
            self._emit("fault", f"{type(e).__name__}: {e}")
            return self._failed(f"the engine failed during this request ({type(e).__name__}: {e})")
        self._beat = time.monotonic()
        self._in_a_row = 0
        for kind, value in _drain(self.engine):
            self._emit(kind, value)
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
        return True

    def _failed(self, message: str) -> bool:
        """After an engine failure: fail what is in flight, reset the engine, back off. False: give up."""
        self.failures += 1
        self._in_a_row += 1
        self._fail_all(message)
        try:
            self.engine.reset(message)
        except Exception as e:
            log.exception("the engine could not be reset")
            self.broken = f"the engine could not be reset after a failure ({type(e).__name__}: {e})"
            return False
        if self._in_a_row >= self.max_failures:
            self.broken = f"{self._in_a_row} engine failures in a row, the last: {message}"
            log.error("giving up on the engine: %s", self.broken)
            return False
        delay = min(self.backoff_s * 2 ** (self._in_a_row - 1), 30.0)
        with self._cv:
            self._cv.wait_for(lambda: self._stopping, timeout=delay)
        self._beat = time.monotonic()
        return not self._stopping

    def _emit(self, kind: str, value: Any) -> None:
        if self.on_event is not None:
            try:
                self.on_event(kind, value)
            except Exception:  # metrics must never stop the engine
                log.exception("on_event(%r) failed", kind)

    def _fail_all(self, message: str) -> None:
        routes, self._routes = self._routes, {}
        failure = EngineFailure(message)
        for rid, sub in routes.items():
            try:
                self.engine.abort(rid)
            except Exception:  # the engine is already broken; the request is failed either way
                log.exception("abort of %s failed", rid)
            _call_soon(sub.loop, sub.queue.put_nowait, failure)


def _drain(engine: Any) -> list[tuple[str, Any]]:
    events = getattr(engine, "events", None)
    out = []
    while events:
        out.append(events.popleft())
    return out


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
        self._lock = threading.Lock()
        self._state = "pending"  # -> "running" (engine thread) or "cancelled" (caller timed out)

    def cancel(self) -> bool:
        """True if the command had not started: it will never run. False: it is running or done."""
        with self._lock:
            if self._state == "pending":
                self._state = "cancelled"
                return True
            return False

    def run(self) -> None:
        with self._lock:
            if self._state == "cancelled":
                return
            self._state = "running"
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
