"""Two-skill prompts on the default bundle: a 50/50 static mix, per-token routing, each adapter alone, the base.

Writes docs/mix_use.json:

    nice -n 5 .venv/bin/python -m experiments.mix_use --json docs/mix_use.json

Items: two-skill rows (`molora.data.skills.generate_mixed` over the bundle's skills, seeds of this script's own,
MIX_USE_SEEDS), any row with a part whose question is in the bundle's training files dropped; 40 validation rows and
60 test rows. Each row is one prompt with both questions (the joiner below) in the bundle's template, answered once,
greedy, through the engine as `molora serve` runs it, under five routings of the same request:

    mix        {"molora": {"mix": {A: 0.5, B: 0.5}}}: every token on the two skills' adapters, half each
    routed     the bundle's learned router, per token (routing "auto")
    adapter_a  pinned to the first question's adapter; adapter_b: to the second's
    base       no adapter (routing "none")

Each part is scored on its own: the reply is cut by `molora.data.mixed.split_answers` and each piece scored as
`molora eval` scores that skill (`molora.eval.tasks.score_item`, strict). Chosen on validation, per routing, by the mean
part accuracy (ties: the shorter budget, then the first joiner): the joiner ("numbered": `render_mixed`'s "Answer each
question on its own line ... Question 1: ... Question 2: ..."; "plain": the two questions separated by a blank line)
and the answer budget (32 or 64 new tokens: the 64-token greedy answer cut at 32 tokens is the greedy answer of a
32-token budget). Test is scored once, with each routing's choice. Ends with one JSON line (also written to --json).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

SPLITS = {"validation": 40, "test": 60}
MIX_USE_SEEDS = {"validation": 9_000_000 + 900_000, "test": 9_000_000 + 900_100}
JOINERS = ("numbered", "plain")
BUDGETS = (32, 64)
ROUTINGS = ("mix", "routed", "adapter_a", "adapter_b", "base")


def rows_of(split: str, tasks: list[str], banned: set[str], n: int | None = None) -> list[dict]:
    """The split's first n (default: SPLITS[split]) two-skill rows, none with a part the bundle trained on."""
    from molora.data.skills import generate_mixed

    n = SPLITS[split] if n is None else n
    rows = generate_mixed(tasks, 3 * SPLITS[split], seed=MIX_USE_SEEDS[split])
    return [r for r in rows if not any(p["input"] in banned for p in r["parts"])][:n]


def prompt_of(row: dict, joiner: str) -> str:
    from molora.data.mixed import render_mixed

    if joiner == "numbered":
        return render_mixed(row["parts"]).prompt
    return "\n\n".join(p["input"] for p in row["parts"])


def request_of(routing: str, row: dict, adapter_for) -> dict:
    """add_request's routing keywords for one routing of one row."""
    a, b = (adapter_for(p["task"]) for p in row["parts"])
    return {
        "mix": {"mix": {a: 0.5, b: 0.5}},
        "routed": {"routing": "auto"},
        "adapter_a": {"adapter": a},
        "adapter_b": {"adapter": b},
        "base": {"routing": "none"},
    }[routing]


def answer(engine, mm, rows: list[dict], joiners: dict[str, list[str]], budget: int) -> dict:
    """{routing: {joiner: [token ids per row]}} for every routing and its joiners, in one engine.generate."""
    from molora.config import SamplingParams
    from molora.prompts import encode_prompt

    jobs = [(r, j, i) for r in ROUTINGS for j in joiners[r] for i in range(len(rows))]
    kw: dict[str, list] = {"routing": [], "adapter": [], "mix": []}
    for r, _, i in jobs:
        req = request_of(r, rows[i], mm.bundle.adapter_for_task)
        kw["routing"].append(req.get("routing", "auto"))
        kw["adapter"].append(req.get("adapter"))
        kw["mix"].append(req.get("mix"))
    prompts = [encode_prompt(mm, prompt_of(rows[i], j)) for _, j, i in jobs]
    outs = engine.generate(prompts, SamplingParams(max_new_tokens=budget), **kw)
    got: dict = {r: {j: [None] * len(rows) for j in joiners[r]} for r in ROUTINGS}
    for (r, j, i), o in zip(jobs, outs):
        if o.error is not None:
            raise SystemExit(f"{r} / {j} / row {i}: {o.error}")
        got[r][j][i] = o.new_token_ids
    return got


def scores(mm, rows: list[dict], ids: list[list[int]], budget: int) -> list[list[bool]]:
    """[row][part] strict hits of the answers cut at `budget` tokens."""
    from molora.data.mixed import split_answers
    from molora.eval.tasks import EvalItem, score_item

    out = []
    for row, a in zip(rows, ids):
        text = mm.tokenizer.decode(a[:budget], skip_special_tokens=True)
        pieces = split_answers(text, len(row["parts"]))
        out.append(
            [score_item(EvalItem(p["task"], p["input"], p["target"]), s)[0] for p, s in zip(row["parts"], pieces)]
        )
    return out


def summary(hits: list[list[bool]]) -> dict:
    parts = [h for row in hits for h in row]
    return {
        "part_accuracy": round(100.0 * sum(parts) / len(parts), 2),
        "both_right": round(100.0 * sum(all(row) for row in hits) / len(hits), 2),
        "hits": ["".join("1" if h else "0" for h in row) for row in hits],
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", type=Path, default=Path("docs/mix_use.json"))
    ap.add_argument("--threads", type=int, default=2)
    a = ap.parse_args(argv)
    torch.set_num_threads(a.threads)
    torch.manual_seed(0)

    from molora.bench.common import machine_info
    from molora.bundle import load
    from molora.engine import Engine, EngineConfig
    from molora.eval.heldout import fingerprint, training_inputs

    mm = load(None)
    bundle = mm.bundle
    tasks = [x.tasks[0] for x in bundle.adapters if x.tasks]
    banned = training_inputs(bundle)
    engine = Engine(mm, EngineConfig(max_num_seqs=32, enable_prefix_caching=False))
    record: dict = {
        "what": "two-skill prompts on the default bundle: a 50/50 mix of the two skills' adapters against per-token "
        "learned routing, each adapter alone and the base model; strict accuracy of each part",
        "command": "python -m experiments.mix_use " + " ".join(argv if argv is not None else sys.argv[1:]),
        "date": time.strftime("%Y-%m-%d"),
        "machine_info": machine_info() | {"threads": a.threads},
        "bundle": bundle.name,
        "fingerprint": fingerprint(bundle),
        "skills": tasks,
        "seeds": MIX_USE_SEEDS,
        "joiners": list(JOINERS),
        "budgets": list(BUDGETS),
        "routings": list(ROUTINGS),
    }
    t0 = time.perf_counter()
    try:
        val = rows_of("validation", tasks, banned)
        got = answer(engine, mm, val, {r: list(JOINERS) for r in ROUTINGS}, max(BUDGETS))
        choice, grid = {}, {}
        for r in ROUTINGS:
            grid[r] = {}
            best = None
            for b in BUDGETS:
                for j in JOINERS:
                    s = summary(scores(mm, val, got[r][j], b))
                    grid[r][f"{j}/{b}"] = {k: v for k, v in s.items() if k != "hits"}
                    if best is None or s["part_accuracy"] > best[0]:
                        best = (s["part_accuracy"], j, b)
            assert best is not None
            choice[r] = {"joiner": best[1], "max_new_tokens": best[2]}
        record["validation"] = {"n": len(val), "grid": grid, "choice": choice}
        record["validation_seconds"] = round(time.perf_counter() - t0, 1)

        t1 = time.perf_counter()
        test = rows_of("test", tasks, banned)
        got = answer(engine, mm, test, {r: [choice[r]["joiner"]] for r in ROUTINGS}, max(BUDGETS))
        record["test"] = {
            "n": len(test),
            "pairs": sorted({" + ".join(sorted(p["task"] for p in row["parts"])) for row in test}),
            "tasks": [[p["task"] for p in row["parts"]] for row in test],  # each row's skills, in part order
            "results": {
                r: choice[r] | summary(scores(mm, test, got[r][choice[r]["joiner"]], choice[r]["max_new_tokens"]))
                for r in ROUTINGS
            },
            "examples": {  # the first three replies per routing, as scored (for a reader to see what a miss is)
                r: [
                    mm.tokenizer.decode(ids[: choice[r]["max_new_tokens"]], skip_special_tokens=True)
                    for ids in got[r][choice[r]["joiner"]][:3]
                ]
                for r in ROUTINGS
            },
            "targets": [[p["target"] for p in row["parts"]] for row in test[:3]],
        }
        record["test_seconds"] = round(time.perf_counter() - t1, 1)
    finally:
        engine.close()
    record["machine_info"]["loadavg_end"] = machine_info()["loadavg_1_5_15"]
    a.json.write_text(json.dumps(record, indent=1) + "\n")
    print(json.dumps({r: v["part_accuracy"] for r, v in record["test"]["results"].items()}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
