"""Per-token LoRA dispatch kernels: the reference loop and the eager fast versions.

Owns the semantics of `lora_delta` (one function, one meaning, several implementations) and the
boundary checks of its arguments. Knows nothing about adapter names, models or engines: an adapter
is a slot index into stacked tensors, a routing is a tensor of slot ids.

Legend: T tokens, S slots, R rank, D_in / D_out hidden sizes of the target linear, k choices per
token (top-k routing, k <= 2 in practice).

    x        [T, D_in]           activations entering the target linear
    A        [S, R, D_in]        stacked lora_A weights (zero-padded to R = r_max)
    B        [S, D_out, R]       stacked lora_B weights
    scale    [S]                 lora_alpha / r (or / sqrt(r)) per slot
    slot_ids [T] or [T, k]       slot per token and choice; -1 = no adapter
    weights  None or [T, k]      mixing weight per choice (None: all 1)

The semantics, as a plain loop (this is `lora_delta_reference`):

    out = zeros(T, D_out)
    for t in range(T):
        for j in range(k):
            s = slot_ids[t, j]
            if s >= 0:
                out[t] += weights[t, j] * scale[s] * (B[s] @ (A[s] @ x[t]))

`out` is a new tensor in x's dtype; the caller adds it to the base output.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from molora.errors import MoLoRAError


class LoRAInputError(MoLoRAError, ValueError):
    """The arguments of a dispatch op have the wrong rank, shape, dtype or slot-id range."""


# ---------------------------------------------------------------------------------------------
# boundary checks


def _fail(what: str, expected: str, got: object) -> None:
    raise LoRAInputError(f"lora_delta: {what} must be {expected}, got {got}")


def validate_routing(slot_ids: Tensor, weights: Tensor | None) -> None:
    """Check slot_ids [T] or [T, k] (integer) and weights (None or float, shaped like slot_ids [T, k])."""
    if slot_ids.dtype not in (torch.int64, torch.int32) or slot_ids.ndim not in (1, 2):
        _fail("slot_ids", "an int64/int32 tensor [T] or [T, k]", f"{slot_ids.dtype} {tuple(slot_ids.shape)}")
    if weights is not None:
        if slot_ids.ndim != 2 or weights.shape != slot_ids.shape or not weights.is_floating_point():
            _fail(
                "weights",
                f"None or a float tensor shaped like slot_ids [T, k] {tuple(slot_ids.shape)}",
                f"{weights.dtype} {tuple(weights.shape)}",
            )


def validate_tensors(x: Tensor, A: Tensor, B: Tensor, scale: Tensor, num_tokens: int, num_slots: int) -> None:
    """Check x [T, D_in], A [S, R, D_in], B [S, D_out, R], scale [S] against each other and against the
    routing's T and S. Ranks, shapes and dtypes only: no data reads, no sync."""
    if x.ndim != 2 or x.shape[0] != num_tokens:
        _fail("x", f"[T={num_tokens}, D_in] (2-D, one row per slot_ids row)", f"shape {tuple(x.shape)}")
    if A.ndim != 3 or B.ndim != 3 or A.shape[0] != num_slots:
        _fail(
            "A and B",
            f"A [S={num_slots}, R, D_in] and B [S, D_out, R] (S as the routing was built for)",
            f"{tuple(A.shape)} and {tuple(B.shape)}",
        )
    S, R, D_in = A.shape
    if B.shape[0] != S or B.shape[2] != R:
        _fail("B", f"[S={S}, D_out, R={R}] to match A {tuple(A.shape)}", f"{tuple(B.shape)}")
    if x.shape[1] != D_in:
        _fail("x", f"[T, D_in={D_in}] to match A {tuple(A.shape)}", f"{tuple(x.shape)}")
    if scale.shape != (S,) or not scale.is_floating_point():
        _fail("scale", f"a float tensor of shape [S={S}]", f"{scale.dtype} {tuple(scale.shape)}")
    if not x.is_floating_point() or A.dtype != x.dtype or B.dtype != x.dtype:
        _fail("x, A, B dtypes", "one floating dtype (cast the bank to x's dtype)", f"{x.dtype}, {A.dtype}, {B.dtype}")


def validate_slot_range(slot_ids: Tensor, num_slots: int) -> None:
    """Check -1 <= slot_ids < S. Reads the data (one device sync on GPU); skip it inside graphs."""
    if slot_ids.numel() == 0:
        return
    lo, hi = torch.stack([slot_ids.min(), slot_ids.max()]).tolist()  # one host read for both
    if lo < -1 or hi >= num_slots:
        _fail(
            "slot_ids values", f"in [-1, S-1] = [-1, {num_slots - 1}] (-1 means no adapter)", f"values in [{lo}, {hi}]"
        )


def as_2d(slot_ids: Tensor) -> Tensor:
    """slot_ids [T] or [T, k] -> [T, k] int64."""
    return (slot_ids if slot_ids.ndim == 2 else slot_ids[:, None]).long()


# ---------------------------------------------------------------------------------------------
# the reference


def lora_delta_reference(
    x: Tensor, A: Tensor, B: Tensor, scale: Tensor, slot_ids: Tensor, weights: Tensor | None = None
) -> Tensor:
    """The spec: the plain loop in the module docstring, token by token. Slow; for tests only.

    x [T, D_in], A [S, R, D_in], B [S, D_out, R], scale [S], slot_ids [T] or [T, k] (-1: none),
    weights None or [T, k]  ->  out [T, D_out] in x's dtype.
    """
    validate_routing(slot_ids, weights)
    validate_tensors(x, A, B, scale, slot_ids.shape[0], A.shape[0])
    validate_slot_range(slot_ids, A.shape[0])
    ids, w = as_2d(slot_ids), None if weights is None else weights.to(x.dtype)
    out = x.new_zeros(x.shape[0], B.shape[1])
    for t in range(ids.shape[0]):
        for j in range(ids.shape[1]):
            s = int(ids[t, j])
            if s < 0:
                continue
            wt = 1.0 if w is None else w[t, j]
            out[t] += wt * scale[s].to(x.dtype) * (B[s] @ (A[s] @ x[t]))
    return out


# ---------------------------------------------------------------------------------------------
# sort_group: sort (token, choice) pairs by slot, one matmul pair per non-empty slot segment


@dataclass(frozen=True)
class SlotGroups:
    """sort_group's routing-only metadata: the routed (token, choice) pairs grouped by slot.
    Depends on slot_ids and weights only, so one step computes it once for all its target linears."""

    counts: list[int]  # [S] pairs per slot (host ints: the one sync)
    tok: Tensor  # [n] token of each routed pair, pairs grouped by slot (stable)
    slot: Tensor  # [n] slot of each pair
    weight: Tensor | None  # [n] weight of each pair (None: all 1)
    row: Tensor  # [T*k] row of the grouped output for pair t*k + j; n (a zero row) if unrouted
    top_k: int


def group_by_slot(ids: Tensor, w: Tensor | None, num_slots: int) -> SlotGroups:
    """Flatten the M = T*k (token, choice) pairs, drop the -1s, stable-sort the rest by slot.
    ids [T, k] int64 (-1: none), w None or [T, k]  ->  SlotGroups (one argsort, one bincount)."""
    T, k = ids.shape
    S = num_slots
    key = ids.reshape(-1)  # [M], M = T*k, pair p = t*k + j
    key = torch.where(key >= 0, key, S)  # -1 -> sentinel S, sorts last
    order = torch.argsort(key, stable=True)  # [M] pairs grouped by slot
    counts = torch.bincount(key, minlength=S + 1).tolist()  # [S+1] host ints: the one sync
    n_used = T * k - counts[S]
    order = order[:n_used]  # [n] pairs that have an adapter
    row = torch.full((T * k,), n_used, dtype=torch.long, device=ids.device)
    row[order] = torch.arange(n_used, device=ids.device)  # [M] pair -> row of the grouped output
    return SlotGroups(
        counts=counts[:S],
        tok=order // k if k > 1 else order,
        slot=key[order],
        weight=None if w is None else w.reshape(-1)[order],
        row=row,
        top_k=k,
    )


def pair_coefficients(g: SlotGroups, scale: Tensor, dtype: torch.dtype) -> Tensor:
    """[n] scale[slot] (* weight) of each routed pair of `g`, in `dtype`."""
    coeff = scale.to(dtype)[g.slot]
    return coeff if g.weight is None else coeff * g.weight.to(dtype)


def sort_group_apply(
    g: SlotGroups, x: Tensor, A: Tensor, B: Tensor, scale: Tensor, out: Tensor | None = None
) -> Tensor:
    """The sort_group backend. Per non-empty slot segment s (at most S of them):
    (x[tok_s] @ A[s].T) * coeff -> [n_s, R], @ B[s].T -> [n_s, D_out]; then the rows go back to their
    tokens by one gather (faster than index_add_ on CPU, deterministic on GPU).
    Work ~ T*k*R*(D_in+D_out): each pair goes through its own adapter only. Fastest for large T.
    out: None (return a new [T, D_out] delta) or a [T, D_out] tensor the delta is added to in place."""
    T, k = g.row.shape[0] // g.top_k, g.top_k
    n_used, D_out = g.tok.shape[0], B.shape[1]
    coeff = pair_coefficients(g, scale, x.dtype)  # [n] scale[s] (* weight)
    xs = x.index_select(0, g.tok)  # [n, D_in] rows grouped by slot
    y = x.new_empty(n_used + 1, D_out)  # [n + 1, D_out]; row n stays zero
    y[n_used].zero_()
    # mm(out=) skips a copy but has no autograd; training (adapters, routers) takes the copy.
    grad = torch.is_grad_enabled() and any(t.requires_grad for t in (x, A, B, coeff))
    off = 0
    for s, n in enumerate(g.counts):
        if n == 0:
            continue
        h = torch.mm(xs[off : off + n], A[s].t())  # [n_s, R]
        h.mul_(coeff[off : off + n, None])
        if grad:
            y[off : off + n] = torch.mm(h, B[s].t())  # [n_s, D_out]
        else:
            torch.mm(h, B[s].t(), out=y[off : off + n])
        off += n
    delta = y.index_select(0, g.row)  # [M, D_out], zero rows for -1
    delta = delta if k == 1 else delta.view(T, k, D_out).sum(1)  # [T, D_out]
    return delta if out is None else out.add_(delta)


# ---------------------------------------------------------------------------------------------
# stacked_mask: every token through every slot, masked by a dense coefficient; static shapes


def slot_weights(ids: Tensor, w: Tensor | None, num_slots: int, dtype: torch.dtype) -> Tensor:
    """W [T, S] with W[t, s] = sum_j w[t, j] * (ids[t, j] == s). No data-dependent shapes, no sync."""
    T, k = ids.shape
    key = torch.where(ids >= 0, ids, num_slots)  # [T, k], -1 -> dump column S
    src = torch.ones(T, k, dtype=dtype, device=ids.device) if w is None else w.to(dtype)
    W = torch.zeros(T, num_slots + 1, dtype=dtype, device=ids.device).scatter_add_(1, key, src)
    return W[:, :num_slots]  # [T, S]


def stacked_mask_apply(W: Tensor, x: Tensor, A: Tensor, B: Tensor, scale: Tensor, out: Tensor | None = None) -> Tensor:
    """The stacked_mask backend: every token through every slot, masked; no sort, no host read, static
    shapes (CUDA-graph friendly). W [T, S] from `slot_weights`. One GEMM for all down-projections and,
    when B is stored slot-major (B.transpose(1, 2) contiguous, as `LoRASlots` keeps it), one for all
    up-projections:

        H   = x @ A.reshape(S*R, D_in).T                    [T, S*R]   (a view of A, no copy)
        H  *= (W * scale)[:, :, None]                       [T, S, R]
        out = H @ B.transpose(1, 2).reshape(S*R, D_out)     [T, D_out] (a view of B, no copy)

    With any other B layout the up-projection is one accumulating GEMM per slot (a transposed copy of
    B per call measured slower for T <= 512: it reads all of B every call).
    Work ~ T*S*R*(D_in+D_out), S/k times sort_group's, so it wins only while T and S*R are small.
    out: None (return a new [T, D_out] delta) or a [T, D_out] tensor the delta is added to in place.
    """
    T = x.shape[0]
    S, R, D_in = A.shape
    C = W.to(x.dtype) * scale.to(x.dtype)  # [T, S]
    H = torch.mm(x, A.reshape(S * R, D_in).t())  # [T, S*R]
    if torch.is_grad_enabled() and any(t.requires_grad for t in (x, A, C)):
        H = H.view(T, S, R) * C[:, :, None]  # training keeps the product out of place
    else:
        H = H.view(T, S, R).mul_(C[:, :, None])  # [T, S, R]
    Bt = B.transpose(1, 2)  # [S, R, D_out]
    if Bt.is_contiguous():
        up = Bt.view(S * R, B.shape[1])  # [S*R, D_out]
        return torch.mm(H.view(T, S * R), up) if out is None else out.addmm_(H.view(T, S * R), up)
    start = 0
    if out is None:
        out, start = torch.mm(H[:, 0], B[0].t()), 1  # [T, D_out]
    for s in range(start, S):
        out.addmm_(H[:, s], B[s].t())
    return out
