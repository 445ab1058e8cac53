"""PEFT LoRA adapter folders in and out.

A PEFT LoRA folder holds `adapter_config.json` and `adapter_model.safetensors` with keys
`base_model.model.<module path>.lora_A.weight` ([r, d_in]) and `...lora_B.weight` ([d_out, r]).
This module reads such a folder into plain tensors, checks it against the shapes of the base model's
linears, and writes one back. It owns file formats and validation; it does not know nn.Module, banks or
routing. Every refusal is an `AdapterError` naming the adapter, the file and the module.

Confinement: given `roots`, a read resolves the folder and every file it opens (symlinks followed,
`Path.resolve(strict=True)`) and refuses any that lands outside all of the roots, so a symlinked
`adapter_model.safetensors` inside an allowed folder cannot pull in a file from elsewhere. The reader opens
the resolved paths. Reading touches no shared state: it is safe on any thread (the engine reads on a worker).
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from molora.config import AdapterConfig
from molora.errors import AdapterError, MoLoRAError

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
KEY_PREFIX = "base_model.model."
_A_SUFFIX = ".lora_A.weight"
_B_SUFFIX = ".lora_B.weight"


@dataclass(frozen=True)
class ModuleLoRA:
    """One module's adapter: delta(x) = scale * B @ (A @ x). A [r, d_in], B [d_out, r]."""

    A: torch.Tensor
    B: torch.Tensor
    scale: float

    @property
    def rank(self) -> int:
        return int(self.A.shape[0])


@dataclass(frozen=True)
class LoRAAdapter:
    """A validated adapter: its name, where it came from, its config and weights per module path, and the
    roots it was confined to when read (None: unconfined); a re-read of `path` must use the same roots."""

    name: str
    path: Path | None
    config: AdapterConfig
    modules: dict[str, ModuleLoRA]
    roots: tuple[Path, ...] | None = None

    @property
    def max_rank(self) -> int:
        return max((m.rank for m in self.modules.values()), default=0)

    def nbytes(self) -> int:
        return sum(m.A.numel() * m.A.element_size() + m.B.numel() * m.B.element_size() for m in self.modules.values())


# --------------------------------------------------------------------------------------------- reading


def resolve_roots(roots: Sequence[str | Path] | None) -> tuple[Path, ...] | None:
    """The confinement roots, resolved (symlinks followed) so that resolved files compare against them."""
    return None if roots is None else tuple(Path(r).resolve() for r in roots)


def confine(path: Path, roots: tuple[Path, ...] | None, who: str) -> Path:
    """`path` resolved, if it lies under one of `roots` (resolved ones); `path` unchanged when roots is None or
    it does not exist (the caller's own open then reports it missing)."""
    if roots is None:
        return path
    try:
        real = path.resolve(strict=True)
    except FileNotFoundError:
        return path
    except (OSError, RuntimeError) as e:  # a symlink loop, a permission error
        raise AdapterError(f"{who}: cannot resolve {path} ({e})") from e
    if not any(real.is_relative_to(r) for r in roots):
        raise AdapterError(
            f"{who}: {path} resolves to {real}, outside the adapter roots "
            f"{[str(r) for r in roots]}; copy the files into the adapter folder instead of linking them"
        )
    return real


def read_adapter_config(
    path: str | Path, name: str = "", *, roots: Sequence[str | Path] | None = None
) -> AdapterConfig:
    """Parse and check `adapter_config.json`; refuse PEFT variants molora cannot serve. With `roots`, the
    folder and the file must resolve inside one of them (module docstring: Confinement)."""
    folder = Path(path)
    cfg_path = folder / CONFIG_FILE
    who = f"adapter {name!r} ({cfg_path})" if name else str(cfg_path)
    roots = resolve_roots(roots)
    if not folder.is_dir():
        raise AdapterError(
            f"adapter {name!r}: {folder} is not a folder; pass a PEFT LoRA folder "
            f"holding {CONFIG_FILE} and {WEIGHTS_FILE}"
        )
    confine(folder, roots, f"adapter {name!r}")
    try:
        raw = json.loads(confine(cfg_path, roots, who).read_text())
    except FileNotFoundError as e:
        raise AdapterError(f"{who}: missing; a PEFT LoRA folder needs {CONFIG_FILE}") from e
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise AdapterError(f"{who}: not valid JSON ({e})") from e
    except RecursionError as e:
        raise AdapterError(f"{who}: nested too deeply to be an adapter config") from e
    if not isinstance(raw, dict):
        raise AdapterError(f"{who}: expected a JSON object, got {type(raw).__name__}")
    _refuse_unsupported(raw, who)
    targets = raw.get("target_modules")
    if isinstance(targets, list):
        targets = tuple(str(t) for t in targets)
    elif not isinstance(targets, str):
        raise AdapterError(f"{who}: target_modules must be a list of names or a regex string, got {targets!r}")
    layers = raw.get("layers_to_transform")
    if isinstance(layers, int):
        layers = (layers,)
    try:
        return AdapterConfig(
            r=int(raw.get("r", 8)),
            lora_alpha=float(raw.get("lora_alpha", 8)),
            target_modules=targets,
            use_rslora=bool(raw.get("use_rslora", False)),
            base_model_name_or_path=raw.get("base_model_name_or_path"),
            rank_pattern={str(k): int(v) for k, v in (raw.get("rank_pattern") or {}).items()},
            alpha_pattern={str(k): float(v) for k, v in (raw.get("alpha_pattern") or {}).items()},
            layers_to_transform=tuple(layers) if layers else None,
        )
    except (TypeError, ValueError, OverflowError, AttributeError, MoLoRAError) as e:
        raise AdapterError(f"{who}: bad value ({e})") from e


def _refuse_unsupported(raw: dict, who: str) -> None:
    peft_type = str(raw.get("peft_type", "LORA")).upper()
    if peft_type != "LORA":
        raise AdapterError(f"{who}: peft_type {peft_type!r} is not supported; molora serves plain LoRA adapters")
    checks = [
        (raw.get("use_dora"), "use_dora=true (DoRA) is not supported; retrain as plain LoRA"),
        (raw.get("fan_in_fan_out"), "fan_in_fan_out=true (Conv1D bases such as GPT-2) is not supported"),
        (raw.get("bias", "none") not in (None, "none"), f"bias={raw.get('bias')!r}: only bias='none' is supported"),
        (raw.get("lora_bias"), "lora_bias=true is not supported"),
        (
            raw.get("modules_to_save"),
            f"modules_to_save={raw.get('modules_to_save')!r}: fully trained modules "
            "are not supported; only LoRA deltas can be routed per token",
        ),
        (raw.get("layers_pattern") not in (None, [], ""), "layers_pattern is not supported"),
    ]
    for bad, why in checks:
        if bad:
            raise AdapterError(f"{who}: {why}")
    init = raw.get("init_lora_weights", True)
    if isinstance(init, str) and init.lower() not in ("gaussian", "true", "pissa", "olora", "loftq", "eva", "corda"):
        raise AdapterError(f"{who}: init_lora_weights={init!r} is not recognised")


def _expected_modules(cfg: AdapterConfig, candidates: Mapping[str, tuple[int, int]]) -> set[str]:
    """The base-model linears PEFT would have adapted, by its matching rules."""
    out = set()
    for module in candidates:
        if isinstance(cfg.target_modules, str):
            hit = re.fullmatch(cfg.target_modules, module) is not None
        else:
            hit = any(module == t or module.endswith("." + t) for t in cfg.target_modules)
        if hit and cfg.layers_to_transform is not None:
            m = re.search(r"\.layers\.(\d+)\.", module)
            hit = m is not None and int(m.group(1)) in cfg.layers_to_transform
        if hit:
            out.add(module)
    return out


def read_adapter(
    path: str | Path,
    module_shapes: Mapping[str, tuple[int, int]],
    *,
    name: str | None = None,
    base_name: str | None = None,
    roots: Sequence[str | Path] | None = None,
    base_norms: Mapping[str, float] | None = None,
) -> LoRAAdapter:
    """Read and validate a PEFT LoRA folder against the base model.

    module_shapes maps each linear of the base model (module path, e.g. `model.layers.0.self_attn.q_proj`)
    to its `(d_out, d_in)`. base_name, when given, must match the adapter's `base_model_name_or_path`
    (compared by their last path component, case-insensitively). roots, when given, confine every file read
    (module docstring: Confinement); the adapter remembers them for later re-reads. base_norms, when given, maps
    module paths to the Frobenius norm of the base weight: a module whose delta `scale * B @ A` is more than
    MAX_DELTA_RATIO times that norm is refused (`delta_norm_ratio`).
    """
    folder = Path(path)
    name = name or folder.name
    roots = resolve_roots(roots)
    cfg = read_adapter_config(folder, name, roots=roots)
    weights_path = folder / WEIGHTS_FILE
    who = f"adapter {name!r} ({weights_path})"
    _check_base(cfg, base_name, f"adapter {name!r} ({folder / CONFIG_FILE})")
    weights_path = confine(weights_path, roots, who)
    if not weights_path.is_file():
        extra = (
            " (found adapter_model.bin: re-save it with safe_serialization=True)"
            if (folder / "adapter_model.bin").exists()
            else ""
        )
        raise AdapterError(f"{who}: missing; molora reads only safetensors weights{extra}")
    try:
        tensors = load_file(str(weights_path))
    except (SafetensorError, OSError, RuntimeError) as e:
        raise AdapterError(f"{who}: cannot read safetensors file ({e})") from e
    pairs, unexpected = _pair_keys(tensors)
    expected = _expected_modules(cfg, module_shapes)
    missing = sorted(expected - set(pairs))
    untargeted = sorted(m for m in pairs if m in module_shapes and m not in expected)
    half = sorted(m for m, (a, b) in pairs.items() if a is None or b is None)
    unknown = sorted(m for m in pairs if m not in module_shapes)
    problems = []
    if unexpected:
        problems.append(f"unexpected keys {unexpected[:8]}{' …' if len(unexpected) > 8 else ''}")
    if half:
        problems.append(f"modules with only one of lora_A/lora_B {half[:8]}")
    if unknown:
        problems.append(f"modules not found among the base model's linears {unknown[:8]}")
    if missing:
        problems.append(f"missing keys for target modules {missing[:8]}{' …' if len(missing) > 8 else ''}")
    if untargeted:
        problems.append(
            f"weights for modules {untargeted[:8]}{' …' if len(untargeted) > 8 else ''} that target_modules "
            f"{cfg.target_modules!r} (with layers_to_transform {cfg.layers_to_transform}) does not name; the config "
            "and the weights must agree"
        )
    if problems:
        raise AdapterError(f"{who}: " + "; ".join(problems))
    if not pairs:
        raise AdapterError(f"{who}: holds no lora_A/lora_B weights")
    modules = {m: _module_lora(cfg, m, a, b, module_shapes[m], who) for m, (a, b) in sorted(pairs.items())}
    if base_norms is not None:
        _check_magnitude(modules, base_norms, who)
    return LoRAAdapter(name=name, path=folder, config=cfg, modules=modules, roots=roots)


def read_adapter_ranks(
    path: str | Path,
    module_shapes: Mapping[str, tuple[int, int]],
    *,
    name: str | None = None,
    base_name: str | None = None,
    roots: Sequence[str | Path] | None = None,
) -> dict[str, int]:
    """What `adapter_config.json` alone says: {module path: rank} of the base model's linears the adapter
    adapts, by PEFT's matching rules. Checks the config as `read_adapter` does (variant, base, confinement);
    never opens the weights file, so registering thousands of adapters costs one small JSON read each."""
    folder = Path(path)
    name = name or folder.name
    cfg = read_adapter_config(folder, name, roots=resolve_roots(roots))
    _check_base(cfg, base_name, f"adapter {name!r} ({folder / CONFIG_FILE})")
    modules = _expected_modules(cfg, module_shapes)
    if not modules:
        raise AdapterError(
            f"adapter {name!r} ({folder / CONFIG_FILE}): target_modules {cfg.target_modules!r} match none of the "
            "base model's linears"
        )
    return {m: cfg.rank_and_alpha(m)[0] for m in sorted(modules)}


def scan_adapter_dir(folder: str | Path) -> dict[str, Path]:
    """{subfolder name: subfolder} of every subfolder of `folder` that holds an `adapter_config.json`, by name;
    files and other subfolders are passed over. AdapterError if `folder` is not a folder."""
    root = Path(folder)
    if not root.is_dir():
        raise AdapterError(f"adapter folder {root} is not a folder; pass a folder of PEFT LoRA folders")
    return {p.name: p for p in sorted(root.iterdir()) if (p / CONFIG_FILE).is_file()}


def _check_base(cfg: AdapterConfig, base_name: str | None, who: str) -> None:
    if not base_name or not cfg.base_model_name_or_path:
        return
    norm = lambda s: Path(str(s).rstrip("/")).name.lower().removesuffix(".gguf")  # noqa: E731
    if norm(cfg.base_model_name_or_path) != norm(base_name):
        raise AdapterError(
            f"{who}: trained for base {cfg.base_model_name_or_path!r}, but the model is {base_name!r}; "
            "load it on its own base, or pass check_base=False if you know the weights are the same"
        )


def _pair_keys(tensors: Mapping[str, torch.Tensor]) -> tuple[dict[str, list], list[str]]:
    pairs: dict[str, list] = {}
    unexpected = []
    for key, t in tensors.items():
        if key.startswith(KEY_PREFIX) and key.endswith(_A_SUFFIX):
            pairs.setdefault(key[len(KEY_PREFIX) : -len(_A_SUFFIX)], [None, None])[0] = t
        elif key.startswith(KEY_PREFIX) and key.endswith(_B_SUFFIX):
            pairs.setdefault(key[len(KEY_PREFIX) : -len(_B_SUFFIX)], [None, None])[1] = t
        else:
            unexpected.append(key)
    return pairs, sorted(unexpected)


def _module_lora(
    cfg: AdapterConfig, module: str, A: torch.Tensor, B: torch.Tensor, shape: tuple[int, int], who: str
) -> ModuleLoRA:
    d_out, d_in = shape
    r = A.shape[0] if A.ndim == 2 else -1
    if A.ndim != 2 or B.ndim != 2 or A.shape[1] != d_in or B.shape != (d_out, r):
        raise AdapterError(
            f"{who}: module {module}: lora_A {tuple(A.shape)} / lora_B {tuple(B.shape)} do not fit the base "
            f"linear (d_out={d_out}, d_in={d_in}); expected lora_A [r, {d_in}] and lora_B [{d_out}, r]. "
            "Was it trained on another base model?"
        )
    if not A.is_floating_point() or not B.is_floating_point():
        raise AdapterError(f"{who}: module {module}: weights must be floating point, got {A.dtype}/{B.dtype}")
    for label, t in (("lora_A", A), ("lora_B", B)):
        if not torch.isfinite(t).all():
            raise AdapterError(f"{who}: module {module}: {label} holds NaN or Inf values")
    cfg_r, _ = cfg.rank_and_alpha(module)
    if cfg_r != r:
        raise AdapterError(f"{who}: module {module}: weights have rank {r} but the config says r={cfg_r}")
    return ModuleLoRA(A=A, B=B, scale=cfg.scaling(module, r))


# A trained LoRA changes its base weight by a small fraction: the default bundle's adapters reach 0.032 of a base
# linear's Frobenius norm, median about 0.008 (docs/adapter_magnitude.json, experiments/adapter_magnitude.py). A
# delta a hundred times the base weight is no fine-tune: it swamps the model and, scaled further, overflows the
# activations into non-finite logits, so such adapters are refused when they load.
MAX_DELTA_RATIO = 100.0


def delta_norm(m: ModuleLoRA) -> float:
    """||scale * B @ A||_F, exactly, without forming the [d_out, d_in] product: ||BA||_F^2 = sum((B^T B) * (A A^T))
    over r x r matrices, in float64 so that huge weights report a huge norm instead of overflowing."""
    a, b = m.A.double(), m.B.double()
    sq = float(((b.T @ b) * (a @ a.T)).sum())
    return abs(m.scale) * math.sqrt(sq) if math.isfinite(sq) and sq >= 0 else math.inf


def delta_norm_ratio(adapter: LoRAAdapter, base_norms: Mapping[str, float]) -> dict[str, float]:
    """{module: ||delta||_F / ||W||_F} for the adapter's modules whose base norm is known and non-zero."""
    return {m: delta_norm(lora) / base_norms[m] for m, lora in adapter.modules.items() if base_norms.get(m, 0.0) > 0.0}


def _check_magnitude(modules: Mapping[str, ModuleLoRA], base_norms: Mapping[str, float], who: str) -> None:
    for m, lora in modules.items():
        base = base_norms.get(m, 0.0)
        if base <= 0.0:
            continue
        ratio = delta_norm(lora) / base
        if not ratio <= MAX_DELTA_RATIO:
            raise AdapterError(
                f"{who}: module {m}: the delta scale * B @ A has {ratio:.3g} times the Frobenius norm of the base "
                f"weight (at most {MAX_DELTA_RATIO:g} is served; trained adapters stay far below 1); its weights or "
                "lora_alpha are not those of a fine-tune of this model"
            )


# --------------------------------------------------------------------------------------------- writing


def save_adapter(
    path: str | Path,
    modules: Mapping[str, tuple[torch.Tensor, torch.Tensor]],
    *,
    r: int,
    lora_alpha: float,
    use_rslora: bool = False,
    base_model_name_or_path: str | None = None,
    dtype: torch.dtype | None = None,
    extra_config: Mapping[str, object] | None = None,
) -> Path:
    """Write a PEFT LoRA folder that PEFT itself loads. modules maps module path → (A [r, d_in], B [d_out, r])."""
    folder = Path(path)
    folder.mkdir(parents=True, exist_ok=True)
    suffixes = sorted({m.rsplit(".", 1)[-1] for m in modules})
    ranks = {m: int(a.shape[0]) for m, (a, _) in modules.items()}
    config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "r": r,
        "lora_alpha": lora_alpha,
        "target_modules": suffixes,
        "use_rslora": use_rslora,
        "lora_dropout": 0.0,
        "bias": "none",
        "fan_in_fan_out": False,
        "use_dora": False,
        "modules_to_save": None,
        "init_lora_weights": True,
        "base_model_name_or_path": base_model_name_or_path,
        "inference_mode": True,
        "rank_pattern": {m: k for m, k in ranks.items() if k != r},
        "alpha_pattern": {},
    }
    config.update(extra_config or {})
    tensors = {}
    for m, (a, b) in modules.items():
        a, b = a.detach(), b.detach()
        if dtype is not None:
            a, b = a.to(dtype), b.to(dtype)
        tensors[f"{KEY_PREFIX}{m}{_A_SUFFIX}"] = a.contiguous().cpu()
        tensors[f"{KEY_PREFIX}{m}{_B_SUFFIX}"] = b.contiguous().cpu()
    try:
        (folder / CONFIG_FILE).write_text(json.dumps(config, indent=2) + "\n")
        save_file(tensors, str(folder / WEIGHTS_FILE))
    except OSError as e:
        raise AdapterError(f"cannot write adapter to {folder}: {e}") from e
    return folder
