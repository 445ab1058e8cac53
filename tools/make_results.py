"""Measure a bundle on fresh test items into docs/results.json, and render docs/results.md from the records.

    .venv/bin/python -m tools.make_results [--bundle DIR] [--n 100] [--n-side 40] [--n-mixed 40] [--threads 2]
    .venv/bin/python -m tools.make_results --render-only        # the page (and plots) from docs/*.json alone

Measuring: held-out test items for each of the bundle's adapter tasks (`molora.eval.heldout`, split "test":
seeds never used for training, for earlier reports or for validation; any item whose input occurs in the
bundle's training data is dropped), answered under each skill's own adapter (= the oracle for single-skill
items) and learned routing on all n items, and the side modes (--side-modes, default sequence and base) on the
first --n-side; two-skill mixed items (learned, sequence, oracle); base retention on the general test prompts
(`molora.data.general`, split "test"; learned and sequence, each against the base model's own answers); the
router's token accuracy on held-out labelled sequences. Each run is cached under --work/<fingerprint>/, so an
interrupted run resumes.

Rendering reads docs/results.json, docs/validation.json (`experiments/choose_base_expert.py`: the choices made on
validation items) and docs/probe_cost.json (`experiments/probe_cost.py`) when present. Every figure on the page
comes from one of those records.
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import sys
import time
from pathlib import Path
from typing import Any

from molora.data.jsonl import read_jsonl
from molora.docblock import from_docs, markers, write_block

# The BBH paper's per-task table (Suzgun et al. 2022, arXiv 2210.09261, 3-shot on the real benchmark items):
# PaLM 540B answer-only, PaLM 540B with chain of thought, and the average human rater
PALM_540B = {"object_counting": 51.2, "multistep_arithmetic_two": 1.6, "dyck_languages": 28.4, "navigate": 62.4}
PALM_540B_COT = {"object_counting": 83.2, "multistep_arithmetic_two": 19.6, "dyck_languages": 28.0, "navigate": 79.6}
HUMAN_AVG = {"object_counting": 86.1, "multistep_arithmetic_two": 9.7, "dyck_languages": 47.8, "navigate": 56.0}
MIXED_MODES = ("learned", "sequence", "oracle")
ROUTER_SEED = 9_000_000 + 200
SYSTEM = "You are a helpful assistant."  # the general prompts again, after a system message many clients send
DOCS = Path("docs")


def log(msg: str) -> None:
    print(f"[make_results {time.strftime('%H:%M:%S')}] {msg}", flush=True)


# ------------------------------------------------------------------------------------------- measuring


def cached(path: Path, run) -> dict:
    """run() -> (summary, predictions), cached at `path` (summary JSON; predictions beside it as JSONL)."""
    from molora.eval.runner import save_results

    if path.is_file():
        log(f"{path.stem}: cached")
        return json.loads(path.read_text())
    log(f"{path.stem}: evaluating")
    summary, predictions = run()
    save_results(summary, predictions, path.with_suffix(".tmp"), path.with_suffix(".jsonl"))
    path.with_suffix(".tmp").rename(path)  # the summary last: its presence marks a finished run
    log(f"{path.stem}: {json.dumps({k: v for k, v in summary.items() if k not in ('by_task', 'by_source')})}")
    return summary


def router_accuracy(mm: Any, tasks: list[str], n_per_skill: int) -> dict:
    """Token accuracy of mm.router on held-out labelled sequences (single skills and two-skill mixes)."""
    from molora.data.skills import SKILLS, generate, generate_mixed
    from molora.data.solutions import worked_solution
    from molora.train.default import labelled_sequence
    from molora.train.router import routing_accuracy

    names = mm.router.adapter_names
    adapter = {t: mm.bundle.adapter_for_task(t) for t in tasks}
    tok, template = mm.tokenizer, mm.bundle.prompt_template
    seg = lambda task, inp, tgt: {
        "prompt": inp,
        "completion": worked_solution(task, inp, tgt),  # noqa: E731
        "label": adapter[task],
    }
    groups = {
        t: [
            labelled_sequence(tok, [seg(t, it.input, it.target)], names, template)
            for it in generate(t, n_per_skill, seed=ROUTER_SEED + SKILLS.index(t))
        ]
        for t in tasks
    }
    groups["mixed"] = [
        labelled_sequence(tok, [seg(p["task"], p["input"], p["target"]) for p in r["parts"]], names, template)
        for r in generate_mixed(tasks, n_per_skill, seed=ROUTER_SEED + 50)
    ]
    return {g: routing_accuracy(mm, mm.router, seqs) for g, seqs in groups.items()}


def measure(args: argparse.Namespace, command: str) -> dict:
    import torch

    from molora.bundle import load
    from molora.data.general import general_split
    from molora.data.jsonl import write_jsonl
    from molora.data.skills import write_bbh_file
    from molora.eval.general import evaluate_general
    from molora.eval.heldout import SPLIT_SEEDS, fingerprint, held_out, held_out_mixed, training_inputs
    from molora.eval.runner import evaluate

    if args.threads:
        torch.set_num_threads(args.threads)
    mm = load(args.bundle)
    bundle = mm.bundle
    fp = fingerprint(bundle)
    work = Path(args.work) / f"{bundle.name}-{fp}"
    (work / "data").mkdir(parents=True, exist_ok=True)
    log(f"bundle {bundle.folder} ({fp}); work dir {work}")
    banned = training_inputs(bundle)
    tasks = [a.tasks[0] for a in bundle.adapters if a.tasks]
    own = {t: bundle.adapter_for_task(t) for t in tasks}
    date = time.strftime("%Y-%m-%d")
    meta = {"split": "test", "fingerprint": fp, "date": date, "command": command}
    runs: list[dict] = []

    def record(task: str, mode: str, summary: dict) -> dict:
        runs.append(
            {
                "task": task,
                "mode": mode,
                **meta,
                **{
                    k: summary.get(k)
                    for k in (
                        "n",
                        "accuracy",
                        "lenient_accuracy",
                        "item_accuracy",
                        "retention",
                        "empty_where_base_answers",
                        "adapter_token_share",
                        "seconds",
                        "generated_tokens",
                    )
                    if summary.get(k) is not None
                },
            }
        )
        return summary

    skills: dict[str, dict] = {}
    dropped = {}
    side = args.n_side if args.n_side and args.n_side < args.n else None
    for t in tasks:
        items, dropped[t] = held_out(t, args.n, banned, split="test")
        write_bbh_file(work / "data" / f"{t}.json", items)
        spec = f"bbh:{work / 'data' / f'{t}.json'}"
        skills[t] = {}
        for mode, limit in [(f"adapter:{own[t]}", None), ("learned", None), *((m, side) for m in args.side_modes if m)]:
            tag = f"{t}__{mode.replace(':', '-')}" + (f"__first{limit}" if limit else "")
            s = cached(work / f"{tag}.json", lambda: evaluate(mm, spec, mode, limit=limit, batch_size=args.batch_size))
            skills[t][mode] = record(t, mode, s)
        skills[t]["oracle"] = skills[t][f"adapter:{own[t]}"]
    mixed = {}
    if args.n_mixed:
        write_jsonl(work / "data" / "mixed.jsonl", held_out_mixed(tasks, args.n_mixed, banned, split="test"))
        for mode in MIXED_MODES:
            s = cached(
                work / f"mixed__{mode}.json",
                lambda: evaluate(mm, f"mixed:{work / 'data' / 'mixed.jsonl'}", mode, batch_size=args.batch_size),
            )
            mixed[mode] = record("mixed", mode, s)
    general = {}
    rows = general_split()["test"]
    write_jsonl(
        work / "data" / "general_test.jsonl",
        [{"id": r["id"], "source": r["source"], "prompt": r["prompt"]} for r in rows],
    )
    spec = f"general:{work / 'data' / 'general_test.jsonl'}"
    base_ids = None
    write_jsonl(
        work / "data" / "general_test_system.jsonl",
        [{"id": r["id"], "source": r["source"], "prompt": r["prompt"], "system": SYSTEM} for r in rows],
    )
    s = cached(
        work / "general_system__learned.json",
        lambda: evaluate_general(
            mm, f"general:{work / 'data' / 'general_test_system.jsonl'}", "learned", batch_size=args.batch_size
        ),
    )
    general_system = {"learned": record("general_system", "learned", s)}
    for mode in ("learned", "sequence"):
        path = work / f"general__{mode}.json"

        def run(mode=mode):
            return evaluate_general(mm, spec, mode, batch_size=args.batch_size, base_answers=base_ids)

        general[mode] = record("general", mode, cached(path, run))
        base_ids = [r["base_ids"] for r in read_jsonl(path.with_suffix(".jsonl"))]
    acc_path = work / "router_accuracy.json"
    if not acc_path.is_file():
        log("router token accuracy")
        acc_path.write_text(json.dumps(router_accuracy(mm, tasks, args.n_router), indent=2) + "\n")
    base = "SmolLM2-135M-Instruct (embedded 4-bit GGUF, dequantized)" if bundle.base == "default" else bundle.base
    return {
        "bundle": str(bundle.folder),
        "base": base,
        "fingerprint": fp,
        "date": date,
        "command": command,
        "machine": f"{platform.machine()}, {torch.get_num_threads()} torch threads, torch {torch.__version__}",
        "n": args.n,
        "n_side": side,
        "n_mixed": args.n_mixed,
        "n_general": len(rows),
        "test_seed": SPLIT_SEEDS["test"],
        "dropped": dropped,
        "training_inputs": len(banned),
        "tasks": tasks,
        "own_adapter": own,
        "skills": skills,
        "mixed": mixed,
        "general": general,
        "general_system": general_system,
        "system_message": SYSTEM,
        "router_accuracy": json.loads(acc_path.read_text()),
        "router": _router_settings(bundle),
        "training": training_cost(bundle),
        "runs": runs,
    }


def training_cost(bundle: Any) -> dict:
    """Per adapter, what its training run recorded (training_stats.json as copied into the manifest): examples,
    epochs, steps, wall seconds and, where recorded, the process's CPU seconds over all threads."""
    out = {}
    for name, st in bundle.extra.get("adapter_training", {}).items():
        row = {
            "examples": st.get("examples"),
            "epochs": st.get("config", {}).get("epochs"),
            "steps": st.get("steps"),
            "tokens": st.get("tokens"),
            "seconds": st.get("seconds"),
        }
        for k in ("cpu_seconds", "cpu_seconds_estimate", "cpu_seconds_note"):
            if k in st:
                row[k] = st[k]
        out[name] = row
    return out


def _cpu_seconds(t: dict) -> tuple[float | None, bool]:
    """(CPU seconds of one adapter's training, whether they are an estimate); None where nothing was recorded."""
    if "cpu_seconds" in t:
        return t["cpu_seconds"], False
    return t.get("cpu_seconds_estimate"), "cpu_seconds_estimate" in t


def render_training(training: dict) -> list[str]:
    """The training-cost table: CPU-minutes per adapter where the run recorded its CPU time, else an estimate
    (marked) or the wall time on the machine's cores."""
    if not training:
        return []
    rows = []
    for name, t in training.items():
        sec, est = _cpu_seconds(t)
        cpu = "not recorded" if sec is None else f"≈{sec / 60:.0f} (estimated²)" if est else f"{sec / 60:.0f}"
        rows.append([name, t["examples"], t["epochs"], t["steps"], t["tokens"], f"{t['seconds'] / 60:.0f}", cpu])
    notes = [f"² {name}: {t['cpu_seconds_note']}" for name, t in training.items() if "cpu_seconds_note" in t]
    return [
        "## Training cost per adapter",
        "",
        _table(["adapter", "examples", "epochs", "steps", "tokens", "wall minutes", "CPU-minutes"], rows),
        "",
        "CPU-minutes: the training process's CPU time over all its threads (`cpu_seconds` in the adapter's "
        "training_stats.json); adapters trained before it was recorded have only wall time, "
        "on 2 cores shared with other jobs. Goal: each adapter ≤ 60 CPU-minutes.",
        *notes,
        "",
    ]


def _router_settings(bundle: Any) -> dict:
    return json.loads((bundle.router_path / "router.json").read_text()) if bundle.router_path else {}


# ------------------------------------------------------------------------------------------- goals


def goals(res: dict, cost: dict | None) -> list[dict]:
    """The quality goals, each with the measured numbers and met / not met (None: not measured)."""
    skills, tasks = res["skills"], res["tasks"]
    out = []
    g = res["general"].get("learned")
    if g:
        out.append(
            {
                "goal": "general prompts: learned gives the base model's exact answer on >= 95%",
                "measured": f"{g['retention']:.1f}% of {g['n']} test prompts",
                "met": g["retention"] >= 95,
            }
        )
        out.append(
            {
                "goal": "general prompts: never empty where the base model answers",
                "measured": f"{g['empty_where_base_answers']:.1f}% empty",
                "met": g["empty_where_base_answers"] == 0,
            }
        )
    gaps = {t: skills[t]["learned"]["accuracy"] - skills[t]["oracle"]["accuracy"] for t in tasks}
    out.append(
        {
            "goal": "in-skill: learned within 1 point of the own adapter on each skill",
            "measured": ", ".join(f"{t} {v:+.1f}" for t, v in gaps.items()),
            "met": all(v >= -1 for v in gaps.values()),
        }
    )
    m = res["mixed"]
    if "learned" in m and "sequence" in m:
        lm, sq = m["learned"]["accuracy"], m["sequence"]["accuracy"]
        out.append(
            {
                "goal": "mixed two-skill items: learned >= sequence + 10",
                "measured": f"learned {lm:.1f} vs sequence {sq:.1f} (part accuracy)",
                "met": lm >= sq + 10,
            }
        )
    above = [t for t in tasks if t in PALM_540B_COT and skills[t]["learned"]["accuracy"] > PALM_540B_COT[t]]
    out.append(
        {
            "goal": "learned routing above PaLM 540B with chain of thought on at least three of the four skills "
            "(synthetic items here; the goal's check is on real BBH items)",
            "measured": f"{len(above)} of {len(tasks)}: "
            + ", ".join(f"{t} {skills[t]['learned']['accuracy']:.1f} vs {PALM_540B_COT.get(t, '-')}" for t in tasks),
            "met": len(above) >= 3,
        }
    )
    if res.get("training"):
        cpu = {a: _cpu_seconds(t) for a, t in res["training"].items()}
        missing = [a for a, (sec, _) in cpu.items() if sec is None]
        estimated = any(est for _, est in cpu.values())
        measured = f"CPU-minutes{' (≈: estimated)' if estimated else ''}: " + ", ".join(
            f"{a} {'≈' if est else ''}{sec / 60:.0f}" for a, (sec, est) in cpu.items() if sec is not None
        )
        if missing:
            measured += f"; not recorded (trained before the record, wall time only): {', '.join(missing)}"
        out.append(
            {
                "goal": "training: each adapter <= 60 CPU-minutes",
                "measured": measured,
                "met": None if missing else all(sec <= 3600 for sec, _ in cpu.values()),
            }
        )
    if cost:
        r = cost["probe_time_over_own"]
        out.append(
            {
                "goal": "probe and gates <= 1.25x the own adapter alone, end to end",
                "measured": f"{r:.2f}x ({cost['command']})",
                "met": r <= 1.25,
            }
        )
    return out


# ------------------------------------------------------------------------------------------- rendering


def _fmt(v: Any) -> str:
    if isinstance(v, float):
        return "n/m" if math.isnan(v) else f"{v:.1f}"
    return str(v)


def _table(header: list[str], rows: list[list[Any]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    return "\n".join([*lines, *("| " + " | ".join(_fmt(v) for v in row) + " |" for row in rows)])


def _modes(res: dict) -> list[str]:
    order = ["base", "sequence", "learned", "oracle"]
    present = set.intersection(*(set(res["skills"][t]) for t in res["tasks"]))
    return [m for m in order if m in present]


def render_validation(val: dict) -> list[str]:
    r = val["routers"]["router"]
    out = [
        "## Choices made on validation items",
        "",
        f"`{val['command']}` on {val['date']}: validation items only ({val['n_skill']} per skill from the "
        f"validation seeds, {val['n_mixed']} two-skill items, {val['n_general']} general prompts of the "
        "validation split); no test item was read. Step 1 runs the probe alone (forwards, no generation): for "
        "each confidence, the share of each prompt's tokens it gives to adapters, and the prompt_share that "
        "keeps all but 1% of each skill's prompts routed (per skill; a bound pooled over the skills "
        "lets one skill lose many times its part) while keeping as many general prompts as possible on the base "
        "(halfway across the gap).",
        "",
        _table(
            [
                "confidence",
                "prompt_share",
                "general kept on the base %",
                "skill prompts locked %",
                f"separated by {r.get('margin', 0)} %",
                "lowest skill share",
            ],
            [
                [
                    c,
                    g["prompt_share"],
                    g["general_on_base"],
                    g.get("skill_locked", "-"),
                    g.get("separated_with_margin", "-"),
                    g["min_skill_share"],
                ]
                for c, g in r["grid"].items()
            ],
        ),
        "",
        f"Chosen for the default router: confidence {r['confidence']}, prompt_share {r['prompt_share']}: the "
        f"most prompts separated by at least {r.get('margin', 0)} on the right side of their prompt_share (general "
        "below, skill above; ties to the lowest confidence). The other router variants (a router without the "
        "probe keeps 0 and 0):",
        "",
        _table(
            ["router", "confidence", "prompt_share", "general kept on the base %"],
            [
                [v, x["confidence"], x["prompt_share"], x["grid"][str(x["confidence"])]["general_on_base"]]
                for v, x in val["routers"].items()
            ],
        ),
        "",
    ]
    gen = val.get("generation")
    if gen:
        tasks = [t for t in gen if t not in ("mixed", "general")]
        pol = ["own", "chosen", "no_probe", "no_carry"]
        out += [
            "Step 2 generates with the chosen settings on the validation items, and re-examines the policy "
            "choices made before (carry over blocks 0-1 and the probe were tuned on the items earlier "
            "reports used): `no_probe` is learned routing without the probe, `no_carry` without carry "
            "and probe (strict accuracy %).",
            "",
            _table(
                ["skill", "own adapter", "learned (chosen)", "no_probe", "no_carry"],
                [[t, *(gen[t][p]["accuracy"] for p in pol)] for t in tasks]
                + [["**mean**", *(sum(gen[t][p]["accuracy"] for t in tasks) / len(tasks) for p in pol)]],
            ),
            "",
        ]
        if "mixed" in gen:
            out += [
                f"Mixed validation items (part accuracy): learned {gen['mixed']['learned']['accuracy']:.1f}, "
                f"sequence {gen['mixed']['sequence']['accuracy']:.1f}."
            ]
        if "general" in gen:
            for k, g in gen["general"].items():
                out += [
                    f"General validation prompts ({k.replace('_', ' ')}): learned routing gives the base model's "
                    f"exact answer on {g['retention']:.1f}% ({g['empty_where_base_answers']:.1f}% empty where the "
                    f"base answers; {g['adapter_token_share']:.1f}% of answer tokens on an adapter)."
                ]
        out += [""]
    return out


def render(res: dict, val: dict | None, cost: dict | None, images: list[str]) -> str:
    skills, tasks = res["skills"], res["tasks"]
    modes = _modes(res)
    se = 100 * math.sqrt(0.25 / res["n"])
    rs = res["router"]
    out = [
        f"# Results: per-token routing of skill adapters on {res['base']}",
        "",
        f"Measured by `{res['command']}` on {res['date']} ({res['machine']}); bundle `{res['bundle']}` "
        f"(fingerprint `{res['fingerprint']}`, router settings: confidence {rs.get('confidence', 'unset')}, "
        f"prompt_share {rs.get('prompt_share', 'unset')}, carry_blocks {rs.get('carry_blocks')}, probe "
        f"{rs.get('probe_prompt')}). Rendered from docs/results.json by `python -m tools.make_results "
        "--render-only`; do not edit by hand.",
        "",
        "**What is synthetic and what is real.** The four skills' items are *synthetic*: generated by "
        "`molora.data.skills` in the surface format of four BIG-Bench-Hard tasks, not the benchmark's own items. "
        f"Test items come from seed {res['test_seed']} + the task's index (never used for training, for earlier "
        "reports or for validation), deduplicated against the bundle's "
        f"{res['training_inputs']} training inputs (dropped: {res['dropped']}). The general prompts are *real*: "
        "human-written Self-Instruct tasks and GSM8K problems (molora.data.general; the test split, never seen "
        "by the router or used to choose a setting). Greedy decoding, the bundle's prompt template, strict "
        f"scoring. One standard error at n={res['n']} is at most {se:.1f} points.",
        "",
    ]
    gl = goals(res, cost)
    out += [
        "## Goals",
        "",
        _table(
            ["goal", "measured", "status"],
            [
                [g["goal"], g["measured"], "n/m" if g["met"] is None else "**met**" if g["met"] else "**not met**"]
                for g in gl
            ],
        ),
        "",
    ]
    out += [
        "## Accuracy per skill (strict, %)",
        "",
        _table(
            ["skill", *modes, "PaLM 540B AO", "PaLM 540B CoT", "human avg", "n"],
            [
                [
                    t,
                    *(skills[t][m]["accuracy"] for m in modes),
                    PALM_540B.get(t, "-"),
                    PALM_540B_COT.get(t, "-"),
                    HUMAN_AVG.get(t, "-"),
                    skills[t]["learned"]["n"],
                ]
                for t in tasks
            ]
            + [
                [
                    "**mean**",
                    *(sum(skills[t][m]["accuracy"] for t in tasks) / len(tasks) for m in modes),
                    "",
                    "",
                    "",
                    "",
                ]
            ],
        ),
        "",
        f"Modes: `base` no adapter; `sequence` one adapter per request, picked by the router's vote over the "
        f"question's tokens (what a per-request server can do); `learned` the router per token; `oracle` the "
        f"skill's own adapter on every token. `base` and `sequence` use the first {res['n_side']} items. "
        "PaLM 540B answer-only (AO) and with chain of thought (CoT), and the average human rater, are the BBH "
        "paper's 3-shot figures on the real benchmark (arXiv 2210.09261): not like for like, our adapters write "
        "a short worked solution and were trained on generated items of the same format.",
        "",
    ]
    out += render_training(res.get("training", {}))
    if images:
        out += [f"![per-skill accuracy]({images[0]})", ""]
    if res["mixed"]:
        m = res["mixed"]
        parts = sorted({t for s in m.values() for t in s["by_task"]})
        out += [
            "## Mixed items: two skills in one sequence",
            "",
            f"{res['n_mixed']} test items, each two questions of different skills answered in turn inside one "
            "sequence. Part accuracy counts each answer; 'both' needs both right.",
            "",
            _table(
                ["mode", "part accuracy", "both parts right", *parts],
                [
                    [k, s["accuracy"], s["item_accuracy"], *(s["by_task"].get(t, "-") for t in parts)]
                    for k, s in m.items()
                ],
            ),
            "",
        ]
    if res["general"]:
        g = res["general"]
        sources = sorted({s for x in g.values() for s in x["by_source"]})
        out += [
            "## General prompts: does the base model keep its answers?",
            "",
            f"The {res['n_general']} general test prompts, answered greedily (first {g['learned']['max_new_tokens']} "
            "tokens) under each mode and on the base model alone, in identical batches. Retention: answers equal "
            "to the base model's, token for token. Adapter tokens: answer tokens computed with an adapter at any "
            "block (`molora eval --task general:FILE`).",
            "",
            _table(
                [
                    "mode",
                    "retention %",
                    "empty where the base answers %",
                    "adapter tokens %",
                    *(f"retention, {s}" for s in sources),
                ],
                [
                    [
                        k,
                        x["retention"],
                        x["empty_where_base_answers"],
                        x["adapter_token_share"],
                        *(x["by_source"][s]["retention"] for s in sources),
                    ]
                    for k, x in g.items()
                ]
                + [
                    [
                        f'{k}, after the system message "{res["system_message"]}"',
                        x["retention"],
                        x["empty_where_base_answers"],
                        x["adapter_token_share"],
                        *(x["by_source"][s]["retention"] for s in sources),
                    ]
                    for k, x in res.get("general_system", {}).items()
                ],
            ),
            "",
        ]
    if val:
        out += render_validation(val)
    if cost:
        out += [
            "## Cost of the router",
            "",
            f"`{cost['command']}`: the first {cost.get('limit', '?')} test items of each skill answered under "
            "learned routing with the probe, without it, and on the own adapter alone, interleaved per repetition.",
            "",
            _table(
                ["variant", "seconds", "answer tokens", "tokens/s", "accuracy"],
                [
                    [v, c["seconds"], c["answer_tokens"], c["tokens_per_s"], c["accuracy"]]
                    for v, c in cost.items()
                    if isinstance(c, dict)
                ],
            ),
            "",
            f"Probe and gates: {cost['probe_time_over_own']:.2f}x the own adapter's time; "
            f"{cost['probe_time_over_no_probe']:.2f}x learned routing without the probe.",
            "",
        ]
    ra = res["router_accuracy"]
    out += [
        "## Router token accuracy",
        "",
        f"Held-out labelled sequences (seed {ROUTER_SEED}), every token routed by the router, the decision "
        "most blocks took compared with the token's skill:",
        "",
        _table(
            ["sequences", "token accuracy", "block accuracy", "tokens"],
            [[k, r["token_accuracy"], r["block_accuracy"], r["tokens"]] for k, r in ra.items()],
        ),
        "",
    ]
    return "\n".join(out + extra_sections())


# Sections measured by other scripts, appended to the page when their record exists: (record under docs/, the
# module that owns it; the module defines render_section(record) -> list of markdown lines).
SECTIONS = [
    ("arith_ops_val_after.json", "experiments.arith_ops"),
    ("arrow.json", "tools.make_arrow"),
    ("arrow_prompt.json", "experiments.arrow_prompt_eval"),
    ("arrow_cost.json", "experiments.arrow_cost"),
    ("gates_prompt.json", "experiments.gates_eval"),
    ("gates_cost.json", "experiments.arrow_cost"),
    ("datafree_prompt.json", "experiments.datafree_choose"),
    ("datafree_hybrid_cost.json", "experiments.arrow_cost"),
    ("hybrid_serve_cost.json", "experiments.hybrid_serve_cost"),
    ("routing_test2.json", "experiments.routing_eval"),
    ("hybrid_ceiling.json", "experiments.hybrid_ceiling"),
    ("hybrid_stall.json", "experiments.hybrid_stall"),
    ("hybrid_stall_staged.json", "experiments.hybrid_stall"),
    ("multimodal.json", "tools.make_multimodal"),
]


def extra_sections(docs: Path = None) -> list[str]:
    """The markdown of every SECTIONS record present, rendered by its own module's render_section."""
    import importlib

    docs = docs or DOCS
    out: list[str] = []
    for record, module in SECTIONS:
        if not (docs / record).is_file():
            continue
        mod = importlib.import_module(module)
        out += mod.render_section(json.loads((docs / record).read_text()))
    return out


README_BEGIN, README_END = markers("results", "tools/make_results.py")  # the summary in docs/routing.md
TABLE_BEGIN, TABLE_END = markers("quality-table", "tools/make_results.py")  # the README's table


def render_readme(res: dict, val: dict | None, cost: dict | None) -> str:
    """The README's quality block (between README_BEGIN and README_END), from the same records as the page."""
    skills, tasks = res["skills"], res["tasks"]
    modes = [m for m in ("base", "sequence", "oracle", "learned") if m in _modes(res)]
    label = {
        "base": "base¹",
        "sequence": "sequence¹",
        "oracle": "own adapter (= oracle)",
        "learned": "**learned per-token**",
    }
    rows = [
        [
            t,
            *(f"**{skills[t][m]['accuracy']:.1f}**" if m == "learned" else skills[t][m]["accuracy"] for m in modes),
            PALM_540B.get(t, "-"),
            PALM_540B_COT.get(t, "-"),
        ]
        for t in tasks
    ]
    out = [
        README_BEGIN,
        f"**Quality** (rendered from [docs/results.json](docs/results.json) by `tools/make_results.py`; "
        f"{res['base']} + four r=8 skill adapters; {res['n']} fresh *synthetic* test items per skill in the "
        "BIG-Bench-Hard format, generated with seeds never used for training, tuning or earlier reports; greedy; "
        "strict accuracy %; full tables in [docs/results.md](docs/results.md)):",
        "",
        _table(["skill", *(label[m] for m in modes), "PaLM 540B answer-only", "PaLM 540B CoT"], rows),
        "",
        f"¹ on the first {res['n_side']} items of each skill.",
    ]
    g = res["general"].get("learned")
    if g:
        seq = res["general"].get("sequence")
        out += [
            "",
            f"**General prompts keep the base model's answers.** On {g['n']} *real* held-out general prompts "
            "(human-written Self-Instruct tasks and GSM8K problems, a test split the router never saw and no "
            f"setting was chosen on), learned routing returns the base model's exact greedy answer on "
            f"**{g['retention']:.1f}%** ({g['empty_where_base_answers']:.1f}% empty where the base answers; "
            f"{g['adapter_token_share']:.1f}% of answer tokens on an adapter)"
            + (f"; one adapter per request picked by the router's vote keeps {seq['retention']:.1f}%" if seq else "")
            + (
                f'; after the system message "{res["system_message"]}" learned routing keeps '
                f"{res['general_system']['learned']['retention']:.1f}%"
                if res.get("general_system")
                else ""
            )
            + ". The router's base class is trained on general text, and a prompt the probe gives to adapters "
            f"below a share of {res['router'].get('prompt_share')} runs wholly on the base model "
            "(`molora/routing/learned.py`: Base expert); both settings were chosen on validation prompts.",
        ]
    m = res["mixed"]
    if "learned" in m and "sequence" in m:
        out += [
            "",
            f"**Two-skill requests** answered turn by turn in one sequence ({res['n_mixed']} test items): "
            f"learned per-token routing gets **{m['learned']['accuracy']:.1f}%** of parts right, the per-part "
            f"oracle {m['oracle']['accuracy']:.1f}%, one adapter per request (`sequence`) "
            f"{m['sequence']['accuracy']:.1f}%: the case today's servers cannot serve.",
        ]
    if cost:
        out += [
            "",
            f"**Router cost**: the probe and gates take {cost['probe_time_over_own']:.2f}x the own adapter's "
            f"time end to end ({cost['probe_time_over_no_probe']:.2f}x learned routing without the probe; "
            "`experiments/probe_cost.py`, interleaved).",
        ]
    out += [README_END]
    return "\n".join(out)


def render_readme_table(res: dict, val: dict | None, cost: dict | None) -> str:
    """The README's quality table (TABLE_BEGIN ... TABLE_END): the table of the summary block and its footnote,
    without the prose (which docs/routing.md keeps)."""
    rows = [line for line in render_readme(res, val, cost).splitlines() if line.startswith(("|", "¹"))]
    head = (
        f"**Quality**, strict accuracy % on {res['n']} fresh synthetic test items per skill in the BIG-Bench-Hard "
        "format, greedy (the general prompts, two-skill requests and the router's cost in "
        "[docs/routing.md](docs/routing.md#figures), every table in [docs/results.md](docs/results.md)):"
    )
    return "\n".join([TABLE_BEGIN, head, "", *rows[:-1], "", rows[-1], TABLE_END])


def plots(res: dict, folder: Path) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    skills, tasks, modes = res["skills"], res["tasks"], _modes(res)
    fig, ax = plt.subplots(figsize=(9, 4))
    width = 0.8 / len(modes)
    for j, mode in enumerate(modes):
        ax.bar(
            [i + j * width for i in range(len(tasks))], [skills[t][mode]["accuracy"] for t in tasks], width, label=mode
        )
    ax.set_xticks([i + 0.4 - width / 2 for i in range(len(tasks))], tasks, fontsize=8)
    ax.set_ylabel("accuracy (%)")
    ax.set_ylim(0, 100)
    ax.legend(fontsize=7, ncol=4)
    ax.set_title(f"Test skill accuracy, {res['n']} synthetic items per skill")
    fig.tight_layout()
    fig.savefig(folder / "results_skills.png", dpi=110)
    plt.close(fig)
    return ["results_skills.png"]


# ------------------------------------------------------------------------------------------- main


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--bundle", default=None, help="bundle folder (default: the embedded default bundle)")
    p.add_argument("--n", type=int, default=100, help="test items per skill (default 100)")
    p.add_argument("--n-side", type=int, default=40, help="items per skill for the side modes (default 40)")
    p.add_argument(
        "--side-modes",
        type=lambda s: s.split(","),
        default=["sequence", "base"],
        help="comma-separated modes run on the first --n-side items (default sequence,base)",
    )
    p.add_argument("--n-mixed", type=int, default=40, help="mixed two-skill test items (default 40; 0 to skip)")
    p.add_argument("--n-router", type=int, default=30, help="held-out sequences per skill for router accuracy")
    p.add_argument("--work", default="runs/results_work", help="data and per-(task, mode) cache")
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's choice)")
    p.add_argument(
        "--render-only", action="store_true", help="measure nothing: render docs/results.md from docs/*.json"
    )
    args = p.parse_args(argv)
    command = "python -m tools.make_results " + " ".join(sys.argv[1:] if argv is None else argv)
    if args.render_only:
        res = json.loads((DOCS / "results.json").read_text())
    else:
        res = measure(args, command)
        (DOCS / "results.json").write_text(json.dumps(res, indent=2) + "\n")
    val = json.loads((DOCS / "validation.json").read_text()) if (DOCS / "validation.json").is_file() else None
    cost = json.loads((DOCS / "probe_cost.json").read_text()) if (DOCS / "probe_cost.json").is_file() else None
    images = plots(res, DOCS)
    (DOCS / "results.md").write_text(render(res, val, cost, images) + "\n", encoding="utf-8")
    write_block(DOCS / "routing.md", README_BEGIN, README_END, from_docs(render_readme(res, val, cost)))
    write_block(Path("README.md"), TABLE_BEGIN, TABLE_END, render_readme_table(res, val, cost))
    log(
        "wrote docs/results.md from docs/results.json"
        + (", docs/validation.json" if val else "")
        + (", docs/probe_cost.json" if cost else "")
    )
    for g in goals(res, cost):
        log(f"goal: {g['goal']}: {'n/m' if g['met'] is None else 'met' if g['met'] else 'NOT met'} ({g['measured']})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
