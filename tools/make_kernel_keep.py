"""The "Which kernels pay" section of docs/benchmarks.md from docs/kernel_keep_{fp32,bf16}.json (and _w8_<dtype>).

    python -m tools.make_kernel_keep          # prints the section (tools/make_benchmarks.py places it)

The records come from `tools/kernel_keep.py --dtype fp32|bf16 --json docs/kernel_keep_<dtype>.json` (the engine
bench with each C++ kernel family turned off, paired in one run; `--quantization int8 --arms w8 --json
docs/kernel_keep_w8_<dtype>.json`: the int8 kernels on an int8 base). `verdicts` applies the keep rule to them: a
family stays where turning it off makes some engine-bench workload at least `keep_at` (1.15x) slower in some dtype.
This script measures nothing.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DTYPES = ("fp32", "bf16")
WORKLOADS = ("generate_routed", "generate_base", "decode_step")


def records(docs: Path, prefix: str = "kernel_keep_") -> dict[str, dict]:
    """{dtype: record} of the kernel_keep records present under docs/ (docs/<prefix><dtype>.json)."""
    out = {}
    for d in DTYPES:
        path = docs / f"{prefix}{d}.json"
        if path.is_file():
            out[d] = json.loads(path.read_text(encoding="utf-8"))
    return out


def d_any(recs: dict[str, dict]) -> str:
    """One dtype of `recs` (the first)."""
    return next(iter(recs))


def verdicts(recs: dict[str, dict]) -> dict[str, tuple[float, str, bool]]:
    """{family: (its largest paired off/all median, "dtype workload" where, kept)} over the records; "none" (every
    kernel off) is not a family and is left out."""
    best: dict[str, tuple[float, str]] = {}
    for d, r in recs.items():
        for fam, per in r["off_over_all"].items():
            if fam == "none":
                continue
            for w, (med, _lo, _hi) in per.items():
                if fam not in best or med > best[fam][0]:
                    best[fam] = (med, f"{d} {w}")
    keep_at = min((r["keep_at"] for r in recs.values()), default=1.15)
    return {f: (v, where, v >= keep_at) for f, (v, where) in best.items()}


def section(docs: Path) -> list[str]:
    recs = records(docs)
    if not recs:
        return []
    first = next(iter(recs.values()))
    m = first["machine"]
    lines = [
        "## Which kernels pay",
        "",
        "Each of molora's C++ kernel families turned off on its own (`MOLORA_KERNELS_OFF`, what runs in its place: "
        "`molora.ops.kernel_build.FAMILIES`) on the engine bench's workloads "
        f"({first['requests']} requests x ({first['prompt_len']} prompt + {first['new_tokens']} new tokens), "
        "4 random adapters, vocab routing; `decode_step`: one step with every request decoding), one worker "
        f"process per arm, asked in turn, order rotated, {first['repeats']} repetitions; the cell is the median "
        "of the paired ratio (time with the family off / with every kernel on), quartiles in brackets. lora, "
        "glue and paged run inside the one-call block, so turning one off also turns the block off. **none**: "
        "every kernel off (torch ops, MKL's packed sgemm, the eager LoRA backends). The keep rule: a family "
        "stays where some workload runs at least 1.15x slower without it. "
        f"CPU: {m['cpu']}, {m['cores']} cores, {m['threads']} threads; "
        + "; ".join(
            f"{d}: `{r['command']}`, load average {r['machine']['loadavg_before']} before and "
            f"{r['machine']['loadavg_after']} after"
            for d, r in recs.items()
        )
        + ".",
        "",
        "| off | " + " | ".join(f"{d} {w}" for d in recs for w in WORKLOADS) + " |",
        "|---|" + "---:|" * (len(recs) * len(WORKLOADS)),
    ]
    fams = list(dict.fromkeys(f for r in recs.values() for f in r["off_over_all"]))
    for fam in fams:
        cells = []
        for r in recs.values():
            for w in WORKLOADS:
                v = r["off_over_all"].get(fam, {}).get(w)
                cells.append("-" if v is None else f"{v[0]:.2f}x [{v[1]:.2f}-{v[2]:.2f}]")
        lines.append(f"| {fam} | " + " | ".join(cells) + " |")
    lines += ["", "Verdicts (the largest of a family's medians):", ""]
    for fam, (v, where, kept) in verdicts(recs).items():
        lines.append(f"- {fam}: {v:.2f}x ({where}): {'kept' if kept else 'below 1.15x: deleted'}")
    same = {
        d: sorted(a for w, arms in r.get("same_tokens_as_all", {}).items() for a, ok in arms.items() if not ok)
        for d, r in recs.items()
    }
    loaded = records(docs, "kernel_keep_loaded_")
    if loaded:
        first_loaded = loaded[d_any(loaded)]
        gone = sorted(
            f
            for f, (_v, _w, kept) in verdicts(loaded).items()
            if not kept and f not in recs[d_any(recs)]["off_over_all"]
        )
        lines += [
            "",
            "Families deleted on an earlier run of the same script (records "
            + ", ".join(f"`docs/kernel_keep_loaded_{d}.json`" for d in loaded)
            + f", {first_loaded['repeats']} repetitions, {first_loaded['machine']['threads']} thread, "
            "a loaded machine: load average "
            + " and ".join(str(r["machine"]["loadavg_before"]) for r in loaded.values())
            + " before; made on commit 587958e, before the deletion):",
            "",
        ]
        for fam in gone:
            v, where, _kept = verdicts(loaded)[fam]
            cells = "; ".join(
                f"{d} " + ", ".join(f"{w} {r['off_over_all'][fam][w][0]:.2f}x" for w in WORKLOADS)
                for d, r in loaded.items()
            )
            lines.append(f"- {fam}: {cells}; largest {v:.2f}x ({where}): below 1.15x, deleted")
    lines += [
        "",
        "Greedy tokens against every kernel on (random adapters, so small float differences can flip a token): "
        + "; ".join(
            f"{d}: " + ("all the same" if not s else "differ with " + ", ".join(sorted(set(s))))
            for d, s in same.items()
        )
        + ".",
        "",
    ]
    return lines + avx2_lines(docs) + w8_lines(docs)


def avx2_lines(docs: Path) -> list[str]:
    """The same bench on a CPU without AVX-512, from docs/kernel_keep_fp32_avx2.json (no lines while none exists):
    why the panel GEMM runs only where its build has AVX-512 (`panels_fit`)."""
    path = docs / "kernel_keep_fp32_avx2.json"
    if not path.is_file():
        return []
    r = json.loads(path.read_text(encoding="utf-8"))
    m = r["machine"]
    cells = lambda fam: ", ".join(  # noqa: E731
        f"{w} {r['off_over_all'][fam][w][0]:.2f}x" for w in WORKLOADS if w in r["off_over_all"].get(fam, {})
    )
    return [
        f"On a CPU without AVX-512 ({m['cpu']}, flags {', '.join(m['cpu_flags'])}, {m['cores']} cores, "
        f"{m['threads']} threads; `{r['command']}`, load average {m['loadavg_before']} before and "
        f"{m['loadavg_after']} after), with every family built: panels off {cells('panels')}; every kernel off "
        f"{cells('none')} (the engine ran faster without them: the panel kernel's 8 x 48 register tile needs "
        "AVX-512's 32 vector registers and spills with AVX2's 16). The panel GEMM now runs only where it is built "
        "for AVX-512 (`panels_fit`); elsewhere float32 weights are packed for MKL's sgemm, as with the family off. "
        f"The other families there, against every kernel on: block {cells('block')}; lora {cells('lora')}; "
        f"glue {cells('glue')}; paged {cells('paged')}.",
        "",
    ]


def w8_lines(docs: Path) -> list[str]:
    """The int8 kernels' knob (family w8) on a weight-only int8 base, from docs/kernel_keep_w8_<dtype>.json (no
    lines while none exists)."""
    recs = records(docs, "kernel_keep_w8_")
    if not recs:
        return []
    lines = [
        "The weight-only int8 kernels (family `w8`: linear_w8 for float32 activations, linear_amx_w8 for bfloat16) "
        "on an int8 base (`--quantization int8`), turned off against every kernel on, the same workloads (off: "
        "torch's linear on the weight dequantized each call; the one-call block then runs kernel by kernel): "
        + "; ".join(
            f"{d}: `{r['command']}`, {r['machine']['threads']} thread(s), load average "
            f"{r['machine']['loadavg_before']} before and {r['machine']['loadavg_after']} after"
            for d, r in recs.items()
        )
        + ".",
        "",
        "| off | " + " | ".join(f"{d} {w}" for d in recs for w in WORKLOADS) + " |",
        "|---|" + "---:|" * (len(recs) * len(WORKLOADS)),
    ]
    cells = []
    for r in recs.values():
        for w in WORKLOADS:
            v = r["off_over_all"].get("w8", {}).get(w)
            cells.append("-" if v is None else f"{v[0]:.2f}x [{v[1]:.2f}-{v[2]:.2f}]")
    lines.append("| w8 | " + " | ".join(cells) + " |")
    v, where, kept = verdicts(recs)["w8"]
    same = "; ".join(
        f"{d}: greedy tokens "
        + ("the same" if all(a.get("w8", True) for a in r.get("same_tokens_as_all", {}).values()) else "differ")
        for d, r in recs.items()
    )
    lines += [
        "",
        f"Verdict: w8 {v:.2f}x ({where}): {'kept' if kept else 'below 1.15x'}. With it off, {same} (off, "
        "each weight is q * scale rounded in the activations' dtype before the product; the kernels multiply by q "
        "exactly and scale each output once).",
        "",
    ]
    return lines


def main() -> int:
    print("\n".join(section(ROOT / "docs")))
    return 0


if __name__ == "__main__":
    sys.exit(main())
