"""What a quantized base's general retention measures: the learned router's own effect, or the base model's answers
moving with the batch they run in.

    .venv/bin/python -m experiments.quant_retention --split test --n-general 60 --variants fp32 int8-qhead bf16 w8a8 \
        --json docs/quant_retention_test.json [--threads 2]

experiments/quant_eval.py's retention is the share of general prompts whose answer under the learned router equals the
same model's answer without adapters, both through the engine (molora serve's path). Per variant (experiments/
bench_quant.py's VARIANTS, on the embedded default bundle) on the same prompts (the first --n-general of the general
split; test2 reads test's, as quant_eval does), this script measures that figure again and takes it apart:

- engine_retention: quant_eval's figure (engine, routed run then base run, prefix cache on as served);
- engine_adapter_tokens: the answer tokens the routed run computed on an adapter (Engine.tokens_by_adapter): 0 means
  the router kept every general prompt wholly on the base model, so any answer that differs does so for another cause;
- engine_base_repeat: the base run again in a fresh engine with the prefix cache off and the prompts in reverse order,
  the share equal to the first base run: how far the base model's own answers depend on the batch (the rows beside
  it, the prefill chunks, reused KV) -- the noise floor any routed-vs-base figure from the engine carries;
- same_batches_retention: molora.eval.general's retention (MoLoRAModel.generate: routed and base answered in
  identical batches, so the batch cannot differ), with its adapter_token_share.

Nothing is chosen here. Records the CPU, the load and the bundle fingerprint.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

from experiments.bench_quant import VARIANTS  # (name -> (dtype, scheme, quantize_lm_head))

ROOT = Path(__file__).resolve().parent.parent


def main(argv: list[str] | None = None) -> int:
    import torch

    from molora.bench.common import machine_info
    from molora.bundle import default_bundle_dir, encode_prompt, load, read_bundle
    from molora.config import SamplingParams
    from molora.data.general import general_split
    from molora.data.jsonl import write_jsonl
    from molora.engine import Engine, EngineConfig
    from molora.eval.general import DEFAULT_TOKENS, evaluate_general
    from molora.eval.heldout import fingerprint

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--split", required=True, choices=["val", "test", "test2"])
    p.add_argument("--n-general", type=int, default=60)
    p.add_argument("--variants", nargs="+", default=["fp32", "w8a8"], choices=list(VARIANTS))
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--json", type=Path, required=True)
    a = p.parse_args(argv)
    torch.set_num_threads(a.threads)
    rows = general_split()["test" if a.split == "test2" else a.split][: a.n_general]
    prompts = [r["prompt"] for r in rows]
    spec = a.json.with_suffix(".prompts.jsonl")
    write_jsonl(spec, [{"id": r["id"], "prompt": r["prompt"]} for r in rows])
    rec: dict = {
        "what": "general retention on a quantized base, taken apart: the router's effect against the base model's "
        "answers moving with the batch",
        "command": "python -m experiments.quant_retention " + " ".join(argv if argv is not None else sys.argv[1:]),
        "date": time.strftime("%Y-%m-%d"),
        "split": a.split,
        "n_general": len(prompts),
        "fingerprint": fingerprint(read_bundle(default_bundle_dir())),
        "machine": {k: v for k, v in machine_info().items() if k in ("cpu", "cpu_flags", "cores")}
        | {"threads": a.threads},
        "variants": {},
    }
    gp = SamplingParams(max_new_tokens=DEFAULT_TOKENS)
    try:
        for name in a.variants:
            dtype, scheme, head = VARIANTS[name]
            t0 = time.perf_counter()
            mm = load(None, dtype=dtype, quantization=scheme, quantize_lm_head=head)
            ids = [encode_prompt(mm, q) for q in prompts]
            eng = Engine(mm, EngineConfig(max_num_seqs=32))  # as quant_eval.py runs it
            routed = [o.new_token_ids for o in eng.generate(ids, gp)]
            on_adapters = sum(n for k, n in eng.tokens_by_adapter.items() if k != "base")
            base = [o.new_token_ids for o in eng.generate(ids, gp, routing="none")]
            fresh = Engine(mm, EngineConfig(max_num_seqs=32, enable_prefix_caching=False))
            again = [o.new_token_ids for o in fresh.generate(ids[::-1], gp, routing="none")][::-1]
            same, _ = evaluate_general(mm, f"general:{spec}", "learned")
            n = len(prompts)
            v = {
                "engine_retention": round(100.0 * sum(x == y for x, y in zip(routed, base)) / n, 2),
                "engine_adapter_tokens": on_adapters,
                "engine_routed_tokens": sum(len(x) for x in routed),
                "engine_base_repeat": round(100.0 * sum(x == y for x, y in zip(base, again)) / n, 2),
                "same_batches_retention": same["retention"],
                "same_batches_adapter_token_share": same["adapter_token_share"],
                "seconds": round(time.perf_counter() - t0, 1),
            }
            rec["variants"][name] = v
            print(name, json.dumps(v), flush=True)
            del eng, fresh, mm
    finally:
        spec.unlink(missing_ok=True)
    rec["loadavg_end"] = [round(x, 2) for x in os.getloadavg()]
    a.json.write_text(json.dumps(rec, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
