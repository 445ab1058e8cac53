"""Choose the data-free gates' settings (molora.train.datafree: prompts the base model writes, labelled by which
adapter moves its answer most) on the validation prompts of scripts/gates_choose.py and
scripts/arrow_variants_choose.py, beside the gates trained on each adapter's own prompts, prompt-Arrow and the
learned router.

    .venv/bin/python scripts/datafree_choose.py --pool runs/datafree_pool.json --json docs/datafree_choice.json \
        [--gates-out runs/datafree_gates]

Data: the pool (scripts/datafree_pool.py: user turns the base model wrote, none equal to an evaluation item) and
the adapters' weights; nothing else trains or labels anything. The pool's sensitivity (KL of each adapter against
the base on the base model's own answer) and block states are cached in --sens.

Validation: the prompts, labels and base-model states of arrow_variants_choose's --features cache (40 items per
skill, 60 general prompts, 40 two-skill items), scored with the same `hit_rates` as Arrow's and the gates' choices.
"sensitivity_direct" (diagnostic, not served: it costs one forward per adapter) routes the first --n-direct
validation prompts of each group by the labelling rule itself, z-scored against the pool: how well the signal
picks a prompt's adapter where the prompt is in view.

Grid: label rule (z_min x margin) x gate l2 x threshold rule x prompt_share x window at the gates' block
(molora.train.gates.CHOSEN's). Choice as gates_choose: the highest skills mean among settings keeping >= 95% of
general validation prompts on the base model (ties: mixed second turns, general kept home, larger share, shorter
window).
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from arrow_variants_choose import hit_rates  # noqa: E402  (the same scoring as Arrow's and the gates' choices)
from gates_choose import RULES, SHARES, WINDOWS, choice_key, prompt_destination  # noqa: E402

Z_MINS = (0.5, 1.0, 1.5, 2.0)
MARGINS = (0.0, 0.5, 1.0)
L2S = (1e-3, 1e-2)


def val_texts(mm, f: dict, tasks: list[str], n_direct: int) -> tuple[list[str], list[str]]:  # noqa: ANN001
    """(labels, prompts) of the first n_direct validation prompts per skill and general (as features orders them)."""
    from molora.data.general import general_split
    from molora.eval.heldout import held_out, training_inputs

    banned = training_inputs(mm.bundle)
    n_val = f["labels"].count(tasks[0])
    labels, texts = [], []
    for t in tasks:
        items, _ = held_out(t, n_val, banned, split="val")
        labels += [t] * n_direct
        texts += [it.input for it in items[:n_direct]]
    labels += ["general"] * n_direct
    texts += [r["prompt"] for r in general_split()["val"][:n_direct]]
    return labels, texts


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--pool", required=True)
    ap.add_argument("--json", required=True)
    ap.add_argument("--features", default="runs/arrow_variants_features.pt", help="arrow_variants_choose's cache")
    ap.add_argument("--sens", default="runs/datafree_sens.pt", help="cache of the pool's sensitivity and states")
    ap.add_argument("--n-direct", type=int, default=10, help="validation prompts per group for the diagnostic")
    ap.add_argument("--answer-tokens", type=int, default=16)
    ap.add_argument("--gates-out", help="save the chosen gates here (a GateRouter folder)")
    ap.add_argument("--threads", type=int, default=1)
    a = ap.parse_args(argv)
    torch.set_num_threads(a.threads)
    t0 = time.time()
    from molora.bench.common import machine_info
    from molora.bundle import load
    from molora.routing.gates import GateConfig, GateRouter
    from molora.train.datafree import gates_from_labels, label_prompts, sensitivity
    from molora.train.gates import CHOSEN

    f = torch.load(a.features)
    labels, tasks, own, names = f["labels"], f["tasks"], f["own"], f["names"]
    block = CHOSEN["source_block"] + f["num_blocks"]
    pool_rec = json.loads(Path(a.pool).read_text())
    pool = pool_rec["prompts"]
    mm = load(None)
    assert list(mm.adapter_names) == list(names), "the features cache was made with another adapter order"
    if Path(a.sens).is_file():
        sens = torch.load(a.sens)
    else:
        t1 = time.time()
        sens = sensitivity(mm, pool, block=block, answer_tokens=a.answer_tokens)
        sens["seconds"] = round(time.time() - t1, 1)
        dl, dt = val_texts(mm, f, tasks, a.n_direct)
        sens["direct"] = {"labels": dl, "kl": sensitivity(mm, dt, answer_tokens=a.answer_tokens)["kl"]}
        torch.save(sens, a.sens)
    kl, states = sens["kl"], sens["states"]

    # diagnostic: the labelling rule applied to validation prompts themselves (z against the pool)
    direct = []
    for z_min, margin in itertools.product(Z_MINS, MARGINS):
        d = label_prompts(sens["direct"]["kl"], z_min=z_min, margin=margin, ref=kl).tolist()
        direct.append({"z_min": z_min, "margin": margin, **hit_rates(sens["direct"]["labels"], d, tasks, own)})
    argmax_direct = label_prompts(sens["direct"]["kl"], z_min=-1e9, margin=0.0, ref=kl).tolist()

    grid, gates_of, label_counts = [], {}, {}
    for z_min, margin in itertools.product(Z_MINS, MARGINS):
        lab = label_prompts(kl, z_min=z_min, margin=margin)
        label_counts[f"{z_min}/{margin}"] = {n: int((lab == k).sum()) for k, n in enumerate(names)} | {
            "base": int((lab == -1).sum())
        }
        for l2, (rule, value) in itertools.product(L2S, RULES):
            try:
                gates = gates_from_labels(states, lab, names, rule=rule, value=value, l2=l2)
            except Exception as e:  # noqa: BLE001  (too few unclaimed prompts: no negatives)
                print(f"skip z_min={z_min} margin={margin}: {e}")
                break
            if not gates:
                continue
            gates_of[(z_min, margin, l2, rule, value)] = gates
            router = GateRouter(GateConfig(hidden_size=states[0].shape[1]), gates)
            to_name = [names.index(n) for n in router.adapter_names]
            votes = [router.votes(s[block]) for s in f["states"]]
            for share, window in itertools.product(SHARES, WINDOWS):
                dest = [prompt_destination(v, share, window) for v in votes]
                dest = [-1 if d < 0 else to_name[d] for d in dest]
                row = {"z_min": z_min, "margin": margin, "l2": l2, "rule": rule, "value": value}
                row.update({"gated": list(gates), "aggregate": "vote", "prompt_share": share, "window": window})
                row.update(hit_rates(labels, dest, tasks, own))
                grid.append(row)
    ok = [r for r in grid if r["general"] >= 95] or grid
    best = max(ok, key=choice_key)
    gates_rec = json.loads(Path("docs/gates_choice.json").read_text())
    rec = {
        "command": f"python scripts/datafree_choose.py --pool {a.pool} --json {a.json} --n-direct {a.n_direct} "
        f"--answer-tokens {a.answer_tokens}",
        "pool_command": pool_rec["command"],
        "date": time.strftime("%Y-%m-%d"),
        "machine": machine_info(),
        "tasks": tasks,
        "n_pool": len(pool),
        "pool_examples": pool[:20],
        "sensitivity_seconds": sens.get("seconds"),
        "pool_kl_median": {n: round(float(kl[:, k].median()), 4) for k, n in enumerate(names)},
        "pool_top_adapter": {n: int((kl.clamp_min(1e-8).log().sub(kl.clamp_min(1e-8).log().mean(0)).div(
            kl.clamp_min(1e-8).log().std(0)).argmax(1) == k).sum()) for k, n in enumerate(names)},
        "label_counts": label_counts,
        "n_val_per_skill": labels.count(tasks[0]),
        "n_general_val": labels.count("general"),
        "block": block,
        "settings_searched": len(grid),
        "grid_top": sorted(ok, key=choice_key, reverse=True)[:40],
        "chosen": best,
        "chosen_label_counts": label_counts[f"{best['z_min']}/{best['margin']}"],
        "sensitivity_direct": {
            "n_per_group": a.n_direct,
            "argmax": hit_rates(sens["direct"]["labels"], argmax_direct, tasks, own),
            "rules": direct,
        },
        "gates_own_prompts_chosen": {k: gates_rec["chosen"][k] for k in (*tasks, "general", "mixed_turn1",
                                                                         "mixed_turn2", "skills_mean")},
        "arrow_prompt_chosen": gates_rec["arrow_prompt_chosen"],
        "learned": gates_rec["learned"],
        "seconds": round(time.time() - t0, 1),
    }
    Path(a.json).write_text(json.dumps(rec, indent=1) + "\n")
    print(json.dumps({"chosen": best, "labels": rec["chosen_label_counts"], "direct": rec["sensitivity_direct"]["argmax"]}))
    if a.gates_out:
        c = best
        cfg = GateConfig(
            hidden_size=states[0].shape[1],
            source_block=block - f["num_blocks"],
            prompt_share=c["prompt_share"],
            prompt_window=c["window"],
        )
        GateRouter(cfg, gates_of[(c["z_min"], c["margin"], c["l2"], c["rule"], c["value"])]).save(a.gates_out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
