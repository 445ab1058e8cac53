"""One prepared device check: the GPU path of molora, measured in one run that prints one JSON line.

    python -m tools.gpu_check [--json OUT]            # a CUDA machine: under 8 minutes
    python -m tools.gpu_check --dry-run               # tiny shapes on the CPU, under a minute (plumbing only)

Needs only torch, transformers, peft and (for the kernel) triton; no network, no model hub: molora is imported
from this source tree, the models are random-weight Qwen3 models built from configs written below (the shapes of
Qwen3-1.7B and Qwen3-8B), the adapters random rank-16 LoRAs on all seven projections. Sections, each timed and
reported (an error is recorded in the JSON, never hidden, and the rest still runs):

  exactness   the triton backend (and stacked_mask) against `lora_delta_reference` (float32 spec) on the real
              linear shapes, K = 4 and 16, top-1 with "none" tokens and top-2 weighted, bf16 / fp16 / fp32
  dispatch    one linear, bf16, T = 1 ... 8192, K = 4 and 16, per-token random routing: base GEMM + routed delta
              (triton, plan prebuilt as in a model step; and stacked_mask) vs base GEMM + one adapter on every
              token (two dense GEMMs: what a one-adapter server runs); the plan's own build time beside
              (once per step for all 7 * L linears). Medians over interleaved, rotated repetitions, CUDA events.
  decode      the runner's decode step at batch 8 on the Qwen3-1.7B shape (then 8B while the budget lasts): eager,
              eager without routing, and replayed from a CUDA graph (molora.model.graphs, a second runner over
              the same model); the graph's logits against eager ones for two routings replayed in turn and
              after an adapter is unloaded (dry run on the CPU: graphs need CUDA, not run)
  engine      Engine.generate vs transformers (the same per-token VocabRouter routing through MoLoRAModel's
              forward, static batch; and plain `model.generate` without adapters) at 64 concurrent sequences

The GPU goals are checked in "goals" from the figures above (null where a figure is missing). Without CUDA
(and without --dry-run / --device cpu) it exits with status 2 and says why.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent

# (name, config) of the random-weight models: Qwen3-1.7B and Qwen3-8B as published (hidden, MLP, layers, heads)
QWEN3_SHAPES: dict[str, dict[str, Any]] = {
    "qwen3-1.7b": dict(
        vocab_size=151936,
        hidden_size=2048,
        intermediate_size=6144,
        num_hidden_layers=28,
        num_attention_heads=16,
        num_key_value_heads=8,
        head_dim=128,
        tie_word_embeddings=True,
    ),
    "qwen3-8b": dict(
        vocab_size=151936,
        hidden_size=4096,
        intermediate_size=12288,
        num_hidden_layers=36,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=128,
        tie_word_embeddings=False,
    ),
}
TINY_SHAPE = dict(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    tie_word_embeddings=True,
)
RANK = 16


def log(msg: str) -> None:
    print(f"[gpu_check {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


# ---------------------------------------------------------------------------------------------- setup


def qwen3(shape: dict[str, Any], device: Any, dtype: Any) -> Any:
    """A random-weight Qwen3 causal LM of `shape`, built directly on `device` (eval mode)."""
    import torch
    from transformers import AutoModelForCausalLM, Qwen3Config

    cfg = Qwen3Config(
        max_position_embeddings=4096,
        rope_theta=1e6,
        rms_norm_eps=1e-6,
        pad_token_id=0,
        eos_token_id=1,
        bos_token_id=2,
        **shape,
    )
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(cfg, dtype=dtype)
    return model.eval()


def linear_shapes(shape: dict[str, Any]) -> dict[str, tuple[int, int]]:
    """(d_in, d_out) of three representative projections of a model shape."""
    D, I, q = shape["hidden_size"], shape["intermediate_size"], shape["num_attention_heads"] * shape["head_dim"]
    return {"q_proj": (D, q), "gate_proj": (D, I), "down_proj": (I, D)}


def bank(S: int, d_in: int, d_out: int, device: Any, dtype: Any, seed: int) -> tuple[Any, Any, Any]:
    """A [S, R, d_in], B [S, d_out, R] (slot-major, as LoRASlots keeps it), scale [S] float32."""
    import torch

    g = torch.Generator(device="cpu").manual_seed(seed)
    A = (torch.randn(S, RANK, d_in, generator=g) / d_in**0.5).to(device, dtype)
    Bt = (torch.randn(S, RANK, d_out, generator=g) * 0.02).to(device, dtype)
    return A, Bt.transpose(1, 2), torch.full((S,), 2.0, device=device)


class Timer:
    """Milliseconds per call of a function: CUDA events around `inner` calls on CUDA, perf_counter elsewhere."""

    def __init__(self, device: Any) -> None:
        import torch

        self.cuda = device.type == "cuda"
        self.torch = torch

    def ms(self, fn: Callable[[], Any], inner: int) -> float:
        torch = self.torch
        if self.cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(inner):
                fn()
            end.record()
            end.synchronize()
            return start.elapsed_time(end) / inner
        t0 = time.perf_counter()
        for _ in range(inner):
            fn()
        return (time.perf_counter() - t0) * 1e3 / inner


def interleaved(timer: Timer, fns: dict[str, Callable[[], Any]], repeats: int, inner: int) -> dict[str, float]:
    """Median ms per call of each variant; variants rotated every repetition, one warm-up round first."""
    from molora.bench.common import rotated

    names = list(fns)
    for n in names:
        fns[n]()
    samples: dict[str, list[float]] = {n: [] for n in names}
    for i in range(repeats):
        for n in rotated(names, i):
            samples[n].append(timer.ms(fns[n], inner))
    return {n: statistics.median(v) for n, v in samples.items()}


def resolved_backend(mm: Any, slots: Any) -> str:
    """The backend "auto" runs for q_proj of block 0 on this step's routing (slots [T, k]), with autograd off."""
    import torch

    lin = mm.model.model.layers[0].self_attn.q_proj
    d = lin.dispatcher
    x = torch.empty(slots.shape[0], lin.in_features, device=lin.weight.device, dtype=lin.weight.dtype)
    with torch.no_grad():
        return d.backend_for(d.plan(slots, num_slots=lin.lora.A.shape[0]), x, lin.lora.A, lin.lora.B, lin.lora.scale)


# ---------------------------------------------------------------------------------------------- sections


def check_exactness(device: Any, shapes: dict[str, dict], Ks: list[int], triton_ok: bool, small: bool) -> list[dict]:
    """Max abs error and error relative to the reference's magnitude, per backend, dtype and case."""
    import torch

    from molora.ops import lora_delta, lora_delta_reference

    rows = []
    backends = (["triton"] if triton_ok else []) + ["stacked_mask"]
    T = 5 if small else 48
    for model, shape in shapes.items():
        d_in, d_out = linear_shapes(shape)["gate_proj"]
        for K in Ks:
            for k, weighted in ((1, False), (2, True)):
                g = torch.Generator().manual_seed(K * 10 + k)
                ids = torch.randint(-1, K, (T, k), generator=g).to(device)
                w = torch.rand(T, k, generator=g).to(device) if weighted else None
                for dtype in (torch.bfloat16, torch.float16, torch.float32):
                    A, B, scale = bank(K, d_in, d_out, device, dtype, seed=K)
                    x = torch.randn(T, d_in, generator=g).to(device, dtype)
                    with torch.no_grad():
                        want = lora_delta_reference(x.float(), A.float(), B.float(), scale, ids, w)
                        for backend in backends:
                            got = lora_delta(x, A, B, scale, ids, w, backend=backend).float()
                            err = (got - want).abs().max().item()
                            ref = want.abs().max().item()
                            rows.append(
                                {
                                    "model": model,
                                    "linear": "gate_proj",
                                    "K": K,
                                    "top_k": k,
                                    "T": T,
                                    "dtype": str(dtype).replace("torch.", ""),
                                    "backend": backend,
                                    "max_abs_err": err,
                                    "max_abs_ref": ref,
                                    "rel_err": err / max(ref, 1e-12),
                                }
                            )
    return rows


def check_dispatch(
    device: Any,
    shapes: dict[str, dict],
    Ks: list[int],
    Ts: list[int],
    triton_ok: bool,
    repeats: int,
    deadline: float,
    inner: int | None = None,
) -> list[dict]:
    """Per linear, bf16: base + routed delta against base + one adapter's dense delta (module docstring)."""
    import torch

    from molora.ops import LoRADispatcher

    timer = Timer(device)
    dtype = torch.bfloat16
    rows = []
    routed = {"triton": LoRADispatcher("triton", check_ids=False)} if triton_ok else {}
    routed["stacked_mask"] = LoRADispatcher("stacked_mask", check_ids=False)
    for model, shape in shapes.items():
        for lin, (d_in, d_out) in linear_shapes(shape).items():
            W = (torch.randn(d_out, d_in, device=device) / d_in**0.5).to(dtype)
            for K in Ks:
                A, B, scale = bank(K, d_in, d_out, device, dtype, seed=K)
                a0, b0 = A[0], B[0]  # one adapter on every token: [R, d_in], [d_out, R]
                for T in Ts:
                    if time.monotonic() > deadline:
                        rows.append({"model": model, "linear": lin, "K": K, "T": T, "skipped": "time budget"})
                        continue
                    x = torch.randn(T, d_in, device=device, dtype=dtype)
                    ids = torch.randint(0, K, (T, 1), device=device)
                    out = torch.empty(T, d_out, device=device, dtype=dtype)
                    fns: dict[str, Callable[[], Any]] = {
                        "base": lambda: torch.mm(x, W.t(), out=out),
                        "single": lambda: torch.mm(x, W.t(), out=out).addmm_(torch.mm(x, a0.t()).mul_(2.0), b0.t()),
                    }
                    plans = {}
                    with torch.no_grad():
                        for name, d in routed.items():
                            plans[name] = d.plan(ids, num_slots=K)
                            fns[name] = lambda d=d, p=plans[name]: d.apply(
                                p, x, A, B, scale, out=torch.mm(x, W.t(), out=out)
                            )
                        if "triton" in routed:
                            fns["triton_plan_build"] = lambda: routed["triton"].plan(ids, num_slots=K).triton_plan()
                        ms = interleaved(timer, fns, repeats, inner or (20 if T <= 1024 else 5))
                    row = {"model": model, "linear": lin, "d_in": d_in, "d_out": d_out, "K": K, "T": T, "ms": ms}
                    for name in routed:
                        row[f"{name}_vs_single"] = ms[name] / ms["single"]
                        row[f"{name}_delta_vs_single_delta"] = (ms[name] - ms["base"]) / max(
                            ms["single"] - ms["base"], 1e-9
                        )
                    rows.append(row)
    return rows


def check_decode(device: Any, shape: dict, K: int, batch: int, ctx: int, repeats: int, dtype: Any) -> dict:
    """The runner's eager decode step at `batch` sequences of `ctx` cached tokens, per-token routing."""
    import torch

    import molora
    from molora.bench.engine import make_adapters
    from molora.model.batch import BatchMeta, StepRouting
    from molora.model.runner import ModelRunner

    model = qwen3(shape, device, dtype)
    with tempfile.TemporaryDirectory() as tmp:
        mm = molora.attach(model, make_adapters(model, Path(tmp), K, RANK), slots=K)
    bs = 16
    per_seq = -(-(ctx + 2) // bs)
    runner = ModelRunner(mm, num_blocks=batch * per_seq, block_size=bs, max_model_len=per_seq * bs)
    tables = [list(range(b * per_seq, (b + 1) * per_seq)) for b in range(batch)]
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(3, shape["vocab_size"], (batch * ctx,), generator=g).to(device)
    slots = torch.randint(-1, K, (batch * ctx, 1), generator=g).to(device)
    with torch.no_grad():
        runner(
            prompt,
            torch.arange(ctx, device=device).repeat(batch),
            BatchMeta([ctx] * batch, [ctx] * batch, tables),
            StepRouting(slots),
        )
        tok = torch.randint(3, shape["vocab_size"], (batch,), generator=g).to(device)
        step_slots = torch.randint(-1, K, (batch, 1), generator=g).to(device)
        meta = BatchMeta([1] * batch, [ctx + 1] * batch, tables)
        pos = torch.full((batch,), ctx, device=device)
        fns = {
            "eager": lambda: runner(tok, pos, meta, StepRouting(step_slots), logits=True),
            "eager_base": lambda: runner(tok, pos, meta, None, logits=True),
        }
        graph: dict[str, Any] = {"status": "not run", "why": "graphs are captured on CUDA only"}
        if device.type == "cuda":
            graphed = ModelRunner(mm, num_blocks=batch * per_seq, block_size=bs, max_model_len=per_seq * bs)
            graphed(
                prompt,
                torch.arange(ctx, device=device).repeat(batch),
                BatchMeta([ctx] * batch, [ctx] * batch, tables),
                StepRouting(slots),
            )
            graph = check_graph(runner, graphed, mm, tok, pos, meta, step_slots, K)
            if graph["status"] == "replayed":
                fns["graph"] = lambda: graphed(tok, pos, meta, StepRouting(step_slots), logits=True)
        ms = interleaved(Timer(device), fns, repeats, 5)
    backend = resolved_backend(mm, step_slots)
    if "graph" in ms:
        graph.update(graph_ms=ms["graph"], eager_over_graph=ms["eager"] / ms["graph"])
    return {
        "batch": batch,
        "context": ctx,
        "K": K,
        "dispatch": backend,
        "eager_ms": ms["eager"],
        "eager_base_ms": ms["eager_base"],
        "routing_overhead": ms["eager"] / ms["eager_base"],
        "graph": graph,
    }


def check_graph(
    eager: Any, graphed: Any, mm: Any, tok: Any, pos: Any, meta: Any, slots: Any, K: int, capture: Any = None
) -> dict:
    """Replays (graphs enabled on `graphed`: CUDA graphs, or `capture`) against the eager runner, both over the
    same model and cached context: two per-token routings in turn, the same routing after one adapter is
    unloaded (the bank changes between replays), then a random per-block LearnedRouter (two allowed sets in
    turn); max |logit difference| of each step."""
    import torch

    from molora.model.batch import RouterGroup, StepRouting
    from molora.routing.learned import LearnedRouter, LearnedRouterConfig, decoder_layers

    graphs = graphed.enable_graphs() if capture is None else graphed.enable_graphs(capture=capture)

    def diff(routing: Any) -> float:
        g = graphed(tok, pos, meta, routing, logits=True).logits
        e = eager(tok, pos, meta, routing, logits=True).logits
        return float((g.float() - e.float()).abs().max())

    other = (slots + 1) % K
    fixed = [diff(StepRouting(s)) for s in (slots, other, slots)]
    name = mm.adapter_names[0]
    adapter = mm.adapters[name]
    mm.unload_adapter(name)
    fixed.append(diff(StepRouting(other)))
    mm.load_adapter(name, adapter)
    dev = slots.device
    router = LearnedRouter(
        LearnedRouterConfig(tuple(mm.adapter_names), mm.config.hidden_size, len(decoder_layers(mm.model)))
    ).to(dev)
    with torch.no_grad():
        router.weight.normal_(generator=torch.Generator(device=dev).manual_seed(0))
    router_slots = torch.tensor([mm.bank.slot_of(n) for n in mm.adapter_names], device=dev)
    learned = [
        diff(
            StepRouting(
                torch.full_like(slots, -1),
                router=router,
                router_slots=router_slots,
                groups=[RouterGroup(None, allowed)],
            )
        )
        for allowed in (None, torch.arange(K, device=dev) % 2 == 0)
    ]
    if dev.type == "cuda":
        torch.cuda.synchronize()
    return {
        "status": "replayed" if graphs.replays == 6 and not graphs.failed else "failed",
        "captures": graphs.captures,
        "replays": graphs.replays,
        "failed": [repr(k) for k in graphs.failed],
        "max_abs_logit_diff_vs_eager": fixed,
        "learned_max_abs_logit_diff_vs_eager": learned,
    }


def check_engine(device: Any, shape: dict, K: int, seqs: int, prompt_len: int, new: int, dtype: Any) -> dict:
    """Engine.generate vs transformers with the same per-token routing, `seqs` concurrent sequences."""
    import torch

    import molora
    from molora.bench.engine import _hf_base, _hf_routed, make_adapters
    from molora.config import SamplingParams
    from molora.engine import Engine, EngineConfig
    from molora.routing import VocabRouter

    model = qwen3(shape, device, dtype)
    V = shape["vocab_size"]
    q = V // K
    router = VocabRouter([(i * q, (i + 1) * q if i < K - 1 else V, f"skill{i}") for i in range(K)])
    with tempfile.TemporaryDirectory() as tmp:
        mm = molora.attach(model, make_adapters(model, Path(tmp), K, RANK), slots=K, router=router)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, V, (prompt_len,), generator=g).tolist() for _ in range(seqs)]
    longest = prompt_len + new + 16
    cfg = EngineConfig(
        max_num_seqs=seqs,
        max_tokens_per_step=max(512, seqs * 8),
        block_size=16,
        kv_budget_tokens=seqs * (longest + 16),
        max_model_len=longest,
        stop_at_eos=False,
        enable_prefix_caching=False,  # timed repetitions of the same prompts (molora.bench.engine.bench_config)
    )
    engine = Engine(mm, cfg)
    params = SamplingParams(max_new_tokens=new, ignore_eos=True)
    timer = Timer(device)
    variants = {
        "engine": lambda: engine.generate(prompts, params, routing="vocab"),
        "hf_routed": lambda: _hf_routed(mm, prompts, [new] * seqs, seqs),
        "hf_base": lambda: _hf_base(mm.model, prompts, [new] * seqs, seqs),
    }
    with torch.no_grad():
        # warm-up: the whole workload once, so that triton compiles and every decode graph this workload meets
        # (batch bucket, context-block buckets) is captured before the timed run
        engine.generate(prompts, params, routing="vocab")
        _hf_routed(mm, prompts[:2], [2, 2], 2)  # and transformers' first-call costs
        secs = {n: timer.ms(fn, 1) / 1e3 for n, fn in variants.items()}
    gen = seqs * new
    g = engine.runner.graphs
    return {
        "sequences": seqs,
        "prompt_len": prompt_len,
        "new_tokens": new,
        "K": K,
        "decode_graphs": None
        if g is None
        else {"captures": g.captures, "replays": g.replays, "failed": [repr(k) for k in g.failed]},
        "dispatch_at_decode": resolved_backend(mm, torch.zeros(seqs, 1, dtype=torch.long, device=device)),
        "seconds": secs,
        "tok_s": {n: gen / s for n, s in secs.items()},
        "engine_vs_hf_routed": secs["hf_routed"] / secs["engine"],
        "engine_vs_hf_base": secs["hf_base"] / secs["engine"],
    }


# ---------------------------------------------------------------------------------------------- driver


def goals(out: dict) -> dict:
    """The GPU goals from the measured figures (None where the figure is missing)."""
    disp = [r for r in out.get("dispatch") or [] if r.get("K") == 4 and r.get("T", 0) >= 256 and "ms" in r]
    worst = max((r["triton_vs_single"] for r in disp if "triton_vs_single" in r), default=None)
    eng = out.get("engine") or {}
    ratio = eng.get("engine_vs_hf_routed")
    graph = ((out.get("decode") or {}).get("qwen3-1.7b") or {}).get("graph") or {}
    speedup = graph.get("eager_over_graph")
    return {
        "routing_4_adapters_le_1.1x_single_T_ge_256": None
        if worst is None
        else {"worst_ratio": worst, "met": worst <= 1.1},
        "graph_decode_ge_2x_eager_b8": None if speedup is None else {"ratio": speedup, "met": speedup >= 2.0},
        "engine_ge_2x_transformers_64_seqs": None if ratio is None else {"ratio": ratio, "met": ratio >= 2.0},
    }


def run_section(into: dict, name: str, fn: Callable[[], Any], out: dict | None = None) -> None:
    """into[name] = fn(); an exception is recorded in out["errors"] (out: the top-level JSON, default `into`)."""
    out = into if out is None else out
    key = name if into is out else f"{next(k for k, v in out.items() if v is into)}.{name}"
    t0 = time.monotonic()
    log(f"{key} ...")
    try:
        into[name] = fn()
    except Exception as e:  # recorded in the JSON: a failed section must not hide the others
        into[name] = None
        out["errors"][key] = f"{type(e).__name__}: {e}"
        log(traceback.format_exc())
    out["section_s"][key] = round(time.monotonic() - t0, 2)
    log(f"{key}: {out['section_s'][key]} s")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda", help="cuda (default) or cpu (implies --dry-run's tiny shapes)")
    p.add_argument("--dry-run", action="store_true", help="tiny shapes on the CPU in under a minute: plumbing only")
    p.add_argument("--budget-s", type=float, default=420.0, help="stop starting new timings after this many seconds")
    p.add_argument("--json", metavar="OUT", help="also write the JSON to this file")
    a = p.parse_args(argv)
    dry = a.dry_run or a.device == "cpu"
    if dry:
        a.device = "cpu"
        # triton's CPU interpreter; set before triton is first imported (its own functions are decorated then)
        os.environ.setdefault("TRITON_INTERPRET", "1")
    import torch

    if a.device.startswith("cuda") and not torch.cuda.is_available():
        print(
            f"gpu_check: no CUDA device is visible to torch {torch.__version__} (built for CUDA "
            f"{torch.version.cuda}); run it on a GPU machine, or use --dry-run for the CPU plumbing check",
            file=sys.stderr,
        )
        return 2
    from molora.ops.dispatch import triton_available

    device = torch.device(a.device)
    t_start = time.monotonic()
    deadline = t_start + a.budget_s
    triton_ok = triton_available()
    out: dict[str, Any] = {
        "script": "tools/gpu_check.py",
        "dry_run": dry,
        "device": str(device),
        "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "python": platform.python_version(),
        "triton": __import__("triton").__version__ if triton_ok else None,
        "triton_interpret": os.environ.get("TRITON_INTERPRET") == "1",
        "errors": {},
        "section_s": {},
    }
    if not triton_ok:
        out["errors"]["triton"] = "triton is not installed: the triton rows are missing"
    shapes = {"tiny": TINY_SHAPE} if dry else QWEN3_SHAPES
    Ks = [4, 16]
    Ts = [1, 8, 64] if dry else [1, 8, 64, 256, 1024, 4096, 8192]
    small = next(iter(shapes.values()))  # the engine runs on the small model (the 1.7B shape)
    dtype = torch.float32 if dry else torch.bfloat16
    run_section(out, "exactness", lambda: check_exactness(device, shapes, Ks, triton_ok, dry))
    run_section(
        out,
        "dispatch",
        lambda: check_dispatch(device, shapes, Ks, Ts, triton_ok, 1 if dry else 7, deadline, 1 if dry else None),
    )
    out["decode"] = {}
    for name, shape in shapes.items():  # each model shape while the budget lasts (the 1.7B shape first)
        if time.monotonic() < deadline:
            run_section(
                out["decode"],
                name,
                lambda shape=shape: check_decode(device, shape, 4, 8, 16 if dry else 256, 3 if dry else 10, dtype),
                out,
            )
    if time.monotonic() < deadline:
        run_section(
            out,
            "engine",
            lambda: check_engine(device, small, 4, 8 if dry else 64, 8 if dry else 128, 4 if dry else 128, dtype),
        )
    else:
        out["engine"], out["errors"]["engine"] = None, "skipped: time budget spent before the engine section"
    out["goals"] = goals(out) if not dry else {"not_judged": "dry run: tiny shapes on the CPU, plumbing only"}
    out["elapsed_s"] = round(time.monotonic() - t_start, 1)
    line = json.dumps(out)
    if a.json:
        Path(a.json).parent.mkdir(parents=True, exist_ok=True)
        Path(a.json).write_text(json.dumps(out, indent=1) + "\n")
    print(line, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
