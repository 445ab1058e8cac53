"""The GPU recipe's plumbing, end to end on the CPU (tools/gpu_recipe.py --smoke): data, four adapters, the
bundle, the router, every eval mode of both models, the report. Slow (a few minutes on 2 cores)."""

from __future__ import annotations

import json

import pytest

from tests.conftest import load_script


@pytest.mark.slow
@pytest.mark.real_model
def test_gpu_recipe_smoke_runs_every_step(tmp_path):
    recipe = load_script("gpu_recipe")
    assert recipe.main(["all", "--smoke", "--work", str(tmp_path), "--n", "8"]) == 0
    manifest = json.loads((tmp_path / "bundle" / "molora.json").read_text())
    assert [a["name"] for a in manifest["adapters"]] == list(recipe.ADAPTERS)
    assert manifest["router"]["kind"] == "learned"
    results = {p.stem for p in (tmp_path / "results").glob("*.json")}
    for mode in recipe.SMALL_MODES:
        assert f"small__object_counting__{mode}" in results and f"small__navigate__{mode}" in results
    assert "big__object_counting__base" in results
    report = (tmp_path / "report.md").read_text()
    assert "SMOKE RUN" in report and "| Qwen3-8B | base |" in report
