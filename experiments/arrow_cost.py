"""What data-free routing costs end to end: `--router arrow` (prompt-level Arrow with the settings chosen on
validation, experiments/arrow_variants_choose.py) against the request's own adapter alone, on the same requests,
interleaved.

    .venv/bin/python -m experiments.arrow_cost --choice docs/arrow_variants_choice.json --json docs/arrow_cost.json \
        [--limit 8] [--repeats 3] [--threads 1]

For each skill, the first --limit validation items (`molora.eval.heldout` split "val") are answered by
`molora.eval.runner.evaluate` (batched greedy generation, probe pass included) once under the Arrow router and once
under the skill's own adapter, the order rotated every pair (style.md 18), after one untimed item under each.
Per (skill, repetition) pair the ratio of seconds and the ratio of seconds per answer token; the record keeps the
medians, every pair, the load average before and after, and the machine. The answers differ in length where
routing differs, so the per-token ratio is the cost of the routing itself and the seconds ratio what a user waits.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

from experiments.arrow_variants_choose import served_config  # (the choice record -> ArrowConfig fields)


def main(argv: list[str] | None = None) -> int:
    from molora.bench.common import machine_info
    from molora.bundle import load
    from molora.data.skills import write_bbh_file
    from molora.eval.heldout import held_out, training_inputs
    from molora.eval.runner import evaluate
    from molora.routing.arrow import ArrowConfig, ArrowRouter

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--choice", required=True, help="the record of experiments/arrow_variants_choose.py")
    ap.add_argument("--json", required=True)
    ap.add_argument("--limit", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--work", default="runs/arrow_cost")
    ap.add_argument(
        "--gates",
        default=None,
        help="measure the per-adapter gates of this GateRouter folder (molora.routing.gates) instead of Arrow",
    )
    ap.add_argument(
        "--hybrid",
        default=None,
        help="measure the hybrid data-free chooser of this folder (molora.routing.hybrid, one adapter per request, "
        "the evaluation's sequence mode) instead of Arrow",
    )
    a = ap.parse_args(argv)
    if a.gates and a.hybrid:
        ap.error("give at most one of --gates and --hybrid")
    torch.set_num_threads(a.threads)
    load_before = os.getloadavg()
    mm = load(None)
    learned = mm.router
    router: Any
    if a.gates:  # the "arrow" variant of the pairs is then the gates (the record's "router" says which)
        from molora.routing.gates import GateRouter

        router = GateRouter.load(a.gates).bind(mm)
        fields = {**router.config.__dict__, "gates": a.gates}
    elif a.hybrid:  # likewise the hybrid chooser, answered in the sequence mode (its choice, then one adapter)
        from molora.routing.hybrid import HybridChooser

        router = HybridChooser.load(a.hybrid).bind(mm)
        fields = {
            "arrow": dict(router.arrow.__dict__),
            "z_or": router.z_or,
            "z_floor": router.z_floor,
            "hybrid": a.hybrid,
        }
    else:
        fields = served_config(json.loads(Path(a.choice).read_text()))
        router = ArrowRouter(ArrowConfig(**fields), mm.adapter_names).bind(mm)
    banned = training_inputs(mm.bundle)
    tasks = [ad.tasks[0] for ad in mm.bundle.adapters if ad.tasks]
    work = Path(a.work)
    work.mkdir(parents=True, exist_ok=True)

    def use(r: Any) -> None:  # mm.router is a registered submodule while it holds the learned router
        mm._modules.pop("router", None)
        mm.__dict__.pop("router", None)
        mm.router = r

    pairs = []
    warm = work / "warmup.json"  # one untimed item under each variant first: the first forwards of a process pay
    write_bbh_file(warm, held_out(tasks[0], 1, banned, split="val")[0])  # for allocations and thread pools
    routed = "sequence" if a.hybrid else "learned"  # the evaluation mode of the routed side
    for r, mode in ((router, routed), (learned, f"adapter:{mm.bundle.adapter_for_task(tasks[0])}")):
        use(r)
        evaluate(mm, f"bbh:{warm}", mode, batch_size=1, progress=False)
    use(learned)
    for t in tasks:
        items, _ = held_out(t, a.limit, banned, split="val")
        path = work / f"val_{t}.json"
        write_bbh_file(path, items[: a.limit])
        own = mm.bundle.adapter_for_task(t)
        variants = [("arrow", routed), ("own", f"adapter:{own}")]
        for rep in range(a.repeats):
            got = {}
            flip = len(pairs) % 2  # rotate the order every pair (repetitions and skills alike)
            for name, mode in variants[flip:] + variants[:flip]:
                use(router if name == "arrow" else learned)
                t0 = time.perf_counter()
                s, _ = evaluate(mm, f"bbh:{path}", mode, batch_size=a.limit, progress=False)
                got[name] = {"seconds": time.perf_counter() - t0, "tokens": s["generated_tokens"]}
            use(learned)
            a_, o = got["arrow"], got["own"]
            pairs.append(
                {
                    "task": t,
                    "repeat": rep,
                    "first": variants[flip][0],
                    "arrow_s": round(a_["seconds"], 3),
                    "own_s": round(o["seconds"], 3),
                    "arrow_tokens": a_["tokens"],
                    "own_tokens": o["tokens"],
                    "time_ratio": round(a_["seconds"] / o["seconds"], 3),
                    "per_token_ratio": round((a_["seconds"] / a_["tokens"]) / (o["seconds"] / o["tokens"]), 3),
                }
            )
            print(json.dumps(pairs[-1]), file=sys.stderr)
    rec = {
        "command": f"python -m experiments.arrow_cost --choice {a.choice} --json {a.json} --limit {a.limit} "
        f"--repeats {a.repeats} --threads {a.threads}"
        + (f" --gates {a.gates}" if a.gates else "")
        + (f" --hybrid {a.hybrid}" if a.hybrid else ""),
        "router": "gates" if a.gates else "hybrid" if a.hybrid else "arrow",
        "date": time.strftime("%Y-%m-%d"),
        "machine": machine_info(),
        "loadavg_before": [round(x, 2) for x in load_before],
        "loadavg_after": [round(x, 2) for x in os.getloadavg()],
        "config": fields,
        "limit": a.limit,
        "repeats": a.repeats,
        "pairs": pairs,
        "median_time_ratio": round(statistics.median(p["time_ratio"] for p in pairs), 3),
        "median_per_token_ratio": round(statistics.median(p["per_token_ratio"] for p in pairs), 3),
    }
    Path(a.json).write_text(json.dumps(rec, indent=1) + "\n")
    print(json.dumps({k: rec[k] for k in ("median_time_ratio", "median_per_token_ratio", "loadavg_after")}))
    return 0


def render_section(rec: dict) -> list[str]:
    """docs/results.md's cost section of data-free routing (markdown lines) from docs/arrow_cost.json, or of the
    per-adapter gates from docs/gates_cost.json (the pairs' "arrow" side is then the gates)."""
    ok = rec["median_time_ratio"] <= 1.25
    kind = rec.get("router", "arrow")
    who = {"gates": "the per-adapter gates", "hybrid": "the hybrid data-free chooser (its choice included)"}.get(
        kind, "prompt-level Arrow"
    )
    col = kind
    title = "the hybrid data-free chooser costs offline" if kind == "hybrid" else f"`--router {kind}` costs"
    out = [
        f"## What {title}",
        "",
        f"`{rec['command']}` on {rec['date']} ({rec['machine']['cpu']}, {rec['machine']['cores']} cores shared, "
        f"load average {rec['loadavg_before'][0]} before and {rec['loadavg_after'][0]} after): the first "
        f"{rec['limit']} validation items of each skill answered end to end (probe pass included) under {who} "
        f"and under the skill's own adapter alone, interleaved with the order rotated, {rec['repeats']} "
        f"repetitions"
        + (" (the evaluation's batched offline generation; served: the next section)" if kind == "hybrid" else "")
        + f". Median time ratio **{rec['median_time_ratio']:.2f}x** (goal <= 1.25x: "
        f"{'met' if ok else 'not met'}); median ratio of seconds per answer token "
        f"{rec['median_per_token_ratio']:.2f}x (answers differ in length where routing differs). Per skill, the "
        "median time ratio of its pairs: "
        + ", ".join(
            f"{t} {statistics.median(p['time_ratio'] for p in rec['pairs'] if p['task'] == t):.2f}x"
            for t in dict.fromkeys(p["task"] for p in rec["pairs"])
        )
        + ".",
        "",
        f"| skill | repetition | first | {col} s | own s | {col} tokens | own tokens | time ratio | per-token ratio |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    out += [
        f"| {p['task']} | {p['repeat']} | {col if p['first'] == 'arrow' else p['first']} | {p['arrow_s']:.1f} "
        f"| {p['own_s']:.1f} | {p['arrow_tokens']} "
        f"| {p['own_tokens']} | {p['time_ratio']:.2f} | {p['per_token_ratio']:.2f} |"
        for p in rec["pairs"]
    ]
    return out + [""]


if __name__ == "__main__":
    raise SystemExit(main())
