"""Choose prompt-level Arrow's settings on validation prompts only, GenKnowSub and the decision rules included.

    .venv/bin/python -m experiments.arrow_variants_choose --json docs/arrow_variants_choice.json \
        [--n-val 40] [--n-mixed 40] [--n-calib-gsm8k 96]

Each prompt is scored by where its answer would run: its skill's adapter (a mixed item's turn: its question's
adapter), or the base model for a general prompt. One base-model forward per prompt keeps the deciding projection's
normed input at blocks 15, 20, 25 and 29 (--features caches them, ignored by git), so every setting is scored
from the same states. Validation sets: `molora.eval.heldout` split "val" (skills and two-skill items, never the
test split) and `molora.data.general` split "val". No labels anywhere else:

- variant: prototypes of the adapters' own deltas ("arrow") or GenKnowSub ("gks_mean": each delta minus the mean
  delta of the adapters, molora.routing.arrow_protos.general_subtracted; molora has no general adapter);
- calibration: the general text whose RMS normalises each adapter's |cos| (ratio[t, k] = |cos(x_t, v_k)| / RMS_k):
  "self_instruct" (the router's: the first 96 general train prompts) or "mixed" (plus --n-calib-gsm8k GSM8K train
  problems, the split's other source);
- score over the prompt's last `window` tokens (None: all): "energy" mean_t ratio^2, or "share@thr" the share of
  tokens whose best ratio >= thr (ArrowConfig.rms_threshold) and is adapter k's;
- rule: "global" (the prompt goes to the top adapter if its score, for shares the claimed share summed over
  adapters as ArrowConfig.prompt_share, reaches `value`) or "calibrated" (each adapter's limit is the `value`
  quantile of its score over the calibration prompts: per-adapter and data-free).

Choice: among settings that keep >= 95% of general validation prompts on the base model, the highest mean share
of skill prompts sent to their own adapter (ties: mixed items' second turn, plain prototypes, the router's
calibration, the whole prompt). `oracle_bounds` (per variant, block, calibration and score): the most skill prompts
any per-adapter thresholds could send home at the same 95%, thresholds fitted with the validation labels -- what
the scores allow at best, not a setting anyone could choose without labels. The record's `grid` keeps the best
value of each group of settings (all but the rule's value), `settings_searched` counts every setting scored.
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

VOTE_THRESHOLDS = (1.5, 1.75, 2.0, 2.25, 2.5)
SHARES = (0.0, 0.05, 0.1, 0.15, 0.2, 0.25, 0.3)
MEAN_THRESHOLDS = (1.0, 1.25, 1.5, 1.75, 2.0, 2.5, 3.0, 4.0, 5.0, 6.0, 8.0)
QUANTILES = (0.8, 0.9, 0.95, 0.99, 1.0)
WINDOWS = (None, 32, 64)
VARIANTS = ("arrow", "gks_mean")


def features(a: argparse.Namespace) -> dict:
    """Labels, token ids and the normed deciding inputs [T, D] per prompt and block, and the prototypes."""
    from molora.bundle import load
    from molora.data.general import calibration_rows, general_split
    from molora.eval.heldout import held_out, held_out_mixed, training_inputs
    from molora.eval.runner import _ids, template_of, turn_text
    from molora.routing.arrow import ArrowConfig, ArrowRouter
    from molora.routing.arrow_protos import general_subtracted, top_right_singular_vector

    mm = load(None)
    bundle, names = mm.bundle, mm.adapter_names
    banned = training_inputs(bundle)
    tasks = [ad.tasks[0] for ad in bundle.adapters if ad.tasks]
    own = {t: names.index(bundle.adapter_for_task(t)) for t in tasks}
    template, end = template_of(mm)
    prompts: list[tuple[str, list[int]]] = [("calib", r) for r in calibration_rows(mm, 96)]
    # the router's calibration text is the first 96 general train prompts (all Self-Instruct); the general train
    # split's other source (GSM8K word problems) as a second calibration set, still unlabelled general text
    gsm = [r["prompt"] for r in general_split()["train"] if r["source"] == "gsm8k"][: a.n_calib_gsm8k]
    prompts += [("calib_gsm8k", _ids(mm.tokenizer, turn_text(template, p))) for p in gsm]
    for t in tasks:
        items, _ = held_out(t, a.n_val, banned, split="val")
        prompts += [(t, _ids(mm.tokenizer, turn_text(template, it.input))) for it in items]
    prompts += [("general", _ids(mm.tokenizer, turn_text(template, r["prompt"]))) for r in general_split()["val"]]
    # two-skill items answered turn by turn (molora.eval.runner): turn 1 is a prompt of its own; turn 2 follows the
    # first question and its reference answer, as the evaluation renders the model's own answer
    for row in held_out_mixed(tasks, a.n_mixed, banned, split="val"):
        (p1, p2) = row["parts"][:2]
        first = _ids(mm.tokenizer, turn_text(template, p1["input"], p1["target"], end, last=False))
        prompts.append(("mixed1:" + p1["task"], _ids(mm.tokenizer, turn_text(template, p1["input"]))))
        prompts.append(("mixed2:" + p2["task"], first + _ids(mm.tokenizer, turn_text(template, p2["input"]))))
    router = ArrowRouter(ArrowConfig(granularity="per_block"), names).bind(mm)
    L = len(router._block_linear)
    blocks = sorted({L // 2, (2 * L) // 3, (5 * L) // 6, L - 1})
    modules = {b: router._block_linear[b] for b in blocks}
    per_module = {
        m: [(w.A, w.B, w.scale) if (w := mm.adapters[n].modules.get(m)) is not None else None for n in names]
        for m in modules.values()
    }
    protos = {
        "arrow": {
            m: torch.stack([top_right_singular_vector(A, B) for A, B, _ in per]) for m, per in per_module.items()
        },
        "gks_mean": {m: torch.stack(v) for m, v in general_subtracted(per_module).items()},
    }
    states = []
    with torch.no_grad():
        for _, ids in prompts:
            x = torch.tensor([ids])
            out = mm(
                x, adapter_ids=torch.full_like(x, -1), output_hidden_states=True, use_cache=False, logits_to_keep=1
            )
            states.append({b: router._block_norm[b](out.hidden_states[b][0]).float() for b in blocks})
    return {
        "labels": [p[0] for p in prompts],
        "states": states,
        "protos": protos,
        "modules": modules,
        "blocks": blocks,
        "num_blocks": L,
        "tasks": tasks,
        "own": own,
        "names": names,
    }


CALIBRATIONS = {"self_instruct": ("calib",), "mixed": ("calib", "calib_gsm8k")}


def ratios(f: dict, variant: str, b: int, calibration: str) -> list[torch.Tensor]:
    """Per prompt [T, K]: |cos(x, v_k)| over adapter k's RMS |cos| on the calibration prompts' tokens."""
    P = f["protos"][variant][f["modules"][b]]  # [K, D]
    unit = [s[b] / s[b].norm(dim=-1, keepdim=True).clamp_min(1e-12) for s in f["states"]]
    calib = torch.cat([u for u, lab in zip(unit, f["labels"]) if lab in CALIBRATIONS[calibration]])  # [N, D]
    rms = (calib @ P.T).pow(2).mean(0).sqrt()  # [K]
    return [(u @ P.T).abs() / rms for u in unit]


def scores(r: list[torch.Tensor], score: str, window: int | None) -> torch.Tensor:
    """[P, K] prompt-level scores over each prompt's last `window` tokens (None: all): "energy" mean_t ratio^2;
    "share@thr" the share of tokens whose best ratio >= thr and is adapter k's (ArrowConfig.prompt_share's vote)."""
    K = r[0].shape[1]
    r = [x if window is None else x[-window:] for x in r]
    if score == "energy":
        return torch.stack([x.pow(2).mean(0) for x in r])
    thr = float(score.split("@")[1])
    out = []
    for x in r:
        best, ids = x.max(-1)
        out.append(torch.bincount(ids[best >= thr], minlength=K).float() / x.shape[0])
    return torch.stack(out)


def destinations(S: torch.Tensor, rule: str, limit: torch.Tensor, total: bool) -> list[int]:
    """Each prompt's answer: the adapter of the highest score (the lowest index on a tie), or the base model (-1)
    when no adapter scores or, rule "global", the prompt's score (total: summed over adapters, as the claimed
    share of ArrowConfig.prompt_share) is below the limit; rule "calibrated", the top score is not above its
    adapter's limit [K] (a quantile of that adapter's score over the calibration prompts)."""
    top, k = S.max(1)
    if rule == "global":
        ok = ((S.sum(1) if total else top) >= limit[k]) & (top > 0)
    else:
        ok = top > limit[k]
    return torch.where(ok, k, -1).tolist()


def hit_rates(labels: list[str], dest: list[int], tasks: list[str], own: dict) -> dict:
    """% of each group's prompts sent where they belong: a skill's (or a mixed turn's question's) own adapter, the
    base model for a general prompt; skills_mean over the single-skill groups."""
    hits: dict[str, list[bool]] = {t: [] for t in [*tasks, "general", "mixed_turn1", "mixed_turn2"]}
    for lab, d in zip(labels, dest):
        if lab.startswith("mixed"):
            turn, task = lab.split(":")
            hits[f"mixed_turn{turn[-1]}"].append(d == own[task])
        elif lab in hits:
            hits[lab].append(d == (-1 if lab == "general" else own[lab]))
    row = {t: round(100 * statistics.mean(v), 2) for t, v in hits.items() if v}
    row["skills_mean"] = round(statistics.mean(row[t] for t in tasks), 2)
    return row


def oracle_bound(labels: list[str], S: torch.Tensor, tasks: list[str], own: dict, budget: int) -> dict:
    """The most skill prompts any per-adapter thresholds on score S could send to their own adapter while
    sending at most `budget` general validation prompts to an adapter: thresholds fitted with the labels, an
    upper bound for every rule that thresholds S per adapter (not a setting anyone could choose data-free)."""
    top, kstar = S.max(1)
    general = torch.tensor([lab == "general" for lab in labels])
    ths = torch.cat([top.unique(), torch.tensor([float("inf")])])  # [n] candidate thresholds
    above = top[None, :] >= ths[:, None]  # [n, P]
    per: list[dict[int, int]] = []  # per adapter: general prompts taken -> most own skill prompts kept
    for t in tasks:
        mine = kstar == own[t]
        e = (above & mine & general).sum(1)  # [n] general prompts it would take
        h = (above & mine & torch.tensor([lab == t for lab in labels])).sum(1)  # [n] own prompts it keeps
        best: dict[int, int] = {}
        for ei, hi in zip(e.tolist(), h.tolist()):
            if ei <= budget:
                best[ei] = max(best.get(ei, 0), hi)
        per.append(best)
    kept = max(
        (combo for combo in itertools.product(*[list(b.items()) for b in per]) if sum(e for e, _ in combo) <= budget),
        key=lambda combo: sum(h for _, h in combo),
    )
    n = {t: labels.count(t) for t in tasks}
    row = {t: round(100 * h / n[t], 2) for t, (_, h) in zip(tasks, kept)}
    row["skills_mean"] = round(statistics.mean(row[t] for t in tasks), 2)
    return row


def served_config(rec: dict) -> dict:
    """ArrowConfig fields of a choice record's chosen setting (what `--router arrow` serves); refused for a choice
    the router cannot serve (GenKnowSub prototypes, the mixed calibration text, per-adapter limits, the energy
    score: none of them won on validation, so the router does not carry them)."""
    c = rec["chosen"]
    servable = (c["variant"], c["calibration"], c["rule"], c["score"].split("@")[0])
    if servable != ("arrow", "self_instruct", "global", "share"):
        raise SystemExit(f"the chosen setting {servable} is not one ArrowRouter serves; add it to the router first")
    return {
        "granularity": "per_block",
        "prompt": True,
        "rms_threshold": float(c["score"].split("@")[1]),
        "prompt_share": c["value"],
        "prompt_window": c["window"],
        "source_block": c["block"] - rec["num_blocks"],
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--n-val", type=int, default=40, help="validation items per skill (default 40)")
    ap.add_argument("--n-calib-gsm8k", type=int, default=96, help="GSM8K train prompts in the 'mixed' calibration")
    ap.add_argument("--n-mixed", type=int, default=40, help="two-skill validation items (default 40)")
    ap.add_argument("--json", required=True)
    ap.add_argument("--features", default="runs/arrow_variants_features.pt", help="cache of the forwards")
    a = ap.parse_args(argv)
    t0 = time.time()
    cache = Path(a.features)
    if cache.is_file():
        f = torch.load(cache)
    else:
        f = features(a)
        cache.parent.mkdir(parents=True, exist_ok=True)
        torch.save(f, cache)
    labels, tasks, own = f["labels"], f["tasks"], f["own"]
    budget = int(0.05 * labels.count("general"))  # general prompts an adapter may take at 95% retention
    grid, bounds = [], []
    for variant, b, calibration in itertools.product(VARIANTS, f["blocks"], CALIBRATIONS):
        r = ratios(f, variant, b, calibration)
        calib = [i for i, lab in enumerate(labels) if lab in CALIBRATIONS[calibration]]
        for score, window in itertools.product(["energy", *(f"share@{t}" for t in VOTE_THRESHOLDS)], WINDOWS):
            S = scores(r, score, window)
            key = {"variant": variant, "block": b, "calibration": calibration, "score": score, "window": window}
            if window is None:
                bounds.append({**key, **oracle_bound(labels, S, tasks, own, budget)})
            K = S.shape[1]
            limits = [
                ("global", v, torch.full((K,), float(v))) for v in (SHARES if score != "energy" else MEAN_THRESHOLDS)
            ]
            limits += [("calibrated", q, S[calib].quantile(q, dim=0)) for q in QUANTILES]
            for rule, value, limit in limits:
                row = {**key, "rule": rule, "value": value}
                row.update(hit_rates(labels, destinations(S, rule, limit, score != "energy"), tasks, own))
                grid.append(row)
    # the record keeps, per group (all but the rule's value), the best value at >= 95% general retention (the
    # value keeping the most general prompts home where none reaches it): the frontier the choice is made on
    group = ("variant", "block", "calibration", "score", "window", "rule")
    frontier: dict[tuple, dict] = {}
    for r in grid:
        k = tuple(r[g] for g in group)
        rank = (r["general"] >= 95, r["skills_mean"] if r["general"] >= 95 else r["general"], r["mixed_turn2"])
        if k not in frontier or rank > frontier[k][0]:
            frontier[k] = (rank, r)
    searched = len(grid)
    grid = [r for _, r in frontier.values()]
    ok = [r for r in grid if r["general"] >= 95] or grid
    best = max(
        ok,
        key=lambda r: (
            r["skills_mean"],
            r.get("mixed_turn2", 0.0),
            r["variant"] == "arrow",
            r["calibration"] == "self_instruct",
            r["window"] is None,
        ),
    )
    best_of = {
        v: max((r for r in ok if r["variant"] == v), key=lambda r: r["skills_mean"], default=None) for v in VARIANTS
    }
    rec = {
        "command": f"python -m experiments.arrow_variants_choose --json {a.json} --n-val {a.n_val} "
        f"--n-mixed {a.n_mixed} "
        f"--n-calib-gsm8k {a.n_calib_gsm8k}",
        "date": time.strftime("%Y-%m-%d"),
        "machine": machine_info(),
        "tasks": tasks,
        "n_val_per_skill": a.n_val,
        "n_general_val": labels.count("general"),
        "n_calibration_prompts": {c: sum(labels.count(x) for x in v) for c, v in CALIBRATIONS.items()},
        "blocks": f["blocks"],
        "num_blocks": f["num_blocks"],
        "general_budget": budget,
        "settings_searched": searched,
        "oracle_bounds": bounds,
        "grid": grid,
        "best_per_variant": best_of,
        "chosen": best,
        "seconds": round(time.time() - t0, 1),
    }
    Path(a.json).write_text(json.dumps(rec, indent=1) + "\n")
    print(json.dumps({"chosen": best, "best_per_variant": best_of}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
