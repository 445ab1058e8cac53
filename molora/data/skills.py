"""Seeded generators of BIG-Bench-Hard-style items for five skills, and the files they go into.

Owns: the five skill generators (inputs in the surface format of the real BBH task files, targets in
BBH's target format), deterministic seeding, deduplication against another set, mixed rows (parts of
different skills), and JSONL / BBH-file writing.  Does not know: tokenizers, prompts or chat templates,
models, training, scoring (that is `molora.eval`).  Pure Python, no torch.

The formats were confirmed against the BBH task files `bbh/<task>.jsonl` of `suzgunmirac/BIG-Bench-Hard`
(commit e26f26d) and, for word_sorting (absent from the snapshot read), the BBH copy
`bbh/word_sorting.json` of `ctlllll/LLM-ToolMaker`.  Facts matched, per task (no benchmark item is copied):

- object_counting: "I have a flute, two lamps, and a trumpet. How many musical instruments do I have?"
  -> "4" (the count as digits).  Items are comma-separated, "and" before the last one always with a comma (also
  for two items: "I have a microwave, and a bed."); quantities are "a"/"an" or the words two..five;
  five categories with fixed vocabularies (see `_CATEGORIES`; plurals "mice", "fish", "heads of broccoli",
  "stalks of celery", "lettuce heads", "potatoes", "couches"); each kind appears at most once; 2-13 kinds;
  "objects" questions have no distractors, the others sometimes 1-3 items of another category.
- multistep_arithmetic_two: "((a o b o c o d) O (e o f o g o h)) =" with eight integers in -9..9 written
  with a bare minus ("- -4"), o and O drawn from + - *, usual precedence; target the integer.
- word_sorting: "Sort the following words alphabetically: List: w1 w2 ..." with 2-20 distinct lowercase
  words; target the words sorted, space separated.  Our vocabulary is `words.txt.gz` beside this file
  (SCOWL words from Debian's wamerican, lowercase a-z, length >= 3; licence notice in the file).
- dyck_languages: "Complete the rest of the sequence, making sure that the parentheses are closed
  properly. Input: [ < > ] [ ..." over ( [ { <, tokens separated by single spaces; the input is a
  balanced sequence with a suffix of its closing run cut off; target the 1-3 missing closers, spaced.
- navigate: "If you follow these instructions, do you return to the starting point? <instructions>
  \\nOptions:\\n- Yes\\n- No" -> "Yes"/"No".  Two variants: "Always face forward. Take 3 steps left. ..."
  (forward/backward/left/right) and turning ("Take 5 steps. Turn left. Turn around. ..."); step counts
  1-10 ("Take 1 step."), 2-10 instructions.  Our classes are balanced (the real file leans to "No").

Seeds: training data uses seeds `TRAIN_SEED_BASE + i` and held-out evaluation data `EVAL_SEED_BASE + i`
(shard i).  Different seeds are independent streams, so short items can still coincide; run
`dedupe_against(eval_items, train_items)` so that no held-out input equals a training input.
Short real BBH items (two fruits, "[ [") can also coincide with generated ones by chance: when a real
task file is at hand, dedupe the training set against it the same way.
"""

from __future__ import annotations

import gzip
import json
import random
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from functools import cache
from pathlib import Path

SKILLS: tuple[str, ...] = (
    "object_counting",
    "multistep_arithmetic_two",
    "word_sorting",
    "dyck_languages",
    "navigate",
)
TRAIN_SEED_BASE = 1000
EVAL_SEED_BASE = 9_000_000


@dataclass(frozen=True)
class Item:
    """One BBH-style example: `input` is the question text, `target` the exact expected answer."""

    task: str
    input: str
    target: str


# --------------------------------------------------------------------------- object_counting

# category -> ((singular, plural), ...); articles follow the first letter of the singular.
_CATEGORIES: dict[str, tuple[tuple[str, str], ...]] = {
    "fruits": (
        ("apple", "apples"),
        ("banana", "bananas"),
        ("strawberry", "strawberries"),
        ("peach", "peaches"),
        ("orange", "oranges"),
        ("plum", "plums"),
        ("raspberry", "raspberries"),
        ("grape", "grapes"),
        ("nectarine", "nectarines"),
        ("blackberry", "blackberries"),
    ),
    "vegetables": (
        ("yam", "yams"),
        ("cauliflower", "cauliflowers"),
        ("garlic", "garlics"),
        ("lettuce head", "lettuce heads"),
        ("head of broccoli", "heads of broccoli"),
        ("potato", "potatoes"),
        ("stalk of celery", "stalks of celery"),
        ("onion", "onions"),
        ("cabbage", "cabbages"),
        ("carrot", "carrots"),
    ),
    "animals": (
        ("fish", "fish"),
        ("bear", "bears"),
        ("frog", "frogs"),
        ("chicken", "chickens"),
        ("mouse", "mice"),
        ("cat", "cats"),
        ("pig", "pigs"),
        ("rabbit", "rabbits"),
        ("duck", "ducks"),
        ("goat", "goats"),
        ("dog", "dogs"),
        ("cow", "cows"),
        ("donkey", "donkeys"),
        ("snail", "snails"),
        ("snake", "snakes"),
    ),
    "musical instruments": (
        ("flute", "flutes"),
        ("piano", "pianos"),
        ("trombone", "trombones"),
        ("violin", "violins"),
        ("accordion", "accordions"),
        ("clarinet", "clarinets"),
        ("drum", "drums"),
        ("trumpet", "trumpets"),
    ),
    "objects": (
        ("stove", "stoves"),
        ("lamp", "lamps"),
        ("fridge", "fridges"),
        ("chair", "chairs"),
        ("microwave", "microwaves"),
        ("couch", "couches"),
        ("oven", "ovens"),
        ("car", "cars"),
        ("toaster", "toasters"),
        ("table", "tables"),
        ("bed", "beds"),
    ),
}
_NUMBER_WORDS = ("two", "three", "four", "five")


def _phrase(rng: random.Random, noun: tuple[str, str]) -> tuple[str, int]:
    """'a peach' / 'an oven' (most often) or 'three peaches'; returns (text, count)."""
    if rng.random() < 0.72:
        article = "an" if noun[0][0] in "aeiou" else "a"
        return f"{article} {noun[0]}", 1
    count = rng.choice((2, 2, 2, 3, 3, 4, 5))
    return f"{_NUMBER_WORDS[count - 2]} {noun[1]}", count


# Distractors: items of other categories in the list, which the question does not ask about ("How many
# vegetables..." listing a chair and two tables). Real questions often have them, several at once, from any other
# category, objects included (BBH's own worked example: 3 of 8 listed items are objects in a vegetables question).
# Here: DISTRACTOR_SHARE of the questions about a category other than "objects" get 1-4 kinds of distractors
# (weights DISTRACTOR_KINDS), drawn from every other category; an "objects" question lists objects only (a fruit
# is also an object). `molora.data.solutions` judges every listed item, distractors included.
DISTRACTOR_SHARE = 0.6
DISTRACTOR_KINDS = ((1, 0.3), (2, 0.3), (3, 0.25), (4, 0.15))


def _object_counting(rng: random.Random) -> tuple[str, str]:
    category = rng.choice(tuple(_CATEGORIES))
    vocab = _CATEGORIES[category]
    answer = 99
    while answer > 18:  # the real answers run from 2 to 18
        n_kinds = min(len(vocab), rng.choice((2, 2, 3, 3, 4, 5, 6, 7, 8, 9, 10, 11)))
        phrases = [_phrase(rng, kind) for kind in rng.sample(vocab, n_kinds)]
        answer = sum(c for _, c in phrases)
    if category != "objects" and rng.random() < DISTRACTOR_SHARE:
        others = [k for cat, ks in _CATEGORIES.items() if cat != category for k in ks]
        kinds, weights = zip(*DISTRACTOR_KINDS)
        for kind in rng.sample(others, rng.choices(kinds, weights)[0]):
            phrases.insert(rng.randrange(len(phrases) + 1), _phrase(rng, kind))
    texts = [p for p, _ in phrases]
    listing = ", ".join(texts[:-1]) + ", and " + texts[-1]
    return f"I have {listing}. How many {category} do I have?", str(answer)


# --------------------------------------------------------------------------- multistep_arithmetic_two

_OPS = ("+", "-", "*")


def _eval_flat(nums: Sequence[int], ops: Sequence[str]) -> int:
    """Value of n0 o0 n1 o1 n2 ... with * before + and -, left to right."""
    terms, signs, current = [], [], nums[0]
    for op, x in zip(ops, nums[1:]):
        if op == "*":
            current *= x
        else:
            terms.append(current)
            signs.append(op)
            current = x
    terms.append(current)
    value = terms[0]
    for sign, term in zip(signs, terms[1:]):
        value = value + term if sign == "+" else value - term
    return value


def _group(rng: random.Random) -> tuple[str, int]:
    nums = [rng.randint(-9, 9) for _ in range(4)]
    ops = [rng.choice(_OPS) for _ in range(3)]
    text = str(nums[0]) + "".join(f" {op} {x}" for op, x in zip(ops, nums[1:]))
    return f"({text})", _eval_flat(nums, ops)


def _multistep_arithmetic_two(rng: random.Random) -> tuple[str, str]:
    (left, a), (right, b) = _group(rng), _group(rng)
    op = rng.choice(_OPS)
    return f"({left} {op} {right}) =", str(_eval_flat([a, b], [op]))


# --------------------------------------------------------------------------- word_sorting

_WORDS_FILE = Path(__file__).with_name("words.txt.gz")


@cache
def _words() -> tuple[str, ...]:
    try:
        with gzip.open(_WORDS_FILE, "rt", encoding="utf-8") as f:
            return tuple(w for w in (line.strip() for line in f) if w and not w.startswith("#"))
    except OSError as e:
        raise OSError(f"cannot read the word list {_WORDS_FILE}: {e}; reinstall molora") from e


def _word_sorting(rng: random.Random) -> tuple[str, str]:
    words = rng.sample(_words(), rng.randint(2, 20))
    return (
        "Sort the following words alphabetically: List: " + " ".join(words),
        " ".join(sorted(words)),
    )


# --------------------------------------------------------------------------- dyck_languages

_PAIRS = {"(": ")", "[": "]", "{": "}", "<": ">"}


def _balanced(rng: random.Random, n_pairs: int) -> list[str]:
    """A random balanced sequence of n_pairs bracket pairs (iterative, so no recursion limit)."""
    out: list[str] = []
    stack: list[tuple[str, int]] = []  # (closer, pairs still to place inside and after, within this level)
    remaining = n_pairs
    while remaining > 0 or stack:
        if remaining > 0:
            inside = rng.randint(0, remaining - 1)  # pairs nested inside this pair
            opener = rng.choice(tuple(_PAIRS))
            out.append(opener)
            stack.append((_PAIRS[opener], remaining - 1 - inside))
            remaining = inside
        else:
            closer, after = stack.pop()
            out.append(closer)
            remaining = after
    return out


def _dyck_languages(rng: random.Random) -> tuple[str, str]:
    n_open = rng.choice((1, 1, 1, 2, 2, 2, 3, 3))
    size = rng.choice(((0, 3), (0, 3), (4, 12), (4, 12), (13, 40)))
    total = max(rng.randint(*size), 1 if n_open == 1 else 0)  # the real inputs have >= 2 tokens
    cuts = sorted(rng.randint(0, total) for _ in range(n_open))
    sizes = [b - a for a, b in zip([0, *cuts], [*cuts, total])]  # n_open + 1 balanced blocks
    tokens: list[str] = []
    closers: list[str] = []
    for i, n_pairs in enumerate(sizes):
        tokens += _balanced(rng, n_pairs)
        if i < n_open:
            opener = rng.choice(tuple(_PAIRS))
            tokens.append(opener)
            closers.append(_PAIRS[opener])
    prompt = "Complete the rest of the sequence, making sure that the parentheses are closed properly. Input: "
    return prompt + " ".join(tokens), " ".join(reversed(closers))


# --------------------------------------------------------------------------- navigate

_NAV_PROMPT = "If you follow these instructions, do you return to the starting point?"
_NAV_OPTIONS = "\nOptions:\n- Yes\n- No"
_DIRS = ((0, 1), (1, 0), (0, -1), (-1, 0))  # headings 0..3: north, east, south, west (clockwise)
_FACE_FORWARD_NAMES = ("forward", "right", "backward", "left")
_TURNS = {  # heading change (clockwise quarter turns) -> ways to say it
    0: (("Turn left.", "Turn right."), ("Turn right.", "Turn left."), ("Turn around.", "Turn around.")),
    1: (("Turn right.",), ("Turn right.",), ("Turn right.",), ("Turn left.", "Turn around.")),
    2: (("Turn around.",), ("Turn around.",), ("Turn left.", "Turn left."), ("Turn right.", "Turn right.")),
    3: (("Turn left.",), ("Turn left.",), ("Turn left.",), ("Turn right.", "Turn around.")),
}


def _take(n: int, direction: str = "") -> str:
    noun = "step" if n == 1 else "steps"
    return f"Take {n} {noun}{' ' + direction if direction else ''}."


def _split(rng: random.Random, length: int, most: int = 10) -> list[int]:
    """length as a sum of 1-3 random positive parts (more if needed so that each is at most `most`)."""
    k = max(-(-length // most), min(length, rng.choice((1, 1, 1, 1, 2, 2, 2, 3))))
    parts = [1] * k
    for _ in range(length - k):  # hand out the rest one step at a time to parts with room
        open_parts = [i for i, p in enumerate(parts) if p < most]
        parts[rng.choice(open_parts)] += 1
    return parts


def _segments(rng: random.Random, yes: bool, max_len: int) -> list[tuple[int, int]]:
    """Moves (heading, length) whose sum is zero iff `yes`; both classes come from one recipe."""
    while True:
        first = 0 if rng.random() < 0.6 else rng.randrange(4)
        segs = [(first, rng.randint(1, max_len))]
        segs += [(rng.randrange(4), rng.randint(1, max_len)) for _ in range(rng.randint(0, 3))]
        x = sum(_DIRS[h][0] * n for h, n in segs)
        y = sum(_DIRS[h][1] * n for h, n in segs)
        if x:
            segs.append((3 if x > 0 else 1, abs(x)))
        if y:
            segs.append((2 if y > 0 else 0, abs(y)))
        head, tail = segs[:1], segs[1:]
        rng.shuffle(tail)
        segs = head + tail
        if not yes:  # perturb one move so the walk no longer closes
            i = rng.randrange(len(segs))
            h, n = segs[i]
            n2 = n + rng.choice((-3, -2, -1, 1, 2, 3))
            segs[i] = (h, n2) if n2 >= 1 else (rng.randrange(4), n)
        x = sum(_DIRS[h][0] * n for h, n in segs)
        y = sum(_DIRS[h][1] * n for h, n in segs)
        if (x == 0 and y == 0) == yes:
            return segs


def _navigate_text(rng: random.Random, yes: bool) -> str:
    if rng.random() < 0.5:  # "Always face forward." variant: each move names its direction
        while True:
            lines = [_take(part, _FACE_FORWARD_NAMES[h]) for h, n in _segments(rng, yes, 10) for part in _split(rng, n)]
            if 2 <= len(lines) <= 9:
                return " ".join(["Always face forward.", *lines])
    while True:  # turning variant: moves go where you face
        heading, lines = 0, []
        for h, n in _segments(rng, yes, 20):
            delta = (h - heading) % 4
            if delta or rng.random() < 0.1:
                lines += rng.choice(_TURNS[delta])
            heading = h
            lines += [_take(part) for part in _split(rng, n)]
        if rng.random() < 0.3:
            lines += rng.choice(_TURNS[rng.randrange(4)])
        if 2 <= len(lines) <= 10:
            return " ".join(lines)


def _navigate(rng: random.Random, yes: bool | None = None) -> tuple[str, str]:
    yes = rng.random() < 0.5 if yes is None else yes
    return f"{_NAV_PROMPT} {_navigate_text(rng, yes)}{_NAV_OPTIONS}", "Yes" if yes else "No"


# --------------------------------------------------------------------------- public API

_GENERATORS: dict[str, Callable[[random.Random], tuple[str, str]]] = {
    "object_counting": _object_counting,
    "multistep_arithmetic_two": _multistep_arithmetic_two,
    "word_sorting": _word_sorting,
    "dyck_languages": _dyck_languages,
    "navigate": _navigate,
}


def _check_task(task: str) -> None:
    if task not in _GENERATORS:
        raise ValueError(f"unknown skill {task!r}; valid skills: {', '.join(SKILLS)}")


def generate(task: str, n: int, seed: int) -> list[Item]:
    """n distinct items of `task`, the same for the same (task, n, seed).

    For navigate, exactly half the items (n even; one more "No" if odd) have target "Yes".
    """
    _check_task(task)
    if n < 0:
        raise ValueError(f"n must be >= 0, got {n}")
    rng = random.Random(f"molora.skills:{task}:{seed}")
    labels: list[bool | None] = [None] * n
    if task == "navigate":
        labels = [i % 2 == 1 for i in range(n)]
        rng.shuffle(labels)
    items: list[Item] = []
    seen: set[str] = set()
    for label in labels:
        for _ in range(1000):
            text, target = _navigate(rng, label) if task == "navigate" else _GENERATORS[task](rng)
            if text not in seen:
                break
        else:
            raise RuntimeError(f"could not draw {n} distinct {task} items (seed {seed})")
        seen.add(text)
        items.append(Item(task, text, target))
    return items


def dedupe_against(items: Iterable[Item], reference_items: Iterable[Item]) -> list[Item]:
    """`items` without those whose input also occurs in `reference_items` (order kept)."""
    banned = {r.input for r in reference_items}
    return [it for it in items if it.input not in banned]


def generate_mixed(tasks: Sequence[str], n: int, seed: int, parts: int = 2) -> list[dict]:
    """n rows {"parts": [{"task", "input", "target"}, ...]}, each with `parts` parts of different skills."""
    for task in tasks:
        _check_task(task)
    distinct = sorted(set(tasks), key=list(tasks).index)
    if not 1 <= parts <= len(distinct):
        raise ValueError(f"parts={parts} needs that many different skills; got {len(distinct)}: {distinct}")
    rng = random.Random(f"molora.skills:mixed:{','.join(distinct)}:{parts}:{seed}")
    rows: list[dict] = []
    for _ in range(n):
        row = []
        for task in rng.sample(distinct, parts):
            text, target = _GENERATORS[task](rng)
            row.append({"task": task, "input": text, "target": target})
        rows.append({"parts": row})
    return rows


def write_bbh_file(path: str | Path, items: Iterable[Item]) -> None:
    """A task file shaped like the real BBH ones: {"examples": [{"input", "target"}, ...]}."""
    path = Path(path)
    examples = [{"input": it.input, "target": it.target} for it in items]
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps({"examples": examples}, ensure_ascii=False, indent=1), encoding="utf-8")
    except OSError as e:
        raise OSError(f"cannot write {path}: {e}") from e
