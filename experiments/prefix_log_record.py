"""Turn the per-run lines of a `molora bench engine --shared-prefix` stderr log into a record, for a run that
was stopped before it wrote its JSON (the full run takes hours on a loaded 2-core machine).

    python -m experiments.prefix_log_record docs/prefix_cache_learned.log --into docs/prefix_cache.json \\
        --key learned_from_log --command "molora bench engine --shared-prefix --repeats 1 --chats 4"

Each line `  <part> <routing> <cache_on|cache_off>: <wall> s, median TTFT <ttft> s` becomes
record[key][part][routing] = {"wall_s": {...}, "median_ttft_s": {...}, "tok_s": {...}, "tok_s_ratio": off / on
wall, "ttft_ratio": off / on TTFT} (tok_s from --requests x --new-tokens). Only pairs with both variants
are kept. The log itself is committed beside the record.
"""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path

LINE = re.compile(r"^\s+(\w+) (cache_on|cache_off): ([\d.]+) s, median TTFT ([\d.]+) s$")


def parse(text: str, generated: int) -> dict:
    runs: dict[str, dict[str, tuple[float, float]]] = {}
    for line in text.splitlines():
        m = LINE.match(line)
        if m:
            runs.setdefault(m[1], {})[m[2]] = (float(m[3]), float(m[4]))
    out = {}
    for routing, v in runs.items():
        if set(v) == {"cache_on", "cache_off"}:
            wall = {k: v[k][0] for k in v}
            ttft = {k: v[k][1] for k in v}
            out[routing] = {
                "wall_s": wall,
                "median_ttft_s": ttft,
                "tok_s": {k: round(generated / w, 4) for k, w in wall.items()},
                "tok_s_ratio": round(wall["cache_off"] / wall["cache_on"], 4),
                "ttft_ratio": round(ttft["cache_off"] / ttft["cache_on"], 4),
            }
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("log")
    ap.add_argument("--into", required=True, help="the record (JSON) to add the parsed runs to")
    ap.add_argument("--key", required=True)
    ap.add_argument("--command", required=True, help="the command that wrote the log")
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--new-tokens", type=int, default=64)
    a = ap.parse_args()
    record = json.loads(Path(a.into).read_text(encoding="utf-8"))
    record[a.key] = {
        "log": Path(a.log).name,
        "command": a.command,
        "requests": a.requests,
        "new_tokens": a.new_tokens,
        "shared_prefix": parse(Path(a.log).read_text(), a.requests * a.new_tokens),
    }
    Path(a.into).write_text(json.dumps(record, indent=1) + "\n", encoding="utf-8")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
