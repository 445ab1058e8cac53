"""Which of molora's C++ kernel families pay: the engine bench with each family turned off, paired in one run.

    python -m tools.kernel_keep --repeats 5 --threads 2 --dtype fp32 [--json docs/kernel_keep_fp32.json]
    python -m tools.kernel_keep --quantization int8 --dtype bf16 --arms w8   # the int8 kernels' knob

The keep rule: keep a kernel of our own only where it beats what a maintained library gives through torch by >= 1.15x
on the engine bench, measured side by side. One worker process per arm (experiments/ab_engine_trees.py's worker:
SmolLM2-135M, 4 random-weight adapters r=16, a VocabRouter over 4 ranges, fixed seeds), all on this checkout, each with
MOLORA_KERNELS_OFF naming what it turns off (molora.ops.kernel_build.FAMILIES says what runs in each family's place;
with --quantization int8 the base linears are weight-only int8 and the "w8" arm turns their kernels off: torch's linear
on the dequantized weight); "none" turns every kernel off (MOLORA_FUSED=0: torch, MKL's packed sgemm, the eager LoRA
backends). The parent asks the arms in turn for one sample of a workload (the order rotating each repetition), so every
arm sees the same load. Per family and workload: the median over repetitions of (arm's time / all kernels' time),
paired, with quartiles; the families the one-call block runs inside (lora, glue, paged) turn the block off with them, so
they are also given against the "block" arm (the block kernel by kernel). Each arm first reports which of molora's
kernels a routed generate called (`fused_cpu.kernel_clock`), so the record shows the knob did what it says. Ends with
one JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from pathlib import Path
from typing import Any

from experiments import ab_engine_trees as ab

ROOT = Path(__file__).resolve().parents[1]

# arm -> the families it turns off (MOLORA_KERNELS_OFF); "none": MOLORA_FUSED=0
ARMS: dict[str, dict[str, str]] = {
    "all": {},
    "block": {"MOLORA_KERNELS_OFF": "block"},
    "lora": {"MOLORA_KERNELS_OFF": "lora"},
    "glue": {"MOLORA_KERNELS_OFF": "glue"},
    "paged": {"MOLORA_KERNELS_OFF": "paged"},
    "panels": {"MOLORA_KERNELS_OFF": "panels"},
    "amx": {"MOLORA_KERNELS_OFF": "amx"},
    "w8": {"MOLORA_KERNELS_OFF": "w8"},  # with --quantization int8 only
    "none": {"MOLORA_FUSED": "0"},
}
GEMM = {"fp32": "panels", "bf16": "amx"}  # the GEMM family a dtype's weights run on
INSIDE_BLOCK = ("lora", "glue", "paged")  # families whose "off" also turns the one-call block off
KEEP_AT = 1.15


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32", help="the weights' dtype (default fp32)")
    ap.add_argument("--arms", default="", help="comma-separated subset of the arms (default: every arm of the dtype)")
    ap.add_argument("--repeats", type=int, default=5, help="interleaved repetitions (default 5)")
    ap.add_argument("--requests", type=int, default=8, help="concurrent requests (default 8)")
    ap.add_argument("--prompt-len", type=int, default=32, help="prompt tokens per request (default 32)")
    ap.add_argument("--new-tokens", type=int, default=32, help="greedy new tokens per request (default 32)")
    ap.add_argument("--steps", type=int, default=10, help="decode steps timed per decode_step sample (default 10)")
    ap.add_argument("--threads", type=int, default=2, help="torch CPU threads in each worker (default 2)")
    ap.add_argument(
        "--quantization", choices=("int8",), help="a weight-only int8 base (its kernels: the w8 arm; default float)"
    )
    ap.add_argument("--json", metavar="OUT", help="also write the result JSON to this file")
    args = ap.parse_args()
    from molora.bench.common import machine_info

    other_gemm = GEMM["bf16" if args.dtype == "fp32" else "fp32"]
    arms = [a for a in ARMS if a != other_gemm]  # the other dtype's GEMM family does not run here (the LM head's does)
    if args.quantization is None:
        arms.remove("w8")  # no int8 base: the w8 kernels do not run
    if args.arms:
        asked = [a.strip() for a in args.arms.split(",") if a.strip()]
        unknown = [a for a in asked if a not in ARMS]
        if unknown:
            ap.error(f"unknown arms {unknown}; known: {', '.join(ARMS)}")
        if "w8" in asked and args.quantization is None:
            ap.error("the w8 arm needs --quantization int8 (without an int8 base its kernels do not run)")
        arms = ["all", *[a for a in asked if a != "all"]]
    argv = [f"--requests={args.requests}", f"--prompt-len={args.prompt_len}", f"--new-tokens={args.new_tokens}"]
    argv += [f"--steps={args.steps}", f"--threads={args.threads}"] + (["--bf16"] if args.dtype == "bf16" else [])
    argv += [f"--quantization={args.quantization}"] if args.quantization else []
    procs = {a: ab.start(ROOT, argv, ARMS[a]) for a in arms}
    try:
        for a in arms:
            ab.ask(procs[a], "")  # ready
        kernels = {a: ab.ask(procs[a], f"kernels {args.dtype}")["kernels"] for a in arms}
        loads = ["generate_routed", "generate_base", "decode_step"]
        samples, tokens, load_before = ab.interleave(procs, {w: f"{w} {args.dtype}" for w in loads}, args.repeats)
        load_after = os.getloadavg()
    finally:
        for p in procs.values():
            if p.stdin is not None:
                p.stdin.close()
            p.wait()

    def paired(arm: str, base: str, w: str) -> list[float]:
        return [round(x, 4) for x in ab.quartiles([x / y for x, y in zip(samples[w][arm], samples[w][base])])]

    result: dict[str, Any] = {
        "bench": "kernel_keep",
        "command": "python -m tools.kernel_keep " + " ".join(sys.argv[1:]),
        "dtype": args.dtype,
        "quantization": args.quantization,
        "keep_at": KEEP_AT,
        "arms": {a: ARMS[a] for a in arms},
        "repeats": args.repeats,
        "requests": args.requests,
        "prompt_len": args.prompt_len,
        "new_tokens": args.new_tokens,
        "machine": {
            **machine_info(),
            "threads": args.threads,
            "loadavg_before": [round(x, 2) for x in load_before],
            "loadavg_after": [round(x, 2) for x in load_after],
        },
        "kernels_called": kernels,
        "ms": {w: {a: round(statistics.median(samples[w][a]), 2) for a in arms} for w in loads},
        "same_tokens_as_all": {
            w: {a: tokens[w][a] == tokens[w]["all"] and len(tokens[w]["all"]) == 1 for a in arms}
            for w in loads
            if tokens[w]["all"]
        },
        "off_over_all": {a: {w: paired(a, "all", w) for w in loads} for a in arms if a != "all"},
    }
    if "block" in arms:
        result["off_over_block_off"] = {
            a: {w: paired(a, "block", w) for w in loads} for a in arms if a in INSIDE_BLOCK or a == "none"
        }
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
