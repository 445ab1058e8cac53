"""The whole path of molora in one file: a bundle, a prompt, per-token routing, the engine's steps, the answer.

    .venv/bin/python examples/walkthrough.py ["your prompt"]

Runs on the embedded default bundle (SmolLM2-135M-Instruct with four skill adapters and a learned router; nothing is
downloaded). Each step says which module does the work, so you can open it next.
"""

from __future__ import annotations

import sys

import torch

import molora
from molora.config import SamplingParams
from molora.engine import Engine, EngineConfig
from molora.prompts import encode_prompt, stop_ids


def main(prompt: str) -> None:
    # 1. Load a bundle: the base model, the adapters (PEFT folders) in a fixed-slot bank, the router and the tokenizer
    #    (molora.bundle.load; the bank is molora.adapters.bank, the router molora.routing.learned).
    mm = molora.load()
    print("adapters:", mm.adapter_names, "| router:", type(mm.router).__name__)

    # 2. Turn the prompt into token ids with the bundle's chat template (molora.prompts).
    ids = encode_prompt(mm, prompt)
    print(f"prompt: {len(ids)} tokens")

    # 3. One forward pass outside the engine: the router picks an adapter for every token at every block, and each
    #    routed linear (molora.model.lora_linear.RoutedLoRALinear) adds the delta of that token's adapter only.
    with torch.no_grad():
        logits = mm(torch.tensor([ids])).logits  # [1, T, V]
    print("next token after the prompt:", repr(mm.tokenizer.decode(int(logits[0, -1].argmax()))))

    # 4. The engine: continuous batching over a paged KV cache (molora.engine.engine). It takes token ids and gives
    #    token ids back; sampling parameters follow vLLM's names (molora.config.SamplingParams).
    engine = Engine(mm, EngineConfig(max_num_seqs=4, max_model_len=1024, kv_budget_tokens=4096))
    params = SamplingParams(max_new_tokens=48, stop_token_ids=tuple(stop_ids(mm)))

    # 5. Three requests in one batch: per-token routing (the bundle's router), one adapter pinned for every token, and
    #    the base model alone. They share every step; the dispatch groups tokens by adapter (molora.ops.dispatch).
    asked = {
        engine.add_request(ids, params): "routed per token",
        engine.add_request(ids, params, adapter=mm.adapter_names[0]): f"pinned to {mm.adapter_names[0]}",
        engine.add_request(ids, params, routing="none"): "base model",
    }

    # 6. Step until every request ends. A step schedules prefill chunks and one decode token per running request
    #    (molora.engine.scheduler), runs one forward pass, samples and detokenizes (molora.engine.sampler).
    text = {rid: "" for rid in asked}
    adapters: dict[str, list] = {rid: [] for rid in asked}
    steps = 0
    while engine.has_unfinished():
        for out in engine.step():
            text[out.request_id] += out.new_text
            adapters[out.request_id] += out.token_adapters
        steps += 1
    print(f"{steps} engine steps for {len(asked)} requests\n")

    # 7. The answers, and which adapter wrote each token (None: the base model).
    for rid, what in asked.items():
        used = sorted({a or "base" for a in adapters[rid]})
        print(f"[{what}] adapters used: {used}\n{text[rid].strip()}\n")
    engine.close()


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "How many fruits: an apple, two pears and a banana?")
