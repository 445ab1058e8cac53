"""`molora train-adapter`: train one focused LoRA on a JSONL file and write a standard PEFT folder.

Examples are `{"prompt", "completion"}` or chat `{"messages": [...]}` (the last assistant message is the
completion). Each is rendered with the bundle's prompt template; the loss covers only the completion and
the end-of-turn token (the pad token is the EOS token, so masking is by labels and attention, never by pad
id, or the model would never learn to stop). The adapter is trained with PEFT itself, so the folder is
exactly what PEFT saves. Seeded: the same data, config and seed give the same adapter.
"""

from __future__ import annotations

import json
import logging
import math
import random
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from molora.bundle import CHATML_TEMPLATE, END_OF_TURN, turn_text
from molora.config import LLAMA_PROJECTIONS
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
    bf16: bool = True          # frozen base in bf16, LoRA weights fp32
    warmup: float = 0.05

    def __post_init__(self) -> None:
        if self.rank < 1 or self.batch_size < 1 or self.epochs <= 0 or self.lr <= 0:
            raise MoLoRAError(f"bad training config {self}: rank, batch_size, epochs and lr must be positive")


def read_examples(path: str | Path) -> list[tuple[str, str]]:
    """(prompt, completion) pairs from a JSONL file; a bad line is an error naming the line."""
    out = []
    path = Path(path)
    try:
        lines = path.read_text().splitlines()
    except OSError as e:
        raise MoLoRAError(f"cannot read training data {path}: {e}") from e
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
            out.append(_as_pair(row))
        except (json.JSONDecodeError, KeyError, TypeError, ValueError) as e:
            raise MoLoRAError(f"{path}:{n}: expected {{\"prompt\",\"completion\"}} or {{\"messages\":[...]}} "
                              f"({e})") from e
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


def tokenize_pairs(tokenizer: Any, pairs: Sequence[tuple[str, str]], template: str = CHATML,
                   max_len: int = 256) -> list[tuple[list[int], int]]:
    """(ids, prompt_len) per example: template(prompt) + completion + END, truncated to max_len."""
    out = []
    for prompt, completion in pairs:
        p = tokenizer(turn_text(template, prompt), add_special_tokens=False)["input_ids"]
        c = tokenizer(completion + END, add_special_tokens=False)["input_ids"]
        out.append(((p + c)[:max_len], len(p)))
    return out


def batches(encoded: list[tuple[list[int], int]], batch_size: int, rng: random.Random,
            pad_id: int) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """Length-bucketed, shuffled batches of (ids [B, L], attention [B, L], labels [B, L]); -100 = no loss."""
    order = sorted(range(len(encoded)), key=lambda i: (len(encoded[i][0]), rng.random()))
    groups = [order[i:i + batch_size] for i in range(0, len(order), batch_size)]
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
            lab[row, plen: len(seq)] = torch.tensor(seq[plen:])
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


def train_adapter(model: Any, tokenizer: Any, pairs: Sequence[tuple[str, str]], out_dir: str | Path,
                  config: AdapterTrainConfig = AdapterTrainConfig(), *, template: str = CHATML,
                  progress: bool = True) -> dict:
    """Train a LoRA on `model` (modified in place by PEFT) and save a PEFT folder at out_dir."""
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(config.seed)
    rng = random.Random(config.seed)
    lcfg = LoraConfig(r=config.rank, lora_alpha=config.alpha, target_modules=list(config.target_modules),
                      lora_dropout=0.0, bias="none", task_type="CAUSAL_LM")
    if config.bf16:
        model = model.to(torch.bfloat16)  # base in bf16 (fast matmuls on avx512_bf16); LoRA weights stay fp32
    pm = get_peft_model(model, lcfg, autocast_adapter_dtype=True)
    pm.train()
    encoded = tokenize_pairs(tokenizer, pairs, template, config.max_len)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    epochs = math.ceil(config.epochs)
    plan = [b for e in range(epochs) for b in batches(encoded, config.batch_size, rng, pad)]
    plan = plan[: max(1, round(len(plan) * config.epochs / epochs))]
    params = [p for p in pm.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=config.lr, weight_decay=0.0)
    warm = max(1, int(config.warmup * len(plan)))
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min((s + 1) / warm, 0.5 * (1 + math.cos(math.pi * min(1.0, (s - warm) / max(1, len(plan) - warm))))))
    t0, tokens, losses = time.perf_counter(), 0, []
    bar = tqdm(plan, desc=f"train {Path(out_dir).name}", disable=not progress, unit="batch")
    base = pm.get_base_model()
    dev = next(base.parameters()).device
    for ids, att, lab in bar:
        loss = completion_loss(base, ids.to(dev), att.to(dev), lab.to(dev))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        tokens += int(att.sum())
        losses.append(float(loss))
        bar.set_postfix(loss=f"{sum(losses[-20:]) / len(losses[-20:]):.3f}",
                        tok_s=f"{tokens / (time.perf_counter() - t0):.0f}")
    pm.eval()
    out_dir = Path(out_dir)
    pm.save_pretrained(str(out_dir))
    stats = {"examples": len(pairs), "steps": len(plan), "tokens": tokens,
             "seconds": round(time.perf_counter() - t0, 1), "final_loss": round(sum(losses[-20:]) / max(1, len(losses[-20:])), 4),
             "config": asdict(config)}
    (out_dir / "training_stats.json").write_text(json.dumps(stats, indent=2) + "\n")
    return stats
