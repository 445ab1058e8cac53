"""The tiny early-fusion base: a Llama-architecture model over the 46-token text+image vocabulary.

    hidden 192, 4 layers, 4 heads, FFN 768, untied head: 2.38M parameters (4.8 MB in fp16)

`train_base` trains it from scratch on interleaved digit sequences (molora.multimodal.vocab: base_sequences)
with AdamW and a cosine schedule, seeded and single-threaded, and writes a plain transformers folder
(config.json, model.safetensors in fp16, tokenizer.json): `molora.model.base.load_base(folder)` and
AutoModelForCausalLM load it like any other base. It knows nothing of adapters or routing.
"""

from __future__ import annotations

import json
import logging
import math
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from molora.multimodal.vocab import Digits, base_sequences, build_tokenizer, vocabulary

log = logging.getLogger("molora.multimodal")


def tiny_config(
    vocab_size: int | None = None,
    *,
    hidden: int = 192,
    layers: int = 4,
    heads: int = 4,
    ffn: int = 768,
    max_positions: int = 160,
) -> Any:
    from transformers import LlamaConfig

    tok = vocabulary()
    return LlamaConfig(
        vocab_size=vocab_size or len(tok),
        hidden_size=hidden,
        intermediate_size=ffn,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=heads,
        max_position_embeddings=max_positions,
        tie_word_embeddings=False,
        bos_token_id=tok.index("<bos>"),
        eos_token_id=tok.index("<eos>"),
        pad_token_id=tok.index("<pad>"),
        rms_norm_eps=1e-5,
    )


def batch_ids(tokenizer: Any, texts: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
    """(ids [B, L], labels [B, L]) right-padded; labels -100 on padding."""
    rows = [tokenizer(t, add_special_tokens=False)["input_ids"] for t in texts]
    L = max(len(r) for r in rows)
    ids = torch.full((len(rows), L), tokenizer.pad_token_id, dtype=torch.long)
    labels = torch.full((len(rows), L), -100, dtype=torch.long)
    for b, r in enumerate(rows):
        ids[b, : len(r)] = torch.tensor(r)
        labels[b, : len(r)] = torch.tensor(r)
    return ids, labels


def train_base(
    out: str | Path,
    train: Digits,
    *,
    steps: int = 700,
    batch_size: int = 64,
    lr: float = 3e-3,
    seed: int = 0,
    log_every: int = 50,
) -> dict:
    """Train the tiny base from scratch and save it (fp16 weights) with its tokenizer at `out`."""
    from transformers import LlamaForCausalLM

    torch.manual_seed(seed)
    tok = build_tokenizer()
    model = LlamaForCausalLM(tiny_config())
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01, betas=(0.9, 0.95))
    warm = max(1, steps // 20)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min((s + 1) / warm, 0.5 * (1 + math.cos(math.pi * min(1.0, (s - warm) / max(1, steps - warm)))))
    )
    rng = np.random.RandomState(seed)
    pool: list[str] = []
    t0, losses = time.perf_counter(), []
    for step in range(steps):
        if len(pool) < batch_size:
            pool += base_sequences(train, rng)
        texts, pool = pool[:batch_size], pool[batch_size:]
        ids, labels = batch_ids(tok, texts)
        loss = model(input_ids=ids, attention_mask=(labels != -100).long(), labels=labels).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        losses.append(float(loss.detach()))
        if log_every and (step + 1) % log_every == 0:
            log.info(
                "base step %d/%d loss %.4f (%.0f s)",
                step + 1,
                steps,
                np.mean(losses[-log_every:]),
                time.perf_counter() - t0,
            )
    out = Path(out)
    model.eval()
    model.half().save_pretrained(str(out))
    tok.save_pretrained(str(out))
    stats = {
        "steps": steps,
        "batch_size": batch_size,
        "lr": lr,
        "seed": seed,
        "parameters": sum(p.numel() for p in model.parameters()),
        "seconds": round(time.perf_counter() - t0, 1),
        "final_loss": round(float(np.mean(losses[-50:])), 4),
    }
    (out / "training_stats.json").write_text(json.dumps(stats, indent=2) + "\n")
    return stats
