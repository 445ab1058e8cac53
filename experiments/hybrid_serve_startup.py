"""What `molora serve ... --router hybrid` costs at start-up: the chooser's calibration (the pool the base model writes,
each adapter's entropies over it, Arrow's binding) on the default bundle's base and adapters, cold and cached.

    python -m experiments.hybrid_serve_startup --json docs/hybrid_serve_startup.json --cache runs/hybrid_cache \
        [--threads 1] [--pool-n 800]

One process, in this order: `build_engine` (what `molora serve` runs before it listens) of the default bundle with
its router set to none (the model and engine alone), then with the served hybrid setting (`--router hybrid`,
molora.userbundle.HYBRID_ROUTER; --pool-n overrides its pool size) on an empty --cache (cold: the calibration is
computed and written), then again on the same cache (warm: read back). The record keeps the wall seconds of each
build, the calibration's own parts as the cache files note them (pool, entropies per adapter), the load average
before and after, and the machine. --cache must be empty or absent (the cold build must compute everything).
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path


def main(argv: list[str] | None = None) -> int:
    import torch

    from molora.bench.common import machine_info
    from molora.bundle import default_bundle_dir
    from molora.engine import EngineConfig
    from molora.manifest import MANIFEST, parse_manifest
    from molora.server.launch import build_engine
    from molora.userbundle import router_entry

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--json", required=True)
    ap.add_argument("--cache", required=True, help="an empty folder for the calibration cache")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--pool-n", type=int, default=None, help="pool size (default: the served setting's)")
    a = ap.parse_args(argv)
    cache = Path(a.cache)
    if cache.exists() and any(cache.iterdir()):
        ap.error(f"--cache {cache} is not empty; the cold build must compute everything")
    os.environ["MOLORA_HYBRID_CACHE"] = str(cache)
    torch.set_num_threads(a.threads)
    load_before = os.getloadavg()
    folder = default_bundle_dir()
    raw = json.loads((folder / MANIFEST).read_text())
    router = router_entry("hybrid")
    if a.pool_n is not None:
        router["pool_n"] = a.pool_n
    cfg = EngineConfig()

    def build(kind: str) -> float:
        bundle = parse_manifest({**raw, "router": router if kind == "hybrid" else {"kind": "none"}}, folder, kind)
        t0 = time.perf_counter()
        engine = build_engine(bundle, cfg)
        seconds = time.perf_counter() - t0
        assert (engine.mm.chooser is not None) == (kind == "hybrid")
        engine.close()
        return round(seconds, 1)

    none_s = build("none")
    cold_s = build("hybrid")
    files = {p.name: json.loads(p.read_text()) for p in sorted(cache.glob("*.json"))}
    warm_s = build("hybrid")
    pool = next(v for k, v in files.items() if k.startswith("pool-"))
    ent = {v["adapter"]: v["seconds"] for k, v in files.items() if k.startswith("entropy-")}
    rec = {
        "command": f"python -m experiments.hybrid_serve_startup --json {a.json} --cache {a.cache} --threads {a.threads}"
        + (f" --pool-n {a.pool_n}" if a.pool_n is not None else ""),
        "date": time.strftime("%Y-%m-%d"),
        "machine": machine_info(),
        "loadavg_before": [round(x, 2) for x in load_before],
        "loadavg_after": [round(x, 2) for x in os.getloadavg()],
        "router": router,
        "build_none_s": none_s,
        "build_hybrid_cold_s": cold_s,
        "build_hybrid_warm_s": warm_s,
        "pool_prompts": len(pool["prompts"]),
        "pool_s": pool["seconds"],
        "entropy_s": ent,
        "calibration_cold_s": round(cold_s - none_s, 1),
        "calibration_warm_s": round(warm_s - none_s, 1),
    }
    Path(a.json).parent.mkdir(parents=True, exist_ok=True)
    Path(a.json).write_text(json.dumps(rec, indent=1) + "\n")
    print(json.dumps({k: v for k, v in rec.items() if k not in ("machine", "router")}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
