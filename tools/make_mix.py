"""The mix benchmark's block in docs/serving.md, rendered from its committed record (docs/mix_bench.json, written by
`molora bench mix --json docs/mix_bench.json`).

    python -m tools.make_mix            # rewrite the block
    python -m tools.make_mix --check    # exit 1 when the block is stale
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from molora.docblock import markers, wrap, write_block

ROOT = Path(__file__).resolve().parents[1]
RECORD = ROOT / "docs" / "mix_bench.json"
PAGE = ROOT / "docs" / "serving.md"
BEGIN, END = markers("mixbench", "tools/make_mix.py")
LABELS = {
    "pinned": "pinned, one adapter each (top-1)",
    "mix": "a different two-adapter mix each (top-2, fused kernel per choice column)",
    "mix_eager": "the same mixes, fused kernel kept to top-1 (top-2 on the eager backends)",
}


def render(record: dict) -> str:
    """The block's body: the setup, one row per variant (tokens/s, its paired ratio to pinned) and the goal."""
    c, m = record["config"], record["machine"]
    lines = [
        f"{c['requests']} requests of {c['prompt_len']} prompt tokens and {c['new_tokens']} greedy new tokens on the "
        f"default bundle ({len(c['adapters'])} adapters, {c['slots']} slots, {c['dtype']}), one engine, "
        f"{c['repeats']} interleaved repetitions, {c['threads']} thread(s) on {m['cpu']} "
        f"(record: [mix_bench.json](mix_bench.json)).",
        "",
        "| batch | tokens/s (median) | tokens/s over pinned (paired median [quartiles]) |",
        "|---|---:|---:|",
    ]
    for name, label in LABELS.items():
        tps = record["tokens_per_s"][name]
        if name == "pinned":
            lines.append(f"| {label} | {tps:.1f} | 1 |")
        else:
            med, lo, hi = record["over_pinned"][name]
            lines.append(f"| {label} | {tps:.1f} | {med:.2f} [{lo:.2f}, {hi:.2f}] |")
    med = record["over_pinned"]["mix"][0]
    goal = record["goal_over_pinned"]
    lines += ["", f"Goal: at least {goal:g}x of pinned; measured {med:.2f}x ({'met' if med >= goal else 'not met'})."]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--check", action="store_true", help="exit 1 when the block is stale; write nothing")
    a = p.parse_args(argv)
    block = wrap(BEGIN, END, render(json.loads(RECORD.read_text())))
    changed = write_block(PAGE, BEGIN, END, block, check=a.check)
    if a.check and changed:
        print(f"{PAGE} is stale: run python -m tools.make_mix", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
