"""Adapter IO refusals and the bank's all-or-nothing loads."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

import molora
from molora.adapters import read_adapter, save_adapter
from molora.errors import AdapterError, BankFullError
from molora.model.lora_linear import linear_shapes
from tests.conftest import gen, make_peft_adapter, tiny_model


@pytest.fixture
def good(tmp_path):
    return make_peft_adapter(tmp_path / "good", "qwen3", r=4, targets=("q_proj", "v_proj"))


def _edit_config(path, **changes):
    cfg = json.loads((path / "adapter_config.json").read_text())
    cfg.update(changes)
    (path / "adapter_config.json").write_text(json.dumps(cfg))


def _edit_weights(path, fn):
    w = load_file(str(path / "adapter_model.safetensors"))
    save_file(fn(w), str(path / "adapter_model.safetensors"))


SHAPES = linear_shapes(tiny_model("qwen3"))


@pytest.mark.parametrize(
    "changes, message",
    [
        ({"use_dora": True}, "DoRA"),
        ({"peft_type": "IA3"}, "peft_type 'IA3'"),
        ({"modules_to_save": ["lm_head"]}, "modules_to_save"),
        ({"bias": "all"}, "bias='all'"),
    ],
)
def test_unsupported_peft_variants_are_refused(good, changes, message):
    _edit_config(good, **changes)
    with pytest.raises(AdapterError, match=message) as e:
        read_adapter(good, SHAPES, name="g")
    assert "adapter 'g'" in str(e.value) and "adapter_config.json" in str(e.value)


def test_missing_safetensors_is_refused_naming_the_file(good):
    (good / "adapter_model.safetensors").unlink()
    with pytest.raises(AdapterError, match=r"adapter_model.safetensors\): missing"):
        read_adapter(good, SHAPES, name="g")


def test_wrong_shape_names_the_module(good):
    key = "base_model.model.model.layers.1.self_attn.v_proj.lora_A.weight"
    _edit_weights(good, lambda w: {**w, key: torch.zeros(4, 65)})
    with pytest.raises(AdapterError, match=r"model\.layers\.1\.self_attn\.v_proj.*d_in=64"):
        read_adapter(good, SHAPES, name="g")


def test_nan_weights_are_refused(good):
    key = "base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight"
    _edit_weights(good, lambda w: {**w, key: torch.full_like(w[key], float("nan"))})
    with pytest.raises(AdapterError, match="q_proj: lora_B holds NaN"):
        read_adapter(good, SHAPES, name="g")


def test_missing_and_unexpected_keys_are_listed(good):
    drop = "base_model.model.model.layers.1.self_attn.q_proj.lora_A.weight"
    drop_b = drop.replace("lora_A", "lora_B")

    def edit(w):
        w = {k: v for k, v in w.items() if k not in (drop, drop_b)}
        w["base_model.model.model.layers.0.mlp.extra.weight"] = torch.zeros(2, 2)
        return w

    _edit_weights(good, edit)
    with pytest.raises(AdapterError) as e:
        read_adapter(good, SHAPES, name="g")
    assert "unexpected keys" in str(e.value) and "mlp.extra.weight" in str(e.value)
    assert "missing keys" in str(e.value) and "layers.1.self_attn.q_proj" in str(e.value)


def test_other_base_model_is_refused(good):
    _edit_config(good, base_model_name_or_path="org/OtherModel-7B")
    with pytest.raises(AdapterError, match="trained for base 'org/OtherModel-7B'"):
        read_adapter(good, SHAPES, name="g", base_name="HuggingFaceTB/SmolLM2-135M-Instruct")


def _bank_state(mm):
    return (
        {m: (s.A.clone(), s.B.clone(), s.scale.clone(), s.active) for m, s in mm.bank.slots.items()},
        list(mm.bank.table),
        mm.adapter_names,
    )


def _same(a, b):
    (sa, ta, na), (sb, tb, nb) = a, b
    return (
        ta == tb
        and na == nb
        and all(
            torch.equal(sa[m][0], sb[m][0])
            and torch.equal(sa[m][1], sb[m][1])
            and torch.equal(sa[m][2], sb[m][2])
            and sa[m][3] == sb[m][3]
            for m in sa
        )
    )


def test_failed_loads_leave_the_bank_exactly_as_before(tmp_path, good):
    mm = molora.attach(tiny_model("qwen3"), {"good": good}, slots=2, max_rank=4)
    before = _bank_state(mm)
    big = make_peft_adapter(tmp_path / "big", "qwen3", r=8)
    with pytest.raises(AdapterError, match="exceeds the bank's max_rank 4"):
        mm.load_adapter("big", big)
    outside = make_peft_adapter(tmp_path / "mlp", "qwen3", targets=("up_proj",))
    with pytest.raises(AdapterError, match="not built for"):
        mm.load_adapter("mlp", outside)
    with pytest.raises(AdapterError, match="already loaded"):
        mm.load_adapter("good", good)
    nan = make_peft_adapter(tmp_path / "nan", "qwen3")
    key = "base_model.model.model.layers.1.self_attn.v_proj.lora_A.weight"
    _edit_weights(nan, lambda w: {**w, key: torch.full_like(w[key], float("inf"))})
    with pytest.raises(AdapterError, match="NaN or Inf"):
        mm.load_adapter("nan", nan)
    assert _same(before, _bank_state(mm))
    mm.load_adapter("second", make_peft_adapter(tmp_path / "s", "qwen3", seed=3))
    with pytest.raises(BankFullError, match="all 2 slots are in use"):
        mm.load_adapter("third", make_peft_adapter(tmp_path / "t", "qwen3", seed=4))


def test_unload_zeroes_the_slot_and_frees_it(good):
    mm = molora.attach(tiny_model("qwen3"), {"good": good}, slots=1)
    mm.unload_adapter("good")
    assert mm.bank.free_slots() == [0]
    assert all(s.A.abs().sum() == 0 and s.B.abs().sum() == 0 and s.active == 0 for s in mm.bank.slots.values())
    with pytest.raises(AdapterError, match="not loaded"):
        mm.unload_adapter("good")


def test_saved_adapter_round_trips_and_loads_in_peft(tmp_path):
    from peft import PeftModel

    g = gen(0)
    mods = {
        f"model.layers.{i}.self_attn.q_proj": (torch.randn(3, 64, generator=g), torch.randn(64, 3, generator=g))
        for i in range(2)
    }
    path = save_adapter(tmp_path / "mine", mods, r=3, lora_alpha=6)
    back = read_adapter(path, SHAPES, name="mine")
    assert set(back.modules) == set(mods)
    assert back.modules["model.layers.0.self_attn.q_proj"].scale == 2.0
    ids = torch.randint(3, 100, (1, 8), generator=g)
    pm = PeftModel.from_pretrained(tiny_model("qwen3"), str(path)).eval()
    mm = molora.attach(tiny_model("qwen3"), {"mine": path})
    with torch.no_grad():
        assert (pm(input_ids=ids).logits - mm(ids, adapter_ids="mine").logits).abs().max() <= 1e-4
