"""The served data-free chooser (`--router hybrid`) beside the bundle's learned router on one split, same items, same
evaluation code: skills, general retention and two-skill items.

    .venv/bin/python -m experiments.routing_eval --split test2 --n 100 --n-general 60 --n-mixed 50 \
        --cache runs/hybrid_cache400 --work runs/routing_test2 --json docs/routing_test2.json [--threads 2]

On the embedded default bundle (molora.load(None)):

- learned: the bundle's learned router, per token (evaluation mode "learned");
- hybrid: the chooser `molora serve --router hybrid` builds (molora.userbundle.HYBRID_ROUTER, calibrated from --cache
  as the server does, molora.calibration.hybrid_chooser), one adapter or the base model per request (mode
  "sequence"; a two-skill item: one pick for the whole conversation), and on the two-skill items also per turn
  (hybrid_turn, mode "turn": each turn's own pick);
- sequence: the learned router's one adapter per request (mode "sequence"), on the two-skill items only: the
  "one adapter per request" baseline.

Items: --n per skill (molora.eval.heldout; test2 leaves out every val and test item), the first --n-general general
prompts of the split (test2 has none of its own: the test split's, as experiments/quant_eval.py reads them), --n-mixed
two-skill items of the split's mixed seed. Every number comes with the per-item hits, so differences get paired 95%
intervals (experiments/quant_eval.py's). Runs are cached under --work (an interrupted run resumes); the record is
written at the end. No setting is chosen here: the hybrid's were chosen on validation (docs/datafree_hybrid_choice.json,
docs/hybrid_pool_size_choice.json).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

from experiments.quant_eval import paired_ci95, wilson95  # (paired and single-proportion intervals)
from tools.make_results import cached  # (the one cache of evaluation runs)

SUMMARY = ("n", "accuracy", "seconds", "generated_tokens")


def main(argv: list[str] | None = None) -> int:
    import torch

    from molora.bench.common import machine_info
    from molora.bundle import load
    from molora.calibration import hybrid_chooser
    from molora.data.general import general_split
    from molora.data.jsonl import read_jsonl, write_jsonl
    from molora.data.skills import write_bbh_file
    from molora.eval.general import evaluate_general
    from molora.eval.heldout import fingerprint, held_out, held_out_mixed, training_inputs
    from molora.eval.runner import evaluate
    from molora.routing.hybrid import HybridSettings
    from molora.userbundle import router_entry

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--split", required=True, choices=["val", "test", "test2"])
    ap.add_argument("--n", type=int, default=100)
    ap.add_argument("--n-general", type=int, default=60)
    ap.add_argument("--n-mixed", type=int, default=50)
    ap.add_argument("--cache", required=True, help="the served chooser's calibration cache (cold: computed)")
    ap.add_argument("--work", required=True)
    ap.add_argument("--json", required=True)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--batch-size", type=int, default=16)
    a = ap.parse_args(argv)
    torch.set_num_threads(a.threads)
    work = Path(a.work)
    (work / "data").mkdir(parents=True, exist_ok=True)
    mm = load(None)
    bundle = mm.bundle
    learned = mm.router
    router = router_entry("hybrid")
    t0 = time.perf_counter()
    hybrid = hybrid_chooser(mm, HybridSettings.from_json(router), Path(a.cache))
    build_s = time.perf_counter() - t0

    def use(r: Any) -> None:  # mm.router is a registered submodule while it holds the learned router
        mm._modules.pop("router", None)
        mm.__dict__.pop("router", None)
        mm.router = r

    banned = training_inputs(bundle)
    tasks = [ad.tasks[0] for ad in bundle.adapters if ad.tasks]
    methods = {"learned": (learned, "learned"), "hybrid": (hybrid, "sequence")}
    skills: dict[str, dict] = {t: {} for t in tasks}
    for t in tasks:
        items, _ = held_out(t, a.n, banned, split=a.split)
        path = work / "data" / f"{a.split}_{t}.json"
        write_bbh_file(path, items)
        for label, (r, mode) in methods.items():
            use(r)
            s, preds = _run(
                work / f"{t}__{label}.json",
                lambda m=mode, p=path: evaluate(mm, f"bbh:{p}", m, progress=False, batch_size=a.batch_size),
            )
            skills[t][label] = {k: s[k] for k in SUMMARY} | {"hits": _hits(preds)}
        skills[t]["hybrid"]["picks"] = _picks(hybrid.choose_served(mm, [it.input for it in items]), skills[t])
    rows = general_split()["test" if a.split == "test2" else a.split][: a.n_general]
    gpath = work / "data" / "general.jsonl"
    write_jsonl(gpath, [{"id": r["id"], "source": r["source"], "prompt": r["prompt"]} for r in rows])
    general = {}
    for label, (r, mode) in methods.items():
        use(r)
        g, _ = _run(
            work / f"general__{label}.json",
            lambda m=mode: evaluate_general(mm, f"general:{gpath}", m, batch_size=a.batch_size),
        )
        general[label] = {k: g[k] for k in ("n", "retention", "empty_where_base_answers", "adapter_token_share")}
        kept = round(g["retention"] * g["n"] / 100)
        general[label]["retention_ci95"] = [round(100 * x, 2) for x in wilson95(kept, g["n"])]
    mixed = {}
    if a.n_mixed:
        mpath = work / "data" / "mixed.jsonl"
        write_jsonl(mpath, held_out_mixed(tasks, a.n_mixed, banned, split=a.split))
        for label, r, mode in [
            ("sequence", learned, "sequence"),
            ("learned", learned, "learned"),
            ("hybrid", hybrid, "sequence"),
            ("hybrid_turn", hybrid, "turn"),
        ]:
            use(r)
            s, preds = _run(
                work / f"mixed__{label}.json",
                lambda m=mode: evaluate(mm, f"mixed:{mpath}", m, progress=False, batch_size=a.batch_size),
            )
            mixed[label] = {k: s[k] for k in (*SUMMARY, "item_accuracy")} | {"hits": _hits(preds)}
        for v in mixed.values():
            v["vs_sequence"] = round(v["accuracy"] - mixed["sequence"]["accuracy"], 2)
            v["vs_sequence_ci95"] = paired_ci95(v["hits"], mixed["sequence"]["hits"])
    for by in skills.values():
        for v in by.values():
            v["vs_learned"] = round(v["accuracy"] - by["learned"]["accuracy"], 2)
            v["vs_learned_ci95"] = paired_ci95(v["hits"], by["learned"]["hits"])
    rec = {
        "command": "python -m experiments.routing_eval " + " ".join(argv if argv is not None else sys.argv[1:]),
        "date": time.strftime("%Y-%m-%d"),
        "machine": machine_info() | {"threads": a.threads, "loadavg_end": [round(x, 2) for x in os.getloadavg()]},
        "split": a.split,
        "fingerprint": fingerprint(bundle),
        "hybrid_router": router,
        "hybrid_build_s": round(build_s, 1),
        "n": a.n,
        "n_general": len(rows),
        "n_mixed": a.n_mixed,
        "skills": skills,
        "general": general,
        "mixed": mixed,
        "mixed_items": len(read_jsonl(work / "data" / "mixed.jsonl")) if a.n_mixed else 0,
    }
    Path(a.json).write_text(json.dumps(rec, indent=1) + "\n")
    print(json.dumps({t: {k: v["accuracy"] for k, v in by.items()} for t, by in skills.items()}))
    print(
        json.dumps(
            {
                "general": {k: v["retention"] for k, v in general.items()},
                "mixed": {k: v["accuracy"] for k, v in mixed.items()},
            }
        )
    )
    return 0


def _run(path: Path, run: Any) -> tuple[dict, list[dict]]:
    """`cached` with the predictions read back (the per-item hits the paired intervals need)."""
    s = cached(path, run)
    preds = [json.loads(line) for line in path.with_suffix(".jsonl").read_text().splitlines() if line.strip()]
    return s, preds


def _picks(choices: list[dict], by: dict) -> dict:
    """What the hybrid chose on a skill's items (its decisions again, deterministic: the same calls the evaluation
    made): per pick (an adapter, or "base"), how many items and how many of them it answered right; for the items it
    kept on the base model, the range of Arrow's claimed share and of the largest z (the rule's two signals)."""
    hits = by["hybrid"]["hits"]
    out: dict = {"by_pick": {}}
    for c, h in zip(choices, hits):
        k = out["by_pick"].setdefault(c["adapter"] or "base", {"items": 0, "right": 0})
        k["items"] += 1
        k["right"] += h == "1"
    home = [c for c in choices if c["adapter"] is None]
    if home:
        tops = [max(c["z"].values()) for c in home if c["z"]]
        out["base_share_range"] = [min(c["share"] for c in home), max(c["share"] for c in home)]
        out["base_top_z_range"] = [round(min(tops), 3), round(max(tops), 3)] if tops else None
    return out


def _hits(preds: list[dict]) -> str:
    """ "1"/"0" per scored prediction (a two-skill item: per part), in file order."""
    return "".join("1" if p["correct"] else "0" for p in preds)


def _goals(rec: dict) -> str:
    """The data-free goals read off the record: every skill within 10 points of the learned router, >= 95% of general
    prompts answered as the base model answers with none empty, the two-skill items >= one adapter per request + 10
    (per turn, as a served chat turn is chosen)."""
    worst = min(rec["skills"].items(), key=lambda kv: kv[1]["hybrid"]["vs_learned"])
    g = rec["general"]["hybrid"]
    out = [
        f"within 10 points of learned on every skill {'met' if worst[1]['hybrid']['vs_learned'] >= -10 else 'not met'}"
        f" (worst: {worst[0]} {worst[1]['hybrid']['vs_learned']:+.1f})",
        f"general >= 95% {'met' if g['retention'] >= 95 and g['empty_where_base_answers'] == 0 else 'not met'} "
        f"({g['retention']:.1f}%, {g['empty_where_base_answers']:.1f}% empty)",
    ]
    if rec["mixed"]:
        d = rec["mixed"]["hybrid_turn"]["vs_sequence"]
        out.append(f"two-skill items >= sequence + 10 {'met' if d >= 10 else 'not met'} (hybrid_turn {d:+.1f})")
    return "; ".join(out)


def render_section(rec: dict) -> list[str]:
    """docs/results.md's section on this record: the three tables, differences with their paired intervals."""
    tasks = list(rec["skills"])
    m = rec["machine"]
    out = [
        f"## The served data-free chooser beside the learned router on {rec['split']}",
        "",
        f"`{rec['command']}` on {rec['date']} ({m['cpu']}, {m['threads']} threads, load average "
        f"{m['loadavg_end'][0]} at the end; bundle {rec['fingerprint']}): the chooser `molora serve --router hybrid` "
        f"builds (pool of {rec['hybrid_router']['pool_n']} turns, settings chosen on validation), one adapter or the "
        f"base model per request, against the bundle's learned router (per token), {rec['n']} items per skill, "
        f"{rec['n_general']} general prompts, {rec['n_mixed']} two-skill items; "
        + ("scored once, " if rec["split"].startswith("test") else "")
        + "no setting chosen here. Strict accuracy %; in brackets the paired 95% interval on the difference "
        "(points). The data-free goals on these items: " + _goals(rec) + ".",
        "",
        "| skill | learned | hybrid | hybrid - learned |",
        "|---|---:|---:|---|",
    ]
    for t in tasks:
        by = rec["skills"][t]
        h = by["hybrid"]
        lo, hi = h["vs_learned_ci95"]
        out.append(
            f"| {t} | {by['learned']['accuracy']:.1f} | {h['accuracy']:.1f} | {h['vs_learned']:+.1f} "
            f"[{lo:+.1f}, {hi:+.1f}] |"
        )
    picks = {t: by["hybrid"].get("picks") for t, by in rec["skills"].items()}
    if all(picks.values()):
        out += ["", "The hybrid's picks on each skill's items (items, of them answered right):", ""]
        for t, p in picks.items():
            line = f"- {t}: " + ", ".join(f"{k} {v['items']} ({v['right']} right)" for k, v in p["by_pick"].items())
            if "base_share_range" in p:
                lo, hi = p["base_share_range"]
                line += f"; kept on the base model with Arrow's claimed share {lo:.3f}-{hi:.3f}"
                if p.get("base_top_z_range"):
                    zl, zh = p["base_top_z_range"]
                    line += f" and top z {zl:.2f}-{zh:.2f}"
                line += f" (the rule: share >= {rec['hybrid_router']['arrow']['prompt_share']} or z >= "
                line += f"{rec['hybrid_router']['z_or']})"
            out.append(line)
    out += ["", "| general prompts | retention % (95% interval) | empty where the base answers % | adapter tokens % |"]
    out += ["|---|---|---:|---:|"]
    for k, g in rec["general"].items():
        lo, hi = g["retention_ci95"]
        out.append(
            f"| {k} | {g['retention']:.1f} [{lo:.1f}, {hi:.1f}] | {g['empty_where_base_answers']:.1f} | "
            f"{g['adapter_token_share']:.1f} |"
        )
    if rec["mixed"]:
        out += [
            "",
            "| two-skill items | part accuracy % | both right % | vs one adapter per request (sequence) |",
            "|---|---:|---:|---|",
        ]
        for k, v in rec["mixed"].items():
            lo, hi = v["vs_sequence_ci95"]
            out.append(
                f"| {k} | {v['accuracy']:.1f} | {v['item_accuracy']:.1f} | {v['vs_sequence']:+.1f} "
                f"[{lo:+.1f}, {hi:+.1f}] |"
            )
    return out + [""]


if __name__ == "__main__":
    raise SystemExit(main())
