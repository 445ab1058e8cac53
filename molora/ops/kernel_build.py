"""Building and loading molora's C++ CPU kernels: one library of torch ops, `torch.ops.molora.*`.

The sources lie in `csrc/` (package data), one file per kernel family, and register their entry points with
`TORCH_LIBRARY(molora, ...)` (csrc/bindings.cpp: the schemas) and the decode block's binding as the custom class
`torch.classes.molora.BoundBlock`. The library is compiled on first use by `torch.utils.cpp_extension.load`
(`is_python_module=False`: loading it registers the ops; about a minute; `-O3 -march=native`) into torch's extension
cache under a name keyed by `build_key()`: a hash of the sources, the flags, torch's and Python's versions and the
CPU's feature flags, so an edited source builds anew and two checkouts never share a build. Without a C++ compiler
molora says so once (a log warning) and the callers run their torch fallbacks.

Knobs (environment, read at the first load): MOLORA_FUSED=0 turns the kernels off; MOLORA_KERNELS_OFF=glue,paged
turns single kernel families off (`off`, FAMILIES: each wrapper then answers "cannot run" and its caller takes the
torch or library path, as without a build; what tools/kernel_keep.py measures each family against);
MOLORA_KERNELS_ASAN=1 builds them
with AddressSanitizer (`-fsanitize=address`, a build key of its own; the process must preload libasan:
tools/kernel_asan.py runs the kernel tests so).

Owns the build and whether the kernels may run now (`ready`, `suspended`); knows nothing of what they compute
(molora.ops.fused_cpu: the LoRA backend; molora.ops.cpu_kernels: the decode path's kernels).
"""

from __future__ import annotations

import hashlib
import logging
import os
import platform
import shutil
import sys
import threading
from pathlib import Path
from typing import Any

import torch

from molora.ops.device import ThreadFlag

log = logging.getLogger("molora.ops")

_CSRC = Path(__file__).parent / "csrc"  # the kernels' sources (package data), one file per kernel family
# what the compiler is given, as one library; common.h (shared types, entry points) and checks.h are included
_SOURCES: tuple[Path, ...] = tuple(
    _CSRC / f
    for f in (
        "lora_fused.cpp",  # the fused per-token LoRA kernel (lora_fused_, bf16_dot)
        "paged_decode.cpp",  # decode attention over the paged KV cache (paged_decode, paged_decode_rows)
        "glue.cpp",  # add_rms_norm, rope_write, silu_mul
        "linear_panels.cpp",  # float32 GEMM on panels
        "linear_amx.cpp",  # bfloat16 GEMM on AMX tiles (amx_ready, linear_amx)
        "linear_w8.cpp",  # weight-only int8 GEMM (linear_w8)
        "linear_w8a8.cpp",  # W8A8's rounding and scaling around torch._int_mm (quantize_rows_, scale_rows_)
        "decode_block.cpp",  # a whole decoder block of a decode step (BoundBlock)
        "bindings.cpp",  # TORCH_LIBRARY(molora): every op's schema
    )
)
# -fopenmp: at::parallel_for runs on torch's OpenMP threads (torch's own libgomp.so.1, already loaded, serves this
# library too); without it the kernel silently runs on one thread.
_CFLAGS = ("-O3", "-march=native", "-ffp-contract=fast", "-fopenmp")
_LDFLAGS = ("-fopenmp",)
_ASAN_CFLAGS = ("-fsanitize=address", "-fno-omit-frame-pointer", "-g")  # MOLORA_KERNELS_ASAN=1
_ASAN_LDFLAGS = ("-fsanitize=address",)

_lock = threading.Lock()
_ops: Any = None  # torch.ops.molora once the library is loaded (`load`)
_path: str | None = None  # the loaded library's file
_failed: str | None = None

# Within `with suspended():` (on this thread) every kernel reports that it cannot run, so callers take their torch
# fallbacks: a step recorded op by op (tests/graph_emulator.py) must run only torch ops.
suspended = ThreadFlag()


# The kernel families MOLORA_KERNELS_OFF names, and what runs in a family's place when it is off:
FAMILIES: dict[str, str] = {
    "lora": "per-token LoRA (lora_fused_) -> the eager backends (molora.ops.lora: sort_group)",
    "paged": "decode attention over the paged cache (paged_decode, paged_decode_rows) -> gather + torch SDPA",
    "glue": "add_rms_norm, rope_write, silu_mul -> torch ops",
    "panels": "float32 GEMM on panels (linear_panels) -> MKL's packed sgemm",
    "amx": "bfloat16 GEMM on AMX tiles (linear_amx) -> torch's bfloat16 linear (oneDNN)",
    "w8": "weight-only int8 GEMMs (linear_w8, linear_amx_w8) -> torch's linear on the dequantized weight; W8A8's "
    "rounding and scaling around torch._int_mm (quantize_rows_, scale_rows_) -> torch ops",
    "block": "a decode step's block as one call (run_block) -> the block kernel by kernel",
}
_off: frozenset[str] | None = None


def off(family: str) -> bool:
    """Whether MOLORA_KERNELS_OFF (a comma-separated list of FAMILIES, read once) turns `family` off. An unknown
    name in the variable raises ValueError naming it and the known ones."""
    global _off
    if _off is None:
        names = {n.strip() for n in os.environ.get("MOLORA_KERNELS_OFF", "").split(",") if n.strip()}
        unknown = sorted(names - set(FAMILIES))
        if unknown:
            raise ValueError(
                f"MOLORA_KERNELS_OFF names unknown kernel families {unknown}; known: {', '.join(FAMILIES)}"
            )
        _off = frozenset(names)
    assert family in FAMILIES, family
    return family in _off


def asan() -> bool:
    """Whether this process builds (and loads) the AddressSanitizer build: MOLORA_KERNELS_ASAN=1."""
    return os.environ.get("MOLORA_KERNELS_ASAN", "0") == "1"


def flags() -> tuple[tuple[str, ...], tuple[str, ...]]:
    """(compile flags, link flags) of this process's build: the release flags, plus ASan's where `asan()`."""
    return (_CFLAGS + _ASAN_CFLAGS, _LDFLAGS + _ASAN_LDFLAGS) if asan() else (_CFLAGS, _LDFLAGS)


def build_key() -> str:
    """The library's build key: a hash of every file in csrc/ (names and contents), the compile and link flags,
    torch's and Python's versions, this CPU's feature flags (-march=native) and where csrc/ lies. The build lives in
    torch's extension cache under `molora_kernels_<key>`: editing a source builds anew, and two checkouts never share
    (or overwrite) one build; even with equal sources they would only take turns rebuilding it, since torch's ninja
    file names the sources by path."""
    h = hashlib.sha256(str(_CSRC.resolve()).encode() + b"\0")
    for path in sorted(_CSRC.iterdir()):
        if path.is_file():
            h.update(path.name.encode() + b"\0" + path.read_bytes() + b"\0")
    h.update(repr((*flags(), torch.__version__, sys.version_info[:2], _cpu_tag())).encode())
    return h.hexdigest()[:16]


def load() -> Any:
    """`torch.ops.molora` with the kernels registered, building the library on first use; None (reason logged
    once, `unavailable_reason`) if it cannot be built."""
    global _ops, _path, _failed
    if _ops is not None or _failed is not None:
        return _ops
    with _lock:
        if _ops is not None or _failed is not None:
            return _ops
        if os.environ.get("MOLORA_FUSED", "1") == "0":
            _failed = "turned off by MOLORA_FUSED=0"
            return None
        compiler = os.environ.get("CXX", "c++")  # what torch.utils.cpp_extension compiles with
        if shutil.which(compiler) is None:
            _failed = f"no C++ compiler: {compiler!r} (CXX, else c++) is not on PATH"
            log.warning(
                "molora's C++ CPU kernels unavailable (%s); using the eager backends. Install a C++ compiler "
                "(g++) to build them, or set MOLORA_FUSED=0 to silence this",
                _failed,
            )
            return None
        try:
            from torch.utils.cpp_extension import load as build

            name = f"molora_kernels_{build_key()}"
            log.info(
                "loading molora's C++ CPU kernels (%s; the first time on a machine it builds: about a minute)", name
            )
            venv_bin = os.path.dirname(sys.executable)  # a venv's ninja, when the venv is not activated
            if venv_bin not in os.environ.get("PATH", "").split(os.pathsep):
                os.environ["PATH"] = venv_bin + os.pathsep + os.environ.get("PATH", "")
            cflags, ldflags = flags()
            _path = build(
                name=name,
                sources=[str(p) for p in _SOURCES],
                extra_include_paths=[str(_CSRC)],
                extra_cflags=list(cflags),
                extra_ldflags=list(ldflags),
                is_python_module=False,  # a library of torch ops: loading it registers them
                verbose=False,
            )
            _ops = torch.ops.molora
        except Exception as e:  # no compiler, no ninja, unsupported platform: the eager backends remain
            _failed = f"{type(e).__name__}: {str(e).strip().splitlines()[-1] if str(e).strip() else ''}"
            log.warning(
                "molora's C++ CPU kernels unavailable (%s); using the eager backends. Install a C++ compiler "
                "(g++) and ninja to build them, or set MOLORA_FUSED=0 to silence this",
                _failed,
            )
        return _ops


def library_path() -> str | None:
    """The loaded library's file (under torch's extension cache, named by `build_key`); None before a load."""
    return _path


def ready() -> Any:
    """`torch.ops.molora` where the kernels may run now (built and not `suspended`), else None."""
    return None if suspended.on else load()


def ops() -> Any:
    """`torch.ops.molora`, for the wrappers once `ready()` said the kernels may run."""
    assert _ops is not None, "molora's CPU kernels are not built; check ready() first"
    return _ops


def unavailable_reason() -> str | None:
    """Why the kernels could not be built (None if they were, or were never tried)."""
    return _failed


def _cpu_tag() -> str:
    """A short hash of this CPU's feature flags: a build with -march=native is only reused on a like CPU."""
    try:
        with open("/proc/cpuinfo") as f:
            cpu_flags = next(line for line in f if line.startswith("flags"))
    except (OSError, StopIteration):
        cpu_flags = platform.processor() or platform.machine()
    return hashlib.sha1(cpu_flags.encode()).hexdigest()[:8]
