"""Per-adapter and per-tenant series of /metrics, with a bounded number of label values.

Per tenant (molora.server.tenants), measured by the server as requests finish: requests, prompt and completion
tokens, requests refused by a tenant limit (`limit`: queued or tokens_per_minute), time to first token and the gaps
between output tokens (histograms). Per adapter: requests whose tokens ran on it (measured as they finish) and, read
from the engine at scrape time (`stats()["hotset"]["adapters"]`, `stats()["tokens_by_adapter"]`): where it lives now
(`molora_adapter_residency{adapter,tier}`, tier slot / cpu / disk, value 1), slot loads, evictions and load time, and
tokens routed to it ('base': none). Beside them, `molora_adapters{tier}` counts every registered adapter by tier.

Bounded cardinality: adapters and tenants each get at most `max_adapters` / `max_tenants` label values of their
own; the rest share the label "other". A name gets its own label the first time it shows traffic while there is
room (at a scrape, the busiest first: the top N by traffic when the room fills) and keeps it while it is
registered, so a counter never moves between labels and `rate()` stays right; later names count under "other". An
adapter that is unloaded gives its label back (molora.server.metrics: forget_adapter): its series go, its counts
leave every family (named or "other"), and the next name with traffic may take the room, so a server that loads and
unloads adapters for days does not end with every label held by a name that is gone. Loaded again, the name is
counted afresh (a counter reset, which `rate()` handles).

Series budget: each tenant label writes 31 histogram series (TTFT: 12 buckets + `+Inf`, `_count`, `_sum`,
`_created`; inter-token: 11 + 4) and 3 counters x 2 (value, `_created`) plus 2 x 2 for refusals by limit: 41, so at
most 17 x 41 = 697 with the default 16 tenant labels and "other". Each adapter label writes at most 1 residency
gauge, 2 for its request counter and 1 each for tokens, loads, evictions and load time: at most 33 x 6 + 3 tiers =
201. Everything else /metrics writes is fixed but for responses by route and status code (tens of series).
`SERIES_BUDGET` bounds the whole page, whatever the number of adapters and tenants; tests/test_usage_metrics.py
checks it with 1,000 adapters and 50 tenants.

Knows the engine's `stats()` keys and tenant names; nothing of FastAPI or the engine object; thread-safe.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

MAX_ADAPTER_LABELS = 32  # a plain choice: a dashboard's worth of adapters
MAX_TENANT_LABELS = 16
OTHER = "other"
TIERS = ("slot", "cpu", "disk")
TENANT_LIMITS = ("queued", "tokens_per_minute")
SERIES_BUDGET = 1500  # every series /metrics writes, at the default label bounds (module docstring)


class BoundedLabels:
    """At most `limit` names get a label of their own, for good; the rest map to OTHER (module docstring)."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self._named: dict[str, None] = {}
        self._gone: set[str] = set()  # released names (unloaded adapters): no label, no "other", until restored
        self._lock = threading.Lock()

    def label(self, name: str) -> str:
        with self._lock:
            if name not in self._named and name not in self._gone and len(self._named) < self.limit:
                self._named[name] = None
            return name if name in self._named else OTHER

    def split(self, counts: Mapping[str, float], hidden: frozenset[str] = frozenset()) -> list[tuple[str, float]]:
        """(label, value) pairs of `counts`: first the names with traffic take the room left, busiest first; then
        each named one (unless hidden) and, once a name is left without a label, OTHER with the sum of those."""
        with self._lock:
            counts = {k: n for k, n in counts.items() if k not in self._gone}
            for name, n in sorted(counts.items(), key=lambda kv: (-kv[1], kv[0])):
                if len(self._named) >= self.limit or n <= 0:
                    break
                self._named.setdefault(name, None)
            named = [(k, counts[k]) for k in self._named if k in counts and k not in hidden]
            rest = [n for k, n in counts.items() if k not in self._named]
        return [*named, (OTHER, sum(rest))] if rest else named

    def named(self, name: str) -> bool:
        with self._lock:
            return name in self._named

    def release(self, name: str) -> bool:
        """`name` is gone: free its label (True if it had one) and leave it out of every split until `restore`."""
        with self._lock:
            self._gone.add(name)
            had = name in self._named
            self._named.pop(name, None)
            return had

    def restore(self, name: str) -> None:
        """`name` is back: it may get a label again like any new name."""
        with self._lock:
            self._gone.discard(name)


class UsageMetrics:
    """The per-adapter and per-tenant instruments in `registry`, and the scrape-time families (module docstring)."""

    def __init__(
        self,
        registry: CollectorRegistry,
        ttft_buckets: Sequence[float],
        itl_buckets: Sequence[float],
        *,
        max_adapters: int = MAX_ADAPTER_LABELS,
        max_tenants: int = MAX_TENANT_LABELS,
    ) -> None:
        self.adapters, self.tenants = BoundedLabels(max_adapters), BoundedLabels(max_tenants)
        r = registry
        self.requests = Counter(
            "molora_tenant_requests", "Finished engine requests per tenant.", ["tenant"], registry=r
        )
        self.prompt_tokens = Counter(
            "molora_tenant_prompt_tokens", "Prompt tokens of finished requests per tenant.", ["tenant"], registry=r
        )
        self.completion_tokens = Counter(
            "molora_tenant_completion_tokens", "Completion tokens per tenant.", ["tenant"], registry=r
        )
        self.refused = Counter(
            "molora_tenant_refused",
            "Requests refused (429) by a per-tenant limit: queued (--tenant-max-queued) or tokens_per_minute.",
            ["tenant", "limit"],
            registry=r,
        )
        self.ttft = Histogram(
            "molora_tenant_time_to_first_token_seconds",
            "Time from arrival to the first token, per tenant.",
            ["tenant"],
            buckets=ttft_buckets,
            registry=r,
        )
        self.itl = Histogram(
            "molora_tenant_inter_token_seconds",
            "Time between two outputs of one request, per tenant.",
            ["tenant"],
            buckets=itl_buckets,
            registry=r,
        )
        self.adapter_requests = Counter(
            "molora_adapter_requests",
            "Finished engine requests with at least one token on each adapter ('base': on none).",
            ["adapter"],
            registry=r,
        )

    def observe(
        self,
        tenant: str,
        adapters: Iterable[str | None],
        ttft: float | None,
        gaps: Sequence[float],
        prompt_tokens: int,
        completion_tokens: int,
    ) -> None:
        """One finished engine request of `tenant` whose tokens ran on `adapters` (None: the base model)."""
        t = self.tenants.label(tenant)
        self.requests.labels(tenant=t).inc()
        self.prompt_tokens.labels(tenant=t).inc(prompt_tokens)
        self.completion_tokens.labels(tenant=t).inc(completion_tokens)
        if ttft is not None:
            self.ttft.labels(tenant=t).observe(ttft)
        itl = self.itl.labels(tenant=t)
        for g in gaps:
            itl.observe(g)
        for a in {a if a is not None else "base" for a in adapters}:
            self.adapter_requests.labels(adapter=self.adapters.label(a)).inc()

    def release_adapter(self, name: str) -> None:
        """Adapter `name` was unloaded: its label is free again and its request counter's series goes."""
        if self.adapters.release(name):
            try:
                self.adapter_requests.remove(name)
            except KeyError:  # labelled at a scrape, never counted as a finished request
                pass

    def refuse(self, tenant: str, limit: str) -> None:
        if limit not in TENANT_LIMITS:  # a free-form label value would grow a series per typo
            raise ValueError(f"unknown tenant limit {limit!r}; expected one of {', '.join(TENANT_LIMITS)}")
        self.refused.labels(tenant=self.tenants.label(tenant), limit=limit).inc()

    def families(self, stats: Mapping[str, Any], hidden: frozenset[str]) -> Iterator[Metric]:
        """The scrape-time per-adapter families from the engine's `stats()`; `hidden`: unloaded adapters."""
        tokens = {str(k): float(n) for k, n in (stats.get("tokens_by_adapter", {}) or {}).items()}
        per = (stats.get("hotset", {}) or {}).get("adapters", {}) or {}
        token_split = self.adapters.split(tokens, hidden)  # admits the busiest first
        tiers = GaugeMetricFamily("molora_adapters", "Registered adapters by where they live now.", labels=["tier"])
        for tier in TIERS:
            tiers.add_metric([tier], sum(1 for a in per.values() if a.get("tier") == tier))
        yield tiers
        residency = GaugeMetricFamily(
            "molora_adapter_residency",
            "Where an adapter lives now (value 1 on its tier: slot, cpu or disk); adapters with a label of their own.",
            labels=["adapter", "tier"],
        )
        for name, a in per.items():
            if self.adapters.named(name) and name not in hidden:
                residency.add_metric([name, str(a.get("tier"))], 1)
        yield residency
        for key, metric, help_, scale in (
            ("loads", "molora_adapter_loads", "Copies of an adapter into a hot-set slot.", 1.0),
            ("evictions", "molora_adapter_evictions", "Evictions of an adapter from its slot.", 1.0),
            ("load_ms", "molora_adapter_load_seconds", "Time spent copying an adapter into slots.", 1e-3),
        ):
            family = CounterMetricFamily(metric, help_, labels=["adapter"])
            for label, value in self.adapters.split({n: float(a.get(key, 0)) * scale for n, a in per.items()}, hidden):
                family.add_metric([label], value)
            yield family
        family = CounterMetricFamily(
            "molora_adapter_tokens", "Tokens routed to each adapter ('base': none).", labels=["adapter"]
        )
        for label, value in token_split:
            family.add_metric([label], value)
        yield family
