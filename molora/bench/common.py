"""Shared functions of the `molora bench` modules: threads, interleaved timing, machine info, the JSON line.

Every benchmark here follows one recipe (style habit 12): build all variants first, time them
*interleaved* inside each repetition (so load from other jobs and thermal drift hit every variant alike),
quote medians (and keep minima beside them: a shared CPU adds whole scheduler slices to some samples),
report ratios to the base next to absolute milliseconds, and end stdout with exactly one JSON line.

    set_threads(1)
    t = time_interleaved({"base": f0, "molora": f1}, repeats=5, reset={"molora": undo})
    t.median["molora"] / t.median["base"]
    emit({"bench": "model", ...}, json_path)        # prints the JSON line, optionally writes the file

Knows nothing about models, adapters or the engine.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import statistics
import subprocess
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

# ---------------------------------------------------------------------------------------------- setup


def add_common_args(p: argparse.ArgumentParser, *, plot: bool = True, threads_default: int = 1) -> None:
    """The flags every benchmark takes: --json OUT, --plot OUT.png, --quick, --threads N."""
    p.add_argument("--json", metavar="OUT", help="also write the result JSON to this file")
    if plot:
        p.add_argument("--plot", metavar="OUT.png", help="write a plot of the results to this PNG file")
    p.add_argument("--quick", action="store_true", help="a small, fast configuration (minutes, not tens)")
    p.add_argument(
        "--threads",
        type=int,
        default=threads_default,
        help=f"torch CPU threads (default {threads_default}; 0 = torch's choice). On a shared "
        "machine 1 avoids OpenMP spin stalls that swamp the ratios",
    )


def set_threads(n: int) -> int:
    """Set torch's intra-op threads (n <= 0: leave torch's choice) and return the count in effect."""
    if n > 0:
        torch.set_num_threads(n)
    return torch.get_num_threads()


# ---------------------------------------------------------------------------------------------- timing


@dataclass
class Timing:
    """Per-variant samples in ms, in the order they were taken."""

    samples: dict[str, list[float]] = field(default_factory=dict)

    @property
    def median(self) -> dict[str, float]:
        return {k: statistics.median(v) for k, v in self.samples.items() if v}

    @property
    def min(self) -> dict[str, float]:
        return {k: min(v) for k, v in self.samples.items() if v}

    def ratios(self, ref: str, stat: str = "median") -> dict[str, float]:
        """Each variant's `stat` over the reference variant's (e.g. time / base time)."""
        vals = getattr(self, stat)
        return {k: round(v / vals[ref], 4) for k, v in vals.items()}

    def paired(self, name: str, ref: str) -> tuple[float, float, float]:
        """Median and quartiles of name's time over ref's time *within each repetition* (see paired_ratio)."""
        return paired_ratio(self.samples[name], self.samples[ref])

    def summary(self, ref: str | None = None) -> dict[str, Any]:
        """JSON-ready: medians, minima, sample counts, the samples themselves (in the order taken) and, with
        ref, the ratios of the medians to ref and the per-repetition ("paired") ratios to ref."""
        out: dict[str, Any] = {
            "ms": rounded(self.median),
            "ms_min": rounded(self.min),
            "n": {k: len(v) for k, v in self.samples.items()},
            "samples_ms": {k: [round(x, 3) for x in v] for k, v in self.samples.items()},
        }
        if ref is not None and ref in self.samples:
            out["vs_" + ref] = self.ratios(ref)
            out["paired_vs_" + ref] = {
                k: rounded(list(self.paired(k, ref))) for k in self.samples if self.samples[k] and self.samples[ref]
            }
        return out


def paired_ratio(a: list[float], b: list[float]) -> tuple[float, float, float]:
    """(median, lower quartile, upper quartile) of a[i] / b[i] over the repetitions both were timed in.

    time_interleaved times every variant once per repetition, one right after another, so a[i] and b[i]
    ran under the same load; their ratio cancels a slow change in the machine's load (another tenant
    starting, frequency drift) that shifts both series and that a ratio of two separate medians keeps.
    A variant with max_repeats has the first repetitions' samples only: zip pairs exactly those."""
    r = sorted(x / y for x, y in zip(a, b))
    if not r:
        return math.nan, math.nan, math.nan
    q = statistics.quantiles(r, n=4, method="inclusive") if len(r) > 1 else [r[0], r[0], r[0]]
    return statistics.median(r), q[0], q[2]


def sync(device: torch.device | str | None) -> None:
    """Wait for the work queued on `device` (CUDA runs asynchronously: without this a timer measures only the
    launches). Nothing to wait for on the CPU or for None."""
    if device is not None and torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def timed_ms(fn: Callable[[], Any], device: torch.device | str | None = None) -> float:
    """Wall milliseconds of one call of `fn`, the device's queue drained before and after (`sync`)."""
    sync(device)
    t0 = time.perf_counter()
    fn()
    sync(device)
    return (time.perf_counter() - t0) * 1e3


def rotated(names: list[str], i: int) -> list[str]:
    """`names` rotated left by i: repetition i of an interleaved run starts with variant i mod n."""
    k = i % len(names) if names else 0
    return names[k:] + names[:k]


def time_interleaved(
    fns: Mapping[str, Callable[[], Any]],
    repeats: int,
    *,
    warmup: int = 1,
    reset: Mapping[str, Callable[[], Any]] | None = None,
    max_repeats: Mapping[str, int] | None = None,
    log: Callable[[str], None] | None = None,
    device: torch.device | str | None = None,
) -> Timing:
    """Time every variant once per repetition, `repeats` times (after `warmup` untimed calls each). The order
    rotates by one variant per repetition (`rotated`), so no variant always runs first (cold caches) or
    right after a given other one (warm caches from the same kernel, as `fused` right after `auto`).

    reset[name], when given, runs untimed after each call of `name` (e.g. crop a KV cache back). A variant
    in max_repeats is timed only in its first max_repeats[name] repetitions and gets no warm-up call (a
    variant 100x slower than the rest need not take 100x the run time, and its first-call costs are small
    beside it; its median is over fewer samples, and `Timing.samples` says so).
    device: where the variants run; on CUDA every sample is taken between two `sync`s.
    """
    reset = reset or {}
    max_repeats = max_repeats or {}
    for name, fn in fns.items():
        for _ in range(0 if name in max_repeats else warmup):
            fn()
            if name in reset:
                reset[name]()
    timing = Timing({k: [] for k in fns})
    for i in range(repeats):
        for name in rotated(list(fns), i):
            fn = fns[name]
            if i >= max_repeats.get(name, repeats):
                continue
            timing.samples[name].append(timed_ms(fn, device))
            if name in reset:
                reset[name]()
        if log is not None:
            log(f"  rep {i + 1}/{repeats}: " + ", ".join(f"{k} {v[-1]:.1f}" for k, v in timing.samples.items() if v))
    return timing


# ---------------------------------------------------------------------------------------------- machine


def cpu_model() -> str:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, timeout=5).stdout
        for line in out.splitlines():
            if line.startswith("Model name:"):
                return line.split(":", 1)[1].strip()
    except (OSError, subprocess.SubprocessError):
        pass
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def _cpu_flags() -> list[str]:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                have = set(line.split(":", 1)[1].split())
                return [f for f in ("avx2", "avx512f", "avx512_bf16", "amx_bf16", "amx_tile") if f in have]
    except OSError:
        pass
    return []


def _version(module: str) -> str | None:
    try:
        return __import__(module).__version__
    except Exception:  # noqa: BLE001 - an optional package may be missing or broken: report it as absent
        return None


def machine_info() -> dict[str, Any]:
    """What the numbers were measured on: CPU model and flags, cores, load, library versions, threads."""
    try:
        load = [round(x, 2) for x in os.getloadavg()]
    except OSError:
        load = None
    return {
        "cpu": cpu_model(),
        "cpu_flags": _cpu_flags(),
        "cores": os.cpu_count(),
        "loadavg_1_5_15": load,
        "threads": torch.get_num_threads(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": _version("transformers"),
        "peft": _version("peft"),
        "platform": platform.platform(),
    }


# ---------------------------------------------------------------------------------------------- output


def rounded(x: Any, digits: int = 4) -> Any:
    """Round every float inside dicts/lists to `digits` significant-ish decimals (keeps JSON short)."""
    if isinstance(x, float):
        return x if not math.isfinite(x) else round(x, digits)
    if isinstance(x, dict):
        return {k: rounded(v, digits) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [rounded(v, digits) for v in x]
    return x


def emit(result: Mapping[str, Any], json_path: str | Path | None = None) -> None:
    """Write `result` (indented) to json_path if given, then print it as the final single JSON line."""
    result = rounded(dict(result))
    if json_path:
        Path(json_path).parent.mkdir(parents=True, exist_ok=True)
        Path(json_path).write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result), flush=True)


def stderr_log(msg: str) -> None:
    """Progress lines go to stderr so stdout ends with the one JSON line."""
    import sys

    print(msg, file=sys.stderr, flush=True)
