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

from molora.ops import fused_cpu

ROOT = Path(__file__).resolve().parents[1]


def test_the_build_key_follows_every_source_file_and_the_flags(tmp_path, monkeypatch):
    here = fused_cpu.build_key()
    csrc = tmp_path / "csrc"
    shutil.copytree(fused_cpu._CSRC, csrc)
    monkeypatch.setattr(fused_cpu, "_CSRC", csrc)
    key = fused_cpu.build_key()
    assert key == fused_cpu.build_key() and len(key) == 16  # a pure function of the files, flags and place
    assert key != here  # another checkout: a build of its own
    for path in sorted(p for p in csrc.iterdir() if p.is_file()):  # a header counts as a source does
        text = path.read_bytes()
        path.write_bytes(text + b"\n// edited\n")
        assert fused_cpu.build_key() != key, path.name
        path.write_bytes(text)
        assert fused_cpu.build_key() == key
    (csrc / "extra.h").write_text("// a new file\n")
    assert fused_cpu.build_key() != key
    (csrc / "extra.h").unlink()
    monkeypatch.setattr(fused_cpu, "_CFLAGS", fused_cpu._CFLAGS + ("-DNDEBUG",))
    assert fused_cpu.build_key() != key


def test_the_build_lives_under_its_key(tmp_path):
    """Where the kernels are built, they were built under molora_kernels_<build_key()>: not under a hand-bumped
    name another checkout's different sources could also use."""
    if not fused_cpu.available():
        pytest.skip(f"no kernel build here: {fused_cpu.unavailable_reason()}")
    assert fused_cpu._load().__name__ == f"molora_kernels_{fused_cpu.build_key()}"


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
