"""W8A8's linear side by side on SmolLM2-135M's shapes: what `--quantization w8a8` runs against what it ran before,
its parts in torch ops, and the float32 GEMM it replaces, interleaved, in one process.

    python -m experiments.ab_w8a8_kernel [--rows 1 16 64 1024] [--repeats 7] [--threads 2]
        [--json docs/quant_w8a8_kernel.json]

Variants, each on the same random weight (quantized per output channel, molora.ops.quant) and activations:
- `w8a8`: molora.ops.quant.linear_w8a8 as served: the rows rounded by molora's kernel (fused_cpu.quantize_rows),
  torch._int_mm, the int32 sums scaled by molora's kernel (fused_cpu.scale_rows).
- `w8a8_torch_ops`: the same arithmetic in torch ops (quantize_tokens, torch._int_mm, acc.float() * step * scales):
  what the two kernels replace (equal bit for bit: tests/test_quant.py).
- `onednn_s8`: what linear_w8a8 ran before torch._int_mm: torch.ops.onednn.qlinear_pointwise on signed int8 activations
  (oneDNN's prepacked weight); only at --onednn-rows (default 1 and 16), it is slow where the CPU has no AMX.
- `fp32_panels`: the float32 GEMM molora runs on unquantized weights (molora.ops.packed panels, linear_panels).

Per shape and row count: the median over --repeats of the median of 5 calls, the variants' order rotated every
repetition. Ends with one JSON line (also written to --json), the command and the machine in it.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

SHAPES = {  # SmolLM2-135M's linears: (N, K)
    "q_o": (576, 576),
    "k_v": (192, 576),
    "gate_up": (1536, 576),
    "down": (576, 1536),
}


def timed(fn, calls: int = 5) -> float:
    """Median seconds of `calls` calls of fn (after one call not timed)."""
    fn()
    out = []
    for _ in range(calls):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return statistics.median(out)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", type=int, nargs="+", default=[1, 16, 64, 1024])
    p.add_argument("--onednn-rows", type=int, nargs="*", default=[1, 16])
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--json", type=Path, default=None)
    a = p.parse_args(argv)
    torch.set_num_threads(a.threads)
    torch.set_grad_enabled(False)
    from molora.bench.common import machine_info
    from molora.ops import fused_cpu, packed, quant

    if not fused_cpu.available():
        raise SystemExit(f"molora's kernels are not built here: {fused_cpu.unavailable_reason()}")
    g = torch.Generator().manual_seed(0)
    record: dict = {
        "command": "python -m experiments.ab_w8a8_kernel " + " ".join(sys.argv[1:] if argv is None else argv),
        "machine": machine_info(),
        "repeats": a.repeats,
        "unit": "microseconds per call (median)",
        "cells": [],
    }
    for rows in a.rows:
        for shape, (n, k) in SHAPES.items():
            w = torch.randn(n, k, generator=g) * 0.05
            x = torch.randn(rows, k, generator=g)
            q, s = quant.quantize(w, "w8a8")
            wp = quant.prepack_w8a8(q, s)
            panels = packed.panels(w)

            def torch_ops(x=x, wp=wp):
                xq, step = quant.quantize_tokens(x)
                return torch._int_mm(xq, wp.qt).float().mul_(step).mul_(wp.scales)

            variants = {
                "w8a8": lambda x=x, wp=wp: quant.linear_w8a8(x, wp),
                "w8a8_torch_ops": torch_ops,
                "fp32_panels": lambda x=x, panels=panels: fused_cpu.linear_panels(x, panels, None),
            }
            if rows in a.onednn_rows:
                packed_s8 = torch.ops.onednn.qlinear_prepack(q.contiguous(), None)
                zeros = torch.zeros(n, dtype=torch.long)

                def onednn_s8(x=x, packed_s8=packed_s8, s=s, zeros=zeros):
                    xq, step = quant.quantize_tokens(x)
                    y = torch.ops.onednn.qlinear_pointwise(
                        xq, 1.0, 0, packed_s8, s, zeros, None, 1.0, 0, torch.float32, "none", [], ""
                    )
                    return y.mul_(step)

                variants["onednn_s8"] = onednn_s8
            assert torch.equal(variants["w8a8"](), variants["w8a8_torch_ops"]())  # the same numbers
            names = list(variants)
            secs: dict[str, list[float]] = {v: [] for v in names}
            for i in range(a.repeats):
                for v in names[i % len(names) :] + names[: i % len(names)]:
                    secs[v].append(timed(variants[v], 1 if v == "onednn_s8" else 5))
            cell = {"rows": rows, "shape": shape, "n": n, "k": k}
            cell.update({v: round(statistics.median(t) * 1e6, 2) for v, t in secs.items()})
            cell["fp32_over_w8a8"] = round(cell["fp32_panels"] / cell["w8a8"], 3)
            cell["torch_ops_over_w8a8"] = round(cell["w8a8_torch_ops"] / cell["w8a8"], 3)
            if "onednn_s8" in cell:
                cell["onednn_s8_over_w8a8"] = round(cell["onednn_s8"] / cell["w8a8"], 1)
            record["cells"].append(cell)
            print(json.dumps(cell), file=sys.stderr, flush=True)
    if a.json:
        a.json.write_text(json.dumps(record, indent=1) + "\n")
    print(json.dumps(record))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
