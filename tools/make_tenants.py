"""Measure the scheduling policies under a flooding tenant and render the figures of docs/serving.md.

    .venv/bin/python -m tools.make_tenants [--repeats 2]      # runs the bench, writes docs/tenants_bench.json
    .venv/bin/python -m tools.make_tenants --render-only      # docs/serving.md from docs/tenants_bench.json
    .venv/bin/python -m tools.make_tenants --check            # exit 1 if the page differs from a render

Runs `molora bench serve --tenants 4 ...` (molora.bench.tenants: one `molora serve --scheduling-policy P` per policy
on the embedded default bundle, learned routing; the steady tenants alone, then under the flood) and keeps its final
JSON with the command, the CPU and the date in docs/tenants_bench.json; then renders the block between
TENANTS_BEGIN and TENANTS_END in docs/serving.md.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import platform
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

from molora.docblock import markers, replace_block

ROOT = Path(__file__).resolve().parent.parent
RECORD = ROOT / "docs" / "tenants_bench.json"
VARIANTS = ROOT / "docs" / "tenants_variants.json"  # experiments/tenants_variants.py
TRACE = ROOT / "docs" / "tenants_trace.json"  # experiments/tenants_variants.py --trace
PAGE = ROOT / "docs" / "serving.md"
TENANTS_BEGIN, TENANTS_END = markers("tenants", "tools/make_tenants.py")
BENCH = [
    "--tenants", "4", "--per-tenant", "4", "--period", "3", "--steady-tokens", "16",
    "--flood", "12", "--flood-tokens", "32", "--max-num-seqs", "8",
]  # fmt: skip


def cpu_name() -> str:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return platform.processor() or "unknown"
    return next((ln.split(":", 1)[1].strip() for ln in out.splitlines() if ln.startswith("Model name")), "unknown")


def run(repeats: int) -> dict[str, Any]:
    out = ROOT / "docs" / ".tenants_bench_raw.json"
    argv = [sys.executable, "-m", "molora.bench.serve", *BENCH, "--repeats", str(repeats), "--json", str(out)]
    subprocess.run(argv, cwd=ROOT, check=True)
    result = json.loads(out.read_text())
    out.unlink()
    return {
        "command": "python -m molora.bench.serve " + " ".join([*BENCH, "--repeats", str(repeats)]),
        "cpu": cpu_name(),
        "date": dt.date.today().isoformat(),
        "result": result,
    }


def _x(v: float | None, digits: int = 1) -> str:
    return "n/a" if v is None else f"{v:.{digits}f}x"


def _ms(v: float | None) -> str:
    return "n/a" if v is None else f"{v / 1000:.2f} s" if v >= 1000 else f"{v:.0f} ms"


def page_block(record: dict[str, Any]) -> str:
    r = record["result"]
    med = r["median"]
    lines = [
        TENANTS_BEGIN,
        f"Measured with `{record['command']}` on {record['cpu']} ({record['date']}), "
        f"medians of {r['repeats']} runs per policy, each policy on its own server, order rotated: one tenant sends "
        f"{r['flood']} long requests ({r['flood_tokens']} new tokens, four questions per prompt) at once while "
        f"{r['tenants']} tenants each send {r['per_tenant']} short requests ({r['steady_tokens']} new tokens) one "
        f"every {r['period_s']:g} s; `--max-num-seqs {r['max_num_seqs']}`, `ignore_eos` (every policy serves the "
        "same tokens).",
        "",
        "| policy | steady TTFT p50 alone → flood (ratio) | steady TTFT p99 alone → flood (ratio) | flood done (s) "
        "| output tok/s (vs fcfs) | engine steps, output tokens per step |",
        "|---|---|---|---|---|---|",
    ]
    for policy, m in med.items():
        lines.append(
            f"| `{policy}` | {_ms(m.get('steady_ttft_alone_p50_ms'))} → {_ms(m.get('steady_ttft_flood_p50_ms'))} "
            f"({_x(m.get('steady_ttft_p50_ratio'))}) | {_ms(m.get('steady_ttft_alone_p99_ms'))} → "
            f"{_ms(m.get('steady_ttft_flood_p99_ms'))} ({_x(m.get('steady_ttft_p99_ratio'))}) | "
            f"{m.get('flood_first_done_s'):.1f} – {m.get('flood_last_done_s'):.1f} | {m.get('output_tok_s'):.1f} "
            f"({_x(m.get('output_tok_s_vs_fcfs'), 2)}) | {m.get('engine_steps'):.0f}, "
            f"{m.get('output_tokens_per_step')} |"
        )
    runs = r["runs"]
    spread = "; ".join(
        f"{p} {min(x['output_tok_s'] for x in rows):.1f}–{max(x['output_tok_s'] for x in rows):.1f} tok/s, "
        f"steady TTFT p50 {min(x['steady_ttft_p50_ratio'] for x in rows):.1f}–"
        f"{max(x['steady_ttft_p50_ratio'] for x in rows):.1f}x"
        for p, rows in runs.items()
    )
    base = med.get("fcfs", {}).get("engine_steps")
    steps = ", ".join(
        f"{p} takes {m['engine_steps']:.0f} steps"
        + (f" ({m['engine_steps'] / base - 1:+.0%} against fcfs)" if base and p != "fcfs" else "")
        + (
            f", {m['engine_step_s']:.1f} s inside them and {m['preemptions']:.0f} preemptions"
            if "engine_step_s" in m  # records from before the bench read them
            else ""
        )
        for p, m in med.items()
    )
    fcfs_rate = {x["repeat"]: x["output_tok_s"] for x in runs.get("fcfs", [])}
    ratios = {
        p: [x["output_tok_s"] / fcfs_rate[x["repeat"]] for x in rows]
        for p, rows in runs.items()
        if p != "fcfs" and all(x["repeat"] in fcfs_rate for x in rows)
    }
    paired = "; ".join(
        f"{p} {', '.join(f'{r:.2f}' for r in rs)} (median {statistics.median(rs):.2f})" for p, rs in ratios.items()
    )
    throughput = f"output tok/s over fcfs's in the same repetition: {paired}" if paired else ""
    lines += ["", f"Run to run on this machine: {spread}; {throughput}. For the same tokens {steps}.", ""]
    lines += variants_lines()
    lines += trace_lines()
    lines += [f"Record: `docs/{RECORD.name}`; renderer: `tools/make_tenants.py`.", TENANTS_END]
    return "\n".join(lines)


def variants_lines() -> list[str]:
    """The fair policy with one rule off, from docs/tenants_variants.json (experiments/tenants_variants.py; no lines
    while it does not exist)."""
    if not VARIANTS.is_file():
        return []
    v = json.loads(VARIANTS.read_text(encoding="utf-8"))
    m = v["machine"]
    rows = [
        "Which rule of `fair` costs throughput (`" + v["command"] + "`, "
        f"{len(next(iter(v['runs'].values())))} runs per variant, interleaved, on {m['cpu']} "
        f"({', '.join(m['cpu_flags'])}), {m['cores']} cores; `noseat`: a tenant with no seat waits for one instead "
        "of preempting; `seat0`: the seat rule only for a tenant with no request running; `noheld`: no step "
        "share; compare within this table only when its CPU differs from the one above):",
        "",
        "| variant | steady TTFT p50 / p99 ratio | output tok/s (vs fcfs) | output tok/s, each run | engine steps, "
        "each run | preemptions |",
        "|---|---|---|---|---|---|",
    ]
    for name, med in v["median"].items():
        rate, each, steps = _run_cells(med, v["runs"][name])
        rows.append(
            f"| `{name}` | {_x(med['steady_ttft_p50_ratio'])} / {_x(med['steady_ttft_p99_ratio'])} | {rate} | {each} | "
            f"{steps} | {med['preemptions']:.0f} |"
        )
    return rows + ["", f"Record: `docs/{VARIANTS.name}`.", ""]


def _run_cells(med: dict[str, Any], runs: list[dict[str, Any]]) -> tuple[str, str, str]:
    """A variant's median output tok/s (and its ratio to fcfs's), each run's tok/s, each run's engine steps."""
    return (
        f"{med['output_tok_s']:.1f} ({_x(med.get('output_tok_s_vs_fcfs'), 2)})",
        ", ".join(f"{r['output_tok_s']:.1f}" for r in runs),
        ", ".join(str(r["engine_steps"]) for r in runs),
    )


def trace_lines() -> list[str]:
    """Where each policy's steps go in the flood run, from docs/tenants_trace.json (experiments/tenants_variants.py
    --trace; no lines while it does not exist): medians over runs of the part where every tenant has work and of the
    tail after the last steady request left."""
    if not TRACE.is_file():
        return []
    v = json.loads(TRACE.read_text(encoding="utf-8"))
    m = v["machine"]

    def med(rows: list[dict[str, Any]], part: str, key: str) -> float:
        return statistics.median(r["trace_summary"][part][key] for r in rows)

    rows = [
        "Where the steps go (`" + v["command"] + f"`, {len(next(iter(v['runs'].values())))} runs per policy, "
        f"interleaved, on {m['cpu']}, {m['cores']} cores; every engine step recorded in the server; medians over "
        "runs). "
        "*Contended*: from the flood's arrival until the last steady request leaves the scheduler; *tail*: the "
        "flood's last requests after that"
        + (
            "; `fair:drain`: each tenant's waiting requests longest left first, and a waiting request takes the seat "
            "of its own tenant's running request with the fewest tokens left (`experiments/tenants_variants.py`)"
            if "fair:drain" in v["runs"]
            else ""
        )
        + ". Each run is listed: its tok/s move with the machine's load, its engine steps much less:",
        "",
        "| policy | output tok/s, whole run (vs fcfs); each run | engine steps, each run; preemptions | contended: "
        "steps, s, output tok/s, seats in use | tail: steps, s, output tokens, seats in use | flood requests left at "
        "the tail |",
        "|---|---|---|---|---|---|",
    ]
    for name, runs in v["runs"].items():
        c_tok, c_s = med(runs, "contended", "output_tokens"), med(runs, "contended", "seconds")
        rate, each, steps = _run_cells(v["median"][name], runs)
        rows.append(
            f"| `{name}` | {rate}; {each} | {steps}; {v['median'][name]['preemptions']:.0f} | "
            f"{med(runs, 'contended', 'steps'):.0f}, {c_s:.1f}, {c_tok / c_s:.1f}, "
            f"{med(runs, 'contended', 'seats_per_step'):.1f} | "
            f"{med(runs, 'tail', 'steps'):.0f}, {med(runs, 'tail', 'seconds'):.1f}, "
            f"{med(runs, 'tail', 'output_tokens'):.0f}, {med(runs, 'tail', 'seats_per_step'):.1f} | "
            f"{statistics.median(r['trace_summary']['flood_left_at_tail'] for r in runs):.0f} |"
        )
    return rows + ["", f"Record: `docs/{TRACE.name}`.", ""]


def render(record: dict[str, Any], check: bool = False) -> int:
    text = PAGE.read_text(encoding="utf-8")
    new = replace_block(text, TENANTS_BEGIN, TENANTS_END, page_block(record), PAGE)
    if new == text:
        return 0
    if check:
        print(f"out of date: {PAGE}; run tools/make_tenants.py --render-only")
        return 1
    PAGE.write_text(new, encoding="utf-8")
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--render-only", action="store_true")
    p.add_argument("--check", action="store_true", help="exit 1 if the docs differ from a render of the record")
    args = p.parse_args(argv)
    if not (args.render_only or args.check):
        RECORD.write_text(json.dumps(run(args.repeats), indent=2) + "\n")
    return render(json.loads(RECORD.read_text()), check=args.check)


if __name__ == "__main__":
    sys.exit(main())
