"""Prompts through a loaded bundle model (a `MoLoRAModel` from molora.bundle.load), outside the engine.

    ids = encode_prompt(mm, "What is 17 * 23?")          # the bundle's template (or the tokenizer's chat template)
    res = run_prompt(mm, "What is 17 * 23?", trace=True)  # answer text and ids, and each token's adapter
    answers, n = generate_batch(mm, rows, router, max_new, stop_ids(mm))   # greedy, left-padded batch

`run_prompt` and `generate_batch` run transformers-style `MoLoRAModel.generate` (what the CLI's one-off prompts,
evaluation and training-time checks use); serving runs through molora.engine instead. The per-token adapter
traces (`generation_adapters`, `token_adapters`, `trace_forwards`) read the routing decisions a forward records in
`RoutingContext.trace`. Knows a model only through the attributes of `MoLoRAModel` (tokenizer, bundle, router,
generate); nothing of manifests' files, requests or HTTP.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from molora.manifest import END_OF_TURN, Bundle
from molora.routing import Router, SequenceRouter

if TYPE_CHECKING:
    from molora.model.attach import MoLoRAModel


@dataclass
class PromptResult:
    prompt: str
    text: str
    prompt_ids: list[int]
    answer_ids: list[int]
    adapters: list[str | None]  # one per token of prompt_ids + answer_ids


def encode_prompt(mm: MoLoRAModel, prompt: str) -> list[int]:
    """Token ids of `prompt` wrapped in the bundle's template (or the tokenizer's chat template)."""
    tok = mm.tokenizer
    bundle = getattr(mm, "bundle", None)
    if bundle is not None:
        return tok(bundle.format_prompt(prompt), add_special_tokens=False)["input_ids"]
    return tok.apply_chat_template(
        [{"role": "user", "content": prompt}], add_generation_prompt=True, tokenize=True, return_dict=True
    )["input_ids"]


def stop_token_ids(tok: Any, bundle: Bundle | None) -> list[int]:
    """End-of-sequence ids: the tokenizer's eos plus the bundle's stop tokens (ChatML's end without one)."""
    ids = {tok.eos_token_id} if getattr(tok, "eos_token_id", None) is not None else set()
    for s in bundle.stop if bundle is not None else (END_OF_TURN,):
        tid = tok.convert_tokens_to_ids(s)
        if isinstance(tid, int) and tid != getattr(tok, "unk_token_id", None) and tid >= 0:
            ids.add(tid)
    return sorted(ids)


def stop_ids(mm: MoLoRAModel) -> list[int]:
    return stop_token_ids(mm.tokenizer, getattr(mm, "bundle", None))


@torch.no_grad()
def run_prompt(
    mm: MoLoRAModel,
    prompt: str,
    *,
    adapter: str | None = None,
    router: Router | None = None,
    max_new_tokens: int = 128,
    temperature: float = 0.0,
    seed: int | None = None,
    trace: bool = False,
) -> PromptResult:
    """Generate an answer for one prompt; with trace=True also report each token's adapter."""
    ids = torch.tensor([encode_prompt(mm, prompt)], device=mm.device)
    spec = adapter if adapter is not None else (router if router is not None else mm.router)
    gen_spec = spec if spec is not None else SequenceRouter(None)  # no router: the base model
    stops = stop_ids(mm)
    in_network = trace and not isinstance(gen_spec, str) and gen_spec.in_network
    if in_network:
        mm.context.trace = []  # every block's decision in every forward of the generation itself
    try:
        out = mm.generate(
            ids,
            adapter_ids=gen_spec,
            max_new_tokens=max_new_tokens,
            temperature=temperature,
            eos_token_id=stops,
            seed=seed,
        )
        steps = mm.context.trace
    finally:
        mm.context.trace = None
    answer = out[0, ids.shape[1] :].tolist()
    while answer and answer[-1] in stops:
        answer.pop()
    text = mm.tokenizer.decode(answer, skip_special_tokens=True)
    full = out[:, : ids.shape[1] + len(answer)]
    if in_network:
        adapters = generation_adapters(steps, gen_spec, full.shape[1])
    else:
        adapters = token_adapters(mm, full, gen_spec) if trace else []
    return PromptResult(prompt, text, ids[0].tolist(), answer, adapters)


def left_pad(rows: Sequence[Sequence[int]], pad: int, device: Any = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(ids [B, L], attention_mask [B, L]) with each row right-aligned (left padding)."""
    L = max(len(r) for r in rows)
    ids = torch.full((len(rows), L), pad, dtype=torch.long)
    mask = torch.zeros((len(rows), L), dtype=torch.long)
    for b, row in enumerate(rows):
        ids[b, L - len(row) :] = torch.tensor(row, dtype=torch.long)
        mask[b, L - len(row) :] = 1
    return ids.to(device), mask.to(device)


def generate_batch(
    mm: MoLoRAModel, rows: Sequence[Sequence[int]], spec: str | Router, max_new: Sequence[int], stops: Sequence[int]
) -> tuple[list[list[int]], int]:
    """Greedy answers (token ids, stop token dropped) for prompt ids `rows`, and the tokens generated.

    Each row keeps at most its own max_new tokens, so an answer does not depend on its batch.
    """
    pad = mm.tokenizer.pad_token_id if mm.tokenizer.pad_token_id is not None else stops[0]
    ids, mask = left_pad(rows, pad, mm.device)
    out = mm.generate(
        ids, mask, adapter_ids=spec, max_new_tokens=max(max_new), eos_token_id=list(stops), pad_token_id=pad
    )
    answers, generated = [], 0
    for b, new in enumerate(out[:, ids.shape[1] :].tolist()):
        new = new[: max_new[b]]
        cut = next((i for i, t in enumerate(new) if t in stops), None)
        generated += len(new) if cut is None else cut + 1
        answers.append(new if cut is None else new[:cut])
    return answers, generated


def trace_forwards(trace: list) -> list[list[torch.Tensor]]:
    """`RoutingContext.trace` entries (block, ids [T, k]) grouped by forward (the block index starts over),
    each block's top choice ids[:, 0]."""
    forwards: list[list[torch.Tensor]] = []
    prev = None
    for block, ids in trace:
        if prev is None or block <= prev:
            forwards.append([])
        forwards[-1].append(ids[:, 0])
        prev = block
    return forwards


def generation_adapters(trace: list, router: Router, n: int) -> list[str | None]:
    """The adapter of each of n tokens (prompt + answer) as a generation routed it: the most frequent
    choice over blocks in the forward that ran the token, from `RoutingContext.trace` entries (block, ids).
    A probe forward (molora.routing.learned: Probe) is skipped: the prompt ran again with its decisions.
    A last answer token that was never fed back has no routing (None)."""
    forwards = trace_forwards(trace)
    if getattr(router, "probe_prompt", False):
        forwards = forwards[1:]
    picks: list[str | None] = []
    for f in forwards:
        for col in torch.stack(f).T.tolist():  # [blocks, tokens] -> per token
            best = max(set(col), key=col.count)
            picks.append(router.adapter_names[best] if best >= 0 else None)
    return (picks + [None] * n)[:n]


@torch.no_grad()
def token_adapters(mm: MoLoRAModel, ids: torch.Tensor, spec: Any) -> list[str | None]:
    """The adapter each token of ids [1, N] is routed to (learned: the most frequent choice over blocks)."""
    names = mm.adapter_names
    router = spec if spec is not None else mm.router
    if isinstance(router, str):
        return [router] * ids.shape[1]
    if router is not None and router.in_network:
        mm.context.trace = []
        try:
            mm(ids, adapter_ids=router)
            votes = torch.stack([t for _, t in mm.context.trace])[..., 0]  # [blocks, N] router order
        finally:
            mm.context.trace = None
        rnames = router.adapter_names
        picks = []
        for col in votes.T.tolist():
            best = max(set(col), key=col.count)
            picks.append(rnames[best] if best >= 0 else None)
        return picks
    routing = router.route(ids, names, start=0)
    first = routing.adapter_ids.reshape(ids.shape[1], -1)[:, 0].tolist()
    return [names[i] if i >= 0 else None for i in first]
