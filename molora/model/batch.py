"""The runner's per-step inputs and outputs, and the attention plan: plain types with no model code.

`BatchMeta` (the flattened ragged batch: positions, block tables, context lengths), `StepRouting` and `RouterGroup`
(what routes each row), `PagedKVCache` (the cache tensors), the attention plan (`AttnPlan` of `Decode` and
`Prefill` entries) and `StepOutput` (what a forward returns). `molora.model.runner` builds and consumes them,
`molora.model.graphs` records them, the engine fills `BatchMeta` and `StepRouting`; none of them imports the
runner. Legend as in molora.model.runner.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")
MERGE_PREFILL_TOKENS = 0  # fresh prompts up to this many tokens in all share one masked attention call (0: never).
# Off: measured against 256 (experiments/ab_prefill_merge.py, docs/prefill_merge_ab.json) one batched causal call per
# prompt length was as fast (0.95x the time on 8 fresh ~25-token prompts a step), and in the merged call a prompt's
# attention sums are grouped with its neighbours' keys, so its answer depends on its company: under w8a8 19 of 24
# greedy answers stayed equal across max_num_seqs 4 and 32 merged, 23 per length (float32: 24 both)


@dataclass
class BatchMeta:
    """Per-sequence layout of one flattened step. Sequence b owns tokens [offset_b, offset_b + query_lens[b]).

    query_lens[b]: tokens of b in this step (a prefill chunk or 1 for decode); context_lens[b]: KV length of
    b after this step (cached + new), so its new tokens sit at positions context_lens[b] - query_lens[b] ...;
    block_tables[b]: cache block ids of b in order (covering at least context_lens[b] rows).
    """

    query_lens: list[int]
    context_lens: list[int]
    block_tables: list[list[int]]


@dataclass
class RouterGroup:
    """Rows of the step routed by the in-network router, with one allowed mask: rows [n] (None = all T),
    allowed bool [K] over the router's adapters (None = all). A recorded step (molora.model.graphs) gives one
    group of every row instead, with allowed [T, K] per row and `owned` [T] bool: the rows the router decides
    (the others keep their fixed routing), so that which rows those are can change between replays."""

    rows: Tensor | None
    allowed: Tensor | None
    owned: Tensor | None = None


@dataclass
class StepRouting:
    """The routing of one step. slot_ids [T, k] (-1 = base) and weights [T, k] or None hold the fixed
    routing of every row; `router` (with `router_slots` [K]: router adapter index -> bank slot, -1 if not
    resident) overwrites the rows of its `groups` before each block. `carry` [T] (or None): the decision each
    row carries from its predecessor (-2: none) for a router with `carry_blocks`. `fixed` [T] (or None): a
    decision that holds at every block (-2: the router decides), a probe pass's for prompt tokens
    (molora.routing.learned: Probe)."""

    slot_ids: Tensor | None = None
    weights: Tensor | None = None
    router: Any = None
    router_slots: Tensor | None = None
    # mix experts (molora.routing.mix.router_experts): router_slots [K, m] and router_weights [K, m], each index's
    # slots and weights (molora.routing.base.expert_rows); None: router_slots [K], one slot per index
    router_weights: Tensor | None = None
    groups: list[RouterGroup] = field(default_factory=list)
    carry: Tensor | None = None
    fixed: Tensor | None = None


class PagedKVCache:
    """K and V of every block, in fixed blocks: k[l], v[l] are [N, Hkv, hd] with row = block * bs + offset."""

    def __init__(
        self,
        num_layers: int,
        num_blocks: int,
        block_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device | str | None = None,
    ) -> None:
        rows = num_blocks * block_size
        self.num_blocks, self.block_size = num_blocks, block_size
        self.k = torch.zeros(num_layers, rows, num_kv_heads, head_dim, dtype=dtype, device=device)
        self.v = torch.zeros(num_layers, rows, num_kv_heads, head_dim, dtype=dtype, device=device)

    def blocks(self, rows: Tensor) -> Tensor:
        """A layer's [N, Hkv, hd] cache viewed by block: [num_blocks, block_size, Hkv, hd]."""
        return rows.view(self.num_blocks, self.block_size, *rows.shape[1:])

    def nbytes(self) -> int:
        return 2 * self.k.numel() * self.k.element_size()

    def clear_blocks(self, blocks: Iterable[int]) -> None:
        """Zero the K and V rows of `blocks` in every layer (after a fault that may have left NaN in them)."""
        for b in blocks:
            rows = slice(b * self.block_size, (b + 1) * self.block_size)
            self.k[:, rows].zero_()
            self.v[:, rows].zero_()


class Decode:
    """The decode tokens of a step (query length 1) and where their contexts lie in the paged cache.

    rows [Bd] rows in T; table [Bd, nb] cache blocks of each context (nb: the longest, short tables padded with
    block 0); ctx [Bd] context lengths. `blocks` and `mask` (the gathered-SDPA fallback's) are built on first use
    and the mask kept for the step's other layers (keep_mask False: computed at every use, as a recorded step
    needs, whose ctx changes between replays; molora.model.graphs).
    """

    def __init__(self, rows: Tensor, table: Tensor, ctx: Tensor, block_size: int, *, keep_mask: bool = True) -> None:
        self.rows, self.table, self.ctx, self.block_size = rows, table, ctx, block_size
        self.keep_mask = keep_mask
        self._mask: Tensor | None = None

    @property
    def blocks(self) -> Tensor:
        """[Bd * nb] the blocks of every context, sequence after sequence."""
        return self.table.reshape(-1)

    @property
    def mask(self) -> Tensor:
        """[Bd, 1, 1, nb * bs] bool, True = attend (rows before each context's end)."""
        if self._mask is not None:
            return self._mask
        col = torch.arange(self.table.shape[1] * self.block_size, device=self.table.device)
        mask = (col[None, :] < self.ctx[:, None])[:, None, None, :]
        if self.keep_mask:
            self._mask = mask
        return mask


@dataclass
class Prefill:
    """One attention call over prompt tokens: `count` sequences of equal length whose rows in T are `rows`
    (sequence after sequence). Keys come from this step's own tokens (`blocks` None) or from the cache blocks
    of one sequence's whole context (a chunk continuing a prompt); `mask` [n, ctx] (True = attend) or None
    for plain causal attention."""

    rows: slice | Tensor
    count: int = 1
    blocks: Tensor | None = None
    mask: Tensor | None = None


@dataclass
class AttnPlan:
    """Index tensors of one step, shared by all layers (built once per step by `ModelRunner.plan`)."""

    write_rows: Tensor  # [T] cache row of each new token
    last_rows: Tensor  # [B] row in T of each sequence's last token
    decode: Decode | None
    prefill: list[Prefill]


@dataclass
class StepOutput:
    """Everything one forward produced. hidden [B, D]: the normed hidden state of each sequence's last token;
    logits [b, V] of the rows asked for (None if none); last_slot_ids / last_weights [B, k]: the routing of
    each sequence's last token (what produced its logits); last_carry [B] and carry_rows [T]: decisions at a
    carrying router's carry_source block (-2: not routed), None without such a router. token_logits [t, V]: the
    logits of the rows of T asked for by `token_logits=` (prompt scoring, speculative verification), each under its own
    row's routing; token_slot_ids [t, k]: that routing (the slots of each such row's token at the last block)."""

    hidden: Tensor
    logits: Tensor | None = None
    last_slot_ids: Tensor | None = None
    last_weights: Tensor | None = None
    last_carry: Tensor | None = None
    carry_rows: Tensor | None = None
    token_logits: Tensor | None = None
    token_slot_ids: Tensor | None = None
