"""Speculative decoding without a draft model: drafts from the request's own tokens, verified in one forward.

    spec = SpeculativeConfig.parse('{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4}')
    Engine(mm, EngineConfig(speculative=spec))

Drafts (vLLM's `--speculative-config` methods, no draft model):
    "ngram"   prompt lookup (`ngram_draft`): the longest suffix of the request's prompt + output, of
              prompt_lookup_max down to prompt_lookup_min tokens, that occurred earlier in it; the tokens that
              followed its latest earlier occurrence are the draft.
    "suffix"  suffix decoding (`suffix_draft`): the longest suffix (up to suffix_decoding_max_tree_depth tokens)
              that occurred earlier in the request's tokens, or in the recent outputs of requests on the same
              adapter (suffix_decoding_max_cached_requests of them; 0: the request's own tokens only); of every
              continuation of that suffix the most frequent is followed, token by token.

Verification (the engine's step): a decoding request with a draft d_1..d_k runs its last token and the draft as one
chunk of k + 1 tokens, each routed as plain decoding routes it (molora.engine.routing: pinned, token-id router,
learned router and Arrow per row; a carrying router's draft rows assume their predecessor's carried decision, see
`carry_valid`, and the rows after a wrong one are dropped or computed again: CARRY, molora's key "molora": {"carry":
...}); the logits of every row come back (`ModelRunner.forward(token_logits=)`). `accept` keeps the tokens
plain decoding would give: greedy keeps the longest prefix of the draft that equals the argmax and adds the argmax
after it; with temperature > 0, rejection sampling for a deterministic draft (draft d accepted with probability
p(d), else one id drawn from p with d removed, renormalised; after a whole accepted draft one more from the last
row), which leaves the output distribution exactly that of plain sampling. Rows after the last kept token are
rolled back by the engine: the request's computed length, its KV blocks beyond it and its carried decisions.

Speculation applies while at most MAX_DECODES requests decode in a step (the measured turning point, below), and
per request where it cannot change what the request would get: not to requests with a
constraint (structured output, a bundle's constrained spans), logit knobs (bias, bad words, penalties, whose
values depend on every earlier id), or short of min_tokens; those decode one token a step. A draft never runs
past max_new_tokens or max_model_len, and the accepted tokens go through the stop rules one by one, so stop ids,
stop strings and max_tokens end a request exactly where plain decoding would.

Knows token ids, sampling parameters and generators; nothing about models, KV layout or routing.
"""

from __future__ import annotations

import dataclasses
import json
from collections import Counter, deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from molora.errors import MoLoRAError
from molora.sampling import filter_logits_rows

METHODS = ("ngram", "suffix")
# What a carrying router's draft rows do after the first row whose assumed carry was wrong (`carry_valid`):
# "truncate" keeps the rows before it and decodes the rest again next step; "rerun" runs the rows from it again in the
# same step with the decisions the pass computed (`Speculator.record`, the engine's `_commit_draft`).
CARRY = ("truncate", "rerun")
_MOLORA_KEYS = {"carry"}
# Speculate only while at most this many requests decode in a step. Measured on the default bundle (2 CPU threads,
# docs/speculative.json, docs/speculative_batch.json): output tokens/s with speculation over without was about 2x at
# batch 1 but 0.92x at 2, 0.96x at 4, 0.70x at 8, 0.73x at 16 and 0.60x at 32 (from two requests on, a plain decode
# step runs the fused one-call block, which a verification chunk does not).
MAX_DECODES = 1
_KEYS = {
    "ngram": {"method", "num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min"},
    "suffix": {
        "method",
        "num_speculative_tokens",
        "suffix_decoding_max_tree_depth",
        "suffix_decoding_max_cached_requests",
    },
}


@dataclass(frozen=True)
class SpeculativeConfig:
    """vLLM's speculative config for the draft-model-free methods (module docstring); checked at construction."""

    method: str = "ngram"
    num_speculative_tokens: int = 4
    prompt_lookup_max: int = 4
    prompt_lookup_min: int = 1
    suffix_decoding_max_tree_depth: int = 24
    suffix_decoding_max_cached_requests: int = 0
    carry: str = "truncate"  # molora's key ("molora": {"carry": ...}): see CARRY

    def __post_init__(self) -> None:
        if self.carry not in CARRY:
            raise MoLoRAError(
                f'speculative config "molora": {{"carry": {self.carry!r}}}: choose one of {", ".join(CARRY)}'
            )
        if self.method not in METHODS:
            raise MoLoRAError(
                f"speculative config method={self.method!r}: choose one of {', '.join(METHODS)} "
                "(draft models are not supported)"
            )
        for name in (
            "num_speculative_tokens",
            "prompt_lookup_max",
            "prompt_lookup_min",
            "suffix_decoding_max_tree_depth",
        ):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise MoLoRAError(f"speculative config {name}={value!r} must be an integer >= 1")
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise MoLoRAError(
                f"speculative config prompt_lookup_min={self.prompt_lookup_min} exceeds prompt_lookup_max="
                f"{self.prompt_lookup_max}; lower the minimum or raise the maximum"
            )
        c = self.suffix_decoding_max_cached_requests
        if not isinstance(c, int) or isinstance(c, bool) or c < 0:
            raise MoLoRAError(f"speculative config suffix_decoding_max_cached_requests={c!r} must be an integer >= 0")

    @classmethod
    def parse(cls, text: str | dict) -> SpeculativeConfig:
        """From vLLM's `--speculative-config` JSON (or its dict); an unknown method or key is refused, naming it."""
        if isinstance(text, str):
            try:
                data = json.loads(text)
            except json.JSONDecodeError as e:
                raise MoLoRAError(
                    f"--speculative-config is not valid JSON ({e}); give e.g. "
                    '\'{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4}\''
                ) from e
        else:
            data = text
        if not isinstance(data, dict):
            raise MoLoRAError(f"--speculative-config must be a JSON object, got {type(data).__name__}")
        method = data.get("method", "ngram")
        if method not in METHODS:
            raise MoLoRAError(
                f"speculative config method={method!r}: choose one of {', '.join(METHODS)} "
                "(draft models are not supported)"
            )
        unknown = sorted(set(data) - _KEYS[method] - {"molora"})
        if unknown:
            raise MoLoRAError(
                f"speculative config key(s) {unknown} are not known for method {method!r}; "
                f'known: {sorted(_KEYS[method])} and "molora": {{...}}'
            )
        data = dict(data)
        ours = data.pop("molora", {})
        if not isinstance(ours, dict):
            raise MoLoRAError(f'speculative config "molora" must be a JSON object, got {type(ours).__name__}')
        unknown = sorted(set(ours) - _MOLORA_KEYS)
        if unknown:
            raise MoLoRAError(
                f'speculative config "molora" key(s) {unknown} are not known; known: {sorted(_MOLORA_KEYS)}'
            )
        return cls(**data, **ours)


# ---------------------------------------------------------------------------------------------- drafts
def ngram_draft(tokens: Sequence[int], k: int, max_n: int, min_n: int) -> list[int]:
    """Prompt lookup: for n from max_n down to min_n, if the last n tokens occurred earlier in `tokens`, the (up to
    k) tokens that followed their latest earlier occurrence; [] if no suffix of min_n tokens or more recurs."""
    L = len(tokens)
    for n in range(min(max_n, L - 1), min_n - 1, -1):
        tail = list(tokens[L - n :])
        for start in range(L - n - 1, -1, -1):  # latest earlier occurrence first
            if tokens[start] == tail[0] and list(tokens[start : start + n]) == tail:
                return list(tokens[start + n : start + n + k])
    return []


def suffix_draft(tokens: Sequence[int], k: int, max_depth: int, corpus: Sequence[Sequence[int]] = ()) -> list[int]:
    """Suffix decoding: the longest suffix of `tokens` (up to max_depth) that occurs earlier in `tokens` or anywhere
    in `corpus` (recent outputs), then, token by token, the most frequent continuation of the matched text over
    every occurrence (ties: the latest occurrence's), for up to k tokens."""
    L = len(tokens)
    texts = [list(tokens)] + [list(c) for c in corpus]
    for n in range(min(max_depth, L), 0, -1):
        tail = list(tokens[L - n :])
        # every occurrence of tail that has a continuation (in `tokens`, before its own suffix)
        occ = [  # (text, index after the occurrence): every earlier occurrence of tail with a continuation
            (t, i + n)
            for t, text in enumerate(texts)
            for i in range((L if t == 0 else len(text)) - n)
            if text[i] == tail[0] and text[i : i + n] == tail
        ]
        if not occ:
            continue
        draft: list[int] = []
        while occ and len(draft) < k:
            counts = Counter(texts[t][j] for t, j in occ)
            best = max(counts.values())
            nxt = next(texts[t][j] for t, j in reversed(occ) if counts[texts[t][j]] == best)
            draft.append(nxt)
            occ = [(t, j + 1) for t, j in occ if texts[t][j] == nxt and j + 1 < len(texts[t])]
        return draft
    return []


# ---------------------------------------------------------------------------------------------- acceptance
def greedy_accept(logits: torch.Tensor, draft: Sequence[int]) -> list[int]:
    """logits [k + 1, V] of the rows last token, d_1 .. d_k -> the ids plain greedy decoding gives: the longest
    prefix of `draft` equal to the rows' argmax, then the argmax after it (1 to k + 1 ids)."""
    picks = logits.argmax(-1).tolist()  # [k + 1]
    out = []
    for i, p in enumerate(picks):
        out.append(p)
        if i >= len(draft) or p != draft[i]:
            break
    return out


def rejection_accept(probs: torch.Tensor, draft: Sequence[int], generator: torch.Generator | None) -> list[int]:
    """probs [k + 1, V] (each row the distribution plain sampling draws from), d_1 .. d_k -> the ids emitted.

    Row i accepts d_{i+1} with probability probs[i, d_{i+1}] (a deterministic draft's proposal puts all its mass on
    d, so min(1, p/q) = p); on a rejection it draws from probs[i] with d_{i+1} removed, renormalised, and stops;
    a fully accepted draft adds one draw from the last row. Each emitted id then follows plain sampling's
    distribution given the ids before it."""
    device = probs.device
    out: list[int] = []
    for i, d in enumerate(draft):
        u = torch.rand(1, generator=generator, device=device)
        if float(u) < float(probs[i, d]):
            out.append(int(d))
            continue
        rest = probs[i].clone()
        rest[d] = 0.0
        if float(rest.sum()) <= 0.0:  # p(d) was 1 up to rounding: nothing else can be drawn
            out.append(int(d))
            continue
        out.append(int(torch.multinomial(rest[None], 1, generator=generator)[0, 0]))
        return out
    k = len(draft)
    if probs.shape[0] > k:  # a row after the draft: one more id (none when the caller verifies on, `carry` "rerun")
        out.append(int(torch.multinomial(probs[k : k + 1], 1, generator=generator)[0, 0]))
    return out


def accept(logits: torch.Tensor, draft: Sequence[int], params: Any, generator: torch.Generator | None) -> list[int]:
    """The ids a verified chunk emits (module docstring): logits [k + 1, V] raw, `params` the request's
    SamplingParams (greedy, or temperature / top_k / top_p / min_p as the sampler applies them)."""
    if params.greedy:
        return greedy_accept(logits, draft)
    n = logits.shape[0]
    probs = filter_logits_rows(
        logits.float(), [params.temperature] * n, [params.top_k] * n, [params.top_p] * n, [params.min_p] * n
    ).softmax(-1)  # [k + 1, V]
    return rejection_accept(probs, draft, generator)


def carry_valid(assumed: Sequence[int], computed: Sequence[int]) -> int:
    """How many rows of a verified chunk ran on the decision plain decoding would have carried into them: row 0 always
    (its carry is known), row j >= 1 if every row before it is valid and its assumed carry equals the decision
    row j - 1 got at the carry_source block in this forward (`computed`). assumed [k + 1] (row 0's unused),
    computed [k + 1]."""
    m = 1
    while m < len(assumed) and assumed[m] == computed[m - 1]:
        m += 1
    return m


# ---------------------------------------------------------------------------------------------- the engine's part
class Speculator:
    """Proposes drafts for the engine's decoding requests and keeps the counts (`stats`). The engine owns one
    when EngineConfig.speculative is set."""

    def __init__(self, config: SpeculativeConfig, max_decodes: int = MAX_DECODES) -> None:
        self.config = config
        self.max_decodes = max_decodes  # speculate while at most this many requests decode in a step
        self.recent: dict[str | None, deque[list[int]]] = {}  # "suffix": recent outputs per adapter (pinned)
        self.drafted = self.accepted = self.verified = self.emitted = self.carry_cut = 0
        self.reruns = self.rerun_rows = 0  # carry "rerun": extra passes and the rows they computed

    @staticmethod
    def eligible(req: Any) -> bool:
        """Whether speculation cannot change what `req` gets (module docstring)."""
        p = req.params
        return (
            not req.constraints
            and not p.adjusts_logits
            and req.num_generated >= p.min_tokens
            and p.prompt_logprobs is None
            and not req.probing
        )

    def propose(self, req: Any, room: int) -> list[int]:
        """A draft for `req` (at most `room` ids: what max_new_tokens and max_model_len leave after the next id)."""
        c = self.config
        k = min(c.num_speculative_tokens, room)
        if k <= 0 or not self.eligible(req):
            return []
        if c.method == "ngram":
            return ngram_draft(req.tokens, k, c.prompt_lookup_max, c.prompt_lookup_min)
        corpus = self.recent.get(req.route.adapter, ()) if c.suffix_decoding_max_cached_requests else ()
        return suffix_draft(req.tokens, k, c.suffix_decoding_max_tree_depth, corpus)

    def record(
        self, drafted: int, emitted: int, accepted: int, cut: int = 0, reruns: int = 0, rerun_rows: int = 0
    ) -> None:
        """One verified chunk: `drafted` draft ids, `accepted` of them kept, `emitted` ids in all; `cut`: rows dropped
        because the decision they assumed to carry was not the one their predecessor got (`carry_valid`); `reruns`
        passes over `rerun_rows` rows computed again instead (carry "rerun")."""
        self.verified += 1
        self.carry_cut += cut
        self.reruns += reruns
        self.rerun_rows += rerun_rows
        self.drafted += drafted
        self.accepted += accepted
        self.emitted += emitted

    def finished(self, req: Any) -> None:
        """Keep a finished request's output for "suffix" drafts of later requests on the same adapter."""
        n = self.config.suffix_decoding_max_cached_requests
        if self.config.method != "suffix" or n == 0:
            return
        self.recent.setdefault(req.route.adapter, deque(maxlen=n)).append(list(req.tokens[len(req.prompt_ids) :]))

    def stats(self) -> dict:
        """Engine.stats()["speculative"]: drafted and accepted ids, verified chunks, mean ids emitted per chunk."""
        return {
            "method": self.config.method,
            "num_speculative_tokens": self.config.num_speculative_tokens,
            "drafted": self.drafted,
            "accepted": self.accepted,
            "verified_chunks": self.verified,
            "carry": self.config.carry,
            "carry_cut_rows": self.carry_cut,
            "carry_reruns": self.reruns,
            "carry_rerun_rows": self.rerun_rows,
            "acceptance_rate": self.accepted / self.drafted if self.drafted else None,
            "mean_acceptance_length": self.emitted / self.verified if self.verified else None,
        }


def merge_outputs(pieces: Sequence[Any]) -> Any:
    """The RequestOutputs of one request's ids emitted in one step (one per id, in order) as one: ids, text,
    adapters and logprobs joined; the finish state, counts and once-given fields from the pieces."""
    if len(pieces) == 1:
        return pieces[0]
    last = pieces[-1]
    logprobs = None
    if any(p.logprobs is not None for p in pieces):
        logprobs = [x for p in pieces for x in (p.logprobs or [])]
    return dataclasses.replace(
        last,
        new_token_ids=[t for p in pieces for t in p.new_token_ids],
        new_text="".join(p.new_text for p in pieces),
        token_adapters=[x for p in pieces for x in p.token_adapters],
        logprobs=logprobs,
        prompt_logprobs=next((p.prompt_logprobs for p in pieces if p.prompt_logprobs is not None), None),
        chosen=next((p.chosen for p in pieces if p.chosen is not None), None),
    )
