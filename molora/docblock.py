"""Rendered blocks in README and docs: a script owns the text between two HTML comments and rewrites it from
its committed record, so a figure in the docs never drifts from its measurement.

    <!-- results:begin (tools/make_results.py) -->
    ...generated...
    <!-- results:end -->

`markers(name, script)` gives the pair, `replace_block` swaps one block in a text (the block carries its own
markers, as `wrap` builds it), `write_block` does it in a file (or, with check, only says whether it is stale);
`from_docs` moves a README-relative block's links to a page in docs/.
"""

from __future__ import annotations

from pathlib import Path


def markers(name: str, script: str) -> tuple[str, str]:
    return f"<!-- {name}:begin ({script}) -->", f"<!-- {name}:end -->"


def wrap(begin: str, end: str, body: str) -> str:
    """A block: the begin marker, the body and the end marker, one per line."""
    return f"{begin}\n{body}\n{end}"


def replace_block(text: str, begin: str, end: str, block: str, where: str | Path = "the text") -> str:
    """`text` with its begin...end block (markers included) replaced by `block` (which starts with begin and ends
    with end); SystemExit naming `where` when the markers are missing, so a script stops rather than append."""
    if not (block.startswith(begin) and block.endswith(end)):
        raise ValueError(f"a rendered block must start with {begin!r} and end with {end!r}")
    a = text.find(begin)
    b = text.find(end, a + len(begin)) if a >= 0 else -1
    if a < 0 or b < 0:
        raise SystemExit(f"{where} has no {begin} ... {end} block to render into; add the two lines where it belongs")
    return text[:a] + block + text[b + len(end) :]


def from_docs(block: str) -> str:
    """A block rendered with README-relative links (`](docs/x)`), its links made relative to a page in docs/."""
    return block.replace("](docs/", "](")


def write_block(path: Path, begin: str, end: str, block: str, *, check: bool = False) -> bool:
    """Render `block` into the file at `path`; True when the file changed (with check: would change; nothing is
    written)."""
    text = path.read_text(encoding="utf-8")
    new = replace_block(text, begin, end, block, path)
    if new != text and not check:
        path.write_text(new, encoding="utf-8")
    return new != text
