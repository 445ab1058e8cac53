"""Who goes next: the order in which the scheduler tries waiting requests, and whom it preempts for KV blocks.

Three policies (EngineConfig.scheduling_policy, vLLM's `--scheduling-policy` names plus one):
  fcfs      the queue as it stands: arrival order, a preempted request back at its front. Victim: the request
            admitted last (`running[-1]`).
  priority  vLLM's: lower `Request.priority` first, then arrival (`Request.seq`). Victim: the running request with
            the highest priority value, the latest arrival among those (vLLM's choice).
  fair      S-LoRA's Virtual Token Counter (Sheng et al., "Fairness in Serving Large Language Models", OSDI'24):
            one counter per tenant of the tokens served to it, input tokens weighted `input_weight`, output tokens
            `output_weight` (1 and 2, VTC's weights). The waiting requests are tried tenant by tenant, least counter
            first (on equal counters, the tenant with fewer requests in flight), each tenant's own requests in
            arrival order; the counter a request would add (its uncomputed
            tokens at the input weight) is counted before the next pick, so one step's admissions alternate between
            tenants. A tenant that becomes active (a first request in flight) is lifted to the least counter of the
            active tenants (or, when none is active, to that of the last one to leave): idling earns no credit.
            Victim: the latest arrival of the running tenant with the largest counter. Seats: when every seat
            (max_num_seqs) is taken, the latest request of the most-served tenant holding at least two seats more
            than the next waiting request's tenant is preempted for it, if that tenant's counter is above the waiting
            tenant's (`seat_victim`; a preempted request's full KV blocks stay in the prefix cache); VTC's admission
            order alone would leave a light tenant waiting for a heavy one's requests to finish. Step share: when
            several tenants have prompt tokens to compute in a step, the most-served of them (ahead of another) gets
            prompt tokens only after the others have had theirs, and at most as many as they took (`held_back`; its
            decodes run as always): a light tenant's first token does not wait for a step filled with a heavy
            tenant's prompt chunks. When the others take none (nothing of theirs can be admitted), it gets the
            budget as before.

Every policy orders the whole queue, so it is work-conserving: what the first tenant cannot use (its requests are
being read, or need more blocks or slots than are free) the scheduler still gives to the requests after it, by the
same rules as under fcfs, and a lone tenant gets the whole engine. The scheduler's slot-aware rule
(`admission="slots"`) applies after the order: warm requests still pass a slot-blocked one.

What is charged: every token a step computes for a request (`charge`, from `Scheduler.schedule`): a prefill chunk's
tokens at the input weight (a recompute after preemption counts again: it is work the engine does for that tenant),
a decode token at the output weight; prefix-cache hits are not computed and cost nothing. What a request's routing
allows (its adapters, their slots) never enters the counter: slots are the scheduler's business.

Knows requests' tenant, priority, arrival order and token counts; nothing about KV blocks, slots or tensors.
"""

from __future__ import annotations

import heapq
from collections import Counter, deque
from collections.abc import Iterable, Sequence

from molora.engine.request import Request
from molora.errors import MoLoRAError

POLICIES = ("fcfs", "priority", "fair")
INPUT_WEIGHT, OUTPUT_WEIGHT = 1.0, 2.0  # VTC's weights (w_p = 1, w_q = 2 in the paper): a plain choice


class Policy:
    """fcfs, and the interface the scheduler calls (module docstring)."""

    name = "fcfs"

    def enter(self, req: Request) -> None:
        """`req` was queued for the first time (it is in flight until `leave`)."""

    def leave(self, req: Request) -> None:
        """`req` left the scheduler for good (finished, aborted, failed)."""

    def charge(self, req: Request, n: int, output: bool) -> None:
        """A step computes `n` tokens of `req`: a decode token (output) or a prefill chunk."""

    def order(self, waiting: Sequence[Request]) -> list[Request]:
        """The waiting requests in the order the scheduler tries them."""
        return list(waiting)

    def victim(self, running: Sequence[Request]) -> Request:
        """The running request to preempt when one needs a KV block and none is free."""
        return running[-1]

    def seat_victim(self, running: Sequence[Request], head: Request) -> Request | None:
        """Every seat is taken and `head` is the next waiting request: the running request to preempt so that it gets
        one, or None (fcfs and priority: none; it waits for a seat to free)."""
        return None

    def held_back(self, prompting: Iterable[Request]) -> str | None:
        """The tenant whose prompt tokens wait this step until the other tenants' prompts have had theirs, and then
        get at most as many (`prompting`: the requests with prompt tokens to compute, running or waiting), or None
        (fcfs and priority: none; every prompt takes the budget in queue order)."""
        return None

    def check(self, in_flight: Iterable[Request]) -> None:
        """Assert the policy's own bookkeeping agrees with the requests in flight."""


class PriorityPolicy(Policy):
    name = "priority"

    def order(self, waiting: Sequence[Request]) -> list[Request]:
        return sorted(waiting, key=lambda r: (r.priority, r.seq))

    def victim(self, running: Sequence[Request]) -> Request:
        return max(running, key=lambda r: (r.priority, r.seq))


class FairPolicy(Policy):
    """S-LoRA's Virtual Token Counter over tenants (module docstring)."""

    name = "fair"

    def __init__(self, input_weight: float = INPUT_WEIGHT, output_weight: float = OUTPUT_WEIGHT) -> None:
        if not (input_weight > 0 and output_weight > 0):
            raise MoLoRAError(f"fair share weights {input_weight}, {output_weight} must be positive")
        self.input_weight, self.output_weight = input_weight, output_weight
        self.counters: dict[str, float] = {}  # tenant -> weighted tokens served; idle tenants at or below the
        self.in_flight: Counter[str] = Counter()  # floor are forgotten (they would be lifted to it anyway)
        self.floor = 0.0  # the least counter of the active tenants, as last seen: never decreases

    def _lift_floor(self) -> float:
        active = [self.counters[t] for t in self.in_flight]
        if active:
            self.floor = max(self.floor, min(active))
        return self.floor

    def enter(self, req: Request) -> None:
        t = req.tenant
        if not self.in_flight[t]:
            self.counters[t] = max(self.counters.get(t, 0.0), self._lift_floor())
        self.in_flight[t] += 1

    def leave(self, req: Request) -> None:
        t = req.tenant
        self._lift_floor()
        self.in_flight[t] -= 1
        if self.in_flight[t] <= 0:
            del self.in_flight[t]
            if self.counters[t] <= self.floor:
                del self.counters[t]

    def charge(self, req: Request, n: int, output: bool) -> None:
        self.counters[req.tenant] += n * (self.output_weight if output else self.input_weight)

    def order(self, waiting: Sequence[Request]) -> list[Request]:
        queues: dict[str, deque[Request]] = {}
        for r in waiting:
            queues.setdefault(r.tenant, deque()).append(r)
        heap = [(self.counters[t], self.in_flight[t], q[0].seq, t) for t, q in queues.items()]
        heapq.heapify(heap)
        out: list[Request] = []
        while heap:
            counter, _, _, t = heapq.heappop(heap)
            q = queues[t]
            r = q.popleft()
            out.append(r)
            if q:  # what admitting r would add to its tenant's counter, before the next pick
                heapq.heappush(heap, (counter + self.input_weight * r.remaining, self.in_flight[t], q[0].seq, t))
        return out

    def victim(self, running: Sequence[Request]) -> Request:
        return max(running, key=lambda r: (self.counters[r.tenant], r.seq))

    def seat_victim(self, running: Sequence[Request], head: Request) -> Request | None:
        """The latest request of the most-served tenant that holds at least two seats more than `head`'s tenant
        (so it still holds as many after giving one up), if that tenant's counter is above `head`'s: a tenant is
        not kept waiting for a seat by one that has been served more and holds more seats."""
        seats = Counter(r.tenant for r in running)
        held = [r for r in running if seats[r.tenant] >= seats[head.tenant] + 2]
        if not held:
            return None
        victim = self.victim(held)
        return victim if self.counters[victim.tenant] > self.counters[head.tenant] else None

    def held_back(self, prompting: Iterable[Request]) -> str | None:
        """The most-served of the tenants with prompt tokens to compute, if it is ahead of another of them (a larger
        counter; on equal counters, more requests in flight: a tenant just lifted to a flooding tenant's counter is
        not behind it): a light tenant's prompt does not share a step with a whole budget of a heavy tenant's prompt
        chunks."""
        tenants = {r.tenant for r in prompting}
        if len(tenants) < 2:
            return None
        keys = {t: (self.counters[t], self.in_flight[t]) for t in tenants}
        heavy = max(tenants, key=keys.__getitem__)
        return heavy if keys[heavy] > min(keys.values()) else None

    def check(self, in_flight: Iterable[Request]) -> None:
        expected = Counter(r.tenant for r in in_flight)
        assert self.in_flight == expected, (dict(self.in_flight), dict(expected))
        assert all(self.counters[t] >= self.floor for t in self.in_flight), "an active tenant below the floor"


def make_policy(name: str) -> Policy:
    """The policy of that name (POLICIES); a MoLoRAError naming the choices otherwise."""
    kinds = {"fcfs": Policy, "priority": PriorityPolicy, "fair": FairPolicy}
    if name not in kinds:
        raise MoLoRAError(f"scheduling_policy={name!r}: choose one of {', '.join(POLICIES)}")
    return kinds[name]()
