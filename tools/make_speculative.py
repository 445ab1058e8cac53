"""The figures of docs/speculative.md from its record, docs/speculative.json.

    python -m tools.make_speculative [--check]

The records come from `molora bench engine --speculative JSON --json docs/speculative.json` (molora.bench.speculative;
the command and the machine are in each record): docs/speculative.json, and docs/speculative_loaded.json, the same
command on the same machine while other jobs loaded its two cores. This script measures nothing: it renders the tables
between the page's `<!-- speculative:begin (tools/make_speculative.py) -->` and `<!-- speculative:end -->` markers.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from molora.docblock import markers, wrap, write_block

ROOT = Path(__file__).resolve().parent.parent
RECORD = ROOT / "docs" / "speculative.json"
LOADED = ROOT / "docs" / "speculative_loaded.json"  # the same command on the same machine under other jobs' load
BATCH = ROOT / "docs" / "speculative_batch.json"  # batch sizes between: where speculative.MAX_DECODES comes from
PAGE = ROOT / "docs" / "speculative.md"
BEGIN, END = markers("speculative", "tools/make_speculative.py")


def _f(x: float | None, fmt: str) -> str:
    return "-" if x is None else format(x, fmt)


def render(rec: dict, *more: dict, sweep: dict | None = None) -> str:
    """The block: per record, the setup line, then one row per group (batch 1 skills, batch 1 chat, batch N skills);
    then the batch-size sweep, if given."""
    parts = [_table(r) for r in (rec, *more)] + ([_sweep(sweep)] if sweep is not None else [])
    return wrap(BEGIN, END, "\n\n".join(parts))


def _sweep(rec: dict) -> str:
    """One row per batch size of the sweep record: plain and speculative tok/s on the skill prompts, their ratio."""
    lines = [
        f"Batch sizes between, measured with `{rec['command']}` on {rec['cpu']} ({rec['threads']} threads, "
        f"{rec['dtype']}). {rec.get('note', '')}".rstrip(),
        "",
        "| batch | plain tok/s | speculative tok/s | speculative / plain | batch 1 in the same run: skills, chat | "
        "tokens differing | adapters differing |",
        "|---:|---:|---:|---:|---|---:|---:|",
    ]
    for b, run in rec["runs"].items():
        g = run[f"b{b}_skills"]
        one = f"{run['b1_skills']['speedup']:.2f}x, {run['b1_chat']['speedup']:.2f}x"
        bad = sum(x["tokens_differing"] for x in run.values())
        ads = sum(x["adapters_differing"] for x in run.values())
        lines.append(
            f"| {b} | {g['plain_tok_s']:.2f} | {g['spec_tok_s']:.2f} | {g['speedup']:.2f}x | {one} | "
            f"{bad} of {sum(x['tokens'] for x in run.values())} | {ads} |"
        )
    return "\n".join(lines)


def _table(rec: dict) -> str:
    spec = json.dumps(rec["speculative"])
    lines = [
        f"Measured with `{rec['command']}` on {rec['cpu']} ({rec['threads']} threads, {rec['dtype']}, "
        f"{rec['items_per_skill']} items per skill at batch 1, greedy, at most {rec['new_tokens']} new tokens, stop "
        f"at the bundle's stop ids), speculative config `{spec}`. {rec.get('note', '')}".rstrip(),
        "",
        "| batch | prompts | requests | output tokens | plain tok/s | speculative tok/s | speculative / plain | "
        "drafted | accepted | mean ids per verified chunk | tokens differing | adapters differing |",
        "|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for key, g in rec.items():
        if not (key.startswith("b") and isinstance(g, dict) and "speedup" in g):
            continue
        batch, group = key[1:].split("_", 1)
        lines.append(
            f"| {batch} | {group} | {g['requests']} | {g['output_tokens']} | {g['plain_tok_s']:.2f} | "
            f"{g['spec_tok_s']:.2f} | {g['speedup']:.2f}x | {g['drafted']} | {g['accepted']} | "
            f"{_f(g['mean_acceptance_length'], '.2f')} | {g['tokens_differing']} of {g['tokens']} | "
            f"{g['adapters_differing']} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tools.make_speculative", description=__doc__.split("\n")[0])
    ap.add_argument("--check", action="store_true", help="only say whether the page is stale (exit 1 if so)")
    args = ap.parse_args(argv)
    recs = [json.loads(p.read_text(encoding="utf-8")) for p in (RECORD, LOADED) if p.exists()]
    sweep = json.loads(BATCH.read_text(encoding="utf-8")) if BATCH.exists() else None
    changed = write_block(PAGE, BEGIN, END, render(*recs, sweep=sweep), check=args.check)
    if args.check and changed:
        print(f"{PAGE} is stale: run python -m tools.make_speculative")
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
