"""A/B of weight-only quantized base linears against molora's float32 and bfloat16 ones, in one process.

    python -m experiments.ab_quant_linear [--rows 1 8 32 128] [--layers 30] [--repeats 9] [--threads 2] \
        [--json out.json]

SmolLM2-135M's seven linear shapes (q, k, v, o, gate, up, down: hidden 576, kv 192, intermediate 1536) over
`--layers` separate weights (as an engine step meets them: cold), random weights from a seeded generator. Variants,
per activation dtype (float32, bfloat16), all timed alternating in one process with the order rotated every
repetition:

- `packed`: what the engine runs today (`molora.ops.packed.PackedLinear`: panel GEMM in float32, AMX in bfloat16,
  torch's GEMV for one row);
- `torch`: torch's own linear on the plain weight;
- `int8`: what `--quantization int8` runs (`molora.ops.quant.linear_int8`: weight only, molora's kernels:
  `linear_w8` in float32, `linear_amx_w8` on AMX in bfloat16);
- `w8a8`: what `--quantization w8a8` runs (`molora.ops.quant.linear_w8a8`: torch._int_mm, oneDNN's
  qlinear before; the activations rounded to int8 per token by molora, no smoothing factors: they add one multiply);
- `int8-wo`: torch's weight-only int8 kernel `torch._weight_int8pack_mm` (int8 weight [N, K], one scale per output
  channel, activations in their own dtype);
- `int4/gG`: `torch._weight_int4pack_mm_for_cpu` on `torch._convert_weight_to_int4pack_for_cpu` (groups of G along
  K, a scale and a zero per group and output channel; 128 does not divide K = 576);
- `fbgemm-a8w8` (float32 only; not weight-only, what `w8a8` ran before oneDNN): FBGEMM's dynamic quantized
  linear `torch.ops.quantized.linear_dynamic` (int8 weight per output channel, the activations quantized per tensor
  to uint8 at each call, integer products on VNNI).

torchao 0.18 (pip) was tried by hand and is not timed here: it brings no CPU kernels (its `torch.ops.torchao` holds
only quantize/dequantize ops), and its eager int8 weight-only and dynamic int8 layers ran 0.09-0.54x `packed` at
T = 8 and 32 (one run, 3 repetitions).

Prints one line per (dtype, T): the median time of one full pass (7 * layers linears) per variant and its ratio to
`packed`; ends with one JSON line (also written to --json) with the CPU.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
import warnings
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
SHAPES = [(576, 576), (192, 576), (192, 576), (576, 576), (1536, 576), (1536, 576), (576, 1536)]  # (N, K)


def cpu_info() -> dict:
    """molora.bench.common.machine_info() plus the int8 flags (avx512_vnni, amx_int8) of /proc/cpuinfo."""
    from molora.bench.common import machine_info

    flags = next(
        (
            ln.split(":", 1)[1].split()
            for ln in Path("/proc/cpuinfo").read_text().splitlines()
            if ln.startswith("flags")
        ),
        [],
    )
    return {**machine_info(), "int8_flags": [f for f in ("avx512_vnni", "amx_int8") if f in flags]}


def variants(ws: list[torch.Tensor], dtype: torch.dtype, groups: list[int]) -> dict:
    """name -> list of per-linear callables x -> y for the weights ws (float32 [N, K])."""
    from molora.ops import packed, quant

    wd = [w.to(dtype) for w in ws]
    out = {
        "packed": [packed.PackedLinear(w) for w in wd],
        "torch": [(lambda x, w=w: torch.nn.functional.linear(x, w)) for w in wd],
    }
    q8 = [quant.quantize_int8(w) for w in ws]
    tiles8 = [quant.tiles(q) if dtype == torch.bfloat16 else None for q, _ in q8]
    out["int8"] = [(lambda x, q=q, t=t: quant.linear_int8(x, q[0], q[1], t)) for q, t in zip(q8, tiles8)]
    packs8 = [quant.prepack_w8a8(*q) for q in q8]
    out["w8a8"] = [(lambda x, p=p: quant.linear_w8a8(x, p)) for p in packs8]
    out["int8-wo"] = [(lambda x, q=q: torch._weight_int8pack_mm(x, q[0], q[1].to(x.dtype))) for q in q8]
    if dtype == torch.float32:  # FBGEMM's dynamic int8 linear (module docstring); float32 activations only
        warnings.filterwarnings("ignore", message=".*quantize_per_channel.*")
        packs = [
            torch.ops.quantized.linear_prepack(
                torch.quantize_per_channel(
                    w, (q[1].double()), torch.zeros(w.shape[0], dtype=torch.long), 0, torch.qint8
                ),
                None,
            )
            for w, q in zip(ws, q8)
        ]
        out["fbgemm-a8w8"] = [(lambda x, p=p: torch.ops.quantized.linear_dynamic(x, p, False)) for p in packs]
    for g in groups:
        q4 = [quant.quantize_int4(w, g) for w in ws]
        packs = [(torch._convert_weight_to_int4pack_for_cpu(q[0], 1), q[1].to(dtype)) for q in q4]
        out[f"int4/g{g}"] = [(lambda x, p=p, g=g: torch._weight_int4pack_mm_for_cpu(x, p[0], g, p[1])) for p in packs]
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", type=int, nargs="+", default=[1, 8, 32, 128])
    p.add_argument("--layers", type=int, default=30)
    p.add_argument("--repeats", type=int, default=9)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--groups", type=int, nargs="*", default=[32], help="int4 group sizes (none: no int4 variant)")
    p.add_argument("--json", type=Path, default=None)
    a = p.parse_args(argv)
    torch.set_num_threads(a.threads)
    g = torch.Generator().manual_seed(0)
    ws = [torch.randn(n, k, generator=g) * 0.05 for _ in range(a.layers) for n, k in SHAPES]
    record = {
        "command": "python -m experiments.ab_quant_linear " + " ".join(sys.argv[1:] if argv is None else argv),
        "cpu": cpu_info(),
        "torch": torch.__version__,
        "threads": a.threads,
        "layers": a.layers,
        "repeats": a.repeats,
        "unit": "ms per pass (7 linears x layers)",
        "results": [],
    }
    print(f"# {record['cpu']}", flush=True)
    for dtype in (torch.float32, torch.bfloat16):
        fns = variants(ws, dtype, a.groups)
        names = list(fns)
        for T in a.rows:
            xs = [torch.randn(T, k, generator=g).to(dtype) for _, k in SHAPES]
            with torch.inference_mode():
                for n in names:  # warm up (packing, first-call setup)
                    for i, f in enumerate(fns[n]):
                        f(xs[i % 7])
                times: dict[str, list[float]] = {n: [] for n in names}
                for r in range(a.repeats):
                    order = names[r % len(names) :] + names[: r % len(names)]
                    for n in order:
                        t0 = time.perf_counter()
                        for i, f in enumerate(fns[n]):
                            f(xs[i % 7])
                        times[n].append((time.perf_counter() - t0) * 1e3)
            med = {n: statistics.median(v) for n, v in times.items()}
            row = {
                "dtype": str(dtype).removeprefix("torch."),
                "T": T,
                "ms": med,
                "min_ms": {n: min(v) for n, v in times.items()},
                "vs_packed": {n: med["packed"] / med[n] for n in names},
            }
            record["results"].append(row)
            print(
                f"{row['dtype']:>8} T={T:<4} "
                + "  ".join(f"{n} {med[n]:7.2f} ({row['vs_packed'][n]:.2f}x)" for n in names),
                flush=True,
            )
    record["loadavg_after"] = [round(x, 2) for x in os.getloadavg()]
    line = json.dumps(record)
    if a.json:
        a.json.write_text(json.dumps(record, indent=1) + "\n")
    print(line)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
