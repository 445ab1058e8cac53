"""Server metrics and their Prometheus text exposition (format 0.0.4), without a client library.

Owns: the latency histograms the server measures itself (time to first token, time per output token,
request latency), counters of HTTP responses by route and status, of prompt and completion tokens, the
tokens/s gauge over a sliding window, and `render()`, which writes all of them plus the engine's own
counters (queue depth, running, KV blocks, hot-set hits/misses/evictions, tokens per adapter) from a
`stats()` dict. Knows nothing of FastAPI or the engine object; every method is thread-safe.
"""

from __future__ import annotations

import bisect
import threading
import time
from collections import deque
from collections.abc import Mapping, Sequence
from typing import Any

TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)
LATENCY_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
RATE_WINDOW_S = 10.0


class Histogram:
    """Cumulative-bucket histogram (le upper bounds, plus +Inf), sum and count."""

    def __init__(self, buckets: Sequence[float]) -> None:
        self.bounds = tuple(sorted(buckets))
        self.counts = [0] * (len(self.bounds) + 1)  # last: above every bound
        self.sum = 0.0
        self.count = 0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.bounds, value)] += 1
        self.sum += value
        self.count += 1

    def lines(self, name: str) -> list[str]:
        out, running = [], 0
        for bound, n in zip(self.bounds, self.counts):
            running += n
            out.append(f'{name}_bucket{{le="{bound:g}"}} {running}')
        out.append(f'{name}_bucket{{le="+Inf"}} {self.count}')
        out += [f"{name}_sum {self.sum:.6f}", f"{name}_count {self.count}"]
        return out


class ServerMetrics:
    """What the server measures; `render(stats, ...)` adds the engine's view."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.ttft = Histogram(TTFT_BUCKETS)
        self.tpot = Histogram(TPOT_BUCKETS)
        self.latency = Histogram(LATENCY_BUCKETS)
        self.responses: dict[tuple[str, int], int] = {}
        self.prompt_tokens = 0
        self.completion_tokens = 0
        self.finish_reasons: dict[str, int] = {}
        self._window: deque[tuple[float, int]] = deque()  # (monotonic time, tokens of one step)
        self.started = time.time()

    # -------------------------------------------------------------------------------------- observe
    def observe_step(self, new_tokens: int, seconds: float) -> None:
        """Called by the engine thread after every step."""
        now = time.monotonic()
        with self._lock:
            self._window.append((now, new_tokens))
            self._trim(now)

    def observe_request(self, *, ttft: float | None, tpot: float | None, latency: float, prompt_tokens: int,
                        completion_tokens: int, finish_reason: str | None) -> None:
        """One finished engine request (one choice), as the handler saw it."""
        with self._lock:
            if ttft is not None:
                self.ttft.observe(ttft)
            if tpot is not None:
                self.tpot.observe(tpot)
            self.latency.observe(latency)
            self.prompt_tokens += prompt_tokens
            self.completion_tokens += completion_tokens
            reason = finish_reason or "none"
            self.finish_reasons[reason] = self.finish_reasons.get(reason, 0) + 1

    def observe_response(self, route: str, status: int) -> None:
        with self._lock:
            key = (route, status)
            self.responses[key] = self.responses.get(key, 0) + 1

    def tokens_per_second(self) -> float:
        now = time.monotonic()
        with self._lock:
            self._trim(now)
            return sum(n for _, n in self._window) / RATE_WINDOW_S

    def _trim(self, now: float) -> None:
        while self._window and self._window[0][0] < now - RATE_WINDOW_S:
            self._window.popleft()

    # -------------------------------------------------------------------------------------- render
    def render(self, stats: Mapping[str, Any], *, in_flight: int, max_in_flight: int, draining: bool) -> str:
        """Prometheus text: server gauges and histograms, then the engine's `stats()` dict."""
        rate = self.tokens_per_second()
        out: list[str] = []
        metric = _Writer(out)
        metric("molora_requests_in_flight", "gauge", "Engine requests admitted by the server, not finished.",
               [("", in_flight)])
        metric("molora_requests_max_in_flight", "gauge", "Engine requests the server admits at once.",
               [("", max_in_flight)])
        metric("molora_draining", "gauge", "1 while the server drains before exiting.", [("", int(draining))])
        metric("molora_requests_waiting", "gauge", "Requests queued in the engine (queue depth).",
               [("", stats.get("num_waiting", 0))])
        metric("molora_requests_running", "gauge", "Requests the engine is running.",
               [("", stats.get("num_running", 0))])
        metric("molora_kv_blocks_total", "gauge", "KV-cache blocks in the pool.",
               [("", stats.get("kv_blocks_total", 0))])
        metric("molora_kv_blocks_free", "gauge", "Free KV-cache blocks.", [("", stats.get("kv_blocks_free", 0))])
        metric("molora_tokens_per_second", "gauge", f"Generated tokens per second over the last {RATE_WINDOW_S:g} s.",
               [("", round(rate, 3))])
        metric("molora_engine_steps_total", "counter", "Engine steps run.", [("", stats.get("steps", 0))])
        metric("molora_generation_tokens_total", "counter", "Tokens the engine generated.",
               [("", stats.get("tokens_generated", 0))])
        hot = stats.get("hotset", {}) or {}
        metric("molora_engine_preemptions_total", "counter", "Requests preempted for lack of KV blocks or slots.",
               [("", stats.get("num_preemptions", 0))])
        metric("molora_hotset_slots", "gauge", "Adapter slots in the hot set.", [("", hot.get("slots", 0))])
        metric("molora_hotset_slots_used", "gauge", "Hot-set slots holding an adapter.",
               [("", hot.get("slots_used", 0))])
        metric("molora_hotset_hits_total", "counter", "Adapter lookups served from a hot-set slot.",
               [("", hot.get("hits", 0))])
        metric("molora_hotset_misses_total", "counter", "Adapter lookups that had to load into a slot.",
               [("", hot.get("misses", 0))])
        metric("molora_hotset_evictions_total", "counter", "Adapters evicted from a hot-set slot.",
               [("", hot.get("evictions", 0))])
        metric("molora_hotset_disk_reads_total", "counter", "Adapters read from disk (not in the CPU tier).",
               [("", hot.get("disk_reads", 0))])
        metric("molora_hotset_load_seconds_total", "counter", "Time spent loading adapters into slots.",
               [("", hot.get("load_ms_total", 0) / 1000.0)])
        per_adapter = stats.get("tokens_by_adapter", {}) or {}
        metric("molora_adapter_tokens_total", "counter", "Tokens routed to each adapter ('base': none).",
               [(_labels(adapter=name), n) for name, n in sorted(per_adapter.items(), key=lambda kv: str(kv[0]))])
        with self._lock:
            metric("molora_prompt_tokens_total", "counter", "Prompt tokens of finished requests.",
                   [("", self.prompt_tokens)])
            metric("molora_completion_tokens_total", "counter", "Completion tokens of finished requests.",
                   [("", self.completion_tokens)])
            metric("molora_request_finish_total", "counter", "Finished engine requests by finish reason.",
                   [(_labels(reason=r), n) for r, n in sorted(self.finish_reasons.items())])
            metric("molora_http_responses_total", "counter", "HTTP responses by route and status code.",
                   [(_labels(route=r, code=str(c)), n) for (r, c), n in sorted(self.responses.items())])
            for name, hist, help_ in (
                    ("molora_time_to_first_token_seconds", self.ttft, "Time from arrival to the first token."),
                    ("molora_time_per_output_token_seconds", self.tpot, "Mean time between output tokens."),
                    ("molora_request_latency_seconds", self.latency, "Time from arrival to the last token.")):
                out += [f"# HELP {name} {help_}", f"# TYPE {name} histogram", *hist.lines(name)]
        return "\n".join(out) + "\n"


class _Writer:
    def __init__(self, out: list[str]) -> None:
        self.out = out

    def __call__(self, name: str, kind: str, help_: str, samples: list[tuple[str, float]]) -> None:
        self.out += [f"# HELP {name} {help_}", f"# TYPE {name} {kind}"]
        self.out += [f"{name}{labels} {_num(value)}" for labels, value in samples]


def _labels(**kv: str | None) -> str:
    parts = [f'{k}="{_escape(str(v))}"' for k, v in kv.items()]
    return "{" + ",".join(parts) + "}"


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def _num(value: float) -> str:
    return str(int(value)) if float(value).is_integer() else f"{float(value):.6g}"
