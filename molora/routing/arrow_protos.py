"""Arrow's prototypes: one unit direction per adapter and adapted linear, from the adapter's weights alone.

Owns the linear algebra (`top_right_singular_vector`) and GenKnowSub (`general_subtracted`): what the router
scores tokens against. Knows nothing of models, blocks or routing decisions (molora.routing.arrow does).

The prototype of adapter e at linear l is the top right singular vector of its delta ΔW[e] = scale·B·A (a
direction in the linear's input space, unit norm, sign arbitrary). Scaling by `scale` changes no single adapter's
vector, but it weighs the adapters against each other once deltas are combined, as GenKnowSub combines them.

**GenKnowSub** (arXiv 2505.10939; PEFT's `use_gks`): subtract a general-knowledge delta ΔW_g from each task
delta before taking its vector, so that what every adapter shares (the chat format, fluent text) stops pulling the
prototypes toward the same directions:

    v[e] = top right singular vector of (ΔW[e] - ΔW_g)

PEFT subtracts the mean of *general adapters'* lora_A and lora_B factors from each task adapter's factors, which
only means a delta difference when all adapters share their initialisation. molora has no general adapter and its
adapters are trained independently, so `general_subtracted` works on deltas and takes ΔW_g = the mean of the
loaded task adapters' deltas (`general="mean"`), all without forming a d_out × d_in matrix:

    ΔW[e] - mean_j ΔW[j] = [s_e B_e, -s_1 B_1 / K, ..., -s_K B_K / K] @ [A_e; A_1; ...; A_K]

a product of factors of rank <= (K + 1)·r, whose right singular vectors come from the same QR trick.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

GENERALS = ("mean",)


@torch.no_grad()
def top_right_singular_vector(
    A: torch.Tensor, B: torch.Tensor, *, method: str = "svd", iters: int = 15, seed: int | None = 0
) -> torch.Tensor:
    """The top right singular vector [d_in] (fp32, unit norm, sign arbitrary) of B @ A, A [r, d_in], B [d_out, r],
    without forming B @ A. svd: B = QR, so B·A = Q(R·A) and the right singular vectors are R·A's ([r, d_in]).
    power: PEFT's estimator, v <- AᵀBᵀB A v normalised, from randn(d_in) drawn with `seed`."""
    A32, B32 = A.float(), B.float()
    if method == "svd":
        _, R = torch.linalg.qr(B32)  # R [r, r]
        _, _, Vh = torch.linalg.svd(R @ A32, full_matrices=False)  # Vh [r, d_in]
        return Vh[0]
    gen = None
    if seed is not None:
        gen = torch.Generator(device=A32.device.type)
        gen.manual_seed(int(seed))
    C = B32.T @ B32  # [r, r]
    v = torch.randn(A32.shape[1], dtype=A32.dtype, device=A32.device, generator=gen)
    v = v / (v.norm() + 1e-8)
    for _ in range(iters):
        w = A32.T @ (C @ (A32 @ v))
        v = w / (w.norm() + 1e-8)
    return v


@torch.no_grad()
def general_subtracted(
    modules: Mapping[str, Sequence[tuple[torch.Tensor, torch.Tensor, float]]],
) -> dict[str, list[torch.Tensor | None]]:
    """GenKnowSub prototypes with the mean delta as the general one (module docstring).

    modules: module path -> per adapter (router order) its (A [r, d_in], B [d_out, r], scale), or None where the
    adapter does not adapt that module. Returns module path -> per adapter the vector [d_in] of ΔW[e] minus the
    mean delta of the adapters present there (None where absent). With one adapter present the difference is zero:
    its plain vector is kept (there is nothing general to subtract)."""
    out: dict[str, list[torch.Tensor | None]] = {}
    for module, per in modules.items():
        present = [w for w in per if w is not None]
        k = len(present)
        vecs: list[torch.Tensor | None] = []
        for w in per:
            if w is None:
                vecs.append(None)
                continue
            A, B, s = w
            if k == 1:
                vecs.append(top_right_singular_vector(A, B))
                continue
            A_cat = torch.cat([A.float()] + [Aj.float() for Aj, _, _ in present])  # [(k+1) r, d_in]
            B_cat = torch.cat([s * B.float()] + [-sj * Bj.float() / k for _, Bj, sj in present], 1)  # [d_out, (k+1) r]
            vecs.append(top_right_singular_vector(A_cat, B_cat))
        out[module] = vecs
    return out
