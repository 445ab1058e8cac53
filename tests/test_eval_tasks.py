"""molora.eval.tasks / molora.eval.extract: loaders read each format, scoring reads typical replies."""

from __future__ import annotations

import csv
import json
import os
from pathlib import Path

import pytest

from molora.data import generate, generate_mixed, write_bbh_file, write_jsonl
from molora.eval.extract import last_boxed, normalize_math
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


def _shared() -> Path:
    here = Path(__file__).resolve()
    for candidate in (os.environ.get("MOLORA_SHARED"), here.parents[2] / "shared", "/work/shared"):
        if candidate and (Path(candidate) / "data" / "gsm8k" / "test.jsonl").is_file():
            return Path(candidate)
    pytest.skip("shared/data/gsm8k is not here")


# ----------------------------------------------------------------- scoring typical replies


@pytest.mark.parametrize(
    "task, prediction, target, expected",
    [
        ("object_counting", "12", "12", (True, True)),
        ("object_counting", " 12.\n\nQ: next question", "12", (True, True)),
        ("object_counting", "There are 12 fruits.", "12", (False, True)),
        ("object_counting", "You have twelve fruits.", "12", (False, True)),
        ("object_counting", "The answer is 12.", "12", (True, True)),
        ("object_counting", "13", "12", (False, False)),
        ("multistep_arithmetic_two", "-24", "-24", (True, True)),
        ("multistep_arithmetic_two", "24", "-24", (False, False)),
        ("multistep_arithmetic_two", "So the result is -24.", "-24", (False, True)),
        ("navigate", "Yes", "Yes", (True, True)),
        ("navigate", "The answer is No.", "No", (True, True)),
        ("navigate", "No, you end up 3 steps away.", "No", (False, True)),
        ("navigate", "Yes", "No", (False, False)),
        ("dyck_languages", "] } )", "] } )", (True, True)),
        ("dyck_languages", "]})", "] } )", (True, True)),
        ("dyck_languages", "To close it: ] } )\nDone", "] } )", (False, True)),
        ("dyck_languages", "] }", "] } )", (False, False)),
        ("word_sorting", "apple banana cherry", "apple banana cherry", (True, True)),
        ("word_sorting", "Sorted: apple, banana, cherry.", "apple banana cherry", (False, True)),
        ("word_sorting", "banana apple cherry", "apple banana cherry", (False, False)),
        ("gsm8k", "9 * 2 = 18 dollars.\n#### 18", "18", (True, True)),
        ("gsm8k", "So she earns $1,234.00.\nThe answer is 1,234.", "1234", (True, True)),
        ("gsm8k", "First 5, then 7 more: 12 in all", "12", (True, True)),
        ("gsm8k", "It is 12.\nI hope that helps, 3 times over", "12", (False, False)),
        ("math", "Thus $x = \\boxed{\\frac{1}{2}}$.", "\\dfrac12", (True, True)),
        ("math", "\\boxed{0.5}", "\\frac{1}{2}", (True, True)),
        ("math", "The answer is $\\frac12$.", "\\frac{1}{2}", (False, True)),
        ("math", "\\boxed{\\frac{1}{3}}", "\\frac{1}{2}", (False, False)),
        ("gpqa", "(B)", "B", (True, True)),
        ("gpqa", "B. Because ...", "B", (True, True)),
        ("gpqa", "I would pick (B) here", "B", (False, True)),
        ("date_understanding", "(A)", "(A)", (True, True)),
        ("date_understanding", "The answer is (C).", "(A)", (False, False)),
        ("boolean_expressions", "True", "True", (True, True)),
        ("sports_understanding", "Yes, it is plausible.", "yes", (False, True)),
        ("formal_fallacies", "invalid", "valid", (False, False)),
    ],
)
def test_score_typical_replies(task, prediction, target, expected):
    assert score(task, prediction, target) == expected


def test_multiple_choice_accepts_the_option_text():
    item = EvalItem("date_understanding", "When?\nOptions:\n(A) 01/02/2003\n(B) 02/02/2003", "(B)")
    assert score_item(item, "02/02/2003") == (True, True)
    assert score_item(item, "It must be 02/02/2003 I think") == (False, True)
    assert score_item(item, "01/02/2003") == (False, False)


def test_answer_kind_by_name_then_by_target_shape():
    assert answer_kind("dyck_languages", "]") == "dyck"
    assert answer_kind("bbh_word_sorting", "a b") == "words"
    assert answer_kind("logical_deduction_five_objects", "(C)") == "choice"
    assert answer_kind("web_of_lies", "No") == "label"
    assert answer_kind("some_task", "42") == "int"
    assert answer_kind("some_task", "a sentence") == "text"


@pytest.mark.parametrize(
    "raw, normal",
    [
        ("\\dfrac12", "\\frac{1}{2}"),
        ("\\tfrac{3}{4}", "\\frac{3}{4}"),
        ("\\left( 3, \\frac{\\pi}{2} \\right)", "(3,\\frac{\\pi}{2})"),
        ("10\\text{ cm}", "10"),
        ("\\text{Evelyn}", "Evelyn"),
        ("x = 5", "5"),
        ("90^\\circ", "90"),
        ("\\$18.", "18"),
        ("50\\%", "50"),
        ("3/4", "\\frac{3}{4}"),
        ("\\sqrt3", "\\sqrt{3}"),
        (".75", "0.75"),
        ("0.5", "\\frac{1}{2}"),
    ],
)
def test_normalize_math(raw, normal):
    assert normalize_math(raw) == normal
    assert normalize_math(normal) == normal


def test_last_boxed_balances_braces():
    assert last_boxed("a \\boxed{1} then \\boxed{\\frac{a}{b^{2}}} end") == "\\frac{a}{b^{2}}"
    assert last_boxed("\\boxed 7.") == "7."
    assert last_boxed("no box") is None


# ----------------------------------------------------------------- loaders


def test_gsm8k_loader_on_the_real_file():
    path = _shared() / "data" / "gsm8k" / "test.jsonl"
    name, items = load_task(f"gsm8k:{path}")
    assert name == "gsm8k" and len(items) == 1319
    assert items[0].target == "18" and items[0].input.startswith("Janet")
    assert all(it.target.lstrip("-").isdigit() for it in items)  # commas gone, integers
    reference = [json.loads(line)["answer"] for line in path.read_text().splitlines()[:50]]
    assert all(score_item(it, ans) == (True, True) for it, ans in zip(items, reference))


def test_bbh_loader_round_trip(tmp_path: Path):
    items = generate("navigate", 10, 5)
    write_bbh_file(tmp_path / "navigate.json", items)
    name, loaded = load_task(f"bbh:{tmp_path / 'navigate.json'}")
    assert name == "navigate"
    assert [(e.task, e.input, e.target) for e in loaded] == [(i.task, i.input, i.target) for i in items]
    assert majority_baseline(loaded) == 50.0


def test_math_loader_uses_answer_or_last_boxed(tmp_path: Path):
    rows = [
        {"problem": "p1", "solution": "so \\boxed{2} wait \\boxed{\\dfrac{1}{2}}"},
        {"problem": "p2", "solution": "\\boxed{9}", "answer": "10\\text{ cm}"},
    ]
    write_jsonl(tmp_path / "math.jsonl", rows)
    name, items = load_task(f"math:{tmp_path / 'math.jsonl'}")
    assert name == "math" and [it.target for it in items] == ["\\frac{1}{2}", "10"]
    (tmp_path / "math.json").write_text(json.dumps(rows))
    assert load_task(f"math:{tmp_path / 'math.json'}")[1] == items


def test_gpqa_loader_shuffles_stably(tmp_path: Path):
    header = ["Question", "Correct Answer", "Incorrect Answer 1", "Incorrect Answer 2", "Incorrect Answer 3", "X"]
    with (tmp_path / "gpqa.csv").open("w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(header)
        for i in range(20):
            writer.writerow([f"Question {i}?\nWith two lines", f"right {i}", "w1", "w2", f"w3, {i}", ""])
    name, items = load_task(f"gpqa:{tmp_path / 'gpqa.csv'}")
    assert name == "gpqa" and len(items) == 20
    assert load_task(f"gpqa:{tmp_path / 'gpqa.csv'}")[1] == items
    letters = set()
    for i, it in enumerate(items):
        assert it.choices is not None and sorted(it.choices) == sorted([f"right {i}", "w1", "w2", f"w3, {i}"])
        assert it.choices["ABCD".index(it.target)] == f"right {i}"
        assert f"\nOptions:\n(A) {it.choices[0]}\n(B) " in it.input
        assert score_item(it, f"({it.target})") == (True, True)
        assert score_item(it, f"right {i}") == (True, True)
        letters.add(it.target)
    assert len(letters) > 1  # the correct answer is not always first


def test_mixed_loader_and_scoring(tmp_path: Path):
    write_jsonl(tmp_path / "mixed.jsonl", generate_mixed(["navigate", "dyck_languages", "object_counting"], 6, 2))
    name, items = load_task(f"mixed:{tmp_path / 'mixed.jsonl'}")
    assert name == "mixed" and len(items) == 6
    for it in items:
        assert it.task == "mixed" and it.parts is not None and len(it.parts) == 2
        assert all(p.input in it.input for p in it.parts)
        assert score_item(it, it.target) == (True, True)
        wrong = f"Answer 1: {it.parts[0].target}\nAnswer 2: nothing"
        assert score_parts(it, wrong)[0] == (True, True) and score_item(it, wrong) == (False, False)


def test_bad_specs_and_files_name_the_problem(tmp_path: Path):
    with pytest.raises(TaskError, match="KIND:FILE"):
        load_task("object_counting.json")
    with pytest.raises(TaskError, match="KIND:FILE"):
        load_task("mmlu:x.json")
    with pytest.raises(TaskError, match="does not exist"):
        load_task(f"bbh:{tmp_path / 'missing.json'}")
    (tmp_path / "bad.json").write_text('{"examples": [{"input": "q"}]}')
    with pytest.raises(TaskError, match="lacks 'target'"):
        load_task(f"bbh:{tmp_path / 'bad.json'}")
    (tmp_path / "g.csv").write_text("Question,Answer\nq,a\n")
    with pytest.raises(TaskError, match="Correct Answer"):
        load_task(f"gpqa:{tmp_path / 'g.csv'}")
    with pytest.raises(ValueError):
        majority_baseline([])
