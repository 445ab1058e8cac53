"""Bundles: a folder with `molora.json` naming a base model, its adapters, a router and a prompt template.

    mm = load("path/to/bundle")     # a MoLoRAModel, router and tokenizer attached; load(None): the embedded default

This module turns a parsed `Bundle` into a model: `load` reads the base, attaches the adapters (quantizing the base
on request), builds the router (`make_router`) and fills in what the manifest leaves to the tokenizer
(`with_tokenizer`: the chat template and its stop tokens; `load_tokenizer` for a front end that only tokenises).

Its parts: molora.manifest owns the manifest format (`Bundle`, `read_bundle`, `parse_manifest`, `write_manifest`,
the ChatML defaults); molora.prompts runs prompts through a loaded model outside the engine (`run_prompt`,
`generate_batch`, stop ids, per-token adapter traces). Their names are re-exported here, so
`from molora.bundle import read_bundle, run_prompt` keeps working. Knows nothing of requests or HTTP.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from molora.errors import BundleError, MoLoRAError
from molora.manifest import (
    CHATML_TEMPLATE,
    DEFAULT_BUNDLE_DIR,
    END_OF_TURN,
    FORMAT,
    MANIFEST,
    ROUTER_KINDS,
    AdapterEntry,
    Bundle,
    default_bundle_dir,
    parse_manifest,
    read_bundle,
    turn_text,
    write_manifest,
)
from molora.prompts import (
    PromptResult,
    encode_prompt,
    generate_batch,
    generation_adapters,
    left_pad,
    run_prompt,
    stop_ids,
    stop_token_ids,
    token_adapters,
    trace_forwards,
)
from molora.routing import Router, SequenceRouter, VocabRouter

if TYPE_CHECKING:
    from molora.model.attach import MoLoRAModel

__all__ = [  # the manifest's and the prompts' names are re-exported: their import path stays molora.bundle
    "CHATML_TEMPLATE",
    "DEFAULT_BUNDLE_DIR",
    "END_OF_TURN",
    "FORMAT",
    "MANIFEST",
    "QUANT_CALIBRATION_ROWS",
    "ROUTER_KINDS",
    "AdapterEntry",
    "attach_chooser",
    "Bundle",
    "hybrid_chooser",
    "PromptResult",
    "chat_prompt_template",
    "default_bundle_dir",
    "encode_prompt",
    "generate_batch",
    "generation_adapters",
    "left_pad",
    "load",
    "load_tokenizer",
    "make_router",
    "named_router",
    "parse_manifest",
    "quant_calibration_rows",
    "read_bundle",
    "run_prompt",
    "stop_ids",
    "stop_token_ids",
    "token_adapters",
    "trace_forwards",
    "turn_text",
    "with_tokenizer",
    "write_manifest",
]

GATES_FOLDER = "gates"  # where a bundle keeps per-adapter gates beside another router (`--router gates`)
QUANT_CALIBRATION_ROWS = 16  # general prompts with their answers an int8 base reads on load (SmoothQuant)


def quant_calibration_rows(tokenizer: Any, template: str = CHATML_TEMPLATE) -> list[list[int]]:
    """The token rows a w8a8 base measures SmoothQuant's activation ranges on (`load`, and the benches that build
    the same model): QUANT_CALIBRATION_ROWS general prompts with their answers in `template`."""
    from molora.data.general import general_rows

    return general_rows(tokenizer, QUANT_CALIBRATION_ROWS, template, with_output=True)


def make_router(bundle: Bundle, kind: str | None = None, tokenizer: Any = None) -> Router | None:
    """The bundle's router (or another kind it can provide: 'vocab' needs vocab_routes; 'arrow' and 'arrow-token'
    are the named routers of molora.routing.names, the bundle's own Arrow settings winning for 'arrow'; 'hybrid'
    chooses per request and is no token router: `hybrid_chooser`). A vocab router `from_tokenizer` reads its ranges
    from `tokenizer` (default: the base's, loaded here)."""
    kind = kind or bundle.router_kind
    if kind in ("arrow", "arrow-token"):
        from molora.routing.arrow import ArrowConfig, ArrowRouter
        from molora.routing.names import router_config

        options = router_config(kind, bundle.router_options)
        return ArrowRouter(
            ArrowConfig.from_json(options, where=f"bundle {bundle.name!r} router"), [a.name for a in bundle.adapters]
        )
    if kind == "gates":  # composable per-adapter gates (molora.routing.gates): the manifest's, else <bundle>/gates
        from molora.routing.gates import GateRouter

        own = bundle.router_kind == "gates"
        folder = bundle.router_path if own and bundle.router_path else bundle.folder / GATES_FOLDER
        if not folder.is_dir():
            raise BundleError(
                f"bundle {bundle.name!r} has no per-adapter gates ({folder} is missing); train them with "
                "experiments/gates_choose.py --gates-out DIR and name DIR as the router (kind gates)"
            )
        options = {k: v for k, v in bundle.router_options.items() if k not in ("kind", "path")} if own else {}
        gates = GateRouter.load(folder, options)
        unknown = [n for n in gates.adapter_names if n not in {a.name for a in bundle.adapters}]
        if unknown:
            raise BundleError(f"bundle {bundle.name!r}: gates for adapters {unknown} the manifest does not list")
        return gates
    if kind == "learned":
        from molora.routing.learned import LearnedRouter

        if bundle.router_path is None:
            raise BundleError(f"bundle {bundle.name!r} has no learned router")
        router = LearnedRouter.load(bundle.router_path)
        unknown = [n for n in router.adapter_names if n not in {a.name for a in bundle.adapters}]
        if unknown:
            raise BundleError(
                f"bundle {bundle.name!r}: the router was trained for adapters {unknown} that "
                f"the manifest does not list ({[a.name for a in bundle.adapters]})"
            )
        return router
    if kind == "vocab":
        if not bundle.vocab_routes:
            raise BundleError(f"bundle {bundle.name!r} defines no vocab_routes")
        routes = bundle.vocab_routes
        if "from_tokenizer" in routes:
            tokenizer = tokenizer if tokenizer is not None else load_tokenizer(bundle.base)[0]
            return VocabRouter.from_vocab(tokenizer.get_vocab(), routes["from_tokenizer"], routes.get("default"))
        if "ranges" not in routes:
            raise BundleError(f"bundle {bundle.name!r}: vocab_routes needs 'ranges' or 'from_tokenizer'")
        return VocabRouter([tuple(r) for r in routes["ranges"]], routes.get("default"))
    if kind == "sequence":
        first = bundle.adapters[0].name if bundle.adapters else None
        return SequenceRouter(first)
    return None


def load(
    path: str | Path | Bundle | None = None,
    *,
    base_only: bool = False,
    dtype: torch.dtype = torch.float32,
    dispatch: str = "auto",
    quantization: str | None = None,
    quantize_lm_head: bool | None = None,
    chooser: bool = True,
) -> Any:
    """A `MoLoRAModel` for the bundle at `path` (None: the embedded default; or a `Bundle` already parsed, e.g.
    `molora.userbundle.bundle_from_flags`), router and tokenizer attached. quantization ("int8", "int4", "w8a8";
    default the manifest's "quantization", else none): the base's linears quantized on load (molora.model.attach;
    quantize_lm_head: the LM head too, as attach takes it). A hybrid bundle gets its per-request chooser
    (`mm.chooser`, calibrated: `attach_chooser`) unless chooser=False (the caller converts the weights first, then
    calls attach_chooser)."""
    from molora.model.attach import attach
    from molora.model.base import load_base

    if isinstance(path, Bundle):
        bundle = path
    else:
        bundle = read_bundle(default_bundle_dir() if path is None else path)
    model, tokenizer = load_base(bundle.base, dtype)
    bundle = with_tokenizer(bundle, tokenizer, model)
    adapters = {} if base_only else {a.name: a.path for a in bundle.adapters}
    quantization = quantization or bundle.manifest.get("quantization")
    calibration = None
    if quantization == "w8a8":  # SmoothQuant's activation ranges: general text in the bundle's template
        calibration = quant_calibration_rows(tokenizer, bundle.prompt_template)
    try:
        mm = attach(
            model,
            adapters,
            slots=bundle.slots if not base_only else None,
            max_rank=bundle.max_rank,
            tokenizer=tokenizer,
            dispatch=dispatch,
            target_modules=bundle.target_modules,
            check_base=bundle.check_base,
            quantization=quantization,
            calibration=calibration,
            quantize_lm_head=quantize_lm_head,
        )
    except MoLoRAError as e:
        raise BundleError(f"bundle {bundle.folder}: {e}") from e
    router = None if base_only else make_router(bundle, tokenizer=tokenizer)
    mm.router = router.to(mm.device) if isinstance(router, torch.nn.Module) else router
    mm.bundle = bundle
    if hasattr(router, "bind"):  # Arrow: prototypes from the adapters' weights, once, before the first request
        router.bind(mm)  # (and a calibration on general text in the bundle's template, if asked)
    if chooser and not base_only:
        attach_chooser(mm)
    return mm


def attach_chooser(mm: MoLoRAModel) -> Any:
    """Give a model of a hybrid bundle (router kind "hybrid") its per-request chooser, `mm.chooser`: calibrated
    on its adapters from the cache or computed now (molora.calibration.hybrid_calibration, which logs its progress),
    and `mm.calibration`, what rebuilds it when adapters are loaded or unloaded at run time; other bundles are left
    as they are. Call it after any dtype conversion: the calibration is keyed by it."""
    bundle = mm.bundle
    if bundle is None or bundle.router_kind != "hybrid":
        return mm
    from molora.calibration import hybrid_calibration
    from molora.routing.hybrid import HybridSettings

    settings = HybridSettings.from_json(bundle.router_options, where=f"bundle {bundle.name!r}")
    mm.chooser, mm.calibration = hybrid_calibration(mm, settings)
    return mm


def named_router(mm: MoLoRAModel, name: str) -> Router:
    """The token router that router `name` (arrow, arrow-token: molora.routing.names) means on mm's bundle, bound to
    mm (Arrow's prototypes and its base option's calibration computed now): mm's own router when it is that one (an
    Arrow bundle's 'arrow'), so a name runs the same router as the bundle does. 'hybrid' is a per-request chooser:
    `hybrid_chooser`."""
    if name not in ("arrow", "arrow-token"):
        raise BundleError(
            f"router {name!r} is no named token router; use arrow or arrow-token (hybrid: hybrid_chooser)"
        )
    router = make_router(mm.bundle, name, mm.tokenizer)
    own = getattr(mm, "router", None)
    if type(own) is type(router) and own.config == router.config:  # type: ignore[attr-defined]
        return own
    router.bind(mm)  # type: ignore[attr-defined]
    return router


def hybrid_chooser(mm: MoLoRAModel) -> Any:
    """The per-request chooser that router name 'hybrid' means on mm (molora.routing.names): the bundle's own
    (`mm.chooser`, calibrated by `load`) when its router is hybrid, else one with the named settings, calibrated
    on mm's adapters from the cache or computed now (molora.calibration.hybrid_calibration: minutes the first
    time, then read back). mm is left as it is."""
    if getattr(mm, "chooser", None) is not None:
        return mm.chooser
    from molora.calibration import hybrid_chooser as calibrated
    from molora.routing.hybrid import HybridSettings
    from molora.routing.names import router_config

    own = mm.bundle.router_options if mm.bundle is not None else None
    return calibrated(mm, HybridSettings.from_json(router_config("hybrid", own), where="router 'hybrid'"))


PLACEHOLDER = "{prompt}"


def with_tokenizer(bundle: Bundle, tokenizer: Any, model: Any = None) -> Bundle:
    """The bundle with what it leaves to the tokenizer filled in: its `chat_template` installed on the tokenizer,
    and a prompt template of None rendered from the tokenizer's chat template (one user message whose content
    is the placeholder, so single-message prompts equal `apply_chat_template`'s), with the model's generation
    eos tokens added to `stop`."""
    if bundle.chat_template is not None:
        tokenizer.chat_template = bundle.chat_template
    if bundle.prompt_template is not None:
        return bundle
    return replace(
        bundle,
        prompt_template=chat_prompt_template(tokenizer),
        stop=tuple(dict.fromkeys(bundle.stop + tuple(_generation_eos(tokenizer, model, bundle.base)))),
    )


def chat_prompt_template(tokenizer: Any) -> str:
    """The tokenizer's chat template on one user message, with `{prompt}` where its content goes ("{prompt}"
    alone when the tokenizer has no chat template: raw text, as a base model wants it)."""
    if not getattr(tokenizer, "chat_template", None):
        return PLACEHOLDER
    try:
        text = tokenizer.apply_chat_template(
            [{"role": "user", "content": PLACEHOLDER}], add_generation_prompt=True, tokenize=False
        )
    except Exception as e:  # a Jinja template raises what it likes
        raise BundleError(
            f"the chat template cannot render one user message ({type(e).__name__}: {e}); give "
            "a working one with --chat-template FILE"
        ) from e
    if not isinstance(text, str) or text.count(PLACEHOLDER) != 1:
        raise BundleError(
            "the chat template does not render a user message's content verbatim; give a "
            "prompt_template in molora.json (with {prompt}) or another --chat-template"
        )
    return text


def _generation_eos(tokenizer: Any, model: Any, base: str) -> list[str]:
    """The tokens the model's generation config ends on (e.g. Llama 3's <|eot_id|> beside <|end_of_text|>); without
    the model (a front end that only tokenises), read from the base's generation_config.json where it has one."""
    config = getattr(model, "generation_config", None)
    if config is None and base != "default" and not base.endswith(".gguf"):
        from transformers import GenerationConfig

        try:
            config = GenerationConfig.from_pretrained(base, local_files_only=True)
        except (OSError, ValueError):
            config = None
    ids = getattr(config, "eos_token_id", None)
    ids = [ids] if isinstance(ids, int) else list(ids or [])
    return [t for t in tokenizer.convert_ids_to_tokens(ids) if isinstance(t, str)]


def load_tokenizer(base: str) -> tuple[Any, Any]:
    """(tokenizer, model config or None) of a bundle's base without loading its weights: what a front end
    that only tokenises needs (the Ray ingress)."""
    from transformers import AutoConfig, AutoTokenizer

    from molora.model.base import DEFAULT_BASE_NAME, cache_root, default_gguf_path

    if base in ("default", DEFAULT_BASE_NAME):
        cached = cache_root() / DEFAULT_BASE_NAME.rsplit("/", 1)[-1]
        path = cached if (cached / "config.json").is_file() else default_gguf_path()
    else:
        path = Path(base)
    try:
        if path.suffix == ".gguf":
            return AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name), None
        local = {} if path.exists() else {"local_files_only": True}  # a cached hub id: never a download
        return (AutoTokenizer.from_pretrained(str(path), **local), AutoConfig.from_pretrained(str(path), **local))
    except (OSError, ValueError) as e:
        raise BundleError(f"cannot load the tokenizer of base {base!r} from {path}: {e}") from e
