"""Engine benchmark: continuous batching with per-token routing against transformers with static batches.

    python -m molora.bench.engine [--quick] [--json OUT]
    python -m molora.bench.engine --shared-prefix [...]   the prefix-cache benchmark (molora.bench.prefix)
    python -m molora.bench.engine --peer llama.cpp [...]  against llama.cpp, same prompts (molora.bench.peer)
    python -m molora.bench.engine --speculative JSON [...]  with and without speculative decoding
                                                           (molora.bench.speculative)

Setup: SmolLM2-135M (the embedded default), 4 random-weight adapters (r=16, all seven projections, written
with `save_adapter` into a temp dir), a VocabRouter splitting the vocabulary into 4 ranges (per-token
routing: every step mixes all adapters), N concurrent requests of P-token random prompts and G greedy new
tokens each (eos ignored, so every variant does the same greedy work).

Measured in one run, variants interleaved within each repetition, medians reported:
  engine       Engine.generate over all requests (continuous batching, paged KV, per-token routing)
  engine_base  the same engine with routing "none" (no LoRA work): the runner's own speed
  hf_routed    the transformers forward with a DynamicCache (MoLoRAModel.generate's loop, last-token logits
               only), static left-padded batches of --hf-batch requests, the same per-token routing
  hf_base      transformers `model.generate` on the same static batches without adapters (no LoRA work at
               all: a lower bound for transformers' time)
  decode step  Engine.step() with N sequences decoding under per-token routing vs. the same step with
               routing "none" (base only): the routing overhead ratio; then a few routed decode steps under
               torch.profiler: the time of molora's KERNEL_OPS timed around each call without the profiler
               (molora.ops.fused_cpu.kernel_clock), plus torch's KERNEL_OPS from a profiled run of as many steps,
               over the clocked steps' wall time (decode_step_kernel_share); and the profiled steps' kernel time
               over their own wall time, the profiler's cost included (decode_step_kernel_share_profiled: lower)
  swap         promoting an adapter from the CPU tier into a slot vs. a plain copy of the same bytes
  ceiling      one profiled engine run (torch.profiler): the time its GEMM, attention and LoRA kernels take
               (`KERNEL_OPS`, self time). hf_routed_s / that time is the most any runner calling the same
               kernels could gain over hf_routed, even with zero cost outside them (scheduling, routing
               metadata, norms, sampling, KV writes). Profiling adds a little to each op, so the ceiling
               is if anything slightly low.
Ends with one JSON line. Owns only timing and reporting; knows the engine through its public API.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from molora.adapters import save_adapter
from molora.bench.common import paired_ratio, rotated, sync, timed_ms
from molora.config import LLAMA_PROJECTIONS, SamplingParams
from molora.engine import Engine, EngineConfig
from molora.engine.hotset import HotSet
from molora.ops import fused_cpu
from molora.routing import VocabRouter

if TYPE_CHECKING:
    from molora.model.attach import MoLoRAModel


def make_adapters(model: Any, folder: Path, k: int, rank: int, seed: int = 0) -> dict[str, Path]:
    """k random-weight PEFT folders (rank `rank`, all seven projections) for `model`."""
    g = torch.Generator().manual_seed(seed)
    targets = {
        n: m
        for n, m in model.named_modules()
        if isinstance(m, torch.nn.Linear) and n.rsplit(".", 1)[-1] in LLAMA_PROJECTIONS
    }
    out = {}
    for i in range(k):
        modules = {
            n: (
                torch.randn(rank, m.in_features, generator=g) / m.in_features**0.5,
                torch.randn(m.out_features, rank, generator=g) * 0.02,
            )
            for n, m in targets.items()
        }
        out[f"skill{i}"] = save_adapter(
            folder / f"skill{i}",
            modules,
            r=rank,
            lora_alpha=2 * rank,
            base_model_name_or_path=getattr(model, "name_or_path", None),
        )
    return out


KERNEL_OPS = frozenset(
    {
        "aten::mm",
        "aten::addmm",
        "aten::addmm_",
        "aten::bmm",
        "aten::baddbmm",
        "aten::_scaled_dot_product_flash_attention_for_cpu",
        "aten::_scaled_dot_product_attention_math",
        "aten::_scaled_dot_product_efficient_attention",
        "aten::_scaled_dot_product_flash_attention",
        "molora::lora_fused_",  # the C++ kernels (torch.ops.molora, molora.ops.fused_cpu)
        "molora::paged_decode",
        "molora::paged_decode_rows",
        # GEMMs on packed weights (molora.ops.packed)
        "mkl::_mkl_linear",
        "molora::linear_panels",
        "molora::linear_amx",
    }
)


def kernel_times(fn: Callable[[], Any], device: torch.device | None = None) -> tuple[dict[str, float], float]:
    """({KERNEL_OPS name: seconds}, profiled wall seconds) of one run of `fn` under torch.profiler. The wall clock
    runs inside the profiling context: the profiler's own start and stop (about 0.1 s here, some 10% of ten
    decode steps) are no part of `fn`'s time. KERNEL_OPS are summed in CPU self time: on CUDA that is the
    launch cost, not the kernels' device time (the share is a CPU-side figure there)."""
    from torch.profiler import profile

    with profile() as prof:
        sync(device)
        t0 = time.perf_counter()
        fn()
        sync(device)
        wall = time.perf_counter() - t0
    out: dict[str, float] = {}
    for e in prof.key_averages():  # a name may come twice: a range opened in Python and one opened in C++
        if e.key in KERNEL_OPS:
            out[e.key] = out.get(e.key, 0.0) + e.self_cpu_time_total / 1e6
    return out, wall


def kernel_seconds(fn: Callable[[], Any], device: torch.device | None = None) -> tuple[float, float]:
    """(seconds in KERNEL_OPS, profiled wall seconds) of one run of `fn` under torch.profiler (`kernel_times`)."""
    per_op, wall = kernel_times(fn, device)
    return sum(per_op.values()), wall


def _padded(prompts: list[list[int]], device: torch.device | str = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
    """Left-padded ids [B, L] and attention mask [B, L] of a static batch, on `device`."""
    width = max(len(p) for p in prompts)
    ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts], device=device)
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=device)
    return ids, mask


@torch.no_grad()
def _hf_routed(mm: MoLoRAModel, prompts: list[list[int]], news: list[int], batch: int) -> None:
    """Static batches through the transformers forward (DynamicCache, SDPA) with per-token routing; each
    batch runs until its longest request is done. MoLoRAModel.generate's loop, plus logits_to_keep=1
    (it computes prefill logits at every position, which would flatter the engine)."""
    from transformers import DynamicCache

    for i in range(0, len(prompts), batch):
        ids, mask = _padded(prompts[i : i + batch], mm.device)
        pos = (mask.cumsum(-1) - 1).clamp(min=0)
        cache, step_ids, start = DynamicCache(), ids, 0
        for _ in range(max(news[i : i + batch])):
            out = mm(
                step_ids,
                attention_mask=mask,
                adapter_ids=mm.router,
                position_ids=pos,
                cache=cache,
                use_cache=True,
                start=start,
                logits_to_keep=1,
            )
            nxt = out.logits[:, -1].argmax(-1)
            start += step_ids.shape[1]
            step_ids, pos = nxt[:, None], pos[:, -1:] + 1
            mask = torch.cat([mask, mask.new_ones(mask.shape[0], 1)], dim=1)


def _hf_base(model: Any, prompts: list[list[int]], news: list[int], batch: int) -> None:
    for i in range(0, len(prompts), batch):
        ids, mask = _padded(prompts[i : i + batch], next(model.parameters()).device)
        new = max(news[i : i + batch])
        model.generate(
            ids, attention_mask=mask, max_new_tokens=new, min_new_tokens=new, do_sample=False, pad_token_id=0
        )


def decode_steps(
    engines: dict[str, Engine], prompts: list[list[int]], routing: dict[str, str], steps: int
) -> dict[str, float]:
    """Median ms of one Engine.step() with every sequence decoding, per engine, steps interleaved."""
    for name, eng in engines.items():
        for p in prompts:
            eng.add_request(p, SamplingParams(max_new_tokens=2 * steps + 8), routing=routing[name])  # all steps
        while any(r.remaining > 1 or r.num_computed == 0 for r in eng.requests.values()):
            eng.step()  # finish every prefill first
    times: dict[str, list[float]] = {n: [] for n in engines}
    dev = {n: e.runner.device for n, e in engines.items()}
    for i in range(steps):
        for name in rotated(list(engines), i):
            times[name].append(timed_ms(engines[name].step, dev[name]))
    first = next(iter(engines))  # the routed engine: its decode step's kernel share
    n = max(steps // 2, 1)
    run_n = lambda: [engines[first].step() for _ in range(n)]  # noqa: E731
    with fused_cpu.kernel_clock() as clock:  # n steps timing molora's kernels themselves, no profiler
        plain_s = timed_ms(run_n, dev[first]) / 1e3
    per_op, wall_s = kernel_times(run_n, dev[first])  # then n steps under torch.profiler
    kernel_s = sum(per_op.values())
    aten_s = sum(v for k, v in per_op.items() if not k.startswith("molora::"))  # torch's own kernels, if any ran
    clocked_s = sum(v for k, v in clock.items() if k in KERNEL_OPS) + aten_s
    for eng in engines.values():
        for rid in list(eng.requests):
            eng.abort(rid)
        eng.step()
    med = {name: statistics.median(v[2:]) for name, v in times.items()}
    # molora's kernels timed around each call (fused_cpu.kernel_clock) plus torch's kernels from the profiled steps,
    # over the clocked steps' wall time; and, as before, the profiled kernel time over the profiled steps' wall time
    # (the profiler adds about a fifth to every step, measured 145 against 117-125 ms, and inflates each kernel's
    # self time: divided by the unprofiled steps' time that read 1.05 in one run, so it is not used)
    return {**med, "kernel_share": clocked_s / plain_s, "kernel_share_profiled": kernel_s / wall_s}


def swap_cost(mm: MoLoRAModel, name: str, repeats: int = 5) -> dict[str, float]:
    """ms to evict `name` from its slot and promote it back from the CPU tier, vs. copying its bytes."""
    hs = HotSet(mm, cpu_bytes=1 << 30)
    adapter = mm.adapters[name]
    swap, copy = [], []
    for _ in range(repeats):
        hs._evict(name)
        swap.append(timed_ms(lambda: hs.acquire([name]), mm.device))  # CPU tier -> slot (no disk read)
        hs.release([name])
        srcs = [t for m in adapter.modules.values() for t in (m.A, m.B)]
        dsts = [torch.empty_like(t) for t in srcs]
        copy.append(timed_ms(lambda: [d.copy_(s) for d, s in zip(dsts, srcs)], mm.device))
    return {
        "swap_ms": statistics.median(swap),
        "memcpy_ms": statistics.median(copy),
        "adapter_mib": adapter.nbytes() / 2**20,
    }


def bench_config(requests: int, longest: int) -> EngineConfig:
    """The engine settings of the engine benches: `requests` sequences of up to `longest` tokens all resident, steps
    of up to 512 tokens, no EOS stop (every request decodes its full count), and no prefix cache: the benches time
    the same prompts repeatedly on one engine, and with the cache on a repetition found most of its prompt blocks
    cached by the one before (768 of 1024 prompt tokens at 16 x 64) and skipped that prefill, which the peers it is
    compared with (transformers, llama.cpp) do not. Older records were made with the cache on (molora.bench.prefix
    measures what it saves)."""
    return EngineConfig(
        max_num_seqs=requests,
        max_tokens_per_step=512,
        block_size=16,
        kv_budget_tokens=requests * (longest + 16),
        max_model_len=longest,
        stop_at_eos=False,
        enable_prefix_caching=False,
    )


def workload(
    requests: int, prompt_len: int, new_tokens: int, vocab: int, mixed: bool, seed: int = 0
) -> tuple[list[list[int]], list[int]]:
    """Random prompts and new-token counts: all equal, or (mixed) uniform in [1/4, 1] of the given sizes."""
    g = torch.Generator().manual_seed(seed)
    lo = lambda n: max(1, n // 4) if mixed else n  # noqa: E731
    lens = torch.randint(lo(prompt_len), prompt_len + 1, (requests,), generator=g).tolist()
    news = torch.randint(lo(new_tokens), new_tokens + 1, (requests,), generator=g).tolist()
    return [torch.randint(0, vocab, (n,), generator=g).tolist() for n in lens], news


def measure(
    mm: MoLoRAModel,
    cfg: EngineConfig,
    prompts: list[list[int]],
    news: list[int],
    repeats: int,
    hf_batch: int,
    decode_samples: int,
    tag: str,
) -> dict:
    """Interleaved throughput of engine / hf_routed / hf_base, then the decode-step ratio (module docstring)."""
    engine = Engine(mm, cfg)
    params = [SamplingParams(max_new_tokens=n) for n in news]
    variants = {
        "engine": lambda: engine.generate(prompts, params, routing="vocab"),
        "engine_base": lambda: engine.generate(prompts, params, routing="none"),
        "hf_routed": lambda: _hf_routed(mm, prompts, news, hf_batch),
        "hf_base": lambda: _hf_base(mm.model, prompts, news, hf_batch),
    }
    secs: dict[str, list[float]] = {k: [] for k in variants}
    for i in range(repeats):
        for name in rotated(list(variants), i):
            secs[name].append(timed_ms(variants[name], mm.device) / 1e3)
            print(f"  {tag} {name}: {secs[name][-1]:.2f} s", file=sys.stderr, flush=True)
    med = {k: statistics.median(v) for k, v in secs.items()}
    gen = sum(news)
    step = decode_steps(
        {"routed": engine, "base": Engine(mm, cfg)}, prompts, {"routed": "vocab", "base": "none"}, decode_samples
    )
    out = {f"{k}_s": v for k, v in med.items()}
    out.update({f"{k}_tok_s": gen / v for k, v in med.items()})
    kernel_s, profiled_s = kernel_seconds(variants["engine"], mm.device)
    out.update({f"{k}_samples_s": [float(f"{x:.6g}") for x in v] for k, v in secs.items()})  # 6 digits: a ratio
    # recomputed from the record agrees with the stored one (3 decimals lost most of a tiny run's milliseconds)
    out["speedup_vs_hf_routed_paired"] = list(paired_ratio(secs["hf_routed"], secs["engine"]))  # [median, q1, q3]
    out.update(
        speedup_vs_hf_routed=med["hf_routed"] / med["engine"],
        speedup_vs_hf_base=med["hf_base"] / med["engine"],
        engine_base_vs_hf_base=med["hf_base"] / med["engine_base"],
        engine_kernel_s=kernel_s,
        engine_kernel_share=kernel_s / profiled_s,
        ceiling_vs_hf_routed=med["hf_routed"] / kernel_s,
        decode_step_routed_ms=step["routed"],
        decode_step_base_ms=step["base"],
        decode_step_kernel_share=step["kernel_share"],
        decode_step_kernel_share_clocked=True,
        decode_step_kernel_share_profiled=step["kernel_share_profiled"],
        decode_routing_overhead=step["routed"] / step["base"],
    )
    return out


def run(
    requests: int,
    prompt_len: int,
    new_tokens: int,
    repeats: int,
    hf_batch: int,
    decode_samples: int,
    bf16: bool,
    mixed: bool,
) -> dict:
    from molora import attach
    from molora.model.base import load_base

    model, _tok = load_base()  # on molora.model.base.device() ($MOLORA_DEVICE)
    vocab = model.config.vocab_size
    with tempfile.TemporaryDirectory() as tmp:
        paths = make_adapters(model, Path(tmp), 4, 16)
        q = vocab // 4
        router = VocabRouter([(i * q, (i + 1) * q if i < 3 else vocab, f"skill{i}") for i in range(4)])
        mm = attach(model, paths, router=router)
        prompts, news = workload(requests, prompt_len, new_tokens, vocab, mixed)
        longest = prompt_len + new_tokens + decode_samples + 16
        cfg = bench_config(requests, longest)
        result = {
            "requests": requests,
            "prompt_len": prompt_len,
            "new_tokens": new_tokens,
            "mixed": mixed,
            "generated_tokens": sum(news),
            "repeats": repeats,
            "hf_batch": hf_batch,
            "threads": torch.get_num_threads(),
        }
        result.update(measure(mm, cfg, prompts, news, repeats, hf_batch, decode_samples, "fp32"))
        result.update(swap_cost(mm, "skill0"))
        if bf16:
            mm.to(torch.bfloat16)
            r16 = measure(mm, cfg, prompts, news, repeats, hf_batch, decode_samples, "bf16")
            result.update({f"bf16_{k}": v for k, v in r16.items()})
            result["bf16_engine_vs_fp32_hf_routed"] = result["hf_routed_s"] / r16["engine_s"]
    return result


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if "--shared-prefix" in argv:  # the prefix-cache benchmark (molora.bench.prefix): its own options
        from molora.bench import prefix

        return prefix.main(argv)
    if "--speculative" in argv:  # speculative decoding on the default bundle (molora.bench.speculative)
        from molora.bench import speculative

        return speculative.main(argv)
    if "--peer" in argv:  # llama.cpp as a peer (molora.bench.peer): its own options
        from molora.bench import peer

        i = argv.index("--peer")
        if argv[i + 1 : i + 2] != ["llama.cpp"]:
            print("molora bench engine: --peer takes one value, llama.cpp", file=sys.stderr)
            return 2
        return peer.main(argv[:i] + argv[i + 2 :])
    ap = argparse.ArgumentParser(prog="molora bench engine", description=__doc__.split("\n")[0])
    ap.add_argument("--requests", type=int, default=32, help="concurrent requests (default 32)")
    ap.add_argument("--prompt-len", type=int, default=128, help="prompt tokens per request (default 128)")
    ap.add_argument("--new-tokens", type=int, default=64, help="greedy new tokens per request (default 64)")
    ap.add_argument("--repeats", type=int, default=3, help="interleaved repetitions (default 3; --quick: 1)")
    ap.add_argument("--hf-batch", type=int, default=32, help="static batch size of the transformers baselines")
    ap.add_argument("--decode-samples", type=int, default=20, help="decode steps timed per variant")
    ap.add_argument("--bf16", action="store_true", help="also run every variant with bf16 weights (AMX on CPU)")
    ap.add_argument(
        "--mixed",
        action="store_true",
        help="prompt lengths and new tokens uniform in [1/4, 1] of the given sizes (padding and "
        "early finishers: where continuous batching pays)",
    )
    ap.add_argument("--threads", type=int, default=0, help="torch CPU threads (default: torch's choice)")
    ap.add_argument("--quick", action="store_true", help="one repetition, 10 decode samples")
    ap.add_argument("--json", metavar="OUT", help="also write the result JSON to this file")
    args = ap.parse_args(argv)
    repeats, samples = (1, 10) if args.quick else (args.repeats, args.decode_samples)
    if args.threads:
        torch.set_num_threads(args.threads)
    res = run(args.requests, args.prompt_len, args.new_tokens, repeats, args.hf_batch, samples, args.bf16, args.mixed)
    print(
        f"engine {res['engine_tok_s']:.1f} tok/s | transformers routed {res['hf_routed_tok_s']:.1f} tok/s "
        f"(x{res['speedup_vs_hf_routed']:.2f}) | transformers base {res['hf_base_tok_s']:.1f} tok/s "
        f"(x{res['speedup_vs_hf_base']:.2f}) | engine base-only x{res['engine_base_vs_hf_base']:.2f} vs "
        "transformers base"
    )
    print(
        f"ceiling: the engine's GEMM + attention kernels take {res['engine_kernel_s']:.2f} s "
        f"({100 * res['engine_kernel_share']:.0f}% of a profiled run): at most x{res['ceiling_vs_hf_routed']:.2f} "
        f"over transformers routed with these kernels"
    )
    print(
        f"decode step: routed {res['decode_step_routed_ms']:.1f} ms vs base {res['decode_step_base_ms']:.1f} ms "
        f"(x{res['decode_routing_overhead']:.2f}); swap {res['swap_ms']:.2f} ms vs memcpy {res['memcpy_ms']:.2f} ms"
    )
    line = json.dumps({"bench": "engine", **{k: round(v, 4) if isinstance(v, float) else v for k, v in res.items()}})
    if args.json:
        Path(args.json).write_text(line + "\n")
    print(line)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
