"""Requests the per-request chooser routes (routing "hybrid"): they wait here for its pick, then run pinned to it.

A model served with `--router hybrid` carries a per-request chooser (`mm.chooser`, molora.routing.hybrid) that
reads a request's question (a chat's last user turn, a completion's prompt) and picks the one adapter the whole
request runs on, or the base model. `ChooserQueue` is the part an `Engine` owns for them: `add` takes a request
whose routing resolved to "choosing" (molora.engine.admission); `step`, called at the start of every engine step,
advances the chooser by one forward pass (molora.engine.admission.chooser_stages: the chooser's adapters pinned in
slots from its first pass to its last), so a choice pauses the running requests for one pass at a time. Requests
waiting together with the same allowed set are chosen in one call (equal questions once). When the pick is in,
each request resolves its routing again, pinned to the pick (None: the base model), and joins the scheduler's
queue; `Request.chosen` ({"adapter", "share", "z"}) goes out on its first output (RequestOutput.chosen), and one
event per call, ("chose", (the adapter picked per question, seconds)), reaches a server's metrics.

While the chooser's adapters cannot all be put in slots (a read in flight, every slot pinned), the requests wait
and it is tried again at the next step; their queue deadline still applies. A chooser that raises ends the requests
of that call alone (finish_reason "error", RequestOutput.error starting "the adapter chooser failed"; the event
("chooser_failed", (questions, message))); the engine goes on. Aborted or expired requests leave the call; a call
nobody waits for any more is closed, which unpins its adapters.

Knows the chooser, the hot set and the request's routing; nothing about KV, sampling or HTTP.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable, Generator
from typing import TYPE_CHECKING, Any

from molora.engine.admission import chooser_stages
from molora.engine.hotset import HotSet
from molora.engine.request import Request, RequestOutput
from molora.errors import BankFullError

if TYPE_CHECKING:
    from molora.model.attach import MoLoRAModel

log = logging.getLogger("molora.engine")

CHOOSER_FAILED = "the adapter chooser failed"  # how RequestOutput.error begins when the chooser raised


class ChooserQueue:
    """The requests waiting for the per-request chooser (module docstring). `admit(req, pick)` resolves a chosen
    request's routing and queues it; `end(req, reason, error)` ends one; `busy()` says whether other requests are
    running or waiting (the chooser then takes one pass per stage)."""

    def __init__(
        self,
        mm: MoLoRAModel,
        hotset: HotSet,
        *,
        admit: Callable[[Request, str | None], None],
        end: Callable[[Request, str, str | None], RequestOutput],
        busy: Callable[[], bool],
        events: deque[tuple[str, Any]],
    ) -> None:
        self.mm, self.hotset, self.admit, self.end, self.busy, self.events = mm, hotset, admit, end, busy, events
        self.waiting: list[Request] = []
        self._call: tuple[Generator[None, None, list[dict]], list[Request], list[str], float] | None = None

    def __len__(self) -> int:
        return len(self.waiting) + (len(self._call[1]) if self._call is not None else 0)

    def requests(self) -> list[Request]:
        """Every request waiting for a pick, in a call or not."""
        return [*self.waiting, *(self._call[1] if self._call is not None else [])]

    def add(self, req: Request) -> None:
        self.waiting.append(req)

    def step(self, alive: Callable[[Request], bool]) -> list[RequestOutput]:
        """One stage of the chooser between two engine steps; `alive(req)`: the request is still in flight (not
        aborted or expired). Returns the outputs of requests that ended (the chooser raised)."""
        self.waiting = [r for r in self.waiting if alive(r)]
        if self._call is None and not self._begin():
            return []
        assert self._call is not None
        stages, reqs, questions, t0 = self._call
        reqs = [r for r in reqs if alive(r)]
        if not reqs:  # nobody waits for this call any more: close it (its pins go)
            stages.close()
            self._call = None
            return []
        self._call = (stages, reqs, questions, t0)
        try:
            next(stages)
            return []
        except StopIteration as done:
            picks = done.value
        except Exception as e:
            self._call = None
            stages.close()
            why = f"{CHOOSER_FAILED} on this request ({type(e).__name__}: {e}); name an adapter as the model, or set "
            why += "the routing, to run without it"
            log.error("%s", why, exc_info=e)
            self.events.append(("chooser_failed", (len(questions), why)))
            return [self.end(r, "error", why) for r in reqs]
        self._call = None
        seconds = time.monotonic() - t0
        by_question = dict(zip(questions, picks))
        self.events.append(("chose", ([p["adapter"] for p in picks], seconds)))
        for r in reqs:
            pick = by_question[_question(r)]
            r.chosen = dict(pick)
            self.admit(r, pick["adapter"])
        return []

    def _begin(self) -> bool:
        """Start a call for the first waiting request and every other waiting one with its allowed set; False when
        there is none, or the chooser's adapters cannot be put in slots now (tried again next step)."""
        if not self.waiting:
            return False
        allowed = self.waiting[0].route.allowed
        reqs = [r for r in self.waiting if r.route.allowed == allowed]
        questions = list(dict.fromkeys(_question(r) for r in reqs))
        stages = chooser_stages(
            self.mm, self.hotset, questions, None if allowed is None else sorted(allowed), self.busy
        )
        try:
            next(stages)  # the first stage: pins its adapters (BankFullError when they are not all in slots now)
        except BankFullError as e:
            log.debug("the chooser waits for slots: %s", e)
            return False
        except StopIteration as done:  # chose in one pass: `step` finishes it now
            stages = _done(done.value)
        except Exception as e:  # a failure in its first pass: `step` reports it as any other
            stages = _raises(e)
        self.waiting = [r for r in self.waiting if r not in reqs]
        self._call = (stages, reqs, questions, time.monotonic())
        return True

    def discard(self) -> None:
        """Close the call in flight (its pins go) and forget every waiting request (after Engine.reset)."""
        if self._call is not None:
            self._call[0].close()
            self._call = None
        self.waiting.clear()


def _question(req: Request) -> str:
    assert req.question is not None, "a request waiting for the chooser has a question"
    return req.question


def _raises(error: Exception) -> Generator[None, None, list[dict]]:
    """A staged computation that raises `error` at its next stage."""
    raise error
    yield  # a generator function


def _done(value: list[dict]) -> Generator[None, None, list[dict]]:
    """A staged computation that has already ended with `value`."""
    return value
    yield  # a generator function
