"""`molora generate | route | demo | codes-png`: answers and routing views on a bundle."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from molora.cli.registry import command

# --------------------------------------------------------------------------------------------- generate


ROUTER_CHOICES = ["learned", "arrow", "arrow-token", "hybrid", "gates", "vocab", "sequence"]


def add_router_arg(p: argparse.ArgumentParser) -> None:
    """`--routing/--router NAME` of route and generate (eval takes the same names among its modes)."""
    from molora.routing.names import names_help

    p.add_argument(
        "--routing",
        "--router",
        dest="routing",
        default=None,
        choices=ROUTER_CHOICES,
        help="router to use (default: the bundle's); each name is the same router in every command and in the "
        f"server's molora.routing: {names_help()}; gates: one gate per adapter, each trained on its own adapter's "
        "prompts only; learned, vocab, sequence: the bundle's own",
    )


def prompt_routing(mm, name: str | None, adapter: str | None = None) -> Callable[[str], dict]:
    """run_prompt's routing arguments ({"adapter", "router"}) per prompt text, for router `name` (None: the
    bundle's): a token router built once from the name (Arrow's prototypes and calibration computed here), or for
    hybrid the adapter its chooser picks for each prompt (the base model: none)."""
    from molora.bundle import hybrid_chooser, make_router, named_router
    from molora.errors import MoLoRAError
    from molora.routing import SequenceRouter

    if name is None and adapter is None and getattr(mm, "chooser", None) is not None:
        name = "hybrid"  # a hybrid bundle's own router is its per-request chooser
    if name is None:
        return lambda prompt: {"adapter": adapter, "router": None}
    if adapter is not None:
        raise MoLoRAError(f"--adapter {adapter} pins every token, which contradicts --router {name}; give one")
    if name == "hybrid":
        chooser = hybrid_chooser(mm)

        def pick(prompt: str) -> dict:
            chosen = chooser.choose_per_request(mm, [prompt])[0]
            return {"adapter": chosen, "router": None if chosen is not None else SequenceRouter(None)}

        return pick
    router = named_router(mm, name) if name in ("arrow", "arrow-token") else make_router(mm.bundle, name, mm.tokenizer)
    return lambda prompt: {"adapter": None, "router": router}


def _generate_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("prompt", help="the user message (the bundle's prompt template wraps it)")
    p.add_argument("--bundle", default=None, help="bundle folder (default: the embedded default bundle)")
    p.add_argument("--base-only", action="store_true", help="ignore the bundle's adapters: the plain base model")
    p.add_argument("--adapter", default=None, help="pin one adapter for every token instead of the router")
    add_router_arg(p)
    p.add_argument("--max-tokens", type=int, default=128, help="new tokens at most (default 128)")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--seed", type=int, default=None, help="sampling seed")
    p.add_argument(
        "--speculative-config",
        default=None,
        metavar="JSON",
        help='answer through the engine with speculative decoding, vLLM\'s flag: \'{"method": "ngram", '
        '"num_speculative_tokens": 4, "prompt_lookup_max": 4}\' or \'{"method": "suffix"}\' (the bundle\'s own '
        "router or --adapter; molora.engine.speculative)",
    )


@command("generate", _generate_args)
def _generate(args: argparse.Namespace) -> int:
    """One answer on a bundle (the default one unless --bundle), routed by its router or one pinned adapter."""
    from molora.bundle import load, run_prompt
    from molora.engine.speculative import SpeculativeConfig
    from molora.errors import MoLoRAError
    from molora.sampling import bundle_constraint

    speculative = SpeculativeConfig.parse(args.speculative_config) if args.speculative_config else None
    mm = load(args.bundle, base_only=args.base_only)
    routing = prompt_routing(mm, args.routing, args.adapter)(args.prompt)
    spans = bundle_constraint(mm.bundle, mm.tokenizer) is not None
    if spans or speculative is not None:  # constrained spans or speculation: the engine runs it
        if routing["router"] is not None and args.routing != "hybrid":
            why = "constrains spans, which" if spans else "is answered with speculation, which"
            raise MoLoRAError(
                f"bundle {mm.bundle.name if mm.bundle else '(base)'!r} {why} its engine applies with the bundle's own "
                f"router; drop --router {args.routing}"
            )
        print(
            engine_answer(
                mm,
                args.prompt,
                adapter=routing["adapter"],
                routing="none" if routing["router"] is not None else "auto",  # hybrid's pick of the base model
                max_new_tokens=args.max_tokens,
                temperature=args.temperature,
                seed=args.seed,
                speculative=speculative,
            )
        )
        return 0
    result = run_prompt(
        mm,
        args.prompt,
        **routing,
        max_new_tokens=args.max_tokens,
        temperature=args.temperature,
        seed=args.seed,
    )
    print(result.text)
    return 0


def engine_answer(
    mm,
    prompt: str,
    *,
    adapter: str | None = None,
    routing: str = "auto",
    max_new_tokens: int = 128,
    temperature: float = 0.0,
    seed: int | None = None,
    speculative: Any = None,
) -> str:
    """One answer through the engine (what the server runs), e.g. for a bundle with constrained spans or with
    speculative decoding (`speculative`: a SpeculativeConfig); the KV cache sized for this one request."""
    from molora.bundle import encode_prompt, stop_ids
    from molora.config import SamplingParams
    from molora.engine import Engine, EngineConfig

    ids = encode_prompt(mm, prompt)
    n = len(ids) + max_new_tokens
    eng = Engine(mm, EngineConfig(max_num_seqs=1, max_model_len=n, kv_budget_tokens=n, speculative=speculative))
    try:
        params = SamplingParams(
            max_new_tokens=max_new_tokens, temperature=temperature, seed=seed, stop_token_ids=tuple(stop_ids(mm))
        )
        return eng.generate([ids], params, adapter=adapter, routing=routing)[0].new_text.strip()
    finally:
        eng.close()


# --------------------------------------------------------------------------------------------- route


def _route_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("prompt", help="the user message")
    p.add_argument("--bundle", default=None, help="bundle folder (default: the embedded default bundle)")
    add_router_arg(p)
    p.add_argument("--adapter", default=None, help="pin one adapter instead of routing")
    p.add_argument("--max-tokens", type=int, default=64, help="new tokens at most (default 64)")
    p.add_argument("--json", action="store_true", help='print {"tokens":[{"text","adapter"}...]} instead')
    p.add_argument("--html", default=None, metavar="FILE", help="also write a coloured HTML page with a legend")


@command("route", _route_args)
def _route(args: argparse.Namespace) -> int:
    """Generate and show each token of prompt and answer coloured by its adapter."""
    from molora.bundle import load
    from molora.view import render_json, to_ansi, to_html, to_plain

    mm = load(args.bundle)
    routing = prompt_routing(mm, args.routing, args.adapter)(args.prompt)
    view = routed_view(mm, args.prompt, **routing, max_new_tokens=args.max_tokens)
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
    p.add_argument(
        "--html", default="routing.html", metavar="FILE", help="routing page to write (default routing.html)"
    )
    p.add_argument(
        "--max-tokens",
        type=int,
        default=320,
        help="answer budget per prompt (default 320: the adapters' worked solutions fit; most stop well before)",
    )
    p.add_argument(
        "--multimodal",
        action="store_true",
        help="the early-fusion digits bundle instead: a PNG grid of digits drawn per mode (base, each "
        "adapter on every token, both summed, vocab-routed) and the caption table",
    )
    p.add_argument(
        "--png",
        default="multimodal_digits.png",
        metavar="FILE",
        help="with --multimodal: the grid to write (default multimodal_digits.png)",
    )


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
    p.add_argument(
        "text", help="generated text holding <img_0>..<img_15> codes (the first image is drawn), or - for stdin"
    )
    p.add_argument("--out", required=True, help="PNG file to write")
    p.add_argument("--scale", type=int, default=16, help="pixels per code (default 16)")


@command("codes-png", _codes_png_args)
def _codes_png(args: argparse.Namespace) -> int:
    """Turn the image codes of a digits-bundle answer (as `molora generate` or the server return it) into a PNG."""
    from molora.multimodal.generate import levels_from_text, to_pixels, write_png

    text = sys.stdin.read() if args.text == "-" else args.text
    print(f"wrote {write_png(to_pixels(levels_from_text(text), args.scale), args.out)}")
    return 0
