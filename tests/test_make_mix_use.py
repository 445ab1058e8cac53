"""The two-skill block of docs/serving.md (a mix against routing) is rendered from its committed record, says what
the record's hits say, and is up to date."""

from __future__ import annotations

import json

from tests.conftest import load_script


def _record(mix_hits: list[str], routed_hits: list[str]) -> dict:
    other = {"joiner": "plain", "max_new_tokens": 32, "part_accuracy": 0.0, "both_right": 0.0, "hits": ["00", "00"]}

    def res(hits):
        parts = [h for row in hits for h in row]
        acc = 100.0 * parts.count("1") / len(parts)
        return {**other, "hits": hits, "part_accuracy": acc, "both_right": 100.0 * hits.count("11") / len(hits)}

    return {
        "command": "python -m experiments.mix_use",
        "machine_info": {"threads": 2, "cpu": "CPU"},
        "skills": ["object_counting", "navigate"],
        "joiners": ["numbered", "plain"],
        "budgets": [32, 64],
        "validation": {"n": 2},
        "test": {
            "n": 2,
            "tasks": [["object_counting", "navigate"], ["navigate", "object_counting"]],
            "results": {"mix": res(mix_hits), "routed": res(routed_hits)}
            | {r: dict(other) for r in ("adapter_a", "adapter_b", "base")},
        },
    }


def test_the_block_counts_the_paired_parts_and_names_who_is_ahead_per_skill():
    make = load_script("make_mix_use")
    rec = _record(["11", "01"], ["10", "00"])  # the mix: counting 2/2, navigate 1/2; routing: counting 1/2
    text = make.render(rec, rec["test"]["tasks"])
    assert "2 were right only with the mix and 0 only with routing (two-sided sign test p = 0.50)" in text
    assert "the mix is ahead overall (75.0% against 25.0%" in text and "within what chance gives" in text
    assert make.sign_test(10, 0) < 0.01 and make.sign_test(3, 3) == 1.0
    assert "| 100 | 50 |" in text  # the mix's per-skill cells: counting, navigate
    flipped = _record(["10", "00"], ["11", "01"])
    assert "per-token routing is ahead overall" in make.render(flipped, flipped["test"]["tasks"])


def test_serving_md_block_is_current():
    make = load_script("make_mix_use")
    record = json.loads(make.RECORD.read_text())
    assert record["test"]["results"].keys() == make.LABELS.keys()
    assert make.main(["--check"]) == 0
