"""How long one full garbage collection takes in a serving process, with and without the start-up heap freeze
(molora.engine.heap), and how many objects it walks.

    python -m experiments.gc_pause [--adapters 1000] [--repeats 7] --json docs/gc_pause.json

Builds what the 1,000-adapter traffic bench builds (molora.bench.hotset_traffic.build_engine: the default base, N
random rank-8 adapters registered, a learned router over all of them), runs a few requests so the engine's
buffers exist, then times `gc.collect()` (a generation-2 collection, the kind that fell inside engine steps in
docs/hotset_traffic_stalls.json) `--repeats` times unfrozen and `--repeats` times after `freeze_heap()`, in
alternation (unfreeze between pairs), and writes medians, the objects tracked and the objects frozen.
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

from molora.bench.common import emit, machine_info, set_threads
from molora.bench.hotset_traffic import build_engine, make_adapters, make_traffic, run_traffic
from molora.bench.model_workloads import load_model
from molora.engine.heap import freeze_heap, unfreeze_heap


def timed_collect() -> float:
    t = time.perf_counter()
    gc.collect()
    return 1e3 * (time.perf_counter() - t)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--adapters", type=int, default=1000)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json", default=None)
    a = ap.parse_args(argv)
    set_threads(a.threads)
    base = load_model("smollm2")
    with tempfile.TemporaryDirectory() as tmp:
        paths = make_adapters(base, Path(tmp), a.adapters, 8)
        engine = build_engine(base, paths, 32, 128, 16, "fcfs", 0, 48)
        traffic = make_traffic(list(paths), 32, 1.1, 0.5, int(base.config.vocab_size), 32, 0)
        run_traffic(engine, traffic, 16, 4)  # the engine's buffers, caches and a few loads exist
        off, on, frozen = [], [], []
        tracked = len(gc.get_objects())
        for _ in range(a.repeats):
            off.append(timed_collect())
            frozen.append(freeze_heap())
            on.append(timed_collect())
            unfreeze_heap()
        engine.close()
    out = {
        "what": "one full garbage collection (gc.collect()) in a process holding the 1,000-adapter traffic bench's "
        "engine, unfrozen and after freeze_heap(), alternating",
        "command": "python -m experiments.gc_pause " + " ".join(sys.argv[1:] if argv is None else argv),
        "machine": machine_info(),
        "adapters": a.adapters,
        "repeats": a.repeats,
        "objects_tracked": tracked,
        "objects_frozen_median": statistics.median(frozen),
        "collect_ms": {"unfrozen": [round(x, 3) for x in off], "frozen": [round(x, 3) for x in on]},
        "collect_ms_median": {"unfrozen": round(statistics.median(off), 3), "frozen": round(statistics.median(on), 3)},
    }
    print(json.dumps(out["collect_ms_median"]), file=sys.stderr)
    emit(out, a.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
