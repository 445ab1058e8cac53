"""Server metrics on the standard client library, `prometheus_client`, one registry per server.

Owns two kinds of series and `render()`, which writes both as Prometheus text:

- What the server measures itself, as `prometheus_client` instruments in `self.registry`, a
  `CollectorRegistry` of this instance alone (never the process-global `REGISTRY`: several apps live in
  one test process). Histograms: time to first token, time per output token, request latency, queue wait
  (arrival to first token), engine step time. Counters: HTTP responses by route and status, prompt and
  completion tokens, finish reasons, expired deadlines by kind, engine failures by kind, the per-request
  chooser's picks by adapter and its time per call (--router hybrid). A gauge of
  generated tokens/s over a sliding window, read when scraped.
- What the engine and the server report at scrape time, passed to `render()`: the engine's `stats()` dict
  (queue depth, running, KV blocks, steps, preemptions, hot-set slots/hits/misses/evictions/loads, tokens
  per adapter, prefix-cache queried/hit tokens, hit rate, cached blocks and evictions) and the server's
  in-flight count, limit, draining, readiness and engine health. These are
  built per scrape as metric families (`GaugeMetricFamily`, `CounterMetricFamily`) and exposed next to the
  registry's; nothing of one scrape is kept for the next (but the LoRA view, below), so concurrent
  scrapes cannot mix.

For an inference gateway that routes by adapter affinity (the Kubernetes Gateway API Inference Extension's
endpoint picker in front of N plain `molora serve` replicas): `molora_lora_requests_info`, vLLM's
`vllm:lora_requests_info` under molora's prefix, built from the engine's `stats()["lora_requests"]`. One
sample; its labels carry the state and its value is the Unix time the state was read (vLLM sets it with
`set_to_current_time`, and the picker keeps the sample with the latest): `running_lora_adapters` and
`waiting_lora_adapters`, the adapters the running and the waiting requests route to, comma-separated, and
`max_lora`, the engine's slots. With `render(..., bundle=NAME)` the adapters are listed as the model ids
requests name them by, `NAME:adapter`: the picker compares them with a request's `model`. This is the one
thing kept from scrape to scrape: when the engine does not answer (busy, stopped) the last view is written
again with its own, older time, as vLLM's stays at its last update. `molora_kv_cache_usage_ratio` (blocks in
use, 0 to 1) is the KV figure the same picker reads.
Why this name and not the vLLM one as well: the picker takes the metric's name from its configuration
(`--lora-info-metric` in older releases, `engineConfigs[].loraSpec` of its `core-metrics-extractor` plugin
in newer ones, which refuse that flag); only the default is the vLLM name, and a server that is not vLLM
must configure its queue and KV metric names there anyway, so a vLLM-named alias of this one series would
not make the defaults work and would add a vLLM series to molora's dashboards. The prefix is `molora_` like
every series here (Prometheus keeps colons for recording rules). docs/serving.md shows the configuration.

Adapter removal: `molora_adapter_tokens_total{adapter=...}` comes from the engine's `tokens_by_adapter`,
which still carries an adapter after it is unloaded. `forget_adapter(name)` hides that label set from
later scrapes and gives its per-adapter label back (molora.server.usage); `known_adapter(name)` (call it when an
adapter is loaded) shows it again, with whatever count the engine then reports.

Names are those of the hand-written exposition this replaced; `prometheus_client` adds the `_total` of a
counter itself (`Counter("molora_prompt_tokens")` is exposed as `molora_prompt_tokens_total`). What the
library writes differently: values as floats (`3.0`), labels sorted by name (`code` before `route`),
bucket bounds as floats (`le="1.0"`), and a `<name>_created` gauge beside every counter and histogram
(the library's default; turning it off is process-global, so it stays on).

Knows nothing of FastAPI or the engine object; every method is thread-safe.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from molora.server.usage import UsageMetrics

CONTENT_TYPE = CONTENT_TYPE_LATEST  # the media type of what `render()` returns, for the /metrics response

TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)
LATENCY_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
QUEUE_WAIT_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
STEP_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)
RATE_WINDOW_S = 10.0

LORA_INFO = "molora_lora_requests_info"  # vLLM's vllm:lora_requests_info, labels and value alike
LORA_INFO_LABELS = ("max_lora", "running_lora_adapters", "waiting_lora_adapters")

DEADLINE_KINDS = ("request", "queue")  # whole-request deadline; time allowed in the queue
# a step raised; a request failed alone; the thread restarted; an adapter was unloaded for non-finite logits
FAILURE_KINDS = ("step", "isolated", "restart", "quarantine")


class ServerMetrics:
    """What the server measures; `render(stats, ...)` adds the engine's view at scrape time."""

    def __init__(self) -> None:
        self._lock = threading.Lock()  # guards the tokens/s window, the last step time, the forgotten names and
        #                                the last LoRA view
        self._window: deque[tuple[float, int]] = deque()  # (monotonic time, tokens of one step)
        self._last_step = time.monotonic()
        self._forgotten: set[str] = set()
        self._lora: tuple[tuple[str, ...], float] | None = None  # the last LoRA view read: label values, time
        self.started = time.time()

        self.registry = r = CollectorRegistry()
        self.ttft = Histogram(
            "molora_time_to_first_token_seconds",
            "Time from arrival to the first token.",
            buckets=TTFT_BUCKETS,
            registry=r,
        )
        self.tpot = Histogram(
            "molora_time_per_output_token_seconds", "Mean time between output tokens.", buckets=TPOT_BUCKETS, registry=r
        )
        self.latency = Histogram(
            "molora_request_latency_seconds",
            "Time from arrival to the last token.",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.queue_wait = Histogram(
            "molora_queue_wait_seconds",
            "Time from arrival to the first scheduled token.",
            buckets=QUEUE_WAIT_BUCKETS,
            registry=r,
        )
        self.step_time = Histogram(
            "molora_engine_step_seconds", "Time of one engine step.", buckets=STEP_BUCKETS, registry=r
        )
        self.prompt_tokens = Counter("molora_prompt_tokens", "Prompt tokens of finished requests.", registry=r)
        self.completion_tokens = Counter(
            "molora_completion_tokens", "Completion tokens of finished requests.", registry=r
        )
        self.finish_reasons = Counter(
            "molora_request_finish", "Finished engine requests by finish reason.", ["reason"], registry=r
        )
        self.responses = Counter(
            "molora_http_responses", "HTTP responses by route and status code.", ["route", "code"], registry=r
        )
        self.deadlines = Counter(
            "molora_deadline_expired",
            "Requests ended by a deadline, by kind (request: the whole request; queue: waiting to be scheduled).",
            ["kind"],
            registry=r,
        )
        self.failures = Counter(
            "molora_engine_failures",
            "Engine failures by kind (step: a step raised; isolated: "
            "a request failed alone after isolation; restart: the engine thread restarted; quarantine: an adapter "
            "was unloaded because its requests gave non-finite logits).",
            ["kind"],
            registry=r,
        )
        self.choices = Counter(
            "molora_chooser_choices",
            "Prompts the per-request chooser (--router hybrid) decided, by the adapter it picked ('base': none; "
            "'error': it failed on that request).",
            ["adapter"],
            registry=r,
        )
        self.choose_time = Histogram(
            "molora_chooser_seconds",
            "Time of one chooser call (all of a request's prompts).",
            buckets=STEP_BUCKETS,
            registry=r,
        )
        for kind in DEADLINE_KINDS:  # every kind exposed from the start, at 0, so rate() sees the first one
            self.deadlines.labels(kind=kind)
        for kind in FAILURE_KINDS:
            self.failures.labels(kind=kind)
        self.usage = UsageMetrics(r, TTFT_BUCKETS, TPOT_BUCKETS)  # per adapter and per tenant, bounded
        Gauge(
            "molora_tokens_per_second", f"Generated tokens per second over the last {RATE_WINDOW_S:g} s.", registry=r
        ).set_function(lambda: round(self.tokens_per_second(), 3))

    # -------------------------------------------------------------------------------------- observe
    def observe_step(self, new_tokens: int, seconds: float) -> None:
        """Called by the engine thread after every step: the tokens/s window and the step-time histogram."""
        now = time.monotonic()
        self.step_time.observe(seconds)
        with self._lock:
            self._window.append((now, new_tokens))
            self._last_step = now
            self._trim(now)

    def observe_request(
        self,
        *,
        ttft: float | None,
        tpot: float | None,
        latency: float,
        prompt_tokens: int,
        completion_tokens: int,
        finish_reason: str | None,
        tenant: str | None = None,
        adapters: Sequence[str | None] = (),
        gaps: Sequence[float] = (),
    ) -> None:
        """One finished engine request (one choice), as the handler saw it: with its `tenant`, the per-tenant and
        per-adapter series too (`adapters`: each token's adapter; `gaps`: seconds between its outputs)."""
        if tenant is not None:
            self.usage.observe(tenant, adapters, ttft, gaps, prompt_tokens, completion_tokens)
        if ttft is not None:
            self.ttft.observe(ttft)
        if tpot is not None:
            self.tpot.observe(tpot)
        self.latency.observe(latency)
        self.prompt_tokens.inc(prompt_tokens)
        self.completion_tokens.inc(completion_tokens)
        self.finish_reasons.labels(reason=finish_reason or "none").inc()

    def observe_response(self, route: str, status: int) -> None:
        self.responses.labels(route=route, code=str(status)).inc()

    def observe_queue_wait(self, seconds: float) -> None:
        """Time from a request's arrival to its first scheduled step (its first token)."""
        self.queue_wait.observe(seconds)

    def count_deadline(self, kind: str) -> None:
        """A request ended because a deadline passed; `kind` is one of DEADLINE_KINDS."""
        self.deadlines.labels(kind=_check_kind(kind, DEADLINE_KINDS, "deadline")).inc()

    def count_engine_failure(self, kind: str = "step") -> None:
        """An engine failure; `kind` is one of FAILURE_KINDS."""
        self.failures.labels(kind=_check_kind(kind, FAILURE_KINDS, "engine failure")).inc()

    def observe_choices(self, adapters: list[str | None], seconds: float) -> None:
        """One chooser call: the adapter picked per prompt (None: the base model), and its time."""
        self.choose_time.observe(seconds)
        for a in adapters:
            self.choices.labels(adapter=a if a is not None else "base").inc()

    def count_tenant_refusal(self, tenant: str, limit: str) -> None:
        """A request refused (429) by a per-tenant limit (molora.server.usage.TENANT_LIMITS)."""
        self.usage.refuse(tenant, limit)

    def count_choice_failure(self) -> None:
        self.choices.labels(adapter="error").inc()

    # -------------------------------------------------------------------------------------- adapters
    def forget_adapter(self, name: str) -> None:
        """An adapter was removed: leave its label set out of `molora_adapter_tokens_total` from now on."""
        with self._lock:
            self._forgotten.add(name)
        self.usage.release_adapter(name)

    def known_adapter(self, name: str) -> None:
        """An adapter was loaded: expose its label set again if it was forgotten (a no-op otherwise)."""
        with self._lock:
            self._forgotten.discard(name)
        self.usage.adapters.restore(name)

    # -------------------------------------------------------------------------------------- read
    def tokens_per_second(self) -> float:
        now = time.monotonic()
        with self._lock:
            self._trim(now)
            return sum(n for _, n in self._window) / RATE_WINDOW_S

    def _trim(self, now: float) -> None:
        while self._window and self._window[0][0] < now - RATE_WINDOW_S:
            self._window.popleft()

    def render(
        self,
        stats: Mapping[str, Any],
        *,
        in_flight: int,
        max_in_flight: int,
        draining: bool,
        ready: bool | None = None,
        engine_healthy: bool = True,
        last_step_age_s: float | None = None,
        bundle: str | None = None,
    ) -> str:
        """Prometheus text (media type CONTENT_TYPE): the engine's `stats()` and the server's state, then
        everything this instance measured.

        `ready` defaults to "not draining and the engine is healthy"; `last_step_age_s` to the time since
        the last `observe_step` (since this object was built if there was none). `bundle`: a prefix that makes
        `molora_lora_requests_info` list `bundle:adapter` ids; the server passes none, since a request pins an
        adapter by its bare name (vLLM's convention, module docstring)."""
        now = time.monotonic()
        lora = _lora_labels(stats.get("lora_requests"), bundle)
        with self._lock:
            forgotten = frozenset(self._forgotten)
            age = now - self._last_step if last_step_age_s is None else last_step_age_s
            if lora is not None:
                self._lora = (lora, time.time())
            lora_view = self._lora
        view = _Scrape(
            stats=stats,
            in_flight=in_flight,
            max_in_flight=max_in_flight,
            draining=draining,
            ready=(not draining and engine_healthy) if ready is None else ready,
            engine_healthy=engine_healthy,
            last_step_age_s=age,
            forgotten=forgotten,
            lora=lora_view,
        )
        return generate_latest(_Exposition(view, self.registry, self.usage)).decode()


def _lora_labels(lora: Mapping[str, Any] | None, bundle: str | None) -> tuple[str, ...] | None:
    """The label values of `molora_lora_requests_info` (LORA_INFO_LABELS order) from `stats()["lora_requests"]`;
    None when the engine did not report it."""
    if not lora:
        return None
    prefix = f"{bundle}:" if bundle else ""
    running, waiting = (",".join(prefix + str(n) for n in lora[key]) for key in ("running", "waiting"))
    return str(int(lora["max_lora"])), running, waiting


def _check_kind(kind: str, allowed: tuple[str, ...], what: str) -> str:
    if kind not in allowed:  # a free-form label value would grow a series per typo
        raise ValueError(f"unknown {what} kind {kind!r}; expected one of {', '.join(allowed)}")
    return kind


# ------------------------------------------------------------------------------------------ one scrape
@dataclass(frozen=True)
class _Scrape:
    """What `render()` was told about the engine and the server, for one scrape."""

    stats: Mapping[str, Any]
    in_flight: int
    max_in_flight: int
    draining: bool
    ready: bool
    engine_healthy: bool
    last_step_age_s: float
    forgotten: frozenset[str]
    lora: tuple[tuple[str, ...], float] | None  # the LoRA view to write: label values and the time it was read


class _Exposition:
    """A collector for one scrape: the families of `view`, then those of the server's own registry."""

    def __init__(self, view: _Scrape, registry: CollectorRegistry, usage: UsageMetrics) -> None:
        self.view, self.registry, self.usage = view, registry, usage

    def collect(self) -> Iterator[Metric]:
        yield from _scrape_families(self.view)
        yield from self.usage.families(self.view.stats, self.view.forgotten)
        yield from self.registry.collect()


def _scrape_families(v: _Scrape) -> Iterator[Metric]:
    stats = v.stats
    hot = stats.get("hotset", {}) or {}
    prefix = stats.get("prefix_cache", {}) or {}
    gauges = (
        ("molora_requests_in_flight", "Engine requests admitted by the server, not finished.", v.in_flight),
        ("molora_requests_max_in_flight", "Engine requests the server admits at once.", v.max_in_flight),
        ("molora_draining", "1 while the server drains before exiting.", int(v.draining)),
        ("molora_ready", "1 while the server accepts new requests.", int(v.ready)),
        ("molora_engine_healthy", "1 while the engine thread is alive and its steps succeed.", int(v.engine_healthy)),
        ("molora_engine_last_step_age_seconds", "Seconds since the engine last finished a step.", v.last_step_age_s),
        ("molora_requests_waiting", "Requests queued in the engine (queue depth).", stats.get("num_waiting", 0)),
        ("molora_requests_running", "Requests the engine is running.", stats.get("num_running", 0)),
        ("molora_kv_blocks_total", "KV-cache blocks in the pool.", stats.get("kv_blocks_total", 0)),
        ("molora_kv_blocks_free", "Free KV-cache blocks.", stats.get("kv_blocks_free", 0)),
        ("molora_kv_cache_usage_ratio", "Fraction of the KV-cache blocks in use (0 to 1).", _kv_usage(stats)),
        ("molora_hotset_slots", "Adapter slots in the hot set.", hot.get("slots", 0)),
        ("molora_hotset_slots_used", "Hot-set slots holding an adapter.", hot.get("slots_used", 0)),
        ("molora_hotset_cpu_tier_bytes", "Bytes of adapters held in the CPU tier.", hot.get("cpu_tier_bytes", 0)),
        (
            "molora_hotset_cpu_tier_budget_bytes",
            "The CPU tier's bound in bytes (--max-cpu-loras).",
            hot.get("cpu_tier_budget", 0),
        ),
        (
            "molora_hotset_reserved_bytes",
            "Bytes adapter reads in flight or waiting to be taken hold against the "
            "CPU tier's budget (tier + reserved stays within the budget, but for one read on demand).",
            hot.get("reserved_bytes", 0),
        ),
        (
            "molora_hotset_memory_only_bytes",
            "Bytes of CPU-tier adapters that exist only in memory (never dropped, outside the budget).",
            hot.get("memory_only_bytes", 0),
        ),
        (
            "molora_hotset_host_bytes",
            "Host bytes of every adapter the hot set holds: CPU tier, resident adapters' own copies, finished reads.",
            hot.get("host_bytes", 0),
        ),
        (
            "molora_adapter_pins",
            "Adapter pins held by requests in flight (0 when idle).",
            sum((hot.get("pinned") or {}).values()),
        ),
        (
            "molora_prefix_cache_blocks",
            "KV blocks holding reusable prefix content (held or cached).",
            prefix.get("cached_blocks", 0),
        ),
        (
            "molora_prefix_cache_hit_rate",
            "Prompt tokens served from the prefix cache over tokens looked up.",
            prefix.get("hit_rate", 0.0),
        ),
    )
    for name, help_, value in gauges:
        yield GaugeMetricFamily(name, help_, value=value)
    if v.lora is not None:
        labels, read_at = v.lora
        info = GaugeMetricFamily(
            LORA_INFO,
            "Adapters of the running and the waiting requests (comma-separated) "
            "and the slots (max_lora); the value is the Unix time this was read.",
            labels=list(LORA_INFO_LABELS),
        )
        info.add_metric(list(labels), read_at)
        yield info
    counters = (  # CounterMetricFamily strips the `_total` and the exposition puts it back
        ("molora_engine_steps_total", "Engine steps run.", stats.get("steps", 0)),
        ("molora_generation_tokens_total", "Tokens the engine generated.", stats.get("tokens_generated", 0)),
        (
            "molora_engine_preemptions_total",
            "Requests preempted for lack of KV blocks or slots.",
            stats.get("num_preemptions", 0),
        ),
        ("molora_hotset_hits_total", "Adapter lookups served from a hot-set slot.", hot.get("hits", 0)),
        ("molora_hotset_misses_total", "Adapter lookups that had to load into a slot.", hot.get("misses", 0)),
        ("molora_hotset_evictions_total", "Adapters evicted from a hot-set slot.", hot.get("evictions", 0)),
        ("molora_hotset_disk_reads_total", "Adapters read from disk (not in the CPU tier).", hot.get("disk_reads", 0)),
        (
            "molora_hotset_prefetches_total",
            "Adapter reads started when a request was queued (prefetch).",
            hot.get("prefetches", 0),
        ),
        (
            "molora_hotset_prefetch_deferred_total",
            "Prefetches put off because the CPU tier's budget had no room.",
            hot.get("prefetch_deferred", 0),
        ),
        (
            "molora_hotset_load_seconds_total",
            "Time spent loading adapters into slots.",
            hot.get("load_ms_total", 0) / 1000.0,
        ),
        (
            "molora_prefix_cache_queries_total",
            "Prompt tokens looked up in the prefix cache (vLLM's queries).",
            prefix.get("queried_tokens", 0),
        ),
        (
            "molora_prefix_cache_hits_total",
            "Prompt tokens served from the prefix cache (vLLM's prefix_cache_hits).",
            prefix.get("hit_tokens", 0),
        ),
        ("molora_prefix_cache_evictions_total", "Cached KV blocks evicted for new ones.", prefix.get("evictions", 0)),
    )
    for name, help_, value in counters:
        yield CounterMetricFamily(name, help_, value=value)


def _kv_usage(stats: Mapping[str, Any]) -> float:
    total = stats.get("kv_blocks_total", 0)
    return (total - stats.get("kv_blocks_free", 0)) / total if total else 0.0
