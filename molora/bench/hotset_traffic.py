"""Hot-set traffic benchmark: Zipf traffic over many adapters through the engine, against the same traffic on one.

    molora bench hotset --traffic --adapters 1000 [--quick] [--threads 1] [--json OUT]

Setup: N random PEFT adapters (rank 8, q_proj and v_proj, bf16 files: 1,000 folders write in seconds) for
the base, every one registered with the engine (all read once, then the CPU tier keeps what its byte budget
holds; the rest go back to disk). A LearnedRouter with random gates over all N (one shared gate).
Traffic: R requests; each draws its adapter with Zipf popularity (p(rank k) ~ 1 / k^s, s = 1.1) over the N
and is either pinned to it or learned per token with an allowed set of 2-4 (it plus Zipf draws); P-token
random prompts, G greedy new tokens, C requests kept in flight (closed loop: one is queued when one ends).
Every engine has the same step budget (`--max-num-batched-tokens`, default C + P: every decode plus one whole
prompt per step; decodes go first, longer prefills are chunked), so a step that admits requests costs about a
decode step plus one prompt rather than C prompts beside the decodes.

Variants, each a full run of the same traffic on a fresh engine, the order rotated every repetition:
  one         every adapter name of the traffic replaced by the most popular one (allowed sets of one)
  many_fcfs   the traffic as drawn, scheduler admission FCFS
  many_slots  the traffic as drawn, slot-aware admission (molora.engine.scheduler: bounded bypass)
  many_fcfs_nice10  (--loader-nice-ab) many_fcfs with the loader thread at nice +10
              (MOLORA_LOADER_NICE=10; the others run at the default, 0: molora.engine.loader)
  many_fcfs_nofreeze  (--gc-freeze-ab) many_fcfs without `gc.freeze()` once the engine is built; every other
              variant freezes the heap as `molora serve` does (molora.engine.heap)

Reported per variant: output tokens/s (and the ratio to `one`), also per second of this process's CPU time (all
its threads: on a machine shared with other work, wall time counts theirs too, CPU time far less); time to first
token of requests whose adapters were all resident when queued (warm) and of the others (cold), medians and p90;
inter-token gaps of warm requests over steps in which an adapter was loaded into a slot or read from disk vs. steps
with no adapter work, medians and p99, the load steps split again into those that also prefilled (against "admits")
and those that only decoded (against "quiet"), and the median step; the CPU tier's bytes, its reservations and the
process's resident memory over the run (the tier bound asserted at every step from the hot set's counters,
`HotSet.check` and the process's RSS every 10th). Ends with one JSON line.
Owns the traffic and the measurement; knows the engine through its public API and `engine.hotset`'s counters.
"""

from __future__ import annotations

import contextlib
import gc
import os
import random
import resource
import statistics
import tempfile
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from molora.engine.heap import freeze_heap, unfreeze_heap
from molora.engine.loader import loader_nice

VARIANTS = ("one", "many_fcfs", "many_slots")
NICE10 = "many_fcfs_nice10"  # --loader-nice-ab: many_fcfs with the loader thread at nice +10
NOFREEZE = "many_fcfs_nofreeze"  # --gc-freeze-ab: many_fcfs without gc.freeze() once the engine is built
TARGETS = ("q_proj", "v_proj")


def make_adapters(model: Any, folder: Path, k: int, rank: int, seed: int = 0) -> dict[str, Path]:
    """k random PEFT folders (rank `rank`, q_proj and v_proj, bf16), names a0..a{k-1}; each its own weights."""
    from molora.adapters import save_adapter

    g = torch.Generator().manual_seed(seed)
    targets = {
        n: m for n, m in model.named_modules() if isinstance(m, torch.nn.Linear) and n.rsplit(".", 1)[-1] in TARGETS
    }
    out = {}
    for i in range(k):
        modules = {
            n: (
                (torch.randn(rank, m.in_features, generator=g) / m.in_features**0.5).bfloat16(),
                (torch.randn(m.out_features, rank, generator=g) * 0.02).bfloat16(),
            )
            for n, m in targets.items()
        }
        out[f"a{i}"] = save_adapter(folder / f"a{i}", modules, r=rank, lora_alpha=2 * rank)
    return out


def make_traffic(
    names: list[str], n: int, s: float, learned_share: float, vocab: int, prompt_len: int, seed: int
) -> list[dict]:
    """n requests: {"adapter": name} pinned or {"allowed": [2-4 names]} learned, and a prompt of token ids."""
    from molora.bench.serve import zipf_models

    rng = random.Random(seed)
    ranked = list(names)
    rng.shuffle(ranked)
    weights = [1.0 / (k + 1) ** s for k in range(len(ranked))]
    out = []
    for first in zipf_models(ranked, n, s, seed):
        prompt = [rng.randrange(3, vocab) for _ in range(prompt_len)]
        if rng.random() < learned_share:
            size = rng.randint(2, 4)
            allowed = [first]
            while len(allowed) < min(size, len(names)):
                extra = rng.choices(ranked, weights=weights)[0]
                if extra not in allowed:
                    allowed.append(extra)
            out.append({"allowed": allowed, "prompt": prompt})
        else:
            out.append({"adapter": first, "prompt": prompt})
    return out


def on_one(traffic: list[dict], name: str) -> list[dict]:
    """The same traffic with every adapter replaced by `name` (allowed sets collapse to [name])."""
    return [
        {"adapter": name, "prompt": t["prompt"]} if "adapter" in t else {"allowed": [name], "prompt": t["prompt"]}
        for t in traffic
    ]


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize()


def build_engine(
    base: Any,
    paths: dict[str, Path],
    slots: int,
    cpu_mib: int,
    max_num_seqs: int,
    admission: str,
    seed: int,
    max_num_batched_tokens: int | None = None,
) -> Any:
    """A fresh engine over a copy of `base` with every adapter registered (read once, then cold or warm); its step
    budget `max_num_batched_tokens` (None: max(256, 4 x max_num_seqs), the budget before chunked prefill)."""
    import copy

    from molora import attach
    from molora.engine import Engine, EngineConfig
    from molora.routing.learned import LearnedRouter, LearnedRouterConfig, decoder_layers

    names = list(paths)
    mm = attach(
        copy.deepcopy(base), {n: paths[n] for n in names[:1]}, slots=slots, target_modules=TARGETS, check_base=False
    )
    cfg = LearnedRouterConfig(tuple(names), mm.config.hidden_size, len(decoder_layers(mm.model)), placement="shared")
    router = LearnedRouter(cfg)
    with torch.no_grad():
        router.weight.normal_(generator=torch.Generator().manual_seed(seed))
    mm.router = router.to(next(mm.model.parameters()).device)
    engine = Engine(
        mm,
        EngineConfig(
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens or max(256, 4 * max_num_seqs),
            kv_budget_tokens=max_num_seqs * 256,
            max_model_len=256,
            stop_at_eos=False,
            cpu_tier_bytes=cpu_mib << 20,
            admission=admission,
        ),
    )
    for n in names[1:]:
        engine.load_adapter(n, paths[n])
    return engine


class GcClock:
    """Python's garbage collections while it is installed (`gc.callbacks`): per generation, how many and how long;
    `take()` the seconds spent in full (generation 2) collections since the last take."""

    def __init__(self) -> None:
        self.count = [0, 0, 0]
        self.gen2_s: list[float] = []
        self._t0 = 0.0
        self._since = 0.0

    def __call__(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._t0 = time.perf_counter()
            return
        gen = int(info["generation"])
        self.count[gen] += 1
        if gen == 2:
            took = time.perf_counter() - self._t0
            self.gen2_s.append(took)
            self._since += took

    def take(self) -> float:
        took, self._since = self._since, 0.0
        return took

    def __enter__(self) -> GcClock:
        gc.callbacks.append(self)
        return self

    def __exit__(self, *exc: object) -> None:
        gc.callbacks.remove(self)


def run_traffic(engine: Any, traffic: list[dict], concurrency: int, new_tokens: int) -> dict:
    """Drive the closed loop; per-request TTFT (warm/cold), warm inter-token gaps by step kind, memory samples,
    stalls by step kind and the full garbage collections that fell inside steps."""
    with GcClock() as clock:
        out = _run_traffic(engine, traffic, concurrency, new_tokens, clock)
    log = out.pop("_step_log")  # (seconds, kind, a full collection ran in it) per step
    limit = 3 * statistics.median(t for t, _, _ in log)
    kinds = ("quiet", "admits", "load_decodes", "load_admits")
    # a stall: a step over 3x the median step. Their rate per kind of step tells a load's stalls (load_admits
    # against admits, load_decodes against quiet: the same work without a load) from the machine's own pauses,
    # which strike every kind alike
    out["stalls"] = {
        "threshold_ms": round(1e3 * limit, 1),
        "by_kind": {k: {"steps": sum(1 for _, x, _ in log if x == k)} for k in kinds},
        "with_gen2": sum(1 for t, _, g in log if g and t > limit),
    }
    for k in kinds:
        out["stalls"]["by_kind"][k]["stalls"] = sum(1 for t, x, _ in log if x == k and t > limit)
    out["gc"] = {
        "collections_by_generation": clock.count,
        "gen2_ms": _dist(clock.gen2_s),
        "steps_with_gen2": sum(1 for _, _, g in log if g),
    }
    return out


def _run_traffic(engine: Any, traffic: list[dict], concurrency: int, new_tokens: int, clock: GcClock) -> dict:
    from molora.config import SamplingParams

    hs = engine.hotset
    params = SamplingParams(max_new_tokens=new_tokens)
    queue = list(enumerate(traffic))
    info: dict[str, dict] = {}
    # a warm request's gaps by the kind of step that ended them: "loads" (an adapter was copied into a slot or read),
    # "admits" (no load, but the step prefilled requests: it computed more tokens than it emitted), "quiet" (decode);
    # "loads" split again by whether the step also prefilled ("load_admits") or only decoded ("load_decodes"), so a
    # load's own cost reads against the step of the same work without one (admits / quiet)
    warm_gaps: dict[str, list[float]] = {k: [] for k in ("loads", "admits", "quiet", "load_admits", "load_decodes")}
    steps: list[float] = []
    step_log: list[tuple[float, str, bool]] = []
    mem: list[dict] = []
    peak = {"cpu_tier_bytes": 0, "reserved_bytes": 0, "tier_plus_reserved": 0, "rss_bytes": 0}
    tokens = 0
    t0, c0 = time.perf_counter(), time.process_time()
    while queue or engine.has_unfinished():
        while queue and len(engine.requests) < concurrency:
            i, t = queue.pop(0)
            needs = [t["adapter"]] if "adapter" in t else t["allowed"]
            rid = engine.add_request(
                t["prompt"],
                params,
                adapter=t.get("adapter"),
                allowed_adapters=t.get("allowed"),
                routing="auto" if "adapter" in t else "learned",
                request_id=f"r{i}",
            )
            info[rid] = {"t_add": time.perf_counter(), "warm": all(hs.resident(n) for n in needs), "last": None}
        before = (hs.misses, hs.disk_reads, hs.reads_in_flight())
        computed = engine.tokens_computed
        s0 = time.perf_counter()
        clock.take()
        outs = engine.step()
        now = time.perf_counter()
        steps.append(now - s0)
        gen2 = clock.take() > 0
        loads = hs.misses != before[0] or hs.disk_reads != before[1] or before[2] > 0 or hs.reads_in_flight() > 0
        emitted = sum(len(o.new_token_ids) for o in outs)
        prefilled = engine.tokens_computed - computed > emitted
        kind = "loads" if loads else "admits" if prefilled else "quiet"
        sub = ("load_admits" if prefilled else "load_decodes") if loads else None
        step_log.append((now - s0, sub or kind, gen2))
        for o in outs:
            if o.finish_reason not in (None, "length"):
                raise RuntimeError(f"request {o.request_id} ended {o.finish_reason}: {o.error}")
            r = info[o.request_id]
            for _ in o.new_token_ids:
                tokens += 1
                if r["last"] is None:
                    r["ttft"] = now - r["t_add"]
                elif r["warm"]:
                    warm_gaps[kind].append(now - r["last"])
                    if sub is not None:
                        warm_gaps[sub].append(now - r["last"])
                r["last"] = now
        reserved = sum(hs.reserved.values())  # the bound every step from the counters; HotSet.check every 10th
        over = hs.reserved.get(hs.overdraft, 0) if hs.overdraft is not None else 0
        if hs.cpu_used + reserved > hs.cpu_budget + over:
            raise AssertionError(f"CPU tier {hs.cpu_used} + reserved {reserved} B over its budget {hs.cpu_budget} B")
        sample = {
            "cpu_tier_bytes": hs.cpu_used,
            "reserved_bytes": reserved,
            "tier_plus_reserved": hs.cpu_used + reserved,
        }
        if len(steps) % 10 == 1:
            hs.check()
            sample["rss_bytes"] = _rss_bytes()
            mem.append({"t_s": round(now - t0, 3), **sample})
        for k, v in sample.items():
            peak[k] = max(peak[k], v)
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    ttft = {k: [r["ttft"] for r in info.values() if r["warm"] == (k == "warm")] for k in ("warm", "cold")}
    st = hs.stats()
    return {
        "wall_s": round(wall, 3),
        "output_tokens": tokens,
        "tokens_per_s": round(tokens / wall, 3),
        "cpu_s": round(cpu, 3),
        "tokens_per_cpu_s": round(tokens / cpu, 3),
        "steps": len(steps),
        "step_ms_median": round(1e3 * statistics.median(steps), 3),
        "_step_log": step_log,
        "ttft_ms": {k: _dist(v) for k, v in ttft.items()},
        "warm_itl_ms": {k: _dist(v) for k, v in warm_gaps.items()},
        "memory": {"cpu_tier_budget": st["cpu_tier_budget"], "peak": peak, "samples": mem[:: max(1, len(mem) // 60)]},
        "hotset": {
            k: st[k] for k in ("hits", "misses", "evictions", "disk_reads", "prefetches", "prefetch_deferred", "slots")
        },
    }


@contextlib.contextmanager
def _loader_nice(value: str | None) -> Iterator[None]:
    """MOLORA_LOADER_NICE set to `value` inside the block (None: as it was)."""
    old = os.environ.get("MOLORA_LOADER_NICE")
    if value is not None:
        os.environ["MOLORA_LOADER_NICE"] = value
    try:
        yield
    finally:
        if old is None:
            os.environ.pop("MOLORA_LOADER_NICE", None)
        else:
            os.environ["MOLORA_LOADER_NICE"] = old


def _dist(xs: list[float]) -> dict:
    if not xs:
        return {"n": 0}
    xs = sorted(xs)
    q = lambda p: xs[min(len(xs) - 1, int(p * len(xs)))]
    return {
        "n": len(xs),
        "median": round(1e3 * statistics.median(xs), 3),
        "p90": round(1e3 * q(0.9), 3),
        "p99": round(1e3 * q(0.99), 3),
    }


def run(
    model: str,
    adapters: int,
    rank: int,
    requests: int,
    s: float,
    learned_share: float,
    prompt_len: int,
    new_tokens: int,
    concurrency: int,
    slots: int,
    cpu_mib: int,
    repeats: int,
    seed: int,
    log: Any,
    max_num_batched_tokens: int | None = None,
    loader_nice_ab: bool = False,
    gc_freeze_ab: bool = False,
) -> dict:
    from molora.bench.common import machine_info
    from molora.bench.model_workloads import load_model

    base = load_model(model)
    vocab = int(base.config.vocab_size)
    budget = max_num_batched_tokens or concurrency + prompt_len
    with tempfile.TemporaryDirectory() as tmp:
        t = time.perf_counter()
        paths = make_adapters(base, Path(tmp), adapters, rank, seed)
        make_s = time.perf_counter() - t
        log(f"# {adapters} adapters (r={rank}, {', '.join(TARGETS)}, bf16) written in {make_s:.1f} s")
        traffic = make_traffic(list(paths), requests, s, learned_share, vocab, prompt_len, seed)
        top = Counter(tr["adapter"] if "adapter" in tr else tr["allowed"][0] for tr in traffic).most_common(1)[0][0]
        variants = VARIANTS + ((NICE10,) if loader_nice_ab else ()) + ((NOFREEZE,) if gc_freeze_ab else ())
        runs: dict[str, list[dict]] = {v: [] for v in variants}
        for rep in range(repeats):
            k = rep % len(variants)
            for v in variants[k:] + variants[:k]:
                admission = "slots" if v == "many_slots" else "fcfs"
                with _loader_nice("10" if v == NICE10 else None):  # the pool reads it when the first read starts
                    engine = build_engine(base, paths, slots, cpu_mib, concurrency, admission, seed, budget)
                    frozen = freeze_heap() if v != NOFREEZE else 0  # as `molora serve` does once it is built
                    out = run_traffic(engine, on_one(traffic, top) if v == "one" else traffic, concurrency, new_tokens)
                    out["gc"]["frozen_objects"] = frozen
                    engine.close()
                    del engine
                    unfreeze_heap()
                runs[v].append(out)
                log(
                    f"  rep {rep} {v:<10} {out['tokens_per_s']:8.2f} tok/s  ttft warm {out['ttft_ms']['warm']} "
                    f"cold {out['ttft_ms']['cold']}  misses {out['hotset']['misses']}"
                )
    best = {v: statistics.median(r["tokens_per_s"] for r in runs[v]) for v in variants}
    per_cpu = {v: statistics.median(r["tokens_per_cpu_s"] for r in runs[v]) for v in variants}
    return {
        "bench": "hotset_traffic",
        "machine": machine_info(),
        "model": model,
        "adapters": adapters,
        "rank": rank,
        "targets": list(TARGETS),
        "adapter_dtype": "bfloat16",
        "make_adapters_s": round(make_s, 2),
        "requests": requests,
        "zipf_s": s,
        "learned_share": learned_share,
        "prompt_len": prompt_len,
        "new_tokens": new_tokens,
        "concurrency": concurrency,
        "slots": slots,
        "cpu_tier_mib": cpu_mib,
        "max_num_batched_tokens": budget,
        "enable_chunked_prefill": True,
        "repeats": repeats,
        "seed": seed,
        "one_adapter": top,
        "loader_nice": {v: 10 if v == NICE10 else loader_nice() for v in variants},
        "tokens_per_s": {v: round(x, 3) for v, x in best.items()},
        "vs_one": {v: round(best[v] / best["one"], 4) for v in variants},
        "tokens_per_cpu_s": {v: round(x, 3) for v, x in per_cpu.items()},
        "vs_one_cpu": {v: round(per_cpu[v] / per_cpu["one"], 4) for v in variants},
        "runs": runs,
    }


def format_table(out: dict) -> str:
    lines = [
        f"Zipf s={out['zipf_s']} over {out['adapters']} adapters (r={out['rank']}), {out['requests']} requests, "
        f"{out['concurrency']} in flight, {out['slots']} slots, CPU tier {out['cpu_tier_mib']} MiB, "
        f"step budget {out['max_num_batched_tokens']} tokens:",
        f"{'variant':<11} {'tok/s':>8} {'x one':>6} {'TTFT warm':>10} {'TTFT cold':>10} {'ITL quiet':>10} "
        f"{'ITL admits':>10} {'ITL loads':>10} {'peak tier+res MiB':>18}",
    ]
    for v, runs in out["runs"].items():
        r = runs[-1]
        med = lambda d: d.get("median", float("nan"))
        lines.append(
            f"{v:<11} {out['tokens_per_s'][v]:>8.2f} {out['vs_one'][v]:>6.3f} {med(r['ttft_ms']['warm']):>10.1f} "
            f"{med(r['ttft_ms']['cold']):>10.1f} {med(r['warm_itl_ms']['quiet']):>10.1f} "
            f"{med(r['warm_itl_ms'].get('admits', {})):>10.1f} {med(r['warm_itl_ms']['loads']):>10.1f} "
            f"{r['memory']['peak']['tier_plus_reserved'] / 2**20:>18.1f}"
        )
    return "\n".join(lines)
