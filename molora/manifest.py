"""The bundle manifest: `molora.json` in a bundle folder, read, checked and written; no model is loaded here.

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
      "slots": 8, "max_rank": 16,
      "mixes": {"arith_words": {"arith": 0.5, "words": 0.5}},  # named static mixes (molora.routing.mix)
      "router_experts": ["arith_words"]   # mixes the router takes as experts (Engine.set_router_experts)
    }

A router {"kind": "arrow", "top_k": 1, "temperature": 1.0, "granularity": "per_linear" | "per_block",
"threshold": null} needs no folder and no training: it routes from the adapters' own weights;
{"kind": "arrow", "granularity": "per_block", "prompt": true, "rms_threshold": 2.0, "prompt_share": 0.2} decides per
prompt with a base option calibrated on general text (what `--router arrow` writes; `molora.routing.arrow`).
{"kind": "hybrid", "arrow": {...}, "z_or": 3.5, "pool_n": 800, ...} chooses one adapter (or the base model) per
request (`molora.routing.hybrid.HybridSettings`; what `--router hybrid` writes), calibrated at load on text the base
model writes (`molora.calibration`).

Relative paths resolve against the bundle folder; every file the manifest names is checked to exist when it is read
(`read_bundle`, `parse_manifest`), so a bad bundle is refused before any weights load. Also the chat-turn text the
training, router and evaluation data share (`turn_text`, the ChatML defaults).

Kept apart from molora.bundle, which turns a parsed `Bundle` into a model: reading, checking and writing the format
touches no weights and no tokenizer. Owns the format and its validation; knows nothing of models, requests or HTTP.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from molora.errors import BundleError

MANIFEST = "molora.json"
ROUTER_KINDS = ("learned", "arrow", "hybrid", "gates", "vocab", "sequence", "none")
FORMAT = "molora-bundle/1"
DEFAULT_BUNDLE_DIR = Path(__file__).parent / "default_bundle"
CHATML_TEMPLATE = "<|im_start|>user\n{prompt}<|im_end|>\n<|im_start|>assistant\n"
END_OF_TURN = "<|im_end|>"


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
    mixes: dict = field(default_factory=dict)  # name -> {adapter: weight}, checked by the engine (Engine.add_mix)
    router_experts: list = field(default_factory=list)  # mixes the router takes as experts (Engine.set_router_experts)
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
    if kind == "hybrid":
        from molora.errors import RoutingError
        from molora.routing.hybrid import HybridSettings

        try:
            HybridSettings.from_json(router, where=f"router of {path}")
        except (RoutingError, TypeError) as e:
            raise BundleError(f"{path}: router: {e}") from e
    router_path = (folder / router["path"]).resolve() if router.get("path") else None
    if kind in ("learned", "gates") and (router_path is None or not router_path.is_dir()):
        raise BundleError(f"{path}: {kind} router folder {router_path} is missing")
    if raw.get("quantization") not in (None, "int8", "int4", "w8a8"):  # molora.ops.quant.SCHEMES
        raise BundleError(
            f'{path}: "quantization" must be "int8", "int4" or "w8a8" (or absent), got {raw["quantization"]!r}'
        )
    for key, kind_ in (("slots", int), ("max_rank", int), ("target_modules", list), ("chat_template", str)):
        if raw.get(key) is not None and not isinstance(raw[key], kind_):
            raise BundleError(f"{path}: {key!r} must be a {kind_.__name__}, got {raw[key]!r}")
    router_experts = raw.get("router_experts") or []
    if not isinstance(router_experts, list) or not all(
        isinstance(n, str) and n in (raw.get("mixes") or {}) for n in router_experts
    ):
        raise BundleError(
            f'{path}: "router_experts" must list names of "mixes" (the mixes the router takes as experts), '
            f"got {router_experts!r}"
        )
    mixes = raw.get("mixes") or {}
    if not isinstance(mixes, dict) or not all(isinstance(m, dict) for m in mixes.values()):
        raise BundleError(f'{path}: "mixes" must map names to {{adapter: weight}} objects, got {mixes!r}')
    clash = sorted(set(mixes) & set(names))
    if clash:
        raise BundleError(f"{path}: mixes {clash} share a name with an adapter; rename them")
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
        mixes={str(n): dict(m) for n, m in mixes.items()},
        router_experts=router_experts,
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
