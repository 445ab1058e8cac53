"""How large trained adapters' deltas are against their base weights: the figure behind the load-time bound
`molora.adapters.io.MAX_DELTA_RATIO`.

For every adapter of the embedded default bundle, ||scale * B @ A||_F / ||W||_F per adapted module
(`molora.adapters.io.delta_norm_ratio`): the largest, the median and the module count. Writes
docs/adapter_magnitude.json.

    .venv/bin/python -m experiments.adapter_magnitude --json docs/adapter_magnitude.json
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import subprocess

import molora
from molora.adapters.io import MAX_DELTA_RATIO, delta_norm_ratio


def cpu_name() -> str:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
        return next(line.split(":", 1)[1].strip() for line in out.splitlines() if line.startswith("Model name"))
    except (OSError, subprocess.CalledProcessError, StopIteration):
        return platform.processor() or "unknown"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", default="docs/adapter_magnitude.json", help="record to write")
    args = ap.parse_args()
    mm = molora.load(chooser=False)
    norms = mm.base_norms()
    adapters = {}
    for name, adapter in mm.adapters.items():
        ratios = delta_norm_ratio(adapter, norms)
        adapters[name] = {
            "modules": len(ratios),
            "max_ratio": max(ratios.values()),
            "median_ratio": statistics.median(ratios.values()),
            "max_module": max(ratios, key=ratios.__getitem__),
        }
    record = {
        "what": "||scale * B @ A||_F / ||W||_F of each adapted module of the default bundle's adapters",
        "bound": MAX_DELTA_RATIO,
        "largest": max(a["max_ratio"] for a in adapters.values()),
        "adapters": adapters,
        "cpu": cpu_name(),
        "command": "python -m experiments.adapter_magnitude --json " + args.json,
    }
    with open(args.json, "w") as f:
        json.dump(record, f, indent=2)
        f.write("\n")
    print(json.dumps({k: v for k, v in record.items() if k != "adapters"}))


if __name__ == "__main__":
    main()
