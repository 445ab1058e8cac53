"""Scoring generated digits and captions, and timing one routed pass against one pass per adapter.

An image is read by an SVC trained on the real quantised training images (its gamma and C chosen on the
validation images). An inverted image (mean level above the middle: the background is light) is read
after inverting it back, so digit accuracy and style are measured apart. A caption is scored by
`molora.multimodal.vocab.parse_caption`: its digit, its phrasing, or broken. Knows nothing of HTTP.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from molora.multimodal import generate as mg
from molora.multimodal.vocab import LEVELS, Digits, invert, parse_caption

if TYPE_CHECKING:
    from molora.model.attach import MoLoRAModel

INVERTED_MEAN = (LEVELS - 1) / 2


@dataclass
class Reader:
    """An SVC over quantised images [N, 64] (levels 0..15)."""

    model: Any
    params: dict
    val_accuracy: float
    test_accuracy: float

    def read(self, images: np.ndarray) -> np.ndarray:
        return self.model.predict(np.asarray(images, dtype=np.float64))


def fit_reader(
    splits: dict[str, Digits], grid: Sequence[tuple[float, float]] = ((0.001, 5), (0.003, 5), (0.01, 5), (0.003, 1))
) -> Reader:
    """Fit an SVC per (gamma, C) on train, keep the best on val, score it once on test."""
    from sklearn.svm import SVC

    best = None
    for gamma, c in grid:
        m = SVC(gamma=gamma, C=c).fit(splits["train"].images, splits["train"].labels)
        acc = float((m.predict(splits["val"].images) == splits["val"].labels).mean())
        if best is None or acc > best[0]:
            best = (acc, m, {"gamma": gamma, "C": c})
    acc, model, params = best
    test = float((model.predict(splits["test"].images) == splits["test"].labels).mean())
    return Reader(model, params, round(acc, 4), round(test, 4))


def is_inverted(image: np.ndarray) -> bool:
    return float(np.mean(image)) > INVERTED_MEAN


def score_draws(reader: Reader, digits: Sequence[int], drawn: Sequence[mg.Drawn]) -> dict:
    """Image accuracy, inverted share, caption accuracy, new-phrasing share, broken captions."""
    images = [d.image for d in drawn]
    ok = [im is not None for im in images]
    inv = [bool(im is not None and is_inverted(im)) for im in images]
    upright = (
        np.stack([invert(im) if v else im for im, v in zip(images, inv) if im is not None])
        if any(ok)
        else np.zeros((0, 64))
    )
    read = reader.read(upright) if len(upright) else np.zeros(0)
    want = np.array([d for d, o in zip(digits, ok) if o])
    caps = [parse_caption(d.caption) for d in drawn]
    n = len(drawn)
    return {
        "n": n,
        "image_accuracy": round(float((read == want).sum()) / n, 3),
        "inverted": round(sum(inv) / n, 3),
        **score_captions(digits, [d.caption for d in drawn], caps),
    }


def score_captions(digits: Sequence[int], texts: Sequence[str], parsed: Sequence[tuple] | None = None) -> dict:
    parsed = parsed if parsed is not None else [parse_caption(t) for t in texts]
    n = len(texts)
    return {
        "caption_accuracy": round(sum(p[0] == d for p, d in zip(parsed, digits)) / n, 3),
        "new_phrasing": round(sum(p[1] == "new" for p in parsed) / n, 3),
        "broken": round(sum(p[0] is None for p in parsed) / n, 3),
    }


def evaluate_mode(
    mm: MoLoRAModel,
    reader: Reader,
    spec: Any,
    digits: Sequence[int],
    images: Digits,
    *,
    temperature: float,
    seed: int,
    text_temperature: float | None = None,
) -> dict:
    """Draw (image + caption in one sequence) for `digits` and caption the real `images`, under `spec`."""
    drawn = mg.draw(mm, digits, spec, temperature=temperature, seed=seed, text_temperature=text_temperature)
    out = score_draws(reader, digits, drawn)
    caps = mg.caption_images(mm, list(images.images), spec, temperature=0.0)
    read = score_captions(images.labels.tolist(), caps)
    out.update({f"read_{k}": v for k, v in read.items()})
    return out


def interleaved_times(variants: dict[str, Callable[[], Any]], reps: int) -> dict[str, list[float]]:
    """Seconds per call of each variant, the order rotated every repetition (one warm-up call each first):
    `molora.bench.common.time_interleaved`, in seconds."""
    from molora.bench.common import time_interleaved

    timing = time_interleaved(variants, reps)
    return {n: [ms / 1e3 for ms in v] for n, v in timing.samples.items()}
