"""`molora bench model`'s workloads: the models, every variant's copy of them, and one callable per variant and
scenario, ready to be timed.

    st = build_stack("tiny", load_model("tiny"), folder, k=4, rank=16, xlora=True, bf16=True, max_len=129, max_batch=32)
    fns = prefill_fns(st, batch=8, length=128)             # {"base": fn, "molora": fn, "runner": fn, ...}
    fns, resets = decode_fns(st, batch=8, ctx=128)         # one decode step each; resets crop the HF caches back
    fns = kmodality_fns(mm, base, K=4, batch=8, length=128, segment=16)   # per-token vs K per-sequence passes

Each variant gets its own deep copy of the base (attach and PEFT both swap modules), random-weight PEFT adapters and
seeded random inputs and routings, so two runs time the same work. What the variants are and
why is in molora.bench.model's docstring; the timing, the plan and the JSON are there too, the table, plot and goals
in molora.bench.model_report. Knows models through attach, PEFT and the runner; times nothing.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor, nn

from molora.config import LLAMA_PROJECTIONS
from molora.routing import Routing

if TYPE_CHECKING:
    from molora.model.attach import MoLoRAModel

# ---------------------------------------------------------------------------------------------- models


def tiny_llama(vocab: int = 1024, hidden: int = 128, layers: int = 4) -> nn.Module:
    """A small random Llama (fp32, eval), seeded: the "tiny config" where per-call overheads dominate."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=hidden * 11 // 4,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=1024,
        tie_word_embeddings=True,
        pad_token_id=0,
    )
    torch.manual_seed(0)
    return LlamaForCausalLM(cfg).eval()


def load_model(name: str) -> nn.Module:
    """The bench's base model on `molora.model.base.device()` ($MOLORA_DEVICE); every input follows it."""
    from molora.model.base import device, load_base

    if name == "tiny":
        return tiny_llama().to(device())
    if name == "smollm2":
        return load_base()[0]
    raise ValueError(f"unknown model {name!r}; use tiny or smollm2")


def device_of(model: nn.Module) -> torch.device:
    """The device of `model`'s first parameter: where its inputs must be."""
    return next(model.parameters()).device


def make_adapters(model: nn.Module, folder: Path, k: int, rank: int, seed: int = 0) -> dict[str, Path]:
    """k random PEFT folders (rank `rank`, all seven projections); names skill0..skill{k-1}."""
    from molora.bench.engine import make_adapters as make

    return make(model, folder, k, rank, seed)


def lora_flops(cfg: Any, rank: int, targets: tuple[str, ...] = LLAMA_PROJECTIONS) -> dict[str, float]:
    """Multiply-accumulates per token of the base's linears (with and without lm_head) and of one LoRA
    adapter of rank `rank` on `targets` (r * (d_in + d_out) per adapted linear), and their ratios."""
    D, I, L, V = cfg.hidden_size, cfg.intermediate_size, cfg.num_hidden_layers, cfg.vocab_size
    hd = getattr(cfg, "head_dim", None) or D // cfg.num_attention_heads
    q, kv = cfg.num_attention_heads * hd, cfg.num_key_value_heads * hd
    shapes = {
        "q_proj": (D, q),
        "k_proj": (D, kv),
        "v_proj": (D, kv),
        "o_proj": (q, D),
        "gate_proj": (D, I),
        "up_proj": (D, I),
        "down_proj": (I, D),
    }  # (d_in, d_out)
    body = L * sum(a * b for a, b in shapes.values())
    head = D * V
    lora = L * sum(rank * (a + b) for n, (a, b) in shapes.items() if n in targets)
    return {
        "base_linear_macs_per_token": body + head,
        "base_body_macs_per_token": body,
        "lm_head_macs_per_token": head,
        "lora_macs_per_token": lora,
        "lora_vs_base": lora / (body + head),
        "lora_vs_body": lora / body,
        "attention_macs_per_token_at_ctx": 2 * L * cfg.num_attention_heads * hd,
    }  # x context length


@dataclass
class Stack:
    """Every variant's model for one base: separate copies, since attach and PEFT both swap modules."""

    name: str
    base: nn.Module
    mm: MoLoRAModel  # MoLoRAModel, K adapters
    names: list[str]
    runner: Any = None  # ModelRunner over mm
    blocks_per_seq: int = 0  # runner cache blocks owned by each sequence (fixed tables)
    peft: Any = None
    xlora: Any = None
    errors: dict[str, str] = field(default_factory=dict)
    base_bf16: nn.Module | None = None
    mm_bf16: Any = None


def _peft_mixed(model: nn.Module, paths: dict[str, Path]) -> Any:
    from peft import PeftModel

    names = list(paths)
    pm = PeftModel.from_pretrained(model, str(paths[names[0]]), adapter_name=names[0])
    for n in names[1:]:
        pm.load_adapter(str(paths[n]), adapter_name=n)
    return pm.eval()


def _xlora(model: nn.Module, paths: dict[str, Path]) -> Any:
    """PEFT X-LoRA over the same adapters. Its adapters must be named "0".."K-1": XLoraModel loads them
    under those names but activates the config's keys, and PEFT 0.21's disable_adapter_layers (run by
    every scaling pass) then fails with KeyError on any other name."""
    from peft import XLoraConfig, get_peft_model

    model.config.use_cache = False  # XLoraModel raises "`use_cache` must be False" otherwise
    cfg = XLoraConfig(
        task_type="CAUSAL_LM",
        hidden_size=model.config.hidden_size,
        xlora_depth=1,
        adapters={str(i): str(p) for i, p in enumerate(paths.values())},
    )
    return get_peft_model(model, cfg).eval()


def build_stack(
    name: str,
    base: nn.Module,
    folder: Path,
    k: int,
    rank: int,
    *,
    xlora: bool,
    bf16: bool,
    max_len: int,
    max_batch: int,
) -> Stack:
    from molora import attach
    from molora.model.runner import ModelRunner

    paths = make_adapters(base, folder, k, rank)
    mm = attach(copy.deepcopy(base), paths)
    st = Stack(name, base, mm, mm.adapter_names)
    st.blocks_per_seq = -(-(max_len + 1) // 16)
    st.runner = ModelRunner(mm, num_blocks=max_batch * st.blocks_per_seq, block_size=16, max_model_len=max_len + 16)
    st.peft = _peft_mixed(copy.deepcopy(base), paths)
    if xlora:
        try:
            st.xlora = _xlora(copy.deepcopy(base), paths)
        except Exception as e:  # noqa: BLE001 - recorded in the JSON and the docs, never silently skipped
            st.errors["xlora"] = f"{type(e).__name__}: {e}"
    if bf16:
        st.base_bf16 = copy.deepcopy(base).to(torch.bfloat16)
        st.mm_bf16 = attach(copy.deepcopy(base).to(torch.bfloat16), paths)
    return st


# ---------------------------------------------------------------------------------------------- variants


def _runner_meta(batch: int, q_len: int, ctx: int, blocks_per_seq: int) -> Any:
    from molora.model.batch import BatchMeta

    tables = [list(range(b * blocks_per_seq, (b + 1) * blocks_per_seq)) for b in range(batch)]
    return BatchMeta([q_len] * batch, [ctx] * batch, tables)


def _random_routing(shape: tuple[int, ...], k: int, seed: int, device: torch.device | str = "cpu") -> Tensor:
    return torch.randint(0, k, shape, generator=torch.Generator().manual_seed(seed)).to(device)


def prefill_fns(st: Stack, batch: int, length: int, seed: int = 0) -> dict[str, Callable[[], Any]]:
    """One forward over [batch, length] tokens per variant, logits of the last position only."""
    from molora.model.batch import StepRouting

    vocab, K, dev = st.base.config.vocab_size, len(st.names), device_of(st.base)
    ids = torch.randint(0, vocab, (batch, length), generator=torch.Generator().manual_seed(seed)).to(dev)
    aid = _random_routing((batch, length), K, seed + 1, dev)  # [B, L] adapter indices
    slots = st.mm.slot_routing(Routing(aid), aid.shape)[0]  # [T, 1] bank slots
    per_req = [st.names[b % K] for b in range(batch)]
    tokens = ids.reshape(-1)  # [T]
    positions = torch.arange(length, device=dev).repeat(batch)  # [T]
    meta = _runner_meta(batch, length, length, st.blocks_per_seq)
    kw = dict(logits_to_keep=1, use_cache=False)
    fns: dict[str, Callable[[], Any]] = {
        "base": lambda: st.base(input_ids=ids, **kw),
        "molora": lambda: st.mm(ids, adapter_ids=aid, **kw),
        "runner_base": lambda: st.runner.forward(tokens, positions, meta, None, logits=True),
        "runner": lambda: st.runner.forward(tokens, positions, meta, StepRouting(slot_ids=slots), logits=True),
        "peft_mixed": lambda: st.peft(input_ids=ids, adapter_names=per_req, **kw),
        "peft_single": lambda: st.peft(input_ids=ids, **kw),  # its active adapter: the first
        "kpass": lambda: [st.mm(ids, adapter_ids=n, **kw) for n in st.names],
    }
    if st.xlora is not None:
        fns["xlora"] = lambda: st.xlora(input_ids=ids, **kw)
    if st.base_bf16 is not None:
        fns["base_bf16"] = lambda: st.base_bf16(input_ids=ids, **kw)
        fns["molora_bf16"] = lambda: st.mm_bf16(ids, adapter_ids=aid, **kw)
    return fns


def _kv_cache(model: nn.Module, batch: int, ctx: int, seed: int) -> Any:
    """A DynamicCache already holding `ctx` random K/V rows per layer (their values do not change the time)."""
    from transformers import DynamicCache

    cfg = model.config
    hd = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    dtype = next(model.parameters()).dtype
    g = torch.Generator().manual_seed(seed)
    cache = DynamicCache(config=cfg)
    for layer in range(cfg.num_hidden_layers):
        kv = torch.randn(2, batch, cfg.num_key_value_heads, ctx, hd, generator=g).to(device_of(model), dtype)
        cache.update(kv[0], kv[1], layer)
    return cache


def decode_fns(
    st: Stack, batch: int, ctx: int, seed: int = 0, *, xlora: bool = True
) -> tuple[dict[str, Callable[[], Any]], dict[str, Callable[[], Any]]]:
    """(fns, resets): one decode step of `batch` sequences holding `ctx` cached tokens each. Each HF cache
    is cropped back to ctx after every call (untimed), so every sample decodes at the same length."""
    from molora.model.batch import StepRouting

    vocab, K, dev = st.base.config.vocab_size, len(st.names), device_of(st.base)
    nxt = torch.randint(0, vocab, (batch, 1), generator=torch.Generator().manual_seed(seed)).to(dev)
    aid = _random_routing((batch, 1), K, seed + 1, dev)
    slots = st.mm.slot_routing(Routing(aid), aid.shape)[0]  # [B, 1]
    per_req = [st.names[b % K] for b in range(batch)]
    positions = torch.full((batch,), ctx, device=dev)
    meta = _runner_meta(batch, 1, ctx + 1, st.blocks_per_seq)
    caches = {n: _kv_cache(st.base, batch, ctx, seed) for n in ("base", "molora", "peft_mixed", "peft_single", "kpass")}
    kw = dict(logits_to_keep=1, use_cache=True)

    def kpass() -> None:
        for n in st.names:  # K steps, each one adapter over every sequence
            st.mm(nxt, adapter_ids=n, cache=caches["kpass"], **kw)
            caches["kpass"].crop(-1)

    fns: dict[str, Callable[[], Any]] = {
        "base": lambda: st.base(input_ids=nxt, cache=caches["base"], **kw),
        "molora": lambda: st.mm(nxt, adapter_ids=aid, cache=caches["molora"], **kw),
        "runner_base": lambda: st.runner.forward(nxt.reshape(-1), positions, meta, None, logits=True),
        "runner": lambda: st.runner.forward(nxt.reshape(-1), positions, meta, StepRouting(slot_ids=slots), logits=True),
        "peft_mixed": lambda: st.peft(input_ids=nxt, adapter_names=per_req, cache=caches["peft_mixed"], **kw),
        "peft_single": lambda: st.peft(input_ids=nxt, cache=caches["peft_single"], **kw),
        "kpass": kpass,
    }
    if st.base_bf16 is not None:
        caches["base_bf16"] = _kv_cache(st.base_bf16, batch, ctx, seed)
        caches["molora_bf16"] = _kv_cache(st.base_bf16, batch, ctx, seed)
        fns["base_bf16"] = lambda: st.base_bf16(input_ids=nxt, cache=caches["base_bf16"], **kw)
        fns["molora_bf16"] = lambda: st.mm_bf16(nxt, adapter_ids=aid, cache=caches["molora_bf16"], **kw)
    if xlora and st.xlora is not None:  # no KV cache in PEFT X-LoRA: one new token costs a forward over ctx + 1 tokens
        full = torch.randint(0, vocab, (batch, ctx + 1), generator=torch.Generator().manual_seed(seed + 2)).to(dev)
        fns["xlora_recompute"] = lambda: st.xlora(input_ids=full, logits_to_keep=1)
    resets = {n: (lambda c=c: c.crop(-1)) for n, c in caches.items() if n != "kpass"}
    return fns, resets


def kmodality_fns(
    mm: MoLoRAModel, base: nn.Module, K: int, batch: int, length: int, segment: int, seed: int = 0
) -> dict[str, Callable[[], Any]]:
    """Sequences alternating K vocab-routed modalities: per-token (one pass, the VocabRouter decides)
    against per-sequence emulation (K passes, one adapter each over all tokens), plus the base."""
    from molora.routing import VocabRouter

    vocab = base.config.vocab_size
    span = vocab // K
    names = mm.adapter_names[:K]
    router = VocabRouter([(i * span, (i + 1) * span, names[i]) for i in range(K)])
    g = torch.Generator().manual_seed(seed)
    pos = torch.arange(length)
    modality = (pos[None, :] // segment + torch.arange(batch)[:, None]) % K  # [B, L]
    ids = (modality * span + torch.randint(0, span, (batch, length), generator=g)).to(device_of(base))  # [B, L]
    kw = dict(logits_to_keep=1, use_cache=False)
    return {
        "base": lambda: base(input_ids=ids, **kw),
        "per_token": lambda: mm(ids, adapter_ids=router, **kw),
        "per_sequence": lambda: [mm(ids, adapter_ids=n, **kw) for n in names],
    }
