"""`molora eval --task general:FILE`: base retention, empty answers and adapter tokens, and the probe-share tools."""

from __future__ import annotations

import json

import pytest
import torch

from molora.eval.general import choose_prompt_share, evaluate_general, load_general, probe_shares
from molora.eval.runner import EvalError
from molora.routing.learned import LearnedRouter, LearnedRouterConfig
from tests.test_eval_runner import adapters, make_mm  # noqa: F401  (the fixture and the toy model)


def _file(tmp_path, prompts):
    path = tmp_path / "general.jsonl"
    path.write_text("".join(json.dumps({"prompt": p, "source": "toy"}) + "\n" for p in prompts))
    return f"general:{path}"


PROMPTS = ["Write a haiku.", "What is the capital of France?", "Tell me a joke about cats, please."]


def test_base_routing_retains_every_answer_and_a_pinned_adapter_runs_every_token_on_it(adapters, tmp_path):
    mm = make_mm(adapters)
    spec = _file(tmp_path, PROMPTS)
    base, preds = evaluate_general(mm, spec, "base", max_new_tokens=6)
    assert base["retention"] == 100.0 and base["adapter_token_share"] == 0.0 and base["n"] == 3
    assert all(p["equal"] and p["base"] == p["prediction"] for p in preds)
    pinned, preds = evaluate_general(
        mm, spec, "adapter:count", max_new_tokens=6, base_answers=[p["base_ids"] for p in preds]
    )
    assert pinned["adapter_token_share"] == 100.0
    assert pinned["retention"] == round(100.0 * sum(p["equal"] for p in preds) / 3, 2)
    assert pinned["by_source"]["toy"]["n"] == 3


def test_learned_routing_counts_the_tokens_its_own_forwards_ran_on_an_adapter(adapters, tmp_path):
    spec = _file(tmp_path, PROMPTS)
    on_none = make_mm(adapters, router_bias=None)  # every gate picks "none": the base model's answers
    s, _ = evaluate_general(on_none, spec, "learned", max_new_tokens=5)
    assert s["retention"] == 100.0 and s["adapter_token_share"] == 0.0 and s["empty_where_base_answers"] == 0.0
    on_count = make_mm(adapters, router_bias=0)  # every gate picks "count"
    s, preds = evaluate_general(on_count, spec, "learned", max_new_tokens=5)
    assert s["adapter_token_share"] == 100.0
    assert all(p["adapter_tokens"] == p["tokens"] for p in preds)


def test_general_files_are_checked(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "ok"}\n{"question": "no prompt"}\n')
    with pytest.raises(EvalError, match=r"bad.jsonl:2: each line needs a non-empty string \"prompt\""):
        load_general(f"general:{bad}")
    with pytest.raises(EvalError, match="cannot read .*missing.jsonl"):
        load_general(f"general:{tmp_path / 'missing.jsonl'}")
    with pytest.raises(EvalError, match="general:FILE"):
        load_general("general:")


def test_probe_shares_and_the_prompt_share_that_separates_them(adapters):
    mm = make_mm(adapters)
    cfg = LearnedRouterConfig(
        adapter_names=("count", "nav"), hidden_size=64, num_blocks=2, carry_blocks=1, probe_prompt=True
    )
    router = LearnedRouter(cfg)
    with torch.no_grad():
        router.bias[-1, 2] = 10.0  # the last block: "none" for every token
    assert probe_shares(mm, router, PROMPTS) == [0.0, 0.0, 0.0]
    with torch.no_grad():
        router.bias[-1, 0] = 20.0  # now "count" for every token
    assert probe_shares(mm, router, PROMPTS) == [1.0, 1.0, 1.0]
    assert choose_prompt_share([0.0, 0.1, 0.5, 0.9], [0.7, 0.8]) == 0.6  # 0.9 cannot be told apart
    assert choose_prompt_share([0.0], [0.6]) == 0.3
    assert choose_prompt_share([0.2], [0.0, 0.9]) == 0.0  # a wholly unclaimed skill prompt
    skill = [0.0] + [0.8] * 199  # one in 200 may be lost (1%)
    assert choose_prompt_share([0.1, 0.2], skill) == 0.5
    assert choose_prompt_share([0.1, 0.2], skill, max_skill_lost=0.0) == 0.0
    # per skill, the bound holds for each: pooled, two low prompts of one skill are 1% of 200 and both are lost;
    # per skill they are 2% of that skill's 100, so only the lowest may be lost (0.35 kept: halfway to 0.2)
    per_skill = {"count": [0.3, 0.35] + [0.8] * 98, "nav": [0.9] * 100}
    assert choose_prompt_share([0.1, 0.2], [x for v in per_skill.values() for x in v]) == 0.5
    assert choose_prompt_share([0.1, 0.2], per_skill) == 0.275
    with pytest.raises(ValueError, match="at least one"):
        choose_prompt_share([0.1], {})
