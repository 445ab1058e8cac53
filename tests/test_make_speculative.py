"""tools/make_speculative.py: docs/speculative.md's table is rendered from docs/speculative.json and stays in sync."""

from __future__ import annotations

import json

from tests.conftest import ROOT, load_script

GROUP = dict(
    requests=2,
    output_tokens=100,
    plain_tok_s=10.0,
    spec_tok_s=15.0,
    speedup=1.5,
    drafted=40,
    accepted=30,
    mean_acceptance_length=2.5,
    tokens=100,
    tokens_differing=0,
    adapters_differing=0,
)


def test_render_has_one_row_per_group_with_its_figures():
    ms = load_script("make_speculative")
    rec = {
        "command": "molora bench engine --speculative X",
        "cpu": "a CPU",
        "threads": 2,
        "dtype": "torch.float32",
        "items_per_skill": 2,
        "new_tokens": 64,
        "speculative": {"method": "ngram"},
        "b1_skills": GROUP,
        "b1_chat": {**GROUP, "speedup": 0.9, "mean_acceptance_length": None},
        "b32_skills": GROUP,
    }
    block = ms.render(rec)
    assert block.startswith(ms.BEGIN) and block.endswith(ms.END)
    rows = [ln for ln in block.splitlines() if ln.startswith("| 1 ") or ln.startswith("| 32 ")]
    assert len(rows) == 3
    assert sum(ln.startswith(("| 1 ", "| 32 ")) for ln in ms.render(rec, rec).splitlines()) == 6  # two records
    assert "| 1.50x |" in rows[0] and "| 0.90x |" in rows[1] and "| - |" in rows[1] and "0 of 100" in rows[2]


def test_page_is_in_sync_with_its_record():
    ms = load_script("make_speculative")
    for name in ("speculative.json", "speculative_loaded.json"):
        rec = json.loads((ROOT / "docs" / name).read_text())
        for k in ("b1_skills", "b1_chat", "b32_skills"):
            assert rec[k]["tokens_differing"] == 0 and rec[k]["adapters_differing"] == 0
    assert ms.main(["--check"]) == 0, "docs/speculative.md is stale: run python -m tools.make_speculative"
