"""Next-token selection from logits: greedy, temperature, min-p, top-k, top-p, top-n logprobs, the logit knobs
(logit bias, bad words, repetition/frequency/presence penalties), and constraints.

Pure tensor functions (layer 1): they know nothing about models, adapters or requests.

The logit knobs act on raw logits before temperature, in vLLM's order (`adjust_logits_rows`): bias, bad words,
penalties. The penalties touch only the (row, id) cells of the ids a row has seen (`apply_penalties`), and a step
where no row sets a knob never calls them.

Constraints are one mechanism: a packed bitmask of allowed token ids per row (int32 [B, W], W = ceil(V / 32),
bit k of word w allows id 32 w + k: the layout xgrammar and llguidance fill), applied to the logits of a
sampling step in one batched op (`apply_bitmask`). A `Constraint` is shared and immutable; `begin(prompt)` gives
a request its `ConstraintState`, whose `fill(tokens, bitmask, row)` writes the ids allowed after `tokens`
(prompt + generated so far). The uses: `SpanConstraint` (an early-fusion model's fixed-length image spans,
stateless: its state is read from the last ids; the engine applies the bundle's, the multimodal demo its own),
and `molora.structured.GrammarConstraint` (a JSON schema, regex, choice or grammar on a grammar engine). A mask
depends on token ids only, never on routing or adapters.
"""

from __future__ import annotations

import functools
import itertools
import logging
import math
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from molora.errors import MoLoRAError

log = logging.getLogger(__name__)


def filter_logits(
    logits: torch.Tensor, temperature: float, top_k: int = 0, top_p: float = 1.0, min_p: float = 0.0
) -> torch.Tensor:
    """Scaled logits [B, V] with everything below min-p, outside top-k or outside the top-p nucleus set to -inf."""
    out = logits.float() / max(temperature, 1e-6)
    if min_p > 0.0:
        out = _drop_below_min_p(out, _log_min_p([min_p] * out.shape[0], out.device))
    if top_k and top_k < out.shape[-1]:
        kth = torch.topk(out, top_k, dim=-1).values[..., -1:]
        out = out.masked_fill(out < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(out, dim=-1, descending=True)
        probs = sorted_logits.softmax(-1)
        # drop a token when the mass before it already reaches top_p (the first token always stays)
        drop = probs.cumsum(-1) - probs >= top_p
        drop[..., 0] = False  # also when top_p rounds to 0 in float32 (5e-324 is a valid top_p)
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        out = torch.full_like(out, float("-inf")).scatter(-1, order, sorted_logits)
    return out


def filter_logits_rows(
    logits: torch.Tensor,
    temperature: Sequence[float],
    top_k: Sequence[int],
    top_p: Sequence[float],
    min_p: Sequence[float] | None = None,
) -> torch.Tensor:
    """`filter_logits` of every row of logits [B, V] with its own temperature, top_k, top_p and min_p (each of
    length B; min_p None: 0 for all), in one batched op per stage: row b equals filter_logits(logits[b:b+1],
    temperature[b], top_k[b], top_p[b], min_p[b]) bit for bit (tests/test_sampling.py). top_k 0 or >= V, top_p 1.0
    and min_p 0 leave a row whole. Stages in vLLM's order: temperature, min_p, top_k, top_p."""
    B, V = logits.shape
    if not len(temperature) == len(top_k) == len(top_p) == B or (min_p is not None and len(min_p) != B):
        raise MoLoRAError(
            f"filter_logits_rows: {B} rows but {len(temperature)} temperatures, {len(top_k)} top_k, "
            f"{len(top_p)} top_p, {'no' if min_p is None else len(min_p)} min_p; give one of each per row"
        )
    temps = torch.tensor([max(t, 1e-6) for t in temperature], dtype=torch.float32, device=logits.device)
    out = logits.float() / temps[:, None]  # [B, V]
    if min_p is not None and any(m > 0.0 for m in min_p):
        out = _drop_below_min_p(out, _log_min_p(min_p, logits.device))
    ks = [k if 0 < k < V else 0 for k in top_k]
    if any(ks):
        vals = torch.topk(out, max(ks), dim=-1).values  # [B, kmax], descending
        idx = torch.tensor([max(k - 1, 0) for k in ks], device=logits.device)
        kth = vals.gather(-1, idx[:, None])  # [B, 1]: the k-th largest
        kth[torch.tensor([k == 0 for k in ks], device=logits.device)] = float("-inf")  # rows without top_k
        out = out.masked_fill(out < kth, float("-inf"))
    if any(p < 1.0 for p in top_p):
        sorted_logits, order = torch.sort(out, dim=-1, descending=True)
        probs = sorted_logits.softmax(-1)
        ps = torch.tensor(top_p, dtype=torch.float32, device=logits.device)
        # as filter_logits: drop a token when the mass before it already reaches top_p (rows with 1.0 keep all)
        drop = (probs.cumsum(-1) - probs >= ps[:, None]) & (ps < 1.0)[:, None]
        drop[..., 0] = False  # the first token always stays, also when a top_p rounds to 0 in float32
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        out = torch.full_like(out, float("-inf")).scatter(-1, order, sorted_logits)
    return out


def _log_min_p(min_p: Sequence[float], device: torch.device | str) -> torch.Tensor:
    """log(min_p) [B, 1] float32; -inf for min_p 0 (the row keeps every id)."""
    logs = [math.log(m) if m > 0.0 else -math.inf for m in min_p]
    return torch.tensor(logs, dtype=torch.float32, device=device)[:, None]


def _drop_below_min_p(scaled: torch.Tensor, log_min_p: torch.Tensor) -> torch.Tensor:
    """scaled [B, V] with the ids whose probability is below min_p times the top one's at -inf. In logits:
    p[t] < min_p * p_max  <=>  scaled[t] < max(scaled) + log(min_p), so no softmax is needed."""
    top = scaled.amax(-1, keepdim=True)  # [B, 1]
    return scaled.masked_fill(scaled < top + log_min_p, float("-inf"))


def greedy(logits: torch.Tensor) -> torch.Tensor:
    """The index of the first maximum along the last dim, as `argmax` gives it. torch's max reduction is the
    faster kernel on CPU: 0.9 ms against 3.7 ms for bf16 logits [32, 49152], 1.0 against 1.7 ms in fp32
    (measured on this project's 2-core machine)."""
    return logits.max(-1).indices


def sample_next(
    logits: torch.Tensor,
    temperature: float = 0.0,
    top_k: int = 0,
    top_p: float = 1.0,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """Token ids [B] chosen from logits [B, V]; temperature 0 means greedy (argmax)."""
    if temperature == 0.0:
        return greedy(logits)
    probs = filter_logits(logits, temperature, top_k, top_p).softmax(-1)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)


def top_logprobs(logits: torch.Tensor, chosen: torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(logprob of chosen [B], top-n logprobs [B, n], their ids [B, n]) from raw logits [B, V]."""
    logp = torch.log_softmax(logits.float(), dim=-1)
    chosen_lp = logp.gather(-1, chosen[:, None]).squeeze(-1)
    if n <= 0:
        empty = logp.new_empty(logp.shape[0], 0)
        return chosen_lp, empty, empty.long()
    vals, ids = torch.topk(logp, n, dim=-1)
    return chosen_lp, vals, ids


# ------------------------------------------------------------------------------------------- logit knobs
def banned_ids(output: Sequence[int], words: Sequence[Sequence[int]]) -> list[int]:
    """The ids `words` (token-id sequences) ban as the next id after `output`: a word's last id when `output` ends
    with the rest of the word; a one-id word is always banned (vLLM's bad_words)."""
    out = []
    for word in words:
        head = len(word) - 1
        if head == 0 or (len(output) >= head and tuple(output[len(output) - head :]) == tuple(word[:-1])):
            out.append(word[-1])
    return out


def _cells(rows: Sequence[int], seqs: Sequence[Sequence[int]], vocab_size: int) -> torch.Tensor:
    """Flat indices [n] (row * V + id) into a [*, V] tensor of every id of seqs[k], in row rows[k]. The ids go
    through numpy: torch.tensor of a 16k-int list took 2 ms on this CPU, about twice as long."""
    lens = torch.tensor([len(seq) for seq in seqs])
    flat = np.fromiter(itertools.chain.from_iterable(seqs), dtype=np.int64, count=int(lens.sum()))
    return torch.repeat_interleave(torch.tensor(rows, dtype=torch.long) * vocab_size, lens) + torch.from_numpy(flat)


def apply_penalties(
    logits: torch.Tensor,
    rows: Sequence[int],
    prompts: Sequence[Sequence[int]] | None,
    outputs: Sequence[Sequence[int]],
    presence: Sequence[float],
    frequency: Sequence[float],
    repetition: Sequence[float],
) -> None:
    """Penalize rows `rows` of logits [B, V] float32 in place, as vLLM does: in row rows[k], every id of prompts[k]
    or outputs[k] has its logit divided by repetition[k] if positive, multiplied by it if not (prompts None: no
    repetition penalty); then logits[t] -= frequency[k] * count[t] + presence[k] * (count[t] > 0), count[t] being
    how often t occurs in outputs[k].

    Only the (row, id) cells those ids name are read and written: one gather and one scatter per penalty. A cell
    the repetition penalty names twice (in prompt and output) is computed twice from the same gathered value and
    written twice with the same result, so it is penalized once. vLLM's dense form (a [r, V] count tensor and some
    ten passes over it) took 33 to 66 ms per step for 32 rows of a 49152-id vocabulary on this 2-core CPU, about a
    sixth of a decode step."""
    B, V = logits.shape
    flat = logits.view(-1)  # [B * V], logits is contiguous
    dev = logits.device
    per_row = torch.ones(B, 3, dtype=torch.float32)  # [B, 3] (repetition, frequency, presence)
    per_row[list(rows)] = torch.tensor(list(zip(repetition, frequency, presence)), dtype=torch.float32)
    per_row = per_row.to(dev)
    emitted = _cells(rows, outputs, V).to(dev)  # [n] one cell per generated id
    if prompts is not None:
        seen = torch.cat([_cells(rows, prompts, V).to(dev), emitted])  # [m]
        scale = per_row[torch.div(seen, V, rounding_mode="floor"), 0]  # [m]
        vals = flat[seen]
        flat[seen] = torch.where(vals > 0, vals / scale, vals * scale)
    cells, counts = torch.unique(emitted, return_counts=True)  # [c], [c]: a sort of the n cells, not a [B, V] count
    k = torch.div(cells, V, rounding_mode="floor")  # [c] each cell's row
    flat[cells] = flat[cells] - (per_row[k, 1] * counts + per_row[k, 2])


def adjust_logits_rows(
    logits: torch.Tensor,
    logit_bias: Sequence[Mapping[int, float]],
    bad_words: Sequence[Sequence[Sequence[int]]],
    outputs: Sequence[Sequence[int]],
    prompts: Sequence[Sequence[int]],
    presence: Sequence[float],
    frequency: Sequence[float],
    repetition: Sequence[float],
) -> torch.Tensor:
    """A float32 copy [r, V] of logits [r, V] with each row's knobs applied, in vLLM's order: its logit_bias
    {id: bias} added, the ids its bad words ban after its output (`banned_ids`) at -inf, then the penalties
    (`apply_penalties`) over its generated ids outputs[i] and, for the repetition penalty, its prompt ids
    prompts[i]. Every argument has one entry per row; a row whose knobs are off comes back as it was, and its
    outputs and prompts entries are not read."""
    # clone, not .to(copy=True): the latter took 2.5 ms against 0.45 for fp32 [32, 49152] on this CPU
    out = logits.clone(memory_format=torch.contiguous_format) if logits.dtype == torch.float32 else logits.float()
    cells = [(i, t, b) for i, bias in enumerate(logit_bias) for t, b in bias.items()]
    if cells:
        rows, ids, vals = zip(*cells)
        out[list(rows), list(ids)] += torch.tensor(vals, dtype=torch.float32, device=out.device)
    bans = [(i, t) for i, words in enumerate(bad_words) if words for t in banned_ids(outputs[i], words)]
    if bans:
        rows, ids = zip(*bans)
        out[list(rows), list(ids)] = float("-inf")
    pen = [i for i in range(len(out)) if presence[i] or frequency[i] or repetition[i] != 1.0]  # rows that count ids
    if pen:
        apply_penalties(
            out,
            pen,
            [prompts[i] for i in pen] if any(repetition[i] != 1.0 for i in pen) else None,
            [outputs[i] for i in pen],
            [presence[i] for i in pen],
            [frequency[i] for i in pen],
            [repetition[i] for i in pen],
        )
    return out


# ------------------------------------------------------------------------------------------- constraints
_BITS = ((torch.arange(256)[:, None] >> torch.arange(8)) & 1).bool()  # [256, 8]: byte -> its 8 bits


def bitmask_words(vocab_size: int) -> int:
    """W: int32 words of one row of a packed bitmask over `vocab_size` ids."""
    return (vocab_size + 31) // 32


def full_bitmask(rows: int, vocab_size: int) -> torch.Tensor:
    """A packed bitmask [rows, W] that allows every id (all bits set)."""
    return torch.full((rows, bitmask_words(vocab_size)), -1, dtype=torch.int32)


def unpack_bitmask(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """allowed [B, V] (bool) from a packed bitmask [B, W] int32 (little-endian words: a byte lookup)."""
    B = bitmask.shape[0]
    return _BITS.to(bitmask.device)[bitmask.contiguous().view(torch.uint8).long()].reshape(B, -1)[:, :vocab_size]


def pack_bitmask(allowed: torch.Tensor) -> torch.Tensor:
    """The packed bitmask [B, W] int32 of allowed [B, V] (bool); ids past V stay disallowed."""
    B, V = allowed.shape
    bits = torch.zeros(B, bitmask_words(V) * 32, dtype=torch.uint8, device=allowed.device)
    bits[:, :V] = allowed.to(torch.uint8)
    weights = (1 << torch.arange(8, device=allowed.device)).to(torch.uint8)
    return (bits.reshape(B, -1, 8) * weights).sum(-1, dtype=torch.uint8).view(torch.int32)


def apply_bitmask_reference(logits: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    """A copy of logits [B, V] with the ids the bitmask [B, W] does not allow at -inf: unpack, then masked_fill."""
    allowed = unpack_bitmask(bitmask.to(logits.device), logits.shape[-1])
    return logits.masked_fill(~allowed, float("-inf"))


@functools.cache
def _bitmask_kernel() -> Callable[..., None] | None:
    """xgrammar's in-place kernel (reads the packed words: no [B, V] bool mask is built), or None when xgrammar is
    not installed (the `structured` extra). On fp32 [32, 49152] on this project's 2-core machine, under load: 26
    against 28 to 96 ms for the reference with 2 threads, 16 against 16 ms with one. Chosen once, on first use."""
    try:
        from xgrammar import apply_token_bitmask_inplace
    except ImportError:
        log.info("packed bitmasks: the torch reference (xgrammar is not installed)")
        return None
    log.info("packed bitmasks: xgrammar's apply_token_bitmask_inplace")
    return apply_token_bitmask_inplace


def apply_bitmask(logits: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    """A copy of logits [B, V] with the ids the bitmask [B, W] does not allow at -inf (one batched op; equal to
    `apply_bitmask_reference`)."""
    kernel = _bitmask_kernel()
    if kernel is None or logits.dim() != 2 or logits.shape[0] == 0:
        return apply_bitmask_reference(logits, bitmask)
    out = logits.clone()
    kernel(out, bitmask.to(logits.device).contiguous(), vocab_size=logits.shape[-1])
    return out


def masked_greedy(logits: torch.Tensor, bitmask: torch.Tensor, candidates: int = 2) -> torch.Tensor:
    """greedy(apply_bitmask(logits, bitmask)) [B], without masking the rows whose answer is among their first
    `candidates` picks: a row's refused pick is set to -inf in a copy of the refused rows and they pick again
    (max's first index, so ids come in greedy's order: value descending, then id); rows refused `candidates`
    times take the argmax over their allowed ids (`_allowed_argmax`). One more pick reads the rows once, the full mask
    about four times (copy, mask, max); topk(8) took 9 to 18 ms for fp32 [32, 49152] on this CPU, one max 0.6 to 0.8 ms.
    logits [B, V], bitmask [B, W] int32."""
    out = greedy(logits)  # [B]
    todo = (~is_allowed(bitmask, out)).nonzero().flatten()  # [r] rows refused
    if len(todo) == 0:
        return out
    work, bits, pick = logits[todo], bitmask[todo], out[todo]  # copies: [r, V], [r, W], [r]
    live = torch.ones(len(todo), dtype=torch.bool, device=logits.device)  # [r] still refused
    rows = torch.arange(len(todo), device=logits.device)
    for _ in range(candidates - 1):
        work[rows[live], pick[live]] = float("-inf")
        pick = greedy(work)
        ok = is_allowed(bits, pick) & live
        out[todo[ok]] = pick[ok]
        live &= ~ok
        if not bool(live.any()):
            return out
    rest = todo[live]
    out[rest] = _allowed_argmax(logits[rest], bitmask[rest])
    return out


def _allowed_argmax(logits: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    """greedy(apply_bitmask(logits, bitmask)) [r] for rows that allow some id. When few words of the mask are
    non-zero (a grammar state that allows a few hundred ids: a key, a digit, a bracket), only the allowed ids are
    read: their logits are gathered and reduced per row (max, then the first id of it); otherwise the full mask."""
    r, V = logits.shape
    row, word = bitmask.nonzero(as_tuple=True)  # [P] non-zero words
    if 4 * len(row) > bitmask.numel() or torch.unique(row).numel() < r:  # dense, or a row empty
        return greedy(apply_bitmask(logits, bitmask))
    shifts = torch.arange(32, dtype=torch.int32, device=logits.device)
    p, bit = (((bitmask[row, word][:, None] >> shifts) & 1) != 0).nonzero(as_tuple=True)  # [K] allowed bits
    ids, rows = word[p] * 32 + bit, row[p]  # [K], [K]
    inside = ids < V
    ids, rows = ids[inside], rows[inside]
    vals = logits[rows, ids].float()  # [K]
    best = torch.full((r,), float("-inf"), device=logits.device).scatter_reduce(0, rows, vals, "amax")
    top = vals == best[rows]  # [K] at the row's max
    first = torch.full((r,), V, dtype=torch.long, device=logits.device)
    return first.scatter_reduce(0, rows[top], ids[top], "amin")


def is_allowed(bitmask: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Whether each row's id is allowed: bitmask [B, W] int32, ids [B] -> [B] bool (no unpacking)."""
    words = bitmask.gather(-1, (ids // 32)[:, None]).squeeze(-1)
    return ((words >> (ids % 32).to(torch.int32)) & 1).bool()


class ConstraintState(ABC):
    """One request's view of a constraint. `fill` may advance internal state over the ids it has not seen yet,
    so it must be given the same growing list of ids every step (prompt + generated)."""

    @abstractmethod
    def fill(self, tokens: Sequence[int], bitmask: torch.Tensor, row: int) -> None:
        """Write the ids allowed after `tokens` into bitmask[row] ([B, W] int32); all zero: a dead end."""


class Constraint(ABC):
    """A constraint on generated ids, shared by requests (immutable); `begin` gives one request its state."""

    @abstractmethod
    def begin(self, prompt: Sequence[int]) -> ConstraintState:
        """The state of a request whose prompt is `prompt` (the constraint applies to what is generated after)."""


def constraint_bitmask(
    states: Sequence[Sequence[ConstraintState]], tokens: Sequence[Sequence[int]], vocab_size: int
) -> torch.Tensor:
    """The packed bitmask [B, W] of a step: row b allows what every state of states[b] allows after tokens[b]
    (no state: every id)."""
    out = full_bitmask(len(states), vocab_size)
    scratch = None
    for b, row_states in enumerate(states):
        for k, state in enumerate(row_states):
            if k == 0:
                state.fill(tokens[b], out, b)
                continue
            scratch = full_bitmask(1, vocab_size) if scratch is None else scratch
            state.fill(tokens[b], scratch, 0)
            out[b] &= scratch[0]
    return out


@dataclass(frozen=True)
class SpanConstraint(Constraint, ConstraintState):
    """Fixed-length spans of restricted ids, as an early-fusion model writes an image: `open` (<boi>), exactly
    `length` ids of `codes`, then `close` (<eoi>). Emu3 and Lumina-mGPT decode their images this way.

        inside a span (the last open id has fewer than `length` ids after it): only codes
        after the length-th code:                                              only close
        outside (no open id among the last length + 1 ids, or a close after it): `outside` if given (the
            multimodal demo: its words and <eos>), else anything but codes and close (the served bundle)

    The state is a pure function of the token ids so far (prompt + generated), read from their last
    length + 1 ids, so a prompt that ends inside a span (".. <boi> c1 c2") is continued inside it and a
    request carries no state of its own: `begin` returns the constraint itself.
    """

    open_id: int
    close_id: int
    code_ids: tuple[int, ...]
    length: int
    outside: tuple[int, ...] | None = None
    _tables: dict = field(default_factory=dict, init=False, compare=False, repr=False)  # (V, device) -> tables

    def __post_init__(self) -> None:
        if self.length < 1 or not self.code_ids:
            raise MoLoRAError(
                f"a constrained span needs length >= 1 and at least one code id (length={self.length}, "
                f"{len(self.code_ids)} codes)"
            )
        if {self.open_id, self.close_id} & set(self.code_ids) or self.open_id == self.close_id:
            raise MoLoRAError(
                f"a span's open id {self.open_id} and close id {self.close_id} must differ and not be "
                "among its codes; narrow the code prefixes"
            )

    def begin(self, prompt: Sequence[int]) -> SpanConstraint:
        return self

    def state(self, tokens: Sequence[int]) -> int:
        """0 inside a span (a code comes next), 1 at its end (close comes next), 2 outside."""
        tail = tokens[-(self.length + 1) :]
        for k in range(len(tail) - 1, -1, -1):
            if tail[k] == self.close_id:
                return 2
            if tail[k] == self.open_id:
                return 0 if len(tail) - 1 - k < self.length else 1
        return 2

    def allowed(self, vocab_size: int, device: torch.device | str = "cpu") -> torch.Tensor:
        """allowed ids [3, V] (bool) by state: codes / close / outside."""
        return self._table(vocab_size, device)[0]

    def _table(self, vocab_size: int, device: torch.device | str = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
        """(allowed [3, V] bool, the same packed [3, W] int32), built once per vocabulary size and device."""
        key = (vocab_size, str(device))
        if key not in self._tables:
            codes = torch.zeros(vocab_size, dtype=torch.bool)
            codes[[i for i in self.code_ids if i < vocab_size]] = True
            close = torch.zeros(vocab_size, dtype=torch.bool)
            close[self.close_id] = True
            if self.outside is None:
                out = ~(codes | close)
            else:
                out = torch.zeros(vocab_size, dtype=torch.bool)
                out[[i for i in self.outside if i < vocab_size]] = True
            allowed = torch.stack([codes, close, out])
            self._tables[key] = (allowed.to(device), pack_bitmask(allowed))
        return self._tables[key]

    def fill(self, tokens: Sequence[int], bitmask: torch.Tensor, row: int) -> None:
        bitmask[row] = self._table(bitmask.shape[-1] * 32)[1][self.state(tokens)]

    def apply(self, logits: torch.Tensor, tokens: Sequence[Sequence[int]]) -> torch.Tensor:
        """A copy of logits [B, V] with the ids each row's span state forbids at -inf (row b's ids so far:
        tokens[b]): `apply_bitmask` over this constraint's rows."""
        V = logits.shape[-1]
        return apply_bitmask(logits, constraint_bitmask([[self]] * len(tokens), tokens, V))

    @classmethod
    def from_vocab(cls, vocab: Mapping[str, int], spec: Mapping[str, Any]) -> SpanConstraint:
        """From a vocabulary (token -> id, a tokenizer's `get_vocab()` or a model's lookup table) and a spec
        {"open": "<boi>", "close": "<eoi>", "codes": ["<img_"], "length": 64}: the codes are the tokens whose
        name starts with one of the prefixes (as `VocabRouter.from_vocab` reads its ranges)."""
        missing = [k for k in ("open", "close", "codes", "length") if k not in spec]
        if missing:
            raise MoLoRAError(
                f"constrained_spans {dict(spec)} lacks {missing}; give open, close, codes (token prefixes) and length"
            )
        for key in ("open", "close"):
            if spec[key] not in vocab:
                raise MoLoRAError(
                    f"constrained_spans: the {key} token {spec[key]!r} is not in the vocabulary ({len(vocab)} tokens)"
                )
        prefixes = tuple(spec["codes"])
        ends = {spec["open"], spec["close"]}
        codes = sorted(int(i) for t, i in vocab.items() if t.startswith(prefixes) and t not in ends)
        if not codes:
            raise MoLoRAError(
                f"constrained_spans: no token of the vocabulary ({len(vocab)} tokens) starts with {list(prefixes)}"
            )
        return cls(int(vocab[spec["open"]]), int(vocab[spec["close"]]), tuple(codes), int(spec["length"]))


def bundle_constraint(bundle: Any, tokenizer: Any) -> SpanConstraint | None:
    """The SpanConstraint a bundle's manifest declares under `extra.constrained_spans` (None: it declares none),
    its token names read from `tokenizer`'s vocabulary."""
    extra = getattr(bundle, "extra", None)
    spec = extra.get("constrained_spans") if isinstance(extra, Mapping) else None
    if spec is None:
        return None
    if tokenizer is None:
        raise MoLoRAError(
            f"bundle {getattr(bundle, 'name', '?')!r} declares constrained_spans, which name tokens: "
            "give the engine a tokenizer"
        )
    return SpanConstraint.from_vocab(tokenizer.get_vocab(), spec)
