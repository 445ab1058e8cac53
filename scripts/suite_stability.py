"""Does the fast suite depend on test order or on the machine's speed? Run it several times in a random order,
optionally beside a CPU burner, and record each run's seed, counts and exit status.

    PYTHONPATH=. python scripts/suite_stability.py --runs 3                       # random order
    PYTHONPATH=. python scripts/suite_stability.py --runs 5 --burners 2           # random order under a CPU burner
    ... --json docs/suite_stability.json   (a run adds its section to the record: "random" or "burner<N>")

The suite is the one .ci/run shuffles: `-m "not slow and not ray"`, pytest-random-order with module buckets, a
fresh seed per run (from `--seed`'s generator, printed and recorded so a failure can be rerun). A burner is a
child process spinning on the CPU for the whole run, so the tests see a machine slower than usual and shared.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import random
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent


def _burn(stop: Any) -> None:  # a multiprocessing.Event
    x = 0
    while not stop.is_set():
        for i in range(100_000):
            x = (x * 31 + i) % 1_000_003


def _counts(out: str) -> dict[str, int]:
    """pytest's last summary line as numbers: {"passed": 960, "failed": 0, ...}."""
    lines = [ln for ln in out.splitlines() if re.search(r"\d+ (passed|failed|error)", ln)]
    if not lines:
        return {}
    return {k: int(n) for n, k in re.findall(r"(\d+) (passed|failed|errors?|skipped|deselected)", lines[-1])}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--burners", type=int, default=0, help="CPU-spinning child processes during each run")
    ap.add_argument("--seed", type=int, default=0, help="seeds the generator of the runs' order seeds")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    rng = random.Random(args.seed)
    runs = []
    for _ in range(args.runs):
        order_seed = rng.randrange(1, 100_000)
        stop = multiprocessing.Event()
        burners = [multiprocessing.Process(target=_burn, args=(stop,), daemon=True) for _ in range(args.burners)]
        for b in burners:
            b.start()
        t0 = time.perf_counter()
        cmd = [sys.executable, "-m", "pytest", "-m", "not slow and not ray", "-p", "no:cacheprovider"]
        cmd += ["--random-order-bucket=module", f"--random-order-seed={order_seed}"]
        proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
        stop.set()
        for b in burners:
            b.join()
        out = proc.stdout + proc.stderr
        failed = [ln for ln in out.splitlines() if ln.startswith(("FAILED", "ERROR"))]
        run = {
            "order_seed": order_seed,
            "exit": proc.returncode,
            "counts": _counts(out),
            "wall_s": round(time.perf_counter() - t0, 1),
            "failed": failed[:20],
            "load_avg_end": [round(x, 2) for x in os.getloadavg()],
        }
        runs.append(run)
        print(json.dumps(run), flush=True)
    section = {
        "command": " ".join(["PYTHONPATH=. python scripts/suite_stability.py"] + sys.argv[1:]),
        "burners": args.burners,
        "cpus": os.cpu_count(),
        "runs": runs,
        "passed_runs": sum(r["exit"] == 0 for r in runs),
    }
    print(json.dumps({k: v for k, v in section.items() if k != "runs"}))
    if args.json is not None:
        record = json.loads(args.json.read_text()) if args.json.exists() else {}
        record["random" if args.burners == 0 else f"burner{args.burners}"] = section
        args.json.write_text(json.dumps(record, indent=1) + "\n")
    return 0 if section["passed_runs"] == len(runs) else 1


if __name__ == "__main__":
    sys.exit(main())
