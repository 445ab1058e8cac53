"""Gates for `molora.routing.gates.GateRouter` with no training data: prompts the base model writes itself,
labelled by which adapter changes the model's behaviour on them most (the data-free path).

    pool = sample_pool(mm, 2000, seed=0, exclude=eval_inputs)      # user turns the base model writes, deduplicated
    s = sensitivity(mm, pool, block=15)                            # per prompt and adapter: KL(adapter || base)
    labels = label_prompts(s["kl"], z_min=1.0, margin=0.5)         # adapter index per prompt, -1: none stands out
    gates = gates_from_labels(s["states"], labels, names)          # molora.train.gates.fit_gate per adapter

Only two things are read: the adapters' weights (through the model they change) and text the base model writes.

- **Pool** (`sample_pool`, now in molora.calibration, where the served hybrid chooser draws its pool too): the
  base model samples the user turn of its own chat template (the text after the template's "{prompt}" opening, up
  to its end-of-turn token) at a temperature; a turn that does not end within the token budget is cut after its
  last sentence or line end (dropped without one); empty turns and repeats (case and whitespace folded) are
  dropped, and so is any turn in `exclude` (callers pass the evaluation items, so the pool never holds one).
- **Sensitivity.** For each pooled prompt the base model answers greedily (`answer_tokens` tokens); the prompt and
  that answer are then read once on the base model and once per adapter, and KL(adapter || base) of the next-token
  distributions is averaged over the positions that predict the answer (the last prompt token onward): how far the
  adapter would move the base model's own answer. The base pass also keeps the prompt tokens' normed input at
  `block`, the state the gates read.
  Each adapter's entropy there is kept too ("entropy", "entropy_first"): how sure the adapter is of itself.
- **Labels.** A score (KL, or 1 / entropy) is log'd and z-scored per adapter over the pool (an adapter that moves
  every answer is not preferred for that); a prompt goes to the adapter with the largest z when it reaches
  `z_min` and leads the runner-up by `margin`, otherwise to no adapter (-1).
- **Gates.** Each adapter's gate is fitted alone (molora.train.gates.fit_gate) on the prompts labelled with it
  against the prompts no adapter claims: the same logistic gate and threshold rules as the gates trained on an
  adapter's own prompts, so `--router gates` serves them unchanged.

Measured on the default bundle (experiments/datafree_choose.py, docs/datafree_choice.json): the gates fail on
validation (skills mean 23%), since the pool holds almost no skill-like prompt, while the first-answer-token
confidence routes the skill prompts themselves well; molora.routing.confidence serves that signal per request,
calibrated on this module's pool (experiments/datafree_confidence.py).
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from molora.calibration import sample_pool  # noqa: F401  (moved there: the served hybrid chooser needs it)
from molora.calibration import template_parts as _template_parts
from molora.errors import MoLoRAError
from molora.routing.gates import Gate

if TYPE_CHECKING:
    from molora.model.attach import MoLoRAModel


def _left_pad(rows: Sequence[Sequence[int]], pad: int) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(r) for r in rows)
    ids = torch.tensor([[pad] * (width - len(r)) + list(r) for r in rows])
    mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows])
    return ids, mask


@torch.no_grad()
def sensitivity(
    mm: MoLoRAModel,
    prompts: Sequence[str],
    *,
    block: int | None = None,
    answer_tokens: int = 16,
    batch: int = 16,
) -> dict:
    """Per prompt and adapter (mm.adapter_names order): "kl" [N, K] the mean KL(adapter || base) over the positions
    predicting the base model's greedy answer (answer_tokens 0: no answer, the first answer token's alone),
    "entropy" [N, K] the adapter's mean entropy there and "entropy_first" [N, K] at its first answer token (how
    sure the adapter is of itself), "answers" (the base answer's token ids), and with `block` "states": each
    prompt's normed input at that block on the base model [T, D] (module docstring)."""
    from molora.routing.base import SequenceRouter
    from molora.routing.learned import decoder_layers

    if answer_tokens < 0 or batch < 1:
        raise MoLoRAError(f"sensitivity: answer_tokens={answer_tokens}, batch={batch}")
    head, tail, end_ids = _template_parts(mm)
    layers = decoder_layers(mm.model)
    K = len(mm.adapter_names)
    pad = mm.tokenizer.pad_token_id if mm.tokenizer.pad_token_id is not None else end_ids[0]
    kl_rows: list[torch.Tensor] = []
    ent_rows: list[torch.Tensor] = []
    ent0_rows: list[torch.Tensor] = []
    answers: list[list[int]] = []
    states: list[torch.Tensor] = []
    for i in range(0, len(prompts), batch):
        rows = [
            list(mm.tokenizer(head + p + tail, add_special_tokens=False)["input_ids"]) for p in prompts[i : i + batch]
        ]
        ids, mask = _left_pad(rows, pad)
        ids, mask = ids.to(mm.device), mask.to(mm.device)
        ans: list[list[int]] = [[] for _ in rows]
        if answer_tokens:
            gen = mm.generate(
                ids, mask, adapter_ids=SequenceRouter(None), max_new_tokens=answer_tokens, eos_token_id=end_ids
            )[:, ids.shape[1] :].tolist()
            ans = [g[: g.index(end_ids[0]) + 1] if end_ids[0] in g else g for g in gen]  # keep the end token
        full = [r + a for r, a in zip(rows, ans)]
        fid, fmask = _left_pad(full, pad)
        fid, fmask = fid.to(mm.device), fmask.to(mm.device)
        pos = (fmask.cumsum(-1) - 1).clamp(min=0)
        width = fid.shape[1]
        # positions predicting the answer: the last prompt token up to the one before the answer's last token
        keep = torch.zeros_like(fmask, dtype=torch.bool)
        for j, a in enumerate(ans):  # (no answer: the last prompt token alone, predicting the first answer token)
            keep[j, width - len(a) - 1 : width - 1 if a else width] = True
        tail_n = max(len(a) for a in ans) + 1  # logits only where an answer is predicted (left padding: the end)
        keep = keep[:, width - tail_n :]
        base = mm(
            fid,
            attention_mask=fmask,
            adapter_ids=torch.full_like(fid, -1),
            position_ids=pos,
            output_hidden_states=block is not None,
            use_cache=False,
            logits_to_keep=tail_n,
        )
        logp_b = base.logits.float().log_softmax(-1)[keep]  # [P, V]
        if block is not None:
            h = layers[block].get_submodule("input_layernorm")(base.hidden_states[block]).float().cpu()
            for j, (r, a) in enumerate(zip(rows, ans)):
                states.append(h[j, width - len(a) - len(r) : width - len(a)].clone())
        counts = keep.sum(-1).tolist()
        kl, ent, ent0 = torch.zeros(len(rows), K), torch.zeros(len(rows), K), torch.zeros(len(rows), K)
        for k in range(K):
            o = mm(
                fid,
                attention_mask=fmask,
                adapter_ids=torch.full_like(fid, k),
                position_ids=pos,
                use_cache=False,
                logits_to_keep=tail_n,
            )
            logp_a = o.logits.float().log_softmax(-1)[keep]
            p_a = logp_a.exp()
            per_pos = (p_a * (logp_a - logp_b)).sum(-1).clamp_min(0).cpu()  # [P]
            kl[:, k] = torch.stack([c.mean() for c in per_pos.split(counts)])
            ent_pos = -(p_a * logp_a).sum(-1).cpu()
            ent[:, k] = torch.stack([c.mean() for c in ent_pos.split(counts)])
            ent0[:, k] = torch.stack([c[0] for c in ent_pos.split(counts)])
        kl_rows.append(kl)
        ent_rows.append(ent)
        ent0_rows.append(ent0)
        answers += ans

    def cat(rows: list[torch.Tensor]) -> torch.Tensor:
        return torch.cat(rows) if rows else torch.zeros(0, K)

    out: dict = {"kl": cat(kl_rows), "entropy": cat(ent_rows), "entropy_first": cat(ent0_rows), "answers": answers}
    if block is not None:
        out["states"] = states
    return out


def zscores(kl: torch.Tensor, ref: torch.Tensor | None = None) -> torch.Tensor:
    """[N, K] log KL z-scored per adapter by the mean and spread of `ref`'s log KL (default kl itself: the pool)."""
    lk = kl.clamp_min(1e-8).log()
    lr = lk if ref is None else ref.clamp_min(1e-8).log()
    return (lk - lr.mean(0)) / lr.std(0).clamp_min(1e-6)


def label_prompts(kl: torch.Tensor, *, z_min: float, margin: float, ref: torch.Tensor | None = None) -> torch.Tensor:
    """[N]: the adapter whose z-scored sensitivity (`zscores`) is largest, reaches z_min and leads the runner-up by
    margin; -1 where none does (module docstring)."""
    z = zscores(kl, ref)
    if z.shape[1] == 1:
        return torch.where(z[:, 0] >= z_min, 0, -1)
    top = z.topk(2, dim=1)
    ok = (top.values[:, 0] >= z_min) & (top.values[:, 0] - top.values[:, 1] >= margin)
    return torch.where(ok, top.indices[:, 0], -1)


def gates_from_labels(
    states: Sequence[torch.Tensor],
    labels: torch.Tensor,
    names: Sequence[str],
    *,
    min_prompts: int = 5,
    seed: int = 0,
    rule: str = "youden",
    value: float = 0.0,
    l2: float = 1e-2,
) -> dict[str, Gate]:
    """{adapter: Gate} for each adapter with at least `min_prompts` prompts labelled with it, fitted alone on those
    prompts' states against the states of the prompts labelled -1 (molora.train.gates.fit_gate; each set shuffled
    by a fixed seed first). Adapters with too few prompts get no gate (their prompts stay on the base model)."""
    from molora.train.gates import fit_gate

    if len(states) != labels.shape[0]:
        raise MoLoRAError(f"{len(states)} prompt states for {labels.shape[0]} labels")
    neg = [states[i] for i in range(len(states)) if int(labels[i]) == -1]
    random.Random(2).shuffle(neg)
    if len(neg) < 2:
        raise MoLoRAError(f"only {len(neg)} pooled prompts claimed by no adapter: no negatives for the gates")
    gates = {}
    for k, name in enumerate(names):
        pos = [states[i] for i in range(len(states)) if int(labels[i]) == k]
        if len(pos) < min_prompts:
            continue
        random.Random(1).shuffle(pos)
        gates[name] = fit_gate(pos, neg, seed=seed, rule=rule, value=value, l2=l2)
    return gates
