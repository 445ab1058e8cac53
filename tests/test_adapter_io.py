"""Adapter I/O at run time: cold reads run on the loader thread while steps go on, a failed read fails only
its request, unloading drains (or, forced, aborts) the requests that use an adapter, and adapter files are
confined to their roots on every read."""

from __future__ import annotations

import shutil
import threading
from pathlib import Path

import pytest
import torch

import molora
from molora.adapters.io import read_adapter
from molora.config import LLAMA_PROJECTIONS, SamplingParams
from molora.engine import Engine, EngineConfig
from molora.errors import AdapterError
from molora.model.lora_linear import linear_shapes
from molora.routing import VocabRouter
from tests.conftest import VOCAB, make_peft_adapter, tiny_model

ARCH = "qwen3"
SPECS = {
    "a": dict(r=4, alpha=8, targets=("q_proj", "v_proj", "down_proj")),
    "b": dict(r=8, alpha=4, targets=("q_proj", "k_proj", "o_proj", "up_proj")),
    "c": dict(r=2, alpha=16, targets=("v_proj", "up_proj")),
}
CFG = EngineConfig(
    max_num_seqs=8, max_tokens_per_step=48, block_size=4, kv_budget_tokens=1024, max_model_len=128, stop_at_eos=False
)
COLD = EngineConfig(**{**CFG.__dict__, "cpu_tier_bytes": 0})  # no CPU tier: every miss reads the disk
GREEDY = SamplingParams(max_new_tokens=6)


@pytest.fixture(scope="module")
def paths(tmp_path_factory):
    root = tmp_path_factory.mktemp("adapters")
    return {n: make_peft_adapter(root / n, ARCH, seed=i, **s) for i, (n, s) in enumerate(SPECS.items())}


def _mm(paths, names=("a",), **kw):
    return molora.attach(
        tiny_model(ARCH), {n: paths[n] for n in names}, target_modules=LLAMA_PROJECTIONS, max_rank=8, **kw
    )


def _prompt(n: int, seed: int) -> list[int]:
    return torch.randint(3, VOCAB, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _warm_reference(paths, prompt: list[int], adapter: str, max_new_tokens: int = 6) -> list[int]:
    """The tokens `adapter` gives `prompt` when it was attached (always in a slot)."""
    engine = Engine(_mm(paths, names=("a", "b", "c")), CFG)
    return engine.generate([prompt], SamplingParams(max_new_tokens=max_new_tokens), adapter=adapter)[0].new_token_ids


def _run(engine: Engine, check: bool = True) -> dict[str, list]:
    """Step to the end; every output of each request, in order."""
    outs: dict[str, list] = {}
    while engine.has_unfinished():
        for out in engine.step():
            outs.setdefault(out.request_id, []).append(out)
        if check:
            engine.check()
    return outs


def _tokens(outs: list) -> list[int]:
    return [t for o in outs for t in o.new_token_ids]


# ------------------------------------------------------------------------------------------ reads off the step


def test_cold_read_runs_on_the_loader_thread_while_other_requests_decode(paths, monkeypatch):
    mm = _mm(paths, slots=1)
    engine = Engine(mm, COLD)
    engine.load_adapter("b", paths["b"])  # validated; no free slot and no CPU tier: disk
    assert engine.hotset.tier("b") == "disk"
    gate, threads = threading.Event(), []
    read = mm.read

    def slow_read(name, path, **kw):
        threads.append(threading.current_thread().name)
        assert gate.wait(30), "the test never released the read"
        return read(name, path, **kw)

    monkeypatch.setattr(mm, "read", slow_read)
    cold_prompt, warm_prompt = _prompt(7, 1), _prompt(5, 2)
    cold = engine.add_request(cold_prompt, GREEDY, adapter="b")  # head of the queue, adapter on disk
    warm = engine.add_request(warm_prompt, SamplingParams(max_new_tokens=12), adapter="a")
    got: dict[str, list[int]] = {cold: [], warm: []}
    for _ in range(5):  # the read is held: the warm request decodes on
        outs = {o.request_id: o for o in engine.step()}
        assert len(outs[warm].new_token_ids) == 1 and cold not in outs
        got[warm] += outs[warm].new_token_ids
        engine.check()
        assert engine.stats()["hotset"]["reads_in_flight"] == 1
        assert engine.scheduler.waiting[0].request_id == cold
        assert {d["name"]: d["state"] for d in engine.list_adapters()} == {"a": "ready", "b": "loading"}
    assert engine.steps == 5 and threads == ["molora-adapter-io_0"]
    gate.set()
    for rid, outs in _run(engine).items():
        got[rid] += _tokens(outs)
    assert got[cold] == _warm_reference(paths, cold_prompt, "b")  # the same tokens as a warm adapter
    assert got[warm] == _warm_reference(paths, warm_prompt, "a", 12)
    hs = engine.stats()["hotset"]
    assert (hs["disk_reads"], hs["reads_in_flight"], hs["read_failures"], hs["misses"]) == (2, 0, 0, 1)
    assert engine.hotset.tier("b") == "slot" and not engine.hotset.reads


def test_an_idle_engine_waits_for_the_read_without_empty_steps(paths):
    engine = Engine(_mm(paths, slots=1), COLD)
    engine.load_adapter("c", str(paths["c"]))
    p = _prompt(6, 3)
    out = engine.generate([p], GREEDY, adapter="c")[0]
    assert out.new_token_ids == _warm_reference(paths, p, "c") and engine.steps == 6


def test_failed_read_fails_only_its_request_and_is_forgotten(paths, tmp_path):
    engine = Engine(_mm(paths, slots=1), COLD)
    folder = shutil.copytree(paths["b"], tmp_path / "b")
    engine.load_adapter("b", folder)
    shutil.rmtree(folder)  # the folder vanishes after registration
    bad = engine.add_request(_prompt(4, 1), GREEDY, adapter="b")
    ok = engine.add_request(_prompt(4, 2), GREEDY, adapter="a")
    outs = _run(engine)
    last = outs[bad][-1]
    assert last.finish_reason == "abort" and last.new_token_ids == []
    assert "'b'" in last.error and str(folder) in last.error
    assert outs[ok][-1].finish_reason == "length" and len(_tokens(outs[ok])) == 6
    hs = engine.stats()["hotset"]
    assert hs["read_failures"] == 1 and hs["reads_in_flight"] == 0 and not engine.hotset.pins
    shutil.copytree(paths["b"], folder)  # fixed: the failure does not stick
    p = _prompt(5, 4)
    assert engine.generate([p], GREEDY, adapter="b")[0].new_token_ids == _warm_reference(paths, p, "b")
    engine.close()  # the loader thread stops; a later miss restarts it
    assert engine.generate([p], GREEDY, adapter="a")[0].finish_reason == "length"
    assert engine.generate([p], GREEDY, adapter="b")[0].new_token_ids == _warm_reference(paths, p, "b")


def test_read_adapter_on_a_worker_then_load_equals_loading_the_folder(paths, tmp_path):
    engine = Engine(_mm(paths), CFG)
    box: dict = {}
    worker = threading.Thread(target=lambda: box.update(adapter=engine.read_adapter("c", paths["c"])))
    worker.start()
    worker.join()
    assert engine.list_adapters()[-1]["name"] == "a"  # reading registered nothing
    engine.load_adapter("c", box["adapter"])
    p = _prompt(7, 2)
    assert engine.generate([p], GREEDY, adapter="c")[0].new_token_ids == _warm_reference(paths, p, "c")
    # bad input changes nothing: a name in use, a rank the bank cannot hold, a folder that is not one
    before = (engine.list_adapters(), list(engine.mm.bank.table), engine.hotset.stats())
    with pytest.raises(AdapterError, match="already loaded"):
        engine.read_adapter("c", paths["c"])
    with pytest.raises(AdapterError, match="already loaded"):
        engine.load_adapter("c", box["adapter"])
    big = make_peft_adapter(tmp_path / "big", ARCH, r=16, targets=("q_proj",))
    with pytest.raises(AdapterError, match="max_rank"):
        engine.read_adapter("big", big)
    with pytest.raises(AdapterError, match="max_rank"):
        engine.load_adapter("big", big)
    with pytest.raises(AdapterError, match="not a folder"):
        engine.load_adapter("nope", tmp_path / "nope")
    assert (engine.list_adapters(), list(engine.mm.bank.table), engine.hotset.stats()) == before


# ------------------------------------------------------------------------------------------ draining unload


def _learned_mm(paths):
    from molora.routing.learned import LearnedRouter, LearnedRouterConfig, decoder_layers

    mm = _mm(paths, names=("a", "b", "c"))
    cfg = LearnedRouterConfig(("b", "a"), mm.config.hidden_size, len(decoder_layers(mm.model)))
    router = LearnedRouter(cfg)
    with torch.no_grad():  # seed 2: on the tiny model, this random router picks "a" for the tests' prompts (asserted)
        router.weight.normal_(generator=torch.Generator().manual_seed(2))
    mm.router = router
    return mm


def test_unload_drains_under_learned_routing_until_the_last_user_finishes(paths):
    long_p, new_p = _prompt(9, 5), _prompt(8, 6)
    ref = Engine(_learned_mm(paths), CFG)
    ref_long, ref_new = ref.generate([long_p, new_p], [SamplingParams(max_new_tokens=12), GREEDY])
    assert "a" in ref_new.token_adapters  # without the unload, the router does pick it
    engine = Engine(_learned_mm(paths), CFG)
    free0 = engine.allocator.num_free
    long = engine.add_request(long_p, SamplingParams(max_new_tokens=12))
    got = _tokens(engine.step() + engine.step())
    assert engine.unload_adapter("a") == "draining"
    assert engine.unload_adapter("a") == "draining"  # idempotent
    states = {d["name"]: d["state"] for d in engine.list_adapters()}
    assert states == {"a": "draining", "b": "ready", "c": "ready"}
    with pytest.raises(AdapterError, match="being unloaded"):
        engine.add_request(new_p, GREEDY, adapter="a")
    with pytest.raises(AdapterError, match="still draining"):
        engine.load_adapter("a", paths["a"])
    new = engine.add_request(new_p, GREEDY)
    req = engine.requests[new]
    assert "a" not in req.needs and "a" not in req.route.allowed
    outs: dict[str, list] = {}
    while engine.has_unfinished():
        for out in engine.step():
            outs.setdefault(out.request_id, []).append(out)
        engine.check()
        # registered exactly as long as the request that used it is in flight
        assert ("a" in engine.hotset.paths) == (long in engine.requests)
    assert got + _tokens(outs[long]) == ref_long.new_token_ids  # the running request kept its adapter
    assert "a" not in [a for o in outs[new] for a in o.token_adapters]
    assert [d["name"] for d in engine.list_adapters()] == ["b", "c"] and "a" not in engine.mm.bank
    assert engine.allocator.num_free == free0 and not engine.hotset.pins and not engine.hotset.draining
    engine.load_adapter("a", paths["a"])  # gone: the name is free again
    assert engine.unload_adapter("a") == "unloaded"
    with pytest.raises(AdapterError, match="unknown adapter"):
        engine.unload_adapter("a")


def test_draining_under_vocab_routing_sends_its_tokens_to_the_base(paths):
    mm = _mm(paths, names=("a", "b", "c"))
    mm.router = VocabRouter([(0, 50, "a"), (50, 90, "b")], default="c")
    engine = Engine(mm, CFG)
    holder = engine.add_request(_prompt(4, 1), SamplingParams(max_new_tokens=10), adapter="a")
    engine.step()
    assert engine.unload_adapter("a") == "draining"
    prompt = _prompt(6, 7)
    rid = engine.add_request(prompt, SamplingParams(max_new_tokens=12), routing="vocab")
    outs = _run(engine)
    feed = [prompt[-1]] + _tokens(outs[rid])[:-1]
    assert [a for o in outs[rid] for a in o.token_adapters] == [
        None if t < 50 else "b" if t < 90 else "c" for t in feed
    ]
    assert outs[holder][-1].finish_reason == "length" and "a" not in engine.hotset.paths


def test_an_unloaded_adapter_of_a_vocab_router_leaves_its_tokens_to_the_base(paths):
    """Once gone (not only draining), the adapter a fixed rule names is left out as well: routed requests are still
    admitted and its range runs on the base model."""
    mm = _mm(paths, names=("a", "b", "c"))
    mm.router = VocabRouter([(0, 50, "a"), (50, 90, "b")], default="c")
    engine = Engine(mm, CFG)
    assert engine.unload_adapter("a") == "unloaded" and "a" not in engine.hotset.paths
    prompt = _prompt(6, 7)
    rid = engine.add_request(prompt, SamplingParams(max_new_tokens=12), routing="vocab")
    outs = _run(engine)
    feed = [prompt[-1]] + _tokens(outs[rid])[:-1]
    assert [a for o in outs[rid] for a in o.token_adapters] == [
        None if t < 50 else "b" if t < 90 else "c" for t in feed
    ]


def test_drain_survives_preemption_of_its_users(paths):
    busy = EngineConfig(
        max_num_seqs=8, max_tokens_per_step=16, block_size=4, num_kv_blocks=32, max_model_len=128, stop_at_eos=False
    )
    engine = Engine(_mm(paths, names=("a", "b")), busy)
    users = [engine.add_request(_prompt(20 + i, i), SamplingParams(max_new_tokens=16), adapter="a") for i in range(4)]
    others = [
        engine.add_request(_prompt(20 + i, 10 + i), SamplingParams(max_new_tokens=16), adapter="b") for i in range(3)
    ]
    engine.step()
    assert engine.unload_adapter("a") == "draining"
    outs = _run(engine)  # check() each step: every need stays registered
    assert engine.stats()["num_preemptions"] > 0
    assert all(outs[r][-1].finish_reason == "length" for r in users + others)
    assert engine.hotset.names == ["b"] and engine.allocator.num_free == 32


def test_force_unload_aborts_its_users_with_an_error_and_unloads_now(paths):
    engine = Engine(_learned_mm(paths), CFG)
    free0 = engine.allocator.num_free
    pinned = engine.add_request(_prompt(5, 1), SamplingParams(max_new_tokens=20), adapter="a")
    learned = engine.add_request(_prompt(5, 2), SamplingParams(max_new_tokens=20))
    other = engine.add_request(_prompt(5, 3), SamplingParams(max_new_tokens=8), adapter="c")
    engine.step()
    queued = engine.add_request(_prompt(5, 4), GREEDY, adapter="a")  # not started yet
    assert engine.unload_adapter("a", force=True) == "unloaded"
    assert "a" not in engine.hotset.paths and "a" not in engine.mm.bank
    engine.check()
    outs = _run(engine)
    why = "adapter 'a' was unloaded (force) while this request used it"
    for rid in (pinned, learned, queued):
        assert outs[rid][0].finish_reason == "abort" and outs[rid][0].error == why
    assert outs[other][-1].finish_reason == "length" and outs[other][-1].error is None
    assert engine.allocator.num_free == free0 and not engine.hotset.pins


# ------------------------------------------------------------------------------------------ confinement


def _outside_link(paths, tmp_path) -> tuple[Path, Path]:
    """root/x: a copy of adapter c whose safetensors file is a symlink to a copy outside root."""
    root, outside = tmp_path / "root", tmp_path / "outside"
    shutil.copytree(paths["c"], outside)
    (root / "x").mkdir(parents=True)
    shutil.copy(paths["c"] / "adapter_config.json", root / "x")
    (root / "x" / "adapter_model.safetensors").symlink_to(outside / "adapter_model.safetensors")
    return root, outside


def test_a_symlinked_file_outside_the_roots_is_refused(paths, tmp_path):
    root, outside = _outside_link(paths, tmp_path)
    engine = Engine(_mm(paths), CFG)
    before = (engine.list_adapters(), list(engine.mm.bank.table), engine.hotset.stats())
    with pytest.raises(AdapterError, match="outside the adapter roots") as e:
        engine.load_adapter("x", root / "x", roots=[root])
    assert str(outside / "adapter_model.safetensors") in str(e.value)
    with pytest.raises(AdapterError, match="outside the adapter roots"):
        engine.read_adapter("x", root / "x", roots=[root])
    (root / "y").symlink_to(outside, target_is_directory=True)  # the folder itself links out
    with pytest.raises(AdapterError, match="outside the adapter roots"):
        engine.load_adapter("y", root / "y", roots=[root])
    assert (engine.list_adapters(), list(engine.mm.bank.table), engine.hotset.stats()) == before
    engine.load_adapter("x", root / "x", roots=[root, outside])  # inside the roots: fine
    shapes = linear_shapes(tiny_model(ARCH))
    via_link = tmp_path / "link_to_root"  # a root that is itself a symlink
    via_link.symlink_to(root, target_is_directory=True)
    shutil.copy(outside / "adapter_model.safetensors", tmp_path / "w.safetensors")
    (root / "x" / "adapter_model.safetensors").unlink()
    shutil.copy(tmp_path / "w.safetensors", root / "x" / "adapter_model.safetensors")
    assert read_adapter(via_link / "x", shapes, roots=[via_link]).roots == (root.resolve(),)


def test_a_cold_reread_is_confined_and_fails_only_its_request(paths, tmp_path):
    root, outside = _outside_link(paths, tmp_path)
    (root / "x" / "adapter_model.safetensors").unlink()
    shutil.copy(outside / "adapter_model.safetensors", root / "x")  # a real file at registration
    engine = Engine(_mm(paths, slots=1), COLD)
    box: dict = {}
    worker = threading.Thread(target=lambda: box.update(adapter=engine.read_adapter("x", root / "x", roots=[root])))
    worker.start()
    worker.join()
    engine.load_adapter("x", box["adapter"])  # keeps the roots it was read with
    assert engine.hotset.tier("x") == "disk"
    (root / "x" / "adapter_model.safetensors").unlink()  # swapped for a link out of the root
    (root / "x" / "adapter_model.safetensors").symlink_to(outside / "adapter_model.safetensors")
    bad = engine.add_request(_prompt(4, 1), GREEDY, adapter="x")
    ok = engine.add_request(_prompt(4, 2), GREEDY, adapter="a")
    outs = _run(engine)
    assert outs[bad][-1].finish_reason == "abort" and "outside the adapter roots" in outs[bad][-1].error
    assert outs[ok][-1].finish_reason == "length"
    assert engine.hotset.tier("x") == "disk" and engine.stats()["hotset"]["read_failures"] == 1
