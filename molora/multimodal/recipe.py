"""The digits bundle: one seeded recipe from sklearn's digits to a served early-fusion bundle.

    base/               the tiny Llama (molora.multimodal.base), fp16 safetensors + tokenizer.json
    adapters/image      inverted digits (15 - q), trained jointly with `text` under the vocab router
    adapters/text       the new caption phrasing ("the digit is seven"), trained jointly with `image`
    adapters/image_apart, adapters/text_apart   the same styles, each trained alone on every token
    molora.json         router "vocab": ranges read from the tokenizer (<boi> and <img_*> -> image, the
                        rest -> text), so <boi> predicts the first code on the image adapter and <eoi>
                        predicts the first caption word on the text adapter

The package ships the result (molora/multimodal/bundle, 6.9 MB: base and adapters in fp16) so
`molora demo --multimodal` and the tests need no training; `molora build-multimodal --out DIR` rebuilds it
(seeded, one thread: the base took 18 minutes and the four adapters 12 on a shared 2-core machine).
Adapters "apart" go through PEFT (`train_adapter`, what `molora train-adapter` runs); "joint" ones through
`train_routed` under the bundle's own router. Both use one AdapterTrainConfig, so routing during training is
the only difference. Chosen on validation draws (scripts/make_multimodal.py's validation seed): 5 epochs at
lr 4e-3; 2 epochs at 3e-3 left the image adapter unable to keep the digit (validation image accuracy of the
image adapter on every token 0.30, of the joint routed pair 0.34).
"""

from __future__ import annotations

import json
import shutil
from dataclasses import asdict, dataclass
from pathlib import Path

from molora.bundle import write_manifest
from molora.multimodal.vocab import END, IMAGE_PREFIXES, PROMPT_TEMPLATE, adapter_pairs, load_splits

BUNDLE_DIR = Path(__file__).parent / "bundle"
ROUTES = {"from_tokenizer": {"image": list(IMAGE_PREFIXES)}, "default": "text"}
STYLES = {"image": ("inverted", "base"), "text": ("base", "new")}  # (image style, caption style) taught


@dataclass(frozen=True)
class DigitsRecipe:
    base_steps: int = 650
    rank: int = 16
    alpha: float = 32.0
    lr: float = 4e-3
    epochs: float = 5.0
    batch_size: int = 16
    captioning: float = 0.3  # share of adapter examples that caption a real image
    seed: int = 0


def shipped_bundle() -> Path:
    return BUNDLE_DIR


def manifest() -> dict:
    desc = {"image": "draws digits inverted (15 - q); trained jointly with text under the vocab router",
            "text": "captions as 'the digit is seven'; trained jointly with image under the vocab router",
            "image_apart": "draws digits inverted; trained alone, on every token",
            "text_apart": "captions as 'the digit is seven'; trained alone, on every token"}
    return {"name": "molora-digits", "base": "base", "prompt_template": PROMPT_TEMPLATE, "stop": ["<eos>"],
            "adapters": [{"name": n, "path": f"adapters/{n}", "description": d} for n, d in desc.items()],
            "router": {"kind": "vocab"}, "vocab_routes": ROUTES, "slots": 4, "max_rank": 16}


def build_bundle(out: str | Path, recipe: DigitsRecipe = DigitsRecipe(), *, base_from: str | Path | None = None,
                 progress: bool = False) -> Path:
    """Train (or copy, with base_from) the base, train the four adapters, write the manifest."""
    import torch

    from molora.model.base import load_base
    from molora.multimodal.base import train_base
    from molora.routing import VocabRouter
    from molora.train.adapter import AdapterTrainConfig, train_adapter, train_routed

    out = Path(out)
    splits = load_splits(recipe.seed)
    if base_from is not None:
        shutil.copytree(base_from, out / "base", dirs_exist_ok=True)
    else:
        train_base(out / "base", splits["train"], steps=recipe.base_steps, seed=recipe.seed)
    cfg = AdapterTrainConfig(rank=recipe.rank, alpha=recipe.alpha, lr=recipe.lr, epochs=recipe.epochs,
                             batch_size=recipe.batch_size, seed=recipe.seed, bf16=False)
    train = splits["train"]
    kw = dict(template=PROMPT_TEMPLATE, end=END, progress=progress)
    for name, (image_style, text_style) in STYLES.items():
        model, tok = load_base(out / "base")
        pairs = adapter_pairs(train, image_style, text_style, captioning=recipe.captioning, seed=recipe.seed)
        train_adapter(model, tok, pairs, out / "adapters" / f"{name}_apart", cfg, **kw)
    model, tok = load_base(out / "base")
    pairs = adapter_pairs(train, "inverted", "new", captioning=recipe.captioning, seed=recipe.seed)
    router = VocabRouter.from_vocab(tok.get_vocab(), ROUTES["from_tokenizer"], ROUTES["default"])
    torch.manual_seed(recipe.seed)
    train_routed(model, tok, pairs, {n: out / "adapters" / n for n in STYLES}, router, cfg, **kw)
    for name in manifest()["adapters"]:
        finish_adapter(out / name["path"])
    write_manifest(out, manifest())
    (out / "recipe.json").write_text(json.dumps(asdict(recipe), indent=2) + "\n")
    return out


def finish_adapter(folder: Path) -> None:
    """As the package ships an adapter: weights in fp16 (loaders cast them back), the base named by the
    bundle's folder ("base", not the build path), no model card."""
    from safetensors.torch import load_file, save_file

    path = folder / "adapter_model.safetensors"
    save_file({k: v.half() for k, v in load_file(str(path)).items()}, str(path))
    cfg = json.loads((folder / "adapter_config.json").read_text())
    (folder / "adapter_config.json").write_text(json.dumps({**cfg, "base_model_name_or_path": "base"}, indent=2) + "\n")
    (folder / "README.md").unlink(missing_ok=True)  # PEFT's model-card template
