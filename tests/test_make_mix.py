"""The mix benchmark's block in docs/serving.md is rendered from its committed record and is up to date."""

from __future__ import annotations

import json

from tests.conftest import load_script


def test_the_rendered_block_reports_each_variant_and_the_goal():
    make_mix = load_script("make_mix")
    record = json.loads(make_mix.RECORD.read_text())
    text = make_mix.render(record)
    for name in make_mix.LABELS:
        assert f"{record['tokens_per_s'][name]:.1f}" in text
    med = record["over_pinned"]["mix"][0]
    assert f"measured {med:.2f}x" in text and ("not met" in text) == (med < record["goal_over_pinned"])


def test_serving_md_block_is_current():
    assert load_script("make_mix").main(["--check"]) == 0
