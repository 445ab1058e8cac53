"""Registration at scale: a folder of a thousand PEFT folders becomes a thousand known adapters by reading only their
`adapter_config.json`; a weights file is read when a request first needs its adapter; a bad folder refuses the
whole registration and changes nothing; `/v1/models` pages through them."""

from __future__ import annotations

import json
import re
import shutil

import pytest
import torch
from fastapi.testclient import TestClient

import molora
from molora.adapters.io import CONFIG_FILE, WEIGHTS_FILE, scan_adapter_dir
from molora.config import SamplingParams
from molora.engine import Engine, EngineConfig
from molora.errors import AdapterError, MoLoRAError
from molora.server import create_app
from molora.server.launch import register_lora_dirs
from tests.conftest import VOCAB, make_peft_adapter, tiny_model, tiny_tokenizer

ARCH = "qwen3"
CFG = dict(max_num_seqs=4, max_tokens_per_step=32, block_size=4, kv_budget_tokens=256, max_model_len=64)
N = 1000


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    return make_peft_adapter(tmp_path_factory.mktemp("src") / "real", ARCH, r=4, seed=7)


def config_only(root, source, n: int):
    """n adapter folders holding only the source's adapter_config.json: no weights file to read."""
    root.mkdir()
    for i in range(n):
        (root / f"ad{i:04d}").mkdir()
        shutil.copy(source / CONFIG_FILE, root / f"ad{i:04d}" / CONFIG_FILE)
    return root


def engine_of(source, slots: int = 2, tokenizer=None) -> Engine:
    mm = molora.attach(tiny_model(ARCH), {"base0": source}, slots=slots, tokenizer=tokenizer)
    return Engine(mm, EngineConfig(**CFG))


def test_a_thousand_folders_register_without_a_weights_file_and_one_loads_on_first_use(tmp_path, source):
    root = config_only(tmp_path / "many", source, N)
    shutil.copy(source / WEIGHTS_FILE, root / "ad0007" / WEIGHTS_FILE)  # the one a request will use
    engine = engine_of(source)
    reads = engine.hotset.disk_reads
    engine.register_adapters(scan_adapter_dir(root), roots=[root])
    listed = {a["name"]: a for a in engine.list_adapters()}
    assert len(listed) == N + 1 and listed["ad0999"]["tier"] == "disk" and listed["ad0999"]["slot"] is None
    assert engine.hotset.disk_reads == reads  # no folder's weights were read

    prompt = torch.randint(3, VOCAB, (6,), generator=torch.Generator().manual_seed(1)).tolist()
    params = SamplingParams(max_new_tokens=4)
    got = engine.generate([prompt], params, adapter="ad0007")[0].new_token_ids
    assert engine.hotset.disk_reads == reads + 1 and engine.hotset.tier("ad0007") == "slot"
    alone = Engine(molora.attach(tiny_model(ARCH), {"solo": source}), EngineConfig(**CFG))
    assert got == alone.generate([prompt], params, adapter="solo")[0].new_token_ids
    engine.hotset.check()


def test_a_bad_config_or_a_taken_name_refuses_the_whole_folder_and_changes_nothing(tmp_path, source):
    root = config_only(tmp_path / "some", source, 5)
    cfg = json.loads((source / CONFIG_FILE).read_text())
    (root / "ad0003" / CONFIG_FILE).write_text(json.dumps({**cfg, "r": 64}))
    engine = engine_of(source)
    before = engine.list_adapters()
    with pytest.raises(AdapterError, match=r"adapter 'ad0003' .*rank 64 exceeds the bank's max_rank"):
        engine.register_adapters(scan_adapter_dir(root), roots=[root])
    (root / "ad0003" / CONFIG_FILE).write_text(json.dumps({**cfg, "peft_type": "IA3"}))
    with pytest.raises(AdapterError, match=r"ad0003.*peft_type 'IA3' is not supported"):
        engine.register_adapters(scan_adapter_dir(root), roots=[root])
    assert engine.list_adapters() == before
    shutil.rmtree(root / "ad0003")
    (root / "base0").mkdir()
    shutil.copy(source / CONFIG_FILE, root / "base0" / CONFIG_FILE)
    with pytest.raises(AdapterError, match=r"already registered \['base0'\]"):
        engine.register_adapters(scan_adapter_dir(root), roots=[root])
    assert engine.list_adapters() == before
    with pytest.raises(AdapterError, match="is not a folder"):
        scan_adapter_dir(root / "nope")


def test_a_missing_weights_file_fails_the_request_that_needs_it_not_the_registration(tmp_path, source):
    root = config_only(tmp_path / "bare", source, 3)
    engine = engine_of(source)
    engine.register_adapters(scan_adapter_dir(root), roots=[root])
    out = engine.generate([[5, 6, 7]], SamplingParams(max_new_tokens=2), adapter="ad0001")[0]
    assert out.finish_reason == "abort" and re.search(r"ad0001.*adapter_model.safetensors.*missing", out.error)
    assert "ad0001" in engine.hotset.paths  # still registered: fix the folder and it reads again
    engine.hotset.check()


def test_lora_dirs_are_listed_by_v1_models_page_by_page(tmp_path, source):
    root = config_only(tmp_path / "served", source, 250)
    engine = engine_of(source, tokenizer=tiny_tokenizer())
    names = register_lora_dirs(engine, [root])
    assert names == [f"ad{i:04d}" for i in range(250)]
    client = TestClient(create_app(engine, model_name="toy"))
    seen, after = [], None
    while True:
        page = client.get("/v1/models", params={"limit": 100, **({"after": after} if after else {})}).json()
        seen += [m["id"] for m in page["data"]]
        if not page["has_more"]:
            break
        after = page["last_id"]
    assert set(names) <= set(seen) and len(seen) == len(set(seen)) == 252  # the model, base0 and the 250


def test_lora_dir_refuses_a_subfolder_that_is_not_an_adapter_name(tmp_path, source):
    root = config_only(tmp_path / "odd", source, 2)
    (root / "ad0001").rename(root / "has:colon")
    engine = engine_of(source)
    before = engine.list_adapters()
    with pytest.raises(MoLoRAError, match=r"subfolder names \['has:colon'\] are not adapter names"):
        register_lora_dirs(engine, [root])
    assert engine.list_adapters() == before
