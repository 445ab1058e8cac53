"""tools/make_benchmarks.py: docs/benchmarks.md, docs/performance.md's speed block and the README's speed table
are renders of the committed record docs/benchmarks.json, and a run of some benches keeps the others' records.
No benchmark runs here."""

from __future__ import annotations

import copy
import json
import shutil
from pathlib import Path

import pytest

from tests.conftest import load_script

ROOT = Path(__file__).resolve().parent.parent
RECORD = ROOT / "docs" / "benchmarks.json"


@pytest.fixture(scope="module")
def mb():
    return load_script("make_benchmarks")


@pytest.fixture(scope="module")
def records() -> dict:
    return json.loads(RECORD.read_text())


def block(mb, records: dict) -> str:
    """The speed block as docs/performance.md holds it (links relative to docs/)."""
    return mb.readme_block(records, mb.script_command(records), "benchmarks.md", "benchmarks.json", ROOT / "docs")


def iqr(p: list[float]) -> str:
    return f"{p[0]:.2f}× [{p[1]:.2f}–{p[2]:.2f}]"


def test_rendering_the_record_is_deterministic(mb, records) -> None:
    again = json.loads(RECORD.read_text())
    assert block(mb, records) == block(mb, again)
    out = ROOT / "docs" / "benchmarks.md"
    cmd = mb.script_command(records)
    assert mb.render(records, out, out.parent, cmd, "") == mb.render(again, out, out.parent, cmd, "")


def test_speed_block_and_readme_table_are_fresh_renders_of_the_record(mb, records) -> None:
    """A page or README edited by hand, or a record changed without re-rendering, fails here: run
    `.venv/bin/python -m tools.make_benchmarks --render-only`."""
    page = (ROOT / "docs" / "performance.md").read_text(encoding="utf-8")
    a, b = page.index(mb.SPEED_BEGIN), page.index(mb.SPEED_END) + len(mb.SPEED_END)
    assert page[a:b] == block(mb, records)
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    assert mb.readme_table(records, "docs/performance.md") in readme


def test_benchmarks_page_and_readme_pass_the_check(mb, capsys) -> None:
    assert mb.main(["--check"]) == 0, capsys.readouterr().err


def test_readme_figures_are_the_records(mb, records) -> None:
    text = block(mb, records)
    r = next(x for x in records["model"]["result"]["results"] if x["model"] == "smollm2")
    for scen in ("prefill", "decode_b8"):  # paired medians [IQR] the bench stored beside its samples
        assert f"**{iqr(r[scen]['paired_vs_base']['molora'])}**" in text
        assert iqr(r[scen]["paired_vs_base"]["runner"]) in text
    e, m = records["engine"]["result"], records["engine_mixed"]["result"]
    assert f"{e['engine_tok_s']:.0f} tokens/s, **{iqr(e['speedup_vs_hf_routed_paired'])}**" in text
    assert f"{e['bf16_engine_tok_s']:.0f} tokens/s, {iqr(e['bf16_speedup_vs_hf_routed_paired'])}" in text
    assert f"{m['engine_tok_s']:.0f} tokens/s, **{iqr(m['speedup_vs_hf_routed_paired'])}**" in text
    assert f"could make it at most {1 / e['engine_kernel_share']:.2f}× faster than now" in text
    ops = records["ops"]["result"]["rows"]
    plan = sorted(x["ms"]["plan"] for x in ops if x["T"] == 512)
    assert f"{plan[0]:.2f}–{plan[-1]:.2f} ms at T=512" in text
    top = max(records["serve"]["result"]["levels"], key=lambda lv: lv["concurrency"])
    assert f"{top['output_tok_s']:.1f} output tokens/s at concurrency {top['concurrency']}" in text
    assert f"({top['speedup_vs_hf']:.2f}×)" in text


def test_auto_is_named_as_the_backend_it_ran(mb, records) -> None:
    """auto resolved to fused in every recorded shape: one result, "auto (= fused)", never two."""
    text = block(mb, records)
    assert {x["auto_backend"] for x in records["ops"]["result"]["rows"]} == {"fused"}
    assert "auto (= fused) costs" in text and "fused costs" not in text.replace("auto (= fused) costs", "")
    mixed = copy.deepcopy(records)
    mixed["ops"]["result"]["rows"][0]["auto_backend"] = "stacked_mask"
    n = len(mixed["ops"]["result"]["rows"])
    assert f"auto (fused in {n - 1} of {n} shapes, stacked_mask in 1 of {n} shapes) costs" in block(mb, mixed)


def test_the_block_follows_the_record(mb, records) -> None:
    """Figures change with the record they come from: none is typed into the script."""
    changed = copy.deepcopy(records)
    e = changed["engine"]["result"]
    e["engine_tok_s"], e["speedup_vs_hf_routed_paired"] = 987.4, [2.5, 2.25, 2.75]
    pre = next(x for x in changed["model"]["result"]["results"] if x["model"] == "smollm2")["prefill"]
    pre["samples_ms"]["molora"] = [2 * v for v in pre["samples_ms"]["base"]]  # exactly 2x base every repetition
    changed["serve"]["result"]["levels"][-1]["output_tok_s"] = 55.57
    text = block(mb, changed)
    assert "987 tokens/s, **2.50× [2.25–2.75]**" in text
    assert "| prefill 8×128 | **2.00× [2.00–2.00]** |" in text
    assert "prefill ≤ 1.15×: molora per-token **not met**" in text  # the goal is judged again, not copied
    assert "55.6 output tokens/s at concurrency 16" in text


def test_render_only_needs_only_the_record(mb, tmp_path) -> None:
    """A fresh clone has no runs/bench: --render-only reads docs/benchmarks.json alone."""
    shutil.copy(RECORD, tmp_path / "benchmarks.json")
    (tmp_path / "README.md").write_text(f"# x\n\n{mb.SPEED_BEGIN}\nold\n{mb.SPEED_END}\n\nrest\n", encoding="utf-8")
    argv = [
        "--out",
        str(tmp_path / "benchmarks.md"),
        "--work",
        str(tmp_path / "absent"),
        "--summary",
        str(tmp_path / "README.md"),
        "--readme",
        "",
    ]
    assert mb.main(["--render-only", *argv]) == 0
    assert not (tmp_path / "absent").exists()
    readme = (tmp_path / "README.md").read_text(encoding="utf-8")
    assert "old" not in readme and readme.endswith(f"{mb.SPEED_END}\n\nrest\n") and "| prefill 8×128 |" in readme
    assert mb.main(["--check", *argv]) == 0
    (tmp_path / "README.md").write_text(readme.replace("tokens/s", "tok/s"), encoding="utf-8")
    assert mb.main(["--check", *argv]) == 1


def test_only_replaces_its_benches_and_keeps_the_rest(mb, records, tmp_path, monkeypatch) -> None:
    """`--only engine engine_mixed` reruns those two with the kept records' --threads and --quick and merges them
    into the record, which keeps every other bench as it was."""
    shutil.copy(RECORD, tmp_path / "benchmarks.json")
    (tmp_path / "README.md").write_text(f"{mb.SPEED_BEGIN}\n{mb.SPEED_END}\n", encoding="utf-8")
    calls = []

    def fake_run(what: str, args: list[str], threads: int, quick: bool) -> dict:
        calls.append((what, args, threads, quick))
        return records[what] | {"date": "2030-01-01T00:00:00"}

    monkeypatch.setattr(mb, "run_bench", fake_run)
    assert (
        mb.main(
            [
                "--only",
                "engine",
                "engine_mixed",
                "--out",
                str(tmp_path / "benchmarks.md"),
                "--work",
                str(tmp_path / "work"),
                "--summary",
                str(tmp_path / "README.md"),
                "--readme",
                "",
            ]
        )
        == 0
    )
    assert [(w, t, q) for w, _, t, q in calls] == [("engine", 2, True), ("engine_mixed", 2, True)]
    assert calls[0][1][: calls[0][1].index("--json")] == records["engine"]["command"].split()[3:-2]
    merged = json.loads((tmp_path / "benchmarks.json").read_text())
    assert list(merged) == list(records)
    assert {w: r["date"] for w, r in merged.items() if r != records[w]} == {
        "engine": "2030-01-01T00:00:00",
        "engine_mixed": "2030-01-01T00:00:00",
    }


def test_a_run_that_would_mix_configurations_is_refused(mb, records) -> None:
    kept = {w: r for w, r in records.items() if w != "engine"}
    assert mb.run_config(kept, None, None) == (2, True)
    assert mb.run_config({}, None, None) == (1, False)
    with pytest.raises(SystemExit, match="--threads=1"):
        mb.run_config(kept, 1, None)
    assert mb.merge_records({"serve": 1, "ops": 2}, {"model": 3, "ops": 4}) == {"ops": 4, "model": 3, "serve": 1}


def test_scaleout_docs_render_from_their_record():
    """docs/scaleout.md's block is what tools/make_scaleout.py renders from
    docs/scaleout.json (no figure without its record)."""
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    out = subprocess.run(
        [sys.executable, "-m", "tools.make_scaleout", "--check"], capture_output=True, text=True, cwd=root
    )
    assert out.returncode == 0, out.stdout + out.stderr
