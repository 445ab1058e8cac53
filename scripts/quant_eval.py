"""The default bundle's skills and general retention on a quantized base, beside float32 and bfloat16.

    python scripts/quant_eval.py --split val|test [--n 24] [--n-general 40] [--variants fp32 bf16 int8 int4-bf16]
        [--json docs/quant_eval_val.json]

For each variant (molora.load(None, dtype, quantization): the embedded default bundle, its learned router, int8 with
the SmoothQuant calibration load does), greedy, the bundle's prompt template, `molora.eval`'s scoring:

- skills: `--n` held-out items per skill of the split (molora.eval.heldout: val seeds for choosing, test seeds scored
  once), routing "learned"; strict accuracy per skill, and its difference from float32's;
- general: the first `--n-general` general prompts of the split (molora.data.general), routing "learned";
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
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
VARIANTS = {
    "fp32": (torch.float32, None),
    "bf16": (torch.bfloat16, None),
    "int8": (torch.float32, "int8"),
    "int8-bf16": (torch.bfloat16, "int8"),
    "int4-bf16": (torch.bfloat16, "int4"),
}


def main(argv: list[str] | None = None) -> int:
    from molora.bundle import default_bundle_dir, load, read_bundle
    from molora.data.general import general_split
    from molora.data.jsonl import write_jsonl
    from molora.data.skills import write_bbh_file
    from molora.eval.general import evaluate_general
    from molora.eval.heldout import fingerprint, held_out, training_inputs
    from molora.eval.runner import evaluate

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--split", choices=["val", "test"], required=True)
    p.add_argument("--n", type=int, default=24)
    p.add_argument("--n-general", type=int, default=40)
    p.add_argument("--variants", nargs="+", default=["fp32", "bf16", "int8", "int4-bf16"], choices=list(VARIANTS))
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--json", type=Path, default=None)
    a = p.parse_args(argv)
    torch.set_num_threads(a.threads)
    bundle = read_bundle(default_bundle_dir())
    banned = training_inputs(bundle)
    tasks = [x.tasks[0] for x in bundle.adapters if x.tasks]
    record: dict = {
        "what": "default bundle, learned routing, on a quantized base: skills (strict accuracy) and general retention",
        "command": "python scripts/quant_eval.py " + " ".join(argv if argv is not None else sys.argv[1:]),
        "split": a.split,
        "fingerprint": fingerprint(bundle),
        "machine": {"cpu": platform.processor() or platform.machine(), "threads": a.threads},
        "n": a.n,
        "n_general": a.n_general,
        "variants": {},
    }
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        for t in tasks:
            items, _ = held_out(t, a.n, banned, split=a.split)
            write_bbh_file(work / f"{t}.json", items)
        rows = general_split()[a.split][: a.n_general]
        write_jsonl(
            work / "general.jsonl", [{"id": r["id"], "source": r["source"], "prompt": r["prompt"]} for r in rows]
        )
        fp32_base = None
        for name in a.variants:
            dtype, scheme = VARIANTS[name]
            t0 = time.perf_counter()
            mm = load(None, dtype=dtype, quantization=scheme)
            v: dict = {"dtype": str(dtype).removeprefix("torch."), "quantization": scheme, "skills": {}}
            for t in tasks:
                s, _ = evaluate(mm, f"bbh:{work / f'{t}.json'}", "learned", batch_size=a.batch_size, progress=False)
                v["skills"][t] = s["accuracy"]
            s, preds = evaluate_general(mm, f"general:{work / 'general.jsonl'}", "learned", batch_size=a.batch_size)
            base_ids = [pr["base_ids"] for pr in preds]
            if name == "fp32":
                fp32_base = base_ids
            v["general"] = {"retention": s["retention"], "empty_where_base_answers": s["empty_where_base_answers"]}
            if fp32_base is not None:
                same = sum(x == y for x, y in zip(base_ids, fp32_base))
                v["general"]["base_equal_to_fp32_base"] = round(100.0 * same / len(rows), 2)
            v["seconds"] = round(time.perf_counter() - t0, 1)
            record["variants"][name] = v
            print(name, json.dumps(v), flush=True)
            del mm
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
