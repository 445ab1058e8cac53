"""Composable per-adapter gates (molora.routing.gates, molora.train.gates): each gate trained alone, a new gate
changes no other, a prompt no gate claims stays on the base model."""

from __future__ import annotations

import pytest
import torch

import molora
from molora.config import SamplingParams
from molora.engine import Engine, EngineConfig
from molora.errors import BundleError, RoutingError
from molora.routing.gates import Gate, GateConfig, GateRouter
from molora.train.gates import fit_gate, gate_threshold, train_gate
from tests.conftest import VOCAB, make_peft_adapter, tiny_model

D = 16
ENGINE = EngineConfig(
    max_num_seqs=4, max_tokens_per_step=32, block_size=4, kv_budget_tokens=512, max_model_len=128, stop_at_eos=False
)


def _prompts(center: torch.Tensor, n: int, seed: int, spread: float = 1.0) -> list[torch.Tensor]:
    """n prompts of 5..12 tokens [T, D] scattered around `center`."""
    g = torch.Generator().manual_seed(seed)
    return [
        center + spread * torch.randn(int(torch.randint(5, 13, (1,), generator=g)), D, generator=g) for _ in range(n)
    ]


def _centers(seed: int = 0) -> torch.Tensor:
    return 3.0 * torch.randn(4, D, generator=torch.Generator().manual_seed(seed))  # [general, a, b, c]


def test_training_uses_only_its_generator_and_separates_its_own_prompts_from_general_text():
    c = _centers()
    pos, neg = _prompts(c[1], 40, 1), _prompts(c[0], 60, 2)
    torch.manual_seed(123)  # the global RNG must not matter
    w1, b1 = train_gate(pos, neg, generator=torch.Generator().manual_seed(5), epochs=5)
    torch.manual_seed(999)
    w2, b2 = train_gate(pos, neg, generator=torch.Generator().manual_seed(5), epochs=5)
    assert torch.equal(w1, w2) and b1 == b2
    w3, _ = train_gate(pos, neg, generator=torch.Generator().manual_seed(6), epochs=5)
    assert not torch.equal(w1, w3)  # the generator draws the minibatch order: the test can tell
    test_pos, test_neg = _prompts(c[1], 20, 3), _prompts(c[0], 20, 4)
    assert all(float((s @ w1 + b1).mean()) > 0 for s in test_pos)
    assert all(float((s @ w1 + b1).mean()) < 0 for s in test_neg)


def test_quantile_threshold_lets_that_share_of_general_tokens_fire():
    c = _centers()
    neg = _prompts(c[0], 50, 7)
    w, b = torch.randn(D, generator=torch.Generator().manual_seed(1)), 0.3
    thr = gate_threshold(w, b, [], neg, "quantile", 0.9)
    scores = torch.cat([s @ w + b for s in neg])
    assert abs(float((scores > thr).float().mean()) - 0.1) < 0.01
    with pytest.raises(ValueError, match="threshold rule"):
        gate_threshold(w, b, [], neg, "median", 0.5)


def _gate(center_idx: int, seed: int = 0) -> Gate:
    c = _centers()
    return fit_gate(_prompts(c[center_idx], 40, 10 + center_idx), _prompts(c[0], 60, 2), seed=seed, value=0.99)


def test_adding_a_gate_leaves_the_other_gates_bit_identical():
    router = GateRouter(GateConfig(hidden_size=D), {"a": _gate(1), "b": _gate(2)})
    before = {n: router.gate_of(n) for n in ("a", "b")}
    router.add_gate("c", _gate(3))
    assert router.adapter_names == ["a", "b", "c"]
    for n, g in before.items():
        after = router.gate_of(n)
        assert torch.equal(after.weight, g.weight) and after.bias == g.bias and after.threshold == g.threshold
    # and each gate is what training on its own data alone gives: a gate trained again is the same gate
    again = _gate(2)
    assert torch.equal(router.gate_of("b").weight, again.weight) and router.gate_of("b").threshold == again.threshold
    c = _centers()
    votes = [router.votes(p).tolist() for p in _prompts(c[3], 5, 30, spread=0.3)]
    assert all(v.count(2) > len(v) // 2 for v in votes)  # the new adapter's prompts go to it
    with pytest.raises(RoutingError, match="already has a gate"):
        router.add_gate("a", _gate(1))
    with pytest.raises(RoutingError, match="weight shape"):
        router.add_gate("d", Gate(torch.zeros(D + 1), 0.0, 0.0))


def test_a_prompt_no_gate_claims_stays_on_the_base_model():
    router = GateRouter(GateConfig(hidden_size=D, prompt_share=0.5), {"a": _gate(1), "b": _gate(2)})
    c = _centers()
    for p in _prompts(c[0], 4, 40, spread=0.3):
        general = router.votes(p)[None]  # [1, T]
        assert (general == -1).all()  # no gate clears its threshold on general text
        routes = router.prompt_routes(general)
        assert (routes == -1).all() and router.base_only(routes).all()
    # a prompt some of whose tokens a gate claims, but fewer than prompt_share, stays on the base too
    votes = torch.tensor([[-1, -1, -1, 1, -1, -1], [1, 1, 1, -1, 1, 0]])
    routes = router.prompt_routes(votes)
    assert router.base_only(routes).tolist() == [True, False]
    assert routes[1].tolist() == [1, 1, 1, 1, 1, 1]  # the rest of a claimed prompt and its last token: its adapter
    # a gate above every score never fires
    high = GateRouter(GateConfig(hidden_size=D), {"a": Gate(torch.zeros(D), 0.0, 1.0)})
    assert (high.votes(torch.randn(7, D, generator=torch.Generator().manual_seed(0))) == -1).all()


def test_config_and_files_are_checked(tmp_path):
    for bad, match in (
        ({"prompt_share": 1.5}, "prompt_share"),
        ({"prompt_window": 0}, "prompt_window"),
        ({"hidden_size": 0}, "hidden_size"),
    ):
        with pytest.raises(RoutingError, match=match):
            GateConfig(**{"hidden_size": D, **bad})
    router = GateRouter(GateConfig(hidden_size=D, prompt_window=32), {"a": _gate(1), "b": _gate(2)})
    back = GateRouter.load(router.save(tmp_path / "g"))
    assert back.config == router.config and back.adapter_names == ["a", "b"]
    assert torch.equal(back.weight, router.weight) and torch.equal(back.threshold, router.threshold)
    with pytest.raises(BundleError, match="cannot read"):
        GateRouter.load(tmp_path / "missing")


@torch.no_grad()
def test_engine_equals_generate_and_an_unclaimed_prompt_answers_as_the_base_model(tmp_path):
    """The gates plug in as Arrow's prompt mode does: a probe votes at the source block, the answer carries the
    prompt's adapter; the engine gives generate's tokens; gates that never fire leave the base model's answer."""
    paths = {f"e{i}": make_peft_adapter(tmp_path / f"e{i}", "qwen3", seed=i) for i in range(2)}
    mm = molora.attach(tiny_model("qwen3"), paths)
    hidden = mm.model.config.hidden_size
    g = torch.Generator().manual_seed(3)
    loose = {n: Gate(torch.randn(hidden, generator=g), 0.0, -100.0) for n in paths}  # every token is claimed
    mm.router = GateRouter(GateConfig(hidden_size=hidden, source_block=-1), loose).bind(mm)
    p = torch.randint(3, VOCAB, (13,), generator=g).tolist()
    params = SamplingParams(max_new_tokens=5)
    routed = Engine(mm, ENGINE).generate([p], params, routing="auto")[0]
    ref = mm.generate(torch.tensor([p]), adapter_ids=mm.router, max_new_tokens=5)[0, len(p) :].tolist()
    assert routed.new_token_ids == ref
    never = {n: Gate(torch.zeros(hidden), 0.0, 1.0) for n in paths}
    mm.router = GateRouter(GateConfig(hidden_size=hidden, source_block=-1), never).bind(mm)
    got, base = Engine(mm, ENGINE).generate([p, p], params, routing=["auto", "none"])
    assert got.new_token_ids == base.new_token_ids
    assert got.new_token_ids != routed.new_token_ids  # the routed answer differed: the test can tell


@torch.no_grad()
def test_a_bundle_and_the_router_flag_serve_saved_gates(tmp_path):
    """A bundle names its gates (router kind "gates", or a gates/ folder beside another router for `--router
    gates`); `--router DIR` with a gates.json becomes that router; the loaded router is bound and routes."""
    from molora.bundle import make_router, run_prompt, write_manifest
    from molora.userbundle import router_entry

    paths = _tiny_bundle_parts(tmp_path, 2)
    hidden = tiny_model("llama").config.hidden_size
    g = torch.Generator().manual_seed(4)
    gates = {n: Gate(torch.randn(hidden, generator=g), 0.0, -100.0) for n in paths}
    GateRouter(GateConfig(hidden_size=hidden, source_block=-1), gates).save(tmp_path / "gates")
    assert router_entry(str(tmp_path / "gates")) == {"kind": "gates", "path": str((tmp_path / "gates").resolve())}
    adapters = [{"name": n, "path": str(p)} for n, p in paths.items()]
    write_manifest(
        tmp_path,
        {
            "name": "g",
            "base": "base",
            "adapters": adapters,
            "router": {"kind": "gates", "path": "gates", "prompt_share": 0.5},
        },
    )
    mm = molora.load(tmp_path)
    assert isinstance(mm.router, GateRouter) and mm.router.config.prompt_share == 0.5  # the manifest's setting
    res = run_prompt(mm, "w5 w9 w40 w77", max_new_tokens=3, trace=True)
    assert len(res.answer_ids) >= 1 and set(res.adapters) - {None} <= {"e0", "e1"} and set(res.adapters) != {None}
    write_manifest(tmp_path, {"name": "g", "base": "base", "adapters": adapters})  # no router: gates/ beside
    assert isinstance(make_router(molora.load(tmp_path).bundle, "gates"), GateRouter)
    (tmp_path / "gates" / "gates.json").rename(tmp_path / "gates" / "moved.json")
    with pytest.raises(BundleError, match="cannot read the gate router"):
        make_router(molora.load(tmp_path).bundle, "gates")


def _tiny_bundle_parts(tmp_path, n: int) -> dict:
    from tests.conftest import tiny_tokenizer

    base = tmp_path / "base"
    tiny_model("llama").save_pretrained(str(base))
    tiny_tokenizer().save_pretrained(str(base))
    return {f"e{i}": make_peft_adapter(tmp_path / f"e{i}", "llama", seed=i) for i in range(n)}


@torch.no_grad()
def test_train_gates_adds_a_gate_without_touching_the_others(tmp_path):
    """`molora train-gates` for one adapter keeps every other adapter's gate in the folder bit for bit."""
    from molora.bundle import write_manifest
    from molora.train.gates import train_gates_for_bundle

    paths = _tiny_bundle_parts(tmp_path, 3)
    adapters = [{"name": n, "path": str(p)} for n, p in paths.items()]
    write_manifest(tmp_path, {"name": "g", "base": "base", "adapters": adapters})
    mm = molora.load(tmp_path)
    words = {
        n: [" ".join(f"w{10 * i + j % 7}" for j in range(k, k + 6)) for k in range(12)] for i, n in enumerate(paths)
    }
    out = tmp_path / "gates"
    settings = {"source_block": -1}
    general = [" ".join(f"w{50 + (k * 7 + j) % 40}" for j in range(8)) for k in range(20)]  # the gates' negatives
    first = train_gates_for_bundle(
        mm, {"e0": words["e0"], "e1": words["e1"]}, out=out, settings=settings, negatives=general
    )
    assert set(first["trained"]) == {"e0", "e1"} and first["kept"] == []
    before = GateRouter.load(out)
    second = train_gates_for_bundle(mm, {"e2": words["e2"]}, out=out, settings=settings, negatives=general)
    assert second["kept"] == ["e0", "e1"]
    after = GateRouter.load(out)
    assert after.adapter_names == ["e0", "e1", "e2"]
    for n in ("e0", "e1"):
        a, b = after.gate_of(n), before.gate_of(n)
        assert torch.equal(a.weight, b.weight) and a.bias == b.bias and a.threshold == b.threshold
    with pytest.raises(molora.errors.MoLoRAError, match="lacks"):
        train_gates_for_bundle(mm, {"nope": words["e0"]}, out=out)
