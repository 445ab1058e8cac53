"""Which bundles a server serves and which bundle and adapter a request's `model` names.

`ModelInfo` is what the handlers know of one served bundle (tokenizer, stop ids, context length, prompt template,
its adapters, which follow loads and unloads); `Catalog` holds a server's bundles by name and resolves a model id
(`bundle`, `adapter`, `bundle:adapter`) to one of them, answering 404 or 400 as vLLM does for an unknown or an
ambiguous name. Knows nothing of engines, requests or HTTP transport.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from molora.config import (
    DEFAULT_MAX_ARRAY_ITEMS,
    DEFAULT_MAX_NUMBER_DIGITS,
    DEFAULT_MAX_OBJECT_PROPERTIES,
    DEFAULT_MAX_STRING_CHARS,
)
from molora.errors import MoLoRAError
from molora.server.protocol import APIError


@dataclass
class ModelInfo:
    """What the handlers need to know about the served model; `adapters` follows loads and unloads."""

    name: str
    tokenizer: Any
    stop_token_ids: tuple[int, ...]
    vocab_size: int
    max_model_len: int | None = None
    prompt_template: str | None = None  # the bundle's, with "{prompt}"; None: the tokenizer's template
    adapters: list[str] = field(default_factory=list)
    default_max_tokens: int = 512  # chat without max_tokens (capped by the context left)
    adapter_paths: dict[str, str | None] = field(default_factory=dict)  # /v1/models' "root" of each adapter
    mixes: dict[str, dict[str, float]] = field(default_factory=dict)  # named mixes (POST /v1/mixes, molora.json)
    chooser: str | None = None  # "hybrid": model=<name> asks the engine's per-request chooser (molora.server.choosing)
    tool_parser: str | None = None  # --enable-auto-tool-choice: parses tool_choice "auto" (None: "auto" is refused)
    # chat messages' special-token literals are tokenized as text (molora.server.special_tokens) unless this is set
    allow_special_tokens_in_chat: bool = False
    # structured output closes free strings, unbounded arrays, open objects and numbers at these (molora.structured;
    # None: unbounded)
    max_json_string_chars: int | None = DEFAULT_MAX_STRING_CHARS
    max_json_array_items: int | None = DEFAULT_MAX_ARRAY_ITEMS
    max_json_object_properties: int | None = DEFAULT_MAX_OBJECT_PROPERTIES
    max_json_number_digits: int | None = DEFAULT_MAX_NUMBER_DIGITS

    @property
    def models(self) -> list[str]:
        """The model ids this bundle answers to: itself (the base, or its router), each adapter's name (pinned,
        as vLLM names a LoRA) and `name:adapter` (the same, unambiguous when a server serves several bundles); a named
        mix the same way as an adapter (`pinned` then names the mix: the handler tells them apart)."""
        named = list(self.adapters) + [m for m in self.mixes if m not in self.adapters]
        return [self.name] + named + [f"{self.name}:{a}" for a in named]

    def pinned(self, model: str) -> str | None:
        """The pinned adapter of `model`, one of `models` (None for the base name)."""
        if model == self.name:
            return None
        return model if model in self.adapters or model in self.mixes else model[len(self.name) + 1 :]


class Catalog:
    """The bundles a server serves, by name; `resolve(model)` finds the bundle and adapter a request names."""

    def __init__(self, infos: Sequence[ModelInfo]) -> None:
        if not infos:
            raise MoLoRAError("a server needs at least one bundle")
        self.infos = {i.name: i for i in infos}
        if len(self.infos) != len(infos):
            raise MoLoRAError(f"two bundles share a name: {[i.name for i in infos]}; give each its own")

    def __iter__(self) -> Iterator[ModelInfo]:
        return iter(self.infos.values())

    def __len__(self) -> int:
        return len(self.infos)

    @property
    def models(self) -> list[str]:
        return [m for info in self for m in info.models]

    def bundle(self, name: str | None) -> ModelInfo:
        """The bundle called `name` (None: the only one); 404 for anything else."""
        if name is None:
            if len(self.infos) == 1:
                return next(iter(self))
            raise APIError(400, f"this server serves several bundles {list(self.infos)}; name one", param="bundle")
        if name not in self.infos:
            raise APIError(
                404,
                f"bundle {name!r} is not served here; served: {list(self.infos)}",
                param="bundle",
                code="bundle_not_found",
            )
        return self.infos[name]

    def adapter_id(self, info: ModelInfo, adapter: str) -> str:
        """The id /v1/models lists for an adapter: its bare name (vLLM's), or `bundle:adapter` where the bare
        name is ambiguous (several bundles hold it, or it is some bundle's own name)."""
        holders = [i for i in self if adapter in i.adapters or adapter in i.mixes]
        return adapter if len(holders) == 1 and adapter not in self.infos else f"{info.name}:{adapter}"

    def resolve(self, model: str) -> tuple[ModelInfo, str | None]:
        """(bundle, pinned adapter or None for the base name) of a model id; 404 for anything else, 400 for a
        bare adapter name that several bundles hold."""
        if model in self.infos:
            return self.infos[model], None
        holders = [info for info in self if model in info.adapters or model in info.mixes]
        if len(holders) > 1:
            raise APIError(
                400,
                f"adapter {model!r} is served by several bundles; name one as {[f'{i.name}:{model}' for i in holders]}",
                param="model",
                code="model_ambiguous",
            )
        for info in holders or self:
            if model in info.models:
                return info, info.pinned(model)
        raise APIError(
            404,
            f"model {model!r} does not exist; this server serves {self.models}",
            param="model",
            code="model_not_found",
        )
