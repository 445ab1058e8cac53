"""Bundles: a folder that names base, adapters and router loads whole, or fails with a clear error."""

from __future__ import annotations

import json

import pytest
import torch

import molora
from molora.bundle import read_bundle, write_manifest
from molora.errors import BundleError
from molora.routing.learned import LearnedRouter, LearnedRouterConfig
from tests.conftest import gen, make_peft_adapter, tiny_model, tiny_tokenizer


@pytest.fixture
def bundle(tmp_path):
    base = tmp_path / "base"
    tiny_model("llama").save_pretrained(str(base))
    tiny_tokenizer().save_pretrained(str(base))
    for i, name in enumerate(("x", "y")):
        make_peft_adapter(tmp_path / "adapters" / name, "llama", seed=i)
    router = LearnedRouter(LearnedRouterConfig(adapter_names=("x", "y"), hidden_size=64, num_blocks=2))
    torch.nn.init.normal_(router.weight, generator=gen(0))
    router.save(tmp_path / "router")
    write_manifest(
        tmp_path,
        {
            "name": "tiny",
            "base": "base",
            "adapters": [
                {"name": "x", "path": "adapters/x", "tasks": ["task_x"]},
                {"name": "y", "path": "adapters/y", "tasks": ["task_y"]},
            ],
            "router": {"kind": "learned", "path": "router"},
            "vocab_routes": {"ranges": [[0, 64, "x"]], "default": "y"},
        },
    )
    return tmp_path


def _manifest(folder):
    return json.loads((folder / "molora.json").read_text())


def test_bundle_loads_base_adapters_and_router(bundle):
    mm = molora.load(bundle)
    assert mm.adapter_names == ["x", "y"]
    assert isinstance(mm.router, LearnedRouter)
    assert mm.bundle.adapter_for_task("task_y") == "y"
    ids = torch.randint(3, 100, (1, 9), generator=gen(1))
    with torch.no_grad():
        assert mm(ids).logits.shape == (1, 9, 128)  # routed by the attached learned router


def test_missing_adapter_folder_is_named(bundle):
    m = _manifest(bundle)
    m["adapters"][1]["path"] = "adapters/nope"
    write_manifest(bundle, m)
    with pytest.raises(BundleError, match="adapter 'y'.*adapters/nope"):
        read_bundle(bundle)


def test_router_trained_for_other_adapters_is_refused(bundle):
    m = _manifest(bundle)
    m["adapters"] = m["adapters"][:1]
    write_manifest(bundle, m)
    with pytest.raises(BundleError, match=r"router was trained for adapters \['y'\]"):
        molora.load(bundle)


def test_adapter_for_another_base_is_refused(bundle):
    cfg_path = bundle / "adapters" / "x" / "adapter_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["base_model_name_or_path"] = "org/SomethingElse-7B"
    cfg_path.write_text(json.dumps(cfg))
    with pytest.raises(BundleError, match="trained for base 'org/SomethingElse-7B'"):
        molora.load(bundle)


def test_missing_manifest_says_how_to_make_one(tmp_path):
    with pytest.raises(BundleError, match="molora bundle init"):
        read_bundle(tmp_path)
