"""Short worked solutions for the training completions of skills a 135M model cannot answer in one token.

Measured: adapters trained on bare answers reached 2/20 (object_counting) and 0/20
(multistep_arithmetic_two) on held-out items. A worked solution turns each into steps a small model can do
locally (add one small count to a running total; apply one operation at a time), ending with BBH's
chain-of-thought closing "So the answer is X." — the strict scorer reads the text after "answer is".

    object_counting:          "a flute: 1 (total 1); two trumpets: 2 (total 3). So the answer is 3."
    multistep_arithmetic_two: "(-1 + 2 * 3 - 4) = (-1 + 6 - 4) = (5 - 4) = 1. (5 - -6) = 11. 1 * 11 = 11.
                               So the answer is 11."

Pure Python; knows the surface formats of the generators in `molora.data.skills`, nothing else.
"""

from __future__ import annotations

import re

from molora.data.skills import _CATEGORIES

_COUNT_WORDS = {"a": 1, "an": 1, "two": 2, "three": 3, "four": 4, "five": 5}
_QUESTION = re.compile(r"^I have (?P<items>.+)\. How many (?P<cat>[a-z ]+) do I have\?$")
_ARITH = re.compile(r"^\(\((?P<left>.+)\) (?P<op>[+\-*]) \((?P<right>.+)\)\) =$")
WORKED_TASKS = ("object_counting", "multistep_arithmetic_two")


def worked_solution(task: str, question: str, target: str) -> str:
    """The training completion for `question`: a worked solution for WORKED_TASKS, else the bare target."""
    if task == "object_counting":
        return _counting(question, target)
    if task == "multistep_arithmetic_two":
        return _arithmetic(question, target)
    return target


def _counting(question: str, target: str) -> str:
    m = _QUESTION.match(question)
    if not m:
        raise ValueError(f"not an object_counting question: {question!r}")
    names = {n for pair in _CATEGORIES[m["cat"]] for n in pair}
    total, steps = 0, []
    for phrase in re.split(r", (?:and )?", m["items"]):
        word, _, noun = phrase.partition(" ")
        if noun in names:
            total += _COUNT_WORDS[word]
            steps.append(f"{phrase}: {_COUNT_WORDS[word]} (total {total})")
    if str(total) != target:
        raise ValueError(f"worked count {total} != target {target} for {question!r}")
    return "; ".join(steps) + f". So the answer is {total}."


def _reduce(expr: str) -> tuple[list[str], int]:
    """Evaluate one flat group step by step (* first, then left to right); return the chain and value."""
    toks = expr.split()
    nums = [int(toks[0])] + [int(t) for t in toks[2::2]]
    ops = toks[1::2]
    chain = []
    while ops:
        i = ops.index("*") if "*" in ops else 0
        a, b = nums[i], nums[i + 1]
        nums[i: i + 2] = [a * b if ops[i] == "*" else a + b if ops[i] == "+" else a - b]
        del ops[i]
        if ops:
            chain.append("(" + " ".join(str(nums[0]) if k == 0 else f"{ops[k - 1]} {nums[k]}"
                                        for k in range(len(nums))) + ")")
    return chain, nums[0]


def _arithmetic(question: str, target: str) -> str:
    m = _ARITH.match(question)
    if not m:
        raise ValueError(f"not a multistep_arithmetic_two question: {question!r}")
    parts, values = [], []
    for side in ("left", "right"):
        chain, value = _reduce(m[side])
        parts.append(" = ".join([f"({m[side]})", *chain, str(value)]) + ".")
        values.append(value)
    a, b = values
    result = a * b if m["op"] == "*" else a + b if m["op"] == "+" else a - b
    if str(result) != target:
        raise ValueError(f"worked value {result} != target {target} for {question!r}")
    parts.append(f"{a} {m['op']} {b} = {result}.")
    return " ".join(parts) + f" So the answer is {result}."
