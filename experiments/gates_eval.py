"""Score the composable per-adapter gates (molora.routing.gates, chosen on validation by experiments/gates_choose.py)
once on the test items of docs/arrow_prompt.json (the first --n test items per skill, the first --n-general general
test prompts, --n-mixed two-skill test items), with the same evaluation code, and write docs/gates_prompt.json
beside that record's prompt-level Arrow, learned router and one-adapter-per-request results (same bundle
fingerprint and item counts, checked).

    .venv/bin/python -m experiments.gates_eval --gates runs/gates --choice docs/gates_choice.json \
        --json docs/gates_prompt.json [--beside docs/arrow_prompt.json]

With --confidence instead of --gates, a molora.routing.confidence chooser (experiments/datafree_confidence.py) picks
one adapter (or the base) per request, scored in the evaluation's "sequence" mode (two-skill items: one adapter
for the whole conversation). With --hybrid, a molora.routing.hybrid chooser (experiments/datafree_hybrid.py:
prompt-level
Arrow decides whether a request leaves the base model, the confidence chooser which adapter), scored the same way.
Runs are cached under --work (an interrupted run resumes).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

from tools.make_results import cached  # (the one cache of evaluation runs)


def main(argv: list[str] | None = None) -> int:
    import torch

    from molora.bench.common import machine_info
    from molora.bundle import load
    from molora.data.general import general_split
    from molora.data.jsonl import write_jsonl
    from molora.data.skills import write_bbh_file
    from molora.eval.general import evaluate_general
    from molora.eval.heldout import fingerprint, held_out, held_out_mixed, training_inputs
    from molora.eval.runner import evaluate
    from molora.routing.confidence import ConfidenceChooser
    from molora.routing.gates import GateRouter
    from molora.routing.hybrid import HybridChooser

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--gates", help="the GateRouter folder experiments/gates_choose.py --gates-out wrote")
    ap.add_argument(
        "--confidence",
        help="instead of gates: a molora.routing.confidence chooser folder (experiments/datafree_confidence.py --out), "
        "scored in the evaluation's one-adapter-per-request mode",
    )
    ap.add_argument(
        "--hybrid", help="instead of gates: a molora.routing.hybrid chooser folder (datafree_hybrid.py --out)"
    )
    ap.add_argument("--choice", required=True, help="the record of experiments/gates_choose.py")
    ap.add_argument("--json", required=True)
    ap.add_argument("--beside", default="docs/arrow_prompt.json", help="the record whose items and modes to join")
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--work", default="runs/gates_work")
    ap.add_argument(
        "--per-turn",
        action="store_true",
        help="with --confidence or --hybrid: also answer the two-skill items in the evaluation's turn mode (each "
        "turn chosen on its own question), column LABEL_turn",
    )
    ap.add_argument("--note", default=None, help="a sentence kept in the record (e.g. which test scoring this is)")
    ap.add_argument("--label", default="gates", help="the column these gates get in the record (default gates)")
    a = ap.parse_args(argv)
    if sum(x is not None for x in (a.gates, a.confidence, a.hybrid)) != 1:
        ap.error("give exactly one of --gates, --confidence and --hybrid")
    mode = "learned" if a.gates else "sequence"
    torch.set_num_threads(a.threads)
    work = Path(a.work)
    (work / "data").mkdir(parents=True, exist_ok=True)
    beside = json.loads(Path(a.beside).read_text())
    n, n_general, n_mixed = beside["n"], beside["n_general"], beside["n_mixed"]
    mm = load(None)
    bundle = mm.bundle
    if fingerprint(bundle) != beside["fingerprint"]:
        raise SystemExit(f"{a.beside} scored another bundle ({beside['fingerprint']} != {fingerprint(bundle)})")
    router: Any
    if a.gates:
        router = GateRouter.load(a.gates).bind(mm)
    elif a.hybrid:
        router = HybridChooser.load(a.hybrid).bind(mm)
    else:
        router = ConfidenceChooser.load(a.confidence)
    mm._modules.pop("router", None)  # mm.router is a registered submodule while it holds the learned router
    mm.__dict__.pop("router", None)
    mm.router = router
    banned = training_inputs(bundle)
    tasks = [ad.tasks[0] for ad in bundle.adapters if ad.tasks]
    skills, general, mixed = {}, {}, {}
    for t in tasks:
        items, _ = held_out(t, max(n, 100), banned, split="test")
        path = work / "data" / f"test_{t}.json"
        write_bbh_file(path, items[:n])
        s = cached(
            work / f"test__{t}__{a.label}.json",
            lambda spec=f"bbh:{path}": evaluate(mm, spec, mode, batch_size=a.batch_size, progress=False),
        )
        skills[t] = {a.label: {k: s[k] for k in ("n", "accuracy", "seconds", "generated_tokens")}}
        skills[t].update(beside["skills"][t])
    rows = general_split()["test"][:n_general]
    write_jsonl(
        work / "data" / "general_test.jsonl",
        [{"id": r["id"], "source": r["source"], "prompt": r["prompt"]} for r in rows],
    )
    g = cached(
        work / f"general__{a.label}.json",
        lambda: evaluate_general(mm, f"general:{work / 'data' / 'general_test.jsonl'}", mode, batch_size=a.batch_size),
    )
    general[a.label] = {k: g[k] for k in ("n", "retention", "empty_where_base_answers", "adapter_token_share")}
    general.update(beside["general"])
    if n_mixed:
        write_jsonl(work / "data" / "mixed.jsonl", held_out_mixed(tasks, n_mixed, banned, split="test"))
        s = cached(
            work / f"mixed__{a.label}.json",
            lambda: evaluate(
                mm, f"mixed:{work / 'data' / 'mixed.jsonl'}", mode, batch_size=a.batch_size, progress=False
            ),
        )
        mixed[a.label] = {k: s[k] for k in ("n", "accuracy", "item_accuracy", "seconds", "generated_tokens")}
        if a.per_turn and mode == "sequence":
            s = cached(
                work / f"mixed__{a.label}_turn.json",
                lambda: evaluate(
                    mm, f"mixed:{work / 'data' / 'mixed.jsonl'}", "turn", batch_size=a.batch_size, progress=False
                ),
            )
            mixed[f"{a.label}_turn"] = {
                k: s[k] for k in ("n", "accuracy", "item_accuracy", "seconds", "generated_tokens")
            }
        mixed.update(beside["mixed"])
    rec = {
        "command": "python -m experiments.gates_eval "
        + (
            f"--gates {a.gates} "
            if a.gates
            else f"--hybrid {a.hybrid} "
            if a.hybrid
            else f"--confidence {a.confidence} "
        )
        + f"--choice {a.choice} --json {a.json} "
        f"--beside {a.beside} --threads {a.threads}"
        + ("" if a.label == "gates" else f" --label {a.label}")
        + (" --per-turn" if a.per_turn else "")
        + (f" --note {json.dumps(a.note)}" if a.note else ""),
        **({"note": a.note} if a.note else {}),
        "beside": {k: beside[k] for k in ("command", "date", "fingerprint")},
        "choice": a.choice,
        "date": time.strftime("%Y-%m-%d"),
        "machine": machine_info(),
        "fingerprint": fingerprint(bundle),
        "config": {**router.config.__dict__, "adapter_names": router.adapter_names}
        if a.gates
        else {
            **{k: v for k, v in router.chooser.__dict__.items() if k not in ("mean", "std")},
            "arrow": {k: v for k, v in router.arrow.__dict__.items()},
            "z_or": router.z_or,
            "z_floor": router.z_floor,
        }
        if a.hybrid
        else {k: v for k, v in router.__dict__.items() if k not in ("mean", "std")},
        "skills": skills,
        "general": general,
        "mixed": mixed,
        "n": n,
        "n_general": n_general,
        "n_mixed": n_mixed,
    }
    Path(a.json).write_text(json.dumps(rec, indent=1) + "\n")
    print(json.dumps({"skills": {t: {m: v["accuracy"] for m, v in d.items()} for t, d in skills.items()}}))
    print(json.dumps({"general": general, "mixed": {m: v["accuracy"] for m, v in mixed.items()}}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())


def _row(name: str, r: dict, cols: list[str]) -> str:
    return f"| {name} | " + " | ".join(f"{r[c]:.1f}" for c in cols) + " |"


def render_section(rec: dict) -> list[str]:
    """docs/results.md's section on the composable gates (markdown lines) from docs/gates_prompt.json and its
    validation choice (docs/gates_choice.json)."""
    c = rec["config"]
    out = [
        "## Composable per-adapter gates (each adapter's own prompts, no other adapter's data)",
        "",
        "One linear gate per adapter over one block's normed input, each trained alone (one-vs-rest) on its own "
        "adapter's training prompts against general prompts the base model answers (general train split and "
        "everyday topic prompts), each with its own threshold set on held-out prompts of those two sets; a new "
        "adapter brings its gate and no other gate changes (`molora/routing/gates.py`, `molora/train/gates.py`). A "
        "probe on the base model lets each prompt token vote for the gate that clears its threshold by most, the "
        "prompt votes as in prompt-level Arrow, and a prompt no gate claims (or too little of it) stays on the base "
        f"model. Settings: block {c['source_block']} (from the end), prompt_share {c['prompt_share']}, prompt_window "
        f"{c['prompt_window']}. Unlike Arrow (no data at all), the gates need each adapter's own prompts.",
        "",
    ]
    choice_path = Path(rec["choice"])
    if choice_path.is_file():
        ch = json.loads(choice_path.read_text())
        tasks = ch["tasks"]
        cols = [*tasks, "general", "mixed_turn1", "mixed_turn2", "skills_mean"]
        b = ch["chosen"]
        out += [
            f"**Chosen on validation** (`{ch['command']}`; the {ch['n_val_per_skill']} validation items per skill, "
            f"{ch['n_general_val']} general prompts and two-skill items of docs/arrow_variants_choice.json; % of each "
            "set whose answer runs where it belongs, own adapter or base model; among settings keeping >= 95% of "
            f"general prompts on the base, {ch['settings_searched']} searched). Gates: block {b['block']}, l2 "
            f"{b['l2']}, threshold {b['rule']} {b['value']}, prompt_share {b['prompt_share']}, window {b['window']}. "
            "The learned router's entry is its probe's decision at the last prompt token (where its answer starts).",
            "",
            "| routing | " + " | ".join(cols) + " |",
            "|---|" + "---|" * len(cols),
            _row("gates (chosen)", b, cols),
        ]
        if ch.get("best_mean_pooled"):
            out.append(_row("gates, mean-pooled state (not served)", ch["best_mean_pooled"], cols))
        out += [_row("prompt-Arrow (chosen)", ch["arrow_prompt_chosen"], cols), _row("learned", ch["learned"], cols)]
        ties = sum(1 for r in ch["grid_top"] if r["skills_mean"] == b["skills_mean"] and r["aggregate"] == "vote")
        out += [
            "",
            f"At least {ties} served settings (of the {len(ch['grid_top'])} best the record keeps) reach the chosen "
            "skills mean on validation, so the tie-breaks (two-skill second turns, then general prompts kept home) "
            "decide among them; the validation set cannot rank them further.",
        ]
        out.append("")
    items = f"the first {rec['n']} test items per skill, the items of docs/arrow_prompt.json, whose other columns"
    items += " it repeats"
    return out + test_tables(rec, items)


def test_tables(rec: dict, items: str, mixed_note: str = "") -> list[str]:
    """The test tables of a record this script writes (skills, general prompts, two-skill items); `items` says
    which items, `mixed_note` what the two-skill caption adds."""
    tasks = list(rec["skills"])
    modes = list(next(iter(rec["skills"].values())))
    out = [
        f"**Test items** (`{rec['command']}` on {rec['date']}; {items}; strict accuracy %, scored once):",
        "",
        "| skill | " + " | ".join(modes) + " |",
        "|---|" + "---|" * len(modes),
    ]
    out += [f"| {t} | " + " | ".join(f"{rec['skills'][t][m]['accuracy']:.1f}" for m in modes) + " |" for t in tasks]
    out += ["", f"**General prompts** ({rec['n_general']} test prompts):", ""]
    out += ["| routing | retention % | empty % | adapter tokens % |", "|---|---|---|---|"]
    out += [
        f"| {m} | {g['retention']:.1f} | {g['empty_where_base_answers']:.1f} | {g['adapter_token_share']:.1f} |"
        for m, g in rec["general"].items()
    ]
    if rec.get("mixed"):
        caption = f"**Two-skill items** ({rec['n_mixed']} test items; part accuracy %, both right %{mixed_note}):"
        out += ["", caption, ""]
        out += ["| routing | part accuracy % | both right % |", "|---|---|---|"]
        out += [f"| {k} | {v['accuracy']:.1f} | {v['item_accuracy']:.1f} |" for k, v in rec["mixed"].items()]
    return out + [""]
