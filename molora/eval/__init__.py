"""Benchmark evaluation: task files, answer extraction and scoring (pure Python, no torch)."""

from molora.eval.tasks import (
    EvalItem,
    TaskError,
    answer_kind,
    load_task,
    majority_baseline,
    score,
    score_item,
    score_parts,
)

__all__ = [
    "EvalItem",
    "TaskError",
    "answer_kind",
    "load_task",
    "majority_baseline",
    "score",
    "score_item",
    "score_parts",
]
