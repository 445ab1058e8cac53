"""`molora` command line: thin argparse entry points over the library.

    molora generate "prompt"            a completion on the default bundle (or --bundle DIR)
    molora route "prompt"               the answer with each token coloured by its adapter
    molora demo                         what `make run` shows (--multimodal: the early-fusion digits bundle)
    molora codes-png TEXT --out F.png   the image codes of a digits-bundle answer as a PNG
    molora serve [--model M --lora-modules NAME=PATH ...]   the OpenAI-compatible server (vLLM's flags)
    molora bundle init|check / setup-default
    molora train-adapter / train-routed / train-router / train-gates / build-default / eval / bench

One module per group of commands (generate, train, serve, evaluate), each registering its commands in
`molora.cli.registry`; this module builds the parser and runs one.
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence

from molora.cli import evaluate, generate, serve, setup, train  # noqa: F401  (each registers its commands)
from molora.cli.generate import engine_answer, routed_view
from molora.cli.registry import COMMANDS
from molora.cli.serve import own_bundle
from molora.errors import MoLoRAError

ORDER = (
    "generate",
    "route",
    "demo",
    "codes-png",
    "serve",
    "bundle",
    "setup-default",
    "train-adapter",
    "train-routed",
    "train-router",
    "train-gates",
    "build-default",
    "build-multimodal",
    "eval",
    "bench",
)  # as `molora --help` lists them
__all__ = ["build_parser", "engine_answer", "main", "own_bundle", "routed_view"]


# --------------------------------------------------------------------------------------------- main


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="molora", description="Per-token routing over many LoRA adapters.")
    parser.add_argument("-v", "--verbose", action="store_true", help="log what molora decides (backends, slots)")
    sub = parser.add_subparsers(dest="command", required=True)
    for name, (add_args, fn) in sorted(COMMANDS.items(), key=lambda kv: ORDER.index(kv[0])):
        p = sub.add_parser(name, help=(fn.__doc__ or "").strip().split("\n")[0] or None)
        add_args(p)
        p.set_defaults(func=fn)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=logging.INFO if args.verbose else logging.WARNING, format="%(levelname)s %(name)s: %(message)s"
    )
    try:
        return args.func(args)
    except MoLoRAError as e:
        print(f"molora {args.command}: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
