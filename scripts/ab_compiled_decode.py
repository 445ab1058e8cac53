"""Does torch.compile pay for the engine's decode step on the CPU? (issue 19: "try compiling the step")

    python scripts/ab_compiled_decode.py [--bf16] [--steps 20]

Two engines over one SmolLM2-135M with 4 random adapters (r=16, vocab routing, dispatch "stacked_mask": the torch
ops a compiled step can trace), 32 requests of 128-token prompts decoding. One runs its decode steps eagerly (with
molora's C++ glue and paged attention); the other records its batch-32 decode step through `DecodeGraphs` with
torch.compile as the capture (the static step, molora's C++ kernels turned off so that dynamo sees torch ops only,
gathered SDPA attention). Steps alternate between the two; prints the compile time and the median step times.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent


def compile_capture(step):
    """`DecodeGraphs` capture by torch.compile: the compiled step runs at every replay, its outputs copied into
    the first run's."""
    from molora.ops import fused_cpu

    with fused_cpu.suspended():
        compiled = torch.compile(step, dynamic=False)
        t0 = time.perf_counter()
        out = compiled()
        print(f"compile and first run: {time.perf_counter() - t0:.1f} s", file=sys.stderr, flush=True)

    def replay() -> None:
        with fused_cpu.suspended():
            new = compiled()
        for name in ("hidden", "logits", "last_slot_ids", "last_weights", "last_carry", "carry_rows"):
            if getattr(out, name) is not None:
                getattr(out, name).copy_(getattr(new, name))

    return replay, out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--bf16", action="store_true")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--threads", type=int, default=2)
    a = p.parse_args(argv)
    torch.set_num_threads(a.threads)
    sys.path.insert(0, str(ROOT))
    from molora import attach
    from molora.bench.engine import make_adapters, workload
    from molora.config import SamplingParams
    from molora.engine import Engine, EngineConfig
    from molora.model.base import load_base
    from molora.routing import VocabRouter

    dtype = torch.bfloat16 if a.bf16 else torch.float32
    model, _ = load_base()
    vocab = model.config.vocab_size
    paths = make_adapters(model, Path(tempfile.mkdtemp()), 4, 16)
    q = vocab // 4
    router = VocabRouter([(i * q, (i + 1) * q if i < 3 else vocab, f"skill{i}") for i in range(4)])
    mm = attach(model, paths, router=router, dispatch="stacked_mask").to(dtype)
    mm.dispatcher.check_ids = False
    prompts, _ = workload(32, 128, 64, vocab, False)
    cfg = EngineConfig(
        max_num_seqs=32,
        max_tokens_per_step=512,
        block_size=16,
        kv_budget_tokens=32 * 300,
        max_model_len=290,
        stop_at_eos=False,
        enable_prefix_caching=False,  # timed repetitions of the same prompts (molora.bench.engine.bench_config)
    )
    engines = {}
    for name in ("eager", "compiled"):
        eng = Engine(mm, cfg)
        if name == "compiled":
            eng.runner.enable_graphs(capture=compile_capture, buckets=(32,))
        for prompt in prompts:
            eng.add_request(prompt, SamplingParams(max_new_tokens=a.steps + 40), routing="vocab")
        while any(r.num_computed < len(r.prompt_ids) for r in eng.requests.values()):
            eng.step()
        engines[name] = eng
    engines["compiled"].step()  # compiles
    times: dict[str, list[float]] = {n: [] for n in engines}
    for i in range(a.steps):
        for name in ("eager", "compiled") if i % 2 else ("compiled", "eager"):
            t0 = time.perf_counter()
            engines[name].step()
            times[name].append(time.perf_counter() - t0)
    med = {n: statistics.median(v[2:]) * 1e3 for n, v in times.items()}
    graphs = engines["compiled"].stats()["decode_graphs"]
    print(
        f"{str(dtype)[6:]} batch-32 decode step: eager {med['eager']:.1f} ms, compiled {med['compiled']:.1f} ms "
        f"(eager / compiled {med['eager'] / med['compiled']:.2f}x); graphs {graphs}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
