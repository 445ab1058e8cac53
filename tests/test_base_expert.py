"""The base model as a routing outcome: confidence, the prompt share, and a prompt kept wholly on the base."""

from __future__ import annotations

import json
import logging

import pytest
import torch

import molora
from molora.config import SamplingParams
from molora.engine import Engine, EngineConfig
from molora.errors import BundleError, RoutingError
from molora.routing import SequenceRouter
from molora.routing.learned import LearnedRouter, LearnedRouterConfig, decoder_layers
from tests.conftest import make_peft_adapter, tiny_model


def _router(**kw) -> LearnedRouter:
    return LearnedRouter(LearnedRouterConfig(("a", "b"), 8, 3, **kw))


def test_confidence_gives_unconfident_tokens_to_the_base_model():
    """Joint gate: probabilities (a, b, none) = (0.6, 0.3, 0.1) for token 0 and (0.9, 0.05, 0.05) for token 1."""
    logits = torch.tensor([[0.6, 0.3, 0.1], [0.9, 0.05, 0.05]]).log()
    assert _router().choose(logits)[0][:, 0].tolist() == [0, 0]
    assert _router(confidence=0.5).choose(logits)[0][:, 0].tolist() == [0, 0]
    assert _router(confidence=0.7).choose(logits)[0][:, 0].tolist() == [-1, 0]
    assert _router(confidence=0.95).choose(logits)[0][:, 0].tolist() == [-1, -1]
    ids, w = _router(confidence=0.5, top_k=2).choose(logits)  # top-2: the unconfident second choice too
    assert ids.tolist() == [[0, -1], [0, -1]] and w is not None
    # (a, b, none) = (0.3, 0.1, 0.6): "none" wins the argmax, but confidence 0.25 lets "a" claim the token
    narrow = torch.tensor([[0.3, 0.1, 0.6]]).log()
    assert _router().choose(narrow)[0][:, 0].tolist() == [-1]
    assert _router(confidence=0.25).choose(narrow)[0][:, 0].tolist() == [0]
    assert _router(confidence=0.35).choose(narrow)[0][:, 0].tolist() == [-1]
    # composable: each gate's own sigmoid; logit 1.0 -> p 0.73, logit 3.0 -> p 0.95 (threshold 0 alone: both pass)
    comp = torch.tensor([[1.0, -2.0], [-2.0, 3.0]])
    assert _router(composable=True).choose(comp)[0][:, 0].tolist() == [0, 1]
    assert _router(composable=True, confidence=0.9).choose(comp)[0][:, 0].tolist() == [-1, 1]


def test_base_expert_settings_are_checked():
    with pytest.raises(RoutingError, match=r"confidence=1.5 is outside \[0, 1\]"):
        _router(confidence=1.5)
    with pytest.raises(RoutingError, match=r"prompt_share=-0.1 is outside \[0, 1\]"):
        _router(prompt_share=-0.1, carry_blocks=1, probe_prompt=True)
    with pytest.raises(RoutingError, match="prompt_share=0.5 needs probe_prompt"):
        _router(prompt_share=0.5)


def test_a_prompt_the_probe_barely_claims_stays_wholly_on_the_base_model():
    router = _router(carry_blocks=1, probe_prompt=True, prompt_share=0.5)
    probe = torch.tensor(
        [
            [-1, -1, 1, -1, -1, -1],  # one stray token of six: the base model
            [-1, 0, 0, 1, 0, -1],  # four of six: routed, the gaps take "a"
            [-1, -1, -1, -1, -1, -1],
        ]
    )  # nothing claimed: the base model
    routes = router.prompt_routes(probe)
    assert routes.tolist() == [[-1] * 6, [0, 0, 0, 1, 0, 0], [-1] * 6]
    assert router.base_only(routes).tolist() == [True, False, True]
    mask = torch.tensor([[0, 0, 0, 0, 1, 1]])  # padding is neither claimed nor counted
    assert router.prompt_routes(torch.tensor([[0, 0, 0, 0, 1, -1]]), mask).tolist() == [[0, 0, 0, 0, 1, 1]]
    assert router.base_only(torch.tensor([[0, 0, -1, -1]]), torch.tensor([[0, 0, 1, 1]])).tolist() == [True]


def test_an_old_router_file_loads_with_a_warning_naming_what_it_lacks(tmp_path, caplog):
    folder = _router(carry_blocks=1, probe_prompt=True).save(tmp_path / "old")
    raw = json.loads((folder / "router.json").read_text())
    del raw["confidence"], raw["prompt_share"]
    (folder / "router.json").write_text(json.dumps(raw))
    with caplog.at_level(logging.WARNING, logger="molora.routing"):
        old = LearnedRouter.load(folder)
    assert old.config.confidence == 0 and old.config.prompt_share == 0
    assert str(folder / "router.json") in caplog.text and "confidence, prompt_share" in caplog.text
    caplog.clear()
    new = LearnedRouter.load(_router(carry_blocks=1, probe_prompt=True, confidence=0.4).save(tmp_path / "new"))
    assert new.config.confidence == 0.4 and not caplog.text
    raw["confidence"] = 2.0
    (folder / "router.json").write_text(json.dumps(raw))
    with pytest.raises(BundleError, match=r"router.json: confidence=2.0 is outside \[0, 1\]"):
        LearnedRouter.load(folder)


def _mm_with_router(tmp_path, none_at_last_block: bool):
    """Two adapters; every gate picks "b" except, when asked, the last block's, which picks none: the probe
    then leaves the whole prompt unclaimed."""
    paths = {
        n: make_peft_adapter(tmp_path / n, "qwen3", seed=i, targets=("q_proj", "v_proj", "down_proj"))
        for i, n in enumerate(("a", "b"))
    }
    mm = molora.attach(tiny_model("qwen3"), paths)
    cfg = LearnedRouterConfig(
        ("a", "b"),
        mm.config.hidden_size,
        len(decoder_layers(mm.model)),
        carry_blocks=1,
        probe_prompt=True,
        prompt_share=0.5,
    )
    router = LearnedRouter(cfg)
    with torch.no_grad():
        router.bias[:, 1] = 5.0
        if none_at_last_block:
            router.bias[-1, 2] = 10.0
    mm.router = router
    return mm


@torch.no_grad()
def test_a_prompt_kept_on_the_base_gets_the_base_models_answer_in_generate_and_the_engine(tmp_path):
    prompt = list(range(5, 25))
    ids = torch.tensor([prompt])
    mm = _mm_with_router(tmp_path, none_at_last_block=True)
    base = mm.generate(ids, adapter_ids=SequenceRouter(None), max_new_tokens=8)[0, len(prompt) :].tolist()
    mm.context.trace = []
    got = mm.generate(ids, adapter_ids=mm.router, max_new_tokens=8)[0, len(prompt) :].tolist()
    trace, mm.context.trace = mm.context.trace, None
    n_blocks = len(decoder_layers(mm.model))
    assert got == base
    assert all(bool((t == -1).all()) for _, t in trace[n_blocks:])  # after the probe: every block, every token
    cfg = EngineConfig(max_num_seqs=4, max_tokens_per_step=16, block_size=4, kv_budget_tokens=512, stop_at_eos=False)
    out = Engine(mm, cfg).generate([prompt], SamplingParams(max_new_tokens=8))[0]
    assert out.new_token_ids == base and set(out.token_adapters) == {None}
    # the same router with the last block claiming the prompt routes it (the comparison can tell them apart)
    routed = _mm_with_router(tmp_path / "r", none_at_last_block=False)
    assert routed.generate(ids, adapter_ids=routed.router, max_new_tokens=8)[0, len(prompt) :].tolist() != base
