"""Faults and time on the real engine (tiny random model) and behind the server: a request's own fault ends
it alone, deadlines end requests and free what they held, a hung step is seen by /health, a crash loop makes
the server unready, streams get keep-alive comments while they wait."""

from __future__ import annotations

import json
import threading
import time

import httpx
import pytest
import torch

from molora.config import SamplingParams
from molora.engine import Engine, EngineConfig
from molora.errors import MoLoRAError
from molora.model.attach import attach
from molora.routing import VocabRouter
from molora.server import ServerThread, create_app
from molora.server.generation import Limits
from tests.conftest import make_peft_adapter, tiny_model
from tests.test_server import FakeEngine, ToyTokenizer, assert_error, wait_for

GREEDY = SamplingParams(max_new_tokens=8, temperature=0.0)
PROMPTS = [[5, 70, 9, 11], [80, 81, 3], [7, 7, 100, 2, 66], [40, 90]]


@pytest.fixture(scope="module")
def adapters(tmp_path_factory):
    root = tmp_path_factory.mktemp("adapters")
    return {n: make_peft_adapter(root / n, "qwen3", seed=i) for i, n in enumerate(("math", "code"))}


def make_engine(adapters, **cfg) -> Engine:
    mm = attach(
        tiny_model("qwen3"),
        adapters,
        router=VocabRouter([(0, 64, "math")], default="code"),
        tokenizer=ToyTokenizer(),
        check_base=False,
    )
    return Engine(mm, EngineConfig(max_model_len=256, kv_budget_tokens=1024, **cfg))


def run(engine: Engine, ids: list[str]) -> dict:
    """Step until every id in `ids` finished; {id: (token ids, finish_reason, error)}."""
    got: dict[str, list] = {rid: [[], None, None] for rid in ids}
    for _ in range(500):
        for out in engine.step():
            if out.request_id in got:
                got[out.request_id][0] += out.new_token_ids
                if out.finished:
                    got[out.request_id][1:] = [out.finish_reason, out.error]
        if all(v[1] is not None for v in got.values()):
            return {k: tuple(v) for k, v in got.items()}
    raise AssertionError("requests did not finish")


class RaisingRouter:
    """Wraps a token-id router; raises for one request (an injected fault in that request's routing)."""

    def __init__(self, inner) -> None:
        self.inner = inner

    def route(self, *a, **kw):
        raise RuntimeError("injected routing fault")

    def __getattr__(self, name):
        return getattr(self.inner, name)


def test_a_request_whose_routing_raises_fails_alone(adapters):
    engine = make_engine(adapters)
    ids = [engine.add_request(p, GREEDY) for p in PROMPTS]
    reference = run(engine, ids)
    free = engine.allocator.num_free

    ids = [engine.add_request(p, GREEDY) for p in PROMPTS]
    engine.requests[ids[2]].route.router = RaisingRouter(engine.requests[ids[2]].route.router)
    got = run(engine, ids)
    tokens, reason, error = got[ids[2]]
    assert reason == "error" and "injected routing fault" in error and tokens == []
    for i in (0, 1, 3):  # the others are exactly what they were without the fault
        assert got[ids[i]][:2] == reference[list(reference)[i]][:2]
    assert engine.isolation.faults >= 1 and engine.isolation.failures == 1
    engine.check()
    assert engine.allocator.num_free == free and not engine.hotset.pins
    assert engine.stats()["failed_requests"] == 1


def _poison(engine: Engine, name: str) -> None:
    bank = engine.mm.bank
    with torch.no_grad():
        for s in bank.slots.values():
            s.A[bank.slot_of(name)].fill_(float("nan"))


@pytest.mark.parametrize("disk", ["intact", "corrupt"])
def test_a_poisoned_adapter_slot_is_mended_or_fails_only_its_users(adapters, tmp_path, disk):
    import shutil

    folders = {n: shutil.copytree(p, tmp_path / n) for n, p in adapters.items()}
    engine = make_engine(folders)
    pinned = SamplingParams(max_new_tokens=6, temperature=0.0)
    jobs = [(PROMPTS[2], "math"), (PROMPTS[0], "code"), (PROMPTS[1], "code"), (PROMPTS[3], "math")]
    ref = run(engine, ids := [engine.add_request(p, pinned, adapter=a) for p, a in jobs])
    reference = [ref[i][:2] for i in ids]
    free = engine.allocator.num_free

    _poison(engine, "math")  # NaN in a validated adapter's slot (a bit flip, a bad copy)
    if disk == "corrupt":
        (folders["math"] / "adapter_model.safetensors").write_bytes(b"garbage")
    got = run(engine, ids := [engine.add_request(p, pinned, adapter=a) for p, a in jobs])
    assert engine.mm.bank.nonfinite() == []
    for (_, adapter), rid, want in zip(jobs, ids, reference):
        if disk == "corrupt" and adapter == "math":  # it cannot be mended: its users fail, naming it
            assert got[rid][1] == "error" and "adapter 'math' was corrupt" in got[rid][2]
        else:  # mended from disk (or untouched): exactly as before
            assert got[rid][:2] == want
    assert engine.isolation.faults >= 1
    engine.check()
    assert engine.allocator.num_free == free and not engine.hotset.pins
    # later requests on the freed blocks are still exact (failed requests' KV rows were zeroed)
    again = run(engine, ids := [engine.add_request(p, pinned, adapter="code") for p, _ in jobs])
    assert [again[i][:2][1] for i in ids] == ["length"] * 4
    assert [again[i][:2] for i in ids][1:3] == reference[1:3]


def test_deadlines_end_requests_and_free_their_blocks(adapters):
    engine = make_engine(adapters, max_num_seqs=1)
    free = engine.allocator.num_free
    with pytest.raises(MoLoRAError, match="timeout_s"):
        engine.add_request([5], GREEDY, timeout_s=0)
    # ignore_eos: each request runs its 200 steps (>= 2 s at 10 ms a step) unless its deadline ends it; without it
    # an EOS from the random model could end `a` first (a race between EOS and the clock, not the path under test)
    long = SamplingParams(max_new_tokens=200, temperature=0.0, ignore_eos=True)
    a = engine.add_request([5, 6, 7], long, timeout_s=0.2)
    b = engine.add_request([8, 9], long, queue_timeout_s=0.05)  # waits behind a (max_num_seqs=1)

    def slow_step():  # the engine checks deadlines at step boundaries; slow the steps down to cross them
        time.sleep(0.01)
        return Engine.step(engine)

    got = {}
    for _ in range(1000):
        for out in slow_step():
            if out.finished:
                got[out.request_id] = out
        if len(got) == 2:
            break
    assert got[b].finish_reason == "timeout" and got[b].error.startswith("queue timeout")
    assert got[b].completion_tokens == 0
    assert got[a].finish_reason == "timeout" and "timeout of 0.2 s" in got[a].error
    assert got[a].completion_tokens < 200
    assert engine.stats()["deadlines_expired"] == {"request": 1, "queue": 1}
    engine.check()
    assert engine.allocator.num_free == free and not engine.hotset.pins


# ------------------------------------------------------------------------------------------ behind the server


def test_server_deadline_answers_504_and_streams_a_timeout_finish_reason(adapters):
    engine = make_engine(adapters)
    # a long grace: the engine's own deadline path is under test, not the handler's backstop (a loaded CI
    # machine can hold the engine thread past a 2 s grace)
    app = create_app(
        engine, model_name="tiny", limits=Limits(request_timeout_s=60, max_request_timeout_s=120, deadline_grace_s=30)
    )
    # ignore_eos: 250 steps of >= 10 ms (>= 2.5 s) always outlast the 0.3 s deadline; without it an EOS from the
    # random model could end the request first (a race between EOS and the deadline, not the path under test)
    body = {"model": "tiny", "prompt": [5, 6], "max_tokens": 250, "temperature": 0, "ignore_eos": True}
    with ServerThread(app) as url, httpx.Client(base_url=url, timeout=30) as http:
        assert_error(http.post("/completions", json={**body, "molora": {"timeout": 500}}), 400, "molora.timeout")
        slow = threading.Event()
        step = engine.step

        def slowed():
            if slow.is_set():
                time.sleep(0.01)
            return step()

        engine.step = slowed
        slow.set()
        err = assert_error(http.post("/completions", json={**body, "molora": {"timeout": 0.3}}), 504)
        assert err["code"] == "timeout" and "timeout of 0.3 s" in err["message"]
        t0 = time.monotonic()
        r = http.post("/completions", json={**body, "stream": True, "molora": {"timeout": 0.3}})
        events = [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: {")]
        # the whole story on failure (this assertion once failed on a loaded CI machine and its cut repr hid why)
        story = (
            f"{len(events)} events in {time.monotonic() - t0:.2f} s; finish reasons "
            f"{[e['choices'][0]['finish_reason'] for e in events if e.get('choices')]}; "
            f"last {json.dumps(events[-1])[:300]}; stream tail {r.text[-400:]!r}"
        )
        assert events[-2]["choices"][0]["finish_reason"] == "timeout", story
        assert events[-1]["error"]["code"] == "timeout" and "timeout of 0.3 s" in events[-1]["error"]["message"]
        wait_for(lambda: app.state.molora.client.in_flight == 0, timeout=10)
        stats = engine.stats()
        assert stats["kv_blocks_free"] == stats["kv_blocks_total"] and not stats["hotset"]["pinned"]
        metrics = httpx.get(url.removesuffix("/v1") + "/metrics").text
        assert 'molora_deadline_expired_total{kind="request"} 2.0' in metrics


class HangingEngine(FakeEngine):
    """A fake engine whose steps block while `hang` is set."""

    def __init__(self, **kw) -> None:
        super().__init__(**kw)
        self.hang = threading.Event()
        self.release = threading.Event()

    def step(self):
        if self.hang.is_set():
            self.release.wait(20)
        return super().step()


def test_a_hung_step_turns_health_503_and_engine_calls_time_out():
    engine = HangingEngine(step_delay=0.002)
    app = create_app(engine, stall_s=0.5, engine_call_timeout_s=0.3)
    with ServerThread(app) as url:
        base = url.removesuffix("/v1")
        assert httpx.get(base + "/health").status_code == 200 and httpx.get(base + "/ready").status_code == 200
        engine.hang.set()
        with (
            httpx.Client(base_url=url, timeout=30) as http,
            http.stream("POST", "/completions", json={"model": "toy", "prompt": "a", "max_tokens": 50, "stream": True}),
        ):
            # the time it takes is measured by tools/fault_harness.py (docs/reliability.md), not asserted here
            wait_for(lambda: httpx.get(base + "/health").status_code == 503, timeout=10)
            health = httpx.get(base + "/health").json()
            assert health["status"] == "stalled"
            assert httpx.get(base + "/ready").status_code == 503
            r = httpx.get(url + "/adapters", timeout=5)  # needs the engine thread: 503, not a hang
            assert r.status_code == 503 and r.json()["error"]["code"] == "engine_busy"
            metrics = httpx.get(base + "/metrics", timeout=5)  # the server's own figures, without the engine's
            assert metrics.status_code == 200 and "molora_engine_healthy 0.0" in metrics.text
            engine.hang.clear()
            engine.release.set()
        wait_for(lambda: httpx.get(base + "/health").status_code == 200, timeout=5)


def test_the_handler_answers_504_past_the_grace_when_the_engine_is_stuck():
    """The backstop: a step that never returns cannot end the request, so the handler does, at the deadline
    plus `deadline_grace_s`, for a plain and a streamed request alike."""
    engine = HangingEngine(step_delay=0.002)
    app = create_app(engine, limits=Limits(deadline_grace_s=0.2))
    body = {"model": "toy", "prompt": "a", "max_tokens": 50, "molora": {"timeout": 0.2}}
    with ServerThread(app) as url, httpx.Client(base_url=url, timeout=30) as http:
        engine.hang.set()
        err = assert_error(http.post("/completions", json=body), 504)
        assert err["code"] == "timeout" and "stalled engine" in err["message"]
        r = http.post("/completions", json={**body, "stream": True})
        events = [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: {")]
        assert events[-1]["error"]["code"] == "timeout" and "stalled engine" in events[-1]["error"]["message"]
        engine.hang.clear()
        engine.release.set()


def test_limits_reject_a_grace_that_is_not_positive():
    with pytest.raises(MoLoRAError, match="deadline_grace_s=0"):
        Limits(deadline_grace_s=0)


class CrashingEngine(FakeEngine):
    def step(self):
        raise RuntimeError("engine bug")


def test_a_crash_loop_makes_the_server_unready_and_refuse_work():
    engine = CrashingEngine()
    app = create_app(engine)
    runner = app.state.molora.client.runner
    runner.backoff_s = 0.01
    with ServerThread(app) as url, httpx.Client(base_url=url, timeout=30) as http:
        base = url.removesuffix("/v1")
        for _ in range(runner.max_failures):
            err = assert_error(http.post("/completions", json={"model": "toy", "prompt": "a"}), 500)
            assert err["code"] == "engine_error" and "engine bug" in err["message"]
        wait_for(lambda: runner.broken is not None, timeout=5)
        assert httpx.get(base + "/health").json()["status"] == "broken"
        assert httpx.get(base + "/ready").status_code == 503
        assert_error(http.post("/completions", json={"model": "toy", "prompt": "a"}), 503)
        assert 'molora_engine_failures_total{kind="step"} 5.0' in httpx.get(base + "/metrics").text


def test_streams_get_keepalive_comments_while_they_wait():
    engine = FakeEngine(step_delay=0.25)
    app = create_app(engine, limits=Limits(keepalive_s=0.05))
    with ServerThread(app) as url, httpx.Client(base_url=url, timeout=30) as http:
        r = http.post("/completions", json={"model": "toy", "prompt": "a", "max_tokens": 2, "stream": True})
        lines = r.text.splitlines()
        assert ": keep-alive" in lines and [x for x in lines if x][-1] == "data: [DONE]"


def test_a_large_prompt_is_tokenised_off_the_event_loop(monkeypatch):
    import molora.server.generation as generation

    threads = []
    tokenize = ToyTokenizer.encode

    def recording(self, text, add_special_tokens=True):
        threads.append(threading.current_thread().name)
        return tokenize(self, text, add_special_tokens)

    monkeypatch.setattr(ToyTokenizer, "encode", recording)
    app = create_app(FakeEngine(max_model_len=1 << 20))
    with ServerThread(app) as url, httpx.Client(base_url=url, timeout=30) as http:
        small = http.post("/completions", json={"model": "toy", "prompt": "a", "max_tokens": 1})
        big = http.post(
            "/completions", json={"model": "toy", "prompt": "a" * (generation.OFFLOAD_CHARS + 1), "max_tokens": 1}
        )
        assert small.status_code == big.status_code == 200
    assert len(threads) == 2 and threads[0] != threads[1]
