"""`molora bench model`'s output: the goals judged, the text table and the plot of time over the base per variant
and scenario, from the result dict `molora.bench.model.run` returns (and from a committed record: tools/
make_benchmarks.py renders the docs with `goals` and `scenario_ratio`)."""

from __future__ import annotations

from typing import Any

from molora.bench.common import paired_ratio, rounded

GOALS = {"prefill_vs_base": 1.15, "decode_b8_vs_base": 1.3, "xlora_over_molora": 2.0}


def scenario_ratio(s: dict, a: str, b: str) -> float:
    """a's time / b's in one scenario record (`_scenario`, a K-modality row): the paired median of its samples;
    a record made before the samples were kept: the ratio of its medians."""
    smp = s.get("samples_ms")
    return paired_ratio(smp[a], smp[b])[0] if smp else s["ms"][a] / s["ms"][b]


def goals(results: list[dict]) -> dict:
    """The issue's goals, judged per path on the largest model measured (they are stated for SmolLM2-135M);
    the decode goal at batch 8, or the smallest decode batch measured. `values` are ratios of medians,
    `values_min` the same ratios of minima, `values_paired` the median [and quartiles] of the ratios taken
    within each repetition (`common.paired_ratio`: the two runs side by side, under the same load). `met`
    judges the paired median: on a shared CPU another tenant's load moves whole stretches of a run, which
    shifts both series alike and cancels in the per-repetition ratio but not in a ratio of two medians."""
    r = next((x for x in results if x["model"] == "smollm2"), results[-1])
    rows: list[dict[str, Any]] = []

    def ratio(s: dict, a: str, b: str, stat: str) -> float:
        return round(s[stat][a] / s[stat][b], 4)

    def add(
        name: str, text: str, limit: float, pairs: dict[str, tuple[dict, str, str]], at_least: bool = False
    ) -> None:
        values = {k: ratio(s, a, b, "ms") for k, (s, a, b) in pairs.items()}
        values_min = {k: ratio(s, a, b, "ms_min") for k, (s, a, b) in pairs.items()}
        values_paired = {
            k: rounded(list(paired_ratio(s["samples_ms"][a], s["samples_ms"][b]))) for k, (s, a, b) in pairs.items()
        }
        met = {k: (v[0] >= limit if at_least else v[0] <= limit) for k, v in values_paired.items()}
        rows.append(
            {
                "name": name,
                "goal": text,
                "limit": limit,
                "values": values,
                "values_min": values_min,
                "values_paired": values_paired,
                "met": met,
            }
        )

    pre = r["prefill"]
    add(
        "prefill_vs_base",
        f"prefill {pre['batch']}x{pre['length']}: time / base <= {GOALS['prefill_vs_base']}",
        GOALS["prefill_vs_base"],
        {k: (pre, k, "base") for k in ("molora", "runner")},
    )
    decodes = sorted((x for x in r if x.startswith("decode_b")), key=lambda k: (k != "decode_b8", r[k]["batch"]))
    if decodes:
        d = r[decodes[0]]
        add(
            "decode_vs_base",
            f"decode step, batch {d['batch']}: time / base <= {GOALS['decode_b8_vs_base']}",
            GOALS["decode_b8_vs_base"],
            {k: (d, k, "base") for k in ("molora", "runner")},
        )
    if "xlora" in pre["ms"]:
        pairs = {"prefill": (pre, "xlora", "molora")}
        if decodes and "xlora_recompute" in r[decodes[0]]["ms"]:
            pairs[decodes[0]] = (r[decodes[0]], "xlora_recompute", "molora")
        add(
            "xlora_over_molora",
            f"X-LoRA time / molora time >= {GOALS['xlora_over_molora']} at K={r['adapters']}",
            GOALS["xlora_over_molora"],
            pairs,
            at_least=True,
        )
    return {"model": r["model"], "rows": rows}


def format_table(out: dict) -> str:
    lines = []
    for r in out["results"]:
        scen = [("prefill", r["prefill"])] + [(k, r[k]) for k in r if k.startswith("decode_b")]
        names = list(dict.fromkeys(n for _, s in scen for n in s["ms"]))
        lines.append(
            f"== {r['model']}  (LoRA MACs / base MACs per token: {r['flops']['lora_vs_base']:.3f}; "
            f"/ body without lm_head: {r['flops']['lora_vs_body']:.3f})"
        )
        lines.append(f"{'scenario':<12}" + "".join(f"{n:>17}" for n in names) + "   (ms, paired ratio to base)")
        for label, s in scen:
            cells = "".join(
                f"{s['ms'][n]:>9.2f} ({s['paired_vs_base'][n][0]:>4.2f}x)" if n in s["ms"] else f"{'-':>17}"
                for n in names
            )
            lines.append(f"{label:<12}{cells}")
        for row in r.get("kmodality", []):
            lines.append(
                f"K-modality K={row['K']}: per-token {row['ms']['per_token']:.1f} ms, per-sequence "
                f"{row['ms']['per_sequence']:.1f} ms: speedup {row['speedup']:.2f}x (limit {row['K']}x)"
            )
        if r["errors"]:
            lines.append(f"errors: {r['errors']}")
    for g in out["goals"]["rows"]:
        vals = ", ".join(
            f"{k} {v[0]:.2f} [{v[1]:.2f}-{v[2]:.2f}], medians {g['values'][k]:.2f} "
            f"({'met' if g['met'][k] else 'NOT met'})"
            for k, v in g["values_paired"].items()
        )
        lines.append(f"goal [{out['goals']['model']}] {g['goal']}: {vals}")
    return "\n".join(lines)


def plot(out: dict, path: str) -> None:
    """Time / base per variant and scenario (one panel per model, log scale), and the K-modality speedup."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    res = out["results"]
    kmod = [r for r in res if r.get("kmodality")]
    fig, axes = plt.subplots(1, len(res) + bool(kmod), figsize=(6 * len(res) + 4 * bool(kmod), 5), squeeze=False)
    top = 2.0  # linear scale clipped at 2x base, so 1.05x and 1.3x stay apart; taller bars carry their value
    for ax, r in zip(axes[0], res):
        scen = ["prefill"] + [k for k in r if k.startswith("decode_b")]
        names = list(dict.fromkeys(n for s in scen for n in r[s]["vs_base"]))
        width = 0.8 / len(names)
        for i, n in enumerate(names):
            xs = [j + i * width for j in range(len(scen))]
            ys = [scenario_ratio(r[s], n, "base") if n in r[s]["ms"] else float("nan") for s in scen]
            ax.bar(xs, [min(y, top) for y in ys], width, label=n)
            for x, y in zip(xs, ys):
                if y > top:
                    ax.text(x, top, f"{y:.1f}x", rotation=90, ha="center", va="top", fontsize=7, color="white")
        ax.axhline(1.0, color="k", lw=0.8)
        ax.set(
            ylim=(0, top),
            ylabel="time / base (median of per-repetition ratios)",
            title=f"{r['model']}",
            xticks=[j + 0.4 - width / 2 for j in range(len(scen))],
            xticklabels=scen,
        )
        ax.legend(fontsize=7, ncol=4, loc="upper center", bbox_to_anchor=(0.5, -0.1))
    if kmod:
        ax = axes[0][-1]
        for r in kmod:
            Ks = [row["K"] for row in r["kmodality"]]
            ax.plot(
                Ks,
                [scenario_ratio(row, "per_sequence", "per_token") for row in r["kmodality"]],
                marker="o",
                label=f"{r['model']} measured",
            )
        ax.plot(Ks, Ks, "k--", lw=0.8, label="K (the limit)")
        ax.set(
            xlabel="K modalities",
            ylabel="per-sequence (K passes) / per-token (1 pass)",
            title="K-modality workload",
            xticks=Ks,
        )
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
