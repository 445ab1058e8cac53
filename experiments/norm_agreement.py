"""Greedy agreement of molora's engine with transformers on the real model's general prompts, per source tree.

    python -m experiments.norm_agreement --tree base=/tmp/base --tree head=. [--json docs/norm_agreement.json]

What changes when the C++ RMSNorm takes its mean of squares as the float32 nearest the exact mean (a float64 sum)
instead of replaying torch's float32 summation order: each tree (a checkout of molora) runs in a process of its own
with PYTHONPATH on it. In each, the default base model (molora.model.base.load_default_base, no adapters) answers the
general prompts of the validation and test splits (molora.data.general.general_split, chat template applied) greedily,
up to --new-tokens tokens or eos, twice: through molora's Engine (continuous batching, paged KV, the C++ kernels where
they run) and through transformers' `generate` one prompt at a time (do_sample=False). Recorded per tree and dtype
(float32, bfloat16): how many prompts get the same tokens from both, and the first position where they part where they
do. Ends with one JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]


def measure(new_tokens: int, limit: int, threads: int) -> dict[str, Any]:
    import torch

    import molora
    from molora.config import SamplingParams
    from molora.data.general import general_split
    from molora.engine import Engine, EngineConfig
    from molora.model.base import load_default_base
    from molora.ops import fused_cpu

    torch.set_num_threads(threads)
    split = general_split()
    rows = (split["val"] + split["test"])[:limit]
    out: dict[str, Any] = {"kernels": fused_cpu.available(), "prompts": len(rows), "new_tokens": new_tokens}
    for dtype in (torch.float32, torch.bfloat16):
        model, tok = load_default_base()
        model = model.to(dtype).eval()
        prompts = [
            tok.apply_chat_template(
                [{"role": "user", "content": r["prompt"]}], add_generation_prompt=True, tokenize=True
            )
            for r in rows
        ]
        prompts = [list(p["input_ids"]) if hasattr(p, "keys") else list(p) for p in prompts]
        ref = []
        with torch.no_grad():
            for p in prompts:  # transformers, one prompt at a time (no padding)
                ids = model.generate(
                    torch.tensor([p]), max_new_tokens=new_tokens, do_sample=False, pad_token_id=tok.eos_token_id
                )[0, len(p) :].tolist()
                ref.append(ids)
        mm = molora.attach(model)
        longest = max(len(p) for p in prompts) + new_tokens + 16
        eng = Engine(mm, EngineConfig(max_num_seqs=len(prompts), max_model_len=longest, kv_budget_tokens=64 * longest))
        got = [o.new_token_ids for o in eng.generate(prompts, SamplingParams(max_new_tokens=new_tokens))]
        gen_eos = getattr(model.generation_config, "eos_token_id", None)
        eos = {tok.eos_token_id, *(gen_eos if isinstance(gen_eos, list) else [gen_eos])} - {None}
        same, parted = 0, []
        for a, b in zip(got, ref):
            a, b = _until_eos(a, eos), _until_eos(b, eos)
            if a == b:
                same += 1
            else:
                parted.append(next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b))))
        out[str(dtype).removeprefix("torch.")] = {
            "same_tokens": same,
            "prompts": len(prompts),
            "first_difference_at": sorted(parted),
            "tokens_compared": sum(len(b) for b in ref),
        }
        del eng, mm, model
    return out


def _until_eos(ids: list[int], eos: set[int]) -> list[int]:
    """The tokens before the first eos (transformers keeps the eos it stops at; the engine may not)."""
    return next((ids[:i] for i, t in enumerate(ids) if t in eos), ids)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tree", action="append", default=[], metavar="NAME=DIR", help="a checkout to measure (repeat)")
    ap.add_argument("--new-tokens", type=int, default=48, help="greedy tokens per prompt at most (default 48)")
    ap.add_argument("--limit", type=int, default=60, help="prompts (validation, then test; default 60: all)")
    ap.add_argument("--threads", type=int, default=1, help="torch CPU threads (default 1)")
    ap.add_argument("--json", metavar="OUT", help="also write the record to this file")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(measure(args.new_tokens, args.limit, args.threads)))
        return 0
    from molora.bench.common import machine_info

    record: dict[str, Any] = {
        "what": "greedy tokens of molora's engine vs transformers' generate, default base, general val+test prompts",
        "command": "python -m experiments.norm_agreement " + " ".join(sys.argv[1:]),
        "machine": machine_info(),
        "trees": {},
    }
    for spec in args.tree:
        name, _, folder = spec.partition("=")
        tree = Path(folder).resolve()
        run = subprocess.run(
            [sys.executable, str(Path(__file__).resolve()), "--child", f"--new-tokens={args.new_tokens}",
             f"--limit={args.limit}", f"--threads={args.threads}"],
            env={**os.environ, "PYTHONPATH": str(tree)},
            cwd=tree,
            capture_output=True,
            text=True,
        )  # fmt: skip
        if run.returncode != 0:
            raise SystemExit(f"tree {name} ({tree}) failed:\n{run.stderr[-3000:]}")
        record["trees"][name] = {"dir": str(tree), **json.loads(run.stdout.strip().splitlines()[-1])}
    if args.json:
        Path(args.json).write_text(json.dumps(record, indent=1) + "\n")
    print(json.dumps(record))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
