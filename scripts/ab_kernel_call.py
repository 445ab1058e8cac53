"""The cost of calling molora's C++ kernels as torch ops against the pybind11 module they were before, in one process.

    PYTHONPATH=. python scripts/ab_kernel_call.py --base-so ~/.cache/torch_extensions/py311_cpu/<old>/<old>.so

--base-so: a build of the kernels from before they became torch ops (a pybind11 module with the same entry points,
`add_rms_norm` with its (var, lanes) arguments and a `BoundBlock` class with a `run` method; e.g. molora at 82a086a).
Both are loaded into this process (the module by its file, this tree's library through molora.ops.kernel_build) and
timed interleaved, in CPU time of this thread (the machine is shared), torch on one thread:

  silu_mul [1, 64]                   one small kernel: the call's own cost
  block tiny / block SmolLM2 T=8     a bound decoder block's step (D 64 / D 576, 9 heads of 64, MLP 1536, float32
                                     panels, no LoRA): pybind's method, and the op run_block as cpu_kernels.run_block
                                     calls it (with torch-function dispatch off) and without that guard

Medians of --repeats, microseconds per call; ends with one JSON line.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]


def block(lib_new: bool, old: object, D: int, H: int, Hkv: int, hd: int, F: int, T: int) -> tuple[object, tuple]:
    g = torch.Generator().manual_seed(0)
    shapes = ((D, D), (Hkv * hd, D), (Hkv * hd, D), (D, D), (F, D), (F, D), (D, F))
    P = [torch.randn(n // 16, k, 16, generator=g) * 0.02 for n, k in shapes]
    e = [torch.empty(0)] * 7
    N = 64 * 16
    head = (P, e, e, e, e, torch.ones(D), torch.ones(D), 1e-6)
    tail = (H, Hkv, hd, torch.ones(256, hd), torch.zeros(256, hd), torch.zeros(N, Hkv, hd), torch.zeros(N, Hkv, hd))
    tail += (16, hd**-0.5, 0, [])
    b = torch.classes.molora.BoundBlock(*head, *tail) if lib_new else old.BoundBlock(*head, 8, *tail)  # type: ignore[attr-defined]
    step = (torch.randn(T, D, generator=g), torch.empty(0), False, torch.empty(0, dtype=torch.long), torch.empty(0), [])
    step += (torch.full((T,), 60), torch.arange(T) * 128 + 60, torch.arange(T * 8).view(T, 8), torch.full((T,), 61))
    step += (torch.arange(T), torch.empty(0, dtype=torch.float64))
    return b, step


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--base-so", type=Path, required=True, help="the pybind11 build of the kernels to compare with")
    ap.add_argument("--repeats", type=int, default=9, help="interleaved repetitions (default 9)")
    ap.add_argument("--json", metavar="OUT", help="also write the result JSON to this file")
    args = ap.parse_args()
    sys.path.insert(0, str(ROOT))
    from molora.bench.common import machine_info, rotated
    from molora.ops import kernel_build

    torch.set_num_threads(1)
    spec = importlib.util.spec_from_file_location(args.base_so.stem, args.base_so)
    assert spec is not None and spec.loader is not None
    old = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(old)
    new = kernel_build.load()
    if new is None:
        raise SystemExit(f"this tree's kernels did not build: {kernel_build.unavailable_reason()}")
    guard = torch._C.DisableTorchFunctionSubclass
    g, u = torch.randn(1, 64), torch.randn(1, 64)
    cases: dict[str, tuple[Callable[[], object], int]] = {
        "silu_mul pybind": (lambda: old.silu_mul(g, u), 4000),  # type: ignore[attr-defined]
        "silu_mul op": (lambda: new.silu_mul(g, u), 4000),
    }
    for name, dims, n in (("tiny", (64, 4, 2, 16, 96, 2), 3000), ("SmolLM2 T=8", (576, 9, 3, 64, 1536, 8), 200)):
        bo, so = block(False, old, *dims)
        bn, sn = block(True, old, *dims)

        def guarded(bn: object = bn, sn: tuple = sn) -> object:
            with guard():
                return new.run_block(bn, *sn)

        cases[f"block {name} pybind"] = (lambda bo=bo, so=so: bo.run(*so), n)  # type: ignore[attr-defined]
        cases[f"block {name} op"] = (guarded, n)
        cases[f"block {name} op, no guard"] = (lambda bn=bn, sn=sn: new.run_block(bn, *sn), n)
    times: dict[str, list[float]] = {k: [] for k in cases}
    with torch.inference_mode():
        for fn, _ in cases.values():
            fn()
        for i in range(args.repeats):
            for name in rotated(list(cases), i):
                fn, n = cases[name]
                t0 = time.thread_time()
                for _ in range(n):
                    fn()
                times[name].append((time.thread_time() - t0) / n * 1e6)
    result = {
        "bench": "ab_kernel_call",
        "command": "PYTHONPATH=. python scripts/ab_kernel_call.py " + " ".join(sys.argv[1:]),
        "machine": machine_info(),
        "us_per_call_median": {k: round(statistics.median(v), 2) for k, v in times.items()},
        "repeats": args.repeats,
    }
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
