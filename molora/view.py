"""The routing view: a prompt and its answer with every token coloured by the adapter it was routed to.

Three renderings of one `RoutedText`: ANSI colours for the terminal, JSON
(`{"tokens": [{"text", "adapter"}], "counts": {...}}`, adapter null for none) and a standalone HTML page
with a legend. Token texts are cut from incremental decodes so a multi-byte character is never split.
"""

from __future__ import annotations

import html
import json
from collections import Counter
from dataclasses import dataclass
from typing import Any

PALETTE = ["#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e", "#17becf", "#8c564b", "#e377c2"]
ANSI = ["34", "31", "32", "35", "33", "36", "90", "95"]
NONE_LABEL = "base"


@dataclass
class RoutedText:
    tokens: list[tuple[str, str | None, bool]]  # (text, adapter or None, is_answer)
    adapters: list[str]  # legend order

    def counts(self) -> dict[str, int]:
        c = Counter(a if a is not None else NONE_LABEL for _, a, _ in self.tokens)
        return {name: c.get(name, 0) for name in [*self.adapters, NONE_LABEL]}

    def to_json(self) -> dict:
        return {
            "tokens": [{"text": t, "adapter": a, "answer": ans} for t, a, ans in self.tokens],
            "counts": self.counts(),
        }


def routed_text(
    tokenizer: Any, ids: list[int], adapters: list[str | None], n_prompt: int, names: list[str]
) -> RoutedText:
    """Pair each visible token of ids with its adapter; special tokens (template markers) are dropped."""
    special = set(getattr(tokenizer, "all_special_ids", []) or [])
    out: list[tuple[str, str | None, bool]] = []
    prev = ""
    for i in range(len(ids)):
        text = tokenizer.decode(ids[: i + 1], skip_special_tokens=True)
        if text.endswith("\ufffd"):
            continue  # part of a multi-byte character: its text arrives with the next token
        piece, prev = text[len(prev) :], text
        if ids[i] in special or not piece:
            continue
        out.append((piece, adapters[i] if i < len(adapters) else None, i >= n_prompt))
    return RoutedText(out, list(names))


def to_ansi(view: RoutedText) -> str:
    colour = {n: ANSI[i % len(ANSI)] for i, n in enumerate(view.adapters)}
    parts = []
    for text, adapter, _ in view.tokens:
        code = colour.get(adapter, "2")  # dim for base
        parts.append(f"\x1b[{code}m{text}\x1b[0m")
    legend = "  ".join(f"\x1b[{colour[n]}m■ {n}\x1b[0m" for n in view.adapters) + f"  \x1b[2m■ {NONE_LABEL}\x1b[0m"
    counts = ", ".join(f"{k}: {v}" for k, v in view.counts().items())
    return "".join(parts) + f"\n\n{legend}\ntokens per adapter: {counts}"


def to_plain(view: RoutedText) -> str:
    counts = ", ".join(f"{k}: {v}" for k, v in view.counts().items())
    return "".join(t for t, _, _ in view.tokens) + f"\n\ntokens per adapter: {counts}"


def to_html(views: list[tuple[str, RoutedText]], title: str = "molora routing view") -> str:
    """A standalone page: one panel per (heading, view), tokens coloured, legend and counts."""
    names = views[0][1].adapters if views else []
    colour = {n: PALETTE[i % len(PALETTE)] for i, n in enumerate(names)}
    legend = "".join(f'<span class="tok" style="background:{colour[n]}">{html.escape(n)}</span> ' for n in names)
    legend += f'<span class="tok base">{NONE_LABEL}</span>'
    panels = []
    for heading, view in views:
        spans = []
        for text, adapter, answer in view.tokens:
            style = f' style="background:{colour[adapter]}"' if adapter in colour else ""
            cls = "tok" + ("" if adapter in colour else " base") + (" ans" if answer else "")
            spans.append(
                f'<span class="{cls}"{style} title="{html.escape(adapter or NONE_LABEL)}">{html.escape(text)}</span>'
            )
        counts = " · ".join(f"{html.escape(k)} {v}" for k, v in view.counts().items())
        panels.append(
            f'<section><h2>{html.escape(heading)}</h2><div class="text">{"".join(spans)}</div>'
            f'<p class="counts">tokens per adapter: {counts}</p></section>'
        )
    return f"""<!doctype html><html><head><meta charset="utf-8"><title>{html.escape(title)}</title>
<style>
body {{ font-family: system-ui, sans-serif; max-width: 60rem; margin: 2rem auto; color: #222; }}
.text {{ font-family: ui-monospace, monospace; white-space: pre-wrap; line-height: 1.9; }}
.tok {{ color: white; border-radius: 3px; padding: 1px 0; }}
.tok.base {{ background: #ddd; color: #333; }}
.tok.ans {{ outline: 2px solid #222; }}
.legend .tok {{ padding: 2px 6px; }}
.counts {{ color: #555; font-size: 0.9rem; }}
</style></head><body><h1>{html.escape(title)}</h1>
<p class="legend">{legend} &nbsp; (outlined: generated answer)</p>
{"".join(panels)}</body></html>
"""


def render_json(view: RoutedText) -> str:
    return json.dumps(view.to_json(), ensure_ascii=False)
