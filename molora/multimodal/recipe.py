"""The digits bundle: one seeded recipe from sklearn's digits to a served early-fusion bundle.

    base/               the tiny Llama (molora.multimodal.base), fp16 safetensors + tokenizer.json
    adapters/image      inverted digits (15 - q), trained jointly with `text` under the vocab router
    adapters/text       the new caption phrasing ("the digit is seven"), trained jointly with `image`
    adapters/image_apart, adapters/text_apart   the same styles, each trained alone on every token
    molora.json         router "vocab": ranges read from the tokenizer (<boi> and <img_*> -> image, the
                        rest -> text), so <boi> predicts the first code on the image adapter and <eoi>
                        predicts the first caption word on the text adapter; extra.constrained_spans: the
                        image spans (<boi>, 64 codes, <eoi>) the engine and `molora generate` enforce

The package ships the result (molora/multimodal/bundle, 6.9 MB: base and adapters in fp16) so
`molora demo --multimodal` and the tests need no training; `molora build-multimodal --out DIR` rebuilds it
(seeded, one thread: the base took 18 minutes and the four adapters 12 on a shared 2-core machine).
Adapters "apart" go through PEFT (`train_adapter`, what `molora train-adapter` runs); "joint" ones through
`train_routed` under the bundle's own router (what `molora train-routed` runs). The apart pair uses 5 epochs at
lr 4e-3, chosen on validation draws (tools/make_multimodal.py's validation seed): 2 epochs at 3e-3 left the
image adapter unable to keep the digit (validation image accuracy of the image adapter on every token 0.30, of
the joint routed pair 0.34). The joint pair uses 10 epochs at lr 2e-3 (`joint_epochs`, `joint_lr`), chosen by
`tools/make_multimodal.py --choose-joint` on validation only (recorded in docs/multimodal.json "joint_choice"):
image accuracy of the routed pair 0.92 and caption accuracy 0.98, against 0.59 / 0.69 at 5 epochs / 4e-3 and
0.73 / 0.49 at 10 epochs / 4e-3. So the apart-vs-joint comparison mixes routing during training with the
longer, gentler schedule: the apart pair was not retrained at 10 / 2e-3.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from molora.bundle import write_manifest
from molora.multimodal.vocab import (
    BOI,
    CODE_PREFIX,
    END,
    EOI,
    IMAGE_PREFIXES,
    PIXELS,
    PROMPT_TEMPLATE,
    Digits,
    adapter_pairs,
    load_splits,
)

if TYPE_CHECKING:
    from molora.train.adapter import AdapterTrainConfig

BUNDLE_DIR = Path(__file__).parent / "bundle"
ROUTES = {"from_tokenizer": {"image": list(IMAGE_PREFIXES)}, "default": "text"}
# the image spans the engine and `molora generate` constrain (molora.sampling.SpanConstraint), by token name
SPANS = {"open": BOI, "close": EOI, "codes": [CODE_PREFIX], "length": PIXELS}
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
    joint_epochs: float | None = 10.0  # the joint (router-aware) pair's epochs, lr and captioning share;
    joint_lr: float | None = 2e-3  # None: as the apart ones (chosen on validation; see the module docstring)
    joint_captioning: float | None = None

    def joint_config(self) -> AdapterTrainConfig:
        """The joint pair's training config (`train_joint`)."""
        from molora.train.adapter import AdapterTrainConfig

        return AdapterTrainConfig(
            rank=self.rank,
            alpha=self.alpha,
            lr=self.joint_lr or self.lr,
            epochs=self.joint_epochs or self.epochs,
            batch_size=self.batch_size,
            seed=self.seed,
            bf16=False,
        )


def shipped_bundle() -> Path:
    return BUNDLE_DIR


def manifest() -> dict:
    desc = {
        "image": "draws digits inverted (15 - q); trained jointly with text under the vocab router",
        "text": "captions as 'the digit is seven'; trained jointly with image under the vocab router",
        "image_apart": "draws digits inverted; trained alone, on every token",
        "text_apart": "captions as 'the digit is seven'; trained alone, on every token",
    }
    return {
        "name": "molora-digits",
        "base": "base",
        "prompt_template": PROMPT_TEMPLATE,
        "stop": ["<eos>"],
        "adapters": [{"name": n, "path": f"adapters/{n}", "description": d} for n, d in desc.items()],
        "router": {"kind": "vocab"},
        "vocab_routes": ROUTES,
        "slots": 4,
        "max_rank": 16,
        "extra": {"constrained_spans": SPANS},
    }


def build_bundle(
    out: str | Path,
    recipe: DigitsRecipe = DigitsRecipe(),
    *,
    base_from: str | Path | None = None,
    progress: bool = False,
) -> Path:
    """Train (or copy, with base_from) the base, train the four adapters, write the manifest."""
    from molora.model.base import load_base
    from molora.multimodal.base import train_base
    from molora.train.adapter import AdapterTrainConfig, train_adapter

    out = Path(out)
    splits = load_splits(recipe.seed)
    if base_from is not None:
        shutil.copytree(base_from, out / "base", dirs_exist_ok=True)
    else:
        train_base(out / "base", splits["train"], steps=recipe.base_steps, seed=recipe.seed)
    cfg = AdapterTrainConfig(
        rank=recipe.rank,
        alpha=recipe.alpha,
        lr=recipe.lr,
        epochs=recipe.epochs,
        batch_size=recipe.batch_size,
        seed=recipe.seed,
        bf16=False,
    )
    train = splits["train"]
    kw = dict(template=PROMPT_TEMPLATE, end=END, progress=progress)
    for name, (image_style, text_style) in STYLES.items():
        model, tok = load_base(out / "base")
        pairs = adapter_pairs(train, image_style, text_style, captioning=recipe.captioning, seed=recipe.seed)
        train_adapter(model, tok, pairs, out / "adapters" / f"{name}_apart", cfg, **kw)
    for name in STYLES:
        finish_adapter(out / "adapters" / f"{name}_apart")
    train_joint(out, recipe, train, progress=progress)
    write_manifest(out, manifest())
    (out / "recipe.json").write_text(json.dumps(asdict(recipe), indent=2) + "\n")
    return out


def train_joint(out: str | Path, recipe: DigitsRecipe, train: Digits, *, progress: bool = False) -> dict:
    """Train the joint pair (adapters/image and adapters/text of the bundle at `out`, over its base) together
    under the bundle's vocab router with `recipe.joint_config()`, and finish them as shipped."""
    import torch

    from molora.model.base import load_base
    from molora.routing import VocabRouter
    from molora.train.adapter import train_routed

    out = Path(out)
    model, tok = load_base(out / "base")
    captioning = recipe.captioning if recipe.joint_captioning is None else recipe.joint_captioning
    pairs = adapter_pairs(train, "inverted", "new", captioning=captioning, seed=recipe.seed)
    router = VocabRouter.from_vocab(tok.get_vocab(), ROUTES["from_tokenizer"], ROUTES["default"])
    torch.manual_seed(recipe.seed)
    stats = train_routed(
        model,
        tok,
        pairs,
        {n: out / "adapters" / n for n in STYLES},
        router,
        recipe.joint_config(),
        template=PROMPT_TEMPLATE,
        end=END,
        progress=progress,
    )
    for name in STYLES:
        finish_adapter(out / "adapters" / name)
    return stats


def finish_adapter(folder: Path) -> None:
    """As the package ships an adapter: weights in fp16 (loaders cast them back), the base named by the
    bundle's folder ("base", not the build path), no model card."""
    from safetensors.torch import load_file, save_file

    path = folder / "adapter_model.safetensors"
    save_file({k: v.half() for k, v in load_file(str(path)).items()}, str(path))
    cfg = json.loads((folder / "adapter_config.json").read_text())
    (folder / "adapter_config.json").write_text(json.dumps({**cfg, "base_model_name_or_path": "base"}, indent=2) + "\n")
    (folder / "README.md").unlink(missing_ok=True)  # PEFT's model-card template
