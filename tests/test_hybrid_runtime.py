"""`--router hybrid` with adapters loaded and unloaded at run time: the chooser is recalibrated for the new set of
adapters (only the new adapter's statistics computed, one forward pass per engine-thread stage), swapped in whole
at the end, and never picks an unloaded adapter; a calibration that fails leaves the adapters and the chooser as
they were and the server serving.

Tiny random Llama base and PEFT adapters, each drawn from its own generator (tests.test_hybrid_serve's bundle)."""

from __future__ import annotations

import httpx
import pytest
import torch

import molora
from molora.server.app import create_app
from molora.server.launch import ServerThread, build_engine
from tests.conftest import make_peft_adapter
from tests.test_hybrid_serve import ENGINE, PROMPTS, _bundle, _post


def _chat(http: httpx.Client, prompt: str, **extra) -> dict:
    r = _post(http, "/chat/completions", {"model": "d", "messages": [{"role": "user", "content": prompt}], **extra})
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]


def test_an_adapter_loaded_at_run_time_is_calibrated_and_chosen(tmp_path, monkeypatch):
    """Served with e0 alone, then e1 loaded through /v1/load_lora_adapter: the chooser now has e1's statistics (those
    a start with both computes) and picks as the chooser of a start with both does, e1 included."""
    monkeypatch.setenv("MOLORA_HYBRID_CACHE", str(tmp_path / "cache-both"))
    both = molora.load(_bundle(tmp_path, adapters=2))
    want = both.chooser.choose_per_request(both, PROMPTS)
    assert "e1" in want  # the new adapter must win somewhere, else the test could not tell
    monkeypatch.setenv("MOLORA_HYBRID_CACHE", str(tmp_path / "cache-one"))  # e1's statistics are computed at run time
    engine = build_engine(_bundle(tmp_path, adapters=1), ENGINE)
    assert engine.mm.chooser.adapter_names == ("e0",)
    with (
        ServerThread(create_app(engine, adapter_roots=[tmp_path])) as url,
        httpx.Client(base_url=url, timeout=120) as http,
    ):
        before = [_chat(http, p)["molora"]["chooser"]["adapter"] for p in PROMPTS]
        assert "e1" not in before
        r = http.post("/load_lora_adapter", json={"lora_name": "e1", "lora_path": str(tmp_path / "e1")})
        assert r.status_code == 200, r.text
        chooser = engine.mm.chooser
        assert chooser.adapter_names == ("e0", "e1") and chooser._router(engine.mm).adapter_names == ["e0", "e1"]
        assert torch.allclose(torch.tensor(chooser.chooser.mean), torch.tensor(both.chooser.chooser.mean))
        assert torch.allclose(torch.tensor(chooser.chooser.std), torch.tensor(both.chooser.chooser.std))
        for prompt, pick in zip(PROMPTS, want):
            chat = _chat(http, prompt, molora={"return_routing": True})
            assert chat["molora"]["chooser"]["adapter"] == pick
            assert set(chat["molora"]["adapters"]) <= {pick}
            if pick == "e1":  # the request ran on the new adapter: the same answer as pinning it
                pinned = _post(
                    http, "/chat/completions", {"model": "e1", "messages": [{"role": "user", "content": prompt}]}
                )
                assert pinned.json()["choices"][0]["message"]["content"] == chat["message"]["content"]
    assert len(list((tmp_path / "cache-one").glob("entropy-*.json"))) == 2  # e1's statistics cached by its contents
    assert not any(engine.hotset.pins.values())


def test_unload_drops_the_adapter_and_a_new_one_of_the_same_name_is_calibrated_anew(tmp_path, monkeypatch):
    monkeypatch.setenv("MOLORA_HYBRID_CACHE", str(tmp_path / "cache"))
    engine = build_engine(_bundle(tmp_path, adapters=2), ENGINE)
    first = engine.mm.chooser
    make_peft_adapter(tmp_path / "other", "llama", seed=7)
    with (
        ServerThread(create_app(engine, adapter_roots=[tmp_path])) as url,
        httpx.Client(base_url=url, timeout=120) as http,
    ):
        assert http.post("/unload_lora_adapter", json={"lora_name": "e1"}).status_code == 200
        dropped = engine.mm.chooser
        assert dropped.adapter_names == ("e0",) and dropped._router(engine.mm).adapter_names == ["e0"]
        assert dropped.chooser.mean == first.chooser.mean[:1] and dropped.chooser.std == first.chooser.std[:1]
        picks = [_chat(http, p)["molora"]["chooser"] for p in PROMPTS]
        assert all(c["adapter"] in ("e0", None) and set(c["z"]) <= {"e0"} for c in picks)
        # the name again, other contents: its statistics are its own, not the unloaded adapter's
        r = http.post("/load_lora_adapter", json={"lora_name": "e1", "lora_path": str(tmp_path / "other")})
        assert r.status_code == 200, r.text
        again = engine.mm.chooser
        assert again.adapter_names == ("e0", "e1") and again.chooser.mean[0] == first.chooser.mean[0]
        assert again.chooser.mean[1] != first.chooser.mean[1]
        # the last adapter gone: the chooser picks the base model, never an unloaded name
        for name in ("e0", "e1"):
            assert http.delete(f"/adapters/{name}").status_code == 200
        assert all(_chat(http, p)["molora"]["chooser"]["adapter"] is None for p in PROMPTS[:3])


def test_a_failing_calibration_leaves_adapters_and_chooser_as_they_were(tmp_path, monkeypatch):
    import shutil

    from safetensors.torch import load_file, save_file

    import molora.calibration as cal

    monkeypatch.setenv("MOLORA_HYBRID_CACHE", str(tmp_path / "cache"))
    engine = build_engine(_bundle(tmp_path, adapters=1), ENGINE)
    make_peft_adapter(tmp_path / "new", "llama", seed=3)
    chooser, names = engine.mm.chooser, engine.hotset.names
    real = cal.first_token_entropy

    def broken(mm, rows, **k):
        raise RuntimeError("boom")

    with (
        ServerThread(create_app(engine, adapter_roots=[tmp_path])) as url,
        httpx.Client(base_url=url, timeout=120) as http,
    ):
        monkeypatch.setattr(cal, "first_token_entropy", broken)
        r = http.post("/adapters", json={"name": "new", "path": str(tmp_path / "new")})
        assert r.status_code == 500 and r.json()["error"]["code"] == "chooser_calibration_failed"
        assert "boom" in r.json()["error"]["message"] and "not loaded" in r.json()["error"]["message"]
        assert engine.mm.chooser is chooser and engine.hotset.names == names and "new" not in engine.mm.adapter_names
        assert not any(engine.hotset.pins.values())
        assert "new" not in [m["id"] for m in http.get("/models").json()["data"]]
        assert (
            _post(
                http, "/chat/completions", {"model": "new", "messages": [{"role": "user", "content": "w5"}]}
            ).status_code
            == 404
        )
        assert _chat(http, PROMPTS[0])["molora"]["chooser"]["adapter"] in ("e0", None)  # still serving
        monkeypatch.setattr(cal, "first_token_entropy", real)
        shutil.copytree(
            tmp_path / "new", tmp_path / "huge"
        )  # finite weights whose answers are not: the adapter's fault
        f = tmp_path / "huge" / "adapter_model.safetensors"
        save_file({k: v * 3e38 if "lora_B" in k else v for k, v in load_file(str(f)).items()}, str(f))
        r = http.post("/adapters", json={"name": "huge", "path": str(tmp_path / "huge")})
        assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_adapter", r.text
        assert "Frobenius norm" in r.json()["error"]["message"]  # refused when read, before any calibration
        # an adapter the chooser cannot score (non-finite entropies) is the adapter's fault too: 400, nothing changed
        monkeypatch.setattr(cal, "first_token_entropy", lambda *a, **k: real(*a, **k) * float("nan"))
        r = http.post("/adapters", json={"name": "new", "path": str(tmp_path / "new")})
        assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_adapter", r.text
        assert "non-finite entropies" in r.json()["error"]["message"]
        monkeypatch.setattr(cal, "first_token_entropy", real)
        assert engine.mm.chooser is chooser and engine.hotset.names == names and not any(engine.hotset.pins.values())
        r = http.post("/adapters", json={"name": "new", "path": str(tmp_path / "new")})  # fixed: it loads now
        assert r.status_code == 201, r.text
        assert engine.mm.chooser.adapter_names == ("e0", "new")


def test_the_staged_load_swaps_the_chooser_only_at_its_end_and_rolls_back_when_closed(tmp_path, monkeypatch):
    """Engine.load_adapter_stages: between stages (engine steps run there) the old chooser serves, the new adapter
    pinned; the last stage swaps; closing it half-way unregisters the adapter. More adapters than slots: refused
    before anything changes."""
    from molora.engine import Engine, EngineConfig
    from molora.errors import BankFullError

    monkeypatch.setenv("MOLORA_HYBRID_CACHE", str(tmp_path / "cache"))
    engine = Engine(molora.load(_bundle(tmp_path, adapters=1)), EngineConfig(max_num_seqs=4))
    old = engine.mm.chooser
    make_peft_adapter(tmp_path / "e1", "llama", seed=1)
    half = engine.load_adapter_stages("e1", tmp_path / "e1")
    next(half)
    assert "e1" in engine.hotset.names and engine.hotset.pins["e1"] == 1 and engine.mm.chooser is old
    half.close()  # a client gave up
    assert "e1" not in engine.hotset.names and engine.mm.chooser is old and not any(engine.hotset.pins.values())
    make_peft_adapter(tmp_path / "e5", "llama", seed=5)
    stages = engine.load_adapter_stages("e5", tmp_path / "e5")
    n = 0
    while True:
        try:
            next(stages)
            n += 1
            assert engine.mm.chooser is old and engine.hotset.pins["e5"] == 1
        except StopIteration:
            break
    assert n == -(-len(engine.mm.calibration.rows) // 16)  # one forward pass of 16 pooled prompts per stage
    assert engine.mm.chooser.adapter_names == ("e0", "e5") and not any(engine.hotset.pins.values())
    for k in range(2, 4):
        make_peft_adapter(tmp_path / f"x{k}", "llama", seed=10 + k)
        engine.load_adapter(f"x{k}", tmp_path / f"x{k}")  # the one-go load recalibrates too
    assert engine.mm.chooser.adapter_names == ("e0", "e5", "x2", "x3")  # the bank's 4 slots
    make_peft_adapter(tmp_path / "x4", "llama", seed=14)
    with pytest.raises(BankFullError, match="4 slots"):
        engine.load_adapter("x4", tmp_path / "x4")
    assert "x4" not in engine.hotset.names and len(engine.mm.chooser.adapter_names) == 4
