"""ServerMetrics on prometheus_client: names kept from the hand-written exposition, histograms and counters
count what was observed, removed adapters drop out, two instances share nothing, and the LoRA gauge an
inference gateway reads (vLLM's lora_requests_info) follows an engine's running and waiting requests.

Every check reads the text `render()` returns, parsed with prometheus_client's own parser: what a
Prometheus server would see.
"""

from __future__ import annotations

import threading
import time

import pytest
from prometheus_client import CONTENT_TYPE_LATEST
from prometheus_client.parser import text_string_to_metric_families

from molora.server.metrics import (
    CONTENT_TYPE,
    DEADLINE_KINDS,
    FAILURE_KINDS,
    LORA_INFO,
    LORA_INFO_LABELS,
    RATE_WINDOW_S,
    ServerMetrics,
)

# Every family the hand-written exposition wrote (name in the text, type), before prometheus_client.
OLD_FAMILIES = {
    "molora_requests_in_flight": "gauge",
    "molora_requests_max_in_flight": "gauge",
    "molora_draining": "gauge",
    "molora_requests_waiting": "gauge",
    "molora_requests_running": "gauge",
    "molora_kv_blocks_total": "gauge",
    "molora_kv_blocks_free": "gauge",
    "molora_tokens_per_second": "gauge",
    "molora_engine_steps_total": "counter",
    "molora_generation_tokens_total": "counter",
    "molora_engine_preemptions_total": "counter",
    "molora_hotset_slots": "gauge",
    "molora_hotset_slots_used": "gauge",
    "molora_hotset_hits_total": "counter",
    "molora_hotset_misses_total": "counter",
    "molora_hotset_evictions_total": "counter",
    "molora_hotset_disk_reads_total": "counter",
    "molora_hotset_load_seconds_total": "counter",
    "molora_adapter_tokens_total": "counter",
    "molora_prompt_tokens_total": "counter",
    "molora_completion_tokens_total": "counter",
    "molora_request_finish_total": "counter",
    "molora_http_responses_total": "counter",
    "molora_time_to_first_token_seconds": "histogram",
    "molora_time_per_output_token_seconds": "histogram",
    "molora_request_latency_seconds": "histogram",
}
NEW_FAMILIES = {
    "molora_ready": "gauge",
    "molora_engine_healthy": "gauge",
    "molora_engine_last_step_age_seconds": "gauge",
    "molora_queue_wait_seconds": "histogram",
    "molora_engine_step_seconds": "histogram",
    "molora_deadline_expired_total": "counter",
    "molora_engine_failures_total": "counter",
    "molora_kv_cache_usage_ratio": "gauge",
    LORA_INFO: "gauge",
}
STATS = {
    "num_waiting": 2,
    "num_running": 1,
    "kv_blocks_total": 64,
    "kv_blocks_free": 60,
    "steps": 11,
    "tokens_generated": 30,
    "num_preemptions": 1,
    "tokens_by_adapter": {"base": 5, "math": 3, "code": 4},
    "hotset": {
        "slots": 4,
        "slots_used": 2,
        "hits": 7,
        "misses": 2,
        "evictions": 1,
        "disk_reads": 1,
        "load_ms_total": 250,
        "cpu_tier_bytes": 3000,
        "cpu_tier_budget": 4096,
    },
    "lora_requests": {"running": ["math"], "waiting": ["code", "math"], "max_lora": 4},
}


def scrape(m: ServerMetrics, stats: dict | None = None, **kw) -> dict[str, object]:
    """render() parsed: {exposed family name: Metric}; counters under their `_total` name, as in the text."""
    kw = {"in_flight": 1, "max_in_flight": 8, "draining": False, **kw}
    families = text_string_to_metric_families(m.render(STATS if stats is None else stats, **kw))
    return {f.name + ("_total" if f.type == "counter" else ""): f for f in families}


def value(fams: dict, sample: str, **labels: str) -> float:
    """The one sample named `sample` with exactly these labels."""
    hits = [s.value for f in fams.values() for s in f.samples if s.name == sample and s.labels == labels]
    assert len(hits) == 1, (sample, labels, hits)
    return hits[0]


def test_every_old_metric_name_and_type_is_still_exposed():
    fams = scrape(ServerMetrics())
    exposed = {name: f.type for name, f in fams.items()}
    assert {n: exposed.get(n) for n in OLD_FAMILIES} == OLD_FAMILIES
    assert {n: exposed.get(n) for n in NEW_FAMILIES} == NEW_FAMILIES


def test_engine_stats_are_exposed_with_their_values():
    fams = scrape(ServerMetrics())
    for sample, want in (
        ("molora_requests_in_flight", 1),
        ("molora_requests_max_in_flight", 8),
        ("molora_requests_waiting", 2),
        ("molora_requests_running", 1),
        ("molora_kv_blocks_total", 64),
        ("molora_kv_blocks_free", 60),
        ("molora_engine_steps_total", 11),
        ("molora_generation_tokens_total", 30),
        ("molora_engine_preemptions_total", 1),
        ("molora_hotset_slots", 4),
        ("molora_hotset_slots_used", 2),
        ("molora_hotset_hits_total", 7),
        ("molora_hotset_misses_total", 2),
        ("molora_hotset_evictions_total", 1),
        ("molora_hotset_disk_reads_total", 1),
        ("molora_hotset_load_seconds_total", 0.25),
        ("molora_kv_cache_usage_ratio", 4 / 64),
        ("molora_hotset_cpu_tier_bytes", 3000),
        ("molora_hotset_cpu_tier_budget_bytes", 4096),
    ):
        assert value(fams, sample) == want, sample
    assert {s.labels["adapter"]: s.value for s in fams["molora_adapter_tokens_total"].samples} == {
        "base": 5,
        "math": 3,
        "code": 4,
    }


def test_empty_stats_render_zeros_as_before():
    fams = scrape(ServerMetrics(), stats={})
    assert value(fams, "molora_kv_blocks_free") == 0 == value(fams, "molora_hotset_hits_total")
    assert value(fams, "molora_kv_cache_usage_ratio") == 0  # no pool: nothing in use, not a division by zero
    assert fams["molora_adapter_tokens_total"].samples == []
    assert LORA_INFO not in fams  # never read: no view to show


def test_histograms_fill_cumulative_buckets_sum_and_count():
    m = ServerMetrics()
    for ttft in (0.003, 0.02, 100.0):  # below the first bound, inside, above the last
        m.observe_request(ttft=ttft, tpot=None, latency=1.0, prompt_tokens=1, completion_tokens=1, finish_reason="stop")
    fams = scrape(m)
    ttft = "molora_time_to_first_token_seconds"
    assert value(fams, ttft + "_bucket", le="0.005") == 1
    assert value(fams, ttft + "_bucket", le="0.025") == 2
    assert value(fams, ttft + "_bucket", le="30.0") == 2
    assert value(fams, ttft + "_bucket", le="+Inf") == 3 == value(fams, ttft + "_count")
    assert value(fams, ttft + "_sum") == pytest.approx(100.023)
    assert value(fams, "molora_time_per_output_token_seconds_count") == 0  # tpot None: not observed
    assert value(fams, "molora_request_latency_seconds_count") == 3


def test_queue_wait_and_step_time_histograms():
    m = ServerMetrics()
    m.observe_queue_wait(0.2)
    m.observe_step(4, 0.003)
    m.observe_step(2, 0.3)
    fams = scrape(m)
    assert value(fams, "molora_queue_wait_seconds_bucket", le="0.1") == 0
    assert value(fams, "molora_queue_wait_seconds_bucket", le="0.25") == 1
    assert value(fams, "molora_engine_step_seconds_bucket", le="0.005") == 1
    assert value(fams, "molora_engine_step_seconds_count") == 2
    assert value(fams, "molora_engine_step_seconds_sum") == pytest.approx(0.303)
    assert value(fams, "molora_tokens_per_second") == pytest.approx(6 / RATE_WINDOW_S)


def test_counters_add_tokens_finish_reasons_and_responses():
    m = ServerMetrics()
    m.observe_request(ttft=0.1, tpot=0.01, latency=0.5, prompt_tokens=5, completion_tokens=3, finish_reason="stop")
    m.observe_request(ttft=None, tpot=None, latency=0.1, prompt_tokens=2, completion_tokens=0, finish_reason=None)
    for route, status in (("/v1/completions", 200), ("/v1/completions", 200), ("/v1/completions", 429)):
        m.observe_response(route, status)
    fams = scrape(m)
    assert value(fams, "molora_prompt_tokens_total") == 7
    assert value(fams, "molora_completion_tokens_total") == 3
    assert value(fams, "molora_request_finish_total", reason="stop") == 1
    assert value(fams, "molora_request_finish_total", reason="none") == 1
    assert value(fams, "molora_http_responses_total", route="/v1/completions", code="200") == 2
    assert value(fams, "molora_http_responses_total", route="/v1/completions", code="429") == 1


def test_deadline_and_failure_counters_start_at_zero_and_refuse_unknown_kinds():
    m = ServerMetrics()
    fams = scrape(m)
    assert all(value(fams, "molora_deadline_expired_total", kind=k) == 0 for k in DEADLINE_KINDS)
    assert all(value(fams, "molora_engine_failures_total", kind=k) == 0 for k in FAILURE_KINDS)
    m.count_deadline("queue")
    m.count_deadline("queue")
    m.count_deadline("request")
    m.count_engine_failure()
    m.count_engine_failure("restart")
    fams = scrape(m)
    assert value(fams, "molora_deadline_expired_total", kind="queue") == 2
    assert value(fams, "molora_deadline_expired_total", kind="request") == 1
    assert value(fams, "molora_engine_failures_total", kind="step") == 1
    assert value(fams, "molora_engine_failures_total", kind="restart") == 1
    assert value(fams, "molora_engine_failures_total", kind="isolated") == 0
    with pytest.raises(ValueError, match="request, queue"):
        m.count_deadline("total")
    with pytest.raises(ValueError, match="step, isolated, restart"):
        m.count_engine_failure("oom")


def test_forgotten_adapter_drops_out_until_it_is_loaded_again():
    m = ServerMetrics()
    m.forget_adapter("math")
    adapters = {s.labels["adapter"] for s in scrape(m)["molora_adapter_tokens_total"].samples}
    assert adapters == {"base", "code"}  # the engine's dict still has "math"; the exposition does not
    m.known_adapter("math")
    m.known_adapter("never-forgotten")  # a no-op
    adapters = {s.labels["adapter"] for s in scrape(m)["molora_adapter_tokens_total"].samples}
    assert adapters == {"base", "math", "code"}


def test_readiness_health_and_step_age_gauges():
    m = ServerMetrics()
    fams = scrape(m)  # an old caller: no new keywords
    assert value(fams, "molora_ready") == 1 and value(fams, "molora_engine_healthy") == 1
    assert 0 <= value(fams, "molora_engine_last_step_age_seconds") < 60
    assert value(scrape(m, draining=True), "molora_ready") == 0  # draining is not ready by default
    assert value(scrape(m, engine_healthy=False), "molora_ready") == 0
    fams = scrape(m, ready=True, engine_healthy=False, last_step_age_s=12.5, draining=True)
    assert value(fams, "molora_ready") == 1 and value(fams, "molora_engine_healthy") == 0
    assert value(fams, "molora_engine_last_step_age_seconds") == 12.5
    assert value(fams, "molora_draining") == 1


def test_two_instances_share_no_state():
    a, b = ServerMetrics(), ServerMetrics()
    assert a.registry is not b.registry
    a.observe_request(ttft=0.1, tpot=0.01, latency=0.5, prompt_tokens=5, completion_tokens=3, finish_reason="stop")
    a.observe_response("/v1/models", 200)
    a.observe_step(10, 0.01)
    a.count_deadline("request")
    a.forget_adapter("math")
    fams = scrape(b)
    assert value(fams, "molora_prompt_tokens_total") == 0
    assert value(fams, "molora_time_to_first_token_seconds_count") == 0
    assert value(fams, "molora_engine_step_seconds_count") == 0
    assert value(fams, "molora_tokens_per_second") == 0
    assert value(fams, "molora_deadline_expired_total", kind="request") == 0
    assert fams["molora_http_responses_total"].samples == []
    assert "math" in {s.labels["adapter"] for s in fams["molora_adapter_tokens_total"].samples}


def test_concurrent_observations_all_count():
    m = ServerMetrics()

    def work() -> None:
        for _ in range(500):
            m.observe_response("/v1/completions", 200)
            m.observe_step(1, 0.001)
            m.render(STATS, in_flight=0, max_in_flight=1, draining=False)

    threads = [threading.Thread(target=work) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    fams = scrape(m)
    assert value(fams, "molora_http_responses_total", route="/v1/completions", code="200") == 2000
    assert value(fams, "molora_engine_step_seconds_count") == 2000


def test_content_type_is_the_client_library_one():
    assert CONTENT_TYPE == CONTENT_TYPE_LATEST


# ------------------------------------------------------------------------------------------ LoRA gauge


def lora_info(fams: dict) -> tuple[dict[str, str], float]:
    """(labels, value) of the one molora_lora_requests_info sample."""
    (sample,) = fams[LORA_INFO].samples
    assert sample.name == LORA_INFO and tuple(sorted(sample.labels)) == LORA_INFO_LABELS
    return sample.labels, sample.value


def test_lora_info_has_vllm_labels_and_the_time_it_was_read_as_value():
    before = time.time()
    labels, read_at = lora_info(scrape(ServerMetrics()))
    assert labels == {"max_lora": "4", "running_lora_adapters": "math", "waiting_lora_adapters": "code,math"}
    assert before <= read_at <= time.time()  # a Unix time in seconds, as vLLM's set_to_current_time
    labels, _ = lora_info(scrape(ServerMetrics(), bundle="molora-default"))  # the model ids requests name
    assert labels == {
        "max_lora": "4",
        "running_lora_adapters": "molora-default:math",
        "waiting_lora_adapters": "molora-default:code,molora-default:math",
    }


def test_lora_info_keeps_the_last_view_and_its_time_when_the_engine_does_not_answer():
    m = ServerMetrics()
    first = lora_info(scrape(m))
    assert lora_info(scrape(m, stats={})) == first  # engine busy: the same view, with its older time
    idle = {**STATS, "lora_requests": {"running": [], "waiting": [], "max_lora": 4}}
    labels, read_at = lora_info(scrape(m, stats=idle))
    assert labels == {"max_lora": "4", "running_lora_adapters": "", "waiting_lora_adapters": ""}
    assert read_at >= first[1]


@pytest.fixture(scope="module")
def adapter_paths(tmp_path_factory):
    from tests.conftest import make_peft_adapter

    root = tmp_path_factory.mktemp("adapters")
    return {n: make_peft_adapter(root / n, "qwen3", seed=i) for i, n in enumerate(("a", "b", "c"))}


def engine_of(adapter_paths, *, slots: int, max_num_seqs: int):
    """An engine on the tiny random Qwen3 with adapters a, b, c and a vocab router (a | b | default c)."""
    import molora
    from molora.config import LLAMA_PROJECTIONS
    from molora.engine import Engine, EngineConfig
    from molora.routing import VocabRouter
    from tests.conftest import tiny_model

    mm = molora.attach(
        tiny_model("qwen3"),
        adapter_paths,
        slots=slots,
        target_modules=LLAMA_PROJECTIONS,
        router=VocabRouter([(0, 50, "a"), (50, 90, "b")], default="c"),
    )
    return Engine(
        mm,
        EngineConfig(
            max_num_seqs=max_num_seqs,
            max_tokens_per_step=64,
            block_size=4,
            kv_budget_tokens=512,
            max_model_len=64,
            stop_at_eos=False,
        ),
    )


def engine_scrape(m: ServerMetrics, engine, **kw) -> dict[str, object]:
    return scrape(m, stats=engine.stats(), **kw)


def test_pinned_requests_show_running_and_waiting_adapters_and_the_slot_count(adapter_paths):
    from molora.config import SamplingParams

    engine = engine_of(adapter_paths, slots=3, max_num_seqs=1)  # one runs, the others wait
    m = ServerMetrics()
    labels, _ = lora_info(engine_scrape(m, engine))
    assert labels == {"max_lora": "3", "running_lora_adapters": "", "waiting_lora_adapters": ""}
    long = SamplingParams(max_new_tokens=20)
    engine.add_request([5, 6, 7], long, adapter="b")
    engine.add_request([8, 9], long, adapter="a")
    engine.add_request([10, 11], long, adapter="b")
    labels, _ = lora_info(engine_scrape(m, engine))  # nothing scheduled yet: all three wait
    assert labels == {"max_lora": "3", "running_lora_adapters": "", "waiting_lora_adapters": "a,b"}
    engine.step()
    assert engine.stats()["num_running"] == 1
    labels, _ = lora_info(engine_scrape(m, engine, bundle="tiny"))
    assert labels == {"max_lora": "3", "running_lora_adapters": "tiny:b", "waiting_lora_adapters": "tiny:a,tiny:b"}
    while engine.has_unfinished():
        engine.step()
    labels, _ = lora_info(engine_scrape(m, engine))
    assert labels == {"max_lora": "3", "running_lora_adapters": "", "waiting_lora_adapters": ""}


def test_per_token_request_shows_every_adapter_it_may_route_to(adapter_paths):
    from molora.config import SamplingParams

    engine = engine_of(adapter_paths, slots=3, max_num_seqs=4)
    m = ServerMetrics()
    engine.add_request(
        [5, 60, 100], SamplingParams(max_new_tokens=20), routing="vocab", allowed_adapters=["a", "c"]
    )  # its router may choose a, b or c; b is not allowed
    engine.add_request([7, 8], SamplingParams(max_new_tokens=20), routing="none")  # base model: names none
    engine.step()
    assert engine.stats()["num_running"] == 2
    labels, _ = lora_info(engine_scrape(m, engine))
    assert labels == {"max_lora": "3", "running_lora_adapters": "a,c", "waiting_lora_adapters": ""}
