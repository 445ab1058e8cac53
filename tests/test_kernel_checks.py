"""Every entry point of molora's C++ CPU kernels (molora/ops/csrc) checks its inputs before it touches memory: a
shape, stride, dtype, device or index that disagrees raises a RuntimeError naming the function and the argument,
never a crash or a silent write past a buffer (the cases AddressSanitizer found: rope_write past the cache,
add_rms_norm past its buffers, paged_decode trusting its tables, lora_fused_ with a token listed twice; greedy_rows,
which crashed on an empty vocabulary, is deleted: it did not pay, docs/kernel_keep_*.json). One test per check: each
starts from valid arguments (which must run), breaks one thing, and asserts the error. The kernels are called as the
torch ops they are (torch.ops.molora.<name>), below molora.ops.fused_cpu's wrappers, which filter some of these cases
out themselves."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from tests.conftest import gen

META = torch.device("meta")


class _Library:
    """The kernels as torch registered them: torch.ops.molora.<op>, and torch.classes.molora.BoundBlock."""

    def __getattr__(self, name: str) -> object:
        return torch.classes.molora.BoundBlock if name == "BoundBlock" else getattr(torch.ops.molora, name)


@pytest.fixture(scope="module")
def mod():
    from molora.ops import kernel_build

    if kernel_build.load() is None:
        pytest.skip(f"no kernel build here: {kernel_build.unavailable_reason()}")
    return _Library()


def _run(fn: Callable, args: dict, **change) -> object:
    """fn(**args with `change` applied); a change that is a callable gets the original value."""
    call = dict(args)
    for k, v in change.items():
        call[k] = v(args[k]) if callable(v) else v
    return fn(*call.values())


def _check(mod, kernel: str, make: Callable[[], dict], change: dict, match: str) -> None:
    """The valid arguments run; with `change` the kernel raises a RuntimeError matching `match`."""
    fn = getattr(mod, kernel)
    with torch.inference_mode():
        _run(fn, make())
        with pytest.raises(RuntimeError, match=match):
            _run(fn, make(), **change)


# ------------------------------------------------------------------------------------------- lora_fused_


def lora_args(T: int = 6, S: int = 3, R: int = 4, d_in: int = 16, d_out: int = 24) -> dict:
    g = gen(1)
    return dict(
        out=torch.zeros(T, d_out),
        x=torch.randn(T, d_in, generator=g),
        A=torch.randn(S, R, d_in, generator=g),
        B=torch.randn(S, R, d_out, generator=g).transpose(1, 2),  # slot-major, as the bank keeps it
        tok=torch.tensor([0, 3, 1, 5, 2]),
        scale=torch.ones(S),
        weight=torch.empty(0),
        counts=[2, 2, 1],
    )


LORA = {
    "x width differs from A's": (dict(x=torch.zeros(6, 17)), "shapes disagree"),
    "out rows differ from x's": (dict(out=torch.zeros(5, 24)), "shapes disagree"),
    "B rank differs from A's": (dict(B=torch.zeros(3, 24, 5)), "shapes disagree"),
    "dtypes differ": (dict(A=lambda a: a.bfloat16()), "one dtype"),
    "a tensor not on the CPU": (dict(x=torch.empty(6, 16, device=META)), "x must be a CPU tensor"),
    "tok not int64": (dict(tok=lambda t: t.int()), "tok int64"),
    "more counts than slots": (dict(counts=[1, 1, 1, 2]), "at most S"),
    "scale not [S]": (dict(scale=torch.ones(4)), r"scale \[S\]"),
    "a negative count": (dict(counts=[2, -1, 1]), "negative count"),
    "counts name more pairs than tok holds": (dict(counts=[3, 2, 1]), "pairs"),
    "fewer weights than pairs": (dict(weight=torch.ones(3)), "pairs"),
    "a token outside x's rows": (dict(tok=torch.tensor([0, 3, 1, 6, 2])), "token 6 of 6"),
    "a negative token": (dict(tok=torch.tensor([0, -1, 1, 5, 2])), "token -1 of 6"),
    "a token listed twice in one block": (dict(tok=torch.tensor([0, 3, 1, 1, 2])), "listed twice"),
    "a token listed under two slots": (dict(tok=torch.tensor([0, 3, 1, 5, 0])), "listed twice"),
}


@pytest.mark.parametrize("case", list(LORA))
def test_lora_fused_checks(mod, case):
    change, match = LORA[case]
    _check(mod, "lora_fused_", lora_args, change, match)


# ------------------------------------------------------------------------------------------- paged decode

BS, NBLK, HD = 4, 6, 16  # block size, blocks in the cache, head dim


def paged_args(rows: bool = False) -> dict:
    """3 sequences of 5, 8 and 1 tokens; q, out [T, H, hd] (T = 3, or 5 with rows); cache of NBLK blocks."""
    g = gen(2)
    T = 5 if rows else 3
    args = dict(
        out=torch.zeros(T, 4, HD),
        q=torch.randn(T, 4, HD, generator=g),
        kc=torch.randn(NBLK * BS, 2, HD, generator=g),
        vc=torch.randn(NBLK * BS, 2, HD, generator=g),
        tables=torch.tensor([[0, 1], [2, 3], [5, -1]]),  # -1: a table's unused tail, never read
        ctx=torch.tensor([5, 8, 1]),
    )
    if rows:
        args["rows"] = torch.tensor([4, 0, 2])
    return {**args, "block_size": BS, "scale": 0.25, "window": 0}


PAGED = {
    "ctx past the sequence's table": (dict(ctx=torch.tensor([5, 9, 1])), r"ctx\[1\] = 9 is outside \[1, 8\]"),
    "an empty context": (dict(ctx=torch.tensor([5, 0, 1])), r"ctx\[1\] = 0"),
    "a block id past the cache": (
        dict(tables=torch.tensor([[0, 1], [2, 6], [5, -1]])),
        r"tables\[1, 1\] = 6 is not a block of the cache",
    ),
    "a negative block id in use": (dict(tables=torch.tensor([[0, -1], [2, 3], [5, -1]])), r"tables\[0, 1\] = -1"),
    "a table row per sequence": (dict(tables=torch.tensor([[0, 1], [2, 3]])), r"tables must be contiguous int64 \[3"),
    "tables not int64": (dict(tables=lambda t: t.int()), "tables must be contiguous int64"),
    "ctx of another length": (dict(ctx=torch.tensor([5, 8])), r"ctx must have shape \[3\]"),
    "ctx not int64": (dict(ctx=lambda t: t.int()), "ctx must be a contiguous int64"),
    "heads not a multiple of kv heads": (
        dict(kc=torch.zeros(NBLK * BS, 3, HD), vc=torch.zeros(NBLK * BS, 3, HD)),
        "multiple of the cache's 3 kv heads",
    ),
    "head dims differ": (dict(kc=torch.zeros(NBLK * BS, 2, 8), vc=torch.zeros(NBLK * BS, 2, 8)), "head_dim 8 differs"),
    "vc shaped unlike kc": (dict(vc=torch.zeros(NBLK * BS - 1, 2, HD)), "must have kc's shape"),
    "out shaped unlike q": (dict(out=lambda o: o[:, :3]), "must have q's shape"),
    "cache dtype differs": (dict(kc=lambda t: t.bfloat16()), "kc is BFloat16 but q is Float"),
    "q of ints": (dict(q=lambda t: t.long(), out=lambda t: t.long()), "float32 or bfloat16"),
    "q heads not contiguous": (dict(q=lambda t: t.transpose(1, 2).contiguous().transpose(1, 2)), "contiguous heads"),
    "block size 0": (dict(block_size=0), "block_size 0 must be >= 1"),
    "a negative window": (dict(window=-1), "window -1"),
    "a cache not on the CPU": (dict(kc=torch.empty(NBLK * BS, 2, HD, device=META)), "kc must be a CPU tensor"),
}
ROWS = {
    "a row past q": (dict(rows=torch.tensor([4, 0, 5])), r"rows\[2\] = 5 is outside \[0, 5\)"),
    "a negative row": (dict(rows=torch.tensor([4, -1, 2])), r"rows\[1\] = -1"),
    "a row listed twice": (dict(rows=torch.tensor([4, 0, 4])), "appears twice"),
    "rows of another length": (dict(rows=torch.tensor([4, 0])), r"tables must be contiguous int64 \[2"),
}


@pytest.mark.parametrize("case", list(PAGED))
def test_paged_decode_checks(mod, case):
    change, match = PAGED[case]
    _check(mod, "paged_decode", paged_args, change, match)


@pytest.mark.parametrize("case", list(PAGED) + list(ROWS))
def test_paged_decode_rows_checks(mod, case):
    change, match = {**PAGED, **ROWS}[case]
    _check(mod, "paged_decode_rows", lambda: paged_args(rows=True), change, match)


def test_paged_decode_reads_only_the_blocks_of_the_window(mod):
    """A sliding window: blocks wholly before it are never read, so an unused id there is accepted."""
    args = paged_args()
    with torch.inference_mode():
        bad_first = torch.tensor([[-7, 1], [2, 3], [5, -1]])
        _run(mod.paged_decode, args, tables=bad_first, window=1)  # sequence 0 reads key 4 alone: block 1
        with pytest.raises(RuntimeError, match=r"tables\[0, 0\] = -7"):
            _run(mod.paged_decode, args, tables=bad_first, window=2)  # keys 3-4: blocks 0 and 1


# ------------------------------------------------------------------------------------------- glue kernels


def norm_args() -> dict:
    g = gen(3)
    return dict(
        h=torch.randn(4, 32, generator=g),
        d=torch.randn(4, 32, generator=g),
        w=torch.ones(32),
        out=torch.empty(4, 32),
        eps=1e-6,
    )


NORM = {
    "weight shorter than a row": (dict(w=torch.ones(31)), r"weight \[31\] must be \[D\] = \[32\]"),
    "weight longer than a row": (dict(w=torch.ones(48)), r"must be \[D\] = \[32\]"),
    "delta of another shape": (dict(d=torch.zeros(4, 16)), "delta .* must have h's shape"),
    "delta with more rows": (dict(d=torch.zeros(5, 32)), "delta .* must have h's shape"),
    "out of another shape": (dict(out=torch.empty(3, 32)), "out .* must have h's shape"),
    "weight of another dtype": (dict(w=lambda w: w.bfloat16()), "weight is BFloat16 but h is Float"),
    "delta of another dtype": (dict(d=lambda d: d.bfloat16()), "delta is BFloat16 but h is Float"),
    "h not [T, D]": (dict(h=torch.zeros(32)), r"h must be \[T, D\]"),
    "h of ints": (
        dict(
            h=lambda h: h.long(),
            d=torch.empty(0),
            w=torch.ones(32, dtype=torch.long),
            out=torch.empty(4, 32, dtype=torch.long),
        ),
        "float32 or bfloat16",
    ),
    "rows with a column stride": (dict(h=lambda h: h.t().contiguous().t()), "unit stride"),
    "h not on the CPU": (dict(h=torch.empty(4, 32, device=META)), "h must be a CPU tensor"),
}


@pytest.mark.parametrize("case", list(NORM))
def test_add_rms_norm_checks(mod, case):
    change, match = NORM[case]
    _check(mod, "add_rms_norm", norm_args, change, match)


P_ROWS = 10  # rows of the cos / sin tables


def rope_args() -> dict:
    g = gen(4)
    return dict(
        q=torch.randn(3, 4, 8, generator=g),
        k=torch.randn(3, 2, 8, generator=g),
        v=torch.randn(3, 2, 8, generator=g),
        cos=torch.randn(P_ROWS, 8, generator=g),
        sin=torch.randn(P_ROWS, 8, generator=g),
        pos=torch.tensor([0, 4, 9]),
        wrows=torch.tensor([2, 7, 11]),
        kc=torch.zeros(12, 2, 8),
        vc=torch.zeros(12, 2, 8),
    )


ROPE = {
    "a position past the tables": (dict(pos=torch.tensor([0, 10, 9])), r"positions\[1\] = 10 is outside \[0, 10\)"),
    "a negative position": (dict(pos=torch.tensor([0, 4, -1])), r"positions\[2\] = -1"),
    "a write row past the cache": (dict(wrows=torch.tensor([2, 12, 11])), r"write_rows\[1\] = 12 is outside \[0, 12\)"),
    "a negative write row": (dict(wrows=torch.tensor([-3, 7, 11])), r"write_rows\[0\] = -3"),
    "positions of another length": (dict(pos=torch.tensor([0, 4])), r"positions must have shape \[3\]"),
    "write rows not int64": (dict(wrows=lambda t: t.int()), "write_rows must be a contiguous int64"),
    "k with other rows": (dict(k=torch.zeros(2, 2, 8)), "k .* and v .* must both be"),
    "v shaped unlike k": (dict(v=torch.zeros(3, 1, 8)), "k .* and v .* must both be"),
    "cache kv heads differ": (dict(kc=torch.zeros(12, 1, 8), vc=torch.zeros(12, 1, 8)), r"must both be \[N, 2, 8\]"),
    "vc shaped unlike kc": (dict(vc=torch.zeros(11, 2, 8)), r"must both be \[N, 2, 8\]"),
    "tables of another width": (
        dict(cos=torch.zeros(P_ROWS, 6), sin=torch.zeros(P_ROWS, 6)),
        r"must both be \[positions, 8\]",
    ),
    "an odd head dim": (
        dict(
            q=torch.zeros(3, 4, 7),
            k=torch.zeros(3, 2, 7),
            v=torch.zeros(3, 2, 7),
            cos=torch.zeros(P_ROWS, 7),
            sin=torch.zeros(P_ROWS, 7),
            kc=torch.zeros(12, 2, 7),
            vc=torch.zeros(12, 2, 7),
        ),
        "must be even",
    ),
    "cache of another dtype": (dict(kc=lambda t: t.bfloat16()), "kc is BFloat16 but q is Float"),
    "q heads not contiguous": (dict(q=lambda t: t.transpose(1, 2).contiguous().transpose(1, 2)), "layout"),
    "q not [T, H, hd]": (dict(q=torch.zeros(3, 32)), r"q must be \[T, H, head_dim\]"),
    "a cache not on the CPU": (dict(vc=torch.empty(12, 2, 8, device=META)), "vc must be a CPU tensor"),
}


@pytest.mark.parametrize("case", list(ROPE))
def test_rope_write_checks(mod, case):
    change, match = ROPE[case]
    _check(mod, "rope_write", rope_args, change, match)


def silu_args() -> dict:
    g = gen(5)
    return dict(g=torch.randn(4, 24, generator=g), u=torch.randn(4, 24, generator=g))


SILU = {
    "up of another shape": (dict(u=torch.zeros(4, 16)), "up .* must have gate's shape"),
    "up of another dtype": (dict(u=lambda u: u.bfloat16()), "up is BFloat16 but gate is Float"),
    "gate not [T, D]": (dict(g=torch.zeros(24), u=torch.zeros(24)), r"gate must be \[T, D\]"),
    "rows with a column stride": (dict(u=lambda u: u.t().contiguous().t()), "unit stride"),
    "up not on the CPU": (dict(u=torch.empty(4, 24, device=META)), "up must be a CPU tensor"),
}


@pytest.mark.parametrize("case", list(SILU))
def test_silu_mul_checks(mod, case):
    change, match = SILU[case]
    _check(mod, "silu_mul", silu_args, change, match)


# ------------------------------------------------------------------------------------------- packed GEMMs


def panels_args() -> dict:
    g = gen(7)
    return dict(
        y=torch.empty(5, 32),
        x=torch.randn(5, 24, generator=g),
        P=torch.randn(2, 24, 16, generator=g),
        bias=torch.empty(0),
    )


PANELS = {
    "x width differs from the panels'": (dict(x=torch.zeros(5, 23)), "linear_panels: float32 x"),
    "y of another width": (dict(y=torch.empty(5, 48)), "linear_panels: float32 x"),
    "y of other rows": (dict(y=torch.empty(4, 32)), "linear_panels: float32 x"),
    "y not [M, N]": (dict(y=torch.empty(5, 32, 1)), "linear_panels: float32 x"),
    "a bias of another length": (dict(bias=torch.zeros(31)), "bias"),
    "panels not 16 wide": (dict(P=torch.zeros(2, 24, 8)), "P .N/16, K, 16."),
    "bfloat16 x": (dict(x=lambda x: x.bfloat16()), "linear_panels: float32 x"),
    "x not on the CPU": (dict(x=torch.empty(5, 24, device=META)), "x must be a CPU tensor"),
}


@pytest.mark.parametrize("case", list(PANELS))
def test_linear_panels_checks(mod, case):
    change, match = PANELS[case]
    _check(mod, "linear_panels", panels_args, change, match)


def amx_args() -> dict:
    g = gen(8)
    return dict(
        y=torch.empty(5, 32, dtype=torch.bfloat16),
        x=torch.randn(5, 64, generator=g).bfloat16(),
        P=torch.randn(2, 2, 16, 32, generator=g).bfloat16(),
        bias=torch.empty(0, dtype=torch.bfloat16),
    )


AMX = {
    "x width differs from the tiles'": (dict(x=torch.zeros(5, 32, dtype=torch.bfloat16)), "linear_amx: bfloat16 x"),
    "y of another width": (dict(y=torch.empty(5, 16, dtype=torch.bfloat16)), "linear_amx: bfloat16 x"),
    "y not [M, N]": (dict(y=torch.empty(5, 32, 1, dtype=torch.bfloat16)), "linear_amx: bfloat16 x"),
    "a bias of another length": (dict(bias=torch.zeros(8, dtype=torch.bfloat16)), "bias"),
    "float32 x": (dict(x=lambda x: x.float()), "linear_amx: bfloat16 x"),
    "x not on the CPU": (dict(x=torch.empty(5, 64, dtype=torch.bfloat16, device=META)), "x must be a CPU tensor"),
}


@pytest.mark.parametrize("case", list(AMX))
def test_linear_amx_checks(mod, case):
    change, match = AMX[case]
    if not mod.amx_ready():  # the shapes are checked first all the same; the valid call cannot run here
        with torch.inference_mode(), pytest.raises(RuntimeError, match=match):
            _run(mod.linear_amx, amx_args(), **change)
        return
    _check(mod, "linear_amx", amx_args, change, match)


def w8_args() -> dict:
    g = gen(10)
    return dict(
        y=torch.empty(5, 20),
        x=torch.randn(5, 32, generator=g),
        q=torch.randint(-127, 128, (20, 32), generator=g, dtype=torch.int8),
        scale=torch.rand(20, generator=g),
        bias=torch.empty(0),
    )


W8 = {
    "x width differs from q's": (dict(x=torch.zeros(5, 48)), "must share K"),
    "K not a multiple of 16": (
        dict(x=torch.zeros(5, 24), q=torch.zeros(20, 24, dtype=torch.int8)),
        "a multiple of 16",
    ),
    "y of another width": (dict(y=torch.empty(5, 16)), "y must be .M, N. = .5, 20."),
    "y of other rows": (dict(y=torch.empty(4, 20)), "y must be .M, N. = .5, 20."),
    "y not [M, N]": (dict(y=torch.empty(5, 20, 1)), "y must be .M, N."),
    "y of another dtype": (dict(y=torch.empty(5, 20, dtype=torch.bfloat16)), "one dtype"),
    "x not [M, K]": (dict(x=torch.zeros(5, 32, 1)), "x must be .M, K."),
    "q not int8": (dict(q=lambda q: q.float()), "q must be a contiguous int8"),
    "q not contiguous": (dict(q=lambda q: q.t().contiguous().t()), "q must be a contiguous int8"),
    "q not [N, K]": (dict(q=lambda q: q[None]), "q must be .N, K."),
    "x with a column stride": (dict(x=lambda x: torch.zeros(32, 5).t()), "unit column stride"),
    "scale of another length": (dict(scale=torch.ones(19)), "scale must be a contiguous float32"),
    "scale in bfloat16": (dict(scale=torch.ones(20, dtype=torch.bfloat16)), "scale must be a contiguous float32"),
    "a bias of another length": (dict(bias=torch.zeros(19)), "bias must be a contiguous"),
    "a bias of another dtype": (dict(bias=torch.zeros(20, dtype=torch.bfloat16)), "one dtype"),
    "int8 x": (dict(x=lambda x: x.to(torch.int8)), "x must be float32 or bfloat16"),
    "x not on the CPU": (dict(x=torch.empty(5, 32, device=META)), "x must be a CPU tensor"),
}


@pytest.mark.parametrize("case", list(W8))
def test_linear_w8_checks(mod, case):
    change, match = W8[case]
    _check(mod, "linear_w8", w8_args, change, match)


def quantize_rows_args() -> dict:
    g = gen(12)
    return dict(
        xq=torch.empty(5, 32, dtype=torch.int8),
        step=torch.empty(5, 1),
        x=torch.randn(5, 32, generator=g),
        smooth=torch.empty(0),
    )


QUANTIZE_ROWS = {
    "xq of another width": (dict(xq=torch.empty(5, 16, dtype=torch.int8)), "xq must be a contiguous int8 .M, K."),
    "xq of other rows": (dict(xq=torch.empty(4, 32, dtype=torch.int8)), "xq must be a contiguous int8 .M, K."),
    "xq not int8": (dict(xq=torch.empty(5, 32)), "xq must be a contiguous int8"),
    "xq not contiguous": (dict(xq=torch.empty(32, 5, dtype=torch.int8).t()), "xq must be a contiguous int8"),
    "step of another length": (dict(step=torch.empty(4, 1)), "step must be a contiguous float32 of M = 5"),
    "step in bfloat16": (dict(step=torch.empty(5, 1, dtype=torch.bfloat16)), "step must be a contiguous float32"),
    "smooth of another length": (dict(smooth=torch.ones(31)), "smooth must be a contiguous float32 .K. = .32."),
    "smooth in bfloat16": (dict(smooth=torch.ones(32, dtype=torch.bfloat16)), "smooth must be a contiguous float32"),
    "x not [M, K]": (dict(x=torch.zeros(5, 32, 1)), "x must be .M, K."),
    "x with a column stride": (dict(x=torch.zeros(32, 5).t()), "unit column stride"),
    "int8 x": (dict(x=lambda x: x.to(torch.int8)), "x must be float32 or bfloat16"),
    "x not on the CPU": (dict(x=torch.empty(5, 32, device=META)), "x must be a CPU tensor"),
}


@pytest.mark.parametrize("case", list(QUANTIZE_ROWS))
def test_quantize_rows_checks(mod, case):
    change, match = QUANTIZE_ROWS[case]
    _check(mod, "quantize_rows_", quantize_rows_args, change, match)


def scale_rows_args() -> dict:
    g = gen(13)
    return dict(
        y=torch.empty(5, 20),
        acc=torch.randint(-1000, 1000, (5, 20), generator=g, dtype=torch.int32),
        step=torch.rand(5, 1, generator=g),
        scale=torch.rand(20, generator=g),
        bias=torch.empty(0),
    )


SCALE_ROWS = {
    "acc of another width": (dict(acc=torch.zeros(5, 16, dtype=torch.int32)), "acc must be a contiguous int32 .M, N."),
    "acc of other rows": (dict(acc=torch.zeros(4, 20, dtype=torch.int32)), "acc must be a contiguous int32 .M, N."),
    "acc not int32": (dict(acc=torch.zeros(5, 20)), "acc must be a contiguous int32"),
    "acc not contiguous": (dict(acc=torch.zeros(20, 5, dtype=torch.int32).t()), "acc must be a contiguous int32"),
    "step of another length": (dict(step=torch.ones(4, 1)), "step must be a contiguous float32 of M = 5"),
    "scale of another length": (dict(scale=torch.ones(19)), "scale must be a contiguous float32 .N. = .20."),
    "scale in bfloat16": (dict(scale=torch.ones(20, dtype=torch.bfloat16)), "scale must be a contiguous float32"),
    "a bias of another length": (dict(bias=torch.zeros(19)), "bias must be a contiguous"),
    "a bias of another dtype": (dict(bias=torch.zeros(20, dtype=torch.bfloat16)), "one dtype"),
    "y not [M, N]": (dict(y=torch.empty(5, 20, 1)), "y must be .M, N."),
    "int32 y": (dict(y=torch.empty(5, 20, dtype=torch.int32)), "y must be float32 or bfloat16"),
    "acc not on the CPU": (dict(acc=torch.empty(5, 20, dtype=torch.int32, device=META)), "acc must be a CPU tensor"),
}


@pytest.mark.parametrize("case", list(SCALE_ROWS))
def test_scale_rows_checks(mod, case):
    change, match = SCALE_ROWS[case]
    _check(mod, "scale_rows_", scale_rows_args, change, match)


def amx_w8_args() -> dict:
    g = gen(11)
    return dict(
        y=torch.empty(5, 32, dtype=torch.bfloat16),
        x=torch.randn(5, 64, generator=g).bfloat16(),
        P=torch.randint(-127, 128, (2, 2, 16, 32), generator=g, dtype=torch.int8),
        scale=torch.rand(32, generator=g),
        bias=torch.empty(0, dtype=torch.bfloat16),
    )


AMX_W8 = {
    "x width differs from the tiles'": (dict(x=torch.zeros(5, 32, dtype=torch.bfloat16)), "linear_amx_w8: bfloat16"),
    "y of another width": (dict(y=torch.empty(5, 16, dtype=torch.bfloat16)), "linear_amx_w8: bfloat16"),
    "bfloat16 tiles": (dict(P=lambda p: p.bfloat16()), "int8 P"),
    "a bias of another length": (dict(bias=torch.zeros(8, dtype=torch.bfloat16)), "bias"),
    "scale of another length": (dict(scale=torch.ones(16)), "scale must be a contiguous float32"),
    "scale in bfloat16": (dict(scale=torch.ones(32, dtype=torch.bfloat16)), "scale must be a contiguous float32"),
    "scale not on the CPU": (dict(scale=torch.ones(32, device=META)), "scale must be a CPU tensor"),
    "float32 x": (dict(x=lambda x: x.float()), "linear_amx_w8: bfloat16 x"),
}


@pytest.mark.parametrize("case", list(AMX_W8))
def test_linear_amx_w8_checks(mod, case):
    change, match = AMX_W8[case]
    if not mod.amx_ready():  # the shapes are checked first all the same; the valid call cannot run here
        with torch.inference_mode(), pytest.raises(RuntimeError, match=match):
            _run(mod.linear_amx_w8, amx_w8_args(), **change)
        return
    _check(mod, "linear_amx_w8", amx_w8_args, change, match)


# ------------------------------------------------------------------------------------------- a bound block


def block_args() -> dict:
    # D 64, 4 heads and 2 kv heads of 16, MLP width 96: q, k, v, o, gate, up, down as float32 panels [N/16, K, 16]
    P = [torch.zeros(n // 16, k, 16) for n, k in ((64, 64), (32, 64), (32, 64), (64, 64), (96, 64), (96, 64), (64, 96))]
    empty = [torch.empty(0)] * 7
    return dict(
        P=P,
        WS=empty,
        bias=empty,
        A=empty,
        B=empty,
        scale=empty,
        ln1=torch.ones(64),
        ln2=torch.ones(64),
        eps=1e-6,
        H=4,
        Hkv=2,
        hd=16,
        cos=torch.ones(8, 16),
        sin=torch.zeros(8, 16),
        kc=torch.zeros(16, 2, 16),
        vc=torch.zeros(16, 2, 16),
        block_size=4,
        scaling=0.25,
        window=0,
        watched=[],
        held=[],
    )


BLOCK = {
    "six linears": (dict(P=[torch.zeros(4, 64, 16)] * 6), "7 linears"),
    "heads not a multiple of kv heads": (dict(Hkv=3), "H must be a positive multiple of Hkv"),
    "no kv heads": (dict(Hkv=0), "H must be a positive multiple of Hkv"),
    "block size 0": (dict(block_size=0), "block_size 0"),
    "a packed weight of 2 dims": (dict(P=[torch.zeros(64, 64)] * 7), "linear 0's weight must be"),
    "int8 weights without scales": (dict(P=[torch.zeros(64, 64, dtype=torch.int8)] * 7), "with 0 scales"),
    "int8 weights of 3 dims": (
        dict(P=[torch.zeros(4, 64, 16, dtype=torch.int8)] * 7, WS=[torch.ones(64)] * 7),
        "linear 0's weight must be",
    ),
    "six weight scales": (dict(WS=[torch.empty(0)] * 6), "7 linears"),
}


@pytest.mark.parametrize("case", list(BLOCK))
def test_bound_block_checks(mod, case):
    change, match = BLOCK[case]
    _check(mod, "BoundBlock", block_args, change, match)


def test_a_bound_block_run_checks_its_step(mod):
    """A bound block's step runs the checked kernels: a write row past the cache raises, nothing is written."""
    args = block_args()
    with torch.inference_mode():
        block = mod.BoundBlock(*args.values())
        h = torch.randn(2, 64, generator=gen(9))
        step = dict(
            block=block,
            h=h,
            delta=torch.empty(0),
            lora=False,
            tok=torch.empty(0, dtype=torch.long),
            weight=torch.empty(0),
            counts=[],
            pos=torch.tensor([3, 1]),
            wrows=torch.tensor([3, 16]),
            tables=torch.tensor([[0], [1]]),
            ctx=torch.tensor([4, 2]),
            rows=torch.tensor([0, 1]),
            clock=torch.empty(0),
        )
        with pytest.raises(RuntimeError, match=r"write_rows\[1\] = 16 is outside \[0, 16\)"):
            _run(mod.run_block, step)
        assert not args["kc"].any() and not args["vc"].any()
        _run(mod.run_block, step, wrows=torch.tensor([3, 5]))  # the same step with a row in range runs
