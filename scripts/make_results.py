"""Regenerate docs/results.md (tables and plots) for a bundle, in one command.

    .venv/bin/python scripts/make_results.py [--bundle DIR] [--n 250] [--n-mixed 100] \\
        [--out docs/results.md] [--json runs/results.json] [--work runs/results_work]

Steps: generate held-out items for each of the bundle's adapter tasks (`molora.data.skills.generate`
with seed EVAL_SEED_BASE + the task's index in SKILLS, never a training seed), drop any whose input
occurs in the bundle's training data (the bundle folder's data/*.jsonl), write them as BBH task files;
evaluate every skill under base, each single adapter (a K x K table), merge, sequence, learned and
oracle; evaluate mixed items (two skills in one multi-turn sequence) under base, merge, sequence,
oracle and learned; measure the router's token accuracy on held-out sequences; write the markdown,
three PNG plots beside it, and one JSON file with every number.

Every (task, mode) result is cached under --work/<bundle fingerprint>/ (summary JSON + predictions
JSONL), so a crashed or interrupted run resumes where it stopped; a retrained bundle gets a new
fingerprint and is evaluated afresh.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import platform
import sys
import time
from pathlib import Path
from typing import Any

import torch

from molora.bundle import Bundle, load
from molora.data.skills import EVAL_SEED_BASE, SKILLS, Item, generate, generate_mixed, write_bbh_file, write_jsonl
from molora.eval.runner import evaluate, save_results

# Published anchors (BBH paper, arXiv 2210.09261, Table: PaLM 540B 3-shot answer-only; SmolLM2 model card).
PALM_540B = {"object_counting": 51.2, "multistep_arithmetic_two": 1.6, "word_sorting": 32.0,
             "dyck_languages": 28.4, "navigate": 62.4}
SMOLLM2_BBH = 28.2
SKILL_MODES = ("base", "merge", "sequence", "learned", "oracle")
MIXED_MODES = ("base", "merge", "sequence", "oracle", "learned")
MIXED_SEED = EVAL_SEED_BASE + 100
ROUTER_SEED = EVAL_SEED_BASE + 200


def log(msg: str) -> None:
    print(f"[make_results {time.strftime('%H:%M:%S')}] {msg}", flush=True)


# ------------------------------------------------------------------------------------------- data

def fingerprint(bundle: Bundle) -> str:
    """12 hex digits over the manifest and every weights file of the bundle."""
    h = hashlib.sha256((bundle.folder / "molora.json").read_bytes())
    files = [a.path / "adapter_model.safetensors" for a in bundle.adapters]
    if bundle.router_path is not None:
        files += sorted(bundle.router_path.glob("*"))
    for f in files:
        h.update(f.read_bytes())
    return h.hexdigest()[:12]


def training_inputs(bundle: Bundle) -> set[str]:
    """Every question text in the bundle's training files (data/*.jsonl): prompts, segments, parts."""
    seen: set[str] = set()
    for path in sorted((bundle.folder / "data").glob("*.jsonl")):
        for line in path.read_text(encoding="utf-8").splitlines():
            if not line.strip():
                continue
            row = json.loads(line)
            for seg in [row, *row.get("segments", []), *row.get("parts", [])]:
                for key in ("prompt", "input"):
                    if isinstance(seg.get(key), str):
                        seen.add(seg[key])
    return seen


def held_out(task: str, n: int, banned: set[str]) -> tuple[list[Item], int]:
    """n items of `task` from its evaluation seed, none in `banned`; (items, how many were dropped)."""
    k = SKILLS.index(task)
    items, dropped, extra = [], 0, 0
    while len(items) < n:
        batch = generate(task, n, seed=EVAL_SEED_BASE + k + 1000 * extra)
        have = {it.input for it in items}
        fresh = [it for it in batch if it.input not in banned and it.input not in have]
        dropped += sum(it.input in banned for it in batch) if extra == 0 else 0
        items += fresh[: n - len(items)]
        extra += 1
    return items, dropped


def write_eval_data(bundle: Bundle, folder: Path, n: int, n_mixed: int) -> dict[str, Any]:
    """BBH files per skill and a mixed JSONL under `folder`; returns specs and dedupe counts."""
    banned = training_inputs(bundle)
    tasks = [a.tasks[0] for a in bundle.adapters if a.tasks]
    out: dict[str, Any] = {"skills": {}, "dropped": {}, "training_inputs": len(banned)}
    for task in tasks:
        items, dropped = held_out(task, n, banned)
        write_bbh_file(folder / f"{task}.json", items)
        out["skills"][task] = f"bbh:{folder / f'{task}.json'}"
        out["dropped"][task] = dropped
    rows = [r for r in generate_mixed(tasks, 2 * n_mixed, seed=MIXED_SEED)
            if not any(p["input"] in banned for p in r["parts"])][:n_mixed]
    write_jsonl(folder / "mixed.jsonl", rows)
    out["mixed"] = f"mixed:{folder / 'mixed.jsonl'}"
    out["tasks"] = tasks
    return out


# ------------------------------------------------------------------------------------------- evaluation

NOT_MEASURED = {"accuracy": math.nan, "lenient_accuracy": math.nan, "item_accuracy": math.nan,
                "majority_baseline": math.nan, "seconds": 0.0, "generated_tokens": 0, "n": 0, "by_task": {}}
CACHED_ONLY = False  # --cached-only: render what the cache holds; a missing run shows as "n/m"


def cached_eval(mm: Any, spec: str, mode: str, cache: Path, batch_size: int, limit: int | None = None) -> dict:
    """The summary of evaluating `spec` (its first `limit` items) under `mode`, read from `cache` if there."""
    tag = f"__first{limit}" if limit else ""
    path = cache / f"{spec.split('/')[-1].rsplit('.', 1)[0]}__{mode.replace(':', '-')}{tag}.json"
    if path.is_file():
        log(f"{spec.split('/')[-1]} {mode}: cached")
        return json.loads(path.read_text())
    if CACHED_ONLY:
        log(f"{spec.split('/')[-1]} {mode}: not measured (--cached-only)")
        return dict(NOT_MEASURED, routing=mode)
    log(f"{spec.split('/')[-1]} {mode}: evaluating")
    summary, predictions = evaluate(mm, spec, mode, batch_size=batch_size, limit=limit)
    save_results(summary, predictions, path.with_suffix(".tmp"), path.with_suffix(".jsonl"))
    path.with_suffix(".tmp").rename(path)  # the summary last: its presence marks a finished run
    log(f"{spec.split('/')[-1]} {mode}: accuracy {summary['accuracy']} (lenient {summary['lenient_accuracy']}), "
        f"{summary['tokens_per_s']} tok/s")
    return summary


def router_accuracy(mm: Any, tasks: list[str], n_per_skill: int, cache: Path) -> dict:
    """Token accuracy of mm.router on held-out labelled sequences (single skills and two-skill mixes)."""
    from molora.data.solutions import worked_solution
    from molora.train.default import labelled_sequence
    from molora.train.router import routing_accuracy

    path = cache / "router_accuracy.json"
    if path.is_file():
        return json.loads(path.read_text())
    if CACHED_ONLY:
        return {}
    names = mm.router.adapter_names
    adapter = {t: mm.bundle.adapter_for_task(t) for t in tasks}
    tok, template = mm.tokenizer, mm.bundle.prompt_template
    groups: dict[str, list] = {}
    for task in tasks:
        items = generate(task, n_per_skill, seed=ROUTER_SEED + SKILLS.index(task))
        groups[task] = [labelled_sequence(tok, [{"prompt": it.input,
                                                 "completion": worked_solution(task, it.input, it.target),
                                                 "label": adapter[task]}], names, template) for it in items]
    groups["mixed"] = [labelled_sequence(tok, [{"prompt": p["input"],
                                                "completion": worked_solution(p["task"], p["input"], p["target"]),
                                                "label": adapter[p["task"]]} for p in r["parts"]], names, template)
                       for r in generate_mixed(tasks, n_per_skill, seed=ROUTER_SEED + 50)]
    log(f"router token accuracy on {sum(map(len, groups.values()))} held-out sequences")
    result = {g: routing_accuracy(mm, mm.router, seqs) for g, seqs in groups.items()}
    path.write_text(json.dumps(result, indent=2) + "\n")
    return result


# ------------------------------------------------------------------------------------------- goals

def goals(skills: dict[str, dict[str, dict]], mixed: dict[str, dict], own: dict[str, str]) -> list[dict]:
    """The four goals of the issue, each with the measured numbers and met / not met."""
    acc = lambda t, m: skills[t][m]["accuracy"]  # noqa: E731
    tasks = list(skills)
    learned = sum(acc(t, "learned") for t in tasks) / len(tasks)
    oracle = sum(acc(t, "oracle") for t in tasks) / len(tasks)
    gaps = {t: acc(t, "learned") - acc(t, f"adapter:{own[t]}") for t in tasks}
    rows = [
        {"goal": "learned within 2 points of oracle on average",
         "measured": f"learned {learned:.1f} vs oracle {oracle:.1f} (mean over {len(tasks)} skills)",
         "met": learned >= oracle - 2},
        {"goal": "learned >= each skill's own adapter - 2",
         "measured": ", ".join(f"{t} {g:+.1f}" for t, g in gaps.items()),
         "met": all(g >= -2 for g in gaps.values())},
    ]
    if "learned" in mixed and "sequence" in mixed:
        lm, sq = mixed["learned"]["accuracy"], mixed["sequence"]["accuracy"]
        rows.append({"goal": "mixed items: learned per-token >= sequence + 10",
                     "measured": f"learned {lm:.1f} vs sequence {sq:.1f} (part accuracy)", "met": lm >= sq + 10}
                    if not (math.isnan(lm) or math.isnan(sq)) else
                    {"goal": "mixed items: learned per-token >= sequence + 10", "measured": "not measured in this run",
                     "met": None})
    above = [t for t in tasks if t in PALM_540B and acc(t, "learned") > PALM_540B[t]]
    anchored = [t for t in tasks if t in PALM_540B]
    rows.append({"goal": "135M + MoLoRA (learned) above PaLM 540B answer-only on >= 3 of 4 skills",
                 "measured": f"above on {len(above)} of {len(anchored)}: " + (", ".join(above) or "none"),
                 "met": len(above) >= 3})
    return rows


# ------------------------------------------------------------------------------------------- plots

def plots(res: dict, folder: Path, stem: str) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    skills, tasks, names = res["skills"], res["tasks"], res["adapters"]
    files = []
    fig, ax = plt.subplots(figsize=(9, 4))
    width = 0.8 / len(SKILL_MODES)
    for j, mode in enumerate(SKILL_MODES):
        ax.bar([i + j * width for i in range(len(tasks))], [skills[t][mode]["accuracy"] for t in tasks], width,
               label=mode)
    for i, t in enumerate(tasks):
        if t in PALM_540B:
            ax.hlines(PALM_540B[t], i - width / 2, i + 0.8 - width / 2, colors="black", linestyles="dashed",
                      label="PaLM 540B (answer-only)" if i == 0 else None)
    ax.set_xticks([i + 0.4 - width / 2 for i in range(len(tasks))], tasks, fontsize=8)
    ax.set_ylabel("accuracy (%)")
    ax.set_ylim(0, 100)
    ax.legend(fontsize=7, ncol=3)
    ax.set_title(f"Held-out skill accuracy, {res['n']} items per skill")
    files.append(_save(fig, folder / f"{stem}_skills.png"))

    fig, ax = plt.subplots(figsize=(5.5, 4))
    grid = [[skills[t][f"adapter:{a}"]["accuracy"] for t in tasks] for a in names]
    im = ax.imshow(grid, cmap="viridis", vmin=0, vmax=100)
    for r, row in enumerate(grid):
        for c, v in enumerate(row):
            ax.text(c, r, f"{v:.0f}", ha="center", va="center", color="white" if v < 60 else "black")
    ax.set_xticks(range(len(tasks)), tasks, rotation=20, fontsize=7)
    ax.set_yticks(range(len(names)), names)
    ax.set_xlabel("evaluated on")
    ax.set_ylabel("single adapter")
    fig.colorbar(im, ax=ax)
    files.append(_save(fig, folder / f"{stem}_adapters.png"))

    if res["mixed"]:
        fig, ax = plt.subplots(figsize=(6, 3.5))
        modes = list(res["mixed"])
        ax.bar(modes, [res["mixed"][m]["accuracy"] for m in modes], label="part accuracy")
        ax.bar(modes, [res["mixed"][m]["item_accuracy"] for m in modes], width=0.4, label="both parts right")
        ax.set_ylabel("accuracy (%)")
        ax.set_ylim(0, 100)
        ax.legend(fontsize=8)
        ax.set_title(f"Mixed two-skill sequences ({res['n_mixed']} items)")
        files.append(_save(fig, folder / f"{stem}_mixed.png"))
    return files


def _save(fig: Any, path: Path) -> str:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    import matplotlib.pyplot as plt

    plt.close(fig)
    return path.name


# ------------------------------------------------------------------------------------------- markdown

def _table(header: list[str], rows: list[list[Any]]) -> str:
    fmt = lambda v: ("n/m" if math.isnan(v) else f"{v:.1f}") if isinstance(v, float) else str(v)  # noqa: E731
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    return "\n".join([*lines, *("| " + " | ".join(fmt(v) for v in row) + " |" for row in rows)])


def _reused_note(res: dict) -> list[str]:
    """A line naming the runs taken over from an earlier bundle's cache (marked "reused_from" in their JSON)."""
    runs = sorted({f"{t} {m}" for t, modes in res["skills"].items() for m, s in modes.items() if s.get("reused_from")}
                  | {f"mixed {m}" for m, s in res.get("mixed", {}).items() if s.get("reused_from")})
    if not runs:
        return []
    src = sorted({s["reused_from"] for modes in res["skills"].values() for s in modes.values() if s.get("reused_from")})
    return [f"Reused runs: {len(runs)} (task, mode) runs were copied from the caches of the earlier bundles "
            f"{', '.join(src)} rather than rerun. Each uses no router, only adapters whose weights are byte-identical "
            f"here, on byte-identical items, and none of its answers reached the answer budget it ran with (so the "
            f"budgets used now could not change it): {'; '.join(runs)}. Runs decoded by an older version of the "
            "dispatch code can differ from a rerun only in the floating-point summation order of the LoRA delta.", ""]


def render(res: dict, command: str, images: list[str]) -> str:
    skills, tasks, names = res["skills"], res["tasks"], res["adapters"]
    own = res["own_adapter"]
    mean = lambda mode, key="accuracy": sum(skills[t][mode][key] for t in tasks) / len(tasks)  # noqa: E731
    se = 100 * math.sqrt(0.25 / res["n"])
    out = [
        f"# Results: per-token routing of skill adapters on {res['base']}",
        "",
        f"Generated by `{command}` on {res['date']} ({res['machine']}). Bundle `{res['bundle']}` "
        f"(fingerprint `{res['fingerprint']}`). Do not edit by hand: rerun the command.",
        "",
        f"Held-out items: {res['n']} per skill, generated by `molora.data.skills.generate(task, n, "
        f"seed=EVAL_SEED_BASE + index)` (EVAL_SEED_BASE = {EVAL_SEED_BASE}; training uses seeds near 1000), "
        f"then deduplicated against the bundle's {res['data']['training_inputs']} training inputs "
        f"(dropped: {res['data']['dropped']}). They follow the BBH task files' surface format but are not "
        f"the benchmark's items. One standard error at n={res['n']} is at most {se:.1f} points. "
        "Greedy decoding, the bundle's prompt template, strict scoring (the answer as asked; lenient in the "
        "second table). The own-adapter (= oracle) and learned runs use all items; base, merge, sequence and "
        f"the other adapters use the first {res.get('n_side') or res['n']} items of each skill. The default "
        "bundle's counting, arithmetic and navigate adapters answer with a short worked solution ending \"So the "
        "answer is X.\" (BBH's chain-of-thought closing; `molora/data/solutions.py`: running totals, one "
        "operation at a time, the position and heading after each instruction), which the strict scorer reads; "
        "the dyck adapter answers bare. PaLM's figures are answer-only, so the comparison is not like for like.",
        "",
        *_reused_note(res),
        "## Goals",
        "",
        _table(["goal", "measured", "status"],
               [[g["goal"], g["measured"], "n/m" if g["met"] is None else "**met**" if g["met"] else "**not met**"]
                for g in res["goals"]]),
        "",
        "## Accuracy per skill (strict, %)",
        "",
        _table(["skill", *SKILL_MODES, "PaLM 540B", "majority"],
               [[t, *(skills[t][m]["accuracy"] for m in SKILL_MODES), PALM_540B.get(t, "-"),
                 skills[t]["base"]["majority_baseline"]] for t in tasks]
               + [["**mean**", *(mean(m) for m in SKILL_MODES), "", ""]]),
        "",
        "Modes: `base` no adapter; `merge` every token on the uniform average of all adapters (exact, "
        "top-K with weights 1/K); `sequence` one adapter per request, picked by the router's vote over the "
        "question's tokens (what a per-request server can do); `learned` the router per token; `oracle` the "
        "skill's own adapter on every token (for single-skill items this is exactly the `adapter:<own>` run "
        "below, so it is taken from it rather than run twice).",
        "",
        f"![per-skill accuracy]({images[0]})" if images else "",
        "",
        "### Lenient accuracy (%, the first well-formed answer anywhere in the reply)",
        "",
        _table(["skill", *SKILL_MODES], [[t, *(skills[t][m]["lenient_accuracy"] for m in SKILL_MODES)]
                                         for t in tasks]
               + [["**mean**", *(mean(m, "lenient_accuracy") for m in SKILL_MODES)]]),
        "",
        "## Each single adapter on each skill (strict, %)",
        "",
        _table(["adapter \\ skill", *tasks], [[f"{a}" + (" (own: " + ", ".join(t for t in tasks if own[t] == a)
                                                          + ")" if a in own.values() else ""),
                                               *(skills[t][f"adapter:{a}"]["accuracy"] for t in tasks)]
                                              for a in names]),
        "",
        f"![adapter x skill]({images[1]})" if len(images) > 1 else "",
        "",
    ]
    if res["mixed"]:
        mixed = res["mixed"]
        parts = sorted({t for s in mixed.values() for t in s["by_task"]})
        out += [
            "## Mixed items: two skills in one sequence",
            "",
            f"{res['n_mixed']} items, each two questions of different skills answered in turn inside one "
            "sequence (question 1, the model's answer, question 2, its answer), rendered exactly as the router's "
            "multi-turn training data. Part accuracy counts each answer; 'both' needs both answers right. "
            "`sequence` keeps one adapter for the whole sequence, picked by the router's vote over both "
            "questions; `oracle` puts each part's tokens on its skill's adapter; `learned` routes per token.",
            "",
            _table(["mode", "part accuracy", "lenient", "both parts right", *parts],
                   [[m, s["accuracy"], s["lenient_accuracy"], s["item_accuracy"],
                     *(s["by_task"].get(t, "-") for t in parts)] for m, s in mixed.items()]),
            "",
            f"![mixed items]({images[2]})" if len(images) > 2 else "",
            "",
        ]
    out += ["## Router token accuracy", ""]
    ra = res["router"]
    out += [f"Recomputed here on held-out labelled sequences (seed {ROUTER_SEED}: each skill's items with their "
            "reference answers, and two-skill mixes), every token forced through the router, the decision "
            "taken by most blocks compared with the token's skill (template tokens not scored):", "",
            _table(["sequences", "token accuracy", "block accuracy", "tokens"],
                   [[g, r["token_accuracy"], r["block_accuracy"], r["tokens"]] for g, r in ra["held_out"].items()]),
            ""]
    if ra.get("manifest"):
        out += ["As reported by the bundle's training (its manifest, `extra.routers`, on its own held-out split "
                "including generic text labelled none):", "",
                _table(["router variant", "token accuracy", "block accuracy", "tokens"],
                       [[v, r.get("token_accuracy", "-"), r.get("block_accuracy", "-"), r.get("tokens", "-")]
                        for v, r in ra["manifest"].items()]), ""]
    cost = res["cost"]
    out += ["## Cost of each mode", "",
            "Answer tokens per second, end to end (prefill of the prompt, decoding, and for `sequence` the "
            "extra forward that picks the adapter), summed over all skills; static batches of "
            f"{res['batch_size']} prompts of similar length, {res['threads']} CPU threads, fp32. Rows differ in "
            "how long the answers are (the base model writes sentences until its budget), so seconds per "
            "item is shown too." + (
                " Reused runs (above) keep the timing of the session that ran them, under that session's load on "
                "the machine, so rows measured at different times are not a side-by-side comparison; "
                "`scripts/probe_cost.py` times learned routing with and without its probe pass, and the own "
                "adapter, interleaved in one run." if _reused_note(res) else ""), "",
            _table(["mode", "tokens/s", "relative to base", "seconds per item", "answer tokens per item"],
                   [[m, c["tokens_per_s"], f'{c["tokens_per_s"] / cost["base"]["tokens_per_s"]:.2f}x',
                     c["seconds_per_item"], c["tokens_per_item"]] for m, c in cost.items()]), ""]
    out += ["## Published anchors", "",
            _table(["model", "setting", "object counting", "multistep arithmetic", "word sorting", "dyck",
                    "navigate", "BBH overall"],
                   [["PaLM 540B", "3-shot, answer-only (arXiv 2210.09261)", *PALM_540B.values(), "-"],
                    ["SmolLM2-135M-Instruct", "model card", "-", "-", "-", "-", "-", SMOLLM2_BBH],
                    ["SmolLM2-135M + MoLoRA (learned), here", "0-shot, generated held-out items",
                     *(skills[t]["learned"]["accuracy"] if t in skills else "-" for t in PALM_540B), "-"]]),
            "",
            "Caveats: our items are generated in the BBH format, not the benchmark's own 250 per task, and the "
            "base weights are the 4-bit GGUF dequantized (scores will not match published full-precision "
            "SmolLM2 numbers); PaLM was prompted 3-shot with no task training, our adapters were trained on "
            "generated items of the same format. The comparison says what 135M parameters plus small "
            "specialists reach on these formats, not that the small model is generally stronger.",
            ""]
    return "\n".join(out)


# ------------------------------------------------------------------------------------------- main

def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--bundle", default=None, help="bundle folder (default: the embedded default bundle)")
    p.add_argument("--n", type=int, default=250, help="held-out items per skill (default 250)")
    p.add_argument("--n-side", type=int, default=100,
                   help="items per skill for base, merge, sequence and the other adapters (default 100)")
    p.add_argument("--n-mixed", type=int, default=100, help="mixed two-skill items (default 100; 0 to skip)")
    p.add_argument("--n-router", type=int, default=50, help="held-out sequences per skill for router accuracy")
    p.add_argument("--out", default="docs/results.md", help="markdown file; plots go beside it")
    p.add_argument("--json", default="runs/results.json", help="every number, as JSON")
    p.add_argument("--work", default="runs/results_work", help="data and per-(task, mode) cache")
    p.add_argument("--batch-size", type=int, default=16, help="prompts per generation batch (default 16)")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's choice)")
    p.add_argument("--cached-only", action="store_true",
                   help="evaluate nothing: render the cached runs, marking missing ones n/m (not measured)")
    args = p.parse_args(argv)
    global CACHED_ONLY
    CACHED_ONLY = args.cached_only
    if args.threads:
        torch.set_num_threads(args.threads)
    # --cached-only re-renders what this same command (without the flag) measured; show the measuring command
    command = "python scripts/make_results.py " + " ".join(a for a in (sys.argv[1:] if argv is None else argv)
                                                           if a != "--cached-only")

    mm = load(args.bundle)
    bundle = mm.bundle
    fp = fingerprint(bundle)
    work = Path(args.work) / f"{bundle.name}-{fp}-n{args.n}-m{args.n_mixed}"  # --n-side results are keyed by limit
    (work / "data").mkdir(parents=True, exist_ok=True)
    (work / "results").mkdir(parents=True, exist_ok=True)
    log(f"bundle {bundle.folder} ({fp}); work dir {work}")
    data = write_eval_data(bundle, work / "data", args.n, args.n_mixed)
    tasks, names = data["tasks"], mm.adapter_names
    own = {t: bundle.adapter_for_task(t) for t in tasks}
    cache = work / "results"

    skills: dict[str, dict[str, dict]] = {t: {} for t in tasks}
    # the comparisons the goals rest on (own adapter = oracle for single-skill items, learned) use all n
    # items; the side modes (base, the other adapters, merge, sequence) use the first --n-side items
    side = args.n_side if args.n_side and args.n_side < args.n else None
    for t in tasks:
        for mode in [f"adapter:{own[t]}", "learned"]:
            skills[t][mode] = cached_eval(mm, data["skills"][t], mode, cache, args.batch_size)
        for mode in ["sequence", "merge", "base", *(f"adapter:{a}" for a in names if a != own[t])]:
            skills[t][mode] = cached_eval(mm, data["skills"][t], mode, cache, args.batch_size, side)
        skills[t]["oracle"] = {**skills[t][f"adapter:{own[t]}"], "routing": "oracle"}
    mixed = {m: cached_eval(mm, data["mixed"], m, cache, args.batch_size) for m in MIXED_MODES} \
        if args.n_mixed else {}
    router = {"held_out": router_accuracy(mm, tasks, args.n_router, cache),
              "manifest": bundle.extra.get("routers", {})}

    cost = {}
    for mode in ["base", "merge", "sequence", "learned", "oracle"]:
        runs = [skills[t][mode] for t in tasks] + ([mixed[mode]] if mode in mixed else [])
        secs, toks, n = (sum(r[k] for r in runs) for k in ("seconds", "generated_tokens", "n"))
        cost[mode] = {"tokens_per_s": toks / max(secs, 1e-9), "seconds_per_item": secs / max(n, 1),
                      "tokens_per_item": toks / max(n, 1)}
    base = "SmolLM2-135M-Instruct (embedded 4-bit GGUF, dequantized)" if bundle.base == "default" else bundle.base
    res = {"bundle": str(bundle.folder), "base": base, "fingerprint": fp, "n": args.n, "n_side": args.n_side, "n_mixed": args.n_mixed,
           "date": time.strftime("%Y-%m-%d"), "batch_size": args.batch_size, "threads": torch.get_num_threads(),
           "machine": f"{platform.machine()}, {torch.get_num_threads()} torch threads, torch {torch.__version__}",
           "tasks": tasks, "adapters": names, "own_adapter": own, "data": data, "skills": skills,
           "mixed": mixed, "router": router, "cost": cost, "anchors": {"palm_540b_answer_only": PALM_540B,
                                                                      "smollm2_135m_instruct_bbh": SMOLLM2_BBH}}
    res["goals"] = goals(skills, mixed, own)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    images = plots(res, out.parent, out.stem)
    out.write_text(render(res, command, images) + "\n", encoding="utf-8")
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(res, indent=2) + "\n")
    log(f"wrote {out}, {', '.join(images)} and {args.json}")
    for g in res["goals"]:
        log(f"goal: {g['goal']}: {'n/m' if g['met'] is None else 'met' if g['met'] else 'NOT met'} ({g['measured']})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
