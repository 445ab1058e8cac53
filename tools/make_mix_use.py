"""The two-skill block of docs/serving.md (a static mix against per-token routing), rendered from its committed record
(docs/mix_use.json, written by `python -m experiments.mix_use --json docs/mix_use.json ...`: its `command`).

    python -m tools.make_mix_use            # rewrite the block
    python -m tools.make_mix_use --check    # exit 1 when the block is stale
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
    "mix": "50/50 static mix of a's and b's adapters",
    "routed": "per-token routing (the bundle's learned router)",
    "adapter_a": "a's adapter alone",
    "adapter_b": "b's adapter alone",
    "base": "the base model",
}
SHORT = {
    "object_counting": "counting",
    "multistep_arithmetic_two": "arithmetic",
    "dyck_languages": "dyck",
    "navigate": "navigate",
}


def short(skill: str) -> str:
    return SHORT.get(skill, skill)


def sign_test(a: int, b: int) -> float:
    """Two-sided exact sign test of a against b discordant pairs (1.0 when there are none)."""
    n, k = a + b, min(a, b)
    if n == 0:
        return 1.0
    return min(1.0, 2 * sum(math.comb(n, i) for i in range(k + 1)) / 2**n)


def per_skill(hits: list[str], tasks: list[list[str]]) -> dict[str, float]:
    """Strict accuracy (%) of the replies of each skill, either turn."""
    right: dict[str, list[int]] = {}
    for row, ts in zip(hits, tasks):
        for h, t in zip(row, ts):
            right.setdefault(t, []).append(h == "1")
    return {t: 100.0 * sum(v) / len(v) for t, v in right.items()}


def discordant(a: list[str], b: list[str], turns: tuple[int, ...] = (0, 1)) -> tuple[int, int]:
    """(replies right only in a, only in b) over the same rows and the given turns."""
    only_a = only_b = 0
    for x, y in zip(a, b):
        for t in turns:
            only_a += x[t] == "1" and y[t] == "0"
            only_b += x[t] == "0" and y[t] == "1"
    return only_a, only_b


def render(record: dict) -> str:
    """The block's body: setup, one row per routing (turn 1, turn 2, both right, per skill, cut by the budget), both
    right per ordered skill pair, a paired count of mix against routing, and what the numbers say."""
    test = record["test"]
    res, tasks = test["results"], test["tasks"]
    skills = [s for s in record["skills"] if any(s in ts for ts in tasks)]
    budgets: dict[str, int] = {}
    for ts, bs in zip(tasks, test["budgets"]):
        budgets.update(zip(ts, bs))
    m = record["machine_info"]
    n = test["n"]
    of = f" (the first {n} of the {test['asked']} asked for: the run was stopped there)" if test["asked"] != n else ""
    lines = [
        f"{n} two-skill test conversations{of}: turn 1 asks a question of skill a, turn 2 a question of another skill "
        f"b with turn 1 and the model's reply in the context (rendered as the server renders a two-turn chat); own "
        f"seeded items of the default bundle's skills, none from its training files. One routing runs the whole "
        f"conversation, greedy, through the engine; each reply is scored strictly by its own skill as `molora eval` "
        f"scores it, with that skill's eval answer budget ("
        + ", ".join(f"{short(s)} {budgets[s]}" for s in skills)
        + " new tokens). Nothing was chosen (budgets: eval's; rendering: the server's; decoding: greedy), so "
        + (
            f"the {record['validation']['n']} validation conversations only stand beside test as a second sample; "
            if "validation" in record
            else "no validation split was needed; "
        )
        + "test was scored once. "
        f"{m['threads']} threads on {m['cpu']} (record: [mix_use.json](mix_use.json), `{record['command']}`).",
        "",
        "| routing | turn 1 right % | turn 2 right % | both right % | "
        + " | ".join(short(s) + " %" for s in skills)
        + " | replies cut by the budget |",
        "|---|---:|---:|---:|" + "---:|" * len(skills) + "---:|",
    ]
    for r, label in LABELS.items():
        x = res[r]
        ps = per_skill(x["hits"], tasks)
        cells = " | ".join(f"{ps[s]:.0f}" if s in ps else "-" for s in skills)
        lines.append(
            f"| {label} | {x['turn1_accuracy']:.1f} | {x['turn2_accuracy']:.1f} | {x['both_right']:.1f} | {cells} "
            f"| {sum(x['cut_by_budget'])} |"
        )
    pairs: dict[tuple[str, str], list[int]] = {}
    for i, ts in enumerate(tasks):
        pairs.setdefault((ts[0], ts[1]), []).append(i)
    lines += [
        "",
        "Conversations with both replies right, per ordered skill pair (a then b; right / in the pair):",
        "",
        "| a → b | " + " | ".join(LABELS) + " |",
        "|---|" + "---:|" * len(LABELS),
    ]
    for (a, b), rows in sorted(pairs.items(), key=lambda kv: (skills.index(kv[0][0]), skills.index(kv[0][1]))):
        cells = " | ".join(f"{sum(res[r]['hits'][i] == '11' for i in rows)}/{len(rows)}" for r in LABELS)
        lines.append(f"| {short(a)} → {short(b)} | {cells} |")
    lines += ["", summary(res, tasks, skills)]
    return "\n".join(lines)


def summary(res: dict, tasks: list[list[str]], skills: list[str]) -> str:
    """One paragraph from the numbers: the paired count of replies only the mix or only routing got right (all, and per
    turn), the skills on which each is ahead, and when each is the better choice on these conversations."""
    mix, routed = res["mix"], res["routed"]
    mix_only, routed_only = discordant(mix["hits"], routed["hits"])
    p = sign_test(mix_only, routed_only)
    t1, t2 = discordant(mix["hits"], routed["hits"], (0,)), discordant(mix["hits"], routed["hits"], (1,))
    acc = {r: (x["turn1_accuracy"] + x["turn2_accuracy"]) / 2 for r, x in res.items()}
    who = "the mix" if mix_only > routed_only else "per-token routing" if routed_only > mix_only else "neither"
    text = (
        f"Paired over the same replies, {mix_only} were right only with the mix and {routed_only} only with routing "
        f"(two-sided sign test p = {p:.2g}; turn 1: {t1[0]} against {t1[1]}, turn 2: {t2[0]} against {t2[1]}): "
        f"{who} is ahead ({acc['mix']:.1f}% against {acc['routed']:.1f}% of replies right, both replies of a "
        f"conversation {mix['both_right']:.1f}% against {routed['both_right']:.1f}%; a's adapter alone "
        f"{acc['adapter_a']:.1f}%, b's {acc['adapter_b']:.1f}%, the base {acc['base']:.1f}%)."
    )
    a1, b2 = res["adapter_a"]["turn1_accuracy"], res["adapter_b"]["turn2_accuracy"]
    text += (
        f" Per turn, against the adapter of that turn's skill alone: turn 1 routing {routed['turn1_accuracy']:.1f}%, "
        f"the mix {mix['turn1_accuracy']:.1f}%, a's adapter {a1:.1f}%; turn 2 routing {routed['turn2_accuracy']:.1f}%, "
        f"the mix {mix['turn2_accuracy']:.1f}%, b's adapter {b2:.1f}%."
    )
    pm, pr = per_skill(mix["hits"], tasks), per_skill(routed["hits"], tasks)
    ahead_mix = [short(s) for s in skills if pm[s] > pr[s]]
    ahead_routed = [short(s) for s in skills if pr[s] > pm[s]]
    if ahead_mix:
        text += f" The mix is ahead on {', '.join(ahead_mix)} replies"
        text += f", routing on {', '.join(ahead_routed)}." if ahead_routed else "."
    elif ahead_routed:
        text += f" Routing is ahead on {', '.join(ahead_routed)} replies."
    single = max(acc["adapter_a"], acc["adapter_b"])
    if p >= 0.05:
        text += (
            " The difference between the mix and routing is within what chance gives on these conversations, so they "
            "do not say that one is better than the other here."
        )
    elif routed_only > mix_only:
        text += (
            " Where each turn belongs to one skill, routing each token to its skill's adapter beats halving both "
            "deltas: half of each adapter answers neither skill as its own adapter does. Here a mix helped only on the "
            f"{mix_only} replies it alone got right; what a mix is meant for (skills no router knows, tokens that need "
            "both adapters at once) these conversations do not test."
        )
    else:
        text += (
            " On these conversations a mix helps: the router's per-token choice misses a turn's skill more often than "
            "half of each delta does; routing stays the choice where each turn needs its own adapter undiluted."
        )
    if max(acc["mix"], acc["routed"]) < single:
        text += (
            f" Neither reaches the better single adapter ({single:.1f}%), which answers only its own turn: on two "
            "skills in one conversation, what one adapter does for its own skill is the bar."
        )
    return text


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--check", action="store_true", help="exit 1 when the block is stale; write nothing")
    a = p.parse_args(argv)
    record = json.loads(RECORD.read_text())
    block = wrap(BEGIN, END, render(record))
    changed = write_block(PAGE, BEGIN, END, block, check=a.check)
    if a.check and changed:
        print(f"{PAGE} is stale: run python -m tools.make_mix_use", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
