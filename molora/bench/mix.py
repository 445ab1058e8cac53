"""Mix benchmark: a batch of requests each on its own two-adapter mix against the same batch pinned one adapter each.

    python -m molora.bench.mix [--quick] [--json OUT]        (molora bench mix)

Setup: the default bundle (SmolLM2-135M-Instruct and its trained adapters, one slot each), N requests of P-token
random prompts and G greedy new tokens (eos ignored: every variant does the same token work), one engine for all
variants (no prefix cache: each repetition computes every prompt).

Measured in one run, variants interleaved within each repetition (the order rotating), medians reported:
  pinned      request i pinned to adapter i mod K (top-1: one adapter's LoRA work per token)
  mix         request i on its own mix of two adapters (pair i mod C(K, 2), weights w_i and 1 - w_i, all N mixes
              different): top-2 rows, the fused CPU kernel one call per choice column where it runs
  mix_eager   the same mixes with the fused kernel kept to top-1 (`LoRADispatcher.max_fused_top_k = 1`): top-2 rows
              on the eager backends (stacked_mask / sort_group by the cost model), as mixes ran before the kernel
              took top-k
tokens/s = N * G / the median seconds of running the batch to completion; `over_pinned` the paired ratio of the
pinned time to a variant's time per repetition, i.e. the variant's tokens/s over pinned's (median and quartiles,
molora.bench.common.paired_ratio).
Ends with one JSON line. Owns only timing and reporting; knows the engine through its public API.
"""

from __future__ import annotations

import argparse
import itertools
import statistics
from collections.abc import Sequence
from typing import Any

import torch

from molora.bench.common import (
    add_common_args,
    emit,
    machine_info,
    paired_ratio,
    rounded,
    set_threads,
    time_interleaved,
)
from molora.bench.common import stderr_log as log
from molora.bench.engine import bench_config, workload
from molora.config import SamplingParams
from molora.engine import Engine

VARIANTS = ("pinned", "mix", "mix_eager")


def mixes(names: Sequence[str], n: int) -> list[dict[str, float]]:
    """n different two-adapter mixes: request i takes pair i mod C(K, 2) with weights w and 1 - w, w spread over
    (0.1, 0.9) so that no two requests share a mix."""
    pairs = list(itertools.combinations(names, 2))
    out = []
    for i in range(n):
        a, b = pairs[i % len(pairs)]
        w = round(0.1 + 0.8 * i / max(1, n - 1), 4)
        out.append({a: w, b: round(1.0 - w, 4)})
    assert len({tuple(sorted(m.items())) for m in out}) == n, "the mixes must all differ"
    return out


def run(requests: int, prompt_len: int, new_tokens: int, repeats: int, dtype: torch.dtype) -> dict[str, Any]:
    import molora

    mm = molora.load(dtype=dtype)
    engine = Engine(mm, bench_config(requests, prompt_len + new_tokens + 1))
    names = list(mm.adapters)
    prompts, _ = workload(requests, prompt_len, new_tokens, int(mm.config.vocab_size), mixed=False)
    params = SamplingParams(max_new_tokens=new_tokens, ignore_eos=True)
    mix_list = mixes(names, requests)
    pins = [names[i % len(names)] for i in range(requests)]
    dispatcher = mm.dispatcher
    limit = dispatcher.max_fused_top_k

    def pinned() -> None:
        engine.generate(prompts, params, adapter=pins)

    def mixed(fused_top_k: int | None) -> None:
        dispatcher.max_fused_top_k = fused_top_k
        try:
            ids = [engine.add_request(p, params, mix=m) for p, m in zip(prompts, mix_list)]
            done: set[str] = set()
            while engine.has_unfinished():
                done.update(o.request_id for o in engine.step() if o.finished)
            assert done == set(ids), "every mixed request must finish"
        finally:
            dispatcher.max_fused_top_k = limit

    with torch.inference_mode():
        timing = time_interleaved(
            {"pinned": pinned, "mix": lambda: mixed(None), "mix_eager": lambda: mixed(1)},
            repeats,
            log=log,
        )
    tokens = requests * new_tokens
    med = {k: statistics.median(v) / 1e3 for k, v in timing.samples.items()}  # seconds
    ratio = {k: paired_ratio(timing.samples["pinned"], timing.samples[k]) for k in ("mix", "mix_eager")}
    return {
        "bench": "mix",
        "config": {
            "requests": requests,
            "prompt_len": prompt_len,
            "new_tokens": new_tokens,
            "repeats": repeats,
            "dtype": str(dtype).removeprefix("torch."),
            "adapters": names,
            "slots": mm.bank.num_slots,
            "mixes": mix_list,
            "threads": torch.get_num_threads(),
        },
        "machine": machine_info(),
        "seconds": rounded(med),
        "tokens_per_s": rounded({k: tokens / s for k, s in med.items()}),
        "samples_ms": {k: rounded(v) for k, v in timing.samples.items()},
        # paired per repetition: pinned time / variant time (the variant's tokens/s over pinned's): median, IQR
        "over_pinned": {k: rounded(list(v)) for k, v in ratio.items()},
        "goal_over_pinned": 0.8,
    }


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="molora bench mix", description=__doc__.splitlines()[0])
    p.add_argument("--requests", type=int, default=32)
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    add_common_args(p, plot=False)
    a = p.parse_args(argv)
    set_threads(a.threads)
    if a.quick:
        a.requests, a.prompt_len, a.new_tokens, a.repeats = 4, 8, 4, 2
    result = run(a.requests, a.prompt_len, a.new_tokens, a.repeats, getattr(torch, a.dtype))
    emit(result, a.json)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
