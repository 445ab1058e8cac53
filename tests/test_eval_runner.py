"""molora.eval.runner and molora.routing.merge on a tiny random Llama with a character-level stand-in tokenizer.

Invariants: each routing mode hands generation the routing it names (oracle: the task's adapter; merge:
all adapters at 1/K, equal to PEFT's exact "cat" merge); mixed items are answered turn by turn in the
rendering router training uses, each part scored on its own; batching does not change greedy answers;
the summary and predictions records have their documented fields.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from molora.bundle import AdapterEntry, Bundle
from molora.data import generate, generate_mixed, write_bbh_file, write_jsonl
from molora.eval.runner import (
    CHATML,
    EvalError,
    evaluate,
    generate_batch,
    save_results,
    sequence_choice,
    turn_text,
)
from molora.model.attach import attach
from molora.routing import OracleRouter, SequenceRouter
from molora.routing.learned import LearnedRouter, LearnedRouterConfig
from molora.routing.merge import UniformMergeRouter
from tests.conftest import gen, make_peft_adapter, tiny_model

SPECIALS = {"<|im_end|>": 1, "<|im_start|>": 2}


class ToyTokenizer:
    """Characters to ids 4..99 ("\\n" = 99), ChatML markers to 1 (= eos) and 2; pad 0, unknown 3."""

    pad_token_id, eos_token_id, unk_token_id = 0, 1, 3

    def __call__(self, text: str, add_special_tokens: bool = False) -> dict:
        ids, i = [], 0
        while i < len(text):
            special = next((s for s in SPECIALS if text.startswith(s, i)), None)
            if special:
                ids.append(SPECIALS[special])
                i += len(special)
                continue
            c = text[i]
            ids.append(99 if c == "\n" else ord(c) - 28 if 32 <= ord(c) <= 126 else 3)
            i += 1
        return {"input_ids": ids}

    def decode(self, ids, skip_special_tokens: bool = False) -> str:
        inv = {v: k for k, v in SPECIALS.items()}
        out = []
        for t in ids:
            if t in inv:
                out.append("" if skip_special_tokens else inv[t])
            elif t == 99:
                out.append("\n")
            elif 4 <= t < 99:
                out.append(chr(t + 28))
        return "".join(out)

    def convert_tokens_to_ids(self, token: str) -> int:
        return SPECIALS.get(token, self.unk_token_id)


TOK = ToyTokenizer()


@pytest.fixture(scope="module")
def adapters(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("adapters")
    return {
        "count": make_peft_adapter(root / "count", "llama", r=4, seed=1),
        "nav": make_peft_adapter(root / "nav", "llama", r=2, seed=2),
    }


def make_mm(adapters: dict[str, Path], router_bias: int | None = 0, router=None):
    """Tiny Llama + adapters "count" (object_counting) and "nav" (navigate) + `router`, by default a
    learned router that sends every token to adapter index `router_bias` (None: to "none")."""
    mm = attach(tiny_model("llama"), adapters, tokenizer=TOK, router=router)
    mm.bundle = Bundle(
        folder=Path("."),
        name="toy",
        base="toy",
        adapters=(
            AdapterEntry("count", adapters["count"], tasks=("object_counting",)),
            AdapterEntry("nav", adapters["nav"], tasks=("navigate",)),
        ),
        prompt_template=CHATML,
        stop=("<|im_end|>",),
    )
    if router is not None:
        return mm
    router = LearnedRouter(LearnedRouterConfig(adapter_names=("count", "nav"), hidden_size=64, num_blocks=2))
    with torch.no_grad():
        router.bias[:, 2 if router_bias is None else router_bias] = 10.0
    mm.router = router
    return mm


def spy(mm, monkeypatch) -> list:
    """Record (input_ids, adapter_ids) of every mm.generate call, still running the real generate."""
    calls, real = [], mm.generate

    def generate_spy(input_ids, attention_mask=None, **kw):
        calls.append((input_ids.clone(), kw["adapter_ids"]))
        return real(input_ids, attention_mask, **kw)

    monkeypatch.setattr(mm, "generate", generate_spy)
    return calls


def bbh_file(tmp_path: Path, task: str, n: int = 3) -> str:
    path = tmp_path / f"{task}.json"
    write_bbh_file(path, generate(task, n, seed=7))
    return f"bbh:{path}"


def mixed_file(tmp_path: Path, n: int = 3) -> tuple[str, list[dict]]:
    rows = generate_mixed(["object_counting", "navigate"], n, seed=3)
    path = tmp_path / "mixed.jsonl"
    write_jsonl(path, rows)
    return f"mixed:{path}", rows


# ------------------------------------------------------------------------------------------- merge


def test_merge_router_gives_every_token_all_adapters_at_one_over_k():
    routing = UniformMergeRouter().route(torch.zeros(2, 5, dtype=torch.long), ["x", "y", "z"])
    assert routing.adapter_ids.shape == (2, 5, 3) and routing.weights.shape == (2, 5, 3)
    assert routing.adapter_ids[1, 4].tolist() == [0, 1, 2]
    assert torch.allclose(routing.weights, torch.full((2, 5, 3), 1 / 3))
    assert UniformMergeRouter(["z", "x"]).route(
        torch.zeros(1, 1, dtype=torch.long), ["x", "y", "z"]
    ).adapter_ids.flatten().tolist() == [2, 0]


def test_merge_router_equals_peft_cat_merge_of_averaged_deltas(adapters):
    from peft import PeftModel

    peft = PeftModel.from_pretrained(tiny_model("llama"), str(adapters["count"]), adapter_name="count")
    peft.load_adapter(str(adapters["nav"]), adapter_name="nav")
    peft.add_weighted_adapter(["count", "nav"], [0.5, 0.5], "merged", combination_type="cat")
    peft.set_adapter("merged")
    ids = torch.randint(4, 99, (2, 9), generator=gen(0))
    with torch.no_grad():
        want = peft(input_ids=ids).logits
        mm = attach(tiny_model("llama"), adapters)
        got = mm(ids, adapter_ids=UniformMergeRouter()).logits
        single = mm(ids, adapter_ids="count").logits
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
    assert not torch.allclose(got, single, atol=1e-4)  # the merge really differs from one adapter


# ------------------------------------------------------------------------------------------- modes


def test_each_mode_hands_generation_its_routing(adapters, tmp_path, monkeypatch):
    mm = make_mm(adapters, router_bias=1)
    calls = spy(mm, monkeypatch)
    counting, navigate, sorting = (bbh_file(tmp_path, t) for t in ("object_counting", "navigate", "word_sorting"))
    kw = dict(max_new_tokens=2, progress=False)

    evaluate(mm, counting, "base", **kw)
    assert isinstance(calls[-1][1], SequenceRouter) and calls[-1][1].adapters is None
    evaluate(mm, counting, "adapter:nav", **kw)
    assert calls[-1][1] == "nav"
    evaluate(mm, counting, "merge", **kw)
    assert isinstance(calls[-1][1], UniformMergeRouter)
    evaluate(mm, counting, "learned", **kw)
    assert calls[-1][1] is mm.router
    for spec, want in ((counting, "count"), (navigate, "nav"), (sorting, None)):  # sorting: no adapter's task
        evaluate(mm, spec, "oracle", **kw)
        ids, router = calls[-1]
        assert isinstance(router, OracleRouter)
        assert {label for row in router.labels for label in row} == {want}
        assert len(router.labels[0]) == ids.shape[1]
    evaluate(mm, counting, "sequence", **kw)  # the router sends everything to "nav"
    assert isinstance(calls[-1][1], SequenceRouter) and calls[-1][1].adapters == ["nav"] * 3


def test_sequence_vote_falls_back_to_base_when_no_token_picks_an_adapter(adapters):
    assert sequence_choice(make_mm(adapters, router_bias=None), ["I have a cat.", "x"]) == [None, None]
    assert sequence_choice(make_mm(adapters, router_bias=0), ["I have a cat.", "x"]) == ["count", "count"]


def test_sequence_vote_counts_only_the_question_tokens_of_each_row(adapters):
    from molora.routing import VocabRouter

    mm = make_mm(adapters, router=VocabRouter([(20, 30, "count"), (37, 96, "nav")]))  # digits, letters
    # the template's own letters ("user", "assistant") would outvote "12 a" if they were counted
    got = sequence_choice(mm, ["a long question 1", "12 a", "1 ab", "x"], batch_size=3)
    assert got == ["nav", "count", "nav", "nav"]


def test_bad_modes_are_refused_with_the_choices(adapters, tmp_path):
    mm = make_mm(adapters)
    spec = bbh_file(tmp_path, "navigate")
    with pytest.raises(EvalError, match="loaded"):
        evaluate(mm, spec, "adapter:nope", progress=False)
    with pytest.raises(EvalError, match="use one of"):
        evaluate(mm, spec, "per-token", progress=False)
    mm.router = None
    with pytest.raises(EvalError, match="router"):
        evaluate(mm, spec, "learned", progress=False)


def test_batched_greedy_answers_do_not_depend_on_the_batch(adapters):
    mm = make_mm(adapters)
    rows = [TOK(turn_text(CHATML, q))["input_ids"] for q in ("a", "a longer question", "mid one")]
    alone = [generate_batch(mm, [r], "count", [5], [1])[0][0] for r in rows]
    together, _ = generate_batch(mm, rows, "count", [5, 5, 5], [1])
    assert together == alone


# ------------------------------------------------------------------------------------------- mixed


def scripted(mm, monkeypatch, answer_for) -> list:
    """Replace mm.generate by a model that answers each row's last question with answer_for(question)."""
    calls = []

    def fake_generate(input_ids, attention_mask=None, *, adapter_ids=None, eos_token_id=None, pad_token_id=0, **kw):
        calls.append((input_ids.clone(), adapter_ids))
        new = []
        for row, mask in zip(input_ids.tolist(), attention_mask.tolist()):
            text = TOK.decode([t for t, m in zip(row, mask) if m])
            question = text.rsplit("<|im_start|>user\n", 1)[1].split("<|im_end|>")[0]
            new.append(TOK(answer_for(question))["input_ids"] + [eos_token_id[0]])
        width = max(map(len, new))
        new = torch.tensor([r + [pad_token_id] * (width - len(r)) for r in new])
        return torch.cat([input_ids, new], 1)

    monkeypatch.setattr(mm, "generate", fake_generate)
    return calls


def test_mixed_items_are_answered_turn_by_turn_and_scored_per_part(adapters, tmp_path, monkeypatch):
    from molora.train.default import labelled_sequence

    mm = make_mm(adapters)
    spec, rows = mixed_file(tmp_path)
    targets = {p["input"]: p["target"] for r in rows for p in r["parts"]}
    # right on object_counting, wrong on navigate ("Maybe")
    calls = scripted(mm, monkeypatch, lambda q: targets[q] if "How many" in q else "Maybe")
    summary, preds = evaluate(mm, spec, "learned", batch_size=2, progress=False)

    assert [p["input"] for p in preds] == [p["input"] for r in rows for p in r["parts"]]
    assert all(p["correct"] == (p["task"] == "object_counting") for p in preds)
    assert [p["prediction"] for p in preds if p["task"] == "navigate"] == ["Maybe"] * 3
    assert summary["n"] == 6 and summary["items"] == 3 and summary["item_accuracy"] == 0.0
    assert summary["accuracy"] == 50.0 and summary["by_task"] == {"object_counting": 100.0, "navigate": 0.0}
    assert len(calls) == 4  # two turns, batches of two

    # turn 2 sees turn 1's question and answer exactly as router training renders them
    first = rows[0]["parts"]
    segments = [
        {"prompt": first[0]["input"], "completion": preds[0]["prediction"], "label": None},
        {"prompt": first[1]["input"], "completion": "", "label": None},
    ]
    want = labelled_sequence(TOK, segments, ["count", "nav"]).ids[:-1]  # drop the empty answer's end token
    seen = [row[mask].tolist() for ids, _ in calls[2:] for row, mask in zip(ids, ids != 0)]
    assert want in seen


def test_mixed_oracle_labels_each_part_with_its_adapter(adapters, tmp_path, monkeypatch):
    mm = make_mm(adapters)
    spec, rows = mixed_file(tmp_path, n=2)
    calls = spy(mm, monkeypatch)
    summary, preds = evaluate(mm, spec, "oracle", max_new_tokens=3, progress=False)
    assert len(preds) == 4 and summary["items"] == 2
    adapter = {"object_counting": "count", "navigate": "nav"}
    ids, router = calls[-1]  # turn 2: first part's tokens, then the second's
    assert len(router.labels) == 2
    for b, labels in enumerate(router.labels):
        labels = labels[-int((ids[b] != 0).sum()) :]  # without the left padding
        row = next(r for r in rows if r["parts"][0]["input"] in TOK.decode(ids[b].tolist()))
        first, second = (adapter[p["task"]] for p in row["parts"])
        switch = labels.index(second)
        assert set(labels[:switch]) == {first} and set(labels[switch:]) == {second}
        turn2 = TOK(turn_text(CHATML, row["parts"][1]["input"]))["input_ids"]
        assert len(labels) - switch == len(turn2)


# ------------------------------------------------------------------------------------------- records


def test_summary_and_predictions_files_have_the_documented_fields(adapters, tmp_path):
    mm = make_mm(adapters)
    summary, preds = evaluate(
        mm, bbh_file(tmp_path, "navigate", n=4), "adapter:nav", max_new_tokens=2, batch_size=3, progress=False
    )
    save_results(summary, preds, tmp_path / "out" / "s.json", tmp_path / "out" / "p.jsonl")
    written = json.loads((tmp_path / "out" / "s.json").read_text())
    assert {
        "task",
        "routing",
        "n",
        "accuracy",
        "lenient_accuracy",
        "majority_baseline",
        "tokens_per_s",
        "seconds",
    } <= set(written)
    assert written["task"] == "navigate" and written["routing"] == "adapter:nav" and written["n"] == 4
    assert written["majority_baseline"] == 50.0 and 0 <= written["accuracy"] <= written["lenient_accuracy"] <= 100
    lines = [json.loads(x) for x in (tmp_path / "out" / "p.jsonl").read_text().splitlines()]
    assert len(lines) == 4 and all({"input", "target", "prediction", "correct"} <= set(x) for x in lines)
    assert [x["target"] for x in lines] == [it.target for it in generate("navigate", 4, seed=7)]


class KeywordChooser:
    """A per-request chooser (molora.routing.confidence's interface): "count" for a counting question, else "nav";
    records the questions it was asked."""

    def __init__(self) -> None:
        self.asked: list[list[str]] = []

    def choose_per_request(self, mm, questions, *, batch_size: int = 16):
        self.asked.append(list(questions))
        return ["count" if "How many" in q else "nav" for q in questions]


@pytest.mark.parametrize("mode", ["sequence", "turn"])
def test_turn_mode_chooses_each_turn_on_its_own_question_and_sequence_once_for_the_conversation(
    adapters, tmp_path, monkeypatch, mode
):
    mm = make_mm(adapters)
    mm._modules.pop("router", None)  # the learned router is a registered submodule
    chooser = KeywordChooser()
    mm.router = chooser
    spec, rows = mixed_file(tmp_path, n=2)
    calls = spy(mm, monkeypatch)
    evaluate(mm, spec, mode, max_new_tokens=2, batch_size=2, progress=False)
    firsts = [r["parts"][0]["input"] for r in rows]
    seconds = [r["parts"][1]["input"] for r in rows]
    assert all({p["task"] for p in r["parts"]} == {"object_counting", "navigate"} for r in rows)
    per_turn = [[c[1].adapters for c in calls[:1]], [c[1].adapters for c in calls[1:]]]
    if mode == "turn":
        assert sorted(map(sorted, chooser.asked)) == sorted([sorted(firsts), sorted(seconds)])
        want = [["count" if "How many" in q else "nav" for q in qs] for qs in (firsts, seconds)]
    else:  # one choice on the questions joined, kept for both turns
        assert chooser.asked == [["\n\n".join(r["parts"][i]["input"] for i in range(2)) for r in rows]]
        joined = ["count" if "How many" in "\n\n".join(p["input"] for p in r["parts"]) else "nav" for r in rows]
        want = [joined, joined]
    assert len(calls) == 2  # one batch per turn
    assert sorted(per_turn[0][0]) == sorted(want[0]) and sorted(per_turn[1][0]) == sorted(want[1])
    # every item mixes counting and navigate: per turn both adapters run, once per conversation only "count"
    assert set(per_turn[0][0] + per_turn[1][0]) == ({"count", "nav"} if mode == "turn" else {"count"})
