"""Arrow routing (molora.routing.arrow): prototypes from the adapters' weights, PEFT's routing on sparse dispatch."""

from __future__ import annotations

import json

import pytest
import torch

import molora
from molora.bundle import read_bundle, write_manifest
from molora.config import SamplingParams
from molora.engine import Engine, EngineConfig
from molora.errors import BundleError, RoutingError
from molora.routing import ArrowConfig, ArrowRouter, VocabRouter
from molora.routing.arrow_protos import top_right_singular_vector
from tests.conftest import VOCAB, gen, make_peft_adapter, tiny_model, tiny_tokenizer

ALL = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
ENGINE = EngineConfig(
    max_num_seqs=4, max_tokens_per_step=32, block_size=4, kv_budget_tokens=512, max_model_len=128, stop_at_eos=False
)


@pytest.fixture(scope="module")
def adapters(tmp_path_factory):
    """Four same-shaped adapters per architecture (PEFT's Arrow needs equal ranks and targets)."""
    root = tmp_path_factory.mktemp("arrow")
    return {
        arch: [make_peft_adapter(root / arch / f"e{i}", arch, seed=i, targets=ALL) for i in range(4)]
        for arch in ("qwen3", "llama")
    }


def _mm(paths, arch="qwen3", n=4):
    return molora.attach(tiny_model(arch), {f"e{i}": paths[arch][i] for i in range(n)})


def _ids(seed=0, shape=(2, 11)):
    return torch.randint(3, VOCAB, shape, generator=torch.Generator().manual_seed(seed))


# ------------------------------------------------------------------------------------------ prototypes


def test_prototype_is_the_top_right_singular_vector_of_BA():
    g = torch.Generator().manual_seed(0)
    A, B = torch.randn(4, 48, generator=g), torch.randn(32, 4, generator=g)
    want = torch.linalg.svd(B @ A).Vh[0]
    got = top_right_singular_vector(A, B)
    assert torch.allclose(got.abs(), want.abs(), atol=1e-5) and abs(float(got @ want)) > 1 - 1e-6
    power = top_right_singular_vector(A, B, method="power", iters=2000, seed=3)  # converged power iteration
    assert abs(float(power @ want)) > 1 - 1e-5
    few = top_right_singular_vector(A, B, method="power", iters=1, seed=3)
    assert abs(float(few @ want)) < 1 - 1e-3  # one step is not the answer: the test can tell them apart


def test_top_k_weights_are_a_softmax_of_the_top_similarities_over_temperature(adapters):
    mm = _mm(adapters)
    r = ArrowRouter(ArrowConfig(top_k=2, temperature=0.5)).bind(mm)
    name = "model.layers.1.mlp.down_proj"
    x = torch.randn(7, 96, generator=gen(0))
    ids, w = r.decide_linear(name, x)
    P, _, _ = r.prototypes(name, x.device)
    sim = (x @ P.T).abs()
    top, idx = sim.topk(2, dim=-1)
    assert torch.equal(ids, idx)
    assert torch.allclose(w, torch.softmax(top / 0.5, -1), atol=1e-6)
    one, none = ArrowRouter(ArrowConfig(top_k=1)).bind(mm).decide_linear(name, x)
    assert none is None and torch.equal(one[:, 0], sim.argmax(-1))


# ------------------------------------------------------------------------------------------ PEFT


@pytest.mark.parametrize("arch", ["qwen3", "llama"])
@pytest.mark.parametrize("top_k,temperature", [(1, 1.0), (2, 1.0), (3, 0.5)])
@torch.no_grad()
def test_per_linear_logits_equal_peft_create_arrow_model(adapters, arch, top_k, temperature):
    from peft import ArrowConfig as PeftArrowConfig
    from peft import create_arrow_model

    peft = create_arrow_model(
        tiny_model(arch),
        [str(p) for p in adapters[arch]],
        PeftArrowConfig(top_k=top_k, router_temperature=temperature, rng_seed=0),
    ).eval()
    ids = _ids(1)
    want = peft(input_ids=ids).logits
    mm = _mm(adapters, arch)
    router = ArrowRouter(ArrowConfig(top_k=top_k, temperature=temperature, method="power", seed=0))
    got = mm(ids, adapter_ids=router).logits
    assert torch.allclose(got, want, atol=2e-5, rtol=1e-5), float((got - want).abs().max())
    assert not torch.allclose(tiny_model(arch)(ids).logits, want, atol=1e-2)  # the adapters change the logits


# ------------------------------------------------------------------------------------------ behaviour


@torch.no_grad()
def test_threshold_keeps_unclaimed_tokens_on_the_base_model(adapters):
    mm = _mm(adapters)
    ids = _ids(2)
    base = tiny_model("qwen3")(ids).logits
    for gran in ("per_linear", "per_block"):
        strict = ArrowRouter(ArrowConfig(granularity=gran, threshold=1.0))  # no |cos| reaches 1: all on base
        assert torch.allclose(mm(ids, adapter_ids=strict).logits, base, atol=1e-5)
        loose = ArrowRouter(ArrowConfig(granularity=gran, threshold=0.0))
        assert not torch.allclose(mm(ids, adapter_ids=loose).logits, base, atol=1e-3)


@torch.no_grad()
def test_per_block_decides_once_per_block_from_the_projection_input(adapters):
    mm = _mm(adapters)
    ids = _ids(3, (1, 9))
    router = ArrowRouter(ArrowConfig(granularity="per_block", top_k=1))
    mm.context.trace = []
    got = mm(ids, adapter_ids=router).logits
    trace, mm.context.trace = mm.context.trace, None
    assert [b for b, _ in trace] == [0, 1]  # one decision per block
    # each equals Arrow on input_layernorm(block input) with q_proj's prototypes (block inputs read by hooks)
    inputs = []
    hooks = [
        layer.register_forward_pre_hook(
            lambda m, a, k: inputs.append(a[0] if a else k["hidden_states"]), with_kwargs=True
        )
        for layer in mm.model.model.layers
    ]
    mm(ids, adapter_ids=router)
    for h in hooks:
        h.remove()
    for b, (_, ids_b) in enumerate(trace):
        x = mm.model.model.layers[b].input_layernorm(inputs[b].reshape(-1, 64))
        want, _ = router.decide_linear(f"model.layers.{b}.self_attn.q_proj", x)
        assert torch.equal(ids_b, want)
    per_linear = mm(ids, adapter_ids=ArrowRouter(ArrowConfig(granularity="per_linear"))).logits
    assert not torch.allclose(got, per_linear, atol=1e-4)  # two granularities, two routings


@torch.no_grad()
def test_one_adapter_is_every_token_on_it_in_both_granularities(adapters):
    mm = _mm(adapters, n=1)
    ids = _ids(4)
    pinned = mm(ids, adapter_ids="e0").logits
    for gran in ("per_linear", "per_block"):
        assert torch.allclose(mm(ids, adapter_ids=ArrowRouter(ArrowConfig(granularity=gran))).logits, pinned, atol=1e-5)


@torch.no_grad()
def test_runtime_adapter_load_recomputes_prototypes(adapters):
    mm = _mm(adapters, n=2)
    router = ArrowRouter(ArrowConfig(top_k=2))  # follows the model's adapters
    ids = _ids(5)
    mm(ids, adapter_ids=router)
    assert router.adapter_names == ["e0", "e1"]
    mm.load_adapter("e2", adapters["qwen3"][2])
    assert router.refresh() == ["e2"]  # the new adapter's prototypes, once
    got = mm(ids, adapter_ids=router).logits
    assert router.refresh() == []
    assert router.adapter_names == ["e0", "e1", "e2"]
    fresh = mm(ids, adapter_ids=ArrowRouter(ArrowConfig(top_k=2))).logits
    assert torch.allclose(got, fresh, atol=1e-6)
    # a new adapter under an old name: its prototypes are computed again
    mm.unload_adapter("e0")
    mm.load_adapter("e0", adapters["qwen3"][3])
    assert sorted(router.refresh()) == ["e0"]
    P, _, _ = router.prototypes("model.layers.0.self_attn.q_proj", torch.device("cpu"))
    want = top_right_singular_vector(
        mm.adapters["e0"].modules["model.layers.0.self_attn.q_proj"].A,
        mm.adapters["e0"].modules["model.layers.0.self_attn.q_proj"].B,
    )
    assert torch.allclose(P[router.adapter_names.index("e0")], want)


# ------------------------------------------------------------------------------------------ bundle, errors


@pytest.fixture
def arrow_bundle(tmp_path, adapters):
    base = tmp_path / "base"
    tiny_model("llama").save_pretrained(str(base))
    tiny_tokenizer().save_pretrained(str(base))
    write_manifest(
        tmp_path,
        {
            "name": "arrow",
            "base": "base",
            "adapters": [{"name": f"e{i}", "path": str(adapters["llama"][i])} for i in range(3)],
            "router": {"kind": "arrow", "top_k": 2, "granularity": "per_block"},
        },
    )
    return tmp_path


@torch.no_grad()
def test_bundle_of_adapters_alone_routes_by_arrow_without_training(arrow_bundle):
    from molora.bundle import run_prompt

    mm = molora.load(arrow_bundle)
    assert isinstance(mm.router, ArrowRouter)
    assert mm.router.config.top_k == 2 and mm.router.granularity == "per_block"
    assert mm.router.adapter_names == ["e0", "e1", "e2"]
    res = run_prompt(mm, "w5 w9 w40 w77", max_new_tokens=4, trace=True)
    assert len(res.answer_ids) >= 1 and set(res.adapters) <= {"e0", "e1", "e2", None}
    ids = _ids(6)
    pinned = mm(ids, adapter_ids="e0").logits
    assert not torch.allclose(mm(ids).logits, pinned, atol=1e-4)


@pytest.mark.parametrize(
    "router,match",
    [
        ({"kind": "arrow", "topk": 2}, r"unknown option\(s\) \['topk'\].*top_k"),
        ({"kind": "arrow", "top_k": 0}, r"top_k=0: use an integer >= 1"),
        ({"kind": "arrow", "granularity": "per_token"}, r"granularity='per_token': use one of per_linear, per_block"),
        ({"kind": "arrow", "threshold": 2}, r"threshold=2: a \|cosine\| in \[0, 1\]"),
        ({"kind": "arrows"}, r"router kind 'arrows': use learned, arrow"),
    ],
)
def test_bad_arrow_config_is_refused_naming_the_file_and_the_fix(arrow_bundle, router, match):
    m = json.loads((arrow_bundle / "molora.json").read_text())
    m["router"] = router
    write_manifest(arrow_bundle, m)
    with pytest.raises(BundleError, match=match) as e:
        read_bundle(arrow_bundle)
    assert "molora.json" in str(e.value)


def test_per_block_without_an_adapted_attention_projection_is_refused(tmp_path):
    path = make_peft_adapter(tmp_path / "mlp", "qwen3", targets=("up_proj", "down_proj"))
    mm = molora.attach(tiny_model("qwen3"), {"mlp": path})
    with pytest.raises(RoutingError, match="per_block.*q_proj, k_proj or v_proj.*granularity='per_linear'"):
        ArrowRouter(ArrowConfig(granularity="per_block")).bind(mm)
    with torch.no_grad():  # per-linear works with any targets
        mm(_ids(7), adapter_ids=ArrowRouter(ArrowConfig()))


# ------------------------------------------------------------------------------------------ engine


@pytest.mark.parametrize("gran", ["per_linear", "per_block"])
@torch.no_grad()
def test_engine_equals_generate_and_respects_allowed_adapters(adapters, gran):
    mm = _mm(adapters, n=3)
    mm.router = ArrowRouter(ArrowConfig(granularity=gran, top_k=2), ["e0", "e1", "e2"]).bind(mm)
    engine = Engine(mm, ENGINE)
    p, q = _ids(8, (13,)).tolist(), _ids(9, (7,)).tolist()
    params = SamplingParams(max_new_tokens=5)
    outs = engine.generate(
        [p, p, q],
        params,
        routing=["arrow", "arrow", "auto"],
        adapter=[None, None, "e2"],
        allowed_adapters=[None, ["e1"], None],
    )
    ref = mm.generate(torch.tensor([p]), adapter_ids=mm.router, max_new_tokens=5)[0, len(p) :].tolist()
    assert outs[0].new_token_ids == ref
    only = ArrowRouter(ArrowConfig(granularity=gran, top_k=2), ["e1"])
    ref1 = mm.generate(torch.tensor([p]), adapter_ids=only, max_new_tokens=5)[0, len(p) :].tolist()
    assert outs[1].new_token_ids == ref1
    ref2 = mm.generate(torch.tensor([q]), adapter_ids="e2", max_new_tokens=5)[0, len(q) :].tolist()
    assert outs[2].new_token_ids == ref2
    mm.router = VocabRouter([(0, 50, "e0")])
    with pytest.raises(RoutingError, match="routing='arrow' runs the router of that name"):
        Engine(mm, EngineConfig(max_model_len=64)).add_request(p, params, routing="arrow")


def test_server_accepts_the_arrow_routing_option():
    from molora.server.protocol import MoloraOptions

    assert MoloraOptions(routing="arrow").routing == "arrow"


# ------------------------------------------------------------------------------------------ prompt mode, calibration


def _calib_rows(n=12, seed=40):
    g = torch.Generator().manual_seed(seed)
    return [
        torch.randint(3, VOCAB, (int(torch.randint(6, 20, (1,), generator=g)),), generator=g).tolist() for _ in range(n)
    ]


@pytest.mark.parametrize(
    "bad, match",
    [
        (dict(prompt=True), "per_block"),
        (dict(granularity="per_block", prompt=True, top_k=2), "top_k=1"),
        (dict(granularity="per_block", rms_threshold=-1.0), "ratio >= 0"),
        (dict(granularity="per_block", prompt_share=0.2), "needs prompt=true"),
        (dict(granularity="per_block", prompt=True, calibration_prompts=2), "calibration_prompts"),
    ],
)
def test_prompt_mode_and_calibration_settings_are_checked(bad, match):
    with pytest.raises(RoutingError, match=match):
        ArrowConfig(**bad)


@torch.no_grad()
def test_calibration_scores_a_later_adapter_without_another_forward(adapters):
    """general_rms is sqrt(vᵀ E[x̂x̂ᵀ] v) over the calibration tokens: equal to the RMS |cos| measured directly,
    for an adapter loaded after the calibration too."""
    mm = _mm(adapters, n=2)
    r = ArrowRouter(ArrowConfig(granularity="per_block", rms_threshold=1.0))
    with pytest.raises(RoutingError, match="tokenizer"):
        r.bind(mm)  # a bare model has no tokenizer to render general text
    rows = _calib_rows()
    r = ArrowRouter(ArrowConfig(granularity="per_block")).bind(mm, rows)
    mm.load_adapter("e2", adapters["qwen3"][2])
    r.refresh()
    module = r._block_linear[1]
    got = r.general_rms(module, torch.device("cpu"))
    cos = []
    for row in rows:
        ids = torch.tensor([row])
        out = mm(ids, adapter_ids=torch.full_like(ids, -1), output_hidden_states=True, use_cache=False)
        x = r._block_norm[1](out.hidden_states[1][0]).float()
        P, _, _ = r.prototypes(module, x.device)
        cos.append((x @ P.T).abs() / x.norm(dim=-1, keepdim=True))
    want = torch.cat(cos).pow(2).mean(0).sqrt()
    assert got.shape == (3,) and torch.allclose(got, want, rtol=1e-4)


def test_fill_prompt_routes_votes_fills_and_hands_the_answer_the_prompts_adapter():
    from molora.routing.base import base_only, fill_prompt_routes

    probe = torch.tensor([[-1, 1, 1, 0, -1, 2], [-1, -1, -1, -1, 0, -1], [-1, -1, -1, -1, -1, -1]])
    learned = fill_prompt_routes(probe, None, 0.0)
    assert learned[0].tolist() == [1, 1, 1, 0, 1, 2]  # -1 takes the majority; votes stay
    arrow = fill_prompt_routes(probe, None, 0.0, last_takes_top=True)
    assert arrow[0].tolist() == [1, 1, 1, 0, 1, 1]  # the last token: the prompt's adapter
    assert fill_prompt_routes(probe, None, 0.2, last_takes_top=True)[1].tolist() == [-1] * 6  # 1/6 < 0.2
    assert base_only(arrow).tolist() == [False, False, True]


def test_prompt_window_votes_over_the_last_real_tokens_only():
    from molora.routing.base import fill_prompt_routes

    # a history claimed by adapter 0, then a latest question claimed by adapter 1; row 1 left-padded by two
    probe = torch.tensor([[0, 0, 0, 0, 1, -1, 1], [-1, -1, 0, 0, 0, 1, 1]])
    mask = torch.tensor([[1, 1, 1, 1, 1, 1, 1], [0, 0, 1, 1, 1, 1, 1]])
    whole = fill_prompt_routes(probe, mask, 0.0, last_takes_top=True)
    assert whole[:, -1].tolist() == [0, 0]  # the history outvotes the question
    last3 = fill_prompt_routes(probe, mask, 0.0, last_takes_top=True, window=3)
    assert last3[:, -1].tolist() == [1, 1]  # padding is not counted in the window
    assert last3[0].tolist() == [0, 0, 0, 0, 1, 1, 1]  # claimed tokens keep their own adapter
    # the share is of the window: 2 of the last 3 claimed in row 0 (>= 0.6), 3 of 3 in row 1
    assert fill_prompt_routes(probe, mask, 0.6, window=3)[0].tolist() != [-1] * 7
    assert fill_prompt_routes(probe, mask, 0.7, window=3)[0].tolist() == [-1] * 7
    with pytest.raises(RoutingError, match="prompt_window"):
        ArrowConfig(granularity="per_block", prompt_window=8)  # needs prompt=true


@torch.no_grad()
def test_prompt_mode_engine_equals_generate_and_generation_follows_the_prompt(adapters):
    """Prompt-level Arrow: a probe on the base model decides each prompt token at the source block, the prompt
    votes, the answer carries the prompt's adapter at every block; the engine (probe phase, carry) gives the
    tokens MoLoRAModel.generate gives, and a prompt kept on the base model answers as the base model."""
    mm = _mm(adapters, n=3)
    cfg = ArrowConfig(granularity="per_block", prompt=True, rms_threshold=0.0, source_block=-1)
    mm.router = ArrowRouter(cfg, ["e0", "e1", "e2"]).bind(mm, _calib_rows())
    engine = Engine(mm, ENGINE)
    p, q = _ids(8, (13,)).tolist(), _ids(9, (7,)).tolist()
    params = SamplingParams(max_new_tokens=5)
    outs = engine.generate([p, q], params, routing="auto")
    for prompt, out in zip([p, q], outs):
        ref = mm.generate(torch.tensor([prompt]), adapter_ids=mm.router, max_new_tokens=5)[0, len(prompt) :].tolist()
        assert out.new_token_ids == ref
    # the prompt's vote decides the answer: its last token (which the answer carries) takes the most voted adapter
    mm(torch.tensor([p]), adapter_ids=mm.router, use_cache=False)  # a probe forward (every token unknown)
    votes = mm.last_carry[0]
    routes = mm.router.prompt_routes(votes[None])[0]
    assert int(routes[-1]) >= 0 and int(routes[-1]) == int(torch.bincount(votes[votes >= 0]).argmax())
    # a threshold no token reaches keeps the prompt, and so its answer, on the base model
    mm.router = ArrowRouter(
        ArrowConfig(granularity="per_block", prompt=True, rms_threshold=1e6), ["e0", "e1", "e2"]
    ).bind(mm, _calib_rows())
    e2 = Engine(mm, ENGINE)
    got, base = e2.generate([p, p], params, routing=["auto", "none"])
    assert got.new_token_ids == base.new_token_ids
    assert got.new_token_ids != outs[0].new_token_ids  # the routed answer differed: the test can tell
