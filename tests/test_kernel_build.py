"""The C++ kernels' build (molora.ops.fused_cpu): keyed by a hash of what it is built from, so an edited source
builds anew and two checkouts with different sources never share a build; without a compiler molora says so once
and runs the eager backends."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from molora.ops import fused_cpu, kernel_build

pytestmark = pytest.mark.usefixtures("panels_where_built")  # the panel-packed paths on every CPU

ROOT = Path(__file__).resolve().parents[1]


def test_the_build_key_follows_every_source_file_and_the_flags(tmp_path, monkeypatch):
    here = kernel_build.build_key()
    csrc = tmp_path / "csrc"
    shutil.copytree(kernel_build._CSRC, csrc)
    monkeypatch.setattr(kernel_build, "_CSRC", csrc)
    key = kernel_build.build_key()
    assert key == kernel_build.build_key() and len(key) == 16  # a pure function of the files, flags and place
    assert key != here  # another checkout: a build of its own
    for path in sorted(p for p in csrc.iterdir() if p.is_file()):  # a header counts as a source does
        text = path.read_bytes()
        path.write_bytes(text + b"\n// edited\n")
        assert kernel_build.build_key() != key, path.name
        path.write_bytes(text)
        assert kernel_build.build_key() == key
    (csrc / "extra.h").write_text("// a new file\n")
    assert kernel_build.build_key() != key
    (csrc / "extra.h").unlink()
    monkeypatch.setattr(kernel_build, "_CFLAGS", kernel_build._CFLAGS + ("-DNDEBUG",))
    assert kernel_build.build_key() != key
    monkeypatch.setattr(kernel_build, "_CFLAGS", kernel_build._CFLAGS[:-1])
    monkeypatch.setenv("MOLORA_KERNELS_ASAN", "1")  # the sanitizer build: a key of its own
    assert kernel_build.build_key() not in (key, here)


def test_the_build_lives_under_its_key_and_registers_torch_ops(tmp_path):
    """Where the kernels are built, they were built under molora_kernels_<build_key()>: not under a hand-bumped
    name another checkout's different sources could also use; loading the library registered every entry point
    as a torch op with its schema (in-place arguments marked) and the decode block as a torch class."""
    if not fused_cpu.available():
        pytest.skip(f"no kernel build here: {fused_cpu.unavailable_reason()}")
    assert Path(kernel_build.library_path()).name == f"molora_kernels_{kernel_build.build_key()}.so"
    import torch

    ops = kernel_build.load()
    assert ops is torch.ops.molora
    for name in (
        "lora_fused_",
        "paged_decode",
        "paged_decode_rows",
        "add_rms_norm",
        "rope_write",
        "silu_mul",
        "linear_panels",
        "panels_fit",
        "linear_amx",
        "amx_ready",
        "bf16_dot",
    ):
        assert getattr(ops, name).default._schema.name == f"molora::{name}"
    assert "Tensor(a!) out" in str(ops.lora_fused_.default._schema)
    assert torch.classes.molora.BoundBlock is not None


_NO_COMPILER = """
import json, logging, torch
records = []
class Keep(logging.Handler):
    def emit(self, record): records.append(record)
logging.getLogger("molora.ops").addHandler(Keep())
from molora.ops import fused_cpu, lora_delta, lora_delta_reference
from molora.ops.gather import LoRABackendError
g = torch.Generator().manual_seed(0)
x, A = torch.randn(7, 8, generator=g), torch.randn(3, 2, 8, generator=g)
B = torch.randn(3, 2, 8, generator=g).transpose(1, 2)   # slot-major, as the bank keeps it
ids, scale = torch.tensor([0, 1, 2, -1, 0, 2, 1]), torch.ones(3)
with torch.inference_mode():
    eager = [bool(torch.allclose(lora_delta(x, A, B, scale, ids, backend="auto"),
                                 lora_delta_reference(x, A, B, scale, ids), atol=1e-5)) for _ in range(3)]
    try:
        lora_delta(x, A, B, scale, ids, backend="fused")
        refused = ""
    except LoRABackendError as e:
        refused = str(e)
print(json.dumps({"available": [fused_cpu.available() for _ in range(3)], "reason": fused_cpu.unavailable_reason(),
                  "warnings": [r.getMessage() for r in records if r.levelname == "WARNING"], "eager": eager,
                  "refused": refused}))
"""


def test_without_a_compiler_molora_says_so_once_and_runs_the_eager_backends(tmp_path):
    env = {
        **os.environ,
        "CXX": str(tmp_path / "no-such-compiler"),
        "TORCH_EXTENSIONS_DIR": str(tmp_path / "ext"),
        "PYTHONPATH": str(ROOT),
    }
    env.pop("MOLORA_FUSED", None)
    run = subprocess.run(
        [sys.executable, "-c", _NO_COMPILER], env=env, cwd=tmp_path, capture_output=True, text=True, timeout=300
    )
    assert run.returncode == 0, run.stderr[-2000:]
    got = json.loads(run.stdout.strip().splitlines()[-1])
    assert got["available"] == [False, False, False]
    assert "no C++ compiler" in got["reason"] and "no-such-compiler" in got["reason"]
    assert len(got["warnings"]) == 1 and "eager backends" in got["warnings"][0], got["warnings"]
    assert got["eager"] == [True, True, True]
    assert "could not be built here" in got["refused"] and "no C++ compiler" in got["refused"]
    assert not (tmp_path / "ext").exists() or not any((tmp_path / "ext").rglob("*.so"))


@pytest.fixture
def kernels_off(monkeypatch):
    """Set MOLORA_KERNELS_OFF for one test (the variable is read once per process: the cached set is reset)."""

    def set_off(value: str) -> None:
        monkeypatch.setenv("MOLORA_KERNELS_OFF", value)
        monkeypatch.setattr(kernel_build, "_off", None)

    yield set_off
    monkeypatch.setattr(kernel_build, "_off", None)


def test_kernels_off_names_unknown_families(kernels_off):
    kernels_off("glue,warp_drive")
    with pytest.raises(ValueError, match=r"MOLORA_KERNELS_OFF.*'warp_drive'.*known: lora, paged, glue"):
        kernel_build.off("glue")


@pytest.mark.parametrize("family", sorted(kernel_build.FAMILIES))
def test_a_family_turned_off_declines_and_the_others_still_run(kernels_off, family):
    """Each family's wrappers answer "cannot run" (the callers' torch or library path) when MOLORA_KERNELS_OFF names
    it, and only its own: what tools/kernel_keep.py measures each family against."""
    if not fused_cpu.available():
        pytest.skip(f"no kernel build here: {fused_cpu.unavailable_reason()}")
    import torch

    from molora.ops import packed, quant

    g = torch.Generator().manual_seed(36)
    x = torch.randn(4, 32, generator=g)
    w = torch.randn(32, generator=g)
    q, k, v = (torch.randn(4, 2, 8, generator=g) for _ in range(3))
    cos, sin = torch.ones(16, 8), torch.zeros(16, 8)
    kc, vc = torch.zeros(16, 2, 8), torch.zeros(16, 2, 8)
    pos = torch.arange(4)
    weight = torch.randn(32, 32, generator=g)
    q8, s8 = quant.quantize_int8(weight)
    amx = fused_cpu.amx()  # before any family is off: linear_amx_w8 runs where the build runs on AMX

    def runs() -> dict[str, bool]:
        with torch.no_grad():
            return {
                "glue": fused_cpu.add_rms_norm(x.clone(), None, w, 1e-6) is not None
                and fused_cpu.rope_write(q.clone(), k.clone(), v, cos, sin, pos, pos, kc, vc)
                and fused_cpu.silu_mul(x.clone(), x),
                "paged": fused_cpu.paged_decode(q, kc, vc, torch.zeros(4, 1, dtype=torch.long), pos + 1, 16, 1.0, None)
                is not None,
                "panels": packed.form(weight) == "panels"
                and fused_cpu.linear_panels(x, packed.panels(weight), None) is not None,
                "lora": fused_cpu.available(),
                "block": fused_cpu.block_supports(x),
                "w8": fused_cpu.linear_w8(x, q8, s8) is not None
                and (not amx or fused_cpu.linear_amx_w8(x.bfloat16(), quant.tiles(q8), s8) is not None)
                and fused_cpu.quantize_rows(x) is not None
                and fused_cpu.scale_rows(torch.zeros(4, 32, dtype=torch.int32), torch.ones(4, 1), s8, x.dtype)
                is not None,
            }

    before = runs()
    assert all(before.values()), before
    kernels_off(family)
    after = runs()
    if family == "amx":
        assert not fused_cpu.amx() and packed.form(weight.bfloat16()) == "torch"
        assert after == before
        return
    expect = {f: f != family for f in before}
    expect["block"] = family not in ("block", "glue", "paged", "lora")  # the one-call block runs these inside
    assert after == expect


def test_the_panel_gemm_packs_only_where_built_for_avx512(monkeypatch):
    """Its register tile spills without AVX-512's 32 vector registers (molora.ops.packed: measured several times
    slower than MKL there), so the library packs float32 weights for it only where the build has AVX-512."""
    if not fused_cpu.available():
        pytest.skip(f"no kernel build here: {fused_cpu.unavailable_reason()}")
    import torch

    from molora.ops import cpu_kernels, packed

    with open("/proc/cpuinfo") as f:
        flags = next(line for line in f if line.startswith("flags")).split()
    fit = bool(torch.ops.molora.panels_fit())
    assert fit == ("avx512f" in flags)
    monkeypatch.setattr(fused_cpu, "panels_ready", cpu_kernels.panels_ready)  # the library's own rule
    assert cpu_kernels.panels_ready() == fit
    assert packed.form(torch.zeros(32, 32)) == ("panels" if fit else "mkl")
