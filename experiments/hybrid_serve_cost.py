"""What the served hybrid chooser costs a request end to end: `molora serve`'s app (HTTP, the engine thread) on the
default bundle with `--router hybrid`, answering each validation item once through the chooser (model=<the
bundle's name>) and once pinned to the item's own adapter (model=<adapter>), interleaved.

    .venv/bin/python -m experiments.hybrid_serve_cost --json docs/hybrid_serve_cost.json --cache runs/hybrid_cache \
        [--limit 4] [--repeats 2] [--threads 1]

The calibration is read from --cache (experiments/hybrid_serve_startup.py writes it; a cold cache computes it first).
For each skill, the first --limit validation items (`molora.eval.heldout` split "val", as experiments/arrow_cost.py
takes them) are sent one at a time as a chat turn with the evaluation's token budget for the answer kind
(`molora.eval.runner.MAX_NEW_TOKENS`), greedy; each (item, repetition) is a pair whose order rotates every pair
(style.md 18), after one untimed request under each variant. The prefix cache is off, so neither variant reuses
the other's prompt KV. Per pair the ratio of seconds and of seconds per answer token; the record keeps every pair
(with the chooser's pick), the medians overall and per skill, the chooser's own time per call (/metrics), the load
average before and after, and the machine. Before the server starts, the chooser alone is timed on every item both
ways (its separate base and adapter passes, and `joint_pass`: one forward of the prompt on the base and every
adapter), interleaved the same way; the server then runs the served path (HybridChooser.decide_stages: every pass
left in one forward while the engine has no other request, which is every request here, sent one at a time; the
record counts what the stages found, "served_stage_checks").
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import time
from pathlib import Path


def main(argv: list[str] | None = None) -> int:
    import httpx
    import torch

    from molora.bench.common import machine_info
    from molora.bundle import default_bundle_dir, read_bundle
    from molora.engine import EngineConfig
    from molora.eval.heldout import held_out, training_inputs
    from molora.eval.runner import MAX_NEW_TOKENS
    from molora.eval.tasks import answer_kind
    from molora.manifest import MANIFEST, parse_manifest
    from molora.server.app import create_app
    from molora.server.launch import ServerThread, build_engine
    from molora.userbundle import router_entry

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--json", required=True)
    ap.add_argument("--cache", required=True, help="the calibration cache (experiments/hybrid_serve_startup.py)")
    ap.add_argument("--limit", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--threads", type=int, default=1)
    a = ap.parse_args(argv)
    os.environ["MOLORA_HYBRID_CACHE"] = str(a.cache)
    torch.set_num_threads(a.threads)
    load_before = os.getloadavg()
    folder = default_bundle_dir()
    raw = json.loads((folder / MANIFEST).read_text())
    bundle = parse_manifest({**raw, "router": router_entry("hybrid")}, folder, "hybrid")
    t0 = time.perf_counter()
    engine = build_engine(bundle, EngineConfig(enable_prefix_caching=False))
    build_s = time.perf_counter() - t0
    own_bundle = read_bundle(folder)
    banned = training_inputs(own_bundle)
    tasks = [ad.tasks[0] for ad in own_bundle.adapters if ad.tasks]
    work = []
    for t in tasks:
        items, _ = held_out(t, a.limit, banned, split="val")
        work += [(t, it, own_bundle.adapter_for_task(t)) for it in items[: a.limit]]
    chooser, joint_setting = engine.mm.chooser, engine.mm.chooser.joint
    ab = []  # the chooser alone, before the server starts (nothing else runs on the model): separate passes or joint
    for _rep in range(a.repeats):
        for t, item, _ in work:
            got = {}
            flip = len(ab) % 2
            for joint in [(False, True), (True, False)][flip]:
                object.__setattr__(chooser, "joint", joint)
                t1 = time.perf_counter()
                pick = chooser.choose_served(engine.mm, [item.input])[0]["adapter"]
                got[joint] = (time.perf_counter() - t1, pick)
            ab.append(
                {
                    "task": t,
                    "separate_s": round(got[False][0], 3),
                    "joint_s": round(got[True][0], 3),
                    "same_pick": got[False][1] == got[True][1],
                }
            )
    object.__setattr__(chooser, "joint", joint_setting)
    asked = {"idle": 0, "busy": 0}  # what each served choice's stages found (Engine.choose_stages: busy or not)
    has_work = engine.scheduler.has_work

    def counted() -> bool:
        busy = has_work()
        asked["busy" if busy else "idle"] += 1
        return busy

    engine.scheduler.has_work = counted  # type: ignore[method-assign]
    pairs = []
    with ServerThread(create_app(engine)) as url, httpx.Client(base_url=url, timeout=600) as http:

        def ask(model: str, item) -> dict:  # noqa: ANN001
            budget = MAX_NEW_TOKENS.get(answer_kind(item.task, item.target), 64)
            body = {
                "model": model,
                "messages": [{"role": "user", "content": item.input}],
                "max_tokens": budget,
                "temperature": 0,
            }
            t0 = time.perf_counter()
            r = http.post("/chat/completions", json=body)
            seconds = time.perf_counter() - t0
            r.raise_for_status()
            out = r.json()
            pick = (out["choices"][0].get("molora") or {}).get("chooser", {}).get("adapter", model)
            return {"seconds": seconds, "tokens": out["usage"]["completion_tokens"], "pick": pick}

        _, first, own = work[0]
        ask(bundle.name, first), ask(own, first)  # untimed: the first requests of a process pay for allocations
        for rep in range(a.repeats):
            for t, item, own in work:
                flip = len(pairs) % 2
                variants = [("hybrid", bundle.name), ("own", own)]
                got = {name: ask(model, item) for name, model in variants[flip:] + variants[:flip]}
                h, o = got["hybrid"], got["own"]
                pairs.append(
                    {
                        "task": t,
                        "repeat": rep,
                        "first": variants[flip][0],
                        "pick": h["pick"],
                        "own_adapter": own,
                        "hybrid_s": round(h["seconds"], 3),
                        "own_s": round(o["seconds"], 3),
                        "hybrid_tokens": h["tokens"],
                        "own_tokens": o["tokens"],
                        "time_ratio": round(h["seconds"] / o["seconds"], 3),
                        "per_token_ratio": round(
                            (h["seconds"] / max(h["tokens"], 1)) / (o["seconds"] / max(o["tokens"], 1)), 3
                        ),
                    }
                )
                print(json.dumps(pairs[-1]), flush=True)
        metrics = http.get(url.removesuffix("/v1") + "/metrics").text
    total = float(re.search(r"^molora_chooser_seconds_sum (\S+)$", metrics, re.M).group(1))  # type: ignore[union-attr]
    calls = float(re.search(r"^molora_chooser_seconds_count (\S+)$", metrics, re.M).group(1))  # type: ignore[union-attr]

    def med(rows: list[dict], key: str) -> float:
        return round(statistics.median(p[key] for p in rows), 3)

    rec = {
        "command": f"python -m experiments.hybrid_serve_cost --json {a.json} --cache {a.cache} --limit {a.limit} "
        f"--repeats {a.repeats} --threads {a.threads}",
        "date": time.strftime("%Y-%m-%d"),
        "machine": machine_info(),
        "loadavg_before": [round(x, 2) for x in load_before],
        "loadavg_after": [round(x, 2) for x in os.getloadavg()],
        "router": router_entry("hybrid"),
        "engine": {"enable_prefix_caching": False},
        "build_s": round(build_s, 1),
        "limit": a.limit,
        "repeats": a.repeats,
        "served": "one forward of every pass left while the engine has no other request, else one pass per engine "
        "step (HybridChooser.decide_stages)",
        "served_stage_checks": asked,
        "chooser_ab": {
            "pairs": ab,
            "median_separate_s": med(ab, "separate_s"),
            "median_joint_s": med(ab, "joint_s"),
            "median_joint_over_separate": round(statistics.median(p["joint_s"] / p["separate_s"] for p in ab), 3),
            "same_picks": sum(p["same_pick"] for p in ab),
        },
        "chooser_calls": int(calls),
        "chooser_mean_s": round(total / calls, 3),
        "pairs": pairs,
        "picked_own_adapter": round(100 * statistics.mean(p["pick"] == p["own_adapter"] for p in pairs), 1),
        "median_time_ratio": med(pairs, "time_ratio"),
        "median_per_token_ratio": med(pairs, "per_token_ratio"),
        "per_task": {
            t: {
                "median_time_ratio": med([p for p in pairs if p["task"] == t], "time_ratio"),
                "median_per_token_ratio": med([p for p in pairs if p["task"] == t], "per_token_ratio"),
                "median_own_tokens": statistics.median(p["own_tokens"] for p in pairs if p["task"] == t),
            }
            for t in tasks
        },
    }
    Path(a.json).write_text(json.dumps(rec, indent=1) + "\n")
    print(json.dumps({k: rec[k] for k in ("median_time_ratio", "median_per_token_ratio", "chooser_mean_s")}))
    return 0


def _startup_lines(docs: Path) -> list[str]:
    out = []
    for path in sorted(docs.glob("hybrid_serve_startup*.json")):
        r = json.loads(path.read_text())
        ent = r["entropy_s"]
        out.append(
            f"- `{r['command']}` on {r['date']} (load average {r['loadavg_before'][0]} before, "
            f"{r['loadavg_after'][0]} after; {r['machine']['threads']} thread): pool of **{r['pool_prompts']}** turns. "
            f"`build_engine` (what `molora serve` runs before it listens) took {r['build_none_s']:.0f} s with no "
            f"router (the process's first build), **{r['build_hybrid_cold_s']:.0f} s** with the hybrid on an empty "
            f"cache (the pool {r['pool_s']:.0f} s; each adapter's entropies over it "
            + ", ".join(f"{k} {v:.0f} s" for k, v in ent.items())
            + f") and **{r['build_hybrid_warm_s']:.0f} s** on the cache it wrote (a restart)."
            + (f" Note: {r['note']}." if r.get("note") else "")
        )
    return out


def _served(rec: dict) -> str:
    """How the record's served choices ran (older records: one fixed setting)."""
    if "served_stage_checks" not in rec:
        return "joint pass" if rec["served_joint_pass"] else "separate passes"
    c = rec["served_stage_checks"]
    return f"one joint forward when the engine was idle: idle at {c['idle']} and busy at {c['busy']} stage checks"


def render_section(rec: dict) -> list[str]:
    """docs/results.md's section on the served hybrid chooser: its start-up calibration
    (docs/hybrid_serve_startup*.json), its pool size (docs/hybrid_pool_size_choice.json) and its cost per request
    (this script's record), each where its record exists."""
    docs = Path(__file__).resolve().parent.parent / "docs"
    out = [
        "## Serving the hybrid data-free chooser (`--router hybrid`)",
        "",
        "`molora serve --model M --lora-modules ... --router hybrid` serves the hybrid above with its validation "
        "setting (`molora.userbundle.HYBRID_ROUTER`): calibrated at start-up on the user's own base and adapters "
        "(`molora/calibration.py`, cached on disk), then asked per request on the engine thread (docs/serving.md). "
        "Measured on the default bundle's base and adapters (its ChatML template), 1 thread:",
        "",
        *_startup_lines(docs),
    ]
    size = docs / "hybrid_pool_size_choice.json"
    if size.is_file():
        z = json.loads(size.read_text())
        cols = [k for k in z["grid"][0] if k != "pool_n"]
        full = {k: v for k, v in max(z["grid"], key=lambda r: r["pool_n"]).items() if k != "pool_n"}
        j = z["joint_pass_check"]
        out += [
            "",
            f"**Pool size, chosen on validation** (`{z['command']}`; {z['n_val_prompts']} validation prompts of "
            "experiments/datafree_hybrid.py, same `hit_rates`; the first n turns of the 800-turn pool are the pool of "
            "n). "
            f"Rule: {z['rule']}. Chosen: **{z['chosen']['pool_n']}** turns. Check that the served calibration is the "
            "validated one: the 800-turn row is "
            + ("identical to" if full == z["validated_choice_row"] else "**not** identical to")
            + " the committed choice's validation row (docs/datafree_hybrid_choice.json), and the pool statistics "
            + ("equal" if z["served_pool_stats"] == z["committed_pool_stats"] else "**differ from**")
            + " docs/datafree_confidence/confidence.json's to 4 decimals. The served per-request path (one joint "
            f"forward of the prompt on the base and every adapter) picks differently on {j['picks_differ']} of the "
            f"{z['n_val_prompts']} prompts (largest entropy difference {j['max_abs_entropy_diff']:g}).",
            "",
            "| pool turns | " + " | ".join(cols) + " |",
            "|---" * (len(cols) + 1) + "|",
            *[f"| {r['pool_n']} | " + " | ".join(str(r[c]) for c in cols) + " |" for r in z["grid"]],
        ]
    ok = rec["median_time_ratio"] <= 1.25
    out += [
        "",
        f"**Cost per request, served** (`{rec['command']}` on {rec['date']}, load average {rec['loadavg_before'][0]} "
        f"before and {rec['loadavg_after'][0]} after): the first {rec['limit']} validation items of each skill sent "
        "one at a time over HTTP, through the chooser (model = the bundle) and pinned to the skill's own adapter, "
        f"interleaved with the order rotated, {rec['repeats']} repetitions, prefix cache off. Median time ratio "
        f"**{rec['median_time_ratio']:.3f}x** (goal <= 1.25x: {'met' if ok else 'not met'}), per answer token "
        f"{rec['median_per_token_ratio']:.2f}x; the chooser's own time {rec['chooser_mean_s']:.2f} s per call "
        f"(mean of {rec['chooser_calls']}, {_served(rec)}); it "
        f"picked the item's own adapter in {rec['picked_own_adapter']}% of pairs. The chooser alone, before serving: "
        f"median {rec['chooser_ab']['median_separate_s']:.2f} s per prompt with separate base and adapter passes, "
        f"{rec['chooser_ab']['median_joint_s']:.2f} s with one joint forward (median ratio "
        f"{rec['chooser_ab']['median_joint_over_separate']:.2f}x; same pick in {rec['chooser_ab']['same_picks']} of "
        f"{len(rec['chooser_ab']['pairs'])}).",
        "",
        "| skill | median time ratio | median per-token ratio | median answer tokens (own) |",
        "|---|---|---|---|",
        *[
            f"| {t} | {v['median_time_ratio']:.2f} | {v['median_per_token_ratio']:.2f} | {v['median_own_tokens']} |"
            for t, v in rec["per_task"].items()
        ],
        "",
    ]
    return out


if __name__ == "__main__":
    raise SystemExit(main())
