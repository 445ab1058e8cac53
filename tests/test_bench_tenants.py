"""The many-tenants benchmark (molora.bench.tenants): what it reports from a run's requests, and docs/serving.md's
block is what tools/make_tenants.py renders from docs/tenants_bench.json (no figure without its record)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from molora.bench.tenants import FLOOD, Shot, summarize


def test_summary_compares_the_steady_tenants_alone_and_under_the_flood():
    alone = [Shot("steady-0", 0.0, ttft=0.2, done=0.5, tokens=4), Shot("steady-1", 1.0, ttft=0.4, done=1.6, tokens=4)]
    flood = [
        Shot(FLOOD, 0.0, ttft=0.1, done=8.0, tokens=10),
        Shot(FLOOD, 0.0, ttft=0.1, done=10.0, tokens=10),
        Shot("steady-0", 0.0, ttft=2.0, done=3.0, tokens=4),
        Shot("steady-1", 1.0, ttft=4.0, done=6.0, tokens=4),
    ]
    row = summarize(alone, flood, {"molora_engine_steps_total": 14.0, "molora_generation_tokens_total": 28.0})
    assert row["steady_ttft_alone_p50_ms"] == 200.0 and row["steady_ttft_flood_p50_ms"] == 2000.0
    assert row["steady_ttft_p50_ratio"] == 10.0 and row["steady_ttft_p99_ratio"] == 10.0
    assert (row["flood_first_done_s"], row["flood_last_done_s"], row["makespan_s"]) == (8.0, 10.0, 10.0)
    assert row["output_tokens"] == 28 and row["output_tok_s"] == 2.8 and row["output_tokens_per_step"] == 2.0
    assert row["errors"] == 0


def test_tenants_docs_render_from_their_record():
    root = Path(__file__).resolve().parent.parent
    out = subprocess.run(
        [sys.executable, "-m", "tools.make_tenants", "--check"], capture_output=True, text=True, cwd=root
    )
    assert out.returncode == 0, out.stdout + out.stderr


def test_a_step_trace_splits_the_flood_run_where_the_last_steady_request_leaves(tmp_path):
    from experiments.tenants_variants import trace_summary

    def step(t, running, waiting, decode, prompt):
        return {"t0": t, "t1": t + 0.5, "running": running, "waiting": waiting, "decode": decode, "prompt": prompt}

    steps = [
        step(0, [["steady-0", 0, 16]], [], 1, 0),  # the steady tenants alone: not the flood run
        step(1, [[FLOOD, 1, 32], ["steady-0", 2, 16]], [FLOOD], 1, 100),
        step(2, [[FLOOD, 1, 31], ["steady-0", 2, 15]], [FLOOD], 2, 0),
        step(3, [[FLOOD, 1, 30], [FLOOD, 3, 32]], [FLOOD], 1, 50),
        step(4, [[FLOOD, 1, 29], [FLOOD, 3, 31]], [FLOOD], 2, 0),
        step(5, [[FLOOD, 1, 28], [FLOOD, 3, 30]], [], 2, 40),
    ]
    path = tmp_path / "steps.jsonl"
    path.write_text("".join(json.dumps(s) + "\n" for s in steps))
    got = trace_summary(path)
    assert got["contended"] == {
        "steps": 2, "seconds": 1.0, "output_tokens": 3, "prompt_tokens": 100, "seats_per_step": 2.0
    }  # fmt: skip
    assert got["tail"] == {"steps": 3, "seconds": 1.5, "output_tokens": 5, "prompt_tokens": 90, "seats_per_step": 2.0}
    assert got["flood_left_at_tail"] == 3 and got["flood_running_tokens_left_at_tail"] == [30, 32]
