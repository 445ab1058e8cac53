"""The two-skill block of docs/serving.md (a static mix against per-token routing), rendered from its committed record
(docs/mix_use.json, written by `python -m experiments.mix_use --json docs/mix_use.json`).

    python -m tools.make_mix_use            # rewrite the block
    python -m tools.make_mix_use --check    # exit 1 when the block is stale

The per-skill columns need each test row's two skills: the record's `test.tasks` where it has them, else the rows are
drawn again from the record's seeds (`experiments.mix_use.rows_of`: pure Python, the same rows the run answered).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

from molora.docblock import markers, wrap, write_block

ROOT = Path(__file__).resolve().parents[1]
RECORD = ROOT / "docs" / "mix_use.json"
PAGE = ROOT / "docs" / "serving.md"
BEGIN, END = markers("mixuse", "tools/make_mix_use.py")
LABELS = {
    "mix": "50/50 static mix of the two skills' adapters",
    "routed": "per-token routing (the bundle's learned router)",
    "adapter_a": "the first question's adapter alone",
    "adapter_b": "the second question's adapter alone",
    "base": "the base model",
}
SHORT = {
    "object_counting": "counting",
    "multistep_arithmetic_two": "arithmetic",
    "dyck_languages": "dyck",
    "navigate": "navigate",
}


def test_tasks(record: dict) -> list[list[str]]:
    """Each test row's two skills, in part order."""
    if "tasks" in record["test"]:
        return record["test"]["tasks"]
    from experiments.mix_use import rows_of
    from molora.bundle import default_bundle_dir, read_bundle
    from molora.eval.heldout import training_inputs

    banned = training_inputs(read_bundle(default_bundle_dir()))
    rows = rows_of("test", record["skills"], banned, n=record["test"]["n"])
    return [[p["task"] for p in row["parts"]] for row in rows]


def sign_test(a: int, b: int) -> float:
    """Two-sided exact sign test of a against b discordant pairs (1.0 when there are none)."""
    n, k = a + b, min(a, b)
    if n == 0:
        return 1.0
    return min(1.0, 2 * sum(math.comb(n, i) for i in range(k + 1)) / 2**n)


def per_skill(hits: list[str], tasks: list[list[str]]) -> dict[str, float]:
    """Strict accuracy (%) of the parts of each skill."""
    right: dict[str, list[int]] = {}
    for row, ts in zip(hits, tasks):
        for h, t in zip(row, ts):
            right.setdefault(t, []).append(h == "1")
    return {t: 100.0 * sum(v) / len(v) for t, v in right.items()}


def render(record: dict, tasks: list[list[str]]) -> str:
    """The block's body: setup, one row per routing (choice, part accuracy, both right, per skill), a paired count of
    mix against routing, and what the numbers say about when each is ahead."""
    test, val = record["test"], record["validation"]
    res = test["results"]
    skills = [s for s in record["skills"] if any(s in ts for ts in tasks)]
    m = record["machine_info"]
    lines = [
        f"{test['n']} two-skill test prompts (two questions of different skills of the default bundle in one prompt, "
        f"own seeded items, none from the training files), greedy, through the engine; each part scored strictly as "
        f'`molora eval` scores its skill (a reply without "Answer i:" marks is cut into parts by its lines, in '
        f"order). The prompt layout ({' or '.join(record['joiners'])}) and the answer budget "
        f"({' or '.join(str(b) for b in record['budgets'])} new tokens) were chosen per routing on {val['n']} "
        f"validation prompts; test was scored once. {m['threads']} threads on {m['cpu']} "
        f"(record: [mix_use.json](mix_use.json), `{record['command']}`).",
        "",
        "| routing | layout / budget | parts right % | both right % | "
        + " | ".join(SHORT.get(s, s) + " %" for s in skills)
        + " |",
        "|---|---|---:|---:|" + "---:|" * len(skills),
    ]
    for r, label in LABELS.items():
        x = res[r]
        ps = per_skill(x["hits"], tasks)
        cells = " | ".join(f"{ps[s]:.0f}" if s in ps else "-" for s in skills)
        lines.append(
            f"| {label} | {x['joiner']} / {x['max_new_tokens']} | {x['part_accuracy']:.1f} | {x['both_right']:.1f} "
            f"| {cells} |"
        )
    lines += ["", summary(res, tasks, skills)]
    return "\n".join(lines)


def summary(res: dict, tasks: list[list[str]], skills: list[str]) -> str:
    """One paragraph from the numbers: the paired count of parts only the mix or only routing got right, and the
    skills on which each is ahead."""
    mix_only = routed_only = 0
    for a, b in zip(res["mix"]["hits"], res["routed"]["hits"]):
        for x, y in zip(a, b):
            mix_only += x == "1" and y == "0"
            routed_only += x == "0" and y == "1"
    pm, pr = per_skill(res["mix"]["hits"], tasks), per_skill(res["routed"]["hits"], tasks)
    ahead_mix = [SHORT.get(s, s) for s in skills if pm[s] > pr[s]]
    ahead_routed = [SHORT.get(s, s) for s in skills if pr[s] > pm[s]]
    diff = res["mix"]["part_accuracy"] - res["routed"]["part_accuracy"]
    best_single = max(res["adapter_a"]["part_accuracy"], res["adapter_b"]["part_accuracy"])
    p = sign_test(mix_only, routed_only)
    who = "the mix" if diff > 0 else "per-token routing" if diff < 0 else "neither"
    text = (
        f"Paired over the same parts, {mix_only} were right only with the mix and {routed_only} only with routing "
        f"(two-sided sign test p = {p:.2f}): {who} is ahead overall ({res['mix']['part_accuracy']:.1f}% against "
        f"{res['routed']['part_accuracy']:.1f}% of parts; the better single adapter {best_single:.1f}%, the base "
        f"{res['base']['part_accuracy']:.1f}%)."
    )
    if all(res[r]["both_right"] == 0 for r in res):
        text += " No routing answered both parts of any prompt."
    if ahead_mix:
        text += f" The mix is ahead on {', '.join(ahead_mix)} parts"
        text += f", routing on {', '.join(ahead_routed)}." if ahead_routed else "."
    elif ahead_routed:
        text += f" Routing is ahead on {', '.join(ahead_routed)} parts."
    if p >= 0.05:
        text += (
            " The difference between the mix and routing is within what chance gives on these prompts, so they do not "
            "say when one helps more than the other; what they say is that neither makes two skills answer one prompt."
        )
    elif mix_only > routed_only:
        text += (
            " On these prompts a mix helps: the router's per-token choice misses a skill more often than half of each "
            "delta does; routing stays the choice where each part needs its own adapter undiluted."
        )
    else:
        text += (
            " On these prompts, whose parts each belong to one skill, routing each token to its adapter beats halving "
            "both deltas; a mix is the choice where no router knows the skills, or where every token needs both."
        )
    return text


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--check", action="store_true", help="exit 1 when the block is stale; write nothing")
    a = p.parse_args(argv)
    record = json.loads(RECORD.read_text())
    block = wrap(BEGIN, END, render(record, test_tasks(record)))
    changed = write_block(PAGE, BEGIN, END, block, check=a.check)
    if a.check and changed:
        print(f"{PAGE} is stale: run python -m tools.make_mix_use", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
