"""`molora demo --multimodal`: the digits bundle drawn and captioned under each way of applying its adapters.

One greedy image per digit 0..9 per mode (a PNG grid: a row per mode) and a caption table: the caption each
mode writes after its own drawn 7, and its caption of a real test image. Modes:

    base                      no adapter
    image adapter everywhere  image_apart on every token (trained alone, on every token)
    text adapter everywhere   text_apart on every token
    both summed everywhere    image_apart + text_apart on every token
    vocab-routed, apart       image tokens -> image_apart, the rest -> text_apart
    vocab-routed, joint       the bundle's router: image / text, trained together under it
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from molora.multimodal import generate as mg
from molora.multimodal.vocab import load_splits
from molora.routing import VocabRouter

if TYPE_CHECKING:
    from molora.model.attach import MoLoRAModel


def modes(mm: MoLoRAModel) -> dict[str, Any]:
    """Mode label -> routing spec on a loaded digits bundle (apart and joint adapters both loaded)."""
    router = mm.router
    apart = VocabRouter([(lo, hi, f"{n}_apart") for lo, hi, n in router.ranges], f"{router.default}_apart")
    return {
        "base": None,
        "image adapter everywhere": "image_apart",
        "text adapter everywhere": "text_apart",
        "both summed everywhere": mg.EveryToken(["image_apart", "text_apart"]),
        "vocab-routed, apart": apart,
        "vocab-routed, joint": router,
    }


def grid_png(rows: dict[str, list[np.ndarray | None]], path: str | Path, scale: int = 6) -> Path:
    """A row of 8x8 images per mode; labelled with matplotlib when it is installed, plain otherwise."""
    blank = np.full(64, 8, dtype=np.int64)  # a missing image shows as grey
    pics = {k: [mg.to_pixels(im if im is not None else blank, scale) for im in v] for k, v in rows.items()}
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        gap = np.full((8 * scale, 2), 255, dtype=np.uint8)
        lines = [np.hstack([x for p in ps for x in (p, gap)]) for ps in pics.values()]
        sep = np.full((2, lines[0].shape[1]), 255, dtype=np.uint8)
        return mg.write_png(np.vstack([x for ln in lines for x in (ln, sep)]), path)
    n_cols = max(len(v) for v in pics.values())
    fig, axes = plt.subplots(len(pics), n_cols, figsize=(1.0 * n_cols + 1.8, 1.0 * len(pics)))
    for r, (label, ps) in enumerate(pics.items()):
        for c in range(n_cols):
            ax = axes[r][c]
            ax.set_xticks([])
            ax.set_yticks([])
            if c < len(ps):
                ax.imshow(ps[c], cmap="gray", vmin=0, vmax=255)
            if c == 0:
                ax.set_ylabel(label, rotation=0, ha="right", va="center", fontsize=8)
            if r == 0:
                ax.set_title(str(c), fontsize=8)
    fig.tight_layout()
    fig.savefig(str(path), dpi=100)
    plt.close(fig)
    return Path(path)


def run_demo(mm: MoLoRAModel, out_png: str | Path) -> tuple[Path, list[list[str]]]:
    """Draw 0..9 under every mode (greedy), write the grid, and return it with the caption table rows
    [mode, caption after its own 7, caption of a real 7]."""
    test = load_splits()["test"]
    real7 = test.images[int(np.flatnonzero(test.labels == 7)[0])]
    rows, table = {}, []
    for label, spec in modes(mm).items():
        drawn = mg.draw(mm, list(range(10)), spec)
        rows[label] = [d.image for d in drawn]
        read = mg.caption_images(mm, [real7], spec)[0]
        table.append([label, drawn[7].caption or "(empty)", read or "(empty)"])
    return grid_png(rows, out_png), table
