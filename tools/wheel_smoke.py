"""From a fresh venv holding only the built wheel (and the openai client): make a tiny random Llama folder and a
PEFT-format adapter, start `molora serve --model ... --lora-modules ...`, and answer the openai client.

Run by .ci/wheel_check.sh as `VENV/bin/python -I wheel_smoke.py WORKDIR` from a copy outside the repository
(-I: isolated, so nothing is imported from the checkout). Exits non-zero on any failure.
"""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import time
from pathlib import Path


def make_model(folder: Path) -> None:
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import AutoModelForCausalLM, LlamaConfig, PreTrainedTokenizerFast

    cfg = LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=128,
        pad_token_id=0,
        eos_token_id=1,
        bos_token_id=2,
    )
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.1)
    model.save_pretrained(str(folder))
    vocab = {"<pad>": 0, "</s>": 1, "<s>": 2, **{f"w{i}": i for i in range(3, 64)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="<pad>", eos_token="</s>", bos_token="<s>", unk_token="<pad>"
    )
    fast.chat_template = "{% for m in messages %}w3 {{ m['content'] }} w4 {% endfor %}w5"
    fast.save_pretrained(str(folder))


def make_adapter(folder: Path, seed: int) -> None:
    import torch

    from molora.adapters.io import save_adapter

    g = torch.Generator().manual_seed(seed)
    mods = {
        f"model.layers.{i}.self_attn.{m}": (torch.randn(4, 32, generator=g), torch.randn(d, 4, generator=g))
        for i in range(2)
        for m, d in (("q_proj", 32), ("v_proj", 16))
    }
    save_adapter(folder, mods, r=4, lora_alpha=8)


def main(work: Path) -> int:
    import openai

    make_model(work / "tiny")
    make_adapter(work / "adapters" / "a", 1)
    make_adapter(work / "adapters" / "b", 2)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    molora = Path(sys.executable).parent / "molora"
    cmd = [
        str(molora),
        "serve",
        "--model",
        str(work / "tiny"),
        "--lora-modules",
        f"a={work / 'adapters' / 'a'}",
        "--port",
        str(port),
        "--adapter-root",
        str(work / "adapters"),
        "--max-model-len",
        "96",
    ]
    server = subprocess.Popen(cmd, cwd=work)
    try:
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="x", max_retries=0)
        deadline = time.monotonic() + 300
        while True:
            try:
                ids = [m.id for m in client.models.list()]
                break
            except openai.APIConnectionError:
                if server.poll() is not None or time.monotonic() > deadline:
                    raise SystemExit(f"the server did not come up (exit code {server.poll()})") from None
                time.sleep(1)
        print("models:", ids)
        assert ids == [str(work / "tiny"), "a"], ids
        out = client.completions.create(model="a", prompt="w10 w11 w12", max_tokens=6, temperature=0)
        print("completion (a):", out.choices[0].text, out.usage)
        chat = client.chat.completions.create(
            model=str(work / "tiny"), max_tokens=4, messages=[{"role": "user", "content": "w20 w21"}]
        )
        print("chat (base):", chat.choices[0].message.content)
        import urllib.request

        req = urllib.request.Request(
            f"http://127.0.0.1:{port}/v1/load_lora_adapter",
            method="POST",
            data=json.dumps({"lora_name": "b", "lora_path": "b"}).encode(),
            headers={"Content-Type": "application/json"},
        )
        print("load_lora_adapter:", urllib.request.urlopen(req).read().decode())
        out = client.completions.create(model="b", prompt="w10 w11 w12", max_tokens=6, temperature=0)
        print("completion (b):", out.choices[0].text)
        print("wheel smoke: OK")
        return 0
    finally:
        server.terminate()
        server.wait(30)


if __name__ == "__main__":
    sys.exit(main(Path(sys.argv[1]).resolve()))
