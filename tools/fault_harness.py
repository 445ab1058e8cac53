"""Fault and load harness: the real engine behind the server on 127.0.0.1, hit with traffic that breaks things.

    python -m tools.fault_harness [--requests 2000] [--concurrency 64] [--out docs/fault_harness.json]
    python -m tools.fault_harness --render-only        # docs/reliability.md from the record

Starts `molora serve` on the embedded default bundle in a child process (with injected faults: a step
whose batch holds a prompt starting with the poison marker raises, as a kernel bug on one request would; one
step hangs for the liveness check at the end), then
sends `--requests` requests from `--concurrency` closed-loop clients, each of one kind (seeded draw):

    ok          a chat or completion request, streamed or not, per-token routing or a pinned adapter
    disconnect  a stream the client drops after its first events
    deadline    a request with a short `molora.timeout` (it may also finish in time)
    invalid     a malformed body: bad JSON, unknown field, out-of-range value, unknown model, wrong type
    poison      a completion whose prompt starts with the poison marker: its step raises
    extra       a request pinned to an adapter an admin loads and unloads (drain or force) during traffic

Tenants join and leave (`user`: a flooding tenant sends FLOOD_SHARE of all requests throughout, the rest come
from tenants each active over a window of TENANT_SPAN requests, a new one every TENANT_STRIDE) and the server runs
`--scheduling-policy fair`: the no-starvation invariant is that every `ok` request completes within the server's
request deadline (REQUEST_TIMEOUT_S), whichever tenant sent it.

Each request ends as completed, failed by design (the failure its kind exists to cause: 4xx for invalid,
504 for a deadline, 500 engine_error for poison, a dropped stream for disconnect, 404 / 500 request_aborted
for an extra adapter being unloaded), or failed otherwise (anything else, including a client timeout: a hung
request). At the end, with nothing in flight, the KV blocks and adapter pins must be back at their start
values. Writes the record (`--out`) and renders docs/reliability.md from it.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx

from molora.bench.sse import SSEStream
from molora.docblock import from_docs, markers, replace_block, wrap

ROOT = Path(__file__).resolve().parents[1]
# Fault markers: a prompt that starts with three of these token ids (text never tokenizes to that at position
# 0, where chat prompts hold the template's tokens) makes its step raise (POISON) or sleep HANG_S (HANG).
POISON, HANG = 49150, 49151
HANG_S, STALL_S = 12.0, 4.0  # the injected hang; the server's --stall-timeout
ADMIN = "harness-admin"
AUTH = {"Authorization": f"Bearer {ADMIN}"}  # an admin key is also an API key
KINDS = {"ok": 0.62, "disconnect": 0.08, "deadline": 0.08, "invalid": 0.10, "poison": 0.04, "extra": 0.08}
CLIENT_TIMEOUT_S = 300.0
REQUEST_TIMEOUT_S = 240.0  # the server's deadline for every request (Limits.request_timeout_s)
FLOOD_SHARE, TENANT_SPAN, TENANT_STRIDE = 0.3, 400, 100  # tenants joining and leaving (module docstring)


# ---------------------------------------------------------------------------------------------- server child


def serve_child(port: int) -> None:
    """The server with one injected fault (see the module docstring)."""
    from molora.engine import EngineConfig
    from molora.server import serve
    from molora.server.generation import Limits
    from molora.server.launch import build_engine

    engine = build_engine(engine_config=EngineConfig(scheduling_policy="fair"))
    run = engine._run

    def faulty(scheduled):
        if any(s.request.prompt_ids[:3] == [POISON] * 3 for s in scheduled):
            raise RuntimeError("injected step fault (poison prompt)")
        if not hung and any(s.request.prompt_ids[:3] == [HANG] * 3 for s in scheduled):
            hung.append(True)  # once
            time.sleep(HANG_S)
        return run(scheduled)

    hung: list[bool] = []
    engine._run = faulty
    serve(
        engine=engine,
        port=port,
        admin_keys=[ADMIN],
        adapter_roots=[adapter_root()],
        log_level="warning",
        limits=Limits(request_timeout_s=REQUEST_TIMEOUT_S, queue_timeout_s=120),
        stall_s=STALL_S,
    )


def adapter_root() -> Path:
    import molora

    return Path(molora.__file__).parent / "default_bundle" / "adapters"


def start_server() -> tuple[subprocess.Popen, str]:
    from molora.server.launch import free_port

    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, __file__, "--serve", str(port)], env={**os.environ, "PYTHONUNBUFFERED": "1"}
    )
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"the server exited with {proc.returncode}")
        try:
            if httpx.get(base + "/ready", timeout=1).status_code == 200:
                return proc, base
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    proc.kill()
    raise SystemExit("the server did not become ready in 300 s")


# ---------------------------------------------------------------------------------------------- traffic


def plan(n: int, seed: int, adapters: list[str], model: str) -> list[dict]:
    from molora.bench.serve import make_prompts

    rng = random.Random(seed)
    prompts = make_prompts(max(n, 50), seed)
    kinds, weights = zip(*KINDS.items())
    work = []
    for i in range(n):
        kind = rng.choices(kinds, weights)[0]
        job = {
            "i": i,
            "kind": kind,
            "prompt": prompts[i % len(prompts)],
            "stream": rng.random() < 0.5,
            "chat": rng.random() < 0.7,
            "max_tokens": rng.randint(4, 16),
            "model": rng.choice([model] * 3 + [f"{model}:{a}" for a in adapters]),
            "tenant": tenant(i, rng),
        }
        if kind == "deadline":
            job.update(timeout=round(rng.uniform(0.02, 0.6), 3), max_tokens=64)
        elif kind == "disconnect":
            job.update(stream=True, drop_after=rng.randint(1, 3), max_tokens=48)
        elif kind == "invalid":
            job["bad"] = rng.choice(["json", "field", "range", "model", "type", "empty"])
        elif kind == "extra":
            job["model"] = f"{model}:extra"
        work.append(job)
    return work


def tenant(i: int, rng: random.Random) -> str:
    """Job i's tenant: the flooding one with probability FLOOD_SHARE, else one of those active at i (tenant k is
    active for jobs k * TENANT_STRIDE up to k * TENANT_STRIDE + TENANT_SPAN)."""
    if rng.random() < FLOOD_SHARE:
        return "flood"
    last = i // TENANT_STRIDE
    return f"t{rng.randint(max(0, last - TENANT_SPAN // TENANT_STRIDE + 1), last)}"


def body(job: dict) -> tuple[str, Any]:
    """(path, JSON body or raw bytes) of a job."""
    opts = {"timeout": job["timeout"]} if "timeout" in job else None
    if job["kind"] == "poison":
        return "/v1/completions", {
            "model": job["model"].split(":")[0],
            "prompt": [POISON] * 3 + [17, 23, 5],
            "max_tokens": job["max_tokens"],
            "stream": job["stream"],
        }
    if job["chat"]:
        b = {
            "model": job["model"],
            "messages": [{"role": "user", "content": job["prompt"]}],
            "max_tokens": job["max_tokens"],
            "temperature": 0,
            "stream": job["stream"],
        }
    else:
        b = {
            "model": job["model"],
            "prompt": job["prompt"],
            "max_tokens": job["max_tokens"],
            "temperature": 0,
            "stream": job["stream"],
        }
    b["user"] = job["tenant"]
    if opts:
        b["molora"] = opts
    bad = job.get("bad")
    if bad == "json":
        return "/v1/chat/completions", json.dumps(b)[:-7].encode()
    if bad == "field":
        b["frobnicate"] = True
    elif bad == "range":
        b["temperature"] = 7.5
    elif bad == "model":
        b["model"] = "no-such-model"
    elif bad == "type":
        b["max_tokens"] = "many"
    elif bad == "empty":
        b = {"model": job["model"], "messages": []} if job["chat"] else {"model": job["model"], "prompt": ""}
    return ("/v1/chat/completions" if job["chat"] else "/v1/completions"), b


BY_DESIGN = {  # kind -> (status, error code or None) pairs that are that kind's intended failure
    "invalid": lambda s, c: 400 <= s < 500,
    "deadline": lambda s, c: s == 504 and c == "timeout",
    "poison": lambda s, c: s == 500 and c == "engine_error",
    "extra": lambda s, c: (s == 404 and c == "model_not_found") or (s == 500 and c == "request_aborted"),
}


async def one(client: httpx.AsyncClient, job: dict) -> dict:
    path, b = body(job)
    t0 = time.perf_counter()
    res = {"i": job["i"], "kind": job["kind"], "stream": job["stream"]}
    kw = {"content": b, "headers": {"content-type": "application/json"}} if isinstance(b, bytes) else {"json": b}
    try:
        if not job["stream"] or job["kind"] == "invalid":
            r = await client.post(path, **kw)
            res["status"] = r.status_code
            data = r.json()
            if r.status_code == 200:
                res["finish"] = data["choices"][0]["finish_reason"]
            else:
                res["code"] = data.get("error", {}).get("code")
        else:
            async with client.stream("POST", path, **kw) as r:
                res["status"] = r.status_code
                if r.status_code != 200:
                    res["code"] = json.loads(await r.aread()).get("error", {}).get("code")
                else:
                    events = 0
                    stream = SSEStream(r)
                    async for event in stream:
                        if "error" in event:
                            res["code"] = event["error"]["code"]
                            break
                        events += 1
                        for c in event.get("choices", []):
                            if c.get("finish_reason"):
                                res["finish"] = c["finish_reason"]
                        if job["kind"] == "disconnect" and events >= job["drop_after"]:
                            res["dropped"] = True
                            break
                    if stream.done:
                        res["done"] = True
    except httpx.TimeoutException:
        res["hung"] = True
    except Exception as e:  # connection reset, bad JSON from the server: not by design
        res["exception"] = f"{type(e).__name__}: {e}"
    res["latency"] = time.perf_counter() - t0
    res["outcome"] = classify(job, res)
    return res


def classify(job: dict, res: dict) -> str:
    if res.get("hung") or res.get("exception"):
        return "failed_otherwise"
    status, code = res.get("status"), res.get("code")
    if job["kind"] == "disconnect" and res.get("dropped"):
        return "by_design"
    if (
        status == 200
        and code is None
        and res.get("finish") in ("stop", "length")
        and (not job["stream"] or res.get("done"))
    ):
        return "completed"
    if job["kind"] == "deadline" and status == 200 and code == "timeout":  # the stream's in-band deadline
        return "by_design"
    if job["kind"] == "poison" and status == 200 and code == "engine_error":
        return "by_design"
    if job["kind"] == "extra" and status == 200 and code == "request_aborted":
        return "by_design"
    check = BY_DESIGN.get(job["kind"])
    return "by_design" if check is not None and status != 200 and check(status, code) else "failed_otherwise"


async def admin_loop(client: httpx.AsyncClient, stop: asyncio.Event, rng: random.Random, log: list) -> None:
    """Load 'extra' (a copy of a shipped adapter), let traffic use it, unload it (drain, or force)."""
    headers = AUTH
    source = sorted(p.name for p in adapter_root().iterdir() if p.is_dir())
    while not stop.is_set():
        r = await client.post("/v1/adapters", json={"name": "extra", "path": rng.choice(source)}, headers=headers)
        log.append(("load", r.status_code))
        await asyncio.sleep(rng.uniform(1.0, 3.0))
        force = rng.random() < 0.3
        r = await client.delete("/v1/adapters/extra", params={"force": str(force).lower()}, headers=headers)
        log.append(("force-unload" if force else "unload", r.status_code))
        await asyncio.sleep(rng.uniform(0.5, 1.5))


async def drive(base: str, work: list[dict], concurrency: int, seed: int) -> tuple[list[dict], list, float]:
    limits = httpx.Limits(max_connections=concurrency + 8, max_keepalive_connections=concurrency + 8)
    async with httpx.AsyncClient(base_url=base, timeout=CLIENT_TIMEOUT_S, limits=limits, headers=AUTH) as client:
        queue = list(reversed(work))
        results: list[dict] = []
        stop = asyncio.Event()
        admin_log: list = []
        admin = asyncio.create_task(admin_loop(client, stop, random.Random(seed + 1), admin_log))

        async def worker() -> None:
            while queue:
                results.append(await one(client, queue.pop()))

        probes: list[int] = []

        async def prober() -> None:  # liveness during traffic: a false stall would show as a 503 here
            while not stop.is_set():
                probes.append((await client.get("/health")).status_code)
                await asyncio.sleep(0.5)

        t0 = time.perf_counter()
        probe = asyncio.create_task(prober())
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        wall = time.perf_counter() - t0
        stop.set()
        await admin
        await probe
    return results, admin_log, wall, probes


async def hang_probe(base: str, model: str) -> dict:
    """One request whose first step hangs HANG_S: how long until /health says 503, and until it is 200 again."""
    async with httpx.AsyncClient(base_url=base, timeout=CLIENT_TIMEOUT_S, headers=AUTH) as client:
        t0 = time.perf_counter()
        req = asyncio.create_task(
            client.post("/v1/completions", json={"model": model, "prompt": [HANG] * 3 + [17, 5], "max_tokens": 2})
        )
        seen = back = None
        while (not req.done() or (seen is not None and back is None)) and time.perf_counter() - t0 < 120:
            status = (await client.get("/health")).status_code
            now = time.perf_counter() - t0
            if status == 503 and seen is None:
                seen = now
            if status == 200 and seen is not None and back is None:
                back = now
            await asyncio.sleep(0.05)
        r = await req
    return {
        "stall_timeout_s": STALL_S,
        "hang_s": HANG_S,
        "reported_after_s": seen,
        "healthy_again_after_s": back,
        "request_status": r.status_code,
        "within_2x_stall": seen is not None and seen <= 2 * STALL_S,
    }


def metric(base: str, name: str, labels: str = "") -> float:
    text = httpx.get(base + "/metrics", timeout=30, headers=AUTH).text
    for line in text.splitlines():
        if line.startswith(name + labels + " "):
            return float(line.split()[-1])
    return 0.0


def settle(base: str, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if (
            metric(base, "molora_requests_in_flight") == 0
            and metric(base, "molora_requests_running") == 0
            and metric(base, "molora_requests_waiting") == 0
        ):
            return
        time.sleep(0.5)
    raise SystemExit("requests still in flight 120 s after the traffic ended: lost or hung")


def pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    s = sorted(values)
    return s[min(len(s) - 1, int(round(q * (len(s) - 1))))]


def measure(args: argparse.Namespace) -> dict:
    proc, base = start_server()
    try:
        r = httpx.get(base + "/v1/models", timeout=30, headers=AUTH)
        if r.status_code != 200:
            raise SystemExit(f"GET /v1/models: {r.status_code} {r.text}")
        models = r.json()["data"]
        model = models[0]["id"]
        adapters = [m["adapter"] for m in models if m.get("adapter")]
        start = {
            "kv_free": metric(base, "molora_kv_blocks_free"),
            "kv_total": metric(base, "molora_kv_blocks_total"),
            "pins": metric(base, "molora_adapter_pins"),
        }
        work = plan(args.requests, args.seed, adapters, model)
        results, admin_log, wall, probes = asyncio.run(drive(base, work, args.concurrency, args.seed))
        settle(base)
        hang = asyncio.run(hang_probe(base, model))
        settle(base)
        end = {"kv_free": metric(base, "molora_kv_blocks_free"), "pins": metric(base, "molora_adapter_pins")}
        health = httpx.get(base + "/health", timeout=30).json()
        server = {
            name: {kind: metric(base, name, f'{{kind="{kind}"}}') for kind in kinds}
            for name, kinds in (
                ("molora_engine_failures_total", ("step", "isolated", "restart")),
                ("molora_deadline_expired_total", ("request", "queue")),
            )
        }
    finally:
        proc.terminate()
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
    outcomes: dict[str, dict[str, int]] = {}
    for r in results:
        outcomes.setdefault(r["kind"], {}).setdefault(r["outcome"], 0)
        outcomes[r["kind"]][r["outcome"]] += 1
    done = [r["latency"] for r in results if r["outcome"] == "completed"]
    ok_by_tenant: dict[str, list[dict]] = {}
    for r in results:
        if r["kind"] == "ok":
            ok_by_tenant.setdefault(work[r["i"]]["tenant"], []).append(r)
    otherwise = [r for r in results if r["outcome"] == "failed_otherwise"]
    return {
        "command": f"python -m tools.fault_harness --requests {args.requests} --concurrency {args.concurrency} "
        f"--seed {args.seed}",
        "bundle": "embedded default (SmolLM2-135M-Instruct, 4 adapters, learned routing), float32, CPU",
        "requests": len(results),
        "concurrency": args.concurrency,
        "wall_s": round(wall, 1),
        "completed": sum(r["outcome"] == "completed" for r in results),
        "failed_by_design": sum(r["outcome"] == "by_design" for r in results),
        "failed_otherwise": len(otherwise),
        "hung": sum(bool(r.get("hung")) for r in results),
        "failed_otherwise_examples": otherwise[:10],
        "outcomes_by_kind": outcomes,
        "latency_completed_s": {
            "p50": pct(done, 0.5),
            "p99": pct(done, 0.99),
            "mean": statistics.fmean(done) if done else None,
        },
        "kv_blocks": {
            "total": start["kv_total"],
            "free_at_start": start["kv_free"],
            "free_at_end": end["kv_free"],
            "leaked": start["kv_free"] - end["kv_free"],
        },
        "adapter_pins": {"at_start": start["pins"], "at_end": end["pins"]},
        "admin_actions": {f"{a} {s}": sum(1 for x in admin_log if x == (a, s)) for a, s in sorted(set(admin_log))},
        "server_counters": server,
        "health_at_end": health,
        "health_probes_during_traffic": {"count": len(probes), "not_200": sum(p != 200 for p in probes)},
        "hung_step": hang,
        "tenants": {
            "policy": "fair",
            "count": len({job["tenant"] for job in work}),
            "flood_share": FLOOD_SHARE,
            "request_deadline_s": REQUEST_TIMEOUT_S,
            "ok_requests": sum(len(v) for v in ok_by_tenant.values()),
            "ok_not_completed": sum(r["outcome"] != "completed" for v in ok_by_tenant.values() for r in v),
            "worst_ok_latency_s": max((r["latency"] for v in ok_by_tenant.values() for r in v), default=None),
            "worst_tenant_median_s": max(
                (statistics.median(r["latency"] for r in v) for v in ok_by_tenant.values()), default=None
            ),
        },
    }


# ---------------------------------------------------------------------------------------------- render


FUZZ_BLOCK = "<!-- fuzz:begin"  # the page's second part, rendered by tools/fuzz_server.py


def render(record: dict) -> str:
    lat = record["latency_completed_s"]
    rows = ["| kind | completed | failed by design | failed otherwise |", "|---|---:|---:|---:|"]
    for kind in KINDS:
        o = record["outcomes_by_kind"].get(kind, {})
        rows.append(f"| {kind} | {o.get('completed', 0)} | {o.get('by_design', 0)} | {o.get('failed_otherwise', 0)} |")
    f = record["server_counters"]["molora_engine_failures_total"]
    d = record["server_counters"]["molora_deadline_expired_total"]
    kv = record["kv_blocks"]
    return "\n".join(
        [
            "# Reliability under faults",
            "",
            "Rendered by `tools/fault_harness.py --render-only` from `docs/fault_harness.json`; measured with",
            f"`{record['command']}` on {record['bundle']}.",
            "",
            f"{record['requests']} requests from {record['concurrency']} concurrent clients in {record['wall_s']} s: "
            f"**{record['completed']} completed, {record['failed_by_design']} failed by design, "
            f"{record['failed_otherwise']} failed otherwise** ({record['hung']} hung).",
            "",
            *rows,
            "",
            f"- KV blocks: {kv['free_at_start']:.0f} of {kv['total']:.0f} free at the start, {kv['free_at_end']:.0f} "
            f"at the end (leaked: {kv['leaked']:.0f}); adapter pins {record['adapter_pins']['at_start']:.0f} -> "
            f"{record['adapter_pins']['at_end']:.0f}.",
            f"- Latency of completed requests: p50 {lat['p50']:.2f} s, p99 {lat['p99']:.2f} s.",
            f"- Server counters: engine failures step {f['step']:.0f}, isolated {f['isolated']:.0f}, restarts "
            f"{f['restart']:.0f}; deadlines expired in the engine: request {d['request']:.0f}, queue {d['queue']:.0f}.",
            f"- Admin actions during traffic: {record['admin_actions']}.",
            "- Liveness: /health polled every 0.5 s during traffic answered "
            f"{record['health_probes_during_traffic']['count']}"
            f" times, {record['health_probes_during_traffic']['not_200']} not 200 (no false stall at --stall-timeout "
            f"{record['hung_step']['stall_timeout_s']:g} s). Then one step hung {record['hung_step']['hang_s']:g} s "
            f"(injected): /health answered 503 after {_s(record['hung_step']['reported_after_s'])} (goal: within 2x "
            f"the stall timeout, {2 * record['hung_step']['stall_timeout_s']:g} s) and 200 again "
            f"{_s(record['hung_step']['healthy_again_after_s'])} after the request was sent; the request itself "
            f"answered {record['hung_step']['request_status']}.",
            *tenant_lines(record),
            "",
            "Kinds: `ok` plain requests (chat or completion, streamed or not, routed or pinned); `disconnect` streams",
            "dropped after 1-3 events; `deadline` requests with `molora.timeout` of 0.02-0.6 s (some finish in time);",
            "`invalid` malformed bodies; `poison` prompts whose step raises (an injected fault: only they may fail);",
            "`extra` requests pinned to an adapter that an admin loads and unloads (drain or force) during traffic.",
            "",
        ]
    )


def tenant_lines(record: dict) -> list[str]:
    t = record.get("tenants")
    if t is None:  # a record from before tenants were part of the run
        return []
    return [
        f"- Tenants (no starvation): {t['count']} tenants joining and leaving (`user`), one sending "
        f"{t['flood_share']:.0%} of all requests throughout, under `--scheduling-policy {t['policy']}`: "
        f"{t['ok_requests'] - t['ok_not_completed']} of {t['ok_requests']} `ok` requests completed within the "
        f"{t['request_deadline_s']:g} s request deadline; the slowest took {_s(t['worst_ok_latency_s'])}, the "
        f"worst tenant's median {_s(t['worst_tenant_median_s'])}."
    ]


def _s(seconds: float | None) -> str:
    return "never" if seconds is None else f"{seconds:.2f} s"


BEGIN, END = markers("reliability", "tools/fault_harness.py")


def readme_block(record: dict) -> str:
    lat, kv = record["latency_completed_s"], record["kv_blocks"]
    return (
        f"- **Under faults** ([docs/reliability.md](docs/reliability.md), `tools/fault_harness.py`): "
        f"{record['requests']} requests from {record['concurrency']} concurrent clients against the default "
        "bundle, with random disconnects, short deadlines, malformed bodies, an adapter loaded and unloaded "
        f"(drain or force) during traffic and injected step faults: {record['completed']} completed, "
        f"{record['failed_by_design']} failed by design, **{record['failed_otherwise']} failed otherwise, "
        f"{record['hung']} hung**; KV blocks leaked {kv['leaked']:.0f}, adapter pins left "
        f"{record['adapter_pins']['at_end']:.0f}; completed requests p50 {lat['p50']:.2f} s, p99 "
        f"{lat['p99']:.2f} s on 2 CPU cores."
    )


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--requests", type=int, default=2000)
    p.add_argument("--concurrency", type=int, default=64)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=str(ROOT / "docs" / "fault_harness.json"))
    p.add_argument("--render-only", action="store_true")
    p.add_argument("--serve", type=int, metavar="PORT", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.serve:
        serve_child(args.serve)
        return 0
    out = Path(args.out)
    if not args.render_only:
        record = measure(args)
        out.write_text(json.dumps(record, indent=1) + "\n")
    record = json.loads(out.read_text())
    reliability = ROOT / "docs" / "reliability.md"
    old = reliability.read_text() if reliability.exists() else ""
    kept = old[old.find(FUZZ_BLOCK) :] if FUZZ_BLOCK in old else ""  # tools/fuzz_server.py's block follows, as is
    reliability.write_text(render(record) + ("\n" + kept if kept else ""))
    page = ROOT / "docs" / "serving.md"  # the summary beside "Running it for others"
    block = from_docs(wrap(BEGIN, END, readme_block(record)))
    page.write_text(replace_block(page.read_text(), BEGIN, END, block, page))
    print(
        json.dumps(
            {
                k: record[k]
                for k in (
                    "requests",
                    "completed",
                    "failed_by_design",
                    "failed_otherwise",
                    "hung",
                    "kv_blocks",
                    "adapter_pins",
                    "latency_completed_s",
                )
            }
        )
    )
    starved = record.get("tenants", {}).get("ok_not_completed", 0)
    return 0 if record["failed_otherwise"] == 0 and record["kv_blocks"]["leaked"] == 0 and not starved else 1


if __name__ == "__main__":
    sys.exit(main())
