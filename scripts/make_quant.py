"""The quantized-base section of docs/benchmarks.md from its records (docs/quant.json, docs/quant_linear.json).

    python scripts/make_quant.py [--check]       # = scripts/make_benchmarks.py --render-only (or --check)

docs/quant_linear.json comes from `scripts/ab_quant_linear.py --json docs/quant_linear.json` (the kernels on
SmolLM2-135M's linear shapes), docs/quant.json from `scripts/bench_quant.py --json docs/quant.json` (the engine on
the real model). `section` renders the lines; scripts/make_benchmarks.py, which renders the whole page, places them.
This script measures nothing.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def kernel_table(rec: dict) -> list[str]:
    names = list(rec["results"][0]["ms"])
    head = (
        f"Kernels, {rec['layers']} layers x SmolLM2-135M's 7 linear shapes, {rec['threads']} thread(s), median ms "
        f"per pass of {rec['repeats']} interleaved repetitions (x: speed against `packed`, what the engine runs "
        "today; int8-wo: torch's weight-only int8 kernel; fbgemm-a8w8: FBGEMM's per-tensor dynamic linear):"
    )
    out = [head, "", "| activations | T | " + " | ".join(names) + " |", "|---|---:|" + "---:|" * len(names)]
    for r in rec["results"]:
        cells = [f"{r['ms'][n]:.1f} ({r['vs_packed'][n]:.2f}x)" if n in r["ms"] else "-" for n in names]
        out.append(f"| {r['dtype']} | {r['T']} | " + " | ".join(cells) + " |")
    return out


def engine_table(rec: dict) -> list[str]:
    head = (
        f"Engine, `Engine.generate` over {rec['requests']} requests x ({rec['prompt_len']} prompt + "
        f"{rec['new_tokens']} new tokens), routing {rec['routing']}, medians of {rec['repeats']} interleaved "
        f"repetitions; weights: the base model's bytes against the {rec['gguf_bytes'] / 1e6:.1f} MB GGUF it ships "
        "as; greedy: the share of fp32's greedy tokens repeated before the first difference (random prompts):"
    )
    out = [
        head,
        "",
        "| variant | s | tok/s | vs fp32 | weights MB | vs GGUF | greedy = fp32 |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for name, v in rec["variants"].items():
        agree = v.get("greedy_agreement_vs_fp32")
        out.append(
            f"| {name} | {v['s']:.2f} | {v['tok_s']:.1f} | {v['vs_fp32']:.2f}x | "
            f"{v['weight_bytes_total'] / 1e6:.1f} | {v['weights_vs_gguf']:.2f}x | "
            f"{'-' if agree is None else f'{agree:.2f}'} |"
        )
    return out


def section(docs: Path) -> list[str]:
    """The "Quantized base" section of docs/benchmarks.md from docs/quant.json and docs/quant_linear.json (no lines
    while either record is missing). scripts/make_benchmarks.py places it on the page it renders."""
    if not ((docs / "quant.json").is_file() and (docs / "quant_linear.json").is_file()):
        return []
    lin = json.loads((docs / "quant_linear.json").read_text())
    eng = json.loads((docs / "quant.json").read_text())
    m = eng["machine"]
    head = (
        f"Measured on {m['cpu']} ({', '.join(m['cpu_flags'] + m['int8_flags'])}), {m['cores']} cores shared "
        f"with other work (load average {m['loadavg_1_5_15']} at the engine run), {m['threads']} thread(s): read "
        "the ratios, not the absolute figures. int8 is W8A8 on FBGEMM (weights per output channel, activations "
        "quantized per token); int4 is weight only on torch's kernel, groups of 32 (molora.ops.quant). Records: "
        "`scripts/bench_quant.py --json docs/quant.json`, `scripts/ab_quant_linear.py --json "
        "docs/quant_linear.json`; rendered by `scripts/make_quant.py`."
    )
    return [
        "## Quantized base (`--quantization int8|int4`)",
        "",
        head,
        "",
        *engine_table(eng),
        "",
        *kernel_table(lin),
        "",
        *quality_lines(docs),
    ]


def quality_lines(docs: Path) -> list[str]:
    """One paragraph from docs/quant_quality.json (scripts/quant_quality.py), when it exists."""
    path = docs / "quant_quality.json"
    if not path.is_file():
        return []
    q = json.loads(path.read_text())
    parts = [
        f"{name}: {v['same_answer_as_fp32']:.0%} the same answer as fp32, {v['correct']} correct"
        for name, v in q["schemes"].items()
    ]
    return [
        f"Quality spot check (`scripts/quant_quality.py --json docs/quant_quality.json`): the default bundle, "
        f"its own routing, greedy, on {q['items']} validation items ({q['per_skill']} per skill of "
        f"{', '.join(q['tasks'])}); fp32 {q['fp32_correct']} correct; " + "; ".join(parts) + ". Not the skill "
        "and general-retention re-measurement issue 38 asks for (validation, then test once).",
        "",
    ]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--check", action="store_true", help="only say whether docs/benchmarks.md is stale")
    a = p.parse_args(argv)
    sys.path.insert(0, str(ROOT / "scripts"))
    import make_benchmarks

    return make_benchmarks.main(["--check"] if a.check else ["--render-only"])


if __name__ == "__main__":
    raise SystemExit(main())
