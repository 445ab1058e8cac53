"""Every per-token LoRA dispatch backend equals the reference loop (molora.ops)."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch

import molora.ops.gather as gather_module
from molora.ops import (
    BACKENDS,
    LoRABackendError,
    LoRADispatcher,
    lora_delta,
    lora_delta_reference,
    pick_backend,
)
from tests.conftest import gen, load_script

pytestmark = pytest.mark.usefixtures("panels_where_built")  # the panel-packed paths on every CPU

ROOT = Path(__file__).resolve().parents[1]
EAGER = ("sort_group", "stacked_mask", "auto")  # gather compiles; it has its own test below
D_IN, D_OUT, R = 24, 20, 4


def make(T: int, S: int, k: int = 1, *, seed: int = 0, dtype=torch.float32, ids=None, weighted=False):
    """Small-magnitude random inputs (outputs of order 0.1-1) and a random routing with -1s."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, D_IN, generator=g)
    A = torch.randn(S, R, D_IN, generator=g) * 0.3
    B = torch.randn(S, D_OUT, R, generator=g) * 0.3
    scale = torch.rand(S, generator=g) + 0.5
    if ids is None:
        ids = torch.randint(-1, S, (T, k), generator=g)
    w = torch.rand(ids.shape, generator=g) if weighted else None
    return [x.to(dtype), A.to(dtype), B.to(dtype), scale, ids, None if w is None else w.to(dtype)]


def routing_cases() -> dict[str, list]:
    T, S = 37, 5
    g = gen(0)  # the routings given explicitly; the same in every call (the tests call this again)
    return {
        "random_top1_with_unrouted": make(T, S, 1, seed=1),
        "slot_nobody_uses": make(T, S, ids=torch.randint(0, 3, (T, 1), generator=g) * 2),  # slots 1, 3 empty
        "all_tokens_one_adapter": make(T, S, ids=torch.full((T, 1), 3)),
        "no_token_routed": make(T, S, ids=torch.full((T, 1), -1)),
        "single_token": make(1, S, 1, seed=2),
        "single_slot": make(T, 1, ids=torch.randint(-1, 1, (T, 1), generator=g)),
        "flat_slot_ids": make(T, S, ids=torch.randint(-1, S, (T,), generator=g)),
        "top2_weighted": make(T, S, 2, seed=3, weighted=True),
        "top2_same_slot_twice": make(T, S, ids=torch.randint(0, S, (T, 1), generator=g).repeat(1, 2), weighted=True),
        "top2_unweighted": make(T, S, 2, seed=4),
    }


@pytest.mark.parametrize("case", list(routing_cases()))
@pytest.mark.parametrize("backend", EAGER)
def test_backend_equals_reference(backend: str, case: str) -> None:
    args = routing_cases()[case]
    want = lora_delta_reference(*args)
    got = lora_delta(*args, backend=backend)
    assert got.shape == want.shape and got.dtype == want.dtype
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("backend", BACKENDS + ("auto",))
def test_zero_tokens_give_empty_output(backend: str) -> None:
    args = make(0, 3, 2)  # no compile: T = 0 returns before any kernel
    out = lora_delta(*args, backend=backend)
    assert out.shape == (0, D_OUT) and out.dtype == torch.float32


@pytest.mark.parametrize("backend", EAGER)
def test_bf16_close_to_fp32_reference(backend: str) -> None:
    args = make(29, 4, 2, seed=5, dtype=torch.bfloat16, weighted=True)
    got = lora_delta(*args, backend=backend)
    assert got.dtype == torch.bfloat16
    as32 = [a.float() if torch.is_tensor(a) and a.is_floating_point() else a for a in args]
    torch.testing.assert_close(got.float(), lora_delta_reference(*as32), atol=3e-2, rtol=3e-2)


@pytest.mark.parametrize("backend", ("sort_group", "stacked_mask"))
def test_gradients_equal_reference(backend: str) -> None:
    """Adapter and router training backpropagate through the fast kernels."""
    x, A, B, scale, ids, w = make(13, 3, 2, seed=6, weighted=True)

    def grads(fn):
        leaves = [t.clone().requires_grad_() for t in (x, A, B, w)]
        fn(leaves[0], leaves[1], leaves[2], scale, ids, leaves[3]).square().sum().backward()
        return [t.grad for t in leaves]

    want = grads(lora_delta_reference)
    got = grads(lambda *a: lora_delta(*a, backend=backend))
    for g, r in zip(got, want):
        torch.testing.assert_close(g, r, atol=1e-5, rtol=1e-5)


@pytest.mark.slow
def test_compiled_gather_equals_reference() -> None:
    """One compile (~5-30 s on 2 cores, less with a warm inductor cache) covers -1s, empty and repeated
    slots and weights; other cases would each recompile (sizes 0/1 and dtypes specialize)."""
    ids = torch.tensor([[0, 0], [-1, 2], [2, -1], [-1, -1], [0, 2]]).repeat(3, 1)  # slot 1 unused
    args = make(15, 3, ids=ids, weighted=True)
    torch.testing.assert_close(lora_delta(*args, backend="gather"), lora_delta_reference(*args), atol=1e-5, rtol=1e-5)


def eager(T: int, S: int, k: int, rank: int = 16, d: int = 2048) -> str:
    """What "auto" picks where the fused kernel cannot run (CPU float32, so only the cost model decides)."""
    return pick_backend("cpu", torch.float32, T, S, k, rank, d, fused_available=False, bf16_dot=False)


@pytest.mark.parametrize("T", [0, 1, 8, 64, 512, 4096, 65536])
@pytest.mark.parametrize("S", [1, 2, 4, 16, 64])
@pytest.mark.parametrize("k", [1, 2])
@pytest.mark.parametrize("rank", [8, 64])
def test_the_cost_model_picks_an_eager_backend(T: int, S: int, k: int, rank: int) -> None:
    # never compiles, never loops over tokens
    assert eager(T, S, k, rank) in ("sort_group", "stacked_mask")


def test_the_cost_model_stacks_small_steps_and_sorts_large_ones() -> None:
    assert eager(8, 4, 1) == "stacked_mask"  # decode step, few adapters
    assert eager(4096, 16, 1) == "sort_group"  # long prefill, many adapters
    assert eager(64, 16, 1, rank=64) == "sort_group"  # stacking wastes 15/16 of r=64 work
    for T in (1, 64, 4096):
        assert eager(T, 1, 1) == "stacked_mask"  # one slot: nothing to sort


# What "auto" chose before `pick_backend` was split out of `dispatch._resolve`, recorded by running the old
# `LoRADispatcher("auto").backend_for` over this grid (no autograd, B slot-major, fused_cpu.available and
# fused_cpu.bf16_dot patched to the key's values). Key: (device, dtype, fused_available, bf16_dot, k); value:
# one word per PICK_SRD entry, one letter per PICK_TS entry: f fused, m stacked_mask, s sort_group. The cpu top-2 rows
# with the kernel available were since rewritten: the fused kernel runs top-k as one call per choice column (float32
# at any T, bfloat16 while the step's T * k pairs stay under the per-slot threshold).
PICK_SRD = [(1, 16, 576, 1536), (2, 8, 1024, 1024), (4, 16, 576, 1536), (4, 64, 1536, 576), (16, 16, 576, 1536)]
PICK_TS = [0, 1, 8, 47, 48, 95, 96, 191, 192, 383, 384, 767, 768, 1535, 1536, 4096, 6143, 6144]
PICK_LETTER = {"fused": "f", "stacked_mask": "m", "sort_group": "s"}
PICK_EXPECTED = {
    (
        "cpu",
        "float32",
        False,
        False,
        1,
    ): "mmmmmmmmmmmmmmmmmm mmmmmmmmmmmmmmmmmm mmmmmmmmmmmmmmmmmm smmmmsssssssssssss ssmmmmmsssssssssss",
    (
        "cpu",
        "float32",
        False,
        False,
        2,
    ): "mmmmmmmmmmmmmmmmmm mmmmmmmmmmmmmmmmmm mmmmmmmmmmmmmmmmmm mmmmmmmmmmmmmmmmmm mmmmmmmmmsssssssss",
    (
        "cpu",
        "float32",
        True,
        False,
        1,
    ): "ffffffffffffffffff ffffffffffffffffff ffffffffffffffffff ffffffffffffffffff ffffffffffffffffff",
    (
        "cpu",
        "float32",
        True,
        False,
        2,
    ): "ffffffffffffffffff ffffffffffffffffff ffffffffffffffffff ffffffffffffffffff ffffffffffffffffff",
    (
        "cpu",
        "float32",
        True,
        True,
        1,
    ): "ffffffffffffffffff ffffffffffffffffff ffffffffffffffffff ffffffffffffffffff ffffffffffffffffff",
    (
        "cpu",
        "float32",
        True,
        True,
        2,
    ): "ffffffffffffffffff ffffffffffffffffff ffffffffffffffffff ffffffffffffffffff ffffffffffffffffff",
    (
        "cpu",
        "bfloat16",
        False,
        False,
        1,
    ): "mmmmmmmmmmmmmmmmmm mmmmmmmmmmmmmmmmmm mmmmmmmmmmmmmmmmmm smmmmsssssssssssss ssmmmmmsssssssssss",
    (
        "cpu",
        "bfloat16",
        False,
        False,
        2,
    ): "mmmmmmmmmmmmmmmmmm mmmmmmmmmmmmmmmmmm mmmmmmmmmmmmmmmmmm mmmmmmmmmmmmmmmmmm mmmmmmmmmsssssssss",
    (
        "cpu",
        "bfloat16",
        True,
        False,
        1,
    ): "ffffmmmmmmmmmmmmmm ffffffmmmmmmmmmmmm ffffffffmmmmmmmmmm ffffffffssssssssss ffffffffffffssssss",
    (
        "cpu",
        "bfloat16",
        True,
        False,
        2,
    ): "fffmmmmmmmmmmmmmmm ffffmmmmmmmmmmmmmm ffffffmmmmmmmmmmmm ffffffmmmmmmmmmmmm ffffffffffssssssss",
    (
        "cpu",
        "bfloat16",
        True,
        True,
        1,
    ): "ffffffffffmmmmmmmm ffffffffffffmmmmmm ffffffffffffffmmmm ffffffffffffffssss fffffffffffffffffs",
    (
        "cpu",
        "bfloat16",
        True,
        True,
        2,
    ): "ffffffffmmmmmmmmmm ffffffffffmmmmmmmm ffffffffffffmmmmmm ffffffffffffmmmmmm fffffffffffffffsss",
    (
        "cpu",
        "float16",
        False,
        False,
        1,
    ): "mmmmmmmmmmmmmmmmmm mmmmmmmmmmmmmmmmmm mmmmmmmmmmmmmmmmmm smmmmsssssssssssss ssmmmmmsssssssssss",
    (
        "cpu",
        "float16",
        False,
        False,
        2,
    ): "mmmmmmmmmmmmmmmmmm mmmmmmmmmmmmmmmmmm mmmmmmmmmmmmmmmmmm mmmmmmmmmmmmmmmmmm mmmmmmmmmsssssssss",
    (
        "cpu",
        "float16",
        True,
        False,
        1,
    ): "mmmmmmmmmmmmmmmmmm mmmmmmmmmmmmmmmmmm mmmmmmmmmmmmmmmmmm smmmmsssssssssssss ssmmmmmsssssssssss",
    (
        "cpu",
        "float16",
        True,
        False,
        2,
    ): "mmmmmmmmmmmmmmmmmm mmmmmmmmmmmmmmmmmm mmmmmmmmmmmmmmmmmm mmmmmmmmmmmmmmmmmm mmmmmmmmmsssssssss",
    (
        "cpu",
        "float16",
        True,
        True,
        1,
    ): "mmmmmmmmmmmmmmmmmm mmmmmmmmmmmmmmmmmm mmmmmmmmmmmmmmmmmm smmmmsssssssssssss ssmmmmmsssssssssss",
    (
        "cpu",
        "float16",
        True,
        True,
        2,
    ): "mmmmmmmmmmmmmmmmmm mmmmmmmmmmmmmmmmmm mmmmmmmmmmmmmmmmmm mmmmmmmmmmmmmmmmmm mmmmmmmmmsssssssss",
    (
        "meta",
        "float32",
        False,
        False,
        1,
    ): "mmmmmmmmmmmmmmmmmm mmmmmmmmmmmmmmmmmm mmmmmmmmmmmmmmmmmm smmmmsssssssssssss ssmmmmmsssssssssss",
    (
        "meta",
        "float32",
        False,
        False,
        2,
    ): "mmmmmmmmmmmmmmmmmm mmmmmmmmmmmmmmmmmm mmmmmmmmmmmmmmmmmm mmmmmmmmmmmmmmmmmm mmmmmmmmmsssssssss",
    (
        "meta",
        "float32",
        True,
        False,
        1,
    ): "mmmmmmmmmmmmmmmmmm mmmmmmmmmmmmmmmmmm mmmmmmmmmmmmmmmmmm smmmmsssssssssssss ssmmmmmsssssssssss",
    (
        "meta",
        "float32",
        True,
        False,
        2,
    ): "mmmmmmmmmmmmmmmmmm mmmmmmmmmmmmmmmmmm mmmmmmmmmmmmmmmmmm mmmmmmmmmmmmmmmmmm mmmmmmmmmsssssssss",
    (
        "meta",
        "float32",
        True,
        True,
        1,
    ): "mmmmmmmmmmmmmmmmmm mmmmmmmmmmmmmmmmmm mmmmmmmmmmmmmmmmmm smmmmsssssssssssss ssmmmmmsssssssssss",
    (
        "meta",
        "float32",
        True,
        True,
        2,
    ): "mmmmmmmmmmmmmmmmmm mmmmmmmmmmmmmmmmmm mmmmmmmmmmmmmmmmmm mmmmmmmmmmmmmmmmmm mmmmmmmmmsssssssss",
    (
        "meta",
        "bfloat16",
        False,
        False,
        1,
    ): "mmmmmmmmmmmmmmmmmm mmmmmmmmmmmmmmmmmm mmmmmmmmmmmmmmmmmm smmmmsssssssssssss ssmmmmmsssssssssss",
    (
        "meta",
        "bfloat16",
        False,
        False,
        2,
    ): "mmmmmmmmmmmmmmmmmm mmmmmmmmmmmmmmmmmm mmmmmmmmmmmmmmmmmm mmmmmmmmmmmmmmmmmm mmmmmmmmmsssssssss",
    (
        "meta",
        "bfloat16",
        True,
        False,
        1,
    ): "mmmmmmmmmmmmmmmmmm mmmmmmmmmmmmmmmmmm mmmmmmmmmmmmmmmmmm smmmmsssssssssssss ssmmmmmsssssssssss",
    (
        "meta",
        "bfloat16",
        True,
        False,
        2,
    ): "mmmmmmmmmmmmmmmmmm mmmmmmmmmmmmmmmmmm mmmmmmmmmmmmmmmmmm mmmmmmmmmmmmmmmmmm mmmmmmmmmsssssssss",
    (
        "meta",
        "bfloat16",
        True,
        True,
        1,
    ): "mmmmmmmmmmmmmmmmmm mmmmmmmmmmmmmmmmmm mmmmmmmmmmmmmmmmmm smmmmsssssssssssss ssmmmmmsssssssssss",
    (
        "meta",
        "bfloat16",
        True,
        True,
        2,
    ): "mmmmmmmmmmmmmmmmmm mmmmmmmmmmmmmmmmmm mmmmmmmmmmmmmmmmmm mmmmmmmmmmmmmmmmmm mmmmmmmmmsssssssss",
}


def _pick_table(pick) -> dict[tuple, str]:
    """pick(device, dtype, T, S, k, r, d_in, d_out, fused_available, bf16_dot) -> backend, over the recorded grid."""
    return {
        key: " ".join(
            "".join(
                PICK_LETTER[pick(key[0], getattr(torch, key[1]), T, S, key[4], r, d_in, d_out, key[2], key[3])]
                for T in PICK_TS
            )
            for S, r, d_in, d_out in PICK_SRD
        )
        for key in PICK_EXPECTED
    }


def test_pick_backend_keeps_the_choices_of_the_old_resolve() -> None:
    def pure(device, dtype, T, S, k, r, d_in, d_out, fused, dot):
        return pick_backend(device, dtype, T, S, k, r, d_in + d_out, fused_available=fused, bf16_dot=dot)

    assert _pick_table(pure) == PICK_EXPECTED
    # the old code tested device.type == "cpu" only: any other device takes the rows recorded on "meta"
    cuda = _pick_table(lambda _device, *rest: pure("cuda", *rest))
    assert all(cuda[key] == want for key, want in PICK_EXPECTED.items() if key[0] == "meta")


def test_the_dispatcher_resolves_auto_with_pick_backend(monkeypatch) -> None:
    """The same grid through `backend_for` (validation, tensor signature -> pick_backend's arguments, cache)."""
    from molora.ops import fused_cpu

    dispatch = LoRADispatcher("auto")

    def resolved(device, dtype, T, S, k, r, d_in, d_out, fused, dot):
        monkeypatch.setattr(fused_cpu, "available", lambda: fused)
        monkeypatch.setattr(fused_cpu, "bf16_dot", lambda: dot)
        A = torch.empty(S, r, d_in, dtype=dtype, device=device)
        B = torch.empty(S, r, d_out, dtype=dtype, device=device).transpose(1, 2)  # slot-major, as the bank
        x = torch.empty(T, d_in, dtype=dtype, device=device)
        plan = dispatch.plan(torch.zeros(T, k, dtype=torch.long), num_slots=S)
        return dispatch.backend_for(plan, x, A, B, torch.ones(S, device=device))

    with torch.no_grad():
        assert _pick_table(resolved) == PICK_EXPECTED


def test_pick_backend_is_pure(monkeypatch) -> None:
    """No kernel build, no tensors: the choice is a function of its arguments alone."""
    from molora.ops import kernel_build

    monkeypatch.setattr(kernel_build, "load", lambda: pytest.fail("pick_backend must not build or load the kernel"))
    args = ("cpu", torch.bfloat16, 1000, 4, 1, 16, 2112)
    first = [pick_backend(*args, fused_available=f, bf16_dot=b) for f in (False, True) for b in (False, True)]
    assert first == [pick_backend(*args, fused_available=f, bf16_dot=b) for f in (False, True) for b in (False, True)]
    assert first == ["stacked_mask", "stacked_mask", "stacked_mask", "fused"]


def test_dispatch_doc_is_rendered_from_the_records() -> None:
    """docs/dispatch.md's measured block is what tools/make_dispatch_table.py renders from docs/benchmarks.json
    and the constants of pick_backend today (rerun the script after changing either)."""
    script = load_script("make_dispatch_table")
    assert script.main(["--check", "--docs", str(ROOT / "docs")]) == 0


def test_the_kernel_source_ships_with_the_package() -> None:
    import fnmatch
    import tomllib

    from molora.ops import kernel_build

    patterns = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]["molora"]
    files = sorted(kernel_build._CSRC.iterdir())  # every file the build reads (sources and headers) ships
    assert set(kernel_build._SOURCES) <= set(files)
    for path in files:
        rel = path.relative_to(ROOT / "molora").as_posix()
        assert any(fnmatch.fnmatch(rel, p) for p in patterns), rel


def test_unknown_backend_names_the_valid_ones() -> None:
    with pytest.raises(ValueError, match="sort_group.*stacked_mask.*gather"):
        LoRADispatcher("nope")
    with pytest.raises(ValueError, match="auto"):
        lora_delta(*make(2, 2), backend="nope")


def test_dispatcher_logs_its_backend_once_and_matches_reference(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger="molora.ops"):
        dispatch = LoRADispatcher("sort_group")
    assert "sort_group" in caplog.text
    args = make(9, 3, 2, seed=7, weighted=True)
    torch.testing.assert_close(dispatch(*args), lora_delta_reference(*args), atol=1e-5, rtol=1e-5)


def test_one_plan_serves_every_target_linear_of_a_step() -> None:
    """A step checks and sorts its routing once; linears of other shapes (and dtypes) reuse it."""
    x, A, B, scale, ids, w = make(23, 4, 2, seed=8, weighted=True)
    g = torch.Generator().manual_seed(9)
    A2, B2 = torch.randn(4, 8, D_IN, generator=g) * 0.3, torch.randn(4, 40, 8, generator=g) * 0.3
    for backend in EAGER:
        dispatch = LoRADispatcher(backend)
        plan = dispatch.plan(ids, w, num_slots=4)
        for a, b in ((A, B), (A2, B2)):
            torch.testing.assert_close(
                dispatch.apply(plan, x, a, b, scale), lora_delta_reference(x, a, b, scale, ids, w), atol=1e-5, rtol=1e-5
            )
        got16 = dispatch.apply(plan, x.bfloat16(), A.bfloat16(), B.bfloat16(), scale)
        torch.testing.assert_close(got16.float(), lora_delta_reference(x, A, B, scale, ids, w), atol=3e-2, rtol=3e-2)


def test_plan_refuses_a_bank_with_another_slot_count() -> None:
    x, A, B, scale, ids, _ = make(5, 3)
    plan = LoRADispatcher().plan(ids, num_slots=4)
    with pytest.raises(ValueError, match="S=4"):
        LoRADispatcher().apply(plan, x, A, B, scale)


def test_gather_without_a_compiler_raises_a_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    def broken(*args):
        raise RuntimeError("no C++ compiler")

    monkeypatch.setattr(gather_module, "compiled_gather_core", lambda: broken)
    with pytest.raises(LoRABackendError, match="sort_group"):
        lora_delta(*make(3, 2), backend="gather")


def _bad(**over):
    x, A, B, scale, ids, w = make(4, 3, 2, weighted=True)
    d = dict(x=x, A=A, B=B, scale=scale, slot_ids=ids, weights=w) | over
    return d["x"], d["A"], d["B"], d["scale"], d["slot_ids"], d["weights"]


@pytest.mark.parametrize(
    "args, message",
    [
        (_bad(x=torch.zeros(4, D_IN + 1)), "D_in"),
        (_bad(x=torch.zeros(4, 2, D_IN)), r"\[T=4, D_in\]"),
        (_bad(B=torch.zeros(3, D_OUT, R + 1)), "R="),
        (_bad(scale=torch.ones(2)), "scale"),
        (_bad(slot_ids=torch.zeros(5, 2, dtype=torch.long), weights=None), r"x must be \[T=5"),
        (_bad(slot_ids=torch.zeros(4, 2)), "int64"),
        (_bad(weights=torch.ones(4, 1)), "weights"),
        (_bad(A=torch.zeros(3, R, D_IN, dtype=torch.float64)), "dtype"),
        (_bad(slot_ids=torch.tensor([[0, 3]] * 4)), r"\[-1, 2\]"),
        (_bad(slot_ids=torch.tensor([[0, -2]] * 4)), "-1 means no adapter"),
    ],
)
def test_bad_arguments_raise_value_error_saying_what_was_expected(args, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        lora_delta(*args)


@pytest.mark.parametrize("case", list(routing_cases()))
@pytest.mark.parametrize("backend", EAGER)
def test_slot_major_b_and_in_place_out_equal_reference(backend: str, case: str) -> None:
    """B as the bank stores it (a transposed view of [S, R, D_out]: stacked_mask's one-GEMM path), and the
    delta added into a given `out` in place (what a routed linear does with its base output)."""
    x, A, B, scale, ids, w = routing_cases()[case]
    B_major = B.transpose(1, 2).contiguous().transpose(1, 2)  # same values, slot-major storage
    want = lora_delta_reference(x, A, B, scale, ids, w)
    torch.testing.assert_close(lora_delta(x, A, B_major, scale, ids, w, backend=backend), want, atol=1e-5, rtol=1e-5)
    dispatch = LoRADispatcher(backend)
    base = torch.randn(x.shape[0], D_OUT, generator=torch.Generator().manual_seed(5))
    out = base.clone()
    got = dispatch.apply(dispatch.plan(ids, w, num_slots=A.shape[0]), x, A, B_major, scale, out=out)
    assert got is out
    torch.testing.assert_close(out, base + want, atol=1e-5, rtol=1e-5)


def test_out_of_the_wrong_shape_is_refused_and_left_unchanged() -> None:
    x, A, B, scale, ids, _ = make(6, 3)
    dispatch = LoRADispatcher()
    out = torch.zeros(6, D_OUT + 1)
    with pytest.raises(ValueError, match="out must be"):
        dispatch.apply(dispatch.plan(ids, num_slots=3), x, A, B, scale, out=out)
    assert not out.any()


# ------------------------------------------------------------------------------ fused (C++ CPU kernel)


def _fused_or_skip():
    from molora.ops import fused_cpu

    if not fused_cpu.available():
        import shutil

        # with a C++ compiler the kernel must build: a failed build fails these tests instead of hiding
        assert shutil.which("g++") is None and shutil.which("c++") is None, (
            f"a C++ compiler is here but the fused kernel did not build: {fused_cpu.unavailable_reason()}"
        )
        pytest.skip(f"no C++ compiler here, so no fused kernel: {fused_cpu.unavailable_reason()}")
    return fused_cpu


@pytest.mark.parametrize("case", list(routing_cases()))
def test_fused_equals_reference_and_adds_in_place(case: str) -> None:
    """Top-1 and top-k (one kernel call per choice column), weighted or not, the same slot twice in a row."""
    _fused_or_skip()
    x, A, B, scale, ids, w = routing_cases()[case]
    B_major = B.transpose(1, 2).contiguous().transpose(1, 2)
    want = lora_delta_reference(x, A, B, scale, ids, w)
    dispatch = LoRADispatcher("fused")
    base = torch.randn(x.shape[0], D_OUT, generator=torch.Generator().manual_seed(5))
    out = base.clone()
    with torch.no_grad():
        torch.testing.assert_close(
            lora_delta(x, A, B_major, scale, ids, w, backend="fused"), want, atol=1e-5, rtol=1e-5
        )
        got = dispatch.apply(dispatch.plan(ids, w, num_slots=A.shape[0]), x, A, B_major, scale, out=out)
    assert got is out
    torch.testing.assert_close(out, base + want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize(
    "T, S, rank, d_in, d_out", [(37, 5, 6, 40, 136), (130, 3, 16, 64, 192), (5, 2, 9, 17, 65), (1400, 4, 16, 520, 1030)]
)
def test_fused_vector_paths_and_tails_equal_reference(T, S, rank, d_in, d_out) -> None:
    """Shapes that reach the 16-lane shrink, the 64-column expand tiles, their scalar tails, rank tiles of
    4 and 1, and partial blocks of fewer than 4 tokens; weights on top-1 choices; a strided out. The last
    case is large enough (> 4 MB of rows) for the kernel to prefetch the next block's rows."""
    _fused_or_skip()
    g = torch.Generator().manual_seed(T)
    x = torch.randn(T, d_in, generator=g)
    A = torch.randn(S, rank, d_in, generator=g) * 0.2
    B = (torch.randn(S, rank, d_out, generator=g) * 0.2).transpose(1, 2)
    scale = torch.rand(S, generator=g) + 0.5
    ids = torch.randint(-1, S, (T, 1), generator=g)
    w = torch.rand(T, 1, generator=g)
    want = lora_delta_reference(x, A, B, scale, ids, w)
    wide = torch.zeros(T, 2 * d_out)
    with torch.no_grad():
        torch.testing.assert_close(lora_delta(x, A, B, scale, ids, w, backend="fused"), want, atol=1e-5, rtol=1e-5)
        dispatch = LoRADispatcher("fused")
        dispatch.apply(dispatch.plan(ids, w, num_slots=S), x, A, B, scale, out=wide[:, ::2])
    torch.testing.assert_close(wide[:, ::2], want, atol=1e-5, rtol=1e-5)
    assert not wide[:, 1::2].any()


@pytest.mark.parametrize(
    "T, S, rank, d_in, d_out",
    [(37, 5, 6, 40, 136), (5, 2, 9, 17, 65), (1400, 4, 16, 520, 1030), (300, 2, 16, 576, 192)],
)
def test_fused_bf16_paths_equal_reference(T, S, rank, d_in, d_out) -> None:
    """bfloat16: the dot-product shrink with its scalar tail (d_in not a multiple of 32), lone blocks that
    widen B as they read it and runs of blocks that widen a slot's B once; within bf16 rounding of the
    float32 reference computed from the same bf16 inputs, added into a bf16 output."""
    _fused_or_skip()
    g = torch.Generator().manual_seed(T + 1)
    x = torch.randn(T, d_in, generator=g).bfloat16()
    A = (torch.randn(S, rank, d_in, generator=g) * 0.2).bfloat16()
    B = (torch.randn(S, rank, d_out, generator=g) * 0.2).bfloat16().transpose(1, 2)
    scale = torch.rand(S, generator=g) + 0.5
    ids = torch.randint(-1, S, (T, 1), generator=g)
    base = torch.randn(T, d_out, generator=g).bfloat16()
    want = base.float() + lora_delta_reference(x.float(), A.float(), B.float(), scale, ids, None)
    out = base.clone()
    with torch.no_grad():
        dispatch = LoRADispatcher("fused")
        dispatch.apply(dispatch.plan(ids, num_slots=S), x, A, B, scale, out=out)
    torch.testing.assert_close(out.float(), want, atol=1e-2 * want.abs().max().item(), rtol=1e-2)
    unrouted = ids[:, 0] < 0
    assert torch.equal(out[unrouted], base[unrouted])


def test_auto_takes_fused_only_where_it_can_run() -> None:
    _fused_or_skip()
    x, A, B, scale, ids, _ = make(9, 3)
    B_major = B.transpose(1, 2).contiguous().transpose(1, 2)
    dispatch = LoRADispatcher("auto")

    def picked(*, k: int = 1, b=B_major, dtype=torch.float32, T: int = 9) -> str:
        reps = -(-T // ids.shape[0])
        plan = dispatch.plan(ids.repeat(reps, k)[:T], num_slots=3)
        dispatch.apply(plan, x.repeat(reps, 1)[:T].to(dtype), A.to(dtype), b.to(dtype), scale)
        return next(iter(plan.resolved.values()))

    with torch.no_grad():
        assert picked() == "fused"
        assert picked(k=2) == "fused"  # top-2: one kernel call per choice column
        dispatch.max_fused_top_k = 1
        assert picked(k=2) in ("stacked_mask", "sort_group")  # kept to top-1: the eager backends
        assert picked() == "fused"
        dispatch.max_fused_top_k = None
        assert picked(b=B) in ("stacked_mask", "sort_group")  # B not slot-major
        assert picked(dtype=torch.bfloat16) == "fused"
        assert picked(T=1000) == "fused"  # float32: at any T
        # bf16: the eager backends' bf16 GEMMs win from a number of tokens per slot on (3 slots here)
        from molora.ops import dispatch as dispatch_module
        from molora.ops import fused_cpu

        per_slot = (
            dispatch_module.FUSED_BF16_TOKENS_PER_SLOT
            if fused_cpu.bf16_dot()
            else dispatch_module.FUSED_BF16_SOFT_TOKENS_PER_SLOT
        )
        assert picked(dtype=torch.bfloat16, T=per_slot * 3 - 1) == "fused"
        assert picked(dtype=torch.bfloat16, T=per_slot * 3) in ("stacked_mask", "sort_group")
        assert picked(dtype=torch.float64) in ("stacked_mask", "sort_group")
    assert picked() in ("stacked_mask", "sort_group")  # autograd on (training)


def test_fused_refuses_what_it_cannot_run_with_a_clear_error() -> None:
    _fused_or_skip()
    x, A, B, scale, ids, w = make(6, 3, 2)
    with torch.no_grad(), pytest.raises(ValueError, match="slot-major"):
        lora_delta(x, A, B, scale, ids, w, backend="fused")
    with pytest.raises(ValueError, match="autograd off"):
        lora_delta(*make(6, 3), backend="fused")


@pytest.mark.parametrize("T, d_in, d_out", [(37, 40, 136), (9, 64, 192)])
def test_fused_bf16_close_to_fp32_reference(T, d_in, d_out) -> None:
    """bf16 tensors: exact widening, float32 sums, one rounding per output (as close as stacked_mask)."""
    _fused_or_skip()
    g = torch.Generator().manual_seed(d_out)
    x = torch.randn(T, d_in, generator=g)
    A = torch.randn(3, 8, d_in, generator=g) * 0.2
    B = (torch.randn(3, 8, d_out, generator=g) * 0.2).transpose(1, 2)
    scale = torch.rand(3, generator=g) + 0.5
    ids = torch.randint(-1, 3, (T, 1), generator=g)
    base = torch.randn(T, d_out, generator=g)
    args16 = [t.bfloat16() for t in (x, A, B)]
    want = base + lora_delta_reference(*[t.float() for t in args16], scale, ids)
    with torch.no_grad():
        dispatch = LoRADispatcher("fused")
        out = base.bfloat16()
        dispatch.apply(dispatch.plan(ids, num_slots=3), *args16, scale, out=out)
        stacked = lora_delta(*args16, scale, ids, backend="stacked_mask").float() + base.bfloat16().float()
    assert out.dtype == torch.bfloat16
    err, err_stacked = (out.float() - want).abs().max(), (stacked - want).abs().max()
    assert err <= max(2 * err_stacked, 1e-2 * want.abs().max())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("weighted", [False, True])
@pytest.mark.parametrize("k", [1, 2])
def test_add_into_equals_apply_bit_for_bit(dtype, weighted, k) -> None:
    """The routed linears' path: the fused kernel on the plan's prepared arguments, no checks in Python."""
    _fused_or_skip()
    x, A, B, scale, ids, w = make(37, 5, k, dtype=dtype, weighted=weighted)
    B = B.transpose(1, 2).contiguous().transpose(1, 2)
    base = torch.randn(37, D_OUT, generator=torch.Generator().manual_seed(3)).to(dtype)
    for backend in ("auto", "fused"):
        dispatch = LoRADispatcher(backend)
        with torch.inference_mode():
            plan = dispatch.plan(ids, w, num_slots=5)
            assert plan.fused_step(backend, dtype) is not None
            want = dispatch.apply(dispatch.plan(ids, w, num_slots=5), x, A, B, scale, out=base.clone())
            got = base.clone()
            assert dispatch.add_into(plan, x, A, B, scale, got) is got
        assert torch.equal(got, want)


def test_add_into_takes_the_checked_path_where_the_kernel_cannot_run() -> None:
    _fused_or_skip()
    x, A, B, scale, ids, _ = make(9, 3)
    B_major = B.transpose(1, 2).contiguous().transpose(1, 2)
    want = lora_delta_reference(x, A, B, scale, ids)
    dispatch = LoRADispatcher("auto")
    with torch.inference_mode():
        plan = dispatch.plan(ids, num_slots=3)
        wide = torch.zeros(9, 2 * D_IN)
        wide[:, ::2] = x  # x with a column stride of 2: the kernel declines it
        out = torch.zeros(9, D_OUT)
        dispatch.add_into(plan, wide[:, ::2], A, B_major, scale, out)
        torch.testing.assert_close(out, want, atol=1e-5, rtol=1e-5)
        out = torch.zeros(9, D_OUT)
        dispatch.add_into(plan, x, A, B, scale, out)  # B not slot-major: the eager backends
        torch.testing.assert_close(out, want, atol=1e-5, rtol=1e-5)
        assert LoRADispatcher("sort_group").plan(ids, num_slots=3).fused_step("sort_group", torch.float32) is None
    out = torch.zeros(9, D_OUT)
    dispatch.add_into(dispatch.plan(ids, num_slots=3), x, A, B_major, scale, out)  # autograd on
    torch.testing.assert_close(out, want, atol=1e-5, rtol=1e-5)


def test_the_fused_kernel_checks_shapes_itself_and_leaves_out_unchanged() -> None:
    """add_into skips apply's checks in Python; the kernel refuses shapes that disagree, naming them."""
    fused_cpu = _fused_or_skip()
    x, A, B, scale, ids, _ = make(9, 3)
    B = B.transpose(1, 2).contiguous().transpose(1, 2)
    dispatch = LoRADispatcher("auto")
    with torch.inference_mode():
        plan = dispatch.plan(ids, num_slots=3)
        out = torch.zeros(9, D_OUT)
        with pytest.raises(RuntimeError, match="shapes disagree"):
            dispatch.add_into(plan, torch.zeros(9, D_IN + 1), A, B, scale, out)
        with pytest.raises(RuntimeError, match="shapes disagree"):
            dispatch.add_into(plan, x, A, B, scale, torch.zeros(9, D_OUT + 3))
        with pytest.raises(RuntimeError, match="token"):  # a token outside x's rows
            fused_cpu.lora_add(out[:2], x[:2], A, B, scale, torch.tensor([5]), None, [1, 0, 0])
        with pytest.raises(RuntimeError, match="pairs"):  # counts naming more pairs than tok holds
            fused_cpu.lora_add(out, x, A, B, scale, torch.tensor([0]), None, [2, 0, 0])
        assert not out.any()


def test_backend_for_names_what_apply_runs() -> None:
    from molora.ops import fused_cpu
    from molora.ops.lora import LoRAInputError

    g = gen(0)
    x, A, B, scale = (
        torch.randn(6, 8, generator=g),
        torch.randn(3, 2, 8, generator=g),
        torch.randn(3, 8, 2, generator=g),
        torch.ones(3),
    )
    ids = torch.tensor([0, 1, 2, -1, 0, 1])
    auto = LoRADispatcher("auto")
    plan = auto.plan(ids, num_slots=3)
    chosen = auto.backend_for(plan, x, A, B, scale)
    assert chosen in BACKENDS and chosen != "auto"
    if fused_cpu.available():
        major = B.transpose(1, 2).contiguous().transpose(1, 2)  # slot-major, as the bank keeps B
        assert chosen != "fused" and auto.backend_for(plan, x, A, major, scale) != "fused"  # autograd on
        with torch.inference_mode():
            assert auto.backend_for(plan, x, A, B, scale) != "fused"  # B not slot-major
            assert auto.backend_for(plan, x, A, major, scale) == "fused"
    assert LoRADispatcher("stacked_mask").backend_for(plan, x, A, B, scale) == "stacked_mask"
    with pytest.raises(LoRAInputError):  # checked as apply checks: x's width must match A
        auto.backend_for(plan, torch.zeros(6, 5), A, B, scale)


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize(
    "H,Hkv,hd,window",
    [
        (9, 3, 64, None),
        (4, 2, 16, None),
        (4, 2, 16, 5),
        (8, 8, 24, None),
        (10, 2, 64, 6),
        (16, 8, 128, None),
        (12, 2, 128, None),
    ],
)
def test_paged_decode_reads_the_cache_in_place_like_gathered_attention(dtype, tol, H, Hkv, hd, window):
    """The kernel's attention over blocks read where they lie equals softmax attention over the gathered
    context (grouped heads, a sliding window keeping the last `window` keys, a context of one token, one
    long enough for the 16-lane exp), on the register-tiled path (head dims 64 and 128, with 2, 3, 5 and 6 query
    heads per kv head: reductions four at a time, value groups of 4 or 2 heads, and their remainders) and the
    generic one (other head dims)."""
    fused_cpu = _fused_or_skip()
    g = torch.Generator().manual_seed(0)
    bs, blocks = 8, 40
    kc, vc = (torch.randn(blocks * bs, Hkv, hd, generator=g).to(dtype) for _ in range(2))
    ctx, tables = torch.tensor([7, 1, 29]), torch.tensor([[5, 2, 9, 0], [11, 0, 0, 0], [1, 3, 4, 7]])
    q = torch.randn(3, H, hd, generator=g).to(dtype)
    with torch.no_grad():
        out = fused_cpu.paged_decode(q, kc, vc, tables, ctx, bs, hd**-0.5, window)
    for b in range(3):
        rows = torch.cat([torch.arange(t * bs, (t + 1) * bs) for t in tables[b].tolist()])[: int(ctx[b])]
        rows = rows[0 if window is None else max(0, int(ctx[b]) - window) :]
        k, v = kc[rows].float(), vc[rows].float()  # [t, Hkv, hd]
        qq = q[b].float().view(Hkv, H // Hkv, hd)
        p = (torch.einsum("kgd,tkd->kgt", qq, k) * hd**-0.5).softmax(-1)
        want = torch.einsum("kgt,tkd->kgd", p, v).reshape(H, hd)
        assert (out[b].float() - want).abs().max() <= tol
    assert fused_cpu.paged_decode(q.to(torch.float16), kc.half(), vc.half(), tables, ctx, bs, 1.0, None) is None


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("window", [None, 6])
def test_paged_decode_of_a_batch_equals_each_sequence_alone(dtype, window):
    """A batch of many sequences (one task per sequence, all its kv heads) gives each sequence bit for bit what
    it gets alone (one task per kv head), whatever the number of threads."""
    fused_cpu = _fused_or_skip()
    g = torch.Generator().manual_seed(2)
    H, Hkv, hd, bs, B = 9, 3, 64, 4, 12
    kc, vc = (torch.randn(80 * bs, Hkv, hd, generator=g).to(dtype) for _ in range(2))
    tables = torch.randperm(80, generator=g)[: B * 6].view(B, 6)
    ctx = torch.randint(1, 6 * bs + 1, (B,), generator=g)
    q = torch.randn(B, H, hd, generator=g).to(dtype)
    threads = torch.get_num_threads()
    try:
        for n in (1, 2):
            torch.set_num_threads(n)
            with torch.no_grad():
                batch = fused_cpu.paged_decode(q, kc, vc, tables, ctx, bs, hd**-0.5, window)
                alone = torch.cat(
                    [
                        fused_cpu.paged_decode(
                            q[b : b + 1], kc, vc, tables[b : b + 1], ctx[b : b + 1], bs, hd**-0.5, window
                        )
                        for b in range(B)
                    ]
                )
            assert torch.equal(batch, alone)
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_paged_decode_rows_reads_and_writes_rows_of_a_step_in_place(dtype):
    """paged_decode_rows on strided rows of a wider step tensor equals paged_decode on the gathered rows, and
    leaves every other output row alone."""
    fused_cpu = _fused_or_skip()
    g = torch.Generator().manual_seed(1)
    H, Hkv, hd, bs = 4, 2, 16, 8
    kc, vc = (torch.randn(40 * bs, Hkv, hd, generator=g).to(dtype) for _ in range(2))
    ctx, tables = torch.tensor([7, 1, 29]), torch.tensor([[5, 2, 9, 0], [11, 0, 0, 0], [1, 3, 4, 7]])
    wide = torch.randn(6, (H + 2 * Hkv) * hd, generator=g).to(dtype)  # q, k, v side by side
    q = wide[:, : H * hd].view(6, H, hd)  # row stride (H + 2Hkv) hd
    rows = torch.tensor([4, 0, 2])
    out = torch.full((6, H, hd), 7.0, dtype=dtype)
    with torch.no_grad():
        assert fused_cpu.paged_decode_rows(out, q, kc, vc, tables, ctx, rows, bs, hd**-0.5, None)
        want = fused_cpu.paged_decode(q[rows].contiguous(), kc, vc, tables, ctx, bs, hd**-0.5, None)
    assert torch.equal(out[rows], want)
    assert (out[[1, 3, 5]] == 7.0).all()


def _norm_spec(h: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """add_rms_norm's spec: LlamaRMSNorm's formula with the mean of squares taken in float64 and rounded once to
    float32 (the float32 nearest the exact mean, whatever order a sum runs in)."""
    hf = h.float()
    mean = hf.double().pow(2).mean(-1, keepdim=True).float()
    return w * (hf * torch.rsqrt(mean + eps)).to(h.dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_glue_kernels_equal_the_torch_ops(dtype):
    """rope_write is transformers' RoPE bit for bit (and writes K, V to the cache rows); add_rms_norm adds the
    residual bit for bit and normalises with the float32 nearest the exact mean of squares (bit for bit the formula
    with a float64 mean), which is within one float32 ulp or so of LlamaRMSNorm's in float32 and, in bfloat16, equal
    to it but for rare elements one bf16 ulp apart (at every width and row count tried: no replay of torch's own
    summation order); silu_mul is silu(g) * u (to rounding)."""
    fused_cpu = _fused_or_skip()
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    from molora.model.block import rotate_half as _rotate_half

    g = torch.Generator().manual_seed(0)
    T, H, Hkv, hd, P = 7, 9, 3, 64, 50
    qkv = torch.randn(T, (H + 2 * Hkv) * hd, generator=g).to(dtype)
    q, k, v = (t.view(T, -1, hd) for t in qkv.split([H * hd, Hkv * hd, Hkv * hd], 1))  # strided views
    ang = torch.randn(P, hd, generator=g) * 3
    cos, sin = ang.cos().to(dtype), ang.sin().to(dtype)
    pos, rows = torch.randint(0, P, (T,), generator=g), torch.randperm(40, generator=g)[:T]
    kc, vc = torch.zeros(40, Hkv, hd, dtype=dtype), torch.zeros(40, Hkv, hd, dtype=dtype)
    c, s = cos[pos][:, None], sin[pos][:, None]
    want_q, want_k, want_v = q * c + _rotate_half(q) * s, k * c + _rotate_half(k) * s, v.clone()
    with torch.no_grad():
        assert fused_cpu.rope_write(q, k, v, cos, sin, pos, rows, kc, vc)
    assert torch.equal(q, want_q) and torch.equal(k, want_k)
    assert torch.equal(kc[rows], want_k) and torch.equal(vc[rows], want_v)

    h, d = (torch.randn(T, 576, generator=g).to(dtype) for _ in range(2))
    w = (torch.rand(576, generator=g) + 0.5).to(dtype)
    want_h = h + d
    with torch.no_grad():
        out = fused_cpu.add_rms_norm(h, d, w, 1e-5)
    assert torch.equal(h, want_h)
    assert torch.equal(out, _norm_spec(want_h, w, 1e-5))
    tol = 1e-5 if dtype == torch.float32 else 1e-2

    norm = LlamaRMSNorm(1, eps=1e-6)  # transformers' module, at widths below, at and above the 16 lanes
    # float32: within 2e-6 relative of transformers (one ulp of the mean, halved by the square root, and the final
    # rounding); bfloat16: the few elements whose rounding the two means decide differently are one bf16 ulp apart
    # (2^-7 relative at most, twice for the second rounding after the weight), under one in a thousand of them
    rel, share = (2e-6, 1.0) if dtype == torch.float32 else (2.0**-6, 1e-3)
    for width in (1, 7, 15, 16, 63, 64, 100, 256, 576, 960, 1024, 1030, 2048, 4096, 5120, 16384, 20000):
        for rows in (1, 3, 300):
            x = (torch.randn(rows, width, generator=g) * torch.rand(rows, 1, generator=g) * 8).to(dtype)
            norm.weight = torch.nn.Parameter((torch.rand(width, generator=g) + 0.5).to(dtype))
            d = torch.randn(rows, width, generator=g).to(dtype)
            with torch.no_grad():
                want = norm(x + d)
                got = fused_cpu.add_rms_norm(x.clone(), d, norm.weight, 1e-6)
            assert torch.equal(got, _norm_spec(x + d, norm.weight, 1e-6)), (width, rows)
            diff = (got.float() - want.float()).abs()
            assert (diff <= rel * want.float().abs()).all(), (width, rows, diff.max())
            assert (diff > 0).float().mean() <= share, (width, rows)

    gate, up = (torch.randn(T, 1000, generator=g) * 4).to(dtype), torch.randn(T, 1000, generator=g).to(dtype)
    want = torch.nn.functional.silu(gate) * up
    with torch.no_grad():
        assert fused_cpu.silu_mul(gate, up)
    assert ((gate.float() - want.float()).abs() <= tol * want.float().abs().clamp(min=1)).all()
    with torch.enable_grad():  # autograd on: the kernels decline, the caller runs the torch ops
        assert fused_cpu.add_rms_norm(h, None, w, 1e-5) is None and not fused_cpu.silu_mul(gate, up)


@pytest.mark.skipif(
    not __import__("molora.ops.packed", fromlist=["available"]).available(),
    reason="MKL's packed linear is not in this torch build",
)
def test_packed_linear_equals_torch_bit_for_bit_and_follows_weight_changes():
    """PackedLinear (molora.ops.packed) runs its packed GEMM (molora's panel kernel up to PANEL_MAX_ROWS rows, or
    MKL's for a width that is not a multiple of 16) for every row count above one (one packed copy) and equals
    torch.mm / addmm up to float32 rounding (one row, or panels past their limit: torch itself), strided rows
    included; on panels a row's result does not depend on the other rows; a weight changed in place is packed
    again."""
    from torch.profiler import profile

    from molora.ops import fused_cpu
    from molora.ops.packed import PANEL_MAX_ROWS, PackedLinear

    g = torch.Generator().manual_seed(5)
    forms = set()
    for d_out, d_in, bias in ((96, 64, False), (200, 48, True), (64, 150, False), (48, 40, True)):
        w = torch.randn(d_out, d_in, generator=g)
        b = torch.randn(d_out, generator=g) if bias else None
        lin = PackedLinear(w, b)
        forms.add(lin.form)
        with torch.no_grad():
            for T in (1, 2, 3, 9, 31, 32, 33, 257):
                x = torch.randn(T, d_in + 3, generator=g)[:, :d_in]  # rows with a wider stride
                want = torch.mm(x, w.t()) if b is None else torch.addmm(b, x, w.t())
                with profile() as prof:
                    got = lin(x)
                unpacked = any(e.key == "aten::mm" or e.key == "aten::addmm" for e in prof.key_averages())
                torch_rows = T == 1 or (lin.form == "panels" and T > PANEL_MAX_ROWS)
                assert unpacked == torch_rows, (T, "the packed kernel runs for T > 1 (panels: up to their limit)")
                assert torch.equal(got, want) if T == 1 else (got - want).abs().max() <= 1e-4, (d_out, d_in, T)
                if lin.form == "panels" and not torch_rows:  # each row's sum in k order: a row's result is its own
                    assert torch.equal(lin(x[:2]), got[:2]) and torch.equal(lin(x[-2:]), got[-2:]), T
            x = torch.randn(8, d_in, generator=g)
            w.mul_(0.5)  # in place: version moves
            want = torch.mm(x, w.t()) if b is None else torch.addmm(b, x, w.t())
            assert (lin(x) - want).abs().max() <= 1e-4
    # molora's panel kernel packs widths that are multiples of 16, MKL the others (200), where each is built
    assert forms == ({"panels"} if fused_cpu.available() else set()) | {"mkl"}
    with pytest.raises(ValueError, match="float32 CPU"):
        PackedLinear(torch.zeros(4, 4, dtype=torch.bfloat16))


def test_amx_linear_equals_torch_bf16_and_each_row_is_its_own():
    """bfloat16 on AMX tiles (molora.ops.packed form "amx"): torch's bf16 linear bit for bit up to 32 rows (torch's
    oneDNN computes the same sums in the same order there; above, torch's blocking changes and a few outputs move by
    a bf16 rounding), a row's result independent of the other rows at every T the kernel serves, strided rows, a bias
    added before the one rounding, an odd panel count, a weight changed in place packed again."""
    from molora.ops import fused_cpu
    from molora.ops.packed import PANEL_MAX_ROWS, PackedLinear, form

    if not fused_cpu.amx():
        pytest.skip(f"no AMX-BF16 tile unit here (or no kernel build: {fused_cpu.unavailable_reason()})")
    g = torch.Generator().manual_seed(6)
    for d_out, d_in, bias in ((96, 64, False), (48, 160, True), (576, 576, False), (16, 32, True)):
        w = (torch.randn(d_out, d_in, generator=g) * 0.1).bfloat16()
        b = (torch.randn(d_out, generator=g)).bfloat16() if bias else None
        lin = PackedLinear(w, b)
        assert lin.form == "amx"
        with torch.no_grad():
            for T in (1, 2, 3, 16, 17, 31, 32, 33, 100, PANEL_MAX_ROWS, PANEL_MAX_ROWS + 1):
                x = torch.randn(T, d_in + 8, generator=g).bfloat16()[:, :d_in]  # rows with a wider stride
                got, want = lin(x), torch.nn.functional.linear(x, w, b)
                assert got.dtype == torch.bfloat16 and got.shape == want.shape
                if T <= 32 or T > PANEL_MAX_ROWS:
                    assert torch.equal(got, want), (d_out, d_in, T)
                else:
                    assert (got != want).float().mean() < 1e-2
                    assert (got.float() - want.float()).abs().max() <= 1e-2 * want.float().abs().max()
                if 2 <= T <= PANEL_MAX_ROWS:
                    assert torch.equal(lin(x[:2]), got[:2]) and torch.equal(lin(x[-3:]), got[-3:]), T
            w.mul_(0.5)  # in place: packed again
            x = torch.randn(8, d_in, generator=g).bfloat16()
            assert torch.equal(lin(x), torch.nn.functional.linear(x, w, b))
    assert form(torch.zeros(48, 40).bfloat16()) == "torch"  # K not a multiple of 32: torch's GEMM
    assert form(torch.zeros(40, 64).bfloat16()) == "torch"  # N not a multiple of 16


def test_kernel_clock_times_the_kernels_called_inside_its_block_only():
    """fused_cpu.kernel_clock: the bench's decode-step kernel share without torch.profiler."""
    fused_cpu = _fused_or_skip()
    x, A, B, scale, ids, _ = make(9, 3)
    B = B.transpose(1, 2).contiguous().transpose(1, 2)
    dispatch = LoRADispatcher("fused")
    with torch.inference_mode():
        plan = dispatch.plan(ids, num_slots=3)
        with fused_cpu.kernel_clock() as clock:
            dispatch.apply(plan, x, A, B, scale)
            seen = dict(clock)
        dispatch.apply(plan, x, A, B, scale)  # after the block: not counted
    assert set(seen) == {"molora::lora_fused_"} and seen["molora::lora_fused_"] > 0 and clock == seen
