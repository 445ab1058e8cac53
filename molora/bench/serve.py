"""Load generator for the OpenAI-compatible server: a concurrency sweep with Zipf adapter popularity.

    python -m molora.bench.serve [--url http://host:8000/v1] [--concurrency 1,4,16,64] [--baseline]

Each level runs `--requests` streamed chat requests through `c` concurrent clients (closed loop: a client
sends its next request when the last one ends). Models are drawn with Zipf popularity (p ~ 1/rank^s) over
the plain bundle (per-token routing) and every `bundle:adapter` (pinned) that `/v1/models` lists; prompts
mix single-skill BBH-style questions and multi-skill ones (`molora.data`). Per level it reports output
throughput, requests/s, and p50/p99 of time to first token (TTFT) and time per output token (TPOT).
Without `--url` it starts a server in a child process on the bundle (`--bundle`, default: the embedded one); then
`--baseline` also serves the same requests with transformers `generate` (static padded batches of `c`
requests, one model per batch) on a second copy of the model, for the comparison the docs quote.
`--ray` runs the same closed-loop work against `molora serve` and `molora serve --ray --replicas N` (both
started here, each in its own process), level by level with the order rotated per repetition: the cost of the
extra hop (output tokens/s ratio, added p50 latency per request) and whether greedy outputs agree.
`--tenants N` runs the many-tenants scenario instead (molora.bench.tenants): one tenant floods while N send short
requests at a steady rate, under each scheduling policy side by side.
Ends with one JSON line. Owns only load generation and reporting; knows the server through HTTP.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import socket
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import httpx

from molora.bench.sse import SSEStream
from molora.data import SKILLS, generate, generate_mixed, render_mixed

if TYPE_CHECKING:
    from molora.model.attach import MoLoRAModel


@dataclass
class Sample:
    ok: bool
    tokens: int = 0
    ttft: float | None = None
    tpot: float | None = None
    latency: float = 0.0
    error: str = ""
    text: str = ""


def make_prompts(n: int, seed: int = 0, mixed_share: float = 0.3) -> list[str]:
    """n prompts: BBH-style single-skill questions, and a `mixed_share` of two-skill ones."""
    rng = random.Random(seed)
    n_mixed = int(n * mixed_share)
    single = [item.input for task in SKILLS for item in generate(task, -(-(n - n_mixed) // len(SKILLS)), seed)]
    mixed = [render_mixed(row["parts"]).prompt for row in generate_mixed(SKILLS, n_mixed, seed, parts=2)]
    prompts = rng.sample(single, n - n_mixed) + mixed
    rng.shuffle(prompts)
    return prompts


def zipf_models(models: Sequence[str], n: int, s: float, seed: int = 0) -> list[str]:
    """n model ids drawn with p(rank k) ~ 1 / k^s over `models` in a seeded random rank order."""
    rng = random.Random(seed)
    ranked = list(models)
    rng.shuffle(ranked)
    weights = [1.0 / (k + 1) ** s for k in range(len(ranked))]
    return rng.choices(ranked, weights=weights, k=n)


async def one_request(client: httpx.AsyncClient, model: str, prompt: str, max_tokens: int) -> Sample:
    """One streamed chat request: TTFT from send to the first chunk with text, TPOT from there to the
    last chunk of the stream over the remaining completion tokens (usage counts them)."""
    body = {
        "model": model,
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    t0 = time.perf_counter()
    first = last = None
    tokens = 0
    text: list[str] = []
    try:
        async with client.stream("POST", "/chat/completions", json=body) as r:
            if r.status_code != 200:
                return Sample(False, error=f"{r.status_code}: {(await r.aread())[:200]!r}")
            async for chunk in SSEStream(r):
                if "error" in chunk:
                    return Sample(False, error=str(chunk["error"]))
                if chunk.get("usage"):
                    tokens = chunk["usage"]["completion_tokens"]
                if chunk.get("choices"):  # a token step; text may lag a step (held-back UTF-8 or stop prefix)
                    last = time.perf_counter()
                if first is None and any(c["delta"].get("content") for c in chunk.get("choices", [])):
                    first = last
                text += [c["delta"].get("content") or "" for c in chunk.get("choices", [])]
    except httpx.HTTPError as e:
        return Sample(False, error=f"{type(e).__name__}: {e}")
    end = time.perf_counter()
    tpot = (last - first) / (tokens - 1) if first is not None and last is not None and tokens > 1 else None
    return Sample(True, tokens, None if first is None else first - t0, tpot, end - t0, text="".join(text))


async def run_level(
    url: str, headers: dict[str, str], work: list[tuple[str, str]], concurrency: int, max_tokens: int
) -> tuple[list[Sample], float]:
    """All of `work` (model, prompt) through `concurrency` closed-loop clients; (samples, wall seconds)."""
    queue: asyncio.Queue[tuple[int, tuple[str, str]]] = asyncio.Queue()
    for item in enumerate(work):
        queue.put_nowait(item)
    samples: list[Sample] = [Sample(False, error="not run")] * len(work)
    limits = httpx.Limits(max_connections=concurrency + 4, max_keepalive_connections=concurrency + 4)
    async with httpx.AsyncClient(base_url=url, headers=headers, timeout=600, limits=limits) as client:

        async def worker() -> None:
            while not queue.empty():
                i, (model, prompt) = queue.get_nowait()
                samples[i] = await one_request(client, model, prompt, max_tokens)  # in work order

        t0 = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        return samples, time.perf_counter() - t0


def pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    values = sorted(values)
    return values[min(len(values) - 1, max(0, round(q / 100 * (len(values) - 1))))]


def summarize(concurrency: int, samples: list[Sample], wall: float) -> dict[str, Any]:
    ok = [s for s in samples if s.ok]
    ttft = [s.ttft for s in ok if s.ttft is not None]
    tpot = [s.tpot for s in ok if s.tpot is not None]
    ms = lambda v: None if v is None else round(v * 1000, 2)  # noqa: E731
    return {
        "concurrency": concurrency,
        "requests": len(samples),
        "errors": len(samples) - len(ok),
        "output_tok_s": round(sum(s.tokens for s in ok) / wall, 2),
        "req_s": round(len(ok) / wall, 3),
        "ttft_p50_ms": ms(pct(ttft, 50)),
        "ttft_p99_ms": ms(pct(ttft, 99)),
        "tpot_p50_ms": ms(pct(tpot, 50)),
        "tpot_p99_ms": ms(pct(tpot, 99)),
        "latency_p50_ms": ms(pct([s.latency for s in ok], 50)),
        "first_error": next((s.error for s in samples if not s.ok), None),
    }


def hf_baseline(
    mm: MoLoRAModel, work: list[tuple[str, str]], batch: int, max_tokens: int, served_name: str
) -> dict[str, Any]:
    """The same requests through transformers `generate`: static left-padded batches of `batch`, one model each.

    mm: a `MoLoRAModel` of the same bundle (`molora.bundle.load`), not shared with the engine.
    """
    import torch

    from molora.bundle import encode_prompt, stop_ids
    from molora.routing import SequenceRouter

    stops, pad = stop_ids(mm), mm.tokenizer.pad_token_id or 0
    tokens, latencies = 0, []
    t0 = time.perf_counter()
    for start in range(0, len(work), batch):
        by_model: dict[str, list[str]] = {}
        for model, prompt in work[start : start + batch]:
            by_model.setdefault(model, []).append(prompt)
        for model, prompts in by_model.items():
            adapter = model.partition(":")[2] if model != served_name else None
            spec = adapter if adapter else (mm.router if mm.router is not None else SequenceRouter(None))
            ids = [encode_prompt(mm, p) for p in prompts]
            width = max(map(len, ids))
            x = torch.tensor([[pad] * (width - len(r)) + r for r in ids])
            mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in ids])
            t1 = time.perf_counter()
            out = mm.generate(
                x, mask, adapter_ids=spec, max_new_tokens=max_tokens, eos_token_id=stops, pad_token_id=pad
            )
            latencies += [time.perf_counter() - t1] * len(prompts)
            for row in out[:, width:].tolist():
                tokens += next((i for i, t in enumerate(row) if t in stops), len(row))
    wall = time.perf_counter() - t0
    return {
        "batch": batch,
        "output_tok_s": round(tokens / wall, 2),
        "req_s": round(len(work) / wall, 3),
        "latency_p50_ms": round(pct(latencies, 50) * 1000, 2),
        "latency_p99_ms": round(pct(latencies, 99) * 1000, 2),
    }


def start_server(
    bundle: str | None,
    max_concurrency: int,
    timeout_s: float = 600.0,
    ray_replicas: int | None = None,
    ray_ingress: str = "serve",
    extra: Sequence[str] = (),
    launcher: Sequence[str] = (),
) -> tuple[subprocess.Popen, str]:
    """`molora serve` in a child process (so the load generator does not share its GIL) on a free port;
    with ray_replicas, `molora serve --ray --replicas N --ray-ingress KIND` (Ray and every replica stop with
    it). launcher: the command that runs molora's CLI on the arguments after it (default: this Python's
    molora.cli.main)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    cmd = list(
        launcher or (sys.executable, "-c", "import sys; from molora.cli import main; sys.exit(main(sys.argv[1:]))")
    )
    cmd += [
        "serve",
        "--port",
        str(port),
        "--max-queue",
        str(max(64, 2 * max_concurrency)),
        "--max-num-seqs",
        str(max(64, max_concurrency)),
    ] + (["--bundle", bundle] if bundle else [])
    cmd += list(extra)  # later flags win (argparse): e.g. another --max-num-seqs
    if ray_replicas is not None:
        cmd += ["--ray", "--replicas", str(ray_replicas), "--ray-ingress", ray_ingress]
    proc = subprocess.Popen(cmd, env={**os.environ, "RAY_USAGE_STATS_ENABLED": "0"})
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                return proc, f"http://127.0.0.1:{port}/v1"
        except httpx.HTTPError:
            pass
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise SystemExit(f"the server did not start (exit code {proc.poll()}); see its log above")
        time.sleep(0.5)


def _print_row(r: dict[str, Any]) -> None:
    print(
        f"{r['concurrency']:>5} {r['requests']:>5} {r['errors']:>4} {r['output_tok_s']:>10} {r['req_s']:>7} "
        f"{r['ttft_p50_ms']!s:>9} {r['ttft_p99_ms']!s:>9} {r['tpot_p50_ms']!s:>9} {r['tpot_p99_ms']!s:>9}"
        + (f"   hf: {r['hf']['output_tok_s']} tok/s ({r['speedup_vs_hf']}x)" if "hf" in r else ""),
        flush=True,
    )


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="molora bench serve", description=__doc__.split("\n")[0])
    ap.add_argument("--url", default=None, help="API base of a running server (default: start one here)")
    ap.add_argument("--bundle", default=None, help="bundle for the server started here (default: embedded)")
    ap.add_argument("--api-key", default=None, help="Bearer key for --url")
    ap.add_argument("--concurrency", default="1,2,4,8,16,32,64", help="comma-separated levels (default 1..64)")
    ap.add_argument("--requests", type=int, default=0, help="requests per level (default: max(16, 2 x level))")
    ap.add_argument("--max-tokens", type=int, default=64, help="new tokens per request at most (default 64)")
    ap.add_argument("--zipf", type=float, default=1.1, help="Zipf exponent of model popularity (default 1.1)")
    ap.add_argument("--mixed-share", type=float, default=0.3, help="share of multi-skill prompts (default 0.3)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--baseline", action="store_true", help="also time transformers generate (local server only)")
    ap.add_argument(
        "--ray",
        action="store_true",
        help="compare molora serve with molora serve --ray side by side (servers started here)",
    )
    ap.add_argument("--replicas", type=int, default=1, help="engine replicas of the --ray server (default 1)")
    ap.add_argument(
        "--ray-ingress",
        choices=("serve", "process"),
        default="serve",
        help="--ray: where the --ray server's HTTP app runs (molora serve --ray-ingress)",
    )
    ap.add_argument("--repeats", type=int, default=2, help="--ray: runs per level and server, order rotated")
    ap.add_argument("--json", metavar="OUT", help="also write the result JSON to this file")
    from molora.bench import tenants

    tenants.add_arguments(ap)
    args = ap.parse_args(argv)
    if args.tenants:
        if args.url or args.ray or args.baseline:
            ap.error("--tenants starts one server per scheduling policy here: drop --url, --ray and --baseline")
        return tenants.main(args)
    levels = [int(c) for c in args.concurrency.split(",") if c.strip()]
    if not levels or min(levels) < 1:
        ap.error(f"--concurrency {args.concurrency!r}: give positive integers, e.g. 1,4,16")
    if args.baseline and args.url:
        ap.error("--baseline needs the model in this process: drop --url")
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    if args.ray:
        if args.url or args.baseline:
            ap.error("--ray starts both servers here: drop --url and --baseline")
        return compare_ray(args, levels)

    server = None
    url = args.url
    if url is None:
        server, url = start_server(args.bundle, max(levels))
    try:
        models = [m["id"] for m in httpx.get(url + "/models", headers=headers, timeout=30).json()["data"]]
        served = models[0]
        print(f"# {url}: models {models}, Zipf s={args.zipf}", flush=True)
        asyncio.run(run_level(url, headers, [(served, "Warm up.")] * 2, 2, 8))
        print(
            f"{'conc':>5} {'reqs':>5} {'err':>4} {'out tok/s':>10} {'req/s':>7} {'ttft p50':>9} {'ttft p99':>9} "
            f"{'tpot p50':>9} {'tpot p99':>9}   (ms)"
        )
        results: list[dict[str, Any]] = []
        hf_model = None
        for c in levels:
            n = args.requests or max(16, 2 * c)
            work = list(
                zip(zipf_models(models, n, args.zipf, args.seed + c), make_prompts(n, args.seed + c, args.mixed_share))
            )
            samples, wall = asyncio.run(run_level(url, headers, work, c, args.max_tokens))
            row = summarize(c, samples, wall)
            if args.baseline:
                if hf_model is None:
                    from molora.bundle import load

                    hf_model = load(args.bundle)
                row["hf"] = hf_baseline(hf_model, work, c, args.max_tokens, served)
                row["speedup_vs_hf"] = round(row["output_tok_s"] / max(row["hf"]["output_tok_s"], 1e-9), 2)
            results.append(row)
            _print_row(row)
    finally:
        if server is not None:
            server.terminate()  # SIGTERM: the server drains (nothing is in flight) and exits
            server.wait(60)
    out = {
        "bench": "serve",
        "url": args.url or "local",
        "models": models,
        "zipf": args.zipf,
        "max_tokens": args.max_tokens,
        "levels": results,
    }
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=2)
    print(json.dumps(out))
    return 0 if all(r["errors"] == 0 for r in results) else 1


def compare_ray(args: argparse.Namespace, levels: list[int]) -> int:
    """`molora serve` vs `molora serve --ray --replicas N` on the same work, side by side (module docstring)."""
    from molora.bench.common import rotated

    servers = {}
    try:
        for name, replicas in (("plain", None), ("ray", args.replicas)):
            servers[name] = start_server(args.bundle, max(levels), ray_replicas=replicas, ray_ingress=args.ray_ingress)
        urls = {name: url for name, (_, url) in servers.items()}
        models = [m["id"] for m in httpx.get(urls["plain"] + "/models", timeout=30).json()["data"]]
        for url in urls.values():  # warm both: the Ray replica loads the bundle on its first request
            asyncio.run(run_level(url, {}, [(m, "Warm up.") for m in models], 2, 8))
        print(
            f"# plain {urls['plain']} vs ray --replicas {args.replicas} --ray-ingress {args.ray_ingress} "
            f"{urls['ray']}; models {models}",
            flush=True,
        )
        results = []
        for c in levels:
            n = args.requests or max(16, 2 * c)
            work = list(
                zip(zipf_models(models, n, args.zipf, args.seed + c), make_prompts(n, args.seed + c, args.mixed_share))
            )
            runs: dict[str, list[dict[str, Any]]] = {"plain": [], "ray": []}
            texts: dict[str, list[str]] = {}
            latencies: dict[str, list[list[float | None]]] = {"plain": [], "ray": []}
            for rep in range(args.repeats):
                for name in rotated(["plain", "ray"], rep):
                    samples, wall = asyncio.run(run_level(urls[name], {}, work, c, args.max_tokens))
                    runs[name].append(summarize(c, samples, wall))
                    texts[name] = [smp.text if smp.ok else None for smp in samples]
                    latencies[name].append([smp.latency if smp.ok else None for smp in samples])
            # the same request in both servers, repetition by repetition: the median of its latency difference
            paired = [
                1000 * (r - p)
                for rp, pp in zip(latencies["ray"], latencies["plain"])
                for r, p in zip(rp, pp)
                if r is not None and p is not None
            ]
            same = sum(a is not None and a == b for a, b in zip(texts["plain"], texts["ray"]))
            ratios = [r["output_tok_s"] / max(p["output_tok_s"], 1e-9) for p, r in zip(runs["plain"], runs["ray"])]
            added = [
                r["latency_p50_ms"] - p["latency_p50_ms"]
                for p, r in zip(runs["plain"], runs["ray"])
                if r["latency_p50_ms"] is not None and p["latency_p50_ms"] is not None
            ]
            row = {
                "concurrency": c,
                "requests": n,
                "plain": runs["plain"],
                "ray": runs["ray"],
                "tok_s_ratio_median": round(_median(ratios), 3),
                "tok_s_ratios": [round(x, 3) for x in ratios],
                "added_latency_p50_ms_median": round(_median(added), 2) if added else None,
                "added_latency_paired_ms_median": round(_median(paired), 2) if paired else None,
                "same_greedy_outputs": f"{same}/{n}",
                "errors": {k: sum(r["errors"] for r in v) for k, v in runs.items()},
            }
            results.append(row)
            print(
                f"conc {c:>3}: plain {_median([r['output_tok_s'] for r in runs['plain']]):.1f} tok/s, ray "
                f"{_median([r['output_tok_s'] for r in runs['ray']]):.1f} tok/s, ratio {row['tok_s_ratio_median']} "
                f"{row['tok_s_ratios']}, added p50 latency {row['added_latency_p50_ms_median']} ms (paired per request "
                f"{row['added_latency_paired_ms_median']} ms), same outputs "
                f"{row['same_greedy_outputs']}, errors {row['errors']}",
                flush=True,
            )
    finally:
        for proc, _ in servers.values():
            proc.terminate()
        for proc, _ in servers.values():
            proc.wait(120)
    out = {
        "bench": "serve_ray",
        "replicas": args.replicas,
        "ingress": args.ray_ingress,
        "repeats": args.repeats,
        "models": models,
        "max_tokens": args.max_tokens,
        "zipf": args.zipf,
        "threads": os.cpu_count(),
        "levels": results,
    }
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=2)
    print(json.dumps(out))
    return 0 if all(sum(r["errors"].values()) == 0 for r in results) else 1


def _median(values: list[float]) -> float:
    v = sorted(values)
    return (v[(len(v) - 1) // 2] + v[len(v) // 2]) / 2


if __name__ == "__main__":
    sys.exit(main())
