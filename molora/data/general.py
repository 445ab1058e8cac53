"""General text: prompts outside every skill, for the router's base class and for base-retention checks.

Pure Python (no torch). Three sources, each split by item into train / validation / test once, by a fixed
seed, so that no setting is ever chosen on an item that is reported:

- **Self-Instruct** seed tasks (175 human-written everyday instructions; `self_instruct.jsonl.gz`, Apache-2.0):
  a seeded shuffle of the task ids gives 105 train, 35 validation, 35 test prompts.
- **GSM8K** train problems (`generic.jsonl.gz`, 400 of them, MIT): word problems, the nearest general text to
  the arithmetic and counting skills. The first 150 of a seeded shuffle were the router's generic text before
  this split existed and stay in train; of the other 250, 25 are validation, 25 test, the rest train.
- **Topic prompts** (train only): everyday requests built from templates and words of `words.txt.gz`
  ("Write a short poem about the harbor."), so the base class sees many topics and forms, including the nouns
  the counting skill lists (a banana in a poem is not a counting question). Their answers come from the base model
  itself (`molora.train.default`).

    split = general_split()            # {"train": [...], "val": [...], "test": [...]} of {"id", "prompt", ...}
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

from molora.data.jsonl import read_jsonl
from molora.errors import RoutingError

DATA = Path(__file__).resolve().parent
SELF_INSTRUCT_FILE = DATA / "self_instruct.jsonl.gz"
GSM8K_FILE = DATA / "generic.jsonl.gz"
EVERYDAY_TOPICS = (
    "sea",
    "moon",
    "city",
    "forest",
    "river",
    "mountain",
    "garden",
    "library",
    "bicycle",
    "train",
    "winter",
    "summer",
    "rain",
    "coffee",
    "tea",
    "bread",
    "kitchen",
    "school",
    "teacher",
    "doctor",
    "hospital",
    "museum",
    "painting",
    "song",
    "guitar",
    "camera",
    "phone",
    "computer",
    "robot",
    "rocket",
    "planet",
    "star",
    "island",
    "bridge",
    "castle",
    "market",
    "festival",
    "birthday",
    "wedding",
    "holiday",
    "airport",
    "hotel",
    "umbrella",
    "clock",
    "window",
    "letter",
    "newspaper",
    "movie",
    "football",
    "marathon",
    "volcano",
    "desert",
    "ocean",
    "friendship",
    "job interview",
    "recipe",
    "soup",
    "salad",
    "sandwich",
    "cookie",
)
SPLIT_SEED = 15  # the general split's shuffle seed (never changed once results exist)
SELF_INSTRUCT_SIZES = (105, 35, 35)  # train, val, test
GSM8K_ROUTER_OLD = 150  # the router's generic rows before the split (seed 0 shuffle): train only
GSM8K_HELD = (25, 25)  # val, test from the rest

TOPIC_TEMPLATES = (
    "Write a short poem about the {w}.",
    "What is a {w}? Explain it to a child.",
    "Give me three tips for buying a {w}.",
    "Write a two-sentence story about a {w} and a {v}.",
    "Describe the {w} in one paragraph.",
    "What is the difference between a {w} and a {v}?",
    "Translate into French: I like the {w}.",
    "Write a tweet about my new {w}.",
    "Suggest a name for a shop that sells {w}s.",
    "Summarize in one sentence why people like the {w}.",
    "Write an email to a friend about the {w} I saw yesterday.",
    "List some facts about the {w}.",
)


def self_instruct_rows() -> list[dict]:
    """{"id", "prompt", "output"} per Self-Instruct task: the instruction, then its instance input if any."""
    rows = []
    for task in read_jsonl(SELF_INSTRUCT_FILE, comments=True):
        inst = task["instances"][0]
        prompt = task["instruction"].strip()
        if inst.get("input", "").strip():
            prompt += "\n\n" + inst["input"].strip()
        rows.append({"id": task["id"], "source": "self_instruct", "prompt": prompt, "output": inst["output"].strip()})
    return rows


def gsm8k_rows() -> list[dict]:
    """{"id", "prompt", "output"} per shipped GSM8K train problem, in the seed-0 shuffle the router always used
    (`molora.train.default.read_generic`)."""
    rows = read_jsonl(GSM8K_FILE, comments=True)
    random.Random(0).shuffle(rows)
    return [
        {"id": f"gsm8k_{i}", "source": "gsm8k", "prompt": r["prompt"], "output": r["completion"]}
        for i, r in enumerate(rows)
    ]


def general_split() -> dict[str, list[dict]]:
    """The fixed train / val / test split of Self-Instruct and GSM8K general prompts (module docstring)."""
    si = self_instruct_rows()
    random.Random(SPLIT_SEED).shuffle(si)
    a, b, _ = SELF_INSTRUCT_SIZES
    gs = gsm8k_rows()
    old, rest = gs[:GSM8K_ROUTER_OLD], gs[GSM8K_ROUTER_OLD:]
    random.Random(SPLIT_SEED).shuffle(rest)
    v, t = GSM8K_HELD
    return {
        "train": si[:a] + old + rest[v + t :],
        "val": si[a : a + b] + rest[:v],
        "test": si[a + b :] + rest[v : v + t],
    }


def topic_prompts(n: int, seed: int) -> list[dict]:
    """n templated everyday requests over random words (train only)."""
    from molora.data.skills import _CATEGORIES

    words = list(EVERYDAY_TOPICS) + [one for items in _CATEGORIES.values() for one, _ in items]
    rng = random.Random(seed)
    out = []
    for i in range(n):
        t = TOPIC_TEMPLATES[i % len(TOPIC_TEMPLATES)]
        out.append(
            {"id": f"topic_{seed}_{i}", "source": "topic", "prompt": t.format(w=rng.choice(words), v=rng.choice(words))}
        )
    return out


def split_record() -> dict[str, list[str]]:
    """The ids of each split, for a bundle's manifest."""
    return {k: [r["id"] for r in v] for k, v in general_split().items()}


def general_rows(
    tokenizer: Any, n: int, template: str | None = None, *, with_output: bool = False, split: str = "train"
) -> list[list[int]]:
    """Token ids of the first n general rows of `split`, each prompt rendered as one user message: in `template`
    ("...{prompt}..."), else the tokenizer's chat template, else as plain text; with_output: the row's reference
    answer follows (text a model reads as it writes its own answer)."""
    rows = general_split()[split][:n]
    out = []
    for r in rows:
        if template is not None:
            text = template.replace("{prompt}", r["prompt"])
        elif getattr(tokenizer, "chat_template", None) is not None:
            msgs = [{"role": "user", "content": r["prompt"]}]
            text = tokenizer.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
        else:
            text = r["prompt"] + "\n"
        out.append(tokenizer.encode(text + (r["output"] if with_output else ""), add_special_tokens=False))
    return out


def calibration_rows(mm: Any, n: int) -> list[list[int]]:
    """Token ids of n general prompts of the train split (molora.data.general), each rendered as the model's
    bundle renders one user message (its prompt template; the tokenizer's chat template without a bundle):
    `molora.data.general.general_rows`, which this refuses to let fall back to plain text."""
    tok = getattr(mm, "tokenizer", None)
    if tok is None:
        raise RoutingError(
            "arrow rms_threshold calibrates on general text and needs the model's tokenizer "
            "(molora.load attaches it; or call router.calibrate(rows) with token ids)"
        )
    template = getattr(getattr(mm, "bundle", None), "prompt_template", None)
    if template is None and getattr(tok, "chat_template", None) is None:
        raise RoutingError(
            "arrow rms_threshold renders general prompts in the model's chat template, and its "
            "tokenizer has none: load it through a bundle with a prompt_template, or call "
            "router.calibrate(rows) with token ids"
        )
    return general_rows(tok, n, template)
