"""Continuous batching: which tokens of which requests run in the next step.

Each step packs, under a token budget (`max_tokens_per_step`, vLLM's `max_num_batched_tokens`) and in this order:
  1. one decode token for every running request that is decoding,
  2. the next prefill chunk of running requests still in prefill (chunked prefill),
  3. new requests from the waiting queue (FCFS) while the budget, `max_num_seqs`, free KV blocks and
     hot-set slots allow; admission grows the block table for the first chunk and pins the adapters.
     A request whose adapters are still being read from disk (`HotSet.fetch`: the read runs on the
     hot set's loader thread) keeps its place in the queue and is passed over, so the requests behind
     it may start; a shortage of KV blocks or slots stops admission (FCFS). Only when nothing at all
     can run does `schedule` wait for a read to finish (an idle engine has nothing better to do).
     A request whose adapter cannot be read fails alone (`failed`, with `Request.error`).
Decodes always go first, so a small budget keeps the cost of a step that admits requests near that of a decode
step (their prompts spread over the next steps) instead of putting every new prompt beside the decodes at once.
With `chunked_prefill=False` (vLLM's `--no-enable-chunked-prefill`) a prompt is never split: a request waits
(FCFS) until a step has room for all its uncomputed tokens (EngineConfig checks that the budget holds
max_model_len). The tokens are the same either way: a chunk attends to the rows the earlier chunks cached.
When a running request needs a KV block and none is free, the most recently admitted request is
preempted (recompute): its blocks and pins are released and it goes back to the front of the queue with
all its tokens (prompt + generated so far) to prefill again.

Prefix cache (molora.engine.prefix, when given): admission pins the adapters first, then looks up the
cached blocks of the request's tokens; it holds them (shared, reference-counted) and starts its first
chunk after them, at the cached length; the last token is always computed. A request whose next uncached block is being
computed by a running request (`PrefixCache.behind`: requests that arrive together with one system prompt) keeps its
place and is passed over until that block is published, so the shared blocks are computed once; likewise a running
request in prefill (a probed prompt's real pass, just restarted) sits out a step while a request ahead of it computes
its next block, and takes the blocks published meanwhile (`PrefixCache.extend`). Unreferenced cached blocks count as
free (`BlockAllocator.num_free`) and are evicted when a table grows. A preempted request releases its blocks into the
cache and usually finds them there again when it is readmitted. Finished or aborted requests free their blocks and pins
at once (`finish`). A request whose prompt is being probed (`Request.probing`, a learned router's probe pass) is
prefilled like any other; its chunks are marked `probe` and sample nothing.

Slot-aware admission (`admission="slots"`; the default stays "fcfs" until a quiet run of the traffic bench
shows it wins, see below): when the first waiting request
that needs a slot cannot get one (every slot it could take is pinned by running requests), the waiting
requests behind it whose adapters are all resident need no slot, so they move ahead of it (in their order)
instead of waiting behind it; each request counts how many were moved ahead of it (`Request.bypassed`) and
once that reaches `max_bypass` nothing more moves ahead of it: a cold request waits at most that many extra
admissions. Measured against FCFS on Zipf traffic over many adapters in molora/bench/hotset.py (--adapters).

Scheduling policy (molora.engine.policy: `fcfs`, `priority`, `fair`): each step the policy orders the waiting queue
before admission (then the slot-aware rule applies, as above) and picks the victim of a preemption; the scheduler
tells it what each step computes for whom (`Policy.charge`) and when a request enters and leaves. Under fcfs the
queue is left as it stands and the victim is the request admitted last, as described above. The policy may hold one
tenant's prompt tokens back in a step (`Policy.held_back`; fair: the most-served of several tenants with prompts to
compute): its prompt chunks and admissions come after everyone else's, and take at most as many tokens as the others'
prompts took (all the budget left if they took none); its decodes run first as always.

Draining adapters (`HotSet.drain`, an unload while requests use it): when the last request in flight
(waiting or running) that needs a draining adapter leaves (`finish`, or failing to start), the scheduler
unregisters the adapter. A preempted request is still in flight and keeps the adapter registered.

Owns the waiting queue, the running list and their resources. Knows nothing about tensors, routing
decisions, sampling or text.
"""

from __future__ import annotations

import itertools
import logging
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from molora.engine.hotset import HotSet
from molora.engine.kv import BlockAllocator
from molora.engine.policy import Policy, make_policy
from molora.engine.request import Request
from molora.errors import MoLoRAError

if TYPE_CHECKING:  # molora.engine.prefix imports routing, which imports this module
    from molora.engine.prefix import PrefixCache

log = logging.getLogger("molora.engine")


READ_WAIT_S = 0.05  # longest a step waits for an adapter read when nothing else can run
ADMISSION = ("fcfs", "slots")
MAX_BYPASS = 16  # most requests slot-aware admission moves ahead of one waiting request


@dataclass
class Scheduled:
    """A request's share of one step: `n` tokens starting at token index `start` (= its num_computed);
    `probe`: a chunk of the probe pass over the prompt (molora.routing.learned: Probe); `drafted`: how many of the
    n are draft ids after its last known token (`Request.draft`, speculative decoding: molora.engine.speculative)."""

    request: Request
    start: int
    n: int
    probe: bool = False
    drafted: int = 0

    @property
    def samples(self) -> bool:
        """True if this chunk reaches the end of the known tokens, so its last position yields a new token."""
        return not self.probe and self.start + self.n - self.drafted == len(self.request.tokens)

    @property
    def decode(self) -> bool:
        """True if this chunk decodes (one known token past the prompt, with its draft rows if any), False for a
        prompt chunk (prefill, probe, or a recompute after preemption)."""
        return self.n - self.drafted == 1 and self.start >= len(self.request.prompt_ids)

    @property
    def ids(self) -> list[int]:
        """The chunk's token ids [n]: the request's known tokens, then its draft ids (a chunk of draft ids only: the
        rows a verification computes again, speculative carry "rerun")."""
        req = self.request
        if not self.drafted:
            return req.tokens[self.start : self.start + self.n]
        return (req.tokens + req.draft)[self.start : self.start + self.n]


class Scheduler:
    """Continuous batching with chunked prefill and recompute preemption (module docstring)."""

    def __init__(
        self,
        allocator: BlockAllocator,
        hotset: HotSet,
        *,
        max_num_seqs: int,
        max_tokens_per_step: int,
        prefix: PrefixCache | None = None,
        admission: str = "fcfs",
        max_bypass: int = MAX_BYPASS,
        chunked_prefill: bool = True,
        policy: str | Policy = "fcfs",
    ) -> None:
        if admission not in ADMISSION or max_bypass < 0:
            raise MoLoRAError(
                f"admission={admission!r}, max_bypass={max_bypass}: choose one of {ADMISSION} and a bypass bound >= 0"
            )
        self.allocator, self.hotset, self.prefix = allocator, hotset, prefix
        self.admission, self.max_bypass = admission, max_bypass
        self.max_num_seqs, self.max_tokens = max_num_seqs, max_tokens_per_step
        self.chunked_prefill = chunked_prefill
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.num_preemptions = 0
        self.num_seat_preemptions = 0  # of those, for a waiting tenant short of seats (policy.seat_victim)
        self.policy = make_policy(policy) if isinstance(policy, str) else policy
        self._seq = itertools.count()  # arrival order (Request.seq)
        self.failed: list[tuple[Request, str]] = []  # (request, why) that could not start; the engine reports them

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def add(self, request: Request) -> None:
        """Queue a request and start reading its cold adapters now (`HotSet.prefetch`, within the CPU tier's
        budget), so they are usually warm when it reaches the front."""
        request.seq = next(self._seq)
        self.waiting.append(request)
        self.policy.enter(request)
        self.hotset.prefetch(request.needs)

    def _prefetch_queue(self) -> None:
        """Tell the hot set what the whole queue needs, in queue order: it reads ahead within its budget and
        protects those adapters from displacement by other prefetches and from slot eviction where it can."""
        self.hotset.prefetch([n for r in self.waiting for n in r.needs], queue=True)

    # ------------------------------------------------------------------------------------ one step
    def schedule(self) -> list[Scheduled]:
        out: list[Scheduled] = []
        self._order_waiting()
        preemptions = self.num_preemptions
        self._take_seat()
        decoding = [r for r in self.running if r.remaining == 1]
        prefilling = [r for r in self.running if r.remaining > 1]
        if self.policy.name != "fcfs" and len(prefilling) > 1:  # the policy also orders who gets the step's budget
            prefilling = self.policy.order(prefilling)
        held = self.policy.held_back(itertools.chain(prefilling, self.waiting))
        deferred = [r for r in prefilling if r.tenant == held]
        computing: set = set()  # prefix keys of the blocks this step computes
        self._run(decoding + [r for r in prefilling if r.tenant != held], out, computing)
        if self.num_preemptions != preemptions:  # preempted requests went back to the front of the queue
            self._order_waiting()
        self._order_for_slots()
        reading, stopped = self._admit(out, hold=held)
        if reading and not out:  # nothing can run until an adapter read finishes: wait a little, bounded so
            self.hotset.wait_reads(READ_WAIT_S)  # that the engine thread stays responsive (commands, deadlines,
            _, stopped = self._admit(out, hold=held)  # heartbeat); the next step waits again
        if held is not None:  # the held-back tenant's prompts: after the others', at most as many tokens
            others = sum(s.n for s in out if not s.decode and s.request.tenant != held)
            if not others:  # the others took nothing this step: nothing to hold back for, the step as without
                self._run(deferred, out, computing)
                self._admit(out)
            elif (left := self._run(deferred, out, computing, others)) and not stopped:
                self._admit(out, only=held, limit=left)  # (never past a request that stopped admission)
        self._prefetch_queue()
        for s in out:
            self.policy.charge(s.request, s.n, output=s.decode)
        return out

    def _run(self, reqs: list[Request], out: list[Scheduled], computing: set, limit: int | None = None) -> int | None:
        """Give running requests their tokens for this step, in order (module docstring, 1. and 2.), at most `limit`
        tokens in all if given; what is left of `limit`."""
        spare = self.max_tokens - sum(r.remaining == 1 for r in reqs)  # for draft ids: every decode gets one first
        for req in reqs:
            budget = self.max_tokens - sum(s.n for s in out)  # a preemption may give tokens back
            if limit is not None:
                budget = min(budget, limit)
            if budget == 0:
                break
            if req not in self.running:  # preempted earlier in this loop
                continue
            if (
                self.prefix is not None
                and req.remaining > 1
                and self.prefix.extend(req)
                and self.prefix.behind(req, len(req.block_table), computing)
            ):
                continue  # a request ahead of it computes its next block in this step
            n = min(req.remaining, budget)
            drafted = 0
            if req.remaining == 1 and req.draft:  # speculative decoding: the draft ids ride along, as a small chunk
                drafted = max(0, min(len(req.draft), spare, budget - 1))
                spare -= drafted
                n += drafted
            if n < req.remaining and not self.chunked_prefill:
                continue  # its whole prompt does not fit this step: it waits for one with room
            if self._make_room(req, req.num_computed + n, out):
                out.append(Scheduled(req, req.num_computed, n, req.probing, drafted))
                if limit is not None:
                    limit -= n
                if self.prefix is not None:
                    computing.update(self.prefix.computing(req, req.num_computed + n))
        return limit

    def _order_waiting(self) -> None:
        """The waiting queue in the policy's order (fcfs: as it stands)."""
        if self.policy.name != "fcfs" and len(self.waiting) > 1:
            order = self.policy.order(self.waiting)
            self.waiting.clear()
            self.waiting.extend(order)

    def _take_seat(self) -> None:
        """Every seat taken and requests waiting (in the policy's order): the policy may preempt one running request
        so that the next waiting request gets one this step (molora.engine.policy, `seat_victim`)."""
        if len(self.running) < self.max_num_seqs or not self.waiting or self.policy.name == "fcfs":
            return
        victim = self.policy.seat_victim(self.running, self.waiting[0])
        if victim is not None:
            self.preempt(victim)
            self.num_seat_preemptions += 1

    def _admit(
        self, out: list[Scheduled], *, hold: str | None = None, only: str | None = None, limit: int | None = None
    ) -> tuple[bool, bool]:
        """Admit waiting requests into `out` (module docstring, 3.), passing over tenant `hold`'s or, given `only`,
        every other tenant's, within `limit` tokens if given. (reading, stopped): True if one was passed over because
        its adapters are still being read; True if a request stopped admission (blocks, slots, or its whole
        prompt), which the requests behind it may not pass."""
        budget = self.max_tokens - sum(s.n for s in out)
        if limit is not None:
            budget = min(budget, limit)
        reading, i = False, 0
        in_flight = self.prefix.in_flight(self.running) if self.prefix is not None and self.waiting else set()
        while i < len(self.waiting) and budget > 0 and len(self.running) < self.max_num_seqs:
            req = self.waiting[i]
            if req.tenant == hold or (only is not None and req.tenant != only):
                i += 1  # its tenant's prompts wait for the others' this step (Policy.held_back)
                continue
            n = min(req.remaining, budget)
            try:
                if not self.hotset.fetch(req.needs):
                    reading, i = True, i + 1  # its adapters are being read: it keeps its place
                    continue
                if self.prefix is None and not self._whole(req.remaining, n):
                    break  # chunked prefill off: it waits (FCFS) for a step with room for its whole prompt
                if self.prefix is None and not self.allocator.can_grow(req.block_table, n):
                    break  # FCFS: later requests wait behind this one
                if not self.hotset.acquire(req.needs):
                    break  # every slot it could take is pinned by running requests
            except MoLoRAError as e:  # an adapter cannot be read any more: fail this request only
                del self.waiting[i]
                req.error = str(e)
                self.failed.append((req, str(e)))
                self.policy.leave(req)
                self._retire(req.needs)
                continue
            hits: list[int] = []
            if self.prefix is not None:  # looked up under the pins: the adapters' versions cannot change
                hits = self.prefix.match(req)
                if self.prefix.behind(req, len(hits), in_flight):
                    self.hotset.release(req.needs)
                    i += 1  # a running request is computing its next block: it keeps its place
                    continue
                todo = len(req.tokens) - len(hits) * self.allocator.block_size
                n = min(todo, budget)
                if not self._whole(todo, n) or not self.allocator.can_grow(
                    req.block_table, len(hits) * self.allocator.block_size + n, hits
                ):
                    self.hotset.release(req.needs)
                    break
                self.allocator.share(req.block_table, hits)
                self.prefix.take(req, hits)
            req.pinned = True
            self.allocator.grow(req.block_table, req.num_computed + n)
            del self.waiting[i]
            self.running.append(req)
            out.append(Scheduled(req, req.num_computed, n, req.probing))
            budget -= n
            if self.prefix is not None:
                in_flight |= self.prefix.in_flight([req])
        else:  # the queue, the budget or the seats ran out: no request stopped admission
            return reading, False
        return reading, True

    def _whole(self, todo: int, n: int) -> bool:
        """False if chunked prefill is off and the `n` tokens that fit this step are not all `todo`."""
        return self.chunked_prefill or n >= todo

    def _order_for_slots(self) -> None:
        """Slot-aware admission (module docstring): move the warm requests behind the first slot-blocked one
        ahead of it, never past a request already bypassed `max_bypass` times."""
        if self.admission != "slots" or len(self.waiting) < 2:
            return
        hs = self.hotset
        free = hs.mm.bank.num_slots - len(hs.slot_lru)
        unpinned = {n for n in hs.slot_lru if not hs.pins[n]}

        def blocked(req: Request) -> bool:
            missing = sum(not hs.resident(n) for n in req.needs)
            return bool(missing) and missing > free + len(unpinned - set(req.needs))

        b = next((i for i, req in enumerate(self.waiting) if blocked(req)), None)  # the first request slots block
        if b is None:
            return
        ahead: list[Request] = []
        behind: list[Request] = []
        for r in itertools.islice(self.waiting, b, None):
            if all(hs.resident(n) for n in r.needs) and all(c.bypassed < self.max_bypass for c in behind):
                for c in behind:
                    c.bypassed += 1
                ahead.append(r)
            else:
                behind.append(r)
        if ahead:
            kept = list(itertools.islice(self.waiting, 0, b))
            self.waiting.clear()
            self.waiting.extend(kept + ahead + behind)

    def restart(self, req: Request) -> None:
        """req's probe pass just ended: its prompt is computed again from the start, with the probe's decisions.
        With a prefix cache the probe's blocks are published and released, and the real pass starts after the
        blocks the cache holds for it."""
        if self.prefix is None:
            req.num_computed = 0  # the probe's blocks stay in the table, rewritten by the real pass
            return
        self.prefix.publish(req)
        self.allocator.free(req.block_table)
        hits = self.prefix.match(req)
        self.allocator.share(req.block_table, hits)
        self.prefix.take(req, hits)

    def _make_room(self, req: Request, length: int, scheduled: list[Scheduled]) -> bool:
        """Grow req's table to `length` rows, preempting the newest running requests for blocks.
        False if req itself had to be preempted."""
        while not self.allocator.grow(req.block_table, length):
            victim = self.policy.victim(self.running)
            for i, s in enumerate(scheduled):
                if s.request is victim:  # it was already given tokens this step: take them back
                    del scheduled[i]
                    break
            self.preempt(victim)
            if victim is req:
                return False
        return True

    # ------------------------------------------------------------------------------------ releasing
    def preempt(self, req: Request) -> None:
        """Give back req's blocks and pins; it restarts (recompute) from the front of the queue."""
        self._release(req)
        self.running.remove(req)
        req.num_computed = 0
        self.waiting.appendleft(req)
        self.num_preemptions += 1

    def finish(self, req: Request) -> None:
        """Remove a finished or aborted request from wherever it is and free its blocks and pins; unregister
        draining adapters it was the last user of."""
        self._release(req)
        if req in self.running:
            self.running.remove(req)
            self.policy.leave(req)
        elif req in self.waiting:
            self.waiting.remove(req)
            self.policy.leave(req)
        self._retire(req.needs)

    def users(self, name: str) -> list[Request]:
        """Requests in flight (running or waiting) that may route to adapter `name`."""
        return [r for r in itertools.chain(self.running, self.waiting) if name in r.needs]

    def _retire(self, names: Iterable[str]) -> None:
        for n in dict.fromkeys(names):
            if n in self.hotset.draining and not self.users(n):
                self.hotset.unregister(n)
                log.info("adapter %r unloaded: its last request left", n)

    def _release(self, req: Request) -> None:
        self.allocator.free(req.block_table)
        if req.pinned:
            self.hotset.release(req.needs)
            req.pinned = False

    def check(self) -> None:
        """Assert that the block pool and the pins add up to exactly what the running requests hold, that every
        adapter a request in flight needs is registered, and that every draining adapter still has a user."""
        self.allocator.check(r.block_table for r in self.running)
        assert all(not r.block_table and not r.pinned for r in self.waiting)
        expected: dict[str, int] = {}
        for r in self.running:
            for n in dict.fromkeys(r.needs):
                expected[n] = expected.get(n, 0) + 1
        assert dict(self.hotset.pins) == expected, (dict(self.hotset.pins), expected)
        in_flight = list(itertools.chain(self.running, self.waiting))
        self.policy.check(in_flight)
        assert all(n in self.hotset.paths for r in in_flight for n in r.needs), "a request needs an unknown adapter"
        assert all(self.users(n) for n in self.hotset.draining), "a draining adapter without users was not unloaded"
        self.hotset.check()
