"""Fault isolation of an engine step: which requests a failing step ends, and how corrupt adapter slots mend.

`FaultIsolation` is the part of `Engine` (molora.engine.engine) that runs a step's chunks through `Engine._run`
and, when that raises, runs them again in halves until the request(s) that make it raise are found; only those
end (finish_reason "error"), the rest of the step completes as if nothing happened (recomputing a chunk writes the
same KV rows again; sampler generators are restored first). Non-finite hidden states with non-finite adapter
weights in the bank (`CorruptSlots`) make it rewrite those slots from a fresh read of their folders (`_mend`) and
run the step again; an adapter that cannot be read again is zeroed and only the requests that may use it end.
`_fail` ends one request on an error of its own and zeroes the KV rows only it holds.

Owns the engine's fault counters (`faults`, `failures`); knows nothing about sampling, text or HTTP.
"""

from __future__ import annotations

import logging
from collections import deque
from typing import TYPE_CHECKING, Any, Protocol

from molora.engine.hotset import HotSet
from molora.engine.kv import BlockAllocator
from molora.engine.prefix import PrefixCache
from molora.engine.request import Request, RequestOutput
from molora.engine.scheduler import Scheduled
from molora.errors import AdapterError

if TYPE_CHECKING:
    from molora.model.attach import MoLoRAModel
    from molora.model.runner import ModelRunner

log = logging.getLogger("molora.engine")


class CorruptSlots(Exception):
    """A step met non-finite adapter weights in the bank (FaultIsolation._mend)."""

    def __init__(self, names: list[str]) -> None:
        super().__init__(f"non-finite weights in the slots of {names}")
        self.names = names


class _EngineParts(Protocol):
    """What FaultIsolation uses of the engine it is part of."""

    mm: MoLoRAModel
    runner: ModelRunner
    hotset: HotSet
    allocator: BlockAllocator
    prefix: PrefixCache | None
    faults: int
    failures: int
    events: deque[tuple[str, Any]]

    def _run(self, scheduled: list[Scheduled]) -> list[RequestOutput]: ...

    def _end(self, req: Request, reason: str, error: str | None = None) -> RequestOutput: ...

    def _run_isolating(self, scheduled: list[Scheduled], top: bool = True) -> list[RequestOutput]: ...

    def _mend(self, names: list[str]) -> dict[str, str]: ...

    def _fail(self, req: Request, why: str) -> RequestOutput: ...


class FaultIsolation:
    """Engine's fault handling (module docstring). Counters: `faults` (chunks that raised), `failures`
    (requests ended alone by a fault)."""

    faults: int
    failures: int

    def _run_isolating(self: _EngineParts, scheduled: list[Scheduled], top: bool = True) -> list[RequestOutput]:
        """_run(scheduled), bisecting on an exception to end only the request(s) that raise (see Engine.step)."""
        gens = {id(s.request): s.request.generator.get_state() for s in scheduled if s.request.generator is not None}
        try:
            return self._run(scheduled)
        except Exception as e:
            self.faults += 1
            for s in scheduled:  # a sampled row may have drawn before the exception
                g = s.request.generator
                if g is not None and id(s.request) in gens:
                    g.set_state(gens[id(s.request)])
            error = e
        if isinstance(error, CorruptSlots):  # every row of the step is spoiled: mend the slots, run again
            lost = self._mend(error.names)
            outs, keep = [], []
            for s in scheduled:
                gone = [n for n in lost if n in s.request.needs]
                if gone:
                    outs.append(
                        self._fail(
                            s.request,
                            f"adapter {gone[0]!r} was corrupt in memory and could not be "
                            f"read again ({lost[gone[0]]}); it now adds nothing",
                        )
                    )
                else:
                    keep.append(s)
            return outs + (self._run_isolating(keep, top) if keep else [])
        what = f"{type(error).__name__}: {error}"
        if top:  # one "fault" event per step that raised, however many re-runs isolate it
            self.events.append(("fault", what))
        if len(scheduled) == 1:
            req = scheduled[0].request
            log.error("request %s failed alone (isolated): %s", req.request_id, what, exc_info=error)
            return [self._fail(req, f"the engine failed on this request ({what})")]
        log.warning(
            "a step over %d chunks raised %s; running it again in halves to isolate the cause", len(scheduled), what
        )
        mid = len(scheduled) // 2
        return self._run_isolating(scheduled[:mid], False) + self._run_isolating(scheduled[mid:], False)

    def _mend(self: _EngineParts, names: list[str]) -> dict[str, str]:
        """Rewrite the corrupt slots of `names` from a fresh read of their folders (validated, so finite).
        Returns {name: why} of those that could not be read again; their slots are zeroed (the adapter adds
        nothing) and their CPU-tier copies dropped. Either way the slot is finite afterwards."""
        lost: dict[str, str] = {}
        bank = self.mm.bank
        for name in names:
            path = self.hotset.paths.get(name)
            try:
                if path is None:
                    raise AdapterError("it was given in memory: there is no folder to read it from")
                fresh = self.mm.read(name, path, roots=self.hotset.roots.get(name))
                bank.rewrite(name, fresh)
                self.mm.adapters[name] = fresh
                log.error("adapter %r was corrupt in its slot (non-finite weights); rewrote it from %s", name, path)
                self.events.append(("repaired", name))
            except Exception as e:
                bank.rewrite(name, None)
                lost[name] = f"{type(e).__name__}: {e}"
                log.error(
                    "adapter %r was corrupt in its slot and could not be read again (%s); zeroed it", name, lost[name]
                )
            self.hotset.forget_warm(name)  # the warm copy may be what was corrupted
            self.hotset.forget_version(name)
        if self.prefix is not None:  # KV computed while the slot was corrupt must not be reused
            self.prefix.invalidate()
        return lost

    def _fail(self: _EngineParts, req: Request, why: str) -> RequestOutput:
        """End one request on an error of its own: zero its KV rows (they may hold NaN that a later owner of
        these blocks would read through masked attention), free them, report finish_reason "error"."""
        self.failures += 1
        self.events.append(("isolated", why))
        own = [b for b in req.block_table if self.allocator.refs(b) == 1]  # blocks shared with others stay
        self.allocator.forget(own)
        self.runner.cache.clear_blocks(own)
        return self._end(req, "error", why)
