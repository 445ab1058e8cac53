"""Small frozen configuration records, validated at construction.

Owns the plain-data descriptions of an adapter (what `adapter_config.json` says), of the adapter bank and
of sampling. Knows nothing about torch modules.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
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


# A JSON answer that never ends is a string or a list the model repeats inside until max_tokens cuts it. The
# compiler closes free strings and unbounded arrays at these bounds (molora.schema_rules.bound_runaways; 0/None:
# off). Chosen on the validation schemas at 768 new tokens (docs/structured_bounds_val.json): finished answers
# 11 of 26 unbounded, 20 with 128 or 256 characters and 16 items, 18 with 256 and 32 items; every answer that
# finished unbounded kept its text. A schema's own maxLength / maxItems always win.
DEFAULT_MAX_STRING_CHARS = 256
DEFAULT_MAX_ARRAY_ITEMS = 16
# Open objects (additionalProperties not false) close at this many properties and numbers at this many digits
# before the point (a range the grammar engine writes without an exponent). Chosen on the same validation schemas
# (docs/structured_bounds_val.json): with 256 characters and 16 items, 20 of 26 finished; adding 16 properties and
# 15 digits, or 8 and 9, 21 (ties go to the looser); no answer that finished unbounded changed text.
DEFAULT_MAX_OBJECT_PROPERTIES: int | None = 16
DEFAULT_MAX_NUMBER_DIGITS: int | None = 15

# the bounds an adapter config must keep: a rank no linear reaches, and a scaling (alpha / r) far above what
# training uses (PEFT's defaults give 1-2; rsLoRA with a large alpha, tens) but below where it only overflows
MAX_LORA_RANK = 65536
# repetition_penalty scales float32 logits: past this factor a logit of any size already leaves the top (or tops
# every other), and near float32's range a zero logit times it turns NaN
MAX_REPETITION_PENALTY = 1e4
MAX_LORA_SCALE = 1024.0


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
        if not 0 < self.r <= MAX_LORA_RANK:
            raise MoLoRAError(f"LoRA rank r={self.r} must lie in [1, {MAX_LORA_RANK}]")
        if not self.target_modules:
            raise MoLoRAError("target_modules is empty: name at least one module (e.g. ['q_proj', 'v_proj'])")
        for key, r in self.rank_pattern.items():
            if not 0 < r <= MAX_LORA_RANK:
                raise MoLoRAError(f"rank_pattern[{key!r}]={r} must lie in [1, {MAX_LORA_RANK}]")
        for label, alpha in [
            ("lora_alpha", self.lora_alpha),
            *((f"alpha_pattern[{k!r}]", a) for k, a in self.alpha_pattern.items()),
        ]:
            if not math.isfinite(alpha):
                raise MoLoRAError(f"{label}={alpha} is not a finite number")
        for label, pattern in [
            ("target_modules", self.target_modules),
            *(
                (f"{which} key", k)
                for which, d in (("rank_pattern", self.rank_pattern), ("alpha_pattern", self.alpha_pattern))
                for k in d
            ),
        ]:
            if isinstance(pattern, str):
                try:
                    re.compile(pattern)
                except (re.error, RecursionError, OverflowError) as e:
                    raise MoLoRAError(f"{label} {pattern[:100]!r} is not a valid regular expression ({e})") from e
        # the largest scaling any module can get: the largest |alpha| over the smallest rank the config names
        alpha = max(abs(a) for a in (self.lora_alpha, *self.alpha_pattern.values()))
        r = min((self.r, *self.rank_pattern.values()))
        scale = alpha / (math.sqrt(r) if self.use_rslora else r)
        if scale > MAX_LORA_SCALE:
            raise MoLoRAError(
                f"LoRA scaling lora_alpha / {'sqrt(r)' if self.use_rslora else 'r'} reaches {alpha:g} / "
                f"{f'sqrt({r})' if self.use_rslora else r} = {scale:g}, over {MAX_LORA_SCALE:g}: such a delta "
                "would swamp the base model (check lora_alpha, r and their patterns)"
            )

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

    The logit knobs follow OpenAI and vLLM, applied to the raw logits in this order (adjust_logits_rows in
    molora.sampling): logit_bias {id: bias in [-100, 100]} is added; bad_words_ids (token-id sequences, vLLM's
    bad_words once tokenized) ban a sequence's last id when the generated ids end with the rest of it (a one-id
    sequence is always banned); repetition_penalty (> 0, 1 = off) divides the positive logits and multiplies the
    negative ones of every id seen in the prompt or the output; then logits[t] -= frequency_penalty * count[t] +
    presence_penalty * (count[t] > 0), count[t] being how often t was generated so far (both in [-2, 2]).
    Temperature comes next, then min_p ([0, 1], 0 = off: drops the ids whose probability is below min_p times the
    top one's), top_k and top_p.
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
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    min_p: float = 0.0
    logit_bias: Mapping[int, float] = field(default_factory=dict)
    bad_words_ids: tuple[tuple[int, ...], ...] = ()
    # None: the prompt is not scored; N >= 0: RequestOutput.prompt_logprobs holds every prompt token's logprob
    # (the first's None) with the top N alternatives, under the request's routing (molora.engine.engine)
    prompt_logprobs: int | None = None

    def __post_init__(self) -> None:
        if self.max_new_tokens < 0:
            raise MoLoRAError(
                f"max_new_tokens={self.max_new_tokens} must be >= 0 (0: the request ends after its prompt, "
                "which is useful with prompt_logprobs)"
            )
        if self.prompt_logprobs is not None and not 0 <= self.prompt_logprobs <= 20:
            raise MoLoRAError(f"prompt_logprobs={self.prompt_logprobs} must lie in [0, 20] (or None: off)")
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
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2.0 <= getattr(self, name) <= 2.0:
                raise MoLoRAError(f"{name}={getattr(self, name)} must lie in [-2, 2] (0 = off)")
        if not 1 / MAX_REPETITION_PENALTY <= self.repetition_penalty <= MAX_REPETITION_PENALTY:
            raise MoLoRAError(
                f"repetition_penalty={self.repetition_penalty} must lie in [{1 / MAX_REPETITION_PENALTY:g}, "
                f"{MAX_REPETITION_PENALTY:g}] (1 = off, above 1 discourages repeats)"
            )
        if not 0.0 <= self.min_p <= 1.0:
            raise MoLoRAError(f"min_p={self.min_p} must lie in [0, 1] (0 = off)")
        self._check_logit_bias()
        self._check_bad_words()

    def _check_logit_bias(self) -> None:
        for token, bias in self.logit_bias.items():
            if not _is_token_id(token):
                raise MoLoRAError(f"logit_bias key {token!r} is not a token id (an int >= 0)")
            if not -100.0 <= bias <= 100.0:
                raise MoLoRAError(f"logit_bias[{token}]={bias} must lie in [-100, 100]")

    def _check_bad_words(self) -> None:
        words = tuple(tuple(word) for word in self.bad_words_ids)
        for word in words:
            if not word or not all(_is_token_id(t) for t in word):
                raise MoLoRAError(
                    f"bad_words_ids entry {list(word)} must be a non-empty sequence of token ids (ints >= 0)"
                )
        object.__setattr__(self, "bad_words_ids", words)  # lists from a caller become the declared tuples

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def adjusts_logits(self) -> bool:
        """True when a knob changes the raw logits (logit_bias, bad_words_ids or a penalty): the sampler then
        works on an adjusted copy of this request's row; rows of requests without any skip that work."""
        return bool(
            self.logit_bias
            or self.bad_words_ids
            or self.presence_penalty
            or self.frequency_penalty
            or self.repetition_penalty != 1.0
        )


def _is_token_id(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0
