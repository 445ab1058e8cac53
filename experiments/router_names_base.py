"""How many real general prompts each named router keeps on the base model, as `molora route --router NAME` runs it.

Writes docs/router_names_base.json:

    .venv/bin/python -m experiments.router_names_base --json docs/router_names_base.json

The prompts: the held-out test split of molora.data.general (`general_split()["test"]`), its Self-Instruct items
only (35 human-written everyday tasks; the named routers' settings were chosen on the validation split). Each prompt
runs on the embedded default bundle through the same code path as `molora route --router NAME` (`prompt_routing`,
then `run_prompt` with trace, greedy, route's default budget of 64 new tokens). A prompt is *kept on the base model*
when every token of prompt and answer ran on the base weights (no adapter); `answer_kept` counts the answer tokens
only. The hybrid chooser's calibration is read from $MOLORA_CACHE/hybrid or computed first (minutes, then cached).
"""

from __future__ import annotations

import argparse
import json
import platform
import subprocess
import time
from pathlib import Path


def cpu_name() -> str:
    """lscpu's "Model name"."""
    out = subprocess.run(["lscpu"], capture_output=True, text=True, check=False).stdout
    for line in out.splitlines():
        if line.startswith("Model name:"):
            return line.split(":", 1)[1].strip()
    return platform.processor() or "unknown"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", default="docs/router_names_base.json", help="record to write")
    ap.add_argument("--routers", default="arrow,hybrid,arrow-token", help="router names, comma-separated")
    ap.add_argument("--max-tokens", type=int, default=64, help="new tokens per answer (route's default)")
    ap.add_argument("--limit", type=int, default=None, help="first N prompts only (a quick look)")
    args = ap.parse_args(argv)

    import torch

    from molora.bundle import load, run_prompt
    from molora.cli.generate import prompt_routing
    from molora.data.general import general_split

    torch.manual_seed(0)
    items = [it for it in general_split()["test"] if it["source"] == "self_instruct"][: args.limit]
    mm = load(None)
    record: dict = {
        "command": "python -m experiments.router_names_base --json " + args.json,
        "date": time.strftime("%Y-%m-%d"),
        "machine": {"cpu": cpu_name(), "threads": torch.get_num_threads(), "torch": torch.__version__},
        "bundle": mm.bundle.name,
        "split": "molora.data.general general_split()['test'], source self_instruct (held out)",
        "n_prompts": len(items),
        "max_new_tokens": args.max_tokens,
        "kept": "every prompt and answer token ran on the base model (no adapter)",
        "routers": {},
    }
    for name in args.routers.split(","):
        t0 = time.perf_counter()
        rows = []
        routing_of = prompt_routing(mm, name)  # built once, as one `molora route` run builds it
        t_built = time.perf_counter() - t0
        for it in items:
            routing = routing_of(it["prompt"])
            r = run_prompt(mm, it["prompt"], **routing, max_new_tokens=args.max_tokens, trace=True)
            n_prompt = len(r.prompt_ids)
            on = [a for a in r.adapters if a is not None]
            rows.append(
                {
                    "id": it["id"],
                    "kept": not on,
                    "answer_kept": all(a is None for a in r.adapters[n_prompt:]),
                    "adapter_tokens": len(on),
                    "adapters": sorted(set(on)),
                }
            )
        n = len(rows)
        record["routers"][name] = {
            "kept_pct": round(100.0 * sum(r["kept"] for r in rows) / n, 2),
            "answer_kept_pct": round(100.0 * sum(r["answer_kept"] for r in rows) / n, 2),
            "build_seconds": round(t_built, 1),
            "seconds": round(time.perf_counter() - t0, 1),
            "per_prompt": rows,
        }
        print(name, {k: v for k, v in record["routers"][name].items() if k != "per_prompt"}, flush=True)
    Path(args.json).write_text(json.dumps(record, indent=1) + "\n")
    print(json.dumps({k: {"kept_pct": v["kept_pct"]} for k, v in record["routers"].items()}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
