"""`molora train-adapter`: train one focused LoRA on a JSONL file and write a standard PEFT folder.

Examples are `{"prompt", "completion"}` or chat `{"messages": [...]}` (the last assistant message is the
completion). Each is rendered with the bundle's prompt template; the loss covers only the completion and
the end-of-turn token (the pad token is the EOS token, so masking is by labels and attention, never by pad
id, or the model would never learn to stop). The adapter is trained with PEFT itself, so the folder is
exactly what PEFT saves. Seeded: the same data, config and seed give the same adapter.

`train_routed` trains several adapters at once under a router (each token's delta from the adapter its
router picks, as at inference): the adapters sit in molora's own bank (`molora.attach`) with their slot
tensors made trainable, and each is written back as a PEFT folder. Adapters that will be routed together
couple through attention; training them under the same routing as inference lets them learn to read each
other's keys and values (docs: the multimodal section).
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import random
import time
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from molora.bundle import CHATML_TEMPLATE, END_OF_TURN, turn_text
from molora.config import LLAMA_PROJECTIONS
from molora.data.jsonl import iter_jsonl
from molora.errors import MoLoRAError

log = logging.getLogger("molora.train")

CHATML = CHATML_TEMPLATE
END = END_OF_TURN


@dataclass(frozen=True)
class AdapterTrainConfig:
    rank: int = 16
    alpha: float = 32.0
    target_modules: tuple[str, ...] = LLAMA_PROJECTIONS
    lr: float = 1e-3
    epochs: float = 1.0
    batch_size: int = 16
    max_len: int = 256
    seed: int = 0
    bf16: bool = True  # frozen base in bf16, LoRA weights fp32
    warmup: float = 0.05

    def __post_init__(self) -> None:
        if self.rank < 1 or self.batch_size < 1 or self.epochs <= 0 or self.lr <= 0:
            raise MoLoRAError(f"bad training config {self}: rank, batch_size, epochs and lr must be positive")


def read_examples(path: str | Path) -> list[tuple[str, str]]:
    """(prompt, completion) pairs from a JSONL file; a bad line is an error naming the line."""
    out = []
    path = Path(path)
    for n, row in iter_jsonl(path, error=MoLoRAError):
        try:
            out.append(_as_pair(row))
        except (KeyError, TypeError, ValueError) as e:
            raise MoLoRAError(f'{path}:{n}: expected {{"prompt","completion"}} or {{"messages":[...]}} ({e})') from e
    if not out:
        raise MoLoRAError(f"{path}: no examples")
    return out


def _as_pair(row: dict) -> tuple[str, str]:
    if "messages" in row:
        msgs = row["messages"]
        if not msgs or msgs[-1]["role"] != "assistant":
            raise ValueError("the last message must be the assistant's")
        prompt = "\n".join(m["content"] for m in msgs[:-1] if m["role"] != "system")
        return prompt, msgs[-1]["content"]
    return str(row["prompt"]), str(row["completion"])


def tokenize_pairs(
    tokenizer: Any, pairs: Sequence[tuple[str, str]], template: str = CHATML, max_len: int = 256, end: str = END
) -> list[tuple[list[int], int]]:
    """(ids, prompt_len) per example: template(prompt) + completion + end, truncated to max_len."""
    out = []
    for prompt, completion in pairs:
        p = tokenizer(turn_text(template, prompt), add_special_tokens=False)["input_ids"]
        c = tokenizer(completion + end, add_special_tokens=False)["input_ids"]
        out.append(((p + c)[:max_len], len(p)))
    return out


def batches(
    encoded: list[tuple[list[int], int]], batch_size: int, rng: random.Random, pad_id: int
) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """Length-bucketed, shuffled batches of (ids [B, L], attention [B, L], labels [B, L]); -100 = no loss."""
    order = sorted(range(len(encoded)), key=lambda i: (len(encoded[i][0]), rng.random()))
    groups = [order[i : i + batch_size] for i in range(0, len(order), batch_size)]
    rng.shuffle(groups)
    out = []
    for g in groups:
        L = max(len(encoded[i][0]) for i in g)
        ids = torch.full((len(g), L), pad_id, dtype=torch.long)
        att = torch.zeros((len(g), L), dtype=torch.long)
        lab = torch.full((len(g), L), -100, dtype=torch.long)
        for row, i in enumerate(g):
            seq, plen = encoded[i]
            ids[row, : len(seq)] = torch.tensor(seq)
            att[row, : len(seq)] = 1
            lab[row, plen : len(seq)] = torch.tensor(seq[plen:])
        out.append((ids, att, lab))
    return out


def completion_loss(model: Any, ids: torch.Tensor, att: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Next-token loss on labelled positions only: the vocabulary projection runs on those rows alone
    (completions are a few tokens of a ~100-token sequence; full logits would dominate the cost)."""
    hidden = model.model(input_ids=ids, attention_mask=att).last_hidden_state  # [B, L, D]
    target = labels[:, 1:]
    keep = target != -100
    logits = model.lm_head(hidden[:, :-1][keep])  # [N, V]
    return torch.nn.functional.cross_entropy(logits.float(), target[keep])


def train_adapter(
    model: Any,
    tokenizer: Any,
    pairs: Sequence[tuple[str, str]],
    out_dir: str | Path,
    config: AdapterTrainConfig = AdapterTrainConfig(),
    *,
    template: str = CHATML,
    end: str = END,
    progress: bool = True,
) -> dict:
    """Train a LoRA on `model` (modified in place by PEFT) and save a PEFT folder at out_dir. `end` closes
    every completion (the bundle's stop token; ChatML's end of turn by default)."""
    try:
        from peft import LoraConfig, get_peft_model
    except ImportError as e:
        raise MoLoRAError("training an adapter needs PEFT: pip install 'molora[train]'") from e

    torch.manual_seed(config.seed)
    lcfg = LoraConfig(
        r=config.rank,
        lora_alpha=config.alpha,
        target_modules=list(config.target_modules),
        lora_dropout=0.0,
        bias="none",
        task_type="CAUSAL_LM",
    )
    if config.bf16:
        model = model.to(torch.bfloat16)  # base in bf16 (fast matmuls on avx512_bf16); LoRA weights stay fp32
    pm = get_peft_model(model, lcfg, autocast_adapter_dtype=True)
    pm.train()
    base = pm.get_base_model()
    stats = _fit(
        base,
        [p for p in pm.parameters() if p.requires_grad],
        tokenizer,
        pairs,
        config,
        template,
        end,
        Path(out_dir).name,
        progress,
    )
    pm.eval()
    out_dir = Path(out_dir)
    pm.save_pretrained(str(out_dir))
    stats = {"examples": len(pairs), **stats, "config": asdict(config)}
    (out_dir / "training_stats.json").write_text(json.dumps(stats, indent=2) + "\n")
    return stats


def _fit(
    model: Any,
    params: list[torch.Tensor],
    tokenizer: Any,
    pairs: Sequence[tuple[str, str]],
    config: AdapterTrainConfig,
    template: str,
    end: str,
    label: str,
    progress: bool,
    routed: Any = None,
) -> dict:
    """The training loop both paths share: seeded batches, AdamW with warmup and cosine decay, the completion
    loss. `routed(ids)` (or None) is a context manager that routes one batch (train_routed)."""
    rng = random.Random(config.seed)
    encoded = tokenize_pairs(tokenizer, pairs, template, config.max_len, end)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    epochs = math.ceil(config.epochs)
    plan = [b for e in range(epochs) for b in batches(encoded, config.batch_size, rng, pad)]
    plan = plan[: max(1, round(len(plan) * config.epochs / epochs))]
    opt = torch.optim.AdamW(params, lr=config.lr, weight_decay=0.0)
    warm = max(1, int(config.warmup * len(plan)))
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt,
        lambda s: min((s + 1) / warm, 0.5 * (1 + math.cos(math.pi * min(1.0, (s - warm) / max(1, len(plan) - warm))))),
    )
    t0, c0, tokens, losses = time.perf_counter(), time.process_time(), 0, []
    bar = tqdm(plan, desc=f"train {label}", disable=not progress, unit="batch")
    dev = next(model.parameters()).device
    for ids, att, lab in bar:
        ids, att, lab = ids.to(dev), att.to(dev), lab.to(dev)
        with routed(ids) if routed is not None else contextlib.nullcontext():
            loss = completion_loss(model, ids, att, lab)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        tokens += int(att.sum())
        losses.append(float(loss.detach()))
        bar.set_postfix(
            loss=f"{sum(losses[-20:]) / len(losses[-20:]):.3f}", tok_s=f"{tokens / (time.perf_counter() - t0):.0f}"
        )
    # cpu_seconds: this process's CPU time over all its threads (the CPU-minutes a CPU-only user pays; unlike
    # the wall time it hardly moves when other jobs share the machine)
    return {
        "steps": len(plan),
        "tokens": tokens,
        "seconds": round(time.perf_counter() - t0, 1),
        "cpu_seconds": round(time.process_time() - c0, 1),
        "final_loss": round(sum(losses[-20:]) / max(1, len(losses[-20:])), 4),
    }


def train_routed(
    model: Any,
    tokenizer: Any,
    pairs: Sequence[tuple[str, str]],
    out_dirs: Mapping[str, str | Path],
    router: Any,
    config: AdapterTrainConfig = AdapterTrainConfig(bf16=False),
    *,
    template: str = CHATML,
    end: str = END,
    progress: bool = True,
) -> dict:
    """Train the adapters named by `out_dirs` (name -> folder) together on `model` (modified in place: its
    linears become routed), each token's delta from the adapter `router` picks, and save each as a PEFT
    folder. The adapters start as PEFT starts a LoRA (A Kaiming-uniform, B zero) and train in the model's
    dtype (keep it float32: the bank holds the LoRA weights in that dtype; config.bf16 is not used)."""
    from molora.adapters.io import save_adapter
    from molora.model.attach import attach

    torch.manual_seed(config.seed)
    model.requires_grad_(False)
    shapes = {
        n: (m.out_features, m.in_features)
        for n, m in model.named_modules()
        if isinstance(m, torch.nn.Linear) and n.rsplit(".", 1)[-1] in config.target_modules
    }
    if not shapes:
        raise MoLoRAError(f"no linear of the model matches target_modules={list(config.target_modules)}")
    meta = getattr(model, "name_or_path", None) or None
    for out in out_dirs.values():  # initial folders: what PEFT's get_peft_model would start from
        init = {}
        for m, (d_out, d_in) in sorted(shapes.items()):
            a = torch.empty(config.rank, d_in)
            torch.nn.init.kaiming_uniform_(a, a=math.sqrt(5))
            init[m] = (a, torch.zeros(d_out, config.rank))
        save_adapter(out, init, r=config.rank, lora_alpha=config.alpha, base_model_name_or_path=meta)
    mm = attach(
        model, {n: Path(p) for n, p in out_dirs.items()}, slots=len(out_dirs), max_rank=config.rank, check_base=False
    )
    params = []
    for slots in mm.bank.slots.values():  # A [S, R, d_in] and Bt [S, R, d_out]: every slot is an adapter
        params += [slots.A.requires_grad_(True), slots.Bt.requires_grad_(True)]
    mm.train()
    stats = _fit(
        mm.model,
        params,
        tokenizer,
        pairs,
        config,
        template,
        end,
        "+".join(out_dirs),
        progress,
        routed=lambda ids: mm.routed(ids, router),
    )
    mm.eval()
    for slots in mm.bank.slots.values():
        slots.A.requires_grad_(False)
        slots.Bt.requires_grad_(False)
    for name, out in out_dirs.items():
        s = mm.bank.slot_of(name)
        save_adapter(
            out,
            {m: (sl.A[s], sl.B[s]) for m, sl in mm.bank.slots.items()},
            r=config.rank,
            lora_alpha=config.alpha,
            base_model_name_or_path=meta,
        )
        stats_out = {"examples": len(pairs), **stats, "trained_with": sorted(out_dirs), "config": asdict(config)}
        (Path(out) / "training_stats.json").write_text(json.dumps(stats_out, indent=2) + "\n")
    return stats
