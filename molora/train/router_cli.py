"""`molora train-router` on a bundle: data files per adapter in, router folder + manifest entry out."""

from __future__ import annotations

import json
import random
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING

from molora.bundle import MANIFEST
from molora.errors import MoLoRAError
from molora.train.adapter import read_examples
from molora.train.default import labelled_sequence
from molora.train.router import RouterTrainConfig, routing_accuracy, train_router

if TYPE_CHECKING:
    from molora.model.attach import MoLoRAModel


def train_router_for_bundle(
    mm: MoLoRAModel,
    data: dict[str, str],
    cfg: RouterTrainConfig,
    *,
    limit: int = 300,
    mixed: int = 0,
    seed: int = 0,
    out_name: str = "router",
) -> dict:
    """Train a router over the bundle's adapters from {adapter|"none": jsonl}; write it and the manifest."""
    bundle = mm.bundle
    names = [a.name for a in bundle.adapters]
    unknown = [k for k in data if k != "none" and k not in names]
    if unknown:
        raise MoLoRAError(f"--data names adapters {unknown} that the bundle lacks (it has {names})")
    missing = [n for n in names if n not in data]
    if missing:
        raise MoLoRAError(f"no data for adapters {missing}: give --data NAME=FILE for each adapter")
    rng = random.Random(seed)
    per = {k: read_examples(v)[:limit] for k, v in data.items()}
    rows = [
        [{"prompt": p, "completion": c, "label": None if k == "none" else k}] for k, ex in per.items() for p, c in ex
    ]
    for _ in range(mixed):
        a, b = rng.sample(names, 2)
        rows.append(
            [
                {"prompt": p, "completion": c, "label": n}
                for n, (p, c) in ((a, rng.choice(per[a])), (b, rng.choice(per[b])))
            ]
        )
    rng.shuffle(rows)
    seqs = [labelled_sequence(mm.tokenizer, r, names, bundle.prompt_template) for r in rows]
    cut = max(1, int(0.85 * len(seqs)))
    router = train_router(mm, seqs[:cut], names, cfg, progress=True)
    folder = bundle.folder / out_name
    router.save(folder)
    report = {"router": str(folder), "config": asdict(cfg), **routing_accuracy(mm, router, seqs[cut:])}
    manifest_path = Path(bundle.folder) / MANIFEST
    manifest = json.loads(manifest_path.read_text())
    manifest["router"] = {"kind": "learned", "path": out_name}
    manifest.setdefault("extra", {}).setdefault("routers", {})[out_name] = report
    manifest_path.write_text(json.dumps(manifest, indent=2) + "\n")
    return report
