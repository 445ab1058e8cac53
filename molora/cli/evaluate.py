"""`molora eval | bench`: task scores and performance benchmarks."""

from __future__ import annotations

import argparse
import json

from molora.cli.registry import command

# --------------------------------------------------------------------------------------------- eval


def _eval_args(p: argparse.ArgumentParser) -> None:
    from molora.routing.names import names_help

    p.add_argument("--bundle", default=None, help="bundle folder (default: the embedded default bundle)")
    p.add_argument(
        "--task",
        required=True,
        metavar="KIND:FILE",
        help="bbh:FILE.json, gsm8k:FILE.jsonl, math:FILE, gpqa:FILE.csv, mixed:FILE.jsonl, or "
        'general:FILE.jsonl ({"prompt"} per line: base retention, the share of answers equal to '
        "the base model's)",
    )
    p.add_argument(
        "--routing",
        "--router",
        dest="routing",
        default="learned",
        help="base, adapter:NAME, oracle, sequence, turn, learned (the bundle's router, default), merge, or a "
        f"named router, the same as in route, generate and serve: {names_help()}",
    )
    p.add_argument("--limit", type=int, default=None, help="first N items only")
    p.add_argument("--batch-size", type=int, default=16, help="prompts per generation batch (default 16)")
    p.add_argument("--max-tokens", type=int, default=None, help="answer budget (default: per task kind)")
    p.add_argument("--json", default=None, metavar="OUT", help='write {"task","routing","n","accuracy",...}')
    p.add_argument("--predictions", default=None, metavar="OUT.jsonl", help="one line per item (or mixed part)")


@command("eval", _eval_args)
def _eval(args: argparse.Namespace) -> int:
    """Score a routed model on a task file (greedy, the bundle's prompt template)."""
    from molora.bundle import load
    from molora.eval.general import evaluate_general
    from molora.eval.runner import evaluate, save_results

    mm = load(args.bundle)
    run = evaluate_general if args.task.startswith("general:") else evaluate
    summary, predictions = run(
        mm, args.task, args.routing, limit=args.limit, batch_size=args.batch_size, max_new_tokens=args.max_tokens
    )
    save_results(summary, predictions, args.json, args.predictions)
    print(json.dumps(summary))
    return 0


# --------------------------------------------------------------------------------------------- bench


def _bench_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "what",
        nargs="?",
        choices=["ops", "model", "hotset", "engine", "serve", "peer"],
        help="which benchmark (`molora bench WHAT --help` lists its options)",
    )
    p.add_argument(
        "args",
        nargs=argparse.REMAINDER,
        help="that benchmark's options, e.g. --quick --threads 1 --json OUT --plot OUT.png",
    )


@command("bench", _bench_args)
def _bench(args: argparse.Namespace) -> int:
    """Performance benchmarks: ops, model, hotset, engine, serve, peer (each ends with one JSON line)."""
    from molora.bench.cli import main as bench_main

    return bench_main([args.what, *args.args] if args.what else [])
