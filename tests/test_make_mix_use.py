"""The two-skill block of docs/serving.md (a mix against routing over two-turn conversations) is rendered from its
committed record, says what the record's hits say, and is up to date."""

from __future__ import annotations

import json

from tests.conftest import load_script

TASKS = [["object_counting", "navigate"], ["navigate", "object_counting"]]


def _record(mix_hits: list[str], routed_hits: list[str], asked: int = 2) -> dict:
    def res(hits):
        n = len(hits)
        return {
            "turn1_accuracy": 100.0 * sum(h[0] == "1" for h in hits) / n,
            "turn2_accuracy": 100.0 * sum(h[1] == "1" for h in hits) / n,
            "both_right": 100.0 * hits.count("11") / n,
            "hits": hits,
            "cut_by_budget": [0, 1],
            "mean_tokens": [10.0, 20.0],
        }

    return {
        "command": "python -m experiments.mix_use --test 2",
        "machine_info": {"threads": 2, "cpu": "CPU"},
        "skills": ["object_counting", "multistep_arithmetic_two", "navigate"],
        "test": {
            "n": 2,
            "asked": asked,
            "tasks": TASKS,
            "budgets": [[224, 320], [320, 224]],
            "results": {"mix": res(mix_hits), "routed": res(routed_hits)}
            | {r: res(["10", "00"]) for r in ("adapter_a", "adapter_b", "base")},
        },
    }


def test_the_block_counts_the_paired_replies_per_turn_and_names_who_is_ahead_per_skill():
    make = load_script("make_mix_use")
    # the mix: row 1 both right (counting, navigate), row 2 turn 2 right (counting); routing: row 1 turn 1 only
    text = make.render(_record(["11", "01"], ["10", "00"]))
    assert "2 were right only with the mix and 0 only with routing (two-sided sign test p = 0.5; " in text
    assert "turn 1: 0 against 0, turn 2: 2 against 0): the mix is ahead (75.0% against 25.0%" in text
    assert "within what chance gives" in text
    assert "| 50.0 | 100.0 | 50.0 | 100 | 50 | 1 |" in text  # mix: turn 1, turn 2, both, counting, navigate, cut
    assert "| counting → navigate | 1/1 | 0/1 | 0/1 | 0/1 | 0/1 |" in text  # both right, per ordered pair
    assert "arithmetic" not in text.split("\n")[2]  # a skill no row asked is no column
    assert "counting 224, navigate 320 new tokens" in text and "no validation split was needed" in text
    flipped = make.render(_record(["10", "00"], ["11", "01"]))
    assert "per-token routing is ahead" in flipped
    assert "the first 2 of the 30 asked for" in make.render(_record(["10", "00"], ["11", "01"], asked=30))


def test_sign_test_and_discordant_counts():
    make = load_script("make_mix_use")
    assert make.sign_test(10, 0) < 0.01 and make.sign_test(3, 3) == 1.0 and make.sign_test(0, 0) == 1.0
    assert make.discordant(["10", "01"], ["11", "00"]) == (1, 1)
    assert make.discordant(["10", "01"], ["11", "00"], (0,)) == (0, 0)


def test_serving_md_block_is_current():
    make = load_script("make_mix_use")
    record = json.loads(make.RECORD.read_text())
    assert record["test"]["results"].keys() == make.LABELS.keys()
    assert make.main(["--check"]) == 0
