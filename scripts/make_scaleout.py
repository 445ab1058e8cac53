"""Measure `molora serve --ray` against `molora serve` and render the figures of docs/scaleout.md and the README.

    .venv/bin/python scripts/make_scaleout.py [--requests 32] [--max-tokens 64] [--repeats 3]
    .venv/bin/python scripts/make_scaleout.py --render-only      # docs and README from docs/scaleout.json

Runs two benches, each `molora bench serve --ray` (both servers started in child processes on the embedded
default bundle, the same closed-loop streamed chat work against each, order rotated per repetition):

    one_replica   --replicas 1 at concurrency 1 and 16: the cost of the extra hop (issue 16's goals: output
                  tokens/s >= 0.9x at concurrency 16, added p50 latency <= 15 ms at concurrency 1) and whether
                  greedy outputs agree token for token
    two_replicas  --replicas 2, 500 requests at concurrency 32: failed requests (goal 0; 429s counted apart)

Keeps each bench's final JSON line, with its command and wall time, in docs/scaleout.json, then renders the
block between SCALE_BEGIN and SCALE_END in docs/scaleout.md and the README line between the README markers.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import shlex
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
RECORD = ROOT / "docs" / "scaleout.json"
PAGE = ROOT / "docs" / "scaleout.md"
README = ROOT / "README.md"
SCALE_BEGIN, SCALE_END = "<!-- scaleout:begin (scripts/make_scaleout.py) -->", "<!-- scaleout:end -->"


def bench_argv(what: str, args: argparse.Namespace) -> list[str]:
    if what == "one_replica":
        return ["serve", "--ray", "--replicas", "1", "--concurrency", "1,16", "--requests", str(args.requests),
                "--max-tokens", str(args.max_tokens), "--repeats", str(args.repeats)]
    return ["serve", "--ray", "--replicas", "2", "--concurrency", "32", "--requests", "500",
            "--max-tokens", str(args.max_tokens // 2), "--repeats", "1"]


def run(what: str, args: argparse.Namespace) -> dict[str, Any]:
    argv = bench_argv(what, args)
    cmd = [sys.executable, "-m", "molora.bench.cli", *argv]
    print("$ molora bench " + shlex.join(argv), flush=True)
    t0 = time.time()
    proc = subprocess.run(cmd, cwd=ROOT, stdout=subprocess.PIPE, text=True, env={**os.environ,
                                                                                 "RAY_USAGE_STATS_ENABLED": "0"})
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    if not lines:
        raise SystemExit(f"{what}: the bench printed no JSON (exit {proc.returncode})")
    return {"command": "molora bench " + shlex.join(argv), "wall_s": round(time.time() - t0, 1),
            "exit_code": proc.returncode, "result": json.loads(lines[-1])}


def _level(rec: dict, c: int) -> dict:
    return next(r for r in rec["result"]["levels"] if r["concurrency"] == c)


def _med(runs: list[dict], key: str) -> float:
    v = sorted(r[key] for r in runs)
    return (v[(len(v) - 1) // 2] + v[len(v) // 2]) / 2


def page_block(records: dict) -> str:
    one, two = records["one_replica"], records["two_replicas"]
    lines = [SCALE_BEGIN, "",
             f"Measured {records['date']} on {records['machine']} (record: [scaleout.json](scaleout.json)); the "
             "embedded default bundle, streamed chat requests with Zipf-drawn models (per-token routing and pinned "
             f"adapters), greedy, at most {one['result']['max_tokens']} new tokens; both servers run at once "
             "in their own processes and take turns level by level, order rotated per repetition.", "",
             "| concurrency | `molora serve` tok/s | `--ray --replicas 1` tok/s | ratio (median; each run) | "
             "added p50 latency / request | same greedy outputs | errors (plain / ray) |",
             "|---:|---:|---:|---|---:|---:|---|"]
    for row in one["result"]["levels"]:
        lines.append(f"| {row['concurrency']} | {_med(row['plain'], 'output_tok_s'):.1f} | "
                     f"{_med(row['ray'], 'output_tok_s'):.1f} | **{row['tok_s_ratio_median']:.2f}×** "
                     f"({', '.join(f'{x:.2f}' for x in row['tok_s_ratios'])}) | "
                     f"{row['added_latency_p50_ms_median']:.1f} ms | {row['same_greedy_outputs']} | "
                     f"{row['errors']['plain']} / {row['errors']['ray']} |")
    c1, c16 = _level(one, 1), _level(one, 16)
    per_token = c1["added_latency_p50_ms_median"] / one["result"]["max_tokens"]
    verdict = lambda ok: "met" if ok else "**not met**"  # noqa: E731
    lines += ["", f"Issue 16's goals: output tokens/s ≥ 0.9× at concurrency 16: {c16['tok_s_ratio_median']:.2f}×, "
              f"{verdict(c16['tok_s_ratio_median'] >= 0.9)}; added latency ≤ 15 ms per request at concurrency 1: "
              f"+{c1['added_latency_p50_ms_median']:.0f} ms, {verdict(c1['added_latency_p50_ms_median'] <= 15)} "
              f"(about {per_token:.1f} ms per streamed token at up to {one['result']['max_tokens']} tokens: every "
              "output crosses two Ray hops); greedy outputs equal: "
              f"{verdict(all(r['same_greedy_outputs'].split('/')[0] == r['same_greedy_outputs'].split('/')[1] for r in one['result']['levels'] + two['result']['levels']))}."]
    t = _level(two, 32)
    ray = t["ray"][0]
    lines += ["", f"Two replicas (`--replicas 2`, one torch thread each): {ray['requests']} requests at concurrency 32, "
              f"at most {two['result']['max_tokens']} new tokens: **{ray['errors']} failed** "
              f"({ray['output_tok_s']:.1f} output tok/s; `molora serve` on the same work: "
              f"{t['plain'][0]['output_tok_s']:.1f} tok/s, {t['plain'][0]['errors']} failed); greedy outputs "
              f"equal for {t['same_greedy_outputs']}.", "",
              "Commands: `" + "`, `".join(r["command"] for r in (one, two)) + "` (via `scripts/make_scaleout.py`).",
              "", SCALE_END]
    return "\n".join(lines)


def readme_line(records: dict) -> str:
    one, two = records["one_replica"], records["two_replicas"]
    c1, c16 = _level(one, 1), _level(one, 16)
    ray2 = _level(two, 32)["ray"][0]
    return "\n".join([
        SCALE_BEGIN,
        f"- **Scale-out on Ray Serve** ([docs/scaleout.md](docs/scaleout.md)): `molora serve --ray` with one "
        f"replica against `molora serve` on the same machine: {c16['tok_s_ratio_median']:.2f}× the output "
        f"tokens/s at concurrency 16, +{c1['added_latency_p50_ms_median']:.0f} ms p50 latency per request at "
        f"concurrency 1, greedy outputs equal ({c16['same_greedy_outputs']}); two replicas: {ray2['errors']} of "
        f"{ray2['requests']} requests failed at concurrency 32.",
        SCALE_END])


def replace_block(text: str, block: str, where: Path) -> str:
    if SCALE_BEGIN not in text or SCALE_END not in text:
        raise SystemExit(f"{where}: no {SCALE_BEGIN} ... {SCALE_END} block to replace")
    head, rest = text.split(SCALE_BEGIN, 1)
    return head + block + rest.split(SCALE_END, 1)[1]


def render(records: dict, check: bool = False) -> int:
    stale = []
    for path, block in ((PAGE, page_block(records)), (README, readme_line(records))):
        text = path.read_text()
        new = replace_block(text, block, path)
        if new != text:
            stale.append(path)
            if not check:
                path.write_text(new)
    if check and stale:
        print(f"out of date: {[str(p) for p in stale]}; run scripts/make_scaleout.py --render-only")
        return 1
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--requests", type=int, default=32, help="requests per level and run of one_replica")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--only", nargs="+", choices=["one_replica", "two_replicas"], default=None)
    p.add_argument("--render-only", action="store_true")
    p.add_argument("--check", action="store_true", help="exit 1 if the docs differ from a render of the record")
    args = p.parse_args(argv)
    if args.render_only or args.check:
        return render(json.loads(RECORD.read_text()), check=args.check)
    records = json.loads(RECORD.read_text()) if RECORD.exists() else {}
    for what in args.only or ["one_replica", "two_replicas"]:
        records[what] = run(what, args)
        records["date"] = dt.date.today().isoformat()
        records["machine"] = f"{os.cpu_count()} CPU cores, no GPU"
        RECORD.write_text(json.dumps(records, indent=2) + "\n")
    return render(records)


if __name__ == "__main__":
    sys.exit(main())
