"""Learned routing: trained without manual labels, equal to oracle routing where it agrees, composable."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import molora
from molora.routing.learned import LearnedRouter
from molora.train.router import LabelledSeq, RouterTrainConfig, routing_accuracy, train_router
from tests.conftest import VOCAB, gen, make_peft_adapter, tiny_model

# two clearly separable synthetic domains of token ids, and generic text
RANGES = {"a": (40, 60), "b": (84, 104), None: (3, 23)}


def _seqs(label: str | None, n: int, seed: int, names=("a", "b"), length=12, generic=(3, 23)) -> list[LabelledSeq]:
    g = torch.Generator().manual_seed(seed)
    lo, hi = RANGES[label] if label else generic
    k = names.index(label) if label else -1
    out = []
    for _ in range(n):
        ids = torch.randint(lo, hi, (length,), generator=g).tolist()
        out.append(LabelledSeq(ids, [k] * length, [k] * length))
    return out


def _mixture(seed: int, n: int = 40) -> list[LabelledSeq]:
    return _seqs("a", n, seed) + _seqs("b", n, seed + 1) + _seqs(None, n, seed + 2)


def _attached(tmp_path, names=("a", "b")):
    paths = {
        n: make_peft_adapter(tmp_path / n, "qwen3", seed=i, targets=("q_proj", "v_proj", "down_proj"))
        for i, n in enumerate(names)
    }
    return molora.attach(tiny_model("qwen3"), paths)


CFG = RouterTrainConfig(steps=200, lr=2e-2, tokens_per_seq=12)


def test_router_learns_separable_domains_above_95_percent(tmp_path):
    mm = _attached(tmp_path)
    router = train_router(mm, _mixture(0), ["a", "b"], CFG)
    acc = routing_accuracy(mm, router, _mixture(100, n=15))
    assert acc["token_accuracy"] >= 95.0, acc


@torch.no_grad()
def test_learned_routing_equals_oracle_routing_where_the_router_agrees(tmp_path):
    mm = _attached(tmp_path)
    router = train_router(mm, _mixture(0), ["a", "b"], CFG)
    agreed = 0
    for seq in _mixture(200, n=5):
        ids = torch.tensor([seq.ids])
        mm.context.trace = []
        learned = mm(ids, adapter_ids=router).logits
        decisions = torch.stack([t[:, 0] for _, t in mm.context.trace])  # [blocks, N]
        mm.context.trace = None
        if not bool((decisions == torch.tensor(seq.labels)).all()):
            continue
        agreed += 1
        oracle = mm(ids, adapter_ids=torch.tensor([seq.route])).logits
        assert torch.allclose(learned, oracle, atol=1e-5)
    assert agreed >= 5  # the check above ran on most sequences


@torch.no_grad()
def test_new_adapter_with_its_own_gate_leaves_old_routes_unchanged(tmp_path):
    mm = _attached(tmp_path, names=("a",))
    # a shared gate at block 0 reads the embeddings, which no adapter shapes: a gate trained apart sees
    # exactly the features it will meet. Per-block gates read states that other adapters shaped, so a new
    # gate can flip a few decisions there (measured in docs/results.md); this test pins the exact case.
    cfg = RouterTrainConfig(composable=True, placement="shared", steps=400, lr=2e-2, tokens_per_seq=12)
    # a's trainer, too, sees the world beyond its domain as generic text (ids below and above a's range): a gate that
    # never saw an id claims it or not by chance (on some random tiny models a's gate claimed 9 of 72 of b's tokens)
    generic_a = (
        _seqs(None, 40, 1, ("a",))
        + _seqs(None, 20, 4, ("a",), generic=(3, 40))
        + _seqs(None, 40, 5, ("a",), generic=(60, VOCAB))
    )
    only_a = train_router(mm, _seqs("a", 40, 0, ("a",)) + generic_a, ["a"], cfg)
    probe = _seqs("a", 6, 50, ("a",)) + _seqs(None, 6, 51, ("a",))

    def routes(router):
        out = []
        for s in probe:
            mm.context.trace = []
            mm(torch.tensor([s.ids]), adapter_ids=router)
            out.append(torch.stack([t for _, t in mm.context.trace]))
            mm.context.trace = None
        return out

    before = routes(only_a)
    # adapter b and its gate are trained apart (b's data versus generic text), then loaded at run time
    mm_b = _attached(tmp_path / "b_only", names=("b",))
    # b's trainer sees the world beyond its domain as generic text (here: every id below b's range)
    # lr 5e-2: at 2e-2, b's gate (20 domain ids against 81 generic ones, data 1:4) was short of converged after 400
    # steps on some random tiny models (79% of b's tokens on its own; 100% at 5e-2)
    gate_b = train_router(
        mm_b,
        _seqs("b", 40, 2, ("b",)) + _seqs(None, 160, 3, ("b",), generic=(3, 84)),
        ["b"],
        dataclasses.replace(cfg, lr=5e-2),
    )
    mm.load_adapter("b", tmp_path / "b_only" / "b")
    only_a.add_adapter("b", *gate_b.gate_of("b"))
    after = routes(only_a)
    assert all(torch.equal(x, y) for x, y in zip(before, after))
    acc_b = routing_accuracy(
        mm, only_a, [LabelledSeq(s.ids, s.route, [1] * len(s.ids)) for s in _seqs("b", 6, 60, ("b",))]
    )
    assert acc_b["token_accuracy"] >= 90.0, acc_b


def test_router_saves_and_loads_identically(tmp_path):
    mm = _attached(tmp_path)
    router = train_router(mm, _mixture(0, n=10), ["a", "b"], RouterTrainConfig(steps=20))
    back = LearnedRouter.load(router.save(tmp_path / "r"))
    assert torch.equal(back.weight, router.weight) and back.adapter_names == ["a", "b"]
    ids = torch.tensor([_seqs("a", 1, 9)[0].ids])
    with torch.no_grad():
        assert torch.equal(mm(ids, adapter_ids=router).logits, mm(ids, adapter_ids=back).logits)


def test_top2_router_weights_are_renormalized(tmp_path):
    mm = _attached(tmp_path)
    router = train_router(mm, _mixture(0, n=10), ["a", "b"], RouterTrainConfig(steps=20, top_k=2))
    ids, w = router.choose(torch.randn(7, 3, generator=gen(0)))
    assert ids.shape == (7, 2) and torch.allclose(w.sum(-1), torch.ones(7))


def test_router_routes_a_bf16_model_like_the_fp32_one(tmp_path):
    """mm.to(bfloat16) (what `molora serve --dtype bfloat16` does) also casts the router; its gates still run in
    fp32, so it routes and its decisions match the fp32 router's on the same hidden states."""
    mm = _attached(tmp_path)
    router = train_router(mm, _mixture(0, n=10), ["a", "b"], RouterTrainConfig(steps=40))
    hidden = torch.randn(9, mm.config.hidden_size, generator=gen(0))
    want = router.choose(router.logits(0, hidden))[0]
    mm.router = router
    mm.to(torch.bfloat16)
    assert router.weight.dtype == torch.bfloat16
    got = router.choose(router.logits(0, hidden.to(torch.bfloat16)))[0]
    assert (got == want).float().mean() >= 0.8  # bf16 hidden states: near-ties may flip
    ids = torch.tensor([_seqs("a", 1, 9)[0].ids])
    with torch.no_grad():
        assert torch.isfinite(mm(ids, adapter_ids=router).logits.float()).all()


def test_router_features_always_include_the_key_positions(tmp_path):
    """Key positions (the tokens that pick each answer's first token) are trained on besides the sample."""
    from molora.train.router import collect_features

    mm = _attached(tmp_path)
    seqs = _seqs("a", 6, 4)
    keyed = [LabelledSeq(s.ids, s.route, s.labels, key=(len(s.ids) - 2, len(s.ids) - 1)) for s in seqs]
    cfg = RouterTrainConfig(tokens_per_seq=3)
    feats, labels = collect_features(mm, seqs, ["a", "b"], cfg)
    feats_k, labels_k = collect_features(mm, keyed, ["a", "b"], cfg)
    assert feats.shape[0] == 6 * 3 and feats_k.shape[0] == 6 * (3 + 2)
    last = mm(torch.tensor([keyed[0].ids]), adapter_ids="a", output_hidden_states=True).hidden_states[0][0, -1]
    assert any(torch.allclose(f[0].float(), last.to(torch.bfloat16).float()) for f in feats_k[:5])


def _biased_router(mm, carry_blocks: int, probe_prompt: bool = False) -> LearnedRouter:
    """Gates with zero weights: block 0 picks "a", every later block picks "b" (router order a, b)."""
    from molora.routing.learned import LearnedRouterConfig, decoder_layers

    cfg = LearnedRouterConfig(
        ("a", "b"),
        mm.config.hidden_size,
        len(decoder_layers(mm.model)),
        carry_blocks=carry_blocks,
        probe_prompt=probe_prompt,
    )
    router = LearnedRouter(cfg)
    with torch.no_grad():
        router.bias[0, 0] = 5.0
        router.bias[1:, 1] = 5.0
    return router


def test_carry_replaces_the_early_gates_only_where_a_decision_is_carried():
    from molora.errors import RoutingError
    from molora.routing.learned import LearnedRouterConfig

    router = LearnedRouter(LearnedRouterConfig(("a", "b"), 8, 3, carry_blocks=1))
    with torch.no_grad():
        router.bias[:, 0] = 5.0  # every gate alone would pick "a"
    h, carry = torch.randn(3, 8, generator=gen(0)), torch.tensor([1, -2, -1])
    assert router.decide(0, h, carry=carry)[0][:, 0].tolist() == [1, 0, -1]
    assert router.decide(1, h, carry=carry)[0][:, 0].tolist() == [0, 0, 0]  # above carry_blocks: own gate
    assert router.decide(0, h)[0][:, 0].tolist() == [0, 0, 0]  # nothing carried: own gate
    assert router.carry_source == 2
    for bad in (dict(carry_blocks=3), dict(carry_blocks=1, top_k=2), dict(carry_blocks=1, placement="shared")):
        with pytest.raises(RoutingError, match="carry_blocks"):
            LearnedRouterConfig(("a", "b"), 8, 3, **bad)


@torch.no_grad()
def test_generate_carries_the_last_blocks_decision_into_the_next_tokens_early_blocks(tmp_path):
    """Prompt tokens keep their block-0 gate ("a"); each generated token fed back takes, at block 0, the
    decision its predecessor got at the last block ("b"). Without carry block 0 stays on "a"."""
    mm = _attached(tmp_path)
    ids = torch.tensor([_seqs("a", 1, 3)[0].ids])
    for carry_blocks, later in ((1, 1), (0, 0)):
        mm.context.trace = []
        mm.generate(ids, adapter_ids=_biased_router(mm, carry_blocks), max_new_tokens=3)
        block0 = [t[:, 0].tolist() for b, t in mm.context.trace if b == 0]
        mm.context.trace = None
        assert block0[0] == [0] * ids.shape[1]  # the prompt forward
        assert block0[1:] == [[later], [later]]  # the two fed-back tokens
    back = LearnedRouter.load(_biased_router(mm, 1).save(tmp_path / "r"))
    assert back.carry_blocks == 1


def test_fixed_decisions_hold_at_every_block_and_probe_needs_carry():
    from molora.errors import RoutingError
    from molora.routing.base import in_network_decide
    from molora.routing.learned import LearnedRouterConfig

    router = LearnedRouter(LearnedRouterConfig(("a", "b"), 8, 3, carry_blocks=1, probe_prompt=True))
    with torch.no_grad():
        router.bias[:, 0] = 5.0  # every gate alone would pick "a"
    h = torch.randn(3, 8, generator=gen(0))
    for block in range(3):
        ids, w = in_network_decide(router, block, h, None, None, torch.tensor([1, -2, -1]))
        assert ids[:, 0].tolist() == [1, 0, -1] and w is None  # -2: the gate decides
        assert in_network_decide(router, block, h, None, None, torch.tensor([1, 1, -1]))[0][:, 0].tolist() == [1, 1, -1]
    probe = torch.tensor([[-1, -1, 2, -1, 1, 2], [1, -1, -1, 0, 0, 1], [-1, -1, -1, -1, -1, -1]])
    assert router.prompt_routes(probe).tolist() == [[2, 2, 2, 2, 1, 2], [1, 0, 0, 0, 0, 1], [-1] * 6]
    mask = torch.tensor([[1] * 6, [0, 0, 0, 1, 1, 1], [1] * 6])  # padding does not vote
    assert router.prompt_routes(torch.tensor([[1, 1, 1, 0, -1, 0]]), mask[1:2]).tolist() == [[1, 1, 1, 0, 0, 0]]
    with pytest.raises(RoutingError, match="probe_prompt needs carry_blocks"):
        LearnedRouterConfig(("a", "b"), 8, 3, probe_prompt=True)


@torch.no_grad()
def test_generate_probes_the_prompt_then_routes_every_block_of_it_by_the_probes_last_block(tmp_path):
    """With probe_prompt, a first forward over the prompt runs on the gates (block 0 picks "a", the last
    block "b"); the real prompt forward then puts every block of every prompt token on "b"."""
    mm = _attached(tmp_path)
    ids = torch.tensor([_seqs("a", 1, 3)[0].ids])
    L, n_blocks = ids.shape[1], len(mm.model.model.layers)
    mm.context.trace = []
    out = mm.generate(ids, adapter_ids=_biased_router(mm, 1, probe_prompt=True), max_new_tokens=2)
    trace, mm.context.trace = mm.context.trace, None
    probe, real = trace[:n_blocks], trace[n_blocks : 2 * n_blocks]
    assert probe[0][1][:, 0].tolist() == [0] * L and probe[-1][1][:, 0].tolist() == [1] * L
    assert all(t[:, 0].tolist() == [1] * L for _, t in real)  # every block of the prompt: the probe's "b"
    assert [t.shape[0] for _, t in trace[2 * n_blocks :]] == [1] * n_blocks  # then one token per forward
    plain = mm.generate(ids, adapter_ids=_biased_router(mm, 1), max_new_tokens=2)
    assert out.shape == plain.shape
    back = LearnedRouter.load(_biased_router(mm, 1, probe_prompt=True).save(tmp_path / "p"))
    assert back.probe_prompt


def test_generation_adapters_reads_the_generations_own_forwards():
    """The routing view of a generation: majority over blocks per forward, the probe forward skipped, and
    None for a last token that was never fed back."""
    from types import SimpleNamespace

    from molora.bundle import generation_adapters

    t = torch.tensor
    probe = [(0, t([[0], [0]])), (1, t([[0], [0]])), (2, t([[0], [0]]))]
    prompt = [(0, t([[0], [1]])), (1, t([[1], [1]])), (2, t([[1], [-1]]))]
    fed_back = [(0, t([[-1]])), (1, t([[-1]])), (2, t([[0]]))]
    probing = SimpleNamespace(adapter_names=["a", "b"], probe_prompt=True)
    assert generation_adapters(probe + prompt + fed_back, probing, 4) == ["b", "b", None, None]
    plain = SimpleNamespace(adapter_names=["a", "b"], probe_prompt=False)
    assert generation_adapters(prompt + fed_back, plain, 3) == ["b", "b", None]


@pytest.mark.parametrize("composable,confidence,top_k", [(False, 0.0, 1), (False, 0.4, 2), (True, 0.6, 1)])
def test_choose_takes_one_allowed_set_per_token(composable, confidence, top_k):
    """allowed [T, K] (each token its own adapters) chooses for each token what allowed [K] chooses for it alone."""
    from molora.routing.learned import LearnedRouterConfig

    router = LearnedRouter(
        LearnedRouterConfig(("a", "b", "c"), 8, 4, composable=composable, confidence=confidence, top_k=top_k)
    )
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(6, 3 if composable else 4, generator=g) * 2
    allowed = torch.rand(6, 3, generator=g) > 0.4
    ids, w = router.choose(logits, allowed)
    for t in range(6):
        ids_t, w_t = router.choose(logits[t : t + 1], allowed[t])
        assert torch.equal(ids[t : t + 1], ids_t)
        assert (w is None) == (w_t is None) and (w is None or torch.allclose(w[t : t + 1], w_t))
