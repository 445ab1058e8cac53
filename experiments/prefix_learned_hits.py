"""Why the learned-routing prefix-cache gain is what it is: the shared-prefix workload of
`molora bench engine --shared-prefix` (same prompts) with the cache on and one new token per request, then
how many prompt tokens the probe pass and the real pass took from the cache, and how many distinct real-pass
decision sequences (filled probe decisions, base-expert verdict) the shared system prompt got.

    python -m experiments.prefix_learned_hits --json docs/prefix_cache_learned_hits.json
"""

from __future__ import annotations

import argparse
import json
import random
from collections import Counter
from pathlib import Path

import torch

from molora.bench.prefix import question, system_prompt, turn
from molora.bundle import load
from molora.config import SamplingParams
from molora.engine import Engine, EngineConfig


@torch.no_grad()
def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--system-tokens", type=int, default=512)
    ap.add_argument("--json", required=True)
    a = ap.parse_args()
    mm = load()
    tok = mm.tokenizer
    rng = random.Random(0)
    system = system_prompt(tok, a.system_tokens)
    prompts = [system + turn(tok, question(rng)) for _ in range(a.requests)]
    engine = Engine(
        mm,
        EngineConfig(
            max_num_seqs=a.requests,
            max_tokens_per_step=512,
            block_size=16,
            max_model_len=2048,
            kv_budget_tokens=a.requests * 1024,
            stop_at_eos=False,
        ),
    )
    ids = [engine.add_request(p, SamplingParams(max_new_tokens=1, ignore_eos=True), routing="auto") for p in prompts]
    reqs = [engine.requests[i] for i in ids]
    cached = {}
    while engine.has_unfinished():
        for o in engine.step():
            if o.finished:
                cached[o.request_id] = o.cached_tokens
    n = len(system)
    sys_routes = Counter(
        (r.route.mode, tuple(r.route.prompt_routes[:n]) if r.route.mode == "learned" else None) for r in reqs
    )
    res = {
        "requests": a.requests,
        "system_tokens": n,
        "prefix_cache": engine.stats()["prefix_cache"],
        "cached_tokens_per_request": [cached[i] for i in ids],
        "base_only_requests": sum(r.route.mode == "none" for r in reqs),
        "distinct_system_prompt_routings": len(sys_routes),
        "requests_per_system_prompt_routing": sorted(sys_routes.values(), reverse=True),
        "tokens_computed": engine.tokens_computed,
    }
    Path(a.json).write_text(json.dumps(res, indent=1) + "\n")
    print(json.dumps(res))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
