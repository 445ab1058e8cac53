"""The figures of docs/speculative.md from its records, docs/speculative*.json.

    python -m tools.make_speculative [--check]

The records come from `molora bench engine --speculative JSON --json docs/speculative.json` (molora.bench.speculative;
the command and the machine are in each record): docs/speculative.json, and docs/speculative_loaded.json, the same
command on the same machine while other jobs loaded its two cores; docs/speculative_carry.json, the two carry
treatments (`molora bench engine --speculative JSON --carry-compare`); docs/speculative_peer.json, beside llama.cpp's
prompt lookup (`molora bench peer --speculative JSON`, molora.bench.peer_speculative); each with a `_loaded` run beside
it, the same command while other jobs loaded the cores. This script measures nothing: it
renders the tables between the page's `<!-- speculative:begin (tools/make_speculative.py) -->` and
`<!-- speculative:end -->` markers, and likewise `speculative_carry` and `speculative_peer`.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from molora.docblock import markers, wrap, write_block

ROOT = Path(__file__).resolve().parent.parent
RECORD = ROOT / "docs" / "speculative.json"
LOADED = ROOT / "docs" / "speculative_loaded.json"  # the same command on the same machine under other jobs' load
RULE = ROOT / "docs" / "speculative_rule.json"  # another CPU, with the batch-N row under the engine's own rule
BATCH = ROOT / "docs" / "speculative_batch.json"  # batch sizes between: where speculative.MAX_DECODES comes from
# carry "truncate" against "rerun", batch 1: a quiet run, then the same command under other jobs' load
CARRY = [ROOT / "docs" / "speculative_carry.json", ROOT / "docs" / "speculative_carry_loaded.json"]
# beside llama.cpp's prompt lookup, batch 1, one LoRA: likewise
PEER = [ROOT / "docs" / "speculative_peer.json", ROOT / "docs" / "speculative_peer_loaded.json"]
PAGE = ROOT / "docs" / "speculative.md"
BEGIN, END = markers("speculative", "tools/make_speculative.py")
CARRY_BEGIN, CARRY_END = markers("speculative_carry", "tools/make_speculative.py")
PEER_BEGIN, PEER_END = markers("speculative_peer", "tools/make_speculative.py")


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


def _machine(m: dict) -> str:
    load = m.get("loadavg_1_5_15")
    after = m.get("loadavg_after")
    return (
        f"{m['cpu']} ({m['cores']} cores, threads: {m['threads']}; load average {load[0] if load else '-'} at the start"
        + (f", {after[0]} at the end" if after else "")
        + ")"
    )


def render_carry(rec: dict, default: str) -> str:
    """The carry comparison: per group the median tok/s of plain, truncate and rerun over the rounds, the medians of
    the per-round ratios, ids per verified chunk, rows cut and rows run again; then which treatment the numbers
    favour and the default (`default`: SpeculativeConfig's)."""
    lines = [
        f"Measured with `{rec['command']}` on {_machine(rec['machine_info'])}, {rec['dtype']}, "
        f"{rec['items_per_skill']} items per skill and as many chat prompts, each alone (batch 1), greedy, at most "
        f"{rec['new_tokens']} new tokens; plain, truncate and rerun on every prompt in turn, the order rotating, "
        f"{rec['repeats']} rounds. {rec.get('note', '')}".rstrip(),
        "",
        "| prompts | requests | tok/s plain | tok/s truncate | tok/s rerun | rerun / truncate | truncate / plain | "
        "rerun / plain | ids per verified chunk (truncate, rerun) | rows cut (truncate) | reruns: passes, rows | "
        "tokens, adapters differing from plain (both treatments) |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---|---:|---|---|",
    ]
    ratios = []
    for key, g in rec.items():
        if not (key.startswith("b1_") and isinstance(g, dict)):
            continue
        t, r, med = g["truncate"], g["rerun"], g["median_tok_s"]
        ratios.append(g["median_ratio_rerun_over_truncate"])
        lines.append(
            f"| {key[3:]} | {g['requests']} | {med['plain']:.2f} | {med['truncate']:.2f} | {med['rerun']:.2f} | "
            f"{g['median_ratio_rerun_over_truncate']:.2f}x | {g['median_ratio_truncate_over_plain']:.2f}x | "
            f"{g['median_ratio_rerun_over_plain']:.2f}x | {_f(t['ids_per_verified_chunk'], '.2f')}, "
            f"{_f(r['ids_per_verified_chunk'], '.2f')} | {t['carry_cut_rows']} | {r['carry_reruns']}, "
            f"{r['carry_rerun_rows']} | {t['tokens_differing'] + r['tokens_differing']}, "
            f"{t['adapters_differing'] + r['adapters_differing']} of {t['tokens']} |"
        )
    groups = [g for k, g in rec.items() if k.startswith("b1_") and isinstance(g, dict)]
    cuts = sum(g["truncate"]["carry_cut_rows"] for g in groups)
    reruns = sum(g["rerun"]["carry_reruns"] for g in groups)
    if reruns == 0:
        verdict = (
            f"`rerun` ran no extra pass in this run: each of the {cuts} rows `truncate` cut came after a rejected "
            "draft id, where neither treatment uses them, so both emitted the same ids per verified chunk and did the "
            "same work; their ratio measures the machine's noise only and nothing favours `rerun`"
        )
    elif all(x > 1 for x in ratios):
        verdict = "`rerun` was faster on every group"
    elif all(x < 1 for x in ratios):
        verdict = "`truncate` was faster on every group"
    else:
        verdict = "neither treatment was faster on every group"
    lines += ["", f"{verdict}; the default is `{default}`."]
    return "\n".join(lines)


def render_peer(rec: dict) -> str:
    """Beside llama.cpp: per group the median tok/s of the four systems over the rounds and the medians of the
    per-round tok/s ratios (> 1: the first is faster), molora's ids per verified chunk and each system's greedy
    agreement with molora plain."""
    lines = [
        f"Measured with `{rec['command']}` on {_machine(rec['machine_info'])}: llama-cpp-python "
        f"{rec['llama_cpp']['llama_cpp_python']} ({rec['llama_cpp']['api']}; drafts `{rec['llama_cpp_draft']}`) on "
        f"`{rec['gguf']}`, molora in float32; each prompt alone, greedy, at most {rec['new_tokens']} new tokens or a "
        f"stop id, on the bundle's `{rec['adapter']}` LoRA on both; the four systems on every prompt in turn, the "
        f"order rotating, {rec['repeats']} rounds. {rec.get('note', '')}".rstrip(),
        "",
        "| prompts | requests | molora tok/s | molora + ngram | llama.cpp | llama.cpp + prompt lookup | "
        "molora ngram / plain | llama.cpp lookup / plain | llama.cpp / molora, plain | "
        "llama.cpp lookup / molora ngram | molora ids per verified chunk | "
        "greedy agreement with molora (ngram, llama.cpp, llama.cpp lookup) |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for name, g in rec["groups"].items():
        m, r, a = g["median_tok_s"], g["median_ratio_over_molora"], g["greedy_agreement_with_molora"]
        lines.append(
            f"| {name} | {g['requests']} | {m['molora']:.2f} | {m['molora_spec']:.2f} | {m['llama.cpp']:.2f} | "
            f"{m['llama.cpp_spec']:.2f} | {r['molora_spec']:.2f}x | {g['median_ratio_llama_spec_over_llama']:.2f}x | "
            f"{r['llama.cpp']:.2f}x | "
            f"{g['median_ratio_llama_spec_over_molora_spec']:.2f}x | {_f(g['molora_ids_per_verified_chunk'], '.2f')} | "
            f"{a['molora_spec']:.2f}, {a['llama.cpp']:.2f}, {a['llama.cpp_spec']:.2f} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tools.make_speculative", description=__doc__.split("\n")[0])
    ap.add_argument("--check", action="store_true", help="only say whether the page is stale (exit 1 if so)")
    args = ap.parse_args(argv)
    recs = [json.loads(p.read_text(encoding="utf-8")) for p in (RECORD, LOADED, RULE) if p.exists()]
    sweep = json.loads(BATCH.read_text(encoding="utf-8")) if BATCH.exists() else None
    changed = write_block(PAGE, BEGIN, END, render(*recs, sweep=sweep), check=args.check)
    from molora.engine.speculative import SpeculativeConfig

    carry = [json.loads(p.read_text(encoding="utf-8")) for p in CARRY if p.exists()]
    if carry:
        body = "\n\n".join(render_carry(r, SpeculativeConfig().carry) for r in carry)
        changed |= write_block(PAGE, CARRY_BEGIN, CARRY_END, wrap(CARRY_BEGIN, CARRY_END, body), check=args.check)
    peer = [json.loads(p.read_text(encoding="utf-8")) for p in PEER if p.exists()]
    if peer:
        body = "\n\n".join(render_peer(r) for r in peer)
        changed |= write_block(PAGE, PEER_BEGIN, PEER_END, wrap(PEER_BEGIN, PEER_END, body), check=args.check)
    if args.check and changed:
        print(f"{PAGE} is stale: run python -m tools.make_speculative")
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
