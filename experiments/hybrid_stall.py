"""What a `--router hybrid` request's choice costs the other requests of a running server: a streamed, pinned
request's inter-token gaps while requests arrive that the chooser decides, against the same arrivals pinned to an
adapter (no chooser), alternating.

    molora serve --model M --lora-modules a=PATH ... --router hybrid --port 8123     # in another shell
    python -m experiments.hybrid_stall --url http://127.0.0.1:8123 --repeats 3 --json docs/hybrid_stall.json

Per repetition and arm: one stream (`--stream-adapter`, `--stream-tokens` tokens, ignore_eos), and after its first
token `--arrivals` short chat requests one after another, on the base name (the chooser decides: arm "chooser") or
pinned to `--stream-adapter` (arm "pinned"). Reported per arm: the stream's gaps (median, p99, max) and the gaps
over 3x the run's median. The chooser runs on the engine thread between steps (molora.server.choosing), so while it
runs no request steps: this measures that pause.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import threading
import time

import httpx

QUESTIONS = (
    "How many apples are there if I have two apples and three pears?",
    "What is 7 * 8 - 3?",
    "Name three colors.",
    "Is 17 a prime number?",
    "Write one sentence about rain.",
)


def run_arm(url: str, base: str, arm: str, a: argparse.Namespace) -> dict:
    gaps: list[float] = []
    first = threading.Event()

    def stream() -> None:
        last = None
        body = {
            "model": a.stream_adapter,
            "messages": [{"role": "user", "content": "Tell me a long story."}],
            "max_tokens": a.stream_tokens,
            "temperature": 0,
            "stream": True,
            "ignore_eos": True,
        }
        with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=600) as r:
            for line in r.iter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    now = time.perf_counter()
                    if last is not None:
                        gaps.append(now - last)
                    last = now
                    first.set()

    th = threading.Thread(target=stream)
    th.start()
    first.wait(120)
    picks = []
    for q in QUESTIONS[: a.arrivals]:
        model = base if arm == "chooser" else a.stream_adapter
        j = httpx.post(
            url + "/v1/chat/completions",
            json={"model": model, "messages": [{"role": "user", "content": q}], "max_tokens": 8, "temperature": 0},
            timeout=600,
        ).json()
        picks.append(((j["choices"][0].get("molora") or {}).get("chooser") or {}).get("adapter", "pinned"))
    th.join()
    med = statistics.median(gaps)
    g = sorted(gaps)
    return {
        "arm": arm,
        "gaps": len(g),
        "median_ms": round(1e3 * med, 2),
        "p99_ms": round(1e3 * g[int(0.99 * (len(g) - 1))], 2),
        "max_ms": round(1e3 * g[-1], 2),
        "over_3x_median": sum(1 for x in g if x > 3 * med),
        "picks": picks,
    }


def render_section(r: dict) -> list[str]:
    """docs/results.md's lines for this record (tools/make_results.py appends them)."""
    s = r["summary"]
    row = lambda arm: (
        f"| {arm} | {s[arm]['median_ms']:.1f} | {s[arm]['p99_ms']:.1f} | {s[arm]['max_ms']:.1f} | "
        f"{s[arm]['over_3x_median']:g} |"
    )
    return [
        "",
        f"### What a served choice costs the other requests: {r.get('server_chooser', 'joint pass')}",
        "",
        f"A streamed request pinned to one adapter ({r['stream_tokens']} tokens) while {r['arrivals']} short chat "
        "requests arrive one after another, decided by the hybrid chooser (chooser) or pinned to an adapter "
        f"(pinned), alternating, {r['repeats']} repetitions, medians over them (record `docs/hybrid_stall.json`, "
        f"`{r['command']}`, against `{r['server']}`; {r['cpu']}, load average {r['loadavg_1_5_15']} at the end). "
        "The chooser runs on the engine thread between steps, so while it decides, no request steps:",
        "",
        "| arrivals | stream gap median ms | p99 ms | max ms | gaps over 3x the median |",
        "|---|---:|---:|---:|---:|",
        row("chooser"),
        row("pinned"),
        "",
    ]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--url", default="http://127.0.0.1:8123")
    ap.add_argument("--stream-adapter", default="counting")
    ap.add_argument("--stream-tokens", type=int, default=200)
    ap.add_argument("--arrivals", type=int, default=5)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--json", default=None)
    ap.add_argument("--label", default="", help="how the server's chooser runs its passes (kept in the record)")
    a = ap.parse_args(argv)
    base = httpx.get(a.url + "/v1/models").json()["data"][0]["id"]
    runs = []
    for rep in range(a.repeats):
        for arm in ("chooser", "pinned") if rep % 2 == 0 else ("pinned", "chooser"):
            runs.append({"rep": rep, **run_arm(a.url, base, arm, a)})
            print(json.dumps(runs[-1]), file=sys.stderr)
    summary = {
        arm: {
            k: statistics.median(r[k] for r in runs if r["arm"] == arm)
            for k in ("median_ms", "p99_ms", "max_ms", "over_3x_median")
        }
        for arm in ("chooser", "pinned")
    }
    out = {
        "what": "a streamed pinned request's inter-token gaps while requests arrive that the hybrid chooser decides, "
        "against the same arrivals pinned (no chooser), alternating; medians over repetitions",
        "command": "python -m experiments.hybrid_stall " + " ".join(sys.argv[1:] if argv is None else argv),
        "server": "molora serve --model <SmolLM2-135M-Instruct GGUF> --lora-modules counting=... arithmetic=... "
        "dyck=... navigate=... (the default bundle's adapters) --router hybrid, 2 threads",
        "cpu": next((l.split(":", 1)[1].strip() for l in open("/proc/cpuinfo") if l.startswith("model name")), "?"),
        "loadavg_1_5_15": [round(x, 2) for x in os.getloadavg()],
        "server_chooser": a.label,
        "arrivals": a.arrivals,
        "stream_tokens": a.stream_tokens,
        "repeats": a.repeats,
        "summary": summary,
        "runs": runs,
    }
    print(json.dumps(summary))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
