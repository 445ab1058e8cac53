"""Measure Ray placement by adapter set (`--ray-placement adapters`) against Ray's own choice by bundle
(`--ray-placement bundle`) and keep the balance in docs/ray_placement.json.

    .venv/bin/python -m experiments.ray_placement [--calls 160] [--adapters 24] [--repeats 1]
    .venv/bin/python -m experiments.ray_placement --render-only     # docs/scaleout.md's block from the record

Setup: one bundle on the default base with N random rank-8 adapters (each a copy of the shapes of the embedded
`counting` adapter, its own seeded weights): 4 in its manifest (a bundle holds at most as many as it has slots),
the other N-4 loaded at run time through the ingress's registry (POST /v1/adapters does the same), so every
engine knows all N and holds 4 in slots, the rest in its CPU tier; two engine replicas (one torch thread each) on
a local Ray. Traffic (`molora.bench.hotset_traffic.make_traffic`): Zipf (s = 1.1) over the N, every call pinned
to its adapter (the bundle has no router: an unpinned call would run the base model and need no adapter);
16-token prompts, 2 greedy new tokens, 4 calls in flight (closed loop), through the ingress's `RayClient`.
Before the measured calls, 8 concurrent calls make both replicas hold the bundle.
Per variant (order rotated every repetition): calls per replica, and the share of calls whose needed adapters
were all in a slot of the replica when they arrived (the replica checks it on its engine thread). Writes the
record, renders the block between PLACE_BEGIN and PLACE_END in docs/scaleout.md, ends with the record as one
JSON line.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

import torch

from molora.docblock import markers, wrap, write_block

ROOT = Path(__file__).resolve().parent.parent
RECORD = ROOT / "docs" / "ray_placement.json"
PAGE = ROOT / "docs" / "scaleout.md"
PLACE_BEGIN, PLACE_END = markers("ray-placement", "experiments/ray_placement.py")
VARIANTS = ("adapters", "bundle")
VOCAB = 49152  # SmolLM2's
SLOTS = 4


def make_bundle(folder: Path, n: int, seed: int) -> list[str]:
    """n random adapters shaped like the default bundle's `counting`, the first SLOTS of them in a bundle."""
    from safetensors.torch import load_file, save_file

    from molora.bundle import default_bundle_dir, write_manifest

    src = default_bundle_dir() / "adapters" / "counting"
    shapes = load_file(str(src / "adapter_model.safetensors"))
    g = torch.Generator().manual_seed(seed)
    names = [f"a{i}" for i in range(n)]
    for name in names:
        out = folder / "adapters" / name
        out.mkdir(parents=True)
        shutil.copy(src / "adapter_config.json", out / "adapter_config.json")
        tensors = {k: (torch.randn(v.shape, generator=g) * 0.02).to(v.dtype) for k, v in shapes.items()}
        save_file(tensors, str(out / "adapter_model.safetensors"))
    write_manifest(
        folder,
        {
            "format": "molora-bundle/1",
            "name": "placement",
            "base": "default",
            "adapters": [{"name": a, "path": f"adapters/{a}"} for a in names[:SLOTS]],
            "router": {"kind": "none"},
            "slots": SLOTS,
        },
    )
    return names


async def drive(client, traffic: list[dict], concurrency: int, new_tokens: int) -> None:
    from molora.config import SamplingParams
    from molora.server.runner import RequestSpec

    todo = list(enumerate(traffic))

    async def worker() -> None:
        while todo:
            i, t = todo.pop(0)
            spec = RequestSpec(
                0,
                t["prompt"],
                SamplingParams(max_new_tokens=new_tokens, temperature=0.0),
                t.get("adapter"),
                t.get("allowed"),
            )
            sub = await client.submit([spec], f"c{i}", "placement")
            try:
                while sub.unfinished:
                    item = await sub.queue.get()
                    if not isinstance(item, tuple):
                        raise RuntimeError(f"call {i} failed: {item}")
                    if item[1].finished:
                        sub.finished(item[1].request_id)
            finally:
                sub.close()

    await asyncio.gather(*(worker() for _ in range(concurrency)))


def run_variant(placement: str, bundle: Path, names: list[str], traffic: list[dict], warm: list[dict], args) -> dict:
    from ray import serve

    from molora.server import ray_serve as rs
    from molora.server.ray_client import RayClient
    from molora.server.ray_state import Registry

    cfg = rs.RayConfig(
        bundles=(str(bundle),),
        replicas=2,
        max_queue=4,
        ray_queue=64,  # the warm-up's burst waits for a replica instead of a 429
        threads_per_replica=1,
        cpus_per_replica=0.5,
        engine_config={"max_model_len": 256, "kv_budget_tokens": 4096, "max_num_seqs": 8},
        placement=placement,
    )
    specs = rs.bundle_specs(cfg.bundles)
    handle = serve.run(rs.engine_deployment(cfg, specs), name=f"placement-{placement}", route_prefix=None)
    try:

        async def go() -> tuple[dict, float]:
            client = RayClient(handle, Registry(specs), max_in_flight=64, call_timeout_s=600)  # the first builds
            for name in names[SLOTS:]:
                await client.load_adapter("placement", name, bundle / "adapters" / name, [bundle])
            await drive(client, warm, 8, 1)  # both replicas take the bundle (the holder fills, the rest spills)
            held = sorted(client.placements)
            client.placements.clear()
            t0 = time.perf_counter()
            await drive(client, traffic, args.concurrency, args.new_tokens)
            return {"replicas_after_warmup": len(held), "placements": dict(client.placements)}, time.perf_counter() - t0

        out, wall = asyncio.run(go())
    finally:
        serve.delete(f"placement-{placement}")
    per = sorted(out["placements"].values(), key=lambda x: -x[0])
    calls = sum(c for c, _ in per)
    return {
        "placement": placement,
        "replicas_holding_bundle": out["replicas_after_warmup"],
        "calls": calls,
        "calls_per_replica": [c for c, _ in per],
        "all_resident": sum(h for _, h in per),
        "all_resident_share": round(sum(h for _, h in per) / calls, 3),
        "wall_s": round(wall, 1),
    }


def render(record: dict) -> str:
    """The docs/scaleout.md block: one row per run."""
    st = record["setup"]
    lines = [
        f"{st['replicas']} replicas, {st['slots']} slots each, {st['adapters']} adapters, {st['calls']} calls pinned "
        f"Zipf (s = {st['zipf_s']}), {st['concurrency']} in flight, {st['new_tokens']} new tokens, base "
        f"{st['base']}, {st['cores']} cores ({record['date']}):",
        "",
        "| `--ray-placement` | calls per replica | calls whose adapter was in a slot on arrival | wall s |",
        "|---|---|---|---|",
    ]
    for r in record["runs"]:
        per = " / ".join(str(c) for c in r["calls_per_replica"])
        share = f"{r['all_resident']}/{r['calls']} ({100 * r['all_resident_share']:.0f}%)"
        lines.append(f"| {r['placement']} | {per} | {share} | {r['wall_s']} |")
    lines += ["", f"Command: `{record['command']}` (record: docs/ray_placement.json)."]
    return wrap(PLACE_BEGIN, PLACE_END, "\n".join(lines))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--calls", type=int, default=160)
    ap.add_argument("--adapters", type=int, default=24)
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--new-tokens", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=RECORD)
    ap.add_argument("--render-only", action="store_true", help="render docs/scaleout.md from the record")
    args = ap.parse_args()
    if args.render_only:
        write_block(PAGE, PLACE_BEGIN, PLACE_END, render(json.loads(args.out.read_text())))
        return

    import ray
    from ray import serve

    from molora.bench.hotset_traffic import make_traffic

    os.environ["RAY_USAGE_STATS_ENABLED"] = "0"
    with tempfile.TemporaryDirectory() as tmp:
        names = make_bundle(Path(tmp) / "bundle", args.adapters, args.seed)
        traffic = make_traffic(names, args.calls, 1.1, 0.0, VOCAB, 16, args.seed)
        warm = [{"adapter": names[0], "prompt": [5] * 16}] * 8
        ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, _temp_dir=str(Path(tmp) / "ray"))
        runs = []
        try:
            serve.start(proxy_location="Disabled")
            for r in range(args.repeats):
                order = VARIANTS[r % 2 :] + VARIANTS[: r % 2]
                for v in order:
                    runs.append(run_variant(v, Path(tmp) / "bundle", names, traffic, warm, args))
                    print(json.dumps(runs[-1]), file=sys.stderr, flush=True)
        finally:
            serve.shutdown()
            ray.shutdown()
    record = {
        "what": "Ray placement by adapter set vs by bundle: calls per replica and the share of calls whose "
        "adapters were all in a slot when they arrived",
        "command": "python -m experiments.ray_placement " + " ".join(sys.argv[1:]),
        "date": dt.date.today().isoformat(),
        "setup": {
            "replicas": 2,
            "slots": SLOTS,
            "adapters": args.adapters,
            "calls": args.calls,
            "zipf_s": 1.1,
            "pinned_share": 1.0,
            "concurrency": args.concurrency,
            "new_tokens": args.new_tokens,
            "base": "default (SmolLM2-135M-Instruct)",
            "cores": os.cpu_count(),
        },
        "runs": runs,
    }
    args.out.write_text(json.dumps(record, indent=2) + "\n")
    if args.out == RECORD:
        write_block(PAGE, PLACE_BEGIN, PLACE_END, render(record))
    print(json.dumps(record))


if __name__ == "__main__":
    main()
