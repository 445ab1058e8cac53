"""Choose the base-expert settings (confidence, prompt_share) and re-examine carry and probe, on validation only.

    .venv/bin/python -m experiments.choose_base_expert --bundle DIR [--n-skill 50] [--n-mixed 30] [--write]

Validation items only (molora.eval.heldout split "val"; molora.data.general "val"); nothing here reads a test item.

1. Probe shares (forwards only). For each confidence in a grid, the share of each validation prompt's tokens the
   probe gives to adapters: general prompts, each skill's questions, and the first questions of two-skill items.
   For each confidence, `choose_prompt_share` keeps every skill's prompts routed (its 1% loss bound holds per skill,
   not pooled) and as many general prompts as possible on the base. The chosen confidence keeps the most general
   prompts on the base (ties: the lowest).
2. Generation (greedy) with the chosen settings: learned routing on every skill's validation items beside the
   skill's own adapter, on mixed items, and base retention on the general validation prompts; and the policy
   variants carry/probe re-examined on the skills: learned without the probe, without carry and probe.

Writes one JSON record (--out, default docs/validation.json) and, with --write, the chosen settings into each
router.json of the bundle (the joint per-block router gets both; a router without a probe gets confidence only).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path

import torch

from molora.bundle import load
from molora.data.general import general_split
from molora.data.jsonl import write_jsonl
from molora.data.skills import write_bbh_file
from molora.eval.general import choose_prompt_share, evaluate_general, probe_shares
from molora.eval.heldout import fingerprint, held_out, held_out_mixed, training_inputs
from molora.eval.runner import evaluate
from molora.routing.learned import LearnedRouter

GRID = (0.0, 0.1, 0.2, 0.3, 0.5, 0.7)
MARGIN = 0.05  # a prompt counts as separated this far from prompt_share
SYSTEM = "You are a helpful assistant."  # what many OpenAI clients send first


def log(msg: str) -> None:
    print(f"[choose_base_expert {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def stage1(mm, router: LearnedRouter, prompts: dict[str, list[str]], cached: dict | None = None) -> dict:
    """Probe shares per confidence (or `cached`: an earlier record's grid for these prompts); the prompt_share
    chosen for each; the confidence chosen: the most prompts separated by at least MARGIN on the right side of
    their prompt_share (general below, skill above), ties to the lowest confidence. Without the margin a
    threshold that squeezes between two shares 0.01 apart would win, and would not hold on new prompts."""
    base_cfg = router.config
    rows = {}
    for c in GRID:
        router.config = dataclasses.replace(base_cfg, confidence=c, prompt_share=0.0)
        shares = cached[str(c)]["shares"] if cached else {k: probe_shares(mm, router, v) for k, v in prompts.items()}
        per_skill = {k: v for k, v in shares.items() if k != "general"}
        skill = [x for v in per_skill.values() for x in v]
        gen = shares["general"]
        s = choose_prompt_share(gen, per_skill)  # the loss bound holds for each skill (and the mixed firsts)
        kept = sum(g < s for g in gen) / len(gen)
        robust = (sum(g < s - MARGIN for g in gen) / len(gen) + sum(x >= s + MARGIN for x in skill) / len(skill)) / 2
        rows[str(c)] = {
            "prompt_share": s,
            "general_on_base": round(100 * kept, 2),
            "skill_locked": round(100 * sum(x < s for x in skill) / len(skill), 2),
            "skill_locked_per_skill": {k: sum(x < s for x in v) for k, v in per_skill.items()},
            "separated_with_margin": round(100 * robust, 2),
            "min_skill_share": round(min(skill), 4),
            "shares": {k: [round(x, 4) for x in v] for k, v in shares.items()},
        }
        log(
            f"confidence {c}: prompt_share {s}, general prompts kept on the base {100 * kept:.1f}%, "
            f"separated by {MARGIN}: {100 * robust:.1f}%, lowest skill share {min(skill):.3f}"
        )
    router.config = base_cfg
    best = max(GRID, key=lambda c: (rows[str(c)]["separated_with_margin"], -c))
    return {"grid": rows, "confidence": best, "prompt_share": rows[str(best)]["prompt_share"], "margin": MARGIN}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--bundle", required=True)
    p.add_argument("--n-skill", type=int, default=50)
    p.add_argument("--n-mixed", type=int, default=30)
    p.add_argument("--n-generate", type=int, default=None, help="skill items per skill for step 2 (default --n-skill)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--work", default="runs/validation")
    p.add_argument("--out", default="docs/validation.json")
    p.add_argument("--write", action="store_true", help="write the chosen settings into the bundle's router.json files")
    p.add_argument("--skip-generation", action="store_true", help="stage 1 only")
    p.add_argument("--stage1", default=None, help="reuse the probe shares of an earlier record (same prompts)")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    command = "python -m experiments.choose_base_expert " + " ".join(sys.argv[1:])
    mm = load(args.bundle)
    bundle = mm.bundle
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    banned = training_inputs(bundle)
    tasks = [a.tasks[0] for a in bundle.adapters if a.tasks]
    skill_items = {t: held_out(t, args.n_skill, banned, split="val")[0] for t in tasks}
    mixed = held_out_mixed(tasks, args.n_mixed, banned, split="val")
    general = general_split()["val"]
    prompts = {
        "general": [g["prompt"] for g in general],
        **{t: [it.input for it in v] for t, v in skill_items.items()},
        "mixed_first": [r["parts"][0]["input"] for r in mixed],
    }
    record = {
        "bundle": str(bundle.folder),
        "fingerprint_before": fingerprint(bundle),
        "command": command,
        "date": time.strftime("%Y-%m-%d"),
        "threads": args.threads,
        "n_skill": args.n_skill,
        "n_mixed": args.n_mixed,
        "n_general": len(general),
        "routers": {},
    }
    variants = ["router"] + [v for v in ("router_shared", "router_composable") if (bundle.folder / v).is_dir()]
    for v in variants:
        router = mm.router if v == "router" else LearnedRouter.load(bundle.folder / v).to(mm.device)
        if not router.probe_prompt:  # no probe, no prompt share: such a router keeps its argmax (confidence 0)
            log(f"stage 1: {v} has no probe pass; its settings stay confidence 0, prompt_share 0")
            continue
        log(f"stage 1: {v}")
        cached = json.loads(Path(args.stage1).read_text())["routers"][v]["grid"] if args.stage1 else None
        record["routers"][v] = stage1(mm, router, prompts, cached)
        if args.write:
            chosen = record["routers"][v]
            router.config = dataclasses.replace(
                router.config, confidence=chosen["confidence"], prompt_share=chosen["prompt_share"]
            )
            router.save(bundle.folder / v)
    if not args.skip_generation:
        chosen = record["routers"]["router"]
        router = mm.router
        router.config = dataclasses.replace(
            router.config, confidence=chosen["confidence"], prompt_share=chosen["prompt_share"]
        )
        policies = {
            "chosen": router.config,
            "no_probe": dataclasses.replace(router.config, probe_prompt=False, prompt_share=0.0),
            "no_carry": dataclasses.replace(router.config, probe_prompt=False, prompt_share=0.0, carry_blocks=0),
        }
        gen = {}
        n_gen = args.n_generate or args.n_skill
        for t in tasks:
            write_bbh_file(work / f"{t}.json", skill_items[t][:n_gen])
            spec = f"bbh:{work / f'{t}.json'}"
            own = bundle.adapter_for_task(t)
            gen[t] = {"own": evaluate(mm, spec, f"adapter:{own}", progress=False)[0]}
            for name, cfg in policies.items():
                router.config = cfg
                gen[t][name] = evaluate(mm, spec, "learned", progress=False)[0]
            router.config = policies["chosen"]
            log(f"{t}: " + ", ".join(f"{k} {s['accuracy']}" for k, s in gen[t].items()))
        write_jsonl(work / "mixed.jsonl", mixed[:n_gen])
        gen["mixed"] = {
            m: evaluate(mm, f"mixed:{work / 'mixed.jsonl'}", m, progress=False)[0] for m in ("learned", "sequence")
        }
        log("mixed: " + ", ".join(f"{k} {s['accuracy']}" for k, s in gen["mixed"].items()))
        write_jsonl(
            work / "general_val.jsonl", [{"id": g["id"], "source": g["source"], "prompt": g["prompt"]} for g in general]
        )
        gsum, _ = evaluate_general(mm, f"general:{work / 'general_val.jsonl'}", "learned")
        gen["general"] = {"learned": gsum}
        log(f"general: {json.dumps(gsum)}")
        write_jsonl(
            work / "general_val_system.jsonl",
            [{"id": g["id"], "source": g["source"], "prompt": g["prompt"], "system": SYSTEM} for g in general],
        )
        gsum, _ = evaluate_general(mm, f"general:{work / 'general_val_system.jsonl'}", "learned")
        gen["general"]["learned_with_system"] = gsum
        log(f"general with a system message: {json.dumps(gsum)}")
        record["generation"] = gen
    record["fingerprint_after"] = fingerprint(bundle)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(record, indent=2) + "\n")
    log(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
