"""One decoder block as the runner runs it (`Block`), its linears (`Linear`: the base GEMM on packed weights, or a
weight-only int8 base's kernel, plus the routed LoRA delta) and the block's C++ decode path beside it
(`Block.run_bound`: the whole block as one call on arguments bound once). The routed linears read the step's routing
from the model's `RoutingContext`, which the runner writes once per step before the first block; the C++ path gets
the routing's kernel arguments as an argument (`one_call`). The norm, RoPE and attention functions the runner calls live
here too. Legend as in molora.model.runner.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol, cast

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from molora.adapters.bank import LoRASlots
from molora.model.batch import AttnPlan, Decode, PagedKVCache, Prefill
from molora.model.lora_linear import RoutedLoRALinear
from molora.model.quant_linear import QuantizedLinear
from molora.ops import fused_cpu, packed


# What a Block borrows from a transformers decoder layer (LlamaDecoderLayer and its Mistral/Qwen2/Qwen3 kin), as
# types: nn.Module.__getattr__ types every submodule `Tensor | Module`, so the layer is read through these once.
class HFAttention(Protocol):
    q_proj: nn.Module
    k_proj: nn.Module
    v_proj: nn.Module
    o_proj: nn.Module
    head_dim: int
    scaling: float


class HFDecoderLayer(Protocol):
    self_attn: HFAttention
    mlp: nn.Module
    input_layernorm: nn.Module
    post_attention_layernorm: nn.Module


class HFGatedMLP(Protocol):
    """A Llama-style MLP (`Block.gated_silu`): down(act_fn(gate(x)) * up(x))."""

    gate_proj: nn.Module
    up_proj: nn.Module
    down_proj: nn.Module
    act_fn: Callable[[Tensor], Tensor]


class RMSNorm(Protocol):
    """transformers' RMSNorm of the families in RMS_NORMS: weight * x / sqrt(mean(x^2) + variance_epsilon)."""

    weight: Tensor
    variance_epsilon: float

    def __call__(self, h: Tensor) -> Tensor: ...


class Linear:
    """One linear of the model as the runner calls it: with `pack`, the base GEMM on the weight packed once
    (molora.ops.packed, torch's result up to float32 rounding) and then, for a routed linear, each token's delta
    (`RoutedLoRALinear.add_delta`); without, or for a single row, the module itself. Module hooks of packed
    linears are not called (the runner calls the computation, not the module). A weight-only int8 base
    (`QuantizedLinear` of scheme int8, alone or under a routed linear) runs as its module (its own int8 kernel, then
    the delta) and binds into the one-call decode block with its int8 operands (`quant`)."""

    __slots__ = ("mod", "packed", "routed", "quant")

    def __init__(self, mod: nn.Module, pack: bool) -> None:
        self.mod = mod
        weight = getattr(mod, "weight", None)
        self.packed = (
            packed.PackedLinear(weight, getattr(mod, "bias", None))
            if pack and isinstance(weight, Tensor) and packed.supports(weight)
            else None
        )
        self.routed = mod if isinstance(mod, RoutedLoRALinear) else None  # the module again, where it is routed
        base = mod._modules.get("qbase") if self.routed is not None else mod
        self.quant = base if isinstance(base, QuantizedLinear) and base.scheme == "int8" else None

    def __call__(self, x: Tensor) -> Tensor:
        if self.packed is None or x.shape[0] < 2:
            return self.mod(x)
        y = self.packed(x)
        return self.routed.add_delta(x, y) if self.routed is not None else y

    def kernel_args(self, dtype: torch.dtype) -> tuple | None:
        """(weight, bias, A, B, scale, weight scales) as `fused_cpu.bind_block` takes them, where `__call__` on 2 to
        PANEL_MAX_ROWS rows of `dtype` runs molora's packed GEMM (weight scales None) or int8 kernel (the int8
        operands of `QuantizedLinear.w8_operands`) and, for a routed linear that an adapter targets, the fused LoRA
        kernel (A, B, scale None: no delta); None where it would run anything else."""
        w: Tensor | None
        ws: Tensor | None
        if self.quant is not None:
            if (
                dtype not in fused_cpu.DTYPES
                or not fused_cpu.available()
                or not fused_cpu.w8_ready()
                or self.quant.in_features % 16
            ):
                return None
            (w, ws), bias = self.quant.w8_operands(dtype), self.quant.bias
            if bias is not None and bias.dtype != dtype:
                return None
        else:
            w = None if self.packed is None else self.packed.kernel_weight(dtype)
            if w is None or self.packed is None:
                return None
            ws, bias = None, self.packed.bias
        lora = self.routed.kernel_operands() if self.routed is not None else None
        return (w, bias, None, None, None, ws) if lora is None else (w, bias, *lora, ws)

    def watched(self) -> tuple[list[Tensor], list[Tensor]]:
        """(watched, held) for `fused_cpu.bind_block`. Watched: the tensors whose change means a bound block must be
        bound again: the base weight (its packed copy) and bias (an int8 base: its qweight, scales and bias), and a
        routed linear's A or scale where the kernel gets a copy of it (A not contiguous, scale cast to float32: a
        bfloat16 model's bank). Held: the slot tensors the kernel reads in place (Bt, and A and scale where not
        copied), so that a load or unload writing a slot keeps the binding; only their moving to other storage means a
        rebind."""
        if self.quant is not None:
            q = self.quant
            watched = [q.qweight, q.scales] + ([] if q.bias is None else [q.bias])
        else:
            weight = self.mod.weight
            assert isinstance(weight, Tensor) and self.packed is not None, "only a packed linear is bound"
            watched = [weight] + ([] if self.packed.bias is None else [self.packed.bias])
        held: list[Tensor] = []
        if self.routed is not None:
            lora = self.routed.lora
            held.append(lora.Bt)  # B is its transposed view
            (held if lora.A.is_contiguous() else watched).append(lora.A)
            (held if lora.scale.dtype == torch.float32 else watched).append(lora.scale)
        return watched, held


class Block:
    """One decoder block's modules and our attention over the paged cache (not an nn.Module: it only
    borrows the model's modules)."""

    # this block's [N, Hkv, hd] K and V cache views: set by ModelRunner right after it builds the blocks
    kc: Tensor
    vc: Tensor

    def __init__(self, layer: nn.Module, index: int, cfg: Any, pack: bool = False) -> None:
        hf = cast(HFDecoderLayer, layer)
        attn = hf.self_attn
        self.index = index
        self.input_layernorm, self.post_attention_layernorm = hf.input_layernorm, hf.post_attention_layernorm
        self.q_proj, self.k_proj, self.v_proj, self.o_proj = (
            Linear(m, pack) for m in (attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj)
        )
        self.q_norm: nn.Module | None = getattr(attn, "q_norm", None)
        self.k_norm: nn.Module | None = getattr(attn, "k_norm", None)
        self.mlp = hf.mlp
        self.num_heads: int = cfg.num_attention_heads
        self.num_kv_heads: int = cfg.num_key_value_heads
        self.head_dim = attn.head_dim
        self.scaling = attn.scaling
        self.window = sliding_window(cfg, index)
        # gate, up, SiLU and down called here (one fused SiLU * up) where the MLP is Llama's
        self.gated_silu = getattr(cfg, "hidden_act", None) == "silu" and all(
            hasattr(self.mlp, n) for n in ("gate_proj", "up_proj", "down_proj")
        )
        if self.gated_silu:
            mlp = cast(HFGatedMLP, self.mlp)
            self.act_fn = mlp.act_fn
            self.gate_proj, self.up_proj, self.down_proj = (
                Linear(m, pack) for m in (mlp.gate_proj, mlp.up_proj, mlp.down_proj)
            )
        # Where every piece of the block runs on molora's kernels (packed GEMMs, RMSNorms, no q/k norm, SiLU MLP),
        # a decode step's block may run as one C++ call (`run_bound`; fused_cpu.run_block)
        self.linears = (
            (self.q_proj, self.k_proj, self.v_proj, self.o_proj, self.gate_proj, self.up_proj, self.down_proj)
            if self.gated_silu
            and self.q_norm is None
            and all(type(n).__name__ in RMS_NORMS for n in (self.input_layernorm, self.post_attention_layernorm))
            else ()
        )
        if not all(
            lin.quant is not None or (lin.packed is not None and lin.packed.form in ("panels", "amx"))
            for lin in self.linears
        ):
            self.linears = ()
        self.routed = next((lin.routed for lin in self.linears if lin.routed is not None), None)  # context, dispatcher
        self._bound: Any = None  # the block bound for one-call decode steps (`run_bound`), and what it was for
        self._bound_key: tuple | None = None
        self._gemm: str | None = None  # the bound block's GEMM kernel, as `kernel_clock` names it

    def __call__(
        self,
        h: Tensor,
        delta: Tensor | None,
        positions: Tensor,
        plan: AttnPlan,
        cache: PagedKVCache,
        cos: Tensor,
        sin: Tensor,
        one_call: Any = None,
    ) -> tuple[Tensor, Tensor]:
        """h [T, D] the residual stream and delta [T, D] (or None) what the previous block adds to it ->
        (h, this block's delta). h is updated in place (each add fused with the RMSNorm that reads it).
        one_call: where the runner found the step fit to run blocks as one C++ call (`ModelRunner._one_call`), the
        routing's fused-kernel arguments (`RoutedLoRALinear.kernel_step`), or PER_BLOCK to ask them here."""
        if one_call is not None and self.linears:
            step = (
                one_call
                if one_call is not PER_BLOCK
                else ()
                if self.routed is None
                else self.routed.kernel_step(h.shape[0], h.dtype)
            )
            out = None if step is None else self.run_bound(h, delta, positions, plan, cache, cos, sin, step)
            if out is not None:  # the whole block in one C++ call: the same kernels, the same order
                return h, out
        x = add_norm(self.input_layernorm, h, delta)  # h += delta; x = norm(h)
        x = add_norm(self.post_attention_layernorm, h, self.o_proj(self.attention(x, positions, plan, cache, cos, sin)))
        return h, self._mlp(x)

    def run_bound(
        self,
        h: Tensor,
        delta: Tensor | None,
        positions: Tensor,
        plan: AttnPlan,
        cache: PagedKVCache,
        cos: Tensor,
        sin: Tensor,
        step: tuple,
    ) -> Tensor | None:
        """The block on a decode step as one C++ call (`fused_cpu.run_block`) on its arguments bound once
        (`fused_cpu.bind_block`: packed weights, slots, norms, tables, cache views) and bound again where they no
        longer hold: another dtype, a linear starting or stopping to carry a delta or slots moved
        (`LoRASlots.generation`), a watched weight, bias or norm written or moved, a held slot tensor moved (the C++
        side checks; `Linear.watched`). Adapter loads and unloads write slots in place and keep the binding. None:
        the block cannot run so (a linear not on molora's kernels in this dtype), nothing done."""
        key = (h.dtype, LoRASlots.generation)
        for _ in range(2):
            if self._bound_key != key:
                self._bound, self._bound_key = self._bind(h.dtype, cache, cos, sin), key
            if self._bound is None:
                return None
            d = plan.decode
            assert d is not None, "run_bound runs decode steps only (ModelRunner._one_call)"
            out = fused_cpu.run_block(
                self._bound, h, delta, step, positions, plan.write_rows, d.table, d.ctx, d.rows, self._gemm
            )
            if out is not None:
                return out
            self._bound_key = None  # something watched changed
        return None

    def _bind(self, dtype: torch.dtype, cache: PagedKVCache, cos: Tensor, sin: Tensor) -> Any:
        # both norms are transformers' RMSNorms where `linears` is not empty (__init__)
        ln1, ln2 = cast(RMSNorm, self.input_layernorm), cast(RMSNorm, self.post_attention_layernorm)
        if (
            ln1.weight.dtype != dtype
            or ln2.weight.dtype != dtype
            or cos.dtype != dtype
            or ln1.variance_epsilon != ln2.variance_epsilon
            or self.kc.dtype != dtype
            or self.vc.dtype != dtype
        ):
            return None
        args = [lin.kernel_args(dtype) for lin in self.linears]
        linears = [a for a in args if a is not None]
        if len(linears) != len(args):
            return None
        watched, held = [ln1.weight, ln2.weight], []
        for lin in self.linears:
            w, k = lin.watched()
            watched += w
            held += k
        w0 = linears[0][0]
        self._gemm = (
            ("molora::linear_amx_w8" if w0.dim() == 4 else "molora::linear_w8") if w0.dtype == torch.int8 else None
        )
        return fused_cpu.bind_block(
            (ln1.weight, ln2.weight),
            ln1.variance_epsilon,
            linears,
            (self.num_heads, self.num_kv_heads, self.head_dim),
            (cos, sin),
            (self.kc, self.vc, cache.block_size, self.scaling, self.window),
            watched,
            held,
        )

    def _mlp(self, x: Tensor) -> Tensor:
        if not self.gated_silu:
            return self.mlp(x)
        g, u = self.gate_proj(x), self.up_proj(x)
        if fused_cpu.silu_mul(g, u):
            return self.down_proj(g)
        return self.down_proj(self.act_fn(g) * u)

    def attention(
        self, x: Tensor, positions: Tensor, plan: AttnPlan, cache: PagedKVCache, cos: Tensor, sin: Tensor
    ) -> Tensor:
        T, H, Hkv, hd = x.shape[0], self.num_heads, self.num_kv_heads, self.head_dim
        q = self.q_proj(x).view(T, H, hd)
        k = self.k_proj(x).view(T, Hkv, hd)
        v = self.v_proj(x).view(T, Hkv, hd)
        if self.q_norm is not None:
            assert self.k_norm is not None  # Qwen3: both head norms
            q, k = self.q_norm(q), self.k_norm(k)
        kc, vc = self.kc, self.vc  # [N, Hkv, hd] (cache's views)
        # RoPE in place and K, V into the cache: one C++ call (equal bit for bit to the torch ops below)
        if not fused_cpu.rope_write(q, k, v, cos, sin, positions, plan.write_rows, kc, vc):
            c, s = cos[positions][:, None, :], sin[positions][:, None, :]  # [T, 1, hd]
            q = q * c + rotate_half(q) * s
            k = k * c + rotate_half(k) * s
            kc.index_copy_(0, plan.write_rows, k)
            vc.index_copy_(0, plan.write_rows, v)
        out = x.new_empty(T, H, hd)
        if plan.decode is not None:
            d = plan.decode
            if not fused_cpu.paged_decode_rows(
                out, q, kc, vc, d.table, d.ctx, d.rows, cache.block_size, self.scaling, self.window
            ):
                out[d.rows] = self._decode(q[d.rows], cache.blocks(kc), cache.blocks(vc), d, positions[d.rows])
        for p in plan.prefill:
            out[p.rows] = self._prefill(q, k, v, p, positions, kc, vc, cache)
        return out.view(T, H * hd)

    def _prefill(
        self,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        p: Prefill,
        positions: Tensor,
        kc: Tensor,
        vc: Tensor,
        cache: PagedKVCache,
    ) -> Tensor:
        """One `Prefill` entry: q [T, H, hd] rows p.rows against their keys -> [rows, H, hd]."""
        P, Hkv, hd = p.count, self.num_kv_heads, self.head_dim
        qpos = positions[p.rows].view(P, -1)[0]  # [n] (equal for the P prompts)
        if p.blocks is None:  # keys are this step's tokens (fresh prompts)
            kk, vv, kpos = k[p.rows], v[p.rows], qpos
        else:  # gather whole blocks (contiguous copies), then cut to the context length
            assert p.mask is not None, "a chunk over cached blocks has its [n, ctx] mask (ModelRunner.plan)"
            c = p.mask.shape[1]
            kk = cache.blocks(kc).index_select(0, p.blocks).view(-1, Hkv, hd)[:c]  # [ctx, Hkv, hd]
            vv = cache.blocks(vc).index_select(0, p.blocks).view(-1, Hkv, hd)[:c]
            kpos = torch.arange(c, device=q.device)
        mask = p.mask
        if self.window is not None:
            win = (kpos[None, :] > qpos[:, None] - self.window) & (kpos[None, :] <= qpos[:, None])
            mask = win if mask is None else mask & win
        qq, kk, vv = (t.view(P, -1, t.shape[-2], hd).transpose(1, 2) for t in (q[p.rows], kk, vv))  # [P, h, n, hd]
        o = F.scaled_dot_product_attention(
            qq, kk, vv, attn_mask=mask, is_causal=mask is None, scale=self.scaling, enable_gqa=True
        )  # [P, H, n, hd]
        return o.transpose(1, 2).reshape(-1, q.shape[1], hd)

    def _decode(self, q: Tensor, kb: Tensor, vb: Tensor, d: Decode, qpos: Tensor) -> Tensor:
        """q [Bd, H, hd] of single-token sequences against their contexts -> [Bd, H, hd].

        kb, vb [NB, bs, Hkv, hd]: the layer's cache by block. Whole blocks are gathered (contiguous copies,
        about twice as fast as gathering rows); the mask hides rows past each context's end.
        """
        Bd, H, hd = q.shape
        Hkv = self.num_kv_heads
        kk = kb.index_select(0, d.blocks).view(Bd, -1, Hkv, hd).transpose(1, 2)  # [Bd, Hkv, C, hd]
        vv = vb.index_select(0, d.blocks).view(Bd, -1, Hkv, hd).transpose(1, 2)
        mask = d.mask  # [Bd, 1, 1, C]
        if self.window is not None:
            col = torch.arange(kk.shape[2], device=q.device)
            mask = mask & (col[None, :] > qpos[:, None] - self.window)[:, None, None, :]
        qg = q.view(Bd, Hkv, H // Hkv, hd)  # query head h = kv * G + g
        o = F.scaled_dot_product_attention(qg, kk, vv, attn_mask=mask, scale=self.scaling)  # [Bd, Hkv, G, hd]
        return o.reshape(Bd, H, hd)


PER_BLOCK = object()  # `ModelRunner._one_call`: the routing's kernel arguments are asked per block (in-network router)

RMS_NORMS = ("LlamaRMSNorm", "MistralRMSNorm", "Qwen2RMSNorm", "Qwen3RMSNorm")  # one formula (add_rms_norm)


def add_norm(norm: nn.Module, h: Tensor, delta: Tensor | None) -> Tensor:
    """h += delta (in place; None: nothing to add), then norm(h): one C++ call where the kernel runs and `norm`
    is transformers' RMSNorm, else the torch ops."""
    if type(norm).__name__ in RMS_NORMS:
        rms = cast(RMSNorm, norm)
        out = fused_cpu.add_rms_norm(h, delta, rms.weight, rms.variance_epsilon)
        if out is not None:
            return out
    if delta is not None:
        h.add_(delta)
    return norm(h)


def rotate_half(x: Tensor) -> Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def rope_tables(rotary: nn.Module, max_len: int, dtype: torch.dtype, device: torch.device) -> tuple[Tensor, Tensor]:
    """cos, sin [max_len, hd] from the model's own rotary embedding (any rope_type the config names).

    Dynamic rope types that rescale with the sequence length are evaluated once at max_len.
    """
    probe = torch.zeros(1, dtype=dtype, device=device)
    pos = torch.arange(max_len, device=device)[None]  # [1, P]
    with torch.no_grad():
        cos, sin = rotary(probe, pos)
    return cos[0].to(dtype), sin[0].to(dtype)


def sliding_window(cfg: Any, index: int) -> int | None:
    window = getattr(cfg, "sliding_window", None)
    types = getattr(cfg, "layer_types", None)
    if window is None:
        return None
    if types is not None:
        return window if types[index] == "sliding_attention" else None
    return window  # Mistral: every layer
