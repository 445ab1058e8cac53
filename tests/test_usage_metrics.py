"""Per-adapter and per-tenant series in /metrics (molora.server.usage): label values bounded (the first names with
traffic, busiest first, then "other"), counters that never move between labels, a fixed series budget with 1,000
adapters and 50 tenants, and the hot set's per-adapter tiers, loads and evictions that feed them."""

from __future__ import annotations

import pytest
from fastapi.testclient import TestClient
from prometheus_client.parser import text_string_to_metric_families

import molora
from molora.config import LLAMA_PROJECTIONS, SamplingParams
from molora.engine import Engine, EngineConfig
from molora.server import create_app
from molora.server.usage import MAX_ADAPTER_LABELS, MAX_TENANT_LABELS, OTHER, SERIES_BUDGET, BoundedLabels
from tests.conftest import make_peft_adapter, tiny_model
from tests.test_server import FakeEngine


def test_bounded_labels_admit_the_busiest_while_there_is_room_and_keep_them():
    labels = BoundedLabels(2)
    assert labels.split({"a": 5, "b": 9, "c": 1, "idle": 0}) == [("b", 9), ("a", 5), (OTHER, 1)]
    # c grows past both: it stays under "other", so no counter ever moves between labels
    assert labels.split({"a": 6, "b": 9, "c": 50, "d": 2}) == [("b", 9), ("a", 6), (OTHER, 52)]
    assert labels.label("a") == "a" and labels.label("zzz") == OTHER
    assert labels.split({"a": 7, "b": 9}, hidden=frozenset({"a"})) == [("b", 9)]
    fresh = BoundedLabels(1)
    assert fresh.label("t1") == "t1" and fresh.label("t2") == OTHER and fresh.label("t1") == "t1"


def test_a_released_name_frees_its_label_and_leaves_every_split_until_restored():
    labels = BoundedLabels(2)
    assert labels.split({"a": 5, "b": 9, "c": 1}) == [("b", 9), ("a", 5), (OTHER, 1)]
    assert labels.release("a") and not labels.release("zzz")  # zzz never had a label
    # a's counts leave the page (neither its label nor "other"); the room goes to the next name with traffic
    assert labels.split({"a": 5, "b": 9, "c": 1}) == [("b", 9), ("c", 1)]
    assert labels.label("a") == OTHER  # a draining request of the unloaded adapter finishing late
    labels.restore("a")
    assert labels.split({"a": 1, "b": 9, "c": 1}) == [("b", 9), ("c", 1), (OTHER, 1)]  # back, but the room is taken


def test_adapters_loaded_and_unloaded_for_days_do_not_keep_the_labels(tmp_path):
    """More adapters than there are labels come and go one after another, each with traffic: every one gets a label
    of its own while it is loaded, and an unloaded one leaves no series behind."""
    root = tmp_path / "adapters"
    names = [f"x{i}" for i in range(MAX_ADAPTER_LABELS + 8)]
    for n in names:
        (root / n).mkdir(parents=True)
        (root / n / "adapter_config.json").write_text("{}")
    with TestClient(create_app(FakeEngine(), adapter_roots=[root])) as client:
        for n in names:
            assert client.post("/v1/adapters", json={"name": n, "path": n}).status_code == 201
            body = {"model": f"toy:{n}", "prompt": "q", "max_tokens": 2}
            assert client.post("/v1/completions", json=body).status_code == 200
            text = client.get("/metrics").text
            requests = {
                s.labels["adapter"]: s.value
                for f in text_string_to_metric_families(text)
                for s in f.samples
                if s.name == "molora_adapter_requests_total"
            }
            assert requests.get(n) == 1 and OTHER not in requests, (n, requests)
            assert client.delete(f"/v1/adapters/{n}").status_code == 200
        text = client.get("/metrics").text
    left = {s.labels.get("adapter") for f in text_string_to_metric_families(text) for s in f.samples}
    assert not left & set(names)


class ManyAdapters(FakeEngine):
    """The fake engine with `n` registered adapters, each with a tier, loads, evictions and tokens in its stats."""

    def stats(self) -> dict:
        out = super().stats()
        names = self.mm.adapter_names
        out["hotset"]["adapters"] = {
            n: {"tier": ("slot", "cpu", "disk")[i % 3], "loads": i % 5, "evictions": i % 4, "load_ms": 1.5 * (i % 7)}
            for i, n in enumerate(names)
        }
        out["tokens_by_adapter"] = {n: (i * 7919) % 1000 for i, n in enumerate(names)}
        return out


def test_a_thousand_adapters_and_fifty_tenants_stay_under_the_series_budget():
    engine = ManyAdapters(adapters=[f"a{i}" for i in range(1000)])
    with TestClient(create_app(engine, max_queue=64)) as client:
        for t in range(50):
            body = {"model": f"toy:a{t * 7}", "prompt": "q", "max_tokens": 3, "user": f"tenant-{t}"}
            assert client.post("/v1/completions", json=body).status_code == 200
        text = client.get("/metrics").text
    samples = [s for f in text_string_to_metric_families(text) for s in f.samples]
    assert len(samples) <= SERIES_BUDGET, len(samples)
    by_name: dict[str, list] = {}
    for s in samples:
        by_name.setdefault(s.name, []).append(s.labels)
    tenants = {lab["tenant"] for lab in by_name["molora_tenant_time_to_first_token_seconds_count"]}
    assert len(tenants) == MAX_TENANT_LABELS + 1 and OTHER in tenants and "tenant-0" in tenants
    assert {lab["tenant"] for lab in by_name["molora_tenant_requests_total"]} == tenants
    assert sum(1 for _ in by_name["molora_tenant_inter_token_seconds_count"]) == len(tenants)
    for name in ("molora_adapter_tokens_total", "molora_adapter_loads_total", "molora_adapter_requests_total"):
        adapters = {lab["adapter"] for lab in by_name[name]}
        assert len(adapters) <= MAX_ADAPTER_LABELS + 1 and OTHER in adapters, name
    assert len(by_name["molora_adapter_residency"]) <= MAX_ADAPTER_LABELS
    tiers = {lab["tier"] for lab in by_name["molora_adapters"]}
    assert tiers == {"slot", "cpu", "disk"}


def test_tenant_counts_and_latencies_are_per_tenant():
    engine = FakeEngine()
    with TestClient(create_app(engine)) as client:
        for user, n in (("alice", 4), ("bob", 2), ("alice", 3)):
            body = {"model": "toy:math", "prompt": "q", "max_tokens": n, "user": user}
            assert client.post("/v1/completions", json=body).status_code == 200
        text = client.get("/metrics").text
    values = {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for f in text_string_to_metric_families(text)
        for s in f.samples
    }
    assert values["molora_tenant_requests_total", (("tenant", "alice"),)] == 2
    assert values["molora_tenant_completion_tokens_total", (("tenant", "alice"),)] == 7
    assert values["molora_tenant_completion_tokens_total", (("tenant", "bob"),)] == 2
    assert values["molora_tenant_time_to_first_token_seconds_count", (("tenant", "bob"),)] == 1
    assert values["molora_tenant_inter_token_seconds_count", (("tenant", "alice"),)] == 3 + 2  # n - 1 gaps each
    assert values["molora_adapter_requests_total", (("adapter", "math"),)] == 3


@pytest.fixture(scope="module")
def paths(tmp_path_factory):
    root = tmp_path_factory.mktemp("adapters")
    return {
        n: make_peft_adapter(root / n, "qwen3", seed=i, r=4, targets=("q_proj", "v_proj")) for i, n in enumerate("ab")
    }


def test_the_hot_set_reports_each_adapters_tier_loads_and_evictions(paths):
    mm = molora.attach(tiny_model("qwen3"), {"a": paths["a"]}, slots=1, target_modules=LLAMA_PROJECTIONS)
    cfg = EngineConfig(
        max_num_seqs=2, block_size=4, kv_budget_tokens=512, max_model_len=64, stop_at_eos=False, cpu_tier_bytes=1 << 24
    )
    engine = Engine(mm, cfg)
    engine.load_adapter("b", str(paths["b"]))
    engine.generate([[5, 6, 7]], SamplingParams(max_new_tokens=2), adapter="b")
    per = engine.stats()["hotset"]["adapters"]
    assert per["b"]["tier"] == "slot" and per["b"]["loads"] == 1 and per["b"]["load_ms"] > 0
    assert per["a"]["tier"] == "cpu" and per["a"]["evictions"] == 1 and per["a"]["loads"] == 0
    engine.generate([[5, 6, 7]], SamplingParams(max_new_tokens=2), adapter="a")
    per = engine.stats()["hotset"]["adapters"]
    assert (per["a"]["tier"], per["a"]["loads"], per["b"]["tier"], per["b"]["evictions"]) == ("slot", 1, "cpu", 1)
