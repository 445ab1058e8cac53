"""Choose the composable per-adapter gates' settings (molora.routing.gates) on the validation prompts that
experiments/arrow_variants_choose.py scores prompt-level Arrow on, beside Arrow's chosen setting and the learned router.

    .venv/bin/python -m experiments.gates_choose --json docs/gates_choice.json [--n-pos 160] [--gates-out runs/gates]

Data each gate sees (and nothing else): its own adapter's training prompts (the first --n-pos of the items the
adapter was trained on, `molora.data.skills.generate(task, n, TRAIN_SEED_BASE + 10 i)` as molora.train.default
writes them, minus any that is also a validation or test item) against general prompts the base model answers
(the general train split, Self-Instruct and GSM8K, plus the recipe's everyday topic prompts): the same negatives
for every gate. Each set is shuffled by a fixed seed; 80% trains the gate, 20% sets its threshold
(molora.train.gates.fit_gate). No gate sees another adapter's prompts, the validation prompts or their labels.

Validation: the prompts, labels and base-model states of experiments/arrow_variants_choose.py's --features cache
(runs it first if missing: 40 items per skill, 60 general prompts, 40 two-skill items, both turns), so every
number here is on the same items as docs/arrow_variants_choice.json. A prompt's destination is where its answer
runs: `fill_prompt_routes`' last-token decision (the code the router serves). The learned router's destination is
its probe's filled decision at the last prompt token (where its answer's first token runs; later answer tokens may
move, as its gates decide per token).

Grid: block x l2 x threshold rule (quantile of general scores 0.9..0.995, or Youden on the held-out sets) x
prompt_share x window. Choice: as Arrow's, the highest skills mean among settings keeping >= 95% of general
validation prompts on the base model (ties: mixed second turns, general prompts kept home, then the larger share
and the shorter window). "mean" (aggregate) is a reference only: the gates' score of the window's mean state, which
the probe cannot serve (it hands the prompt vote token decisions, not scores).
"""

from __future__ import annotations

import argparse
import itertools
import json
import random
import time
from pathlib import Path

import torch

from experiments.arrow_variants_choose import hit_rates  # (the same scoring as Arrow's choice)

L2S = (1e-3, 1e-2)
RULES = [("quantile", q) for q in (0.9, 0.95, 0.98, 0.99, 0.995)] + [("youden", 0.0)]
SHARES = (0.0, 0.05, 0.1, 0.15, 0.2, 0.3, 0.4)
WINDOWS = (None, 32, 64)
AGGREGATES = ("vote", "mean")  # mean: a reference the probe cannot serve (it passes token votes, not scores)


def train_states(mm, tasks: list[str], n_pos: int, blocks: list[int]) -> dict:  # noqa: ANN001
    """Per adapter its own training prompts' states, and the general prompts' states (module docstring)."""
    from molora.data.general import general_split, topic_prompts
    from molora.data.skills import TRAIN_SEED_BASE, generate
    from molora.eval.heldout import held_out, held_out_mixed, training_inputs
    from molora.eval.runner import _ids, template_of, turn_text
    from molora.train.default import SKILL_ADAPTERS, DefaultRecipe
    from molora.train.gates import prompt_states

    template, _ = template_of(mm)
    banned = training_inputs(mm.bundle)
    heldout = {it.input for t in tasks for s in ("val", "test") for it in held_out(t, 100, banned, split=s)[0]}
    heldout |= {
        p["input"] for s in ("val", "test") for r in held_out_mixed(tasks, 100, banned, split=s) for p in r["parts"]
    }
    order = list(SKILL_ADAPTERS.values())
    pos, dropped = {}, {}
    for t in tasks:
        i = order.index(t)
        items = generate(t, n_pos + 50, seed=TRAIN_SEED_BASE + 10 * i)  # the adapter's own training items, in order
        keep = [it.input for it in items if it.input not in heldout][:n_pos]
        dropped[t] = sum(it.input in heldout for it in items)
        random.Random(1).shuffle(keep)
        pos[t] = prompt_states(mm, [_ids(mm.tokenizer, turn_text(template, p)) for p in keep], blocks)
    general = [r["prompt"] for r in general_split()["train"]]
    general += [r["prompt"] for r in topic_prompts(DefaultRecipe().n_topic, TRAIN_SEED_BASE + 99)]
    random.Random(2).shuffle(general)
    neg = prompt_states(mm, [_ids(mm.tokenizer, turn_text(template, p)) for p in general], blocks)
    return {"pos": pos, "neg": neg, "dropped_heldout_overlap": dropped, "n_general": len(general)}


def learned_destinations(mm, f: dict) -> list[int]:  # noqa: ANN001
    """The learned router's destination per validation prompt (module docstring), in f's router order."""
    router = mm.router
    own_names = list(router.adapter_names)
    out = []
    with torch.no_grad():
        for ids in f["ids"]:
            if not ids:  # a calibration prompt of Arrow's: not scored
                out.append(-1)
                continue
            x = torch.tensor([ids])
            mm(x, use_cache=False, logits_to_keep=1)
            routes = router.prompt_routes(mm.last_carry, None)
            d = int(routes[0, -1])
            out.append(-1 if d < 0 else f["names"].index(own_names[d]))
    return out


def choice_key(r: dict) -> tuple:
    """Highest skills mean, then mixed second turns, then general prompts kept home, then the larger share and
    the shorter window (the stricter vote)."""
    window = -1 if r["window"] is None else -r["window"]
    return (r["skills_mean"], r["mixed_turn2"], r["general"], r["prompt_share"], window)


def prompt_destination(votes: torch.Tensor, share: float, window: int | None) -> int:
    from molora.routing.base import fill_prompt_routes

    return int(fill_prompt_routes(votes[None], None, share, last_takes_top=True, window=window)[0, -1])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--json", required=True)
    ap.add_argument("--n-pos", type=int, default=160, help="own training prompts per gate (80%% fit, 20%% threshold)")
    ap.add_argument("--features", default="runs/arrow_variants_features.pt", help="arrow_variants_choose's cache")
    ap.add_argument("--train-features", default="runs/gates_train_features.pt")
    ap.add_argument("--learned", default="runs/gates_learned_val.json", help="cache of the learned router's decisions")
    ap.add_argument("--gates-out", help="save the chosen gates here (a GateRouter folder)")
    ap.add_argument("--threads", type=int, default=1)
    a = ap.parse_args(argv)
    torch.set_num_threads(a.threads)
    t0 = time.time()
    from molora.bench.common import machine_info
    from molora.bundle import load
    from molora.routing.gates import Gate, GateConfig, GateRouter
    from molora.train.gates import gate_threshold, held_cut, train_gate

    if not Path(a.features).is_file():
        from experiments import arrow_variants_choose

        arrow_variants_choose.main(["--json", "runs/arrow_variants_choice_rerun.json", "--features", a.features])
    f = torch.load(a.features)
    labels, tasks, own, names, blocks = f["labels"], f["tasks"], f["own"], f["names"], f["blocks"]
    mm = load(None)
    if Path(a.train_features).is_file():
        tr = torch.load(a.train_features)
    else:
        tr = train_states(mm, tasks, a.n_pos, blocks)
        torch.save(tr, a.train_features)
    if Path(a.learned).is_file():
        learned_dest = json.loads(Path(a.learned).read_text())
    else:
        f["ids"] = rebuild_ids(mm, f, tasks)
        learned_dest = learned_destinations(mm, f)
        Path(a.learned).write_text(json.dumps(learned_dest))
    learned_row = hit_rates(labels, learned_dest, tasks, own)
    grid, gates_of = [], {}
    for b, l2, aggregate in itertools.product(blocks, L2S, AGGREGATES):
        pool = (lambda s: s.mean(0, keepdim=True)) if aggregate == "mean" else (lambda s: s)
        pos = {t: [pool(s[b]) for s in tr["pos"][t]] for t in tasks}
        neg = [pool(s[b]) for s in tr["neg"]]
        cn = held_cut(len(neg), 0.2)
        fitted = {}
        for t in tasks:  # each gate alone: its own prompts and the general ones, seed 0 (as fit_gate)
            cp = held_cut(len(pos[t]), 0.2)
            w, bias = train_gate(pos[t][:cp], neg[:cn], generator=torch.Generator().manual_seed(0), l2=l2)
            fitted[t] = (w, bias, pos[t][cp:])
        for rule, value in RULES:
            gates = {
                names[own[t]]: Gate(w, bias, gate_threshold(w, bias, held, neg[cn:], rule, value))
                for t, (w, bias, held) in fitted.items()
            }
            gates_of[(b, l2, aggregate, rule, value)] = gates
            router = GateRouter(GateConfig(hidden_size=f["states"][0][b].shape[1]), gates)
            for share, window in itertools.product(SHARES if aggregate == "vote" else (0.0,), WINDOWS):
                if aggregate == "vote":
                    dest = [prompt_destination(router.votes(s[b]), share, window) for s in f["states"]]
                else:  # the mean state of the window: a linear gate's mean score (not served: reference only)
                    dest = [int(router.votes(s[b][-(window or 0) :].mean(0, keepdim=True))[0]) for s in f["states"]]
                row = {"block": b, "l2": l2, "aggregate": aggregate, "rule": rule, "value": value}
                row.update({"prompt_share": share, "window": window, **hit_rates(labels, dest, tasks, own)})
                grid.append(row)

    ok = [r for r in grid if r["general"] >= 95] or grid
    served = [r for r in ok if r["aggregate"] == "vote"]
    best_mean = max((r for r in ok if r["aggregate"] == "mean"), key=lambda r: r["skills_mean"], default=None)
    best = max(served, key=choice_key)
    arrow = json.loads(Path("docs/arrow_variants_choice.json").read_text())["chosen"]
    rec = {
        "command": f"python -m experiments.gates_choose --json {a.json} --n-pos {a.n_pos}",
        "date": time.strftime("%Y-%m-%d"),
        "machine": machine_info(),
        "tasks": tasks,
        "n_val_per_skill": labels.count(tasks[0]),
        "n_general_val": labels.count("general"),
        "n_pos_per_gate": a.n_pos,
        "n_general_train": tr["n_general"],
        "dropped_heldout_overlap": tr["dropped_heldout_overlap"],
        "blocks": blocks,
        "settings_searched": len(grid),
        "grid_top": sorted(ok, key=choice_key, reverse=True)[:60],
        "best_per_block": {
            str(b): max((r for r in ok if r["block"] == b), key=lambda r: r["skills_mean"], default=None)
            for b in blocks
        },
        "chosen": best,
        "best_mean_pooled": best_mean,
        "arrow_prompt_chosen": {k: arrow[k] for k in (*tasks, "general", "mixed_turn1", "mixed_turn2", "skills_mean")},
        "learned": learned_row,
        "seconds": round(time.time() - t0, 1),
    }
    Path(a.json).write_text(json.dumps(rec, indent=1) + "\n")
    print(json.dumps({"chosen": best, "arrow": rec["arrow_prompt_chosen"], "learned": learned_row}))
    if a.gates_out:
        c = best
        cfg = GateConfig(
            hidden_size=f["states"][0][c["block"]].shape[1],
            source_block=c["block"] - f["num_blocks"],
            prompt_share=c["prompt_share"],
            prompt_window=c["window"],
        )
        GateRouter(cfg, gates_of[(c["block"], c["l2"], "vote", c["rule"], c["value"])]).save(a.gates_out)
    return 0


def rebuild_ids(mm, f: dict, tasks: list[str]) -> list[list[int]]:  # noqa: ANN001
    """The validation prompts' token ids, built exactly as arrow_variants_choose.features orders them."""
    from molora.data.general import general_split
    from molora.eval.heldout import held_out, held_out_mixed, training_inputs
    from molora.eval.runner import _ids, template_of, turn_text

    template, end = template_of(mm)
    banned = training_inputs(mm.bundle)
    n_val = f["labels"].count(tasks[0])
    n_mixed = sum(lab.startswith("mixed1:") for lab in f["labels"])
    ids: list[list[int]] = [[] for lab in f["labels"] if lab.startswith("calib")]
    for t in tasks:
        items, _ = held_out(t, n_val, banned, split="val")
        ids += [_ids(mm.tokenizer, turn_text(template, it.input)) for it in items]
    ids += [_ids(mm.tokenizer, turn_text(template, r["prompt"])) for r in general_split()["val"]]
    for row in held_out_mixed(tasks, n_mixed, banned, split="val"):
        (p1, p2) = row["parts"][:2]
        first = _ids(mm.tokenizer, turn_text(template, p1["input"], p1["target"], end, last=False))
        ids.append(_ids(mm.tokenizer, turn_text(template, p1["input"])))
        ids.append(first + _ids(mm.tokenizer, turn_text(template, p2["input"])))
    assert len(ids) == len(f["labels"]), "the validation prompts differ from the features cache"
    assert all(len(i) == s[f["blocks"][0]].shape[0] for i, s in zip(ids, f["states"]) if i), "token counts differ"
    return ids


if __name__ == "__main__":
    raise SystemExit(main())
