"""Answer extraction and normalization: from a model's raw output to a comparable answer string.

Owns: per answer kind, the strict extraction (the answer as asked) and the lenient one (the first
well-formed answer anywhere), and the canonical forms targets and answers are compared in (integers,
numbers, LaTeX math, option letters, bracket runs, word lists).  Does not know: files, prompts, models,
which task an item comes from beyond the `kind` it is given (see `molora.eval.tasks.answer_kind`).
Pure Python, no torch.

Strict reads the reply up to the first end marker (`END_MARKERS`), then takes the text after the last
"the answer is" if there is one, else the first non-empty line; it strips whitespace, a trailing period,
and wrapping ** or quotes.  Math answers are the last \\boxed{...}; gsm8k answers the number after "####",
else after the last "answer is", else the last number on the last line.
"""

from __future__ import annotations

import re
from collections.abc import Mapping

END_MARKERS = ("<|im_end|>", "<|endoftext|>", "</s>", "<|eot_id|>", "\nQ:", "\nQuestion:", "\n\n\n")
KINDS = ("int", "number", "math", "choice", "label", "dyck", "words", "text")
LABEL_SETS = (("yes", "no"), ("true", "false"), ("valid", "invalid"))
_NUMBER_WORDS = {
    w: i
    for i, w in enumerate(
        "zero one two three four five six seven eight nine ten eleven twelve thirteen fourteen fifteen "
        "sixteen seventeen eighteen nineteen twenty".split()
    )
}
_ANSWER_IS = re.compile(r"(?i)\banswer\s*(?:is|:)\s*:?")
_INT_OR_WORD = re.compile(r"(?i)(?<![\w.])(-?\d+|" + "|".join(_NUMBER_WORDS) + r")(?![\w]|\.\d)")
_NUMBER = re.compile(r"-?\$?\s?\d[\d,]*(?:\.\d+)?|-?\.\d+")
_CLOSERS = re.compile(r"[)\]}>](?:\s*[)\]}>])*")
_LETTER = re.compile(r"^\(?([A-R])\)?(?:[.:)]|\s|$)")
_PAREN_LETTER = re.compile(r"\(([A-R])\)")


# --------------------------------------------------------------------------- shared steps


def cut_at_end(text: str) -> str:
    """The reply up to the first end marker (chat end tokens, a new few-shot question)."""
    for marker in END_MARKERS:
        i = text.find(marker)
        if i >= 0:
            text = text[:i]
    return text


def _clean(s: str) -> str:
    s = s.strip().strip("*").strip()
    if len(s) >= 2 and s[0] == s[-1] and s[0] in "\"'`":
        s = s[1:-1].strip()
    return s.rstrip(".").strip()


def strict_span(prediction: str) -> str:
    """The answer as asked: after the last 'the answer is', else the first non-empty line; cleaned."""
    text = cut_at_end(prediction).strip()
    marks = list(_ANSWER_IS.finditer(text))
    if marks:
        text = text[marks[-1].end() :].strip()
    first = next((line for line in text.splitlines() if line.strip()), "")
    return _clean(first)


def canonical_number(s: str) -> str | None:
    """'1,234' / '$18.00' / '-3' -> '1234' / '18' / '-3'; None if s is not a number."""
    s = s.strip().replace(",", "").replace("$", "").replace(" ", "").rstrip(".").rstrip("%")
    try:
        value = float(s)
    except ValueError:
        return None
    if value != value or value in (float("inf"), float("-inf")):
        return None
    return str(int(value)) if value == int(value) else repr(value)


# --------------------------------------------------------------------------- LaTeX math


def last_boxed(text: str) -> str | None:
    """Content of the last \\boxed{...} (or \\fbox{...}), braces balanced; also '\\boxed 5'."""
    i = max(text.rfind("\\boxed"), text.rfind("\\fbox"))
    if i < 0:
        return None
    rest = text[i:].removeprefix("\\boxed").removeprefix("\\fbox")
    if rest.startswith(" "):
        m = re.match(r" +([^\s$]+)", rest)
        return m.group(1) if m else None
    if not rest.startswith("{"):
        return None
    depth = 0
    for j, ch in enumerate(rest):
        depth += {"{": 1, "}": -1}.get(ch, 0)
        if depth == 0:
            return rest[1:j]
    return None


def _fix_fracs(s: str) -> str:
    """'\\frac12' -> '\\frac{1}{2}', '\\frac1{b}' -> '\\frac{1}{b}', '\\frac{a}2' -> '\\frac{a}{2}'."""
    parts = s.split("\\frac")
    out = parts[0]
    for p in parts[1:]:
        out += "\\frac"
        if p.startswith("{"):
            close = _matching_brace(p)
            if close is not None and close + 1 < len(p) and p[close + 1] != "{":
                p = p[: close + 1] + "{" + p[close + 1] + "}" + p[close + 2 :]
            out += p
        elif len(p) >= 2:
            b = p[1] if p[1] != "{" else None
            out += "{" + p[0] + "}" + ("{" + b + "}" + p[2:] if b else p[1:])
        else:
            out += p
    return out


def _matching_brace(s: str) -> int | None:
    depth = 0
    for j, ch in enumerate(s):
        depth += {"{": 1, "}": -1}.get(ch, 0)
        if depth == 0:
            return j
    return None


def normalize_math(s: str) -> str:
    """The usual MATH answer normalization, so that equal answers compare equal as strings.

    Drops: line breaks, spaces, '\\!', '\\left', '\\right', '^\\circ', '$', '\\%' and '%', a trailing '.',
    trailing text units ('5 \\text{ cm}' -> '5'), a short 'x =' prefix.  Rewrites: '\\dfrac'/'\\tfrac' ->
    '\\frac', '\\frac12' -> '\\frac{1}{2}', '\\sqrt3' -> '\\sqrt{3}', 'a/b' of integers -> '\\frac{a}{b}',
    '0.5' -> '\\frac{1}{2}', '.5' -> '0.5', '\\text{X}' alone -> 'X'.
    """
    s = s.replace("\n", "").replace("\\!", "").replace("\\\\", "\\").strip()
    s = s.replace("tfrac", "frac").replace("dfrac", "frac")
    s = s.replace("\\left", "").replace("\\right", "")
    s = s.replace("^{\\circ}", "").replace("^\\circ", "")
    s = s.replace("\\$", "").replace("$", "").replace("\\%", "").replace("%", "")
    whole_text = re.fullmatch(r"\\(?:text|textbf|mbox|mathrm)\{(.*)\}", s.strip())
    if whole_text:
        s = whole_text.group(1)
    s = re.sub(r"(?<=\S)\s*\\(?:text|mbox|mathrm)\{\s*[A-Za-z ]+\}(\^\d)?$", "", s)  # trailing units
    s = re.sub(r"(^|[\s{])\.(\d)", r"\g<1>0.\2", s)
    if s.count("=") == 1 and len(s.split("=")[0].strip()) <= 2:
        s = s.split("=")[1]
    s = re.sub(r"\\sqrt(\w)", r"\\sqrt{\1}", s)
    s = s.replace(" ", "")
    s = _fix_fracs(s)
    s = s.rstrip(".")
    if s == "0.5":
        s = "\\frac{1}{2}"
    m = re.fullmatch(r"(-?\d+)/(\d+)", s)
    if m:
        s = f"\\frac{{{m.group(1)}}}{{{m.group(2)}}}"
    return s


# --------------------------------------------------------------------------- per-kind extraction


def _letter_of(span: str, options: Mapping[str, str] | None) -> str | None:
    m = _LETTER.match(span)
    if m:
        return m.group(1)
    for letter, text in (options or {}).items():
        if _clean(text).lower() == span.lower():
            return letter
    return None


def _label_set(target: str) -> tuple[str, ...]:
    t = target.strip().lower()
    return next((s for s in LABEL_SETS if t in s), (t,))


def strict_answer(kind: str, prediction: str, target: str, options: Mapping[str, str] | None = None) -> str | None:
    """The answer as asked, in the canonical form of `kind` (None if there is none)."""
    if kind == "math":
        boxed = last_boxed(cut_at_end(prediction))
        return None if boxed is None else normalize_math(boxed)
    if kind == "number":
        text = cut_at_end(prediction)
        if "####" in text:
            found = _NUMBER.search(text.split("####")[-1])
        else:
            marks = list(_ANSWER_IS.finditer(text))
            lines = [line for line in text.splitlines() if line.strip()]
            tail = text[marks[-1].end() :] if marks else (lines[-1] if lines else "")
            found = _NUMBER.search(tail) if marks else _last(_NUMBER, tail)
        return canonical_number(found.group(0)) if found else None
    span = strict_span(prediction)
    if kind == "int":
        return str(int(span)) if re.fullmatch(r"-?\d+", span) else None
    if kind == "choice":
        return _letter_of(span, options)
    if kind == "label":
        return span.lower()
    if kind == "dyck":
        return " ".join("".join(span.split())) if re.fullmatch(r"[)\]}>\s]+", span) else None
    if kind == "words":
        return " ".join(span.split())
    return span.lower()


def _last(pattern: re.Pattern, text: str) -> re.Match | None:
    found = None
    for match in pattern.finditer(text):
        found = match
    return found


def lenient_answer(kind: str, prediction: str, target: str, options: Mapping[str, str] | None = None) -> str | None:
    """The first well-formed answer anywhere in the reply (last number for gsm8k), canonical form."""
    text = cut_at_end(prediction)
    if kind == "int":
        m = _INT_OR_WORD.search(text)
        if m is None:
            return None
        word = m.group(1).lower()
        return str(_NUMBER_WORDS[word] if word in _NUMBER_WORDS else int(word))
    if kind == "number":
        m = _last(_NUMBER, text)
        return canonical_number(m.group(0)) if m else None
    if kind == "math":
        answer = last_boxed(text)
        if answer is None and _ANSWER_IS.search(text):
            answer = strict_span(text)
        elif answer is None:
            dollars = re.findall(r"\$([^$]+)\$", text)
            number = _last(_NUMBER, text)
            answer = dollars[-1] if dollars else (number.group(0) if number else None)
        return normalize_math(answer) if answer else None
    if kind == "choice":
        m = _PAREN_LETTER.search(text)
        if m:
            return m.group(1)
        strict = strict_answer(kind, prediction, target, options)
        if strict:
            return strict
        hits = [(text.lower().find(_clean(t).lower()), k) for k, t in (options or {}).items() if _clean(t)]
        hits = [h for h in hits if h[0] >= 0]
        return min(hits)[1] if hits else None
    if kind == "label":
        words = "|".join(map(re.escape, _label_set(target)))
        m = re.search(rf"(?i)\b({words})\b", text)
        return m.group(1).lower() if m else None
    if kind == "dyck":
        m = _CLOSERS.search(text)
        return " ".join("".join(m.group(0).split())) if m else None
    if kind == "words":
        for line in text.splitlines():
            line = re.sub(r"(?i)^\s*(?:sorted(?: list)?|list|answer)\s*:", "", line)
            words = re.findall(r"[A-Za-z0-9'&-]+", line)
            if words:
                return " ".join(words)
        return None
    t = _clean(target).lower()
    return t if t and re.search(rf"(?i)(?<!\w){re.escape(t)}(?!\w)", text) else strict_span(prediction).lower()


def canonical_target(kind: str, target: str) -> str:
    """The target in the same canonical form as the extracted answers."""
    if kind == "int":
        return str(int(target.strip()))
    if kind == "number":
        return canonical_number(target) or target.strip()
    if kind == "math":
        return normalize_math(target)
    if kind == "choice":
        m = _LETTER.match(target.strip())
        return m.group(1) if m else target.strip()
    if kind == "dyck":
        return " ".join("".join(target.split()))
    if kind == "words":
        return " ".join(target.split())
    return _clean(target).lower()
