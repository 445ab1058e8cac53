"""What the probe pass costs (molora.routing.learned: Probe), timed side by side with learned routing without it.

    .venv/bin/python -m experiments.probe_cost --data DIR [--bundle DIR] [--limit 32] [--repeats 2] [--threads 2]

For each skill file DIR/<task>.json (BBH format, e.g. make_results.py's held-out data) and each repetition,
evaluates the first --limit items under learned routing with the probe, learned routing without it (the same
router, `probe_prompt` off) and the task's own adapter, in turn (interleaved, so load on the machine falls on
all three alike). Prints one JSON line (and writes it to --out): per variant the summed seconds, answer tokens, tokens/s
and accuracy.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time
from pathlib import Path

import torch

from molora.bundle import load
from molora.eval.runner import evaluate


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--data", required=True, help="folder of BBH task files named <task>.json")
    p.add_argument("--bundle", default=None, help="bundle folder (default: the embedded default bundle)")
    p.add_argument("--limit", type=int, default=32)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--out", default=None, help="also write the JSON record here (e.g. docs/probe_cost.json)")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    mm = load(args.bundle)
    router = mm.router
    if not getattr(router, "probe_prompt", False):
        raise SystemExit("the bundle's router has no probe_prompt: nothing to compare")
    with_probe, without = router.config, dataclasses.replace(router.config, probe_prompt=False, prompt_share=0.0)
    totals = {v: {"seconds": 0.0, "tokens": 0, "correct": 0.0, "n": 0} for v in ("probe", "no_probe", "own")}
    for task_file in sorted(Path(args.data).glob("*.json")):
        spec = f"bbh:{task_file}"
        own = mm.bundle.adapter_for_task(task_file.stem)
        for _ in range(args.repeats):
            for variant, mode, cfg in (
                ("probe", "learned", with_probe),
                ("no_probe", "learned", without),
                ("own", f"adapter:{own}", with_probe),
            ):
                router.config = cfg
                t0 = time.perf_counter()
                s, _ = evaluate(mm, spec, mode, limit=args.limit, progress=False)
                t = totals[variant]
                t["seconds"] += time.perf_counter() - t0
                t["tokens"] += s["generated_tokens"]
                t["correct"] += s["accuracy"] * s["n"] / 100
                t["n"] += s["n"]
    router.config = with_probe
    out = {
        v: {
            "seconds": round(t["seconds"], 2),
            "answer_tokens": t["tokens"],
            "tokens_per_s": round(t["tokens"] / t["seconds"], 2),
            "accuracy": round(100 * t["correct"] / t["n"], 2),
        }
        for v, t in totals.items()
    }
    out["probe_time_over_no_probe"] = round(totals["probe"]["seconds"] / totals["no_probe"]["seconds"], 3)
    out["probe_time_over_own"] = round(totals["probe"]["seconds"] / totals["own"]["seconds"], 3)
    out["command"] = "python -m experiments.probe_cost " + " ".join(
        f"--{k.replace('_', '-')} {v}" for k, v in vars(args).items() if v is not None
    )
    out["limit"], out["date"] = args.limit, time.strftime("%Y-%m-%d")
    print(json.dumps(out))
    if args.out:
        Path(args.out).write_text(json.dumps(out, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
