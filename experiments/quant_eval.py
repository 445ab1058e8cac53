"""The default bundle's skills and general retention on a quantized base, beside float32 and bfloat16.

    python -m experiments.quant_eval --split val|test [--n 24] [--n-general 40] [--variants fp32 bf16 int8 int4-bf16]
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
import math
import os
import sys
import time
from pathlib import Path

import torch

from experiments.bench_quant import VARIANTS  # (the engine bench's variants: name -> (dtype, scheme, quantize_lm_head))

ROOT = Path(__file__).resolve().parent.parent


def paired_ci95(a: str, b: str) -> list[float]:
    """95% interval (points) on accuracy(a) - accuracy(b) over the same items ("1"/"0" per item): Agresti and Min's
    adjusted Wald interval for paired proportions (half an item added to each cell of the 2x2 table, so that no or few
    discordant items do not shrink it to nothing): d +- 1.96 sqrt(u + v - m d^2) / m, with u, v the items only a or
    only b got right plus 1/2 each, m = n + 2, d = (u - v) / m."""
    n = len(a)
    u = sum(x == "1" and y == "0" for x, y in zip(a, b)) + 0.5
    v = sum(x == "0" and y == "1" for x, y in zip(a, b)) + 0.5
    m = n + 2
    d = (u - v) / m
    half = 1.96 * math.sqrt(max(0.0, u + v - m * d * d)) / m
    return [round(100.0 * (d - half), 2), round(100.0 * (d + half), 2)]


def wilson95(k: int, n: int) -> tuple[float, float]:
    """Wilson's 95% interval on a share k / n."""
    z, p = 1.96, k / n
    mid, half = p + z * z / (2 * n), z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n))
    return (mid - half) / (1 + z * z / n), (mid + half) / (1 + z * z / n)


def main(argv: list[str] | None = None) -> int:
    from molora.bench.common import machine_info
    from molora.bundle import default_bundle_dir, encode_prompt, load, read_bundle
    from molora.config import SamplingParams
    from molora.data.general import general_split
    from molora.engine import Engine, EngineConfig
    from molora.eval.general import DEFAULT_TOKENS
    from molora.eval.heldout import fingerprint, held_out, training_inputs
    from molora.eval.runner import MAX_NEW_TOKENS
    from molora.eval.tasks import answer_kind, score
    from molora.model.quant_linear import QuantizedLinear

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--split", choices=["val", "test", "test2"])
    p.add_argument("--n", type=int, default=24)
    p.add_argument("--n-general", type=int, default=40)
    p.add_argument("--variants", nargs="+", default=["fp32", "bf16", "int8", "int4-bf16"], choices=list(VARIANTS))
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--json", type=Path, default=None)
    p.add_argument(
        "--recompute",
        type=Path,
        default=None,
        help="only recompute a record's differences and intervals from its per-item hits (this script's current "
        "formulas) and write it back; runs no model",
    )
    p.add_argument(
        "--fp32-from",
        type=Path,
        default=None,
        help="a record of this script on the same split, items and bundle whose fp32 variant the differences are "
        "taken against (a run of the other variants in a second process)",
    )
    a = p.parse_args(argv)
    if a.recompute is not None:
        rec = json.loads(a.recompute.read_text())
        loadavg = rec["machine"].get("loadavg_end")
        finish(rec, list(next(iter(rec["variants"].values()))["skills"]), a.recompute)
        rec["machine"]["loadavg_end"] = loadavg  # the run's, not this call's
        a.recompute.write_text(json.dumps(rec, indent=1) + "\n")
        return 0
    if a.split is None:
        p.error("--split is required (unless --recompute)")
    torch.set_num_threads(a.threads)
    bundle = read_bundle(default_bundle_dir())
    banned = training_inputs(bundle)
    tasks = [x.tasks[0] for x in bundle.adapters if x.tasks]
    items = [it for t in tasks for it in held_out(t, a.n, banned, split=a.split)[0]]
    # test2 has no general prompts of its own (the general split has none left): it reads the test split's
    general = [r["prompt"] for r in general_split()["test" if a.split == "test2" else a.split][: a.n_general]]
    record: dict = {
        "what": "default bundle, learned routing, on a quantized base: skills (strict accuracy) and general retention",
        "command": "python -m experiments.quant_eval " + " ".join(argv if argv is not None else sys.argv[1:]),
        "split": a.split,
        "fingerprint": fingerprint(bundle),
        "machine": {k: v for k, v in machine_info().items() if k in ("cpu", "cpu_flags", "cores", "loadavg_1_5_15")}
        | {"threads": a.threads},
        "n": a.n,
        "n_general": len(general),
        "variants": {},
    }
    fp32_base = None
    if a.fp32_from is not None:
        other = json.loads(a.fp32_from.read_text())
        same = {k: other.get(k) == record[k] for k in ("split", "n", "n_general", "fingerprint")}
        if not all(same.values()) or "fp32" not in other["variants"] or "base_tokens" not in other["variants"]["fp32"]:
            raise SystemExit(
                f"--fp32-from {a.fp32_from}: needs an fp32 variant (with its base tokens) on the same split, n, "
                f"n_general and bundle; matches: {same}"
            )
        record["fp32_from"] = {"record": str(a.fp32_from), "command": other["command"]}
        record["reference_fp32"] = other["variants"]["fp32"]
        fp32_base = record["reference_fp32"]["base_tokens"]
    for name in a.variants:
        dtype, scheme, head = VARIANTS[name]
        t0 = time.perf_counter()
        mm = load(None, dtype=dtype, quantization=scheme, quantize_lm_head=head)
        eng = Engine(mm, EngineConfig(max_num_seqs=32))
        params = [
            SamplingParams(max_new_tokens=MAX_NEW_TOKENS.get(answer_kind(it.task, it.target), 64)) for it in items
        ]
        outs = eng.generate([encode_prompt(mm, it.input) for it in items], params)
        texts = [mm.tokenizer.decode(o.new_token_ids, skip_special_tokens=True) for o in outs]
        hits = [score(it.task, txt, it.target)[0] for it, txt in zip(items, texts)]
        v: dict = {
            "dtype": str(dtype).removeprefix("torch."),
            "quantization": scheme,
            "lm_head_int8": isinstance(mm.model.get_output_embeddings(), QuantizedLinear),
            "skills": {},
        }
        v["hits"] = {}  # per item, in the split's order: "1" right, "0" wrong (for the paired intervals)
        for t in tasks:
            mine = [h for it, h in zip(items, hits) if it.task == t]
            v["skills"][t] = round(100.0 * sum(mine) / len(mine), 2)
            v["hits"][t] = "".join("1" if h else "0" for h in mine)
        rows = [encode_prompt(mm, q) for q in general]
        gp = SamplingParams(max_new_tokens=DEFAULT_TOKENS)
        routed = [o.new_token_ids for o in eng.generate(rows, gp)]
        base = [o.new_token_ids for o in eng.generate(rows, gp, routing="none")]
        if name == "fp32":
            fp32_base = base
            v["base_tokens"] = base  # the general answers without adapters, for --fp32-from in another run
        kept = [x == y for x, y in zip(routed, base)]
        v["general"] = {
            "retention": round(100.0 * sum(kept) / len(rows), 2),
            "retention_ci95": [round(100.0 * x, 2) for x in wilson95(sum(kept), len(rows))],
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
        finish(record, tasks, a.json)  # after every variant: a run stopped early keeps what it measured
    print(json.dumps(record))
    return 0


def finish(record: dict, tasks: list[str], path: Path | None) -> None:
    """Add the differences from float32 (with their paired 95% intervals) and the load; write the record to path."""
    ref = record["variants"].get("fp32") or record.get("reference_fp32")
    if ref:
        for v in record["variants"].values():
            v["skills_vs_fp32"] = {t: round(v["skills"][t] - ref["skills"][t], 2) for t in tasks}
            v["skills_vs_fp32_ci95"] = {t: paired_ci95(v["hits"][t], ref["hits"][t]) for t in tasks}
    record["machine"]["loadavg_end"] = os.getloadavg()
    if path:
        path.write_text(json.dumps(record, indent=1) + "\n")


if __name__ == "__main__":
    raise SystemExit(main())
