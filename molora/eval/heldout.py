"""Held-out evaluation items for a bundle: fixed seeds per split, never a training seed, never a training input.

    items, dropped = held_out("navigate", 100, training_inputs(bundle), split="test")

Splits of the generated skill items (`molora.data.skills.generate`, seeds far from TRAIN_SEED_BASE):

    legacy  EVAL_SEED_BASE + k           the items earlier results reported (carry and probe were tuned on them)
    val     EVAL_SEED_BASE + 500 + k     validation: every setting of routing is chosen here
    test    EVAL_SEED_BASE + 300000 + k  fresh test items, scored once per bundle

(k = the task's index in SKILLS; a split that must replace dropped duplicates draws further batches at
+1000 per batch). Mixed (two-skill) items use MIXED_SEEDS. `fingerprint` names a bundle's exact weights.
"""

from __future__ import annotations

import hashlib
from typing import Any

from molora.data.jsonl import read_jsonl
from molora.data.skills import EVAL_SEED_BASE, SKILLS, Item, generate, generate_mixed

SPLIT_SEEDS = {"legacy": EVAL_SEED_BASE, "val": EVAL_SEED_BASE + 500, "test": EVAL_SEED_BASE + 300_000}
MIXED_SEEDS = {"legacy": EVAL_SEED_BASE + 100, "val": EVAL_SEED_BASE + 600, "test": EVAL_SEED_BASE + 300_100}


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


def held_out(task: str, n: int, banned: set[str], split: str = "test") -> tuple[list[Item], int]:
    """n items of `task` from the split's seed, none in `banned`; (items, how many were dropped)."""
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
