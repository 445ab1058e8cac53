"""scripts/arrow_variants_choose.py: the served preset is the validation choice; the decision rules and the
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
