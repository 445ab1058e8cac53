"""Measure vocabulary routing on the early-fusion digits bundle and render its docs.

    .venv/bin/python -m tools.make_multimodal [--bundle DIR] [--n 100] [--reps 5]
    .venv/bin/python -m tools.make_multimodal --render-only      # docs/multimodal.md's block from docs/multimodal.json
    .venv/bin/python -m tools.make_multimodal --choose-joint A B  # train joint pairs, score them on validation

Single-threaded, seeded. Splits: the SVC that reads generated images fits on the train images and picks its
gamma and C on validation; every mode runs on validation first (draw seeds VAL_SEED, the validation images
to caption), which is where the bundle's choice of router (joint vs apart adapters) is checked; the test run
(TEST_SEED, the test images) is scored once. Per mode: image digit accuracy, inverted share, caption accuracy
after its own image, new phrasing share, broken captions, and the same for captions of real test images.
Speed: one routed pass vs one pass per adapter (same outputs?) vs the plain base model, drawing n digits with
their captions, order rotated per repetition, medians. Writes docs/multimodal.json and docs/multimodal_digits.png
(the demo grid) and the block between the markers in docs/multimodal.md; tools/make_results.py appends
`render_section(record)` to docs/results.md.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import statistics
import sys
import time
from pathlib import Path

from molora.docblock import from_docs, markers, replace_block, wrap

ROOT = Path(__file__).resolve().parent.parent
RECORD = ROOT / "docs" / "multimodal.json"
GRID = ROOT / "docs" / "multimodal_digits.png"
PAGE = ROOT / "docs" / "multimodal.md"
BEGIN, END = markers("multimodal", "tools/make_multimodal.py")
VAL_SEED, TEST_SEED, TEMPERATURE = 1, 2, 1.0
TEXT_TEMPERATURES = (1.0, 0.0)  # candidates for the caption spans, chosen on validation (images: TEMPERATURE)
# the joint pair's training settings tried (--choose-joint): label -> DigitsRecipe fields over the shipped recipe;
# "shipped" scores the bundle's own pair. Scored on validation only ("vocab-routed, joint", draw seed VAL_SEED,
# the validation images), at the caption temperature the record chose; the test split is never read here.
JOINT_CANDIDATES = {
    "shipped": {},
    "e10_lr4e-3": {"joint_epochs": 10.0, "joint_lr": 4e-3},
    "e10_lr2e-3": {"joint_epochs": 10.0, "joint_lr": 2e-3},
    "e15_lr4e-3": {"joint_epochs": 15.0, "joint_lr": 4e-3},
    "e10_lr4e-3_cap0.5": {"joint_epochs": 10.0, "joint_lr": 4e-3, "joint_captioning": 0.5},
    "e7_lr4e-3": {"joint_epochs": 7.0, "joint_lr": 4e-3},
    "e5_lr2e-3": {"joint_epochs": 5.0, "joint_lr": 2e-3},
    "e10_lr1e-3": {"joint_epochs": 10.0, "joint_lr": 1e-3},
}
GOALS = {
    "inverted": 0.95,
    "new_phrasing": 0.95,
    "broken": 0.05,
    "image_accuracy": 0.6,
    "caption_accuracy": 0.6,
    "routed_vs_base": 1.2,
    "k_pass_vs_routed": 1.8,
}


def all_modes(mm) -> dict:
    """The demo's six modes, the joint adapters on every token, and the off-by-one ablation of the router."""
    from molora.multimodal import generate as mg
    from molora.multimodal.demo import modes
    from molora.routing import VocabRouter

    out = modes(mm)
    out["image adapter (joint) everywhere"] = "image"
    out["text adapter (joint) everywhere"] = "text"
    out["both (joint) summed everywhere"] = mg.EveryToken(["image", "text"])
    ((lo, hi, _),) = mm.router.ranges  # <boi> .. <img_15>
    eoi = mm.tokenizer.convert_tokens_to_ids("<eoi>")
    out["vocab-routed, joint, off by one"] = VocabRouter([(lo + 1, hi, "image"), (eoi, eoi + 1, "image")], "text")
    return out


def evaluate_split(mm, reader, specs: dict, split, seed: int, n: int, text_temperature: float) -> dict:
    from molora.multimodal.evaluate import evaluate_mode

    digits = [i % 10 for i in range(n)]
    out = {}
    for label, spec in specs.items():
        t0 = time.perf_counter()
        out[label] = evaluate_mode(
            mm, reader, spec, digits, split, temperature=TEMPERATURE, seed=seed, text_temperature=text_temperature
        )
        print(f"  {label:<38} {out[label]}  ({time.perf_counter() - t0:.1f} s)", flush=True)
    return out


def speed(mm, n: int, reps: int, text_temperature: float) -> dict:
    from molora.multimodal import generate as mg
    from molora.multimodal.evaluate import interleaved_times

    digits = [i % 10 for i in range(n)]
    names = sorted({n for _, _, n in mm.router.ranges} | {mm.router.default})
    outs = {}

    def run(key, **kw):
        def call():
            outs[key] = [
                d.tokens
                for d in mg.draw(
                    mm, digits, temperature=TEMPERATURE, seed=TEST_SEED, text_temperature=text_temperature, **kw
                )
            ]

        return call

    times = interleaved_times(
        {
            "base": run("base", spec=None),
            "routed": run("routed", spec=mm.router),
            "k_pass": run("k_pass", spec=mm.router, passes=names),
        },
        reps,
    )
    tokens = sum(len(t) for t in outs["routed"])
    out = {
        "sequences": n,
        "generated_tokens": tokens,
        "reps": reps,
        "adapters": names,
        "seconds": {k: [round(x, 4) for x in v] for k, v in times.items()},
        "outputs_equal": sum(a == b for a, b in zip(outs["routed"], outs["k_pass"])),
    }
    return {**out, **ratios(out["seconds"], tokens)}


def ratios(seconds: dict[str, list[float]], tokens: int) -> dict:
    """Medians, and each ratio as the median of the per-repetition ratios (the variants of one repetition run
    back to back, so another tenant's load on the machine cancels in the pair) with its interquartile range."""

    def paired(a: str, b: str) -> tuple[float, list[float]]:
        r = sorted(x / y for x, y in zip(seconds[a], seconds[b]))
        q = statistics.quantiles(r, n=4) if len(r) > 1 else [r[0]] * 3
        return round(statistics.median(r), 3), [round(q[0], 3), round(q[2], 3)]

    med = {k: statistics.median(v) for k, v in seconds.items()}
    (rb, rb_iqr), (kr, kr_iqr) = paired("routed", "base"), paired("k_pass", "routed")
    return {
        "median_s": {k: round(v, 4) for k, v in med.items()},
        "routed_vs_base": rb,
        "routed_vs_base_iqr": rb_iqr,
        "k_pass_vs_routed": kr,
        "k_pass_vs_routed_iqr": kr_iqr,
        "ratio_of_medians": {
            "routed_vs_base": round(med["routed"] / med["base"], 3),
            "k_pass_vs_routed": round(med["k_pass"] / med["routed"], 3),
        },
        "routed_tokens_per_s": round(tokens / med["routed"], 1),
    }


def measure(args: argparse.Namespace) -> dict:
    import torch

    from molora.bundle import load
    from molora.multimodal.demo import run_demo
    from molora.multimodal.evaluate import fit_reader
    from molora.multimodal.recipe import shipped_bundle
    from molora.multimodal.vocab import load_splits

    torch.set_num_threads(1)
    t0 = time.time()
    splits = load_splits()
    reader = fit_reader(splits)
    print(f"reader {reader.params}: val {reader.val_accuracy}, test {reader.test_accuracy}", flush=True)
    bundle = Path(args.bundle) if args.bundle else shipped_bundle()
    mm = load(bundle)
    specs = all_modes(mm)
    val, mean_caption = {}, {}
    for tt in TEXT_TEMPERATURES:
        print(f"validation, caption temperature {tt}", flush=True)
        val[str(tt)] = evaluate_split(mm, reader, specs, splits["val"], VAL_SEED, args.n, tt)
        mean_caption[str(tt)] = round(statistics.mean(r["caption_accuracy"] for r in val[str(tt)].values()), 4)
    text_t = float(max(mean_caption, key=mean_caption.get))  # the first candidate on a tie
    print(f"test, caption temperature {text_t}", flush=True)
    test = evaluate_split(mm, reader, specs, splits["test"], TEST_SEED, args.n, text_t)
    print("speed", flush=True)
    sp = speed(mm, args.n, args.reps, text_t)
    print(json.dumps(sp), flush=True)
    _, table = run_demo(mm, GRID)
    tok, routes = mm.tokenizer, mm.router
    ids = tok("<boi> <eoi>", add_special_tokens=False, return_tensors="pt")["input_ids"]
    picked = [mm.adapter_names[i] for i in routes.route(ids, mm.adapter_names).adapter_ids[0].tolist()]
    return {
        "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "command": "tools/make_multimodal.py " + " ".join(sys.argv[1:]),
        "bundle": str(bundle.relative_to(ROOT)) if bundle.is_relative_to(ROOT) else str(bundle),
        "threads": 1,
        "temperature": TEMPERATURE,
        "text_temperature": text_t,
        "text_temperature_choice": {
            "candidates": list(TEXT_TEMPERATURES),
            "validation_mean_caption_accuracy": mean_caption,
        },
        "seeds": {"val": VAL_SEED, "test": TEST_SEED},
        "splits": {k: int(len(v.labels)) for k, v in splits.items()},
        "reader": {"params": reader.params, "val_accuracy": reader.val_accuracy, "test_accuracy": reader.test_accuracy},
        "router": {
            "ranges": [list(r) for r in routes.ranges],
            "default": routes.default,
            "boi": picked[0],
            "eoi": picked[1],
        },
        "validation": val,
        "test": test,
        "speed": sp,
        "demo_captions": table,
        "goals": GOALS,
        "wall_s": round(time.time() - t0, 1),
        **previous_choice(),
    }


def previous_choice() -> dict:
    """The record's joint_choice (--choose-joint), kept when the measurement is re-run."""
    old = json.loads(RECORD.read_text()) if RECORD.is_file() else {}
    return {"joint_choice": old["joint_choice"]} if "joint_choice" in old else {}


def choose_joint(args: argparse.Namespace) -> dict:
    """Train each named candidate's joint pair over the shipped base (into --work/LABEL) and score the
    vocab-routed pair on validation; results merge into docs/multimodal.json["joint_choice"]."""
    import shutil

    import torch

    from molora.bundle import load
    from molora.multimodal.evaluate import evaluate_mode, fit_reader
    from molora.multimodal.recipe import DigitsRecipe, shipped_bundle, train_joint
    from molora.multimodal.vocab import load_splits

    torch.set_num_threads(1)
    splits = load_splits()
    reader = fit_reader(splits)
    record = json.loads(RECORD.read_text()) if RECORD.is_file() else {}
    text_t = float(record.get("text_temperature", 0.0))
    shipped = json.loads((shipped_bundle() / "recipe.json").read_text())
    work = Path(args.work) / "joint_choice.json"  # candidates scored so far, this run's and earlier ones'
    choice = (
        json.loads(work.read_text())
        if work.is_file()
        else record.get("joint_choice")
        or {
            "criterion": "validation image accuracy of the vocab-routed joint pair, among candidates within every "
            "style and caption goal",
            "text_temperature": text_t,
            "candidates": {},
        }
    )
    for label in args.choose_joint:
        if label not in JOINT_CANDIDATES:
            raise SystemExit(f"--choose-joint {label}: use one of {list(JOINT_CANDIDATES)}")
        t0 = time.perf_counter()
        folder, train_stats = shipped_bundle(), None
        if JOINT_CANDIDATES[label]:
            folder = Path(args.work) / label
            want = {**shipped, **JOINT_CANDIDATES[label]}
            done = folder / "recipe.json"
            if not done.is_file() or json.loads(done.read_text()) != want:  # else: trained by an earlier run
                shutil.copytree(shipped_bundle(), folder, dirs_exist_ok=True)
                train_joint(folder, DigitsRecipe(**want), splits["train"], progress=False)
                done.write_text(json.dumps(want, indent=2) + "\n")
            train_stats = json.loads((folder / "adapters" / "image" / "training_stats.json").read_text())
        mm = load(folder)
        digits = [i % 10 for i in range(args.n)]
        val = evaluate_mode(
            mm,
            reader,
            mm.router,
            digits,
            splits["val"],
            temperature=TEMPERATURE,
            seed=VAL_SEED,
            text_temperature=text_t,
        )
        entry = choice["candidates"].get(label, {})
        entry = {
            **entry,
            "joint": JOINT_CANDIDATES[label],
            "validation": {**entry.get("validation", {}), f"{args.n} draws": val},
            "wall_s": round(time.perf_counter() - t0, 1),
        }
        if train_stats is not None:
            entry["training"] = {k: train_stats.get(k) for k in ("steps", "seconds", "cpu_seconds", "final_loss")}
        choice["candidates"][label] = entry
        print(f"{label}: {json.dumps(entry)}", flush=True)
        work.parent.mkdir(parents=True, exist_ok=True)
        work.write_text(json.dumps(choice, indent=2) + "\n")
    return choice


# --------------------------------------------------------------------------------------------- rendering

COLUMNS = [
    ("image_accuracy", "image digit acc."),
    ("inverted", "inverted"),
    ("caption_accuracy", "caption acc."),
    ("new_phrasing", "new phrasing"),
    ("broken", "broken caption"),
    ("read_caption_accuracy", "captioning real images: acc."),
    ("read_new_phrasing", "… new phrasing"),
    ("read_broken", "… broken"),
]


def _table(rows: dict) -> list[str]:
    out = ["| mode | " + " | ".join(c for _, c in COLUMNS) + " |", "|---" * (len(COLUMNS) + 1) + "|"]
    for label, r in rows.items():
        out.append(f"| {label} | " + " | ".join(f"{r[k]:.2f}" for k, _ in COLUMNS) + " |")
    return out


def _iqr(q: list[float]) -> str:
    return f"[{q[0]:.2f}–{q[1]:.2f}]"


def goals_met(record: dict) -> list[tuple[str, bool]]:
    r = record["test"]["vocab-routed, joint"]
    s = record["speed"]
    return [
        (f"images in image style {r['inverted']:.2f} (goal ≥ 0.95)", r["inverted"] >= 0.95),
        (f"captions in text style {r['new_phrasing']:.2f} (goal ≥ 0.95)", r["new_phrasing"] >= 0.95),
        (f"broken captions {r['broken']:.2f} (goal ≤ 0.05)", r["broken"] <= 0.05),
        (f"image digit accuracy {r['image_accuracy']:.2f} (goal ≥ 0.6)", r["image_accuracy"] >= 0.6),
        (f"caption accuracy {r['caption_accuracy']:.2f} (goal ≥ 0.6)", r["caption_accuracy"] >= 0.6),
        (f"one routed pass {s['routed_vs_base']:.2f}x the base model's time (goal ≤ 1.2x)", s["routed_vs_base"] <= 1.2),
        (
            f"one pass per adapter {s['k_pass_vs_routed']:.2f}x the routed pass (goal ≥ 1.8x), outputs equal "
            f"{s['outputs_equal']}/{s['sequences']}",
            s["k_pass_vs_routed"] >= 1.8 and s["outputs_equal"] == s["sequences"],
        ),
    ]


def render_section(record: dict) -> list[str]:
    """The docs/results.md section (markdown lines) from docs/multimodal.json."""
    t, s = record["test"], record["speed"]
    n = t["base"]["n"]
    lines = [
        "",
        "## Multimodal: vocabulary routing on an early-fusion text+image model",
        "",
        f"The digits bundle (molora/multimodal/bundle): a 2.4M-parameter Llama trained on {record['splits']['train']} "
        "digit images over 46 ids (words and 16 image codes), an image adapter that draws digits inverted and a "
        "text adapter with "
        "a new caption phrasing, routed by token id (router ranges read from the tokenizer: "
        f"{record['router']['ranges']}, <boi> → {record['router']['boi']}, <eoi> → {record['router']['eoi']}). "
        f"Test: {n} drawn digits per mode (image and caption in one sequence; image spans sampled at "
        f"temperature {record['temperature']}, caption spans at {record['text_temperature']}, the better of "
        f"{record['text_temperature_choice']['candidates']} by mean caption accuracy on validation) and "
        f"{record['splits']['test']} real test images to caption (greedy); images read by an SVC "
        f"(test accuracy on real images {record['reader']['test_accuracy']}).",
        "",
    ]
    lines += [
        'Modes: "everywhere" puts an adapter on every token; "apart" adapters were each trained alone '
        'on every token (PEFT, `train_adapter`), "joint" ones together under the vocab router '
        '(`train_routed`); "off by one" routes <boi> to text and <eoi> to image (the wrong shift).',
        "",
    ]
    lines += _table(t)
    lines += [
        "",
        f"Speed ({s['sequences']} sequences, {s['generated_tokens']} generated tokens, {s['reps']} "
        f"interleaved repetitions, order rotated, 1 thread; ratios are medians of the per-repetition ratios, "
        f"interquartile range in brackets): base {s['median_s']['base']:.2f} s, one routed pass "
        f"{s['median_s']['routed']:.2f} s ({s['routed_vs_base']:.2f}x base {_iqr(s['routed_vs_base_iqr'])}), "
        f"one pass per adapter {s['median_s']['k_pass']:.2f} s ({s['k_pass_vs_routed']:.2f}x routed "
        f"{_iqr(s['k_pass_vs_routed_iqr'])}); outputs equal {s['outputs_equal']}/{s['sequences']}. The "
        "passes emulate per-sequence routing exactly: each forward runs once per adapter over every row and "
        "keeps, per run of positions, the pass its router picks (logits and keys/values).",
        "",
        "Goals (vocab-routed, joint adapters, test):",
        "",
    ]
    lines += [f"- {'met' if ok else 'not met'}: {text}" for text, ok in goals_met(record)]
    return lines + [""]


def readme_block(record: dict) -> str:
    t = record["test"]
    keep = [
        "base",
        "image adapter everywhere",
        "text adapter everywhere",
        "both summed everywhere",
        "vocab-routed, apart",
        "vocab-routed, joint",
    ]
    s = record["speed"]
    out = [
        "![digits drawn per mode](docs/multimodal_digits.png)",
        "",
        "Rows: the base; the image or text adapter (each trained alone) on every token; both summed on every "
        "token; vocab-routed with the adapters trained apart; vocab-routed with the bundle's adapters, trained "
        "together under the router. The images above and the captions below are greedy; the accuracies come "
        f"from {t['base']['n']} sampled test draws per mode (images read by an SVC).",
        "",
        "| mode | image digit acc. | inverted | caption acc. | new phrasing | broken caption |",
        "|---|---|---|---|---|---|",
    ]
    for k in keep:
        r = t[k]
        out.append(
            f"| {k} | {r['image_accuracy']:.2f} | {r['inverted']:.2f} | {r['caption_accuracy']:.2f} | "
            f"{r['new_phrasing']:.2f} | {r['broken']:.2f} |"
        )
    out += ["", "| mode | caption after its own drawn 7 | caption of a real 7 |", "|---|---|---|"]
    out += [f"| {a} | {b} | {c} |" for a, b, c in record["demo_captions"]]
    out += [
        "",
        f"One routed pass: {s['routed_vs_base']:.2f}x {_iqr(s['routed_vs_base_iqr'])} the base model's "
        f"time; one pass per adapter: {s['k_pass_vs_routed']:.2f}x {_iqr(s['k_pass_vs_routed_iqr'])} the routed "
        f"pass, outputs equal {s['outputs_equal']}/{s['sequences']} "
        f"(`docs/multimodal.json`, {t['base']['n']} test draws per mode).",
    ]
    return "\n".join(out)


def render(record: dict) -> None:
    text = PAGE.read_text()
    PAGE.write_text(replace_block(text, BEGIN, END, from_docs(wrap(BEGIN, END, readme_block(record))), PAGE))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--bundle", default=None, help="digits bundle (default: the shipped one)")
    p.add_argument("--n", type=int, default=100, help="drawn digits per mode and split (default 100)")
    p.add_argument("--reps", type=int, default=5, help="speed repetitions (default 5)")
    p.add_argument("--render-only", action="store_true", help="only render docs/multimodal.md from the record")
    p.add_argument(
        "--choose-joint",
        nargs="+",
        default=None,
        metavar="LABEL",
        help=f"train and score these joint-pair candidates on validation ({', '.join(JOINT_CANDIDATES)})",
    )
    p.add_argument(
        "--work",
        default=str(ROOT / "runs" / "multimodal_joint"),
        help="folder for the candidates' bundles (default runs/multimodal_joint)",
    )
    args = p.parse_args(argv)
    if args.choose_joint:
        choice = choose_joint(args)
        record = json.loads(RECORD.read_text())
        RECORD.write_text(json.dumps({**record, "joint_choice": choice}, indent=2) + "\n")
        print(f"wrote {RECORD} (joint_choice)")
        return 0
    if not args.render_only:
        record = measure(args)
        RECORD.write_text(json.dumps(record, indent=2) + "\n")
        print(f"wrote {RECORD} and {GRID}")
    record = json.loads(RECORD.read_text())
    render(record)
    print("\n".join(render_section(record)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
