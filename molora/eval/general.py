"""`molora eval --task general:FILE`: does routing keep the base model's answers on prompts outside every skill?

    summary, predictions = evaluate_general(mm, "general:prompts.jsonl", "learned")

FILE is JSONL, one prompt per line: {"prompt": "..."} (optional "id" and "source" are carried into the
predictions; an optional "system" message renders the prompt with the tokenizer's chat template, as the server
does for a chat with a system message). Each prompt is answered greedily twice in identical batches, once on the base
model and once under `routing`, with the same answer budget (`max_new_tokens`, default 64), and three figures come back:

    retention                 % of prompts whose answer (up to the budget) equals the base model's, token for token
    empty_where_base_answers  % of prompts the base model answers (non-empty) that come back empty
    adapter_token_share       % of answer tokens computed by a forward that ran on an adapter at any block for
                              that token (learned routing: read from the generation's own forwards; a pinned
                              adapter or merge: every token; base, oracle: none, since no adapter claims these)

Owns the general prompt file format and these figures. Prompts and generation are `molora.eval.runner`'s.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from molora.bundle import generate_batch, left_pad, stop_ids, trace_forwards, turn_text
from molora.data.jsonl import iter_jsonl
from molora.eval.runner import (
    PER_REQUEST,
    EvalError,
    Mode,
    _ids,
    _spec,
    parse_mode,
    sequence_choice,
    template_of,
)

if TYPE_CHECKING:
    from molora.model.attach import MoLoRAModel

DEFAULT_TOKENS = 64


def load_general(spec: str) -> tuple[str, list[dict]]:
    """(name, rows) from "general:FILE"; rows are {"prompt", "id", "source"}."""
    kind, sep, file = spec.partition(":")
    if kind != "general" or not sep or not file:
        raise EvalError(f"task {spec!r}: a general task is 'general:FILE' with FILE a JSONL of {{\"prompt\": ...}}")
    path = Path(file)
    rows = []
    for n, row in iter_jsonl(path, error=EvalError):
        if not isinstance(row, dict) or not isinstance(row.get("prompt"), str) or not row["prompt"].strip():
            raise EvalError(f'{path}:{n}: each line needs a non-empty string "prompt"')
        if row.get("system") is not None and not isinstance(row["system"], str):
            raise EvalError(f'{path}:{n}: "system" must be a string (a system message) or absent')
        rows.append(
            {
                "prompt": row["prompt"],
                "id": row.get("id", f"{path.stem}_{n}"),
                "source": row.get("source"),
                "system": row.get("system"),
            }
        )
    if not rows:
        raise EvalError(f"{path} holds no prompts")
    return path.stem, rows


def _render(mm: MoLoRAModel, template: str, item: dict) -> list[int]:
    """Prompt ids as the server renders a chat: the bundle's template for one user message, the tokenizer's
    chat template when a system message comes with it."""
    if not item.get("system"):
        return _ids(mm.tokenizer, turn_text(template, item["prompt"]))
    text = mm.tokenizer.apply_chat_template(
        [{"role": "system", "content": item["system"]}, {"role": "user", "content": item["prompt"]}],
        add_generation_prompt=True,
        tokenize=False,
    )
    return _ids(mm.tokenizer, text)


def _adapter_flags(trace: list, probe: bool, rows: int, prompt_len: int, answers: list[list[int]]) -> list[list[bool]]:
    """Per row, per answer token: did the forward that computed it use an adapter at any block for it?
    Forwards: [probe], the prompt [B*L], then one per generated token [B]."""
    fw = trace_forwards(trace)[1 if probe else 0 :]
    used = [torch.stack(f).ge(0).any(0) for f in fw]  # per forward: [T] bool
    flags = []
    for b, ans in enumerate(answers):
        row = [bool(used[0].view(rows, prompt_len)[b, -1])]  # token 0: the prompt forward
        row += [bool(used[j][b]) for j in range(1, min(len(ans), len(used)))]  # token j: forward j
        flags.append(row[: len(ans)])
    return flags


def _fixed_share(mode: Mode, adapter: str | None) -> bool:
    """Whether a non-learned mode runs a row's answer on an adapter."""
    return mode.kind in ("adapter", "merge") or (mode.kind in PER_REQUEST and adapter is not None)


@torch.no_grad()
def _answer(
    mm: MoLoRAModel, rows: list[list[int]], mode: Mode, chosen: list[str | None], *, batch_size: int, max_new: int
) -> tuple[list[list[int]], list[list[bool]]]:
    """Greedy answers of every prompt under `mode`, and per answer token whether it ran on an adapter."""
    stops = stop_ids(mm)
    order = sorted(range(len(rows)), key=lambda i: len(rows[i]))  # similar lengths share a batch
    answers: list[list[int]] = [[] for _ in rows]
    flags: list[list[bool]] = [[] for _ in rows]
    for i in range(0, len(order), batch_size):
        idx = order[i : i + batch_size]
        batch = [rows[j] for j in idx]
        labels = [[None] for _ in idx]
        spec = _spec(mm, mode, labels, [chosen[j] for j in idx])
        learned = mode.kind == "learned"
        if learned:
            mm.context.trace = []
        try:
            got, _ = generate_batch(mm, batch, spec, [max_new] * len(idx), stops)
            trace = mm.context.trace
        finally:
            mm.context.trace = None
        if learned:
            L = max(len(r) for r in batch)
            fl = _adapter_flags(trace, bool(getattr(spec, "probe_prompt", False)), len(idx), L, got)
        else:
            fl = [[_fixed_share(mode, chosen[j])] * len(a) for j, a in zip(idx, got)]
        for j, a, f in zip(idx, got, fl):
            answers[j], flags[j] = a, f
    return answers, flags


def evaluate_general(
    mm: MoLoRAModel,
    task_spec: str,
    routing: str,
    *,
    limit: int | None = None,
    batch_size: int = 16,
    max_new_tokens: int | None = None,
    base_answers: list[list[int]] | None = None,
) -> tuple[dict, list[dict]]:
    """Base retention of `routing` on the prompts of `task_spec` (module docstring); (summary, predictions).

    base_answers: the base model's answers (token ids) from an earlier call with the same prompts, batch size
    and budget (`predictions[i]["base_ids"]`), to skip answering them again."""
    if batch_size < 1 or (limit is not None and limit < 1) or (max_new_tokens is not None and max_new_tokens < 1):
        raise EvalError(
            f"batch_size, limit and max_new_tokens must be >= 1 (got {batch_size}, {limit}, {max_new_tokens})"
        )
    mode = parse_mode(mm, routing)
    if mode.kind == "oracle":
        mode = Mode("base")  # no adapter's tasks cover a general prompt: the oracle is the base model
    name, items = load_general(task_spec)
    items = items[:limit] if limit is not None else items
    budget = max_new_tokens or DEFAULT_TOKENS
    template, _ = template_of(mm)
    rows = [_render(mm, template, it) for it in items]
    start = time.perf_counter()
    if base_answers is None:
        base_answers, _ = _answer(mm, rows, Mode("base"), [None] * len(rows), batch_size=batch_size, max_new=budget)
    elif len(base_answers) != len(rows):
        raise EvalError(f"base_answers has {len(base_answers)} answers for {len(rows)} prompts")
    chosen = (
        sequence_choice(mm, [it["prompt"] for it in items], batch_size=batch_size, chooser=mode.router)
        if mode.kind in PER_REQUEST
        else [None] * len(rows)
    )
    answers, flags = _answer(mm, rows, mode, chosen, batch_size=batch_size, max_new=budget)
    seconds = time.perf_counter() - start
    tok = mm.tokenizer
    predictions = []
    for it, base, ans, fl in zip(items, base_answers, answers, flags):
        predictions.append(
            {
                "id": it["id"],
                "source": it["source"],
                "input": it["prompt"],
                "base": tok.decode(base, skip_special_tokens=True),
                "prediction": tok.decode(ans, skip_special_tokens=True),
                "equal": ans == list(base),
                "empty": not ans and bool(base),
                "adapter_tokens": sum(fl),
                "tokens": len(ans),
                "base_ids": list(base),
            }
        )
    return summarize_general(name, str(mode), predictions, budget, seconds), predictions


def summarize_general(task: str, routing: str, predictions: list[dict], budget: int, seconds: float) -> dict:
    """The summary record of a general run (percentages; by source where the file names sources)."""

    def pct(ps: list[dict]) -> dict:
        answered = [p for p in ps if p["base_ids"]]
        tokens = sum(p["tokens"] for p in ps)
        return {
            "n": len(ps),
            "retention": round(100.0 * sum(p["equal"] for p in ps) / len(ps), 2),
            "empty_where_base_answers": round(100.0 * sum(p["empty"] for p in answered) / max(1, len(answered)), 2),
            "adapter_token_share": round(100.0 * sum(p["adapter_tokens"] for p in ps) / max(1, tokens), 2),
        }

    sources = sorted({p["source"] for p in predictions if p["source"]})
    return {
        "task": f"general:{task}",
        "routing": routing,
        **pct(predictions),
        "max_new_tokens": budget,
        "seconds": round(seconds, 3),
        "by_source": {s: pct([p for p in predictions if p["source"] == s]) for s in sources},
    }


# ------------------------------------------------------------------------------------------- base expert


@torch.no_grad()
def probe_shares(mm: MoLoRAModel, router: Any, prompts: list[str], *, batch_size: int = 16) -> list[float]:
    """Per prompt (rendered with the bundle's template), the share of its tokens the router's probe pass gives
    to an adapter: what `prompt_share` is compared with (molora.routing.learned: Base expert)."""
    template, _ = template_of(mm)
    rows = [_ids(mm.tokenizer, turn_text(template, p)) for p in prompts]
    order = sorted(range(len(rows)), key=lambda i: len(rows[i]))
    out = [0.0] * len(rows)
    for i in range(0, len(order), batch_size):
        idx = order[i : i + batch_size]
        ids, mask = left_pad([rows[j] for j in idx], 0, mm.device)
        positions = (mask.cumsum(-1) - 1).clamp(min=0)  # as generate's probe
        mm(ids, attention_mask=mask, adapter_ids=router, position_ids=positions, use_cache=False, logits_to_keep=1)
        claimed = (mm.last_carry >= 0) & mask.bool()  # [B, L]
        for r, j in enumerate(idx):
            out[j] = float(claimed[r].sum()) / len(rows[j])
    return out


def choose_prompt_share(
    general: list[float], skill: list[float] | Mapping[str, list[float]], max_skill_lost: float = 0.01
) -> float:
    """The prompt_share that keeps all but at most `max_skill_lost` of the skill prompts routed (share >= it)
    and as many general prompts as possible on the base (share < it): halfway between the lowest skill share
    it keeps and the highest general share below that; 0 when that skill share is 0.

    skill: one pool of shares, or shares per skill: then the bound holds for every skill on its own (a pooled
    bound lets the skill with the lowest shares lose many times its part: 2 of 50 counting prompts
    fell under a 1% bound pooled over 200)."""
    pools = [list(skill)] if not isinstance(skill, Mapping) else [list(v) for v in skill.values() if v]
    if not pools:
        raise ValueError("choose_prompt_share needs at least one skill share")
    low = min(sorted(p)[min(int(max_skill_lost * len(p)), len(p) - 1)] for p in pools)
    below = [g for g in general if g < low]
    if low <= 0:
        return 0.0
    return round((low + max(below)) / 2, 4) if below else round(low / 2, 4)
