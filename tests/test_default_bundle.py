"""The embedded default bundle on the real model: it loads offline and routes each skill to its adapter."""

from __future__ import annotations

import pytest

import molora
from molora.bundle import run_prompt
from molora.data.skills import EVAL_SEED_BASE, generate

pytestmark = [pytest.mark.slow, pytest.mark.real_model]


@pytest.fixture(scope="module")
def mm():
    return molora.load()


def test_default_bundle_names_four_skill_adapters_and_a_learned_router(mm):
    assert mm.adapter_names == ["counting", "arithmetic", "dyck", "navigate"]
    assert mm.router is not None and mm.router.adapter_names == mm.adapter_names
    assert {t for a in mm.bundle.adapters for t in a.tasks} == {
        "object_counting",
        "multistep_arithmetic_two",
        "dyck_languages",
        "navigate",
    }


@pytest.mark.parametrize(
    "task, adapter",
    [
        ("object_counting", "counting"),
        ("multistep_arithmetic_two", "arithmetic"),
        ("dyck_languages", "dyck"),
        ("navigate", "navigate"),
    ],
)
def test_learned_router_sends_each_skill_to_its_adapter(mm, task, adapter):
    item = generate(task, 1, seed=EVAL_SEED_BASE + 4321)[0]
    r = run_prompt(mm, item.input, max_new_tokens=4, trace=True)
    question = r.adapters[3 : len(r.prompt_ids)]  # after "<|im_start|>user\n"
    assert question.count(adapter) >= 0.8 * len(question), (task, question)


def test_demo_what_make_run_shows(tmp_path, capsys):
    """`molora demo` (the `make run` job): one routed answer per skill plus a two-skill message, and the page."""
    from molora.cli import main

    page = tmp_path / "routing.html"
    assert main(["demo", "--max-tokens", "6", "--html", str(page)]) == 0
    out = capsys.readouterr().out
    assert out.count("== ") == 6 and "== two skills in one message" in out and "tokens per adapter" in out
    assert "the base model alone answers the same: True" in out
    assert "<html" in page.read_text().lower()


def test_router_data_always_trains_the_positions_that_pick_each_answers_first_token(mm):
    """The assistant header of every turn is a key position, labelled with that turn's adapter."""
    from molora.train.default import KEY_TOKENS, labelled_sequence

    segs = [
        {"prompt": "((1 + 2) * (3 - 4)) =", "completion": "So the answer is -3.", "label": "arithmetic"},
        {
            "prompt": "I have a cat. How many animals do I have?",
            "completion": "So the answer is 1.",
            "label": "counting",
        },
    ]
    seq = labelled_sequence(mm.tokenizer, segs, mm.adapter_names, mm.bundle.prompt_template)
    assert len(seq.key) == 2 * KEY_TOKENS
    first, second = seq.key[:KEY_TOKENS], seq.key[KEY_TOKENS:]
    assert mm.tokenizer.decode([seq.ids[p] for p in first]).endswith("assistant\n")
    assert {seq.labels[p] for p in first} == {mm.adapter_names.index("arithmetic")}
    assert {seq.labels[p] for p in second} == {mm.adapter_names.index("counting")}
    answer = mm.tokenizer.decode(seq.ids[first[-1] + 1 : second[0]])
    assert answer.startswith("So the answer is -3.")  # the key ends right before the answer


@pytest.mark.parametrize(
    "prompt",
    [
        "What is the capital of France?",
        "Write a haiku about the sea.",
        "Write a short story about a robot named Unit3 who learns to paint.",
    ],
)
def test_a_general_prompt_gets_the_base_models_answer(mm, prompt):
    """The prompts a new user tries first: the router keeps them, answer included, on the base."""
    from molora.routing import SequenceRouter

    routed = run_prompt(mm, prompt, max_new_tokens=24, trace=True)
    alone = run_prompt(mm, prompt, router=SequenceRouter(None), max_new_tokens=24)
    assert routed.answer_ids == alone.answer_ids and routed.answer_ids
    assert set(routed.adapters) == {None}
