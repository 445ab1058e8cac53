"""The router interface and the deterministic routers.

A router maps tokens to adapters. It answers in *adapter indices*: positions in the model's list of
adapter names (`MoLoRAModel.adapter_names`), -1 meaning "base model only". The model turns indices into
bank slots; routers never see slots, banks or modules.

    route(input_ids [B, L], adapter_names, start=p) -> Routing(adapter_ids [B, L] or [B, L, k], weights)

`start` is the position of `input_ids[:, 0]` in the sequence: 0 for a prompt, the current length during
generation (a generated token is routed when it is fed back in, so the input token decides).

Routers whose decision is made inside the network from hidden states (the learned router) set
`in_network = True`; their `route` is not called by the model.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar, Protocol

import torch
from torch import nn

from molora.errors import RoutingError
from molora.ops.device import host_readable

if TYPE_CHECKING:
    from molora.adapters.bank import AdapterBank
    from molora.adapters.io import LoRAAdapter


@dataclass
class Routing:
    """Per-token choice: adapter_ids [B, L] (top-1) or [B, L, k] with weights [B, L, k]; -1 = none."""

    adapter_ids: torch.Tensor
    weights: torch.Tensor | None = None


def in_network_decide(
    router,
    block: int,
    hidden: torch.Tensor,
    allowed: torch.Tensor | None = None,
    carry: torch.Tensor | None = None,
    fixed: torch.Tensor | None = None,
):
    """router.decide for one block, passing `carry` (molora.routing.learned: Carry) only to a router with
    `carry_blocks`; other in-network routers keep the three-argument `decide(block, hidden, allowed)`.

    fixed [T] (or None): a decision that holds at every block (router index, -1 none; -2 where the router
    decides), as a probe pass gives the prompt tokens (molora.routing.learned: Probe). Top-1 routers only.

    On the CPU the all-known and none-known cases skip work (host reads of `fixed` are free there, unless the step is
    recorded: molora.ops.device.host_readable). Elsewhere nothing reads `fixed` on the host: the router always decides
    and the fixed rows overwrite its choice (the same result), and a block the router leaves undecided (None) keeps the
    previous decision for every row, which for the fixed rows already is their fixed decision (the first block always
    decides)."""
    known = None
    host = fixed is None or host_readable(fixed)
    if fixed is not None:
        known = fixed >= -1
        if host and bool(known.all()):
            return fixed.long()[:, None], None
    if carry is not None and getattr(router, "carry_blocks", 0) > 0:
        out = router.decide(block, hidden, allowed, carry)
    else:
        out = router.decide(block, hidden, allowed)
    if known is None or fixed is None or (host and not bool(known.any())):  # known is None iff fixed is
        return out
    if out is None and not host:
        return None
    if out is None or out[0].shape[1] != 1:
        raise RoutingError("fixed decisions need a per-block top-1 router")
    return torch.where(known[:, None], fixed.long()[:, None], out[0]), None


def fill_prompt_routes(
    probe: torch.Tensor,
    mask: torch.Tensor | None,
    prompt_share: float,
    last_takes_top: bool = False,
    window: int | None = None,
) -> torch.Tensor:
    """A prompt's decisions [B, L] from a probe pass's per-token decisions [B, L] (router index, -1 none;
    molora.routing.learned: Probe and Base expert). mask [B, L] (1 = token, 0 = padding) keeps padding out.

    The vote counts the last `window` real tokens of each prompt (None: all of them; in a conversation, the latest
    turn rather than the whole history). A prompt whose share of voting tokens the probe gave to adapters is below
    `prompt_share`, or is zero, stays wholly on the base model (every decision -1: the caller keeps its answer
    there too). Otherwise each -1 takes the vote's most frequent adapter (the lowest index on a tie), and with
    last_takes_top so does its last token."""
    real = torch.ones_like(probe, dtype=torch.bool) if mask is None else mask.to(device=probe.device).bool()
    voting = real
    if window is not None:  # real tokens at or after each position, counted from the end: [B, L]
        voting = real & (real.flip(1).long().cumsum(1).flip(1) <= window)
    claimed = (probe >= 0) & voting
    K = int(probe.max().clamp(min=0)) + 1
    counts = torch.zeros(probe.shape[0], K, dtype=torch.long, device=probe.device)
    counts.scatter_add_(1, probe.clamp(min=0), claimed.long())  # [B, K]
    top = counts.argmax(1, keepdim=True).expand_as(probe)  # first max: lowest index
    share = claimed.sum(1) / voting.sum(1).clamp(min=1)  # [B]
    base = (claimed.sum(1) == 0) | (share < prompt_share)  # [B]
    filled = torch.where(probe == -1, top, probe)
    if last_takes_top:
        filled = torch.cat([filled[:, :-1], top[:, -1:]], 1)
    return torch.where(base[:, None], torch.full_like(probe, -1), filled)


def base_only(routes: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
    """[B] bool: rows of `fill_prompt_routes` that stay wholly on the base model (every real token -1)."""
    off = routes == -1
    if mask is not None:
        off |= ~mask.to(device=routes.device).bool()
    return off.all(1)


def to_slots(index_to_slot: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Adapter indices (-1: none) -> bank slots (-1: the base model) through index_to_slot [K] (-1 where an
    adapter has no slot). The one index -> slot lookup of every routing path."""
    return torch.cat([index_to_slot, index_to_slot.new_full((1,), -1)])[ids.long()]


def expert_rows(
    index_to_slot: torch.Tensor, index_weights: torch.Tensor | None, ids: torch.Tensor, weights: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """A router's choices as dispatch rows. ids [n, k] router indices (-1 none), weights [n, k] or None (top-1).

    index_weights None: index_to_slot [K] maps each index to one slot (`to_slots`): (slots [n, k], weights).
    Else each index is an expert of up to m adapters (a mix expert, molora.routing.mix.router_experts):
    index_to_slot [K, m] its slots (-1 padding), index_weights [K, m] their weights, and choice j of a row
    becomes m columns with the router's weight times the expert's:

        slots[t, j*m + i] = index_to_slot[ids[t, j], i]
        w[t, j*m + i]     = weights[t, j] * index_weights[ids[t, j], i]     (weights None: 1)

    so a token whose choice is a mix runs on the mix's row, as a static mix does."""
    if index_weights is None:
        return to_slots(index_to_slot, ids), weights
    K, m = index_to_slot.shape
    pad = torch.cat([index_to_slot, index_to_slot.new_full((1, m), -1)])  # [K + 1, m]: index -1 -> no slot
    padw = torch.cat([index_weights, index_weights.new_zeros(1, m)])
    n, k = ids.shape
    slots = pad[ids.long()].reshape(n, k * m)  # [n, k*m]
    w = padw[ids.long()]  # [n, k, m]
    if weights is not None:
        w = w * weights.to(w.dtype)[:, :, None]
    return slots, w.reshape(n, k * m)


def decide_slots(
    router,
    block: int,
    hidden: torch.Tensor,
    index_to_slot: torch.Tensor,
    allowed: torch.Tensor | None = None,
    carry: torch.Tensor | None = None,
    fixed: torch.Tensor | None = None,
    index_weights: torch.Tensor | None = None,
):
    """One block's in-network decision as bank slots: (slots [n, k], weights [n, k] | None, router indices
    [n, k]), or None when the block keeps the previous decision; with index_weights (mix experts) each choice is
    m columns (`expert_rows`). Used by the transformers path (`RoutingContext.route_block`) and the engine's runner
    (`ModelRunner._decide`) alike."""
    out = in_network_decide(router, block, hidden, allowed, carry, fixed)
    if out is None:
        return None
    ids, weights = out
    slots, w = expert_rows(index_to_slot, index_weights, ids, weights)
    return slots, w, ids


def adapter_index(names: Sequence[str], name: str | None) -> int:
    """Index of `name` in `names` (-1 for None), with a clear error when it is not loaded."""
    if name is None:
        return -1
    try:
        return list(names).index(name)
    except ValueError:
        raise RoutingError(f"unknown adapter {name!r}; loaded adapters: {list(names)}") from None


class RoutedModel(Protocol):
    """What a router, the chooser and the engine use of a routed model: the surface `molora.model.MoLoRAModel`
    implements (`molora.attach` builds one). A forward (`mm(input_ids, adapter_ids=..., **hf_kwargs)`) returns the
    transformers output with each token's adapter applied; `context` is the per-step routing context the routed
    linears read (molora.model.context); `adapters` are the loaded adapters in load order (index i is
    `adapter_names[i]`), each in a slot of `bank`."""

    model: nn.Module
    bank: AdapterBank
    context: Any
    router: Router | None
    tokenizer: Any
    adapters: dict[str, LoRAAdapter]
    chooser: Any  # a per-request chooser (molora.routing.hybrid.HybridChooser) or None
    calibration: Any  # what rebuilds `chooser` at run time, or None
    bundle: Any  # the manifest the model came from (molora.load), or None

    @property
    def adapter_names(self) -> list[str]: ...

    @property
    def device(self) -> torch.device: ...

    @property
    def config(self) -> Any: ...

    def __call__(self, input_ids: torch.Tensor, *args: Any, **kwargs: Any) -> Any: ...


class Router(ABC):
    """Maps the tokens of a batch to adapter indices."""

    in_network: ClassVar[bool] = False

    @abstractmethod
    def route(self, input_ids: torch.Tensor, adapter_names: Sequence[str], *, start: int = 0) -> Routing:
        """Adapter indices for `input_ids` [B, L] whose first column sits at position `start`."""


class InNetworkRouter(Protocol):
    """What the model layer calls on a router with `in_network = True` (molora.routing.learned's LearnedRouter,
    molora.routing.arrow's ArrowRouter): decisions per block from hidden states (`decide_slots`), the gates that
    decide (`gate_index`), carry and probe settings, a check against the model before a forward (`prepare`)."""

    in_network: ClassVar[bool]
    adapter_names: Sequence[str]

    @property
    def carry_blocks(self) -> int: ...

    @property
    def carry_source(self) -> int: ...

    @property
    def probe_prompt(self) -> bool: ...

    def gate_index(self, block: int) -> int | None: ...

    def prepare(self, mm: RoutedModel, input_ids: torch.Tensor) -> None: ...

    def prompt_routes(self, probe: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor: ...

    def base_only(self, routes: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor: ...


class VocabRouter(Router):
    """Routes by token-id ranges: the multimodal case (image-code ids to an image adapter, the rest to text).

    ranges: (lo, hi, adapter) with lo inclusive, hi exclusive, non-overlapping; tokens outside every range
    go to `default` (an adapter name, or None for the base model).
    """

    def __init__(self, ranges: Sequence[tuple[int, int, str | None]], default: str | None = None) -> None:
        spans = sorted((int(lo), int(hi), name) for lo, hi, name in ranges)
        for lo, hi, name in spans:
            if not 0 <= lo < hi:
                raise RoutingError(f"vocab range [{lo}, {hi}) for {name!r} is empty or negative; need 0 <= lo < hi")
        for (lo1, hi1, n1), (lo2, hi2, n2) in zip(spans, spans[1:]):
            if lo2 < hi1:
                raise RoutingError(f"vocab ranges [{lo1}, {hi1}) for {n1!r} and [{lo2}, {hi2}) for {n2!r} overlap")
        self.ranges = spans
        self.default = default
        self._lookups: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}

    @classmethod
    def from_vocab(
        cls, vocab: Mapping[str, int], prefixes: Mapping[str, Sequence[str]], default: str | None = None
    ) -> VocabRouter:
        """Ranges read from a vocabulary (token -> id): each adapter takes the ids of the tokens whose name
        starts with one of its prefixes, merged into contiguous ranges. A tokenizer's `get_vocab()` or a
        model's lookup table fits: Chameleon's `vocabulary_map` scatters its image tokens ("IMGIMG...")
        through the vocabulary (several ranges), Emu3's visual tokens ("<|visual token") fill the top ids
        (one range)."""
        ranges = []
        for adapter, starts in prefixes.items():
            ids = sorted({int(i) for tok, i in vocab.items() if tok.startswith(tuple(starts))})
            if not ids:
                raise RoutingError(
                    f"no token of the vocabulary ({len(vocab)} tokens) starts with {list(starts)} "
                    f"for adapter {adapter!r}"
                )
            ranges += [(lo, hi, adapter) for lo, hi in id_ranges(ids)]
        return cls(ranges, default)

    def route(self, input_ids: torch.Tensor, adapter_names: Sequence[str], *, start: int = 0) -> Routing:
        # two ops per call (an engine routes every request of every step): the bucket of each id among the
        # ranges' bounds, then that bucket's adapter index
        bounds, table = self._lookup(tuple(adapter_names), input_ids.device, input_ids.dtype)
        return Routing(table[torch.bucketize(input_ids, bounds, right=True)])

    def _lookup(
        self, names: tuple[str, ...], device: torch.device, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """bounds [m] (every range's lo and hi, sorted) and table [m + 1]: the adapter index of the ids in
        [bounds[i - 1], bounds[i]) at i (the default below bounds[0], between ranges and from bounds[-1] on)."""
        key = (names, device, dtype)
        if key not in self._lookups:
            default = adapter_index(names, self.default)
            index = {lo: adapter_index(names, name) for lo, _hi, name in self.ranges}
            bounds = sorted({b for lo, hi, _ in self.ranges for b in (lo, hi)})
            table = [default] + [index.get(b, default) for b in bounds]
            self._lookups[key] = (
                torch.tensor(bounds, dtype=dtype, device=device),
                torch.tensor(table, dtype=dtype, device=device),
            )
        return self._lookups[key]

    def to_json(self) -> dict:
        return {"ranges": [[lo, hi, n] for lo, hi, n in self.ranges], "default": self.default}


def id_ranges(ids: Sequence[int]) -> list[tuple[int, int]]:
    """Sorted distinct ids as contiguous [lo, hi) ranges: [3, 4, 5, 9] -> [(3, 6), (9, 10)]."""
    out: list[tuple[int, int]] = []
    for i in ids:
        if out and out[-1][1] == i:
            out[-1] = (out[-1][0], i + 1)
        else:
            out.append((i, i + 1))
    return out


class SequenceRouter(Router):
    """One adapter per sequence, as today's servers do: the per-request baseline.

    adapters: one name for every row, or one name (or None) per row of the batch.
    """

    def __init__(self, adapters: str | None | Sequence[str | None]) -> None:
        self.adapters = adapters

    def route(self, input_ids: torch.Tensor, adapter_names: Sequence[str], *, start: int = 0) -> Routing:
        rows = input_ids.shape[0]
        per_row = (
            [self.adapters] * rows if self.adapters is None or isinstance(self.adapters, str) else list(self.adapters)
        )
        if len(per_row) != rows:
            raise RoutingError(f"SequenceRouter has {len(per_row)} adapters for a batch of {rows} sequences")
        idx = torch.tensor([adapter_index(adapter_names, n) for n in per_row], device=input_ids.device)
        return Routing(idx[:, None].expand_as(input_ids).clone())


class OracleRouter(Router):
    """Per-token labels given by the caller (adapter names, or None), indexed by sequence position.

    labels: [B][N] names covering positions 0..N-1; positions past N use the row's last label
    (so generated tokens stay on the adapter of the part they answer).
    """

    def __init__(self, labels: Sequence[Sequence[str | None]]) -> None:
        if not labels or any(len(row) == 0 for row in labels):
            raise RoutingError("OracleRouter needs at least one label per sequence")
        self.labels = [list(row) for row in labels]

    def route(self, input_ids: torch.Tensor, adapter_names: Sequence[str], *, start: int = 0) -> Routing:
        rows, length = input_ids.shape
        if rows != len(self.labels):
            raise RoutingError(f"OracleRouter has labels for {len(self.labels)} sequences, batch has {rows}")
        out = torch.empty_like(input_ids)
        for b, row in enumerate(self.labels):
            names = [row[min(p, len(row) - 1)] for p in range(start, start + length)]
            out[b] = torch.tensor([adapter_index(adapter_names, n) for n in names], dtype=out.dtype)
        return Routing(out)
