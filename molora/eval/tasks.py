"""Benchmark task files in, scored answers out.

Owns: reading the task files (`load_task("KIND:FILE")` for BBH, GSM8K, MATH, GPQA and our mixed rows)
into `EvalItem`s, which answer kind a task has, scoring a model's reply against a target (strict and
lenient, see `molora.eval.extract`), and the majority-class baseline.  Does not know: prompts, chat
templates, models or generation (the caller turns `EvalItem.input` into a prompt and hands back the
reply).  Pure Python, no torch.

File formats:
- bbh:   JSON {"examples": [{"input", "target"}, ...]} (or JSONL of such objects); task = file stem.
- gsm8k: JSONL {"question", "answer"}; target = text after the last "####", commas removed.
- math:  JSON list / {"examples": [...]} or JSONL of {"problem", "solution"[, "answer"]}; target = "answer"
         if present, else the last \\boxed{...} of the solution, normalized (`extract.normalize_math`).
- gpqa:  CSV with "Question", "Correct Answer", "Incorrect Answer 1..3"; the four choices are shuffled
         by a seed taken from a hash of the question (stable across runs and machines); input is
         "<question>\\nOptions:\\n(A) ...\\n(B) ...\\n(C) ...\\n(D) ...", target the letter ("C").
- mixed: JSONL {"parts": [{"task", "input", "target"}, ...]}; items have task "mixed", input and target
         rendered by `molora.data.mixed.render_mixed`, and `parts` holding one EvalItem per part.
"""

from __future__ import annotations

import csv
import hashlib
import json
import random
import re
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from molora.data.jsonl import read_jsonl
from molora.data.mixed import render_mixed, split_answers
from molora.errors import MoLoRAError
from molora.eval.extract import (
    LABEL_SETS,
    canonical_target,
    last_boxed,
    lenient_answer,
    normalize_math,
    strict_answer,
)

LOADERS = ("bbh", "gsm8k", "math", "gpqa", "mixed")
_TASK_KINDS = {
    "object_counting": "int",
    "multistep_arithmetic_two": "int",
    "navigate": "label",
    "dyck_languages": "dyck",
    "word_sorting": "words",
    "gsm8k": "number",
    "math": "math",
    "gpqa": "choice",
}
_OPTION_LINE = re.compile(r"(?m)^\(([A-R])\)\s*(.*?)\s*$")


class TaskError(MoLoRAError, ValueError):
    """A task spec or task file is malformed."""


@dataclass(frozen=True)
class EvalItem:
    """One question.  `choices` are the option texts in (A), (B), ... order where the loader knows them;
    `parts` are the sub-items of a mixed item (task "mixed"), None otherwise."""

    task: str
    input: str
    target: str
    choices: tuple[str, ...] | None = None
    parts: tuple[EvalItem, ...] | None = None


# --------------------------------------------------------------------------- loading


def load_task(spec: str) -> tuple[str, list[EvalItem]]:
    """("task name", items) from "KIND:FILE", KIND one of bbh, gsm8k, math, gpqa, mixed."""
    kind, sep, file = spec.partition(":")
    if not sep or kind not in LOADERS or not file:
        raise TaskError(f"bad task spec {spec!r}: want KIND:FILE with KIND one of {', '.join(LOADERS)}")
    path = Path(file)
    if not path.is_file():
        raise TaskError(f"task file {path} (from {spec!r}) does not exist")
    loader = {"bbh": _load_bbh, "gsm8k": _load_gsm8k, "math": _load_math, "gpqa": _load_gpqa, "mixed": _load_mixed}
    name, items = loader[kind](path)
    if not items:
        raise TaskError(f"task file {path} holds no items")
    return name, items


def _read_text(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise TaskError(f"cannot read task file {path}: {e}") from e


def _json_rows(path: Path) -> list[dict]:
    """Rows of a JSON file (a list, or an object with "examples") or of a JSONL file."""
    text = _read_text(path)
    try:
        if path.suffix == ".jsonl":
            return read_jsonl(path, error=TaskError)
        data = json.loads(text)
    except json.JSONDecodeError as e:
        raise TaskError(f"{path} is not valid JSON{' lines' if path.suffix == '.jsonl' else ''}: {e}") from e
    rows = data.get("examples") if isinstance(data, dict) else data
    if not isinstance(rows, list):
        raise TaskError(f'{path}: want a list of examples or {{"examples": [...]}}, got {type(data).__name__}')
    return rows


def _field(row: Mapping, key: str, path: Path, i: int) -> str:
    if not isinstance(row, Mapping) or key not in row:
        have = sorted(row) if isinstance(row, Mapping) else type(row).__name__
        raise TaskError(f"{path}: example {i} lacks {key!r} (has {have})")
    return str(row[key])


def _load_bbh(path: Path) -> tuple[str, list[EvalItem]]:
    task = path.stem
    rows = _json_rows(path)
    return task, [EvalItem(task, _field(r, "input", path, i), _field(r, "target", path, i)) for i, r in enumerate(rows)]


def gsm8k_target(answer: str) -> str:
    """The final answer of a GSM8K solution: the text after the last '####', commas removed."""
    return answer.split("####")[-1].strip().replace(",", "")


def _load_gsm8k(path: Path) -> tuple[str, list[EvalItem]]:
    rows = _json_rows(path)
    items = []
    for i, r in enumerate(rows):
        answer = _field(r, "answer", path, i)
        if "####" not in answer:
            raise TaskError(f"{path}: example {i} answer has no '####' final answer")
        items.append(EvalItem("gsm8k", _field(r, "question", path, i), gsm8k_target(answer)))
    return "gsm8k", items


def _load_math(path: Path) -> tuple[str, list[EvalItem]]:
    items = []
    for i, r in enumerate(_json_rows(path)):
        answer = r.get("answer") if isinstance(r, Mapping) else None
        if answer is None:
            answer = last_boxed(_field(r, "solution", path, i))
            if answer is None:
                raise TaskError(f"{path}: example {i} solution has no \\boxed{{...}} answer")
        items.append(EvalItem("math", _field(r, "problem", path, i), normalize_math(str(answer))))
    return "math", items


def gpqa_item(question: str, correct: str, incorrect: Sequence[str]) -> EvalItem:
    """A GPQA item with its choices shuffled by a seed from the question's hash."""
    seed = int.from_bytes(hashlib.sha256(question.encode("utf-8")).digest()[:8], "big")
    choices = [correct.strip(), *(c.strip() for c in incorrect)]
    random.Random(seed).shuffle(choices)
    letters = "ABCDEFGH"[: len(choices)]
    options = "\n".join(f"({letter}) {choice}" for letter, choice in zip(letters, choices))
    target = letters[choices.index(correct.strip())]
    return EvalItem("gpqa", f"{question.strip()}\nOptions:\n{options}", target, tuple(choices))


def _load_gpqa(path: Path) -> tuple[str, list[EvalItem]]:
    columns = ["Question", "Correct Answer", "Incorrect Answer 1", "Incorrect Answer 2", "Incorrect Answer 3"]
    rows = list(csv.DictReader(_read_text(path).splitlines(keepends=True)))
    if rows and not set(columns) <= set(rows[0]):
        raise TaskError(f"{path}: GPQA CSV needs columns {columns}; has {sorted(rows[0])}")
    return "gpqa", [gpqa_item(r["Question"], r["Correct Answer"], [r[c] for c in columns[2:]]) for r in rows]


def mixed_item(parts: Sequence[Mapping[str, str]]) -> EvalItem:
    """An EvalItem of task "mixed" from parts {"task", "input", "target"}."""
    text = render_mixed(parts)
    sub = tuple(EvalItem(str(p["task"]), str(p["input"]), str(p["target"])) for p in parts)
    return EvalItem("mixed", text.prompt, text.target, parts=sub)


def _load_mixed(path: Path) -> tuple[str, list[EvalItem]]:
    items = []
    for i, r in enumerate(_json_rows(path)):
        parts = r.get("parts") if isinstance(r, Mapping) else None
        if not isinstance(parts, list) or not parts:
            raise TaskError(f"{path}: row {i} needs a non-empty 'parts' list")
        for p in parts:
            for key in ("task", "input", "target"):
                _field(p, key, path, i)
        items.append(mixed_item(parts))
    return "mixed", items


# --------------------------------------------------------------------------- scoring


def answer_kind(task: str, target: str) -> str:
    """The answer kind of a task (see `extract.KINDS`): known tasks by name, other BBH tasks by target shape."""
    name = task.removeprefix("bbh_").removeprefix("bbh-")
    if name in _TASK_KINDS:
        return _TASK_KINDS[name]
    t = target.strip()
    if re.fullmatch(r"\([A-R]\)", t):
        return "choice"
    if any(t.lower() in s for s in LABEL_SETS):
        return "label"
    if re.fullmatch(r"-?\d+", t):
        return "int"
    return "text"


def options_in(text: str) -> dict[str, str]:
    """{"A": "option text", ...} from lines "(A) option text" of a question."""
    return {m.group(1): m.group(2) for m in _OPTION_LINE.finditer(text)}


def score(task: str, prediction: str, target: str, *, options: Mapping[str, str] | None = None) -> tuple[bool, bool]:
    """(strict, lenient) correctness of a reply; lenient is never below strict.

    `options` ({"A": text, ...}) lets a multiple-choice reply name the option text instead of its letter.
    """
    kind = answer_kind(task, target)
    want = canonical_target(kind, target)
    strict = strict_answer(kind, prediction, target, options) == want
    lenient = strict or lenient_answer(kind, prediction, target, options) == want
    return strict, lenient


def score_parts(item: EvalItem, prediction: str) -> list[tuple[bool, bool]]:
    """(strict, lenient) for each part of a mixed item, from the reply cut by `split_answers`."""
    if item.parts is None:
        raise ValueError(f"item of task {item.task!r} has no parts")
    answers = split_answers(prediction, len(item.parts))
    return [score_item(part, answer) for part, answer in zip(item.parts, answers)]


def score_item(item: EvalItem, prediction: str) -> tuple[bool, bool]:
    """score() for an item, with its options; a mixed item counts only if every part does."""
    if item.parts is not None:
        results = score_parts(item, prediction)
        return all(s for s, _ in results), all(l for _, l in results)
    if item.choices is not None:
        options = dict(zip("ABCDEFGHIJKLMNOPQR", item.choices))
    else:
        options = options_in(item.input)
    return score(item.task, prediction, item.target, options=options or None)


def majority_baseline(items: Sequence[EvalItem]) -> float:
    """Percent of items whose target is the most common target."""
    if not items:
        raise ValueError("majority_baseline of no items")
    return 100.0 * Counter(it.target for it in items).most_common(1)[0][1] / len(items)
