"""Greedy outputs of the default bundle on a quantized base against float32, on a few validation items per skill.

    python scripts/quant_quality.py [--per-skill 4] [--schemes int8] [--json docs/quant_quality.json]

For each skill task of the default bundle, `--per-skill` validation items (molora.data.skills.generate with the
validation seed EVAL_SEED_BASE + 500 + the task's index, as molora.routing.learned's choices were made on; no test
item), each prompt run greedily through the engine with the bundle's own routing, once on the float32 base and once
per quantized base. Records per scheme: the share of items whose answer text equals float32's, and the items scored
correct (strict) on each base. A spot check, not the skill re-measurement of issue 38 (validation then test once).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent


def answers(scheme: str | None, prompts: list[str], max_new: int) -> list[str]:
    from molora.bundle import encode_prompt, load
    from molora.config import SamplingParams
    from molora.engine import Engine, EngineConfig

    mm = load(None, quantization=scheme)
    eng = Engine(mm, EngineConfig(max_num_seqs=len(prompts)))
    outs = eng.generate([encode_prompt(mm, p) for p in prompts], SamplingParams(max_new_tokens=max_new))
    return [mm.tokenizer.decode(o.new_token_ids, skip_special_tokens=True) for o in outs]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--per-skill", type=int, default=4)
    p.add_argument("--schemes", nargs="+", default=["int8"], choices=["int8", "int4"])
    p.add_argument("--max-new", type=int, default=96)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--json", type=Path, default=None)
    a = p.parse_args(argv)
    torch.set_num_threads(a.threads)
    sys.path.insert(0, str(ROOT))
    from molora.bundle import default_bundle_dir, read_bundle
    from molora.data.skills import EVAL_SEED_BASE, generate
    from molora.eval.tasks import score

    tasks = [t for entry in read_bundle(default_bundle_dir()).adapters for t in entry.tasks]
    items = [it for i, t in enumerate(tasks) for it in generate(t, a.per_skill, seed=EVAL_SEED_BASE + 500 + i)]
    prompts = [it.input for it in items]
    ref = answers(None, prompts, a.max_new)
    record = {
        "items": len(items),
        "tasks": tasks,
        "per_skill": a.per_skill,
        "max_new": a.max_new,
        "fp32_correct": sum(score(it.task, r, it.target)[0] for it, r in zip(items, ref)),
        "schemes": {},
    }
    for scheme in a.schemes:
        out = answers(scheme, prompts, a.max_new)
        record["schemes"][scheme] = {
            "same_answer_as_fp32": sum(x == y for x, y in zip(ref, out)) / len(items),
            "correct": sum(score(it.task, r, it.target)[0] for it, r in zip(items, out)),
            "per_task_same": {t: sum(x == y for it, x, y in zip(items, ref, out) if it.task == t) for t in tasks},
        }
        print(
            f"{scheme}: same answer as fp32 {record['schemes'][scheme]['same_answer_as_fp32']:.2f}, correct "
            f"{record['schemes'][scheme]['correct']}/{len(items)} (fp32 {record['fp32_correct']})",
            flush=True,
        )
    if a.json:
        a.json.write_text(json.dumps(record, indent=1) + "\n")
    print(json.dumps(record))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
