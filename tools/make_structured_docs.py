"""Render the structured-output figures of docs/serving.md from their records.

    python -m tools.make_structured_docs

Reads docs/grammar_engines.json (experiments/choose_grammar_engine.py: the engine choice, validation split) and
docs/structured.json (experiments/structured_bench.py: the chosen engine on the real model, test split) and rewrites
the block between the structured markers in docs/serving.md. Every number on the page comes from those files.
"""

from __future__ import annotations

import json
from pathlib import Path

from molora.docblock import markers, wrap, write_block

ROOT = Path(__file__).resolve().parent.parent
PAGE = ROOT / "docs" / "serving.md"
BEGIN, END = markers("structured", "tools/make_structured_docs.py")


def _engines(rec: dict) -> list[str]:
    lines = [
        f"Choice of grammar engine: {rec['schemas']} validation schemas, the {rec['tokenizer']} tokenizer "
        f"({rec['vocab_size']} ids), one thread of {rec['cpu']} "
        "(`experiments/choose_grammar_engine.py` → `docs/grammar_engines.json`):",
        "",
        "| engine | version | schemas compiled | compile, median / max (ms) | masks of a 32-row step (ms) "
        "| tokenizer view (s) | random walks that ended: valid |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rec["results"]:
        if "error" in r:
            lines.append(f"| {r['engine']} | — | does not load: {r['error']} | | | | |")
            continue
        lines.append(
            f"| {r['engine']} | {r['version']} | {r['coverage']:.1%} | {r['compile_ms_median']:g} / "
            f"{r['compile_ms_max']:g} | {r['mask_ms_b32']:g} | {r['setup_s']:g} | "
            f"{r['walks_valid']} of {r['walks_complete']} |"
        )
    lines += ["", "Schemas each engine refused:", ""]
    for r in rec["results"]:
        fails = {k: v for k, v in r.get("failures", {}).items() if not k.endswith("(walk)")}
        lines.append(
            f"- {r['engine']}: " + ("; ".join(f"`{k}` ({v.splitlines()[0][:110]})" for k, v in fails.items()) or "none")
        )
    return lines


def _bench(rec: dict) -> list[str]:
    c, v = rec["compile"], rec["validity"]
    tput = rec.get("throughput", [])
    lines = [
        f"On the real model ({rec['model']}, {rec['dtype']}, {rec['grammar_engine']}, {rec['threads']} threads of "
        f"{rec['cpu']}), the {c['schemas']} test schemas, scored once (`{rec['command']}` → "
        "`docs/structured.json`"
        + (
            f"; load average (1, 5, 15 min) {rec['load_avg_start']} at the start, {rec.get('load_avg_end')} at the end"
            if "load_avg_start" in rec
            else ""
        )
        + (f"; answers from `{rec['validity_command']}`" if "validity_command" in rec else "")
        + "):",
        "",
        "| measure | result | goal |",
        "|---|---|---|",
        f"| schemas compiled | {c['compiled']} of {c['schemas']} ({c['coverage']:.1%}) | ≥ 90% |",
        f"| answers that parse and validate | {v['valid']} of {v['answers']} ({v['valid_share']:.1%}); "
        f"{v['finished']} ended within {v['max_new_tokens']} tokens, of which {v['valid_share_of_finished']:.1%} "
        "valid"
        + (
            f"; {v['flagged']} flagged by the answer check, {v['invalid_unflagged']} invalid and not flagged"
            if "flagged" in v
            else ""
        )
        + " | 100% |",
        f"| compile, first (median / max) | {c['compile_ms_first_median']:g} / {c['compile_ms_first_max']:g} ms | — |",
        f"| compile, cached (median) | {c['compile_ms_cached_median']:g} ms | — |",
    ]
    for t in tput:
        goal = "overhead ≤ 10%" if t["batch"] == 1 else "≥ 0.9×"
        tps = t["tokens_per_s"]
        ms = t["step_ms_median"]
        lines.append(
            f"| batch {t['batch']} decode, tokens/s unconstrained → constrained | {tps['unconstrained']:g} → "
            f"{tps['constrained']:g} ({t['constrained_over_unconstrained']:g}×, per-token overhead "
            f"{t['per_token_overhead']:+.1%}; step {ms['unconstrained']:g} → {ms['constrained']:g} ms) "
            f"| {goal} |"
        )
    st = rec.get("strict")
    if st is None:
        from molora.structured import unenforced

        schemas = json.loads((ROOT / "molora" / "data" / "schemas" / "schemas.json").read_text())["schemas"]
        loose = {s["name"]: unenforced(s["schema"]) for s in schemas if s["split"] == "test"}
        loose = {k: v for k, v in loose.items() if v}
        kept = c["compiled"] - len(loose)
        lines += [
            f"| with `strict: true` (unenforced keywords refused) | {kept} of {c['schemas']} compiled "
            f"({kept / c['schemas']:.1%}) | — |"
        ]
        lines += ["", "Refused under strict: " + "; ".join(f"`{k}` ({', '.join(v)})" for k, v in loose.items())]
    else:
        lines += [
            f"| with `strict: true` (unenforced keywords refused) | {st['compiled']} of {st['schemas']} compiled "
            f"({st['coverage']:.1%}); {st['valid']} of {st['answers']} answers valid, "
            f"{st['valid_share_of_finished']:.1%} of the {st['finished']} that ended | 100% valid |"
        ]
        lines += ["", "Refused under strict: " + "; ".join(f"`{k}` ({', '.join(v)})" for k, v in st["refused"].items())]
    if "source" in v:
        lines += ["", f"Validity comes from {v['source']}."]
    if tput:
        t0 = tput[0]
        timed = ", ".join(
            f"batch {t['batch']} {t['steps']['unconstrained']} / {t['steps']['constrained']}" for t in tput
        )
        lines += [
            "",
            f"Throughput: greedy decode steps where every row decodes, median, {t0['reps']} run(s) per "
            f"variant, {t0['max_new_tokens']} new tokens per request"
            + (
                ", prompts that name the schema without spelling it (less prefill; decode is what is timed)"
                if t0.get("short_prompts")
                else ""
            )
            + f"; steps timed (unconstrained / constrained): {timed}"
            + (
                f"; measured by an earlier run (`{rec['throughput_command']}`, load average "
                f"{rec['throughput_load_avg'][0]} at its start, {rec['throughput_load_avg'][1]} at its end)."
                if "throughput_command" in rec
                else "."
            ),
        ]
    if len(tput) < 2:
        lines += ["", "Batch 32 throughput: not measured (the run did not finish before the deadline)."]
    bad = [r for r in v.get("rows", []) if not r["valid"]]
    if bad:
        lines += ["", "Answers that did not validate:", ""]
        lines += [
            f"- `{r['name']}`: finish_reason {r['finish_reason']} after {r['tokens']} tokens; {r.get('why', '')}"
            for r in bad
        ]
    if c["failures"]:
        lines += ["", "Schemas refused: " + "; ".join(f"`{k}` ({m[:120]})" for k, m in c["failures"].items())]
    return lines


def main() -> None:
    engines = json.loads((ROOT / "docs" / "grammar_engines.json").read_text())
    bench = json.loads((ROOT / "docs" / "structured.json").read_text())
    page = wrap(BEGIN, END, "\n".join([""] + _engines(engines) + [""] + _bench(bench) + [""]))
    for path, block in ((PAGE, page),):
        if write_block(path, BEGIN, END, block):
            print(f"rendered {path.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
