"""Model benchmark: one routed forward against the base model and against the peers, side by side.

    python -m molora.bench.model [--models tiny smollm2] [--quick] [--threads 1] [--json OUT] [--plot OUT.png]

Setup per model (a tiny random Llama config, and SmolLM2-135M, the embedded default): K=4 random-weight
PEFT adapters, rank 16 on all seven projections, random per-token routing. Variants, timed interleaved in
each repetition (medians, ms; every ratio is against `base` measured in the same run):

  base          the plain transformers model (no adapters at all)
  molora        MoLoRAModel forward with a per-token adapter_ids tensor [B, L] (one pass, work N)
  runner_base   the engine's lean ModelRunner (flattened batch, paged KV cache) with routing off
  runner        the same runner with the per-token routing (the engine's hot path)
  peft_mixed    PeftModel with the K adapters and `adapter_names=[...]`, one adapter per request (PEFT's
                mixed batch: per-request routing, not per token, the closest PEFT offers)
  xlora         PEFT X-LoRA (XLoraModel, depth-1 classifier): a base "scaling pass", then every adapter at
                every token weighted by the learned per-token mixture (dense, the nearest peer to MoLoRA)
  peft_single   PeftModel with one adapter active on every token: a plain unmerged LoRA, the cost any
                unmerged adapter pays over the base (the floor for molora's per-token forward)
  kpass         per-token routing emulated with per-sequence routing: K full passes, one adapter each
  base_bf16, molora_bf16   the same in bfloat16 weights (off with --no-bf16)

Scenarios: prefill (B x L tokens, logits of the last position only: what a server needs) and one decode
step (batch 8 and 32, a KV cache of L tokens: transformers DynamicCache via `cache=`, logits_to_keep=1;
the runner uses its paged cache). X-LoRA cannot use a KV cache in PEFT (XLoraModel refuses
`use_cache=True` and its generate forces use_cache=False), so its decode step is measured as what it
really costs there: a full recompute over the L + 1 tokens (`xlora_recompute`).

Then the K-modality workload of the paper: sequences whose tokens alternate K vocab-routed modalities
(VocabRouter over K equal vocabulary ranges, segments of --segment tokens), one per-token pass against
per-sequence emulation (K passes), K in {2, 4, 8}: the speedup should approach K.

Ends with one JSON line. Owns the plan, the timing (interleaved, medians, paired ratios) and the JSON; the
models and the callables timed live in molora.bench.model_workloads, the goals, table and plot in
molora.bench.model_report (their names are re-exported here).
"""

from __future__ import annotations

import argparse
import copy
import sys
import tempfile
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from molora.bench.common import Timing, add_common_args, emit, machine_info, set_threads, stderr_log, time_interleaved
from molora.bench.model_report import GOALS, format_table, goals, plot, scenario_ratio
from molora.bench.model_workloads import (
    Stack,
    build_stack,
    decode_fns,
    device_of,
    kmodality_fns,
    load_model,
    lora_flops,
    make_adapters,
    prefill_fns,
)
from molora.config import LLAMA_PROJECTIONS

__all__ = [  # the workloads' and the report's names are re-exported: their import path stays molora.bench.model
    "GOALS",
    "Plan",
    "Stack",
    "bench_kmodality",
    "bench_model",
    "build_stack",
    "decode_fns",
    "goals",
    "kmodality_fns",
    "load_model",
    "lora_flops",
    "main",
    "make_adapters",
    "prefill_fns",
    "run",
]

# ---------------------------------------------------------------------------------------------- driver


@dataclass
class Plan:
    models: list[str]
    repeats: int
    prefill: tuple[int, int]  # (batch, length)
    decode_batches: list[int]
    ctx: int
    kmod_Ks: list[int]
    kmod_batch: int
    kmod_models: list[str]
    segment: int
    bf16: bool
    xlora: bool
    k: int = 4
    rank: int = 16
    xlora_decode_repeats: int = 2


def _scenario(
    label: str,
    fns: dict,
    repeats: int,
    resets: dict | None = None,
    max_repeats: dict | None = None,
    device: torch.device | None = None,
) -> dict:
    stderr_log(f"# {label}: {', '.join(fns)}")
    t: Timing = time_interleaved(fns, repeats, reset=resets, max_repeats=max_repeats, log=stderr_log, device=device)
    out = t.summary("base")
    if "base_bf16" in out["ms"]:
        out["vs_base_bf16"] = t.ratios("base_bf16")
    return out


def bench_model(name: str, plan: Plan, folder: Path) -> dict:
    base = load_model(name)
    longest = max(plan.prefill[1], plan.ctx + 1)
    st = build_stack(
        name,
        base,
        folder / name,
        plan.k,
        plan.rank,
        xlora=plan.xlora,
        bf16=plan.bf16,
        max_len=longest,
        max_batch=max([plan.prefill[0], *plan.decode_batches]),
    )
    cfg = base.config
    res: dict[str, Any] = {
        "model": name,
        "config": {
            k: getattr(cfg, k)
            for k in (
                "hidden_size",
                "intermediate_size",
                "num_hidden_layers",
                "num_attention_heads",
                "num_key_value_heads",
                "vocab_size",
            )
        },
        "adapters": plan.k,
        "rank": plan.rank,
        "targets": list(LLAMA_PROJECTIONS),
        "flops": lora_flops(cfg, plan.rank),
        "errors": st.errors,
    }
    B, L = plan.prefill
    with torch.inference_mode(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        res["prefill"] = {"batch": B, "length": L} | _scenario(
            f"{name} prefill {B}x{L}", prefill_fns(st, B, L), plan.repeats, device=device_of(base)
        )
        for b in plan.decode_batches:
            # X-LoRA's recompute step costs a whole prefill: measured at the smallest batch only
            fns, resets = decode_fns(st, b, plan.ctx, xlora=b == min(plan.decode_batches))
            res[f"decode_b{b}"] = {"batch": b, "context": plan.ctx} | _scenario(
                f"{name} decode b={b} ctx={plan.ctx}",
                fns,
                plan.repeats,
                resets,
                {"xlora_recompute": plan.xlora_decode_repeats},
                device_of(base),
            )
        if name in plan.kmod_models and plan.kmod_Ks:
            res["kmodality"] = bench_kmodality(st, plan)
    return res


def bench_kmodality(st: Stack, plan: Plan) -> list[dict]:
    from molora import attach

    Kmax = max(plan.kmod_Ks)
    with tempfile.TemporaryDirectory() as tmp:
        paths = make_adapters(st.base, Path(tmp), Kmax, plan.rank, seed=1)
        mm = attach(copy.deepcopy(st.base), paths, slots=Kmax)
    rows = []
    for K in plan.kmod_Ks:
        fns = kmodality_fns(mm, st.base, K, plan.kmod_batch, plan.prefill[1], plan.segment)
        s = _scenario(f"{st.name} K-modality K={K}", fns, plan.repeats, device=device_of(st.base))
        s.update(
            K=K,
            batch=plan.kmod_batch,
            length=plan.prefill[1],
            segment=plan.segment,
            speedup_of_medians=round(s["ms"]["per_sequence"] / s["ms"]["per_token"], 3),
        )
        s["speedup"] = round(scenario_ratio(s, "per_sequence", "per_token"), 3)
        rows.append(s)
    return rows


def run(plan: Plan) -> dict:
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        for name in plan.models:
            results.append(bench_model(name, plan, Path(tmp)))
    return {
        "bench": "model",
        "machine": machine_info(),
        "plan": plan.__dict__,
        "results": results,
        "goals": goals(results),
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="molora bench model", description=__doc__.splitlines()[0])
    p.add_argument("--models", nargs="+", default=["tiny", "smollm2"], choices=["tiny", "smollm2"])
    p.add_argument("--repeats", type=int, default=5, help="interleaved repetitions (default 5; --quick: 3)")
    p.add_argument("--prefill", type=int, nargs=2, default=[8, 128], metavar=("B", "L"), help="prefill shape")
    p.add_argument("--decode-batches", type=int, nargs="*", default=[8, 32], help="decode batch sizes")
    p.add_argument("--context", type=int, default=128, help="cached tokens per sequence at the decode step")
    p.add_argument("--kmod-Ks", type=int, nargs="*", default=[2, 4, 8], help="K of the K-modality workload")
    p.add_argument("--kmod-batch", type=int, default=8, help="sequences in the K-modality prefill (--quick: 1)")
    p.add_argument("--segment", type=int, default=16, help="tokens per modality run in the K-modality workload")
    p.add_argument("--no-bf16", action="store_true", help="skip the bfloat16 variants")
    p.add_argument("--no-xlora", action="store_true", help="skip PEFT X-LoRA")
    add_common_args(p)
    a = p.parse_args(argv)
    threads = set_threads(a.threads)
    plan = Plan(
        models=a.models,
        repeats=3 if a.quick and a.repeats == 5 else a.repeats,
        prefill=tuple(a.prefill),
        decode_batches=a.decode_batches,
        ctx=a.context,
        kmod_Ks=a.kmod_Ks,
        kmod_batch=1 if a.quick and a.kmod_batch == 8 else a.kmod_batch,
        kmod_models=a.models,
        segment=a.segment,
        bf16=not a.no_bf16,
        xlora=not a.no_xlora,
        xlora_decode_repeats=1 if a.quick else 2,
    )
    stderr_log(f"# molora bench model: {plan} threads={threads}")
    out = run(plan)
    print(format_table(out))
    if a.plot:
        plot(out, a.plot)
    emit(out, a.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
