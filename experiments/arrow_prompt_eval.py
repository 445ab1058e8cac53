"""Score prompt-level Arrow (settings chosen on validation by experiments/arrow_variants_choose.py) once on the test
items that docs/arrow.json scored the learned router and per-token Arrow on (the first --n test items per skill
of `molora.eval.heldout`, the first --n-general general test prompts) and on --n-mixed two-skill test items
(beside the learned router and one adapter per request, `sequence`), with the same evaluation code, and write
docs/arrow_prompt.json.

    python -m experiments.arrow_prompt_eval --choice docs/arrow_variants_choice.json --json docs/arrow_prompt.json

Runs are cached under --work (an interrupted run resumes).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

from experiments.arrow_variants_choose import served_config  # (the choice record -> ArrowConfig fields)
from tools.make_results import cached  # (the one cache of evaluation runs)


def main(argv: list[str] | None = None) -> int:
    import torch

    from molora.bench.common import machine_info
    from molora.bundle import load
    from molora.data.jsonl import write_jsonl
    from molora.eval.heldout import fingerprint, held_out_mixed, training_inputs
    from molora.eval.runner import evaluate
    from molora.routing.arrow import ArrowConfig, ArrowRouter

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--choice", required=True, help="the record of experiments/arrow_variants_choose.py")
    ap.add_argument("--json", required=True)
    ap.add_argument("--n", type=int, default=24)
    ap.add_argument("--n-general", type=int, default=40)
    ap.add_argument("--n-mixed", type=int, default=24)
    ap.add_argument("--mixed-modes", default="arrow_prompt,learned,sequence", help="comma-separated")
    ap.add_argument(
        "--learned-from",
        help="an earlier record of this script on the same items (same bundle fingerprint, --n, --n-general): take "
        "the learned router's single-skill and general results from it instead of generating them again (greedy, so "
        "the same answers); the record names its source",
    )
    ap.add_argument(
        "--part",
        choices=("all", "single", "mixed"),
        default="all",
        help="single / mixed: only fill the run cache of that part (two processes can share a busy machine); "
        "all: every run (cached ones reused) and the record",
    )
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--work", default="runs/arrow_prompt_work")
    a = ap.parse_args(argv)
    torch.set_num_threads(a.threads)
    work = Path(a.work)
    (work / "data").mkdir(parents=True, exist_ok=True)
    cfg = ArrowConfig(**served_config(json.loads(Path(a.choice).read_text())))
    mm = load(None)
    bundle, names = mm.bundle, mm.adapter_names
    learned = mm.router
    router = ArrowRouter(cfg, names).bind(mm)

    def use(r: Any) -> None:  # mm.router is a registered submodule while it holds the learned router
        mm._modules.pop("router", None)
        mm.__dict__.pop("router", None)
        mm.router = r

    def run(path: Path, r: Any, go: Any) -> dict:
        def wrapped():
            use(r)
            try:
                return go()
            finally:
                use(learned)

        return cached(path, wrapped)

    banned = training_inputs(bundle)
    tasks = [ad.tasks[0] for ad in bundle.adapters if ad.tasks]
    prior = json.loads(Path(a.learned_from).read_text()) if a.learned_from else None
    if prior and (prior["fingerprint"], prior["n"], prior["n_general"]) != (fingerprint(bundle), a.n, a.n_general):
        raise SystemExit(f"{a.learned_from} scored other items (fingerprint, --n or --n-general differ)")
    single = ("arrow_prompt",) if prior else ("arrow_prompt", "learned")
    skills, general, mixed = {}, {}, {}
    if a.part != "mixed":
        single_part(a, tasks, banned, single, prior, run, router, learned, skills, general)
    if a.n_mixed and a.part != "single":
        write_jsonl(work / "data" / "mixed.jsonl", held_out_mixed(tasks, a.n_mixed, banned, split="test"))
        for m, r, mode in (
            ("arrow_prompt", router, "learned"),
            ("learned", learned, "learned"),
            ("sequence", learned, "sequence"),
        ):
            if m not in a.mixed_modes.split(","):
                continue
            s = run(
                work / f"mixed__{m}.json",
                r,
                lambda mode=mode: evaluate(
                    mm, f"mixed:{work / 'data' / 'mixed.jsonl'}", mode, batch_size=a.batch_size, progress=False
                ),
            )
            mixed[m] = {k: s[k] for k in ("n", "accuracy", "item_accuracy", "seconds", "generated_tokens")}
    if a.part != "all":
        return 0
    rec = {
        "command": "python -m experiments.arrow_prompt_eval --choice "
        + a.choice
        + " --json "
        + a.json
        + f" --n {a.n} --n-general {a.n_general} --n-mixed {a.n_mixed} --mixed-modes {a.mixed_modes} --threads "
        + f"{a.threads}"
        + (f" --learned-from {a.learned_from}" if a.learned_from else ""),
        "learned_from": None if prior is None else {k: prior[k] for k in ("command", "date", "fingerprint", "config")},
        "date": time.strftime("%Y-%m-%d"),
        "machine": machine_info(),
        "fingerprint": fingerprint(bundle),
        "config": {
            k: getattr(cfg, k)
            for k in (
                "granularity",
                "prompt",
                "rms_threshold",
                "prompt_share",
                "prompt_window",
                "source_block",
                "calibration_prompts",
            )
        },
        "skills": skills,
        "general": general,
        "mixed": mixed,
        "n_mixed": a.n_mixed,
        "n": a.n,
        "n_general": a.n_general,
    }
    Path(a.json).write_text(json.dumps(rec, indent=1) + "\n")
    print(
        json.dumps(
            {"skills": {t: {m: v["accuracy"] for m, v in d.items()} for t, d in skills.items()}, "general": general}
        )
    )
    return 0


def single_part(a, tasks, banned, modes, prior, run, router, learned, skills, general) -> None:  # noqa: ANN001
    """Fill skills[task][mode] and general[mode] (the learned router's from `prior` when given)."""
    from molora.data.general import general_split
    from molora.data.jsonl import write_jsonl
    from molora.data.skills import write_bbh_file
    from molora.eval.general import evaluate_general
    from molora.eval.heldout import held_out
    from molora.eval.runner import evaluate

    work = Path(a.work)
    routers = {"arrow_prompt": router, "learned": learned}
    mm = router._mm
    for t in tasks:
        items, _ = held_out(t, max(a.n, 100), banned, split="test")
        path = work / "data" / f"test_{t}.json"
        write_bbh_file(path, items[: a.n])
        skills[t] = {}
        for m in modes:
            s = run(
                work / f"test__{t}__{m}.json",
                routers[m],
                lambda spec=f"bbh:{path}": evaluate(mm, spec, "learned", batch_size=a.batch_size, progress=False),
            )
            skills[t][m] = {k: s[k] for k in ("n", "accuracy", "seconds", "generated_tokens")}
        if prior:
            skills[t]["learned"] = prior["skills"][t]["learned"]
    rows = general_split()["test"][: a.n_general]
    write_jsonl(
        work / "data" / "general_test.jsonl",
        [{"id": r["id"], "source": r["source"], "prompt": r["prompt"]} for r in rows],
    )
    for m in modes:
        g = run(
            work / f"general__{m}.json",
            routers[m],
            lambda: evaluate_general(
                mm, f"general:{work / 'data' / 'general_test.jsonl'}", "learned", batch_size=a.batch_size
            ),
        )
        general[m] = {k: g[k] for k in ("n", "retention", "empty_where_base_answers", "adapter_token_share")}
    if prior:
        general["learned"] = prior["general"]["learned"]


def _setting(r: dict) -> str:
    window = "whole prompt" if r["window"] is None else f"last {r['window']} tokens"
    return (
        f"block {r['block']}, {r['calibration']} calibration, {r['score']} over the {window}, {r['rule']} {r['value']}"
    )


def render_choice(ch: dict) -> list[str]:
    """The validation choice (docs/arrow_variants_choice.json): the best setting of each variant and rule at 95%
    general retention, and what per-adapter thresholds fitted with labels would allow at best."""
    tasks = ch["tasks"]
    cols = [*tasks, "general", "mixed_turn1", "mixed_turn2"]
    ok = [r for r in ch["grid"] if r["general"] >= 95]
    out = [
        f"**Chosen on validation** (`{ch['command']}`: {ch['n_val_per_skill']} validation items per skill, "
        f"{ch['n_general_val']} general validation prompts, two-skill validation items whose second turn follows the "
        "first question and its reference answer; calibration text without labels). % of each set sent where it "
        "belongs (own adapter; base model for general prompts); the best setting of each prototype variant, "
        "calibration text and rule among those keeping >= 95% of general prompts on the base model:",
        "",
        "| prototypes | calibration | rule | setting | " + " | ".join(cols) + " | skills mean |",
        "|---|---|---|---|" + "---|" * (len(cols) + 1),
    ]
    for v, cal, rule in sorted({(r["variant"], r["calibration"], r["rule"]) for r in ok}):
        best = max(
            (r for r in ok if (r["variant"], r["calibration"], r["rule"]) == (v, cal, rule)),
            key=lambda r: (r["skills_mean"], r["mixed_turn2"]),
        )
        out.append(
            f"| {v} | {cal} | {rule} | {_setting(best)} | "
            + " | ".join(f"{best[c]:.1f}" for c in cols)
            + f" | {best['skills_mean']:.1f} |"
        )
    c = ch["chosen"]
    out += ["", f"Chosen (served by `--router arrow`): {c['variant']} prototypes, {_setting(c)}.", ""]
    same = [
        r
        for r in ch["oracle_bounds"]
        if (r["block"], r["calibration"], r["score"]) == (c["block"], c["calibration"], c["score"])
    ]
    top = [
        max((r for r in ch["oracle_bounds"] if r["variant"] == v), key=lambda r: r["skills_mean"])
        for v in sorted({r["variant"] for r in ch["oracle_bounds"]})
    ]
    out += [
        "**What Arrow's scores allow at best**: per-adapter thresholds fitted *with the validation labels* (at most "
        f"{ch['general_budget']} general prompts sent to an adapter), the ceiling of every rule that thresholds a "
        "score per adapter; the chosen score, then the best block, calibration and score of each variant:",
        "",
        "| prototypes | block | calibration | score | " + " | ".join(tasks) + " | skills mean |",
        "|---|---|---|---|" + "---|" * (len(tasks) + 1),
    ]
    out += [
        f"| {r['variant']} | {r['block']} | {r['calibration']} | {r['score']} | "
        + " | ".join(f"{r[t]:.1f}" for t in tasks)
        + f" | {r['skills_mean']:.1f} |"
        for r in same + top
    ]
    return out + [""]


def render_section(rec: dict) -> list[str]:
    """docs/results.md's prompt-level Arrow section (markdown lines) from docs/arrow_prompt.json and the choice
    record beside it (docs/arrow_variants_choice.json)."""
    choice_path = Path("docs") / "arrow_variants_choice.json"
    ch = json.loads(choice_path.read_text()) if choice_path.is_file() else None
    c = rec["config"]
    window = "the whole prompt" if c.get("prompt_window") is None else f"its last {c['prompt_window']} tokens"
    out = [
        "## Arrow with prompt-level evidence and a calibrated base option (no training data)",
        "",
        f"`{rec['command']}` on {rec['date']} (bundle fingerprint {rec['fingerprint']}). A probe pass on the base "
        f"model scores each prompt token against each adapter's prototype at one block, divided by that adapter's "
        "RMS score over general text run on the base model (train-split general prompts in the chat template, no "
        "labels); a token whose best ratio is below the threshold votes for no adapter; the prompt goes to the "
        "adapter most of its voting tokens chose, or stays wholly on the base model when fewer than `prompt_share` "
        f"of them voted; the vote counts {window}; the answer carries the prompt's adapter "
        f"(`molora/routing/arrow.py`). Settings: block {c['source_block']} (from the end), rms_threshold "
        f"{c['rms_threshold']}, prompt_share {c['prompt_share']}, prompt_window {c.get('prompt_window')}.",
        "",
    ]
    if ch:
        out += render_choice(ch)
    tasks = list(rec["skills"])
    modes = list(next(iter(rec["skills"].values())))
    out += [
        f"**Test items** (the first {rec['n']} per skill of the test split; strict accuracy %, scored once):",
        "",
        "| skill | " + " | ".join(modes) + " |",
        "|---|" + "---|" * len(modes),
    ]
    out += [f"| {t} | " + " | ".join(f"{rec['skills'][t][m]['accuracy']:.1f}" for m in modes) + " |" for t in tasks]
    out += [
        "",
        f"**General prompts** ({rec['n_general']} test prompts): % answered exactly as the base model; % empty "
        "where the base answers; % of answer tokens on an adapter:",
        "",
        "| routing | retention % | empty % | adapter tokens % |",
        "|---|---|---|---|",
    ]
    out += [
        f"| {m} | {g['retention']:.1f} | {g['empty_where_base_answers']:.1f} | {g['adapter_token_share']:.1f} |"
        for m, g in rec["general"].items()
    ]
    if rec.get("mixed"):
        m = rec["mixed"]
        out += [
            "",
            f"**Two-skill items** ({rec['n_mixed']} test items, two questions of different skills answered turn by "
            "turn in one sequence; part accuracy %, and % of items with both parts right). `sequence`: one adapter "
            "per request (the learned router's vote over the questions), what a per-request server can do:",
            "",
            "| routing | part accuracy % | both right % |",
            "|---|---|---|",
        ]
        out += [f"| {k} | {v['accuracy']:.1f} | {v['item_accuracy']:.1f} |" for k, v in m.items()]
        if "arrow_prompt" in m and "sequence" in m:
            gap = m["arrow_prompt"]["accuracy"] - m["sequence"]["accuracy"]
            out += [
                "",
                f"Goal (prompt-level Arrow >= one adapter per request + 10 points): {gap:+.1f} points, "
                f"{'met' if gap >= 10 else 'not met'}.",
            ]
    return out + [""]


if __name__ == "__main__":
    raise SystemExit(main())
