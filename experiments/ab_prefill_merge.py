"""Merged prefill attention against one causal call per prompt length: speed, and whether a prompt's answer depends on
the batch it runs in.

    .venv/bin/python -m experiments.ab_prefill_merge --json docs/prefill_merge_ab.json [--repeats 8] [--threads 2]

The runner can put the fresh prompts of a step (MERGE_PREFILL_TOKENS tokens in all at most) into one attention call
under a block-diagonal mask (molora.model.runner.ModelRunner.plan); otherwise each prompt length is one batched causal
call. In the merged call a prompt's keys share the attention kernel's blocks with its neighbours', so its sums are
grouped differently with other company: float32 hides that, but a base whose activations are rounded (w8a8: per
token, to int8) turns those last bits into other tokens.

- speed: the engine (max_num_seqs 8, prefix cache off) answers one token to each of the general train prompts of at
  most 40 tokens (steps of 8 fresh prompts, about 200 tokens: merged when allowed), MERGE_PREFILL_TOKENS 256 against
  0, alternating, --repeats times; medians and their ratio;
- batch: per base (float32, w8a8), the same 24 general validation prompts answered greedily (48 tokens) with
  max_num_seqs 4 and 32 (other company in every step), prefix cache off, merged and not: how many of the 24 answers
  are equal.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path


def main(argv: list[str] | None = None) -> int:
    import torch

    import molora.model.runner as runner
    from molora.bench.common import machine_info
    from molora.bundle import encode_prompt, load
    from molora.config import SamplingParams
    from molora.data.general import general_split
    from molora.engine import Engine, EngineConfig

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--json", type=Path, required=True)
    ap.add_argument("--repeats", type=int, default=8)
    ap.add_argument("--threads", type=int, default=2)
    a = ap.parse_args(argv)
    torch.set_num_threads(a.threads)
    default = runner.MERGE_PREFILL_TOKENS
    settings = {"merged": 256, "per length": 0}
    rec: dict = {
        "command": "python -m experiments.ab_prefill_merge " + " ".join(argv if argv is not None else sys.argv[1:]),
        "date": time.strftime("%Y-%m-%d"),
        "machine": machine_info() | {"threads": a.threads},
        "settings": settings,
    }
    try:
        mm = load(None)
        short = [r for r in (encode_prompt(mm, x["prompt"]) for x in general_split()["train"]) if len(r) <= 40]
        eng = Engine(mm, EngineConfig(max_num_seqs=8, enable_prefix_caching=False))
        one = SamplingParams(max_new_tokens=1)
        secs: dict[str, list[float]] = {k: [] for k in settings}
        for i in range(a.repeats):
            for name in list(settings)[i % 2 :] + list(settings)[: i % 2]:
                runner.MERGE_PREFILL_TOKENS = settings[name]
                t0 = time.perf_counter()
                eng.generate(short, one, routing="none")
                secs[name].append(time.perf_counter() - t0)
        med = {k: statistics.median(v) for k, v in secs.items()}
        rec["speed"] = {
            "prompts": len(short),
            "mean_prompt_tokens": round(sum(map(len, short)) / len(short), 1),
            "seconds": {k: [round(x, 4) for x in v] for k, v in secs.items()},
            "median_s": {k: round(v, 4) for k, v in med.items()},
            "per_length_over_merged": round(med["per length"] / med["merged"], 3),
        }
        print(json.dumps(rec["speed"]["median_s"]), flush=True)
        prompts = [x["prompt"] for x in general_split()["val"][:24]]
        gp = SamplingParams(max_new_tokens=48)
        rec["batch"] = {}
        for base, scheme in (("fp32", None), ("w8a8", "w8a8")):
            mm = load(None, quantization=scheme)
            rows = [encode_prompt(mm, q) for q in prompts]
            got = {}
            for name, merge in settings.items():
                runner.MERGE_PREFILL_TOKENS = merge
                answers = []
                for seqs in (4, 32):
                    e = Engine(mm, EngineConfig(max_num_seqs=seqs, enable_prefix_caching=False))
                    answers.append([o.new_token_ids for o in e.generate(rows, gp, routing="none")])
                got[name] = sum(x == y for x, y in zip(*answers))
            rec["batch"][base] = {"prompts": len(rows), "equal_across_max_num_seqs_4_and_32": got}
            print(base, json.dumps(got), flush=True)
    finally:
        runner.MERGE_PREFILL_TOKENS = default
    a.json.write_text(json.dumps(rec, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
