"""experiments/arith_ops.py: every written step is read, scored against true arithmetic, and replayed against the
question, so a wrong copy and a wrong sum are told apart. Hand-written answers; no model runs here."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from tests.conftest import load_script

ROOT = Path(__file__).resolve().parent.parent
Q = "((-1 + 2 * 3 - 4) * (5 - -6)) ="
RIGHT = (
    "(-1 + 2 * 3 - 4): 2 * 3 = 6; -1 + 6 = 5; 5 - 4 = 1. (5 - -6): 5 - -6 = 5 + 6 = 11. "
    "1 * 11 = 11. So the answer is 11."
)


@pytest.fixture(scope="module")
def ops():
    return load_script("arith_ops")


def test_a_right_answer_parses_into_every_step_all_right(ops):
    steps, first = ops.check_item(Q, RIGHT)
    assert [(s.a, s.op, s.b, s.c, s.where) for s in steps] == [
        (2, "*", 3, 6, "group"),
        (-1, "+", 6, 5, "group"),
        (5, "-", 4, 1, "group"),
        (5, "-", -6, 11, "group"),
        (1, "*", 11, 11, "final"),
    ]
    assert first is None
    assert all(s.ok and s.operands_ok and s.rewrites_ok for s in steps)


def test_a_wrong_sum_is_a_compute_error_and_later_steps_use_the_models_value(ops):
    wrong = RIGHT.replace("-1 + 6 = 5; 5 - 4 = 1", "-1 + 6 = 7; 7 - 4 = 3").replace(
        "1 * 11 = 11. So the answer is 11", "3 * 11 = 33. So the answer is 33"
    )
    steps, first = ops.check_item(Q, wrong)
    assert first == "compute"
    assert [s.ok for s in steps] == [True, False, True, True, True]
    assert all(s.operands_ok for s in steps)  # 7 - 4 and 3 * 11 carry the model's own values


def test_a_wrong_operand_is_a_copy_error(ops):
    steps, first = ops.check_item(Q, RIGHT.replace("-1 + 6 = 5; 5 - 4 = 1", "1 + 6 = 7; 7 - 4 = 3"))
    assert first == "copy_operand"
    assert steps[1].ok and steps[1].operands_ok is False
    assert steps[2].operands_ok is None  # alignment lost: not judged


def test_rewrites_are_checked_and_buckets_name_signs_and_digits(ops):
    s = ops.parse_step("-23 * 7 = -(20*7 + 3*7) = -(140 + 22) = -161", "group")
    assert s.ok and not s.rewrites_ok
    assert ops.buckets(s)["by_op_signs"] == "neg * pos"
    assert ops.buckets(s)["by_op_digits"] == "2d * 1d"
    assert ops.buckets(ops.parse_step("5 - -6 = 5 + 6 = 11", "group"))["by_op_signs"] == "pos - neg"
    assert ops.parse_step("so we get 11", "group") is None


def test_truncated_and_unparsed_answers_are_reported(ops):
    assert ops.check_item(Q, RIGHT.split(" So the answer")[0])[1] == "no_answer"
    assert ops.check_item(Q, "The answer is 11.")[1] == "unparsed"
    assert ops.check_item(Q, RIGHT.replace("answer is 11", "answer is 12"))[1] == "answer_line"
    summary = ops.report([{"input": Q, "prediction": RIGHT, "correct": True}])
    assert summary["items"]["accuracy"] == 1.0 and summary["steps"]["n"] == 5
    assert summary["by_op"]["*"] == {"n": 2, "correct": 2, "accuracy": 1.0}


def test_every_worked_solution_reads_back_with_every_step_and_rewrite_right(ops):
    from molora.data.skills import generate
    from molora.data.solutions import worked_solution

    for it in generate("multistep_arithmetic_two", 300, seed=5):
        steps, first = ops.check_item(it.input, worked_solution("multistep_arithmetic_two", it.input, it.target))
        assert first is None, it.input
        assert len(steps) == 7 and all(s.ok and s.rewrites_ok and s.operands_ok for s in steps), it.input


def test_the_results_section_sets_each_bucket_beside_the_record_it_was_compared_with(ops, tmp_path):
    rows = [{"input": Q, "prediction": RIGHT, "correct": True}]
    before = ops.report([{"input": Q, "prediction": RIGHT.replace("5 - 4 = 1", "5 - 4 = 2"), "correct": False}])
    (tmp_path / "before.json").write_text(__import__("json").dumps(before))
    after = {"compared_with": "before.json", "adapter": "the new one", **ops.report(rows)}
    text = "\n".join(ops.render_section(after, docs=tmp_path))
    assert "| items right | 0% (1) | 100% (1) |" in text
    assert "| position: group - | 50% (2) | 100% (2) |" in text
    assert "| op signs: neg - neg | - | - |" in text  # a bucket neither answer has


def test_the_results_page_loads_the_section_from_its_record(ops, tmp_path):
    results = load_script("make_results")
    sys.modules.pop("arith_ops", None)  # as in a fresh process: the page must register the script itself
    after = ops.report([{"input": Q, "prediction": RIGHT, "correct": True}])  # compared with nothing
    (tmp_path / "arith_ops_val_after.json").write_text(__import__("json").dumps(after))
    text = "\n".join(results.extra_sections(tmp_path))
    assert "## Arithmetic, per operation" in text and "| items right | - | 100% (1) |" in text
