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


# --------------------------------------------------------------------------------------------- serve

def _serve_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--bundle", default=None, help="bundle folder (default: the embedded default bundle)")
    p.add_argument("--host", default="127.0.0.1", help="interface to listen on (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=8000, help="port (default 8000)")
    p.add_argument("--api-key", action="append", default=[], metavar="KEY",
                   help="accept this Bearer key (repeatable; also $MOLORA_API_KEYS, comma-separated); none: open")
    p.add_argument("--admin-key", action="append", default=[], metavar="KEY",
                   help="key that may load/unload adapters (repeatable; also $MOLORA_ADMIN_KEYS)")
    p.add_argument("--adapter-root", action="append", default=[], metavar="DIR",
                   help="folder POST /v1/adapters may load from (repeatable; none: run-time loading off)")
    p.add_argument("--max-queue", type=int, default=256, help="engine requests in flight at most; more get 429")
    p.add_argument("--max-num-seqs", type=int, default=64, help="sequences the engine runs per step (default 64)")
    p.add_argument("--max-model-len", type=int, default=2048, help="context length in tokens (default 2048)")
    p.add_argument("--drain-timeout", type=float, default=30.0, help="seconds SIGTERM waits for in-flight requests")


@command("serve", _serve_args)
def _serve(args: argparse.Namespace) -> int:
    """Serve the OpenAI-compatible API (model=bundle routes per token; bundle:adapter pins one adapter)."""
    import os

    from molora.engine import EngineConfig
    from molora.server import serve

    def env(name: str) -> list[str]:
        return [k for k in os.environ.get(name, "").split(",") if k]

    serve(args.bundle, host=args.host, port=args.port, api_keys=args.api_key + env("MOLORA_API_KEYS"),
          admin_keys=args.admin_key + env("MOLORA_ADMIN_KEYS"), adapter_roots=args.adapter_root,
          max_queue=args.max_queue, drain_timeout_s=args.drain_timeout,
          engine_config=EngineConfig(max_num_seqs=args.max_num_seqs, max_model_len=args.max_model_len))
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
