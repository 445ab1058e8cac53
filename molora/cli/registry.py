"""The table of `molora` subcommands: each module of molora.cli registers its commands with `@command`."""

from __future__ import annotations

import argparse
from collections.abc import Callable

Command = Callable[[argparse.Namespace], int]
COMMANDS: dict[str, tuple[Callable[[argparse.ArgumentParser], None], Command]] = {}


def command(name: str, add_args: Callable[[argparse.ArgumentParser], None]) -> Callable[[Command], Command]:
    """Register `fn` as `molora NAME`, its flags added by `add_args`."""

    def register(fn: Command) -> Command:
        COMMANDS[name] = (add_args, fn)
        return fn

    return register
