"""Write the data-free pool: user turns the base model writes itself (molora.train.datafree.sample_pool), none equal
to a validation or test item of any skill, two-skill item or general prompt.

    .venv/bin/python -m experiments.datafree_pool --out runs/datafree_pool.json [--n 800] [--seed 0]
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path


def eval_inputs(mm) -> set[str]:  # noqa: ANN001
    """Every validation and test prompt the evaluations use (skills, two-skill parts, general)."""
    from molora.data.general import general_split
    from molora.eval.heldout import held_out, held_out_mixed, training_inputs

    banned = training_inputs(mm.bundle)
    tasks = [ad.tasks[0] for ad in mm.bundle.adapters if ad.tasks]
    out = {it.input for t in tasks for s in ("val", "test") for it in held_out(t, 100, banned, split=s)[0]}
    out |= {
        p["input"] for s in ("val", "test") for r in held_out_mixed(tasks, 100, banned, split=s) for p in r["parts"]
    }
    out |= {r["prompt"] for s in ("val", "test") for r in general_split()[s]}
    return out


def main(argv: list[str] | None = None) -> int:
    import torch

    from molora.bundle import load
    from molora.train.datafree import sample_pool

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--n", type=int, default=800)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--batch", type=int, default=128)
    ap.add_argument("--max-new-tokens", type=int, default=48)
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--threads", type=int, default=1)
    a = ap.parse_args(argv)
    torch.set_num_threads(a.threads)
    t0 = time.time()
    mm = load(None)
    excluded = eval_inputs(mm)
    pool = sample_pool(
        mm,
        a.n,
        seed=a.seed,
        exclude=excluded,
        batch=a.batch,
        max_new_tokens=a.max_new_tokens,
        temperature=a.temperature,
    )
    rec = {
        "command": f"python -m experiments.datafree_pool --out {a.out} --n {a.n} --seed {a.seed} --batch {a.batch} "
        f"--max-new-tokens {a.max_new_tokens} --temperature {a.temperature}",
        "n_excluded_eval_inputs": len(excluded),
        "seconds": round(time.time() - t0, 1),
        "prompts": pool,
    }
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(rec, indent=1) + "\n")
    print(len(pool), rec["seconds"])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
