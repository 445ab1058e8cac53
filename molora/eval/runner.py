"""`molora eval`: answer a task file with a routed model and score the answers.

    summary, predictions = evaluate(mm, "bbh:object_counting.json", "learned", limit=100)

Owns: the routing modes of an evaluation, the prompts (the bundle's template; multi-turn rendering of
mixed items), batched greedy generation (left padding, prompts of similar length together, stop at
the bundle's stop tokens), per-kind answer budgets, and the summary / predictions records.  Does not
know: file formats or answer extraction (`molora.eval.tasks`), training, HTTP.

Routing modes (`routing`):

    base           no adapter on any token
    adapter:NAME   NAME on every token
    merge          every token on all adapters with weight 1/K (`UniformMergeRouter`)
    oracle         each question's tokens (and its answer's) on the adapter whose `tasks` lists its task
                   (`Bundle.adapter_for_task`); the base model where none does
    sequence       one adapter per sequence, as a per-request server picks it: the learned router's
                   vote over the prompt's question tokens (per token the decision most blocks took, then
                   the adapter most tokens chose, "none" votes ignored; ties go to the earlier adapter).
                   If no token chooses an adapter the sequence runs on the base model.  Mixed items
                   vote over all their questions joined, and keep that one adapter for every turn.
    turn           as sequence, but a mixed item's every turn is chosen again on that turn's question alone
                   (a per-request server choosing on the latest user message); the whole conversation so
                   far then runs on that turn's adapter. Single items: the same as sequence.
    learned        the model's router (`mm.router`) on every token
    arrow, arrow-token
                   the named router (molora.routing.names: the same router as `molora route --router NAME`)
                   on every token, as learned
    hybrid         the named per-request chooser (`molora.bundle.hybrid_chooser`): one adapter or the base
                   model per question, as sequence

Single items are one turn: template(question) -> answer.  Mixed items (task "mixed") are answered turn
by turn inside one sequence, rendered exactly as `molora.train.default.labelled_sequence` renders
router training data, each turn tokenized on its own:

    template(q1) + a1 + END + "\\n" + template(q2) + a2 + END ...

where a_i is the model's own answer to q_i (generation stops at END).  Each part is scored on its own.
"""

from __future__ import annotations

import json
import time
from collections import Counter, defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from molora.bundle import (
    CHATML_TEMPLATE,
    END_OF_TURN,
    generate_batch,
    hybrid_chooser,
    left_pad,
    named_router,
    stop_ids,
    turn_text,
)
from molora.errors import MoLoRAError
from molora.eval.tasks import EvalItem, answer_kind, load_task, score_item
from molora.routing import OracleRouter, Router, SequenceRouter
from molora.routing.merge import UniformMergeRouter
from molora.routing.names import NAMED_ROUTERS

if TYPE_CHECKING:
    from molora.model.attach import MoLoRAModel

MODES = ("base", "adapter:NAME", "merge", "oracle", "sequence", "turn", "learned", *NAMED_ROUTERS)
PER_REQUEST = ("sequence", "turn")  # one adapter (or the base) per request, chosen by sequence_choice
END = END_OF_TURN
CHATML = CHATML_TEMPLATE
# new-token budget per answer kind: bare answers are short; a word list or a worked solution is not
# (the default bundle answers counting and arithmetic ("int") with worked solutions of up to ~162 tokens since
# arithmetic writes its sign handling (95% within 148), navigate ("label") with a position trace of up to ~275:
# each move writes its sum and the new position)
MAX_NEW_TOKENS = {
    "int": 224,
    "label": 320,
    "dyck": 32,
    "choice": 32,
    "words": 96,
    "text": 64,
    "number": 256,
    "math": 256,
}


class EvalError(MoLoRAError, ValueError):
    """An evaluation cannot run as asked (unknown routing mode or adapter, no router, no bundle)."""


# ------------------------------------------------------------------------------------------- prompts


def template_of(mm: MoLoRAModel) -> tuple[str, str]:
    """(prompt template with "{prompt}", end-of-turn text) of the model's bundle (ChatML without one)."""
    bundle = getattr(mm, "bundle", None)
    if bundle is None:
        return CHATML, END
    return bundle.prompt_template, (bundle.stop[0] if bundle.stop else END)


def _ids(tokenizer: Any, text: str) -> list[int]:
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


# ------------------------------------------------------------------------------------------- routing


@dataclass(frozen=True)
class Mode:
    """A parsed routing mode; `adapter` is set for adapter:NAME. A named router (molora.routing.names) runs as
    kind learned (a token router) or sequence (hybrid's per-request chooser) with `router` set and `name` kept."""

    kind: str
    adapter: str | None = None
    name: str | None = None
    router: Any = field(default=None, compare=False)

    def __str__(self) -> str:
        return self.name or (f"adapter:{self.adapter}" if self.kind == "adapter" else self.kind)


def parse_mode(mm: MoLoRAModel, routing: str) -> Mode:
    """Check that `mm` can run `routing` (see the module docstring) and parse it."""
    if routing in NAMED_ROUTERS:
        if not mm.adapter_names or getattr(mm, "bundle", None) is None:
            raise EvalError(f"routing {routing!r} routes among a bundle's adapters, and none are loaded")
        if routing == "hybrid":
            return Mode("sequence", name=routing, router=hybrid_chooser(mm))
        return Mode("learned", name=routing, router=named_router(mm, routing))
    kind, sep, name = routing.partition(":")
    if kind == "adapter" and sep:
        if name not in mm.adapter_names:
            raise EvalError(f"routing {routing!r}: no adapter {name!r} is loaded (loaded: {mm.adapter_names})")
        return Mode("adapter", name)
    if kind not in ("base", "merge", "oracle", "sequence", "turn", "learned") or sep:
        raise EvalError(f"unknown routing mode {routing!r}; use one of {', '.join(MODES)}")
    if kind in ("learned", *PER_REQUEST) and mm.router is None:
        raise EvalError(
            f"routing {routing!r} needs the bundle's router, and this model has none "
            "(use a bundle whose molora.json names a learned router)"
        )
    if kind == "oracle" and getattr(mm, "bundle", None) is None:
        raise EvalError("routing 'oracle' needs a bundle: its adapters' `tasks` say which adapter fits a task")
    if kind in ("merge", "oracle", *PER_REQUEST) and not mm.adapter_names:
        raise EvalError(f"routing {routing!r} needs adapters, and none are loaded")
    return Mode(kind)


def _vote(picks: Sequence[int], names: Sequence[str]) -> str | None:
    """The adapter most tokens picked (-1 = none is ignored; ties: the earlier adapter), None if none."""
    counts = Counter(p for p in picks if p >= 0)
    if not counts:
        return None
    best = max(counts.values())
    return names[min(p for p, c in counts.items() if c == best)]


@torch.no_grad()
def sequence_choice(
    mm: MoLoRAModel, questions: Sequence[str], *, batch_size: int = 16, chooser: Any = None
) -> list[str | None]:
    """One adapter per question text: the router's vote over its question tokens (see module docstring), or the
    router's own per-request choice where it has one (`choose_per_request`: molora.routing.confidence), or
    `chooser`'s (a per-request chooser given by name: Mode.router)."""
    chooser = chooser if chooser is not None else mm.router
    if hasattr(chooser, "choose_per_request"):
        return list(chooser.choose_per_request(mm, questions, batch_size=batch_size))
    template, _ = template_of(mm)
    head, _, tail = template.partition("{prompt}")
    n_head, n_tail = len(_ids(mm.tokenizer, head)), len(_ids(mm.tokenizer, tail))
    router = mm.router
    rows = [_ids(mm.tokenizer, turn_text(template, q)) for q in questions]
    order = sorted(range(len(rows)), key=lambda i: len(rows[i]))  # similar lengths share a batch
    out: list[str | None] = [None] * len(rows)
    for i in range(0, len(rows), batch_size):
        chunk = [rows[j] for j in order[i : i + batch_size]]
        ids, mask = left_pad(chunk, pad=0, device=mm.device)  # [B, L]
        if router.in_network:
            mm.context.trace = []
            try:
                mm(ids, attention_mask=mask, adapter_ids=router)
                votes = torch.stack([t[:, 0] for _, t in mm.context.trace])  # [blocks, B*L] router order
            finally:
                mm.context.trace = None
            picks = torch.mode(votes, dim=0).values.view(ids.shape)  # [B, L]
            names = router.adapter_names
        else:
            picks = router.route(ids, mm.adapter_names).adapter_ids
            picks = picks[..., 0] if picks.ndim == 3 else picks  # [B, L]
            names = mm.adapter_names
        L = ids.shape[1]
        for r, row in enumerate(chunk):
            lo, hi = L - len(row) + n_head, L - n_tail  # the question's tokens
            span = picks[r, lo:hi] if hi > lo else picks[r, L - len(row) :]
            out[order[i + r]] = _vote(span.tolist(), names)
    return out


def _spec(
    mm: MoLoRAModel, mode: Mode, labels: list[list[str | None]] | None, chosen: list[str | None] | None
) -> str | Router:
    """The `adapter_ids` argument of mm.generate for one batch."""
    if mode.kind == "base":
        return SequenceRouter(None)
    if mode.kind == "adapter":
        return mode.adapter
    if mode.kind == "merge":
        return UniformMergeRouter()
    if mode.kind == "learned":
        return mode.router if mode.router is not None else mm.router
    if mode.kind in PER_REQUEST:
        return SequenceRouter(chosen)
    return OracleRouter(labels)


# ------------------------------------------------------------------------------------------- generation


@dataclass
class _Dialog:
    """One item as a conversation: its parts (questions), the answers so far, the ids of finished turns."""

    item: EvalItem
    parts: tuple[EvalItem, ...]
    answers: list[str] = field(default_factory=list)
    ids: list[int] = field(default_factory=list)
    labels: list[str | None] = field(default_factory=list)  # oracle adapter per position of `ids`
    adapter: str | None = None  # sequence mode: the one adapter (turn mode: this turn's)


def _answer_all(
    mm: MoLoRAModel, dialogs: list[_Dialog], mode: Mode, *, batch_size: int, max_new_tokens: int | None, progress: bool
) -> int:
    """Fill every dialog's answers, turn by turn, in batches of similar length; return tokens generated."""
    from tqdm import tqdm

    template, end = template_of(mm)
    stops = stop_ids(mm)
    tok = mm.tokenizer
    bundle = getattr(mm, "bundle", None)
    generated = 0
    bar = tqdm(total=sum(len(d.parts) for d in dialogs), desc=f"eval {mode}", unit="answer", disable=not progress)
    for turn in range(max(len(d.parts) for d in dialogs)):
        active = [d for d in dialogs if len(d.parts) > turn]
        if mode.kind == "turn":  # each turn chosen again on its own question
            for d, adapter in zip(
                active,
                sequence_choice(mm, [d.parts[turn].input for d in active], batch_size=batch_size, chooser=mode.router),
            ):
                d.adapter = adapter
        prompts = {id(d): d.ids + _ids(tok, turn_text(template, d.parts[turn].input)) for d in active}
        budget = {
            id(d): max_new_tokens or MAX_NEW_TOKENS.get(answer_kind(d.parts[turn].task, d.parts[turn].target), 64)
            for d in active
        }
        active.sort(key=lambda d: (budget[id(d)], len(prompts[id(d)])))
        for i in range(0, len(active), batch_size):
            batch = active[i : i + batch_size]
            labels = None
            if mode.kind == "oracle":  # per position, left-padded like the ids (pads take the first label)
                L = max(len(prompts[id(d)]) for d in batch)
                labels = [
                    d.labels + [bundle.adapter_for_task(d.parts[turn].task)] * (len(prompts[id(d)]) - len(d.labels))
                    for d in batch
                ]
                labels = [[row[0]] * (L - len(row)) + row for row in labels]
            spec = _spec(mm, mode, labels, [d.adapter for d in batch])
            answers, n = generate_batch(
                mm, [prompts[id(d)] for d in batch], spec, [budget[id(d)] for d in batch], stops
            )
            generated += n
            for d, ans in zip(batch, answers):
                text = tok.decode(ans, skip_special_tokens=True)
                d.answers.append(text)
                last = turn + 1 == len(d.parts)
                if not last:  # the finished turn, re-rendered as training renders it
                    seg = _ids(tok, turn_text(template, d.parts[turn].input, text, end, last=False))
                    d.labels += [bundle.adapter_for_task(d.parts[turn].task) if bundle else None] * len(seg)
                    d.ids += seg
            bar.update(len(batch))
    bar.close()
    return generated


# ------------------------------------------------------------------------------------------- evaluate


def evaluate(
    mm: MoLoRAModel,
    task_spec: str,
    routing: str,
    *,
    limit: int | None = None,
    batch_size: int = 16,
    max_new_tokens: int | None = None,
    progress: bool = True,
) -> tuple[dict, list[dict]]:
    """Answer the items of `task_spec` ("KIND:FILE") under `routing`; return (summary, predictions).

    summary: {"task", "routing", "n", "accuracy", "lenient_accuracy", "majority_baseline", "tokens_per_s",
    "seconds", "generated_tokens", "by_task"} with percentages; mixed tasks count parts in n and add
    "items" and "item_accuracy" (every part right).  predictions: one {"task", "input", "target",
    "prediction", "correct", "lenient"} per item, or per part of a mixed item, in file order.
    """
    if batch_size < 1:
        raise EvalError(f"batch_size must be >= 1, got {batch_size}")
    if limit is not None and limit < 1:
        raise EvalError(f"limit must be >= 1 (or None for every item), got {limit}")
    if max_new_tokens is not None and max_new_tokens < 1:
        raise EvalError(f"max_new_tokens must be >= 1 (or None for the per-kind default), got {max_new_tokens}")
    mode = parse_mode(mm, routing)
    name, items = load_task(task_spec)
    items = items[:limit] if limit is not None else items
    dialogs = [_Dialog(it, it.parts if it.parts is not None else (it,)) for it in items]
    start = time.perf_counter()
    if mode.kind == "sequence":
        whole = ["\n\n".join(p.input for p in d.parts) for d in dialogs]
        for d, adapter in zip(dialogs, sequence_choice(mm, whole, batch_size=batch_size, chooser=mode.router)):
            d.adapter = adapter
    generated = _answer_all(mm, dialogs, mode, batch_size=batch_size, max_new_tokens=max_new_tokens, progress=progress)
    seconds = time.perf_counter() - start
    predictions, item_hits = [], []
    for d in dialogs:
        hits = []
        for part, answer in zip(d.parts, d.answers):
            strict, lenient = score_item(part, answer)
            hits.append(strict)
            predictions.append(
                {
                    "task": part.task,
                    "input": part.input,
                    "target": part.target,
                    "prediction": answer,
                    "correct": strict,
                    "lenient": lenient,
                }
            )
        item_hits.append(all(hits))
    summary = summarize(name, str(mode), predictions, seconds, generated)
    if any(it.parts is not None for it in items):
        summary["items"] = len(items)
        summary["item_accuracy"] = round(100.0 * sum(item_hits) / len(items), 2)
    return summary, predictions


def summarize(task: str, routing: str, predictions: Sequence[dict], seconds: float, generated: int) -> dict:
    """The summary record of scored predictions (see `evaluate`)."""
    n = len(predictions)
    by_task: dict[str, list[dict]] = defaultdict(list)
    for p in predictions:
        by_task[p["task"]].append(p)
    majority = sum(Counter(p["target"] for p in ps).most_common(1)[0][1] for ps in by_task.values())
    pct = lambda k, ps: round(100.0 * sum(bool(p[k]) for p in ps) / len(ps), 2)  # noqa: E731
    return {
        "task": task,
        "routing": routing,
        "n": n,
        "accuracy": pct("correct", predictions),
        "lenient_accuracy": pct("lenient", predictions),
        "majority_baseline": round(100.0 * majority / n, 2),
        "tokens_per_s": round(generated / seconds, 2) if seconds > 0 else 0.0,
        "seconds": round(seconds, 3),
        "generated_tokens": generated,
        "by_task": {t: pct("correct", ps) for t, ps in by_task.items()},
    }


def save_results(
    summary: dict,
    predictions: Sequence[dict],
    json_path: str | Path | None = None,
    predictions_path: str | Path | None = None,
) -> None:
    """Write the summary JSON and / or the predictions JSONL (one line per item or part)."""
    for path, text in (
        (json_path, lambda: json.dumps(summary, indent=2) + "\n"),
        (predictions_path, lambda: "".join(json.dumps(p, ensure_ascii=False) + "\n" for p in predictions)),
    ):
        if path is None:
            continue
        path = Path(path)
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text(), encoding="utf-8")
        except OSError as e:
            raise EvalError(f"cannot write {path}: {e}") from e
