"""The engine bench's workloads on two source trees of molora, paired in one run: before vs after a change.

    python -m experiments.ab_engine_trees --base /tmp/base --repeats 7 [--quantization int8]
        [--json docs/x.json]

Two worker processes, one per tree (`--base` and `--head`, default this checkout), each with PYTHONPATH on its tree,
its own build of the C++ kernels (the build key differs per tree) and the same model, adapters and prompts (molora.
bench.engine's setup: SmolLM2-135M, 4 random-weight adapters r=16, a VocabRouter over 4 ranges; fixed seeds). The
parent asks them in turn to run one sample of a workload, so only one runs at a time and both see the same load; the
order of the trees rotates each repetition (style 18). --quantization int8 (int4, w8a8) quantizes the base linears as
`attach` does, the bfloat16 engine cast after. Workloads, in float32 and (--bf16) bfloat16:

  generate_routed / generate_base   Engine.generate over --requests prompts of --prompt-len tokens, --new-tokens
                                    greedy tokens each (eos ignored), routing "vocab" / "none"
  decode_step                       the median of --steps Engine.step() calls with every request decoding (routed)

Reports per workload the median of head / base over the repetitions (paired) with its quartiles, each tree's median
milliseconds, and whether both trees generated the same tokens (a hash of every request's tokens). Ends with one JSON
line. The trees must both offer molora.bench.engine.make_adapters / workload and Engine.generate.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]


# ---------------------------------------------------------------------------------------------- the worker


def worker(args: argparse.Namespace) -> None:
    """One tree's side: set up once, then answer each request line ("generate_routed fp32", ...) with a JSON line."""
    import copy

    import torch

    from molora import attach
    from molora.bench.engine import make_adapters, workload
    from molora.config import SamplingParams
    from molora.engine import Engine, EngineConfig
    from molora.model.base import load_base
    from molora.ops import fused_cpu
    from molora.routing import VocabRouter

    if args.threads:
        torch.set_num_threads(args.threads)
    model, _tok = load_base()
    vocab = model.config.vocab_size
    tmp = tempfile.TemporaryDirectory()
    paths = make_adapters(model, Path(tmp.name), 4, 16)
    q = vocab // 4
    router = VocabRouter([(i * q, (i + 1) * q if i < 3 else vocab, f"skill{i}") for i in range(4)])
    prompts, news = workload(args.requests, args.prompt_len, args.new_tokens, vocab, False)
    longest = args.prompt_len + args.new_tokens + 2 * args.steps + 16
    cfg = EngineConfig(  # the engine bench's settings (bench_config), spelled out: an older tree's may differ
        max_num_seqs=args.requests,
        max_tokens_per_step=512,
        block_size=16,
        kv_budget_tokens=args.requests * (longest + 16),
        max_model_len=longest,
        stop_at_eos=False,
        enable_prefix_caching=False,  # timed repetitions of the same prompts
    )
    bf16 = copy.deepcopy(model) if args.bf16 else None  # a copy before attach changes the model
    quant = args.quantization  # the base linears quantized (as bench_quant: attach, then the dtype)
    engines = {"fp32": Engine(attach(model, paths, router=router, quantization=quant), cfg)}
    if bf16 is not None:
        if quant is None:
            bf16 = bf16.to(torch.bfloat16)
        mm16 = attach(bf16, paths, router=router, quantization=quant)
        mm16.to(torch.bfloat16)
        engines["bf16"] = Engine(mm16, cfg)
    params = [SamplingParams(max_new_tokens=n) for n in news]
    print(json.dumps({"ready": True, "kernels": fused_cpu.available()}), flush=True)
    for line in sys.stdin:
        what, dtype = line.split()
        eng = engines[dtype]
        if what.startswith("generate"):
            t0 = time.perf_counter()
            outs = eng.generate(prompts, params, routing="vocab" if what == "generate_routed" else "none")
            ms = (time.perf_counter() - t0) * 1e3
            sha = hashlib.sha256(json.dumps([o.new_token_ids for o in outs]).encode()).hexdigest()[:16]
            print(json.dumps({"ms": ms, "tokens": sha}), flush=True)
        elif what == "kernels":  # which of molora's kernels a routed generate calls (tools/kernel_keep.py)
            with fused_cpu.kernel_clock() as clock:
                eng.generate(prompts, params, routing="vocab")
            print(json.dumps({"ms": 0.0, "tokens": None, "kernels": sorted(clock)}), flush=True)
        else:  # decode_step
            for p in prompts:
                eng.add_request(p, SamplingParams(max_new_tokens=2 * args.steps + 8), routing="vocab")
            while any(r.remaining > 1 or r.num_computed == 0 for r in eng.requests.values()):
                eng.step()  # every prefill done first
            times = []
            for _ in range(args.steps):
                t0 = time.perf_counter()
                eng.step()
                times.append((time.perf_counter() - t0) * 1e3)
            for rid in list(eng.requests):
                eng.abort(rid)
            eng.step()
            print(json.dumps({"ms": statistics.median(times), "tokens": None}), flush=True)


# ---------------------------------------------------------------------------------------------- the parent


def start(tree: Path, argv: list[str], env_extra: dict[str, str] | None = None) -> subprocess.Popen:
    """A worker on `tree` (PYTHONPATH), with `env_extra` added to its environment (tools/kernel_keep.py: the
    kernel families it turns off)."""
    env = {**os.environ, "PYTHONPATH": str(tree), **(env_extra or {})}
    proc = subprocess.Popen(
        [sys.executable, str(Path(__file__).resolve()), "--worker", *argv],
        cwd=tree,
        env=env,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    return proc


def ask(proc: subprocess.Popen, request: str) -> dict[str, Any]:
    assert proc.stdin is not None and proc.stdout is not None
    if request:
        proc.stdin.write(request + "\n")
        proc.stdin.flush()
    while True:
        line = proc.stdout.readline()
        if not line:
            raise SystemExit(f"a worker ended early (exit {proc.wait()})")
        if line.startswith("{"):
            return json.loads(line)


def interleave(
    procs: dict[str, subprocess.Popen], requests: dict[str, str], repeats: int
) -> tuple[dict[str, dict[str, list[float]]], dict[str, dict[str, set]], tuple[float, float, float]]:
    """One untimed warm-up of each request on every worker, then `repeats` repetitions asking the workers in turn
    (order rotated each repetition, so only one runs at a time and all see the same load). requests: key -> the
    request line. Returns ({key: {worker: [ms]}}, {key: {worker: token hashes}}, the load average before the timed
    repetitions). tools/kernel_keep.py asks its arms through it too."""
    from molora.bench.common import rotated

    names = list(procs)
    samples: dict[str, dict[str, list[float]]] = {k: {n: [] for n in names} for k in requests}
    tokens: dict[str, dict[str, set]] = {k: {n: set() for n in names} for k in requests}
    for name in names:  # first-call costs, the kernels' first runs
        for request in requests.values():
            ask(procs[name], request)
    load_before = os.getloadavg()
    for i in range(repeats):
        for key, request in requests.items():
            for name in rotated(names, i):
                got = ask(procs[name], request)
                samples[key][name].append(got["ms"])
                if got["tokens"]:
                    tokens[key][name].add(got["tokens"])
        print(f"  rep {i + 1}/{repeats}", file=sys.stderr, flush=True)
    return samples, tokens, load_before


def quartiles(r: list[float]) -> list[float]:
    r = sorted(r)
    q = statistics.quantiles(r, n=4, method="inclusive") if len(r) > 1 else [r[0]] * 3
    return [statistics.median(r), q[0], q[2]]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--base", type=Path, help="the tree before the change")
    ap.add_argument("--head", type=Path, default=ROOT, help="the tree after it (default: this checkout)")
    ap.add_argument("--repeats", type=int, default=5, help="interleaved repetitions (default 5)")
    ap.add_argument("--requests", type=int, default=8, help="concurrent requests (default 8)")
    ap.add_argument("--prompt-len", type=int, default=32, help="prompt tokens per request (default 32)")
    ap.add_argument("--new-tokens", type=int, default=32, help="greedy new tokens per request (default 32)")
    ap.add_argument("--steps", type=int, default=10, help="decode steps timed per decode_step sample (default 10)")
    ap.add_argument("--bf16", action="store_true", help="also run every workload with bfloat16 weights")
    ap.add_argument("--threads", type=int, default=1, help="torch CPU threads in each worker (default 1)")
    ap.add_argument(
        "--quantization", choices=("int8", "int4", "w8a8"), help="quantize the base linears (attach's quantization)"
    )
    ap.add_argument("--json", metavar="OUT", help="also write the result JSON to this file")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        worker(args)
        return 0
    if args.base is None:
        ap.error("--base DIR is required")
    from molora.bench.common import machine_info

    argv = [
        f"--{k.replace('_', '-')}={v}"
        for k, v in vars(args).items()
        if k in ("requests", "prompt_len", "new_tokens", "steps", "threads")
    ]
    argv += (["--bf16"] if args.bf16 else []) + ([f"--quantization={args.quantization}"] if args.quantization else [])
    trees = {"base": args.base.resolve(), "head": args.head.resolve()}
    procs = {name: start(tree, argv) for name, tree in trees.items()}
    kernels = {name: ask(p, "")["kernels"] for name, p in procs.items()}
    dtypes = ["fp32", "bf16"] if args.bf16 else ["fp32"]
    loads = [(w, d) for d in dtypes for w in ("generate_routed", "generate_base", "decode_step")]
    samples, tokens, load_before = interleave(procs, {f"{w} {d}": f"{w} {d}" for w, d in loads}, args.repeats)
    for p in procs.values():
        p.stdin.close()  # type: ignore[union-attr]
        p.wait()
    result: dict[str, Any] = {
        "bench": "ab_engine_trees",
        "command": "python -m experiments.ab_engine_trees " + " ".join(sys.argv[1:]),
        "trees": {k: str(v) for k, v in trees.items()},
        "kernels_built": kernels,
        "repeats": args.repeats,
        "requests": args.requests,
        "prompt_len": args.prompt_len,
        "new_tokens": args.new_tokens,
        "machine": {**machine_info(), "threads": args.threads, "loadavg_before": [round(x, 2) for x in load_before]},
        "workloads": {},
    }
    for key, s in samples.items():
        ratio = quartiles([h / b for h, b in zip(s["head"], s["base"])])
        result["workloads"][key] = {
            "head_over_base_paired": [round(x, 4) for x in ratio],
            "base_ms": round(statistics.median(s["base"]), 2),
            "head_ms": round(statistics.median(s["head"]), 2),
            "same_tokens": None
            if not tokens[key]["base"]
            else len(tokens[key]["base"]) == 1 and tokens[key]["base"] == tokens[key]["head"],
        }
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
