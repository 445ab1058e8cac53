"""Training one adapter's gate for `molora.routing.gates.GateRouter`: its own prompts against general text, alone.

    states = prompt_states(mm, rows, blocks)                  # base-model forwards, normed block inputs [T, D]
    w, b = train_gate(pos_train, neg_train, generator=torch.Generator().manual_seed(0))
    thr = gate_threshold(w, b, pos_held, neg_held, rule="quantile", value=0.99)

A gate sees two sets only: its adapter's training prompts (positives) and general prompts the base model answers
(negatives, the same for every gate: `molora.data.general` train split plus everyday topic prompts). Every token of
a prompt is an example; each prompt weighs the same within its class and the two classes weigh the same, so long
prompts and the larger general set do not dominate. The fit is logistic regression on standardised features
(mean and spread of the gate's own training tokens, folded back into w and b), Adam over minibatches drawn by the
given generator: the same generator state gives the same gate, bit for bit.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from molora.routing.gates import Gate

if TYPE_CHECKING:
    from molora.model.attach import MoLoRAModel

THRESHOLD_RULES = ("quantile", "youden")


@torch.no_grad()
def prompt_states(
    mm: MoLoRAModel, rows: Sequence[Sequence[int]], blocks: Sequence[int]
) -> list[dict[int, torch.Tensor]]:
    """Per prompt (token ids), {block: input_layernorm(block input) [T, D] fp32} from one base-model forward."""
    from molora.routing.learned import decoder_layers

    layers = decoder_layers(mm.model)
    out = []
    for r in rows:
        ids = torch.tensor([list(r)], device=mm.device)
        o = mm(ids, adapter_ids=torch.full_like(ids, -1), output_hidden_states=True, use_cache=False, logits_to_keep=1)
        out.append({b: layers[b].input_layernorm(o.hidden_states[b][0]).float().cpu() for b in blocks})
    return out


def _examples(pos: Sequence[torch.Tensor], neg: Sequence[torch.Tensor]) -> tuple[torch.Tensor, ...]:
    """(x [N, D], y [N], weight [N]): every token, weighted 1 / (tokens of its prompt · prompts of its class)."""
    xs, ys, ws = [], [], []
    for label, group in ((1.0, pos), (0.0, neg)):
        for s in group:
            xs.append(s.float())
            ys.append(torch.full((s.shape[0],), label))
            ws.append(torch.full((s.shape[0],), 1.0 / (s.shape[0] * len(group))))
    return torch.cat(xs), torch.cat(ys), torch.cat(ws)


def train_gate(
    pos: Sequence[torch.Tensor],
    neg: Sequence[torch.Tensor],
    *,
    generator: torch.Generator,
    epochs: int = 20,
    batch: int = 2048,
    lr: float = 0.01,
    l2: float = 1e-3,
) -> tuple[torch.Tensor, float]:
    """(weight [D], bias) of a logistic gate: tokens of the positive prompts (each [T, D]) against the negative
    prompts' tokens (module docstring). Only `generator` draws randomness (the minibatch order)."""
    if not pos or not neg:
        raise ValueError(f"a gate needs positive and negative prompts (got {len(pos)} and {len(neg)})")
    x, y, w = _examples(pos, neg)
    mu = x.mean(0)
    sd = x.std(0).clamp_min(1e-6)
    z = (x - mu) / sd  # [N, D]
    W = torch.zeros(x.shape[1], requires_grad=True)
    b = torch.zeros((), requires_grad=True)
    opt = torch.optim.Adam([W, b], lr=lr)
    N = x.shape[0]
    with torch.enable_grad():
        for _ in range(epochs):
            order = torch.randperm(N, generator=generator)
            for i in range(0, N, batch):
                j = order[i : i + batch]
                logit = z[j] @ W + b
                loss = (F.binary_cross_entropy_with_logits(logit, y[j], reduction="none") * w[j]).sum() * (N / len(j))
                loss = loss / 2 + l2 * W.pow(2).sum()  # the weights of each class sum to 1: loss ~ mean of the two
                opt.zero_grad()
                loss.backward()
                opt.step()
    with torch.no_grad():
        weight = W / sd  # w·(x - mu)/sd + b = (w/sd)·x + (b - (w/sd)·mu)
        return weight.detach().clone(), float(b - weight @ mu)


def gate_threshold(
    weight: torch.Tensor,
    bias: float,
    pos: Sequence[torch.Tensor],
    neg: Sequence[torch.Tensor],
    rule: str = "quantile",
    value: float = 0.99,
) -> float:
    """The gate's threshold from held-out prompts of its own two sets (never another adapter's): rule "quantile",
    the `value` quantile of its score over the general tokens (a token of general text fires with probability about
    1 - value); "youden", the score that best separates its own tokens from general ones (max TPR - FPR, each
    prompt weighing the same)."""
    if rule not in THRESHOLD_RULES:
        raise ValueError(f"threshold rule {rule!r}: use one of {THRESHOLD_RULES}")
    s_neg = torch.cat([s.float() @ weight + bias for s in neg])
    if rule == "quantile":
        return float(torch.quantile(s_neg.double(), value))
    x, y, w = _examples(pos, neg)
    s = x @ weight + bias
    order = s.argsort(descending=True)
    s, y, w = s[order], y[order], w[order]
    tpr = (w * y).cumsum(0)  # share of positive weight at or above each score
    fpr = (w * (1 - y)).cumsum(0)
    i = int((tpr - fpr).argmax())
    nxt = s[i + 1] if i + 1 < len(s) else s[i] - 1
    return float((s[i] + nxt) / 2)  # fire above the midpoint (margin > 0 strictly)


def fit_gate(
    pos: Sequence[torch.Tensor],
    neg: Sequence[torch.Tensor],
    *,
    seed: int = 0,
    held: float = 0.2,
    rule: str = "quantile",
    value: float = 0.99,
    l2: float = 1e-3,
) -> Gate:
    """One adapter's `Gate` from its own prompts' states `pos` and the general prompts' states `neg` (each [T, D]):
    the last `held` share of each set sets the threshold (`gate_threshold`), the rest trains it (`train_gate`,
    generator seeded with `seed`). Callers shuffle the sets beforehand if their order means anything."""
    cut_p, cut_n = held_cut(len(pos), held), held_cut(len(neg), held)
    w, b = train_gate(pos[:cut_p], neg[:cut_n], generator=torch.Generator().manual_seed(seed), l2=l2)
    return Gate(w, b, gate_threshold(w, b, pos[cut_p:], neg[cut_n:], rule, value))


def held_cut(n: int, held: float) -> int:
    """Where `fit_gate` splits n prompts: [:cut] train the gate, [cut:] (at least one) set its threshold."""
    return n - max(1, int(held * n))


# the settings experiments/gates_choose.py chose on the default bundle's validation prompts (docs/gates_choice.json)
CHOSEN = {"source_block": -15, "l2": 0.01, "rule": "youden", "value": 0.0, "prompt_share": 0.4, "prompt_window": 32}


def general_negatives() -> list[str]:
    """The general prompts every gate is trained against: the general train split (Self-Instruct, GSM8K) and the
    default recipe's everyday topic prompts, in a fixed shuffled order (no adapter's data)."""
    import random

    from molora.data.general import general_split, topic_prompts
    from molora.data.skills import TRAIN_SEED_BASE

    general = [r["prompt"] for r in general_split()["train"]]
    general += [r["prompt"] for r in topic_prompts(200, TRAIN_SEED_BASE + 99)]
    random.Random(2).shuffle(general)
    return general


def train_gates_for_bundle(
    mm: MoLoRAModel,
    prompts: dict[str, list[str]],
    *,
    out: Path,
    seed: int = 0,
    settings: dict | None = None,
    negatives: Sequence[str] | None = None,
) -> dict:
    """Gates for the adapters named in `prompts` (adapter -> its own training prompts), each trained alone against
    `negatives` (default `general_negatives()`) with `settings` (default CHOSEN), written to the GateRouter folder
    `out`. A gate already in `out` for another adapter is kept as it is, bit for bit (composable: only the named
    adapters' gates are trained); one for a named adapter is replaced. Returns a report per gate."""
    import random

    from molora.errors import MoLoRAError
    from molora.routing.gates import GateConfig, GateRouter
    from molora.routing.learned import decoder_layers

    s = {**CHOSEN, **(settings or {})}
    unknown = [n for n in prompts if n not in mm.adapter_names]
    if unknown:
        raise MoLoRAError(f"gates for adapters {unknown} that the model lacks (it has {mm.adapter_names})")
    template = mm.bundle.prompt_template

    def ids(p: str) -> list[int]:
        return list(mm.tokenizer(template.replace("{prompt}", p), add_special_tokens=False)["input_ids"])

    n_blocks = len(decoder_layers(mm.model))
    block = s["source_block"] + n_blocks if s["source_block"] < 0 else s["source_block"]
    cfg = GateConfig(
        hidden_size=mm.model.config.hidden_size,
        source_block=s["source_block"],
        prompt_share=s["prompt_share"],
        prompt_window=s["prompt_window"],
    )
    old = GateRouter.load(out) if (Path(out) / "gates.json").is_file() else None
    router = GateRouter(cfg)
    if old is not None:
        for n in old.adapter_names:
            if n not in prompts:
                router.add_gate(n, old.gate_of(n))
    neg = [st[block] for st in prompt_states(mm, [ids(p) for p in (negatives or general_negatives())], [block])]
    report = {}
    for name, own in prompts.items():
        own = list(own)
        random.Random(1).shuffle(own)
        pos = [st[block] for st in prompt_states(mm, [ids(p) for p in own], [block])]
        router.add_gate(name, fit_gate(pos, neg, seed=seed, rule=s["rule"], value=s["value"], l2=s["l2"]))
        report[name] = {"prompts": len(pos), "general_prompts": len(neg)}
    router.save(out)
    return {"gates": str(out), "trained": report, "kept": [n for n in router.adapter_names if n not in prompts]}
