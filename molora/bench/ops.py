"""Micro-benchmark of the per-token LoRA dispatch backends (`molora.ops`) against simple baselines.

Owns the timing loop, the table, the JSON line and the plot for `molora bench ops`. Knows nothing
about models or adapters: it builds random stacked slot tensors and random routings.

For every (T tokens, K adapters, r rank) it times, interleaved within each repetition (medians, ms):
  sort_group, stacked_mask, gather (compiled), fused (C++, where it builds and runs: fp32, top-1), auto
             the dispatch backends (reference is too slow)
  single     all tokens on one adapter: y += scale0 * (x @ A0.T) @ B0.T, what per-request serving runs
  kpass      per-sequence routing emulated: the full single-adapter LoRA K times over all T tokens
  base       the dense base linear x @ W.T, W [d_out, d_in], to put the LoRA overhead in proportion
  plan       checking and grouping the routing (`LoRADispatcher.plan`): paid once per step and shared by
             every routed linear (once per block with a learned router: 7 linears in a Llama block)
and reports each backend's ratio to single, to kpass and to base. Every LoRA variant adds its delta into
a preallocated output and each backend reuses one plan, as inside a model's linear (`_variant_fns`).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence

import torch
from torch import Tensor

from molora.bench.common import Timing, add_common_args, emit, machine_info, set_threads, time_interleaved
from molora.ops import LoRADispatcher
from molora.ops.dispatch import cost_features

VARIANTS_OPS: tuple[str, ...] = ("sort_group", "stacked_mask", "gather", "fused", "auto")
VARIANTS_BASE: tuple[str, ...] = ("single", "kpass", "base", "plan")


def _inputs(T: int, K: int, r: int, d: int, d_out: int, top_k: int, dtype: torch.dtype, seed: int) -> dict:
    """Random x [T, d], A [K, r, d], B [K, d_out, r], scale [K], slot_ids [T, top_k], W [d_out, d].
    B is laid out as the bank keeps it (`LoRASlots`): a transposed view of a contiguous [K, r, d_out]."""
    g = torch.Generator().manual_seed(seed)
    rand = lambda *shape: (torch.randn(*shape, generator=g) * 0.05).to(dtype)  # noqa: E731
    ids = torch.randint(0, K, (T, top_k), generator=g)
    weights = torch.softmax(torch.randn(T, top_k, generator=g), -1).to(dtype) if top_k > 1 else None
    return dict(
        x=rand(T, d),
        A=rand(K, r, d),
        B=rand(K, r, d_out).transpose(1, 2),
        scale=torch.full((K,), 2.0),
        slot_ids=ids,
        weights=weights,
        W=rand(d_out, d),
    )


def _variant_fns(inp: dict, variants: Sequence[str]) -> dict[str, Callable[[], Tensor]]:
    """Each LoRA variant adds its delta into one preallocated output y [T, d_out], as a model's linear adds
    it into the base output (RoutedLoRALinear passes out=y; a per-request server adds its one adapter's
    delta the same way): no variant pays for allocating or zeroing its result. Each dispatch backend applies
    one plan built here, as the routed linears of a step share the step's plan; `plan` times building it."""
    x, A, B, scale, ids, w = (inp[k] for k in ("x", "A", "B", "scale", "slot_ids", "weights"))
    K = A.shape[0]
    y = x.new_zeros(x.shape[0], B.shape[1])
    s0 = float(scale[0])
    planner = LoRADispatcher("auto")

    def kpass() -> Tensor:  # K full passes; each keeps the tokens of its adapter (K*N work)
        for s in range(K):
            keep = (ids[:, 0] == s).to(x.dtype)[:, None]
            y.addmm_((x @ A[s].t()) * keep, B[s].t(), alpha=float(scale[s]))
        return y

    fns: dict[str, Callable[[], Tensor]] = {
        "single": lambda: y.addmm_(x @ A[0].t(), B[0].t(), alpha=s0),
        "kpass": kpass,
        "base": lambda: x @ inp["W"].t(),
        "plan": lambda: planner.plan(ids, w, num_slots=K).groups().tok,
    }
    for name in VARIANTS_OPS:
        d = LoRADispatcher(name)
        plan = d.plan(ids, w, num_slots=K)
        fns[name] = lambda d=d, plan=plan: d.apply(plan, x, A, B, scale, out=y)
    return {k: fns[k] for k in variants}


def bench_ops(
    Ts: Sequence[int] = (1, 8, 64, 512, 4096),
    Ks: Sequence[int] = (1, 2, 4, 8, 16),
    ranks: Sequence[int] = (8, 16, 64),
    d: int = 1024,
    repeats: int = 10,
    *,
    d_out: int | None = None,
    top_k: int = 1,
    dtype: torch.dtype = torch.float32,
    gather: bool = True,
) -> list[dict]:
    """One row per (T, K, r): median ms of every variant plus ratios. gather=False skips the compiled
    backend (its first call compiles, ~25 s on 2 CPU cores)."""
    d_out = d if d_out is None else d_out
    from molora.ops import fused_cpu

    fused = top_k == 1 and dtype in (torch.float32, torch.bfloat16) and fused_cpu.available()
    variants = [v for v in VARIANTS_OPS if (gather or v != "gather") and (fused or v != "fused")] + list(VARIANTS_BASE)
    rows = []
    with torch.inference_mode():
        for T in Ts:
            for K in Ks:
                for r in ranks:
                    inp = _inputs(T, K, r, d, d_out, top_k, dtype, seed=T * 1000 + K * 10 + r)
                    t = time_interleaved(_variant_fns(inp, variants), repeats, warmup=2)
                    rows.append(
                        _row(T, K, r, d, d_out, top_k, dtype, t.median)
                        | {"ms_min": _round(t.min)}
                        | _paired(t)
                        | {"auto_backend": _auto_backend(inp)}
                    )
    return rows


def _auto_backend(inp: dict) -> str:
    """The backend "auto" resolves to for these inputs (as the timed auto variant, adding into an output)."""
    d = LoRADispatcher("auto")
    plan = d.plan(inp["slot_ids"], inp["weights"], num_slots=inp["A"].shape[0])
    out = inp["x"].new_zeros(inp["x"].shape[0], inp["B"].shape[1])
    return d.backend_for(plan, inp["x"], inp["A"], inp["B"], inp["scale"], out)


def _paired(t: Timing) -> dict:
    """auto's per-repetition ratios to single and to kpass: [median, lower, upper quartile]
    (`molora.bench.common.paired_ratio`)."""
    return {
        f"paired_vs_{ref}": {"auto": [round(v, 4) for v in t.paired("auto", ref)]}
        for ref in ("single", "kpass")
        if "auto" in t.samples and ref in t.samples
    }


def _round(ms: dict[str, float]) -> dict[str, float]:
    return {k: round(v, 4) for k, v in ms.items()}


def _row(T: int, K: int, r: int, d: int, d_out: int, top_k: int, dtype: torch.dtype, ms: dict) -> dict:
    row: dict = dict(
        T=T,
        K=K,
        r=r,
        d=d,
        d_out=d_out,
        top_k=top_k,
        dtype=str(dtype).removeprefix("torch."),
        threads=torch.get_num_threads(),
        ms=_round(ms),
    )
    ops = [v for v in VARIANTS_OPS if v in ms]
    row["vs_single"] = {v: round(ms[v] / ms["single"], 3) for v in ops}
    row["vs_kpass"] = {v: round(ms[v] / ms["kpass"], 3) for v in ops}
    row["vs_base"] = {v: round(ms[v] / ms["base"], 3) for v in ops + ["single"]}
    row["fastest"] = min((v for v in ops if v != "auto"), key=ms.__getitem__)
    return row


def format_table(rows: list[dict], stat: str = "ms") -> str:
    """Fixed-width text table: ms per variant (stat "ms": medians, "ms_min": minima), then auto's ratios."""
    names = [v for v in VARIANTS_OPS + VARIANTS_BASE if rows and v in rows[0]["ms"]]
    head = f"{'T':>5} {'K':>3} {'r':>3} " + " ".join(f"{n:>12}" for n in names)
    head += f" {'auto/single':>11} {'auto/kpass':>10} {'auto/base':>9}  fastest"
    lines = [head, "-" * len(head)]
    for row in rows:
        ms = row[stat]
        cells = " ".join(f"{ms[n]:>12.3f}" for n in names)
        fastest = min((v for v in VARIANTS_OPS if v in ms and v != "auto"), key=ms.__getitem__)
        lines.append(
            f"{row['T']:>5} {row['K']:>3} {row['r']:>3} {cells} {ms['auto'] / ms['single']:>11.2f} "
            f"{ms['auto'] / ms['kpass']:>10.2f} {ms['auto'] / ms['base']:>9.2f}  {fastest}"
        )
    return "\n".join(lines)


def _nnls(X: Tensor, y: Tensor) -> Tensor:
    """Least squares with non-negative coefficients (active set: drop the most negative term, refit)."""
    active = list(range(X.shape[1]))
    while True:
        c = torch.linalg.lstsq(X[:, active], y[:, None]).solution[:, 0]
        if (c >= 0).all():
            out = torch.zeros(X.shape[1], dtype=X.dtype)
            out[active] = c
            return out
        active.pop(int(c.argmin()))


def fit_cost_model(rows: list[dict], stat: str = "ms_min") -> dict[str, list[float]]:
    """Refit the coefficients (us) of the "auto" cost model (molora.ops.dispatch.STACKED_US, SORTED_US)
    to these rows, minimizing relative error; one refit drops points > 60% off (other jobs' noise)."""
    coef = {}
    for backend in ("stacked_mask", "sort_group"):
        X = torch.tensor(
            [cost_features(backend, r["T"], r["K"], r["top_k"], r["r"], r["d"] + r["d_out"]) for r in rows],
            dtype=torch.float64,
        )
        y = torch.tensor([r[stat][backend] * 1e3 for r in rows], dtype=torch.float64)  # us
        keep = torch.ones_like(y, dtype=torch.bool)
        for _ in range(2):
            c = _nnls(X[keep] / y[keep, None], torch.ones(int(keep.sum()), dtype=torch.float64))
            keep = ((X @ c) / y - 1).abs() < 0.6
        coef[backend] = [round(v, 2) for v in c.tolist()]
    return coef


def auto_regret(rows: list[dict], stat: str = "ms_min") -> tuple[float, float]:
    """(mean, max) of auto's time over the faster of sort_group and stacked_mask."""
    ratios = [r[stat]["auto"] / min(r[stat]["sort_group"], r[stat]["stacked_mask"]) for r in rows]
    return sum(ratios) / len(ratios), max(ratios)


def plot(rows: list[dict], path: str, stat: str = "ms") -> None:
    """time / single-adapter time vs T per backend, one panel per K (the middle rank of the run)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ranks = sorted({row["r"] for row in rows})
    r = ranks[len(ranks) // 2]
    Ks = sorted({row["K"] for row in rows})
    fig, axes = plt.subplots(1, len(Ks), figsize=(4 * len(Ks), 3.5), squeeze=False, sharey=True)
    for ax, K in zip(axes[0], Ks):
        sel = sorted((row for row in rows if row["K"] == K and row["r"] == r), key=lambda row: row["T"])
        for v in list(sel[0]["vs_single"]) + ["kpass"]:
            ys = [row[stat][v] / row[stat]["single"] for row in sel]
            ax.plot([row["T"] for row in sel], ys, marker="o", label=v)
        ax.set(xscale="log", yscale="log", title=f"K={K}, r={r}, d={sel[0]['d']}", xlabel="T tokens")
    axes[0][0].set_ylabel("time / single-adapter LoRA")
    axes[0][-1].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="molora bench ops", description=__doc__.splitlines()[0])
    add_common_args(p, threads_default=0)  # --json, --plot, --quick (T in 1,64,512,4096; K in 1,4; r=16; no gather)
    p.add_argument("--Ts", type=int, nargs="+", default=[1, 8, 64, 512, 4096], help="token counts T")
    p.add_argument("--Ks", type=int, nargs="+", default=[1, 2, 4, 8, 16], help="adapter (slot) counts K")
    p.add_argument("--ranks", type=int, nargs="+", default=[8, 16, 64], help="LoRA ranks r")
    p.add_argument("--d", type=int, default=1024, help="hidden size d_in")
    p.add_argument("--d-out", type=int, default=None, help="output size d_out (default: d)")
    p.add_argument("--top-k", type=int, default=1, help="choices per token (2: weighted top-2)")
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    p.add_argument(
        "--repeats", type=int, default=None, help="timed repetitions (medians reported; default 10, --quick: 5)"
    )
    p.add_argument(
        "--stat",
        choices=["median", "min"],
        default="median",
        help="statistic in the table (min resists noise from other jobs on a shared CPU)",
    )
    p.add_argument("--skip-gather", action="store_true", help="skip the compiled gather backend")
    p.add_argument("--fit", action="store_true", help="refit the auto rule's cost model to this run")
    a = p.parse_args(argv)
    set_threads(a.threads)
    if a.quick:
        a.Ts, a.Ks, a.ranks, a.skip_gather = [1, 64, 512, 4096], [1, 4], [16], True
    if a.repeats is None:
        a.repeats = 5 if a.quick else 10
    rows = bench_ops(
        a.Ts,
        a.Ks,
        a.ranks,
        a.d,
        a.repeats,
        d_out=a.d_out,
        top_k=a.top_k,
        dtype=getattr(torch, a.dtype),
        gather=not a.skip_gather,
    )
    stat = "ms" if a.stat == "median" else "ms_min"
    print(format_table(rows, stat))
    if a.fit:
        coef = fit_cost_model(rows, stat)
        print(
            f"fitted STACKED_US = {tuple(coef['stacked_mask'])}, SORTED_US = {tuple(coef['sort_group'])}; "
            "auto / faster eager backend: mean %.3f, max %.2f" % auto_regret(rows, stat)
        )
    if a.plot:
        plot(rows, a.plot, stat)
    emit({"bench": "ops", "machine": machine_info(), "repeats": a.repeats, "rows": rows}, a.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
