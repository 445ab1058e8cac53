"""Choose prompt-level Arrow's settings on validation prompts only: which block decides, the calibrated base
threshold and the prompt share, by where each prompt would be sent (its skill's adapter, or the base model for a
general prompt). One base-model forward per prompt gives every block's hidden state, so the whole grid costs
what one pass over the prompts costs. Writes the grid and the choice to a JSON record.

    .venv/bin/python scripts/arrow_prompt_choose.py --json docs/arrow_prompt_choice.json [--n-val 40]

Validation sets: `molora.eval.heldout` split "val" (skills; never the test split) and `molora.data.general`
split "val" (60 general prompts). Calibration text: the general *train* split (ArrowRouter.calibrate). The
choice: among settings that keep >= 95% of general validation prompts on the base model, the highest mean share
of skill prompts sent to their own adapter (ties: the higher threshold, then the later block).
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import time
from pathlib import Path

import torch

from molora.bench.common import machine_info
from molora.routing.base import fill_prompt_routes

THRESHOLDS = (1.0, 1.25, 1.5, 1.75, 2.0, 2.5, 3.0)
SHARES = (0.0, 0.05, 0.1, 0.2, 0.3)


def main(argv: list[str] | None = None) -> int:
    from molora.bundle import load
    from molora.data.general import general_split
    from molora.eval.heldout import held_out, training_inputs
    from molora.eval.runner import _ids, template_of, turn_text
    from molora.routing.arrow import ArrowConfig, ArrowRouter, calibration_rows

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--n-val", type=int, default=40, help="validation items per skill (default 40)")
    ap.add_argument("--json", required=True)
    ap.add_argument("--save", help="also keep the per-prompt ratios (torch.save) for other decision rules")
    a = ap.parse_args(argv)
    t0 = time.time()
    mm = load(None)
    bundle = mm.bundle
    names = mm.adapter_names
    banned = training_inputs(bundle)
    tasks = [ad.tasks[0] for ad in bundle.adapters if ad.tasks]
    own = {t: names.index(bundle.adapter_for_task(t)) for t in tasks}
    template, _ = template_of(mm)
    prompts: list[tuple[str, list[int]]] = []
    for t in tasks:
        items, _ = held_out(t, a.n_val, banned, split="val")
        prompts += [(t, _ids(mm.tokenizer, turn_text(template, it.input))) for it in items]
    prompts += [("general", _ids(mm.tokenizer, turn_text(template, r["prompt"]))) for r in general_split()["val"]]
    # calibrated at every block (prompt=False), so that the grid can try several source blocks
    router = ArrowRouter(ArrowConfig(granularity="per_block", rms_threshold=1.0), names).bind(mm)
    L = len(router._block_linear)
    blocks = sorted({L // 3, L // 2, (2 * L) // 3, (5 * L) // 6, L - 1})
    # the calibration prompts themselves (general train split, unlabelled): each adapter's prompt-level vote
    # share on ordinary text, the data-free reference for a per-adapter base threshold (rule "calibrated")
    calib = [("calib", r) for r in calibration_rows(mm, router.config.calibration_prompts)]
    prompts = calib + prompts
    # ratio [T, K] per prompt and block: |cos(x, v)| / its general-text RMS
    ratios: list[dict[int, torch.Tensor]] = []
    with torch.no_grad():
        for _, ids in prompts:
            x = torch.tensor([ids])
            out = mm(
                x, adapter_ids=torch.full_like(x, -1), output_hidden_states=True, use_cache=False, logits_to_keep=1
            )
            per = {}
            for b in blocks:
                module = router._block_linear[b]
                per[b] = router.general_ratio(module, router._block_norm[b](out.hidden_states[b][0]).float())
            ratios.append(per)
    if a.save:
        torch.save(
            {
                "labels": [p[0] for p in prompts],
                "ratios": ratios,
                "own": own,
                "tasks": tasks,
                "blocks": blocks,
                "num_blocks": L,
                "calibration_tokens": router._calib_tokens,
            },
            a.save,
        )
    grid = []
    for b, thr, share in itertools.product(blocks, THRESHOLDS, SHARES):
        hits: dict[str, list[bool]] = {t: [] for t in [*tasks, "general"]}
        for (label, _), per in zip(prompts, ratios):
            if label == "calib":
                continue
            best, ids = per[b].max(-1)
            probe = torch.where(best < thr, -1, ids)[None]
            routes = fill_prompt_routes(probe, None, share, last_takes_top=True)
            dest = int(routes[0, -1])  # what the answer runs on
            hits[label].append(dest == (-1 if label == "general" else own[label]))
        row = {
            "block": b,
            "rms_threshold": thr,
            "prompt_share": share,
            **{t: round(100 * sum(v) / len(v), 2) for t, v in hits.items()},
        }
        row["skills_mean"] = round(statistics.mean(row[t] for t in tasks), 2)
        grid.append(row)
    ok = [r for r in grid if r["general"] >= 95] or grid
    best = max(ok, key=lambda r: (r["skills_mean"], r["rms_threshold"], r["block"]))
    rec = {
        "command": "python scripts/arrow_prompt_choose.py --json " + a.json + f" --n-val {a.n_val}",
        "date": time.strftime("%Y-%m-%d"),
        "machine": machine_info(),
        "tasks": tasks,
        "n_val_per_skill": a.n_val,
        "n_general_val": sum(1 for p in prompts if p[0] == "general"),
        "n_calibration_prompts": len(calib),
        "blocks": blocks,
        "num_blocks": L,
        "calibration_tokens": router._calib_tokens,
        "grid": grid,
        "chosen": best,
        "seconds": round(time.time() - t0, 1),
    }
    Path(a.json).write_text(json.dumps(rec, indent=1) + "\n")
    print(json.dumps(best))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
