"""Router names: what `--router NAME` (serve, route, generate, eval), `--routing NAME` and the server's
`"molora": {"routing": NAME}` mean, in one place. Each name is one router, the same in every command:

    arrow        prompt-level Arrow (data-free, from the adapters' weights): the probe decides each prompt token at
                 one block, the prompt votes, a prompt with too few claimed tokens runs wholly on the base model
                 (its base option is calibrated on general text); the settings chosen on validation
    arrow-token  Arrow's plain defaults (PEFT's): every adapted linear routes every token on its own, no base option
    hybrid       one adapter or the base model per request: Arrow's prompt vote decides whether, the adapters'
                 confidence over a pool the base model writes decides which (calibrated once, cached:
                 molora.calibration)

A bundle's own router object wins over the name's settings where it is of the same kind (a manifest router
{"kind": "arrow", ...} is what `arrow` means on that bundle; {"kind": "hybrid", ...} what `hybrid` means).
`router_config` is the one place that turns a name into a manifest router object; `molora.bundle.make_router`
and `molora.userbundle.router_entry` build from it. Pure data: knows no models.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from molora.errors import RoutingError

# `arrow`: what experiments/arrow_variants_choose.py chose on validation (docs/arrow_variants_choice.json: block 25
# of 30 = 5/6 of the depth, the default source_block; scored once on test in docs/arrow_prompt.json)
ARROW_ROUTER: dict[str, Any] = {
    "kind": "arrow",
    "granularity": "per_block",
    "prompt": True,
    "rms_threshold": 2.0,
    "prompt_share": 0.2,
    "prompt_window": 64,
}

# `arrow-token`: Arrow's defaults (molora.routing.arrow.ArrowConfig(), PEFT's create_arrow_model): per linear, top-1
ARROW_TOKEN_ROUTER: dict[str, Any] = {"kind": "arrow"}

# `hybrid`: what experiments/datafree_hybrid.py chose on validation (docs/datafree_hybrid_choice.json: Arrow's own
# setting above, block 25 of 30, with z_or 3.5 and no z_floor; scored once on test in docs/datafree_hybrid_prompt.json),
# over the pool of experiments/datafree_pool.py's seeded command (seed 0, batches of 128, 48 tokens, T 1.0), of which
# the first 400 turns: the pool size experiments/hybrid_pool_size.py chose on validation
# (docs/hybrid_pool_size_choice.json; the 800 turns the choice was made with take twice the start-up time)
HYBRID_ROUTER: dict[str, Any] = {
    "kind": "hybrid",
    "arrow": {k: v for k, v in ARROW_ROUTER.items() if k != "kind"},
    "z_or": 3.5,
    "z_floor": None,
    "pool_n": 400,
    "pool_seed": 0,
    "pool_batch": 128,
    "pool_max_new_tokens": 48,
    "pool_temperature": 1.0,
}

NAMED_ROUTERS: dict[str, dict[str, Any]] = {
    "arrow": ARROW_ROUTER,
    "arrow-token": ARROW_TOKEN_ROUTER,
    "hybrid": HYBRID_ROUTER,
}

# one line per name, for the help text of every command that takes one
ROUTER_HELP: dict[str, str] = {
    "arrow": "prompt-level Arrow from the adapters' weights, no training: the prompt votes once, general prompts "
    "stay on the base model (settings chosen on validation, docs/arrow_variants_choice.json)",
    "arrow-token": "Arrow's plain defaults (as PEFT): every linear routes every token, no base option",
    "hybrid": "one adapter or the base model per request: Arrow's prompt vote says whether, the adapters' "
    "confidence says which (calibrated once, minutes, cached in $MOLORA_CACHE/hybrid; "
    "docs/datafree_hybrid_choice.json)",
}


def names_help() -> str:
    """'arrow: ...; arrow-token: ...; hybrid: ...' for a command's help text (argparse-safe: % doubled)."""
    return "; ".join(f"{n}: {h}" for n, h in ROUTER_HELP.items()).replace("%", "%%")


def router_config(name: str, own: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The manifest router object that router `name` (a key of NAMED_ROUTERS) means on a bundle whose own router
    object is `own` (None: none): `own` itself where it is of the name's kind (`arrow` on an Arrow bundle,
    `hybrid` on a hybrid one: the bundle's settings win), else the name's settings. A deep copy either way."""
    if name not in NAMED_ROUTERS:
        raise RoutingError(f"router {name!r}: the named routers are {', '.join(NAMED_ROUTERS)}")
    chosen: Mapping[str, Any] = NAMED_ROUTERS[name]
    if name != "arrow-token" and own is not None and own.get("kind") == chosen["kind"]:
        chosen = own
    return {k: dict(v) if isinstance(v, Mapping) else v for k, v in chosen.items()}
