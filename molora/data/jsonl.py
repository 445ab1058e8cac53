"""JSONL in and out: the one reader and writer every training, evaluation and data file goes through.

    for lineno, row in iter_jsonl("data.jsonl"): ...      # blank lines skipped; `.gz` read compressed
    rows = read_jsonl("data.jsonl.gz", comments=True)     # also skips lines starting with '#'
    write_jsonl("out.jsonl", rows)

A line that is not JSON raises `error` (ValueError unless the caller names its own class) with `path:line`; an
unreadable file raises it naming the path. Pure Python, no torch.
"""

from __future__ import annotations

import gzip
import json
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import asdict, is_dataclass
from pathlib import Path
from typing import Any


def iter_jsonl(
    path: str | Path, *, comments: bool = False, error: type[Exception] = ValueError
) -> Iterator[tuple[int, Any]]:
    """(line number, parsed value) for each non-blank line (and, with comments, not starting with '#')."""
    path = Path(path)
    try:
        if path.suffix == ".gz":
            with gzip.open(path, "rt", encoding="utf-8") as f:
                lines = f.read().splitlines()
        else:
            lines = path.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError, EOFError) as e:
        raise error(f"cannot read {path}: {e}") from e
    for lineno, line in enumerate(lines, 1):
        if not line.strip() or (comments and line.startswith("#")):
            continue
        try:
            yield lineno, json.loads(line)
        except json.JSONDecodeError as e:
            raise error(f"{path}:{lineno}: not JSON ({e})") from e


def read_jsonl(path: str | Path, *, comments: bool = False, error: type[Exception] = ValueError) -> list[Any]:
    """The values of a JSONL file, in order (`iter_jsonl` without the line numbers)."""
    return [row for _, row in iter_jsonl(path, comments=comments, error=error)]


def write_jsonl(path: str | Path, rows: Iterable[Mapping | Any]) -> None:
    """One JSON object per line (dataclass instances as their fields), parent folders made."""
    path = Path(path)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with path.open("w", encoding="utf-8") as f:
            for row in rows:
                obj = asdict(row) if is_dataclass(row) and not isinstance(row, type) else dict(row)
                f.write(json.dumps(obj, ensure_ascii=False) + "\n")
    except OSError as e:
        raise OSError(f"cannot write {path}: {e}") from e
