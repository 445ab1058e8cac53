"""The requests in flight and how each one ends: stop rules on each new token, deadlines, abort, and the freeing.

`RequestLifecycle` is a part the `Engine` (molora.engine.engine) owns: the table of requests in flight
(`requests`), the outputs waiting for the next step (`pending`: aborts), and the one way out of the engine
(`end`), which frees a request's KV blocks and adapter pins at once (Scheduler.finish). `advance` appends a
sampled token and applies the stop rules (eos and stop ids past min_tokens, stop strings through the streaming
detokenizer, max_new_tokens, max_model_len); `expire` ends the requests past their `timeout_s` /
`queue_timeout_s` at the start of a step; `abort` cancels one from outside. It runs nothing on the model.

Owns the finish reasons ("stop", "length", "timeout", "abort", "error") and the counters of generated tokens (in
all and per adapter) and expired deadlines; knows nothing about KV layout, sampling or HTTP.
"""

from __future__ import annotations

import logging
from collections import Counter, deque
from typing import Any

from molora.engine.request import Request, RequestOutput
from molora.engine.scheduler import Scheduler

log = logging.getLogger("molora.engine")


class RequestLifecycle:
    """The engine's requests in flight and their endings (module docstring). `events` is the engine's event queue
    (shared: a server's metrics read it); deadline expiries land there as ("deadline", "request" | "queue")."""

    def __init__(
        self, scheduler: Scheduler, eos_ids: frozenset[int], max_model_len: int, events: deque[tuple[str, Any]]
    ) -> None:
        self.scheduler, self.eos_ids, self.max_model_len, self.events = scheduler, eos_ids, max_model_len, events
        self.requests: dict[str, Request] = {}
        self.pending: list[RequestOutput] = []  # outputs of requests ended between steps (abort)
        self.tokens_generated = 0
        self.tokens_by_adapter: Counter[str] = Counter()
        self.deadlines_expired: Counter[str] = Counter()

    def admit(self, req: Request) -> None:
        """Take a new request in (its id checked unique by the caller) and queue it."""
        self.requests[req.request_id] = req
        self.scheduler.add(req)

    def abort(self, request_id: str, error: str | None = None) -> None:
        """Cancel a request: its KV blocks and pins are freed now; the next step reports it finished ("abort",
        with `error` as RequestOutput.error when given). Unknown or already finished ids are ignored."""
        req = self.requests.get(request_id)
        if req is not None:
            self.pending.append(self.end(req, "abort", error))

    def withdraw(self, request_ids: list[str]) -> None:
        """End these requests as if they had never been added: freed now, and no output reports them."""
        for rid in request_ids:
            req = self.requests.get(rid)
            if req is not None:
                self.end(req, "abort")
        gone = set(request_ids)
        self.pending = [o for o in self.pending if o.request_id not in gone]

    def has_unfinished(self) -> bool:
        return bool(self.requests) or bool(self.pending)

    def take_pending(self) -> list[RequestOutput]:
        """The outputs of requests ended between steps, handed out once."""
        out, self.pending = self.pending, []
        return out

    def end(self, req: Request, reason: str, error: str | None = None) -> RequestOutput:
        """Finish `req` now with `reason` (and `error`): free its KV blocks and pins, return its last output."""
        self.requests.pop(req.request_id, None)
        req.finish_reason, req.error = reason, error
        self.scheduler.finish(req)
        return req.output([], req.text.emit(final=True), [], None)

    def drop_refused(self) -> list[RequestOutput]:
        """End the requests the scheduler gave up on this step (Scheduler.failed: they can never be admitted) with
        finish_reason "abort" and the scheduler's reason; it already freed what they held."""
        out = []
        for req, why in self.scheduler.failed:
            log.error("request %s aborted: %s", req.request_id, why)
            self.requests.pop(req.request_id, None)
            req.finish_reason, req.error = "abort", why
            out.append(req.output([], "", [], None))
        self.scheduler.failed.clear()
        return out

    def expire(self, now: float) -> list[RequestOutput]:
        """End the requests past their deadline (add_request's timeout_s / queue_timeout_s)."""
        out = []
        for req in list(self.requests.values()):
            age = now - req.arrival
            if req.timeout_s is not None and age >= req.timeout_s:
                kind, why = "request", f"the request ran past its timeout of {req.timeout_s:g} s"
            elif req.queue_timeout_s is not None and not req.started and age >= req.queue_timeout_s:
                kind, why = (
                    "queue",
                    (
                        f"queue timeout: the request waited {age:.3g} s without starting (limit "
                        f"{req.queue_timeout_s:g} s); the server is overloaded, retry later"
                    ),
                )
            else:
                continue
            self.deadlines_expired[kind] += 1
            self.events.append(("deadline", kind))
            out.append(self.end(req, "timeout", why))
        return out

    def advance(self, req: Request, token: int, adapter: str | None, lp: list[dict] | None) -> RequestOutput:
        """Append a sampled token, apply stop rules, stream text; finish and free the request if done."""
        req.tokens.append(token)
        self.tokens_generated += 1
        self.tokens_by_adapter[adapter or "base"] += 1
        p = req.params
        reason, cut = None, False
        check = req.num_generated > p.min_tokens  # the first min_tokens tokens never stop (vLLM's min_tokens)
        if check and ((token in self.eos_ids and not p.ignore_eos) or token in p.stop_token_ids):
            reason = "stop"
        elif req.text.append(req.detok.add(token) if req.detok is not None else "", check):
            reason, cut = "stop", True
        if reason is None and (req.num_generated >= p.max_new_tokens or len(req.tokens) >= self.max_model_len):
            reason = "length"
        if reason is not None and not cut and req.detok is not None:
            if req.text.append(req.detok.flush(), check):  # bytes held back at the end may complete a stop string
                reason = "stop"
        text = req.text.emit(final=reason is not None)
        if reason is not None:
            req.finish_reason = reason
            self.scheduler.finish(req)
            del self.requests[req.request_id]
        return req.output([token], text, [adapter], lp)
