"""The hot set under pressure: reads start when a request is queued, stay inside the CPU tier's byte budget,
never move a slot (so never an adapter a running request pins), and every request still gets its own adapter's
tokens; slot eviction spares the adapters the queue wants."""

from __future__ import annotations

import pytest
import torch

import molora
from molora.config import SamplingParams
from molora.engine import Engine, EngineConfig
from molora.engine.loader import folder_bytes
from molora.errors import MoLoRAError
from tests.conftest import VOCAB, make_peft_adapter, tiny_model

ARCH = "qwen3"
NAMES = [f"x{i}" for i in range(6)]
CFG = dict(
    max_num_seqs=8, max_tokens_per_step=48, block_size=4, kv_budget_tokens=1024, max_model_len=128, stop_at_eos=False
)
GREEDY = SamplingParams(max_new_tokens=4)


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("pressure")
    return {
        n: make_peft_adapter(root / n, ARCH, r=4, targets=("q_proj", "v_proj", "down_proj"), seed=10 + i)
        for i, n in enumerate(NAMES)
    }


def _prompt(seed: int, n: int = 6) -> list[int]:
    return torch.randint(3, VOCAB, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.fixture(scope="module")
def reference(folders):
    """Greedy tokens of each adapter alone (an engine holding only it) for prompts 0..3."""
    out = {}
    for n, path in folders.items():
        engine = Engine(molora.attach(tiny_model(ARCH), {n: path}), EngineConfig(**CFG))
        for p, o in enumerate(engine.generate([_prompt(p) for p in range(4)], GREEDY, adapter=n)):
            out[n, p] = o.new_token_ids
    return out


def _engine(folders, slots: int, budget_adapters: float) -> Engine:
    """Two adapters resident, the rest registered cold (read again from disk), a CPU tier of that many adapters."""
    one = folder_bytes(folders[NAMES[0]])
    mm = molora.attach(tiny_model(ARCH), {n: folders[n] for n in NAMES[:2]}, slots=slots)
    engine = Engine(mm, EngineConfig(**CFG, cpu_tier_bytes=int(budget_adapters * one)))
    for n in NAMES[2:]:
        engine.load_adapter(n, str(folders[n]))
        engine.hotset.forget_warm(n)
    engine.hotset.check()
    return engine


def _run(engine: Engine) -> dict[str, list[int]]:
    got: dict[str, list[int]] = {}
    while engine.has_unfinished():
        for out in engine.step():
            got.setdefault(out.request_id, []).extend(out.new_token_ids)
            assert out.finish_reason in (None, "length"), out.error
        engine.scheduler.check()  # pins, KV pool and the hot set's byte bound (HotSet.check)
    return got


def test_queueing_starts_the_read_and_moves_no_slot(folders, reference):
    engine = _engine(folders, slots=2, budget_adapters=4)
    hs = engine.hotset
    long = engine.add_request(_prompt(0), SamplingParams(max_new_tokens=30), adapter="x0")
    first = [t for o in engine.step() for t in o.new_token_ids]  # x0 runs and is pinned
    slots = {n: hs.mm.bank.slot_of(n) for n in hs.mm.bank.names}
    rid = engine.add_request(_prompt(1), GREEDY, adapter="x4")
    assert "x4" in hs.reads and hs.prefetches == 1  # read started at queue time, before any step
    assert {n: hs.mm.bank.slot_of(n) for n in hs.mm.bank.names} == slots
    hs.check()
    got = _run(engine)
    assert got[rid] == reference["x4", 1] and (first + got[long])[:4] == reference["x0", 0]


@pytest.mark.parametrize("budget_adapters", [0, 1.5, 3])
def test_memory_stays_in_the_budget_and_every_request_gets_its_adapter(folders, reference, budget_adapters):
    engine = _engine(folders, slots=2, budget_adapters=budget_adapters)
    hs = engine.hotset
    want = {}
    for i in range(18):
        name, p = NAMES[(i * 5) % len(NAMES)], i % 4
        want[engine.add_request(_prompt(p), GREEDY, adapter=name)] = (name, p)
        hs.check()  # prefetch at queue time keeps the bound too
    got = _run(engine)
    assert {rid: got[rid] for rid in want} == {rid: reference[k] for rid, k in want.items()}
    assert not hs.pins and not hs.reserved and hs.overdraft is None
    if budget_adapters >= 1:
        assert hs.prefetches > 0
    if budget_adapters < 1:
        assert hs.cpu_used == 0  # nothing fits: each cold adapter is one overdraft read at a time


def test_prefetch_is_refused_past_the_budget_and_takes_no_room_from_wanted_reads(folders):
    engine = _engine(folders, slots=2, budget_adapters=1.5)  # room for one read
    hs = engine.hotset
    engine.add_request(_prompt(0), GREEDY, adapter="x2")
    engine.add_request(_prompt(1), GREEDY, adapter="x3")
    assert list(hs.reads) == ["x2"] and hs.prefetch_deferred == 1 and hs.overdraft is None
    hs.check()


def test_slot_eviction_spares_adapters_the_queue_wants(folders, reference):
    engine = _engine(folders, slots=2, budget_adapters=6)
    hs = engine.hotset
    for n in NAMES[2:]:
        hs.cpu[n] = hs.mm.read(n, folders[n])  # all warm: only the slot choice is under test
        hs.cpu_used += hs.cpu[n].nbytes()
    hs.check()
    engine.generate([_prompt(0)], GREEDY, adapter="x0")
    engine.generate([_prompt(0)], GREEDY, adapter="x1")  # LRU order: x0, x1 (x0 least recent)
    hs.prefetch(["x0"], queue=True)  # what a queue needing x0 tells the hot set
    hs.acquire(["x2"])  # must evict x1, not the least recent x0
    assert hs.resident("x0") and not hs.resident("x1")
    hs.release(["x2"])
    hs.check()


@pytest.mark.parametrize("admission", ["slots", "fcfs"])
def test_slot_aware_admission_lets_warm_requests_pass_a_blocked_cold_one_a_bounded_number_of_times(
    folders, reference, admission
):
    """One slot, pinned by a long x0 request: a cold x1 request cannot start; the x0 requests queued behind it
    need no slot. "slots" admits max_bypass of them ahead of it, then it waits its turn; "fcfs" admits none."""
    mm = molora.attach(tiny_model(ARCH), {"x0": folders["x0"]}, slots=1)
    engine = Engine(mm, EngineConfig(**CFG, cpu_tier_bytes=1 << 24, admission=admission))
    engine.load_adapter("x1", str(folders["x1"]))
    engine.scheduler.max_bypass = 2
    first: dict[str, int] = {}
    got: dict[str, list[int]] = {}

    def step(i):
        for o in engine.step():
            if o.new_token_ids:
                first.setdefault(o.request_id, i)
            got.setdefault(o.request_id, []).extend(o.new_token_ids)
            assert o.finish_reason in (None, "length")
        engine.scheduler.check()

    engine.add_request(_prompt(0), SamplingParams(max_new_tokens=8), adapter="x0", request_id="long")
    step(0)
    engine.add_request(_prompt(1), GREEDY, adapter="x1", request_id="cold")
    warm = [engine.add_request(_prompt(2), GREEDY, adapter="x0", request_id=f"w{i}") for i in range(5)]
    i = 1
    while engine.has_unfinished():
        step(i)
        i += 1
    order = sorted(["cold", *warm], key=lambda r: first[r])
    assert order == (["w0", "w1", "cold", "w2", "w3", "w4"] if admission == "slots" else ["cold", *warm])
    assert got["cold"] == reference["x1", 1] and all(got[w] == reference["x0", 2] for w in warm)


def test_admission_is_an_engine_setting_and_a_serve_flag():
    from molora.cli import build_parser

    with pytest.raises(MoLoRAError, match=r"EngineConfig.admission='lifo': choose one of fcfs, slots"):
        EngineConfig(admission="lifo")
    assert build_parser().parse_args(["serve"]).admission == "fcfs"
    assert build_parser().parse_args(["serve", "--admission", "slots"]).admission == "slots"
