"""A request in flight, what one engine step reports for it, and its streaming detokenizer.

`Request` holds the token ids (prompt + generated), how many of them the KV cache holds, the block table,
the pinned adapters, the sampler's generator and the text state. `RequestOutput` is the per-step delta the
engine returns (the server streams these). `IncrementalDetokenizer` turns token ids into text without ever
splitting a UTF-8 character: bytes that decode to U+FFFD at the end are held back until the next token
completes them. `TextState` applies stop strings and holds back text that may be the start of one.

Knows tokens, text and sampling parameters; knows nothing about models, KV tensors or slots.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from molora.config import SamplingParams

REPLACEMENT = "\ufffd"
_PROMPT_CONTEXT = 5  # prompt tokens decoded before the first generated one (leading-space handling)


@dataclass
class RequestOutput:
    """What one request produced in one step (or, from `Engine.generate`, in total)."""

    request_id: str
    new_token_ids: list[int]
    new_text: str
    token_adapters: list[str | None]  # adapter that produced each new token (routing of the emitting position)
    finished: bool
    finish_reason: str | None  # "stop" | "length" | "abort" | "timeout" | "error"
    prompt_tokens: int
    completion_tokens: int
    logprobs: list[dict] | None  # per new token {"token_id", "logprob", "top": [(id, logprob), ...]}
    error: str | None = None  # why the engine ended it ("abort" by an operator, "timeout", "error")
    cached_tokens: int = 0  # prompt tokens whose KV came from the prefix cache (molora.engine.prefix)
    # SamplingParams.prompt_logprobs: per prompt token, None for the first, else {"token_id", "logprob", "rank",
    # "top": [(id, logprob), ...]}; given once, on the first output after the whole prompt is computed
    prompt_logprobs: list[dict | None] | None = None
    # routing "hybrid": the per-request chooser's pick {"adapter", "share", "z"}, given once, on the first output
    chosen: dict | None = None


class IncrementalDetokenizer:
    """Decodes a growing list of ids window by window (vLLM's prefix/read offsets).

    tokenizer needs only `decode(ids, skip_special_tokens=True) -> str`.
    """

    def __init__(self, tokenizer: Any, prompt_ids: list[int]) -> None:
        self.tokenizer = tokenizer
        self.ids = list(prompt_ids[-_PROMPT_CONTEXT:])
        self.prefix = 0  # ids[prefix:read] were already turned into text
        self.read = len(self.ids)

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True) if ids else ""

    def add(self, token_id: int) -> str:
        """Text completed by `token_id` ("" while a character is still incomplete)."""
        self.ids.append(token_id)
        before = self._decode(self.ids[self.prefix : self.read])
        full = self._decode(self.ids[self.prefix :])
        if full.endswith(REPLACEMENT) or len(full) <= len(before):
            return ""  # an incomplete UTF-8 sequence (or nothing new): hold it back
        self.prefix, self.read = self.read, len(self.ids)
        return full[len(before) :]

    def flush(self) -> str:
        """Whatever is still held back (at the end of a request), even if it is not valid UTF-8."""
        before = self._decode(self.ids[self.prefix : self.read])
        full = self._decode(self.ids[self.prefix :])
        self.prefix = self.read = len(self.ids)
        return full[len(before) :] if full.startswith(before) else ""


class TextState:
    """The generated text, cut at the first stop string; `emit` returns only text that can no longer
    turn out to be part of a stop string."""

    def __init__(self, stop: tuple[str, ...]) -> None:
        self.stop = tuple(s for s in stop if s)
        self.hold = max((len(s) for s in self.stop), default=1) - 1
        self.text = ""
        self.emitted = 0
        self._searched = 0

    def append(self, piece: str, check: bool = True) -> bool:
        """Add text; True if a stop string now appears (the text is cut before it). check=False adds it
        unsearched (the first min_tokens tokens): a later search still finds a stop string that starts in it
        and ends in later text, as vLLM's does."""
        self.text += piece
        if not check:
            self._searched = len(self.text)
            return False
        if not self.stop or not piece:
            return False
        start = max(0, self._searched - self.hold)
        hits = [i for i in (self.text.find(s, start) for s in self.stop) if i >= 0]
        self._searched = len(self.text)
        if hits:
            self.text = self.text[: min(hits)]
            return True
        return False

    def emit(self, final: bool) -> str:
        upto = len(self.text) if final else max(self.emitted, len(self.text) - self.hold)
        out = self.text[self.emitted : upto]
        self.emitted = upto
        return out


@dataclass(eq=False)
class Request:
    """One request in flight. `tokens` = prompt + generated; `num_computed` of them are in the KV cache."""

    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    route: Any  # its RouteState (molora.engine.routing): mode, router, allowed adapters,
    # pins and the decisions it carries; the engine's routing layer owns it
    generator: torch.Generator | None = None
    detok: IncrementalDetokenizer | None = None
    text: TextState = field(default_factory=lambda: TextState(()))
    tokens: list[int] = field(default_factory=list)
    num_computed: int = 0
    block_table: list[int] = field(default_factory=list)
    pinned: bool = False
    finish_reason: str | None = None
    error: str | None = None  # what ended it, when the engine ended it (see RequestOutput.error)
    arrival: float = 0.0  # time.monotonic() when the engine got it
    timeout_s: float | None = None  # deadlines (Engine.add_request)
    queue_timeout_s: float | None = None
    started: bool = False  # scheduled at least once (the queue timeout no longer applies)
    prefix: Any = None  # its key chain in the prefix cache (molora.engine.prefix.PrefixState)
    cached_tokens: int | None = None  # tokens its first real pass took from the prefix cache (None: not looked up)
    constraints: list = field(default_factory=list)  # ConstraintStates (molora.sampling) its next ids must obey
    tenant: str = "default"  # whose request it is: the fair share's unit (molora.engine.policy)
    priority: int = 0  # lower first under the priority policy (vLLM's)
    seq: int = 0  # arrival order in the scheduler (Scheduler.add)
    bypassed: int = 0  # waiting requests admitted ahead of it by slot-aware admission (Scheduler)
    # per prompt position, its token's logprob entry (RequestOutput.prompt_logprobs); filled chunk by chunk and
    # rewritten if the prompt is computed again (preemption); None: not asked for, or already given out
    prompt_scores: list[dict | None] | None = None
    question: str | None = None  # routing "hybrid": the text the per-request chooser reads (molora.engine.choosing)
    chosen: dict | None = None  # the chooser's pick, until it goes out on an output (RequestOutput.chosen)
    # speculative decoding: ids proposed to follow `tokens`, verified in the next step (molora.engine.speculative)
    draft: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.tokens = list(self.prompt_ids)
        if self.params.prompt_logprobs is not None:
            self.prompt_scores = [None] * len(self.prompt_ids)

    @property
    def num_generated(self) -> int:
        return len(self.tokens) - len(self.prompt_ids)

    # What the scheduler sees of the routing: which adapters to pin, and whether a chunk is a probe pass.
    @property
    def needs(self) -> tuple[str, ...]:
        """Adapters pinned while the request is in flight (RouteState.needs)."""
        return self.route.needs

    @property
    def probing(self) -> bool:
        """True while the probe pass over the prompt is unfinished: its chunks sample nothing and, once it
        ends, the prompt is computed again (num_computed goes back to 0) with the probe's decisions."""
        return self.route.probing

    @property
    def remaining(self) -> int:
        """Tokens not yet in the KV cache (1 while decoding)."""
        return len(self.tokens) - self.num_computed

    def output(
        self, new_ids: list[int], new_text: str, adapters: list[str | None], logprobs: list[dict] | None
    ) -> RequestOutput:
        scores = None
        if self.prompt_scores is not None and self.num_computed >= len(self.prompt_ids):
            scores, self.prompt_scores = self.prompt_scores, None  # the whole prompt is scored: given once
        chosen, self.chosen = self.chosen, None
        return RequestOutput(
            self.request_id,
            new_ids,
            new_text,
            adapters,
            self.finish_reason is not None,
            self.finish_reason,
            len(self.prompt_ids),
            self.num_generated,
            logprobs,
            self.error,
            self.cached_tokens or 0,
            scores,
            chosen,
        )
