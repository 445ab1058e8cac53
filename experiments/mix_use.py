"""Two-skill conversations on the default bundle: a 50/50 static mix, per-token routing, each adapter alone, the base.

Writes docs/mix_use.json:

    nice -n 19 .venv/bin/python -m experiments.mix_use --json docs/mix_use.json [--validation N] [--test N]

Items: two-skill rows (`molora.data.skills.generate_mixed` over the bundle's skills, seeds of this script's own,
MIX_USE_SEEDS), any row with a part whose question is in the bundle's training files dropped. A row is one
conversation of two user turns of two different skills a and b: turn 1 asks question A, the model's reply is
generated; turn 2 asks question B with turn 1 and its reply in the context, rendered as the server renders a two-turn
chat (the tokenizer's chat template over [user A, assistant reply, user B]; turn 1 alone as the server renders one user
message: the bundle's prompt template), and the reply to turn 2 is generated. Both turns run greedy through the engine
under one routing, the same for the whole sequence:

    mix        {"molora": {"mix": {a: 0.5, b: 0.5}}}: every token on a's and b's adapters, half each
    routed     the bundle's learned router, per token (routing "auto")
    adapter_a  pinned to a's adapter; adapter_b: to b's
    base       no adapter (routing "none")

Each reply is scored by its own skill as `molora eval` scores it (`molora.eval.tasks.score_item`, strict), with that
skill's eval answer budget (`molora.eval.runner.MAX_NEW_TOKENS` of its answer kind), ending at the bundle's stop
tokens. Nothing is chosen: the budgets are eval's, the rendering the server's, decoding greedy; the validation rows,
when asked for, are scored beside test as a second sample and choose nothing; test is scored once. Ends with one JSON
line (the record is also written to --json, after each split).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

SPLITS = {"validation": 30, "test": 60}
MIX_USE_SEEDS = {"validation": 9_000_000 + 900_000, "test": 9_000_000 + 900_100}
ROUTINGS = ("mix", "routed", "adapter_a", "adapter_b", "base")


def rows_of(split: str, tasks: list[str], banned: set[str], n: int | None = None) -> list[dict]:
    """The split's first n (default: SPLITS[split]) two-skill rows, none with a part the bundle trained on."""
    from molora.data.skills import generate_mixed

    n = SPLITS[split] if n is None else n
    rows = generate_mixed(tasks, 3 * max(n, SPLITS[split]), seed=MIX_USE_SEEDS[split])
    return [r for r in rows if not any(p["input"] in banned for p in r["parts"])][:n]


def request_of(routing: str, row: dict, adapter_for) -> dict:
    """add_request's routing keywords for one routing of one row (a: turn 1's skill, b: turn 2's)."""
    a, b = (adapter_for(p["task"]) for p in row["parts"])
    return {
        "mix": {"mix": {a: 0.5, b: 0.5}},
        "routed": {"routing": "auto"},
        "adapter_a": {"adapter": a},
        "adapter_b": {"adapter": b},
        "base": {"routing": "none"},
    }[routing]


def budget_of(part: dict) -> int:
    """The new-token budget `molora eval` gives this part's skill."""
    from molora.eval.runner import MAX_NEW_TOKENS
    from molora.eval.tasks import answer_kind

    return MAX_NEW_TOKENS.get(answer_kind(part["task"], part["target"]), 64)


def turn_prompt(mm, row: dict, turn: int, replies: list[str]) -> list[int]:
    """Token ids of turn `turn`'s prompt as the server renders the chat: one user message through the bundle's
    prompt template; two turns (A, the reply to A, B) through the tokenizer's chat template."""
    from molora.prompts import encode_prompt

    parts = row["parts"]
    if turn == 0:
        return encode_prompt(mm, parts[0]["input"])
    msgs = [
        {"role": "user", "content": parts[0]["input"]},
        {"role": "assistant", "content": replies[0]},
        {"role": "user", "content": parts[1]["input"]},
    ]
    text = mm.tokenizer.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
    return list(mm.tokenizer.encode(text, add_special_tokens=False))


def converse(engine, mm, rows: list[dict]) -> dict:
    """{routing: [{"replies": [text, text], "cut": [bool, bool], "tokens": [n, n]} per row]}: both turns of every
    row under every routing, each turn in one engine.generate over all routings and rows."""
    from molora.config import SamplingParams
    from molora.prompts import stop_ids

    stops = tuple(stop_ids(mm))
    jobs = [(r, i) for r in ROUTINGS for i in range(len(rows))]
    got: dict = {r: [{"replies": [], "cut": [], "tokens": []} for _ in rows] for r in ROUTINGS}
    for turn in (0, 1):
        kw: dict[str, list] = {"routing": [], "adapter": [], "mix": []}
        for r, i in jobs:
            req = request_of(r, rows[i], mm.bundle.adapter_for_task)
            kw["routing"].append(req.get("routing", "auto"))
            kw["adapter"].append(req.get("adapter"))
            kw["mix"].append(req.get("mix"))
        prompts = [turn_prompt(mm, rows[i], turn, got[r][i]["replies"]) for r, i in jobs]
        params = [
            SamplingParams(max_new_tokens=budget_of(rows[i]["parts"][turn]), stop_token_ids=stops) for _, i in jobs
        ]
        outs = engine.generate(prompts, params, **kw)
        for (r, i), o in zip(jobs, outs):
            if o.error is not None:
                raise SystemExit(f"{r} / row {i} / turn {turn + 1}: {o.error}")
            g = got[r][i]
            g["replies"].append(mm.tokenizer.decode(o.new_token_ids, skip_special_tokens=True))
            g["cut"].append(o.finish_reason == "length")
            g["tokens"].append(len(o.new_token_ids))
    return got


def hits_of(rows: list[dict], convs: list[dict]) -> list[str]:
    """Per row "11"/"10"/...: turn 1's and turn 2's reply right, each scored strictly by its own skill."""
    from molora.eval.tasks import EvalItem, score_item

    return [
        "".join(
            "1" if score_item(EvalItem(p["task"], p["input"], p["target"]), reply)[0] else "0"
            for p, reply in zip(row["parts"], c["replies"])
        )
        for row, c in zip(rows, convs)
    ]


def summary(hits: list[str], convs: list[dict]) -> dict:
    n = len(hits)
    return {
        "turn1_accuracy": round(100.0 * sum(h[0] == "1" for h in hits) / n, 2),
        "turn2_accuracy": round(100.0 * sum(h[1] == "1" for h in hits) / n, 2),
        "both_right": round(100.0 * hits.count("11") / n, 2),
        "hits": hits,
        "cut_by_budget": [sum(c["cut"][t] for c in convs) for t in (0, 1)],  # replies that ran out of tokens
        "mean_tokens": [round(sum(c["tokens"][t] for c in convs) / n, 1) for t in (0, 1)],
    }


def run_split(engine, mm, rows: list[dict], chunk: int, done) -> dict:
    """Both turns of `rows` under every routing, `chunk` rows at a time; after each chunk `done(result so far)` is
    called with the rows answered so far (rows_of is prefix-stable: the first k rows of a longer split are the rows
    of a k-row split), so a run stopped between chunks leaves a record of the rows it finished."""
    t0 = time.perf_counter()
    got: dict = {r: [] for r in ROUTINGS}
    out: dict = {}
    for lo in range(0, len(rows), chunk):
        part = converse(engine, mm, rows[lo : lo + chunk])
        for r in ROUTINGS:
            got[r] += part[r]
        done_rows = rows[: len(got[ROUTINGS[0]])]
        out = {
            "n": len(done_rows),
            "asked": len(rows),
            "tasks": [[p["task"] for p in row["parts"]] for row in done_rows],  # each row's skills, in turn order
            "budgets": [[budget_of(p) for p in row["parts"]] for row in done_rows],
            "results": {r: summary(hits_of(done_rows, got[r]), got[r]) for r in ROUTINGS},
            "examples": {r: [c["replies"] for c in got[r][:2]] for r in ROUTINGS},  # first two rows' replies, as scored
            "targets": [[p["target"] for p in row["parts"]] for row in done_rows[:2]],
            "seconds": round(time.perf_counter() - t0, 1),
        }
        done(out)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", type=Path, default=Path("docs/mix_use.json"))
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--validation", type=int, default=SPLITS["validation"], help="validation rows (0: none)")
    ap.add_argument("--test", type=int, default=SPLITS["test"], help="test rows (0: none)")
    ap.add_argument("--max-num-seqs", type=int, default=64)
    ap.add_argument("--chunk", type=int, default=10, help="rows per engine.generate; the record is written after each")
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
    engine = Engine(mm, EngineConfig(max_num_seqs=a.max_num_seqs, enable_prefix_caching=False))
    record: dict = {
        "what": "two-skill conversations on the default bundle (turn 1 asks skill a, turn 2 skill b with turn 1 and "
        "its reply in the context): a 50/50 mix of a's and b's adapters against per-token learned routing, each "
        "adapter alone and the base model, one routing per whole conversation; each reply scored strictly by its own "
        "skill",
        "command": "python -m experiments.mix_use " + " ".join(argv if argv is not None else sys.argv[1:]),
        "date": time.strftime("%Y-%m-%d"),
        "machine_info": machine_info() | {"threads": a.threads},
        "bundle": bundle.name,
        "fingerprint": fingerprint(bundle),
        "skills": tasks,
        "seeds": MIX_USE_SEEDS,
        "routings": list(ROUTINGS),
        "max_num_seqs": a.max_num_seqs,
    }
    try:
        for split, n in (("validation", a.validation), ("test", a.test)):
            if n <= 0:
                continue

            def done(result: dict, split: str = split) -> None:
                record[split] = result
                record["machine_info"]["loadavg_end"] = machine_info()["loadavg_1_5_15"]
                a.json.write_text(json.dumps(record, indent=1) + "\n")
                print(split, result["n"], "rows", result["seconds"], "s", file=sys.stderr, flush=True)

            run_split(engine, mm, rows_of(split, tasks, banned, n), a.chunk, done)
    finally:
        engine.close()
    last = record.get("test") or record.get("validation") or {"results": {}}
    res = last["results"]
    print(json.dumps({r: [v["turn1_accuracy"], v["turn2_accuracy"], v["both_right"]] for r, v in res.items()}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
