"""Named mixes as experts of the learned and the Arrow router: a token the router sends to a mix runs on the mix's
weighted sum of adapter deltas, exactly as a request pinned to that static mix (top-1, and top-2 where the router's
weight multiplies the mix's), an Arrow mix's prototype is the top right singular vector of its combined delta, a
changed mix expert records no new decode graph and misses the prefix cache, and bad input is refused naming the
mix with nothing changed."""

from __future__ import annotations

import math

import pytest
import torch

import molora
from molora.config import LLAMA_PROJECTIONS, SamplingParams
from molora.engine import Engine
from molora.errors import RoutingError
from molora.model.graphs import DecodeGraphs
from molora.routing import VocabRouter
from molora.routing.arrow import ArrowConfig, ArrowRouter
from molora.routing.learned import LearnedRouter, LearnedRouterConfig, decoder_layers
from tests.conftest import VOCAB, gen, make_peft_adapter, tiny_model
from tests.graph_emulator import emulated_capture
from tests.test_mix import CFG, SPECS, TOL  # the same three unlike adapters and engine settings

MIX = {"a": 0.7, "b": 0.3}


@pytest.fixture(scope="module", params=["qwen3", "llama"])
def arch_paths(request, tmp_path_factory):
    root = tmp_path_factory.mktemp(f"mixexp-{request.param}")
    paths = {n: make_peft_adapter(root / n, request.param, seed=20 + i, **s) for i, (n, s) in enumerate(SPECS.items())}
    return request.param, paths


def _mm(arch, paths, router=None, slots=4, names=("a", "b", "c")):
    chosen = {n: paths[n] for n in names}
    mm = molora.attach(tiny_model(arch), chosen, target_modules=LLAMA_PROJECTIONS, slots=slots, max_rank=8)
    mm.dispatcher.check_ids = False  # graphs read no ids back
    if router is not None:
        mm.router = router(mm)
    return mm


def _learned(bias: dict[str, float], top_k: int = 1):
    """A joint learned router over a, b, c whose gates ignore the hidden state: every token gets the classes of
    `bias` (adapter -> logit; the others and "none" far below)."""

    def build(mm):
        names = ("a", "b", "c")
        cfg = LearnedRouterConfig(names, mm.config.hidden_size, len(decoder_layers(mm.model)), top_k=top_k)
        r = LearnedRouter(cfg)
        with torch.no_grad():
            r.bias.fill_(-20.0)
            for n, v in bias.items():
                r.bias[:, names.index(n)] = v
        return r

    return build


def _prompt(n: int, seed: int) -> list[int]:
    return torch.randint(3, VOCAB, (n,), generator=gen(seed)).tolist()


def _run(engine, prompt, **kw):
    params = SamplingParams(max_new_tokens=6, logprobs=1, prompt_logprobs=1)
    return engine.generate([prompt], params, **kw)[0]


def _same(got, want):
    assert got.new_token_ids == want.new_token_ids
    lp = lambda o: torch.tensor([e["logprob"] for e in o.logprobs])
    plp = lambda o: torch.tensor([e["logprob"] for e in o.prompt_logprobs[1:]])
    assert (lp(got) - lp(want)).abs().max().item() < TOL
    assert (plp(got) - plp(want)).abs().max().item() < TOL


# ------------------------------------------------------------------------------------------ exactness


def test_a_token_the_learned_router_sends_to_a_mix_runs_as_that_static_mix(arch_paths):
    arch, paths = arch_paths
    engine = Engine(_mm(arch, paths, _learned({"a": 5.0})), CFG)
    prompt = _prompt(9, 1)
    plain = _run(engine, prompt)  # every token on a
    engine.add_mix("ab", MIX, router_expert=True)
    assert engine.router_experts == ["ab"] and engine.mm.router.experts()[0] == (("a", 0.7), ("b", 0.3))
    routed = _run(engine, prompt)
    _same(routed, _run(Engine(_mm(arch, paths), CFG), prompt, mix=MIX))
    assert routed.new_token_ids != plain.new_token_ids or routed.logprobs != plain.logprobs  # the mix ran, not a
    engine.add_mix("ab", MIX, router_expert=False)  # back to plain routing
    _same(_run(engine, prompt), plain)


def test_top2_router_weight_multiplies_the_mix_weights(arch_paths):
    arch, paths = arch_paths
    engine = Engine(_mm(arch, paths, _learned({"a": 2.0, "c": 1.0}, top_k=2)), CFG)
    engine.add_mix("ab", MIX, router_expert=True)
    prompt = _prompt(7, 2)
    wa = math.exp(2.0) / (math.exp(2.0) + math.exp(1.0))  # the router's renormalized top-2 weights
    want = _run(Engine(_mm(arch, paths), CFG), prompt, mix={"a": 0.7 * wa, "b": 0.3 * wa, "c": 1 - wa})
    _same(_run(engine, prompt), want)


@pytest.mark.parametrize("gran", ["per_block", "per_linear"])
def test_arrow_mix_expert_runs_as_the_static_mix_and_its_prototype_is_the_combined_deltas(arch_paths, gran):
    arch, paths = arch_paths
    router = lambda mm: ArrowRouter(ArrowConfig(granularity=gran, top_k=1), adapter_names=[]).bind(mm)
    engine = Engine(_mm(arch, paths, router), CFG)
    engine.add_mix("ab", MIX, router_expert=True)
    r = engine.mm.router
    assert r.adapter_names == ["ab"]  # its one expert: every token runs on the mix
    prompt = _prompt(10, 3)
    _same(_run(engine, prompt), _run(Engine(_mm(arch, paths), CFG), prompt, mix=MIX))
    adapters = engine.mm.adapters
    module = next(m for m in adapters["a"].modules if m in adapters["b"].modules)  # q_proj of a block
    delta = sum(
        w * adapters[n].modules[module].scale * adapters[n].modules[module].B @ adapters[n].modules[module].A
        for n, w in MIX.items()
    )
    want = torch.linalg.svd(delta.float()).Vh[0]
    P, has, _ = r.prototypes(module, torch.device("cpu"))
    assert bool(has[0]) and abs(float(P[0] @ want)) > 1 - 1e-5


def test_arrow_chooses_between_adapters_and_a_mix(arch_paths):
    arch, paths = arch_paths
    engine = Engine(_mm(arch, paths, lambda mm: ArrowRouter(ArrowConfig(), adapter_names=["a", "b"]).bind(mm)), CFG)
    engine.add_mix("ab", MIX, router_expert=True)
    r = engine.mm.router
    assert r.adapter_names == ["a", "b", "ab"] and r.experts()[2] == (("a", 0.7), ("b", 0.3))
    module = next(m for m in engine.mm.adapters["a"].modules if m in engine.mm.adapters["b"].modules)
    P, _, _ = r.prototypes(module, torch.device("cpu"))  # [3, d_in]: a's, b's and the mix's
    ids, _ = r.choose(3.0 * P, module)  # an input along each prototype picks that expert
    assert ids[:, 0].tolist() == [0, 1, 2]


# ------------------------------------------------------------------------------------------ graphs and cache


def test_mix_experts_replay_decode_graphs_equal_eager_and_a_changed_mix_records_no_new_graph(arch_paths):
    arch, paths = arch_paths
    prompts = [_prompt(n, 30 + n) for n in (5, 8, 6)]
    params = SamplingParams(max_new_tokens=6)
    outs, keys = [], []
    for graphed in (False, True):
        engine = Engine(_mm(arch, paths, _learned({"a": 5.0})), CFG)
        if graphed:
            engine.runner.enable_graphs(capture=emulated_capture, buckets=(1, 2, 4, 8), max_top_k=4)
        engine.add_mix("ab", MIX, router_expert=True)
        first = [o.new_token_ids for o in engine.generate(prompts, params, mix=[None, MIX, None])]
        if graphed:
            graphs: DecodeGraphs = engine.runner.graphs
            captured = graphs.captures
            assert captured > 0 and graphs.failed == []
            assert any(k[4] is not None and k[4][4] == (3, 2) for k in graphs.graphs)  # learned, a [K, m] table
            keys = sorted(map(str, graphs.graphs))
            engine.add_mix("ab", {"a": 0.2, "b": 0.8})  # the same expert, other weights: the same graphs replay
            engine.add_mix("ac", {"a": 0.5, "c": 0.5})  # a named mix that is no expert: nothing recorded either
            engine.generate(prompts, params, mix=[None, MIX, None])
            assert graphs.captures == captured and sorted(map(str, graphs.graphs)) == keys
            assert all(k[2] in (1, 2, 4) for k in graphs.graphs)  # k: the power-of-two widths of a static mix
        outs.append(first)
    assert outs[0] == outs[1]


def test_prefix_cache_keys_a_routed_mix_by_its_weights(arch_paths):
    arch, paths = arch_paths
    engine = Engine(_mm(arch, paths, _learned({"a": 5.0})), CFG)
    engine.add_mix("ab", MIX, router_expert=True)
    prompt, params = _prompt(17, 7), SamplingParams(max_new_tokens=2)
    assert engine.generate([prompt], params)[0].cached_tokens == 0
    assert engine.generate([prompt], params)[0].cached_tokens == 16
    engine.add_mix("ab", {"a": 0.7, "b": 0.2})
    assert engine.generate([prompt], params)[0].cached_tokens == 0


# ------------------------------------------------------------------------------------------ bad input


def test_bad_router_experts_are_refused_naming_the_mix_and_change_nothing(arch_paths):
    arch, paths = arch_paths

    def two(mm):  # a learned router over a and b only
        cfg = LearnedRouterConfig(("a", "b"), mm.config.hidden_size, len(decoder_layers(mm.model)))
        return LearnedRouter(cfg)

    engine = Engine(_mm(arch, paths, two, slots=2, names=("a", "b")), CFG)
    engine.register_adapters({"c": paths["c"]})  # known, read on first use: three adapters, two slots
    engine.add_mix("ab", {"a": 0.5, "b": 0.5}, router_expert=True)
    engine.add_mix("ac", {"a": 0.5, "c": 0.5})
    router, before = engine.mm.router, dict(engine.mm.router.mix_experts)
    cases = [
        (lambda: engine.set_router_experts(["nope"]), "nope"),
        (lambda: engine.set_router_experts(["ac"]), "'ac'.*\\['c'\\]"),  # c: not one of the router's adapters
        (lambda: engine.add_mix("ac", {"a": 0.5, "c": 0.5}, router_expert=True), "'ac'"),
        (lambda: engine.add_mix("ab2", {"a": 0.5, "b": 0.5}, router_expert=True), "'a' is in two mix experts"),
        (lambda: engine.add_mix("abc", {"a": 0.3, "b": 0.3, "c": 0.4}, router_expert=True), "2 slots"),
        (lambda: engine.set_router_experts("ab"), "list"),
    ]
    for call, words in cases:
        with pytest.raises(RoutingError, match=words):
            call()
        assert engine.router_experts == ["ab"] and router.mix_experts == before
        assert engine.mixes.names() == ["ab", "ac"] and dict(engine.mixes.items())["ac"] == (("a", 0.5), ("c", 0.5))
    vocab = Engine(_mm(arch, paths, lambda mm: VocabRouter([(0, 50, "a")])), CFG)
    vocab.add_mix("ab", MIX)
    with pytest.raises(RoutingError, match="in-network router") as e:
        vocab.set_router_experts(["ab"])
    assert e.value.field == "router_experts" and vocab.router_experts == []
    arrow = Engine(_mm(arch, paths, lambda mm: ArrowRouter(ArrowConfig(), adapter_names=["a"]).bind(mm)), CFG)
    arrow.register_adapters({"z": paths["c"]})  # known, not read yet: no weights for a prototype
    arrow.add_mix("az", {"a": 0.5, "z": 0.5})
    with pytest.raises(RoutingError, match="'az'.*not loaded"):
        arrow.set_router_experts(["az"])
    assert arrow.router_experts == [] and arrow.mm.router.adapter_names == ["a"]


def test_manifest_router_experts_name_its_mixes(tmp_path):
    from molora.errors import BundleError
    from molora.manifest import parse_manifest

    raw = {"base": "tiny", "adapters": [], "mixes": {"m": {"a": 1.0}}}
    assert parse_manifest({**raw, "router_experts": ["m"]}, tmp_path, "molora.json").router_experts == ["m"]
    assert parse_manifest(raw, tmp_path, "molora.json").router_experts == []
    for bad in (["nope"], "m", [1]):
        with pytest.raises(BundleError, match="router_experts"):
            parse_manifest({**raw, "router_experts": bad}, tmp_path, "molora.json")
