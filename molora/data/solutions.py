"""Short worked solutions for the training completions of skills a 135M model cannot answer in one token.

Measured: adapters trained on bare answers reached 2/20 (object_counting) and 0/20
(multistep_arithmetic_two) on held-out items. A worked solution turns each into steps a small model can do
locally (add one small count to a running total; apply one operation at a time), ending with BBH's
chain-of-thought closing "So the answer is X." — the strict scorer reads the text after "answer is".

    object_counting:          "a flute: 1 (total 1); a banana: not a musical instrument; two trumpets: 2 (total 3).
                               So the answer is 3."
    multistep_arithmetic_two: "(-1 + 2 * 3 - 4): 2 * 3 = 6; -1 + 6 = 6-1 = 5; 5 - 4 = 1. (5 - -6): 5 - -6 = 5+6 = 11.
                               1 * 11 = 11. So the answer is 11."
    navigate:                 "Start at (0, 0) facing north. Take 3 steps north: y 0 + 3 = 3, now (0, 3).
                               Turn left: north -> west. Take 3 steps west: x 0 - 3 = -3, now (-3, 3).
                               (-3, 3) is not the start. So the answer is No."

Navigate keeps the whole state (position, heading) in the text, and writes each update next to what it
needs: a turn names the heading before and after it (a lookup in a 4 x 3 table, no state further back); a
move writes the one coordinate it changes as a sum of the previous value and the step count, then the new
position. Measured on the earlier format (position only): most wrong traces were heading lookups and two-digit
sums done in the head.

Arithmetic writes the sign handling of every sum or difference with a negative operand or a negative result
as an operation on sizes with the sign outside ("-7 + 3 = -(7-3) = -4"), so no step adds across zero in one
go (single steps with a negative operand failed before; experiments/arith_ops.py measures per-operation
accuracy by operation, operand signs and digits).

Pure Python; knows the surface formats of the generators in `molora.data.skills`, nothing else.
"""

from __future__ import annotations

import re

from molora.data.skills import _CATEGORIES

_COUNT_WORDS = {"a": 1, "an": 1, "two": 2, "three": 3, "four": 4, "five": 5}
_QUESTION = re.compile(r"^I have (?P<items>.+)\. How many (?P<cat>[a-z ]+) do I have\?$")
_ARITH = re.compile(r"^\(\((?P<left>.+)\) (?P<op>[+\-*]) \((?P<right>.+)\)\) =$")
_NAV_INSTRUCTIONS = re.compile(r"return to the starting point\? (?P<steps>.+?)\nOptions:", re.S)
_NAV_STEP = re.compile(
    r"Always face forward\.|Turn (?P<turn>left|right|around)\.|"
    r"Take (?P<n>\d+) steps?(?: (?P<dir>forward|backward|left|right))?\."
)
_HEADINGS = ("north", "east", "south", "west")  # clockwise, as in molora.data.skills
_HEADING_STEP = ((0, 1), (1, 0), (0, -1), (-1, 0))
_TURN = {"right": 1, "around": 2, "left": 3}  # clockwise quarter turns
_FACING = {"forward": 0, "right": 1, "backward": 2, "left": 3}  # "Always face forward" moves
WORKED_TASKS = ("object_counting", "multistep_arithmetic_two", "navigate")


def worked_solution(task: str, question: str, target: str) -> str:
    """The training completion for `question`: a worked solution for WORKED_TASKS, else the bare target."""
    if task == "object_counting":
        return _counting(question, target)
    if task == "multistep_arithmetic_two":
        return _arithmetic(question, target)
    if task == "navigate":
        return _navigate(question, target)
    return target


def _counting(question: str, target: str) -> str:
    """Every listed item judged in turn: its count added to the running total, or "not a <category>" (a
    distractor is written down and skipped, so the model sees the judgement, not a silent omission)."""
    m = _QUESTION.match(question)
    if not m:
        raise ValueError(f"not an object_counting question: {question!r}")
    names = {n for pair in _CATEGORIES[m["cat"]] for n in pair}
    one = m["cat"][:-1]  # fruits -> fruit, musical instruments -> ... instrument
    other = f"not {'an' if one[0] in 'aeiou' else 'a'} {one}"
    total, steps = 0, []
    for phrase in re.split(r", (?:and )?", m["items"]):
        word, _, noun = phrase.partition(" ")
        if noun in names:
            total += _COUNT_WORDS[word]
            steps.append(f"{phrase}: {_COUNT_WORDS[word]} (total {total})")
        else:
            steps.append(f"{phrase}: {other}")
    if str(total) != target:
        raise ValueError(f"worked count {total} != target {target} for {question!r}")
    return "; ".join(steps) + f". So the answer is {total}."


def _op(a: int, op: str, b: int) -> tuple[str, int]:
    """One operation written out next to its operands: "a op b = c", and for a sum or difference that involves
    a negative number, its sign handling between them: the two signed terms rewritten as one operation on
    their sizes with the sign outside ("5 - -6 = 5+6 = 11", "-7 + 3 = -(7-3) = -4", "3 - 8 = -(8-3) = -5",
    "-7 - 3 = -(7+3) = -10"). Products stay "a * b = c"."""
    value = a * b if op == "*" else a + b if op == "+" else a - b
    if op == "*" or a == 0 or b == 0 or (a > 0 and b > 0 and (op == "+" or a >= b)):
        return f"{a} {op} {b} = {value}", value
    x, y = a, b if op == "+" else -b  # the signed terms: value == x + y
    if x >= 0 and y >= 0:
        sizes = f"{x}+{y}"
    elif x < 0 and y < 0:
        sizes = f"-({-x}+{-y})"
    else:
        p, n = (x, -y) if x >= 0 else (y, -x)  # the positive term, the size of the negative one
        sizes = f"{p}-{n}" if p >= n else f"-({n}-{p})"
    return f"{a} {op} {b} = {sizes} = {value}", value


def _reduce(expr: str) -> tuple[list[str], int]:
    """Evaluate one flat group one operation at a time (* first, then left to right); return the
    operations as written ("a op b = c") and the value."""
    toks = expr.split()
    nums = [int(toks[0])] + [int(t) for t in toks[2::2]]
    ops = toks[1::2]
    steps = []
    while ops:
        i = ops.index("*") if "*" in ops else 0
        text, value = _op(nums[i], ops[i], nums[i + 1])
        steps.append(text)
        nums[i : i + 2] = [value]
        del ops[i]
    return steps, nums[0]


def _arithmetic(question: str, target: str) -> str:
    m = _ARITH.match(question)
    if not m:
        raise ValueError(f"not a multistep_arithmetic_two question: {question!r}")
    parts, values = [], []
    for side in ("left", "right"):
        steps, value = _reduce(m[side])
        parts.append(f"({m[side]}): " + "; ".join(steps) + ".")
        values.append(value)
    text, result = _op(values[0], m["op"], values[1])
    if str(result) != target:
        raise ValueError(f"worked value {result} != target {target} for {question!r}")
    parts.append(text + ".")
    return " ".join(parts) + f" So the answer is {result}."


def _navigate(question: str, target: str) -> str:
    m = _NAV_INSTRUCTIONS.search(question)
    if not m:
        raise ValueError(f"not a navigate question: {question!r}")
    text = m["steps"].strip()
    steps = list(_NAV_STEP.finditer(text))
    if " ".join(s[0] for s in steps) != text:
        raise ValueError(f"navigate instructions not understood: {text!r}")
    fixed = text.startswith("Always face forward.")
    x = y = heading = 0
    out = [] if fixed else ["Start at (0, 0) facing north."]
    for step in steps:
        if step["turn"]:
            old, heading = heading, (heading + _TURN[step["turn"]]) % 4
            out.append(f"Turn {step['turn']}: {_HEADINGS[old]} -> {_HEADINGS[heading]}.")
        elif step["n"]:
            n = int(step["n"])
            h = _FACING[step["dir"]] if fixed and step["dir"] else heading
            dx, dy = _HEADING_STEP[h]
            axis, before = ("x", x) if dx else ("y", y)
            x, y = x + n * dx, y + n * dy
            where = step["dir"] if fixed and step["dir"] else _HEADINGS[h]
            sign = "+" if dx + dy > 0 else "-"
            out.append(
                f"Take {n} step{'s' if n != 1 else ''} {where}: {axis} {before} {sign} {n} = "
                f"{x if dx else y}, now ({x}, {y})."
            )
        elif not fixed:
            raise ValueError(f"'Always face forward.' must come first: {text!r}")
    back = x == 0 and y == 0
    if ("Yes" if back else "No") != target:
        raise ValueError(f"worked walk ends at ({x}, {y}), target {target} for {question!r}")
    out.append(
        f"({x}, {y}) is the start. So the answer is Yes."
        if back
        else f"({x}, {y}) is not the start. So the answer is No."
    )
    return " ".join(out)
