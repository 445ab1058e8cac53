"""Which part of the fair policy costs throughput on the tenants bench: fair with one of its rules turned off, beside
fcfs and priority, on the scenario of `molora bench serve --tenants` (molora.bench.tenants), interleaved.

    python -m experiments.tenants_variants --json docs/tenants_variants.json [--repeats 2] [--period 3]
        [--variants fcfs,priority,fair,fair:seat0,fair:noseat,fair:noheld] [--server-args "..."] [--trace]

Variants: a scheduling policy, and for fair optionally `:noseat` (FairPolicy.seat_victim answers None: a tenant with
no seat waits for one to free instead of preempting the most-served tenant's latest request) or `:noheld`
(FairPolicy.held_back answers None: no step share, every prompt takes the budget in the fair order) or `:seat0` (the
seat rule only for a tenant with no request running, as it was before it counted seats) or `:drainN` (longest left
first: each tenant's waiting requests ordered by the tokens they have left to generate, most first, and when every
seat is taken, the next waiting request takes the seat of its own tenant's running request with the fewest tokens
left, if that one has at least N left (default 8) and the waiting one at least N more; "left" is max_tokens minus
tokens generated, which is the true remaining work only where the length is known in advance, as under the bench's
`ignore_eos`: a makespan rule for a finite flood, measured here, not the product's). Each run starts its own
`molora serve` child (molora.bench.tenants.measure_policy; the variant patched in before the CLI runs), then runs the
bench's two scenarios (steady tenants alone, then with the flood) with the bench's own defaults of the recorded
command; the order of the variants rotates per repetition. Writes one row per run (molora.bench.tenants.summarize,
plus the variant) and the medians per variant (molora.bench.tenants.medians), with the machine. Measures only; the
product never imports this file.

`--trace`: the server child also writes one line per engine step (its start and end, the running requests' tenants
and tokens left, the waiting requests' tenants, decode and prompt tokens computed), and each run's row gains
`trace_summary` of its flood run, split where the last steady request leaves the scheduler: before it ("contended":
every tenant has work) and after it ("tail": only the flood's last requests), each with its steps, seconds, output
tokens and seats in use per step, and how many flood requests (and tokens) were left when the tail began. Written
with it: docs/tenants_trace.json (`--trace --variants fcfs,fair --json docs/tenants_trace.json`).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from molora.bench import tenants
from molora.bench.common import emit, machine_info, rotated

KEYS = ("steady_ttft_p50_ratio", "steady_ttft_p99_ratio", "output_tok_s", "makespan_s", "engine_steps", "preemptions")


def record_steps(path: str) -> None:
    """Make every engine step append one JSON line to `path` (module docstring, `--trace`)."""
    from molora.engine import engine, scheduler

    schedule, step = scheduler.Scheduler.schedule, engine.Engine.step
    out = open(path, "a", encoding="utf-8")  # noqa: SIM115 (open for the life of the server)

    def traced_schedule(self):  # type: ignore[no-untyped-def]
        self.traced = schedule(self)
        self.traced_state = (
            [[r.tenant, r.seq, r.params.max_new_tokens - r.num_generated] for r in self.running],
            [r.tenant for r in self.waiting],
        )
        return self.traced

    def traced_step(self):  # type: ignore[no-untyped-def]
        self.scheduler.traced = []
        t0 = time.monotonic()
        outputs = step(self)
        if self.scheduler.traced:
            running, waiting = self.scheduler.traced_state
            line = {
                "t0": t0,
                "t1": time.monotonic(),
                "running": running,
                "waiting": waiting,
                "decode": sum(s.n for s in self.scheduler.traced if s.decode),
                "prompt": sum(s.n for s in self.scheduler.traced if not s.decode),
            }
            out.write(json.dumps(line) + "\n")
            out.flush()
        return outputs

    scheduler.Scheduler.schedule = traced_schedule  # type: ignore[method-assign]
    engine.Engine.step = traced_step  # type: ignore[method-assign]


def trace_summary(path: Path) -> dict[str, Any]:
    """The flood run's steps from a `record_steps` file, split where the last steady request left (module
    docstring). The flood run's steps are those from the first step with a flood request in flight."""
    lines = [json.loads(x) for x in path.read_text(encoding="utf-8").splitlines()]
    in_flight = lambda st: [r[0] for r in st["running"]] + st["waiting"]  # noqa: E731
    first = next(i for i, st in enumerate(lines) if tenants.FLOOD in in_flight(st))
    steps = lines[first:]
    last = max(i for i, st in enumerate(steps) if any(t != tenants.FLOOD for t in in_flight(st)))

    def part(sts: list[dict]) -> dict[str, Any]:
        return {
            "steps": len(sts),
            "seconds": round(sum(st["t1"] - st["t0"] for st in sts), 2),
            "output_tokens": sum(st["decode"] for st in sts),
            "prompt_tokens": sum(st["prompt"] for st in sts),
            "seats_per_step": round(sum(len(st["running"]) for st in sts) / len(sts), 2) if sts else 0.0,
        }

    tail = steps[last + 1 :]
    left = [r for r in tail[0]["running"] if r[0] == tenants.FLOOD] if tail else []
    return {
        "contended": part(steps[: last + 1]),
        "tail": part(tail),
        "flood_left_at_tail": len(left) + (tail[0]["waiting"].count(tenants.FLOOD) if tail else 0),
        "flood_running_tokens_left_at_tail": sorted(r[2] for r in left),
    }


def child(variant: str, argv: list[str], trace: str = "") -> int:
    """`molora serve argv` with the fair policy's rule named by `variant` turned off (module docstring), every step
    written to `trace` if given."""
    from molora.cli import main
    from molora.engine import policy

    if trace:
        record_steps(trace)

    if variant == "noseat":
        policy.FairPolicy.seat_victim = lambda self, running, head: None  # type: ignore[method-assign]
    elif variant == "noheld":
        policy.FairPolicy.held_back = lambda self, prompting: None  # type: ignore[method-assign]
    elif variant == "seat0":  # the seat rule before it counted seats: only for a tenant with none running
        rule = policy.FairPolicy.seat_victim

        def seat0(self, running, head):  # type: ignore[no-untyped-def]
            return None if any(r.tenant == head.tenant for r in running) else rule(self, running, head)

        policy.FairPolicy.seat_victim = seat0  # type: ignore[method-assign]
    elif variant.startswith("drain"):  # longest left first (module docstring)
        from molora.engine import scheduler

        margin = int(variant.removeprefix("drain") or 8)
        left = lambda r: r.params.max_new_tokens - r.num_generated  # noqa: E731
        order = policy.FairPolicy.order

        def lpt_order(self, waiting):  # type: ignore[no-untyped-def]
            return order(self, sorted(waiting, key=lambda r: (-left(r), r.seq)))

        take = scheduler.Scheduler._take_seat

        def drain_take(self):  # type: ignore[no-untyped-def]
            take(self)
            if len(self.running) < self.max_num_seqs or not self.waiting:
                return
            head = self.waiting[0]
            mine = [r for r in self.running if r.tenant == head.tenant and left(r) >= margin]
            if mine:
                v = min(mine, key=lambda r: (left(r), -r.seq))
                if left(head) >= left(v) + margin:
                    self.preempt(v)
                    self.num_seat_preemptions += 1

        policy.FairPolicy.order = lpt_order  # type: ignore[method-assign]
        scheduler.Scheduler._take_seat = drain_take  # type: ignore[method-assign]
    elif variant:
        raise SystemExit(f"unknown fair variant {variant!r}: noseat, noheld, seat0 or drainN")
    return main(argv)


def one_run(variant: str, args: argparse.Namespace, bench: argparse.Namespace) -> dict:
    policy, _, rule = variant.partition(":")
    with tempfile.TemporaryDirectory() as tmp:
        trace = Path(tmp) / "steps.jsonl" if args.trace else None
        launcher = [sys.executable, "-m", "experiments.tenants_variants", "--child", rule, str(trace or ""), "--"]
        row = tenants.measure_policy(bench, policy, args.server_args.split(), launcher)
        if trace is not None:
            row["trace_summary"] = trace_summary(trace)
    return row


def main() -> int:
    if "--child" in sys.argv:  # the server side of one run
        i = sys.argv.index("--child")
        return child(sys.argv[i + 1], sys.argv[sys.argv.index("--") + 1 :], sys.argv[i + 2])
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--variants", default="fcfs,priority,fair,fair:seat0,fair:noseat,fair:noheld")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--period", type=float, default=3.0, help="seconds between one steady tenant's requests")
    ap.add_argument("--server-args", default="", help="more `molora serve` flags for every variant")
    ap.add_argument("--trace", action="store_true", help="record every engine step; summarize each flood run")
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
            shown = ("variant", "repeat", *KEYS, "trace_summary")
            print(json.dumps({k: row[k] for k in shown if k in row}), flush=True)
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
    emit(out, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
