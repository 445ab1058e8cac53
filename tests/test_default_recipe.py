"""The default recipe's training files (no model: write_data with the base model's answers given)."""

from __future__ import annotations

import json
from dataclasses import replace

from molora.data.general import general_split
from molora.train.default import DefaultRecipe, general_prompts, write_data


def _rows(path):
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def test_router_data_adds_each_skills_shortest_questions(tmp_path):
    recipe = replace(
        DefaultRecipe(), n_train=4, n_router=3, n_mixed=2, n_topic=2, n_general_mixed=2, router_short=(("counting", 5),)
    )
    answers = {p["id"]: "fine." for p in general_prompts(recipe, general_split())}
    paths = write_data(tmp_path, recipe, answers)
    single = [r["segments"][0] for r in _rows(paths["router"]) if len(r["segments"]) == 1]
    by_label: dict = {}
    for seg in single:
        by_label.setdefault(seg["label"], []).append(seg["prompt"])
    assert {k: len(v) for k, v in by_label.items() if k} == {
        "counting": 3 + 5,
        "arithmetic": 3,
        "dyck": 3,
        "navigate": 3,
    }
    lengths = sorted(len(p) for p in by_label["counting"])
    assert lengths[4] < 90  # five questions of two or three listed items
    assert all(s["completion"] for s in single if s["label"] == "counting")
    plain = write_data(tmp_path / "plain", replace(recipe, router_short=()), answers)
    assert len(_rows(paths["router"])) == len(_rows(plain["router"])) + 5
