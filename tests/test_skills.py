"""molora.data.skills / molora.data.mixed: generators are deterministic and their targets are right.

Each target is recomputed here from the input text alone, by code independent of the generators.
"""

from __future__ import annotations

import ast
import collections
import json
import re
from pathlib import Path

import pytest

from molora.data import (
    EVAL_SEED_BASE,
    SKILLS,
    TRAIN_SEED_BASE,
    Item,
    dedupe_against,
    generate,
    generate_mixed,
    read_jsonl,
    render_mixed,
    split_answers,
    write_bbh_file,
    write_jsonl,
)

N = 300


@pytest.fixture(scope="module")
def items() -> dict[str, list[Item]]:
    return {task: generate(task, N, TRAIN_SEED_BASE) for task in SKILLS}


def test_generate_is_deterministic_and_seed_dependent(items):
    for task in SKILLS:
        assert generate(task, N, TRAIN_SEED_BASE) == items[task]
        assert generate(task, 20, TRAIN_SEED_BASE + 1) != items[task][:20]
        assert len({it.input for it in items[task]}) == N  # distinct inputs
        assert all(it.task == task for it in items[task])


def test_unknown_task_error_names_the_valid_ones():
    with pytest.raises(ValueError, match="object_counting.*navigate"):
        generate("boolean_expressions", 3, 0)


# ----------------------------------------------------------------- object_counting

_KINDS = {  # singular nouns per category, written out independently of the generator
    "fruits": "apple banana strawberry peach orange plum raspberry grape nectarine blackberry",
    "vegetables": "yam cauliflower garlic lettuce_head head_of_broccoli potato stalk_of_celery onion cabbage carrot",
    "animals": "fish bear frog chicken mouse cat pig rabbit duck goat dog cow donkey snail snake",
    "musical instruments": "flute piano trombone violin accordion clarinet drum trumpet",
    "objects": "stove lamp fridge chair microwave couch oven car toaster table bed",
}
_COUNTS = {"a": 1, "an": 1, "two": 2, "three": 3, "four": 4, "five": 5}


def _singular(noun: str) -> str:
    irregular = {"mice": "mouse", "fish": "fish", "heads of broccoli": "head of broccoli"}
    irregular |= {"stalks of celery": "stalk of celery", "lettuce heads": "lettuce head"}
    if noun in irregular:
        return irregular[noun]
    for plural, single in (("ies", "y"), ("ches", "ch"), ("oes", "o"), ("s", "")):
        if noun.endswith(plural):
            return noun[: -len(plural)] + single
    return noun


def _category(noun: str, count: int) -> str:
    single = noun if count == 1 else _singular(noun)
    hits = [c for c, words in _KINDS.items() if single.replace(" ", "_") in words.split()]
    assert len(hits) == 1, noun
    return hits[0]


def test_object_counting_format_and_target(items):
    for it in items["object_counting"]:
        m = re.fullmatch(r"I have (.+), and (.+)\. How many (\w+(?: \w+)?) do I have\?", it.input)
        assert m, it.input
        phrases = m.group(1).split(", ") + [m.group(2)]
        total = 0
        for phrase in phrases:
            word, noun = phrase.split(" ", 1)
            assert (word == "an") == (noun[0] in "aeiou") or word not in ("a", "an"), phrase
            if _category(noun, _COUNTS[word]) == m.group(3):
                total += _COUNTS[word]
        assert it.target == str(total) and 2 <= total <= 18
        assert len(phrases) >= 2


# ----------------------------------------------------------------- multistep_arithmetic_two

_GROUP = r"\((-?\d) ([-+*]) (-?\d) ([-+*]) (-?\d) ([-+*]) (-?\d)\)"


def test_multistep_arithmetic_format_and_target(items):
    for it in items["multistep_arithmetic_two"]:
        assert re.fullmatch(rf"\({_GROUP} [-+*] {_GROUP}\) =", it.input), it.input
        expr = it.input.removesuffix(" =")
        value = eval(compile(ast.parse(expr, mode="eval"), "<expr>", "eval"), {"__builtins__": {}})
        assert it.target == str(value)


# ----------------------------------------------------------------- word_sorting


def test_word_sorting_format_and_target(items):
    prefix = "Sort the following words alphabetically: List: "
    for it in items["word_sorting"]:
        assert it.input.startswith(prefix)
        words = it.input[len(prefix) :].split(" ")
        assert 2 <= len(words) <= 20 and len(set(words)) == len(words)
        assert all(re.fullmatch(r"[a-z]{3,}", w) for w in words)
        assert it.target == " ".join(sorted(words))


# ----------------------------------------------------------------- dyck_languages


def test_dyck_format_and_target(items):
    prefix = "Complete the rest of the sequence, making sure that the parentheses are closed properly. Input: "
    pairs = {"(": ")", "[": "]", "{": "}", "<": ">"}
    for it in items["dyck_languages"]:
        assert it.input.startswith(prefix)
        tokens = it.input[len(prefix) :].split(" ")
        assert len(tokens) >= 2 and all(t in "([{<)]}>" for t in tokens)
        stack = []
        for t in tokens:
            if t in pairs:
                stack.append(pairs[t])
            else:
                assert stack and stack.pop() == t, it.input
        assert 1 <= len(stack) <= 3
        assert it.target == " ".join(reversed(stack))


# ----------------------------------------------------------------- navigate

_NAV_Q = "If you follow these instructions, do you return to the starting point? "
_NAV_OPTIONS = "\nOptions:\n- Yes\n- No"


def _walk(instructions: list[str]) -> tuple[int, int]:
    x = y = 0
    dx, dy = 0, 1
    moves = {"forward": (0, 1), "backward": (0, -1), "left": (-1, 0), "right": (1, 0)}
    for ins in instructions:
        m = re.fullmatch(r"Take (\d+) steps?(?: (forward|backward|left|right))?", ins)
        if m:
            n = int(m.group(1))
            assert 1 <= n <= 10 and (n == 1) == ins.startswith("Take 1 step") and not ins.startswith("Take 1 steps")
            mx, my = moves[m.group(2)] if m.group(2) else (dx, dy)
            x, y = x + n * mx, y + n * my
        elif ins == "Turn left":
            dx, dy = -dy, dx
        elif ins == "Turn right":
            dx, dy = dy, -dx
        elif ins == "Turn around":
            dx, dy = -dx, -dy
        else:
            raise AssertionError(f"unknown instruction {ins!r}")
    return x, y


def test_navigate_format_target_and_balance(items):
    counts = collections.Counter()
    for it in items["navigate"]:
        assert it.input.startswith(_NAV_Q) and it.input.endswith(_NAV_OPTIONS)
        body = it.input[len(_NAV_Q) : -len(_NAV_OPTIONS)]
        assert body.endswith(".")
        instructions = body[:-1].split(". ")
        forward = instructions[0] == "Always face forward"
        if forward:
            instructions = instructions[1:]
            assert all(re.search(r"(forward|backward|left|right)$", i) for i in instructions)
        else:
            assert not any(re.search(r"(forward|backward|left|right)$", i) for i in instructions if "Take" in i)
        assert 2 <= len(instructions) <= 10
        assert it.target == ("Yes" if _walk(instructions) == (0, 0) else "No")
        counts[(forward, it.target)] += 1
    assert counts[(True, "Yes")] + counts[(False, "Yes")] == N // 2
    assert all(c > N // 8 for c in counts.values()), counts  # both variants, both answers


# ----------------------------------------------------------------- seeds, dedupe, mixed, files


def test_dedupe_against_drops_shared_inputs(items):
    train = items["dyck_languages"]
    held_out = generate("dyck_languages", N, EVAL_SEED_BASE) + train[:5]
    kept = dedupe_against(held_out, train)
    assert not {it.input for it in kept} & {it.input for it in train}
    assert len(kept) <= N


def test_generate_mixed_parts_are_different_skills():
    rows = generate_mixed(SKILLS, 40, 7, parts=2)
    assert rows == generate_mixed(SKILLS, 40, 7, parts=2)
    for row in rows:
        tasks = [p["task"] for p in row["parts"]]
        assert len(tasks) == 2 and len(set(tasks)) == 2 and set(tasks) <= set(SKILLS)
    assert len({tuple(p["task"] for p in r["parts"]) for r in rows}) > 5
    with pytest.raises(ValueError, match="different skills"):
        generate_mixed(["navigate", "navigate"], 3, 0, parts=2)


def test_render_mixed_spans_and_split_answers():
    rows = generate_mixed(["navigate", "word_sorting", "dyck_languages"], 5, 1, parts=3)
    for row in rows:
        text = render_mixed(row["parts"])
        for i, (part, (a, b), (c, d)) in enumerate(zip(row["parts"], text.prompt_spans, text.target_spans), 1):
            assert text.prompt[a:b] == f"Question {i}: {part['input']}"
            assert text.target[c:d] == f"Answer {i}: {part['target']}"
        assert split_answers(text.target, 3) == [p["target"] for p in row["parts"]]
    assert split_answers("Yes\n\n] )\n", 3) == ["Yes", "] )", ""]


def test_files_round_trip(tmp_path: Path, items):
    rows = generate_mixed(SKILLS, 4, 3)
    write_jsonl(tmp_path / "m.jsonl", rows)
    assert read_jsonl(tmp_path / "m.jsonl") == rows
    write_jsonl(tmp_path / "i.jsonl", items["navigate"][:3])
    assert [Item(**r) for r in read_jsonl(tmp_path / "i.jsonl")] == items["navigate"][:3]
    write_bbh_file(tmp_path / "navigate.json", items["navigate"][:3])
    data = json.loads((tmp_path / "navigate.json").read_text())
    assert data == {"examples": [{"input": it.input, "target": it.target} for it in items["navigate"][:3]]}


def test_data_modules_do_not_import_torch():
    root = Path(__file__).resolve().parents[1] / "molora"
    for name in ("data/__init__.py", "data/skills.py", "data/mixed.py", "eval/tasks.py", "eval/extract.py"):
        path = root / name
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
            names += [node.module or ""] if isinstance(node, ast.ImportFrom) else []
            assert not any(n.split(".")[0] in ("torch", "numpy", "transformers") for n in names), path


def test_worked_solutions_end_with_the_target_for_every_worked_skill():
    from molora.data.solutions import WORKED_TASKS, worked_solution
    from molora.eval.extract import strict_span

    for task in WORKED_TASKS:
        for it in generate(task, 200, seed=77):
            sol = worked_solution(task, it.input, it.target)
            assert sol.endswith(f"So the answer is {it.target}.")
            assert strict_span(sol) == it.target


def test_navigate_worked_solution_tracks_position_and_heading():
    from molora.data.solutions import worked_solution

    q = (
        "If you follow these instructions, do you return to the starting point? Take 3 steps. Turn left. "
        "Take 3 steps. Turn around. Take 3 steps. Turn right. Take 3 steps.\nOptions:\n- Yes\n- No"
    )
    assert worked_solution("navigate", q, "Yes") == (
        "Start at (0, 0) facing north. Take 3 steps north: y 0 + 3 = 3, now (0, 3). Turn left: north -> west. "
        "Take 3 steps west: x 0 - 3 = -3, now (-3, 3). Turn around: west -> east. Take 3 steps east: "
        "x -3 + 3 = 0, now (0, 3). Turn right: east -> south. Take 3 steps south: y 3 - 3 = 0, now (0, 0). "
        "(0, 0) is the start. So the answer is Yes."
    )
    fixed = (
        "If you follow these instructions, do you return to the starting point? Always face forward. "
        "Take 2 steps right. Take 1 step backward.\nOptions:\n- Yes\n- No"
    )
    assert worked_solution("navigate", fixed, "No") == (
        "Take 2 steps right: x 0 + 2 = 2, now (2, 0). Take 1 step backward: y 0 - 1 = -1, now (2, -1). "
        "(2, -1) is not the start. So the answer is No."
    )
    with pytest.raises(ValueError, match="target"):
        worked_solution("navigate", fixed, "Yes")  # a wrong target is caught, not trained on
    with pytest.raises(ValueError, match="not understood"):
        worked_solution("navigate", fixed.replace("Take 2 steps right.", "Jump twice."), "No")


def test_arithmetic_worked_solution_writes_each_operation_next_to_its_operands():
    from molora.data.solutions import worked_solution

    q = "((-1 + 2 * 3 - 4) * (5 - -6)) ="
    assert worked_solution("multistep_arithmetic_two", q, "11") == (
        "(-1 + 2 * 3 - 4): 2 * 3 = 6; -1 + 6 = 6-1 = 5; 5 - 4 = 1. (5 - -6): 5 - -6 = 5+6 = 11. "
        "1 * 11 = 11. So the answer is 11."
    )
    # every sum or difference with a negative side is rewritten on sizes, the sign outside
    q2 = "((3 - 8 + -7 - 2) - (-4 - 5 + 0 * 6)) ="
    assert worked_solution("multistep_arithmetic_two", q2, "-5") == (
        "(3 - 8 + -7 - 2): 3 - 8 = -(8-3) = -5; -5 + -7 = -(5+7) = -12; -12 - 2 = -(12+2) = -14. "
        "(-4 - 5 + 0 * 6): 0 * 6 = 0; -4 - 5 = -(4+5) = -9; -9 + 0 = -9. -14 - -9 = -(14-9) = -5. "
        "So the answer is -5."
    )
    with pytest.raises(ValueError):
        worked_solution("multistep_arithmetic_two", q, "12")  # a wrong target is caught, not trained on


def test_counting_worked_solution_judges_every_listed_item():
    from molora.data.solutions import worked_solution

    q = "I have a chair, two potatoes, a banana, and a cabbage. How many vegetables do I have?"
    assert worked_solution("object_counting", q, "3") == (
        "a chair: not a vegetable; two potatoes: 2 (total 2); a banana: not a vegetable; a cabbage: 1 (total 3). "
        "So the answer is 3."
    )
    animals = "I have a fish, an apple, and two mice. How many animals do I have?"
    assert worked_solution("object_counting", animals, "3").startswith("a fish: 1 (total 1); an apple: not an animal;")
    with pytest.raises(ValueError, match="target"):
        worked_solution("object_counting", q, "5")  # counting the distractors is caught, not trained on


def test_counting_distractors_are_frequent_and_several():
    """The distribution the generator declares (molora.data.skills.DISTRACTOR_SHARE / DISTRACTOR_KINDS), measured
    on generated questions: a distractor is an item outside the asked category."""
    from molora.data.skills import _CATEGORIES, DISTRACTOR_SHARE

    with_distractors, kinds, questions = 0, collections.Counter(), 0
    for it in generate("object_counting", 1000, seed=11):
        cat = it.input.rsplit("How many ", 1)[1][: -len(" do I have?")]
        if cat == "objects":
            continue
        questions += 1
        names = {n for pair in _CATEGORIES[cat] for n in pair}
        listing = it.input[len("I have ") : it.input.index(". How many")]
        other = [p for p in listing.replace(", and ", ", ").split(", ") if p.partition(" ")[2] not in names]
        with_distractors += bool(other)
        kinds[len(other)] += 1
    assert abs(with_distractors / questions - DISTRACTOR_SHARE) < 0.06
    assert all(kinds[k] > 0.05 * questions for k in (1, 2, 3, 4)) and max(kinds) == 4


def test_test2_items_are_fresh_distinct_and_disjoint_from_val_and_test():
    from molora.eval.heldout import EARLIER_SIZES, held_out

    banned = {generate("navigate", 3, 1)[0].input}  # a "training" input: never drawn
    for task in ("object_counting", "navigate"):
        items, _ = held_out(task, 120, banned, split="test2")
        inputs = [it.input for it in items]
        assert len(inputs) == len(set(inputs)) == 120 and not set(inputs) & banned
        earlier = {it.input for s in ("val", "test") for m in EARLIER_SIZES for it in held_out(task, m, banned, s)[0]}
        assert not set(inputs) & earlier
        assert inputs == [it.input for it in held_out(task, 120, banned, split="test2")[0]]  # the same every call
    with pytest.raises(ValueError, match="valid splits"):
        held_out("navigate", 1, set(), split="test3")
