"""Device hygiene: state that must follow `mm.to(device)`, no CPU kernel build for non-CPU tensors, no
host read of device values inside a step, device-aware bench timing, and the GPU recipe's manifests.

No GPU is needed. A step's host reads are caught on the `meta` device: meta tensors have shapes but no data, so
anything that would read a device value back to the host on a GPU (.item(), .tolist(), bool(), int(), a
repeat_interleave with device counts, a nonzero) raises there, and every `device.type == "cpu"` branch takes its
non-CPU side, as on CUDA."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import molora
from molora.model.batch import BatchMeta, RouterGroup, StepRouting
from molora.model.runner import ModelRunner
from molora.ops import LoRADispatcher, LoRAInputError, kernel_build
from molora.routing.learned import LearnedRouter, LearnedRouterConfig
from tests.conftest import load_script, make_peft_adapter, tiny_model

TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@pytest.fixture
def mm(tmp_path):
    paths = {n: make_peft_adapter(tmp_path / n, "qwen3", seed=i, r=4, targets=TARGETS) for i, n in enumerate("abc")}
    return molora.attach(tiny_model("qwen3"), paths)


@pytest.fixture
def no_cpu_kernel(monkeypatch):
    """Fail the test if anything builds or loads the fused CPU kernel (kernel_build.load)."""
    monkeypatch.setattr(
        kernel_build, "load", lambda: pytest.fail("the fused CPU kernel was loaded for non-CPU tensors")
    )


def test_index_to_slot_moves_with_the_model(mm) -> None:
    assert mm._index_to_slot.tolist() == [mm.bank.slot_of(n) for n in "abc"]
    assert not any("_index_to_slot" in k for k in mm.state_dict())  # not persistent: no checkpoint key
    mm.to("meta")
    assert mm._index_to_slot.device.type == "meta"
    assert mm.bank.slots[next(iter(mm.bank.slots))].A.device.type == "meta"


def test_dispatch_on_a_non_cpu_device_neither_builds_the_cpu_kernel_nor_reads_ids(no_cpu_kernel) -> None:
    S, R, D = 4, 8, 32
    x = torch.empty(5, D, device="meta")
    A, B = torch.empty(S, R, D, device="meta"), torch.empty(S, R, D, device="meta").transpose(1, 2)
    ids = torch.empty(5, 1, dtype=torch.long, device="meta")
    dispatch = LoRADispatcher("auto")  # default check_ids: only where the ids lie on the CPU
    with torch.no_grad():
        plan = dispatch.plan(ids, num_slots=S)
        assert dispatch.backend_for(plan, x, A, B, torch.ones(S, device="meta")) == "stacked_mask"
        assert dispatch.apply(plan, x, A, B, torch.ones(S, device="meta")).shape == (5, D)
    with pytest.raises((NotImplementedError, RuntimeError)):  # the canary: an explicit check reads the ids
        LoRADispatcher("auto", check_ids=True).plan(ids, num_slots=S)


def test_check_ids_still_checks_cpu_ids_by_default() -> None:
    with pytest.raises(LoRAInputError, match="slot_ids values"):
        LoRADispatcher("stacked_mask").plan(torch.tensor([0, 4]), num_slots=4)
    LoRADispatcher("stacked_mask", check_ids=False).plan(torch.tensor([0, 4]), num_slots=4)  # off: not read


def _decode_inputs(B: int) -> tuple[torch.Tensor, torch.Tensor, BatchMeta]:
    ctx = [5 + 3 * b for b in range(B)]
    meta = BatchMeta([1] * B, ctx, [[2 * b, 2 * b + 1] for b in range(B)])
    tokens = torch.empty(B, dtype=torch.long, device="meta")
    positions = torch.empty(B, dtype=torch.long, device="meta")
    return tokens, positions, meta


def _learned(mm, **kw) -> LearnedRouter:
    cfg = LearnedRouterConfig(tuple("abc"), mm.config.hidden_size, mm.config.num_hidden_layers, **kw)
    return LearnedRouter(cfg)


@pytest.mark.parametrize("routing", ["tokens", "learned", "learned_carry", "learned_probe"])
def test_a_decode_step_reads_nothing_back_from_the_device(mm, routing, no_cpu_kernel) -> None:
    """One decode step of the runner (4 sequences, per-token routing over 3 adapters) on meta tensors: routing,
    plan, dispatch and attention run to the logits without one host read (the allow-list is empty)."""
    B = 4
    router = None
    if routing != "tokens":
        kw = {
            "learned": {},
            "learned_carry": {"carry_blocks": 1},
            "learned_probe": {"carry_blocks": 1, "probe_prompt": True},
        }[routing]
        router = mm.router = _learned(mm, **kw)  # a submodule of mm: moves with it
    mm.to("meta")
    runner = ModelRunner(mm, num_blocks=2 * B, block_size=16, max_model_len=64)
    tokens, positions, meta = _decode_inputs(B)
    if router is None:
        step = StepRouting(slot_ids=torch.empty(B, 1, dtype=torch.long, device="meta"))
    else:
        carry = torch.empty(B, dtype=torch.long, device="meta") if router.carry_blocks else None
        fixed = torch.empty(B, dtype=torch.long, device="meta") if router.probe_prompt else None
        step = StepRouting(
            slot_ids=torch.empty(B, 1, dtype=torch.long, device="meta"),
            router=router,
            router_slots=mm._index_to_slot,
            groups=[RouterGroup(None, None)],
            carry=carry,
            fixed=fixed,
        )
    out = runner(tokens, positions, meta, step, logits=True)
    assert out.logits.shape == (B, mm.config.vocab_size) and out.logits.device.type == "meta"
    assert out.last_slot_ids.shape == (B, 1)


def test_the_runner_rejects_positions_that_disagree_with_the_metadata(mm) -> None:
    runner = ModelRunner(mm, num_blocks=4, block_size=16, max_model_len=64)
    meta = BatchMeta([1], [5], [[0]])
    runner(torch.tensor([7]), torch.tensor([4]), meta)  # position 4 = context 5 - 1
    with pytest.raises(molora.MoLoRAError, match="positions disagree"):
        runner(torch.tensor([7]), torch.tensor([3]), meta)


def test_bench_sync_waits_only_on_cuda(monkeypatch) -> None:
    from molora.bench import common

    calls = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: calls.append(str(device)))
    common.sync("cpu")
    common.sync(None)
    assert calls == []
    common.sync("cuda:0")
    assert calls == ["cuda:0"]
    calls.clear()
    t = common.time_interleaved({"a": lambda: None, "b": lambda: None}, 2, warmup=0, device="cuda")
    assert len(t.samples["a"]) == 2 and len(calls) == 2 * 2 * 2  # before and after every timed call


def test_bench_models_load_onto_molora_device(monkeypatch) -> None:
    """`molora bench model` loads through the device() path: MOLORA_DEVICE=meta puts the model there."""
    from molora.bench import model as bench_model
    from molora.model import base

    monkeypatch.setattr(base, "device", lambda: torch.device("meta"))
    assert next(bench_model.load_model("tiny").parameters()).device.type == "meta"


def _recipe():
    return load_script("gpu_recipe")


def test_gpu_recipe_manifests_name_the_base_folder_read_bundle_finds(tmp_path, monkeypatch) -> None:
    """The recipe's default --work is relative (runs/gpu): its manifests must still name the real model folders
    once read_bundle resolves them against the bundle folder."""
    pytest.importorskip("huggingface_hub")
    from molora.bundle import read_bundle, write_manifest

    recipe = _recipe()
    monkeypatch.chdir(tmp_path)
    work = Path("runs/gpu")
    for repo in (recipe.SMALL, recipe.BIG):  # present already, so fetch downloads nothing
        folder = work / "models" / repo.split("/")[1]
        folder.mkdir(parents=True)
        (folder / "config.json").write_text(json.dumps({"model_type": "qwen3"}))
    models = recipe.fetch(work, smoke=False)
    write_manifest(work / "big", recipe.bundle_manifest(models["big"], []))
    assert read_bundle(work / "big").base == str((tmp_path / "runs/gpu/models/Qwen3-8B").resolve())
    assert recipe.bundle_manifest("default", [])["base"] == "default"


def test_a_thread_flag_is_off_in_every_thread_until_that_thread_sets_it() -> None:
    import threading

    from molora.ops.device import ThreadFlag

    flag, seen = ThreadFlag(), []
    assert not flag.on
    with flag():
        assert flag.on
        with flag():
            assert flag.on
        assert flag.on  # the inner block restores the outer value
        other = threading.Thread(target=lambda: seen.append(flag.on))
        other.start()
        other.join()
    assert seen == [False] and not flag.on
