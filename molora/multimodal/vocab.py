"""The early-fusion vocabulary and data: text words and image codes in one id space, and digit sequences.

    ids 0..3    <pad> <bos> <eos> <eoi>        (<eoi> closes an image: routed as text, it predicts the caption)
    ids 4..28   draw the digit this is 0..9 zero..nine
    id  29      <boi>                          (opens an image: routed as image, it predicts the first code)
    ids 30..45  <img_0> .. <img_15>            (one 8x8 digit = 64 codes in raster order, 16 grey levels)

The tokenizer is a real transformers tokenizer (a `tokenizers` WordLevel model split on whitespace, wrapped
by PreTrainedTokenizerFast), saved as tokenizer.json so AutoTokenizer and bundle loading work unchanged.
The image range is declared by token names (`IMAGE_PREFIXES`): a router reads it from the vocabulary
(`molora.routing.VocabRouter.from_vocab`), never from hard-coded ids.

Data: sklearn's bundled `load_digits` (1,797 images, 8x8, values 0..16), quantised to 16 levels and split
once, seeded, into train / validation / test images. This module knows nothing of models or routing.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from molora.errors import MoLoRAError

SPECIALS = ("<pad>", "<bos>", "<eos>", "<eoi>")
NUMBER_WORDS = ("zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine")
WORDS = ("draw", "the", "digit", "this", "is", *(str(d) for d in range(10)), *NUMBER_WORDS)
BOI, EOI = "<boi>", "<eoi>"
LEVELS = 16
CODE_PREFIX = "<img_"
CODES = tuple(f"{CODE_PREFIX}{q}>" for q in range(LEVELS))
IMAGE_PREFIXES = (BOI, CODE_PREFIX)  # the tokens a vocab router sends to the image adapter
PIXELS = 64  # codes per image
PROMPT_TEMPLATE = "<bos> {prompt}"
END = " <eos>"


def vocabulary() -> list[str]:
    return [*SPECIALS, *WORDS, BOI, *CODES]


def build_tokenizer() -> Any:
    """The 46-token PreTrainedTokenizerFast (save it with `save_pretrained`)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {t: i for i, t in enumerate(vocabulary())}
    core = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    core.decoder = decoders.WordPiece(prefix="##")  # joins words with spaces
    tok = PreTrainedTokenizerFast(
        tokenizer_object=core, bos_token="<bos>", eos_token="<eos>", pad_token="<pad>", unk_token="<pad>"
    )
    return tok


def image_token_ids(tokenizer: Any) -> tuple[int, list[int]]:
    """(<boi> id, code ids by level) from the tokenizer."""
    vocab = tokenizer.get_vocab()
    missing = [t for t in (BOI, *CODES) if t not in vocab]
    if missing:
        raise MoLoRAError(
            f"tokenizer lacks the image tokens {missing[:3]}...; build it with molora.multimodal.vocab.build_tokenizer"
        )
    return vocab[BOI], [vocab[c] for c in CODES]


# --------------------------------------------------------------------------------------------- data


@dataclass(frozen=True)
class Digits:
    """Quantised images [N, 64] (0..15) and labels [N], one split."""

    images: np.ndarray
    labels: np.ndarray


def load_splits(seed: int = 0, n_val: int = 300, n_test: int = 360) -> dict[str, Digits]:
    """train / val / test splits of sklearn's digits, quantised to 16 levels (seeded permutation)."""
    try:
        from sklearn.datasets import load_digits
    except ImportError as e:
        raise MoLoRAError("the multimodal demo needs scikit-learn: pip install 'molora[multimodal]'") from e
    d = load_digits()
    images = quantise(d.data)
    order = np.random.RandomState(seed).permutation(len(images))
    test, val, train = order[:n_test], order[n_test : n_test + n_val], order[n_test + n_val :]
    return {
        name: Digits(images[idx], d.target[idx].astype(np.int64))
        for name, idx in (("train", train), ("val", val), ("test", test))
    }


def quantise(pixels: np.ndarray) -> np.ndarray:
    """sklearn's 0..16 grey values -> 0..15 levels (int64)."""
    return np.minimum(np.asarray(pixels) * LEVELS // 17, LEVELS - 1).astype(np.int64)


def invert(image: np.ndarray) -> np.ndarray:
    """The image adapter's style: every level q becomes 15 - q."""
    return (LEVELS - 1) - np.asarray(image)


def codes_text(image: np.ndarray) -> str:
    return " ".join(CODES[int(q)] for q in image)


def caption(digit: int, style: str = "base") -> str:
    """The base caption ("this is the digit 7") or the text adapter's phrasing ("the digit is seven")."""
    if style == "base":
        return f"this is the digit {digit}"
    if style == "new":
        return f"the digit is {NUMBER_WORDS[digit]}"
    raise MoLoRAError(f"caption style {style!r}: use base or new")


def draw_prompt(digit: int) -> str:
    return f"draw the digit {digit}"


def image_span(image: np.ndarray) -> str:
    return f"{BOI} {codes_text(image)} <eoi>"


def parse_caption(text: str) -> tuple[int | None, str | None]:
    """(digit, style) of a caption text, or (None, None) when it is neither phrasing (a broken caption)."""
    words = text.replace("<eos>", " ").split()
    if (
        len(words) == 5
        and words[:4] == ["this", "is", "the", "digit"]
        and words[4] in "0123456789"
        and len(words[4]) == 1
    ):
        return int(words[4]), "base"
    if len(words) == 4 and words[:3] == ["the", "digit", "is"] and words[3] in NUMBER_WORDS:
        return NUMBER_WORDS.index(words[3]), "new"
    return None, None


def base_sequences(data: Digits, rng: np.random.RandomState) -> list[str]:
    """One epoch of the base model's texts: per image an interleaved line (prompt, image, caption) or a
    captioning line (image, caption), plus number-word lines, shuffled."""
    out = []
    for image, label in zip(data.images, data.labels):
        d = int(label)
        if rng.rand() < 0.6:
            out.append(f"<bos> {draw_prompt(d)} {image_span(image)} {caption(d)} <eos>")
        else:
            out.append(f"<bos> {image_span(image)} {caption(d)} <eos>")
    for d in range(10):
        out += [f"<bos> {d} is {NUMBER_WORDS[d]} <eos>", f"<bos> {NUMBER_WORDS[d]} is {d} <eos>"] * 4
    rng.shuffle(out)
    return out


def adapter_pairs(
    data: Digits, image_style: str, text_style: str, *, captioning: float = 0.3, seed: int = 0
) -> list[tuple[str, str]]:
    """(prompt, completion) pairs for `molora.train.adapter` (template PROMPT_TEMPLATE, end END).

    image_style "base" | "inverted" for generated images; text_style "base" | "new" for captions. A share
    `captioning` of the pairs instead gives a real (not inverted) image as the prompt and the caption as the
    completion, so an adapter that runs on image tokens also learns to read ordinary images."""
    rng = np.random.RandomState(seed)
    out = []
    for image, label in zip(data.images, data.labels):
        d = int(label)
        if rng.rand() < captioning:
            out.append((image_span(image), caption(d, text_style)))
            continue
        drawn = invert(image) if image_style == "inverted" else image
        out.append((draw_prompt(d), f"{image_span(drawn)} {caption(d, text_style)}"))
    return out
