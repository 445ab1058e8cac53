"""Run the C++ kernels' tests under AddressSanitizer and record the findings (docs/kernel_asan.json).

    python -m tools.kernel_asan [--json docs/kernel_asan.json] [--tests ...]

1. Builds the kernels with MOLORA_KERNELS_ASAN=1 (molora.ops.kernel_build: -fsanitize=address -fno-omit-frame-pointer
   -g, a build key of its own) in a plain process; loading that build there fails (the ASan runtime must come first in
   the process: ASan aborts it), which is expected: only the build is wanted.
2. Runs pytest on the kernel tests (tests/test_kernel_checks.py: a bad-input test per check of every entry point,
   and the fused, paged-attention, glue, GEMM and one-call-block tests of tests/test_ops.py and
   tests/test_runner.py, and the int8 kernels' tests of tests/test_quant.py) with LD_PRELOAD set to gcc's libasan
   and libstdc++ (`gcc -print-file-name=...`) and ASAN_OPTIONS=detect_leaks=0 (Python itself "leaks" by design), the
   ASan build loaded.
3. Counts the reports ("ERROR: AddressSanitizer") in the output and writes the record: command, tests, pytest's
   summary line, findings and the first lines of each report.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TESTS = [
    "tests/test_kernel_checks.py",
    "tests/test_ops.py",
    "-k",
    "kernel or fused or paged or glue or packed or amx or add_into or slot_major or bit_for_bit or one_call or bound "
    "or quantized_kernel or int8",
    "tests/test_runner.py",
    "tests/test_quant.py",
]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--json", default=str(ROOT / "docs" / "kernel_asan.json"), help="where to write the record")
    args = ap.parse_args()
    libasan, libstdcxx = (
        subprocess.run(["gcc", f"-print-file-name={lib}"], capture_output=True, text=True).stdout.strip()
        for lib in ("libasan.so", "libstdc++.so")
    )
    if not Path(libasan).is_file():
        raise SystemExit(f"no libasan here (gcc -print-file-name=libasan.so gave {libasan!r})")
    # libstdc++ preloaded too: python does not link it, and ASan's __cxa_throw interceptor must find the real one
    # when it starts (else the first C++ exception, a failed check, aborts: "real___cxa_throw != 0")
    preload = f"{libasan} {libstdcxx}"
    env = {**os.environ, "MOLORA_KERNELS_ASAN": "1", "PYTHONPATH": str(ROOT)}
    build = subprocess.run(
        [sys.executable, "-c", "from molora.ops import kernel_build as k; print(k.build_key(), flush=True); k.load()"],
        env=env,
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    key = build.stdout.strip().splitlines()[0] if build.stdout.strip() else None  # the load itself may abort
    run_env = {**env, "LD_PRELOAD": preload, "ASAN_OPTIONS": "detect_leaks=0"}
    probe = subprocess.run(  # the sanitized build loads under the preload (else every kernel test would skip)
        [sys.executable, "-c", "from molora.ops import kernel_build as k; k.load(); print(k.library_path())"],
        env=run_env,
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    library = probe.stdout.strip().splitlines()[-1] if probe.stdout.strip() else "None"
    if key is None or key not in library:
        raise SystemExit(f"the ASan build did not load under LD_PRELOAD={preload}: {probe.stderr[-1500:]}")
    cmd = [sys.executable, "-m", "pytest", "-p", "no:randomly", *TESTS]  # pyproject adds -q
    run = subprocess.run(cmd, env=run_env, cwd=ROOT, capture_output=True, text=True)
    out = run.stdout + run.stderr
    reports = [m.start() for m in re.finditer(r"ERROR: AddressSanitizer", out)]
    summary = next((line for line in reversed(out.splitlines()) if re.search(r"\d+ (passed|failed)", line)), "")
    record = {
        "what": "molora's C++ kernels (molora/ops/csrc) built with -fsanitize=address, their tests run under ASan",
        "command": "python -m tools.kernel_asan",
        "pytest": " ".join(["python -m pytest -p no:randomly", *[f"'{t}'" if " " in t else t for t in TESTS]]),
        "env": {"MOLORA_KERNELS_ASAN": "1", "LD_PRELOAD": preload, "ASAN_OPTIONS": "detect_leaks=0"},
        "build_key": key,  # MOLORA_KERNELS_ASAN=1: differs from the release build's
        "pytest_exit": run.returncode,
        "pytest_summary": summary,
        "findings": len(reports),
        "reports": [out[i : i + 600] for i in reports[:5]],
        "library": library,
    }
    Path(args.json).write_text(json.dumps(record, indent=1) + "\n")
    print(json.dumps(record))
    return 0 if run.returncode == 0 and not reports else 1


if __name__ == "__main__":
    raise SystemExit(main())
