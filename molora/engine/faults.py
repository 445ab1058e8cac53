"""Fault isolation of an engine step: which requests a failing step ends, and how corrupt adapter slots mend.

`FaultIsolation` is a part the `Engine` (molora.engine.engine) owns. `run(compute, scheduled)` runs a step's chunks
through `compute` (the engine's `_run`) and, when that raises, runs them again in halves until the request(s) that
make it raise are found; only those end (finish_reason "error"), the rest of the step completes as if nothing
happened (recomputing a chunk writes the same KV rows again; sampler generators are restored first). Non-finite
hidden states with non-finite adapter weights in the bank (`CorruptSlots`) make it rewrite those slots from a fresh
read of their folders (`mend`) and run the step again; an adapter that cannot be read again is zeroed and only the
requests that may use it end. `fail` ends one request on an error of its own and zeroes the KV rows only it holds.

Owns the engine's fault counters (`faults`, `failures`); knows nothing about sampling, text or HTTP.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from molora.engine.hotset import HotSet
from molora.engine.kv import BlockAllocator
from molora.engine.lifecycle import RequestLifecycle
from molora.engine.prefix import PrefixCache
from molora.engine.request import Request, RequestOutput
from molora.engine.scheduler import Scheduled
from molora.errors import AdapterError
from molora.model.batch import PagedKVCache

if TYPE_CHECKING:
    from molora.model.attach import MoLoRAModel

log = logging.getLogger("molora.engine")

Compute = Callable[[list[Scheduled]], list[RequestOutput]]


class CorruptSlots(Exception):
    """A step met non-finite adapter weights in the bank (FaultIsolation.mend)."""

    def __init__(self, names: list[str]) -> None:
        super().__init__(f"non-finite weights in the slots of {names}")
        self.names = names


class FaultIsolation:
    """The engine's fault handling (module docstring). Counters: `faults` (chunks that raised, or a request whose
    commit raised), `failures` (requests ended alone by a fault)."""

    def __init__(
        self,
        mm: MoLoRAModel,
        hotset: HotSet,
        allocator: BlockAllocator,
        prefix: PrefixCache | None,
        cache: PagedKVCache,
        lifecycle: RequestLifecycle,
        events: deque[tuple[str, Any]],
    ) -> None:
        self.mm, self.hotset, self.allocator, self.prefix, self.cache = mm, hotset, allocator, prefix, cache
        self.lifecycle, self.events = lifecycle, events
        self.faults = self.failures = 0

    def run(self, compute: Compute, scheduled: list[Scheduled], top: bool = True) -> list[RequestOutput]:
        """compute(scheduled), bisecting on an exception to end only the request(s) that raise (Engine.step)."""
        gens = {id(s.request): s.request.generator.get_state() for s in scheduled if s.request.generator is not None}
        try:
            return compute(scheduled)
        except Exception as e:
            self.faults += 1
            for s in scheduled:  # a sampled row may have drawn before the exception
                g = s.request.generator
                if g is not None and id(s.request) in gens:
                    g.set_state(gens[id(s.request)])
            error = e
        if isinstance(error, CorruptSlots):  # every row of the step is spoiled: mend the slots, run again
            lost = self.mend(error.names)
            outs, keep = [], []
            for s in scheduled:
                gone = [n for n in lost if n in s.request.needs]
                if gone:
                    outs.append(
                        self.fail(
                            s.request,
                            f"adapter {gone[0]!r} was corrupt in memory and could not be "
                            f"read again ({lost[gone[0]]}); it now adds nothing",
                        )
                    )
                else:
                    keep.append(s)
            return outs + (self.run(compute, keep, top) if keep else [])
        what = f"{type(error).__name__}: {error}"
        if top:  # one "fault" event per step that raised, however many re-runs isolate it
            self.events.append(("fault", what))
        if len(scheduled) == 1:
            req = scheduled[0].request
            log.error("request %s failed alone (isolated): %s", req.request_id, what, exc_info=error)
            return [self.fail(req, f"the engine failed on this request ({what})")]
        log.warning(
            "a step over %d chunks raised %s; running it again in halves to isolate the cause", len(scheduled), what
        )
        mid = len(scheduled) // 2
        return self.run(compute, scheduled[:mid], False) + self.run(compute, scheduled[mid:], False)

    def mend(self, names: list[str]) -> dict[str, str]:
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

    def fail(self, req: Request, why: str) -> RequestOutput:
        """End one request on an error of its own: zero its KV rows (they may hold NaN that a later owner of
        these blocks would read through masked attention), free them, report finish_reason "error"."""
        self.failures += 1
        self.events.append(("isolated", why))
        own = [b for b in req.block_table if self.allocator.refs(b) == 1]  # blocks shared with others stay
        self.allocator.forget(own)
        self.cache.clear_blocks(own)
        return self.lifecycle.end(req, "error", why)
