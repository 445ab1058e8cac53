"""Many tenants on one server: one tenant floods while others send short requests at a steady rate.

    python -m molora.bench.serve --tenants 4 [--policies fcfs,priority,fair] [--flood 24] [--json OUT]

For each scheduling policy a `molora serve --scheduling-policy P` starts in a child process (the same bundle and
flags each time, `--max-num-seqs` seats) and runs, in an order rotated per repetition:
  alone  the steady tenants only: each of `--tenants` tenants sends `--per-tenant` short requests (`--steady-tokens`
         new tokens), one every `--period` seconds, its start offset by period / tenants (open loop);
  flood  the same, and at time 0 one more tenant sends `--flood` long requests (four prompts joined,
         `--flood-tokens` new tokens) at once.
Every request is streamed with `ignore_eos`, so each policy serves exactly the same tokens; its tenant is the
OpenAI `user` field; under `priority` the flood is sent with priority 1 (vLLM's: lower first), the rest 0.
Reported per policy: the steady tenants' TTFT p50 / p99 alone and under the flood (and their ratio), the flood's
completion time, total output tokens over the makespan (tokens/s) and, from the server's /metrics, the engine
steps, tokens computed (prompt and output), the mean output tokens per step (batch size), preemptions and the time
spent inside engine steps during the flood run.
Ends with one JSON line. Knows the server through HTTP only.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import httpx

from molora.bench.common import emit, rotated
from molora.bench.serve import make_prompts, pct, start_server
from molora.bench.sse import SSEStream

FLOOD = "flood"


@dataclass
class Shot:
    tenant: str
    sent: float  # seconds after the run started
    ttft: float | None = None
    done: float | None = None  # seconds after the run started
    tokens: int = 0
    error: str = ""


async def _send(client: httpx.AsyncClient, model: str, prompt: str, tokens: int, shot: Shot, priority: int) -> None:
    body = {
        "model": model,
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
        "user": shot.tenant,
    }
    if priority:
        body["priority"] = priority
    t0 = time.perf_counter()
    try:
        async with client.stream("POST", "/chat/completions", json=body) as r:
            if r.status_code != 200:
                shot.error = f"{r.status_code}: {(await r.aread())[:200]!r}"
                return
            async for chunk in SSEStream(r):
                if "error" in chunk:
                    shot.error = str(chunk["error"])
                    return
                if chunk.get("usage"):
                    shot.tokens = chunk["usage"]["completion_tokens"]
                if shot.ttft is None and any(c["delta"].get("content") for c in chunk.get("choices", [])):
                    shot.ttft = time.perf_counter() - t0
    except httpx.HTTPError as e:
        shot.error = f"{type(e).__name__}: {e}"
        return
    shot.done = shot.sent + time.perf_counter() - t0


async def run_scenario(url: str, model: str, args: argparse.Namespace, flood: bool, policy: str) -> list[Shot]:
    """One run (module docstring): every request's Shot, in send order."""
    steady_prompts = make_prompts(args.tenants * args.per_tenant, args.seed, mixed_share=0.0)
    long_prompts = make_prompts(4 * args.flood, args.seed + 1, mixed_share=0.0)
    shots: list[Shot] = []
    tasks: list[asyncio.Task] = []
    limits = httpx.Limits(max_connections=args.flood + 4 * args.tenants + 8)
    async with httpx.AsyncClient(base_url=url, timeout=1800, limits=limits) as client:
        t0 = time.perf_counter()

        def launch(tenant: str, prompt: str, tokens: int, priority: int) -> None:
            shot = Shot(tenant, time.perf_counter() - t0)
            shots.append(shot)
            tasks.append(asyncio.create_task(_send(client, model, prompt, tokens, shot, priority)))

        if flood:
            for i in range(args.flood):
                launch(
                    FLOOD, "\n\n".join(long_prompts[4 * i : 4 * i + 4]), args.flood_tokens, int(policy == "priority")
                )
        order = sorted(
            ((j + k / args.tenants) * args.period, k, j) for k in range(args.tenants) for j in range(args.per_tenant)
        )
        for at, k, j in order:
            await asyncio.sleep(max(0.0, at - (time.perf_counter() - t0)))
            launch(f"steady-{k}", steady_prompts[k * args.per_tenant + j], args.steady_tokens, 0)
        await asyncio.gather(*tasks)
    return shots


def _engine_counters(url: str) -> dict[str, float]:
    """The engine's step and token counters from /metrics (the server's base URL, without /v1)."""
    text = httpx.get(url.removesuffix("/v1") + "/metrics", timeout=30).text
    want = (
        "molora_engine_steps_total",
        "molora_generation_tokens_total",
        "molora_prompt_tokens_total",
        "molora_engine_preemptions_total",
        "molora_engine_step_seconds_sum",
    )
    out = {}
    for line in text.splitlines():
        name, _, value = line.partition(" ")
        if name in want:
            out[name] = float(value)
    return out


def summarize(alone: list[Shot], flood: list[Shot], counters: dict[str, float]) -> dict[str, Any]:
    ms = lambda v: None if v is None else round(v * 1000, 1)  # noqa: E731
    steady = lambda shots: [s.ttft for s in shots if s.tenant != FLOOD and s.ttft is not None]  # noqa: E731
    a, f = steady(alone), steady(flood)
    fl = [s for s in flood if s.tenant == FLOOD]
    makespan = max(s.done or 0.0 for s in flood)
    tokens = sum(s.tokens for s in flood)
    steps = counters.get("molora_engine_steps_total", 0.0)
    row = {
        "steady_ttft_alone_p50_ms": ms(pct(a, 50)),
        "steady_ttft_alone_p99_ms": ms(pct(a, 99)),
        "steady_ttft_flood_p50_ms": ms(pct(f, 50)),
        "steady_ttft_flood_p99_ms": ms(pct(f, 99)),
        "flood_first_done_s": round(min(s.done or makespan for s in fl), 2) if fl else None,
        "flood_last_done_s": round(max(s.done or 0.0 for s in fl), 2) if fl else None,
        "makespan_s": round(makespan, 2),
        "output_tokens": tokens,
        "output_tok_s": round(tokens / makespan, 2) if makespan else None,
        "engine_steps": int(steps),
        "output_tokens_per_step": round(counters.get("molora_generation_tokens_total", 0.0) / steps, 2)
        if steps
        else None,
        "prompt_tokens": int(counters.get("molora_prompt_tokens_total", 0.0)),
        "preemptions": int(counters.get("molora_engine_preemptions_total", 0.0)),
        "engine_step_s": round(counters.get("molora_engine_step_seconds_sum", 0.0), 2),
        "errors": sum(bool(s.error) for s in alone + flood),
        "first_error": next((s.error for s in alone + flood if s.error), None),
    }
    for q in (50, 99):
        x, y = row[f"steady_ttft_flood_p{q}_ms"], row[f"steady_ttft_alone_p{q}_ms"]
        row[f"steady_ttft_p{q}_ratio"] = round(x / y, 2) if x and y else None
    return row


def measure(url: str, args: argparse.Namespace, policy: str) -> dict[str, Any]:
    """The two runs of the module docstring against the server at `url` (its base URL, with /v1), after one warm-up
    request: `summarize`'s row, with the engine's counters of the flood run."""
    model = httpx.get(url + "/models", timeout=30).json()["data"][0]["id"]
    asyncio.run(_warm(url, model))
    alone = asyncio.run(run_scenario(url, model, args, False, policy))
    before = _engine_counters(url)
    flood = asyncio.run(run_scenario(url, model, args, True, policy))
    after = _engine_counters(url)
    return summarize(alone, flood, {k: after[k] - before.get(k, 0.0) for k in after})


def measure_policy(
    args: argparse.Namespace, policy: str, extra: Sequence[str] = (), launcher: Sequence[str] = ()
) -> dict[str, Any]:
    """`measure` on a `molora serve --scheduling-policy policy --max-num-seqs ...` child of its own (start_server,
    with `extra` flags and its `launcher`), stopped afterwards."""
    flags = ["--scheduling-policy", policy, "--max-num-seqs", str(args.max_num_seqs), *extra]
    server, url = start_server(args.bundle, args.max_num_seqs, extra=flags, launcher=launcher)
    try:
        return measure(url, args, policy)
    finally:
        server.terminate()
        server.wait(60)


def medians(results: dict[str, list[dict[str, Any]]]) -> dict[str, dict[str, Any]]:
    """Per name (a policy or variant), the median of each numeric field over its runs, and its output tok/s over
    fcfs's when `results` holds fcfs."""
    base = results.get("fcfs")
    summary = {}
    for name, rows in results.items():
        med = {
            k: _median([r[k] for r in rows if r[k] is not None]) for k in rows[0] if isinstance(rows[0][k], float | int)
        }
        if base:
            fcfs_tok = _median([r["output_tok_s"] for r in base if r["output_tok_s"]])
            med["output_tok_s_vs_fcfs"] = round(med["output_tok_s"] / fcfs_tok, 3) if fcfs_tok else None
        summary[name] = med
    return summary


def main(args: argparse.Namespace) -> int:
    policies = [p for p in args.policies.split(",") if p]
    results: dict[str, list[dict[str, Any]]] = {p: [] for p in policies}
    for rep in range(args.repeats):
        for policy in rotated(policies, rep):
            row = measure_policy(args, policy)
            row.update(policy=policy, repeat=rep)
            results[policy].append(row)
            print(json.dumps(row), flush=True)
    summary = medians(results)
    out = {
        "bench": "serve --tenants",
        "bundle": args.bundle or "default",
        "tenants": args.tenants,
        "per_tenant": args.per_tenant,
        "period_s": args.period,
        "steady_tokens": args.steady_tokens,
        "flood": args.flood,
        "flood_tokens": args.flood_tokens,
        "max_num_seqs": args.max_num_seqs,
        "repeats": args.repeats,
        "runs": results,
        "median": summary,
    }
    emit(out, args.json)
    return 0 if all(r["errors"] == 0 for rows in results.values() for r in rows) else 1


async def _warm(url: str, model: str) -> None:
    async with httpx.AsyncClient(base_url=url, timeout=600) as client:
        await _send(client, model, "Warm up.", 4, Shot("warm", 0.0), 0)


def _median(values: Sequence[float]) -> float:
    v = sorted(values)
    return round((v[(len(v) - 1) // 2] + v[len(v) // 2]) / 2, 3) if v else 0.0


def add_arguments(ap: argparse.ArgumentParser) -> None:
    g = ap.add_argument_group("tenants (--tenants N: one flooding tenant and N steady ones, per policy)")
    g.add_argument("--tenants", type=int, default=0, metavar="N", help="steady tenants (0: the concurrency sweep)")
    g.add_argument("--policies", default="fcfs,priority,fair", help="scheduling policies side by side")
    g.add_argument("--per-tenant", type=int, default=8, help="requests per steady tenant (default 8)")
    g.add_argument("--period", type=float, default=4.0, help="seconds between one steady tenant's requests")
    g.add_argument("--steady-tokens", type=int, default=16, help="new tokens per steady request (default 16)")
    g.add_argument("--flood", type=int, default=24, help="long requests the flooding tenant sends at once")
    g.add_argument("--flood-tokens", type=int, default=64, help="new tokens per flood request (default 64)")
    g.add_argument("--max-num-seqs", type=int, default=8, help="the servers' --max-num-seqs (default 8)")
