"""Held-out evaluation items for a bundle: fixed seeds per split, never a training seed, never a training input.

    items, dropped = held_out("navigate", 100, training_inputs(bundle), split="test")

Splits of the generated skill items (`molora.data.skills.generate`, seeds far from TRAIN_SEED_BASE):

    legacy  EVAL_SEED_BASE + k           the items earlier results reported (carry and probe were tuned on them)
    val     EVAL_SEED_BASE + 500 + k     validation: every setting of routing is chosen here
    test    EVAL_SEED_BASE + 300000 + k  fresh test items, scored once per bundle
    test2   EVAL_SEED_BASE + 600000 + k  a second, larger test split, drawn after the others: its items also leave
                                         out every val and test item at the sizes results were drawn with
                                         (EARLIER_SIZES), so that no item read before is scored again

(k = the task's index in SKILLS; a split that must replace dropped duplicates draws further batches at
+1000 per batch). Mixed (two-skill) items use MIXED_SEEDS. `fingerprint` names a bundle's exact weights.
"""

from __future__ import annotations

import hashlib
from typing import Any

from molora.data.jsonl import read_jsonl
from molora.data.skills import EVAL_SEED_BASE, SKILLS, Item, generate, generate_mixed

SPLIT_SEEDS = {
    "legacy": EVAL_SEED_BASE,
    "val": EVAL_SEED_BASE + 500,
    "test": EVAL_SEED_BASE + 300_000,
    "test2": EVAL_SEED_BASE + 600_000,
}
MIXED_SEEDS = {
    "legacy": EVAL_SEED_BASE + 100,
    "val": EVAL_SEED_BASE + 600,
    "test": EVAL_SEED_BASE + 300_100,
    "test2": EVAL_SEED_BASE + 600_100,
}
FRESH_FROM = {"test2": ("val", "test")}  # a later split -> the earlier splits whose items it leaves out
EARLIER_SIZES = (6, 24, 40, 50, 100, 200)  # items per skill the records of docs/ drew from val and test (a draw's
# items depend on its size: navigate shuffles its labels first)


def fingerprint(bundle: Any) -> str:
    """12 hex digits over the manifest and every weights file of the bundle."""
    h = hashlib.sha256((bundle.folder / "molora.json").read_bytes())
    files = [a.path / "adapter_model.safetensors" for a in bundle.adapters]
    if bundle.router_path is not None:
        files += sorted(bundle.router_path.glob("*"))
    for f in files:
        h.update(f.read_bytes())
    return h.hexdigest()[:12]


def training_inputs(bundle: Any) -> set[str]:
    """Every question text in the bundle's training files (data/*.jsonl): prompts, segments, parts."""
    seen: set[str] = set()
    for path in sorted((bundle.folder / "data").glob("*.jsonl")):
        for row in read_jsonl(path):
            for seg in [row, *row.get("segments", []), *row.get("parts", [])]:
                for key in ("prompt", "input"):
                    if isinstance(seg.get(key), str):
                        seen.add(seg[key])
    return seen


def earlier_inputs(task: str, split: str, banned: set[str]) -> set[str]:
    """The inputs of `task` that the splits before `split` (FRESH_FROM) give at every size of EARLIER_SIZES."""
    return {
        it.input for s in FRESH_FROM.get(split, ()) for m in EARLIER_SIZES for it in held_out(task, m, banned, s)[0]
    }


def held_out(task: str, n: int, banned: set[str], split: str = "test") -> tuple[list[Item], int]:
    """n items of `task` from the split's seed, none in `banned` (nor, for a later split, in the earlier splits:
    `earlier_inputs`); (items, how many were dropped)."""
    if split not in SPLIT_SEEDS:
        raise ValueError(f"unknown split {split!r}; valid splits: {', '.join(SPLIT_SEEDS)}")
    if split in FRESH_FROM:
        banned = banned | earlier_inputs(task, split, banned)
    k = SKILLS.index(task)
    items, dropped, extra = [], 0, 0
    while len(items) < n:
        batch = generate(task, n, seed=SPLIT_SEEDS[split] + k + 1000 * extra)
        have = {it.input for it in items}
        fresh = [it for it in batch if it.input not in banned and it.input not in have]
        dropped += sum(it.input in banned for it in batch) if extra == 0 else 0
        items += fresh[: n - len(items)]
        extra += 1
    return items, dropped


def held_out_mixed(tasks: list[str], n: int, banned: set[str], split: str = "test") -> list[dict]:
    """n two-skill rows {"parts": [...]} from the split's mixed seed, no part in `banned`."""
    rows = generate_mixed(tasks, 2 * n, seed=MIXED_SEEDS[split])
    return [r for r in rows if not any(p["input"] in banned for p in r["parts"])][:n]
