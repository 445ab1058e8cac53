"""Training a router: adapters trained apart, one small router that learns which of them fits each token.

    .venv/bin/python examples/train_router.py

Copies the embedded default bundle (four skill adapters) to a temporary folder, writes one JSONL file of examples per
adapter plus general text the base model should keep, trains a learned router over frozen base and adapters (the
same code as `molora train-router`), and routes a prompt with it. A few minutes on 2 CPU cores.
"""

from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path

import molora
from molora.bundle import DEFAULT_BUNDLE_DIR
from molora.data import general, skills
from molora.data.solutions import worked_solution
from molora.prompts import run_prompt
from molora.train.router import RouterTrainConfig
from molora.train.router_cli import train_router_for_bundle
from molora.view import routed_text, to_plain

TASKS = {  # adapter -> the skill its data is drawn from (molora.data.skills: seeded BBH-style generators)
    "counting": "object_counting",
    "arithmetic": "multistep_arithmetic_two",
    "dyck": "dyck_languages",
    "navigate": "navigate",
}


def write_data(folder: Path, n: int = 30) -> dict[str, str]:
    """{adapter | "none": jsonl path}: each file holds {"prompt", "completion"} rows, the format train-router reads."""
    files = {}
    for adapter, task in TASKS.items():
        rows = [
            {"prompt": it.input, "completion": worked_solution(task, it.input, it.target)}
            for it in skills.generate(task, n, seed=123)  # a seed of its own: not the items the adapters trained on
        ]
        files[adapter] = _write(folder / f"{adapter}.jsonl", rows)
    # "none": general requests the router must leave on the base model (Self-Instruct's everyday tasks)
    rows = [{"prompt": r["prompt"], "completion": r["output"]} for r in general.self_instruct_rows()[:n]]
    files["none"] = _write(folder / "general.jsonl", rows)
    return files


def _write(path: Path, rows: list[dict]) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def main() -> None:
    work = Path(tempfile.mkdtemp(prefix="molora-router-"))
    # 1. A bundle of our own: the default one's manifest and adapters (a bundle is a folder with molora.json).
    bundle = shutil.copytree(DEFAULT_BUNDLE_DIR, work / "bundle")
    data = write_data(work)

    # 2. Load it and train: labels come from which file a token's example came from, features from the frozen
    #    model's hidden states; only the gates (one linear map per block) are fitted (molora.train.router).
    mm = molora.load(bundle)
    report = train_router_for_bundle(mm, data, RouterTrainConfig(steps=150), limit=30, out_name="my_router")
    print({k: v for k, v in report.items() if k != "config"})

    # 3. The manifest now names the new router; load the bundle again and route a prompt with it.
    mm = molora.load(bundle)
    r = run_prompt(mm, "How many animals: a cat, two dogs and a cow?", max_new_tokens=40, trace=True)
    view = routed_text(mm.tokenizer, r.prompt_ids + r.answer_ids, r.adapters, len(r.prompt_ids), mm.adapter_names)
    print(to_plain(view))
    shutil.rmtree(work)


if __name__ == "__main__":
    main()
