"""`molora` command line: thin argparse entry points over the library.

    molora generate "prompt"            a completion on the default bundle (or --bundle DIR)
    molora route "prompt"               the answer with each token coloured by its adapter
    molora demo                         what `make run` shows
    molora train-adapter / train-router / build-default / eval / bench / serve
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Callable, Sequence

from molora.errors import MoLoRAError

Command = Callable[[argparse.Namespace], int]
_COMMANDS: dict[str, tuple[Callable[[argparse.ArgumentParser], None], Command]] = {}


def command(name: str, add_args: Callable[[argparse.ArgumentParser], None]):
    def register(fn: Command) -> Command:
        _COMMANDS[name] = (add_args, fn)
        return fn
    return register


# --------------------------------------------------------------------------------------------- generate

def _generate_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("prompt", help="the user message (the bundle's prompt template wraps it)")
    p.add_argument("--bundle", default=None, help="bundle folder (default: the embedded default bundle)")
    p.add_argument("--base-only", action="store_true", help="ignore the bundle's adapters: the plain base model")
    p.add_argument("--adapter", default=None, help="pin one adapter for every token instead of the router")
    p.add_argument("--max-tokens", type=int, default=128, help="new tokens at most (default 128)")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--seed", type=int, default=None, help="sampling seed")


@command("generate", _generate_args)
def _generate(args: argparse.Namespace) -> int:
    from molora.bundle import load, run_prompt

    mm = load(args.bundle, base_only=args.base_only)
    result = run_prompt(mm, args.prompt, adapter=args.adapter, max_new_tokens=args.max_tokens,
                        temperature=args.temperature, seed=args.seed)
    print(result.text)
    return 0


# --------------------------------------------------------------------------------------------- main

def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="molora", description="Per-token routing over many LoRA adapters.")
    parser.add_argument("-v", "--verbose", action="store_true", help="log what molora decides (backends, slots)")
    sub = parser.add_subparsers(dest="command", required=True)
    for name, (add_args, fn) in _COMMANDS.items():
        p = sub.add_parser(name, help=(fn.__doc__ or "").strip().split("\n")[0] or None)
        add_args(p)
        p.set_defaults(func=fn)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format="%(levelname)s %(name)s: %(message)s")
    try:
        return args.func(args)
    except MoLoRAError as e:
        print(f"molora {args.command}: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
