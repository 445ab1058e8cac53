"""The default bundle's skills and general retention on a quantized base, beside float32 and bfloat16.

    python scripts/quant_eval.py --split val|test [--n 24] [--n-general 40] [--variants fp32 bf16 int8 int4-bf16]
        [--json docs/quant_eval_val.json]

For each variant (molora.load(None, dtype, quantization): the embedded default bundle, its learned router, int8 with
the SmoothQuant calibration load does), through the engine as `molora serve` runs it (routing "auto": the bundle's
learned router; greedy; stop at the end of the turn), the bundle's prompt template, `molora.eval`'s scoring and
answer budgets:

- skills: `--n` held-out items per skill of the split (molora.eval.heldout: val seeds for choosing, test seeds scored
  once); strict accuracy per skill, and its difference from float32's;
- general: the first `--n-general` general prompts of the split (molora.data.general), 64 new tokens at most;
  retention (the share of answers equal to the same model's own answer without adapters, as docs/results.md
  reports it) and the share equal to float32's base answer (what a quantized base changes by itself).

Ends with one JSON line (also written to --json). Records the CPU, the load and the commit's bundle fingerprint.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))
from bench_quant import VARIANTS  # noqa: E402  (the same variants as the engine bench: name -> (dtype, scheme))


def main(argv: list[str] | None = None) -> int:
    from molora.bundle import default_bundle_dir, encode_prompt, load, read_bundle
    from molora.config import SamplingParams
    from molora.data.general import general_split
    from molora.engine import Engine, EngineConfig
    from molora.eval.general import DEFAULT_TOKENS
    from molora.eval.heldout import fingerprint, held_out, training_inputs
    from molora.eval.runner import MAX_NEW_TOKENS
    from molora.eval.tasks import answer_kind, score

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--split", choices=["val", "test"], required=True)
    p.add_argument("--n", type=int, default=24)
    p.add_argument("--n-general", type=int, default=40)
    p.add_argument("--variants", nargs="+", default=["fp32", "bf16", "int8", "int4-bf16"], choices=list(VARIANTS))
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--json", type=Path, default=None)
    a = p.parse_args(argv)
    torch.set_num_threads(a.threads)
    bundle = read_bundle(default_bundle_dir())
    banned = training_inputs(bundle)
    tasks = [x.tasks[0] for x in bundle.adapters if x.tasks]
    items = [it for t in tasks for it in held_out(t, a.n, banned, split=a.split)[0]]
    general = [r["prompt"] for r in general_split()[a.split][: a.n_general]]
    record: dict = {
        "what": "default bundle, learned routing, on a quantized base: skills (strict accuracy) and general retention",
        "command": "python scripts/quant_eval.py " + " ".join(argv if argv is not None else sys.argv[1:]),
        "split": a.split,
        "fingerprint": fingerprint(bundle),
        "machine": {"cpu": platform.processor() or platform.machine(), "threads": a.threads},
        "n": a.n,
        "n_general": len(general),
        "variants": {},
    }
    fp32_base = None
    for name in a.variants:
        dtype, scheme = VARIANTS[name]
        t0 = time.perf_counter()
        mm = load(None, dtype=dtype, quantization=scheme)
        eng = Engine(mm, EngineConfig(max_num_seqs=32))
        params = [
            SamplingParams(max_new_tokens=MAX_NEW_TOKENS.get(answer_kind(it.task, it.target), 64)) for it in items
        ]
        outs = eng.generate([encode_prompt(mm, it.input) for it in items], params)
        texts = [mm.tokenizer.decode(o.new_token_ids, skip_special_tokens=True) for o in outs]
        hits = [score(it.task, txt, it.target)[0] for it, txt in zip(items, texts)]
        v: dict = {"dtype": str(dtype).removeprefix("torch."), "quantization": scheme, "skills": {}}
        for t in tasks:
            mine = [h for it, h in zip(items, hits) if it.task == t]
            v["skills"][t] = round(100.0 * sum(mine) / len(mine), 2)
        rows = [encode_prompt(mm, q) for q in general]
        gp = SamplingParams(max_new_tokens=DEFAULT_TOKENS)
        routed = [o.new_token_ids for o in eng.generate(rows, gp)]
        base = [o.new_token_ids for o in eng.generate(rows, gp, routing="none")]
        if name == "fp32":
            fp32_base = base
        v["general"] = {
            "retention": round(100.0 * sum(x == y for x, y in zip(routed, base)) / len(rows), 2),
            "empty_where_base_answers": round(
                100.0 * sum(not x and bool(y) for x, y in zip(routed, base)) / max(1, sum(bool(y) for y in base)), 2
            ),
        }
        if fp32_base is not None:
            same = sum(x == y for x, y in zip(base, fp32_base))
            v["general"]["base_equal_to_fp32_base"] = round(100.0 * same / len(rows), 2)
        v["seconds"] = round(time.perf_counter() - t0, 1)
        record["variants"][name] = v
        print(name, json.dumps(v), flush=True)
        del eng, mm
    ref = record["variants"].get("fp32")
    if ref:
        for v in record["variants"].values():
            v["skills_vs_fp32"] = {t: round(v["skills"][t] - ref["skills"][t], 2) for t in tasks}
    record["machine"]["loadavg_end"] = os.getloadavg()
    print(json.dumps(record))
    if a.json:
        a.json.write_text(json.dumps(record, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
