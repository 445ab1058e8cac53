"""Choose the hybrid data-free chooser's settings (molora.routing.hybrid: prompt-level Arrow decides whether a prompt
leaves the base model, the confidence chooser's largest z which adapter) on the validation prompts of
experiments/arrow_variants_choose.py, scored with its `hit_rates`.

    .venv/bin/python -m experiments.datafree_hybrid --json docs/datafree_hybrid_choice.json \
        [--confidence docs/datafree_confidence] [--out runs/datafree_hybrid]

Inputs, none labelled: arrow_variants_choose's --features cache (the base model's normed states at the deciding
blocks, per validation prompt, and the adapters' prototypes; its calibration prompts give each adapter's RMS), the
confidence chooser's pool calibration (docs/datafree_confidence/confidence.json: per adapter mean and spread of
log(1 / entropy) over the base model's own pool), and each adapter's first-answer-token entropy on every validation
prompt (--val-entropy caches them). Every prompt is decided on its own, a two-skill item's second turn with the
first in view (as arrow_variants_choose scores them), so the mixed columns are a per-turn choice.

Grid: Arrow's servable prompt vote (plain prototypes, the router's calibration text) at each block, vote threshold
(rms_threshold), window and prompt_share; z_or (the confidence alone also claims a prompt at this top z; None:
never) and z_floor (the top z must also reach this; None: no floor). Choice: the highest skills mean among settings
keeping >= 95% of general validation prompts on the base model (ties: mixed second turns, general kept home, the
settings of prompt-Arrow's own choice, no z_or, no z_floor). Every setting is scored; the record keeps each
(block, threshold, window) group's best, the 20 best overall and the count.
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
import time
from pathlib import Path

import torch

from experiments.arrow_variants_choose import SHARES, VOTE_THRESHOLDS, WINDOWS, hit_rates, ratios, scores
from experiments.features import features_cache
from experiments.features import scored as scored_prompts
from experiments.gates_choose import rebuild_ids

Z_OR = (None, 3.0, 3.5, 4.0, 5.0)
Z_FLOOR = (None, 0.0, 1.0, 2.0)


def rank(r: dict, arrow_chosen: dict) -> tuple:
    same = all(r[k] == arrow_chosen[k] for k in ("block", "threshold", "window", "prompt_share"))
    return (r["skills_mean"], r["mixed_turn2"], r["general"], same, r["z_or"] is None, r["z_floor"] is None)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--json", required=True)
    ap.add_argument("--features", default="runs/arrow_variants_features.pt")
    ap.add_argument("--confidence", default="docs/datafree_confidence", help="the confidence chooser's folder")
    ap.add_argument("--val-entropy", default="runs/datafree_val_entropy5.pt", help="cache: adapters' and base's")
    ap.add_argument("--arrow-choice", default="docs/arrow_variants_choice.json")
    ap.add_argument("--out", help="save the chosen hybrid chooser here")
    ap.add_argument("--threads", type=int, default=1)
    a = ap.parse_args(argv)
    torch.set_num_threads(a.threads)
    t0 = time.time()
    from molora.bench.common import machine_info
    from molora.routing.confidence import ConfidenceChooser, first_token_entropy
    from molora.routing.hybrid import hybrid_decide

    feats = features_cache(a.features)
    f, labels, tasks, own, names = feats.raw, feats.labels, feats.tasks, feats.own, feats.names
    chooser = ConfidenceChooser.load(a.confidence)
    assert list(chooser.adapter_names) == list(names), (chooser.adapter_names, names)
    scored = scored_prompts(labels)
    K = len(names)
    if Path(a.val_entropy).is_file():
        ent = torch.load(a.val_entropy)
    else:
        from molora.bundle import load

        mm = load(None)
        ids = rebuild_ids(mm, f, tasks)
        t1 = time.time()
        ent = first_token_entropy(mm, [ids[i] for i in scored], adapters=[*range(K), -1])
        print(f"validation entropies: {len(scored)} prompts, {time.time() - t1:.0f} s", file=sys.stderr)
        Path(a.val_entropy).parent.mkdir(parents=True, exist_ok=True)
        torch.save(ent, a.val_entropy)
    if tuple(ent.shape) != (len(scored), K + 1):
        raise SystemExit(f"{a.val_entropy} holds {tuple(ent.shape)} entropies, want ({len(scored)}, {K + 1})")
    lab = [labels[i] for i in scored]
    z = chooser.zscores(ent[:, :K])
    arrow_rec = json.loads(Path(a.arrow_choice).read_text())
    ac = arrow_rec["chosen"]
    arrow_chosen = {
        "block": ac["block"],
        "threshold": float(ac["score"].split("@")[1]),
        "window": ac["window"],
        "prompt_share": ac["value"],
    }
    grid = []
    for b in f["blocks"]:
        r = ratios(f, "arrow", b, "self_instruct")
        for thr, window in itertools.product(VOTE_THRESHOLDS, WINDOWS):
            share = scores(r, f"share@{thr}", window).sum(1)[scored]
            for ps, z_or, z_floor in itertools.product(SHARES, Z_OR, Z_FLOOR):
                dest = hybrid_decide(share, z, ps, z_or, z_floor)
                row = {"block": b, "threshold": thr, "window": window, "prompt_share": ps, "z_or": z_or}
                grid.append({**row, "z_floor": z_floor, **hit_rates(lab, dest, tasks, own)})
    ok = [r for r in grid if r["general"] >= 95] or grid
    best = max(ok, key=lambda r: rank(r, arrow_chosen))
    group = ("block", "threshold", "window")
    frontier: dict[tuple, dict] = {}
    for r in ok:
        k = tuple(r[g] for g in group)
        if k not in frontier or rank(r, arrow_chosen) > rank(frontier[k], arrow_chosen):
            frontier[k] = r
    at_arrow = [r for r in grid if all(r[k] == v for k, v in arrow_chosen.items())]
    conf_rec = json.loads(Path("docs/datafree_confidence_choice.json").read_text())
    cols = (*tasks, "general", "mixed_turn1", "mixed_turn2", "skills_mean")
    rec = {
        "command": f"python -m experiments.datafree_hybrid --json {a.json} --confidence {a.confidence}",
        "features_command": arrow_rec["command"],
        "date": time.strftime("%Y-%m-%d"),
        "machine": machine_info(),
        "tasks": tasks,
        "n_val_per_skill": labels.count(tasks[0]),
        "n_general_val": labels.count("general"),
        "confidence": a.confidence,
        "arrow_chosen_setting": arrow_chosen,
        "grid_axes": {
            "block": f["blocks"],
            "threshold": list(VOTE_THRESHOLDS),
            "window": list(WINDOWS),
            "prompt_share": list(SHARES),
            "z_or": list(Z_OR),
            "z_floor": list(Z_FLOOR),
        },
        "settings_searched": len(grid),
        "chosen": best,
        "at_arrow_chosen_setting": max(
            [r for r in at_arrow if r["general"] >= 95] or at_arrow, key=lambda r: rank(r, arrow_chosen)
        ),
        "at_arrow_chosen_setting_plain": next(r for r in at_arrow if r["z_or"] is None and r["z_floor"] is None),
        "frontier": sorted(frontier.values(), key=lambda r: rank(r, arrow_chosen), reverse=True),
        "top20": sorted(ok, key=lambda r: rank(r, arrow_chosen), reverse=True)[:20],
        "confidence_chosen": {k: conf_rec["chosen"][k] for k in cols},
        "confidence_argmax_never_base": conf_rec["argmax_never_base"],
        "arrow_prompt_chosen": {k: ac[k] for k in cols},
        "learned": conf_rec["learned"],
        "beats_confidence_chosen": best["skills_mean"] > conf_rec["chosen"]["skills_mean"] and best["general"] >= 95,
        "test_policy": "scored on test (experiments/gates_eval.py --hybrid) only if it beats the confidence chooser's "
        "validation skills mean at >= 95% general; that test is the second data-free method scored on test "
        "(the first: the confidence chooser, docs/datafree_prompt.json)",
        "seconds": round(time.time() - t0, 1),
    }
    Path(a.json).write_text(json.dumps(rec, indent=1) + "\n")
    print(
        json.dumps(
            {"chosen": best, "beats": rec["beats_confidence_chosen"], "plain": rec["at_arrow_chosen_setting_plain"]}
        )
    )
    if a.out:
        from molora.routing.arrow import ArrowConfig
        from molora.routing.hybrid import HybridChooser

        arrow = ArrowConfig(
            granularity="per_block",
            prompt=True,
            rms_threshold=best["threshold"],
            prompt_share=best["prompt_share"],
            prompt_window=best["window"],
            source_block=best["block"] - f["num_blocks"],
        )
        HybridChooser(chooser, arrow, best["z_or"], best["z_floor"]).save(a.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
