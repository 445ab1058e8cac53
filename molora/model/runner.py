"""`ModelRunner`: a lean Llama-family forward over a flattened ragged batch and a paged KV cache.

    runner = ModelRunner(mm, num_blocks=256, block_size=16)
    out = runner.forward(tokens, positions, meta, routing, logits=rows)   # a StepOutput
    out.hidden      # [B, D] last token of each sequence (normed); out.logits [len(rows), V]
    out.last_slot_ids, out.last_carry, out.carry_rows               # what routing decided (None if nothing)

The runner is a function of its inputs: everything a forward produces comes back in its `StepOutput`, and
nothing of one forward is read by the next (only the KV cache carries state, by design).

Legend: T tokens in the step (all sequences, concatenated, no padding), B sequences in the step,
D hidden, H query heads, Hkv key/value heads, G = H / Hkv, hd head dim, L blocks, K router adapters,
k choices per token, N = num_blocks * block_size cache rows.

The runner is built FROM an attached `MoLoRAModel` and reuses its transformers modules (embed_tokens,
input_layernorm, q_proj ... which are `RoutedLoRALinear` where adapted, sharing the bank and
`mm.context`), so PEFT keys and the bank stay the same objects. It implements only what transformers
would do with padding and a cache object: RoPE (cos/sin tables taken once from the model's own
`rotary_emb`, so every rope_type of the config is honoured), grouped-query causal attention (optionally
sliding-window) over a paged cache, and the last-token selection. Supported: Llama/SmolLM2, Mistral,
Qwen2 (q/k/v bias lives in the linears) and Qwen3 (q_norm / k_norm on the head dim).

Routing is explicit per step (`StepRouting`): fixed slot ids [T, k] written into `mm.context` once, and
optionally an in-network router whose `decide(block, hidden, allowed)` is called before each block for
the rows it owns, or, for a per-linear router (Arrow per_linear, `router.per_linear`), a `LinearRouting` in
the context through which each routed linear routes the router's rows by its own input. The runner knows
slots and router indices, not adapter names, requests or sampling.

Per block, the residual stream h is updated in place and each add is fused with the RMSNorm that reads it; RoPE
is applied in place together with the K/V cache write; the MLP's SiLU(gate) * up is one call (the C++ glue of
`molora.ops.fused_cpu`, with the same torch ops as the fallback where it cannot run). RoPE and the adds equal
the torch ops bit for bit, and so does the norm in both dtypes (its mean summed in torch's order); SiLU's exp may
differ from torch's in the last bit (greedy outputs of the engine bench unchanged in both dtypes, measured).

On the CPU, a decode step's Llama-shaped block whose every piece runs on those kernels (the linears on packed weights
through molora's panel or AMX GEMM and, where routed, the fused LoRA kernel; RMSNorms; no q/k norm) runs as one C++
call, `fused_cpu.run_block`: the same kernels in the same order, equal bit for bit (tested in both dtypes), without
the Python between them (about 20 calls a block). What stays the same from step to step (packed weights, adapter
slots, norms, RoPE tables, cache views) is bound once per block (`_Block.run_bound`, `fused_cpu.bind_block`) and
bound again when it moves: another dtype, an adapter load or unload (`LoRASlots.generation`), a weight, norm, slot or
scale written or swapped (checked in C++ by storage and version). `ModelRunner._one_call` decides per step (a
decode-only step of 2 to PANEL_MAX_ROWS rows, the routing's fused-kernel arguments asked once, or per block for an
in-network router). Measured on the engine bench's routed batch-32 decode step (SmolLM2-135M, 2 threads, one
process, steps alternating with the kernel-by-kernel path): 0.81x the time in bfloat16 and 0.86x in float32, greedy
outputs equal. Prefill and mixed steps, and anything else, take the kernel-by-kernel path.

A decode step can instead be replayed from a captured graph (`enable_graphs`, molora.model.graphs: CUDA graphs,
one per batch-size bucket, static buffers, padding rows writing into the cache's one spare block,
`scratch_block`); `forward` hands such steps to it and `compute` is the step itself, on a plan built already.

Attention has two paths, planned once per step (`ModelRunner.plan` -> `AttnPlan`): paged decode (every
sequence with one new token, `Decode`; on CPU the fused kernel `fused_cpu.paged_decode` reads each context
where it lies in the cache, elsewhere its blocks are gathered for SDPA) and ragged prefill (`Prefill` entries: P prompts of one length in one
causal call, fresh prompts merged under a block-diagonal mask, or a chunk attending to its cached context).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from molora.adapters.bank import LoRASlots
from molora.errors import MoLoRAError
from molora.ops import fused_cpu, packed
from molora.ops.device import to_device
from molora.routing.arrow import LinearRouting
from molora.routing.base import decide_slots

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")
MERGE_PREFILL_TOKENS = 256  # fresh prompts up to this many tokens in all share one masked attention call
# (saves a call per prompt; above it the dense Tf x Tf mask costs more than the calls it saves)


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
    groups: list[RouterGroup] = field(default_factory=list)
    carry: Tensor | None = None
    fixed: Tensor | None = None


class PagedKVCache:
    """K and V of every block, in fixed blocks: k[l], v[l] are [N, Hkv, hd] with row = block * bs + offset."""

    def __init__(self, num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device | str | None = None) -> None:
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

    write_rows: Tensor                        # [T] cache row of each new token
    last_rows: Tensor                         # [B] row in T of each sequence's last token
    decode: Decode | None
    prefill: list[Prefill]


@dataclass
class StepOutput:
    """Everything one forward produced. hidden [B, D]: the normed hidden state of each sequence's last token;
    logits [b, V] of the rows asked for (None if none); last_slot_ids / last_weights [B, k]: the routing of
    each sequence's last token (what produced its logits); last_carry [B] and carry_rows [T]: decisions at a
    carrying router's carry_source block (-2: not routed), None without such a router."""

    hidden: Tensor
    logits: Tensor | None = None
    last_slot_ids: Tensor | None = None
    last_weights: Tensor | None = None
    last_carry: Tensor | None = None
    carry_rows: Tensor | None = None


class ModelRunner:
    """Explicit-input forward of an attached Llama-family model over a paged KV cache (module docstring).

    Not an nn.Module: it borrows the model's modules and owns only the cache and the RoPE tables.
    """

    def __init__(self, mm: Any, *, num_blocks: int, block_size: int = 16, max_model_len: int = 2048,
                 pack_weights: bool | None = None) -> None:
        cfg = mm.model.config
        if getattr(cfg, "model_type", None) not in SUPPORTED_MODEL_TYPES:
            raise MoLoRAError(f"the runner supports model types {SUPPORTED_MODEL_TYPES}, got "
                              f"{getattr(cfg, 'model_type', None)!r}; use MoLoRAModel.generate for others")
        inner = mm.model.model
        self.mm = mm
        self.context = mm.context
        self.embed = inner.embed_tokens
        self.norm = inner.norm
        param = next(mm.model.parameters())
        self.dtype, self.device = param.dtype, param.device
        # base GEMMs on packed weights (molora.ops.packed) where they run (`packed.form`: float32 on molora's kernel
        # or MKL, bfloat16 on AMX; each linear is asked on its own), unless False
        self.pack_weights = pack_weights is not False and param.device.type == "cpu"
        self.lm_head = _Linear(mm.model.lm_head, self.pack_weights)
        # The blocks' own submodules, resolved once.
        self.blocks = [_Block(layer, i, cfg, self.pack_weights) for i, layer in enumerate(inner.layers)]
        b0 = self.blocks[0]
        self.num_heads, self.num_kv_heads, self.head_dim = b0.num_heads, b0.num_kv_heads, b0.head_dim
        self.max_model_len = max_model_len
        # one block more than asked for: the scratch block, which no sequence owns (`scratch_block`), where the
        # padding rows of a captured decode step write their K/V
        self.cache = PagedKVCache(len(self.blocks), num_blocks + 1, block_size, self.num_kv_heads, self.head_dim,
                                  self.dtype, self.device)
        self.scratch_block = num_blocks
        self.graphs: Any = None  # a molora.model.graphs.DecodeGraphs once `enable_graphs` is called
        self.cos, self.sin = _rope_tables(inner.rotary_emb, max_model_len, self.dtype, self.device)  # [P, hd]
        for block in self.blocks:  # each block's [N, Hkv, hd] views of the cache, taken once
            block.kc, block.vc = self.cache.k[block.index], self.cache.v[block.index]
        # the routed linears' context and dispatcher, whose routing a one-call decode step asks once (`_one_call`);
        # a block with a routed linear on another context or dispatcher runs kernel by kernel
        self._routed = next((b.routed for b in self.blocks if b.routed is not None), None)
        for block in self.blocks:
            if any(lin.routed and (lin.mod.context is not self._routed.context
                                   or lin.mod.dispatcher is not self._routed.dispatcher) for lin in block.linears):
                block.linears = ()

    @property
    def block_size(self) -> int:
        return self.cache.block_size

    def enable_graphs(self, **kwargs: Any) -> Any:
        """Replay decode steps from captured graphs (`molora.model.graphs.DecodeGraphs(self, **kwargs)`: CUDA
        graphs on a CUDA device; elsewhere pass `capture=`). Returns the `DecodeGraphs`."""
        from molora.model.graphs import DecodeGraphs

        self.graphs = DecodeGraphs(self, **kwargs)
        return self.graphs

    # ------------------------------------------------------------------------------------ forward
    @torch.no_grad()
    def forward(self, tokens: Tensor, positions: Tensor, meta: BatchMeta, routing: StepRouting | None = None,
                *, logits: bool | list[int] = False) -> StepOutput:
        """tokens [T], positions [T] -> the `StepOutput` of the last token of each sequence; logits: True for
        every sequence's, a list of sequence indices for those only, False for none.

        Writes the K/V of every token into the cache rows its sequence's block table names. A decode step the
        runner's `graphs` accept (`enable_graphs`) is replayed from a captured graph instead.
        """
        if self.graphs is not None and self.graphs.accepts(meta, routing):
            out = self.graphs.run(tokens, positions, meta, routing, logits)
            if out is not None:
                return out
        return self.compute(tokens, positions, self.plan(positions, meta), routing, logits=logits)

    __call__ = forward

    @torch.no_grad()
    def compute(self, tokens: Tensor, positions: Tensor, plan: AttnPlan, routing: StepRouting | None = None,
                *, logits: bool | list[int] = False) -> StepOutput:
        """`forward` on a plan built already (by `plan`, or by `DecodeGraphs` from its static buffers)."""
        ctx = self.context
        slot_ids = None if routing is None else routing.slot_ids
        weights = None if routing is None else routing.weights
        learned = routing is not None and routing.router is not None and bool(routing.groups)
        per_linear = learned and getattr(routing.router, "per_linear", False)
        learned = learned and not per_linear
        carry_out = None
        if learned:  # the router overwrites its rows per block; keep the caller's tensors intact
            slot_ids, weights = self._routing_buffers(tokens.shape[0], routing)
            if getattr(routing.router, "carry_blocks", 0) > 0:
                carry_out = torch.full((tokens.shape[0],), -2, dtype=torch.long, device=slot_ids.device)
        ctx.set(slot_ids, weights)
        if per_linear:  # each routed linear decides from its own input (molora.routing.arrow: LinearRouting)
            ctx.linear = LinearRouting(routing.router, routing.router_slots,
                                       [(g.rows, g.allowed) for g in routing.groups])
        try:
            h = self.embed(tokens)                                          # [T, D] the residual stream
            delta = None                                                    # what the last block adds to h
            one_call = self._one_call(h, plan, learned)
            for block in self.blocks:
                if learned:
                    if delta is not None:  # the router reads the block's whole input
                        h, delta = h.add_(delta), None
                    self._decide(block.index, h, routing, slot_ids, weights, carry_out)
                    ctx.set(slot_ids, weights)  # rows changed in place: drop the step's cached plan
                h, delta = block(h, delta, positions, plan, self.cache, self.cos, self.sin, one_call)
            last = plan.last_rows
            h = _add_norm(self.norm, h[last], None if delta is None else delta[last])   # [B, D]
        finally:
            ctx.clear()
        out = StepOutput(h, None, None if slot_ids is None else slot_ids[plan.last_rows],     # [B, k]
                         None if weights is None else weights[plan.last_rows],
                         None if carry_out is None else carry_out[plan.last_rows], carry_out)  # [B], [T]
        if logits is not False:
            rows = slice(None) if logits is True else logits
            pick = (lambda t: None if t is None else t[rows])
            out.logits = self.logits(h[rows], pick(out.last_slot_ids), pick(out.last_weights))
        return out

    def _one_call(self, h: Tensor, plan: AttnPlan, learned: bool) -> Any:
        """Whether this step's blocks may run as one C++ call each (`_Block.run_bound`): a decode-only step of 2 to
        PANEL_MAX_ROWS rows where molora's kernels run and reproduce the norm's sum, and the routing's fused-kernel
        arguments (`RoutedLoRALinear.kernel_step`: () without routing), or PER_BLOCK where a router decides per block;
        None where not (every block then runs kernel by kernel)."""
        T, d = h.shape[0], plan.decode
        if (plan.prefill or d is None or d.rows.shape[0] != T or not 2 <= T <= packed.PANEL_MAX_ROWS
                or not fused_cpu.glue_supports(h) or not fused_cpu.norm_lanes()):
            return None
        if learned:
            return PER_BLOCK
        return () if self._routed is None else self._routed.kernel_step(T, h.dtype)

    @torch.no_grad()
    def logits(self, hidden: Tensor, slot_ids: Tensor | None = None, weights: Tensor | None = None) -> Tensor:
        """hidden [b, D] (already normed) -> logits [b, V]. An adapted lm_head routes row i by slot_ids [b, k]
        (and weights), the routing of that row's token (StepOutput.last_slot_ids); None: the base lm_head."""
        if hasattr(self.lm_head.mod, "lora") and slot_ids is not None:
            self.context.set(slot_ids, weights)
            try:
                return self.lm_head(hidden)
            finally:
                self.context.clear()
        return self.lm_head(hidden)

    # ------------------------------------------------------------------------------------ routing
    @staticmethod
    def _routing_buffers(T: int, routing: StepRouting) -> tuple[Tensor, Tensor | None]:
        """Working copies [T, k] of the fixed routing, widened to the router's top-k with weights if needed."""
        router_k = getattr(routing.router, "top_k", None) or getattr(getattr(routing.router, "config", None), "top_k", 1)
        k = max(int(router_k), 1 if routing.slot_ids is None else routing.slot_ids.shape[1])
        device = routing.router_slots.device
        ids = torch.full((T, k), -1, dtype=torch.long, device=device)
        w = None
        if routing.slot_ids is not None:
            ids[:, :routing.slot_ids.shape[1]] = routing.slot_ids
        if k > 1 or routing.weights is not None:
            w = torch.zeros(T, k, dtype=torch.float32, device=device)
            if routing.weights is not None:
                w[:, :routing.weights.shape[1]] = routing.weights
            else:
                w[:, 0] = 1.0
        return ids, w

    def _decide(self, block: int, h: Tensor, routing: StepRouting, slot_ids: Tensor, weights: Tensor | None,
                carry_out: Tensor | None = None) -> None:
        """Let the router choose, from the block's input h [T, D], the slots of its rows (in place);
        carry_out [T] (a router with carry_blocks) receives the decisions at its carry_source block."""
        for g in routing.groups:
            hidden = h if g.rows is None else h[g.rows]                      # [n, D]
            carry = routing.carry if routing.carry is None or g.rows is None else routing.carry[g.rows]
            fixed = routing.fixed if routing.fixed is None or g.rows is None else routing.fixed[g.rows]
            out = decide_slots(routing.router, block, hidden, routing.router_slots, g.allowed, carry, fixed)
            if out is None:
                continue                                                     # keep the previous decision
            slots, w, ids = out                                              # [n, k'] slots (-1 = base), router order

            def put(dst: Tensor, value: Tensor, g: RouterGroup = g) -> None:  # the group's rows of dst <- value
                if g.owned is None:
                    dst[slice(None) if g.rows is None else g.rows] = value
                else:  # a recorded step's group: every row, the router's own ones changed (RouterGroup.owned)
                    dst.copy_(torch.where(g.owned.view(-1, *[1] * (dst.dim() - 1)), value, dst))

            if carry_out is not None and block == routing.router.carry_source:
                put(carry_out, ids[:, 0])
            k2 = slots.shape[1]
            if k2 > slot_ids.shape[1]:
                raise MoLoRAError(f"the router returned top-{k2} choices but declares top_k={slot_ids.shape[1]} "
                                  "(set `top_k` or `config.top_k` on the router)")
            put(slot_ids, torch.cat([slots, slots.new_full((slots.shape[0], slot_ids.shape[1] - k2), -1)], 1))
            if weights is not None:
                ww = torch.ones_like(slots, dtype=weights.dtype) if w is None else w.to(weights.dtype)
                put(weights, torch.cat([ww, ww.new_zeros(ww.shape[0], weights.shape[1] - k2)], 1))

    # ------------------------------------------------------------------------------------ planning
    def plan(self, positions: Tensor, meta: BatchMeta) -> AttnPlan:
        """Cache rows to write, decode gathers and prefill chunks of one step (shared by all layers).

        Built from `meta` alone (host lists): sequence b's tokens sit at positions context_lens[b] - query_lens[b]
        ... context_lens[b] - 1, so nothing reads `positions` back from the device (no sync). On the CPU, where
        the read is free, `positions` is checked against that contract."""
        q_lens, ctx_lens, tables = meta.query_lens, meta.context_lens, meta.block_tables
        B, bs, dev = len(q_lens), self.cache.block_size, self.device
        if not (len(ctx_lens) == len(tables) == B) or sum(q_lens) != positions.shape[0]:
            raise MoLoRAError(f"batch metadata covers {sum(q_lens)} tokens in {B} sequences, but the step has "
                              f"{positions.shape[0]} tokens")
        if max(ctx_lens) > self.max_model_len:
            raise MoLoRAError(f"context of {max(ctx_lens)} tokens exceeds max_model_len={self.max_model_len}")
        # the per-token and decode indices in Python (a handful of tensors per step, not a chain of small ops)
        pos = [p for n, c in zip(q_lens, ctx_lens) for p in range(c - n, c)]
        if positions.device.type == "cpu" and positions.tolist() != pos:
            raise MoLoRAError("positions disagree with the batch metadata: sequence b's tokens must sit at positions "
                              "context_lens[b] - query_lens[b] ... context_lens[b] - 1")
        write, ends, t = [], [], 0
        for b in range(B):
            tb = tables[b]
            for p in pos[t:t + q_lens[b]]:
                write.append(tb[p // bs] * bs + p % bs)
            t += q_lens[b]
            ends.append(t)
        write_rows = to_device(write, dev)                                  # [T] cache row of each new token
        dec = [b for b in range(B) if q_lens[b] == 1]
        decode = None
        if dec:
            nb = -(-max(ctx_lens[b] for b in dec) // bs)                        # blocks of the longest context
            dec_table = [tables[b][:nb] + [0] * (nb - min(len(tables[b]), nb)) for b in dec]
            decode = Decode(to_device([ends[b] - 1 for b in dec], dev),
                            to_device(dec_table, dev).view(len(dec), nb),                          # [Bd, nb]
                            to_device([ctx_lens[b] for b in dec], dev), bs)
        last_rows = to_device([e - 1 for e in ends], dev)                   # [B]
        if all(q_lens[b] == 1 for b in range(B)):
            return AttnPlan(write_rows, last_rows, decode, [])
        width = max(len(t) for t in tables)
        table = to_device([t + [0] * (width - len(t)) for t in tables], dev)                 # [B, W]
        seq_of = to_device(torch.repeat_interleave(torch.arange(B), torch.tensor(q_lens)), dev)  # [T] (host counts)
        starts = [0]
        for n in q_lens[:-1]:
            starts.append(starts[-1] + n)
        prefill: list[Prefill] = []
        fresh = [b for b in range(B) if q_lens[b] > 1 and ctx_lens[b] == q_lens[b]]  # whole context in this step
        if len(fresh) > 1 and sum(q_lens[b] for b in fresh) <= MERGE_PREFILL_TOKENS:
            # one attention call for all fresh prompts: block-diagonal causal mask over their tokens
            rows = torch.cat([torch.arange(starts[b], starts[b] + q_lens[b], device=dev) for b in fresh])  # [Tf]
            seg, pos = seq_of[rows], positions[rows]
            prefill.append(Prefill(rows, mask=(seg[None, :] == seg[:, None]) & (pos[None, :] <= pos[:, None])))
            fresh = []
        by_len: dict[int, list[int]] = {}  # fresh prompts by length: each length is one batched causal call
        for b in fresh:
            by_len.setdefault(q_lens[b], []).append(b)
        for n, seqs in by_len.items():
            if all(starts[b2] == starts[b1] + n for b1, b2 in zip(seqs, seqs[1:])):   # adjacent in T (or alone)
                prefill.append(Prefill(slice(starts[seqs[0]], starts[seqs[-1]] + n), len(seqs)))
            else:
                prefill.append(Prefill(torch.cat([torch.arange(starts[b], starts[b] + n, device=dev) for b in seqs]),
                                       len(seqs)))
        for b in range(B):
            n, c = q_lens[b], ctx_lens[b]
            if n == 1 or c == n:
                continue
            # earlier tokens are in the cache: gather the whole context, causal with offset
            mask = torch.arange(c, device=dev)[None, :] <= (c - n + torch.arange(n, device=dev))[:, None]
            prefill.append(Prefill(slice(starts[b], starts[b] + n), 1, table[b, :-(-c // bs)], mask))  # [n, c]
        return AttnPlan(write_rows, last_rows, decode, prefill)


class _Linear:
    """One linear of the model as the runner calls it: with `pack`, the base GEMM on the weight packed once
    (molora.ops.packed, torch's result up to float32 rounding) and then, for a routed linear, each token's delta
    (`RoutedLoRALinear.add_delta`); without, or for a single row, the module itself. Module hooks of packed
    linears are not called (the runner calls the computation, not the module)."""

    __slots__ = ("mod", "packed", "routed")

    def __init__(self, mod: nn.Module, pack: bool) -> None:
        self.mod = mod
        weight = getattr(mod, "weight", None)
        self.packed = (packed.PackedLinear(weight, getattr(mod, "bias", None))
                       if pack and isinstance(weight, Tensor) and packed.supports(weight) else None)
        self.routed = hasattr(mod, "add_delta")

    def __call__(self, x: Tensor) -> Tensor:
        if self.packed is None or x.shape[0] < 2:
            return self.mod(x)
        y = self.packed(x)
        return self.mod.add_delta(x, y) if self.routed else y

    def kernel_args(self, dtype: torch.dtype) -> tuple | None:
        """(packed weight, bias, A, B, scale) as `fused_cpu.bind_block` takes them, where `__call__` on 2 to
        PANEL_MAX_ROWS rows of `dtype` runs molora's packed GEMM and, for a routed linear that an adapter targets,
        the fused LoRA kernel (A, B, scale None: no delta); None where it would run anything else."""
        w = None if self.packed is None else self.packed.kernel_weight(dtype)
        if w is None:
            return None
        lora = self.mod.kernel_operands() if self.routed else None
        return (w, self.packed.bias, None, None, None) if lora is None else (w, self.packed.bias, *lora)

    def watched(self) -> list[Tensor]:
        """The tensors whose change means a bound block must be bound again: the base weight (its packed copy) and
        bias, and a routed linear's slots and scales."""
        out = [self.mod.weight] + ([] if self.packed.bias is None else [self.packed.bias])
        if self.routed:
            bufs = self.mod.lora._buffers
            out += [bufs["A"], bufs["Bt"], bufs["scale"]]
        return out


class _Block:
    """One decoder block's modules and our attention over the paged cache (not an nn.Module: it only
    borrows the model's modules)."""

    def __init__(self, layer: nn.Module, index: int, cfg: Any, pack: bool = False) -> None:
        attn = layer.self_attn
        self.index = index
        self.input_layernorm, self.post_attention_layernorm = layer.input_layernorm, layer.post_attention_layernorm
        self.q_proj, self.k_proj, self.v_proj, self.o_proj = (_Linear(m, pack) for m in
                                                              (attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj))
        self.q_norm, self.k_norm = getattr(attn, "q_norm", None), getattr(attn, "k_norm", None)
        self.mlp = layer.mlp
        self.num_heads = cfg.num_attention_heads
        self.num_kv_heads = cfg.num_key_value_heads
        self.head_dim = attn.head_dim
        self.scaling = attn.scaling
        self.window = _sliding_window(cfg, index)
        self.kc: Tensor | None = None  # this block's [N, Hkv, hd] K and V cache views (set by ModelRunner)
        self.vc: Tensor | None = None
        mlp = self.mlp  # gate, up, SiLU and down called here (one fused SiLU * up) where the MLP is Llama's
        self.gated_silu = (getattr(cfg, "hidden_act", None) == "silu"
                           and all(hasattr(mlp, n) for n in ("gate_proj", "up_proj", "down_proj")))
        if self.gated_silu:
            self.gate_proj, self.up_proj, self.down_proj = (_Linear(m, pack) for m in
                                                            (mlp.gate_proj, mlp.up_proj, mlp.down_proj))
        # Where every piece of the block runs on molora's kernels (packed GEMMs, RMSNorms, no q/k norm, SiLU MLP),
        # a decode step's block may run as one C++ call (`run_bound`; fused_cpu.run_block)
        self.linears = ((self.q_proj, self.k_proj, self.v_proj, self.o_proj, self.gate_proj, self.up_proj,
                         self.down_proj) if self.gated_silu and self.q_norm is None
                        and all(type(n).__name__ in _RMS_NORMS for n in (self.input_layernorm,
                                                                       self.post_attention_layernorm))
                        else ())
        if not all(lin.packed is not None and lin.packed.form in ("panels", "amx") for lin in self.linears):
            self.linears = ()
        self.routed = next((lin.mod for lin in self.linears if lin.routed), None)   # its context and dispatcher
        self._bound: Any = None        # the block bound for one-call decode steps (`run_bound`), and what it was for
        self._bound_key: tuple | None = None

    def __call__(self, h: Tensor, delta: Tensor | None, positions: Tensor, plan: AttnPlan, cache: PagedKVCache,
                 cos: Tensor, sin: Tensor, one_call: Any = None) -> tuple[Tensor, Tensor]:
        """h [T, D] the residual stream and delta [T, D] (or None) what the previous block adds to it ->
        (h, this block's delta). h is updated in place (each add fused with the RMSNorm that reads it).
        one_call: where the runner found the step fit to run blocks as one C++ call (`ModelRunner._one_call`), the
        routing's fused-kernel arguments (`RoutedLoRALinear.kernel_step`), or PER_BLOCK to ask them here."""
        if one_call is not None and self.linears:
            step = (one_call if one_call is not PER_BLOCK else () if self.routed is None
                    else self.routed.kernel_step(h.shape[0], h.dtype))
            out = None if step is None else self.run_bound(h, delta, positions, plan, cache, cos, sin, step)
            if out is not None:                  # the whole block in one C++ call: the same kernels, the same order
                return h, out
        x = _add_norm(self.input_layernorm, h, delta)                        # h += delta; x = norm(h)
        x = _add_norm(self.post_attention_layernorm, h, self.o_proj(self.attention(x, positions, plan, cache,
                                                                                     cos, sin)))
        return h, self._mlp(x)

    def run_bound(self, h: Tensor, delta: Tensor | None, positions: Tensor, plan: AttnPlan, cache: PagedKVCache,
                  cos: Tensor, sin: Tensor, step: tuple) -> Tensor | None:
        """The block on a decode step as one C++ call (`fused_cpu.run_block`) on its arguments bound once
        (`fused_cpu.bind_block`: packed weights, slots, norms, tables, cache views) and bound again where they no
        longer hold: another dtype, an adapter slot's `active` changed or slots moved (`LoRASlots.generation`), a
        watched weight, bias, norm or slot written or moved (the C++ side checks). None: the block cannot run so
        (a linear not on molora's kernels in this dtype), nothing done."""
        key = (h.dtype, LoRASlots.generation)
        for _ in range(2):
            if self._bound_key != key:
                self._bound, self._bound_key = self._bind(h.dtype, cache, cos, sin), key
            if self._bound is None:
                return None
            d = plan.decode
            out = fused_cpu.run_block(self._bound, h, delta, step, positions, plan.write_rows, d.table, d.ctx, d.rows)
            if out is not None:
                return out
            self._bound_key = None                                          # something watched changed
        return None

    def _bind(self, dtype: torch.dtype, cache: PagedKVCache, cos: Tensor, sin: Tensor) -> Any:
        ln1, ln2 = self.input_layernorm, self.post_attention_layernorm
        lanes = fused_cpu.norm_lanes()
        if (not lanes or ln1.weight.dtype != dtype or ln2.weight.dtype != dtype or cos.dtype != dtype
                or ln1.variance_epsilon != ln2.variance_epsilon or self.kc.dtype != dtype or self.vc.dtype != dtype):
            return None
        linears = [lin.kernel_args(dtype) for lin in self.linears]
        if None in linears:
            return None
        watched = [ln1.weight, ln2.weight] + [t for lin in self.linears for t in lin.watched()]
        return fused_cpu.bind_block((ln1.weight, ln2.weight), ln1.variance_epsilon, lanes, linears,
                                    (self.num_heads, self.num_kv_heads, self.head_dim), (cos, sin),
                                    (self.kc, self.vc, cache.block_size, self.scaling, self.window), watched)

    def _mlp(self, x: Tensor) -> Tensor:
        if not self.gated_silu:
            return self.mlp(x)
        g, u = self.gate_proj(x), self.up_proj(x)
        if fused_cpu.silu_mul(g, u):
            return self.down_proj(g)
        return self.down_proj(self.mlp.act_fn(g) * u)

    def attention(self, x: Tensor, positions: Tensor, plan: AttnPlan, cache: PagedKVCache,
                  cos: Tensor, sin: Tensor) -> Tensor:
        T, H, Hkv, hd = x.shape[0], self.num_heads, self.num_kv_heads, self.head_dim
        q = self.q_proj(x).view(T, H, hd)
        k = self.k_proj(x).view(T, Hkv, hd)
        v = self.v_proj(x).view(T, Hkv, hd)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        kc, vc = self.kc, self.vc                                            # [N, Hkv, hd] (cache's views)
        # RoPE in place and K, V into the cache: one C++ call (equal bit for bit to the torch ops below)
        if not fused_cpu.rope_write(q, k, v, cos, sin, positions, plan.write_rows, kc, vc):
            c, s = cos[positions][:, None, :], sin[positions][:, None, :]    # [T, 1, hd]
            q = q * c + _rotate_half(q) * s
            k = k * c + _rotate_half(k) * s
            kc.index_copy_(0, plan.write_rows, k)
            vc.index_copy_(0, plan.write_rows, v)
        out = x.new_empty(T, H, hd)
        if plan.decode is not None:
            d = plan.decode
            if not fused_cpu.paged_decode_rows(out, q, kc, vc, d.table, d.ctx, d.rows, cache.block_size,
                                               self.scaling, self.window):
                out[d.rows] = self._decode(q[d.rows], cache.blocks(kc), cache.blocks(vc), d, positions[d.rows])
        for p in plan.prefill:
            out[p.rows] = self._prefill(q, k, v, p, positions, kc, vc, cache)
        return out.view(T, H * hd)

    def _prefill(self, q: Tensor, k: Tensor, v: Tensor, p: Prefill, positions: Tensor, kc: Tensor, vc: Tensor,
                 cache: PagedKVCache) -> Tensor:
        """One `Prefill` entry: q [T, H, hd] rows p.rows against their keys -> [rows, H, hd]."""
        P, Hkv, hd = p.count, self.num_kv_heads, self.head_dim
        qpos = positions[p.rows].view(P, -1)[0]                              # [n] (equal for the P prompts)
        if p.blocks is None:  # keys are this step's tokens (fresh prompts)
            kk, vv, kpos = k[p.rows], v[p.rows], qpos
        else:  # gather whole blocks (contiguous copies), then cut to the context length
            c = p.mask.shape[1]
            kk = cache.blocks(kc).index_select(0, p.blocks).view(-1, Hkv, hd)[:c]   # [ctx, Hkv, hd]
            vv = cache.blocks(vc).index_select(0, p.blocks).view(-1, Hkv, hd)[:c]
            kpos = torch.arange(c, device=q.device)
        mask = p.mask
        if self.window is not None:
            win = (kpos[None, :] > qpos[:, None] - self.window) & (kpos[None, :] <= qpos[:, None])
            mask = win if mask is None else mask & win
        qq, kk, vv = (t.view(P, -1, t.shape[-2], hd).transpose(1, 2) for t in (q[p.rows], kk, vv))  # [P, h, n, hd]
        o = F.scaled_dot_product_attention(qq, kk, vv, attn_mask=mask, is_causal=mask is None, scale=self.scaling,
                                           enable_gqa=True)                  # [P, H, n, hd]
        return o.transpose(1, 2).reshape(-1, q.shape[1], hd)

    def _decode(self, q: Tensor, kb: Tensor, vb: Tensor, d: Decode, qpos: Tensor) -> Tensor:
        """q [Bd, H, hd] of single-token sequences against their contexts -> [Bd, H, hd].

        kb, vb [NB, bs, Hkv, hd]: the layer's cache by block. Whole blocks are gathered (contiguous copies,
        about twice as fast as gathering rows); the mask hides rows past each context's end.
        """
        Bd, H, hd = q.shape
        Hkv = self.num_kv_heads
        kk = kb.index_select(0, d.blocks).view(Bd, -1, Hkv, hd).transpose(1, 2)   # [Bd, Hkv, C, hd]
        vv = vb.index_select(0, d.blocks).view(Bd, -1, Hkv, hd).transpose(1, 2)
        mask = d.mask                                                        # [Bd, 1, 1, C]
        if self.window is not None:
            col = torch.arange(kk.shape[2], device=q.device)
            mask = mask & (col[None, :] > qpos[:, None] - self.window)[:, None, None, :]
        qg = q.view(Bd, Hkv, H // Hkv, hd)                                   # query head h = kv * G + g
        o = F.scaled_dot_product_attention(qg, kk, vv, attn_mask=mask, scale=self.scaling)  # [Bd, Hkv, G, hd]
        return o.reshape(Bd, H, hd)


PER_BLOCK = object()   # `ModelRunner._one_call`: the routing's kernel arguments are asked per block (in-network router)

_RMS_NORMS = ("LlamaRMSNorm", "MistralRMSNorm", "Qwen2RMSNorm", "Qwen3RMSNorm")  # one formula (add_rms_norm)


def _add_norm(norm: nn.Module, h: Tensor, delta: Tensor | None) -> Tensor:
    """h += delta (in place; None: nothing to add), then norm(h): one C++ call where the kernel runs and `norm`
    is transformers' RMSNorm, else the torch ops."""
    if type(norm).__name__ in _RMS_NORMS:
        out = fused_cpu.add_rms_norm(h, delta, norm.weight, norm.variance_epsilon)
        if out is not None:
            return out
    if delta is not None:
        h.add_(delta)
    return norm(h)


def _rotate_half(x: Tensor) -> Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def _rope_tables(rotary: nn.Module, max_len: int, dtype: torch.dtype, device: torch.device) -> tuple[Tensor, Tensor]:
    """cos, sin [max_len, hd] from the model's own rotary embedding (any rope_type the config names).

    Dynamic rope types that rescale with the sequence length are evaluated once at max_len.
    """
    probe = torch.zeros(1, dtype=dtype, device=device)
    pos = torch.arange(max_len, device=device)[None]                          # [1, P]
    with torch.no_grad():
        cos, sin = rotary(probe, pos)
    return cos[0].to(dtype), sin[0].to(dtype)


def _sliding_window(cfg: Any, index: int) -> int | None:
    window = getattr(cfg, "sliding_window", None)
    types = getattr(cfg, "layer_types", None)
    if window is None:
        return None
    if types is not None:
        return window if types[index] == "sliding_attention" else None
    return window  # Mistral: every layer
