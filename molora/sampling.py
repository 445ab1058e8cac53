"""Next-token selection from logits: greedy, temperature, top-k, top-p, and top-n logprobs.

Pure tensor functions (layer 1): they know nothing about models, adapters or requests.
"""

from __future__ import annotations

import torch


def filter_logits(logits: torch.Tensor, temperature: float, top_k: int = 0, top_p: float = 1.0) -> torch.Tensor:
    """Scaled logits [B, V] with everything outside top-k / the top-p nucleus set to -inf."""
    out = logits.float() / max(temperature, 1e-6)
    if top_k and top_k < out.shape[-1]:
        kth = torch.topk(out, top_k, dim=-1).values[..., -1:]
        out = out.masked_fill(out < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(out, dim=-1, descending=True)
        probs = sorted_logits.softmax(-1)
        # drop a token when the mass before it already reaches top_p (the first token always stays)
        drop = probs.cumsum(-1) - probs >= top_p
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        out = torch.full_like(out, float("-inf")).scatter(-1, order, sorted_logits)
    return out


def greedy(logits: torch.Tensor) -> torch.Tensor:
    """The index of the first maximum along the last dim, as `argmax` gives it. torch's max reduction is the
    faster kernel on CPU: 0.9 ms against 3.7 ms for bf16 logits [32, 49152], 1.0 against 1.7 ms in fp32
    (measured on this project's 2-core machine)."""
    return logits.max(-1).indices


def sample_next(logits: torch.Tensor, temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0,
                generator: torch.Generator | None = None) -> torch.Tensor:
    """Token ids [B] chosen from logits [B, V]; temperature 0 means greedy (argmax)."""
    if temperature == 0.0:
        return greedy(logits)
    probs = filter_logits(logits, temperature, top_k, top_p).softmax(-1)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)


def top_logprobs(logits: torch.Tensor, chosen: torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(logprob of chosen [B], top-n logprobs [B, n], their ids [B, n]) from raw logits [B, V]."""
    logp = torch.log_softmax(logits.float(), dim=-1)
    chosen_lp = logp.gather(-1, chosen[:, None]).squeeze(-1)
    if n <= 0:
        empty = logp.new_empty(logp.shape[0], 0)
        return chosen_lp, empty, empty.long()
    vals, ids = torch.topk(logp, n, dim=-1)
    return chosen_lp, vals, ids
