"""`molora bench WHAT [options]`: dispatch to one benchmark module's `main(argv)`.

    molora bench ops     [--quick] ...     dispatch kernels vs single adapter, K-pass and the base matmul
    molora bench model   [--quick] ...     prefill / decode: base, molora, runner, PEFT, X-LoRA, K-pass
    molora bench hotset  [--quick] ...     adapter load latency per tier, LRU hit rate under Zipf
    molora bench engine  [--quick] ...     continuous batching vs transformers (--shared-prefix: prefix cache)
    molora bench serve   [...]             load generator against the OpenAI-compatible server
    molora bench peer    [...]             the engine against llama.cpp at matching precisions (optional peer)
    molora bench mix     [--quick] ...     a batch of two-adapter mixes against the same batch pinned

Each module is imported only when chosen (they pull in different dependencies) and ends its stdout with
one JSON line. `molora bench WHAT --help` lists that benchmark's options.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Sequence

BENCHES: dict[str, str] = {
    "ops": "molora.bench.ops",
    "model": "molora.bench.model",
    "hotset": "molora.bench.hotset",
    "engine": "molora.bench.engine",
    "serve": "molora.bench.serve",
    "peer": "molora.bench.peer",
    "mix": "molora.bench.mix",
}


def usage() -> str:
    lines = ["usage: molora bench {" + ",".join(BENCHES) + "} [options]", ""]
    lines += [line for line in __doc__.splitlines()[2:10] if line.strip()]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    """Run `molora bench <what> <options...>`; returns the benchmark's exit code (2 on a bad subcommand)."""
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] in ("-h", "--help"):
        print(usage())
        return 0 if args else 2
    what, rest = args[0], args[1:]
    if what not in BENCHES:
        print(
            f"molora bench: unknown benchmark {what!r}; choose one of {', '.join(BENCHES)}\n\n{usage()}",
            file=sys.stderr,
        )
        return 2
    module = importlib.import_module(BENCHES[what])
    return int(module.main(rest) or 0)


if __name__ == "__main__":
    sys.exit(main())
