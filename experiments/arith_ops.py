"""Per-operation accuracy of worked multistep_arithmetic_two answers (predictions JSONL of `molora eval`).

    .venv/bin/python -m experiments.arith_ops runs/arith/before.jsonl --json runs/arith/before.json

Reads each prediction's worked solution, the format of `molora.data.solutions._arithmetic`:

    "(G1): a op b = c; ...; a op b = c. (G2): ... . L op R = c. So the answer is N."

where a step is "a op b = ... = c": its first part two integer operands and an operator, its last part the
value the model wrote, any parts between a rewrite ("a + b", "-(20*7 + 3*7)") checked by evaluating it.
Every step is scored against true arithmetic (compute errors), and replayed against the question: with the
model's own earlier values, the operands the worked order (* first, then left to right; then the two group
values) would use next (copy/order errors). Buckets: operation and operand signs ("neg - neg"), operation
and operand digits ("2d * 1d"), operation and digits of the true result, group step vs the final combine.

Owns the parsing and the scoring of steps; knows the solution format, not the model or the eval runner.
Pure Python. Ends with one JSON object (stdout, and --json OUT).
"""

from __future__ import annotations

import argparse
import json
import re
from collections import Counter, defaultdict
from dataclasses import dataclass
from pathlib import Path

from molora.data.jsonl import read_jsonl

_QUESTION = re.compile(r"^\(\((?P<left>.+)\) (?P<op>[+\-*]) \((?P<right>.+)\)\) =$")
_HEADER = re.compile(r"\((-?\d+(?: [+\-*] -?\d+)*)\):\s*")
_BINARY = re.compile(r"^(-?\d+) ([+\-*]) (-?\d+)$")
_INT = re.compile(r"^-?\d+$")
_EXPR = re.compile(r"^[\d\s+\-*()]{1,200}$")
_ANSWER = re.compile(r"answer is\s*(-?\d+)")


@dataclass
class Step:
    """One "a op b = ... = c" the model wrote; `operands_ok` None where the replay lost alignment."""

    text: str
    a: int
    op: str
    b: int
    c: int
    where: str  # "group" or "final"
    rewrites_ok: bool  # every middle part evaluates to the true value
    operands_ok: bool | None = None

    @property
    def true(self) -> int:
        return apply(self.a, self.op, self.b)

    @property
    def ok(self) -> bool:
        return self.c == self.true


def apply(a: int, op: str, b: int) -> int:
    return a * b if op == "*" else a + b if op == "+" else a - b


def _value(expr: str) -> int | None:
    """An integer expression of digits, + - * and parentheses, evaluated; None if it is anything else."""
    if not _EXPR.match(expr):
        return None
    try:
        v = eval(expr, {"__builtins__": {}}, {})  # noqa: S307 - only digits, spaces, + - * ( ) reach here
    except (SyntaxError, TypeError, ValueError):
        return None
    return v if isinstance(v, int) else None


def parse_step(text: str, where: str) -> Step | None:
    """ "a op b = ... = c" -> Step; None if the first part is not a binary operation or the last not an int."""
    parts = [p.strip() for p in text.strip().rstrip(".").split(" = ")]
    m = _BINARY.match(parts[0]) if len(parts) >= 2 else None
    if not m or not _INT.match(parts[-1]):
        return None
    a, op, b = int(m[1]), m[2], int(m[3])
    true = apply(a, op, b)
    rewrites_ok = all(_value(p) == true for p in parts[1:-1])
    return Step(text.strip(), a, op, b, int(parts[-1]), where, rewrites_ok)


def parse_solution(prediction: str) -> dict:
    """Split a worked answer into its group headers, steps and final answer.

    Returns {"groups": [(header, [Step|None...]), ...], "final": [Step|None...], "answer": int|None}; a None
    step is a piece of text that did not parse as a step.
    """
    body, _, tail = prediction.partition("So the answer is")
    m = re.match(r"\s*(-?\d+)", tail)
    answer = int(m[1]) if m else None
    heads = list(_HEADER.finditer(body))
    groups, final = [], []
    for k, h in enumerate(heads):
        end = heads[k + 1].start() if k + 1 < len(heads) else len(body)
        segment = body[h.end() : end].strip()
        inside, dot, rest = segment.partition(". ") if ". " in segment else (segment.rstrip("."), "", "")
        groups.append((h[1], [parse_step(s, "group") for s in inside.split("; ") if s.strip()]))
        if k + 1 == len(heads) and rest.strip():
            final = [parse_step(s, "final") for s in rest.strip().rstrip(".").split("; ") if s.strip()]
    return {"groups": groups, "final": final, "answer": answer}


def _replay_group(expr: str, steps: list[Step | None]) -> int | None:
    """Mark each step's operands right or wrong against the worked order, carrying the model's own values;
    return the group's value as the model has it (None if the replay lost alignment)."""
    toks = expr.split()
    nums = [int(toks[0])] + [int(t) for t in toks[2::2]]
    ops = toks[1::2]
    for s in steps:
        if s is None or not ops:
            return None
        i = ops.index("*") if "*" in ops else 0
        s.operands_ok = (s.a, s.op, s.b) == (nums[i], ops[i], nums[i + 1])
        if not s.operands_ok:
            return None
        nums[i : i + 2] = [s.c]
        del ops[i]
    return nums[0] if not ops else None


def check_item(question: str, prediction: str) -> tuple[list[Step], str | None]:
    """All parsed steps of one answer (operands marked by the replay), and the first error in reading order:
    None (no error), "unparsed", "copy_header", "copy_operand", "compute", "answer_line" or "no_answer"."""
    q = _QUESTION.match(question)
    if not q:
        raise ValueError(f"not a multistep_arithmetic_two question: {question!r}")
    sol = parse_solution(prediction)
    steps: list[Step] = []
    first: str | None = None

    def note(kind: str) -> None:
        nonlocal first
        first = first or kind

    values = []
    for k, side in enumerate(("left", "right")):
        if k >= len(sol["groups"]):
            note("unparsed")
            values.append(None)
            continue
        header, group = sol["groups"][k]
        if header != q[side]:
            note("copy_header")
        values.append(_replay_group(q[side], group))
        for s in group:
            if s is None:
                note("unparsed")
                continue
            steps.append(s)
            if s.operands_ok is False:
                note("copy_operand")
            elif not s.ok:
                note("compute")
    for s in sol["final"]:
        if s is None:
            note("unparsed")
            continue
        if None not in values:
            s.operands_ok = (s.a, s.op, s.b) == (values[0], q["op"], values[1])
            if not s.operands_ok:
                note("copy_operand")
        steps.append(s)
        if not s.ok:
            note("compute")
    if not sol["final"]:
        note("unparsed")
    if sol["answer"] is None:
        note("no_answer")
    elif sol["final"] and sol["final"][-1] is not None and sol["answer"] != sol["final"][-1].c:
        note("answer_line")
    return steps, first


def _digits(x: int) -> str:
    n = len(str(abs(x)))
    return f"{n}d" if n < 3 else "3+d"


def buckets(s: Step) -> dict[str, str]:
    """The buckets one step counts in, by grouping."""
    sign = lambda x: "neg" if x < 0 else "pos"  # noqa: E731 - zero counts as pos
    return {
        "by_op": s.op,
        "by_op_signs": f"{sign(s.a)} {s.op} {sign(s.b)}",
        "by_op_digits": f"{_digits(s.a)} {s.op} {_digits(s.b)}",
        "by_op_result_digits": f"{s.op} -> {_digits(s.true)}{' neg' if s.true < 0 else ''}",
        "by_position": f"{s.where} {s.op}",
    }


def _rate(ok: int, n: int) -> dict:
    return {"n": n, "correct": ok, "accuracy": round(ok / n, 4) if n else None}


def report(rows: list[dict]) -> dict:
    """Scores over predictions rows ({"input", "prediction", "correct", ...}) -> one JSON-able summary."""
    tally: dict[str, dict[str, list[int]]] = defaultdict(lambda: defaultdict(lambda: [0, 0]))
    first_errors: Counter = Counter()
    compute_by_op: Counter = Counter()
    n_steps = n_ok = n_rewrite_bad = n_op_checked = n_op_ok = items_ok = items_all_steps_ok = 0
    for row in rows:
        steps, first = check_item(row["input"], row["prediction"])
        items_ok += bool(row.get("correct"))
        items_all_steps_ok += first is None
        if not row.get("correct"):
            first_errors[first or "scored_wrong_but_steps_ok"] += 1
        if first == "compute":
            bad = next(s for s in steps if s.operands_ok is not False and not s.ok)
            compute_by_op[buckets(bad)["by_op_signs"]] += 1
        for s in steps:
            n_steps += 1
            n_ok += s.ok
            n_rewrite_bad += not s.rewrites_ok
            if s.operands_ok is not None:
                n_op_checked += 1
                n_op_ok += s.operands_ok
            for group, key in buckets(s).items():
                tally[group][key][0] += s.ok
                tally[group][key][1] += 1
    out = {
        "items": _rate(items_ok, len(rows)),
        "items_every_step_right": _rate(items_all_steps_ok, len(rows)),
        "steps": _rate(n_ok, n_steps),
        "operands_copied": _rate(n_op_ok, n_op_checked),
        "steps_with_a_wrong_rewrite": n_rewrite_bad,
        "first_error_of_wrong_items": dict(first_errors.most_common()),
        "first_compute_error_by_op_signs": dict(compute_by_op.most_common()),
    }
    for group, keys in tally.items():
        out[group] = {k: _rate(*v) for k, v in sorted(keys.items())}
    return out


# the buckets the results page shows, before and after (the record holds every bucket)
SHOWN = (
    ("by_op", ("+", "-", "*")),
    (
        "by_op_signs",
        ("pos + pos", "pos + neg", "neg + pos", "neg + neg", "pos - pos", "pos - neg", "neg - pos", "neg - neg"),
    ),
    ("by_op_digits", ("1d * 1d", "2d * 1d", "2d * 2d")),
    ("by_position", ("group +", "group -", "group *", "final +", "final -", "final *")),
)


def _pct(rate: dict | None) -> str:
    return "-" if not rate or rate.get("accuracy") is None else f"{100 * rate['accuracy']:.0f}% ({rate['n']})"


def render_section(after: dict, docs: Path | None = None) -> list[str]:
    """The results page's section (tools/make_results.py SECTIONS): per-operation accuracy of the adapter in
    `after` beside the record it names in "compared_with" (a file beside it under docs/)."""
    docs = docs or Path(__file__).resolve().parent.parent / "docs"
    before = json.loads((docs / after["compared_with"]).read_text()) if after.get("compared_with") else {}
    rows = [
        ["items right", _pct(before.get("items")), _pct(after["items"])],
        ["steps right", _pct(before.get("steps")), _pct(after["steps"])],
        ["operands copied right", _pct(before.get("operands_copied")), _pct(after["operands_copied"])],
    ]
    for group, keys in SHOWN:
        rows += [
            [
                f"{group.removeprefix('by_').replace('_', ' ')}: {k}",
                _pct(before.get(group, {}).get(k)),
                _pct(after.get(group, {}).get(k)),
            ]
            for k in keys
        ]
    lines = ["| | before | after |", "|---|---|---|"] + ["| " + " | ".join(r) + " |" for r in rows]
    return [
        "## Arithmetic, per operation (validation items)",
        "",
        f'{after["items"]["n"]} validation items (`docs/arith_val_items.json`, held-out split "val"), answered '
        'by the arithmetic adapter alone; `experiments/arith_ops.py` reads every written step "a op b = c" and '
        "scores it against true arithmetic (how many steps, or items, in brackets). Before: the adapter shipped "
        "before it "
        f"({after.get('compared_with', '-')}). After: {after.get('adapter', '-')}. The choice was made "
        "on these items, so they are not a test score; the test score is in the table above.",
        "",
        *lines,
        "",
    ]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("predictions", type=Path, help="predictions JSONL of `molora eval --predictions`")
    p.add_argument("--json", type=Path, default=None, help="also write the summary here")
    args = p.parse_args(argv)
    try:
        rows = read_jsonl(args.predictions)
    except OSError as e:
        raise SystemExit(f"cannot read {args.predictions}: {e}") from e
    summary = {"predictions": str(args.predictions), **report(rows)}
    if args.json:
        args.json.write_text(json.dumps(summary, indent=1) + "\n")
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
