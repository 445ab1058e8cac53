"""Which part of the fair policy costs throughput on the tenants bench: fair with one of its rules turned off, beside
fcfs and priority, on the scenario of `molora bench serve --tenants` (molora.bench.tenants), interleaved.

    python -m experiments.tenants_variants --json docs/tenants_variants.json [--repeats 2] [--period 3]
        [--variants fcfs,priority,fair,fair:seat0,fair:noseat,fair:noheld] [--server-args "..."]

Variants: a scheduling policy, and for fair optionally `:noseat` (FairPolicy.seat_victim answers None: a tenant with
no seat waits for one to free instead of preempting the most-served tenant's latest request) or `:noheld`
(FairPolicy.held_back answers None: no step share, every prompt takes the budget in the fair order) or `:seat0` (the
seat rule only for a tenant with no request running, as it was before it counted seats). Each run starts its own
`molora serve` child (molora.bench.tenants.measure_policy; the variant patched in before the CLI runs), then runs the
bench's two scenarios (steady tenants alone, then with the flood) with the bench's own defaults of the recorded
command; the order of the variants rotates per repetition. Writes one row per run (molora.bench.tenants.summarize,
plus the variant) and the medians per variant (molora.bench.tenants.medians), with the machine. Measures only; the
product never imports this file.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from molora.bench import tenants
from molora.bench.common import machine_info, rotated

KEYS = ("steady_ttft_p50_ratio", "steady_ttft_p99_ratio", "output_tok_s", "makespan_s", "engine_steps", "preemptions")


def child(variant: str, argv: list[str]) -> int:
    """`molora serve argv` with the fair policy's rule named by `variant` turned off (module docstring)."""
    from molora.cli import main
    from molora.engine import policy

    if variant == "noseat":
        policy.FairPolicy.seat_victim = lambda self, running, head: None  # type: ignore[method-assign]
    elif variant == "noheld":
        policy.FairPolicy.held_back = lambda self, prompting: None  # type: ignore[method-assign]
    elif variant == "seat0":  # the seat rule before it counted seats: only for a tenant with none running
        rule = policy.FairPolicy.seat_victim

        def seat0(self, running, head):  # type: ignore[no-untyped-def]
            return None if any(r.tenant == head.tenant for r in running) else rule(self, running, head)

        policy.FairPolicy.seat_victim = seat0  # type: ignore[method-assign]
    elif variant:
        raise SystemExit(f"unknown fair variant {variant!r}: noseat, noheld or seat0")
    return main(argv)


def one_run(variant: str, args: argparse.Namespace, bench: argparse.Namespace) -> dict:
    policy, _, rule = variant.partition(":")
    launcher = [sys.executable, "-m", "experiments.tenants_variants", "--child", rule, "--"]
    return tenants.measure_policy(bench, policy, args.server_args.split(), launcher)


def main() -> int:
    if "--child" in sys.argv:  # the server side of one run
        i = sys.argv.index("--child")
        return child(sys.argv[i + 1], sys.argv[sys.argv.index("--") + 1 :])
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--variants", default="fcfs,priority,fair,fair:seat0,fair:noseat,fair:noheld")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--period", type=float, default=3.0, help="seconds between one steady tenant's requests")
    ap.add_argument("--server-args", default="", help="more `molora serve` flags for every variant")
    ap.add_argument("--json", metavar="OUT")
    args = ap.parse_args()
    # the scenario of the recorded tenants bench (docs/tenants_bench.json's command)
    bench = argparse.Namespace(
        bundle=None,
        tenants=4,
        per_tenant=4,
        period=args.period,
        steady_tokens=16,
        flood=12,
        flood_tokens=32,
        seed=0,
        max_num_seqs=8,
    )
    variants = [v for v in args.variants.split(",") if v]
    runs: dict[str, list[dict]] = {v: [] for v in variants}
    load_before = os.getloadavg()
    for rep in range(args.repeats):
        for v in rotated(variants, rep):
            row = one_run(v, args, bench)
            row.update(variant=v, repeat=rep)
            runs[v].append(row)
            print(json.dumps({k: row[k] for k in ("variant", "repeat", *KEYS)}), flush=True)
    median = tenants.medians(runs)
    out = {
        "experiment": "tenants_variants",
        "command": "python -m experiments.tenants_variants " + " ".join(sys.argv[1:]),
        "scenario": vars(bench),
        "server_args": args.server_args,
        "machine": {**machine_info(), "loadavg_before": [round(x, 2) for x in load_before]},
        "runs": runs,
        "median": median,
    }
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(out, fh, indent=2)
    print(json.dumps(median))
    return 0


if __name__ == "__main__":
    sys.exit(main())
