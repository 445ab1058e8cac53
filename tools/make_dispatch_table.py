"""Render the measured block of docs/dispatch.md from docs/benchmarks.json and the constants of `pick_backend`.

    .venv/bin/python -m tools.make_dispatch_table            # rewrite the block in docs/dispatch.md
    .venv/bin/python -m tools.make_dispatch_table --check    # exit 1 if the block is out of date

The block holds the thresholds and cost-model coefficients the code uses (`molora.ops.dispatch`), and one row per
shape of the `ops_grid` record (`ops_grid.result.rows[*]`: T tokens, K slots, r rank, fp32, top-1): the medians
(`ms`) of fused, stacked_mask, sort_group and gather; the record's `fastest` and `auto_backend`; what
`pick_backend` picks for that shape when the fused kernel cannot run (the eager cost model) and its measured time
over the faster eager backend's. Every figure comes from the record or from the code.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

from molora.docblock import markers, replace_block
from molora.ops import dispatch

BEGIN, END = markers("dispatch-table", "tools/make_dispatch_table.py")
EAGER = ("stacked_mask", "sort_group")


def fmt(v: float) -> str:
    return f"{v:.3g}"


def eager_pick(row: dict) -> str:
    """`pick_backend` for the record's shape with the fused kernel unavailable: the cost model's choice."""
    return dispatch.pick_backend(
        "cpu",
        getattr(torch, row["dtype"]),
        row["T"],
        row["K"],
        row["top_k"],
        row["r"],
        row["d"] + row["d_out"],
        fused_available=False,
        bf16_dot=False,
    )


def render(records: dict) -> str:
    rec = records["ops_grid"]
    rows = rec["result"]["rows"]
    shapes = sorted({(r["d"], r["d_out"], r["dtype"], r["top_k"], r["threads"]) for r in rows})
    out = [
        BEGIN,
        "",
        f"Thresholds the code uses (`molora/ops/dispatch.py`): `FUSED_BF16_TOKENS_PER_SLOT` = "
        f"{dispatch.FUSED_BF16_TOKENS_PER_SLOT}, `FUSED_BF16_SOFT_TOKENS_PER_SLOT` = "
        f"{dispatch.FUSED_BF16_SOFT_TOKENS_PER_SLOT}; cost-model coefficients in µs, "
        f"`STACKED_US` = {dispatch.STACKED_US} (fixed, per slot, per M weights read, per M MACs), "
        f"`SORTED_US` = {dispatch.SORTED_US} (fixed, per used slot, per M MACs, per M activations moved, "
        "top-k > 1).",
        "",
        f"Measured: `docs/benchmarks.json` → `ops_grid` (`{rec['command']}`, {rec['date']}; medians of "
        f"{rec['result']['repeats']} interleaved repetitions, field `ms`; shapes d × d_out, dtype, top-k, "
        f"threads: {', '.join(f'{a} × {b}, {c}, top-{k}, {t}' for a, b, c, k, t in shapes)}). "
        "**eager pick**: `pick_backend` with `fused_available=False`; **/ faster eager**: its measured time "
        "over the faster of stacked_mask and sort_group.",
        "",
        "| T | K | r | fused | stacked_mask | sort_group | gather | fastest | auto (recorded) | eager pick "
        "| / faster eager |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    regrets, gather_wins = [], 0
    for r in rows:
        ms = r["ms"]
        pick = eager_pick(r)
        regret = ms[pick] / min(ms[b] for b in EAGER)
        regrets.append(regret)
        gather = fmt(ms["gather"]) if "gather" in ms else "–"
        if "gather" in ms and ms["gather"] < min(ms[b] for b in EAGER):
            gather_wins += 1
            gather = f"**{gather}**"
        out.append(
            f"| {r['T']} | {r['K']} | {r['r']} | {fmt(ms['fused'])} | {fmt(ms['stacked_mask'])} "
            f"| {fmt(ms['sort_group'])} | {gather} | {r['fastest']} | {r['auto_backend']} | {pick} "
            f"| {regret:.2f} |"
        )
    n = len(rows)
    auto_fastest = sum(r["auto_backend"] == r["fastest"] for r in rows)
    agree = sum(x == 1.0 for x in regrets)
    out += [
        "",
        f"Over these {n} shapes: the recorded auto backend is the fastest measured at {auto_fastest}; without "
        f"the kernel the cost model picks the faster eager backend at {agree}, at a mean of "
        f"{sum(regrets) / n:.3f}× and at most {max(regrets):.2f}× its time; gather is faster than both eager "
        f"backends at {gather_wins} (in bold).",
        "",
        END,
    ]
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--docs", type=Path, default=Path("docs"), help="folder with benchmarks.json and dispatch.md")
    p.add_argument("--check", action="store_true", help="exit 1 if docs/dispatch.md's block is out of date")
    a = p.parse_args(argv)
    page = a.docs / "dispatch.md"
    text = page.read_text(encoding="utf-8")
    new = replace_block(text, BEGIN, END, render(json.loads((a.docs / "benchmarks.json").read_text(encoding="utf-8"))))
    if a.check:
        if new != text:
            print(f"{page} is out of date: run tools/make_dispatch_table.py", file=sys.stderr)
            return 1
        return 0
    page.write_text(new, encoding="utf-8")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
