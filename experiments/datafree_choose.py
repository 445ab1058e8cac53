"""Choose the data-free gates' settings (molora.train.datafree: prompts the base model writes, labelled by which
adapter moves its answer most) on the validation prompts of experiments/gates_choose.py and
experiments/arrow_variants_choose.py, beside the gates trained on each adapter's own prompts, prompt-Arrow and the
learned router.

    .venv/bin/python -m experiments.datafree_choose --pool runs/datafree_pool.json --json docs/datafree_choice.json \
        [--gates-out runs/datafree_gates]

Data: the pool (experiments/datafree_pool.py: user turns the base model wrote, none equal to an evaluation item) and
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
import random
import time
from pathlib import Path

import torch

from experiments.arrow_variants_choose import hit_rates  # (the same scoring as Arrow's and the gates' choices)
from experiments.features import features_cache
from experiments.gates_choose import RULES, SHARES, WINDOWS, choice_key, prompt_destination
from experiments.gates_eval import _row, test_tables  # (the test tables of the records gates_eval writes)

Z_MINS = (0.5, 1.0, 1.5, 2.0)
MARGINS = (0.0, 0.5)
L2S = (1e-2,)
MIN_PROMPTS = 5
# what says an adapter claims a prompt (higher: more): "kl" how far it moves the base model's answer;
# "confident" / "confident_mean" how sure it is of itself (1 / its entropy at the first answer token / over them)
SIGNALS = ("kl", "confident", "confident_mean")


def signal(s: dict, name: str) -> torch.Tensor:
    if name == "kl":
        return s["kl"]
    return 1.0 / s["entropy_first" if name == "confident" else "entropy"].clamp_min(1e-6)


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
    ap.add_argument(
        "--answer-tokens", type=int, default=0, help="base answer tokens read (0: the first one's prediction only)"
    )
    ap.add_argument("--gates-out", help="save the chosen gates here (a GateRouter folder)")
    ap.add_argument("--threads", type=int, default=1)
    a = ap.parse_args(argv)
    torch.set_num_threads(a.threads)
    t0 = time.time()
    from molora.bench.common import machine_info
    from molora.bundle import load
    from molora.routing.gates import Gate, GateConfig, GateRouter
    from molora.train.datafree import label_prompts, sensitivity, zscores
    from molora.train.gates import CHOSEN, gate_threshold, held_cut, train_gate

    feats = features_cache(a.features)
    f, labels, tasks, own, names = feats.raw, feats.labels, feats.tasks, feats.own, feats.names
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
        sens["direct"] = {"labels": dl, **sensitivity(mm, dt, answer_tokens=a.answer_tokens)}
        torch.save(sens, a.sens)
    kl, states = sens["kl"], sens["states"]

    signals = SIGNALS if a.answer_tokens else SIGNALS[:2]  # no answer: the mean is the first token's
    pool_signal = {sig: signal(sens, sig) for sig in signals}
    direct_signal = {sig: signal(sens["direct"], sig) for sig in signals}
    dlab = sens["direct"]["labels"]
    # diagnostic: the labelling rule applied to validation prompts themselves (z against the pool)
    direct = []
    for sig, z_min, margin in itertools.product(signals, Z_MINS, MARGINS):
        d = label_prompts(direct_signal[sig], z_min=z_min, margin=margin, ref=pool_signal[sig]).tolist()
        direct.append({"signal": sig, "z_min": z_min, "margin": margin, **hit_rates(dlab, d, tasks, own)})
    argmax_direct = {
        sig: hit_rates(
            dlab, label_prompts(direct_signal[sig], z_min=-1e9, margin=0.0, ref=pool_signal[sig]).tolist(), tasks, own
        )
        for sig in signals
    }

    grid, gates_of, label_counts = [], {}, {}
    for sig, z_min, margin in itertools.product(signals, Z_MINS, MARGINS):
        lab = label_prompts(pool_signal[sig], z_min=z_min, margin=margin)
        counts = {n: int((lab == k).sum()) for k, n in enumerate(names)} | {"base": int((lab == -1).sum())}
        label_counts[f"{sig}/{z_min}/{margin}"] = counts
        neg = [states[i] for i in range(len(states)) if int(lab[i]) == -1]
        random.Random(2).shuffle(neg)
        if len(neg) < 10:
            continue
        cn = held_cut(len(neg), 0.2)
        for l2 in L2S:
            fitted = {}
            for k, n in enumerate(names):  # each gate alone, as molora.train.datafree.gates_from_labels
                pos = [states[i] for i in range(len(states)) if int(lab[i]) == k]
                if len(pos) < MIN_PROMPTS:
                    continue
                random.Random(1).shuffle(pos)
                cp = held_cut(len(pos), 0.2)
                w, bias = train_gate(pos[:cp], neg[:cn], generator=torch.Generator().manual_seed(0), l2=l2)
                fitted[n] = (w, bias, pos[cp:])
            if not fitted:
                continue
            for rule, value in RULES:
                gates = {
                    n: Gate(w, bias, gate_threshold(w, bias, held, neg[cn:], rule, value))
                    for n, (w, bias, held) in fitted.items()
                }
                key = (sig, z_min, margin, l2, rule, value)
                gates_of[key] = gates
                router = GateRouter(GateConfig(hidden_size=states[0].shape[1]), gates)
                to_name = [names.index(n) for n in router.adapter_names]
                votes = [router.votes(s[block]) for s in f["states"]]
                for share, window in itertools.product(SHARES, WINDOWS):
                    dest = [prompt_destination(v, share, window) for v in votes]
                    dest = [-1 if d < 0 else to_name[d] for d in dest]
                    row = {"signal": sig, "z_min": z_min, "margin": margin, "l2": l2, "rule": rule, "value": value}
                    row.update({"gated": list(gates), "aggregate": "vote", "prompt_share": share, "window": window})
                    row.update(hit_rates(labels, dest, tasks, own))
                    grid.append(row)
    ok = [r for r in grid if r["general"] >= 95] or grid
    best = max(ok, key=choice_key)
    gates_rec = json.loads(Path("docs/gates_choice.json").read_text())
    rec = {
        "command": f"python -m experiments.datafree_choose --pool {a.pool} --json {a.json} --n-direct {a.n_direct} "
        f"--answer-tokens {a.answer_tokens}",
        "pool_command": pool_rec["command"],
        "date": time.strftime("%Y-%m-%d"),
        "machine": machine_info(),
        "tasks": tasks,
        "n_pool": len(pool),
        "pool_examples": pool[:20],
        "sensitivity_seconds": sens.get("seconds"),
        "pool_kl_median": {n: round(float(kl[:, k].median()), 4) for k, n in enumerate(names)},
        "pool_top_adapter": {
            sig: {n: int((zscores(pool_signal[sig]).argmax(1) == k).sum()) for k, n in enumerate(names)}
            for sig in signals
        },
        "label_counts": label_counts,
        "n_val_per_skill": labels.count(tasks[0]),
        "n_general_val": labels.count("general"),
        "block": block,
        "settings_searched": len(grid),
        "grid_top": sorted(ok, key=choice_key, reverse=True)[:40],
        "chosen": best,
        "chosen_label_counts": label_counts[f"{best['signal']}/{best['z_min']}/{best['margin']}"],
        "sensitivity_direct": {
            "n_per_group": a.n_direct,
            "argmax": argmax_direct,
            "rules": direct,
        },
        "gates_own_prompts_chosen": {
            k: gates_rec["chosen"][k] for k in (*tasks, "general", "mixed_turn1", "mixed_turn2", "skills_mean")
        },
        "arrow_prompt_chosen": gates_rec["arrow_prompt_chosen"],
        "learned": gates_rec["learned"],
        "seconds": round(time.time() - t0, 1),
    }
    Path(a.json).write_text(json.dumps(rec, indent=1) + "\n")
    print(
        json.dumps(
            {"chosen": best, "labels": rec["chosen_label_counts"], "direct": rec["sensitivity_direct"]["argmax"]}
        )
    )
    if a.gates_out:
        c = best
        cfg = GateConfig(
            hidden_size=states[0].shape[1],
            source_block=block - f["num_blocks"],
            prompt_share=c["prompt_share"],
            prompt_window=c["window"],
        )
        key = (c["signal"], c["z_min"], c["margin"], c["l2"], c["rule"], c["value"])
        GateRouter(cfg, gates_of[key]).save(a.gates_out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())


def render_section(rec: dict) -> list[str]:
    """docs/results.md's section on data-free routing (markdown lines): the test record of the confidence chooser
    (docs/datafree_prompt.json, written by experiments/gates_eval.py --confidence), its validation choice
    (experiments/datafree_confidence.py) and the gates trained on pseudo-labelled pool prompts
    (docs/datafree_choice.json, this script's record)."""
    c = rec["config"]
    out = [
        "## Data-free routing: the adapters' weights and text the base model writes, no labelled data",
        "",
        "The base model writes a pool of user turns itself (`experiments/datafree_pool.py`; none equal to an "
        "evaluation item). Two ways to route with it were measured (`molora/train/datafree.py`, "
        "`molora/routing/confidence.py`):",
        "",
        "- **confidence chooser** (one adapter per request): each adapter reads the prompt, its confidence is 1 / the "
        "entropy of its first answer token, z-scored per adapter over the pool; the request goes to the adapter "
        "with the largest z if it reaches z_min and leads the runner-up by the margin, else to the base model. "
        "Costs one prompt pass per adapter before the answer.",
        "- **gates on pseudo-labels**: the per-adapter gates of the section above, trained on pooled prompts "
        "labelled by the same kind of z (or by KL(adapter || base) on the first answer token) instead of any "
        "adapter's own prompts.",
        "",
    ]
    choice_path = Path(rec["choice"])
    cols: list[str] = []
    if choice_path.is_file():
        ch = json.loads(choice_path.read_text())
        tasks = ch["tasks"]
        cols = [*tasks, "general", "mixed_turn1", "mixed_turn2", "skills_mean"]
        b = ch["chosen"]
        out += [
            f"**Chosen on validation** (`{ch['command']}`; pool: `{ch['pool_command']}`, {ch['n_pool']} prompts; the "
            f"validation items of docs/gates_choice.json; % of each set whose answer runs where it belongs; among the "
            f"{ch['settings_searched']} rules those keeping >= 95% of general prompts on the base). Confidence "
            f"chooser: z_min {b['z_min']}, margin {b['margin']}.",
            "",
            "| routing | " + " | ".join(cols) + " |",
            "|---|" + "---|" * len(cols),
            _row("confidence chooser (chosen)", b, cols),
            _row("confidence, largest z, never base", ch["argmax_never_base"], cols),
        ]
        if ch.get("relative_to_base_val_only"):
            r = ch["relative_to_base_val_only"]
            out.append(_row(f"confidence over the base's own, z_min {r['z_min']} (validation only)", r, cols))
        gates_path = Path("docs/datafree_choice.json")
        if gates_path.is_file():
            g = json.loads(gates_path.read_text())
            out.append(_row("gates on pseudo-labelled pool (chosen)", g["chosen"], cols))
        out += [
            _row("gates on own prompts (chosen)", ch["gates_own_prompts_chosen"], cols),
            _row("prompt-Arrow (chosen)", ch["arrow_prompt_chosen"], cols),
            _row("learned", ch["learned"], cols),
            "",
        ]
        if gates_path.is_file():
            gb = g["chosen"]
            counts = ", ".join(f"{k} {v}" for k, v in g["chosen_label_counts"].items())
            out += [
                f"Gates on pseudo-labels: `{g['command']}`, {g['settings_searched']} settings; chosen label signal "
                f"{gb['signal']} (z_min {gb['z_min']}, margin {gb['margin']}), pooled prompts per label: {counts}. "
                "They fail because the pool holds almost no prompt like a skill's: a gate learns what the adapter "
                "claims among the base model's own turns, which is not what marks a skill's prompts.",
                "",
                f"Each signal's labelling rule applied to validation prompts themselves (the first "
                f"{g['sensitivity_direct']['n_per_group']} of each skill; the adapter with the largest z, never the "
                "base): KL(adapter || base) on the first answer token picks the wrong adapter, confidence the right "
                "one.",
                "",
                "| signal | " + " | ".join([*tasks, "skills_mean"]) + " |",
                "|---|" + "---|" * (len(tasks) + 1),
            ]
            out += [_row(sig, r, [*tasks, "skills_mean"]) for sig, r in g["sensitivity_direct"]["argmax"].items()]
            out += [
                "",
                "The confidence-over-base row was scored on validation after the test below had been scored with "
                "the chosen rule, so it was not tested. The confidence chooser's own cost (one prompt pass per "
                "adapter before the answer) is not measured; the hybrid's (one more, on the base model) is, where "
                "docs/datafree_hybrid_cost.json exists (below).",
                "",
            ]
    out += _test_tables(rec, f"chooser z_min {c['z_min']}, margin {c['margin']}", "the confidence chooser")
    out += _hybrid_section(cols)
    return out


def _test_tables(rec: dict, what: str, who: str) -> list[str]:
    """The test tables of a gates_eval.py record (skills, general prompts, two-skill items)."""
    items = f"{what}; the items of docs/arrow_prompt.json and docs/gates_prompt.json, whose other columns it repeats"
    return test_tables(rec, items, f"; {who} picks one adapter for the whole conversation, as `sequence` does")


def _hybrid_section(cols: list[str]) -> list[str]:
    """The hybrid chooser (molora.routing.hybrid): its validation choice (docs/datafree_hybrid_choice.json,
    experiments/datafree_hybrid.py) and, where it was scored, its test record (docs/datafree_hybrid_prompt.json)."""
    path = Path("docs/datafree_hybrid_choice.json")
    if not path.is_file():
        return []
    h = json.loads(path.read_text())
    b = h["chosen"]
    cols = cols or [*h["tasks"], "general", "mixed_turn1", "mixed_turn2", "skills_mean"]
    rule = f"Arrow block {b['block']}, vote threshold {b['threshold']}, window {b['window']}, "
    rule += f"prompt_share {b['prompt_share']}, z_or {b['z_or']}, z_floor {b['z_floor']}"
    p = h["arrow_chosen_setting"]
    beats = h["beats_confidence_chosen"]
    out = [
        "### Hybrid: prompt-Arrow decides whether, confidence decides which",
        "",
        "`molora/routing/hybrid.py`: prompt-level Arrow's vote (the share of the prompt's last tokens whose "
        "calibrated ratio claims them) decides whether a request leaves the base model, the confidence chooser's "
        "largest z which adapter it goes to; optionally a top z of z_or also claims a prompt, and a top z below "
        "z_floor keeps it home. Each validation prompt is decided on its own (a two-skill item's second turn with "
        "the first in view), so the mixed columns are a per-turn choice. "
        f"**Chosen on validation** (`{h['command']}`; {h['settings_searched']} settings, the same items, "
        f"`hit_rates` and >= 95% general rule as above): {rule}.",
        "",
        "| routing | " + " | ".join(cols) + " |",
        "|---|" + "---|" * len(cols),
        _row("hybrid (chosen)", b, cols),
        _row(
            f"hybrid at prompt-Arrow's setting (block {p['block']}, threshold {p['threshold']}, window {p['window']}, "
            f"share {p['prompt_share']})",
            h["at_arrow_chosen_setting_plain"],
            cols,
        ),
        _row("confidence chooser (chosen)", h["confidence_chosen"], cols),
        _row("prompt-Arrow (chosen)", h["arrow_prompt_chosen"], cols),
        _row("learned", h["learned"], cols),
        "",
        f"The hybrid {'beats' if beats else 'does not beat'} the confidence chooser's skills mean on validation at "
        f">= 95% general ({b['skills_mean']:.1f} vs {h['confidence_chosen']['skills_mean']:.1f}), so it "
        + (
            "was not scored on test."
            if not beats
            else "was scored on test once (below), the second data-free method scored on test (the "
            "first: the confidence chooser above)."
            if Path("docs/datafree_hybrid_prompt.json").is_file()
            else "is the candidate for the test (not scored yet)."
        ),
        "",
    ]
    test = Path("docs/datafree_hybrid_prompt.json")
    if beats and test.is_file():
        rec = json.loads(test.read_text())
        a = rec["config"]["arrow"]
        what = (
            f"Arrow source block {a['source_block']}, threshold {a['rms_threshold']}, window {a['prompt_window']}, "
            f"prompt_share {a['prompt_share']}, z_or {rec['config']['z_or']}, z_floor {rec['config']['z_floor']}"
        )
        who = "the hybrid column"
        if any(k.endswith("_turn") for k in rec.get("mixed", {})):
            who = (
                "its _turn column chooses each turn on that turn's question (the evaluation's turn mode); "
                "the hybrid column"
            )
        out += _test_tables(rec, what, who)
    return out
