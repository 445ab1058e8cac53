"""Small frozen configuration records, validated at construction.

Owns the plain-data descriptions of an adapter (what `adapter_config.json` says), of the adapter bank and
of sampling. Knows nothing about torch modules.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field

from molora.errors import MoLoRAError

# The linear projections of a Llama-family decoder block, in transformers' names.
LLAMA_PROJECTIONS: tuple[str, ...] = (
    "q_proj",
    "k_proj",
    "v_proj",
    "o_proj",
    "gate_proj",
    "up_proj",
    "down_proj",
)


@dataclass(frozen=True)
class AdapterConfig:
    """The subset of a PEFT `LoraConfig` that molora serves.

    `target_modules` is a tuple of module-name suffixes, or a single regex string (PEFT allows both).
    `rank_pattern` / `alpha_pattern` map a module-name key (matched as PEFT does: the full name or a suffix)
    to an override of `r` / `lora_alpha`.
    """

    r: int
    lora_alpha: float
    target_modules: tuple[str, ...] | str
    use_rslora: bool = False
    base_model_name_or_path: str | None = None
    rank_pattern: dict[str, int] = field(default_factory=dict)
    alpha_pattern: dict[str, float] = field(default_factory=dict)
    layers_to_transform: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        if self.r <= 0:
            raise MoLoRAError(f"LoRA rank r={self.r} must be positive")
        if not self.target_modules:
            raise MoLoRAError("target_modules is empty: name at least one module (e.g. ['q_proj', 'v_proj'])")

    def rank_and_alpha(self, module: str) -> tuple[int, float]:
        """The (r, alpha) PEFT uses for `module` once rank/alpha patterns are applied."""
        r = _pattern_lookup(self.rank_pattern, module, self.r)
        alpha = _pattern_lookup(self.alpha_pattern, module, self.lora_alpha)
        return int(r), float(alpha)

    def scaling(self, module: str, rank: int | None = None) -> float:
        """`alpha / r`, or `alpha / sqrt(r)` with rsLoRA, as PEFT computes it for `module`."""
        r, alpha = self.rank_and_alpha(module)
        r = rank if rank is not None else r
        return alpha / math.sqrt(r) if self.use_rslora else alpha / r


def _pattern_lookup(pattern: dict, module: str, default: float) -> float:
    # PEFT matches a pattern key as a regex against a dotted suffix of the module name.
    for key, value in pattern.items():
        if re.fullmatch(rf"(.*\.)?(?:{key})", module):
            return value
    return default


@dataclass(frozen=True)
class BankConfig:
    """Shape of the adapter bank: `num_slots` fixed slots, each holding ranks up to `max_rank`."""

    num_slots: int
    max_rank: int

    def __post_init__(self) -> None:
        if self.num_slots < 1:
            raise MoLoRAError(f"num_slots={self.num_slots}: the bank needs at least one slot")
        if self.max_rank < 1:
            raise MoLoRAError(f"max_rank={self.max_rank} must be at least 1")


@dataclass(frozen=True)
class SamplingParams:
    """How to pick the next token and when to stop. temperature 0 means greedy.

    ignore_eos and min_tokens follow vLLM: ignore_eos=True keeps generating past the model's eos token(s)
    (the engine's `eos_ids`); `stop_token_ids` and `stop` still end the request. min_tokens=N: the first N
    generated tokens can be neither an eos id nor a stop_token_id (their logits are set to -inf before
    sampling, also with ignore_eos) and the text they make is not searched for stop strings, so the earliest
    stop is token N+1; max_new_tokens still ends the request. Benchmarks use ignore_eos=True (or
    min_tokens=max_new_tokens) to generate exactly max_new_tokens tokens.
    """

    max_new_tokens: int = 64
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    stop: tuple[str, ...] = ()
    logprobs: int = 0
    ignore_eos: bool = False
    min_tokens: int = 0

    def __post_init__(self) -> None:
        if self.max_new_tokens < 1:
            raise MoLoRAError(f"max_new_tokens={self.max_new_tokens} must be at least 1")
        if self.temperature < 0:
            raise MoLoRAError(f"temperature={self.temperature} must be >= 0 (0 = greedy)")
        if not 0 < self.top_p <= 1:
            raise MoLoRAError(f"top_p={self.top_p} must lie in (0, 1]")
        if self.top_k < 0:
            raise MoLoRAError(f"top_k={self.top_k} must be >= 0 (0 = off)")
        if not 0 <= self.logprobs <= 20:
            raise MoLoRAError(f"logprobs={self.logprobs} must lie in [0, 20]")
        if self.min_tokens < 0:
            raise MoLoRAError(f"min_tokens={self.min_tokens} must be >= 0 (0 = off)")
        if self.min_tokens > self.max_new_tokens:
            raise MoLoRAError(
                f"min_tokens={self.min_tokens} exceeds max_new_tokens={self.max_new_tokens}; "
                "lower min_tokens or raise max_new_tokens"
            )

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0
