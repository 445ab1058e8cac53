"""The text of a mixed request: several questions of different skills in one prompt, answered in one reply.

Owns: how the parts of a mixed row ({"parts": [{"task", "input", "target"}, ...]}, made by
`molora.data.skills.generate_mixed`) become one prompt and one reference reply, where each part's text
lies in them (character spans, so training can label the tokens of each part with its skill), and how a
reply is cut back into per-part answers.  Does not know: tokenizers, chat templates, scoring, models.
Pure Python, no torch.

Layout (N parts):

    Answer each question on its own line, as "Answer 1: ...", "Answer 2: ...".
    <blank line>
    Question 1: <input 1>
    <blank line>
    Question 2: <input 2>

and the reference reply is "Answer 1: <target 1>\\nAnswer 2: <target 2>".
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

INSTRUCTION = 'Answer each question on its own line, as "Answer 1: ...", "Answer 2: ...".'
_ANSWER_MARK = re.compile(r"(?im)^[ \t*#>-]*answer\s*(\d+)\s*[:.)]\s*")


@dataclass(frozen=True)
class MixedText:
    """One rendered mixed row.  Spans are [start, end) character offsets, one per part, in part order:
    `prompt_spans[i]` covers "Question i+1: <input>", `target_spans[i]` covers "Answer i+1: <target>"."""

    prompt: str
    target: str
    prompt_spans: tuple[tuple[int, int], ...]
    target_spans: tuple[tuple[int, int], ...]


def render_mixed(parts: Sequence[Mapping[str, str]]) -> MixedText:
    """Prompt and reference reply of a mixed row; each part needs "input" and "target"."""
    if not parts:
        raise ValueError("a mixed row needs at least one part, got none")
    prompt, prompt_spans = INSTRUCTION, []
    for i, part in enumerate(parts, 1):
        prompt += "\n\n"
        start = len(prompt)
        prompt += f"Question {i}: {part['input']}"
        prompt_spans.append((start, len(prompt)))
    target, target_spans = "", []
    for i, part in enumerate(parts, 1):
        if i > 1:
            target += "\n"
        start = len(target)
        target += f"Answer {i}: {part['target']}"
        target_spans.append((start, len(target)))
    return MixedText(prompt, target, tuple(prompt_spans), tuple(target_spans))


def split_answers(reply: str, n_parts: int) -> list[str]:
    """The answer to each of n_parts questions in a reply ("" where none is found).

    Uses the "Answer i:" marks where there are any (the text up to the next mark); otherwise the
    non-empty lines of the reply, in order.
    """
    marks = list(_ANSWER_MARK.finditer(reply))
    answers = [""] * n_parts
    if marks:
        for mark, nxt in zip(marks, [*marks[1:], None]):
            i = int(mark.group(1)) - 1
            if 0 <= i < n_parts and not answers[i]:
                answers[i] = reply[mark.end() : nxt.start() if nxt else len(reply)].strip()
        return answers
    lines = [line.strip() for line in reply.splitlines() if line.strip()]
    for i, line in enumerate(lines[:n_parts]):
        answers[i] = line
    return answers
