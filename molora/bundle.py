"""Bundles: a folder with `molora.json` naming a base model, its adapters, a router and a prompt template.

    {
      "format": "molora-bundle/1",
      "name": "molora-default",
      "base": "default",                      # the embedded SmolLM2, a .gguf file or a transformers folder
      "prompt_template": "<|im_start|>user\\n{prompt}<|im_end|>\\n<|im_start|>assistant\\n",
      "stop": ["<|im_end|>"],
      "adapters": [{"name": "arith", "path": "adapters/arith", "description": "...",
                    "tasks": ["multistep_arithmetic_two"]}],
      "router": {"kind": "learned", "path": "router"},     # or "arrow" / "vocab" / "sequence" / "none"
      "vocab_routes": {"ranges": [[lo, hi, "adapter"]], "default": null},
                                              # or {"from_tokenizer": {"adapter": ["<token prefix>", ...]}}:
                                              # ranges read from the tokenizer's vocabulary
      "slots": 8, "max_rank": 16
    }

A router {"kind": "arrow", "top_k": 1, "temperature": 1.0, "granularity": "per_linear" | "per_block",
"threshold": null} needs no folder and no training: it routes from the adapters' own weights;
{"kind": "arrow", "granularity": "per_block", "prompt": true, "rms_threshold": 2.0, "prompt_share": 0.2} decides per
prompt with a base option calibrated on general text (what `--router arrow` writes; `molora.routing.arrow`).

Relative paths resolve against the bundle folder. `load(path_or_None)` returns a `MoLoRAModel` with the
router and tokenizer attached; None is the embedded default bundle shipped inside the package.
This module owns the manifest format and its validation; it knows nothing of requests or HTTP.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch

from molora.errors import BundleError, MoLoRAError
from molora.routing import Router, SequenceRouter, VocabRouter

MANIFEST = "molora.json"
ROUTER_KINDS = ("learned", "arrow", "vocab", "sequence", "none")
FORMAT = "molora-bundle/1"
DEFAULT_BUNDLE_DIR = Path(__file__).parent / "default_bundle"
CHATML_TEMPLATE = "<|im_start|>user\n{prompt}<|im_end|>\n<|im_start|>assistant\n"
END_OF_TURN = "<|im_end|>"
QUANT_CALIBRATION_ROWS = 16  # general prompts with their answers an int8 base reads on load (SmoothQuant)


def turn_text(template: str, prompt: str, answer: str | None = None, end: str = END_OF_TURN, last: bool = True) -> str:
    """One chat turn: template(prompt) [+ answer + end [+ "\\n" before a following turn]].

    Training data, router data and evaluation all render turns with this function, so they agree.
    """
    text = template.replace("{prompt}", prompt)
    if answer is None:
        return text
    return text + answer + end + ("" if last else "\n")


@dataclass(frozen=True)
class AdapterEntry:
    name: str
    path: Path
    description: str = ""
    tasks: tuple[str, ...] = ()


@dataclass(frozen=True)
class Bundle:
    """A parsed, validated manifest (paths resolved)."""

    folder: Path
    name: str
    base: str
    adapters: tuple[AdapterEntry, ...]
    router_kind: str = "none"
    router_path: Path | None = None
    router_options: dict = field(default_factory=dict)  # the manifest's router object (kind "arrow": its settings)
    vocab_routes: dict | None = None
    prompt_template: str | None = CHATML_TEMPLATE  # None: the tokenizer's chat template (filled in by `load`)
    stop: tuple[str, ...] = (END_OF_TURN,)
    slots: int | None = None
    max_rank: int | None = None
    extra: dict = field(default_factory=dict)
    chat_template: str | None = None  # a Jinja chat template that replaces the tokenizer's own
    target_modules: tuple[str, ...] | None = None  # linears made routable besides the adapters' own targets
    check_base: bool = True  # refuse adapters whose base_model_name_or_path names another base
    manifest: dict = field(default_factory=dict, repr=False, compare=False)  # the parsed JSON, as given

    def adapter_for_task(self, task: str) -> str | None:
        """The adapter whose `tasks` lists `task` (oracle routing), or None."""
        return next((a.name for a in self.adapters if task in a.tasks), None)

    def format_prompt(self, prompt: str) -> str:
        if self.prompt_template is None:
            raise BundleError(
                f"bundle {self.name!r} takes its prompt template from the tokenizer's chat template; "
                "load it with molora.load() first"
            )
        return self.prompt_template.replace("{prompt}", prompt)


def read_bundle(folder: str | Path) -> Bundle:
    """Parse `folder/molora.json` and check that every file it names exists."""
    folder = Path(folder)
    path = folder / MANIFEST
    try:
        raw = json.loads(path.read_text())
    except FileNotFoundError as e:
        raise BundleError(
            f"{path}: missing; a bundle folder holds {MANIFEST} (make one with "
            "`molora bundle init --model M --lora-modules NAME=PATH --out DIR`)"
        ) from e
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise BundleError(f"{path}: not valid JSON ({e})") from e
    if not isinstance(raw, dict):
        raise BundleError(f"{path}: expected a JSON object, got {type(raw).__name__}")
    return parse_manifest(raw, folder, where=str(path))


def parse_manifest(raw: dict, folder: Path, where: str) -> Bundle:
    """A manifest's fields checked and resolved (relative paths against `folder`); `where` names it in errors."""
    path = where
    if raw.get("format", FORMAT) != FORMAT:
        raise BundleError(f"{path}: format {raw.get('format')!r} is not {FORMAT!r}")
    adapters = []
    for i, a in enumerate(raw.get("adapters", [])):
        if not isinstance(a, dict) or "name" not in a or "path" not in a:
            raise BundleError(f"{path}: adapters[{i}] needs 'name' and 'path'")
        p = (folder / a["path"]).resolve()
        if not (p / "adapter_config.json").is_file():
            raise BundleError(f"{path}: adapter {a['name']!r}: {p} holds no adapter_config.json")
        adapters.append(AdapterEntry(a["name"], p, a.get("description", ""), tuple(a.get("tasks", []))))
    names = [a.name for a in adapters]
    if len(set(names)) != len(names):
        raise BundleError(f"{path}: duplicate adapter names {names}")
    router = raw.get("router") or {"kind": "none"}
    if not isinstance(router, dict):
        raise BundleError(
            f'{path}: "router" must be an object such as {{"kind": "learned", "path": "router"}}, got {router!r}'
        )
    kind = router.get("kind", "none")
    if kind not in ROUTER_KINDS:
        raise BundleError(f"{path}: router kind {kind!r}: use {', '.join(ROUTER_KINDS)}")
    if kind == "arrow":
        from molora.errors import RoutingError
        from molora.routing.arrow import ArrowConfig

        try:
            ArrowConfig.from_json(router, where=f"router of {path}")
        except (RoutingError, TypeError) as e:
            raise BundleError(f"{path}: router: {e}") from e
    router_path = (folder / router["path"]).resolve() if router.get("path") else None
    if kind == "learned" and (router_path is None or not router_path.is_dir()):
        raise BundleError(f"{path}: learned router folder {router_path} is missing")
    if raw.get("quantization") not in (None, "int8", "int4"):  # molora.ops.quant.SCHEMES
        raise BundleError(f'{path}: "quantization" must be "int8" or "int4" (or absent), got {raw["quantization"]!r}')
    for key, kind_ in (("slots", int), ("max_rank", int), ("target_modules", list), ("chat_template", str)):
        if raw.get(key) is not None and not isinstance(raw[key], kind_):
            raise BundleError(f"{path}: {key!r} must be a {kind_.__name__}, got {raw[key]!r}")
    return Bundle(
        folder=folder,
        name=str(raw.get("name", folder.name)),
        base=_resolve_base(raw, folder),
        adapters=tuple(adapters),
        router_kind=kind,
        router_path=router_path,
        router_options=dict(router),
        vocab_routes=raw.get("vocab_routes"),
        prompt_template=raw.get("prompt_template", CHATML_TEMPLATE),
        stop=tuple(raw.get("stop", [])),
        slots=raw.get("slots"),
        max_rank=raw.get("max_rank"),
        extra=raw.get("extra", {}),
        chat_template=raw.get("chat_template"),
        target_modules=tuple(raw["target_modules"]) if raw.get("target_modules") else None,
        check_base=bool(raw.get("check_base", True)),
        manifest=dict(raw),
    )


def _resolve_base(raw: dict, folder: Path) -> str:
    """The manifest's base: "default", an absolute path, a path relative to the bundle, or (when no such path
    exists) a model id that transformers resolves from its local cache."""
    base = str(raw.get("base", "default"))
    if base == "default" or Path(base).is_absolute():
        return base
    local = (folder / base).resolve()
    return str(local) if local.exists() or "/" not in base or base.startswith(".") else base


def write_manifest(folder: str | Path, manifest: dict) -> Path:
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / MANIFEST).write_text(json.dumps({"format": FORMAT, **manifest}, indent=2) + "\n")
    return folder / MANIFEST


def default_bundle_dir() -> Path:
    if not (DEFAULT_BUNDLE_DIR / MANIFEST).is_file():
        raise BundleError(
            f"the embedded default bundle is missing ({DEFAULT_BUNDLE_DIR}); rebuild it with "
            f"`molora build-default --out {DEFAULT_BUNDLE_DIR}`"
        )
    return DEFAULT_BUNDLE_DIR


def make_router(bundle: Bundle, kind: str | None = None, tokenizer: Any = None) -> Router | None:
    """The bundle's router (or another kind it can provide: 'vocab' needs vocab_routes). A vocab router
    `from_tokenizer` reads its ranges from `tokenizer` (default: the base's, loaded here)."""
    kind = kind or bundle.router_kind
    if kind == "arrow":
        from molora.routing.arrow import ArrowConfig, ArrowRouter

        # the manifest's settings when its router is Arrow; Arrow's defaults when asked for over another kind
        options = bundle.router_options if bundle.router_kind == "arrow" else {}
        return ArrowRouter(
            ArrowConfig.from_json(options, where=f"bundle {bundle.name!r} router"), [a.name for a in bundle.adapters]
        )
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
) -> Any:
    """A `MoLoRAModel` for the bundle at `path` (None: the embedded default; or a `Bundle` already parsed, e.g.
    `molora.userbundle.bundle_from_flags`), router and tokenizer attached. quantization ("int8", "int4"; default the
    manifest's "quantization", else none): the base's linears quantized on load (molora.model.attach)."""
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
    if quantization == "int8":  # SmoothQuant's activation ranges: general text in the bundle's template
        from molora.data.general import general_rows

        calibration = general_rows(tokenizer, QUANT_CALIBRATION_ROWS, bundle.prompt_template, with_output=True)
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
        )
    except MoLoRAError as e:
        raise BundleError(f"bundle {bundle.folder}: {e}") from e
    router = None if base_only else make_router(bundle, tokenizer=tokenizer)
    mm.router = router.to(mm.device) if isinstance(router, torch.nn.Module) else router
    mm.bundle = bundle
    if hasattr(router, "bind"):  # Arrow: prototypes from the adapters' weights, once, before the first request
        router.bind(mm)  # (and a calibration on general text in the bundle's template, if asked)
    return mm


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


# --------------------------------------------------------------------------------------------- prompts


@dataclass
class PromptResult:
    prompt: str
    text: str
    prompt_ids: list[int]
    answer_ids: list[int]
    adapters: list[str | None]  # one per token of prompt_ids + answer_ids


def encode_prompt(mm: Any, prompt: str) -> list[int]:
    """Token ids of `prompt` wrapped in the bundle's template (or the tokenizer's chat template)."""
    tok = mm.tokenizer
    bundle = getattr(mm, "bundle", None)
    if bundle is not None:
        return tok(bundle.format_prompt(prompt), add_special_tokens=False)["input_ids"]
    return tok.apply_chat_template(
        [{"role": "user", "content": prompt}], add_generation_prompt=True, tokenize=True, return_dict=True
    )["input_ids"]


def stop_token_ids(tok: Any, bundle: Bundle | None) -> list[int]:
    """End-of-sequence ids: the tokenizer's eos plus the bundle's stop tokens (ChatML's end without one)."""
    ids = {tok.eos_token_id} if getattr(tok, "eos_token_id", None) is not None else set()
    for s in bundle.stop if bundle is not None else (END_OF_TURN,):
        tid = tok.convert_tokens_to_ids(s)
        if isinstance(tid, int) and tid != getattr(tok, "unk_token_id", None) and tid >= 0:
            ids.add(tid)
    return sorted(ids)


def stop_ids(mm: Any) -> list[int]:
    return stop_token_ids(mm.tokenizer, getattr(mm, "bundle", None))


@torch.no_grad()
def run_prompt(
    mm: Any,
    prompt: str,
    *,
    adapter: str | None = None,
    router: Router | None = None,
    max_new_tokens: int = 128,
    temperature: float = 0.0,
    seed: int | None = None,
    trace: bool = False,
) -> PromptResult:
    """Generate an answer for one prompt; with trace=True also report each token's adapter."""
    ids = torch.tensor([encode_prompt(mm, prompt)], device=mm.device)
    spec = adapter if adapter is not None else (router if router is not None else mm.router)
    gen_spec = spec if spec is not None else SequenceRouter(None)  # no router: the base model
    stops = stop_ids(mm)
    in_network = trace and not isinstance(gen_spec, str) and gen_spec.in_network
    if in_network:
        mm.context.trace = []  # every block's decision in every forward of the generation itself
    try:
        out = mm.generate(
            ids,
            adapter_ids=gen_spec,
            max_new_tokens=max_new_tokens,
            temperature=temperature,
            eos_token_id=stops,
            seed=seed,
        )
        steps = mm.context.trace
    finally:
        mm.context.trace = None
    answer = out[0, ids.shape[1] :].tolist()
    while answer and answer[-1] in stops:
        answer.pop()
    text = mm.tokenizer.decode(answer, skip_special_tokens=True)
    full = out[:, : ids.shape[1] + len(answer)]
    if in_network:
        adapters = generation_adapters(steps, gen_spec, full.shape[1])
    else:
        adapters = token_adapters(mm, full, gen_spec) if trace else []
    return PromptResult(prompt, text, ids[0].tolist(), answer, adapters)


def left_pad(rows: Sequence[Sequence[int]], pad: int, device: Any = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(ids [B, L], attention_mask [B, L]) with each row right-aligned (left padding)."""
    L = max(len(r) for r in rows)
    ids = torch.full((len(rows), L), pad, dtype=torch.long)
    mask = torch.zeros((len(rows), L), dtype=torch.long)
    for b, row in enumerate(rows):
        ids[b, L - len(row) :] = torch.tensor(row, dtype=torch.long)
        mask[b, L - len(row) :] = 1
    return ids.to(device), mask.to(device)


def generate_batch(
    mm: Any, rows: Sequence[Sequence[int]], spec: str | Router, max_new: Sequence[int], stops: Sequence[int]
) -> tuple[list[list[int]], int]:
    """Greedy answers (token ids, stop token dropped) for prompt ids `rows`, and the tokens generated.

    Each row keeps at most its own max_new tokens, so an answer does not depend on its batch.
    """
    pad = mm.tokenizer.pad_token_id if mm.tokenizer.pad_token_id is not None else stops[0]
    ids, mask = left_pad(rows, pad, mm.device)
    out = mm.generate(
        ids, mask, adapter_ids=spec, max_new_tokens=max(max_new), eos_token_id=list(stops), pad_token_id=pad
    )
    answers, generated = [], 0
    for b, new in enumerate(out[:, ids.shape[1] :].tolist()):
        new = new[: max_new[b]]
        cut = next((i for i, t in enumerate(new) if t in stops), None)
        generated += len(new) if cut is None else cut + 1
        answers.append(new if cut is None else new[:cut])
    return answers, generated


def trace_forwards(trace: list) -> list[list[torch.Tensor]]:
    """`RoutingContext.trace` entries (block, ids [T, k]) grouped by forward (the block index starts over),
    each block's top choice ids[:, 0]."""
    forwards: list[list[torch.Tensor]] = []
    prev = None
    for block, ids in trace:
        if prev is None or block <= prev:
            forwards.append([])
        forwards[-1].append(ids[:, 0])
        prev = block
    return forwards


def generation_adapters(trace: list, router: Router, n: int) -> list[str | None]:
    """The adapter of each of n tokens (prompt + answer) as a generation routed it: the most frequent
    choice over blocks in the forward that ran the token, from `RoutingContext.trace` entries (block, ids).
    A probe forward (molora.routing.learned: Probe) is skipped: the prompt ran again with its decisions.
    A last answer token that was never fed back has no routing (None)."""
    forwards = trace_forwards(trace)
    if getattr(router, "probe_prompt", False):
        forwards = forwards[1:]
    picks: list[str | None] = []
    for f in forwards:
        for col in torch.stack(f).T.tolist():  # [blocks, tokens] -> per token
            best = max(set(col), key=col.count)
            picks.append(router.adapter_names[best] if best >= 0 else None)
    return (picks + [None] * n)[:n]


@torch.no_grad()
def token_adapters(mm: Any, ids: torch.Tensor, spec: Any) -> list[str | None]:
    """The adapter each token of ids [1, N] is routed to (learned: the most frequent choice over blocks)."""
    names = mm.adapter_names
    router = spec if spec is not None else mm.router
    if isinstance(router, str):
        return [router] * ids.shape[1]
    if router is not None and router.in_network:
        mm.context.trace = []
        try:
            mm(ids, adapter_ids=router)
            votes = torch.stack([t for _, t in mm.context.trace])[..., 0]  # [blocks, N] router order
        finally:
            mm.context.trace = None
        rnames = router.adapter_names
        picks = []
        for col in votes.T.tolist():
            best = max(set(col), key=col.count)
            picks.append(rnames[best] if best >= 0 else None)
        return picks
    routing = router.route(ids, names, start=0)
    first = routing.adapter_ids.reshape(ids.shape[1], -1)[:, 0].tolist()
    return [names[i] if i >= 0 else None for i in first]
