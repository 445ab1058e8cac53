"""Shared fixtures: tiny random Qwen3 / Llama models and PEFT adapters made by PEFT itself.

Every random tensor a fixture makes is drawn from its own `torch.Generator(seed)` (`gen`), never from the
process-wide RNG: a model's or an adapter's weights, and so every greedy output the tests compare, are the same
whichever tests ran before (the suite also runs in a random order in CI, .ci/run). Constructors that draw their
initial weights from the process RNG (transformers' `from_config`, PEFT's LoRA init) run inside `private_rng()`,
which leaves the process RNG as it found it, and their weights are then overwritten from a generator."""

from __future__ import annotations

import copy
import importlib
from pathlib import Path

import pytest
import torch

VOCAB = 128
ROOT = Path(__file__).resolve().parent.parent


def load_script(name: str):
    """tools/<name>.py or experiments/<name>.py, imported as a module of its package (the repository root is on
    sys.path under pytest, as it is for `python -m tools.<name>`)."""
    package = "tools" if (ROOT / "tools" / f"{name}.py").is_file() else "experiments"
    return importlib.import_module(f"{package}.{name}")


def tiny_config(arch: str):
    from transformers import LlamaConfig, Qwen3Config

    common = dict(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        pad_token_id=0,
        eos_token_id=1,
        bos_token_id=2,
    )
    if arch == "qwen3":
        return Qwen3Config(head_dim=16, tie_word_embeddings=False, **common)
    if arch == "llama":
        return LlamaConfig(tie_word_embeddings=True, **common)
    raise ValueError(arch)


def gen(seed: int = 0) -> torch.Generator:
    """A CPU generator of its own, seeded: what every random draw in the tests takes (`generator=gen(...)`)."""
    return torch.Generator().manual_seed(seed)


def private_rng():
    """A context in which code that draws from the process RNG may run without changing it for anyone else (the
    state is restored on exit); what it draws there is not to be relied on: overwrite it from a generator."""
    return torch.random.fork_rng(devices=[])


def init_weights(model: torch.nn.Module, seed: int = 0) -> torch.nn.Module:
    """Overwrite every parameter of a transformers model from `gen(seed)`, in `named_parameters` order, by
    transformers' own init rule: linear and embedding weights N(0, initializer_range), biases 0, norm weights 1, an
    embedding's padding row 0. Returns the model (eval mode)."""
    g = gen(seed)
    std = getattr(model.config, "initializer_range", None) or 0.02
    with torch.no_grad():
        for name, p in model.named_parameters():  # tied weights appear once
            if name.endswith("bias"):
                p.zero_()
            elif p.dim() == 1:  # RMSNorm / LayerNorm weights
                p.fill_(1.0)
            else:
                p.normal_(0.0, std, generator=g)
        for m in model.modules():
            if isinstance(m, torch.nn.Embedding) and m.padding_idx is not None:
                m.weight[m.padding_idx].zero_()
    return model.eval()


def random_model(config, seed: int = 0, cls=None) -> torch.nn.Module:
    """A float32 transformers model of `config` (`cls(config)`, or AutoModelForCausalLM) with weights from
    `gen(seed)` (`init_weights`); the process RNG is left as it was."""
    from transformers import AutoModelForCausalLM

    with private_rng():
        model = cls(config) if cls is not None else AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    return init_weights(model.float(), seed)


_MODELS: dict[str, torch.nn.Module] = {}


def tiny_model(arch: str = "qwen3") -> torch.nn.Module:
    """A fresh fp32 copy of the tiny random model of `arch` (the same weights in every call and every process,
    whatever ran before: `random_model(..., seed=0)`)."""
    if arch not in _MODELS:
        _MODELS[arch] = random_model(tiny_config(arch), seed=0)
    return copy.deepcopy(_MODELS[arch])


def make_peft_adapter(
    path: Path,
    arch: str,
    *,
    r: int = 4,
    alpha: float = 8,
    targets=("q_proj", "v_proj"),
    rslora: bool = False,
    seed: int = 0,
    **extra,
) -> Path:
    """Save a PEFT LoRA folder with random (non-zero) A and B for the tiny model of `arch`, drawn from `gen(seed)`
    alone (the same adapter whatever ran before)."""
    from peft import LoraConfig, get_peft_model

    cfg = LoraConfig(
        r=r,
        lora_alpha=alpha,
        target_modules=list(targets),
        use_rslora=rslora,
        init_lora_weights=False,
        task_type="CAUSAL_LM",
        **extra,
    )
    with private_rng():  # PEFT's own (overwritten) init draws from the process RNG
        peft_model = get_peft_model(tiny_model(arch), cfg)
    g = gen(seed)
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_" in name:
                p.normal_(0, 0.2, generator=g)
    peft_model.save_pretrained(str(path))
    return path


def tiny_tokenizer():
    """A word-level fast tokenizer over VOCAB ids: "w3 w17" -> [3, 17]; ids 0-2 are pad/eos/bos."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "<|im_end|>": 1, "<s>": 2, **{f"w{i}": i for i in range(3, VOCAB)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="<pad>", eos_token="<|im_end|>", bos_token="<s>", unk_token="<pad>"
    )


def save_eos_prone_base(folder) -> None:
    """A tiny Llama and its tokenizer saved in `folder`, whose base model ends a turn (eos, id 1) often: eos's row of
    the head along the mean final state, so eos takes about a fifth of each step (the data-free choosers' pools)."""
    model = tiny_model("llama")
    with torch.no_grad():
        ids = torch.randint(3, 128, (4, 12), generator=torch.Generator().manual_seed(0))
        mu = model.model(ids).last_hidden_state.mean((0, 1))
        model.lm_head.weight[1] = mu / mu.norm() * 1.5
    model.save_pretrained(str(folder))
    tiny_tokenizer().save_pretrained(str(folder))


@pytest.fixture(params=["qwen3", "llama"])
def arch(request) -> str:
    return request.param


@pytest.fixture
def panels_where_built(monkeypatch):
    """Pack float32 weights for molora's panel GEMM wherever the kernels are built, also on a CPU without AVX-512
    where the library packs them for MKL instead (the kernel computes the same there, only slower): the tests of
    the panel-packed paths run on every machine."""
    from molora.ops import fused_cpu, kernel_build

    monkeypatch.setattr(
        fused_cpu, "panels_ready", lambda: kernel_build.ready() is not None and not kernel_build.off("panels")
    )
