"""Choose the served hybrid chooser's pool size on validation: how many user turns the base model must write for the
adapters' confidence statistics, the part of `--router hybrid`'s start-up calibration that grows with the pool.

    python -m experiments.hybrid_pool_size --json docs/hybrid_pool_size_choice.json --cache runs/hybrid_cache \
        [--sizes 50,100,200,400,800] [--full-n 800] [--threads 1]

--cache holds the 800-turn pool: `experiments/hybrid_serve_startup.py --cache runs/hybrid_cache --pool-n 800`.

Inputs, none labelled: the served calibration's cache (--cache, experiments/hybrid_serve_startup.py: the 800-turn pool
and each adapter's first-answer-token entropy on every pooled turn, in the order drawn; the first n turns of that
pool are the pool of n, molora.calibration.sample_pool) and the validation prompts of
experiments/arrow_variants_choose.py in the same order (40 per skill, the 60 general prompts, 40 two-skill items by
turn), whose Arrow claimed shares (molora.routing.hybrid.arrow_claim_share, the served setting) and per-adapter
entropies are computed here. For each pool size the chooser's statistics come from the pool's first n turns and
every validation prompt is decided by the served rule (molora.routing.hybrid.hybrid_decide, z_or 3.5), scored with
experiments/arrow_variants_choose.py's `hit_rates` (the same items and rule as experiments/datafree_hybrid.py). Also
checked
on the same prompts: the served per-request path's `joint_pass` (one forward of each prompt on the base model and
every adapter together) against the separate passes the validation used, picks and largest differences.

Rule, fixed before any size was scored: the smallest size whose skills mean is within 1.25 points (two skill items
of 160) of the 800-turn pool's and which keeps >= 95% of general prompts on the base model.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from experiments.arrow_variants_choose import hit_rates


def val_prompts(mm, n_val: int = 40, n_mixed: int = 40) -> tuple[list[str], list[list[int]]]:  # noqa: ANN001
    """(labels, token ids) of arrow_variants_choose's validation prompts, in its order, calibration rows left out."""
    from molora.data.general import general_split
    from molora.eval.heldout import held_out, held_out_mixed, training_inputs
    from molora.eval.runner import _ids, template_of, turn_text

    banned = training_inputs(mm.bundle)
    tasks = [ad.tasks[0] for ad in mm.bundle.adapters if ad.tasks]
    template, end = template_of(mm)
    out: list[tuple[str, list[int]]] = []
    for t in tasks:
        items, _ = held_out(t, n_val, banned, split="val")
        out += [(t, _ids(mm.tokenizer, turn_text(template, it.input))) for it in items]
    out += [("general", _ids(mm.tokenizer, turn_text(template, r["prompt"]))) for r in general_split()["val"]]
    for row in held_out_mixed(tasks, n_mixed, banned, split="val"):
        (p1, p2) = row["parts"][:2]
        first = _ids(mm.tokenizer, turn_text(template, p1["input"], p1["target"], end, last=False))
        out.append(("mixed1:" + p1["task"], _ids(mm.tokenizer, turn_text(template, p1["input"]))))
        out.append(("mixed2:" + p2["task"], first + _ids(mm.tokenizer, turn_text(template, p2["input"]))))
    return [lab for lab, _ in out], [ids for _, ids in out]


def pool_entropies(cache: Path, names: list[str], n: int) -> torch.Tensor:
    """[n, K]: the cached entropies of the pool of n turns, adapters in `names` order."""
    pools = [p for p in cache.glob("pool-*.json") if len(json.loads(p.read_text())["prompts"]) == n]
    if len(pools) != 1:
        raise SystemExit(f"{cache}: want one cached pool of {n} turns, found {len(pools)}")
    key = pools[0].stem.removeprefix("pool-")
    by_name = {d["adapter"]: d["entropy"] for d in (json.loads(p.read_text()) for p in cache.glob(f"entropy-{key}-*"))}
    missing = [x for x in names if x not in by_name]
    if missing:
        raise SystemExit(f"{cache}: no cached entropies of {missing} over pool {key}")
    return torch.tensor([by_name[x] for x in names], dtype=torch.float64).T


def chosen_n(grid: list[dict], full_n: int) -> int:
    """The rule (module docstring): the smallest size within 1.25 points of the full pool's skills mean and keeping
    >= 95% general; the full pool if none."""
    top = next(r for r in grid if r["pool_n"] == full_n)
    ok = [r["pool_n"] for r in grid if r["skills_mean"] >= top["skills_mean"] - 1.25 and r["general"] >= 95]
    return min(ok) if ok else full_n


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--json", required=True)
    ap.add_argument("--cache", required=True)
    ap.add_argument("--sizes", default="50,100,200,400,800")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument(
        "--full-n", type=int, default=800, help="the cached pool's size: the pool the validation choice was made with"
    )
    ap.add_argument("--wait-s", type=float, default=0.0, help="wait this long for the cache to be complete")
    ap.add_argument("--val-entropy", default="runs/hybrid_val_entropy.pt", help="cache of the validation entropies")
    a = ap.parse_args(argv)
    torch.set_num_threads(a.threads)
    t0 = time.time()
    from molora.bench.common import machine_info
    from molora.bundle import load
    from molora.routing.confidence import ConfidenceChooser, first_token_entropy
    from molora.routing.hybrid import HybridChooser, HybridSettings, arrow_claim_share, hybrid_decide, joint_pass
    from molora.userbundle import router_entry

    sizes = sorted(int(s) for s in a.sizes.split(","))
    mm = load(None)
    names = list(mm.adapter_names)
    tasks = [ad.tasks[0] for ad in mm.bundle.adapters if ad.tasks]
    own = {t: names.index(mm.bundle.adapter_for_task(t)) for t in tasks}
    labels, rows = val_prompts(mm)
    s = HybridSettings.from_json(router_entry("hybrid"))
    unused = ConfidenceChooser(tuple(names), (0.0,) * len(names), (1.0,) * len(names), 0.0, 0.0)
    hybrid = HybridChooser(unused, s.arrow, s.z_or, s.z_floor).bind(mm)
    share = arrow_claim_share(hybrid._router(mm), mm, rows)
    if Path(a.val_entropy).is_file():
        ent = torch.load(a.val_entropy)
    else:
        ent = first_token_entropy(mm, rows)
        Path(a.val_entropy).parent.mkdir(parents=True, exist_ok=True)
        torch.save(ent, a.val_entropy)
    t1 = time.time()
    j_share, j_ent = joint_pass(hybrid._router(mm), mm, rows, list(range(len(names))))
    joint_s = time.time() - t1
    deadline = time.time() + a.wait_s  # the pool's entropies may still be being written by the start-up script
    while True:
        try:
            full = pool_entropies(Path(a.cache), names, a.full_n)
            break
        except SystemExit:
            if time.time() > deadline:
                raise
            time.sleep(20)
    grid = []
    for n in sizes:
        conf = ConfidenceChooser.from_pool(names, full[:n], z_min=0.0, margin=0.0)
        dest = hybrid_decide(share, conf.zscores(ent), s.arrow.prompt_share, s.z_or, s.z_floor)
        grid.append({"pool_n": n, **hit_rates(labels, dest, tasks, own)})
    conf = ConfidenceChooser.from_pool(names, full[: chosen_n(grid, a.full_n)], z_min=0.0, margin=0.0)
    sep = hybrid_decide(share, conf.zscores(ent), s.arrow.prompt_share, s.z_or, s.z_floor)
    one = hybrid_decide(j_share, conf.zscores(j_ent), s.arrow.prompt_share, s.z_or, s.z_floor)
    joint = {
        "note": "molora.routing.hybrid.joint_pass (one forward of each prompt on the base and every adapter) "
        "against the separate passes, at the chosen pool size, on every validation prompt",
        "picks_differ": sum(x != y for x, y in zip(sep, one)),
        "max_abs_share_diff": round(float((share - j_share).abs().max()), 6),
        "max_abs_entropy_diff": round(float((ent - j_ent).abs().max()), 6),
        "joint_seconds": round(joint_s, 1),
    }
    chosen = next(r for r in grid if r["pool_n"] == chosen_n(grid, a.full_n))
    validated = json.loads(Path("docs/datafree_hybrid_choice.json").read_text())["chosen"]
    committed = json.loads(Path("docs/datafree_confidence/confidence.json").read_text())
    served = ConfidenceChooser.from_pool(names, full, z_min=0.0, margin=0.0)
    rec = {
        "command": f"python -m experiments.hybrid_pool_size --json {a.json} --cache {a.cache} --sizes {a.sizes} "
        f"--threads {a.threads}",
        "date": time.strftime("%Y-%m-%d"),
        "machine": machine_info(),
        "rule": "smallest pool whose validation skills mean is within 1.25 points of the full pool's and keeps "
        ">= 95% of general prompts on the base model",
        "setting": {**router_entry("hybrid"), "pool_n": a.full_n},
        "n_val_prompts": len(rows),
        "grid": grid,
        "chosen": chosen,
        "joint_pass_check": joint,
        "validated_choice_row": {k: validated[k] for k in grid[0] if k in validated},
        "served_pool_stats": {"mean": [round(x, 4) for x in served.mean], "std": [round(x, 4) for x in served.std]},
        "committed_pool_stats": {
            "mean": [round(x, 4) for x in committed["mean"]],
            "std": [round(x, 4) for x in committed["std"]],
        },
        "seconds": round(time.time() - t0, 1),
    }
    Path(a.json).write_text(json.dumps(rec, indent=1) + "\n")
    print(json.dumps({"grid": grid, "chosen": chosen["pool_n"]}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
