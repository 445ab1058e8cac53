"""How much of the learned-vs-oracle gap is the routing of prompt tokens? (an experiment, not a routing mode)

    .venv/bin/python scripts/prompt_routing_bound.py --task bbh:FILE --adapter NAME [--bundle DIR] [--limit N]

Evaluates the bundle's learned router with one change: every prompt token (the forwards in which no token
carries a decision, see molora.routing.learned: Carry) goes to the task's own adapter at every block, while
generated tokens are routed by the learned router as usual. If this scores the own adapter's accuracy, the
whole gap lies in the prompt tokens' routing. Prints the summary JSON line of `molora eval`.
"""

from __future__ import annotations

import argparse
import json

import torch

from molora.bundle import load
from molora.eval.runner import evaluate


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--task", required=True, help="KIND:FILE, as for molora eval (single-skill items)")
    p.add_argument("--adapter", required=True, help="the task's own adapter: every prompt token goes there")
    p.add_argument("--bundle", default=None, help="bundle folder (default: the embedded default bundle)")
    p.add_argument("--limit", type=int, default=None)
    args = p.parse_args()
    mm = load(args.bundle)
    router = mm.router
    if getattr(router, "carry_blocks", 0) <= 0:
        raise SystemExit("the bundle's router has no carry_blocks: prompt and generated forwards look alike")
    index = router.adapter_names.index(args.adapter)
    decide = router.decide

    def prompt_on_own_adapter(block, hidden, allowed=None, carry=None):
        if carry is None:  # a prompt forward: no token carries its predecessor's decision
            return torch.full((hidden.shape[0], 1), index, dtype=torch.long, device=hidden.device), None
        return decide(block, hidden, allowed, carry)

    router.decide = prompt_on_own_adapter
    summary, _ = evaluate(mm, args.task, "learned", limit=args.limit, progress=False)
    print(json.dumps({**summary, "routing": f"learned, prompt on {args.adapter}"}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
