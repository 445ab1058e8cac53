"""Score prompt-level Arrow (settings chosen on validation by scripts/arrow_prompt_choose.py) once on the test
items that docs/arrow.json scored the learned router and per-token Arrow on (the first --n test items per skill
of `molora.eval.heldout`, the first --n-general general test prompts), with the same evaluation code, and write
docs/arrow_prompt.json beside them.

    .venv/bin/python scripts/arrow_prompt_eval.py --choice docs/arrow_prompt_choice.json --json docs/arrow_prompt.json

Runs are cached under --work (an interrupted run resumes).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).parent))
from make_results import cached  # noqa: E402  (the one cache of evaluation runs)


def main(argv: list[str] | None = None) -> int:
    import torch

    from molora.bench.common import machine_info
    from molora.bundle import load
    from molora.data.general import general_split
    from molora.data.jsonl import write_jsonl
    from molora.data.skills import write_bbh_file
    from molora.eval.general import evaluate_general
    from molora.eval.heldout import fingerprint, held_out, training_inputs
    from molora.eval.runner import evaluate
    from molora.routing.arrow import ArrowConfig, ArrowRouter

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--choice", required=True, help="the record of scripts/arrow_prompt_choose.py")
    ap.add_argument("--json", required=True)
    ap.add_argument("--n", type=int, default=24)
    ap.add_argument("--n-general", type=int, default=40)
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--work", default="runs/arrow_prompt_work")
    a = ap.parse_args(argv)
    torch.set_num_threads(a.threads)
    work = Path(a.work)
    (work / "data").mkdir(parents=True, exist_ok=True)
    chosen = json.loads(Path(a.choice).read_text())["chosen"]
    mm = load(None)
    bundle, names = mm.bundle, mm.adapter_names
    L = json.loads(Path(a.choice).read_text())["num_blocks"]
    cfg = ArrowConfig(
        granularity="per_block",
        prompt=True,
        rms_threshold=chosen["rms_threshold"],
        prompt_share=chosen["prompt_share"],
        source_block=chosen["block"] - L,
    )
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
    skills = {}
    for t in tasks:
        items, _ = held_out(t, max(a.n, 100), banned, split="test")
        path = work / "data" / f"test_{t}.json"
        write_bbh_file(path, items[: a.n])
        skills[t] = {}
        for m, r in (("arrow_prompt", router), ("learned", learned)):
            s = run(
                work / f"test__{t}__{m}.json",
                r,
                lambda spec=f"bbh:{path}": evaluate(mm, spec, "learned", batch_size=a.batch_size, progress=False),
            )
            skills[t][m] = {k: s[k] for k in ("n", "accuracy", "seconds", "generated_tokens")}
    rows = general_split()["test"][: a.n_general]
    write_jsonl(
        work / "data" / "general_test.jsonl",
        [{"id": r["id"], "source": r["source"], "prompt": r["prompt"]} for r in rows],
    )
    general = {}
    for m, r in (("arrow_prompt", router), ("learned", learned)):
        g = run(
            work / f"general__{m}.json",
            r,
            lambda: evaluate_general(
                mm, f"general:{work / 'data' / 'general_test.jsonl'}", "learned", batch_size=a.batch_size
            ),
        )
        general[m] = {k: g[k] for k in ("n", "retention", "empty_where_base_answers", "adapter_token_share")}
    rec = {
        "command": "python scripts/arrow_prompt_eval.py --choice "
        + a.choice
        + " --json "
        + a.json
        + f" --n {a.n} --n-general {a.n_general} --threads {a.threads}",
        "date": time.strftime("%Y-%m-%d"),
        "machine": machine_info(),
        "fingerprint": fingerprint(bundle),
        "config": {
            k: getattr(cfg, k)
            for k in ("granularity", "prompt", "rms_threshold", "prompt_share", "source_block", "calibration_prompts")
        },
        "skills": skills,
        "general": general,
        "n": a.n,
        "n_general": len(rows),
    }
    Path(a.json).write_text(json.dumps(rec, indent=1) + "\n")
    print(
        json.dumps(
            {"skills": {t: {m: v["accuracy"] for m, v in d.items()} for t, d in skills.items()}, "general": general}
        )
    )
    return 0


def render_section(rec: dict) -> list[str]:
    """docs/results.md's prompt-level Arrow section (markdown lines) from docs/arrow_prompt.json and the choice
    record beside it (docs/arrow_prompt_choice.json)."""
    choice_path = Path("docs") / "arrow_prompt_choice.json"
    ch = json.loads(choice_path.read_text()) if choice_path.is_file() else None
    c = rec["config"]
    out = [
        "## Arrow with prompt-level evidence and a calibrated base option (no training data)",
        "",
        f"`{rec['command']}` on {rec['date']} (bundle fingerprint {rec['fingerprint']}). A probe pass on the base "
        f"model scores each prompt token against each adapter's prototype at one block, divided by that adapter's "
        "RMS score over general text run on the base model (train-split general prompts in the chat template, no "
        "labels); a token whose best ratio is below the threshold votes for no adapter; the prompt goes to the "
        "adapter most of its tokens voted for, or stays wholly on the base model when fewer than `prompt_share` "
        "of its tokens voted; the answer carries the prompt's adapter (`molora/routing/arrow.py`). Settings: "
        f"block {c['source_block']} (from the end), rms_threshold {c['rms_threshold']}, prompt_share "
        f"{c['prompt_share']}.",
        "",
    ]
    if ch:
        out += [
            f"**Chosen on validation** (`{ch['command']}`: {ch['n_val_per_skill']} validation items per skill, "
            f"{ch['n_general_val']} general validation prompts; calibration on {ch['calibration_tokens']} tokens): "
            "among settings that keep >= 95% of general prompts on the base model, the highest mean share of "
            "skill prompts sent to their own adapter. Chosen: "
            + ", ".join(f"{k} {v}" for k, v in ch["chosen"].items())
            + ".",
            "",
        ]
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
    return out + [""]


if __name__ == "__main__":
    raise SystemExit(main())
