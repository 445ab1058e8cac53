"""Scheduling policies (molora.engine.policy): the order of admission under fcfs, priority and fair; the fair
share between a flooding and a light tenant; idling earns no credit; work conservation; preemption victims; and no
starvation in a seeded randomized run of tenants joining and leaving on a simulated clock (the engine's own
scheduler and request lifecycle, the model's forward replaced by bookkeeping)."""

from __future__ import annotations

import random

import pytest

import molora
from molora.config import LLAMA_PROJECTIONS, SamplingParams
from molora.engine import Engine, EngineConfig
from molora.engine.policy import INPUT_WEIGHT, OUTPUT_WEIGHT, FairPolicy, PriorityPolicy, make_policy
from molora.engine.request import Request
from molora.errors import MoLoRAError
from tests.conftest import VOCAB, make_peft_adapter, tiny_model

ARCH = "qwen3"
NEW = 4


@pytest.fixture(scope="module")
def paths(tmp_path_factory):
    root = tmp_path_factory.mktemp("adapters")
    return {n: make_peft_adapter(root / n, ARCH, seed=i, r=4, targets=("q_proj", "v_proj")) for i, n in enumerate("ab")}


def _engine(paths, policy: str, **kw) -> Engine:
    mm = molora.attach(tiny_model(ARCH), dict(paths), target_modules=LLAMA_PROJECTIONS)
    cfg = dict(max_num_seqs=1, max_tokens_per_step=64, block_size=4, kv_budget_tokens=1024, max_model_len=128)
    cfg.update(kw)
    return Engine(mm, EngineConfig(stop_at_eos=False, scheduling_policy=policy, enable_prefix_caching=False, **cfg))


def _prompt(n: int, rng: random.Random) -> list[int]:
    return [rng.randrange(3, VOCAB) for _ in range(n)]


def _start_order(engine: Engine) -> list[str]:
    """Run the engine dry; the ids in the order they produced their first token."""
    order: list[str] = []
    while engine.has_unfinished():
        for out in engine.step():
            if out.request_id not in order:
                order.append(out.request_id)
        engine.check()
    return order


# ------------------------------------------------------------------------------------------ admission order


def test_fcfs_admits_in_arrival_order_and_priority_by_value_then_arrival(paths):
    rng = random.Random(1)
    prios = [3, 0, 3, -1, 0]
    runs = {}
    for policy in ("fcfs", "priority"):
        engine = _engine(paths, policy)
        for i, p in enumerate(prios):
            p = p if policy == "priority" else 0
            engine.add_request(_prompt(6, rng), SamplingParams(max_new_tokens=NEW), request_id=f"r{i}", priority=p)
        runs[policy] = _start_order(engine)
    assert runs["fcfs"] == ["r0", "r1", "r2", "r3", "r4"]
    assert runs["priority"] == ["r3", "r1", "r4", "r0", "r2"]


def test_fair_alternates_between_a_flooding_and_a_light_tenant(paths):
    rng = random.Random(2)
    orders = {}
    for policy in ("fcfs", "fair"):
        engine = _engine(paths, policy)
        for i in range(6):
            engine.add_request(_prompt(8, rng), SamplingParams(max_new_tokens=NEW), request_id=f"A{i}", tenant="A")
        for i in range(2):
            engine.add_request(_prompt(8, rng), SamplingParams(max_new_tokens=NEW), request_id=f"B{i}", tenant="B")
        orders[policy] = _start_order(engine)
    assert orders["fcfs"] == ["A0", "A1", "A2", "A3", "A4", "A5", "B0", "B1"]
    # equal counters: the tenant with fewer requests in flight first (B0), then A0 (B has been served), B1, the rest
    assert orders["fair"] == ["B0", "A0", "B1", "A1", "A2", "A3", "A4", "A5"]


def test_tenant_defaults_to_the_pinned_adapter(paths):
    engine = _engine(paths, "fair")
    rng = random.Random(3)
    engine.add_request(_prompt(5, rng), SamplingParams(max_new_tokens=NEW), request_id="x", adapter="a")
    engine.add_request(_prompt(5, rng), SamplingParams(max_new_tokens=NEW), request_id="y")
    assert engine.requests["x"].tenant == "a" and engine.requests["y"].tenant == "default"
    assert engine.scheduler.policy.in_flight == {"a": 1, "default": 1}


def test_counters_stay_within_one_request_of_each_other_while_both_tenants_wait(paths):
    """VTC's bound: while two tenants are backlogged, their counters differ by at most what the in-flight requests
    may add (here max_num_seqs requests of the largest cost); fcfs serves the later tenant nothing meanwhile."""
    rng = random.Random(4)
    seqs, plen = 2, 12
    cost = INPUT_WEIGHT * plen + OUTPUT_WEIGHT * NEW
    for policy in ("fcfs", "fair"):
        engine = _engine(paths, policy, max_num_seqs=seqs)
        for t in "AB":
            for i in range(30):
                engine.add_request(
                    _prompt(plen, rng), SamplingParams(max_new_tokens=NEW), request_id=f"{t}{i}", tenant=t
                )
        served = {"A": 0, "B": 0}
        for _ in range(20):  # both stay backlogged for these steps
            for out in engine.step():
                served[out.request_id[0]] += len(out.new_token_ids)
            waiting = {r.tenant for r in engine.scheduler.waiting}
            assert waiting == {"A", "B"}
            if policy == "fair":
                c = engine.scheduler.policy.counters
                assert abs(c["A"] - c["B"]) <= seqs * cost, c
        if policy == "fcfs":
            assert served["B"] == 0 and served["A"] > 0
        else:
            assert served["B"] > 0 and abs(served["A"] - served["B"]) <= seqs * NEW


def test_idling_earns_no_credit(paths):
    """B arrives after A was served alone for a while: B starts at A's counter, so A is not shut out."""
    rng = random.Random(5)
    engine = _engine(paths, "fair")
    for i in range(3):
        engine.add_request(_prompt(8, rng), SamplingParams(max_new_tokens=NEW), request_id=f"A{i}", tenant="A")
    while len(engine.requests) > 1:
        engine.step()
    policy = engine.scheduler.policy
    assert isinstance(policy, FairPolicy)
    a = policy.counters["A"]
    assert a > 3 * 8  # A0, A1 served (and A2 started)
    for i in range(3, 6):
        engine.add_request(_prompt(8, rng), SamplingParams(max_new_tokens=NEW), request_id=f"A{i}", tenant="A")
    for i in range(3):
        engine.add_request(_prompt(8, rng), SamplingParams(max_new_tokens=NEW), request_id=f"B{i}", tenant="B")
    assert policy.counters["B"] == policy.floor == a
    order = _start_order(engine)
    # B starts at A's counter with fewer requests in flight, so it goes first on the tie; then the two alternate:
    # B is not owed the tokens A was served alone
    assert order == ["B0", "A2", "B1", "A3", "B2", "A4", "A5"], order


def test_a_lone_tenant_gets_the_whole_engine(paths):
    """Work conservation: one tenant with a counter far above an idle one's still fills every seat at once."""
    rng = random.Random(6)
    engine = _engine(paths, "fair", max_num_seqs=4)
    engine.add_request(_prompt(8, rng), SamplingParams(max_new_tokens=NEW), request_id="B0", tenant="B")
    _start_order(engine)
    for i in range(4):
        engine.add_request(_prompt(8, rng), SamplingParams(max_new_tokens=NEW), request_id=f"A{i}", tenant="A")
    engine.scheduler.policy.counters["A"] += 10_000
    engine.step()
    assert len(engine.scheduler.running) == 4 and not engine.scheduler.waiting


def test_bad_policy_and_priority_are_refused(paths):
    with pytest.raises(MoLoRAError, match="scheduling_policy='lottery'.*fcfs, priority, fair"):
        EngineConfig(scheduling_policy="lottery")
    with pytest.raises(MoLoRAError, match="scheduling_policy"):
        make_policy("lottery")
    engine = _engine(paths, "priority")
    with pytest.raises(MoLoRAError, match="priority='high' must be an integer"):
        engine.add_request([5, 6], SamplingParams(), priority="high")  # type: ignore[arg-type]
    with pytest.raises(MoLoRAError, match="tenant=''"):
        engine.add_request([5, 6], SamplingParams(), tenant="")
    with pytest.raises(MoLoRAError, match="priority=2 needs the priority scheduling policy.*runs 'fair'"):
        _engine(paths, "fair").add_request([5, 6], SamplingParams(), priority=2)
    assert not engine.requests and not engine.scheduler.waiting


# ------------------------------------------------------------------------------------------ preemption victims


def _bare(rid: str, tenant: str, priority: int, seq: int) -> Request:
    r = Request(rid, [3, 4, 5], SamplingParams(), route=None)
    r.tenant, r.priority, r.seq = tenant, priority, seq
    return r


def test_victims_are_the_latest_lowest_priority_and_the_latest_of_the_most_served_tenant():
    reqs = [_bare("a", "A", 0, 0), _bare("b", "B", 5, 1), _bare("c", "A", 5, 2), _bare("d", "B", 0, 3)]
    assert PriorityPolicy().victim(reqs).request_id == "c"
    fair = FairPolicy()
    for r in reqs:
        fair.enter(r)
    fair.charge(reqs[1], 10, output=True)  # B: 20
    fair.charge(reqs[0], 15, output=False)  # A: 15
    assert fair.victim(reqs).request_id == "d"
    fair.check(reqs)
    for r in reqs:
        fair.leave(r)
    # the floor is the counter of the last tenant to leave; idle counters at or below it are forgotten
    assert not fair.in_flight and fair.floor == 20 and not fair.counters


def test_preemption_under_priority_takes_the_lowest_priority_running_request(paths):
    """KV for 3 sequences of 8+20 tokens at most: the lowest-priority request is the one sent back to the queue."""
    rng = random.Random(7)
    engine = _engine(paths, "priority", max_num_seqs=3, kv_budget_tokens=128, max_model_len=64)
    for rid, p in (("hi", 0), ("lo", 9), ("mid", 1)):
        engine.add_request(_prompt(24, rng), SamplingParams(max_new_tokens=20), request_id=rid, priority=p)
    preempted: list[str] = []
    done: set[str] = set()
    while engine.has_unfinished():
        running = {r.request_id for r in engine.scheduler.running}
        n = engine.scheduler.num_preemptions
        done |= {o.request_id for o in engine.step() if o.finished}
        if engine.scheduler.num_preemptions > n:
            preempted += sorted(running - {r.request_id for r in engine.scheduler.running} - done)
        engine.check()
    assert preempted and preempted[0] == "lo", preempted
    assert done == {"hi", "lo", "mid"}


# ------------------------------------------------------------------------------------------ no starvation


def _simulate(paths, policy: str, seconds: float, seed: int) -> dict[str, float]:
    """A seeded workload on a simulated clock: tenants join and leave; while joined, each sends short requests at
    its own rate, and some send a flood (many long requests at once). One step takes 20 ms + 0.5 ms per token (the
    clock advances by that, no wall clock); the model's forward is replaced by bookkeeping, everything else is the
    engine's scheduler and lifecycle. Returns, per request kind, the longest time from arrival to finish."""
    rng = random.Random(seed)
    engine = _engine(paths, policy, max_num_seqs=8, max_tokens_per_step=64, kv_budget_tokens=512)
    tenants = [f"t{i}" for i in range(8)]
    joined: dict[str, float] = {}  # tenant -> when it leaves
    arrivals: dict[str, tuple[float, str]] = {}
    worst = {"steady": 0.0, "flood": 0.0}
    clock, nxt, ids = 0.0, 0.0, 0

    def send(tenant: str, kind: str, plen: int, new: int) -> None:
        nonlocal ids
        rid = f"{kind}-{ids}"
        ids += 1
        engine.add_request(_prompt(plen, rng), SamplingParams(max_new_tokens=new), request_id=rid, tenant=tenant)
        arrivals[rid] = (clock, kind)

    while clock < seconds or engine.has_unfinished():
        while clock < seconds and nxt <= clock:  # once a simulated second: tenants join, leave, send
            for t in tenants:
                if t in joined and joined[t] <= clock:
                    del joined[t]
                elif t not in joined and rng.random() < 0.02:
                    joined[t] = clock + rng.uniform(10, 120)
                    if rng.random() < 0.3:
                        for _ in range(rng.randrange(20, 60)):
                            send(t, "flood", rng.randrange(40, 64), rng.randrange(16, 48))
            for t in joined:
                for _ in range(rng.randrange(0, 7)):
                    send(t, "steady", rng.randrange(4, 16), rng.randrange(4, 16))
            nxt += 1.0
        scheduled = engine.scheduler.schedule()
        tokens = sum(s.n for s in scheduled)
        clock += 0.02 + 0.0005 * tokens if scheduled else max(nxt - clock, 0.02)
        for s in scheduled:
            req = s.request
            req.started, req.num_computed = True, s.start + s.n
            if s.samples:
                out = engine.lifecycle.advance(req, rng.randrange(3, VOCAB), None, None)
                if out.finished:
                    t0, kind = arrivals.pop(req.request_id)
                    worst[kind] = max(worst[kind], clock - t0)
        assert not engine.scheduler.failed
        engine.scheduler.check()
    assert not arrivals and not engine.requests
    return worst


@pytest.mark.parametrize("policy", ["fair", "fcfs"])
def test_no_request_starves_with_tenants_joining_and_leaving(paths, policy):
    worst = _simulate(paths, policy, seconds=300, seed=11)
    assert worst["steady"] <= 60 and worst["flood"] <= 60, worst


@pytest.mark.slow
def test_no_request_starves_in_thirty_simulated_minutes(paths):
    worst = _simulate(paths, "fair", seconds=1800, seed=12)
    assert worst["steady"] <= 60 and worst["flood"] <= 60, worst


@pytest.mark.parametrize("admission", ["slots", "fcfs"])
def test_fair_share_composes_with_slot_aware_admission(paths, admission):
    """One slot, pinned by a long request on "a": tenant C (first in the fair order) asks for cold "b" and cannot
    start; with admission "slots" tenant W's warm requests on "a" pass it, with "fcfs" they wait behind it."""
    rng = random.Random(8)
    mm = molora.attach(tiny_model(ARCH), {"a": paths["a"]}, slots=1, target_modules=LLAMA_PROJECTIONS)
    cfg = EngineConfig(
        max_num_seqs=4,
        max_tokens_per_step=64,
        block_size=4,
        kv_budget_tokens=1024,
        max_model_len=128,
        stop_at_eos=False,
        scheduling_policy="fair",
        admission=admission,
        cpu_tier_bytes=1 << 24,
    )
    engine = Engine(mm, cfg)
    engine.load_adapter("b", str(paths["b"]))
    engine.add_request(_prompt(6, rng), SamplingParams(max_new_tokens=10), request_id="long", adapter="a", tenant="L")
    engine.step()
    engine.add_request(_prompt(6, rng), SamplingParams(max_new_tokens=NEW), request_id="cold", adapter="b", tenant="C")
    for i in range(2):
        engine.add_request(
            _prompt(6, rng), SamplingParams(max_new_tokens=NEW), request_id=f"w{i}", adapter="a", tenant="W"
        )
    order = _start_order(engine)
    assert order == (["long", "w0", "w1", "cold"] if admission == "slots" else ["long", "cold", "w0", "w1"])


def test_fair_gives_a_waiting_tenant_without_a_seat_one_from_the_most_served_tenant(paths):
    """Every seat held by tenant A: under fair, B's new request takes a seat from A once A is ahead of it (A's latest
    request is preempted and recomputed, with the same tokens); under fcfs B waits for one of A's to finish; a tenant
    holding a single seat is never preempted for another."""
    rng = random.Random(9)
    prompts = [_prompt(8, rng) for _ in range(3)]
    runs = {}
    for policy in ("fcfs", "fair"):
        engine = _engine(paths, policy, max_num_seqs=2)
        for i in range(2):
            engine.add_request(prompts[i], SamplingParams(max_new_tokens=12), request_id=f"A{i}", tenant="A")
        tokens: dict[str, list[int]] = {}
        for _ in range(3):  # both of A's requests are decoding
            for out in engine.step():
                tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
        engine.add_request(prompts[2], SamplingParams(max_new_tokens=4), request_id="B0", tenant="B")
        steps_to_b = 0
        while "B0" not in tokens:
            steps_to_b += 1
            for out in engine.step():
                tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
        while engine.has_unfinished():
            for out in engine.step():
                tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
            engine.check()
        runs[policy] = (steps_to_b, engine.stats()["num_seat_preemptions"], tokens)
    # B becomes active at A's counter (no idle credit): a tie for one step, then A has been served more
    assert runs["fair"][:2] == (2, 1)
    assert runs["fcfs"][0] > 1 and runs["fcfs"][1] == 0
    assert runs["fair"][2] == runs["fcfs"][2]  # the preempted request's recompute changed no token

    lone = _engine(paths, "fair", max_num_seqs=1)
    lone.add_request(prompts[0], SamplingParams(max_new_tokens=12), request_id="A0", tenant="A")
    for _ in range(3):
        lone.step()
    lone.add_request(prompts[2], SamplingParams(max_new_tokens=4), request_id="B0", tenant="B")
    while lone.has_unfinished():
        lone.step()
    assert lone.stats()["num_seat_preemptions"] == 0


def test_fair_gives_a_tenant_holding_one_seat_another_from_a_tenant_holding_three(paths):
    """Four seats: B holds one, A (more served) three. B's next request takes one of A's seats (A keeps two, as many
    as B then holds); with A holding only two, B's next request waits for a seat instead."""
    rng = random.Random(10)
    for a_seats, preempted in ((3, 1), (2, 0)):
        engine = _engine(paths, "fair", max_num_seqs=a_seats + 1)
        engine.add_request(_prompt(8, rng), SamplingParams(max_new_tokens=40), request_id="B0", tenant="B")
        for i in range(a_seats):
            engine.add_request(_prompt(8, rng), SamplingParams(max_new_tokens=40), request_id=f"A{i}", tenant="A")
        for _ in range(6):  # every seat decoding; A has been served more than B
            engine.step()
        engine.add_request(_prompt(8, rng), SamplingParams(max_new_tokens=4), request_id="B1", tenant="B")
        started = None
        for k in range(8):
            if any(o.request_id == "B1" and o.new_token_ids for o in engine.step()):
                started = k
                break
        assert engine.stats()["num_seat_preemptions"] == preempted, a_seats
        assert (started is not None) == bool(preempted), (a_seats, started)
        while engine.has_unfinished():
            engine.step()
        engine.check()


def _recording(engine: Engine) -> list[list[tuple[str, int, bool]]]:
    """Record every step's chunks as (request id, tokens, decode) through the engine's own scheduler."""
    steps: list[list[tuple[str, int, bool]]] = []
    schedule = engine.scheduler.schedule

    def recorded():
        out = schedule()
        steps.append([(s.request.request_id, s.n, s.decode) for s in out])
        return out

    engine.scheduler.schedule = recorded
    return steps


def test_fair_holds_a_flooding_tenants_prompt_chunks_back_for_a_light_tenants_prompt(paths):
    """A's two long prompts are being prefilled when B's short request arrives: under fair the step that computes B's
    prompt gives A's prompt chunks no more tokens than B's, so B's first token comes the step after it arrives; under
    fcfs A's chunks fill the budget and B waits for them. The same tokens either way, and a lone tenant (or one
    tenant with no one lighter) keeps the whole budget."""
    rng = random.Random(11)
    prompts = [_prompt(60, rng) for _ in range(2)] + [_prompt(6, rng)]
    runs = {}
    for policy in ("fcfs", "fair"):
        engine = _engine(paths, policy, max_num_seqs=4, max_tokens_per_step=16)
        steps = _recording(engine)
        for i in range(2):
            engine.add_request(prompts[i], SamplingParams(max_new_tokens=NEW), request_id=f"A{i}", tenant="A")
        engine.step()
        engine.add_request(prompts[2], SamplingParams(max_new_tokens=NEW), request_id="B0", tenant="B")
        tokens: dict[str, list[int]] = {}
        first_b = None
        while engine.has_unfinished():
            for out in engine.step():
                tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
            if first_b is None and "B0" in tokens:
                first_b = len(steps) - 1
            engine.check()
        runs[policy] = (first_b, steps, tokens)
    fair_first, fair_steps, fair_tokens = runs["fair"]
    assert fair_first == 1  # B's whole prompt in the first step after it arrived
    b_step = fair_steps[1]
    a_prompt = sum(n for rid, n, decode in b_step if rid.startswith("A") and not decode)
    assert ("B0", 6, False) in b_step and 0 < a_prompt <= 6
    assert runs["fcfs"][0] > fair_first + 2  # fcfs: A's prompts go first
    assert all(sum(n for _, n, _ in step) == 16 for step in runs["fcfs"][1][:3])
    assert fair_tokens == runs["fcfs"][2]

    lone = _engine(paths, "fair", max_num_seqs=4, max_tokens_per_step=16)
    steps = _recording(lone)
    for i in range(2):
        lone.add_request(prompts[i], SamplingParams(max_new_tokens=NEW), request_id=f"A{i}", tenant="A")
    while lone.has_unfinished():
        lone.step()
    assert all(sum(n for _, n, _ in step) == 16 for step in steps[:7])  # 120 prompt tokens in full steps
