"""Benchmark smoke tests: every bench's tiny path runs end to end and ends stdout with one valid JSON line
(timings are not checked: they are measurements, not invariants). Together well under 30 s on 2 cores."""

from __future__ import annotations

import gc
import json

import pytest
import torch

from molora.bench.cli import main as bench_main
from molora.bench.common import paired_ratio, time_interleaved
from molora.bench.model import lora_flops
from tests.conftest import tiny_model


@pytest.fixture(autouse=True)
def keep_threads():
    n = torch.get_num_threads()
    yield
    torch.set_num_threads(n)


def _last_json(capsys) -> dict:
    out = capsys.readouterr().out.strip().splitlines()
    return json.loads(out[-1])


def test_cli_refuses_unknown_bench(capsys):
    assert bench_main(["nope"]) == 2
    assert "ops" in capsys.readouterr().err


def test_interleaved_timing_resets_and_caps_repeats():
    calls: list[str] = []
    t = time_interleaved(
        {"a": lambda: calls.append("a"), "b": lambda: calls.append("b")},
        3,
        warmup=1,
        reset={"a": lambda: calls.append("reset")},
        max_repeats={"b": 1},
    )
    assert [len(v) for v in t.samples.values()] == [3, 1]
    assert calls == ["a", "reset", "a", "reset", "b", "a", "reset", "a", "reset"]  # no warm-up for capped b
    assert t.ratios("a")["a"] == 1.0


def test_interleaved_order_rotates_so_no_variant_always_runs_first():
    order: list[str] = []
    fns = {n: (lambda n=n: order.append(n)) for n in ("a", "b", "c")}
    time_interleaved(fns, repeats=4, warmup=0)
    assert order == ["a", "b", "c", "b", "c", "a", "c", "a", "b", "a", "b", "c"]


def test_paired_ratio_cancels_load_shared_by_a_repetition():
    # The machine slows down 3x for the last two repetitions: both variants pay it alike.
    base = [10.0, 10.0, 10.0, 30.0, 30.0]
    lora = [11.0, 11.0, 12.0, 33.0, 33.0]
    med, q1, q3 = paired_ratio(lora, base)
    assert med == pytest.approx(1.1) and q1 == pytest.approx(1.1) and q3 == pytest.approx(1.1)
    assert paired_ratio([12.0, 30.0], [10.0, 10.0, 10.0])[0] == pytest.approx(2.1)  # zips the reps both ran
    assert all(v != v for v in paired_ratio([], [1.0]))  # nothing paired: NaN
    t = time_interleaved({"a": lambda: None, "b": lambda: None}, 3)
    s = t.summary("a")
    assert len(s["samples_ms"]["b"]) == 3 and s["paired_vs_a"]["a"] == [1.0, 1.0, 1.0]


def test_lora_flops_of_smollm2_are_a_few_percent():
    from transformers import LlamaConfig

    cfg = LlamaConfig(
        hidden_size=576,
        intermediate_size=1536,
        num_hidden_layers=30,
        num_attention_heads=9,
        num_key_value_heads=3,
        head_dim=64,
        vocab_size=49152,
    )
    f = lora_flops(cfg, 16)
    assert 0.03 < f["lora_vs_base"] < f["lora_vs_body"] < 0.05


def test_ops_bench_json(tmp_path, capsys):
    path = tmp_path / "ops.json"
    assert (
        bench_main(
            [
                "ops",
                "--Ts",
                "1",
                "16",
                "--Ks",
                "1",
                "2",
                "--ranks",
                "4",
                "--d",
                "32",
                "--repeats",
                "1",
                "--skip-gather",
                "--json",
                str(path),
            ]
        )
        == 0
    )
    line = _last_json(capsys)
    assert line["bench"] == "ops" and len(line["rows"]) == 4
    assert all(len(r["paired_vs_single"]["auto"]) == 3 for r in line["rows"])
    assert json.loads(path.read_text())


def test_model_bench_json_on_tiny(tmp_path, capsys):
    path = tmp_path / "model.json"
    assert (
        bench_main(
            [
                "model",
                "--models",
                "tiny",
                "--prefill",
                "2",
                "16",
                "--decode-batches",
                "2",
                "--context",
                "16",
                "--kmod-Ks",
                "2",
                "--kmod-batch",
                "1",
                "--repeats",
                "1",
                "--threads",
                "1",
                "--json",
                str(path),
            ]
        )
        == 0
    )
    line = _last_json(capsys)
    assert line == json.loads(path.read_text())
    r = line["results"][0]
    assert r["model"] == "tiny" and line["machine"]["cores"] >= 1
    for variant in ("base", "molora", "runner", "peft_mixed", "peft_single", "kpass", "molora_bf16"):
        assert r["prefill"]["ms"][variant] > 0 and variant in r["decode_b2"]["vs_base"]
    # X-LoRA is either measured or its failure is recorded, never silently missing
    assert "xlora" in r["prefill"]["ms"] or "xlora" in r["errors"]
    assert r["kmodality"][0]["K"] == 2 and r["kmodality"][0]["speedup"] > 0
    goals = line["goals"]["rows"]
    assert [g["name"] for g in goals][:2] == ["prefill_vs_base", "decode_vs_base"]
    for g in goals:  # met judges the paired median; its quartiles bracket it
        for k, (med, q1, q3) in g["values_paired"].items():
            assert q1 <= med <= q3 and g["met"][k] == (
                med >= g["limit"] if g["name"].startswith("xlora") else med <= g["limit"]
            )


def test_hotset_bench_json_on_tiny(tmp_path, capsys):
    assert (
        bench_main(
            [
                "hotset",
                "--model",
                "tiny",
                "--adapters",
                "4",
                "--slots",
                "1",
                "4",
                "--requests",
                "40",
                "--repeats",
                "1",
                "--threads",
                "1",
                "--json",
                str(tmp_path / "h.json"),
            ]
        )
        == 0
    )
    line = _last_json(capsys)
    assert set(line["tiers"]["ms"]) == {"memcpy", "slot_copy", "slot_hit", "cpu_tier", "disk", "read"}
    rows = line["zipf"]["rows"]
    assert rows[-1]["hit_rate"] == 1.0 and rows[0]["hits"] + rows[0]["misses"] == 40


def test_hotset_traffic_bench_quick_on_tiny(tmp_path, capsys, monkeypatch):
    """The many-adapter traffic bench, CI-sized: every request of every variant ends with its tokens (the bench
    raises otherwise), the one-adapter variant loads at most its one adapter, the many-adapter ones load many, and
    the CPU tier stays within its budget at every sampled step (HotSet.check also asserts it each step)."""
    monkeypatch.delenv("MOLORA_LOADER_NICE", raising=False)  # the default, 0
    monkeypatch.delenv("MOLORA_GC_FREEZE", raising=False)  # the default, on
    assert (
        bench_main(
            [
                "hotset",
                "--traffic",
                "--quick",
                "--adapters",
                "12",
                "--requests",
                "10",
                "--threads",
                "1",
                "--loader-nice-ab",
                "--gc-freeze-ab",
                "--json",
                str(tmp_path / "t.json"),
            ]
        )
        == 0
    )
    line = _last_json(capsys)
    variants = {"one", "many_fcfs", "many_slots", "many_fcfs_nice10", "many_fcfs_nofreeze"}
    assert line["bench"] == "hotset_traffic" and set(line["runs"]) == variants
    assert line["loader_nice"]["many_fcfs_nice10"] == 10 and line["loader_nice"]["many_fcfs"] == 0
    for v, (run,) in line["runs"].items():
        gaps = run["warm_itl_ms"]  # every load step either prefilled or only decoded
        assert gaps["loads"]["n"] == gaps["load_admits"]["n"] + gaps["load_decodes"]["n"]
        assert run["output_tokens"] == 10 * line["new_tokens"]
        assert run["ttft_ms"]["warm"]["n"] + run["ttft_ms"]["cold"]["n"] == 10
        assert run["memory"]["peak"]["cpu_tier_bytes"] <= run["memory"]["cpu_tier_budget"]
        assert (run["gc"]["frozen_objects"] > 0) == (v != "many_fcfs_nofreeze")
        kinds = run["stalls"]["by_kind"]  # every step counted once, under the kind its gaps were filed under
        assert sum(k["steps"] for k in kinds.values()) == run["steps"]
        assert all(0 <= k["stalls"] <= k["steps"] for k in kinds.values())
        assert v == "one" or kinds["load_admits"]["steps"] > 0
        assert run["stalls"]["with_gen2"] <= run["gc"]["steps_with_gen2"] <= run["gc"]["collections_by_generation"][2]
    assert gc.get_freeze_count() == 0  # every variant's freeze undone
    misses = {v: run["hotset"]["misses"] for v, (run,) in line["runs"].items()}
    assert misses["one"] <= 1 < min(misses["many_fcfs"], misses["many_slots"], misses["many_fcfs_nice10"])
    assert line["vs_one"]["one"] == 1.0


def test_engine_bench_json_on_tiny(monkeypatch, capsys):
    import molora.model.base as base

    monkeypatch.setattr(base, "load_default_base", lambda *a, **k: (tiny_model("qwen3"), None))
    assert (
        bench_main(
            [
                "engine",
                "--requests",
                "2",
                "--prompt-len",
                "8",
                "--new-tokens",
                "3",
                "--hf-batch",
                "2",
                "--threads",
                "1",
                "--quick",
            ]
        )
        == 0
    )
    line = _last_json(capsys)
    assert line["bench"] == "engine" and line["engine_tok_s"] > 0
    assert line["engine_base_tok_s"] > 0
    # the kernels are part of a profiled run, so their share lies in (0, 1] and the ceiling is a real bound
    assert 0 < line["engine_kernel_share"] <= 1
    assert line["ceiling_vs_hf_routed"] > 0
    med, q1, q3 = line["speedup_vs_hf_routed_paired"]  # one repetition: the quartiles are the ratio
    assert q1 == med == q3
    assert med == pytest.approx(line["hf_routed_samples_s"][0] / line["engine_samples_s"][0], rel=1e-4)  # 6 digits kept


def test_gc_clock_times_full_collections_and_uninstalls():
    from molora.bench.hotset_traffic import GcClock

    with GcClock() as clock:
        gc.collect()
        assert clock.take() > 0 and clock.take() == 0  # take() empties it
    assert clock.count[2] >= 1 and len(clock.gen2_s) == clock.count[2]
    assert clock not in gc.callbacks


def test_engine_bench_repetitions_recompute_every_prompt():
    """The engine benches time the same prompts again and again on one engine (molora.bench.engine.measure, the peer
    bench, bench_quant): with bench_config no repetition may find its prompt's KV blocks cached by the one before,
    or it would skip prefill work its peers (transformers, llama.cpp) do."""
    import dataclasses

    import molora
    from molora.bench.engine import bench_config, workload
    from molora.config import SamplingParams
    from molora.engine import Engine

    mm = molora.attach(tiny_model("llama"), {})
    prompts, news = workload(4, 40, 3, mm.config.vocab_size, False, seed=3)
    engine = Engine(mm, bench_config(4, 40 + 3 + 16))
    params = [SamplingParams(max_new_tokens=n) for n in news]
    first = [r.new_token_ids for r in engine.generate(prompts, params, routing="none")]
    again = [r.new_token_ids for r in engine.generate(prompts, params, routing="none")]
    assert again == first  # greedy: the same work
    assert engine.prefix is None  # no cache: the second repetition prefilled all 160 prompt tokens again
    cached = Engine(mm, dataclasses.replace(bench_config(4, 40 + 3 + 16), enable_prefix_caching=True))
    for _ in range(2):
        cached.generate(prompts, params, routing="none")
    assert cached.prefix is not None and cached.prefix.stats()["hit_tokens"] > 0  # what the cache would have skipped
