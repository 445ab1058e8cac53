"""`molora train-adapter | train-routed | train-router | train-gates | build-default | build-multimodal`."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from molora.cli.registry import command
from molora.errors import MoLoRAError

# --------------------------------------------------------------------------------------------- training


def _train_adapter_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("data", help='JSONL of {"prompt","completion"} or {"messages":[...]}')
    p.add_argument("--out", required=True, help="folder to write the PEFT adapter into")
    p.add_argument("--base", default="default", help="base model: default, a .gguf file or a transformers folder")
    _lora_args(p)
    p.add_argument("--fp32", action="store_true", help="keep the frozen base in fp32 (default bf16: faster)")
    p.add_argument(
        "--bundle",
        default=None,
        metavar="DIR",
        help="take the base, prompt template and end token (its first stop) from this bundle, e.g. "
        "molora/multimodal/bundle (default: the ChatML template and <|im_end|>)",
    )


def _lora_config(args: argparse.Namespace, *, bf16: bool):
    """The AdapterTrainConfig of the `_lora_args` flags."""
    from molora.train.adapter import AdapterTrainConfig

    return AdapterTrainConfig(
        rank=args.rank,
        alpha=args.alpha,
        lr=args.lr,
        epochs=args.epochs,
        batch_size=args.batch_size,
        seed=args.seed,
        bf16=bf16,
        target_modules=tuple(t for t in args.targets.split(",") if t),
    )


def _bundle_text(b) -> dict:
    """A bundle's prompt template and end text (its first stop), as train_adapter and train_routed take them."""
    return {"template": b.prompt_template, "end": (" " + b.stop[0]) if b.stop else ""}


def _lora_args(p: argparse.ArgumentParser) -> None:
    """The LoRA and optimiser flags train-adapter and train-routed share."""
    p.add_argument("--rank", type=int, default=8, help="LoRA rank (default 8)")
    p.add_argument("--alpha", type=float, default=16.0, help="lora_alpha (default 16)")
    p.add_argument("--lr", type=float, default=1e-3, help="learning rate (default 1e-3)")
    p.add_argument("--epochs", type=float, default=1.0, help="passes over the data (default 1)")
    p.add_argument("--batch-size", type=int, default=16, help="examples per step (default 16)")
    p.add_argument(
        "--targets",
        default=",".join(("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")),
        help="comma-separated module names",
    )
    p.add_argument("--seed", type=int, default=0, help="seed (same data + seed = same adapter)")


@command("train-adapter", _train_adapter_args)
def _train_adapter(args: argparse.Namespace) -> int:
    """Train one focused LoRA on a JSONL file; writes a standard PEFT folder."""
    from molora.model.base import load_base
    from molora.train.adapter import read_examples, train_adapter

    pairs = read_examples(args.data)
    cfg = _lora_config(args, bf16=not args.fp32)
    kw = {}
    base = None if args.base == "default" else args.base
    b = None
    if args.bundle:
        from molora.bundle import read_bundle

        b = read_bundle(args.bundle)
        base = b.base
    model, tok = load_base(base)
    if b is not None:
        from molora.bundle import with_tokenizer

        kw = _bundle_text(with_tokenizer(b, tok, model))  # a template left to the tokenizer is rendered from it
    stats = train_adapter(model, tok, pairs, args.out, cfg, **kw)
    print(
        f"wrote {args.out}: {stats['examples']} examples, {stats['tokens']} tokens in {stats['seconds']} s, "
        f"final loss {stats['final_loss']}"
    )
    return 0


def _train_routed_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("data", help='JSONL of {"prompt","completion"} or {"messages":[...]}, for all the adapters')
    p.add_argument(
        "--routed-with",
        "--bundle",
        dest="bundle",
        required=True,
        metavar="BUNDLE",
        help="bundle whose base, prompt template, end token (its first stop) and vocab router (molora.json "
        "router kind vocab) the adapters train under, e.g. molora/multimodal/bundle",
    )
    p.add_argument("--out", required=True, help="folder: one PEFT adapter per adapter the router names, OUT/<name>")
    _lora_args(p)


@command("train-routed", _train_routed_args)
def _train_routed(args: argparse.Namespace) -> int:
    """Train the adapters of a bundle's vocab router jointly, each token's LoRA from the adapter the router gives
    it (as served); writes one PEFT folder per adapter."""

    from molora.bundle import make_router, read_bundle
    from molora.model.base import load_base
    from molora.train.adapter import read_examples, train_routed

    b = read_bundle(args.bundle)
    if b.router_kind != "vocab":
        raise MoLoRAError(
            f"train-routed trains under a bundle's vocab router; {b.folder} has router kind "
            f'{b.router_kind!r} (give a bundle whose molora.json has "router": {{"kind": "vocab"}} '
            "and vocab_routes)"
        )
    pairs = read_examples(args.data)
    model, tok = load_base(b.base)  # float32: train_routed trains the bank's slots in the model's dtype
    router = make_router(b, tokenizer=tok)
    names = [n for n in dict.fromkeys([r[2] for r in router.ranges] + [router.default]) if n is not None]
    outs = {n: Path(args.out) / n for n in names}
    stats = train_routed(model, tok, pairs, outs, router, _lora_config(args, bf16=False), **_bundle_text(b))
    print(
        f"wrote {', '.join(str(p) for p in outs.values())}: {len(pairs)} examples, {stats['tokens']} tokens in "
        f"{stats['seconds']} s, final loss {stats['final_loss']}"
    )
    return 0


def _train_router_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--bundle", required=True, help="bundle folder whose adapters the router chooses between")
    p.add_argument(
        "--data",
        action="append",
        default=[],
        metavar="ADAPTER=FILE",
        help="an adapter's JSONL data (repeatable); use none=FILE for generic text",
    )
    p.add_argument("--mixed", type=int, default=0, help="also build this many two-adapter multi-turn sequences")
    p.add_argument("--placement", default="per_block", choices=["per_block", "shared"])
    p.add_argument("--composable", action="store_true", help="one independent gate per adapter")
    p.add_argument("--top-k", type=int, default=1, choices=[1, 2])
    p.add_argument(
        "--refine-margin",
        type=float,
        default=None,
        help="relabel tokens another adapter predicts better by this many nats",
    )
    p.add_argument(
        "--carry-blocks",
        type=int,
        default=None,
        help="generated tokens take their predecessor's last-block decision in blocks below this "
        "(default 2 for per_block top-1 routers, 0 = off)",
    )
    p.add_argument(
        "--probe-prompt",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="route each prompt token's blocks by a probe pass's last-block decision (one more "
        "forward over the prompt; default: on wherever carry is on)",
    )
    p.add_argument(
        "--confidence",
        type=float,
        default=0.0,
        help="an adapter takes a token only with at least this gate probability, else the base model "
        "does (0..1; default 0 = the most probable class; choose it on validation data)",
    )
    p.add_argument(
        "--prompt-share",
        type=float,
        default=0.0,
        help="a request whose prompt the probe gives to adapters less than this share of runs wholly "
        "on the base model (0..1; needs the probe; default 0 = only a wholly unclaimed prompt)",
    )
    p.add_argument(
        "--tokens-per-seq",
        type=int,
        default=16,
        help="labelled tokens sampled per sequence for the gates (default 16; more trains rare "
        "positions better, memory grows as tokens x blocks x hidden size)",
    )
    p.add_argument("--limit", type=int, default=300, help="sequences per data file at most (default 300)")
    p.add_argument("--seed", type=int, default=0)


@command("train-router", _train_router_args)
def _train_router(args: argparse.Namespace) -> int:
    """Train the learned router (base and adapters frozen) and write it into the bundle."""
    from molora.bundle import load
    from molora.train.router import RouterTrainConfig
    from molora.train.router_cli import train_router_for_bundle

    mm = load(args.bundle)
    cfg = RouterTrainConfig(
        placement=args.placement,
        composable=args.composable,
        top_k=args.top_k,
        refine_margin=args.refine_margin,
        carry_blocks=args.carry_blocks,
        probe_prompt=args.probe_prompt,
        confidence=args.confidence,
        prompt_share=args.prompt_share,
        tokens_per_seq=args.tokens_per_seq,
        seed=args.seed,
    )
    data = dict(d.split("=", 1) for d in args.data)
    report = train_router_for_bundle(mm, data, cfg, limit=args.limit, mixed=args.mixed, seed=args.seed)
    print(json.dumps(report))
    return 0


def _train_gates_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--bundle", required=True, help="bundle folder whose adapters get gates")
    p.add_argument(
        "--data",
        action="append",
        default=[],
        metavar="ADAPTER=FILE",
        help="an adapter's own JSONL data (repeatable; its prompts are used): only these adapters' gates are "
        "trained, the gates of others already in --out are kept unchanged",
    )
    p.add_argument("--out", default=None, help="gates folder (default: BUNDLE/gates, what --router gates loads)")
    p.add_argument("--limit", type=int, default=200, help="prompts per data file at most (default 200)")
    p.add_argument("--seed", type=int, default=0)


@command("train-gates", _train_gates_args)
def _train_gates(args: argparse.Namespace) -> int:
    """Train one gate per named adapter on its own prompts against general text (composable: no retraining)."""
    from molora.bundle import GATES_FOLDER, load
    from molora.train.adapter import read_examples
    from molora.train.gates import train_gates_for_bundle

    if not args.data:
        raise MoLoRAError("give --data ADAPTER=FILE for each adapter whose gate to train")
    mm = load(args.bundle)
    prompts = {k: [p for p, _ in read_examples(v)[: args.limit]] for k, v in (d.split("=", 1) for d in args.data)}
    out = Path(args.out) if args.out else mm.bundle.folder / GATES_FOLDER
    print(json.dumps(train_gates_for_bundle(mm, prompts, out=out, seed=args.seed)))
    return 0


def _build_default_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--out", required=True, help="folder for the bundle")
    p.add_argument("--data-only", action="store_true", help="write only the training JSONL files")
    p.add_argument("--n-train", type=int, default=1500, help="training examples per adapter (default 1500)")
    p.add_argument("--seed", type=int, default=0)


@command("build-default", _build_default_args)
def _build_default(args: argparse.Namespace) -> int:
    """Rebuild the embedded default bundle (data, four adapters, router) with one seeded command."""
    from molora.train.default import DefaultRecipe, build_default

    out = build_default(args.out, DefaultRecipe(n_train=args.n_train, seed=args.seed), data_only=args.data_only)
    print(f"wrote {out}")
    return 0


def _build_multimodal_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--out", required=True, help="folder for the digits bundle")
    p.add_argument("--base-steps", type=int, default=650, help="base training steps (default 650)")
    p.add_argument("--base-from", default=None, metavar="DIR", help="reuse a trained base folder instead")
    p.add_argument("--seed", type=int, default=0)


@command("build-multimodal", _build_multimodal_args)
def _build_multimodal(args: argparse.Namespace) -> int:
    """Rebuild the shipped early-fusion digits bundle (base, four adapters, vocab router) with one seeded command."""
    import torch

    from molora.multimodal.recipe import DigitsRecipe, build_bundle

    torch.set_num_threads(1)  # the recipe's figures were taken single-threaded; the base is seeded either way
    out = build_bundle(
        args.out, DigitsRecipe(base_steps=args.base_steps, seed=args.seed), base_from=args.base_from, progress=True
    )
    print(f"wrote {out}")
    return 0
