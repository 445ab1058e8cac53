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


MACHINE = dict(cpu="a CPU", cores=2, threads=1, loadavg_1_5_15=[1.0, 1.0, 1.0])


def _carry_group(cut: int, ratio: float) -> dict:
    arm = dict(
        ids_per_verified_chunk=1.8, carry_cut_rows=cut, carry_reruns=0, carry_rerun_rows=0, tokens=50,
        tokens_differing=0, adapters_differing=0,
    )  # fmt: skip
    return {
        "requests": 4,
        "median_tok_s": {"plain": 10.0, "truncate": 20.0, "rerun": 20.0 * ratio},
        "median_ratio_rerun_over_truncate": ratio,
        "median_ratio_truncate_over_plain": 2.0,
        "median_ratio_rerun_over_plain": 2.0 * ratio,
        "truncate": arm,
        "rerun": {**arm, "carry_cut_rows": 0, "carry_reruns": cut, "carry_rerun_rows": 2 * cut},
    }


def test_carry_table_says_what_the_numbers_favour():
    ms = load_script("make_speculative")
    rec = dict(command="c", machine_info=MACHINE, dtype="torch.float32", items_per_skill=1, new_tokens=8, repeats=3)
    none = ms.render_carry({**rec, "b1_skills": _carry_group(0, 1.02), "b1_chat": _carry_group(0, 0.97)}, "truncate")
    assert "| skills | 4 | 10.00 | 20.00 | 20.40 | 1.02x |" in none
    assert "`rerun` ran no extra pass" in none and "each of the 0 rows" in none
    assert "the default is `truncate`" in none
    won = ms.render_carry({**rec, "b1_skills": _carry_group(3, 1.2), "b1_chat": _carry_group(1, 1.1)}, "rerun")
    assert "`rerun` was faster on every group" in won and "| 3, 6 |" in won
    lost = ms.render_carry({**rec, "b1_skills": _carry_group(3, 0.8)}, "truncate")
    assert "`truncate` was faster on every group" in lost


def test_peer_table_has_one_row_per_group():
    ms = load_script("make_speculative")
    systems = ("molora", "molora_spec", "llama.cpp", "llama.cpp_spec")
    group = {
        "requests": 4,
        "median_tok_s": dict(zip(systems, (10.0, 20.0, 30.0, 33.0))),
        "median_ratio_over_molora": dict(zip(systems, (1.0, 2.0, 3.0, 3.3))),
        "median_ratio_llama_spec_over_llama": 1.1,
        "median_ratio_llama_spec_over_molora_spec": 1.65,
        "molora_ids_per_verified_chunk": 1.9,
        "greedy_agreement_with_molora": dict(zip(systems, (1.0, 1.0, 0.9, 0.9))),
    }
    rec = dict(
        command="c", machine_info=MACHINE, llama_cpp={"llama_cpp_python": "0.3", "api": "Llama"}, llama_cpp_draft="d",
        gguf="m.gguf", new_tokens=8, adapter="counting", repeats=3, groups={"skills": group, "chat": group},
    )  # fmt: skip
    rows = [ln for ln in ms.render_peer(rec).splitlines() if ln.startswith(("| skills", "| chat"))]
    assert len(rows) == 2
    assert "| 10.00 | 20.00 | 30.00 | 33.00 | 2.00x | 1.10x | 3.00x | 1.65x | 1.90 | 1.00, 0.90, 0.90 |" in rows[0]
