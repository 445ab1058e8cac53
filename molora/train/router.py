"""`molora train-router`: train the learned router with base and adapters frozen, without manual labels.

A token's label is the dataset it came from: the adapter whose training data holds it, or "none" for
generic text. Sequences may concatenate items of several datasets (multi-turn), so the router also sees
skill switches inside one sequence. Features are the input hidden states of each decoder block, taken
from a teacher-forced forward in which every token already uses its label's adapter (the states the
router meets at inference when it is right). Gates are linear, so training on cached features is fast.

Optionally labels are refined by loss: a token whose label adapter does not give the lowest next-token
loss among the adapters (by a margin) is relabelled to the adapter that does.
"""

from __future__ import annotations

import logging
import random
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from molora.errors import MoLoRAError
from molora.routing.learned import LearnedRouter, LearnedRouterConfig

log = logging.getLogger("molora.train")

IGNORE = -100


@dataclass
class LabelledSeq:
    """ids [N]; route [N]: adapter index (router order, -1 none) used in the teacher-forced forward;
    labels [N]: the target class per token (-1 none, IGNORE = not scored, e.g. template tokens);
    key: positions always trained on (besides the tokens_per_seq sampled ones): the last tokens before
    each answer, whose routing picks the answer's first token."""

    ids: list[int]
    route: list[int]
    labels: list[int]
    key: tuple[int, ...] = ()


@dataclass(frozen=True)
class RouterTrainConfig:
    placement: str = "per_block"
    shared_block: int = 0
    composable: bool = False
    top_k: int = 1
    steps: int = 300
    lr: float = 1e-2
    weight_decay: float = 1e-3
    tokens_per_seq: int = 16
    batch_size: int = 16
    seed: int = 0
    refine_margin: float | None = None  # refine labels by loss when set (nats)
    threshold: float = 2.0  # composable: a gate claims a token only above this logit (p > 0.88)
    carry_blocks: int | None = None  # None: CARRY_BLOCKS for per_block top-1 routers, else 0
    probe_prompt: bool | None = None  # None: on wherever carry is on (molora.routing.learned: Probe)
    confidence: float = 0.0  # base expert (molora.routing.learned): chosen on validation data
    prompt_share: float = 0.0  # base expert: needs the probe


# Blocks whose gates a generated token replaces by its predecessor's last-block decision (molora.routing.learned:
# Carry). Measured on the default bundle's held-out router data: block 0's gate 62% right, block 1's 90%,
# block 2's 96%, >= 97% after; with carry over blocks 0-1 learned navigate went from 71.7% to 78.3% on its first
# 60 items (80.0% with blocks 0-1 forced to the right adapter; carry over 3 blocks also 78.3%).
CARRY_BLOCKS = 2


def carry_blocks_for(cfg: RouterTrainConfig, num_blocks: int) -> int:
    """The router's carry_blocks: the config's, or by default CARRY_BLOCKS where carry applies."""
    if cfg.carry_blocks is not None:
        return cfg.carry_blocks
    ok = cfg.placement == "per_block" and cfg.top_k == 1 and num_blocks > CARRY_BLOCKS
    return CARRY_BLOCKS if ok else 0


def probe_prompt_for(cfg: RouterTrainConfig, carry_blocks: int) -> bool:
    """The router's probe_prompt: the config's, or by default on wherever carry is on."""
    return bool(carry_blocks) if cfg.probe_prompt is None else cfg.probe_prompt


@torch.no_grad()
def collect_features(
    mm, seqs: Sequence[LabelledSeq], names: Sequence[str], cfg: RouterTrainConfig, progress: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """(features [N, L, D] bf16: block-input hidden states of sampled labelled tokens, labels [N])."""
    from tqdm import tqdm

    rng = random.Random(cfg.seed)
    slot_of = {i: mm.adapter_names.index(n) for i, n in enumerate(names)}
    feats, labels = [], []
    order = sorted(range(len(seqs)), key=lambda i: len(seqs[i].ids))
    groups = [order[i : i + cfg.batch_size] for i in range(0, len(order), cfg.batch_size)]
    dev = mm.device
    for g in tqdm(groups, desc="router features", disable=not progress, unit="batch"):
        L = max(len(seqs[i].ids) for i in g)
        ids = torch.zeros(len(g), L, dtype=torch.long)
        att = torch.zeros(len(g), L, dtype=torch.long)
        route = torch.full((len(g), L), -1, dtype=torch.long)
        for r, i in enumerate(g):
            s = seqs[i]
            n = len(s.ids)
            ids[r, :n] = torch.tensor(s.ids)
            att[r, :n] = 1
            route[r, :n] = torch.tensor([slot_of[a] if a >= 0 else -1 for a in s.route])
        ids, att, route = ids.to(dev), att.to(dev), route.to(dev)
        out = mm(ids, attention_mask=att, adapter_ids=route, output_hidden_states=True)
        hidden = torch.stack(out.hidden_states[: len(out.hidden_states) - 1], dim=2)  # [B, L, blocks, D]
        if cfg.refine_margin is not None:
            relabel = _refined_labels(mm, ids, att, seqs, g, names, cfg.refine_margin)
        for r, i in enumerate(g):
            s = seqs[i]
            lab = relabel[r] if cfg.refine_margin is not None else s.labels
            key = [p for p in s.key if p < len(lab) and lab[p] != IGNORE]
            pos = [p for p, y in enumerate(lab) if y != IGNORE and p not in key]
            pos = rng.sample(pos, min(cfg.tokens_per_seq, len(pos))) + key
            if pos:
                feats.append(hidden[r, pos].to(device="cpu", dtype=torch.bfloat16))  # gates fit on CPU
                labels.append(torch.tensor([lab[p] for p in pos]))
    if not feats:
        raise MoLoRAError("no labelled tokens to train the router on")
    return torch.cat(feats), torch.cat(labels)


def _refined_labels(mm, ids, att, seqs, group, names, margin) -> list[list[int]]:
    """Relabel a token to the adapter with the lowest next-token loss when it beats the label by margin."""
    losses = []
    for k in range(len(names)):
        logits = mm(ids, attention_mask=att, adapter_ids=names[k]).logits[:, :-1]
        nll = F.cross_entropy(logits.transpose(1, 2), ids[:, 1:], reduction="none")  # [B, L-1]
        losses.append(F.pad(nll, (1, 0)))  # loss of predicting token p from position p-1
    losses = torch.stack(losses, -1)  # [B, L, K]
    out = []
    for r, i in enumerate(group):
        lab = list(seqs[i].labels)
        for p, y in enumerate(lab):
            if y >= 0 and p > 0:
                best = int(losses[r, p].argmin())
                if best != y and losses[r, p, y] - losses[r, p, best] > margin:
                    lab[p] = best
        out.append(lab)
    return out


def fit_gates(
    feats: torch.Tensor,
    labels: torch.Tensor,
    num_classes: int,
    gates: Sequence[int],
    cfg: RouterTrainConfig,
    binary_positive: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Linear gates on RMS-normalized features of the given blocks: weight [G, C, D], bias [G, C].

    Multi-class (softmax over C, label -1 -> class C-1) or, with binary_positive=k, one logistic gate
    per block (C = 1): tokens labelled k are positive, the rest negative.
    """
    torch.manual_seed(cfg.seed)
    # gate-major [G, N, D], contiguous once: a batched matmul per step (an einsum over [N, G, D] copied the
    # whole feature tensor into this layout at every step: 3.7x the time per step, measured at N=4000)
    x = F.rms_norm(feats[:, list(gates)].float(), (feats.shape[-1],)).transpose(0, 1).contiguous()
    G, D = x.shape[0], x.shape[2]
    C = 1 if binary_positive is not None else num_classes
    y = (
        (labels == binary_positive).float()
        if binary_positive is not None
        else torch.where(labels < 0, num_classes - 1, labels)
    )
    W = torch.zeros(G, C, D, requires_grad=True)
    b = torch.zeros(G, C, requires_grad=True)
    opt = torch.optim.Adam([W, b], lr=cfg.lr, weight_decay=cfg.weight_decay)
    with torch.enable_grad():  # callers may hold no_grad
        for _ in range(cfg.steps):
            logits = torch.bmm(x, W.transpose(1, 2)) + b[:, None]  # [G, N, C]
            if binary_positive is not None:
                loss = F.binary_cross_entropy_with_logits(logits[..., 0], y[None].expand(G, -1))
            else:
                loss = F.cross_entropy(logits.reshape(-1, C), y.repeat(G))
            opt.zero_grad()
            loss.backward()
            opt.step()
    return W.detach(), b.detach()


def train_router(
    mm,
    train: Sequence[LabelledSeq],
    names: Sequence[str],
    cfg: RouterTrainConfig = RouterTrainConfig(),
    *,
    generic_label: int = -1,
    progress: bool = False,
    features: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> LearnedRouter:
    """A LearnedRouter over adapters `names` (all loaded in mm) trained on labelled sequences.

    features: (feats, labels) from `collect_features` to reuse across router variants.
    """
    from molora.routing.learned import decoder_layers

    missing = [n for n in names if n not in mm.adapter_names]
    if missing:
        raise MoLoRAError(f"train-router: adapters {missing} are not loaded (loaded: {mm.adapter_names})")
    blocks = len(decoder_layers(mm.model))
    carry = carry_blocks_for(cfg, blocks)
    rcfg = LearnedRouterConfig(
        adapter_names=tuple(names),
        hidden_size=mm.config.hidden_size,
        num_blocks=blocks,
        placement=cfg.placement,
        shared_block=cfg.shared_block,
        composable=cfg.composable,
        top_k=cfg.top_k,
        threshold=cfg.threshold,
        carry_blocks=carry,
        probe_prompt=probe_prompt_for(cfg, carry),
        confidence=cfg.confidence,
        prompt_share=cfg.prompt_share,
    )
    gates = list(range(blocks)) if cfg.placement == "per_block" else [cfg.shared_block]
    feats, labels = features if features is not None else collect_features(mm, train, names, cfg, progress)
    log.info("router features: %d tokens x %d blocks", feats.shape[0], feats.shape[1])
    router = LearnedRouter(rcfg)
    if cfg.composable:
        # each adapter's gate sees only its own data and generic text: trained independently
        fitted = [
            fit_gates(
                feats[(labels == k) | (labels == generic_label)],
                labels[(labels == k) | (labels == generic_label)],
                1,
                gates,
                cfg,
                binary_positive=k,
            )
            for k in range(len(names))
        ]
        W = torch.cat([w for w, _ in fitted], 1)
        b = torch.cat([bb for _, bb in fitted], 1)
    else:
        W, b = fit_gates(feats, labels, len(names) + 1, gates, cfg)
    with torch.no_grad():
        router.weight.copy_(W)
        router.bias.copy_(b)
    return router.to(mm.device)


@torch.no_grad()
def routing_accuracy(mm, router: LearnedRouter, seqs: Sequence[LabelledSeq]) -> dict:
    """Token-level accuracy of in-network routing on held-out sequences (labels != IGNORE).

    `vote`: the most frequent decision over blocks per token; `block_mean`: all (token, block) decisions.
    """
    hit_vote = hit_block = n_tok = n_block = 0
    for s in seqs:
        ids = torch.tensor([s.ids], device=mm.device)
        mm.context.trace = []
        try:
            mm(ids, adapter_ids=router)
            votes = torch.stack([t[:, 0] for _, t in mm.context.trace]).cpu()  # [blocks, N]
        finally:
            mm.context.trace = None
        lab = torch.tensor(s.labels)
        keep = lab != IGNORE
        if not keep.any():
            continue
        v, y = votes[:, keep], lab[keep]
        hit_block += int((v == y).sum())
        n_block += v.numel()
        mode = torch.mode(v, dim=0).values
        hit_vote += int((mode == y).sum())
        n_tok += int(keep.sum())
    return {
        "token_accuracy": 100.0 * hit_vote / max(1, n_tok),
        "block_accuracy": 100.0 * hit_block / max(1, n_block),
        "tokens": n_tok,
    }
