"""How a request ends: the stop rules on each new token, deadlines, abort, and the freeing that follows.

`RequestLifecycle` is the part of `Engine` (molora.engine.engine) that decides when a request is over and frees
what it holds: `_advance` appends a sampled token and applies the stop rules (eos and stop ids past min_tokens, stop
strings through the streaming detokenizer, max_new_tokens, max_model_len); `_expire` ends the requests past their
`timeout_s` / `queue_timeout_s` at the start of a step; `abort` cancels one from outside; `_end` is the one way out,
freeing its KV blocks and adapter pins at once (Scheduler.finish). The step loop and fault isolation call these;
they run nothing on the model.

Owns the finish reasons ("stop", "length", "timeout", "abort", "error") and the counters of generated tokens and
expired deadlines; knows nothing about KV layout, sampling or HTTP.
"""

from __future__ import annotations

from collections import Counter, deque
from typing import Any, Protocol

from molora.engine.request import Request, RequestOutput
from molora.engine.scheduler import Scheduler


class _EngineParts(Protocol):
    """What RequestLifecycle uses of the engine it is part of."""

    requests: dict[str, Request]
    scheduler: Scheduler
    _pending: list[RequestOutput]
    eos_ids: frozenset[int]
    max_model_len: int
    tokens_generated: int
    tokens_by_adapter: Counter[str]
    deadlines_expired: Counter[str]
    events: deque[tuple[str, Any]]

    def _end(self, req: Request, reason: str, error: str | None = None) -> RequestOutput: ...

    def _event(self, kind: str, value: Any) -> None: ...


class RequestLifecycle:
    """Engine's request endings (module docstring)."""

    def abort(self: _EngineParts, request_id: str, error: str | None = None) -> None:
        """Cancel a request: its KV blocks and pins are freed now; the next step reports it finished ("abort",
        with `error` as RequestOutput.error when given). Unknown or already finished ids are ignored."""
        req = self.requests.get(request_id)
        if req is not None:
            self._pending.append(self._end(req, "abort", error))

    def has_unfinished(self: _EngineParts) -> bool:
        return bool(self.requests) or bool(self._pending)

    def _end(self: _EngineParts, req: Request, reason: str, error: str | None = None) -> RequestOutput:
        """Finish `req` now with `reason` (and `error`): free its KV blocks and pins, return its last output."""
        self.requests.pop(req.request_id, None)
        req.finish_reason, req.error = reason, error
        self.scheduler.finish(req)
        return req.output([], req.text.emit(final=True), [], None)

    def _expire(self: _EngineParts, now: float) -> list[RequestOutput]:
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
            self._event("deadline", kind)
            out.append(self._end(req, "timeout", why))
        return out

    def _event(self: _EngineParts, kind: str, value: Any) -> None:
        self.events.append((kind, value))

    def _advance(
        self: _EngineParts, req: Request, token: int, adapter: str | None, lp: list[dict] | None
    ) -> RequestOutput:
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
