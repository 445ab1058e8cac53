"""Render the quantized-base block of docs/benchmarks.md from its records (docs/quant.json, docs/quant_linear.json).

    python scripts/make_quant.py [--check]

docs/quant_linear.json comes from `scripts/ab_quant_linear.py --json docs/quant_linear.json` (the kernels on
SmolLM2-135M's linear shapes), docs/quant.json from `scripts/bench_quant.py --json docs/quant.json` (the engine on
the real model). This script measures nothing; --check says whether the page is stale.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PAGE = ROOT / "docs" / "benchmarks.md"


def kernel_table(rec: dict) -> list[str]:
    names = list(rec["results"][0]["ms"])
    head = (f"Kernels, {rec['layers']} layers x SmolLM2-135M's 7 linear shapes, {rec['threads']} thread(s), median ms "
            f"per pass of {rec['repeats']} interleaved repetitions (x: speed against `packed`, what the engine runs "
            "today; int8-wo: torch's weight-only int8 kernel; fbgemm-a8w8: FBGEMM's per-tensor dynamic linear):")
    out = [head, "", "| activations | T | " + " | ".join(names) + " |", "|---|---:|" + "---:|" * len(names)]
    for r in rec["results"]:
        cells = [f"{r['ms'][n]:.1f} ({r['vs_packed'][n]:.2f}x)" if n in r["ms"] else "-" for n in names]
        out.append(f"| {r['dtype']} | {r['T']} | " + " | ".join(cells) + " |")
    return out


def engine_table(rec: dict) -> list[str]:
    head = (f"Engine, `Engine.generate` over {rec['requests']} requests x ({rec['prompt_len']} prompt + "
            f"{rec['new_tokens']} new tokens), routing {rec['routing']}, medians of {rec['repeats']} interleaved "
            f"repetitions; weights: the base model's bytes against the {rec['gguf_bytes'] / 1e6:.1f} MB GGUF it ships "
            "as; greedy: the share of fp32's greedy tokens repeated before the first difference (random prompts):")
    out = [head, "", "| variant | s | tok/s | vs fp32 | weights MB | vs GGUF | greedy = fp32 |",
           "|---|---:|---:|---:|---:|---:|---:|"]
    for name, v in rec["variants"].items():
        agree = v.get("greedy_agreement_vs_fp32")
        out.append(f"| {name} | {v['s']:.2f} | {v['tok_s']:.1f} | {v['vs_fp32']:.2f}x | "
                   f"{v['weight_bytes_total'] / 1e6:.1f} | {v['weights_vs_gguf']:.2f}x | "
                   f"{'-' if agree is None else f'{agree:.2f}'} |")
    return out


def render() -> str:
    from molora.docblock import markers, wrap

    lin = json.loads((ROOT / "docs" / "quant_linear.json").read_text())
    eng = json.loads((ROOT / "docs" / "quant.json").read_text())
    m = eng["machine"]
    head = (f"Measured on {m['cpu']} ({', '.join(m['cpu_flags'] + m['int8_flags'])}), {m['cores']} cores shared "
            f"with other work (load average {m['loadavg_1_5_15']} at the engine run): read the ratios, not the "
            "absolute figures. int8 is W8A8 on FBGEMM (activations quantized per token); int4 is weight only on "
            "torch's kernel (molora.ops.quant).")
    body = [head, ""]
    body += engine_table(eng) + [""] + kernel_table(lin)
    begin, end = markers("quant", "scripts/make_quant.py")
    return wrap(begin, end, "\n".join(body))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--check", action="store_true", help="only say whether docs/benchmarks.md is stale")
    a = p.parse_args(argv)
    sys.path.insert(0, str(ROOT))
    from molora.docblock import markers, write_block

    begin, end = markers("quant", "scripts/make_quant.py")
    changed = write_block(PAGE, begin, end, render(), check=a.check)
    print(f"{PAGE.relative_to(ROOT)}: {'stale' if a.check and changed else 'changed' if changed else 'up to date'}")
    return 1 if a.check and changed else 0


if __name__ == "__main__":
    raise SystemExit(main())
