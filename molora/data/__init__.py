"""Generated training and evaluation data: BBH-style skill items and mixed (multi-skill) requests.

Pure Python (no torch): used by both `molora.train` and `molora.eval`.
"""

from molora.data.jsonl import iter_jsonl, read_jsonl, write_jsonl
from molora.data.mixed import MixedText, render_mixed, split_answers
from molora.data.skills import (
    EVAL_SEED_BASE,
    SKILLS,
    TRAIN_SEED_BASE,
    Item,
    dedupe_against,
    generate,
    generate_mixed,
    write_bbh_file,
)

__all__ = [
    "EVAL_SEED_BASE",
    "SKILLS",
    "TRAIN_SEED_BASE",
    "Item",
    "MixedText",
    "dedupe_against",
    "generate",
    "generate_mixed",
    "iter_jsonl",
    "read_jsonl",
    "render_mixed",
    "split_answers",
    "write_bbh_file",
    "write_jsonl",
]
