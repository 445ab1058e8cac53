"""experiments/arrow_variants_choose.py: the served preset is the validation choice; the decision rules and the
labelled ceiling on hand-made scores (no model runs here)."""

from __future__ import annotations

import json

import pytest
import torch

from molora.routing import ArrowConfig
from molora.userbundle import ARROW_ROUTER
from tests.conftest import ROOT, load_script


@pytest.fixture(scope="module")
def av():
    return load_script("arrow_variants_choose")


def test_router_arrow_preset_serves_the_setting_chosen_on_validation(av):
    rec = json.loads((ROOT / "docs" / "arrow_variants_choice.json").read_text())
    served = av.served_config(rec)
    preset = {k: v for k, v in ARROW_ROUTER.items() if k != "kind"}
    # the preset leaves source_block at its default, 5/6 of the depth: the chosen block
    assert ArrowConfig(**preset).source_block is None and rec["chosen"]["block"] == (5 * rec["num_blocks"]) // 6
    assert preset == {k: v for k, v in served.items() if k != "source_block"}
    ArrowConfig(**served)  # a valid config


def test_served_config_refuses_a_setting_the_router_cannot_serve(av):
    chosen = {"variant": "gks_mean", "calibration": "self_instruct", "rule": "global", "score": "share@2.0"}
    with pytest.raises(SystemExit, match="not one ArrowRouter serves"):
        av.served_config({"chosen": {**chosen, "value": 0.2, "window": None, "block": 25}, "num_blocks": 30})


def test_destinations_global_and_calibrated_rules(av):
    S = torch.tensor([[0.30, 0.10], [0.05, 0.12], [0.0, 0.0], [0.2, 0.2]])  # [P, K] prompt scores
    # global on shares: the claimed share summed over adapters must reach the limit; a tie goes to adapter 0
    assert av.destinations(S, "global", torch.full((2,), 0.2), total=True) == [0, -1, -1, 0]
    assert av.destinations(S, "global", torch.full((2,), 0.15), total=True) == [0, 1, -1, 0]
    # calibrated: the top score must exceed its own adapter's limit
    assert av.destinations(S, "calibrated", torch.tensor([0.25, 0.1]), total=False) == [0, 1, -1, -1]


def test_oracle_bound_fits_per_adapter_thresholds_within_the_general_budget(av):
    labels = ["a", "a", "b", "b", "general", "general"]
    own = {"a": 0, "b": 1}
    # a's prompts score 0.5 and 0.2 on adapter 0; a general prompt scores 0.3 there; b's 0.4 and 0.6 on adapter 1
    S = torch.tensor([[0.5, 0.0], [0.2, 0.0], [0.0, 0.4], [0.0, 0.6], [0.3, 0.0], [0.0, 0.1]])
    none = av.oracle_bound(labels, S, ["a", "b"], own, budget=0)
    assert none == {"a": 50.0, "b": 100.0, "skills_mean": 75.0}  # 0.2 would take the general 0.3
    one = av.oracle_bound(labels, S, ["a", "b"], own, budget=1)
    assert one == {"a": 100.0, "b": 100.0, "skills_mean": 100.0}


def _pair(task, first, arrow_s, own_s, arrow_tokens, own_tokens):
    return {
        "task": task,
        "repeat": 0,
        "first": first,
        "arrow_s": arrow_s,
        "own_s": own_s,
        "arrow_tokens": arrow_tokens,
        "own_tokens": own_tokens,
        "time_ratio": round(arrow_s / own_s, 3),
        "per_token_ratio": round((arrow_s / arrow_tokens) / (own_s / own_tokens), 3),
    }


def test_cost_section_judges_the_median_time_ratio_against_the_goal():
    cost = load_script("arrow_cost")
    rec = {
        "command": "python -m experiments.arrow_cost ...",
        "date": "2026-12-03",
        "machine": {"cpu": "cpu", "cores": 2},
        "loadavg_before": [1.0, 1.0, 1.0],
        "loadavg_after": [2.0, 2.0, 2.0],
        "limit": 4,
        "repeats": 1,
        "pairs": [_pair("a", "arrow", 12.0, 10.0, 100, 100), _pair("b", "own", 30.0, 10.0, 200, 100)],
        "median_time_ratio": 1.2,
        "median_per_token_ratio": 1.35,
    }
    text = "\n".join(cost.render_section(rec))
    assert (
        "**1.20x** (goal <= 1.25x: met)" in text and "| b | 0 | own | 30.0 | 10.0 | 200 | 100 | 3.00 | 1.50 |" in text
    )
    rec["median_time_ratio"] = 1.3
    assert "goal <= 1.25x: not met" in "\n".join(cost.render_section(rec))


def test_prompt_section_renders_mixed_items_and_their_goal():
    ev = load_script("arrow_prompt_eval")
    mode = {"n": 24, "accuracy": 50.0, "seconds": 1.0, "generated_tokens": 10}
    rec = {
        "command": "python -m experiments.arrow_prompt_eval ...",
        "date": "2026-12-03",
        "fingerprint": "f",
        "config": {"source_block": -5, "rms_threshold": 2.0, "prompt_share": 0.2, "prompt_window": 64},
        "skills": {"t": {"arrow_prompt": mode, "learned": mode}},
        "general": {"arrow_prompt": {"retention": 100.0, "empty_where_base_answers": 0.0, "adapter_token_share": 0.0}},
        "n": 24,
        "n_general": 40,
        "n_mixed": 12,
        "mixed": {
            "arrow_prompt": {"accuracy": 45.0, "item_accuracy": 20.0},
            "sequence": {"accuracy": 40.0, "item_accuracy": 10.0},
        },
    }
    text = "\n".join(ev.render_section(rec))
    assert "| arrow_prompt | 45.0 | 20.0 |" in text and "+5.0 points, not met" in text
    rec["mixed"]["arrow_prompt"]["accuracy"] = 50.0
    assert "+10.0 points, met" in "\n".join(ev.render_section(rec))


def test_hybrid_cost_and_validation_sections_name_the_hybrid_and_test_only_a_winner(tmp_path, monkeypatch):
    cost = load_script("arrow_cost")
    rec = {
        "command": "python -m experiments.arrow_cost ... --hybrid runs/h",
        "router": "hybrid",
        "date": "2026-12-03",
        "machine": {"cpu": "cpu", "cores": 2},
        "loadavg_before": [1.0, 1.0, 1.0],
        "loadavg_after": [2.0, 2.0, 2.0],
        "limit": 4,
        "repeats": 1,
        "pairs": [_pair("a", "arrow", 15.0, 10.0, 100, 100)],
        "median_time_ratio": 1.5,
        "median_per_token_ratio": 1.5,
    }
    text = "\n".join(cost.render_section(rec))
    assert "## What the hybrid data-free chooser costs offline" in text and "| a | 0 | hybrid | 15.0 |" in text
    dc = load_script("datafree_choose")
    row = {"object_counting": 80.0, "general": 95.0, "mixed_turn1": 90.0, "mixed_turn2": 80.0, "skills_mean": 80.0}
    setting = {"block": 25, "threshold": 2.0, "window": 64, "prompt_share": 0.2}
    choice = {
        "command": "python -m experiments.datafree_hybrid ...",
        "tasks": ["object_counting"],
        "settings_searched": 7,
        "chosen": {**setting, "z_or": 3.5, "z_floor": None, **row},
        "arrow_chosen_setting": setting,
        "at_arrow_chosen_setting_plain": {**row, "skills_mean": 70.0},
        "confidence_chosen": {**row, "skills_mean": 75.0},
        "arrow_prompt_chosen": row,
        "learned": row,
        "beats_confidence_chosen": True,
    }
    monkeypatch.chdir(tmp_path)
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "datafree_hybrid_choice.json").write_text(json.dumps(choice))
    text = "\n".join(dc._hybrid_section([]))
    assert "| hybrid (chosen) | 80.0 | 95.0 | 90.0 | 80.0 | 80.0 |" in text and "z_or 3.5" in text
    assert "beats the confidence chooser's skills mean" in text and "not scored yet" in text
    choice["beats_confidence_chosen"] = False
    (tmp_path / "docs" / "datafree_hybrid_choice.json").write_text(json.dumps(choice))
    assert "was not scored on test" in "\n".join(dc._hybrid_section([]))
