"""Shared fixtures: tiny random Qwen3 / Llama models and PEFT adapters made by PEFT itself."""

from __future__ import annotations

import copy
import importlib.util
import sys
from pathlib import Path

import pytest
import torch

VOCAB = 128
ROOT = Path(__file__).resolve().parent.parent


def load_script(name: str):
    """scripts/<name>.py as a module, registered in sys.modules under `name` (a script's dataclasses look their
    module up there)."""
    spec = importlib.util.spec_from_file_location(name, ROOT / "scripts" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def tiny_config(arch: str):
    from transformers import LlamaConfig, Qwen3Config

    common = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                  pad_token_id=0, eos_token_id=1, bos_token_id=2)
    if arch == "qwen3":
        return Qwen3Config(head_dim=16, tie_word_embeddings=False, **common)
    if arch == "llama":
        return LlamaConfig(tie_word_embeddings=True, **common)
    raise ValueError(arch)


_MODELS: dict[str, torch.nn.Module] = {}


def tiny_model(arch: str = "qwen3") -> torch.nn.Module:
    """A fresh fp32 copy of the tiny random model of `arch` (same weights every call)."""
    from transformers import AutoModelForCausalLM

    if arch not in _MODELS:
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(tiny_config(arch), dtype=torch.float32)
        model.eval()
        _MODELS[arch] = model
    return copy.deepcopy(_MODELS[arch])


def make_peft_adapter(path: Path, arch: str, *, r: int = 4, alpha: float = 8, targets=("q_proj", "v_proj"),
                      rslora: bool = False, seed: int = 0, **extra) -> Path:
    """Save a PEFT LoRA folder with random (non-zero) A and B for the tiny model of `arch`."""
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(seed)
    cfg = LoraConfig(r=r, lora_alpha=alpha, target_modules=list(targets), use_rslora=rslora,
                     init_lora_weights=False, task_type="CAUSAL_LM", **extra)
    peft_model = get_peft_model(tiny_model(arch), cfg)
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_" in name:
                p.normal_(0, 0.2)
    peft_model.save_pretrained(str(path))
    return path


def tiny_tokenizer():
    """A word-level fast tokenizer over VOCAB ids: "w3 w17" -> [3, 17]; ids 0-2 are pad/eos/bos."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "<|im_end|>": 1, "<s>": 2, **{f"w{i}": i for i in range(3, VOCAB)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<|im_end|>",
                                   bos_token="<s>", unk_token="<pad>")


@pytest.fixture(params=["qwen3", "llama"])
def arch(request) -> str:
    return request.param
