"""The triton backend equals `lora_delta_reference` (kernels run in Triton's CPU interpreter, TRITON_INTERPRET=1:
slow, so the shapes are tiny), its metadata is sync-free and well formed, and "auto" picks it on CUDA only.

The interpreter tests skip where triton is not installed (it is no test dependency: the wheel is about 285 MB).
`make test-triton` (run by .ci/run) installs it and runs them with MOLORA_REQUIRE_TRITON=1, which turns every such
skip into a failure: there the GPU path is checked on every submission, on the CPU."""

from __future__ import annotations

import importlib.util
import os
import sys

import pytest
import torch

from molora.ops import LoRADispatcher, LoRAInputError, lora_delta, lora_delta_reference, pick_backend

HAS_TRITON = importlib.util.find_spec("triton") is not None
REQUIRE_TRITON = os.environ.get("MOLORA_REQUIRE_TRITON") == "1"  # make test-triton: no skip may hide the GPU path
needs_triton = pytest.mark.skipif(not HAS_TRITON and not REQUIRE_TRITON, reason="triton is not installed")
if HAS_TRITON and "triton" not in sys.modules:
    # Triton decorates its own functions (tl.zeros, ...) for the interpreter only if TRITON_INTERPRET is set when
    # triton is first imported; this module is imported at collection, before any test imports triton. Nothing
    # else in molora runs triton on the CPU, so the setting changes no other test.
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture
def interpret(monkeypatch):
    """Kernels decorated and run by Triton's CPU interpreter."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    import triton.language as tl

    if type(tl.zeros).__name__ != "InterpretedFunction":
        why = "triton was imported before TRITON_INTERPRET=1 was set; run with TRITON_INTERPRET=1"
        if REQUIRE_TRITON:
            pytest.fail(why)
        pytest.skip(why)


def _case(
    T: int, S: int, k: int, R: int, d_in: int, d_out: int, *, dtype=torch.float32, weighted=False, seed=0, used=None
):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, d_in, generator=g)
    A = torch.randn(S, R, d_in, generator=g) * 0.3
    Bt = torch.randn(S, R, d_out, generator=g) * 0.3
    scale = torch.rand(S, generator=g) + 0.5
    choices = torch.tensor(used if used is not None else list(range(-1, S)))
    ids = choices[torch.randint(0, len(choices), (T, k), generator=g)]
    w = torch.rand(T, k, generator=g) if weighted else None
    cast = lambda t: t.to(dtype)
    return cast(x), cast(A), cast(Bt).transpose(1, 2), scale, ids, w  # B [S, D_out, R] slot-major, as the bank


CASES = {
    "mixed": dict(T=9, S=3, k=1, R=4, d_in=40, d_out=24),
    "one token": dict(T=1, S=4, k=1, R=8, d_in=16, d_out=16),
    "one slot": dict(T=6, S=1, k=1, R=16, d_in=32, d_out=20),
    "empty slots": dict(T=7, S=5, k=1, R=4, d_in=24, d_out=40, used=[-1, 3]),
    "all base": dict(T=5, S=2, k=1, R=4, d_in=16, d_out=16, used=[-1]),
    "top-2 weighted": dict(T=6, S=4, k=2, R=8, d_in=32, d_out=70, weighted=True),
    "top-1 weighted": dict(T=8, S=2, k=1, R=3, d_in=24, d_out=33, weighted=True),
    "several tiles per slot": dict(T=70, S=2, k=1, R=4, d_in=16, d_out=16, used=[0, 1]),
}
TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}


@pytest.mark.slow
@needs_triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("case", list(CASES))
def test_triton_equals_the_reference(case, dtype, interpret) -> None:
    x, A, B, scale, ids, w = _case(**CASES[case], dtype=dtype)
    want = lora_delta_reference(x.float(), A.float(), B.float(), scale, ids, w)  # float32 spec
    got = lora_delta(x, A, B, scale, ids, w, backend="triton")
    assert got.dtype == dtype and got.shape == want.shape
    tol = TOL[dtype] * max(1.0, want.abs().max().item())
    torch.testing.assert_close(got.float(), want, atol=tol, rtol=TOL[dtype])


@pytest.mark.slow
@needs_triton
def test_triton_adds_into_out_in_place(interpret) -> None:
    x, A, B, scale, ids, w = _case(**CASES["top-2 weighted"], seed=3)
    dispatch = LoRADispatcher("triton")
    plan = dispatch.plan(ids, w, num_slots=A.shape[0])
    base = torch.randn(x.shape[0], B.shape[1], generator=torch.Generator().manual_seed(4))
    out = base.clone()
    assert dispatch.apply(plan, x, A, B, scale, out=out) is out
    torch.testing.assert_close(out, base + lora_delta_reference(x, A, B, scale, ids, w), atol=1e-5, rtol=1e-5)
    # a second linear on the same plan (its metadata is built once and reused)
    A2, B2 = A.flip(0).contiguous(), B.flip(0)
    torch.testing.assert_close(
        dispatch.apply(plan, x, A2, B2, scale.flip(0)),
        lora_delta_reference(x, A2, B2, scale.flip(0), ids, w),
        atol=1e-5,
        rtol=1e-5,
    )


@pytest.mark.slow
@needs_triton
def test_a_routed_model_on_triton_equals_auto(tmp_path, interpret) -> None:
    import molora
    from tests.conftest import make_peft_adapter, tiny_model

    paths = {
        n: make_peft_adapter(tmp_path / n, "llama", seed=i, targets=("q_proj", "v_proj", "down_proj"))
        for i, n in enumerate("ab")
    }
    ids = torch.randint(3, 100, (2, 5), generator=torch.Generator().manual_seed(0))
    route = torch.randint(-1, 2, (2, 5), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = molora.attach(tiny_model("llama"), paths)(ids, adapter_ids=route).logits
        got = molora.attach(tiny_model("llama"), paths, dispatch="triton")(ids, adapter_ids=route).logits
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


@needs_triton
@pytest.mark.parametrize("T,S,k", [(1, 4, 1), (9, 3, 1), (70, 2, 1), (40, 16, 2), (300, 4, 1)])
def test_the_plan_puts_every_routed_pair_in_one_tile_of_its_slot(T, S, k) -> None:
    from molora.ops.triton_lora import build_plan

    g = torch.Generator().manual_seed(T)
    ids = torch.randint(-1, S, (T, k), generator=g)
    plan = build_plan(ids, None, S)
    bm = plan.block_m
    rows = plan.rows.view(-1, bm)  # [tiles, BM]
    flat = ids.reshape(-1)
    routed = sorted(p for p in range(T * k) if flat[p] >= 0)
    assert sorted(r for r in plan.rows.tolist() if r >= 0) == routed  # each routed pair exactly once
    for tile, slot in enumerate(plan.tile_slot.tolist()):
        pairs = [p for p in rows[tile].tolist() if p >= 0]
        if slot == S:
            assert not pairs  # past the padded total: empty
        else:
            assert pairs and all(flat[p] == slot for p in pairs)  # one slot per tile


@needs_triton
def test_the_plan_reads_nothing_back_from_the_device() -> None:
    """build_plan on meta tensors (no data: any host read raises): the per-slot counts stay on the device."""
    from molora.ops.triton_lora import build_plan

    ids = torch.empty(64, 2, dtype=torch.long, device="meta")
    plan = build_plan(ids, torch.empty(64, 2, device="meta"), 8)
    assert plan.rows.device.type == "meta" and plan.rows.shape[0] == plan.num_tiles * plan.block_m


@needs_triton
def test_tile_sizes_come_from_the_table_by_pair_count() -> None:
    from molora.ops.triton_lora import TILES, tiles_for

    assert [tiles_for(m)[0] for m in (1, 32, 33, 256, 257, 2048, 2049, 10**6)] == [16, 16, 32, 32, 64, 64, 128, 128]
    assert all(a[0] < b[0] for a, b in zip(TILES, TILES[1:]))


def test_auto_picks_triton_on_cuda_only() -> None:
    args = (torch.bfloat16, 512, 4, 1, 16, 4096)
    assert pick_backend("cuda", *args, fused_available=False, bf16_dot=False, triton_available=True) == "triton"
    assert pick_backend("cuda", *args, fused_available=False, bf16_dot=False, triton_available=False) != "triton"
    for fused in (False, True):
        assert pick_backend("cpu", *args, fused_available=fused, bf16_dot=False, triton_available=True) != "triton"


@needs_triton
def test_explicit_triton_on_cpu_without_the_interpreter_is_refused(monkeypatch) -> None:
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    x, A, B, scale, ids, w = _case(**CASES["mixed"])
    with pytest.raises(LoRAInputError, match="CUDA tensors"):
        lora_delta(x, A, B, scale, ids, w, backend="triton")


@needs_triton
def test_explicit_triton_with_autograd_on_is_refused(interpret) -> None:
    x, A, B, scale, ids, w = _case(**CASES["mixed"])
    with torch.enable_grad(), pytest.raises(LoRAInputError, match="no backward"):
        lora_delta(x.requires_grad_(), A, B, scale, ids, w, backend="triton")
