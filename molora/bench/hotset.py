"""Hot-set benchmark: adapter load latency per tier, and the hit rate under Zipf popularity.

    python -m molora.bench.hotset [--model smollm2|tiny] [--quick] [--threads 1] [--json OUT] [--plot OUT.png]
    python -m molora.bench.hotset --traffic --adapters 1000 [...]   Zipf traffic through the engine over many
        adapters against the same traffic on one (molora.bench.hotset_traffic)

Setup: N random PEFT adapters (rank 16, all seven projections) for the model, written to a temp folder.
Latency per tier, variants interleaved in each repetition (medians, ms):

  memcpy      copying the adapter's bytes into preallocated tensors: the floor of any load
  slot_copy   `AdapterBank.load` of an in-memory `LoRAAdapter` into a free slot (unload untimed)
  slot_hit    `HotSet.acquire` of an adapter already in a slot (bookkeeping only)
  cpu_tier    `HotSet.acquire` of an adapter held in the CPU tier while every slot is taken: evict the
              least recently used slot (zeroing it) and copy the adapter in
  disk        the same with no CPU tier (cpu_bytes=0): `read_adapter` (safetensors + validation) on the
              hot set's loader thread, waited for, then evict and copy. After the first read the file sits
              in the OS page cache, so this is a warm disk.
  read        `read_adapter` alone (the disk tier's share)

The tier hits are made certain by cycling over more adapters than slots (LRU then misses every time).

Hit rate: R requests whose adapter is drawn with Zipf popularity (p(rank k) ~ 1 / k^s) over N adapters,
each an acquire + release through the real `HotSet` (LRU over S slots, every adapter kept in the CPU tier),
for each S of a sweep; beside it the hit rate of pinning the S most popular adapters forever (the best
static choice when requests are independent draws).

Ends with one JSON line. Owns timing and reporting; knows the hot set through its public methods.
"""

from __future__ import annotations

import argparse
import copy
import itertools
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from molora.bench.common import add_common_args, emit, machine_info, set_threads, stderr_log, time_interleaved


def _hotset(base: nn.Module, paths: dict[str, Path], slots: int, cpu_bytes: int) -> Any:
    """A fresh attached copy of `base` with the first `slots` adapters in slots, every other one registered
    (kept in the CPU tier when cpu_bytes allows; an evicted adapter joins the CPU tier the same way)."""
    from molora import attach
    from molora.engine.hotset import HotSet

    names = list(paths)
    mm = attach(copy.deepcopy(base), {n: paths[n] for n in names[:slots]}, slots=slots)
    hs = HotSet(mm, cpu_bytes=cpu_bytes)
    for n in names[slots:]:
        hs.register(n, paths[n])
    return hs


def _cycler(hs: Any, names: list[str], expect: str) -> tuple[Callable[[], None], Callable[[], None]]:
    """(acquire the next adapter of a round robin over `names`, release it). Asserts the tier it came from.
    The round robin starts after the resident adapters, so with more adapters than slots LRU misses every time."""
    resident = [n for n in names if hs.resident(n)]
    order = itertools.cycle([n for n in names if n not in resident] + resident)
    held: list[str] = []

    def acquire() -> None:
        name = next(order)
        tier = hs.tier(name)
        assert tier == expect, f"{name} was in tier {tier!r}, expected {expect!r}"
        while not hs.acquire([name]):  # a disk miss: the read runs on the hot set's loader thread
            assert hs.wait_reads(), f"{name} could not be acquired"
        held.append(name)

    def release() -> None:
        hs.release([held.pop()])

    return acquire, release


def tier_latency(base: nn.Module, paths: dict[str, Path], repeats: int) -> dict[str, Any]:
    from molora.adapters.bank import AdapterBank
    from molora.adapters.io import read_adapter
    from molora.config import BankConfig
    from molora.model.lora_linear import linear_shapes

    names = list(paths)
    shapes = linear_shapes(base)
    adapter = read_adapter(paths[names[0]], shapes, name=names[0], base_name=None)
    bank = AdapterBank({m: shapes[m] for m in adapter.modules}, BankConfig(2, adapter.max_rank))
    srcs = [t for m in adapter.modules.values() for t in (m.A, m.B)]
    dsts = [torch.empty_like(t) for t in srcs]
    hs_cpu = _hotset(base, paths, 2, cpu_bytes=1 << 40)  # 2 slots, N >= 3 adapters: cycling misses
    hs_disk = _hotset(base, paths, 2, cpu_bytes=0)
    hs_hit = hs_cpu  # slot hits: the adapter just acquired stays resident
    cpu_acq, cpu_rel = _cycler(hs_cpu, names, "cpu")
    disk_acq, disk_rel = _cycler(hs_disk, names, "disk")
    fns: dict[str, Callable[[], Any]] = {
        "memcpy": lambda: [d.copy_(s) for d, s in zip(dsts, srcs)],
        "slot_copy": lambda: bank.load(adapter),
        "slot_hit": lambda: hs_hit.acquire([hs_hit.mm.bank.names[0]]),
        "cpu_tier": cpu_acq,
        "disk": disk_acq,
        "read": lambda: read_adapter(paths[names[1]], shapes, name=names[1], base_name=None),
    }
    resets = {
        "slot_copy": lambda: bank.unload(adapter.name),
        "cpu_tier": cpu_rel,
        "disk": disk_rel,
        "slot_hit": lambda: hs_hit.release([hs_hit.mm.bank.names[0]]),
    }
    # slot_hit shares hs_cpu: it refreshes the LRU position of one of the two resident adapters, so the
    # round robin's next adapter is still never resident as long as there are at least 4 adapters.
    t = time_interleaved(fns, repeats, warmup=2, reset=resets, log=stderr_log)
    out = t.summary("memcpy")
    out["adapter_mib"] = round(adapter.nbytes() / 2**20, 3)
    out["gib_s"] = {
        k: round(adapter.nbytes() / 2**30 / (v / 1e3), 2) for k, v in out["ms"].items() if k not in ("slot_hit",)
    }
    return out


def zipf_weights(n: int, s: float) -> list[float]:
    w = [1.0 / (k + 1) ** s for k in range(n)]
    total = sum(w)
    return [x / total for x in w]


def hit_rate(base: nn.Module, paths: dict[str, Path], slots: int, requests: int, s: float, seed: int) -> dict:
    """Acquire + release each of `requests` Zipf-drawn adapters through a HotSet of `slots` slots."""
    from molora.bench.serve import zipf_models

    hs = _hotset(base, paths, slots, cpu_bytes=1 << 40)
    before = hs.stats()
    for name in zipf_models(list(paths), requests, s, seed):
        assert hs.acquire([name])
        hs.release([name])
    st = hs.stats()
    hits, misses = st["hits"] - before["hits"], st["misses"] - before["misses"]
    load_ms = st["load_ms_total"] - before["load_ms_total"]
    return {
        "slots": slots,
        "adapters": len(paths),
        "requests": requests,
        "hits": hits,
        "misses": misses,
        "hit_rate": round(hits / requests, 4),
        "evictions": st["evictions"] - before["evictions"],
        "load_ms_per_request": round(load_ms / requests, 4),
        "static_top_s_hit_rate": round(sum(zipf_weights(len(paths), s)[:slots]), 4),
    }


def run(
    model: str, adapters: int, rank: int, repeats: int, slots_sweep: list[int], requests: int, s: float, seed: int
) -> dict:
    from molora.bench.model_workloads import load_model, make_adapters

    base = load_model(model)
    with tempfile.TemporaryDirectory() as tmp:
        paths = make_adapters(base, Path(tmp), adapters, rank)
        stderr_log(f"# tier latency ({model}, {adapters} adapters, r={rank})")
        tiers = tier_latency(base, paths, repeats)
        rows = []
        for S in slots_sweep:
            rows.append(hit_rate(base, paths, S, requests, s, seed))
            stderr_log(
                f"  zipf s={s}: {S} slots / {adapters} adapters: LRU hit rate {rows[-1]['hit_rate']:.3f} "
                f"(static top-S {rows[-1]['static_top_s_hit_rate']:.3f})"
            )
    return {
        "bench": "hotset",
        "machine": machine_info(),
        "model": model,
        "adapters": adapters,
        "rank": rank,
        "repeats": repeats,
        "tiers": tiers,
        "zipf": {"s": s, "requests": requests, "seed": seed, "rows": rows},
    }


def format_table(out: dict) -> str:
    t = out["tiers"]
    lines = [
        f"load latency per tier, one adapter of {t['adapter_mib']} MiB ({out['model']}, r={out['rank']}):",
        f"{'variant':<10} {'median ms':>10} {'min ms':>9} {'GiB/s':>7} {'x memcpy':>9}",
    ]
    for k, v in t["ms"].items():
        lines.append(
            f"{k:<10} {v:>10.3f} {t['ms_min'][k]:>9.3f} {t['gib_s'].get(k, float('nan')):>7.2f} "
            f"{t['vs_memcpy'][k]:>9.2f}"
        )
    z = out["zipf"]
    lines.append(f"Zipf s={z['s']}, {z['requests']} requests over {out['adapters']} adapters, LRU:")
    lines.append(f"{'slots':>5} {'hit rate':>9} {'static top-S':>13} {'load ms/request':>16}")
    for r in z["rows"]:
        lines.append(
            f"{r['slots']:>5} {r['hit_rate']:>9.3f} {r['static_top_s_hit_rate']:>13.3f} "
            f"{r['load_ms_per_request']:>16.3f}"
        )
    return "\n".join(lines)


def plot(out: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a1, a2) = plt.subplots(1, 2, figsize=(10, 3.6))
    t = out["tiers"]
    names = list(t["ms"])
    a1.bar(names, [t["ms"][n] for n in names])
    a1.set(yscale="log", ylabel="ms (median)", title=f"load latency per tier ({t['adapter_mib']} MiB adapter)")
    a1.tick_params(axis="x", labelrotation=30)
    rows = out["zipf"]["rows"]
    S = [r["slots"] for r in rows]
    a2.plot(S, [r["hit_rate"] for r in rows], marker="o", label="LRU (measured, HotSet)")
    a2.plot(S, [r["static_top_s_hit_rate"] for r in rows], "k--", label="static top-S (IRM optimum)")
    a2.set(
        xscale="log",
        xticks=S,
        xticklabels=[str(x) for x in S],
        ylim=(0, 1.02),
        xlabel="slots",
        ylabel="hit rate",
        title=f"Zipf s={out['zipf']['s']}, {out['adapters']} adapters",
    )
    a2.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="molora bench hotset", description=__doc__.splitlines()[0])
    p.add_argument(
        "--model",
        choices=["smollm2", "tiny"],
        default="smollm2",
        help="base whose shapes the adapters take (default smollm2)",
    )
    p.add_argument("--adapters", type=int, default=16, help="adapters N (default 16)")
    p.add_argument("--rank", type=int, default=16, help="LoRA rank (default 16)")
    p.add_argument("--slots", type=int, nargs="+", default=[1, 2, 4, 8, 16], help="slot counts S to sweep")
    p.add_argument("--requests", type=int, default=2000, help="Zipf requests per S (default 2000; --quick 500)")
    p.add_argument("--zipf", type=float, default=1.1, help="Zipf exponent s (default 1.1)")
    p.add_argument("--repeats", type=int, default=20, help="timed repetitions per tier (default 20; --quick 5)")
    p.add_argument("--seed", type=int, default=0)
    t = p.add_argument_group("--traffic (molora.bench.hotset_traffic; --rank defaults to 8 there)")
    t.add_argument(
        "--traffic",
        action="store_true",
        help="Zipf traffic through the engine over --adapters adapters vs. the same traffic on one",
    )
    t.add_argument("--concurrency", type=int, default=16, help="requests in flight (default 16; --quick 4)")
    t.add_argument("--engine-slots", type=int, default=32, help="hot-set slots of the engine (default 32; --quick 8)")
    t.add_argument("--cpu-tier-mib", type=int, default=128, help="CPU tier budget in MiB (default 128; --quick 1)")
    t.add_argument(
        "--learned-share",
        type=float,
        default=0.5,
        help="share of requests learned per token with an allowed set of 2-4 (default 0.5; the rest are pinned)",
    )
    t.add_argument("--prompt-len", type=int, default=32)
    t.add_argument(
        "--max-num-batched-tokens",
        type=int,
        default=None,
        help="the engines' step budget (default: --concurrency + --prompt-len, every decode plus one prompt)",
    )
    t.add_argument("--new-tokens", type=int, default=32)
    t.add_argument(
        "--loader-nice-ab",
        action="store_true",
        help="add many_fcfs_nice10: many_fcfs with the adapter loader at nice +10 (MOLORA_LOADER_NICE=10)",
    )
    t.add_argument(
        "--gc-freeze-ab",
        action="store_true",
        help="add many_fcfs_nofreeze: many_fcfs without gc.freeze() once the engine is built (molora.engine.heap)",
    )
    add_common_args(p)
    a = p.parse_args(argv)
    if a.traffic:
        return _traffic(p, a, sys.argv[1:] if argv is None else argv)
    if a.adapters < 4:
        p.error("--adapters must be at least 4 (the tier timing cycles over more adapters than its 2 slots)")
    if a.quick:
        a.requests = min(a.requests, 500)
        a.repeats = min(a.repeats, 5)
    set_threads(a.threads)
    out = run(
        a.model, a.adapters, a.rank, a.repeats, [S for S in a.slots if S <= a.adapters], a.requests, a.zipf, a.seed
    )
    print(format_table(out))
    if a.plot:
        plot(out, a.plot)
    emit(out, a.json)
    return 0


def _traffic(p: argparse.ArgumentParser, a: argparse.Namespace, argv: list[str]) -> int:
    from molora.bench import hotset_traffic as ht

    given = lambda flag: any(x == flag or x.startswith(flag + "=") for x in argv)
    rank = a.rank if given("--rank") else 8
    requests = a.requests if given("--requests") else 400
    repeats = a.repeats if given("--repeats") else 1
    if a.quick:  # CI-sized: the tiny model, few adapters and requests, a CPU tier of about one adapter
        a.model = a.model if given("--model") else "tiny"
        a.adapters = a.adapters if given("--adapters") else 40
        requests = requests if given("--requests") else 24
        a.concurrency = a.concurrency if given("--concurrency") else 4
        a.engine_slots = a.engine_slots if given("--engine-slots") else 8
        a.cpu_tier_mib = a.cpu_tier_mib if given("--cpu-tier-mib") else 1
        a.new_tokens = a.new_tokens if given("--new-tokens") else 6
        a.prompt_len = a.prompt_len if given("--prompt-len") else 8
    if a.max_num_batched_tokens is not None and a.max_num_batched_tokens < 1:
        p.error("--max-num-batched-tokens must be at least 1")
    if a.adapters < 4 or requests < 1 or a.concurrency < 1 or a.engine_slots < 4:
        p.error(
            "--traffic needs --adapters >= 4, --requests >= 1, --concurrency >= 1 and --engine-slots >= 4 "
            "(a learned request's allowed set takes up to 4 slots)"
        )
    set_threads(a.threads)
    out = ht.run(
        a.model,
        a.adapters,
        rank,
        requests,
        a.zipf,
        a.learned_share,
        a.prompt_len,
        a.new_tokens,
        a.concurrency,
        a.engine_slots,
        a.cpu_tier_mib,
        repeats,
        a.seed,
        stderr_log,
        a.max_num_batched_tokens,
        a.loader_nice_ab,
        a.gc_freeze_ab,
    )
    out = {"command": "molora bench hotset " + " ".join(argv), **out}  # what reproduces the record
    print(ht.format_table(out))
    emit(out, a.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
