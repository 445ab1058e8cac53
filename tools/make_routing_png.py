"""Draw the routing view of one prompt as a PNG (docs/routing.png): each token boxed in its adapter's colour.

    .venv/bin/python -m tools.make_routing_png [--bundle DIR] [--out docs/routing.png]

The default prompt puts two skills in one message (a counting question, then an arithmetic expression),
so the picture shows the learned router switching adapters inside one sequence.
"""

from __future__ import annotations

import argparse
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.patches import Patch  # noqa: E402

from molora.bundle import load  # noqa: E402
from molora.cli import routed_view  # noqa: E402
from molora.data.skills import EVAL_SEED_BASE, generate  # noqa: E402
from molora.view import NONE_LABEL, PALETTE  # noqa: E402


def draw(view, title: str, out: str, width: int = 92) -> None:
    colour = {n: PALETTE[i % len(PALETTE)] for i, n in enumerate(view.adapters)}
    lines, line, col = [], [], 0
    for text, adapter, answer in view.tokens:
        for k, piece in enumerate(text.split("\n")):
            if k:
                lines.append(line)
                line, col = [], 0
            if piece:
                if col + len(piece) > width:
                    lines.append(line)
                    line, col = [], 0
                line.append((col, piece, adapter, answer))
                col += len(piece)
    lines.append(line)
    fig, ax = plt.subplots(figsize=(width * 0.105, 0.32 * len(lines) + 1.2))
    ax.set_xlim(0, width)
    ax.set_ylim(-len(lines), 1)
    ax.axis("off")
    for y, row in enumerate(lines):
        for x, piece, adapter, answer in row:
            face = colour.get(adapter, "#dddddd")
            ax.add_patch(
                plt.Rectangle(
                    (x, -y - 0.4),
                    len(piece),
                    0.8,
                    color=face,
                    alpha=0.9,
                    ec="black" if answer else "none",
                    lw=1.2 if answer else 0,
                )
            )
            ax.text(
                x + 0.05,
                -y,
                piece,
                va="center",
                ha="left",
                family="monospace",
                fontsize=9,
                color="white" if adapter in colour else "#333333",
            )
    handles = [Patch(color=colour[n], label=n) for n in view.adapters] + [Patch(color="#dddddd", label=NONE_LABEL)]
    ax.legend(
        handles=handles,
        loc="upper center",
        bbox_to_anchor=(0.5, 1.0 + 0.9 / len(lines)),
        ncol=len(handles),
        frameon=False,
        fontsize=9,
    )
    ax.set_title(title, fontsize=10, pad=26)
    fig.savefig(out, dpi=110, bbox_inches="tight")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--bundle", default=None)
    p.add_argument("--out", default="docs/routing.png")
    args = p.parse_args(argv)
    mm = load(args.bundle)
    a = generate("object_counting", 1, seed=EVAL_SEED_BASE + 31)[0]
    b = generate("multistep_arithmetic_two", 1, seed=EVAL_SEED_BASE + 31)[0]
    view = routed_view(mm, a.input + "\n" + b.input, max_new_tokens=72)
    counts = ", ".join(f"{k} {v}" for k, v in view.counts().items())
    draw(view, f"learned per-token routing, {mm.bundle.name} (boxed: generated answer) — tokens: {counts}", args.out)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
