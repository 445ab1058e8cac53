"""Engine throughput on a quantized base: int8 and int4 against float32 and bfloat16, interleaved, in one process.

    python -m experiments.bench_quant [--requests 16] [--prompt-len 64] [--new-tokens 32] [--repeats 3]
        [--json docs/quant.json]

The engine bench's workload (molora.bench.engine: SmolLM2-135M, 4 random r=16 adapters on all seven projections, a
VocabRouter over 4 vocabulary ranges, so every step routes per token over all adapters; random prompts, greedy, eos
ignored), one `Engine` per variant, `Engine.generate` over all requests timed with the variants' order rotated every
repetition; medians, throughput and the ratio to float32. Variants (`--variants`): fp32, bf16, int8 (weight-only
int8, float32 activations: linear_w8), int8-bf16 (the same, bfloat16 model: linear_amx_w8), w8a8 (int8 weights and
activations on torch._int_mm, SmoothQuant on the calibration rows molora.load reads; float32 model); w8a8-bf16,
w8a8-qhead (its LM head in w8a8 too), int4-bf16 (weight only, bfloat16 activations) and int4 (float32 activations)
only when asked for (DEFAULT).

Also per variant: the bytes of the base weights resident after the warm-up (quantized linears, float parameters and
the copies kept for the kernels: the runner's packed float weights, the int8 layers' float32 scales (w8a8 keeps no
copy of its weight); `molora.model.quant_linear.weight_bytes`) against the GGUF file the default model
ships as, and the share of greedy tokens equal to fp32's (per request, up to its first differing token, over all
requests). Ends with one JSON line (also written to --json), with the command line and the load average before
(machine) and after the timed runs.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
VARIANTS = {  # name -> (dtype, quantization, quantize_lm_head: None the scheme's default, molora.attach)
    "fp32": (torch.float32, None, None),
    "bf16": (torch.bfloat16, None, None),
    "int8": (torch.float32, "int8", None),
    "int8-bf16": (torch.bfloat16, "int8", None),
    "int8-qhead": (torch.float32, "int8", True),  # the LM head (and the tied embedding) in int8 too
    "int8-bf16-qhead": (torch.bfloat16, "int8", True),
    "int8-fhead": (torch.float32, "int8", False),  # the LM head (and the tied embedding) in the model's dtype
    "int8-bf16-fhead": (torch.bfloat16, "int8", False),
    "w8a8": (torch.float32, "w8a8", None),
    "w8a8-bf16": (torch.bfloat16, "w8a8", None),
    "w8a8-qhead": (torch.float32, "w8a8", True),  # the LM head in w8a8 too (the tied embedding reads its rows)
    "int4-bf16": (torch.bfloat16, "int4", None),
    "int4": (torch.float32, "int4", None),
}
SCHEMES_DOC = (  # what the variants' schemes are (tools/make_quant.py prints it beside the figures)
    "int8 is weight only (one scale per output channel, activations in the model's dtype) on molora's kernels: "
    "linear_w8 for float32 activations, linear_amx_w8 (AMX) for bfloat16; w8a8 is W8A8 on torch._int_mm (activations "
    "rounded per token after SmoothQuant's per-channel factors); int4 is weight only on torch's kernel, groups of "
    "32 (molora.ops.quant)."
)
# w8a8 with some projections (by last name) in weight-only int8 instead, float32 activations: bench-only variants,
# built here by quantizing before attach (molora.model.quant_linear.quantize_linears twice; no served option yet),
# after experiments/w8a8_keep_probe.py found down_proj's rounded activations behind half of w8a8's arithmetic KL
W8A8_KEEP = {"w8a8-keepdown": ("down_proj",)}


def quantize_keeping(model: torch.nn.Module, keep: tuple[str, ...], act_amax: dict | None = None) -> list[str]:
    """w8a8 on every linear of `model` but the LM head and the projections `keep` (last names), SmoothQuant from
    act_amax as attach does it; then `keep` in weight-only int8. The names quantized (what attach's call returns)."""
    from molora.model.quant_linear import quantize_linears

    return quantize_linears(model, "w8a8", skip=("lm_head", *keep), act_amax=act_amax) + quantize_linears(model, "int8")


DEFAULT = ["fp32", "bf16", "int8", "int8-bf16", "w8a8"]  # int4 in float32: torch's kernel ran 0.01-0.03x the
# packed float32 GEMM at T = 8-128 (docs/quant_linear.json), a 1024-token prefill alone would take minutes


def agreement(ref: list[list[int]], out: list[list[int]]) -> float:
    """Share of ref's tokens that out repeats before its first difference, over all requests."""
    same = 0
    for a, b in zip(ref, out):
        n = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
        same += n
    return same / max(1, sum(len(a) for a in ref))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--requests", type=int, default=16)
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--variants", nargs="+", default=DEFAULT, choices=[*VARIANTS, *W8A8_KEEP])
    p.add_argument("--json", type=Path, default=None)
    a = p.parse_args(argv)
    torch.set_num_threads(a.threads)
    from molora import attach
    from molora.bench.common import machine_info
    from molora.bench.engine import bench_config, make_adapters, workload
    from molora.bundle import quant_calibration_rows
    from molora.config import SamplingParams
    from molora.engine import Engine
    from molora.model.base import default_gguf_path, load_base
    from molora.model.quant_linear import QuantizedLinear, activation_ranges, weight_bytes
    from molora.routing import VocabRouter

    flags = next(
        (
            ln.split(":", 1)[1].split()
            for ln in Path("/proc/cpuinfo").read_text().splitlines()
            if ln.startswith("flags")
        ),
        [],
    )
    record = {
        "command": "python -m experiments.bench_quant " + " ".join(sys.argv[1:] if argv is None else argv),
        "machine": {**machine_info(), "int8_flags": [f for f in ("avx512_vnni", "amx_int8") if f in flags]},
        "requests": a.requests,
        "prompt_len": a.prompt_len,
        "new_tokens": a.new_tokens,
        "repeats": a.repeats,
        "schemes": SCHEMES_DOC,
        "routing": "vocab (per token over 4 adapters, r=16, all seven projections)",
        "gguf_bytes": default_gguf_path().stat().st_size,
        "variants": {},
    }
    engines, outputs = {}, {}
    with tempfile.TemporaryDirectory() as tmp:
        for name in a.variants:
            keep = W8A8_KEEP.get(name)
            dtype, scheme, head = VARIANTS["w8a8" if keep else name]
            model, tok = load_base()
            vocab = model.config.vocab_size
            paths = make_adapters(model, Path(tmp), 4, 16)  # the same seed: the same adapters every time
            q = vocab // 4
            router = VocabRouter([(i * q, (i + 1) * q if i < 3 else vocab, f"skill{i}") for i in range(4)])
            calib = None  # w8a8: SmoothQuant's ranges from the rows molora.load reads (molora.bundle.load)
            if scheme == "w8a8":
                calib = quant_calibration_rows(tok)
            if keep:  # w8a8 but `keep` (SmoothQuant as attach does it), then those in weight-only int8
                quantize_keeping(model, keep, activation_ranges(model, calib))
                scheme = None  # quantized already
            mm = attach(model, paths, router=router, quantization=scheme, calibration=calib, quantize_lm_head=head)
            if dtype != torch.float32:
                mm.to(dtype)
            prompts, news = workload(a.requests, a.prompt_len, a.new_tokens, vocab, False)
            longest = a.prompt_len + a.new_tokens + 16
            engines[name] = Engine(mm, bench_config(a.requests, longest))
            record["variants"][name] = {
                "dtype": str(dtype).removeprefix("torch."),
                "quantization": f"w8a8, {'/'.join(keep)} weight-only int8" if keep else scheme,
                "lm_head_int8": isinstance(mm.model.get_output_embeddings(), QuantizedLinear),
            }
        params = [SamplingParams(max_new_tokens=n) for n in news]
        names = list(engines)
        secs: dict[str, list[float]] = {n: [] for n in names}
        for n in names:  # warm up (packing) on a short request
            engines[n].generate(prompts[:2], SamplingParams(max_new_tokens=2), routing="vocab")
            # every copy of the base weights now resident: the model's, the kernels' (made at the first call)
            wb = weight_bytes(engines[n].mm.model, engines[n].runner.packed_weights())
            record["variants"][n].update(weight_bytes=wb, weight_bytes_total=sum(wb.values()))
            print(f"# {n}: weights {sum(wb.values()) / 1e6:.1f} MB {wb}", file=sys.stderr, flush=True)
        for i in range(a.repeats):
            for n in names[i % len(names) :] + names[: i % len(names)]:
                t0 = time.perf_counter()
                out = engines[n].generate(prompts, params, routing="vocab")
                secs[n].append(time.perf_counter() - t0)
                outputs[n] = [r.new_token_ids for r in out]  # greedy: the same every repetition
                print(f"  {n}: {secs[n][-1]:.2f} s", file=sys.stderr, flush=True)
    record["loadavg_after"] = [round(x, 2) for x in os.getloadavg()]
    gen = sum(news)
    base = statistics.median(secs.get("fp32", secs[names[0]]))
    for n in names:
        med = statistics.median(secs[n])
        v = record["variants"][n]
        v.update(
            s=med,
            samples_s=[round(x, 4) for x in secs[n]],
            tok_s=gen / med,
            vs_fp32=base / med,
            weights_vs_gguf=v["weight_bytes_total"] / record["gguf_bytes"],
        )
        if "fp32" in outputs and n != "fp32":
            v["greedy_agreement_vs_fp32"] = agreement(outputs["fp32"], outputs[n])
        print(
            f"{n:>10}: {med:6.2f} s  {gen / med:7.1f} tok/s  {base / med:5.2f}x fp32  weights "
            f"{v['weight_bytes_total'] / 1e6:6.1f} MB ({v['weights_vs_gguf']:.2f}x GGUF)"
            + (f"  greedy = fp32 {v['greedy_agreement_vs_fp32']:.2f}" if "greedy_agreement_vs_fp32" in v else ""),
            flush=True,
        )
    if a.json:
        a.json.write_text(json.dumps(record, indent=1) + "\n")
    print(json.dumps(record))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
