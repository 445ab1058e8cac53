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
the torch ops bit for bit; the norm's mean of squares is the float32 nearest the exact mean, not torch's own float32
sum (within about one ulp of transformers' norm; `fused_cpu.add_rms_norm`); SiLU's exp may differ from torch's in
the last bit.

On the CPU, a decode step's Llama-shaped block whose every piece runs on those kernels (the linears on packed weights
through molora's panel or AMX GEMM and, where routed, the fused LoRA kernel; RMSNorms; no q/k norm) runs as one C++
call, `fused_cpu.run_block`: the same kernels in the same order, equal bit for bit (tested in both dtypes), without
the Python between them (about 20 calls a block). What stays the same from step to step (packed weights, adapter
slots, norms, RoPE tables, cache views) is bound once per block (`molora.model.block.Block.run_bound`,
`fused_cpu.bind_block`) and bound again when it moves: another dtype, a linear gaining its first adapter or losing its
last (`LoRASlots.generation`), a weight or norm written or swapped, slots moved (checked in C++: storage and version;
storage alone for the slots, which loads and unloads write in place and the bound block reads there).
`ModelRunner._one_call` decides per step (a decode-only step of 2 to PANEL_MAX_ROWS rows, the routing's fused-kernel
arguments asked once, or per block for an in-network router). Measured on the engine bench's routed batch-32 decode step
(SmolLM2-135M, 2 threads, one process, steps alternating with the kernel-by-kernel path): 0.81x the time in bfloat16 and
0.86x in float32, greedy outputs equal. Prefill and mixed steps, and anything else, take the kernel-by-kernel path.

A decode step can instead be replayed from a captured graph (`enable_graphs`, molora.model.graphs: CUDA graphs,
one per batch-size bucket, static buffers, padding rows writing into the cache's one spare block,
`scratch_block`); `forward` hands such steps to it and `compute` is the step itself, on a plan built already.

Attention has two paths, planned once per step (`ModelRunner.plan` -> `AttnPlan`): paged decode (every
sequence with one new token, `Decode`; on CPU the fused kernel `fused_cpu.paged_decode` reads each context
where it lies in the cache, elsewhere its blocks are gathered for SDPA) and ragged prefill (`Prefill` entries: P prompts
of one length in one causal call (fresh prompts merged under a block-diagonal mask where MERGE_PREFILL_TOKENS allows;
off by default, molora.model.batch), or a chunk attending to its cached
context).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from molora.errors import MoLoRAError
from molora.model.batch import (
    MERGE_PREFILL_TOKENS,
    SUPPORTED_MODEL_TYPES,
    AttnPlan,
    BatchMeta,
    Decode,
    PagedKVCache,
    Prefill,
    RouterGroup,
    StepOutput,
    StepRouting,
)
from molora.model.block import PER_BLOCK, Block, Linear, add_norm, rope_tables
from molora.ops import fused_cpu, packed
from molora.ops.device import to_device
from molora.routing.arrow_linear import LinearRouting
from molora.routing.base import decide_slots

if TYPE_CHECKING:
    from molora.model.attach import MoLoRAModel


class ModelRunner:
    """Explicit-input forward of an attached Llama-family model over a paged KV cache (module docstring).

    Not an nn.Module: it borrows the model's modules and owns only the cache and the RoPE tables.
    """

    def __init__(
        self,
        mm: MoLoRAModel,
        *,
        num_blocks: int,
        block_size: int = 16,
        max_model_len: int = 2048,
        pack_weights: bool | None = None,
    ) -> None:
        cfg = mm.model.config
        if getattr(cfg, "model_type", None) not in SUPPORTED_MODEL_TYPES:
            raise MoLoRAError(
                f"the runner supports model types {SUPPORTED_MODEL_TYPES}, got "
                f"{getattr(cfg, 'model_type', None)!r}; use MoLoRAModel.generate for others"
            )
        hf: Any = mm.model  # a transformers causal LM of a supported type (checked above)
        inner = hf.model
        self.mm = mm
        self.context = mm.context
        self.embed = inner.embed_tokens
        self.norm = inner.norm
        param = next(mm.model.parameters())
        self.dtype, self.device = param.dtype, param.device
        # base GEMMs on packed weights (molora.ops.packed) where they run (`packed.form`: float32 on molora's kernel
        # or MKL, bfloat16 on AMX; each linear is asked on its own), unless False
        self.pack_weights = pack_weights is not False and param.device.type == "cpu"
        self.lm_head = Linear(hf.lm_head, self.pack_weights)
        # The blocks' own submodules, resolved once.
        self.blocks = [Block(layer, i, cfg, self.pack_weights) for i, layer in enumerate(inner.layers)]
        b0 = self.blocks[0]
        self.num_heads, self.num_kv_heads, self.head_dim = b0.num_heads, b0.num_kv_heads, b0.head_dim
        self.max_model_len = max_model_len
        # one block more than asked for: the scratch block, which no sequence owns (`scratch_block`), where the
        # padding rows of a captured decode step write their K/V
        self.cache = PagedKVCache(
            len(self.blocks), num_blocks + 1, block_size, self.num_kv_heads, self.head_dim, self.dtype, self.device
        )
        self.scratch_block = num_blocks
        self.graphs: Any = None  # a molora.model.graphs.DecodeGraphs once `enable_graphs` is called
        self.cos, self.sin = rope_tables(inner.rotary_emb, max_model_len, self.dtype, self.device)  # [P, hd]
        for block in self.blocks:  # each block's [N, Hkv, hd] views of the cache, taken once
            block.kc, block.vc = self.cache.k[block.index], self.cache.v[block.index]
        # the routed linears' context and dispatcher, whose routing a one-call decode step asks once (`_one_call`);
        # a block with a routed linear on another context or dispatcher runs kernel by kernel
        self._routed = routed = next((b.routed for b in self.blocks if b.routed is not None), None)
        for block in self.blocks:
            if routed is not None and any(
                lin.routed is not None
                and (lin.routed.context is not routed.context or lin.routed.dispatcher is not routed.dispatcher)
                for lin in block.linears
            ):
                block.linears = ()

    @property
    def block_size(self) -> int:
        return self.cache.block_size

    def packed_weights(self) -> list[Tensor]:
        """The packed copies of the float base weights this runner keeps beside the model's (molora.ops.packed: made
        at a linear's first packed call), for `quant_linear.weight_bytes` to count."""
        names = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
        lins = [self.lm_head] + [lin for b in self.blocks for n in names if (lin := getattr(b, n, None)) is not None]
        return [lin.packed.packed for lin in lins if lin.packed is not None and lin.packed.packed is not None]

    def enable_graphs(self, **kwargs: Any) -> Any:
        """Replay decode steps from captured graphs (`molora.model.graphs.DecodeGraphs(self, **kwargs)`: CUDA
        graphs on a CUDA device; elsewhere pass `capture=`). Returns the `DecodeGraphs`."""
        from molora.model.graphs import DecodeGraphs

        self.graphs = DecodeGraphs(self, **kwargs)
        return self.graphs

    # ------------------------------------------------------------------------------------ forward
    @torch.no_grad()
    def forward(
        self,
        tokens: Tensor,
        positions: Tensor,
        meta: BatchMeta,
        routing: StepRouting | None = None,
        *,
        logits: bool | list[int] = False,
        token_logits: list[int] | None = None,
    ) -> StepOutput:
        """tokens [T], positions [T] -> the `StepOutput` of the last token of each sequence; logits: True for
        every sequence's, a list of sequence indices for those only, False for none. token_logits: rows of T
        whose logits come back too (`StepOutput.token_logits`, in that order; scoring a prompt).

        Writes the K/V of every token into the cache rows its sequence's block table names. A decode step the
        runner's `graphs` accept (`enable_graphs`) is replayed from a captured graph instead (not one that asks
        for token_logits: a graph returns the last rows only).
        """
        if self.graphs is not None and not token_logits and self.graphs.accepts(meta, routing):
            out = self.graphs.run(tokens, positions, meta, routing, logits)
            if out is not None:
                return out
        plan = self.plan(positions, meta)
        return self.compute(tokens, positions, plan, routing, logits=logits, token_logits=token_logits)

    __call__ = forward

    @torch.no_grad()
    def compute(
        self,
        tokens: Tensor,
        positions: Tensor,
        plan: AttnPlan,
        routing: StepRouting | None = None,
        *,
        logits: bool | list[int] = False,
        token_logits: list[int] | None = None,
    ) -> StepOutput:
        """`forward` on a plan built already (by `plan`, or by `DecodeGraphs` from its static buffers)."""
        ctx = self.context
        slot_ids = None if routing is None else routing.slot_ids
        weights = None if routing is None else routing.weights
        router = None if routing is None or not routing.groups else routing.router  # None: the fixed routing only
        per_linear = router is not None and bool(getattr(router, "per_linear", False))
        learned = router is not None and not per_linear
        carry_out = None
        if learned:  # the router overwrites its rows per block; keep the caller's tensors intact
            assert routing is not None
            slot_ids, weights = self._routing_buffers(tokens.shape[0], routing)
            if getattr(routing.router, "carry_blocks", 0) > 0:
                carry_out = torch.full((tokens.shape[0],), -2, dtype=torch.long, device=slot_ids.device)
        ctx.set(slot_ids, weights)
        if per_linear:  # each routed linear decides from its own input (molora.routing.arrow: LinearRouting)
            assert routing is not None and routing.router_slots is not None
            ctx.linear = LinearRouting(
                routing.router,
                routing.router_slots,
                [(g.rows, g.allowed) for g in routing.groups],
                routing.router_weights,
            )
        try:
            h = self.embed(tokens)  # [T, D] the residual stream
            delta = None  # what the last block adds to h
            one_call = self._one_call(h, plan, learned)
            for block in self.blocks:
                if learned:
                    assert routing is not None and slot_ids is not None
                    if delta is not None:  # the router reads the block's whole input
                        h, delta = h.add_(delta), None
                    self._decide(block.index, h, routing, slot_ids, weights, carry_out)
                    ctx.set(slot_ids, weights)  # rows changed in place: drop the step's cached plan
                h, delta = block(h, delta, positions, plan, self.cache, self.cos, self.sin, one_call)
            scored = None if not token_logits else to_device(token_logits, h.device)  # [t] rows of T
            if scored is not None:  # h[scored] is a copy: the last rows below see h as the blocks left it
                h_scored = add_norm(self.norm, h[scored], None if delta is None else delta[scored])  # [t, D]
            last = plan.last_rows
            h = add_norm(self.norm, h[last], None if delta is None else delta[last])  # [B, D]
        finally:
            ctx.clear()
        out = StepOutput(
            h,
            None,
            None if slot_ids is None else slot_ids[plan.last_rows],  # [B, k]
            None if weights is None else weights[plan.last_rows],
            None if carry_out is None else carry_out[plan.last_rows],
            carry_out,
        )  # [B], [T]
        if logits is not False:
            rows = slice(None) if logits is True else logits
            pick = lambda t: None if t is None else t[rows]
            out.logits = self.logits(h[rows], pick(out.last_slot_ids), pick(out.last_weights))
        if scored is not None:  # each row's lm_head routing is its own token's, as for the last rows
            at = lambda t: None if t is None else t[scored]
            out.token_logits = self.logits(h_scored, at(slot_ids), at(weights))  # [t, V]
            out.token_slot_ids = at(slot_ids)  # [t, k] or None (every row on the base model)
        return out

    def _one_call(self, h: Tensor, plan: AttnPlan, learned: bool) -> Any:
        """Whether this step's blocks may run as one C++ call each (`Block.run_bound`): a decode-only step of 2 to
        PANEL_MAX_ROWS rows where molora's kernels run, and the routing's fused-kernel
        arguments (`RoutedLoRALinear.kernel_step`: () without routing), or PER_BLOCK where a router decides per block;
        None where not (every block then runs kernel by kernel)."""
        T, d = h.shape[0], plan.decode
        if (
            plan.prefill
            or d is None
            or d.rows.shape[0] != T
            or not 2 <= T <= packed.PANEL_MAX_ROWS
            or not fused_cpu.block_supports(h)
        ):
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
        router_k = getattr(routing.router, "top_k", 0) or getattr(getattr(routing.router, "config", None), "top_k", 1)
        assert routing.router_slots is not None, "a router's step routing has router_slots"
        m = 1 if routing.router_weights is None else routing.router_weights.shape[1]  # columns per choice
        k = max(int(router_k) * m, 1 if routing.slot_ids is None else routing.slot_ids.shape[1])
        device = routing.router_slots.device
        ids = torch.full((T, k), -1, dtype=torch.long, device=device)
        w = None
        if routing.slot_ids is not None:
            ids[:, : routing.slot_ids.shape[1]] = routing.slot_ids
        if k > 1 or routing.weights is not None:
            w = torch.zeros(T, k, dtype=torch.float32, device=device)
            if routing.weights is not None:
                w[:, : routing.weights.shape[1]] = routing.weights
            else:
                w[:, 0] = 1.0
        return ids, w

    def _decide(
        self,
        block: int,
        h: Tensor,
        routing: StepRouting,
        slot_ids: Tensor,
        weights: Tensor | None,
        carry_out: Tensor | None = None,
    ) -> None:
        """Let the router choose, from the block's input h [T, D], the slots of its rows (in place);
        carry_out [T] (a router with carry_blocks) receives the decisions at its carry_source block."""
        assert routing.router_slots is not None, "a router's step routing has router_slots"
        for g in routing.groups:
            hidden = h if g.rows is None else h[g.rows]  # [n, D]
            carry = routing.carry if routing.carry is None or g.rows is None else routing.carry[g.rows]
            fixed = routing.fixed if routing.fixed is None or g.rows is None else routing.fixed[g.rows]
            out = decide_slots(
                routing.router, block, hidden, routing.router_slots, g.allowed, carry, fixed, routing.router_weights
            )
            if out is None:
                continue  # keep the previous decision
            slots, w, ids = out  # [n, k'] slots (-1 = base), router order

            def put(dst: Tensor, value: Tensor, g: RouterGroup = g) -> None:  # the group's rows of dst <- value
                if g.owned is None:
                    dst[slice(None) if g.rows is None else g.rows] = value
                else:  # a recorded step's group: every row, the router's own ones changed (RouterGroup.owned)
                    dst.copy_(torch.where(g.owned.view(-1, *[1] * (dst.dim() - 1)), value, dst))

            if carry_out is not None and block == routing.router.carry_source:
                put(carry_out, ids[:, 0])
            k2 = slots.shape[1]
            if k2 > slot_ids.shape[1]:
                raise MoLoRAError(
                    f"the router returned top-{k2} choices but declares top_k={slot_ids.shape[1]} "
                    "(set `top_k` or `config.top_k` on the router)"
                )
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
            raise MoLoRAError(
                f"batch metadata covers {sum(q_lens)} tokens in {B} sequences, but the step has "
                f"{positions.shape[0]} tokens"
            )
        if max(ctx_lens) > self.max_model_len:
            raise MoLoRAError(f"context of {max(ctx_lens)} tokens exceeds max_model_len={self.max_model_len}")
        # the per-token and decode indices in Python (a handful of tensors per step, not a chain of small ops)
        pos = [p for n, c in zip(q_lens, ctx_lens) for p in range(c - n, c)]
        if positions.device.type == "cpu" and positions.tolist() != pos:
            raise MoLoRAError(
                "positions disagree with the batch metadata: sequence b's tokens must sit at positions "
                "context_lens[b] - query_lens[b] ... context_lens[b] - 1"
            )
        write, ends, t = [], [], 0
        for b in range(B):
            tb = tables[b]
            for p in pos[t : t + q_lens[b]]:
                write.append(tb[p // bs] * bs + p % bs)
            t += q_lens[b]
            ends.append(t)
        write_rows = to_device(write, dev)  # [T] cache row of each new token
        dec = [b for b in range(B) if q_lens[b] == 1]
        decode = None
        if dec:
            nb = -(-max(ctx_lens[b] for b in dec) // bs)  # blocks of the longest context
            dec_table = [tables[b][:nb] + [0] * (nb - min(len(tables[b]), nb)) for b in dec]
            decode = Decode(
                to_device([ends[b] - 1 for b in dec], dev),
                to_device(dec_table, dev).view(len(dec), nb),  # [Bd, nb]
                to_device([ctx_lens[b] for b in dec], dev),
                bs,
            )
        last_rows = to_device([e - 1 for e in ends], dev)  # [B]
        if all(q_lens[b] == 1 for b in range(B)):
            return AttnPlan(write_rows, last_rows, decode, [])
        width = max(len(t) for t in tables)
        table = to_device([t + [0] * (width - len(t)) for t in tables], dev)  # [B, W]
        seq_of = to_device(torch.repeat_interleave(torch.arange(B), torch.tensor(q_lens)), dev)  # [T] (host counts)
        starts = [0]
        for n in q_lens[:-1]:
            starts.append(starts[-1] + n)
        prefill: list[Prefill] = []
        fresh = [b for b in range(B) if q_lens[b] > 1 and ctx_lens[b] == q_lens[b]]  # whole context in this step
        if len(fresh) > 1 and sum(q_lens[b] for b in fresh) <= MERGE_PREFILL_TOKENS:
            # one attention call for all fresh prompts: block-diagonal causal mask over their tokens
            rows = torch.cat([torch.arange(starts[b], starts[b] + q_lens[b], device=dev) for b in fresh])  # [Tf]
            seg, tpos = seq_of[rows], positions[rows]
            prefill.append(Prefill(rows, mask=(seg[None, :] == seg[:, None]) & (tpos[None, :] <= tpos[:, None])))
            fresh = []
        by_len: dict[int, list[int]] = {}  # fresh prompts by length: each length is one batched causal call
        for b in fresh:
            by_len.setdefault(q_lens[b], []).append(b)
        for n, seqs in by_len.items():
            if all(starts[b2] == starts[b1] + n for b1, b2 in zip(seqs, seqs[1:])):  # adjacent in T (or alone)
                prefill.append(Prefill(slice(starts[seqs[0]], starts[seqs[-1]] + n), len(seqs)))
            else:
                prefill.append(
                    Prefill(torch.cat([torch.arange(starts[b], starts[b] + n, device=dev) for b in seqs]), len(seqs))
                )
        for b in range(B):
            n, c = q_lens[b], ctx_lens[b]
            if n == 1 or c == n:
                continue
            # earlier tokens are in the cache: gather the whole context, causal with offset
            mask = torch.arange(c, device=dev)[None, :] <= (c - n + torch.arange(n, device=dev))[:, None]
            prefill.append(Prefill(slice(starts[b], starts[b] + n), 1, table[b, : -(-c // bs)], mask))  # [n, c]
        return AttnPlan(write_rows, last_rows, decode, prefill)
