"""Resident bytes of the base weights per precision: every copy molora keeps, beside the GGUF files of llama.cpp.

    python -m experiments.quant_weight_bytes [--variants fp32 bf16 int8 int8-bf16 w8a8 int4-bf16]
        [--json docs/quant_weight_bytes.json]

For each variant (experiments/bench_quant.py's VARIANTS: dtype, quantization, LM head; SmolLM2-135M, no adapters):
`attach`,
cast, one `Engine`, and a short `generate` (8 prompts of 32 token ids, 4 new tokens: a prefill step of several rows and
decode steps, so every copy a kernel makes at its first call exists), then `quant_linear.weight_bytes` over the model
and the runner's packed copies (`ModelRunner.packed_weights`): "quantized" (int8/int4 weights and scales, as kept),
"float" (the parameters: embeddings and tied LM head, norms, float base linears), "kernel_copies" (the runner's packed
copies of float weights: the base linears of a float model and the LM head where it stays float; int8's float32 scales
in a bfloat16 model; w8a8's oneDNN copy). Beside them: the bytes of the GGUF the default model ships as and of the
llama.cpp files the peer bench makes (`molora bench peer`'s cache, where present). Measures bytes only, no time: the
figures do not depend on the load, but which copies exist depends on the CPU (bfloat16 weights are packed only where AMX
runs: the record names the CPU). Where the peer cache lacks the llama.cpp files, --gguf-sizes-from takes their sizes
from an earlier record (a file's size does not depend on the CPU). Ends with one JSON line (also written to --json).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

from experiments.bench_quant import VARIANTS  # (name -> (dtype, scheme, quantize_lm_head))

ROOT = Path(__file__).resolve().parent.parent

GGUF_OF = {"fp32": "F32", "bf16": "BF16", "int4-bf16": "Q4_0"} | {n: "Q8_0" for n in VARIANTS if n.startswith("int8")}


def main(argv: list[str] | None = None) -> int:
    from molora import attach
    from molora.bench.common import machine_info
    from molora.bench.engine import bench_config, workload
    from molora.config import SamplingParams
    from molora.engine import Engine
    from molora.model.base import cache_root, default_gguf_path, load_base
    from molora.model.quant_linear import QuantizedLinear, weight_bytes
    from molora.ops import fused_cpu

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument(
        "--variants",
        nargs="+",
        default=["fp32", "bf16", "int8", "int8-bf16", "w8a8", "int4-bf16"],
        choices=list(VARIANTS),
    )
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--json", type=Path, default=None)
    p.add_argument(
        "--gguf-sizes-from",
        type=Path,
        default=None,
        help="a record of this script whose llama.cpp file sizes (gguf_peer) stand in for the files the peer "
        "bench's cache lacks here (llama-cpp-python absent); the record names its source",
    )
    a = p.parse_args(argv)
    torch.set_num_threads(a.threads)
    src = default_gguf_path()
    peer = cache_root() / "peer"
    record: dict = {
        "command": "python -m experiments.quant_weight_bytes " + " ".join(sys.argv[1:] if argv is None else argv),
        "what": "resident bytes of the base weights after a short generate, every copy counted once "
        "(molora.model.quant_linear.weight_bytes with ModelRunner.packed_weights)",
        # which copies exist depends on the CPU: bfloat16 weights are packed (a second copy) only where AMX runs
        "machine": {k: v for k, v in machine_info().items() if k in ("cpu", "cpu_flags", "cores", "threads")}
        | {"amx": fused_cpu.amx(), "w8_amx": fused_cpu.w8_amx()},
        "gguf_shipped": {"file": src.name, "bytes": src.stat().st_size},
        "gguf_peer": {
            t: (peer / f"{src.stem.split('.')[0]}-{t}.gguf").stat().st_size
            for t in sorted(set(GGUF_OF.values()))
            if (peer / f"{src.stem.split('.')[0]}-{t}.gguf").is_file()
        },
        "variants": {},
    }
    if a.gguf_sizes_from is not None:
        try:
            earlier = json.loads(a.gguf_sizes_from.read_text())["gguf_peer"]
        except (OSError, ValueError, KeyError) as e:
            raise SystemExit(f"--gguf-sizes-from {a.gguf_sizes_from}: no gguf_peer sizes readable there ({e})") from e
        missing = {t: n for t, n in earlier.items() if t not in record["gguf_peer"]}
        record["gguf_peer"] |= missing
        record["gguf_peer_from"] = {"record": str(a.gguf_sizes_from), "types": sorted(missing)}
    for name in a.variants:
        dtype, scheme, head = VARIANTS[name]
        model, _tok = load_base()
        mm = attach(model, {}, quantization=scheme, quantize_lm_head=head)
        if dtype != torch.float32:
            mm.to(dtype)
        prompts, news = workload(8, 32, 4, model.config.vocab_size, False)
        eng = Engine(mm, bench_config(8, 32 + 4 + 16))
        eng.generate(prompts, [SamplingParams(max_new_tokens=n) for n in news], routing="none")
        wb = weight_bytes(mm.model, eng.runner.packed_weights())
        total = sum(wb.values())
        v: dict = {
            "dtype": str(dtype).removeprefix("torch."),
            "quantization": scheme,
            "lm_head_int8": isinstance(mm.model.get_output_embeddings(), QuantizedLinear),
            "bytes": wb,
            "total": total,
        }
        gguf = GGUF_OF.get(name)
        if gguf in record["gguf_peer"]:
            v["gguf"] = gguf
            v["total_over_gguf"] = round(total / record["gguf_peer"][gguf], 4)
            v["without_kernel_copies_over_gguf"] = round((total - wb["kernel_copies"]) / record["gguf_peer"][gguf], 4)
        record["variants"][name] = v
        print(name, json.dumps(v), file=sys.stderr, flush=True)
        del eng, mm, model
    print(json.dumps(record))
    if a.json:
        a.json.write_text(json.dumps(record, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
