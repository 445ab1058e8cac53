"""Measure Arrow routing (no training data) on the default bundle into docs/arrow.json; render its section.

    .venv/bin/python -m tools.make_arrow [--n 24] [--n-val 6] [--n-general 40] [--threads 1] [--reps 7] [--skip speed]

Three parts, each cached under --work so an interrupted run resumes:

1. **Speed and exactness**: molora's Arrow (per-linear and per-block, sparse dispatch) against PEFT's
   `create_arrow_model` (every adapter for every token, mixed) on the same base model (SmolLM2-135M) and the
   bundle's K=4 adapters: prefill (B rows of L tokens) and decode (one token per row over a cached context),
   the variants interleaved with their order rotated every repetition, medians. molora's per-linear Arrow uses
   PEFT's own prototype estimator (method "power", the same seed) for this part, and its logits are checked
   against PEFT's in the same run.
2. **Choices on validation items** (`molora.eval.heldout` split "val", never test): Arrow's top_k per
   granularity, by mean strict accuracy over the skills.
3. **Test items** (split "test", the first --n per skill): Arrow per-linear and per-block (the chosen settings)
   beside the learned router, the own adapter (= oracle), sequence and base, scored by `molora.eval.runner`;
   and base retention on the general test prompts (`molora.eval.general`).

`render_section(record)` turns docs/arrow.json into markdown; tools/make_results.py appends it to
docs/results.md when the record exists.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from molora.data.jsonl import read_jsonl
from tools.make_results import cached  # (the one cache of evaluation runs)

DOCS = Path("docs")
TOP_KS = (1, 2)  # the validation grid (temperature matters only for top_k > 1: PEFT's 1.0)
SPEED_KS = (1, 3)  # top-1 (molora's sparse case) and PEFT's default top-3


def log(msg: str) -> None:
    print(f"[make_arrow {time.strftime('%H:%M:%S')}] {msg}", flush=True)


# ------------------------------------------------------------------------------------------- speed


def speed(bundle: Any, reps: int, rows: int, length: int) -> dict:
    """Interleaved prefill / decode timings and logit differences, molora's Arrow vs PEFT's (module docstring)."""
    import torch
    from peft import ArrowConfig as PeftArrowConfig
    from peft import create_arrow_model
    from transformers import DynamicCache

    from molora.model.attach import attach
    from molora.model.base import load_base
    from molora.routing.arrow import ArrowConfig, ArrowRouter

    names = [a.name for a in bundle.adapters]
    base, tok = load_base(bundle.base, torch.float32)
    mm = attach(
        load_base(bundle.base, torch.float32)[0],
        {a.name: a.path for a in bundle.adapters},
        slots=bundle.slots,
        max_rank=bundle.max_rank,
    )
    peft = create_arrow_model(
        load_base(bundle.base, torch.float32)[0],
        [str(a.path) for a in bundle.adapters],
        PeftArrowConfig(top_k=SPEED_KS[0], router_temperature=1.0, rng_seed=0),
    ).eval()
    text = (
        "Count the fruits: I have an apple, two bananas and a grape. Then evaluate ((-3 + 7) * (2 - 5)) and "
        "close the brackets of [ ( { } ) and decide if walking 3 steps forward then 3 back returns. "
    ) * 24
    ids = torch.tensor(tok(text, add_special_tokens=False)["input_ids"][: rows * length]).view(rows, length)
    step = ids[:, -1:].clone()

    def set_peft_k(k: int) -> None:
        for m in peft.modules():
            if hasattr(m, "lora_arrow"):
                m.lora_arrow["arrow_router"].top_k = k

    out: dict = {"rows": rows, "length": length, "reps": reps, "K": len(names), "by_k": {}}
    for k in SPEED_KS:
        routers = {
            g: ArrowRouter(ArrowConfig(top_k=k, granularity=g, method="power", seed=0), names)
            for g in ("per_linear", "per_block")
        }
        variants = {
            "base": lambda **kw: mm.model(**kw),
            "peft_arrow": lambda **kw: (set_peft_k(k), peft(**kw))[1],
            "molora_per_linear": lambda **kw: mm(adapter_ids=routers["per_linear"], **kw),
            "molora_per_block": lambda **kw: mm(adapter_ids=routers["per_block"], **kw),
        }
        caches = {}
        with torch.no_grad():
            logits = {v: f(input_ids=ids, use_cache=False).logits for v, f in variants.items()}
            for v, f in variants.items():  # a prompt's cache per variant, cut back to it after each decode step
                caches[v] = DynamicCache()
                f(input_ids=ids, cache=caches[v], use_cache=True)
            dec = {v: f(input_ids=step, cache=caches[v], use_cache=True).logits for v, f in variants.items()}
            for c in caches.values():
                c.crop(-1)
        diff = {v: float((logits[v] - logits["peft_arrow"]).abs().max()) for v in variants}
        ddiff = {v: float((dec[v] - dec["peft_arrow"]).abs().max()) for v in variants}
        times: dict[str, dict[str, list[float]]] = {
            "prefill": {v: [] for v in variants},
            "decode": {v: [] for v in variants},
        }
        order = list(variants)
        with torch.no_grad():
            for r in range(reps):
                rot = order[r % len(order) :] + order[: r % len(order)]  # rotate: no variant always runs first
                for v in rot:
                    t0 = time.perf_counter()
                    variants[v](input_ids=ids, use_cache=False)
                    times["prefill"][v].append(time.perf_counter() - t0)
                    t0 = time.perf_counter()
                    variants[v](input_ids=step, cache=caches[v], use_cache=True)
                    times["decode"][v].append(time.perf_counter() - t0)
                    caches[v].crop(-1)
        med = {ph: {v: statistics.median(ts) for v, ts in d.items()} for ph, d in times.items()}
        out["by_k"][str(k)] = {
            "median_s": med,
            "speedup_over_peft": {ph: {v: med[ph]["peft_arrow"] / med[ph][v] for v in variants} for ph in med},
            "over_base": {ph: {v: med[ph][v] / med[ph]["base"] for v in variants} for ph in med},
            # the time the adapters add over the base model: PEFT's divided by each variant's
            "added_time_peft_over": {
                ph: {
                    v: (med[ph]["peft_arrow"] - med[ph]["base"]) / max(med[ph][v] - med[ph]["base"], 1e-9)
                    for v in variants
                    if v != "base"
                }
                for ph in med
            },
            "max_abs_logit_diff_vs_peft": {"prefill": diff, "decode": ddiff},
        }
        log(
            f"speed top_k={k}: {json.dumps(out['by_k'][str(k)]['speedup_over_peft'])} diff "
            f"{diff['molora_per_linear']:.2e}"
        )
    return out


# ------------------------------------------------------------------------------------------- quality


def quality(args: argparse.Namespace, work: Path) -> dict:
    import torch

    from molora.bundle import load
    from molora.data.general import general_split
    from molora.data.jsonl import write_jsonl
    from molora.data.skills import write_bbh_file
    from molora.eval.general import evaluate_general
    from molora.eval.heldout import held_out, training_inputs
    from molora.eval.runner import evaluate
    from molora.routing.arrow import ArrowConfig, ArrowRouter

    torch.set_num_threads(args.threads)
    mm = load(None)
    bundle, learned = mm.bundle, mm.router
    names = mm.adapter_names
    banned = training_inputs(bundle)
    tasks = [a.tasks[0] for a in bundle.adapters if a.tasks]
    own = {t: bundle.adapter_for_task(t) for t in tasks}
    (work / "data").mkdir(parents=True, exist_ok=True)

    def task_file(t: str, split: str, n: int) -> str:
        items, _ = held_out(t, max(n, 100) if split == "test" else n, banned, split=split)
        path = work / "data" / f"{split}_{t}.json"
        write_bbh_file(path, items[:n])  # test: the first n of make_results' 100 items
        return f"bbh:{path}"

    def arrow(gran: str, k: int) -> ArrowRouter:
        return ArrowRouter(ArrowConfig(top_k=k, granularity=gran), names).bind(mm)

    def use(router: Any) -> None:  # mm.router is a registered submodule while it holds the learned router
        mm._modules.pop("router", None)
        mm.__dict__.pop("router", None)
        mm.router = router

    def run(tag: str, spec: str, mode: str, router: Any) -> dict:
        def go():
            use(router)
            try:
                return evaluate(mm, spec, mode, batch_size=args.batch_size, progress=False)
            finally:
                use(learned)

        return cached(work / f"{tag}.json", go)

    # 2. validation: top_k per granularity
    val: dict = {g: {} for g in ("per_linear", "per_block")}
    for gran in val:
        for k in TOP_KS:
            r = arrow(gran, k)
            acc = {
                t: run(f"val__{t}__{gran}_k{k}", task_file(t, "val", args.n_val), "learned", r)["accuracy"]
                for t in tasks
            }
            val[gran][str(k)] = {"by_task": acc, "mean": sum(acc.values()) / len(acc)}
    chosen = {g: int(max(v, key=lambda k: (v[k]["mean"], -int(k)))) for g, v in val.items()}
    log(f"chosen on validation: {chosen}")

    # 3. test
    modes = {
        "base": ("base", learned),
        "sequence": ("sequence", learned),
        "learned": ("learned", learned),
        "arrow_per_linear": ("learned", arrow("per_linear", chosen["per_linear"])),
        "arrow_per_block": ("learned", arrow("per_block", chosen["per_block"])),
    }
    skills: dict = {}
    for t in tasks:
        spec = task_file(t, "test", args.n)
        skills[t] = {"oracle": run(f"test__{t}__oracle", spec, f"adapter:{own[t]}", learned)}
        for m, (mode, router) in modes.items():
            skills[t][m] = run(f"test__{t}__{m}", spec, mode, router)
        skills[t] = {
            m: {k: s[k] for k in ("n", "accuracy", "seconds", "generated_tokens")} for m, s in skills[t].items()
        }

    rows = general_split()["test"][: args.n_general]
    write_jsonl(
        work / "data" / "general_test.jsonl",
        [{"id": r["id"], "source": r["source"], "prompt": r["prompt"]} for r in rows],
    )
    gspec = f"general:{work / 'data' / 'general_test.jsonl'}"
    general, base_ids = {}, None
    for m in ("learned", "arrow_per_linear", "arrow_per_block"):
        path = work / f"general__{m}.json"

        def go(router=modes[m][1]):
            use(router)
            try:
                return evaluate_general(mm, gspec, "learned", batch_size=args.batch_size, base_answers=base_ids)
            finally:
                use(learned)

        s = cached(path, go)
        general[m] = {k: s[k] for k in ("n", "retention", "empty_where_base_answers", "adapter_token_share")}
        base_ids = [r["base_ids"] for r in read_jsonl(path.with_suffix(".jsonl"))]
    return {
        "tasks": tasks,
        "own_adapter": own,
        "validation": val,
        "chosen_top_k": chosen,
        "skills": skills,
        "general": general,
        "n": args.n,
        "n_val": args.n_val,
        "n_general": len(rows),
    }


# ------------------------------------------------------------------------------------------- goals, rendering


def goals(rec: dict) -> list[dict]:
    out = []
    s = rec.get("speed", {}).get("by_k", {}).get("1")
    if s:
        sp = s["speedup_over_peft"]["prefill"]["molora_per_linear"]
        d = s["max_abs_logit_diff_vs_peft"]["prefill"]["molora_per_linear"]
        out.append(
            {
                "goal": "per-linear Arrow >= 3x faster than PEFT's on prefill at K=4 (top-1), equal logits",
                "measured": f"{sp:.2f}x, max |logit diff| {d:.1e}",
                "met": sp >= 3 and d < 1e-3,
            }
        )
    q = rec.get("quality")
    if q:
        gaps = {
            t: q["skills"][t]["arrow_per_block"]["accuracy"] - q["skills"][t]["learned"]["accuracy"] for t in q["tasks"]
        }
        out.append(
            {
                "goal": "per-block Arrow within 10 points of the learned router on each skill",
                "measured": ", ".join(f"{t} {v:+.1f}" for t, v in gaps.items()),
                "met": all(v >= -10 for v in gaps.values()),
            }
        )
    return out


def _table(header: list[str], rows: list[list[Any]]) -> list[str]:
    fmt = lambda v: f"{v:.1f}" if isinstance(v, float) else str(v)  # noqa: E731
    return [
        "| " + " | ".join(header) + " |",
        "|" + "|".join("---" for _ in header) + "|",
        *("| " + " | ".join(fmt(v) for v in r) + " |" for r in rows),
    ]


def render_section(rec: dict) -> list[str]:
    """docs/results.md's Arrow section (markdown lines) from docs/arrow.json."""
    cmds = sorted({p.get("command", rec["command"]) for p in (rec.get("speed"), rec.get("quality")) if p})
    out = [
        "## Arrow: routing with no training data",
        "",
        f"{' and '.join(f'`{c}`' for c in cmds)} on {rec['date']} ({rec['machine']}). Arrow (arXiv 2405.11157) "
        "routes each token by "
        "|x·v| against each adapter's top right singular vector v of B·A, top-k and softmax(/temperature); "
        "`molora/routing/arrow.py`. molora runs only the chosen adapters on its sparse dispatch; PEFT's "
        "`create_arrow_model` computes all K and mixes them.",
        "",
    ]
    sp = rec.get("speed")
    if sp:
        out += [
            f"**Speed** ({sp['rows']} rows x {sp['length']} tokens prefill; decode: one token per row over that "
            f"context; K={sp['K']}; {sp['reps']} interleaved repetitions, medians; molora per-linear with PEFT's "
            "prototype estimator so the logits must match):",
            "",
        ]
        rows = []
        for k, s in sp["by_k"].items():
            for v in ("base", "peft_arrow", "molora_per_linear", "molora_per_block"):
                rows.append(
                    [
                        k,
                        v,
                        *(f"{1000 * s['median_s'][ph][v]:.1f}" for ph in ("prefill", "decode")),
                        *(f"{s['speedup_over_peft'][ph][v]:.2f}x" for ph in ("prefill", "decode")),
                        f"{s['max_abs_logit_diff_vs_peft']['prefill'][v]:.1e}",
                    ]
                )
        out += _table(
            [
                "top_k",
                "variant",
                "prefill ms",
                "decode ms",
                "prefill vs PEFT",
                "decode vs PEFT",
                "max |logit - PEFT's|",
            ],
            rows,
        ) + [""]
        out += [
            "Time the adapters add over the base model, PEFT's divided by molora's (prefill / decode): "
            + "; ".join(
                f"top_k={k} "
                + ", ".join(
                    f"{v.replace('molora_', '')} {s['added_time_peft_over']['prefill'][v]:.1f}x / "
                    f"{s['added_time_peft_over']['decode'][v]:.1f}x"
                    for v in ("molora_per_linear", "molora_per_block")
                )
                for k, s in sp["by_k"].items()
            )
            + ".",
            "",
        ]
    q = rec.get("quality")
    if q:
        out += [
            f'**Choices on validation items** ({q["n_val"]} per skill, split "val"): mean strict accuracy % by '
            "top_k; chosen: " + ", ".join(f"{g} top_k={k}" for g, k in q["chosen_top_k"].items()) + ".",
            "",
        ]
        out += _table(
            ["granularity", "top_k", *q["tasks"], "mean"],
            [
                [g, k, *(v["by_task"][t] for t in q["tasks"]), v["mean"]]
                for g, d in q["validation"].items()
                for k, v in d.items()
            ],
        ) + [""]
        modes = ["base", "sequence", "learned", "oracle", "arrow_per_linear", "arrow_per_block"]
        out += [f"**Test items** (the first {q['n']} per skill of the test split; strict accuracy %):", ""]
        out += _table(["skill", *modes], [[t, *(q["skills"][t][m]["accuracy"] for m in modes)] for t in q["tasks"]])
        out += [
            "",
            "Arrow's decision is per token and per linear with no view of the prompt as a whole, and with the "
            "threshold off no token stays on the base model. The chat template's tokens route like any other: in a "
            "navigate prompt traced by hand (`molora route --router arrow`), `<|im_start|>assistant\\n` went to "
            "the dyck adapter, which ends the turn at once, so most navigate answers came back empty. The learned "
            "router's probe and fill (molora/routing/learned.py) exist for exactly this, and Arrow has neither.",
        ]
        out += ["", f"**General prompts** ({q['n_general']} test prompts; % answered exactly as the base model):", ""]
        out += _table(
            ["routing", "retention %", "empty where the base answers %", "answer tokens on an adapter %"],
            [
                [m, g["retention"], g["empty_where_base_answers"], g["adapter_token_share"]]
                for m, g in q["general"].items()
            ],
        ) + [""]
    gl = goals(rec)
    if gl:
        out += (
            ["**Goals:**", ""]
            + [f"- {g['goal']}: {'met' if g['met'] else 'NOT met'} ({g['measured']})" for g in gl]
            + [""]
        )
    return out


# ------------------------------------------------------------------------------------------- main


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--n", type=int, default=24, help="test items per skill (default 24)")
    p.add_argument("--n-val", type=int, default=6, help="validation items per skill for the choices (default 6)")
    p.add_argument("--n-general", type=int, default=40, help="general test prompts (default 40)")
    p.add_argument("--reps", type=int, default=7, help="interleaved repetitions of the speed part (default 7)")
    p.add_argument("--rows", type=int, default=4)
    p.add_argument("--length", type=int, default=128)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--work", default="runs/arrow_work")
    p.add_argument("--skip", default="", help="comma-separated parts to skip: speed, quality")
    p.add_argument("--render-only", action="store_true")
    args = p.parse_args(argv)
    import torch

    from molora.bundle import default_bundle_dir, read_bundle
    from molora.eval.heldout import fingerprint

    path = DOCS / "arrow.json"
    if args.render_only:
        print("\n".join(render_section(json.loads(path.read_text()))))
        return 0
    torch.set_num_threads(args.threads)
    bundle = read_bundle(default_bundle_dir())
    work = Path(args.work) / f"{fingerprint(bundle)}-n{args.n}-v{args.n_val}-g{args.n_general}"
    work.mkdir(parents=True, exist_ok=True)
    command = "python -m tools.make_arrow " + " ".join(sys.argv[1:] if argv is None else argv)
    rec = {
        "command": command,
        "date": time.strftime("%Y-%m-%d"),
        "fingerprint": fingerprint(bundle),
        "machine": f"{platform.machine()}, {torch.get_num_threads()} torch threads, torch {torch.__version__}",
    }
    skip = set(filter(None, args.skip.split(",")))
    old = json.loads(path.read_text()) if path.is_file() else {}
    rec.update({part: old[part] for part in ("speed", "quality") if part in skip and part in old})  # kept as measured
    if "speed" not in skip:
        sp = work / "speed.json"
        if not sp.is_file():
            sp.write_text(
                json.dumps({**speed(bundle, args.reps, args.rows, args.length), "command": command}, indent=2) + "\n"
            )
        rec["speed"] = json.loads(sp.read_text())
    if "quality" not in skip:
        rec["quality"] = {**quality(args, work), "command": command}
    rec["goals"] = goals(rec)
    path.write_text(json.dumps(rec, indent=2) + "\n")
    for g in rec["goals"]:
        log(f"goal: {g['goal']}: {'met' if g['met'] else 'NOT met'} ({g['measured']})")
    print(
        json.dumps(
            {
                "speed_top1": rec.get("speed", {}).get("by_k", {}).get("1", {}).get("speedup_over_peft"),
                "goals": rec["goals"],
            }
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
