"""Arrow's prototypes (molora.routing.arrow_protos): GenKnowSub on deltas, against dense SVDs."""

from __future__ import annotations

import torch

from molora.routing.arrow_protos import general_subtracted, top_right_singular_vector


def _factors(g: torch.Generator, r: int = 3, d_in: int = 40, d_out: int = 24, scale: float = 2.0):
    return torch.randn(r, d_in, generator=g), torch.randn(d_out, r, generator=g), scale


def _same_direction(u: torch.Tensor, v: torch.Tensor) -> bool:
    return abs(float(u @ v)) > 1 - 1e-5


def test_general_subtracted_is_the_top_vector_of_each_delta_minus_the_mean_delta():
    g = torch.Generator().manual_seed(0)
    per = [_factors(g, scale=s) for s in (1.0, 2.0, 0.5)]
    got = general_subtracted({"m": per})["m"]
    deltas = [s * B @ A for A, B, s in per]  # [d_out, d_in] each
    mean = torch.stack(deltas).mean(0)
    for vec, delta, (A, B, _) in zip(got, deltas, per):
        want = torch.linalg.svd(delta - mean).Vh[0]
        assert _same_direction(vec, want)
        assert not _same_direction(vec, top_right_singular_vector(A, B))  # the subtraction changed it


def test_general_subtracted_skips_absent_adapters_and_keeps_a_lone_adapter_plain():
    g = torch.Generator().manual_seed(1)
    a, b = _factors(g), _factors(g)
    out = general_subtracted({"both": [a, None, b], "lone": [None, a, None]})
    assert out["both"][1] is None and out["lone"][0] is None and out["lone"][2] is None
    mean = (a[2] * a[1] @ a[0] + b[2] * b[1] @ b[0]) / 2
    assert _same_direction(out["both"][0], torch.linalg.svd(a[2] * a[1] @ a[0] - mean).Vh[0])
    assert _same_direction(out["lone"][1], top_right_singular_vector(a[0], a[1]))
