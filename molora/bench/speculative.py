"""Speculative decoding benchmark: output tokens/s with and without drafts, each token and its adapter compared.

    python -m molora.bench.engine --speculative '{"method": "ngram", "num_speculative_tokens": 4}' [--json OUT]

Setup: the default bundle (SmolLM2-135M-Instruct with its four skill adapters under its learned router, carry and
probe included), the bundle's prompt template and stop ids, greedy. Prompts: `--items` items of each of the four
skills, drawn with molora.data.skills.generate (seed 7919, not the recipe's seeds), and as many general chat prompts
from the validation split of molora.data.general. Two batch sizes:
  batch 1    every prompt alone through Engine.generate, with and without speculation, the two variants alternating
             prompt by prompt (the first of each pair rotating)
  batch N    all the skill prompts of one round at once (--batch, default 32), the variants rotating per repetition:
             plain, speculation forced on every decoding request ("skills"), and speculation under the engine's own
             rule (speculative.MAX_DECODES: only while that few requests decode; "skills, default rule")
Reported per group (skills, chat; batch 1 and batch N): output tokens, seconds, tokens/s of each variant and their
ratio, the mean acceptance length (ids emitted per verified chunk), and how many tokens and adapters differ from
plain decoding (the goal is none). Ends with one JSON line. Knows the engine through its public API only.

    python -m molora.bench.engine --speculative JSON --carry-compare [--repeats R] [--json OUT]

compares the two treatments of a draft row whose carried decision was wrong (speculative config "molora": {"carry":
...}: "truncate", "rerun") at batch 1 instead: plain, truncate and rerun on every prompt, the order rotating prompt by
prompt, the whole round repeated R times; per group the median tokens/s of each variant over the rounds, the median
of the per-round ratios (rerun / truncate, each / plain), ids per verified chunk, carry cuts and reruns.
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from molora.config import SamplingParams
from molora.engine import Engine, EngineConfig
from molora.engine.speculative import SpeculativeConfig

SKILLS = ("object_counting", "multistep_arithmetic_two", "dyck_languages", "navigate")
SEED = 7919  # item seed of this bench (the recipe's training and eval items use others)


def prompts(mm: Any, items: int, chat: bool = True) -> dict[str, list[list[int]]]:
    """Token ids of `items` prompts per skill (group "skills"; skill after skill) and of as many general chat prompts
    (group "chat", unless chat=False)."""
    from molora.data.general import general_split
    from molora.data.skills import generate
    from molora.prompts import encode_prompt

    skills = [encode_prompt(mm, it.input) for task in SKILLS for it in generate(task, items, SEED)]
    rows = general_split()["val"][: len(SKILLS) * items] if chat else []
    chat = [encode_prompt(mm, r["prompt"]) for r in rows]
    return {"skills": skills, "chat": chat}


def _run(engine: Engine, batch: list[list[int]], params: SamplingParams) -> tuple[float, list[Any]]:
    t = time.perf_counter()
    outs = engine.generate(batch, params)
    return time.perf_counter() - t, outs


def compare(plain: list[Any], fast: list[Any]) -> dict[str, int]:
    """Tokens and adapters that differ between the two variants' outputs, position by position."""
    tok = ad = n = 0
    for a, b in zip(plain, fast):
        n += max(len(a.new_token_ids), len(b.new_token_ids))
        tok += sum(x != y for x, y in zip(a.new_token_ids, b.new_token_ids))
        tok += abs(len(a.new_token_ids) - len(b.new_token_ids))
        ad += sum(x != y for x, y in zip(a.token_adapters, b.token_adapters))
    return {"tokens": n, "tokens_differing": tok, "adapters_differing": ad}


def measure(
    mm: Any,
    spec: SpeculativeConfig,
    groups: dict[str, list[list[int]]],
    big: list[list[int]],
    new_tokens: int,
    repeats: int,
) -> dict:
    """Batch 1 over each group of `groups`, then the batch of `big` at once (module docstring)."""
    from molora.prompts import stop_ids

    batch = len(big)
    longest = max(len(p) for g in [*groups.values(), big] for p in g) + new_tokens + 8
    cfg = dict(max_num_seqs=batch, block_size=16, kv_budget_tokens=batch * (longest + 16), max_model_len=longest)
    cfg["enable_prefix_caching"] = False  # each variant computes every prompt, as a repetition would without a cache
    engines = {"plain": Engine(mm, EngineConfig(**cfg)), "spec": Engine(mm, EngineConfig(**cfg, speculative=spec))}
    # speculate at every batch size: the bench measures where verification pays (speculative.MAX_DECODES comes from it)
    engines["spec"].speculator.max_decodes = 1 << 30  # type: ignore[union-attr]
    engines["rule"] = Engine(mm, EngineConfig(**cfg, speculative=spec))  # the engine's own rule, as served
    params = SamplingParams(max_new_tokens=new_tokens, stop_token_ids=tuple(stop_ids(mm)))
    _run(engines["plain"], groups["skills"][:2], params)  # warm-up: kernels, packed weights
    _run(engines["spec"], groups["skills"][:2], params)
    out: dict[str, Any] = {}
    for name, group in groups.items():  # batch 1: prompt by prompt, the variants alternating
        secs = {"plain": 0.0, "spec": 0.0}
        outs: dict[str, list[Any]] = {"plain": [], "spec": []}
        before = engines["spec"].stats()["speculative"]
        for i, p in enumerate(group):
            for v in ("plain", "spec") if i % 2 == 0 else ("spec", "plain"):
                s, o = _run(engines[v], [p], params)
                secs[v] += s
                outs[v] += o
        out[f"b1_{name}"] = _summary(secs, outs, before, engines["spec"].stats()["speculative"])
        print(f"  batch 1 {name}: {out[f'b1_{name}']}", file=sys.stderr, flush=True)
    variants = ("plain", "spec", "rule")
    secs = dict.fromkeys(variants, 0.0)
    outs = {v: [] for v in variants}
    before = {v: engines[v].stats()["speculative"] for v in ("spec", "rule")}
    for r in range(repeats):  # batch N: the whole batch at once, the first variant rotating
        for k in range(len(variants)):
            v = variants[(r + k) % len(variants)]
            s, o = _run(engines[v], big, params)
            secs[v] += s
            if r == 0:
                outs[v] = o
    for v, key in (("spec", f"b{batch}_skills"), ("rule", f"b{batch}_skills, default rule")):
        pair = {"plain": secs["plain"], "spec": secs[v]}
        summary = _summary(
            pair, {"plain": outs["plain"], "spec": outs[v]}, before[v], engines[v].stats()["speculative"], scale=repeats
        )
        out[key] = summary
        print(f"  batch {batch} {key}: {summary}", file=sys.stderr, flush=True)
    return out


def _summary(secs: dict, outs: dict, before: dict, after: dict, scale: int = 1) -> dict:
    n = sum(len(o.new_token_ids) for o in outs["plain"]) * scale
    chunks = after["verified_chunks"] - before["verified_chunks"]
    drafted = after["drafted"] - before["drafted"]
    accepted = after["accepted"] - before["accepted"]
    emitted = (after["mean_acceptance_length"] or 0) * after["verified_chunks"] - (
        before["mean_acceptance_length"] or 0
    ) * before["verified_chunks"]
    return {
        "requests": len(outs["plain"]),
        "output_tokens": n,
        "plain_s": round(secs["plain"], 4),
        "spec_s": round(secs["spec"], 4),
        "plain_tok_s": round(n / secs["plain"], 2),
        "spec_tok_s": round(n / secs["spec"], 2),
        "speedup": round(secs["plain"] / secs["spec"], 4),
        "drafted": drafted,
        "accepted": accepted,
        "acceptance_rate": round(accepted / drafted, 4) if drafted else None,
        "mean_acceptance_length": round(emitted / chunks, 4) if chunks else None,
        **compare(outs["plain"], outs["spec"]),
    }


CARRY_VARIANTS = ("plain", "truncate", "rerun")


def measure_carry(mm: Any, spec: SpeculativeConfig, groups: dict[str, list[list[int]]], new_tokens: int, repeats: int):
    """Batch 1, plain against the two carry treatments, interleaved and repeated (module docstring)."""
    import dataclasses
    import statistics

    from molora.prompts import stop_ids

    longest = max(len(p) for g in groups.values() for p in g) + new_tokens + 8
    cfg = dict(max_num_seqs=1, block_size=16, kv_budget_tokens=longest + 16, max_model_len=longest)
    cfg["enable_prefix_caching"] = False
    engines = {"plain": Engine(mm, EngineConfig(**cfg))}
    for carry in ("truncate", "rerun"):
        engines[carry] = Engine(mm, EngineConfig(**cfg, speculative=dataclasses.replace(spec, carry=carry)))
    params = SamplingParams(max_new_tokens=new_tokens, stop_token_ids=tuple(stop_ids(mm)))
    for v in CARRY_VARIANTS:  # warm-up: kernels, packed weights
        _run(engines[v], groups["skills"][:2], params)
    out: dict[str, Any] = {}
    for name, group in groups.items():
        rounds: list[dict[str, float]] = []
        before = {v: engines[v].stats()["speculative"] for v in ("truncate", "rerun")}
        outs: dict[str, list[Any]] = {v: [] for v in CARRY_VARIANTS}
        n = 0
        for r in range(repeats):
            secs = dict.fromkeys(CARRY_VARIANTS, 0.0)
            for i, p in enumerate(group):
                k = (r * len(group) + i) % 3  # rotate which variant runs first
                for v in CARRY_VARIANTS[k:] + CARRY_VARIANTS[:k]:
                    t, o = _run(engines[v], [p], params)
                    secs[v] += t
                    if r == 0:
                        outs[v] += o
            n = sum(len(o.new_token_ids) for o in outs["plain"])
            rounds.append({v: n / secs[v] for v in CARRY_VARIANTS})
            print(
                f"  {name} round {r}: " + ", ".join(f"{v} {x:.2f} tok/s" for v, x in rounds[-1].items()),
                file=sys.stderr,
                flush=True,
            )
        med = statistics.median
        g: dict[str, Any] = {
            "requests": len(group),
            "output_tokens_per_round": n,
            "tok_s_rounds": rounds,
            "median_tok_s": {v: round(med(x[v] for x in rounds), 2) for v in CARRY_VARIANTS},
            "median_ratio_rerun_over_truncate": round(med(x["rerun"] / x["truncate"] for x in rounds), 4),
            "median_ratio_truncate_over_plain": round(med(x["truncate"] / x["plain"] for x in rounds), 4),
            "median_ratio_rerun_over_plain": round(med(x["rerun"] / x["plain"] for x in rounds), 4),
        }
        for v in ("truncate", "rerun"):
            a, b = before[v], engines[v].stats()["speculative"]
            chunks = b["verified_chunks"] - a["verified_chunks"]
            emitted = (b["mean_acceptance_length"] or 0) * b["verified_chunks"] - (
                a["mean_acceptance_length"] or 0
            ) * a["verified_chunks"]
            g[v] = {
                "verified_chunks": chunks,
                "ids_per_verified_chunk": round(emitted / chunks, 4) if chunks else None,
                "drafted": b["drafted"] - a["drafted"],
                "accepted": b["accepted"] - a["accepted"],
                "carry_cut_rows": b["carry_cut_rows"] - a["carry_cut_rows"],
                "carry_reruns": b["carry_reruns"] - a["carry_reruns"],
                "carry_rerun_rows": b["carry_rerun_rows"] - a["carry_rerun_rows"],
                **compare(outs["plain"], outs[v]),
            }
        out[f"b1_{name}"] = g
        print(f"  batch 1 {name}: {json.dumps(g)}", file=sys.stderr, flush=True)
    return out


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="molora bench engine --speculative", description=__doc__.split("\n")[0])
    ap.add_argument("--speculative", required=True, metavar="JSON", help="vLLM's speculative config (ngram, suffix)")
    ap.add_argument("--items", type=int, default=4, help="prompts per skill, and 4x as many chat prompts (default 4)")
    ap.add_argument("--new-tokens", type=int, default=96, help="greedy new tokens at most (default 96)")
    ap.add_argument("--batch", type=int, default=32, help="the large batch: skill items of its own (default 32)")
    ap.add_argument("--repeats", type=int, default=2, help="repetitions of the large batch (default 2)")
    ap.add_argument("--threads", type=int, default=0, help="torch CPU threads (default: torch's choice)")
    ap.add_argument("--json", metavar="OUT", help="also write the result JSON to this file")
    ap.add_argument(
        "--carry-compare",
        action="store_true",
        help='batch 1 only: plain against "molora": {"carry": "truncate"} and {"carry": "rerun"}, --repeats rounds',
    )
    argv_list = list(sys.argv[1:] if argv is None else argv)
    args = ap.parse_args(argv_list)
    spec = SpeculativeConfig.parse(args.speculative)
    if args.threads:
        torch.set_num_threads(args.threads)
    from molora.bench.common import machine_info
    from molora.bundle import load

    mm = load(None)
    groups = prompts(mm, args.items)
    machine = machine_info()
    res: dict[str, Any] = {
        "bench": "speculative_carry" if args.carry_compare else "speculative",
        "command": "python -m molora.bench.engine " + " ".join(shlex.quote(a) for a in argv_list),
        "cpu": machine["cpu"],
        "machine_info": machine,
        "speculative": json.loads(args.speculative),
        "items_per_skill": args.items,
        "new_tokens": args.new_tokens,
        "repeats": args.repeats,
        "threads": torch.get_num_threads(),
        "dtype": str(next(mm.model.parameters()).dtype),
    }
    if args.carry_compare:
        res.update(measure_carry(mm, spec, groups, args.new_tokens, args.repeats))
    else:
        per_skill = -(-args.batch // len(SKILLS))
        big = prompts(mm, per_skill, chat=False)["skills"][: args.batch]
        res["batch"] = args.batch
        res.update(measure(mm, spec, groups, big, args.new_tokens, args.repeats))
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=1) + "\n")
    print(json.dumps(res))
    return 0
