"""The GPU recipe for the paper's headline table: Qwen3-1.7B with four focused LoRAs (math, code, science,
logic) under a learned per-token router, against Qwen3-8B alone, on GSM8K, MATH-500, BBH and GPQA-diamond.

On a CUDA machine with access to the Hugging Face hub (about 1.5 h of training and 2-4 h of evaluation on one
H100-class GPU; GPQA is gated: accept its terms on the hub and `huggingface-cli login` first):

    pip install -e .[serve,recipe]
    MOLORA_DEVICE=cuda python -m tools.gpu_recipe all --work runs/gpu
    MOLORA_DEVICE=cuda python -m tools.gpu_recipe eval --work runs/gpu --limit 100    # a quicker eval

Steps, each resumable (finished outputs are kept), `all` runs them in order:
  fetch    Qwen/Qwen3-1.7B and Qwen/Qwen3-8B into WORK/models (huggingface_hub.snapshot_download)
  data     training JSONL per adapter and the four eval sets, into WORK/data and WORK/eval:
           math     GSM8K train (openai/gsm8k) + MATH train (EleutherAI/hendrycks_math), worked solutions
           code     CodeAlpaca-20k (sahil2801/CodeAlpaca-20k)
           science  SciQ (allenai/sciq), rendered as lettered multiple choice like GPQA, support + answer
           logic    molora's own BBH-style generators (molora.data.skills, worked solutions), never BBH items
           eval:    GSM8K test, MATH-500 (HuggingFaceH4/MATH-500), BBH (lukaemon/bbh, 27 tasks),
                    GPQA-diamond (Idavidrein/gpqa)
  train    one LoRA per adapter on Qwen3-1.7B (rank 16, all seven projections, bf16 base), then the bundle
  router   the learned per-token router over the four adapters (`molora train-router`'s code)
  eval     1.7B + MoLoRA (learned, sequence, oracle, base) and Qwen3-8B (base) on every set
  report   WORK/report.md: the table, per set and mode

Both models use Qwen3's chat format with thinking off (an empty <think></think> block, as Qwen's own
template writes for enable_thinking=False), so neither spends its budget on hidden reasoning.
MOLORA_DEVICE (see molora.model.base) puts every model on the GPU; nothing else changes for CUDA.

--smoke runs the same pipeline on any machine, offline, in a few minutes: the embedded SmolLM2 as both
models, packaged data only (the GSM8K-style problems in molora/data/generic.jsonl.gz for math, the logic
generators, code and science stand-ins drawn from the generators; GSM8K test items from ../shared/data/gsm8k
when that folder exists), tiny sizes. It checks the plumbing, not the science.
"""

from __future__ import annotations

import argparse
import csv
import json
import random
import re
import sys
import time
from pathlib import Path

from molora.data.jsonl import read_jsonl, write_jsonl

ROOT = Path(__file__).resolve().parent.parent
SHARED_GSM8K = ROOT.parent / "shared" / "data" / "gsm8k"
SMALL, BIG = "Qwen/Qwen3-1.7B", "Qwen/Qwen3-8B"
QWEN3_TEMPLATE = "<|im_start|>user\n{prompt}<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"
ADAPTERS = ("math", "code", "science", "logic")
MATH_SUBJECTS = (
    "algebra",
    "counting_and_probability",
    "geometry",
    "intermediate_algebra",
    "number_theory",
    "prealgebra",
    "precalculus",
)
BBH_TASKS = (
    "boolean_expressions",
    "causal_judgement",
    "date_understanding",
    "disambiguation_qa",
    "dyck_languages",
    "formal_fallacies",
    "geometric_shapes",
    "hyperbaton",
    "logical_deduction_five_objects",
    "logical_deduction_seven_objects",
    "logical_deduction_three_objects",
    "movie_recommendation",
    "multistep_arithmetic_two",
    "navigate",
    "object_counting",
    "penguins_in_a_table",
    "reasoning_about_colored_objects",
    "ruin_names",
    "salient_translation_error_detection",
    "snarks",
    "sports_understanding",
    "temporal_sequences",
    "tracking_shuffled_objects_five_objects",
    "tracking_shuffled_objects_seven_objects",
    "tracking_shuffled_objects_three_objects",
    "web_of_lies",
    "word_sorting",
)
TASKS_OF = {"math": ["gsm8k", "math"], "code": [], "science": ["gpqa"], "logic": list(BBH_TASKS)}
SMALL_MODES = ("learned", "sequence", "oracle", "base")


def log(msg: str) -> None:
    print(f"[gpu_recipe {time.strftime('%H:%M:%S')}] {msg}", flush=True)


# ----------------------------------------------------------------------------------------------- fetch


def fetch(work: Path, smoke: bool) -> dict[str, str]:
    """Local folders of the two models ("default" in smoke mode)."""
    if smoke:
        return {"small": "default", "big": "default"}
    from huggingface_hub import snapshot_download

    out = {}
    for key, repo in (("small", SMALL), ("big", BIG)):
        folder = work / "models" / repo.split("/")[1]
        if not (folder / "config.json").is_file():
            log(f"downloading {repo}")
            snapshot_download(
                repo,
                local_dir=str(folder),
                allow_patterns=["*.json", "*.safetensors", "*.txt", "*.model", "*.tiktoken"],
            )
        out[key] = str(folder)
    return out


# ------------------------------------------------------------------------------------------------ data


def _gsm8k_completion(answer: str) -> str:
    return re.sub(r"<<[^>]*>>", "", answer).strip()  # drop the calculator annotations, keep "#### N"


def _logic_rows(n: int, seed: int) -> list[dict]:
    from molora.data.skills import SKILLS, generate
    from molora.data.solutions import worked_solution

    per = -(-n // len(SKILLS))
    return [
        {"prompt": it.input, "completion": worked_solution(task, it.input, it.target)}
        for i, task in enumerate(SKILLS)
        for it in generate(task, per, seed + 17 * i)
    ][:n]


def _choice_row(question: str, correct: str, wrong: list[str], support: str) -> dict:
    from molora.eval.tasks import gpqa_item

    item = gpqa_item(question, correct, wrong)
    lead = (support.strip() + " ") if support and support.strip() else ""
    return {"prompt": item.input, "completion": f"{lead}The answer is ({item.target})."}


def make_data(work: Path, n: int, smoke: bool) -> None:
    data, ev = work / "data", work / "eval"
    if all((data / f"{a}.jsonl").is_file() for a in ADAPTERS) and (ev / "done").is_file():
        log("data: already written")
        return
    rng = random.Random(0)
    gsm_train = read_jsonl(SHARED_GSM8K / "train.jsonl") if SHARED_GSM8K.is_dir() else None
    gsm_test = read_jsonl(SHARED_GSM8K / "test.jsonl") if SHARED_GSM8K.is_dir() else None
    if smoke:
        from molora.train.default import read_generic  # GSM8K-style worked problems shipped in the package

        rows = {"math": read_generic(n, 0), "logic": _logic_rows(n, 1000)}
        # stand-ins so the plumbing runs offline: word lists and bracket runs from the generators
        from molora.data.skills import generate

        rows["code"] = [{"prompt": it.input, "completion": it.target} for it in generate("word_sorting", n, 77)]
        rows["science"] = [{"prompt": it.input, "completion": it.target} for it in generate("dyck_languages", n, 78)]
        for name, r in rows.items():
            write_jsonl(data / f"{name}.jsonl", r)
        if gsm_test is not None:
            write_jsonl(ev / "gsm8k.jsonl", gsm_test[:8])
        from molora.data.skills import EVAL_SEED_BASE, write_bbh_file

        (ev / "bbh").mkdir(parents=True, exist_ok=True)
        for task in ("object_counting", "navigate"):
            write_bbh_file(ev / "bbh" / f"{task}.json", generate(task, 8, EVAL_SEED_BASE + 5))
        (ev / "done").write_text("smoke\n")
        return
    from datasets import load_dataset

    half = n // 2
    if gsm_train is None:
        gsm_train = list(load_dataset("openai/gsm8k", "main", split="train"))
        gsm_test = list(load_dataset("openai/gsm8k", "main", split="test"))
    math_train = [r for s in MATH_SUBJECTS for r in load_dataset("EleutherAI/hendrycks_math", s, split="train")]
    rng.shuffle(gsm_train)
    rng.shuffle(math_train)
    math_rows = [{"prompt": r["question"], "completion": _gsm8k_completion(r["answer"])} for r in gsm_train[:half]]
    math_rows += [{"prompt": r["problem"], "completion": r["solution"]} for r in math_train[: n - len(math_rows)]]
    code = list(load_dataset("sahil2801/CodeAlpaca-20k", split="train"))
    rng.shuffle(code)
    code_rows = [
        {"prompt": r["instruction"] + (f"\n\n{r['input']}" if r.get("input") else ""), "completion": r["output"]}
        for r in code[:n]
    ]
    sciq = list(load_dataset("allenai/sciq", split="train"))
    rng.shuffle(sciq)
    sci_rows = [
        _choice_row(
            r["question"],
            r["correct_answer"],
            [r["distractor1"], r["distractor2"], r["distractor3"]],
            r.get("support", ""),
        )
        for r in sciq[:n]
    ]
    for name, rows in (
        ("math", math_rows),
        ("code", code_rows),
        ("science", sci_rows),
        ("logic", _logic_rows(n, 1000)),
    ):
        rng.shuffle(rows)
        write_jsonl(data / f"{name}.jsonl", rows)
    write_jsonl(ev / "gsm8k.jsonl", [{"question": r["question"], "answer": r["answer"]} for r in gsm_test])
    write_jsonl(
        ev / "math500.jsonl",
        [
            {"problem": r["problem"], "solution": r["solution"], "answer": r["answer"]}
            for r in load_dataset("HuggingFaceH4/MATH-500", split="test")
        ],
    )
    (ev / "bbh").mkdir(parents=True, exist_ok=True)
    for task in BBH_TASKS:
        rows = [{"input": r["input"], "target": r["target"]} for r in load_dataset("lukaemon/bbh", task, split="test")]
        (ev / "bbh" / f"{task}.json").write_text(json.dumps({"examples": rows}))
    cols = ["Question", "Correct Answer", "Incorrect Answer 1", "Incorrect Answer 2", "Incorrect Answer 3"]
    with (ev / "gpqa_diamond.csv").open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=cols)
        w.writeheader()
        for r in load_dataset("Idavidrein/gpqa", "gpqa_diamond", split="train"):
            w.writerow({c: r[c] for c in cols})
    (ev / "done").write_text("ok\n")


# ------------------------------------------------------------------------------------------ train, router


def bundle_manifest(base: str, adapters: list[str]) -> dict:
    """The manifest of a bundle over `base` ("default" or a model folder). A folder is written as an absolute
    path: `read_bundle` resolves a relative base against the bundle's own folder, not against the working
    directory this script was started in."""
    if base != "default":
        base = str(Path(base).resolve())
    return {
        "name": "qwen3-molora" if adapters else "base",
        "base": base,
        "prompt_template": QWEN3_TEMPLATE,
        "stop": ["<|im_end|>"],
        "slots": max(1, len(adapters)),
        "max_rank": 16,
        "adapters": [
            {"name": a, "path": f"adapters/{a}", "tasks": TASKS_OF[a], "description": f"{a} (tools/gpu_recipe.py)"}
            for a in adapters
        ],
    }


def train(work: Path, models: dict[str, str], smoke: bool) -> Path:
    from molora.bundle import write_manifest
    from molora.model.base import load_base
    from molora.train.adapter import AdapterTrainConfig, read_examples, train_adapter

    bundle = work / "bundle"
    for i, name in enumerate(ADAPTERS):
        out = bundle / "adapters" / name
        if (out / "training_stats.json").is_file():
            log(f"adapter {name}: already trained")
            continue
        model, tok = load_base(models["small"])
        cfg = AdapterTrainConfig(
            rank=16,
            alpha=32.0,
            lr=2e-4 if not smoke else 1e-3,
            epochs=1.0,
            batch_size=16 if not smoke else 4,
            max_len=1024 if not smoke else 256,
            seed=i,
        )
        stats = train_adapter(
            model, tok, read_examples(work / "data" / f"{name}.jsonl"), out, cfg, template=QWEN3_TEMPLATE
        )
        log(f"adapter {name}: {stats['examples']} examples, loss {stats['final_loss']}, {stats['seconds']} s")
        del model
    write_manifest(bundle, bundle_manifest(models["small"], list(ADAPTERS)))
    write_manifest(work / "big", bundle_manifest(models["big"], []))
    return bundle


def router(work: Path, smoke: bool) -> None:
    from molora.bundle import load
    from molora.train.router import RouterTrainConfig
    from molora.train.router_cli import train_router_for_bundle

    bundle = work / "bundle"
    if (bundle / "router" / "router.json").is_file():
        log("router: already trained")
        return
    mm = load(bundle)
    data = {a: str(work / "data" / f"{a}.jsonl") for a in ADAPTERS}
    stats = train_router_for_bundle(
        mm, data, RouterTrainConfig(placement="per_block"), limit=8 if smoke else 400, mixed=4 if smoke else 400
    )
    log(f"router: {stats}")


# -------------------------------------------------------------------------------------------- eval, report


def eval_sets(work: Path) -> list[str]:
    ev = work / "eval"
    sets = [f"gsm8k:{ev / 'gsm8k.jsonl'}"] if (ev / "gsm8k.jsonl").is_file() else []
    if (ev / "math500.jsonl").is_file():
        sets.append(f"math:{ev / 'math500.jsonl'}")
    sets += [f"bbh:{p}" for p in sorted((ev / "bbh").glob("*.json"))]
    if (ev / "gpqa_diamond.csv").is_file():
        sets.append(f"gpqa:{ev / 'gpqa_diamond.csv'}")
    return sets


def evaluate_all(work: Path, limit: int | None) -> None:
    from molora.bundle import load
    from molora.eval.runner import evaluate, save_results

    out = work / "results"
    out.mkdir(parents=True, exist_ok=True)
    for label, folder, modes in (("small", work / "bundle", SMALL_MODES), ("big", work / "big", ("base",))):
        mm = None
        for spec in eval_sets(work):
            for mode in modes:
                stem = f"{label}__{Path(spec.split(':', 1)[1]).stem}__{mode}"
                if (out / f"{stem}.json").is_file():
                    continue
                mm = mm or load(folder)
                summary, preds = evaluate(mm, spec, mode, limit=limit)
                save_results(summary, preds, out / f"{stem}.json", out / f"{stem}.jsonl")
                log(f"{stem}: {summary['accuracy']:.1f}")
        del mm


def report(work: Path) -> Path:
    rows: dict[tuple[str, str], dict[str, float]] = {}
    for f in sorted((work / "results").glob("*.json")):
        label, task, mode = f.stem.split("__")
        s = json.loads(f.read_text())
        key = "bbh" if (work / "eval" / "bbh" / f"{task}.json").is_file() else task
        rows.setdefault((label, mode), {}).setdefault(key, []).append(s["accuracy"])
    sets = ["gsm8k", "math500", "bbh", "gpqa_diamond"]
    smoke = (work / "eval" / "done").read_text().startswith("smoke")
    lines = [
        "# GPU recipe: Qwen3-1.7B + MoLoRA against Qwen3-8B"
        + (" (SMOKE RUN: SmolLM2 stand-in, tiny sizes; plumbing only)" if smoke else ""),
        "",
        "Accuracy in percent (BBH: mean over its tasks); `tools/gpu_recipe.py`.",
        "",
        "| model | routing | " + " | ".join(sets) + " |",
        "|---|---|" + "---|" * len(sets),
    ]
    for (label, mode), acc in sorted(rows.items()):
        name = "Qwen3-1.7B + 4 LoRAs" if label == "small" else "Qwen3-8B"
        cells = [f"{sum(acc[s]) / len(acc[s]):.1f}" if s in acc else "–" for s in sets]
        lines.append(f"| {name} | {mode} | " + " | ".join(cells) + " |")
    path = work / "report.md"
    path.write_text("\n".join(lines) + "\n")
    log(f"wrote {path}")
    return path


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("step", choices=["all", "fetch", "data", "train", "router", "eval", "report"])
    p.add_argument("--work", default="runs/gpu", help="folder for models, data, bundle and results")
    p.add_argument("--n", type=int, default=6000, help="training examples per adapter (default 6000)")
    p.add_argument("--limit", type=int, default=None, help="first N items of each eval set")
    p.add_argument("--smoke", action="store_true", help="tiny offline run on the embedded SmolLM2 (module doc)")
    a = p.parse_args(argv)
    work = Path(a.work).resolve()
    n = min(a.n, 16) if a.smoke else a.n
    limit = a.limit if a.limit is not None else (2 if a.smoke else None)
    models = fetch(work, a.smoke) if a.step in ("all", "fetch", "train") else None
    if a.step in ("all", "data"):
        make_data(work, n, a.smoke)
    if a.step in ("all", "train"):
        train(work, models, a.smoke)
    if a.step in ("all", "router"):
        router(work, a.smoke)
    if a.step in ("all", "eval"):
        evaluate_all(work, limit)
    if a.step in ("all", "report", "eval"):
        report(work)
    return 0


if __name__ == "__main__":
    sys.exit(main())
